# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend's inter-chunk stage in inference on CPU: the walk within superblocks, plain attention across them.

The walk (`ops_walk.py`) moves every key through every later block's P, one step at a time: 1 + D / C of the scores'
products, in batched products and elementwise passes over all heads and blocks that leave the CPU's caches. In
inference, the sequence is cut into superblocks of S blocks instead (`superblock_blocks`; `SUPERBLOCK_TOKENS` tokens
by default). Within a superblock, the walk runs as before (all superblocks at once, as a batch of S-block sequences).
Every earlier key, moved to the superblock's start, and every query of the superblock, moved back to it, then meet in
plain attention, which PyTorch's fused flash-attention CPU kernel computes with its row log-sum-exp (`_far_attention`);
the two softmaxes are merged by their log-sum-exps. The far keys move through one superblock's product of P at a
time: D / L of the scores' products, L = S * C tokens.

`superblock_attention` is the stage's entry, in the profiler range `path_attention.superblocks` (its far part in
`path_attention.far_attention`).

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import torch
from torch.profiler import record_function

from .ops_inputs import ChunkedInputs
from .ops_walk import gate_logits, inference_walk

# Tokens of a superblock, by default: inference on CPU over more than two of them runs over superblocks.
SUPERBLOCK_TOKENS = 512
# PyTorch's fused CPU attention that also returns the row log-sum-exp (also `local_attention`'s): a private op, so
# None where this torch lacks it, and then no superblocks.
FUSED_CPU_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def superblock_blocks(length: int, block: int, tokens: int) -> int:
    """Blocks of `block` tokens in a superblock of `tokens` (`superblock_attention`): 0 (none) unless a superblock
    holds two blocks or more and the sequence spans more than two superblocks (with two, measured slower)."""
    blocks = tokens // block
    return blocks if blocks >= 2 and length > 2 * tokens else 0


def _superblock_heads(x: torch.Tensor, batch: int) -> torch.Tensor:
    """[S, J * B, H, R, X] -> [J, B, H, S * R, X]: each superblock's rows (or keys) as one sequence per head."""
    S, _, H, R, X = x.shape
    return x.unflatten(1, (-1, batch)).permute(1, 2, 3, 0, 4, 5).reshape(-1, batch, H, S * R, X)


def _far_attention(
    q_far: torch.Tensor, k_far: torch.Tensor, v_far: torch.Tensor, p_far: torch.Tensor, dtype: torch.dtype | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each superblock's queries (moved back to its start) on every earlier key (moved to it).

    q_far [J, B, H, R, E], k_far [J, B, H, K, E] (superblock j's keys moved to its end), v_far [J, B, H, K, E], p_far
    [J, B, H, D, D] (the product of superblock j's P, acting on the keys' first D columns); products in `dtype` (None:
    the inputs'). Returns the output [J, B, H, R, E] and log-sum-exp [J, B, H, R, 1], -inf for superblock 0.
    """
    with record_function("path_attention.far_attention"):
        J, B, H, R, E = q_far.shape
        K, D = k_far.shape[-2], p_far.shape[-1]
        out = q_far.new_zeros(J, B, H, R, E)
        lse = q_far.new_full((J, B, H, R, 1), float("-inf"))
        keys = k_far.new_empty(B, H, (J - 1) * K, E)  # superblocks 0 ... j - 1's keys, at superblock j's start
        values = v_far[:-1].permute(1, 2, 0, 3, 4).flatten(2, 3)
        if dtype is not None:
            q_far, values = q_far.to(dtype), values.to(dtype)
        for j in range(1, J):
            seen = (j - 1) * K
            keys[:, :, :seen, :D] = keys[:, :, :seen, :D] @ p_far[j - 1].transpose(-1, -2)
            keys[:, :, seen : seen + K] = k_far[j - 1]
            o_j, lse_j = FUSED_CPU_ATTENTION(
                q_far[j], keys[:, :, : seen + K].to(q_far.dtype), values[:, :, : seen + K], scale=1.0
            )
            out[j], lse[j, ..., 0] = o_j, lse_j
        return out, lse


def superblock_attention(
    chunks: ChunkedInputs,
    *,
    logits: torch.Tensor,
    q_start: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    product_dtype: torch.dtype | None,
) -> torch.Tensor:
    """`ops_walk.inter_chunk`'s output in inference, for chunks in the superblock layout (`ops_inputs.to_chunks`;
    unpacked, CPU), from the intra-chunk stage's outputs (`logits` not gated).

    The far part's queries and keys carry the gate as the walk's do (`ops_walk._fold_gate`): query head h's row carries
    e_h, a key -G_j per query head, which P leaves alone; the queries' G_i, the same for every key of a row, is added to
    its log-sum-exp. The far products run in `product_dtype` where the gate stays out of them (no gate).
    """
    with record_function("path_attention.superblocks"):
        S, B, G, C = chunks.superblock, chunks.batch, chunks.group, chunks.chunk_size
        D, DV = p.shape[-1], chunks.v.shape[-1] - 1
        logits = gate_logits(chunks, logits, chunks.gate_rows)
        o_near, lse_near = inference_walk(
            chunks, logits, q_start, k_end, p, last_step=S - 1, product_dtype=product_dtype
        )
        # Queries moved back to their superblock's start: q~ of block s through P_{s - 1} ... P_0 of its superblock.
        prefix = [torch.eye(D, dtype=p.dtype, device=p.device).expand_as(p[0])]
        for s in range(S - 1):
            prefix.append(p[s] @ prefix[-1])
        q_far = q_start @ torch.stack(prefix)
        # Keys moved to their superblock's end: k~ of block s through P_{s + 1} ... P_{S - 1}; the superblock's product.
        suffix = [torch.eye(D, dtype=p.dtype, device=p.device).expand_as(p[0])]
        for s in reversed(range(1, S)):
            suffix.append(suffix[-1] @ p[s])
        k_far = k_end @ torch.stack(suffix[::-1]).transpose(-1, -2)
        p_far = p[S - 1] @ prefix[-1]  # P_{S - 1} ... P_0
        v_far = chunks.v[..., :DV]
        far_dtype = product_dtype if chunks.gate is None else None
        if chunks.gate is not None:  # the row of query head h carries e_h, a key -G_j of every query head
            rows = torch.eye(G, dtype=p.dtype, device=p.device).repeat_interleave(C, 0)  # [G * C, G]
            q_far = torch.cat([q_far, rows.expand(*q_far.shape[:-2], -1, -1)], -1)
            k_far = torch.cat([k_far, -chunks.gate.transpose(-1, -2)], -1)
        if v_far.shape[-1] != q_far.shape[-1]:  # the fused kernel wants one head size: pad the narrower side with zeros
            width = max(v_far.shape[-1], q_far.shape[-1])
            q_far, k_far, v_far = (torch.nn.functional.pad(x, (0, width - x.shape[-1])) for x in (q_far, k_far, v_far))
        J = q_far.shape[1] // B
        o_far, lse_far = _far_attention(
            _superblock_heads(q_far, B),
            _superblock_heads(k_far, B),
            _superblock_heads(v_far, B),
            p_far.unflatten(0, (J, B)),
            far_dtype,
        )
        # Back to the near walk's layout [S, J * B, H, G * C, X]
        o_far = o_far.unflatten(-2, (S, G * C)).permute(3, 0, 1, 2, 4, 5).flatten(1, 2)[..., :DV]
        lse_far = lse_far.unflatten(-2, (S, G * C)).permute(3, 0, 1, 2, 4, 5).flatten(1, 2)
        if chunks.gate is not None:
            lse_far = lse_far + chunks.gate_rows
        lse = torch.logaddexp(lse_near, lse_far)
        return o_near * (lse_near - lse).exp() + o_far.to(o_near.dtype) * (lse_far - lse).exp()


__all__ = ["FUSED_CPU_ATTENTION", "SUPERBLOCK_TOKENS", "superblock_attention", "superblock_blocks"]
