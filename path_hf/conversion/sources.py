# Copyright 2026 The path-hf authors. Apache-2.0.
"""Where a conversion reads from: a local checkpoint directory, the snapshot of a hub repository in the cache, or a
llama.cpp GGUF file materialised as a checkpoint (`conversion.gguf` makes the `GGUFCheckpoint`).

A hub id is downloaded in two steps, as `from_pretrained` would: its top-level files first (config, tokenizer), and
its weights only once the config has been checked (`fetch_weights`), honouring `HF_HUB_OFFLINE`, the revision and
files already cached.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
from huggingface_hub import snapshot_download
from transformers.utils import SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, WEIGHTS_INDEX_NAME, WEIGHTS_NAME

from ..errors import ConversionError, first_line
from .io import SourceWeights, read_index

# Files of a checkpoint that hold weights, in any format: not downloaded before the config is checked, not carried over.
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".h5", ".msgpack", ".gguf", ".onnx")


@dataclass(frozen=True)
class GGUFCheckpoint:
    """A GGUF file materialised as a checkpoint in `directory`, or only planned there (`weights` described from the
    file's header, `model.safetensors` not written: what `--dry-run` needs)."""

    file: Path  # the GGUF file
    header: str  # what its header says, e.g. "GGUF llama, tensors 210 Q4_1, 61 F32, 1 Q8_0"
    header_record: dict  # what `path_conversion` records of it (besides its path and the dtype)
    directory: Path
    dtype: torch.dtype
    weights: SourceWeights

    def describe(self) -> str:
        return f"{self.header}, dequantised to {str(self.dtype).removeprefix('torch.')}"

    def record(self) -> dict:
        return {**self.header_record, "dtype": str(self.dtype).removeprefix("torch.")}


@dataclass(frozen=True)
class Source:
    """A source checkpoint on disk: a local directory, the snapshot of a hub repository in the cache, or a GGUF file
    materialised as a checkpoint in a temporary directory."""

    path: Path
    repo_id: str | None = None
    revision: str | None = None  # the snapshot's commit
    gguf: GGUFCheckpoint | None = None

    @property
    def name(self) -> str:
        return self.repo_id or str(self.gguf.file if self.gguf else self.path)

    @property
    def public_name(self) -> str:
        """The name a published model card gives the source: the hub id, or the file's or folder's own name (never
        where it lies on this machine)."""
        return self.repo_id or (self.gguf.file if self.gguf else self.path).name


def link_roots(directory: Path) -> tuple[Path, ...]:
    """Where the files of the source `directory` (resolved) may lie when reached through a link without
    `--follow-symlinks`: in it and, for a snapshot in the Hugging Face cache (`models--ORG--NAME/snapshots/COMMIT`,
    made of links into `../../blobs`), in its repository's `blobs`."""
    repo = directory.parents[1] if len(directory.parents) > 1 else directory
    if directory.parent.name == "snapshots" and repo.name.startswith("models--"):
        return directory, (repo / "blobs").resolve()
    return (directory,)


def links_outside(directory: Path, paths: Iterable[Path]) -> list[tuple[Path, Path]]:
    """`(path, what it resolves to)` for each of `paths`, files of the source `directory` (resolved), that resolves
    outside `link_roots(directory)`: through a link, or a `..` in a name an index gives."""
    roots = link_roots(directory)
    found = []
    for path in dict.fromkeys(paths):
        target = path.resolve()
        if not any(target.is_relative_to(root) for root in roots):
            found.append((path, target))
    return found


def follow_links(directory: Path, links: Sequence[tuple[Path, Path]], follow: bool) -> None:
    """Refuse the `links` out of the source `directory` (`links_outside`), naming each and its target, unless
    `follow` (`--follow-symlinks`): then name them in a line, since what they point to goes into the output."""
    if not links:
        return
    named = ", ".join(f"{path.relative_to(directory)} -> {target}" for path, target in links)
    if not follow:
        raise ConversionError(
            f"{directory} has links to files outside it, which the conversion would read and copy into the output: "
            f"{named}; remove them, or pass --follow-symlinks to copy what they point to."
        )
    print(f"following links out of {directory} (--follow-symlinks): {named}", flush=True)


def _download(repo_id: str, revision: str | None, **patterns) -> Path:
    try:
        return Path(snapshot_download(repo_id, revision=revision, **patterns))
    except (OSError, ValueError) as error:  # not found, offline and not cached, invalid id, HTTP errors
        raise ConversionError(f"cannot get {repo_id!r} from the hub: {first_line(error)}") from error


def resolve_source(source: str, revision: str | None) -> Source:
    """A local directory as it is; a hub id downloaded without its weights (`fetch_weights` gets them after the
    config has been checked), honouring `HF_HUB_OFFLINE`, `revision` and the cache."""
    path = Path(source).expanduser()
    if path.is_dir():
        if revision is not None:
            raise ConversionError(f"--revision applies to hub ids, but {source} is a local directory.")
        return Source(path.resolve())
    if path.exists():
        if path.suffix.lower() == ".gguf":  # `convert` materialises it first
            raise ConversionError(f"{source} is a GGUF file: plan it inside `conversion.gguf.gguf_source(options)`.")
        raise ConversionError(f"{source} is a file; SRC must be a checkpoint directory, a .gguf file or a hub id.")
    ignore = [f"*{suffix}" for suffix in WEIGHT_SUFFIXES] + ["*/*"]  # top-level files only
    snapshot = _download(source, revision, ignore_patterns=ignore)
    return Source(snapshot, repo_id=source, revision=snapshot.name)


def fetch_weights(source: Source) -> None:
    """Download the weight files of a hub source (only those the index lists, or the single file)."""
    if source.repo_id is None:
        return
    for index_name in (SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME):
        index = source.path / index_name
        if index.is_file():
            _download(source.repo_id, source.revision, allow_patterns=read_index(index)[0])
            return
    for single_name in (SAFE_WEIGHTS_NAME, WEIGHTS_NAME):
        _download(source.repo_id, source.revision, allow_patterns=[single_name])
        if (source.path / single_name).is_file():
            return


__all__ = [
    "WEIGHT_SUFFIXES",
    "GGUFCheckpoint",
    "Source",
    "fetch_weights",
    "follow_links",
    "link_roots",
    "links_outside",
    "resolve_source",
]
