"""SIGKILL at every step of commit (of a commit that supersedes a root) and of bounded
eviction/collection slices, repeatedly.

A child process runs the protocol with a step hook that SIGKILLs the child the n-th time it
reaches the named step. After each kill the parent reconciles, runs fsck, and checks that
every root acknowledged before the kill restores byte-for-byte and that nothing restored
is ever torn (page contents are a function of the key, so every page read is checkable).
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import random
import secrets
import signal
import time
from multiprocessing.connection import Connection
from pathlib import Path

import pytest

from sparkcache.maintenance_policy import CostModel, SliceBudget, SliceMeter
from sparkcache.store import PageStore, Publication, objects
from sparkcache.store.eviction import EvictionPlan
from sparkcache.store.fileops import COMMIT_STEPS, EVICTION_STEPS
from sparkcache.store.fsck import fsck
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.testing import KillAt, make_root, page_bytes
from tests.conftest import run_children

SIZE = 16384
CHILD_TIMEOUT_S = 60
CTX = mp.get_context("fork")


def pool_key(group: int, pos: int) -> str:
    return hashlib.blake2b(f"{group}/{pos}".encode(), digest_size=16).hexdigest()


def random_root(rng: random.Random) -> tuple[str, list[str]]:
    """Roots share prefixes from three groups (dedup) and end in a unique tail."""
    group = rng.randrange(3)
    keys = [pool_key(group, i) for i in range(rng.randint(1, 3))]
    keys.append(secrets.token_hex(16))
    return secrets.token_hex(16), keys


# Steps each chunk of a file passes through (``objects.WRITE_CHUNK_BYTES``; in the
# children here a record each); the others (a pooled file taken, the rename) happen once
# for the one file a commit writes.
PER_PAGE_STEPS = {"commit.temp_write", "commit.written"}
# Files in the pool before each commit child, more than its commits take, so that every
# page it writes overwrites a pooled file holding another page's bytes (store/pool.py).
POOLED = 24


def seed_pool(store_dir: Path, files: int) -> None:
    """Commit ``files`` one-page roots, remove them and collect their files into the pool."""
    with PageStore(store_dir, 0, lease_seconds=0, pool_bytes=1 << 30) as store:
        ids = []
        for _ in range(files):
            ids.append(secrets.token_hex(16))
            store.commit(make_root(ids[-1], [secrets.token_hex(16)], SIZE))
        store.remove_roots(ids)
        store.collect(files)


def commit_child(store_dir: Path, step: str, nth: int, seed: int, conn: Connection) -> None:
    """Acknowledge ``nth`` commits, then die at ``step`` of the next one.

    Some commits extend the root acknowledged just before them (the next turn of its
    conversation, under a new id), which grows that root in place; the fatal one always
    does, so every step is a step of a commit that changes an acknowledged root in its
    transaction. The fatal commit
    writes three fresh pages (one pack), and per-page steps die at its first, second or
    third record depending on ``nth``, so kills land at different points of a commit.
    Every commit's file is written over a pooled file.
    """
    objects.WRITE_CHUNK_BYTES = 1  # a chunk per record: kills land between records
    seed_pool(store_dir, POOLED)
    occurrence = 1 + nth % 3 if step in PER_PAGE_STEPS else 1
    hook = KillAt(step, occurrence, armed=False)
    store = PageStore(store_dir, 0, hook=hook)
    rng = random.Random(seed)
    previous: tuple[str, list[str]] | None = None
    for i in range(6):
        hook.armed = i == nth
        if previous is not None and (hook.armed or rng.random() < 0.5):
            root_id = secrets.token_hex(16)
            keys = previous[1] + [secrets.token_hex(16) for _ in range(3 if hook.armed else 1)]
            if hook.armed:
                conn.send(("extending", previous[1]))
        else:
            root_id, keys = random_root(rng)
            if hook.armed:
                keys += [secrets.token_hex(16) for _ in range(2)]
        store.commit(make_root(root_id, keys, SIZE))
        conn.send(("ack", root_id, keys))
        previous = (root_id, keys)
    conn.send(("done",))


def batch_child(store_dir: Path, step: str, nth: int, seed: int, conn: Connection) -> None:
    """Acknowledge two roots, then die at ``step`` of a batch of three publications
    (``commit_batch``): the next turn of the second root, the turn after that (relying on
    pages the first writes) and a new root. Steps that come once a publication die in its
    first, second or third depending on ``nth``; the sync comes once a batch."""
    objects.WRITE_CHUNK_BYTES = 1
    seed_pool(store_dir, POOLED)
    occurrence = 1 if step in ("commit.syncing", "commit.durable") else 1 + nth % 3
    hook = KillAt(step, occurrence, armed=False)
    store = PageStore(store_dir, 0, hook=hook)
    rng = random.Random(seed)
    for _ in range(2):
        root_id, keys = random_root(rng)
        store.commit(make_root(root_id, keys, SIZE))
        conn.send(("ack", root_id, keys))
    turn = keys + [secrets.token_hex(16) for _ in range(2)]
    after = turn + [secrets.token_hex(16) for _ in range(2)]
    fresh = [secrets.token_hex(16) for _ in range(3)]
    conn.send(("extending", keys))
    conn.send(("batch", turn + after + fresh))
    hook.armed = True
    store.commit_batch([Publication(make_root(secrets.token_hex(16), ks, SIZE))
                        for ks in (turn, after, fresh)])
    conn.send(("done",))


def eviction_child(store_dir: Path, step: str, nth: int, seed: int, conn: Connection) -> None:
    """Acknowledge six roots, then evict and collect everything in slices as maintenance
    does, each allowed two roots and two pages' bytes: roots are cut short across slices
    (``evict.truncated``), and the kill lands inside one of them. The pool takes four
    files, and later ones lose their back half, then are unlinked: collection's two ways
    out are both crossed."""
    store = PageStore(store_dir, 0, lease_seconds=0, hook=KillAt(step, nth),
                      pool_bytes=4 * (SIZE + HEADER_SIZE), halve_above=4096)
    rng = random.Random(seed)
    ids = []
    for _ in range(6):
        root_id, keys = random_root(rng)
        store.commit(make_root(root_id, keys, SIZE))
        conn.send(("ack", root_id, keys))
        ids.append(root_id)
    conn.send(("removing", ids))
    plan, costs = EvictionPlan(), CostModel()
    # As the maintenance worker does: collection goes on while files wait to be removed
    # (a file cut short takes a slice per piece of its byte budget).
    while ((usage := store.usage()).entries or usage.collectable_objects
           or store.unlinking.objects):
        budget = SliceMeter(SliceBudget(2, 2 * SIZE, 10.0), costs, time.monotonic)
        if usage.collectable_objects or store.unlinking.objects:
            store.collect(3, budget)
        store.evict(budget, plan, need=usage.used_bytes)
    conn.send(("done",))


def run_child(target, *args) -> list[tuple]:
    """Run ``target`` in a child, which must die by SIGKILL at its step; its messages."""
    messages, (code,) = run_children(CTX, [(target, args)], CHILD_TIMEOUT_S)
    assert code == -signal.SIGKILL, f"child was not killed at its step: {messages}"
    return messages


# What the kill must leave behind for reconcile() to clean up (proves the kill landed):
# one of these. A kill before collection frees a record of a pack others still hold
# leaves its blocks in the pack, which reconcile punches.
LEFTOVERS = {
    "commit.recycled": ("temp_files_removed",),
    "commit.temp_write": ("temp_files_removed",),
    "commit.written": ("temp_files_removed",),
    "commit.rename": ("orphan_files_removed",),
    "commit.syncing": ("orphan_files_removed",),
    "commit.durable": ("orphan_files_removed",),
    "commit.index_txn": ("orphan_files_removed",),
    "collect.unlink": ("orphan_files_removed", "pack_ranges_freed"),
    "collect.shrunk": ("orphan_files_removed",),
}


def verify_after_crash(
    store_dir: Path,
    acked: dict[str, list[str]],
    doomed: set[str],
    step: str,
    kept: list[list[str]],
) -> None:
    """``doomed``: acknowledged roots that may have been evicted; ``kept``: the pages of
    roots the killed commit would have grown, which must still be roots as they were."""
    if step in LEFTOVERS:
        seen = fsck(store_dir, grace_seconds=0)  # fsck sees the debris
        assert not seen.ok or seen.unpunched_bytes, seen
    with PageStore(store_dir, 0) as store:
        result = store.reconcile(grace_seconds=0)
    if step in LEFTOVERS:
        assert sum(getattr(result, name) for name in LEFTOVERS[step]) >= 1, result
    report = fsck(store_dir, grace_seconds=0)
    assert report.ok, report.problems
    with PageStore(store_dir, 0) as store:
        stored: dict[str, list[str]] = {}
        for root_id, key in store._rconn.execute(
            "SELECT root_id, key FROM root_pages ORDER BY root_id, pos"
        ):
            stored.setdefault(root_id, []).append(key)
        for keys in kept:
            assert keys in stored.values(), "a commit that never committed changed a root"
        for root_id, keys in acked.items():
            if root_id in doomed:
                # Evicted, or cut from its end: what is left is a prefix of its pages, or,
                # cut and then grown in place by a later commit that extended what was
                # left, a prefix of that commit's (restored below).
                left = stored.get(root_id, [])
                assert any(k[: len(left)] == left for k in acked.values()), root_id
                continue
            # A root grown in place by another id's commit holds every page it held.
            assert root_id in stored or any(k[: len(keys)] == keys for k in stored.values()), (
                f"acknowledged root {root_id} lost"
            )
            bufs = [bytearray(SIZE) for _ in keys]
            assert store.restore(keys, bufs) == len(keys)
            assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]
        # Every root in the index, acknowledged or not, restores only whole, correct pages.
        for keys in stored.values():
            bufs = [bytearray(SIZE) for _ in keys]
            n = store.restore(keys, bufs)
            assert n == len(keys)
            assert [bytes(b) for b in bufs[:n]] == [page_bytes(k, SIZE) for k in keys[:n]]
        assert not list(store.layout.objects_dir.rglob("*.tmp"))
        assert store.counters.quarantined == 0


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_sigkill_during_commit(tmp_path: Path, step: str) -> None:
    store_dir = tmp_path / "store"
    acked: dict[str, list[str]] = {}
    for nth in (1, 2, 3):
        kept = []
        for msg in run_child(commit_child, store_dir, step, nth, nth):
            if msg[0] == "ack":
                acked[msg[1]] = msg[2]
            elif msg[0] == "extending":
                kept.append(msg[1])
        assert kept, "the killed commit extended nothing: the test proves less"
        verify_after_crash(store_dir, acked, set(), step, kept)
    assert len(acked) >= 3


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_sigkill_during_a_batch_leaves_none_of_it(tmp_path: Path, step: str) -> None:
    """A batch is all or none: after a kill at any step of it, no page it added is in a
    root, the root it would have grown is as acknowledged, and fsck is clean."""
    store_dir = tmp_path / "store"
    acked: dict[str, list[str]] = {}
    for nth in (1, 2, 3):
        kept, added = [], []
        for msg in run_child(batch_child, store_dir, step, nth, 200 + nth):
            if msg[0] == "ack":
                acked[msg[1]] = msg[2]
            elif msg[0] == "extending":
                kept.append(msg[1])
            elif msg[0] == "batch":
                added = msg[1]
        assert kept and added, "the child died before its batch: the test proves less"
        verify_after_crash(store_dir, acked, set(), step, kept)
        with PageStore(store_dir, 0) as store:
            assert store.lookup(added[-3:]) == 0
            held = {k for (k,) in store._rconn.execute("SELECT key FROM root_pages")}
            assert not held & set(added) - {k for ks in acked.values() for k in ks}


@pytest.mark.parametrize("step", EVICTION_STEPS)
def test_sigkill_during_eviction(tmp_path: Path, step: str) -> None:
    store_dir = tmp_path / "store"
    acked: dict[str, list[str]] = {}
    doomed: set[str] = set()
    for nth in (1, 2, 3):
        for msg in run_child(eviction_child, store_dir, step, nth, 100 + nth):
            if msg[0] == "ack":
                acked[msg[1]] = msg[2]
            elif msg[0] == "removing":
                doomed.update(msg[1])
        verify_after_crash(store_dir, acked, doomed, step, [])
    assert doomed
