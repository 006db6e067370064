# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend's inter-chunk stage: the walk over the block diagonals, with an online softmax and its backward.

The walk takes the intra-chunk stage's outputs (`ops_transform.py`): q~, the diagonal blocks' logits, k~ and P_n. At
step d every query chunk m >= d meets key chunk m - d at once (one batched matmul), then every running key is moved
through the next chunk's P (on the key side: a chunk has C keys but G * C query rows under GQA). A flash-attention
style online softmax keeps memory at O(T * (C + D)) per head, and Python loops over N chunks, not N^2 chunk pairs.

Backward is written out (`_InterChunkSoftmax`), as FlashAttention's is: the probabilities of every block come back
from the row log-sum-exp, and the walk runs backward, handing each step's key gradient through P to the step before.
Autograd through the walk would keep every step's softmax and slice its large inputs at every step. It starts from
the running keys of every step or, where keeping them would take more than `checkpoint_above_bytes`
(`CHECKPOINT_ABOVE_BYTES`), from those of every `steps_per_checkpoint`-th step (`STEPS_PER_CHECKPOINT`),
recomputing the others.

`inter_chunk` is the stage's entry (`inference_walk` without autograd); the walk runs in the profiler range
`path_attention.walk`, its backward in `path_attention.walk_backward`, each move of the running keys in
`path_attention.next_keys`.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import math
from itertools import pairwise

import torch
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from .ops_inputs import ChunkedInputs, chunk_rows, host_cu_seqlens

# Steps of the walk whose running keys backward recomputes from the first one's, when keeping every step's keys would
# take more than CHECKPOINT_ABOVE_BYTES (short sequences keep them all: no recomputation) and the caller does not say
# otherwise (`recompute`).
STEPS_PER_CHECKPOINT = 8
CHECKPOINT_ABOVE_BYTES = 32 * 2**20

# An argument whose exp is a normal number, one above the least (whose exp rounds below it in float32), for each
# compute dtype (`ops_inputs.chunk_inputs` computes in float32 or wider).
EXP_FLOOR = {dtype: math.log(torch.finfo(dtype).tiny) + 1 for dtype in (torch.float32, torch.float64)}


def floored_exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of `x` in place, `x` first raised to the least argument whose exp is a normal number of its dtype.

    PyTorch's vectorised CPU exp takes a slow path, 5-65x slower, on arguments whose exp underflows (bench/exp_cpu.py),
    and a softmax meets many: masked (-inf) logits and keys gated far below the row's maximum. Raised, each adds at
    most e times the dtype's smallest normal number (3.2e-38 in float32) to a sum whose largest term is 1.
    """
    return x.clamp_min_(EXP_FLOOR[x.dtype]).exp_()


def walk_last_step(cu_seqlens: torch.Tensor | None, n_chunks: int, chunk_size: int) -> int:
    """The last block diagonal with any visible key: N - 1, or fewer where no packed sequence spans N chunks."""
    if cu_seqlens is None:
        return n_chunks - 1
    bounds = pairwise(host_cu_seqlens(cu_seqlens))
    return max((b - 1) // chunk_size - a // chunk_size for a, b in bounds if b > a)


def gate_logits(chunks: ChunkedInputs, logits: torch.Tensor, gate_q: torch.Tensor | None) -> torch.Tensor:
    """The diagonal blocks' `logits` with the gate added, + G_i - G_j; `gate_q` is `chunks.gate_rows` (None: no
    gate, `logits` as they are)."""
    if gate_q is None:
        return logits
    gate_k = chunks.gate[..., None, :]  # [N, B, H, G, 1, C]: G_j of each key, per query head
    return logits + gate_q - chunk_rows(gate_k.expand(-1, -1, -1, -1, chunks.chunk_size, -1))


def _masked_logits(chunks: ChunkedInputs, scores: torch.Tensor, queries: slice, keys: slice) -> torch.Tensor:
    """`scores` of query chunks `queries` against key chunks `keys`, -inf where the query may not see the key: across
    packed sequences, and above the diagonal within a chunk."""
    mask = None
    if chunks.segment is not None:
        seg = chunks.segment
        mask = seg[queries][:, None, None, None, :, None] == seg[keys][:, None, None, None, None, :]
    if queries == keys:
        mask = chunks.causal if mask is None else mask & chunks.causal
    if mask is not None:
        scores = scores.unflatten(-2, (chunks.group, chunks.chunk_size)).masked_fill(~mask, float("-inf"))
        scores = chunk_rows(scores)
    return scores


def _step_logits(chunks: ChunkedInputs, scores: torch.Tensor, d: int, sink_after: int | None) -> torch.Tensor:
    """`scores` of step d (query chunks d ... N - 1 on key chunks 0 ... N - 1 - d) masked (`_masked_logits`); past
    step `sink_after` (not None), only query chunk d's scores on key chunk 0 (the sink) are kept."""
    N = chunks.n_chunks
    scores = _masked_logits(chunks, scores, queries=slice(d, N), keys=slice(0, N - d))
    if sink_after is not None and d > sink_after:
        scores = torch.cat([scores[:1], torch.full_like(scores[1:], float("-inf"))])
    return scores


def _fold_gate(
    chunks: ChunkedInputs,
    *,
    gate_q: torch.Tensor | None,
    q_start: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """q~, k~ and P_n as the walk uses them: with the gate folded into their matmuls.

    The row of query head h carries (G_i, e_h) after its D columns and a key carries (1, -G_j per head), so
    q . k_run = q^T P k + G_i - G_j; P acts as the identity on the extras.
    """
    if chunks.gate is None:
        return q_start, k_end, p
    G, C, D = chunks.group, chunks.chunk_size, p.shape[-1]
    dtype, device = p.dtype, p.device
    extra = 1 + G
    rows = torch.eye(G, dtype=dtype, device=device).repeat_interleave(C, 0)  # [G * C, G]: e_h of each row
    q_walk = torch.cat([q_start, gate_q, rows.expand(*q_start.shape[:-2], -1, -1)], -1)
    k_walk = torch.cat([k_end, k_end.new_ones(*k_end.shape[:-1], 1), -chunks.gate.transpose(-1, -2)], -1)
    p_walk = torch.zeros(*p.shape[:-2], D + extra, D + extra, dtype=dtype, device=device)
    p_walk[..., :D, :D] = p
    p_walk[..., D:, D:] = torch.eye(extra, dtype=dtype, device=device)
    return q_walk, k_walk, p_walk


def _segments(last_step: int, steps_per_checkpoint: int) -> list[range]:
    """The walk's steps 1 ... last_step in runs of `steps_per_checkpoint`: a run recomputes its keys from its first."""
    return [
        range(a, min(a + steps_per_checkpoint, last_step + 1)) for a in range(1, last_step + 1, steps_per_checkpoint)
    ]


def _next_keys(k_run: torch.Tensor, p_walk: torch.Tensor, d: int) -> torch.Tensor:
    """The running keys of step d + 1 from those of step d: key chunk n moves through P_{n+d}. In the profiler range
    `path_attention.next_keys`."""
    with record_function("path_attention.next_keys"):
        return k_run[:-1] @ p_walk[d : len(p_walk) - 1].transpose(-1, -2)


def _softmax_walk(
    chunks: ChunkedInputs,
    logits: torch.Tensor,
    q_walk: torch.Tensor,
    k_walk: torch.Tensor,
    p_walk: torch.Tensor,
    *,
    last_step: int,
    keep_keys: bool | None,
    product_dtype: torch.dtype | None = None,
    sink_after: int | None = None,
    steps_per_checkpoint: int = STEPS_PER_CHECKPOINT,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The softmax over every visible key, without autograd: the diagonal blocks (`logits`, gated, not masked), then
    the block diagonals 1 ... `last_step` of the walk (past step `sink_after`, only each step's first query chunk on
    key chunk 0: `_step_logits`). In the profiler range `path_attention.walk`.

    With `product_dtype` (bfloat16; inference), the walk's score and value products take their inputs in it and
    accumulate in float32 (their outputs are rounded to it); the softmax, its running sums, the diagonal blocks and
    the running keys' moves through P stay in the compute dtype. So does the gate: its cumulative values reach tens,
    which bfloat16 would round to whole units, so q_walk, k_walk and p_walk come without it (`_fold_gate` not
    applied) and it is added to each block's scores.

    Returns the output o [N, B, H, G * C, DV], the row log-sum-exp [N, B, H, G * C, 1] and the running keys a
    backward starts from: those of every step (`keep_keys`), of the first step of each segment (False, `_segments`
    of `steps_per_checkpoint`), or none (None: inference).
    """
    with record_function("path_attention.walk"):
        N, G, C, v = chunks.n_chunks, chunks.group, chunks.chunk_size, chunks.v
        if product_dtype is None:
            q_prod, v_prod = q_walk, v
            gate_q = None  # folded into q_walk and k_walk
        else:
            q_prod, v_prod = q_walk.to(product_dtype), v.to(product_dtype)
            gate_q = chunks.gate_rows
        s = _masked_logits(chunks, logits, queries=slice(None), keys=slice(None))
        m_out = s.amax(-1, keepdim=True)
        acc_out = floored_exp_(s - m_out) @ v  # the ones column of v makes the last column the softmax denominator
        # acc and m view the rows of query chunks d ... N - 1, updated in place: chunk d is complete after step d.
        acc, m, k_run, saved = acc_out, m_out, k_walk[: N - 1], []
        for d in range(1, last_step + 1):
            acc, m = acc[1:], m[1:]
            if keep_keys or (keep_keys is not None and (d - 1) % steps_per_checkpoint == 0):
                saved.append(k_run)
            s = q_prod[d:] @ k_run.to(q_prod.dtype).transpose(-1, -2)
            if product_dtype is not None:
                s = s.to(acc.dtype)
            if gate_q is not None:  # + G_i - G_j
                s.add_(gate_q[d:]).unflatten(-2, (G, C)).sub_(chunks.gate[: N - d, ..., None, :])
            s = _step_logits(chunks, s, d, sink_after)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            acc.mul_(floored_exp_(m - m_new)).add_(floored_exp_(s.sub_(m_new)).to(v_prod.dtype) @ v_prod[: N - d])
            m.copy_(m_new)
            if d < last_step:
                k_run = _next_keys(k_run, p_walk, d)
        denominator = acc_out[..., -1:]
        return acc_out[..., :-1] / denominator, m_out + denominator.log(), saved


class _InterChunkSoftmax(torch.autograd.Function):
    """`_softmax_walk` with its backward written out. Inputs: the diagonal blocks' logits, q~, k~ and P_n as the walk
    uses them (`_fold_gate`) and v with its ones column; the output o."""

    @staticmethod
    def forward(
        ctx,
        logits,
        q_walk,
        k_walk,
        p_walk,
        v,
        chunks: ChunkedInputs,
        last_step: int,
        keep_keys: bool,
        sink_after: int | None,
        steps_per_checkpoint: int,
    ):
        o, lse, saved = _softmax_walk(
            chunks,
            logits,
            q_walk,
            k_walk,
            p_walk,
            last_step=last_step,
            keep_keys=keep_keys,
            sink_after=sink_after,
            steps_per_checkpoint=steps_per_checkpoint,
        )
        ctx.save_for_backward(logits, q_walk, k_walk, p_walk, v, o, lse, *saved)
        ctx.chunks, ctx.last_step, ctx.keep_keys = chunks, last_step, keep_keys
        ctx.sink_after, ctx.steps_per_checkpoint = sink_after, steps_per_checkpoint
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        with record_function("path_attention.walk_backward"):
            logits, q_walk, k_walk, p_walk, v, o, lse, *saved = ctx.saved_tensors
            chunks, N = ctx.chunks, ctx.chunks.n_chunks
            values = v[..., :-1]
            delta = (do * o).sum(-1, keepdim=True)  # sum_j p_ij dp_ij of each row
            dq, dk, dp, dv = (torch.zeros_like(x) for x in (q_walk, k_walk, p_walk, v))

            def logits_grad(s: torch.Tensor, queries: slice, keys: slice) -> torch.Tensor:
                # In place: `s` is always a tensor of its own here (the diagonal's masked copy, or a step's product).
                prob = floored_exp_(s.sub_(lse[queries]))
                dv[keys, ..., :-1] += prob.transpose(-1, -2) @ do[queries]
                return (do[queries] @ values[keys].transpose(-1, -2)).sub_(delta[queries]).mul_(prob)

            every = slice(None)
            d_logits = logits_grad(_masked_logits(chunks, logits, every, every), every, every)
            carry = None  # the gradient of the running keys of step d + 1
            for index, run in reversed(list(enumerate(_segments(ctx.last_step, ctx.steps_per_checkpoint)))):
                if ctx.keep_keys:
                    keys = saved[run.start - 1 : run.stop - 1]
                else:  # recompute the segment's keys from its first step's
                    keys = [saved[index]]
                    for d in run[:-1]:
                        keys.append(_next_keys(keys[-1], p_walk, d))
                for d, k_run in zip(reversed(run), reversed(keys), strict=True):
                    queries, key_chunks = slice(d, N), slice(0, N - d)
                    ds = logits_grad(
                        _step_logits(chunks, q_walk[d:] @ k_run.transpose(-1, -2), d, ctx.sink_after),
                        queries,
                        key_chunks,
                    )
                    dq[d:] += ds @ k_run
                    dk_run = ds.transpose(-1, -2) @ q_walk[d:]
                    if carry is not None:  # k_run of step d + 1 = k_run[:-1] @ P^T
                        dk_run[:-1] += carry @ p_walk[d : N - 1]
                        dp[d : N - 1] += carry.transpose(-1, -2) @ k_run[:-1]
                    carry = dk_run
            if carry is not None:
                dk[: N - 1] += carry
            return d_logits, dq, dk, dp, dv, None, None, None, None, None


def inter_chunk(
    chunks: ChunkedInputs,
    *,
    q_start: torch.Tensor,
    logits: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    last_step: int,
    requires_grad: bool,
    recompute: bool | None,
    product_dtype: torch.dtype | None = None,
    sink_after: int | None = None,
    checkpoint_above_bytes: int = CHECKPOINT_ABOVE_BYTES,
    steps_per_checkpoint: int = STEPS_PER_CHECKPOINT,
) -> torch.Tensor:
    """The output of the softmax over every visible key, [N, B, H, G * C, DV], from the intra-chunk stage's outputs
    (`logits` not gated).

    `last_step` is the last block diagonal walked (`walk_last_step`, or fewer); past step `sink_after` (not None) a
    query chunk sees only key chunk 0; `requires_grad`: whether autograd will call for gradients; `recompute` is
    `path_attention`'s, and where it is None backward recomputes the running keys (from every
    `steps_per_checkpoint`-th step's) when keeping them all would take more than `checkpoint_above_bytes`;
    `product_dtype` (inference only) is `chunk_path_attention`'s.
    """
    N, C = chunks.n_chunks, chunks.chunk_size
    gate_q = chunks.gate_rows  # one node for both uses: autograd sums its two gradients there, as it always did
    logits = gate_logits(chunks, logits, gate_q)
    if not requires_grad:
        return inference_walk(
            chunks,
            logits,
            q_start,
            k_end,
            p,
            last_step=last_step,
            product_dtype=product_dtype,
            sink_after=sink_after,
        )[0]
    q_walk, k_walk, p_walk = _fold_gate(chunks, gate_q=gate_q, q_start=q_start, k_end=k_end, p=p)
    # Backward starts from the running keys of every step, or, if they are large (or the caller says), from those of
    # each segment's first step, recomputing the others: memory O(T * (C + D)).
    B, H = chunks.k.shape[1:3]
    kept_bytes = last_step * N / 2 * B * H * C * k_walk.shape[-1] * k_walk.element_size()
    keep_keys = kept_bytes <= checkpoint_above_bytes if recompute is None else not recompute
    return _InterChunkSoftmax.apply(
        logits, q_walk, k_walk, p_walk, chunks.v, chunks, last_step, keep_keys, sink_after, steps_per_checkpoint
    )


def inference_walk(
    chunks: ChunkedInputs,
    logits: torch.Tensor,
    q_start: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    *,
    last_step: int,
    product_dtype: torch.dtype | None,
    sink_after: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk without autograd, from `inter_chunk`'s inputs (`logits` gated: `gate_logits`): the output and the row
    log-sum-exp. The gate is folded into the products (`_fold_gate`), or kept out of them where they run in
    `product_dtype`."""
    if product_dtype not in (None, p.dtype):
        walk = _softmax_walk(
            chunks,
            logits,
            q_start,
            k_end,
            p,
            last_step=last_step,
            keep_keys=None,
            product_dtype=product_dtype,
            sink_after=sink_after,
        )
        return walk[0], walk[1]
    q_walk, k_walk, p_walk = _fold_gate(chunks, gate_q=chunks.gate_rows, q_start=q_start, k_end=k_end, p=p)
    walk = _softmax_walk(
        chunks, logits, q_walk, k_walk, p_walk, last_step=last_step, keep_keys=None, sink_after=sink_after
    )
    return walk[0], walk[1]


__all__ = [
    "CHECKPOINT_ABOVE_BYTES",
    "EXP_FLOOR",
    "STEPS_PER_CHECKPOINT",
    "floored_exp_",
    "gate_logits",
    "inference_walk",
    "inter_chunk",
    "walk_last_step",
]
