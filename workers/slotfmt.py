"""What capture writes into a capture slot for commit: a header, one entry per page of
the publication, the run table, then the copied pages (the page delta) run-major.

Run-major: a page is a sequence of runs (one per layer and K/V, ``BlockViews.run_bytes``);
the slot holds run 0 of every copied page, then run 1 of every copied page, and so on.
That is the order capture can copy in with one C-level gather per run, and commit hands
each page to the store as its pieces, written with one ``writev`` (docs/pipeline.md).

The slot carries the whole publication, not only a ring record, so a commit worker that
restarts can redo every slot it holds from the slot alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MAGIC = 0x5350_4B53_4C4F_5432  # "SPKSLOT2"
HEAD = np.dtype(
    [("magic", "<u8"), ("pub_id", "<u8"), ("root_hi", "<u8"), ("root_lo", "<u8"),
     ("npages", "<u4"), ("nruns", "<u4"), ("copied", "<u8")]
)
# copied: the page's place among the copied pages; -1: the store held this page at
# capture time, so it was not copied.
ENTRY = np.dtype([("key_hi", "<u8"), ("key_lo", "<u8"), ("copied", "<i8")])
RUN = np.dtype("<u8")  # bytes of one run of one page
_ALIGN = 64


def data_start(npages: int, nruns: int) -> int:
    end = HEAD.itemsize + ENTRY.itemsize * npages + RUN.itemsize * nruns
    return (end + _ALIGN - 1) // _ALIGN * _ALIGN


def needed(npages: int, copied: int, run_bytes: list[int]) -> int:
    """Slot bytes a publication of ``npages`` with ``copied`` delta pages needs."""
    return data_start(npages, len(run_bytes)) + copied * sum(run_bytes)


def data(slot: np.ndarray, npages: int, copied: int, run_bytes: list[int]) -> np.ndarray:
    """The bytes the copied pages go to (``BlockViews.gather_runs`` fills them)."""
    start = data_start(npages, len(run_bytes))
    return slot[start : start + copied * sum(run_bytes)]


def write_header(slot: np.ndarray, pub_id: int, root: tuple[int, int], keys: np.ndarray,
                 first_copied: int, run_bytes: list[int]) -> None:
    """Header, entries (``keys`` has fields key_hi and key_lo) and run table."""
    n, nruns = len(keys), len(run_bytes)
    slot[: HEAD.itemsize].view(HEAD)[0] = (
        MAGIC, pub_id, root[0], root[1], n, nruns, n - first_copied
    )
    entries = slot[HEAD.itemsize : HEAD.itemsize + ENTRY.itemsize * n].view(ENTRY)
    entries["key_hi"], entries["key_lo"] = keys["key_hi"], keys["key_lo"]
    entries["copied"] = np.arange(n) - first_copied
    entries["copied"][:first_copied] = -1
    at = HEAD.itemsize + ENTRY.itemsize * n
    slot[at : at + RUN.itemsize * nruns].view(RUN)[:] = run_bytes


@dataclass(frozen=True)
class SlotContents:
    """A filled slot as commit reads it."""

    pub_id: int
    root: tuple[int, int]
    entries: np.ndarray  # ENTRY records, one per page of the publication
    run_bytes: list[int]
    copied: int
    start: int  # where the run-major page data begins

    @property
    def page_bytes(self) -> int:
        return sum(self.run_bytes)

    def pieces(self, slot: np.ndarray, copied_index: int) -> list[np.ndarray]:
        """The runs of copied page ``copied_index``, in page order."""
        out, at = [], self.start
        for size in self.run_bytes:
            lo = at + copied_index * size
            out.append(slot[lo : lo + size])
            at += self.copied * size
        return out


def read(slot: np.ndarray) -> SlotContents:
    """Parse a filled slot; ValueError if it holds no valid publication."""
    head = slot[: HEAD.itemsize].view(HEAD)[0]
    if int(head["magic"]) != MAGIC:
        raise ValueError("no publication header")
    n, nruns, copied = int(head["npages"]), int(head["nruns"]), int(head["copied"])
    at = HEAD.itemsize + ENTRY.itemsize * n
    if copied > n or at + RUN.itemsize * nruns > slot.size:
        raise ValueError(f"header out of range (pages {n}, runs {nruns}, copied {copied})")
    entries = slot[HEAD.itemsize : at].view(ENTRY)
    run_bytes = [int(x) for x in slot[at : at + RUN.itemsize * nruns].view(RUN)]
    start = data_start(n, nruns)
    if start + copied * sum(run_bytes) > slot.size:
        raise ValueError("page data past the end of the slot")
    return SlotContents(int(head["pub_id"]), (int(head["root_hi"]), int(head["root_lo"])),
                        entries, run_bytes, copied, start)
