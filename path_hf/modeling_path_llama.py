# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTHLlama: Llama (and Qwen2 / Qwen3) with PaTH attention (Yang et al., 2025, arXiv 2505.16381).

A PaTH layer scores query i against key j through the data-dependent Householder transforms of the tokens in
between, `q_i^T H_i ... H_{j+1} k_j` with `H_t = I - beta_t w_t w_t^T`, optionally with the forget gate of
PaTH-FoX. The layers listed in `config.path_layers` use it; the others keep the source model's RoPE attention.

The only relative imports are flat modules that `save_pretrained` copies next to the weights, so a saved model
loads with `trust_remote_code=True` where path_hf is not installed.
"""

import enum
import math
import re
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from transformers import initialization as init
from transformers.cache_utils import Cache, DynamicCache, DynamicLayer, StaticLayer
from transformers.masking_utils import create_causal_mask, find_packed_sequence_indices
from transformers.modeling_layers import GradientCheckpointingLayer
from transformers.modeling_outputs import BaseModelOutputWithPast
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.llama.modeling_llama import (
    LlamaAttention,
    LlamaDecoderLayer,
    LlamaForCausalLM,
    LlamaMLP,
    LlamaModel,
    LlamaPreTrainedModel,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
    apply_rotary_pos_emb,
    eager_attention_forward,
    repeat_kv,
    rotate_half,
)
from transformers.processing_utils import Unpack
from transformers.utils import TransformersKwargs, is_torchdynamo_compiling
from transformers.utils.deprecation import deprecate_kwarg
from transformers.utils.generic import merge_with_config_defaults
from transformers.utils.output_capturing import capture_outputs

from .cache_path_llama import PaTHCacheLayer, PaTHStaticCacheLayer
from .configuration_path_llama import LOCAL_LAYER_TYPE, PATH_LAYER_TYPE, PaTHLlamaConfig, RopeMode
from .local_attention import LocalCacheLayer, full_attention, local_attention
from .ops import path_attention


class PaTHGain(nn.Module):
    """`bt_gain` / `g_gain`: a gain per head in [0, 1] that scales beta or the log forget gate, `[..., heads]` in
    float32.

    The gain is the weight folded into [0, 1], a triangle wave of period 2 (`|w|` on [-1, 1]), so every value of the
    weight acts on the output with slope +-1: no optimizer hook keeps it in range and it never drifts where it does
    nothing. A weight of 0 switches the PaTH component off exactly (`path_init="identity"`) and still gets the
    gradient of a gain (slope +1 there), so training switches it on. A module of its own, so that `bt_proj` and
    `g_proj` stay the plain `nn.Linear`s they look like (as in FLA) and PEFT can list it in `modules_to_save`.
    """

    def __init__(self, num_heads: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(num_heads))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        phase = torch.remainder(self.weight.float(), 2)
        # min(phase, 2 - phase) in one op; at phase 1 the gradient goes to `phase` (slope +1), as `clamp` passes it
        return x * phase.clamp(max=2 - phase)


class PaTHShortConvolution(nn.Conv1d):
    """`w_conv1d`: depthwise causal convolution over time followed by SiLU (FLA's `ShortConvolution`), weight
    `[C, 1, K]`, no bias."""

    def __init__(self, hidden_size: int, kernel_size: int):
        super().__init__(hidden_size, hidden_size, kernel_size, groups=hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        conv_state: torch.Tensor | None = None,
        seq_pos: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """
        Args:
            x: `[B, T, C]` inputs, zeros at padding.
            conv_state: `[B, K - 1, C]` the inputs preceding `x` (a cache); zeros if None.
            seq_pos: `[B, T]` position of each token in its own sequence, for packed rows: no tap reaches back
                into the previous sequence.

        Returns:
            `[B, T, C]` float32.
        """
        T, K = x.shape[1], self.kernel_size[0]
        if conv_state is None:
            conv_state = x.new_zeros(x.shape[0], K - 1, x.shape[2])
        history = torch.cat([conv_state, x], dim=1).float()
        weight = self.weight.float()
        if seq_pos is None and T == 1:  # a decode step: its K taps in two small ops (tap j reads x_{t - (K - 1 - j)});
            # on CPU, F.conv1d's set-up costs about 15x that for one token (bench/decode_cpu.py)
            return F.silu((history * weight[:, 0].t()).sum(1, keepdim=True))
        if seq_pos is None:  # one op over the whole sequence
            return F.silu(F.conv1d(history.transpose(1, 2), weight, groups=weight.shape[0]).transpose(1, 2))
        out = 0
        for shift in range(K):  # tap `shift` reads x_{t - shift}
            tap = history[:, K - 1 - shift : K - 1 - shift + T]
            if seq_pos is not None:
                tap = tap * (seq_pos >= shift)[..., None]
            out = out + tap * weight[:, 0, K - 1 - shift]
        return F.silu(out)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """`x / sqrt(|x|^2 + eps)` over the last dim (FLA's `l2_norm`); zero vectors stay zero."""
    return x * torch.rsqrt(x.pow(2).sum(-1, keepdim=True) + eps)


# A parameter of decoder layer `layer` in a checkpoint: `model.layers.{layer}.` (Llama's layout, which PaTHLlama keeps).
LAYER_PARAMETER = re.compile(r"model\.layers\.(?P<layer>\d+)\.")

# The modules a PaTH layer adds to the source attention (FLA's names, and the gains), in registration order; the
# forget gate's come only with `path_forget_gate`.
FORGET_GATE_MODULES = ("g_proj", "g_gain")
PATH_MODULES = ("w_proj", "w_conv1d", "bt_proj", "bt_gain", *FORGET_GATE_MODULES)

# A gain's initial weight for each `path_init`: 1 leaves beta and g as their projections make them (FLA's init), 0 makes
# every Householder transform the identity and the forget gate 1.
PATH_GAIN_INIT = {"default": 1.0, "identity": 0.0}


class PaTHLlamaRoPEAttention(LlamaAttention):
    """The source model's RoPE softmax attention: Llama's, plus Qwen3's per-head `q_norm` / `k_norm`
    (`config.qk_norm`) and an `o_proj` bias set apart from the q/k/v biases (`config.attention_o_bias`, Qwen2)."""

    def __init__(self, config: PaTHLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        if config.attention_o_bias != config.attention_bias:
            self.o_proj = nn.Linear(
                config.num_attention_heads * self.head_dim, config.hidden_size, bias=config.attention_o_bias
            )
        if config.qk_norm:  # Qwen3: RMSNorm over each head, before RoPE
            self.q_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
            self.k_norm = LlamaRMSNorm(self.head_dim, eps=config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def project_qkv(
        self, hidden_states: torch.Tensor, position_embeddings: tuple[torch.Tensor, torch.Tensor] | None
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q `[B, T, HQ, D]`, k `[B, T, H, D]`, v `[B, T, H, D]`; RoPE applied if `position_embeddings` is given."""
        hidden_shape = (*hidden_states.shape[:-1], -1, self.head_dim)
        query_states = self.q_norm(self.q_proj(hidden_states).view(hidden_shape))
        key_states = self.k_norm(self.k_proj(hidden_states).view(hidden_shape))
        value_states = self.v_proj(hidden_states).view(hidden_shape)
        if position_embeddings is not None:
            cos, sin = position_embeddings
            query_states, key_states = apply_rotary_pos_emb(query_states, key_states, cos, sin, unsqueeze_dim=2)
        return query_states, key_states, value_states

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        query_states, key_states, value_states = self.project_qkv(hidden_states, position_embeddings)
        # Llama's forward from here on, with q, k, v in the cache layout [B, heads, T, D].
        query_states, key_states, value_states = (x.transpose(1, 2) for x in (query_states, key_states, value_states))
        if cache is not None:
            key_states, value_states = cache.update(key_states, value_states, self.layer_idx, kwargs=kwargs)

        attention_interface = ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, eager_attention_forward
        )
        attn_output, attn_weights = attention_interface(
            self,
            query_states,
            key_states,
            value_states,
            attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout,
            scaling=self.scaling,
            **kwargs,
        )
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights

    def _cache_layer(self, cache: Cache) -> DynamicLayer | StaticLayer:
        """This layer's cache, for the attentions whose cache layers are their own (PaTH, local; the RoPE attention's
        are transformers', which `cache.update` serves): one of `_cache_layer_classes`. An empty layer of another
        class (a cache built without the config, `DynamicCache()`) is replaced by the class for its kind, `"static"`
        for a `StaticLayer`, `"dynamic"` otherwise; a layer that holds keys, or of a kind with no class, is refused."""
        while len(cache.layers) <= self.layer_idx and cache.layer_class_to_replicate is not None:
            cache.layers.append(cache.layer_class_to_replicate())
        layer = cache.layers[self.layer_idx]
        if not isinstance(layer, tuple(self._cache_layer_classes.values())):
            static = isinstance(layer, StaticLayer)
            layer_class = self._cache_layer_classes.get("static" if static else "dynamic")
            holds_keys = layer.get_seq_length() > 0
            if holds_keys or layer_class is None:
                raise ValueError(
                    f"Layer {self.layer_idx} is a {self._layer_kind} but its cache is a {type(layer).__name__}"
                    f"{' that already holds keys' if holds_keys else ''}: {self._cache_advice}"
                )
            layer = layer_class(layer.max_cache_len) if static else layer_class()
            cache.layers[self.layer_idx] = layer
        return layer


class PaTHLlamaLocalAttention(PaTHLlamaRoPEAttention):
    """The source's RoPE attention made local (`config.local_window`): each query sees the last `local_window` keys
    and the `local_sinks` first ones, renumbered into the window (`local_attention`). Its cache is a
    `LocalCacheLayer`, which keeps only those."""

    # Its cache layer (`_cache_layer`): dynamic only, and what to build instead of another.
    _cache_layer_classes = {"dynamic": LocalCacheLayer}
    _layer_kind = "local layer (local_window)"
    _cache_advice = (
        "local layers take a dynamic cache built from the model's config, `DynamicCache(config=model.config)`."
    )

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        local_positions: torch.Tensor | None = None,
        local_sequences: torch.Tensor | None = None,
        rope_inv_freq: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            local_positions: `[B, T]` each token's position in its sequence, -1 for padding (`PaTHLlamaModel` passes
                them, with `rope_inv_freq`, the frequencies of its rotary embedding).
            local_sequences: `[B, T]` which sequence of a packed row each token belongs to, or None.

        Returns:
            The output `[B, T, hidden]`, and the attention weights `[B, HQ, 1, S]` of a decode step (one new token
            after S - 1 seen) when they are asked for (`output_attentions`), over every key seen, as eager attention
            returns them (0 on the keys the layer no longer sees or caches). Otherwise None: a prefill forms no
            attention matrix.
        """
        if local_positions is None or rope_inv_freq is None:
            raise ValueError("A local layer needs local_positions and rope_inv_freq (PaTHLlamaModel passes them).")
        window, sinks = self.config.local_window, self.config.local_sinks
        full_heads = self.config.full_heads(self.layer_idx)
        query_states, key_states, value_states = self.project_qkv(hidden_states, position_embeddings)
        query_states, key_states, value_states = (x.transpose(1, 2) for x in (query_states, key_states, value_states))
        key_positions = local_positions
        if cache is not None:  # a layer with full heads keeps every key
            key_states, value_states, key_positions = self._cache_layer(cache).update_local(
                key_states, value_states, local_positions, None if full_heads else window, sinks
            )
        if local_sequences is not None and key_positions.shape[-1] != local_positions.shape[-1]:
            raise ValueError("Packed sequences cannot continue a cache.")
        decode_weights = cache is not None and hidden_states.shape[1] == 1
        decode_weights = decode_weights and kwargs.get("output_attentions", self.config.output_attentions)
        attn_output = local_attention(
            query_states,
            key_states,
            value_states,
            local_positions,
            key_positions,
            window=window,
            sinks=sinks,
            inv_freq=rope_inv_freq,
            scaling=self.scaling,
            query_sequences=local_sequences,
            key_sequences=local_sequences,
            return_weights=decode_weights,
        )
        if full_heads:
            attn_output = attn_output[0] if decode_weights else attn_output
            attn_output[:, :, full_heads] = full_attention(
                query_states[:, full_heads],
                key_states[:, [head // self.num_key_value_groups for head in full_heads]],
                value_states[:, [head // self.num_key_value_groups for head in full_heads]],
                local_positions,
                key_positions,
                self.scaling,
                local_sequences,
            )
            decode_weights = False  # the full heads' weights are not formed
        attn_weights = None
        if decode_weights:  # over the S keys seen: a cached key's index is its position plus the row's padding
            attn_output, kept_weights = attn_output
            seen = self._cache_layer(cache).get_seq_length()
            index = (key_positions + (seen - 1 - local_positions)).clamp(min=0)  # padding: weight 0, anywhere
            attn_weights = kept_weights.new_zeros(*kept_weights.shape[:3], seen)
            attn_weights.scatter_add_(-1, index[:, None, None].expand_as(kept_weights), kept_weights)
        attn_output = attn_output.reshape(*hidden_states.shape[:-1], -1).contiguous()
        return self.o_proj(attn_output), attn_weights


def rope_band(config: PaTHLlamaConfig) -> torch.Tensor | None:
    """`[rotary_dim]` bool mask of the RoPE dims that PaTH layers rotate: the pairs whose wavelength `2 pi / theta_i`
    is at most `config.rope_max_wavelength`; None when every pair rotates. The frequencies are the model's own RoPE's
    (its `rope_parameters`, YaRN or Llama 3 scaling included), not those of a scaling swapped in at evaluation time:
    a pair trained without rotation stays so."""
    if config.rope_max_wavelength is None:
        return None
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        inv_freq, _ = LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    else:
        inv_freq, _ = ROPE_INIT_FUNCTIONS[rope_type](config, "cpu")
    return (2 * math.pi / inv_freq.double() <= config.rope_max_wavelength).repeat(2)  # cos/sin hold each angle twice


def band_limited(
    position_embeddings: tuple[torch.Tensor, torch.Tensor], rotate: torch.Tensor, attention_scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's `(cos, sin)` with the pairs outside `rotate` at angle 0: `cos` there is the rotary embedding's own
    `attention_scaling` (1, or YaRN's magnitude factor) and `sin` 0, exactly what a zero frequency gives."""
    cos, sin = position_embeddings
    rotate = rotate.to(cos.device)
    return cos.where(rotate, attention_scaling), sin.where(rotate, 0.0)


def attention_temperature(
    position_ids: torch.Tensor, scale: float, length: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """Llama 4's log-length query scale `1 + scale * log(floor((p + 1) / length) + 1)` at positions `p`: exactly 1
    below `length - 1`, then growing with the log of the number of `length`s; in `dtype` (float64 for float64
    queries), at least float32."""
    dtype = torch.promote_types(dtype, torch.float32)
    return 1.0 + scale * torch.log1p(torch.floor((position_ids.to(dtype) + 1.0) / length))


def packed_sequences(position_ids: torch.Tensor, batch_size: int) -> torch.Tensor | None:
    """Sequences packed in the rows of a batch, found where `position_ids` do not step by one (the rule of
    transformers' masks, as `DataCollatorWithFlattening` makes them).

    Returns None if every row holds one sequence, else `cu_seqlens` `[N + 1]` over the flattened `B * T` tokens (int32,
    transformers' `cu_seq_lens_q`).
    """
    seq_idx = find_packed_sequence_indices(position_ids.expand(batch_size, -1))
    if seq_idx is None:
        return None
    starts = F.pad(seq_idx[:, 1:] != seq_idx[:, :-1], (1, 0), value=True).flatten()
    return F.pad(starts.nonzero().squeeze(-1), (0, 1), value=starts.numel()).int()


def unpadded_sequences(attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The real tokens of a padded batch, `attention_mask` `[B, S]` (nonzero = token), each row one sequence.

    Returns None if nothing is padded, else the positions of the real tokens among the flattened `B * S` and
    `cu_seqlens` `[N + 1]` (int32) of the rows over them (rows of padding only are left out).
    """
    if attention_mask.all():
        return None
    lengths = attention_mask.sum(-1)
    indices = attention_mask.flatten().nonzero().squeeze(-1)
    return indices, F.pad(lengths[lengths > 0].cumsum(0), (1, 0)).int()


def sequence_positions(cu_seqlens: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """The position of each token within its sequence, `shape` `[B, T]`, for `cu_seqlens` over the flattened `B * T`
    tokens (computed on the device: no host synchronisation)."""
    positions = torch.arange(shape[0] * shape[1], device=cu_seqlens.device)
    is_start = torch.zeros(positions.numel() + 1, dtype=torch.bool, device=cu_seqlens.device)
    is_start[cu_seqlens.long()] = True
    start = torch.where(is_start[:-1], positions, 0).cummax(0).values
    return (positions - start).view(shape)


class PaTHStep(enum.Enum):
    """What a PaTH layer's forward does with its new tokens, decided once from them and its cache (`of`)."""

    PREFILL = "prefill"  # nothing cached: `path_attention` over the new tokens, filling the cache if there is one
    DECODE = "decode"  # one new token after cached ones: the recurrent step (`_decode_step`)
    CONTINUE = "continue"  # several new tokens after cached ones: `_chunked_prefill`

    @classmethod
    def of(cls, new_tokens: int, cache_layer: PaTHCacheLayer | PaTHStaticCacheLayer | None) -> tuple["PaTHStep", int]:
        """The step, and how many tokens the cache holds (0 where the step does not read it). A static cache decodes
        at any length without reading it: a compiled decode step never syncs with the host."""
        if cache_layer is None:
            return cls.PREFILL, 0
        if new_tokens == 1 and isinstance(cache_layer, PaTHStaticCacheLayer):
            return cls.DECODE, 0
        past = int(cache_layer.get_seq_length())
        if past == 0:
            return cls.PREFILL, 0
        return (cls.DECODE if new_tokens == 1 else cls.CONTINUE), past


class PaTHLlamaAttention(PaTHLlamaRoPEAttention):
    """PaTH attention: the source attention's projections, with the Householder transforms of the tokens between
    query and key in every logit, and RoPE only with `rope_mode="keep"` (on q and k) or `"interleave"` (on q, k and w).

    New parameters (FLA's names): `w_proj` (full rank, or low rank with `path_w_rank`), `w_conv1d` (short
    convolution, `path_conv_size > 0`), `bt_proj` (beta) and, with `path_forget_gate`, `g_proj`; all plain modules, the
    nonlinearities applied here as in FLA. Beside them, `bt_gain` and `g_gain` (`PaTHGain`) scale beta and g, so that
    `path_init="identity"` can start at exactly beta = 0 and g = 0.
    """

    # Whether its decoder layer is gradient checkpointed (set with the layer's, by `activation_checkpointing_enable`).
    # Training then recomputes the whole layer in backward, so the torch backend keeps its walk's activations rather
    # than recompute the walk a second time; otherwise it recomputes long walks (`path_attention`'s `recompute`).
    gradient_checkpointing = False
    # Keyword arguments of the torch backend (`ops_chunk.chunk_path_attention`'s knobs: `walk_merges`,
    # `superblock_tokens`, `window`, ...) that its `path_attention` calls pass on (`chunk_options`), set on a layer by
    # studies and tests that change how it computes (lab/smollm2/passkey_probe.py); none by default. With any set, the
    # layer runs the torch backend.
    chunk_options: Mapping[str, Any] = MappingProxyType({})
    # Its cache layers by the kind of cache (`_cache_layer`), and what to build instead of another.
    _cache_layer_classes = {"dynamic": PaTHCacheLayer, "static": PaTHStaticCacheLayer}
    _layer_kind = "PaTH layer"
    _cache_advice = (
        "build the cache from the model's config, `DynamicCache(config=model.config)` or "
        "`StaticCache(config=model.config, max_cache_len=...)`."
    )

    def __init__(self, config: PaTHLlamaConfig, layer_idx: int):
        super().__init__(config, layer_idx)
        self.num_key_value_heads = config.num_key_value_heads
        kv_dim = config.num_key_value_heads * self.head_dim
        if config.path_w_rank is None:
            self.w_proj = nn.Linear(config.hidden_size, kv_dim, bias=False)
        else:
            self.w_proj = nn.Sequential(
                nn.Linear(config.hidden_size, config.path_w_rank, bias=False),
                nn.Linear(config.path_w_rank, kv_dim, bias=False),
            )
        self.w_conv1d = PaTHShortConvolution(kv_dim, config.path_conv_size) if config.path_conv_size > 0 else None
        self.bt_proj = nn.Linear(config.hidden_size, config.num_key_value_heads, bias=True)
        self.bt_gain = PaTHGain(config.num_key_value_heads)
        if config.path_forget_gate:
            self.g_proj = nn.Linear(config.hidden_size, config.num_attention_heads, bias=True)
            self.g_gain = PaTHGain(config.num_attention_heads)
        else:
            self.g_proj = self.g_gain = None

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    def forward(
        self,
        hidden_states: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor] | None = None,
        attention_mask: torch.Tensor | None = None,
        cache: Cache | None = None,
        cu_seq_lens_q: torch.Tensor | None = None,
        indices_q: torch.Tensor | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """
        Args:
            hidden_states: `[B, T, hidden]`.
            position_embeddings: RoPE `(cos, sin)`, used with `rope_mode="keep"` or `"interleave"`.
            attention_mask: `[B, past + T]` padding mask (nonzero = token), or None.
            cache: continued if it holds this layer's past, filled otherwise.
            cu_seq_lens_q: `[N + 1]` boundaries of sequences over the flattened tokens (transformers' flash-attention
                kwarg): without padding or cache, sequences packed in rows, which never attend to each other; with
                `indices_q`, the rows of a padded batch over its real tokens. `PaTHLlamaModel` finds them once per
                forward, from the padding mask or from `position_ids` that restart.
            indices_q: positions of the real tokens among the flattened `B * T` when `attention_mask` pads; found
                here from the mask when not given.

        Returns:
            The output `[B, T, hidden]`, and the attention weights `[B, HQ, 1, S]` of a decode step (one new token
            after a cache of S - 1) when they are asked for (`output_attentions`, in the kwargs or the config), as
            eager attention returns them: `_decode_attention_weights`. Otherwise None: a prefill forms no attention
            matrix.
        """
        batch_size, seq_len = hidden_states.shape[:2]
        attention_mask = self._padding_mask(attention_mask)
        rope = position_embeddings if self.config.rope_mode != RopeMode.DROP else None
        q, k, v = self.project_qkv(hidden_states, rope)
        q = self._scale_queries(q, kwargs.get("position_ids"))
        w, beta, g = self._transform_inputs(hidden_states, attention_mask)

        cache_layer = self._cache_layer(cache) if cache is not None else None
        step, past = PaTHStep.of(seq_len, cache_layer)
        # A prefill keeps sequences apart: those packed in rows, or padded rows over their real tokens (`indices_q`).
        cu_seqlens = None
        if step is PaTHStep.PREFILL and (attention_mask is None or indices_q is not None):
            cu_seqlens = cu_seq_lens_q
        w = self._householder_vectors(
            w, rope, attention_mask=attention_mask, cache_layer=cache_layer, cu_seqlens=cu_seqlens
        )

        attn_weights = None
        if step is PaTHStep.DECODE:
            o = self._decode_step(q, k, v, w, beta, g, attention_mask=attention_mask, cache_layer=cache_layer)
            # Only when asked: the weights are read from the cache the step left, beside the output, not instead of it.
            if kwargs.get("output_attentions", self.config.output_attentions):
                attn_weights = self._decode_attention_weights(q, attention_mask=attention_mask, cache_layer=cache_layer)
        elif step is PaTHStep.PREFILL:
            o = self._prefill(
                q,
                k,
                v,
                w,
                beta,
                g,
                attention_mask=attention_mask,
                cu_seqlens=cu_seqlens,
                indices=indices_q,
                cache_layer=cache_layer,
            )
        else:  # PaTHStep.CONTINUE
            o = self._chunked_prefill(
                q, k, v, w, beta, g, attention_mask=attention_mask, cache_layer=cache_layer, past=past
            )
        return self.o_proj(o.reshape(batch_size, seq_len, -1)), attn_weights

    @staticmethod
    def _padding_mask(attention_mask: torch.Tensor | None) -> torch.Tensor | None:
        """The 2-D padding mask `[B, past + T]` as bool (True = token), or None; any other mask is refused."""
        if attention_mask is None:
            return None
        if attention_mask.ndim != 2:
            raise ValueError(
                f"PaTH layers take a 2-D padding mask [batch, past + new tokens], got {attention_mask.ndim}-D."
            )
        return attention_mask.bool()

    def _scale_queries(self, q: torch.Tensor, position_ids: torch.Tensor | None) -> torch.Tensor:
        """q `[B, T, HQ, D]` times the attention temperature at `position_ids` (`path_attn_temperature_scale`), in q's
        dtype; q itself when the temperature is off."""
        if not self.config.path_attn_temperature_scale:
            return q
        if position_ids is None:
            raise ValueError(
                "path_attn_temperature_scale needs the position_ids of the tokens (the model passes them)."
            )
        temperature = attention_temperature(
            position_ids, self.config.path_attn_temperature_scale, self.config.attn_temperature_length, q.dtype
        )
        return (q * temperature[..., None, None]).to(q.dtype)

    def _transform_inputs(self, hidden_states: torch.Tensor, attention_mask: torch.Tensor | None):
        """The new tokens' `w` `[B, T, kv_dim]` as `w_proj` gives it (`_householder_vectors` makes the unit vectors),
        and, in float32, `beta` `[B, T, H]` and the log forget gate `g` `[B, T, HQ]` (None without the gate): all 0 at
        padding, which transforms nothing and feeds nothing to the convolution."""
        w = self.w_proj(hidden_states)
        # beta in [0, path_beta_max) (float32): beta > 1 gives H_t a negative eigenvalue
        beta = self.bt_gain(self.config.path_beta_max * self.bt_proj(hidden_states).float().sigmoid())
        g = self.g_gain(F.logsigmoid(self.g_proj(hidden_states).float())) if self.g_proj is not None else None
        if attention_mask is not None:
            new_tokens = attention_mask[:, -hidden_states.shape[1] :]
            w, beta = w * new_tokens[..., None], beta * new_tokens[..., None]
            g = g * new_tokens[..., None] if g is not None else None
        return w, beta, g

    def _householder_vectors(self, w, rope, *, attention_mask, cache_layer, cu_seqlens) -> torch.Tensor:
        """The unit vectors `[B, T, H, D]` (float32) of the transforms from `_transform_inputs`' `w`: the short
        convolution (continuing `cache_layer`'s inputs, and within each sequence packed in a row by `cu_seqlens`),
        L2 normalisation, and with `rope_mode="interleave"` the keys' rotation `rope`."""
        batch_size, seq_len = w.shape[:2]
        if self.w_conv1d is not None:
            conv_state = seq_pos = None
            if cache_layer is not None:
                conv_state = cache_layer.update_conv_state(w, self.w_conv1d.kernel_size[0] - 1)
            if cu_seqlens is not None and attention_mask is None:  # packed: no tap reaches the previous sequence
                seq_pos = sequence_positions(cu_seqlens, (batch_size, seq_len))
            w = self.w_conv1d(w, conv_state, seq_pos)
        w = l2_normalize(w.float().view(batch_size, seq_len, self.num_key_value_heads, self.head_dim))
        if self.config.rope_mode == RopeMode.INTERLEAVE:  # w turns with the keys: H_t becomes R_t H_t R_t^T
            cos, sin = (x.float().unsqueeze(2) for x in rope)
            # A pure rotation: YaRN's cos/sin carry its magnitude factor (every pair alike), a temperature for q.k that
            # would stretch w off the unit sphere and H_t off a reflection (beta times that factor squared).
            w = (w * cos + rotate_half(w) * sin) / torch.hypot(cos[..., :1], sin[..., :1])
        return w

    def _prefill(self, q, k, v, w, beta, g, *, attention_mask, cu_seqlens, indices, cache_layer) -> torch.Tensor:
        """Nothing cached: PaTH attention over the new tokens (`_path_attention`), whose transformed keys, values and
        forget gates fill `cache_layer` when there is one."""
        o, k_cache = self._path_attention(
            q,
            k,
            v,
            w,
            beta,
            g,
            attention_mask=attention_mask,
            cu_seqlens=cu_seqlens,
            return_k_cache=cache_layer is not None,
            indices=indices,
        )
        if cache_layer is not None:
            cache_layer.update(k_cache.transpose(1, 2), v.transpose(1, 2))
            if g is not None:
                cache_layer.update_gate(g)
        return o

    def _path_attention(self, q, k, v, w, beta, g, *, attention_mask, cu_seqlens, return_k_cache, indices=None):
        """`path_attention` over `[B, S]` rows (shapes as `path_attention`'s). Padding (`attention_mask` False) is
        dropped and each row, or each sequence of `cu_seqlens` over the flattened rows, is its own sequence. With
        `indices` (the real tokens among the flattened rows), `cu_seqlens` is over them and the mask is not read."""
        kwargs = {"scale": self.scaling, "backend": self.config.path_backend, "return_k_cache": return_k_cache}
        if self.gradient_checkpointing and self.training:
            kwargs["recompute"] = False
        if self.chunk_options:
            kwargs.update(backend="torch", chunk_options=self.chunk_options)
        if attention_mask is not None and indices is None:
            indices, cu_seqlens = unpadded_sequences(attention_mask) or (None, cu_seqlens)
        if indices is None and cu_seqlens is None:
            return path_attention(q, k, v, w, beta, g, **kwargs)

        batch_size, seq_len = q.shape[:2]

        def flatten(x):
            x = x.flatten(0, 1)
            return (x if indices is None else x[indices]).unsqueeze(0)

        def unflatten(x):
            x = x.squeeze(0)
            if indices is not None:
                x = x.new_zeros(batch_size * seq_len, *x.shape[1:]).index_copy(0, indices, x)
            return x.view(batch_size, seq_len, *x.shape[1:])

        o, k_cache = path_attention(
            *(flatten(x) for x in (q, k, v, w, beta)),
            flatten(g) if g is not None else None,
            cu_seqlens=cu_seqlens,
            **kwargs,
        )
        return unflatten(o), unflatten(k_cache) if return_k_cache else None

    def _decode_step(self, q, k, v, w, beta, g, *, attention_mask, cache_layer) -> torch.Tensor:
        """One new token: its transform updates the cached keys, then it attends to them like to a KV cache."""
        keys, values = cache_layer.decode_update(w[:, 0], beta[:, 0], k.transpose(1, 2), v.transpose(1, 2))
        bias = None  # [B, HQ or 1, 1, S]
        if g is not None:  # FLA adds the gate before the softmax scale
            bias = (self.scaling * cache_layer.update_gate(g)[:, :, None, :]).to(q.dtype)
        key_mask = cache_layer.get_key_mask(attention_mask)
        if key_mask is not None:
            padding = ~key_mask[:, None, None, :]
            bias = q.new_zeros(padding.shape) if bias is None else bias
            bias = bias.masked_fill(padding, torch.finfo(q.dtype).min)
        # enable_gqa: the kernel reads each key head for its query heads (a decode step on CPU in half the time of
        # repeat_kv's copies at SmolLM2's 9 / 3 heads, exactly the same output).
        gqa = self.num_key_value_groups > 1
        o = F.scaled_dot_product_attention(
            q.transpose(1, 2), keys, values, attn_mask=bias, scale=self.scaling, enable_gqa=gqa
        )
        return o.transpose(1, 2)

    def _decode_attention_weights(self, q, *, attention_mask, cache_layer) -> torch.Tensor:
        """The attention probabilities `[B, HQ, 1, S]` of the decode step `_decode_step` just ran, over the S keys of
        `cache_layer` (a static cache's slots, the unused ones at 0): the softmax of
        `scale * (q . k_j + G_e - G_j)` with the keys as the step left them (transformed by every token after them),
        the forget gate where FLA adds it, and the padding masked, as the step's SDPA computes them. Computed in at
        least float32 and returned in q's dtype, as eager attention returns its weights."""
        dtype = torch.promote_types(q.dtype, torch.float32)
        keys = repeat_kv(cache_layer.keys, self.num_key_value_groups).to(dtype)
        logits = self.scaling * (q.transpose(1, 2).to(dtype) @ keys.transpose(-1, -2))
        if self.g_proj is not None:
            logits = logits + self.scaling * cache_layer.gate[:, :, None, :].to(dtype)
        key_mask = cache_layer.get_key_mask(attention_mask)
        if key_mask is not None:
            logits = logits.masked_fill(~key_mask[:, None, None, :], torch.finfo(dtype).min)
        return logits.softmax(-1).to(q.dtype)

    def _chunked_prefill(self, q, k, v, w, beta, g, *, attention_mask, cache_layer, past: int) -> torch.Tensor:
        """Several new tokens after `past` cached ones: PaTH attention over [cached ; new] tokens, where the cached
        keys, already transformed, get beta = 0. The transformed keys it returns are the new cache."""
        batch_size = q.shape[0]

        def with_past(past_part, new_part):
            return torch.cat([past_part, new_part], dim=1)

        keys = with_past(cache_layer.keys[:, :, :past].transpose(1, 2), k)
        values = with_past(cache_layer.values[:, :, :past].transpose(1, 2), v)
        g_all = None
        if g is not None:
            # -gate is a cumulative gate of the cached tokens (0 at the last one): its steps continue into g.
            past_cum = -cache_layer.gate[..., :past]
            past_g = torch.diff(past_cum, dim=-1, prepend=past_cum[..., :1]).transpose(1, 2)
            g_all = with_past(past_g, g)
        o, k_cache = self._path_attention(
            with_past(q.new_zeros(batch_size, past, *q.shape[2:]), q),
            keys,
            values,
            with_past(w.new_zeros(batch_size, past, *w.shape[2:]), w),
            with_past(beta.new_zeros(batch_size, past, beta.shape[2]), beta),
            g_all,
            attention_mask=attention_mask,
            cu_seqlens=None,
            return_k_cache=True,
        )
        cache_layer.update(k.transpose(1, 2), v.transpose(1, 2))
        cache_layer.replace_keys(k_cache.transpose(1, 2))
        if g is not None:
            cache_layer.update_gate(g)
        return o[:, past:]


class PaTHLlamaDecoderLayer(LlamaDecoderLayer):
    """Llama's decoder layer holding a PaTH, a local or a RoPE attention, as `config.layer_types` says."""

    def __init__(self, config: PaTHLlamaConfig, layer_idx: int):
        # Not LlamaDecoderLayer.__init__, which builds a LlamaAttention.
        GradientCheckpointingLayer.__init__(self)
        self.hidden_size = config.hidden_size
        self.attention_type = config.layer_types[layer_idx]
        attention_class = {PATH_LAYER_TYPE: PaTHLlamaAttention, LOCAL_LAYER_TYPE: PaTHLlamaLocalAttention}.get(
            self.attention_type, PaTHLlamaRoPEAttention
        )
        self.self_attn = attention_class(config=config, layer_idx=layer_idx)
        self.mlp = LlamaMLP(config)
        self.input_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = LlamaRMSNorm(config.hidden_size, eps=config.rms_norm_eps)


class PaTHLlamaPreTrainedModel(LlamaPreTrainedModel):
    config: PaTHLlamaConfig
    _no_split_modules = ["PaTHLlamaDecoderLayer"]
    # A PaTH prefill branches on the data (padding, packing); the decode step with a static cache is one graph.
    _can_compile_fullgraph = False
    _can_record_outputs = {
        "hidden_states": PaTHLlamaDecoderLayer,
        "attentions": PaTHLlamaRoPEAttention,
    }

    def _set_gradient_checkpointing(self, *args, **kwargs) -> None:
        super()._set_gradient_checkpointing(*args, **kwargs)
        # Each PaTH attention follows its own layer (`every_n_layers` leaves some layers to keep their activations).
        for layer in self.modules():
            if isinstance(layer, PaTHLlamaDecoderLayer) and isinstance(layer.self_attn, PaTHLlamaAttention):
                layer.self_attn.gradient_checkpointing = layer.gradient_checkpointing

    def _init_weights(self, module: nn.Module) -> None:
        # Llama's init, N(0, initializer_range) for Linears and convolutions and biases 0, is FLA's for w_proj,
        # w_conv1d, bt_proj and g_proj; PaTH's own are the gains and the forget gate's bias.
        super()._init_weights(module)
        if isinstance(module, PaTHGain):
            init.constant_(module.weight, PATH_GAIN_INIT[self.config.path_init])
        elif isinstance(module, PaTHLlamaAttention):
            # Its PaTH modules from the attention too, so that a layer initialises alone (`init_path_parameters`).
            # `post_init` and `from_pretrained` reach them first, as submodules, which marks them initialised: they
            # are drawn once.
            for name in PATH_MODULES:
                child = getattr(module, name)
                for submodule in child.modules() if child is not None else ():
                    self._initialize_weights(submodule)
            if module.g_proj is not None:
                init.constant_(module.g_proj.bias, self.config.path_forget_gate_bias)

    def _initialize_weights(self, module: nn.Module, is_custom_code: bool = False) -> None:
        # transformers skips a module of custom code that owns no parameter directly, as PaTHLlamaAttention, whose init
        # sets the forget gate's bias. `_init_weights` uses transformers' init functions, which leave loaded parameters
        # as they are, so it needs no such guard.
        super()._initialize_weights(module, is_custom_code and not isinstance(module, PaTHLlamaAttention))


def init_path_parameters(module: PaTHLlamaAttention, config: PaTHLlamaConfig) -> None:
    """Initialise the PaTH parameters (`PATH_MODULES`) of one `PaTHLlamaAttention` held without its model, as
    `from_pretrained` and `post_init` do (`PaTHLlamaPreTrainedModel._init_weights`): FLA's init (weights
    N(0, initializer_range), biases 0), the forget gate's bias `path_forget_gate_bias`, the gains `PATH_GAIN_INIT`.
    The source attention's parameters are left as they are. The checkpoint converter calls it for each layer."""
    PaTHLlamaPreTrainedModel(config)._init_weights(module)


class PaTHLlamaModel(PaTHLlamaPreTrainedModel, LlamaModel):
    """`LlamaModel` with PaTH decoder layers (and, in a hybrid, the local layers' own RoPE), as transformers' modular
    models derive from Llama: its `__init__` builds the rest."""

    def __init__(self, config: PaTHLlamaConfig):
        super().__init__(config)
        self.layers = nn.ModuleList(
            [PaTHLlamaDecoderLayer(config, layer_idx) for layer_idx in range(config.num_hidden_layers)]
        )
        if LOCAL_LAYER_TYPE in config.layer_types:
            # The local layers' own RoPE, the same as the global layers' as built, but a separate module: scaling for
            # length (`path_hf.evaluation.rope_scaling`, which swaps `rotary_emb`) concerns the global layers only,
            # since no distance in a local layer exceeds its window.
            self.local_rotary_emb = LlamaRotaryEmbedding(config=config)
        self.post_init()

    @deprecate_kwarg("past_key_values", "5.40.0", new_name="cache")
    @merge_with_config_defaults
    @capture_outputs
    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.LongTensor | None = None,
        cache: Cache | None = None,
        inputs_embeds: torch.Tensor | None = None,
        use_cache: bool | None = None,
        **kwargs: Unpack[TransformersKwargs],
    ) -> BaseModelOutputWithPast:
        """`LlamaModel.forward`, except that each layer gets the mask of its type (PaTH layers the 2-D padding mask,
        with the boundaries of padded or packed sequences found once: `cu_seq_lens_q`, `indices_q`) and that, when not
        given, `position_ids` count real tokens only (`cumsum(attention_mask) - 1`)."""
        if (input_ids is None) ^ (inputs_embeds is not None):
            raise ValueError("You must specify exactly one of input_ids or inputs_embeds")

        if inputs_embeds is None:
            inputs_embeds: torch.Tensor = self.embed_tokens(input_ids)

        if use_cache and cache is None:
            cache = DynamicCache(config=self.config)

        past_seen_tokens = cache.get_seq_length() if cache is not None else 0
        given_position_ids = position_ids
        if position_ids is None:
            position_ids = self._position_ids(inputs_embeds, attention_mask, past_seen_tokens)

        mask_mapping = self._mask_mapping(inputs_embeds, attention_mask, cache, position_ids, past_seen_tokens)
        mask_mapping[PATH_LAYER_TYPE], layer_kwargs = self._find_sequences(
            inputs_embeds, attention_mask, given_position_ids, past_seen_tokens, kwargs
        )

        hidden_states = inputs_embeds
        position_embeddings = self.rotary_emb(hidden_states, position_ids=position_ids)
        rope_by_type = self._rope_by_type(hidden_states, position_ids, position_embeddings)
        if LOCAL_LAYER_TYPE in layer_kwargs:
            layer_kwargs[LOCAL_LAYER_TYPE] = {
                **layer_kwargs[LOCAL_LAYER_TYPE],
                **self._local_kwargs(inputs_embeds, attention_mask, position_ids, given_position_ids, past_seen_tokens),
            }

        # Local layers with full heads take the global layers' RoPE (which evaluation may scale) for all their heads.
        full_layers = {layer for layer, _ in self.config.local_full_heads or ()}
        for layer_idx, decoder_layer in enumerate(self.layers[: self.config.num_hidden_layers]):
            rope, extra = rope_by_type[decoder_layer.attention_type], layer_kwargs[decoder_layer.attention_type]
            if layer_idx in full_layers:
                rope, extra = position_embeddings, {**extra, "rope_inv_freq": self.rotary_emb.inv_freq}
            hidden_states = decoder_layer(
                hidden_states,
                attention_mask=mask_mapping[decoder_layer.attention_type],
                position_embeddings=rope,
                position_ids=position_ids,
                cache=cache,
                use_cache=use_cache,
                **extra,
            )

        hidden_states = self.norm(hidden_states)
        return BaseModelOutputWithPast(
            last_hidden_state=hidden_states,
            cache=cache,
        )

    @staticmethod
    def _position_ids(
        inputs_embeds: torch.Tensor, attention_mask: torch.Tensor | None, past_seen_tokens: int
    ) -> torch.Tensor:
        """The positions of the new tokens when none are given: with a 2-D padding mask, real tokens counted
        (`cumsum(attention_mask) - 1`, 0 at padding), as generate() does, so that left padding does not shift the
        positions RoPE sees; otherwise `past_seen_tokens` onwards."""
        if attention_mask is not None and attention_mask.ndim == 2:
            position_ids = attention_mask.long().cumsum(-1) - 1
            return position_ids.masked_fill(attention_mask == 0, 0)[:, -inputs_embeds.shape[1] :]
        position_ids = torch.arange(inputs_embeds.shape[1], device=inputs_embeds.device) + past_seen_tokens
        return position_ids.unsqueeze(0)

    def _mask_mapping(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        cache: Cache | None,
        position_ids: torch.Tensor,
        past_seen_tokens: int,
    ) -> dict[str, torch.Tensor | None]:
        """The mask of each layer type: the 2-D padding mask for the PaTH layers, none for the local layers (they read
        the padding from their tokens' positions, `_local_kwargs`), Llama's causal mask for the full RoPE layers."""
        mask_mapping = {PATH_LAYER_TYPE: attention_mask, LOCAL_LAYER_TYPE: None}
        if "full_attention" in self.config.layer_types:
            # An empty cache is no cache: packed sequences are then recognised, as in the PaTH layers. A static cache
            # always counts: its keys have max_cache_len slots.
            mask_mapping["full_attention"] = create_causal_mask(
                config=self.config,
                inputs_embeds=inputs_embeds,
                attention_mask=attention_mask,
                cache=cache if cache is not None and (cache.is_compileable or past_seen_tokens > 0) else None,
                position_ids=position_ids,
            )
        return mask_mapping

    def _find_sequences(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        given_position_ids: torch.Tensor | None,
        past_seen_tokens: int,
        kwargs: dict,
    ) -> tuple[torch.Tensor | None, dict[str, dict]]:
        """The padded or packed sequences of a prefill, found once per forward rather than in every PaTH layer (each
        finding waits for the device), as transformers' flash-attention kwargs.

        Returns:
            The PaTH layers' padding mask (`attention_mask`, or None when it pads nothing), and the kwargs of each
            layer type: `kwargs`, plus for the PaTH layers of a padded batch `cu_seq_lens_q` and `indices_q` (its rows
            over the real tokens), or for every layer the `cu_seq_lens_q` / `_k` and `max_length_q` / `_k` of the
            sequences packed in rows (found from `position_ids` that restart, when no mask is given).
        """
        layer_kwargs = dict.fromkeys(self.config.layer_types, kwargs)
        # The length is tested first: a static cache's length is a tensor, which a compiled decode step must not branch
        # on.
        if PATH_LAYER_TYPE not in layer_kwargs or inputs_embeds.shape[1] <= 1 or past_seen_tokens != 0:
            # An eager step whose mask pads nothing (generate's, without padding) gives the PaTH layers none: they then
            # skip a dozen small ops each on every decoded token.
            padding_free = attention_mask is not None and attention_mask.ndim == 2 and not is_torchdynamo_compiling()
            if padding_free and bool(attention_mask.all()):
                return None, layer_kwargs
            return attention_mask, layer_kwargs
        if attention_mask is not None and attention_mask.ndim == 2:
            unpadded = unpadded_sequences(attention_mask.bool())
            if unpadded is None:
                return None, layer_kwargs
            indices, cu_seqlens = unpadded
            layer_kwargs[PATH_LAYER_TYPE] = {**kwargs, "cu_seq_lens_q": cu_seqlens, "indices_q": indices}
        elif attention_mask is None and given_position_ids is not None and kwargs.get("cu_seq_lens_q") is None:
            cu_seqlens = packed_sequences(given_position_ids, inputs_embeds.shape[0])
            if cu_seqlens is not None:  # for every layer: flash attention takes them too
                max_length = int(cu_seqlens.diff().max())
                packed = {
                    "cu_seq_lens_q": cu_seqlens,
                    "cu_seq_lens_k": cu_seqlens,
                    "max_length_q": max_length,
                    "max_length_k": max_length,
                }
                layer_kwargs = {layer_type: {**kwargs, **packed} for layer_type in layer_kwargs}
        return attention_mask, layer_kwargs

    def _rope_by_type(
        self,
        hidden_states: torch.Tensor,
        position_ids: torch.Tensor,
        position_embeddings: tuple[torch.Tensor, torch.Tensor],
    ) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """RoPE's `(cos, sin)` for each layer type: the global `position_embeddings`, the local layers' own RoPE
        (`local_rotary_emb`), and for the PaTH layers only those pairs that critical-band RoPE keeps turning
        (`rope_max_wavelength`)."""
        rope_by_type = dict.fromkeys(self.config.layer_types, position_embeddings)
        if LOCAL_LAYER_TYPE in rope_by_type:
            rope_by_type[LOCAL_LAYER_TYPE] = self.local_rotary_emb(hidden_states, position_ids=position_ids)
        rotate = rope_band(self.config)
        if rotate is not None and PATH_LAYER_TYPE in rope_by_type:
            rope_by_type[PATH_LAYER_TYPE] = band_limited(position_embeddings, rotate, self.rotary_emb.attention_scaling)
        return rope_by_type

    def _local_kwargs(
        self,
        inputs_embeds: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor,
        given_position_ids: torch.Tensor | None,
        past_seen_tokens: int,
    ) -> dict[str, torch.Tensor | None]:
        """What the local layers read: each token's position (-1 at padding), the sequences packed in a row (from
        `position_ids` that restart, when no mask or cache is given) and the RoPE frequencies."""
        batch_size, seq_len = inputs_embeds.shape[:2]
        positions = position_ids.expand(batch_size, -1)
        sequences = None
        if attention_mask is not None:
            if attention_mask.ndim != 2:
                raise ValueError(
                    f"Local layers take a 2-D padding mask [batch, past + new tokens], got {attention_mask.ndim}-D."
                )
            positions = positions.masked_fill(attention_mask[:, -seq_len:] == 0, -1)
        elif given_position_ids is not None and seq_len > 1 and past_seen_tokens == 0:
            sequences = find_packed_sequence_indices(positions)
        inv_freq = self.local_rotary_emb.inv_freq
        return {"local_positions": positions, "local_sequences": sequences, "rope_inv_freq": inv_freq}


class PaTHLlamaForCausalLM(PaTHLlamaPreTrainedModel, LlamaForCausalLM):
    def __init__(self, config: PaTHLlamaConfig):
        # Not LlamaForCausalLM.__init__, which builds a LlamaModel.
        PaTHLlamaPreTrainedModel.__init__(self, config)
        self.model = PaTHLlamaModel(config)
        self.vocab_size = config.vocab_size
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)

        # Initialize weights and apply final processing
        self.post_init()


__all__ = [
    "PaTHLlamaForCausalLM",
    "PaTHLlamaModel",
    "PaTHLlamaPreTrainedModel",
    "PaTHLlamaAttention",
    "PaTHLlamaRoPEAttention",
    "PaTHLlamaLocalAttention",
    "PaTHLlamaDecoderLayer",
    "PaTHGain",
    "PaTHShortConvolution",
    "init_path_parameters",
    "attention_temperature",
    "band_limited",
    "rope_band",
]
