# Copyright 2026 The path-hf authors. Apache-2.0.
"""The losses of the recipe's three stages: `align` (`AttentionAlignment`: each PaTH attention matched to the
teacher's on the teacher's input, MSE), `distill` (KL to the teacher's next-token distribution) and `lm` (next-token
cross entropy)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.checkpoint import checkpoint

from path_hf.errors import RecipeError
from path_hf.evaluation import IGNORE_INDEX
from path_hf.modeling_path_llama import packed_sequences
from path_hf.recipes.models import path_attention_layers


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
        # The student's own RoPE tables, computed once a step where the teacher's are of lower precision.
        self.rotary = next((m for name, m in student.named_modules() if name.endswith("rotary_emb")), None)
        self.tables: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor]] = {}
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
                if kwargs.get("position_ids") is not None:
                    self.inputs[idx]["position_ids"] = kwargs["position_ids"]

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
            tables = recorded["position_embeddings"]
            if _less_precise(tables[0].dtype, dtype) and self.rotary is not None and "position_ids" in recorded:
                # a bfloat16 teacher hands down cos/sin rounded to 3 digits: the student's own, at its precision
                if dtype not in self.tables:
                    self.tables[dtype] = self.rotary(kwargs["hidden_states"], recorded["position_ids"])
                tables = self.tables[dtype]
            kwargs["position_embeddings"] = tuple(t.to(dtype) for t in tables)
        return kwargs

    def _record(self, store: dict, idx: int):
        def hook(module, args, output):
            if self.active:
                store[idx] = output[0]

        return hook

    @contextmanager
    def aligning(self) -> Iterator[None]:
        """The hooks work inside this block: the forward passes, and the backward (which may recompute them)."""
        self.active = True
        try:
            yield
        finally:
            self.active = False
            self.inputs.clear()
            self.targets.clear()
            self.outputs.clear()
            self.tables.clear()

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


def _less_precise(dtype: torch.dtype, than: torch.dtype) -> bool:
    return torch.finfo(dtype).eps > torch.finfo(than).eps


def _rope_kwargs(kwargs: dict) -> dict:
    return {"position_embeddings": kwargs["position_embeddings"]} if "position_embeddings" in kwargs else {}


KL_CHUNK = 256  # rows of the vocabulary-wide log-softmax formed at once by `distillation_loss`


def _kl_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over rows of KL(teacher || student) of softmax(logits / temperature), in float32."""
    student = F.log_softmax(student_logits.float() / temperature, -1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, -1)
    return F.kl_div(student, teacher, log_target=True, reduction="sum")


def distillation_loss(
    model: nn.Module,
    teacher: nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    chunk: int = KL_CHUNK,
) -> torch.Tensor:
    """Stage 2: KL(teacher || student) of the next-token distributions at softened `temperature`, times T^2, mean
    over the positions that predict a token of their own sequence.

    The KL is formed `chunk` rows at a time, each recomputed in the backward (`torch.utils.checkpoint`): besides the
    two models' logits and the student's logit gradient, memory holds one chunk's vocabulary-wide temporaries, not
    the five or so full [tokens, vocabulary] tensors of a one-shot `F.kl_div` (at 2048 tokens and SmolLM2's 49,152
    words, 400 MB each in float32)."""
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    with torch.no_grad():
        teacher_logits = teacher(**inputs).logits[:, :-1][mask]  # in the teacher's dtype: float32 per chunk
    student_logits = model(**inputs).logits[:, :-1][mask]
    if not len(student_logits):  # no position predicts a token of its own sequence: nothing to match
        return student_logits.sum()
    pieces = [
        checkpoint(_kl_rows, rows, target, temperature, use_reentrant=False)
        for rows, target in zip(student_logits.split(chunk), teacher_logits.split(chunk), strict=True)
    ]
    return torch.stack(pieces).sum() / len(student_logits) * temperature**2


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stage 3: next-token cross entropy, no prediction across sequence boundaries."""
    return model(**batch, use_cache=False).loss
