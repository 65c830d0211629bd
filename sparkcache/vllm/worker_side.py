"""The connector's worker side: one per TP rank, inside vLLM's worker process.

It registers the rank's KV caches with a ``SparkCacheClient`` and carries out what the
scheduler side decided: saves (publications to capture) and loads (restores), and it
reports both back through ``get_finished``. vLLM's CPU backend keeps its KV in private
memory; the worker side moves it into a shared-memory segment in place
(``kvmem.SharedKVCaches.adopt``), so capture and restore reach its blocks as they reach a
GPU's, and the engine copies nothing. Where that cannot be done (a torch without the
storage swap, a /dev/shm too small for the KV), pages pass through a ``StagingPool``: one
copy per page on the engine's thread.
"""

from __future__ import annotations

import logging
import time
from collections import Counter

import torch

from sparkcache import kvmem
from sparkcache.client import SparkCacheClient
from sparkcache.staging import StagingPool
from sparkcache.vllm.kv_groups import KVGroups
from sparkcache.vllm.metadata import PageJob, SparkCacheMetadata
from sparkcache.vllm.settings import Settings

log = logging.getLogger(__name__)

# With no save (or no load) outstanding, get_finished reads the capture rings (or the
# restore ring) only this often: nothing can arrive for this rank then but reports of
# publications already released by their deadline (drained here, ignored) and
# durability reports no one on this side waits for.
# Every step of a decode-only batch would otherwise pay for polling five rings on cold
# caches: ~50 µs a step in vLLM's CPU engine, about half of what the connector cost there.
IDLE_POLL_S = 1.0
# How often handle_preemptions polls capture's completions while it waits for the copies
# of a preempted request's blocks.
PREEMPTION_POLL_S = 0.001


def _take_reports(sent: set[str], finished: set[str], recved: set[str]
                  ) -> tuple[set[str] | None, set[str] | None]:
    """``get_finished``'s answer, taken out of the sets it comes from: the saves done
    whose request vLLM has reported finished, and every load ended."""
    sending = sent & finished
    sent -= sending
    finished -= sending
    recving = set(recved)
    recved.clear()
    return sending or None, recving or None


def block_dims(shape: tuple[int, ...], num_blocks: int, block_size: int) -> tuple[int, int]:
    """(block dimension, block-size dimension) of one layer's KV tensor: vLLM 0.33's
    ``[blocks, kv heads, block size, K+V head size]``, or the older
    ``[2, blocks, block size, kv heads, head size]`` / ``[2, blocks, kv heads, block size,
    head size]``."""
    if len(shape) == 4 and shape[0] == num_blocks and shape[2] == block_size:
        return 0, 2
    if len(shape) == 5 and shape[0] == 2 and shape[1] == num_blocks:
        return 1, (2 if shape[2] == block_size else 3)
    raise ValueError(f"KV tensor of shape {list(shape)}: expected [{num_blocks}, heads, "
                     f"{block_size}, head size] or [2, {num_blocks}, ...]")


def distinct_tensors(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """Each tensor once, in order: with the hybrid allocator the layers of different KV
    cache groups share tensors (layer ``i`` of every group holds its blocks in tensor
    ``i``), and a page is each block of each tensor once."""
    seen: set[tuple] = set()
    out = []
    for t in tensors:
        ident = (t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.dtype)
        if ident not in seen:
            seen.add(ident)
            out.append(t)
    return out


class LoadErrors:
    """The blocks of loads that did not load every page, by request, until reported:
    vLLM takes them by block (``get_block_ids_with_load_errors``), or by request for a
    model with several KV cache groups (``get_transfer_results``' ``failed_recving``)."""

    def __init__(self) -> None:
        self._by_request: dict[str, set[int]] = {}

    def add(self, req_id: str, blocks: list[int]) -> None:
        self._by_request.setdefault(req_id, set()).update(blocks)

    def take(self) -> dict[str, set[int]]:
        taken, self._by_request = self._by_request, {}
        return taken


class WorkerSide:
    def __init__(self, settings: Settings, rank: int, groups: KVGroups | None = None) -> None:
        """``groups``: vLLM's KV cache groups where it made several (``kv_groups``)."""
        self.settings = settings
        self.rank = rank
        self.groups = groups if groups is not None and groups.hybrid else None
        self.client = SparkCacheClient(settings.cfg, rank, model_id=settings.model_id,
                                       tp_size=settings.tp_size)
        self.counters: Counter = Counter()
        self.shared_kv: kvmem.SharedKVCaches | None = None
        self.staging: StagingPool | None = None
        self._num_blocks = 0
        self._page_bytes = 0
        # Publications whose blocks (the engine's, or staging pages) capture may still
        # be copying, per request.
        self._lent: Counter[str] = Counter()
        # Finished requests whose engine blocks vLLM holds until their publications end.
        self._holding: set[str] = set()
        self._sent: set[str] = set()  # saves done (or given up), not yet reported
        self._recved: set[str] = set()  # loads done, not yet reported
        self._loading: dict[str, PageJob] = {}  # loads started and not ended
        # Loads the restore worker holds: request -> (job, staging pages, started at).
        self._inflight: dict[str, tuple[PageJob, list[int] | None, float]] = {}
        self._finished: set[str] = set()  # saved requests vLLM reported finished
        self.load_errors = LoadErrors()
        self._poll_at = 0.0  # when get_finished next reads the rings with nothing outstanding
        # Something may have been counted since totals() was last read: start() had jobs,
        # or get_finished read the rings (the connector's stats skip the sums otherwise).
        self.counted = False

    # ------------------------------------------------------------------ registration

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        tensors = distinct_tensors(list(kv_caches.values()))
        if not tensors:
            raise ValueError("no KV caches to register")
        first = tensors[0]
        num_blocks = max(first.shape[:2])
        block_dim, size_dim = block_dims(tuple(first.shape), num_blocks, self.settings.block_size)
        self._num_blocks = int(first.shape[block_dim])
        self._page_bytes = sum(t.select(block_dim, 0).numel() * t.element_size()
                               for t in tensors)
        if not all(t.is_cuda for t in tensors):
            self.shared_kv = self._adopt(tensors)
        layout = kvmem.page_layout(tensors, block_dim)
        if self.groups is not None:
            layout += f";kv_groups={self.groups.signature()}"
        if all(t.is_cuda for t in tensors) or self.shared_kv is not None:
            ok = self.client.register_kv_caches(tensors, block_dim, size_dim,
                                                kv_layout=layout, kv_dtype=self.settings.kv_dtype)
        else:
            # Private CPU memory: stage through shared pages (see StagingPool).
            pages = max(1, min(self._num_blocks,
                               self.settings.staging_bytes // self._page_bytes))
            self.staging = StagingPool(self.settings.cfg.instance, self.rank, tensors,
                                       block_dim, pages)
            ok = self.client.register_kv_caches(
                self.staging.tensors, 0, self._staged_size_dim(block_dim, size_dim),
                kv_layout=layout, kv_dtype=self.settings.kv_dtype)
        if not ok:
            raise RuntimeError("SparkCache refused the KV caches (see the log)")

    def _adopt(self, tensors: list[torch.Tensor]) -> kvmem.SharedKVCaches | None:
        if not kvmem.can_adopt():
            log.warning("SparkCache: this torch cannot move the KV cache into shared "
                        "memory; pages are copied through a staging pool instead")
            return None
        try:
            return kvmem.SharedKVCaches.adopt(self.settings.cfg.instance, self.rank, tensors)
        except OSError as e:
            size = sum({t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                        for t in tensors}.values())
            log.warning("SparkCache: the KV cache (%.1f GiB) does not fit in /dev/shm (%s); "
                        "pages are copied through a staging pool instead, on the engine's "
                        "thread (a larger /dev/shm avoids it)", size / 2**30, e)
            return None

    @staticmethod
    def _staged_size_dim(block_dim: int, size_dim: int) -> int:
        """The block-size dimension of a staging tensor: the engine's dimensions with the
        block dimension moved to the front."""
        return size_dim + 1 if size_dim < block_dim else size_dim

    # ------------------------------------------------------------------ per step

    def start(self, meta: SparkCacheMetadata) -> None:
        """Carry out one step's saves and loads (start_load_kv). vLLM waits for every job
        it hands over (a load's request waits for its report, a save holds its blocks), so
        one that faults is still ended here: a load with its blocks load errors, a save
        unsaved, unless it was already handed on (then its completion ends it)."""
        if meta.saves or meta.loads or meta.partial:
            self.counted = True
        for job in meta.partial:
            if self.staging is not None or self._lent[job.req_id]:
                # Staged, a running request's blocks are never lent (its pages would be
                # copied on this thread at every stride); with one of its saves still
                # copying, this one waits for the next stride, or its final save.
                self.counters["partial_skipped"] += 1
                continue
            try:
                self._save(job, partial=True)
            except Exception:
                self._job_fault("save", job)
        for job in meta.saves:
            if self.staging is None:
                self._holding.add(job.req_id)
            else:
                # The engine's blocks are free again as soon as their pages are staged.
                self._sent.add(job.req_id)
            try:
                self._save(job)
            except Exception:
                self._job_fault("save", job)
            self._settle(job.req_id)
        for job in meta.loads:
            try:
                self._load(job)
            except Exception:
                self._job_fault("load", job)
                if job.req_id not in self._inflight:
                    self._end_unsent(job, None)

    def _job_fault(self, kind: str, job: PageJob) -> None:
        self.counters[f"{kind}_fault"] += 1
        log.warning("SparkCache: the %s of request %s failed; ended without the cache",
                    kind, job.req_id, exc_info=True)

    def _valid(self, job: PageJob) -> bool:
        ids = job.block_ids[: job.pages]
        ok = len(ids) == job.pages and (
            not ids or (min(ids) >= 0 and max(ids) < self._num_blocks))
        if not ok:
            self.counters["bad_job"] += 1
        return ok

    def _settle(self, req_id: str) -> None:
        """A finished request whose publications have all ended is reported sent."""
        if req_id in self._holding and not self._lent[req_id]:
            self._holding.discard(req_id)
            self._sent.add(req_id)
        if not self._lent[req_id]:
            del self._lent[req_id]

    def _save(self, job: PageJob, partial: bool = False) -> None:
        """Publish a request's full pages; its blocks are lent until the pages are copied
        (by capture, or into staging here). A job of no pages publishes nothing."""
        if not job.pages or not self._valid(job):
            return
        if self.staging is None:
            if self.client.publish_keys(job.req_id, job.keys, job.block_ids, partial=partial):
                self._lent[job.req_id] += 1
                self.counters["saved_pages"] += job.pages
            return
        pages = self.staging.take(job.pages)
        if pages is None:
            self.counters["skipped_staging_full"] += 1
            return
        try:
            self.staging.copy_in(job.block_ids[: job.pages], pages)
        except BaseException:
            self.staging.give_back(pages)
            raise
        if self.client.publish_keys(job.req_id, job.keys, pages):
            self._lent[job.req_id] += 1
            self.counters["saved_pages"] += job.pages
        else:
            self.staging.give_back(pages)

    def handle_preemptions(self, meta: SparkCacheMetadata) -> None:
        """Save the preempted requests' computed pages, then wait until no publication
        reads their blocks: vLLM calls this before the step that may write into them (the
        preemption freed them to another request). Each publication ends by its deadline
        at the latest (``poll_completions`` releases it then, and capture drops a copy
        that finishes later), so the wait is bounded by the latest of their deadlines."""
        if not meta.preempted:
            return
        self.counted = True
        for job in meta.preempted:
            try:
                self._save(job)
            except Exception:
                self._job_fault("save", job)
        if self.staging is not None:
            return  # their pages are copied already: the blocks are free
        started = time.perf_counter()
        waiting = {job.req_id for job in meta.preempted}
        while any(self._lent[r] for r in waiting):
            self._poll_completions()
            if any(self._lent[r] for r in waiting):
                time.sleep(PREEMPTION_POLL_S)
        for req_id in waiting:
            self._lent.pop(req_id, None)
        self.counters["preemption_wait_seconds"] += time.perf_counter() - started

    def _poll_completions(self) -> None:
        now = time.monotonic()
        for done in self.client.poll_completions():
            req_id = str(done.seq_id)
            if self.staging is not None:
                self.staging.give_back(done.blocks)
            elif done.lent_at:
                self.counters["lent_bytes"] += len(done.blocks) * self._page_bytes
                self.counters["lent_seconds"] += now - done.lent_at
            if self._lent[req_id]:
                self._lent[req_id] -= 1
            self._settle(req_id)

    def _load(self, job: PageJob) -> None:
        """Hand a load to the restore worker: into the blocks themselves, or into staging
        pages copied into the blocks when it is done (``_finish_load``)."""
        n = job.pages
        pages = None
        if not self._valid(job):
            self._end_unsent(job, None)
            return
        if self.staging is not None:
            pages = self.staging.take(n)
            if pages is None:
                self.counters["load_staging_full"] += 1
                self._end_unsent(job, None)
                return
        self._loading[job.req_id] = job
        target = pages if pages is not None else job.block_ids[:n]
        if self.client.load_keys(job.req_id, job.keys, target, lease=job.lease):
            self._inflight[job.req_id] = (job, pages, time.perf_counter())
        else:
            self._end_load(job, pages, 0)

    def _finish_loads(self) -> bool:
        """End the loads the restore worker answered; whether there were any."""
        results = self.client.poll_loads()
        for result in results:
            entry = self._inflight.pop(str(result.load_id), None)
            if entry is None:
                continue
            job, pages, started = entry
            got = min(result.tokens // self.settings.block_size, job.pages)
            if pages is not None and got and self.staging is not None:
                try:
                    self.staging.copy_out(pages[:got], job.block_ids[:got])
                except Exception:
                    self._job_fault("load", job)
                    got = 0  # whatever reached the blocks is recomputed
            self.counters["load_seconds"] += time.perf_counter() - started
            self._end_load(job, pages, got)
        return bool(results)

    def _end_unsent(self, job: PageJob, pages: list[int] | None) -> None:
        """End a load never handed to the client, and the read lease its lookup took
        (the client ends the lease of a load it took)."""
        self.client.release(job.lease)
        self._end_load(job, pages, 0)

    def _end_load(self, job: PageJob, pages: list[int] | None, got: int) -> None:
        """The load is over (``got`` pages in its blocks): the blocks of the rest are load
        errors, which vLLM computes."""
        if pages is not None and self.staging is not None:
            self.staging.give_back(pages)
        self.counters["loaded_pages"] += got
        if got < job.pages:
            self.counters["load_errors"] += 1
            self.load_errors.add(job.req_id, job.block_ids[got: job.pages])
        self._loading.pop(job.req_id, None)
        self._recved.add(job.req_id)

    def _note_finished(self, finished_req_ids: set[str]) -> None:
        # Only a request with a save here is remembered: its save came in this same
        # step's metadata (vLLM binds it and calls start_load_kv before get_finished), and
        # the ids of every other finished request would pile up for the process's life.
        self._finished |= finished_req_ids & (self._sent | self._holding)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._note_finished(finished_req_ids)
        now = time.monotonic()
        idle_poll = now >= self._poll_at
        if idle_poll:
            self._poll_at = now + IDLE_POLL_S
        # Each ring only while something of its kind is outstanding (and at the idle
        # poll): a step of loads alone then does not also pay for the capture rings.
        # Only a load's result changes what totals() sums (a capture's completion does
        # not); the stats' refresh picks up anything else.
        if (self._inflight or idle_poll) and self._finish_loads():
            self.counted = True
        if self._lent or idle_poll:
            self._poll_completions()
        return _take_reports(self._sent, self._finished, self._recved)

    def salvage(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """``get_finished`` once it has raised, and from then on: this side's bookkeeping
        is no longer trusted, only the client's (``busy_ids``). vLLM waits for every
        job it handed over, so each still outstanding is reported once no worker can
        touch its blocks: a load with all of them load errors (vLLM computes them, a page
        that did land included), a save sent, unsaved or not, once vLLM reported its
        request finished. Never sooner: capture copying blocks vLLM has reused would
        store another request's bytes under these keys. Staging pages those jobs held
        are not given back: the pool's bookkeeping is this side's too, and new jobs go
        to ``Unserved``."""
        self._note_finished(finished_req_ids)
        busy = {str(i) for i in self.client.busy_ids()}
        for req_id, job in list(self._loading.items()):
            if req_id not in busy:
                del self._loading[req_id]
                self._inflight.pop(req_id, None)
                self.load_errors.add(req_id, job.block_ids[: job.pages])
                self._recved.add(req_id)
        for req_id in [r for r in self._lent if r not in busy]:
            del self._lent[req_id]
        for req_id in [r for r in self._holding if r not in busy]:
            self._holding.discard(req_id)
            self._sent.add(req_id)
        return _take_reports(self._sent, self._finished, self._recved)

    def wait_unused(self, req_ids: set[str]) -> None:
        """``handle_preemptions`` while salvaging: wait until no worker uses the blocks of
        ``req_ids``, by the client's account (a publication ends by its deadline at the
        latest)."""
        while req_ids & {str(i) for i in self.client.busy_ids()}:
            time.sleep(PREEMPTION_POLL_S)

    def totals(self) -> dict[str, float]:
        """Everything counted so far, under the names of ``stats.METRICS`` (skips as
        ``skipped:<reason>``)."""
        c = self.counters
        out: dict[str, float] = {
            "loaded_tokens": c["loaded_pages"] * self.settings.block_size,
            "load_seconds": c["load_seconds"], "load_errors": c["load_errors"],
            "saved_pages": c["saved_pages"], "lent_bytes": c["lent_bytes"],
            "lent_seconds": c["lent_seconds"],
            "preemption_wait_seconds": c["preemption_wait_seconds"]}
        for reason in ("bad_job", "partial_skipped", "skipped_staging_full",
                       "load_staging_full", "save_fault", "load_fault"):
            if c[reason]:
                out[f"skipped:{reason}"] = c[reason]
        for reason, n in self.client.counters.skipped.items():
            out[f"skipped:publish_{reason}"] = n
        for reason, n in self.client.counters.misses.items():
            out[f"skipped:load_{reason}"] = n
        return out

    def close(self) -> None:
        self.client.close()
        if self.staging is not None:
            self.staging.close()
            self.staging = None
        if self.shared_kv is not None:
            # Unlinks the name; vLLM's tensors keep the mapping for as long as they live.
            self.shared_kv.close()
            self.shared_kv = None


class Unserved:
    """The jobs of a rank whose worker side is not running (it could not start, or could
    not register the KV caches) while the scheduler side, another process, hands out
    loads and saves. vLLM waits for each, so each is answered as the cache being absent:
    a load received at the next ``get_finished`` with all its blocks load errors (vLLM
    computes them), a save sent, unsaved, once vLLM reports its request finished."""

    def __init__(self) -> None:
        self.jobs = 0  # answered so, for the log
        self._recved: set[str] = set()
        self.load_errors = LoadErrors()
        self._sent: set[str] = set()
        self._finished: set[str] = set()

    def take(self, meta: SparkCacheMetadata) -> None:
        for job in meta.loads:
            self._recved.add(job.req_id)
            self.load_errors.add(job.req_id, job.block_ids[: job.pages])
        self._sent.update(job.req_id for job in meta.saves)
        self.jobs += len(meta.loads) + len(meta.saves)

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        self._finished |= finished_req_ids & self._sent  # as WorkerSide.get_finished
        return _take_reports(self._sent, self._finished, self._recved)
