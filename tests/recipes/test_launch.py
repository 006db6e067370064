"""recipes/train.py as a program: two CPU processes under `accelerate launch`, and SIGTERM to it or to its launcher."""

import json
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests import processes
from tests.processes import environment
from tests.recipes.recipe_runs import ROOT, read_log, recipe_config, run_recipe, write_config


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def two_processes(config: Path) -> list[str]:
    """`accelerate launch` of the recipe on two CPU processes (gloo; with ACCELERATE_USE_CPU=1), through
    tests/recipes/teardown.py, which checks that the process group outlives the DDP model."""
    accelerate = Path(sys.executable).with_name("accelerate")
    return [
        str(accelerate), "launch", "--multi_gpu", "--num_processes", "2", "--num_machines", "1",
        "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()),
        "tests/recipes/teardown.py", "--config", str(config),
    ]  # fmt: skip


def test_two_processes_finish_with_the_same_weights(tiny_source, tmp_path):
    out = tmp_path / "run"
    stages = [
        {"name": "align", "tokens": 256, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 256, "learning_rate": 1e-2},
    ]
    config = write_config(
        recipe_config(tiny_source, out, stages=stages, training={"trainable": "attention"}), tmp_path / "recipe.yaml"
    )
    result = processes.run(two_processes(config), timeout=300, cwd=ROOT, env=environment(ACCELERATE_USE_CPU="1"))
    assert result.returncode == 0, result.stderr[-3000:]

    recovery = json.loads((out / "recovery.json").read_text())
    checksums = recovery["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    # 2 processes x 4 sequences x 16 tokens = 128 tokens a step: 2 steps per stage.
    assert recovery["final"] == {**recovery["final"], "step": 4, "tokens": 512}
    assert (out / "final" / "model.safetensors").is_file()


def wait_for_training(process: subprocess.Popen, out: Path) -> None:
    """Until `process` has logged its first training step; a test fails if it exits first, or does not get there in
    two minutes (its process group is then stopped, with tracebacks)."""
    deadline = time.monotonic() + 120
    while not ((out / "logs" / "recovery" / "log.jsonl").is_file() and any("train/lr" in e for e in read_log(out))):
        if process.poll() is not None:
            pytest.fail(f"exited with {process.returncode} before training: {process.stderr.read()[-3000:]}")
        if time.monotonic() > deadline:
            processes.communicate(process, timeout=0)
        time.sleep(0.2)


def test_sigterm_to_two_processes_stops_both_at_one_step_and_ends_in_order(tiny_source, tmp_path):
    """SIGTERM to the launcher of two processes, which passes it on: both stop at the end of the same step, save one
    checkpoint, and release the DDP model before the process group goes (tests/recipes/teardown.py checks it)."""
    out = tmp_path / "run"
    stages = [{"name": "lm", "tokens": 64 * 10_000, "learning_rate": 1e-3}]
    config = write_config(recipe_config(tiny_source, out, stages=stages), tmp_path / "recipe.yaml")
    with processes.group(two_processes(config), cwd=ROOT, env=environment(ACCELERATE_USE_CPU="1")) as launcher:
        wait_for_training(launcher, out)
        launcher.send_signal(signal.SIGTERM)
        _, stderr = processes.communicate(launcher, timeout=120)

    stops = [
        line.split("stopped by a signal at step ")[1].split(";")[0]
        for line in stderr.splitlines()
        if "stopped by a signal at step " in line
    ]
    assert len(stops) == 2 and stops[0] == stops[1], stderr[-3000:]
    assert "RuntimeError" not in stderr, stderr[-3000:]
    checkpoint = out / "checkpoints" / f"step-{int(stops[0]):08d}"
    assert (checkpoint / "run_state.json").is_file()
    assert sorted(path.name for path in checkpoint.glob("random_states_*.pkl")) == [
        "random_states_0.pkl",
        "random_states_1.pkl",
    ]


def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_source, tmp_path):
    out = tmp_path / "run"
    stages = [{"name": "lm", "tokens": 64 * 10_000, "learning_rate": 1e-3}]
    config = write_config(recipe_config(tiny_source, out, stages=stages), tmp_path / "recipe.yaml")
    with processes.group(
        [sys.executable, "recipes/train.py", "--config", str(config)], cwd=ROOT, env=environment()
    ) as process:
        wait_for_training(process, out)
        process.send_signal(signal.SIGTERM)
        _, stderr = processes.communicate(process, timeout=120)

    assert process.returncode == 130, stderr[-3000:]
    assert "Traceback" not in stderr
    stopped_at = int(stderr.split("stopped by a signal at step ")[1].split(";")[0])
    assert 1 <= stopped_at < 10_000
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "model.safetensors").is_file()


def test_sigterm_to_the_launcher_stops_training_with_a_checkpoint_to_resume_from(tiny_source, tmp_path):
    """What `kill`, `timeout` and job schedulers do: SIGTERM to `accelerate launch`, which dies of it at once."""
    out = tmp_path / "run"
    stages = [{"name": "lm", "tokens": 64 * 10_000, "learning_rate": 1e-3}]
    config = recipe_config(tiny_source, out, stages=stages)
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [
        str(accelerate), "launch", "--cpu", "--num_processes", "1", "--num_machines", "1", "--mixed_precision", "no",
        "--dynamo_backend", "no", "recipes/train.py", "--config", str(write_config(config, tmp_path / "recipe.yaml")),
    ]  # fmt: skip
    # On the way out, the group is killed: a train.py still training after its launcher died would be left there.
    with processes.group(command, cwd=ROOT, env=environment()) as launcher:
        wait_for_training(launcher, out)
        launcher.send_signal(signal.SIGTERM)
        # train.py writes to the launcher's stdout and stderr: they close when it has exited too.
        _, stderr = processes.communicate(launcher, timeout=60)
    # killed by the signal, or exited 128 + 15 where a handler in its imports caught it (once, in a full-suite run)
    assert launcher.returncode in (-signal.SIGTERM, 128 + signal.SIGTERM), launcher.returncode
    stopped_at = int(stderr.split("stopped by a signal at step ")[1].split(";")[0])
    assert (out / "checkpoints" / f"step-{stopped_at:08d}" / "run_state.json").is_file()

    config["stages"][0]["tokens"] = 64 * (stopped_at + 1)
    config["training"]["resume"] = True
    assert run_recipe(config, tmp_path) == 0
    assert [entry["step"] for entry in read_log(out) if "train/lr" in entry] == list(range(1, stopped_at + 2))


# A launcher of one worker that follows it (`follow_launcher`) the way `mode` says: "prctl" as on Linux, "poll" as
# where there is no prctl, "gone" with the launcher killed (SIGKILL) before prctl is set. The worker prints "SIGTERM"
# when it gets one.
FOLLOWING_WORKER = """
import os, signal, subprocess, sys, time

mode = sys.argv[1]
if sys.argv[2:] != ["worker"]:
    worker = subprocess.Popen([sys.executable, __file__, mode, "worker"])
    worker.wait()
    sys.exit(worker.returncode)

from path_hf.recipes import checkpoints

parent_death_signal = checkpoints.signal_on_parent_death
if mode == "poll":
    parent_death_signal = lambda signum: False
elif mode == "gone":
    def launcher_gone_first(signum):
        launcher = os.getppid()
        os.kill(launcher, signal.SIGKILL)
        while os.getppid() == launcher:
            time.sleep(0.01)
        return checkpoints.signal_on_parent_death(signum)
    parent_death_signal = launcher_gone_first

signal.signal(signal.SIGTERM, lambda signum, frame: (print("SIGTERM", flush=True), sys.exit(0)))
checkpoints.follow_launcher(poll_seconds=0.05, parent_death_signal=parent_death_signal)
print("following", flush=True)
time.sleep(120)
"""


@pytest.mark.parametrize("mode", ["prctl", "poll", "gone"])
def test_a_worker_gets_sigterm_when_its_launcher_is_killed(tmp_path, mode):
    script = tmp_path / "launcher.py"
    script.write_text(FOLLOWING_WORKER)
    env = environment(ACCELERATE_MIXED_PRECISION="no")
    with processes.group([sys.executable, str(script), mode], env=env) as launcher:
        assert launcher.stdout.readline() == ("SIGTERM\n" if mode == "gone" else "following\n")
        if mode != "gone":
            launcher.kill()
        # The worker writes to the launcher's stdout: it closes when the worker has exited too.
        stdout, stderr = processes.communicate(launcher, timeout=30)
    assert launcher.returncode == -signal.SIGKILL
    assert stdout == ("" if mode == "gone" else "SIGTERM\n"), stderr[-3000:]
