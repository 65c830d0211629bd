"""The soak's stand-in for vLLM: a small serving loop on one core.

- a KV cache of fixed-size blocks in vLLM's per-layer layout ``[K/V, blocks, block size,
  heads, head dim]``, in shared memory (``kvmem.SharedKVCaches``) so that SparkCache's
  workers reach the blocks as they reach a GPU's;
- a scheduler that admits requests when their blocks are free, looks their prefix up
  (leased) at admission and loads it asynchronously, as vLLM's connector does;
- continuous batching: every step decodes one token of every running request and
  prefills up to ``max_batched_tokens`` of the requests still in prefill (chunked);
- a forward of fixed decode cost plus per-token prefill cost (``model.ToyModel``);
- page contents derived from page keys (``pages``): the step writes each page it
  completes into its block, and every loaded page is compared byte for byte;
- a save of the computed full pages at finish, whose blocks stay lent until the store
  gives them back; every step timed.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch

from sparkcache import kvmem
from sparkcache.identity import KeyChain, Namespace
from sparkcache.soak.backend import Backend
from sparkcache.soak.model import ToyModel
from sparkcache.soak.pages import page_content

log = logging.getLogger(__name__)

LAYERS, HEADS, HEAD_DIM = 4, 2, 32
DTYPE = torch.float16
MODEL_ID = "sparkcache-soak-4l"
IDLE_SLEEP_S = 0.0005


def kv_shape(page_tokens: int, blocks: int) -> tuple[int, ...]:
    return (2, blocks, page_tokens, HEADS, HEAD_DIM)


def page_bytes(page_tokens: int) -> int:
    return LAYERS * 2 * page_tokens * HEADS * HEAD_DIM * DTYPE.itemsize


def namespace(tensors: list[torch.Tensor], page_tokens: int) -> Namespace:
    """The namespace SparkCacheClient.register_kv_caches gives these tensors."""
    return Namespace(MODEL_ID, str(DTYPE), kvmem.page_layout(tensors, 1), 1, 0, page_tokens)


@dataclass
class Request:
    req_id: str
    chain: KeyChain  # the conversation's keys; grows with the request's tokens
    prompt_len: int
    max_new: int
    next_token: Callable[[], int]
    on_finish: Callable[[Request], None] | None = None
    arrived: float = field(default_factory=time.perf_counter)
    blocks: list[int] = field(default_factory=list)
    state: str = "waiting"  # waiting, loading, prefill, decode, done
    computed: int = 0  # tokens whose KV is in the blocks
    generated: int = 0
    written: int = 0  # leading pages whose bytes are in their blocks
    loaded_pages: int = 0
    first_token_at: float | None = None
    finished_at: float | None = None
    # The engine process's CPU time (time.process_time, every thread) at the same moments.
    first_token_cpu: float | None = None
    finished_cpu: float | None = None
    saved: bool = False

    @property
    def keys(self) -> list[str]:
        return self.chain.keys


@dataclass
class StepRecord:
    at: float  # perf_counter at the step's end
    phase: str
    ms: float
    decode: int
    prefill_tokens: int


@dataclass
class EngineCounters:
    restores_verified: int = 0  # pages loaded and found byte-exact
    restore_mismatches: int = 0
    hit_tokens: int = 0  # tokens loaded instead of prefilled
    prefilled_tokens: int = 0
    decoded_tokens: int = 0
    loads: int = 0
    loads_refused: int = 0
    saves: int = 0
    finished: int = 0
    verify_s: float = 0.0


class SoakEngine:
    def __init__(self, instance: str, page_tokens: int, blocks: int, model: ToyModel) -> None:
        self.page = page_tokens
        self.kv = kvmem.SharedKVCaches.create(instance, 0, [kv_shape(page_tokens, blocks)]
                                              * LAYERS, DTYPE)
        self.tensors = self.kv.tensors
        for t in self.tensors:
            t.zero_()  # fault every page in now, not in the first probe's steps
        self.views = kvmem.BlockViews(self.tensors, 1)
        self.namespace = namespace(self.tensors, page_tokens)
        self.model = model
        self.blocks = blocks
        self.free: deque[int] = deque(range(blocks))
        self.backend: Backend | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # loading, prefill or decode
        self.lent: dict[str, list[int]] = {}  # saves whose blocks the store holds
        self.steps: list[StepRecord] = []
        self.counters = EngineCounters()
        self.phase = "idle"
        self._by_id: dict[str, Request] = {}
        self._scratch = np.empty(self.views.page_bytes, np.uint8)

    # ---------------------------------------------------------------- requests

    def submit(self, req: Request) -> None:
        self.waiting.append(req)
        self._by_id[req.req_id] = req

    @property
    def busy(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        assert self.backend is not None
        while self.waiting:
            req = self.waiting[0]
            need = -(-(req.prompt_len + req.max_new) // self.page)
            if need > self.blocks:
                raise ValueError(f"request {req.req_id} needs {need} blocks; the engine "
                                 f"has {self.blocks}")
            if len(self.free) < need:
                return
            self.waiting.popleft()
            req.blocks = [self.free.popleft() for _ in range(need)]
            # vLLM asks for the prefix of every prompt token but the last: one token
            # is always computed, to sample from.
            keys = req.keys[: (req.prompt_len - 1) // self.page]
            pages = self.backend.lookup(keys) if keys else 0
            req.state = "prefill"
            if pages:
                if self.backend.load(req.req_id, keys[:pages], req.blocks[:pages]):
                    req.state = "loading"
                    self.counters.loads += 1
                else:
                    self.counters.loads_refused += 1
            self.running.append(req)

    # ---------------------------------------------------------------- polling

    def poll(self) -> None:
        """What the store finished: loads (verified here, outside the step's time) and
        saves whose blocks came back."""
        assert self.backend is not None
        polled = self.backend.poll()
        for req_id in polled.released:
            for b in self.lent.pop(req_id, ()):
                self.free.append(b)
        for req_id, pages in polled.loads:
            req = self._by_id.get(req_id)
            if req is None or req.state != "loading":
                continue
            self._verify(req, pages)
            req.state = "prefill"

    def _verify(self, req: Request, pages: int) -> None:
        t0 = time.perf_counter()
        good = 0
        for i in range(pages):
            self.views.gather(req.blocks[i], self._scratch)
            if np.array_equal(self._scratch, page_content(req.keys[i], self._scratch.size)):
                good += 1
            else:
                break
        self.counters.restores_verified += good
        self.counters.restore_mismatches += pages - good
        # A page that does not match is recomputed, with everything after it.
        req.loaded_pages = good
        req.computed = good * self.page
        req.written = good
        self.counters.hit_tokens += good * self.page
        self.counters.verify_s += time.perf_counter() - t0

    # ---------------------------------------------------------------- one step

    def step(self) -> bool:
        """Admit, then one forward over every runnable request; False if nothing ran."""
        self.poll()
        t0 = time.perf_counter()
        self._admit()
        decoding = [r for r in self.running if r.state == "decode"]
        budget = self.model.shape.max_batched_tokens
        prefills: list[tuple[Request, int]] = []
        for req in self.running:
            if req.state != "prefill" or budget <= 0:
                continue
            n = min(budget, req.prompt_len - req.computed)
            prefills.append((req, n))
            budget -= n
        if not decoding and not prefills:
            return False
        prefill_tokens = sum(n for _, n in prefills)
        self.model.forward(len(decoding), prefill_tokens)
        now = time.perf_counter()
        for req in decoding:
            req.chain.extend([req.next_token()])
            req.computed += 1
            req.generated += 1
            self._write_pages(req)
        for req, n in prefills:
            req.computed += n
            self._write_pages(req)
            if req.computed == req.prompt_len:
                req.chain.extend([req.next_token()])
                req.generated = 1
                req.first_token_at = now
                req.first_token_cpu = time.process_time()
                req.state = "decode"
        self.counters.prefilled_tokens += prefill_tokens
        self.counters.decoded_tokens += len(decoding)
        for req in [r for r in self.running if r.state == "decode"
                    and r.generated >= r.max_new]:
            self._finish(req)
        end = time.perf_counter()
        self.steps.append(StepRecord(end, self.phase, (end - t0) * 1e3, len(decoding),
                                     prefill_tokens))
        return True

    def _write_pages(self, req: Request) -> None:
        """The KV of every page the step completed, into its block."""
        full = min(req.computed // self.page, len(req.keys))
        for i in range(req.written, full):
            self.views.scatter(req.blocks[i], page_content(req.keys[i], self.views.page_bytes))
        req.written = max(req.written, full)

    def _finish(self, req: Request) -> None:
        assert self.backend is not None
        req.state = "done"
        req.finished_at = time.perf_counter()
        req.finished_cpu = time.process_time()
        self.running.remove(req)
        del self._by_id[req.req_id]
        self.counters.finished += 1
        pages = min(req.computed // self.page, len(req.keys))
        if pages and self.backend.save(req.req_id, req.keys[:pages], req.blocks[:pages]):
            req.saved = True
            self.counters.saves += 1
            self.lent[req.req_id] = req.blocks
        else:
            self.free.extend(req.blocks)
        req.blocks = []
        if req.on_finish is not None:
            req.on_finish(req)

    # ---------------------------------------------------------------- loops

    def run_until(self, done: Callable[[], bool], deadline: float) -> bool:
        """Step until ``done()`` or ``deadline`` (perf_counter); whether done."""
        while not done():
            if time.perf_counter() > deadline:
                return False
            if not self.step():
                time.sleep(IDLE_SLEEP_S)
        return True

    def drain_lent(self, timeout_s: float) -> bool:
        """Wait until the store gave back every lent block."""
        deadline = time.perf_counter() + timeout_s
        while self.lent and time.perf_counter() < deadline:
            self.poll()
            time.sleep(0.002)
        return not self.lent

    def skips(self) -> Counter:
        out = self.backend.skips() if self.backend is not None else Counter()
        if self.counters.loads_refused:
            out["load_refused"] += self.counters.loads_refused
        return out

    def close(self) -> None:
        self.tensors = []
        self.views = None  # type: ignore[assignment]
        self.kv.close()
