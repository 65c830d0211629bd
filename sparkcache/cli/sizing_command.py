"""``sparkcache sizing`` as the CLI runs it: figures measured on the running instance
(``sizing_measure``), given as flags, or taken from the configuration, each labelled with
where it came from; then ``sizing.advise``. Prints; returns the exit code (0 advice given,
1 nothing to measure, 2 a bad flag)."""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from typing import Any

from sparkcache import config
from sparkcache.config import Config
from sparkcache.instance import NoSupervisor
from sparkcache.sizing import Figure, SizingError, SizingInputs, advise, size
from sparkcache.sizing_measure import Measured, MeasureError, measure

# Flags that are sizes (bytes, or bytes per second): parsed like the size settings.
SIZE_FLAGS = ("net_growth_bytes_per_s", "reclaim_bytes_per_s", "largest_publication_bytes",
              "working_set_bytes", "mean_root_bytes")


# The longest --window: a day measures all there is to measure.
MAX_WINDOW_S = 86400.0


class FlagError(ValueError):
    pass


def _flag(name: str) -> str:
    return config.flag_name(name)


def parse_flags(given: dict[str, str | None]) -> dict[str, Figure]:
    """Size flags given -> Figures (FlagError naming the flag and what is allowed)."""
    out = {}
    for name in SIZE_FLAGS:
        text = given.get(name)
        if text is None:
            continue
        try:
            value = config.parse_size(text)
        except ValueError as exc:
            raise FlagError(f"{_flag(name)}={text!r} is invalid: expected {exc}") from None
        out[name] = Figure(float(value), f"flag {_flag(name)}")
    return out


def reclaim_capacity(settings: dict[str, float], where: str) -> Figure:
    """The most maintenance's caps let it reclaim a second: slice bytes x slices a second
    (duty x 1000 / slice ms), and no more than the I/O cap. An upper bound: what a slice
    really frees depends on how many pages the victims share."""
    per_slice = settings["maintenance_slice_bytes"]
    slices = settings["maintenance_duty"] * 1000 / settings["maintenance_slice_ms"]
    value = min(per_slice * slices, settings["maintenance_io_bytes_per_s"])
    return Figure(value, f"config{where}: upper bound, SPARKCACHE_MAINTENANCE_SLICE_BYTES x "
                         "DUTY / SLICE_MS, at most IO_BYTES_PER_S; no episode measured")


def _settings(cfg: Config) -> dict[str, float]:
    return {name: float(getattr(cfg, name)) for name in (
        "max_bytes", "low_watermark_bytes", "lease_seconds", "maintenance_slice_bytes",
        "maintenance_slice_ms", "maintenance_duty", "maintenance_io_bytes_per_s",
        "capture_slot_bytes")}


def _growth(measured: float, what: str) -> Figure:
    """The growth measured, or 0 when the store shrank over the window (rows collected
    before their files are unlinked, a root superseded by a smaller one): less than no
    growth is no growth, not a figure out of range."""
    if measured >= 0:
        return Figure(measured, what)
    return Figure(0.0, f"{what}: it shrank by {size(-measured)}/s, taken as no growth")


def inputs_from(flags: dict[str, Figure], settings: dict[str, float], where: str,
                target: Figure, m: Measured | None) -> tuple[SizingInputs, str]:
    """The figures to advise on, flags first, then measured, then configuration; and a
    line saying what was measured."""
    def cfg(name: str) -> Figure:
        return Figure(settings[name], f"config{where} SPARKCACHE_{name.upper()}")

    measured: dict[str, Figure] = {}
    head = "planning from the figures given (nothing measured)"
    duty = None
    if m is not None and m.ranks:
        r = max(m.ranks, key=lambda x: x.net_growth_bytes_per_s)
        what = f"measured on rank {r.rank} over {r.window_s:.1f}s"
        head = (f"measured {len(m.ranks)} rank(s) of supervisor pid {m.supervisor_pid} over "
                f"{r.window_s:.1f}s; advice for rank {r.rank}, the fastest growing")
        measured["net_growth_bytes_per_s"] = _growth(r.net_growth_bytes_per_s, what)
        if r.in_episode and r.reclaim_bytes_per_s > 0:
            measured["reclaim_bytes_per_s"] = Figure(r.reclaim_bytes_per_s,
                                                     what + ", in a pressure episode")
        if m.largest_root_bytes is not None:
            measured["largest_publication_bytes"] = Figure(
                float(m.largest_root_bytes), "measured: the largest root in the index")
        if m.mean_root_bytes is not None:
            measured["mean_root_bytes"] = Figure(m.mean_root_bytes,
                                                 "measured: mean root in the index")
        duty = Figure(r.duty, what + ", share of the last 10s")

    def pick(name: str, default: Figure | None) -> Figure | None:
        return flags.get(name) or measured.get(name) or default

    growth = pick("net_growth_bytes_per_s", None)
    if growth is None:
        raise FlagError(f"no net growth rate: give {_flag('net_growth_bytes_per_s')} "
                        "(bytes a second, such as 50MiB) or run it beside a supervisor")
    largest_default = Figure(settings["capture_slot_bytes"],
                             f"config{where} SPARKCACHE_CAPTURE_SLOT_BYTES: the most one "
                             "commit adds at once (a publication goes in parts of a slot)")
    inputs = SizingInputs(
        net_growth_bytes_per_s=growth,
        reclaim_bytes_per_s=pick("reclaim_bytes_per_s", reclaim_capacity(settings, where)),
        largest_publication_bytes=pick("largest_publication_bytes", largest_default),
        max_bytes=cfg("max_bytes"), low_watermark_bytes=cfg("low_watermark_bytes"),
        target_interval_s=target, lease_seconds=cfg("lease_seconds"),
        working_set_bytes=flags.get("working_set_bytes"),
        mean_root_bytes=pick("mean_root_bytes", None),
        maintenance_duty=duty, duty_cap=cfg("maintenance_duty") if duty else None,
    )
    return inputs, head


def _finite(value: Any) -> Any:
    """JSON has no infinity: an interval that never comes is null."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_finite(v) for v in value]
    return value


def main(cfg: Config, *, json_out: bool, window_s: float, target_interval_s: float,
         given: dict[str, str | None]) -> int:
    if not 0 < window_s <= MAX_WINDOW_S:  # nan and inf too: time.sleep cannot wait them
        print(f"sparkcache: --window={window_s}: expected seconds above 0 and at most "
              f"{MAX_WINDOW_S:g}, such as 10", file=sys.stderr)
        return 2
    try:
        flags = parse_flags(given)
    except FlagError as exc:
        print(f"sparkcache: {exc}", file=sys.stderr)
        return 2
    target = Figure(target_interval_s, "flag --target-interval")
    m: Measured | None = None
    settings, where = _settings(cfg), ""
    if "net_growth_bytes_per_s" not in flags:
        try:
            m = measure(cfg.store_dir, window_s, cfg)
        except (NoSupervisor, MeasureError) as exc:
            print(f"sparkcache: {exc}; or plan without one: give "
                  f"{_flag('net_growth_bytes_per_s')}", file=sys.stderr)
            return 1
        settings = {**settings, **m.settings}
        where = f" of supervisor pid {m.supervisor_pid}"
    try:
        inputs, head = inputs_from(flags, settings, where, target, m)
        advice = advise(inputs)
    except (FlagError, SizingError) as exc:
        print(f"sparkcache: {exc}", file=sys.stderr)
        return 2
    if json_out:
        print(json.dumps(_finite({
            "inputs": dataclasses.asdict(inputs),
            "advice": dataclasses.asdict(advice),
            "measured": dataclasses.asdict(m) if m is not None else None,
        })))
        return 0
    print(f"sparkcache sizing: {head}")
    for line in advice.lines:
        print(f"  {line}")
    return 0
