"""``PrefixLookup`` (the vLLM scheduler's lookups) against real supervisors."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

from sparkcache.workers.lifecycle import FAULT_FILE_ENV, FAULT_ROLE_ENV, Role

from sparkcache.identity import Namespace, sequence_keys
from sparkcache.prefix_lookup import RETRY_INTERVAL_S, PrefixLookup
from sparkcache.store import PageStore
from sparkcache.store.testing import make_root
from tests.pipeline_util import make_cfg, start_supervisor, stop_supervisor, wait_for

NS = Namespace("m", "float16", "pages", 1, 0, 16)


def test_no_supervisor_is_a_miss_and_a_restarted_one_is_found(tmp_path: Path,
                                                               instance: str) -> None:
    store = tmp_path / "store"
    cfg = make_cfg(store, instance)
    keys = list(sequence_keys(NS, list(range(16 * 8))).pages)
    lookup = PrefixLookup(cfg, 1)
    try:
        assert lookup.lookup(keys) == 0 and lookup.misses["unavailable"] == 1
        sup = start_supervisor(store, instance)
        try:
            with PageStore(store, 0) as st:
                st.commit(make_root("ab" * 16, keys[:5], 64))
            time.sleep(RETRY_INTERVAL_S)
            assert lookup.lookup(keys) == 5
        finally:
            stop_supervisor(sup)
        # Its rings are still mapped here, but nobody reads them: a miss, not a lease
        # into a dead ring.
        assert lookup.lookup(keys) == 0
        sup = start_supervisor(store, instance)
        try:
            time.sleep(RETRY_INTERVAL_S)
            assert lookup.lookup(keys) == 5  # reattached to the new supervisor's rings
        finally:
            stop_supervisor(sup)
    finally:
        lookup.close()


def test_the_first_lookup_after_a_supervisor_is_replaced_is_answered(tmp_path: Path,
                                                                     instance: str) -> None:
    """A supervisor stopped and another started between two lookups (an upgrade, a
    restart under a running engine): the lookup drops the handles of the one that
    stopped and asks again through the new one's at once. Until 2026-12-04 it counted a
    miss and missed again for a second (``RETRY_INTERVAL_S``): an agent's next turn,
    sent right after a restart, recomputed its whole prefix."""
    store = tmp_path / "store"
    keys = list(sequence_keys(NS, list(range(16 * 8))).pages)
    lookup = PrefixLookup(make_cfg(store, instance), 1)
    try:
        sup = start_supervisor(store, instance)
        try:
            with PageStore(store, 0) as st:
                st.commit(make_root("ab" * 16, keys[:5], 64))
            assert lookup.lookup(keys) == 5
        finally:
            stop_supervisor(sup)
        sup = start_supervisor(store, instance)
        try:
            assert lookup.lookup(keys) == 5
            assert lookup.lookup(keys) == 5
            assert not lookup.misses, lookup.misses
        finally:
            stop_supervisor(sup)
    finally:
        lookup.close()


def test_maintenance_is_checked_alive_at_most_once_an_interval(tmp_path: Path, instance: str,
                                                               monkeypatch) -> None:
    store = tmp_path / "store"
    keys = list(sequence_keys(NS, list(range(16 * 8))).pages)
    lookup = PrefixLookup(make_cfg(store, instance), 1, alive_recheck_s=0.5)
    checks: list[bool] = []
    real = PrefixLookup._maintenance_alive

    def counted(self: PrefixLookup, rank: int) -> bool:
        checks.append(real(self, rank))
        return checks[-1]

    monkeypatch.setattr(PrefixLookup, "_maintenance_alive", counted)
    sup = start_supervisor(store, instance)
    try:
        with PageStore(store, 0) as st:
            st.commit(make_root("ab" * 16, keys[:5], 64))
        assert lookup.lookup(keys) == 5 and lookup.lookup(keys) == 5
        assert checks == [True]  # two lookups inside the interval, one check
        time.sleep(0.6)
        assert lookup.lookup(keys) == 5 and checks == [True, True]
    finally:
        stop_supervisor(sup)
    time.sleep(0.6)
    try:
        assert lookup.lookup(keys) == 0  # the next interval sees maintenance gone
        assert checks[-1] is False and lookup.misses["unavailable"] == 1
    finally:
        lookup.close()


def test_maintenance_down_under_its_supervisor_keeps_the_handles(tmp_path: Path,
                                                                 instance: str,
                                                                 monkeypatch) -> None:
    """Maintenance crash-looping under a running supervisor: lookups miss meanwhile (no
    lease could be taken), the lookup keeps its store readers and the supervisor's
    segments (opening them all again on the scheduler's thread would find the same
    ones), and answers again once maintenance is back. Any other fault still drops them."""
    store, fault = tmp_path / "store", tmp_path / "crash"
    keys = list(sequence_keys(NS, list(range(16 * 8))).pages)
    lookup = PrefixLookup(make_cfg(store, instance), 1)
    # A maintenance worker that dies as it starts, the supervisor retrying, stays down.
    sup = start_supervisor(store, instance, "--startsecs", "1", "--startretries", "100",
                           env={FAULT_ROLE_ENV: "maintenance", FAULT_FILE_ENV: str(fault)})
    try:
        with PageStore(store, 0) as st:
            st.commit(make_root("ab" * 16, keys[:5], 64))
        wait_for(lambda: lookup.lookup(keys) == 5, 30, "a first answer")
        reader, stats = lookup._readers[0], lookup._stats[0]
        fault.touch()
        time.sleep(1.5)  # past --startsecs: a crash of a running worker, then failed starts
        os.kill(stats.read(int(Role.MAINTENANCE)).pid, signal.SIGKILL)
        wait_for(lambda: lookup.lookup(keys) == 0 and lookup.misses["unavailable"], 30,
                 "a miss while maintenance is down", poll=0.05)
        time.sleep(RETRY_INTERVAL_S)
        assert lookup.lookup(keys) == 0  # asked again: still down, still the same handles
        assert lookup._readers[0] is reader and lookup._stats[0] is stats
        fault.unlink()
        wait_for(lambda: lookup.lookup(keys) == 5, 60, "an answer again", poll=0.1)
        assert lookup._readers[0] is reader and lookup._stats[0] is stats
        # Any other fault, under the same supervisor too, is asked again at once
        # through handles opened afresh.
        real_lease, faults = PrefixLookup._lease, iter([OSError("a faulty ring")])

        def lease_once(self: PrefixLookup, key: str, pos: int, lease: int) -> bool:
            fault = next(faults, None)
            if fault is not None:
                raise fault
            return real_lease(self, key, pos, lease)

        monkeypatch.setattr(PrefixLookup, "_lease", lease_once)
        assert lookup.lookup(keys) == 5
        assert lookup._readers[0] is not reader and lookup._stats[0] is not stats
    finally:
        lookup.close()
        stop_supervisor(sup)
