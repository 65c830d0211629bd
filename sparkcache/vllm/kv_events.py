"""KV events for routers: which of this engine's pages the store holds, told through vLLM's
own event path (the scheduler's ``take_events``, published with vLLM's
``--kv-events-config``), so a KV-aware router can send a conversation's next turn to the
node that holds it on disk (docs/vllm.md, "KV events for a router").

What a router learns, in vLLM's terms (``BlockStored``, ``BlockRemoved``,
``AllBlocksCleared``, medium ``STORAGE``), named by vLLM's own block hashes:

* stored: once a saved page is durable and restorable on every rank. A save is watched
  from the moment the scheduler side sends it; it is found stored by reading each rank's
  index (the root of its last page is visible only once every page of it is durable), or
  forgotten after ``UNCONFIRMED_AFTER_S``.
* removed: a page announced here that any rank's removal log (``store.removals``) names:
  evicted, quarantined or deleted.
* cleared: ``reset_cache``: nothing stored before is looked up by this engine again.

A page's announcement (its block hashes, its parent's, its tokens) is kept in a ledger in
the store directory, one SQLite file per namespace (``events-<seed>.sqlite``, written only
by this scheduler side; losing it costs announcements, never a wrong one: each is checked
against the store before it is sent). After a restart of vLLM the ledger's pages that the
store still holds are announced again and the rest removed; when a removal log cannot say
what happened (trimmed past the cursor, or another store), every announced page is
checked again the same way. So a router's index converges on what the store holds.

The scheduler's thread only hands work over; a thread of its own does it, bounded per
check (``CHECK_EVERY_S``, ``PAGES_PER_CHECK``, ``LOG_ROWS_PER_CHECK``) and with few SQL
statements a check (``KVEvents._insert``).
"""

from __future__ import annotations

import logging
import os
import queue
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache.identity import KEY_BYTES, Namespace
from sparkcache.store import StoreError, index
from sparkcache.store.layout import RankLayout
from sparkcache.store.removals import log_end, removals_since, restorable

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.1
# vLLM's ZMQ publisher, connecting to a router (an endpoint with a host), drops the first
# batch it sends, apparently because its socket takes in the router's subscription only
# once first used (vLLM 0.33: the first of eight batches lost in 4 runs of 4, whatever the
# wait before it; in the events test a batch 0.1 s after the first was lost too). Nothing
# is announced until this long after a first batch that carries nothing (a removal of no
# block), sent again half-way in case the socket needs a second use (with one, one run of
# the events test in fifteen failed here, its cause not seen; none of 10 since with two).
ANNOUNCE_AFTER_PRIMER_S = 1.0
# Work of one check: its longer C calls hold the GIL, which vLLM's thread waits for (a
# 300k-token first turn, 18,750 pages of 16 tokens, over 19 checks: that thread's worst
# pause 1.7-2.4 ms, against 1.4-1.7 ms with nothing beside it, in two runs measured).
PAGES_PER_CHECK = 1024
LOG_ROWS_PER_CHECK = 4096
# A save not found stored after this long was refused or lost (the publish deadline and
# a commit are far shorter): it is forgotten.
UNCONFIRMED_AFTER_S = 600.0
_TOKEN_DTYPE = np.dtype("<u4")

_LEDGER_SCHEMA = """
CREATE TABLE IF NOT EXISTS pages(
    key BLOB PRIMARY KEY,
    pos INTEGER NOT NULL,
    hashes BLOB NOT NULL,
    blocks INTEGER NOT NULL,
    parent BLOB,
    tokens BLOB NOT NULL,
    block_size INTEGER NOT NULL,
    lora_name TEXT,
    lora_id INTEGER,
    epoch TEXT NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS pages_epoch ON pages(epoch, pos);
"""


# A run of a save's pages into the ledger in one statement (``KVEvents._insert``): row n
# takes the n-th fixed-width slice of each blob; its parent is the last block hash of
# the page before (the run's own parent for the first).
_INSERT_RUN = """
WITH RECURSIVE i(n) AS (SELECT 0 UNION ALL SELECT n + 1 FROM i WHERE n + 1 < :count)
INSERT OR REPLACE INTO pages
SELECT substr(:keys, n * 16 + 1, 16), :first + n, substr(:hashes, n * :hw + 1, :hw), :blocks,
       CASE WHEN n = 0 THEN :parent ELSE substr(:hashes, n * :hw - :hl + 1, :hl) END,
       substr(:tokens, n * :tw + 1, :tw), :block_size, :lora_name, :lora_id, :epoch
FROM i
"""


@dataclass(frozen=True)
class Stored:
    """Pages stored: their vLLM block hashes in order, the hash before the first (None at
    a prompt's start), their tokens, tokens a block, and the request's LoRA adapter."""

    hashes: list[bytes]
    parent: bytes | None
    tokens: list[int]
    block_size: int
    lora_name: str | None = None
    lora_id: int | None = None


@dataclass(frozen=True)
class Removed:
    hashes: list[bytes]
    # The ledger's pages it stands for: forgotten once vLLM has taken it (``take``).
    keys: list[bytes] = field(default_factory=list, compare=False)


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass
class _Save:
    """A save sent to the workers whose pages ``first..first + pages - 1`` of a request
    are not yet known stored. ``hashes`` and ``tokens`` are the request's own lists, read
    by absolute position when announced: both only grow, and what a saved page covers
    never changes, so the scheduler's thread hands them over without a copy."""

    keys: bytes  # raw keys of those pages
    first: int
    blocks: int  # vLLM blocks a page
    page_tokens: int
    hashes: Sequence[bytes]
    tokens: Sequence[int]
    lora_name: str | None
    lora_id: int | None
    since: float

    @property
    def pages(self) -> int:
        return len(self.keys) // KEY_BYTES

    def key(self, i: int) -> bytes:
        return self.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES]

    def page_hashes(self, a: int, b: int) -> list[bytes]:
        """vLLM's block hashes of its pages ``a..b-1``."""
        k = self.blocks
        return list(self.hashes[(self.first + a) * k:(self.first + b) * k])

    def parent(self, a: int) -> bytes | None:
        """The block hash before its page ``a`` (None at the prompt's start)."""
        p = (self.first + a) * self.blocks
        return self.hashes[p - 1] if p else None

    def page_tokens_of(self, a: int, b: int) -> Sequence[int]:
        """The tokens of its pages ``a..b-1``."""
        t = self.page_tokens
        return self.tokens[(self.first + a) * t:(self.first + b) * t]

    def split(self, n: int) -> tuple[_Save, _Save]:
        """Its first ``n`` pages, and the rest."""
        return (replace(self, keys=self.keys[:n * KEY_BYTES]),
                replace(self, keys=self.keys[n * KEY_BYTES:], first=self.first + n))


@dataclass
class EventCounts:
    """What was announced, under the names of the ``events_*`` metrics (``totals``)."""

    stored_pages: int = 0
    removed_pages: int = 0
    unconfirmed_saves: int = 0
    resyncs: int = 0
    # Saves not watched, by why: vLLM's block hashes could not name their pages.
    skipped: dict[str, int] = field(default_factory=dict)

    def totals(self) -> dict[str, int]:
        """``events_<count>``, and the skips as ``skipped:events_<reason>``."""
        out = {f"events_{k}": v for k, v in asdict(self).items() if k != "skipped"}
        out.update({f"skipped:events_{k}": v for k, v in self.skipped.items()})
        return out


# A ledger row whose removal is announced but not yet taken by vLLM is marked
# ``gone:<epoch>`` (``KVEvents._remove``): it no longer counts as held.
_HELD = "epoch NOT LIKE 'gone:%'"


class Ledger:
    """The announced pages of one namespace (module doc): ``key -> announcement``, and the
    ``epoch`` (process) that last announced each."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None: in memory (a namespace no later process can have: after a
        ``reset_cache``)."""
        if path is not None:
            index.check_db_file(path, create=True)
        self.conn = sqlite3.connect(":memory:" if path is None else path, isolation_level=None)
        # Advisory: a crash may lose the last announcements, each checked before use.
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=OFF")
        self.conn.executescript(_LEDGER_SCHEMA)

    def holds(self, keys: Sequence[bytes]) -> set[bytes]:
        """Those of ``keys`` the ledger holds (one row back a chunk: see ``_insert``)."""
        out: set[bytes] = set()
        for part in index.chunks(list(keys)):
            marks = ",".join("?" * len(part))
            found = self.conn.execute(f"SELECT group_concat(hex(key), '') FROM pages "
                                      f"WHERE key IN ({marks}) AND {_HELD}",
                                      tuple(part)).fetchone()[0]
            raw = bytes.fromhex(found or "")
            out.update(raw[i:i + KEY_BYTES] for i in range(0, len(raw), KEY_BYTES))
        return out

    def first_not_held(self, save: _Save) -> int:
        """The first of a save's pages the ledger does not hold. The pages a root holds
        are a prefix of its key chain, and so are those announced of it: a binary
        search."""
        lo, hi = 0, save.pages  # pages before lo held; from hi on not
        while lo < hi:
            mid = (lo + hi) // 2
            if self.conn.execute(f"SELECT 1 FROM pages WHERE key = ? AND {_HELD}",
                                 (save.key(mid),)).fetchone():
                lo = mid + 1
            else:
                hi = mid
        return lo

    def close(self) -> None:
        self.conn.close()


class KVEvents:
    """The events of one scheduler side (module doc). The scheduler's thread only hands
    things over: ``note_save`` as saves are sent, ``attach`` and ``clear``, and ``take``
    whenever vLLM asks, which returns what is ready. The ledger and the stores' indexes
    are read and written on a thread of its own (``background``; a test drives the same
    work from ``take``): announcing a 4,096-page check took 127-137 ms, measured, most
    of it in SQLite, which lets go of the GIL."""

    def __init__(self, store_dir: Path, tp_size: int, clock=time.monotonic,
                 background: bool = False) -> None:
        self.store_dir = Path(store_dir)
        self.tp_size = tp_size
        self.clock = clock
        self.counts = EventCounts()
        self.epoch = os.urandom(8).hex()
        # A ledger row announced removed, not yet taken by vLLM: if this process stops
        # first, the next announces it removed again (a later epoch checks it).
        self._gone = f"gone:{self.epoch}"
        self._inbox: queue.SimpleQueue[tuple] = queue.SimpleQueue()
        self._out: deque[Event] = deque()  # appended by the worker, taken by vLLM's thread
        # The worker's own: the ledger, the indexes, the saves being watched.
        self._ledger: Ledger | None = None
        self._ns_seed: bytes | None = None
        self._conns: list[sqlite3.Connection | None] = [None] * tp_size
        self._cursors: list[int | None] = [None] * tp_size
        self._saves: deque[_Save] = deque()
        self._check_at = 0.0
        self._announce_from: float | None = None  # set by the primer (ANNOUNCE_AFTER_PRIMER_S)
        self._primed = False  # the second primer sent
        # The ledger may hold pages of another epoch (a new ledger, or after a resync):
        # ``_announce_again`` looks, until it finds none (its query reads the ledger).
        self._unchecked = False
        self._thread: threading.Thread | None = None
        self._stopped = False  # the worker ended: nothing more is handed over
        if background:
            self._thread = threading.Thread(target=self._run, name="sparkcache-kv-events",
                                            daemon=True)
            self._thread.start()

    # ------------------------------------------------------------------ vLLM's thread

    def attach(self, ns: Namespace, durable: bool = True) -> None:
        """The namespace whose pages are announced; its ledger is opened (``durable``
        False: in memory). Another namespace than before (``reset_cache``) clears."""
        self._inbox.put(("attach", ns.seed(), durable))

    def clear(self) -> None:
        """``reset_cache``: every page announced so far is gone for this engine."""
        self._inbox.put(("clear",))

    def note_save(self, request: Any, raw_keys: bytes, page_tokens: int,
                  hash_block_size: int | None) -> None:
        """A save of the request's first pages (their keys ``raw_keys``) was sent."""
        pages = len(raw_keys) // KEY_BYTES
        if pages <= 0 or self._stopped:
            return
        if not hash_block_size or page_tokens % hash_block_size:
            self._skip("block_size")
            return
        hashes = getattr(request, "block_hashes", None) or ()
        blocks = page_tokens // hash_block_size
        if len(hashes) < pages * blocks:
            self._skip("hashes")
            return
        lora = getattr(request, "lora_request", None)
        self._inbox.put(("save", _Save(
            raw_keys, 0, blocks, page_tokens, hashes, request.all_token_ids,
            getattr(lora, "name", None), getattr(lora, "adapter_id", None), self.clock())))

    def _skip(self, reason: str) -> None:
        self.counts.skipped[reason] = self.counts.skipped.get(reason, 0) + 1

    def take(self) -> list[Event]:
        """The events ready since the last call. The pages of removals taken are then
        forgotten by the ledger (``_forget``): a removal that vLLM never took is
        announced again by the next process."""
        if self._thread is None:
            self._work(self.clock())
        out = []
        while self._out:
            out.append(self._out.popleft())
        taken = [k for e in out if isinstance(e, Removed) for k in e.keys]
        if taken:
            self._inbox.put(("taken", taken))
        return out

    def close(self) -> None:
        """Stop the worker. Saves not yet found stored go into the ledger as pages of no
        epoch, which the next process checks (``_announce_again``): a commit that ends
        after vLLM stopped is announced by the engine that follows."""
        if self._thread is not None:
            self._inbox.put(("stop",))
            self._thread.join(10)
            self._thread = None
        else:
            self._shut()

    # ------------------------------------------------------------------ the worker

    def _run(self) -> None:
        try:
            while True:
                try:
                    item = self._inbox.get(timeout=CHECK_EVERY_S)
                except queue.Empty:
                    item = None
                if item is not None and item[0] == "stop":
                    break
                if not self._work(self.clock(), item):
                    break
        except Exception:
            log.warning("KV events stopped: nothing more is announced", exc_info=True)
        finally:
            self._stopped = True
            self._shut()

    def _work(self, now: float, item: tuple | None = None) -> bool:
        """``item``, then the rest of the inbox in order, then a check when one is due.
        False once the inbox said stop."""
        while True:
            if item is None:
                try:
                    item = self._inbox.get_nowait()
                except queue.Empty:
                    break
            if item[0] == "stop":
                return False
            if item[0] == "attach":
                self._attach(item[1], item[2])
            elif item[0] == "clear":
                self._clear()
            elif item[0] == "save":
                self._watch(item[1])
            elif item[0] == "taken":
                self._forget(item[1])
            item = None
        if self._ledger is not None and now >= self._check_at:
            self._check_at = now + CHECK_EVERY_S
            self._check(now)
        return True

    def _attach(self, seed: bytes, durable: bool) -> None:
        if seed == self._ns_seed:
            return
        if self._ledger is not None:
            self._ledger.close()
            self._out.append(Cleared())
            self._saves.clear()
        self._ns_seed = seed
        path = self.store_dir / f"events-{seed.hex()}.sqlite" if durable else None
        self._unchecked = True
        try:
            self._ledger = Ledger(path)
        except (OSError, sqlite3.Error, StoreError) as exc:
            self._ledger = None
            log.warning("KV events off: the ledger %s cannot be opened: %s", path, exc)

    def _clear(self) -> None:
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        self._ns_seed = None
        self._saves.clear()
        self._out.append(Cleared())

    def _watch(self, save: _Save) -> None:
        """Watch a save's pages the ledger does not hold yet."""
        if self._ledger is None:
            return
        first = self._ledger.first_not_held(save)
        if first < save.pages:
            self._saves.append(save.split(first)[1])

    def _shut(self) -> None:
        if self._ledger is not None and self._saves:
            try:
                with index.write_txn(self._ledger.conn):
                    for save in self._saves:
                        self._insert(save, 0, save.pages, epoch="")
            except sqlite3.Error:
                log.warning("KV events: saves in flight not kept for the next engine",
                            exc_info=True)
        for conn in self._conns:
            if conn is not None:
                conn.close()
        self._conns = [None] * self.tp_size
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None

    def _check(self, now: float) -> None:
        if self._announce_from is None:
            self._out.append(Removed([]))
            self._announce_from = now + ANNOUNCE_AFTER_PRIMER_S
        elif not self._primed and now >= self._announce_from - ANNOUNCE_AFTER_PRIMER_S / 2:
            self._out.append(Removed([]))
            self._primed = True
        conns = self._rank_conns()
        if conns is None:
            return
        self._start_cursors(conns)  # removals from the primer on are read
        if now < self._announce_from:
            return
        budget = PAGES_PER_CHECK
        self._read_removals(conns)
        if self._unchecked:
            budget -= self._announce_again(conns, budget)
        self._confirm_saves(conns, budget, now)

    def _rank_conns(self) -> list[sqlite3.Connection] | None:
        for rank in range(self.tp_size):
            if self._conns[rank] is None:
                try:
                    self._conns[rank] = index.connect(RankLayout(self.store_dir, rank).index_path,
                                                      create=False, readonly=True)
                except Exception:  # no store yet: nothing is stored
                    return None
        return self._conns  # type: ignore[return-value]

    def _start_cursors(self, conns: list[sqlite3.Connection]) -> None:
        """Each rank's log is read from its end when first opened: what the ledger holds
        from before is checked by ``_announce_again`` (it is not of this epoch)."""
        for rank, conn in enumerate(conns):
            if self._cursors[rank] is None:
                self._cursors[rank] = log_end(conn) or 0

    def _read_removals(self, conns: list[sqlite3.Connection]) -> None:
        ledger = self._ledger
        assert ledger is not None
        lost = False
        gone: list[bytes] = []
        for rank, conn in enumerate(conns):
            cursor = self._cursors[rank]
            assert cursor is not None
            got = removals_since(conn, cursor, LOG_ROWS_PER_CHECK)
            self._cursors[rank] = got.cursor
            lost |= got.lost
            gone += [bytes.fromhex(k) for k in got.keys]
        if gone:
            self._remove(gone)
        if lost:
            # Check every page again, as after a restart.
            self.counts.resyncs += 1
            ledger.conn.execute("UPDATE pages SET epoch = '' WHERE epoch = ?", (self.epoch,))
            self._unchecked = True

    def _remove(self, keys: Sequence[bytes]) -> None:
        """Announce removed the pages of ``keys`` the ledger holds, marked gone until
        vLLM has taken the removal."""
        ledger = self._ledger
        assert ledger is not None
        with index.write_txn(ledger.conn):
            for part in index.chunks(list(keys)):
                marks = ",".join("?" * len(part))
                found = ledger.conn.execute(
                    "SELECT group_concat(hex(key) || ':' || hex(hashes) || ':' || blocks, ',') "
                    f"FROM pages WHERE key IN ({marks}) AND {_HELD}",
                    tuple(part)).fetchone()[0]
                if not found:
                    continue
                for item in found.split(","):
                    key, hashes, blocks = item.split(":")
                    self._out.append(Removed(_split(bytes.fromhex(hashes), int(blocks)),
                                             [bytes.fromhex(key)]))
                    self.counts.removed_pages += 1
                ledger.conn.execute(f"UPDATE pages SET epoch = ? WHERE key IN ({marks}) "
                                    f"AND {_HELD}", (self._gone, *part))

    def _forget(self, keys: Sequence[bytes]) -> None:
        """Removals vLLM took: their pages leave the ledger (unless stored again since)."""
        ledger = self._ledger
        if ledger is None:
            return
        with index.write_txn(ledger.conn):
            for part in index.chunks(list(keys)):
                marks = ",".join("?" * len(part))
                ledger.conn.execute(f"DELETE FROM pages WHERE epoch = ? AND key IN ({marks})",
                                    (self._gone, *part))

    def _announce_again(self, conns: list[sqlite3.Connection], budget: int) -> int:
        """Pages the ledger holds from another epoch (an earlier process, or a check
        asked for): announced again where every rank can restore them, removed where
        not. Parents before children (``pos``). Returns the pages checked."""
        ledger = self._ledger
        assert ledger is not None
        rows = ledger.conn.execute(
            "SELECT key, pos, hashes, blocks, parent, tokens, block_size, lora_name, lora_id "
            "FROM pages WHERE epoch NOT IN (?, ?) ORDER BY pos LIMIT ?",
            (self.epoch, self._gone, budget)).fetchall()
        if len(rows) < budget:
            self._unchecked = False  # these are the last
        if not rows:
            return 0
        present = _restorable_everywhere(conns, [r[0] for r in rows])
        with index.write_txn(ledger.conn):
            for key, _pos, hashes, blocks, parent, tokens, block_size, lora_name, lora_id in rows:
                if key in present:
                    self._out.append(Stored(_split(hashes, blocks), parent,
                                            np.frombuffer(tokens, _TOKEN_DTYPE).tolist(),
                                            block_size, lora_name, lora_id))
                    self.counts.stored_pages += 1
                    ledger.conn.execute("UPDATE pages SET epoch = ? WHERE key = ?",
                                        (self.epoch, key))
                else:
                    self._out.append(Removed(_split(hashes, blocks), [key]))
                    self.counts.removed_pages += 1
                    ledger.conn.execute("UPDATE pages SET epoch = ? WHERE key = ?",
                                        (self._gone, key))
        return len(rows)

    def _confirm_saves(self, conns: list[sqlite3.Connection], budget: int, now: float) -> None:
        """Announce the pages of the saves found stored, oldest save first."""
        ledger = self._ledger
        assert ledger is not None
        for _ in range(len(self._saves)):
            if budget <= 0:
                return
            save = self._saves.popleft()
            if not _restorable_everywhere(conns, [save.key(save.pages - 1)]):
                if now - save.since < UNCONFIRMED_AFTER_S:
                    self._saves.append(save)  # looked at again next check
                else:
                    self.counts.unconfirmed_saves += 1
                continue
            if save.pages > budget:
                save, rest = save.split(budget)
                self._saves.appendleft(rest)  # found stored: the rest follows next check
            budget -= save.pages
            self._announce(conns, save)

    def _announce(self, conns: list[sqlite3.Connection], save: _Save) -> None:
        """Announce the save's pages that every rank can restore and the ledger does not
        hold: one event and one ledger statement per run of them (normally one)."""
        ledger = self._ledger
        assert ledger is not None
        keys = [save.key(i) for i in range(save.pages)]
        held = ledger.holds(keys)
        present = _restorable_everywhere(conns, [k for k in keys if k not in held])
        with index.write_txn(ledger.conn):
            a = 0
            while a < save.pages:
                if keys[a] not in present:
                    a += 1
                    continue
                b = a
                while b < save.pages and keys[b] in present:
                    b += 1
                self._out.append(Stored(save.page_hashes(a, b), save.parent(a),
                                        list(save.page_tokens_of(a, b)),
                                        save.page_tokens // save.blocks, save.lora_name,
                                        save.lora_id))
                self._insert(save, a, b, self.epoch)
                self.counts.stored_pages += b - a
                a = b

    def _insert(self, save: _Save, a: int, b: int, epoch: str) -> None:
        """Put the save's pages ``a..b-1`` in the ledger, inside the caller's transaction,
        in one statement: SQLite's loop runs without the GIL, where a row at a time
        would take it back for each (and wait for it while vLLM's thread runs)."""
        assert self._ledger is not None
        k = save.blocks
        hashes = save.page_hashes(a, b)
        hash_len = len(hashes[0])
        tokens = np.asarray(save.page_tokens_of(a, b), dtype=_TOKEN_DTYPE)
        self._ledger.conn.execute(_INSERT_RUN, {
            "count": b - a, "keys": save.keys[a * KEY_BYTES: b * KEY_BYTES],
            "first": save.first + a, "hashes": b"".join(hashes), "hw": k * hash_len,
            "hl": hash_len, "blocks": k, "parent": save.parent(a),
            "tokens": tokens.tobytes(), "tw": save.page_tokens * _TOKEN_DTYPE.itemsize,
            "block_size": save.page_tokens // k, "lora_name": save.lora_name,
            "lora_id": save.lora_id, "epoch": epoch})


def _split(joined: bytes, blocks: int) -> list[bytes]:
    size = len(joined) // blocks
    return [joined[i * size:(i + 1) * size] for i in range(blocks)]


def _restorable_everywhere(conns: list[sqlite3.Connection], keys: Sequence[bytes]) -> set[bytes]:
    if not keys:
        return set()
    hexes = [k.hex() for k in keys]
    found = set(hexes)
    for conn in conns:
        found &= restorable(conn, [h for h in hexes if h in found])
        if not found:
            break
    return {bytes.fromhex(h) for h in found}


def to_vllm(events: Sequence[Event]) -> list[Any]:
    """vLLM's event records for ``events`` (block hashes as vLLM gives them to routers:
    ``maybe_convert_block_hash``)."""
    from vllm.distributed.kv_events import (
        MEDIUM_STORAGE,
        AllBlocksCleared,
        BlockRemoved,
        BlockStored,
    )
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    out: list[Any] = []
    for e in events:
        if isinstance(e, Stored):
            out.append(BlockStored(
                block_hashes=[maybe_convert_block_hash(h) for h in e.hashes],
                parent_block_hash=None if e.parent is None else maybe_convert_block_hash(e.parent),
                token_ids=e.tokens, block_size=e.block_size, lora_id=e.lora_id,
                medium=MEDIUM_STORAGE, lora_name=e.lora_name))
        elif isinstance(e, Removed):
            out.append(BlockRemoved(block_hashes=[maybe_convert_block_hash(h) for h in e.hashes],
                                    medium=MEDIUM_STORAGE))
        else:
            out.append(AllBlocksCleared())
    return out
