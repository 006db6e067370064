"""A hybrid through the recipe: `model.convert` with `layers`, `local_window` and `local_sinks` (packed 32-token
blocks, longer than the window, so the local layers' window and sinks act in training), align and distill stages.
Only the PaTH layers' attention trains; the local layers stay the source's, and the final model keeps the fields."""

import json

import torch
from safetensors.torch import load_file

from tests.recipes.recipe_runs import read_log, recipe_config, run_recipe


def test_a_hybrid_recovers_its_path_layers_only(tiny_source, tmp_path):
    out = tmp_path / "run"
    model = {"convert": {"rope": "interleave", "forget_gate": True, "layers": "1", "local_window": 8, "local_sinks": 2}}
    stages = [
        {"name": "align", "tokens": 128, "learning_rate": 1e-2},
        {"name": "distill", "tokens": 128, "learning_rate": 1e-2},
    ]
    data = {"block_size": 32}
    config = recipe_config(tiny_source, out, model=model, stages=stages, data=data, training={"trainable": "attention"})
    assert run_recipe(config, tmp_path) == 0
    saved = json.loads((out / "final" / "config.json").read_text())
    assert (saved["path_layers"], saved["local_window"], saved["local_sinks"]) == ([1], 8, 2)
    before, after = load_file(out / "converted" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    moved = {name for name in before if not torch.equal(before[name], after[name])}
    assert moved and all(name.startswith("model.layers.1.self_attn.") for name in moved), sorted(moved)
    assert [entry["tokens"] for entry in read_log(out) if "train/lr" in entry][-1] == 256
