"""Helpers of the pipeline tests: a supervisor subprocess and a synthetic engine."""

from __future__ import annotations

import contextlib
import functools
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
from sparkcache.shm.segment import instance_entries
from sparkcache.workers.lifecycle import die_with_parent

from sparkcache import config
from sparkcache.store.fsck import fsck
from sparkcache.supervisor import RUNTIME_FILE
from sparkcache.synthetic import (  # noqa: F401  (re-exported for the tests)
    BLOCKS,
    LAYERS,
    SyntheticEngine,
    kv_shape,
    sequences,
)

T = TypeVar("T")

PAGE_TOKENS = 16
SHAPE = kv_shape(PAGE_TOKENS)
SETTINGS = {
    "ranks": "1", "capture_slots": "4", "capture_slot_bytes": "1MiB",
    "page_tokens": str(PAGE_TOKENS), "max_bytes": "1GiB", "low_watermark_bytes": "512MiB",
    "metrics_port": "0",
}


def wait_for(cond: Callable[[], T], timeout: float, what: str, poll: float = 0.05) -> T:
    """Poll ``cond`` until it returns something true, and return that; fail the test
    naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not (got := cond()):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(poll)
    return got


def ends_with_test(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``preexec_fn`` for a process a test starts: the kernel sends it ``sig`` when the
    test's process dies, so a test process killed from outside (SIGKILL, or SIGTERM,
    which skips fixture teardown) leaves no supervisor or server running."""
    return functools.partial(die_with_parent, sig)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_cfg(store: Path, instance: str, **more: str) -> config.Config:
    return config.load(
        env={}, overrides={"store_dir": str(store), "instance": instance, **SETTINGS, **more}
    )


def start_supervisor(store: Path, instance: str, *extra: str, env: dict | None = None,
                     wait_ready: bool = True, new_session: bool = False) -> subprocess.Popen:
    args = [sys.executable, "-m", "sparkcache", "supervise", "--store-dir", str(store),
            "--instance", instance]
    for k, v in SETTINGS.items():
        args += [config.flag_name(k), v]
    proc = subprocess.Popen(
        [*args, *extra], env={**os.environ, **(env or {})}, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True, start_new_session=new_session,
        preexec_fn=ends_with_test(),
    )
    if wait_ready:
        deadline = time.monotonic() + 90
        while not (store / RUNTIME_FILE).exists():
            if proc.poll() is not None:
                _, err = proc.communicate()
                pytest.fail(f"supervisor exited {proc.returncode}: {err[-3000:]}")
            if time.monotonic() > deadline:
                stop_supervisor(proc)
                pytest.fail("supervisor not ready in 90s")
            time.sleep(0.05)
    return proc


def stop_supervisor(proc: subprocess.Popen, timeout: float = 30) -> tuple[int, str]:
    """SIGTERM, wait, kill if it hangs (and fail). Returns (exit code, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10)
        pytest.fail(f"supervisor {proc.pid} did not stop within {timeout}s")
    return proc.returncode, err


def runtime(store: Path) -> dict:
    return json.loads((store / RUNTIME_FILE).read_text())


def wait_committed(engine: SyntheticEngine, timeout: float = 60, settle: float = 2.0,
                   seqs: dict[str, list[int]] | None = None) -> dict:
    """Sequences of ``seqs`` (default: every accepted one) not fully in the store, once
    commit has caught up: none are missing, or the missing set has not changed for
    ``settle`` seconds."""
    deadline = time.monotonic() + timeout
    last, since = None, time.monotonic()
    while True:
        missing = {
            sid: t for sid, t in (engine.accepted if seqs is None else seqs).items()
            if engine.client.lookup(t) < len(t)
        }
        if missing.keys() != last:
            last, since = missing.keys(), time.monotonic()
        if not missing or time.monotonic() - since > settle or time.monotonic() > deadline:
            return missing
        time.sleep(0.1)


def check_restores(engine: SyntheticEngine, seqs: dict[str, list[int]]) -> int:
    """Restore each sequence into zeroed blocks; every page must come back byte for byte."""
    pages = 0
    for sid, tokens in seqs.items():
        restored, exact = engine.restore_exact(tokens)
        assert restored == exact == len(engine.keys(tokens)), (sid, restored, exact)
        pages += restored
    return pages


def check_stopped(stopped: tuple[int, str], store: Path, instance: str) -> None:
    """The supervisor stopped cleanly, the store passes fsck, /dev/shm is empty."""
    rc, err = stopped
    assert rc == 0, err[-3000:]
    report = fsck(store)
    assert report.ok, report.problems
    assert instance_entries(instance) == []


@contextlib.contextmanager
def pipeline(store: Path, instance: str, settings: dict[str, str] | None = None,
             env: dict | None = None, device: str = "cpu",
             blocks: int = BLOCKS) -> Iterator[SyntheticEngine]:
    """A supervisor (with ``settings`` on top of SETTINGS) and a synthetic engine of
    ``blocks`` KV blocks on ``store``. On leaving, the engine closes and the supervisor
    stops; unless the body failed, it must have stopped cleanly (``check_stopped``)."""
    settings = settings or {}
    flags = [a for k, v in settings.items() for a in (config.flag_name(k), v)]
    sup = start_supervisor(store, instance, *flags, env=env)
    engine = None
    try:
        cfg = make_cfg(store, instance, **settings)
        engine = SyntheticEngine.create(cfg, 0, device=device, blocks=blocks)
        yield engine
    finally:
        if engine is not None:
            engine.close()
        stopped = stop_supervisor(sup)
    check_stopped(stopped, store, instance)
