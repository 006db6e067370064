# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoints, resuming and stopping in recipes/train.py: the run state a checkpoint keeps besides model, optimizer
and RNG states, saves that a kill midway cannot corrupt, the checks a resume makes before anything is loaded, the
refusal to start anew over an earlier run, and stopping at the end of a step on SIGTERM or Ctrl-C."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.utils import load as load_restricted  # torch.load(weights_only=True), numpy arrays allowed

from path_hf.atomic import replace_directory
from path_hf.errors import RecipeError
from path_hf.recipes.arguments import TrainingArguments


@dataclass
class RunState:
    """What a checkpoint keeps besides model, optimizer and RNG (`run_state.json`): the data position and the
    recovery log."""

    step: int = 0
    batches: int = 0  # micro-batches consumed per process (the data positions follow from step: batches_drawn)
    tokens: int = 0
    source_ppl: dict[str, float] = field(default_factory=dict)  # by eval length, e.g. "1x"
    history: list[dict] = field(default_factory=list)


RUN_STATE = "run_state.json"  # the last file a checkpoint gets
STAGING = ".partial"  # checkpoints/.step-NNNNNNNN.partial: a checkpoint being written


def step_dirs(output_dir: Path) -> list[Path]:
    """The `checkpoints/step-NNNNNNNN` directories, oldest first, complete or not."""
    return sorted(path for path in (output_dir / "checkpoints").glob("step-*") if path.is_dir())


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoints holding their run state, oldest first."""
    return [path for path in step_dirs(output_dir) if (path / RUN_STATE).is_file()]


def latest_checkpoint(output_dir: Path, accelerator: Accelerator) -> Path | None:
    """The newest complete checkpoint, saying which and naming the incomplete ones passed over (left by a save killed
    midway before saves were staged). The main process removes the staging directories of unfinished saves."""
    checkpoints = output_dir / "checkpoints"
    if accelerator.is_main_process:
        for staging in sorted(checkpoints.glob(f".step-*{STAGING}")):
            shutil.rmtree(staging)
            accelerator.print(f"removed {staging}: a checkpoint save that did not finish")
    incomplete, found = [], None
    for path in reversed(step_dirs(output_dir)):
        if (path / RUN_STATE).is_file() or any(path.glob("custom_checkpoint_*.pkl")):  # old format: refused later
            found = path
            break
        incomplete.append(path.name)
    if incomplete:
        accelerator.print(f"skipped incomplete checkpoint(s) {', '.join(incomplete)} in {checkpoints} (no {RUN_STATE})")
    accelerator.print(f"resuming from {found}" if found else f"no complete checkpoint in {checkpoints}: starting anew")
    return found


RUN_OUTPUTS = ("checkpoints", "logs", "final", "adapter", "recovery.json", "recovery.png")  # not `converted`


def check_output_dir(training: TrainingArguments, force: bool) -> list[Path]:
    """The outputs of an earlier run in `training.output_dir`, for `force` to delete. A new run over them, whose
    checkpoints and logs would mix with the old ones, is refused unless it resumes or is forced."""
    output_dir = Path(training.output_dir)
    existing = next(path for path in (output_dir, *output_dir.parents) if path.exists())
    if not existing.is_dir():
        raise RecipeError(f"training.output_dir {output_dir}: {existing} is a file, not a directory")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise RecipeError(f"training.output_dir {output_dir}: {existing} is not writable")
    found = [output_dir / name for name in RUN_OUTPUTS if (output_dir / name).exists()]
    if force and training.resume:
        raise RecipeError("--force deletes the checkpoints training.resume=true would continue from: give only one")
    if found and not training.resume and not force:
        raise RecipeError(
            f"training.output_dir {output_dir} holds an earlier run ({', '.join(path.name for path in found)}): "
            "continue it with training.resume=true, or start anew in a new or empty training.output_dir, or with "
            "--force (deletes those, keeps converted/)"
        )
    return found if force else []


def delete_earlier_run(outputs: list[Path], output_dir: Path, accelerator: Accelerator) -> None:
    """`--force`: the main process deletes the `outputs` of an earlier run (`check_output_dir`) before this one
    writes any; every process waits for it."""
    if outputs and accelerator.is_main_process:
        for path in outputs:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        accelerator.print(f"--force: deleted {', '.join(path.name for path in outputs)} of {output_dir}")
    accelerator.wait_for_everyone()


def save_checkpoint(accelerator: Accelerator, state: RunState, output_dir: Path, keep: int) -> Path:
    """`accelerator.save_state` (model, optimizer, each process's RNG states) and the run state as JSON into
    `checkpoints/.step-NNNNNNNN.partial`, which the main process renames to `step-NNNNNNNN` once every file is on
    disk: a save killed midway leaves the previous checkpoints as they were. Keeps the latest `keep` complete ones."""
    path = output_dir / "checkpoints" / f"step-{state.step:08d}"
    staging = path.with_name(f".{path.name}{STAGING}")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))  # every process writes its own RNG states
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / RUN_STATE).write_text(json.dumps(asdict(state)))
        # over an incomplete one of an earlier run, or this step saved again
        replace_directory(staging, path, old=path.with_name(f".{path.name}.old{STAGING}"), sync=True)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


class Checkpointer:
    """The run's checkpoints (`save_checkpoint`), remembering the step last saved: a stop or a failure needs the
    checkpoint of the current step, saved once."""

    def __init__(self, accelerator: Accelerator, state: RunState, output_dir: Path, keep: int):
        self.accelerator, self.state, self.output_dir, self.keep = accelerator, state, output_dir, keep
        self._saved: tuple[int, Path] | None = None

    def save(self) -> Path:
        path = save_checkpoint(self.accelerator, self.state, self.output_dir, self.keep)
        self._saved = (self.state.step, path)
        return path

    def ensure_saved(self) -> Path:
        """The checkpoint of the current step, saved now unless it already was."""
        if self._saved is not None and self._saved[0] == self.state.step:
            return self._saved[1]
        return self.save()


# What DeepSpeed writes beside its shards: the text file naming them, and conversion scripts a resume never runs.
DEEPSPEED_FILES = ("latest", "zero_to_fp32.py", "zero_to_torch.py")


def read_checkpoint(checkpoint: Path, accelerator: Accelerator) -> RunState:
    """The run state of `checkpoint`, read before any model is loaded, refusing a checkpoint that resuming from could
    run code or leave the RNG states behind: every file besides safetensors and JSON must load through accelerate's
    restricted loader (tensors, numbers, containers, numpy arrays), and there must be one RNG state file per process."""
    if pickled := sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
        raise RecipeError(
            f"{pickled[0]}: a pickled run state (what earlier versions of this recipe wrote) is not loaded, as a "
            "pickle can run code; this checkpoint cannot be resumed: start anew with --force or in a new "
            "training.output_dir"
        )
    for file in sorted(checkpoint.iterdir()):
        if file.is_dir() or file.suffix in (".safetensors", ".json") or file.name in DEEPSPEED_FILES:
            continue  # directories: engine shards (DeepSpeed), read by the engine's own loader
        try:
            load_restricted(file, map_location="cpu", mmap=True)
        except Exception as error:
            reason = (str(error).strip() or type(error).__name__).splitlines()[0]
            raise RecipeError(
                f"{file}: refused, it does not load as plain tensors and numbers (torch.load weights_only=True: "
                f"{reason}); resume only from checkpoints this recipe wrote"
            ) from error
    processes = len(list(checkpoint.glob("random_states_*.pkl")))
    if processes != accelerator.num_processes:
        raise RecipeError(
            f"{checkpoint}: written by {processes} process(es), this run has {accelerator.num_processes}; resume with "
            "the same number of processes (the data position and the RNG states are per process)"
        )
    try:
        return RunState(**json.loads((checkpoint / RUN_STATE).read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"{checkpoint / RUN_STATE}: not a run state of this recipe ({error})") from error


def restore_checkpoint(accelerator: Accelerator, checkpoint: Path) -> None:
    """`accelerator.load_state` of a checkpoint `read_checkpoint` accepted, refusing to go on if the RNG states were
    not restored (accelerate only logs that)."""
    accelerator.load_state(str(checkpoint))
    rng_file = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    saved = load_restricted(rng_file, map_location="cpu")
    torch_state = saved.get("torch_manual_seed") if isinstance(saved, dict) else None
    if not isinstance(torch_state, torch.Tensor) or not torch.equal(torch.get_rng_state(), torch_state):
        raise RecipeError(f"{rng_file}: its random states could not be restored; an exact resume needs them")


def all_processes(accelerator: Accelerator, flag: bool) -> bool:
    """True when `flag` is true on any process (so every process takes the same branch)."""
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum").item() > 0)


class Interrupted(Exception):
    """The run was stopped by SIGTERM or Ctrl-C after saving a checkpoint."""


class StopRequest:
    """While entered, SIGTERM and Ctrl-C set `signal` instead of stopping the process: the loop checkpoints at the
    end of the step and exits. The previous handlers come back on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.signal = signum


LAUNCHER_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")  # set by accelerate launch, by torchrun


def follow_launcher(poll_seconds: float = 1.0) -> None:
    """Under `accelerate launch` or torchrun, send this process SIGTERM when its launcher dies, so that it checkpoints
    and exits (`StopRequest`). accelerate's one-process launcher dies of a SIGTERM (from `kill`, `timeout`, a
    scheduler) without passing it on, and the training process would otherwise train on, re-parented; this also
    covers a launcher killed by SIGKILL. A script started from a shell keeps running when the shell exits (nohup)."""
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-launcher", daemon=True).start()
