"""Announcing hand-overs of arena slots on a ring, in order, and again while they wait.

Capture tells commit which slots it filled (``filled``); commit tells capture which it
freed (``freed``). Each receiver reads a slot only under such a record (its semaphore
orders the sender's writes before the receiver's reads), so a record must never be lost:

* records go out in the order the hand-overs were made; one the full ring refuses waits,
  and every later one waits behind it (commit relies on hand-over order);
* a slot still held by the receiver's role with the same generation ``REMIND_AFTER_S``
  after its record was pushed gets it again: a receiver that died after popping it, or
  restarted since, learns of it that way. Duplicates are harmless: a receiver checks the
  owner and generation, and ignores a record that no longer matches.
"""

from __future__ import annotations

import time
from collections import deque

from sparkcache.shm import Producer, RingFull, SlotArena

# A record is pushed again this long after its last push while its slot still waits.
REMIND_AFTER_S = 1.0


class SlotAnnouncer:
    def __init__(self, ring: Producer, arena: SlotArena, owner: int) -> None:
        self._ring = ring
        self._arena = arena
        self._owner = owner  # the receiving role's owner value
        self._waiting: deque[tuple[int, int]] = deque()  # (slot, generation), in order
        self._pushed: dict[int, tuple[int, float]] = {}  # slot -> (generation, pushed at)

    def add(self, slot: int) -> None:
        """Announce slot ``slot``, just handed over to the receiving role."""
        self._waiting.append((slot, int(self._arena.state[slot]["generation"])))
        self.flush()

    def flush(self) -> None:
        """Push what waits, in order, and queue again every slot due a reminder. A stale
        read of a slot's state (the receiver's write not visible yet) only delays
        forgetting it, or repeats a record the receiver ignores."""
        now = time.monotonic()
        for slot, (generation, pushed) in list(self._pushed.items()):
            st = self._arena.state[slot]
            if int(st["owner"]) != self._owner or int(st["generation"]) != generation:
                del self._pushed[slot]
            elif now - pushed >= REMIND_AFTER_S and (slot, generation) not in self._waiting:
                self._waiting.append((slot, generation))
        while self._waiting:
            slot, generation = self._waiting[0]
            try:
                self._ring.try_push((slot, 0, generation))
            except RingFull:
                return
            self._waiting.popleft()
            self._pushed[slot] = (generation, now)
