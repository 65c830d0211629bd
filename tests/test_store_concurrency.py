"""Publication racing collection: never lost, never referencing a collected file."""

from __future__ import annotations

import multiprocessing as mp
import os
import random
import secrets
import sqlite3
from multiprocessing.connection import Connection
from multiprocessing.synchronize import Event
from pathlib import Path

import pytest
from eviction_util import UNLIMITED, meter

from sparkcache.store import PageStore
from sparkcache.store.eviction import EvictionPlan
from sparkcache.store.fsck import fsck
from sparkcache.store.layout import object_name
from sparkcache.store.testing import make_root, page_bytes
from tests.conftest import run_children

SIZE = 4096
CHILD_TIMEOUT_S = 120
CTX = mp.get_context("fork")
SHARED = [secrets.token_hex(16) for _ in range(6)]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_commit_retries_when_a_deduplicated_page_is_collected_meanwhile(
    tmp_path: Path,
) -> None:
    clock = Clock()
    evictor = PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock)
    first, shared = secrets.token_hex(16), secrets.token_hex(16)
    fired: list[str] = []
    armed: list[bool] = []

    def collect_shared_page(step: str) -> None:
        # Between the committer's dedup check and its transaction, another process
        # removes the only root holding the shared page and collects the page.
        if step == "commit.syncing" and armed and not fired:
            fired.append(step)
            evictor.remove_roots([first])
            assert evictor.collect(10).objects == 2

    committer = PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock, hook=collect_shared_page)
    committer.commit(make_root(first, [shared, secrets.token_hex(16)], SIZE))
    clock.now += 1
    armed.append(True)
    keys = [shared, secrets.token_hex(16)]
    result = committer.commit(make_root(secrets.token_hex(16), keys, SIZE))
    assert fired and result.retries == 1
    bufs = [bytearray(SIZE), bytearray(SIZE)]
    assert evictor.restore(keys, bufs) == 2
    assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
    committer.close()
    evictor.close()
    assert fsck(tmp_path / "s", grace_seconds=0).ok


@pytest.mark.parametrize("change", ["removed", "cut", "quarantined", "replaced"])
def test_a_held_prefix_that_changes_before_the_transaction_is_looked_at_again(
    tmp_path: Path, change: str,
) -> None:
    """A commit growing a root takes its pages as held by that root before its transaction
    and checks inside it that they still are, without reading them all again: the root
    removed, cut short below the end of the held prefix (eviction's bounded slices cut
    roots from their end), one of its pages quarantined, or the root stored again under
    its id by another committer with keys that are not one chain and the same last key
    (its old pages collected), all between the two, each make the commit look again and
    write what is no longer held."""
    clock = Clock()
    other = PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock)
    keys = [secrets.token_hex(16) for _ in range(8)]
    fired: list[str] = []

    def change_the_held_root(step: str) -> None:
        if step != "commit.syncing" or fired or not armed:
            return
        fired.append(step)
        if change == "removed":
            assert other.remove_roots([first]).removed == (first,)
        elif change == "replaced":
            clock.now += 1
            other.commit(make_root(first, [*(secrets.token_hex(16) for _ in range(5)),
                                           keys[5]], SIZE))
            assert other.collect(10).objects == 5
        elif change == "cut":
            other.evict(meter(nbytes=2 * SIZE), EvictionPlan(), UNLIMITED)
            assert other.lookup(keys[:6]) == 4
        else:
            (gen,) = other._rconn.execute("SELECT generation FROM objects WHERE key = ?",
                                          (keys[2],)).fetchone()
            other.quarantine(keys[2], gen, "test")

    armed: list[bool] = []
    committer = PageStore(tmp_path / "s", 0, lease_seconds=0, clock=clock,
                          hook=change_the_held_root)
    first = secrets.token_hex(16)
    committer.commit(make_root(first, keys[:6], SIZE))
    clock.now += 1
    armed.append(True)
    result = committer.commit(make_root(secrets.token_hex(16), keys, SIZE))
    assert fired and result.retries == 1
    bufs = [bytearray(SIZE) for _ in keys]
    assert other.restore(keys, bufs) == len(keys)
    assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
    committer.close()
    other.close()
    assert fsck(tmp_path / "s", grace_seconds=0).ok


def committer(store_dir: Path, seed: int, done: Event, conn: Connection) -> None:
    rng = random.Random(seed)
    store = PageStore(store_dir, 0, lease_seconds=0)
    for _ in range(120):
        keys = [*rng.sample(SHARED, rng.randint(1, 3)), secrets.token_hex(16)]
        root_id = secrets.token_hex(16)
        store.commit(make_root(root_id, keys, SIZE))
        conn.send(("ack", root_id, keys))
    store.close()
    done.set()


def evictor(store_dir: Path, seed: int, done: Event, conn: Connection) -> None:
    """Evict and collect in small random slices for as long as the committer runs."""
    rng = random.Random(seed)
    store = PageStore(store_dir, 0, lease_seconds=0)
    while not done.is_set():
        victims = store.select_victims(rng.randint(1, 4))
        removed = store.remove_roots(victims).removed
        conn.send(("removed", list(removed)))
        store.collect(rng.randint(1, 8))
    store.close()


def run_all(procs: list[tuple], timeout: float) -> list[tuple]:
    """Run every (target, args) child to a clean exit; their messages."""
    messages, codes = run_children(CTX, procs, timeout)
    assert codes == [0] * len(procs)
    return messages


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_concurrent_commits_and_eviction_lose_nothing(tmp_path: Path, seed: int) -> None:
    store_dir = tmp_path / "store"
    PageStore(store_dir, 0).close()
    done = CTX.Event()
    children = [(committer, (store_dir, seed, done)), (evictor, (store_dir, seed + 10, done))]
    messages = run_all(children, CHILD_TIMEOUT_S)
    acked = {m[1]: m[2] for m in messages if m[0] == "ack"}
    removed = {r for m in messages if m[0] == "removed" for r in m[1]}
    assert len(acked) == 120 and removed
    report = fsck(store_dir, grace_seconds=0)
    assert report.ok, report.problems
    with PageStore(store_dir, 0) as store:
        present = {r for (r,) in store._rconn.execute("SELECT id FROM roots")}
        assert set(acked) - removed <= present, "an acknowledged publication was lost"
        assert present <= set(acked)
        for root_id in present:
            keys = acked[root_id]
            bufs = [bytearray(SIZE) for _ in keys]
            assert store.restore(keys, bufs) == len(keys), f"root {root_id} lost a page"
            assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]


def test_reconcile_beside_a_commit_never_strands_it(tmp_path: Path) -> None:
    """A reconcile that sweeps a commit's renamed-but-unindexed files forces a rewrite."""
    sweeper = PageStore(tmp_path / "s", 0)
    swept = []

    def sweep(step: str) -> None:
        if step == "commit.syncing" and not swept:
            swept.append(sweeper.reconcile(grace_seconds=0))

    committer = PageStore(tmp_path / "s", 0, hook=sweep)
    keys = [secrets.token_hex(16) for _ in range(3)]
    result = committer.commit(make_root(secrets.token_hex(16), keys, SIZE))
    assert swept[0].orphan_files_removed == 1  # the commit's pack of three
    assert result.retries == 1
    bufs = [bytearray(SIZE) for _ in keys]
    assert sweeper.restore(keys, bufs) == 3
    assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
    committer.close()
    sweeper.close()
    assert fsck(tmp_path / "s", grace_seconds=0).ok


def test_a_sweep_lists_its_directory_outside_the_write_lock_and_misses_no_commit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A sweep listed and stat-ed a whole fan-out directory inside its write transaction:
    on a store of cold inodes, every commit waited for that. Now a commit can take the
    lock while the directory is listed, and one landing between the listing and the
    transaction is neither swept nor called missing; the old orphan beside it is swept."""
    store_dir = tmp_path / "s"
    sweeper = PageStore(store_dir, 0)
    committer = PageStore(store_dir, 0)
    fan = "ab"
    before = [fan + secrets.token_hex(15) for _ in range(2)]
    committer.commit(make_root(secrets.token_hex(16), before, SIZE))
    orphan = sweeper.layout.objects_dir / fan / object_name(fan + "0" * 30, "1" * 16)
    orphan.write_bytes(b"junk")
    during = [fan + secrets.token_hex(15) for _ in range(2)]
    real_listdir = os.listdir

    def listdir_then_commit(path):  # what a commit does while a fan-out dir is listed
        names = real_listdir(path)
        if isinstance(path, int) and not listed:
            listed.append(path)
            probe = sqlite3.connect(sweeper.layout.index_path, timeout=0)
            try:
                probe.execute("BEGIN IMMEDIATE")  # "database is locked" if the sweep held it
                probe.execute("ROLLBACK")
            finally:
                probe.close()
            committed.append(committer.commit(make_root(secrets.token_hex(16), during, SIZE)))
        return names

    listed: list = []
    committed: list = []
    monkeypatch.setattr(os, "listdir", listdir_then_commit)
    result = sweeper.sweep([fan], grace_seconds=0)
    monkeypatch.undo()
    assert committed and (result.orphan_files_removed, result.objects_missing) == (1, 0)
    assert not orphan.exists()
    for keys in (before, during):
        bufs = [bytearray(SIZE) for _ in keys]
        assert sweeper.restore(keys, bufs) == len(keys)
        assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
    committer.close()
    sweeper.close()
    assert fsck(store_dir, grace_seconds=0).ok
