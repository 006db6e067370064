# Copyright 2026 The path-hf authors. Apache-2.0.
"""Passkey retrieval: a five-digit key hidden at a random depth in filler text of about `context_length` tokens; a
trial counts when greedy decoding after "The pass key is" would write every token of the key."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

import torch
from torch import nn

from .scoring import IGNORE_INDEX, Window, eval_mode, forward_logits, progress_bar, window_batches

PASSKEY_INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about it.\n"
)
PASSKEY_FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
PASSKEY_NEEDLE = "The pass key is {key}. Remember it. {key} is the pass key. "
PASSKEY_QUESTION = "\nWhat is the pass key? The pass key is"


def passkey_windows(tokenizer, context_length: int, trials: int = 20, seed: int = 0) -> list[Window]:
    """`trials` passkey prompts of at most `context_length` tokens, each a `Window` whose labels are the key's tokens
    (the answer after "The pass key is") and `IGNORE_INDEX` elsewhere.

    Each prompt is the intro, filler sentences with the needle (a random five-digit key, stated twice) at a uniformly
    random depth, and the question; the pieces are tokenised apart and joined as ids, so no token crosses a piece.
    Trial i draws its key and depth from `random.Random(seed + i)`: the same prompts for every model with the same
    tokenizer.
    """

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
        before = rng.randint(0, repeats)
        prompt = prefix + intro + filler * before + needle + filler * (repeats - before) + question
        input_ids = torch.tensor(prompt + answer, dtype=torch.long)
        labels = torch.full_like(input_ids, IGNORE_INDEX)
        labels[len(prompt) :] = input_ids[len(prompt) :]
        windows.append(Window(input_ids, labels))
    return windows


@torch.no_grad()
def answer_accuracy(
    model: nn.Module, windows: Sequence[Window], batch_size: int = 8, progress: bool = False
) -> list[bool]:
    """For each window: does greedy decoding from the tokens before its first label write every labelled token?

    Teacher forcing gives the same verdict in one forward pass: greedy decoding writes the answer exactly when, at
    each answer position, the most likely next token is the answer's (the labels must be one contiguous run at the
    end of the window, as `passkey_windows` makes them).
    """
    correct: list[bool] = []
    batches = progress_bar(
        window_batches(windows, batch_size), math.ceil(len(windows) / batch_size), "passkey", progress
    )
    with eval_mode(model) as device:
        for input_ids, attention_mask, labels in batches:
            predicted = forward_logits(model, input_ids, attention_mask, device)[:, :-1].argmax(-1).cpu()
            targets = labels[:, 1:]
            scored = targets != IGNORE_INDEX
            correct += ((predicted == targets) | ~scored).all(1).tolist()
    return correct


def passkey_accuracy(
    model: nn.Module,
    tokenizer,
    context_length: int,
    trials: int = 20,
    seed: int = 0,
    batch_size: int = 8,
    progress: bool = False,
) -> float:
    """Fraction of `trials` passkey prompts of about `context_length` tokens whose key `model` retrieves (see
    `passkey_windows` and `answer_accuracy`)."""
    correct = answer_accuracy(model, passkey_windows(tokenizer, context_length, trials, seed), batch_size, progress)
    return sum(correct) / len(correct)


__all__ = [
    "PASSKEY_FILLER",
    "PASSKEY_INTRO",
    "PASSKEY_NEEDLE",
    "PASSKEY_QUESTION",
    "answer_accuracy",
    "passkey_accuracy",
    "passkey_windows",
]
