"""What capture writes into a capture slot for commit: a header, one entry per page of
the publication, the run table, then the copied pages (the page delta) run-major.

Run-major: a page is a sequence of runs (one per layer and K/V, ``BlockViews.run_bytes``);
the slot holds run 0 of every copied page, then run 1 of every copied page, and so on.
That is the order capture can copy in with one C-level gather per run, and commit hands
each page to the store as its pieces, written with one ``writev`` (docs/pipeline.md).

The slot carries the whole publication, not only a ring record, so a commit worker that
restarts can redo every slot it holds from the slot alone.

A publication whose page delta does not fit one slot is captured in parts, one slot each,
in page order (``plan_parts``): every part but the last holds only its own pages, which
commit stages (``PageStore.stage``: durable, invisible); the last holds an entry for every
page of the publication and its own pages' data, and commit publishes the root from it,
adopting the staged pages (docs/pipeline.md, "Publications in parts").
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# 3: parts (a publication larger than a slot). A slot of version 2 is refused as holding
# no publication: slots live in shared memory, which a supervisor's restart makes anew.
MAGIC = 0x5350_4B53_4C4F_5433  # "SPKSLOT3"
HEAD = np.dtype(
    [("magic", "<u8"), ("pub_id", "<u8"), ("root_hi", "<u8"), ("root_lo", "<u8"),
     ("npages", "<u4"), ("nruns", "<u4"), ("copied", "<u8"), ("part", "<u4"),
     ("parts", "<u4")]
)
# copied: the page's place among the copied pages; -1: not in this slot (the store held
# it at capture time, or another part of the publication carries it).
ENTRY = np.dtype([("key_hi", "<u8"), ("key_lo", "<u8"), ("copied", "<i8")])
RUN = np.dtype("<u8")  # bytes of one run of one page
_ALIGN = 64


def data_start(npages: int, nruns: int) -> int:
    end = HEAD.itemsize + ENTRY.itemsize * npages + RUN.itemsize * nruns
    return (end + _ALIGN - 1) // _ALIGN * _ALIGN


def needed(npages: int, copied: int, run_bytes: list[int]) -> int:
    """Slot bytes a publication of ``npages`` with ``copied`` delta pages needs."""
    return data_start(npages, len(run_bytes)) + copied * sum(run_bytes)


def fitting(slot_bytes: int, entries: int | None, run_bytes: list[int]) -> int:
    """The most copied pages a slot of ``slot_bytes`` holds beside ``entries`` entries, or
    (``entries`` None) beside one entry per copied page, as a part that is not the last
    has."""
    page = sum(run_bytes)
    if entries is not None:
        return max(0, (slot_bytes - data_start(entries, len(run_bytes))) // page)
    n = max(0, (slot_bytes - data_start(0, len(run_bytes))) // (page + ENTRY.itemsize))
    while n and needed(n, n, run_bytes) > slot_bytes:
        n -= 1  # the alignment of the data's start
    return n


def plan_parts(npages: int, delta: list[int], slot_bytes: int,
               run_bytes: list[int]) -> list[list[int]] | None:
    """The page indices each part of a publication of ``npages`` copies, in order, whose
    page delta (the pages to copy) is ``delta``: as few parts as slots of ``slot_bytes``
    allow, the last as full as it may be beside its entry for every page. None if a slot
    cannot hold a page beside those entries."""
    last = fitting(slot_bytes, npages, run_bytes)
    if last < 1:
        return None
    if len(delta) <= last:
        return [delta]
    per = fitting(slot_bytes, None, run_bytes)
    if per < 1:
        return None
    head = delta[: len(delta) - last]
    return [head[i : i + per] for i in range(0, len(head), per)] + [delta[len(head):]]


def data(slot: np.ndarray, npages: int, copied: int, run_bytes: list[int]) -> np.ndarray:
    """The bytes the copied pages go to (``BlockViews.gather_runs`` fills them)."""
    start = data_start(npages, len(run_bytes))
    return slot[start : start + copied * sum(run_bytes)]


def write_header(slot: np.ndarray, pub_id: int, root: tuple[int, int], keys: np.ndarray,
                 copied: np.ndarray, run_bytes: list[int], part: int = 0,
                 parts: int = 1) -> None:
    """Header, entries (``keys`` has fields key_hi and key_lo; ``copied`` each page's place
    among the copied pages, -1 for one not in this slot) and run table, for part ``part``
    of ``parts``."""
    n, nruns = len(keys), len(run_bytes)
    slot[: HEAD.itemsize].view(HEAD)[0] = (
        MAGIC, pub_id, root[0], root[1], n, nruns, int((copied >= 0).sum()), part, parts
    )
    entries = slot[HEAD.itemsize : HEAD.itemsize + ENTRY.itemsize * n].view(ENTRY)
    entries["key_hi"], entries["key_lo"] = keys["key_hi"], keys["key_lo"]
    entries["copied"] = copied
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
    part: int
    parts: int

    @property
    def last(self) -> bool:
        """Whether this slot publishes the root (the last part of its publication)."""
        return self.part == self.parts - 1

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
    part, parts = int(head["part"]), int(head["parts"])
    at = HEAD.itemsize + ENTRY.itemsize * n
    if copied > n or at + RUN.itemsize * nruns > slot.size or not 0 <= part < parts:
        raise ValueError(f"header out of range (pages {n}, runs {nruns}, copied {copied}, "
                         f"part {part} of {parts})")
    entries = slot[HEAD.itemsize : at].view(ENTRY)
    run_bytes = [int(x) for x in slot[at : at + RUN.itemsize * nruns].view(RUN)]
    start = data_start(n, nruns)
    if start + copied * sum(run_bytes) > slot.size:
        raise ValueError("page data past the end of the slot")
    return SlotContents(int(head["pub_id"]), (int(head["root_hi"]), int(head["root_lo"])),
                        entries, run_bytes, copied, start, part, parts)
