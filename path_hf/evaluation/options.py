# Copyright 2026 The path-hf authors. Apache-2.0.
"""`EvalOptions`: everything an evaluation (`path-hf eval`, `path_hf.evaluation.evaluate`) is asked to do, one field a
flag (`path_hf.arguments` builds the flags from it), and `ModelSpec`, one model to evaluate.

A model is `[LABEL=]PATH[@ROPE[:FACTOR]]`: any checkpoint `AutoModelForCausalLM.from_pretrained` loads, or a
llama.cpp GGUF file (read by transformers and dequantised whole to `--dtype`, `path_hf.loading`), evaluated as it
is or, with `@yarn`, `@dynamic` or `@linear`, with transformers' RoPE scaling of that type swapped in (see
`path_hf.evaluation.rope_scaling`). Without a FACTOR, YaRN and linear use `length / train length` at each length (no
scaling at or below the training length) and dynamic NTK uses 1 (it rescales by the sequence length itself)
(`ModelSpec.factor_at`). PATH is taken whole when it exists ('@' and all); ROPE may be in any case.

`EvalOptions.check` refuses, before any model is loaded, a number out of its range and an `--output` or `--plot` that
could not be written at the end.
"""

from __future__ import annotations

import math
import os
import shutil
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass, field, fields
from pathlib import Path

from transformers import PretrainedConfig

from ..arguments import DTYPES
from ..arguments import flag as option_flag
from ..configuration_path_llama import source_context
from ..errors import EvaluationError
from .copy_retrieval import COPY_SPAN
from .needles import DEPTHS, HAYSTACKS, MULTIKEY_KEYS, MULTIKEY_QUESTIONS, NeedleTemplates
from .rope import ROPE_SCALING_TYPES


@dataclass(frozen=True)
class ModelSpec:
    """One `--model`: where it is, what to call it, and the RoPE scaling to evaluate it with."""

    label: str
    path: str
    rope_scaling: str | None = None
    rope_factor: float | None = None

    @classmethod
    def parse(cls, spec: str) -> ModelSpec:
        """`[LABEL=]PATH[@ROPE[:FACTOR]]`; the label defaults to the directory name (and `+ROPE`). ROPE is one of
        `ROPE_SCALING_TYPES` in any case; an '@' in the last part of PATH starts it, unless PATH with it exists."""
        label, path = "", spec
        if "=" in spec.split("/")[0] and not Path(spec).expanduser().exists():
            label, _, path = spec.partition("=")
        rope, factor = None, None
        if "@" in path.rsplit("/", 1)[-1] and not Path(path).expanduser().exists():
            missing = path
            path, _, suffix = path.rpartition("@")
            rope, colon, factor_text = suffix.partition(":")
            rope = rope.lower()
            if rope not in ROPE_SCALING_TYPES:
                raise ValueError(
                    f"--model {spec!r}: unknown RoPE scaling {suffix.partition(':')[0]!r} (choices: "
                    f"{', '.join(ROPE_SCALING_TYPES)}, then optionally :FACTOR); no path {missing!r} exists either"
                )
            if colon:
                try:
                    factor = float(factor_text)
                except ValueError:
                    factor = math.nan
                if not (math.isfinite(factor) and factor >= 1):
                    raise ValueError(
                        f"--model {spec!r}: the RoPE scaling factor must be a number of at least 1, got {factor_text!r}"
                    )
        if not path:
            raise ValueError(f"--model {spec!r} names no checkpoint: use [LABEL=]PATH[@yarn|@dynamic|@linear[:FACTOR]]")
        label = label or Path(path.rstrip("/")).name + (f"+{rope}" if rope else "")
        return cls(label, path, rope, factor)

    def factor_at(self, length: int, train_length: int | None) -> float | None:
        """The RoPE scaling factor this model is evaluated with at `length`: its FACTOR if it gives one, else
        `length / train_length` (at least 1) for YaRN and linear and 1 for dynamic NTK; None without a scaling."""
        if not self.rope_scaling or self.rope_factor is not None:
            return self.rope_factor
        return 1.0 if self.rope_scaling == "dynamic" else max(1.0, length / train_length)


def parse_lengths(spec: str) -> tuple[int, ...]:
    """`"256,512,1024"` -> `(256, 512, 1024)`: distinct context lengths of at least 2 tokens, sorted."""
    try:
        lengths = sorted({int(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(f"--lengths {spec!r} is not a comma-separated list of token counts such as 256,512") from None
    if not lengths or lengths[0] < 2:
        raise ValueError(f"--lengths {spec!r}: give one or more context lengths of at least 2 tokens")
    return tuple(lengths)


def parse_depths(spec: str) -> tuple[float, ...]:
    """`"0.1,0.5,0.9"` -> `(0.1, 0.5, 0.9)`: distinct relative depths of the passkey needle in [0, 1], sorted."""
    try:
        depths = sorted({float(part) for part in spec.split(",") if part.strip()})
    except ValueError:
        raise ValueError(
            f"--passkey-depths {spec!r} is not a comma-separated list of numbers such as 0.1,0.5,0.9"
        ) from None
    if not depths:
        raise ValueError(f"--passkey-depths {spec!r}: give one or more depths between 0 and 1, such as 0.1,0.5,0.9")
    _check_depths(depths)
    return tuple(depths)


def _check_depths(depths: Iterable[float]) -> None:
    for depth in depths:
        if not 0.0 <= depth <= 1.0:  # nan too
            raise ValueError(
                f"--passkey-depths: each depth must be between 0 (the key first) and 1 (right before the "
                f"question), got {depth:g}"
            )


def model_train_length(config: PretrainedConfig, given: int | None = None) -> int | None:
    """The training context a model is evaluated against (RoPE scaling, the plot, the table): `given`
    (`--train-length`), else the source context of its config (`source_context`)."""
    if given is not None:
        return given
    return source_context(config)


@dataclass(kw_only=True)
class EvalOptions:
    """Everything `path-hf eval` was asked to do: one field per flag (`path_hf.arguments`)."""

    models: list[ModelSpec] = field(
        metadata={
            "flag": "--model",
            "parse": ModelSpec.parse,
            "repeat": True,
            "metavar": "[LABEL=]PATH[@ROPE[:F]]",
            "help": "a checkpoint (directory, hub id or llama.cpp .gguf file); repeat to compare models. @yarn, "
            "@dynamic or @linear evaluate it with that RoPE scaling (factor F; default: length / train length for "
            "yarn and linear, 1 for dynamic)",
        }
    )
    data: list[str] = field(
        metadata={
            "nargs": "+",
            "metavar": "FILE",
            "help": ".txt, .jsonl or .parquet files (may be compressed), or directories of them",
        }
    )
    lengths: tuple[int, ...] = field(
        metadata={"parse": parse_lengths, "metavar": "N,N,...", "help": "context lengths in tokens"}
    )
    tokenizer: str | None = field(
        default=None,
        metadata={
            "metavar": "PATH_OR_ID",
            "help": "the tokenizer of every --model, for checkpoints saved without one (default: each model's own)",
        },
    )
    text_field: str = field(default="text", metadata={"help": "column of JSON/parquet records (default: %(default)s)"})
    max_tokens: int = field(
        default=65536,
        metadata={
            "metavar": "N",
            "help": "evaluate on the first N tokens of the data, the same tokens at every length (default: "
            "%(default)s)",
        },
    )
    stride: int | None = field(
        default=None,
        metadata={
            "metavar": "S",
            "help": "sliding windows that move by S tokens, each token scored once with up to length-1 tokens of "
            "context (default: non-overlapping windows)",
        },
    )
    batch_size: int = field(default=8, metadata={"help": "windows per forward pass (default: %(default)s)"})
    perplexity: bool = field(
        default=True,
        metadata={"negate": "--no-perplexity", "help": "skip the perplexity windows (retrieval only)"},
    )
    passkey_trials: int = field(
        default=20,
        metadata={
            "metavar": "N",
            "help": "passkey prompts per length, a key hidden in the haystack text (--needle-data) and asked for at "
            "the end, spread over --passkey-depths; 0 skips the test (default: %(default)s)",
        },
    )
    passkey_depths: tuple[float, ...] = field(
        default=DEPTHS,
        metadata={
            "parse": parse_depths,
            "metavar": "D,D,...",
            "help": "the share of the haystack before the passkey, one depth a trial in turn (default: "
            + ",".join(f"{depth:g}" for depth in DEPTHS)
            + ")",
        },
    )
    haystacks: int = field(
        default=HAYSTACKS,
        metadata={
            "metavar": "H",
            "help": "stretches of text a length's passkey trials are hidden in; the trials of one haystack and depth "
            "share the forward pass over the text before their key (default: %(default)s)",
        },
    )
    multikey_trials: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "multi-key prompts per length: --multikey-keys keys with distinct names in one haystack, one of "
            "them asked for; 0 skips the test (default: %(default)s)",
        },
    )
    multikey_keys: int = field(
        default=MULTIKEY_KEYS, metadata={"metavar": "K", "help": "keys in a multi-key haystack (default: %(default)s)"}
    )
    multikey_questions: int = field(
        default=MULTIKEY_QUESTIONS,
        metadata={
            "metavar": "Q",
            "help": "questions asked of each multi-key haystack, each a trial sharing its forward pass (default: "
            "%(default)s)",
        },
    )
    needle_data: list[str] | None = field(
        default=None,
        metadata={
            "nargs": "+",
            "metavar": "FILE",
            "help": "the haystack text of the passkey and multi-key prompts (default: --data); held-out text",
        },
    )
    needle_templates: str | None = field(
        default=None,
        metadata={
            "metavar": "FILE.json",
            "help": "needle and question templates of the passkey and multi-key prompts (default: path_hf's "
            "evaluation set, path_hf/evaluation/needle_templates.json)",
        },
    )
    greedy_check: int = field(
        default=1,
        metadata={
            "metavar": "N",
            "help": "the first N passkey and multi-key trials of each length are also decoded greedily with generate, "
            "from scratch: a check of the teacher-forced verdict (default: %(default)s)",
        },
    )
    local_window: int | None = field(
        default=None,
        metadata={
            "metavar": "W",
            "help": "evaluate models with local layers (a hybrid's local_window) with this window instead of the "
            "one they were converted with",
        },
    )
    copy_trials: int = field(
        default=0,
        metadata={
            "metavar": "N",
            "help": "copy-retrieval windows per length, each a span of --data at its start and again at its end, "
            "scored on the repeat (top-1 accuracy and NLL); one forward pass of the length per window; 0 skips the "
            "test (default: %(default)s)",
        },
    )
    copy_span: int = field(
        default=COPY_SPAN,
        metadata={
            "metavar": "S",
            "help": "tokens of the copied span; its last S-1 tokens are scored, copied from length-S tokens back "
            "(default: %(default)s)",
        },
    )
    seed: int = field(
        default=0, metadata={"help": "seed of the passkey prompts and of the copy spans (default: %(default)s)"}
    )
    train_length: int | None = field(
        default=None,
        metadata={
            "metavar": "N",
            "help": "the models' training context, for RoPE scaling, the plot and the table (default: from each "
            "config)",
        },
    )
    dtype: str = field(default="float32", metadata={"choices": DTYPES, "help": "dtype the models are loaded in"})
    device: str | None = field(
        default=None, metadata={"help": "cpu, cuda, cuda:1, ... (default: cuda when there is one)"}
    )
    trust_remote_code: bool = field(default=False, metadata={"help": "allow code shipped with a checkpoint"})
    output: str | None = field(default=None, metadata={"metavar": "FILE.json", "help": "write every number as JSON"})
    plot: str | None = field(
        default=None,
        metadata={"metavar": "FILE.png", "help": "plot perplexity against context length, one line a model"},
    )
    force: bool = field(default=False, metadata={"help": "replace --output / --plot if they exist"})
    progress: bool = field(default=True, metadata={"negate": "--no-progress", "help": "no progress bars"})
    debug: bool = field(default=False, repr=False, metadata={"help": "print the traceback of an error"})

    def check(self) -> None:
        """Refuse what cannot run before any model is loaded: labels, every number out of its range, and outputs
        that could not be written at the end."""
        labels = [spec.label for spec in self.models]
        if duplicated := sorted({label for label in labels if labels.count(label) > 1}):
            raise EvaluationError(f"two --model share the label {duplicated[0]!r}: name them with LABEL=PATH")
        if not self.lengths or min(self.lengths) < 2:
            raise EvaluationError(f"--lengths {self.lengths}: give one or more context lengths of at least 2 tokens")
        for option in fields(self):
            minimum, meaning = _MINIMUMS.get(option.name, (None, ""))
            value = getattr(self, option.name)
            if minimum is not None and value is not None and value < minimum:
                raise EvaluationError(f"{option_flag(option)} must be at least {minimum} ({meaning}), got {value}")
        if not self.passkey_depths:
            raise EvaluationError("--passkey-depths is empty: give one or more depths between 0 and 1")
        try:
            _check_depths(self.passkey_depths)
        except ValueError as error:
            raise EvaluationError(str(error)) from None
        if not (self.perplexity or self.passkey_trials or self.multikey_trials or self.copy_trials):
            raise EvaluationError(
                "--no-perplexity with no retrieval test measures nothing: give --passkey-trials, --multikey-trials or "
                "--copy-trials"
            )
        if self.needle_templates is not None:
            try:
                self.templates()
            except ValueError as error:
                raise EvaluationError(f"--needle-templates {error}") from None
            if self.multikey_trials and self.multikey_keys > len(self.templates().names):
                raise EvaluationError(
                    f"--multikey-keys {self.multikey_keys} is more than the {len(self.templates().names)} names of "
                    f"--needle-templates {self.needle_templates}: give fewer keys or more names"
                )
        if self.copy_trials and 2 * self.copy_span + 1 > self.lengths[-1]:
            raise EvaluationError(
                f"--copy-span {self.copy_span} does not fit the longest length {self.lengths[-1]}: a copy window holds "
                f"the span twice and a BOS token ({2 * self.copy_span + 1} tokens): give a --copy-span of at most "
                f"{(self.lengths[-1] - 1) // 2}, or longer --lengths"
            )
        if self.stride is not None and self.stride > self.lengths[0]:
            raise EvaluationError(
                f"--stride {self.stride} must be between 1 and the shortest length ({self.lengths[0]}): each "
                "window slides by that many tokens"
            )
        if self.max_tokens < self.lengths[-1]:
            raise EvaluationError(
                f"--max-tokens {self.max_tokens} is below the longest length {self.lengths[-1]}: no window would fit"
            )
        self._check_outputs()

    def templates(self) -> NeedleTemplates:
        """The needle templates of the passkey and multi-key prompts (`--needle-templates`, or path_hf's own)."""
        if self.needle_templates is None:
            return NeedleTemplates.default()
        return NeedleTemplates.from_file(self.needle_templates)

    @property
    def needles_wanted(self) -> bool:
        """Whether a needle test (passkey or multi-key) runs, and so haystack text is needed."""
        return bool(self.passkey_trials or self.multikey_trials)

    def tokenizer_source(self, spec: ModelSpec) -> tuple[str, str]:
        """The flag and the source of the tokenizer `spec` is evaluated with: `--tokenizer`, or the model's own."""
        return ("--tokenizer", self.tokenizer) if self.tokenizer else ("--model", spec.path)

    def _check_outputs(self) -> None:
        """`--output` and `--plot` must be files that can be written where they are named (a directory that exists
        and takes new files), not directories, not each other, not existing files without `--force`; the plot in a
        format matplotlib writes."""
        outputs = [(flag, path) for flag, path in (("--output", self.output), ("--plot", self.plot)) if path]
        if len(outputs) == 2 and Path(self.output).resolve() == Path(self.plot).resolve():
            raise EvaluationError(f"--output and --plot are the same file, {self.output}: give two paths")
        for flag, path in outputs:
            target = Path(path)
            if target.is_dir():
                raise EvaluationError(f"{flag} {path} is a directory: give a file path")
            if target.exists() and not self.force:
                raise EvaluationError(f"{flag} {path} exists: pass --force to replace it, or choose another path")
            directory = target.resolve().parent
            if not directory.is_dir():
                raise EvaluationError(f"{flag} {path}: its directory does not exist: create it or choose another path")
            try:  # what atomic_file does at the end: a new file in that directory
                handle, probe = tempfile.mkstemp(dir=directory, prefix=f".{target.name}.")
            except OSError as error:
                raise EvaluationError(
                    f"{flag} {path}: cannot write in {directory} ({error.strerror}): choose another path"
                ) from error
            os.close(handle)
            os.unlink(probe)
        if self.plot:
            _check_plot_format(self.plot)


# The smallest value of each numeric option (those with a range beyond it are checked in `EvalOptions.check`).
_MINIMUMS = {
    "max_tokens": (1, "tokens of --data to evaluate on"),
    "stride": (1, "tokens a sliding window moves by"),
    "batch_size": (1, "windows per forward pass"),
    "passkey_trials": (0, "0 skips the passkey test"),
    "haystacks": (1, "stretches of text the passkey trials are hidden in"),
    "multikey_trials": (0, "0 skips the multi-key test"),
    "multikey_keys": (2, "keys in a multi-key haystack, one asked for"),
    "multikey_questions": (1, "questions asked of each multi-key haystack"),
    "greedy_check": (0, "0 decodes no trial with generate"),
    "local_window": (1, "tokens a local layer sees"),
    "copy_trials": (0, "0 skips the copy test"),
    "copy_span": (2, "tokens of the copied span, whose first is not scored"),
    "seed": (0, "the seed of the passkey prompts"),
    "train_length": (1, "the models' training context, in tokens"),
}


def _check_plot_format(plot: str) -> None:
    """Refuse a `--plot` whose suffix is not a format matplotlib writes here (pgf needs its TeX program)."""
    import matplotlib
    from matplotlib.backend_bases import FigureCanvasBase

    suffix = Path(plot).suffix.lower().lstrip(".")
    formats = sorted(FigureCanvasBase.get_supported_filetypes())
    if suffix not in formats:
        problem = f"matplotlib cannot write .{suffix} files" if suffix else "no suffix names the format"
        raise EvaluationError(
            f"--plot {plot}: {problem}: end the name with one of {', '.join('.' + name for name in formats)}"
        )
    texsystem = matplotlib.rcParams["pgf.texsystem"]
    if suffix == "pgf" and shutil.which(texsystem) is None:
        raise EvaluationError(f"--plot {plot}: matplotlib writes .pgf with {texsystem}, which is not installed")


__all__ = ["EvalOptions", "ModelSpec", "model_train_length", "parse_depths", "parse_lengths"]
