"""Experiment, not used by path_hf: the "super-block row walk" variant of the torch backend's forward.

Each query chunk attends to all earlier keys at once; keys are kept transformed to the start of the current
super-block of S chunks (far keys) or of the current chunk (near keys), so the Householder products `P_n` are
folded into the far keys only once per super-block. Forward only, no forget gate, no packing. Prints its largest
difference to `path_attention`, then its forward time against `path_attention` and SDPA at 2048 and 4096 tokens.

    python -m lab.bench.superblock_rows
"""

import time
from functools import partial

import torch
import torch.nn.functional as F

from path_hf.ops import path_attention
from path_hf.ops_inputs import from_chunks, to_chunks
from path_hf.ops_transform import chunk_householder


@torch.no_grad()
def superblock_rows(q, k, v, w, beta, chunk_size: int = 64, superblock: int = 4) -> torch.Tensor:
    B, T, HQ, D = q.shape
    H, DV = k.shape[2], v.shape[-1]
    G, C, S = HQ // H, chunk_size, superblock
    N = -(-T // C)
    qc = to_chunks(q.view(B, T, H, G, D), N, C, torch.float32).transpose(-2, -3).reshape(N, B, H, G * C, D)
    qc = qc * D**-0.5
    kc, wc, vc = (to_chunks(x, N, C, torch.float32) for x in (k, w, v))
    u, c, k_end, p = chunk_householder(kc, wc, to_chunks(beta, N, C, torch.float32))
    causal = torch.ones(C, C, dtype=torch.bool).tril()
    qw = (qc @ wc.transpose(-1, -2)).unflatten(-2, (G, C)).masked_fill(~causal, 0).flatten(-3, -2)
    q_start = qc - qw @ u
    diag = (qc @ kc.transpose(-1, -2) - qw @ c).unflatten(-2, (G, C)).masked_fill(~causal, float("-inf"))
    diag = diag.flatten(-3, -2)
    values = vc.permute(1, 2, 0, 3, 4).reshape(B, H, N * C, DV)
    keys = k_end.new_empty(B, H, N * C, D)  # [0, s0 C): at the start of chunk s0; [s0 C, m C): at the start of m
    scores = k_end.new_empty(B, H, G * C, N * C)
    eye = torch.eye(D)
    since_s0, s0, out = eye, 0, []
    for m in range(N):
        if m and m % S == 0:  # fold the super-block's product into the far keys
            keys[:, :, : m * C] = torch.cat(
                [keys[:, :, : s0 * C] @ since_s0.transpose(-1, -2), keys[:, :, s0 * C : m * C]], dim=2
            )
            s0, since_s0 = m, eye
        end = (m + 1) * C
        s = scores[..., :end]
        if s0:
            s[..., : s0 * C] = (q_start[m] @ since_s0) @ keys[:, :, : s0 * C].transpose(-1, -2)
        if m > s0:
            s[..., s0 * C : m * C] = q_start[m] @ keys[:, :, s0 * C : m * C].transpose(-1, -2)
        s[..., m * C : end] = diag[m]
        out.append(torch.softmax(s, -1) @ values[:, :, :end])
        if m > s0:
            keys[:, :, s0 * C : m * C] = keys[:, :, s0 * C : m * C] @ p[m].transpose(-1, -2)
        keys[:, :, m * C : end] = k_end[m]
        since_s0 = p[m] @ since_s0
    o = torch.stack(out).unflatten(-2, (G, C)).transpose(-2, -3)
    return from_chunks(o, T).reshape(B, T, HQ, DV)


def inputs(T: int, H: int, D: int) -> tuple[torch.Tensor, ...]:
    q, k, v = (torch.randn(1, T, H, D) for _ in range(3))
    return q, k, v, F.normalize(torch.randn(1, T, H, D), dim=-1), torch.rand(1, T, H) * 2


def time_length(T: int) -> None:
    """Median of 3 forward times at length T (H=8, D=64), the methods alternating so load hits all of them."""
    q, k, v, w, beta = inputs(T, 8, 64)
    qt, kt, vt = (t.transpose(1, 2) for t in (q, k, v))
    runs = {
        "sdpa": partial(F.scaled_dot_product_attention, qt, kt, vt, is_causal=True),
        "path_attention": partial(path_attention, q, k, v, w, beta, backend="torch"),
        "rows C=64 S=4": partial(superblock_rows, q, k, v, w, beta, chunk_size=64, superblock=4),
        "rows C=64 S=8": partial(superblock_rows, q, k, v, w, beta, chunk_size=64, superblock=8),
    }
    times = {name: [] for name in runs}
    with torch.no_grad():
        for run in runs.values():
            run()
        for _ in range(3):
            for name, run in runs.items():
                start = time.perf_counter()
                run()
                times[name].append(time.perf_counter() - start)
    base = sorted(times["sdpa"])[1]
    for name, ts in times.items():
        print(f"T={T} {name:16s} {1e3 * sorted(ts)[1]:8.1f} ms  {sorted(ts)[1] / base:.2f}x SDPA")


def main() -> None:
    torch.manual_seed(0)
    x = inputs(700, 4, 16)
    with torch.no_grad():
        error = (superblock_rows(*x, chunk_size=32, superblock=3) - path_attention(*x, backend="torch")[0]).abs()
    print(f"max abs difference to path_attention: {error.max().item():.2e}")
    torch.set_num_threads(1)
    for T in (2048, 4096):
        time_length(T)


if __name__ == "__main__":
    main()
