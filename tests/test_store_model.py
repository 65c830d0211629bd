"""Model-based test: random commits, restores, evictions, collections and reconciles
against a plain-Python model of which roots exist (a commit grows the root that is its
prefix, and is not stored if one extends it) and what their pages hold."""

from __future__ import annotations

import hashlib
import itertools
from pathlib import Path

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule, run_state_machine_as_test

from sparkcache.store import PageStore
from sparkcache.store.fsck import fsck
from sparkcache.store.testing import make_root, page_bytes

SIZE = 512


def key(group: int, pos: int) -> str:
    return hashlib.blake2b(f"k{group}/{pos}".encode(), digest_size=16).hexdigest()


def test_store_matches_a_model(tmp_path: Path) -> None:
    counter = itertools.count()

    class StoreMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.now = 1000.0
            self.dir = tmp_path / f"m{next(counter)}"
            self.store = PageStore(self.dir, 0, lease_seconds=5, clock=lambda: self.now)
            self.roots: dict[str, list[str]] = {}
            self.ids = itertools.count()

        @rule(group=st.integers(0, 2), length=st.integers(1, 4), tail=st.booleans())
        def commit(self, group: int, length: int, tail: bool) -> None:
            root_id = f"{next(self.ids):032x}"
            keys = [key(group, i) for i in range(length)]
            if tail:
                keys.append(key(100 + int(root_id, 16), 0))
            result = self.store.commit(make_root(root_id, keys, SIZE))
            # Keys are chained (key(group, i) stands for the prefix 0..i of the group), so
            # a root extending this one makes it redundant, and a root that is a prefix of
            # it (one at most: no root is a prefix of another) grows into it, keeping its
            # id.
            extended = any(len(k) > len(keys) and k[: len(keys)] == keys
                           for k in self.roots.values())
            assert result.covered == extended
            if not extended:
                prefixes = [r for r, k in self.roots.items() if keys[: len(k)] == k]
                assert len(prefixes) <= 1
                assert result.roots_superseded == len(prefixes)
                self.roots[prefixes[0] if prefixes else root_id] = keys

        @rule(seconds=st.floats(0, 10))
        def advance(self, seconds: float) -> None:
            self.now += seconds

        @rule(k=st.integers(1, 4))
        def evict(self, k: int) -> None:
            victims = self.store.select_victims(k)
            result = self.store.remove_roots(victims)
            assert result.removed == tuple(victims)
            for root_id in victims:
                del self.roots[root_id]

        @rule(n=st.integers(1, 6))
        def collect(self, n: int) -> None:
            self.store.collect(n)

        @rule()
        def reconcile(self) -> None:
            result = self.store.reconcile(grace_seconds=0)
            assert result.orphan_files_removed == result.dead_rows_removed == 0

        @invariant()
        def every_root_restores(self) -> None:
            stored = {r for (r,) in self.store._rconn.execute("SELECT id FROM roots")}
            assert stored == self.roots.keys()
            assert self.store.usage().entries == len(self.roots)
            for keys in self.roots.values():
                bufs = [bytearray(SIZE) for _ in keys]
                assert self.store.restore(keys, bufs) == len(keys)
                assert [bytes(b) for b in bufs] == [page_bytes(k, SIZE) for k in keys]

        def teardown(self) -> None:
            self.store.close()
            report = fsck(self.dir, grace_seconds=0)
            assert report.ok, report.problems

    run_state_machine_as_test(
        StoreMachine,
        settings=settings(
            max_examples=25,
            stateful_step_count=15,
            deadline=None,
            suppress_health_check=[HealthCheck.too_slow],
        ),
    )
