# Copyright 2026 The path-hf authors. Apache-2.0.
"""The settings of recipes/train.py: dataclasses with help text, read once from a YAML file and `key=value` overrides.

    accelerate launch recipes/train.py --config recipes/configs/tiny-cpu.yaml training.output_dir=runs/x \\
        stages.0.tokens=1e5

A YAML file has four sections: `model` (`ModelSettings`), `data` (`DataSettings`), `stages` (a list of `Stage`) and
`training` (`TrainingSettings`). Every key is checked before any work starts: an unknown key, a missing required
key, a wrong type or a value outside its choices fails naming the field (`training.batch_size`, `stages.0.name`).
`python recipes/train.py --help` lists every key with its default and help.
"""

from __future__ import annotations

import argparse
import importlib.util
import math
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path

import yaml

from ..arguments import DTYPES, add_arguments, describe_fields, from_arguments, from_mapping
from ..errors import RecipeError

STAGES = ("align", "distill", "lm")
TRAINABLE = ("path", "gate", "attention", "full", "lora")
# The sets a stage may narrow the run's to, each a subset of the next.
NESTED_TRAINABLE = ("gate", "path", "attention", "full")
TRACKERS = ("tensorboard", "jsonl", "wandb")


def _help(text: str, **metadata) -> dict:
    return {"help": text, **metadata}


@dataclass
class ModelSettings:
    path: str = field(
        metadata=_help(
            "the model to recover: a converted PaTH checkpoint (model_type path_llama), or a RoPE Llama/Qwen source "
            "(checkpoint directory, hub id or llama.cpp .gguf file) that is converted on the fly with `convert` into "
            "<output_dir>/converted"
        )
    )
    teacher: str | None = field(
        default=None,
        metadata=_help(
            "the source RoPE model (checkpoint directory, hub id or .gguf file): the perplexity baseline and the "
            "teacher of the align and distill stages. Default: `path` when it is a RoPE model, else the source "
            "recorded by the converter (config.path_conversion)"
        ),
    )
    convert: dict = field(
        default_factory=dict,
        metadata=_help(
            "options of `path-hf convert` (`path_hf.conversion.options.ConvertOptions` fields: rope, init, "
            "forget_gate, layers, w_rank, conv_size, seed, dtype, allow_nonfinite, follow_symlinks, ...) used when "
            "`path` is a RoPE model"
        ),
    )
    dtype: str = field(
        default="float32", metadata=_help("dtype the trained model is loaded in (master weights)", choices=DTYPES)
    )
    teacher_dtype: str = field(
        default="float32",
        metadata=_help(
            "dtype of the frozen teacher; auto: bfloat16 where the device multiplies bfloat16 matrices fast (a CUDA "
            "GPU that supports it, a CPU with AMX or AVX-512 BF16), float32 elsewhere",
            choices=(*DTYPES, "auto"),
        ),
    )


@dataclass
class DataSettings:
    train_files: list[str] = field(
        default_factory=list,
        metadata=_help(
            "local .txt (documents separated by blank lines), .jsonl/.json or .parquet files; or use `dataset`"
        ),
    )
    dataset: str | None = field(default=None, metadata=_help("a hub dataset name, instead of train_files"))
    dataset_config: str | None = field(default=None, metadata=_help("the hub dataset's configuration name"))
    dataset_split: str = field(default="train", metadata=_help("the hub dataset's split"))
    streaming: bool = field(
        default=False,
        metadata=_help("stream the data (hub or local files) instead of preparing it all first; for large datasets"),
    )
    text_field: str = field(default="text", metadata=_help("column holding the text of .jsonl/.parquet/hub data"))
    eval_files: list[str] = field(
        default_factory=list,
        metadata=_help("held-out evaluation files; if empty, the first `eval_documents` documents are held out"),
    )
    eval_documents: int = field(
        default=100, metadata=_help("documents held out of the training data for evaluation (without eval_files)")
    )
    eval_tokens: int = field(default=100_000, metadata=_help("at most this many evaluation tokens are scored"))
    block_size: int = field(default=2048, metadata=_help("tokens per packed training sequence"))
    shuffle_seed: int = field(default=0, metadata=_help("seed of the order of the training blocks"))
    shuffle_buffer: int = field(default=10_000, metadata=_help("shuffle buffer (documents) when streaming"))


@dataclass
class Stage:
    name: str = field(
        metadata=_help(
            "align: each PaTH layer's attention output matched to the source layer's on the same input (MSE); "
            "distill: KL to the source model's next-token distribution; lm: plain language modelling",
            choices=STAGES,
        )
    )
    tokens: int = field(metadata=_help("training tokens of this stage (all processes together)"))
    learning_rate: float = field(metadata=_help("peak learning rate"))
    warmup_ratio: float = field(default=0.05, metadata=_help("fraction of the stage's steps of linear warmup"))
    min_lr_ratio: float = field(default=0.1, metadata=_help("cosine decay ends at learning_rate * min_lr_ratio"))
    block_size: int | None = field(
        default=None,
        metadata=_help(
            "tokens per packed training sequence in this stage (default data.block_size): e.g. a last stage at "
            "longer blocks, for the attention at distances the first stages never showed"
        ),
    )
    trainable: str | None = field(
        default=None, metadata=_help("a narrower set than training.trainable for this stage (default: the run's)")
    )
    activation_checkpointing: bool | None = field(
        default=None,
        metadata=_help(
            "recompute activations in backward in this stage (default training.activation_checkpointing): e.g. off "
            "at short blocks, where memory is no constraint and recomputing costs time, on at long ones"
        ),
    )
    retrieval: float = field(
        default=0.0,
        metadata=_help(
            "share of the stage's blocks made synthetic retrieval blocks (distill stages): needle sentences with "
            "keys put in the text, questions about them at the end, the answers also trained on with cross entropy "
            "(path_hf.recipes.retrieval_blocks; its templates are not the evaluation's)"
        ),
    )
    retrieval_weight: float = field(
        default=1.0, metadata=_help("weight of the answers' cross entropy beside the distillation loss")
    )
    kl_stride: int = field(
        default=1,
        metadata=_help(
            "a distill stage forms the KL at every k-th position only: an estimate at 1/k of the output head's cost "
            "(on a CPU the head's products and softmax over the vocabulary are most of a small model's step)"
        ),
    )
    local_window: list[int] | int | None = field(
        default=None,
        metadata=_help(
            "the local layers' window in this stage's training steps, shorter than the block so that only the PaTH "
            "layers of a hybrid see its far part: one number, or a list drawn from at random each step (default: the "
            "model's local_window). Evaluation and the saved model keep the model's own"
        ),
    )

    @property
    def local_windows(self) -> list[int]:
        """The training windows of the stage (`local_window` as a list; empty: the model's own)."""
        if self.local_window is None:
            return []
        return [self.local_window] if isinstance(self.local_window, int) else list(self.local_window)


@dataclass
class TrainingSettings:
    output_dir: str = field(metadata=_help("run directory: converted model, checkpoints, logs, final model"))
    trainable: str = field(
        default="path",
        metadata=_help(
            "path: only the new PaTH parameters; gate: only beta and the forget gate (bt_proj, g_proj and their "
            "gains: long-context tuning of how far attention reaches); attention: PaTH parameters and q/k/v/o of the "
            "PaTH layers; full: everything; lora: LoRA on lora_target_modules, the PaTH parameters fully trained, "
            "merged at the end",
            choices=TRAINABLE,
        ),
    )
    lora_r: int = field(default=16, metadata=_help("LoRA rank"))
    lora_alpha: int = field(default=32, metadata=_help("LoRA alpha"))
    lora_dropout: float = field(default=0.0, metadata=_help("LoRA dropout"))
    lora_target_modules: list[str] | str = field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"],
        metadata=_help("module names LoRA wraps, or 'all-linear' (the PaTH projections are never wrapped)"),
    )
    batch_size: int = field(default=8, metadata=_help("sequences per process per micro-batch"))
    gradient_accumulation_steps: int = field(default=1, metadata=_help("micro-batches per optimizer step"))
    weight_decay: float = field(default=0.0, metadata=_help("AdamW weight decay"))
    max_grad_norm: float = field(default=1.0, metadata=_help("gradient clipping norm; 0 turns clipping off"))
    distill_temperature: float = field(default=1.0, metadata=_help("softmax temperature of the distill stage"))
    activation_checkpointing: bool = field(default=False, metadata=_help("recompute activations in backward"))
    eval_every: int = field(default=100, metadata=_help("evaluate perplexity every N optimizer steps (and at the end)"))
    eval_lengths: list[int] = field(
        default_factory=lambda: [1, 2, 4],
        metadata=_help("evaluation context lengths, as multiples of block_size: length extrapolation"),
    )
    eval_batch_size: int = field(default=4, metadata=_help("windows per evaluation forward pass"))
    target_ratio: float | None = field(
        default=None, metadata=_help("stop once perplexity / source perplexity (at 1x block_size) is at most this")
    )
    log_every: int = field(default=10, metadata=_help("log the training loss every N optimizer steps"))
    log_with: list[str] = field(
        default_factory=lambda: ["tensorboard", "jsonl"],
        metadata=_help(f"trackers, any of {', '.join(TRACKERS)}"),
    )
    save_every: int = field(default=500, metadata=_help("checkpoint (accelerator.save_state) every N optimizer steps"))
    keep_checkpoints: int = field(default=2, metadata=_help("how many of the latest checkpoints to keep"))
    resume: bool = field(
        default=False,
        metadata=_help(
            "continue from the latest complete checkpoint in output_dir (from the beginning if there is none), with "
            "the config it was written with (cadence and the last stage's tokens may change: recipes/README.md); "
            "without it, a run in an output_dir that holds an earlier run is refused unless --force is given"
        ),
    )
    seed: int = field(default=0, metadata=_help("seed of the run (LoRA init, dropout)"))


@dataclass(frozen=True)
class PlannedStage:
    """A stage with what it leaves to the run's settings resolved: `stage.tokens` training tokens in sequences of
    `block_size` tokens, the value of the setting `block_size_setting` (`stages.N.block_size`, or `data.block_size`
    where the stage sets none)."""

    stage: Stage
    block_size: int
    block_size_setting: str


def plan_stage_blocks(stages: list[Stage], block_size: int) -> list[PlannedStage]:
    """`stages` with their block lengths resolved, `block_size` (`data.block_size`) where a stage sets none."""
    return [
        PlannedStage(stage, block_size, "data.block_size")
        if stage.block_size is None
        else PlannedStage(stage, stage.block_size, f"stages.{i}.block_size")
        for i, stage in enumerate(stages)
    ]


@dataclass
class RecipeConfig:
    model: ModelSettings
    data: DataSettings
    stages: list[Stage]
    training: TrainingSettings

    @cached_property
    def stage_plan(self) -> list[PlannedStage]:
        """The stages with their block lengths resolved, once (`plan_stage_blocks`): what the data, the models' checks
        and the schedule read. Not a field: the config as written is what checkpoints record and compare."""
        return plan_stage_blocks(self.stages, self.data.block_size)

    @property
    def block_size_settings(self) -> dict[int, str]:
        """Each block length the stages train at (one packing of the data each), with the setting that asks for it
        first, for messages."""
        settings = {}
        for planned in self.stage_plan:
            settings.setdefault(planned.block_size, planned.block_size_setting)
        return settings


@dataclass(kw_only=True)
class RecipeCommand:
    """The command line of recipes/train.py: the YAML file, the overrides of its keys, and `--force`."""

    config: str = field(metadata=_help("YAML file with sections model, data, stages, training"))
    force: bool = field(
        default=False,
        metadata=_help(
            "start anew in a training.output_dir that holds an earlier run: delete its checkpoints, logs and final "
            "model first (the converted model is kept). Without it such a run is refused unless training.resume=true"
        ),
    )
    overrides: list[str] = field(
        default_factory=list,
        metadata=_help("e.g. training.batch_size=4", positional=True, nargs="*", metavar="KEY=VALUE"),
    )


def from_dict(cls, data, prefix: str):
    """`cls(**data)`, every key checked (`path_hf.arguments.from_mapping`); a `RecipeError` names the field at fault."""
    return from_mapping(cls, data, prefix, RecipeError)


def set_override(tree: dict, override: str) -> None:
    """Apply `a.b.c=value` (the value read as YAML) to the nested dicts and lists of `tree`."""
    key, sep, raw = override.partition("=")
    if not sep or not key:
        raise RecipeError(f"override {override!r} is not key=value (e.g. training.batch_size=4)")
    parts = key.split(".")
    node = tree
    for i, part in enumerate(parts):
        last = i == len(parts) - 1
        if isinstance(node, list):
            if not part.isdigit() or int(part) >= len(node):
                raise RecipeError(f"override {key}: {'.'.join(parts[:i])} has no item {part}")
            part = int(part)
        elif not isinstance(node, dict):
            raise RecipeError(f"override {key}: {'.'.join(parts[:i])} is not a mapping")
        if last:
            node[part] = read_yaml(raw, f"override {override}")
        else:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        description="Recover a PaTH model converted from a RoPE model: attention alignment, logit distillation and "
        "continued pretraining, tracking perplexity against the source model.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="keys (section.key=value overrides the YAML file; values are read as YAML):\n" + describe_keys(),
    )
    add_arguments(parser, RecipeCommand)
    return parser


def describe_keys() -> str:
    """Every key with its default and help text, for `--help`."""
    sections = (
        ("model", ModelSettings),
        ("data", DataSettings),
        ("stages.N", Stage),
        ("training", TrainingSettings),
    )
    return "\n".join(line for section, cls in sections for line in describe_fields(cls, section))


def parse_config(argv: list[str] | None = None) -> RecipeConfig:
    """Read `--config` and the `key=value` overrides into a checked `RecipeConfig`."""
    return read_config(parse_command(argv))


def parse_command(argv: list[str] | None = None) -> RecipeCommand:
    """The command line `argv` (default: `sys.argv[1:]`) of recipes/train.py."""
    return from_arguments(build_parser().parse_args(argv), RecipeCommand)


def read_config(command: RecipeCommand) -> RecipeConfig:
    """The checked `RecipeConfig` of a command line (`parse_command`)."""
    path = Path(command.config)
    if not path.is_file():
        raise RecipeError(f"--config {path}: no such file")
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise RecipeError(f"--config {path}: not a text file (byte {error.start} is not UTF-8)") from None
    except OSError as error:
        raise RecipeError(f"--config {path}: cannot read it ({error.strerror})") from None
    tree = read_yaml(text, f"--config {path}") or {}
    for override in command.overrides:
        set_override(tree, override)
    config = from_dict(RecipeConfig, tree, "")
    check_values(config)
    return config


def read_yaml(text: str, where: str):
    """`text` read as YAML; a syntax error is a `RecipeError` naming `where`, the line and column, and the problem."""
    try:
        return yaml.safe_load(text)
    except yaml.MarkedYAMLError as error:
        mark = error.problem_mark or error.context_mark
        at = f"line {mark.line + 1}, column {mark.column + 1}: " if mark else ""
        problem = error.problem or error.context or type(error).__name__
        hint = " (YAML indents with spaces, not tabs)" if "\\t" in problem else ""
        raise RecipeError(f"{where}: not valid YAML ({at}{problem}{hint})") from None
    except yaml.YAMLError as error:  # a character YAML does not accept (a binary file)
        raise RecipeError(f"{where}: not valid YAML ({' '.join(str(error).split())})") from None


def check_values(config: RecipeConfig) -> None:
    """Checks of values that need no file or model, each naming its field: sizes, rates and ratios in their ranges
    (finite), a stage to run, each stage's trainable set within the run's, known trackers."""
    data, training = config.data, config.training
    if not config.stages:
        raise RecipeError("stages is empty: give at least one of align, distill, lm")
    stages = list(enumerate(config.stages))
    ranges = [  # what a field allows, the test of a value, the fields (None: unset, nothing to check)
        ("positive", lambda value: value > 0, {
            **{f"stages.{i}.tokens": stage.tokens for i, stage in stages},
            **{f"stages.{i}.kl_stride": stage.kl_stride for i, stage in stages},
            "data.eval_tokens": data.eval_tokens,
            "data.shuffle_buffer": data.shuffle_buffer,
            "training.lora_alpha": training.lora_alpha,
            "training.batch_size": training.batch_size,
            "training.gradient_accumulation_steps": training.gradient_accumulation_steps,
            "training.eval_every": training.eval_every,
            "training.eval_batch_size": training.eval_batch_size,
            "training.log_every": training.log_every,
            "training.save_every": training.save_every,
            "training.keep_checkpoints": training.keep_checkpoints,
        }),
        ("at least 1", lambda value: value >= 1, {"training.lora_r": training.lora_r}),
        ("at least 2 (a token and the next one it predicts)", lambda value: value >= 2, {
            "data.block_size": data.block_size,
            **{f"stages.{i}.block_size": stage.block_size for i, stage in stages},
        }),
        ("a finite number > 0", lambda value: math.isfinite(value) and value > 0, {
            **{f"stages.{i}.learning_rate": stage.learning_rate for i, stage in stages},
            "training.distill_temperature": training.distill_temperature,
            "training.target_ratio": training.target_ratio,
        }),
        ("a finite number >= 0", lambda value: math.isfinite(value) and value >= 0, {
            **{f"stages.{i}.retrieval_weight": stage.retrieval_weight for i, stage in stages},
            "training.weight_decay": training.weight_decay,
            "training.max_grad_norm": training.max_grad_norm,
        }),
        ("in [0, 1]", lambda value: 0 <= value <= 1, {
            **{f"stages.{i}.retrieval": stage.retrieval for i, stage in stages},
            **{f"stages.{i}.warmup_ratio": stage.warmup_ratio for i, stage in stages},
            **{f"stages.{i}.min_lr_ratio": stage.min_lr_ratio for i, stage in stages},
        }),
        ("in [0, 1)", lambda value: 0 <= value < 1, {"training.lora_dropout": training.lora_dropout}),
        ("0 or more", lambda value: value >= 0, {
            "data.eval_documents": data.eval_documents,
            "data.shuffle_seed": data.shuffle_seed,
        }),
        ("in [0, 2**32)", lambda value: 0 <= value < 2**32, {"training.seed": training.seed}),  # numpy's seeds
    ]  # fmt: skip
    for allowed, in_range, values in ranges:
        for name, value in values.items():
            if value is not None and not in_range(value):
                raise RecipeError(f"{name} must be {allowed}, got {value}")
    if not training.eval_lengths or min(training.eval_lengths) < 1:
        raise RecipeError(
            f"training.eval_lengths must be positive multiples of block_size, got {training.eval_lengths}"
        )
    for i, stage in stages:
        check_stage_trainable(f"stages.{i}.trainable", stage.trainable, training.trainable)
        if stage.retrieval and stage.name != "distill":
            raise RecipeError(
                f"stages.{i}.retrieval: retrieval blocks are trained by a distill stage (KL beside the answers' cross "
                f"entropy), not {stage.name}: set it on a distill stage, or leave it 0"
            )
        windows = stage.local_windows
        if stage.local_window is not None and (not windows or any(
            isinstance(window, bool) or not isinstance(window, int) or window < 1 for window in windows
        )):  # fmt: skip
            raise RecipeError(
                f"stages.{i}.local_window must be a positive number of tokens or a list of them, got "
                f"{stage.local_window!r}"
            )
    unknown = sorted(set(training.log_with) - set(TRACKERS))
    if unknown:
        raise RecipeError(f"training.log_with: unknown tracker(s) {unknown}; use {', '.join(TRACKERS)}")
    for tracker in set(training.log_with) - {"jsonl"}:
        if importlib.util.find_spec(tracker) is None:
            raise RecipeError(f"training.log_with: {tracker} is not installed (pip install {tracker})")
    if bool(data.train_files) == bool(data.dataset):
        raise RecipeError("give exactly one of data.train_files (local files) and data.dataset (a hub dataset)")


def check_stage_trainable(name: str, value: str | None, run: str) -> None:
    """A stage's `trainable` (`name`): unset, or one of `NESTED_TRAINABLE` within the run's set (the optimizer is built
    once, from the run's parameters), never with LoRA."""
    if value is None:
        return
    if value not in NESTED_TRAINABLE:
        raise RecipeError(
            f"{name} must be one of {', '.join(NESTED_TRAINABLE)} (each a subset of the next), got {value!r}; leave it "
            "unset to train training.trainable's set"
        )
    if run == "lora":
        raise RecipeError(
            f"{name} {value!r} cannot narrow training.trainable lora (the stage would train other parameters than the "
            "LoRA run's): leave it unset, or give training.trainable one of attention, full"
        )
    if NESTED_TRAINABLE.index(value) > NESTED_TRAINABLE.index(run):
        narrower = ", ".join(NESTED_TRAINABLE[: NESTED_TRAINABLE.index(run) + 1])
        raise RecipeError(
            f"{name} {value!r} is wider than training.trainable {run!r}: the optimizer holds only the run's "
            f"parameters; give the stage one of {narrower}, or widen training.trainable to {value}"
        )


def flatten(tree: dict, sep: str = ".", prefix: str = "") -> dict:
    """The values of a config tree (`dataclasses.asdict` of a `RecipeConfig`) by their full names, `stages.0.tokens`
    with `sep="."`: mappings and lists of mappings (the stages) are walked, any other value is one entry."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, list) and value and all(isinstance(item, dict) for item in value):
            value = {str(i): item for i, item in enumerate(value)}
        if isinstance(value, dict):
            flat |= flatten(value, sep, f"{name}{sep}")
        else:
            flat[name] = value
    return flat


__all__ = [
    "DataSettings",
    "ModelSettings",
    "PlannedStage",
    "RecipeCommand",
    "RecipeConfig",
    "RecipeError",
    "Stage",
    "TrainingSettings",
    "build_parser",
    "check_values",
    "flatten",
    "parse_command",
    "parse_config",
    "plan_stage_blocks",
    "read_config",
]
