"""The one way path-hf handles Ctrl-C and SIGTERM (`path_hf.signals`): the commands' policy (SIGTERM raises
KeyboardInterrupt) and the training loop's (the signal is recorded), each with the handlers restored afterwards, and
neither touching signals outside the main thread. The signals are real: sent to this process with `os.kill`."""

import os
import signal
import threading

import pytest

from path_hf.signals import StopRequest, handling_signals, sigterm_as_interrupt


def send(signum: int) -> None:
    os.kill(os.getpid(), signum)  # Python runs the handler before the next bytecode of this thread


def test_sigterm_raises_keyboard_interrupt_and_the_handler_comes_back():
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            send(signal.SIGTERM)
    assert signal.getsignal(signal.SIGTERM) == before


def test_a_second_sigterm_during_the_cleanup_is_ignored():
    cleaned = []
    with pytest.raises(KeyboardInterrupt):
        with sigterm_as_interrupt():
            try:
                send(signal.SIGTERM)
            finally:
                send(signal.SIGTERM)  # would raise again, or kill the process, if not ignored
                cleaned.append(True)
    assert cleaned == [True]


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_stop_request_records_the_signal_and_does_not_stop(signum):
    before = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    with StopRequest() as stop:
        assert stop.signal is None
        send(signum)
        assert stop.signal == signum  # recorded; the block goes on
    assert {s: signal.getsignal(s) for s in before} == before


def test_handling_signals_does_nothing_outside_the_main_thread():
    seen = []

    def worker():
        with handling_signals(lambda signum: seen.append(signum)):
            seen.append(signal.getsignal(signal.SIGTERM))

    before = signal.getsignal(signal.SIGTERM)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join()
    assert seen == [before]  # no handler installed (signal.signal would raise ValueError there)
