"""recipes/train.py under the sharding engines: FSDP2 for real on two CPU processes (gloo), and what can be checked of
DeepSpeed without it. See recipes/README.md, "FSDP2 and DeepSpeed: what the tests run"."""

import json
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from accelerate.utils import DistributedType
from safetensors.torch import load_file
from torch import nn

from path_hf.errors import RecipeError
from path_hf.recipes.checkpoints import read_checkpoint
from path_hf.recipes.models import check_engine
from path_hf.recipes.settings import TrainingSettings
from tests import processes
from tests.processes import environment
from tests.recipes.recipe_runs import ROOT, parse_config, read_log, recipe_config, run_recipe, write_config
from tests.recipes.test_launch import free_port

ADAM_EPS = 1e-8  # torch.optim.AdamW's default, which the recipe keeps


def update_bound(steps: int, learning_rate: float, max_grad_norm: float) -> float:
    """The most AdamW (no weight decay) can move a weight in `steps` steps when every gradient was clipped to
    `max_grad_norm`: each step moves it by lr * m / (sqrt(v) + eps), |m| <= max |g| <= max_grad_norm, sqrt(v) >= 0.
    Unclipped, Adam's first step moves every weight with a gradient by lr itself."""
    return steps * learning_rate * max_grad_norm / ADAM_EPS


def largest_update(out: Path) -> float:
    before, after = load_file(out / "converted" / "model.safetensors"), load_file(out / "final" / "model.safetensors")
    return max((after[name] - before[name]).abs().max().item() for name in before)


def grad_norms(out: Path) -> list[float]:
    return [entry["train/grad_norm"] for entry in read_log(out) if "train/lr" in entry]


def replacing_parameters(prepare):
    """`Accelerator.prepare`, after which every parameter of the model is a new object, as after FSDP2's
    `fully_shard` (accelerate swaps the new ones into the optimizer, as it does for FSDP2)."""

    def replacing(self, model, optimizer, dataloader):
        model, optimizer, dataloader = prepare(self, model, optimizer, dataloader)
        new = {}
        for module in model.modules():
            for name, param in list(module.named_parameters(recurse=False)):
                if param not in new:
                    new[param] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)
                setattr(module, name, new[param])
        for group in optimizer.param_groups:
            group["params"] = [new[param] for param in group["params"]]
        return model, optimizer, dataloader

    return replacing


def test_clipping_acts_on_the_parameters_of_the_prepared_model(tiny_source, tmp_path, monkeypatch):
    """Gradients are clipped where they are: on the prepared model's parameters, not on the objects the optimizer
    was built from, which FSDP2 replaces (clipping those was a silent no-op: no gradient, norm 0)."""
    from accelerate import Accelerator

    monkeypatch.setattr(Accelerator, "prepare", replacing_parameters(Accelerator.prepare))
    out = tmp_path / "run"
    stages = [{"name": "lm", "tokens": 128, "learning_rate": 1e-2}]
    training = {"trainable": "attention", "max_grad_norm": 1e-9}
    assert run_recipe(recipe_config(tiny_source, out, stages=stages, training=training), tmp_path) == 0

    norms = grad_norms(out)
    assert len(norms) == 2 and all(norm > 1e-3 for norm in norms)  # before clipping
    assert 0 < largest_update(out) <= update_bound(2, 1e-2, 1e-9)  # 2e-3, where an unclipped step moves 1e-2


ENGINE_STAGES = [
    {"name": "align", "tokens": 256, "learning_rate": 1e-2},
    {"name": "lm", "tokens": 256, "learning_rate": 1e-2},
]
ENGINE_TRAINING = {"trainable": "attention", "max_grad_norm": 1e-9}


def cpu_config(name: str, tmp_path: Path) -> Path:
    """A shipped accelerate config on two CPU processes in full precision: only what CPU and the tiny recipe need is
    changed (DeepSpeed accumulates as many micro-batches as the recipe: 1)."""
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / f"{name}.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no")
    if name == "fsdp2":
        config["use_cpu"] = True
    else:
        config["deepspeed_config"]["gradient_accumulation_steps"] = 1
    return write_config(config, tmp_path / f"{name}-cpu.yaml")


def launch_recipe(tiny_source, out: Path, script: str, accelerate_args: list[str], env: dict[str, str]) -> None:
    """The tiny align + lm recipe (4 steps of 2 x 4 blocks of 16 tokens) under `accelerate launch`, into `out`."""
    config = recipe_config(tiny_source, out, stages=ENGINE_STAGES, training=ENGINE_TRAINING)
    config = write_config(config, out.with_suffix(".yaml"))
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", *accelerate_args, "--main_process_port", str(free_port())]
    result = processes.run([*command, script, "--config", str(config)], timeout=300, cwd=ROOT, env=environment(**env))
    assert result.returncode == 0, result.stderr[-3000:]


@pytest.fixture(scope="module")
def ddp_run(tiny_source, tmp_path_factory) -> Path:
    """The engine tests' recipe under DDP on two CPU processes: the reference."""
    out = tmp_path_factory.mktemp("ddp") / "run"
    ddp = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
    ddp_env = {"ACCELERATE_USE_CPU": "1"}
    launch_recipe(tiny_source, out, "tests/recipes/teardown.py", [*ddp, "--dynamo_backend", "no"], ddp_env)
    return out


@pytest.mark.parametrize("engine", ["fsdp2", "deepspeed_zero2", "deepspeed_zero3"])
def test_sharded_engines_on_two_cpu_processes_clip_the_whole_gradient_like_ddp(engine, tiny_source, ddp_run, tmp_path):
    """A shipped FSDP2 or DeepSpeed config on two CPU processes (`engines_on_cpu.py` says why it is needed) trains
    like DDP on the same data: the same gradient norm at every step (the whole gradient's, gathered over the shards,
    not one shard's, nor 0 as when FSDP2's stale parameters were clipped), every update within the clipping bound
    (DeepSpeed's `gradient_clipping: auto` is the recipe's max_grad_norm), the same final weights, a checkpoint
    written by the engine's own code. DeepSpeed is not a dependency: its runs need it installed."""
    if engine.startswith("deepspeed"):
        pytest.importorskip("deepspeed")
    out = tmp_path / engine
    env = {"ACCELERATE_USE_CPU": "1"} if engine == "fsdp2" else {}
    config = cpu_config(engine, tmp_path)
    launch_recipe(tiny_source, out, "tests/recipes/engines_on_cpu.py", ["--config_file", str(config)], env)

    checkpoint = out / "checkpoints" / "step-00000004"
    engine_file = "pytorch_model_fsdp.bin" if engine == "fsdp2" else "pytorch_model"  # it did run under the engine
    assert (checkpoint / engine_file).exists()
    assert read_checkpoint(checkpoint, SimpleNamespace(num_processes=2)).step == 4  # a resume would accept it
    norms = grad_norms(out)
    assert len(norms) == 4 and min(norms) > 0
    assert norms == pytest.approx(grad_norms(ddp_run), rel=1e-4)
    assert 0 < largest_update(out) <= update_bound(4, 1e-2, 1e-9)
    final = load_file(out / "final" / "model.safetensors")
    for name, tensor in load_file(ddp_run / "final" / "model.safetensors").items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
    if engine == "fsdp2":  # every process gathers the whole weights: the same model on both
        checksums = json.loads((out / "recovery.json").read_text())["replica_checksums"]
        assert len(checksums) == 2 and checksums[0] == checksums[1]


def deepspeed_plugin_of(accelerate_config: Path, monkeypatch):
    """The DeepSpeed plugin a process started by `accelerate launch --config_file accelerate_config` builds: the
    launcher reads the config as it does (stopped before it needs DeepSpeed to spawn), its environment then makes
    the plugin. Neither needs DeepSpeed installed."""
    import accelerate.commands.launch as launch
    from accelerate.utils import DeepSpeedPlugin
    from accelerate.utils.launch import prepare_deepspeed_cmd_env

    spawned = {}
    monkeypatch.setattr(launch, "deepspeed_launcher", lambda args: spawned.update(prepare_deepspeed_cmd_env(args)[1]))
    args = launch.launch_command_parser().parse_args(["--config_file", str(accelerate_config), "recipes/train.py"])
    launch.launch_command(args)
    for name, value in spawned.items():
        if name.startswith("ACCELERATE_"):
            monkeypatch.setenv(name, value)
    return DeepSpeedPlugin()


@pytest.mark.parametrize("name", ["deepspeed_zero2", "deepspeed_zero3"])
def test_shipped_deepspeed_configs_load_and_agree_with_the_recipe_in_their_launch_line(name, monkeypatch):
    """Each shipped DeepSpeed config, read by accelerate's launcher, gives the ZeRO stage it says, and the recipe
    config its launch line names trains with it: the same micro-batches per step, DeepSpeed's clipping the recipe's."""
    accelerate_config = ROOT / "recipes" / "accelerate" / f"{name}.yaml"
    launch_line = next(line for line in accelerate_config.read_text().splitlines() if "accelerate launch" in line)
    recipe = parse_config(["--config", launch_line.split("--config ")[1].strip()])
    plugin = deepspeed_plugin_of(accelerate_config, monkeypatch)
    assert plugin.zero_stage == int(name[-1]) and plugin.zero3_init_flag == (name == "deepspeed_zero3")

    check_engine(recipe.training, DistributedType.DEEPSPEED, plugin)
    assert plugin.deepspeed_config["gradient_clipping"] == recipe.training.max_grad_norm
    assert plugin.deepspeed_config["gradient_accumulation_steps"] == recipe.training.gradient_accumulation_steps


def test_the_engine_checks_refuse_what_the_engine_would_override():
    from accelerate.utils import DeepSpeedPlugin

    def plugin(**fields):
        return DeepSpeedPlugin(**{"zero_stage": 2, "gradient_accumulation_steps": 1, **fields})

    training = TrainingSettings(output_dir=".", max_grad_norm=0.5, gradient_accumulation_steps=4)
    with pytest.raises(RecipeError, match=r"gradient_accumulation_steps: 1, training.gradient_accumulation_steps is 4"):
        check_engine(training, DistributedType.DEEPSPEED, plugin())
    with pytest.raises(RecipeError, match=r"gradient_clipping: 1.0, training.max_grad_norm is 0.5"):
        check_engine(training, DistributedType.DEEPSPEED, plugin(gradient_accumulation_steps=4, gradient_clipping=1.0))
    agreeing = plugin(gradient_accumulation_steps=4, gradient_clipping=0.5)
    check_engine(training, DistributedType.DEEPSPEED, agreeing)
    left_open = plugin(gradient_accumulation_steps=4, gradient_clipping="auto")
    check_engine(training, DistributedType.DEEPSPEED, left_open)
    assert left_open.deepspeed_config["gradient_clipping"] == 0.5

    lora = TrainingSettings(output_dir=".", trainable="lora")
    check_engine(lora, DistributedType.DEEPSPEED, plugin())  # ZeRO-2 keeps whole weights
    check_engine(lora, DistributedType.MULTI_GPU)
    for engine, deepspeed in ((DistributedType.DEEPSPEED, plugin(zero_stage=3)), (DistributedType.FSDP, None)):
        with pytest.raises(RecipeError, match="lora merges on one process"):
            check_engine(lora, engine, deepspeed)
