"""The maintenance worker's policy: when a slice may run and how much it may do. No
processes or I/O here, and every time is passed in (or read from an injected clock), so
tests drive it deterministically (``tests/test_maintenance_policy.py``);
``workers/maintenance.py`` is the loop that carries it out. Reasons and measured figures:
``docs/maintenance.md``.

* ``Pressure``: watermarks with hysteresis. Crossing ``max_bytes`` starts an episode; it
  ends once used bytes are back at ``low_watermark_bytes``. Meanwhile eviction's goal is
  what lies above the low watermark and is not already awaiting collection.
* ``SliceBudget`` and ``SliceMeter``: at most N roots, B bytes and T seconds per slice.
  Time is judged before each unit of work with costs learnt from earlier units
  (``CostModel``), so a slice stops before it would run over, not after.
* ``DutyCycle``: over any window of ``WINDOW_S``, slices take at most ``duty`` of it, so
  maintenance never runs continuously however much is left to do. Past ``max_bytes`` the
  share rises with used bytes, to ``duty_max`` at the hard cap (``Limits.duty_at``).
* ``IoPacer``: bytes unlinked and written to the index, at most ``io_bytes_per_s`` on
  average (a token bucket holding one second's worth).
* ``HardCap``: how long used bytes have stood at the hard cap, where the engine's client
  refuses publications (``store_full``): a refusal that lasts shows in the stats.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from sparkcache.config import Config
from sparkcache.store.eviction import TXN

# The duty cap holds over any window this long.
WINDOW_S = 1.0
# The stats report the duty used over this long.
REPORT_WINDOW_S = 10.0


@dataclass(frozen=True)
class SliceBudget:
    """What one slice may do: roots evicted or cut short, bytes of page references dropped
    plus bytes of objects collected, and seconds."""

    roots: int
    bytes: int
    seconds: float


@dataclass(frozen=True)
class Limits:
    """The settings the policy follows (``Config``'s ``maintenance_*`` fields)."""

    budget: SliceBudget
    duty: float
    io_bytes_per_s: float
    max_bytes: int
    low_watermark_bytes: int
    hard_cap_bytes: int
    duty_max: float

    @classmethod
    def from_config(cls, cfg: Config) -> Limits:
        return cls(
            SliceBudget(cfg.maintenance_slice_roots, cfg.maintenance_slice_bytes,
                        cfg.maintenance_slice_ms / 1000),
            cfg.maintenance_duty, cfg.maintenance_io_bytes_per_s, cfg.max_bytes,
            cfg.low_watermark_bytes, cfg.hard_cap_bytes,
            max(cfg.maintenance_duty, cfg.maintenance_duty_max),
        )

    def duty_at(self, used: int) -> float:
        """The duty cap with ``used`` bytes stored: ``duty`` up to ``max_bytes``, rising in
        proportion to ``duty_max`` at the hard cap. Commits in bursts (several turns of
        long conversations at once) outran a fixed duty's reclaiming and met the hard cap,
        where publications are refused: a refused first turn is a conversation never
        stored. Bounded all the same, and calm below ``max_bytes``
        (docs/maintenance.md, "Pacing")."""
        over = used - self.max_bytes
        if over <= 0:
            return self.duty
        gap = max(1, self.hard_cap_bytes - self.max_bytes)
        return self.duty + (self.duty_max - self.duty) * min(1.0, over / gap)


@dataclass
class Pressure:
    """Watermarks with hysteresis; ``since`` is when the current episode began."""

    high: int
    low: int
    since: float | None = None

    def update(self, used: int, now: float) -> bool:
        """Whether an episode is active after seeing ``used`` bytes at ``now``."""
        if self.since is None and used > self.high:
            self.since = now
        elif self.since is not None and used <= self.low:
            self.since = None
        return self.since is not None

    def need(self, used: int, collectable: int) -> int:
        """Bytes eviction still has to make collectable: what is above the low watermark
        and not already awaiting collection (0 outside an episode). Counting what awaits
        collection keeps eviction from overshooting while collection catches up."""
        if self.since is None:
            return 0
        return max(0, used - collectable - self.low)


class CostModel:
    """Seconds one unit of each kind of work takes (``store.eviction``'s PAGE, UNLINK,
    TXN), learnt from what slices measured. An estimate rises to a slower observation at
    once and decays toward faster ones, so slices plan with the recent worst case. A kind
    never measured has no estimate: a slice then does one unit of it, and learns."""

    DECAY = 0.2

    def __init__(self) -> None:
        self._per_unit: dict[str, float] = {}

    def estimate(self, kind: str) -> float | None:
        return self._per_unit.get(kind)

    def cheapest(self) -> float:
        """The lowest estimate of a unit of work (not a transaction), 0 if none yet."""
        return min((v for k, v in self._per_unit.items() if k != TXN), default=0.0)

    def observe(self, kind: str, units: int, seconds: float) -> None:
        if units <= 0:
            return
        seen = seconds / units
        old = self._per_unit.get(kind, seen)
        self._per_unit[kind] = seen if seen > old else old + self.DECAY * (seen - old)


class SliceMeter:
    """One slice against its budget (the store's ``eviction.Budget``): what it spent, and
    whether the next units still fit. ``clock`` is monotonic seconds."""

    def __init__(self, budget: SliceBudget, costs: CostModel,
                 clock: Callable[[], float]) -> None:
        self.budget = budget
        self.costs = costs
        self._clock = clock
        self.started = clock()
        # The last reading of the clock, and the one that ended the last unit of work.
        self._read = self._worked_until = self.started
        self._spent = False  # a check found no time left for any unit
        # Seconds spent waiting for the index's write lock (``lock_waited``), in all and
        # not yet taken off a unit's cost.
        self.waited = 0.0
        self._wait_unspent = 0.0
        self.roots = 0
        self.bytes = 0
        self.units = 0  # pages dropped and objects collected
        # The longest single spend, (seconds, kind, units): what a slice that overran
        # its budget spent its time on, for the worker's warning.
        self.slowest: tuple[float, str, int] = (0.0, "", 0)

    @property
    def fresh(self) -> bool:
        return self.units == 0

    def now(self) -> float:
        self._read = self._clock()
        return self._read

    def roots_left(self) -> int:
        return self.budget.roots - self.roots

    def bytes_left(self) -> int:
        return max(0, self.budget.bytes - self.bytes)

    def affordable(self, kind: str, units: int) -> int:
        """How many of ``units`` of ``kind`` fit in the time left, keeping room for the
        transaction's commit."""
        if self._spent:
            return 0
        # Room for the COMMIT, at most half the slice: a COMMIT that checkpoints the WAL
        # (tens of milliseconds, now and then, beside busy commits) is learnt at once as
        # the cost of every COMMIT, and a reserve of a whole slice left each later slice
        # one unit (docs/maintenance.md, "Waiting for the lock is not work").
        reserve = min(self.costs.estimate(TXN) or 0.0, self.budget.seconds / 2)
        left = self.started + self.waited + self.budget.seconds - self.now() - reserve
        if left < self.costs.cheapest():
            # No unit of any kind fits: later checks need not read the clock again (a
            # reading is work too, and the reserve covers only the check that found this).
            self._spent = True
            return 0
        per_unit = self.costs.estimate(kind)
        if per_unit is None:
            return min(units, 1)  # never measured: one, to learn what it costs
        return min(units, int(left / max(per_unit, 1e-9)))

    def spend(self, kind: str, units: int, nbytes: int, seconds: float) -> None:
        """Count ``units`` of ``kind`` done in ``seconds``, ending at the last reading of
        ``now()``: the time since the last unit ended counts too (the budget checks that
        let these start), so the estimates cover all that a slice's time goes to."""
        seconds = max(0.0, max(seconds, self._read - self._worked_until) - self._wait_unspent)
        self._wait_unspent = 0.0
        if kind != TXN:
            self.units += units
        self._worked_until = self._read
        self.bytes += nbytes
        self.costs.observe(kind, units, seconds)
        if seconds > self.slowest[0]:
            self.slowest = (seconds, kind, units)

    def take_root(self) -> None:
        self.roots += 1

    def lock_waited(self, seconds: float) -> None:
        """The slice waited ``seconds`` for the index's write lock, held by a commit. Not
        work: it counts against neither the slice's time nor the unit whose time it falls
        in (nor, in the worker, the duty cap). Counted as work, a commit's hold of
        30-200 ms taught the cost model that a transaction costs more than a whole
        slice, and at the cap, where commits hold the lock the most, every slice then did
        one unit of work: eviction fell to ~25 MiB/s and publications were refused
        (docs/maintenance.md, "Waiting for the lock is not work")."""
        self.now()  # the wait is over: the next unit's time starts here
        self.waited += seconds
        self._wait_unspent += seconds

    def worked_s(self, end: float) -> float:
        """The slice's seconds of work, from its start to ``end``: its lock waits left out."""
        return max(0.0, end - self.started - self.waited)


class DutyCycle:
    """Slices take at most ``share`` of any window of ``window`` seconds.

    A slice lasts at most ``slice_s`` (its time budget), so the next one may start at ``s``
    once the slices recorded in ``[s + slice_s - window, s]`` leave room for a whole one:
    every window that will contain it then holds at most ``share * window`` of work (the
    busiest such window is the one ending as it ends). A slice that ran over its budget
    counts as long as it was.
    """

    def __init__(self, share: float, slice_s: float, window: float = WINDOW_S,
                 history: float = REPORT_WINDOW_S) -> None:
        if not 0 < slice_s <= share * window:
            raise ValueError(f"a slice of {slice_s}s cannot fit {share:.0%} of {window}s")
        self.share = share
        self.slice_s = slice_s
        self.window = window
        self.history = max(history, window)
        self._spans: deque[tuple[float, float]] = deque()

    def record(self, start: float, end: float) -> None:
        self._spans.append((start, end))
        while self._spans and self._spans[0][1] < end - self.history:
            self._spans.popleft()

    def wait(self, now: float) -> float:
        """Seconds from ``now`` until the next slice may start."""
        allowance = self.share * self.window - self.slice_s
        busy = 0.0
        for start, end in reversed(self._spans):
            # (A nanosecond of slack: sums of floats must not cost a whole slice.)
            if busy + (end - start) > allowance + 1e-9:
                # Work after `cut` is exactly the allowance: the window may begin there.
                cut = end - (allowance - busy)
                return max(0.0, cut + self.window - self.slice_s - now)
            busy += end - start
        return 0.0

    def used(self, now: float, over: float = REPORT_WINDOW_S) -> float:
        """Share of the last ``over`` seconds spent in slices."""
        since = now - over
        busy = sum(max(0.0, min(end, now) - max(start, since)) for start, end in self._spans)
        return busy / over


class IoPacer:
    """Bytes unlinked and written to the index at ``rate`` per second on average: a token
    bucket holding one second's worth. A slice is charged after it ran (its bytes are
    known then); the next one waits until the bucket is no longer in debt."""

    def __init__(self, rate: float, now: float) -> None:
        self.rate = rate
        self.level = rate
        self._at = now

    def _refill(self, now: float) -> None:
        self.level = min(self.rate, self.level + (now - self._at) * self.rate)
        self._at = max(self._at, now)

    def charge(self, nbytes: int, now: float) -> None:
        self._refill(now)
        self.level -= nbytes

    def wait(self, now: float) -> float:
        self._refill(now)
        return 0.0 if self.level >= 0 else -self.level / self.rate


@dataclass
class HardCap:
    """Time used bytes spent at or above ``cap``, where publications are refused:
    ``since`` the current stretch began (None below it) and ``total_s`` in all."""

    cap: int
    since: float | None = None
    total_s: float = 0.0
    _seen: float | None = field(default=None, repr=False)

    def update(self, used: int, now: float) -> None:
        if used >= self.cap:
            if self.since is None:
                self.since = now
            elif self._seen is not None:
                self.total_s += now - self._seen
        else:
            self.since = None
        self._seen = now


class Pacing:
    """When the next slice may start: the later of the duty cap (at the used bytes last
    seen) and the I/O cap."""

    def __init__(self, limits: Limits, now: float) -> None:
        self.limits = limits
        self.duty = DutyCycle(limits.duty, limits.budget.seconds)
        self.io = IoPacer(limits.io_bytes_per_s, now)

    def wait(self, now: float, used: int) -> float:
        self.duty.share = self.limits.duty_at(used)
        return max(self.duty.wait(now), self.io.wait(now))

    def record(self, start: float, end: float, io_bytes: int) -> None:
        self.duty.record(start, end)
        self.io.charge(io_bytes, end)
