# Copyright 2026 The path-hf authors. Apache-2.0.
"""Exclusive locks on files, held by a process until it ends: `flock`, which the kernel releases however the process
ends, so a lock file that a killed process left behind locks nothing. `path-hf convert` locks its destination with
one (`conversion.staging.destination_lock`), the recipes their `training.output_dir`. The holder writes
`process PID on host HOST` into the file, so that whoever is refused can be told who holds it."""

from __future__ import annotations

import os
import re
import socket
from pathlib import Path

try:
    import fcntl
except ImportError:  # not POSIX: nothing is locked
    fcntl = None

HOST = re.sub(r"[^A-Za-z0-9.-]", "_", socket.gethostname()) or "localhost"


class LockHeld(Exception):
    """Another process holds the lock; `holder` is what it wrote: `process 123 on host node1`."""

    def __init__(self, path: Path, holder: str):
        super().__init__(f"{path} is locked by {holder}")
        self.path, self.holder = path, holder


def acquire_lock(path: Path) -> int | None:
    """An open descriptor of `path` (created if missing) that this process holds locked, with its name written in;
    None where locks are not available (no `fcntl`, or a file system without them: ENOLCK, EOPNOTSUPP). Raises
    `LockHeld` if another process holds it, `OSError` if the file cannot be opened or created."""
    if fcntl is None:
        return None
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = lock_holder(fd)
            os.close(fd)
            raise LockHeld(path, holder) from None
        except OSError:
            os.close(fd)
            return None
        try:
            current = os.stat(path)
        except FileNotFoundError:
            current = None
        # The holder before us may have removed the file between our open and our lock: ours is then no one's.
        if current is not None and os.path.samestat(current, os.fstat(fd)):
            os.ftruncate(fd, 0)
            os.write(fd, f"process {os.getpid()} on host {HOST}\n".encode())
            return fd
        os.close(fd)


def release_lock(path: Path, fd: int) -> None:
    """Remove the lock file and release it. Removed while still locked: a process that opened it meanwhile finds it
    gone once it gets the lock, and starts again with a new file (`acquire_lock`)."""
    path.unlink(missing_ok=True)
    os.close(fd)


def lock_holder(fd: int) -> str:
    """Who holds the lock file open as `fd`, as it wrote there: `process 123 on host node1`."""
    written = os.pread(fd, 256, 0).decode(errors="replace").strip()
    return written if re.fullmatch(r"process \d+ on host \S+", written) else "a process that has not named itself yet"


__all__ = ["HOST", "LockHeld", "acquire_lock", "lock_holder", "release_lock"]
