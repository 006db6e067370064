from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conversion.checkpoints import make_source


@pytest.fixture(autouse=True)
def fresh_accelerator_state() -> Iterator[None]:
    """Each in-process run builds its own Accelerator: forget the previous one's singletons."""
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(reset_partial_state=True)
    GradientState._reset_state()


@pytest.fixture(scope="session")
def tiny_source(tmp_path_factory) -> Path:
    """A tiny random Llama (3 layers, hidden 64, vocab 256) with a word-level tokenizer of the test text."""
    return make_source(tmp_path_factory.mktemp("source") / "llama", "llama", tokenizer=True)
