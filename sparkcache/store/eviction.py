"""Bounded eviction inside one index transaction: plan victims from the LRU index, cut
them from their last page back, as much as a slice's budget allows.

Why cut from the end. A root can hold thousands of pages (a 300k-token conversation is
18,750), and removing it in one transaction would hold the index's write lock, and the
lookup gate, for as long as that takes. Chained keys make every prefix of a root a valid
root (page ``i``'s key names pages ``0..i``), so a root cut to its first ``p`` pages is
still consistent: its refcounts are exact, lookups and restores of its prefix work, fsck
finds nothing. Eviction therefore drops a root's page references from the end in chunks,
committing whatever the budget allowed, and deletes the root once it has no page left;
a crash between two slices leaves a shorter root. The end is also where the bytes are:
pages shared with other roots (a system prompt) are a root's first pages.

Why bytes are counted apart from roots. Roots share page objects, so removing a root frees
only the pages no other root holds. Refcounts along a root never grow toward its end (a
root holding page ``i`` holds every page before it), so the pages it alone holds are a
suffix, found by a binary search (``exclusive_bytes``). A root whose last page is held
elsewhere frees nothing at all (another root extends it); planning passes over such roots
while bytes are still needed (``EvictionPlan.cursor`` remembers how far the walk went, so
no slice walks the same ones again), at most ``WALK_FACTOR`` times the slice's root budget
per plan.

Why leases yield at the cap, oldest first (docs/maintenance.md, "Leases at the cap"). The
walk is in lease order, ``(lease_until, last_access)``, over every root: roots whose lease
is over come first, least recently used first, then, only if they do not cover the goal,
roots whose conversation lease still runs, the oldest lease first. A conversation lease
refusing eviction outright let a store whose roots were all younger than the lease refuse
every new publication until leases ran out.

Read leases (``reads``: a lookup's until its load reports, capture's until its commit)
protect reads in flight, and end with them (a release by the lease's id). A root under
one is passed over. One whose release never came (a load vLLM dropped) would hold its
pages until its ``until``: once a walk reaches the last root with bytes still needed and
has passed over read leases older than ``READ_GRACE_S``, those yield for the rest of the
episode, in the walk's order; a lease taken within ``READ_GRACE_S`` always holds.
"""

from __future__ import annotations

import sqlite3
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

# Units of work whose cost a slice's budget learns (see maintenance_policy.CostModel).
PAGE = "page"  # one page reference dropped from a root (index rows)
UNLINK = "unlink"  # one unreferenced object collected (row deleted, file unlinked)
RECORD = "record"  # a pack's record collected, its punch deferred (row deleted, one read)
ROW = "row"  # an unreferenced object's row deleted by collection (its file goes later)
TXN = "txn"  # beginning and committing one write transaction (and its fsync, if synced)
SYNC = "sync"  # the WAL fsynced outside a transaction (collection's deletions made durable)
# Page references dropped per statement batch; between batches the budget is asked again.
CHUNK_PAGES = 256
# Planning reads at most this many LRU roots per root a slice may evict, and plans at most
# PLAN_MAX victims at once.
WALK_FACTOR = 4
PLAN_MAX = 1024
# A read lease this young always holds: the longest read in flight is done within it. A
# load of a whole 300k-token prefix of an 8B model (37 GiB) takes ~12 s at 3 GiB/s; the
# rest is room for a load that waited its turn behind another (docs/maintenance.md).
READ_GRACE_S = 20.0
# Where an LRU walk starts: before every (lease_until, last_access, id).
_START = (-1e308, -1e308, "")


class Budget(Protocol):
    """What a slice may still do; ``sparkcache.maintenance_policy.SliceMeter`` is one.
    ``fresh``: nothing done yet, so one unit is allowed even if it does not fit (a slice
    always makes progress, even on a page larger than its byte budget)."""

    fresh: bool

    def now(self) -> float: ...

    def roots_left(self) -> int: ...

    def bytes_left(self) -> int: ...

    def affordable(self, kind: str, units: int) -> int: ...

    def spend(self, kind: str, units: int, nbytes: int, seconds: float) -> None: ...

    def take_root(self) -> None: ...

    def lock_waited(self, seconds: float) -> None: ...


@dataclass
class Candidate:
    """A root planned for eviction, as it was when planned."""

    root_id: str
    lease_until: float
    last_access: float
    pages: int
    bytes: int
    reclaim: int  # bytes of the pages it alone holds when planned

    def leased(self, now: float) -> bool:
        """Its conversation lease still runs: taking it is that lease yielding."""
        return self.lease_until > now


@dataclass
class EvictionPlan:
    """Victims chosen but not yet removed, carried from slice to slice, and how far the
    LRU walk has gone (``None``: start from the least recently used root)."""

    victims: deque[Candidate] = field(default_factory=deque)
    cursor: tuple[float, float, str] | None = None
    # Read leases older than READ_GRACE_S yield: a walk reached the last root short of
    # its goal, passing over such leases (``stale_reads`` counts them in the walk).
    reads_yield: bool = False
    stale_reads: int = 0

    def restart(self) -> None:
        """A new episode: walk from the least recently used root, every read lease
        holding."""
        self.cursor, self.reads_yield, self.stale_reads = None, False, 0

    @property
    def roots(self) -> int:
        return len(self.victims)

    @property
    def bytes(self) -> int:
        return sum(v.bytes for v in self.victims)


@dataclass
class Progress:
    """What one eviction transaction did (``records.EvictResult`` once committed)."""

    removed: list[str] = field(default_factory=list)
    cut: int = 0
    pages: int = 0
    bytes: int = 0
    reclaimed_objects: int = 0
    reclaimed_bytes: int = 0
    skipped: int = 0
    read_leased: int = 0  # roots passed over for a read lease
    read_yielded: int = 0  # roots planned whose read lease (older than READ_GRACE_S) yields
    dropped: int = 0
    yielded_roots: int = 0  # roots removed whole while their conversation lease ran
    yielded_bytes: int = 0  # bytes made collectable from roots under a running lease
    left_cut: bool = False  # the last root worked on is still there, shorter


def refcount_at(conn: sqlite3.Connection, root_id: str, pos: int) -> int:
    row = conn.execute(
        "SELECT o.refcount FROM root_pages rp JOIN objects o ON o.key = rp.key "
        "WHERE rp.root_id = ? AND rp.pos = ?", (root_id, pos),
    ).fetchone()
    return 1 if row is None else int(row[0])  # a missing row is nobody else's either


def exclusive_bytes(conn: sqlite3.Connection, root_id: str, pages: int, nbytes: int) -> int:
    """Bytes that evicting the root would free: its pages no other root holds, a suffix
    (see the module doc), found with O(log pages) probes. Pages of one rank are one size,
    so the suffix's bytes are its share of the root's."""
    if pages <= 0 or refcount_at(conn, root_id, pages - 1) > 1:
        return 0
    lo, hi = 0, pages - 1  # refcount_at(hi) <= 1
    while lo < hi:
        mid = (lo + hi) // 2
        if refcount_at(conn, root_id, mid) <= 1:
            hi = mid
        else:
            lo = mid + 1
    return (pages - lo) * nbytes // pages


def read_held(newest: float | None, now: float, reads_yield: bool) -> bool:
    """Whether a root whose running read leases were taken at latest at ``newest`` (None:
    it has none) keeps its pages."""
    return newest is not None and (not reads_yield or newest > now - READ_GRACE_S)


# The newest read lease of root ``r.id`` still running at ``?`` (NULL: none).
_NEWEST_READ = "(SELECT max(taken) FROM reads WHERE root_id = r.id AND until > ?)"


def plan(conn: sqlite3.Connection, victims: EvictionPlan, need: int, budget: Budget,
         now: float, progress: Progress) -> None:
    """Add roots in lease order from the cursor (those whose lease is over first, least
    recently used first, then the oldest leases), passing over those under a read lease
    that holds, until their reclaimable bytes cover ``need`` or the slice's root budget is
    planned. An index walk of at most ``WALK_FACTOR`` x that budget rows, each with a
    range probe of its read leases and O(log pages) probes."""
    room = min(budget.roots_left(), PLAN_MAX)
    if room <= 0:
        return
    limit = WALK_FACTOR * room
    rows = conn.execute(
        f"SELECT r.id, r.lease_until, r.last_access, r.pages, r.bytes, {_NEWEST_READ} "
        "FROM roots r WHERE (r.lease_until, r.last_access, r.id) > (?, ?, ?) "
        "ORDER BY r.lease_until, r.last_access, r.id LIMIT ?",
        (now, *(victims.cursor or _START), limit),
    ).fetchall()
    examined = 0
    for root_id, lease_until, last_access, pages, nbytes, newest in rows:
        examined += 1
        victims.cursor = (lease_until, last_access, root_id)
        if read_held(newest, now, victims.reads_yield):
            progress.read_leased += 1
            victims.stale_reads += newest <= now - READ_GRACE_S
            continue
        reclaim = exclusive_bytes(conn, root_id, pages, nbytes)
        if reclaim == 0:
            progress.skipped += 1
            continue
        progress.read_yielded += newest is not None
        victims.victims.append(Candidate(root_id, lease_until, last_access, pages, nbytes,
                                         reclaim))
        need -= reclaim
        if need <= 0 or victims.roots >= room:
            break
    if examined == len(rows) < limit:
        # The walk reached the last root: start over, read leases past their grace
        # yielding if they were all that kept it short of the goal.
        victims.reads_yield |= need > 0 and victims.stale_reads > 0
        victims.cursor, victims.stale_reads = None, 0


def _still_victim(conn: sqlite3.Connection, v: Candidate, now: float,
                  reads_yield: bool) -> bool:
    """Re-checked under the write lock: a read lease taken or an access made since
    planning (a lookup's lease, a restore's touch, a later turn) keeps the root."""
    row = conn.execute(
        f"SELECT r.lease_until, r.last_access, r.pages, r.bytes, {_NEWEST_READ} "
        "FROM roots r WHERE r.id = ?",
        (now, v.root_id),
    ).fetchone()
    if row is None or read_held(row[4], now, reads_yield) or row[1] != v.last_access:
        return False
    v.lease_until, v.pages, v.bytes = float(row[0]), int(row[2]), int(row[3])
    return True


def cut(conn: sqlite3.Connection, v: Candidate, want: int, budget: Budget,
        progress: Progress) -> int:
    """Drop ``v``'s page references from its end, chunk by chunk, while the budget allows
    and until ``want`` bytes were freed, or it has none left: then the root goes. Returns
    the number of pages dropped."""
    dropped = reclaimed = 0
    while v.pages and reclaimed < want:
        per_page = max(1, v.bytes // v.pages)
        n = min(CHUNK_PAGES, v.pages, budget.affordable(PAGE, CHUNK_PAGES),
                budget.bytes_left() // per_page, -(-(want - reclaimed) // per_page))
        if n <= 0:
            if not budget.fresh:
                break
            n = 1  # at least one page per slice
        start = budget.now()
        rows = conn.execute(
            "SELECT rp.pos, rp.key, coalesce(o.bytes, 0), coalesce(o.refcount, 0) "
            "FROM root_pages rp LEFT JOIN objects o ON o.key = rp.key "
            "WHERE rp.root_id = ? AND rp.pos >= ? ORDER BY rp.pos DESC",
            (v.root_id, v.pages - n),
        ).fetchall()
        taken = fitting_rows(rows, budget, size=2)
        if not taken:
            break
        first = taken[-1][0]
        size = sum(r[2] for r in taken)
        conn.execute("DELETE FROM root_pages WHERE root_id = ? AND pos >= ?", (v.root_id, first))
        conn.executemany("UPDATE objects SET refcount = refcount - 1 WHERE key = ?",
                         [(r[1],) for r in taken])
        freed = [r[2] for r in taken if r[3] == 1]
        v.pages, v.bytes = first, max(0, v.bytes - size)
        dropped += len(taken)
        reclaimed += sum(freed)
        progress.pages += len(taken)
        progress.bytes += size
        progress.reclaimed_objects += len(freed)
        progress.reclaimed_bytes += sum(freed)
        budget.spend(PAGE, len(taken), size, budget.now() - start)
    if not dropped:
        return 0
    if v.pages:
        conn.execute("UPDATE roots SET pages = ?, bytes = ? WHERE id = ?",
                     (v.pages, v.bytes, v.root_id))
    else:
        conn.execute("DELETE FROM roots WHERE id = ?", (v.root_id,))
    return dropped


def evict(conn: sqlite3.Connection, victims: EvictionPlan, need: int, budget: Budget,
          now: float, hook: Callable[[str], None]) -> Progress:
    """Inside the caller's write transaction: free up to ``need`` bytes (made collectable)
    from the plan's victims, planning more when it is empty, within ``budget``."""
    progress = Progress()
    planned = not victims.victims
    if planned:
        plan(conn, victims, need, budget, now, progress)
    hook("evict.select")
    while progress.reclaimed_bytes < need and budget.roots_left() > 0:
        if not victims.victims:
            if planned:
                break  # one walk per step
            plan(conn, victims, need - progress.reclaimed_bytes, budget, now, progress)
            planned = True
            continue
        v = victims.victims[0]
        if not _still_victim(conn, v, now, victims.reads_yield):
            victims.victims.popleft()
            progress.dropped += 1
            continue
        reclaimed = progress.reclaimed_bytes
        if not cut(conn, v, need - progress.reclaimed_bytes, budget, progress):
            break  # the budget allowed nothing more
        budget.take_root()
        if v.leased(now):
            progress.yielded_bytes += progress.reclaimed_bytes - reclaimed
            progress.yielded_roots += not v.pages
        if v.pages:
            progress.cut += 1
            progress.left_cut = True
            break  # out of budget, or enough freed: the rest waits for the next slice
        victims.victims.popleft()
        progress.removed.append(v.root_id)
        progress.left_cut = False
    return progress


def fitting_rows(rows: list[tuple], budget: Budget, size: int) -> list[tuple]:
    """The leading ``rows`` whose bytes (column ``size``) fit the budget's bytes left; one
    at least while the slice has done nothing yet."""
    room, total, out = budget.bytes_left(), 0, []
    for row in rows:
        total += row[size]
        if total > room and not (budget.fresh and not out):
            break
        out.append(row)
    return out
