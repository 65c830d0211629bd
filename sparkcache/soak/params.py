"""What a soak runs: its lanes and its parameters, checked before anything starts."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

from sparkcache.config import MiB


@dataclass(frozen=True)
class Lane:
    """One way of running the store beside the engine."""

    name: str
    access_mode: str  # read-write, restore-only or off
    # isolated: worker processes pinned away from the engine's core; unpinned: worker
    # processes on any core; inline: the predecessor's threads inside the engine
    # process; none: no SparkCache at all.
    placement: str


LANES: dict[str, Lane] = {
    lane.name: lane
    for lane in (
        Lane("isolated-read-write", "read-write", "isolated"),
        Lane("unpinned-read-write", "read-write", "unpinned"),
        Lane("inline-read-write", "read-write", "inline"),
        Lane("restore-only", "restore-only", "isolated"),
        Lane("off", "off", "none"),
    )
}


class SoakParamError(ValueError):
    """A parameter is out of range; the message names it and what is allowed."""


@dataclass(frozen=True)
class SoakParams:
    """Every knob of one ``sparkcache soak`` invocation. Token counts are per request;
    sizes are bytes of one rank's store (the soak runs one rank)."""

    lanes: tuple[str, ...] = tuple(LANES)
    duration_s: float = 40.0  # soak phase of each lane
    conversations: int = 4  # concurrent, each growing turn by turn
    # The report's conversations grew from 75k to 300k tokens. What the predecessor's
    # maintenance and commits cost grows with the length of its roots (it reads every
    # root on every pass; it fsyncs every page), and at a twentieth of that length (the
    # soak's first sizes) the inline lane showed no slowdown; at a tenth (--quick) to a
    # fifth (these), with the store aged (soak.aging), it does (docs/soak.md).
    context_min: int = 16384  # tokens of a conversation's first turn
    context_max: int = 65536  # a conversation past this starts over (a new one)
    tail_tokens: int = 2048  # new prompt tokens each turn (prefilled), as in the report
    turn_decode_tokens: int = 32  # tokens generated each turn
    page_tokens: int = 16
    # The store's cap (high watermark) and low watermark: the conversations' own roots
    # (at most context_max each; the soak's engine stores 1 KiB a token) fit under the
    # low watermark, so a turn finds its prefix. Each read-write lane's store is filled
    # to the low watermark after the before-probes (soak.aging); the conversations'
    # growth, the roots of those that start over and the probes' push it to its cap,
    # and eviction takes the aged roots first, throughout the soak.
    max_bytes: int = 384 * MiB
    low_watermark_bytes: int = 320 * MiB
    # Seconds a new publication is protected from eviction: the production lane's 300 s
    # against its hour-long soak, scaled to minutes (a root leased for the whole soak
    # could never be evicted, and the store would only refuse at its hard cap).
    lease_seconds: float = 3.0
    # Seconds a lookup protects the prefix it counted, for the load that follows (here
    # within a step or two). SparkCache's default (30 s) would keep every conversation
    # ever looked up in a minutes-long soak from eviction.
    lookup_lease_seconds: float = 2.0
    probes: int = 3  # idle probes before and after the soak
    probe_tokens: int = 2048  # prompt tokens of a probe
    probe_decode_tokens: int = 128  # tokens a probe generates
    engine_core: int = 0  # the core the engine is pinned to in every lane
    seed: int = 0

    @classmethod
    def quick(cls, **overrides: object) -> SoakParams:
        """Every lane in under 3 minutes on 2 cores: shorter conversations, probes and
        soak, on a store aged as the default's is (the same low watermark, so the
        predecessor's passes read as many roots) with half its headroom above it, which
        the shorter soak fills."""
        base = dict(duration_s=10.0, context_min=8192, context_max=32768, tail_tokens=2048,
                    turn_decode_tokens=24, max_bytes=352 * MiB,
                    low_watermark_bytes=320 * MiB, probe_tokens=1024, probe_decode_tokens=128)
        base.update(overrides)
        return cls(**base)  # type: ignore[arg-type]

    def check(self) -> None:
        """Raise SoakParamError naming the first bad parameter and what is allowed."""
        unknown = [name for name in self.lanes if name not in LANES]
        if unknown or not self.lanes:
            raise SoakParamError(f"--lanes {','.join(self.lanes)!r}: expected a comma-"
                                 f"separated list of {', '.join(LANES)}")
        # Results, stores and shared-memory instances are per lane name: a lane named
        # twice would find its first run's store still there (or being removed).
        twice = sorted({name for name in self.lanes if self.lanes.count(name) > 1})
        if twice:
            raise SoakParamError(f"--lanes {','.join(self.lanes)!r}: expected each lane "
                                 f"once ({', '.join(twice)} named twice)")
        positive = ("duration_s", "lease_seconds", "lookup_lease_seconds", "conversations",
                    "context_min", "tail_tokens",
                    "turn_decode_tokens", "page_tokens", "max_bytes", "low_watermark_bytes",
                    "probes", "probe_tokens", "probe_decode_tokens")
        for name in positive:
            if getattr(self, name) <= 0:
                raise SoakParamError(f"{flag(name)}={getattr(self, name)!r}: expected > 0")
        if self.seed < 0:  # numpy's seed sequences take no negative entropy
            raise SoakParamError(f"--seed={self.seed!r}: expected 0 or more")
        if self.context_max < self.context_min + self.tail_tokens:
            raise SoakParamError(
                f"{flag('context_max')}={self.context_max}: expected at least "
                f"{flag('context_min')} + {flag('tail_tokens')} "
                f"({self.context_min + self.tail_tokens})")
        if self.low_watermark_bytes >= self.max_bytes:
            raise SoakParamError(
                f"{flag('low_watermark_bytes')}={self.low_watermark_bytes}: expected below "
                f"{flag('max_bytes')} ({self.max_bytes})")
        if self.probe_tokens < 2 * self.page_tokens:
            raise SoakParamError(f"{flag('probe_tokens')}={self.probe_tokens}: expected at "
                                 f"least two pages ({2 * self.page_tokens} tokens)")
        cores = sorted(os.sched_getaffinity(0))
        if self.engine_core not in cores:
            raise SoakParamError(f"{flag('engine_core')}={self.engine_core}: expected one "
                                 f"of the cores this process may use, {cores}")
        if "isolated" in {LANES[n].placement for n in self.lanes} and len(cores) < 2:
            raise SoakParamError("the isolated lanes need a second core for the workers; "
                                 f"this process may use only {cores}: pass --lanes without "
                                 "isolated-read-write and restore-only")

    @property
    def worker_cores(self) -> list[int]:
        """Cores of the isolated lanes' workers: every core but the engine's."""
        return [c for c in sorted(os.sched_getaffinity(0)) if c != self.engine_core]

    def describe(self) -> dict[str, object]:
        out = dataclasses.asdict(self)
        out["lanes"] = list(self.lanes)
        return out


def flag(name: str) -> str:
    return "--" + name.replace("_", "-")
