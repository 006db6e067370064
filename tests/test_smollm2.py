"""`make smollm2`'s pipeline end to end, reduced (`examples/smollm2/run.py --quick`) on a tiny GGUF that the test
writes: the baselines' conversions, the recipe's conversion with --verify, the shipped recipe and its control, every
row on the protocol, results.json and its table; `--steps` runs what it names and the missing steps those need."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parent.parent
from tests import processes  # noqa: E402
from tests.conversion.gguf_files import tiny_model, write_gguf  # noqa: E402

KINDS = ["source", "source+yarn", "streaming", "heads", "control", "path"]


def run_pipeline(gguf: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    command = [sys.executable, "examples/smollm2/run.py", "--quick", "--threads", "1", "--gguf", str(gguf)]
    return processes.run([*command, "--output", str(out), *extra], timeout=1200, cwd=ROOT, env=processes.environment())


@pytest.mark.slow
def test_the_smollm2_pipeline_on_a_tiny_gguf(tmp_path):
    gguf = write_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_model(), "llama", "Q8_0")
    out = tmp_path / "smollm2"
    completed = run_pipeline(gguf, out, "--jobs", "2")
    assert completed.returncode == 0, completed.stdout[-3000:] + completed.stderr[-3000:]
    results = json.loads((out / "results.json").read_text())
    protocol = yaml.safe_load((ROOT / "examples" / "smollm2" / "protocol.yaml").read_text())
    texts = list(protocol["texts"])

    # One row per model, of the schema's kinds, exactly one shipped: the trained hybrid at its own window.
    rows = results["rows"]
    assert [row["kind"] for row in rows] == KINDS
    assert [row["label"] for row in rows if row["shipped"]] == ["PaTH hybrid + YaRN (window 16)"]
    for row in rows:
        assert set(row) >= {"label", "kind", "shipped", "recipe_minutes", "training_tokens", "ppl", "passkey"}
        assert set(row["ppl"]) == set(texts) and all(set(ppl) == {"64", "128", "256"} for ppl in row["ppl"].values())
        assert set(row["passkey"]) == {"128", "256"} and set(row["multikey"]) == {"256"}
        for cell in [*row["passkey"].values(), *row["multikey"].values()]:
            assert 0 <= cell["found"] <= cell["trials"] == 2
            assert cell["wilson95"][0] <= cell["found"] / cell["trials"] <= cell["wilson95"][1]
            assert cell["greedy"][1] == 1  # the first trial also decoded with generate
        trained = row["kind"] in ("control", "path")
        assert (row["training_tokens"] > 0) == trained and (row["recipe_minutes"] > 0) == trained
    # The source and YaRN are one model inside the training length and differ past it.
    source, yarn = rows[0]["ppl"][texts[0]], rows[1]["ppl"][texts[0]]
    assert yarn["64"] == pytest.approx(source["64"], rel=1e-6) and yarn["128"] != pytest.approx(source["128"])

    # The shipped model and the control: the same conversion; only the PaTH layers' attention trained; the shipped
    # recipe trained with a window shorter than the block, the control with none (its local layers see the block).
    shipped, control = (json.loads((out / run / "final" / "config.json").read_text()) for run in ("train", "control"))
    assert shipped["path_layers"] == control["path_layers"] == [1]
    assert shipped["local_window"] == control["local_window"] == 16
    recipe = yaml.safe_load((ROOT / "recipes" / "configs" / "smollm2-135m-cpu.yaml").read_text())
    control_recipe = yaml.safe_load((ROOT / "recipes" / "configs" / "smollm2-135m-cpu-control.yaml").read_text())
    assert all(stage.get("local_window") for stage in recipe["stages"])
    assert not any(stage.get("local_window") for stage in control_recipe["stages"])
    assert [{k: v for k, v in stage.items() if k != "local_window"} for stage in recipe["stages"]] == control_recipe[
        "stages"
    ]
    before, after = (
        load_file(out / "converted" / "model.safetensors"),
        load_file(out / "train" / "final" / "model.safetensors"),
    )
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(name.startswith("model.layers.1.self_attn.") for name in moved), sorted(moved)
    heads = json.loads((out / "baselines" / "heads" / "config.json").read_text())
    assert len(heads["local_full_heads"]) == 2 and heads["path_layers"] == []

    # Each step is shown as the command a user would type; the table is printed; reports name relative files.
    for command in ("$ path-hf convert --from", "$ accelerate launch --cpu", "--full-heads", "--verify"):
        assert command in completed.stdout
    assert "| **PaTH hybrid + YaRN (window 16)** (shipped) |" in completed.stdout
    for report_file in (out / "eval").rglob("*.json"):
        assert not any(Path(name).is_absolute() for name in json.loads(report_file.read_text())["data"]), report_file

    # A second run reuses every step's output: nothing runs again.
    again = run_pipeline(gguf, out)
    assert again.returncode == 0, again.stderr[-3000:]
    assert "$ " not in again.stdout and not (out / "eval" / "source" / "ppl-python-docs.part").exists()

    # --steps names what runs, and a missing step it needs runs first, said so.
    (out / "control" / "run.json").unlink()
    named = run_pipeline(gguf, out, "--steps", "summary", "--rows", "control")
    assert named.returncode == 0, named.stderr[-3000:]
    assert "also running control, eval: needed by summary" in named.stdout
    assert "$ path-hf convert --from" not in named.stdout.split("recipes/train.py")[0]  # no baseline converted again


def test_an_unknown_step_is_named(tmp_path):
    completed = run_pipeline(tmp_path / "absent.gguf", tmp_path / "out", "--steps", "convert,recover")
    assert completed.returncode == 1 and "unknown step(s) ['recover']" in completed.stderr
