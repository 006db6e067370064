# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend of `path_attention`: PaTH attention chunked in PyTorch, on any device and head dim.

Three steps, as FLA splits its chunked kernels, and a fourth for inference on CPU:
- intra-chunk transform (`_intra_chunk`): the UT transform of each chunk's Householder product, the logits within
  a chunk and the queries moved back to their chunk's start; pairs of chunks are then merged into the walk's blocks
  (`_merge_chunks`), so that the walk moves its keys once per two chunks;
- inter-chunk walk (`_inter_chunk`): the block diagonals, one step each, with an online softmax, and its backward
  written out (`_InterChunkSoftmax`), which recomputes the running keys from every `_STEPS_PER_CHECKPOINT`-th step
  where keeping them all would take too much memory;
- in inference on CPU, superblocks (`_superblock_attention`): the walk runs within superblocks of 512 tokens, and
  each superblock's queries meet every earlier key in PyTorch's fused flash-attention kernel;
- key-cache preparation (`_key_cache`): the fully transformed keys a decode starts from, per packed sequence.
Everything runs in fp32 (or wider) with memory O(T * chunk); `chunk_path_attention` is the entry point, which
`path_attention` calls after checking its inputs.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import math
import weakref
from dataclasses import dataclass
from functools import partial
from itertools import pairwise

import torch
from torch.autograd.function import once_differentiable

# Steps of the walk whose running keys backward recomputes from the first one's, when keeping every step's keys would
# take more than _CHECKPOINT_ABOVE_BYTES (short sequences keep them all: no recomputation) and the caller does not say
# otherwise (`recompute`).
_STEPS_PER_CHECKPOINT = 8
_CHECKPOINT_ABOVE_BYTES = 32 * 2**20


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp of `x` in place, `x` first raised to the least argument whose exp is a normal number of its dtype.

    PyTorch's vectorised CPU exp takes a slow path, 5-65x slower, on arguments whose exp underflows (bench/exp_cpu.py),
    and a softmax meets many: masked (-inf) logits and keys gated far below the row's maximum. Raised, each adds at
    most e times the dtype's smallest normal number (3.2e-38 in float32) to a sum whose largest term is 1.
    """
    return x.clamp_min_(_EXP_FLOOR[x.dtype]).exp_()


# An argument whose exp is a normal number, one above the least (whose exp rounds below it in float32), for each
# compute dtype (`_chunk_inputs` computes in float32 or wider).
_EXP_FLOOR = {dtype: math.log(torch.finfo(dtype).tiny) + 1 for dtype in (torch.float32, torch.float64)}


# The values of the cu_seqlens seen last: (weak reference to the tensor, its version counter, its values).
_cu_seqlens_on_host: tuple[weakref.ref, int | None, list[int]] | None = None


def _host_cu_seqlens(cu_seqlens: torch.Tensor) -> list[int]:
    """cu_seqlens' values as Python ints. Reading them syncs with the device, so they are kept for the tensor read last
    (by identity, as FLA's `tensor_cache`): a model hands the same tensor to every layer, which then read it once."""
    global _cu_seqlens_on_host
    version = None if cu_seqlens.is_inference() else cu_seqlens._version  # inference tensors keep no version
    cached = _cu_seqlens_on_host
    if cached is not None and cached[0]() is cu_seqlens and cached[1] == version:
        return cached[2]
    values = cu_seqlens.tolist()
    _cu_seqlens_on_host = (weakref.ref(cu_seqlens), version, values)
    return values


def _segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of each of `total` positions; positions past cu_seqlens[-1] get -1."""
    ids = torch.full((total,), -1, dtype=torch.long, device=cu_seqlens.device)
    lengths, end = cu_seqlens[1:] - cu_seqlens[:-1], _host_cu_seqlens(cu_seqlens)[-1]
    segments = torch.arange(len(lengths), device=ids.device)
    ids[:end] = torch.repeat_interleave(segments, lengths, output_size=end)  # output_size: no sync
    return ids


# ---------------------------------------------------------------------------------------------------------------
# Intra-chunk transform
#
# The sequence is cut into N chunks of C tokens. Within chunk n, with local positions 1..C, the UT transform gives
# the product of its Householder matrices in closed form. With L the strictly lower part of diag(beta) W W^T and
# T_n = (I + L)^{-1}:
#   U = T_n diag(beta) W                    H_s ... H_1 = I - W^T U[:s]     (prefix products, any s)
#   c = T_n tril_{-1}(diag(beta) W K^T)     H_i ... H_{j+1} k_j = k_j - sum_{j<s<=i} c_sj w_s
# so that:
#   intra-chunk logits  A_ij = q_i.k_j - sum_{s<=i} (q_i.w_s) c_sj                 (j <= i)
#   q~_i = H_1 ... H_i q_i  (query moved back to the chunk start)   = q_i - (tril(Q W^T) U)_i
#   k~_j = H_C ... H_{j+1} k_j  (key moved to the chunk end)       = k_j - (c^T W)_j
#   P_n  = H_C ... H_1 = I - W^T U  (D x D)
# and a query in chunk m scores a key in chunk n < m as  q~_i^T P_{m-1} ... P_{n+1} k~_j.
# ---------------------------------------------------------------------------------------------------------------


def _to_chunks(
    x: torch.Tensor, n_chunks: int, chunk_size: int, dtype: torch.dtype, superblock: int = 0
) -> torch.Tensor:
    """[B, T, H, ...] -> [N, B, H, C, ...] in `dtype`, zero-padded at the end to N * C tokens.

    The chunk dim leads so that a run of chunks is one contiguous slice: matmuls over it need no copies. With
    `superblock` S (`_superblock_attention`), the superblocks of S chunks are a batch instead: [S, N / S * B, H, C,
    ...], chunk j * S + s of batch b at [s, j * B + b].
    """
    B, T = x.shape[:2]
    pad = n_chunks * chunk_size - T
    x = x.to(dtype)
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.view(B, n_chunks, chunk_size, *x.shape[2:]).movedim(2, 3).movedim(1, 0)
    if superblock:
        x = x.unflatten(0, (-1, superblock)).transpose(0, 1).flatten(1, 2)
    return x.contiguous()


def _chunk_order(x: torch.Tensor, chunks: _ChunkedInputs) -> torch.Tensor:
    """[N, B, ...] from a tensor of `chunks`' layout: the superblock layout of `_to_chunks` undone."""
    if not chunks.superblock:
        return x
    return x.unflatten(1, (-1, chunks.batch)).transpose(0, 1).flatten(0, 1)


def _from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[N, B, H, C, ...] -> [B, T, H, ...], dropping the end padding."""
    x = x.movedim(0, 1).movedim(3, 2)
    return x.flatten(1, 2)[:, :length]


def _chunk_rows(x: torch.Tensor) -> torch.Tensor:
    """[.., G, C, C] -> [.., G * C, C]: the G query heads of a key head as the rows of one chunk."""
    return x.flatten(-3, -2)


@dataclass(frozen=True)
class _ChunkedInputs:
    """The inputs cut into chunks, `[N, B, H, ...]` in the compute dtype, and what the steps mask with."""

    q: torch.Tensor | None  # [N, B, H, G * C, D]: the G query heads of key head h as G * C rows, scale folded in
    k: torch.Tensor  # [N, B, H, C, D]; once merged (`_merge_chunks`), the keys moved to their chunk's end
    v: torch.Tensor  # [N, B, H, C, DV + 1]: a ones column last
    w: torch.Tensor | None  # [N, B, H, C, D]; q, w and beta are None once merged: the walk needs none of them
    beta: torch.Tensor | None  # [N, B, H, C], 0 past T: padded tokens transform nothing; None once merged
    gate: torch.Tensor | None  # [N, B, H, G, C]: scale * G_i (cumulative log gate per sequence); None without g
    segment: torch.Tensor | None  # [N, C]: sequence index of each position (-1 past T); None without cu_seqlens
    causal: torch.Tensor  # [C, C] bool, lower triangle
    group: int  # G, query heads per key head
    batch: int  # B
    # S: the layout [S, N / S * B, ...] of `_to_chunks`, for `_superblock_attention`; 0: [N, B, ...]
    superblock: int = 0

    @property
    def gate_rows(self) -> torch.Tensor | None:
        """[N, B, H, G * C, 1]: G_i of each query row (`q`'s row order), None without a gate."""
        return None if self.gate is None else self.gate.flatten(-2)[..., None]

    @property
    def n_chunks(self) -> int:
        return self.k.shape[0]

    @property
    def chunk_size(self) -> int:
        return self.k.shape[-2]


def _chunk_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    *,
    scale: float,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
    chunks_multiple: int = 1,
    superblock: int = 0,
) -> _ChunkedInputs:
    """`path_attention`'s inputs [B, T, ...] cut into chunks of `chunk_size` tokens, and the masks; the number of
    chunks a multiple of `chunks_multiple` (padding chunks at the end); in the superblock layout of `_to_chunks` with
    `superblock` (unpacked only)."""
    B, T, HQ, D = q.shape
    H = k.shape[2]
    G, C = HQ // H, chunk_size
    N = -(-T // (C * chunks_multiple)) * chunks_multiple
    dtype = torch.promote_types(q.dtype, torch.float32)

    # GQA: the G query heads of a key head become G * C rows of each chunk, so one matmul serves them all.
    # The softmax scale is folded into q once.
    chunk = partial(_to_chunks, n_chunks=N, chunk_size=C, dtype=dtype, superblock=superblock)
    qc = chunk(q.view(B, T, H, G, D)).transpose(-2, -3).flatten(-3, -2) * scale
    kc, wc = chunk(k), chunk(w)
    # A ones column on v makes every `e @ v` also return the softmax denominator.
    # (padded keys get it too, so padded rows of a packed batch have a nonzero denominator).
    vc = chunk(v)
    vc = torch.cat([vc, vc.new_ones(*vc.shape[:-1], 1)], -1)
    betac = chunk(beta)

    gc = None
    if g is not None:
        gcum = g.to(dtype).cumsum(1)
        if cu_seqlens is not None:  # restart the cumulative gate at every sequence start
            starts = torch.cat([gcum.new_zeros(1, 1, HQ), gcum], dim=1)[:, cu_seqlens[:-1]]
            gcum = gcum - starts[:, _segment_ids(cu_seqlens, T)]
        gc = chunk(gcum.view(B, T, H, G) * scale).transpose(-1, -2)
    return _ChunkedInputs(
        q=qc,
        k=kc,
        v=vc,
        w=wc,
        beta=betac,
        gate=gc,
        segment=None if cu_seqlens is None else _segment_ids(cu_seqlens, N * C).view(N, C),
        causal=torch.ones(C, C, dtype=torch.bool, device=q.device).tril(),
        group=G,
        batch=B,
        superblock=superblock,
    )


def _chunk_householder(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """UT transform of each chunk. k, w: [N, B, H, C, D]; beta: [N, B, H, C].

    Returns U [.., C, D], c [.., C, C], k~ (keys moved to their chunk's end) [.., C, D] and P_n [.., D, D].
    """
    D = w.shape[-1]
    wb = w * beta[..., None]
    lower = torch.tril(wb @ w.transpose(-1, -2), -1)
    rhs = torch.cat([wb, torch.tril(wb @ k.transpose(-1, -2), -1)], dim=-1)
    solved = torch.linalg.solve_triangular(lower, rhs, upper=False, unitriangular=True)  # the diagonal: ones
    u, c = solved[..., :D], solved[..., D:]
    k_end = _minus_product(k, c.transpose(-1, -2), w)
    p = _minus_product(torch.eye(D, dtype=w.dtype, device=w.device), w.transpose(-1, -2), u)
    return u, c, k_end, p


def _minus_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x - a @ b, a and b [..., M, K] and [..., K, N] of the same leading dims, x broadcastable to their product. In
    inference in one pass (`torch.baddbmm`: 0.9x the intra-chunk transform's time at T = 2048); under autograd as
    the two ops of before, since `baddbmm` made training no faster (BENCHMARKS.md)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, a, b)):
        return x - a @ b
    batch = a.shape[:-2]
    out = torch.baddbmm(x.expand(*batch, *x.shape[-2:]).flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=-1)
    return out.unflatten(0, batch)


def _intra_chunk(chunks: _ChunkedInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns q~ (queries moved to their chunk's start) [N, B, H, G * C, D], the intra-chunk logits A
    [N, B, H, G * C, C] (neither masked nor gated), k~ [N, B, H, C, D] and P_n [N, B, H, D, D]."""
    G, C = chunks.group, chunks.chunk_size
    u, c, k_end, p = _chunk_householder(chunks.k, chunks.w, chunks.beta)
    qw = _chunk_rows((chunks.q @ chunks.w.transpose(-1, -2)).unflatten(-2, (G, C)).masked_fill(~chunks.causal, 0))
    q_start = _minus_product(chunks.q, qw, u)
    logits = _minus_product(chunks.q @ chunks.k.transpose(-1, -2), qw, c)
    return q_start, logits, k_end, p


def _merge_chunks(
    chunks: _ChunkedInputs, q_start: torch.Tensor, logits: torch.Tensor, k_end: torch.Tensor, p: torch.Tensor
) -> tuple[_ChunkedInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`_intra_chunk`'s outputs for chunks twice as long, from those of each pair of chunks (a, b) (N even).

    The walk then moves each key through one P per 2C tokens, not per C: its products through P cost C * D^2 per
    block of C x C scores, so doubling the walk's blocks halves their share (D / C of the score and value products at
    C = 64) and halves the walk's steps. The UT transform stays at C, where its triangular solve is cheap. For the
    pair: P = P_b P_a, the keys of a move on through P_b, the queries of b move back through P_a, and the diagonal
    block gains the logits of b's queries on a's keys, q~_b . k~_a (adjacent chunks: no P between them); a's queries
    on b's keys are masked by the causal mask of the longer chunk.
    """
    N, G, C = chunks.n_chunks, chunks.group, chunks.chunk_size

    def pairs(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return x.unflatten(0, (N // 2, 2)).unbind(1)

    def rows(x: torch.Tensor) -> torch.Tensor:  # [.., G * C, X] -> [.., G, C, X]
        return x.unflatten(-2, (G, C))

    (q_a, q_b), (l_a, l_b), (k_a, k_b), (p_a, p_b) = pairs(q_start), pairs(logits), pairs(k_end), pairs(p)
    cross = rows(q_b @ k_a.transpose(-1, -2))
    top = torch.cat([rows(l_a), torch.zeros_like(cross)], -1)  # a's queries: b's keys are masked (causal)
    merged_logits = torch.cat([top, torch.cat([cross, rows(l_b)], -1)], -2).flatten(-3, -2)
    merged_q = torch.cat([rows(q_a), rows(q_b @ p_a)], -2).flatten(-3, -2)
    merged_k = torch.cat([k_a @ p_b.transpose(-1, -2), k_b], -2)
    v_a, v_b = pairs(chunks.v)
    merged = _ChunkedInputs(
        q=None,
        k=merged_k,
        v=torch.cat([v_a, v_b], -2),
        w=None,
        beta=None,
        gate=None if chunks.gate is None else torch.cat(pairs(chunks.gate), -1),
        segment=None if chunks.segment is None else chunks.segment.reshape(N // 2, 2 * C),
        causal=torch.ones(2 * C, 2 * C, dtype=torch.bool, device=chunks.causal.device).tril(),
        group=G,
        batch=chunks.batch,
    )
    return merged, merged_q, merged_logits, merged_k, p_b @ p_a


# ---------------------------------------------------------------------------------------------------------------
# Inter-chunk walk
#
# The inter-chunk part walks the block diagonals: at step d every query chunk m >= d meets key chunk m - d at once
# (one batched matmul), then every running key is moved through the next chunk's P (on the key side: a chunk has C
# keys but G * C query rows under GQA). A flash-attention style online softmax keeps memory at O(T * (C + D)) per
# head, and Python loops over N chunks, not N^2 chunk pairs.
#
# Backward is written out (`_InterChunkSoftmax`), as FlashAttention's is: the probabilities of every block come back
# from the row log-sum-exp, and the walk runs backward, handing each step's key gradient through P to the step
# before. Autograd through the walk would keep every step's softmax and slice its large inputs at every step.
# ---------------------------------------------------------------------------------------------------------------


def _masked_logits(chunks: _ChunkedInputs, scores: torch.Tensor, queries: slice, keys: slice) -> torch.Tensor:
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
        scores = _chunk_rows(scores)
    return scores


def _fold_gate(
    chunks: _ChunkedInputs,
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


def _segments(last_step: int) -> list[range]:
    """The walk's steps 1 ... last_step in runs of `_STEPS_PER_CHECKPOINT`: a run recomputes its keys from its first."""
    return [
        range(a, min(a + _STEPS_PER_CHECKPOINT, last_step + 1)) for a in range(1, last_step + 1, _STEPS_PER_CHECKPOINT)
    ]


def _next_keys(k_run: torch.Tensor, p_walk: torch.Tensor, d: int) -> torch.Tensor:
    """The running keys of step d + 1 from those of step d: key chunk n moves through P_{n+d}."""
    return k_run[:-1] @ p_walk[d : len(p_walk) - 1].transpose(-1, -2)


def _softmax_walk(
    chunks: _ChunkedInputs,
    logits: torch.Tensor,
    q_walk: torch.Tensor,
    k_walk: torch.Tensor,
    p_walk: torch.Tensor,
    *,
    last_step: int,
    keep_keys: bool | None,
    product_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """The softmax over every visible key, without autograd: the diagonal blocks (`logits`, gated, not masked), then
    the block diagonals 1 ... `last_step` of the walk.

    With `product_dtype` (bfloat16; inference), the walk's score and value products take their inputs in it and
    accumulate in float32 (their outputs are rounded to it); the softmax, its running sums, the diagonal blocks and
    the running keys' moves through P stay in the compute dtype. So does the gate: its cumulative values reach tens,
    which bfloat16 would round to whole units, so q_walk, k_walk and p_walk come without it (`_fold_gate` not
    applied) and it is added to each block's scores.

    Returns the output o [N, B, H, G * C, DV], the row log-sum-exp [N, B, H, G * C, 1] and the running keys a
    backward starts from: those of every step (`keep_keys`), of the first step of each segment (False, `_segments`),
    or none (None: inference).
    """
    N, G, C, v = chunks.n_chunks, chunks.group, chunks.chunk_size, chunks.v
    if product_dtype is None:
        q_prod, v_prod = q_walk, v
        gate_q = None  # folded into q_walk and k_walk
    else:
        q_prod, v_prod = q_walk.to(product_dtype), v.to(product_dtype)
        gate_q = chunks.gate_rows
    s = _masked_logits(chunks, logits, queries=slice(None), keys=slice(None))
    m_out = s.amax(-1, keepdim=True)
    acc_out = _exp_(s - m_out) @ v  # the ones column of v makes the last column the softmax denominator
    # acc and m view the rows of query chunks d ... N - 1, updated in place: chunk d is complete after step d.
    acc, m, k_run, saved = acc_out, m_out, k_walk[: N - 1], []
    for d in range(1, last_step + 1):
        acc, m = acc[1:], m[1:]
        if keep_keys or (keep_keys is not None and (d - 1) % _STEPS_PER_CHECKPOINT == 0):
            saved.append(k_run)
        s = q_prod[d:] @ k_run.to(q_prod.dtype).transpose(-1, -2)
        if product_dtype is not None:
            s = s.to(acc.dtype)
        if gate_q is not None:  # + G_i - G_j
            s.add_(gate_q[d:]).unflatten(-2, (G, C)).sub_(chunks.gate[: N - d, ..., None, :])
        s = _masked_logits(chunks, s, queries=slice(d, N), keys=slice(0, N - d))
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        acc.mul_(_exp_(m - m_new)).add_(_exp_(s.sub_(m_new)).to(v_prod.dtype) @ v_prod[: N - d])
        m.copy_(m_new)
        if d < last_step:
            k_run = _next_keys(k_run, p_walk, d)
    denominator = acc_out[..., -1:]
    return acc_out[..., :-1] / denominator, m_out + denominator.log(), saved


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16): there bfloat16 products run several times
    faster than float32 ones; without them PyTorch emulates bfloat16, slower than float32."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def walk_product_dtype(q: torch.Tensor, requires_grad: bool) -> torch.dtype | None:
    """The default `product_dtype` of `chunk_path_attention`: bfloat16 for bfloat16 queries on a CPU that multiplies
    bfloat16 natively, in inference (where it is measured faster: BENCHMARKS.md); else None, the compute dtype."""
    fast = q.device.type == "cpu" and q.dtype == torch.bfloat16 and cpu_multiplies_bf16()
    return torch.bfloat16 if fast and not requires_grad else None


class _InterChunkSoftmax(torch.autograd.Function):
    """`_softmax_walk` with its backward written out. Inputs: the diagonal blocks' logits, q~, k~ and P_n as the walk
    uses them (`_fold_gate`) and v with its ones column; the output o."""

    @staticmethod
    def forward(ctx, logits, q_walk, k_walk, p_walk, v, chunks: _ChunkedInputs, last_step: int, keep_keys: bool):
        o, lse, saved = _softmax_walk(chunks, logits, q_walk, k_walk, p_walk, last_step=last_step, keep_keys=keep_keys)
        ctx.save_for_backward(logits, q_walk, k_walk, p_walk, v, o, lse, *saved)
        ctx.chunks, ctx.last_step, ctx.keep_keys = chunks, last_step, keep_keys
        return o

    @staticmethod
    @once_differentiable
    def backward(ctx, do):
        logits, q_walk, k_walk, p_walk, v, o, lse, *saved = ctx.saved_tensors
        chunks, N = ctx.chunks, ctx.chunks.n_chunks
        values = v[..., :-1]
        delta = (do * o).sum(-1, keepdim=True)  # sum_j p_ij dp_ij of each row
        dq, dk, dp, dv = (torch.zeros_like(x) for x in (q_walk, k_walk, p_walk, v))

        def logits_grad(s: torch.Tensor, queries: slice, keys: slice) -> torch.Tensor:
            # In place: `s` is always a tensor of its own here (the diagonal's masked copy, or a step's product).
            prob = _exp_(s.sub_(lse[queries]))
            dv[keys, ..., :-1] += prob.transpose(-1, -2) @ do[queries]
            return (do[queries] @ values[keys].transpose(-1, -2)).sub_(delta[queries]).mul_(prob)

        every = slice(None)
        d_logits = logits_grad(_masked_logits(chunks, logits, every, every), every, every)
        carry = None  # the gradient of the running keys of step d + 1
        for index, run in reversed(list(enumerate(_segments(ctx.last_step)))):
            if ctx.keep_keys:
                keys = saved[run.start - 1 : run.stop - 1]
            else:  # recompute the segment's keys from its first step's
                keys = [saved[index]]
                for d in run[:-1]:
                    keys.append(_next_keys(keys[-1], p_walk, d))
            for d, k_run in zip(reversed(run), reversed(keys), strict=True):
                queries, key_chunks = slice(d, N), slice(0, N - d)
                ds = logits_grad(
                    _masked_logits(chunks, q_walk[d:] @ k_run.transpose(-1, -2), queries, key_chunks),
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
        return d_logits, dq, dk, dp, dv, None, None, None


def _walk_merges(length: int, chunk_size: int) -> int:
    """How many times `_merge_chunks` doubles the walk's blocks: once for sequences of more than `_MERGE_ABOVE`
    chunks, else never. Measured on CPU, one thread (BENCHMARKS.md): blocks of 2 x 64 took 1.18x / 1.09x
    the time of blocks of 64 at T = 512 (forward / forward+backward), 1.04x / 0.98x at 1024 and 0.72-0.95x at 2048
    and 8192; 4 x 64, 2 x 32 and unmerged chunks of 128 did not beat 2 x 64."""
    return 1 if length > _MERGE_ABOVE * chunk_size else 0


_MERGE_ABOVE = 16


def _last_step(cu_seqlens: torch.Tensor | None, n_chunks: int, chunk_size: int) -> int:
    """The last block diagonal with any visible key: N - 1, or fewer where no packed sequence spans N chunks."""
    if cu_seqlens is None:
        return n_chunks - 1
    bounds = pairwise(_host_cu_seqlens(cu_seqlens))
    return max((b - 1) // chunk_size - a // chunk_size for a, b in bounds if b > a)


def _inter_chunk(
    chunks: _ChunkedInputs,
    *,
    q_start: torch.Tensor,
    logits: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    last_step: int,
    requires_grad: bool,
    recompute: bool | None,
    product_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The output of the softmax over every visible key, [N, B, H, G * C, DV] (in `chunks`' layout).

    `last_step` is the last block diagonal walked (`_last_step`); `requires_grad`: whether autograd will call for
    gradients; `recompute` is `path_attention`'s; `product_dtype` (inference only) is `chunk_path_attention`'s.
    Chunks in the superblock layout (inference only) go to `_superblock_attention`.
    """
    N, C = chunks.n_chunks, chunks.chunk_size
    gate_q = chunks.gate_rows  # one node for both uses: autograd sums its two gradients there, as it always did
    if gate_q is not None:
        gate_k = chunks.gate[..., None, :]  # [N, B, H, G, 1, C]: G_j of each key, per query head
        logits = logits + gate_q - _chunk_rows(gate_k.expand(-1, -1, -1, -1, C, -1))
    if not requires_grad:
        if chunks.superblock:
            return _superblock_attention(
                chunks, logits=logits, q_start=q_start, k_end=k_end, p=p, product_dtype=product_dtype
            )
        return _inference_walk(chunks, logits, q_start, k_end, p, last_step=last_step, product_dtype=product_dtype)[0]
    q_walk, k_walk, p_walk = _fold_gate(chunks, gate_q=gate_q, q_start=q_start, k_end=k_end, p=p)
    # Backward starts from the running keys of every step, or, if they are large (or the caller says), from those of
    # each segment's first step, recomputing the others: memory O(T * (C + D)).
    B, H = chunks.k.shape[1:3]
    kept_bytes = last_step * N / 2 * B * H * C * k_walk.shape[-1] * k_walk.element_size()
    keep_keys = kept_bytes <= _CHECKPOINT_ABOVE_BYTES if recompute is None else not recompute
    return _InterChunkSoftmax.apply(logits, q_walk, k_walk, p_walk, chunks.v, chunks, last_step, keep_keys)


def _inference_walk(
    chunks: _ChunkedInputs,
    logits: torch.Tensor,
    q_start: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    *,
    last_step: int,
    product_dtype: torch.dtype | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The walk without autograd, from `_inter_chunk`'s inputs (`logits` gated): the output and the row log-sum-exp.
    The gate is folded into the products (`_fold_gate`), or kept out of them where they run in `product_dtype`."""
    if product_dtype not in (None, p.dtype):
        walk = _softmax_walk(
            chunks, logits, q_start, k_end, p, last_step=last_step, keep_keys=None, product_dtype=product_dtype
        )
        return walk[0], walk[1]
    q_walk, k_walk, p_walk = _fold_gate(chunks, gate_q=chunks.gate_rows, q_start=q_start, k_end=k_end, p=p)
    walk = _softmax_walk(chunks, logits, q_walk, k_walk, p_walk, last_step=last_step, keep_keys=None)
    return walk[0], walk[1]


# ---------------------------------------------------------------------------------------------------------------
# Superblocks (inference on CPU)
#
# The walk moves every key through every later block's P, one step at a time: 1 + D / C of the scores' products, in
# batched products and elementwise passes over all heads and blocks that leave the CPU's caches. In inference, the
# sequence is cut into superblocks of S blocks instead. Within a superblock, the walk runs as before (all superblocks
# at once, as a batch of S-block sequences). Every earlier key, moved to the superblock's start, and every query of
# the superblock, moved back to it, then meet in plain attention, which PyTorch's fused flash-attention CPU kernel
# computes with its row log-sum-exp (`_far_attention`); the two softmaxes are merged by their log-sum-exps. The far
# keys move through one superblock's product of P at a time: D / L of the scores' products, L = S * C tokens.
# ---------------------------------------------------------------------------------------------------------------


def _superblock_blocks(length: int, block: int, tokens: int) -> int:
    """Blocks of `block` tokens in a superblock of `tokens` (`_superblock_attention`): 0 (none) unless a superblock
    holds two blocks or more and the sequence spans more than two superblocks (with two, measured slower)."""
    blocks = tokens // block
    return blocks if blocks >= 2 and length > 2 * tokens else 0


_SUPERBLOCK_TOKENS = 512
# PyTorch's fused CPU attention that also returns the row log-sum-exp (also `local_attention`'s): a private op, so
# None where this torch lacks it, and then no superblocks.
FUSED_CPU_ATTENTION = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


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


def _superblock_attention(
    chunks: _ChunkedInputs,
    *,
    logits: torch.Tensor,
    q_start: torch.Tensor,
    k_end: torch.Tensor,
    p: torch.Tensor,
    product_dtype: torch.dtype | None,
) -> torch.Tensor:
    """`_inter_chunk`'s output in inference, for chunks in the superblock layout (`_to_chunks`; unpacked, CPU).

    The far part's queries and keys carry the gate as `_fold_gate`'s do: query head h's row carries e_h, a key
    -G_j per query head, which P leaves alone; the queries' G_i, the same for every key of a row, is added to its
    log-sum-exp. The far products run in `product_dtype` where the gate stays out of them (no gate).
    """
    S, B, G, C = chunks.superblock, chunks.batch, chunks.group, chunks.chunk_size
    D, DV = p.shape[-1], chunks.v.shape[-1] - 1
    o_near, lse_near = _inference_walk(chunks, logits, q_start, k_end, p, last_step=S - 1, product_dtype=product_dtype)
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


# ---------------------------------------------------------------------------------------------------------------
# Key-cache preparation
# ---------------------------------------------------------------------------------------------------------------


def _transformed_keys(k_end: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Move every chunk-end key through the later chunks: [N, B, H, C, D] -> fully transformed keys, same shape."""
    suffix = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device).expand_as(p[0])
    out = [None] * len(k_end)
    for n in reversed(range(len(k_end))):
        out[n] = k_end[n] @ suffix.transpose(-1, -2)  # suffix = P_{N-1} ... P_{n+1}
        suffix = suffix @ p[n]
    return torch.stack(out)


def _sequence_transformed_keys(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor, *, chunk_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """Fully transformed keys of one unpacked batch [B, T, H, D]."""
    T = k.shape[1]
    N = -(-T // chunk_size)
    kc, wc = (_to_chunks(x, N, chunk_size, dtype) for x in (k, w))
    _, _, k_end, p = _chunk_householder(kc, wc, _to_chunks(beta, N, chunk_size, dtype))
    return _from_chunks(_transformed_keys(k_end, p), T)


def _key_cache(
    k: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    *,
    k_end: torch.Tensor,
    p: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    chunk_size: int,
) -> torch.Tensor:
    """`k_cache_j = H_e ... H_{j+1} k_j` [B, T, H, D] in the compute dtype, e the last position of j's sequence.

    Unpacked, from the intra-chunk transform's k~ and P_n; packed, each sequence's keys stop at its own end.
    """
    if cu_seqlens is None:
        return _from_chunks(_transformed_keys(k_end, p), k.shape[1])
    bounds = pairwise(_host_cu_seqlens(cu_seqlens))
    return torch.cat(
        [
            _sequence_transformed_keys(k[:, a:b], w[:, a:b], beta[:, a:b], chunk_size=chunk_size, dtype=k_end.dtype)
            for a, b in bounds
        ],
        dim=1,
    )


def chunk_path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float,
    cu_seqlens: torch.LongTensor | None = None,
    chunk_size: int = 64,
    return_k_cache: bool = False,
    recompute: bool | None = None,
    product_dtype: torch.dtype | None | str = "auto",
    walk_merges: int | None = None,
    superblock_tokens: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch backend: `path_attention`'s arguments (checked there, `scale` given) and outputs.

    Computes in q's dtype promoted to at least fp32. `path_attention` calls it with autocast off, which would run the
    matmuls in bf16. In inference, `product_dtype` (a dtype, None for the compute dtype, or "auto":
    `walk_product_dtype`) is the input dtype of the walk's score and value products (`_softmax_walk`). The walk
    runs over blocks of `chunk_size * 2**walk_merges` tokens (`_merge_chunks`; None: `_walk_merges`). Inference on
    CPU without `cu_seqlens` runs over superblocks of `superblock_tokens` tokens (`_superblock_attention`; None:
    `_SUPERBLOCK_TOKENS`, 0: none).
    """
    B, T, HQ = q.shape[:3]
    DV = v.shape[-1]
    requires_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, w, beta, g))
    if product_dtype == "auto":
        product_dtype = walk_product_dtype(q, requires_grad)
    superblock = 0  # superblocks: inference on CPU, unpacked, over unmerged chunks (faster there: BENCHMARKS.md)
    if not requires_grad and cu_seqlens is None and q.device.type == "cpu" and not walk_merges and FUSED_CPU_ATTENTION:
        tokens = _SUPERBLOCK_TOKENS if superblock_tokens is None else superblock_tokens
        superblock = _superblock_blocks(T, chunk_size, tokens)
    merges = 0 if superblock else _walk_merges(T, chunk_size) if walk_merges is None else walk_merges
    chunks = _chunk_inputs(
        q,
        k,
        v,
        w,
        beta,
        g,
        scale=scale,
        cu_seqlens=cu_seqlens,
        chunk_size=chunk_size,
        chunks_multiple=2**merges * max(superblock, 1),
        superblock=superblock,
    )
    q_start, logits, k_end, p = _intra_chunk(chunks)
    walk = (chunks, q_start, logits, k_end, p)
    for _ in range(merges):
        walk = _merge_chunks(*walk)
    walk_chunks = walk[0]
    o = _inter_chunk(
        walk_chunks,
        q_start=walk[1],
        logits=walk[2],
        k_end=walk[3],
        p=walk[4],
        last_step=_last_step(cu_seqlens, n_chunks=walk_chunks.n_chunks, chunk_size=walk_chunks.chunk_size),
        requires_grad=requires_grad,
        recompute=recompute,
        product_dtype=product_dtype,
    )
    o = _chunk_order(o, chunks).unflatten(-2, (chunks.group, walk_chunks.chunk_size))
    o = o.transpose(-2, -3)  # [N, B, H, C, G, DV]
    o = _from_chunks(o, T).reshape(B, T, HQ, DV).to(q.dtype)
    if not return_k_cache:
        return o, None
    k_end, p = _chunk_order(k_end, chunks), _chunk_order(p, chunks)
    k_cache = _key_cache(k, w, beta, k_end=k_end, p=p, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o, k_cache.to(k.dtype)


__all__ = ["chunk_path_attention"]
