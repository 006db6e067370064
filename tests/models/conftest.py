import pytest
import torch


@pytest.fixture(autouse=True)
def single_thread():
    """Tiny models run fastest on one thread, and the CI machine is shared: no oversubscription."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
