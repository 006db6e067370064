# Copyright 2026 The path-hf authors. Apache-2.0.
"""Freed tensor memory handed back to the system at once, on glibc (Linux).

On CPU, torch takes tensor memory from malloc. glibc serves an allocation from its heap, and only one above the
"mmap threshold" with its own mapping, which `free` returns to the system. The threshold is dynamic: it rises to the
size of the largest mapped block freed, up to 32 MiB. A training step at long blocks makes thousands of temporaries
of a few MiB each (PaTH's walk over the chunks, the MLP's activations, recomputed layer by layer under activation
checkpointing); once the threshold has risen they come from the heap, and what the step frees stays resident, cut
into pieces between the blocks still alive. Measured on SmolLM2-135M at a 4096-token distill step
(`bench/distill_memory.py`, BENCHMARKS.md), that fragmentation, not live tensors, is most of the peak resident memory.

`return_freed_memory` fixes the threshold (which also stops it rising), so that every block of at least
`MMAP_THRESHOLD` bytes is mapped on its own and returned when freed. A threshold set by the user in the environment
(`MALLOC_MMAP_THRESHOLD_`, read by glibc at start) is left as it is; on other C libraries this does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
MMAP_THRESHOLD = 1 << 20  # bytes: a block of a few MiB is returned when freed; small ones stay in the heap


def return_freed_memory(threshold: int = MMAP_THRESHOLD) -> bool:
    """Fix glibc's mmap threshold at `threshold` bytes for this process. Returns whether it was set (False: not
    glibc, or `MALLOC_MMAP_THRESHOLD_` already set in the environment)."""
    if not sys.platform.startswith("linux") or "MALLOC_MMAP_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, threshold) == 1
