# Copyright 2026 The path-hf authors. Apache-2.0.
"""The lab's summaries over seeds, its Markdown tables and its plots, from the runs (`run.py`), or again from a
`results.json` (`python -m lab.pe_lab --replot --output DIR`)."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from .positions import ENCODINGS, RESCALED_ROPE, RESCALINGS
from .tasks import TASKS

# The plots' panels: a few rows each, so that every line can be told apart. RoPE is drawn in every panel it does not
# belong to, as the reference.
FAMILIES = {
    "absolute and bias": ("NoPE", "sinusoidal", "learned absolute", "T5 bias", "ALiBi"),
    "RoPE, rescaled at test time": ("RoPE", *RESCALED_ROPE.values()),
    "accumulated SO(2)": ("SO(2) random, QK", "SO(2) random, QKV", "SO(2) learned, QK", "SO(2) learned, QKV"),
    "PaTH": ("PaTH", "PaTH-FoX", "ALiBi"),
}
REFERENCE = "RoPE"


def labels_of(encoding: str) -> dict[str, str | None]:
    """The rows one trained model gives: {label: RoPE rescaling}; RoPE also gives one row per test-time rescaling."""
    rows: dict[str, str | None] = {ENCODINGS[encoding].label: None}
    if encoding == "rope":
        rows |= {RESCALED_ROPE[f"rope+{rescaling}"]: rescaling for rescaling in RESCALINGS}
    return rows


def row_order(label: str) -> int:
    """Rows in the order of `ENCODINGS`, each RoPE rescaling after RoPE."""
    return [row for encoding in ENCODINGS for row in labels_of(encoding)].index(label)


def summarise(values: list[float]) -> dict:
    return {
        "mean": statistics.fmean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
        "seeds": len(values),
    }


def summary(runs: list[dict], train_lengths: dict[str, int]) -> dict:
    """Per task and row, over seeds: the metric by length (text: also its ratio to the training length) and the far
    mass (mean over layers) by length."""
    out: dict = {}
    for task_name, train_length in train_lengths.items():
        text = TASKS[task_name].metric == "perplexity"
        per_row: dict[str, dict[str, dict]] = {}
        for run in (r for r in runs if r["task"] == task_name):
            for label, by_length in run["metric"].items():
                row = per_row.setdefault(label, {"metric": {}, "ratio": {}, "far_mass": {}})
                for length, value in by_length.items():
                    row["metric"].setdefault(length, []).append(value)
                    if text:
                        row["ratio"].setdefault(length, []).append(value / by_length[train_length])
                for length, layers in run["far_mass"].get(label, {}).items():
                    row["far_mass"].setdefault(length, []).append(statistics.fmean(layers))
        out[task_name] = {
            "metric": TASKS[task_name].metric,
            "train_length": train_length,
            "rows": {
                label: {kind: {n: summarise(v) for n, v in values.items()} for kind, values in per_row[label].items()}
                for label in sorted(per_row, key=row_order)
            },
        }
    return out


def cell(stats: dict, digits: int) -> str:
    """`mean ± std` over seeds (the mean alone for one seed)."""
    text = f"{stats['mean']:.{digits}f}"
    return text + f" ± {stats['std']:.{digits}f}" if stats["seeds"] > 1 else text


def tables(summaries: dict, far_distance: int) -> str:
    """The Markdown tables: per task the metric by length, and the far mass where measured."""
    lines = []
    for task_name, result in summaries.items():
        rows, train_length = result["rows"], result["train_length"]
        lengths = sorted({n for row in rows.values() for n in row["metric"]})
        text = result["metric"] == "perplexity"
        what = "perplexity ratio to the training length" if text else "accuracy"
        lines += [f"### {task_name}: {what}, trained at {train_length} (mean ± std over seeds)", ""]
        head = ["encoding"] + ([f"ppl at {train_length}"] if text else []) + [f"{n // train_length}x" for n in lengths]
        lines += ["| " + " | ".join(head + ["seeds"]) + " |", "|" + " --- |" * (len(head) + 1)]
        for label, row in rows.items():
            values = row["ratio" if text else "metric"]
            cells = [cell(row["metric"][train_length], 2)] if text else []
            cells += [cell(values[n], 2 if text else 3) for n in lengths]
            lines.append(f"| {label} | " + " | ".join(cells) + f" | {values[train_length]['seeds']} |")
        lines.append("")
        if any(row["far_mass"] for row in rows.values()):
            lines += [
                f"### {task_name}: attention mass on keys more than {far_distance} tokens back (queries of the last "
                "quarter of the window, mean over heads and layers)",
                "",
                "| encoding | " + " | ".join(f"{n // train_length}x" for n in lengths) + " |",
                "|" + " --- |" * (len(lengths) + 1),
            ]
            for label, row in rows.items():
                lines.append(f"| {label} | " + " | ".join(cell(row["far_mass"][n], 3) for n in lengths) + " |")
            lines.append("")
    return "\n".join(lines)


def _panels(rows: dict, kind: str, path: Path, train_length: int, ylabel: str, title: str, log_y: bool) -> None:
    """One panel per family of `FAMILIES` present in `rows`: the mean over seeds against length, and the band from
    the lowest to the highest seed where there are several."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter, NullFormatter

    families = {name: [label for label in labels if label in rows] for name, labels in FAMILIES.items()}
    families = {name: labels for name, labels in families.items() if labels}
    rows_of_panels = (len(families) + 1) // 2
    fig, axes = plt.subplots(rows_of_panels, 2, figsize=(10, 3.8 * rows_of_panels), sharey=True, squeeze=False)
    for ax in axes.flat[len(families) :]:
        ax.set_visible(False)
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    for ax, (name, labels) in zip(axes.flat, families.items(), strict=False):  # a spare panel stays hidden
        if REFERENCE in rows and REFERENCE not in labels:
            labels = [*labels, REFERENCE]
        for label in labels:
            stats = rows[label][kind]
            lengths = sorted(stats)
            style = (
                {"color": "gray", "linestyle": ":"}
                if label == REFERENCE and name != "RoPE, rescaled at test time"
                else {}
            )
            (line,) = ax.plot(
                lengths, [stats[n]["mean"] for n in lengths], marker="o", markersize=3, label=label, **style
            )
            if stats[lengths[0]]["seeds"] > 1:
                low, high = [stats[n]["min"] for n in lengths], [stats[n]["max"] for n in lengths]
                ax.fill_between(lengths, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
        ax.axvline(train_length, color="gray", linestyle="--", linewidth=0.8)
        ax.set_xscale("log", base=2)
        ax.set_xticks(lengths)
        ax.xaxis.set_major_formatter(plain)
        ax.xaxis.set_minor_formatter(NullFormatter())
        if log_y:
            ax.set_yscale("log")
            ax.yaxis.set_major_formatter(plain)
            ax.yaxis.set_minor_formatter(plain)
        ax.set_title(name, fontsize=10)
        ax.set_xlabel("context length (tokens)")
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def plots(summaries: dict, out: Path) -> None:
    """`<task>.png` (the accuracy, or the perplexity ratio, against length) and `<task>-far-mass.png`."""
    for task_name, result in summaries.items():
        text, rows, train_length = result["metric"] == "perplexity", result["rows"], result["train_length"]
        ylabel = "perplexity / perplexity at the training length" if text else "accuracy"
        title = f"{task_name}, trained at {train_length} tokens: mean over seeds, band from the lowest to the highest"
        _panels(rows, "ratio" if text else "metric", out / f"{task_name}.png", train_length, ylabel, title, text)
        if any(row["far_mass"] for row in rows.values()):
            title = f"{task_name}: attention mass on keys far back from the query (mean over heads and layers)"
            _panels(rows, "far_mass", out / f"{task_name}-far-mass.png", train_length, "far mass", title, False)


def with_int_keys(data: dict) -> dict:
    """`data` as JSON holds it, with the lengths (JSON keys are strings) as ints again."""
    return json.loads(json.dumps(data), object_hook=lambda d: {int(k) if k.isdigit() else k: v for k, v in d.items()})


def write(report: dict, out: Path, far_distance: int) -> str:
    """`results.json`, `results.md` and the plots in `out`; returns the Markdown."""
    (out / "results.json").write_text(json.dumps(report, indent=1) + "\n")
    summaries = with_int_keys(report["summary"])
    markdown = tables(summaries, far_distance)
    (out / "results.md").write_text(markdown + "\n")
    plots(summaries, out)
    return markdown
