"""The typed results of an evaluation (`path_hf.evaluation.results`) against the JSON `path-hf eval --output` writes:
the same numbers, in the keys and the order that saved reports have (docs/demo/demo.json, the SmolLM2 runs), and the
same table of either."""

import json
from dataclasses import replace

import pytest

from path_hf.commands.eval import progress_line, run_eval
from path_hf.evaluation import (
    EvalOptions,
    EvalReport,
    ModelSpec,
    NeedleSummary,
    NeedleTrial,
    TrialResult,
    format_table,
    summarize_trials,
)
from tests.evaluation.eval_models import EVAL_DATA, TRAIN_LENGTH


def trial(kind: str, depth: float, answer: tuple[int, ...] = (5, 6)) -> NeedleTrial:
    return NeedleTrial(kind, 64, (1, 2, 3), answer, 0, 1, depth, 10, "12345", None, 0)


@pytest.mark.parametrize("kind", ["passkey", "multikey"])
def test_a_needle_summary_is_what_summarize_trials_writes(kind):
    """Found / trials, the interval, the likelihood, by depth (passkey only) and the greedy check, key for key."""
    results = [
        TrialResult(trial(kind, 0.1), 2, 2, 1.5, greedy=(5, 7)),  # found; greedy decoding disagrees
        TrialResult(trial(kind, 0.1), 1, 2, 3.0, greedy=(5, 7)),
        TrialResult(trial(kind, 0.5), 0, 2, 4.0),
    ]
    summary = NeedleSummary.of(results)
    assert (summary.found, summary.trials, summary.greedy_checked, summary.greedy_agrees) == (1, 3, 2, 1)
    assert list(json.dumps(summary.to_json())) == list(json.dumps(summarize_trials(results)))
    if kind == "passkey":
        assert {depth: (count.found, count.trials) for depth, count in summary.by_depth.items()} == {
            "0.1": (1, 2),
            "0.5": (0, 1),
        }
    else:
        assert summary.by_depth is None and "by_depth" not in summary.to_json()


def test_the_report_is_the_json_written(checkpoints, tmp_path, capsys):
    """`run_eval` returns the typed report of what it wrote: the JSON is `to_json()`, key order included; a scaled
    model's result where its scaling is the identity is the unscaled one's, marked; the table is the same of both."""
    output = tmp_path / "eval.json"
    options = EvalOptions(
        models=[ModelSpec.parse(str(checkpoints["llama"])), ModelSpec.parse(f"scaled={checkpoints['llama']}@yarn")],
        data=[str(EVAL_DATA)],
        lengths=(32, 64),
        max_tokens=64,
        passkey_trials=1,
        copy_trials=1,
        copy_span=8,
        progress=False,
        output=str(output),
    )
    report = run_eval(options)
    assert isinstance(report, EvalReport) and list(report.models) == ["llama", "scaled"]
    written = output.read_text()
    assert written == json.dumps(report.to_json(), indent=2) + "\n"
    saved = json.loads(written)
    assert list(saved) == [
        "data", "max_tokens", "lengths", "windowing", "stride", "perplexity", "passkey_trials", "passkey_depths",
        "haystacks", "multikey_trials", "multikey_keys", "multikey_questions", "needle_data", "needle_templates",
        "greedy_check", "local_window", "copy_trials", "copy_span", "seed", "dtype", "models", "train_length",
    ]  # fmt: skip
    assert list(saved["models"]["scaled"]) == [
        "path", "tokenizer", "model_type", "rope_scaling", "train_length", "tokens", "local_window", "lengths", "spec",
    ]  # fmt: skip
    plain, scaled = report.models["llama"].lengths, report.models["scaled"].lengths
    assert TRAIN_LENGTH == 32 and scaled[32] == replace(plain[32], rope_factor=1.0, same_as_unscaled=True)
    assert scaled[64].rope_factor == 2.0 and not scaled[64].same_as_unscaled
    assert plain[32].passkey.summary is None and plain[32].passkey.error.startswith("context length 32 is too short")
    assert plain[64].passkey.summary.trials == 1 and plain[64].copy.accuracy is not None
    lengths = saved["models"]["scaled"]["lengths"]
    perplexity = ["ppl", "nll", "tokens", "windows", "ppl_second_half"]
    assert list(lengths["32"]) == perplexity + [
        "passkey", "passkey_error", "copy", "copy_nll", "seconds", "rope_factor", "same_as_unscaled",
    ]  # fmt: skip
    computed = ["rope_factor", "passkey", "passkey_trials", "copy", "copy_nll", "seconds"]
    assert list(lengths["64"]) == perplexity + computed
    assert lengths["32"]["seconds"] == saved["models"]["llama"]["lengths"]["32"]["seconds"]
    out, err = capsys.readouterr()
    assert format_table(report) == format_table(saved) and out == format_table(saved) + "\n"
    assert f"{'scaled':>24}  {32:>6}  {progress_line(scaled[32])}  (the unscaled model's)" in err.splitlines()
    assert progress_line(plain[64]).startswith(f"ppl {saved['models']['llama']['lengths']['64']['ppl']:9.3f}  passkey")
