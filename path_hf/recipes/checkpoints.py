# Copyright 2026 The path-hf authors. Apache-2.0.
"""Checkpoints, resuming and stopping in recipes/train.py: the run state a checkpoint keeps besides model, optimizer
and RNG states (with the config it was written with and the files it holds), saves that a kill midway cannot corrupt,
the checks a resume makes before anything is loaded (the checkpoint whole, its run state sound, the config unchanged),
the refusal to start anew over an earlier run, and stopping at the end of a step on SIGTERM or Ctrl-C
(`signals.StopRequest`)."""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import shutil
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field, fields, replace
from fnmatch import fnmatchcase
from pathlib import Path, PurePosixPath

import torch
from accelerate import Accelerator
from accelerate.utils import load as load_restricted  # torch.load(weights_only=True), numpy arrays allowed
from safetensors import SafetensorError, safe_open

from ..atomic import replace_directory
from ..errors import RecipeError, first_line
from ..locking import LockHeld, acquire_lock, release_lock
from .data import eval_length_names
from .schedule import StagePlan, planned_steps, tokens_before
from .settings import RecipeConfig, TrainingSettings, flatten


@dataclass
class RunState:
    """What a checkpoint keeps besides model, optimizer and RNG (`run_state.json`): the data position, the recovery
    log, and the config the run trains with (`recorded_config`), which a resume compares with its own."""

    step: int = 0
    batches: int = 0  # micro-batches consumed per process (the data positions follow from step: batches_drawn)
    tokens: int = 0
    source_ppl: dict[str, float] = field(default_factory=dict)  # by eval length, e.g. "1x"
    history: list[dict] = field(default_factory=list)  # {"step", "tokens", "ppl", "ratio"} per evaluation
    config: dict = field(default_factory=dict)
    model: dict = field(default_factory=dict)  # the fingerprint of the model trained (`model_fingerprint`)


def model_fingerprint(path: str | Path) -> dict:
    """What identifies the model a run trains, from a local checkpoint directory: a sha256 of its config and of its
    tensors' names, shapes and dtypes (read from the safetensors headers, not the weights). {} for anything else (a hub
    id, a GGUF file). A resume refuses a model whose fingerprint changed: another conversion of it (other layers,
    another RoPE mode) would load the checkpoint's weights into the wrong places, or fail to."""
    directory = Path(path)
    config_file = directory / "config.json"
    if not directory.is_dir() or not config_file.is_file():
        return {}
    config = json.loads(config_file.read_text())
    config.pop("path_conversion", None)  # where and when it was converted, not what
    tensors = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, "pt") as weights:
            for name in weights.keys():  # noqa: SIM118 (a safe_open handle is not a mapping)
                piece = weights.get_slice(name)
                tensors[name] = [piece.get_shape(), piece.get_dtype()]
    digest = hashlib.sha256(json.dumps([config, sorted(tensors.items())], sort_keys=True).encode()).hexdigest()
    return {"path": str(path), "sha256": digest}


def recorded_config(config: RecipeConfig) -> dict:
    """`config` as `run_state.json` records it: JSON values only."""
    return json.loads(json.dumps(asdict(config), default=str))


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
        if (path / RUN_STATE).is_file():
            found = path
            break
        incomplete.append(path.name)
    if incomplete:
        accelerator.print(f"skipped incomplete checkpoint(s) {', '.join(incomplete)} in {checkpoints} (no {RUN_STATE})")
    accelerator.print(f"resuming from {found}" if found else f"no complete checkpoint in {checkpoints}: starting anew")
    return found


RUN_OUTPUTS = ("checkpoints", "logs", "final", "adapter", "recovery.json", "recovery.png")  # not `converted`


def check_output_dir(training: TrainingSettings, force: bool) -> list[Path]:
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


# The lock of a training run on its output_dir: one run at a time writes there.
RUN_LOCK = ".lock"


@contextmanager
def output_dir_lock(output_dir: Path) -> Iterator[None]:
    """Hold `output_dir/.lock` for the block (`path_hf.locking`: released however the process ends), or refuse,
    naming the process that holds it: two runs in one folder would write the same checkpoints and logs. Taken by the
    launch's main process (RANK 0); the others run inside its lock. A folder made for the lock is removed again if the
    block leaves it empty."""
    if int(os.environ.get("RANK", "0")) != 0:
        yield
        return
    made = not output_dir.exists()
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / RUN_LOCK
    try:
        fd = acquire_lock(path)
    except LockHeld as held:
        raise RecipeError(
            f"training.output_dir {output_dir} is in use by another training run ({held.holder}): wait for it to "
            "end, or choose another training.output_dir"
        ) from None
    except OSError as error:
        raise RecipeError(f"training.output_dir {output_dir}: cannot create its lock file ({error.strerror})") from None
    try:
        yield
    finally:
        if fd is not None:
            release_lock(path, fd)
        if made and not any(output_dir.iterdir()):
            output_dir.rmdir()


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
        # what a resume checks before loading anything: the files as they were written, by how many processes
        record = {**asdict(state), "processes": accelerator.num_processes, "files": file_sizes(staging)}
        record["sha256"] = file_digests(staging)
        (staging / RUN_STATE).write_text(json.dumps(record))
        # over an incomplete one of an earlier run, or this step saved again
        replace_directory(staging, path, old=path.with_name(f".{path.name}.old{STAGING}"), sync=True)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


def file_sizes(checkpoint: Path) -> dict[str, int]:
    """Every file of `checkpoint` (in engine subdirectories too) by its relative path, with its size in bytes."""
    return {
        path.relative_to(checkpoint).as_posix(): path.stat().st_size
        for path in sorted(checkpoint.rglob("*"))
        if path.is_file() and path.name != RUN_STATE
    }


def file_digests(checkpoint: Path) -> dict[str, str]:
    """The sha256 of every file of `checkpoint` (but its run state), by relative path: a resume checks the contents
    against them, where the sizes alone miss bytes overwritten in place."""
    return {name: _sha256(checkpoint / name) for name in file_sizes(checkpoint)}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as stream:
        for chunk in iter(lambda: stream.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


class DamagedCheckpoint(RecipeError):
    """A checkpoint whose files are not as they were written (missing, resized, overwritten): a resume passes over it
    to the newest one before it that is whole (`readable_checkpoint`)."""


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
    run code, that is not whole, or that does not fit this run: its `run_state.json` must be sound (`parse_run_state`),
    written by as many processes as this run has, every file it lists present with the size and (where recorded) the
    sha256 it was written with, safetensors headers readable, and every file besides safetensors and JSON must load
    through accelerate's restricted loader (tensors, numbers, containers, numpy arrays). A file that is not as written
    raises `DamagedCheckpoint`. Only `accelerator.num_processes` is read."""
    state, processes, files, digests = parse_run_state(checkpoint / RUN_STATE)
    if processes != accelerator.num_processes:
        raise RecipeError(
            f"{checkpoint}: written by {processes} process(es), this run has {accelerator.num_processes}; resume with "
            "the same number of processes (the data position and the RNG states are per process)"
        )
    for name, size in files.items():
        path = checkpoint / name
        if not path.is_file():
            raise DamagedCheckpoint(f"{path}: missing (the checkpoint was written with it)")
        if path.stat().st_size != size:
            raise DamagedCheckpoint(f"{path}: damaged ({path.stat().st_size:,} bytes, {size:,} when written)")
        if name in digests and _sha256(path) != digests[name]:
            raise DamagedCheckpoint(f"{path}: damaged (its bytes differ from those written: another sha256)")
        if path.suffix == ".safetensors":
            try:
                with safe_open(path, "pt") as weights:
                    weights.keys()
            except (SafetensorError, OSError) as error:
                raise DamagedCheckpoint(f"{path}: damaged ({first_line(error)})") from error
    for file in sorted(checkpoint.iterdir()):
        if file.is_dir() or file.suffix in (".safetensors", ".json") or file.name in DEEPSPEED_FILES:
            continue  # directories: engine shards (DeepSpeed), read by the engine's own loader
        try:
            load_restricted(file, map_location="cpu", mmap=True)
        except Exception as error:
            raise RecipeError(
                f"{file}: refused, it does not load as plain tensors and numbers (torch.load weights_only=True: "
                f"{first_line(error)}); resume only from checkpoints this recipe wrote"
            ) from error
    return state


def check_same_model(checkpoint: Path, saved: RunState, student: str) -> None:
    """Refuse to resume `checkpoint` into a model other than the one it trained (`model_fingerprint`): weights trained
    under one conversion would go on training under another, or fail to load."""
    if saved.model and model_fingerprint(student).get("sha256") != saved.model.get("sha256"):
        raise RecipeError(
            f"{checkpoint} trained another model than the one at {student} now (its config or its tensors changed "
            "since: converted again?); resume with the model it trained, or start anew with --force or in a new "
            "training.output_dir"
        )


def readable_checkpoint(checkpoint: Path, accelerator: Accelerator) -> tuple[Path, RunState]:
    """`checkpoint` and its run state (`read_checkpoint`), or, where it is damaged, the newest complete checkpoint
    before it that is not, saying which it passed over and why. Refused when none is whole."""
    earlier = [path for path in complete_checkpoints(checkpoint.parent.parent) if path.name < checkpoint.name]
    damaged: list[DamagedCheckpoint] = []
    for candidate in [checkpoint, *reversed(earlier)]:
        try:
            state = read_checkpoint(candidate, accelerator)
        except DamagedCheckpoint as error:
            damaged.append(error)
            continue
        for error in damaged:
            accelerator.print(f"warning: passed over {error}", file=sys.stderr)
        if damaged:
            accelerator.print(f"resuming from {candidate} instead, the newest checkpoint that is whole")
        return candidate, state
    raise RecipeError(
        f"{damaged[0]}; no earlier checkpoint is whole either: start anew with --force (or delete {checkpoint.parent})"
    )


def _instead(checkpoint: Path) -> str:
    """What to do instead of resuming from a damaged `checkpoint`: the earlier complete ones, if any."""
    earlier = [path.name for path in complete_checkpoints(checkpoint.parent.parent) if path.name < checkpoint.name]
    if earlier:
        return (
            f"delete {checkpoint} to resume from {earlier[-1]}, the latest before it (complete checkpoints: "
            f"{', '.join(earlier)})"
        )
    return f"there is no earlier checkpoint: start anew with --force (or delete {checkpoint})"


RUN_STATE_FIELDS = tuple(option.name for option in fields(RunState)) + ("processes", "files", "sha256")
OPTIONAL_FIELDS = ("model", "sha256")  # not written by earlier versions
HISTORY_FIELDS = ("step", "tokens", "ppl", "ratio")


def parse_run_state(path: Path) -> tuple[RunState, int, dict[str, int], dict[str, str]]:
    """`run_state.json` read as untrusted input: the run state, the number of processes that wrote the checkpoint, and
    its files' sizes and sha256 digests, every field of the type it must have; a `RecipeError` names the file and the
    field."""
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as error:
        raise RecipeError(f"{path}: not a run state of this recipe ({first_line(error)})") from error
    if not isinstance(record, dict):
        raise RecipeError(f"{path}: not a run state of this recipe (not a JSON object)")
    if "config" not in record:
        raise RecipeError(
            f"{path}: written by an earlier version of this recipe, which recorded no config to compare this run's "
            "with: resume it with that version, or start anew with --force or in a new training.output_dir"
        )
    unknown = sorted(set(record) - set(RUN_STATE_FIELDS))
    missing = [k for k in RUN_STATE_FIELDS if k not in record and k not in OPTIONAL_FIELDS]
    if unknown or missing:
        raise RecipeError(f"{path}: not a run state of this recipe (unknown: {unknown}, missing: {missing})")

    def expect(name: str, value, valid: bool, kind: str) -> None:
        if not valid:
            shown = json.dumps(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise RecipeError(
                f"{path}: {name} must be {kind}, got {shown}; resume only from checkpoints this recipe wrote"
            )

    for name in ("step", "batches", "tokens"):
        expect(name, record[name], _is_count(record[name]), "an integer >= 0")
    expect(
        "processes", record["processes"], _is_count(record["processes"]) and record["processes"] >= 1, "an integer >= 1"
    )
    files = record["files"]
    expect("files", files, isinstance(files, dict) and all(_is_count(size) for size in files.values()), "sizes by file")
    for name in files:
        inside = not PurePosixPath(name).is_absolute() and ".." not in PurePosixPath(name).parts
        expect(f"files[{name!r}]", name, inside and name != "", "a path inside the checkpoint")
    expect("source_ppl", record["source_ppl"], _is_scores(record["source_ppl"]), "numbers by evaluation length")
    history = record["history"]
    expect("history", history, isinstance(history, list) and bool(history), "a list of evaluations")
    for i, entry in enumerate(history):
        expect(
            f"history.{i}", entry, isinstance(entry, dict) and sorted(entry) == sorted(HISTORY_FIELDS), "an evaluation"
        )
        for name in ("step", "tokens"):
            expect(f"history.{i}.{name}", entry[name], _is_count(entry[name]), "an integer >= 0")
        for name in ("ppl", "ratio"):
            expect(f"history.{i}.{name}", entry[name], _is_scores(entry[name]), "numbers by evaluation length")
    expect("config", record["config"], isinstance(record["config"], dict), "a mapping")
    digests = record.get("sha256", {})
    sound = isinstance(digests, dict) and set(digests) <= set(files)
    sound = sound and all(isinstance(value, str) and len(value) == 64 for value in digests.values())
    expect("sha256", digests, sound, "sha256 digests by file")
    model = record.get("model", {})
    expect("model", model, isinstance(model, dict) and all(isinstance(v, str) for v in model.values()), "a model")
    names = [name for name in RUN_STATE_FIELDS if name not in ("processes", "files", "sha256") and name in record]
    state = RunState(**{name: record[name] for name in names})
    return state, record["processes"], files, digests


def _is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _is_scores(value) -> bool:
    return isinstance(value, dict) and all(
        isinstance(score, (int, float)) and not isinstance(score, bool) for score in value.values()
    )


# The fields a resume may change (patterns of the flattened names): where the run lives, how often it evaluates, logs
# and saves, when it stops early, and how it computes (not what). Any other field changes the data position, the
# schedule of the steps taken, the model, what trains or what the recorded evaluations mean; of those, only the last
# stage's tokens may change (`check_resume`).
RESUME_MAY_CHANGE = (
    "training.output_dir",
    "training.resume",
    "training.activation_checkpointing",
    "training.eval_every",
    "training.eval_batch_size",
    "training.target_ratio",
    "training.log_every",
    "training.log_with",
    "training.save_every",
    "training.keep_checkpoints",
    "stages.*.activation_checkpointing",
)


def may_change(name: str) -> bool:
    """Whether the flattened config field `name` may change on resume: it matches one of `RESUME_MAY_CHANGE`."""
    return any(fnmatchcase(name, pattern) for pattern in RESUME_MAY_CHANGE)


def check_resume(checkpoint: Path, saved: RunState, config: RecipeConfig, stages: list[StagePlan]) -> RunState:
    """The run state `saved` (`read_checkpoint`) continued under `config`, whose stages are planned as `stages`:
    refused, naming every field, where `config` differs from the config the checkpoint was written with in more than
    `RESUME_MAY_CHANGE` and the last stage's tokens, and where the step, data position, tokens and evaluations of
    `saved` are not those the plan gives (a run state edited, or the last stage made to end before the step reached)."""
    path, current = checkpoint / RUN_STATE, recorded_config(config)
    old, new = flatten(saved.config), flatten(current)
    last_tokens = f"stages.{len(config.stages) - 1}.tokens"
    changes = [
        f"{name} {_shown(old, name)} -> {_shown(new, name)}"
        for name in dict.fromkeys([*old, *new])
        if not may_change(name)
        and old.get(name, _UNSET) != new.get(name, _UNSET)
        and not (name == last_tokens and _is_count(old.get(name)))  # checked against the step reached below
    ]
    if changes:
        raise RecipeError(
            f"{checkpoint} was written with another config: {', '.join(changes)}; resume with the config it was "
            "written with (recipes/README.md says which fields may change), or start anew with --force or in a new "
            "training.output_dir"
        )
    total = planned_steps(stages)
    if saved.step > total:
        last = stages[-1]
        if old[last_tokens] != new[last_tokens]:
            needed = (saved.step - last.first_step) * last.tokens_per_step
            raise RecipeError(
                f"{last_tokens} {new[last_tokens]} ends the run at step {total}, before step {saved.step}, which "
                f"{checkpoint} reached: give it at least {needed} (a resume may make the last stage longer or shorter, "
                "not end before the step reached)"
            )
        raise RecipeError(
            f"{path}: step {saved.step} is past the end of the run ({total} steps); resume only from checkpoints this "
            "recipe wrote"
        )

    def expect(name: str, value, expected) -> None:
        if value != expected:
            raise RecipeError(
                f"{path}: {name} is {value}, step {saved.step} of this config gives {expected}; resume only from "
                "checkpoints this recipe wrote"
            )

    expect("batches", saved.batches, saved.step * config.training.gradient_accumulation_steps)
    expect("tokens", saved.tokens, tokens_before(stages, saved.step))
    lengths = list(eval_length_names(config.training.eval_lengths).values())
    expect("source_ppl's lengths", sorted(saved.source_ppl), sorted(lengths) if saved.source_ppl else [])
    steps = [entry["step"] for entry in saved.history]
    expect("history's first step", steps[0], 0)
    expect("history's last step", max(steps[-1], saved.step), saved.step)  # never an evaluation ahead of the run
    expect("history's order of steps", steps, sorted(steps))
    for i, entry in enumerate(saved.history):
        expect(f"history.{i}.tokens", entry["tokens"], tokens_before(stages, entry["step"]))
        expect(f"history.{i}.ppl's lengths", sorted(entry["ppl"]), sorted(lengths))
        expect(f"history.{i}.ratio's lengths", sorted(entry["ratio"]), sorted(saved.source_ppl))
    return replace(saved, config=current)


_UNSET = object()


def _shown(values: dict, name: str) -> str:
    return json.dumps(values[name]) if name in values else "(unset)"


def restore_checkpoint(accelerator: Accelerator, checkpoint: Path) -> None:
    """`accelerator.load_state` of a checkpoint `read_checkpoint` accepted, refusing to go on if the RNG states were
    not restored (accelerate only logs that). What the checks before could not see (tensors that do not fit the model,
    damage inside a file of the right size) fails naming the checkpoint."""
    try:
        accelerator.load_state(str(checkpoint))
    except (OSError, RuntimeError, ValueError, KeyError) as error:
        raise RecipeError(
            f"{checkpoint}: cannot be loaded ({first_line(error)}); if the model at model.path is the one it trained, "
            f"the checkpoint is damaged: {_instead(checkpoint)}"
        ) from error
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


LAUNCHER_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")  # set by accelerate launch, by torchrun


def follow_launcher(poll_seconds: float = 1.0, parent_death_signal: Callable[[int], bool] | None = None) -> None:
    """Under `accelerate launch` or torchrun, have this process sent SIGTERM when its launcher dies, so that it
    checkpoints and exits (`StopRequest`). accelerate's one-process launcher dies of a SIGTERM (from `kill`, `timeout`,
    a scheduler) without passing it on, and the training process would otherwise train on, re-parented; this also
    covers a launcher killed by SIGKILL. A script started from a shell keeps running when the shell exits (nohup).

    On Linux the kernel sends the signal (`prctl(PR_SET_PDEATHSIG)`) when the thread that started this process exits:
    these launchers start their workers from their main thread, so when the launcher exits. A launcher gone before
    that was set is seen by the parent having changed since. Where there is no `prctl`, a daemon thread looks for a new
    parent every `poll_seconds`. `parent_death_signal`: what asks for the signal, `signal_on_parent_death` unless
    given (a test's stand-in: no `prctl`, or the launcher killed first)."""
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    launcher = os.getppid()
    if (parent_death_signal or signal_on_parent_death)(signal.SIGTERM):
        if os.getppid() != launcher:  # the launcher died before the kernel was told to signal its death
            os.kill(os.getpid(), signal.SIGTERM)
        return

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-launcher", daemon=True).start()


PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def signal_on_parent_death(signum: int) -> bool:
    """Have Linux send this process `signum` when the thread of its parent that started it exits
    (`prctl(PR_SET_PDEATHSIG)`; the processes it forks do not inherit it). False where there is no `prctl`."""
    if sys.platform != "linux":
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, signum, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_PDEATHSIG) failed")
    return True
