# Copyright 2026 The path-hf authors. Apache-2.0.
"""What recipes/train.py measures and logs: the perplexity of the converted model against the source model's at each
evaluation length (`RecoveryTracker`), the training log through accelerate's trackers (a JSONL file among them), the
progress bar, and at the end the table, `recovery.json` and `recovery.png`."""

from __future__ import annotations

import json
import math
import time
from dataclasses import asdict
from pathlib import Path

import torch
from accelerate import Accelerator
from accelerate.tracking import GeneralTracker
from torch import nn
from torch.distributed.tensor import DTensor
from tqdm.auto import tqdm

from ..atomic import atomic_file
from ..evaluation import IGNORE_INDEX, PerplexityResult, Window, plots, score_windows
from .checkpoints import RunState
from .models import shards_weights
from .settings import RecipeConfig, TrainingSettings, flatten

RUN_NAME = "recovery"  # accelerate's project name: logs/recovery/


def evaluate(
    model: nn.Module, windows: dict[str, list[Window]], accelerator: Accelerator, batch_size: int
) -> dict[str, float]:
    """Perplexity at each evaluation length, the windows split over the processes (each process runs the same
    number of batches, which sharded engines need)."""
    results = {}
    if shards_weights(accelerator.distributed_type, accelerator.state.deepspeed_plugin):
        model = WholeForward(model)
    for length, all_windows in windows.items():
        per_process = math.ceil(len(all_windows) / accelerator.num_processes)
        mine = all_windows[accelerator.process_index :: accelerator.num_processes]
        # Filler windows score nothing (labels all ignored) and keep the processes in step.
        filler = Window(all_windows[0].input_ids, torch.full_like(all_windows[0].labels, IGNORE_INDEX))
        mine = mine + [filler] * (per_process - len(mine))
        result = score_windows(model, mine, batch_size)
        totals = accelerator.reduce(
            torch.tensor([result.nll_sum, result.tokens], dtype=torch.float64, device=accelerator.device), "sum"
        )
        results[length] = PerplexityResult(totals[0].item(), int(totals[1].item())).ppl
    return results


class WholeForward(nn.Module):
    """`model` scored through its own forward alone. FSDP and ZeRO-3 gather the weights from the root module's forward
    on, which `path_hf.evaluation` would bypass by running the decoder and the head apart (to form the logits in
    chunks)."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, **kwargs):
        return self.model(**kwargs)


class JSONLTracker(GeneralTracker):
    """An accelerate tracker appending one JSON object per `log` call to `<logging_dir>/<run_name>/log.jsonl`."""

    name = "jsonl"
    requires_logging_directory = True

    def __init__(self, run_name: str, logging_dir: str | Path, **kwargs):
        super().__init__()
        self.path = Path(logging_dir) / run_name / "log.jsonl"

    def start(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)

    @property
    def tracker(self):
        return self.path

    def store_init_configuration(self, values: dict):
        self.log({"config": values}, step=None)

    def log(self, values: dict, step: int | None = None, **kwargs):
        with self.path.open("a") as file:
            file.write(json.dumps({"step": step, **values}) + "\n")


def trim_log(logging_dir: Path, step: int) -> int:
    """Drop the rows of `log.jsonl` that a killed run logged after `step`, the step a resume continues from (it logs
    them again); the rows without a step (the config of each start) stay. Returns how many were dropped."""
    path = Path(logging_dir) / RUN_NAME / "log.jsonl"
    if not path.is_file():
        return 0
    kept, dropped = [], 0
    for line in path.read_text().splitlines(keepends=True):
        try:
            row_step = json.loads(line).get("step")
        except (ValueError, AttributeError):  # a line cut short by the kill: not a row
            dropped += 1
            continue
        if isinstance(row_step, int) and row_step > step:
            dropped += 1
        else:
            kept.append(line)
    if dropped:
        with atomic_file(path) as tmp:
            tmp.write_text("".join(kept))
    return dropped


def trackers(log_with: list[str], logging_dir: Path) -> list[str | GeneralTracker]:
    """accelerate's `log_with`: the trackers named in `training.log_with`, `jsonl` being our `JSONLTracker`."""
    return [JSONLTracker(RUN_NAME, logging_dir) if name == "jsonl" else name for name in log_with]


def flat_config(config: RecipeConfig) -> dict:
    """The recipe config as the hyperparameters trackers store: flat `section/key` names, scalar values."""
    return {
        name: value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
        for name, value in flatten(asdict(config), sep="/").items()
    }


class RecoveryTracker:
    """The perplexity recovery of a run, measured on the evaluation `windows` and kept in `state` (its `source_ppl`
    and `history`, which every checkpoint saves); each measurement is logged and printed."""

    def __init__(
        self, state: RunState, windows: dict[str, list[Window]], accelerator: Accelerator, training: TrainingSettings
    ):
        self.state, self.windows, self.accelerator = state, windows, accelerator
        self.batch_size, self.target_ratio = training.eval_batch_size, training.target_ratio

    def evaluate_source(self, teacher: nn.Module) -> None:
        """The source model's perplexity: the baseline of every ratio."""
        self.state.source_ppl = evaluate(teacher, self.windows, self.accelerator, self.batch_size)
        self.accelerator.log({f"eval/source_ppl_{k}": v for k, v in self.state.source_ppl.items()}, step=0)
        self.accelerator.print(f"source model: ppl {_fmt(self.state.source_ppl)}")

    def evaluate(self, model: nn.Module) -> bool:
        """The converted model's perplexity and its ratio to the source's, at the current step; whether that ratio at
        1x reached `training.target_ratio`."""
        state = self.state
        ppl = evaluate(model, self.windows, self.accelerator, self.batch_size)
        ratio = {length: ppl[length] / state.source_ppl[length] for length in ppl} if state.source_ppl else {}
        state.history.append({"step": state.step, "tokens": state.tokens, "ppl": ppl, "ratio": ratio})
        logged = {f"eval/ppl_{length}": value for length, value in ppl.items()}
        logged |= {f"eval/ratio_{length}": value for length, value in ratio.items()}
        self.accelerator.log({**logged, "tokens": state.tokens}, step=state.step)
        self.accelerator.print(f"step {state.step}: tokens {state.tokens:,} ppl {_fmt(ppl)} ratio {_fmt(ratio)}")
        return self.target_ratio is not None and bool(ratio) and ratio["1x"] <= self.target_ratio

    def result(self, *, stopped_at_target: bool, replica_checksums: list[float] | None) -> dict:
        """What `recovery.json` holds: the source perplexities, every evaluation, the final one."""
        state = self.state
        return {
            "source_ppl": state.source_ppl,
            "history": state.history,
            "final": state.history[-1],
            "stopped_at_target": stopped_at_target,
            "replica_checksums": replica_checksums,
        }

    def write(self, result: dict, output_dir: Path) -> None:
        """Print the table; the main process writes `recovery.json` (`result`) and `recovery.png`."""
        self.accelerator.print(recovery_table(self.state))
        if self.accelerator.is_main_process:
            (output_dir / "recovery.json").write_text(json.dumps(result, indent=2) + "\n")
            plot_recovery(self.state, output_dir / "recovery.png", self.target_ratio)


class TrainingLog:
    """The training log, step by step: the main process's progress bar (stage, loss, tokens/s) every step, and every
    `training.log_every` steps the trackers' `train/<stage>_loss` (the mean over the processes), `train/lr`,
    `train/tokens_per_second`, `tokens` and `train/grad_norm` (before clipping). A context manager: the bar closes
    on exit."""

    def __init__(self, total_steps: int, state: RunState, accelerator: Accelerator, log_every: int):
        self.state, self.accelerator, self.log_every = state, accelerator, log_every
        self.start_tokens, self.started = state.tokens, time.perf_counter()
        self.bar = tqdm(
            total=total_steps, initial=state.step, disable=not accelerator.is_main_process, desc="training", unit="step"
        )

    def __enter__(self) -> TrainingLog:
        return self

    def __exit__(self, *exc_info) -> None:
        self.bar.close()

    def step(self, *, stage: str, loss: float, lr: float, grad_norm: torch.Tensor | float | None) -> None:
        """The step `state.step` done. Every process calls this (the loss and a DTensor norm are reduced)."""
        state, accelerator = self.state, self.accelerator
        tokens_per_second = (state.tokens - self.start_tokens) / (time.perf_counter() - self.started)
        self.bar.update()
        self.bar.set_postfix(stage=stage, loss=f"{loss:.4g}", tok_s=f"{tokens_per_second:,.0f}")
        if state.step % self.log_every != 0:
            return
        logged = {
            f"train/{stage}_loss": accelerator.reduce(torch.tensor(loss, device=accelerator.device), "mean").item(),
            "train/lr": lr,
            "train/tokens_per_second": tokens_per_second,
            "tokens": state.tokens,
        }
        if grad_norm is not None:
            logged["train/grad_norm"] = _scalar(grad_norm)
        accelerator.log(logged, step=state.step)


def recovery_table(state: RunState) -> str:
    """Perplexity per evaluation length: the source model, the converted model before and after training."""
    first, last = state.history[0], state.history[-1]
    lines = [f"{'length':>8} {'source':>10} {'converted':>10} {'trained':>10} {'ratio':>7}"]
    for length, ppl in last["ppl"].items():
        source = state.source_ppl.get(length, math.nan)
        lines.append(f"{length:>8} {source:>10.4g} {first['ppl'][length]:>10.4g} {ppl:>10.4g} {ppl / source:>7.4f}")
    return "\n".join(lines + [f"after {last['tokens']:,} training tokens ({last['step']} steps)"])


def plot_recovery(state: RunState, path: Path, target_ratio: float | None) -> None:
    """recovery.png: perplexity ratio to the source against tokens seen, one line per evaluation length (the
    perplexity itself when there is no source model to compare with)."""
    metric = "ratio" if state.source_ppl else "ppl"  # without a teacher there is no ratio: plot the perplexity
    curves = {
        f"eval at {length} block_size": [(entry["tokens"], entry[metric][length]) for entry in state.history]
        for length in state.history[0][metric]
    }
    plots.plot_recovery(curves, path, ratio=bool(state.source_ppl), target=target_ratio)


def _scalar(value: torch.Tensor | float) -> float:
    """A number from a tensor, a DTensor (gathered: every process must call this) or a float (DeepSpeed's norm)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)


def _fmt(values: dict[str, float]) -> str:
    return " ".join(f"{key}={value:.4g}" for key, value in values.items())
