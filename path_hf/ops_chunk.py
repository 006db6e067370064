# Copyright 2026 The path-hf authors. Apache-2.0.
"""The torch backend of `path_attention`: PaTH attention chunked in PyTorch, on any device and head dim.

`chunk_path_attention` is the entry point, which `path_attention` calls after checking its inputs. It chooses how to
run (its knobs, each an explicit keyword argument with its default here or beside the stage it tunes) and runs the
stages, one a file as FLA keeps its chunked kernels:

- `ops_inputs.py`: the inputs cut into chunks of C tokens (`chunk_inputs`), the layout every stage reads;
- `ops_transform.py`: the intra-chunk transform (`intra_chunk`): the UT transform of each chunk's Householder
  product, the logits within a chunk and the queries moved back to their chunk's start; pairs of chunks are then
  merged into the walk's blocks (`merge_chunks`, `walk_merges` times; by default once past `MERGE_ABOVE` chunks), so
  that the walk moves its keys once per two chunks;
- `ops_walk.py`: the inter-chunk walk (`inter_chunk`): the block diagonals, one step each, with an online softmax,
  and its backward written out, which recomputes the running keys from every `steps_per_checkpoint`-th step where
  keeping them all would take more than `checkpoint_above_bytes`;
- `ops_superblock.py`: in inference on CPU, superblocks (`superblock_attention`): the walk runs within superblocks
  of `superblock_tokens` tokens, and each superblock's queries meet every earlier key in PyTorch's fused
  flash-attention kernel;
- `ops_key_cache.py`: key-cache preparation (`key_cache`): the fully transformed keys a decode starts from, per
  packed sequence.

Everything runs in fp32 (or wider) with memory O(T * chunk). Each stage runs in a profiler range of its own
(`torch.profiler.record_function`: `path_attention.chunk_inputs`, `.intra_chunk`, `.merge_chunks`, `.walk`,
`.next_keys`, `.walk_backward`, `.superblocks`, `.far_attention`, `.key_cache`), which bench/profile_cpu.py reads.

A flat file, as `ops.py` explains: a checkpoint's remote code copies it beside the weights, with the files above.
"""

from __future__ import annotations

import math

import torch

from .ops_inputs import chunk_inputs, chunk_order, from_chunks
from .ops_key_cache import key_cache
from .ops_superblock import FUSED_CPU_ATTENTION, SUPERBLOCK_TOKENS, superblock_attention, superblock_blocks
from .ops_transform import MERGE_ABOVE, default_walk_merges, intra_chunk, merge_chunks
from .ops_walk import CHECKPOINT_ABOVE_BYTES, STEPS_PER_CHECKPOINT, inter_chunk, walk_last_step


def cpu_multiplies_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 natively (AMX or AVX-512 BF16): there bfloat16 products run several times
    faster than float32 ones; without them PyTorch emulates bfloat16, slower than float32."""
    return torch.cpu._is_amx_tile_supported() or torch.cpu._is_avx512_bf16_supported()


def walk_product_dtype(q: torch.Tensor, requires_grad: bool) -> torch.dtype | None:
    """The default `product_dtype` of `chunk_path_attention`: bfloat16 for bfloat16 queries on a CPU that multiplies
    bfloat16 natively, in inference (where it is measured faster: BENCHMARKS.md); else None, the compute dtype."""
    fast = q.device.type == "cpu" and q.dtype == torch.bfloat16 and cpu_multiplies_bf16()
    return torch.bfloat16 if fast and not requires_grad else None


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
    merge_above: int = MERGE_ABOVE,
    superblock_tokens: int = SUPERBLOCK_TOKENS,
    window: int | None = None,
    window_sink: bool = False,
    checkpoint_above_bytes: int = CHECKPOINT_ABOVE_BYTES,
    steps_per_checkpoint: int = STEPS_PER_CHECKPOINT,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The torch backend: `path_attention`'s arguments (checked there, `scale` given) and outputs.

    Computes in q's dtype promoted to at least fp32. `path_attention` calls it with autocast off, which would run the
    matmuls in bf16. The knobs, which change how it computes but not what (`window` excepted):

    - `product_dtype` (inference): a dtype, None for the compute dtype, or "auto" (`walk_product_dtype`): the input
      dtype of the walk's score and value products (`ops_walk._softmax_walk`);
    - `walk_merges`: the walk runs over blocks of `chunk_size * 2**walk_merges` tokens (`ops_transform.merge_chunks`);
      None: once past `merge_above` chunks, else never (`ops_transform.default_walk_merges`);
    - `superblock_tokens`: inference on CPU without `cu_seqlens`, `walk_merges` or `window` runs over superblocks of
      that many tokens (`ops_superblock.superblock_attention`, where `superblock_blocks` finds it worth it; 0: never);
    - `checkpoint_above_bytes`, `steps_per_checkpoint`: where `recompute` is None, backward recomputes the walk's
      running keys from every `steps_per_checkpoint`-th step's when keeping them all would take more than
      `checkpoint_above_bytes` (`ops_walk.inter_chunk`);
    - `window` (a study of what a model reads, not PaTH attention: lab/smollm2/passkey_probe.py): each query sees
      only the keys of its own block and the `ceil(window / block)` blocks before it, block the walk's block of
      `chunk_size * 2**walk_merges` tokens (at least `window` keys back, fewer than `window + block`); with
      `window_sink`, also the first block of its sequence.
    """
    if window is not None and window < 0:
        raise ValueError(f"window must be None or at least 0, got {window}.")
    if window_sink and window is None:
        raise ValueError("window_sink needs a window.")
    B, T, HQ = q.shape[:3]
    DV = v.shape[-1]
    requires_grad = torch.is_grad_enabled() and any(x is not None and x.requires_grad for x in (q, k, v, w, beta, g))
    if product_dtype == "auto":
        product_dtype = walk_product_dtype(q, requires_grad)
    superblock = 0  # superblocks: inference on CPU, unpacked, over unmerged chunks (faster there: BENCHMARKS.md)
    if (
        not requires_grad
        and cu_seqlens is None
        and q.device.type == "cpu"
        and not walk_merges
        and window is None
        and FUSED_CPU_ATTENTION
    ):
        superblock = superblock_blocks(T, chunk_size, superblock_tokens)
    if superblock:
        merges = 0
    elif walk_merges is None:
        merges = default_walk_merges(T, chunk_size, merge_above=merge_above)
    else:
        merges = walk_merges
    chunks = chunk_inputs(
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
    q_start, logits, k_end, p = intra_chunk(chunks)
    walk = (chunks, q_start, logits, k_end, p)
    for _ in range(merges):
        walk = merge_chunks(*walk)
    walk_chunks = walk[0]
    if superblock:
        o = superblock_attention(
            walk_chunks, logits=walk[2], q_start=walk[1], k_end=walk[3], p=walk[4], product_dtype=product_dtype
        )
    else:
        last_step = walk_last_step(cu_seqlens, n_chunks=walk_chunks.n_chunks, chunk_size=walk_chunks.chunk_size)
        sink_after = None
        if window is not None:
            window_steps = math.ceil(window / walk_chunks.chunk_size)
            if window_sink:
                sink_after = window_steps
            else:
                last_step = min(last_step, window_steps)
        o = inter_chunk(
            walk_chunks,
            q_start=walk[1],
            logits=walk[2],
            k_end=walk[3],
            p=walk[4],
            last_step=last_step,
            requires_grad=requires_grad,
            recompute=recompute,
            product_dtype=product_dtype,
            sink_after=sink_after,
            checkpoint_above_bytes=checkpoint_above_bytes,
            steps_per_checkpoint=steps_per_checkpoint,
        )
    o = chunk_order(o, chunks).unflatten(-2, (chunks.group, walk_chunks.chunk_size))
    o = o.transpose(-2, -3)  # [N, B, H, C, G, DV]
    o = from_chunks(o, T).reshape(B, T, HQ, DV).to(q.dtype)
    if not return_k_cache:
        return o, None
    k_end, p = chunk_order(k_end, chunks), chunk_order(p, chunks)
    k_cache = key_cache(k, w, beta, k_end=k_end, p=p, cu_seqlens=cu_seqlens, chunk_size=chunk_size)
    return o, k_cache.to(k.dtype)


__all__ = ["chunk_path_attention", "cpu_multiplies_bf16", "walk_product_dtype"]
