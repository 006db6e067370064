"""lab/gpu/gpu_smollm2.py's stage bookkeeping, which the GPU run relies on and CI can check without a GPU: each
stage's rate read back from the recipe's JSONL log by stage index (two stages of one name included), and the stages
scaled by one factor to fill the training time."""

import json

import pytest

from lab.gpu import gpu_smollm2
from path_hf.recipes.schedule import plan_stages, tokens_before
from path_hf.recipes.settings import Stage, plan_stage_blocks

STAGES = [
    Stage(name="align", tokens=2048, learning_rate=1e-3),
    Stage(name="distill", tokens=4096, learning_rate=1e-4),
    Stage(name="align", tokens=4096, learning_rate=1e-4, block_size=1024),
    Stage(name="distill", tokens=8192, learning_rate=1e-4, block_size=2048),
]
RATES = [400.0, 250.0, 300.0, 100.0]  # tokens/s, one per stage
WARMUP = [3.0, 0.0, 1.5, 0.5]  # seconds the first step of each stage takes beyond its rate


def write_log(path, plans, rates=RATES, warmups=WARMUP):
    """The recipe's JSONL log of a run at these per-stage rates: tokens/s since the start, at every step."""
    rows, elapsed = [{"step": 0, "eval/ppl_1x": 10.0, "tokens": 0}], 0.0
    for plan, rate, warmup in zip(plans, rates, warmups, strict=True):
        for offset in range(plan.steps):
            step = plan.first_step + offset + 1
            elapsed += plan.tokens_per_step / rate + (warmup if offset == 0 else 0.0)
            tokens = tokens_before(plans, step)
            rows.append(
                {
                    "step": step,
                    f"train/{plan.stage.name}_loss": 1.0,
                    "train/tokens_per_second": tokens / elapsed,
                    "tokens": tokens,
                }  # fmt: skip
            )
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_stage_timing_reads_each_stage_by_index(tmp_path):
    plans = plan_stages(plan_stage_blocks(STAGES, 256), 2)
    assert [plan.steps for plan in plans] == [4, 8, 2, 2]
    write_log(tmp_path / "log.jsonl", plans)
    timing = gpu_smollm2.stage_timing(tmp_path / "log.jsonl", 1, plans)
    assert [entry["stage"] for entry in timing] == ["align", "distill", "align", "distill"]
    assert [entry["block_size"] for entry in timing] == [256, 256, 1024, 2048]
    assert [entry["tokens_per_s"] for entry in timing] == pytest.approx(RATES)
    assert [entry["warmup_s"] for entry in timing] == pytest.approx(WARMUP)


def test_stage_timing_refuses_a_log_of_other_stages(tmp_path):
    plans = plan_stages(plan_stage_blocks(STAGES, 256), 2)
    write_log(tmp_path / "log.jsonl", plan_stages(plan_stage_blocks(STAGES[:2] + STAGES[3:] + STAGES[2:3], 256), 2))
    with pytest.raises(gpu_smollm2.StepFailed, match="does not follow the planned stages"):
        gpu_smollm2.stage_timing(tmp_path / "log.jsonl", 1, plans)


def test_size_stages_fills_the_time_in_the_configured_proportions():
    plans = plan_stages(plan_stage_blocks(STAGES, 256), 2)
    rates = [{"tokens_per_s": rate} for rate in RATES]
    train_s = 1000.0
    scale, steps = gpu_smollm2.size_stages(plans, rates, train_s)
    assert sum(scale * plan.stage.tokens / rate for plan, rate in zip(plans, RATES, strict=True)) == pytest.approx(
        train_s
    )
    for plan, count in zip(plans, steps, strict=True):  # whole steps, rounded down
        assert count * plan.tokens_per_step <= scale * plan.stage.tokens < (count + 1) * plan.tokens_per_step
    planned = sum(n * plan.tokens_per_step / rate for n, plan, rate in zip(steps, plans, RATES, strict=True))
    assert planned <= train_s
    # no time left: every stage still gets its minimum of steps
    assert gpu_smollm2.size_stages(plans, rates, -5.0, minimum=2) == (0.0, [2, 2, 2, 2])
    assert gpu_smollm2.size_stages(plans, rates, 0.0)[1] == [1, 1, 1, 1]
