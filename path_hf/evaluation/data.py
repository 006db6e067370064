# Copyright 2026 The path-hf authors. Apache-2.0.
"""Text for evaluation and training: local files -> documents (a `datasets` dataset with one text column) -> token
ids, each document with the tokenizer's special tokens and followed by EOS."""

from __future__ import annotations

import bz2
import gzip
import lzma
from collections.abc import Iterable, Sequence
from pathlib import Path

COMPRESSED_SUFFIXES = (".gz", ".xz", ".bz2", ".zst")
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_DECOMPRESSORS = {".gz": gzip.open, ".xz": lzma.open, ".bz2": bz2.open}


def _data_suffix(file: Path) -> str:
    """The suffix that says how to read `file`: `.jsonl` for `a.jsonl` and `a.jsonl.gz`."""
    return Path(file.stem).suffix if file.suffix in COMPRESSED_SUFFIXES else file.suffix


def _expand_directory(file: str) -> list[str]:
    """`[file]`, or for a directory the data files directly in it (hidden files left out), sorted by name."""
    if not Path(file).is_dir():
        return [file]
    found = sorted(
        str(path)
        for path in Path(file).iterdir()
        if path.is_file() and not path.name.startswith(".") and _data_suffix(path) in _BUILDERS
    )
    if not found:
        raise ValueError(
            f"{file} is a directory with no data files (looked for {', '.join('*' + s for s in _BUILDERS)}, each "
            f"optionally compressed with {', '.join(COMPRESSED_SUFFIXES)})"
        )
    return found


def data_files(files: Sequence[str | Path]) -> tuple[str, dict]:
    """The `datasets` builder and its keyword arguments that read local `files`, all of one kind: `.txt` (a document
    ends at a blank line), `.jsonl` / `.json` or `.parquet`, each optionally compressed (`.gz`, `.xz`, `.bz2`, `.zst`,
    which `datasets` decompresses itself). A directory stands for the data files directly in it, sorted by name.
    Raises `FileNotFoundError` / `ValueError` naming the files at fault."""
    files = [expanded for file in files for expanded in _expand_directory(str(file))]
    if not files:
        raise ValueError("no data files given")
    missing = [file for file in files if not Path(file).is_file()]
    if missing:
        raise FileNotFoundError(f"no such file(s): {', '.join(missing)}")
    suffixes = {_data_suffix(Path(file)) for file in files}
    if len(suffixes) != 1 or next(iter(suffixes)) not in _BUILDERS:
        raise ValueError(
            f"data files must all be .txt, .jsonl/.json or .parquet (optionally compressed with "
            f"{', '.join(COMPRESSED_SUFFIXES)}), got {sorted(suffixes)}"
        )
    builder = _BUILDERS[suffixes.pop()]
    kwargs = {"sample_by": "paragraph"} if builder == "text" else {}
    return builder, {"data_files": files, **kwargs}


def _blank(file: str, builder: str) -> bool:
    """Whether `file` holds nothing but whitespace (once decompressed): no documents, and nothing `datasets` reads (it
    fails on an empty file). Only its first non-blank bytes are read."""
    if Path(file).stat().st_size == 0:
        return True
    suffix = Path(file).suffix
    if builder == "parquet" or (suffix in COMPRESSED_SUFFIXES and suffix not in _DECOMPRESSORS):
        return False  # a parquet file has a schema; zstandard is not in the standard library
    try:
        with _DECOMPRESSORS.get(suffix, open)(file, "rb") as stream:
            while chunk := stream.read(1 << 16):
                if chunk.strip():
                    return False
    except (OSError, EOFError, lzma.LZMAError):  # a damaged file: `datasets` says what is wrong with it
        return False
    return True


def load_texts(files: Sequence[str | Path], text_field: str = "text", streaming: bool = False):
    """The documents of local `files` (see `data_files`) as a `datasets` dataset (an `IterableDataset` if
    `streaming`) with the one column `text_field`, empty documents left out, in file order. Each file is read on its
    own, so files whose records carry different other fields mix; files holding only whitespace add nothing. Raises
    `ValueError` naming a file without the column."""
    from datasets import Dataset, Features, Value, concatenate_datasets, load_dataset

    builder, kwargs = data_files(files)
    parts = []
    for file in kwargs.pop("data_files"):
        if _blank(file, builder):
            continue
        dataset = load_dataset(builder, data_files=[file], split="train", streaming=streaming, **kwargs)
        parts.append(text_documents(dataset, text_field, file))
    if not parts:
        empty = Dataset.from_dict({text_field: []}, features=Features({text_field: Value("string")}))
        return empty.to_iterable_dataset() if streaming else empty
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def text_documents(dataset, text_field: str, source: str):
    """The non-empty documents of a `datasets` dataset (or `IterableDataset`), as its one column `text_field`. Raises
    `ValueError` naming `source` when it has no such column."""
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"{source} has no column {text_field!r} (columns: {columns}): set the text field")
    return dataset.select_columns([text_field]).filter(lambda row: bool(row[text_field] and row[text_field].strip()))


def read_texts(files: Sequence[str | Path], text_field: str = "text") -> list[str]:
    """The non-empty documents of local `files` (see `load_texts`), in order; `text_field` names the column of
    JSON / parquet records."""
    return list(load_texts(files, text_field)[text_field])


def tokenize_documents(texts: Sequence[str], tokenizer) -> list[list[int]]:
    """The token ids of each of `texts` as the models read a document: with the tokenizer's special tokens (BOS) and
    followed by EOS."""
    eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
    return [ids + eos for ids in tokenizer(list(texts), add_special_tokens=True)["input_ids"]]


def tokenize_stream(texts: Iterable[str], tokenizer, max_tokens: int | None = None) -> list[int]:
    """`texts` tokenised as one stream of documents (`tokenize_documents`), cut to at most `max_tokens` tokens."""
    stream: list[int] = []
    for text in texts:
        stream += tokenize_documents([text], tokenizer)[0]
        if max_tokens is not None and len(stream) >= max_tokens:
            break
    return stream if max_tokens is None else stream[:max_tokens]


__all__ = [
    "COMPRESSED_SUFFIXES",
    "data_files",
    "load_texts",
    "read_texts",
    "text_documents",
    "tokenize_documents",
    "tokenize_stream",
]
