"""Where the torch backend's time goes: a profile of `path_attention(backend="torch")` on CPU, by phase and by kind.

    python bench/profile_cpu.py                                      # T = 2048, 8192, 32768; 1 and 2 threads
    python bench/profile_cpu.py --seq-lens 2048 --threads 1 --modes fwd

Each (T, mode, threads) case runs one step under `torch.profiler` after a warm-up step, on the shapes of
bench/attention_cpu.py (B=1, H=HQ=8, D=64, fp32, chunk 64; its `make_step`, so both benchmarks time the same thing).
Two breakdowns of the step's wall time:
- by phase: the torch backend's stages, each in the `record_function` range it runs in (`ops_inputs.chunk_inputs`,
  `ops_transform.intra_chunk`, the forward walk and its written-out backward in `ops_walk.py`), and the rest (w
  normalisation, beta, output layout, autograd of the intra-chunk transform);
- by kind: the self time of the aten ops, summed as matrix products (`bmm`, `mm`, `matmul`, `linalg_solve_triangular`),
  exp, other elementwise and reductions, copies and allocation (`copy_`, `cat`, `zeros`, `fill_`, `empty`, `clone`,
  ...), and the rest; what no aten op accounts for is Python and dispatch overhead.
Also the count of aten calls and of batched products with their mean size, to show how small the products are.
Writes a Markdown table to stdout and JSON to bench/out/profile_cpu.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import Counter
from pathlib import Path

import torch
from attention_cpu import Case, machine_info, make_inputs, make_step, parse_ints
from torch.profiler import ProfilerActivity, profile

# Each phase's name in the table, and the profiler range the torch backend runs it in.
PHASES = {
    "chunk inputs": "path_attention.chunk_inputs",
    "intra-chunk": "path_attention.intra_chunk",
    "walk (forward)": "path_attention.walk",
    "walk (backward)": "path_attention.walk_backward",
}
MATMUL = {"aten::bmm", "aten::mm", "aten::matmul", "aten::linalg_solve_triangular", "aten::addmm", "aten::baddbmm"}
EXP = {"aten::exp", "aten::exp_"}
COPY = {
    "aten::copy_", "aten::cat", "aten::zeros", "aten::zeros_like", "aten::fill_", "aten::zero_", "aten::empty",
    "aten::empty_strided", "aten::clone", "aten::contiguous", "aten::new_zeros", "aten::new_ones", "aten::ones",
    "aten::eye", "aten::stack", "aten::full", "aten::resize_", "aten::_to_copy", "aten::to", "aten::index_put_",
    "aten::new_empty", "aten::new_empty_strided", "aten::empty_like",
}  # fmt: skip
ELEMENTWISE = {
    "aten::mul", "aten::mul_", "aten::add", "aten::add_", "aten::sub", "aten::sub_", "aten::div", "aten::div_",
    "aten::maximum", "aten::amax", "aten::sum", "aten::masked_fill", "aten::masked_fill_", "aten::log", "aten::tril",
    "aten::where", "aten::neg", "aten::sigmoid", "aten::rsub", "aten::eq", "aten::bitwise_not", "aten::cumsum",
    "aten::norm", "aten::linalg_vector_norm", "aten::clamp_min", "aten::expand_as", "aten::logical_not",
}  # fmt: skip


def kind(name: str) -> str:
    if name in MATMUL:
        return "matmul"
    if name in EXP:
        return "exp"
    if name in ELEMENTWISE:
        return "elementwise"
    if name in COPY:
        return "copy/alloc"
    return "other aten"


def profile_case(case: Case, threads: int, heads: int, head_dim: int) -> dict[str, object]:
    torch.set_num_threads(threads)
    step = make_step(case, make_inputs(case, heads, head_dim, requires_grad=case.mode != "fwd"))
    step()  # warm-up
    start = time.perf_counter()
    step()
    plain_ms = 1e3 * (time.perf_counter() - start)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof:
        start = time.perf_counter()
        step()
        profiled_ms = 1e3 * (time.perf_counter() - start)
    events = prof.key_averages()
    ranges = {e.key: e.cpu_time_total / 1e3 for e in events}
    phases = {name: ranges[key] for name, key in PHASES.items() if key in ranges}
    kinds: Counter[str] = Counter()
    calls = 0
    for e in events:
        if e.key.startswith("aten::"):
            kinds[kind(e.key)] += e.self_cpu_time_total / 1e3
            calls += e.count
    # Sizes of the batched products: flops per call (2 * batch * m * n * k) from the recorded shapes.
    products, flops = 0, 0.0
    for e in prof.key_averages(group_by_input_shape=True):
        if e.key == "aten::bmm" and len(e.input_shapes) >= 2 and e.input_shapes[0] and e.input_shapes[1]:
            (b, m, k), (_, _, n) = e.input_shapes[0], e.input_shapes[1]
            products += e.count
            flops += e.count * 2.0 * b * m * n * k
    aten_ms = sum(kinds.values())
    return {
        "case": case.spec(),
        "threads": threads,
        "plain_ms": plain_ms,
        "profiled_ms": profiled_ms,
        "phases_ms": phases,
        "kinds_ms": dict(kinds),
        "python_and_dispatch_ms": profiled_ms - aten_ms,
        "aten_calls": calls,
        "bmm_calls": products,
        "bmm_gflop": flops / 1e9,
        "bmm_mean_mflop": flops / max(products, 1) / 1e6,
    }


def table(rows: list[dict[str, object]]) -> str:
    names = [*PHASES, "rest"]
    kinds = ["matmul", "exp", "elementwise", "copy/alloc", "other aten"]
    head = "| T | mode | threads | ms (profiled) | " + " | ".join(names) + " | " + " | ".join(kinds)
    head += " | Python + dispatch | aten calls | bmm calls | MFLOP / bmm | bmm GFLOP/s |"
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        total = r["profiled_ms"]
        phase = {n: r["phases_ms"].get(n, 0.0) for n in PHASES}
        phase["rest"] = total - sum(phase.values())
        kind_ms = {k: r["kinds_ms"].get(k, 0.0) for k in kinds}
        t, mode = r["case"].split(":")[1:3]
        cells = [f"{100 * phase[n] / total:.0f}%" for n in names]
        cells += [f"{100 * kind_ms[k] / total:.0f}%" for k in kinds]
        cells.append(f"{100 * r['python_and_dispatch_ms'] / total:.0f}%")
        rate = r["bmm_gflop"] / max(r["kinds_ms"].get("matmul", 1e-9) / 1e3, 1e-9)
        line = f"| {t} | {mode} | {r['threads']} | {total:.0f} | " + " | ".join(cells)
        line += f" | {r['aten_calls']} | {r['bmm_calls']} | {r['bmm_mean_mflop']:.2f} | {rate:.1f} |"
        lines.append(line)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-lens", type=parse_ints, default=[2048, 8192, 32768])
    parser.add_argument("--modes", default="fwd,fwd+bwd", help="comma-separated: fwd, fwd+bwd")
    parser.add_argument("--threads", type=parse_ints, default=[1, 2])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--chunk-size", type=int, default=64)
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "out" / "profile_cpu.json")
    args = parser.parse_args()
    info = machine_info(max(args.threads))
    print(f"# torch backend profile: {info['cpu']}, {info['nproc']} cores, torch {info['torch']}, commit")
    print(f"# {info['commit']}, B=1, H=HQ={args.heads}, D={args.head_dim}, fp32, chunk {args.chunk_size}; load")
    print(f"# average at start {info['loadavg_start']}. Shares of the profiled step's wall time.")
    rows = []
    for seq_len in args.seq_lens:
        for mode in args.modes.split(","):
            for threads in args.threads:
                case = Case("path", seq_len, mode, args.chunk_size)
                rows.append(profile_case(case, threads, args.heads, args.head_dim))
                print(f"  {case.spec():28s} {threads} threads {rows[-1]['profiled_ms']:9.0f} ms", file=sys.stderr)
    print()
    print(table(rows))
    info["loadavg_end"] = os.getloadavg()
    print(f"# Load average at end: {info['loadavg_end']}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"machine": info, "args": {k: str(v) for k, v in vars(args).items()}, "rows": rows}))
    print(f"# JSON: {args.out}")


if __name__ == "__main__":
    main()
