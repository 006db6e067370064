"""`make demo`'s pipeline end to end, reduced (`examples/demo.py --quick`): convert the embedded default model with
`path-hf convert`, recover it with the recipe, evaluate five models at 1x-8x with `path-hf eval`, summarise."""

import json
import sys
from pathlib import Path

import pytest
import yaml

from tests import processes

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.slow
def test_the_demo_pipeline(tmp_path):
    out = tmp_path / "demo"
    command = [sys.executable, "examples/demo.py", "--quick", "--threads", "1", "--output", str(out)]
    completed = processes.run(command, timeout=900, cwd=ROOT, env=processes.environment())
    assert completed.returncode == 0, completed.stderr[-3000:]
    report = json.loads((out / "demo.json").read_text())
    lengths = [str(m * 256) for m in (1, 2, 4, 8)]
    models = ["RoPE (source)", "RoPE + YaRN", "RoPE + dynamic NTK", "PaTH, step 0", "PaTH, recovered"]
    assert list(report["perplexity"]) == models
    assert all(list(report["perplexity"][model]) == lengths for model in models)
    ppl = report["perplexity"]
    # The source and its scaled variants are one model at the training length; beyond it the scalings differ.
    assert ppl["RoPE + YaRN"]["256"] == pytest.approx(ppl["RoPE (source)"]["256"], rel=1e-6)
    assert ppl["RoPE + dynamic NTK"]["256"] == pytest.approx(ppl["RoPE (source)"]["256"], rel=1e-6)
    assert len({ppl[model]["2048"] for model in models[:3]}) == 3
    # The recipe trained the converted model: it is better than at step 0, and the summary says by how much.
    assert ppl["PaTH, recovered"]["256"] < ppl["PaTH, step 0"]["256"]
    # One implementation: the recipe's tracking and `path-hf eval` agree on the same tokens.
    for multiple in ("1x", "2x", "4x"):
        length = str(int(multiple[0]) * 256)
        assert report["recovery"]["source_ppl"][multiple] == pytest.approx(ppl["RoPE (source)"][length], rel=1e-4)
        assert report["recovery"]["history"][0]["ppl"][multiple] == pytest.approx(ppl["PaTH, step 0"][length], rel=1e-4)
        assert report["recovery"]["final"]["ppl"][multiple] == pytest.approx(ppl["PaTH, recovered"][length], rel=1e-4)
    goals = report["goals"]
    assert goals["recovery_ratio_1x"] == pytest.approx(ppl["PaTH, recovered"]["256"] / ppl["RoPE (source)"]["256"])
    stages = yaml.safe_load((ROOT / "recipes" / "configs" / "tiny-cpu.yaml").read_text())["stages"]
    assert goals["training_tokens"] == report["recovery"]["final"]["tokens"] == len(stages) * 4096
    assert (out / "converted" / "config.json").is_file()
    assert json.loads((out / "converted" / "config.json").read_text())["model_type"] == "path_llama"
    for plot in (out / "ppl_vs_length.png", out / "train" / "recovery.png"):
        assert plot.read_bytes()[:4] == b"\x89PNG"
    assert "| PaTH, recovered |" in completed.stdout and "recovery: ratio" in completed.stdout
    # Each step is shown as the command a user would type.
    assert "$ path-hf convert --from" in completed.stdout and "$ path-hf eval --data" in completed.stdout
    assert "$ accelerate launch --cpu" in completed.stdout
