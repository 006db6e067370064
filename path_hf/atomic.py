# Copyright 2026 The path-hf authors. Apache-2.0.
"""Writes that a reader never sees half done: a file or a directory is written under a staging name beside its
destination and renamed into place once complete (`os.replace`, atomic within a file system). `path-hf convert`
writes checkpoints this way, `path-hf eval` its JSON and plots, the recipes their training checkpoints."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


@contextmanager
def atomic_file(path: str | Path, exclusive: bool = False) -> Iterator[Path]:
    """A temporary path beside `path` for the block to write, renamed onto `path` if the block succeeds (with the
    permissions of any new file) and deleted if it fails or is interrupted. With `exclusive`, a `path` that exists by
    then (made by another process meanwhile) is never replaced: `FileExistsError`, and the written file is kept under
    its temporary name, which the error gives (`filename2`)."""
    target = Path(path)
    handle, tmp = tempfile.mkstemp(dir=target.resolve().parent, prefix=f".{target.name}.", suffix=target.suffix)
    os.close(handle)
    keep = False
    try:
        yield Path(tmp)
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(tmp, 0o666 & ~umask)  # mkstemp makes it private
        if exclusive:
            try:
                os.link(tmp, target)  # fails if `target` exists, atomically
            except FileExistsError as error:
                keep = True
                raise FileExistsError(error.errno, f"{target} exists", str(target), None, tmp) from None
        else:
            os.replace(tmp, target)
    finally:
        if not keep:
            Path(tmp).unlink(missing_ok=True)


def replace_directory(staging: Path, target: Path, old: Path, sync: bool = False) -> None:
    """Move the complete directory `staging` to `target`. An existing `target` is first renamed to `old` and deleted
    afterwards, so that `target` is at every moment either the whole old or the whole new one. With `sync`, the files
    are flushed to disk before the rename, and the rename itself after it (POSIX)."""
    if sync:
        sync_to_disk(staging)
    if target.exists() or target.is_symlink():
        os.replace(target, old)
        os.replace(staging, target)
        if old.is_dir() and not old.is_symlink():
            shutil.rmtree(old)
        else:
            old.unlink()
    else:
        os.replace(staging, target)
    if sync:
        sync_to_disk(target.parent, recursive=False)


@contextmanager
def atomic_directory(target: Path, staging: Path, old: Path) -> Iterator[Path]:
    """The new, empty directory `staging` for the block to write, moved to `target` by `replace_directory` if the
    block succeeds and deleted if it fails or is interrupted. `staging` and `old` must be beside `target` (the same
    file system), and named so that whoever finds them left by a killed process knows what they are."""
    target.parent.mkdir(parents=True, exist_ok=True)
    staging.mkdir()
    try:
        yield staging
        replace_directory(staging, target, old)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


def sync_to_disk(directory: Path, recursive: bool = True) -> None:
    """fsync the files under `directory` (if `recursive`) and the directory entries themselves (POSIX only)."""
    paths = [*sorted(directory.rglob("*")), directory] if recursive else [directory]
    for path in paths:
        if path.is_dir() and os.name != "posix":
            continue
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


__all__ = ["atomic_directory", "atomic_file", "replace_directory", "sync_to_disk"]
