# Copyright 2026 The path-hf authors. Apache-2.0.
"""Exercise 1 of seed 000: RoPE by hand on a 64-dim head, and where frequency aliasing starts as N grows.

```
python -m lab.pe_lab.rope_by_hand           # prints the three checks below (a second or two)
```

1. RoPE in two lines of cos / sin (the seed's interleaved pairs), and q.k depending on the offset only: the scores of
   random q, k at positions (m, n) and (m + s, n + s) agree to float64 rounding, and equal q . R((n - m) theta) k.
2. Plane p turns by theta_p = base^(-2p/d) per position, so it comes back to the same angle every 2 pi / theta_p
   positions: over ids [0, N), the planes whose wavelength is below N are aliased (two ids a wavelength apart look
   alike in that plane). The first wraps at N = 7, half of them by N ~ 630, all 32 by N ~ 47,000.
3. The score of a vector against itself d positions away, f(d) = mean_p cos(d theta_p) (equal energy per plane),
   falls from 1 but has sidelobes: the largest f over [N/2, N) is printed with the nearest offset that scores no
   higher, i.e. how near a key N tokens away can look.
"""

from __future__ import annotations

import math

import torch

DIM, BASE = 64, 10000.0


def rope(x: torch.Tensor, position: torch.Tensor, base: float = BASE) -> torch.Tensor:
    """Seed 000's RoPE: turn each pair (2p, 2p+1) of `x` `[..., d]` by `position * theta_p`."""
    theta = base ** (-torch.arange(0, x.shape[-1], 2, dtype=x.dtype) / x.shape[-1])
    angle = position[..., None] * theta
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack([x1 * angle.cos() - x2 * angle.sin(), x1 * angle.sin() + x2 * angle.cos()], -1).flatten(-2)


def offset_only(trials: int = 1000, seed: int = 0) -> tuple[float, float]:
    """Largest |score(m, n) - score(m + s, n + s)| and |score(m, n) - q . R((n - m) theta) k| over random cases."""
    generator = torch.Generator().manual_seed(seed)
    q, k = torch.randn(2, trials, DIM, generator=generator, dtype=torch.float64)
    m, n, s = torch.randint(0, 100_000, (3, trials), generator=generator).double()
    score = (rope(q, m) * rope(k, n)).sum(-1)
    shifted = (rope(q, m + s) * rope(k, n + s)).sum(-1)
    relative = (q * rope(k, n - m)).sum(-1)
    return (score - shifted).abs().max().item(), (score - relative).abs().max().item()


def wavelengths() -> torch.Tensor:
    """2 pi / theta_p for the DIM / 2 planes, fastest first."""
    return 2 * math.pi * BASE ** (torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)


def self_score(max_offset: int) -> torch.Tensor:
    """f(d) = mean_p cos(d theta_p) for d in [0, max_offset)."""
    theta = BASE ** (-torch.arange(0, DIM, 2, dtype=torch.float64) / DIM)
    return (torch.arange(max_offset, dtype=torch.float64)[:, None] * theta).cos().mean(-1)


def main() -> None:
    shift, relative = offset_only()
    print(f"1. q.k depends on the offset only (d = {DIM}, 1000 random q, k, positions up to 100k, float64):")
    print(f"   max |s(m, n) - s(m + s, n + s)| = {shift:.1e};  max |s(m, n) - q.R(n - m)k| = {relative:.1e}\n")

    waves = wavelengths()
    print("2. planes that have wrapped (wavelength 2 pi / theta_p < N) over position ids [0, N):")
    print("   " + "  ".join(f"N={n}: {int((waves < n).sum())}" for n in (4, 8, 64, 256, 1024, 4096, 16384, 65536)))
    firsts = {p: math.ceil(waves[p].item()) for p in (0, DIM // 4 - 1, DIM // 2 - 1)}
    print("   first N at which plane p wraps: " + ", ".join(f"p={p}: {n}" for p, n in firsts.items()) + "\n")

    longest = 65536
    f = self_score(longest)
    print("3. self-score f(d) = mean_p cos(d theta_p): the largest f over d in [N/2, N), and the nearest offset")
    print("   scoring no higher (a key that far can look as near as that):")
    for n in (64, 256, 1024, 4096, 16384, 65536):
        top = f[n // 2 : n].max().item()
        nearest = int((f <= top).nonzero()[0])
        print(f"   N={n:6d}: max f = {top:+.3f}, as near as d = {nearest}")


if __name__ == "__main__":
    main()
