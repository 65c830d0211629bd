"""The engine's counters on the supervisor's /metrics: a real supervisor, a
``SparkCacheClient`` (the synthetic engine) publishing, skipping and loading, and a
``PrefixLookup`` looking up; each writes its rank's engine stats block, and a scrape over
HTTP shows what they counted. Also: the record's reason fields cover every reason the
engine's code counts, unknown ones land in ``other``, and a missing block costs nothing."""

from __future__ import annotations

import ast
import time
from pathlib import Path

import pytest
from pipeline_util import free_port, make_cfg, pipeline, wait_committed
from sparkcache.shm.layouts import (
    ENGINE_STATS,
    LOAD_MISS_REASONS,
    LOAD_RESULTS,
    LOOKUP_MISS_REASONS,
    SKIP_REASONS,
)
from test_metrics import get, scrape, value

from sparkcache import engine_stats
from sparkcache.client import ClientCounters
from sparkcache.engine_stats import WRITE_INTERVAL_S, by_reason
from sparkcache.prefix_lookup import PrefixLookup
from sparkcache.protocol import LoadStatus, status_name
from sparkcache.synthetic import sequences

REPO = Path(__file__).resolve().parent.parent


def _wait_scrape(port: int, cond, timeout: float, what: str) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        _, s = scrape(port)
        try:
            if cond(s):
                return s
        except KeyError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.1)


@pytest.mark.slow
def test_engine_counters_are_served_by_the_supervisor(tmp_path: Path, instance: str) -> None:
    store, port = tmp_path / "store", free_port()
    with pipeline(store, instance, {"metrics_port": str(port)}) as engine:
        client = engine.client
        # Before any engine process wrote: the families exist, without series.
        types, s = scrape(port)
        assert types["engine_lookups"] == "counter"
        assert types["engine_report_age_seconds"] == "gauge"
        assert not any(name.startswith("engine_") for name, _ in s)

        seqs = dict(list(sequences(6).items())[:4])
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), client.counters
        engine.drain()
        assert wait_committed(engine, settle=5) == {}
        # A skip to count: a publication of no pages.
        assert not client.publish("empty", [], [])
        # Loads: two whole ones, and one refused for a block outside the KV caches.
        tokens = list(seqs.values())
        loads = []
        for i in range(2):
            blocks = [engine.free.pop() for _ in engine.keys(tokens[i])]
            assert client.load(f"load-{i}", tokens[i], blocks)
            loads.append(blocks)
        assert not client.load("bad", tokens[2], [10**6] * len(engine.keys(tokens[2])))
        results = engine.wait_loaded(["load-0", "load-1"])
        assert all(r.status == "ok" for r in results.values()), results
        for blocks in loads:
            engine.free.extend(blocks)

        # The scheduler's lookups: one stored prefix (a hit), one never stored (a miss).
        cfg = make_cfg(store, instance, metrics_port=str(port))
        lookup = PrefixLookup(cfg, 1)
        try:
            held = list(engine.keys(tokens[0]))
            assert lookup.lookup(held) == len(held)
            other = list(engine.keys(sequences(2, seed=77)["seq-1"]))
            assert lookup.lookup(other) == 0
        finally:
            lookup.close()  # writes what it counted, due or not

        # The client writes at most every 0.5 s, from its polls.
        time.sleep(WRITE_INTERVAL_S)
        engine.poll()
        c = client.counters
        s = _wait_scrape(port, lambda s: value(s, "engine_lookups_total", rank="0",
                                                writer="client") == c.lookups, 5,
                         "the client's counters")
        on = {"rank": "0", "writer": "client"}
        assert value(s, "engine_publications_total", **on) == len(seqs) == c.published
        assert value(s, "engine_published_pages_total", **on) == sum(
            len(engine.keys(t)) for t in seqs.values())
        assert value(s, "engine_publication_skips_total", reason="bad_request", **on) == 1
        assert value(s, "engine_publication_skips_total", reason="other", **on) == 0
        assert value(s, "engine_loads_total", **on) == 2
        assert value(s, "engine_load_results_total", status="ok", **on) == 2
        assert value(s, "engine_load_results_total", status="worker_gone", **on) == 0
        assert value(s, "engine_load_misses_total", reason="bad_block", **on) == 1
        assert value(s, "engine_loaded_pages_total", **on) == sum(map(len, loads))
        assert value(s, "engine_checksum_failures_total", **on) == 0
        # Two loads had room at once: none waited in the client's queue.
        assert value(s, "engine_loads_queued_total", **on) == c.loads_queued == 0
        assert value(s, "engine_load_queue_seconds_total", **on) == 0
        assert value(s, "engine_load_queue_depth", **on) == 0
        assert types["engine_load_queue_depth"] == "gauge"
        # wait_committed looked every sequence up through the client.
        assert value(s, "engine_lookups_total", **on) == c.lookups > 0
        assert value(s, "engine_lookup_tokens_total", **on) == c.lookup_tokens
        assert value(s, "engine_lookup_hit_tokens_total", **on) == c.hit_tokens > 0
        assert 0 <= value(s, "engine_report_age_seconds", **on) < 2

        lk = {"rank": "0", "writer": "lookup"}
        page = cfg.page_tokens
        assert value(s, "engine_lookups_total", **lk) == 2
        assert value(s, "engine_lookup_tokens_total", **lk) == (len(held) + len(other)) * page
        assert value(s, "engine_lookup_hit_tokens_total", **lk) == len(held) * page
        assert value(s, "engine_lookup_misses_total", reason="not_stored", **lk) == 1
        assert value(s, "engine_lookup_misses_total", reason="unavailable", **lk) == 0
        # The lookup writer counts lookups only.
        assert ("engine_publications_total", frozenset(lk.items())) not in s

        # Idle: the lookup writer's report ages at every scrape.
        a = value(s, "engine_report_age_seconds", **lk)
        time.sleep(1.2)
        _, later = scrape(port)
        assert value(later, "engine_report_age_seconds", **lk) - a >= 1.0
        assert get(port, "/healthz")[0] == 200
    # pipeline() checked that the supervisor stopped cleanly and /dev/shm is empty.


def test_a_missing_block_means_no_publishing(tmp_path: Path, instance: str) -> None:
    cfg = make_cfg(tmp_path / "store", instance)
    assert engine_stats.EngineStatsWriter.attach(cfg, 0, engine_stats.SLOT_CLIENT) is None
    lookup = PrefixLookup(cfg, 1)
    try:
        assert lookup.lookup(["ab" * 16]) == 0  # no supervisor: a miss, never a raise
        assert lookup.misses["unavailable"] == 1
    finally:
        lookup.close()


def test_unknown_reasons_are_counted_in_other() -> None:
    fields = by_reason("skip_", {"no_slot": 2, "brand_new": 3, "other": 1}, SKIP_REASONS)
    assert fields["skip_no_slot"] == 2 and fields["skip_other"] == 4
    assert set(fields) == {f"skip_{r}" for r in SKIP_REASONS}


def test_client_fields_split_lookup_misses_from_read_misses() -> None:
    c = ClientCounters()
    c.misses.update({"evicting": 1, "error": 3, "bad_block": 2, "corrupt": 1})
    c.lookup_misses.update({"evicting": 1, "error": 1})
    c.load_status.update({"ok": 4, "worker_gone": 1, "surprising": 1})
    f = c.fields()
    assert f["lookup_miss_evicting"] == 1 and f["lookup_miss_error"] == 1
    assert f["load_miss_error"] == 2 and f["load_miss_bad_block"] == 2
    assert "load_miss_evicting" not in f
    assert f["load_ok"] == 4 and f["load_worker_gone"] == 1 and f["load_other"] == 1
    assert f["checksum_failures"] == 1
    assert set(f) <= set(ENGINE_STATS.dtype.names)


def _counted_reasons(path: Path) -> dict[str, set[str]]:
    """function name -> the reason strings it counts: ``return "x"``, ``reason = "x"``,
    ``<counter>["x"] += 1`` and ``self._lookup_miss("x")``."""
    out: dict[str, set[str]] = {}
    for fn in ast.walk(ast.parse(path.read_text())):
        if not isinstance(fn, ast.FunctionDef):
            continue
        found = out.setdefault(fn.name, set())
        for node in ast.walk(fn):
            value_ = None
            if isinstance(node, ast.Return | ast.Assign) and isinstance(
                    node.value, ast.Constant):
                if isinstance(node, ast.Return) or any(
                        isinstance(t, ast.Name) and t.id == "reason" for t in node.targets):
                    value_ = node.value.value
            elif isinstance(node, ast.AugAssign) and isinstance(node.target, ast.Subscript):
                if isinstance(node.target.slice, ast.Constant):
                    value_ = node.target.slice.value
            elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                  and node.func.attr == "_lookup_miss" and node.args
                  and isinstance(node.args[0], ast.Constant)):
                value_ = node.args[0].value
            if isinstance(value_, str):
                found.add(value_)
    return out


def test_every_reason_the_engine_counts_has_its_own_field() -> None:
    client = _counted_reasons(REPO / "sparkcache" / "client.py")
    lookup = _counted_reasons(REPO / "sparkcache" / "prefix_lookup.py")
    skips = set().union(*(client[f] for f in (
        "register_kv_caches", "_admission", "_push", "publish", "publish_keys")))
    assert skips <= set(SKIP_REASONS), skips - set(SKIP_REASONS)
    reads = set().union(*(client[f] for f in (
        "_queue_load", "load", "load_keys", "_restore_keys", "restore", "restore_keys",
        "_take_loaded", "_reap_loads")))
    assert reads <= set(LOAD_MISS_REASONS), reads - set(LOAD_MISS_REASONS)
    lookups = client["lookup"] | client["_lookup"] | set().union(*lookup.values())
    assert lookups <= set(LOOKUP_MISS_REASONS), lookups - set(LOOKUP_MISS_REASONS)
    statuses = {status_name(LoadStatus, s) for s in LoadStatus} | {"worker_gone"}
    assert statuses <= set(LOAD_RESULTS)
    for reasons in (SKIP_REASONS, LOAD_MISS_REASONS, LOOKUP_MISS_REASONS, LOAD_RESULTS):
        assert reasons[-1] == "other" and len(set(reasons)) == len(reasons)
