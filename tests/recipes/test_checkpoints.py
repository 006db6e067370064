"""Checkpoints of recipes/train.py: resuming runs no code planted in a checkpoint and restores every RNG state; a save
killed midway leaves the complete checkpoints to resume from."""

import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator

from tests.recipes.recipe_runs import read_log, recipe_config, run_recipe, train


class PlantedCode:
    """A pickle that creates `marker` when it is unpickled without restrictions, and then reads as `value`."""

    def __init__(self, marker, value=None):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return eval, (f"[open({self.marker!r}, 'w').close(), {self.value!r}][1]",)


RUN_STATE = {"step": 2, "batches": 2, "tokens": 128, "source_ppl": {}, "history": []}


@pytest.fixture(scope="module")
def finished_run(tiny_source, tmp_path_factory):
    """A run of two steps with a checkpoint at step 2."""
    tmp_path = tmp_path_factory.mktemp("finished")
    config = recipe_config(tiny_source, tmp_path / "run", training={"save_every": 2})
    assert run_recipe(config, tmp_path) == 0
    return tmp_path / "run"


def test_a_checkpoint_holds_no_pickled_objects(finished_run):
    files = {path.name for path in (finished_run / "checkpoints" / "step-00000002").iterdir()}
    assert files == {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "run_state.json"}


def plant_old_format(checkpoint, marker):
    """A checkpoint as earlier versions wrote it (the issue's repro): the run state pickled by accelerate."""
    (checkpoint / "run_state.json").unlink(missing_ok=True)
    torch.save(PlantedCode(marker, RUN_STATE), checkpoint / "custom_checkpoint_0.pkl")


def plant_custom_state(checkpoint, marker):
    torch.save(PlantedCode(marker, RUN_STATE), checkpoint / "custom_checkpoint_0.pkl")


def plant_random_states(checkpoint, marker):
    torch.save({"random_state": PlantedCode(marker)}, checkpoint / "random_states_0.pkl")


def plant_optimizer(checkpoint, marker):
    torch.save(PlantedCode(marker), checkpoint / "optimizer.bin")


def unusable_random_states(checkpoint, marker):
    torch.save({"step": 2}, checkpoint / "random_states_0.pkl")  # loads, but accelerate cannot restore it


def more_processes(checkpoint, marker):
    shutil.copy(checkpoint / "random_states_0.pkl", checkpoint / "random_states_1.pkl")


@pytest.mark.parametrize(
    "tamper, message",
    [
        (plant_old_format, "custom_checkpoint_0.pkl: a pickled run state (what earlier versions of this recipe wrote)"),
        (plant_custom_state, "custom_checkpoint_0.pkl: a pickled run state"),
        (plant_random_states, "random_states_0.pkl: refused, it does not load as plain tensors and numbers"),
        (plant_optimizer, "optimizer.bin: refused, it does not load as plain tensors and numbers"),
        (unusable_random_states, "random_states_0.pkl: its random states could not be restored"),
        (more_processes, "written by 2 process(es), this run has 1; resume with the same number of processes"),
    ],
    ids=lambda value: getattr(value, "__name__", ""),
)
def test_resume_refuses_a_tampered_checkpoint_without_running_it(
    tiny_source, finished_run, tmp_path, capsys, tamper, message
):
    out, marker = tmp_path / "run", tmp_path / "marker"
    shutil.copytree(finished_run, out)
    tamper(out / "checkpoints" / "step-00000002", marker)
    config = recipe_config(tiny_source, out, training={"save_every": 2, "resume": True})
    exit_code = run_recipe(config, tmp_path)
    assert not marker.exists(), "resuming ran the code planted in the checkpoint"
    assert exit_code == 1
    error = capsys.readouterr().err
    assert message in error and "Traceback" not in error


class Killed(Exception):
    """The process dying in the middle of a checkpoint save."""


def test_a_save_killed_midway_leaves_the_complete_checkpoints_to_resume_from(
    tiny_source, tmp_path, monkeypatch, capsys
):
    out = tmp_path / "run"
    stages = [{"name": "lm", "tokens": 256, "learning_rate": 1e-3}]  # 4 steps of 64 tokens
    config = recipe_config(tiny_source, out, stages=stages, training={"save_every": 2, "keep_checkpoints": 1})
    save_state, saves = Accelerator.save_state, []

    def killed_at_the_second_save(self, output_dir, **kwargs):
        saves.append(output_dir)
        if len(saves) == 1:
            return save_state(self, output_dir, **kwargs)
        Path(output_dir).mkdir(parents=True, exist_ok=True)
        (Path(output_dir) / "model.safetensors").write_bytes(b"half written")
        raise Killed

    monkeypatch.setattr(Accelerator, "save_state", killed_at_the_second_save)
    with pytest.raises(Killed):
        run_recipe(config, tmp_path)
    monkeypatch.undo()
    checkpoints = out / "checkpoints"
    assert not (checkpoints / "step-00000004").exists()
    assert (checkpoints / "step-00000002" / "run_state.json").is_file()
    # What a save killed by an earlier version of the recipe left: an empty step directory, here newer than the rest.
    (checkpoints / "step-00000009").mkdir()
    capsys.readouterr()

    config["training"]["resume"] = True
    assert run_recipe(config, tmp_path) == 0
    output = capsys.readouterr().out
    assert "removed " + str(checkpoints / ".step-00000004.partial") in output
    assert f"skipped incomplete checkpoint(s) step-00000009 in {checkpoints}" in output
    assert f"resuming from {checkpoints / 'step-00000002'}" in output
    # The killed run logged steps 1-4; the resumed one continued after step 2.
    assert [entry["step"] for entry in read_log(out) if "train/lr" in entry] == [1, 2, 3, 4, 3, 4]
    # Only complete checkpoints count towards keep_checkpoints=1: step 4 is kept, the incomplete one left alone.
    assert sorted(path.name for path in checkpoints.iterdir()) == ["step-00000004", "step-00000009"]
    assert (checkpoints / "step-00000004" / "run_state.json").is_file()


def test_a_new_run_over_an_earlier_one_needs_resume_or_force(tiny_source, finished_run, tmp_path, capsys, monkeypatch):
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    before = sorted(path.relative_to(out) for path in out.rglob("*"))
    config = recipe_config(tiny_source, out, training={"save_every": 2})

    def no_model_loads(*args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train, "load_models", no_model_loads)
    assert run_recipe(config, tmp_path) == 1
    error = capsys.readouterr().err
    assert f"training.output_dir {out} holds an earlier run (checkpoints, logs, final, recovery.json" in error
    assert "training.resume=true" in error and "new or empty training.output_dir" in error and "--force" in error
    assert run_recipe(config, tmp_path, "--force", "training.resume=true") == 1
    assert "--force deletes the checkpoints training.resume=true would continue from" in capsys.readouterr().err
    assert sorted(path.relative_to(out) for path in out.rglob("*")) == before
    monkeypatch.undo()

    assert run_recipe(config, tmp_path, "--force") == 0
    assert "--force: deleted checkpoints, logs, final, recovery.json, recovery.png" in capsys.readouterr().out
    assert [entry["step"] for entry in read_log(out) if "train/lr" in entry] == [1, 2]  # a new log
    assert sorted(path.name for path in (out / "checkpoints").iterdir()) == ["step-00000002"]
