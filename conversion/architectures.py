# Copyright 2026 The path-hf authors. Apache-2.0.
"""What the converter accepts, as data: the source architectures, how their configs become a `PaTHLlamaConfig`,
and the tensors a source checkpoint must hold.

`PaTHLlamaConfig` describes each supported layout with a few flags (Qwen2: `attention_bias=True,
attention_o_bias=False`; Qwen3: `qk_norm=True`), so a source tensor keeps its name in the output: the table
`SOURCE_TENSORS` is both what is checked in the source and what is written.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass, field

from transformers import PretrainedConfig

from path_hf import PaTHLlamaConfig
from path_hf.errors import ConversionError
from path_hf.ops import FLA_HEAD_DIMS

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
class TensorSpec:
    """A tensor of the layout: name (with `{layer}` for each decoder layer), shape in `config_dims` names, and
    the `config_dims` flag it depends on (None: always present)."""

    name: str
    shape: tuple[str, ...]
    when: str | None = None

    @property
    def pattern(self) -> re.Pattern:
        return re.compile(re.escape(self.name).replace(re.escape("{layer}"), r"(?P<layer>\d+)"))


_ATTN = "model.layers.{layer}.self_attn"
_MLP = "model.layers.{layer}.mlp"
SOURCE_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec("model.embed_tokens.weight", ("vocab_size", "hidden_size")),
    TensorSpec("model.layers.{layer}.input_layernorm.weight", ("hidden_size",)),
    TensorSpec(f"{_ATTN}.q_proj.weight", ("q_dim", "hidden_size")),
    TensorSpec(f"{_ATTN}.q_proj.bias", ("q_dim",), when="attention_bias"),
    TensorSpec(f"{_ATTN}.k_proj.weight", ("kv_dim", "hidden_size")),
    TensorSpec(f"{_ATTN}.k_proj.bias", ("kv_dim",), when="attention_bias"),
    TensorSpec(f"{_ATTN}.v_proj.weight", ("kv_dim", "hidden_size")),
    TensorSpec(f"{_ATTN}.v_proj.bias", ("kv_dim",), when="attention_bias"),
    TensorSpec(f"{_ATTN}.o_proj.weight", ("hidden_size", "q_dim")),
    TensorSpec(f"{_ATTN}.o_proj.bias", ("hidden_size",), when="attention_o_bias"),
    TensorSpec(f"{_ATTN}.q_norm.weight", ("head_dim",), when="qk_norm"),
    TensorSpec(f"{_ATTN}.k_norm.weight", ("head_dim",), when="qk_norm"),
    TensorSpec("model.layers.{layer}.post_attention_layernorm.weight", ("hidden_size",)),
    TensorSpec(f"{_MLP}.gate_proj.weight", ("intermediate_size", "hidden_size")),
    TensorSpec(f"{_MLP}.gate_proj.bias", ("intermediate_size",), when="mlp_bias"),
    TensorSpec(f"{_MLP}.up_proj.weight", ("intermediate_size", "hidden_size")),
    TensorSpec(f"{_MLP}.up_proj.bias", ("intermediate_size",), when="mlp_bias"),
    TensorSpec(f"{_MLP}.down_proj.weight", ("hidden_size", "intermediate_size")),
    TensorSpec(f"{_MLP}.down_proj.bias", ("hidden_size",), when="mlp_bias"),
    TensorSpec("model.norm.weight", ("hidden_size",)),
    TensorSpec("lm_head.weight", ("vocab_size", "hidden_size"), when="untied_embeddings"),
)

# Source tensors that are not copied: RoPE's buffer (in old checkpoints), and a head tied to the embeddings.
IGNORED_SOURCE_TENSORS: tuple[TensorSpec, ...] = (
    TensorSpec(f"{_ATTN}.rotary_emb.inv_freq", ()),
    TensorSpec("lm_head.weight", (), when="tied_embeddings"),
)


def config_dims(config: PaTHLlamaConfig) -> dict[str, int | bool]:
    """The sizes and flags `SOURCE_TENSORS` is written in."""
    return {
        "vocab_size": config.vocab_size,
        "hidden_size": config.hidden_size,
        "intermediate_size": config.intermediate_size,
        "head_dim": config.head_dim,
        "q_dim": config.num_attention_heads * config.head_dim,
        "kv_dim": config.num_key_value_heads * config.head_dim,
        "attention_bias": config.attention_bias,
        "attention_o_bias": config.attention_o_bias,
        "qk_norm": config.qk_norm,
        "mlp_bias": config.mlp_bias,
        "tied_embeddings": config.tie_word_embeddings,
        "untied_embeddings": not config.tie_word_embeddings,
    }


def _match(name: str, specs: Iterable[TensorSpec], dims: dict, num_layers: int) -> TensorSpec | None:
    for spec in specs:
        found = spec.pattern.fullmatch(name)
        if found and (spec.when is None or dims[spec.when]):
            if "layer" not in found.groupdict() or int(found["layer"]) < num_layers:
                return spec
    return None


def check_source_tensors(
    tensors: Iterable[TensorMeta], config: PaTHLlamaConfig
) -> tuple[list[TensorMeta], list[TensorMeta]]:
    """The source tensors to copy and those to leave out (`IGNORED_SOURCE_TENSORS`), after checking every name
    and shape against `SOURCE_TENSORS` and `config`.

    Raises `ConversionError` for a missing tensor, an unexpected one, or a shape that disagrees with the config.
    """
    dims = config_dims(config)
    kept, ignored = [], []
    for tensor in tensors:
        if _match(tensor.name, IGNORED_SOURCE_TENSORS, dims, config.num_hidden_layers):
            ignored.append(tensor)
            continue
        spec = _match(tensor.name, SOURCE_TENSORS, dims, config.num_hidden_layers)
        if spec is None:
            raise ConversionError(f"unexpected tensor {tensor.name!r} in the source: not part of its config's layout.")
        expected = tuple(dims[dim] for dim in spec.shape)
        if tensor.shape != expected:
            raise ConversionError(
                f"tensor {tensor.name!r} has shape {list(tensor.shape)} but the config implies {list(expected)} "
                f"({' x '.join(spec.shape)}): the weights do not belong to this config."
            )
        kept.append(tensor)
    found = {tensor.name for tensor in kept}
    missing = [
        name
        for spec in SOURCE_TENSORS
        if spec.when is None or dims[spec.when]
        for name in (
            [spec.name.format(layer=i) for i in range(config.num_hidden_layers)]
            if "{layer}" in spec.name
            else [spec.name]
        )
        if name not in found
    ]
    if missing:
        raise ConversionError(f"the source lacks {len(missing)} tensor(s) its config implies, e.g. {missing[0]!r}.")
    return kept, ignored


__all__ = [
    "ARCHITECTURES",
    "Architecture",
    "IGNORED_SOURCE_TENSORS",
    "SOURCE_TENSORS",
    "TensorSpec",
    "check_attention",
    "check_source_config",
    "check_source_tensors",
    "config_dims",
    "path_config_from",
]
