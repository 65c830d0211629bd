"""``StoreReader``: the read side of one rank's store, which never writes.

The engine process reads through it alone: its index connection is opened read-only with
a busy timeout of a few milliseconds, so no call it makes can wait behind a writer's lock
(WAL readers work on a snapshot; the rare moments a reader must wait, it gives up and
the call is a miss). Whatever a read finds wrong (a checksum mismatch, a live row whose
file is gone) is *reported* as a ``BadObject``, never repaired here: ``PageStore``
quarantines what its own reads report, and the engine-side client sends what it finds to
the maintenance worker.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sqlite3
import stat
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from sparkcache.identity import require_hex, require_keys
from sparkcache.store import index
from sparkcache.store.direct import DirectReads, Pending, mostly_cached, supported
from sparkcache.store.fileops import FileOps
from sparkcache.store.gate import LookupGate
from sparkcache.store.layout import DIR_FLAGS, RankLayout, fanout, open_subdir
from sparkcache.store.objects import (
    HEADER_SIZE,
    IOV_MAX,
    ObjectCorrupt,
    open_object,
    read_verified,
    record_span,
)
from sparkcache.store.records import StoreError

log = logging.getLogger(__name__)

# Bytes of the following pages a restore keeps open and has the kernel read ahead while it
# verifies the current one (at least one page). Bytes, not pages: a model with large pages
# must not pin more page cache per reader thread, nor one with small pages leave the
# disk's queue shallow. With 512 KiB pages, 4 pages (the old fixed depth) and 8 MiB gave
# 4,096-page restores at 0.93-0.94 and 0.91-1.06 of a sequential read, two runs each
# (scripts/bench_store.py): a deeper queue helps long restores a little, within noise.
PREFETCH_BYTES = 8 << 20


@dataclass(frozen=True)
class BadObject:
    """An object a read found damaged; to be quarantined by a writer."""

    key: str
    generation: str
    reason: str


@dataclass(slots=True)
class PlannedPage:
    """A page's live object, as the index named it when planned: a file of its own, or
    (``file_key`` set) the record at ``offset`` of that pack. A plain slotted record: a
    300k-token load plans 18,750 of them, and frozen (``object.__setattr__`` per field)
    the plan of such a load took 141 ms in-process against 110 slotted."""

    key: str
    generation: str
    size: int
    file_key: str | None = None
    offset: int = 0

    @property
    def file(self) -> tuple[str, str]:
        """The name of the file holding it: ``(key, generation)``."""
        return (self.file_key or self.key, self.generation)


@dataclass(frozen=True)
class ReadResult:
    pages: int  # leading pages restored and verified
    bad: tuple[BadObject, ...]
    # The bytes of those pages by how they were read: past the page cache; through it for
    # being mostly in it; through it for a direct read being impossible (no ``direct``, a
    # refusal of O_DIRECT, or an object file of its own).
    direct_bytes: int = 0
    cached_bytes: int = 0
    buffered_bytes: int = 0


# Quarantined keys are few: a partial index holds them (``index``).
QUARANTINED_KEYS = "SELECT key FROM objects WHERE state = 'quarantined'"


# At most this many hints are read (two keys each): the statement stays one index read
# per key, in SQLite's C, whatever a caller passes.
MAX_HINTS = 4


# The objects of a run of one root's pages, in order: one range of ``root_pages`` joined
# with ``objects``.
_ROOT_RUN = (
    "SELECT rp.key, o.generation, o.bytes, o.refcount, o.state, o.file_key, o.file_offset "
    "FROM root_pages rp JOIN objects o ON o.key = rp.key "
    "WHERE rp.root_id = ? AND rp.pos >= ? AND rp.pos <= ? ORDER BY rp.pos")


def _planned_by_root(conn: sqlite3.Connection, keys: list[str]) -> list[PlannedPage]:
    """The leading ``keys`` whose objects are live, as far as a root holding the last of
    them holds them in this order: one range read where ``plan`` read a row per key.
    Chained keys (a load's) are a root's run whenever the last is stored; any other list,
    or one whose last key is not stored, gets fewer or none, and ``plan`` reads the rest
    a row per key, so the answer is the same either way. Measured in-process, the plan
    of an 18,750-page prefix (a 300k-token load): 204-211 ms where a row per key took
    271-293."""
    row = conn.execute("SELECT root_id, pos FROM root_pages WHERE key = ? LIMIT 1",
                       (keys[-1],)).fetchone() if keys else None
    if row is None or row[1] < len(keys) - 1:
        return []
    root_id, last = row
    plan: list[PlannedPage] = []
    for (key, generation, size, refcount, state, file_key, offset), want in zip(
            conn.execute(_ROOT_RUN, (root_id, last - len(keys) + 1, last)), keys,
            strict=False):
        if key != want or refcount == 0 or state != "live":
            break
        plan.append(PlannedPage(key, generation, size, file_key, offset))
    return plan


def chained_prefix(conn: sqlite3.Connection, keys: Sequence[str], beyond: int = 0,
                   hints: Sequence[int] = ()) -> int:
    """How many leading ``keys`` (a chain) have a live, referenced object, in O(log n)
    lookups instead of a row per key; or 0 when it is not longer than ``beyond`` pages,
    the pages the caller has already (vLLM's own prefix cache): one lookup tells, and a
    quarantined object among those pages does not end the prefix, since it is not read.
    ``hints``, answers the caller expects (where the conversation's latest saves ended),
    are tried first: one statement confirms the one that is right (``_confirmed_hint``);
    if none is, that statement was the cost, and the search follows.

    Page keys are chained (``sparkcache.identity``): key ``i`` determines keys ``0..i``, so
    a referenced object of key ``i`` belongs to a root that holds all of them, and the
    referenced keys of a chain are a prefix of it. A binary search finds its end; a
    quarantined object inside it then ends the prefix there. Quarantined objects are few
    (read through a partial index), so a lookup never reads 18750 rows for a 300k-token
    request."""
    def referenced(i: int) -> bool:
        row = conn.execute("SELECT refcount FROM objects WHERE key = ?",
                           (require_hex(keys[i], "page key"),)).fetchone()
        return row is not None and row[0] > 0

    if beyond >= len(keys):
        return 0
    confirmed = _confirmed_hint(conn, keys, beyond, hints)
    if confirmed is not None:
        return confirmed
    with index.read_txn(conn):  # one snapshot for every probe
        if beyond and not referenced(beyond):
            return 0  # nor any key after it: each would imply this one
        lo, hi = beyond, len(keys)  # keys[:lo] referenced; keys[hi:] not
        while lo < hi:
            mid = (lo + hi) // 2
            if referenced(mid):
                lo = mid + 1
            else:
                hi = mid
        quarantined = {key for (key,) in conn.execute(QUARANTINED_KEYS)}
    return _short_of_quarantined(keys, beyond, lo, quarantined)


def _confirmed_hint(conn: sqlite3.Connection, keys: Sequence[str], beyond: int,
                    hints: Sequence[int]) -> int | None:
    """``chained_prefix``'s answer if one of ``hints`` is its end, else None. One
    statement, so one snapshot: for each hint, its last page and the page after it, and
    the quarantined keys. The referenced keys of a chain are a prefix of it, so a hint
    whose last page is referenced and whose next is not is that prefix's end. vLLM's
    scheduler asks this for each request it admits, on its own thread, where each
    statement costs tens of microseconds with the caches cold that a forward leaves; a
    search's transaction takes five or more."""
    n = len(keys)
    ends = [h for h in dict.fromkeys(hints) if beyond < h <= n][:MAX_HINTS]
    if not ends:
        return None
    at = {i for h in ends for i in (h - 1, h) if i < n}
    probes = [require_hex(keys[i], "page key") for i in at]
    marks = ", ".join("?" * len(probes))
    refs: dict[str, int] = {}
    quarantined: set[str] = set()
    for key, refcount in conn.execute(
            f"SELECT key, refcount FROM objects WHERE key IN ({marks}) "
            f"UNION ALL SELECT key, -1 FROM ({QUARANTINED_KEYS})", probes).fetchall():
        if refcount < 0:
            quarantined.add(key)
        else:
            refs[key] = refcount
    for h in ends:
        if refs.get(keys[h - 1], 0) > 0 and (h == n or refs.get(keys[h], 0) <= 0):
            return _short_of_quarantined(keys, beyond, h, quarantined)
    return None


def _short_of_quarantined(keys: Sequence[str], beyond: int, end: int,
                          quarantined: set[str]) -> int:
    """``end``, or the first quarantined key between ``beyond`` and it; 0 if that is not
    beyond ``beyond``."""
    if quarantined:
        for i in range(beyond, end):
            if keys[i] in quarantined:
                end = i
                break
    return end if end > beyond else 0


class StoreReader:
    """Lookups and verified restores of ``<store_dir>/rank-<rank>``."""

    def __init__(self, store_dir: Path | str, rank: int, *, readonly: bool = True,
                 fileops: FileOps | None = None, direct: DirectReads | None = None) -> None:
        """``direct``: read runs of a pack's records past the page cache with it
        (``sparkcache.store.direct``; the restore worker's readers), else through it."""
        self.layout = RankLayout(Path(store_dir), rank)
        self.layout.prepare(create=False)
        self._ops = fileops or FileOps()
        self._direct = direct
        # The current read_planned's bytes read per path (ReadResult's fields).
        self._read_bytes = {"direct": 0, "cached": 0, "buffered": 0}
        self._objects_fd = os.open(self.layout.objects_dir, DIR_FLAGS)
        try:
            self.gate = LookupGate(self.layout.rank_dir, create=False)
            try:
                self.conn = index.connect(self.layout.index_path, create=False,
                                          readonly=readonly)
            except BaseException:
                self.gate.close()
                raise
        except BaseException:
            os.close(self._objects_fd)
            raise

    def close(self) -> None:
        if self._direct is not None:
            self._direct.close()
        self.conn.close()
        self.gate.close()
        os.close(self._objects_fd)

    def lookup(self, keys: Sequence[str], beyond: int = 0, hints: Sequence[int] = ()) -> int:
        """Number of leading ``keys`` (a chain) the store holds live: the longest stored
        prefix, found by ``chained_prefix`` (``hints``: answers expected, tried first);
        0 if it is not longer than ``beyond``."""
        return chained_prefix(self.conn, keys, beyond, hints)

    def restore(self, keys: Sequence[str], into: Sequence[object]) -> ReadResult:
        """Read and verify the leading ``keys`` into ``into`` (one writable buffer per page).

        A page that fails verification ends the prefix and is reported in ``bad``. The next
        ``PREFETCH_BYTES`` of objects are opened and read ahead by the kernel while the
        current one is verified; an open object stays readable even if collection unlinks it.
        """
        if len(into) < len(keys):
            raise ValueError(f"restore: {len(keys)} keys but only {len(into)} buffers")
        return self.read_planned(self.plan(keys), into)

    def plan(self, keys: Sequence[str]) -> list[PlannedPage]:
        """The objects of the leading ``keys`` the index holds live (one read
        transaction): what ``read_planned`` reads. Nothing is read from the files yet."""
        keys = require_keys(keys)
        with index.read_txn(self.conn) as conn:
            plan = _planned_by_root(conn, keys)
            rest = keys[len(plan):]
            rows = index.rows_for_keys(
                conn, "generation, bytes, refcount, state, file_key, file_offset", rest)
        for key in rest:
            row = rows.get(key)
            if row is None or row[2] == 0 or row[3] != "live":
                break
            plan.append(PlannedPage(key, row[0], row[1], row[4], row[5]))
        return plan

    def recent_pages(self, budget: int) -> list[PlannedPage]:
        """The live objects of the most recently used roots, newest root first and each
        root's pages in order, each object once, until they reach ``budget`` bytes: what
        the first turns after a restart are likeliest to load (one read transaction;
        the roots are walked down the LRU index, so a large store costs no more)."""
        pages: list[PlannedPage] = []
        seen: set[str] = set()
        total = 0
        with index.read_txn(self.conn) as conn:
            roots = conn.execute(
                "SELECT id FROM roots ORDER BY lease_until DESC, last_access DESC")
            for (root_id,) in roots:
                rows = conn.execute(
                    "SELECT o.key, o.generation, o.bytes, o.file_key, o.file_offset"
                    " FROM root_pages r JOIN objects o ON o.key = r.key"
                    " WHERE r.root_id = ? AND o.state = 'live' ORDER BY r.pos", (root_id,))
                for key, generation, size, file_key, offset in rows:
                    if key in seen:
                        continue
                    if total + size > budget:
                        return pages
                    seen.add(key)
                    pages.append(PlannedPage(key, generation, size, file_key, offset))
                    total += size
        return pages

    def roots(self, restored_only: bool = False) -> list[tuple[str, int, int]]:
        """Every root as (id, pages, bytes), newest first; ``restored_only``: those read
        since they were made (their last access after their creation), most recently
        read first. One read transaction."""
        where, order = ("WHERE last_access > created ", "last_access") if restored_only \
            else ("", "created")
        with index.read_txn(self.conn) as conn:
            return conn.execute(f"SELECT id, pages, bytes FROM roots {where}"
                                f"ORDER BY {order} DESC").fetchall()

    def root_keys(self, root_id: str, start: int, count: int) -> list[str]:
        """Keys of root ``root_id``'s pages ``start`` to ``start + count`` (fewer past its
        end; none if it is gone)."""
        with index.read_txn(self.conn) as conn:
            return [k for (k,) in conn.execute(
                "SELECT key FROM root_pages WHERE root_id = ? AND pos >= ? ORDER BY pos "
                "LIMIT ?", (root_id, start, count))]

    def read_ahead(self, pages: Sequence[PlannedPage]) -> int:
        """Ask the kernel to read the objects of ``pages`` into the page cache, without
        waiting for it; the bytes asked for (objects gone since they were planned are
        passed over). Consecutive records of a pack are asked for as one range."""
        asked = 0
        i = 0
        while i < len(pages):
            page = pages[i]
            j = i + 1
            if page.file_key is not None:
                while (j < len(pages) and pages[j].file == page.file
                       and pages[j].offset > pages[j - 1].offset):
                    j += 1
            fd = self._open_file(page, [])
            if fd is not None:
                last = pages[j - 1]
                # An object file whole (length 0: to its end), a pack's run of records.
                end = last.offset + HEADER_SIZE + last.size if page.file_key else 0
                with contextlib.suppress(OSError):  # readahead is an optimisation only
                    os.posix_fadvise(fd, page.offset, end - page.offset if end else 0,
                                     os.POSIX_FADV_WILLNEED)
                self._ops.close(fd)
                asked += sum(p.size for p in pages[i:j])
            i = j
        return asked

    def read_planned(self, pages: Sequence[PlannedPage], into: Sequence[object]) -> ReadResult:
        """Read and verify the objects ``pages`` (from ``plan``, maybe a slice of it) into
        ``into`` in order, up to the first that cannot be read or fails verification (in
        ``bad``). An entry of ``into`` is one writable buffer, or a list of byte
        memoryviews holding exactly the page in pieces (its KV blocks' runs). A buffer of a
        page that failed holds no byte of it. Only the file reads of ``pages`` touch this
        reader's index connection (a file found missing is looked up), so each thread
        reading in parallel needs its own ``StoreReader``."""
        if len(into) < len(pages):
            raise ValueError(f"restore: {len(pages)} keys but only {len(into)} buffers")
        plan: list[tuple[PlannedPage, memoryview | list[memoryview]]] = []
        for i, page in enumerate(pages):
            target = into[i]
            if isinstance(target, list):
                held = sum(p.nbytes for p in target)
                if (held != page.size or any(p.readonly for p in target)
                        or len(target) >= IOV_MAX):
                    raise ValueError(f"restore: the pieces of page {i} must be writable, "
                                     f"fewer than {IOV_MAX} and hold {page.size} bytes, "
                                     f"hold {held} in {len(target)}")
                plan.append((page, target))
                continue
            buf = memoryview(target).cast("B")  # type: ignore[arg-type]
            if buf.readonly or buf.nbytes < page.size:
                raise ValueError(
                    f"restore: buffer {i} must be writable and hold {page.size} bytes, "
                    f"has {buf.nbytes}{' (read-only)' if buf.readonly else ''}"
                )
            plan.append((page, buf))
        bad: list[BadObject] = []
        self._read_bytes = dict.fromkeys(self._read_bytes, 0)
        pages = self._read_plan(plan, bad)
        by = self._read_bytes
        return ReadResult(pages, tuple(bad), by["direct"], by["cached"], by["buffered"])

    def _read_plan(self, plan: list[tuple[PlannedPage, memoryview | list[memoryview]]],
                   bad: list[BadObject]) -> int:
        """Read and verify ``plan`` in order; the number of pages restored. With ``direct``,
        each run of a pack's records laid end to end is read past the page cache."""
        if self._direct is None:
            return self._read_buffered(plan, bad)
        n = 0
        for run, in_pack in _runs(plan):
            direct = self._direct  # None from a run that found O_DIRECT refused
            got = (self._read_run(direct, run, bad) if in_pack and direct is not None
                   else self._read_buffered(run, bad))
            n += got
            if got < len(run):
                break
        return n

    def _read_run(self, direct: DirectReads,
                  run: list[tuple[PlannedPage, memoryview | list[memoryview]]],
                  bad: list[BadObject]) -> int:
        """Read ``run``, records of one pack end to end, past the page cache
        (``DirectReads``); through it where most of it is cached, or where the
        filesystem takes no ``O_DIRECT``."""
        first = run[0][0]
        fd = self._open_file(first, bad)
        if fd is None:
            return 0
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                bad.append(BadObject(first.key, first.generation, "not a regular file"))
                return 0
            last = run[-1][0]
            if mostly_cached(fd, first.offset, last.offset + record_span(last.size)
                             - first.offset):
                return self._read_buffered(run, bad, "cached")
            try:
                self._ops.set_direct(fd)
            except OSError as exc:
                if supported(exc):
                    raise
                return self._refused(exc, run, bad)
            done, error = direct.read_run(
                self._ops, fd,
                [Pending(p.key, p.generation, p.size, p.offset, buf) for p, buf in run])
        except OSError as exc:  # its stat or its O_DIRECT switch
            self._failed(first, exc, bad)
            return 0
        finally:
            self._ops.close(fd)
        self._read_bytes["direct"] += sum(page.size for page, _ in run[:done])
        if isinstance(error, OSError) and not supported(error):
            # The open took O_DIRECT but the read did not: a device whose logical blocks
            # are larger than a record's alignment (4 KiB).
            return done + self._refused(error, run[done:], bad)
        if error is not None:
            self._failed(run[done][0], error, bad)
        return done

    def _failed(self, page: PlannedPage, error: Exception, bad: list[BadObject]) -> None:
        """What a read of ``page`` that failed with ``error`` is: damage (reported in
        ``bad``), or a miss (logged where unreadable)."""
        if isinstance(error, ObjectCorrupt):
            # An object collected since it was planned is a miss, not damage: a pack's
            # record reads as zeros (its blocks punched), and an object file of its own
            # taken into the pool is overwritten in place by the next commit while this
            # reader still holds it open.
            if self._still_live(page):
                bad.append(BadObject(page.key, page.generation, str(error)))
        else:
            log.warning("object %s.%s unreadable: %s; a miss", page.key, page.generation,
                        error)

    def _refused(self, error: OSError,
                 run: list[tuple[PlannedPage, memoryview | list[memoryview]]],
                 bad: list[BadObject]) -> int:
        """``O_DIRECT`` refused: ``run``, and every read of this reader from now on, through
        the page cache."""
        log.info("the store's filesystem takes no O_DIRECT here (%s): restores read "
                 "through the page cache", error.strerror)
        if self._direct is not None:
            self._direct.close()
            self._direct = None
        return self._read_buffered(run, bad)

    def _read_buffered(self, plan: list[tuple[PlannedPage, memoryview | list[memoryview]]],
                       bad: list[BadObject], path: str = "buffered") -> int:
        """Read and verify ``plan`` in order through the page cache; the number of pages
        restored, whose bytes are counted as read by ``path``.

        An object file of its own is opened ahead, up to ``PREFETCH_BYTES`` past the
        current page, and the kernel asked to read it while the current one is verified.
        A pack is opened once and its records read front to back: the kernel's readahead
        of a sequential reader then fetches it in large requests (asking it to read the
        records ahead was slower, docs/store.md, "Packs"). A record that fails verification
        because collection punched it since it was planned is a miss, not damage."""
        ahead: deque[int] = deque()  # descriptors of plan[n : opened] (a pack's repeated)
        packs: dict[tuple[str, str], int] = {}  # open packs, by file name
        ahead_bytes = 0  # their sizes, the current page's excluded
        opened = 0
        limit = len(plan)  # cut at the first page that cannot be opened
        n = 0
        try:
            for page, buf in plan:
                while opened < limit and (not ahead or ahead_bytes < PREFETCH_BYTES):
                    fd = self._open_planned(plan[opened][0], packs, bad)
                    if fd is None:
                        limit = opened
                        break
                    if ahead:
                        ahead_bytes += plan[opened][0].size
                    ahead.append(fd)
                    opened += 1
                if not ahead:
                    break
                fd = ahead.popleft()
                if ahead:
                    ahead_bytes -= plan[n + 1][0].size  # the next page becomes the current
                in_pack = page.file_key is not None
                try:
                    read_verified(self._ops, fd, page.key, page.generation, page.size, buf,
                                  page.offset if in_pack else None)
                except (ObjectCorrupt, OSError) as exc:
                    self._failed(page, exc, bad)
                    break
                finally:
                    if not in_pack:
                        self._ops.close(fd)
                n += 1
        finally:
            shared = set(packs.values())
            for fd in ahead:
                if fd not in shared:
                    self._ops.close(fd)
            for fd in shared:
                self._ops.close(fd)
        self._read_bytes[path] += sum(page.size for page, _ in plan[:n])
        return n

    def _still_live(self, page: PlannedPage) -> bool:
        """Whether ``page``'s row still names the object it was planned from."""
        return self.conn.execute(
            "SELECT 1 FROM objects WHERE key = ? AND generation = ? AND state = 'live'",
            (page.key, page.generation)).fetchone() is not None

    def _open_planned(self, page: PlannedPage, packs: dict[tuple[str, str], int],
                      bad: list[BadObject]) -> int | None:
        """The descriptor to read ``page`` from: its own file, opened and read ahead, or
        its pack's, opened once (kept in ``packs``); None (reported) if it cannot be."""
        if page.file_key is None:
            fd = self._open_file(page, bad)
            if fd is not None:
                try:
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_WILLNEED)
                except OSError:
                    pass  # readahead is an optimisation only
            return fd
        fd = packs.get(page.file)
        if fd is None:
            fd = self._open_file(page, bad)
            if fd is not None:
                packs[page.file] = fd
                # Twice the kernel's readahead window for this descriptor: 64 records of
                # 512 KiB read at 0.89-0.93 of a sequential read with it, 0.85-0.88
                # without (docs/store.md, "Reading a pack").
                with contextlib.suppress(OSError):
                    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
        return fd

    def _open_file(self, page: PlannedPage, bad: list[BadObject]) -> int | None:
        """Open the file holding ``page``; None (reported) if it cannot be."""
        key, generation = page.key, page.generation
        file_key = page.file[0]
        try:
            dir_fd = open_subdir(fanout(file_key), self._objects_fd, create=False)
        except FileNotFoundError:
            self._missing(key, generation, bad)
            return None
        except StoreError as exc:
            bad.append(BadObject(key, generation, str(exc)))
            return None
        try:
            return open_object(self._ops, dir_fd, file_key, generation)
        except FileNotFoundError:
            self._missing(key, generation, bad)
            return None
        except ObjectCorrupt as exc:
            bad.append(BadObject(key, generation, str(exc)))
            return None
        except OSError as exc:
            log.warning("object %s.%s cannot be opened: %s; a miss", key, generation, exc)
            return None
        finally:
            os.close(dir_fd)

    def _missing(self, key: str, generation: str, bad: list[BadObject]) -> None:
        """A live row without its file: a race with collection is a plain miss; else damage."""
        row = self.conn.execute(
            "SELECT generation, refcount, state FROM objects WHERE key = ?", (key,)
        ).fetchone()
        if row is not None and row[0] == generation and row[2] == "live":
            bad.append(BadObject(key, generation, "file missing"))


def _runs(plan: list[tuple[PlannedPage, memoryview | list[memoryview]]],
          ) -> Iterator[tuple[list[tuple[PlannedPage, memoryview | list[memoryview]]], bool]]:
    """``plan`` in pieces, in order, each with whether it is a run of one pack's records
    laid end to end (read past the page cache) or not (object files of their own)."""
    start = 0
    for i in range(1, len(plan) + 1):
        prev = plan[i - 1][0]
        if i < len(plan):
            page = plan[i][0]
            if (prev.file_key is not None) == (page.file_key is not None) and (
                    prev.file_key is None or (page.file == prev.file and page.offset
                                              == prev.offset + record_span(prev.size))):
                continue
        yield plan[start:i], prev.file_key is not None
        start = i
