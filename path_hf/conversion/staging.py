# Copyright 2026 The path-hf authors. Apache-2.0.
"""The destination's side of a conversion: the checks before anything is written (`check_destination`,
`check_disk_space`), and the staging directories written beside the destination (`STAGING_KINDS`).

One conversion at a time writes to a destination: each holds its lock (`destination_lock`, `.DST.lock` beside it)
from before any work until its output is in place, and a second is refused. Ctrl-C and SIGTERM remove the staging
directories; one that a killed run left is found by its name and removed by the next conversion to the same
destination (`clear_stale_staging`), if its process ran on this host and no longer exists, or holds no lock on the
destination. Writing a directory atomically is `path_hf.atomic`'s; only the names are the converter's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import secrets
import shutil
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from transformers.utils import CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME

from ..errors import ConversionError
from ..locking import HOST, LockHeld, acquire_lock, release_lock
from .options import format_size

try:
    import fcntl
except ImportError:  # not POSIX: `destination_lock` does not lock
    fcntl = None

# Headroom kept free on the destination's file system beyond the bytes written (file-system blocks and metadata, other
# writers meanwhile): 1/16 of the output plus 128 KiB, at most 256 MiB (reached at a 4 GiB output).
_DISK_MARGIN_MAX = 256 * 2**20
_DISK_MARGIN_FIXED = 128 * 2**10
# Directories a conversion writes beside DST: the output being written (tmp), a GGUF materialised as a checkpoint
# (gguf), a replaced DST being deleted (old). Named `.DST.KIND-HOST-PID-TOKEN`.
STAGING_KINDS = ("tmp", "gguf", "old")
# The destinations whose lock this process holds (`destination_lock`), and how many blocks hold each.
_held_locks: dict[Path, int] = {}


# What a model folder holds at its top: weights, or a transformers config (`check_destination`).
_WEIGHT_PATTERNS = ("*.safetensors", "*.gguf", "pytorch_model*.bin", SAFE_WEIGHTS_INDEX_NAME, WEIGHTS_INDEX_NAME)
# Subfolders a model folder may hold: huggingface_hub's download metadata (`hf download --local-dir`). path-hf writes
# no subfolder, so any other one is someone's own.
_MODEL_SUBFOLDERS = (".cache",)
_NAMED_ENTRIES = 5


def check_destination(output: Path, force: bool, source: Path | None = None) -> None:
    """Refuse a destination that a conversion must not replace: the current or home directory or a folder holding
    them, one that overlaps `source` (if known), a file, a folder that is not a model's (`--force` replaces only a
    model folder or an empty one, see `not_a_model`), and a model without `force`."""
    output = output.resolve()
    for name, directory in _protected_directories():
        if directory.is_relative_to(output):
            what = name if directory == output else f"a folder that holds {name} ({directory})"
            raise ConversionError(
                f"the destination {output} is {what}, which a conversion would replace whole; write the model to a "
                f"new folder, e.g. --to {output / 'model-path'}."
            )
    if source is not None:
        check_overlap(output, source)
    if output.exists() and not output.is_dir():
        raise ConversionError(f"the destination {output} is a file, not a model folder; choose a new or empty folder.")
    if output.is_dir() and any(output.iterdir()):
        if (reason := not_a_model(output)) is not None:
            raise ConversionError(
                f"the destination {output} is not a model folder ({reason}): --force replaces only a model folder or "
                "an empty one; choose a new or empty folder."
            )
        if not force:
            raise ConversionError(f"{output} exists and holds a model; pass --force to replace it.")


def check_overlap(output: Path, source: Path) -> None:
    """Refuse a destination inside `source` (resolved), or `source` inside it (it would be replaced): part of
    `check_destination`, and what is checked again of a source known only later (a hub snapshot, a linked GGUF)."""
    output = output.resolve()
    if output.is_relative_to(source):
        raise ConversionError(f"the destination {output} is inside the source {source}.")
    if source.is_relative_to(output):
        raise ConversionError(f"the source {source} is inside the destination {output}, which would be replaced.")


def _protected_directories() -> list[tuple[str, Path]]:
    """The directories no conversion replaces, nor any folder holding them: the current and the home directory."""
    found = []
    for name, directory in (("the current directory", Path.cwd), ("your home directory", Path.home)):
        try:
            found.append((name, directory().resolve()))
        except (OSError, RuntimeError):  # a removed current directory; no home known
            pass
    return found


def not_a_model(directory: Path) -> str | None:
    """Why the non-empty `directory` is not a model folder, naming what it holds (`"no config.json or weights; it
    holds notes/, thesis.tex"`), or None if it is one: it holds weights or a transformers `config.json` at its top,
    and no subfolder but `_MODEL_SUBFOLDERS` (path-hf writes none: any other is someone's own)."""
    entries = sorted(directory.iterdir())
    if not _transformers_config(directory / CONFIG_NAME) and not any(
        path.is_file() for pattern in _WEIGHT_PATTERNS for path in directory.glob(pattern)
    ):
        return f"no config.json or weights; it holds {_name_entries(entries)}"
    folders = [
        path for path in entries if path.is_dir() and not path.is_symlink() and path.name not in _MODEL_SUBFOLDERS
    ]
    if folders:
        return f"it holds folders that are not a model's: {_name_entries(folders)}"
    return None


def _name_entries(paths: list[Path]) -> str:
    named = ", ".join(path.name + ("/" if path.is_dir() else "") for path in paths[:_NAMED_ENTRIES])
    more = f" and {len(paths) - _NAMED_ENTRIES} more" if len(paths) > _NAMED_ENTRIES else ""
    return f"{named}{more}"


def _transformers_config(path: Path) -> bool:
    """Whether `path` is a transformers `config.json`: a JSON object naming a model type or architectures."""
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(config, dict) and ("model_type" in config or "architectures" in config)


def disk_margin(needed: int) -> int:
    """The free space kept beyond `needed` bytes written: 1/16 of them plus 128 KiB, at most 256 MiB."""
    return min(_DISK_MARGIN_MAX, needed // 16 + _DISK_MARGIN_FIXED)


def check_disk_space(output: Path, needed: int) -> None:
    """Refuse when the destination's file system has less free space than the output plus a margin
    (`disk_margin`). Stale staging directories beside `output` count as free, since a conversion removes them first
    (`clear_stale_staging`); those of other conversions, or that cannot be checked, are named if space is short."""
    existing = output.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    staging = find_staging(output)
    reclaimable = sum(directory.size for directory in staging if directory.stale)
    margin = disk_margin(needed)
    if free + reclaimable < needed + margin:
        removable = f" (+ {format_size(reclaimable)} in stale staging directories to remove)" if reclaimable else ""
        held = [directory for directory in staging if not directory.stale]
        held_by = (
            f"; {format_size(sum(d.size for d in held))} is held by staging directories of other conversions: "
            f"{', '.join(d.path.name for d in held)}"
            if held
            else ""
        )
        raise ConversionError(
            f"not enough free disk space in {existing}: the output needs {format_size(needed)} "
            f"(+ {format_size(margin)} margin), {format_size(free)} is free{removable}{held_by}."
        )


def staging_directory(output: Path, kind: str) -> Path:
    """A new path beside `output` for a directory a conversion to `output` writes (`kind`, one of `STAGING_KINDS`),
    naming this host and process: `.DST.KIND-HOST-PID-TOKEN`."""
    return output.with_name(f".{output.name}.{kind}-{HOST}-{os.getpid()}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class StagingDirectory:
    """A directory a conversion to the same destination wrote, found beside it (`find_staging`)."""

    path: Path
    host: str
    pid: int
    locked: bool = False  # whether the process that found it holds the destination's lock

    @property
    def state(self) -> str:
        """`dead`: its process, on this host, no longer runs. `running`: it does (or its pid was reused).
        `unknown`: another host's."""
        if self.host != HOST or os.name != "posix":  # Windows' os.kill would end the process
            return "unknown"
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return "dead"
        except PermissionError:  # another user's process
            return "running"
        except OverflowError:  # not a process id
            return "unknown"
        return "running"

    @property
    def stale(self) -> bool:
        """Whether no conversion is writing it: its process is dead or, when the finder holds the destination's lock
        (`destination_lock`), is one on this host that does not (every conversion holds it while it writes)."""
        return self.state == "dead" or (self.state == "running" and self.locked)

    @property
    def size(self) -> int:
        """Bytes it occupies on disk."""
        total = 0
        for root, _, files in os.walk(self.path):
            for name in files:
                try:
                    total += os.lstat(os.path.join(root, name)).st_blocks * 512
                except OSError:  # removed meanwhile
                    pass
        return total

    def describe(self) -> str:
        if self.state == "dead":
            owner = f"left by process {self.pid}, which is no longer running"
        elif self.state == "running" and self.locked:
            owner = (
                f"of process {self.pid} on this host, which holds no lock on the destination (not a conversion: its "
                "process id was reused)"
            )
        elif self.state == "running":
            owner = f"of running process {self.pid} on this host (another conversion to the same destination?)"
        else:
            owner = f"of process {self.pid} on host {self.host}"
        return f"{self.path} ({format_size(self.size)}), {owner}"


def find_staging(output: Path) -> list[StagingDirectory]:
    """The staging directories of conversions to `output` beside it, whoever wrote them, but this process."""
    output = output.resolve()
    pattern = re.compile(
        rf"\.{re.escape(output.name)}\.(?:{'|'.join(STAGING_KINDS)})-(?P<host>.+)-(?P<pid>\d+)-[0-9a-f]{{8}}"
    )
    if not output.parent.is_dir():
        return []
    locked = output in _held_locks
    found = [
        StagingDirectory(path, named["host"], int(named["pid"]), locked)
        for path in sorted(output.parent.iterdir())
        if (named := pattern.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()
    ]
    return [directory for directory in found if not (directory.host == HOST and directory.pid == os.getpid())]


def clear_stale_staging(output: Path, remove: bool = True) -> None:
    """Remove (if `remove`) the stale staging directories beside `output` (`StagingDirectory.stale`: left by a killed
    conversion), saying so; name those of a conversion that may be running, or that cannot be checked, and leave
    them. Run while holding the destination's lock (`destination_lock`), so that none is being written."""
    for directory in find_staging(output):
        if not directory.stale:
            print(
                f"warning: left as it is: {directory.describe()}; delete it once no conversion to {output.name} runs",
                file=sys.stderr,
                flush=True,
            )
        elif not remove:
            print(f"stale staging directory {directory.describe()}: a conversion removes it", flush=True)
        else:
            description = directory.describe()
            shutil.rmtree(directory.path, ignore_errors=True)
            if directory.path.exists():
                print(f"warning: cannot remove {description}", file=sys.stderr, flush=True)
            else:
                print(f"removed stale staging directory {description}", flush=True)


def lock_file(output: Path) -> Path:
    """The lock file of conversions to `output`: `.DST.lock` beside it."""
    return output.with_name(f".{output.name}.lock")


@contextmanager
def destination_lock(output: Path, create_parent: bool = True) -> Iterator[None]:
    """Hold the lock of conversions to `output` for the block, or refuse (`ConversionError`, naming the process that
    holds it). The lock is `flock` on `lock_file(output)`, which the kernel releases when its process ends, however it
    ends: a lock file that a killed conversion left locks nothing, and the next one takes it over. Nested blocks of one
    process share the lock.

    The folder holding `output` is made if missing (and removed again if the block fails), unless not
    `create_parent`: then the block runs unlocked, as nobody can be writing there. POSIX: where `fcntl` is missing
    (Windows), or the file system cannot lock, the block runs unlocked."""
    output = output.resolve()
    if output in _held_locks:
        _held_locks[output] += 1
        try:
            yield
        finally:
            _held_locks[output] -= 1
        return
    if fcntl is None or (not create_parent and not output.parent.is_dir()):
        yield
        return
    if not create_parent:  # a dry run writes nothing: a folder it may not write to is no reason to refuse it
        try:
            fd = acquire_lock(lock_file(output))
        except OSError:
            fd = None
        except LockHeld:
            fd = _lock(lock_file(output), output)  # refused, naming the holder
        if fd is not None:
            _held_locks[output] = 1
        try:
            yield
        finally:
            if fd is not None:
                del _held_locks[output]
                release_lock(lock_file(output), fd)
        return
    created = _make_directories(output.parent)
    try:
        fd = _lock(lock_file(output), output)
        if fd is None:
            yield
            return
        _held_locks[output] = 1
        try:
            yield
        finally:
            del _held_locks[output]
            # Removed while still locked: a process that opened it meanwhile finds it gone once it gets the lock, and
            # starts again with a new file (`_lock`).
            release_lock(lock_file(output), fd)
    except BaseException:
        for directory in reversed(created):
            with contextlib.suppress(OSError):  # no longer empty: someone else's now
                directory.rmdir()
        raise


def _make_directories(directory: Path) -> list[Path]:
    """Make `directory` and its missing parents; the ones made, outermost first."""
    missing = [path for path in (directory, *directory.parents) if not path.exists()][::-1]
    directory.mkdir(parents=True, exist_ok=True)
    return missing


def _lock(path: Path, output: Path) -> int | None:
    """An open descriptor of `path` that this process holds locked (`acquire_lock`); None (with a warning) where the
    file system cannot lock."""
    try:
        fd = acquire_lock(path)
    except LockHeld as held:
        raise ConversionError(
            f"another conversion to {output} is running ({held.holder}, holding {path}); wait for it to end, or "
            "choose another --to."
        ) from None
    except OSError as error:
        raise ConversionError(
            f"cannot open or create the lock file {path} ({error.strerror}); --to must be in a folder you can write to."
        ) from error
    if fd is None:
        print(
            f"warning: cannot lock {path}: another conversion to {output.name} could run at the same time",
            file=sys.stderr,
            flush=True,
        )
    return fd


__all__ = [
    "STAGING_KINDS",
    "StagingDirectory",
    "check_destination",
    "check_disk_space",
    "check_overlap",
    "clear_stale_staging",
    "destination_lock",
    "disk_margin",
    "find_staging",
    "lock_file",
    "not_a_model",
    "staging_directory",
]
