# Copyright 2026 The path-hf authors. Apache-2.0.
"""The destination's side of a conversion: the checks before anything is written (`check_destination`,
`check_disk_space`), and the staging directories written beside the destination (`STAGING_KINDS`).

Ctrl-C and SIGTERM remove the staging directories; one that a killed run left is found by its name and removed by
the next conversion to the same destination (`clear_stale_staging`), if its process ran on this host and no longer
exists. Writing a directory atomically is `path_hf.atomic`'s; only the names are the converter's.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from path_hf.errors import ConversionError

from .options import format_size

# Headroom kept free on the destination's file system beyond the bytes written (file-system blocks and metadata, other
# writers meanwhile): 1/16 of the output plus 128 KiB, at most 256 MiB (reached at a 4 GiB output).
_DISK_MARGIN_MAX = 256 * 2**20
_DISK_MARGIN_FIXED = 128 * 2**10
# Directories a conversion writes beside DST: the output being written (tmp), a GGUF materialised as a checkpoint
# (gguf), a replaced DST being deleted (old). Named `.DST.KIND-HOST-PID-TOKEN` (by older versions `.DST.KIND-TOKEN`).
STAGING_KINDS = ("tmp", "gguf", "old")
_HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


def check_destination(output: Path, source: Path, force: bool) -> None:
    """Refuse a destination that holds files (unless `force`), or that overlaps the source."""
    output = output.resolve()
    if output.exists() and not force and (not output.is_dir() or any(output.iterdir())):
        raise ConversionError(f"{output} exists and is not empty; pass --force to replace it.")
    if output.is_relative_to(source):
        raise ConversionError(f"the destination {output} is inside the source {source}.")
    if source.is_relative_to(output):
        raise ConversionError(f"the source {source} is inside the destination {output}, which would be replaced.")


def disk_margin(needed: int) -> int:
    """The free space kept beyond `needed` bytes written: 1/16 of them plus 128 KiB, at most 256 MiB."""
    return min(_DISK_MARGIN_MAX, needed // 16 + _DISK_MARGIN_FIXED)


def check_disk_space(output: Path, needed: int) -> None:
    """Refuse when the destination's file system has less free space than the output plus a margin
    (`disk_margin`). Staging directories of dead processes beside `output` count as free, since a conversion
    removes them first (`clear_stale_staging`); those of other live or unknown processes are named if space is
    short."""
    existing = output.resolve()
    while not existing.exists():
        existing = existing.parent
    free = shutil.disk_usage(existing).free
    staging = [directory for directory in find_staging(output) if directory.pid != os.getpid()]
    reclaimable = sum(directory.size for directory in staging if directory.state == "dead")
    margin = disk_margin(needed)
    if free + reclaimable < needed + margin:
        removable = f" (+ {format_size(reclaimable)} in stale staging directories to remove)" if reclaimable else ""
        held = [directory for directory in staging if directory.state != "dead"]
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
    return output.with_name(f".{output.name}.{kind}-{_HOST}-{os.getpid()}-{secrets.token_hex(4)}")


@dataclass(frozen=True)
class StagingDirectory:
    """A directory a conversion to the same destination wrote, found beside it (`find_staging`)."""

    path: Path
    host: str | None  # None: named by an older version, which recorded no process
    pid: int | None

    @property
    def state(self) -> str:
        """`dead`: its process, on this host, no longer runs. `running`: it does (or its pid was reused).
        `unknown`: another host's, or named without a process."""
        if self.pid is None or self.host != _HOST or os.name != "posix":  # Windows' os.kill would end the process
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
        owner = {
            "dead": f"left by process {self.pid}, which is no longer running",
            "running": f"of running process {self.pid} on this host (another conversion to the same destination?)",
            "unknown": f"of process {self.pid} on host {self.host}"
            if self.pid is not None
            else "left by an older path-hf, which did not record its process",
        }[self.state]
        return f"{self.path} ({format_size(self.size)}), {owner}"


def find_staging(output: Path) -> list[StagingDirectory]:
    """The staging directories of conversions to `output` beside it, whoever wrote them."""
    output = output.resolve()
    pattern = re.compile(
        rf"\.{re.escape(output.name)}\.(?:{'|'.join(STAGING_KINDS)})-(?:(?P<host>.+)-(?P<pid>\d+)-)?[0-9a-f]{{8}}"
    )
    if not output.parent.is_dir():
        return []
    return [
        StagingDirectory(path, found["host"], int(found["pid"]) if found["pid"] else None)
        for path in sorted(output.parent.iterdir())
        if (found := pattern.fullmatch(path.name)) and path.is_dir() and not path.is_symlink()
    ]


def clear_stale_staging(output: Path, remove: bool = True) -> None:
    """Remove (if `remove`) the staging directories beside `output` that a killed conversion left, saying so; name
    those of a process still running, or that cannot be checked, and leave them."""
    for directory in find_staging(output):
        if directory.state != "dead":
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


__all__ = [
    "STAGING_KINDS",
    "StagingDirectory",
    "check_destination",
    "check_disk_space",
    "clear_stale_staging",
    "disk_margin",
    "find_staging",
    "staging_directory",
]
