"""One lane of a soak: a fresh store and its SparkCache (or the inline model, or none),
idle probes, the soak of conversations, the same probes again, then everything stopped
and the figures gathered."""

from __future__ import annotations

import functools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparkcache import exit_signal
from sparkcache.shm.segment import instance_entries
from sparkcache.soak import engine as engine_mod
from sparkcache.soak.aging import age_store, aged_conversations, seed_store
from sparkcache.soak.backend import NullBackend, ServiceBackend
from sparkcache.soak.control import ControlEngine
from sparkcache.soak.engine import SoakEngine, StepRecord
from sparkcache.soak.inline import InlineStore
from sparkcache.soak.model import ToyModel
from sparkcache.soak.params import LANES, Lane, SoakParams
from sparkcache.soak.remover import StoreRemover
from sparkcache.soak.service import Service, StatsSample, settings
from sparkcache.soak.stats import bucket_quantile, percentile
from sparkcache.soak.workload import ProbeResult, run_conversations, run_probe

log = logging.getLogger(__name__)

DRAIN_TIMEOUT_S = 60.0
# A probe during which other processes took more than this share of the engine's core,
# in a lane where none of them can be SparkCache's, is repeated, PROBE_RETRIES times at
# most (see _host_took_core).
FOREIGN_BUSY_MAX = 0.1
PROBE_RETRIES = 2
Progress = Callable[[str, float], None]  # (what the lane is doing, share of it done)


@dataclass
class LaneResult:
    lane: str
    before: list[ProbeResult]
    after: list[ProbeResult]
    steps: list[StepRecord]
    timeline: list[dict[str, float | str]]
    probe_repeats: dict[str, int] = field(default_factory=dict)  # by phase
    figures: dict[str, object] = field(default_factory=dict)


def kv_blocks(params: SoakParams) -> int:
    """Blocks for every conversation's turn twice over (the next turn's blocks while the
    store still holds the last one's) and two probes."""
    page = params.page_tokens
    turn = -(-(params.context_max + params.turn_decode_tokens + page) // page)
    probe = -(-(params.probe_tokens + params.probe_decode_tokens) // page)
    return (2 * params.conversations + 1) * turn + 2 * probe


def slot_bytes(params: SoakParams) -> int:
    """A capture slot holds a whole conversation: after an eviction a turn may have to
    copy every page of it again."""
    page = params.page_tokens
    return (-(-(params.context_max + params.turn_decode_tokens) // page) + 1) * \
        engine_mod.page_bytes(page)


class _Timeline:
    """Samples every quarter second: the store's figures and the engine's steps since
    the last sample."""

    def __init__(self, engine: SoakEngine, service: Service | None,
                 inline: InlineStore | None) -> None:
        self.engine, self.service, self.inline = engine, service, inline
        self.t0 = time.perf_counter()
        self.rows: list[dict[str, float | str]] = []
        self.samples: list[StatsSample] = []
        self._step_at = 0
        self._commit_at = 0
        self._pass_s = 0.0

    def tick(self) -> None:
        steps = self.engine.steps[self._step_at:]
        self._step_at = len(self.engine.steps)
        ms = [s.ms for s in steps]
        row: dict[str, float | str] = {
            "t_s": round(time.perf_counter() - self.t0, 3), "phase": self.engine.phase,
            "steps": len(ms), "step_p50_ms": percentile(ms, 50),
            "step_p99_ms": percentile(ms, 99), "step_max_ms": max(ms, default=0.0),
        }
        if self.service is not None:
            sample = self.service.sample()
            if sample is not None:
                last = self.samples[-1] if self.samples else None
                self.samples.append(sample)
                n = sample.commits - (last.commits if last else 0)
                took = sample.commit_sum_s - (last.commit_sum_s if last else 0.0)
                row.update(used_bytes=sample.used_bytes, evicted_roots=sample.evicted_roots,
                           reclaimed_bytes=sample.reclaimed_bytes, commits=n,
                           commit_mean_s=took / n if n else 0.0)
        elif self.inline is not None:
            st = self.inline.stats
            new = st.commit_durations[self._commit_at:]
            self._commit_at = len(st.commit_durations)
            row.update(used_bytes=st.used_bytes, evicted_roots=st.evicted_roots,
                       reclaimed_bytes=st.reclaimed_bytes, commits=len(new),
                       commit_mean_s=sum(d for _, d in new) / len(new) if new else 0.0,
                       maintenance_s=round(st.pass_s - self._pass_s, 4))
            self._pass_s = st.pass_s
        self.rows.append(row)


def run_lane(name: str, params: SoakParams, model: ToyModel, workdir: Path,
             all_cores: list[int], progress: Progress, remover: StoreRemover,
             control: ControlEngine | None = None) -> LaneResult:
    """Run lane ``name``; its store is handed to ``remover`` at the end, and the removal
    of the lane before it ends before anything of this one is measured."""
    lane = LANES[name]
    store_dir = workdir / name
    store_dir.mkdir(mode=0o700, parents=True)
    instance = f"soak{os.getpid()}{list(LANES).index(name)}"
    engine = SoakEngine(instance, params.page_tokens, kv_blocks(params), model)
    service: Service | None = None
    inline: InlineStore | None = None
    supervisor_exit: int | None = None
    age: Callable[[], int] | None = None  # fills a read-write lane's store (soak.aging)
    try:
        progress("starting", 0.0)
        if lane.placement in ("isolated", "unpinned"):
            cpus = ([c for c in all_cores if c != params.engine_core]
                    if lane.placement == "isolated" else all_cores)
            if lane.access_mode == "restore-only":
                seed_store(store_dir, params, engine.namespace)
            else:
                age = functools.partial(age_store, store_dir, params, engine.namespace)
            env = settings(params, store_dir, instance, lane.access_mode, cpus,
                           slot_bytes(params))
            service = Service.start(env, workdir / f"{name}.supervisor.log")
            engine.backend = ServiceBackend(service.cfg, engine.tensors, engine_mod.MODEL_ID)
        elif lane.placement == "inline":
            inline = InlineStore(store_dir, engine.views, params.max_bytes,
                                 params.low_watermark_bytes)
            age = functools.partial(inline.age, aged_conversations(params, engine.namespace))
            engine.backend = inline
        else:
            engine.backend = NullBackend()
        timeline = _Timeline(engine, service, inline)
        started = time.perf_counter()
        repeats: dict[str, int] = {}

        def probes(phase: str) -> list[ProbeResult]:
            out = []
            for i in range(params.probes):
                exit_signal.exit_if_signalled()
                progress(f"probe {phase} {i + 1}/{params.probes}", 0.0)
                for attempt in range(1 + PROBE_RETRIES):
                    probe = run_probe(engine, params, engine.namespace, phase, i,
                                      control=control)
                    timeline.tick()
                    if not _host_took_core(lane, probe) or attempt == PROBE_RETRIES:
                        break
                    repeats[phase] = repeats.get(phase, 0) + 1
                out.append(probe)
            return out

        remover.wait()
        # One probe not counted: the first requests of a process pay for its warm-up.
        run_probe(engine, params, engine.namespace, "warmup", 0, control=control)
        before = probes("before")
        # The time at the cap before the after-probes, most of it at once (soak.aging).
        progress("aging the store", 0.0)
        aged = age() if age is not None else 0
        until = time.perf_counter() + params.duration_s
        soak_start = time.perf_counter()

        def tick() -> None:
            timeline.tick()
            progress("soak", min(1.0, (time.perf_counter() - soak_start) / params.duration_s))

        turns = run_conversations(engine, params, engine.namespace, until, tick)
        progress("soak", 1.0)
        after = probes("after")
        engine.phase = "drain"
        drained = engine.drain_lent(DRAIN_TIMEOUT_S)
        timeline.tick()
        skips = engine.skips()
        engine.backend.close()
        if service is not None:
            supervisor_exit = service.stop()
            service = None
        wall = time.perf_counter() - started
        result = LaneResult(name, before, after, engine.steps, timeline.rows,
                            probe_repeats=repeats)
        result.figures = _figures(params, result, engine, timeline, inline, skips, turns,
                                  wall, drained, supervisor_exit)
        result.figures["aged_bytes"] = aged
        return result
    finally:
        try:
            if service is not None:
                service.stop()
            if inline is not None:
                inline.close()
        finally:
            # Even when a second Ctrl-C cuts the wait for the supervisor short: the KV
            # cache's segment is this process's alone to unlink (hundreds of MiB of
            # /dev/shm), and the supervisor, signalled already, ends by itself.
            engine.close()
            left = instance_entries(instance)
            if left:
                log.warning("lane %s left shared memory: %s", name, left)
            remover.remove(store_dir)


def _host_took_core(lane: Lane, probe: ProbeResult) -> bool:
    """True if other processes took the engine's core during ``probe`` in a lane where
    no SparkCache process may run there (its workers pinned to other cores, or none):
    then they were the shared host's other tenants, and the probe measured them, not
    the lane. In the unpinned lane SparkCache's own workers may be what took the core,
    which is what that lane measures; the inline lane's threads are the engine process's
    own, which the meter does not count as other."""
    return (lane.placement in ("isolated", "none")
            and (probe.core_other_busy or 0.0) > FOREIGN_BUSY_MAX)


def _share(x: float | None) -> float | None:
    return None if x is None else round(x, 3)


def _mean(xs: list[float]) -> float:
    return float(np.mean(xs)) if xs else 0.0


def _figures(params: SoakParams, r: LaneResult, engine: SoakEngine, timeline: _Timeline,
             inline: InlineStore | None, skips: Counter, turns: int, wall: float,
             drained: bool, supervisor_exit: int | None) -> dict[str, object]:
    soak_ms = [s.ms for s in r.steps if s.phase == "soak"]
    before = [p.decode_tok_s for p in r.before]
    after = [p.decode_tok_s for p in r.after]
    before_vs = [p.vs_control for p in r.before if p.vs_control is not None]
    after_vs = [p.vs_control for p in r.after if p.vs_control is not None]
    wall_ratio = round(_mean(after) / _mean(before), 4) if before else 0.0
    c = engine.counters
    fig: dict[str, object] = {
        "before_tok_s": [round(x, 2) for x in before],
        "after_tok_s": [round(x, 2) for x in after],
        # Against the control engine where it ran beside every probe (control.py): the
        # host's drift cancels. Medians: one probe caught by a burst moves a mean.
        "after_over_before": (round(float(np.median(after_vs) / np.median(before_vs)), 4)
                              if before_vs and after_vs else wall_ratio),
        "after_over_before_wall": wall_ratio,
        "before_vs_control": [round(x, 4) for x in before_vs],
        "after_vs_control": [round(x, 4) for x in after_vs],
        "first_token_before_s": [round(p.first_token_s, 4) for p in r.before],
        "first_token_after_s": [round(p.first_token_s, 4) for p in r.after],
        "core_other_busy_before": [_share(p.core_other_busy) for p in r.before],
        "core_other_busy_after": [_share(p.core_other_busy) for p in r.after],
        "engine_cpu_share_before": [_share(p.engine_cpu_share) for p in r.before],
        "engine_cpu_share_after": [_share(p.engine_cpu_share) for p in r.after],
        "probe_repeats": dict(r.probe_repeats),
        "step_p50_ms": round(percentile(soak_ms, 50), 3),
        "step_p99_ms": round(percentile(soak_ms, 99), 3),
        "step_max_ms": round(max(soak_ms, default=0.0), 3),
        "soak_steps": len(soak_ms),
        "turns": turns,
        "restores_verified": c.restores_verified,
        "restore_mismatches": c.restore_mismatches,
        "hit_tokens": c.hit_tokens,
        "prefilled_tokens": c.prefilled_tokens,
        "decoded_tokens": c.decoded_tokens,
        "loads": c.loads,
        "saves": c.saves,
        "verify_s": round(c.verify_s, 3),
        "skips": dict(sorted(skips.items())),
        "max_bytes": params.max_bytes,
        "low_watermark_bytes": params.low_watermark_bytes,
        "lent_blocks_returned": drained,
        "wall_s": round(wall, 2),
    }
    used = [float(row["used_bytes"]) for row in timeline.rows if "used_bytes" in row]
    fig["used_bytes_max"] = int(max(used, default=0))
    fig["used_bytes_end"] = int(used[-1]) if used else 0
    if timeline.samples:
        last = timeline.samples[-1]
        from sparkcache.shm.layouts import DURATION_BUCKETS_S
        fig.update(
            evicted_roots=last.evicted_roots, cut_roots=last.cut_roots,
            reclaimed_bytes=last.reclaimed_bytes, commits=last.commits,
            commit_mean_s=round(last.commit_sum_s / last.commits, 4) if last.commits else 0.0,
            commit_p50_le_s=bucket_quantile(last.commit_buckets, DURATION_BUCKETS_S, 0.5,
                                            last.commits),
            commit_p99_le_s=bucket_quantile(last.commit_buckets, DURATION_BUCKETS_S, 0.99,
                                            last.commits),
            maintenance_slice_max_s=round(last.slice_max_s, 4),
            refused_at_hard_cap_s=round(last.refused_s, 2),
            supervisor_exit=supervisor_exit)
    elif inline is not None:
        st = inline.stats
        durs = [d for _, d in st.commit_durations]
        fig.update(
            evicted_roots=st.evicted_roots, cut_roots=0, reclaimed_bytes=st.reclaimed_bytes,
            commits=st.commits, commit_mean_s=round(_mean(durs), 4),
            commit_p50_s=round(percentile(durs, 50), 4),
            commit_p99_s=round(percentile(durs, 99), 4),
            maintenance_passes=st.passes, maintenance_pass_s=round(st.pass_s, 3),
            maintenance_pass_max_s=round(st.pass_max_s, 4), pages_fsynced=st.pages_written,
            commit_queue_max=st.queue_max)
    else:
        fig.update(evicted_roots=0, cut_roots=0, reclaimed_bytes=0, commits=0)
    return fig
