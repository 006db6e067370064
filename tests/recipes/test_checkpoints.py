"""Checkpoints of recipes/train.py: resuming runs no code planted in a checkpoint, restores every RNG state, refuses a
checkpoint that is not whole, a run state that is not sound and a config that changed, naming the file or every field;
a save killed midway leaves the complete checkpoints to resume from."""

import json
import shutil
from pathlib import Path

import pytest
import torch
from accelerate import Accelerator
from safetensors.torch import load_file

from path_hf.recipes.checkpoints import file_digests, file_sizes, recorded_config
from tests.recipes.recipe_runs import parse_config, read_log, recipe_config, run_recipe, train, write_config


class PlantedCode:
    """A pickle that creates `marker` when it is unpickled without restrictions, and then reads as `value`."""

    def __init__(self, marker, value=None):
        self.marker, self.value = str(marker), value

    def __reduce__(self):
        return eval, (f"[open({self.marker!r}, 'w').close(), {self.value!r}][1]",)


RUN_STATE = {"step": 2, "batches": 2, "tokens": 128, "source_ppl": {}, "history": []}


@pytest.fixture(scope="module")
def finished_run(tiny_source, tmp_path_factory):
    """A run of two steps with checkpoints at steps 1 and 2."""
    tmp_path = tmp_path_factory.mktemp("finished")
    config = recipe_config(tiny_source, tmp_path / "run", training={"save_every": 1})
    assert run_recipe(config, tmp_path) == 0
    return tmp_path / "run"


def edit_run_state(checkpoint: Path, **fields) -> None:
    """Set `fields` in the checkpoint's run_state.json, and record its files as they are now (as someone who planted a
    file and knew the format would)."""
    path = checkpoint / "run_state.json"
    recorded = {"files": file_sizes(checkpoint), "sha256": file_digests(checkpoint)}
    path.write_text(json.dumps({**json.loads(path.read_text()), **recorded, **fields}))


def test_a_checkpoint_holds_no_pickled_objects_and_records_its_config_and_files(tiny_source, finished_run, tmp_path):
    checkpoint = finished_run / "checkpoints" / "step-00000002"
    files = {path.name for path in checkpoint.iterdir()}
    assert files == {"model.safetensors", "optimizer.bin", "random_states_0.pkl", "run_state.json"}
    run_state = json.loads((checkpoint / "run_state.json").read_text())
    config = recipe_config(tiny_source, finished_run, training={"save_every": 1})
    assert run_state["config"] == recorded_config(parse_config(["--config", str(write_config(config, tmp_path / "r"))]))
    assert run_state["processes"] == 1
    assert run_state["files"] == {name: (checkpoint / name).stat().st_size for name in files - {"run_state.json"}}


def plant_custom_state(checkpoint, marker):
    """A pickle beside the files the run state lists, named as accelerate names a registered object's state."""
    torch.save(PlantedCode(marker, RUN_STATE), checkpoint / "custom_checkpoint_0.pkl")


def plant_random_states(checkpoint, marker):
    torch.save({"random_state": PlantedCode(marker)}, checkpoint / "random_states_0.pkl")
    edit_run_state(checkpoint)


def plant_optimizer(checkpoint, marker):
    torch.save(PlantedCode(marker), checkpoint / "optimizer.bin")
    edit_run_state(checkpoint)


def unusable_random_states(checkpoint, marker):
    torch.save({"step": 2}, checkpoint / "random_states_0.pkl")  # loads, but accelerate cannot restore it
    edit_run_state(checkpoint)


def more_processes(checkpoint, marker):
    shutil.copy(checkpoint / "random_states_0.pkl", checkpoint / "random_states_1.pkl")
    edit_run_state(checkpoint, processes=2)


@pytest.mark.parametrize(
    "tamper, message",
    [
        (plant_custom_state, "custom_checkpoint_0.pkl: refused, it does not load as plain tensors and numbers"),
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
    # The killed run logged steps 1-4; the resumed one dropped the entries after step 2 and logged 3 and 4 again.
    assert [entry["step"] for entry in read_log(out) if "train/lr" in entry] == [1, 2, 3, 4]
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


def tree(directory: Path) -> dict[str, bytes]:
    return {str(path.relative_to(directory)): path.read_bytes() for path in directory.rglob("*") if path.is_file()}


@pytest.fixture
def resumed_run(finished_run, tmp_path, monkeypatch):
    """A copy of `finished_run` to resume, where loading a model fails the test."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)

    def no_model_loads(*args):
        raise AssertionError("a model was loaded")

    monkeypatch.setattr(train, "load_models", no_model_loads)
    return out


def refused_resume(tiny_source, out, tmp_path, capsys, *overrides) -> str:
    """The one-line error of a resume in `out` (`resumed_run`), which must change nothing there."""
    before = tree(out)
    config = recipe_config(tiny_source, out, training={"save_every": 1, "resume": True})
    assert run_recipe(config, tmp_path, *overrides) == 1
    error = capsys.readouterr().err
    assert error.startswith("error: ") and len(error.splitlines()) == 1, error
    assert tree(out) == before
    return error


def truncated(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:1000])


def garbage(path: Path) -> None:
    path.write_bytes(b"\x07" * path.stat().st_size)


def overwritten(path: Path) -> None:
    """Bytes changed in place past the header: the size and the header as written."""
    data = bytearray(path.read_bytes())
    data[-64:] = b"\x7f" * 64
    path.write_bytes(bytes(data))


@pytest.mark.parametrize(
    "file, damage, problem",
    [
        ("model.safetensors", truncated, "damaged (1,000 bytes, "),
        ("model.safetensors", garbage, "damaged (its bytes differ from those written: another sha256)"),
        ("model.safetensors", overwritten, "damaged (its bytes differ from those written: another sha256)"),
        ("optimizer.bin", Path.unlink, "missing (the checkpoint was written with it)"),
        ("random_states_0.pkl", Path.unlink, "missing (the checkpoint was written with it)"),
    ],
    ids=["truncated-weights", "garbage-weights", "overwritten-weights", "no-optimizer", "no-random-states"],
)
def test_resume_passes_over_a_damaged_checkpoint_to_the_newest_whole_one(
    tiny_source, finished_run, tmp_path, capsys, file, damage, problem
):
    """A damaged newest checkpoint is named and passed over; the run resumes from the one before it and ends with the
    weights of the run that was never interrupted."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    checkpoints = out / "checkpoints"
    damage(checkpoints / "step-00000002" / file)
    config = recipe_config(tiny_source, out, training={"save_every": 1, "resume": True})
    capsys.readouterr()
    assert run_recipe(config, tmp_path) == 0
    captured = capsys.readouterr()
    assert f"warning: passed over {checkpoints / 'step-00000002' / file}: {problem}" in captured.err, captured.err
    assert f"resuming from {checkpoints / 'step-00000001'} instead, the newest checkpoint that is whole" in captured.out
    final, expected = (load_file(run / "final" / "model.safetensors") for run in (out, finished_run))
    assert all(torch.equal(final[name], expected[name]) for name in expected)


def test_a_damaged_only_checkpoint_says_to_start_anew(tiny_source, resumed_run, tmp_path, capsys):
    checkpoints = resumed_run / "checkpoints"
    shutil.rmtree(checkpoints / "step-00000001")
    (checkpoints / "step-00000002" / "optimizer.bin").unlink()
    error = refused_resume(tiny_source, resumed_run, tmp_path, capsys)
    assert error.startswith(f"error: {checkpoints / 'step-00000002' / 'optimizer.bin'}: missing"), error
    assert error.endswith(f"no earlier checkpoint is whole either: start anew with --force (or delete {checkpoints})\n")


@pytest.mark.parametrize(
    "edit, message",
    [
        ({"step": -5}, "run_state.json: step must be an integer >= 0, got -5"),
        ({"step": "2"}, 'run_state.json: step must be an integer >= 0, got "2"'),
        ({"step": 1_000_000}, "run_state.json: step 1000000 is past the end of the run (2 steps)"),
        ({"step": 1}, "run_state.json: batches is 2, step 1 of this config gives 1"),
        ({"tokens": 5}, "run_state.json: tokens is 5, step 2 of this config gives 128"),
        ({"batches": 3}, "run_state.json: batches is 3, step 2 of this config gives 2"),
        ({"processes": 0}, "run_state.json: processes must be an integer >= 1, got 0"),
        ({"files": {"../../recipe.yaml": 1}}, "run_state.json: files['../../recipe.yaml'] must be a path inside"),
        ({"source_ppl": [1.0]}, "run_state.json: source_ppl must be numbers by evaluation length, got [1.0]"),
        ({"source_ppl": {"1x": 5.0}}, "run_state.json: source_ppl's lengths is ['1x'], step 2 of this config gives"),
        ({"history": []}, "run_state.json: history must be a list of evaluations, got []"),
        ({"history": [{"step": 0}]}, "run_state.json: history.0 must be an evaluation"),
        ({"history": [{"step": 0, "tokens": 0, "ppl": {"1x": "low"}, "ratio": {}}]}, "history.0.ppl must be numbers"),
        ({"history": [{"step": 0, "tokens": 0, "ppl": {"3x": 1.0}, "ratio": {}}]}, "history.0.ppl's lengths is"),
        ({"history": [{"step": 9, "tokens": 0, "ppl": {}, "ratio": {}}]}, "history's first step is 9"),
        ({"config": []}, "run_state.json: config must be a mapping"),
        (
            {"config": None, "extra": 1},
            "run_state.json: not a run state of this recipe (unknown: ['extra'], missing: [])",
        ),
        (None, "run_state.json: written by an earlier version of this recipe, which recorded no config"),
        ("{", "run_state.json: not a run state of this recipe (Expecting property name"),
    ],
    ids=[
        "negative-step",
        "string-step",
        "step-past-the-run",
        "step-without-its-batches",
        "tokens",
        "batches",
        "no-processes",
        "file-outside",
        "source-ppl-type",
        "source-ppl-lengths",
        "empty-history",
        "history-entry",
        "history-ppl-type",
        "history-ppl-lengths",
        "history-first-step",
        "config-type",
        "unknown-field",
        "earlier-version",
        "not-json",
    ],
)
def test_resume_refuses_a_run_state_that_is_not_sound_naming_the_field(
    tiny_source, resumed_run, tmp_path, capsys, edit, message
):
    path = resumed_run / "checkpoints" / "step-00000002" / "run_state.json"
    record = json.loads(path.read_text())
    if edit is None:  # as earlier versions wrote it
        text = json.dumps({name: record[name] for name in ("step", "batches", "tokens", "source_ppl", "history")})
    else:
        text = edit if isinstance(edit, str) else json.dumps({**record, **edit})
    path.write_text(text)
    error = refused_resume(tiny_source, resumed_run, tmp_path, capsys)
    assert f"error: {path.parent}/" in error and message in error


@pytest.mark.parametrize(
    "overrides, changes",
    [
        (["training.batch_size=2"], "training.batch_size 4 -> 2"),
        (["data.block_size=32"], "data.block_size 16 -> 32"),
        (["training.trainable=full"], 'training.trainable "path" -> "full"'),
        (["training.eval_lengths=[1]"], "training.eval_lengths [1, 2] -> [1]"),
        (
            [
                "training.eval_lengths=[1]",
                "model.convert.rope=keep",
                "stages.0.learning_rate=1e-2",
                "data.streaming=true",
            ],
            'model.convert.rope "drop" -> "keep", data.streaming false -> true, stages.0.learning_rate 0.001 -> 0.01, '
            "training.eval_lengths [1, 2] -> [1]",
        ),
        (
            ["stages=[{name: lm, tokens: 128, learning_rate: 1e-3}, {name: lm, tokens: 64, learning_rate: 1e-3}]"],
            'stages.1.name (unset) -> "lm", stages.1.tokens (unset) -> 64',
        ),
    ],
    ids=["batch_size", "block_size", "trainable", "eval_lengths", "four-fields", "a-stage-added"],
)
def test_resume_after_a_config_change_names_every_field_that_changed(
    tiny_source, resumed_run, tmp_path, capsys, overrides, changes
):
    error = refused_resume(tiny_source, resumed_run, tmp_path, capsys, *overrides)
    checkpoint = resumed_run / "checkpoints" / "step-00000002"
    assert error.startswith(f"error: {checkpoint} was written with another config: {changes}")
    assert "resume with the config it was written with" in error


def test_resume_may_change_the_cadence_the_output_dir_and_the_last_stage_tokens(
    tiny_source, finished_run, tmp_path, capsys
):
    moved = tmp_path / "moved"
    shutil.copytree(finished_run, moved)
    cadence = {
        "resume": True,
        "eval_every": 1,
        "eval_batch_size": 2,
        "log_every": 2,
        "save_every": 3,
        "keep_checkpoints": 5,
        "target_ratio": 1e-3,
        "activation_checkpointing": True,
    }
    longer = [{"name": "lm", "tokens": 256, "learning_rate": 1e-3}]  # 4 steps where it had 2
    config = recipe_config(tiny_source, moved, stages=longer, training=cadence)
    assert run_recipe(config, tmp_path) == 0
    assert [entry["step"] for entry in read_log(moved) if "train/lr" in entry] == [1, 2, 4]
    recovery = json.loads((moved / "recovery.json").read_text())
    assert [entry["step"] for entry in recovery["history"]] == [0, 3, 4]  # step 2 saved before its evaluation
    assert recovery["final"]["tokens"] == 256
    checkpoint = moved / "checkpoints" / "step-00000004"
    assert json.loads((checkpoint / "run_state.json").read_text())["config"]["stages"][0]["tokens"] == 256
    capsys.readouterr()

    config["stages"][0]["tokens"] = 64  # ends before the step reached
    assert run_recipe(config, tmp_path) == 1
    assert capsys.readouterr().err == (
        f"error: stages.0.tokens 64 ends the run at step 1, before step 4, which {checkpoint} reached: give it at "
        "least 256 (a resume may make the last stage longer or shorter, not end before the step reached)\n"
    )


def test_a_second_run_in_an_output_dir_in_use_is_refused_naming_the_first(tiny_source, finished_run, tmp_path, capsys):
    """While one run holds its output_dir (its lock, as every run does while it trains), another one there, resuming
    or not, is refused before it writes anything, and the holder is named; once the first ends, it runs."""
    import os

    from path_hf.locking import acquire_lock, release_lock

    run_dir = tmp_path / "run"
    shutil.copytree(finished_run, run_dir)
    config = recipe_config(tiny_source, run_dir, training={"save_every": 1, "resume": True})
    before = {path: path.stat().st_mtime_ns for path in run_dir.rglob("*")}
    fd = acquire_lock(run_dir / ".lock")
    try:
        capsys.readouterr()
        assert run_recipe(config, tmp_path) == 1
        err = capsys.readouterr().err.strip().splitlines()[-1]
        assert f"is in use by another training run (process {os.getpid()} on host " in err, err
        assert {path: path.stat().st_mtime_ns for path in run_dir.rglob("*") if path.name != ".lock"} == before
    finally:
        release_lock(run_dir / ".lock", fd)
    assert run_recipe(config, tmp_path) == 0 and not (run_dir / ".lock").exists()


def test_resume_refuses_a_model_that_changed_under_the_run(tiny_source, finished_run, tmp_path, capsys):
    """The model a run trains, converted again with other options (here another RoPE mode): the checkpoint's weights
    would train on under the other conversion, so the resume is refused, naming the model, and no checkpoint is
    blamed."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    config_file = out / "converted" / "config.json"
    config_file.write_text(json.dumps({**json.loads(config_file.read_text()), "rope_mode": "keep"}))
    config = recipe_config(tiny_source, out, training={"save_every": 1, "resume": True})
    capsys.readouterr()
    assert run_recipe(config, tmp_path) == 1
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"trained another model than the one at {out / 'converted'} now" in error, error
    assert "delete" not in error


def test_a_resume_drops_the_log_rows_written_after_its_checkpoint(tiny_source, finished_run, tmp_path, capsys):
    """A run killed after it logged step 2 but before it saved it resumes from step 1 and logs step 2 again: the log
    then holds each step once, not the killed run's row beside the replayed one."""
    out = tmp_path / "run"
    shutil.copytree(finished_run, out)
    shutil.rmtree(out / "checkpoints" / "step-00000002")
    for name in ("final", "recovery.json"):
        path = out / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    with (out / "logs" / "recovery" / "log.jsonl").open("a") as log:
        log.write('{"step": 2, "train/lo')  # cut short by the kill
    config = recipe_config(tiny_source, out, training={"save_every": 1, "resume": True})
    capsys.readouterr()
    assert run_recipe(config, tmp_path) == 0
    assert "dropped 3 row(s) of the log written after step 1" in capsys.readouterr().out
    steps = [entry["step"] for entry in read_log(out) if "train/lr" in entry]
    assert steps == [1, 2]
