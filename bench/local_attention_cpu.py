"""CPU benchmark: a hybrid's local layer (`path_hf.local_attention`) on a prefill within its window, SDPA's causal
kernel (what it takes since the fast path) against its blockwise sliding-window attention (what it took before, and
what it takes past the window or on padded rows).

    OMP_NUM_THREADS=1 python bench/local_attention_cpu.py                  # SmolLM2's shapes: 9 query heads, 3 KV heads

Times are medians of --reps runs after one warm-up, the two methods alternating in one process, so background load
hits both alike. Writes a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import path_hf.local_attention as local


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(length: int, backward: bool, heads: int, kv_heads: int, dim: int, blocks: bool):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, length, dim, generator=generator, requires_grad=backward)
    key = torch.randn(1, kv_heads, length, dim, generator=generator, requires_grad=backward)
    value = torch.randn(1, kv_heads, length, dim, generator=generator, requires_grad=backward)
    positions = torch.arange(length)[None]
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, dim, 2).float() / dim))

    def run():
        original = local._within_window
        if blocks:
            local._within_window = lambda *args: False
        try:
            with torch.set_grad_enabled(backward):
                out = local.local_attention(
                    query,
                    key,
                    value,
                    positions,
                    positions,
                    window=length,
                    sinks=4,
                    inv_freq=inv_freq,
                    scaling=dim**-0.5,
                )
                if backward:
                    out.sum().backward()
        finally:
            local._within_window = original

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="512,2048,8192")
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print("| T | pass | blockwise | SDPA causal | blockwise / SDPA |\n|---:|---|---:|---:|---:|")
    for length in map(int, args.seq_lens.split(",")):
        for backward in (False, True):
            runs = {blocks: case(length, backward, 9, 3, 64, blocks) for blocks in (True, False)}
            times = {blocks: [] for blocks in runs}
            for run in runs.values():
                run()
            for _ in range(args.reps):
                for blocks, run in runs.items():
                    times[blocks].append(timed(run))
            block, fast = (statistics.median(times[b]) for b in (True, False))
            name = "forward+backward" if backward else "forward"
            print(f"| {length} | {name} | {block * 1e3:.1f} ms | {fast * 1e3:.1f} ms | {block / fast:.2f}x |")


if __name__ == "__main__":
    main()
