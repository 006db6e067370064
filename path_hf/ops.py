# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTH attention math: one entry point, two backends, and the decode-step key update.

PaTH (Yang et al., 2025) scores a query against a key through the Householder transforms of every token in
between::

    logits_ij = scale * (q_i^T H_i H_{i-1} ... H_{j+1} k_j + G_i - G_j),   j <= i
    H_t = I - beta_t w_t w_t^T,   G = cumsum(g) within each sequence (log forget gate, optional)

`path_attention` runs this with FLA's Triton kernel (`backend="fla"`) or with the chunked PyTorch implementation
in this file (`backend="torch"`: any device, any head dim, fp32 accumulation, memory O(T * chunk)). The semantics
and tensor layouts are FLA's `parallel_path_attn`, so a model trained on GPU behaves the same everywhere.

This module is a single flat file on purpose: `save_pretrained` copies it beside the weights (it follows the
modeling file's relative imports), so a checkpoint loads with `trust_remote_code=True` where path_hf is absent.
"""

from __future__ import annotations

import importlib.util
import weakref
from functools import cache
from itertools import pairwise

import torch
from torch.utils.checkpoint import checkpoint

BACKENDS = ("auto", "torch", "fla")
# Head dims FLA's Triton kernels are compiled for (fla/ops/path_attn/parallel.py).
FLA_HEAD_DIMS = (16, 32, 64, 128)
# Torch backend: block diagonals walked between two activation checkpoints when training, when the walk would keep
# more than _CHECKPOINT_ABOVE_BYTES for backward (short sequences keep everything: no recomputation) and the caller
# does not say otherwise (`recompute`).
_STEPS_PER_CHECKPOINT = 8
_CHECKPOINT_ABOVE_BYTES = 32 * 2**20


@cache
def fla_available() -> bool:
    """Whether FLA and Triton are importable (checked without importing them: `import fla` is slow)."""
    return all(importlib.util.find_spec(name) is not None for name in ("fla", "triton"))


def fla_unsupported_reason(q: torch.Tensor, v: torch.Tensor | None = None) -> str | None:
    """Why FLA's kernel cannot run these inputs, or None if it can."""
    head_dims = {q.shape[-1]} | ({v.shape[-1]} if v is not None else set())
    bad = sorted(d for d in head_dims if d not in FLA_HEAD_DIMS)
    if bad:
        return f"head dim {bad[0]} is not one FLA's PaTH kernel supports {FLA_HEAD_DIMS}"
    if not fla_available():
        return "flash-linear-attention or triton is not installed (pip install 'path-hf[fla]')"
    return None


def resolve_backend(backend: str, q: torch.Tensor, v: torch.Tensor | None = None) -> str:
    """Pick the backend that runs: `"fla"` or `"torch"`.

    `"auto"` takes FLA on CUDA tensors when it is installed and supports the head dims, and the torch backend
    otherwise. `"fla"` raises a ValueError naming the reason when FLA cannot run these inputs.
    """
    if backend not in BACKENDS:
        raise ValueError(f"Unknown PaTH attention backend {backend!r}; choose one of {BACKENDS}.")
    if backend == "torch":
        return "torch"
    reason = fla_unsupported_reason(q, v)
    if backend == "fla":
        if reason is not None:
            raise ValueError(f"backend='fla' cannot run: {reason}. Use backend='torch', which runs any head dim.")
        return "fla"
    return "fla" if q.is_cuda and reason is None else "torch"


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


def _check_inputs(q, k, v, w, beta, g, cu_seqlens) -> None:
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(
            f"q, k, v must be [B, T, heads, head_dim]; got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}."
        )
    B, T, HQ, D = q.shape
    H = k.shape[2]
    if k.shape[-1] != D:
        raise ValueError(f"q and k must have the same head dim; got {D} and {k.shape[-1]}.")
    if w.shape != k.shape:
        raise ValueError(f"w must have the shape of k {tuple(k.shape)}; got {tuple(w.shape)}.")
    if v.shape[:3] != k.shape[:3]:
        raise ValueError(f"v must be [B, T, H, DV] with k's B, T, H {tuple(k.shape[:3])}; got {tuple(v.shape)}.")
    if q.shape[:2] != k.shape[:2]:
        raise ValueError(f"q and k must share batch and length; got {tuple(q.shape[:2])} and {tuple(k.shape[:2])}.")
    if HQ % H != 0:
        raise ValueError(f"The number of query heads ({HQ}) must be a multiple of the number of key heads ({H}).")
    if beta.shape != k.shape[:3]:
        raise ValueError(f"beta must be [B, T, H] = {tuple(k.shape[:3])}; got {tuple(beta.shape)}.")
    if g is not None and g.shape != q.shape[:3]:
        raise ValueError(f"g must be [B, T, HQ] = {tuple(q.shape[:3])}; got {tuple(g.shape)}.")
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise ValueError(f"cu_seqlens must be an integer tensor, got {type(cu_seqlens).__name__}.")
        if B != 1:
            raise ValueError(
                f"With cu_seqlens the batch size must be 1, got {B}: flatten the packed sequences into one row."
            )
        bounds = _host_cu_seqlens(cu_seqlens) if cu_seqlens.dim() == 1 else []
        if not bounds or bounds[0] != 0 or bounds[-1] != T:
            raise ValueError(f"cu_seqlens must be 1-D, start at 0 and end at T={T}; got {cu_seqlens.tolist()}.")


def path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    *,
    scale: float | None = None,
    cu_seqlens: torch.LongTensor | None = None,
    backend: str = "auto",
    return_k_cache: bool = False,
    chunk_size: int = 64,
    recompute: bool | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    r"""PaTH attention (causal), FLA's `parallel_path_attn` semantics on any backend.

    Args:
        q: queries `[B, T, HQ, D]`.
        k: keys `[B, T, H, D]`; `HQ % H == 0` (GQA).
        v: values `[B, T, H, DV]`.
        w: Householder directions `[B, T, H, D]`, already L2-normalised.
        beta: Householder strengths `[B, T, H]` in (0, 2).
        g: optional log forget gate `[B, T, HQ]` (<= 0), PaTH-FoX.
        scale: softmax scale, `D ** -0.5` if None.
        cu_seqlens: `[N + 1]` boundaries of packed sequences (B must be 1), int32 or int64; no attention crosses
            them. Its values are read to the host once per tensor: pass every layer the same one.
        backend: `"auto"`, `"torch"` or `"fla"`.
        return_k_cache: also return the fully transformed keys, which decoding starts from after a prefill.
        chunk_size: block size of the torch backend.
        recompute: whether the torch backend's backward recomputes its walk over the block diagonals rather than keep
            its activations (checkpoints every 8 steps). None (the default) recomputes when keeping them would take
            more than 32 MiB: memory O(T * chunk) instead of O(T^2), for one extra forward walk. Pass False where the
            caller is recomputed in backward anyway (a gradient-checkpointed layer): the walk then runs twice per
            training step, not three times. FLA's kernel ignores it.

    Returns:
        o `[B, T, HQ, DV]` in q's dtype, and k_cache `[B, T, H, D]` in k's dtype (None unless asked):
        `k_cache_j = H_e ... H_{j+1} k_j`, e the last position of j's sequence. Both backends accumulate in fp32
        whatever the input dtypes, under `torch.autocast` too.
    """
    _check_inputs(q, k, v, w, beta, g, cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if resolve_backend(backend, q, v) == "fla":
        # Inside `try`: transformers' check_imports then does not require fla for a trust_remote_code load.
        try:
            from fla.ops.path_attn.parallel import parallel_path_attn
        except ImportError as e:
            raise ValueError(f"backend='fla' needs flash-linear-attention: {e}. Use backend='torch'.") from e

        # FLA keeps w, beta and g in fp32 for precision (and asserts it).
        o, k_cache = parallel_path_attn(
            q, k, v, w.float(), beta.float(), None if g is None else g.float(),
            scale=scale, cu_seqlens=cu_seqlens, use_cache=return_k_cache,
        )  # fmt: skip
        return o.to(q.dtype), (k_cache.to(k.dtype) if return_k_cache else None)
    # Autocast would run the matmuls in bf16, the chained products of the walk included: compute in fp32 (from
    # bf16 inputs too) and return q's dtype, as FLA's kernels do.
    with torch.autocast(q.device.type, enabled=False):
        return _chunked_path_attention(q, k, v, w, beta, g, scale, cu_seqlens, chunk_size, return_k_cache, recompute)


def path_decode_update(keys: torch.Tensor, w: torch.Tensor, beta: torch.Tensor) -> torch.Tensor:
    """Apply the new token's Householder transform to every cached key: `k <- k - beta (w . k) w`.

    Args:
        keys: cached, already transformed keys `[B, H, S, D]` (transformers' cache layout).
        w: the new token's direction `[B, H, D]`, L2-normalised.
        beta: the new token's strength `[B, H]`.

    Returns:
        The updated keys `[B, H, S, D]` in keys' dtype (the algebra runs in at least fp32).
    """
    dtype = torch.promote_types(keys.dtype, torch.float32)
    k, w = keys.to(dtype), w.to(dtype).unsqueeze(2)
    return (k - beta.to(dtype)[..., None, None] * (k * w).sum(-1, keepdim=True) * w).to(keys.dtype)


def naive_path_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Token-by-token reference: the decode recursion run over the whole sequence. O(T^2 D), for testing.

    Same arguments and output as `path_attention` (no packing).
    """
    B, T, HQ, D = q.shape
    G = HQ // k.shape[2]
    scale = D**-0.5 if scale is None else scale
    dtype = torch.promote_types(q.dtype, torch.float32)
    q, k, v = (x.to(dtype).transpose(1, 2) for x in (q, k, v))
    gate = torch.zeros(B, HQ, T, dtype=dtype, device=q.device) if g is None else g.to(dtype).transpose(1, 2)
    gate = gate.cumsum(-1)
    keys = k[:, :, :0]
    out = []
    for t in range(T):
        keys = torch.cat([path_decode_update(keys, w[:, t], beta[:, t]), k[:, :, t : t + 1]], dim=2)
        keys_q, v_q = keys.repeat_interleave(G, 1), v[:, :, : t + 1].repeat_interleave(G, 1)
        logits = (q[:, :, t : t + 1] @ keys_q.transpose(-1, -2)).squeeze(2)
        logits = scale * (logits + gate[..., t : t + 1] - gate[..., : t + 1])
        out.append((logits.softmax(-1).unsqueeze(2) @ v_q).squeeze(2))
    return torch.stack(out, dim=1).to(q.dtype)


# ---------------------------------------------------------------------------------------------------------------
# Torch backend
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
# The inter-chunk part walks the block diagonals: at step d every query chunk m >= d meets key chunk m - d at once
# (one batched matmul), then every running key is moved through the next chunk's P (on the key side: a chunk has C
# keys but G * C query rows under GQA). A flash-attention style online softmax keeps memory at O(T * (C + D)) per
# head, and Python loops over N chunks, not N^2 chunk pairs.
# ---------------------------------------------------------------------------------------------------------------


def _to_chunks(x: torch.Tensor, n_chunks: int, chunk_size: int, dtype: torch.dtype) -> torch.Tensor:
    """[B, T, H, ...] -> [N, B, H, C, ...] in `dtype`, zero-padded at the end to N * C tokens.

    The chunk dim leads so that a run of chunks is one contiguous slice: matmuls over it need no copies.
    """
    B, T = x.shape[:2]
    pad = n_chunks * chunk_size - T
    x = x.to(dtype)
    if pad:
        x = torch.cat([x, x.new_zeros(B, pad, *x.shape[2:])], dim=1)
    x = x.view(B, n_chunks, chunk_size, *x.shape[2:]).movedim(2, 3).movedim(1, 0)
    return x.contiguous()


def _from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[N, B, H, C, ...] -> [B, T, H, ...], dropping the end padding."""
    x = x.movedim(0, 1).movedim(3, 2)
    return x.flatten(1, 2)[:, :length]


def _chunk_householder(
    k: torch.Tensor, w: torch.Tensor, beta: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """UT transform of each chunk. k, w: [N, B, H, C, D]; beta: [N, B, H, C].

    Returns U [.., C, D], c [.., C, C], k~ (keys moved to their chunk's end) [.., C, D] and P_n [.., D, D].
    """
    C, D = w.shape[-2:]
    eye_c = torch.eye(C, dtype=w.dtype, device=w.device)
    wb = w * beta[..., None]
    lower = torch.tril(wb @ w.transpose(-1, -2), -1)
    rhs = torch.cat([wb, torch.tril(wb @ k.transpose(-1, -2), -1)], dim=-1)
    solved = torch.linalg.solve_triangular(lower + eye_c, rhs, upper=False, unitriangular=True)
    u, c = solved[..., :D], solved[..., D:]
    k_end = k - c.transpose(-1, -2) @ w
    p = torch.eye(D, dtype=w.dtype, device=w.device) - w.transpose(-1, -2) @ u
    return u, c, k_end, p


def _transformed_keys(k_end: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Move every chunk-end key through the later chunks: [N, B, H, C, D] -> fully transformed keys, same shape."""
    suffix = torch.eye(p.shape[-1], dtype=p.dtype, device=p.device).expand_as(p[0])
    out = [None] * len(k_end)
    for n in reversed(range(len(k_end))):
        out[n] = k_end[n] @ suffix.transpose(-1, -2)  # suffix = P_{N-1} ... P_{n+1}
        suffix = suffix @ p[n]
    return torch.stack(out)


def _sequence_transformed_keys(k, w, beta, chunk_size, dtype):
    """Fully transformed keys of one unpacked batch [B, T, H, D]."""
    T = k.shape[1]
    N = -(-T // chunk_size)
    kc, wc = (_to_chunks(x, N, chunk_size, dtype) for x in (k, w))
    _, _, k_end, p = _chunk_householder(kc, wc, _to_chunks(beta, N, chunk_size, dtype))
    return _from_chunks(_transformed_keys(k_end, p), T)


def _segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of each of `total` positions; positions past cu_seqlens[-1] get -1."""
    ids = torch.full((total,), -1, dtype=torch.long, device=cu_seqlens.device)
    lengths, end = cu_seqlens[1:] - cu_seqlens[:-1], _host_cu_seqlens(cu_seqlens)[-1]
    segments = torch.arange(len(lengths), device=ids.device)
    ids[:end] = torch.repeat_interleave(segments, lengths, output_size=end)  # output_size: no sync
    return ids


def _walk_segment(walk, recompute: bool, *state):
    """`walk(*state)`; with `recompute`, backward keeps only `state` and runs the walk again."""
    return checkpoint(walk, *state, use_reentrant=False) if recompute else walk(*state)


def _chunked_path_attention(q, k, v, w, beta, g, scale, cu_seqlens, chunk_size, return_k_cache, recompute):
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[-1]
    G, C = HQ // H, chunk_size
    N = -(-T // C)
    dtype = torch.promote_types(q.dtype, torch.float32)

    # GQA: the G query heads of a key head become G * C rows of each chunk, so one matmul serves them all.
    # The softmax scale is folded into q once.
    qc = _to_chunks(q.view(B, T, H, G, D), N, C, dtype).transpose(-2, -3).reshape(N, B, H, G * C, D) * scale
    kc, wc = _to_chunks(k, N, C, dtype), _to_chunks(w, N, C, dtype)
    # A ones column on v makes every `e @ v` also return the softmax denominator.
    # (padded keys get it too, so padded rows of a packed batch have a nonzero denominator).
    vc = _to_chunks(v, N, C, dtype)
    vc = torch.cat([vc, vc.new_ones(*vc.shape[:-1], 1)], -1)
    u, c, k_end, p = _chunk_householder(kc, wc, _to_chunks(beta, N, C, dtype))  # zero beta past T: identity

    seg = None if cu_seqlens is None else _segment_ids(cu_seqlens, N * C).view(N, C)
    causal = torch.ones(C, C, dtype=torch.bool, device=q.device).tril()

    def chunk_rows(x):  # [.., G, C, C] -> [.., G * C, C]
        return x.flatten(-3, -2)

    qw = chunk_rows((qc @ wc.transpose(-1, -2)).unflatten(-2, (G, C)).masked_fill(~causal, 0))
    q_start = qc - qw @ u
    logits = qc @ kc.transpose(-1, -2) - qw @ c

    gq = gk = None
    if g is not None:
        gcum = g.to(dtype).cumsum(1)
        if cu_seqlens is not None:  # restart the cumulative gate at every sequence start
            starts = torch.cat([gcum.new_zeros(1, 1, HQ), gcum], dim=1)[:, cu_seqlens[:-1]]
            gcum = gcum - starts[:, _segment_ids(cu_seqlens, T)]
        gc = _to_chunks(gcum.view(B, T, H, G) * scale, N, C, dtype).transpose(-1, -2)  # [N, B, H, G, C]
        gq, gk = gc.flatten(-2)[..., None], gc[..., None, :]

    # The walk folds the gate into its matmuls: the row of query head h carries (G_i, e_h) after its D columns and
    # a key carries (1, -G_j per head), so q . k_run = q^T P k + G_i - G_j; P acts as the identity on the extras.
    k_walk, p_walk = k_end, p
    if gq is not None:
        extra = 1 + G
        rows = torch.eye(G, dtype=dtype, device=q.device).repeat_interleave(C, 0)  # [G * C, G]: e_h of each row
        q_start = torch.cat([q_start, gq, rows.expand(*q_start.shape[:-2], -1, -1)], -1)
        k_walk = torch.cat([k_end, k_end.new_ones(*k_end.shape[:-1], 1), -gc.transpose(-1, -2)], -1)
        p_walk = torch.zeros(*p.shape[:-2], D + extra, D + extra, dtype=dtype, device=q.device)
        p_walk[..., :D, :D] = p
        p_walk[..., D:, D:] = torch.eye(extra, dtype=dtype, device=q.device)

    def block_logits(scores, m_slice, n_slice, gated=True):
        """Masked (and, unless `gated` is False, gated) logits of query chunks m_slice against key chunks n_slice."""
        if gq is not None and gated:
            scores = scores + gq[m_slice] - chunk_rows(gk[n_slice].expand(-1, -1, -1, -1, C, -1))
        mask = None
        if seg is not None:
            mask = seg[m_slice][:, None, None, None, :, None] == seg[n_slice][:, None, None, None, None, :]
        if m_slice == n_slice:
            mask = causal if mask is None else mask & causal
        if mask is not None:
            scores = chunk_rows(scores.unflatten(-2, (G, C)).masked_fill(~mask, float("-inf")))
        return scores

    # Diagonal blocks: every chunk against itself.
    s = block_logits(logits, slice(None), slice(None))
    m = s.amax(-1, keepdim=True)
    acc = torch.exp(s - m) @ vc  # [N, B, H, G * C, DV + 1]: unnormalised output and softmax denominator

    # Off-diagonal blocks, one block diagonal per step d: query chunk m meets key chunk m - d. Chunk m is complete
    # after step m and moves to `done`.
    last_step = N - 1
    if seg is not None:  # no sequence spans more than this many chunk boundaries
        last_step = max((b - 1) // C - a // C for a, b in pairwise(_host_cu_seqlens(cu_seqlens)) if b > a)
    # Without autograd, update the buffers in place (fewer memory passes).
    in_place = not (torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, w, beta, g)))

    def walk(first: int, stop: int, acc, m, k_run):
        """Steps `first` to `stop - 1`. `k_run` holds key chunks n = 0 ... N - 1 - first moved to the start of query
        chunk n + first: the keys carry the transforms (C rows a chunk, where the queries have G * C)."""
        finished = []
        for d in range(first, stop):
            s = block_logits(q_start[d:] @ k_run.transpose(-1, -2), slice(d, N), slice(0, N - d), gated=False)
            m_new = torch.maximum(m, s.amax(-1, keepdim=True))
            if in_place:
                acc = acc.mul_(torch.exp(m - m_new)).add_(s.sub_(m_new).exp_() @ vc[: N - d])
            else:
                acc = acc * torch.exp(m - m_new) + torch.exp(s - m_new) @ vc[: N - d]
            finished.append(acc[:1])
            acc, m = acc[1:], m_new[1:]
            if d < last_step:  # key chunk n moves through P_{n+d}
                k_run = k_run[:-1] @ p_walk[d : N - 1].transpose(-1, -2)
        return torch.cat(finished), acc, m, k_run

    # Backward keeps every step's softmax inputs unless they are large (or the caller says): then only the segment
    # boundaries are kept and the steps recomputed, memory O(T * (C + D)).
    saved_bytes = 3 * last_step * N / 2 * B * H * G * C * C * vc.element_size()
    recompute = not in_place and (saved_bytes > _CHECKPOINT_ABOVE_BYTES if recompute is None else recompute)
    done = [acc[:1]]
    state = (acc[1:], m[1:], k_walk[: N - 1])
    for first in range(1, last_step + 1, _STEPS_PER_CHECKPOINT):
        stop = min(first + _STEPS_PER_CHECKPOINT, last_step + 1)
        finished, *state = _walk_segment(walk, recompute, first, stop, *state)
        done.append(finished)
    done.append(state[0])

    acc = torch.cat(done)
    o = (acc[..., :DV] / acc[..., DV:]).unflatten(-2, (G, C)).transpose(-2, -3)  # [N, B, H, C, G, DV]
    o = _from_chunks(o, T).reshape(B, T, HQ, DV).to(q.dtype)
    if not return_k_cache:
        return o, None
    if cu_seqlens is None:
        k_cache = _from_chunks(_transformed_keys(k_end, p), T)
    else:  # each sequence's keys stop at its own end
        bounds = pairwise(_host_cu_seqlens(cu_seqlens))
        k_cache = torch.cat(
            [_sequence_transformed_keys(k[:, a:b], w[:, a:b], beta[:, a:b], C, dtype) for a, b in bounds], dim=1
        )
    return o, k_cache.to(k.dtype)


__all__ = [
    "BACKENDS",
    "FLA_HEAD_DIMS",
    "fla_available",
    "naive_path_attention",
    "path_attention",
    "path_decode_update",
    "resolve_backend",
]
