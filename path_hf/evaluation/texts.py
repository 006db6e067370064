# Copyright 2026 The path-hf authors. Apache-2.0.
"""Text for evaluation and training: local files -> documents (a `datasets` dataset with one text column) -> token
ids, each document with the tokenizer's special tokens and followed by EOS."""

from __future__ import annotations

import bz2
import contextlib
import gzip
import json
import logging
import lzma
import sys
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

from ..errors import first_line

COMPRESSED_SUFFIXES = (".gz", ".xz", ".bz2", ".zst")
_BUILDERS = {".txt": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet"}
_KINDS = {"text": "text", "json": "JSON", "parquet": "parquet"}
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
    `ValueError` naming a file that cannot be read and what is wrong with it (`_read_file`), and one whose column
    `text_field` is missing or does not hold text."""
    from datasets import Dataset, Features, Value, concatenate_datasets

    builder, kwargs = data_files(files)
    parts = []
    for file in kwargs.pop("data_files"):
        if _blank(file, builder):
            continue
        parts.append(text_documents(_read_file(file, builder, streaming, **kwargs), text_field, file))
    if not parts:
        empty = Dataset.from_dict({text_field: []}, features=Features({text_field: Value("string")}))
        return empty.to_iterable_dataset() if streaming else empty
    return parts[0] if len(parts) == 1 else concatenate_datasets(parts)


def _read_file(file: str, builder: str, streaming: bool = False, **kwargs):
    """`datasets.load_dataset(builder, data_files=[file])`, its train split. A file it cannot read (binary, not
    UTF-8, broken JSON, not parquet, damaged compression) raises `ValueError` naming the file and what is wrong with
    it, where `datasets` says "An error occurred while generating the dataset". Streamed, its first records are read
    here, so that such a file is refused now rather than at the first step of a training run (a fault further in
    still shows only there)."""
    from datasets import load_dataset

    try:
        with _quiet_loaders():
            dataset = load_dataset(builder, data_files=[file], split="train", streaming=streaming, **kwargs)
            if streaming:
                next(iter(dataset), None)
    except Exception as error:  # anything from pyarrow, pandas, fsspec, the decompressors or `datasets` itself
        cause = _fault(file, builder) or _first_cause(error)
        raise ValueError(f"cannot read {file} as {_KINDS[builder]}: {cause}") from error
    return dataset


@contextlib.contextmanager
def _quiet_loaders() -> Iterator[None]:
    """Silences the messages `datasets`' file loaders log before they raise: `_read_file`'s error says it once."""
    logger = logging.getLogger("datasets.packaged_modules")
    level = logger.level
    logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        logger.setLevel(level)


def _first_cause(error: BaseException) -> str:
    """The first line of the first error in `error`'s chain that is not `datasets`' wrapper of another."""
    from datasets.exceptions import DatasetGenerationError

    while isinstance(error, DatasetGenerationError) and (error.__cause__ or error.__context__) is not None:
        error = error.__cause__ or error.__context__
    return first_line(error)


_JSON_TYPES = {dict: "object", list: "array", str: "string", int: "number", float: "number"}


def _fault(file: str, builder: str) -> str | None:
    """What is wrong with the text or JSON `file` that `datasets` failed to read: the first line that is not UTF-8,
    not JSON or not a JSON object (JSON lines), a JSON document that does not parse, or a compression that does not
    decompress. None when nothing is found, and for parquet and zstandard (not in the standard library) files."""
    suffix = Path(file).suffix
    if builder == "parquet" or (suffix in COMPRESSED_SUFFIXES and suffix not in _DECOMPRESSORS):
        return None
    document: list[str] | None = None  # the text, once the first record is not JSON on its own: one JSON document
    records = 0
    try:
        with _DECOMPRESSORS.get(suffix, open)(file, "rb") as stream:
            for number, line in enumerate(stream, 1):
                try:
                    text = line.decode("utf-8")
                except UnicodeDecodeError as error:
                    return (
                        f"line {number} is not UTF-8 text (byte {line[error.start]:#04x} at column {error.start + 1})"
                    )
                if document is not None:
                    document.append(text)
                if builder != "json" or document is not None or not text.strip():
                    continue
                try:
                    record = json.loads(text.rstrip("\r\n"))
                except json.JSONDecodeError as error:
                    if records:
                        return f"line {number} is not JSON (column {error.colno}: {error.msg})"
                    document = ["\n"] * (number - 1) + [text]
                    continue
                records += 1
                if not isinstance(record, dict) and not (records == 1 and isinstance(record, list)):
                    kind = _JSON_TYPES.get(type(record), "literal")
                    return f"line {number} is a JSON {kind}, not an object (JSON lines hold one record a line)"
    except (OSError, EOFError, lzma.LZMAError) as error:
        return f"it does not decompress as {suffix} ({error})"
    if document is not None:
        try:
            json.loads("".join(document))
        except json.JSONDecodeError as error:
            return f"it is not JSON (line {error.lineno}, column {error.colno}: {error.msg})"
    return None


def data_fault(files: Sequence[str | Path]) -> str | None:
    """`FILE: what is wrong` for the first of the local data `files` with a fault `_fault` finds (a line that is not
    UTF-8 or not JSON, a compression that does not decompress), or None: what a stream that failed partway hit."""
    builder, kwargs = data_files(files)
    for file in kwargs["data_files"]:
        if (fault := _fault(file, builder)) is not None:
            return f"{file}: {fault}"
    return None


def text_documents(dataset, text_field: str, source: str):
    """The non-empty documents of a `datasets` dataset (or `IterableDataset`), as its one column `text_field`. Raises
    `ValueError` naming `source` when it has no such column, or one of values that are not text (as far as the
    dataset declares its columns: a streamed one may not)."""
    columns = dataset.column_names
    if columns is not None and text_field not in columns:
        raise ValueError(f"{source} has no column {text_field!r} (columns: {columns}): set the text field")
    feature = (dataset.features or {}).get(text_field)
    kind = getattr(feature, "dtype", type(feature).__name__)
    if feature is not None and kind not in ("string", "large_string"):
        raise ValueError(f"{source}: column {text_field!r} holds {kind} values, not text: set the text field")
    dataset = dataset.select_columns([text_field])
    if hasattr(dataset, "num_rows"):  # loaded (a stream is not read twice): records without the field are said
        missing = dataset.filter(lambda row: row[text_field] is None).num_rows
        if missing:
            print(
                f"warning: {missing} of the {dataset.num_rows} records of {source} have no {text_field!r} field and "
                "are left out",
                file=sys.stderr,
                flush=True,
            )
    return dataset.filter(lambda row: bool(row[text_field] and row[text_field].strip()))


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
    "data_fault",
    "COMPRESSED_SUFFIXES",
    "data_files",
    "load_texts",
    "read_texts",
    "text_documents",
    "tokenize_documents",
    "tokenize_stream",
]
