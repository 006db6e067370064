# Copyright 2026 The path-hf authors. Apache-2.0.
"""`--verify`: run the converted checkpoint and its source on the same tokens and compare their logits.

With RoPE kept and every Householder transform at the identity (all `bt_gain` / `g_gain` gains 0, whatever
`--init` chose), a PaTH layer computes what the source layer computed, so the logits must agree to rounding: any
larger difference is a weight that went to the wrong place.

Both models run in float64, RMSNorms included, so that rounding (~1e-14) stays far below any real difference
however deep and wide the model: in float32 the PaTH layer's chunked attention and the source's SDPA, summing in
other orders, drift apart by 4e-5 to 7e-5 over SmolLM2's 30 layers already. The difference is measured relative
to the spread of the source's logits, `max |logits - source logits| / std(source logits)`, so the limit means the
same for every model. A failure names the first output that differs (the input embeddings, a layer's, the final
norm's, or the logits), which points at the wrong tensor. Logits that hold NaN or Inf (weights converted with
`--allow-nonfinite`) cannot be compared: the failure says so and names the first output that is not finite.

With `rope_max_wavelength` (critical-band RoPE) or an attention temperature the converted model no longer computes
the source, so it is compared with a reference built apart from PaTHLlama's code (`SourceReference`): the source as
transformers builds it, its PaTH layers given RoPE from a copy of its rotary embedding whose slow frequencies are 0,
and their queries multiplied by Llama 4's temperature in forward hooks.

Memory stays bounded whatever the model size: decoder layers are streamed from the checkpoint files (a layer's
weights are loaded just before it runs and dropped after), the input embeddings are gathered row by row for the
tokens used, and the head is applied in blocks of vocabulary rows.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
from accelerate import init_empty_weights
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig
from transformers.models.llama.modeling_llama import LlamaRMSNorm
from transformers.models.mistral.modeling_mistral import MistralRMSNorm
from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

from .. import PaTHLlamaConfig
from ..configuration_path_llama import RopeMode
from ..errors import ConversionError
from ..evaluation import token_nll
from ..modeling_path_llama import LAYER_PARAMETER, PATH_GAIN_INIT, PaTHGain
from .io import SourceReader, SourceTensor, SourceWeights
from .options import VERIFY_TOLERANCE, format_layers
from .plan import ConversionPlan

TEXT_FILE = Path(__file__).with_name("verify_text.txt")
MAX_TOKENS = 256
DTYPE = torch.float64
# The rows of the head multiplied at once: 64 MiB of them (`streamed_logits`' default).
HEAD_BLOCK_BYTES = 2**26
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
# The RMSNorms of the architectures the converter reads (PaTHLlama's is Llama's). They normalise in float32 whatever
# the input's dtype: a rounding to 6e-8 that the layers amplify (1e-12 noise on SmolLM2's embeddings then moves its
# logits by 2e-6 of their std), so `streamed_logits` runs them in the model's dtype.
_RMS_NORMS = (LlamaRMSNorm, MistralRMSNorm, Qwen2RMSNorm, Qwen3RMSNorm)

# `load(name, rows)`: a tensor, or rows `start:stop` of it, in the dtype the model runs in.
Loader = Callable[[str, slice | None], torch.Tensor]
# `observe(stage, hidden_states)`: called with the input embeddings, each decoder layer's output and the final norm's.
Observer = Callable[[str, torch.Tensor], None]


class CheckpointTensors:
    """`load(name, rows)` from a checkpoint's files, one file open at a time, remembering what was read.

    Returns `dtype` tensors. `round_to` gives a tensor the dtype it has after conversion before it is widened, so
    that a source compared with a `--dtype`-cast output differs only by what the conversion is meant to change.
    """

    def __init__(
        self, weights: SourceWeights, round_to: dict[str, torch.dtype] | None = None, dtype: torch.dtype = DTYPE
    ):
        self._tensors = {tensor.name: tensor for tensor in weights.tensors}
        self._round_to = round_to or {}
        self._dtype = dtype
        self._reader = SourceReader()
        self.used: set[str] = set()

    def __call__(self, name: str, rows: slice | None = None) -> torch.Tensor:
        if name not in self._tensors:
            raise ConversionError(f"verification failed: the model has a parameter {name!r} the checkpoint lacks.")
        self.used.add(name)
        tensor = self._tensors[name]
        if rows is not None:
            start, stop, _ = rows.indices(tensor.shape[0])
        # Allocated before the data is read: the read buffer, freed first, then leaves no hole in glibc's heap,
        # which would otherwise grow by tens of MB per layer.
        widened = torch.empty(tensor.shape if rows is None else (stop - start, *tensor.shape[1:]), dtype=self._dtype)
        data = self._reader.tensor(tensor) if rows is None else self._read_rows(tensor, start, stop)
        return widened.copy_(data.to(self._round_to.get(name, data.dtype)))

    def _read_rows(self, tensor: SourceTensor, start: int, stop: int) -> torch.Tensor:
        if tensor.offset is None:  # a `.bin` file, memory-mapped
            return self._reader.tensor(tensor)[start:stop]
        row_bytes = tensor.nbytes // tensor.shape[0]
        rows = dataclasses.replace(
            tensor, shape=(stop - start, *tensor.shape[1:]), offset=tensor.offset + start * row_bytes
        )
        return self._reader.tensor(rows)  # only these rows are read from the file

    @property
    def unused(self) -> set[str]:
        return set(self._tensors) - self.used


def _parameter_name(model: nn.Module, module: nn.Module) -> str:
    return next(name for name, candidate in model.named_modules() if candidate is module) + ".weight"


def streamed_logits(
    config: PretrainedConfig,
    load: Loader,
    input_ids: torch.Tensor,
    prepare_layer: Callable[[nn.Module], None] | None = None,
    observe: Observer | None = None,
    dtype: torch.dtype = DTYPE,
    prepare_model: Callable[[nn.Module], None] | None = None,
    *,
    head_block_bytes: int = HEAD_BLOCK_BYTES,
) -> torch.Tensor:
    """`dtype` logits `[1, T, vocab]` of the causal LM `config` describes, with weights from `load`, holding one
    decoder layer at a time, the embedding rows of `input_ids` and a block of the head (`head_block_bytes` of its
    rows at once), and running the RMSNorms in `dtype` too (`rms_norm_in_dtype`); `prepare_model` edits the model
    once built (its parameters still on the meta device, its RoPE buffers computed), `prepare_layer` each layer once
    its weights are loaded, `observe` sees the hidden states between the stages."""
    with init_empty_weights(include_buffers=False):  # parameters on the meta device, RoPE buffers computed
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    model.eval()
    if prepare_model is not None:
        prepare_model(model)
    for module in model.modules():
        if isinstance(module, _RMS_NORMS):
            module.forward = partial(rms_norm_in_dtype, module)
    embeddings_name = _parameter_name(model, model.get_input_embeddings())
    output_name = _parameter_name(model, model.get_output_embeddings())
    head_name = embeddings_name if config.tie_word_embeddings else output_name
    resident = [
        name
        for name in model.state_dict()
        if not LAYER_PARAMETER.match(name) and name not in (embeddings_name, output_name)
    ]
    model.load_state_dict({name: load(name) for name in resident}, strict=False, assign=True)

    def load_layer(prefix: str, layer: nn.Module, args) -> None:
        layer.load_state_dict({name: load(prefix + name) for name in layer.state_dict()}, assign=True)
        if prepare_layer is not None:
            prepare_layer(layer)

    def drop_layer(layer_idx: int, layer: nn.Module, args, output: torch.Tensor) -> None:
        layer.to("meta")
        if observe is not None:
            observe(f"layer {layer_idx}'s output", output)

    for name, layer in model.named_modules():
        if found := LAYER_PARAMETER.fullmatch(f"{name}."):  # a decoder layer
            layer.register_forward_pre_hook(partial(load_layer, found[0]))
            layer.register_forward_hook(partial(drop_layer, int(found["layer"])))
    with torch.no_grad():
        inputs_embeds = torch.cat([load(embeddings_name, slice(i, i + 1)) for i in input_ids[0].tolist()])[None]
        if observe is not None:
            observe("the input embeddings", inputs_embeds)
        hidden_states = model.model(inputs_embeds=inputs_embeds, use_cache=False).last_hidden_state
        if observe is not None:
            observe("the final norm's output", hidden_states)
        block = max(1, head_block_bytes // (config.hidden_size * dtype.itemsize))
        logits = hidden_states.new_empty(*hidden_states.shape[:2], config.vocab_size)
        for start in range(0, config.vocab_size, block):
            logits[..., start : start + block] = hidden_states @ load(head_name, slice(start, start + block)).T
        return logits


def rms_norm_in_dtype(norm: nn.Module, hidden_states: torch.Tensor) -> torch.Tensor:
    """transformers' RMSNorm, computed in the input's dtype."""
    variance = hidden_states.pow(2).mean(-1, keepdim=True)
    return norm.weight * (hidden_states * torch.rsqrt(variance + norm.variance_epsilon))


def relative_difference(output: torch.Tensor, reference: torch.Tensor) -> float:
    """`max |output - reference| / std(reference)`: what `--verify` compares with `VERIFY_TOLERANCE`."""
    return ((output - reference).abs().max() / reference.std()).item()


def identity_transforms(layer: nn.Module) -> None:
    """Set every Householder transform of `layer` to the identity (and every forget gate to 1): its gains as
    `path_init="identity"` starts them."""
    for module in layer.modules():
        if isinstance(module, PaTHGain):
            module.weight.data.fill_(PATH_GAIN_INIT["identity"])


def llama4_temperature(position: int, scale: float, length: int) -> float:
    """Llama 4's log-length query scale at `position`, written out: `1 + scale * log(floor((p + 1) / length) + 1)`."""
    return 1 + scale * math.log(math.floor((position + 1) / length) + 1)


class SourceReference:
    """The model `--verify` compares the converted one with: the source as transformers builds it, changed only as
    the converted `config` asks, without PaTHLlama's code. With `rope_max_wavelength`, each PaTH layer gets its RoPE
    from a copy of the source's rotary embedding whose `inv_freq` is 0 for the pairs whose wavelength `2 pi /
    inv_freq` exceeds it (so they never turn; YaRN's magnitude factor stays), through a forward pre-hook on the
    decoder layer; the other layers keep the source's. With `path_attn_temperature_scale`, a forward hook multiplies
    each PaTH layer's queries (`q_norm`'s output where there is one, else `q_proj`'s) at position p by
    `llama4_temperature(p, ...)`. `prepare` is `streamed_logits`' `prepare_model`."""

    def __init__(self, config: PaTHLlamaConfig):
        self.max_wavelength = config.rope_max_wavelength
        self.scale = config.path_attn_temperature_scale
        self.length = config.attn_temperature_length
        self.path_layers = (
            list(range(config.num_hidden_layers)) if config.path_layers is None else list(config.path_layers)
        )
        self.all_layers = len(self.path_layers) == config.num_hidden_layers
        self.removed: list[int] = []  # the pairs that do not turn, known once `prepare` has seen the source's RoPE
        self.factors: list[float] = []  # the temperature at each position, once the model has run

    @property
    def changed(self) -> bool:
        """Whether the reference differs from the source."""
        return bool(self.path_layers) and (self.max_wavelength is not None or bool(self.scale))

    def prepare(self, model: nn.Module) -> None:
        layers = model.model.layers
        if self.max_wavelength is not None:
            banded = copy.deepcopy(model.model.rotary_emb)
            slow = 2 * math.pi / banded.inv_freq.double() > self.max_wavelength
            self.removed = slow.nonzero().flatten().tolist()
            banded.inv_freq[slow] = 0.0
            for index in self.path_layers:
                layers[index].register_forward_pre_hook(partial(_band_limited_rope, banded), with_kwargs=True)
        if self.scale:
            for index in self.path_layers:
                attention = layers[index].self_attn
                queries = attention.q_norm if getattr(attention, "q_norm", None) is not None else attention.q_proj
                queries.register_forward_hook(self._temperature)

    def _temperature(self, module: nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        """`output` `[1, T, ...]`, the queries of positions 0 to T-1, times Llama 4's temperature at each."""
        self.factors = [llama4_temperature(p, self.scale, self.length) for p in range(output.shape[1])]
        factors = torch.tensor(self.factors, dtype=output.dtype)
        return output * factors.view(-1, *(1,) * (output.ndim - 2))

    def describe(self) -> str:
        """`"the source with RoPE pairs 20-31 removed (...)"`: what the converted model is compared with."""
        if not self.changed:
            return "the source"
        where = "" if self.all_layers else f" on its layers {format_layers(self.path_layers)} (the PaTH layers)"
        changes = []
        if self.max_wavelength is not None:
            limit = f"{self.max_wavelength:g} tokens"
            changes.append(
                f"RoPE pairs {format_layers(self.removed)} removed (inv_freq set to 0 where 2 pi / inv_freq > {limit})"
                if self.removed
                else f"no RoPE pair removed (none has a wavelength above {limit})"
            )
        if self.scale:
            factors = self.factors or [1.0]
            spread = (
                f"exactly 1 on these {len(self.factors)} tokens (fewer than {self.length})"
                if max(factors) == 1
                else f"{min(factors):.4g} to {max(factors):.4g} on these {len(self.factors)} tokens"
            )
            changes.append(
                f"queries times Llama 4's temperature 1 + {self.scale:g} log(floor((p + 1) / {self.length}) + 1) "
                f"(forward hooks; {spread})"
            )
        return f"the source with {' and '.join(changes)}{where}"


def _band_limited_rope(rotary: nn.Module, layer: nn.Module, args, kwargs) -> tuple:
    """A decoder layer's forward pre-hook: its `position_embeddings` from `rotary` (the band-limited copy)."""
    hidden_states = args[0] if args else kwargs["hidden_states"]
    return args, {**kwargs, "position_embeddings": rotary(hidden_states, kwargs["position_ids"])}


def _perplexity(logits: torch.Tensor, input_ids: torch.Tensor) -> float:
    return math.exp(token_nll(logits[:, :-1], input_ids[:, 1:]).mean().item())


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


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    """What `verify_conversion` measured. `describe()` is what `path-hf convert --verify` prints of it, `check()`
    raises `VerificationFailed` when the difference exceeds the tolerance."""

    # max |logits - reference logits| / std(reference logits), in float64 (`relative_difference`).
    difference: float
    # The tokens both models ran on: the built-in text's in the source's tokenizer, or fixed random ids.
    tokens: int
    # Whether the tokens are the built-in text (the source has a tokenizer): only then are perplexities measured.
    text: bool
    # What the converted model is compared with when it is not the source (`SourceReference.describe()`), else None.
    reference: str | None
    # The first output that differs beyond the tolerance ("layer 1's output", ...): where a failure shows first;
    # None when the verification passed.
    first_differing: str | None
    # The converted model's RoPE mode and init, as the perplexity line names them.
    rope_mode: str
    path_init: str
    # On the built-in text, once the verification passed: the source's, the reference's (only when there is one)
    # and the converted model's as converted (its RoPE mode and init); None otherwise.
    source_perplexity: float | None = None
    reference_perplexity: float | None = None
    converted_perplexity: float | None = None
    tolerance: float = VERIFY_TOLERANCE

    @property
    def passed(self) -> bool:
        """Whether the difference is within the tolerance."""
        return self.difference <= self.tolerance  # NaN fails

    def describe(self) -> str:
        """The lines `--verify` prints once both models ran: the difference, then the perplexities (or why there
        are none)."""
        name = "source" if self.reference is None else "reference"
        lines = [
            f"verify: max |logits - {name} logits| / std({name} logits) = {self.difference:.3g} in float64, with "
            f"RoPE kept and the transforms at identity (limit {self.tolerance:g})"
        ]
        if self.passed and not self.text:
            lines.append("verify: the source has no tokenizer; perplexity skipped")
        elif self.passed:
            perplexities = [("source", self.source_perplexity)]
            if self.reference is not None:
                perplexities.append(("reference", self.reference_perplexity))
            shown = ", ".join(f"{label} {perplexity:.3f}" for label, perplexity in perplexities)
            lines.append(
                f"verify: perplexity on the built-in text: {shown}, converted {self.converted_perplexity:.3f} "
                f"(rope {self.rope_mode}, init {self.path_init})"
            )
        return "\n".join(lines)

    def check(self) -> None:
        """Raise `VerificationFailed` when the difference exceeds the tolerance, naming the first output that
        differs."""
        if self.passed:
            return
        against = "the source's" if self.reference is None else f"the reference's ({self.reference})"
        cause = (
            "the weight mapping is wrong."
            if self.reference is None
            else "the weight mapping is wrong, or the converted model does not apply its RoPE band or temperature as "
            "the reference does."
        )
        raise VerificationFailed(
            f"verification failed: the converted model's logits differ from {against} by {self.difference:.3g} x "
            f"their std (limit {self.tolerance:g}; float64, RoPE kept, transforms at identity), first at "
            f"{self.first_differing}: {cause}",
            self,
        )


class VerificationFailed(ConversionError):
    """The converted model's logits differ from the reference's beyond the tolerance; `result` is what was
    measured."""

    def __init__(self, message: str, result: VerifyResult):
        super().__init__(message)
        self.result = result


def verify_conversion(plan: ConversionPlan, directory: Path) -> VerifyResult:
    """Run the conversion written to `directory` and its source, or `SourceReference` when the conversion asks for
    a RoPE band or an attention temperature, and compare their logits; then, if they agree and the source has a
    tokenizer, measure the perplexities on the built-in text.

    Prints what it runs, on how many tokens and, when it is not the source, what the reference is, as it goes; the
    caller prints the result (`VerifyResult.describe()`) and fails on it (`VerifyResult.check()`). Raises
    `ConversionError` when the checkpoint and the model disagree about a tensor, or when logits hold NaN or Inf.
    """
    input_ids, is_text = verification_input(plan.source.path, plan.config.vocab_size)
    if plan.config.local_window is not None and input_ids.shape[1] > plan.config.local_window:
        # Past its window a local layer sees fewer keys than the source's: inside it, the same.
        input_ids = input_ids[:, : plan.config.local_window]
        print(f"verify: the first {input_ids.shape[1]} tokens only, the local layers' window (--local-window)")
    print(f"verify: running the source and the converted model on {input_ids.shape[1]} tokens in float64", flush=True)
    round_to = {tensor.source.name: tensor.dtype for tensor in plan.tensors if tensor.source is not None}
    reference = SourceReference(plan.config)
    source_config = AutoConfig.from_pretrained(plan.source.path)
    source_stages: dict[str, torch.Tensor] = {}
    source_nonfinite: list[str] = []  # the stages whose output holds NaN or Inf, in order

    def record(stage: str, hidden_states: torch.Tensor) -> None:
        source_stages[stage] = hidden_states
        if not hidden_states.isfinite().all():
            source_nonfinite.append(stage)

    source_logits = streamed_logits(
        source_config,
        CheckpointTensors(plan.weights, round_to),
        input_ids,
        observe=record,
        prepare_model=reference.prepare if reference.changed else None,
    )
    if reference.changed:
        print(f"verify: reference: {reference.describe()}", flush=True)

    differing: list[str] = []  # the stages whose output differs from the reference's, in order
    converted_nonfinite: list[str] = []

    def compare(stage: str, hidden_states: torch.Tensor) -> None:
        if not relative_difference(hidden_states, source_stages.pop(stage)) <= VERIFY_TOLERANCE:
            differing.append(stage)
        if not hidden_states.isfinite().all():
            converted_nonfinite.append(stage)

    converted = CheckpointTensors(SourceWeights.from_directory(directory))
    config = AutoConfig.from_pretrained(directory)
    identity_config = AutoConfig.from_pretrained(directory, rope_mode=RopeMode.KEEP.value)
    identity_logits = streamed_logits(
        identity_config, converted, input_ids, prepare_layer=identity_transforms, observe=compare
    )
    if converted.unused:
        raise ConversionError(
            f"verification failed: the converted checkpoint holds tensors the model does not use, e.g. "
            f"{sorted(converted.unused)[0]!r}."
        )
    # "source" where the reference is the source, "reference" where it is changed: the words of the message.
    name = "reference" if reference.changed else "source"
    for model, logits, stages in (
        (name, source_logits, source_nonfinite),
        ("converted model", identity_logits, converted_nonfinite),
    ):
        if not logits.isfinite().all():
            first = stages[0] if stages else "the logits (the head)"
            raise ConversionError(
                f"verification failed: the {model}'s logits hold NaN or Inf (first at {first}): its weights hold "
                "non-finite values (converted with --allow-nonfinite), so the models cannot be compared; convert "
                "without --verify to keep them."
            )
    result = VerifyResult(
        difference=relative_difference(identity_logits, source_logits),
        tokens=input_ids.shape[1],
        text=is_text,
        reference=reference.describe() if reference.changed else None,
        first_differing=None,
        rope_mode=config.rope_mode,
        path_init=config.path_init,
    )
    if not result.passed:
        return dataclasses.replace(result, first_differing=differing[0] if differing else "the logits (the head)")
    if not is_text:
        return result

    same_model = RopeMode(config.rope_mode).keeps_rope and config.path_init == "identity"
    converted_logits = identity_logits if same_model else streamed_logits(config, converted, input_ids)
    source_perplexity, reference_perplexity = _perplexity(source_logits, input_ids), None
    if reference.changed:  # the source as it is too: what the band or the temperature costs before training
        plain_logits = streamed_logits(source_config, CheckpointTensors(plan.weights, round_to), input_ids)
        source_perplexity, reference_perplexity = _perplexity(plain_logits, input_ids), source_perplexity
    return dataclasses.replace(
        result,
        source_perplexity=source_perplexity,
        reference_perplexity=reference_perplexity,
        converted_perplexity=_perplexity(converted_logits, input_ids),
    )


__all__ = [
    "CheckpointTensors",
    "SourceReference",
    "VerificationFailed",
    "VerifyResult",
    "identity_transforms",
    "llama4_temperature",
    "relative_difference",
    "streamed_logits",
    "verification_input",
    "verify_conversion",
]
