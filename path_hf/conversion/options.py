# Copyright 2026 The path-hf authors. Apache-2.0.
"""`ConvertOptions`: every option of `path-hf convert`, typed and documented once; the CLI flags are built from it."""

from __future__ import annotations

import re
from dataclasses import dataclass, field, fields
from typing import Any

from transformers.utils.hub import convert_file_size_to_int

from .. import PaTHLlamaConfig
from ..arguments import DTYPES, check_choices, flag
from ..configuration_path_llama import PATH_INITS, ROPE_MODES, check_path_fields, field_help
from ..errors import ConversionError
from ..evaluation.retrieval_heads import RETRIEVAL_DEPTHS, RETRIEVAL_TRIALS

# --verify: the largest max |logits - source logits| / std(source logits), both models in float64 with the
# transforms at identity. Rounding gives ~1e-14 (SmolLM2); one tensor perturbed by 1e-3 of its RMS gives 3e-4 to
# 5e-3, a misplaced one 1 to 10 (conversion/README.md).
VERIFY_TOLERANCE = 1e-6
_DEFAULT_SHARD_SIZE = "5GB"
# `--retrieval-layers`: the longest default length of its passkey prompts (a forward pass each, on the whole source).
RETRIEVAL_LENGTH = 8192
# `--rope-max-wavelength context`: the source's own training context (`plan.source_context`).
CONTEXT = "context"
# Options of running the command rather than of the checkpoint it writes: a recipe's `model.convert` cannot set them.
RUN_OPTIONS = ("source", "output", "dry_run", "verify", "force", "debug")
# Options left out of the conversion record (`config.path_conversion`): those, and where the source comes from and how
# it is read, which is recorded on its own.
UNRECORDED_OPTIONS = (*RUN_OPTIONS, "revision", "gguf_file", "follow_symlinks")


def parse_layers(spec: str) -> tuple[int, ...]:
    """`"0-11,20"` -> `(0, 1, ..., 11, 20)`: comma-separated indices and inclusive ranges; `"none"` -> `()` (no PaTH
    layer: with `--local-window`, every layer local, StreamingLLM's windowed source)."""
    if spec.strip().lower() == "none":
        return ()
    layers: set[int] = set()
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)\s*(?:-\s*(\d+)\s*)?", part)
        if not found:
            raise ValueError(f"{spec!r} is not a list of layer indices and ranges such as 0-11,20")
        first, last = int(found[1]), int(found[2] or found[1])
        if last < first:
            raise ValueError(f"range {part.strip()!r} ends before it starts")
        layers.update(range(first, last + 1))
    return tuple(sorted(layers))


def parse_heads(spec: str) -> tuple[tuple[int, int], ...]:
    """`"3:0,7:5"` -> `((3, 0), (7, 5))`: `layer:head` pairs of query heads, sorted."""
    heads = set()
    for part in spec.split(","):
        found = re.fullmatch(r"\s*(\d+)\s*:\s*(\d+)\s*", part)
        if not found:
            raise ValueError(f"{spec!r} is not a list of layer:head pairs such as 3:0,7:5")
        heads.add((int(found[1]), int(found[2])))
    return tuple(sorted(heads))


def format_heads(heads) -> str:
    """`((3, 0), (7, 5))` -> `"3:0,7:5"`: the inverse of `parse_heads`."""
    return ",".join(f"{layer}:{head}" for layer, head in sorted(map(tuple, heads)))


def format_layers(layers) -> str:
    """`(0, 1, 2, 5)` -> `"0-2,5"`, `()` -> `"none"`: the inverse of `parse_layers`."""
    if not layers:
        return "none"
    runs: list[list[int]] = []
    for layer in sorted(layers):
        if runs and layer == runs[-1][1] + 1:
            runs[-1][1] = layer
        else:
            runs.append([layer, layer])
    return ",".join(str(first) if first == last else f"{first}-{last}" for first, last in runs)


def parse_size(size: str) -> int:
    """`"5GB"`, `"500MiB"` or a number of bytes -> bytes."""
    return int(size) if size.isdigit() else convert_file_size_to_int(size)


def check_wavelength(value) -> float | str | None:
    """The value of `--rope-max-wavelength` (a flag's text, or a recipe's number or word): a number of tokens as a
    float, `CONTEXT`, or None; anything else raises `ConversionError`. Whether the number is in range is the config's
    check (`check_path_fields`), as for every config field."""
    if value is None:
        return None
    if isinstance(value, str):
        text = value.strip()
        if text.lower() == CONTEXT:
            return CONTEXT
        try:
            value = float(text)
        except ValueError:
            value = text
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConversionError(
            f"--rope-max-wavelength must be a number of tokens or {CONTEXT!r} (the source's training context), got "
            f"{value!r}."
        )
    return float(value)  # its range is checked with the config's other fields (`check_path_fields`)


def format_size(nbytes: int) -> str:
    """Bytes as the converter prints them: `3_850_000_000` -> `"3.85 GB"` (decimal units, as `parse_size` reads)."""
    for unit in ("B", "KB", "MB", "GB"):
        if nbytes < 1000 or unit == "GB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.2f} {unit}"
        nbytes /= 1000
    raise AssertionError  # unreachable


def config_option(config_field: str, *, notation: str = "", metadata: dict | None = None) -> Any:
    """A `ConvertOptions` field that sets the converted model's `PaTHLlamaConfig.<config_field>`: its default is the
    config's, its help the config's documentation of the field (`field_help`, after the flag's own `notation` where
    it has one), and `ConvertOptions.config_fields` hands its value to the config under the config's name."""
    default = getattr(PaTHLlamaConfig, config_field)
    help_text = f"sets {config_field}: " + field_help(config_field).replace("%", "%%")
    if notation:
        help_text += f" On the command line: {notation}"
    if default is not None and not isinstance(default, bool):
        help_text += " (default: %(default)s)"
    metadata = {"config": config_field, "help": help_text, **(metadata or {})}
    return field(default=default, metadata=metadata)


@dataclass(kw_only=True)
class ConvertOptions:
    """Options of `path-hf convert`. Each field is one command-line flag (`--field-name` unless `flag` says
    otherwise; `path_hf.arguments`) and one key of a recipe's `model.convert`; its `help` is the flag's
    documentation. A field that sets a `PaTHLlamaConfig` field is a `config_option`: default, help and checks are the
    config's."""

    source: str = field(
        metadata={"flag": "--from", "metavar": "SRC", "help": "local directory, hub id, or llama.cpp .gguf file"}
    )
    output: str = field(metadata={"flag": "--to", "metavar": "DST", "help": "output directory"})
    revision: str | None = field(default=None, metadata={"help": "branch, tag or commit of a hub SRC (default: main)"})
    gguf_file: str | None = field(
        default=None,
        metadata={
            "metavar": "NAME",
            "help": "the GGUF file in the directory SRC to convert (Llama, Qwen2, Qwen3; dequantised whole to "
            "--dtype, float32 by default)",
        },
    )
    rope: str = config_option("rope_mode", metadata={"choices": ROPE_MODES})
    rope_max_wavelength: float | str | None = config_option(
        "rope_max_wavelength",
        notation=f"a number of tokens, or {CONTEXT!r}: the source's training context (original_max_position_embeddings "
        "of its RoPE parameters, else max_position_embeddings).",
        metadata={"parse": str, "metavar": "TOKENS"},  # a number or the word `context`: `check_wavelength`
    )
    attn_temperature_scale: float = config_option("path_attn_temperature_scale", metadata={"metavar": "S"})
    attn_temperature_length: int | None = config_option("path_attn_temperature_length", metadata={"metavar": "L"})
    forget_gate: bool = config_option("path_forget_gate")
    forget_gate_bias: float = config_option("path_forget_gate_bias", metadata={"metavar": "B"})
    layers: tuple[int, ...] | None = config_option(
        "path_layers",
        notation="indices and inclusive ranges, e.g. 0-11,20.",
        metadata={"parse": parse_layers, "metavar": "LIST"},
    )
    retrieval_layers: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": "instead of --layers: make the N layers where the source retrieves from far back the PaTH layers, "
            "measured before converting (path_hf.evaluation.retrieval_heads: the source runs on passkey prompts of "
            "--retrieval-length tokens, and the layers whose strongest head puts the most attention on the passkey "
            "when the key is written are kept). Load the whole source, one forward pass a prompt "
            f"({RETRIEVAL_TRIALS * len(RETRIEVAL_DEPTHS)} prompts). With "
            "--local-window the other layers become local: the hybrid retrieves past its window only through these",
        },
    )
    retrieval_length: int | None = field(
        default=None,
        metadata={
            "metavar": "TOKENS",
            "help": "the passkey prompts' length of --retrieval-layers; the needles sit "
            + " and ".join(f"{1 - depth:.0%}".replace("%", "%%") for depth in RETRIEVAL_DEPTHS)
            + f" of it back (default: the source's training context, at most {RETRIEVAL_LENGTH})",
        },
    )
    local_window: int | None = config_option("local_window", metadata={"metavar": "W"})
    local_sinks: int = config_option("local_sinks", metadata={"metavar": "N"})
    local_full_heads: tuple[tuple[int, int], ...] | None = config_option(
        "local_full_heads",
        notation="layer:head pairs, e.g. 3:0,7:5.",
        metadata={"parse": parse_heads, "metavar": "LIST"},
    )
    full_heads: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": "instead of --local-full-heads: keep the N query heads of the local layers that retrieve from far "
            "back as full heads, measured before converting as --retrieval-layers measures layers (each head's "
            "attention on a passkey when the key is written). Needs --local-window",
        },
    )
    w_rank: int | None = config_option("path_w_rank", metadata={"metavar": "R"})
    conv_size: int = config_option("path_conv_size", metadata={"metavar": "K"})
    init: str = config_option("path_init", metadata={"choices": PATH_INITS})
    seed: int = field(default=0, metadata={"help": "seed of the new parameters' init (default: %(default)s)"})
    dtype: str | None = field(
        default=None,
        metadata={
            "choices": DTYPES,
            "help": "cast floating-point tensors to this dtype (default: keep the source's; float32 for a GGUF)",
        },
    )
    max_shard_size: int = field(
        default=parse_size(_DEFAULT_SHARD_SIZE),
        metadata={
            "parse": parse_size,
            "metavar": "SIZE",
            "help": f"largest output shard, e.g. 5GB, 500MiB (default: {_DEFAULT_SHARD_SIZE})",
        },
    )
    allow_torch_only_head_dim: bool = field(
        default=False,
        metadata={"help": "convert a model whose head dim FLA's kernel cannot run; the torch backend runs any"},
    )
    allow_nonfinite: bool = field(
        default=False,
        metadata={
            "help": "convert weights that hold NaN or Inf (or become Inf when cast to --dtype) as they are, naming "
            "them in a warning; by default the first such tensor stops the conversion"
        },
    )
    follow_symlinks: bool = field(
        default=False,
        metadata={
            "help": "read and copy files of SRC that are links to files outside it (named in the output); by default "
            "such links are refused. A hub snapshot's links into its cache are always followed"
        },
    )
    dry_run: bool = field(
        default=False,
        metadata={"help": "print the plan (architecture, layers converted, parameters added, bytes) and write nothing"},
    )
    verify: bool = field(
        default=False,
        metadata={
            "help": "check the converted model against the source before it is moved into place: both run in float64, "
            "the converted one with RoPE kept and the transforms at identity, and max |logits - source logits| / "
            f"std(source logits) must be at most {VERIFY_TOLERANCE:g}; prints both perplexities. With "
            "--rope-max-wavelength or --attn-temperature-scale the reference is the source (transformers' model) with "
            "the same RoPE pairs at frequency 0 and the same query temperature, applied by hand"
        },
    )
    force: bool = field(
        default=False,
        metadata={
            "help": "replace DST if it holds a model (a config.json or weights); a folder that is not a model's, the "
            "current or home directory and a file are never replaced"
        },
    )
    debug: bool = field(default=False, metadata={"help": "print the traceback of an error"})

    def __post_init__(self):
        check_choices(self, ConversionError)
        if self.dry_run and self.verify:
            raise ConversionError("--verify checks written files; it cannot run with --dry-run.")
        if self.forget_gate_bias != PaTHLlamaConfig.path_forget_gate_bias and not self.forget_gate:
            raise ConversionError("--forget-gate-bias sets the forget gate's init: it needs --forget-gate.")
        if self.retrieval_layers is not None:
            if self.layers is not None:
                raise ConversionError(
                    "--layers names the PaTH layers and --retrieval-layers measures them: give one of the two."
                )
            if isinstance(self.retrieval_layers, bool) or self.retrieval_layers < 1:
                raise ConversionError(
                    f"--retrieval-layers must be a positive number of layers, got {self.retrieval_layers}."
                )
        if self.full_heads is not None:
            if self.local_full_heads is not None:
                raise ConversionError(
                    "--local-full-heads names the full heads and --full-heads measures them: give one of the two."
                )
            if isinstance(self.full_heads, bool) or self.full_heads < 1:
                raise ConversionError(f"--full-heads must be a positive number of heads, got {self.full_heads}.")
            if self.local_window is None:
                raise ConversionError("--full-heads keeps heads of the local layers whole: it needs --local-window.")
        if self.local_full_heads is not None and self.local_window is None:
            raise ConversionError("--local-full-heads are heads of the local layers: it needs --local-window.")
        if self.retrieval_length is not None:
            if self.retrieval_layers is None and self.full_heads is None:
                raise ConversionError(
                    "--retrieval-length is the prompts' length of --retrieval-layers and --full-heads: it needs one."
                )
            if self.retrieval_length < 1:
                raise ConversionError(
                    f"--retrieval-length must be a positive number of tokens, got {self.retrieval_length}."
                )
        if not 0 <= self.seed < 2**63:
            raise ConversionError(f"--seed must be an integer from 0 to 2**63 - 1 (torch's seeds), got {self.seed}.")
        self.rope_max_wavelength = check_wavelength(self.rope_max_wavelength)
        if isinstance(self.attn_temperature_length, float) and self.attn_temperature_length.is_integer():
            self.attn_temperature_length = int(self.attn_temperature_length)  # a recipe's 8192.0
        values = self.config_fields()
        if values["rope_max_wavelength"] == CONTEXT:
            values["rope_max_wavelength"] = 1.0  # a positive length, known once the source is read
        try:
            check_path_fields(values, self._flag_name)
        except ValueError as error:
            raise ConversionError(str(error)) from error
        if self.local_window is not None and self.layers is None and self.retrieval_layers is None:
            raise ConversionError(
                "--local-window makes the layers outside --layers local, but every layer becomes a PaTH layer: "
                "name the PaTH layers with --layers (or measure them with --retrieval-layers N)."
            )
        if self.attn_temperature_length is not None and not self.attn_temperature_scale:
            raise ConversionError(
                "--attn-temperature-length sets where the temperature starts to grow: it needs "
                "--attn-temperature-scale."
            )
        if self.max_shard_size < 1:
            raise ConversionError(f"--max-shard-size must be positive, got {self.max_shard_size}.")

    @classmethod
    def _flag_name(cls, config_field: str, value: Any = None) -> str:
        """How the options name a config field in a message: its flag (`--rope`), or a setting (`--rope drop`)."""
        option = next(option for option in fields(cls) if option.metadata.get("config") == config_field)
        return flag(option) if value is None else f"{flag(option)} {value}"

    def config_fields(self) -> dict[str, Any]:
        """The `PaTHLlamaConfig` fields these options set, by the config's names (`--rope` -> `rope_mode`), as given:
        `rope_max_wavelength` may still be `CONTEXT`, which the plan resolves against the source."""
        return {
            option.metadata["config"]: getattr(self, option.name)
            for option in fields(self)
            if "config" in option.metadata
        }


__all__ = [
    "CONTEXT",
    "RETRIEVAL_LENGTH",
    "format_heads",
    "parse_heads",
    "RUN_OPTIONS",
    "UNRECORDED_OPTIONS",
    "VERIFY_TOLERANCE",
    "ConvertOptions",
    "check_wavelength",
    "format_layers",
    "format_size",
    "parse_layers",
    "parse_size",
]
