"""Segments, sweep, slot arena and stats blocks."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import posix_ipc
import psutil
import pytest
import sparkcache.shm.segment as shm_segment
from sparkcache.shm import (
    FREE,
    ForeignSegment,
    LayoutMismatch,
    Producer,
    RecordLayout,
    Ring,
    Segment,
    SegmentError,
    SlotArena,
    SlotOwnershipError,
    StatsBlock,
    open_semaphore,
    segment_name,
    sweep,
)
from sparkcache.shm.arena import writer_dead
from sparkcache.shm.segment import (
    SegmentSpec,
    creator_alive,
    foreign_entries,
    instance_entries,
    process_start,
    user,
)

from tests.conftest import join_or_kill

SPEC = SegmentSpec("test", 1)
WORKER = RecordLayout(
    "worker-stats", 1,
    np.dtype([("pid", "<u4"), ("state", "<u4"), ("heartbeat", "<f8"), ("a", "<u8"), ("b", "<u8")]),
)


def test_header_is_checked_on_attach(instance):
    name = segment_name(instance, 0, "seg")
    with Segment.create(name, SPEC, 100) as seg:
        assert stat.S_IMODE(os.stat("/dev/shm" + name).st_mode) == 0o600
        assert int(seg.header[0]["creator_pid"]) == os.getpid()
        with pytest.raises(LayoutMismatch, match="layout version is 1, this code expects 2"):
            Segment.attach(name, SegmentSpec("test", 2))
        with pytest.raises(LayoutMismatch, match="kind is 'test', this code expects 'ring'"):
            Segment.attach(name, SegmentSpec("ring", 1))
        with Segment.attach(name, SPEC) as other:
            assert not other.owner
        assert instance_entries(instance)  # an attacher's close never unlinks


def test_names_are_validated():
    with pytest.raises(ValueError, match="instance 'a/b'"):
        segment_name("a/b", 0, "x")
    with pytest.raises(ValueError, match="role"):
        segment_name("ok", 0, "../x")


def test_two_users_instances_of_one_name_never_meet(instance):
    """Each user's supervisor runs instance ``default`` unless told otherwise: their
    names carry the user's id, so one's segments neither block nor serve the other's
    (and an engine under the wrong account is told whose segments it missed)."""
    name = segment_name(instance, 0, "seg")
    assert name == f"/sparkcache.u{os.geteuid()}.{instance}.r0.seg"
    theirs = f"/sparkcache.u{NOBODY}.{instance}.r0.seg"
    with Segment.create(theirs, SPEC, 100) as seg:
        os.chown(_shm(theirs), NOBODY, -1)
        assert foreign_entries(instance) == [] and sweep(instance) == []
        with pytest.raises(SegmentError) as e:
            Segment.attach(name, SPEC)
        assert str(e.value) == (
            f"shared-memory segment {name} does not exist; {user(NOBODY)} run(s) that "
            "instance: segments are per user, so run the engine under the supervisor's "
            "account")
        with Segment.create(name, SPEC, 100):  # ours, beside theirs
            assert instance_entries(instance) == [name[1:]]
        assert seg.owner


def _create_and_exit(name: str, ring_name: str) -> None:
    Segment.create(name, SPEC, 64)
    Ring.create(ring_name, WORKER, 4)
    os._exit(0)  # die without cleaning up, like a SIGKILLed supervisor


def test_sweep_removes_only_dead_creators_segments(instance, spawn):
    other = instance + "x"
    mine_live = Segment.create(segment_name(instance, 0, "live"), SPEC, 64)
    other_dead = spawn.Process(
        target=_create_and_exit,
        args=(segment_name(other, 0, "dead"), segment_name(other, 0, "ring")),
    )
    dead = spawn.Process(
        target=_create_and_exit,
        args=(segment_name(instance, 0, "dead"), segment_name(instance, 1, "ring")),
    )
    for p in (dead, other_dead):
        p.start()
        assert join_or_kill(p) == 0
    try:
        removed = sweep(instance)
        assert sorted(removed) == sorted(
            segment_name(instance, r, n) + suffix
            for r, n, suffix in [(0, "dead", ""), (1, "ring", ""), (1, "ring", ".data"),
                                 (1, "ring", ".space")]
        )
        assert instance_entries(instance) == [segment_name(instance, 0, "live")[1:]]
        assert len(instance_entries(other)) == 4  # another instance is never touched
    finally:
        mine_live.close()
        sweep(other)
    assert instance_entries(other) == []


def test_sweep_keeps_the_semaphores_of_a_ring_made_while_it_runs(instance, monkeypatch):
    """A second supervisor of the instance starting beside the first: its sweep listed
    the segments before the first made a ring, then found that ring's semaphores with
    no segment listed for them and unlinked them; no end could attach to the ring."""
    name = segment_name(instance, 0, "ring")
    made: list[Ring] = []

    class RingMadeAfterTheListing(type(shm_segment.SHM_DIR)):
        def glob(self, pattern):
            listed = list(super().glob(pattern))
            if not pattern.startswith("sem.") and not made:
                made.append(Ring.create(name, WORKER, 4))
            return iter(listed)

    monkeypatch.setattr(shm_segment, "SHM_DIR",
                        RingMadeAfterTheListing(shm_segment.SHM_DIR))
    try:
        assert sweep(instance) == []
        assert len(instance_entries(instance)) == 3
        producer = Producer(name, WORKER)  # opens both semaphores by name
        producer.detach()
    finally:
        made[0].close()


def test_arena_hands_slots_over(instance):
    CAPTURE, COMMIT = 1, 2
    with SlotArena.create(segment_name(instance, 0, "slots"), 3, 4096) as arena:
        assert [i for i, _ in arena.held_by(FREE)] == [0, 1, 2]
        arena.hand_over(0, FREE, CAPTURE)
        arena.slot_array(0)[:4] = [1, 2, 3, 4]
        arena.hand_over(0, CAPTURE, COMMIT, used=4)
        assert [i for i, _ in arena.held_by(FREE)] == [1, 2]
        with pytest.raises(SlotOwnershipError, match="owned by 2, not 1"):
            arena.hand_over(0, CAPTURE, FREE)
        with SlotArena.attach(arena.name) as seen:
            assert seen.slot_array(0)[:4].tobytes() == b"\x01\x02\x03\x04"
            assert int(seen.state[0]["used"]) == 4 and int(seen.state[0]["owner"]) == COMMIT
            # Read with no record covering it: the owner, then a copy of the rest.
            assert seen.held(0, CAPTURE) is None and seen.held(1, COMMIT) is None
            held = seen.held(0, COMMIT)
            assert (int(held["generation"]), int(held["pid"])) == (1, os.getpid())
            arena.hand_over(1, FREE, CAPTURE)
            arena.hand_over(1, CAPTURE, FREE)
            assert int(seen.held(1, FREE)["generation"]) == 1
        arena.hand_over(0, COMMIT, FREE)
        assert [i for i, _ in arena.held_by(FREE)] == [0, 1, 2] and int(arena.state[0]["used"]) == 0
        with pytest.raises(IndexError, match="expected 0-2"):
            arena.slot_array(3)


def _wall_clock_stepped(monkeypatch: pytest.MonkeyPatch, seconds: float) -> None:
    """What a step of the wall clock does to psutil: the boot time it adds to a process's
    start (``btime`` of /proc/stat, whole seconds worked out from the wall clock) moves."""
    import psutil._pslinux as pslinux

    boot = pslinux.boot_time()
    monkeypatch.setattr(pslinux, "boot_time", lambda: boot + seconds)


def test_a_wall_clock_step_leaves_a_live_process_alive(instance, monkeypatch):
    """CI once took the live test process, writer of a slot it had handed over, for dead:
    psutil's start times move with the wall clock, and a step of a second made the same
    process's two readings differ by exactly the tolerance. Starts since boot do not."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(child.pid)
        with SlotArena.create(segment_name(instance, 0, "slots"), 1, 4096) as arena:
            arena.hand_over(0, FREE, 1)
            _wall_clock_stepped(monkeypatch, 1.0)
            assert creator_alive(child.pid, start)
            assert not writer_dead(arena.held(0, 1))
            assert sweep(instance) == []  # the arena's creator lives
            assert not creator_alive(child.pid, start + 0.01)  # a pid reused: another start
            arena.hand_over(0, 1, FREE)
    finally:
        child.kill()
        child.wait()
    assert not creator_alive(child.pid, start) and process_start(child.pid) == 0.0


def test_a_segment_of_another_header_version_is_judged_by_its_pid_alone(instance):
    """Header version 1 held a wall-clock start: compared with a start since boot it
    would call every live creator dead, and a sweep unlink a running engine's KV."""
    with Segment.create(segment_name(instance, 0, "old"), SPEC, 64) as seg:
        seg.header[0]["header_version"] = 1
        seg.header[0]["creator_start"] = 1.8e9
        assert sweep(instance) == []
        seg.header[0]["creator_pid"] = 2**31 - 1  # a pid no process has
        assert sweep(instance) == [seg.name]


def test_the_start_of_a_process_named_with_spaces_and_parentheses(instance):
    """/proc/<pid>/stat puts the command name, which the process chooses, before the
    start: parsed from the last parenthesis, a name like this one cannot shift it."""
    name = b"a) b (c 1 2 3"[:15]  # the kernel keeps 15 bytes
    set_name = f"import ctypes; ctypes.CDLL(None).prctl(15, {name!r}, 0, 0, 0)"
    child = subprocess.Popen(
        [sys.executable, "-c", f"{set_name}; print(flush=True); import time; time.sleep(60)"],
        stdout=subprocess.PIPE)
    try:
        child.stdout.readline()
        assert Path(f"/proc/{child.pid}/comm").read_bytes().rstrip(b"\n") == name
        psutil_since_boot = psutil.Process(child.pid).create_time() - psutil.boot_time()
        assert process_start(child.pid) == pytest.approx(psutil_since_boot, abs=0.02)
    finally:
        child.kill()
        child.wait()
        child.stdout.close()


def test_stats_block_round_trip_and_version_check(instance):
    name = segment_name(instance, 0, "stats")
    with StatsBlock.create(name, WORKER, 3) as block:
        assert block.read(0) is None
        block.write(1, (42, 2, 1.5, 7, 8))
        with StatsBlock.attach(name, WORKER) as reader:
            assert reader.read(1) == (42, 2, 1.5, 7, 8) and reader.read(0) is None
        v2 = RecordLayout("worker-stats", 2, WORKER.dtype)
        with pytest.raises(LayoutMismatch):
            StatsBlock.attach(name, v2)


def _hammer(name: str, n: int) -> None:
    block = StatsBlock.attach(name, WORKER)
    for i in range(1, n + 1):
        block.write(0, (i, i, float(i), i, i))
    block.close()


def test_stats_reader_never_sees_a_torn_record(instance, spawn):
    """A writer in another process rewrites the record as fast as it can; every field
    of every record read must come from the same write."""
    name = segment_name(instance, 0, "stats")
    with StatsBlock.create(name, WORKER, 1) as block:
        writer = spawn.Process(target=_hammer, args=(name, 200_000))
        writer.start()
        seen = 0
        while writer.is_alive() or seen == 0:
            rec = block.read(0)
            if rec is not None:
                assert len(set(rec)) == 1, rec
                seen += 1
        assert join_or_kill(writer) == 0
        assert block.read(0)[0] == 200_000
        assert seen > 100


# ------------------------------------------------------------------ ownership (as root here)

NOBODY = 65534


def _shm(name: str) -> str:
    return "/dev/shm/" + name.lstrip("/")


def test_attach_refuses_a_segment_of_another_user_or_mode(instance):
    name = segment_name(instance, 0, "seg")
    with Segment.create(name, SPEC, 100):
        os.chown(_shm(name), NOBODY, -1)
        with pytest.raises(ForeignSegment) as e:
            Segment.attach(name, SPEC)
        assert str(e.value) == (
            f"shared-memory segment {name} is owned by {user(NOBODY)}, not by this user "
            f"({user(os.geteuid())}); refusing to use it"
        )
        assert f"uid {NOBODY}" in str(e.value)
        os.chown(_shm(name), os.geteuid(), -1)
        os.chmod(_shm(name), 0o644)
        with pytest.raises(ForeignSegment, match=rf"{name} has mode 0644 \(owner uid 0"):
            Segment.attach(name, SPEC)
        os.chmod(_shm(name), 0o600)
        Segment.attach(name, SPEC).close()  # its own again: fine
        link = segment_name(instance, 0, "link")
        os.symlink(_shm(name), _shm(link))
        try:
            with pytest.raises(ForeignSegment, match=rf"{link} is .*a symlink"):
                Segment.attach(link, SPEC)
        finally:
            os.unlink(_shm(link))


def test_open_semaphore_checks_owner_and_mode(instance):
    name = segment_name(instance, 0, "sem")
    path = "/dev/shm/sem." + name[1:]
    with pytest.raises(posix_ipc.ExistentialError):
        open_semaphore(name)
    posix_ipc.Semaphore(name, posix_ipc.O_CREX, mode=0o600).close()
    try:
        sem = open_semaphore(name)
        sem.release()
        sem.close()
        os.chown(path, NOBODY, -1)
        with pytest.raises(ForeignSegment, match=rf"semaphore {name} is owned by uid {NOBODY}"):
            open_semaphore(name)
        os.chown(path, os.geteuid(), -1)
        os.chmod(path, 0o666)
        with pytest.raises(ForeignSegment, match=rf"semaphore {name} has mode 0666"):
            open_semaphore(name)
    finally:
        posix_ipc.unlink_semaphore(name)
    os.symlink("/etc/hostname", path)
    try:
        with pytest.raises(ForeignSegment, match=rf"semaphore {name} is a symlink"):
            open_semaphore(name)
    finally:
        os.unlink(path)


def test_create_names_the_owner_of_a_name_taken_already(instance):
    name = segment_name(instance, 0, "seg")
    taken = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=0o644, size=4096)
    taken.close_fd()
    os.chown(_shm(name), NOBODY, -1)
    try:
        with pytest.raises(SegmentError) as e:
            Segment.create(name, SPEC, 100)
        assert str(e.value) == (
            f"shared-memory segment {name} already exists: {_shm(name)} "
            f"(owner {user(NOBODY)}, mode 0644)"
        )
        # The sweep leaves another user's entry alone (it cannot judge its header) and
        # foreign_entries reports it, for the supervisor's one-line refusal.
        assert sweep(instance) == []
        assert foreign_entries(instance) == [f"{_shm(name)} (owner {user(NOBODY)}, mode 0644)"]
    finally:
        posix_ipc.unlink_shared_memory(name)


def test_sweep_never_waits_on_a_fifo(instance):
    """A FIFO planted under the instance's prefix used to block the sweep (and so the
    supervisor's start) forever in open()."""
    fifo = _shm(segment_name(instance, 0, "stats"))
    os.mkfifo(fifo, 0o600)
    try:
        done = threading.Event()
        t = threading.Thread(target=lambda: (sweep(instance), done.set()), daemon=True)
        t.start()
        finished = done.wait(10)
        if not finished:  # unblock the old code's open() so the thread ends
            os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
        t.join(10)
        assert finished, "sweep blocked on a FIFO"
        assert foreign_entries(instance) == [f"{fifo} (a FIFO, owner {user(0)})"]
    finally:
        os.unlink(fifo)


def test_a_ring_end_refuses_a_foreign_semaphore(instance):
    """A ring's semaphores are checked as its segment is: one another user owns (here:
    chowned to nobody) refuses the attach with a message naming it."""
    layout = RecordLayout("rec", 1, np.dtype([("v", "<u8")]))
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, layout, 8):
        os.chown("/dev/shm/sem." + name[1:] + ".data", NOBODY, -1)
        with pytest.raises(ForeignSegment, match=rf"semaphore {name}.data is owned by uid"):
            Producer(name, layout)
