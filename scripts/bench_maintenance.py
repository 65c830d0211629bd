"""Benchmark of maintenance at the store's cap: what it costs the commits, measured in one
run on one disk.

A writer in this process commits publications at a steady rate (conversations: each turn
adds ``--pages`` fresh pages to a conversation that shares a system prompt with the others,
and supersedes its previous turn's root), timing every ``PageStore.commit``, in three
scenarios, each on a fresh store:

* empty: an empty store with room to spare; the maintenance worker runs and has nothing
  to evict (``commit_p50_empty_s``, ``commit_p99_empty_s``);
* full: the store filled to ``max_bytes`` before the writer starts, so it stays at its cap
  for the whole run, the real maintenance worker process evicting and collecting in
  budgeted, paced slices, its collected files pooled for the writer's commits to
  overwrite (``commit_p99_full_s``, ``full_vs_empty_p99``, target <= 1.5;
  ``recycled_share_full``: the share of the writer's files, a pack per turn, written
  over a pooled one);
* baseline: the same, with the predecessor's maintenance instead, in its own process:
  every pass scans and sorts the whole inventory, removes roots down to the low
  watermark in one transaction, then collects every unreferenced object, unlinking its
  file, and passes run back to back while used bytes are above ``max_bytes``: no
  budget, no pause (``commit_p99_baseline_s``, ``baseline_vs_empty_p99``).

The conversations the writer keeps going fit under the low watermark, as a store sized
for its traffic holds them (``live_bytes_max``: every one of them at its last turn, against
``low_watermark_bytes``): what maintenance evicts is conversations that have ended. In a
store too small for them (``--conversations 16`` at the default cap: up to 544 MiB of
live conversations under a 384 MiB watermark; the bench warns) eviction takes live ones
too, and the next turn of each writes its evicted turns again, 2 to 8 turns' pages in one
commit: 2-3 % of that store's commits, so its p99 is such a rewrite's, against an
ordinary turn's in the empty store. So each scenario also gives the p99 of the ordinary
turns alone, the commits that wrote exactly ``--pages`` pages
(``commit_p99_<scenario>_turns_s``, ``full_vs_empty_p99_turns``,
``baseline_vs_empty_p99_turns``: the same commit, slowed or not by maintenance beside it),
and how many commits wrote more (``rewrites_<scenario>``).

With ``--leased-at-cap``, one more scenario after the rounds, on its own (no ratio):

* leased: the store filled to ``max_bytes`` with the default lease (``lease_seconds``,
  300 s, or ``--set lease_seconds=...``), and the writer publishing at once, so every root
  is still leased as the store fills past its cap far faster than leases run out; each
  publication admitted as the engine's client admits one (refused as ``store_full`` while
  the used bytes maintenance last reported stand at the hard cap, read at most every
  ``ADMISSION_READ_S``): ``refused_publications_at_cap`` (target 0) of
  ``publications_at_cap``, and the roots maintenance evicted while their lease still ran
  (``yielded_roots_at_cap``; docs/maintenance.md, "Leases at the cap").

The scenarios run in alternating rounds (``--rounds``), so drift in a shared disk's speed
falls on each alike. Both kinds of maintenance run as the supervisor starts maintenance
(nice 10, best-effort I/O at its lowest level). From the full runs: the longest slice the
worker reported (``max_slice_ms``) against its budget (``slice_budget_ms``), the longest
fsync of the index it made between slices to make a slice's collection durable
(``max_index_sync_ms``; no lock held, no part of a slice), its CPU time
over the runs' wall time (``maintenance_cpu_share``) against the duty cap (``duty_cap``),
the bytes it collected per second (``reclaim_bytes_per_s``) against the bytes the writer
published (``publish_bytes_per_s``), and how long publications were refused at the hard
cap; each commit's wait for the index's write lock (``commit_lock_wait_*``).
First, what one unit of maintenance's work costs on the same disk (``unit_*``: a small
transaction, dropping a page reference, collecting an object), which its defaults are
chosen from.

Usage: ``python scripts/bench_maintenance.py [--json] [--dir D] [--seconds S] ...``
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import multiprocessing as mp
import os
import random
import shutil
import signal
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import psutil
from sparkcache.workers.lifecycle import Role, State, WorkerSpec, run_worker

from sparkcache import config, segments
from sparkcache.maintenance_policy import CostModel, SliceBudget, SliceMeter
from sparkcache.store import PageData, PageStore, Root
from sparkcache.store.eviction import EvictionPlan

MIB = 1 << 20
# What the supervisor gives maintenance under a supervisor at nice 0
# (sparkcache.supervisor.MAINTENANCE_NICE_STEP; not imported: that module loads torch, and
# so would every process spawned from here).
NICE = 10
# How long the engine's client trusts the used bytes it read before admitting a
# publication (sparkcache.client.HEALTH_CACHE_S; not imported: that module loads torch).
ADMISSION_READ_S = 0.25


@dataclass
class Conversations:
    """Conversations of a steady writer: turn after turn, each adds ``pages`` fresh pages to
    one of ``active`` conversations (all opened by the same system prompt); one that has had
    ``turns`` turns is replaced by a new one."""

    pages: int
    active: int
    turns: int
    prompt: list[str]
    rng: random.Random = field(default_factory=lambda: random.Random(1))
    convs: list[list[str]] = field(default_factory=list)
    ages: list[int] = field(default_factory=list)

    def next_turn(self) -> tuple[str, list[str]]:
        if len(self.convs) < self.active:
            self.convs.append(list(self.prompt))
            self.ages.append(0)
            i = len(self.convs) - 1
        else:
            i = self.rng.randrange(self.active)
            if self.ages[i] >= self.turns:
                self.convs[i], self.ages[i] = list(self.prompt), 0
        self.convs[i] += [os.urandom(16).hex() for _ in range(self.pages)]
        self.ages[i] += 1
        return os.urandom(16).hex(), list(self.convs[i])


def make_root(root_id: str, keys: list[str], page: bytes) -> Root:
    # Every page the same bytes: only the delta is written, and its contents do not matter.
    return Root(root_id, [PageData(k, page) for k in keys])


def percentile(samples: list[float], q: float) -> float:
    ordered = sorted(samples)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def lower_priority(pid: int) -> None:
    """As the supervisor lowers maintenance (``sparkcache.supervisor._spawn``), relative to
    this process (the writer), which may run niced itself."""
    p = psutil.Process(pid)
    p.nice(min(19, os.nice(0) + NICE))
    try:
        p.ionice(psutil.IOPRIO_CLASS_BE, 7)
    except (psutil.Error, AttributeError):
        pass


def baseline(store_dir: str, max_bytes: int, low: int, lease_s: float) -> None:
    """The predecessor's maintenance (see the module doc), until SIGTERM."""
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    store = PageStore(store_dir, 0, lease_seconds=lease_s)
    conn = store._wconn
    while not stop:
        usage = store.usage()
        if usage.used_bytes <= max_bytes:
            time.sleep(0.2)
            continue
        # The unary + keeps SQLite off the LRU index: a scan and a sort of every root.
        victims, freed = [], 0
        for root_id, nbytes in conn.execute(
                "SELECT id, bytes FROM roots WHERE +lease_until <= ? "
                "ORDER BY +lease_until, last_access", (time.time(),)).fetchall():
            if usage.used_bytes - freed <= low:
                break
            victims.append(root_id)
            freed += nbytes
        store.remove_roots(victims)
        store.collect(1 << 30)
    store.close()


@dataclass
class Run:
    commits: list[float]
    lock_waits: list[float]  # of each commit, for the index's write lock
    published: int
    seconds: float
    cpu_s: float = 0.0  # the maintenance process's
    # From the maintenance worker's stats: the longest slice, bytes collected, seconds at
    # the hard cap, roots evicted.
    slice_max_s: float = 0.0
    collected: int = 0
    refused_s: float = 0.0
    evicted: int = 0
    # Page files the writer wrote, and how many of them over a pooled file (store/pool.py).
    files: int = 0
    recycled: int = 0
    written_pages: list[int] = field(default_factory=list)  # of each commit
    # The longest fsync of the index after a slice that collected (outside slices).
    index_sync_max_s: float = 0.0
    refused: int = 0  # publications refused at the hard cap (only when admission is on)
    yielded: int = 0  # roots maintenance evicted while their lease still ran

    def __add__(self, other: Run) -> Run:
        """Two rounds of one scenario as one."""
        return Run(self.commits + other.commits, self.lock_waits + other.lock_waits,
                   self.published + other.published, self.seconds + other.seconds,
                   self.cpu_s + other.cpu_s, max(self.slice_max_s, other.slice_max_s),
                   self.collected + other.collected, self.refused_s + other.refused_s,
                   self.evicted + other.evicted, self.files + other.files,
                   self.recycled + other.recycled, self.written_pages + other.written_pages,
                   max(self.index_sync_max_s, other.index_sync_max_s),
                   self.refused + other.refused, self.yielded + other.yielded)

    def turns_of(self, pages: int) -> list[float]:
        """The commit times of the turns that wrote exactly ``pages`` pages."""
        return [t for t, n in zip(self.commits, self.written_pages, strict=True) if n == pages]


def admission(segs: segments.RankSegments, hard_cap: int) -> Callable[[], bool]:
    """Whether a publication is taken now, as the engine's client decides (its
    ``store_full``): the used bytes maintenance reported, read at most every
    ``ADMISSION_READ_S``, below the hard cap."""
    read_at, full = float("-inf"), False

    def admit() -> bool:
        nonlocal read_at, full
        now = time.monotonic()
        if now - read_at >= ADMISSION_READ_S:
            read_at = now
            full = segs.stats.read(int(Role.MAINTENANCE)).used_bytes >= hard_cap
        return not full

    return admit


def write(store: PageStore, convs: Conversations, page: bytes, rate: float,
          seconds: float, admit: Callable[[], bool] = lambda: True) -> Run:
    """Commit a turn every 1/rate s (never catching up in bursts) for ``seconds``; a turn
    ``admit`` refuses is counted, not committed."""
    period, commits, waits, published, files, sizes = 1.0 / rate, [], [], 0, 0, []
    refused = 0
    taken = store.pool.taken_files if store.pool else 0
    start = time.monotonic()
    due = start
    while (now := time.monotonic()) < start + seconds:
        if now < due:
            time.sleep(due - now)
        root_id, keys = convs.next_turn()
        if not admit():
            refused += 1
            due = max(due + period, time.monotonic())
            continue
        waited = store.counters.lock_wait_s
        t0 = time.perf_counter()
        result = store.commit(make_root(root_id, keys, page))
        commits.append(time.perf_counter() - t0)
        waits.append(store.counters.lock_wait_s - waited)
        published += result.bytes_written
        sizes.append(result.pages_written)
        files += result.pages_written > 0  # a turn's new pages are one file, its pack
        due = max(due + period, time.monotonic())
    recycled = (store.pool.taken_files if store.pool else 0) - taken
    return Run(commits, waits, published, time.monotonic() - start, files=files,
               recycled=recycled, written_pages=sizes, refused=refused)


def fill(store: PageStore, convs: Conversations, page: bytes, upto: int) -> None:
    while store.usage().used_bytes + convs.pages * len(page) <= upto:
        root_id, keys = convs.next_turn()
        store.commit(make_root(root_id, keys, page))


def start_worker(cfg: config.Config, segs: segments.RankSegments,
                 ctx: mp.context.SpawnContext) -> mp.process.BaseProcess:
    proc = ctx.Process(target=run_worker,
                       args=(WorkerSpec(cfg, 0, Role.MAINTENANCE, os.getpid()),))
    proc.start()
    lower_priority(proc.pid)
    deadline = time.monotonic() + 60
    while True:
        rec = segs.stats.read(int(Role.MAINTENANCE))
        if rec is not None and rec.pid == proc.pid and rec.state == State.READY:
            return proc
        if time.monotonic() > deadline or not proc.is_alive():
            proc.kill()
            raise RuntimeError("the maintenance worker did not start")
        time.sleep(0.02)


def stop(proc: mp.process.BaseProcess) -> None:
    proc.terminate()
    proc.join(30)
    if proc.is_alive():
        proc.kill()
        proc.join()
        raise RuntimeError(f"maintenance process {proc.pid} did not stop")


def scenario(work: Path, name: str, args: argparse.Namespace, page: bytes,
             ctx: mp.context.SpawnContext) -> Run:
    store_dir = work / name
    full = name != "empty"
    leased = name == "leased"
    max_bytes = args.max_mib * MIB if full else 1 << 50
    cfg = config.load(env={}, overrides={
        "store_dir": str(store_dir), "instance": "b" + uuid.uuid4().hex[:12],
        "max_bytes": str(max_bytes), "low_watermark_bytes": str(args.low_mib * MIB),
        "lease_seconds": str(args.lease_s), "capture_slots": "1",
        "capture_slot_bytes": "1MiB", **args.settings,
    })
    if leased:
        cfg = dataclasses.replace(cfg, lease_seconds=args.cap_lease_s)
    convs = Conversations(args.pages, args.conversations, args.turns,
                          [os.urandom(16).hex() for _ in range(args.prompt_pages)])
    store = PageStore(store_dir, 0, lease_seconds=cfg.lease_seconds)
    segs = segments.RankSegments.create(cfg, 0, len(Role))
    proc = None
    try:
        if full:
            fill(store, convs, page, max_bytes)
        if full and not leased:
            time.sleep(args.lease_s)  # what the fill published is evictable now
        if name == "baseline":
            proc = ctx.Process(target=baseline, args=(str(store_dir), max_bytes,
                                                      args.low_mib * MIB, args.lease_s))
            proc.start()
            lower_priority(proc.pid)
        else:
            proc = start_worker(cfg, segs, ctx)
        before = psutil.Process(proc.pid).cpu_times()
        report0 = segs.stats.read(int(Role.MAINTENANCE))
        admit = admission(segs, cfg.hard_cap_bytes) if leased else (lambda: True)
        run = write(store, convs, page, args.rate, args.seconds, admit)
        after = psutil.Process(proc.pid).cpu_times()
        run.cpu_s = (after.user + after.system) - (before.user + before.system)
        if name != "baseline":
            report = segs.stats.read(int(Role.MAINTENANCE))
            run.slice_max_s = report.slice_max_s
            run.index_sync_max_s = report.index_sync_max_s
            run.collected = report.collected_bytes - report0.collected_bytes
            run.refused_s = report.refused_s - report0.refused_s
            run.evicted = report.evicted_roots - report0.evicted_roots
            run.yielded = report.yielded_roots - report0.yielded_roots
        stop(proc)
        proc = None
    finally:
        if proc is not None:
            proc.kill()
            proc.join()
        store.close()
        segs.close()
        shutil.rmtree(store_dir)
    return run


def unit_costs(work: Path, page: bytes, roots: int = 16, pages: int = 32) -> dict[str, float]:
    """What one unit of maintenance's work costs on this disk, the figures its defaults
    come from (docs/maintenance.md): a small write transaction as eviction commits it
    (unsynced), dropping one page reference from a root (index rows, one transaction per
    root), and collecting one object (its row, in one synced transaction for all, and
    unlinking its file)."""
    with PageStore(work / "units", 0, lease_seconds=0) as store:
        chains = []
        for _ in range(roots):
            keys = [os.urandom(16).hex() for _ in range(pages)]
            store.commit(make_root(os.urandom(16).hex(), keys, page))
            chains.append(keys)
        txn, evict = [], []
        for keys in chains:
            store.record_access(keys[-1], pages - 1, time.time())
            t0 = time.perf_counter()
            store.flush_touches()
            txn.append(time.perf_counter() - t0)
        for _ in chains:
            meter = SliceMeter(SliceBudget(1, 1 << 62, 60.0), CostModel(), time.monotonic)
            t0 = time.perf_counter()
            store.evict(meter, EvictionPlan(), 1 << 62)
            evict.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        collected = store.collect(1 << 30).objects
        collect_s = time.perf_counter() - t0
    return {
        "unit_txn_ms": statistics.median(txn) * 1000,
        "unit_drop_page_us": (statistics.median(evict) - statistics.median(txn)) / pages * 1e6,
        "unit_collect_us": collect_s / collected * 1e6,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--dir", type=Path, help="directory on the disk to measure")
    parser.add_argument("--seconds", type=float, default=20.0,
                        help="writing per scenario and round")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the three scenarios")
    parser.add_argument("--rate", type=float, default=16.0, help="publications per second")
    parser.add_argument("--pages", type=int, default=16, help="fresh pages per publication")
    parser.add_argument("--page-kib", type=int, default=256)
    parser.add_argument("--conversations", type=int, default=8,
                        help="active at once (all of them at most live_bytes_max)")
    parser.add_argument("--turns", type=int, default=8, help="turns of a conversation")
    parser.add_argument("--prompt-pages", type=int, default=8, help="shared system prompt")
    parser.add_argument("--max-mib", type=int, default=512, help="max_bytes of the full runs")
    parser.add_argument("--low-mib", type=int, default=384, help="low watermark")
    parser.add_argument("--lease-s", type=float, default=2.0, help="a new root's lease")
    parser.add_argument("--leased-at-cap", action="store_true",
                        help="one more scenario: the store at its cap with the default "
                        "lease, publications admitted as the client admits them")
    parser.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE",
                        help="a setting of the maintenance worker, e.g. maintenance_slice_ms=50")
    args = parser.parse_args()
    args.settings = dict(item.split("=", 1) for item in args.set)
    settings = config.load(env={}, overrides=args.settings, check_store_dir=False)
    args.cap_lease_s = settings.lease_seconds
    page = os.urandom(args.page_kib * 1024)
    live_max = args.conversations * (args.prompt_pages + args.turns * args.pages) * len(page)
    if live_max > args.low_mib * MIB:
        print(f"bench_maintenance: the live conversations reach {live_max / MIB:.0f} MiB, "
              f"above the {args.low_mib} MiB low watermark: eviction takes live ones, "
              "and their rewrites set the full store's p99 (see rewrites_full)",
              file=sys.stderr)
    ctx = mp.get_context("spawn")
    work = Path(tempfile.mkdtemp(prefix="sparkcache-bench-", dir=args.dir))
    try:
        units = unit_costs(work, page)
        runs: dict[str, Run] = {}
        rounds: dict[str, list[float]] = {}  # each round's p99, to show the spread
        # Rounds alternate the scenarios, so that drift in a shared disk's speed falls on
        # each alike.
        for _ in range(args.rounds):
            for name in ("empty", "full", "baseline"):
                run = scenario(work, name, args, page, ctx)
                runs[name] = runs[name] + run if name in runs else run
                rounds.setdefault(name, []).append(round(percentile(run.commits, 0.99), 4))
        at_cap = scenario(work, "leased", args, page, ctx) if args.leased_at_cap else None
    finally:
        shutil.rmtree(work)
    empty, full, base = runs["empty"], runs["full"], runs["baseline"]
    p99 = {name: percentile(run.commits, 0.99) for name, run in runs.items()}
    turns = {name: run.turns_of(args.pages) for name, run in runs.items()}
    p99_turn = {name: percentile(t, 0.99) for name, t in turns.items()}
    result = {
        "commits_per_scenario": min(len(r.commits) for r in runs.values()),
        "commit_p50_empty_s": statistics.median(empty.commits),
        "commit_p99_empty_s": p99["empty"],
        "commit_p50_full_s": statistics.median(full.commits),
        "commit_p99_full_s": p99["full"],
        "commit_p50_baseline_s": statistics.median(base.commits),
        "commit_p99_baseline_s": p99["baseline"],
        "full_vs_empty_p99": p99["full"] / p99["empty"],
        "baseline_vs_empty_p99": p99["baseline"] / p99["empty"],
        **{f"commit_p99_{name}_by_round_s": r for name, r in rounds.items()},
        **{f"commit_p99_{name}_turns_s": p99_turn[name] for name in runs},
        "full_vs_empty_p99_turns": p99_turn["full"] / p99_turn["empty"],
        "baseline_vs_empty_p99_turns": p99_turn["baseline"] / p99_turn["empty"],
        **{f"rewrites_{name}": len(run.commits) - len(turns[name]) for name, run in runs.items()},
        "commit_lock_wait_p99_full_s": percentile(full.lock_waits, 0.99),
        "commit_lock_wait_max_full_s": max(full.lock_waits),
        "commit_lock_wait_p99_baseline_s": percentile(base.lock_waits, 0.99),
        "commit_lock_wait_max_baseline_s": max(base.lock_waits),
        "max_slice_ms": full.slice_max_s * 1000,
        "slice_budget_ms": settings.maintenance_slice_ms,
        "max_index_sync_ms": full.index_sync_max_s * 1000,
        "maintenance_cpu_share": full.cpu_s / full.seconds,
        "duty_cap": settings.maintenance_duty,
        "baseline_cpu_share": base.cpu_s / base.seconds,
        "reclaim_bytes_per_s": full.collected / full.seconds,
        "publish_bytes_per_s": full.published / full.seconds,
        "refused_s_full": full.refused_s,
        "evicted_roots_full": full.evicted,
        "recycled_share_full": full.recycled / max(1, full.files),
        "recycled_share_baseline": base.recycled / max(1, base.files),
        "page_bytes": len(page),
        "live_bytes_max": live_max,
        "low_watermark_bytes": args.low_mib * MIB,
        **units,
    }
    if at_cap is not None:
        result |= {
            "lease_s_at_cap": args.cap_lease_s,
            "publications_at_cap": len(at_cap.commits) + at_cap.refused,
            "refused_publications_at_cap": at_cap.refused,
            "refused_s_at_cap": at_cap.refused_s,
            "evicted_roots_at_cap": at_cap.evicted,
            "yielded_roots_at_cap": at_cap.yielded,
            "commit_p99_at_cap_s": percentile(at_cap.commits, 0.99),
        }
    result = {k: round(v, 4) if isinstance(v, float) else v for k, v in result.items()}
    if args.json:
        print(json.dumps(result))
    else:
        for key, value in result.items():
            print(f"{key:>32}: {value}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
