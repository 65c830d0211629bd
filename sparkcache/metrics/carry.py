"""Counters that stay monotonic across a worker's restart.

A worker's stats record counts from zero in every process. When the supervisor sees a
worker's process exit it folds that process's last record into the worker's ``Carry``
(the slot still holds it: the next process is spawned only after the backoff, and writes
its own record only once started). A reader adds the carry to the live record's totals,
unless the record it read is one already folded (same pid and start time), so a scrape
between the exit and the restart counts the dead process once, not twice.

The fold replaces one tuple attribute, so a reader in another thread (the HTTP server's)
sees the totals and the folded pids of the same moment without a lock.
"""

from __future__ import annotations

from collections.abc import Mapping

from sparkcache.shm.layouts import DROP_REASONS, DURATION_BUCKETS_S, OUTCOMES, READ_PATHS

# Cumulative fields of shm.layouts.WORKER_STATS (each counts up from 0 in a new process).
COUNTER_FIELDS: tuple[str, ...] = (
    "processed", "failed", "item_errors", "copy_bytes", "copy_seconds", "roots_superseded",
    "lock_wait_s", "evicted_roots", "cut_roots", "skipped_roots", "reclaimed_bytes",
    "collected_objects", "collected_bytes", "io_bytes", "refused_s", "yielded_roots",
    "yielded_bytes", "read_releases", "read_yielded_roots", "disk_full", "fleet_bad_pages",
    *(f"drop_{reason}" for reason in DROP_REASONS),
    *(f"outcome_{n}" for n in range(OUTCOMES)),
    "dur_count", "dur_sum_s",
    *(f"dur_le_{i}" for i in range(len(DURATION_BUCKETS_S))),
    *(f"read_bytes_{path}" for path in READ_PATHS),
)

Incarnation = tuple[int, float]  # (pid, start time) of one worker process


class Carry:
    """The totals of one worker's dead processes."""

    def __init__(self) -> None:
        self._state: tuple[dict[str, float], frozenset[Incarnation]] = (
            dict.fromkeys(COUNTER_FIELDS, 0), frozenset(),
        )

    def fold(self, record: tuple) -> None:
        """Add the totals of ``record`` (a WORKER_STATS named tuple), the last record of a
        process that has exited; a record folded before is ignored."""
        totals, folded = self._state
        who = (int(record.pid), float(record.pid_start))
        if who in folded:
            return
        added = {name: totals[name] + getattr(record, name) for name in COUNTER_FIELDS}
        self._state = (added, folded | {who})

    def totals(self, live: tuple | None) -> Mapping[str, float]:
        """Every counter of the worker: the dead processes' plus ``live``'s (the record
        read from the slot, or None), unless ``live`` is one of the dead already folded."""
        totals, folded = self._state
        if live is None or (int(live.pid), float(live.pid_start)) in folded:
            return totals
        return {name: totals[name] + getattr(live, name) for name in COUNTER_FIELDS}
