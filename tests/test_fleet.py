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
from sparkcache.fleet.pages import fetch, share
from tests.redis_cluster import redis_cluster

PAGE = 64 << 10


def pages(n: int, seed: str) -> list[tuple[bytes, bytes]]:
    """``n`` pages: a raw key each and bytes derived from it."""
    out = []
    for i in range(n):
        key = hashlib.blake2b(f"{seed}/{i}".encode(), digest_size=16).digest()
        out.append((key, hashlib.blake2b(key, digest_size=64).digest() * (PAGE // 64)))
    return out


def test_a_page_is_sent_once_fleet_wide_and_fetched_verified(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        a = connect(ClusterSettings(cluster.url, key_prefix="fleet-a"))
        b = connect(ClusterSettings(cluster.url, key_prefix="fleet-a"))
        first, more = pages(120, "conv"), pages(30, "more")
        sent = share(a, "fleet-a", first)
        assert (sent.sent, sent.present) == (120, 0)
        # Node B shares the same pages and 30 of its own: only those 30 are sent.
        again = share(b, "fleet-a", first + more)
        assert (again.sent, again.present) == (30, 120)
        assert again.bytes_sent == 30 * (PAGE + codec.HEADER.size)
        got = fetch(b, "fleet-a", [k for k, _ in first + more])
        assert got.missing is None and got.bad is None
        assert [bytes(p) for p in got.pages] == [v for _, v in first + more]
        # Another deployment's prefix finds none of them.
        assert fetch(b, "fleet-b", [first[0][0]]).missing == 0
        # Spread over the three masters, not one.
        assert sum(int(cluster.cli(p, "DBSIZE")) > 0 for p in cluster.masters()) == 3
        a.close()
        b.close()


def test_a_wrong_page_under_a_right_key_ends_the_prefix_there(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url))
        batch = pages(10, "planted")
        share(client, "sparkcache", batch)
        key, value = batch[4]
        wrong = bytearray(codec.encode(key, value))
        wrong[-1] ^= 0xFF  # a byte of the page: the checksum fails
        client.set(page_name("sparkcache", key), bytes(wrong))
        # Another page's value (a valid one) under this page's name.
        client.set(page_name("sparkcache", batch[7][0]), codec.encode(*batch[8]))
        got = fetch(client, "sparkcache", [k for k, _ in batch])
        assert (len(got.pages), got.bad, got.reason) == (4, 4, "checksum mismatch")
        got = fetch(client, "sparkcache", [k for k, _ in batch[5:]])
        assert (len(got.pages), got.bad) == (2, 2) and "names page" in got.reason
        client.close()


def test_a_master_killed_mid_run_costs_misses_never_wrong_bytes(tmp_path: Path) -> None:
    with redis_cluster(tmp_path) as cluster:
        client = connect(ClusterSettings(cluster.url, timeout_s=0.5))
        batch = pages(200, "failover")
        share(client, "sparkcache", batch)
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
                    got = fetch(own, "sparkcache", keys)
                except Exception:
                    outcomes["failed"] += 1
                    continue
                if any(bytes(p) != w for p, w in zip(got.pages, want, strict=False)):
                    outcomes["wrong"] += 1
                outcomes["whole" if len(got.pages) == len(keys) else "short"] += 1
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
        assert share(client, "sparkcache", pages(3, "auth")).sent == 3
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
        assert share(client, "sparkcache", pages(3, "auth")).present == 3
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
        got = fetch(client, "fleet-t", [k for k, _ in first + more])
        assert [bytes(p) for p in got.pages] == [v for _, v in first + more]
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
    assert err.count("sharing with") == 1, err[-3000:]
