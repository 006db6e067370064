# Copyright 2026 The path-hf authors. Apache-2.0.
"""Local attention of a PaTHLlama's RoPE layers (`config.local_window`, `config.local_sinks`).

A local layer is the source's RoPE attention restricted to a sliding window of the last `window` keys, plus the first
`sinks` keys of the sequence (StreamingLLM's attention sinks, arXiv 2309.17453), renumbered as StreamingLLM's cache
renumbers them: query i sees sink s at distance `min(i, window - 1 + sinks) - s`, as if the sinks stood just before
the window. No RoPE distance in the layer is ever larger than `window - 1 + sinks`.

Importing this module registers `LocalCacheLayer` for the layer type `"local_attention"`, so that
`DynamicCache(config)` keeps, for each local layer, the sinks and the last `window - 1` tokens only.
"""

import torch
from transformers.cache_utils import DynamicLayer, StaticLayer
from transformers.models.llama.modeling_llama import repeat_kv, rotate_half

from .configuration_path_llama import LOCAL_LAYER_TYPE
from .ops_superblock import FUSED_CPU_ATTENTION

# Queries scored at a time by `local_attention` (each against its window and the sinks): nothing of size T x T forms.
BLOCK = 1024
# PyTorch's fused CPU attention with an additive mask, which also returns each query's log-sum-exp, so that the
# renumbered sinks' scores join the window's softmax without forming the window's logits: about 3x faster than the
# explicit products on one core (BENCHMARKS.md). Private to PyTorch, so `local_attention` falls back to the explicit
# products where it is missing (None), or for a dtype it does not take. A public setting: None takes the explicit
# products everywhere.
FUSED_ATTENTION = FUSED_CPU_ATTENTION
if FUSED_ATTENTION is not None and "attn_mask" not in str(FUSED_ATTENTION.default._schema):  # older PyTorch: no mask
    FUSED_ATTENTION = None
_FUSED_DTYPES = (torch.float32, torch.float64, torch.bfloat16)


def local_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    window: int,
    sinks: int,
    inv_freq: torch.Tensor,
    scaling: float,
    query_sequences: torch.Tensor | None = None,
    key_sequences: torch.Tensor | None = None,
    block: int | None = None,
    return_weights: bool = False,
    fused: bool = True,
    causal_kernel: bool = True,
    decode_kernel: bool = True,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Sliding-window attention with renumbered sinks.

    Args:
        query: `[B, HQ, T, D]`, rotated by RoPE at `query_positions`.
        key, value: `[B, H, S, D]` (`H` divides `HQ`), the keys rotated at `key_positions`; the last T are the
            queries' own tokens, any earlier ones a cache (`LocalCacheLayer`: the sinks, then the last keys).
        query_positions: `[B, T]` position of each query in its sequence.
        key_positions: `[B, S]` position of each key in its sequence, -1 for padding (never seen).
        window: a query at position i sees the keys at positions i - window + 1 to i.
        sinks: and the keys at positions below `sinks`, at distance `min(i, window - 1 + sinks) - s`: its query
            is rotated back by `max(0, i - (window - 1 + sinks))` positions against the sink's key (RoPE's angle
            depends on the distance alone).
        inv_freq: `[D / 2]` the RoPE frequencies the keys and queries were rotated with.
        scaling: the softmax scale.
        query_sequences, key_sequences: `[B, T]`, `[B, S]` which sequence of a packed row each token belongs to
            (tokens of different sequences never see each other); None: one sequence a row.
        block: queries at a time (default `BLOCK`).
        return_weights: also return the attention probabilities over the S keys, `[B, HQ, T, S]` (a sink seen both
            in the window and as a sink cannot be: the two are exclusive), for a decode step's few queries.
        fused: each block in PyTorch's fused attention (`FUSED_ATTENTION`) where it exists and takes the dtype;
            False: the explicit products. Either computes the same attention.
        causal_kernel: a prefill within the window (`within_window`) takes SDPA's causal kernel; False: the blocks
            (the same attention).
        decode_kernel: one query a row (a decode step), unpacked, takes `decode_attention`: its products with every
            key of the cache at once, the key-value heads shared without copies; False: the blocks (the same
            attention).

    Returns:
        `[B, T, HQ, D]`, and the probabilities if asked. A query that sees no key (padding) gets the mean of the
        values: finite, and masked later.
    """
    block = block or BLOCK
    batch_size, num_heads, length, _ = query.shape
    groups = num_heads // key.shape[1]
    offset = key.shape[2] - length
    if (
        causal_kernel
        and not return_weights
        and within_window(query_positions, key_positions, query_sequences, offset, window)
    ):
        # Every query sees every earlier key of its row, and no sink is renumbered: causal attention, SDPA's kernel
        # (which shares the key-value heads itself).
        output = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, is_causal=True, scale=scaling, enable_gqa=groups > 1
        )
        return output.transpose(1, 2)
    if decode_kernel and length == 1 and query_sequences is None and not return_weights:
        return decode_attention(
            query, key, value, query_positions, key_positions, window=window, sinks=sinks, inv_freq=inv_freq,
            scaling=scaling,
        )  # fmt: skip
    key, value = repeat_kv(key, groups), repeat_kv(value, groups)
    dtype = torch.promote_types(query.dtype, torch.float32)  # the softmax in at least float32 (float64 stays)
    hidden = torch.finfo(dtype).min
    num_sinks = count_sinks(key_positions, sinks)
    if num_sinks:
        query_back = rotated_back(query, query_positions, window, sinks, inv_freq)
        sink_positions = key_positions[:, None, :num_sinks]
    output = query.new_empty(batch_size, num_heads, length, value.shape[-1])
    weights = query.new_zeros(batch_size, num_heads, length, key.shape[2]) if return_weights else None
    fused = (
        fused
        and FUSED_ATTENTION is not None
        and not return_weights
        and query.device.type == "cpu"
        and query.dtype in _FUSED_DTYPES
    )
    # The fused op passes no gradient through its log-sum-exp: under autograd, blocks whose queries see a renumbered
    # sink take the explicit products.
    differentiable = torch.is_grad_enabled() and any(x.requires_grad for x in (query, key, value))
    for start in range(0, length, block):
        stop = min(start + block, length)
        first = max(0, start + offset - window + 1)
        i = query_positions[:, start:stop, None]
        j = key_positions[:, None, first : stop + offset]
        near = (j >= 0) & (j <= i) & (i - j < window)
        if query_sequences is not None:
            near &= query_sequences[:, start:stop, None] == key_sequences[:, None, first : stop + offset]
        if num_sinks:
            far = (sink_positions >= 0) & (sink_positions < sinks) & (i - sink_positions >= window)
            if query_sequences is not None:
                far &= query_sequences[:, start:stop, None] == key_sequences[:, None, :num_sinks]
            sink_logits = (query_back[:, :, start:stop] @ key[:, :, :num_sinks].transpose(-1, -2)).to(dtype)
            sink_logits = sink_logits.masked_fill(~far[:, None], hidden)
        sees_sink = bool(num_sinks) and bool(far.any())
        if fused and not (sees_sink and differentiable):
            output[:, :, start:stop] = _fused_block(
                query[:, :, start:stop],
                key[:, :, first : stop + offset],
                value[:, :, first : stop + offset],
                near,
                scaling,
                (sink_logits * scaling, value[:, :, :num_sinks]) if sees_sink else None,
            )
            continue
        logits = (query[:, :, start:stop] @ key[:, :, first : stop + offset].transpose(-1, -2)).to(dtype)
        logits = logits.masked_fill(~near[:, None], hidden)
        if num_sinks:
            logits = torch.cat([logits, sink_logits], dim=-1)
        probs = torch.softmax(logits * scaling, dim=-1).to(value.dtype)
        seen = stop + offset - first
        out = probs[..., :seen] @ value[:, :, first : stop + offset]
        if num_sinks:
            out = out + probs[..., seen:] @ value[:, :, :num_sinks]
        output[:, :, start:stop] = out
        if weights is not None:
            weights[:, :, start:stop, first : stop + offset] = probs[..., :seen]
            weights[:, :, start:stop, :num_sinks] += probs[..., seen:]
    return (output.transpose(1, 2), weights) if return_weights else output.transpose(1, 2)


def count_sinks(key_positions: torch.Tensor, sinks: int) -> int:
    """How many keys at the start of the rows (after any left padding) may be sinks: the sinks lie among them."""
    is_sink = (key_positions >= 0) & (key_positions < sinks)
    return int(is_sink.any(0).nonzero().max()) + 1 if sinks and bool(is_sink.any()) else 0


def rotated_back(
    query: torch.Tensor, query_positions: torch.Tensor, window: int, sinks: int, inv_freq: torch.Tensor
) -> torch.Tensor:
    """The queries `[B, HQ, T, D]` as a renumbered sink sees them: rotated by RoPE back by
    `max(0, i - (window - 1 + sinks))` positions."""
    back = (query_positions - (window - 1 + sinks)).clamp(min=0).to(inv_freq.dtype)
    angles = (back[..., None] * inv_freq).repeat(1, 1, 2)[:, None].to(query.dtype)  # [B, 1, T, D]
    return query * angles.cos() - rotate_half(query) * angles.sin()  # RoPE by -back


def decode_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    *,
    window: int,
    sinks: int,
    inv_freq: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`local_attention` of one query a row (`[B, HQ, 1, D]`, a decode step) over the keys of a cache: the products
    with every key in one matmul per key-value head (its query heads side by side, no copies of the keys), the window
    and the renumbered sinks as a mask, one softmax. The same attention as the blocks; `[B, 1, HQ, DV]`."""
    batch_size, num_heads, _, head_dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    groups = num_heads // kv_heads
    dtype = torch.promote_types(query.dtype, torch.float32)
    i = query_positions[:, -1:]  # [B, 1]
    near = (key_positions >= 0) & (key_positions <= i) & (i - key_positions < window)  # [B, S]
    logits = query.reshape(batch_size, kv_heads, groups, head_dim) @ key.transpose(-1, -2)  # [B, H, G, S]
    logits = logits.to(dtype)
    num_sinks = count_sinks(key_positions, sinks)
    visible = near
    if num_sinks:
        sink_positions = key_positions[:, :num_sinks]
        far = (sink_positions >= 0) & (sink_positions < sinks) & (i - sink_positions >= window)  # [B, n]
        if bool(far.any()):
            query_back = rotated_back(query, query_positions[:, -1:], window, sinks, inv_freq)
            sink_logits = query_back.reshape(batch_size, kv_heads, groups, head_dim) @ key[:, :, :num_sinks].transpose(
                -1, -2
            )
            far_keys = torch.nn.functional.pad(far, (0, length - num_sinks))[:, None, None]  # [B, 1, 1, S]
            padded = torch.nn.functional.pad(sink_logits.to(dtype), (0, length - num_sinks))
            logits = torch.where(far_keys, padded, logits)
            visible = near | far_keys[:, 0, 0]
    logits = logits.masked_fill(~visible[:, None, None], torch.finfo(dtype).min)
    probs = torch.softmax(logits * scaling, dim=-1).to(value.dtype)
    output = probs @ value  # [B, H, G, DV]
    return output.reshape(batch_size, num_heads, 1, value.shape[-1]).transpose(1, 2)


def full_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    scaling: float,
    query_sequences: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of some heads over every key (a local layer's full heads, `config.local_full_heads`).

    Args:
        query: `[B, F, T, D]` the full heads' queries; key, value: `[B, F, S, D]` their key-value heads' keys and
            values (the last T are the queries' own tokens).
        query_positions, key_positions: as `local_attention`'s (-1: padding, never seen).
        query_sequences: as `local_attention`'s; packed rows (no cache) see only their own sequence.

    Returns:
        `[B, T, F, D]`. A prefill of unpadded, unpacked rows runs SDPA's causal kernel; otherwise a mask by
        positions.
    """
    offset = key.shape[2] - query.shape[2]
    if offset == 0 and query_sequences is None and bool((key_positions >= 0).all()):
        output = torch.nn.functional.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
        return output.transpose(1, 2)
    seen = (key_positions[:, None, :] >= 0) & (key_positions[:, None, :] <= query_positions[:, :, None])
    if query_sequences is not None:
        seen &= query_sequences[:, :, None] == query_sequences[:, None, :]
    seen |= ~seen.any(-1, keepdim=True)  # a padded query sees every key: finite, and masked later
    output = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=seen[:, None], scale=scaling)
    return output.transpose(1, 2)


def _fused_block(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    near: torch.Tensor,
    scaling: float,
    sinks: tuple[torch.Tensor, torch.Tensor] | None,
) -> torch.Tensor:
    """One block of queries `[B, H, t, D]` against the keys `[B, H, s, D]` they may see (`near`, `[B, t, s]`) in
    PyTorch's fused attention, then the renumbered sinks (their scaled logits `[B, H, t, n]`, hidden where not seen,
    and their values) merged into the same softmax through the window's log-sum-exp. A query that sees no key
    (padding) gets the mean of the values: finite, and masked later."""
    bias = torch.zeros(near.shape, dtype=query.dtype, device=query.device)
    bias = bias.masked_fill(~near & near.any(-1, keepdim=True), float("-inf"))[:, None]
    output, lse = FUSED_ATTENTION(query, key, value, 0.0, False, attn_mask=bias, scale=scaling)
    if sinks is None:
        return output
    sink_logits, sink_values = sinks
    top = torch.maximum(lse, sink_logits.amax(-1))
    window_weight, sink_weights = (lse - top).exp(), (sink_logits - top[..., None]).exp()
    merged = window_weight[..., None] * output.to(lse.dtype) + sink_weights @ sink_values.to(lse.dtype)
    return (merged / (window_weight + sink_weights.sum(-1))[..., None]).to(value.dtype)


def within_window(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    query_sequences: torch.Tensor | None,
    offset: int,
    window: int,
) -> bool:
    """Whether the local attention is plain causal attention: a prefill (no cache) of one unpadded sequence a row, no
    longer than the window. The sinks then lie inside every query's window, at their own positions."""
    length = key_positions.shape[-1]
    if offset or query_sequences is not None or length > window:
        return False
    return bool((key_positions == torch.arange(length, device=key_positions.device)).all())


class LocalCacheLayer(DynamicLayer):
    """The cache of a local layer: the keys and values of the sinks and of the last `window - 1` tokens, with their
    positions. Bounded: it holds at most `sinks + window - 1` tokens (and any left padding before the sinks) whatever
    the length generated.

    Attributes:
        positions: `[B, S]` the position of each cached token in its sequence, -1 for padding.
        cumulative_length: tokens seen, cached or not (`get_seq_length`).
    """

    _layer_type = LOCAL_LAYER_TYPE
    # Dropped tokens cannot come back.
    is_croppable = False

    def __init__(self, **kwargs):
        super().__init__()
        self.positions: torch.Tensor | None = None
        self.cumulative_length = 0

    def update_local(
        self,
        key_states: torch.Tensor,
        value_states: torch.Tensor,
        positions: torch.Tensor,
        window: int | None,
        sinks: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Append new tokens (`[B, H, T, D]`, positions `[B, T]`); return every key, value and position the new
        tokens may see (the cache before them, then them), and keep only what later tokens may see (everything with
        `window=None`: a layer whose full heads see every key)."""
        keys, values = self.update(key_states, value_states)
        positions = positions if self.positions is None else torch.cat([self.positions, positions], dim=-1)
        self.cumulative_length += key_states.shape[-2]
        if window is None:
            self.positions = positions
            return keys, values, positions
        # Kept: the leading tokens up to the last sink of any row, and the last window - 1.
        is_sink = (positions >= 0) & (positions < sinks)
        head = int(is_sink.any(0).nonzero().max()) + 1 if sinks and bool(is_sink.any()) else 0
        tail = max(head, positions.shape[-1] - (window - 1))
        keep = torch.cat([torch.arange(head), torch.arange(tail, positions.shape[-1])]).to(positions.device)
        self.keys, self.values, self.positions = self.keys[:, :, keep], self.values[:, :, keep], positions[:, keep]
        return keys, values, positions

    def get_seq_length(self) -> int:
        return self.cumulative_length

    def reset(self) -> None:
        super().reset()
        self.positions = None
        self.cumulative_length = 0

    def reorder_cache(self, beam_idx: torch.LongTensor) -> None:
        super().reorder_cache(beam_idx)
        if self.positions is not None:
            self.positions = self.positions.index_select(0, beam_idx.to(self.positions.device))

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        if self.positions is not None:
            self.positions = self.positions.repeat_interleave(repeats, dim=0)

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        if self.positions is not None:
            self.positions = self.positions[indices]


class LocalStaticCacheLayer(StaticLayer):
    """What `StaticCache(config)` would build for a local layer: refused, with what to do instead. A static cache's
    slots are positions, and a local layer keeps the sinks and a moving window."""

    _layer_type = LOCAL_LAYER_TYPE

    def __init__(self, *args, **kwargs):
        raise ValueError(
            "Local layers (local_window) have no static cache: use the dynamic cache that generate builds by default "
            "(not cache_implementation='static'), or DynamicCache(config=model.config)."
        )


__all__ = ["BLOCK", "LocalCacheLayer", "LocalStaticCacheLayer", "full_attention", "local_attention"]
