"""Whether a load beats recomputing its tokens (``sparkcache/load_cost.py``): the rates
as measured from steps and loads, and the cut they decide."""

from __future__ import annotations

import pytest

from sparkcache.load_cost import MAX_STEP_S, MIN_STEP_TOKENS, PROBE_S, LoadCost

PAGE = 16


def engine_at(tokens_per_s: float, steps: int = 5, start: float = 0.0) -> tuple[LoadCost, float]:
    """A cost model whose engine ran prefill steps of 1,024 tokens at ``tokens_per_s``."""
    cost = LoadCost(PAGE)
    now = start
    for _ in range(steps):
        cost.step(1024, now)
        now += 1024 / tokens_per_s
    cost.step(0, now)
    return cost, now


def test_the_compute_rate_comes_from_prefill_steps_alone() -> None:
    cost, now = engine_at(8_000)
    assert cost.tokens_per_s == pytest.approx(8_000)
    # Decode steps (a token per request) and idle gaps say nothing of prefill.
    for _ in range(20):
        cost.step(MIN_STEP_TOKENS - 1, now)
        now += 0.02
    cost.step(4096, now)
    cost.step(0, now + MAX_STEP_S + 1)
    assert cost.tokens_per_s == pytest.approx(8_000)


def test_the_restore_rate_counts_the_time_some_load_was_in_flight() -> None:
    cost = LoadCost(PAGE)
    cost.load_started("a", 100, 0.0)
    cost.load_started("b", 100, 0.5)  # overlapping: both share the workers
    assert cost.in_flight == 200
    cost.load_finished("a", 1.0)
    cost.load_finished("b", 2.0)
    # 100 pages in the first second, then 100 more in the next: 100 pages a second.
    assert cost.pages_per_s == pytest.approx(100)
    assert cost.in_flight == 0
    cost.load_finished("b", 3.0)  # reported twice (two ranks): counted once
    cost.load_finished("unknown", 3.0)
    assert cost.pages_per_s == pytest.approx(100) and cost.in_flight == 0
    # An idle spell is no loading time.
    cost.load_started("c", 100, 60.0)
    cost.load_finished("c", 61.0)
    assert cost.pages_per_s == pytest.approx(100)


def test_nothing_is_cut_until_both_rates_are_measured() -> None:
    cost = LoadCost(PAGE)
    assert cost.worth_loading(10_000, 0.0)
    cost, now = engine_at(1e9)  # an engine that computes anything at once
    assert cost.estimate(10) is None and cost.worth_loading(10_000, now)


def test_a_load_slower_than_recomputing_is_cut_and_a_probe_goes_through() -> None:
    cost, now = engine_at(16_000)  # 1,000 pages of 16 tokens a second
    cost.load_started("a", 400, now)
    cost.load_finished("a", now + 1.0)  # 400 pages a second
    now += 1.0
    load_s, compute_s = cost.estimate(200)
    assert load_s == pytest.approx(0.5) and compute_s == pytest.approx(0.2)
    assert not cost.worth_loading(200, now)
    # Loads in flight come first: a load that wins alone loses behind them.
    fast, t = engine_at(4_000)  # 250 pages a second: loading at 400 wins
    fast.load_started("a", 400, t)
    fast.load_finished("a", t + 1.0)
    assert fast.worth_loading(200, t + 1.0)
    fast.load_started("b", 800, t + 1.0)
    assert not fast.worth_loading(200, t + 1.1)
    # With no load started for PROBE_S, one goes through to measure the rate again.
    assert cost.worth_loading(200, now - 1.0 + PROBE_S)
