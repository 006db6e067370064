"""tests/processes.py, which every test that launches a program goes through: a hung program and whatever it started
are stopped at the timeout, each printing where its threads stand, and nothing of them is left running."""

import os
import sys
import textwrap
import time

import psutil
import pytest

from tests import processes

# A launcher with two workers, each with a second thread, all waiting forever (as the hung DDP rank did).
HUNG = """
    import subprocess, sys, threading, time

    def wait_forever():
        time.sleep(600)

    if sys.argv[1:]:
        threading.Thread(target=wait_forever).start()
        print(f"worker {sys.argv[1]} waiting", flush=True)
        wait_forever()
    else:
        workers = [subprocess.Popen([sys.executable, __file__, str(i)]) for i in range(2)]
        for worker in workers:
            worker.wait()
"""


def test_a_hung_program_is_stopped_whole_with_every_threads_traceback(tmp_path):
    script = tmp_path / "hung.py"
    script.write_text(textwrap.dedent(HUNG))
    with processes.group([sys.executable, str(script)], env=processes.environment()) as process:
        group = process.pid
        with pytest.raises(pytest.fail.Exception) as failure:
            processes.communicate(process, timeout=5)
    message = str(failure.value)
    assert "still running after 5 s" in message
    assert message.count("Fatal Python error: Aborted") == 3  # the launcher and both workers
    assert message.count("in wait_forever") == 4  # both threads of each worker
    assert "in wait\n" in message  # the launcher, in Popen.wait
    assert "worker 0 waiting" in message and "worker 1 waiting" in message
    assert not [p for p in psutil.process_iter() if _group_of(p) == group and _running(p)]


def test_a_program_that_finishes_is_run_as_subprocess_run_would(tmp_path):
    completed = processes.run([sys.executable, "-c", "import sys; print('out'); sys.exit(3)"], timeout=60)
    assert (completed.returncode, completed.stdout) == (3, "out\n")


def _running(process: psutil.Process) -> bool:
    """Alive and not a zombie (which a sandbox's init may never reap)."""
    try:
        return process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _group_of(process: psutil.Process) -> int | None:
    try:
        return os.getpgid(process.pid)
    except ProcessLookupError:
        return None


def test_a_hung_test_ends_pytest_with_every_threads_traceback(tmp_path):
    """tests/conftest.py's guard, for a test that hangs in pytest's own process (no program of its own to stop)."""
    (tmp_path / "conftest.py").write_text("from tests.conftest import hang_guard, pytest_configure  # noqa: F401\n")
    (tmp_path / "test_hung.py").write_text("import time\n\n\ndef test_hangs():\n    time.sleep(600)\n")
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path / "test_hung.py")]
    started = time.monotonic()
    completed = processes.run(
        command, timeout=120, cwd=processes.ROOT, env=processes.environment(PATH_HF_TEST_HUNG_AFTER="3")
    )
    assert completed.returncode != 0 and time.monotonic() - started < 60
    assert "Timeout" in completed.stderr and "in test_hangs" in completed.stderr
