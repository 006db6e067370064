"""CPU benchmark: PaTH attention (torch backend) against RoPE + causal SDPA on the same shapes.

    python bench/attention_cpu.py                                  # T in 512..4096, a few minutes on 2 cores
    python bench/attention_cpu.py --chunk-sizes 32,64,128,256      # adds a chunk-size sweep at --sweep-seq-len
    python bench/attention_cpu.py --seq-lens '' --checkpointed-seq-lens 1024,2048,4096   # gradient checkpointing only

Both sides are timed from the per-head projections to the attention output, so each pays for its own
position encoding: the baseline builds cos/sin and rotates q and k (RoPE), PaTH normalises w and squashes
beta. Times are medians of --reps runs after --warmup runs, in one process, with the repetitions of the
methods compared alternating, so background load hits both alike.
Peak memory is measured in a fresh subprocess, case after case: resident-set high-water mark (VmHWM, reset through
/proc/self/clear_refs after the case's inputs are allocated and one warm-up run) minus the resident size then,
with glibc's mmap threshold fixed at 64 KiB so that every tensor's memory is mapped when allocated and returned
when freed.
With --checkpointed-seq-lens, forward+backward also runs as in a gradient-checkpointed layer (the forward inside
torch.utils.checkpoint, recomputed in backward), PaTH both ways: the walk's running keys kept for backward
(`recompute=False`, what a checkpointed PaTH layer does) and recomputed in backward from every 8th step's
(`recompute=True`, the default for long walks).
With --ops-before COMMIT, the main table also times `path_attention` of path_hf.ops as it was at COMMIT (method
`path@COMMIT`), interleaved with the working tree's, and gives the working tree's time over that one.
Writes a Markdown table to stdout and JSON to bench/out/.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from ops_versions import load_ops_at
from torch.utils.checkpoint import checkpoint
from transformers.dynamic_module_utils import get_relative_import_files

from path_hf import ops

METHODS = ("sdpa", "path")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
GOALS = {"fwd": 2.0, "fwd+bwd": 2.0}  # the goals: PaTH's time over SDPA+RoPE's, at every length
MODES = ("fwd", "fwd+bwd")
RECOMPUTE = {"auto": None, "on": True, "off": False}
# On a shared 2-core machine two OpenMP threads stall whenever another process holds a core: we saw 10x
# slowdowns and fwd slower than fwd+bwd. One thread gives ratios that reproduce.
THREADS_HELP = "torch.set_num_threads; default 1, because 2 threads on a busy 2-core machine give erratic times"


@dataclass(frozen=True)
class Case:
    method: str  # "sdpa": RoPE + causal SDPA; "path": path_attention(backend="torch"); "path@COMMIT": as at COMMIT
    seq_len: int
    mode: str  # "fwd" runs under no_grad; "fwd+bwd" takes gradients of every input; "ckpt" as well, checkpointed
    chunk_size: int
    recompute: str = "auto"  # path_attention's `recompute`: "auto" (None), "on" (True), "off" (False)

    def spec(self) -> str:
        return f"{self.method}:{self.seq_len}:{self.mode}:{self.chunk_size}:{self.recompute}"

    @classmethod
    def parse(cls, spec: str) -> Case:
        method, seq_len, mode, chunk_size, recompute = spec.split(":")
        return cls(method, int(seq_len), mode, int(chunk_size), recompute)


def rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Llama's rotate-half RoPE on x [B, T, H, D]."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


def make_inputs(
    case: Case,
    heads: int,
    head_dim: int,
    requires_grad: bool,
    gate_bias: float | None = None,
    dtype: torch.dtype = torch.float32,
) -> dict[str, torch.Tensor]:
    """Projection outputs [B=1, T, H, D] in `dtype` as a layer would hand them to attention; with `gate_bias`, PaTH
    also gets the forget gate's logits (PaTH-FoX), drawn from N(gate_bias, 1)."""
    gen = torch.Generator().manual_seed(0)
    shape = (1, case.seq_len, heads, head_dim)
    names = ["q", "k", "v"] + (["w", "b"] if case.method.startswith("path") else [])
    names += ["g"] if case.method.startswith("path") and gate_bias is not None else []
    inputs = {n: torch.randn(shape if n not in "bg" else shape[:3], generator=gen) for n in names}
    if "g" in inputs:
        inputs["g"] += gate_bias
    inputs = {n: t.to(dtype) for n, t in inputs.items()}
    for t in inputs.values():
        t.requires_grad_(requires_grad)
    return inputs


def make_step(case: Case, inputs: dict[str, torch.Tensor]) -> Callable[[], object]:
    """One forward (or forward+backward) pass, everything after the q/k/v/w/beta projections."""
    q, k, v = inputs["q"], inputs["k"], inputs["v"]
    head_dim = q.shape[-1]
    if case.method == "sdpa":
        inv_freq = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim))

        def forward() -> torch.Tensor:
            angles = torch.arange(case.seq_len, dtype=torch.float32)[:, None] * inv_freq
            emb = torch.cat((angles, angles), dim=-1)[None, :, None, :]
            cos, sin = emb.cos().to(q.dtype), emb.sin().to(q.dtype)
            qr, kr = rope(q, cos, sin), rope(k, cos, sin)
            qr, kr, vt = (x.transpose(1, 2) for x in (qr, kr, v))  # SDPA wants [B, H, T, D]
            return F.scaled_dot_product_attention(qr, kr, vt, is_causal=True).transpose(1, 2)

    else:
        w_raw, b_raw = inputs["w"], inputs["b"]
        _, _, commit = case.method.partition("@")
        path_attention = (load_ops_at(commit) if commit else ops).path_attention
        # `recompute` only when asked: older commits' path_attention has none
        options = {} if case.recompute == "auto" else {"recompute": RECOMPUTE[case.recompute]}

        g_raw = inputs.get("g")

        def forward() -> torch.Tensor:
            w = F.normalize(w_raw, dim=-1)
            beta = 2 * torch.sigmoid(b_raw)  # in (0, 2)
            g = None if g_raw is None else F.logsigmoid(g_raw)  # log forget gate, as PaTH-FoX computes it
            o, _ = path_attention(q, k, v, w, beta, g, backend="torch", chunk_size=case.chunk_size, **options)
            return o

    if case.mode == "fwd":

        def step() -> object:
            with torch.no_grad():
                return forward()

        return step

    leaves = list(inputs.values())
    grad_out = torch.randn(q.shape, generator=torch.Generator().manual_seed(1))
    if case.mode == "ckpt":  # as `activation_checkpointing_enable()` runs a layer: recomputed in backward

        def step() -> object:
            return torch.autograd.grad(checkpoint(forward, use_reentrant=False), leaves, grad_out)

    else:

        def step() -> object:
            return torch.autograd.grad(forward(), leaves, grad_out)

    return step


def time_interleaved(cases: list[Case], args: argparse.Namespace) -> list[list[float]]:
    """Seconds per step of each case; repetitions alternate between cases so background load hits all alike."""
    steps = [
        make_step(c, make_inputs(c, args.heads, args.head_dim, c.mode != "fwd", args.gate_bias, DTYPES[args.dtype]))
        for c in cases
    ]
    for step in steps:
        for _ in range(args.warmup):
            step()
    times: list[list[float]] = [[] for _ in cases]
    for _ in range(args.reps):
        for step, case_times in zip(steps, times, strict=True):
            start = time.perf_counter()
            step()
            case_times.append(time.perf_counter() - start)
    return times


def _status_mib(key: str) -> float:
    return int(re.search(rf"^{key}:\s+(\d+) kB", Path("/proc/self/status").read_text(), re.M).group(1)) / 1024


def measure_memory_here(
    case: Case, heads: int, head_dim: int, gate_bias: float | None, dtype: torch.dtype
) -> dict[str, float]:
    """Peak resident memory of one step above the resident size once inputs exist (Linux only)."""
    step = make_step(case, make_inputs(case, heads, head_dim, case.mode != "fwd", gate_bias, dtype))
    step()  # first-call allocations (kernel caches, thread pools) are not the op's working memory
    baseline = _status_mib("VmRSS")
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    step()
    return {"baseline_mib": baseline, "peak_mib": _status_mib("VmHWM"), "extra_mib": _status_mib("VmHWM") - baseline}


def measure_memory(cases: list[Case], args: argparse.Namespace) -> list[dict[str, float]]:
    """Runs measure_memory_here for each case, one after another, in one fresh subprocess."""
    cmd = [sys.executable, __file__, "--memory-cases", ",".join(c.spec() for c in cases), "--heads", str(args.heads)]
    cmd += ["--head-dim", str(args.head_dim), "--threads", str(args.threads)]
    cmd += ["--dtype", args.dtype] + ([] if args.gate_bias is None else ["--gate-bias", str(args.gate_bias)])
    # A fixed mmap threshold turns off glibc's adaptive one, which after a warm-up step would serve the measured
    # step from heap memory that is already resident (we saw SDPA's extra memory read as 0 MiB).
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "65536"}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise RuntimeError(f"memory subprocess failed:\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def git_commit() -> str:
    """The checkout's commit, "-dirty" when the files of path_hf.ops (what this measures: ops.py and the files it
    imports relatively) have uncommitted changes."""
    root = Path(__file__).resolve().parent.parent
    git = ["git", "-C", str(root)]
    head = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    status = [*git, "status", "--porcelain", "--", ops.__file__, *get_relative_import_files(ops.__file__)]
    dirty = subprocess.run(status, capture_output=True, text=True).stdout.strip()
    return (head or "unknown") + ("-dirty" if dirty else "")


def machine_info(threads: int) -> dict[str, object]:
    cpuinfo = Path("/proc/cpuinfo").read_text()
    model = re.search(r"^model name\s*:\s*(.*)$", cpuinfo, re.M)
    return {
        "cpu": model.group(1) if model else platform.processor(),
        "nproc": os.cpu_count(),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "commit": git_commit(),
        "loadavg_start": os.getloadavg(),
    }


def run(groups: list[list[Case]], args: argparse.Namespace) -> list[dict[str, object]]:
    """Times each group of cases interleaved, then (optionally) measures each case's memory."""
    rows = []
    for group in groups:
        for case, times in zip(group, time_interleaved(group, args), strict=True):
            rows.append(
                {**asdict(case), "median_ms": 1e3 * statistics.median(times), "times_ms": [1e3 * t for t in times]}
            )
            print(f"  {case.spec():28s} {rows[-1]['median_ms']:9.1f} ms", file=sys.stderr, flush=True)
    if args.memory and groups:
        cases = [case for group in groups for case in group]
        for case, row, memory in zip(cases, rows, measure_memory(cases, args), strict=True):
            row.update(memory)
            print(f"  {case.spec():28s} +{memory['extra_mib']:.0f} MiB", file=sys.stderr, flush=True)
    return rows


def comparison_table(rows: list[dict[str, object]], memory: bool, before: str | None = None) -> str:
    """SDPA+RoPE against PaTH by length and mode; with `before` (a commit), PaTH as it was then too."""
    by_key = {(r["method"], r["seq_len"], r["mode"]): r for r in rows}
    head = "| T | mode | SDPA+RoPE ms | PaTH ms | time ratio |"
    sep = "|---|---|---|---|---|"
    if before:
        head += f" PaTH@{before} ms | PaTH / PaTH@{before} |"
        sep += "---|---|"
    if memory:
        head += " SDPA+RoPE MiB | PaTH MiB | memory ratio |" + (f" PaTH@{before} MiB |" if before else "")
        sep += "---|---|---|" + ("---|" if before else "")
    lines = [head, sep]
    for seq_len in sorted({r["seq_len"] for r in rows}):
        for mode in [m for m in MODES if ("sdpa", seq_len, m) in by_key]:
            base, path = by_key[("sdpa", seq_len, mode)], by_key[("path", seq_len, mode)]
            line = f"| {seq_len} | {mode} | {base['median_ms']:.1f} | {path['median_ms']:.1f} |"
            line += f" {path['median_ms'] / base['median_ms']:.2f}x |"
            old = by_key[(f"path@{before}", seq_len, mode)] if before else None
            if old:
                line += f" {old['median_ms']:.1f} | {path['median_ms'] / old['median_ms']:.2f}x |"
            if memory:
                line += f" {base['extra_mib']:.0f} | {path['extra_mib']:.0f} |"
                line += f" {path['extra_mib'] / max(base['extra_mib'], 1.0):.2f}x |"
                line += f" {old['extra_mib']:.0f} |" if old else ""
            lines.append(line)
    return "\n".join(lines)


def sweep_table(rows: list[dict[str, object]], baseline: dict[str, float], memory: bool) -> str:
    head = "| chunk | mode | PaTH ms | vs SDPA+RoPE |" + (" PaTH MiB |" if memory else "")
    lines = [head, "|---|---|---|---|" + ("---|" if memory else "")]
    for r in sorted(rows, key=lambda r: (r["mode"], r["chunk_size"])):
        ratio = r["median_ms"] / baseline[r["mode"]]
        line = f"| {r['chunk_size']} | {r['mode']} | {r['median_ms']:.1f} | {ratio:.2f}x |"
        lines.append(line + (f" {r['extra_mib']:.0f} |" if memory else ""))
    return "\n".join(lines)


def checkpointed_table(rows: list[dict[str, object]], memory: bool) -> str:
    """Gradient-checkpointed forward+backward: PaTH with the walk's keys kept against recomputed, and SDPA+RoPE."""
    by_key = {(r["method"], r["seq_len"], r["recompute"]): r for r in rows}
    head = "| T | SDPA+RoPE ms | PaTH keys kept ms | PaTH keys recomputed ms | kept / recomputed | kept / SDPA |"
    sep = "|---|---|---|---|---|---|"
    if memory:
        head += " SDPA+RoPE MiB | kept MiB | recomputed MiB | kept / recomputed |"
        sep += "---|---|---|---|"
    lines = [head, sep]
    for seq_len in sorted({r["seq_len"] for r in rows}):
        base, kept, recomputed = (
            by_key[key] for key in (("sdpa", seq_len, "auto"), ("path", seq_len, "off"), ("path", seq_len, "on"))
        )
        line = f"| {seq_len} | {base['median_ms']:.1f} | {kept['median_ms']:.1f} | {recomputed['median_ms']:.1f} |"
        line += f" {kept['median_ms'] / recomputed['median_ms']:.2f}x | {kept['median_ms'] / base['median_ms']:.2f}x |"
        if memory:
            line += f" {base['extra_mib']:.0f} | {kept['extra_mib']:.0f} | {recomputed['extra_mib']:.0f} |"
            line += f" {kept['extra_mib'] / max(recomputed['extra_mib'], 1.0):.2f}x |"
        lines.append(line)
    return "\n".join(lines)


def parse_ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",") if x]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=parse_ints, default=[512, 1024, 2048, 4096])
    parser.add_argument("--modes", default=",".join(MODES), help=f"comma-separated, of {', '.join(MODES)}")
    parser.add_argument("--heads", type=int, default=8, help="H = HQ")
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64, help="path_attention chunk size for the main table")
    parser.add_argument("--chunk-sizes", type=parse_ints, default=[], help="sweep, e.g. 32,64,128,256")
    parser.add_argument("--sweep-seq-len", type=int, default=2048)
    parser.add_argument(
        "--checkpointed-seq-lens", type=parse_ints, default=[], help="gradient-checkpointed fwd+bwd, e.g. 1024,2048"
    )
    parser.add_argument("--ops-before", metavar="COMMIT", help="also time path_hf.ops as it was at COMMIT")
    parser.add_argument(
        "--gate-bias",
        type=float,
        help="PaTH-FoX: PaTH also takes log forget gates logsigmoid(N(GATE_BIAS, 1)) (default: no gate)",
    )
    parser.add_argument(
        "--dtype",
        choices=sorted(DTYPES),
        default="float32",
        help="dtype of the inputs; in bfloat16, PaTH's inference walk multiplies in bfloat16 where the CPU does it "
        "natively (path_hf.ops_chunk.walk_product_dtype)",
    )
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help=THREADS_HELP)
    parser.add_argument("--no-memory", dest="memory", action="store_false", help="skip the memory subprocesses")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "attention_cpu.json")
    parser.add_argument("--memory-cases", help=argparse.SUPPRESS)  # internal: the memory subprocess
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    if args.memory_cases:
        cases = [Case.parse(spec) for spec in args.memory_cases.split(",")]
        dtype = DTYPES[args.dtype]
        print(json.dumps([measure_memory_here(c, args.heads, args.head_dim, args.gate_bias, dtype) for c in cases]))
        return

    info = machine_info(args.threads)
    print(f"# PaTH attention (torch backend) vs RoPE + SDPA on CPU: {info['cpu']}, {info['nproc']} cores,")
    print(f"# torch {info['torch']}, torch.set_num_threads({args.threads}), {args.dtype}, B=1, H=HQ={args.heads},")
    print(f"# D={args.head_dim}, chunk_size={args.chunk_size}; median of {args.reps} after {args.warmup} warm-up.")
    if args.gate_bias is not None:
        print(f"# PaTH-FoX: PaTH takes log forget gates logsigmoid(N({args.gate_bias}, 1)); SDPA+RoPE no gate.")
    if args.memory:
        print("# Memory: extra peak RSS of one step over RSS after inputs exist and one warm-up step (measured")
        print("# in a separate process with MALLOC_MMAP_THRESHOLD_=65536, so freed tensors leave the resident set).")
    print(f"# Commit {info['commit']}; load average at start: {info['loadavg_start']}")

    methods = [*METHODS, f"path@{args.ops_before}"] if args.ops_before else METHODS
    modes = args.modes.split(",")
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown mode(s) {sorted(unknown)}; choose from {', '.join(MODES)}")
    groups = [[Case(m, t, mode, args.chunk_size) for m in methods] for t in args.seq_lens for mode in modes]
    rows = run(groups, args)
    result: dict[str, object] = {"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}
    if rows:
        print()
        print(comparison_table(rows, args.memory, args.ops_before))

    if args.checkpointed_seq_lens:
        checkpointed_groups = [
            [Case("sdpa", t, "ckpt", args.chunk_size)]
            + [Case("path", t, "ckpt", args.chunk_size, recompute) for recompute in ("off", "on")]
            for t in args.checkpointed_seq_lens
        ]
        checkpointed = run(checkpointed_groups, args)
        result["checkpointed"] = checkpointed
        print("\nGradient-checkpointed forward+backward (the forward inside torch.utils.checkpoint, recomputed in")
        print("backward); PaTH with the walk's running keys kept (recompute=False) or recomputed (recompute=True):\n")
        print(checkpointed_table(checkpointed, args.memory))

    if args.chunk_sizes:
        sweep_groups = [
            [Case("sdpa", args.sweep_seq_len, mode, args.chunk_size)]
            + [Case("path", args.sweep_seq_len, mode, c) for c in args.chunk_sizes]
            for mode in MODES
        ]
        sweep = run(sweep_groups, args)
        result["sweep"] = sweep
        print(f"\nChunk-size sweep at T={args.sweep_seq_len}:\n")
        base = {r["mode"]: r["median_ms"] for r in sweep if r["method"] == "sdpa"}
        print(sweep_table([r for r in sweep if r["method"] == "path"], base, args.memory))

    # The goals: PaTH at most GOALS[mode] times SDPA+RoPE at every length measured.
    by_key = {(r["method"], r["seq_len"], r["mode"]): r["median_ms"] for r in rows}
    for mode, goal in GOALS.items():
        ratios = {t: by_key[("path", t, m)] / by_key[("sdpa", t, m)] for (_, t, m) in by_key if m == mode}
        if ratios:
            worst = max(ratios, key=ratios.get)
            result[f"goal_{mode}_max_ratio"] = ratios[worst]
            verdict = "met" if ratios[worst] <= goal else "not met"
            print(f"\nGoal: PaTH {mode} <= {goal}x SDPA+RoPE at every T: {ratios[worst]:.2f}x at T={worst}, {verdict}")

    info["loadavg_end"] = os.getloadavg()
    print(f"# Load average at end: {info['loadavg_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2))
    print(f"# JSON: {args.out}")


if __name__ == "__main__":
    main()
