"""The supervisor's /metrics and /healthz over real HTTP: every metric of docs/metrics.md
with sane values after publications and restores, ages that advance at scrape time while
the engine is idle and commit is stopped (and stay fresh otherwise), health that turns 503
and back, counters that survive a worker's restart, the endpoint on 127.0.0.1 by default,
and the carry's arithmetic."""

from __future__ import annotations

import functools
import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import namedtuple
from pathlib import Path

import psutil
import pytest
from pipeline_util import SETTINGS, free_port, pipeline, runtime, wait_committed, wait_for
from prometheus_client.parser import text_string_to_metric_families
from sparkcache.shm.layouts import DURATION_BUCKETS_S, READ_PATHS

from sparkcache import __version__, config
from sparkcache.filesystems import MEMORY_FILESYSTEMS, filesystem_of
from sparkcache.metrics.carry import COUNTER_FIELDS, Carry
from sparkcache.store.testing import evict_from_page_cache
from sparkcache.synthetic import sequences

pytestmark = pytest.mark.slow
# Each check is a scrape: a tenth of a second apart is often enough.
_wait = functools.partial(wait_for, poll=0.1)

P = "vllm:sparkcache_"
# Every family the endpoint serves (counters and histograms by their family name).
FAMILIES = {
    "build_info", "fleet_bad_pages", "worker_up", "worker_report_age_seconds",
    "worker_restarts", "worker_item_errors",
    "worker_dropped_records", "worker_copied_bytes", "capture_slots",
    "publication_pending_rank_slots", "publication_oldest_pending_seconds",
    "publication_pending_bytes", "ring_depth_records", "store_capacity_bytes",
    "store_low_watermark_bytes", "store_hard_cap_bytes", "maintenance_active_ranks",
    "store_used_bytes", "store_entries", "maintenance_backlog_bytes",
    "maintenance_over_max_bytes", "maintenance_selected_roots", "maintenance_selected_bytes",
    "gc_backlog_objects", "gc_backlog_bytes", "maintenance_duty_ratio", "store_pooled_bytes",
    "store_leased_roots", "store_leased_bytes", "store_filesystem_free_bytes",
    "worker_disk_full_errors", "evicted_roots", "lease_yielded_roots",
    "lease_yielded_bytes", "read_lease_releases", "read_lease_yielded_roots",
    "cut_roots", "reclaimed_bytes", "collected_objects", "collected_bytes",
    "hard_cap_refused_seconds", "maintenance_episode_seconds", "hard_cap_refusing",
    "commit_lock_wait_seconds", "commit_lock_wait_max_seconds", "publications", "restores",
    "checksum_failures", "restore_read_bytes", "capture_duration_seconds",
    "commit_duration_seconds", "restore_duration_seconds", "maintenance_slice_duration_seconds",
    # the engine's counters (tests/test_engine_metrics.py checks their values)
    "engine_report_age_seconds", "engine_lookups", "engine_lookup_tokens",
    "engine_lookup_hit_tokens", "engine_lookup_misses", "engine_publications",
    "engine_published_pages", "engine_publication_skips", "engine_publications_expired",
    "engine_loads", "engine_load_results", "engine_loaded_pages", "engine_restored_pages",
    "engine_load_misses", "engine_checksum_failures", "engine_requests_dropped",
    "engine_ring_errors", "engine_loads_queued", "engine_load_queue_seconds",
    "engine_load_queue_depth",
}
ROLES = ("capture", "commit", "maintenance", "restore")


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


Sample = dict[tuple[str, frozenset], float]


def scrape(port: int) -> tuple[dict[str, str], Sample]:
    """(family name -> type, (sample name, labels) -> value)."""
    status, text = get(port, "/metrics")
    assert status == 200, text
    types, samples = {}, {}
    for fam in text_string_to_metric_families(text):
        assert fam.name.startswith(P), fam.name
        types[fam.name[len(P):]] = fam.type
        for s in fam.samples:
            samples[(s.name[len(P):], frozenset(s.labels.items()))] = s.value
    return types, samples


def value(samples: Sample, name: str, **labels: str) -> float:
    return samples[(name, frozenset(labels.items()))]


def _pids(store: Path) -> dict[str, int]:
    return {w["role"]: w["pid"] for w in runtime(store)["workers"]}


def test_metrics_and_health_of_a_running_instance(tmp_path: Path, instance: str) -> None:
    store, port = tmp_path / "store", free_port()
    # No idle read-ahead: the loads below are to read a cold store past the page cache.
    with pipeline(store, instance, {"metrics_port": str(port), "read_ahead_bytes": "0"}
                  ) as engine:
        rt = runtime(store)
        assert rt["metrics"] == {"host": "127.0.0.1", "port": port}
        listening = [c.laddr for c in psutil.Process(rt["pid"]).net_connections("tcp")
                     if c.status == psutil.CONN_LISTEN]
        assert listening == [("127.0.0.1", port)]
        assert get(port, "/healthz")[0] == 200

        # Publications, then loads through the restore worker.
        seqs = dict(list(sequences(8).items())[:6])
        for sid, tokens in seqs.items():
            assert engine.publish(sid, tokens), engine.client.counters
        engine.drain()
        assert wait_committed(engine, settle=5) == {}
        evict_from_page_cache(store)  # the loads read past the page cache (on a disk)
        loads = []
        for i, tokens in enumerate(list(seqs.values())[:3]):
            blocks = [engine.free.pop() for _ in engine.keys(tokens)]
            assert engine.client.load(f"load-{i}", tokens, blocks)
            loads.append((f"load-{i}", blocks))
        results = engine.wait_loaded([lid for lid, _ in loads])
        for _, blocks in loads:
            engine.free.extend(blocks)
        assert all(r.status == "ok" for r in results.values()), results

        # Maintenance reports the store's totals every 0.2 s while idle.
        _wait(lambda: value(scrape(port)[1], "store_entries", rank="0") > 0, 10,
              "maintenance to report the roots committed")
        types, s = scrape(port)
        assert set(types) == FAMILIES, set(types) ^ FAMILIES
        assert types["publications"] == "counter" and types["capture_slots"] == "gauge"
        assert types["commit_duration_seconds"] == "histogram"
        assert value(s, "build_info", version=__version__) == 1
        for role in ROLES:
            assert value(s, "worker_up", rank="0", role=role) == 1
            assert 0 <= value(s, "worker_report_age_seconds", rank="0", role=role) < 2
            assert value(s, "worker_restarts_total", rank="0", role=role) == 0
        assert value(s, "publications_total", rank="0", outcome="durable") == len(seqs)
        assert value(s, "publications_total", rank="0", outcome="capture_no_slot") == 0
        assert value(s, "restores_total", rank="0", result="ok") == len(loads)
        assert value(s, "checksum_failures_total", rank="0") == 0
        assert 1 <= value(s, "store_entries", rank="0") <= len(seqs)  # some superseded
        assert value(s, "store_used_bytes", rank="0") > 0
        assert value(s, "store_capacity_bytes", rank="0") == config.parse_size("1GiB")
        assert value(s, "maintenance_backlog_bytes", rank="0") == 0  # far below the marks
        assert value(s, "maintenance_active_ranks") == 0
        slots = {o: value(s, "capture_slots", rank="0", owner=o)
                 for o in ("free", "capture", "commit")}
        assert slots == {"free": int(SETTINGS["capture_slots"]), "capture": 0, "commit": 0}
        assert value(s, "publication_pending_rank_slots", rank="0") == 0
        assert value(s, "publication_oldest_pending_seconds", rank="0") == 0
        assert value(s, "worker_copied_bytes_total", rank="0", role="capture") > 0
        assert value(s, "worker_copied_bytes_total", rank="0", role="restore") > 0
        read = {p: value(s, "restore_read_bytes_total", rank="0", path=p) for p in READ_PATHS}
        assert sum(read.values()) == value(s, "worker_copied_bytes_total", rank="0",
                                           role="restore"), read
        if filesystem_of(store) not in MEMORY_FILESYSTEMS:
            assert read["direct"] > 0, read
        for name, count in (("capture_duration_seconds", len(seqs)),
                            ("commit_duration_seconds", len(seqs)),
                            ("restore_duration_seconds", len(loads))):
            assert value(s, f"{name}_count", rank="0") == count
            assert value(s, f"{name}_bucket", rank="0", le="+Inf") == count
            assert 0 < value(s, f"{name}_sum", rank="0") < 60
            buckets = [value(s, f"{name}_bucket", rank="0", le=f"{b:g}")
                       for b in DURATION_BUCKETS_S]
            assert buckets == sorted(buckets) and buckets[-1] <= count
        assert value(s, "maintenance_slice_duration_seconds_count", rank="0") >= 0

        # Idle, everything running: two scrapes 2 s apart both show fresh reports.
        time.sleep(2)
        _, later = scrape(port)
        for role in ROLES:
            assert value(later, "worker_report_age_seconds", rank="0", role=role) < 2

        # Commit stopped with a publication handed to it: its report age and the oldest
        # pending publication's age advance between scrapes; health says why it is 503.
        commit = _pids(store)["commit"]
        os.kill(commit, signal.SIGSTOP)
        try:
            extra = sequences(12, seed=5)["seq-11"]
            assert engine.publish("while-stopped", extra)

            def handed() -> bool:
                _, now = scrape(port)
                return value(now, "capture_slots", rank="0", owner="commit") >= 1

            _wait(handed, 20, "the publication to be handed to the stopped commit")
            _, a = scrape(port)
            time.sleep(2)
            _, b = scrape(port)
            status, why = get(port, "/healthz")
        finally:
            os.kill(commit, signal.SIGCONT)
        age = ("worker_report_age_seconds", frozenset({("rank", "0"), ("role", "commit")}))
        assert b[age] - a[age] >= 1.8, (a[age], b[age])
        oldest = ("publication_oldest_pending_seconds", frozenset({("rank", "0")}))
        assert b[oldest] - a[oldest] >= 1.8, (a[oldest], b[oldest])
        assert a[oldest] > 0 and value(b, "publication_pending_rank_slots", rank="0") >= 1
        assert value(b, "publication_pending_bytes", rank="0") > 0
        for role in ("capture", "maintenance", "restore"):
            assert value(b, "worker_report_age_seconds", rank="0", role=role) < 2
        assert status == 503 and "sparkcache::commit[r0]: no heartbeat" in why, why

        # Continued: the publication commits, reports are fresh, health is back.
        def settled() -> bool:
            _, now = scrape(port)
            return (value(now, "publication_pending_rank_slots", rank="0") == 0
                    and get(port, "/healthz")[0] == 200)

        _wait(settled, 20, "commit to catch up after SIGCONT")
        engine.drain()
        _, s = scrape(port)
        durable = value(s, "publications_total", rank="0", outcome="durable")
        assert durable == len(seqs) + 1
        assert value(s, "worker_report_age_seconds", rank="0", role="commit") < 2
        commits = value(s, "commit_duration_seconds_count", rank="0")

        # Commit killed: down at once, then restarted; its counters carry on.
        os.kill(commit, signal.SIGKILL)
        _wait(lambda: get(port, "/healthz")[0] == 503, 10, "health to say 503")
        status, why = get(port, "/healthz")
        assert "sparkcache::commit[r0]" in why, why

        def restarted() -> bool:
            return get(port, "/healthz")[0] == 200

        _wait(restarted, 30, "commit to be restarted and health 200 again")
        _, s = scrape(port)
        assert value(s, "worker_restarts_total", rank="0", role="commit") == 1
        assert value(s, "worker_up", rank="0", role="commit") == 1
        assert value(s, "publications_total", rank="0", outcome="durable") == durable
        assert value(s, "commit_duration_seconds_count", rank="0") == commits
        assert value(s, "worker_restarts_total", rank="0", role="capture") == 0
    # pipeline() checked that the supervisor stopped cleanly and /dev/shm is empty.
    with pytest.raises(OSError), socket.create_connection(("127.0.0.1", port), timeout=2):
        pass


def _supervise(store: Path, instance: str, *extra: str) -> subprocess.CompletedProcess:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance]
    for k, v in SETTINGS.items():
        args += [config.flag_name(k), v]
    return subprocess.run([*args, *extra], capture_output=True, text=True, timeout=60)


def test_a_taken_port_fails_the_start_in_one_line(tmp_path: Path, instance: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        out = _supervise(tmp_path / "store", instance, "--metrics-port", str(port))
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert f"cannot listen on 127.0.0.1:{port}" in last and "SPARKCACHE_METRICS_PORT" in last
    assert not (tmp_path / "store" / "runtime.json").exists()


def test_bad_metrics_settings_are_refused_naming_what_is_allowed(tmp_path: Path) -> None:
    with pytest.raises(config.ConfigError) as err:
        config.load(env={"SPARKCACHE_METRICS_HOST": "not a host",
                         "SPARKCACHE_METRICS_PORT": "70000"},
                    overrides={"store_dir": str(tmp_path)})
    text = str(err.value)
    assert "SPARKCACHE_METRICS_HOST (--metrics-host)='not a host' is invalid" in text
    assert "an IP address such as 127.0.0.1" in text
    assert "SPARKCACHE_METRICS_PORT (--metrics-port)='70000'" in text
    for host in ("127.0.0.1", "0.0.0.0", "::1", "localhost", "node-7.example"):
        cfg = config.load(env={"SPARKCACHE_METRICS_HOST": host},
                          overrides={"store_dir": str(tmp_path)})
        assert cfg.metrics_host == host and cfg.metrics_port == 9464


def test_docs_list_every_metric_served() -> None:
    """docs/metrics.md has one table row per family the endpoint serves (FAMILIES, which
    the test above checks against a live scrape), and no other."""
    doc = (Path(__file__).resolve().parent.parent / "docs" / "metrics.md").read_text()
    rows = re.findall(r"^\| `([a-z0-9_]+)` \| (gauge|counter|histogram) \|", doc, re.M)
    assert len(rows) == len({name for name, _ in rows})
    assert {name for name, _ in rows} == FAMILIES


def test_dashboard_plots_only_metrics_that_exist() -> None:
    """Every series docs/grafana/sparkcache.json queries is served here, the engine's
    skips included."""
    dash = json.loads((Path(__file__).resolve().parent.parent / "docs" / "grafana"
                       / "sparkcache.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    names = {re.sub(r"_(total|bucket|count|sum)$", "", n)
             for e in exprs for n in re.findall(r"vllm:sparkcache_(\w+)", e)}
    assert "commit_duration_seconds" in names and "maintenance_backlog_bytes" in names
    assert "engine_publication_skips" in names and names <= FAMILIES


_Rec = namedtuple("_Rec", ["pid", "pid_start", *COUNTER_FIELDS])


def _rec(pid: int, **values: float) -> _Rec:
    return _Rec(pid, float(pid), **{**dict.fromkeys(COUNTER_FIELDS, 0), **values})


def test_carry_counts_each_dead_process_once() -> None:
    carry = Carry()
    first = _rec(10, processed=5, dur_sum_s=1.5)
    assert carry.totals(first)["processed"] == 5  # live: its own totals
    carry.fold(first)  # exited
    assert carry.totals(first)["processed"] == 5  # its record still in the slot: once
    carry.fold(first)  # folded twice (a second exit seen): still once
    assert carry.totals(None)["processed"] == 5
    second = _rec(11, processed=2, dur_sum_s=0.5)
    totals = carry.totals(second)
    assert totals["processed"] == 7 and totals["dur_sum_s"] == 2.0
    carry.fold(second)
    assert carry.totals(_rec(12))["processed"] == 7  # a new process starts at 0
