"""SIGTERM ends an engine-side command (the demo, the soak) as Ctrl-C does: a SystemExit
raised from the handler unwinds through the finally blocks that unlink the engine's KV
segment and stop what it started. Python's default would end the process at once and
leave them behind.

A handler's exception is raised wherever the main thread happens to be, and C code
there may lose it: a SystemExit raised while numpy.random's Cython modules are being
imported can be swallowed, or surface as an ImportError (numpy 2, Python 3.11; the
demo's SIGTERM test hung 4 times in 44 runs so). So the handler also records the
signal, and the commands' loops call ``exit_if_signalled`` to finish an exit that was
lost.
"""

from __future__ import annotations

import signal

_received: int | None = None


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler: remember the signal, then exit 128+N through the finally blocks."""
    global _received
    _received = signum
    raise SystemExit(128 + signum)


def install(signum: int = signal.SIGTERM) -> None:
    """Make ``signum`` end this process through ``exit_on_signal``, forgetting a signal
    received before."""
    global _received
    _received = None
    signal.signal(signum, exit_on_signal)


def exit_if_signalled() -> None:
    """Raise the SystemExit of a signal ``exit_on_signal`` received, if any: the exit its
    handler raised may have been lost in C code."""
    if _received is not None:
        raise SystemExit(128 + _received)
