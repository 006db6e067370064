# Copyright 2026 The path-hf authors. Apache-2.0.
"""How path-hf reacts to Ctrl-C and SIGTERM (what `kill`, `timeout` and job schedulers send), written once.

Two policies share one mechanism, `handling_signals`:
- the commands (`path-hf convert`, `eval`, `serve`) stop at once: SIGTERM raises `KeyboardInterrupt` as Ctrl-C does,
  so that the same cleanups run (`sigterm_as_interrupt`);
- the training loop stops at the end of a step, after a checkpoint: the signal is only recorded (`StopRequest`).
"""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


@contextmanager
def handling_signals(handler: Callable[[int], None], signums: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Within the block, each of `signums` calls `handler(signum)`; the previous handlers come back on exit. Only the
    main thread receives signals: elsewhere this does nothing."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, lambda signum, frame: handler(signum)) for signum in signums}
    try:
        yield
    finally:
        for signum, old in previous.items():
            signal.signal(signum, signal.SIG_DFL if old is None else old)


def sigterm_as_interrupt() -> AbstractContextManager[None]:
    """Within the block, SIGTERM raises `KeyboardInterrupt` as Ctrl-C does, so that the same cleanups run; a second
    SIGTERM during them is ignored."""

    def interrupt(signum: int) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        raise KeyboardInterrupt

    return handling_signals(interrupt, (signal.SIGTERM,))


class StopRequest:
    """While entered, SIGTERM and Ctrl-C set `signal` instead of stopping the process: the training loop checkpoints
    at the end of the step and exits. The previous handlers come back on exit."""

    def __init__(self) -> None:
        self.signal: int | None = None
        self._handling = handling_signals(self._record)

    def __enter__(self) -> StopRequest:
        self._handling.__enter__()
        return self

    def __exit__(self, *exc_info) -> None:
        self._handling.__exit__(*exc_info)

    def _record(self, signum: int) -> None:
        self.signal = signum
