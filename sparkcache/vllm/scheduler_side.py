"""The connector's scheduler side: leased lookups across every TP rank, and the loads
and saves the workers carry out. It holds no tensors: the namespace comes from the
registry the worker sides wrote when they registered their KV caches, the keys from the
request (its tokens and what vLLM's own prefix hash covers)."""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any

from sparkcache import kvmem, registry
from sparkcache.config import AccessMode
from sparkcache.identity import Namespace, keys_bytes
from sparkcache.prefix_lookup import ALIVE_RECHECK_S, PrefixLookup
from sparkcache.protocol import new_lease_id, process_gone
from sparkcache.vllm.metadata import PageJob, SparkCacheMetadata
from sparkcache.vllm.request_keys import RequestKeys
from sparkcache.vllm.settings import Settings

log = logging.getLogger(__name__)


# How long an answer of get_num_new_matched_tokens is given again, unchanged, when vLLM asks
# about the same request with the same tokens computed: it asks every step while the
# request waits for free blocks, and each lookup would take another lease and count
# another hit. Well inside the lease the first answer took (``lookup_lease_seconds``).
ANSWER_REUSE_S = 1.0
# How often an incomplete or stale set of registrations is read again.
REGISTRY_RECHECK_S = 1.0


@dataclass
class _Request:
    keys: RequestKeys
    load: tuple[int, int] | None = None  # pages [start, end) found by the last lookup
    lease: int = 0  # the read lease that lookup took, until a load is given it
    loading: bool = False  # an async load was handed to the workers and has not ended
    loading_blocks: tuple[int, ...] = ()  # the blocks of that load
    # A load of it failed (a block came back a load error): it gets no other, or a store
    # that answers lookups but cannot load (a rank whose worker side is down, a page
    # that keeps failing) would have vLLM reschedule it into the same load forever.
    load_failed: bool = False
    # The last answer: (tokens computed when asked, the answer), and until when it holds.
    answer: tuple[int, tuple[int, bool]] | None = None
    answer_until: float = 0.0


class SchedulerSide:
    def __init__(self, settings: Settings, hash_block_size: int | None = None,
                 lookahead_tokens: int = 0) -> None:
        """``hash_block_size`` and ``lookahead_tokens``: how vLLM hashes blocks (its
        ``kv_cache_config.hash_block_size``, ``num_hash_lookahead_tokens``), which lets keys
        of a prefix seen before be taken from ``KeyMemo`` instead of hashed again."""
        self.settings = settings
        self._hash_block_size = hash_block_size
        self._lookahead = lookahead_tokens
        self.block = settings.block_size
        self.lookup = PrefixLookup(settings.cfg, settings.tp_size,
                                   alive_recheck_s=ALIVE_RECHECK_S)
        self.counters: Counter = Counter()
        # Something may have been counted since totals() was last read (a lookup or a
        # finished request): the connector's stats skip the sums otherwise.
        self.counted = False
        self._ns: Namespace | None = None
        self._ns_retry_at = 0.0
        self._reqs: dict[str, _Request] = {}
        self._meta = SparkCacheMetadata()

    # ------------------------------------------------------------------ keys

    def namespace(self) -> Namespace | None:
        """The namespace every rank registered, once they all have (same model, same
        page layout); None until then."""
        if self._ns is not None:
            return self._ns
        now = time.monotonic()
        if now < self._ns_retry_at:
            return None
        self._ns_retry_at = now + REGISTRY_RECHECK_S
        found = []
        for rank in range(self.settings.tp_size):
            reg = kvmem.read_registry(self.settings.cfg.store_dir, rank) or {}
            ns = reg.get("namespace")
            if not ns:
                return None
            owner = registry.registration_owner(reg)
            if owner is None or process_gone(*owner):
                # Left by an engine that is gone: this one's worker side has not
                # registered (or could not), and loads sent to it would wait for nothing.
                return None
            found.append({k: v for k, v in ns.items() if k != "rank"})
        first = found[0]
        if any(f != first for f in found) or first.get("model_id") != self.settings.model_id \
                or first.get("tp_size") != self.settings.tp_size:
            self.counters["namespace_mismatch"] += 1
            return None
        self._ns = Namespace(**first, rank=0)
        return self._ns

    def _keys(self, request: Any, tokens: int) -> list[str] | None:
        """Keys of the full pages among the first ``tokens`` tokens of ``request``,
        hashed incrementally as the request grows (``RequestKeys``)."""
        ns = self.namespace()
        if ns is None:
            return None
        state = self._reqs.get(request.request_id)
        if state is None:
            state = self._reqs[request.request_id] = _Request(RequestKeys(
                ns, hash_block_size=self._hash_block_size,
                lookahead_tokens=self._lookahead))
        keys = state.keys.update(request)
        return keys[: tokens // self.block]

    # ------------------------------------------------------------------ loads

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int, bool]:
        state = self._reqs.get(request.request_id)
        if (state is not None and state.answer is not None
                and state.answer[0] == num_computed_tokens
                and time.monotonic() < state.answer_until):
            return state.answer[1]  # asked again: the lease of the first answer holds
        answer = self._match(request, num_computed_tokens)
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.answer = (num_computed_tokens, answer)
            state.answer_until = time.monotonic() + min(
                ANSWER_REUSE_S, self.settings.cfg.lookup_lease_seconds / 2)
        return answer

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
        self.counted = True
        prompt = int(request.num_prompt_tokens)
        # At least one prompt token is left to compute: vLLM needs a forward to sample.
        keys = self._keys(request, prompt - 1)
        if not keys:
            self.counters["lookup_skipped"] += 1
            return 0, False
        start = -(-num_computed_tokens // self.block)  # pages vLLM has (or part of)
        state = self._reqs[request.request_id]
        if state.load_failed:
            self.counters["load_failed_before"] += 1
            return 0, False
        # The answers expected: the pages the keys' memo took from the conversation's
        # previous turn, which saved them when it finished, then where its latest saves
        # ended (the previous turn's may not be committed yet).
        self._release(state)  # an earlier answer's, not loaded
        lease = new_lease_id()
        pages = self.lookup.lookup(keys, beyond=start, hints=state.keys.expected_ends(),
                                   lease=lease)
        self.counters["lookups"] += 1
        if pages * self.block <= num_computed_tokens or pages <= start:
            if pages:
                self.lookup.release(lease)
            return 0, False
        state.load, state.lease = (start, pages), lease
        self.counters["hit_tokens"] += (pages - start) * self.block
        return pages * self.block - num_computed_tokens, True

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or state.load is None or not num_external_tokens:
            return
        start, end = state.load
        state.load = state.answer = None  # a later lookup asks the store again
        # vLLM now waits for this load's report, whatever follows.
        state.loading = True
        block_ids = list(blocks.get_block_ids()[0])
        if len(block_ids) < end:
            # Sent all the same: the worker side finds the job invalid and reports it
            # ended at once, the blocks there are load errors, which vLLM computes.
            log.warning("request %s: %d blocks for a load of pages up to %d; not loaded",
                        request.request_id, len(block_ids), end)
        state.loading_blocks = tuple(block_ids[start:end])
        self._meta.loads.append(
            PageJob(request.request_id, keys_bytes(state.keys.keys[start:end]),
                    block_ids[start:end], state.lease))
        state.lease = 0  # the load ends it

    def build_connector_meta(self, scheduler_output: Any) -> SparkCacheMetadata:
        meta, self._meta = self._meta, SparkCacheMetadata()
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            # Matched against every load still running, not only those ending now: with
            # several ranks vLLM passes on each rank's errors in the step it reports
            # them, and the load ends only once the last rank has.
            for state in self._reqs.values():
                if state.loading and not invalid.isdisjoint(state.loading_blocks):
                    state.load_failed = True
        for req_id in connector_output.finished_recving or ():
            state = self._reqs.get(req_id)
            if state is not None:
                state.loading = False
                state.loading_blocks = ()

    # ------------------------------------------------------------------ saves

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        self.counted = True
        try:
            return self._save(request, block_ids)
        finally:
            state = self._reqs.pop(request.request_id, None)  # the request is over
            if state is not None:
                self._release(state)

    def _release(self, state: _Request) -> None:
        """End the read lease of a lookup whose load will not come."""
        if state.lease:
            self.lookup.release(state.lease)
            state.lease = 0

    def _save(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        state = self._reqs.get(request.request_id)
        if state is not None and state.loading:
            # Aborted while its load runs. vLLM itself holds the blocks of a request
            # waiting for remote KV until a worker reports the load ended
            # (finished_recving), so nothing is written into a block it gave to another
            # request; there is nothing to save.
            self.counters["aborted_while_loading"] += 1
            return False, None
        if self.settings.cfg.access_mode is not AccessMode.READ_WRITE:
            return False, None
        # Not the tokens of a step still in flight (async scheduling): on a GPU its
        # kernels may not have written them when capture copies the blocks.
        done = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0))
        computed = min(done, len(block_ids) * self.block)
        if computed < self.block:
            return False, None  # no full page: nothing to hash or save
        keys = self._keys(request, computed)  # from what was hashed for its lookup
        if not keys:
            return False, None
        self._meta.saves.append(
            PageJob(request.request_id, keys_bytes(keys), list(block_ids[: len(keys)])))
        self.counters["saves"] += 1
        self._reqs[request.request_id].keys.note_saved(len(keys))  # made by _keys
        return True, None

    def totals(self) -> Counter:
        """Everything counted so far, under the names of ``stats.METRICS`` (skips as
        ``skipped:<reason>``)."""
        out = Counter({k: v for k, v in self.counters.items()
                       if k in ("lookups", "hit_tokens", "saves")})
        for reason, n in self.lookup.misses.items():
            out[f"skipped:lookup_{reason}"] += n
        for reason in ("lookup_skipped", "namespace_mismatch", "aborted_while_loading",
                       "load_failed_before"):
            if self.counters[reason]:
                out[f"skipped:{reason}"] = self.counters[reason]
        return out

    def close(self) -> None:
        self.lookup.close()
