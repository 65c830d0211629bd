"""Typed records and errors of the page store API."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from sparkcache.identity import require_hex, require_keys

ROOT_ID_HEX_LEN = 32
# Raw bytes-like page contents: bytes, bytearray, memoryview, numpy arrays (C-contiguous).
Buffer = bytes | bytearray | memoryview


class StoreError(RuntimeError):
    """The store cannot do what was asked without risking wrong or lost data."""


class UnsafeStoreDir(StoreError):
    """A store path is a symlink, not a directory, owned by someone else, writable by
    others, or on a network filesystem."""


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and each exception it was raised from or during, once each (a chain of
    ``__context__`` can loop): what a fault's kind is told by (a full disk, a failed
    fsync) when the store has wrapped it."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        yield exc
        exc = exc.__cause__ or exc.__context__


class CommitFailed(StoreError):
    """A commit did not happen; nothing of it is referenced and earlier roots are intact."""


@dataclass(slots=True)
class PageData:
    """One page to store: its hex key and its bytes, whole or as the pieces they are made
    of, in order (a capture slot holds a page as one piece per layer and K/V; the pieces
    are checksummed and written with one ``writev``, never joined). Its key is checked by
    the ``Root`` that holds it, with the root's other keys at once. The commit worker
    builds one for every page of a prompt every turn, so it is a plain slotted record: for
    a 300k-token prompt's 18,750, 52 ms with a check each, 13.4-25 frozen without
    (``object.__setattr__`` per field), 3.6 slotted; the batch's check 3.4."""

    key: str
    data: Buffer | list[Buffer] | tuple[Buffer, ...]

    def pieces(self) -> list[memoryview]:
        if isinstance(self.data, list | tuple):
            return [memoryview(d).cast("B") for d in self.data]
        return [memoryview(self.data).cast("B")]

    @property
    def nbytes(self) -> int:
        """The page's payload bytes."""
        return sum(p.nbytes for p in self.pieces())


@dataclass(frozen=True)
class Root:
    """A publication: the ordered pages of one sequence at one moment."""

    root_id: str
    pages: Sequence[PageData]

    def __post_init__(self) -> None:
        require_hex(self.root_id, "root id", ROOT_ID_HEX_LEN)
        if not self.pages:
            raise ValueError(f"root {self.root_id} has no pages; a root needs at least one")
        require_keys([p.key for p in self.pages])


@dataclass(frozen=True)
class Publication:
    """One root for ``PageStore.commit_batch``: committed (``place``), or its pages only
    staged (a chunk of a publication larger than a capture slot; ``PageStore.stage``).
    ``release``: the read lease that protected the pages it relied on, ended in the
    commit's transaction (0: none)."""

    root: Root
    place: bool = True
    release: int = 0


@dataclass(frozen=True)
class CommitResult:
    root_id: str
    pages: int
    pages_written: int
    pages_deduplicated: int
    bytes_written: int
    retries: int
    # Roots of other ids that were prefixes of this one (same pages or fewer), taken over
    # in its transaction: the one such root grown in place, under its own id (a later
    # turn of a conversation grows the earlier turn's root), or several dropped (a store
    # written before supersession may hold the same pages under several ids).
    roots_superseded: int = 0
    # A stored root already extends this one: no root was created, its lease was renewed.
    covered: bool = False


@dataclass(frozen=True)
class RemoveResult:
    removed: tuple[str, ...]
    # Roots asked for that were not removed: unknown, or leased again since selection.
    skipped: tuple[str, ...]
    bytes: int


@dataclass(frozen=True)
class EvictResult:
    """One bounded eviction step (``PageStore.evict``)."""

    removed: tuple[str, ...] = ()  # roots evicted whole
    cut: int = 0  # roots cut short: still there, holding a prefix of what they held
    pages: int = 0  # page references dropped
    bytes: int = 0  # their bytes: the step's work, freed or not
    reclaimed_objects: int = 0  # objects whose last reference went: now collectable
    reclaimed_bytes: int = 0
    skipped: int = 0  # LRU roots passed over because evicting them frees nothing
    dropped: int = 0  # planned victims read-leased or used again since they were planned
    read_leased: int = 0  # roots passed over for a read lease (a lookup's, capture's)
    read_yielded: int = 0  # roots taken whose read lease, older than its grace, yielded
    yielded_roots: int = 0  # roots removed whole while their conversation lease ran
    yielded_bytes: int = 0  # bytes made collectable from roots under a running lease


@dataclass(frozen=True)
class CollectResult:
    objects: int
    bytes: int
    shrunk: int = 0  # steps cutting short files the pool did not take (PageStore.collect)


@dataclass(frozen=True)
class ReconcileResult:
    temp_files_removed: int
    orphan_files_removed: int
    dead_rows_removed: int
    refcounts_fixed: int
    objects_missing: int
    pack_ranges_freed: int = 0  # collected records a crash left holding blocks in a pack


@dataclass(frozen=True)
class Usage:
    entries: int
    used_bytes: int
    objects: int
    # state -> (objects, bytes), e.g. {"live": (10, 10485760), "quarantined": (1, 1048576)}
    by_state: dict[str, tuple[int, int]] = field(default_factory=dict)
    # Objects no root references any more (refcount 0), and their bytes: counted in
    # ``used_bytes`` until collection deletes them.
    collectable_objects: int = 0
    collectable_bytes: int = 0
