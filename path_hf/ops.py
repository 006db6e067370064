# Copyright 2026 The path-hf authors. Apache-2.0.
"""PaTH attention math: the entry point `path_attention`, which checks its inputs and picks a backend.

PaTH (Yang et al., 2025) scores a query against a key through the Householder transforms of every token in
between::

    logits_ij = scale * (q_i^T H_i H_{i-1} ... H_{j+1} k_j + G_i - G_j),   j <= i
    H_t = I - beta_t w_t w_t^T,   G = cumsum(g) within each sequence (log forget gate, optional)

`path_attention` runs this with FLA's Triton kernel (`backend="fla"`) or with the chunked PyTorch implementation
(`backend="torch"`: any device, any head dim, fp32 accumulation, memory O(T * chunk)). The semantics and tensor
layouts are FLA's `parallel_path_attn`, so a model trained on GPU behaves the same everywhere. The math lives in
files beside this one, as FLA keeps its kernels and their naive reference side by side:

- `ops_chunk.py`: the torch backend's entry `chunk_path_attention`, which chooses how to run (its knobs) and runs
  its stages, one a file as FLA's chunked kernels are:
  - `ops_inputs.py`: the inputs cut into chunks, the layout every stage reads (and cu_seqlens read to the host);
  - `ops_transform.py`: the intra-chunk UT transform, and chunk pairs merged into the walk's blocks;
  - `ops_walk.py`: the inter-chunk walk with its online softmax and its written-out backward;
  - `ops_superblock.py`: in inference on CPU, the walk within superblocks and fused attention across them;
  - `ops_key_cache.py`: the fully transformed keys a decode starts from;
- `ops_recurrent.py`: the decode-step key update `path_decode_update` and the token-by-token reference
  `naive_path_attention` built from it (both exported here too).

They are flat files on purpose, not a sub-package: `save_pretrained` copies the modeling file beside the weights
and, recursively, the files it imports with a flat relative import (`from .ops_chunk import ...`), so a checkpoint
loads with `trust_remote_code=True` where path_hf is absent.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Mapping
from functools import cache
from typing import Any

import torch

from .ops_chunk import chunk_path_attention
from .ops_inputs import host_cu_seqlens
from .ops_recurrent import naive_path_attention, path_decode_update

BACKENDS = ("auto", "torch", "fla")
# Head dims FLA's Triton kernels are compiled for (fla/ops/path_attn/parallel.py).
FLA_HEAD_DIMS = (16, 32, 64, 128)


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
        return "flash-linear-attention or triton is not installed (pip install 'flash-linear-attention>=0.6' triton)"
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


def _check_inputs(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    w: torch.Tensor,
    beta: torch.Tensor,
    g: torch.Tensor | None,
    *,
    cu_seqlens: torch.Tensor | None,
) -> None:
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
        bounds = host_cu_seqlens(cu_seqlens) if cu_seqlens.dim() == 1 else []
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
    chunk_options: Mapping[str, Any] | None = None,
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
        recompute: whether the torch backend's backward recomputes the running keys of its walk over the block
            diagonals (from every 8th step's) rather than keep every step's. None (the default) recomputes when
            keeping them would take more than 32 MiB: memory O(T * chunk) instead of O(T^2 / chunk * D), for a few
            percent more matmul work in backward. Pass False where the caller is recomputed in backward anyway (a
            gradient-checkpointed layer), whose second forward has just made them. FLA's kernel ignores it.
        chunk_options: more keyword arguments of the torch backend, `ops_chunk.chunk_path_attention`'s knobs
            (`walk_merges`, `superblock_tokens`, `checkpoint_above_bytes`, `window`, ...; its defaults where not
            given). Given any, `"auto"` runs the torch backend and `"fla"` refuses them.

    Returns:
        o `[B, T, HQ, DV]` in q's dtype, and k_cache `[B, T, H, D]` in k's dtype (None unless asked):
        `k_cache_j = H_e ... H_{j+1} k_j`, e the last position of j's sequence. Both backends accumulate in fp32
        whatever the input dtypes, under `torch.autocast` too. In inference on a CPU that multiplies bfloat16
        natively (AVX-512 BF16, AMX), the torch backend takes bfloat16 q as FLA's kernels do: the score and value
        products of its walk multiply in bfloat16 and accumulate in fp32, with about the error of SDPA in bfloat16
        on the same q, k, v (`ops_chunk.walk_product_dtype`; tests/ops/test_path_attention.py, BENCHMARKS.md).
    """
    _check_inputs(q, k, v, w, beta, g, cu_seqlens=cu_seqlens)
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive integer, got {chunk_size}.")
    if scale is None:
        scale = q.shape[-1] ** -0.5
    if chunk_options and backend == "fla":
        raise ValueError(f"backend='fla' has no chunk_options (got {sorted(chunk_options)}): use backend='torch'.")
    if chunk_options and backend == "auto":
        backend = "torch"
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
        return chunk_path_attention(
            q, k, v, w, beta, g,
            scale=scale, cu_seqlens=cu_seqlens, chunk_size=chunk_size, return_k_cache=return_k_cache,
            recompute=recompute, **(chunk_options or {}),
        )  # fmt: skip


__all__ = [
    "BACKENDS",
    "FLA_HEAD_DIMS",
    "fla_available",
    "naive_path_attention",
    "path_attention",
    "path_decode_update",
    "resolve_backend",
]
