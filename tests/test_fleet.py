"""The shared tier's building blocks against a real Redis Cluster (three masters with a
replica each, tests/redis_cluster.py): pages sent once fleet-wide, fetched and verified,
a planted page refused, a master killed mid-run costing misses and never wrong bytes,
credentials from the environment or a file only."""

from __future__ import annotations

import hashlib
import os
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
    with pytest.raises(ValueError, match="no credentials in a URL"):
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
    assert not any(os.environ.get(k) for k in ("TEST_FLEET_PW",))
