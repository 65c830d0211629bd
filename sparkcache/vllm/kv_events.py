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

The work is bounded per call (``CHECK_EVERY_S``, ``PAGES_PER_CHECK``, ``LOG_ROWS_PER_CHECK``):
it runs on the scheduler's thread.
"""

from __future__ import annotations

import logging
import os
import sqlite3
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from sparkcache.identity import KEY_BYTES, Namespace
from sparkcache.store import index
from sparkcache.store.layout import FILE_MODE, RankLayout
from sparkcache.store.removals import log_end, removals_since, restorable

log = logging.getLogger(__name__)

CHECK_EVERY_S = 0.1
# vLLM's ZMQ publisher, connecting to a router (an endpoint with a host), drops the first
# batch it sends: its socket reads the router's subscription only once it is first used
# (seen with vLLM 0.33: the first of eight batches lost, whatever the wait before it, the
# second lost too when sent 0.1 s after it). Nothing is announced until this long after a
# first batch that carries nothing (a removal of no block).
ANNOUNCE_AFTER_PRIMER_S = 1.0
# Work of one check, so a 300k-token first turn (18,750 pages of 16 tokens) is announced
# over a few checks rather than in one pause of the scheduler.
PAGES_PER_CHECK = 4096
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


@dataclass(frozen=True)
class Cleared:
    pass


Event = Stored | Removed | Cleared


@dataclass
class _Save:
    """A save sent to the workers whose pages are not yet known stored: pages
    ``first..first + len(keys) // KEY_BYTES - 1`` of a request."""

    keys: bytes
    first: int
    hashes: list[bytes]  # ``blocks`` a page
    parent: bytes | None
    tokens: np.ndarray
    lora_name: str | None
    lora_id: int | None
    since: float

    @property
    def pages(self) -> int:
        return len(self.keys) // KEY_BYTES

    def split(self, n: int) -> tuple[_Save, _Save]:
        """Its first ``n`` pages, and the rest."""
        blocks = len(self.hashes) // self.pages
        tokens = len(self.tokens) // self.pages
        head = _Save(self.keys[:n * KEY_BYTES], self.first, self.hashes[:n * blocks],
                     self.parent, self.tokens[:n * tokens], self.lora_name, self.lora_id,
                     self.since)
        tail = _Save(self.keys[n * KEY_BYTES:], self.first + n, self.hashes[n * blocks:],
                     self.hashes[n * blocks - 1], self.tokens[n * tokens:], self.lora_name,
                     self.lora_id, self.since)
        return head, tail


@dataclass
class EventCounts:
    announced_pages: int = 0
    removed_pages: int = 0
    unconfirmed_saves: int = 0
    resyncs: int = 0
    # Saves not watched, by why: vLLM's block hashes could not name their pages.
    reasons: dict[str, int] = field(default_factory=dict)


class Ledger:
    """The announced pages of one namespace (module doc): ``key -> announcement``, and the
    ``epoch`` (process) that last announced each."""

    def __init__(self, path: Path | None) -> None:
        """``path`` None: in memory (a namespace no later process can have: after a
        ``reset_cache``)."""
        if path is not None:
            if not path.exists():
                os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW,
                                 FILE_MODE))
            elif path.is_symlink() or not path.is_file():
                raise OSError(f"{path} is not a plain file")
        self.conn = sqlite3.connect(":memory:" if path is None else path, isolation_level=None)
        # Advisory: a crash may lose the last announcements, each checked before use.
        self.conn.execute("PRAGMA journal_mode=WAL")
        self.conn.execute("PRAGMA synchronous=OFF")
        self.conn.executescript(_LEDGER_SCHEMA)

    def holds(self, keys: Sequence[bytes]) -> set[bytes]:
        out: set[bytes] = set()
        for part in index.chunks(list(keys)):
            marks = ",".join("?" * len(part))
            out.update(k for (k,) in self.conn.execute(
                f"SELECT key FROM pages WHERE key IN ({marks})", tuple(part)))
        return out

    def close(self) -> None:
        self.conn.close()


class KVEvents:
    """The events of one scheduler side (module doc). ``note_save`` as saves are sent,
    ``take`` whenever vLLM asks; every call is cheap when nothing is due."""

    def __init__(self, store_dir: Path, tp_size: int, clock=time.monotonic) -> None:
        self.store_dir = Path(store_dir)
        self.tp_size = tp_size
        self.clock = clock
        self.counts = EventCounts()
        self.epoch = os.urandom(8).hex()
        self._ledger: Ledger | None = None
        self._ns_seed: bytes | None = None
        self._conns: list[sqlite3.Connection | None] = [None] * tp_size
        self._cursors: list[int | None] = [None] * tp_size
        self._saves: deque[_Save] = deque()
        self._out: list[Event] = []
        self._check_at = 0.0
        self._announce_from: float | None = None  # set by the primer (ANNOUNCE_AFTER_PRIMER_S)

    # ------------------------------------------------------------------ inputs

    def attach(self, ns: Namespace, durable: bool = True) -> None:
        """The namespace whose pages are announced; its ledger is opened (``durable``
        False: in memory). Another namespace than before (``reset_cache``) clears."""
        seed = ns.seed()
        if seed == self._ns_seed:
            return
        if self._ledger is not None:
            self._ledger.close()
            self._out.append(Cleared())
            self._saves.clear()
        self._ns_seed = seed
        path = self.store_dir / f"events-{seed.hex()}.sqlite" if durable else None
        self._ledger = Ledger(path)

    def clear(self) -> None:
        """``reset_cache``: every page announced so far is gone for this engine."""
        if self._ledger is not None:
            self._ledger.close()
            self._ledger = None
        self._ns_seed = None
        self._saves.clear()
        self._out.append(Cleared())

    def note_save(self, request: Any, raw_keys: bytes, pages: int, page_tokens: int,
                  hash_block_size: int | None) -> None:
        """A save of the request's pages ``0..pages-1`` (keys ``raw_keys``) was sent."""
        ledger = self._ledger
        if ledger is None or pages <= 0:
            return
        if not hash_block_size or page_tokens % hash_block_size:
            self._skip("block_size")
            return
        blocks = page_tokens // hash_block_size
        hashes = list(getattr(request, "block_hashes", ()) or ())
        if len(hashes) < pages * blocks:
            self._skip("hashes")
            return
        keys = [raw_keys[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(pages)]
        first = _first_not_held(ledger, keys)
        if first >= pages:
            return
        lora = getattr(request, "lora_request", None)
        self._saves.append(_Save(
            keys=raw_keys[first * KEY_BYTES: pages * KEY_BYTES], first=first,
            hashes=hashes[first * blocks: pages * blocks],
            parent=hashes[first * blocks - 1] if first else None,
            tokens=np.asarray(request.all_token_ids[first * page_tokens: pages * page_tokens],
                              dtype=_TOKEN_DTYPE),
            lora_name=getattr(lora, "name", None) if lora is not None else None,
            lora_id=getattr(lora, "adapter_id", None) if lora is not None else None,
            since=self.clock()))

    def _skip(self, reason: str) -> None:
        self.counts.reasons[reason] = self.counts.reasons.get(reason, 0) + 1

    # ------------------------------------------------------------------ output

    def take(self) -> list[Event]:
        """The events since the last call (at most one check's worth)."""
        now = self.clock()
        if self._ledger is not None and now >= self._check_at:
            self._check_at = now + CHECK_EVERY_S
            self._check(now)
        out, self._out = self._out, []
        return out

    def _check(self, now: float) -> None:
        if self._announce_from is None:
            self._out.append(Removed([]))
            self._announce_from = now + ANNOUNCE_AFTER_PRIMER_S
        conns = self._rank_conns()
        if conns is None:
            return
        self._start_cursors(conns)  # removals from the primer on are read
        if now < self._announce_from:
            return
        budget = PAGES_PER_CHECK
        self._read_removals(conns)
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
            ledger.conn.execute("UPDATE pages SET epoch = ''")

    def _remove(self, keys: Sequence[bytes]) -> None:
        ledger = self._ledger
        assert ledger is not None
        held = ledger.holds(keys)
        if not held:
            return
        with index.write_txn(ledger.conn):
            for key in held:
                row = ledger.conn.execute("SELECT hashes, blocks FROM pages WHERE key = ?",
                                          (key,)).fetchone()
                if row is None:
                    continue
                self._out.append(Removed(_split(row[0], row[1])))
                self.counts.removed_pages += 1
                ledger.conn.execute("DELETE FROM pages WHERE key = ?", (key,))

    def _announce_again(self, conns: list[sqlite3.Connection], budget: int) -> int:
        """Pages the ledger holds from another epoch (an earlier process, or a check
        asked for): announced again where every rank can restore them, removed where
        not. Parents before children (``pos``). Returns the pages checked."""
        ledger = self._ledger
        assert ledger is not None
        rows = ledger.conn.execute(
            "SELECT key, pos, hashes, blocks, parent, tokens, block_size, lora_name, lora_id "
            "FROM pages WHERE epoch != ? ORDER BY pos LIMIT ?", (self.epoch, budget)).fetchall()
        if not rows:
            return 0
        present = _restorable_everywhere(conns, [r[0] for r in rows])
        with index.write_txn(ledger.conn):
            for key, _pos, hashes, blocks, parent, tokens, block_size, lora_name, lora_id in rows:
                if key in present:
                    self._out.append(Stored(_split(hashes, blocks), parent,
                                            np.frombuffer(tokens, _TOKEN_DTYPE).tolist(),
                                            block_size, lora_name, lora_id))
                    self.counts.announced_pages += 1
                    ledger.conn.execute("UPDATE pages SET epoch = ? WHERE key = ?",
                                        (self.epoch, key))
                else:
                    self._out.append(Removed(_split(hashes, blocks)))
                    self.counts.removed_pages += 1
                    ledger.conn.execute("DELETE FROM pages WHERE key = ?", (key,))
        return len(rows)

    def _confirm_saves(self, conns: list[sqlite3.Connection], budget: int, now: float) -> None:
        """Announce the pages of the saves found stored, oldest save first."""
        ledger = self._ledger
        assert ledger is not None
        for _ in range(len(self._saves)):
            if budget <= 0:
                return
            save = self._saves.popleft()
            last = save.keys[-KEY_BYTES:]
            if not _restorable_everywhere(conns, [last]):
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
        ledger = self._ledger
        assert ledger is not None
        keys = [save.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES] for i in range(save.pages)]
        held = ledger.holds(keys)
        present = _restorable_everywhere(conns, [k for k in keys if k not in held])
        blocks = len(save.hashes) // save.pages
        page_tokens = len(save.tokens) // save.pages
        block_size = page_tokens // blocks
        run: list[int] = []  # pages of the save announced in one event

        def flush() -> None:
            if not run:
                return
            a, b = run[0], run[-1] + 1
            parent = save.parent if a == 0 else save.hashes[a * blocks - 1]
            self._out.append(Stored(save.hashes[a * blocks: b * blocks], parent,
                                    save.tokens[a * page_tokens: b * page_tokens].tolist(),
                                    block_size, save.lora_name, save.lora_id))
            run.clear()

        with index.write_txn(ledger.conn):
            for i, key in enumerate(keys):
                if key not in present:
                    flush()
                    continue
                run.append(i)
                self.counts.announced_pages += 1
            flush()
            self._insert(save, [i for i, key in enumerate(keys) if key in present], self.epoch)

    def _insert(self, save: _Save, pages: Sequence[int], epoch: str) -> None:
        """Put pages ``pages`` (indexes into the save) in the ledger, inside the caller's
        transaction."""
        assert self._ledger is not None
        blocks = len(save.hashes) // save.pages
        page_tokens = len(save.tokens) // save.pages
        self._ledger.conn.executemany(
            "INSERT OR REPLACE INTO pages VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            [(save.keys[i * KEY_BYTES:(i + 1) * KEY_BYTES], save.first + i,
              b"".join(save.hashes[i * blocks:(i + 1) * blocks]), blocks,
              save.parent if i == 0 else save.hashes[i * blocks - 1],
              save.tokens[i * page_tokens:(i + 1) * page_tokens].tobytes(),
              page_tokens // blocks, save.lora_name, save.lora_id, epoch) for i in pages])

    def close(self) -> None:
        """Saves not yet found stored go into the ledger as pages of no epoch, which the
        next process checks (``_announce_again``): a commit that ends after vLLM stopped
        is announced by the engine that follows."""
        if self._ledger is not None and self._saves:
            try:
                with index.write_txn(self._ledger.conn):
                    for save in self._saves:
                        self._insert(save, range(save.pages), epoch="")
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


def _split(joined: bytes, blocks: int) -> list[bytes]:
    size = len(joined) // blocks
    return [joined[i * size:(i + 1) * size] for i in range(blocks)]


def _first_not_held(ledger: Ledger, keys: Sequence[bytes]) -> int:
    """The first of a key chain's pages the ledger does not hold. Pages a root holds are
    a prefix of its chain, and so are the pages announced of it: a binary search."""
    lo, hi = 0, len(keys)  # keys[:lo] held; keys[hi:] not
    while lo < hi:
        mid = (lo + hi) // 2
        if ledger.conn.execute("SELECT 1 FROM pages WHERE key = ?", (keys[mid],)).fetchone():
            lo = mid + 1
        else:
            hi = mid
    return lo


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
