# Copyright 2026 The path-hf authors. Apache-2.0.
"""The typed results of an evaluation (`path_hf.evaluation.evaluate`) and their JSON form, the `--output` of
`path-hf eval`: an `EvalReport` holds a `ModelResult` per model, which holds a `LengthResult` per context length:
perplexity (`PerplexityScore`), passkey and multi-key retrieval (`NeedleScore`, found / trials overall and by depth in
`NeedleSummary`), copy retrieval (`CopyScore`) and the seconds it took.

`to_json()` writes each as the report's JSON has always been written, keys in the same order; the tables and the
scripts that read saved reports (`format_table`, `common_train_length`) take that JSON form as well.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from .needles import TrialResult, summarize_trials
from .options import EvalOptions, ModelSpec


@dataclass(frozen=True)
class PerplexityScore:
    """Perplexity at one length: `ppl` (exp of `nll`, the mean negative log-likelihood of the scored `tokens`) over
    `windows` windows, and `ppl_second_half`, of the tokens read with at least half a window of context."""

    ppl: float
    nll: float
    tokens: int
    windows: int
    ppl_second_half: float

    def to_json(self) -> dict[str, Any]:
        return {
            "ppl": self.ppl,
            "nll": self.nll,
            "tokens": self.tokens,
            "windows": self.windows,
            "ppl_second_half": self.ppl_second_half,
        }


@dataclass(frozen=True)
class DepthCount:
    """Passkey trials found at one depth."""

    found: int
    trials: int


@dataclass(frozen=True)
class NeedleSummary:
    """A passkey or multi-key test at one length (`summarize_trials`): `found` of `trials`, the `rate` with its 95%
    Wilson interval, the answer's mean negative log-likelihood per token, the same by depth (passkey only; the depths
    as the JSON writes them, "0.1"), and how many trials greedy decoding checked and agreed with."""

    found: int
    trials: int
    rate: float
    wilson95: tuple[float, float]
    nll: float
    by_depth: dict[str, DepthCount] | None
    greedy_checked: int
    greedy_agrees: int

    @classmethod
    def of(cls, results: Sequence[TrialResult]) -> NeedleSummary:
        """The summary of scored trials (`score_trials`)."""
        summary = summarize_trials(results)
        by_depth = summary.get("by_depth")
        return cls(
            found=summary["found"],
            trials=summary["trials"],
            rate=summary["rate"],
            wilson95=tuple(summary["wilson95"]),
            nll=summary["nll"],
            by_depth=None if by_depth is None else {depth: DepthCount(**count) for depth, count in by_depth.items()},
            greedy_checked=summary["greedy_checked"],
            greedy_agrees=summary["greedy_agrees"],
        )

    def to_json(self) -> dict[str, Any]:
        summary: dict[str, Any] = {
            "found": self.found,
            "trials": self.trials,
            "rate": self.rate,
            "wilson95": list(self.wilson95),
            "nll": self.nll,
        }
        if self.by_depth is not None:
            summary["by_depth"] = {depth: asdict(count) for depth, count in self.by_depth.items()}
        summary["greedy_checked"] = self.greedy_checked
        summary["greedy_agrees"] = self.greedy_agrees
        return summary


@dataclass(frozen=True)
class NeedleScore:
    """A passkey or multi-key test at one length: its `summary` and one JSON record a trial (`trial_records`), or,
    where the length is too short for a prompt, no summary and the `error` that says so."""

    summary: NeedleSummary | None
    records: tuple[dict[str, Any], ...] = ()
    error: str | None = None

    def to_json(self, kind: str) -> dict[str, Any]:
        """`{kind: summary, f"{kind}_trials": records}`, or `{kind: None, f"{kind}_error": error}`."""
        if self.summary is None:
            return {kind: None, f"{kind}_error": self.error}
        return {kind: self.summary.to_json(), f"{kind}_trials": list(self.records)}


@dataclass(frozen=True)
class CopyScore:
    """Copy retrieval at one length: top-1 `accuracy` and mean negative log-likelihood `nll` of the repeated span's
    tokens, or, where the length is too short for the span twice (or the text too short), None and the `error`."""

    accuracy: float | None
    nll: float | None
    error: str | None = None

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = {"copy": self.accuracy, "copy_nll": self.nll}
        if self.error is not None:
            entry["copy_error"] = self.error
        return entry


@dataclass(frozen=True)
class LengthResult:
    """A model at one context length: what was measured (None: not asked for), the RoPE scaling factor it ran with,
    the seconds it took, and whether it is the same checkpoint's unscaled result, taken where the scaling is the
    identity (`same_as_unscaled`, with that result's seconds)."""

    perplexity: PerplexityScore | None = None
    rope_factor: float | None = None
    passkey: NeedleScore | None = None
    multikey: NeedleScore | None = None
    copy: CopyScore | None = None
    seconds: float = 0.0
    same_as_unscaled: bool = False

    def needle(self, kind: str) -> NeedleScore | None:
        """`passkey` or `multikey` by name."""
        return {"passkey": self.passkey, "multikey": self.multikey}[kind]

    def to_json(self) -> dict[str, Any]:
        entry: dict[str, Any] = self.perplexity.to_json() if self.perplexity is not None else {}
        if self.rope_factor is not None and not self.same_as_unscaled:
            entry["rope_factor"] = self.rope_factor
        for kind in ("passkey", "multikey"):
            if (score := self.needle(kind)) is not None:
                entry |= score.to_json(kind)
        if self.copy is not None:
            entry |= self.copy.to_json()
        entry["seconds"] = self.seconds
        if self.same_as_unscaled:  # the unscaled result's entry, then these
            entry |= {"rope_factor": self.rope_factor, "same_as_unscaled": True}
        return entry


@dataclass
class ModelResult:
    """One model evaluated at every length: its spec, the tokenizer it was evaluated with, its model type, training
    context (None when unknown), the tokens of the data, the window of its local layers (None without), and a
    `LengthResult` per length."""

    spec: ModelSpec
    tokenizer: str
    model_type: str
    train_length: int | None
    tokens: int
    local_window: int | None
    lengths: dict[int, LengthResult] = field(default_factory=dict)

    @property
    def label(self) -> str:
        return self.spec.label

    def to_json(self) -> dict[str, Any]:
        return {
            "path": self.spec.path,
            "tokenizer": self.tokenizer,
            "model_type": self.model_type,
            "rope_scaling": self.spec.rope_scaling,
            "train_length": self.train_length,
            "tokens": self.tokens,
            "local_window": self.local_window,
            "lengths": {str(length): result.to_json() for length, result in self.lengths.items()},
            "spec": asdict(self.spec),
        }


def common_train_length(records: Iterable[ModelResult | Mapping[str, Any]]) -> int | None:
    """The report's `train_length`: the one training context of all `records` (each a model's, or a whole report's:
    a `ModelResult`, or a JSON record with a `"train_length"`), or None when they differ."""
    train_lengths = {
        record.train_length if isinstance(record, ModelResult) else record["train_length"] for record in records
    }
    return train_lengths.pop() if len(train_lengths) == 1 else None


@dataclass
class EvalReport:
    """An evaluation: the options it ran with and a `ModelResult` per model, by label, in the order of `--model`."""

    options: EvalOptions
    models: dict[str, ModelResult] = field(default_factory=dict)

    @property
    def train_length(self) -> int | None:
        """The models' one training context, or None when they differ (`common_train_length`)."""
        return common_train_length(self.models.values())

    @property
    def windowing(self) -> str:
        stride = self.options.stride
        return f"sliding windows, stride {stride}" if stride else "non-overlapping windows"

    def perplexities(self) -> dict[str, dict[int, float]]:
        """The finite perplexities of each model by length (what `--plot` draws)."""
        return {
            label: {
                length: result.perplexity.ppl
                for length, result in model.lengths.items()
                if result.perplexity is not None and math.isfinite(result.perplexity.ppl)
            }
            for label, model in self.models.items()
        }

    def to_json(self) -> dict[str, Any]:
        """The report as `path-hf eval --output` writes it."""
        options = self.options
        return {
            "data": options.data,
            "max_tokens": options.max_tokens,
            "lengths": list(options.lengths),
            "windowing": self.windowing,
            "stride": options.stride,
            "perplexity": options.perplexity,
            "passkey_trials": options.passkey_trials,
            "passkey_depths": list(options.passkey_depths),
            "haystacks": options.haystacks,
            "multikey_trials": options.multikey_trials,
            "multikey_keys": options.multikey_keys,
            "multikey_questions": options.multikey_questions,
            "needle_data": options.needle_data or options.data,
            "needle_templates": options.needle_templates,
            "greedy_check": options.greedy_check,
            "local_window": options.local_window,
            "copy_trials": options.copy_trials,
            "copy_span": options.copy_span,
            "seed": options.seed,
            "dtype": options.dtype,
            "models": {label: model.to_json() for label, model in self.models.items()},
            "train_length": self.train_length,
        }


__all__ = [
    "CopyScore",
    "DepthCount",
    "EvalReport",
    "LengthResult",
    "ModelResult",
    "NeedleScore",
    "NeedleSummary",
    "PerplexityScore",
    "common_train_length",
]
