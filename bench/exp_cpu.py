"""PyTorch's CPU exp on arguments whose exp underflows, against the torch backend's `floored_exp_` (clamped first).

    python bench/exp_cpu.py            # a few seconds

A softmax exponentiates logits minus their row maximum: masked keys (-inf) and keys gated or scored far below the
maximum give arguments below log(float32's smallest normal number), about -87.3, whose exp is subnormal or 0. Times
`torch.exp` on one million float32 values (the size of one walk step's scores at T=2048, H=8, C=64) drawn as below,
and `path_hf.ops_walk.floored_exp_` on the same values; median of 10 after 2 warm-ups, one thread.
"""

from __future__ import annotations

import statistics
import time

import torch
from attention_cpu import machine_info

from path_hf.ops_walk import floored_exp_


def median_ms(fn, reps: int = 10) -> float:
    for _ in range(2):
        fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1e3 * statistics.median(times)


def main() -> None:
    torch.set_num_threads(1)
    x = torch.randn(32, 8, 64, 64, generator=torch.Generator().manual_seed(0))
    half_masked = x.masked_fill(torch.rand(x.shape, generator=torch.Generator().manual_seed(1)) < 0.5, float("-inf"))
    cases = {
        "N(0, 1)": x,
        "N(0, 1) - 80 (exp normal)": x - 80,
        "N(0, 1) - 100 (exp subnormal)": x - 100,
        "N(0, 1) - 200 (exp 0)": x - 200,
        "half -inf (a causal mask)": half_masked,
    }
    info = machine_info(1)
    print(f"# {info['cpu']}, torch {info['torch']}, one thread, 1M float32; load average {info['loadavg_start']}\n")
    print("| arguments | torch.exp ms | floored_exp_ ms | torch.exp / floored_exp_ |")
    print("|---|---:|---:|---:|")
    for name, values in cases.items():
        plain = median_ms(lambda values=values: torch.exp(values))
        clamped = median_ms(lambda values=values: floored_exp_(values.clone()))
        copy = median_ms(lambda values=values: values.clone())
        print(f"| {name} | {plain:.2f} | {clamped - copy:.2f} | {plain / (clamped - copy):.1f}x |")
    print("\n(floored_exp_ works in place: its time is that of `floored_exp_(x.clone())` less that of `x.clone()`.)")


if __name__ == "__main__":
    main()
