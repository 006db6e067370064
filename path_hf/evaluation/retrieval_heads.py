# Copyright 2026 The path-hf authors. Apache-2.0.
"""Retrieval heads: where each head of a model looks when it writes a passkey it read far back.

```python
from path_hf.evaluation import rank_retrieval_layers, retrieval_heads

mass = retrieval_heads(model, tokenizer, length=8192)  # [layers, heads]
print(rank_retrieval_layers(mass)[:7])                   # the 7 layers whose strongest head looks most at the key
```

For each passkey prompt (`passkey_windows`: `trials` keys at each of `depths`), at each position that predicts one of
the answer's tokens (the prompt's last token, then every answer token but the last), every head's attention
probability on the needle's tokens ("The pass key is 12345. Remember it. 12345 is the pass key."), summed over those
tokens, averaged over the positions and then over the prompts. The probabilities are exact: one decode step a
position (`decode_attention_rows`), after a prefill of the rest of the prompt.

A head that puts most of its mass on the needle is a retrieval head: it copies the key from far back. In a hybrid
(`local_window`), the layers left global must be those that hold them, or nothing past the window is retrieved
(docs/smollm2/long-context, "The hybrid's PaTH layers are not the source's retrieval layers"). `path-hf convert
--retrieval-layers N` makes the N layers `rank_retrieval_layers` puts first the PaTH layers.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from .attention_mass import decode_attention_rows
from .passkey import PASSKEY_NEEDLE, passkey_windows
from .scoring import IGNORE_INDEX, Window

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# Two keys at 10% and at 50% of the filler: 6.5K and 3.3K tokens back in a prompt of 8192.
RETRIEVAL_DEPTHS = (0.1, 0.5)
RETRIEVAL_TRIALS = 2


def needle_span(tokenizer, window: Window) -> tuple[int, int]:
    """`(start, stop)`: where the needle of a `passkey_windows` prompt lies in `window.input_ids` (the key read back
    from the labels; the prompt's pieces are tokenised apart, so the needle's ids appear as they are)."""
    ids = window.input_ids.tolist()
    answer = (window.labels != IGNORE_INDEX).nonzero()
    if not len(answer):
        raise ValueError("the window has no labelled answer: is it a passkey prompt (passkey_windows)?")
    key = tokenizer.decode(window.input_ids[window.labels != IGNORE_INDEX]).strip()
    needle = tokenizer(PASSKEY_NEEDLE.format(key=key), add_special_tokens=False)["input_ids"]
    for start in range(int(answer[0]) - len(needle) + 1):
        if ids[start : start + len(needle)] == needle:
            return start, start + len(needle)
    raise ValueError(f"the needle of key {key!r} is not in the window: is it a passkey prompt (passkey_windows)?")


def needle_mass(model: PreTrainedModel, window: Window, span: tuple[int, int]) -> torch.Tensor:
    """`[layers, heads]` float64: each head's attention probability on the tokens `span` (`needle_span`), summed over
    them, at the positions that predict the answer's tokens (the labels' positions, each shifted back by one),
    averaged over those positions."""
    input_ids = window.input_ids[None]
    length = input_ids.shape[1]
    first = int((window.labels != IGNORE_INDEX).nonzero()[0])
    start, stop = span
    total = None
    # the prompt's last token and each answer token; the last answer token predicts nothing and is left out
    for position, rows in decode_attention_rows(model, input_ids, queries=length - first + 1):
        if position == length - 1:
            continue
        mass = torch.stack([row[0, :, 0, start:stop].double().sum(-1).cpu() for row in rows])
        total = mass if total is None else total + mass
    return total / (length - first)


def retrieval_heads(
    model: PreTrainedModel,
    tokenizer,
    length: int,
    trials: int = RETRIEVAL_TRIALS,
    depths: Sequence[float] = RETRIEVAL_DEPTHS,
    seed: int = 0,
) -> torch.Tensor:
    """`[layers, heads]` float64: each head's mean attention probability on the passkey's needle when the model writes
    the key (`needle_mass`), averaged over `trials` prompts of at most `length` tokens at each of `depths`
    (`passkey_windows` with `seed`)."""
    windows = passkey_windows(tokenizer, length, trials, seed, depths)
    masses = [needle_mass(model, window, needle_span(tokenizer, window)) for window in windows]
    return torch.stack(masses).mean(0)


def rank_retrieval_layers(mass: torch.Tensor) -> list[int]:
    """The layers of `mass` (`[layers, heads]`, `retrieval_heads`) from the one whose strongest head has the most mass
    on the needle to the one whose strongest head has the least (ties: the lower layer first)."""
    strongest = mass.max(-1).values.tolist()
    return sorted(range(len(strongest)), key=lambda layer: (-strongest[layer], layer))


def rank_retrieval_heads(mass: torch.Tensor, layers: Sequence[int] | None = None) -> list[tuple[int, int]]:
    """The `(layer, head)` pairs of `mass` (`[layers, heads]`, `retrieval_heads`), of `layers` only if given, from the
    head with the most mass on the needle to the one with the least (ties: the lower layer, then head, first)."""
    layers = range(mass.shape[0]) if layers is None else layers
    pairs = [(layer, head) for layer in layers for head in range(mass.shape[1])]
    return sorted(pairs, key=lambda pair: (-float(mass[pair]), pair))


__all__ = [
    "rank_retrieval_heads",
    "RETRIEVAL_DEPTHS",
    "RETRIEVAL_TRIALS",
    "needle_mass",
    "needle_span",
    "rank_retrieval_layers",
    "retrieval_heads",
]
