"""Programs the tests start (`accelerate launch`, the pipelines of examples/): each in a process group of its own,
killed whole when it outlives its time, after every Python process in it has printed where each of its threads
stands. A hung run then fails with those tracebacks instead of blocking the suite, and leaves no orphan behind."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import psutil
import pytest

# The seconds each process of a hung group gets to print its threads' tracebacks, one process at a time so that
# theirs do not interleave.
DUMP_SECONDS = 2.0


ROOT = Path(__file__).resolve().parent.parent


def environment(**extra: str) -> dict[str, str]:
    """This process's environment for a test's program, offline and on one thread, with `faulthandler` on: SIGABRT
    (what `stop_group` sends a hung program) prints every thread's traceback. Scripts under tests/ import `tests`."""
    return {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "HF_HUB_OFFLINE": "1",
        "HF_DATASETS_OFFLINE": "1",
        "OMP_NUM_THREADS": "1",
        "PYTHONFAULTHANDLER": "1",
        **extra,
    }


def start(command: Sequence[str], **kwargs) -> subprocess.Popen:
    """`subprocess.Popen(command)` as the leader of a new process group (holding the launcher and whatever it starts),
    with pipes for text output unless `kwargs` say otherwise."""
    kwargs = {"stdout": subprocess.PIPE, "stderr": subprocess.PIPE, "text": True, **kwargs}
    return subprocess.Popen(command, start_new_session=True, **kwargs)


def stop_group(process: subprocess.Popen) -> None:
    """End the process group that `process` leads. Every process in it is frozen first (SIGSTOP: a launcher cannot
    react to its workers' deaths meanwhile); then each in turn, the launched ones first, is sent SIGABRT and let go,
    printing its threads' tracebacks (`faulthandler`) as it dies; SIGKILL ends whatever is left of the group."""
    try:
        leader = psutil.Process(process.pid)
        members = [*leader.children(recursive=True)[::-1], leader]
        for member in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.suspend()
        for member in members:
            with contextlib.suppress(psutil.NoSuchProcess):
                member.send_signal(signal.SIGABRT)
                member.resume()
                _wait_for_death(member, DUMP_SECONDS)
    except psutil.NoSuchProcess:  # the leader has gone meanwhile
        pass
    finally:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)


def _wait_for_death(member: psutil.Process, seconds: float) -> None:
    """Until `member` has died (gone, or a zombie its frozen parent has not reaped), or `seconds` have passed."""
    deadline = time.monotonic() + seconds
    with contextlib.suppress(psutil.NoSuchProcess):
        while member.status() != psutil.STATUS_ZOMBIE and time.monotonic() < deadline:
            time.sleep(0.05)


def communicate(process: subprocess.Popen, timeout: float) -> tuple[str, str]:
    """`process.communicate(timeout)`; past the timeout, the whole group is stopped (`stop_group`) and the test fails
    with the end of what it printed, the tracebacks of the hung processes included."""
    try:
        return process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_group(process)
    stdout, stderr = process.communicate()
    pytest.fail(
        f"{' '.join(map(str, process.args[:3]))} ... still running after {timeout:.0f} s: stopped; its output ends "
        f"with\n{(stdout or '')[-2000:]}\n{(stderr or '')[-12000:]}",
        pytrace=False,
    )


@contextlib.contextmanager
def group(command: Sequence[str], **kwargs) -> Iterator[subprocess.Popen]:
    """`start(command)` for the block, which drives it; on the way out, whatever of its group still runs is
    killed (a process the launcher started and left running, a test that failed midway)."""
    process = start(command, **kwargs)
    try:
        yield process
    finally:
        if process.poll() is None:
            stop_group(process)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait()


def run(command: Sequence[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """`subprocess.run(command, capture_output=True, text=True, timeout=timeout)`, but in its own process group,
    stopped whole (with tracebacks) when it runs past `timeout`, failing the test."""
    with group(command, **kwargs) as process:
        stdout, stderr = communicate(process, timeout)
    return subprocess.CompletedProcess(process.args, process.returncode, stdout, stderr)
