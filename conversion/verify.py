# Copyright 2026 The path-hf authors. Apache-2.0.
"""`--verify`: run the converted checkpoint and its source on the same tokens and compare their logits.

With RoPE kept and every Householder transform at the identity (all `bt_proj` / `g_proj` gains 0, whatever
`--init` chose), a PaTH layer computes what the source layer computed, so the logits must agree to rounding: any
larger difference is a weight that went to the wrong place. Both models run with their decoder layers streamed
from the checkpoint files (a layer's weights are loaded just before it runs and dropped after), so memory holds
the embeddings and one layer whatever the model size.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig

from path_hf.modeling_path_llama import PaTHBetaProjection, PaTHForgetGateProjection

from .convert import ConversionPlan
from .errors import ConversionError
from .io import SourceReader, SourceWeights
from .options import VERIFY_TOLERANCE

TEXT_FILE = Path(__file__).with_name("verify_text.txt")
MAX_TOKENS = 256
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class CheckpointTensors:
    """`name -> float32 tensor` from a checkpoint's files, one file open at a time, remembering what was read.

    `round_to` gives a tensor the dtype it has after conversion before it is widened to float32, so that a source
    compared with a `--dtype`-cast output differs only by what the conversion is meant to change.
    """

    def __init__(self, weights: SourceWeights, round_to: dict[str, torch.dtype] | None = None):
        self._tensors = {tensor.name: tensor for tensor in weights.tensors}
        self._round_to = round_to or {}
        self._reader = SourceReader()
        self.used: set[str] = set()

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._tensors:
            raise ConversionError(f"verification failed: the model has a parameter {name!r} the checkpoint lacks.")
        self.used.add(name)
        tensor = self._reader.tensor(self._tensors[name])
        return tensor.to(self._round_to.get(name, tensor.dtype)).float()

    @property
    def unused(self) -> set[str]:
        return set(self._tensors) - self.used


def streamed_logits(
    config: PretrainedConfig,
    load: Callable[[str], torch.Tensor],
    input_ids: torch.Tensor,
    prepare_layer: Callable[[nn.Module], None] | None = None,
) -> torch.Tensor:
    """Float32 logits of the causal LM `config` describes, with weights from `load(name)`, holding the embeddings
    and one decoder layer at a time; `prepare_layer` edits each layer once its weights are loaded."""
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, RoPE buffers computed
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.eval()
    tied = config.tie_word_embeddings
    resident = [
        name
        for name in model.state_dict()
        if not name.startswith("model.layers.") and not (tied and name == "lm_head.weight")
    ]
    model.load_state_dict({name: load(name) for name in resident}, strict=False, assign=True)
    if tied:
        model.get_output_embeddings().weight = model.get_input_embeddings().weight

    def load_layer(layer_idx: int, layer: nn.Module, args) -> None:
        prefix = f"model.layers.{layer_idx}."
        layer.load_state_dict({name: load(prefix + name) for name in layer.state_dict()}, assign=True)
        if prepare_layer is not None:
            prepare_layer(layer)

    def drop_layer(layer: nn.Module, args, output) -> None:
        layer.to("meta")

    for layer_idx, layer in enumerate(model.model.layers):
        layer.register_forward_pre_hook(partial(load_layer, layer_idx))
        layer.register_forward_hook(drop_layer)
    with torch.no_grad():
        return model(input_ids).logits.float()


def _identity_transforms(layer: nn.Module) -> None:
    for module in layer.modules():
        if isinstance(module, (PaTHBetaProjection, PaTHForgetGateProjection)):
            module.gain.data.zero_()  # beta = 0: H_t = I; g = 0: forget gate 1


def _perplexity(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    return math.exp(F.cross_entropy(logits[0, :-1], input_ids[0, 1:]).item())


def verification_input(source_dir: Path, vocab_size: int) -> tuple[torch.Tensor, bool]:
    """Token ids `[1, T]` of the built-in text in the source's tokenizer, or fixed random ids if the source has no
    tokenizer; and whether they are text (perplexity means something only then)."""
    if any((source_dir / name).is_file() for name in _TOKENIZER_FILES):
        tokenizer = AutoTokenizer.from_pretrained(source_dir)
        ids = tokenizer(TEXT_FILE.read_text(), return_tensors="pt").input_ids[:, :MAX_TOKENS]
        if ids.max() < vocab_size:
            return ids, True
    generator = torch.Generator().manual_seed(0)
    return torch.randint(0, vocab_size, (1, 64), generator=generator), False


def verify_conversion(plan: ConversionPlan, directory: Path) -> float:
    """Check the conversion written to `directory` against its source; returns the max abs logit difference.

    Prints the difference and the perplexity of both models on the built-in text. Raises `ConversionError` when
    the difference exceeds `VERIFY_TOLERANCE`, or when the checkpoint and the model disagree about a tensor.
    """
    input_ids, is_text = verification_input(plan.source.path, plan.config.vocab_size)
    print(f"verify: running the source and the converted model on {input_ids.shape[1]} tokens", flush=True)
    round_to = {tensor.source.name: tensor.dtype for tensor in plan.tensors if tensor.source is not None}
    source_logits = streamed_logits(
        AutoConfig.from_pretrained(plan.source.path), CheckpointTensors(plan.weights, round_to), input_ids
    )

    converted = CheckpointTensors(SourceWeights.from_directory(directory))
    config = AutoConfig.from_pretrained(directory)
    identity_config = AutoConfig.from_pretrained(directory, rope_mode="keep")
    identity_logits = streamed_logits(identity_config, converted, input_ids, prepare_layer=_identity_transforms)
    if converted.unused:
        raise ConversionError(
            f"verification failed: the converted checkpoint holds tensors the model does not use, e.g. "
            f"{sorted(converted.unused)[0]!r}."
        )
    max_diff = (identity_logits - source_logits).abs().max().item()
    print(
        f"verify: max |logits - source logits| = {max_diff:.3g} with RoPE kept and the transforms at identity "
        f"(limit {VERIFY_TOLERANCE:g})",
        flush=True,
    )
    if not max_diff <= VERIFY_TOLERANCE:
        raise ConversionError(
            f"verification failed: the converted model's logits differ from the source's by {max_diff:.3g} "
            f"(> {VERIFY_TOLERANCE:g}) with the transforms at identity; the weight mapping is wrong."
        )

    if not is_text:
        print("verify: the source has no tokenizer; perplexity skipped", flush=True)
        return max_diff
    same_model = config.rope_mode == "keep" and config.path_init == "identity"
    converted_logits = identity_logits if same_model else streamed_logits(config, converted, input_ids)
    print(
        f"verify: perplexity on the built-in text: source {_perplexity(source_logits, input_ids):.3f}, converted "
        f"{_perplexity(converted_logits, input_ids):.3f} (rope {config.rope_mode}, init {config.path_init})",
        flush=True,
    )
    return max_diff


__all__ = ["CheckpointTensors", "streamed_logits", "verification_input", "verify_conversion"]
