"""The connector's counters in vLLM's own stats and Prometheus metrics.

Each side (scheduler and every worker) reports what it counted since its last report as
``SparkCacheStats``, a worker side under names that carry its rank (``by_rank``); vLLM
adds the reports together, logs them, and hands them to ``SparkCachePromMetrics``, which
exposes them on vLLM's /metrics as ``vllm:sparkcache_*`` counters, a worker side's with a
``rank`` label."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (
    KVConnectorPromMetrics,
    KVConnectorStats,
)

# name in the stats -> (metric name, help). A skip is "skipped:<reason>".
METRICS = {
    "lookups": ("vllm:sparkcache_lookups", "Prefix lookups made by the scheduler."),
    "hit_tokens": ("vllm:sparkcache_hit_tokens",
                   "Tokens loaded beyond vLLM's own hit, counted when vLLM admits the "
                   "request (as vLLM counts its own hits)."),
    "loaded_tokens": ("vllm:sparkcache_loaded_tokens", "Tokens restored into KV blocks."),
    "load_seconds": ("vllm:sparkcache_load_seconds", "Seconds spent loading, all loads."),
    "load_errors": ("vllm:sparkcache_load_errors",
                    "Loads that restored fewer pages than looked up (vLLM recomputes)."),
    "load_cuts": ("vllm:sparkcache_load_cuts",
                  "Lookups whose load was expected to take longer than recomputing its "
                  "tokens, so none was made."),
    "load_cut_tokens": ("vllm:sparkcache_load_cut_tokens",
                        "Tokens of those lookups, recomputed instead of loaded."),
    "save_waits": ("vllm:sparkcache_save_waits",
                   "Requests whose lookup waited for a save of their prefix still being "
                   "stored."),
    "save_wait_seconds": ("vllm:sparkcache_save_wait_seconds",
                          "Seconds those requests waited, summed."),
    "save_waits_in_vain": ("vllm:sparkcache_save_waits_in_vain",
                           "Of those waits, the ones that ended with the save not stored "
                           "in time (the request then took what was stored)."),
    "fleet_lookups": ("vllm:sparkcache_fleet_lookups",
                      "Lookups that asked the fleet's cluster for pages the local store "
                      "lacks (the read-through)."),
    "fleet_hit_tokens": ("vllm:sparkcache_fleet_hit_tokens",
                         "Tokens those lookups found in the cluster, past the local "
                         "stores' hit."),
    "saves": ("vllm:sparkcache_saves", "Finished requests whose pages were published."),
    "saved_pages": ("vllm:sparkcache_saved_pages", "Pages published for capture."),
    "partial_saves": ("vllm:sparkcache_partial_saves",
                      "Saves of running requests' pages computed so far."),
    "preemption_saves": ("vllm:sparkcache_preemption_saves",
                         "Saves of preempted requests' computed pages."),
    "held_requests": ("vllm:sparkcache_held_requests",
                      "Finished requests whose blocks vLLM held until their saves ended."),
    "held_seconds": ("vllm:sparkcache_held_seconds",
                     "Seconds finished requests' blocks were held for saves, summed."),
    "lent_bytes": ("vllm:sparkcache_lent_bytes",
                   "Bytes of KV blocks lent to capture, by publication."),
    "lent_seconds": ("vllm:sparkcache_lent_seconds",
                     "Seconds publications' blocks were lent to capture, summed."),
    "preemption_wait_seconds": ("vllm:sparkcache_preemption_wait_seconds",
                                "Seconds the engine waited at preemptions for copies of "
                                "the preempted requests' blocks."),
    "events_stored_pages": ("vllm:sparkcache_events_stored_pages",
                            "Pages announced stored in KV events (again after a restart)."),
    "events_removed_pages": ("vllm:sparkcache_events_removed_pages",
                             "Pages announced removed in KV events."),
    "events_unconfirmed_saves": ("vllm:sparkcache_events_unconfirmed_saves",
                                 "Saves never found stored, so never announced."),
    "events_resyncs": ("vllm:sparkcache_events_resyncs",
                       "Times a removal log could not say what changed, so every "
                       "announced page was checked again."),
}
SKIPS = ("vllm:sparkcache_skips", "Lookups and saves the scheduler skipped, by reason.")
# What each TP rank's worker side counts, reported under its rank: every rank loads and
# publishes its own share of the same pages, so a sum across ranks (what vLLM's
# aggregation would make of one name) counts each token TP times.
WORKER_METRICS = frozenset({"loaded_tokens", "load_seconds", "load_errors", "saved_pages",
                            "lent_bytes", "lent_seconds", "preemption_wait_seconds"})
RANK_SKIPS = ("vllm:sparkcache_rank_skips",
              "Saves and loads a rank's worker side skipped or missed, by reason and rank.")
_RANK = "@rank"


def by_rank(totals: Mapping[str, float], rank: int) -> dict[str, float]:
    """A worker side's totals under names that carry its rank (``loaded_tokens@rank1``),
    so vLLM's aggregation of the ranks' reports keeps them apart."""
    return {f"{k}{_RANK}{rank}": v for k, v in totals.items()}


def split_rank(name: str) -> tuple[str, str | None]:
    """``(name, rank)`` of a reported name; rank None for the scheduler's."""
    base, mark, rank = name.rpartition(_RANK)
    return (base, rank) if mark and rank.isdigit() else (name, None)


@dataclass
class SparkCacheStats(KVConnectorStats):
    data: dict[str, Any] = field(default_factory=dict)

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> SparkCacheStats:
        total = Counter(self.data)
        total.update(other.data)
        return SparkCacheStats(dict(total))

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items()) if v}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Reporter:
    """Turns a side's running totals into the increments since the last report. vLLM asks
    every step, and most steps count nothing: plain dict work, no Counter arithmetic."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}

    def report(self, totals: Mapping[str, float]) -> SparkCacheStats | None:
        last = self._last
        changed = {k: v - last.get(k, 0) for k, v in totals.items() if v != last.get(k, 0)}
        if not changed:
            return None
        self._last = dict(totals)
        return SparkCacheStats(changed)


class SparkCachePromMetrics(KVConnectorPromMetrics):
    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters = {
            key: self._counter_cls(
                name=name, documentation=doc,
                labelnames=[*labelnames, "rank"] if key in WORKER_METRICS else labelnames)
            for key, (name, doc) in METRICS.items()
        }
        self._skips = self._counter_cls(name=SKIPS[0], documentation=SKIPS[1],
                                        labelnames=[*labelnames, "reason"])
        self._rank_skips = self._counter_cls(name=RANK_SKIPS[0], documentation=RANK_SKIPS[1],
                                             labelnames=[*labelnames, "reason", "rank"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value or value < 0:
                continue
            name, rank = split_rank(key)
            ranked = [] if rank is None else [rank]
            if name.startswith("skipped:"):
                skips = self._skips if rank is None else self._rank_skips
                skips.labels(*labels, name.split(":", 1)[1], *ranked).inc(value)
            elif name in self._counters and (rank is not None) == (name in WORKER_METRICS):
                self._counters[name].labels(*labels, *ranked).inc(value)
