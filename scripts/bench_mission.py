"""Mission scale: long agent conversations, several at once, against a store at its cap.

A real supervisor runs its workers beside an engine that plays vLLM's part (KV tensors in
shared memory, blocks handed out and taken back, the client's calls on its thread):

* pages of an 8B model's shape (Llama 3 8B: 8 KV heads of 128, 16-bit, 16-token pages;
  128 KiB a token over its 32 layers), with fewer layers where this machine's memory and
  disk need it (``--layers``, 1 by default: 4 KiB a token; the output says so);
* ``--conversations`` (8) growing from ``--start-tokens`` (75k) to ``--end-tokens``
  (300k) in turns of 2k-8k new tokens; ``--active`` (3) of them take turns at once, each
  for a few turns before another takes its place, so every conversation comes back to a
  store that has evicted meanwhile;
* the store's cap (``max_bytes``) at half the working set, every other setting at its
  default (the lease included: 300 s).

A turn: the engine looks its prompt up (a read lease, which the load's report ends), loads
the stored prefix into fresh blocks through the restore worker, checks loaded pages byte
for byte (the first, the last and 14 more at random), computes the rest (fills the
blocks), then publishes the whole prompt under a new request id, as vLLM does every turn.
The turns of a round start at once.

Figures (JSON with ``--json``):

* ``first_turn_stored``: first turns acknowledged durable, of all (target 1.0);
* ``load_capacity_failures``: loads refused or failed for capacity (a full ring, the
  load limit, too large; target 0);
* ``restore_vs_sequential``: per round, a sequential read of the files holding the
  round's loaded prefixes, cold, over the round's loads from the first call to the last
  report, cold too; median over rounds (target >= 0.8);
* ``commit_vs_sequential``: per round, a sequential write (and fsync) of the bytes its
  publications added over the time from its first publication to its last durable
  acknowledgement, first turns included; median (target >= 0.8);
* ``restore_300k_over_75k``: one load of a whole 300k-token prefix over one of its first
  75k tokens, each alone and cold, medians of three (target <= 4.4, 4 is linear); the
  conversation the store holds most of at the end, published whole first if the cap has
  cut it;
* ``engine_step_us_p99``: the engine's step (every client call it makes in one pass of
  its loop) at p99 while loads and saves run (target <= 200);
* ``shm_bytes_per_rank``: the peak of SparkCache's own ``/dev/shm`` segments, sampled
  (the engine's KV segment not counted; target <= 1 GiB);
* ``refused_publications_at_cap``: publications skipped as ``store_full`` (target 0);
* ``wrong_pages``: checked pages not byte-exact (0);
* ``lookup_misses``: the bench's lookups that missed, by reason (a turn that missed loads
  nothing and computes its whole prompt);
* ``capture_ms_mean``, ``commit_ms_mean``: what a publication took in the capture worker
  and in the commit worker, on average (their duration histograms' sums over counts):
  where a round's commit time goes.

Usage: ``python scripts/bench_mission.py [--json] [--dir D] [--layers 1] [--quick]``
(``--quick``: 6 conversations of 20k-60k tokens, 2 at once, for a smoke run).
"""

from __future__ import annotations

import argparse
import copy
import hashlib
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import torch
from sparkcache.shm.segment import instance_prefix
from sparkcache.workers.lifecycle import Role, State

from sparkcache import config, segments
from sparkcache.client import SparkCacheClient
from sparkcache.identity import KEY_BYTES, keys_bytes, sequence_keys
from sparkcache.kvmem import SharedKVCaches
from sparkcache.prefix_lookup import PrefixLookup
from sparkcache.protocol import new_lease_id
from sparkcache.runtime import RUNTIME_FILE
from sparkcache.store.layout import fanout, object_name
from sparkcache.store.reader import StoreReader
from sparkcache.store.testing import drop_from_page_cache

GIB = 1 << 30
MODEL_LAYERS, HEADS, HEAD_DIM, PAGE_TOKENS = 32, 8, 128, 16
CAPACITY_MISSES = ("ring_full", "load_limit", "too_large")
CHECKED_PAGES = 16



@dataclass
class Conversation:
    name: str
    keys: list[str]  # every page of its last turn, in order
    raw: bytes  # the same keys raw (``keys_bytes``), as vLLM's scheduler hands them over
    turns: list[int]  # pages of each turn's prompt
    done: int = 0  # turns taken
    first_stored: bool | None = None
    published: bool = False  # the current turn's publication was taken

    @property
    def finished(self) -> bool:
        return self.done >= len(self.turns)

    @property
    def request(self) -> str:
        """The id the current turn is published under: a new one every turn, as vLLM
        sends each turn of a conversation as a new request."""
        return f"{self.name}/{self.done}"


@dataclass
class Engine:
    """The engine's thread: a block pool, the client, and the time of each step."""

    client: SparkCacheClient
    kv: SharedKVCaches
    free: list[int]
    steps_us: list[float] = field(default_factory=list)
    loaded: dict = field(default_factory=dict)
    completed: set = field(default_factory=set)
    durable: dict = field(default_factory=dict)

    def step(self, *calls) -> list:
        """One pass of the loop: ``calls`` (a load, a publication), then every poll."""
        t0 = time.perf_counter()
        out = [call() for call in calls]
        for r in self.client.poll_loads():
            self.loaded[r.load_id] = r
        for c in self.client.poll_completions():
            self.completed.add(c.seq_id)
            if c.status != "captured":  # never committed: no durability report follows
                self.durable[c.seq_id] = None
        for d in self.client.poll_durable():
            self.durable[d.seq_id] = d
        self.steps_us.append((time.perf_counter() - t0) * 1e6)
        return out


def page_content(key: str, size: int) -> np.ndarray:
    """A page's bytes, derived from its key (its 64-byte digest repeated): a wrong page
    is another pattern."""
    pattern = np.frombuffer(hashlib.blake2b(key.encode()).digest(), np.uint8)
    return np.tile(pattern, size // pattern.size)


def shm_bytes(instance: str) -> int:
    """Bytes SparkCache's segments of ``instance`` hold in /dev/shm (the engine's own KV
    segment aside)."""
    total = 0
    for entry in os.scandir("/dev/shm"):
        if entry.name.startswith(instance_prefix(instance)) and ".kv" not in entry.name:
            try:
                total += entry.stat().st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def files_of(reader: StoreReader, objects: Path, keys: list[str]) -> list[Path]:
    """The files holding ``keys``' stored objects, in page order, once each."""
    out = []
    for page in reader.plan(keys):
        name, gen = page.file
        out.append(objects / fanout(name) / object_name(name, gen))
    return list(dict.fromkeys(out))


def sequential_read(paths: list[Path]) -> tuple[float, int]:
    buf = memoryview(bytearray(16 << 20))
    start, total = time.perf_counter(), 0
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue  # evicted since: the restores read it, the baseline cannot
        try:
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return time.perf_counter() - start, total


def sequential_write(where: Path, nbytes: int) -> float:
    """Write ``nbytes`` to a new file on the store's filesystem and fsync it."""
    chunk = np.random.default_rng(0).integers(0, 256, 16 << 20, np.uint8).tobytes()
    path = where / f"baseline.{uuid.uuid4().hex}"
    start = time.perf_counter()
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        left = nbytes
        while left > 0:
            left -= os.write(fd, chunk[: min(left, len(chunk))])
        os.fsync(fd)
    finally:
        os.close(fd)
    took = time.perf_counter() - start
    path.unlink()
    return took


def start_supervisor(store: Path, instance: str, settings: dict[str, str]) -> subprocess.Popen:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance]
    for k, v in settings.items():
        args += [config.flag_name(k), v]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (store / RUNTIME_FILE).exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"supervisor did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.05)
    return proc


def wait_ready(cfg: config.Config) -> None:
    with segments.attach_stats(cfg, 0) as stats:
        deadline = time.monotonic() + 120
        while not all((rec := stats.read(int(role))) is not None and rec.state == State.READY
                      for role in (Role.CAPTURE, Role.COMMIT, Role.RESTORE,
                                   Role.MAINTENANCE)):
            if time.monotonic() > deadline:
                raise RuntimeError("workers not READY")
            time.sleep(0.05)


def plan_conversations(n: int, start: int, end: int, turn_min: int, turn_max: int,
                       ns, rng: random.Random) -> list[Conversation]:
    convs = []
    end_pages = end // PAGE_TOKENS
    for i in range(n):
        tokens = np.random.default_rng(1000 + i).integers(
            0, 128_000, end_pages * PAGE_TOKENS).tolist()
        turns = [start // PAGE_TOKENS]
        while turns[-1] < end_pages:
            turns.append(min(end_pages, turns[-1] + rng.randint(turn_min, turn_max)
                             // PAGE_TOKENS))
        keys = list(sequence_keys(ns, tokens).pages)
        convs.append(Conversation(f"conv-{i}", keys, keys_bytes(keys), turns))
    return convs


def run_round(engine: Engine, lookup: PrefixLookup, convs: list[Conversation],
              page: int, rng: random.Random, sample_shm) -> dict:
    """One turn of each of ``convs``, all at once; what it measured."""
    client, views = engine.client, engine.client._reg.views
    jobs = []
    for c in convs:
        n = c.turns[c.done]
        blocks = [engine.free.pop() for _ in range(n)]
        lease = new_lease_id()  # ended by its load's report, as vLLM's connector does
        hit = lookup.lookup(c.keys[:n], lease=lease)
        jobs.append((c, n, blocks, hit, f"{c.name}/{c.done}", lease))
    # Cold: the files a round's loads read are dropped from the page cache first.
    reader = StoreReader(client.cfg.store_dir, 0)
    objects = client.cfg.store_dir / "rank-0" / "objects"
    try:
        paths = [p for c, n, _, hit, *_ in jobs if hit for p in files_of(reader, objects,
                                                                       c.keys[:hit])]
    finally:
        reader.close()
    drop_from_page_cache(paths)
    load_started = time.perf_counter()
    asked = []
    for c, _, blocks, hit, lid, lease in jobs:
        if hit and engine.step(lambda c=c, b=blocks, h=hit, i=lid, r=lease:
                               client.load_keys(i, c.raw[: KEY_BYTES * h], b[:h],
                                                lease=r))[0]:
            asked.append(lid)
    while not all(i in engine.loaded for i in asked):
        engine.step()
        sample_shm()
        time.sleep(0.0005)
    load_s = time.perf_counter() - load_started
    loaded_bytes = 0
    wrong = 0
    out = np.empty(page, np.uint8)
    for c, n, blocks, _, lid, _ in jobs:
        got = engine.loaded[lid].tokens // PAGE_TOKENS if lid in engine.loaded else 0
        loaded_bytes += got * page
        if got:
            for i in {0, got - 1, *rng.sample(range(got), min(got, CHECKED_PAGES - 2))}:
                views.gather(blocks[i], out)
                wrong += not np.array_equal(out, page_content(c.keys[i], page))
        for i in range(got, n):  # the forward pass computes what was not loaded
            views.scatter(blocks[i], page_content(c.keys[i], page))
    drop_from_page_cache(paths)
    seq_read_s, seq_read_bytes = sequential_read(paths)
    # Publications of the whole prompts, all at once.
    stored_before = {c.name: stored_prefix(lookup, c.keys[: c.turns[c.done]])
                     for c, *_ in jobs}
    pub_started = time.perf_counter()
    for c, _, blocks, *_ in jobs:
        c.published = engine.step(lambda c=c, b=blocks:
                                  client.publish_keys(c.request, c.raw[: KEY_BYTES * len(b)],
                                                      b))[0]
    published = [c for c, *_ in jobs if c.published]
    deadline = time.monotonic() + 600
    while not all(c.request in engine.durable for c in published):
        if time.monotonic() > deadline:
            raise RuntimeError(f"publications never acknowledged: {client.counters}")
        engine.step()
        sample_shm()
        time.sleep(0.0005)
    commit_s = time.perf_counter() - pub_started
    added = sum((len(b) - stored_before[c.name]) * page for c, _, b, *_ in jobs
                if c.published)
    # The baseline right after, as the disk is now (a full store's writeback included).
    seq_write_s = sequential_write(client.cfg.store_dir, added) if added >= 16 << 20 else None
    for c, _, blocks, *_ in jobs:
        first = c.done == 0
        ok = c.published and engine.durable[c.request] is not None \
            and engine.durable[c.request].durable
        if first:
            c.first_stored = bool(ok)
        c.done += 1
        engine.free.extend(blocks)
    return {"load_s": load_s, "loaded_bytes": loaded_bytes, "seq_read_s": seq_read_s,
            "seq_read_bytes": seq_read_bytes, "commit_s": commit_s, "added_bytes": added,
            "seq_write_s": seq_write_s,
            "wrong": wrong, "loads": len(asked)}


def stored_prefix(lookup: PrefixLookup, keys: list[str]) -> int:
    """Pages of ``keys`` stored, asked as a lookup whose load will not come: its lease
    is released at once (``PrefixLookup.release``), as vLLM's connector does."""
    lease = new_lease_id()
    pages = lookup.lookup(keys, lease=lease)
    lookup.release(lease)
    return pages


def publish_whole(engine: Engine, c: Conversation, page: int) -> None:
    """Publish ``c``'s whole last prompt, computed (its blocks filled), and wait until it
    is durable."""
    blocks = [engine.free.pop() for _ in c.keys]
    try:
        for key, block in zip(c.keys, blocks, strict=True):
            engine.client._reg.views.scatter(block, page_content(key, page))
        name = f"{c.name}/whole"
        deadline = time.monotonic() + 600
        # Refused while maintenance brings the store back under its hard cap: asked again,
        # as an engine's next turn would be.
        while not engine.step(lambda: engine.client.publish_keys(name, c.raw, blocks))[0]:
            if time.monotonic() > deadline:
                raise RuntimeError(f"whole publication refused: "
                                   f"{engine.client.counters.skipped}")
            time.sleep(0.25)
        while name not in engine.durable:
            if time.monotonic() > deadline:
                raise RuntimeError("whole publication never acknowledged")
            engine.step()
            time.sleep(0.0005)
        if engine.durable[name] is None or not engine.durable[name].durable:
            raise RuntimeError(f"whole publication not stored: {engine.durable[name]}")
    finally:
        engine.free.extend(blocks)


def mean_durations_ms(cfg: config.Config) -> dict[Role, float | None]:
    """Capture's and commit's mean duration of a publication so far, in ms."""
    out: dict[Role, float | None] = {}
    with segments.attach_stats(cfg, 0) as stats:
        for role in (Role.CAPTURE, Role.COMMIT):
            rec = stats.read(int(role))
            out[role] = (rec.dur_sum_s / rec.dur_count * 1e3
                         if rec is not None and rec.dur_count else None)
    return out


def lone_load_s(engine: Engine, keys: list[str], store: Path) -> float:
    reader = StoreReader(store, 0)
    try:
        paths = files_of(reader, store / "rank-0" / "objects", keys)
    finally:
        reader.close()
    drop_from_page_cache(paths)
    blocks = [engine.free.pop() for _ in keys]
    lid = f"lone-{uuid.uuid4().hex}"
    t0 = time.perf_counter()
    if not engine.client.load_keys(lid, keys_bytes(keys), blocks):
        raise RuntimeError(f"load refused: {engine.client.counters}")
    while lid not in engine.loaded:
        engine.step()
        time.sleep(0.0005)
    took = time.perf_counter() - t0
    engine.free.extend(blocks)
    if engine.loaded[lid].tokens != len(keys) * PAGE_TOKENS:
        raise RuntimeError(f"lone load: {engine.loaded[lid]}")
    return took


def bench(work: Path, args: argparse.Namespace) -> dict:
    rng = random.Random(args.seed)
    page = args.layers * 2 * PAGE_TOKENS * HEADS * HEAD_DIM * 2
    end_pages = args.end_tokens // PAGE_TOKENS
    working_set = args.conversations * end_pages * page
    max_bytes = working_set // 2
    settings = {"ranks": "1", "page_tokens": str(PAGE_TOKENS), "max_bytes": str(max_bytes),
                "low_watermark_bytes": str(max_bytes * 4 // 5), "metrics_port": "0"}
    store = work / "store"
    instance = "m" + uuid.uuid4().hex[:10]
    cfg = config.load(env={}, overrides={"store_dir": str(store), "instance": instance,
                                         **settings})
    blocks = args.active * end_pages + 64
    shapes = [(2, blocks, PAGE_TOKENS, HEADS, HEAD_DIM)] * args.layers
    sup = start_supervisor(store, instance, settings)
    kv = SharedKVCaches.create(instance, 0, shapes, torch.float16)
    client = SparkCacheClient(cfg, 0, model_id=f"bench-8b-{args.layers}l")
    lookup = PrefixLookup(cfg, 1)
    peak = [0, 0.0]

    def sample_shm() -> None:
        if time.monotonic() - peak[1] > 0.25:
            peak[0], peak[1] = max(peak[0], shm_bytes(instance)), time.monotonic()

    try:
        if not client.register_kv_caches(kv.tensors):
            raise RuntimeError("registration refused")
        assert client._reg.views.page_bytes == page
        wait_ready(cfg)
        engine = Engine(client, kv, list(range(blocks)))
        convs = plan_conversations(args.conversations, args.start_tokens, args.end_tokens,
                                   args.turn_min, args.turn_max, client._reg.namespace, rng)
        rounds, active, streak = [], [], {}
        started = time.monotonic()
        while True:
            for c in [c for c in active if c.finished or streak[c.name] <= 0]:
                active.remove(c)
            waiting = [c for c in convs if not c.finished and c not in active]
            while len(active) < args.active and waiting:
                c = min(waiting, key=lambda c: (c.done > 0, c.done))  # first turns first
                waiting.remove(c)
                active.append(c)
                streak[c.name] = rng.randint(2, 6)
            if not active:
                break
            rounds.append(run_round(engine, lookup, active, page, rng, sample_shm))
            for c in active:
                streak[c.name] -= 1
            if not args.json:
                r = rounds[-1]
                print(f"round {len(rounds)}: {[f'{c.name}@{c.turns[c.done - 1]}' for c in active]}"
                      f" load {r['loaded_bytes'] / GIB:.2f} GiB in {r['load_s']:.2f}s, "
                      f"commit {r['added_bytes'] / GIB:.2f} GiB in {r['commit_s']:.2f}s "
                      f"(sequential {r['seq_write_s'] or 0:.2f}s)",
                      file=sys.stderr)
        elapsed = time.monotonic() - started
        steps = sorted(engine.steps_us)
        counters = copy.deepcopy(engine.client.counters)  # the rounds', not what follows
        worker_ms = mean_durations_ms(cfg)
        # A whole 300k prefix against its first 75k, each alone and cold: the
        # conversation the store holds most of, published whole first where the cap has
        # cut it (its newest root, so the last that eviction takes).
        last = max(convs, key=lambda c: stored_prefix(lookup, c.keys))
        if stored_prefix(lookup, last.keys) < len(last.keys):
            publish_whole(engine, last, page)
        short = args.start_tokens // PAGE_TOKENS
        ratio = None
        if stored_prefix(lookup, last.keys) == len(last.keys):
            t_short, t_full = [], []
            for _ in range(3):
                t_short.append(lone_load_s(engine, last.keys[:short], store))
                t_full.append(lone_load_s(engine, last.keys, store))
            ratio = statistics.median(t_full) / statistics.median(t_short)
        restore_ratios = [r["seq_read_s"] / r["load_s"] * r["loaded_bytes"] / r["seq_read_bytes"]
                          for r in rounds if r["loaded_bytes"] and r["seq_read_bytes"]]
        commit_ratios = [r["seq_write_s"] / r["commit_s"] for r in rounds if r["seq_write_s"]]
        return {
            "model": f"8B shape (8 KV heads x 128, 16-bit, 16-token pages), {args.layers} of "
                     f"{MODEL_LAYERS} layers: {page * MODEL_LAYERS // args.layers // 1024} KiB a "
                     f"page at full depth, {page // 1024} KiB here",
            "page_bytes": page,
            "conversations": args.conversations,
            "tokens": [args.start_tokens, args.end_tokens],
            "working_set_gib": working_set / GIB,
            "max_bytes_gib": max_bytes / GIB,
            "rounds": len(rounds),
            "turns": sum(c.done for c in convs),
            "elapsed_s": elapsed,
            "first_turn_stored": sum(bool(c.first_stored) for c in convs) / len(convs),
            "load_capacity_failures": sum(counters.misses[m] for m in CAPACITY_MISSES),
            "load_misses": dict(counters.misses),
            "lookup_misses": dict(lookup.misses),
            "load_status": dict(counters.load_status),
            "restore_vs_sequential": statistics.median(restore_ratios) if restore_ratios
            else None,
            "commit_vs_sequential": statistics.median(commit_ratios) if commit_ratios else None,
            "restore_300k_over_75k": ratio,
            "engine_step_us_p99": steps[int(len(steps) * 0.99)] if steps else None,
            "engine_step_us_max": steps[-1] if steps else None,
            "shm_bytes_per_rank": peak[0],
            "refused_publications_at_cap": counters.skipped["store_full"],
            "skipped_publications": dict(counters.skipped),
            "publications_released_by_deadline": counters.released_by_deadline,
            "wrong_pages": sum(r["wrong"] for r in rounds),
            "capture_ms_mean": worker_ms[Role.CAPTURE],
            "commit_ms_mean": worker_ms[Role.COMMIT],
            "restored_gib": sum(r["loaded_bytes"] for r in rounds) / GIB,
            "published_gib": sum(r["added_bytes"] for r in rounds) / GIB,
        }
    finally:
        lookup.close()
        client.close()
        kv.close()
        sup.send_signal(signal.SIGTERM)
        try:
            sup.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            sup.kill()
            sup.communicate()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--layers", type=int, default=1,
                        help=f"layers of the {MODEL_LAYERS} of an 8B model kept")
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--active", type=int, default=3, help="conversations taking turns at once")
    parser.add_argument("--start-tokens", type=int, default=75_000)
    parser.add_argument("--end-tokens", type=int, default=300_000)
    parser.add_argument("--turn-min", type=int, default=2_000)
    parser.add_argument("--turn-max", type=int, default=8_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true",
                        help="6 conversations of 20k-60k tokens, 2 at once: a smoke run")
    args = parser.parse_args()
    if args.quick:
        # The cap still holds the active conversations whole (6 x 60k tokens at the cap's
        # half: 703 MiB; 2 active: 469 MiB), as at full size (8 x 300k: 4.7 GiB; 3: 3.5).
        args.conversations, args.start_tokens, args.end_tokens = 6, 20_000, 60_000
        args.active = 2
    work = Path(tempfile.mkdtemp(prefix="sparkcache-mission-", dir=args.dir))
    try:
        result = bench(work, args)
    finally:
        shutil.rmtree(work)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>28}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
