"""Imported once, in the supervisor's fork server, before it forks the workers that need
torch (capture and restore): each of them then starts in a fraction of a second instead
of importing torch afresh (~2.5 s of CPU on a small host, at every start and every
restart, while the engine's publications meanwhile are skipped).

Forking after ``import torch`` is safe: importing starts no thread pool and no CUDA
context (the first use does, in the worker). Commit and maintenance never need torch and
are still spawned (``sparkcache.supervisor``).

The fork server must outlive a SIGTERM sent to the whole process group (a service
manager stopping the unit): it would die, and its workers with it (their parent-death
signal) in the middle of their drain, which the supervisor orders. A worker forked from
here, hit by the same SIGTERM before it installed its own handler, dies of it as a
spawned one would."""

from __future__ import annotations

import gc
import os
import signal

import setproctitle
import torch  # noqa: F401  the import this module exists to pay once
from sparkcache.workers import capture, restore  # noqa: F401
from sparkcache.workers.lifecycle import die_with_parent

from sparkcache import kvmem  # noqa: F401

TITLE = "sparkcache::forkserver"
_SERVER_PID = os.getpid()


def _on_sigterm(signum: int, frame: object) -> None:
    if os.getpid() != _SERVER_PID:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


setproctitle.setproctitle(TITLE)
# Die with the supervisor, so that its forked workers die with it too (their own
# parent-death signal is tied to this process). Left to itself the fork server lives as
# long as any process it forked holds its end of a pipe, and those wait for it to die.
# A supervisor that died before this took effect ends the fork server all the same: it
# exits once no process holds that pipe, and it has forked none yet.
die_with_parent()
signal.signal(signal.SIGTERM, _on_sigterm)
# What the imports above made lives as long as any worker: out of the collector's reach
# (the permanent generation), so that a forked worker's first full collection neither
# walks it nor, by writing each object's collector header, copies every heap page it
# shares with this process. Measured: that collection ran inside the restore worker's
# first load, ~85 ms of CPU (docs/pipeline.md).
gc.collect()
gc.freeze()
