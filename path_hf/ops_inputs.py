# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend's first stage: `path_attention`'s inputs cut into chunks, the layout every later stage reads.

`chunk_inputs` turns q, k, v, w, beta and g `[B, T, ...]` into `ChunkedInputs`: chunks of C tokens, `[N, B, H, ...]`
in the compute dtype (float32 or wider), the G query heads of a key head as the G * C rows of one chunk, the softmax
scale folded into q, a ones column on v (so that every `e @ v` also returns the softmax denominator), the cumulative
forget gate restarted at each packed sequence, and the masks (causal, and which sequence each position belongs to).
`to_chunks` / `from_chunks` / `chunk_order` move tensors in and out of that layout, also for the superblock layout of
`ops_superblock.py`; `host_cu_seqlens` reads cu_seqlens' values to the host once per tensor.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from functools import partial

import torch
from torch.profiler import record_function

# The values of the cu_seqlens seen last: (weak reference to the tensor, its version counter, its values).
_cu_seqlens_on_host: tuple[weakref.ref, int | None, list[int]] | None = None


def host_cu_seqlens(cu_seqlens: torch.Tensor) -> list[int]:
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


def segment_ids(cu_seqlens: torch.Tensor, total: int) -> torch.Tensor:
    """Sequence index of each of `total` positions; positions past cu_seqlens[-1] get -1."""
    ids = torch.full((total,), -1, dtype=torch.long, device=cu_seqlens.device)
    lengths, end = cu_seqlens[1:] - cu_seqlens[:-1], host_cu_seqlens(cu_seqlens)[-1]
    segments = torch.arange(len(lengths), device=ids.device)
    ids[:end] = torch.repeat_interleave(segments, lengths, output_size=end)  # output_size: no sync
    return ids


def to_chunks(x: torch.Tensor, n_chunks: int, chunk_size: int, dtype: torch.dtype, superblock: int = 0) -> torch.Tensor:
    """[B, T, H, ...] -> [N, B, H, C, ...] in `dtype`, zero-padded at the end to N * C tokens.

    The chunk dim leads so that a run of chunks is one contiguous slice: matmuls over it need no copies. With
    `superblock` S (`ops_superblock.superblock_attention`), the superblocks of S chunks are a batch instead:
    [S, N / S * B, H, C, ...], chunk j * S + s of batch b at [s, j * B + b].
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


def chunk_order(x: torch.Tensor, chunks: ChunkedInputs) -> torch.Tensor:
    """[N, B, ...] from a tensor of `chunks`' layout: the superblock layout of `to_chunks` undone."""
    if not chunks.superblock:
        return x
    return x.unflatten(1, (-1, chunks.batch)).transpose(0, 1).flatten(0, 1)


def from_chunks(x: torch.Tensor, length: int) -> torch.Tensor:
    """[N, B, H, C, ...] -> [B, T, H, ...], dropping the end padding."""
    x = x.movedim(0, 1).movedim(3, 2)
    return x.flatten(1, 2)[:, :length]


def chunk_rows(x: torch.Tensor) -> torch.Tensor:
    """[.., G, C, C] -> [.., G * C, C]: the G query heads of a key head as the rows of one chunk."""
    return x.flatten(-3, -2)


@dataclass(frozen=True)
class ChunkedInputs:
    """The inputs cut into chunks, `[N, B, H, ...]` in the compute dtype, and what the steps mask with."""

    q: torch.Tensor | None  # [N, B, H, G * C, D]: the G query heads of key head h as G * C rows, scale folded in
    k: torch.Tensor  # [N, B, H, C, D]; once merged (`ops_transform.merge_chunks`), the keys moved to their chunk's end
    v: torch.Tensor  # [N, B, H, C, DV + 1]: a ones column last
    w: torch.Tensor | None  # [N, B, H, C, D]; q, w and beta are None once merged: the walk needs none of them
    beta: torch.Tensor | None  # [N, B, H, C], 0 past T: padded tokens transform nothing; None once merged
    gate: torch.Tensor | None  # [N, B, H, G, C]: scale * G_i (cumulative log gate per sequence); None without g
    segment: torch.Tensor | None  # [N, C]: sequence index of each position (-1 past T); None without cu_seqlens
    causal: torch.Tensor  # [C, C] bool, lower triangle
    group: int  # G, query heads per key head
    batch: int  # B
    # S: the layout [S, N / S * B, ...] of `to_chunks`, for `ops_superblock.superblock_attention`; 0: [N, B, ...]
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


def chunk_inputs(
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
) -> ChunkedInputs:
    """`path_attention`'s inputs [B, T, ...] cut into chunks of `chunk_size` tokens, and the masks; the number of
    chunks a multiple of `chunks_multiple` (padding chunks at the end); in the superblock layout of `to_chunks` with
    `superblock` (unpacked only). In the profiler range `path_attention.chunk_inputs`."""
    with record_function("path_attention.chunk_inputs"):
        B, T, HQ, D = q.shape
        H = k.shape[2]
        G, C = HQ // H, chunk_size
        N = -(-T // (C * chunks_multiple)) * chunks_multiple
        dtype = torch.promote_types(q.dtype, torch.float32)

        # GQA: the G query heads of a key head become G * C rows of each chunk, so one matmul serves them all.
        # The softmax scale is folded into q once.
        chunk = partial(to_chunks, n_chunks=N, chunk_size=C, dtype=dtype, superblock=superblock)
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
                gcum = gcum - starts[:, segment_ids(cu_seqlens, T)]
            gc = chunk(gcum.view(B, T, H, G) * scale).transpose(-1, -2)
        return ChunkedInputs(
            q=qc,
            k=kc,
            v=vc,
            w=wc,
            beta=betac,
            gate=gc,
            segment=None if cu_seqlens is None else segment_ids(cu_seqlens, N * C).view(N, C),
            causal=torch.ones(C, C, dtype=torch.bool, device=q.device).tril(),
            group=G,
            batch=B,
            superblock=superblock,
        )


__all__ = [
    "ChunkedInputs",
    "chunk_inputs",
    "chunk_order",
    "chunk_rows",
    "from_chunks",
    "host_cu_seqlens",
    "segment_ids",
    "to_chunks",
]
