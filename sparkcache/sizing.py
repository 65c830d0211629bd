"""Sizing advice from rates: the arithmetic of ``sparkcache sizing``, with no I/O (the
figures come in as ``Figure``s, each naming where it came from, and the advice goes out as
dataclasses). ``sparkcache.sizing_measure`` measures the figures of a running instance.

The model (docs/operations.md). Between pressure episodes nothing is evicted, so a rank's
used bytes grow at the *net growth rate* G: bytes commits add, less what superseding
frees. An episode starts at ``max_bytes`` and evicts down to the low watermark, so the
watermark gap g = max - low is what the store grows through between episodes:
the time between episodes is g / G, and for a wanted time T the gap is G x T. During an
episode eviction must outpace growth (reclaim rate R > G), or used bytes keep rising to the
hard cap (max + g), where publications are refused.

A larger gap costs context: each episode removes about g bytes (g / mean root bytes
conversations), and the store holds on average max - g/2 instead of nearly max, so about
g/2 bytes of conversations that would still be held are gone (misses). The smallest
workable gap is one publication (the largest), so the cost is counted against that.

What must stay resident (the floor) is the larger of the working set given and the bytes
under lease (G x lease seconds: eviction never takes a leased root). A floor above
``max_bytes`` cannot fit at all; a floor above the low watermark is evicted from in every
episode, so it caps the gap at max - floor.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


class SizingError(ValueError):
    """A figure is missing or out of range (the message names it and what is allowed)."""


@dataclass(frozen=True)
class Figure:
    value: float
    source: str  # "measured (...)", "flag --...", "config SPARKCACHE_..."


@dataclass(frozen=True)
class SizingInputs:
    net_growth_bytes_per_s: Figure
    reclaim_bytes_per_s: Figure
    largest_publication_bytes: Figure
    max_bytes: Figure
    low_watermark_bytes: Figure
    target_interval_s: Figure  # the wanted time between pressure episodes
    lease_seconds: Figure | None = None
    working_set_bytes: Figure | None = None
    mean_root_bytes: Figure | None = None
    maintenance_duty: Figure | None = None  # share of time in slices, as measured
    duty_cap: Figure | None = None


@dataclass(frozen=True)
class Advice:
    keeps_pace: bool  # reclamation outpaces growth
    reclaim_margin_bytes_per_s: float  # R - G (negative: falls behind)
    time_to_hard_cap_s: float | None  # from max_bytes, while falling behind; None if not
    hard_cap_bytes: int
    gap_now_bytes: int  # max - low as configured
    interval_now_s: float  # gap now / G (inf when nothing grows)
    gap_for_target_bytes: int  # G x T, at least one largest publication (may pass max)
    gap_raised_to_publication: bool
    low_watermark_for_target_bytes: int  # max - that gap (>= 0 only when it fits)
    removed_per_episode_bytes: int  # about one gap (at most max_bytes)
    removed_per_episode_roots: float | None  # / mean root bytes
    episodes_per_hour: float
    mean_held_bytes: int  # max - gap / 2
    context_lost_vs_smallest_gap_bytes: int  # (gap - largest publication) / 2
    floor_bytes: int  # what must stay resident
    floor_source: str
    fits: bool  # the floor fits under max_bytes
    shortfall_bytes: int  # floor - max when it does not fit; 0 otherwise
    gap_limit_bytes: int | None  # max - floor when the floor caps the gap, else None
    interval_limit_s: float | None  # that gap / G
    lines: list[str]  # the advice in words, each figure with its source


def _check(inputs: SizingInputs) -> None:
    problems = []
    for name in ("net_growth_bytes_per_s", "reclaim_bytes_per_s", "largest_publication_bytes",
                 "max_bytes", "low_watermark_bytes", "target_interval_s", "lease_seconds",
                 "working_set_bytes", "mean_root_bytes"):
        f = getattr(inputs, name)
        if f is not None and (not math.isfinite(f.value) or f.value < 0):
            problems.append(f"{name}={f.value!r} ({f.source}): expected a finite number >= 0")
    if inputs.max_bytes.value <= 0:
        problems.append(f"max_bytes={inputs.max_bytes.value!r}: expected more than 0")
    if inputs.low_watermark_bytes.value > inputs.max_bytes.value:
        problems.append("low_watermark_bytes is above max_bytes: expected at most max_bytes")
    if inputs.target_interval_s.value <= 0:
        problems.append("target_interval_s: expected seconds above 0")
    if problems:
        raise SizingError("; ".join(problems))


def size(n: float) -> str:
    sign = "-" if n < 0 else ""
    n = abs(n)
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{sign}{n / scale:.1f}{unit}"
    return f"{sign}{int(n)}B"


def duration(s: float) -> str:
    if math.isinf(s):
        return "never"
    for unit, scale in (("h", 3600), ("min", 60)):
        if s >= scale:
            return f"{s / scale:.1f}{unit}"
    return f"{s:.1f}s"


def _episodes_every(interval_s: float) -> str:
    """How often a pressure episode starts, in words ("never" reads badly after "every")."""
    if math.isinf(interval_s):
        return "no episode (no net growth)"
    return f"an episode every {duration(interval_s)}"


def _said(f: Figure, shown: str) -> str:
    return f"{shown} [{f.source}]"


def advise(inputs: SizingInputs) -> Advice:
    """The advice for ``inputs`` (SizingError if a figure is out of range)."""
    _check(inputs)
    g = inputs.net_growth_bytes_per_s.value
    r = inputs.reclaim_bytes_per_s.value
    largest = inputs.largest_publication_bytes.value
    max_b, low_b = inputs.max_bytes.value, inputs.low_watermark_bytes.value
    target = inputs.target_interval_s.value
    gap_now = max_b - low_b
    hard_cap = max_b + gap_now
    lines: list[str] = []

    # Does reclamation outpace growth?
    margin = r - g
    keeps_pace = margin > 0 or g == 0
    to_cap = None if keeps_pace else (gap_now / -margin if margin < 0 else math.inf)
    rates = (f"net growth {_said(inputs.net_growth_bytes_per_s, size(g) + '/s')}, reclaim "
             f"{_said(inputs.reclaim_bytes_per_s, size(r) + '/s')}")
    if keeps_pace:
        lines.append(f"reclamation outpaces growth: {rates}; margin {size(margin)}/s")
    else:
        lines.append(
            f"reclamation FALLS BEHIND growth: {rates}; in an episode used bytes rise "
            f"{size(-margin)}/s and reach the hard cap {size(hard_cap)} (publications "
            f"refused) {duration(to_cap or 0)} after crossing max_bytes: raise "
            "SPARKCACHE_MAINTENANCE_DUTY / _DUTY_MAX / _SLICE_BYTES / _IO_BYTES_PER_S, or "
            "publish less")
    if inputs.maintenance_duty is not None:
        cap = "" if inputs.duty_cap is None else (
            f" of a cap of {_said(inputs.duty_cap, f'{inputs.duty_cap.value:.0%}')}")
        lines.append("maintenance duty "
                     f"{_said(inputs.maintenance_duty, f'{inputs.maintenance_duty.value:.0%}')}"
                     f"{cap}")

    # The gap now, and the gap for the target time between episodes.
    interval_now = gap_now / g if g > 0 else math.inf
    lines.append(
        f"gap now {size(gap_now)} (max {_said(inputs.max_bytes, size(max_b))} - low "
        f"{_said(inputs.low_watermark_bytes, size(low_b))}): {_episodes_every(interval_now)}")
    raw_gap = g * target
    gap = max(raw_gap, largest)
    raised = gap > raw_gap
    low_for_target = max_b - gap
    why = (f" (raised to the largest publication "
           f"{_said(inputs.largest_publication_bytes, size(largest))})" if raised else "")
    # A gap past max_bytes has no low watermark: it once printed a negative one.
    if low_for_target >= 0:
        low = f", low watermark {size(low_for_target)}"
    else:
        low = ": more than max_bytes, so no low watermark gives it" + (
            f"; the longest possible is {duration(max_b / g)}" if g > 0 else "")
    lines.append(
        f"for an episode every {_said(inputs.target_interval_s, duration(target))}: gap = "
        f"net growth x target = {size(gap)}{why}{low}")

    # What a larger gap costs; a gap past max_bytes cannot be had: at most all of it.
    target_gap, gap = gap, min(gap, max_b)
    mean_root = inputs.mean_root_bytes.value if inputs.mean_root_bytes else 0.0
    roots = gap / mean_root if mean_root > 0 else None
    per_hour = 3600 * g / gap if gap > 0 else 0.0
    held = max_b - gap / 2
    lost = max(0.0, (gap - largest) / 2)
    lines.append(
        f"cost of that gap: each episode removes about {size(gap)} of context"
        + (f" (~{roots:.0f} conversations of "
           f"{_said(inputs.mean_root_bytes, size(mean_root))})" if roots is not None
           and inputs.mean_root_bytes is not None else "")
        + f", {per_hour:.1f} episodes an hour; the store holds on average {size(held)}, "
        f"{size(lost)} less context than with the smallest workable gap (one publication): "
        "conversations whose prefix was in it miss on their next turn")

    # Does what must stay resident fit?
    floor, floor_source = 0.0, "nothing given"
    if inputs.working_set_bytes is not None:
        floor, floor_source = inputs.working_set_bytes.value, (
            f"working set [{inputs.working_set_bytes.source}]")
    if inputs.lease_seconds is not None:
        leased = g * inputs.lease_seconds.value
        if leased > floor:
            floor = leased
            floor_source = (f"bytes under lease = net growth x lease "
                            f"{_said(inputs.lease_seconds, duration(inputs.lease_seconds.value))}")
    fits = floor <= max_b
    shortfall = 0.0 if fits else floor - max_b
    gap_limit = interval_limit = None
    if not fits:
        lines.append(
            f"the working set CANNOT FIT: {size(floor)} ({floor_source}) against max_bytes "
            f"{size(max_b)}: short by {size(shortfall)}; raise SPARKCACHE_MAX_BYTES to at "
            f"least {size(floor + target_gap)} (the floor plus the gap), or keep less resident")
    elif floor > low_for_target:
        gap_limit = max_b - floor
        interval_limit = gap_limit / g if g > 0 else math.inf
        lines.append(
            f"the working set {size(floor)} ({floor_source}) fits under max_bytes but not "
            f"under that low watermark: every episode evicts part of it unless the gap is "
            f"at most {size(gap_limit)} ({_episodes_every(interval_limit)}), or "
            f"max_bytes is at least {size(floor + target_gap)}")
    elif floor > 0:
        lines.append(f"the working set {size(floor)} ({floor_source}) fits under the low "
                     f"watermark {size(low_for_target)}")

    return Advice(
        keeps_pace=keeps_pace, reclaim_margin_bytes_per_s=margin, time_to_hard_cap_s=to_cap,
        hard_cap_bytes=int(hard_cap), gap_now_bytes=int(gap_now), interval_now_s=interval_now,
        gap_for_target_bytes=int(max_b - low_for_target), gap_raised_to_publication=raised,
        low_watermark_for_target_bytes=int(low_for_target),
        removed_per_episode_bytes=int(gap), removed_per_episode_roots=roots,
        episodes_per_hour=per_hour, mean_held_bytes=int(held),
        context_lost_vs_smallest_gap_bytes=int(lost), floor_bytes=int(floor),
        floor_source=floor_source, fits=fits, shortfall_bytes=int(shortfall),
        gap_limit_bytes=None if gap_limit is None else int(gap_limit),
        interval_limit_s=interval_limit, lines=lines,
    )
