"""The traffic of a soak: idle probes and long conversations growing turn by turn.

Token streams are drawn from a seeded generator per conversation and generation, so
every lane sees the same prompts (and the restore-only lane's store can be seeded with
the prefixes its conversations will ask for).
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

# numpy imports its random module at first use, and a signal's exception raised during
# that import can be lost (sparkcache.exit_signal): the soak's first use comes right
# after its first supervisor is ready, where a Ctrl-C is likeliest. Imported with this
# module instead, before any handler is installed.
import numpy.random

from sparkcache import exit_signal
from sparkcache.identity import KeyChain, Namespace
from sparkcache.soak.contention import CoreMeter
from sparkcache.soak.control import ControlEngine, ControlProbe
from sparkcache.soak.engine import Request, SoakEngine
from sparkcache.soak.params import SoakParams

VOCAB = 50_000


def first_context(params: SoakParams, conv: int, generation: int) -> np.ndarray:
    """The opening prompt of conversation ``conv``'s ``generation``-th life."""
    rng = np.random.default_rng([params.seed, conv, generation, 0])
    return rng.integers(0, VOCAB, params.context_min)


@dataclass
class ProbeResult:
    phase: str
    first_token_s: float
    decode_tok_s: float
    # Share of the engine's core other processes used meanwhile (contention.CoreMeter).
    core_other_busy: float | None = None
    # The engine thread's CPU time over the probe's wall time. Alone on its core it is
    # ~1 however fast the host runs that core today; threads of its own process (the
    # inline lane), processes on its core and GIL waits take it below. About half beside
    # the control engine, which takes the other half.
    engine_cpu_share: float | None = None
    # The engine process's CPU seconds (every thread) from first token to last, and over
    # the whole probe.
    decode_cpu_s: float = 0.0
    cpu_s: float = 0.0
    control: ControlProbe | None = None  # the same probe, run by the control meanwhile

    @property
    def vs_control(self) -> float | None:
        """The engine's decode speed over the control's for the same tokens, both on one
        core at the same time: the control's decode CPU seconds over the engine's."""
        if self.control is None or self.decode_cpu_s <= 0:
            return None
        return self.control.decode_cpu_s / self.decode_cpu_s


@dataclass
class Conversation:
    """One agent session: each turn re-sends everything so far plus a new tail, the
    engine answers a few tokens, and the session starts over past ``context_max``."""

    conv: int
    params: SoakParams
    ns: Namespace
    generation: int = 0
    turn: int = 0
    turns_done: int = 0
    chain: KeyChain = field(init=False)
    _rng: np.random.Generator = field(init=False)

    def __post_init__(self) -> None:
        self._begin()

    def _begin(self) -> None:
        self.chain = KeyChain(self.ns)
        self._rng = np.random.default_rng([self.params.seed, self.conv, self.generation, 1])
        self.turn = 0

    def next_request(self, on_finish: Callable[[Request], None]) -> Request:
        p = self.params
        if self.chain.num_tokens + p.tail_tokens + p.turn_decode_tokens > p.context_max:
            self.generation += 1
            self._begin()
        if self.turn == 0:
            new = first_context(p, self.conv, self.generation)
        else:
            new = self._rng.integers(0, VOCAB, p.tail_tokens)
        self.chain.extend(new)
        req_id = f"c{self.conv}g{self.generation}t{self.turn}"
        self.turn += 1
        rng = self._rng
        return Request(req_id, self.chain, self.chain.num_tokens, p.turn_decode_tokens,
                       lambda: int(rng.integers(0, VOCAB)), on_finish)


def run_probe(engine: SoakEngine, params: SoakParams, ns: Namespace, phase: str,
              index: int, timeout_s: float = 120.0,
              control: ControlEngine | None = None) -> ProbeResult:
    """One request alone: a fresh ~``probe_tokens`` prompt, then ``probe_decode_tokens``
    tokens; its first-token latency and its decode rate. With ``control``, the control
    engine runs the same probe at the same time."""
    rng = np.random.default_rng([params.seed, 1_000_000 + index, zlib.crc32(phase.encode())])
    chain = KeyChain(ns)
    chain.extend(rng.integers(0, VOCAB, params.probe_tokens))
    done: list[Request] = []
    req = Request(f"probe-{phase}-{index}", chain, params.probe_tokens,
                  params.probe_decode_tokens, lambda: int(rng.integers(0, VOCAB)),
                  done.append)
    engine.phase = phase
    meter = CoreMeter(params.engine_core)
    if control is not None:
        control.start(phase, index)
    cpu0, wall0, proc0 = time.thread_time(), time.perf_counter(), time.process_time()
    engine.submit(req)
    if not engine.run_until(lambda: bool(done), time.perf_counter() + timeout_s):
        raise TimeoutError(f"probe {req.req_id} did not finish in {timeout_s:g}s")
    assert req.first_token_at is not None and req.finished_at is not None
    assert req.first_token_cpu is not None and req.finished_cpu is not None
    share = (time.thread_time() - cpu0) / max(1e-9, time.perf_counter() - wall0)
    cpu_s = time.process_time() - proc0
    twin = control.result() if control is not None else None
    decode_s = req.finished_at - req.first_token_at
    return ProbeResult(phase, req.first_token_at - req.arrived,
                       (req.generated - 1) / decode_s if decode_s > 0 else 0.0,
                       meter.share(twin.cpu_s if twin is not None else 0.0), share,
                       req.finished_cpu - req.first_token_cpu, cpu_s, twin)


def run_conversations(engine: SoakEngine, params: SoakParams, ns: Namespace,
                      until: float, tick: Callable[[], None] | None = None) -> int:
    """Keep ``conversations`` sessions going until ``until`` (perf_counter), then finish
    the turns in flight; the turns completed."""
    engine.phase = "soak"
    convs = [Conversation(i, params, ns) for i in range(params.conversations)]
    finished: list[int] = [0]
    stopping = [False]

    def on_finish(req: Request, conv: Conversation) -> None:
        finished[0] += 1
        conv.turns_done += 1
        if not stopping[0]:
            engine.submit(conv.next_request(lambda r: on_finish(r, conv)))

    for conv in convs:
        engine.submit(conv.next_request(lambda r, c=conv: on_finish(r, c)))
    next_tick = 0.0
    while time.perf_counter() < until:
        exit_signal.exit_if_signalled()
        if not engine.step():
            time.sleep(0.0005)
        if tick is not None and time.perf_counter() >= next_tick:
            tick()
            next_tick = time.perf_counter() + 0.25
    stopping[0] = True
    engine.run_until(lambda: not engine.busy, time.perf_counter() + 120)
    return finished[0]
