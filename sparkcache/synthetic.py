"""A synthetic engine: what the demo, the benchmarks and the tests drive SparkCache with.

It plays vLLM's part: KV tensors (one per layer; in shared memory on the CPU, or on a CUDA
device), a pool of free blocks, and a SparkCacheClient. Page contents derive from the page
key, as a real engine's KV derives from the prefix, so any restored page can be checked
byte for byte.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from sparkcache import config
from sparkcache.client import LoadResult, SparkCacheClient
from sparkcache.identity import KeyExtras, sequence_keys
from sparkcache.kvmem import SharedKVCaches
from sparkcache.store.testing import page_bytes

LAYERS = 4
BLOCKS = 256
HEADS, HEAD_DIM = 2, 32
# The synthetic engine's "model": page keys are namespaced by it like a real model's.
MODEL_ID = "sparkcache-synthetic-4l"


def kv_shape(page_tokens: int, blocks: int = BLOCKS) -> tuple[int, ...]:
    """[K/V, blocks, block size, heads, head dim], vLLM's per-layer layout."""
    return (2, blocks, page_tokens, HEADS, HEAD_DIM)


class EngineStalled(RuntimeError):
    """Blocks lent to SparkCache never came back."""


@dataclass
class SyntheticEngine:
    client: SparkCacheClient
    tensors: list[torch.Tensor]
    kv: SharedKVCaches | None  # the shared-memory segment of CPU tensors
    blocks: int = BLOCKS
    free: list[int] = field(default_factory=list)
    accepted: dict[str, list[int]] = field(default_factory=dict)
    captured: set[str] = field(default_factory=set)  # copied: blocks came back
    acknowledged: set[str] = field(default_factory=set)  # durable: the store holds the root
    not_durable: dict[str, str] = field(default_factory=dict)  # seq id -> why not
    # Captured with only part of their pages copied: the rest the store held (and leased).
    relied_on_store: set[str] = field(default_factory=set)
    loaded: dict[object, LoadResult] = field(default_factory=dict)  # load id -> its report
    max_call_s: float = 0.0

    def __post_init__(self) -> None:
        if not self.free:
            self.free = list(range(self.blocks))

    @classmethod
    def create(
        cls, cfg: config.Config, rank: int = 0, device: str = "cpu",
        model_id: str = MODEL_ID, blocks: int = BLOCKS,
    ) -> SyntheticEngine:
        """``blocks``: KV blocks per layer (vLLM sizes it anew at every start; the page
        keys do not depend on it)."""
        shapes = [kv_shape(cfg.page_tokens, blocks)] * LAYERS
        kv = None
        try:
            if device == "cpu":
                kv = SharedKVCaches.create(cfg.instance, rank, shapes, torch.float16)
                tensors = kv.tensors
            else:
                tensors = [torch.zeros(s, dtype=torch.float16, device=device) for s in shapes]
            client = SparkCacheClient(cfg, rank, model_id=model_id)
            if not client.register_kv_caches(tensors):
                client.close()
                raise RuntimeError("the client refused the KV caches (see the log)")
            engine = cls(client, tensors, kv, blocks)
        except BaseException:
            # The segment is this process's: unlinked here, or left in /dev/shm (a
            # SIGTERM's SystemExit lands anywhere up to the return).
            if kv is not None:
                kv.close()
            raise
        return engine

    def keys(self, tokens: list[int], extra: KeyExtras | None = None) -> tuple[str, ...]:
        return sequence_keys(self.client._reg.namespace, tokens, extra).all()

    def _timed(self, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.max_call_s = max(self.max_call_s, time.perf_counter() - t0)
        return out

    def poll(self) -> list:
        """Take completions (their blocks return to the pool) and durability reports."""
        done = self._timed(self.client.poll_completions)
        for c in done:
            self.free.extend(b for b in c.blocks if 0 <= b < self.blocks)
            if c.status == "captured":
                self.captured.add(c.seq_id)
                if c.pages_copied < len(c.blocks):
                    self.relied_on_store.add(c.seq_id)
        for d in self._timed(self.client.poll_durable):
            if d.durable:
                self.acknowledged.add(d.seq_id)
                self.not_durable.pop(d.seq_id, None)
            else:
                self.acknowledged.discard(d.seq_id)
                self.not_durable[d.seq_id] = d.reason
        for result in self._timed(self.client.poll_loads):
            self.loaded[result.load_id] = result
        return done

    def publish(self, seq_id: str, tokens: list[int], tries: int = 400,
                extra: KeyExtras | None = None) -> bool:
        """Fill blocks with the sequence's pages and publish them, retrying a skipped
        publication a while (a real engine would simply move on)."""
        keys = self.keys(tokens, extra)
        deadline = time.monotonic() + 30
        while len(self.free) < len(keys):
            if time.monotonic() > deadline:
                raise EngineStalled(f"blocks never came back: {self.client.counters}")
            self.poll()
            time.sleep(0.005)
        blocks = [self.free.pop() for _ in keys]
        pbytes = self.client._reg.views.page_bytes
        for k, b in zip(keys, blocks, strict=True):
            data = np.frombuffer(bytearray(page_bytes(k, pbytes)), np.uint8)
            self.client._reg.views.scatter(b, data)
        for _ in range(tries):
            if self._timed(self.client.publish, seq_id, tokens, blocks, extra=extra):
                self.accepted[seq_id] = tokens
                return True
            self.poll()
            time.sleep(0.01)
        self.free.extend(blocks)
        return False

    def wait_loaded(self, load_ids: list, timeout: float = 60) -> dict[object, LoadResult]:
        """Poll until every load of ``load_ids`` is reported; their reports."""
        deadline = time.monotonic() + timeout
        while not all(i in self.loaded for i in load_ids):
            if time.monotonic() > deadline:
                raise EngineStalled(f"loads never reported: {self.client.counters}")
            self.poll()
            time.sleep(0.002)
        return {i: self.loaded[i] for i in load_ids}

    def exact_pages(self, tokens: list[int], blocks: list[int],
                    extra: KeyExtras | None = None) -> list[bool]:
        """Per block of ``blocks``, whether it holds the page of ``tokens`` at its place."""
        keys = self.keys(tokens, extra)
        pbytes = self.client._reg.views.page_bytes
        out = np.empty(pbytes, np.uint8)
        exact = []
        for k, b in zip(keys, blocks, strict=False):
            self.client._reg.views.gather(b, out)
            exact.append(out.tobytes() == page_bytes(k, pbytes))
        return exact

    def drain(self, timeout: float = 60) -> None:
        """Wait until every publication's blocks came back and its durability is known."""
        deadline = time.monotonic() + timeout
        while (self.client.pending or self.client.awaiting_durable) and (
            time.monotonic() < deadline
        ):
            self.poll()
            time.sleep(0.01)
        self.poll()

    def restore_exact(self, tokens: list[int],
                      extra: KeyExtras | None = None) -> tuple[int, int]:
        """Restore ``tokens`` into zeroed blocks; (pages restored, pages byte-exact)."""
        for t in self.tensors:
            t.zero_()
        keys = self.keys(tokens, extra)
        blocks = list(range(len(keys)))
        page_tokens = self.client.cfg.page_tokens
        # Pages restored, the tail included.
        restored = -(-self.client.restore(tokens, blocks, extra=extra) // page_tokens)
        pbytes = self.client._reg.views.page_bytes
        out = np.empty(pbytes, np.uint8)
        exact = 0
        for k, b in zip(keys[:restored], blocks, strict=False):
            self.client._reg.views.gather(b, out)
            exact += out.tobytes() == page_bytes(k, pbytes)
        return restored, exact

    def close(self) -> None:
        self.client.close()
        self.tensors = []
        if self.kv is not None:
            self.kv.close()


def sequences(n: int, page_tokens: int = 16, seed: int = 0) -> dict[str, list[int]]:
    """``n`` token sequences: groups sharing 1-4 page prefixes, distinct tails."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 50000, page_tokens * int(rng.integers(1, 5))).tolist()
                for _ in range(n // 10 + 1)]
    out = {}
    for i in range(n):
        own = rng.integers(0, 50000, int(rng.integers(1, 3 * page_tokens))).tolist()
        out[f"seq-{i}"] = prefixes[i % len(prefixes)] + own
    return out
