# Copyright 2026 The path-hf authors. Apache-2.0.
"""Compare several `examples/demo.py` runs (e.g. rope drop vs keep, forget gate on vs off): a Markdown table, the
recovery curves in one plot, and perplexity against context length in another.

```
python examples/compare_demo_runs.py runs/demo runs/demo-keep runs/demo-nogate --output docs/demo/ablation
```
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from path_hf.evaluation import plot_lengths, plots


def label(report: dict) -> str:
    convert = report["conversion"]
    return f"rope {convert['rope']}, gate {'on' if convert.get('forget_gate') else 'off'}"


def table(reports: dict[str, dict]) -> str:
    any_report = next(iter(reports.values()))
    n = any_report["train_length"]
    multiples = [int(length) // n for length in any_report["perplexity"]["PaTH, recovered"]]
    header = ["PaTH variant", "step 0 / source at 1x"]
    header += [f"ratio after {tokens:,} tokens" for tokens in _checkpoints(any_report)]
    header += [f"{m}x" for m in multiples] + ["4x / 1x"]
    rows = ["| " + " | ".join(header) + " |", "|---|" + "---:|" * (len(header) - 1)]
    for name, report in reports.items():
        ppl = report["perplexity"]["PaTH, recovered"]
        source = report["perplexity"]["RoPE (source)"][str(n)]
        step0 = report["perplexity"]["PaTH, step 0"][str(n)]
        ratios = [entry["ratio"]["1x"] for entry in report["recovery"]["history"][1:]]
        cells = [f"{step0 / source:.2f}"] + [f"{ratio:.3f}" for ratio in ratios]
        cells += [f"{ppl[str(m * n)]:.2f}" for m in multiples] + [f"{ppl[str(4 * n)] / ppl[str(n)]:.2f}"]
        rows.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _checkpoints(report: dict) -> list[int]:
    return [entry["tokens"] for entry in report["recovery"]["history"][1:]]


def plot_recovery(reports: dict[str, dict], path: Path) -> None:
    curves = {
        name: [(entry["tokens"], entry["ratio"]["1x"]) for entry in report["recovery"]["history"]]
        for name, report in reports.items()
    }
    plots.plot_recovery(
        curves,
        path,
        target=1.02,
        ylabel="perplexity / source perplexity at 1x",
        title="Recovery of the default model, by PaTH variant",
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path, help="demo output directories (each with demo.json)")
    parser.add_argument("--output", type=Path, required=True, help="prefix of the .md / .png files written")
    args = parser.parse_args(argv)
    reports = {}
    for run in args.runs:
        report = json.loads((run / "demo.json").read_text())
        reports[label(report)] = report
    args.output.parent.mkdir(parents=True, exist_ok=True)
    text = table(reports)
    Path(f"{args.output}.md").write_text(text + "\n")
    plot_recovery(reports, Path(f"{args.output}-recovery.png"))
    n = next(iter(reports.values()))["train_length"]
    lengths = {name: {int(k): v for k, v in r["perplexity"]["PaTH, recovered"].items()} for name, r in reports.items()}
    source = next(iter(reports.values()))["perplexity"]
    lengths |= {name: {int(k): v for k, v in source[name].items()} for name in ("RoPE (source)", "RoPE + YaRN")}
    plot_lengths(lengths, f"{args.output}-lengths.png", n, title="Perplexity against context length, by variant")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
