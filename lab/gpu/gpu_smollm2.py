"""(d) SmolLM2-135M-Instruct converted to PaTH, recovered and evaluated on one GPU with the project's own commands.

The `smollm2` section of lab/gpu/gpu_bench.py. From the GGUF (lab/gpu/gpu_carry.py brings it to the GPU machine)
and recipes/configs/smollm2-135m-gpu.yaml (the CPU recipe's design: RoPE interleaved with PaTH, FLA's init, the
forget gate; align and distill at 512-token blocks, then at 2048; plus a last distill stage at 8192, the source's
whole context; bf16, FLA's kernels):

1. `path-hf convert` with the config's `model.convert` options. `start()` launches it at once: it runs on the CPU
   while gpu_bench.py's FLA sections hold the GPU.
2. `path-hf eval` of the source, the source with YaRN and with dynamic NTK, and the converted model (PaTH at step 0)
   on both held-out texts: two processes in the background (most of their time is parsing the GGUF on the CPU).
3. A probe: the recipe (`accelerate launch recipes/train.py`) for a few steps of each stage. Its JSONL log gives
   each stage's tokens/s past the first steps (compilation, autotuning), and the time stamps of its output lines the
   run's fixed costs: the start up to the first training step, one evaluation, and what follows the last one.
   Stages are told apart by their index (the config has two align and three distill stages): a logged step belongs
   to the stage the recipe's own schedule (path_hf.recipes.schedule) places it in.
4. The recovery run: the same recipe with every stage's configured token budget scaled by one common factor (the
   config's proportions are the design), chosen from the probe's rates to fill the time left before the deadline,
   each stage rounded down to whole steps; evaluated a few times on the way.
5. `path-hf eval` of the recovered model, as it is and with YaRN on its RoPE (factor PATH_YARN_FACTOR), on both
   texts; each text's table joins the two evaluations.

A step that fails or runs out of time is recorded, and the rest goes on where it can. `--dry-run-cpu` (gpu_bench.py)
runs the same steps on a CPU: torch backend, float32, a few training steps, short lengths.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path

from path_hf.evaluation import common_train_length
from path_hf.recipes.models import convert_flags
from path_hf.recipes.schedule import StagePlan, plan_stages, stage_at, tokens_before
from path_hf.recipes.settings import RecipeConfig

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "recipes" / "configs" / "smollm2-135m-gpu.yaml"
TEXTS = {
    "pydocs": ("examples/default_model/data/eval.jsonl.xz", "held-out Python docs, like the training text"),
    "copyright": (
        "examples/data/copyright_does_not_exist/eval.jsonl.xz",
        "Copyright Does Not Exist, never trained on",
    ),
}
MARGIN_S = 15  # kept free before the deadline
PROCESSES = 1  # training processes: the launch options' one GPU (or one CPU process)
# YaRN on the recovered model's RoPE past the source's context: the factor the CPU recipe's evaluations use (chosen on
# training text; `@yarn` alone would scale by length / 8192)
PATH_YARN_FACTOR = 1.5


@dataclass(frozen=True)
class Settings:
    """What differs between the GPU run and the CPU dry run."""

    lengths: tuple[int, ...]  # path-hf eval --lengths
    eval_tokens: int  # path-hf eval --max-tokens
    train_length: int | None  # path-hf eval --train-length (None: the models' own, 8192)
    launch: tuple[str, ...]  # accelerate launch options
    overrides: tuple[str, ...]  # recipe overrides besides models, block lengths, stages' tokens and output
    block_sizes: tuple[tuple[int, int], ...]  # (configured, stand-in) block lengths, data.block_size's and stages'
    probe_steps: int  # steps of each stage at data.block_size in the probe (longer blocks: the same tokens)
    probe_skip: int  # first steps of each stage left out of its rate
    max_train_s: float | None  # cap on the recovery run's training time
    min_steps_per_stage: int  # steps of each stage even when no time is left (0: skip the run then)
    recovery_evals: int  # evaluations during the recovery run, besides the first and the last
    eval_threads: int  # OMP threads of each evaluation process (when OMP_NUM_THREADS is not set)
    final_eval_s: float  # kept for the recovered model's evaluation when no measurement says better


GPU = Settings(
    lengths=(512, 2048, 8192, 16384, 32768),
    eval_tokens=65536,
    train_length=None,
    launch=("--config_file", "recipes/accelerate/single_gpu.yaml"),
    overrides=(),
    block_sizes=(),
    probe_steps=10,
    probe_skip=3,
    max_train_s=None,
    min_steps_per_stage=0,
    recovery_evals=5,
    eval_threads=4,
    final_eval_s=60,
)
DRY_RUN_CPU = Settings(
    lengths=(64, 128, 256),
    eval_tokens=256,
    train_length=64,  # so that YaRN and dynamic NTK scale at 128 and 256, as they do past 8192 on the GPU
    launch=(
        "--cpu",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "no",
        "--dynamo_backend",
        "no",
    ),
    overrides=(
        "data.eval_tokens=256",
        "training.batch_size=2",
        "training.gradient_accumulation_steps=2",
        "training.eval_batch_size=2",
        "training.eval_lengths=[1,2,4]",
        "model.teacher_dtype=float32",
    ),
    block_sizes=((512, 64), (2048, 128), (8192, 256)),  # the stages' order of lengths, at the evaluations' lengths
    probe_steps=3,
    probe_skip=1,
    max_train_s=30,
    min_steps_per_stage=2,  # the dry run checks the path, not the timing
    recovery_evals=1,
    eval_threads=1,
    final_eval_s=240,
)


class Process:
    """A command running in its own process group, its output (stderr too) in a log file with each line's time since
    the start; `marks` holds when lines matching `watch` patterns appeared."""

    def __init__(
        self, name: str, command: list[str], log: Path, env: dict[str, str], watch: dict[str, str] | None = None
    ):
        self.name, self.command, self.log = name, command, log
        self.watch = {key: re.compile(pattern) for key, pattern in (watch or {}).items()}
        self.marks: dict[str, list[float]] = {key: [] for key in self.watch}
        self.started = time.monotonic()
        self.ended: float | None = None  # when its output closed: it exited
        self.seconds: float | None = None
        self.returncode: int | None = None
        log.parent.mkdir(parents=True, exist_ok=True)
        print(f"[smollm2] {name}: {' '.join(command)}", flush=True)
        self.popen = subprocess.Popen(
            command,
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            process_group=0,  # accelerate launch's child too: one killpg stops both
        )
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with self.log.open("w") as log:
            for line in self.popen.stdout:  # universal newlines: tqdm's \r updates are lines too
                now = time.monotonic() - self.started
                log.write(f"[{now:7.1f} s] {line.rstrip()}\n")
                log.flush()
                for key, pattern in self.watch.items():
                    if pattern.search(line):
                        self.marks[key].append(now)
        self.ended = time.monotonic()

    def running(self) -> bool:
        return self.popen.poll() is None

    def wait(self, deadline: float) -> int | None:
        """The exit status, or None if it was still running at `deadline` (then it is stopped: SIGTERM, which the
        recipe answers with a checkpoint, then SIGKILL)."""
        try:
            self.returncode = self.popen.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            self.stop()
        self.reader.join(timeout=10)
        self.seconds = round((self.ended or time.monotonic()) - self.started, 1)
        print(f"[smollm2] {self.name}: exit {self.returncode} after {self.seconds} s", flush=True)
        return self.returncode

    def stop(self) -> None:
        for sig, grace in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
            if self.popen.poll() is not None:
                return
            try:
                os.killpg(self.popen.pid, sig)
            except ProcessLookupError:
                return
            try:
                self.popen.wait(timeout=grace)
            except subprocess.TimeoutExpired:
                continue

    def record(self) -> dict:
        return {"command": self.command, "returncode": self.returncode, "seconds": self.seconds}


class StepFailed(Exception):
    """A step of the run that failed or ran out of time; the message names it and its log."""


def stage_index(plans: list[StagePlan], step: int) -> int:
    """The index of the stage that logged step `step` (counted from 1, as the log counts) belongs to."""
    return plans.index(stage_at(plans, step - 1))


def size_stages(plans: list[StagePlan], rates: list[dict], train_s: float, minimum: int = 0) -> tuple[float, list[int]]:
    """Every stage's configured tokens scaled by one factor k, so that sum_i k * tokens_i / rate_i (`rates`: each
    stage's `tokens_per_s`) is `train_s`; returns k and each stage's steps: k * tokens_i rounded down to whole steps of
    the stage's own tokens per step, at least max(1, `minimum`)."""
    configured_s = sum(plan.stage.tokens / rate["tokens_per_s"] for plan, rate in zip(plans, rates, strict=True))
    scale = max(0.0, train_s) / configured_s
    return scale, [max(1, minimum, int(scale * plan.stage.tokens) // plan.tokens_per_step) for plan in plans]


def stage_timing(log: Path, skip: int, plans: list[StagePlan]) -> list[dict | None]:
    """Each stage's (by index: `plans`, the run's schedule) `tokens_per_s` past its first `skip` steps (fewer if it has
    fewer than skip + 2 steps) and `warmup_s`, what its first steps took beyond that rate (compilation, autotuning);
    None for a stage of fewer than two logged steps. From the recipe's JSONL log (training.log_every=1), which holds
    the tokens/s since training started: a step ends at tokens / tokens_per_s. StepFailed if the log does not follow
    `plans` (a step's stage name or tokens)."""
    steps = [row for row in map(json.loads, log.read_text().splitlines()) if "train/tokens_per_second" in row]
    if not steps:
        raise StepFailed(f"{log} logged no training step")
    ends: list[list[tuple[int, float]]] = [[] for _ in plans]
    for row in steps:
        index = stage_index(plans, row["step"])
        name = next(key.removeprefix("train/").removesuffix("_loss") for key in row if key.endswith("_loss"))
        if name != plans[index].stage.name or row["tokens"] != tokens_before(plans, row["step"]):
            raise StepFailed(
                f"{log}: step {row['step']} ({name}, {row['tokens']:,} tokens) does not follow the planned stages "
                f"(stage {index}: {plans[index].stage.name}, {tokens_before(plans, row['step']):,} tokens)"
            )
        ends[index].append((row["tokens"], row["tokens"] / row["train/tokens_per_second"]))
    timing, stage_start = [], 0.0
    for plan, points in zip(plans, ends, strict=True):
        entry = None
        if len(points) >= 2:
            first = min(skip, len(points) - 2)
            (tokens0, end0), (tokens1, end1) = points[first], points[-1]
            rate = (tokens1 - tokens0) / (end1 - end0)
            warmup = end0 - stage_start - (first + 1) * plan.tokens_per_step / rate
            entry = {
                "stage": plan.stage.name,
                "block_size": plan.block_size,
                "tokens_per_s": rate,
                "warmup_s": max(0.0, warmup),
            }
        timing.append(entry)
        if points:
            stage_start = points[-1][1]
    return timing


def block_overrides(config: RecipeConfig, sizes: dict[int, int]) -> list[str]:
    """Recipe overrides that replace the block lengths of `config` (data.block_size and the stages' own) by their
    stand-ins in `sizes`."""
    overrides = [f"data.block_size={sizes[config.data.block_size]}"] if config.data.block_size in sizes else []
    return overrides + [
        f"stages.{index}.block_size={sizes[stage.block_size]}"
        for index, stage in enumerate(config.stages)
        if stage.block_size in sizes
    ]


def merge_reports(before: dict, after: dict | None) -> dict:
    """One `path-hf eval` report of every model of both evaluations (the same text, lengths and windows)."""
    merged = {**before, "models": {**before["models"], **((after or {}).get("models") or {})}}
    merged["train_length"] = common_train_length(merged["models"].values())
    return merged


def goals(report: dict, block: int) -> dict[str, float | bool]:
    """The recovery goals, where the report holds what they need: the recovered model against the source at the
    training block, against itself at 8192, and the recovered model, as it is and with YaRN on its RoPE, against the
    source with YaRN at 16384 and 32768."""
    models = report["models"]
    if "path-recovered" not in models or "source" not in models:
        return {}

    def ppl(label: str, length: int) -> float | None:
        entry = models.get(label, {}).get("lengths", {}).get(str(length))
        return entry["ppl"] if entry else None

    found = {}
    if (recovered := ppl("path-recovered", block)) and (source := ppl("source", block)):
        found["ratio_at_block"] = recovered / source
        found["ratio_at_block <= 1.05"] = recovered / source <= 1.05
    if (at_16k := ppl("path-recovered", 16384)) and (at_8k := ppl("path-recovered", 8192)):
        found["16384 / 8192 (recovered)"] = at_16k / at_8k
        found["16384 within 1.1x of 8192"] = at_16k / at_8k <= 1.1
    for label, name in (("path-recovered", "recovered"), ("path-recovered+yarn", "recovered + YaRN")):
        for length, better in ((16384, "no worse than"), (32768, "better than")):
            if (recovered := ppl(label, length)) and (yarn := ppl("source+yarn", length)):
                found[f"{length}: {name} / source + YaRN"] = recovered / yarn
                found[f"{length}: {name} {better} source + YaRN"] = (
                    recovered <= yarn if length == 16384 else recovered < yarn
                )
    return found


class SmolLM2Run:
    """The run, its processes and its results (`result`, a JSON-ready dict filled as it goes)."""

    def __init__(
        self,
        gguf: Path,
        work: Path,
        out: Path,
        settings: Settings,
        result: dict,
        record_error: Callable[[str], None],
        save: Callable[[], None],
    ):
        from path_hf.recipes.settings import parse_config

        self.gguf, self.work, self.out, self.settings = gguf, work, out, settings
        self.result, self.record_error, self.save = result, record_error, save
        configured = parse_config(["--config", str(CONFIG), *settings.overrides])
        self.overrides = (*settings.overrides, *block_overrides(configured, dict(settings.block_sizes)))
        self.config = parse_config(["--config", str(CONFIG), *self.overrides])
        training = self.config.training
        self.sequences_per_step = training.batch_size * training.gradient_accumulation_steps * PROCESSES
        self.converted = work / "converted"
        self.main_tokens: list[int] | None = None  # each stage's tokens in the recovery run, once sized
        self.processes: list[Process] = []
        result.update(
            {
                "gguf": str(gguf),
                "config": str(CONFIG.relative_to(REPO)),
                "settings": asdict(settings),
                "block_size": self.config.data.block_size,
                "stages": [
                    {"stage": plan.stage.name, "block_size": plan.block_size, "tokens_per_step": plan.tokens_per_step}
                    for plan in self.plans()
                ],
                "steps": {},
            }
        )

    def plans(self, stage_tokens: list[int] | None = None) -> list[StagePlan]:
        """The recipe's schedule of the config's stages (with `stage_tokens`, each stage's tokens, if given)."""
        config = self.config
        if stage_tokens is not None:
            stages = [replace(stage, tokens=tokens) for stage, tokens in zip(config.stages, stage_tokens, strict=True)]
            config = replace(config, stages=stages)
        return plan_stages(config.stage_plan, self.sequences_per_step)

    # -------------------------------------------------------------------------------------------------- plumbing

    def env(self, threads: int | None = None) -> dict[str, str]:
        env = {
            **os.environ,
            "HF_HUB_OFFLINE": "1",
            "HF_DATASETS_OFFLINE": "1",
            "TRANSFORMERS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(self.work / "hf-datasets"),  # the probe's tokenised blocks serve the main run
            "TQDM_MININTERVAL": "10",
            "PYTHONUNBUFFERED": "1",
        }
        if threads and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = str(threads)
        return env

    def launch(self, name: str, command: list[str], threads: int | None = None, watch: dict | None = None) -> Process:
        process = Process(name, command, self.work / "logs" / f"{name}.log", self.env(threads), watch)
        self.processes.append(process)
        return process

    def finished(self, process: Process, deadline: float) -> Process:
        """Wait for `process` and record it; StepFailed if it failed or ran out of time."""
        returncode = process.wait(deadline)
        self.result["steps"][process.name] = process.record()
        self.save()
        if returncode != 0:
            why = "ran out of time" if returncode is None else f"exited with {returncode}"
            raise StepFailed(f"{process.name} {why}; its log: {process.log}")
        return process

    def attempt(self, what: str, fn: Callable[[], object]) -> object | None:
        try:
            return fn()
        except Exception as error:  # one step failing must not lose the others' results
            self.record_error(f"smollm2 {what}: {error if isinstance(error, StepFailed) else repr(error)}")
            return None
        finally:
            self.save()

    def close(self) -> None:
        """Stop whatever is still running (the deadline passed, or the benchmark itself is stopping)."""
        for process in self.processes:
            if process.running():
                process.stop()

    def cli(self, *args: str) -> list[str]:
        # `path-hf ...` where the package is not installed: this checkout's path_hf, on PYTHONPATH (run.sh).
        return [sys.executable, "-m", "path_hf", *args]

    def recipe(self, output_dir: Path, stage_tokens: list[int], *overrides: str) -> list[str]:
        return [
            sys.executable,
            "-m",
            "accelerate.commands.launch",  # `accelerate launch`
            *self.settings.launch,
            "recipes/train.py",
            "--config",
            str(CONFIG.relative_to(REPO)),
            *self.overrides,
            f"model.path={self.converted}",
            "model.convert={}",
            f"model.teacher={self.gguf}",
            f"training.output_dir={output_dir}",
            *(f"stages.{index}.tokens={tokens}" for index, tokens in enumerate(stage_tokens)),
            *overrides,
        ]

    def evaluate(self, name: str, text: str, models: list[str]) -> Process:
        s = self.settings
        command = self.cli(
            "eval",
            *(arg for model in models for arg in ("--model", model)),
            "--data",
            TEXTS[text][0],
            "--lengths",
            ",".join(map(str, s.lengths)),
            "--max-tokens",
            str(s.eval_tokens),
            "--passkey-trials",
            "0",
            "--dtype",
            "float32",
            "--no-progress",
            "--output",
            str(self.work / "evals" / f"{name}.json"),
            "--force",
            *(["--train-length", str(s.train_length)] if s.train_length else []),
        )
        (self.work / "evals").mkdir(parents=True, exist_ok=True)
        return self.launch(name, command, threads=s.eval_threads)

    # ----------------------------------------------------------------------------------------------------- steps

    def start(self) -> None:
        """Clear earlier outputs and launch the conversion (CPU only)."""
        for name in ("converted", "probe", "main", "evals", "logs"):
            shutil.rmtree(self.work / name, ignore_errors=True)
        self.work.mkdir(parents=True, exist_ok=True)
        self.convert = self.launch(
            "convert",
            self.cli(
                "convert",
                "--from",
                str(self.gguf),
                "--to",
                str(self.converted),
                *convert_flags(self.config.model.convert),
            ),
        )

    def finish(self, deadline: float) -> None:
        """Steps 2-5 after the conversion, everything ending by `deadline` (time.monotonic())."""
        stop_by = deadline - MARGIN_S
        try:
            if self.attempt("convert", lambda: self.finished(self.convert, stop_by)) is None:
                return
            before = {
                text: self.evaluate(
                    f"eval-{text}-before",
                    text,
                    [
                        f"source={self.gguf}",
                        f"source+yarn={self.gguf}@yarn",
                        f"source+dynamic={self.gguf}@dynamic",
                        f"path-step0={self.converted}",
                    ],
                )
                for text in TEXTS
            }
            probe = self.attempt("probe", lambda: self.probe(stop_by))
            main = probe and self.attempt("recovery run", lambda: self.recover(probe, before, stop_by))
            after = {}
            if main:
                self.attempt("recovery curve", self.recovery)
                after = {text: self.evaluate(f"eval-{text}-after", text, self.recovered_models()) for text in TEXTS}
            for process in [*before.values(), *after.values()]:
                self.attempt(process.name, lambda p=process: self.finished(p, stop_by))
            self.attempt("tables", self.tables)
        finally:
            self.close()
            self.collect_logs()

    def recovered_models(self) -> list[str]:
        """`path-hf eval --model` of the recovered model: as it is, and with YaRN on its RoPE."""
        final = self.work / "main" / "final"
        return [f"path-recovered={final}", f"path-recovered+yarn={final}@yarn:{PATH_YARN_FACTOR:g}"]

    def probe_tokens(self) -> list[int]:
        """Each stage's tokens in the probe: `probe_steps` steps at data.block_size, as many tokens at longer blocks
        but at least probe_skip + 2 steps (a rate needs two logged steps past the skipped ones)."""
        s = self.settings
        tokens = s.probe_steps * self.config.data.block_size * self.sequences_per_step
        return [max(s.probe_skip + 2, tokens // plan.tokens_per_step) * plan.tokens_per_step for plan in self.plans()]

    def probe(self, stop_by: float) -> dict:
        tokens = self.probe_tokens()
        process = self.launch(
            "probe",
            self.recipe(
                self.work / "probe",
                tokens,
                "training.log_every=1",
                "training.eval_every=1000000000",
                "training.save_every=1000000000",
            ),
            watch={"source": r"^source model: ppl", "eval": r"^step \d+: tokens"},
        )
        self.finished(process, stop_by)
        stages = stage_timing(
            self.work / "probe" / "logs" / "recovery" / "log.jsonl", self.settings.probe_skip, self.plans(tokens)
        )
        if missing := [
            f"{index} ({stage.name})" for index, stage in enumerate(self.config.stages) if not stages[index]
        ]:
            raise StepFailed(f"the probe logged too few steps of stage {', '.join(missing)} for a rate: {process.log}")
        marks = process.marks
        if not marks["source"] or len(marks["eval"]) < 2:
            raise StepFailed(f"the probe printed no evaluation lines; its log: {process.log}")
        measured = {
            "stages": stages,
            "stage_tokens": tokens,
            "start_s": round(marks["eval"][0], 1),  # launch to the first training step (after the first evaluation)
            "eval_s": round(marks["eval"][0] - marks["source"][0], 1),  # one evaluation of the student
            "end_s": round(process.seconds - marks["eval"][-1], 1),  # the last evaluation's line to the exit
            "seconds": process.seconds,
        }
        self.result["probe"] = measured
        print(f"[smollm2] probe: {json.dumps(measured)}", flush=True)
        return measured

    def final_eval_s(self, before: dict[str, Process]) -> float:
        """Time to keep for the recovered model's evaluations: the converted model's (same size, same lengths) as the
        background evaluation measured it, once per evaluated variant, with room for starting, else the settings'
        guess."""
        estimates = []
        for process in before.values():
            report = self.work / "evals" / f"{process.name}.json"
            if process.running() or not report.is_file():
                return self.settings.final_eval_s
            lengths = json.loads(report.read_text())["models"]["path-step0"]["lengths"].values()
            # the recovered model is evaluated twice (as it is, with YaRN), each like PaTH at step 0
            estimates.append(20 + 1.5 * len(self.recovered_models()) * sum(entry["seconds"] for entry in lengths))
        return max(estimates)

    def recover(self, probe: dict, before: dict[str, Process], stop_by: float) -> bool:
        """The recovery run, its stages sized to fill the training time left: every stage's configured tokens scaled
        by one factor k, so that sum_i k * tokens_i / rate_i (the probe's rates) is that time, each stage then rounded
        down to whole steps of its own tokens per step (at least max(1, min_steps_per_stage))."""
        stages = probe["stages"]
        final_eval_s = self.final_eval_s(before)
        left = stop_by - time.monotonic() - final_eval_s
        evals = self.settings.recovery_evals
        warmup_s = sum(stage["warmup_s"] for stage in stages)
        train_s = left - probe["start_s"] - (evals + 1) * probe["eval_s"] - probe["end_s"] - warmup_s
        if self.settings.max_train_s is not None:
            train_s = min(train_s, self.settings.max_train_s)
        minimum = self.settings.min_steps_per_stage
        if train_s < 10 and not minimum:
            raise StepFailed(f"{left:.0f} s left leave {train_s:.0f} s of training: skipped")
        plans = self.plans()
        scale, steps = size_stages(plans, stages, train_s, minimum)
        stage_tokens = [count * plan.tokens_per_step for count, plan in zip(steps, plans, strict=True)]
        total_steps = sum(steps)
        sizing = {
            "train_s": round(train_s, 1),
            "final_eval_s": round(final_eval_s, 1),
            "scale": scale,
            "stage_tokens": stage_tokens,
            "stage_steps": steps,
            "planned_s": round(
                sum(tokens / rate["tokens_per_s"] for tokens, rate in zip(stage_tokens, stages, strict=True)), 1
            ),
            "eval_every": max(1, total_steps // (evals + 1)),
        }
        self.result["sizing"] = sizing
        self.main_tokens = stage_tokens
        print(f"[smollm2] recovery run sized: {json.dumps(sizing)}", flush=True)
        process = self.launch(
            "main",
            self.recipe(
                self.work / "main",
                stage_tokens,
                "training.log_every=1",
                f"training.eval_every={sizing['eval_every']}",
                "training.save_every=1000000000",
            ),
        )
        self.finished(process, stop_by)
        return True

    def recovery(self) -> None:
        """The recovery run's curve (recovery.json, recovery.png) and its tokens/s past the first steps."""
        main = self.work / "main"
        stages = stage_timing(
            main / "logs" / "recovery" / "log.jsonl", self.settings.probe_skip, self.plans(self.main_tokens)
        )
        recovery = json.loads((main / "recovery.json").read_text())
        self.result["recovery"] = {
            "stages": stages,
            "source_ppl": recovery["source_ppl"],
            "history": recovery["history"],
        }
        if (main / "recovery.png").is_file():
            shutil.copyfile(main / "recovery.png", self.out / "smollm2_recovery.png")

    def tables(self) -> None:
        """Each text's report (every model), its Markdown table, its plot and the goals it shows."""
        from path_hf.evaluation import format_table, plot_lengths

        self.result.setdefault("eval", {})
        self.result.setdefault("tables", {})
        for text, (path, about) in TEXTS.items():
            before_file = self.work / "evals" / f"eval-{text}-before.json"
            after_file = self.work / "evals" / f"eval-{text}-after.json"
            if not before_file.is_file():
                continue
            after = json.loads(after_file.read_text()) if after_file.is_file() else None
            report = merge_reports(json.loads(before_file.read_text()), after)
            report["goals"] = goals(report, self.config.data.block_size)
            self.result["eval"][text] = report
            self.result["tables"][text] = f"{path} ({about})\n\n{format_table(report)}"
            print(self.result["tables"][text], flush=True)
            ppl = {
                label: {int(n): e["ppl"] for n, e in record["lengths"].items() if math.isfinite(e["ppl"])}
                for label, record in report["models"].items()
            }
            plot_lengths(
                ppl, self.out / f"smollm2_lengths_{text}.png", report["train_length"], title=f"SmolLM2-135M: {about}"
            )

    def collect_logs(self, tail_bytes: int = 100_000) -> None:
        """Every process's log (the last `tail_bytes` of each) in one file beside the results."""
        with (self.out / "smollm2_logs.txt").open("w") as combined:
            for process in self.processes:
                text = process.log.read_text(errors="replace") if process.log.is_file() else ""
                cut = f" (last {tail_bytes} bytes)" if len(text) > tail_bytes else ""
                combined.write(f"===== {process.name}{cut}: {' '.join(process.command)}\n{text[-tail_bytes:]}\n")


def _stage_rates(stages: list[dict | None]) -> str:
    return ", ".join(
        f"{index} {stage['stage']}@{stage['block_size']} {stage['tokens_per_s']:,.0f} tokens/s (first steps "
        f"{stage['warmup_s']:.1f} s longer)"
        if stage
        else f"{index}: too few steps"
        for index, stage in enumerate(stages)
    )


def markdown(result: dict) -> list[str]:
    """The section's lines in gpu_bench.md."""
    lines = [
        "",
        "## (d) SmolLM2-135M-Instruct: RoPE interleaved with PaTH + forget gate; align, distill at 512, 2048, 8192",
        "",
    ]
    if probe := result.get("probe"):
        lines.append(
            f"- probe: {_stage_rates(probe['stages'])}; start {probe['start_s']} s, one evaluation "
            f"{probe['eval_s']} s, end {probe['end_s']} s"
        )
    if sizing := result.get("sizing"):
        tokens = ", ".join(
            f"{index} {stage['stage']}@{stage['block_size']} {count:,}"
            for index, (stage, count) in enumerate(zip(result["stages"], sizing["stage_tokens"], strict=True))
        )
        lines.append(
            f"- recovery run sized to {tokens} tokens (the config's budgets x {sizing['scale']:.3g}, whole steps; "
            f"{sizing['train_s']} s of training available, {sizing['planned_s']} s planned)"
        )
    if recovery := result.get("recovery"):
        lines += [
            f"- recovery run, measured: {_stage_rates(recovery['stages'])}",
            "",
            "Recovery (ratio to the source):",
            "",
        ]
        lengths = list(recovery["history"][0]["ratio"])
        lines += ["| tokens | " + " | ".join(lengths) + " |", "|---:|" + "---:|" * len(lengths)]
        for entry in recovery["history"]:
            lines.append(f"| {entry['tokens']:,} | " + " | ".join(f"{entry['ratio'][n]:.3f}" for n in lengths) + " |")
    for text, table in result.get("tables", {}).items():
        lines += ["", f"### {text}", "", table]
        if found := result["eval"][text].get("goals"):
            lines += [
                "",
                "Goals: "
                + "; ".join(f"{k}: {v:.3f}" if isinstance(v, float) else f"{k}: {v}" for k, v in found.items()),
            ]
    steps = result.get("steps", {})
    if steps:
        lines += ["", "Wall time: " + ", ".join(f"{name} {step['seconds']} s" for name, step in steps.items())]
    return lines
