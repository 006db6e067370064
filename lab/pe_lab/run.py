# Copyright 2026 The path-hf authors. Apache-2.0.
"""The positional-encoding lab: the grid of encodings and tasks (`FULL_PLAN`), each trained at one length and evaluated
at 1x-16x or 32x its training length.

```
python -m lab.pe_lab                      # the full grid (what `make lab` runs); output in runs/pe_lab
python -m lab.pe_lab --quick              # a reduced grid in well under a minute (the test): the pipeline only
python -m lab.pe_lab.rope_by_hand         # exercise 1: RoPE by hand, shift invariance, where aliasing starts
```

Writes `results.json` (settings, every run, the summaries), `results.md` (the tables) and one plot per task and one of
the far attention mass into the output directory. Training runs in `--workers` processes of one thread each.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import statistics
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from path_hf.arguments import add_arguments, from_arguments
from path_hf.evaluation import IGNORE_INDEX, token_nll

from .model import LabConfig, LabDecoder
from .positions import ENCODINGS
from .report import labels_of, row_order, summary, with_int_keys, write
from .tasks import TASKS

ROOT = Path(__file__).resolve().parents[2]
EVAL_SEED = 1234  # the evaluation data (and the random SO(2) draws) are the same for every run


@dataclass(frozen=True)
class TaskPlan:
    """What one task trains and evaluates. Encodings in `key` train with every seed, the others with the first."""

    encodings: tuple[str, ...]
    key: tuple[str, ...]
    steps: int
    batch: int
    lr: float
    train_length: int
    multiples: tuple[int, ...]  # evaluated lengths, in training lengths
    eval_tokens: int  # per evaluated length
    model: dict = field(default_factory=dict)  # LabConfig fields that differ from its defaults
    far_mass: bool = False


# The synthetic tasks take a quarter of the text model (hidden 64, 2 layers of 2 heads: 0.1M parameters): it solves
# them, and the budget then fits three seeds of their key rows.
SMALL = {"hidden_size": 64, "num_layers": 2, "num_heads": 2, "intermediate_size": 256}
TEXT_KEY = ("rope", "alibi", "so2-random-qk", "so2-random-qkv", "so2-learned-qk", "so2-learned-qkv", "path")
FULL_PLAN = {
    "text": TaskPlan(tuple(ENCODINGS), TEXT_KEY, steps=300, batch=16, lr=3e-3, train_length=64,
                     multiples=(1, 2, 4, 8, 16, 32), eval_tokens=8192, far_mass=True),
    "key-copy": TaskPlan(("nope", "alibi", "rope", "path"), ("rope", "path"), steps=1500, batch=32, lr=3e-3,
                         train_length=32, multiples=(1, 2, 4, 8, 16, 32), eval_tokens=8192, model=SMALL),
    "flip-flop": TaskPlan(("nope", "learned", "alibi", "rope", "so2-learned-qkv", "path", "path-fox"),
                          ("rope", "path"), steps=400, batch=32, lr=3e-3, train_length=64, multiples=(1, 2, 4, 8, 16),
                          eval_tokens=16384, model=SMALL),
}  # fmt: skip
# The same grid with a tiny model, two steps and short lengths: it runs every part of the pipeline in seconds.
TINY = {"hidden_size": 32, "num_layers": 2, "num_heads": 2, "intermediate_size": 64}
QUICK_PLAN = {
    task: replace(plan, steps=2, batch=4, train_length=16, multiples=(1, 2, 4), eval_tokens=256, model=TINY)
    for task, plan in FULL_PLAN.items()
}


@dataclass
class LabOptions:
    output: Path = field(default=ROOT / "runs" / "pe_lab", metadata={"help": "output directory"})
    tasks: list[str] = field(
        default_factory=lambda: list(TASKS), metadata={"nargs": "+", "choices": tuple(TASKS), "help": "tasks to run"}
    )
    seeds: int = field(default=3, metadata={"help": "seeds of the key encodings of each task (default: 3)"})
    workers: int = field(default=2, metadata={"help": "training processes, one thread each (default: 2)"})
    far_distance: int = field(
        default=32, metadata={"help": "keys further than this from the query are far (default: 32)"}
    )
    quick: bool = field(default=False, metadata={"help": "tiny model, 2 steps, 1 seed: checks the pipeline"})
    replot: bool = field(default=False, metadata={"help": "redraw the tables and plots from OUTPUT/results.json"})


@dataclass(frozen=True)
class Job:
    task: str
    encoding: str
    seed: int
    plan: TaskPlan
    model: LabConfig
    far_distance: int


def lr_at(step: int, plan: TaskPlan) -> float:
    """Linear warmup over the first tenth, cosine decay to a tenth of the peak."""
    warmup = max(1, plan.steps // 10)
    if step < warmup:
        return plan.lr * (step + 1) / warmup
    progress = (step - warmup) / max(1, plan.steps - warmup)
    return plan.lr * (0.1 + 0.45 * (1 + math.cos(math.pi * progress)))


def train(job: Job, task) -> tuple[LabDecoder, list[float]]:
    torch.manual_seed(job.seed)
    model = LabDecoder(job.model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=job.plan.lr, betas=(0.9, 0.95), weight_decay=0.01)
    generator = torch.Generator().manual_seed(job.seed)
    losses = []
    for step in range(job.plan.steps):
        input_ids, targets = task.sample(job.plan.batch, job.plan.train_length, generator)
        loss = token_nll(model(input_ids), targets).sum() / (targets != IGNORE_INDEX).sum()
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, job.plan)
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        losses.append(loss.item())
    return model, losses


def eval_data(task, length: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The same evaluation inputs for every run: the held-out text, or synthetic sequences from a fixed seed."""
    if hasattr(task, "eval_windows"):
        return task.eval_windows(length, tokens)
    return task.sample(max(4, tokens // length), length, torch.Generator().manual_seed(EVAL_SEED + length))


def batches(input_ids: torch.Tensor, targets: torch.Tensor, length: int):
    """About 4096 tokens a batch: memory for the explicit [B, H, T, T] attention stays small."""
    size = max(1, 4096 // length)
    for start in range(0, len(input_ids), size):
        yield input_ids[start : start + size], targets[start : start + size]


def far_mass(probabilities: list[torch.Tensor], distance: int) -> list[float]:
    """Per layer: the attention mass on keys more than `distance` tokens back, averaged over heads and over the queries
    of the window's last quarter (those with the most far keys)."""
    length = probabilities[0].shape[-1]
    position = torch.arange(length)
    far = (position[:, None] - position[None, :]) > distance  # [T, T]
    queries = slice(3 * length // 4, length)
    return [(p * far).sum(-1)[..., queries].mean().item() for p in probabilities]


@torch.no_grad()
def score(
    model: LabDecoder, task, input_ids: torch.Tensor, targets: torch.Tensor, far_distance: int | None = None
) -> tuple[float, list[float] | None]:
    """Accuracy (argmax) of the scored tokens, or perplexity; and, given `far_distance`, the far mass of each layer
    (`far_mass`) on the first batch."""
    torch.manual_seed(EVAL_SEED)
    total, count, mass = 0.0, 0, None
    for ids, tgt in batches(input_ids, targets, input_ids.shape[1]):
        probabilities = [] if far_distance is not None and mass is None else None
        logits = model(ids, probabilities)
        if probabilities:
            mass = far_mass(probabilities, far_distance)
        scored = tgt != IGNORE_INDEX
        if task.metric == "accuracy":
            total += (logits.argmax(-1) == tgt)[scored].sum().item()
        else:
            total += token_nll(logits, tgt).sum().item()
        count += scored.sum().item()
    return (total / count if task.metric == "accuracy" else math.exp(total / count)), mass


def run_job(job: Job) -> dict:
    """Train one model and evaluate it at every length (and every RoPE rescaling)."""
    torch.set_num_threads(1)
    start = time.time()
    task = TASKS[job.task]()
    model, losses = train(job, task)
    trained = time.time() - start
    model.eval()
    metric: dict[str, dict[int, float]] = {label: {} for label in labels_of(job.encoding)}
    mass: dict[str, dict[int, list[float]]] = {label: {} for label in metric}
    for multiple in job.plan.multiples:
        length = multiple * job.plan.train_length
        input_ids, targets = eval_data(task, length, job.plan.eval_tokens)
        for label, rescaling in labels_of(job.encoding).items():
            with model.rescaled_rope(rescaling) if job.encoding == "rope" else contextlib.nullcontext():
                far_distance = job.far_distance if job.plan.far_mass else None
                metric[label][length], layers = score(model, task, input_ids, targets, far_distance)
                if layers is not None:
                    mass[label][length] = layers
    return {
        "task": job.task,
        "encoding": job.encoding,
        "seed": job.seed,
        "parameters": sum(p.numel() for p in model.parameters()),
        "train_seconds": round(trained, 1),
        "eval_seconds": round(time.time() - start - trained, 1),
        "loss": {"first": losses[0], "last_tenth": statistics.fmean(losses[-max(1, len(losses) // 10) :])},
        "metric": metric,
        "far_mass": mass if job.plan.far_mass else {},
    }


def jobs_for(plan: dict[str, TaskPlan], options: LabOptions) -> list[Job]:
    jobs = []
    for task_name, task_plan in plan.items():
        config = LabConfig(vocab_size=TASKS[task_name]().vocab_size, train_length=task_plan.train_length,
                           max_length=max(task_plan.multiples) * task_plan.train_length, **task_plan.model)  # fmt: skip
        for encoding in task_plan.encodings:
            seeds = range(options.seeds if encoding in task_plan.key else 1)
            model = replace(config, encoding=encoding)
            jobs += [Job(task_name, encoding, seed, task_plan, model, options.far_distance) for seed in seeds]
    # the longest first (PaTH's steps cost about twice the others'), so that the workers finish together
    return sorted(
        jobs,
        key=lambda job: (
            -job.plan.steps
            * job.plan.batch
            * job.plan.train_length
            * (job.model.num_layers * job.model.hidden_size)
            * (2 if job.encoding.startswith("path") else 1)
        ),
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_arguments(parser, LabOptions)
    options = from_arguments(parser.parse_args(argv), LabOptions)
    if options.replot:
        report = json.loads((options.output / "results.json").read_text())
        write(report, options.output, report["settings"]["far_distance"])
        print(f"pe_lab: tables and plots redrawn in {options.output}")
        return 0
    if options.quick:
        options = replace(options, seeds=1, far_distance=4)
    plan = {task: (QUICK_PLAN if options.quick else FULL_PLAN)[task] for task in options.tasks}
    jobs = jobs_for(plan, options)
    options.output.mkdir(parents=True, exist_ok=True)
    print(f"pe_lab: {len(jobs)} training runs on {options.workers} workers -> {options.output}", flush=True)
    start = time.time()
    runs = []
    with ProcessPoolExecutor(options.workers, mp_context=torch.multiprocessing.get_context("spawn")) as pool:
        futures = [pool.submit(run_job, job) for job in jobs]
        for done, future in enumerate(as_completed(futures), 1):
            run = future.result()
            runs.append(run)
            shown = ", ".join(f"{n}: {v:.3g}" for n, v in next(iter(run["metric"].values())).items())
            where = f"[{done}/{len(jobs)} {(time.time() - start) / 60:5.1f} min]"
            took = f"({run['train_seconds']:.0f} s + {run['eval_seconds']:.0f} s)"
            print(f"{where} {run['task']} {run['encoding']} seed {run['seed']} {took}: {shown}", flush=True)
    runs = [
        with_int_keys(run)
        for run in sorted(runs, key=lambda r: (r["task"], row_order(ENCODINGS[r["encoding"]].label), r["seed"]))
    ]
    settings = {key: str(value) if isinstance(value, Path) else value for key, value in asdict(options).items()}
    settings |= {"plan": {task: asdict(p) for task, p in plan.items()}, "torch": torch.__version__,
                 "wall_seconds": round(time.time() - start, 1)}  # fmt: skip
    summaries = summary(runs, {task: task_plan.train_length for task, task_plan in plan.items()})
    markdown = write({"settings": settings, "summary": summaries, "runs": runs}, options.output, options.far_distance)
    print("\n" + markdown)
    print(f"pe_lab: {len(jobs)} runs in {(time.time() - start) / 60:.1f} min; results in {options.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
