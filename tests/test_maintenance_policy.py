"""The maintenance policy with an injected clock, no processes: hysteresis, the duty cap
over many slices, the I/O cap, the hard cap's clock, a slice's meter."""

from __future__ import annotations

import bisect
import itertools
import random
from pathlib import Path

import pytest
from eviction_util import FakeClock, meter

from sparkcache import config
from sparkcache.maintenance_policy import (
    WINDOW_S,
    CostModel,
    DutyCycle,
    HardCap,
    IoPacer,
    Limits,
    Pacing,
    Pressure,
    SliceBudget,
)
from sparkcache.store.eviction import PAGE, TXN, UNLINK


def test_an_episode_starts_above_max_and_ends_at_the_low_watermark() -> None:
    p = Pressure(high=100, low=60)
    assert not p.update(100, 0.0)  # at max_bytes: not above it
    assert p.update(101, 1.0) and p.since == 1.0
    assert p.update(80, 2.0) and p.since == 1.0  # between the marks: still evicting
    assert p.need(80, collectable=5) == 15  # above low and not awaiting collection
    assert p.need(80, collectable=30) == 0  # collection alone gets it there
    assert not p.update(60, 3.0) and p.since is None
    assert not p.update(90, 4.0)  # between the marks again: no new episode
    assert p.need(90, 0) == 0


def windows_busy(spans: list[tuple[float, float]], window: float) -> float:
    """The most work any window of ``window`` seconds holds, for disjoint spans in order
    (the busiest window ends where a span ends)."""
    ends = [e for _, e in spans]
    prefix = list(itertools.accumulate((e - s for s, e in spans), initial=0.0))
    worst = 0.0
    for i, (_, end) in enumerate(spans):
        lo = end - window
        j = bisect.bisect_right(ends, lo)  # the first span ending inside the window
        busy = prefix[i + 1] - prefix[j] - max(0.0, lo - spans[j][0])
        worst = max(worst, busy)
    return worst


@pytest.mark.parametrize("share", [0.05, 0.2, 0.5, 1.0])
def test_the_duty_cap_holds_over_any_window_of_many_slices(share: float) -> None:
    rng = random.Random(1)
    slice_s = share * WINDOW_S / 4
    duty = DutyCycle(share, slice_s)
    now, spans = 0.0, []
    for _ in range(2000):
        now += duty.wait(now)
        assert duty.wait(now) == 0.0
        length = slice_s * rng.choice([1.0, 1.0, rng.random()])  # at most the budget
        spans.append((now, now + length))
        duty.record(now, now + length)
        now += length + rng.choice([0.0, 0.0, rng.random() * 0.3])  # sometimes idle
    assert windows_busy(spans, WINDOW_S) <= share * WINDOW_S + 1e-6
    # On the whole, as on every window: the share (and one window's worth at the end).
    total = spans[-1][1] - spans[0][0]
    assert sum(e - s for s, e in spans) <= share * (total + WINDOW_S)


def test_the_duty_cap_lets_work_go_at_its_share_when_there_is_always_work() -> None:
    duty = DutyCycle(0.2, 0.02)
    now, spans = 0.0, []
    while now < 60:
        now += duty.wait(now)
        duty.record(now, now + 0.02)
        spans.append((now, now + 0.02))
        now += 0.02
    assert windows_busy(spans, WINDOW_S) <= 0.2 + 1e-6
    assert sum(e - s for s, e in spans) / now >= 0.195
    assert duty.used(now) == pytest.approx(0.2, abs=0.005)


def test_a_slice_that_cannot_fit_the_cap_is_refused() -> None:
    with pytest.raises(ValueError, match="cannot fit"):
        DutyCycle(0.1, 0.2)


def test_io_pacing_holds_the_rate_after_a_one_second_burst() -> None:
    io = IoPacer(rate=100.0, now=0.0)
    assert io.wait(0.0) == 0.0
    io.charge(250, 0.0)  # a slice spent the burst and more: 150 in debt
    assert io.wait(0.0) == pytest.approx(1.5)
    assert io.wait(1.5) == 0.0
    now, spent = 1.5, 0
    while now < 100:
        now += io.wait(now)
        io.charge(30, now)
        spent += 30
    assert spent <= 100 * (now - 1.5) + 100 + 30


def test_pacing_waits_for_the_later_of_duty_and_io() -> None:
    limits = Limits(SliceBudget(16, 1 << 20, 0.02), 0.2, 1000.0, 100, 50, 150, 0.5)
    pacing = Pacing(limits, 0.0)
    for i in range(10):
        assert pacing.wait(i * 0.02, 0) == 0.0
        pacing.record(i * 0.02, (i + 1) * 0.02, io_bytes=0)
    assert pacing.wait(0.2, 0) == pytest.approx(0.8)  # duty: 0.2 s of any second
    pacing.record(1.0, 1.02, io_bytes=3000)  # 2000 bytes of debt at 1000/s
    assert pacing.wait(1.02, 0) == pytest.approx(2.0, abs=0.03)


def test_the_duty_rises_past_max_bytes_to_its_bound_at_the_hard_cap() -> None:
    limits = Limits(SliceBudget(16, 1 << 20, 0.02), 0.2, 1e12, 100, 50, 150, 0.6)
    assert [limits.duty_at(u) for u in (0, 100)] == [0.2, 0.2]  # calm up to max_bytes
    assert limits.duty_at(125) == pytest.approx(0.4)  # in proportion between the two
    assert [limits.duty_at(u) for u in (150, 10_000)] == [pytest.approx(0.6)] * 2


def test_a_duty_above_the_bound_is_never_lowered_at_the_cap() -> None:
    cfg = config.Config(store_dir=Path("/nonexistent"), maintenance_duty=0.7)
    limits = Limits.from_config(cfg)
    assert (limits.duty, limits.duty_max) == (0.7, 0.7)
    assert limits.duty_at(cfg.hard_cap_bytes) == 0.7
    assert Limits.from_config(config.Config(store_dir=Path("/nonexistent"))).duty_max == 0.5


def test_pacing_near_the_hard_cap_lets_more_slices_run_within_the_raised_share() -> None:
    limits = Limits(SliceBudget(16, 1 << 20, 0.02), 0.2, 1e12, 100, 50, 150, 0.6)

    def busy_in_one_second(used: int) -> float:
        pacing, now, busy = Pacing(limits, 0.0), 0.0, 0.0
        while now < 10.0:  # slices always waiting for work, as at the cap
            now += pacing.wait(now, used)
            pacing.record(now, now + 0.02, io_bytes=0)
            now += 0.02
            busy += 0.02 if now > 9.0 else 0.0
        return busy

    assert busy_in_one_second(100) == pytest.approx(0.2, abs=0.021)
    assert busy_in_one_second(150) == pytest.approx(0.6, abs=0.021)


def test_the_hard_cap_clock_counts_a_sustained_refusal_and_stops_below() -> None:
    cap = HardCap(cap=100)
    cap.update(99, 0.0)
    assert cap.since is None and cap.total_s == 0
    cap.update(100, 1.0)
    cap.update(120, 3.0)
    cap.update(101, 4.5)
    assert cap.since == 1.0 and cap.total_s == pytest.approx(3.5)
    cap.update(80, 5.0)
    assert cap.since is None and cap.total_s == pytest.approx(3.5)
    cap.update(100, 9.0)
    assert cap.since == 9.0


def test_the_meter_stops_before_the_time_budget_with_learnt_costs() -> None:
    clock = FakeClock()
    costs = CostModel()
    m = meter(roots=4, nbytes=1000, seconds=0.01, clock=clock, costs=costs)
    assert m.fresh and m.roots_left() == 4 and m.bytes_left() == 1000
    assert m.affordable(PAGE, 10**6) == 1  # never measured: one, to learn its cost
    clock.now += 0.002
    m.spend(PAGE, 10, 400, seconds=0.002)  # 0.2 ms a page
    m.spend(TXN, 1, 0, seconds=0.001)  # a commit: 1 ms, kept in reserve from now on
    assert costs.estimate(PAGE) == pytest.approx(0.0002)
    assert not m.fresh and m.bytes_left() == 600
    clock.now += 0.001
    assert m.affordable(PAGE, 10**6) == pytest.approx((0.01 - 0.003 - 0.001) / 0.0002, abs=1)
    assert m.affordable(PAGE, 3) == 3
    clock.now += 0.01
    assert m.affordable(PAGE, 5) == 0  # past the budget
    m.take_root()
    assert m.roots_left() == 3


def test_time_between_units_is_the_next_units_and_a_spent_slice_stops_reading() -> None:
    """Whatever passes between two units (the budget checks that let the second start)
    is the second's cost, and all from the last unit to the COMMIT the transaction's;
    once a check finds no unit of any kind fits, later ones answer 0 without reading
    the clock (a reading is work the reserve did not cover)."""
    clock = FakeClock(tick=0.0)
    costs = CostModel()
    m = meter(seconds=0.01, clock=clock, costs=costs)
    start = m.now()
    clock.now += 0.001
    m.spend(PAGE, 1, 0, seconds=m.now() - start)  # 1 ms a page
    clock.now += 0.002  # checks, a hook: nobody's yet
    start = m.now()
    clock.now += 0.001
    m.spend(UNLINK, 1, 0, seconds=m.now() - start)  # measured 1 ms, counted 3
    assert costs.estimate(UNLINK) == pytest.approx(0.003)
    clock.now += 0.0005
    worked = m.now()
    clock.now += 0.0005
    m.spend(TXN, 1, 0, seconds=m.now() - worked)  # measured 0.5 ms, counted 1
    assert costs.estimate(TXN) == pytest.approx(0.001)
    clock.now = m.started + 0.0085  # 1.5 ms left, 1 ms of it the reserve: no unit fits
    assert m.affordable(PAGE, 10) == 0
    clock.tick = 1.0  # any further reading would show
    assert m.affordable(PAGE, 10) == 0 and m.affordable(UNLINK, 1) == 0
    assert clock.now == pytest.approx(m.started + 0.0085)


def test_a_wait_for_the_write_lock_is_no_units_cost_and_no_part_of_the_slice() -> None:
    """A slice that waited for the index's write lock (a commit held it) keeps its whole
    time budget for work, and the unit and the transaction around the wait learn only
    what they did: a wait of a second once made every later slice do one unit."""
    clock = FakeClock()
    costs = CostModel()
    m = meter(seconds=0.02, clock=clock, costs=costs)
    begun = m.now()
    clock.now += 0.5  # BEGIN IMMEDIATE waits for a commit's lock
    m.lock_waited(0.5)
    clock.now += 0.001  # then the transaction's work
    m.spend(TXN, 1, 0, seconds=m.now() - begun)
    assert costs.estimate(TXN) == pytest.approx(0.001)
    clock.now += 0.001
    m.spend(PAGE, 10, 0, seconds=0.001)
    assert costs.estimate(PAGE) == pytest.approx(0.0001)
    # 2 ms of work done, 1 ms in reserve for the COMMIT: 17 ms left, 170 pages.
    assert m.affordable(PAGE, 10**6) == pytest.approx(170, abs=1)
    assert m.waited == pytest.approx(0.5)
    assert m.worked_s(m.now()) == pytest.approx(0.002)
    # A wait between units is taken off the next unit's time, not charged to it.
    clock.now += 0.3
    m.lock_waited(0.3)
    clock.now += 0.001
    m.spend(PAGE, 10, 0, seconds=0.001)
    assert costs.estimate(PAGE) == pytest.approx(0.0001)
    assert m.worked_s(m.now()) == pytest.approx(0.003)


def test_a_commit_slower_than_the_slice_leaves_half_of_it_for_work() -> None:
    """One COMMIT that checkpointed the WAL (40 ms, against a 20 ms slice) is learnt at
    once; the next slices still keep at most half their time in reserve for theirs."""
    clock = FakeClock()
    costs = CostModel()
    costs.observe(PAGE, 100, 0.001)  # 10 us a page
    costs.observe(TXN, 1, 0.040)
    m = meter(seconds=0.02, clock=clock, costs=costs)
    assert m.affordable(PAGE, 10**6) == pytest.approx(1000, abs=1)


def test_costs_rise_at_once_and_decay_slowly() -> None:
    costs = CostModel()
    assert costs.estimate(UNLINK) is None
    costs.observe(UNLINK, 2, 0.01)
    assert costs.estimate(UNLINK) == pytest.approx(0.005)
    costs.observe(UNLINK, 1, 0.02)
    assert costs.estimate(UNLINK) == pytest.approx(0.02)  # slower: at once
    costs.observe(UNLINK, 10, 0.001)
    assert costs.estimate(UNLINK) == pytest.approx(0.02 + 0.2 * (0.0001 - 0.02))
    costs.observe(UNLINK, 0, 5.0)  # nothing done: nothing learnt
    assert costs.estimate(UNLINK) < 0.02


def test_limits_come_from_the_configuration(tmp_path) -> None:
    cfg = config.load({"SPARKCACHE_STORE_DIR": str(tmp_path),
                       "SPARKCACHE_MAINTENANCE_SLICE_MS": "12.5",
                       "SPARKCACHE_MAINTENANCE_SLICE_BYTES": "8MiB"})
    limits = Limits.from_config(cfg)
    assert limits.budget == SliceBudget(16, 8 << 20, 0.0125)
    assert limits.duty == 0.2 and limits.io_bytes_per_s == 1 << 30
    assert limits.hard_cap_bytes == cfg.hard_cap_bytes
