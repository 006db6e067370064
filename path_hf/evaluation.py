# Copyright 2026 The path-hf authors. Apache-2.0.
"""Perplexity of any causal language model over fixed-length windows of token ids.

One implementation for the recipes' recovery tracking, `path-hf eval` and the demo: the text is cut into windows of
`context_length` tokens (non-overlapping, or sliding by `stride` with each token scored once, with as much context
as the window holds), the model scores every token of a window but the first from the tokens before it in the same
window, and the negative log-likelihoods are summed in float32.

```python
from path_hf.evaluation import perplexity

result = perplexity(model, token_ids, context_length=2048)  # one long stream, or a list of documents
print(result.ppl, result.tokens)
```
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

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
    """Summed negative log-likelihood (nats) and the number of tokens it is over; `ppl = exp(nll_sum / tokens)`."""

    nll_sum: float
    tokens: int

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per token (nats)."""
        return self.nll_sum / self.tokens if self.tokens else math.nan

    @property
    def ppl(self) -> float:
        return math.exp(self.nll)

    def __add__(self, other: PerplexityResult) -> PerplexityResult:
        return PerplexityResult(self.nll_sum + other.nll_sum, self.tokens + other.tokens)


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


def _batches(windows: Sequence[Window], batch_size: int) -> Iterable[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
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


@torch.no_grad()
def score_windows(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> PerplexityResult:
    """Summed negative log-likelihood of the scored tokens of `windows` under `model` (any causal LM whose forward
    takes `input_ids`, `attention_mask` and returns `.logits`), in batches of `batch_size` windows.

    The model is put in eval mode for the call and restored after. Windows of different lengths in one batch are
    right-padded (with an attention mask); full batches of equal length get no mask.
    """
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    nll_sum, tokens = 0.0, 0
    batches = _batches(windows, batch_size)
    if progress:
        from tqdm.auto import tqdm

        batches = tqdm(batches, total=math.ceil(len(windows) / batch_size), desc="perplexity", leave=False)
    try:
        for input_ids, attention_mask, labels in batches:
            mask = None if bool(attention_mask.all()) else attention_mask.to(device)
            logits = model(input_ids=input_ids.to(device), attention_mask=mask, use_cache=False).logits
            targets = labels[:, 1:].to(device)
            nll_sum += F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="sum"
            ).item()
            tokens += int((targets != IGNORE_INDEX).sum())
    finally:
        model.train(was_training)
    return PerplexityResult(nll_sum, tokens)


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


__all__ = ["IGNORE_INDEX", "PerplexityResult", "Window", "make_windows", "perplexity", "score_windows"]
