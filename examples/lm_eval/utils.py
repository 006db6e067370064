"""Functions the task configs of this folder name with `!function utils.NAME` (lm-eval imports this file by path)."""

from __future__ import annotations

import json
from pathlib import Path

import datasets

HERE = Path(__file__).resolve().parent


def load(data_file: str, **metadata) -> datasets.DatasetDict:
    """`custom_dataset`: the items of `data_file` (JSON lines, relative to this folder) as the `test` split, read
    without the hub or the datasets cache. lm-eval also passes the task's metadata, which is not needed here."""
    with open(HERE / data_file, encoding="utf-8") as lines:
        items = [json.loads(line) for line in lines]
    return datasets.DatasetDict({"test": datasets.Dataset.from_list(items)})


def perplexity_results(doc: dict, results: tuple[float]) -> dict[str, tuple[float, int]]:
    """wikitext's metrics of one passage: its log-likelihood with its number of words (runs of non-space characters)
    and of UTF-8 bytes, which lm-eval's `word_perplexity`, `byte_perplexity` and `bits_per_byte` aggregate."""
    (loglikelihood,) = results
    text = doc["text"]
    words, size = len(text.split()), len(text.encode("utf-8"))
    return {
        "word_perplexity": (loglikelihood, words),
        "byte_perplexity": (loglikelihood, size),
        "bits_per_byte": (loglikelihood, size),
    }
