"""The connector's counters in vLLM's own stats and Prometheus metrics.

Each side (scheduler and every worker) reports what it counted since its last report as
``SparkCacheStats``; vLLM adds the workers' and the scheduler's together, logs them, and
hands them to ``SparkCachePromMetrics``, which exposes them on vLLM's /metrics as
``vllm:sparkcache_*`` counters."""

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
                   "Tokens the store held beyond vLLM's own hit, at lookup."),
    "loaded_tokens": ("vllm:sparkcache_loaded_tokens", "Tokens restored into KV blocks."),
    "load_seconds": ("vllm:sparkcache_load_seconds", "Seconds spent loading, all loads."),
    "load_errors": ("vllm:sparkcache_load_errors",
                    "Loads that restored fewer pages than looked up (vLLM recomputes)."),
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
}
SKIPS = ("vllm:sparkcache_skips", "Lookups, saves and loads skipped or missed, by reason.")


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
            key: self._counter_cls(name=name, documentation=doc, labelnames=labelnames)
            for key, (name, doc) in METRICS.items()
        }
        self._skips = self._counter_cls(name=SKIPS[0], documentation=SKIPS[1],
                                        labelnames=[*labelnames, "reason"])

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        labels = self.per_engine_labelvalues[engine_idx]
        for key, value in transfer_stats_data.items():
            if not value or value < 0:
                continue
            if key.startswith("skipped:"):
                self._skips.labels(*labels, key.split(":", 1)[1]).inc(value)
            elif key in self._counters:
                self._counters[key].labels(*labels).inc(value)
