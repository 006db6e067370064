# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTHLlama model configuration."""

import math
from collections.abc import Callable, Mapping
from enum import StrEnum
from typing import Any

from huggingface_hub.dataclasses import strict
from transformers import LlamaConfig

from .ops import BACKENDS


class RopeMode(StrEnum):
    """What the PaTH layers do with the source's RoPE (`PaTHLlamaConfig.rope_mode`, `path-hf convert --rope`); a
    member equals its string, which is what a config stores."""

    DROP = "drop"  # PaTH replaces RoPE (the paper)
    KEEP = "keep"  # RoPE on q and k, the transforms on top
    INTERLEAVE = "interleave"  # RoPE on q, k and w: its rotation by one position between consecutive transforms

    @property
    def keeps_rope(self) -> bool:
        """Whether the PaTH layers apply RoPE at all (so that with the transforms at identity they are the source)."""
        return self is not RopeMode.DROP


ROPE_MODES = tuple(mode.value for mode in RopeMode)
# The PaTH fields `check_path_fields` checks (the converter sets each of them: `ConvertOptions.config_fields`).
PATH_OPTION_FIELDS = (
    "rope_mode",
    "rope_max_wavelength",
    "path_attn_temperature_scale",
    "path_attn_temperature_length",
    "path_layers",
    "local_window",
    "local_sinks",
    "path_forget_gate",
    "path_forget_gate_bias",
    "path_w_rank",
    "path_conv_size",
    "path_init",
)
_UNSET = object()
PATH_INITS = ("default", "identity")
# Cache layer type of the PaTH layers (registered by cache_path_llama.PaTHCacheLayer).
PATH_LAYER_TYPE = "path_attention"
# Cache layer type of the local RoPE layers (`local_window`; registered by local_attention.LocalCacheLayer).
LOCAL_LAYER_TYPE = "local_attention"


def field_help(name: str) -> str:
    """The documentation of the `PaTHLlamaConfig` field `name` (its entry in the class docstring's Args), on one line:
    the one explanation of a PaTH option, which the converter's flags show too."""
    lines = PaTHLlamaConfig.__doc__.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"        {name} ("))
    entry = []
    for line in lines[start + 1 :]:
        if not line.startswith(" " * 12):
            break
        entry.append(line.strip())
    return " ".join(entry)


def source_context(config: Any) -> int | None:
    """The source's training context, read off a model's config (a source's, or a PaTHLlama's that keeps its RoPE
    parameters): `original_max_position_embeddings` of its RoPE parameters if they have one (a RoPE scaled beyond its
    training), else `max_position_embeddings` (None for a config without either)."""
    rope_parameters = getattr(config, "rope_parameters", None) or {}
    return rope_parameters.get("original_max_position_embeddings") or getattr(config, "max_position_embeddings", None)


def _config_name(field: str, value: Any = _UNSET) -> str:
    """How the config's checks name a field (`rope_max_wavelength`) or a setting of it (`rope_mode='drop'`)."""
    return field if value is _UNSET else f"{field}={value!r}"


def check_path_fields(values: Mapping[str, Any], name: Callable[..., str] = _config_name) -> None:
    """The checks of the PaTH fields that stand on their own (not on the model's shape), written once for the config
    (`validate_architecture`) and the converter's options, which name the fields as their flags: `name(field)` names
    a field, `name(field, value)` a setting of it. Raises `ValueError`."""
    mode, wavelength = values["rope_mode"], values["rope_max_wavelength"]
    if mode not in ROPE_MODES:
        raise ValueError(f"{name('rope_mode')} must be one of {ROPE_MODES}, got {mode!r}.")
    if wavelength is not None:
        if not RopeMode(mode).keeps_rope:
            raise ValueError(
                f"{name('rope_max_wavelength')} limits the RoPE that PaTH layers keep, but "
                f"{name('rope_mode', RopeMode.DROP.value)} removes it: use {name('rope_mode', RopeMode.KEEP.value)} or "
                f"{name('rope_mode', RopeMode.INTERLEAVE.value)} with it."
            )
        if not (math.isfinite(wavelength) and wavelength > 0):
            raise ValueError(f"{name('rope_max_wavelength')} must be a positive number of tokens, got {wavelength:g}.")
    scale, length = values["path_attn_temperature_scale"], values["path_attn_temperature_length"]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not (math.isfinite(scale) and scale >= 0):
        raise ValueError(
            f"{name('path_attn_temperature_scale')} must be a number >= 0 (0 turns the temperature off), got {scale!r}."
        )
    if length is not None and (isinstance(length, bool) or not isinstance(length, int) or length < 1):
        raise ValueError(f"{name('path_attn_temperature_length')} must be a positive number of tokens, got {length!r}.")
    bias = values["path_forget_gate_bias"]
    if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
        raise ValueError(f"{name('path_forget_gate_bias')} must be a finite number, got {bias!r}.")
    if values["path_init"] not in PATH_INITS:
        raise ValueError(f"{name('path_init')} must be one of {PATH_INITS}, got {values['path_init']!r}.")
    if values["path_conv_size"] < 0:
        raise ValueError(
            f"{name('path_conv_size')} must be >= 0 (0 turns the convolution off), got {values['path_conv_size']}."
        )
    if values["path_w_rank"] is not None and values["path_w_rank"] < 1:
        raise ValueError(
            f"{name('path_w_rank')} must be a positive integer (unset: full rank), got {values['path_w_rank']}."
        )
    window, sinks = values["local_window"], values["local_sinks"]
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"{name('local_window')} must be a positive number of tokens, got {window!r}.")
    if isinstance(sinks, bool) or not isinstance(sinks, int) or sinks < 0:
        raise ValueError(f"{name('local_sinks')} must be a number of tokens >= 0, got {sinks!r}.")
    if sinks and window is None:
        raise ValueError(f"{name('local_sinks')} are the sinks of the local layers: they need {name('local_window')}.")
    if sinks and window is not None and sinks >= window:
        raise ValueError(
            f"{name('local_sinks')} {sinks} must be fewer than the {name('local_window')} {window} keys they sit in."
        )


@strict
class PaTHLlamaConfig(LlamaConfig):
    r"""
    Configuration of a Llama-architecture decoder whose attention layers use PaTH position encoding (Yang et al.,
    2025, arXiv 2505.16381): the logit of query i and key j is `q_i^T H_i H_{i-1} ... H_{j+1} k_j` with data-dependent
    Householder transforms `H_t = I - beta_t w_t w_t^T`. Every [`LlamaConfig`] field keeps its meaning; the fields
    below are added. It also describes Qwen2 (`attention_bias=True, attention_o_bias=False`) and Qwen3
    (`qk_norm=True`, explicit `head_dim`) checkpoints, so their state dicts load without renaming.

    Args:
        attention_o_bias (`bool`, *optional*):
            Whether `o_proj` has a bias. `None` means the same as `attention_bias` (Llama); Qwen2 has q/k/v biases
            and no `o_proj` bias.
        qk_norm (`bool`, *optional*, defaults to `False`):
            Per-head RMSNorm on queries and keys before RoPE (`self_attn.q_norm` / `self_attn.k_norm`, as in Qwen3).
        rope_mode (`str`, *optional*, defaults to `"drop"`):
            What PaTH layers do with RoPE. `"drop"`: PaTH replaces RoPE (the paper). `"keep"`: RoPE is applied to
            q and k and the PaTH transforms act on top, so with `beta = 0` a PaTH layer computes exactly what the
            source RoPE layer did. `"interleave"`: RoPE is applied to q, k and the Householder directions w, which
            puts RoPE's rotation by one position between consecutive transforms, `q_i^T H_i R^-1 H_{i-1} R^-1 ...
            H_{j+1} R^-1 k_j`: the logit depends on the tokens from j to i and not on where they stand, as RoPE's
            does (with `"keep"` it also depends on the absolute positions). With `beta = 0` it too is the source.
        rope_max_wavelength (`float`, *optional*):
            Critical-band partial RoPE, with `rope_mode="keep"` or `"interleave"`: PaTH layers rotate only the RoPE
            frequency pairs whose wavelength `2 pi / theta_i` (in tokens, of the model's own RoPE: its
            `rope_parameters`, YaRN or Llama 3 scaling included) is at most this; the slower pairs are not rotated at
            all (angle 0, for q, k and, with `"interleave"`, w). Set to the source's training context, it removes the
            pairs that never complete a turn in training, so no angle past that context is out of distribution and
            PaTH (with the forget gate) carries long-range position instead (FoPE, arXiv 2412.17739; p-RoPE, arXiv
            2410.06205). RoPE layers (outside `path_layers`) keep every pair. `None`: every pair rotates.
        path_attn_temperature_scale (`float`, *optional*, defaults to 0.0):
            Log-length attention temperature of the PaTH layers (Llama 4's `attn_temperature_tuning`): the query at
            position p is multiplied by `1 + scale * log(floor((p + 1) / length) + 1)`, which is exactly 1 inside
            `length` and grows slowly past it, so that attention stays as sharp over more keys. 0 turns it off.
        path_attn_temperature_length (`int`, *optional*):
            The `length` of the temperature above. `None`: the source's context, `original_max_position_embeddings`
            of the RoPE parameters if they have one, else `max_position_embeddings`.
        path_layers (`list[int]`, *optional*):
            Indices of the layers that use PaTH attention; the others are the source model's RoPE softmax
            attention. `None` means every layer.
        local_window (`int`, *optional*):
            Makes the RoPE layers (those outside `path_layers`) local, the hybrid of long-context models: each query
            sees the last `local_window` keys, itself included (Mistral's `sliding_window`: key j from query i when
            `0 <= i - j < local_window`), plus the `local_sinks` first keys. Set to at most the source's training
            context, no RoPE distance in a local layer is ever out of distribution, and long range is left to the PaTH
            layers. `None`: the RoPE layers see every earlier key.
        local_full_heads (`list[list[int]]`, *optional*):
            Query heads of the local layers that see every key, as `[layer, head]` pairs: the retrieval heads of a
            DuoAttention-style model (arXiv 2410.10819), chosen by a measured score (`path-hf convert --full-heads`),
            the other heads of their layer staying local. A layer holding such heads caches every key and takes the
            global layers' RoPE, which `path-hf eval`'s `@yarn` scales, for all its heads. Needs `local_window`.
        local_sinks (`int`, *optional*, defaults to 0):
            Attention sinks of the local layers (StreamingLLM, arXiv 2309.17453): the first `local_sinks` tokens of a
            sequence stay visible to every query, renumbered as StreamingLLM's cache renumbers them, as if they stood
            just before the window: query i sees sink s at distance `min(i, local_window - 1 + local_sinks) - s`, never
            further than the window reaches. Kept at their own distance instead, the sinks of SmolLM2-135M make its
            perplexity at 16384 worse than no sink at all (docs/smollm2/long-context). Needs `local_window`.
        path_forget_gate (`bool`, *optional*, defaults to `False`):
            Add the forget gate of PaTH-FoX: the logit of (i, j) gains `sum_{j<s<=i} g_s` per query head, with
            `g = log sigmoid(g_proj(x))`.
        path_w_rank (`int`, *optional*):
            Rank of the projection producing `w`. `None`: full rank, `Linear(hidden_size, num_key_value_heads *
            head_dim)`. An int r: `Linear(hidden_size, r)` followed by `Linear(r, num_key_value_heads * head_dim)`.
        path_conv_size (`int`, *optional*, defaults to 3):
            Kernel size of the depthwise causal convolution (followed by SiLU) applied to `w` before it is
            L2-normalised. 0 turns it off.
        path_beta_max (`float`, *optional*, defaults to 1.9):
            `beta = path_beta_max * sigmoid(bt_proj(x))`, in (0, 2]. Values of beta near 2 (eigenvalue -1) can make
            bf16 training diverge, hence a default below 2.
        path_backend (`str`, *optional*, defaults to `"auto"`):
            Kernel computing PaTH attention: `"fla"` (flash-linear-attention's Triton kernel), `"torch"` (any
            device and head dim) or `"auto"` (FLA on CUDA when installed and supported, torch otherwise).
        path_forget_gate_bias (`float`, *optional*, defaults to 0.0):
            Initial bias of `g_proj`: the forget gate starts at about `log sigmoid(path_forget_gate_bias)` per token.
            0 is FLA's init (about -0.69 a token: attention reaches back a few tokens until training opens the gate);
            larger values start with less forgetting (6: about -0.0025 a token).
        path_init (`str`, *optional*, defaults to `"default"`):
            How the PaTH parameters start. `"default"`: FLA's random init. `"identity"`: the gains of beta and g
            (`bt_gain`, `g_gain`) start at 0, so every Householder transform is exactly the identity (and the forget
            gate exactly 1) while the gains still receive gradients, so PaTH switches on at the first optimizer
            step. With `rope_mode="keep"` or `"interleave"` an identity-initialised model computes what its source
            model computed. A gain is its weight folded into [0, 1] (`|w|` near 0): it acts whatever value training
            gives the weight.

    ```python
    >>> from path_hf import PaTHLlamaConfig, PaTHLlamaForCausalLM

    >>> config = PaTHLlamaConfig(hidden_size=256, num_hidden_layers=4, num_attention_heads=4, path_forget_gate=True)
    >>> model = PaTHLlamaForCausalLM(config)
    ```"""

    model_type = "path_llama"
    # Tensor parallelism shards the MLPs only (with the embeddings and the head, as for Llama); every attention layer
    # stays whole on each rank. Llama's plan also splits q/k/v/o by heads, which PaTH's w_proj, w_conv1d, bt_proj,
    # g_proj and the gains would have to follow, heads alike, for the Householder transforms to meet their keys.
    base_model_tp_plan = {
        "layers.*.mlp.gate_proj": "colwise",
        "layers.*.mlp.up_proj": "colwise",
        "layers.*.mlp.down_proj": "rowwise",
    }

    attention_o_bias: bool | None = None
    qk_norm: bool = False
    rope_mode: str = RopeMode.DROP.value
    rope_max_wavelength: float | int | None = None
    path_layers: list[int] | None = None
    local_window: int | None = None
    local_sinks: int = 0
    local_full_heads: list[list[int]] | None = None
    path_forget_gate: bool = False
    path_forget_gate_bias: float | int = 0.0
    path_w_rank: int | None = None
    path_conv_size: int = 3
    path_beta_max: float | int = 1.9
    path_backend: str = "auto"
    path_init: str = "default"
    path_attn_temperature_scale: float | int = 0.0
    path_attn_temperature_length: int | None = None

    def __post_init__(self, **kwargs):
        if self.attention_o_bias is None:
            self.attention_o_bias = self.attention_bias
        if self.path_layers is not None:
            self.path_layers = sorted(set(self.path_layers))
        super().__post_init__(**kwargs)

    @property
    def layer_types(self) -> list[str]:
        """Per-layer attention type: `"path_attention"`, or for the other layers `"local_attention"` with
        `local_window` and `"full_attention"` without (derived from `path_layers` and `local_window`).

        `DynamicCache(config)` builds a `PaTHCacheLayer` for each PaTH layer and a `LocalCacheLayer` for each local
        one from it, which is how `generate` gets the right cache without being told.
        """
        # Each field read once (a config's attribute access costs microseconds, and the model reads this per forward).
        rope_type = LOCAL_LAYER_TYPE if self.local_window is not None else "full_attention"
        path_layers = self.path_layers
        path_layers = None if path_layers is None else set(path_layers)
        return [
            PATH_LAYER_TYPE if path_layers is None or layer_idx in path_layers else rope_type
            for layer_idx in range(self.num_hidden_layers)
        ]

    @layer_types.setter
    def layer_types(self, value):
        raise ValueError(
            "layer_types is derived from path_layers and local_window: set path_layers (None means every layer) and "
            "local_window instead."
        )

    def full_heads(self, layer_idx: int) -> list[int]:
        """The query heads of local layer `layer_idx` that see every key (`local_full_heads`), in order."""
        return sorted(head for layer, head in self.local_full_heads or () if layer == layer_idx)

    def is_path_layer(self, layer_idx: int) -> bool:
        """Whether layer `layer_idx` uses PaTH attention."""
        return self.path_layers is None or layer_idx in self.path_layers

    @property
    def attn_temperature_length(self) -> int:
        """The length past which the PaTH layers' attention temperature grows (`path_attn_temperature_length`)."""
        if self.path_attn_temperature_length is not None:
            return self.path_attn_temperature_length
        return source_context(self)

    def validate_architecture(self):
        """Part of `@strict`-powered validation: checks the shapes and the PaTH fields."""
        # Not Llama's hidden_size % num_attention_heads check: with an explicit head_dim (Qwen3) it need not hold.
        if self.num_attention_heads % self.num_key_value_heads != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of num_key_value_heads "
                f"({self.num_key_value_heads})."
            )
        check_path_fields({field: getattr(self, field) for field in PATH_OPTION_FIELDS})
        if self.path_backend not in BACKENDS:
            raise ValueError(f"path_backend must be one of {BACKENDS}, got {self.path_backend!r}.")
        if not 0 < self.path_beta_max <= 2:
            raise ValueError(f"path_beta_max must be in (0, 2], got {self.path_beta_max}.")
        if self.path_layers is not None:
            outside = [i for i in self.path_layers if not 0 <= i < self.num_hidden_layers]
            if outside:
                raise ValueError(
                    f"path_layers {outside} are not layer indices of a model with {self.num_hidden_layers} layers."
                )
        if self.local_window is not None:
            if self.path_layers is None or len(self.path_layers) == self.num_hidden_layers:
                raise ValueError(
                    "local_window makes the RoPE layers local, but every layer is a PaTH layer: list the PaTH layers "
                    "in path_layers, or leave local_window unset."
                )
        if self.local_full_heads is not None:
            if self.local_window is None:
                raise ValueError("local_full_heads are heads of the local layers that see every key: set local_window.")
            for pair in self.local_full_heads:
                if len(pair) != 2 or not 0 <= pair[1] < self.num_attention_heads:
                    raise ValueError(
                        f"local_full_heads holds [layer, head] pairs of query heads below {self.num_attention_heads}, "
                        f"got {pair}."
                    )
                if not 0 <= pair[0] < self.num_hidden_layers or self.is_path_layer(pair[0]):
                    raise ValueError(f"local_full_heads: layer {pair[0]} is not a local layer of the model.")
        if self.attention_dropout and (self.path_layers is None or self.path_layers):
            raise ValueError(
                f"PaTH attention has no attention dropout; got attention_dropout={self.attention_dropout}. Set it to 0."
            )

    def validate_layer_type(self):
        """`layer_types` is derived from `path_layers` and `local_window` and may hold `"path_attention"` and
        `"local_attention"`, types transformers does not list: nothing to check."""


__all__ = ["PaTHLlamaConfig", "RopeMode", "check_path_fields", "field_help", "source_context"]
