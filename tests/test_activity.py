"""Restores and the hit rate over the last minute and since the supervisor started
(``sparkcache.activity``): the sums across processes that restart, and what ``status``
and ``top --once`` print of a real supervisor's activity."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch
from pipeline_util import (
    BLOCKS,
    LAYERS,
    PAGE_TOKENS,
    SHAPE,
    make_cfg,
    start_supervisor,
    stop_supervisor,
    wait_for,
)

from sparkcache import activity
from sparkcache.activity import Activity
from sparkcache.client import SparkCacheClient
from sparkcache.kvmem import SharedKVCaches

ENGINE = ("engine", 0, "client")
LATER = ("engine", 0, "lookup")
RESTORE = ("restore", 0)


def _engine(lookups: int, tokens: int, hits: int) -> dict[str, float]:
    return {"lookups": lookups, "lookup_tokens": tokens, "hit_tokens": hits}


def test_totals_add_what_each_process_counted_since_the_last_sample() -> None:
    a = Activity(started=1000.0, born=500.0)
    # An engine started before this supervisor: what it counted before is not its
    # activity; one started after it counted nothing before.
    a.sample({ENGINE: {"start": 400.0, **_engine(50, 5000, 4000)},
              LATER: {"start": 600.0, **_engine(1, 100, 100)}}, 1000.0)
    assert a.totals["lookups"] == 1 and a.totals["lookup_tokens"] == 100
    a.sample({ENGINE: {"start": 400.0, **_engine(60, 6000, 4500)}}, 1005.0)
    assert a.totals["lookups"] == 11 and a.totals["lookup_tokens"] == 1100
    # The engine restarted: its counters start again from 0, and what it counted since
    # is added, not subtracted.
    a.sample({ENGINE: {"start": 700.0, **_engine(3, 300, 0)},
              RESTORE: {"restores": 2, "restored_bytes": 10}}, 1010.0)
    assert a.totals["lookups"] == 14 and a.totals["hit_tokens"] == 600
    assert a.totals["restores"] == 2  # a restore worker's totals are the supervisor's
    a.sample({RESTORE: {"restores": 5, "restored_bytes": 40}}, 1015.0)
    assert a.totals["restores"] == 5 and a.totals["restored_bytes"] == 40


def test_the_minute_is_what_was_counted_in_the_last_sixty_seconds() -> None:
    a = Activity(started=0.0)
    for t in range(0, 125, 5):  # one lookup of 100 tokens every 5 s, half hit
        n = t // 5
        a.sample({ENGINE: _engine(n, 100 * n, 50 * n)}, float(t))
    out = a.summary(120.0)
    assert out["totals"]["lookups"] == 24
    assert out["minute_s"] == 60.0 and out["minute"]["lookups"] == 12
    assert activity.hit_rate(out["minute"]) == "50% of 1.2k tokens"
    young = Activity(started=0.0)
    young.sample({ENGINE: _engine(2, 200, 200)}, 3.0)  # counted in the first sample
    out = young.summary(5.0)
    assert out["minute_s"] == 5.0 and out["minute"]["lookups"] == 2  # since the start
    assert activity.hit_rate({}) == "no tokens looked up"


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sparkcache", *args], capture_output=True,
                          text=True, timeout=60)


def test_status_and_top_show_restores_and_the_hit_rate(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    sup = start_supervisor(store, instance)
    kv = SharedKVCaches.create(instance, 0, [SHAPE] * LAYERS, torch.float16)
    c = SparkCacheClient(make_cfg(store, instance), 0, model_id="m")
    try:
        assert c.register_kv_caches(kv.tensors)
        stored = list(range(4 * PAGE_TOKENS))
        assert c.publish("turn-1", stored, [0, 1, 2, 3])
        wait_for(lambda: [d for d in c.poll_durable() if d.durable], 60, "a durable save",
                 poll=0.02)
        assert c.lookup(stored) == len(stored)  # 64 tokens hit
        assert c.lookup(list(range(5000, 5000 + len(stored)))) == 0  # 64 missed
        assert c.load("turn-2", stored, [BLOCKS - 4, BLOCKS - 3, BLOCKS - 2, BLOCKS - 1])
        results = wait_for(c.poll_loads, 60, "the load", poll=0.02)
        assert [r.status for r in results] == ["ok"]
        time.sleep(0.6)
        c.poll_loads()  # the counters reach the engine stats block (every 0.5 s)

        def restored() -> dict | None:
            data = activity.read(store)
            return data if data and data["totals"]["restores"] >= 1 and \
                data["totals"]["lookup_tokens"] >= 2 * len(stored) else None

        data = wait_for(restored, 30, "activity.json to count the restore", poll=0.2)
        page_bytes = LAYERS * SHAPE[0] * SHAPE[2] * SHAPE[3] * SHAPE[4] * 2
        assert data["totals"]["restored_bytes"] == 4 * page_bytes, data
        assert data["minute"]["restores"] == 1, json.dumps(data)
        out = _run("status", "--store-dir", str(store), "--instance", instance)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "restores=1 " in out.stdout and "hit rate 50% of 128 tokens" in out.stdout, \
            out.stdout
        assert "since start" in out.stdout and "last " in out.stdout, out.stdout
        js = json.loads(_run("status", "--store-dir", str(store), "--instance", instance,
                             "--json").stdout)
        assert js["activity"]["totals"]["restores"] == 1, js["activity"]
        top = _run("top", "--once", "--store-dir", str(store), "--instance", instance)
        assert top.returncode == 0, top.stdout + top.stderr
        assert "restores=1 " in top.stdout and "hit rate 50%" in top.stdout, top.stdout
    finally:
        c.close()
        kv.close()
        code, err = stop_supervisor(sup)
        assert code == 0, err[-2000:]
    assert not (store / "activity.json").exists()  # a stopped supervisor's is no activity


def test_status_without_a_supervisor_names_the_store_one_runs_on(
        tmp_path: Path, instance: str) -> None:
    """Pointed at a store no supervisor serves (the default, say), status names the
    stores this user's supervisors run on; once one has run on a store, its capacity
    is what that one was given, not the tool's default."""
    store, other = tmp_path / "store", tmp_path / "other"
    sup = start_supervisor(store, instance, "--max-bytes", "3GiB",
                           "--low-watermark-bytes", "2GiB")
    try:
        out = _run("status", "--store-dir", str(other), "--instance", instance)
        assert out.returncode == 1
        assert f"runs instance {instance!r} on store {store.resolve()}: sparkcache status " \
            f"--store-dir {store.resolve()}" in out.stdout, out.stdout
    finally:
        code, err = stop_supervisor(sup)
        assert code == 0, err[-2000:]
    out = _run("status", "--store-dir", str(store), "--instance", instance)
    assert "/3.0GiB" in out.stdout, out.stdout  # one rank at the 3 GiB it ran with

