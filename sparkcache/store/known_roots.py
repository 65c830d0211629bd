"""The page keys of the roots one committer stored, kept in memory so that the next turn's
commit compares its publication with them instead of reading them from the index.

A commit takes the pages one root holds at the head of its publication as held (neither
written nor re-checked row by row) only after comparing them with that root's keys, for
keys a caller did not chain (``PageStore._held_live_prefix``). Read from ``root_pages``,
that comparison cost ~20 ms for a 300k-token conversation's 18,750 pages at every turn;
its root is one this process committed at the turn before, so its keys are known here.

Why an entry stays right: it is named by the root's row (id and ``created``; a root
deleted and stored again is another row), and it holds the keys that root had when this
process last committed it. A root's rows are only appended (by a commit) or cut from
their end (eviction); the commit looking here has just found that root still holding
the last of the keys it compares, so a cut did not reach them. A regrowth after a cut,
which could put other keys there, is a commit: this process's own (the rank's committer),
which records what it wrote. Entries are dropped least recently used first beyond
``MAX_KEYS`` keys in all; a root not here is read from the index as before.
"""

from __future__ import annotations

from collections import OrderedDict

# About 20 MB of key strings: a few dozen 300k-token conversations at 16 tokens a page.
MAX_KEYS = 262_144


class KnownRoots:
    """Root row (id, created) -> the keys it held when this process committed it."""

    def __init__(self, max_keys: int = MAX_KEYS) -> None:
        self._max_keys = max_keys
        self._keys: OrderedDict[tuple[str, float], list[str]] = OrderedDict()
        self._held = 0

    def remember(self, root_id: str, created: float, keys: list[str]) -> None:
        """Root ``root_id`` (its row made at ``created``) holds exactly ``keys`` now."""
        name = (root_id, created)
        self._forget(name)
        if len(keys) > self._max_keys:
            return
        self._keys[name] = keys
        self._held += len(keys)
        while self._held > self._max_keys:
            _, dropped = self._keys.popitem(last=False)
            self._held -= len(dropped)

    def _forget(self, name: tuple[str, float]) -> None:
        dropped = self._keys.pop(name, None)
        if dropped is not None:
            self._held -= len(dropped)

    def first(self, root_id: str, created: float, n: int) -> list[str] | None:
        """The first ``n`` keys of that root, if known."""
        keys = self._keys.get((root_id, created))
        if keys is None or len(keys) < n:
            return None
        self._keys.move_to_end((root_id, created))
        return keys[:n]
