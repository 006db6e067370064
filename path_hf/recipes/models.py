# Copyright 2026 The path-hf authors. Apache-2.0.
"""The models of recipes/train.py: the student (converted on the fly from a RoPE source if needed) and the teacher,
what of the student trains, the checks and placement each engine needs, and the final save."""

from __future__ import annotations

import re
from collections.abc import Collection, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedType
from peft import LoraConfig, get_peft_model
from safetensors import SafetensorError
from torch import nn
from torch.distributed.tensor import DTensor
from transformers import PretrainedConfig

from .. import PaTHLlamaAttention, PaTHLlamaConfig, PaTHLlamaForCausalLM
from ..arguments import flag
from ..conversion.convert import convert
from ..conversion.options import RUN_OPTIONS, ConvertOptions
from ..errors import ConversionError, RecipeError, SourceError, first_line
from ..loading import load_causal_lm, load_config
from ..modeling_path_llama import FORGET_GATE_MODULES, LAYER_PARAMETER, PATH_MODULES
from ..ops_chunk import cpu_multiplies_bf16
from .settings import ModelSettings, RecipeConfig, Stage, TrainingSettings


@dataclass(frozen=True)
class ModelPlan:
    """Where the student and the teacher come from, known from their configs alone."""

    student: str  # a PaTH checkpoint, existing or written by the conversion
    convert_from: str | None  # a RoPE source to convert into `student` first
    teacher: str | None


def plan_models(config: RecipeConfig) -> ModelPlan:
    """Read the model configs and refuse what cannot train: a block longer than the model's positions, a teacher
    whose vocabulary differs, conversion options of the wrong kind. Loads no weights."""
    model_args = config.model
    # `convert.gguf_file` names the GGUF in a directory `path`: that file is the source (and default teacher).
    gguf_file = model_args.convert.get("gguf_file")
    source = str(Path(model_args.path) / gguf_file) if gguf_file else model_args.path
    student_config = _load_config(source, "model.path")
    if student_config.model_type == PaTHLlamaConfig.model_type:
        if model_args.convert:
            raise RecipeError(f"model.convert is set but model.path {model_args.path} is already a PaTH checkpoint")
        recorded = getattr(student_config, "path_conversion", None) or {}
        student, convert_from, teacher = model_args.path, None, model_args.teacher or recorded.get("source")
        local_window = student_config.local_window
    else:
        student = str(Path(config.training.output_dir) / "converted")
        convert_from, teacher = model_args.path, model_args.teacher or source
        local_window = conversion_options(model_args, student).local_window  # checks the options now
    if local_window is None:
        for i, stage in enumerate(config.stages):
            if stage.local_window is not None:
                raise RecipeError(
                    f"stages.{i}.local_window sets the window of local layers, and the model has none: convert it as a "
                    "hybrid (model.convert.local_window, with model.convert.layers the PaTH layers)"
                )
    limit = getattr(student_config, "max_position_embeddings", None)
    # data.block_size first, also where every stage sets its own: the evaluation windows' unit
    sizes = [(config.data.block_size, "data.block_size"), *config.block_size_settings.items()]
    for size, name in sizes:
        if limit is not None and size > limit:
            raise RecipeError(f"{name} {size} is above the model's limit (max_position_embeddings={limit})")
    needs_teacher = any(stage.name in ("align", "distill") for stage in config.stages)
    if teacher is None and needs_teacher:
        raise RecipeError("model.teacher is required by the align and distill stages (the source RoPE model)")
    if teacher is not None:
        teacher_config = _load_config(teacher, "model.teacher")
        if teacher_config.vocab_size != student_config.vocab_size:
            raise RecipeError(
                f"model.teacher {teacher} has a vocabulary of {teacher_config.vocab_size} tokens, the model "
                f"{student_config.vocab_size}: distillation and the perplexity ratio need the same tokenizer"
            )
    longest = max(config.training.eval_lengths, default=1) * config.data.block_size
    if config.data.eval_tokens < longest:
        raise RecipeError(
            f"data.eval_tokens {config.data.eval_tokens} cannot fill the longest evaluation window "
            f"(training.eval_lengths x data.block_size = {longest}): give at least {longest}"
        )
    return ModelPlan(student, convert_from, teacher)


def _load_config(name: str, field_name: str) -> PretrainedConfig:
    """The config of a checkpoint directory, hub id or GGUF file (`path_hf.loading`)."""
    try:
        return load_config(name)
    except (OSError, ValueError, SourceError) as error:
        raise RecipeError(f"{field_name} {name}: cannot read its config ({first_line(error)})") from error


def conversion_options(model_args: ModelSettings, output: str) -> ConvertOptions:
    """`model.convert` as the converter's own `ConvertOptions` (one definition of every conversion option); a value
    may be written in its flag's notation (`layers: 0-11,20`, `max_shard_size: 5GB`)."""
    known = {option.name: option for option in fields(ConvertOptions) if option.name not in RUN_OPTIONS}
    options = {}
    try:
        for key, value in model_args.convert.items():
            if key not in known:
                raise RecipeError(f"unknown key model.convert.{key}")
            parse = known[key].metadata.get("parse")
            options[key] = parse(str(value)) if parse and isinstance(value, (str, int)) else value
        return ConvertOptions(source=model_args.path, output=output, **options)
    except (ConversionError, ValueError) as error:
        raise RecipeError(f"model.convert: {error}") from error


def convert_flags(convert: dict) -> list[str]:
    """A recipe's `model.convert` as `path-hf convert` flags: {forget_gate: true, layers: "3,7"} -> --forget-gate
    --layers 3,7 (false and null leave a flag out); a key the converter does not take is refused."""
    known = {option.name: option for option in fields(ConvertOptions) if option.name not in RUN_OPTIONS}
    flags = []
    for key, value in convert.items():
        if key not in known:
            raise RecipeError(f"unknown key model.convert.{key}")
        if value is True:
            flags.append(flag(known[key]))
        elif value is not False and value is not None:
            flags += [flag(known[key]), str(value)]
    return flags


# What the converter's flags are in a recipe: `model.convert.<field>`, and the run's own places.
_RECIPE_TERMS = {
    **{
        flag(option): f"model.convert.{option.name}" + ("=true" if option.type in (bool, "bool") else "")
        for option in fields(ConvertOptions)
        if option.name not in RUN_OPTIONS
    },
    "--from": "model.path",
    "--to": "training.output_dir",
}


def in_recipe_terms(message: str) -> str:
    """A converter's message with its flags (`pass --allow-nonfinite`) named as a recipe sets them
    (`model.convert.allow_nonfinite=true`)."""
    return re.sub(r"--[a-z][a-z-]*", lambda found: _RECIPE_TERMS.get(found[0], found[0]), message)


def load_models(
    config: RecipeConfig, plan: ModelPlan, accelerator: Accelerator
) -> tuple[PaTHLlamaForCausalLM, nn.Module | None]:
    """Convert if needed (on the main process, once: a resumed run reuses the converted model), then load the
    student and the frozen teacher."""
    if plan.convert_from is not None and accelerator.is_main_process and not Path(plan.student).is_dir():
        try:
            convert(conversion_options(config.model, plan.student))
        except ConversionError as error:
            raise RecipeError(f"model.path: converting it failed: {in_recipe_terms(str(error))}") from error
    accelerator.wait_for_everyone()
    student_field = "model.path" if plan.convert_from is None else "the model converted from model.path into"
    student = _load_causal_lm(plan.student, getattr(torch, config.model.dtype), student_field)
    teacher = None
    if plan.teacher is not None:
        with unpartitioned(accelerator.state.deepspeed_plugin):
            # a checkpoint, or a GGUF file dequantised to teacher_dtype
            dtype = teacher_dtype(config.model.teacher_dtype, accelerator.device)
            teacher = _load_causal_lm(plan.teacher, dtype, "model.teacher")
        teacher.eval().requires_grad_(False)
    return student, teacher


def _load_causal_lm(name: str, dtype: torch.dtype, field_name: str) -> nn.Module:
    """The model of a checkpoint directory, hub id or GGUF file (`path_hf.loading`), whose config `plan_models`
    read: what fails now are its weights (missing, damaged)."""
    try:
        return load_causal_lm(name, dtype)
    except (OSError, ValueError, SafetensorError, SourceError) as error:
        raise RecipeError(f"{field_name} {name}: cannot load its weights ({first_line(error)})") from error


def fast_bfloat16(device: torch.device) -> bool:
    """Whether `device` multiplies bfloat16 matrices faster than float32 ones: a CUDA GPU that supports bfloat16, or
    a CPU with AMX or AVX-512 BF16 (without them a CPU emulates bfloat16, several times slower than float32)."""
    if device.type == "cuda":
        return torch.cuda.is_bf16_supported()
    return device.type == "cpu" and cpu_multiplies_bf16()


def teacher_dtype(name: str, device: torch.device) -> torch.dtype:
    """`model.teacher_dtype`: a dtype's name, or `auto`, bfloat16 where `fast_bfloat16(device)`, float32 elsewhere."""
    if name == "auto":
        return torch.bfloat16 if fast_bfloat16(device) else torch.float32
    return getattr(torch, name)


@contextmanager
def unpartitioned(deepspeed_plugin=None) -> Iterator[None]:
    """Models loaded in this block stay whole under ZeRO-3, where a model partitioned without an engine (the
    teacher) cannot run. transformers partitions every model loaded while a ZeRO-3 config is registered, whatever
    `zero3_init_flag` says (accelerate's `zero3_init_context_manager(False)` registers the same config again)."""
    if deepspeed_plugin is None:
        yield
        return
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    unset_hf_deepspeed_config()
    try:
        yield
    finally:
        deepspeed_plugin.set_deepspeed_weakref()


def shards_weights(distributed_type: DistributedType, deepspeed_plugin=None) -> bool:
    """Whether no process holds the whole weights: FSDP, DeepSpeed ZeRO-3."""
    return distributed_type == DistributedType.FSDP or (
        deepspeed_plugin is not None and deepspeed_plugin.zero_stage == 3
    )


def check_engine(
    training: TrainingSettings,
    distributed_type: DistributedType,
    deepspeed_plugin=None,
    stages: Sequence[Stage] = (),
) -> None:
    """Refuse what the engine would do otherwise than configured: LoRA under FSDP or ZeRO-3 (its merge needs whole
    weights on one process), a stage's own `trainable` under any engine (DDP, FSDP and DeepSpeed set up their
    gradient reduction once, for the parameters that require gradients when the model is prepared), and a DeepSpeed
    config whose `gradient_clipping` or `gradient_accumulation_steps` differs from `training`'s (DeepSpeed clips and
    accumulates by its own config: accelerate logs an accumulation mismatch and takes DeepSpeed's value, and says
    nothing of the clipping). Values left `auto` (or out) in the DeepSpeed config get `training`'s
    (`gradient_accumulation_steps: auto` in an accelerate config fails in accelerate itself: it reads that value as an
    int)."""
    if training.trainable == "lora" and shards_weights(distributed_type, deepspeed_plugin):
        raise RecipeError("training.trainable=lora merges on one process: use DDP or DeepSpeed ZeRO-2, not FSDP/ZeRO-3")
    narrowed = [i for i, stage in enumerate(stages) if stage.trainable is not None]
    if narrowed and distributed_type != DistributedType.NO:
        i = narrowed[0]
        raise RecipeError(
            f"stages.{i}.trainable {stages[i].trainable!r} changes what trains within a run, which only a run on "
            f"one process can (this one runs under {distributed_type.value}, whose gradient reduction is set up once, "
            "for the parameters that train at the start); run the stage as its own run instead, with model.path the "
            "previous run's final model and training.trainable the stage's set"
        )
    if deepspeed_plugin is None:
        return
    config = deepspeed_plugin.deepspeed_config
    for key in ("gradient_clipping", "gradient_accumulation_steps"):
        name = "max_grad_norm" if key == "gradient_clipping" else key
        value = getattr(training, name)
        if config.get(key, "auto") == "auto":
            config[key] = value
        elif float(config[key]) != value:
            auto = " (or gradient_clipping: auto in the accelerate config)" if key == "gradient_clipping" else ""
            raise RecipeError(
                f"the DeepSpeed config has {key}: {config[key]}, training.{name} is {value}: DeepSpeed would use its "
                f"own; make them equal{auto}"
            )


def place_teacher(teacher: nn.Module | None, accelerator: Accelerator) -> nn.Module | None:
    """The frozen teacher where it runs: sharded like the student under FSDP2, elsewhere a replica on each device."""
    if teacher is None:
        return None
    return shard_teacher(teacher, accelerator) if accelerator.is_fsdp2 else teacher.to(accelerator.device)


def shard_teacher(teacher: nn.Module, accelerator: Accelerator) -> nn.Module:
    """The frozen teacher sharded under FSDP2 one decoder layer at a time, as accelerate shards the student (its
    `prepare` takes a model only with the optimizer that trains it under FSDP2, and `prepare_model(evaluation_mode=
    True)` leaves a model whole and where it was loaded). It only runs forward: no mixed-precision policy, it is
    loaded in `model.teacher_dtype`."""
    from torch.distributed.fsdp import fully_shard

    plugin = accelerator.state.fsdp_plugin
    for layer in teacher.get_decoder().layers:
        fully_shard(layer, reshard_after_forward=plugin.reshard_after_forward, offload_policy=plugin.cpu_offload)
    return fully_shard(teacher, offload_policy=plugin.cpu_offload)


def path_attention_layers(model: nn.Module) -> dict[int, PaTHLlamaAttention]:
    """The PaTH attention modules of `model` (also inside a PEFT or engine wrapper), by layer index."""
    return {m.layer_idx: m for m in model.modules() if isinstance(m, PaTHLlamaAttention)}


def trainable_model(student: PaTHLlamaForCausalLM, training: TrainingSettings, stages: list[Stage]) -> nn.Module:
    """The student as it trains: `select_trainable`'s parameters, ready for activation checkpointing where the run or
    one of its `stages` asks for it (`set_activation_checkpointing` turns it on and off stage by stage)."""
    checkpointed = any(stage_checkpointing(stage, training) for stage in stages)
    if checkpointed and training.trainable == "lora":
        # the frozen embeddings' output must carry gradients into checkpointed layers
        student.enable_input_require_grads()
    return select_trainable(student, training)


def stage_checkpointing(stage: Stage, training: TrainingSettings) -> bool:
    """Whether `stage` recomputes activations in backward: its own setting, else the run's."""
    own = stage.activation_checkpointing
    return training.activation_checkpointing if own is None else own


def set_activation_checkpointing(model: PaTHLlamaForCausalLM, enabled: bool) -> None:
    """Turn activation checkpointing of `model`'s decoder layers on or off (between steps: the gradients are the same,
    recomputed or kept)."""
    if enabled:
        model.activation_checkpointing_enable()
    else:
        model.activation_checkpointing_disable()


# training.trainable=gate: how strongly each token transforms (beta) and forgets (the gate), nothing else.
GATE_MODULES = ("bt_proj", "bt_gain", *FORGET_GATE_MODULES)


def select_trainable(model: PaTHLlamaForCausalLM, training: TrainingSettings) -> nn.Module:
    """Freeze what `training.trainable` leaves out; with `lora`, wrap the model with PEFT (LoRA on the chosen
    modules, the PaTH modules fully trained through `modules_to_save`)."""
    present = sorted({name.rsplit(".", 1)[-1] for name, _ in model.named_modules() if name.endswith(PATH_MODULES)})
    if training.trainable == "lora":
        targets = training.lora_target_modules
        if targets == "all-linear":
            # The PaTH modules are trained fully (modules_to_save), never LoRA-wrapped too.
            targets = sorted(
                {
                    name.rsplit(".", 1)[-1]
                    for name, module in model.named_modules()
                    if isinstance(module, nn.Linear) and name != "lm_head" and not _in_path_module(name)
                }
            )
        elif isinstance(targets, str) or set(targets) & set(PATH_MODULES):
            raise RecipeError(
                "training.lora_target_modules must be a list of module names or 'all-linear', without the PaTH "
                f"modules {PATH_MODULES} (they are trained fully)"
            )
        lora = LoraConfig(
            r=training.lora_r,
            lora_alpha=training.lora_alpha,
            lora_dropout=training.lora_dropout,
            target_modules=targets,
            modules_to_save=present,
            task_type="CAUSAL_LM",
        )
        return get_peft_model(model, lora)
    layers = path_attention_layers(model)
    for name, param in model.named_parameters():
        param.requires_grad_(trains(name, training.trainable, layers))
    return model


def trains(name: str, trainable: str, path_layers: Collection[int]) -> bool:
    """Whether the set `trainable` (path, gate, attention or full) trains the parameter `name` of a model whose PaTH
    attention layers are `path_layers` (indices)."""
    if trainable == "full":
        return True
    if trainable == "path":
        return _in_path_module(name)
    if trainable == "gate":
        return _in_path_module(name, GATE_MODULES)
    # attention: everything in the self_attn of PaTH layers
    layer = LAYER_PARAMETER.match(name)
    return layer is not None and int(layer["layer"]) in path_layers and name.startswith("self_attn.", layer.end())


def narrow_trainable(model: nn.Module, run_trainable: str, stage_trainable: str | None) -> None:
    """Let a stage train `stage_trainable` (None: the run's set) of the run's `run_trainable` parameters: every other
    parameter of `model` (unwrapped, as `select_trainable` got it) gets no gradient, so the optimizer built from the
    run's parameters leaves it as it is. A single process only (`check_engine`)."""
    layers = path_attention_layers(model)
    stage_trainable = stage_trainable or run_trainable
    for name, param in model.named_parameters():
        param.requires_grad_(trains(name, run_trainable, layers) and trains(name, stage_trainable, layers))


def _in_path_module(name: str, modules: tuple[str, ...] = PATH_MODULES) -> bool:
    return any(f".{module}." in f".{name}." for module in modules)


def replica_checksums(model: nn.Module, accelerator: Accelerator) -> list[float] | None:
    """A checksum of the trainable weights, whole, from every process: equal values mean every process ends with the
    same model. Under FSDP2 each process gathers the sharded weights one at a time (what remains to differ there is
    a weight left unsharded); None under FSDP1 and DeepSpeed, whose wrappers hide the whole weights."""
    if accelerator.distributed_type == DistributedType.DEEPSPEED or (
        accelerator.distributed_type == DistributedType.FSDP and not accelerator.is_fsdp2
    ):
        return None
    checksum = torch.zeros((), dtype=torch.float64, device=accelerator.device)
    for param in accelerator.unwrap_model(model).parameters():
        if param.requires_grad:
            whole = (param.full_tensor() if isinstance(param, DTensor) else param).detach().double()
            checksum += whole.abs().sum() + whole.sum()
    return accelerator.gather(checksum[None]).tolist()


def final_card(student: str, config: RecipeConfig) -> str:
    """The model card of `final/`: the card of the model trained (the conversion's, with the source's licence), and
    what the recipe did to it."""
    card = Path(student) / "README.md"
    text = card.read_text().rstrip() if card.is_file() else f"# {Path(config.training.output_dir).name}"
    rows = [f"| {stage.name} | {stage.tokens:,} | {stage.learning_rate:g} |" for stage in config.stages]
    trained = config.training.trainable
    return f"""{text}

## Trained

Trained from that model by path-hf's recipe (`recipes/train.py`), parameters trained: `{trained}`; the stages:

| stage | tokens | learning rate |
|---|---:|---:|
{chr(10).join(rows)}

The run's perplexity against the source is in `recovery.json` beside this folder, its config in each checkpoint's
`run_state.json`.
"""


def save_final_model(
    model: nn.Module, tokenizer, accelerator: Accelerator, output_dir: Path, lora: bool, card: str | None = None
) -> None:
    """`final/`: a plain PaTHLlama checkpoint with its tokenizer (LoRA merged; its adapter kept in `adapter/`) and
    `card` as its README.md, saved by the main process from the state dict gathered from every process (FSDP,
    ZeRO-3)."""
    state_dict = accelerator.get_state_dict(model)
    if not accelerator.is_main_process:
        accelerator.wait_for_everyone()
        return
    unwrapped = accelerator.unwrap_model(model)
    if lora:  # only under engines that keep whole weights on every process (refused otherwise)
        unwrapped.save_pretrained(output_dir / "adapter")
        unwrapped = unwrapped.merge_and_unload()
        state_dict = unwrapped.state_dict()
    unwrapped.save_pretrained(output_dir / "final", state_dict=state_dict)
    tokenizer.save_pretrained(output_dir / "final")
    if card is not None:
        (output_dir / "final" / "README.md").write_text(card)
    accelerator.wait_for_everyone()
