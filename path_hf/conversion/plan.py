# Copyright 2026 The path-hf authors. Apache-2.0.
"""Plan a conversion from the source's config and shard headers alone: no tensor data is read.

`plan_conversion` runs the steps in order, each refusing with a `ConversionError` what it cannot take: a source that
overlaps the destination (the destination itself is `convert`'s to check, first), links out of the source folder
(without `--follow-symlinks`), the source's config (architecture, attention, `--layers`), the converted config, every
source tensor's name and shape against the converted model's layout, the output's tensors in the order they will be
written and cut into shards, the other files to carry over, and the free disk space.
"""

from __future__ import annotations

import importlib.metadata
import json
import math
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, PretrainedConfig
from transformers.utils import CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME

from .. import PaTHLlamaConfig
from ..configuration_path_llama import source_context
from ..errors import ConversionError
from ..loading import TOKENIZER_FILES
from ..modeling_path_llama import LAYER_PARAMETER, rope_band
from .architectures import (
    Architecture,
    Layout,
    check_attention,
    check_source_config,
    check_source_tensors,
    check_source_values,
    converted_layout,
    path_config_from,
)
from .io import SourceTensor, SourceWeights, TensorMeta, find_weight_files, split_into_shards
from .options import CONTEXT, UNRECORDED_OPTIONS, ConvertOptions, format_heads, format_layers, format_size
from .sources import WEIGHT_SUFFIXES, Source, fetch_weights, follow_links, links_outside, resolve_source
from .staging import check_disk_space, check_overlap

# Top-level files of a source that are not carried over as they are: what the converter writes itself.
_REPLACED_FILES = (CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME, "README.md")


def package_version() -> str:
    try:
        return importlib.metadata.version("path-hf")
    except importlib.metadata.PackageNotFoundError:  # running from a source checkout
        return "unknown"


@dataclass(frozen=True)
class OutputTensor(TensorMeta):
    """A tensor of the converted checkpoint: a copy of `source` (cast to `dtype`), or, when `source` is None, the new
    PaTH parameter `parameter` (its name in the attention) of decoder layer `layer`."""

    source: SourceTensor | None = None
    layer: int | None = None
    parameter: str | None = None


@dataclass(frozen=True)
class ConversionPlan:
    """Everything a conversion will do, known before any tensor data is read."""

    options: ConvertOptions
    source: Source
    architecture: Architecture
    config: PaTHLlamaConfig
    weights: SourceWeights
    shards: tuple[tuple[OutputTensor, ...], ...]
    extra_files: tuple[Path, ...]  # tokenizer, chat template, license... copied as they are
    ignored: tuple[SourceTensor, ...] = ()  # source tensors left out (RoPE buffers, a tied head)

    @property
    def tensors(self) -> Iterator[OutputTensor]:
        return (tensor for shard in self.shards for tensor in shard)

    @property
    def weight_bytes(self) -> int:
        return sum(tensor.nbytes for tensor in self.tensors)

    @property
    def has_tokenizer(self) -> bool:
        """Whether the source's files carried over hold a tokenizer (`path-hf eval` and the recipes need one)."""
        names = {path.name for path in self.extra_files}
        return bool(names & set(TOKENIZER_FILES)) or any(name.endswith(".tiktoken") for name in names)

    @property
    def bytes_to_write(self) -> int:
        return self.weight_bytes + sum(path.stat().st_size for path in self.extra_files) + model_code_bytes()

    def describe(self, public: bool = False) -> str:
        """The plan in a few lines, as `--dry-run` prints it; `public`: as the model card gives it, naming the source
        and the destination without this machine's folders."""
        config, opts = self.config, self.options
        copied = [tensor for tensor in self.tensors if tensor.source is not None]
        added = [tensor for tensor in self.tensors if tensor.source is None]
        path_layers = config.path_layers if config.path_layers is not None else range(config.num_hidden_layers)
        added_names = sorted({tensor.parameter for tensor in added})
        revision = f" @ {self.source.revision}" if self.source.revision else ""
        gguf = f" ({self.source.gguf.describe()})" if self.source.gguf else ""
        dtype = str(config.dtype).removeprefix("torch.")
        lines = [
            f"source:       {self.source.public_name if public else self.source.name}{revision}{gguf}",
            f"architecture: {self.architecture.name}, {config.num_hidden_layers} layers, hidden {config.hidden_size}, "
            f"{config.num_attention_heads} heads ({config.num_key_value_heads} kv), head dim {config.head_dim}, "
            f"{'tied' if config.tie_word_embeddings else 'untied'} embeddings",
            f"PaTH layers:  {format_layers(path_layers)} ({len(path_layers)} of {config.num_hidden_layers}), rope "
            f"{config.rope_mode}, forget gate {_gate(config)}, w_proj "
            f"{'full rank' if config.path_w_rank is None else f'rank {config.path_w_rank}'}, conv size "
            f"{config.path_conv_size}, init {config.path_init}, seed {opts.seed}",
            f"copy:         {len(copied)} tensors, {format_size(sum(t.nbytes for t in copied))} from "
            f"{len(self.weights.files)} {self.weights.format} file(s), written as {dtype}",
            f"add:          {len(added)} tensors, {sum(math.prod(t.shape) for t in added):,} parameters, "
            f"{format_size(sum(t.nbytes for t in added))} ({', '.join(added_names)})",
        ]
        if (band := describe_band(config, context=opts.rope_max_wavelength == CONTEXT)) is not None:
            lines.append(f"RoPE band:    {band}")
        if config.path_attn_temperature_scale:
            lines.append(f"temperature:  {describe_temperature(config)}")
        if config.local_window is not None:
            local = [layer for layer in range(config.num_hidden_layers) if not config.is_path_layer(layer)]
            lines.append(
                f"local layers: {format_layers(local) or 'none'}, RoPE attention to the last {config.local_window} "
                f"tokens and {config.local_sinks} sink(s) renumbered into the window"
            )
        if config.local_full_heads:
            lines.append(
                f"full heads:   {format_heads(config.local_full_heads)} (layer:head), every key in view, "
                f"{len(config.local_full_heads)} of {config.num_attention_heads * config.num_hidden_layers}"
            )
        if self.ignored:
            lines.append(f"leave out:    {len(self.ignored)} tensor(s): {', '.join(t.name for t in self.ignored)}")
        lines.append(
            f"write:        {format_size(self.bytes_to_write)} in {len(self.shards)} shard(s) + "
            f"{len(self.extra_files)} tokenizer/other file(s) to "
            f"{Path(opts.output).name if public else Path(opts.output).resolve()}"
        )
        return "\n".join(lines)


def band_pairs(config: PaTHLlamaConfig) -> tuple[list[int], list[int]] | None:
    """The RoPE frequency pairs that PaTH layers rotate and those they do not (`rope_band`), or None without a
    band."""
    rotate = rope_band(config)
    if rotate is None:
        return None
    pairs = rotate[: rotate.numel() // 2].tolist()  # cos/sin hold each pair's angle twice
    return [i for i, kept in enumerate(pairs) if kept], [i for i, kept in enumerate(pairs) if not kept]


def describe_band(config: PaTHLlamaConfig, context: bool = False) -> str | None:
    """`"pairs 0-19 rotate (wavelength <= 8192 tokens), pairs 20-31 do not"`, or None without a band; `context`: the
    limit is the source's training context (`--rope-max-wavelength context`)."""
    if (pairs := band_pairs(config)) is None:
        return None
    rotating, still = pairs
    limit = f"wavelength <= {config.rope_max_wavelength:g} tokens" + (", the source's context" if context else "")
    if not still:
        return f"all {len(rotating)} pairs rotate ({limit}: none is slower)"
    if not rotating:
        return f"no pair rotates (every wavelength is above {config.rope_max_wavelength:g} tokens)"
    return f"{_pairs(rotating, 'rotate')} ({limit}), {_pairs(still, 'do not')}"


def _pairs(indices: list[int], verb: str) -> str:
    """`"pairs 0-3 rotate"`, `"pair 7 does not"`."""
    if len(indices) > 1:
        return f"pairs {format_layers(indices)} {verb}"
    return f"pair {indices[0]} {'does not' if verb == 'do not' else verb + 's'}"


def describe_temperature(config: PaTHLlamaConfig) -> str:
    """Llama 4's query temperature as the plan prints it."""
    scale, length = config.path_attn_temperature_scale, config.attn_temperature_length
    return (
        f"PaTH queries x (1 + {scale:g} log(floor((p + 1) / {length}) + 1)), exactly 1 on the first {length - 1} tokens"
    )


# What a converted checkpoint holds besides its weights, the model code and the files carried over: config.json,
# generation_config.json, the model card and the shard index, counted at most this.
_METADATA_BYTES = 64 * 2**10


def model_code_bytes() -> int:
    """The bytes a converted checkpoint holds besides its weights and the source's files: the model code stored for
    `trust_remote_code` (the modeling and configuration files and what they import relatively, as
    `save_model_code` copies them) and `_METADATA_BYTES` for the config, the generation config and the card."""
    from transformers.dynamic_module_utils import get_relative_import_files

    from .. import configuration_path_llama, modeling_path_llama

    files = {modeling_path_llama.__file__, configuration_path_llama.__file__}
    files |= set(get_relative_import_files(modeling_path_llama.__file__))
    return sum(Path(file).stat().st_size for file in files) + _METADATA_BYTES


def _gate(config: PaTHLlamaConfig) -> str:
    if not config.path_forget_gate:
        return "off"
    return f"on (bias {config.path_forget_gate_bias:g})" if config.path_forget_gate_bias else "on"


def read_source_config(source: Source, options: ConvertOptions) -> tuple[Architecture, PretrainedConfig]:
    """The source's architecture and config, checked: one path-hf converts, attention PaTH can replace, and
    `--layers` inside the model."""
    config_file = source.path / CONFIG_NAME
    if not config_file.is_file():
        raise ConversionError(f"{source.name} has no {CONFIG_NAME}; is it a transformers checkpoint?")
    try:
        raw_config = json.loads(config_file.read_text())
    except ValueError as error:
        raise ConversionError(f"{config_file} is not valid JSON ({error}).") from error
    if not isinstance(raw_config, dict):
        raise ConversionError(f"{config_file} must hold a JSON object, got a {type(raw_config).__name__}.")
    architecture = check_source_config(raw_config)
    check_source_values(raw_config)
    try:
        source_config = AutoConfig.from_pretrained(source.path)
    except (ValueError, TypeError, KeyError) as error:  # transformers' own validation, all on one line
        raise ConversionError(f"{config_file}: transformers refuses it ({' '.join(str(error).split())})") from error
    positions = source_config.max_position_embeddings
    if options.local_window is not None and options.local_window > positions:
        print(
            f"warning: --local-window {options.local_window} is longer than the source's {positions} positions: past "
            f"{positions} its local layers see distances the source never saw, unless a RoPE scaling rescales them "
            "(path-hf eval --model PATH@yarn does)",
            file=sys.stderr,
            flush=True,
        )
    check_attention(source_config, options.allow_torch_only_head_dim)
    if options.layers and max(options.layers) >= source_config.num_hidden_layers:
        raise ConversionError(
            f"--layers names layer {max(options.layers)}, but the model has {source_config.num_hidden_layers} layers "
            f"(0-{source_config.num_hidden_layers - 1})."
        )
    local = options.local_window is not None and options.layers is not None  # --retrieval-layers: not chosen yet
    if local and len(options.layers) == source_config.num_hidden_layers:
        raise ConversionError(
            f"--local-window makes the layers outside --layers local, but --layers names every layer of the model "
            f"(0-{source_config.num_hidden_layers - 1}): every layer is a PaTH layer. Leave some out of --layers."
        )
    return architecture, source_config


def converted_config(
    options: ConvertOptions, source: Source, architecture: Architecture, source_config: PretrainedConfig
) -> PaTHLlamaConfig:
    """The converted model's config: the source's, the options' PaTH fields, and the record of the conversion
    (`path_conversion`, which keeps `--rope-max-wavelength context` as the word; the config holds the number)."""
    path_fields = options.config_fields()
    if path_fields["rope_max_wavelength"] == CONTEXT:
        path_fields["rope_max_wavelength"] = float(source_context(source_config))
    if path_fields["path_layers"] is not None:
        path_fields["path_layers"] = list(path_fields["path_layers"])
    if path_fields["local_full_heads"] is not None:
        path_fields["local_full_heads"] = [list(pair) for pair in path_fields["local_full_heads"]]
    config = path_config_from(
        source_config,
        architecture,
        **path_fields,
        path_conversion={
            "source": source.name,
            "revision": source.revision,
            **({"gguf": source.gguf.record()} if source.gguf else {}),
            "options": {k: v for k, v in asdict(options).items() if k not in UNRECORDED_OPTIONS},
            "path_hf_version": package_version(),
        },
    )
    if config.rope_max_wavelength is not None:
        check_band_is_fixed(config)
    return config


# Source RoPEs whose frequencies depend on the sequence length: dynamic NTK (its base grows past
# max_position_embeddings) and LongRoPE (its long factors past original_max_position_embeddings).
_LENGTH_DEPENDENT_ROPE = {"dynamic": "dynamic NTK", "longrope": "LongRoPE"}


def check_band_is_fixed(config: PaTHLlamaConfig) -> None:
    """`rope_max_wavelength` picks, once, the RoPE pairs that PaTH layers rotate, by their wavelength: refuse a source
    RoPE whose frequencies change with the sequence length, for which no single set is right at every length."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type in _LENGTH_DEPENDENT_ROPE:
        raise ConversionError(
            f"--rope-max-wavelength {config.rope_max_wavelength:g} fixes the RoPE pairs PaTH layers rotate by their "
            f"wavelength, but the source's {_LENGTH_DEPENDENT_ROPE[rope_type]} RoPE changes its frequencies with the "
            "sequence length past its context, so the pairs under the limit change too: convert without "
            "--rope-max-wavelength."
        )


def output_tensors(
    copied: Sequence[SourceTensor], layout: Layout, dtype: torch.dtype, cast: Callable[[torch.dtype], torch.dtype]
) -> list[OutputTensor]:
    """The output's tensors in the order they are written: the source's in its order (shard by shard, data order
    within a shard), each `cast`, and a PaTH layer's new parameters, at `dtype`, right after the layer's last source
    tensor."""
    layers = [int(found["layer"]) if (found := LAYER_PARAMETER.match(t.name)) else None for t in copied]
    last_of_layer = {layer: index for index, layer in enumerate(layers) if layer is not None}
    tensors: list[OutputTensor] = []
    for index, (tensor, layer) in enumerate(zip(copied, layers, strict=True)):
        tensors.append(OutputTensor(tensor.name, cast(tensor.dtype), tensor.shape, source=tensor))
        if layer is not None and last_of_layer[layer] == index:
            tensors.extend(
                OutputTensor(new.name, dtype, new.shape, layer=layer, parameter=parameter)
                for parameter, new in layout.added.get(layer, {}).items()
            )
    return tensors


def extra_files(directory: Path) -> tuple[Path, ...]:
    """The source's top-level files carried over as they are (tokenizer, chat template, licence...): not weights,
    code, hidden files or what the converter writes itself."""
    return tuple(
        path
        for path in sorted(directory.iterdir())
        if path.is_file()
        and not path.name.startswith(".")
        and path.suffix not in (*WEIGHT_SUFFIXES, ".py")
        and path.name not in _REPLACED_FILES
    )


def check_source_links(source: Source, follow: bool) -> None:
    """Refuse the files a conversion reads from the source directory (config, generation config, shard index, weights,
    the files carried over) that lie outside it through a link, unless `follow` (`sources.follow_links`). The links
    of a hub snapshot lead into its cache repository's blobs, which is fine. A shard index is read for the shards it
    names only if it passed, or with `follow`."""
    directory = source.path.resolve()
    named = [
        directory / name for name in (CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)
    ]
    links = links_outside(directory, [*named, *extra_files(directory)])
    if follow or not links:
        links += links_outside(directory, find_weight_files(directory)[0])
    follow_links(directory, links, follow)


def plan_conversion(options: ConvertOptions, source: Source | None = None) -> ConversionPlan:
    """Check the source and the options, and lay out the output; reads configs and shard headers, no tensor data.
    `source`: the source already resolved (a GGUF materialised by `conversion.gguf.gguf_source`).

    Raises `ConversionError` for anything the converter refuses.
    """
    output = Path(options.output).expanduser()
    source = source or resolve_source(options.source, options.revision)
    check_overlap(output, source.path)  # `convert` checked the destination, before a hub source was known
    check_source_links(source, options.follow_symlinks)
    architecture, source_config = read_source_config(source, options)
    fetch_weights(source)
    weights = source.gguf.weights if source.gguf else SourceWeights.from_directory(source.path)
    config = converted_config(options, source, architecture, source_config)
    layout = converted_layout(config)
    copied, ignored = check_source_tensors(weights.tensors, layout, config)
    # The checkpoint's dtype, which the new parameters take too: --dtype, or the source's embeddings'.
    dtype = getattr(torch, options.dtype) if options.dtype else weights.tensor(layout.input_embeddings).dtype
    config.dtype = dtype

    def cast(tensor_dtype: torch.dtype) -> torch.dtype:
        return dtype if options.dtype and tensor_dtype.is_floating_point else tensor_dtype

    shards = split_into_shards(output_tensors(copied, layout, dtype, cast), options.max_shard_size)
    plan = ConversionPlan(
        options,
        source,
        architecture,
        config,
        weights,
        tuple(tuple(shard) for shard in shards),
        extra_files(source.path),
        tuple(ignored),
    )
    check_carried_files(plan)
    check_disk_space(output, plan.bytes_to_write)
    return plan


def check_carried_files(plan: ConversionPlan) -> None:
    """Refuse a source JSON file carried over (tokenizer config, special tokens map, ...) or a generation config that
    does not parse: copied as it is, it would fail whoever loads the converted model. Say so when the source has no
    tokenizer files: the converted model then has none either, and `path-hf eval` and the recipes need one."""
    generation_config = plan.source.path / GENERATION_CONFIG_NAME
    for path in [*plan.extra_files, *([generation_config] if generation_config.is_file() else [])]:
        if path.suffix == ".json":
            try:
                json.loads(path.read_text())
            except (UnicodeDecodeError, ValueError) as error:
                raise ConversionError(
                    f"the source's {path.name} is not valid JSON ({error}); repair or remove it, then convert again."
                ) from error


__all__ = [
    "ConversionPlan",
    "OutputTensor",
    "band_pairs",
    "check_source_links",
    "converted_config",
    "describe_band",
    "describe_temperature",
    "extra_files",
    "output_tensors",
    "package_version",
    "plan_conversion",
    "read_source_config",
    "source_context",
]
