# Copyright 2026 The path-hf authors. Apache-2.0.
"""Synthetic retrieval blocks, written by the recipe from its own training text (a stage's `retrieval` share).

A training block of ordinary text becomes a retrieval block: one to `max_keys` needle sentences, each a random key
(with a distinct name when there are several), are put at random sentence ends of the text, and one or more questions
about them follow at the end, each with its answer. The block keeps its length and becomes one sequence. The
distillation loss covers every position as usual, and `answer_labels` marks the answers' tokens, which the stage also
trains on with cross entropy (`losses.distillation_loss`). Needles lie anywhere in the block, so most of them sit
further back than a training window shorter than the block: only the layers that see the whole block (the PaTH
layers of a hybrid) can fetch them.

The templates (`retrieval_templates.json`) are the recipe's own: `path-hf eval` asks with others
(`path_hf/evaluation/needle_templates.json`), and a test keeps the two sets apart.
"""

from __future__ import annotations

import json
import random
from importlib import resources

import torch

from ..evaluation import IGNORE_INDEX, NeedleTemplates
from ..evaluation.needles import nearest_place, question_and_answer

# Key lengths drawn for each needle (digits), so that no one length is learnt as the answer's.
KEY_DIGITS = (4, 5, 6, 7)
# Text left between the last needle and the questions, at least (an eighth of a short block): the needles are not all
# in the last few tokens.
MIN_GAP = 64


def training_templates() -> NeedleTemplates:
    """The recipe's needle templates (`retrieval_templates.json`), apart from the evaluation's."""
    text = resources.files(__package__).joinpath("retrieval_templates.json").read_text()
    return NeedleTemplates.from_dict(json.loads(text), "retrieval_templates.json")


class RetrievalBlocks:
    """Turns a share of a stage's training blocks into retrieval blocks (see the module docstring).

    Args:
        tokenizer: the student's tokenizer.
        share: the probability that a block becomes a retrieval block.
        seed: with the step and the row, what each block becomes: a resumed run draws the same blocks.
        max_keys: needles a block holds, at most (at least one).
        max_questions: questions asked at the end, at most (each about another needle).
        templates: the needle templates (default: `training_templates()`).
    """

    def __init__(
        self,
        tokenizer,
        share: float,
        seed: int = 0,
        max_keys: int = 4,
        max_questions: int = 2,
        templates: NeedleTemplates | None = None,
    ):
        self.tokenizer = tokenizer
        self.share = share
        self.seed = seed
        self.max_keys = max_keys
        self.max_questions = max_questions
        self.templates = templates or training_templates()
        self.ends: dict[int, bool] = {}  # whether a token ends a sentence, as decoded once

    def _ids(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def _sentence_ends(self, text: list[int]) -> list[int]:
        for token in set(text) - self.ends.keys():
            self.ends[token] = self.tokenizer.decode([token]).rstrip(" ").endswith((".", "!", "?", "\n"))
        return [0] + [index + 1 for index, token in enumerate(text[:-1]) if self.ends[token]]

    def __call__(self, batch: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
        """`batch` (`input_ids`, `position_ids`, `labels`, `[B, T]`) with a share of its rows made retrieval blocks,
        and `answer_labels` (`IGNORE_INDEX` but at the answers' tokens); the same batch if none is drawn."""
        rows = []
        for row in range(batch["input_ids"].shape[0]):
            rng = random.Random(f"retrieval-{self.seed}-{step}-{row}")
            rows.append(self.block(batch["input_ids"][row].tolist(), rng) if rng.random() < self.share else None)
        if all(made is None for made in rows):
            return batch
        batch = {name: value.clone() for name, value in batch.items()}
        answers = torch.full_like(batch["input_ids"], IGNORE_INDEX)
        length = batch["input_ids"].shape[1]
        for row, made in enumerate(rows):
            if made is None:
                continue
            ids, answer_positions = made
            batch["input_ids"][row] = torch.tensor(ids)
            batch["position_ids"][row] = torch.arange(length)
            batch["labels"][row] = batch["input_ids"][row]
            batch["labels"][row, 0] = IGNORE_INDEX
            answers[row, answer_positions] = batch["input_ids"][row, answer_positions]
        batch["answer_labels"] = answers
        return batch

    def block(self, text: list[int], rng: random.Random) -> tuple[list[int], list[int]] | None:
        """A retrieval block of `len(text)` tokens from the text block `text`: `(token ids, the answers' positions)`,
        or None if the block is too short for one."""
        length = len(text)
        keys = rng.randint(1, self.max_keys)
        named = keys > 1
        templates = self.templates.multikey if named else self.templates.passkey
        template = rng.choice(templates)
        names = rng.sample(self.templates.names, keys) if named else [None]
        values = []
        for _ in range(keys):
            digits = rng.choice(KEY_DIGITS)
            values.append(str(rng.randint(10 ** (digits - 1), 10**digits - 1)))
        needles = [
            self._ids(" " + template.needle.format(key=value, name=name or ""))
            for name, value in zip(names, values, strict=True)
        ]
        asked = rng.sample(range(keys), rng.randint(1, min(keys, self.max_questions)))
        asks = []
        for k in asked:
            question = template.question.format(name=names[k] or "")
            asks.append(question_and_answer(self.tokenizer, question, values[k]))
        room = length - sum(map(len, needles)) - sum(len(q) + len(a) for q, a in asks)
        gap = min(MIN_GAP, length // 8)
        if room < gap + keys:
            return None
        body = text[:room]
        ends = [end for end in self._sentence_ends(body) if end <= room - gap]
        places = sorted(nearest_place(ends, rng.uniform(0, room - gap)) for _ in range(keys))
        ids, cursor = [], 0
        for place, needle in zip(places, needles, strict=True):
            ids += body[cursor:place] + needle
            cursor = place
        ids += body[cursor:]
        answer_positions = []
        for question, answer in asks:
            ids += question
            answer_positions += range(len(ids), len(ids) + len(answer))
            ids += answer
        return ids, answer_positions


__all__ = ["KEY_DIGITS", "RetrievalBlocks", "training_templates"]
