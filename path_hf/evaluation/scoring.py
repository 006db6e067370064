# Copyright 2026 The path-hf authors. Apache-2.0.
"""Scoring a causal LM on windows of token ids: perplexity over fixed-length windows (non-overlapping, or sliding
with each token scored once), per position in the window too, and the causality probe `path-hf eval` refuses models
with.

The text is cut into windows of `context_length` tokens; the model scores every token of a window but the first from
the tokens before it in the same window, and the negative log-likelihoods are summed in float32 (float64 totals).
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

IGNORE_INDEX = -100


@dataclass(frozen=True)
class Window:
    """One model input: `input_ids` `[T]`, and `labels` `[T]` holding the ids of the tokens scored in this window and
    `IGNORE_INDEX` elsewhere (context scored by an earlier window; the first token, which has no context)."""

    input_ids: torch.Tensor
    labels: torch.Tensor

    @property
    def scored(self) -> int:
        """How many tokens this window scores: its labels, but the first, which nothing predicts."""
        return int((self.labels[1:] != IGNORE_INDEX).sum())


@dataclass(frozen=True)
class PerplexityResult:
    """Summed negative log-likelihood (nats) and the number of tokens it is over; `ppl = exp(nll_sum / tokens)`.

    `position_nll` / `position_tokens` hold the same sums per position in the window (index p: the token at position p
    of its window), so that `ppl_between(start, end)` gives the perplexity of the tokens read with `start` to `end - 1`
    tokens before them in the window, e.g. those beyond a model's training length.
    """

    nll_sum: float
    tokens: int
    position_nll: tuple[float, ...] = field(default=(), repr=False)
    position_tokens: tuple[int, ...] = field(default=(), repr=False)

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def ppl_between(self, start: int, end: int | None = None) -> float:
        """Perplexity of the tokens at positions `[start, end)` of their windows (`nan` if there are none)."""
        nll, tokens = sum(self.position_nll[start:end]), sum(self.position_tokens[start:end])
        return math.exp(nll / tokens) if tokens else math.nan

    def __add__(self, other: PerplexityResult) -> PerplexityResult:
        def add(a: tuple, b: tuple) -> tuple:
            longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
            return tuple(x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer))

        return PerplexityResult(
            self.nll_sum + other.nll_sum,
            self.tokens + other.tokens,
            add(self.position_nll, other.position_nll),
            add(self.position_tokens, other.position_tokens),
        )


def _documents(token_ids) -> list[torch.Tensor]:
    """One stream (a 1-D tensor or a list of ints) or a list of documents -> a list of 1-D LongTensors."""
    if isinstance(token_ids, torch.Tensor):
        if token_ids.ndim != 1:
            raise ValueError(f"token_ids must be 1-D (one stream) or a list of documents, got shape {token_ids.shape}")
        return [token_ids.long()]
    token_ids = list(token_ids)
    if token_ids and all(isinstance(token, int) for token in token_ids):
        return [torch.tensor(token_ids, dtype=torch.long)]
    return [torch.as_tensor(document, dtype=torch.long) for document in token_ids]


def make_windows(token_ids, context_length: int, stride: int | None = None) -> list[Window]:
    """Cut `token_ids` (one stream, or a list of documents, each cut on its own) into windows of at most
    `context_length` tokens.

    `stride=None` (or `context_length`): non-overlapping windows; the first token of each window is not scored. A
    smaller `stride` slides the window by `stride` tokens and scores only the tokens no earlier window scored, so each
    token after a document's first is scored exactly once, with up to `context_length - 1` tokens of context (the
    sliding-window evaluation of transformers' perplexity guide).
    """
    stride = context_length if stride is None else stride
    if context_length < 2:
        raise ValueError(f"context_length must be at least 2 (one token of context, one scored), got {context_length}")
    if not 1 <= stride <= context_length:
        raise ValueError(f"stride must be in [1, context_length={context_length}], got {stride}")
    windows = []
    for document in _documents(token_ids):
        scored_until = 0  # tokens [0, scored_until) of the document have been scored (or are its first token)
        for begin in range(0, len(document), stride):
            end = min(begin + context_length, len(document))
            input_ids = document[begin:end]
            labels = input_ids.clone()
            labels[: max(scored_until - begin, 0)] = IGNORE_INDEX
            window = Window(input_ids, labels)
            if window.scored:
                windows.append(window)
            scored_until = end
            if end == len(document):
                break
    return windows


def window_batches(
    windows: Sequence[Window], batch_size: int
) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """Right-padded `(input_ids, attention_mask, labels)` batches of `windows`."""
    for start in range(0, len(windows), batch_size):
        batch = windows[start : start + batch_size]
        length = max(len(window.input_ids) for window in batch)
        input_ids = torch.zeros(len(batch), length, dtype=torch.long)
        labels = torch.full((len(batch), length), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros(len(batch), length, dtype=torch.long)
        for row, window in enumerate(batch):
            n = len(window.input_ids)
            input_ids[row, :n], labels[row, :n], attention_mask[row, :n] = window.input_ids, window.labels, 1
        yield input_ids, attention_mask, labels


def progress_bar(iterable, total: int, desc: str, enabled: bool):
    if not enabled:
        return iterable
    from tqdm.auto import tqdm

    return tqdm(iterable, total=total, desc=desc, leave=False, disable=None)  # None: only on a terminal


@contextlib.contextmanager
def eval_mode(model: nn.Module) -> Iterator[torch.device]:
    """`model` in eval mode for the block (restored after); yields the device of its parameters."""
    was_training = model.training
    model.eval()
    try:
        yield next(model.parameters()).device
    finally:
        model.train(was_training)


# Positions whose logits are formed at once when scoring (the default of `logits_chunk`): a 32k-token window of a 128k
# vocabulary would otherwise hold 16 GB of float32 logits.
LOGITS_CHUNK = 2048


def output_head(model: nn.Module) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The map from the last hidden states of `model`'s decoder to its logits, as its forward computes them: the
    output embedding (`get_output_embeddings()`, an `nn.Linear`), then the final scaling or soft-capping its config
    states (Cohere's `logit_scale`, Granite's `logits_scaling`, Falcon-H1's `lm_head_multiplier`, Gemma 2's
    `final_logit_softcapping`). Applied to some
    positions only, it forms their logits without the `[B, T, vocab]` of a whole forward. `None` when `model` does
    not expose a decoder (`get_decoder()`) and a linear output embedding: score it with its own forward."""
    try:
        decoder, head = model.get_decoder(), model.get_output_embeddings()
    except (AttributeError, NotImplementedError):
        return None
    if decoder is None or decoder is model or not isinstance(head, nn.Linear):
        return None
    config = getattr(model, "config", None)
    config = config.get_text_config() if hasattr(config, "get_text_config") else config  # multimodal: the text's
    scale = getattr(config, "logit_scale", None)  # Cohere: logits * logit_scale
    divisor = getattr(config, "logits_scaling", None)  # Granite: logits / logits_scaling
    multiplier = getattr(config, "lm_head_multiplier", None)  # Falcon-H1: logits * lm_head_multiplier
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2 / 3: cap * tanh(logits / cap)

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        if scale is not None and scale != 1:
            out = out * scale
        if divisor is not None and divisor != 1:
            out = out / divisor
        if multiplier is not None and multiplier != 1:
            out = out * multiplier
        if cap:
            out = torch.tanh(out / cap) * cap
        return out

    return logits


def decoder_states(model: nn.Module, input_ids: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """Last hidden states `[B, T, hidden]` of `model`'s decoder (see `output_head`)."""
    return model.get_decoder()(input_ids=input_ids, attention_mask=mask, use_cache=False).last_hidden_state


def forward_logits(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, device) -> torch.Tensor:
    """Logits of a right-padded batch; full batches of equal length get no mask."""
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    return model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False).logits


def position_logits(
    model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor, positions: torch.Tensor, device
) -> torch.Tensor:
    """Logits `[N, vocab]` at the `N` positions where the boolean `positions` `[B, T]` is true (row by row), of a
    right-padded batch, for the cost of a forward pass: the output head is applied to those positions' hidden states
    only (`output_head`), never to the whole `[B, T, hidden]`. A model that does not expose its decoder and head is
    run whole (`forward_logits`) and its logits indexed."""
    head = output_head(model)
    if head is None:
        return forward_logits(model, input_ids, attention_mask, device)[positions.to(device)]
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    hidden = decoder_states(model, input_ids.to(device), mask)
    return head(hidden[positions.to(device)])


def token_nll(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Negative log-likelihood `[B, T]` of `targets` `[B, T]` under `logits` `[B, T, V]` (0 where a target is
    `IGNORE_INDEX`), in at least float32."""
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
    return F.cross_entropy(logits.transpose(1, 2), targets, ignore_index=IGNORE_INDEX, reduction="none")


def model_token_nll(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    device,
    *,
    logits_chunk: int = LOGITS_CHUNK,
) -> torch.Tensor:
    """Negative log-likelihood `[B, T - 1]` of `targets` (the next token at each position, `IGNORE_INDEX` where not
    scored) under `model` for a right-padded batch; full batches of equal length get no mask. Where the head allows it
    (`output_head`), the logits are formed `logits_chunk` positions at a time (memory O(chunk x vocab), not
    O(T x vocab))."""
    mask = None if bool(attention_mask.all()) else attention_mask.to(device)
    input_ids, targets = input_ids.to(device), targets.to(device)
    nll = token_nll
    head = output_head(model)
    if head is None:
        return nll(model(input_ids=input_ids, attention_mask=mask, use_cache=False).logits[:, :-1], targets)
    hidden = decoder_states(model, input_ids, mask)[:, :-1]
    return torch.cat(
        [
            nll(head(hidden[:, start : start + logits_chunk]), targets[:, start : start + logits_chunk])
            for start in range(0, hidden.shape[1], logits_chunk)
        ],
        dim=1,
    )


@torch.no_grad()
def score_windows(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> PerplexityResult:
    """Summed negative log-likelihood of the scored tokens of `windows` under `model` (any causal LM whose forward
    takes `input_ids`, `attention_mask` and returns `.logits`), in batches of `batch_size` windows, in total and per
    position in the window.

    The model is put in eval mode for the call and restored after. Windows of different lengths in one batch are
    right-padded (with an attention mask); full batches of equal length get no mask.
    """
    longest = max((len(window.input_ids) for window in windows), default=1)
    position_nll = torch.zeros(longest, dtype=torch.float64)
    position_tokens = torch.zeros(longest, dtype=torch.long)
    batches = progress_bar(
        window_batches(windows, batch_size), math.ceil(len(windows) / batch_size), "perplexity", progress
    )
    with eval_mode(model) as device:
        for input_ids, attention_mask, labels in batches:
            targets = labels[:, 1:]
            nll = model_token_nll(model, input_ids, attention_mask, targets, device)  # [B, T-1]: position t+1's token
            width = nll.shape[1]
            position_nll[1 : width + 1] += nll.sum(0).double().cpu()
            position_tokens[1 : width + 1] += (targets != IGNORE_INDEX).sum(0).cpu()
    return PerplexityResult(
        position_nll.sum().item(),
        int(position_tokens.sum()),
        tuple(position_nll.tolist()),
        tuple(position_tokens.tolist()),
    )


def perplexity(
    model: nn.Module,
    token_ids,
    context_length: int,
    stride: int | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> PerplexityResult:
    """Perplexity of `model` on `token_ids` (a 1-D tensor or list of ints: one stream; a list of those: documents,
    never attending across each other) over windows of `context_length` tokens.

    Args:
        model: a causal LM (`AutoModelForCausalLM.from_pretrained(...)` or any module returning `.logits`).
        token_ids: the text, tokenised.
        context_length: tokens per window.
        stride: `None` for non-overlapping windows; smaller for sliding windows (see `make_windows`).
        batch_size: windows per forward pass.
        progress: show a progress bar.

    Returns:
        A `PerplexityResult` (`nll_sum`, `tokens`, `nll`, `ppl`).
    """
    return score_windows(model, make_windows(token_ids, context_length, stride), batch_size, progress)


@torch.no_grad()
def attends_causally(model: nn.Module, length: int = 16, seed: int = 0) -> bool:
    """Whether each position's logits depend only on the tokens up to it, as a causal LM's do. Works for any
    architecture, at the cost of one forward of three `length`-token sequences: random token ids twice, and once with
    their second half changed. The first half's logits must not change by more than the two identical rows differ
    (float noise of the kernels; none on CPU) plus 1e-5 of their size. A bidirectional encoder with an LM head (BERT
    loaded as `BertLMHeadModel`) fails: even a tiny random one moves them by 1e-3 of their size, a trained one by far
    more."""
    generator = torch.Generator().manual_seed(seed)
    vocab, half = model.get_input_embeddings().num_embeddings, length // 2
    input_ids = torch.randint(vocab, (length,), generator=generator).repeat(3, 1)
    input_ids[2, half:] = (input_ids[2, half:] + torch.randint(1, vocab, (length - half,), generator=generator)) % vocab
    with eval_mode(model) as device:
        logits = model(input_ids=input_ids.to(device), use_cache=False).logits[:, :half].float()
    noise, change = (logits[0] - logits[1]).abs().max(), (logits[0] - logits[2]).abs().max()
    return bool(change <= 10 * noise + 1e-5 * logits[0].abs().max())


__all__ = [
    "IGNORE_INDEX",
    "PerplexityResult",
    "Window",
    "attends_causally",
    "make_windows",
    "perplexity",
    "score_windows",
    "token_nll",
]
