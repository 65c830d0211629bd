"""The maintenance worker of one rank: the index checked at start (``check_index``),
then slices of bounded work: during a pressure episode, eviction from ``max_bytes`` down
to the low watermark, in lease order (roots whose lease is over, least recently used
first, then the oldest conversation leases; a read lease is never overridden:
docs/maintenance.md, "Leases at the cap"); collection of unreferenced objects; the sweep
of what a crash left, once after each start; and what the engine asks on the request
rings (the engine only reads the index): restore touches,
lookup leases and their releases, quarantines.

The policy (budget per slice, duty cap, I/O cap, hysteresis, the hard cap's clock) is
``sparkcache/maintenance_policy.py``; the bounded eviction itself is
``sparkcache/store/eviction.py`` (index walks only: no slice reads the whole inventory).
This module is the loop that follows them and reports the backlog in the worker's stats
slot, every slice and at least every ``IDLE_S`` while idle. While evicting, the request
rings are drained inside the eviction transaction under the lookup gate
(``sparkcache/store/gate.py``), so a lookup's lease is always written before a removal
could take what it counted.
"""

from __future__ import annotations

import logging
import math
import os
import time
from collections import deque
from collections.abc import Callable

from posix_ipc import SignalError
from sparkcache.shm import Consumer, RingClosed, RingEmpty
from sparkcache.shm.layouts import join_key
from sparkcache.workers import lifecycle
from sparkcache.workers.lifecycle import ENVIRONMENT_FAULTS, Lifecycle, State, WorkerSpec

from sparkcache import segments
from sparkcache.maintenance_policy import (
    CostModel,
    HardCap,
    Limits,
    Pacing,
    Pressure,
    SliceMeter,
)
from sparkcache.protocol import RequestKind
from sparkcache.ratelog import RateLimitedLog
from sparkcache.store import CollectResult, EvictResult, PageStore, index
from sparkcache.store.eviction import EvictionPlan
from sparkcache.store.layout import DIR_FLAGS
from sparkcache.store.recovery import sweep_units
from sparkcache.store.space import Ballast, ballast_bytes, is_disk_full, reserve_shortfall
from sparkcache.store.store import DEFAULT_GRACE_SECONDS

log = logging.getLogger(__name__)

# Rows one collection reads at most; its bytes and time budget usually stop it first.
COLLECT_ROWS = 1024
IDLE_S = 0.2
# A slice longer than this many times its time budget is logged (at most once a minute)
# with its longest step: the budget is an estimate, and an overrun that large is worth
# an operator's look (a disk stalled, or a unit far slower than any seen before).
OVERRUN_WARN = 2.0
# How often the report lists the pool of collected files for its size (store/pool.py),
# and counts the roots under a running conversation lease (``PageStore.leased``).
POOL_READ_S = 1.0
LEASED_READ_S = 1.0
# A request's page position is below the most pages one publication can carry.
_MAX_POS = segments.RINGS["publish"][1]
# Clocks of two processes: an access stamped this far in the future is still believed.
_FUTURE_SLACK_S = 60.0
# A start sweeps no file before READY: what a crash leaves is files (temp files of
# commits in flight, orphans, records not punched), which cost space, never a wrong
# answer, and the whole repair a start ran reads every row (98.8 s at 10 M page rows,
# scripts/bench_start.py, past the READY limit). Once the grace for in-flight commits'
# files is over after the start, every file is swept once, a unit (``SWEEP_DIGITS`` hex
# digits of key prefix: a sixteenth of a fan-out directory, ~2,400 rows at 10 M) at a
# time, as many a slice as its time affords, one while evicting (docs/store.md,
# "Starting after a crash").
RESWEEP_AFTER_S = DEFAULT_GRACE_SECONDS
SWEEP_DIGITS = 3
SWEEP = "sweep"  # a unit of a slice's work: one key prefix's files swept
# After a slice failed on a full disk, the ballast is not taken again for this long: a
# quota (EDQUOT) or an index that cannot grow leaves statvfs's free space plentiful, and
# the ballast was taken and given up every slice.
BALLAST_RETAKE_S = 60.0
SPACE = "space"  # one: pooled files given back for the free-space reserve, or the ballast taken
# Cumulative counters of the stats record (WORKER_STATS names).
_TOTALS = ("evicted_roots", "cut_roots", "skipped_roots", "reclaimed_bytes",
           "collected_objects", "collected_bytes", "io_bytes", "yielded_roots",
           "yielded_bytes", "read_yielded_roots")


def written_bytes() -> int:
    """Bytes this process wrote through write(2) and its kin (``wchar`` of /proc/self/io):
    the index's WAL frames and checkpoints. 0 where the kernel keeps no such count."""
    try:
        with open("/proc/self/io", "rb") as f:
            for line in f:
                if line.startswith(b"wchar:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Maintenance:
    """One rank's maintenance: its rings, its store, the policy's state. ``clock`` is the
    policy's (monotonic seconds); tests inject one."""

    def __init__(self, life: Lifecycle, clock: Callable[[], float] = time.monotonic) -> None:
        cfg = life.spec.cfg
        self.life = life
        self.cfg = cfg
        # The engine worker's requests, and the leases the vLLM scheduler's lookups take.
        self.requests = [segments.consumer(cfg, life.spec.rank, ring)
                         for ring in ("request", "lease")]
        self.store = PageStore(
            cfg.store_dir, life.spec.rank, lease_seconds=cfg.lease_seconds,
            hook=lifecycle.checkpoint, pool_bytes=cfg.pool_cap_bytes,
            halve_above=cfg.maintenance_halve_bytes, checkpoint_thread=True,
        )
        self.clock = clock
        self.pooled_bytes = 0
        self._pool_read_at = float("-inf")
        self.leased_roots = self.leased_bytes = 0
        self._leased_read_at = float("-inf")
        self.limits = Limits.from_config(cfg)
        self.costs = CostModel()
        self._rare = RateLimitedLog(log)
        self.pressure = Pressure(cfg.max_bytes, cfg.low_watermark_bytes)
        self.hard_cap = HardCap(self.limits.hard_cap_bytes)
        self.pacing = Pacing(self.limits, clock())
        self.plan = EvictionPlan()
        self.totals = dict.fromkeys(_TOTALS, 0)
        self.slice_last_s = self.slice_max_s = 0.0
        self.index_sync_s = self.index_sync_max_s = 0.0
        self._quarantines: list[tuple[str, str]] = []
        self._resweep = deque(sweep_units(SWEEP_DIGITS))
        self._resweep_at = clock() + RESWEEP_AFTER_S
        self.space = self.store.space()  # the store's filesystem, read every slice
        self._rank_fd = os.open(self.store.layout.rank_dir, DIR_FLAGS)
        self.ballast = Ballast(self._rank_fd, ballast_bytes(cfg.min_free_bytes))
        self._ballast_at = clock()  # when it may be taken (again)

    def close(self) -> None:
        os.close(self._rank_fd)
        self.store.close()
        for ring in self.requests:
            ring.close()

    def run(self) -> None:
        self.store.check_index(self._started_a_step)
        self.life.processed = 0  # counts slices from here
        self.life.to(State.READY)
        while not self.life.stop:
            pause = self.step()
            if pause:
                self.life.idle(pause)
        self.life.to(State.DRAINING)
        self._take_requests()
        self.store.flush_touches()

    def _started_a_step(self) -> None:
        """Progress of the start (the index check): counted in ``processed``, which the
        supervisor reads as progress while the worker is STARTING and which extends its
        READY deadline (``supervisor_states``), and a beat at most every half second."""
        self.life.processed += 1
        self.life.progress()

    def step(self) -> float:
        """One turn of the loop: a slice if the duty and I/O caps allow one now, then the
        report. Returns how long to wait before the next turn (0: at once)."""
        wait = self.pacing.wait(self.clock(), self.life.used_bytes)
        worked = False
        if wait <= 0:
            try:
                worked = self.slice()
                self._sync_collected()
            except Exception as exc:
                # A full disk is a StoreError too, but space comes back: not FATAL. An
                # fsync that failed (ENOSPC too, on a thin volume) is never tried again.
                if is_disk_full(exc) and not index.sync_failed(exc):
                    self._disk_full(exc)
                elif isinstance(exc, ENVIRONMENT_FAULTS):
                    raise
                else:
                    self.life.item_error("a maintenance slice")
                self.store.check_usable()
        self.report()
        if worked:
            return 0.0
        return min(wait, IDLE_S) if wait > 0 else IDLE_S

    def slice(self) -> bool:
        """One slice of bounded work (``maintenance_policy``); True if it did any."""
        meter = SliceMeter(self.limits.budget, self.costs, self.clock)
        wrote = written_bytes()
        usage = self.store.usage()
        self._watch(usage.used_bytes, meter.started)
        need = self.pressure.need(usage.used_bytes, usage.collectable_bytes)
        short = self._keep_free_space(meter)
        if short > 0:
            # Less what collection is about to free anyway.
            need = max(need, short - usage.collectable_bytes - self.store.unlinking.bytes)
        if self._resweep and meter.started >= self._resweep_at:
            # One unit while evicting: a unit at 10 M rows takes most of a slice.
            for _ in range(1 if need > 0 else len(self._resweep)):
                if not self._resweep or not (meter.fresh or meter.affordable(SWEEP, 1)):
                    break
                begun = meter.now()
                self.store.sweep([self._resweep.popleft()])
                meter.spend(SWEEP, 1, 0, meter.now() - begun)
        collected = CollectResult(0, 0)
        # Deferred punches fall due with nothing else left to collect (after an episode):
        # they are collection's work too, or their blocks stay in packs until the next.
        waiting = self.store.unlinking
        if (usage.collectable_objects or waiting.objects or self.store.punches_due
                or (short and waiting.bytes)):
            rows = COLLECT_ROWS if usage.collectable_objects else 0
            collected = self.store.collect(rows, meter, urgent=short > 0)
        evicted = EvictResult()
        if need > 0:
            evicted = self.store.evict(meter, self.plan, need, self._take_requests)
            requests = 0
        else:
            requests = self._take_requests()
            self.store.flush_touches()
        for key, generation in self._quarantines:
            self.store.verify_and_quarantine(key, generation, "failed verification in a restore")
        self._quarantines = []
        # Any unit of work counts (a punch too, which no result above reports): a slice
        # that did some is paced and measured like any other.
        if meter.fresh and not requests:
            return False
        end = self.clock()
        io = collected.bytes + written_bytes() - wrote
        # The duty counts work: the slice's lock waits are taken off its start.
        self.pacing.record(meter.started + meter.waited, end, io)
        self.slice_last_s = meter.worked_s(end)
        self.slice_max_s = max(self.slice_max_s, self.slice_last_s)
        if self.slice_last_s > OVERRUN_WARN * self.limits.budget.seconds:
            seconds, kind, units = meter.slowest
            self._rare.warning("overrun", "a slice took %.1f ms against its budget of %.0f "
                               "ms; its longest step: %d %s unit(s) in %.1f ms",
                               self.slice_last_s * 1e3, self.limits.budget.seconds * 1e3,
                               units, kind or "no metered", seconds * 1e3)
        self.life.timed(self.slice_last_s)
        t = self.totals
        t["evicted_roots"] += len(evicted.removed)
        t["cut_roots"] += evicted.cut
        t["skipped_roots"] += evicted.skipped
        t["reclaimed_bytes"] += evicted.reclaimed_bytes
        t["collected_objects"] += collected.objects
        t["collected_bytes"] += collected.bytes
        t["io_bytes"] += io
        t["yielded_roots"] += evicted.yielded_roots
        t["yielded_bytes"] += evicted.yielded_bytes
        t["read_yielded_roots"] += evicted.read_yielded
        self.life.processed += 1
        return True

    def _disk_full(self, exc: Exception) -> None:
        """A slice failed on a full disk: counted, the ballast given up for the next
        slice's index writes, and the plan started afresh (its transaction rolled back,
        or may have: the victims' page counts it holds may be ahead of the index)."""
        self.plan.restart()
        self.life.disk_full_error("a maintenance slice", exc)
        self.ballast.release()
        self._ballast_at = self.clock() + BALLAST_RETAKE_S

    def _keep_free_space(self, meter: SliceMeter) -> int:
        """The free-space reserve (docs/store.md, "A full disk"): the bytes this rank is
        still to free for the store's filesystem to have ``min_free_bytes`` free, after
        giving back the pool's files (they free space and evict nothing; while short,
        collection unlinks what it frees rather than pooling it). With the reserve
        holding and room beside it, the ballast is taken (again)."""
        self.space = self.store.space()
        short = reserve_shortfall(self.space, self.cfg.min_free_bytes, self.cfg.ranks)
        pool = self.store.pool
        if pool is not None:
            pool.suspended = short > 0
            if short:
                begun = meter.now()
                released = pool.release(short)
                # Counted only if it freed something: a unit spent on an empty pool in
                # every slice left none fresh, and a unit that no slice's time affords
                # (an unlink learnt at 25 ms on a loaded machine, against a 20 ms budget)
                # runs only in a fresh one: the collected files were never unlinked, and
                # the reserve waited for them forever.
                if released:
                    meter.spend(SPACE, 1, released, meter.now() - begun)
                short -= released
        if (not short and self.ballast.size and meter.started >= self._ballast_at
                and self.space.free_bytes >= self.cfg.min_free_bytes + self.ballast.size
                and not self.ballast.present):
            begun = meter.now()
            self.ballast.take()
            meter.spend(SPACE, 1, 0, meter.now() - begun)
        return max(0, short)

    def _sync_collected(self) -> None:
        """Make the slice's collection durable, after the slice: the fsync waits for the
        disk with no lock held and no CPU used, so it is no part of a slice's work, and
        the files it frees go in the next slice. Timed apart (``index_sync_*``)."""
        begun = self.clock()
        if self.store.sync_collected():
            took = self.clock() - begun
            self.index_sync_s += took
            self.index_sync_max_s = max(self.index_sync_max_s, took)

    def report(self) -> None:
        """The backlog into the stats slot (read at once by the client's admission and by
        ``sparkcache status``), then a beat."""
        usage = self.store.usage()
        waiting = self.store.unlinking  # rows deleted, files not unlinked yet
        now = self.clock()
        used = usage.used_bytes
        self._watch(used, now)
        self.hard_cap.update(used, now)
        self.life.used_bytes = used
        self.life.backlog = max(0, used - self.cfg.low_watermark_bytes)
        self.life.report.update(
            over_max_bytes=max(0, used - self.cfg.max_bytes),
            episode_since=self._wall(self.pressure.since, now),
            selected_roots=self.plan.roots, selected_bytes=self.plan.bytes,
            collectable_objects=usage.collectable_objects + waiting.objects,
            collectable_bytes=usage.collectable_bytes + waiting.bytes,
            slice_last_s=self.slice_last_s, slice_max_s=self.slice_max_s,
            index_sync_s=self.index_sync_s, index_sync_max_s=self.index_sync_max_s,
            duty=self.pacing.duty.used(now),
            refusing_since=self._wall(self.hard_cap.since, now),
            refused_s=self.hard_cap.total_s, entries=usage.entries,
            pooled_bytes=self._pooled(now), **self._leased(now), **self.totals,
            read_releases=self.store.counters.read_releases,
            free_bytes=self.space.free_bytes,
        )
        self.life.beat()

    def _pooled(self, now: float) -> int:
        """The pool's bytes, listed at most once a second: a report follows every slice."""
        pool = self.store.pool
        if pool is not None and now - self._pool_read_at >= POOL_READ_S:
            self.pooled_bytes = pool.pooled_bytes()
            self._pool_read_at = now
        return self.pooled_bytes

    def _leased(self, now: float) -> dict[str, int]:
        """The roots under a running conversation lease and their bytes, counted at most
        once a second: a walk of those roots, outside any slice."""
        if now - self._leased_read_at >= LEASED_READ_S:
            self.leased_roots, self.leased_bytes = self.store.leased()
            self._leased_read_at = now
        return {"leased_roots": self.leased_roots, "leased_bytes": self.leased_bytes}

    def _watch(self, used: int, now: float) -> None:
        """The watermarks seen at ``now``; a new episode considers every root again."""
        calm = self.pressure.since is None
        if self.pressure.update(used, now) and calm:
            self.plan.restart()

    @staticmethod
    def _wall(since: float | None, now: float) -> float:
        """A time of the policy's clock as ``time.time()``; 0 for none."""
        return 0.0 if since is None else time.time() - (now - since)

    def _take_requests(self) -> int:
        """Move every request in the rings into the store's batch (or the quarantine list);
        the number taken. Drains what the rings held when it began (``_take_from``):
        under the gate, what a finished lookup pushed must be in the batch. Releases go
        to the store last: a lease and its release may come by different rings (the
        scheduler's ``lease``, the engine's ``request``), and a lease pushed before its
        release is taken in this drain at the latest (``request`` is drained first), so
        the store never meets a release before its lease, even where a batch is written
        in the middle of the drain."""
        releases: list[int] = []
        taken = sum(self._take_from(ring, releases) for ring in self.requests)
        for lease in releases:
            self.store.record_release(lease)
        return taken

    def _take_from(self, ring: Consumer, releases: list[int]) -> int:
        """Take at most a ring's capacity of requests: all it held when the drain began,
        and no more, so that an engine pushing without pause cannot hold the write lock
        and the gate for as long as it goes on."""
        taken = 0
        while taken < ring.capacity:
            try:
                batch = ring.pop_batch(min(4096, ring.capacity - taken), timeout=0)
            except (RingEmpty, RingClosed, SignalError):
                return taken
            lifecycle.checkpoint("maintenance.requests")
            now = time.time()
            for kind, _, hi, lo, arg, lease, when, seconds in batch.tolist():
                taken += 1
                reason = self._check(kind, arg, lease, when, seconds, now)
                if reason is not None:
                    self.life.drop("request", f"request of kind {kind} ({reason})")
                    continue
                if kind == RequestKind.RELEASE:
                    releases.append(lease)
                    continue
                key = join_key(hi, lo)
                if kind == RequestKind.TOUCH:
                    self.store.record_access(key, arg, when)
                elif kind == RequestKind.LEASE:
                    self.store.record_lease(key, arg, when, when + seconds, lease)
                else:
                    self._quarantines.append((key, f"{arg:016x}"))
        return taken

    @staticmethod
    def _check(kind: int, arg: int, lease: int, when: float, seconds: float,
               now: float) -> str | None:
        """Why a request is malformed, or None."""
        if kind not in RequestKind.__members__.values():
            return "unknown kind"
        if kind == RequestKind.QUARANTINE:
            return None  # any 64 bits name a generation; an unknown object is ignored
        if kind == RequestKind.RELEASE:
            return None if lease else "release of lease 0"
        if arg >= _MAX_POS:
            return f"page position {arg}"
        if not (math.isfinite(when) and 0 < when <= now + _FUTURE_SLACK_S):
            return "access time"
        if kind == RequestKind.LEASE and not (math.isfinite(seconds) and 0 < seconds <= 3600):
            return "lease seconds"
        return None


def _body(life: Lifecycle) -> None:
    m = Maintenance(life)
    try:
        m.run()
    finally:
        m.close()


def run(spec: WorkerSpec) -> None:
    lifecycle.main(spec, _body)
