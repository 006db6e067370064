# Copyright 2026 The path-hf authors. Apache-2.0.
"""The lab's three tasks. Each gives batches of `input_ids` `[B, T]` and `targets` `[B, T]`: at position t the token t
should predict, `IGNORE_INDEX` where nothing is scored. Synthetic tasks score accuracy, the text scores perplexity.

- `KeyCopy`: random key copying / associative recall (seed 000, exercise 4; multi-query associative recall as in
  Arora et al., 2023, "Zoology"). Key-value pairs lie at random places in noise; the sequence ends with queries, each
  a key of an earlier pair, after which the model must copy that pair's value. Longer contexts put the pairs further
  from the queries among more noise.
- `FlipFlop`: flip-flop language modelling (Liu et al., 2023, "Exposing Attention Glitches with Flip-Flop Language
  Modeling"; a state-tracking task of the PaTH paper, §4.1). Instructions write / read / ignore, each followed by a
  bit; after a read the model must give the bit of the latest write. Longer contexts hold more earlier writes, which
  the latest must win over.
- `Text`: byte-level language modelling on the Python documentation that ships with the repo (PSF licence), trained on
  the train split and scored on the held-out eval split.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from path_hf.evaluation import IGNORE_INDEX, read_texts

ROOT = Path(__file__).resolve().parents[2]
TEXT_DATA = ROOT / "examples" / "default_model" / "data"


@dataclass(frozen=True)
class KeyCopy:
    """Tokens: keys [0, K), values [K, K + V), noise [K + V, K + V + N)."""

    keys: int = 32
    values: int = 32
    noise: int = 32
    pairs: int = 4
    queries: int = 4
    metric = "accuracy"

    @property
    def vocab_size(self) -> int:
        return self.keys + self.values + self.noise

    def sample(self, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        body = length - 2 * self.queries
        if body < 2 * self.pairs:
            raise ValueError(f"KeyCopy needs at least {2 * self.pairs + 2 * self.queries} tokens, got {length}")
        tokens = self.keys + self.values + torch.randint(self.noise, (batch, length), generator=generator)
        targets = torch.full((batch, length), IGNORE_INDEX)
        rows = torch.arange(batch)[:, None]
        keys = torch.rand(batch, self.keys, generator=generator).argsort(-1)[:, : self.pairs]  # distinct per row
        values = self.keys + torch.randint(self.values, (batch, self.pairs), generator=generator)
        # pair slots: `pairs` distinct starts among the body's non-overlapping slots of two tokens, in order
        slots = torch.rand(batch, body // 2, generator=generator).argsort(-1)[:, : self.pairs].sort(-1).values
        shift = torch.randint(body - 2 * (body // 2) + 1, (batch, 1), generator=generator)  # odd body: slide by one
        starts = 2 * slots + shift
        tokens[rows, starts], tokens[rows, starts + 1] = keys, values
        asked = torch.rand(batch, self.pairs, generator=generator).argsort(-1)[:, : self.queries]
        query_at = body + 2 * torch.arange(self.queries)
        tokens[:, query_at] = keys.gather(1, asked)
        tokens[:, query_at + 1] = values.gather(1, asked)
        targets[:, query_at] = values.gather(1, asked)
        return tokens, targets


@dataclass(frozen=True)
class FlipFlop:
    """Tokens: write 0, read 1, ignore 2, bits 3 and 4; instructions and bits alternate, the first is a write."""

    write_probability: float = 0.1
    read_probability: float = 0.1
    metric = "accuracy"
    vocab_size = 5

    def sample(self, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if length % 2:
            raise ValueError(f"FlipFlop sequences pair instructions with bits: the length must be even, got {length}")
        steps = length // 2
        draw = torch.rand(batch, steps, generator=generator)
        instruction = torch.full((batch, steps), 2)
        instruction[draw < self.write_probability + self.read_probability] = 1
        instruction[draw < self.write_probability] = 0
        instruction[:, 0] = 0
        bits = torch.randint(2, (batch, steps), generator=generator)
        # a read repeats the bit of the latest write: carry each write's index forward
        index = torch.arange(steps).expand(batch, steps)
        latest = torch.where(instruction == 0, index, torch.zeros_like(index)).cummax(1).values
        bits = torch.where(instruction == 1, bits.gather(1, latest), bits)
        tokens = torch.stack([instruction, 3 + bits], -1).flatten(1)
        targets = torch.full_like(tokens, IGNORE_INDEX)
        read = torch.stack([instruction == 1, torch.zeros_like(instruction, dtype=torch.bool)], -1).flatten(1)
        targets[read] = tokens.roll(-1, 1)[read]  # the bit after each read (a read is never last)
        return tokens, targets


def text_bytes(split: str) -> torch.Tensor:
    """The UTF-8 bytes of a split of the Python docs as one stream, documents separated by a 0 byte (EOS)."""
    documents = read_texts([TEXT_DATA / f"{split}.jsonl.xz"])
    stream = b"\0".join(document.encode() for document in documents) + b"\0"
    return torch.frombuffer(bytearray(stream), dtype=torch.uint8).long()


class Text:
    """Byte-level text (vocabulary 256: a 1M-parameter model needs no tokenizer, and every encoding sees the same
    symbols). The splits are read on first use. Training windows are drawn at random from the train split;
    evaluation cuts the first tokens of the held-out split into non-overlapping windows of each length
    (`eval_windows`), the same tokens at every length."""

    metric = "perplexity"
    vocab_size = 256

    def __init__(self) -> None:
        self._train: torch.Tensor | None = None
        self._eval: torch.Tensor | None = None

    def sample(self, batch: int, length: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        if self._train is None:
            self._train = text_bytes("train")
        starts = torch.randint(len(self._train) - length - 1, (batch, 1), generator=generator)
        window = self._train[starts + torch.arange(length + 1)]
        return window[:, :-1], window[:, 1:]

    def eval_windows(self, length: int, tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The first `tokens` bytes of the held-out split in non-overlapping windows of `length`: input_ids and targets
        `[tokens // length, length]`; the last position of a window predicts nothing (its next byte opens the next)."""
        if self._eval is None:
            self._eval = text_bytes("eval")
        input_ids = self._eval[: tokens // length * length].view(-1, length)
        targets = torch.cat([input_ids[:, 1:], torch.full((len(input_ids), 1), IGNORE_INDEX)], 1)
        return input_ids, targets


TASKS = {"key-copy": KeyCopy, "flip-flop": FlipFlop, "text": Text}
