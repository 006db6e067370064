"""A GGUF file as the recipe's `model.path`: converted on the fly, and the teacher, both as given and as the default
teacher a converted checkpoint records."""

import json

import pytest

from tests.conversion.gguf_files import tiny_model, write_gguf
from tests.recipes.recipe_runs import recipe_config, run_recipe


def test_a_gguf_is_converted_and_is_the_teacher_then_the_recorded_teacher(tmp_path):
    gguf_path = write_gguf(tmp_path / "tiny.Q8_0.gguf", tiny_model(), "llama", "Q8_0")
    stages = [{"name": "distill", "tokens": 64, "learning_rate": 1e-3}]
    exact = {"path": str(gguf_path), "convert": {"rope": "keep", "init": "identity"}}
    first = tmp_path / "first"
    assert run_recipe(recipe_config(gguf_path, first, model=exact, stages=stages), tmp_path) == 0
    record = json.loads((first / "converted" / "config.json").read_text())["path_conversion"]
    assert record["source"] == str(gguf_path) and record["gguf"]["tensor_types"]["Q8_0"] > 0
    # RoPE kept, transforms at identity: the converted model starts exactly at its GGUF teacher's perplexity.
    recovery = json.loads((first / "recovery.json").read_text())
    assert recovery["history"][0]["ratio"] == pytest.approx({"1x": 1.0, "2x": 1.0}, abs=1e-5)

    # The converted checkpoint, without model.teacher: the GGUF its record names is the teacher.
    second = tmp_path / "second"
    converted = {"path": str(first / "converted"), "convert": {}}
    assert run_recipe(recipe_config(gguf_path, second, model=converted, stages=stages), tmp_path) == 0
    recovery = json.loads((second / "recovery.json").read_text())
    assert recovery["source_ppl"] == pytest.approx(json.loads((first / "recovery.json").read_text())["source_ppl"])
    assert recovery["history"][0]["ratio"] == pytest.approx({"1x": 1.0, "2x": 1.0}, abs=1e-5)


def test_a_gguf_named_in_a_directory_of_several_is_the_source_and_the_teacher(tmp_path):
    """`model.path` a directory holding several GGUFs and `model.convert.gguf_file` naming one: that file is
    converted, and it is the default teacher (a directory of several GGUFs cannot be loaded on its own)."""
    folder = tmp_path / "ggufs"
    folder.mkdir()
    chosen = write_gguf(folder / "tiny.Q8_0.gguf", tiny_model(), "llama", "Q8_0")
    write_gguf(folder / "tiny.F32.gguf", tiny_model(), "llama", "F32")
    stages = [{"name": "distill", "tokens": 64, "learning_rate": 1e-3}]
    model = {"path": str(folder), "convert": {"rope": "keep", "init": "identity", "gguf_file": chosen.name}}
    out = tmp_path / "run"
    assert run_recipe(recipe_config(chosen, out, model=model, stages=stages), tmp_path) == 0
    record = json.loads((out / "converted" / "config.json").read_text())["path_conversion"]
    assert record["source"] == str(chosen)
    recovery = json.loads((out / "recovery.json").read_text())
    assert recovery["history"][0]["ratio"] == pytest.approx({"1x": 1.0, "2x": 1.0}, abs=1e-5)
