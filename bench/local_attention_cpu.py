"""CPU benchmark: a hybrid's local layer (`path_hf.local_attention`): its blockwise sliding-window attention, each
block in PyTorch's fused attention (the sinks merged through its log-sum-exp) or in the explicit products it falls
back to, against SDPA's causal kernel over the whole prefill (what a prefill within the window takes).

    OMP_NUM_THREADS=1 python bench/local_attention_cpu.py                  # SmolLM2's shapes: 9 query heads, 3 KV heads
    OMP_NUM_THREADS=1 python bench/local_attention_cpu.py --seq-lens 16384 --window 8192 --reps 2   # past the window

With the window at least T (the default), the three compute the same attention. With a shorter window (`--window`)
the blocks attend to the last `window` keys and 4 renumbered sinks, and SDPA causal, which attends to every key, is
the cost of the same layer without a window. Times are medians of --reps runs after one warm-up, the methods
alternating in one process, so background load hits them alike. Writes a Markdown table to stdout.
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time

import torch

import path_hf.local_attention as local

METHODS = ("explicit", "fused", "sdpa")


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def case(length: int, window: int, backward: bool, heads: int, kv_heads: int, dim: int, method: str):
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, heads, length, dim, generator=generator, requires_grad=backward)
    key = torch.randn(1, kv_heads, length, dim, generator=generator, requires_grad=backward)
    value = torch.randn(1, kv_heads, length, dim, generator=generator, requires_grad=backward)
    positions = torch.arange(length)[None]
    inv_freq = 1.0 / (1e5 ** (torch.arange(0, dim, 2).float() / dim))

    def run():
        with torch.set_grad_enabled(backward):
            out = local.local_attention(
                query,
                key,
                value,
                positions,
                positions,
                window=length if method == "sdpa" else window,
                sinks=4,
                inv_freq=inv_freq,
                scaling=dim**-0.5,
                fused=method != "explicit",  # the blocks' explicit products, or PyTorch's fused attention
                causal_kernel=method == "sdpa",  # the blocks even where the window holds the whole prefill
            )
            if backward:
                out.sum().backward()

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-lens", default="512,2048,8192")
    parser.add_argument("--window", type=int, default=None, help="the local window (default: each T, no cut)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--forward-only", action="store_true")
    args = parser.parse_args()
    print(
        f"{platform.processor() or platform.machine()}, torch {torch.__version__}, {torch.get_num_threads()} thread(s)"
    )
    print(
        "| T | window | pass | explicit blocks | fused blocks | SDPA causal, no window | explicit / fused "
        "| fused / SDPA |\n|---:|---:|---|---:|---:|---:|---:|---:|"
    )
    for length in map(int, args.seq_lens.split(",")):
        window = args.window or length
        for backward in (False,) if args.forward_only else (False, True):
            runs = {method: case(length, window, backward, 9, 3, 64, method) for method in METHODS}
            times = {method: [] for method in runs}
            for run in runs.values():
                run()
            for _ in range(args.reps):
                for method, run in runs.items():
                    times[method].append(timed(run))
            explicit, fused, sdpa = (statistics.median(times[method]) for method in METHODS)
            name = "forward+backward" if backward else "forward"
            print(
                f"| {length} | {window} | {name} | {explicit * 1e3:.1f} ms | {fused * 1e3:.1f} ms "
                f"| {sdpa * 1e3:.1f} ms | {explicit / fused:.2f}x | {fused / sdpa:.2f}x |",
                flush=True,
            )


if __name__ == "__main__":
    main()
