#!/usr/bin/env python3
"""Records/s and wake-up round trips of the shm ring against multiprocessing.Queue,
posix_ipc.MessageQueue and a pipe, all measured in one run between two processes pinned
to different cores. Prints one JSON object (--json) or a table.

Every producer sends one record per call ("single") or 64 per call ("batched"). The
consumers differ, as each transport allows: the ring pops one record per call (it copies
out up to 64 posted records at once and serves the rest from memory); the pipe's reader
reads up to 64 KiB per read(), so its "single" is batched on the read side; the queues
deliver one message per get. Throughputs are medians of --repeat runs.

    .venv/bin/python scripts/bench_ring.py --json [--records 400000] [--round-trips 5000]
        [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time
import uuid

import numpy as np
import posix_ipc
import psutil

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from sparkcache.shm.records import RecordLayout
from sparkcache.shm.ring import DEFAULT_SPIN_S, Consumer, Producer, Ring, RingClosed

LAYOUT = RecordLayout("bench", 1, np.dtype([("seq", "<u8"), ("payload", "<u8")]))
BATCH = 64
REC = struct.Struct("<QQ")
CTX = mp.get_context("spawn")


# (producer core, consumer core), chosen once before anything is pinned: a spawned child
# inherits its parent's affinity, so it cannot look the cores up itself.
_ALLOWED = sorted(os.sched_getaffinity(0))
CORES = (_ALLOWED[0], _ALLOWED[-1])


def _pin(core: int) -> None:
    os.sched_setaffinity(0, {core})


def _reap(proc: mp.process.BaseProcess, cleanup: list) -> None:
    """Never leave a child or a segment behind, even when a measurement failed."""
    if proc.is_alive():
        proc.kill()
        proc.join()
    for fn in cleanup:
        fn()


# ---- consumers: each reads `n` records, then reports its elapsed time -------------


def _ring_consume(name: str, n: int, batched: bool, core: int, ready, out) -> None:
    _pin(core)
    c = Consumer(name, LAYOUT)
    ready.set()
    got = 0
    t0 = None
    while got < n:
        if batched:
            got += len(c.pop_batch(4096, timeout=10))
        else:
            c.pop(timeout=10)
            got += 1
        if t0 is None:
            t0 = time.perf_counter()
    out.put(time.perf_counter())
    c.close()


def _queue_consume(q, n: int, batched: bool, core: int, ready, out) -> None:
    _pin(core)
    ready.set()
    got = 0
    while got < n:
        item = q.get()
        got += len(item) if batched else 1
    out.put(time.perf_counter())


def _mq_consume(name: str, n: int, batched: bool, core: int, ready, out) -> None:
    _pin(core)
    mq = posix_ipc.MessageQueue(name)
    ready.set()
    got = 0
    while got < n:
        msg, _ = mq.receive()
        got += len(msg) // REC.size
    out.put(time.perf_counter())
    mq.close()


def _pipe_consume(fd: int, n: int, batched: bool, core: int, ready, out) -> None:
    _pin(core)
    ready.set()
    want = n * REC.size
    got = 0
    with os.fdopen(fd, "rb", buffering=0) as f:
        while got < want:
            got += len(f.read(min(1 << 16, want - got)))
    out.put(time.perf_counter())


def _throughput(kind: str, n: int, batched: bool) -> float:
    """Records/s from the producer's first push to the consumer's last pop."""
    ready, out = CTX.Event(), CTX.Queue()
    name = f"/sparkcache.bench{uuid.uuid4().hex[:8]}.r0.ring"
    batch = LAYOUT.array([(i, i) for i in range(BATCH)])
    cleanup = []
    if kind == "ring":
        ring = Ring.create(name, LAYOUT, 1 << 14)
        cleanup.append(ring.close)
        proc = CTX.Process(target=_ring_consume, args=(name, n, batched, CORES[1], ready, out))
    elif kind == "mp_queue":
        q = CTX.Queue(maxsize=1 << 14)
        proc = CTX.Process(target=_queue_consume, args=(q, n, batched, CORES[1], ready, out))
    elif kind == "posix_mq":
        mq = posix_ipc.MessageQueue(
            name, posix_ipc.O_CREX, mode=0o600, max_messages=10, max_message_size=REC.size * BATCH
        )
        cleanup += [mq.close, mq.unlink]
        proc = CTX.Process(target=_mq_consume, args=(name, n, batched, CORES[1], ready, out))
    else:
        rfd, wfd = os.pipe()
        # fork, not spawn: the child must inherit the raw descriptor.
        proc = mp.get_context("fork").Process(
            target=_pipe_consume, args=(rfd, n, batched, CORES[1], ready, out)
        )
    proc.start()
    try:
        ready.wait(30)
        if kind == "pipe":
            os.close(rfd)
        _pin(CORES[0])
        t0 = time.perf_counter()
        if kind == "ring":
            p = Producer(name, LAYOUT)
            if batched:
                for _ in range(n // BATCH):
                    p.push_batch(batch, timeout=10)
            else:
                push = p.try_push
                for i in range(n):
                    push((i, i), 10)
            p.detach()
        elif kind == "mp_queue":
            rows = batch.tolist()
            for i in range(n // BATCH if batched else n):
                q.put(rows if batched else (i, i))
        elif kind == "posix_mq":
            raw = batch.tobytes()
            for i in range(n // BATCH if batched else n):
                mq.send(raw if batched else REC.pack(i, i))
        else:
            raw = batch.tobytes()
            for i in range(n // BATCH if batched else n):
                os.write(wfd, raw if batched else REC.pack(i, i))
            os.close(wfd)
        t_end = out.get(timeout=120)
        proc.join(30)
    finally:
        _reap(proc, cleanup)
    return n / (t_end - t0)


# ---- round trips: a ping to the other process and its pong back --------------------


def _ring_echo(ping: str, pong: str, spin_s: float, core: int, ready) -> None:
    _pin(core)
    c = Consumer(ping, LAYOUT, spin_s=spin_s)
    p = Producer(pong, LAYOUT)
    ready.set()
    try:
        while True:
            p.try_push(c.pop(timeout=30))
    except RingClosed:
        pass
    c.close()
    p.close()


def _queue_echo(a, b, core: int, ready) -> None:
    _pin(core)
    ready.set()
    while (item := a.get()) is not None:
        b.put(item)


def _mq_echo(a: str, b: str, core: int, ready) -> None:
    _pin(core)
    qa, qb = posix_ipc.MessageQueue(a), posix_ipc.MessageQueue(b)
    ready.set()
    while (msg := qa.receive()[0]) != b"":
        qb.send(msg)


def _pipe_echo(r: int, w: int, core: int, ready) -> None:
    _pin(core)
    ready.set()
    while len(msg := os.read(r, REC.size)) == REC.size:
        os.write(w, msg)


def _rtt(kind: str, trips: int, spin_s: float = 0.0) -> list[float]:
    """Round-trip times in microseconds."""
    ready = CTX.Event()
    tag = uuid.uuid4().hex[:8]
    a, b = f"/sparkcache.bench{tag}.r0.ping", f"/sparkcache.bench{tag}.r0.pong"
    cleanup = []
    if kind == "ring":
        rings = [Ring.create(a, LAYOUT, 64), Ring.create(b, LAYOUT, 64)]
        cleanup += [r.close for r in rings]
        proc = CTX.Process(target=_ring_echo, args=(a, b, spin_s, CORES[1], ready))
    elif kind == "mp_queue":
        qa, qb = CTX.Queue(), CTX.Queue()
        proc = CTX.Process(target=_queue_echo, args=(qa, qb, CORES[1], ready))
    elif kind == "posix_mq":
        qa, qb = (
            posix_ipc.MessageQueue(x, posix_ipc.O_CREX, mode=0o600, max_messages=4,
                                   max_message_size=REC.size)
            for x in (a, b)
        )
        cleanup += [qa.close, qa.unlink, qb.close, qb.unlink]
        proc = CTX.Process(target=_mq_echo, args=(a, b, CORES[1], ready))
    else:
        r1, w1 = os.pipe()
        r2, w2 = os.pipe()
        proc = mp.get_context("fork").Process(target=_pipe_echo, args=(r1, w2, CORES[1], ready))
    proc.start()
    times = []
    try:
        ready.wait(30)
        _pin(CORES[0])
        if kind == "ring":
            p, c = Producer(a, LAYOUT), Consumer(b, LAYOUT, spin_s=spin_s)
            for i in range(trips):
                t0 = time.perf_counter()
                p.try_push((i, i))
                c.pop(timeout=10)
                times.append(time.perf_counter() - t0)
            p.close()
            c.close()
        elif kind == "mp_queue":
            for i in range(trips):
                t0 = time.perf_counter()
                qa.put((i, i))
                qb.get()
                times.append(time.perf_counter() - t0)
            qa.put(None)
        elif kind == "posix_mq":
            for i in range(trips):
                t0 = time.perf_counter()
                qa.send(REC.pack(i, i))
                qb.receive()
                times.append(time.perf_counter() - t0)
            qa.send(b"")
        else:
            for i in range(trips):
                t0 = time.perf_counter()
                os.write(w1, REC.pack(i, i))
                os.read(r2, REC.size)
                times.append(time.perf_counter() - t0)
            for fd in (w1, r2, r1, w2):
                os.close(fd)
        proc.join(30)
    finally:
        _reap(proc, cleanup)
    return [t * 1e6 for t in times[trips // 10 :]]  # drop warm-up


def _idle_consumer_cpu(seconds: float) -> float:
    """CPU % of a consumer blocked on an empty ring: spin-then-sleep must sleep."""
    name = f"/sparkcache.bench{uuid.uuid4().hex[:8]}.r0.idle"
    ring = Ring.create(name, LAYOUT, 64)
    ready, out = CTX.Event(), CTX.Queue()
    proc = CTX.Process(target=_ring_consume, args=(name, 1, False, CORES[1], ready, out))
    proc.start()
    try:
        ready.wait(30)
        time.sleep(0.2)  # past the bounded spin
        ps = psutil.Process(proc.pid)
        c0 = sum(ps.cpu_times()[:2])
        time.sleep(seconds)
        used = sum(ps.cpu_times()[:2]) - c0
        p = Producer(name, LAYOUT)
        p.try_push((0, 0))
        p.detach()
        out.get(timeout=30)
        proc.join(30)
    finally:
        _reap(proc, [ring.close])
    return 100.0 * used / seconds


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--records", type=int, default=400_000, help="records per single run")
    ap.add_argument("--round-trips", type=int, default=5_000)
    ap.add_argument("--repeat", type=int, default=3, help="runs per throughput figure (median)")
    args = ap.parse_args()
    n = args.records
    res: dict[str, float | int | str] = {
        "cores": len(os.sched_getaffinity(0)),
        "records": n,
        "throughput_median_of": args.repeat,
        "pipe_note": "the pipe reader reads up to 64 KiB per read(): its single-record "
        "figure is batched on the read side (the writer still makes one write() per record)",
    }
    for kind in ("ring", "mp_queue", "posix_mq", "pipe"):
        # The queues are slow: they get fewer records (rates, not totals, are compared).
        single_n = n if kind in ("ring", "pipe") else n // 4
        # Medians of several runs: these machines are noisy.
        res[f"{kind}_single_per_s"] = round(
            statistics.median(_throughput(kind, single_n, False) for _ in range(args.repeat))
        )
        res[f"{kind}_batched_per_s"] = round(
            statistics.median(
                _throughput(kind, n * 4 // BATCH * BATCH, True) for _ in range(args.repeat)
            )
        )
        rtt = _rtt(kind, args.round_trips, spin_s=0.0)
        res[f"{kind}_rtt_p50_us"] = round(_pct(rtt, 50), 2)
        res[f"{kind}_rtt_p99_us"] = round(_pct(rtt, 99), 2)
    # The ring's own wake-up modes: spin briefly then sleep (the default) vs sleep at once.
    res["ring_sleep_rtt_p50_us"] = res["ring_rtt_p50_us"]
    res["ring_sleep_rtt_p99_us"] = res["ring_rtt_p99_us"]
    rtt = _rtt("ring", args.round_trips, spin_s=DEFAULT_SPIN_S)
    res["ring_rtt_p50_us"] = round(_pct(rtt, 50), 2)
    res["ring_rtt_p99_us"] = round(_pct(rtt, 99), 2)
    res["ring_idle_consumer_cpu_percent"] = round(_idle_consumer_cpu(1.0), 2)
    for other in ("mp_queue", "posix_mq", "pipe"):
        res[f"ring_single_vs_{other}"] = round(
            res["ring_single_per_s"] / res[f"{other}_single_per_s"], 2)
        res[f"ring_batched_vs_{other}"] = round(
            res["ring_batched_per_s"] / res[f"{other}_batched_per_s"], 2)
    res["ring_rtt_p50_vs_mp_queue"] = round(res["mp_queue_rtt_p50_us"] / res["ring_rtt_p50_us"], 2)
    res["rtt_median_of"] = len(rtt)
    if args.json:
        print(json.dumps(res))
    else:
        for k, v in res.items():
            print(f"{k:36s} {v}")


if __name__ == "__main__":
    main()
