"""The multi-process tests, again and again under load: `--runs` fresh pytest runs in a row of the DDP, FSDP2 and
two-process SIGTERM tests, `--copies` such sequences at once. A hang shows as a run stopped at `--timeout` with the
tracebacks of its processes (tests/processes.py); the summary counts the runs that failed or hung.

    python -m tests.stress --runs 20 --copies 2 [--log runs/stress]     (`make stress`)
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path

from tests import processes

TESTS = (
    "tests/recipes/test_launch.py::test_two_processes_finish_with_the_same_weights",
    "tests/recipes/test_launch.py::test_sigterm_to_two_processes_stops_both_at_one_step_and_ends_in_order",
    "tests/recipes/test_engines.py::test_sharded_engines_on_two_cpu_processes_clip_the_whole_gradient_like_ddp[fsdp2]",
)


def run_copy(copy: int, runs: int, timeout: float, log: Path, results: list[tuple[int, int, str, float]]) -> None:
    for run in range(1, runs + 1):
        started = time.monotonic()
        command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *TESTS]
        with processes.group(command, cwd=processes.ROOT, env=processes.environment()) as process:
            try:
                stdout, stderr = process.communicate(timeout=timeout)
                outcome = "passed" if process.returncode == 0 else f"failed ({process.returncode})"
            except subprocess.TimeoutExpired:  # a hang: stopped, its processes' tracebacks in the log
                processes.stop_group(process)
                stdout, stderr = process.communicate()
                outcome = "hung"
        seconds = time.monotonic() - started
        (log / f"copy{copy}-run{run:02d}.log").write_text(stdout + stderr)
        results.append((copy, run, outcome, seconds))
        print(f"copy {copy} run {run:2d}: {outcome} in {seconds:.0f} s", flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=20, help="pytest runs in a row per copy")
    parser.add_argument("--copies", type=int, default=2, help="sequences run at once (the load)")
    parser.add_argument("--timeout", type=float, default=600, help="seconds a pytest run may take before it is stopped")
    parser.add_argument("--log", type=Path, default=Path("runs/stress"), help="folder of each run's output")
    args = parser.parse_args()
    args.log.mkdir(parents=True, exist_ok=True)
    results: list[tuple[int, int, str, float]] = []
    threads = [
        threading.Thread(target=run_copy, args=(copy, args.runs, args.timeout, args.log, results))
        for copy in range(1, args.copies + 1)
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    bad = [result for result in results if result[2] != "passed"]
    seconds = sorted(result[3] for result in results)
    print(
        f"{len(results)} runs of {len(TESTS)} tests, {args.copies} at once: {len(results) - len(bad)} passed, "
        f"{sum(r[2] == 'hung' for r in results)} hung, {sum(r[2].startswith('failed') for r in results)} failed; "
        f"{seconds[0]:.0f} / {seconds[len(seconds) // 2]:.0f} / {seconds[-1]:.0f} s a run (min / median / max); "
        f"logs in {args.log}"
    )
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
