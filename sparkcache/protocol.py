"""What the client and the workers say to each other through the rings, defined once:
capture's completion statuses, commit's durability statuses, the kinds of request the
engine sends maintenance, and when a worker counts as alive.

The record layouts themselves are in ``shm/layouts.py``; this module gives their numbers
a meaning.
"""

from __future__ import annotations

import time
from enum import IntEnum

from workers.lifecycle import State


class CaptureStatus(IntEnum):
    """COMPLETION.status: what capture did with a publication. Every value releases the
    publication's blocks; only CAPTURED means a copy went on to commit."""

    CAPTURED = 0
    EXPIRED = 1  # its deadline passed before (or while) it was copied
    UNREGISTERED = 2  # its registration generation is not the current one
    BAD_BLOCK = 3
    NO_SLOT = 4
    TOO_LARGE = 5
    FAILED = 6  # an error while copying (logged by capture)
    MALFORMED = 7  # its records did not pass validation (counted by reason in the stats)


class DurableStatus(IntEnum):
    """DURABLE.status: whether a captured publication's root reached the store."""

    DURABLE = 0  # the root's index transaction committed
    COMMIT_FAILED = 1  # the store refused it (disk full, a relied-on page vanished...)
    BAD_SLOT = 2  # the slot did not hold a readable publication


class RequestKind(IntEnum):
    """REQUEST.kind: what the engine asks maintenance to write for it."""

    TOUCH = 1
    LEASE = 2
    QUARANTINE = 3


def status_name(enum: type[IntEnum], value: int) -> str:
    """``captured``, ``commit_failed``...; an unknown number is named as such, never raised."""
    try:
        return enum(value).name.lower()
    except ValueError:
        return f"unknown_{value}"


def worker_alive(report: tuple | None, stale_after_s: float, now: float | None = None) -> bool:
    """True if a worker's stats report says READY with a heartbeat fresher than
    ``stale_after_s``: the one test of liveness the client and the supervisor share."""
    if report is None:
        return False
    now = time.time() if now is None else now
    return report.state == State.READY and now - report.heartbeat < stale_after_s
