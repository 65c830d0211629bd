"""What capture writes into a slot: a publication in parts, each fitting its slot."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from sparkcache.workers import slotfmt


@given(npages=st.integers(1, 3000), stored=st.integers(0, 3000), staged=st.sets(
    st.integers(0, 2999), max_size=200), page=st.integers(1, 64),
    nruns=st.integers(1, 8), slot_pages=st.integers(1, 400))
def test_parts_cover_the_delta_in_order_and_each_fits_its_slot(
        npages: int, stored: int, staged: set[int], page: int, nruns: int,
        slot_pages: int) -> None:
    runs = [page * 64] * nruns
    slot_bytes = slotfmt.data_start(0, nruns) + slot_pages * sum(runs)
    delta = [i for i in range(min(stored, npages), npages) if i not in staged]
    parts = slotfmt.plan_parts(npages, delta, slot_bytes, runs)
    if parts is None:
        assert slotfmt.fitting(slot_bytes, npages, runs) < 1 or \
            slotfmt.fitting(slot_bytes, None, runs) < 1
        return
    assert [i for p in parts for i in p] == delta
    *head, last = parts
    assert slotfmt.needed(npages, len(last), runs) <= slot_bytes
    for p in head:
        assert p and slotfmt.needed(len(p), len(p), runs) <= slot_bytes
    # As few parts as the slots allow: every part before the last two is full.
    per = slotfmt.fitting(slot_bytes, None, runs)
    assert all(len(p) == per for p in head[:-1])
    assert len(last) == min(len(delta), slotfmt.fitting(slot_bytes, npages, runs))


def test_a_slot_that_cannot_hold_a_page_beside_the_entries_is_too_small() -> None:
    runs = [4096]
    slot_bytes = slotfmt.data_start(100, 1) + 4095
    assert slotfmt.plan_parts(100, list(range(100)), slot_bytes, runs) is None


def test_a_part_reads_back_as_written() -> None:
    runs = [64, 64]
    n = 5
    keys = np.zeros(n, [("key_hi", "<u8"), ("key_lo", "<u8")])
    keys["key_hi"] = np.arange(n)
    copied = np.array([-1, -1, 0, 1, -1])
    slot = np.zeros(slotfmt.needed(n, 2, runs), np.uint8)
    slotfmt.write_header(slot, 7, (1, 2), keys, copied, runs, part=2, parts=3)
    got = slotfmt.read(slot)
    assert (got.pub_id, got.root, got.copied, got.part, got.parts) == (7, (1, 2), 2, 2, 3)
    assert got.last and got.entries["copied"].tolist() == copied.tolist()
    slotfmt.write_header(slot, 7, (1, 2), keys, copied, runs, part=0, parts=3)
    assert not slotfmt.read(slot).last
    slot[: slotfmt.HEAD.itemsize].view(slotfmt.HEAD)["part"] = 3
    with pytest.raises(ValueError, match="part 3 of 3"):
        slotfmt.read(slot)
