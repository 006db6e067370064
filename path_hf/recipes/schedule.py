# Copyright 2026 The path-hf authors. Apache-2.0.
"""The stages of a recipe placed on its optimizer steps, one after another, and the learning rate at each step: each
stage its own linear warmup and cosine decay (one AdamW runs through them all, its moments carried over)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch.optim.lr_scheduler import LambdaLR
from transformers import get_cosine_with_min_lr_schedule_with_warmup

from .settings import PlannedStage, Stage


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


def stage_scheduler(optimizer: torch.optim.Optimizer, plan: StagePlan, step: int) -> LambdaLR:
    """The learning rate of `plan`'s stage on `optimizer`, set for global `step` (the stage's first, or where a run
    resumes) and advanced by `step()` after each optimizer step: a linear warmup over `warmup_ratio` of the stage's
    steps to `stage.learning_rate`, then a cosine decay towards `min_lr_ratio` times it, transformers'
    `get_cosine_with_min_lr_schedule_with_warmup`.

    Its warmup starts at 0, a step that would train at learning rate 0; ours starts at 1/(warmup + 1) of the peak. The
    stage's steps are its steps from the second on, with a warmup of one step more over one step more: the same
    cosine, and the same warmup rates up to the order of one product (within a float64 ulp; the float32 values AdamW
    applies are the same)."""
    stage = plan.stage
    warmup = int(stage.warmup_ratio * plan.steps)
    for group in optimizer.param_groups:
        group["initial_lr"] = stage.learning_rate  # the peak: the scheduler's base learning rate
    return get_cosine_with_min_lr_schedule_with_warmup(
        optimizer,
        num_warmup_steps=warmup + 1,
        num_training_steps=plan.steps + 1,
        min_lr_rate=stage.min_lr_ratio,
        last_epoch=step - plan.first_step,  # the scheduler steps once on creation, to the stage's step + 1
    )
