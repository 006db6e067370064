"""recipes/train.py under the sharding engines: FSDP2 for real on two CPU processes (gloo), and what can be checked of
DeepSpeed without it. See recipes/README.md, "FSDP2 and DeepSpeed: what the tests run"."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from recipe_runs import ROOT, read_log, recipe_config, run_recipe, write_config
from safetensors.torch import load_file
from test_launch import environment, free_port
from torch import nn

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


def fsdp2_cpu_config(tmp_path: Path) -> Path:
    """recipes/accelerate/fsdp2.yaml on two CPU processes in full precision: only what CPU needs is changed."""
    config = yaml.safe_load((ROOT / "recipes" / "accelerate" / "fsdp2.yaml").read_text())
    config.update(num_processes=2, mixed_precision="no", use_cpu=True)
    return write_config(config, tmp_path / "fsdp2-cpu.yaml")


def launch(script: str, accelerate_args: list[str], config: Path) -> None:
    accelerate = Path(sys.executable).with_name("accelerate")
    command = [str(accelerate), "launch", *accelerate_args, "--main_process_port", str(free_port())]
    env = {**environment(), "ACCELERATE_USE_CPU": "1"}
    result = subprocess.run(
        [*command, script, "--config", str(config)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr[-3000:]


def test_fsdp2_on_two_cpu_processes_clips_the_whole_gradient_like_ddp(tiny_source, tmp_path):
    """The shipped FSDP2 config on two CPU processes (`fsdp_on_cpu.py` says why it is needed) and, on the same data,
    DDP: the same gradient norm at every step (the norm of the whole gradient, gathered over the shards, not of one
    shard's, nor 0 as when stale parameters were clipped), every update within the clipping bound, both processes
    ending with the same weights, a checkpoint written by accelerate's FSDP code."""
    stages = [
        {"name": "align", "tokens": 256, "learning_rate": 1e-2},
        {"name": "lm", "tokens": 256, "learning_rate": 1e-2},
    ]
    training = {"trainable": "attention", "max_grad_norm": 1e-9}
    runs = {}
    for engine in ("fsdp2", "ddp"):
        out = runs[engine] = tmp_path / engine
        config = recipe_config(tiny_source, out, stages=stages, training=training)
        config = write_config(config, tmp_path / f"{engine}.yaml")
        if engine == "fsdp2":
            launch("tests/recipes/fsdp_on_cpu.py", ["--config_file", str(fsdp2_cpu_config(tmp_path))], config)
        else:
            ddp = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no"]
            launch("recipes/train.py", [*ddp, "--dynamo_backend", "no"], config)

    fsdp2, ddp = runs["fsdp2"], runs["ddp"]
    assert (fsdp2 / "checkpoints" / "step-00000004" / "pytorch_model_fsdp.bin").is_file()  # it did run under FSDP
    norms = grad_norms(fsdp2)
    assert len(norms) == 4 and min(norms) > 0
    assert norms == pytest.approx(grad_norms(ddp), rel=1e-4)
    assert 0 < largest_update(fsdp2) <= update_bound(4, 1e-2, 1e-9)
    checksums = json.loads((fsdp2 / "recovery.json").read_text())["replica_checksums"]
    assert len(checksums) == 2 and checksums[0] == checksums[1]
    assert checksums[0] == pytest.approx(json.loads((ddp / "recovery.json").read_text())["replica_checksums"][0])
    final = load_file(fsdp2 / "final" / "model.safetensors")
    for name, tensor in load_file(ddp / "final" / "model.safetensors").items():
        torch.testing.assert_close(final[name], tensor, rtol=1e-5, atol=1e-7, msg=name)
