"""sparkcache.exit_signal: a SIGTERM ends an engine-side command through its finally
blocks, and an exit that C code lost is finished at the next check."""

from __future__ import annotations

import os
import signal

import pytest

from sparkcache import exit_signal


@pytest.fixture
def restore_sigterm():
    old = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    yield
    for sig, handler in old.items():
        signal.signal(sig, handler)


def test_a_sigterm_unwinds_with_exit_143(restore_sigterm):
    exit_signal.install(signal.SIGTERM)
    unwound = []
    with pytest.raises(SystemExit) as exc:
        try:
            os.kill(os.getpid(), signal.SIGTERM)  # runs the handler before it returns
        finally:
            unwound.append(True)
    assert exc.value.code == 128 + signal.SIGTERM
    assert unwound == [True]


def test_an_exit_lost_in_between_is_raised_at_the_next_check(restore_sigterm):
    exit_signal.install(signal.SIGTERM)
    exit_signal.exit_if_signalled()  # nothing received: no exit
    try:
        os.kill(os.getpid(), signal.SIGTERM)
    except SystemExit:
        pass  # what numpy.random's Cython import does with it, about one time in ten
    with pytest.raises(SystemExit) as exc:
        exit_signal.exit_if_signalled()
    assert exc.value.code == 128 + signal.SIGTERM
    # Installing afresh forgets it: an in-process soak run after a stopped one.
    exit_signal.install(signal.SIGTERM)
    exit_signal.exit_if_signalled()


def test_a_lost_ctrl_c_is_raised_as_one_at_the_next_check(restore_sigterm):
    """Python's own SIGINT handler keeps no record: a KeyboardInterrupt lost in that
    import let a soak run to its end and exit 0."""
    exit_signal.install(signal.SIGTERM, signal.SIGINT)
    try:
        os.kill(os.getpid(), signal.SIGINT)
    except KeyboardInterrupt:
        pass  # lost
    with pytest.raises(KeyboardInterrupt):
        exit_signal.exit_if_signalled()
