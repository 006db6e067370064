# Copyright 2026 The path-hf authors. Apache-2.0.
"""The losses of the recipe's three stages: `align` (`AttentionAlignment`: each PaTH attention matched to the
teacher's on the teacher's input, MSE), `distill` (KL to the teacher's next-token distribution) and `lm` (next-token
cross entropy)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.nn.functional as F
from accelerate import Accelerator, DistributedType
from accelerate.utils import extract_model_from_parallel
from torch import nn
from torch.utils.checkpoint import checkpoint

from ..errors import RecipeError
from ..evaluation import IGNORE_INDEX
from ..modeling_path_llama import packed_sequences
from .models import path_attention_layers


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
        # (a hybrid's local layers have their own, `local_rotary_emb`; PaTH layers take `rotary_emb`'s)
        self.rotary = next((m for name, m in student.named_modules() if name.rsplit(".", 1)[-1] == "rotary_emb"), None)
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
                return args, {**kwargs, **self.recorded_input(idx, kwargs["hidden_states"].dtype)}
            return None

        return hook

    def recorded_input(self, idx: int, dtype: torch.dtype) -> dict:
        """The keyword arguments of PaTH layer `idx`'s attention in `dtype`: the input the teacher's attention of that
        layer received (recorded in this step's teacher forward), its RoPE tables the student's own where the teacher's
        are less precise."""
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

    def layer_loss(self, idx: int) -> torch.Tensor:
        """The MSE of PaTH layer `idx`'s attention output against the teacher's, both recorded this step."""
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
            loss = torch.stack([self.layer_loss(i) for i in sorted(self.outputs)]).mean()
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
                output = attention(**self.recorded_input(idx, dtype), cu_seq_lens_q=cu_seqlens)[0]
            self.outputs[idx] = output
            loss = self.layer_loss(idx) / len(self.layers)
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


def holds_whole_weights(accelerator: Accelerator) -> bool:
    """One process or DDP: every process holds whole weights, so a module may run outside the model's own forward.
    FSDP and DeepSpeed gather the weights in the wrapped model's forward only."""
    return accelerator.distributed_type not in (DistributedType.FSDP, DistributedType.DEEPSPEED)


def _kl_rows(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """Sum over rows of KL(teacher || student) of softmax(logits / temperature), in float32."""
    student = F.log_softmax(student_logits.float() / temperature, -1)
    teacher = F.log_softmax(teacher_logits.float() / temperature, -1)
    return F.kl_div(student, teacher, log_target=True, reduction="sum")


def _kl_rows_from_hidden(
    student_hidden: torch.Tensor,
    teacher_hidden: torch.Tensor,
    student_head: nn.Module,
    teacher_head: nn.Module,
    temperature: float,
) -> torch.Tensor:
    """`_kl_rows` of the logits that the two LM heads give on these rows of final hidden states."""
    with torch.no_grad():
        teacher_logits = teacher_head(teacher_hidden)
    return _kl_rows(student_head(student_hidden), teacher_logits, temperature)


def distillation_loss(
    model: nn.Module,
    teacher: nn.Module,
    batch: dict[str, torch.Tensor],
    temperature: float,
    chunk: int = KL_CHUNK,
    whole_weights: bool = True,
    answer_weight: float = 1.0,
    kl_stride: int = 1,
) -> torch.Tensor:
    """Stage 2: KL(teacher || student) of the next-token distributions at softened `temperature`, times T^2, mean
    over the positions that predict a token of their own sequence.

    The KL is formed `chunk` rows at a time, each recomputed in the backward (`torch.utils.checkpoint`):
    - `whole_weights` (`holds_whole_weights`): the two models run with their LM heads on the last position only,
      and each chunk's logits are formed by the heads from the final hidden states inside the recomputed chunk, so
      no [tokens, vocabulary] tensor is ever whole. At 4096 tokens and SmolLM2's 49,152 words each is 805 MB in
      float32, and the one-shot loss held five or so of them.
    - otherwise (FSDP, DeepSpeed) the models return their whole logits and only the KL's temporaries are chunked:
      memory holds the two models' logits and the student's logit gradient besides one chunk's temporaries.

    A batch with `answer_labels` (retrieval blocks, `path_hf.recipes.retrieval_blocks`) adds `answer_weight` times the
    student's cross entropy on those tokens (mean over them): the answers themselves, not only the teacher's guess.
    `kl_stride` k > 1 forms the KL at every k-th position only (of each row), an estimate at 1/k of the output head's
    cost, which dominates a step of a small model with a large vocabulary.
    """
    inputs = {"input_ids": batch["input_ids"], "position_ids": batch["position_ids"], "use_cache": False}
    mask = batch["labels"][:, 1:] != IGNORE_INDEX
    if kl_stride > 1:
        mask = mask & (torch.arange(mask.shape[1], device=mask.device) % kl_stride == kl_stride - 1)
    answers = batch.get("answer_labels")
    answer_mask = answers[:, 1:] != IGNORE_INDEX if answers is not None else None
    if not whole_weights:
        with torch.no_grad():
            teacher_logits = teacher(**inputs).logits[:, :-1][mask]  # in the teacher's dtype: float32 per chunk
        all_logits = model(**inputs).logits[:, :-1]
        student_logits = all_logits[mask]
        pieces = [
            checkpoint(_kl_rows, rows, target, temperature, use_reentrant=False)
            for rows, target in zip(student_logits.split(chunk), teacher_logits.split(chunk), strict=True)
        ]
        loss = _mean_kl(pieces, student_logits, temperature)
        if answer_mask is not None and answer_mask.any():
            loss = loss + answer_weight * F.cross_entropy(all_logits[answer_mask].float(), answers[:, 1:][answer_mask])
        return loss
    # The last hidden state that transformers returns is the final norm's output, the LM head's input.
    inputs |= {"output_hidden_states": True, "logits_to_keep": 1}
    with torch.no_grad():
        teacher_hidden = teacher(**inputs).hidden_states[-1][:, :-1][mask]
    all_hidden = model(**inputs).hidden_states[-1][:, :-1]
    student_hidden = all_hidden[mask]
    heads = [extract_model_from_parallel(m).get_output_embeddings() for m in (model, teacher)]
    pieces = [
        checkpoint(_kl_rows_from_hidden, rows, target, *heads, temperature, use_reentrant=False)
        for rows, target in zip(student_hidden.split(chunk), teacher_hidden.split(chunk), strict=True)
    ]
    loss = _mean_kl(pieces, student_hidden, temperature)
    if answer_mask is not None and answer_mask.any():
        logits = heads[0](all_hidden[answer_mask]).float()
        loss = loss + answer_weight * F.cross_entropy(logits, answers[:, 1:][answer_mask])
    return loss


def _mean_kl(pieces: list[torch.Tensor], rows: torch.Tensor, temperature: float) -> torch.Tensor:
    if not len(rows):  # no position predicts a token of its own sequence: nothing to match
        return rows.sum()
    return torch.stack(pieces).sum() / len(rows) * temperature**2


def lm_loss(model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """Stage 3: next-token cross entropy, no prediction across sequence boundaries."""
    return model(**batch, use_cache=False).loss
