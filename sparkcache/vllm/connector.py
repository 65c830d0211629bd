"""``SparkCacheConnector``: vLLM's ``KVConnectorBase_V1`` for SparkCache.

A thin adapter: ``SchedulerSide`` and ``WorkerSide`` translate vLLM's calls into
SparkCache's own (leased lookups, publications, restores); policy stays in SparkCache.
No call raises into vLLM: a fault is logged once per kind, counted, and answered as if
no cache existed (no hit, nothing saved, blocks released).
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)

try:  # vLLM 0.33 reports hits by tier; 0.32 (the CPU engine's) has no tiers
    from vllm.v1.metrics.cache_hit_source import CacheHitSource
except ImportError:
    CacheHitSource = None

from sparkcache.ratelog import RateLimitedLog
from sparkcache.vllm import kv_groups
from sparkcache.vllm import settings as settings_mod
from sparkcache.vllm.metadata import SparkCacheMetadata
from sparkcache.vllm.scheduler_side import SchedulerSide
from sparkcache.vllm.stats import Reporter, SparkCachePromMetrics, SparkCacheStats, by_rank
from sparkcache.vllm.worker_side import Unserved, WorkerSide

log = logging.getLogger(__name__)

STATS_REFRESH_S = 1.0


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except Exception:  # parallel state not initialised: a single rank
        return 0


def _log_through_vllm() -> None:
    """SparkCache's log lines in vLLM's processes go out through vLLM's own handlers, with
    its format (level, time, file) and the process prefix vLLM puts on its workers'
    output. vLLM configures only its ``vllm`` logger: ours reached Python's last-resort
    handler, bare messages without a time or a process, and none below a warning (the
    line saying the connector attached among them). Left alone where the host process
    gave SparkCache's logger (or the root logger) handlers of its own."""
    ours = logging.getLogger("sparkcache")
    theirs = logging.getLogger("vllm")
    if ours.handlers or logging.getLogger().handlers or not theirs.handlers:
        return
    for handler in theirs.handlers:
        ours.addHandler(handler)
    ours.setLevel(theirs.getEffectiveLevel())
    ours.propagate = False


def _recompute_failed_loads(transfer: Any) -> None:
    """A cache is best effort: a page that fails verification or vanished must be
    computed, not fail its request, which vLLM's default ``kv_load_failure_policy``
    ("fail") does. The launch config in docs/vllm.md sets "recompute"; any other value is
    set to it, with a warning naming what was asked (the scheduler reads the policy after
    it made this connector)."""
    policy = getattr(transfer, "kv_load_failure_policy", "recompute")
    if policy != "recompute":
        log.warning("SparkCache: kv_load_failure_policy %r set to 'recompute': a page that "
                    "fails verification or is gone is computed, never failing its request "
                    "(put \"kv_load_failure_policy\": \"recompute\" in "
                    "--kv-transfer-config to say so)", policy)
        transfer.kv_load_failure_policy = "recompute"


def _publishes_kv_events(vllm_config: Any) -> bool:
    events = getattr(vllm_config, "kv_events_config", None)
    return bool(getattr(events, "enable_kv_cache_events", False))


class SparkCacheConnector(KVConnectorBase_V1, SupportsHMA):
    """With the hybrid memory allocator (a model with sliding-window and full-attention
    layers) each save and load spans every KV cache group (``kv_groups``); groups it
    cannot store exactly disable it at start-up, with one line naming them."""

    if CacheHitSource is not None:
        _cache_hit_source = CacheHitSource.DISK  # vLLM's hit metrics, by tier

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        """No: sleep mode frees and remaps the KV cache the workers registered, which
        capture and restore hold mapped; vLLM then refuses the combination at start-up."""
        return False

    def __init__(self, vllm_config: Any, role: KVConnectorRole,
                 kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.faults: Counter = Counter()
        self._log = RateLimitedLog(log)
        self._reporter = Reporter()
        self._stats_at = 0.0
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        # Jobs for this rank while its worker side is not running (``Unserved``).
        self._unserved = Unserved() if role != KVConnectorRole.SCHEDULER else None
        # get_finished raised: the worker side's jobs are salvaged, new ones unserved.
        self._salvaging = False
        # Several KV cache groups (the hybrid allocator): vLLM takes load failures by
        # request (``get_transfer_results``), not by block.
        self._hybrid = False
        _log_through_vllm()
        try:
            _recompute_failed_loads(vllm_config.kv_transfer_config)
            settings = settings_mod.from_vllm(vllm_config)
            groups = kv_groups.from_kv_cache_config(kv_cache_config, settings.block_size)
            self._hybrid = groups is not None and groups.hybrid
            if role == KVConnectorRole.SCHEDULER:
                self._scheduler = SchedulerSide(
                    settings, getattr(kv_cache_config, "hash_block_size", None),
                    int(getattr(vllm_config, "num_hash_lookahead_tokens", 0) or 0),
                    getattr(vllm_config.cache_config, "prefix_caching_hash_algo", None),
                    kv_events=_publishes_kv_events(vllm_config), groups=groups)
            else:
                self._worker = WorkerSide(settings, _tp_rank(), groups)
        except Exception as exc:
            # A misconfiguration is the operator's to fix, but vLLM serves on without us.
            log.error("SparkCache disabled: %s", exc)
            self.faults["init"] += 1

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # best effort: a load that fails is recomputed

    def _fault(self, where: str) -> None:
        self.faults[where] += 1
        self._log.warning(where, "SparkCache: %s failed; serving on without the cache",
                          where, exc_info=True)

    # ------------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        if self._scheduler is None:
            return 0, False
        try:
            return self._scheduler.get_num_new_matched_tokens(request, num_computed_tokens)
        except Exception:
            self._fault("lookup")
            return 0, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.update_state_after_alloc(request, blocks, num_external_tokens)
        except Exception:
            self._fault("update_state_after_alloc")

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        if self._scheduler is None:
            return SparkCacheMetadata()
        try:
            return self._scheduler.build_connector_meta(scheduler_output)
        except Exception:
            self._fault("build_connector_meta")
            return SparkCacheMetadata()

    def update_connector_output(self, connector_output: Any) -> None:
        if self._scheduler is None:
            return
        try:
            self._scheduler.update_connector_output(connector_output)
        except Exception:
            self._fault("update_connector_output")

    def has_pending_block_frees(self) -> bool:
        if self._scheduler is None:
            return False
        try:
            return self._scheduler.has_pending_block_frees()
        except Exception:
            self._fault("has_pending_block_frees")
            return False

    def request_finished(self, request: Any,
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished_all_groups(request, (block_ids,))

    def request_finished_all_groups(
            self, request: Any,
            block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is None:
            return False, None
        try:
            return self._scheduler.request_finished(request, tuple(block_ids))
        except Exception:
            self._fault("request_finished")
            return False, None

    # ------------------------------------------------------------------ stats

    def get_kv_connector_stats(self) -> SparkCacheStats | None:
        """What this side counted since its last report. vLLM asks every step; the sums
        are made only after a step that may have counted something (``side.counted``),
        and at least every STATS_REFRESH_S in case a count came by another path."""
        side = self._scheduler or self._worker
        if side is None:
            return None
        now = time.monotonic()
        if not side.counted and now < self._stats_at:
            return None
        side.counted = False
        self._stats_at = now + STATS_REFRESH_S
        try:
            totals = side.totals()
            if self._worker is not None:
                totals = by_rank(totals, self._worker.rank)
            return self._reporter.report(totals)
        except Exception:
            self._fault("stats")
            return None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> SparkCacheStats:
        return SparkCacheStats(dict(data or {}))

    @classmethod
    def build_prom_metrics(cls, vllm_config: Any, metric_types: dict, labelnames: list[str],
                           per_engine_labelvalues: dict[int, list[object]]
                           ) -> SparkCachePromMetrics:
        return SparkCachePromMetrics(vllm_config, metric_types, labelnames,
                                     per_engine_labelvalues)

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, Any]) -> None:
        if self._worker is None:
            return
        try:
            self._worker.register_kv_caches(kv_caches)
        except Exception:
            self._fault("register_kv_caches")
            self._worker.close()
            self._worker = None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        """Bind a step's metadata only if it has loads or saves. Most steps have neither
        (decode), and with nothing bound vLLM skips its per-layer hooks (resolving the
        layer's attention context, ``wait_for_layer_load``, ``save_kv_layer``: work twice
        per attention layer per step, for calls that do nothing here), and
        ``start_load_kv`` returns at once."""
        if isinstance(connector_metadata, SparkCacheMetadata) and not (
                connector_metadata.loads or connector_metadata.saves
                or connector_metadata.partial):
            self.clear_connector_metadata()
            return
        super().bind_connector_metadata(connector_metadata)

    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        """Before the step whose forward may write into the blocks preemption freed:
        their pages are saved, and no publication reads them once this returns."""
        if not isinstance(kv_connector_metadata, SparkCacheMetadata) or \
                not kv_connector_metadata.preempted or self._worker is None:
            return
        try:
            if self._salvaging:  # nothing saved; the blocks only waited for
                self._worker.wait_unused({job.req_id for job in
                                          kv_connector_metadata.preempted})
            else:
                self._worker.handle_preemptions(kv_connector_metadata)
        except Exception:
            self._fault("handle_preemptions")

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        try:
            meta = self._get_connector_metadata()
            assert isinstance(meta, SparkCacheMetadata)
            if self._worker is not None and not self._salvaging:
                self._worker.start(meta)
            elif self._unserved is not None and (meta.loads or meta.saves or meta.partial):
                self._unserved.take(meta)
                self._log.warning("unserved", "SparkCache: this rank's worker side is not "
                                  "running (or failed); %d loads and saves answered without "
                                  "the cache",
                                  self._unserved.jobs)
        except Exception:
            self._fault("start_load_kv")

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # loads are asynchronous: the request waits for get_finished

    def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any,
                      **kwargs: Any) -> None:
        return None  # saves are of whole pages, published at start_load_kv

    def wait_for_save(self) -> None:
        return None

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """The worker side's reports; once they raised, its salvage's from then on, with
        the jobs handed over since answered as an unserved rank's (``start_load_kv``):
        vLLM waits for every job, so none may be left unreported."""
        try:
            if self._worker is not None and not self._salvaging:
                return self._worker.get_finished(finished_req_ids)
        except Exception:
            self._fault("get_finished")
            self._salvaging = True
        try:
            sending, recving = self._unserved.get_finished(finished_req_ids) \
                if self._unserved is not None else (None, None)
            if self._worker is not None:
                salvaged = self._worker.salvage(finished_req_ids)
                sending = (sending or set()) | (salvaged[0] or set()) or None
                recving = (recving or set()) | (salvaged[1] or set()) or None
            return sending, recving
        except Exception:
            self._fault("get_finished salvage")
        return None, None

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """``get_finished``'s reports and, for a model with several KV cache groups, the
        loads that did not load every page, failed by request: vLLM refuses block-level
        load errors there (it raises) and computes a failed request's prompt whole."""
        sending, recving = self.get_finished(finished_req_ids)
        failed = set(self._take_load_errors()) if self._hybrid else set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=set(recving or ()) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._hybrid:
            return set()  # reported by request (get_transfer_results)
        return set().union(*self._take_load_errors().values())

    def _take_load_errors(self) -> dict[str, set[int]]:
        """The load errors of the worker side and of ``Unserved``, by request."""
        taken: dict[str, set[int]] = {}
        try:
            for side in (self._unserved, self._worker):
                if side is not None:
                    for req_id, blocks in side.load_errors.take().items():
                        taken.setdefault(req_id, set()).update(blocks)
        except Exception:
            self._fault("load errors")
        return taken

    def take_events(self) -> list[Any]:
        if self._scheduler is None:
            return []
        try:
            return self._scheduler.take_events()
        except Exception:
            self._fault("take_events")
            return []

    def reset_cache(self) -> bool | None:
        """After a weight update: see ``SchedulerSide.reset``. The worker side has nothing
        of its own to reset (its keys come from the scheduler)."""
        if self._scheduler is None:
            return None
        try:
            return self._scheduler.reset()
        except Exception:
            self._fault("reset_cache")
            return False

    def shutdown(self) -> None:
        for side in (self._scheduler, self._worker):
            if side is not None:
                try:
                    side.close()
                except Exception:
                    log.debug("SparkCache shutdown", exc_info=True)
        self._scheduler = self._worker = None
