# Copyright 2026 The path-hf authors. Apache-2.0.
"""Passkey retrieval: a five-digit key hidden at a random depth (or at given depths) in filler text of about
`context_length` tokens; a trial counts when greedy decoding after "The pass key is" would write every token of the
key."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch
from torch import nn

from .copy_retrieval import CopyResult, label_scores
from .scoring import IGNORE_INDEX, Window

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it.\n"
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_windows(
    tokenizer, context_length: int, trials: int = 20, seed: int = 0, depths: Sequence[float] | None = None
) -> list[Window]:
    """Passkey prompts of at most `context_length` tokens, each a `Window` whose labels are the key's tokens (the
    answer after "The pass key is") and `IGNORE_INDEX` elsewhere.

    Each prompt is the intro, filler sentences with the needle (a random five-digit key, stated twice) among them, and
    the question; the pieces are tokenised apart and joined as ids, so no token crosses a piece. Trial i draws its key
    from `random.Random(seed + i)`: the same prompts for every model with the same tokenizer.

    Args:
        tokenizer: the model's tokenizer.
        context_length: the most tokens a prompt (answer included) may have; as many filler repeats as fit.
        trials: keys to hide.
        seed: seed of the keys (and of the depths, when `depths` is `None`).
        depths: `None`: one prompt per trial, the needle at a uniformly random depth (drawn from the same generator
            as the key). Otherwise one prompt per trial and depth, trial by trial (`trials * len(depths)` windows,
            window `j` at `depths[j % len(depths)]`), each depth in [0, 1]: the fraction of the filler before the
            needle, 0 right after the intro, 1 right before the question, rounded to a whole filler repeat.

    Raises:
        ValueError: a depth outside [0, 1], or `context_length` too short for a prompt.
    """
    if depths is not None:
        depths = [float(depth) for depth in depths]
        if not depths:
            raise ValueError("depths is empty: give at least one passkey depth, or None for random depths")
        if bad := [depth for depth in depths if not 0.0 <= depth <= 1.0]:
            raise ValueError(
                f"passkey depths must be in [0, 1] (0: after the intro, 1: before the question), got {bad[0]}"
            )

    def ids(text: str) -> list[int]:
        return tokenizer(text, add_special_tokens=False)["input_ids"]

    prefix = tokenizer("", add_special_tokens=True)["input_ids"]  # BOS, for tokenizers that add one
    intro, filler, question = ids(PASSKEY_INTRO), ids(PASSKEY_FILLER), ids(PASSKEY_QUESTION)
    windows = []
    for trial in range(trials):
        rng = random.Random(seed + trial)
        key = str(rng.randint(10_000, 99_999))
        needle, answer = ids(PASSKEY_NEEDLE.format(key=key)), ids(" " + key)
        room = context_length - len(prefix) - len(intro) - len(needle) - len(question) - len(answer)
        repeats = room // len(filler)
        if repeats < 1:
            raise ValueError(
                f"context_length {context_length} is too short for a passkey prompt: it needs at least "
                f"{context_length - room + len(filler)} tokens with this tokenizer"
            )
        befores = [rng.randint(0, repeats)] if depths is None else [round(depth * repeats) for depth in depths]
        for before in befores:
            prompt = prefix + intro + filler * before + needle + filler * (repeats - before) + question
            input_ids = torch.tensor(prompt + answer, dtype=torch.long)
            labels = torch.full_like(input_ids, IGNORE_INDEX)
            labels[len(prompt) :] = input_ids[len(prompt) :]
            windows.append(Window(input_ids, labels))
    return windows


def answer_scores(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> CopyResult:
    """Per window (`passkey_windows`): how many of the key's tokens are the most likely next token (`correct`), their
    summed negative log-likelihood (`nll_sum`, nats) and their number (`tokens`), in one forward pass per batch with
    logits formed only at the positions that predict a label (`label_scores`). The likelihood tells apart models
    that all miss, or all find, the key; `.nll` is its mean per key token."""
    return label_scores(model, windows, batch_size, progress, "passkey")


def answer_accuracy(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> list[bool]:
    """For each window: does greedy decoding from the tokens before its first label write every labelled token?

    Teacher forcing gives the same verdict in one forward pass: greedy decoding writes the answer exactly when, at
    each answer position, the most likely next token is the answer's (the labels must be one contiguous run at the
    end of the window, as `passkey_windows` makes them), i.e. when every labelled token is a top-1 hit
    (`answer_scores`). Only the positions that predict a label get logits: the memory of a forward pass, not of
    `[batch, length, vocab]` logits.
    """
    return list(answer_scores(model, windows, batch_size, progress).all_correct)


def passkey_accuracy(
    model: nn.Module,
    tokenizer,
    context_length: int,
    trials: int = 20,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
    depths: Sequence[float] | None = None,
) -> float:
    """Fraction of the passkey prompts of about `context_length` tokens (`trials` of them, or `trials` at each of
    `depths`) whose key `model` retrieves (see `passkey_windows` and `answer_accuracy`)."""
    windows = passkey_windows(tokenizer, context_length, trials, seed, depths)
    correct = answer_accuracy(model, windows, batch_size, progress)
    return sum(correct) / len(correct)


def _at_depths(values: Sequence, depths: Sequence[float], what: str) -> dict[float, Sequence]:
    """`{depth: the values of its windows}` for per-window `values` of `passkey_windows(..., depths=depths)`, in
    which window `j` is at `depths[j % len(depths)]`."""
    if not depths or not values or len(values) % len(depths):
        raise ValueError(f"{len(values)} {what} are not a whole number of trials at {len(depths)} depths")
    return {float(depth): values[i :: len(depths)] for i, depth in enumerate(depths)}


def accuracy_by_depth(correct: Sequence[bool], depths: Sequence[float]) -> dict[float, float]:
    """`{depth: accuracy}` from the verdicts of `passkey_windows(..., depths=depths)` (`answer_accuracy`)."""
    return {depth: sum(at) / len(at) for depth, at in _at_depths(correct, depths, "verdicts").items()}


def nll_by_depth(scores: CopyResult, depths: Sequence[float]) -> dict[float, float]:
    """`{depth: the key's mean negative log-likelihood per token}` from the `answer_scores` of
    `passkey_windows(..., depths=depths)`."""
    nll_sum = _at_depths(scores.nll_sum, depths, "scores")
    tokens = _at_depths(scores.tokens, depths, "scores")
    return {depth: sum(nll_sum[depth]) / sum(tokens[depth]) for depth in nll_sum}


__all__ = [
    "PASSKEY_FILLER",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "accuracy_by_depth",
    "answer_accuracy",
    "answer_scores",
    "nll_by_depth",
    "passkey_accuracy",
    "passkey_windows",
]
