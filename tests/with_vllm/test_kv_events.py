"""KV events through vLLM's own path: vLLM 0.33's real Scheduler publishes them on ZMQ
(``--kv-events-config``) and a subscriber decodes them as a router's KV indexer does (llm-d
reads this stream). The index it builds must equal what the store holds for this engine
after saves, evictions, a reset and a restart of vLLM."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33's scheduler")
import msgspec
import zmq
from vllm.config import KVEventsConfig
from vllm.distributed.kv_events import (
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

from sparkcache.store.reader import StoreReader
from tests.with_vllm.harness import BLOCK, request, rig
from tests.with_vllm.test_connector_scheduler import derived_keys, running_supervisor

PAGES = 5  # a conversation's pages
PAGE_BYTES = 8192  # the rig's page: 2 layers of K and V, 16 tokens, 2 heads of 32, fp16


class RouterIndex:
    """What a router knows of this engine's storage tier: the block hashes announced
    stored and not since removed, from vLLM's published batches. It listens, as llm-d's
    indexer does, and vLLM connects to it (an endpoint with a host, not ``*``)."""

    def __init__(self) -> None:
        self.sub = zmq.Context.instance().socket(zmq.SUB)
        self.sub.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sub.bind_to_random_port("tcp://127.0.0.1")
        self.decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self.blocks: set = set()
        self.events: list = []

    def drain(self) -> None:
        while self.sub.poll(0):
            _topic, _seq, payload = self.sub.recv_multipart()
            for event in self.decoder.decode(payload).events:
                self.apply(event)

    def apply(self, event) -> None:
        if getattr(event, "medium", MEDIUM_STORAGE) != MEDIUM_STORAGE:
            return  # vLLM's own prefix cache, in the engine's memory
        self.events.append(event)
        if isinstance(event, BlockStored):
            assert event.block_size == BLOCK
            assert len(event.token_ids) == len(event.block_hashes) * BLOCK
            self.blocks.update(event.block_hashes)
        elif isinstance(event, BlockRemoved):
            self.blocks.difference_update(event.block_hashes)
        elif isinstance(event, AllBlocksCleared):
            self.blocks.clear()

    def close(self) -> None:
        self.sub.close(linger=0)


def events_config(*routers: RouterIndex) -> KVEventsConfig:
    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq",
                          endpoint=f"tcp://127.0.0.1:{routers[0].port}")


def store_blocks(store: Path, requests: list) -> set:
    """The block hashes, as vLLM publishes them, of the pages of ``requests`` that the
    store can restore (live and referenced), each page checked in the index itself."""
    reader = StoreReader(store, 0)
    try:
        live = {key for (key,) in reader.conn.execute(
            "SELECT key FROM objects WHERE refcount > 0 AND state = 'live'")}
    finally:
        reader.close()
    out = set()
    for req in requests:
        for key, h in zip(derived_keys(store, req), req.block_hashes, strict=False):
            if key in live:
                out.add(maybe_convert_block_hash(h))
    return out


def settle(r, timeout: float = 20.0) -> None:
    """Step until every rank's publications were committed or refused."""
    deadline = time.monotonic() + timeout
    clients = [w._worker.client for w in r.workers]
    while any(c.pending or c.awaiting_durable for c in clients):
        assert time.monotonic() < deadline, "publications still in flight"
        r.step()
        for c in clients:
            c.poll_durable()
        time.sleep(0.05)


def converge(r, routers: list[RouterIndex], want, timeout: float = 30.0) -> None:
    """Step the idle scheduler (each step takes the connector's events) until every
    router's index equals ``want()``."""
    deadline = time.monotonic() + timeout
    while True:
        r.step()
        for router in routers:
            router.drain()
        expected = want()
        if all(router.blocks == expected for router in routers):
            return
        if time.monotonic() > deadline:
            got = [len(router.blocks) for router in routers]
            events = r.sched.get_kv_connector()._scheduler.events
            raise AssertionError(f"router indexes of {got} blocks, store {len(expected)}; "
                                 f"{events.counts}, {len(events._saves)} saves unconfirmed")
        time.sleep(0.05)


def test_a_routers_index_from_vllms_events_equals_the_stores_contents(
        tmp_path: Path, instance: str) -> None:
    # A cap of about three conversations: maintenance evicts older ones as turns arrive.
    with running_supervisor(tmp_path / "store", instance,
                            "--max-bytes", f"{3 * PAGES * PAGE_BYTES}",
                            "--low-watermark-bytes", f"{2 * PAGES * PAGE_BYTES}") as store:
        requests = []
        router = RouterIndex()
        with rig(store, instance, kv_events=events_config(router)) as r:
            time.sleep(0.3)  # vLLM's publisher connected before any event
            for i in range(8):
                req = request(f"C{i}", [*range(1000 * i, 1000 * i + PAGES * BLOCK), 7])
                requests.append(req)
                r.sched.add_request(req)
                r.run_until_idle()
                settle(r)
                converge(r, [router], lambda: store_blocks(store, requests))
            stored = {h for e in router.events if isinstance(e, BlockStored)
                      for h in e.block_hashes}
            removed = {h for e in router.events if isinstance(e, BlockRemoved)
                       for h in e.block_hashes}
            # More conversations announced than the cap holds, older ones removed again by
            # eviction (a turn that met the cap before maintenance made room was refused).
            assert len(stored) > 3 * PAGES and removed, (len(stored), len(removed))
            assert router.blocks  # what the store holds, not nothing
            # Counted in vLLM's own stats (vllm:sparkcache_events_* on its /metrics). vLLM
            # makes a step's stats before it takes the step's events: those of the last
            # step that took any are reported by the next one.
            def counted() -> int:
                return sum(st.get("events_stored_pages", 0) for st in r.stats)

            deadline = time.monotonic() + 10
            while counted() < len(stored) and time.monotonic() < deadline:
                r.step()
                time.sleep(0.05)
            assert counted() == len(stored), (counted(), len(stored))
            first = next(e for e in router.events if isinstance(e, BlockStored))
            assert first.parent_block_hash is None
            assert first.token_ids == requests[0].all_token_ids[:PAGES * BLOCK]

        # vLLM restarts on the same store: the router that kept its index and one that
        # starts afresh (say, restarted too) both converge on what the store holds.
        for listener in (router, RouterIndex()):
            with rig(store, instance, kv_events=events_config(listener)) as r:
                time.sleep(0.3)
                listener.events.clear()
                converge(r, [listener], lambda: store_blocks(store, requests))
            if listener is not router:
                # Everything it knows came from the new engine's announcements.
                assert any(isinstance(e, BlockStored) for e in listener.events)
                listener.close()

        # A reset (a weight update): all cleared, then what is saved after it.
        with rig(store, instance, kv_events=events_config(router)) as r:
            time.sleep(0.3)
            converge(r, [router], lambda: store_blocks(store, requests))
            assert r.sched.reset_prefix_cache(reset_connector=True) is True
            after = request("D", [*range(50_000, 50_000 + PAGES * BLOCK), 7])
            r.sched.add_request(after)
            r.run_until_idle()
            want = {maybe_convert_block_hash(h) for h in after.block_hashes}
            converge(r, [router], lambda: want)
            assert any(isinstance(e, AllBlocksCleared) for e in router.events)
        router.close()
