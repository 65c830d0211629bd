"""The connector's scheduler side: leased lookups across every TP rank, and the loads
and saves the workers carry out. It holds no tensors: the namespace comes from the
registry the worker sides wrote when they registered their KV caches, the keys from the
request (vLLM's own block hashes of it where they are SHA-256, else its tokens and what
vLLM's hash covers); the workers take the keys it sends."""

from __future__ import annotations

import logging
import secrets
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, field
from typing import Any

from sparkcache import attachment, kvmem, registry
from sparkcache.config import AccessMode, Config
from sparkcache.fleet.link import settings_of
from sparkcache.fleet.lookup import ClusterLookup
from sparkcache.identity import KEY_BYTES, Namespace
from sparkcache.load_cost import LoadCost
from sparkcache.prefix_lookup import ALIVE_RECHECK_S, PrefixLookup
from sparkcache.protocol import new_lease_id
from sparkcache.shm.segment import process_gone
from sparkcache.vllm.block_hash_keys import KeySource, key_source
from sparkcache.vllm.kv_events import KVEvents, to_vllm
from sparkcache.vllm.kv_groups import KVGroups
from sparkcache.vllm.metadata import PageJob, SparkCacheMetadata
from sparkcache.vllm.request_keys import RequestKeys, default_memo
from sparkcache.vllm.settings import Settings

log = logging.getLogger(__name__)


# How long an answer of get_num_new_matched_tokens is given again, unchanged, when vLLM asks
# about the same request with the same tokens computed: it asks every step while the
# request waits for free blocks, and each lookup would take another lease and count
# another hit. Well inside the lease the first answer took (``lookup_lease_seconds``).
ANSWER_REUSE_S = 1.0
# How often an incomplete or stale set of registrations is read again.
REGISTRY_RECHECK_S = 1.0
# How often the supervisor the settings name is looked for again (``attachment``).
ATTACH_RECHECK_S = 5.0
# A request waiting for a save of its prefix (``_save_to_wait_for``) is looked up again
# after this long: vLLM asks every step, and an idle engine steps in a tight loop.
SAVE_RECHECK_S = 0.02
# Ends a hybrid model's lookup tries for a composite stored whole, at most.
COMPOSITE_TRIES = 4
# Saves remembered for requests that may wait for them, at most.
SAVES_KEPT = 4096
# This many waits in a row for saves not stored in time (a store refusing them at its
# cap, a capture worker down) stop waits for a while: each cost a request its wait.
WAITS_IN_VAIN = 3
WAITS_OFF_S = 30.0


@dataclass
class _SaveInFlight:
    """A save handed to the workers, remembered for ``save_wait_s``."""

    pages: int
    at: float  # time.monotonic() when it was handed over


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
    # The ``reset`` its keys were made after ("": none): a request from before a reset
    # (its KV computed with the old weights, say) gets no load after it.
    reset_tag: str = ""
    # The last answer: (tokens computed when asked, the answer), and until when it holds.
    answer: tuple[int, tuple[int, bool]] | None = None
    answer_until: float = 0.0
    # For saves while it runs: vLLM's request (from its lookup), its blocks as the
    # scheduler's outputs gave them, a list per KV cache group (emptied when it is
    # preempted), the tokens computed
    # once the last step that scheduled it has run, and the pages its last save covered.
    request: Any = None
    tables: list[list[int]] = field(default_factory=list)
    # Tokens computed when vLLM last allocated its blocks: below the window that far
    # back, a sliding-window group's tracked block ids may be freed (``windows_held``).
    allocated_at: int = 0
    scheduled_to: int = 0
    saved_pages: int = 0
    # Since when its lookups are answered "later", waiting for a save (0: not waiting),
    # and the most pages of the saves it waited for.
    waiting_since: float = 0.0
    waited_for: int = 0
    # Its last answer was "later" for the cluster's probes, not for a save: asked again
    # at the next step (the probes take a round trip or a few, not a save's time).
    asked_fleet: bool = False


class SchedulerSide:
    def __init__(self, settings: Settings, hash_block_size: int | None = None,
                 lookahead_tokens: int = 0, hash_algo: str | None = None,
                 kv_events: bool = False, groups: KVGroups | None = None) -> None:
        """``hash_block_size``, ``lookahead_tokens`` and ``hash_algo``: how vLLM hashes
        blocks (its ``kv_cache_config.hash_block_size``, ``num_hash_lookahead_tokens``,
        ``cache_config.prefix_caching_hash_algo``). With a cryptographic hash page keys
        are derived from vLLM's block hashes, and keys of a prefix seen before taken from
        ``KeyMemo`` (``block_hash_keys.key_source``); otherwise hashed from the tokens.
        ``kv_events``: vLLM publishes KV cache events (``--kv-events-config``), so the
        store's pages are announced (``kv_events.KVEvents``). ``groups``: vLLM's KV cache
        groups where the hybrid allocator made several (``kv_groups``): each save and
        load is then the composite of them."""
        self.settings = settings
        self.groups = groups if groups is not None and groups.hybrid else None
        # The group whose blocks hold the request's own page keys (vLLM's index).
        self._anchor = self.groups.groups[0].index if self.groups is not None else 0
        # A draft model drops a hit's last page, and the window before the page that is
        # left starts a page before the one stored: vLLM frees that page's blocks before
        # the request ends, so no save of it is ever complete (docs/vllm.md).
        self._loads_off = self.groups is not None and settings.drop_last_page
        if self._loads_off:
            log.warning("SparkCache: a draft model on a model with sliding-window layers: "
                        "prefixes are saved but not loaded (the window a draft model's "
                        "hit needs is freed before a save can copy it)")
        self._hash_block_size = hash_block_size
        self._lookahead = lookahead_tokens
        self._hash_algo = hash_algo
        self.key_source: KeySource | None = None  # chosen at the first request
        self.block = settings.block_size
        self.lookup = PrefixLookup(settings.cfg, settings.tp_size,
                                   alive_recheck_s=ALIVE_RECHECK_S)
        self.cost = LoadCost(self.block)  # whether a load beats recomputing
        self.counters: Counter = Counter()
        # Something may have been counted since totals() was last read (a lookup or a
        # finished request): the connector's stats skip the sums otherwise.
        self.counted = False
        self._ns: Namespace | None = None
        self._ns_retry_at = 0.0
        # vLLM's reset_cache (after a weight update): each makes a new namespace, so
        # nothing stored before it is found again by this process (``reset``).
        self._reset_tag = ""
        self._reqs: dict[str, _Request] = {}
        self._meta = SparkCacheMetadata()
        # Finished requests whose blocks vLLM holds for their saves: since when.
        self._held: dict[str, float] = {}
        self._saving = settings.cfg.access_mode is AccessMode.READ_WRITE
        # What ``attachment.find`` said last (None: a supervisor of the instance serves
        # the store dir), and when it is asked again.
        self._found: str | None = attachment.SUPERVISOR_ABSENT
        self._find_at = 0.0
        # Saves in flight, oldest first, by the raw key of their last page.
        self._saves: OrderedDict[bytes, _SaveInFlight] = OrderedDict()
        self._waits_in_vain = 0  # waits in a row that ended with the save not stored
        self._waits_off_until = 0.0
        self.events = (KVEvents(settings.cfg.store_dir, settings.tp_size, background=True)
                       if kv_events else None)
        self.fleet = _read_through(settings.cfg, settings.tp_size, self.groups is not None)

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
        if self._reset_tag:
            first["model_id"] = f"{first['model_id']}#reset:{self._reset_tag}"
        self._ns = Namespace(**first, rank=0)
        if self.events is not None:
            # After a reset the namespace is this process's alone: its ledger is too.
            self.events.attach(self._ns, durable=not self._reset_tag)
        return self._ns

    def mismatch(self) -> str | None:
        """Why the store dir and instance the settings name are not one supervisor's
        (``attachment.MISMATCHES``), or None; looked at every ``ATTACH_RECHECK_S``. The
        worker sides name it in the log; here it keeps a save that could not be stored
        from being counted as one, and lookups from leasing through the wrong
        supervisor."""
        found = self._supervisor()
        return found if found in attachment.MISMATCHES else None

    def _supervisor(self) -> str | None:
        """``attachment.find``'s reason for the settings, asked every
        ``ATTACH_RECHECK_S``: None while a supervisor of the instance serves the store."""
        now = time.monotonic()
        if now >= self._find_at:
            self._find_at = now + ATTACH_RECHECK_S
            try:
                self._found = attachment.find(self.settings.cfg, 0).reason
            except Exception:
                log.debug("looking for the supervisor failed", exc_info=True)
                self._found = attachment.SUPERVISOR_ABSENT
        return self._found

    def reset(self) -> bool:
        """vLLM's ``reset_cache``, called after a weight update: every later lookup misses
        and every later save is stored apart, under a namespace of its own for this
        process's life. What was stored before stays for eviction (and is found again
        by a vLLM started afresh, which loads its weights again); saves of requests from
        before the reset keep their keys; those requests get no load. True."""
        self._reset_tag = secrets.token_hex(8)
        self._ns, self._ns_retry_at = None, 0.0
        if self.events is not None:
            self.events.clear()
        self.counters["resets"] += 1
        log.info("SparkCache: cache reset (weights updated): earlier pages are no longer "
                 "looked up by this engine")
        return True

    def _keys(self, request: Any, tokens: int) -> list[str] | None:
        """Keys of the full pages among the first ``tokens`` tokens of ``request``,
        hashed incrementally as the request grows (``RequestKeys``)."""
        ns = self.namespace()
        if ns is None:
            return None
        state = self._reqs.get(request.request_id)
        if state is None:
            source = self.key_source or self._choose_key_source(ns)
            state = self._reqs[request.request_id] = _Request(RequestKeys(
                ns, hash_block_size=self._hash_block_size,
                lookahead_tokens=self._lookahead,
                memo=default_memo() if source.memo else None, block_hash_algo=source.algo),
                reset_tag=self._reset_tag)
        keys = state.keys.update(request)
        return keys[: tokens // self.block]

    def _choose_key_source(self, ns: Namespace) -> KeySource:
        """Once, at the first request: vLLM makes its NONE_HASH after this side."""
        source = self.key_source = key_source(
            self._hash_algo, self._hash_block_size, ns.page_tokens, self._lookahead)
        if source.algo is not None:
            log.info("SparkCache: page keys derived %s", source.why)
        else:
            log.warning("SparkCache: page keys hashed from the tokens on the scheduler's "
                        "thread, %s memo: %s", "with the" if source.memo else "without a",
                        source.why)
        return source

    # ------------------------------------------------------------------ loads

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        state = self._reqs.get(request.request_id)
        if (state is not None and state.answer is not None
                and state.answer[0] == num_computed_tokens
                and time.monotonic() < state.answer_until):
            return state.answer[1]  # asked again: the lease of the first answer holds
        answer = self._match(request, num_computed_tokens)
        state = self._reqs.get(request.request_id)
        if state is not None:
            state.request = request
            state.answer = (num_computed_tokens, answer)
            hold = (ANSWER_REUSE_S if answer[0] is not None else
                    0.0 if state.asked_fleet else SAVE_RECHECK_S)
            state.answer_until = time.monotonic() + min(
                hold, self.settings.cfg.lookup_lease_seconds / 2)
        return answer

    def _match(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        self.counted = True
        prompt = int(request.num_prompt_tokens)
        # At least one prompt token is left to compute: vLLM needs a forward to sample.
        keys = self._keys(request, prompt - 1)
        if not keys:
            self.counters["lookup_skipped"] += 1
            return 0, False
        start = -(-num_computed_tokens // self.block)  # pages vLLM has (or part of)
        state = self._reqs[request.request_id]
        if getattr(request, "skip_reading_prefix_cache", False):
            # Asked to read no prefix cache (prompt logprobs, some pooling requests):
            # vLLM 0.33 drops an external hit of such a request itself, so a lookup would
            # only take a read lease and count a hit that is never loaded. Still saved.
            self.counters["lookup_skip_reading"] += 1
            return 0, False
        if state.reset_tag != self._reset_tag:
            self.counters["lookup_before_reset"] += 1
            return 0, False
        if state.load_failed:
            self.counters["load_failed_before"] += 1
            return 0, False
        if self._loads_off:
            self.counters["lookup_draft_window"] += 1
            return 0, False
        mismatch = self.mismatch()
        if mismatch is not None:
            self.counters[f"lookup_{mismatch}"] += 1
            return 0, False
        # The answers expected: the pages the keys' memo took from the conversation's
        # previous turn, which saved them when it finished, then where its latest saves
        # ended (the previous turn's may not be committed yet).
        self._release(state)  # an earlier answer's, not loaded
        lease = new_lease_id()
        # Counted once its answer stands: a request answered "later" while it waits for
        # a save asks again, and the hit rate's denominator counts it once.
        pages = self.lookup.lookup(keys, beyond=start, hints=state.keys.expected_ends(),
                                   lease=lease, counted=False)
        if self.groups is not None and pages > start:
            pages = self._composite_stored(state, keys, start, pages, lease)
        now = time.monotonic()
        state.asked_fleet = False
        if self._waits_for_save(state, keys, max(pages, start), now):
            # Asked again at a later step: what the save stores is likelier to be loaded
            # than computed (the prefix vLLM holds itself, ``start``, needs no save).
            if pages:
                self.lookup.release(lease)
            return None, False
        if self.fleet is not None:
            found = self._from_fleet(request.request_id, state, max(pages, start), len(keys))
            if found is None:  # asked of the cluster: answered at a later step
                if pages:
                    self.lookup.release(lease)
                return None, False
            pages = max(pages, start) + found if found else pages
        self.lookup.count(len(keys), start, pages)
        self.counters["lookups"] += 1
        if pages and self.settings.drop_last_page:
            # As vLLM's prefix cache with a draft model: the draft's KV at the page's
            # last token was computed with a next token this request may not have.
            pages -= 1
        if pages * self.block <= num_computed_tokens or pages <= start:
            if pages:
                self.lookup.release(lease)
            return 0, False
        if (self.settings.cut_slow_loads
                and not self.cost.worth_loading(pages - start, now)):
            # Expected to arrive later than the engine would compute it (load_cost).
            self.lookup.release(lease)
            self.counters["load_cuts"] += 1
            self.counters["load_cut_tokens"] += (pages - start) * self.block
            return 0, False
        state.load, state.lease = (start, pages), lease
        return pages * self.block - num_computed_tokens, True

    def _from_fleet(self, request_id: str, state: _Request, have: int,
                    total: int) -> int | None:
        """Pages past ``have`` the fleet's cluster holds for every rank (the restore
        worker fetches them: the read-through, docs/fleet.md); None: asked, answered at
        a later step."""
        assert self.fleet is not None
        if have >= total:
            return 0
        found = self.fleet.held(request_id, state.keys.key_bytes(have, total), have)
        state.asked_fleet = found is None
        if found:
            self.counters["fleet_hit_tokens"] += found * self.block
        return found

    def _composite_stored(self, state: _Request, keys: list[str], start: int, pages: int,
                          lease: int) -> int:
        """The end of the longest composite stored whole (its sliding windows with it)
        among the anchor's stored prefix (``pages``) and the ends the keys' memo expects
        below it, leased as ``lease`` too; 0 if none beyond ``start``, and ``lease``
        (which the anchor's lookup took) released. A few lookups at most: each an
        O(log n) probe of the index."""
        assert self.groups is not None
        below = sorted((e for e in state.keys.expected_ends() if start < e < pages),
                       reverse=True)
        ends = [pages, *below[:COMPOSITE_TRIES - 1]]
        for end in ends:
            tail = self.groups.derived(state.keys.key_bytes(0, end), 0, end)
            wanted = [*keys[:end], *tail.hex_keys()]
            if self.lookup.lookup(wanted, beyond=start, hints=(len(wanted),), lease=lease,
                                  counted=False) == len(wanted):
                return end
        self.counters["lookup_window_not_stored"] += 1
        self.lookup.release(lease)
        return 0

    def _waits_for_save(self, state: _Request, keys: list[str], have: int,
                        now: float) -> bool:
        """Whether a request whose first ``have`` pages are stored (or held by vLLM) is
        to wait for a save of this engine that stores more of its prefix: an agent's
        next turn comes within milliseconds of the reply, before the save of the turn
        that replied is durable, and missed it (docs/vllm.md, "A turn sent at once").
        It waits while the save is younger than ``save_wait_s`` and than the time the
        engine takes to compute the pages it adds; then the prefix stored is taken.
        After ``WAITS_IN_VAIN`` waits in a row that ended so (a store refusing saves,
        say), none for ``WAITS_OFF_S``. Counted: ``save_waits`` (requests),
        ``save_wait_seconds``, ``save_waits_in_vain``."""
        limit = self.settings.save_wait_s
        saves = self._saves
        while saves:  # forget saves past any wait, oldest first
            oldest = next(iter(saves.values()))
            if now - oldest.at <= limit:
                break
            saves.popitem(last=False)
        # The largest save of this request's prefix past what it has: a page key names
        # its whole prefix, so a save is found by the request's key at the save's end.
        # Where the keys' memo knows where this conversation's saves ended
        # (``expected_ends``: with vLLM's own block hashes, its default), those ends
        # alone are looked up (1.5 us with SAVES_KEPT saves remembered, here); else every
        # save of the last ``save_wait_s`` is compared (1.45 ms with SAVES_KEPT).
        wanted = None
        ends = state.keys.expected_ends()
        if ends:
            for end in ends:
                save = saves.get(state.keys.key_bytes(end - 1, end)) \
                    if have < end <= len(keys) else None
                if save is not None and (wanted is None or save.pages > wanted.pages):
                    wanted = save
        else:
            for last, save in saves.items():
                if (have < save.pages <= len(keys)
                        and (wanted is None or save.pages > wanted.pages)
                        and state.keys.key_bytes(save.pages - 1, save.pages) == last):
                    wanted = save
        if wanted is not None:
            compute = self.cost.compute_seconds(wanted.pages - have)
            if now - wanted.at > (limit if compute is None else min(limit, compute)):
                wanted = None
        if wanted is not None and (state.waiting_since or now >= self._waits_off_until):
            if not state.waiting_since:
                state.waiting_since = now
                self.counters["save_waits"] += 1
            state.waited_for = max(state.waited_for, wanted.pages)
            return True
        if state.waiting_since:
            self.counters["save_wait_seconds"] += now - state.waiting_since
            in_vain = have < state.waited_for
            state.waiting_since, state.waited_for = 0.0, 0
            self._waits_in_vain = self._waits_in_vain + 1 if in_vain else 0
            if in_vain:
                self.counters["save_waits_in_vain"] += 1
            if self._waits_in_vain >= WAITS_IN_VAIN:
                self._waits_in_vain = 0
                self._waits_off_until = now + WAITS_OFF_S
                log.info("SparkCache: %d requests in a row waited for saves that were not "
                         "stored in time; none waits for the next %g s", WAITS_IN_VAIN,
                         WAITS_OFF_S)
        return False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        state = self._reqs.get(request.request_id)
        if state is None or state.load is None or not num_external_tokens:
            return
        start, end = state.load
        state.load = state.answer = None  # a later lookup asks the store again
        # vLLM may take fewer tokens than answered (0.33 cuts a hit to a block boundary
        # for its replay window, or caps it for an auxiliary connector): the pages it
        # takes any token of are loaded, the rest it computes. A page taken in part is
        # loaded whole: vLLM writes its own tokens over the rest of that block.
        end = min(end, start - (-num_external_tokens // self.block))
        # Counted at admission, as vLLM counts its own hits: an answer vLLM does not take
        # (a request never admitted, a hit it drops) is no hit.
        self.counters["hit_tokens"] += num_external_tokens
        self.counted = True
        # vLLM now waits for this load's report, whatever follows.
        state.loading = True
        tables = blocks.get_block_ids()
        block_ids = list(tables[self._anchor])
        if len(block_ids) < end:
            # Sent all the same: the worker side finds the job invalid and reports it
            # ended at once, the blocks there are load errors, which vLLM computes.
            log.warning("request %s: %d blocks for a load of pages up to %d; not loaded",
                        request.request_id, len(block_ids), end)
        if self.groups is None or len(block_ids) < end:
            job = PageJob(request.request_id, state.keys.key_bytes(start, end),
                          block_ids[start:end], state.lease)
        else:
            # Should vLLM take fewer tokens than answered, the windows before its end are
            # not stored: the load fails, and vLLM computes the prompt whole.
            comp = self.groups.composite(state.keys.key_bytes(0, end), start, end, tables)
            job = PageJob(request.request_id, comp.keys, comp.blocks, state.lease)
        state.loading_blocks = tuple(job.block_ids)
        self.cost.load_started(request.request_id, end - start, time.monotonic())
        self._meta.loads.append(job)
        state.lease = 0  # the load ends it

    def build_connector_meta(self, scheduler_output: Any) -> SparkCacheMetadata:
        meta, self._meta = self._meta, SparkCacheMetadata()
        if self.fleet is not None:
            self.fleet.new_step()
        self.cost.step(int(getattr(scheduler_output, "total_num_scheduled_tokens", 0)),
                       time.monotonic())
        self.lookup.publish_counters()
        if not self._saving:
            return meta
        # Preempted first: a request preempted and scheduled again in the same step has
        # its old blocks saved before the new ones replace them here.
        for req_id in getattr(scheduler_output, "preempted_req_ids", None) or ():
            state = self._reqs.get(req_id)
            if state is not None and state.tables and state.tables[self._anchor]:
                meta.preempted.append(self._preemption_save(req_id, state))
        self._track_blocks(scheduler_output)
        stride = self.settings.save_stride_pages if self.mismatch() is None else 0
        for req_id, n in scheduler_output.num_scheduled_tokens.items():
            state = self._reqs.get(req_id)
            if state is None or state.request is None:
                continue
            request = state.request
            computed = int(request.num_computed_tokens)
            state.allocated_at = computed
            state.scheduled_to = computed + int(n)
            if stride:
                # As at finish: only pages whose KV no step in flight still writes.
                done = computed - int(getattr(request, "num_in_flight_tokens", 0))
                if done // self.block >= state.saved_pages + stride:
                    job = self._save_job(req_id, state, done, state.saved_pages)
                    if job is not None:
                        meta.partial.append(job)
                        self.counters["partial_saves"] += 1
        return meta

    def _track_blocks(self, scheduler_output: Any) -> None:
        """Each request's block ids, as the scheduler's output gives them: a new or a
        resumed request's whole table, a running one's additions."""
        for new in scheduler_output.scheduled_new_reqs:
            state = self._reqs.get(new.req_id)
            if state is not None:
                state.tables = [list(ids) for ids in new.block_ids]
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", ())
        for req_id, groups in zip(cached.req_ids, cached.new_block_ids, strict=True):
            state = self._reqs.get(req_id)
            if state is None or groups is None:
                continue
            if req_id in resumed or len(state.tables) != len(groups):
                state.tables = [list(ids) for ids in groups]
            else:
                for table, ids in zip(state.tables, groups, strict=True):
                    table += ids

    def _save_job(self, req_id: str, state: _Request, done: int,
                  more_than: int) -> PageJob | None:
        """A save of the full pages among the first ``done`` tokens (their KV written), if
        there are more than ``more_than``."""
        anchor = state.tables[self._anchor] if state.tables else []
        computed = min(done, len(anchor) * self.block)
        keys = self._keys(state.request, computed) if computed >= self.block else None
        if not keys or len(keys) <= more_than:
            return None
        job = self._save_pages(req_id, state.keys, len(keys), state.tables,
                               tracked_at=state.allocated_at)
        if job is None:
            return None
        state.saved_pages = len(keys)
        state.keys.note_saved(len(keys))
        self._note_save(state.request, state.keys.key_bytes(0, len(keys)))
        return job

    def _save_pages(self, req_id: str, keys: RequestKeys, pages: int,
                    tables: list[list[int]], tracked_at: int | None = None) -> PageJob | None:
        """The save of the first ``pages`` pages from the request's blocks (``tables``, by
        KV cache group: vLLM's own at its end, else tracked from the scheduler's outputs
        as of ``tracked_at`` tokens computed); None where a sliding-window group no longer
        holds the window before its end (vLLM frees blocks that fell out of the window as
        the request runs; counted as skipped, ``save_window_freed``)."""
        anchor = keys.key_bytes(0, pages)
        if self.groups is None:
            return PageJob(req_id, anchor, list(tables[self._anchor][:pages]))
        if not self.groups.windows_held(tables, pages, tracked_at):
            self.counters["save_window_freed"] += 1
            return None
        comp = self.groups.composite(anchor, 0, pages, tables)
        return PageJob(req_id, comp.keys, comp.blocks)

    def _preemption_save(self, req_id: str, state: _Request) -> PageJob:
        """The preempted request's computed pages, from its blocks before the preemption
        freed them (vLLM has already set its computed tokens to 0): all of them, since a
        rank may have skipped a save made while it ran. With no full page the job has
        none: the worker sides still wait for the saves of it in flight."""
        request = state.request
        # The tokens of the steps that scheduled it, less those still in flight, and never
        # the last token known (a draft rejected since its step was scheduled is no token).
        done = min(state.scheduled_to, int(request.num_tokens) - 1) \
            - int(getattr(request, "num_in_flight_tokens", 0))
        job = self._save_job(req_id, state, done, 0)
        if job is None:
            job = PageJob(req_id, b"", [])
        else:
            self.counters["preemption_saves"] += 1
        state.tables = []
        state.scheduled_to = 0
        state.answer = None  # resumed, it looks up what this save stored
        return job

    def has_pending_block_frees(self) -> bool:
        """Finished requests' blocks are held for saves: each is freed once its
        publications are copied or their deadline passes, so vLLM may wait for those
        rather than preempt a running request."""
        return bool(self._held)

    def update_connector_output(self, connector_output: Any) -> None:
        for req_id in getattr(connector_output, "failed_recving", None) or ():
            # A model with several KV cache groups: failed by request (vLLM computes it).
            state = self._reqs.get(req_id)
            if state is not None:
                state.load_failed = True
        invalid = getattr(connector_output, "invalid_block_ids", None)
        if invalid:
            # Matched against every load still running, not only those ending now: with
            # several ranks vLLM passes on each rank's errors in the step it reports
            # them, and the load ends only once the last rank has.
            for state in self._reqs.values():
                if state.loading and not invalid.isdisjoint(state.loading_blocks):
                    state.load_failed = True
        for req_id in connector_output.finished_recving or ():
            self.cost.load_finished(req_id, time.monotonic())
            state = self._reqs.get(req_id)
            if state is not None:
                state.loading = False
                state.loading_blocks = ()
        sending = connector_output.finished_sending
        if sending and self._held:
            now = time.monotonic()
            for req_id in sending:
                since = self._held.pop(req_id, None)
                if since is not None:
                    self.counters["held_requests"] += 1
                    self.counters["held_seconds"] += now - since
                    self.counted = True

    # ------------------------------------------------------------------ saves

    def request_finished(self, request: Any,
                         block_ids: tuple[list[int], ...]) -> tuple[bool, Any]:
        """vLLM's ``request_finished_all_groups``: ``block_ids`` by KV cache group."""
        self.counted = True
        try:
            held, params = self._save(request, block_ids)
        finally:
            state = self._reqs.pop(request.request_id, None)  # the request is over
            if state is not None:
                self._release(state)
            if self.fleet is not None:
                self.fleet.forget(request.request_id)
        if held:
            self._held[request.request_id] = time.monotonic()
        return held, params

    def _release(self, state: _Request) -> None:
        """End the read lease of a lookup whose load will not come."""
        if state.lease:
            self.lookup.release(state.lease)
            state.lease = 0

    def _save(self, request: Any, tables: tuple[list[int], ...]) -> tuple[bool, Any]:
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
        mismatch = self.mismatch()
        if mismatch is not None:
            # Nothing would be stored: counted as skipped, never as a save, and the
            # blocks go back at once.
            self.counters[f"save_{mismatch}"] += 1
            return False, None
        # Not the tokens of a step still in flight (async scheduling): on a GPU its
        # kernels may not have written them when capture copies the blocks.
        done = int(request.num_computed_tokens) - int(getattr(request, "num_in_flight_tokens", 0))
        computed = min(done, len(tables[self._anchor]) * self.block)
        keys = self._keys(request, computed) if computed >= self.block else None
        job = None
        if keys:
            # All its pages, even if a save made while it ran covered them: a rank may
            # have skipped that one, and capture copies only what the store lacks.
            job = self._save_pages(request.request_id, self._reqs[request.request_id].keys,
                                   len(keys), list(tables))
        if job is None:
            if state is None or not state.saved_pages or not state.tables:
                return False, None  # no full page: nothing to hash or save
            # Saves made while it ran may still be copying its blocks: vLLM holds them
            # until the worker sides report those done.
            self._meta.saves.append(PageJob(request.request_id, b"", []))
            return True, None
        request_keys = self._reqs[request.request_id].keys  # made by _keys
        self._meta.saves.append(job)
        self._note_save(request, request_keys.key_bytes(0, len(keys)))
        self.counters["saves"] += 1
        request_keys.note_saved(len(keys))
        return True, None

    def _note_save(self, request: Any, raw_keys: bytes) -> None:
        if self.settings.save_wait_s > 0 and raw_keys and self._supervisor() is None:
            # (Without a supervisor nothing is stored: no request waits for it.)
            last = raw_keys[-KEY_BYTES:]
            self._saves.pop(last, None)  # (a save again of the same pages: the newer)
            self._saves[last] = _SaveInFlight(len(raw_keys) // KEY_BYTES, time.monotonic())
            if len(self._saves) > SAVES_KEPT:
                self._saves.popitem(last=False)
        if self.events is not None:
            self.events.note_save(request, raw_keys, self.block, self._hash_block_size)

    def take_events(self) -> list[Any]:
        """vLLM's ``take_events``: the store's changes to this engine's pages since the
        last call, as vLLM's event records (none unless vLLM publishes events)."""
        if self.events is None:
            return []
        self.namespace()  # the ledger opens with it: a restarted engine announces again
        events = self.events.take()
        if events:
            self.counted = True
        return to_vllm(events)

    def totals(self) -> Counter:
        """Everything counted so far, under the names of ``stats.METRICS`` (skips as
        ``skipped:<reason>``)."""
        out = Counter({k: v for k, v in self.counters.items()
                       if k in ("lookups", "hit_tokens", "saves", "partial_saves",
                                "preemption_saves", "held_requests", "held_seconds",
                                "load_cuts", "load_cut_tokens", "save_waits",
                                "save_wait_seconds", "save_waits_in_vain",
                                "fleet_hit_tokens")})
        for reason, n in self.lookup.misses.items():
            out[f"skipped:lookup_{reason}"] += n
        if self.events is not None:
            out.update(self.events.counts.totals())
        if self.fleet is not None:
            out["fleet_lookups"] = self.fleet.counters["asked"]
            for reason, name in (("late", "fleet_lookup_late"),
                                 ("unavailable", "fleet_lookup_unavailable"),
                                 ("failed", "fleet_lookup_failed")):
                if self.fleet.counters[reason]:
                    out[f"skipped:{name}"] = self.fleet.counters[reason]
        for reason in ("lookup_skipped", "namespace_mismatch", "aborted_while_loading",
                       "load_failed_before", "lookup_before_reset", "lookup_skip_reading",
                       "lookup_window_not_stored", "save_window_freed", "lookup_draft_window",
                       *(f"{side}_{why}" for side in ("lookup", "save")
                         for why in attachment.MISMATCHES)):
            if self.counters[reason]:
                out[f"skipped:{reason}"] = self.counters[reason]
        return out

    def close(self) -> None:
        self.lookup.close()
        if self.fleet is not None:
            self.fleet.close()
        if self.events is not None:
            self.events.close()


def _read_through(cfg: Config, ranks: int, hybrid: bool) -> ClusterLookup | None:
    """The cluster's lookups where the config names a cluster and a lookup time-out."""
    if not cfg.read_through:
        return None
    if hybrid:
        # A hybrid model's hit needs its sliding windows' pages too (the composite,
        # kv_groups), which the cluster's probes of the prefix do not look for.
        log.info("SparkCache: no read-through from the cluster for a model with "
                 "sliding-window layers; this node shares its pages all the same")
        return None
    return ClusterLookup(settings_of(cfg), ranks, cfg.share_lookup_timeout_s)
