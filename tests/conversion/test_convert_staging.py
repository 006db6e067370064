"""The directories a conversion writes beside DST: gone after SIGTERM; left by a killed run, removed by the next one
(if their process is dead) or named (if it runs, or cannot be checked); and the free-space check around them."""

import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from pathlib import Path

import pytest

import path_hf.conversion.staging
from tests.conversion.checkpoints import make_source, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
# `path-hf convert` that stalls at its first raw tensor copy, once the GGUF is materialised and the output's staging
# directory made, after touching the file argv[1]: a known point at which to send SIGTERM.
STALLED_CONVERT = """
import sys, time
from pathlib import Path
from path_hf.cli import main
from path_hf.conversion.io import SafetensorsWriter

def stall(*args):
    Path(sys.argv[1]).touch()
    time.sleep(600)

SafetensorsWriter.copy_tensor = stall
sys.exit(main(sys.argv[2:]))
"""
usage = namedtuple("usage", "total used free")


def staging_names(directory: Path, output_name: str = "converted") -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.startswith(f".{output_name}."))


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    stalled = tmp_path / "stalled"
    env = {
        **os.environ,
        "HF_HUB_OFFLINE": "1",
        "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])),
    }
    command = [sys.executable, "-c", STALLED_CONVERT, str(stalled), "convert", "--from", str(source), "--to"]
    process = subprocess.Popen(
        [*command, str(tmp_path / "converted")], env=env, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    try:
        deadline = time.monotonic() + 300
        while not stalled.exists():
            assert process.poll() is None, process.communicate()[1].decode()
            assert time.monotonic() < deadline, "the conversion never reached its first tensor copy"
            time.sleep(0.1)
        # Both staging directories exist, named with this host and the converter's process id.
        names = staging_names(tmp_path)
        assert [name.split("-")[0] for name in names] == [".converted.gguf", ".converted.tmp"], names
        assert all(f"-{process.pid}-" in name for name in names), names
        process.send_signal(signal.SIGTERM)
        _, err = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 130, err.decode()
    assert "interrupted; nothing was written" in err.decode()
    assert staging_names(tmp_path) == []
    assert not (tmp_path / "converted").exists()


def finished_process_id() -> int:
    """The id of a process that has exited."""
    process = subprocess.Popen([sys.executable, "-c", "pass"])
    process.wait()
    return process.pid


def plant(directory: Path, size: int = 100_000) -> Path:
    """A staging directory left with one file of `size` bytes."""
    directory.mkdir()
    (directory / "model.safetensors").write_bytes(os.urandom(size))
    return directory


@pytest.fixture
def running_process():
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    yield process
    process.kill()
    process.wait()


def test_stale_staging_of_a_dead_process_is_removed(tmp_path, capsys, running_process):
    source = make_source(tmp_path / "source", "llama")
    host = path_hf.conversion.staging._HOST
    dead = [
        plant(tmp_path / f".converted.tmp-{host}-{finished_process_id()}-0123abcd"),
        plant(tmp_path / f".converted.gguf-{host}-{finished_process_id()}-4567cdef"),
    ]
    kept = [
        plant(tmp_path / f".converted.tmp-{host}-{running_process.pid}-89abcdef"),  # a conversion running now
        plant(tmp_path / ".converted.tmp-0badc0de"),  # named by an older version: no process to check
        plant(tmp_path / f".converted.gguf-{host}x-{finished_process_id()}-fedcba98"),  # another host's
    ]
    plant(tmp_path / f".other.tmp-{host}-{finished_process_id()}-0123abcd")  # another destination's

    # --dry-run names them all and removes nothing.
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 0, err
    for path in dead:
        assert f"stale staging directory {path} (" in out and "a conversion removes it" in out
    assert all(path.is_dir() for path in dead + kept)

    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 0, err
    for path in dead:
        assert not path.exists()
        line = next(line for line in out.splitlines() if str(path) in line)
        assert line.startswith("removed stale staging directory") and "which is no longer running" in line
    warnings = [line for line in err.splitlines() if line.startswith("warning: left as it is: ")]
    assert len(warnings) == len(kept)
    for path, owner in zip(kept, ["of running process", "left by an older path-hf", "on host"], strict=True):
        assert path.is_dir()
        assert any(str(path) in line and owner in line for line in warnings), (path, warnings)
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    assert (tmp_path / "converted").is_dir() and len(staging_names(tmp_path)) == len(kept)
    assert len(staging_names(tmp_path, "other")) == 1


def test_small_model_on_a_small_file_system(tmp_path, capsys, monkeypatch):
    """The margin grows with the output: 530 KB converts with 1 MB free (a fixed 256 MiB margin refused it)."""
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 10**6))
    source = make_source(tmp_path / "source", "llama")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 0, err
    assert "write:        528.82 KB" in out
    assert path_hf.conversion.staging.disk_margin(10**12) == 256 * 2**20  # still 256 MiB for big models


def test_free_space_counts_stale_staging_and_names_what_other_conversions_hold(
    tmp_path, capsys, monkeypatch, running_process
):
    source = make_source(tmp_path / "source", "llama")
    host = path_hf.conversion.staging._HOST
    stale = plant(tmp_path / f".converted.tmp-{host}-{finished_process_id()}-0123abcd", 400_000)
    # 529 KB to write + a 161 KB margin: short of 690 KB without the 400 KB of the dead process's directory.
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 400_000))
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 0, err
    assert stale.is_dir()

    held = plant(tmp_path / f".converted.tmp-{host}-{running_process.pid}-89abcdef", 400_000)
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 200_000))
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 1
    message = err.splitlines()[-1]
    assert (
        message.startswith("error: not enough free disk space") and " in stale staging directories to remove" in message
    )
    assert f"is held by staging directories of other conversions: {held.name}" in message
