# Copyright 2026 The path-hf authors. Apache-2.0.
"""Recover a PaTH model converted from a RoPE model, tracking its perplexity against the source model.

    accelerate launch recipes/train.py --config recipes/configs/tiny-cpu.yaml [section.key=value ...]

Stages, any subset in order, each with its own token budget and learning rate: `align` (each PaTH layer's attention
output matched to the source layer's on the same input, MSE), `distill` (KL to the source model's next-token
distribution) and `lm` (continued pretraining). The source model's and the converted model's perplexity on a
held-out split are measured before training, then the converted model's every `eval_every` steps and at the end, at
1x, 2x, 4x... the training block length; `recovery.json` and `recovery.png` hold the result. See recipes/README.md.
"""

from __future__ import annotations

import itertools
import json
import math
import os
import re
import shutil
import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedDataParallelKwargs, DistributedType, skip_first_batches
from accelerate.tracking import GeneralTracker
from accelerate.utils import ProjectConfiguration, set_seed
from accelerate.utils import load as load_restricted  # torch.load(weights_only=True), numpy arrays allowed
from datasets import Dataset, IterableDataset, load_dataset
from peft import LoraConfig, get_peft_model
from torch import nn
from torch.distributed.tensor import DTensor
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import PretrainedConfig

from path_hf import PaTHLlamaAttention, PaTHLlamaConfig, PaTHLlamaForCausalLM
from path_hf.atomic import replace_directory
from path_hf.conversion.convert import convert
from path_hf.conversion.loading import load_causal_lm, load_config, load_tokenizer
from path_hf.conversion.options import RUN_OPTIONS, ConvertOptions
from path_hf.errors import ConversionError
from path_hf.evaluation import (
    IGNORE_INDEX,
    PerplexityResult,
    Window,
    load_texts,
    make_windows,
    plots,
    score_windows,
    text_documents,
    tokenize_documents,
    tokenize_stream,
)
from path_hf.modeling_path_llama import PATH_MODULES, packed_sequences
from path_hf.recipes.arguments import (
    DataArguments,
    ModelArguments,
    RecipeConfig,
    RecipeError,
    Stage,
    TrainingArguments,
    parse_command,
    read_config,
)

# ---------------------------------------------------------------------------------------------------------------------
# Models: the student (converted on the fly from a RoPE source if needed) and the teacher


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
    else:
        student = str(Path(config.training.output_dir) / "converted")
        convert_from, teacher = model_args.path, model_args.teacher or source
        conversion_options(model_args, student)  # checks the option names and values now
    limit = getattr(student_config, "max_position_embeddings", None)
    if limit is not None and config.data.block_size > limit:
        raise RecipeError(
            f"data.block_size {config.data.block_size} is above the model's limit (max_position_embeddings={limit})"
        )
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
    return ModelPlan(student, convert_from, teacher)


def _load_config(name: str, field_name: str) -> PretrainedConfig:
    """The config of a checkpoint directory, hub id or GGUF file (`conversion.loading`)."""
    try:
        return load_config(name)
    except (OSError, ValueError, ConversionError) as error:
        raise RecipeError(f"{field_name} {name}: cannot read its config ({str(error).splitlines()[0]})") from error


def conversion_options(model_args: ModelArguments, output: str) -> ConvertOptions:
    """`model.convert` as the converter's own `ConvertOptions` (one definition of every conversion option)."""
    known = {option.name: option for option in fields(ConvertOptions)}
    options = {}
    for key, value in model_args.convert.items():
        if key not in known or key in RUN_OPTIONS:
            raise RecipeError(f"unknown key model.convert.{key}")
        parse = known[key].metadata.get("parse")
        options[key] = parse(str(value)) if parse and isinstance(value, (str, int)) else value
    try:
        return ConvertOptions(source=model_args.path, output=output, **options)
    except (ConversionError, ValueError) as error:
        raise RecipeError(f"model.convert: {error}") from error


def load_models(config: RecipeConfig, plan: ModelPlan, accelerator: Accelerator):
    """Convert if needed (on the main process, once: a resumed run reuses the converted model), then load the
    student and the frozen teacher."""
    if plan.convert_from is not None and accelerator.is_main_process and not Path(plan.student).is_dir():
        convert(conversion_options(config.model, plan.student))
    accelerator.wait_for_everyone()
    student = load_causal_lm(plan.student, getattr(torch, config.model.dtype))
    teacher = None
    if plan.teacher is not None:
        with unpartitioned(accelerator.state.deepspeed_plugin):
            # a checkpoint, or a GGUF file dequantised to teacher_dtype
            teacher = load_causal_lm(plan.teacher, getattr(torch, config.model.teacher_dtype))
        teacher.eval().requires_grad_(False)
    return student, teacher


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


def check_engine(training: TrainingArguments, distributed_type: DistributedType, deepspeed_plugin=None) -> None:
    """Refuse what the engine would do otherwise than configured: LoRA under FSDP or ZeRO-3 (its merge needs whole
    weights on one process), and a DeepSpeed config whose `gradient_clipping` or `gradient_accumulation_steps`
    differs from `training`'s (DeepSpeed clips and accumulates by its own config: accelerate logs an accumulation
    mismatch and takes DeepSpeed's value, and says nothing of the clipping). Values left `auto` (or out) in the
    DeepSpeed config get `training`'s (`gradient_accumulation_steps: auto` in an accelerate config fails in
    accelerate itself: it reads that value as an int)."""
    if training.trainable == "lora" and shards_weights(distributed_type, deepspeed_plugin):
        raise RecipeError("training.trainable=lora merges on one process: use DDP or DeepSpeed ZeRO-2, not FSDP/ZeRO-3")
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


def select_trainable(model: PaTHLlamaForCausalLM, training: TrainingArguments) -> nn.Module:
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
        if training.trainable == "full":
            param.requires_grad_(True)
        elif training.trainable == "path":
            param.requires_grad_(_in_path_module(name))
        else:  # attention: everything in the self_attn of PaTH layers
            match = re.match(r"model\.layers\.(\d+)\.self_attn\.", name)
            param.requires_grad_(match is not None and int(match[1]) in layers)
    return model


def _in_path_module(name: str) -> bool:
    return any(f".{module}." in f".{name}." for module in PATH_MODULES)


# ---------------------------------------------------------------------------------------------------------------------
# Data: documents -> tokens -> fixed-length blocks, documents never attending to each other


def _load_texts(files: list[str], text_field: str, field_name: str, streaming: bool = False):
    """The documents of local files, one `text_field` column (`path_hf.evaluation.load_texts`)."""
    try:
        return load_texts(files, text_field, streaming)
    except (OSError, ValueError) as error:
        raise RecipeError(f"{field_name}: {error}") from error


def load_documents(data: DataArguments) -> tuple[Dataset | IterableDataset, list[str]]:
    """The training documents, and the held-out evaluation texts, which never enter training."""
    if data.dataset:
        documents = load_dataset(data.dataset, data.dataset_config, split=data.dataset_split, streaming=data.streaming)
        try:
            documents = text_documents(documents, data.text_field, data.dataset)
        except ValueError as error:
            raise RecipeError(f"data.dataset: {error}") from error
    else:
        documents = _load_texts(data.train_files, data.text_field, "data.train_files", data.streaming)
    if data.eval_files:
        eval_texts = list(_load_texts(data.eval_files, data.text_field, "data.eval_files")[data.text_field])
    else:
        eval_texts = [row[data.text_field] for row in documents.take(data.eval_documents)]
        documents = documents.skip(data.eval_documents)
    if not eval_texts:
        raise RecipeError("data: the evaluation split is empty (data.eval_files or data.eval_documents)")
    if next(iter(documents), None) is None:
        raise RecipeError("data: no training documents left (empty files, or all held out by data.eval_documents)")
    return documents, eval_texts


def pack_documents(texts: list[str], tokenizer, block_size: int) -> dict[str, list[list[int]]]:
    """Tokenise `texts` (each followed by EOS) and cut the stream into blocks of `block_size` tokens, with
    `position_ids` restarting at 0 where a document (or a block) starts, which the models read as sequence
    boundaries, and `labels` ignoring each sequence's first token, which nothing in its sequence predicts."""
    input_ids, position_ids = [], []
    for ids in tokenize_documents(texts, tokenizer):
        input_ids += ids
        position_ids += range(len(ids))
    blocks = {"input_ids": [], "position_ids": [], "labels": []}
    for start in range(0, len(input_ids) - block_size + 1, block_size):
        ids = input_ids[start : start + block_size]
        positions = position_ids[start : start + block_size]
        # A block starting inside a document starts a sequence there: renumber that fragment from 0.
        fragment = positions.index(0, 1) if 0 in positions[1:] else block_size
        positions = list(range(fragment)) + positions[fragment:]
        blocks["input_ids"].append(ids)
        blocks["position_ids"].append(positions)
        blocks["labels"].append([IGNORE_INDEX if p == 0 else t for t, p in zip(ids, positions, strict=True)])
    return blocks


def training_blocks(documents, tokenizer, data: DataArguments, accelerator: Accelerator):
    """Packed training blocks in a fixed shuffled order (what makes `resume` exact), as torch tensors."""
    if isinstance(documents, IterableDataset):
        documents = documents.shuffle(seed=data.shuffle_seed, buffer_size=data.shuffle_buffer)
    with accelerator.main_process_first():  # the main process tokenises, the others read its cache
        blocks = documents.map(
            lambda batch: pack_documents(batch[data.text_field], tokenizer, data.block_size),
            batched=True,
            batch_size=1000,
            remove_columns=[data.text_field],
        )
    if isinstance(blocks, Dataset):
        empty = len(blocks) == 0
        blocks = blocks.shuffle(seed=data.shuffle_seed)
    else:  # a stream: pack its first batch of documents
        empty = next(iter(blocks), None) is None
    if empty:
        raise RecipeError(f"data: the training documents make no block of data.block_size={data.block_size} tokens")
    return blocks.with_format("torch")


def endless_batches(dataloader, start: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of `dataloader` epoch after epoch, from batch `start` on (a resumed run's data position). A map-style
    dataset skips to it through its sampler, without loading the skipped batches; a stream reads past them."""
    epochs = itertools.chain.from_iterable(itertools.repeat(dataloader))
    try:
        epoch_length = len(dataloader)
    except TypeError:  # a stream has no length
        yield from itertools.islice(epochs, start, None)
        return
    yield from skip_first_batches(dataloader, start % epoch_length)
    yield from epochs


# ---------------------------------------------------------------------------------------------------------------------
# Losses of the three stages


class AttentionAlignment:
    """Stage 1: every PaTH layer's attention, run on the teacher's attention input for that layer (the normed hidden
    states and RoPE tables the teacher's `self_attn` received), is matched to the teacher's attention output (MSE).

    Hooks on the teacher's `self_attn` record its inputs and outputs during one teacher forward. Then:
    - `isolated` (one process or DDP: every process holds whole weights): each PaTH attention runs alone on its
      recorded input and its loss is backpropagated at once. The student's embeddings, MLPs and head never run, and
      memory holds one layer's graph at a time, since the layers do not depend on each other. Under DDP the gradients
      are averaged here (DDP's own hooks only act after a forward through its wrapper).
    - otherwise (FSDP, DeepSpeed: their wrappers gather the weights in the model's own forward): the student runs
      whole through its wrapper, with hooks substituting each PaTH attention's input while `active`; the layers after
      a PaTH attention compute on values nobody reads.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module, isolated: bool = True):
        self.isolated = isolated
        self.active = False
        self.inputs: dict[int, dict] = {}
        self.targets: dict[int, torch.Tensor] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.layers = path_attention_layers(student)
        if not self.layers:
            raise RecipeError("the align stage needs PaTH layers, and the model has none (path_layers=[])")
        teacher_layers = teacher.get_decoder().layers
        for idx, attention in self.layers.items():
            teacher_attention = teacher_layers[idx].self_attn
            teacher_attention.register_forward_pre_hook(self._record_input(idx), with_kwargs=True)
            teacher_attention.register_forward_hook(self._record(self.targets, idx))
            if not isolated:
                attention.register_forward_pre_hook(self._substitute_input(idx), with_kwargs=True)
                attention.register_forward_hook(self._record(self.outputs, idx))

    # transformers' decoder layers call `self_attn` with keyword arguments only.
    def _record_input(self, idx: int):
        def hook(module, args, kwargs):
            if self.active:
                self.inputs[idx] = {"hidden_states": kwargs["hidden_states"], **_rope_kwargs(kwargs)}

        return hook

    def _substitute_input(self, idx: int):
        def hook(module, args, kwargs):
            if self.active:
                return args, {**kwargs, **self._recorded_input(idx, kwargs["hidden_states"].dtype)}
            return None

        return hook

    def _recorded_input(self, idx: int, dtype: torch.dtype) -> dict:
        recorded = self.inputs[idx]
        kwargs = {"hidden_states": recorded["hidden_states"].to(dtype)}
        if "position_embeddings" in recorded:
            kwargs["position_embeddings"] = tuple(t.to(dtype) for t in recorded["position_embeddings"])
        return kwargs

    def _record(self, store: dict, idx: int):
        def hook(module, args, output):
            if self.active:
                store[idx] = output[0]

        return hook

    @contextmanager
    def aligning(self):
        """The hooks work inside this block: the forward passes, and the backward (which may recompute them)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.inputs.clear()
            self.targets.clear()
            self.outputs.clear()

    def _layer_loss(self, idx: int) -> torch.Tensor:
        return F.mse_loss(self.outputs[idx].float(), self.targets[idx].float())

    def loss(
        self,
        model: nn.Module,
        teacher: nn.Module,
        batch: dict[str, torch.Tensor],
        accelerator: Accelerator | None = None,
    ) -> torch.Tensor:
        """The mean MSE over the PaTH layers. Isolated, it is already backpropagated (through `accelerator` if
        given) and returned detached; otherwise the caller backpropagates it."""
        inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
        with torch.no_grad():
            teacher(**inputs, logits_to_keep=1)
        if not self.isolated:
            logits = model(**inputs, logits_to_keep=1).logits
            loss = torch.stack([self._layer_loss(i) for i in sorted(self.outputs)]).mean()
            # FSDP2 gathers a layer's weights for backward when the gradient of the layer's output arrives, and the
            # MSE reaches only attention outputs: a zero term through the logits brings a gradient to every layer.
            return loss + 0.0 * logits.sum()

        # The packed documents, found once as PaTHLlamaModel finds them for its layers.
        cu_seqlens = packed_sequences(batch["position_ids"], batch["input_ids"].shape[0])
        losses = []
        for idx, attention in sorted(self.layers.items()):
            dtype = attention.q_proj.weight.dtype
            # The wrapped model's forward runs under the mixed-precision autocast; this call bypasses it: enter it.
            with accelerator.autocast() if accelerator is not None else nullcontext():
                output = attention(**self._recorded_input(idx, dtype), cu_seq_lens_q=cu_seqlens)[0]
            self.outputs[idx] = output
            loss = self._layer_loss(idx) / len(self.layers)
            if accelerator is not None:
                accelerator.backward(loss)
            else:
                loss.backward()
            losses.append(loss.detach())
            del self.outputs[idx]
        if accelerator is not None and accelerator.num_processes > 1 and accelerator.sync_gradients:
            average_gradients(model, accelerator)
        return torch.stack(losses).sum()


def average_gradients(model: nn.Module, accelerator: Accelerator) -> None:
    """Average the gradients of the trainable parameters over the processes (what DDP does in its backward)."""
    grads = [param.grad for param in model.parameters() if param.requires_grad and param.grad is not None]
    flat = accelerator.reduce(torch.cat([grad.flatten() for grad in grads]), reduction="mean")
    for grad, averaged in zip(grads, flat.split([grad.numel() for grad in grads]), strict=True):
        grad.copy_(averaged.view_as(grad))


def _rope_kwargs(kwargs: dict) -> dict:
    return {"position_embeddings": kwargs["position_embeddings"]} if "position_embeddings" in kwargs else {}


def distillation_loss(
    model: nn.Module, teacher: nn.Module, batch: dict[str, torch.Tensor], temperature: float
) -> torch.Tensor:
    """Stage 2: KL(teacher || student) of the next-token distributions at softened `temperature`, times T^2, mean
    over the positions that predict a token of their own sequence."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1].float()
    student_logits = model(**inputs).logits[:, :-1].float()
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    kl = F.kl_div(
        F.log_softmax(student_logits[mask] / temperature, -1),
        F.log_softmax(teacher_logits[mask] / temperature, -1),
        log_target=True,
        reduction="batchmean",
    )
    return kl * temperature**2


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stage 3: next-token cross entropy, no prediction across sequence boundaries."""
    return model(**batch, use_cache=False).loss


# ---------------------------------------------------------------------------------------------------------------------
# Run state, schedule, evaluation, logging


@dataclass
class RunState:
    """What a checkpoint keeps besides model, optimizer and RNG (`run_state.json`): the data position and the
    recovery log."""

    step: int = 0
    batches: int = 0  # micro-batches consumed per process: the data position
    tokens: int = 0
    source_ppl: dict[str, float] = field(default_factory=dict)  # by eval length, e.g. "1x"
    history: list[dict] = field(default_factory=list)


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


def plot_recovery(state: RunState, path: Path, target_ratio: float | None) -> None:
    """recovery.png: perplexity ratio to the source against tokens seen, one line per evaluation length (the
    perplexity itself when there is no source model to compare with)."""
    metric = "ratio" if state.source_ppl else "ppl"  # without a teacher there is no ratio: plot the perplexity
    curves = {
        f"eval at {length} block_size": [(entry["tokens"], entry[metric][length]) for entry in state.history]
        for length in state.history[0][metric]
    }
    plots.plot_recovery(curves, path, ratio=bool(state.source_ppl), target=target_ratio)


RUN_STATE = "run_state.json"  # the last file a checkpoint gets
STAGING = ".partial"  # checkpoints/.step-NNNNNNNN.partial: a checkpoint being written


def step_dirs(output_dir: Path) -> list[Path]:
    """The `checkpoints/step-NNNNNNNN` directories, oldest first, complete or not."""
    return sorted(path for path in (output_dir / "checkpoints").glob("step-*") if path.is_dir())


def complete_checkpoints(output_dir: Path) -> list[Path]:
    """The checkpoints holding their run state, oldest first."""
    return [path for path in step_dirs(output_dir) if (path / RUN_STATE).is_file()]


def latest_checkpoint(output_dir: Path, accelerator: Accelerator) -> Path | None:
    """The newest complete checkpoint, saying which and naming the incomplete ones passed over (left by a save killed
    midway before saves were staged). The main process removes the staging directories of unfinished saves."""
    checkpoints = output_dir / "checkpoints"
    if accelerator.is_main_process:
        for staging in sorted(checkpoints.glob(f".step-*{STAGING}")):
            shutil.rmtree(staging)
            accelerator.print(f"removed {staging}: a checkpoint save that did not finish")
    incomplete, found = [], None
    for path in reversed(step_dirs(output_dir)):
        if (path / RUN_STATE).is_file() or any(path.glob("custom_checkpoint_*.pkl")):  # old format: refused later
            found = path
            break
        incomplete.append(path.name)
    if incomplete:
        accelerator.print(f"skipped incomplete checkpoint(s) {', '.join(incomplete)} in {checkpoints} (no {RUN_STATE})")
    accelerator.print(f"resuming from {found}" if found else f"no complete checkpoint in {checkpoints}: starting anew")
    return found


RUN_OUTPUTS = ("checkpoints", "logs", "final", "adapter", "recovery.json", "recovery.png")  # not `converted`


def check_output_dir(training: TrainingArguments, force: bool) -> list[Path]:
    """The outputs of an earlier run in `training.output_dir`, for `force` to delete. A new run over them, whose
    checkpoints and logs would mix with the old ones, is refused unless it resumes or is forced."""
    output_dir = Path(training.output_dir)
    found = [output_dir / name for name in RUN_OUTPUTS if (output_dir / name).exists()]
    if force and training.resume:
        raise RecipeError("--force deletes the checkpoints training.resume=true would continue from: give only one")
    if found and not training.resume and not force:
        raise RecipeError(
            f"training.output_dir {output_dir} holds an earlier run ({', '.join(path.name for path in found)}): "
            "continue it with training.resume=true, or start anew in a new or empty training.output_dir, or with "
            "--force (deletes those, keeps converted/)"
        )
    return found if force else []


def save_checkpoint(accelerator: Accelerator, state: RunState, output_dir: Path, keep: int) -> Path:
    """`accelerator.save_state` (model, optimizer, each process's RNG states) and the run state as JSON into
    `checkpoints/.step-NNNNNNNN.partial`, which the main process renames to `step-NNNNNNNN` once every file is on
    disk: a save killed midway leaves the previous checkpoints as they were. Keeps the latest `keep` complete ones."""
    path = output_dir / "checkpoints" / f"step-{state.step:08d}"
    staging = path.with_name(f".{path.name}{STAGING}")
    if accelerator.is_main_process:
        shutil.rmtree(staging, ignore_errors=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(staging))  # every process writes its own RNG states
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        (staging / RUN_STATE).write_text(json.dumps(asdict(state)))
        # over an incomplete one of an earlier run, or this step saved again
        replace_directory(staging, path, old=path.with_name(f".{path.name}.old{STAGING}"), sync=True)
        for old in complete_checkpoints(output_dir)[:-keep]:
            shutil.rmtree(old)
    accelerator.wait_for_everyone()
    return path


# What DeepSpeed writes beside its shards: the text file naming them, and conversion scripts a resume never runs.
DEEPSPEED_FILES = ("latest", "zero_to_fp32.py", "zero_to_torch.py")


def read_checkpoint(checkpoint: Path, accelerator: Accelerator) -> RunState:
    """The run state of `checkpoint`, read before any model is loaded, refusing a checkpoint that resuming from could
    run code or leave the RNG states behind: every file besides safetensors and JSON must load through accelerate's
    restricted loader (tensors, numbers, containers, numpy arrays), and there must be one RNG state file per process."""
    if pickled := sorted(checkpoint.glob("custom_checkpoint_*.pkl")):
        raise RecipeError(
            f"{pickled[0]}: a pickled run state (what earlier versions of this recipe wrote) is not loaded, as a "
            "pickle can run code; this checkpoint cannot be resumed: start anew with --force or in a new "
            "training.output_dir"
        )
    for file in sorted(checkpoint.iterdir()):
        if file.is_dir() or file.suffix in (".safetensors", ".json") or file.name in DEEPSPEED_FILES:
            continue  # directories: engine shards (DeepSpeed), read by the engine's own loader
        try:
            load_restricted(file, map_location="cpu", mmap=True)
        except Exception as error:
            reason = (str(error).strip() or type(error).__name__).splitlines()[0]
            raise RecipeError(
                f"{file}: refused, it does not load as plain tensors and numbers (torch.load weights_only=True: "
                f"{reason}); resume only from checkpoints this recipe wrote"
            ) from error
    processes = len(list(checkpoint.glob("random_states_*.pkl")))
    if processes != accelerator.num_processes:
        raise RecipeError(
            f"{checkpoint}: written by {processes} process(es), this run has {accelerator.num_processes}; resume with "
            "the same number of processes (the data position and the RNG states are per process)"
        )
    try:
        return RunState(**json.loads((checkpoint / RUN_STATE).read_text()))
    except (OSError, ValueError, TypeError) as error:
        raise RecipeError(f"{checkpoint / RUN_STATE}: not a run state of this recipe ({error})") from error


def restore_checkpoint(accelerator: Accelerator, checkpoint: Path) -> None:
    """`accelerator.load_state` of a checkpoint `read_checkpoint` accepted, refusing to go on if the RNG states were
    not restored (accelerate only logs that)."""
    accelerator.load_state(str(checkpoint))
    rng_file = checkpoint / f"random_states_{accelerator.process_index}.pkl"
    saved = load_restricted(rng_file, map_location="cpu")
    torch_state = saved.get("torch_manual_seed") if isinstance(saved, dict) else None
    if not isinstance(torch_state, torch.Tensor) or not torch.equal(torch.get_rng_state(), torch_state):
        raise RecipeError(f"{rng_file}: its random states could not be restored; an exact resume needs them")


def all_processes(accelerator: Accelerator, flag: bool) -> bool:
    """True when `flag` is true on any process (so every process takes the same branch)."""
    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum").item() > 0)


class StopRequest:
    """While entered, SIGTERM and Ctrl-C set `signal` instead of stopping the process: the loop checkpoints at the
    end of the step and exits. The previous handlers come back on exit."""

    def __init__(self):
        self.signal: int | None = None
        self._previous = {}

    def __enter__(self) -> StopRequest:
        for signum in (signal.SIGINT, signal.SIGTERM):
            self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc_info):
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum, frame):
        self.signal = signum


LAUNCHER_VARIABLES = ("ACCELERATE_MIXED_PRECISION", "TORCHELASTIC_RUN_ID")  # set by accelerate launch, by torchrun


def follow_launcher(poll_seconds: float = 1.0) -> None:
    """Under `accelerate launch` or torchrun, send this process SIGTERM when its launcher dies, so that it checkpoints
    and exits (`StopRequest`). accelerate's one-process launcher dies of a SIGTERM (from `kill`, `timeout`, a
    scheduler) without passing it on, and the training process would otherwise train on, re-parented; this also
    covers a launcher killed by SIGKILL. A script started from a shell keeps running when the shell exits (nohup)."""
    if not any(name in os.environ for name in LAUNCHER_VARIABLES):
        return
    launcher = os.getppid()

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(poll_seconds)
        os.kill(os.getpid(), signal.SIGTERM)

    threading.Thread(target=watch, name="follow-launcher", daemon=True).start()


# ---------------------------------------------------------------------------------------------------------------------
# The run


def train(config: RecipeConfig, force: bool = False) -> dict:
    """Run the recipe; returns what `recovery.json` holds. `force`: clear the outputs of an earlier run in
    `training.output_dir` first (`--force`)."""
    data_args, training = config.data, config.training
    output_dir = Path(training.output_dir)
    # Everything that can be refused is checked before the first model is loaded or converted.
    earlier_outputs = check_output_dir(training, force)
    plan = plan_models(config)
    documents, eval_texts = load_documents(data_args)

    trackers = [
        JSONLTracker("recovery", output_dir / "logs") if name == "jsonl" else name for name in training.log_with
    ]
    uses_alignment = any(stage.name == "align" for stage in config.stages)
    accelerator = Accelerator(
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        log_with=trackers,
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # The align stage leaves the parameters after the last PaTH attention without gradients.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=uses_alignment)],
    )
    set_seed(training.seed)
    if earlier_outputs and accelerator.is_main_process:
        for path in earlier_outputs:
            if path.is_dir():
                shutil.rmtree(path)
            else:
                path.unlink()
        accelerator.print(f"--force: deleted {', '.join(path.name for path in earlier_outputs)} of {output_dir}")
    accelerator.wait_for_everyone()
    checkpoint = latest_checkpoint(output_dir, accelerator) if training.resume else None
    state = read_checkpoint(checkpoint, accelerator) if checkpoint is not None else RunState()
    check_engine(training, accelerator.distributed_type, accelerator.state.deepspeed_plugin)

    student, teacher = load_models(config, plan, accelerator)
    tokenizer = load_tokenizer(plan.student)
    if training.activation_checkpointing:
        student.activation_checkpointing_enable()
        if training.trainable == "lora":  # the frozen embeddings' output must carry gradients into checkpointed layers
            student.enable_input_require_grads()
    model = select_trainable(student, training)
    alignment = None
    if uses_alignment:
        # Sharded engines gather their weights in the model's own forward: the student must run whole there.
        sharded_engine = accelerator.distributed_type in (DistributedType.FSDP, DistributedType.DEEPSPEED)
        alignment = AttentionAlignment(model, teacher, isolated=not sharded_engine)

    blocks = training_blocks(documents, tokenizer, data_args, accelerator)
    dataloader = DataLoader(blocks, batch_size=training.batch_size)
    stream = tokenize_stream(eval_texts, tokenizer, data_args.eval_tokens)
    windows = {f"{n}x": make_windows(stream, n * data_args.block_size) for n in sorted(set(training.eval_lengths))}
    longest = max(training.eval_lengths) * data_args.block_size
    if len(stream) < longest:
        raise RecipeError(
            f"data: the evaluation split has {len(stream)} tokens, fewer than the longest evaluation window "
            f"(training.eval_lengths x data.block_size = {longest}); raise data.eval_tokens or data.eval_documents"
        )

    optimizer = torch.optim.AdamW(
        [param for param in model.parameters() if param.requires_grad], lr=0.0, weight_decay=training.weight_decay
    )
    # FSDP2 replaces every parameter by a sharded one (and swaps them in the optimizer): from here on the parameters
    # are only read from the prepared model.
    model, optimizer, dataloader = accelerator.prepare(model, optimizer, dataloader)
    if teacher is not None:
        # FSDP2 shards the teacher like the student; elsewhere it is a frozen replica on each device.
        teacher = shard_teacher(teacher, accelerator) if accelerator.is_fsdp2 else teacher.to(accelerator.device)

    if checkpoint is not None:
        restore_checkpoint(accelerator, checkpoint)
        accelerator.print(f"resumed at step {state.step} ({state.tokens:,} tokens)")

    tokens_per_step = (
        training.batch_size * data_args.block_size * training.gradient_accumulation_steps * accelerator.num_processes
    )
    stages = plan_stages(config.stages, tokens_per_step)
    total_steps = stages[-1].first_step + stages[-1].steps
    accelerator.init_trackers("recovery", config=_flat(asdict(config)))

    def record_eval() -> dict:
        ppl = evaluate(model, windows, accelerator, training.eval_batch_size)
        ratio = {length: ppl[length] / state.source_ppl[length] for length in ppl} if state.source_ppl else {}
        entry = {"step": state.step, "tokens": state.tokens, "ppl": ppl, "ratio": ratio}
        state.history.append(entry)
        logged = {f"eval/ppl_{length}": value for length, value in ppl.items()}
        logged |= {f"eval/ratio_{length}": value for length, value in ratio.items()}
        accelerator.log({**logged, "tokens": state.tokens}, step=state.step)
        accelerator.print(f"step {state.step}: tokens {state.tokens:,} ppl {_fmt(ppl)} ratio {_fmt(ratio)}")
        return entry

    if not state.history:  # before training: the source and the converted model on the evaluation split
        if teacher is not None:
            state.source_ppl = evaluate(teacher, windows, accelerator, training.eval_batch_size)
            accelerator.log({f"eval/source_ppl_{k}": v for k, v in state.source_ppl.items()}, step=0)
            accelerator.print(f"source model: ppl {_fmt(state.source_ppl)}")
        record_eval()

    with StopRequest() as stop:
        batches = endless_batches(dataloader, state.batches)
        progress = tqdm(
            total=total_steps, initial=state.step, disable=not accelerator.is_main_process, desc="training", unit="step"
        )
        reached_target, started, start_tokens, saved = False, time.perf_counter(), state.tokens, None
        model.train()
        while state.step < total_steps and not reached_target:
            current = stage_at(stages, state.step)
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(current, state.step)
            step_loss, grad_norm = 0.0, None
            for _ in range(training.gradient_accumulation_steps):
                batch = next(batches)
                name = current.stage.name
                with accelerator.accumulate(model):
                    # The alignment hooks stay on through backward, which may recompute activations.
                    with alignment.aligning() if name == "align" else nullcontext():
                        if name == "align":  # isolated, the loss comes back already backpropagated
                            loss = alignment.loss(model, teacher, batch, accelerator)
                        elif name == "distill":
                            loss = distillation_loss(model, teacher, batch, training.distill_temperature)
                        else:
                            loss = lm_loss(model, batch)
                        if all_processes(accelerator, not torch.isfinite(loss).item()):
                            # Nothing of this step has touched the weights: the checkpoint is the last good state.
                            path = saved or save_checkpoint(accelerator, state, output_dir, training.keep_checkpoints)
                            raise RecipeError(
                                f"non-finite {name} loss at step {state.step + 1}; the last good state is saved in "
                                f"{path}"
                            )
                        if loss.requires_grad:
                            accelerator.backward(loss)
                    if accelerator.sync_gradients and training.max_grad_norm > 0:
                        # The prepared model's parameters, all of them (FSDP replaced the ones the optimizer was built
                        # from, and accelerate's FSDP1 path clips only when given exactly these). DeepSpeed clips by its
                        # own config and this returns its norm.
                        grad_norm = accelerator.clip_grad_norm_(model.parameters(), training.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad()
                step_loss += loss.item() / training.gradient_accumulation_steps
            state.step += 1
            state.batches += training.gradient_accumulation_steps
            state.tokens += tokens_per_step
            tokens_per_second = (state.tokens - start_tokens) / (time.perf_counter() - started)
            progress.update()
            progress.set_postfix(stage=current.stage.name, loss=f"{step_loss:.4g}", tok_s=f"{tokens_per_second:,.0f}")
            if state.step % training.log_every == 0:
                logged = {
                    f"train/{current.stage.name}_loss": accelerator.reduce(
                        torch.tensor(step_loss, device=accelerator.device), "mean"
                    ).item(),
                    "train/lr": optimizer.param_groups[0]["lr"],
                    "train/tokens_per_second": tokens_per_second,
                    "tokens": state.tokens,
                }
                if grad_norm is not None:  # before clipping
                    logged["train/grad_norm"] = _scalar(grad_norm)
                accelerator.log(logged, step=state.step)
            if state.step % training.eval_every == 0 and state.step < total_steps:
                entry = record_eval()
                reached_target = _reached(entry, training.target_ratio)
            saved = None  # the checkpoint of this step, once saved
            if state.step % training.save_every == 0:
                saved = save_checkpoint(accelerator, state, output_dir, training.keep_checkpoints)
            if all_processes(accelerator, stop.signal is not None):
                path = saved or save_checkpoint(accelerator, state, output_dir, training.keep_checkpoints)
                progress.close()
                accelerator.end_training()
                raise Interrupted(
                    f"stopped by a signal at step {state.step}; checkpoint {path}; resume with training.resume=true"
                )
        progress.close()

    if not state.history or state.history[-1]["step"] != state.step:
        entry = record_eval()
        reached_target = _reached(entry, training.target_ratio)
    if state.step % training.save_every != 0:
        save_checkpoint(accelerator, state, output_dir, training.keep_checkpoints)
    recovery = {
        "source_ppl": state.source_ppl,
        "history": state.history,
        "final": state.history[-1],
        "stopped_at_target": reached_target,
        "replica_checksums": replica_checksums(model, accelerator),
    }
    save_final_model(model, tokenizer, accelerator, output_dir, training.trainable == "lora")
    accelerator.print(recovery_table(state))
    if accelerator.is_main_process:
        (output_dir / "recovery.json").write_text(json.dumps(recovery, indent=2) + "\n")
        plot_recovery(state, output_dir / "recovery.png", training.target_ratio)
    accelerator.end_training()
    return recovery


class Interrupted(Exception):
    """The run was stopped by SIGTERM or Ctrl-C after saving a checkpoint."""


def recovery_table(state: RunState) -> str:
    """Perplexity per evaluation length: the source model, the converted model before and after training."""
    first, last = state.history[0], state.history[-1]
    lines = [f"{'length':>8} {'source':>10} {'converted':>10} {'trained':>10} {'ratio':>7}"]
    for length, ppl in last["ppl"].items():
        source = state.source_ppl.get(length, math.nan)
        lines.append(f"{length:>8} {source:>10.4g} {first['ppl'][length]:>10.4g} {ppl:>10.4g} {ppl / source:>7.4f}")
    return "\n".join(lines + [f"after {last['tokens']:,} training tokens ({last['step']} steps)"])


def _reached(entry: dict, target_ratio: float | None) -> bool:
    return target_ratio is not None and bool(entry["ratio"]) and entry["ratio"]["1x"] <= target_ratio


def _scalar(value: torch.Tensor | float) -> float:
    """A number from a tensor, a DTensor (gathered: every process must call this) or a float (DeepSpeed's norm)."""
    if isinstance(value, DTensor):
        value = value.full_tensor()
    return float(value)


def _fmt(values: dict[str, float]) -> str:
    return " ".join(f"{key}={value:.4g}" for key, value in values.items())


def _flat(tree: dict, prefix: str = "") -> dict:
    """A nested config as flat `a/b` keys with scalar values (what trackers store as hyperparameters)."""
    flat = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            flat |= _flat(value, f"{name}/")
        elif isinstance(value, list) and value and isinstance(value[0], dict):
            flat |= _flat({str(i): item for i, item in enumerate(value)}, f"{name}/")
        else:
            flat[name] = value if isinstance(value, (int, float, str, bool)) or value is None else str(value)
    return flat


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


def save_final_model(model, tokenizer, accelerator: Accelerator, output_dir: Path, lora: bool) -> None:
    """`final/`: a plain PaTHLlama checkpoint with its tokenizer (LoRA merged; its adapter kept in `adapter/`), saved
    by the main process from the state dict gathered from every process (FSDP, ZeRO-3)."""
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
    accelerator.wait_for_everyone()


def main(argv: list[str] | None = None) -> int:
    """Run the recipe from the command line; a refused configuration prints `error: ...` and returns 1."""
    try:
        command = parse_command(argv)
        train(read_config(command), force=command.force)
    except RecipeError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    follow_launcher()
    sys.exit(main())
