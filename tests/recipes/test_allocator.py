"""`return_freed_memory` (recipes/allocator.py): freed blocks of a few MiB go back to the system at once, where
glibc's dynamic mmap threshold would have kept them in its heap, pinned between blocks still alive."""

import os
import subprocess
import sys

import pytest

PROBE = """
import sys
import torch
from path_hf.recipes.allocator import return_freed_memory

def rss_mib():
    status = dict(line.split(":", 1) for line in open("/proc/self/status"))
    return int(status["VmRSS"].split()[0]) / 1024

if sys.argv[1] == "returned":
    assert return_freed_memory()
big = torch.ones(16 << 20, dtype=torch.uint8)
del big  # a mapped block of 16 MiB freed: glibc's dynamic threshold rises to it
blocks, pins = [], []
for _ in range(100):
    blocks.append(torch.ones(4 << 20, dtype=torch.uint8))  # 400 MiB in blocks of 4 MiB
    pins.append(torch.ones(64 << 10, dtype=torch.uint8))  # blocks that stay alive between them
before = rss_mib()
del blocks
print(before - rss_mib())
"""


def released_mib(mode: str) -> float:
    env = {key: value for key, value in os.environ.items() if key != "MALLOC_MMAP_THRESHOLD_"}
    done = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    return float(done.stdout)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator (Linux): elsewhere it does nothing")
def test_freed_blocks_are_returned_to_the_system():
    assert released_mib("default") < 100  # the heap keeps them
    assert released_mib("returned") > 380


def test_a_threshold_set_by_the_user_is_kept(monkeypatch):
    from path_hf.recipes.allocator import return_freed_memory

    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "131072")
    assert return_freed_memory() is False
