"""`make smollm2`'s pipeline end to end, reduced (`examples/smollm2/run.py --quick`) on a tiny GGUF that the test
writes: convert with --verify, evaluate the source (RoPE, YaRN, dynamic NTK), recover, tune the gate for long
context, evaluate PaTH (step 0, recovered, long-tuned, with and without YaRN), the extras (greedy answers, bfloat16
drift, lm-eval-harness), the summary and its goals."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
from tests import processes  # noqa: E402
from tests.conversion.gguf_files import tiny_model, write_gguf  # noqa: E402

TEXTS = ["python-docs", "copyright-does-not-exist"]
LONG_TEXT = "copyright-does-not-exist"


def goals_of(report: dict, text: str) -> dict:
    return report["goals"][text]


def run_pipeline(gguf: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "examples/smollm2/run.py", "--quick", "--threads", "1", "--gguf", str(gguf)]
    return processes.run([*command, "--output", str(out), *extra], timeout=1200, cwd=ROOT, env=processes.environment())


@pytest.mark.slow
def test_the_smollm2_pipeline_on_a_tiny_gguf(tmp_path):
    gguf = write_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_model(), "llama", "Q8_0")
    out = tmp_path / "smollm2"
    completed = run_pipeline(gguf, out, "--jobs", "2")  # evaluations side by side, their parts joined
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    report = json.loads((out / "smollm2.json").read_text())

    # The converted model is PaTH, recorded as converted from the GGUF, and the recipe trained it.
    converted = json.loads((out / "converted" / "config.json").read_text())
    assert converted["model_type"] == "path_llama" and converted["path_conversion"]["source"] == str(gguf)
    assert converted["path_forget_gate_bias"] == report["recipe"]["model"]["convert"]["forget_gate_bias"]
    # The shipped recipe's hybrid, scaled down: the tiny source's last layer PaTH, the other local, the quick context.
    assert (converted["path_layers"], converted["local_window"], converted["local_sinks"]) == ([1], 64, 4)
    assert report["recovery"]["final"]["tokens"] == 256 * len(report["recipe"]["stages"])
    assert report["long_tuning"]["final"]["tokens"] == 256 * len(report["long_recipe"]["stages"])

    # The long-context tuning moved the gate (beta and the forget gate) of the recovered model, and nothing else.
    recovered, tuned = (load_file(out / run / "final" / "model.safetensors") for run in ("train", "long"))
    assert recovered.keys() == tuned.keys()
    moved = {name for name in recovered if not torch.equal(recovered[name], tuned[name])}
    assert moved and all(re.search(r"\.(bt_proj|bt_gain|g_proj|g_gain)\.", name) for name in moved), sorted(moved)

    models = ["source (RoPE)", "source + YaRN", "source + dynamic NTK", "PaTH, step 0", "PaTH, recovered"]
    models += ["PaTH, long-tuned", "PaTH, recovered + YaRN", "PaTH, long-tuned + YaRN"]
    with_yarn = models[-2:]
    assert report["lengths"] == [64, 128] and list(report["texts"]) == TEXTS
    for text in TEXTS:
        ppl = {
            model: {int(n): value for n, value in values.items()}
            for model, values in report["texts"][text]["ppl"].items()
        }
        assert sorted(ppl) == sorted(models)
        # The one-window pass at the longest length runs on one text, for plain RoPE, YaRN and the shipped model (long-
        # tuned, with YaRN).
        long = {"source (RoPE)", "source + YaRN"} if text == LONG_TEXT else set()
        for model in models[:-2]:
            assert set(ppl[model]) == ({64, 128, 256} if model in long else {64, 128}), (text, model)
        # The PaTH models with YaRN (RoPE is kept) at the longest length of the main pass (and of the long one).
        assert set(ppl["PaTH, recovered + YaRN"]) == {128}, text
        assert set(ppl["PaTH, long-tuned + YaRN"]) == ({128, 256} if text == LONG_TEXT else {128}), text
        assert goals_of(report, text)["recovered_yarn_over_yarn_16k"] == pytest.approx(
            ppl["PaTH, recovered + YaRN"][128] / ppl["source + YaRN"][128]
        )
        assert goals_of(report, text)["long_tuned_yarn_over_yarn_16k"] == pytest.approx(
            ppl["PaTH, long-tuned + YaRN"][128] / ppl["source + YaRN"][128]
        )
        assert goals_of(report, text)["long_tuned_over_source_8k"] == pytest.approx(
            ppl["PaTH, long-tuned"][64] / ppl["source (RoPE)"][64]
        )
        # The source and its scalings are one model within the training length (64 here), and differ past it.
        assert ppl["source + YaRN"][64] == pytest.approx(ppl["source (RoPE)"][64], rel=1e-6)
        assert ppl["source + YaRN"][128] != pytest.approx(ppl["source (RoPE)"][128], rel=1e-6)
        goals = report["goals"][text]
        assert goals["ratio_at_training_length"] == pytest.approx(ppl["PaTH, recovered"][64] / ppl["source (RoPE)"][64])
        assert goals["recovery_met"] == (goals["ratio_at_training_length"] <= 1.05)
        assert goals["recovered_over_yarn_16k"] == pytest.approx(
            ppl["PaTH, recovered"][128] / ppl["source + YaRN"][128]
        )
        assert ("beats_yarn_32k" in goals) == (text == LONG_TEXT)
        # Issue 24's goals, of the shipped (long-tuned) model: every length inside the context against the source.
        inside = {int(n): ratio for n, ratio in goals["long_tuned_over_source"].items()}
        assert inside == pytest.approx({n: ppl["PaTH, long-tuned"][n] / ppl["source (RoPE)"][n] for n in (64,)})
        assert goals["in_context_met"] == (max(inside.values()) <= 1.02)
        assert goals["no_worse_than_yarn_16k_met"] == (goals["long_tuned_yarn_over_yarn_16k"] <= 1)
    long_ppl = report["texts"][LONG_TEXT]["ppl"]
    long_goals = report["goals"][LONG_TEXT]
    assert long_goals["long_tuned_yarn_over_yarn_32k"] == pytest.approx(
        long_ppl["PaTH, long-tuned + YaRN"]["256"] / long_ppl["source + YaRN"]["256"]
    )
    assert long_goals["beats_yarn_32k"] == (long_goals["long_tuned_yarn_over_yarn_32k"] < 1)
    assert long_goals["long_tuned_yarn_32k_over_8k"] == pytest.approx(
        long_ppl["PaTH, long-tuned + YaRN"]["256"] / long_ppl["PaTH, long-tuned"]["64"]
    )
    assert long_goals["flat_32k_met"] == (long_goals["long_tuned_yarn_32k_over_8k"] <= 1.1)
    # YaRN on the PaTH models at 3/4 of the source's factor (length / 64 here): 1.5 at 128, 3 at 256.
    models_on_long_text = report["texts"][LONG_TEXT]["models"]
    for label in with_yarn:
        assert models_on_long_text[label]["lengths"]["128"]["rope_factor"] == 1.5
    assert models_on_long_text["PaTH, long-tuned + YaRN"]["lengths"]["256"]["rope_factor"] == 3.0

    extras = report["extras"]
    assert all(len(extras["answers"][name]) == 5 for name in ("source", "recovered"))
    # The PaTH parameters of step 0 and the recovered model, per layer: beta in (0, 2), log gates <= 0 (forget gate).
    assert set(extras["path_parameters"]) == {"step 0", "recovered"}
    for entry in extras["path_parameters"].values():
        assert len(entry["beta"]["layers"]) == len(converted["path_layers"])
        assert all(0 < beta < 2 for beta in entry["beta"]["layers"])
        assert all(gate <= 0 for gate in entry["log_gate"]["layers"])
    # The recipe moved them: the recovered model's differ from step 0's.
    assert extras["path_parameters"]["recovered"]["beta"] != extras["path_parameters"]["step 0"]["beta"]
    for drift in extras["precision"].values():
        assert 0 <= drift["top1_agreement"] <= 1 and drift["max_diff_over_spread"] >= 0
    for name in ("source", "recovered"):
        tasks = extras["lm_eval"][name]
        assert {"pydocs_lastword", "copyright_does_not_exist_perplexity"} <= set(tasks)
    for plot in [out / f"ppl_vs_length-{text}.png" for text in TEXTS] + [out / "train" / "recovery.png"]:
        assert plot.read_bytes()[:4] == b"\x89PNG"

    # Each step is shown as the command a user would type, with its time and peak memory; the table is printed.
    for command in (
        "$ path-hf convert --from",
        "$ accelerate launch --cpu",
        "$ path-hf eval --data",
        "lm_eval --model hf",
    ):
        assert command in completed.stdout
    assert "--verify" in completed.stdout and "peak RSS" in completed.stdout
    assert "| PaTH, recovered |" in completed.stdout and "long-tuned with YaRN at 256" in completed.stdout
    # The evaluations ran side by side, one process per checkpoint of a pass, and their parts were joined.
    assert completed.stdout.count("$ path-hf eval --data") > len(list(out.glob("eval-*.json")))
    assert not list(out.glob("*.part*"))
    # The reports name the texts relative to the repository, as the published copies must.
    for report_file in out.glob("eval-*.json"):
        assert not any(Path(name).is_absolute() for name in json.loads(report_file.read_text())["data"]), report_file

    # A second run reuses every step's output: nothing is recomputed, the same summary comes out.
    again = run_pipeline(gguf, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "$ " not in again.stdout
    assert json.loads((out / "smollm2.json").read_text())["texts"] == report["texts"]


def test_an_unknown_step_is_named(tmp_path):
    completed = run_pipeline(tmp_path / "absent.gguf", tmp_path / "out", "--steps", "convert,train")
    assert completed.returncode == 1 and "unknown step(s) ['train']" in completed.stderr
