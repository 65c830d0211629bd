"""The shared tier, measured in one run on a real Redis Cluster started for it (three
masters with a replica each, tests/redis_cluster.py, on this host). Prints JSON (--json).

The cluster's own paths, against a plain redis-py cluster pipeline of the same values
to the same cluster (medians of ``--rounds``, the order of the two sides alternating):

* ``share_vs_raw_pipeline``: what the share worker does with a root held in memory after
  its local read: ``fleet.pages.held`` (how far the cluster holds it), then
  ``fleet.pages.send`` of the rest in batches of ``--batch`` pages (8 MiB, the worker's
  ``BATCH_BYTES``), each page framed in place; against plain ``SET``s (target >= 0.8);
* ``fetch_vs_raw_pipeline``: ``fleet.pages.fetch_into`` in the restore worker's chunks
  (16 MiB), every page verified and copied into its buffer, against plain ``GET``s
  (target >= 0.8);
* ``pages_sent_per_unique_page``: two nodes sharing the same conversation, the second
  with more pages: pages sent by both over the distinct pages (target 1.0).

With vLLM's CPU engine (run with ``.vllm/cpu/bin/python``), two nodes (two supervisors,
two stores, one engine at a time in this process, a random 4-layer Llama, pages of 32
tokens: 512 KiB) and ``--conversations`` conversations of ``--prefix-tokens``:

* ``decode_share_on_vs_off``: node A's decode rate (greedy, 128 tokens after a short
  prompt) while its share worker sends the turn-1 pages of every conversation, over the
  rate while it is paused (SIGSTOP) with the same backlog, in turns, medians (target
  >= 0.99; the bytes it sent in each window it was on are printed);
* ``ttft2_other_node_vs_local``: turn 2 of a conversation on node B, its store empty,
  restored from the cluster (the read-through), over the same turn 2 on node A restored
  from its own store, its pages still in the page cache as a turn seconds later finds
  them; medians (target <= 2.0). ``ttft2_other_node_vs_local_cold``: the same against
  node A with its store's files dropped from the page cache first (read from the disk);
* after a master is killed with turns 2 in flight on node B: ``requests_completed``,
  ``wrong_outputs`` (turns whose tokens differ from a full recompute's: 0) and
  ``fleet_bad_pages``.

Usage: ``python scripts/bench_fleet.py [--json] [--pages 1024] [--page-kib 64]
[--rounds 3] [--batch 128] [--prefix-tokens 8192] [--conversations 6]``; needs
``redis-server`` and ``redis-cli`` (scripts/setup).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np
import psutil

from sparkcache.fleet import codec
from sparkcache.fleet.cluster import ClusterSettings, connect, page_name
from sparkcache.fleet.pages import fetch_into, held, send, share
from tests.redis_cluster import Cluster, redis_cluster

CHUNK_BYTES = 16 << 20  # the restore worker's chunk (workers/restore.py)
DECODE_TOKENS = 128


def _pages(n: int, size: int) -> list[tuple[bytes, bytes]]:
    return [(os.urandom(16), os.urandom(size)) for _ in range(n)]


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def cluster_paths(cluster: Cluster, args: argparse.Namespace) -> dict:
    size = args.page_kib << 10
    chunk = max(1, CHUNK_BYTES // size)
    client = connect(ClusterSettings(cluster.url, key_prefix="bench"))
    share_ratio, fetch_ratio = [], []
    for r in range(args.rounds):
        batch = _pages(args.pages, size)
        keys = [k for k, _ in batch]
        names = [page_name("bench", 0, k) for k in keys]
        values = [codec.encode(0, k, v) for k, v in batch]
        # As the share worker holds a batch after its local read (not timed): each page
        # after a header's room.
        room = codec.HEADER.size
        rows = np.empty((len(batch), room + size), np.uint8)
        for i, (_, v) in enumerate(batch):
            rows[i, room:] = np.frombuffer(v, np.uint8)
        into = np.empty((chunk, size), np.uint8)

        def raw_set(names=names, values=values) -> None:
            pipe = client.pipeline(transaction=False)
            for name, value in zip(names, values, strict=True):
                pipe.set(name, value)
            pipe.execute()

        def raw_get(names=names) -> None:
            pipe = client.pipeline(transaction=False)
            for name in names:
                pipe.get(name)
            pipe.execute()

        def ours_share(keys=keys, rows=rows) -> None:
            for i in range(held(client, "bench", (0,), keys), len(keys), args.batch):
                send(client, "bench", 0, [(keys[j], codec.frame(0, keys[j], rows[j]))
                                          for j in range(i, min(i + args.batch, len(keys)))])

        def ours_fetch(keys=keys, into=into) -> None:
            for i in range(0, len(keys), chunk):
                part = keys[i:i + chunk]
                got = fetch_into(client, "bench", 0, part, into, size)
                if got.pages != len(part):
                    raise RuntimeError(f"fetch came short: {got}")

        def clear(names=names) -> None:
            for i in range(0, len(names), 512):
                client.delete(*names[i:i + 512])

        took = {}
        sides = [("raw", raw_set), ("ours", ours_share)]
        for name, fn in (sides if r % 2 == 0 else sides[::-1]):
            clear()
            took[name] = _timed(fn)
        share_ratio.append(took["raw"] / took["ours"])
        reads = [("raw", raw_get), ("ours", ours_fetch)]
        for name, fn in (reads if r % 2 == 0 else reads[::-1]):
            took[name] = _timed(fn)
        fetch_ratio.append(took["raw"] / took["ours"])
        clear()
    conversation, more = _pages(args.pages // 2, size), _pages(args.pages // 4, size)
    a = connect(ClusterSettings(cluster.url, key_prefix="fleet"))
    b = connect(ClusterSettings(cluster.url, key_prefix="fleet"))
    sent = (share(a, "fleet", 0, conversation).sent
            + share(b, "fleet", 0, conversation + more).sent)
    for c in (client, a, b):
        c.close()
    return {
        "pages": args.pages, "page_bytes": size, "rounds": args.rounds, "batch": args.batch,
        "share_vs_raw_pipeline": statistics.median(share_ratio),
        "share_vs_raw_pipeline_each": [round(x, 3) for x in share_ratio],
        "fetch_vs_raw_pipeline": statistics.median(fetch_ratio),
        "fetch_vs_raw_pipeline_each": [round(x, 3) for x in fetch_ratio],
        "pages_sent_per_unique_page": sent / (len(conversation) + len(more)),
    }


# ---------------------------------------------------------------------- the engine


def _load_seconds(before, after) -> float:
    """The restore worker's mean time a load between two of its stats records."""
    return (after.dur_sum_s - before.dur_sum_s) / max(1, after.dur_count - before.dur_count)


def engine_paths(cluster: Cluster, work: Path, args: argparse.Namespace) -> dict:
    from sparkcache.workers.lifecycle import Role
    from vllm import SamplingParams

    from sparkcache.store.testing import evict_from_page_cache
    from tests.with_vllm.engine_util import (
        BENCH_LLAMA,
        BLOCK,
        engine_beside_supervisor,
        stored_prefix_pages,
        wait_until,
        worker_stats,
        write_checkpoint,
    )

    os.environ.update({"SPARKCACHE_SHARE_CLUSTER_URL": cluster.url,
                       "SPARKCACHE_SHARE_KEY_PREFIX": "bench-engine"})
    model = write_checkpoint(work / "model", BENCH_LLAMA)
    pages = args.prefix_tokens // BLOCK
    convs = [[(i * (31 + 2 * c)) % 1000 + 3 for i in range(pages * BLOCK)]
             for c in range(args.conversations)]
    measured, warm, killed = convs[:-3], convs[-3], convs[-2:]
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False, ignore_eos=True)
    greedy = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False, ignore_eos=True)

    def timed(llm, tokens: list[int], params=one, salt: str | None = None):
        prompt = {"prompt_token_ids": tokens, **({"cache_salt": salt} if salt else {})}
        t0 = time.perf_counter()
        out = llm.generate([prompt], params, use_tqdm=False)[0]
        return time.perf_counter() - t0, out

    def decode_rate(llm, reps: int) -> float:
        rates = []
        for i in range(reps):
            prompt = [7 + i, 8, 9, 10]
            t1, _ = timed(llm, prompt, SamplingParams(max_tokens=1, temperature=0.0,
                                                       ignore_eos=True, detokenize=False))
            tn, _ = timed(llm, prompt, SamplingParams(max_tokens=DECODE_TOKENS, temperature=0.0,
                                                       ignore_eos=True, detokenize=False))
            rates.append((DECODE_TOKENS - 1) / max(1e-9, tn - t1))
        return statistics.median(rates)

    def turn2(prefix: list[int]) -> list[int]:
        return [*prefix, 11, 12, 13, 14, 15]

    out: dict = {"prefix_tokens": pages * BLOCK, "conversations": len(convs),
                 "engine_page_bytes": 2 * BENCH_LLAMA["num_hidden_layers"]
                 * BENCH_LLAMA["num_key_value_heads"] * BENCH_LLAMA["head_dim"] * BLOCK * 4}
    # Node A's supervisor lets a worker be silent 10 minutes: its share worker is paused.
    with engine_beside_supervisor(work / "a", model, "bench-fleet", "--heartbeat-timeout-s",
                                  "600", max_model_len=args.prefix_tokens + 1024) as (
            llm, store):
        timed(llm, [5] * 40)
        # Paused while turns 1 are stored, so they are all still to share: then, in
        # turn, decode with it sharing and paused (SIGSTOP: the same process and
        # backlog, none of its work; well within the supervisor's heartbeat limit).
        sharer = psutil.Process(int(worker_stats(store, Role.SHARE).pid))
        sharer.suspend()
        try:
            for prefix in convs:
                timed(llm, [*prefix, 1, 2])
            wait_until(lambda: all(stored_prefix_pages(store, p) >= pages for p in convs), 600,
                  "every turn 1 stored on node A", step=lambda: timed(llm, [5] * 4))
            rates: dict[str, list[float]] = {"on": [], "off": []}
            sent = []  # bytes the share worker sent in each window it was on
            for _ in range(args.decode_reps):
                for side in ("on", "off"):
                    before = worker_stats(store, Role.SHARE).copy_bytes
                    (sharer.resume if side == "on" else sharer.suspend)()
                    rates[side].append(decode_rate(llm, 1))
                    if side == "on":
                        sharer.suspend()
                        time.sleep(0.2)  # its last stats written
                        sent.append(int(worker_stats(store, Role.SHARE).copy_bytes - before))
        finally:
            sharer.resume()
        on, off = statistics.median(rates["on"]), statistics.median(rates["off"])
        out.update(decode_share_on_vs_off=on / off, decode_tok_s_share_on=round(on, 1),
                   decode_tok_s_share_off=round(off, 1),
                   decode_tok_s_each={k: [round(x, 1) for x in v] for k, v in rates.items()},
                   share_bytes_sent_while_on=sent)
        wait_until(lambda: worker_stats(store, Role.SHARE).backlog == 0, 900,
              "node A's share worker done", step=lambda: timed(llm, [5] * 4))
        mark = worker_stats(store, Role.RESTORE)
        local = [timed(llm, turn2(p))[0] for p in measured]
        load_local = _load_seconds(mark, worker_stats(store, Role.RESTORE))
        cold = []  # again, the store's files out of the page cache first: from the disk
        mark = worker_stats(store, Role.RESTORE)
        for p in measured:
            evict_from_page_cache(store)
            cold.append(timed(llm, turn2(p))[0])
        load_cold = _load_seconds(mark, worker_stats(store, Role.RESTORE))
    with engine_beside_supervisor(work / "b", model, "bench-fleet",
                                  max_model_len=args.prefix_tokens + 1024) as (llm, store):
        timed(llm, turn2(warm))  # the cluster's connections opened, as in a node's life
        other, hits = [], []
        mark = worker_stats(store, Role.RESTORE)
        for p in measured:
            took, result = timed(llm, turn2(p))
            other.append(took)
            hits.append((result.num_cached_tokens or 0) >= pages * BLOCK)
        load_other = _load_seconds(mark, worker_stats(store, Role.RESTORE))
        recompute = [timed(llm, turn2(p), salt="recompute")[0] for p in measured]
        out.update(ttft2_other_node_vs_local=statistics.median(other) / statistics.median(local),
                   ttft2_other_node_vs_local_cold=(statistics.median(other)
                                                   / statistics.median(cold)),
                   ttft2_local_s=[round(x, 3) for x in local],
                   ttft2_local_cold_s=[round(x, 3) for x in cold],
                   ttft2_other_node_s=[round(x, 3) for x in other],
                   ttft2_recompute_s=[round(x, 3) for x in recompute],
                   # The restore worker's own time a load, of those turns 2.
                   restore_load_s_local=load_local, restore_load_s_local_cold=load_cold,
                   restore_load_s_other_node=load_other,
                   other_node_full_hits=sum(hits), other_node_turns=len(hits))
        # A master killed with turns 2 in flight.
        results: dict[int, object] = {}

        def serve() -> None:
            prompts = [{"prompt_token_ids": turn2(p)} for p in killed]
            for i, r in enumerate(llm.generate(prompts, greedy, use_tqdm=False)):
                results[i] = r

        thread = threading.Thread(target=serve)
        thread.start()
        time.sleep(0.05)
        cluster.kill(cluster.masters()[0])
        thread.join(600)
        wrong = 0
        for i, p in enumerate(killed):
            want = llm.generate([{"prompt_token_ids": turn2(p), "cache_salt": "recompute"}],
                                greedy, use_tqdm=False)[0]
            got = results.get(i)
            wrong += got is None or list(got.outputs[0].token_ids) != list(
                want.outputs[0].token_ids)
        rec = worker_stats(store, Role.RESTORE)
        out.update(master_killed=True, requests_completed=len(results),
                   requests_sent=len(killed), wrong_outputs=wrong,
                   fleet_bad_pages=int(rec.fleet_bad_pages),
                   fetched_from_cluster_bytes=int(rec.read_bytes_cluster))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--pages", type=int, default=1024)
    parser.add_argument("--page-kib", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch", type=int, default=128, help="pages per share batch")
    parser.add_argument("--prefix-tokens", type=int, default=8192)
    parser.add_argument("--conversations", type=int, default=6,
                        help="at least 4: measured ones, a warm-up, two for the kill")
    parser.add_argument("--decode-reps", type=int, default=7)
    args = parser.parse_args()
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        print("bench_fleet: needs redis-server and redis-cli (scripts/setup installs them)",
              file=sys.stderr)
        return 1
    if args.conversations < 4:
        print("bench_fleet: --conversations must be at least 4", file=sys.stderr)
        return 2
    from tests.with_vllm.engine_util import engine_installed

    work = Path(tempfile.mkdtemp(prefix="sparkcache-fleet-"))
    try:
        with redis_cluster(work / "cluster") as cluster:
            result = {"cluster": "3 masters + 3 replicas, redis-server on this host",
                      **cluster_paths(cluster, args)}
            if engine_installed():
                result.update(engine_paths(cluster, work, args))
            else:
                result["not_measured"] = (
                    "ttft2_other_node_vs_local, decode_share_on_vs_off and the master "
                    "kill need vLLM's CPU engine: run with .vllm/cpu/bin/python")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result = {k: round(v, 3) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>34}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
