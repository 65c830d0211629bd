"""The durable page store of one rank: objects on disk, a SQLite index, and protocols."""

from sparkcache.store.records import (
    CollectResult,
    CommitFailed,
    CommitResult,
    EvictResult,
    PageData,
    Publication,
    ReconcileResult,
    RemoveResult,
    Root,
    StoreError,
    UnsafeStoreDir,
    Usage,
)
from sparkcache.store.store import PageStore, StoreCounters

__all__ = [
    "CollectResult",
    "CommitFailed",
    "CommitResult",
    "EvictResult",
    "PageData",
    "PageStore",
    "Publication",
    "ReconcileResult",
    "RemoveResult",
    "Root",
    "StoreCounters",
    "StoreError",
    "UnsafeStoreDir",
    "Usage",
]
