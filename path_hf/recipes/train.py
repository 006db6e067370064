# Copyright 2026 The path-hf authors. Apache-2.0.
"""Recover a PaTH model converted from a RoPE model, tracking its perplexity against the source model.

    accelerate launch recipes/train.py --config recipes/configs/tiny-cpu.yaml [section.key=value ...]

Stages, any subset in order, each with its own token budget and learning rate: `align` (each PaTH layer's attention
output matched to the source layer's on the same input, MSE), `distill` (KL to the source model's next-token
distribution) and `lm` (continued pretraining). The source model's and the converted model's perplexity on a
held-out split are measured before training, then the converted model's every `eval_every` steps and at the end, at
1x, 2x, 4x... the training block length; `recovery.json` and `recovery.png` hold the result. See recipes/README.md.

This file is the run: set up, then the loop. The rest of the recipe is beside it: `settings.py` (the config),
`models.py` (student, teacher, what trains, engine checks), `data.py` (documents, blocks, evaluation windows),
`losses.py` (the three stages' losses), `schedule.py` (stages on steps, learning rate), `checkpoints.py` (saving,
resuming, stopping), `tracking.py` (perplexity recovery, logs).
"""

from __future__ import annotations

import gc
import random
import sys
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path

import torch
from accelerate import Accelerator, DistributedDataParallelKwargs
from accelerate.utils import ProjectConfiguration, set_seed
from torch import nn
from torch.utils.data import DataLoader

from ..errors import CommandError, RecipeError, first_line
from ..evaluation.texts import data_fault
from ..loading import load_tokenizer
from ..signals import StopRequest
from .checkpoints import (
    Checkpointer,
    Interrupted,
    RunState,
    all_processes,
    check_output_dir,
    check_resume,
    check_same_model,
    delete_earlier_run,
    follow_launcher,
    latest_checkpoint,
    model_fingerprint,
    output_dir_lock,
    readable_checkpoint,
    recorded_config,
    restore_checkpoint,
)
from .data import endless_batches, evaluation_windows, load_documents, training_blocks
from .losses import AttentionAlignment, distillation_loss, holds_whole_weights, lm_loss
from .models import (
    check_engine,
    final_card,
    load_models,
    narrow_trainable,
    place_teacher,
    plan_models,
    replica_checksums,
    save_final_model,
    set_activation_checkpointing,
    stage_checkpointing,
    trainable_model,
)
from .retrieval_blocks import RetrievalBlocks
from .schedule import batches_drawn, plan_stages, planned_steps, stage_at, stage_scheduler
from .settings import RecipeConfig, Stage, TrainingSettings, parse_command, read_config
from .tracking import RUN_NAME, RecoveryTracker, TrainingLog, flat_config, trackers, trim_log


def train(config: RecipeConfig, force: bool = False) -> dict:
    """Run the recipe; returns what `recovery.json` holds. `force`: clear the outputs of an earlier run in
    `training.output_dir` first (`--force`)."""
    output_dir = Path(config.training.output_dir)
    # Everything that can be refused is checked before the first model is loaded or converted.
    earlier_outputs = check_output_dir(config.training, force)
    with output_dir_lock(output_dir):
        return _train(config, earlier_outputs)


def _train(config: RecipeConfig, earlier_outputs: list[Path]) -> dict:
    data_args, training = config.data, config.training
    output_dir = Path(training.output_dir)
    plan = plan_models(config)
    documents, eval_texts = load_documents(data_args)

    uses_alignment = any(stage.name == "align" for stage in config.stages)
    accelerator = Accelerator(
        gradient_accumulation_steps=training.gradient_accumulation_steps,
        log_with=trackers(training.log_with, output_dir / "logs"),
        project_config=ProjectConfiguration(project_dir=str(output_dir), logging_dir=str(output_dir / "logs")),
        # The align stage leaves the parameters after the last PaTH attention without gradients.
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=uses_alignment)],
    )
    set_seed(training.seed)
    delete_earlier_run(earlier_outputs, output_dir, accelerator)
    micro_batches = training.gradient_accumulation_steps
    sequences_per_step = training.batch_size * micro_batches * accelerator.num_processes
    stages = plan_stages(config.stage_plan, sequences_per_step)
    checkpoint = latest_checkpoint(output_dir, accelerator) if training.resume else None
    state = RunState(config=recorded_config(config))
    if checkpoint is not None:  # the checkpoint whole, its run state sound, its model and its config this one
        checkpoint, saved = readable_checkpoint(checkpoint, accelerator)
        check_same_model(checkpoint, saved, plan.student)
        state = check_resume(checkpoint, saved, config, stages)
    check_engine(training, accelerator.distributed_type, accelerator.state.deepspeed_plugin, config.stages)

    student, teacher = load_models(config, plan, accelerator)
    state.model = state.model or model_fingerprint(plan.student)  # what a resume must find at model.path
    tokenizer = load_tokenizer(plan.student)
    # The stages' retrieval blocks by share (a stage's share is drawn per block, with the run's seed).
    retrieval = {
        stage.retrieval: RetrievalBlocks(tokenizer, stage.retrieval, seed=training.seed)
        for stage in config.stages
        if stage.retrieval
    }
    model = trainable_model(student, training, config.stages)
    # Sharded engines gather their weights in the model's own forward: the student must run whole there.
    isolated = holds_whole_weights(accelerator)
    alignment = AttentionAlignment(model, teacher, isolated=isolated) if uses_alignment else None
    # One packing of the training data per block length the stages use, each read from its own position.
    dataloaders = {
        size: DataLoader(
            training_blocks(documents, tokenizer, data_args, accelerator, size, setting),
            batch_size=training.batch_size,
        )
        for size, setting in config.block_size_settings.items()
    }
    windows = evaluation_windows(eval_texts, tokenizer, data_args, training.eval_lengths)
    trainable = [param for param in model.parameters() if param.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=0.0, weight_decay=training.weight_decay)
    # FSDP2 replaces every parameter by a sharded one (and swaps them in the optimizer): from here on the parameters
    # are only read from the prepared model.
    model, optimizer, *prepared = accelerator.prepare(model, optimizer, *dataloaders.values())
    dataloaders = dict(zip(dataloaders, prepared, strict=True))
    teacher = place_teacher(teacher, accelerator)
    if checkpoint is not None:
        restore_checkpoint(accelerator, checkpoint)
        accelerator.print(f"resumed at step {state.step} ({state.tokens:,} tokens)")

    total_steps = planned_steps(stages)
    if checkpoint is not None and accelerator.is_main_process and "jsonl" in training.log_with:
        if dropped := trim_log(output_dir / "logs", state.step):
            accelerator.print(f"dropped {dropped} row(s) of the log written after step {state.step}, logged again now")
    accelerator.init_trackers(RUN_NAME, config=flat_config(config))
    recovery = RecoveryTracker(state, windows, accelerator, training)
    if not state.history:  # before training: the source and the converted model on the evaluation split
        if teacher is not None:
            recovery.evaluate_source(teacher)
        recovery.evaluate(model)

    checkpointer = Checkpointer(accelerator, state, output_dir, training.keep_checkpoints)
    batches, block_size = None, None  # the batches of the current stage's block length
    scheduler, scheduled = None, None  # the learning rate of the current stage, from its first step run here
    trainable_set = training.trainable  # the set that trains now: a stage may narrow the run's (one process only)
    checkpointing = None  # whether the student recomputes its activations in backward now: stage by stage
    reached_target = False
    with StopRequest() as stop, TrainingLog(total_steps, state, accelerator, training.log_every) as log:
        model.train()
        while state.step < total_steps and not reached_target:
            current = stage_at(stages, state.step)
            if current.block_size != block_size:
                block_size = current.block_size
                start = batches_drawn(stages, state.step, block_size, micro_batches)
                batches = endless_batches(dataloaders[block_size], start)
            if (current.stage.trainable or training.trainable) != trainable_set:
                # The run's other parameters get no gradient (None after zero_grad): AdamW leaves them, and their
                # moments, as they are.
                trainable_set = current.stage.trainable or training.trainable
                narrow_trainable(accelerator.unwrap_model(model), training.trainable, trainable_set)
            if (wanted := stage_checkpointing(current.stage, training)) != checkpointing:
                checkpointing = wanted
                set_activation_checkpointing(student, checkpointing)
            if current is not scheduled:
                scheduled, scheduler = current, stage_scheduler(optimizer, current, state.step)
            else:
                scheduler.step()
            lr = scheduler.get_last_lr()[0]
            step_loss, grad_norm = 0.0, None
            blocks = retrieval.get(current.stage.retrieval)
            for micro in range(micro_batches):
                try:
                    batch = next(batches)
                except (ValueError, OSError) as error:  # a record a stream reaches only now (pyarrow's ArrowInvalid)
                    raise unreadable_data(error, config, checkpointer, accelerator) from error
                if blocks is not None:  # a share of the blocks made retrieval blocks, drawn per micro-batch
                    batch = blocks(batch, state.batches + micro)
                with training_window(student, current.stage, state.step, training.seed):
                    loss, norm = train_micro_batch(
                        batch,
                        current.stage,
                        model=model,
                        teacher=teacher,
                        alignment=alignment,
                        optimizer=optimizer,
                        accelerator=accelerator,
                        training=training,
                        checkpointer=checkpointer,
                    )
                grad_norm = grad_norm if norm is None else norm
                step_loss += loss / micro_batches
            state.step += 1
            state.batches += micro_batches
            state.tokens += current.tokens_per_step
            log.step(stage=current.stage.name, loss=step_loss, lr=lr, grad_norm=grad_norm)
            if state.step % training.eval_every == 0 and state.step < total_steps:
                reached_target = recovery.evaluate(model)
            if state.step % training.save_every == 0:
                checkpointer.save()
            if all_processes(accelerator, stop.signal is not None):
                path = checkpointer.ensure_saved()
                # the process group outlives them: end_run
                del model, student, teacher, optimizer, scheduler, alignment, prepared
                end_run(accelerator)
                raise Interrupted(
                    f"stopped by a signal at step {state.step}; checkpoint {path}; resume with training.resume=true"
                )

    if state.history[-1]["step"] != state.step:
        reached_target = recovery.evaluate(model)
    if state.step % training.save_every != 0:
        checkpointer.save()
    result = recovery.result(stopped_at_target=reached_target, replica_checksums=replica_checksums(model, accelerator))
    card = final_card(plan.student, config)
    save_final_model(model, tokenizer, accelerator, output_dir, lora=training.trainable == "lora", card=card)
    recovery.write(result, output_dir)
    del model, student, teacher, optimizer, scheduler, alignment, prepared  # the process group outlives them: end_run
    end_run(accelerator)
    return result


def unreadable_data(
    error: Exception, config: RecipeConfig, checkpointer: Checkpointer, accelerator: Accelerator
) -> RecipeError:
    """The refusal of training data that fails to read partway (a streamed file's bad record): the file and the line
    where one can be found, and, in a one-process run, the state before this step saved to resume from."""
    files = config.data.train_files
    where = (data_fault(files) if files else None) or first_line(error)
    step = checkpointer.state.step + 1
    if accelerator.num_processes > 1:  # the others may still read: no collective save
        return RecipeError(f"the training data cannot be read at step {step} ({where}): repair it and resume")
    return RecipeError(
        f"the training data cannot be read at step {step} ({where}); the state before that step is saved in "
        f"{checkpointer.ensure_saved()}: repair or remove the record, then resume with training.resume=true"
    )


def end_run(accelerator: Accelerator) -> None:
    """Release what accelerate holds of the run (prepared model, optimizer, data loaders, a DeepSpeed engine), collect
    it, and only then end the trackers and destroy the process group. The caller has dropped its own references. The
    group must outlive every wrapper of the model: a DDP model freed after it drops, in its reducer's destructor, the
    last reference to the gloo group while holding the GIL, and the group's destructor then joins a worker thread that
    may be waiting for the GIL to finish the last collective (a hang after the run's work is done, seen in CI)."""
    accelerator.free_memory()
    gc.collect()
    accelerator.end_training()


@contextmanager
def training_window(student: nn.Module, stage: Stage, step: int, seed: int) -> Iterator[None]:
    """The stage's training window on the student's local layers for one step (one of `stage.local_windows`, drawn
    from the run's seed and the step), its own `local_window` back after it: evaluation and the saved model keep it."""
    windows = stage.local_windows
    if not windows:
        yield
        return
    config = student.config
    kept = config.local_window
    config.local_window = random.Random(f"window-{seed}-{step}").choice(windows)
    try:
        yield
    finally:
        config.local_window = kept


def train_micro_batch(
    batch: dict[str, torch.Tensor],
    stage: Stage,
    *,
    model: nn.Module,
    teacher: nn.Module | None,
    alignment: AttentionAlignment | None,
    optimizer: torch.optim.Optimizer,
    accelerator: Accelerator,
    training: TrainingSettings,
    checkpointer: Checkpointer,
) -> tuple[float, torch.Tensor | float | None]:
    """One micro-batch of `stage`: its loss and backward, then clipping (on the last micro-batch of a step, where
    accelerate syncs the gradients) and the optimizer step (which accelerate skips on the others). Returns the loss
    and the gradient norm before clipping, if clipped."""
    with accelerator.accumulate(model):
        # The alignment hooks stay on through backward, which may recompute activations.
        with alignment.aligning() if stage.name == "align" else nullcontext():
            if stage.name == "align":  # isolated, the loss comes back already backpropagated
                loss = alignment.loss(model, teacher, batch, accelerator)
            elif stage.name == "distill":
                loss = distillation_loss(
                    model,
                    teacher,
                    batch,
                    training.distill_temperature,
                    whole_weights=holds_whole_weights(accelerator),
                    answer_weight=stage.retrieval_weight,
                    kl_stride=stage.kl_stride,
                )
            else:
                loss = lm_loss(model, batch)
            if all_processes(accelerator, not torch.isfinite(loss).item()):
                # Nothing of this step has touched the weights: the checkpoint holds them as the steps before left
                # them, which may already be diverging (a loss is finite until it is not).
                raise RecipeError(
                    f"non-finite {stage.name} loss at step {checkpointer.state.step + 1}; the state before that step "
                    f"is saved in {checkpointer.ensure_saved()} (its weights may already be diverging: if a resume "
                    "fails the same way, lower stages' learning_rate and resume from an earlier checkpoint or start "
                    "anew)"
                )
            if loss.requires_grad:
                accelerator.backward(loss)
        grad_norm = None
        if accelerator.sync_gradients and training.max_grad_norm > 0:
            # The prepared model's parameters, all of them (FSDP replaced the ones the optimizer was built from, and
            # accelerate's FSDP1 path clips only when given exactly these). DeepSpeed clips by its own config and
            # this returns its norm.
            grad_norm = accelerator.clip_grad_norm_(model.parameters(), training.max_grad_norm)
        optimizer.step()
        optimizer.zero_grad()
    return loss.item(), grad_norm


def main(argv: list[str] | None = None) -> int:
    """Run the recipe from the command line; a refused configuration or a failed conversion prints `error: ...` and
    returns 1."""
    try:
        command = parse_command(argv)
        train(read_config(command), force=command.force)
    except CommandError as error:  # the recipe's refusals, and those of the conversion it runs
        print(f"error: {error}", file=sys.stderr)
        return 1
    except Interrupted as stopped:
        print(stopped, file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    follow_launcher()
    sys.exit(main())
