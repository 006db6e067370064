"""conversion/convert.py, the script beside the conversion guide, in a fresh process: the flags of `path-hf convert`
(its --help says the same), a conversion that writes what `path-hf convert` writes, and a refusal on one line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.conversion.checkpoints import make_source, run_cli

REPO_ROOT = Path(__file__).resolve().parents[2]
SCRIPT = REPO_ROOT / "conversion" / "convert.py"


def run_script(*args, cwd: Path) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "COLUMNS": "120",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, str(SCRIPT), *(str(arg) for arg in args)]
    return subprocess.run(command, env=env, cwd=cwd, capture_output=True, text=True, timeout=300)


def after_usage(help_text: str) -> str:
    """A --help without its usage lines, which name the program (and wrap by its name's length)."""
    return help_text.split("\n\n", 1)[1]


def test_help_is_path_hf_converts(tmp_path, capsys, monkeypatch):
    result = run_script("--help", cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    monkeypatch.setenv("COLUMNS", "120")
    capsys.readouterr()
    with pytest.raises(SystemExit):
        run_cli(capsys, "convert", "--help")
    expected = capsys.readouterr().out
    assert "--retrieval-layers" in expected and "--from" in expected
    assert after_usage(result.stdout) == after_usage(expected)


def test_a_conversion_through_the_script_is_path_hf_converts(tmp_path, capsys):
    source = make_source(tmp_path / "source", "qwen3", max_shard_size="100KB", tokenizer=True)
    flags = ["--layers", "0,2", "--forget-gate", "--dtype", "bfloat16", "--max-shard-size", "100KB"]
    by_script, by_cli = tmp_path / "script" / "model", tmp_path / "cli" / "model"  # the model card names the folder
    result = run_script("--from", source, "--to", by_script, *flags, cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", by_cli, *flags)
    assert code == 0, err

    # The same plan and report, but for the destination and the time taken.
    def same(stdout: str, output: Path) -> str:
        return re.sub(r" in \d+\.\d s\)", " in T s)", stdout.replace(str(output), "DST"))

    assert same(result.stdout, by_script) == same(out, by_cli) and "wrote DST" in same(out, by_cli)
    names = sorted(path.name for path in by_cli.iterdir())
    assert sorted(path.name for path in by_script.iterdir()) == names and "model.safetensors.index.json" in names
    for name in names:
        assert (by_script / name).read_bytes() == (by_cli / name).read_bytes(), name
    tokens = torch.arange(24)[None]
    with torch.no_grad():
        logits = [AutoModelForCausalLM.from_pretrained(path)(tokens).logits for path in (by_script, by_cli)]
    torch.testing.assert_close(logits[0], logits[1], rtol=0, atol=0)

    refused = run_script("--from", source, "--to", by_script, cwd=tmp_path)
    assert refused.returncode == 1 and refused.stdout == ""
    assert refused.stderr == f"error: {by_script} exists and holds a model; pass --force to replace it.\n"
