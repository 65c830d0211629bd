"""Shared fixtures. Every test that touches shared memory gets its own instance name,
and the fixture fails the test if any /dev/shm entry of that instance is left behind."""

from __future__ import annotations

import multiprocessing as mp
import uuid
from collections.abc import Iterator

import posix_ipc
import pytest
from sparkcache.shm.segment import instance_entries


def _unlink_all(instance: str) -> None:
    for entry in instance_entries(instance):
        try:
            if entry.startswith("sem."):
                posix_ipc.unlink_semaphore("/" + entry[len("sem.") :])
            else:
                posix_ipc.unlink_shared_memory("/" + entry)
        except posix_ipc.ExistentialError:
            pass


@pytest.fixture
def instance() -> Iterator[str]:
    name = "t" + uuid.uuid4().hex[:12]
    yield name
    left = instance_entries(name)
    if left:
        _unlink_all(name)  # keep later tests clean, but fail this one
        pytest.fail(f"/dev/shm entries of instance {name} left behind: {left}")


@pytest.fixture
def spawn() -> mp.context.SpawnContext:
    return mp.get_context("spawn")


def join_or_kill(proc: mp.process.BaseProcess, timeout: float = 60.0) -> int | None:
    """Join ``proc``; kill it if it outlives ``timeout`` and fail. Returns its exit code."""
    proc.join(timeout)
    if proc.is_alive():
        proc.kill()
        proc.join(10)
        pytest.fail(f"process {proc.pid} did not finish within {timeout}s")
    return proc.exitcode


def run_children(
    ctx: mp.context.BaseContext, procs: list[tuple], timeout: float
) -> tuple[list[tuple], list[int | None]]:
    """Start every ``(target, args)`` child with the write end of a pipe as its last
    argument; gather what they send until each closes it; join each (killed past
    ``timeout``). Returns (messages, exit codes)."""
    started = []
    for target, args in procs:
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=target, args=(*args, child))
        proc.start()
        child.close()
        started.append((proc, parent))
    messages: list[tuple] = []
    try:
        for _proc, parent in started:
            try:
                while True:
                    messages.append(parent.recv())
            except EOFError:
                pass
    finally:
        for proc, parent in started:
            proc.join(timeout)
            if proc.is_alive():
                proc.kill()
                proc.join()
            parent.close()
    return messages, [proc.exitcode for proc, _ in started]
