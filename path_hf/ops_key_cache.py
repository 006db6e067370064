# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend's key-cache preparation: the fully transformed keys a decode starts from after a prefill.

`k_cache_j = H_e ... H_{j+1} k_j`, e the last position of j's sequence: each chunk-end key k~ (`ops_transform.py`)
moved through the P_n of every later chunk, per packed sequence. Decoding then keeps them transformed one token at a
time (`ops_recurrent.path_decode_update`). `key_cache` is the stage's entry, in the profiler range
`path_attention.key_cache`.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

from itertools import pairwise

import torch
from torch.profiler import record_function

from .ops_inputs import from_chunks, host_cu_seqlens, to_chunks
from .ops_transform import chunk_householder


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
    kc, wc = (to_chunks(x, N, chunk_size, dtype) for x in (k, w))
    _, _, k_end, p = chunk_householder(kc, wc, to_chunks(beta, N, chunk_size, dtype))
    return from_chunks(_transformed_keys(k_end, p), T)


def key_cache(
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

    Unpacked, from the intra-chunk transform's k~ and P_n ([N, B, H, C, D] and [N, B, H, D, D], in chunk order:
    `ops_inputs.chunk_order`); packed, each sequence's keys stop at its own end.
    """
    with record_function("path_attention.key_cache"):
        if cu_seqlens is None:
            return from_chunks(_transformed_keys(k_end, p), k.shape[1])
        bounds = pairwise(host_cu_seqlens(cu_seqlens))
        return torch.cat(
            [
                _sequence_transformed_keys(k[:, a:b], w[:, a:b], beta[:, a:b], chunk_size=chunk_size, dtype=k_end.dtype)
                for a, b in bounds
            ],
            dim=1,
        )


__all__ = ["key_cache"]
