"""``PageStore``: the durable page store of one rank, used in-process.

Commit protocol (invariants 1 and 3 of the design brief; details in docs/store.md):
  1. read which page keys the index already holds live (the rest is the page delta);
  2. ``ObjectWriter`` writes each delta page to ``<key>.<gen>.tmp`` (its writeback started
     at once) and renames it to ``<key>.<gen>``, then makes every file and name durable
     with one ``syncfs``, on the sync thread;
  3. meanwhile ``BEGIN IMMEDIATE``; re-check every key: one this commit relied on but did
     not write that is no longer live (collected meanwhile), or one it wrote whose file is
     gone (swept by a concurrent reconcile), rolls back and goes round again for those
     keys; then rows for our files, the root (with its lease), its pages and references,
     and the roots it supersedes (its prefixes) dropped; or, if a stored root extends it,
     only that root's lease renewed; the sync waited for, then ``COMMIT`` (fsynced WAL).
     Only then is the root acknowledged.
Several publications commit as one batch (``commit_batch``): steps 1 and 2 for each, one
sync, one transaction, all or none.
Any failure before the COMMIT unlinks every file this commit wrote; earlier roots are
untouched. Superseding in the same transaction is crash-safe for the same reason: before
the COMMIT the superseded roots are all there, after it the new root holds every page they
held, so none of those pages ever has no reference.

Eviction protocol (invariant 2): ``evict`` cuts roots from their end within a slice's
budget, in lease order (unleased roots least recently used first, then the oldest
conversation leases; never a root under a read lease), in one transaction that re-checks
them (``store/eviction.py``; unsynced: a power cut may undo it whole, never part of it;
``select_victims`` and ``remove_roots`` are the unbounded primitives); ``collect`` deletes
unreferenced object rows in one durable transaction (which makes every earlier one durable
too) and only then removes exactly those ``<key>.<generation>`` files: into the pool of
files commits overwrite (``store/pool.py``) while it has room, else unlinked.

A store instance belongs to one process: open a new one after fork.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import sqlite3
import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass, field
from pathlib import Path

from sparkcache.identity import require_hex, require_keys
from sparkcache.store import eviction, index, recovery
from sparkcache.store.checkpointer import Checkpointer
from sparkcache.store.eviction import RECORD, ROW, SYNC, TXN, UNLINK, Budget, EvictionPlan
from sparkcache.store.fileops import FileOps, StepHook, no_hook
from sparkcache.store.gate import LookupGate
from sparkcache.store.known_roots import KnownRoots
from sparkcache.store.layout import (
    DIR_FLAGS,
    FILE_MODE,
    RankLayout,
    fanout,
    object_name,
    open_subdir,
)
from sparkcache.store.objects import (
    HEADER_SIZE,
    ObjectCorrupt,
    open_object,
    record_span,
    verify_file,
)
from sparkcache.store.pool import FilePool
from sparkcache.store.reader import QUARANTINED_KEYS, StoreReader
from sparkcache.store.records import (
    ROOT_ID_HEX_LEN,
    CollectResult,
    CommitFailed,
    CommitResult,
    EvictResult,
    PageData,
    Publication,
    ReconcileResult,
    RemoveResult,
    Root,
    StoreError,
    Usage,
)
from sparkcache.store.space import Space, space_of
from sparkcache.store.writer import ObjectWriter, WrittenFile

log = logging.getLogger(__name__)

DEFAULT_LEASE_SECONDS = 300.0
# Read lease ``?1`` taken at ``?2`` until ``?3`` on the roots holding page ``?5`` with key
# ``?4`` (chained keys: the prefix and every root extending it); the same lease taken
# again (an answer given again) runs to the later end.
_READ_LEASE_SQL = (
    "INSERT INTO reads SELECT root_id, ?1, ?2, ?3 FROM root_pages WHERE key = ?4 AND pos = ?5 "
    "ON CONFLICT(root_id, lease) DO UPDATE SET taken = max(taken, excluded.taken), "
    "until = max(until, excluded.until)"
)
_RELEASE_SQL = "DELETE FROM reads WHERE lease = ?"
_QUARANTINE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# A record collected from a pack that other rows still name is not punched at once: the
# rest of its pack usually follows within a few slices (eviction cuts a root from its
# end), and a pack that goes whole is pooled with its blocks for a commit to overwrite,
# where punching would free them, and a filesystem mounted with discard discards them in
# the journal commits that commits' syncs wait for: with every record punched at once,
# commits at the cap ran 2.6x an empty store's p99 and the disk discarded all 80 MB/s
# reclaimed (docs/store.md, "Packs"). A pack still named this long after its first
# record went has its dead records punched.
PUNCH_DELAY_S = 10.0
# A collected file the pool does not take, if larger than this, is removed in two units
# of a slice's budget after the one that collected it (``_shrink_waiting``): its back
# half cut off, then the rest unlinked (in pieces of a slice's byte budget where half is
# more); a smaller one is unlinked in the unit itself.
# On a filesystem mounted with online discard, freeing blocks discards them there and
# then: on this guest's ext4 (discard, no journal) unlinking a 4 MiB pack took 3.2 ms at
# p50 on an idle disk against 0.37 ms without discard, and 38-40 ms inside a slice beside
# the commits of scripts/bench_maintenance.py, twice the slice's budget. Halves, not
# smaller steps: a 32 MiB pack cut 1 MiB (or 4 MiB) at a time left the next pack written
# slower to read cold, with or without discard; cut in two it did not (docs/store.md,
# "Recycled files").
HALVE_ABOVE_BYTES = 1 << 20
DEFAULT_GRACE_SECONDS = 60.0
# SQLite virtual-machine instructions between two calls of a long statement's progress
# handler (``check_index``): ~2.5 ms of a quick_check on this guest.
PROGRESS_OPS = 100_000
# A batch that wrote more syncs before its transaction begins, not during it: a sync of a
# capture slot's 240 MiB took up to 1 s at the cap, and maintenance's slices waited that
# long for the write lock (2.7 s at most in one mission run with every batch overlapped).
OVERLAP_MAX_BYTES = 128 << 20
# The least time a staged page (``stage``) is kept from collection, whatever the lease.
MIN_STAGE_HOLD_S = 60.0


@dataclass
class StoreCounters:
    """Process-local counters; the metrics layer reads them."""

    commits: int = 0
    stages: int = 0  # chunks of publications larger than a capture slot (``stage``)
    commits_failed: int = 0
    commit_retries: int = 0
    quarantined: int = 0
    missing_files: int = 0
    roots_superseded: int = 0
    commits_covered: int = 0
    # Time commits waited for the index's write lock (held by maintenance, a capture's
    # lease, another writer): the sum and the longest wait.
    lock_wait_s: float = 0.0
    lock_wait_max_s: float = 0.0
    read_releases: int = 0  # releases of read leases written (``record_release``)

    def waited(self, seconds: float) -> None:
        """A commit's wait for the write lock."""
        self.lock_wait_s += seconds
        self.lock_wait_max_s = max(self.lock_wait_max_s, seconds)


@dataclass
class _Deferred:
    """A pack whose collected records wait for their punch: since when, and their bytes."""

    since: float
    bytes: int = 0


@dataclass(frozen=True)
class _Placement:
    """What a commit's transaction did with its root (see ``PageStore._place_root``)."""

    superseded: int  # roots of other ids taken over because the new root extends them
    covered: bool  # a stored root extends the new one: no root was created
    # The root row that holds the publication's pages now (id, created), and how many of
    # its leading rows it had before (0: a new root); None if covered or staged.
    holder: tuple[str, float] | None = None
    kept: int = 0
    # Reference changes for the caller to apply (``_add_refs``), netted.
    refs: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True)
class _HeldPrefix:
    """The leading pages of a publication one root holds live (``_held_live_prefix``),
    and which root row that is: its id and ``created`` (a root deleted and stored again
    under the same id is another row)."""

    pages: int = 0
    root_id: str = ""
    created: float = 0.0


@dataclass(eq=False)
class _Pending:
    """One publication of a batch (``commit_batch``): what its commit looked at, wrote
    and did so far."""

    pub: Publication
    keys: list[str]
    pages: dict[str, PageData]
    data: dict[str, list[memoryview]] = field(default_factory=dict)  # keys looked at
    written: dict[str, WrittenFile] = field(default_factory=dict)  # key -> its file
    surplus: list[str] = field(default_factory=list)  # written, stored first by another
    held: _HeldPrefix = field(default_factory=_HeldPrefix)
    placement: _Placement | None = None

    @classmethod
    def of(cls, pub: Publication) -> _Pending:
        return cls(pub, [p.key for p in pub.root.pages], {p.key: p for p in pub.root.pages})


def _names(batch: list[_Pending]) -> str:
    return ", ".join(item.pub.root.root_id for item in batch)


class _Conflict(Exception):
    """Keys a commit relied on were collected before its transaction; roll back, retry."""

    def __init__(self, keys: set[str]) -> None:
        super().__init__(f"{len(keys)} keys vanished")
        self.keys = keys


def _location(key: str, file: WrittenFile) -> tuple[str | None, int]:
    """The row's ``(file_key, file_offset)`` of page ``key``'s record in ``file``: NULL and
    0 for an object file of its own."""
    return (file.key if file.packed else None), file.records[key][0]


class PageStore:
    """Objects, index and protocols of ``<store_dir>/rank-<rank>``."""

    def __init__(
        self,
        store_dir: Path | str,
        rank: int,
        *,
        lease_seconds: float = DEFAULT_LEASE_SECONDS,
        create: bool = True,
        fileops: FileOps | None = None,
        hook: StepHook = no_hook,
        clock: Callable[[], float] = time.time,
        touch_batch: int = 64,
        touch_interval_s: float = 1.0,
        max_retries: int = 8,
        durable: bool = True,
        pool_bytes: int = 0,
        halve_above: int = HALVE_ABOVE_BYTES,
        checkpoint_thread: bool = False,
    ) -> None:
        if rank < 0:
            raise ValueError(f"rank {rank!r} must be >= 0")
        self.layout = RankLayout(Path(store_dir), rank)
        self.layout.prepare(create)
        self.lease_seconds = lease_seconds
        # A staged chunk's root follows within its publication's deadline; the lease is
        # what protects a new root, and the floor keeps a zero lease from collecting the
        # chunks of a publication still being captured.
        self.stage_hold_s = max(lease_seconds, MIN_STAGE_HOLD_S)
        self.counters = StoreCounters()
        self._ops = fileops or FileOps()
        self._hook = hook
        self._clock = clock
        self._touch_batch = touch_batch
        self._touch_interval_s = touch_interval_s
        self._max_retries = max_retries
        self._touches: dict[tuple[str, int], float] = {}  # (key, pos) -> when accessed
        # (key, pos, lease) -> (taken, protected until)
        self._leases: dict[tuple[str, int, int], tuple[float, float]] = {}
        self._releases: set[int] = set()  # read leases whose read is over
        self._touches_since = 0.0
        # Rows collection deleted whose records it has yet to remove:
        # (key, generation, bytes, file_key, file_offset).
        self._unlinking: deque[tuple[str, str, int, str | None, int]] = deque()
        # Rows a slice's collection deleted without an fsync: their records wait for the
        # index to be synced (``sync_collected``), then join ``_unlinking``.
        self._unsynced: list[tuple[str, str, int, str | None, int]] = []
        # Collected files the pool did not take, being removed in halves
        # (HALVE_ABOVE_BYTES): [key, generation, bytes left, bytes the first step cuts].
        self._shrinking: deque[list] = deque()
        self._halve_above = halve_above
        # Packs with records collected and not yet punched: name -> when the first went,
        # and the bytes of those records (disk space the rows no longer count).
        self._deferred: dict[tuple[str, str], _Deferred] = {}
        self._objects_fd = os.open(self.layout.objects_dir, DIR_FLAGS)
        self._quarantine_fd = os.open(self.layout.quarantine_dir, DIR_FLAGS)
        # Collection pools up to pool_bytes of its files; commits take pooled files
        # whatever this process's cap (store/pool.py). An older store opened without
        # create has no free directory, and then no pool.
        self._free_fd = -1
        self._pool: FilePool | None = None
        if os.path.lexists(self.layout.free_dir):
            self._free_fd = os.open(self.layout.free_dir, DIR_FLAGS)
            self._pool = FilePool(self._ops, self._free_fd, pool_bytes)
        self._writer = ObjectWriter(self._ops, hook, self._objects_fd, self._pool)
        self._known = KnownRoots()
        try:
            # Created by any writer, so an older store gains it on its next open.
            self.gate = LookupGate(self.layout.rank_dir, create=True)
            try:
                self._wconn = index.connect(self.layout.index_path, create, durable=durable)
            except BaseException:
                self.gate.close()
                raise
        except BaseException:
            self._close_dirs()
            raise
        try:
            # Lookups and restores read here, on their own WAL snapshot.
            self._reader = StoreReader(store_dir, rank, readonly=False, fileops=self._ops)
        except BaseException:
            self.gate.close()
            self._wconn.close()
            self._close_dirs()
            raise
        self._rconn = self._reader.conn
        # The workers': their COMMITs leave the WAL's checkpoints to a thread.
        self._checkpointer: Checkpointer | None = None
        if checkpoint_thread:
            self._wconn.execute("PRAGMA wal_autocheckpoint=0")
            self._checkpointer = Checkpointer(self.layout.index_path, index.BUSY_TIMEOUT_MS)

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Flush batched access records, unlink the files collection left waiting, and
        release descriptors and connections."""
        try:
            self.flush_touches()
            self.sync_collected()
            while self._unlinking:
                self._unlink(*self._unlinking.popleft())
            self._punch_deferred(None, every=True)
            self._shrink_waiting(None)
        finally:
            self._writer.close()
            if self._checkpointer is not None:
                self._checkpointer.close()
            self._wconn.close()
            self._reader.close()
            self.gate.close()
            self._close_dirs()

    def _close_dirs(self) -> None:
        os.close(self._objects_fd)
        os.close(self._quarantine_fd)
        if self._free_fd >= 0:
            os.close(self._free_fd)

    @property
    def pool(self) -> FilePool | None:
        """The pool of collected files (``store/pool.py``), if the store has ``free/``."""
        return self._pool

    def __enter__(self) -> PageStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ commit

    def commit(self, root: Root, release: int = 0) -> CommitResult:
        """Store ``root``'s page delta and publish the root with a lease; see module doc.
        ``release``: the read lease (``lease_prefix``) that protected the pages the
        publication relied on, ended in the same transaction (0: none)."""
        return self.commit_batch([Publication(root, place=True, release=release)])[0]

    def stage(self, root: Root) -> CommitResult:
        """Store the pages of one chunk of a publication larger than a capture slot, durably
        but unreferenced, each held from collection for ``stage_hold_s``. Lookups see only
        referenced pages, so nothing of the publication is visible until its last chunk
        commits the root (``commit``), which adopts them as it adopts any live page,
        without writing them again; a publication that never ends leaves them for
        collection once their hold is over. ``root.root_id`` only names the publication in
        logs and errors."""
        return self.commit_batch([Publication(root, place=False)])[0]

    def hold_staged(self, keys: Sequence[str], seconds: float) -> set[str]:
        """Which of ``keys`` are staged (stored, unreferenced: a chunk of an earlier attempt
        at a publication, or of one still being committed), each now held at least
        ``seconds`` more, in one write transaction: a capture copies only the others, and
        the commit of its root finds these."""
        keys = require_keys(keys)
        if not any(rc == 0 and st == "live"
                   for rc, st in index.rows_for_keys(self._rconn, "refcount, state",
                                                      keys).values()):
            return set()  # nothing staged: no write transaction
        with index.write_txn(self._wconn) as conn:
            staged = [k for k, (rc, st) in
                      index.rows_for_keys(conn, "refcount, state", keys).items()
                      if rc == 0 and st == "live"]
            conn.executemany(
                "UPDATE objects SET hold_until = max(coalesce(hold_until, 0), ?) "
                "WHERE key = ?", [(self._clock() + seconds, k) for k in staged])
        return set(staged)

    def commit_batch(
        self, publications: Sequence[Publication],
        more: Callable[[], Sequence[Publication]] | None = None,
    ) -> list[CommitResult]:
        """Commit ``publications`` in their order as one: every delta written, one
        filesystem sync for all of them, one index transaction (``commit`` or ``stage``
        each, as ``Publication.place`` says). All or none: on an error none is published
        and every file the batch wrote is removed. ``more``, asked each time the deltas
        so far are written: publications that came meanwhile, to join the batch (none:
        the batch is complete); the results are in the order of all of them.

        What each commit costs beside its data (a sync, a transaction and its fsync) is
        paid once for the batch: three turns of 2k-8k tokens each over 300k-token
        conversations took 0.39 s one by one where writing their bytes took 0.16
        (scripts/bench_mission.py). A later publication may rely on the pages an earlier one
        writes, and its transaction sees the rows the earlier one added."""
        batch = [_Pending.of(p) for p in publications]
        if self._checkpointer is not None and self._checkpointer.failure is not None:
            failure = self._checkpointer.failure
            raise CommitFailed(f"commit {_names(batch)} refused: an fsync of the index failed "
                               f"at a checkpoint ({failure})") from failure
        retries = 0
        try:
            files = self._write_deltas(batch, more)
            while True:
                try:
                    self._publish_batch(batch, files)
                    break
                except _Conflict as exc:
                    conflict = exc.keys
                for item in batch:
                    for key in conflict:
                        item.written.pop(key, None)  # files that are gone: written again
                retries += 1
                self.counters.commit_retries += 1
                log.info("commit %s: %d deduplicated pages were collected meanwhile; retry",
                         _names(batch), len(conflict))
                if retries > self._max_retries:
                    raise CommitFailed(f"commit {_names(batch)}: still racing collection "
                                       f"after {retries} tries")
                files = self._write_deltas(batch)
        except index.OutcomeUnknown as exc:
            # The COMMIT itself failed: the roots may still be durable, so their files
            # stay; reconcile() removes them later if no row references them.
            self.counters.commits_failed += len(batch)
            raise CommitFailed(f"commit {_names(batch)} failed: {exc}") from exc
        except BaseException as exc:
            self.counters.commits_failed += len(batch)
            for item in batch:
                self._writer.discard(item.written.values())
            if isinstance(exc, OSError | sqlite3.Error):
                raise CommitFailed(f"commit {_names(batch)} failed: {exc}") from exc
            raise
        return [self._settle(item, retries) for item in batch]

    def _publish_batch(self, batch: list[_Pending], files: list[WrittenFile]) -> None:
        """Make ``files`` durable while the transaction of ``batch`` is built, and commit
        it only once they are: no row may name a file that is not durable (step 2 before
        step 3). The sync is mostly the disk writing the data, and the transaction's rows
        are CPU work: one after the other they took 0.08-0.16 s and 0.14-0.24 s of a batch
        of three turns of 2k-8k tokens (scripts/bench_mission.py). The write lock is held
        for the overlap: maintenance waits, never a lookup or a restore; so only while
        the batch wrote at most ``OVERLAP_MAX_BYTES``."""
        syncing = self._writer.start_durable(files)
        try:
            self._hook("commit.syncing")
            if sum(f.nbytes for f in files) > OVERLAP_MAX_BYTES:
                syncing.result()
            with index.write_txn(self._wconn, self.counters.waited) as conn:
                for item in batch:
                    item.placement = self._publish(conn, item)
                syncing.result()
                self._hook("commit.durable")
        except _Conflict:
            # A failed sync fails the commit: syncfs reports an error once, so a retry's
            # sync could pass over pages this one lost.
            syncing.result()
            raise
        finally:
            futures_wait([syncing])  # never a sync left running behind a failure

    def _write_deltas(self, batch: list[_Pending],
                      more: Callable[[], Sequence[Publication]] | None = None
                      ) -> list[WrittenFile]:
        """Steps 1 and 2 for every publication of ``batch``, and those ``more`` adds to it:
        what the index holds live, then the rest written; the files written, not yet
        durable. A page an earlier publication of the batch wrote is not written again:
        the transaction inserts its row before the later one looks."""
        by_batch: set[str] = set()  # keys some publication of the batch wrote
        new_files: list[WrittenFile] = []
        i = 0
        while True:
            if i == len(batch) and more is not None:
                batch.extend(_Pending.of(p) for p in more())
            if i == len(batch):
                break
            item = batch[i]
            i += 1
            keys = item.keys
            # Only the pages past the prefix a root holds live are looked at, row by row:
            # a conversation's next turn costs its new pages, not its length.
            with index.read_txn(self._rconn):  # one snapshot, ended before the writes
                item.held = self._held_live_prefix(self._rconn, keys)
            fresh = list(dict.fromkeys(keys[item.held.pages:]))
            for k in fresh:
                if k not in item.data:
                    item.data[k] = item.pages[k].pieces()
            looked = [k for k in fresh if k not in item.written and k not in by_batch]
            live = self._live_keys(looked)
            delta = [k for k in looked if k not in live]
            file = self._writer.write(delta, item.data, item.written)
            if file is not None:
                new_files.append(file)
            by_batch.update(item.written)
        return new_files

    def _settle(self, item: _Pending, retries: int) -> CommitResult:
        """After the transaction: what one publication of a batch did."""
        placement, held, keys = item.placement, item.held, item.keys
        # Keys another committer stored first: our copies are unreferenced.
        self._writer.release(item.surplus, item.written)
        if placement.holder is not None and (
                placement.kept == 0 or (placement.holder == (held.root_id, held.created)
                                        and held.pages >= placement.kept)):
            # It holds exactly ``keys``: the rows it kept were compared with them.
            self._known.remember(*placement.holder, keys)
        if item.pub.place:
            self.counters.commits += 1
        else:
            self.counters.stages += 1
        self.counters.roots_superseded += placement.superseded
        self.counters.commits_covered += placement.covered
        return CommitResult(
            root_id=item.pub.root.root_id,
            pages=len(keys),
            pages_written=len(item.written),
            pages_deduplicated=len(keys) - len(item.written),
            bytes_written=sum(p.nbytes for k in item.written for p in item.data[k]),
            retries=retries,
            roots_superseded=placement.superseded,
            covered=placement.covered,
        )

    def _live_keys(self, keys: list[str]) -> set[str]:
        rows = index.rows_for_keys(self._rconn, "state", keys)
        return {k for k, (state,) in rows.items() if state == "live"}

    def _held_live_prefix(self, conn: sqlite3.Connection, keys: list[str]) -> _HeldPrefix:
        """How many leading ``keys`` one root holds at their positions, short of the first
        quarantined one: live and referenced, so neither written nor re-checked row by
        row; and that root. Found in O(log n) probes for chained keys (``_held_prefix``),
        then compared with that root's keys in one range read: keys a caller did not chain
        may share a page with a root at its position and differ before it (then none)."""
        n = self._held_prefix(conn, keys)
        if n == 0:
            return _HeldPrefix()
        [(root_id, created)] = conn.execute(
            "SELECT r.id, r.created FROM root_pages rp JOIN roots r ON r.id = rp.root_id "
            "WHERE rp.key = ? AND rp.pos = ? LIMIT 1", (keys[n - 1], n - 1)).fetchall()
        held = self._known.first(root_id, created, n)  # a root this process committed
        if held is None:
            held = [k for (k,) in conn.execute("SELECT key FROM root_pages WHERE root_id = ? "
                                               "AND pos < ? ORDER BY pos", (root_id, n))]
        if held != keys[:n]:
            return _HeldPrefix()
        n = self._short_of_quarantine(conn, keys, n)
        return _HeldPrefix(n, root_id, created) if n else _HeldPrefix()

    @staticmethod
    def _short_of_quarantine(conn: sqlite3.Connection, keys: list[str], n: int) -> int:
        """``n``, or the position of the first quarantined key before it (few or none are:
        a partial index holds them)."""
        quarantined = {k for (k,) in conn.execute(QUARANTINED_KEYS)}
        return next((i for i in range(n) if keys[i] in quarantined), n) if quarantined else n

    def _still_held(self, conn: sqlite3.Connection, keys: list[str], held: _HeldPrefix) -> bool:
        """Inside the commit transaction: whether the root ``_held_live_prefix`` found before
        it still holds ``keys[:held.pages]`` live, without reading its keys again (~20 ms
        each time for a 300k-token prompt's 18,750). It is the same root row (its id and
        ``created``), and it still holds the last of those keys at its position. A root's
        rows are only appended (by a commit) or cut from the end (eviction), so a cut below
        that position removed the row looked at; with chained keys that key at that
        position means the whole prefix, as the binary search relies on. For keys that
        are not one chain (compared one by one before the transaction) only another
        committer's regrowth of that root after such a cut, with the same key at that
        position, would go unseen: a rank has one committer, its commit worker. And none
        of those pages quarantined since."""
        n = held.pages
        row = conn.execute(
            "SELECT rp.key FROM roots r JOIN root_pages rp ON rp.root_id = r.id "
            "WHERE r.id = ? AND r.created = ? AND rp.pos = ?",
            (held.root_id, held.created, n - 1)).fetchone()
        return row is not None and row[0] == keys[n - 1] \
            and self._short_of_quarantine(conn, keys, n) == n

    def _publish(self, conn: sqlite3.Connection, item: _Pending) -> _Placement:
        """Step 3 for one publication, inside the batch's transaction. Raises ``_Conflict``
        with the keys that vanished, to be written again (none: the prefix a root held
        live is no longer); the caller rolls back. Fills ``item.surplus`` with keys we
        wrote that another committer stored first."""
        pub, keys, held = item.pub, item.keys, item.held
        now = self._clock()
        # Payload bytes by key, of the pages the commit asks for: an extension never
        # asks for those its root already holds.
        sizes = {k: sum(p.nbytes for p in v) for k, v in item.data.items()}
        item.surplus.clear()
        if held.pages and not self._still_held(conn, keys, held):
            raise _Conflict(set())  # evicted or quarantined meanwhile: look again
        new_rows = self._adopt_objects(conn, sizes, item.written, item.surplus, now)
        placement = (self._place_root(conn, pub.root.root_id, keys, item.pages, sizes, now)
                     if pub.place else _Placement(superseded=0, covered=False))
        self._add_refs(conn, placement.refs, new_rows)
        if pub.place:
            if pub.release:
                conn.execute(_RELEASE_SQL, (pub.release,))
        else:
            conn.executemany(
                "UPDATE objects SET hold_until = max(coalesce(hold_until, 0), ?) "
                "WHERE key = ? AND refcount = 0", [(now + self.stage_hold_s, k) for k in keys])
        self._hook("commit.index_txn")
        return placement

    def _place_root(
        self,
        conn: sqlite3.Connection,
        root_id: str,
        keys: list[str],
        pages: dict[str, PageData],
        sizes: dict[str, int],
        now: float,
    ) -> _Placement:
        """Inside the commit transaction: insert the root, its pages and references in
        place of the roots it supersedes, or nothing if a stored root already extends it.

        Either way no root is left that is a prefix of another (a conversation keeps one
        root however many turns it publishes), and no page of a dropped root loses its
        last reference: chained keys make a root ending in ``keys[p-1]`` at position
        ``p-1`` hold exactly ``keys[:p]``, which the new root holds too.
        """
        lease_until = now + self.lease_seconds
        if self._renew_extensions(conn, keys, now, lease_until):
            return _Placement(superseded=0, covered=True)
        prefix_roots = self._prefix_roots(conn, keys)
        if len(prefix_roots) == 1:
            # The next publication of what one root holds: a request saving as it runs,
            # or vLLM's next turn of a conversation, a new request id every turn. That
            # root grows in place under the id it was stored with, by rows and references
            # for the new pages only: taking the new id meant rewriting a row per page of
            # the whole prefix (a 250-page turn over 18,750 pages: 0.44-0.66 s, against
            # 0.11-0.15 s growing it).
            [(held_id, _, _, created)] = prefix_roots
            refs: Counter[str] = Counter()
            if held_id != root_id:
                # A root of the publication's own id that is not a prefix of it (an
                # earlier publication of the same request that ended in a tail page) is
                # replaced, as it always was; its references netted with the new ones.
                self._unlink_root(conn, root_id, refs)
            had = self._extend_root(conn, held_id, keys, sizes, now, lease_until, refs)
            return _Placement(superseded=int(held_id != root_id), covered=False,
                              holder=(held_id, created), kept=had, refs=refs)
        # References are netted: a superseded root's pages are the new root's too, so
        # dropping one and adding the other leaves their refcounts as they were.
        refs = Counter(keys)
        last_access, superseded = now, 0
        reads = []
        for old_id, old_lease, old_access, _ in prefix_roots:
            # A lease taken on the old prefix (a lookup about to restore it, a capture
            # relying on it) must keep protecting those pages, now held by the new root.
            lease_until = max(lease_until, old_lease)
            reads += conn.execute("SELECT lease, taken, until FROM reads "
                                  "WHERE root_id = ? AND until > ?", (old_id, now)).fetchall()
            last_access = max(last_access, old_access)
            self._unlink_root(conn, old_id, refs)
            superseded += old_id != root_id
        # The same id that is not a prefix (an earlier publication of the sequence that
        # ended in a tail page) is replaced, as it always was.
        self._unlink_root(conn, root_id, refs)
        # Sizes are known for the pages the commit looked at; the others' are asked of their
        # data (a capture's guard buffer for pages it did not copy).
        nbytes = sum(sizes[k] if k in sizes else pages[k].nbytes for k in keys)
        conn.execute("INSERT INTO roots VALUES (?, ?, ?, ?, ?, ?)",
                     (root_id, nbytes, len(keys), now, last_access, lease_until))
        conn.executemany(
            "INSERT INTO root_pages VALUES (?, ?, ?)",
            [(root_id, pos, key) for pos, key in enumerate(keys)],
        )
        conn.executemany(
            "INSERT INTO reads VALUES (?, ?, ?, ?) ON CONFLICT(root_id, lease) DO UPDATE "
            "SET taken = max(taken, excluded.taken), until = max(until, excluded.until)",
            [(root_id, *read) for read in reads])
        return _Placement(superseded=superseded, covered=False, holder=(root_id, now),
                          refs=refs)

    def _extend_root(self, conn: sqlite3.Connection, root_id: str, keys: list[str],
                     sizes: dict[str, int], now: float, lease_until: float,
                     refs: Counter[str]) -> int:
        """Inside the commit transaction: root ``root_id``, a prefix of ``keys``, becomes
        ``keys``: its row renewed and grown, rows for its new pages only, their references
        added to ``refs`` (for the caller to apply, netted); the pages it had."""
        (had,) = conn.execute("SELECT pages FROM roots WHERE id = ?", (root_id,)).fetchone()
        new = keys[had:]
        conn.execute(
            "UPDATE roots SET bytes = bytes + ?, pages = ?, last_access = max(last_access, ?), "
            "lease_until = max(lease_until, ?) WHERE id = ?",
            (sum(sizes[k] for k in new), len(keys), now, lease_until, root_id))
        conn.executemany("INSERT INTO root_pages VALUES (?, ?, ?)",
                         [(root_id, had + i, key) for i, key in enumerate(new)])
        refs.update(new)
        return had

    def _renew_extensions(
        self, conn: sqlite3.Connection, keys: list[str], now: float, lease_until: float
    ) -> bool:
        """Renew the lease and last access of the roots that extend ``keys`` (hold its
        last page at its position, and more pages), as a restore of the prefix would;
        whether there are any. Such a root already holds every page of ``keys``."""
        n = len(keys)
        cur = conn.execute(
            "UPDATE roots SET last_access = max(last_access, ?), "
            "lease_until = max(lease_until, ?) WHERE pages > ? AND id IN "
            "(SELECT root_id FROM root_pages WHERE key = ? AND pos = ?)",
            (now, lease_until, n, keys[-1], n - 1),
        )
        return cur.rowcount > 0

    def _prefix_roots(
        self, conn: sqlite3.Connection, keys: list[str]
    ) -> list[tuple[str, float, float, float]]:
        """``(id, lease_until, last_access, created)`` of the roots that are prefixes of ``keys``
        (the whole of it included): ``p`` pages, the last of them ``keys[p-1]``.

        Only one length is looked at: the longest prefix of ``keys`` any root holds. A
        prefix root ending earlier would be a prefix of the root holding that longer one,
        and every commit drops such roots (this method is how), so none is left (a store
        written before supersession may keep some, which eviction removes). Asking every
        position instead costs a probe per root sharing each page: with a system prompt
        shared by thousands of conversations, every commit would be slow."""
        n = self._held_prefix(conn, keys)
        if n == 0:
            return []
        return conn.execute(
            "SELECT r.id, r.lease_until, r.last_access, r.created "
            "FROM root_pages rp JOIN roots r ON r.id = rp.root_id "
            "WHERE rp.key = ? AND rp.pos = ? AND r.pages = ?",
            (keys[n - 1], n - 1, n),
        ).fetchall()

    @staticmethod
    def _held_prefix(conn: sqlite3.Connection, keys: list[str]) -> int:
        """How many leading ``keys`` some root holds at their positions: a binary search,
        since chained keys make a root holding page ``i`` hold every page before it."""
        lo, hi = 0, len(keys)  # held below lo, not held from hi on
        while lo < hi:
            mid = (lo + hi) // 2
            if conn.execute(
                "SELECT 1 FROM root_pages WHERE key = ? AND pos = ? LIMIT 1", (keys[mid], mid)
            ).fetchone():
                lo = mid + 1
            else:
                hi = mid
        return lo

    def _adopt_objects(
        self,
        conn: sqlite3.Connection,
        sizes: dict[str, int],
        written: dict[str, WrittenFile],
        surplus: list[str],
        now: float,
    ) -> list[tuple]:
        """Inside the commit transaction: re-check the rows of the pages the commit looked
        at; the rows to insert for the files we wrote (``_add_refs`` inserts them)."""
        rows = index.rows_for_keys(conn, "generation, state", list(sizes))
        conflict = set()
        new_rows = []
        exists: dict[int, bool] = {}  # id(file) -> whether it is still there: a pack once

        def gone(w: WrittenFile) -> bool:
            if id(w) not in exists:
                exists[id(w)] = self._writer.exists(w)
            return not exists[id(w)]

        for key, size in sizes.items():
            row = rows.get(key)
            mine = written.get(key)
            if mine is None:
                if row is None or row[1] != "live":
                    conflict.add(key)
            elif (row is None or row[1] != "live") and gone(mine):
                # Swept by a concurrent reconcile() before we held the lock: write it again.
                conflict.add(key)
            elif row is None:
                new_rows.append((key, mine.generation, size, now, *_location(key, mine)))
            elif row[1] != "live":
                # The quarantined copy was moved aside; ours replaces it.
                conn.execute(
                    "UPDATE objects SET generation = ?, bytes = ?, state = 'live', "
                    "file_key = ?, file_offset = ? WHERE key = ?",
                    (mine.generation, size, *_location(key, mine), key),
                )
            elif row[0] != mine.generation:
                surplus.append(key)
        if conflict:
            raise _Conflict(conflict)
        return new_rows

    def _drop_root(self, conn: sqlite3.Connection, root_id: str) -> int:
        """Delete a root and its references inside the caller's transaction; its bytes."""
        refs: Counter[str] = Counter()
        freed = self._unlink_root(conn, root_id, refs)
        self._add_refs(conn, refs)
        return freed

    @staticmethod
    def _unlink_root(conn: sqlite3.Connection, root_id: str, refs: Counter[str]) -> int:
        """Delete a root's rows inside the caller's transaction and subtract its
        references from ``refs``, for the caller to apply (``_add_refs``); its bytes."""
        row = conn.execute("SELECT bytes FROM roots WHERE id = ?", (root_id,)).fetchone()
        if row is None:
            return 0
        refs.subtract(
            k for (k,) in conn.execute("SELECT key FROM root_pages WHERE root_id = ?", (root_id,))
        )
        conn.execute("DELETE FROM root_pages WHERE root_id = ?", (root_id,))
        conn.execute("DELETE FROM roots WHERE id = ?", (root_id,))
        return int(row[0])

    @staticmethod
    def _add_refs(conn: sqlite3.Connection, refs: Counter[str],
                  new_rows: Sequence[tuple] = ()) -> None:
        """Add ``refs`` (key -> references gained, negative if lost) to the refcounts. A
        page gaining one has no more use for a hold (``stage``): its root holds it, and
        once evicted it is collected at once, as any page. ``new_rows`` (objects the
        commit adds: ``_adopt_objects``) are inserted with their references: inserted
        unreferenced and then counted, each cost three more row writes (the update, and
        the garbage total twice by trigger). A commit of 2,560 new 4 KiB pages
        in-process, medians of 13, three runs each in turn: 0.28-0.31 s, against
        0.33-0.43 s before."""
        conn.executemany(
            "INSERT INTO objects (key, generation, bytes, refcount, state, created, "
            "file_key, file_offset) VALUES (?, ?, ?, ?, 'live', ?, ?, ?)",
            [(key, gen, size, refs.pop(key, 0), created, file_key, offset)
             for key, gen, size, created, file_key, offset in new_rows])
        conn.executemany(
            "UPDATE objects SET refcount = refcount + ?1, "
            "hold_until = CASE WHEN ?1 > 0 THEN NULL ELSE hold_until END WHERE key = ?2",
            [(n, key) for key, n in refs.items() if n],
        )

    # ------------------------------------------------------------------ read side

    def lookup(self, keys: Sequence[str]) -> int:
        """Number of leading ``keys`` the store holds live (the longest stored prefix)."""
        return self._reader.lookup(keys)

    def restore(self, keys: Sequence[str], into: Sequence[object]) -> int:
        """Read and verify the leading ``keys`` into ``into`` (one writable buffer per page)
        (``StoreReader.restore``). Returns how many leading pages were restored; a page that
        fails verification ends the prefix, and its object is quarantined and counted."""
        result = self._reader.restore(keys, into)
        for bad in result.bad:
            if bad.reason == "file missing":
                self.counters.missing_files += 1
            self._quarantine(bad.key, bad.generation, bad.reason)
        n = result.pages
        if n:
            self._touches[(keys[n - 1], n - 1)] = self._clock()
            try:
                self._maybe_flush_touches()
            except sqlite3.Error as exc:
                # The pages were verified and are the caller's; access records can wait.
                log.warning("could not record restore access yet: %s", exc)
        return n

    def quarantine(self, key: str, generation: str, reason: str) -> None:
        """Mark an object bad and move its file (or planted link) aside; never deleted here."""
        self._quarantine(require_hex(key, "page key"), generation, reason)

    def _quarantine(self, key: str, generation: str, reason: str) -> bool:
        """Quarantine object ``key``.``generation`` if its row is still live, judged in
        the transaction that quarantines it: a report made earlier (a reader's, a
        verification's) may name an object collected since, whose file or record is
        someone else's by now. Whether it was quarantined."""
        # Row first: from this COMMIT on no reader uses the object, and the next commit of
        # the key writes a fresh generation. A quarantined row names no pack: its record
        # is moved aside like an object file.
        with index.write_txn(self._wconn) as conn:
            row = conn.execute(
                "SELECT file_key, file_offset, bytes FROM objects "
                "WHERE key = ? AND generation = ? AND state = 'live'",
                (key, generation)).fetchone()
            if row is None:
                return False
            conn.execute(
                "UPDATE objects SET state = 'quarantined', file_key = NULL, file_offset = 0 "
                "WHERE key = ? AND generation = ?",
                (key, generation),
            )
        self.counters.quarantined += 1
        log.warning("object %s.%s failed verification (%s): quarantined", key, generation, reason)
        if row[0] is not None:
            self._quarantine_record(key, generation, row[0], row[1], row[2])
            return True
        name = object_name(key, generation)
        try:
            fd = open_subdir(fanout(key), self._objects_fd, create=False)
        except (FileNotFoundError, StoreError):
            return True
        try:
            self._ops.rename(name, name, fd, self._quarantine_fd)
        except OSError as exc:
            if exc.errno != errno.ENOENT:
                log.warning("could not move %s to quarantine: %s", name, exc)
        finally:
            os.close(fd)
        return True

    def _quarantine_record(self, key: str, generation: str, file_key: str, offset: int,
                           size: int) -> None:
        """Copy a pack's damaged record to ``quarantine/<key>.<generation>`` for
        forensics, then free it in the pack as collection would."""
        name = object_name(key, generation)
        try:
            dir_fd = open_subdir(fanout(file_key), self._objects_fd, create=False)
        except (FileNotFoundError, StoreError):
            return
        try:
            src = open_object(self._ops, dir_fd, file_key, generation)
        except (OSError, ObjectCorrupt):
            return  # the pack is gone or not a file: nothing to keep
        finally:
            os.close(dir_fd)
        try:
            self._copy_to_quarantine(src, name, offset, HEADER_SIZE + size)
        finally:
            self._ops.close(src)
        self._release_record(file_key, generation)

    def _copy_to_quarantine(self, src: int, name: str, offset: int, length: int) -> None:
        try:
            dst = self._ops.open(name, _QUARANTINE_FLAGS, FILE_MODE, self._quarantine_fd)
        except FileExistsError:
            return  # quarantined before (the same record): the first copy is kept
        except OSError as exc:
            log.warning("could not copy %s to quarantine: %s", name, exc)
            return
        try:
            done = 0
            while done < length:
                n = os.copy_file_range(src, dst, length - done, offset + done)
                if n == 0:
                    break  # the pack ends inside the record: keep what there is
                done += n
        except OSError as exc:
            log.warning("could not copy %s to quarantine: %s", name, exc)
        finally:
            self._ops.close(dst)

    def _release_record(self, file_key: str, generation: str,
                        named: bool | None = None, span: int = 0) -> None:
        """A record of pack ``file_key.generation`` that no row names any more: the whole
        pack pooled or unlinked if no row names it at all (rows of a pack are only ever
        deleted once it is published, so that cannot change back), else its punch
        deferred (``PUNCH_DELAY_S``). ``named``: whether rows name the pack, where the
        caller knows it; ``span``: the record's bytes on disk, where known."""
        name = (file_key, generation)
        if self._pack_named(file_key, generation) if named is None else named:
            self._deferred.setdefault(name, _Deferred(self._clock())).bytes += span
            return
        self._deferred.pop(name, None)
        self._remove_file(file_key, generation)

    def _shrink_waiting(self, budget: Budget | None) -> int:
        """Cut the queued files short a step each, as ``budget``'s time and bytes allow
        (all of them without one), unlinking each once a step would empty it; steps taken.

        A step frees the file's back half as queued, or its last piece if that is less.
        Where that is more than the slice has left, the step waits for the next slice, and
        a fresh slice cuts off what its byte budget allows (a whole block at least): a
        collected 2 GiB pack is not freed 1 GiB a unit. Halves are not cut smaller
        otherwise: freeing a file in many small pieces left the next one written slower
        to read cold (docs/store.md, "Recycled files")."""
        steps = 0
        while self._shrinking:
            entry = self._shrinking[0]
            step = entry[3]
            if budget is not None:
                room = budget.bytes_left()
                # A step that empties the file frees every block it holds, its last
                # partial one too; a cut frees ``step``, whole blocks.
                frees = step if step < entry[2] else -(-entry[2] // recovery.BLOCK) * recovery.BLOCK
                if frees > room:
                    if not budget.fresh:
                        break
                    step = max(room // recovery.BLOCK, 1) * recovery.BLOCK
                if not (budget.fresh or budget.affordable(UNLINK, 1)):
                    break
            begun = budget.now() if budget is not None else 0.0
            left = self._writer.shrink(entry[0], entry[1], step)
            if budget is not None:
                budget.spend(UNLINK, 1, max(0, entry[2] - left), budget.now() - begun)
            steps += 1
            if left:
                entry[2] = left
            else:
                self._shrinking.popleft()
        return steps

    def _pack_named(self, file_key: str, generation: str) -> bool:
        return self._wconn.execute(
            "SELECT 1 FROM objects WHERE file_key = ? AND generation = ? LIMIT 1",
            (file_key, generation)).fetchone() is not None

    def _punch_deferred(self, budget: Budget | None, every: bool = False) -> None:
        """Punch the collected records of the packs deferred at least ``PUNCH_DELAY_S``
        ago (``every``: all of them) that rows still name; a pack that none names any more
        goes whole. With a ``budget``, a punch is a unit of its work and frees at most the
        bytes the slice has left (a whole block at least): a dead range of a large pack
        (an evicted root's end, gigabytes of a long conversation) is freed a piece a
        slice, and the pack keeps its place until none is left; its ranges are read
        again from the file each time (``recovery.unfreed_ranges``)."""
        now = self._clock()
        for name, deferred in list(self._deferred.items()):
            if not every and now - deferred.since < PUNCH_DELAY_S:
                continue
            if not self._pack_named(*name):
                self._release_record(*name)
                continue
            for offset, length in self._unpunched(*name):
                end = offset + length
                while offset < end:
                    stop = end
                    if budget is not None:
                        room = budget.bytes_left()
                        stop = min(end, (offset + max(room, recovery.BLOCK))
                                   // recovery.BLOCK * recovery.BLOCK)
                        if not budget.fresh and (stop - offset > room
                                                 or not budget.affordable(UNLINK, 1)):
                            return  # the rest at the next slice
                    begun = budget.now() if budget is not None else 0.0
                    self._writer.punch(*name, offset, stop - offset)
                    if budget is not None:
                        budget.spend(UNLINK, 1, stop - offset, budget.now() - begun)
                    offset = stop
            del self._deferred[name]

    def _unpunched(self, file_key: str, generation: str) -> list[tuple[int, int]]:
        """The ranges of a pack that no row's record covers and that still hold data."""
        try:
            dir_fd = open_subdir(fanout(file_key), self._objects_fd, create=False)
        except (FileNotFoundError, StoreError):
            return []
        try:
            fd = open_object(self._ops, dir_fd, file_key, generation)
        except (OSError, ObjectCorrupt):
            return []
        finally:
            os.close(dir_fd)
        try:
            return recovery.unfreed_ranges(
                recovery.pack_records(self._wconn, file_key, generation), fd)
        finally:
            self._ops.close(fd)

    def _maybe_flush_touches(self) -> None:
        now = self._clock()
        if not self._touches_since:
            self._touches_since = now
        if (
            len(self._touches) >= self._touch_batch
            or now - self._touches_since >= self._touch_interval_s
        ):
            self.flush_touches()

    def record_access(self, key: str, pos: int, when: float) -> None:
        """Batch an access another process's restore made: renews the lease and last
        access of the roots holding page ``pos`` with ``key`` (chained keys make that its
        whole prefix) at the next flush."""
        require_hex(key, "page key")
        self._touches[(key, pos)] = max(when, self._touches.get((key, pos), 0.0))
        self._maybe_flush_touches()

    def record_lease(self, key: str, pos: int, taken: float, until: float,
                     lease: int = 0) -> None:
        """Batch read lease ``lease`` another process's lookup took at ``taken``: protects
        the roots holding page ``pos`` with ``key`` without counting as an access, until
        ``release(lease)`` or ``until``, whichever comes first (docs/maintenance.md,
        "Leases at the cap"). Lease 0 is never released: it ends at ``until``."""
        require_hex(key, "page key")
        old_taken, old_until = self._leases.get((key, pos, lease), (taken, until))
        self._leases[(key, pos, lease)] = (max(taken, old_taken), max(until, old_until))

    def record_release(self, lease: int) -> None:
        """Batch the end of read lease ``lease`` (its read is over), written after the
        leases batched with it: a release that came before its lease (another ring) still
        ends it."""
        if lease <= 0:
            raise ValueError(f"read lease id {lease}: a release names a lease id above 0")
        self._releases.add(lease)

    def flush_touches(self) -> int:
        """Write batched accesses, leases and releases in one transaction; how many were
        written."""
        if not self._touches and not self._leases and not self._releases:
            return 0
        # Unsynced (as eviction): a power cut may lose accesses and leases, never more.
        with index.unsynced(self._wconn), index.write_txn(self._wconn) as conn:
            return self._write_accesses(conn)

    def _write_accesses(self, conn: sqlite3.Connection) -> int:
        conn.executemany(
            "UPDATE roots SET last_access = max(last_access, ?), "
            "lease_until = max(lease_until, ?) WHERE id IN "
            "(SELECT root_id FROM root_pages WHERE key = ? AND pos = ?)",
            [(when, when + self.lease_seconds, key, pos)
             for (key, pos), when in self._touches.items()],
        )
        conn.executemany(_READ_LEASE_SQL,
                         [(lease, taken, until, key, pos)
                          for (key, pos, lease), (taken, until) in self._leases.items()])
        conn.executemany(_RELEASE_SQL, [(lease,) for lease in self._releases])
        if self._leases or self._releases:
            # Leases whose release never came, gone at their end: the table holds the
            # reads of the last ``lookup_lease_seconds``, not every lookup ever dropped.
            conn.execute("DELETE FROM reads WHERE until <= ?", (self._clock(),))
        written = len(self._touches) + len(self._leases) + len(self._releases)
        self.counters.read_releases += len(self._releases)
        self._touches, self._leases, self._touches_since = {}, {}, 0.0
        self._releases = set()
        return written

    def lease_prefix(self, keys: Sequence[str], seconds: float, lease: int = 0) -> int:
        """The stored prefix of ``keys`` (as ``lookup``), protected from eviction by read
        lease ``lease`` for ``seconds`` at most, in one write transaction: what a capture
        that copies only the rest relies on is then still there when its commit comes,
        which ends the lease (``commit(root, release=lease)``)."""
        keys = require_keys(keys)
        if not self._reader.lookup(keys):
            return 0  # nothing to protect: no write transaction
        with index.write_txn(self._wconn) as conn:
            # The prefix one root holds (O(log n) probes and a range read of its keys),
            # not a row per key: with the keys' check, 7.3 ms where a row per key took
            # 23.2 for 3,750 keys, 21.4 where it took 102.7 for a 300k-token prompt's
            # 18,750, in every publication's capture. Never more than is stored (every
            # page of a root is referenced; quarantined ones end it); less only for keys
            # that are not one chain, whose pages capture then copies again.
            n = self._held_live_prefix(conn, keys).pages
            if n:
                now = self._clock()
                conn.execute(_READ_LEASE_SQL, (lease, now, now + seconds, keys[n - 1], n - 1))
        return n

    # ------------------------------------------------------------------ eviction

    def select_victims(self, k: int) -> list[str]:
        """Up to ``k`` roots under no lease of either kind, least recently used first (an
        index walk, no sort).

        Every commit and restore sets ``lease_until = last_access + lease_seconds``, so
        lease order is access order and the ``(lease_until, last_access)`` index yields LRU.
        """
        now = self._clock()
        rows = self._rconn.execute(
            "SELECT id FROM roots WHERE lease_until <= ? AND NOT EXISTS (SELECT 1 FROM "
            "reads WHERE root_id = roots.id AND until > ?) "
            "ORDER BY lease_until, last_access LIMIT ?",
            (now, now, k),
        ).fetchall()
        self._hook("evict.select")
        return [r[0] for r in rows]

    def remove_roots(self, ids: Sequence[str]) -> RemoveResult:
        """Durably remove roots under no lease of either kind and drop their references
        (before any collection)."""
        ids = [require_hex(i, "root id", ROOT_ID_HEX_LEN) for i in ids]
        removed, skipped, freed = [], [], 0
        with index.write_txn(self._wconn) as conn:
            now = self._clock()
            for root_id in ids:
                row = conn.execute(
                    "SELECT max(r.lease_until, coalesce((SELECT max(until) FROM reads "
                    "WHERE root_id = r.id), 0)) FROM roots r WHERE r.id = ?", (root_id,)
                ).fetchone()
                # Re-checked under the write lock: a restore may have renewed the lease.
                if row is None or row[0] > now:
                    skipped.append(root_id)
                    continue
                freed += self._drop_root(conn, root_id)
                removed.append(root_id)
            self._hook("evict.remove")
        return RemoveResult(tuple(removed), tuple(skipped), freed)

    def evict(self, budget: Budget, plan: EvictionPlan, need: int,
              take_requests: Callable[[], object] = lambda: None) -> EvictResult:
        """One eviction step, as one transaction under the lookup gate (``store.gate``):
        ``take_requests()`` moves the accesses and leases waiting for this store in
        (``record_access``, ``record_lease``), they are written, then roots are cut
        from their end and removed in lease order, least recently used first, a read lease
        never overridden (``store/eviction.py``), until
        ``need`` bytes became collectable or ``budget`` is spent. ``plan`` carries the
        victims chosen and not yet removed from one step to the next. ``need <= 0`` only
        writes the requests."""
        gate = contextlib.ExitStack()
        # Unsynced: losing this transaction to a power cut brings its roots back whole,
        # and the collection that unlinks what it freed commits synced, after it. Its
        # COMMIT then holds the write lock for no fsync: maintenance's I/O has the lowest
        # priority, so an fsync of its waits behind commits' I/O while commits wait for it.
        with gate, index.unsynced(self._wconn), \
                index.write_txn(self._wconn, budget.lock_waited) as conn:
            # After BEGIN IMMEDIATE, so lookups are never shut out while this waits for
            # the write lock; released (by the outer stack) only after COMMIT.
            gate.enter_context(self.gate.exclusive())
            take_requests()
            self._write_accesses(conn)
            if need <= 0:
                return EvictResult()
            progress = eviction.evict(conn, plan, need, budget, self._clock(), self._hook)
            self._hook("evict.remove")
            worked = budget.now()
        budget.spend(TXN, 1, 0, budget.now() - worked)
        if progress.left_cut:
            self._hook("evict.truncated")
        return EvictResult(
            removed=tuple(progress.removed), cut=progress.cut, pages=progress.pages,
            bytes=progress.bytes, reclaimed_objects=progress.reclaimed_objects,
            reclaimed_bytes=progress.reclaimed_bytes, skipped=progress.skipped,
            dropped=progress.dropped, read_leased=progress.read_leased,
            read_yielded=progress.read_yielded,
            yielded_roots=progress.yielded_roots, yielded_bytes=progress.yielded_bytes,
        )

    def verify_and_quarantine(self, key: str, generation: str, reason: str) -> bool:
        """Quarantine object ``key``.``generation`` if it is live and fails verification
        here too: a reader's report alone (maybe stale, maybe garbage) never condemns an
        object. True if it was quarantined."""
        key = require_hex(key, "page key")
        row = self._rconn.execute(
            "SELECT bytes, file_key, file_offset FROM objects "
            "WHERE key = ? AND generation = ? AND state = 'live'",
            (key, generation),
        ).fetchone()
        if row is None:
            return False
        size, file_key, offset = row
        try:
            dir_fd = open_subdir(fanout(file_key or key), self._objects_fd, create=False)
        except (FileNotFoundError, StoreError):
            dir_fd = -1
        try:
            if dir_fd >= 0:
                verify_file(self._ops, dir_fd, key, generation, size, file_key, offset)
                return False
        except (ObjectCorrupt, FileNotFoundError):
            pass  # damage, or a live row without its file
        except OSError as exc:
            # EIO, EMFILE, ENOMEM...: says nothing about the object. A good one was
            # quarantined for it; the next failed read reports it again if it is bad.
            log.warning("could not verify %s.%s again (%s); left as it is", key, generation,
                        exc)
            return False
        finally:
            if dir_fd >= 0:
                os.close(dir_fd)
        return self._quarantine(key, generation, reason)

    def check_usable(self) -> None:
        """Raise StoreError if the store's directories are gone or no longer safe: a
        fault of the environment, which no retry of one item can mend."""
        try:
            self.layout.prepare(create=False)
        except OSError as exc:
            raise StoreError(f"store {self.layout.rank_dir} is unusable: {exc}") from exc

    def collect(self, n: int, budget: Budget | None = None,
                urgent: bool = False) -> CollectResult:
        """Delete up to ``n`` unreferenced object rows durably, then unlink their files.

        With a ``budget``: the files of rows an earlier call deleted and left waiting go
        first; then as many rows as the budget's bytes and time estimate allow are deleted,
        in a transaction that commits without an fsync, and their files wait until
        ``sync_collected`` has made that durable (the maintenance worker calls it between
        slices; the next call does otherwise), then are unlinked one by one while a
        slice's time lasts. An unlink can take far longer than usual on a busy disk, so
        files left when the time is up wait for the next call (``unlinking``): their rows
        are gone, so they are nothing to any reader, and a crash leaves them as orphans
        that ``reconcile`` removes. A power cut before the sync may bring the rows back;
        their files are all still there. ``urgent``: the filesystem is short of its
        free-space reserve, so deferred punches are due at once (a reader of a record
        punched early misses it)."""
        if budget is None:
            rows = self._delete_garbage(n)
            for row in rows:
                self._unlink(*row)
            self._punch_deferred(None)
            shrunk = self._shrink_waiting(None)
            return CollectResult(len(rows), sum(r[2] for r in rows), shrunk)
        if self._unsynced:
            begun = budget.now()
            self.sync_collected()
            budget.spend(SYNC, 1, 0, budget.now() - begun)
        self._punch_deferred(budget, every=urgent)
        shrunk = self._shrink_waiting(budget)
        done = self._unlink_waiting(budget)
        if self._unlinking or self._shrinking:
            return CollectResult(done.objects, done.bytes, shrunk)  # out of time
        # Rows deleted as their deletion's time affords; their files go in later slices,
        # each unit budgeted there.
        n = budget.affordable(ROW, n) or (1 if budget.fresh else 0)
        if n <= 0 or (budget.bytes_left() <= 0 and not budget.fresh):
            return done
        rows = self._delete_garbage(n, budget)
        # Only here do files outlive their rows for long (the sync, then later slices).
        self._renew_times({(row[3] or row[0], row[1]) for row in rows})
        self._unsynced.extend(rows)
        budget.now()
        budget.spend(TXN, 1, 0, 0.0)  # the COMMIT, and the times renewed, since the rows
        return CollectResult(done.objects, done.bytes, shrunk)

    def sync_collected(self) -> bool:
        """Make the deletions of a slice's collection durable (the index's WAL fsynced,
        no lock held), so that their files may go: the rows can no longer come back.
        Whether there were any."""
        if not self._unsynced:
            return False
        index.sync_wal(self.layout.index_path)
        self._hook("collect.synced")
        self._unlinking.extend(self._unsynced)
        self._unsynced.clear()
        return True

    @property
    def unlinking(self) -> CollectResult:
        """Objects whose rows collection deleted and whose files it has yet to unlink
        (their deletion synced or not yet), and files it is still cutting short (their
        bytes left); with the bytes of collected records waiting for their punch (no
        object: their pack's other records live on)."""
        waiting = [*self._unsynced, *self._unlinking]
        return CollectResult(len(waiting) + len(self._shrinking),
                             sum(r[2] for r in waiting) + sum(e[2] for e in self._shrinking)
                             + sum(d.bytes for d in self._deferred.values()))

    @property
    def punches_due(self) -> bool:
        """Whether collected records of a pack wait for a punch whose delay is over:
        ``collect`` does them, even with nothing else to collect."""
        now = self._clock()
        return any(now - d.since >= PUNCH_DELAY_S for d in self._deferred.values())

    def _delete_garbage(
        self, n: int, budget: Budget | None = None
    ) -> list[tuple[str, str, int, str | None, int]]:
        """Delete up to ``n`` unreferenced rows (fitting ``budget``'s bytes): durably
        without a budget; with one, in a transaction without an fsync, which would hold
        the write lock while commits wait (``sync_collected`` makes it durable)."""
        with (index.unsynced(self._wconn) if budget is not None else contextlib.nullcontext(),
              index.write_txn(self._wconn, budget and budget.lock_waited) as conn):
            # Staged pages (``stage``) wait for their root while their hold lasts.
            rows = conn.execute(
                "SELECT key, generation, bytes, file_key, file_offset FROM objects "
                "WHERE refcount = 0 AND (hold_until IS NULL OR hold_until <= ?) LIMIT ?",
                (self._clock(), n),
            ).fetchall()
            if budget is not None:
                rows = eviction.fitting_rows(rows, budget, size=2)
            self._hook("collect.select")
            conn.executemany(
                "DELETE FROM objects WHERE key = ? AND generation = ? AND refcount = 0",
                [(row[0], row[1]) for row in rows],
            )
            if budget is not None:
                # The rows' own work, apart from the COMMIT's (``collect``): charged to
                # the transaction, it made every slice keep that much in reserve.
                budget.now()
                budget.spend(ROW, len(rows), 0, 0.0)
            self._hook("collect.delete")
        return rows

    def _renew_times(self, files: set[tuple[str, str]]) -> None:
        """Renew the times of collected files (or of the packs holding their records),
        whose rows are gone. Such a file stays until a later slice unlinks it, and fsck
        and ``reconcile`` spare an unnamed file only while it is younger than their
        grace, as they spare a commit's file before its row names it: with an evicted
        page's old times it was an orphan to a check beside a store at its cap. A crash
        leaves an orphan either way: an old one, which the start-up ``reconcile``
        removes, or a young one, which the worker's re-sweep removes (``sweep``)."""
        for key, generation in files:
            try:
                fd = open_subdir(fanout(key), self._objects_fd, create=False)
            except FileNotFoundError:
                continue
            try:
                os.utime(object_name(key, generation), dir_fd=fd, follow_symlinks=False)
            except OSError:
                pass  # gone already; or left old, which costs a check its verdict only
            finally:
                os.close(fd)

    def _unlink_waiting(self, budget: Budget) -> CollectResult:
        objects = nbytes = 0
        # Whether rows name a pack is asked once per pack here, not once per record (a
        # query each: most of a 64 KiB page's collection). Nothing in this loop deletes
        # rows, and rows naming a published pack are never added, so the answer holds
        # until the loop ends; another process's deletion meanwhile leaves a pack
        # deferred that ``_punch_deferred`` then releases whole. A pack no row names
        # goes whole with its first record; its other records need nothing more.
        named: dict[tuple[str, str], bool] = {}
        gone: set[tuple[str, str]] = set()
        while self._unlinking:
            row = self._unlinking[0]
            size = row[2]
            # A file goes (UNLINK) unless this is a record of a pack other rows still name
            # (or a record quarantined out of it, under the pack's name: ``_unlink``).
            pack = (row[3] or row[0], row[1])
            if pack not in named:
                named[pack] = self._pack_named(*pack)
            kind = RECORD if named[pack] or pack in gone else UNLINK
            if not (budget.fresh or budget.affordable(kind, 1)):
                break
            start = budget.now()
            if pack not in gone:
                self._hook("collect.unlink")
                self._release_record(*pack, named=named[pack], span=record_span(size))
                if not named[pack]:
                    gone.add(pack)
            self._unlinking.popleft()
            budget.spend(kind, 1, size, budget.now() - start)
            objects += 1
            nbytes += size
        return CollectResult(objects, nbytes)

    def _unlink(self, key: str, generation: str, size: int, file_key: str | None = None,
                offset: int = 0) -> None:
        """Remove a collected object: its file into the pool while it has room, else
        unlinked; or its record freed in its pack (``_release_record``)."""
        self._hook("collect.unlink")
        # A row naming no pack may still share its file's name with a pack other rows
        # name: a record quarantined out of a pack names none, and a pack is named after
        # its first record with the pack's generation. So an object file goes, as a
        # pack does, only if no row names a pack of that name.
        self._release_record(file_key or key, generation)

    def _remove_file(self, key: str, generation: str) -> None:
        """A collected file no row names (an object's, or a pack's): into the pool while
        it has room; else unlinked now if it holds at most ``HALVE_ABOVE_BYTES``, or
        queued to lose its back half (whole blocks) and then the rest, a unit each
        (``_shrink_waiting``). A file already gone needs nothing."""
        if any(entry[:2] == [key, generation] for entry in self._shrinking):
            return  # queued already (released through another row that named it)
        name = object_name(key, generation)
        try:
            fd = open_subdir(fanout(key), self._objects_fd, create=False)
        except FileNotFoundError:
            return
        try:
            size = os.stat(name, dir_fd=fd, follow_symlinks=False).st_size
            if self._pooled(name, fd, size):
                return
            if size > self._halve_above:
                self._shrinking.append([key, generation, size, -(-size // 2 // 4096) * 4096])
                return
        except FileNotFoundError:
            return
        except OSError as exc:
            log.warning("could not read the size of %s, unlinking it: %s", name, exc)
        finally:
            os.close(fd)
        self._writer.unlink(key, generation)

    def _pooled(self, name: str, dir_fd: int, size: int) -> bool:
        """Whether collected file ``name`` (in ``dir_fd``) went into the pool; False if
        it is to be unlinked instead (no pool, the pool full, or the rename failed)."""
        if self._pool is None or self._pool.cap_bytes <= 0:
            return False
        try:
            if not self._pool.put(name, dir_fd, size):
                return False
        except FileNotFoundError:
            return True  # gone already: nothing to unlink
        except OSError as exc:
            log.warning("could not pool %s, unlinking it: %s", name, exc)
            return False
        self._hook("collect.pooled")
        return True

    # ------------------------------------------------------------------ recovery

    def reconcile(self, grace_seconds: float = DEFAULT_GRACE_SECONDS) -> ReconcileResult:
        """A whole repair (``sparkcache fsck --repair``): dead rows, wrong refcounts (only
        damage from outside the store's transactions makes either), then every file swept
        (orphans, temp files, records not punched, rows whose file is gone). Reads every
        row and lists every file: a start does not run it (``check_index``).

        Fails closed: if the index does not pass ``quick_check`` nothing is deleted. Temp
        files younger than ``grace_seconds`` are left alone (a commit in another process may
        be writing them). Only ``objects/`` is swept; the index's ``-wal`` and ``-shm`` files
        are never removed. Safe beside running committers: see ``recovery``.
        """
        recovery.check_readable(self._wconn, str(self.layout.index_path))
        dead, fixed = recovery.repair_rows(self._wconn)
        result = self._sweep(None, grace_seconds, dead, fixed)
        log.info("reconcile %s: %s", self.layout.rank_dir, result)
        return result

    def check_index(self, progress: Callable[[], None] | None = None) -> None:
        """What a start needs before the store is used: the index passes ``quick_check``
        (``recovery.check_readable``: fail closed), ``progress`` called every so often
        while it reads (a check reads the whole index: seconds at millions of rows).
        Nothing a crash leaves needs more before serving (docs/store.md, "Starting
        after a crash"): the files it leaves are swept later (``sweep``)."""
        if progress is not None:
            self._wconn.set_progress_handler(lambda: progress() or 0, PROGRESS_OPS)
        try:
            recovery.check_readable(self._wconn, str(self.layout.index_path))
        finally:
            self._wconn.set_progress_handler(None, 0)

    def sweep(self, units: Sequence[str],
              grace_seconds: float = DEFAULT_GRACE_SECONDS) -> ReconcileResult:
        """``reconcile``'s sweep of the files under key prefixes ``units`` alone
        (``recovery.sweep_units``), without its row repair (which reads every row): what
        the maintenance worker runs, a few units a slice, once the start's grace is over,
        for what a crash left (temp files, orphans, records not punched, rows whose file
        is gone)."""
        return self._sweep(units, grace_seconds, 0, 0)

    def _sweep(self, units: Sequence[str] | None, grace_seconds: float, dead: int,
               fixed: int) -> ReconcileResult:
        swept = recovery.sweep_files(self._wconn, self._ops, self._objects_fd, grace_seconds,
                                     units, lambda: index.sync_wal(self.layout.index_path))
        for key, generation in swept.missing:
            self.counters.missing_files += 1
            log.warning("object %s.%s has no file: quarantined", key, generation)
        return ReconcileResult(
            temp_files_removed=swept.temp_files_removed,
            orphan_files_removed=swept.orphan_files_removed,
            dead_rows_removed=dead,
            refcounts_fixed=fixed,
            objects_missing=len(swept.missing),
            pack_ranges_freed=swept.pack_ranges_freed,
        )

    # ------------------------------------------------------------------ accounting

    def usage(self) -> Usage:
        """Entries, bytes and objects per state, from trigger-kept totals (no scan)."""
        totals = {name: (c, b) for name, c, b in self._rconn.execute("SELECT * FROM totals")}
        states = {k: v for k, v in totals.items() if k not in index.TOTALS_NOT_STATES}
        return Usage(
            entries=totals["roots"][0],
            used_bytes=sum(b for _, b in states.values()),
            objects=sum(c for c, _ in states.values()),
            by_state=states,
            collectable_objects=totals["garbage"][0],
            collectable_bytes=totals["garbage"][1],
        )

    def space(self) -> Space:
        """The store's filesystem: its size and the bytes still free (``space_of``)."""
        return space_of(self._objects_fd)

    def leased(self) -> tuple[int, int]:
        """Roots whose conversation lease still runs, and their bytes: an index range
        walk over those roots alone (``roots_lru``), so it grows with the roots published
        or restored within a lease, not with the store."""
        count, nbytes = self._rconn.execute(
            "SELECT count(*), coalesce(sum(bytes), 0) FROM roots WHERE lease_until > ?",
            (self._clock(),),
        ).fetchone()
        return int(count), int(nbytes)
