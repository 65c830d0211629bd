"""The engine's own counters as metric families: what each engine-side writer (the
rank's ``SparkCacheClient``, vLLM's scheduler's prefix lookups) last copied into its
rank's engine stats block (``sparkcache.engine_stats``), read at scrape time.

Names start ``engine_`` so that they never clash with the connector's counters on vLLM's
own ``/metrics`` (``sparkcache/vllm/stats.py``: ``vllm:sparkcache_lookups`` ...), which
count some of the same events through vLLM's stats path. Each series has ``rank`` and
``writer`` labels: the two writers of a rank are different processes, whose counters
reset independently when one restarts.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from sparkcache.metrics.reading import Reading
from sparkcache.shm.layouts import (
    LOAD_MISS_REASONS,
    LOAD_RESULTS,
    LOOKUP_MISS_REASONS,
    SKIP_REASONS,
)

PREFIX = "vllm:sparkcache_"
BOTH = ("client", "lookup")
CLIENT = ("client",)

# (name without _total, help, field, writers that count it)
COUNTERS = (
    ("engine_lookups", "Prefix lookups the engine asked (the hit rate's denominator).",
     "lookups", BOTH),
    ("engine_lookup_tokens", "Tokens the lookups asked about, beyond those the engine "
     "already held (vLLM: beyond its own prefix cache hit).", "lookup_tokens", BOTH),
    ("engine_lookup_hit_tokens", "Of those tokens, the ones found in the store and leased.",
     "lookup_hit_tokens", BOTH),
    ("engine_publications", "Publications the engine handed to capture (taken).",
     "publications", CLIENT),
    ("engine_published_pages", "Pages of those publications.", "published_pages", CLIENT),
    ("engine_publications_expired", "Publications whose blocks the engine took back at "
     "their deadline, capture not having answered.", "expired", CLIENT),
    ("engine_loads", "Loads the engine handed to the restore worker.", "loads", CLIENT),
    ("engine_loaded_pages", "Pages the restore worker wrote into the engine's blocks.",
     "loaded_pages", CLIENT),
    ("engine_restored_pages", "Pages the engine read itself (synchronous restores).",
     "restored_pages", CLIENT),
    ("engine_checksum_failures", "Pages the engine saw fail verification (its own reads "
     "and the restore worker's).", "checksum_failures", CLIENT),
    ("engine_requests_dropped", "Requests to maintenance (lease, access, quarantine) the "
     "engine dropped: their ring was full or absent.", "requests_dropped", CLIENT),
    ("engine_ring_errors", "Ring faults the engine met (it reconnected).", "ring_errors",
     CLIENT),
    ("engine_loads_queued", "Loads (and later parts of large ones) that waited in the "
     "engine's queue for room in the load ring or under its limit of loads in flight.",
     "loads_queued", CLIENT),
    ("engine_load_queue_seconds", "Seconds they waited there, summed.",
     "load_queue_seconds", CLIENT),
)
# (name without _total, help, label, field prefix, values, writers that count it)
BY_REASON = (
    ("engine_lookup_misses", "Lookups that found nothing they could use, by reason "
     "(not_stored: the scheduler's found no page beyond its own).", "reason",
     "lookup_miss_", LOOKUP_MISS_REASONS, BOTH),
    ("engine_publication_skips", "Publications the engine skipped before capture, by "
     "reason.", "reason", "skip_", SKIP_REASONS, CLIENT),
    ("engine_load_results", "Loads the engine got back, by status (worker_gone: the "
     "restore worker died with it).", "status", "load_", LOAD_RESULTS, CLIENT),
    ("engine_load_misses", "Loads and synchronous restores that missed (wholly or in "
     "part), by reason.", "reason", "load_miss_", LOAD_MISS_REASONS, CLIENT),
)
FAMILIES = (*(c[0] for c in COUNTERS), *(b[0] for b in BY_REASON),
            "engine_report_age_seconds", "engine_load_queue_depth")


def families(r: Reading) -> Iterator[Metric]:
    """Every engine family; a writer that never wrote (no engine yet) has no series."""
    labels = ["rank", "writer"]
    age = GaugeMetricFamily(
        PREFIX + "engine_report_age_seconds",
        "Seconds since the engine-side writer last published its counters (every 0.5 s "
        "while it works); grows while the engine is idle, stopped or gone.", labels=labels)
    depth = GaugeMetricFamily(
        PREFIX + "engine_load_queue_depth",
        "Loads waiting in the engine's queue for room in the load ring or under its limit "
        "of loads in flight, at the writer's last write.", labels=labels)
    counters = {name: CounterMetricFamily(PREFIX + name, doc, labels=labels)
                for name, doc, _, _ in COUNTERS}
    by_reason = {name: CounterMetricFamily(PREFIX + name, doc, labels=[*labels, label])
                 for name, doc, label, _, _, _ in BY_REASON}
    for e in r.engines:
        values = [str(e.rank), e.writer]
        age.add_metric(values, e.age_s)
        if e.writer in CLIENT:
            depth.add_metric(values, e.record.load_queue_depth)
        for name, _, fld, writers in COUNTERS:
            if e.writer in writers:
                counters[name].add_metric(values, getattr(e.record, fld))
        for name, _, _, prefix, reasons, writers in BY_REASON:
            if e.writer in writers:
                for reason in reasons:
                    by_reason[name].add_metric([*values, reason],
                                               getattr(e.record, prefix + reason))
    yield age
    yield depth
    yield from counters.values()
    yield from by_reason.values()
