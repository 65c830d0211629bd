"""SIGTERM ends an engine-side command (the demo, the soak) as Ctrl-C does: a SystemExit
raised from the handler unwinds through the finally blocks that unlink the engine's KV
segment and stop what it started. Python's default would end the process at once and
leave them behind. Ctrl-C (SIGINT) still raises KeyboardInterrupt, but through the same
handler, so that it too is recorded.

A handler's exception is raised wherever the main thread happens to be, and C code
there may lose it: a SystemExit raised while numpy.random's Cython modules are being
imported can be swallowed, or surface as an ImportError (numpy 2, Python 3.11; the
demo's SIGTERM test hung 4 times in 44 runs so). So the handler also records the
signal, and the commands' loops call ``exit_if_signalled`` to finish an exit that was
lost. Python's own SIGINT handler keeps no such record: a soak run to its end, exit 0,
after a Ctrl-C that landed in that import. Measured (2026-12-04, a SIGINT sent 0-30 ms
into a process's ``import numpy.random``, 150 runs each): with Python's handler 8 lost and
1 ImportError; with this one 9 lost and recovered at the check after the import, 3
ImportErrors. So the commands also import numpy.random before installing it.
"""

from __future__ import annotations

import signal

_received: int | None = None


def _exit_for(signum: int) -> BaseException:
    # Ctrl-C stays what Python makes of it: the CLI reports it as any Ctrl-C ("Aborted!").
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


def exit_on_signal(signum: int, frame: object) -> None:
    """A signal handler: remember the signal, then unwind through the finally blocks
    (exit 128+N; KeyboardInterrupt for SIGINT)."""
    global _received
    _received = signum
    raise _exit_for(signum)


def install(*signums: int) -> None:
    """Make each of ``signums`` end this process through ``exit_on_signal``, forgetting a
    signal received before."""
    global _received
    _received = None
    for signum in signums:
        signal.signal(signum, exit_on_signal)


def exit_if_signalled() -> None:
    """Raise again what ``exit_on_signal`` raised for a signal it received, if any
    (SystemExit, or KeyboardInterrupt for SIGINT): it may have been lost in C code."""
    if _received is not None:
        raise _exit_for(_received)
