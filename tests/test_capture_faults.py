"""Capture and the shared-memory primitives under faults a long-running node meets: items
that keep failing, a segment swept while it is still being created, an engine that died
without unlinking its KV segment, a descriptor that reaches outside its tensors, a umask
that takes the owner's bits. Workers run in the test's process (worker_rig)."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import stat
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
import torch
from pipeline_util import sequences
from sparkcache.shm import Producer, RecordLayout, Ring
from sparkcache.shm.segment import (
    PAYLOAD_OFFSET,
    SHM_DIR,
    UNWRITTEN_GRACE_S,
    Segment,
    instance_entries,
    process_gone,
    process_start,
    segment_name,
    sweep,
)
from sparkcache.workers.capture import Capture
from worker_rig import rig

from sparkcache import kvmem, segments

SETTINGS = {"release_timeout_seconds": "5"}


def test_failing_publications_keep_one_log_entry_and_one_line(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Every publication whose copy fails is counted, but the rate-limited log keeps one
    entry (and writes one line a minute) for that kind of failure: named by publication
    id, it kept one entry per failure for as long as capture ran and logged each with
    its traceback."""

    def broken_fill(self: Capture, *args: object) -> None:
        raise RuntimeError("injected fault in a copy")

    monkeypatch.setattr(Capture, "_fill", broken_fill)
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        caplog.set_level(logging.WARNING, logger="sparkcache.workers.lifecycle")
        seqs = sequences(6, r.cfg.page_tokens, seed=12)
        for sid, tokens in seqs.items():
            assert r.engine.publish(sid, tokens, tries=1)
            r.step(2)
        assert r.engine.client.counters.capture_failed["failed"] == len(seqs)
        assert r.capture.life.item_errors == len(seqs)
        assert len(r.capture.life._rare._last) == 1
        lines = [rec for rec in caplog.records if "error while handling" in rec.getMessage()]
        assert len(lines) == 1


def test_a_segment_whose_pages_are_being_reserved_is_not_swept(
        instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Reserving an engine's KV cache (``posix_fallocate`` of tens of GiB) can take longer
    than the grace ``sweep`` gives a segment without a header; the header is written
    first, so a supervisor (re)starting meanwhile leaves the live engine's segment alone.
    It used to unlink it: capture and restore could never attach to that engine's KV."""
    real = os.posix_fallocate
    swept: list[str] = []

    def slow_fallocate(fd: int, offset: int, length: int) -> None:
        if length > PAYLOAD_OFFSET:  # the payload's pages: the long part
            old = time.time() - 10 * UNWRITTEN_GRACE_S
            os.utime(fd, (old, old))  # as if it had been going on that long
            swept.extend(sweep(instance))
        real(fd, offset, length)

    monkeypatch.setattr(os, "posix_fallocate", slow_fallocate)
    name = segment_name(instance, 0, segments.engine_segment_role(os.getpid()))
    seg = Segment.create(name, kvmem.KV_SPEC, 1 << 20, reserve=True)
    try:
        assert swept == []
        assert instance_entries(instance) == [name[1:]]
    finally:
        seg.close()


def _leave_kv(instance: str) -> None:
    """An engine that registers its KV cache and dies without unlinking it (SIGKILL)."""
    kvmem.SharedKVCaches.create(instance, 0, [(4, 8)], torch.float16)
    os._exit(0)


def test_an_engine_that_died_leaves_no_kv_segment_behind_its_successor(
        instance: str, spawn: mp.context.SpawnContext) -> None:
    """The next engine of the rank unlinks the KV segment of one that died without doing
    so; only a supervisor's start used to, so each engine restart under a running
    supervisor left a whole KV cache in /dev/shm, where the next adopt found no room."""
    child = spawn.Process(target=_leave_kv, args=(instance,))
    child.start()
    child.join(60)
    assert child.exitcode == 0
    assert len(instance_entries(instance)) == 1  # the dead engine's
    kv = kvmem.SharedKVCaches.create(instance, 0, [(4, 8)], torch.float16)
    try:
        assert instance_entries(instance) == [kv._seg.name[1:]]
        assert kvmem.unlink_dead_engines(instance, 0) == []  # its creator lives
        assert instance_entries(instance) == [kv._seg.name[1:]]
    finally:
        kv.close()


@pytest.mark.parametrize("unlink", [lambda inst: kvmem.unlink_dead_engines(inst, 0), sweep],
                         ids=["next engine", "supervisor start"])
def test_an_engine_exited_but_not_reaped_leaves_no_kv_segment(
        instance: str, spawn: mp.context.SpawnContext, unlink) -> None:
    """A zombie (exited, its parent not yet reaping it: vLLM's engine core under the
    process that started it) maps nothing and writes nothing more; its KV segment went
    only once it was reaped, although capture already took it for gone."""
    child = spawn.Process(target=_leave_kv, args=(instance,))
    child.start()
    try:
        deadline = time.monotonic() + 60
        while psutil.Process(child.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        [left] = instance_entries(instance)
        assert process_gone(child.pid, process_start(child.pid))
        assert unlink(instance) == ["/" + left]
        assert instance_entries(instance) == []
    finally:
        child.join(60)


def test_a_kv_descriptor_reaching_before_the_payload_is_refused(instance: str) -> None:
    """A descriptor names each tensor by its byte offset in the engine's segment; a
    negative one mapped the segment's header as KV (numpy counts from the mapping), which
    capture stored under a page key and a restore overwrote."""
    kv = kvmem.SharedKVCaches.create(instance, 0, [(4, 8)], torch.float16)
    try:
        desc = kvmem.describe(kv.tensors)
        opened = kvmem.open_tensors(desc)  # the engine's own descriptor opens
        opened.close()
        desc["tensors"][0]["offset"] = -PAYLOAD_OFFSET
        with pytest.raises(ValueError, match="offset"):
            kvmem.open_tensors(desc)
    finally:
        kv.close()


def test_ring_semaphores_are_0600_whatever_the_umask(instance: str) -> None:
    """sem_open applies the umask like shm_open; a segment's mode was set explicitly, a
    semaphore's was not, and under a umask that takes the owner's bits every end refused
    the supervisor's own rings (open_semaphore wants exactly 0600)."""
    layout = RecordLayout("umask-rec", 1, np.dtype([("seq", "<u8")]))
    old = os.umask(0o277)
    try:
        ring = Ring.create(segment_name(instance, 0, "ring"), layout, 4)
    finally:
        os.umask(old)
    try:
        modes = {e: stat.S_IMODE(os.lstat(SHM_DIR / e).st_mode)
                 for e in instance_entries(instance)}
        assert len(modes) == 3 and set(modes.values()) == {0o600}, modes
        Producer(ring.name, layout).detach()  # attaches: its checks pass
    finally:
        ring.close()


def test_capture_unlinks_the_kv_of_an_engine_that_died(
        tmp_path: Path, instance: str, spawn: mp.context.SpawnContext) -> None:
    """Capture drops a registration once its engine is gone; it now unlinks that engine's
    segment too: unmapped alone, a SIGKILLed engine's KV cache held its /dev/shm for as
    long as no other engine of the rank started. A live engine's segment stays."""
    with rig(tmp_path / "store", instance, **SETTINGS) as r:
        (sid, tokens), = sequences(1, r.cfg.page_tokens, seed=13).items()
        assert r.engine.publish(sid, tokens, tries=1)
        r.step(2)
        assert r.capture.reg is not None
        live = set(instance_entries(instance))
        child = spawn.Process(target=_leave_kv, args=(instance,))
        child.start()
        child.join(60)
        assert child.exitcode == 0
        assert len(set(instance_entries(instance)) - live) == 1  # the dead engine's
        r.capture.reg.owner = (child.pid, time.time())  # as if it had registered it
        r.capture._owner_check_at = 0.0  # due now
        r.capture._drop_dead_registration()
        assert r.capture.reg is None
        assert set(instance_entries(instance)) == live


def test_a_header_whose_pid_is_not_visible_yet_is_no_dead_creator(instance: str) -> None:
    """On arm64 another core may see a new segment's magic (written last) before its
    creator's pid (zeros until then): such a header is one not written yet, never a dead
    creator's, so neither the engine-side cleanup nor a sweep unlinks it."""
    name = segment_name(instance, 0, "kv1")
    seg = Segment.create(name, kvmem.KV_SPEC, 4096)
    try:
        seg.header[0]["creator_pid"] = 0
        seg.header[0]["creator_start"] = 0.0
        assert kvmem.unlink_dead_engines(instance, 0) == []
        sweep(instance)
        assert instance_entries(instance) == [name[1:]]
    finally:
        seg.close()
