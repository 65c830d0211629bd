"""The supervisor's Prometheus collector: at every scrape, one ``reading.read`` turned into
metric families. Nothing is sampled in between, so what a scrape shows is what the
segments and the supervisor hold at that moment (docs/metrics.md: every metric, its unit
and its limits).

Names keep the ``vllm:`` prefix of the dashboards that exist. Gauges taken from a worker's
record are shown only while that record is its current process's own: a dead worker shows
``worker_up 0`` and a growing report age, never its last backlog as if it were current.
Counters add the totals of a worker's dead processes (``carry``), so they never go back.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from sparkcache import __version__
from sparkcache.metrics import engine, reading
from sparkcache.metrics.reading import Reading, Source, WorkerReading
from sparkcache.protocol import CaptureStatus, DurableStatus, LoadStatus, status_name
from sparkcache.shm.layouts import DROP_REASONS, DURATION_BUCKETS_S, READ_PATHS

PREFIX = "vllm:sparkcache_"

# role -> (histogram name, help) of the durations its record counts (dur_*).
DURATIONS = {
    "capture": ("capture_duration_seconds",
                "Seconds capture took per publication: lease, slot, copy, hand-over."),
    "commit": ("commit_duration_seconds",
               "Seconds commit took per root: object files written and synced, index "
               "transaction."),
    "restore": ("restore_duration_seconds",
                "Seconds the restore worker took per load: read, verify, write into blocks."),
    "maintenance": ("maintenance_slice_duration_seconds",
                    "Seconds per maintenance slice (collection, eviction, requests)."),
}

# Maintenance's record -> per-rank gauges (name, help, field).
MAINTENANCE_GAUGES = (
    ("store_used_bytes", "Bytes the rank's store holds (live and quarantined objects).",
     "used_bytes"),
    ("store_entries", "Roots (publications) in the rank's store.", "entries"),
    ("maintenance_backlog_bytes",
     "Bytes above the low watermark: what eviction would remove in an episode.", "backlog"),
    ("maintenance_over_max_bytes", "Bytes above max_bytes (the high watermark).",
     "over_max_bytes"),
    ("maintenance_selected_roots", "Roots chosen for eviction and not yet removed.",
     "selected_roots"),
    ("maintenance_selected_bytes", "Bytes of the roots chosen and not yet removed.",
     "selected_bytes"),
    ("gc_backlog_objects", "Objects awaiting collection (unreferenced, or rows gone and "
     "files not yet unlinked).", "collectable_objects"),
    ("gc_backlog_bytes", "Bytes of the objects awaiting collection.", "collectable_bytes"),
    ("maintenance_duty_ratio", "Share of the last 10 s maintenance spent in slices (its "
     "cap: SPARKCACHE_MAINTENANCE_DUTY, rising past max bytes to "
     "SPARKCACHE_MAINTENANCE_DUTY_MAX at the hard cap).", "duty"),
    ("store_pooled_bytes", "Bytes of collected files kept for commits to overwrite: on "
     "disk, not in store_used_bytes (cap: SPARKCACHE_MAINTENANCE_POOL_BYTES).",
     "pooled_bytes"),
    ("store_leased_roots", "Roots whose conversation lease (SPARKCACHE_LEASE_SECONDS) "
     "still runs; counted once a second.", "leased_roots"),
    ("store_leased_bytes", "Bytes of the roots whose conversation lease still runs; above "
     "the low watermark, an episode takes the oldest of them.", "leased_bytes"),
    ("store_filesystem_free_bytes", "Bytes free on the store's filesystem, read every "
     "slice; below SPARKCACHE_MIN_FREE_BYTES maintenance evicts.", "free_bytes"),
)
# Counters of maintenance's record (name without _total, help, field).
MAINTENANCE_COUNTERS = (
    ("evicted_roots", "Roots eviction removed whole.", "evicted_roots"),
    ("cut_roots", "Times eviction left a root cut short at a slice's budget.", "cut_roots"),
    ("reclaimed_bytes", "Bytes eviction made collectable (their last reference went).",
     "reclaimed_bytes"),
    ("collected_objects", "Objects deleted from the index and unlinked.",
     "collected_objects"),
    ("collected_bytes", "Bytes of the objects collected.", "collected_bytes"),
    ("lease_yielded_roots", "Roots eviction removed whole while their conversation lease "
     "still ran (the store at its cap, no unleased root left).", "yielded_roots"),
    ("lease_yielded_bytes", "Bytes eviction made collectable from roots whose "
     "conversation lease still ran.", "yielded_bytes"),
    ("read_lease_releases", "Releases of read leases maintenance took: a load reported, or "
     "a lookup that will not be loaded (commits end capture's leases themselves).",
     "read_releases"),
    ("read_lease_yielded_roots", "Roots eviction took whose read lease, older than its "
     "grace and never released, yielded at the cap.", "read_yielded_roots"),
    ("hard_cap_refused_seconds",
     "Seconds used bytes stood at the hard cap, where publications are refused.",
     "refused_s"),
)


# The drop reasons each role can count (workers' ``life.drop`` calls): the others stay 0,
# and a series that can only be 0 is not worth a scrape.
DROPS = {
    "capture": ("framing", "mixed", "page_index", "deadline", "block", "slot"),
    "commit": ("slot",),
    "maintenance": ("request",),
    "restore": ("framing", "mixed", "page_index", "block", "stale"),
}
assert all(set(reasons) <= set(DROP_REASONS) for reasons in DROPS.values())


def _rank(w: WorkerReading) -> str:
    return str(w.info.rank)


class SparkCacheCollector(Collector):
    """Registered in a private CollectorRegistry by ``server.MetricsServer``."""

    def __init__(self, source: Source) -> None:
        self.source = source

    def collect(self) -> Iterator[Metric]:
        now = reading.read(self.source)
        build = GaugeMetricFamily(PREFIX + "build_info", "1, labelled with the SparkCache "
                                  "release serving these metrics.", labels=["version"])
        build.add_metric([__version__], 1)
        yield build
        yield from self._workers(now)
        yield from self._ranks(now)
        yield from self._maintenance(now)
        yield from self._outcomes(now)
        yield from self._durations(now)
        yield from engine.families(now)

    # ------------------------------------------------------------------ every worker

    def _workers(self, r: Reading) -> Iterator[Metric]:
        labels = ["rank", "role"]
        up = GaugeMetricFamily(
            PREFIX + "worker_up", "1 while the worker is RUNNING, READY and beating "
            f"(within {reading.FRESH_S:g} s); 0 otherwise.", labels=labels)
        age = GaugeMetricFamily(
            PREFIX + "worker_report_age_seconds",
            "Seconds since the worker's last report (heartbeat); grows while it is stopped, "
            "hung or dead.", labels=labels)
        restarts = CounterMetricFamily(
            PREFIX + "worker_restarts", "Times the supervisor restarted the worker.",
            labels=labels)
        errors = CounterMetricFamily(
            PREFIX + "worker_item_errors",
            "Unexpected errors while handling one item (the worker went on).", labels=labels)
        drops = CounterMetricFamily(
            PREFIX + "worker_dropped_records",
            "Malformed ring records the worker dropped, by reason.",
            labels=[*labels, "reason"])
        copied = CounterMetricFamily(
            PREFIX + "worker_copied_bytes",
            "Bytes copied: capture into slots, restore into KV blocks.", labels=labels)
        full = CounterMetricFamily(
            PREFIX + "worker_disk_full_errors",
            "Commits (commit) and slices (maintenance) that failed on a full filesystem; "
            "the worker went on.", labels=labels)
        for w in r.workers:
            values = [_rank(w), w.info.role]
            up.add_metric(values, 1.0 if w.up else 0.0)
            if w.age_s is not None:
                age.add_metric(values, w.age_s)
            restarts.add_metric(values, w.info.restarts)
            errors.add_metric(values, w.totals["item_errors"])
            for reason in DROPS.get(w.info.role, DROP_REASONS):
                drops.add_metric([*values, reason], w.totals[f"drop_{reason}"])
            if w.info.role in ("capture", "restore"):
                copied.add_metric(values, w.totals["copy_bytes"])
            if w.info.role in ("commit", "maintenance"):
                full.add_metric(values, w.totals["disk_full"])
        yield from (up, age, restarts, errors, drops, copied, full)

    # ------------------------------------------------------------------ capture slots

    def _ranks(self, r: Reading) -> Iterator[Metric]:
        cfg = self.source.cfg
        slots = GaugeMetricFamily(
            PREFIX + "capture_slots", "Capture slots by owner (free, capture, commit).",
            labels=["rank", "owner"])
        pending = GaugeMetricFamily(
            PREFIX + "publication_pending_rank_slots",
            "Capture slots holding a publication not yet committed (sum over ranks: the "
            "instance's).", labels=["rank"])
        oldest = GaugeMetricFamily(
            PREFIX + "publication_oldest_pending_seconds",
            "Seconds since the oldest pending publication's last hand-over (to capture, or "
            "from capture to commit); 0 when none is pending.", labels=["rank"])
        pending_bytes = GaugeMetricFamily(
            PREFIX + "publication_pending_bytes",
            "Bytes of captured publications waiting for or in commit.", labels=["rank"])
        rings = GaugeMetricFamily(
            PREFIX + "ring_depth_records", "Records pushed into a ring and not yet read.",
            labels=["rank", "ring"])
        capacity = GaugeMetricFamily(
            PREFIX + "store_capacity_bytes",
            "max_bytes: the high watermark of the rank's store.", labels=["rank"])
        low = GaugeMetricFamily(
            PREFIX + "store_low_watermark_bytes",
            "Eviction in an episode stops at this many used bytes.", labels=["rank"])
        cap = GaugeMetricFamily(
            PREFIX + "store_hard_cap_bytes",
            "Used bytes past which publications are refused (store_full).", labels=["rank"])
        for rank in r.ranks:
            label = str(rank.rank)
            for owner, n in rank.slots.items():
                slots.add_metric([label, owner], n)
            pending.add_metric([label], rank.pending_slots)
            oldest.add_metric([label], rank.oldest_pending_s)
            pending_bytes.add_metric([label], rank.pending_bytes)
            for ring, depth in rank.rings.items():
                rings.add_metric([label, ring], depth)
            capacity.add_metric([label], cfg.max_bytes)
            low.add_metric([label], cfg.low_watermark_bytes)
            cap.add_metric([label], cfg.hard_cap_bytes)
        yield from (slots, pending, oldest, pending_bytes, rings, capacity, low, cap)

    # ------------------------------------------------------------------ maintenance, commit

    def _maintenance(self, r: Reading) -> Iterator[Metric]:
        gauges = {name: GaugeMetricFamily(PREFIX + name, doc, labels=["rank"])
                  for name, doc, _ in MAINTENANCE_GAUGES}
        counters = {name: CounterMetricFamily(PREFIX + name, doc, labels=["rank"])
                    for name, doc, _ in MAINTENANCE_COUNTERS}
        episode = GaugeMetricFamily(
            PREFIX + "maintenance_episode_seconds",
            "Seconds the current pressure episode has run; 0 when none.", labels=["rank"])
        refusing = GaugeMetricFamily(
            PREFIX + "hard_cap_refusing",
            "1 while used bytes stand at the hard cap and publications are refused.",
            labels=["rank"])
        active = 0
        lock_total = CounterMetricFamily(
            PREFIX + "commit_lock_wait_seconds",
            "Seconds commits waited for the index's write lock.", labels=["rank"])
        lock_max = GaugeMetricFamily(
            PREFIX + "commit_lock_wait_max_seconds",
            "The longest wait of a commit for the index's write lock since the commit worker "
            "started.", labels=["rank"])
        for w in r.workers:
            label = [_rank(w)]
            rec = w.record if w.live else None
            if w.info.role == "commit":
                lock_total.add_metric(label, w.totals["lock_wait_s"])
                if rec is not None:
                    lock_max.add_metric(label, rec.lock_wait_max_s)
            if w.info.role != "maintenance":
                continue
            for name, _, fld in MAINTENANCE_COUNTERS:
                counters[name].add_metric(label, w.totals[fld])
            if rec is None:
                continue
            for name, _, fld in MAINTENANCE_GAUGES:
                gauges[name].add_metric(label, getattr(rec, fld))
            since = float(rec.episode_since)
            active += since > 0
            episode.add_metric(label, max(0.0, r.at - since) if since else 0.0)
            refusing.add_metric(label, 1.0 if rec.refusing_since else 0.0)
        yield GaugeMetricFamily(
            PREFIX + "maintenance_active_ranks",
            "Ranks whose maintenance is in a pressure episode (evicting to the low "
            "watermark).", value=active)
        yield from gauges.values()
        yield from counters.values()
        yield from (episode, refusing, lock_total, lock_max)

    # ------------------------------------------------------------------ outcomes

    def _outcomes(self, r: Reading) -> Iterator[Metric]:
        pubs = CounterMetricFamily(
            PREFIX + "publications",
            "Publications that reached capture, by outcome: durable, commit_failed, "
            "bad_slot (commit), capture_<status> (refused or failed by capture, e.g. "
            "capture_no_slot). Skips "
            "before capture are counted by the engine "
            "(vllm:sparkcache_engine_publication_skips_total).",
            labels=["rank", "outcome"])
        restores = CounterMetricFamily(
            PREFIX + "restores", "Loads the restore worker answered, by result.",
            labels=["rank", "result"])
        checksum = CounterMetricFamily(
            PREFIX + "checksum_failures",
            "Pages that failed verification in a restore (a miss; the object is "
            "quarantined).", labels=["rank"])
        read = CounterMetricFamily(
            PREFIX + "restore_read_bytes",
            "Bytes of the pages the restore worker restored, by how it read them: direct "
            "(past the page cache), cached (mostly in the page cache already), buffered "
            "(through the page cache, direct reads being impossible there), cluster "
            "(fetched from the fleet's cluster, the local store lacking them).",
            labels=["rank", "path"])
        fleet_bad = CounterMetricFamily(
            PREFIX + "fleet_bad_pages",
            "Pages fetched from the fleet's cluster that failed verification (a miss, "
            "recomputed; the cluster's copy is left to its eviction).", labels=["rank"])
        for w in r.workers:
            label = _rank(w)
            t = w.totals
            if w.info.role == "capture":
                for status in CaptureStatus:
                    if status is not CaptureStatus.CAPTURED:
                        name = "capture_" + status_name(CaptureStatus, status)
                        pubs.add_metric([label, name], t[f"outcome_{int(status)}"])
            elif w.info.role == "commit":
                for status in DurableStatus:
                    pubs.add_metric([label, status_name(DurableStatus, status)],
                                    t[f"outcome_{int(status)}"])
            elif w.info.role == "restore":
                for status in LoadStatus:
                    restores.add_metric([label, status_name(LoadStatus, status)],
                                        t[f"outcome_{int(status)}"])
                checksum.add_metric([label], t[f"outcome_{int(LoadStatus.CORRUPT)}"])
                for path in READ_PATHS:
                    read.add_metric([label, path], t[f"read_bytes_{path}"])
                fleet_bad.add_metric([label], t["fleet_bad_pages"])
        yield from (pubs, restores, checksum, read, fleet_bad)

    # ------------------------------------------------------------------ histograms

    def _durations(self, r: Reading) -> Iterator[Metric]:
        families = {role: HistogramMetricFamily(PREFIX + name, doc, labels=["rank"])
                    for role, (name, doc) in DURATIONS.items()}
        for w in r.workers:
            family = families.get(w.info.role)
            if family is None:
                continue
            t = w.totals
            buckets, total = [], 0.0
            for i, bound in enumerate(DURATION_BUCKETS_S):
                total += t[f"dur_le_{i}"]
                buckets.append((f"{bound:g}", total))
            buckets.append(("+Inf", t["dur_count"]))
            family.add_metric([_rank(w)], buckets, t["dur_sum_s"])
        yield from families.values()
