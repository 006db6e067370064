import faulthandler
import os
from collections.abc import Iterator

# Before huggingface_hub / datasets are imported: the tests never touch the network.
os.environ["HF_HUB_OFFLINE"] = "1"
os.environ["HF_DATASETS_OFFLINE"] = "1"

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # The tests run thousands of tiny matmuls: on a shared 2-core machine two OpenMP threads wait for each other
    # whenever another process holds a core, and each product gets up to ~70x slower than on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# Past this, a test is taken for hung: longer than any test's own limit on the programs it launches
# (tests/processes.py).
HUNG_AFTER_SECONDS = float(os.environ.get("PATH_HF_TEST_HUNG_AFTER", 1800))
_stderr: int | None = None  # pytest's own stderr: a test's output is captured elsewhere


def pytest_configure(config: pytest.Config) -> None:
    global _stderr
    _stderr = os.dup(2)  # no capture runs between the conftests' loading and the first test


@pytest.fixture(autouse=True)
def hang_guard() -> Iterator[None]:
    # A test still running after HUNG_AFTER_SECONDS prints every thread's traceback (without the GIL, which a hang
    # may hold) and ends pytest with an error: CI fails saying where it hung instead of hanging.
    faulthandler.dump_traceback_later(HUNG_AFTER_SECONDS, exit=True, file=_stderr if _stderr is not None else 2)
    yield
    faulthandler.cancel_dump_traceback_later()
