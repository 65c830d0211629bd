"""The shared tier's building blocks against a real Redis Cluster (three masters with a
replica each, tests/redis_cluster.py): pages sent once fleet-wide, fetched and verified,
a planted page refused, a master killed mid-run costing misses and never wrong bytes,
credentials from the environment or a file only."""

from __future__ import annotations

import hashlib
import threading
from pathlib import Path

import pytest

from sparkcache.fleet import codec
from sparkcache.fleet.cluster import ClusterSettings, connect, page_name
from sparkcache.fleet.pages import FetchResult, fetch_into, held, share
from tests.redis_cluster import redis_cluster

PAGE = 64 << 10


def pages(n: int, seed: str) -> list[tuple[bytes, bytes]]:
    """``n`` pages: a raw key each and bytes derived from it."""
    out = []
    for i in range(n):
        key = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest()
        out.append((key, hashlib.blake2b(key, digest_size=64).digest() * (PAGE // 64)))
    return out


def fetch(client, prefix: str, keys: list[bytes], rank: int = 0,
          ) -> tuple[FetchResult, list[bytes]]:
    """``fetch_into`` fresh buffers: what it found, and the pages it copied."""
    rows = [bytearray(PAGE) for _ in keys]
    got = fetch_into(client, prefix, rank, keys, rows, PAGE)
    return got, [bytes(r) for r in rows[: got.pages]]


def test_a_page_is_sent_once_fleet_wide_and_fetched_verified(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        a = connect(ClusterSettings(cluster.url, key_prefix="fleet-a"))
        b = connect(ClusterSettings(cluster.url, key_prefix="fleet-a"))
        first, more = pages(120, "conv"), pages(30, "more")
        sent = share(a, "fleet-a", 0, first)
        assert (sent.sent, sent.present) == (120, 0)
        # Node B shares the same pages and 30 of its own: only those 30 are sent.
        again = share(b, "fleet-a", 0, first + more)
        assert (again.sent, again.present) == (30, 120)
        assert again.bytes_sent == 30 * (PAGE + codec.HEADER.size)
        got, copied = fetch(b, "fleet-a", [k for k, _ in first + more])
        assert got.missing is None and got.bad is None
        assert copied == [v for _, v in first + more]
        # Another deployment's prefix, or another rank, finds none of them.
        assert fetch(b, "fleet-b", [first[0][0]])[0].missing == 0
        assert fetch(b, "fleet-a", [first[0][0]], rank=1)[0].missing == 0
        # Spread over the three masters, not one.
        assert sum(int(cluster.cli(p, "DBSIZE")) > 0 for p in cluster.masters()) == 3
        a.close()
        b.close()


def test_a_wrong_page_under_a_right_key_ends_the_prefix_there(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url))
        batch = pages(10, "planted")
        share(client, "sparkcache", 0, batch)
        key, value = batch[4]
        wrong = bytearray(codec.encode(0, key, value))
        wrong[-1] ^= 0xFF  # a byte of the page: the checksum fails
        client.set(page_name("sparkcache", 0, key), bytes(wrong))
        # Another page's value (a valid one) under this page's name.
        client.set(page_name("sparkcache", 0, batch[7][0]), codec.encode(0, *batch[8]))
        # Rank 1's name holding rank 0's page (valid, but of the other heads).
        client.set(page_name("sparkcache", 1, batch[0][0]), codec.encode(0, *batch[0]))
        got, copied = fetch(client, "sparkcache", [k for k, _ in batch])
        assert (got.pages, got.bad, got.reason) == (4, 4, "checksum mismatch")
        assert copied == [v for _, v in batch[:4]]
        got, _ = fetch(client, "sparkcache", [k for k, _ in batch[5:]])
        assert (got.pages, got.bad) == (2, 2) and "names page" in got.reason
        got, _ = fetch(client, "sparkcache", [batch[0][0]], rank=1)
        assert (got.pages, got.bad) == (0, 0) and "rank 0, not 1" in got.reason
        # A page of another size than the engine's is not its page.
        rows = [bytearray(PAGE * 2)]
        got = fetch_into(client, "sparkcache", 0, [batch[0][0]], rows, PAGE * 2)
        assert (got.pages, got.bad) == (0, 0) and "not the engine's" in got.reason
        assert rows[0] == bytearray(PAGE * 2)  # nothing of it copied
        client.close()


def test_a_master_killed_mid_run_costs_misses_never_wrong_bytes(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url, timeout_s=0.5))
        batch = pages(200, "failover")
        share(client, "sparkcache", 0, batch)
        for port in cluster.masters():
            cluster.cli(port, "WAIT", "1", "2000")  # replicated before the kill
        keys = [k for k, _ in batch]
        want = [v for _, v in batch]
        outcomes = {"whole": 0, "short": 0, "failed": 0, "wrong": 0}
        stop = threading.Event()

        def reader() -> None:
            own = connect(ClusterSettings(cluster.url, timeout_s=0.5))
            while not stop.is_set():
                try:
                    got, copied = fetch(own, "sparkcache", keys)
                except Exception:
                    outcomes["failed"] += 1
                    continue
                if any(p != w for p, w in zip(copied, want, strict=False)):
                    outcomes["wrong"] += 1
                outcomes["whole" if got.pages == len(keys) else "short"] += 1
            own.close()

        thread = threading.Thread(target=reader)
        thread.start()
        try:
            cluster.kill(cluster.masters()[0])
            cluster.wait_ok(timeout=30)  # its replica promoted
            done = outcomes["whole"]
            while outcomes["whole"] == done:  # a whole read after the failover
                thread.join(0.1)
                assert thread.is_alive()
        finally:
            stop.set()
            thread.join(30)
        assert outcomes["wrong"] == 0 and outcomes["whole"] >= 2, outcomes
        client.close()


def test_credentials_come_from_the_environment_or_a_private_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="no credentials in the URL"):
        ClusterSettings("redis://user:secret@127.0.0.1:7000")
    with pytest.raises(ValueError, match="key prefix"):
        ClusterSettings("redis://127.0.0.1:7000", key_prefix="a b")
    with redis_cluster(tmp_path, password="s3cret-pw") as cluster:
        settings = ClusterSettings(cluster.url, password_env="TEST_FLEET_PW")
        client = connect(settings, env={"TEST_FLEET_PW": "s3cret-pw"})
        assert share(client, "sparkcache", 0, pages(3, "auth")).sent == 3
        client.close()
        secret = tmp_path / "pw"
        secret.write_text("s3cret-pw\n")
        secret.chmod(0o644)
        from_file = ClusterSettings(cluster.url, password_env="TEST_FLEET_PW",
                                    password_file=secret)
        with pytest.raises(ValueError, match="readable by others"):
            connect(from_file, env={})
        secret.chmod(0o600)
        client = connect(from_file, env={})
        assert share(client, "sparkcache", 0, pages(3, "auth")).present == 3
        client.close()
        from redis.exceptions import AuthenticationError, RedisClusterException
        with pytest.raises((AuthenticationError, RedisClusterException)):
            connect(settings, env={"TEST_FLEET_PW": "wrong"})


def _store_with(store: Path, root: str, batch: list[tuple[bytes, bytes]]) -> None:
    from sparkcache.store import PageData, PageStore, Root

    with PageStore(store, 0) as s:
        s.commit(Root(hashlib.blake2b(root.encode(), digest_size=16).hexdigest(),
                      [PageData(k.hex(), v) for k, v in batch]))


def _share_stats(store: Path, instance: str):
    """The share worker's stats record once it has sent pages and has none left."""
    from sparkcache.workers.lifecycle import Role

    from sparkcache import segments
    from tests.pipeline_util import make_cfg, wait_for

    with segments.attach_stats(make_cfg(store, instance), 0) as stats:
        def done():
            rec = stats.read(int(Role.SHARE))
            return rec if rec is not None and rec.processed and rec.backlog == 0 else None
        return wait_for(done, 60, "the share worker done")


def test_a_share_worker_per_node_sends_each_page_once_to_the_cluster(tmp_path: Path) -> None:
    """Two nodes (supervisors on stores of their own) holding the same conversation's
    pages, and node B one more turn: A's share worker sends them, B's only its own."""
    from tests.pipeline_util import start_supervisor, stop_supervisor

    first, more = pages(40, "turn-1"), pages(10, "turn-2")
    _store_with(tmp_path / "a", "conv", first)
    _store_with(tmp_path / "b", "conv", first + more)
    with redis_cluster(tmp_path / "cluster") as cluster:
        share = ("--share-cluster-url", cluster.url, "--share-key-prefix", "fleet-t")
        a = start_supervisor(tmp_path / "a", "sharea", *share)
        try:
            rec = _share_stats(tmp_path / "a", "sharea")
            assert (rec.processed, rec.failed) == (40, 0)
            assert rec.copy_bytes == 40 * (PAGE + codec.HEADER.size)
        finally:
            code, err = stop_supervisor(a)
        assert code == 0, err[-2000:]
        b = start_supervisor(tmp_path / "b", "shareb", *share)
        try:
            rec = _share_stats(tmp_path / "b", "shareb")
            assert (rec.processed, rec.failed) == (10, 0)  # the 40 of A's were there
        finally:
            code, err = stop_supervisor(b)
        assert code == 0, err[-2000:]
        client = connect(ClusterSettings(cluster.url, key_prefix="fleet-t"))
        _, copied = fetch(client, "fleet-t", [k for k, _ in first + more])
        assert copied == [v for _, v in first + more]
        client.close()


def test_an_unreachable_cluster_is_retried_with_back_off_and_the_rank_serves_on(
        tmp_path: Path) -> None:
    """Nothing listens at the URL: the share worker stays READY, counts the failures, says
    so once in the log, and tries again later; the rank's other workers run as ever."""
    from sparkcache.workers.lifecycle import Role, State

    from sparkcache import segments
    from tests.pipeline_util import free_port, make_cfg, start_supervisor, stop_supervisor, wait_for

    _store_with(tmp_path / "a", "conv", pages(4, "down"))
    url = f"redis://127.0.0.1:{free_port()}"
    sup = start_supervisor(tmp_path / "a", "sharedown", "--share-cluster-url", url)
    try:
        with segments.attach_stats(make_cfg(tmp_path / "a", "sharedown"), 0) as stats:
            rec = wait_for(lambda: (r := stats.read(int(Role.SHARE))) is not None
                           and r.failed >= 2 and r, 30, "two failed tries")
            assert rec.state == State.READY and rec.processed == 0
            assert rec.backlog > 0  # the pages still to share
            for role in (Role.CAPTURE, Role.COMMIT, Role.RESTORE, Role.MAINTENANCE):
                assert stats.read(int(role)).state == State.READY
    finally:
        code, err = stop_supervisor(sup)
    assert code == 0, err[-2000:]
    assert err.count("share[r0]: the cluster at") == 1, err[-3000:]


def test_held_finds_how_far_every_rank_shared_a_prefix(tmp_path: Path) -> None:
    """The lookup's probes: the end of the prefix both ranks shared, in a few rounds, and
    nothing past a deadline already gone."""
    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url))
        chain = pages(300, "held")
        keys = [k for k, _ in chain]
        share(client, "sparkcache", 0, chain[:250])
        share(client, "sparkcache", 1, chain[:180])
        assert held(client, "sparkcache", (0,), keys) == 250
        assert held(client, "sparkcache", (1,), keys) == 180
        assert held(client, "sparkcache", range(2), keys) == 180
        assert held(client, "sparkcache", range(2), keys[:100]) == 100
        assert held(client, "sparkcache", (0,), keys[250:]) == 0
        assert held(client, "other-prefix", (0,), keys) == 0
        assert held(client, "sparkcache", (0,), keys, deadline=0.0) < 250
        client.close()


def test_a_node_restores_from_the_cluster_what_another_node_shared(
        tmp_path: Path, instance: str) -> None:
    """Node A stores a sequence and its share worker sends it; node B, whose store lacks
    it, loads it: its restore worker fetches the pages from the cluster, byte-exact. A
    page planted there with a wrong byte ends the next load before it, its block never
    written, and is counted."""
    import numpy as np
    from sparkcache.workers.lifecycle import Role

    from sparkcache import segments
    from sparkcache.identity import keys_bytes
    from tests.pipeline_util import make_cfg, pipeline, sequences, wait_committed, wait_for

    with redis_cluster(tmp_path / "cluster") as cluster:
        settings = {"share_cluster_url": cluster.url, "share_key_prefix": "rt"}
        with pipeline(tmp_path / "a", instance + "a", settings) as a:
            tokens = next(iter(sequences(1, a.client.cfg.page_tokens, seed=5).values()))
            assert a.publish("turn-1", tokens)
            a.drain()
            assert wait_committed(a, seqs={"turn-1": tokens}) == {}
            with segments.attach_stats(make_cfg(tmp_path / "a", instance + "a"), 0) as st:
                wait_for(lambda: (r := st.read(int(Role.SHARE))) is not None
                         and r.processed and r.backlog == 0, 60, "A's pages shared")
        with pipeline(tmp_path / "b", instance + "b", settings) as b:
            c, keys = b.client, b.keys(tokens)
            views = c._reg.views
            assert c.lookup(tokens) == 0  # its own store holds none of it

            def load(load_id: str) -> tuple[object, list[int]]:
                blocks = [b.free.pop() for _ in keys]
                for block in blocks:
                    views.scatter(block, np.full(views.page_bytes, 0x5A, np.uint8))
                assert c.load_keys(load_id, keys_bytes(keys), blocks)
                return b.wait_loaded([load_id])[load_id], blocks

            result, blocks = load("from-cluster")
            assert (result.status, result.tokens) == ("ok", len(tokens)), result
            assert all(b.exact_pages(tokens, blocks))
            client = connect(ClusterSettings(cluster.url, key_prefix="rt"))
            name = page_name("rt", 0, bytes.fromhex(keys[3]))
            wrong = bytearray(client.get(name))
            wrong[-1] ^= 0xFF
            client.set(name, bytes(wrong))
            client.close()
            result, blocks = load("planted")
            assert (result.status, result.tokens) == ("partial", 3 * c.cfg.page_tokens)
            assert b.exact_pages(tokens, blocks)[:3] == [True] * 3
            out = np.empty(views.page_bytes, np.uint8)
            for block in blocks[3:]:
                views.gather(block, out)
                assert (out == 0x5A).all()  # never written
            with segments.attach_stats(make_cfg(tmp_path / "b", instance + "b"), 0) as st:
                rec = wait_for(lambda: (r := st.read(int(Role.RESTORE))) is not None
                               and r.fleet_bad_pages and r, 10, "the bad page counted")
                assert rec.fleet_bad_pages == 1
                assert rec.read_bytes_cluster == (len(keys) + 3) * views.page_bytes


def test_lookups_answer_later_then_how_far_and_never_wait_on_a_slow_or_dead_cluster(
        tmp_path: Path) -> None:
    """The scheduler's side of the read-through: the first ask starts the probes and is
    answered at once or "later"; a later ask gets the pages found. A cluster that hangs (every
    master stopped) is answered 0 once the time-out is past, counted late; one that
    cannot be reached is answered 0 at once while backing off."""
    import signal
    import time

    from sparkcache.fleet.lookup import ClusterLookup
    from tests.pipeline_util import free_port, wait_for

    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url))
        chain = pages(40, "lookup")
        share(client, "sparkcache", 0, chain[:30])
        share(client, "sparkcache", 1, chain[:25])
        client.close()
        lookup = ClusterLookup(ClusterSettings(cluster.url, timeout_s=0.5), 2, 0.2)
        try:
            raw = b"".join(k for k, _ in chain)

            def answer(request: str, keys: bytes, start: int) -> int:
                # At once where the probes take under INLINE_WAIT_S, else at a later ask.
                return wait_for(lambda: (n := lookup.held(request, keys, start)) is not None
                                and (n,), 10, "an answer")[0]

            assert answer("r1", raw, 0) == 25
            assert answer("r1", raw[16 * 20:], 20) == 5  # asked from another page on
            assert answer("r1", b"".join(k for k, _ in pages(40, "none")), 0) == 0
            masters = cluster.masters()
            for port in masters:
                cluster.procs[port].send_signal(signal.SIGSTOP)
            try:
                started = time.monotonic()
                assert lookup.held("r2", raw, 0) is None
                while (answer := lookup.held("r2", raw, 0)) is None:
                    time.sleep(0.005)
                assert answer == 0 and time.monotonic() - started < 0.5
                assert lookup.counters["late"] == 1
                # A burst of new requests in one step waits INLINE_WAIT_S in all, not
                # each (200 x 2 ms would be 0.4 s).
                burst = ClusterLookup(ClusterSettings(cluster.url, timeout_s=0.5), 2, 0.2)
                try:
                    started = time.monotonic()
                    assert all(burst.held(f"b{i}", raw, 0) is None for i in range(200))
                    assert time.monotonic() - started < 0.2
                finally:
                    burst.close()  # the probes queued behind the hung one cancelled
            finally:
                for port in masters:
                    cluster.procs[port].send_signal(signal.SIGCONT)
        finally:
            lookup.close()
    dead = ClusterLookup(ClusterSettings(f"redis://127.0.0.1:{free_port()}"), 1, 0.2)
    try:
        wait_for(lambda: dead.held("r3", b"\1" * 16, 0) == 0, 10, "the failure answered")
        assert dead.counters["failed"] == 1
        assert dead.held("r4", b"\1" * 16, 0) == 0  # backing off: at once
        assert dead.counters["unavailable"] == 1
    finally:
        dead.close()


def test_a_full_cluster_is_a_failure_backed_off_and_the_rank_serves_on(
        tmp_path: Path) -> None:
    """A cluster at its ``maxmemory`` that evicts nothing refuses the share worker's
    writes (OOM): counted as failures, logged once, tried again after a back-off; the
    rank's other workers run as ever, and what the cluster took is served whole."""
    from sparkcache.workers.lifecycle import Role, State

    from sparkcache import segments
    from tests.pipeline_util import make_cfg, start_supervisor, stop_supervisor, wait_for

    chain = pages(120, "full")  # 7.5 MiB against 3 masters of 2 MiB
    _store_with(tmp_path / "a", "conv", chain)
    with redis_cluster(tmp_path / "cluster",
                       conf=("maxmemory 2mb", "maxmemory-policy noeviction")) as cluster:
        sup = start_supervisor(tmp_path / "a", "sharefull", "--share-cluster-url",
                               cluster.url)
        try:
            with segments.attach_stats(make_cfg(tmp_path / "a", "sharefull"), 0) as stats:
                rec = wait_for(lambda: (r := stats.read(int(Role.SHARE))) is not None
                               and r.failed >= 2 and r, 30, "two refused batches")
                assert rec.state == State.READY and rec.backlog > 0
                for role in (Role.CAPTURE, Role.COMMIT, Role.RESTORE, Role.MAINTENANCE):
                    assert stats.read(int(role)).state == State.READY
        finally:
            code, err = stop_supervisor(sup)
        assert code == 0, err[-2000:]
        refused = [line for line in err.splitlines() if "failed (" in line]
        assert len(refused) == 1 and "maxmemory" in refused[0], err[-3000:]  # once, short
        assert len(refused[0]) < 400, refused[0]
        client = connect(ClusterSettings(cluster.url))
        got, copied = fetch(client, "sparkcache", [k for k, _ in chain])
        assert copied == [v for _, v in chain[: got.pages]]
        client.close()
