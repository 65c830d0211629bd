"""What capture writes into a capture slot for commit: a header, one entry per page of
the publication, then the copied pages (the page delta), each 64-byte aligned.

The slot carries the whole publication, not only a ring record, so a commit worker that
restarts can redo every slot it holds from the slot alone.
"""

from __future__ import annotations

import numpy as np

MAGIC = 0x5350_4B53_4C4F_5431  # "SPKSLOT1"
HEAD = np.dtype(
    [("magic", "<u8"), ("pub_id", "<u8"), ("root_hi", "<u8"), ("root_lo", "<u8"),
     ("npages", "<u4"), ("pad", "<u4"), ("page_bytes", "<u8")]
)
# offset -1: the store held this page at capture time, so it was not copied.
ENTRY = np.dtype([("key_hi", "<u8"), ("key_lo", "<u8"), ("offset", "<i8")])
_ALIGN = 64


def data_start(npages: int) -> int:
    end = HEAD.itemsize + ENTRY.itemsize * npages
    return (end + _ALIGN - 1) // _ALIGN * _ALIGN


def needed(npages: int, copied: int, page_bytes: int) -> int:
    """Slot bytes a publication of ``npages`` with ``copied`` delta pages needs."""
    stride = (page_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
    return data_start(npages) + copied * stride


def page_offsets(npages: int, first_copied: int, page_bytes: int) -> list[int]:
    stride = (page_bytes + _ALIGN - 1) // _ALIGN * _ALIGN
    start = data_start(npages)
    return [-1 if i < first_copied else start + (i - first_copied) * stride
            for i in range(npages)]


def views(slot: np.ndarray, npages: int) -> tuple[np.ndarray, np.ndarray]:
    """(header record view, entries view) of the slot's bytes ``slot`` (uint8)."""
    head = slot[: HEAD.itemsize].view(HEAD)
    entries = slot[HEAD.itemsize : HEAD.itemsize + ENTRY.itemsize * npages].view(ENTRY)
    return head, entries
