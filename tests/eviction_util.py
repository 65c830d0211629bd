"""Helpers of the eviction and maintenance tests: a clock tests move by hand, and slice
budgets."""

from __future__ import annotations

from dataclasses import dataclass

from sparkcache.maintenance_policy import CostModel, SliceBudget, SliceMeter
from sparkcache.store import EvictResult, PageStore
from sparkcache.store.eviction import EvictionPlan

UNLIMITED = 1 << 62


@dataclass
class FakeClock:
    """Seconds that pass only when told: ``now += s``, and ``tick`` on every reading (work
    that costs time in a deterministic way)."""

    now: float = 1000.0
    tick: float = 0.0

    def __call__(self) -> float:
        self.now += self.tick
        return self.now


def meter(roots: int = UNLIMITED, nbytes: int = UNLIMITED, seconds: float = 1e9,
          clock: FakeClock | None = None, costs: CostModel | None = None) -> SliceMeter:
    return SliceMeter(SliceBudget(roots, nbytes, seconds), costs or CostModel(),
                      clock or FakeClock())


def evict(store: PageStore, roots: int, plan: EvictionPlan | None = None) -> EvictResult:
    """Evict up to ``roots`` whole roots, least recently used first, with no other limit."""
    return store.evict(meter(roots), plan or EvictionPlan(), UNLIMITED)
