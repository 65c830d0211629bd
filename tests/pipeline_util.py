"""Helpers of the pipeline tests: a supervisor subprocess and a synthetic engine."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from sparkcache import config
from sparkcache.client import SparkCacheClient
from sparkcache.identity import sequence_keys
from sparkcache.kvmem import SharedKVCaches
from sparkcache.store.testing import page_bytes
from sparkcache.supervisor import RUNTIME_FILE

PAGE_TOKENS = 16
LAYERS = 4
BLOCKS = 256
SHAPE = (2, BLOCKS, PAGE_TOKENS, 2, 32)  # [K/V, blocks, block size, heads, head dim]
SETTINGS = {
    "ranks": "1", "capture_slots": "4", "capture_slot_bytes": "1MiB",
    "page_tokens": str(PAGE_TOKENS), "max_bytes": "1GiB", "low_watermark_bytes": "512MiB",
    "metrics_port": "0",
}


def make_cfg(store: Path, instance: str, **more: str) -> config.Config:
    return config.load(
        env={}, overrides={"store_dir": str(store), "instance": instance, **SETTINGS, **more}
    )


def start_supervisor(store: Path, instance: str, *extra: str, env: dict | None = None,
                     wait_ready: bool = True) -> subprocess.Popen:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance]
    for k, v in SETTINGS.items():
        args += [config.flag_name(k), v]
    proc = subprocess.Popen(
        [*args, *extra], env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )
    if wait_ready:
        deadline = time.monotonic() + 90
        while not (store / RUNTIME_FILE).exists():
            if proc.poll() is not None:
                _, err = proc.communicate()
                pytest.fail(f"supervisor exited {proc.returncode}: {err[-3000:]}")
            if time.monotonic() > deadline:
                stop_supervisor(proc)
                pytest.fail("supervisor not ready in 90s")
            time.sleep(0.05)
    return proc


def stop_supervisor(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    """SIGTERM, wait, kill if it hangs (and fail). Returns (exit code, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        pytest.fail(f"supervisor {proc.pid} did not stop within {timeout}s")
    return proc.returncode, err


def runtime(store: Path) -> dict:
    return json.loads((store / RUNTIME_FILE).read_text())


def worker_pid(store: Path, role: str) -> int | None:
    for w in runtime(store)["workers"]:
        if w["role"] == role:
            return w["pid"]
    return None


@dataclass
class Engine:
    """A synthetic engine: KV tensors in shared memory, a block pool, and a client.
    Page contents derive from the page key, as a real engine's KV derives from the prefix."""

    client: SparkCacheClient
    kv: SharedKVCaches
    free: list[int] = field(default_factory=lambda: list(range(BLOCKS)))
    accepted: dict[str, list[int]] = field(default_factory=dict)
    acknowledged: set[str] = field(default_factory=set)
    max_call_s: float = 0.0

    @classmethod
    def create(cls, cfg: config.Config, instance: str, release_timeout_s: float = 5.0) -> Engine:
        kv = SharedKVCaches.create(instance, 0, [SHAPE] * LAYERS, torch.float16)
        client = SparkCacheClient(cfg, 0, release_timeout_s=release_timeout_s)
        assert client.register_kv_caches(kv.tensors)
        return cls(client, kv)

    def keys(self, tokens: list[int]) -> tuple[str, ...]:
        return sequence_keys(self.client._reg.namespace, tokens).all()

    def _timed(self, fn, *args):
        t0 = time.perf_counter()
        out = fn(*args)
        self.max_call_s = max(self.max_call_s, time.perf_counter() - t0)
        return out

    def poll(self) -> list:
        done = self._timed(self.client.poll_completions)
        for c in done:
            self.free.extend(b for b in c.blocks if 0 <= b < BLOCKS)
            if c.status == "captured":
                self.acknowledged.add(c.seq_id)
        return done

    def publish(self, seq_id: str, tokens: list[int], tries: int = 400) -> bool:
        keys = self.keys(tokens)
        deadline = time.monotonic() + 30
        while len(self.free) < len(keys):
            if time.monotonic() > deadline:
                pytest.fail(f"blocks never came back: {self.client.counters}")
            self.poll()
            time.sleep(0.005)
        blocks = [self.free.pop() for _ in keys]
        pbytes = self.client._reg.page_bytes
        for k, b in zip(keys, blocks, strict=True):
            data = np.frombuffer(bytearray(page_bytes(k, pbytes)), np.uint8)
            self.client._reg.views.scatter(b, data)
        for _ in range(tries):
            if self._timed(self.client.publish, seq_id, tokens, blocks):
                self.accepted[seq_id] = tokens
                return True
            self.poll()
            time.sleep(0.01)
        self.free.extend(blocks)
        return False

    def drain(self, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while self.client.pending and time.monotonic() < deadline:
            self.poll()
            time.sleep(0.01)
        self.poll()

    def close(self) -> None:
        self.client.close()
        self.kv.close()


def sequences(n: int, seed: int = 0) -> dict[str, list[int]]:
    """``n`` token sequences: groups sharing 1-4 page prefixes, distinct tails."""
    rng = np.random.default_rng(seed)
    prefixes = [rng.integers(0, 50000, PAGE_TOKENS * int(rng.integers(1, 5))).tolist()
                for _ in range(n // 10 + 1)]
    out = {}
    for i in range(n):
        own = rng.integers(0, 50000, int(rng.integers(1, 3 * PAGE_TOKENS))).tolist()
        out[f"seq-{i}"] = prefixes[i % len(prefixes)] + own
    return out
