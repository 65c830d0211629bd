"""The predecessor's shape, as a small model for the ``inline-read-write`` lane.

The old design kept publication and capacity maintenance inside the serving process:
capture, commit and maintenance were threads of the engine process (so they ran on the
engine's core and took turns with it for the GIL), a commit wrote one file per page and
fsynced each, and maintenance scanned and sorted the whole inventory on every pass and
then evicted, with no budget and no pause, until used bytes were back at the low
watermark. This module builds exactly that, and nothing of SparkCache's store: its
index, slices, duty cap and leases are what the lane is compared against.

Layout under ``root``: ``objects/<key>`` (a header, then the page) and
``roots/<id>.json`` (the page keys of one publication; its mtime is its last use).
Lookups (which files exist, in order) run in the engine's thread, as the old lookup did;
loads run on a fourth thread, as an async load.
"""

from __future__ import annotations

import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from collections import Counter, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from sparkcache.kvmem import BlockViews
from sparkcache.soak.aging import AgedConversation
from sparkcache.soak.backend import Polled
from sparkcache.soak.pages import page_content

log = logging.getLogger(__name__)

_HEADER = struct.Struct("<8sQI")  # magic, payload length, CRC-32 of the payload
_MAGIC = b"SPKINLN1"
PASS_INTERVAL_S = 0.5  # a pass after every commit, and at least this often


@dataclass
class InlineStats:
    evicted_roots: int = 0
    reclaimed_bytes: int = 0
    used_bytes: int = 0  # as the last pass found it
    passes: int = 0
    pass_s: float = 0.0  # time spent in passes, in all
    pass_max_s: float = 0.0
    commits: int = 0
    pages_written: int = 0
    queue_max: int = 0  # publications saved and not yet committed, at most
    # (perf_counter at the end, seconds) of every commit: the figures and the timeline.
    commit_durations: list[tuple[float, float]] = field(default_factory=list)


class InlineStore:
    """The three roles as threads, plus loads; the ``Backend`` calls of the engine."""

    def __init__(self, root: Path, views: BlockViews, max_bytes: int, low_bytes: int) -> None:
        self.objects = root / "objects"
        self.roots = root / "roots"
        self.objects.mkdir(parents=True, exist_ok=True)
        self.roots.mkdir(parents=True, exist_ok=True)
        self.views = views
        self.max_bytes = max_bytes
        self.low_bytes = low_bytes
        self.stats = InlineStats()
        self.skipped: Counter = Counter()
        self._capture_q: queue.Queue = queue.Queue()
        self._commit_q: queue.Queue = queue.Queue()
        self._load_q: queue.Queue = queue.Queue()
        self._released: deque[str] = deque()
        self._loaded: deque[tuple[str, int]] = deque()
        self._in_flight = 0  # publications between save and the end of their commit
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=fn, name=f"inline-{fn.__name__}", daemon=True)
                         for fn in (self._capture, self._commit, self._maintain, self._restore)]
        for t in self._threads:
            t.start()

    def _path(self, key: str) -> str:
        return str(self.objects / key)

    def age(self, conversations: Iterable[AgedConversation]) -> int:
        """Write ``conversations`` as the old design left them (``soak.aging``): each
        page once, one root per turn, oldest first; the bytes written. Set-up, not
        measured: nothing is fsynced."""
        nbytes = self.views.page_bytes
        written = 0
        for conv in conversations:
            for key in conv.keys:
                data = page_content(key, nbytes)
                _write_unsynced(self._path(key),
                                [_HEADER.pack(_MAGIC, data.size, zlib.crc32(data)), data])
            for turn, end in enumerate(conv.turn_ends):
                _write_unsynced(str(self.roots / f"aged{conv.index}t{turn}.json"),
                                [json.dumps(conv.keys[:end]).encode()])
            written += len(conv.keys) * nbytes
        return written

    # ---------------------------------------------------------------- engine calls

    def lookup(self, keys: Sequence[str]) -> int:
        for i, key in enumerate(keys):
            if not os.path.exists(self._path(key)):
                return i
        return len(keys)

    def load(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        self._load_q.put((req_id, list(keys), list(blocks)))
        return True

    def save(self, req_id: str, keys: Sequence[str], blocks: Sequence[int]) -> bool:
        # No admission and no slots: the old design queued every publication, and its
        # backlog was whatever commit had not caught up with (SparkCache skips instead).
        with self._lock:
            self._in_flight += 1
            self.stats.queue_max = max(self.stats.queue_max, self._in_flight)
        self._capture_q.put((req_id, list(keys), list(blocks)))
        return True

    def poll(self) -> Polled:
        out = Polled()
        while self._loaded:
            out.loads.append(self._loaded.popleft())
        while self._released:
            out.released.append(self._released.popleft())
        return out

    def skips(self) -> Counter:
        return Counter(self.skipped)

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for q in (self._capture_q, self._commit_q, self._load_q):
            q.put(None)
        for t in self._threads:
            t.join(timeout=30)

    # ---------------------------------------------------------------- capture

    def _capture(self) -> None:
        """Copy the pages the store lacks out of the engine's blocks, give the blocks
        back, hand the copy to commit."""
        while (item := self._capture_q.get()) is not None:
            req_id, keys, blocks = item
            pages = []
            for key, block in zip(keys, blocks, strict=True):
                if os.path.exists(self._path(key)):
                    continue
                buf = np.empty(self.views.page_bytes, np.uint8)
                self.views.gather(block, buf)
                pages.append((key, buf))
            self._released.append(req_id)
            self._commit_q.put((req_id, keys, pages))

    # ---------------------------------------------------------------- commit

    def _commit(self) -> None:
        """One file per page, each written to a temporary name, fsynced and renamed;
        then the root's list of keys, the same way."""
        while (item := self._commit_q.get()) is not None:
            req_id, keys, pages = item
            t0 = time.perf_counter()
            try:
                for key, data in pages:
                    if os.path.exists(self._path(key)):
                        continue  # a publication queued earlier wrote it meanwhile
                    header = _HEADER.pack(_MAGIC, data.size, zlib.crc32(data))
                    self._write(self._path(key), [header, data])
                self._write(str(self.roots / f"{req_id}.json"), [json.dumps(keys).encode()])
                self.stats.pages_written += len(pages)
                self.stats.commits += 1
            except OSError:
                log.exception("inline commit of %s failed", req_id)
                self.skipped["commit_failed"] += 1
            finally:
                with self._lock:
                    self._in_flight -= 1
            self.stats.commit_durations.append((time.perf_counter(),
                                                time.perf_counter() - t0))
            self._wake.set()

    @staticmethod
    def _write(path: str, pieces: list) -> None:
        tmp = f"{path}.tmp{threading.get_ident()}"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            os.writev(fd, pieces)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.rename(tmp, path)

    # ---------------------------------------------------------------- maintenance

    def _maintain(self) -> None:
        while not self._stop.is_set():
            self._wake.wait(PASS_INTERVAL_S)
            self._wake.clear()
            if self._stop.is_set():
                return
            t0 = time.perf_counter()
            try:
                self._pass()
            except OSError:
                log.exception("inline maintenance pass failed")
            took = time.perf_counter() - t0
            self.stats.passes += 1
            self.stats.pass_s += took
            self.stats.pass_max_s = max(self.stats.pass_max_s, took)

    def _pass(self) -> None:
        """Scan the whole inventory, sort it by last use, evict to the low watermark."""
        roots = []
        for entry in os.scandir(self.roots):
            if not entry.name.endswith(".json"):
                continue
            try:
                mtime = entry.stat().st_mtime
                with open(entry.path, "rb") as f:
                    keys = json.loads(f.read())
            except (OSError, ValueError):
                continue  # replaced or removed meanwhile
            roots.append((mtime, entry.path, keys))
        sizes = {}
        for entry in os.scandir(self.objects):
            if ".tmp" in entry.name:
                continue
            try:
                sizes[entry.name] = entry.stat().st_size
            except OSError:
                continue
        used = sum(sizes.values())
        roots.sort()
        refs: Counter = Counter(k for _, _, keys in roots for k in keys)
        if used > self.max_bytes:
            for _, path, keys in roots:
                if used <= self.low_bytes:
                    break
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    continue
                self.stats.evicted_roots += 1
                for key in keys:
                    refs[key] -= 1
                    if refs[key] == 0 and key in sizes:
                        try:
                            os.unlink(self._path(key))
                        except FileNotFoundError:
                            continue
                        used -= sizes[key]
                        self.stats.reclaimed_bytes += sizes.pop(key)
        self.stats.used_bytes = used

    # ---------------------------------------------------------------- loads

    def _restore(self) -> None:
        """Read and check each page, write it into its block; the first missing or bad
        page ends the load."""
        while (item := self._load_q.get()) is not None:
            req_id, keys, blocks = item
            done = 0
            for key, block in zip(keys, blocks, strict=True):
                try:
                    with open(self._path(key), "rb") as f:
                        raw = f.read()
                except OSError:
                    break
                magic, length, crc = _HEADER.unpack_from(raw)
                data = np.frombuffer(raw, np.uint8, offset=_HEADER.size)
                if magic != _MAGIC or length != data.size or zlib.crc32(data) != crc:
                    break
                self.views.scatter(block, data)
                done += 1
            self._loaded.append((req_id, done))


def _write_unsynced(path: str, pieces: list) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.writev(fd, pieces)
    finally:
        os.close(fd)
