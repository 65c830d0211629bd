"""Leases where the data is relied on, with a real supervisor whose store sits at its cap
and evicts all the time (every root's own lease is zero): a publication whose prefix the
store held at capture time commits (capture leased it), and a restore made within a
lookup's lease gets the whole prefix the lookup counted. And leases at the cap
(docs/maintenance.md, "Leases at the cap"): a store whose roots are all younger than the
default 300 s lease keeps taking publications, the oldest leases yielding first, while
a lookup's lease is honoured."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest
from pipeline_util import pipeline, sequences, wait_for
from sparkcache.workers.lifecycle import Role

from sparkcache import segments
from sparkcache.prefix_lookup import PrefixLookup
from sparkcache.protocol import new_lease_id
from sparkcache.store import PageStore
from sparkcache.store.eviction import READ_GRACE_S

pytestmark = pytest.mark.slow

AT_THE_CAP = {
    # 16 KiB pages: a few conversations fill it; every root is a victim once its lease
    # (zero) is over, so maintenance evicts whenever used bytes pass max_bytes.
    "max_bytes": "640KiB", "low_watermark_bytes": "320KiB", "lease_seconds": "0",
    "lookup_lease_seconds": "5", "capture_slots": "2",
}


def test_at_the_cap_relied_on_pages_and_looked_up_prefixes_stay(
        tmp_path: Path, instance: str) -> None:
    rng = random.Random(7)
    store = tmp_path / "store"
    with pipeline(store, instance, AT_THE_CAP) as engine:
        page = engine.client.cfg.page_tokens
        convs = sequences(12, page, seed=9)
        turns = 0
        lookups = restores_full = 0
        deadline = time.monotonic() + 25
        with PageStore(store, 0, create=False) as ps:
            # Until there is evidence enough (the asserts below, twice over), or 25 s.
            while time.monotonic() < deadline and not (
                    turns >= 60 and lookups >= 20 and engine.relied_on_store):
                # A turn of a few conversations: the prefix grows, the store keeps it.
                for sid in rng.sample(sorted(convs), 3):
                    convs[sid] = convs[sid] + [rng.randrange(50000) for _ in range(2 * page)]
                    if len(convs[sid]) > 20 * page:
                        convs[sid] = convs[sid][: 4 * page]  # a new conversation, shared start
                    engine.publish(sid, convs[sid], tries=50)
                    turns += 1
                engine.drain(timeout=30)
                # Lookups of stored conversations, each followed at once by a restore.
                for sid in rng.sample(sorted(engine.accepted), min(4, len(engine.accepted))):
                    tokens = engine.accepted[sid]
                    counted = engine.client.lookup(tokens)
                    if counted == 0:
                        continue
                    lookups += 1
                    restored, exact = engine.restore_exact(tokens)
                    assert restored * page >= counted, (sid, counted, restored)
                    assert exact == restored
                    restores_full += 1
            used = ps.usage().used_bytes

            # The store really was at its cap and evicting: not every conversation is still
            # in. Asked of the index, not by a lookup, which would lease what it counts; and
            # waited for, since a fast run's lookups may lease every root until they expire.
            def evicted() -> list[str]:
                return [s for s, t in engine.accepted.items()
                        if ps.lookup(engine.keys(t)) < len(engine.keys(t))]

            wait_for(evicted, 20, "maintenance to evict a conversation")
        counters = engine.client.counters
        assert used > engine.client.cfg.low_watermark_bytes, used
        assert turns >= 30 and lookups >= 10, (turns, lookups, counters)
        relied = engine.relied_on_store
        assert relied, "no publication relied on stored pages: the test proves nothing"
        failed = {s: why for s, why in engine.not_durable.items() if s in relied}
        assert failed == {}, (failed, counters)
        assert restores_full == lookups


LEASED_AT_THE_CAP = {
    # 16 KiB pages, conversations of 2 pages (32 KiB): 10 of them between max_bytes and
    # the hard cap (960 KiB). lease_seconds is left at its default (300 s): every root the
    # test publishes is still leased at its end.
    "max_bytes": "640KiB", "low_watermark_bytes": "320KiB", "lookup_lease_seconds": "120",
    "capture_slots": "2",
}


def test_at_the_cap_with_every_root_leased_publications_go_on(
        tmp_path: Path, instance: str) -> None:
    rng = random.Random(11)
    store = tmp_path / "store"
    with pipeline(store, instance, LEASED_AT_THE_CAP) as engine:
        cfg = engine.client.cfg
        assert cfg.lease_seconds == 300
        page = cfg.page_tokens

        def conversation() -> list[int]:
            return [rng.randrange(50000) for _ in range(2 * page)]

        # The oldest root, under a lookup's lease (120 s): the first victim, were it not.
        looked_up = conversation()
        assert engine.publish("looked-up", looked_up, tries=1)
        engine.drain(timeout=30)
        assert engine.client.lookup(looked_up) == len(looked_up)
        # Three times what the hard cap holds, a publication every 50 ms or so: far
        # faster than 300 s leases run out, slowly enough for maintenance's slices.
        pair_bytes = 2 * engine.client._reg.views.page_bytes
        order, n = [], 3 * cfg.hard_cap_bytes // pair_bytes
        for i in range(n):
            sid = f"c{i}"
            if engine.publish(sid, conversation(), tries=1):
                order.append(sid)
            engine.drain(timeout=30)
            time.sleep(0.05)
        counters = engine.client.counters
        assert counters.skipped["store_full"] == 0, counters
        assert len(order) == n and not engine.not_durable, counters
        with segments.attach_stats(cfg, 0) as stats:
            rec = stats.read(int(Role.MAINTENANCE))
        with PageStore(store, 0, create=False) as ps:
            now = time.time()
            unleased = ps._rconn.execute(
                "SELECT count(*) FROM roots WHERE lease_until <= ?", (now,)).fetchone()[0]
            kept = [ps.lookup(engine.keys(engine.accepted[sid])) for sid in order]
            kept_looked_up = ps.lookup(engine.keys(looked_up))
    # Every root was under its conversation lease, and most were evicted all the same,
    # the oldest leases first: what is kept is the newest publications, the boundary one
    # perhaps cut short.
    assert unleased == 0
    assert kept == sorted(kept) and kept[0] == 0 and kept[-1] == 2, kept
    evicted = sum(k < 2 for k in kept)
    assert evicted >= len(order) - cfg.hard_cap_bytes // pair_bytes, kept
    assert rec.yielded_roots >= evicted - 1 and rec.yielded_bytes > 0
    assert rec.refused_s == 0 and rec.leased_roots > 0
    # The lookup's lease held: the oldest root of all is whole.
    assert kept_looked_up == 2


def test_read_leases_end_with_their_reads_at_an_agents_turn_rate(
        tmp_path: Path, instance: str) -> None:
    """Turns far faster than the lookup's lease (30 s): each looks its conversation up
    (through the scheduler's ring or the engine's), most load what was counted while the
    next turns publish, some never load (their request went: released, and one
    conversation's never, a lost message). Read leases end with their reads, so eviction
    never has to take a read lease but the lost ones, no publication waits for room longer
    than maintenance takes to evict (had leases held, the store would be pinned until they
    aged past READ_GRACE_S), and no root under a read in flight loses a page: every load
    gets every page its lookup counted.

    A publication may meet ``store_full`` for a moment: the client admits by the used
    bytes maintenance last reported, and on a busy machine maintenance's slices and
    reports lag a fast publisher. It is retried as an engine's next turn would be."""
    rng = random.Random(13)
    store = tmp_path / "store"
    settings = {k: v for k, v in LEASED_AT_THE_CAP.items() if k != "lookup_lease_seconds"}
    with pipeline(store, instance, settings) as engine, \
            segments.attach_stats(engine.client.cfg, 0) as stats:
        cfg, client = engine.client.cfg, engine.client
        assert cfg.lookup_lease_seconds == 30
        page = cfg.page_tokens
        scheduler = PrefixLookup(cfg, 1)

        def turn_of(n: int) -> list[int]:
            return [rng.randrange(50000) for _ in range(n * page)]

        convs = {f"c{i}": turn_of(2) for i in range(12)}
        for sid, tokens in convs.items():
            assert engine.publish(sid, tokens, tries=1), client.counters
            engine.drain(timeout=30)
        loads, released, lost, published, waited_max = 0, 0, 0, 0, 0.0
        looked_up: dict[str, tuple[float, int]] = {}  # when, and the pages counted
        for i in range(150):
            sid = f"c{i // 4 % len(convs)}"  # an agent's turns come in streaks
            tokens = convs[sid]
            lease = new_lease_id()
            if i % 2:
                counted = scheduler.lookup(engine.keys(tokens), lease=lease) * page
            else:
                counted = client.lookup(tokens, lease=lease)
            looked_up[sid] = (time.monotonic(), counted // page)
            load_id = None
            if counted and i % 5 == 4:
                if sid == "c4":
                    lost += 1  # never released: its lease ends at its bound
                else:
                    (scheduler if i % 2 else client).release(lease)
                    released += 1
            elif counted:
                blocks = [engine.free.pop() for _ in range(counted // page)]
                load_id = f"load-{i}"
                assert client.load(load_id, tokens, blocks, lease=lease), client.counters
            # The next turns publish while the load is in flight.
            longer = tokens + turn_of(1)
            asked = time.monotonic()
            assert engine.publish(sid, longer, tries=2000), (i, client.counters.skipped)
            waited_max = max(waited_max, time.monotonic() - asked)
            convs[sid] = longer
            published += len(longer) // page
            engine.drain(timeout=30)
            if load_id is not None:
                result = engine.wait_loaded([load_id])[load_id]
                assert (result.status, result.tokens) == ("ok", counted), (i, result)
                engine.free.extend(blocks)
                loads += 1
        ended = time.monotonic()
        scheduler.close()
        counters = client.counters
        rec = wait_for(lambda: (r := stats.read(int(Role.MAINTENANCE))).read_releases
                       >= loads + released and r, 10, "maintenance to take the releases")
    page_bytes = client._reg.views.page_bytes
    # Far faster than the lease: had leases lasted it, what was looked up within the last
    # lease would be read-leased at the end, more than the hard cap holds.
    recent = [pages for at, pages in looked_up.values()
              if at > ended - cfg.lookup_lease_seconds]
    assert sum(recent) * page_bytes > cfg.hard_cap_bytes, looked_up
    assert published * page_bytes > 3 * cfg.hard_cap_bytes
    assert loads >= 60 and released >= 10 and lost >= 1, (loads, released, lost)
    assert not engine.not_durable, counters
    assert rec.evicted_roots > 0, "the store never evicted: the test proves nothing"
    # Eviction took no read lease but the lost ones, and no publication waited for leases
    # to age: had they held, a store they pinned would wait for READ_GRACE_S.
    assert rec.read_yielded_roots <= lost, (rec.read_yielded_roots, lost)
    assert waited_max < READ_GRACE_S / 2, (waited_max, counters.skipped)
