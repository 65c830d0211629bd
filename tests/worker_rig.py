"""Capture, commit, maintenance and restore run in the test's own process, stepped by hand, on real
segments and a real store: for tests that need to reach into a worker (push what no
well-behaved peer would, make one item fail) and step it deterministically."""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from pipeline_util import make_cfg
from sparkcache.shm import Producer
from sparkcache.workers.capture import Capture
from sparkcache.workers.commit import Commit
from sparkcache.workers.lifecycle import Lifecycle, Role, State, WorkerSpec
from sparkcache.workers.maintenance import Maintenance
from sparkcache.workers.restore import Restore

from sparkcache import config, segments
from sparkcache.synthetic import SyntheticEngine


def ready_life(cfg: config.Config, role: Role) -> Lifecycle:
    """A lifecycle that reports READY in the rank's stats block, without the signal
    handlers and parent-death signal of a real worker process."""
    life = Lifecycle(WorkerSpec(cfg, 0, role, os.getppid()))
    life._stats = segments.attach_stats(cfg, 0)
    life.state = State.READY
    life.beat()
    return life


@dataclass
class Rig:
    cfg: config.Config
    engine: SyntheticEngine
    capture: Capture
    commit: Commit
    maintenance: Maintenance
    restore: Restore
    lease: Producer  # the vLLM scheduler's end of the lease ring (PrefixLookup)

    def step(self, rounds: int = 1) -> None:
        """One turn of every worker, then the engine's polls."""
        for _ in range(rounds):
            for w in (self.capture, self.commit, self.maintenance, self.restore):
                w.life.beat()
            self.capture._step(0)
            self.commit._step(0)
            self.maintenance.slice()
            self.maintenance.report()
            self.restore._step(0)
            self.engine.poll()


@dataclass
class _Detach:
    """A producer end, closed like the other parts (by leaving the ring open)."""

    end: Producer

    def close(self) -> None:
        self.end.detach()


@contextlib.contextmanager
def rig(store: Path, instance: str, clock: Callable[[], float] = time.monotonic,
        **settings: str) -> Iterator[Rig]:
    """``clock``: maintenance's (its slices' budget, duty and pacing)."""
    cfg = make_cfg(store, instance, **settings)
    segs = segments.RankSegments.create(cfg, 0, len(Role))
    made: list = []
    try:
        cap = Capture(ready_life(cfg, Role.CAPTURE))
        made.append(cap)
        com = Commit(ready_life(cfg, Role.COMMIT))
        made.append(com)
        mai = Maintenance(ready_life(cfg, Role.MAINTENANCE), clock=clock)
        made.append(mai)
        res = Restore(ready_life(cfg, Role.RESTORE))
        made.append(res)
        engine = SyntheticEngine.create(cfg)
        made.append(engine)
        lease = segments.producer(cfg, 0, "lease")
        made.append(_Detach(lease))
        yield Rig(cfg, engine, cap, com, mai, res, lease)
    finally:
        for part in reversed(made):
            part.close()
            if hasattr(part, "life"):
                part.life.close()
        segs.close()
