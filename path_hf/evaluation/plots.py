# Copyright 2026 The path-hf authors. Apache-2.0.
"""The two plots of path-hf, written as PNG files: perplexity against context length (`path-hf eval`, the examples)
and recovery against training tokens (the recipes, the examples). matplotlib is imported only when one is drawn."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_lengths(
    results: dict[str, dict[int, float]],
    path: str | Path,
    train_length: int | None = None,
    ylabel: str = "perplexity",
    title: str = "Perplexity against context length",
) -> None:
    """A PNG of one line per model (`results[label][context_length] = value`) against the context length (log2
    axis), with the training length marked."""
    from matplotlib.ticker import FuncFormatter, NullFormatter

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, values in results.items():
        lengths = sorted(values)
        ax.plot(lengths, [values[n] for n in lengths], marker="o", label=label)
    if train_length:
        ax.axvline(train_length, color="gray", linestyle="--", linewidth=1, label=f"training length {train_length}")
    plain = FuncFormatter(lambda value, _: f"{value:g}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted({n for values in results.values() for n in values}))
    ax.xaxis.set_major_formatter(plain)
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel(ylabel)
    if ylabel == "perplexity":
        ax.set_yscale("log")
        ax.yaxis.set_major_formatter(plain)
        ax.yaxis.set_minor_formatter(plain)
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def plot_recovery(
    curves: dict[str, Sequence[tuple[int, float]]],
    path: str | Path,
    *,
    ratio: bool = True,
    target: float | None = None,
    ylabel: str = "perplexity / source perplexity",
    title: str = "PaTH recovery",
) -> None:
    """A PNG of one line per curve (`curves[label] = [(training tokens, value), ...]`), log y axis. With `ratio` the
    values are perplexity ratios to the source model, whose level (1) is marked, and so is `target`; without, they are
    perplexities (`ylabel` "perplexity")."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for label, points in curves.items():
        ax.plot(*zip(*points, strict=True), marker="o", label=label)
    if ratio:
        ax.axhline(1.0, color="gray", linestyle="--", linewidth=1, label="source model")
        if target is not None:
            ax.axhline(target, color="green", linestyle=":", linewidth=1, label=f"target {target:g}")
    ax.set_xlabel("training tokens")
    ax.set_ylabel(ylabel if ratio else "perplexity")
    ax.set_yscale("log")
    ax.set_title(title)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


__all__ = ["plot_lengths", "plot_recovery"]
