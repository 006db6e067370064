# Copyright 2026 The path-hf authors. Apache-2.0.
"""The stages of a recipe placed on its optimizer steps, one after another, and the learning rate at each step: each
stage its own linear warmup and cosine decay (one AdamW runs through them all, its moments carried over)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .arguments import PlannedStage, Stage


@dataclass(frozen=True)
class StagePlan:
    """A stage placed on the run's optimizer steps: `steps` of them from `first_step`, each of `block_size`-token
    sequences, `tokens_per_step` tokens in all."""

    stage: Stage
    first_step: int
    steps: int
    block_size: int
    tokens_per_step: int


def plan_stages(stages: list[PlannedStage], sequences_per_step: int) -> list[StagePlan]:
    """The stages (`RecipeConfig.stage_plan`) one after another, each with enough steps for its token budget (at least
    one). `sequences_per_step`: batch size x accumulation x processes."""
    plans, first = [], 0
    for planned in stages:
        tokens_per_step = planned.block_size * sequences_per_step
        steps = max(1, math.ceil(planned.stage.tokens / tokens_per_step))
        plans.append(StagePlan(planned.stage, first, steps, planned.block_size, tokens_per_step))
        first += steps
    return plans


def batches_drawn(plans: list[StagePlan], step: int, block_size: int, micro_batches: int) -> int:
    """How many micro-batches of `block_size`-token blocks the steps before `step` drew: where a run of that block
    length resumes its data (every block length has its own packing of the data, read from its start)."""
    return sum(
        micro_batches * min(max(0, step - plan.first_step), plan.steps)
        for plan in plans
        if plan.block_size == block_size
    )


def planned_steps(plans: list[StagePlan]) -> int:
    """The optimizer steps of the whole run."""
    return plans[-1].first_step + plans[-1].steps


def tokens_before(plans: list[StagePlan], step: int) -> int:
    """The training tokens of the steps before `step`, all processes together."""
    return sum(plan.tokens_per_step * min(max(0, step - plan.first_step), plan.steps) for plan in plans)


def stage_at(plans: list[StagePlan], step: int) -> StagePlan:
    """The stage that optimizer step `step` (counted from 0) belongs to."""
    return next(plan for plan in plans if step < plan.first_step + plan.steps)


def learning_rate(plan: StagePlan, step: int) -> float:
    """The stage's learning rate at global `step`: linear warmup, then cosine decay to `min_lr_ratio`."""
    stage, progress = plan.stage, step - plan.first_step
    warmup = int(stage.warmup_ratio * plan.steps)
    if progress < warmup:
        return stage.learning_rate * (progress + 1) / (warmup + 1)
    decay = (progress - warmup) / max(1, plan.steps - warmup)
    cosine = 0.5 * (1 + math.cos(math.pi * decay))
    return stage.learning_rate * (stage.min_lr_ratio + (1 - stage.min_lr_ratio) * cosine)


def set_learning_rate(optimizer: torch.optim.Optimizer, lr: float) -> None:
    """Set `lr` on every parameter group of `optimizer`."""
    for group in optimizer.param_groups:
        group["lr"] = lr
