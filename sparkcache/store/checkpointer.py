"""Checkpoints of the index's WAL on a thread of their own, for the workers that write.

SQLite checkpoints on the connection whose COMMIT takes the WAL past 1,000 pages, inside
that COMMIT. A commit of a few hundred pages dirties a leaf of the objects table and of
the ``root_pages_key`` index per page (their keys are random), so nearly every commit of
the mission's turns did it: the COMMIT of a batch of three 2k-8k-token turns took
~125 ms with the checkpoint and ~55 ms without it (960 new pages over 120,000,
in-process, measured for this change). And once the commit worker stopped checkpointing,
maintenance's COMMITs did it instead, inside an eviction's transaction, which holds the
lookup gate: lookups missed as ``evicting`` meanwhile. So the workers' connections
never checkpoint (``wal_autocheckpoint=0``); a thread of each runs a ``PASSIVE``
checkpoint (it never blocks a writer or a reader; with nothing new it does nothing) on
its own connection every ``INTERVAL_S``. Other writers (the CLI) keep SQLite's default.

A checkpoint's failed fsync of the index is what it is at a COMMIT (docs/store.md, "A
failed fsync of the index"): ``failure`` holds it, the thread stops, and the store's next
commit fails with it, which stops the commit worker.
"""

from __future__ import annotations

import logging
import sqlite3
import threading
from pathlib import Path

from sparkcache.store import index

log = logging.getLogger(__name__)

INTERVAL_S = 0.5


class Checkpointer:
    """A thread that checkpoints the index at ``path`` every ``INTERVAL_S``."""

    def __init__(self, path: Path, busy_timeout_ms: int) -> None:
        self._path = path
        self._busy_timeout_ms = busy_timeout_ms
        self._stopping = threading.Event()
        self._warned = False
        self.checkpoints = 0
        self.failure: sqlite3.Error | None = None  # a failed fsync: no checkpoint since
        self._thread = threading.Thread(target=self._run, name="sparkcache-checkpoint",
                                        daemon=True)
        self._thread.start()

    def close(self) -> None:
        """Stop the thread after one last checkpoint."""
        self._stopping.set()
        self._thread.join()

    def _run(self) -> None:
        # A connection belongs to the thread that made it.
        conn = sqlite3.connect(self._path, isolation_level=None,
                               timeout=self._busy_timeout_ms / 1000)
        try:
            while self.failure is None:
                stopping = self._stopping.wait(INTERVAL_S)
                self._checkpoint(conn)
                if stopping:
                    return
        finally:
            conn.close()

    def _checkpoint(self, conn: sqlite3.Connection) -> None:
        try:
            conn.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchall()
            self.checkpoints += 1
        except sqlite3.Error as exc:
            if index.sync_failed(exc):
                log.error("an fsync of the index %s failed at a checkpoint: %s", self._path, exc)
                self.failure = exc
                return
            # The next writer's COMMIT-time checkpoint or the next nudge tries again; a
            # WAL not checkpointed only grows, it loses nothing.
            if not self._warned:
                log.warning("checkpoint of the index %s failed: %s", self._path, exc)
                self._warned = True
