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
