from collections.abc import Iterator

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # The references run thousands of tiny matmuls: on a loaded 2-core machine two OpenMP threads make each of
    # them ~70x slower than one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
