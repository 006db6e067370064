"""`python -m path_hf` in a fresh process, from a hub id in an offline cache, and the output loaded with
`trust_remote_code=True` by a process that never imports path_hf."""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from tests.conversion.checkpoints import make_source

REPO_ROOT = Path(__file__).resolve().parents[2]
COMMIT = "0123456789abcdef0123456789abcdef01234567"
LOAD_WITH_REMOTE_CODE = """
import sys, torch
from transformers import AutoModelForCausalLM
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], trust_remote_code=True)
assert "path_hf" not in sys.modules, "loaded path_hf instead of the code beside the weights"
print(type(model).__module__)
with torch.no_grad():
    torch.save(model(torch.arange(24)[None]).logits, sys.argv[2])
"""


def test_hub_source_python_m_and_trust_remote_code(tmp_path):
    # A hub cache holding tiny/qwen3 at COMMIT, as snapshot_download leaves it; HF_HUB_OFFLINE keeps it offline.
    repo = tmp_path / "hub" / "models--tiny--qwen3"
    source = make_source(repo / "snapshots" / COMMIT, "qwen3", max_shard_size="100KB", tokenizer=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(COMMIT)
    output = tmp_path / "converted"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "HF_HUB_CACHE": str(tmp_path / "hub"),
        "HF_MODULES_CACHE": str(tmp_path / "modules"),
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    flags = ["--rope", "keep", "--init", "identity"]
    convert = [sys.executable, "-m", "path_hf", "convert", "--from", "tiny/qwen3", "--to", str(output), *flags]
    result = subprocess.run(convert, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert f"source:       tiny/qwen3 @ {COMMIT}" in result.stdout
    record = json.loads((output / "config.json").read_text())["path_conversion"]
    assert (record["source"], record["revision"]) == ("tiny/qwen3", COMMIT)
    assert "base_model: tiny/qwen3" in (output / "README.md").read_text()
    assert (output / "tokenizer.json").is_file()

    env["PYTHONPATH"] = os.environ.get("PYTHONPATH", "")
    load = [sys.executable, "-c", LOAD_WITH_REMOTE_CODE, str(output), str(tmp_path / "logits.pt")]
    result = subprocess.run(load, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("transformers_modules.")
    with torch.no_grad():
        source_logits = AutoModelForCausalLM.from_pretrained(source)(torch.arange(24)[None]).logits
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), source_logits, rtol=0, atol=1e-5)
