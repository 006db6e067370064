"""examples/smollm2/screen.py on a tiny checkpoint: config variants as linked folders, one eval process a cell, the
table, and cells kept on a rerun."""

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
SCREEN = ROOT / "examples" / "smollm2" / "screen.py"


def run_screen(screen: dict, tmp_path: Path) -> subprocess.CompletedProcess:
    path = tmp_path / "screen.yaml"
    path.write_text(yaml.safe_dump(screen))
    command = [sys.executable, SCREEN, path, "--output", tmp_path / "out", "--jobs", "2"]
    return subprocess.run(command, capture_output=True, text=True, timeout=600)


def test_screen_of_a_config_variant(checkpoints, tmp_path):
    model = str(checkpoints["path"])
    hot = {"path_attn_temperature_scale": 2.0, "path_attn_temperature_length": 8}
    screen = {
        "texts": ["python-docs"],
        "lengths": [32, 64],
        "max_tokens": 128,
        "train_length": 32,
        "rows": [{"label": "plain", "model": model}, {"label": "hot", "model": model, "config": hot}],
    }
    done = run_screen(screen, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    variant = out / "models" / "hot"
    assert json.loads((variant / "config.json").read_text()).items() >= hot.items()
    assert (variant / "model.safetensors").resolve() == (checkpoints["path"] / "model.safetensors").resolve()
    result = json.loads((out / "screen.json").read_text())
    cells = {(c["row"], c["length"]): c for c in result["cells"]}
    assert set(cells) == {("plain", 32), ("plain", 64), ("hot", 32), ("hot", 64)}
    assert all(c["cpu_minutes"] >= 0 and c["tokens"] > 0 for c in cells.values())
    assert cells["hot", 64]["ppl"] != cells["plain", 64]["ppl"]  # the temperature acts past position 7
    table = (out / "screen.md").read_text()
    assert "| plain | 0 |" in table and "| hot | 0 |" in table

    cell_files = sorted((out / "cells").iterdir())
    stamps = [path.stat().st_mtime_ns for path in cell_files]
    again = run_screen(screen, tmp_path)  # every cell is there: nothing is evaluated again
    assert again.returncode == 0 and [path.stat().st_mtime_ns for path in cell_files] == stamps


def test_screen_refuses_an_unknown_config_field(checkpoints, tmp_path):
    screen = {
        "texts": ["python-docs"],
        "lengths": [32],
        "max_tokens": 64,
        "train_length": 32,
        "rows": [{"label": "typo", "model": str(checkpoints["path"]), "config": {"path_attn_temprature": 1}}],
    }
    done = run_screen(screen, tmp_path)
    assert done.returncode != 0 and "path_attn_temprature" in done.stderr


def test_screen_rows_at_their_own_lengths_with_retrieval(checkpoints, tmp_path):
    model = str(checkpoints["path"])
    screen = {
        "texts": ["python-docs"],
        "lengths": [32, 64],
        "max_tokens": 128,
        "train_length": 32,
        "copy_trials": 1,
        "copy_span": 8,
        "rows": [{"label": "both", "model": model}, {"label": "long only", "model": model, "lengths": [64]}],
    }
    done = run_screen(screen, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    out = tmp_path / "out"
    result = json.loads((out / "screen.json").read_text())
    cells = {(c["row"], c["length"]): c for c in result["cells"]}
    assert set(cells) == {("both", 32), ("both", 64), ("long only", 64)}
    assert result["protocol"]["copy_trials"] == 1 and result["protocol"]["copy_span"] == 8
    for key, entry in cells.items():  # each cell carries its own eval JSON's copy scores
        report = json.loads((out / "cells" / f"{key[0].replace(' ', '-')}--python-docs--{key[1]}.json").read_text())
        evaluated = report["models"][key[0]]["lengths"][str(key[1])]
        assert 0.0 <= entry["copy"] <= 1.0 and entry["copy"] == evaluated["copy"]
        assert entry["copy_nll"] == evaluated["copy_nll"]
    assert cells["both", 64]["copy"] == cells["long only", 64]["copy"]  # the same model and prompt
    table = (out / "screen.md").read_text()
    assert "| long only | 0 | - |" in table and f"copy {cells['both', 32]['copy']:.1%}" in table


def test_screen_refuses_a_row_length_outside_the_screen(checkpoints, tmp_path):
    screen = {
        "texts": ["python-docs"],
        "lengths": [32],
        "max_tokens": 64,
        "train_length": 32,
        "rows": [{"label": "odd", "model": str(checkpoints["path"]), "lengths": [48]}],
    }
    done = run_screen(screen, tmp_path)
    assert done.returncode != 0 and "odd" in done.stderr and "48" in done.stderr


def test_screen_placeholders_name_the_files_of_make_smollm2(checkpoints, tmp_path):
    """`{recovered}` and `{long_tuned}` are the recovered and long-tuned models where examples/smollm2/run.py writes
    them under `--smollm2`."""
    smollm2 = tmp_path / "smollm2"
    for place in ("train", "long"):
        (smollm2 / place).mkdir(parents=True)
        (smollm2 / place / "final").symlink_to(checkpoints["path"])
    screen = {
        "texts": ["python-docs"],
        "lengths": [32],
        "max_tokens": 32,
        "train_length": 32,
        "rows": [{"label": "recovered", "model": "{recovered}"}, {"label": "tuned", "model": "{long_tuned}"}],
    }
    path = tmp_path / "screen.yaml"
    path.write_text(yaml.safe_dump(screen))
    command = [sys.executable, SCREEN, path, "--output", tmp_path / "out", "--jobs", "2", "--smollm2", smollm2]
    done = subprocess.run(command, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    models = json.loads((tmp_path / "out" / "screen.json").read_text())["models"]  # relative to the repository
    # the two are links to one checkpoint: compare the paths, not what they point to
    assert os.path.normpath(ROOT / models["recovered"]) == str(smollm2.resolve() / "train" / "final")
    assert os.path.normpath(ROOT / models["tuned"]) == str(smollm2.resolve() / "long" / "final")


def test_a_cell_counts_the_cpu_time_of_its_process_not_the_wall_time(tmp_path):
    """A cell's `cpu_minutes` is its process's own CPU time, so cells that share the machine still cost what they cost:
    a process that sleeps costs nothing, one that computes costs its time, and the exit code comes back."""
    spec = importlib.util.spec_from_file_location("screen", SCREEN)
    screen = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(screen)
    with open(tmp_path / "log", "w") as stream:
        slept = screen.run_counted([sys.executable, "-c", "import time; time.sleep(1.0)"], dict(os.environ), stream)
        busy = "import time\nend = time.process_time() + 0.5\nwhile time.process_time() < end: pass\nexit(3)"
        computed = screen.run_counted([sys.executable, "-c", busy], dict(os.environ), stream)
    assert slept[0] == 0 and slept[1] < 0.5
    assert computed[0] == 3 and computed[1] >= 0.5
