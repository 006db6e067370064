# Copyright 2026 The path-hf authors. Apache-2.0.
"""An evaluation's report as people read it: the Markdown table of every model and length (`format_table`), and the
files `path-hf eval` writes at the end, the JSON of every number (`--output`) and the plot of perplexity against
context length (`--plot`), each atomically (`write_report`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from ..atomic import atomic_file
from ..errors import EvaluationError
from .plots import plot_lengths
from .results import EvalReport


def _found(summary: Mapping[str, Any]) -> str:
    """`"37/40"` of a passkey or multi-key summary."""
    return f"{summary['found']}/{summary['trials']}"


def format_table(report: EvalReport | Mapping[str, Any]) -> str:
    """Perplexity (and passkey, multi-key and copy retrieval) per model and length, as a Markdown table; of a report,
    or of its JSON form (a saved `--output`)."""
    if isinstance(report, EvalReport):
        report = report.to_json()
    lengths = report["lengths"]
    train = report.get("train_length")
    header = [f"{n} ({n / train:g}x)" if train else str(n) for n in lengths]
    rows = ["| model | " + " | ".join(header) + " |", "|---|" + "---:|" * len(lengths)]
    for label, record in report["models"].items():
        cells = []
        for n in lengths:
            entry = record["lengths"][str(n)]
            parts = [f"{entry['ppl']:.2f}"] if "ppl" in entry else []
            parts += [_found(entry[kind]) for kind in ("passkey", "multikey") if entry.get(kind) is not None]
            if entry.get("copy") is not None:
                parts.append(f"copy {entry['copy']:.1%}")
            cells.append(" / ".join(parts) or "-")
        rows.append(f"| {label} | " + " | ".join(cells) + " |")
    names = ["perplexity"] if report.get("perplexity", True) else []
    names += [f"{kind} found/trials" for kind in ("passkey", "multikey") if report.get(f"{kind}_trials")]
    if report.get("copy_trials"):
        names.append(f"copy accuracy ({report['copy_span']}-token span)")
    return "\n".join(rows) + f"\n({' / '.join(names)}; {report['windowing']})"


def write_report(report: EvalReport, output: str | None = None, plot: str | None = None, force: bool = False) -> None:
    """Write the report's JSON to `output` and its plot to `plot` (either may be None), each atomically. Without
    `force`, a file that another process wrote there meanwhile is kept, and so are these results, beside it: refused
    with the path of both."""
    try:
        if output:
            with atomic_file(output, exclusive=not force) as tmp:
                tmp.write_text(json.dumps(report.to_json(), indent=2) + "\n")
        if plot:
            with atomic_file(plot, exclusive=not force) as tmp:
                plot_lengths(report.perplexities(), tmp, report.train_length)
    except FileExistsError as error:
        raise EvaluationError(
            f"{error.filename} was written by another process while this evaluation ran; this one's is kept in "
            f"{error.filename2}: rename it, or pass --force to replace the file"
        ) from None


__all__ = ["format_table", "write_report"]
