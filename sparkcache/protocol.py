"""What the client and the workers say to each other through the rings, defined once:
capture's completion statuses, commit's durability statuses, restore's load statuses,
the kinds of request the engine sends maintenance, when a worker counts as alive, and
when a process is known to be gone.

The record layouts themselves are in ``shm/layouts.py``; this module gives their numbers
a meaning.
"""

from __future__ import annotations

import os
import time
from enum import IntEnum

from sparkcache.workers.lifecycle import State


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


class LoadStatus(IntEnum):
    """LOADED.status: what the restore worker did with a load. Every value means the
    worker writes nothing more into the load's blocks; ``pages`` says how many leading
    pages it verified and wrote (0 unless stated)."""

    OK = 0  # every page asked for
    PARTIAL = 1  # the store held only the first ``pages`` of them
    CORRUPT = 2  # page ``bad_index`` (== pages) failed verification; never written
    UNREGISTERED = 3  # its registration generation is not the current one
    BAD_BLOCK = 4  # a block id outside the registered geometry; nothing written
    FAILED = 5  # an error while loading (logged by the worker); ``pages`` were written
    MALFORMED = 6  # its records did not pass validation (counted by reason in the stats)
    STALE = 7  # addressed to another restore worker (a dead predecessor); nothing written


class RequestKind(IntEnum):
    """REQUEST.kind: what the engine asks maintenance to write for it."""

    TOUCH = 1
    LEASE = 2
    QUARANTINE = 3
    RELEASE = 4  # the read a LEASE protected is over (docs/maintenance.md)


def new_lease_id() -> int:
    """A read lease's id, named by the lookup that takes it and the release that ends it:
    63 random bits, so that two reads in flight share one with odds of about n^2 / 2^64
    (a shared id would let one read's release end the other's lease early: its load
    would miss, never read wrong bytes). Never 0, which names no lease."""
    return int.from_bytes(os.urandom(8), "little") >> 1 | 1


def release_seconds(timeout_s: float, publication_bytes: int, arena_bytes: int,
                    ahead_bytes: int = 0) -> float:
    """How long the engine lends a publication's blocks to capture: ``timeout_s``
    (``release_timeout_seconds``) for each arena's worth of its pages and of the pages
    lent before it and not yet given back (``ahead_bytes``). Capture copies a
    publication larger than its slots a slot at a time, each after commit has written one
    before it (docs/pipeline.md, "Publications in parts"), and publications in order, so
    a fixed timeout would expire every publication past a few slots long, and one queued
    behind another of gigabytes; this one assumes commit writes an arena's bytes within
    ``timeout_s``. The client sets the deadline with the pages it has lent ahead (at most
    ``segments.PUBLISH_AHEAD_MAX_PAGES``); capture refuses one later than the bound with
    that most ahead."""
    arenas = -(-max(publication_bytes + ahead_bytes, 1) // max(arena_bytes, 1))
    return timeout_s * arenas


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
