"""The removal log of a rank's index and the KV events made from it (``store.removals``,
``sparkcache.vllm.kv_events``), on a real store: what is announced stored is what every
rank can restore, what is evicted or quarantined is announced removed, and a tracker
started afresh (a vLLM restart) or one whose log lost rows converges on the store."""

from __future__ import annotations

import hashlib
import os
import sqlite3
import stat
from pathlib import Path
from types import SimpleNamespace

import pytest

from sparkcache.identity import Namespace
from sparkcache.store import PageStore, index
from sparkcache.store.removals import log_end, removals_since
from sparkcache.store.testing import make_root
from sparkcache.vllm import kv_events
from sparkcache.vllm.kv_events import Cleared, KVEvents, Removed, Stored

PAGE = 16  # tokens a page, and a vLLM block
SIZE = 4096  # bytes a page
NS = Namespace(model_id="m", dtype="float16", kv_layout="NHD", tp_size=1, rank=0,
               page_tokens=PAGE)


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def conversation(name: str, pages: int) -> SimpleNamespace:
    """A request as the tracker reads it: vLLM's chained block hashes and its tokens."""
    tokens = [(hash(name) + i) % 50_000 for i in range(pages * PAGE)]
    hashes, parent = [], b"none"
    for p in range(pages):
        block = bytes(str(tokens[p * PAGE:(p + 1) * PAGE]), "ascii")
        parent = hashlib.sha256(parent + block).digest()
        hashes.append(parent)
    return SimpleNamespace(block_hashes=hashes, all_token_ids=tokens, lora_request=None)


def page_keys(request: SimpleNamespace) -> list[str]:
    """Store keys standing for the request's pages (the tracker takes them as given)."""
    return [hashlib.blake2b(h, digest_size=16).hexdigest() for h in request.block_hashes]


def raw(keys: list[str]) -> bytes:
    return b"".join(bytes.fromhex(k) for k in keys)


def root_id(n: int) -> str:
    return f"{n:032x}"


def tracker(store_dir: Path, clock: Clock) -> KVEvents:
    """A tracker past its first batch, which carries nothing (``ANNOUNCE_AFTER_PRIMER_S``)."""
    ev = KVEvents(store_dir, 1, clock=clock)
    ev.attach(NS)
    assert ev.take() == [Removed([])]
    clock.t += kv_events.ANNOUNCE_AFTER_PRIMER_S / 2
    assert ev.take() == [Removed([])]  # again: vLLM's publisher may drop the first two
    clock.t += kv_events.ANNOUNCE_AFTER_PRIMER_S / 2
    return ev


def take(ev: KVEvents, clock: Clock) -> list:
    clock.t += kv_events.CHECK_EVERY_S
    return ev.take()


def stored_hashes(events: list) -> set[bytes]:
    return {h for e in events if isinstance(e, Stored) for h in e.hashes}


def removed_hashes(events: list) -> set[bytes]:
    return {h for e in events if isinstance(e, Removed) for h in e.hashes}


def save_and_commit(store: PageStore, ev: KVEvents, *requests: SimpleNamespace) -> None:
    """Each request's pages saved (root ``root_id(n)`` for the n-th) and committed."""
    for n, req in enumerate(requests):
        keys = page_keys(req)
        store.commit(make_root(root_id(n), keys, SIZE))
        ev.note_save(req, raw(keys), PAGE, PAGE)


def announced(store: PageStore, clock: Clock, *requests: SimpleNamespace) -> KVEvents:
    """A tracker that has announced ``requests``, saved and committed (``save_and_commit``)."""
    ev = tracker(store.layout.store_dir, clock)
    save_and_commit(store, ev, *requests)
    assert stored_hashes(take(ev, clock)) == {h for r in requests for h in r.block_hashes}
    return ev


@pytest.fixture
def store(tmp_path: Path):
    s = PageStore(tmp_path / "store", 0, lease_seconds=0)
    yield s
    s.close()


def test_a_page_is_announced_once_durable_with_its_hashes_tokens_and_parent(store) -> None:
    clock = Clock()
    ev = tracker(store.layout.store_dir, clock)
    req = conversation("a", 6)
    keys = page_keys(req)
    ev.note_save(req, raw(keys[:4]), PAGE, PAGE)
    assert take(ev, clock) == []  # sent, not yet stored
    store.commit(make_root(root_id(1), keys[:4], SIZE))
    events = take(ev, clock)
    assert events == [Stored(req.block_hashes[:4], None, req.all_token_ids[:4 * PAGE], PAGE)]
    # The next turn's save covers the whole prompt: only the new pages are announced,
    # their parent the last page announced before.
    ev.note_save(req, raw(keys), PAGE, PAGE)
    store.commit(make_root(root_id(2), keys, SIZE))
    events = take(ev, clock)
    assert events == [Stored(req.block_hashes[4:], req.block_hashes[3],
                             req.all_token_ids[4 * PAGE:], PAGE)]
    assert take(ev, clock) == []
    ledger = store.layout.store_dir / f"events-{NS.seed().hex()}.sqlite"
    assert stat.S_IMODE(os.stat(ledger).st_mode) == 0o600
    ev.close()


def test_evicted_and_quarantined_pages_are_announced_removed(store) -> None:
    clock = Clock()
    a, b = conversation("a", 3), conversation("b", 2)
    ev = announced(store, clock, a, b)
    store.remove_roots([root_id(0)])
    generation = store._wconn.execute("SELECT generation FROM objects WHERE key = ?",
                                      (page_keys(b)[1],)).fetchone()[0]
    store.quarantine(page_keys(b)[1], generation, "test")
    events = take(ev, clock)
    assert removed_hashes(events) == set(a.block_hashes) | {b.block_hashes[1]}
    assert stored_hashes(events) == set()
    assert take(ev, clock) == []  # each once
    ev.close()


def test_a_restarted_tracker_announces_what_the_store_still_holds(store) -> None:
    clock = Clock()
    a, b = conversation("a", 3), conversation("b", 2)
    ev = announced(store, clock, a, b)
    ev.close()
    store.remove_roots([root_id(1)])  # while vLLM is down
    again = tracker(store.layout.store_dir, clock)
    events = take(again, clock)
    assert stored_hashes(events) == set(a.block_hashes)
    assert removed_hashes(events) == set(b.block_hashes)
    # Parents first, each page as it was announced: its hash, parent and tokens.
    assert [e for e in events if isinstance(e, Stored)] == [
        Stored([h], a.block_hashes[p - 1] if p else None,
               a.all_token_ids[p * PAGE:(p + 1) * PAGE], PAGE)
        for p, h in enumerate(a.block_hashes)]
    assert take(again, clock) == []
    again.close()


def test_a_log_that_lost_rows_makes_every_announced_page_checked_again(store) -> None:
    clock = Clock()
    a, b = conversation("a", 2), conversation("b", 2)
    ev = announced(store, clock, a, b)
    store.remove_roots([root_id(0)])
    # The rows were trimmed before this tracker read them.
    store._wconn.execute("DELETE FROM removals")
    store.remove_roots([root_id(1)])
    events = take(ev, clock)
    assert ev.counts.resyncs == 1
    events += take(ev, clock)
    assert removed_hashes(events) == set(a.block_hashes) | set(b.block_hashes)
    ev.close()


def test_reset_clears_and_a_save_never_stored_is_forgotten(store) -> None:
    clock = Clock()
    ev = tracker(store.layout.store_dir, clock)
    req = conversation("a", 2)
    ev.note_save(req, raw(page_keys(req)), PAGE, PAGE)
    clock.t += kv_events.UNCONFIRMED_AFTER_S
    assert take(ev, clock) == []
    assert ev.counts.unconfirmed_saves == 1
    ev.clear()
    assert ev.take() == [Cleared()]
    ev.close()


def test_the_removal_log_says_each_removal_once_and_when_it_cannot(tmp_path: Path) -> None:
    with PageStore(tmp_path / "store", 0, lease_seconds=0) as store:
        conn = store._wconn
        keys = [f"{i:032x}" for i in range(1, 5)]
        other = f"{9:032x}"
        store.commit(make_root(root_id(1), [*keys[:3], other], SIZE))
        store.commit(make_root(root_id(2), keys, SIZE))
        assert removals_since(conn, 0, 10).keys == []
        store.remove_roots([root_id(1)])  # its first pages still referenced by root 2
        assert removals_since(conn, 0, 10).keys == [other]
        store.remove_roots([root_id(2)])
        got = removals_since(conn, 1, 10)
        assert sorted(got.keys) == keys and not got.lost and got.cursor == log_end(conn) == 5
        assert removals_since(conn, got.cursor, 10).keys == []
        assert removals_since(conn, 99, 10).lost  # a cursor of another store
        conn.execute("DELETE FROM removals WHERE seq <= 2")
        assert removals_since(conn, 1, 10).lost
        assert not removals_since(conn, 2, 10).lost


def test_the_removal_log_trims_itself_to_its_last_rows(tmp_path: Path) -> None:
    with PageStore(tmp_path / "store", 0) as store:
        conn = store._wconn
        n = index.REMOVALS_KEPT + 4096
        with index.write_txn(conn):
            conn.executemany("INSERT INTO removals(key) VALUES (?)",
                             ((f"{i:032x}",) for i in range(n)))
        first, count = conn.execute("SELECT min(seq), count(*) FROM removals").fetchone()
        assert count <= index.REMOVALS_KEPT + 1024 and first > n - index.REMOVALS_KEPT - 1024
        assert removals_since(conn, 0, 1).lost


def test_an_index_made_before_the_log_gains_it_when_a_writer_opens_it(tmp_path: Path) -> None:
    with PageStore(tmp_path / "store", 0) as store:
        path = store.layout.index_path
    conn = sqlite3.connect(path)
    for name in ("removals_unref", "removals_quarantined", "removals_deleted", "removals_trim"):
        conn.execute(f"DROP TRIGGER {name}")
    conn.execute("DROP TABLE removals")
    conn.commit()
    ro = index.connect(path, create=False, readonly=True)
    assert log_end(ro) is None
    assert removals_since(ro, 0, 10).keys == []
    with PageStore(tmp_path / "store", 0):
        pass
    assert log_end(ro) == 0
    ro.close()
    conn.close()


def test_a_save_committed_after_the_engine_stopped_is_announced_by_the_next(store) -> None:
    clock = Clock()
    ev = tracker(store.layout.store_dir, clock)
    req = conversation("a", 3)
    keys = page_keys(req)
    ev.note_save(req, raw(keys), PAGE, PAGE)
    assert take(ev, clock) == []
    ev.close()  # vLLM stops while the save is in flight
    store.commit(make_root(root_id(1), keys, SIZE))
    again = tracker(store.layout.store_dir, clock)
    assert stored_hashes(take(again, clock)) == set(req.block_hashes)
    again.close()


def test_with_two_ranks_a_page_is_stored_when_both_hold_it_removed_when_either_drops_it(
        tmp_path: Path) -> None:
    clock = Clock()
    with PageStore(tmp_path / "store", 0, lease_seconds=0) as r0, \
            PageStore(tmp_path / "store", 1, lease_seconds=0) as r1:
        ev = KVEvents(tmp_path / "store", 2, clock=clock)
        ev.attach(NS)
        ev.take()
        clock.t += kv_events.ANNOUNCE_AFTER_PRIMER_S / 2
        ev.take()
        clock.t += kv_events.ANNOUNCE_AFTER_PRIMER_S / 2
        req = conversation("a", 2)
        keys = page_keys(req)
        ev.note_save(req, raw(keys), PAGE, PAGE)
        r0.commit(make_root(root_id(1), keys, SIZE))
        assert take(ev, clock) == []  # rank 1 has not committed it
        r1.commit(make_root(root_id(1), keys, SIZE))
        assert stored_hashes(take(ev, clock)) == set(req.block_hashes)
        r1.remove_roots([root_id(1)])
        assert removed_hashes(take(ev, clock)) == set(req.block_hashes)
        ev.close()


def test_a_removal_vllm_never_took_is_announced_by_the_next_engine(store) -> None:
    clock = Clock()
    a = conversation("a", 2)
    ev = announced(store, clock, a)
    store.remove_roots([root_id(0)])
    clock.t += kv_events.CHECK_EVERY_S
    ev._work(clock.t)  # the removal is found and queued, and vLLM stops before taking it
    ev.close()
    again = tracker(store.layout.store_dir, clock)
    assert removed_hashes(take(again, clock)) == set(a.block_hashes)
    assert take(again, clock) == []  # taken now: forgotten
    again.close()
    third = tracker(store.layout.store_dir, clock)
    assert take(third, clock) == []
    third.close()
