"""How often each stage of the torch backend ran, read off `torch.profiler`: every stage of path_hf's ops files runs
in a `record_function` range of its own (`path_attention.walk`, `path_attention.next_keys`, ...; ops_chunk.py lists
them), which the profiler records with the aten ops."""

import contextlib
from collections import Counter
from collections.abc import Iterator

from torch.profiler import ProfilerActivity, profile


@contextlib.contextmanager
def counted_ranges() -> Iterator[Counter]:
    """The profiler ranges and aten ops that ran in the block, counted by name (filled in when the block ends)."""
    counts: Counter[str] = Counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        yield counts
    counts.update(event.name for event in prof.events())
