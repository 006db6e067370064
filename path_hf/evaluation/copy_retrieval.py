# Copyright 2026 The path-hf authors. Apache-2.0.
"""Copy retrieval: a span of real text at the start of a window of `length` tokens, more of the same text after it,
and the span again at the end; the model is scored on the repeat, every token of it but the first, by top-1 accuracy
(was the span copied from `length - span` tokens back?) and negative log-likelihood.

Denser than passkey retrieval: a window scores `span - 1` tokens instead of a key's few, for the same forward pass.
Only the positions that predict a scored token go through the output layer, `LOGITS_CHUNK` at a time: the memory of
a forward pass, not of `[batch, length, vocab]` logits.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .scoring import (
    IGNORE_INDEX,
    LOGITS_CHUNK,
    Window,
    decoder_states,
    eval_mode,
    forward_logits,
    output_head,
    progress_bar,
    window_batches,
)

COPY_SPAN = 256


def copy_windows(
    stream: Sequence[int],
    length: int,
    trials: int,
    span: int = COPY_SPAN,
    seed: int = 0,
    prefix: Sequence[int] | None = None,
) -> list[Window]:
    """Copy-retrieval windows of exactly `length` tokens, one per trial, each a `Window` whose labels are the tokens
    of the repeated span but its first, and `IGNORE_INDEX` elsewhere.

    A window is `prefix` (the tokenizer's BOS, if it adds one), then `length - len(prefix) - span` consecutive tokens
    of `stream` (the first `span` of them: the span; the rest: the text that follows it), then the span again, which
    thus starts at `length - span` and lies `length - len(prefix) - span` tokens after its source. Trial i starts at
    a place drawn from `random.Random(seed + i)`, redrawn while an earlier trial starts there: the same windows for
    every model with the same tokenizer, and the first trials the same whatever their number.

    Args:
        stream: the evaluation text's token ids (`tokenize_stream`).
        length: tokens per window.
        trials: windows, each from another place of `stream`.
        span: tokens of the copied span (at least 2: its first token is not scored).
        seed: seed of the places.
        prefix: tokens each window starts with, before the span.

    Raises:
        ValueError: a span shorter than 2 tokens, negative trials, `length` too short for the prefix and the span
            twice, or `stream` too short for a window (or for `trials` different places).
    """
    prefix = list(prefix or [])
    if span < 2:
        raise ValueError(f"the copy span must be at least 2 tokens (its first is not scored), got {span}")
    if trials < 0:
        raise ValueError(f"trials must be at least 0, got {trials}")
    if length < len(prefix) + 2 * span:
        after = f" after {len(prefix)} prefix token(s)" if prefix else ""
        raise ValueError(
            f"context_length {length} is too short for a copy window with a {span}-token span: it needs at least "
            f"{len(prefix) + 2 * span} tokens (the span twice{after}): give a shorter span"
        )
    text = length - len(prefix) - span  # the span and the text after it
    places = len(stream) - text + 1
    if places < 1:
        raise ValueError(
            f"the stream of {len(stream)} tokens is too short for a copy window of {length} tokens with a "
            f"{span}-token span: it needs at least {text} tokens"
        )
    if trials > places:
        raise ValueError(
            f"the stream of {len(stream)} tokens holds {places} different copy windows of {length} tokens with a "
            f"{span}-token span, fewer than the {trials} trials: give more text or fewer trials"
        )
    stream = torch.as_tensor(stream, dtype=torch.long)
    starts: list[int] = []
    for trial in range(trials):
        rng = random.Random(seed + trial)
        start = rng.randrange(places)
        while start in starts:
            start = rng.randrange(places)
        starts.append(start)
    windows = []
    for start in starts:
        body = stream[start : start + text]
        input_ids = torch.cat([torch.tensor(prefix, dtype=torch.long), body, body[:span]])
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[length - span + 1 :] = input_ids[length - span + 1 :]
        windows.append(Window(input_ids, labels))
    return windows


@dataclass(frozen=True)
class CopyResult:
    """Per window: how many labelled tokens the model predicts top-1 (`correct`), their summed negative
    log-likelihood (`nll_sum`, nats) and their number (`tokens`)."""

    correct: tuple[int, ...]
    nll_sum: tuple[float, ...]
    tokens: tuple[int, ...]

    @property
    def accuracy(self) -> float:
        """Top-1 accuracy over every scored token of every window (`nan` if there are none)."""
        return sum(self.correct) / sum(self.tokens) if sum(self.tokens) else math.nan

    @property
    def all_correct(self) -> tuple[bool, ...]:
        """Per window: is every labelled token a top-1 hit? (What greedy decoding of an answer at the end needs.)"""
        return tuple(hits == count for hits, count in zip(self.correct, self.tokens, strict=True))

    @property
    def nll(self) -> float:
        """Mean negative log-likelihood per scored token (nats; `nan` if there are none)."""
        return sum(self.nll_sum) / sum(self.tokens) if sum(self.tokens) else math.nan


def _scored_predictions(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    positions: torch.Tensor,
    targets: torch.Tensor,
    device,
    logits_chunk: int = LOGITS_CHUNK,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Whether the most likely next token is the target, and the target's negative log-likelihood (float32 or
    wider), `[N]` each, at the `N` positions where `positions` `[B, T]` is true (row by row; `targets` `[N]`). The
    output head is applied to those positions' hidden states only, `logits_chunk` at a time (`position_logits`
    without its `[N, vocab]` at once); a model without a decoder and head is run whole (`forward_logits`)."""
    head = output_head(model)
    targets = targets.to(device)
    if head is None:  # the whole logits, indexed: the head is then the identity
        states = forward_logits(model, input_ids, attention_mask, device)[positions.to(device)]
        head = nn.Identity()
    else:
        mask = None if bool(attention_mask.all()) else attention_mask.to(device)
        states = decoder_states(model, input_ids.to(device), mask)[positions.to(device)]
    hits, nlls = [], []
    for start in range(0, len(targets), logits_chunk):
        logits = head(states[start : start + logits_chunk])
        logits = logits.to(torch.promote_types(logits.dtype, torch.float32))
        target = targets[start : start + logits_chunk]
        hits.append(logits.argmax(-1) == target)
        nlls.append(F.cross_entropy(logits, target, reduction="none"))
    if not hits:
        return torch.zeros(0, dtype=torch.bool), torch.zeros(0)
    return torch.cat(hits).cpu(), torch.cat(nlls).cpu()


@torch.no_grad()
def label_scores(
    model: nn.Module,
    windows: Sequence[Window],
    batch_size: int = 8,
    progress: bool = False,
    desc: str = "scoring",
    *,
    logits_chunk: int = LOGITS_CHUNK,
) -> CopyResult:
    """Top-1 hits and negative log-likelihood of `model` at the labelled tokens of `windows` (those of `copy_windows`
    or of `passkey_windows`), per window, in batches of `batch_size` right-padded windows; each labelled token is
    predicted from the tokens before it in its window, in one forward pass per batch. `desc`: the progress bar's;
    `logits_chunk`: the labelled positions whose logits are formed at once."""
    correct: list[int] = []
    nll_sum: list[float] = []
    tokens: list[int] = []
    batches = progress_bar(window_batches(windows, batch_size), math.ceil(len(windows) / batch_size), desc, progress)
    with eval_mode(model) as device:
        for input_ids, attention_mask, labels in batches:
            scored = labels[:, 1:] != IGNORE_INDEX  # [B, T-1]: position t predicts the label at t + 1
            positions = torch.zeros_like(labels, dtype=torch.bool)
            positions[:, :-1] = scored
            hit, nll = _scored_predictions(
                model, input_ids, attention_mask, positions, labels[:, 1:][scored], device, logits_chunk
            )
            rows = positions.nonzero()[:, 0]
            count = len(labels)
            correct += torch.zeros(count, dtype=torch.long).index_add_(0, rows, hit.long()).tolist()
            nll_sum += torch.zeros(count, dtype=torch.float64).index_add_(0, rows, nll.double()).tolist()
            tokens += torch.bincount(rows, minlength=count).tolist()
    return CopyResult(tuple(correct), tuple(nll_sum), tuple(tokens))


def copy_scores(
    model: nn.Module,
    windows: Sequence[Window],
    batch_size: int = 8,
    progress: bool = False,
    *,
    logits_chunk: int = LOGITS_CHUNK,
) -> CopyResult:
    """Top-1 hits and negative log-likelihood of `model` at the repeats of `windows` (`copy_windows`), per window
    (`label_scores`, `logits_chunk` positions' logits at a time)."""
    return label_scores(model, windows, batch_size, progress, "copy", logits_chunk=logits_chunk)


def copy_accuracy(
    model: nn.Module,
    stream: Sequence[int],
    length: int,
    trials: int = 8,
    span: int = COPY_SPAN,
    seed: int = 0,
    prefix: Sequence[int] | None = None,
    batch_size: int = 8,
    progress: bool = False,
) -> CopyResult:
    """`model`'s copy retrieval on `trials` windows of `length` tokens of `stream` (see `copy_windows` and
    `copy_scores`): `.accuracy`, `.nll`."""
    return copy_scores(model, copy_windows(stream, length, trials, span, seed, prefix), batch_size, progress)


__all__ = ["COPY_SPAN", "CopyResult", "copy_accuracy", "copy_scores", "copy_windows", "label_scores"]
