# Copyright 2026 The path-hf authors. Apache-2.0.
"""The data of recipes/train.py: documents -> tokens -> fixed-length training blocks, documents never attending to
each other, read epoch after epoch from a resumable position; and the held-out evaluation windows."""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import torch
from accelerate import Accelerator, skip_first_batches
from datasets import Dataset, IterableDataset, load_dataset
from torch.utils.data import DataLoader

from ..errors import RecipeError
from ..evaluation import (
    IGNORE_INDEX,
    Window,
    load_texts,
    make_windows,
    text_documents,
    tokenize_documents,
    tokenize_stream,
)
from .settings import DataSettings


def _load_texts(files: list[str], text_field: str, field_name: str, streaming: bool = False):
    """The documents of local files, one `text_field` column (`path_hf.evaluation.load_texts`)."""
    try:
        return load_texts(files, text_field, streaming)
    except (OSError, ValueError) as error:
        raise RecipeError(f"{field_name}: {error}") from error


def load_documents(data: DataSettings) -> tuple[Dataset | IterableDataset, list[str]]:
    """The training documents, and the held-out evaluation texts, which never enter training."""
    if data.dataset:
        documents = load_dataset(data.dataset, data.dataset_config, split=data.dataset_split, streaming=data.streaming)
        try:
            documents = text_documents(documents, data.text_field, data.dataset)
        except ValueError as error:
            raise RecipeError(f"data.dataset: {error}") from error
    else:
        documents = _load_texts(data.train_files, data.text_field, "data.train_files", data.streaming)
    if data.eval_files:
        eval_texts = list(_load_texts(data.eval_files, data.text_field, "data.eval_files")[data.text_field])
    else:
        eval_texts = [row[data.text_field] for row in documents.take(data.eval_documents)]
        documents = documents.skip(data.eval_documents)
    if not eval_texts:
        raise RecipeError("data: the evaluation split is empty (data.eval_files or data.eval_documents)")
    if next(iter(documents), None) is None:
        raise RecipeError("data: no training documents left (empty files, or all held out by data.eval_documents)")
    return documents, eval_texts


def pack_documents(texts: list[str], tokenizer, block_size: int) -> dict[str, list[list[int]]]:
    """Tokenise `texts` (each followed by EOS) and cut the stream into blocks of `block_size` tokens, with
    `position_ids` restarting at 0 where a document (or a block) starts, which the models read as sequence
    boundaries, and `labels` ignoring each sequence's first token, which nothing in its sequence predicts."""
    input_ids, position_ids = [], []
    for ids in tokenize_documents(texts, tokenizer):
        input_ids += ids
        position_ids += range(len(ids))
    blocks = {"input_ids": [], "position_ids": [], "labels": []}
    for start in range(0, len(input_ids) - block_size + 1, block_size):
        ids = input_ids[start : start + block_size]
        positions = position_ids[start : start + block_size]
        # A block starting inside a document starts a sequence there: renumber that fragment from 0.
        fragment = positions.index(0, 1) if 0 in positions[1:] else block_size
        positions = list(range(fragment)) + positions[fragment:]
        blocks["input_ids"].append(ids)
        blocks["position_ids"].append(positions)
        blocks["labels"].append([IGNORE_INDEX if p == 0 else t for t, p in zip(ids, positions, strict=True)])
    return blocks


def training_blocks(
    documents: Dataset | IterableDataset,
    tokenizer,
    data: DataSettings,
    accelerator: Accelerator,
    block_size: int,
    setting: str,
) -> Dataset | IterableDataset:
    """Packed training blocks of `block_size` tokens (the value of `setting`: `RecipeConfig.block_size_settings`) in a
    fixed shuffled order (what makes `resume` exact), as torch tensors."""
    if isinstance(documents, IterableDataset):
        documents = documents.shuffle(seed=data.shuffle_seed, buffer_size=data.shuffle_buffer)
    with accelerator.main_process_first():  # the main process tokenises, the others read its cache
        blocks = documents.map(
            lambda batch: pack_documents(batch[data.text_field], tokenizer, block_size),
            batched=True,
            batch_size=1000,
            remove_columns=[data.text_field],
        )
    if isinstance(blocks, Dataset):
        empty = len(blocks) == 0
        blocks = blocks.shuffle(seed=data.shuffle_seed)
    else:  # a stream: pack its first batch of documents
        empty = next(iter(blocks), None) is None
    if empty:
        raise RecipeError(f"data: the training documents make no block of {setting}={block_size} tokens")
    return blocks.with_format("torch")


def endless_batches(dataloader: DataLoader, start: int) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of `dataloader` epoch after epoch, from batch `start` on (a resumed run's data position). A map-style
    dataset skips to it through its sampler, without loading the skipped batches; a stream reads past them."""
    epochs = itertools.chain.from_iterable(itertools.repeat(dataloader))
    try:
        epoch_length = len(dataloader)
    except TypeError:  # a stream has no length
        yield from itertools.islice(epochs, start, None)
        return
    yield from skip_first_batches(dataloader, start % epoch_length)
    yield from epochs


def eval_length_names(eval_lengths: list[int]) -> dict[int, str]:
    """The names of the evaluation lengths (multiples of the block length), shortest first: `{1: "1x", 2: "2x"}`."""
    return {n: f"{n}x" for n in sorted(set(eval_lengths))}


def evaluation_windows(
    eval_texts: list[str], tokenizer, data: DataSettings, eval_lengths: list[int]
) -> dict[str, list[Window]]:
    """The evaluation text as one stream (EOS between documents, at most `data.eval_tokens` tokens) cut into
    non-overlapping windows of each length of `eval_lengths` times `data.block_size`, by name (`"2x"`). Refuses a
    stream shorter than the longest window."""
    stream = tokenize_stream(eval_texts, tokenizer, data.eval_tokens)
    windows = {name: make_windows(stream, n * data.block_size) for n, name in eval_length_names(eval_lengths).items()}
    longest = max(eval_lengths) * data.block_size
    if len(stream) < longest:
        raise RecipeError(
            f"data: the evaluation split has {len(stream)} tokens, fewer than the longest evaluation window "
            f"(training.eval_lengths x data.block_size = {longest}); raise data.eval_tokens or data.eval_documents"
        )
    return windows
