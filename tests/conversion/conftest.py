import os
from collections.abc import Iterator

os.environ["HF_HUB_OFFLINE"] = "1"  # before huggingface_hub is imported: the tests never touch the network

import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread() -> Iterator[None]:
    # Tiny matmuls on a shared 2-core machine run faster on one thread.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
