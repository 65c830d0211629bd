"""Whether loading a prefix beats recomputing it, from rates measured as the engine runs.

A load's pages arrive at the rate the restore workers served loads while any was in
flight (``load_started``, ``load_finished``), after the pages of the loads already in
flight; recomputing its tokens takes them at the rate the engine computes tokens in its
busy steps (``step``). A load expected to take longer than recomputing is cut
(``worth_loading`` says no): the request computes its prefix instead of waiting for it.

Loading a prefix and computing the rest is never better than one of the two whole: a
load's time grows with its pages at a fixed rate, and a token costs the engine at least
as much the later it comes in the prompt (it attends to all before it), so cutting a
load shorter saves the cheaper pages' time and adds the dearer ones'. The cut is
therefore to nothing.

Until both rates are measured nothing is cut; and a hit is loaded whatever they say
when no load has started for ``PROBE_S``, so that the restore rate is measured again (a
slow spell, a disk shared with something else, passes: without a load the estimate
never would).
Nothing here raises or waits: it is arithmetic on the scheduler's thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Weight of a new sample in the rates' moving averages.
ALPHA = 0.2
# Steps scheduling fewer tokens than this are decode steps: memory-bound, far below the
# engine's prefill rate, which is what recomputing a prefix runs at.
MIN_STEP_TOKENS = 256
# A gap between two steps longer than this was the engine idle, not computing.
MAX_STEP_S = 10.0
# While loads are being cut, one goes through this often (seconds) to measure again.
PROBE_S = 10.0


def _average(old: float | None, sample: float) -> float:
    return sample if old is None else old + ALPHA * (sample - old)


@dataclass
class LoadCost:
    """The two rates and the loads in flight, for one scheduler (every rank's loads end
    together: a load is done when its slowest rank is, and that is what is measured)."""

    page_tokens: int
    pages_per_s: float | None = None  # loads' pages served per second of loading
    tokens_per_s: float | None = None  # tokens the engine computes per second, prefilling
    _loads: dict[str, int] = field(default_factory=dict)  # loads in flight: pages, by request
    _busy_since: float = 0.0  # since when some load has been in flight
    _done: int = 0  # pages finished since the last sample of the restore rate
    _step: tuple[float, int] | None = None  # the last step: when, tokens it scheduled
    _last_load: float = float("-inf")  # when the last load started

    @property
    def in_flight(self) -> int:
        """Pages of loads started and not finished."""
        return sum(self._loads.values())

    def step(self, tokens: int, now: float) -> None:
        """A scheduling step at ``now`` scheduled ``tokens`` tokens. The previous step's
        tokens took the time until this one."""
        if self._step is not None:
            at, scheduled = self._step
            took = now - at
            if scheduled >= MIN_STEP_TOKENS and 0 < took <= MAX_STEP_S:
                self.tokens_per_s = _average(self.tokens_per_s, scheduled / took)
        self._step = (now, tokens)

    def load_started(self, req_id: str, pages: int, now: float) -> None:
        if pages <= 0 or req_id in self._loads:
            return
        if not self._loads:
            self._busy_since = now
        self._loads[req_id] = pages
        self._last_load = now

    def load_finished(self, req_id: str, now: float) -> None:
        """The load of request ``req_id`` ended (all restored or not: its time was spent;
        a request aborted while loading still has its load end)."""
        pages = self._loads.pop(req_id, 0)
        if pages <= 0:
            return
        self._done += pages
        busy = now - self._busy_since
        if busy > 0:
            self.pages_per_s = _average(self.pages_per_s, self._done / busy)
            self._done = 0
            self._busy_since = now
        # else: finished in the instant it started (one step): counted with the next

    def estimate(self, pages: int) -> tuple[float, float] | None:
        """(seconds to load ``pages`` pages after those in flight, seconds to compute
        their tokens); None until both rates are measured."""
        compute = self.compute_seconds(pages)
        if not self.pages_per_s or compute is None:
            return None
        return (self.in_flight + pages) / self.pages_per_s, compute

    def compute_seconds(self, pages: int) -> float | None:
        """Seconds the engine takes to compute ``pages`` pages' tokens; None until
        measured."""
        if not self.tokens_per_s:
            return None
        return pages * self.page_tokens / self.tokens_per_s

    def worth_loading(self, pages: int, now: float) -> bool:
        """Whether a load of ``pages`` pages should go ahead: True unless it is expected to
        take longer than computing them, and a load started within ``PROBE_S``."""
        times = self.estimate(pages)
        if times is None or now - self._last_load >= PROBE_S:
            return True
        load_s, compute_s = times
        return load_s <= compute_s
