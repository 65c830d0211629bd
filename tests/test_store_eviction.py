"""Bounded eviction (``PageStore.evict``, ``store/eviction.py``) and budgeted collection:
roots cut from their end stay valid, bytes freed are counted apart from roots evicted,
roots that free nothing are passed over, read-leased roots are never taken while
conversation leases yield at the cap, oldest first, no step exceeds
its budget (injected clock), every query is an index walk, and a step costs the same
with 10,000 roots as with 1,000,000."""

from __future__ import annotations

import errno
import hashlib
import os
import random
import statistics
import threading
import time
from pathlib import Path

import pytest
from eviction_util import UNLIMITED, FakeClock, evict, meter

from sparkcache.maintenance_policy import CostModel
from sparkcache.store import PageStore, index
from sparkcache.store.eviction import (
    READ_GRACE_S,
    RECORD,
    ROW,
    SYNC,
    TXN,
    UNLINK,
    WALK_FACTOR,
    EvictionPlan,
)
from sparkcache.store.fileops import FileOps
from sparkcache.store.fsck import fsck
from sparkcache.store.testing import make_root, object_file, page_bytes, populate

SIZE = 4096
NOW = 1_000_000.0


def key(tag: str) -> str:
    return hashlib.blake2b(tag.encode(), digest_size=16).hexdigest()


def chain(tag: str, n: int) -> list[str]:
    return [key(f"{tag}/{i}") for i in range(n)]


class LeaseClock:
    """The store's wall clock (leases, last access), moved by hand."""

    def __init__(self) -> None:
        self.now = NOW

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def lease_clock() -> LeaseClock:
    return LeaseClock()


@pytest.fixture
def store(tmp_path: Path, lease_clock: LeaseClock):
    with PageStore(tmp_path / "s", 0, lease_seconds=10, clock=lease_clock) as s:
        yield s


def commit(store: PageStore, keys: list[str], lease_clock: LeaseClock) -> str:
    """Commit a root (its access one second after the previous one's, so LRU order is
    commit order); its id."""
    root_id = os.urandom(16).hex()
    store.commit(make_root(root_id, keys, SIZE))
    lease_clock.now += 1
    return root_id


def pages_of(store: PageStore) -> dict[str, list[str]]:
    roots: dict[str, list[str]] = {}
    for root_id, k in store._rconn.execute(
            "SELECT root_id, key FROM root_pages ORDER BY root_id, pos"):
        roots.setdefault(root_id, []).append(k)
    return roots


def assert_clean(store: PageStore) -> None:
    report = fsck(store.layout.store_dir, grace_seconds=0)
    assert report.ok, report.problems


def test_a_root_cut_from_its_end_stays_a_valid_shorter_root(
        store: PageStore, lease_clock: LeaseClock) -> None:
    keys = chain("a", 10)
    root_id = commit(store, keys, lease_clock)
    lease_clock.now += 100  # its lease is over
    result = store.evict(meter(nbytes=3 * SIZE), EvictionPlan(), UNLIMITED)
    assert (result.removed, result.cut, result.pages) == ((), 1, 3)
    assert result.reclaimed_objects == 3 and result.reclaimed_bytes == 3 * SIZE
    assert pages_of(store) == {root_id: keys[:7]}
    usage = store.usage()
    assert usage.entries == 1 and usage.collectable_objects == 3
    assert usage.collectable_bytes == 3 * SIZE and usage.used_bytes == 10 * SIZE
    assert_clean(store)  # refcounts, page counts, totals (roots' bytes, garbage) all hold
    assert store.lookup(keys) == 7
    bufs = [bytearray(SIZE) for _ in keys]
    assert store.restore(keys, bufs) == 7
    assert [bytes(b) for b in bufs[:7]] == [page_bytes(k, SIZE) for k in keys[:7]]
    assert store.collect(100).objects == 3
    assert store.usage().used_bytes == 7 * SIZE and store.usage().collectable_objects == 0
    assert_clean(store)


def test_evicted_roots_and_reclaimed_bytes_are_counted_apart(
        store: PageStore, lease_clock: LeaseClock) -> None:
    """Conversations sharing a system prompt: evicting one frees only its own pages; the
    last one to go frees the prompt too."""
    prompt = chain("system", 4)
    ids = [commit(store, prompt + chain(f"c{i}", 3), lease_clock) for i in range(3)]
    lease_clock.now += 100
    first = evict(store, 1)
    assert first.removed == (ids[0],) and first.pages == 7
    assert first.reclaimed_objects == 3 and first.reclaimed_bytes == 3 * SIZE
    rest = evict(store, 2)
    assert rest.removed == tuple(ids[1:]) and rest.pages == 14
    assert rest.reclaimed_bytes == (3 + 3 + 4) * SIZE  # the prompt went with the last one
    assert store.usage().entries == 0
    assert store.collect(100).objects == 13
    assert store.usage().used_bytes == 0
    assert_clean(store)


def add_prefix_root(store: PageStore, keys: list[str], last_access: float) -> str:
    """A root holding ``keys``, all held by another root too (an index written before
    supersession keeps such roots): evicting it frees nothing."""
    root_id = os.urandom(16).hex()
    with store._wconn as conn:
        conn.execute("INSERT INTO roots VALUES (?, ?, ?, ?, ?, ?)",
                     (root_id, len(keys) * SIZE, len(keys), last_access, last_access,
                      last_access))
        conn.executemany("INSERT INTO root_pages VALUES (?, ?, ?)",
                         [(root_id, pos, k) for pos, k in enumerate(keys)])
        conn.executemany("UPDATE objects SET refcount = refcount + 1 WHERE key = ?",
                         [(k,) for k in keys])
    return root_id


def test_roots_that_free_nothing_are_passed_over_while_bytes_are_needed(
        store: PageStore, lease_clock: LeaseClock) -> None:
    long = chain("long", 8)
    holder = commit(store, long, lease_clock)
    own = commit(store, chain("own", 2), lease_clock)
    # Many roots older than both, each a prefix of the long one: more than one step walks.
    prefixes = [add_prefix_root(store, long[: 1 + i % 7], NOW - 100 + i) for i in range(40)]
    assert_clean(store)
    lease_clock.now += 100
    plan = EvictionPlan()
    skipped, steps = 0, 0
    while not (result := store.evict(meter(roots=2), plan, SIZE)).pages:
        assert result.skipped <= WALK_FACTOR * 2  # bounded work per step
        skipped += result.skipped
        steps += 1
    # The cursor went on past what earlier steps passed over, to the long root, whose
    # last page no prefix root holds: the one page needed.
    assert steps >= 2 and skipped + result.skipped == len(prefixes)
    assert (result.cut, result.pages, result.reclaimed_bytes) == (1, 1, SIZE)
    roots = pages_of(store)
    assert roots[holder] == long[:7] and roots[own] == chain("own", 2)
    # Needing more, the rest of it goes (its pages live on in the prefix roots), then own.
    result = store.evict(meter(roots=2), plan, 3 * SIZE)
    assert result.removed == (holder, own) and result.reclaimed_bytes == 2 * SIZE
    assert_clean(store)


def read_leased(store: PageStore, now: float) -> set[str]:
    return {r for (r,) in store._rconn.execute(
        "SELECT root_id FROM reads WHERE until > ?", (now,))}


def conversation_leased(store: PageStore, now: float) -> set[str]:
    return {r for (r,) in store._rconn.execute(
        "SELECT id FROM roots WHERE lease_until > ?", (now,))}


def test_read_leased_roots_are_never_taken(store: PageStore, lease_clock: LeaseClock) -> None:
    """Lookups and captures lease prefixes (read leases) while eviction, needing more than
    the store holds, takes every other root, conversation leases and all."""
    rng = random.Random(5)
    chains = {commit(store, chain(f"r{i}", rng.randint(1, 6)), lease_clock): i
              for i in range(30)}
    plan = EvictionPlan()
    taken_under_lease = 0
    for _ in range(60):
        lease_clock.now += rng.uniform(0, 0.5)  # conversation leases (10 s) mostly run
        for root_id in rng.sample(list(chains), 3):  # commit order: the same every run
            keys = pages_of(store).get(root_id)
            if keys:
                store.lease_prefix(keys, rng.uniform(1, 20))
        before = pages_of(store)
        protected = read_leased(store, lease_clock.now)
        leased = conversation_leased(store, lease_clock.now)
        result = store.evict(meter(roots=rng.randint(1, 3), nbytes=rng.randint(1, 8) * SIZE),
                             plan, UNLIMITED)
        store.collect(rng.randint(0, 10))
        after = pages_of(store)
        for r in protected:
            assert after.get(r) == before[r], "a read-leased root lost pages"
        taken_under_lease += sum(after.get(r) != before[r] for r in leased - protected)
        assert result.yielded_bytes <= result.reclaimed_bytes
    assert taken_under_lease > 0, "no conversation lease yielded: the test proves nothing"
    assert_clean(store)


def test_at_the_cap_conversation_leases_yield_oldest_first(
        tmp_path: Path, lease_clock: LeaseClock) -> None:
    """Roots whose lease is over go first, least recently used first; then, while the goal
    is not met, the roots whose 300 s lease still runs, the oldest lease first, each
    counted as yielded; a read-leased root among them stays."""
    with PageStore(tmp_path / "s", 0, lease_seconds=300, clock=lease_clock) as store:
        old = [commit(store, chain(f"old{i}", 2), lease_clock) for i in range(2)]
        lease_clock.now += 400  # their leases are over
        young_keys = [chain(f"young{i}", 2) for i in range(5)]
        young = [commit(store, keys, lease_clock) for keys in young_keys]
        assert conversation_leased(store, lease_clock.now) == set(young)
        assert store.lease_prefix(young_keys[0], 30) == 2  # the oldest lease: read-leased
        plan = EvictionPlan()
        first = store.evict(meter(), plan, 2 * 2 * SIZE)
        assert first.removed == tuple(old) and first.yielded_roots == 0
        second = store.evict(meter(), plan, 2 * 2 * SIZE)
        assert second.removed == (young[1], young[2])
        assert (second.yielded_roots, second.yielded_bytes) == (2, 4 * SIZE)
        assert second.read_leased == 1
        assert set(pages_of(store)) == {young[0], young[3], young[4]}
        # Once its read lease is over, it goes as the oldest lease it is.
        lease_clock.now += 31
        third = store.evict(meter(), EvictionPlan(), 2 * SIZE)
        assert third.removed == (young[0],) and third.yielded_roots == 1
        assert_clean(store)


def test_a_read_lease_on_a_prefix_protects_the_root_the_next_turn_grows(
        tmp_path: Path, lease_clock: LeaseClock) -> None:
    """A capture relying on a stored prefix leases it; the commit of the longer turn (a
    new request id) grows the prefix root in place, and the read lease protects it until
    it runs out."""
    with PageStore(tmp_path / "s", 0, lease_seconds=300, clock=lease_clock) as store:
        keys = chain("conv", 6)
        first = commit(store, keys[:3], lease_clock)
        assert store.lease_prefix(keys[:3], 30) == 3
        commit(store, keys, lease_clock)
        assert pages_of(store) == {first: keys}
        assert read_leased(store, lease_clock.now) == {first}
        assert not store.evict(meter(), EvictionPlan(), UNLIMITED).pages
        lease_clock.now += 30
        assert store.evict(meter(), EvictionPlan(), UNLIMITED).removed == (first,)
        assert store._rconn.execute("SELECT count(*) FROM reads").fetchone() == (0,)
        assert_clean(store)


def lease(store: PageStore, keys: list[str], lease_id: int, now: float,
          seconds: float = 30) -> None:
    """A lookup's read lease of ``keys`` taken at ``now``, written as maintenance does."""
    store.record_lease(keys[-1], len(keys) - 1, now, now + seconds, lease_id)
    store.flush_touches()


def release(store: PageStore, lease_id: int) -> None:
    store.record_release(lease_id)
    store.flush_touches()


def test_a_read_lease_ends_with_its_release_and_no_other_reads(
        store: PageStore, lease_clock: LeaseClock) -> None:
    """Two reads of one root: the release of one (twice over, as a duplicated message
    would) leaves the other's lease holding; the second release ends protection at once,
    long before either lease's bound."""
    keys = chain("shared", 4)
    root = commit(store, keys, lease_clock)
    lease_clock.now += 100  # its conversation lease is over
    lease(store, keys, 1, lease_clock.now)
    lease(store, keys[:2], 2, lease_clock.now)  # a shorter prefix: the same root
    for _ in range(2):
        release(store, 1)
        assert not store.evict(meter(), EvictionPlan(), UNLIMITED).pages
        assert read_leased(store, lease_clock.now) == {root}
    release(store, 2)
    assert store.evict(meter(), EvictionPlan(), UNLIMITED).removed == (root,)
    assert store.counters.read_releases == 3
    assert_clean(store)


def test_a_release_batched_with_its_lease_ends_it_whatever_their_order(
        store: PageStore, lease_clock: LeaseClock) -> None:
    """Maintenance may batch a release before its lease (they come by different rings):
    leases are written first, so it still ends."""
    keys = chain("k", 3)
    commit(store, keys, lease_clock)
    store.record_release(5)
    store.record_lease(keys[-1], 2, lease_clock.now, lease_clock.now + 30, 5)
    store.flush_touches()
    assert read_leased(store, lease_clock.now) == set()
    with pytest.raises(ValueError, match="lease id above 0"):
        store.record_release(0)


def test_a_lost_release_ends_protection_at_the_bound(
        store: PageStore, lease_clock: LeaseClock) -> None:
    """No release comes: the lease holds to its ``until``, then its row goes with the
    next lease written, so the table keeps only the running reads."""
    keys = chain("lost", 3)
    root = commit(store, keys, lease_clock)
    lease_clock.now += 100
    lease(store, keys, 7, lease_clock.now, seconds=5)
    assert not store.evict(meter(), EvictionPlan(), UNLIMITED).pages
    lease_clock.now += 5
    other = chain("other", 1)
    commit(store, other, lease_clock)
    lease(store, other, 8, lease_clock.now)
    assert store._rconn.execute("SELECT lease FROM reads").fetchall() == [(8,)]
    assert store.evict(meter(), EvictionPlan(), UNLIMITED).removed == (root,)


def test_at_the_cap_read_leases_past_their_grace_yield_young_ones_hold(
        tmp_path: Path, lease_clock: LeaseClock) -> None:
    """Reads whose release never came hold while anything else can go; once a walk
    finds nothing else, those older than READ_GRACE_S yield for the rest of the episode,
    in lease order, counted; one taken within the grace holds. A new episode honours them
    all again."""
    with PageStore(tmp_path / "s", 0, lease_seconds=300, clock=lease_clock) as store:
        keys = {name: chain(name, 2) for name in ("stale1", "stale2", "young", "free")}
        roots = {name: commit(store, k, lease_clock) for name, k in keys.items()}
        lease(store, keys["stale1"], 1, lease_clock.now, seconds=120)
        lease(store, keys["stale2"], 2, lease_clock.now, seconds=120)
        lease_clock.now += READ_GRACE_S
        lease(store, keys["young"], 3, lease_clock.now, seconds=120)
        lease_clock.now += 1  # stale1 and 2 are past their grace, young is not
        plan = EvictionPlan()
        first = store.evict(meter(), plan, 2 * 2 * SIZE)
        assert first.removed == (roots["free"],) and first.read_leased == 3
        assert plan.reads_yield and first.read_yielded == 0
        second = store.evict(meter(roots=1), plan, 2 * SIZE)
        assert second.removed == (roots["stale1"],) and second.read_yielded == 1
        plan.restart()  # the next episode
        assert not store.evict(meter(), plan, UNLIMITED).pages
        third = store.evict(meter(), plan, UNLIMITED)
        assert third.removed == (roots["stale2"],)
        assert set(pages_of(store)) == {roots["young"]}
        assert_clean(store)


def test_a_commit_ends_its_captures_lease_and_keeps_a_lookups(
        store: PageStore, lease_clock: LeaseClock) -> None:
    """Capture leases the prefix it does not copy (named by its publication); the commit
    of the longer turn ends that lease in its transaction, while a lookup's lease of the
    same prefix stays on the root the turn grows, and holds."""
    keys = chain("conv", 6)
    first = commit(store, keys[:3], lease_clock)
    assert store.lease_prefix(keys[:3], 30, lease=77) == 3
    lease(store, keys[:3], 78, lease_clock.now)
    store.commit(make_root(os.urandom(16).hex(), keys, SIZE), release=77)
    assert pages_of(store) == {first: keys}
    assert store._rconn.execute("SELECT root_id, lease FROM reads").fetchall() == [(first, 78)]
    lease_clock.now += 20  # its conversation lease (10 s) is over, the lookup's is not
    assert not store.evict(meter(), EvictionPlan(), UNLIMITED).pages
    release(store, 78)
    assert store.evict(meter(), EvictionPlan(), UNLIMITED).removed == (first,)
    assert_clean(store)


def test_a_victim_leased_after_it_was_planned_is_dropped(
        store: PageStore, lease_clock: LeaseClock) -> None:
    a = commit(store, chain("a", 4), lease_clock)
    b_keys = chain("b", 4)
    b = commit(store, b_keys, lease_clock)
    lease_clock.now += 100
    plan = EvictionPlan()
    # Plans both, cuts two pages of the first within the byte budget.
    first = store.evict(meter(roots=2, nbytes=2 * SIZE), plan, UNLIMITED)
    assert first.cut == 1 and [v.root_id for v in plan.victims] == [a, b]
    assert store.lease_prefix(b_keys, 50) == 4  # a lookup counted b
    second = store.evict(meter(), plan, UNLIMITED)
    assert second.removed == (a,) and second.dropped == 1
    assert pages_of(store) == {b: b_keys} and not plan.victims
    assert_clean(store)


class SlowDisk(FileOps):
    """Unlinks, and records punched out of packs, that take 3 ms of the injected clock."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock

    def unlink(self, name: str, dir_fd: int) -> None:
        self.clock.now += 0.003
        super().unlink(name, dir_fd)

    def punch_hole(self, fd: int, offset: int, length: int) -> bool:
        self.clock.now += 0.003
        return super().punch_hole(fd, offset, length)


def test_no_step_exceeds_its_root_byte_or_time_budget(tmp_path: Path) -> None:
    """Slices of collection then eviction, each under one meter, with an injected clock:
    every reading costs 50 us and every unlink 3 ms. Roots of 1 to 40 pages, some
    sharing a prompt. No slice goes past 3 roots, 24 pages' bytes or 20 ms, and they get
    the store down to the goal."""
    clock = FakeClock(tick=50e-6)
    lease_clock = LeaseClock()
    rng = random.Random(3)
    budget = {"roots": 3, "nbytes": 24 * SIZE, "seconds": 0.020}
    with PageStore(tmp_path / "s", 0, lease_seconds=1, clock=lease_clock,
                   fileops=SlowDisk(clock)) as store:
        prompt = chain("prompt", 5)
        for i in range(60):
            own = chain(f"c{i}", rng.randint(1, 40))
            commit(store, prompt + own if i % 3 == 0 else own, lease_clock)
        lease_clock.now += 10
        goal = store.usage().used_bytes // 4
        costs, plan, slices = CostModel(), EvictionPlan(), 0
        while (usage := store.usage()).used_bytes > goal:
            m = meter(**budget, clock=clock, costs=costs)
            if usage.collectable_objects or store.unlinking.objects:
                store.collect(1024, m)
            need = usage.used_bytes - usage.collectable_bytes - goal
            if need > 0:
                store.evict(m, plan, need)
            assert m.roots <= budget["roots"] and m.bytes <= budget["nbytes"]
            # (clock.now: the test's own reading is no part of the slice's work.)
            assert clock.now - m.started <= budget["seconds"], slices
            assert not m.fresh  # every slice made progress
            slices += 1
        assert goal - 40 * SIZE < store.usage().used_bytes <= goal
        assert slices > 10
    report = fsck(tmp_path / "s", grace_seconds=0)
    assert report.ok, report.problems


def test_a_slice_that_waits_for_a_commits_lock_keeps_its_budget_for_work(
        tmp_path: Path, lease_clock: LeaseClock) -> None:
    """Another writer (a commit) holds the index's write lock for 0.3 s while a slice
    evicts and collects: the slice reports the wait, its work is judged without it, and
    its transactions' learnt cost is not the wait (real clock)."""
    with PageStore(tmp_path / "s", 0, lease_seconds=1, clock=lease_clock) as store:
        for i in range(4):
            commit(store, chain(f"c{i}", 20), lease_clock)
        lease_clock.now += 10
        costs = CostModel()
        for step in ("evict", "collect"):
            locked = threading.Event()

            def hold(locked: threading.Event = locked) -> None:
                holder = index.connect(store.layout.index_path, create=False)
                try:
                    holder.execute("BEGIN IMMEDIATE")
                    locked.set()
                    time.sleep(0.3)
                    holder.execute("COMMIT")
                finally:
                    holder.close()

            thread = threading.Thread(target=hold)
            thread.start()
            assert locked.wait(10)
            m = meter(seconds=0.2, costs=costs, clock=time.monotonic)
            if step == "evict":
                assert store.evict(m, EvictionPlan(), 10 * SIZE).reclaimed_bytes >= 10 * SIZE
            else:
                assert store.collect(1024, m).objects + store.unlinking.objects > 0
            thread.join()
            assert m.waited >= 0.2, step
            assert m.worked_s(time.monotonic()) < 0.2, step
            assert costs.estimate(TXN) < 0.1, step


def explain_each(conn, statements: list[str]) -> list[str]:
    plans = []
    for sql in statements:
        if sql.split()[0].upper() not in ("SELECT", "UPDATE", "DELETE", "INSERT"):
            continue
        plans += [f"{row[3]}  <-  {sql[:80]}" for row in conn.execute("EXPLAIN QUERY PLAN " + sql)]
    return plans


def test_every_query_of_a_slice_walks_an_index(tmp_path: Path, lease_clock: LeaseClock) -> None:
    """usage(), collection, eviction with its requests, as a slice runs them: no table scan,
    no sort; the two SCANs allowed read only what they return (the garbage's partial index,
    stopped by LIMIT) or a table of four rows (totals)."""
    with PageStore(tmp_path / "s", 0, lease_seconds=0, clock=lease_clock) as store:
        prompt = chain("p", 3)
        for i in range(20):
            commit(store, prompt + chain(f"x{i}", 5), lease_clock)
        evict(store, 2)  # garbage to collect
        store.record_access(prompt[-1], 2, lease_clock.now)
        store.record_lease(chain("x7", 5)[-1], 7, lease_clock.now, lease_clock.now + 5, 9)
        store.record_release(8)
        statements: list[str] = []
        store._wconn.set_trace_callback(statements.append)
        store._rconn.set_trace_callback(statements.append)
        m = meter(roots=3, nbytes=4 * SIZE)
        store.usage()
        store.collect(1024, m)
        store.evict(meter(roots=3, nbytes=12 * SIZE), EvictionPlan(), UNLIMITED)
        store._wconn.set_trace_callback(None)
        store._rconn.set_trace_callback(None)
        plans = explain_each(store._wconn, statements)
    assert any("roots_lru" in p for p in plans) and any("objects_garbage" in p for p in plans)
    allowed = ("SCAN objects USING INDEX objects_garbage", "SCAN totals")
    bad = [p for p in plans if ("SCAN" in p and not p.startswith(allowed)) or "TEMP B-TREE" in p]
    assert bad == []


@pytest.mark.parametrize("k", [16])
def test_a_slice_costs_the_same_with_10k_and_1m_roots(tmp_path: Path, k: int) -> None:
    """One slice (usage, collection, eviction of ``k`` roots) against stores of 10,000 and
    1,000,000 roots built in SQL, timed alternately: medians within 2x. The WAL is not
    fsynced here (an fsync costs the same at any size, and its noise would hide the
    index's work), and roots hold one page each, so the walk of roots is what grows."""
    stores = {}
    for n in (10_000, 1_000_000):
        s = PageStore(tmp_path / str(n), 0, lease_seconds=0, clock=lambda: NOW, durable=False)
        populate(s._wconn, n, 1, SIZE, NOW - 1)
        stores[n] = (s, EvictionPlan(), CostModel())
    samples: dict[int, list[float]] = {n: [] for n in stores}
    try:
        for i in range(60):
            for n, (s, plan, costs) in stores.items():
                start = time.perf_counter()
                m = meter(roots=k, costs=costs)
                usage = s.usage()
                if usage.collectable_objects:
                    s.collect(1024, m)
                result = s.evict(m, plan, UNLIMITED)
                if i >= 10:  # warm: both caches hold what a slice reads
                    samples[n].append(time.perf_counter() - start)
                assert len(result.removed) == k or usage.collectable_objects
        small, big = (statistics.median(samples[n]) for n in stores)
        # The ratio the issue asks for, shown with pytest -s.
        print(f"slice median {small * 1e3:.2f} ms with 10,000 roots, {big * 1e3:.2f} ms with "
              f"1,000,000: {big / small:.2f}x")
        assert big / small <= 2.0, (small, big)
        assert stores[1_000_000][0].usage().entries > 999_000
    finally:
        for s, _, _ in stores.values():
            s.close()


def test_collection_of_an_object_whose_file_is_gone_goes_on(
        store: PageStore, lease_clock: LeaseClock) -> None:
    commit(store, chain("gone", 3), lease_clock)
    lease_clock.now += 100
    evict(store, 1)
    (victim,) = store._rconn.execute(
        "SELECT key FROM objects WHERE refcount = 0 LIMIT 1").fetchone()
    path, _ = object_file(store.layout.objects_dir, store._rconn, victim)
    path.unlink()  # the pack of all three
    assert not path.exists() and errno.ENOENT
    assert store.collect(10).objects == 3
    assert_clean(store)



def test_a_slices_deletions_are_durable_before_any_of_their_files_goes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A slice's collection commits its deletes without an fsync (no lock held while the
    disk answers) and removes none of their files; the WAL's fsync, outside any
    transaction, comes first (``sync_collected``, or the next slice's collection)."""
    synced: list[int] = []
    unsynced_txns: list[int] = []
    real_sync, real_unsynced = index.sync_wal, index.unsynced

    with PageStore(tmp_path / "s", 0, lease_seconds=0, pool_bytes=0) as store:

        def files() -> int:
            return sum(1 for p in store.layout.objects_dir.rglob("*") if p.is_file())

        def sync_wal(path: Path) -> None:
            assert not store._wconn.in_transaction
            synced.append(files())  # every file is still there when it begins
            real_sync(path)

        def unsynced(conn):
            unsynced_txns.append(1)
            return real_unsynced(conn)

        monkeypatch.setattr(index, "sync_wal", sync_wal)
        monkeypatch.setattr(index, "unsynced", unsynced)
        costs = CostModel()
        for kind in (ROW, UNLINK, RECORD, TXN, SYNC):  # measured: a slice affords all it has
            costs.observe(kind, 1, 1e-6)
        for rounds in (1, 2):
            ids = [os.urandom(16).hex() for _ in range(3)]
            for root_id in ids:
                store.commit(make_root(root_id, [os.urandom(16).hex()], SIZE))
            store.remove_roots(ids)
            # Rows deleted (in a transaction without an fsync), no file touched.
            before = len(unsynced_txns)
            assert store.collect(16, meter(costs=costs)).objects == 0
            assert len(unsynced_txns) == before + 1
            assert (files(), store.usage().collectable_objects) == (3, 0)
            assert store.unlinking.objects == 3 and synced == [3] * (rounds - 1)
            assert store._rconn.execute(
                "SELECT count(*) FROM objects WHERE refcount = 0").fetchone() == (0,)
            if rounds == 1:
                assert store.sync_collected() and not store.sync_collected()
            # Round 2: the next slice's collection syncs first, itself.
            assert store.collect(16, meter(costs=costs)).objects == 3
            assert files() == 0 and synced == [3] * rounds
        # Without a budget (the CLI, tests) the delete is synced at COMMIT, as before.
        last = os.urandom(16).hex()
        store.commit(make_root(last, [os.urandom(16).hex()], SIZE))
        store.remove_roots([last])
        before = len(unsynced_txns)
        assert store.collect(16).objects == 1 and files() == 0 and len(synced) == 2
        assert len(unsynced_txns) == before
        assert_clean(store)


def test_a_file_collection_has_yet_to_unlink_is_no_orphan_to_fsck(tmp_path: Path) -> None:
    """A slice deletes collected rows and leaves their files for later (the sync, then
    the unlinks while time lasts). Those files kept an evicted page's old times, so fsck
    beside a store at its cap reported them as orphans, its grace sparing only young
    files; their times are renewed as their rows go."""
    store_dir = tmp_path / "s"
    with PageStore(store_dir, 0, lease_seconds=0, pool_bytes=0) as store:
        ids = [os.urandom(16).hex() for _ in range(3)]
        for root_id in ids:
            store.commit(make_root(root_id, [os.urandom(16).hex() for _ in range(2)], SIZE))
        hour_ago = time.time() - 3600
        files = [p for p in store.layout.objects_dir.rglob("*") if p.is_file()]
        for path in files:
            os.utime(path, (hour_ago, hour_ago))  # pages evicted an hour after they came
        assert fsck(store_dir).ok
        store.remove_roots(ids)
        costs = CostModel()
        for kind in (ROW, UNLINK, RECORD, TXN, SYNC):
            costs.observe(kind, 1, 1e-6)
        assert store.collect(16, meter(costs=costs)).objects == 0  # rows gone, files not
        assert store.unlinking.objects == 6 and all(p.exists() for p in files)
        report = fsck(store_dir)
        assert report.ok, report.problems
        assert store.sync_collected()
        store.collect(16, meter(costs=costs))
        assert not any(p.exists() for p in files)
    assert fsck(store_dir, grace_seconds=0).ok
