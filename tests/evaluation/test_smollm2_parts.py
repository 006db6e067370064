"""examples/smollm2/run.py resumes an interrupted evaluation step part by part: a part (one checkpoint's `path-hf
eval` of a pass) is kept when it is a finished evaluation of exactly the models, text, lengths and tokens asked, newer
than its checkpoint; anything else is evaluated again."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DATA = Path("examples/default_model/data/eval.jsonl.xz")  # relative, as run.py names its texts
_spec = importlib.util.spec_from_file_location("smollm2_run", ROOT / "examples" / "smollm2" / "run.py")
run_py = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(run_py)


def test_a_finished_part_is_kept_and_anything_else_evaluated_again(checkpoints, tmp_path):
    checkpoint = tmp_path / "llama"
    shutil.copytree(checkpoints["llama"], checkpoint)
    models = [f"source={checkpoint}", f"source + YaRN={checkpoint}@yarn:1.5"]
    part = tmp_path / "eval-python-docs-source.part0.json"
    command = [sys.executable, "-m", "path_hf.cli", "eval", "--data", str(DATA), "--lengths", "32,64", "--no-progress"]
    command += ["--max-tokens", "128", "--batch-size", "1", "--passkey-trials", "0", "--train-length", "32"]
    command += ["--output", str(part), *(flag for model in models for flag in ("--model", model))]
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr

    assert run_py.finished_part(part, DATA, [32, 64], 128, models)
    assert not run_py.finished_part(tmp_path / "missing.part0.json", DATA, [32, 64], 128, models)
    assert not run_py.finished_part(part, DATA, [32, 64, 128], 128, models)  # another length asked
    assert not run_py.finished_part(part, DATA, [32, 64], 256, models)  # more tokens
    assert not run_py.finished_part(part, Path("examples/data/austen/eval.jsonl.xz"), [32, 64], 128, models)
    assert not run_py.finished_part(part, DATA, [32, 64], 128, [models[0], f"{models[1][:-4]}:2"])  # another factor
    assert not run_py.finished_part(part, DATA, [32, 64], 128, models[:1])  # fewer models
    # The checkpoint written again after the part (a step rerun): the part is stale.
    later = part.stat().st_mtime + 10
    os.utime(checkpoint / "model.safetensors", (later, later))
    assert not run_py.finished_part(part, DATA, [32, 64], 128, models)
