# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend's intra-chunk stage: the UT transform of each chunk's Householder product, and chunk pairs merged.

The sequence is cut into N chunks of C tokens (`ops_inputs.chunk_inputs`). Within chunk n, with local positions
1..C, the UT transform gives the product of its Householder matrices in closed form. With L the strictly lower part
of diag(beta) W W^T and T_n = (I + L)^{-1}:

    U = T_n diag(beta) W                    H_s ... H_1 = I - W^T U[:s]     (prefix products, any s)
    c = T_n tril_{-1}(diag(beta) W K^T)     H_i ... H_{j+1} k_j = k_j - sum_{j<s<=i} c_sj w_s

so that:

    intra-chunk logits  A_ij = q_i.k_j - sum_{s<=i} (q_i.w_s) c_sj                 (j <= i)
    q~_i = H_1 ... H_i q_i  (query moved back to the chunk start)   = q_i - (tril(Q W^T) U)_i
    k~_j = H_C ... H_{j+1} k_j  (key moved to the chunk end)       = k_j - (c^T W)_j
    P_n  = H_C ... H_1 = I - W^T U  (D x D)

and a query in chunk m scores a key in chunk n < m as  q~_i^T P_{m-1} ... P_{n+1} k~_j  (`ops_walk.py`).

`intra_chunk` computes q~, A, k~ and P_n; `merge_chunks` then gives the same for chunks twice as long, from each pair
of chunks, so that the walk moves its keys once per two chunks (`default_walk_merges`: how many times, by default).

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import torch
from torch.autograd.function import once_differentiable
from torch.profiler import record_function

from .ops_inputs import ChunkedInputs, chunk_rows

# The UT transform's triangular solve (`unit_lower_solve`) runs in blocks of this many rows: the inverse of each
# diagonal block in a few batched products, the rest by block substitution.
SOLVE_BLOCK = 16

# By default (`default_walk_merges`) the walk runs over merged pairs of chunks for sequences of more than this many
# chunks, and over the chunks themselves up to it.
MERGE_ABOVE = 16


def chunk_householder(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """UT transform of each chunk. k, w: [N, B, H, C, D]; beta: [N, B, H, C].

    Returns U [.., C, D], c [.., C, C], k~ (keys moved to their chunk's end) [.., C, D] and P_n [.., D, D].
    """
    D = w.shape[-1]
    wb = w * beta[..., None]
    lower = torch.tril(wb @ w.transpose(-1, -2), -1)
    rhs = torch.cat([wb, torch.tril(wb @ k.transpose(-1, -2), -1)], dim=-1)
    solved = unit_lower_solve(lower, rhs)
    u, c = solved[..., :D], solved[..., D:]
    k_end = _minus_product(k, c.transpose(-1, -2), w)
    p = _minus_product(torch.eye(D, dtype=w.dtype, device=w.device), w.transpose(-1, -2), u)
    return u, c, k_end, p


def unit_lower_solve(lower: torch.Tensor, rhs: torch.Tensor, *, block: int = SOLVE_BLOCK) -> torch.Tensor:
    """(I + lower)^{-1} rhs, `lower` [..., C, C] strictly lower triangular (what is on and above its diagonal is not
    read), `rhs` [..., C, R] of the same leading dims: `torch.linalg.solve_triangular(I + lower, rhs, upper=False)`.

    In blocks of `block` rows, where they divide C (else by `solve_triangular` itself): the inverse of each diagonal
    block as the product (I - L)(I + L^2)(I + L^4)... (exact: L^block = 0), then block substitution in batched
    products. On CPU `solve_triangular` solves each small matrix on its own; this made the torch backend's forward
    0.91-0.98x as long at 512-2048 tokens (BENCHMARKS.md). Backward is written out, from the same blocks."""
    block = min(block, lower.shape[-1])
    if lower.shape[-1] % block:
        return torch.linalg.solve_triangular(lower.tril(-1), rhs, upper=False, unitriangular=True)
    return _UnitLowerSolve.apply(lower, rhs, block)


def _diagonal_inverses(lower: torch.Tensor, block: int) -> torch.Tensor:
    """(I + L_ii)^{-1} of the diagonal `block` x `block` blocks of `lower` [M, C, C]: [M, C // block, block, block]."""
    M, C = lower.shape[0], lower.shape[-1]
    n = C // block
    diagonal = torch.diagonal(lower.view(M, n, block, n, block), dim1=1, dim2=3).permute(0, 3, 1, 2)
    power = diagonal.tril(-1).reshape(M * n, block, block)
    inverse = torch.eye(block, dtype=lower.dtype, device=lower.device) - power
    reached = 2  # inverse = (I - L)(I + L^2)...(I + L^(reached / 2)): every power of L below `reached`
    while reached < block:
        power = torch.bmm(power, power)
        inverse = torch.baddbmm(inverse, inverse, power)
        reached *= 2
    return inverse.view(M, n, block, block)


def _block_substitution(
    lower: torch.Tensor, rhs: torch.Tensor, inverses: torch.Tensor, transpose: bool
) -> torch.Tensor:
    """(I + L)^{-1} rhs, or (I + L)^{-T} rhs with `transpose`, for L the strict lower part of `lower` [M, C, C], rhs
    [M, C, R], from the diagonal blocks' inverses (`_diagonal_inverses`)."""
    n, block = inverses.shape[1], inverses.shape[-1]
    out = torch.empty_like(rhs)
    for i in reversed(range(n)) if transpose else range(n):
        rows = slice(i * block, (i + 1) * block)
        r = rhs[:, rows]
        if transpose and i < n - 1:  # rows below: L^T's block row i, the solved rows after it
            after = slice((i + 1) * block, None)
            r = torch.baddbmm(r, lower[:, after, rows].mT, out[:, after], alpha=-1)
        elif not transpose and i:
            before = slice(0, i * block)
            r = torch.baddbmm(r, lower[:, rows, before], out[:, before], alpha=-1)
        out[:, rows] = torch.bmm(inverses[:, i].mT if transpose else inverses[:, i], r)
    return out


class _UnitLowerSolve(torch.autograd.Function):
    """`unit_lower_solve` in blocks, with its backward: for X = (I + L)^{-1} R, dR = (I + L)^{-T} dX and
    dL = -tril(dR X^T, -1)."""

    @staticmethod
    def forward(ctx, lower: torch.Tensor, rhs: torch.Tensor, block: int) -> torch.Tensor:
        batch, C = lower.shape[:-2], lower.shape[-1]
        flat_lower, flat_rhs = lower.reshape(-1, C, C), rhs.reshape(-1, C, rhs.shape[-1])
        inverses = _diagonal_inverses(flat_lower, block)
        x = _block_substitution(flat_lower, flat_rhs, inverses, transpose=False)
        ctx.save_for_backward(flat_lower, inverses, x)
        ctx.batch = batch
        return x.view(*batch, C, rhs.shape[-1])

    @staticmethod
    @once_differentiable
    def backward(ctx, dx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, None]:
        flat_lower, inverses, x = ctx.saved_tensors
        C = flat_lower.shape[-1]
        d_rhs = _block_substitution(flat_lower, dx.reshape(x.shape), inverses, transpose=True)
        d_lower = torch.tril(d_rhs @ x.mT, -1).neg_()
        return d_lower.view(*ctx.batch, C, C), d_rhs.view(*ctx.batch, C, x.shape[-1]), None


def _minus_product(x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """x - a @ b, a and b [..., M, K] and [..., K, N] of the same leading dims, x broadcastable to their product. In
    inference in one pass (`torch.baddbmm`: 0.9x the intra-chunk transform's time at T = 2048); under autograd as
    the two ops of before, since `baddbmm` made training no faster (BENCHMARKS.md)."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (x, a, b)):
        return x - a @ b
    batch = a.shape[:-2]
    out = torch.baddbmm(x.expand(*batch, *x.shape[-2:]).flatten(0, -3), a.flatten(0, -3), b.flatten(0, -3), alpha=-1)
    return out.unflatten(0, batch)


def intra_chunk(chunks: ChunkedInputs) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Returns q~ (queries moved to their chunk's start) [N, B, H, G * C, D], the intra-chunk logits A
    [N, B, H, G * C, C] (neither masked nor gated), k~ [N, B, H, C, D] and P_n [N, B, H, D, D]. In the profiler range
    `path_attention.intra_chunk`."""
    with record_function("path_attention.intra_chunk"):
        G, C = chunks.group, chunks.chunk_size
        u, c, k_end, p = chunk_householder(chunks.k, chunks.w, chunks.beta)
        qw = chunk_rows((chunks.q @ chunks.w.transpose(-1, -2)).unflatten(-2, (G, C)).masked_fill(~chunks.causal, 0))
        q_start = _minus_product(chunks.q, qw, u)
        logits = _minus_product(chunks.q @ chunks.k.transpose(-1, -2), qw, c)
        return q_start, logits, k_end, p


def default_walk_merges(length: int, chunk_size: int, *, merge_above: int = MERGE_ABOVE) -> int:
    """How many times `merge_chunks` doubles the walk's blocks by default: once for sequences of more than
    `merge_above` chunks, else never. Measured on CPU, one thread (BENCHMARKS.md): blocks of 2 x 64 took 1.18x / 1.09x
    the time of blocks of 64 at T = 512 (forward / forward+backward), 1.04x / 0.98x at 1024 and 0.72-0.95x at 2048
    and 8192; 4 x 64, 2 x 32 and unmerged chunks of 128 did not beat 2 x 64."""
    return 1 if length > merge_above * chunk_size else 0


def merge_chunks(
    chunks: ChunkedInputs, q_start: torch.Tensor, logits: torch.Tensor, k_end: torch.Tensor, p: torch.Tensor
) -> tuple[ChunkedInputs, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`intra_chunk`'s outputs for chunks twice as long, from those of each pair of chunks (a, b) (N even). In the
    profiler range `path_attention.merge_chunks`.

    The walk then moves each key through one P per 2C tokens, not per C: its products through P cost C * D^2 per
    block of C x C scores, so doubling the walk's blocks halves their share (D / C of the score and value products at
    C = 64) and halves the walk's steps. The UT transform stays at C, where its triangular solve is cheap. For the
    pair: P = P_b P_a, the keys of a move on through P_b, the queries of b move back through P_a, and the diagonal
    block gains the logits of b's queries on a's keys, q~_b . k~_a (adjacent chunks: no P between them); a's queries
    on b's keys are masked by the causal mask of the longer chunk.
    """
    with record_function("path_attention.merge_chunks"):
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
        merged = ChunkedInputs(
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


__all__ = [
    "MERGE_ABOVE",
    "SOLVE_BLOCK",
    "chunk_householder",
    "default_walk_merges",
    "intra_chunk",
    "merge_chunks",
    "unit_lower_solve",
]
