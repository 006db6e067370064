"""What a conversion writes beside DST: its lock, which refuses a second conversion to DST and holds nothing once its
process is gone; the staging directories, gone after SIGTERM, left by a killed run and removed by the next one (if
their process is dead, or holds no lock on DST) or named (if they cannot be checked); and the free-space check
around them."""

import fcntl
import os
import signal
import subprocess
import sys
import time
from collections import namedtuple
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

import path_hf.conversion.plan
import path_hf.conversion.staging
import path_hf.locking
from tests.conversion.checkpoints import make_source, run_cli
from tests.conversion.gguf_files import tiny_model, write_gguf
from tests.processes import communicate, environment, group

# `path-hf convert` held at its first raw tensor copy, once the GGUF (if any) is materialised and the output's staging
# directory made, inside the destination's lock: it touches the file argv[1], then waits for argv[2] to exist (forever
# if it never does) before it copies on. A known point at which to send signals or start a second conversion.
HELD_CONVERT = """
import sys, time
from pathlib import Path
from path_hf.cli import main
from path_hf.conversion.io import SafetensorsWriter

copy_tensor = SafetensorsWriter.copy_tensor

def held(*args):
    Path(sys.argv[1]).touch()
    while not Path(sys.argv[2]).exists():
        time.sleep(0.05)
    copy_tensor(*args)

SafetensorsWriter.copy_tensor = held
sys.exit(main(sys.argv[3:]))
"""
usage = namedtuple("usage", "total used free")


def staging_names(directory: Path, output_name: str = "converted") -> list[str]:
    return sorted(path.name for path in directory.iterdir() if path.name.startswith(f".{output_name}."))


@contextmanager
def held_conversion(tmp_path: Path, source: Path, output: Path, *flags) -> Iterator[subprocess.Popen]:
    """`path-hf convert --from source --to output` in a process of its own, held for the block inside the
    destination's lock, at its first tensor copy (`HELD_CONVERT`); creating `tmp_path / "release"` lets it go on."""
    reached = tmp_path / "held"
    command = [sys.executable, "-c", HELD_CONVERT, reached, tmp_path / "release", "convert", "--from", source]
    with group([str(arg) for arg in [*command, "--to", output, *flags]], env=environment(), cwd=tmp_path) as process:
        deadline = time.monotonic() + 300
        while not reached.exists():
            assert process.poll() is None, process.communicate()[1]
            assert time.monotonic() < deadline, "the conversion never reached its first tensor copy"
            time.sleep(0.1)
        yield process


def test_sigterm_cleans_up_like_ctrl_c(tmp_path):
    source = write_gguf(tmp_path / "model.gguf", tiny_model(), "llama", "F32", tokenizer=False)
    with held_conversion(tmp_path, source, tmp_path / "converted") as process:
        # Both staging directories exist, named with this host and the converter's process id, beside the lock.
        names = staging_names(tmp_path)
        assert [name.split("-")[0] for name in names] == [".converted.gguf", ".converted.lock", ".converted.tmp"]
        assert all(f"-{process.pid}-" in name for name in names if name != ".converted.lock"), names
        process.send_signal(signal.SIGTERM)
        _, err = communicate(process, timeout=120)
    assert process.returncode == 130, err
    assert "interrupted; nothing was written" in err
    assert staging_names(tmp_path) == []
    assert not (tmp_path / "converted").exists()


def test_a_second_conversion_to_the_same_destination_is_refused(tmp_path, capsys):
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    host = path_hf.locking.HOST
    with held_conversion(tmp_path, source, output) as first:
        held = staging_names(tmp_path)
        assert (tmp_path / ".converted.lock").read_text() == f"process {first.pid} on host {host}\n"
        for flags in [(), ("--force",), ("--dry-run",)]:
            code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output, *flags)
            assert code == 1 and err.count("\n") == 1, err
            assert err.startswith(
                f"error: another conversion to {output} is running (process {first.pid} on host {host}, holding "
                f"{tmp_path / '.converted.lock'}); wait for it to end, or choose another --to."
            ), err
            assert out == ""  # refused before the plan, before the stale staging check
            assert staging_names(tmp_path) == held and not output.exists()
        (tmp_path / "release").touch()
        out, err = communicate(first, timeout=120)
    assert first.returncode == 0, err
    assert f"wrote {output}" in out
    assert (output / "model.safetensors").is_file()
    assert staging_names(tmp_path) == []  # the lock file too


def test_the_lock_of_a_killed_conversion_holds_nothing(tmp_path, capsys):
    """SIGKILL leaves the lock file and the staging directory: the kernel released the lock, and the next conversion
    takes it and removes the staging directory."""
    source = make_source(tmp_path / "source", "llama")
    output = tmp_path / "converted"
    with held_conversion(tmp_path, source, output) as first:
        first.kill()
        first.wait()
    left = staging_names(tmp_path)
    assert left[0] == ".converted.lock" and left[1].startswith(f".converted.tmp-{path_hf.locking.HOST}-")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", output)
    assert code == 0, err
    assert f"removed stale staging directory {tmp_path / left[1]} (" in out
    assert (output / "model.safetensors").is_file()
    assert staging_names(tmp_path) == []


def test_a_lock_file_removed_before_it_was_locked_is_made_anew(tmp_path, monkeypatch):
    """A process that opens the lock file just before its holder removes it (on the way out) then locks a file that
    nobody else finds: it must start again with a new one, or two conversions would both hold "the" lock."""
    output = tmp_path / "converted"
    lock = path_hf.conversion.staging.lock_file(output)
    flock, locked = fcntl.flock, []

    def flock_then_removed(fd, operation):
        flock(fd, operation)
        locked.append(os.fstat(fd))
        if len(locked) == 1:
            lock.unlink()  # what the previous holder does between this process's open and its lock

    monkeypatch.setattr(fcntl, "flock", flock_then_removed)
    with path_hf.conversion.staging.destination_lock(output):
        assert len(locked) == 2 and os.path.samestat(lock.stat(), locked[1])
        assert lock.read_text() == f"process {os.getpid()} on host {path_hf.locking.HOST}\n"
        with path_hf.conversion.staging.destination_lock(output):  # nested: shared (`gguf_source` inside `convert`)
            assert len(locked) == 2
        assert lock.exists()
    assert not lock.exists()


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
    host = path_hf.locking.HOST
    dead = [
        plant(tmp_path / f".converted.tmp-{host}-{finished_process_id()}-0123abcd"),
        plant(tmp_path / f".converted.gguf-{host}-{finished_process_id()}-4567cdef"),
    ]
    # A process that runs but holds no lock on the destination is not converting to it (its id was reused).
    unlocked = plant(tmp_path / f".converted.tmp-{host}-{running_process.pid}-89abcdef")
    kept = [plant(tmp_path / f".converted.gguf-{host}x-{finished_process_id()}-fedcba98")]  # another host's
    plant(tmp_path / f".other.tmp-{host}-{finished_process_id()}-0123abcd")  # another destination's

    # --dry-run names them all and removes nothing.
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 0, err
    for path in [*dead, unlocked]:
        assert f"stale staging directory {path} (" in out and "a conversion removes it" in out
    assert all(path.is_dir() for path in [*dead, unlocked, *kept])

    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 0, err
    for path in dead:
        assert not path.exists()
        line = next(line for line in out.splitlines() if str(path) in line)
        assert line.startswith("removed stale staging directory") and "which is no longer running" in line
    assert not unlocked.exists()
    line = next(line for line in out.splitlines() if str(unlocked) in line)
    assert line.startswith("removed stale staging directory") and "which holds no lock on the destination" in line
    warnings = [line for line in err.splitlines() if line.startswith("warning: left as it is: ")]
    assert len(warnings) == len(kept)
    for path, owner in zip(kept, ["on host"], strict=True):
        assert path.is_dir()
        assert any(str(path) in line and owner in line for line in warnings), (path, warnings)
    assert (tmp_path / "converted" / "model.safetensors").is_file()
    assert (tmp_path / "converted").is_dir() and len(staging_names(tmp_path)) == len(kept)
    assert len(staging_names(tmp_path, "other")) == 1


def test_small_model_on_a_small_file_system(tmp_path, capsys, monkeypatch):
    """The margin grows with the output: 740 KB converts with 1 MB free (a fixed 256 MiB margin refused it)."""
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 10**6))
    source = make_source(tmp_path / "source", "llama")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 0, err
    written = float(out.split("write:        ")[1].split(" KB")[0])  # the weights and tokenizer, code and card
    assert written == pytest.approx((528_820 + path_hf.conversion.plan.model_code_bytes()) / 1000, abs=0.01)
    assert path_hf.conversion.staging.disk_margin(10**12) == 256 * 2**20  # still 256 MiB for big models


def test_free_space_counts_stale_staging_and_names_what_other_conversions_hold(tmp_path, capsys, monkeypatch):
    source = make_source(tmp_path / "source", "llama")
    host = path_hf.locking.HOST
    stale = plant(tmp_path / f".converted.tmp-{host}-{finished_process_id()}-0123abcd", 600_000)
    # 740 KB to write + a 177 KB margin: short of 917 KB without the 600 KB of the dead process's directory.
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 400_000))
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 0, err
    assert stale.is_dir()

    held = plant(tmp_path / f".converted.tmp-{host}x-{finished_process_id()}-89abcdef", 400_000)  # another host's
    monkeypatch.setattr(path_hf.conversion.staging.shutil, "disk_usage", lambda path: usage(10**6, 0, 200_000))
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 1
    message = err.splitlines()[-1]
    assert (
        message.startswith("error: not enough free disk space") and " in stale staging directories to remove" in message
    )
    assert f"is held by staging directories of other conversions: {held.name}" in message


def test_a_dry_run_into_a_folder_it_cannot_write_runs(tmp_path, capsys, monkeypatch):
    """--dry-run writes nothing, so a destination folder without write permission (the lock file cannot be made
    there) is no reason to refuse it; a real conversion there is refused, naming the folder."""

    def read_only(path):
        raise PermissionError(13, "Permission denied", str(path))

    monkeypatch.setattr(path_hf.conversion.staging, "acquire_lock", read_only)
    source = make_source(tmp_path / "source", "llama")
    code, out, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted", "--dry-run")
    assert code == 0 and "write:" in out, err
    code, _, err = run_cli(capsys, "convert", "--from", source, "--to", tmp_path / "converted")
    assert code == 1 and "cannot open or create the lock file" in err and not (tmp_path / "converted").exists()
