"""The ring in one process: semantics, errors, and a state-machine test against a deque."""

from __future__ import annotations

import os
import queue
import stat
import subprocess
from collections import deque

import numpy as np
import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule
from sparkcache.shm import (
    Consumer,
    LayoutMismatch,
    Producer,
    RecordLayout,
    Ring,
    RingClosed,
    RingCorrupt,
    RingEmpty,
    RingFull,
    SegmentError,
    segment_name,
)
from sparkcache.shm.layouts import LOAD, PUBLISH
from sparkcache.shm.ring import _CLOSED, _CONSUMER_PID, _POSTED, _PRODUCER_PID
from sparkcache.shm.segment import instance_entries

LAYOUT = RecordLayout("test-rec", 1, np.dtype([("seq", "<u8"), ("val", "<i4"), ("tag", "<u2")]))


@pytest.fixture
def ring(instance: str):
    r = Ring.create(segment_name(instance, 0, "ring"), LAYOUT, 8)
    # prefetch=1: these tests check space coming back record by record
    p, c = Producer(r.name, LAYOUT), Consumer(r.name, LAYOUT, spin_s=0, prefetch=1)
    yield r, p, c
    c.close()
    p.detach()
    r.close()


@pytest.mark.parametrize("layout", [PUBLISH, LOAD], ids=lambda x: x.name)
def test_a_batch_holds_its_shared_fields_in_every_record(layout: RecordLayout) -> None:
    names = layout.dtype.names[::2]
    values = [i + 1.5 if layout.dtype[n].kind == "f" else 2**layout.dtype[n].itemsize + i
              for i, n in enumerate(names)]
    recs = layout.shared(*names).batch(5, *values)
    expected = np.zeros(5, layout.dtype)
    for name, value in zip(names, values, strict=True):
        expected[name] = value
    assert recs.dtype == layout.dtype and recs.tobytes() == expected.tobytes()
    recs["npages"] = 7  # writable, and the records independent of one another
    recs[0]["reg_gen"] = 9
    assert recs["reg_gen"].tolist() == [9] + [expected["reg_gen"][1]] * 4
    assert layout.shared(names[0]).batch(0, 1).shape == (0,)
    for bad in (("nope",), names[1::-1], (names[0], names[0]), ()):
        with pytest.raises(ValueError, match=f"{layout.name} records: shared fields"):
            layout.shared(*bad)


def test_push_pop_in_order_with_wraparound(ring):
    r, p, c = ring
    for i in range(50):
        p.try_push((i, -i, 7))
        assert c.try_pop() == (i, -i, 7)
    batch = LAYOUT.array([(100 + i, i, 8) for i in range(6)])
    p.push_batch(batch)  # wraps around the end of the 8-record ring
    got = c.pop_batch(100)
    assert got.tolist() == batch.tolist()
    assert r.depth() == 0


def test_full_and_empty_raise_queue_exceptions(ring):
    _, p, c = ring
    with pytest.raises(queue.Empty):
        c.try_pop()
    for i in range(8):
        p.try_push((i, 0, 0))
    with pytest.raises(queue.Full):
        p.try_push((9, 0, 0))
    with pytest.raises(RingFull):
        p.push_batch(LAYOUT.array([(1, 1, 0)]))
    assert c.try_pop()[0] == 0
    p.try_push((8, 0, 0))  # space came back batch by batch
    assert [c.try_pop()[0] for _ in range(8)] == list(range(1, 9))
    with pytest.raises(RingEmpty):
        c.pop(timeout=0.01)


def test_a_half_read_batch_keeps_its_space(ring):
    _, p, c = ring
    p.push_batch(LAYOUT.array([(i, 0, 0) for i in range(6)]))
    assert len(c.pop_batch(3)) == 3
    p.push_batch(LAYOUT.array([(6, 0, 0), (7, 0, 0)]))
    with pytest.raises(RingFull):
        p.try_push((8, 0, 0))  # the first batch's 3 read records are not back yet
    assert c.pop_batch(10)["seq"].tolist() == [3, 4, 5, 6, 7]
    p.try_push((8, 0, 0))


def test_a_strided_batch_is_copied_whole(ring):
    _, p, c = ring
    rows = LAYOUT.array([(i, -i, 3) for i in range(8)])[::2]  # not contiguous
    p.push_batch(rows)
    assert c.pop_batch(10).tolist() == rows.tolist()


def test_batch_larger_than_ring_is_refused(ring):
    _, p, _ = ring
    with pytest.raises(ValueError, match="cannot fit a ring of 8"):
        p.push_batch(LAYOUT.array([(i, 0, 0) for i in range(9)]))


def test_wrong_dtype_for_batch_is_refused(ring):
    _, p, _ = ring
    with pytest.raises(TypeError, match="expected"):
        p.push_batch(np.zeros(2, np.dtype([("seq", "<u8")])))


def test_close_drains_then_raises_closed(ring):
    _, p, c = ring
    p.try_push((1, 0, 0))
    p.close()
    assert c.pop(timeout=1)[0] == 1
    with pytest.raises(RingClosed):
        c.pop(timeout=1)


def test_segment_and_semaphores_are_0600_and_removed(instance):
    r = Ring.create(segment_name(instance, 3, "pub"), LAYOUT, 4)
    entries = instance_entries(instance)
    assert len(entries) == 3  # the segment and its data/space semaphores
    for e in entries:
        assert stat.S_IMODE(os.stat(f"/dev/shm/{e}").st_mode) == 0o600
    r.close()
    assert instance_entries(instance) == []


def test_attach_with_other_record_version_fails_clearly(instance):
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, LAYOUT, 4):
        v2 = RecordLayout("test-rec", 2, LAYOUT.dtype)
        with pytest.raises(SegmentError, match=r"'test-rec' v1 .* this code reads 'test-rec' v2"):
            Consumer(name, v2)


def test_attach_with_other_dtype_fails_clearly(instance):
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, LAYOUT, 4):
        other = RecordLayout("test-rec", 1, np.dtype([("seq", "<u8"), ("val", "<u8")]))
        with pytest.raises(LayoutMismatch, match="record dtype fingerprint"):
            Producer(name, other)


def test_attach_to_missing_ring_fails_clearly(instance):
    with pytest.raises(SegmentError, match="does not exist"):
        Consumer(segment_name(instance, 0, "nothing"), LAYOUT)


def test_second_live_consumer_is_refused(ring):
    r, _, _ = ring
    with pytest.raises(SegmentError, match="already has a consumer"):
        Consumer(r.name, LAYOUT)


class RingModel(RuleBasedStateMachine):
    """The ring against a deque. Space returns batch by batch, so the model tracks the
    batches too: a record still occupies space until its whole batch has been copied
    out. A single pop copies out up to PREFETCH records already in the ring; the model
    keeps those in ``buffered``, which a re-attached consumer has lost (at most once)."""

    CAPACITY = 16
    PREFETCH = 5

    def __init__(self) -> None:
        super().__init__()
        import uuid

        self.instance = "t" + uuid.uuid4().hex[:12]
        self.ring = Ring.create(segment_name(self.instance, 0, "ring"), LAYOUT, self.CAPACITY)
        self.p = Producer(self.ring.name, LAYOUT)
        self.c = self._consumer()
        self.model: deque[tuple] = deque()  # records in the ring
        self.batches: deque[list[int]] = deque()  # [size, not yet copied out] per batch
        self.buffered: deque[tuple] = deque()  # copied out by pop, not yet returned
        self.next = 0

    def _consumer(self) -> Consumer:
        return Consumer(self.ring.name, LAYOUT, spin_s=0, prefetch=self.PREFETCH)

    def occupied(self) -> int:
        return sum(size for size, _ in self.batches)

    def _copy_out(self, n: int) -> list[tuple]:
        out = []
        for _ in range(n):
            out.append(self.model.popleft())
            self.batches[0][1] -= 1
            if self.batches[0][1] == 0:
                self.batches.popleft()
        return out

    @rule(n=st.integers(1, 20))
    def push(self, n: int) -> None:
        rows = [(self.next + i, i, 9) for i in range(n)]
        if n > self.CAPACITY:
            with pytest.raises(ValueError):
                self.p.push_batch(LAYOUT.array(rows))
            return
        if self.occupied() + n > self.CAPACITY:
            with pytest.raises(RingFull):
                self.p.push_batch(LAYOUT.array(rows)) if n > 1 else self.p.try_push(rows[0])
            return
        if n == 1:
            self.p.try_push(rows[0])
        else:
            self.p.push_batch(LAYOUT.array(rows))
        self.model.extend(rows)
        self.batches.append([n, n])
        self.next += n

    @rule()
    def pop_one(self) -> None:
        if not self.buffered:
            if not self.model:
                with pytest.raises(RingEmpty):
                    self.c.try_pop()
                return
            self.buffered.extend(self._copy_out(min(self.PREFETCH, len(self.model))))
        assert self.c.try_pop() == self.buffered.popleft()

    @rule(n=st.integers(1, 40))
    def pop_many(self, n: int) -> None:
        if self.buffered:
            want = [self.buffered.popleft() for _ in range(min(n, len(self.buffered)))]
        elif self.model:
            want = self._copy_out(min(n, len(self.model)))
        else:
            with pytest.raises(RingEmpty):
                self.c.pop_batch(n)
            return
        assert self.c.pop_batch(n).tolist() == want

    @rule()
    def reattach_consumer(self) -> None:
        """A new consumer continues exactly where the old one stopped copying out."""
        self.c.close()
        self.c = self._consumer()
        self.buffered.clear()

    @invariant()
    def depth_matches(self) -> None:
        assert self.ring.depth() == len(self.model)

    def teardown(self) -> None:
        self.c.close()
        self.p.detach()
        self.ring.close()
        assert instance_entries(self.instance) == []


RingModel.TestCase.settings = settings(max_examples=150, stateful_step_count=60, deadline=None)
test_ring_state_machine = RingModel.TestCase


def test_consumer_that_died_holding_an_unrecorded_post_is_recovered(instance, spawn):
    """SIGKILL between a successful wait and recording it, made deterministic: take a
    data post by hand, mark the consumer as a dead process, and attach a new one."""
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, LAYOUT, 4) as ring:
        p = Producer(name, LAYOUT)
        p.push_batch(LAYOUT.array([(0, 0, 0), (1, 0, 0)]))
        p.push_batch(LAYOUT.array([(2, 0, 0), (3, 0, 0)]))  # the ring is now full
        dead = spawn.Process(target=int)
        dead.start()
        dead.join()
        c = Consumer(name, LAYOUT, spin_s=0)
        c._m.data.acquire(0)  # the post for batch 0, taken and never recorded
        c._m.set_u64(_CONSUMER_PID, dead.pid)  # a process that has exited
        c._m.close()
        c2 = Consumer(name, LAYOUT, spin_s=0)
        assert c2.pop_batch(2)["seq"].tolist() == [0, 1]
        p.try_push((4, 0, 0))  # space came back: no deadlock
        p.close()
        assert c2.pop_batch(10)["seq"].tolist() == [2, 3, 4]
        with pytest.raises(RingClosed):
            c2.pop(timeout=1)
        c2.close()
        assert ring.depth() == 0


def test_consumer_killed_holding_every_post_is_recovered_when_the_producer_blocks(
    instance, spawn
):
    """The successor of a consumer killed holding the only post of a full ring has no post
    of its own to read under; the producer, blocked, pushes an empty batch to give it
    one. No deadlock, nothing lost, and the post taken unrecorded is adopted."""
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, LAYOUT, 4) as ring:
        p = Producer(name, LAYOUT)
        p.push_batch(LAYOUT.array([(i, 0, 0) for i in range(4)]))  # full
        dead = spawn.Process(target=int)
        dead.start()
        dead.join()
        c = Consumer(name, LAYOUT, spin_s=0)
        c._m.data.acquire(0)  # the only post, taken and never recorded
        c._m.set_u64(_CONSUMER_PID, dead.pid)
        c._m.close()
        c2 = Consumer(name, LAYOUT, spin_s=0)
        with pytest.raises(RingEmpty):
            c2.pop(timeout=0.05)
        with pytest.raises(RingFull):
            p.try_push((4, 0, 0))  # blocked: the empty batch goes out
        assert c2.pop_batch(10, timeout=1)["seq"].tolist() == [0, 1, 2, 3]
        assert c2.adopted == 1
        p.try_push((4, 0, 0))  # the space came back
        assert c2.pop(timeout=1)[0] == 4
        p.close()
        with pytest.raises(RingClosed):
            c2.pop(timeout=1)
        c2.close()
        assert ring.depth() == 0


def test_consumer_attaching_to_a_closed_drained_ring_sees_it_closed(ring):
    r, p, c = ring
    p.try_push((1, 0, 0))
    p.close()
    assert c.pop(timeout=1)[0] == 1
    with pytest.raises(RingClosed):
        c.pop(timeout=1)
    c.close()
    late = Consumer(r.name, LAYOUT, spin_s=0)
    with pytest.raises(RingClosed):
        late.pop(timeout=5)
    late.close()


@pytest.mark.parametrize("end", ["producer", "consumer"])
def test_an_end_whose_pid_was_reused_does_not_lock_the_ring(instance: str, end: str) -> None:
    """An end SIGKILLed while attached leaves its pid in the ring; once the kernel gives
    that pid to an unrelated live process, a new end still attaches (it was refused until
    that process exited). A live process that maps the ring still holds its end."""
    name = segment_name(instance, 0, "ring")
    with Ring.create(name, LAYOUT, 4) as r, subprocess.Popen(["sleep", "60"]) as other:
        try:
            cls, word = (Producer, _PRODUCER_PID) if end == "producer" else (
                Consumer, _CONSUMER_PID)
            first = cls(r.name, LAYOUT)
            with pytest.raises(SegmentError, match=f"already has a {end}"):
                cls(r.name, LAYOUT)  # this process maps the ring: the end is taken
            first._m.set_u64(word, other.pid)  # as if killed, its pid now the sleep's
            first._m.close()
            second = cls(r.name, LAYOUT)
            assert second._m.u64(word) == os.getpid()
            if end == "consumer":
                second.close()
            else:
                second.detach()
        finally:
            other.kill()


def stray_write(r: Ring, batch: int, word: int, value: int) -> None:
    """Overwrite word 0 (end) or 1 (seq) of batch ``batch``'s TABLE entry, as a stray
    write through the owner's mapping would."""
    m = r._m
    m.words[m.table_word + 2 * (batch % m.entries) + word] = value


@pytest.mark.parametrize("end", [2**40, 3], ids=["far_past_the_tail", "before_its_predecessor"])
def test_a_batch_end_the_protocol_cannot_give_is_a_fault_and_nothing_stale_is_served(
        ring, end: int) -> None:
    """A TABLE entry with an impossible end made every later pop replay stale records
    (8.2 M in a probe); now the consumer refuses it, and every pop after."""
    r, p, c = ring
    p.push_batch(LAYOUT.array([(i, 0, 0) for i in range(5)]))
    assert [c.try_pop()[0] for _ in range(5)] == list(range(5))
    p.try_push((5, 0, 0))
    stray_write(r, 1, 0, end)
    with pytest.raises(RingCorrupt, match=rf"ring {r.name} is corrupt: batch 1 ends at record "
                                          rf"{end}, outside \[5, 13\]"):
        c.try_pop()
    with pytest.raises(RingCorrupt):
        c.pop(timeout=0.01)


def test_a_post_without_a_batch_on_an_open_ring_is_a_fault_not_a_close(ring) -> None:
    r, p, c = ring
    p.try_push((1, 0, 0))
    stray_write(r, 0, 1, 12345)  # seq: reads as no batch
    assert r._m.u64(_CLOSED) == 0
    with pytest.raises(RingCorrupt, match="post 0 has no batch and the ring is not closed"):
        c.try_pop()


def test_adoption_takes_no_more_posts_than_can_be_in_flight(instance: str) -> None:
    """A successor adopts posts its killed predecessor took unrecorded, counted from
    ``posted``: a stray ``posted`` made it walk the table round and round."""
    r = Ring.create(segment_name(instance, 0, "ring"), LAYOUT, 8)
    p = Producer(r.name, LAYOUT)
    first = Consumer(r.name, LAYOUT, spin_s=0)
    try:
        p.try_push((1, 0, 0))
        first._m.set_u64(_CONSUMER_PID, 2**22 + 12345)  # as if killed: a pid no one has
        first._m.close()
        r._m.set_u64(_POSTED, 10**9)
        successor = Consumer(r.name, LAYOUT, spin_s=0)
        with pytest.raises(RingCorrupt, match="data posts to adopt, where at most 20"):
            successor.try_pop()
        successor.close()
    finally:
        p.detach()
        r.close()


def test_ends_used_in_a_forked_child_refuse_and_leave_the_parents_ring_alone(ring) -> None:
    """A child forked with the parent's ends (a worker's helper, a test) pushed TABLE
    entries the parent then overwrote, and its exit could close the parent's ring."""
    r, p, c = ring
    p.try_push((1, 0, 0))
    pid = os.fork()
    if pid == 0:  # the child: exit codes say what it saw
        code = 0
        try:
            p.try_push((99, 0, 0))
            code = 10
        except RingCorrupt:
            pass
        try:
            c.try_pop()
            code = code or 11
        except RingCorrupt:
            pass
        p.close()
        c.close()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    p.try_push((2, 0, 0))  # the parent's ends carry on: the child closed nothing
    assert [c.try_pop()[0] for _ in range(2)] == [1, 2]
    assert r._m.u64(_CLOSED) == 0 and r._m.u64(_PRODUCER_PID) == os.getpid()
