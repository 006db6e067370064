# Copyright 2026 The path-hf authors. Apache-2.0.
"""What the converter accepts: the source architectures (as data), how their configs become a `PaTHLlamaConfig`,
and the tensors a source checkpoint must hold.

`PaTHLlamaConfig` describes each supported layout with a few flags (Qwen2: `attention_bias=True,
attention_o_bias=False`; Qwen3: `qk_norm=True`), so a source tensor keeps its name in the output. The layout is read
off the converted model itself, built on the meta device (`converted_layout`): what is checked in the source is what
PaTHLlama holds, and the new parameters are what its PaTH layers add.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch
from torch import nn
from transformers import PretrainedConfig

from .. import PaTHLlamaConfig, PaTHLlamaForCausalLM
from ..errors import ConversionError
from ..modeling_path_llama import PATH_MODULES, PaTHLlamaAttention, PaTHLlamaRoPEAttention
from ..ops import FLA_HEAD_DIMS
from .io import TensorMeta


@dataclass(frozen=True)
class Architecture:
    """A source architecture the converter supports."""

    name: str
    model_type: str
    # `PaTHLlamaConfig` fields that describe this architecture's layout.
    config_overrides: dict = field(default_factory=dict)


ARCHITECTURES: dict[str, Architecture] = {
    arch.name: arch
    for arch in (
        Architecture("LlamaForCausalLM", "llama"),
        Architecture("MistralForCausalLM", "mistral"),
        Architecture("Qwen2ForCausalLM", "qwen2", {"attention_bias": True, "attention_o_bias": False}),
        Architecture("Qwen3ForCausalLM", "qwen3", {"qk_norm": True}),
    )
}

# Source config fields that do not carry over: the source's own identity, and the sliding-window fields
# (refused when in use; `layer_types` is derived from `path_layers` in PaTHLlama).
DROPPED_CONFIG_FIELDS = (
    "architectures",
    "auto_map",
    "model_type",
    "transformers_version",
    "_name_or_path",
    "layer_types",
    "use_sliding_window",
    "sliding_window",
    "max_window_layers",
)

# Why a few well-known architectures cannot be converted (keyed by model_type).
_NOT_ROPE = {
    "gpt2": "learned absolute position embeddings, not RoPE",
    "gpt_bigcode": "learned absolute position embeddings, not RoPE",
    "opt": "learned absolute position embeddings, not RoPE",
    "bert": "an encoder with learned absolute position embeddings, not a RoPE decoder",
    "roberta": "an encoder with learned absolute position embeddings, not a RoPE decoder",
    "bloom": "ALiBi, not RoPE",
    "mpt": "ALiBi, not RoPE",
    "t5": "an encoder-decoder with relative position buckets, not RoPE",
}
_MOE_FIELDS = ("num_experts", "num_local_experts", "n_routed_experts", "moe_intermediate_size")
_MULTIMODAL_FIELDS = ("text_config", "vision_config", "audio_config")


def check_source_config(raw_config: dict) -> Architecture:
    """The supported architecture a source `config.json` describes, or a `ConversionError` saying why not."""
    model_type = raw_config.get("model_type")
    if model_type == PaTHLlamaConfig.model_type:
        raise ConversionError("the source is already a PaTH model (model_type 'path_llama'); nothing to convert.")
    architectures = raw_config.get("architectures") or []
    for arch in ARCHITECTURES.values():
        # A config without `architectures` (written by `config.save_pretrained`) is known by its model_type.
        if arch.model_type == model_type and architectures in ([], [arch.name]):
            return arch
    if any(key in raw_config for key in _MULTIMODAL_FIELDS):
        reason = "it is multimodal"
    elif any(raw_config.get(key) for key in _MOE_FIELDS):
        reason = "it is a mixture-of-experts model"
    elif model_type in _NOT_ROPE:
        reason = f"it uses {_NOT_ROPE[model_type]}"
    else:
        reason = "it is not one of the RoPE decoders path-hf knows"
    described = "/".join(architectures) or "no architecture"
    raise ConversionError(
        f"cannot convert {described} (model_type {model_type!r}): {reason}. Supported: {', '.join(ARCHITECTURES)}."
    )


# Fields of a source config.json that must be positive integers where present.
_POSITIVE_INTS = (
    "num_attention_heads",
    "num_key_value_heads",
    "num_hidden_layers",
    "hidden_size",
    "intermediate_size",
    "head_dim",
    "max_position_embeddings",
    "vocab_size",
)


def check_source_values(raw_config: dict) -> None:
    """Refuse the values of a source `config.json` that would make transformers fail with a raw exception or build a
    model that computes nothing but NaN: sizes that are not positive integers, key/value heads that do not divide the
    heads, a RoPE theta or norm epsilon that is not a positive number, a RoPE type transformers does not know, and a
    RoPE scaling factor below 1. Each refusal names the field and its value."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    def positive_number(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0

    for key in _POSITIVE_INTS:
        value = raw_config.get(key)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConversionError(f"the source's config.json: {key} must be a positive integer, got {value!r}.")
    if raw_config.get("vocab_size") == 1:
        raise ConversionError(
            "the source's config.json: vocab_size 1 leaves one token, which every position predicts: nothing to "
            "convert or verify (a vocabulary needs at least 2 tokens)."
        )
    heads, kv_heads = raw_config.get("num_attention_heads"), raw_config.get("num_key_value_heads")
    if heads and kv_heads and heads % kv_heads:
        raise ConversionError(
            f"the source's config.json: num_key_value_heads {kv_heads} does not divide num_attention_heads {heads} "
            "(each key/value head serves a whole group of query heads)."
        )
    eps = raw_config.get("rms_norm_eps")
    if eps is not None and not positive_number(eps):
        raise ConversionError(f"the source's config.json: rms_norm_eps must be a positive number, got {eps!r}.")
    rope = raw_config.get("rope_parameters") or raw_config.get("rope_scaling") or {}
    if not isinstance(rope, dict):
        raise ConversionError(f"the source's config.json: rope_parameters must be a mapping, got {rope!r}.")
    theta = rope.get("rope_theta", raw_config.get("rope_theta"))
    if theta is not None and not positive_number(theta):
        raise ConversionError(f"the source's config.json: rope_theta must be a positive number, got {theta!r}.")
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type != "default" and rope_type not in ROPE_INIT_FUNCTIONS:
        known = ", ".join(["default", *sorted(ROPE_INIT_FUNCTIONS)])
        raise ConversionError(
            f"the source's config.json: rope_type {rope_type!r} is not one transformers knows ({known})."
        )
    factor = rope.get("factor")
    if rope_type != "default" and factor is not None and not (positive_number(factor) and factor >= 1):
        raise ConversionError(
            f"the source's config.json: the {rope_type} RoPE scaling factor must be a number >= 1, got {factor!r}."
        )


def check_attention(config: PretrainedConfig, allow_torch_only_head_dim: bool) -> None:
    """Refuse attention that PaTH layers cannot replace: sliding windows, and head dims FLA cannot run."""
    layer_types = getattr(config, "layer_types", None) or []
    sliding = any(kind != "full_attention" for kind in layer_types)
    if sliding or (not layer_types and getattr(config, "sliding_window", None) is not None):
        raise ConversionError(
            f"the source uses sliding-window attention (sliding_window={config.sliding_window}); PaTH layers "
            "replace full attention only."
        )
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim not in FLA_HEAD_DIMS and not allow_torch_only_head_dim:
        raise ConversionError(
            f"head dim {head_dim} is not one FLA's PaTH kernel runs {FLA_HEAD_DIMS}; the torch backend still runs "
            "it (slower). Pass --allow-torch-only-head-dim to convert anyway."
        )


def path_config_from(source_config: PretrainedConfig, arch: Architecture, **path_fields) -> PaTHLlamaConfig:
    """The `PaTHLlamaConfig` of the converted model: every source field kept (but `DROPPED_CONFIG_FIELDS`), the
    architecture's layout flags, and `path_fields` (`rope_mode`, `path_layers`, ...)."""
    fields = {key: value for key, value in source_config.to_dict().items() if key not in DROPPED_CONFIG_FIELDS}
    fields.update(arch.config_overrides)
    fields.update(path_fields)
    try:
        config = PaTHLlamaConfig(**fields)
    except (ValueError, TypeError) as error:
        raise ConversionError(f"the converted config is invalid: {error}") from error
    config.architectures = ["PaTHLlamaForCausalLM"]
    return config


@dataclass(frozen=True)
class Layout:
    """The tensors of a converted checkpoint, as `PaTHLlamaForCausalLM` built on the meta device with the converted
    config holds them."""

    source: dict[str, tuple[int, ...]]  # what the source must hold too, under the same name: shapes, in model order
    left_out: frozenset[str]  # what a source may also hold and is not copied
    added: dict[int, dict[str, TensorMeta]]  # what each PaTH layer adds, by name in its attention, in model order
    input_embeddings: str  # the name of the input embeddings


def path_parameters(attention: PaTHLlamaAttention) -> list[tuple[str, nn.Parameter]]:
    """The parameters a PaTH layer adds to the source attention (`PATH_MODULES`), by their name in `attention`."""
    return [(name, param) for name, param in attention.named_parameters() if name.split(".")[0] in PATH_MODULES]


def converted_layout(config: PaTHLlamaConfig) -> Layout:
    """The layout of the model `config` describes, from the model itself: PaTHLlama with an architecture's flags
    (`Architecture.config_overrides`) holds that architecture's tensors under their names, plus what its PaTH layers
    add. A source may also hold a head tied to the embeddings, and (old checkpoints) RoPE's buffer in each attention
    layer: both are left out."""
    with torch.device("meta"):
        model = PaTHLlamaForCausalLM(config)
    parameters = dict(model.named_parameters())
    left_out = set(dict(model.named_parameters(remove_duplicate=False))) - set(parameters)
    added: dict[int, dict[str, TensorMeta]] = {}
    for name, module in model.named_modules():
        if isinstance(module, PaTHLlamaRoPEAttention):  # PaTHLlamaAttention too
            left_out.add(f"{name}.rotary_emb.inv_freq")
        if isinstance(module, PaTHLlamaAttention):
            added[module.layer_idx] = {
                local: TensorMeta(f"{name}.{local}", param.dtype, tuple(param.shape))
                for local, param in path_parameters(module)
            }
    new = {tensor.name for layer in added.values() for tensor in layer.values()}
    embeddings = model.get_input_embeddings().weight
    return Layout(
        source={name: tuple(param.shape) for name, param in parameters.items() if name not in new},
        left_out=frozenset(left_out),
        added=added,
        input_embeddings=next(name for name, param in parameters.items() if param is embeddings),
    )


def _named_sizes(shape: tuple[int, ...], config: PaTHLlamaConfig) -> str:
    """`"hidden_size x intermediate_size"`: each size named by the config field (or product) of that value."""
    names: dict[int, str] = {}
    for name, size in (
        ("hidden_size", config.hidden_size),
        ("intermediate_size", config.intermediate_size),
        ("vocab_size", config.vocab_size),
        ("head_dim", config.head_dim),
        ("num_attention_heads * head_dim", config.num_attention_heads * config.head_dim),
        ("num_key_value_heads * head_dim", config.num_key_value_heads * config.head_dim),
    ):
        names.setdefault(size, name)
    return " x ".join(names.get(size, str(size)) for size in shape)


def check_source_tensors(
    tensors: Iterable[TensorMeta], layout: Layout, config: PaTHLlamaConfig
) -> tuple[list[TensorMeta], list[TensorMeta]]:
    """The source tensors to copy and those to leave out (`layout.left_out`), after checking every name and shape
    against the `layout` of the converted model `config` describes.

    Raises `ConversionError` for a missing tensor, an unexpected one, or a shape that disagrees with the config.
    """
    kept, ignored = [], []
    for tensor in tensors:
        if tensor.name in layout.left_out:
            ignored.append(tensor)
            continue
        expected = layout.source.get(tensor.name)
        if expected is None:
            raise ConversionError(f"unexpected tensor {tensor.name!r} in the source: not part of its config's layout.")
        if tensor.shape != expected:
            raise ConversionError(
                f"tensor {tensor.name!r} has shape {list(tensor.shape)} but the config implies {list(expected)} "
                f"({_named_sizes(expected, config)}): the weights do not belong to this config."
            )
        kept.append(tensor)
    found = {tensor.name for tensor in kept}
    missing = [name for name in layout.source if name not in found]
    if missing:
        raise ConversionError(f"the source lacks {len(missing)} tensor(s) its config implies, e.g. {missing[0]!r}.")
    return kept, ignored


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "Layout",
    "check_attention",
    "check_source_config",
    "check_source_tensors",
    "converted_layout",
    "path_config_from",
    "path_parameters",
]
