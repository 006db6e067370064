# Copyright 2026 The path-hf authors. Apache-2.0.
"""The stages of a recipe placed on its optimizer steps, one after another, and the learning rate at each step: each
stage its own linear warmup and cosine decay (one AdamW runs through them all, its moments carried over)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from path_hf.recipes.arguments import Stage


@dataclass(frozen=True)
class StagePlan:
    """A stage placed on the run's optimizer steps: `steps` of them from `first_step`."""

    stage: Stage
    first_step: int
    steps: int


def plan_stages(stages: list[Stage], tokens_per_step: int) -> list[StagePlan]:
    """The stages one after another, each with enough steps for its token budget (at least one)."""
    plans, first = [], 0
    for stage in stages:
        steps = max(1, math.ceil(stage.tokens / tokens_per_step))
        plans.append(StagePlan(stage, first, steps))
        first += steps
    return plans


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
