#!/usr/bin/env python3
"""The vLLM connector's costs, measured in one run, as JSON (--json) or a table.

* ``lookup_ms_300k``: the scheduler side's leased lookup (``PrefixLookup``: the lookup
  gate, the index, the lease) of a 300k-token request of which 100k tokens are stored,
  page keys already made; median of 50. Target <= 2.
* ``keys_ms_300k``: page keys of the next turn of a 300k-token conversation
  (``scripts/bench_keys.py``, which also reports the cold and per-step figures). Target <= 5.
* ``scheduler_step_us_p99`` / ``worker_step_us_p99``: time spent in the connector's calls
  per engine step, scheduler side and one worker side, with 8 requests running and
  loads and saves in flight (vLLM 0.33's real Scheduler and worker-side connector, a real
  supervisor, the stand-in forward of ``tests/with_vllm/harness.py``). Targets <= 500 and
  <= 200.
* ``restore_vs_sequential``: from ``scripts/bench_restore.py`` when it is there.

Needs the scheduler environment: ``.vllm/sched/bin/python scripts/bench_connector.py
--json`` (``scripts/setup-vllm sched``). ``scripts/bench_ttft.py`` measures time to first
token with the real CPU engine.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections import defaultdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from sparkcache import config, segments  # noqa: E402
from sparkcache.identity import Namespace, sequence_keys  # noqa: E402
from sparkcache.prefix_lookup import PrefixLookup  # noqa: E402
from sparkcache.store import PageStore  # noqa: E402
from sparkcache.store.testing import make_root  # noqa: E402


def lookup_ms_300k(tmp: Path) -> float:
    store, instance = tmp / "lookup-store", f"bl{uuid.uuid4().hex[:8]}"
    store.mkdir(mode=0o700)
    cfg = config.load(env={}, overrides={"store_dir": str(store), "instance": instance,
                                         "page_tokens": "16"}, check_store_dir=False)
    ns = Namespace("bench", "float16", "pages", 1, 0, 16)
    keys = list(sequence_keys(ns, list(range(300_000))).pages)
    with PageStore(store, 0) as st:
        st.commit(make_root("ab" * 16, keys[: 100_000 // 16], 64))
    segs = segments.RankSegments.create(cfg, 0, 4)  # the lease ring; nothing consumes it
    try:
        lookup = PrefixLookup(cfg, 1)
        times = []
        for _ in range(50):
            t0 = time.perf_counter()
            pages = lookup.lookup(keys)
            times.append(time.perf_counter() - t0)
        lookup.close()
        assert pages == 100_000 // 16, pages
    finally:
        segs.close()
    return statistics.median(times) * 1e3


def start_supervisor(store: Path, instance: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
         "--instance", instance, "--page-tokens", "16", "--capture-slots", "4",
         "--capture-slot-bytes", "16MiB", "--metrics-port", "0", "--cpus", str(WORKER_CORE)],
        cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 90
    while not (store / "runtime.json").exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise SystemExit(f"supervisor did not start: {proc.stderr.read()[-2000:]}")
        time.sleep(0.05)
    return proc


# As deployed: SparkCache's workers on their own core, the engine (here, this process)
# on the others. On a 2-core machine that is one core each.
_CORES = sorted(os.sched_getaffinity(0))
WORKER_CORE = _CORES[-1]
ENGINE_CORES = set(_CORES[:-1]) or {_CORES[0]}

SCHED_CALLS = ("get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished", "get_kv_connector_stats")
WORKER_CALLS = ("bind_connector_metadata", "start_load_kv", "wait_for_save", "get_finished",
                "get_block_ids_with_load_errors", "get_kv_connector_stats",
                "clear_connector_metadata", "handle_preemptions")


def _timed(obj: object, names: tuple[str, ...], acc: list[float]) -> None:
    """Wrap ``obj``'s methods ``names`` so each call adds its duration to ``acc[0]``."""
    for name in names:
        real = getattr(obj, name)

        def wrapper(*a, _real=real, **k):
            t0 = time.perf_counter()
            try:
                return _real(*a, **k)
            finally:
                acc[0] += time.perf_counter() - t0
        setattr(obj, name, wrapper)


def step_times(tmp: Path, steps: int) -> dict:
    from tests.with_vllm.harness import BLOCK, request, rig

    store, instance = tmp / "step-store", f"bs{uuid.uuid4().hex[:8]}"
    sup = start_supervisor(store, instance)
    os.sched_setaffinity(0, ENGINE_CORES)
    sched_acc, worker_acc = [0.0], [0.0]
    per_step: dict[str, list[float]] = defaultdict(list)
    try:
        with rig(store, instance, num_blocks=1024, max_batched=512) as r:
            _timed(r.sched.get_kv_connector(), SCHED_CALLS, sched_acc)
            _timed(r.workers[0], WORKER_CALLS, worker_acc)
            turns: dict[int, list[int]] = {}
            running = 8
            n = 0

            def next_turn(conv: int) -> None:
                nonlocal n
                # Each turn re-sends the conversation so far plus 2 new pages.
                turns[conv] = turns.get(conv, []) + [1000 * conv + n + i for i in range(2 * BLOCK)]
                r.sched.add_request(request(f"c{conv}-{n}", turns[conv], max_tokens=8))
                n += 1

            for conv in range(running):
                next_turn(conv)
            loads = saves = 0
            for _ in range(steps):
                sched_acc[0] = worker_acc[0] = 0.0
                before = set(r.sched.requests)
                so = r.step()
                meta = so.kv_connector_metadata
                loads += len(meta.loads)
                saves += len(meta.saves)
                per_step["sched"].append(sched_acc[0])
                per_step["worker"].append(worker_acc[0])
                for rid in before - set(r.sched.requests):  # finished: the next turn
                    next_turn(int(rid[1:].split("-")[0]))
            stats = r.workers[0]._worker.counters
    finally:
        sup.send_signal(signal.SIGTERM)
        sup.wait(60)

    def p99(xs: list[float]) -> float:
        return round(statistics.quantiles(xs, n=100)[98] * 1e6, 1)

    return {"scheduler_step_us_p99": p99(per_step["sched"]),
            "worker_step_us_p99": p99(per_step["worker"]),
            "scheduler_step_us_p50": round(statistics.median(per_step["sched"]) * 1e6, 1),
            "worker_step_us_p50": round(statistics.median(per_step["worker"]) * 1e6, 1),
            "steps": steps, "loads": loads, "saves": saves,
            "loaded_pages": int(stats["loaded_pages"])}


def _script_json(name: str, *args: str) -> dict:
    script = REPO / "scripts" / name
    if not script.exists():
        return {}
    out = subprocess.run([sys.executable, str(script), "--json", *args], cwd=REPO,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    if out.returncode:
        return {f"{name}_error": out.stderr[-500:]}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--steps", type=int, default=300)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        result = {"lookup_ms_300k": round(lookup_ms_300k(Path(tmp)), 3)}
        keys = _script_json("bench_keys.py", "--runs", "5")
        result["keys_ms_300k"] = keys.get("keys_ms_300k")
        result["keys_ms_300k_cold"] = keys.get("keys_ms_300k_cold")
        result.update(step_times(Path(tmp), args.steps))
        restore = _script_json("bench_restore.py")
        result["restore_vs_sequential"] = restore.get("restore_vs_sequential")
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:28} {v}")


if __name__ == "__main__":
    main()
