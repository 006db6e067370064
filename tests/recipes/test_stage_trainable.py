"""`stages.N.trainable`: a stage that trains a narrower set than the run (a last gate-only stage after attention
stages), its refusals, and its exact resume."""

import shutil

import pytest
import torch
from accelerate import DistributedType
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

import path_hf  # noqa: F401  (registers path_llama)
from path_hf.errors import RecipeError
from path_hf.recipes.models import check_engine, narrow_trainable, select_trainable
from path_hf.recipes.settings import NESTED_TRAINABLE, Stage, TrainingSettings
from tests.recipes.recipe_runs import read_log, recipe_config, run_recipe

GATE = {"bt_proj", "bt_gain", "g_proj", "g_gain"}
ATTENTION = {"q_proj", "k_proj", "v_proj", "o_proj", "w_proj", "w_conv1d", *GATE}


def weights(directory) -> dict[str, torch.Tensor]:
    return load_file(directory / "model.safetensors")


def changed(before: dict, after: dict) -> set[str]:
    """The parameter kinds (names without the layer index) whose weights differ."""
    return {
        name.split(".")[-2] if name.endswith(("weight", "bias")) else name
        for name in before
        if not torch.equal(before[name], after[name])
    }


def gate_stage_config(source, out, **training):
    """Two attention steps of 16-token blocks, then two gate-only steps of 32-token blocks; a checkpoint every step."""
    stages = [
        {"name": "lm", "tokens": 128, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 256, "learning_rate": 1e-2, "block_size": 32, "trainable": "gate"},
    ]
    training = {"trainable": "attention", "weight_decay": 0.1, "save_every": 1, "keep_checkpoints": 5, **training}
    model = {"convert": {"rope": "drop", "forget_gate": True}}
    return recipe_config(source, out, stages=stages, training=training, model=model)


def test_a_gate_stage_trains_only_the_gate_and_resumes_exactly(tiny_source, tmp_path):
    uninterrupted, resumed = tmp_path / "a", tmp_path / "b"
    assert run_recipe(gate_stage_config(tiny_source, uninterrupted), tmp_path) == 0
    assert [e["tokens"] for e in read_log(uninterrupted) if "train/lr" in e] == [64, 128, 256, 384]
    before_gate = weights(uninterrupted / "checkpoints" / "step-00000002")  # the end of the attention stage
    final = weights(uninterrupted / "final")
    assert changed(weights(uninterrupted / "converted"), before_gate) == ATTENTION
    # Everything but the gate bit-identical through the gate stage (weight decay and AdamW's moments included).
    assert changed(before_gate, final) == GATE

    # As if stopped after step 3, the first of the gate stage: the resumed run narrows at its first step.
    resumed.mkdir()
    shutil.copytree(uninterrupted / "converted", resumed / "converted")
    shutil.copytree(uninterrupted / "checkpoints" / "step-00000003", resumed / "checkpoints" / "step-00000003")
    assert run_recipe(gate_stage_config(tiny_source, resumed, resume=True), tmp_path) == 0
    for name, tensor in final.items():
        assert torch.equal(tensor, weights(resumed / "final")[name]), name


def test_narrow_trainable_intersects_the_run_and_the_stage_sets(tiny_source, tmp_path):
    from path_hf.conversion.convert import convert
    from path_hf.conversion.options import ConvertOptions

    convert(ConvertOptions(source=str(tiny_source), output=str(tmp_path / "path"), rope="drop", forget_gate=True))
    model = AutoModelForCausalLM.from_pretrained(tmp_path / "path")

    def trained() -> set[str]:
        return {name for name, param in model.named_parameters() if param.requires_grad}

    sets = {}
    for trainable in NESTED_TRAINABLE:
        select_trainable(model, TrainingSettings(output_dir=".", trainable=trainable))
        sets[trainable] = trained()
    assert all(a < b for a, b in zip(list(sets.values()), list(sets.values())[1:], strict=False))  # nested
    assert {name.split(".")[-2] for name in sets["gate"]} == GATE
    for i, run in enumerate(NESTED_TRAINABLE):
        for stage in NESTED_TRAINABLE[: i + 1]:
            narrow_trainable(model, run, stage)
            assert trained() == sets[stage], (run, stage)
        narrow_trainable(model, run, None)
        assert trained() == sets[run]


@pytest.mark.parametrize(
    "run, stage, message",
    [
        (
            "gate",
            "attention",
            "stages.1.trainable 'attention' is wider than training.trainable 'gate': the optimizer "
            "holds only the run's parameters; give the stage one of gate, or widen training.trainable to attention",
        ),
        ("path", "full", "stages.1.trainable 'full' is wider than training.trainable 'path'"),
        (
            "attention",
            "gates",
            "stages.1.trainable must be one of gate, path, attention, full (each a subset of the next), got 'gates'",
        ),
        ("full", "lora", "stages.1.trainable must be one of gate, path, attention, full"),
        ("lora", "gate", "stages.1.trainable 'gate' cannot narrow training.trainable lora"),
    ],
    ids=["wider", "wider-than-path", "unknown", "lora-stage", "lora-run"],
)
def test_a_stage_trainable_outside_the_run_is_refused(tiny_source, tmp_path, capsys, run, stage, message):
    config = gate_stage_config(tiny_source, tmp_path / "run", trainable=run)
    config["stages"][1]["trainable"] = stage
    assert run_recipe(config, tmp_path) == 1
    assert not (tmp_path / "run").exists(), "a refused configuration must not start any work"
    assert message in capsys.readouterr().err


def test_a_stage_trainable_is_refused_under_an_engine():
    training = TrainingSettings(output_dir=".", trainable="attention")
    stages = [Stage("lm", tokens=64, learning_rate=1e-3), Stage("lm", tokens=64, learning_rate=1e-3, trainable="gate")]
    check_engine(training, DistributedType.NO, stages=stages)
    check_engine(training, DistributedType.MULTI_CPU, stages=stages[:1])
    for engine in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU, DistributedType.FSDP):
        with pytest.raises(RecipeError, match=r"stages\.1\.trainable 'gate' .* run the stage as its own run instead"):
            check_engine(training, engine, stages=stages)
