"""Asynchronous loads through the restore worker, with a real supervisor: published
sequences load byte-exact into fresh blocks; a corrupt object is reported with its page
index, zeroed in its block (read in place), and quarantined; a restore worker killed with loads
in flight has every load reported and writes nothing into their blocks afterwards; a
restarted worker drops the records meant for its predecessor."""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import time
from pathlib import Path

import numpy as np
import psutil
import pytest
from pipeline_util import (
    SyntheticEngine,
    pipeline,
    runtime,
    sequences,
    wait_committed,
    wait_for,
)
from sparkcache.shm.segment import SHM_DIR, process_start
from sparkcache.workers.lifecycle import KILL_AT_ENV, KILL_FILE_ENV, Role
from sparkcache.workers.restore import PLAN_PAGES

from sparkcache import segments
from sparkcache.filesystems import MEMORY_FILESYSTEMS, filesystem_of
from sparkcache.identity import keys_bytes
from sparkcache.store import PageStore
from sparkcache.store.direct import mostly_cached
from sparkcache.store.objects import HEADER_SIZE
from sparkcache.store.reader import StoreReader
from sparkcache.store.testing import evict_from_page_cache, make_root, object_file, page_bytes

pytestmark = pytest.mark.slow

SENTINEL = 0x5A
HEARTBEAT_S = 2.0


def _published(engine: SyntheticEngine, n: int, seed: int) -> dict[str, list[int]]:
    """``n`` sequences published, durable and committed; every block free again."""
    seqs = sequences(n, engine.client.cfg.page_tokens, seed=seed)
    for sid, tokens in seqs.items():
        assert engine.publish(sid, tokens), engine.client.counters
    engine.drain()
    assert engine.acknowledged >= set(seqs), engine.client.counters
    assert wait_committed(engine, seqs=seqs) == {}
    return seqs


def _fill(engine: SyntheticEngine, blocks: list[int], value: int = SENTINEL) -> None:
    views = engine.client._reg.views
    page = np.full(views.page_bytes, value, np.uint8)
    for b in blocks:
        views.scatter(b, page)


def _holds_sentinel(engine: SyntheticEngine, blocks: list[int],
                    value: int = SENTINEL) -> list[bool]:
    views = engine.client._reg.views
    out = np.empty(views.page_bytes, np.uint8)
    held = []
    for b in blocks:
        views.gather(b, out)
        held.append(bool((out == value).all()))
    return held


def _worker(store: Path, role: str) -> dict:
    return next(w for w in runtime(store)["workers"] if w["role"] == role)


def _restore_stats(engine: SyntheticEngine):
    with segments.attach_stats(engine.client.cfg, 0) as stats:
        return stats.read(int(Role.RESTORE))


def test_loads_restore_byte_exact_into_fresh_blocks(tmp_path: Path, instance: str) -> None:
    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        seqs = _published(engine, 30, seed=31)
        plans: dict[str, list[int]] = {}
        free = list(engine.free)
        for sid, tokens in seqs.items():
            assert engine.client.lookup(tokens) == len(tokens)  # leased, then loaded
            blocks = [free.pop() for _ in engine.keys(tokens)]
            _fill(engine, blocks)
            plans[sid] = blocks
            assert engine._timed(engine.client.load, sid, tokens, blocks)
        results = engine.wait_loaded(list(seqs))
        for sid, tokens in seqs.items():
            r = results[sid]
            assert (r.status, r.tokens, r.bad_page) == ("ok", len(tokens), None), r
            assert all(engine.exact_pages(tokens, plans[sid])), sid
        # A prefix: at most max_pages; more tokens than stored loads what is stored.
        sid, tokens = next(iter(seqs.items()))
        blocks = plans[sid]
        pt = engine.client.cfg.page_tokens
        longer = tokens + list(range(3 * pt))
        more = blocks + [free.pop() for _ in range(4)]
        stored = engine.client.lookup(longer)  # its full pages: the tail page differs
        assert 0 < stored < len(longer)
        assert engine.client.load("capped", tokens, blocks, max_pages=1)
        assert engine.client.load("longer", longer, more)
        got = engine.wait_loaded(["capped", "longer"])
        assert (got["capped"].status, got["capped"].tokens) == ("ok", pt)
        assert (got["longer"].status, got["longer"].tokens) == ("partial", stored)
        engine.loaded.pop("capped")
        assert engine.client.load("capped", tokens, blocks)  # a reported id may come again
        assert not engine.client.load("capped", tokens, blocks)  # not while in flight
        assert engine.client.counters.misses["duplicate_load"] == 1
        assert engine.wait_loaded(["capped"])["capped"].status == "ok"
        # Refusals are counted, never raised.
        assert not engine.client.load("bad", tokens, [10**6] * len(blocks))
        assert engine.client.counters.misses["bad_block"] == 1
        stats = _restore_stats(engine)
        pages = sum(len(engine.keys(t)) for t in seqs.values())
        assert stats.processed >= len(seqs) + 3 and stats.failed == 0
        assert stats.copy_bytes >= pages * engine.client._reg.views.page_bytes
        assert engine.client.loads_in_flight == 0
        assert engine.max_call_s < 0.25, engine.max_call_s


def test_a_load_longer_than_a_plan_step_is_planned_as_its_reads_reach_it(
        tmp_path: Path, instance: str) -> None:
    """The restore worker plans a load ``PLAN_PAGES`` pages at a time: a stored prefix
    ending in the second step loads whole, byte-exact, and a longer ask stops at its end."""
    stored, asked = PLAN_PAGES + 300, PLAN_PAGES + 500
    with pipeline(tmp_path / "store", instance, {"capture_slot_bytes": "8MiB"},
                  blocks=2 * asked + 8) as engine:
        pt = engine.client.cfg.page_tokens
        tokens = list(range(1, asked * pt + 1))
        assert engine.publish("long", tokens[: stored * pt]), engine.client.counters
        engine.drain()
        assert wait_committed(engine, seqs={"long": tokens[: stored * pt]}) == {}
        free = list(engine.free)
        whole, longer = ([free.pop() for _ in range(n)] for n in (stored, asked))
        _fill(engine, whole + longer)
        assert engine.client.load("whole", tokens[: stored * pt], whole)
        assert engine.client.load("longer", tokens, longer)
        got = engine.wait_loaded(["whole", "longer"])
        assert (got["whole"].status, got["whole"].tokens) == ("ok", stored * pt)
        assert (got["longer"].status, got["longer"].tokens) == ("partial", stored * pt)
        assert all(engine.exact_pages(tokens, whole))
        assert all(engine.exact_pages(tokens, longer[:stored]))
        assert all(_holds_sentinel(engine, longer[stored:]))


def test_keys_as_raw_bytes_publish_and_load_the_same_pages(tmp_path: Path,
                                                           instance: str) -> None:
    """The vLLM connector's path: page keys handed over as their raw bytes."""
    with pipeline(tmp_path / "store", instance) as engine:
        c = engine.client
        tokens = next(iter(sequences(1, c.cfg.page_tokens, seed=41).values()))
        keys = engine.keys(tokens)
        blocks = [engine.free.pop() for _ in keys]
        views = c._reg.views
        for k, b in zip(keys, blocks, strict=True):
            views.scatter(b, np.frombuffer(bytearray(page_bytes(k, views.page_bytes)), np.uint8))
        deadline = time.monotonic() + 30
        while not c.publish_keys("as-bytes", keys_bytes(keys), blocks):
            assert time.monotonic() < deadline, c.counters
            engine.poll()
            time.sleep(0.01)
        engine.accepted["as-bytes"] = tokens
        engine.drain()
        assert wait_committed(engine, seqs={"as-bytes": tokens}) == {}
        assert c.lookup(tokens) == len(tokens)
        fresh = [engine.free.pop() for _ in keys]
        _fill(engine, fresh)
        assert c.load_keys("load-bytes", keys_bytes(keys), fresh)
        r = engine.wait_loaded(["load-bytes"])["load-bytes"]
        assert (r.status, r.tokens) == ("ok", len(keys) * c.cfg.page_tokens), r
        assert all(engine.exact_pages(tokens, fresh))
        # A length that is not whole keys is a refusal, counted, never raised.
        assert not c.load_keys("ragged", b"\0" * 17, fresh[:2])
        assert not c.publish_keys("ragged", b"\0" * 17, fresh[:2])
        assert c.counters.misses["bad_request"] == 1
        assert c.counters.skipped["bad_request"] == 1


def _object_file(store: Path, key: str) -> tuple[Path, int]:
    """The file holding ``key``'s page (its own, or its publication's pack) and the
    offset of its record there."""
    reader = StoreReader(store, 0)
    try:
        return object_file(reader.layout.objects_dir, reader.conn, key)
    finally:
        reader.close()


def test_a_started_worker_reads_the_newest_roots_ahead(tmp_path: Path, instance: str) -> None:
    """Before any load, the restore worker asks the kernel to read the most recently used
    roots' pages into the page cache, newest first, up to ``read_ahead_bytes``, and
    reports the bytes asked for as ``prefaulted_bytes``."""
    store, page = tmp_path / "store", 64 << 10
    with PageStore(store, 0) as ps:
        for _ in range(3):  # committed one after another: the last is the newest
            ps.commit(make_root(os.urandom(16).hex(),
                                [os.urandom(16).hex() for _ in range(8)], page))
    budget = 2 * 8 * page + page // 2  # the two newest roots, not a page of the third
    with pipeline(store, instance, {"read_ahead_bytes": str(budget)}) as engine:
        deadline = time.monotonic() + 30
        while (_restore_stats(engine).prefaulted_bytes != 16 * page
               and time.monotonic() < deadline):
            time.sleep(0.05)
        assert _restore_stats(engine).prefaulted_bytes == 16 * page
        time.sleep(0.5)  # nothing more is read ahead
        assert _restore_stats(engine).prefaulted_bytes == 16 * page


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_a_corrupt_page_is_reported_zeroed_and_quarantined(
        tmp_path: Path, instance: str, cold: bool) -> None:
    """Cached, the worker reads through the page cache; cold, past it
    (sparkcache.store.direct): the same outcome."""
    if cold and filesystem_of(tmp_path) in MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is in memory: nothing to evict")
    store = tmp_path / "store"
    # No idle read-ahead: cold, the load is to find the pack out of the page cache.
    with pipeline(store, instance, {"read_ahead_bytes": "0"}) as engine:
        pt = engine.client.cfg.page_tokens
        tokens = list(range(1000, 1000 + 6 * pt))
        assert engine.publish("victim", tokens)
        engine.drain()
        assert "victim" in engine.acknowledged
        assert wait_committed(engine, seqs={"victim": tokens}) == {}
        keys = engine.keys(tokens)
        path, offset = _object_file(store, keys[2])
        raw = bytearray(path.read_bytes())
        raw[offset + HEADER_SIZE + 9] ^= 0xFF  # a page byte: the header parses, the checksum fails
        path.write_bytes(bytes(raw))
        # Maintenance verifies a reported page through the page cache (and the kernel's
        # read-ahead takes the rest of the pack with it): it is held still until the
        # restore worker's own reads are checked, or on a loaded machine it came first.
        maintenance = _worker(store, "maintenance")["pid"]
        os.kill(maintenance, signal.SIGSTOP)
        try:
            if cold:
                evict_from_page_cache(store)
            blocks = engine.free[: len(keys)]
            _fill(engine, blocks)
            assert engine.client.load("victim", tokens, blocks)
            r = engine.wait_loaded(["victim"])["victim"]
            assert (r.status, r.bad_page, r.tokens) == ("corrupt", 2, 2 * pt), r
            assert engine.exact_pages(tokens, blocks[:2]) == [True, True]
            # The engine's KV is host memory: the restore worker reads each page straight
            # into its block (cached) or verifies it in its own buffer first (cold).
            # Either way the bad page's block was zeroed (no byte of the page is left in
            # it), and the pages after it, in the same chunk, were never written.
            assert engine.client._reg.views.host_runs
            if cold:  # read past the page cache: still not in it
                fd = os.open(path, os.O_RDONLY)
                try:
                    assert not mostly_cached(fd, 0, path.stat().st_size)
                finally:
                    os.close(fd)
        finally:
            os.kill(maintenance, signal.SIGCONT)
        assert _holds_sentinel(engine, blocks[2:3], 0) == [True]
        assert _holds_sentinel(engine, blocks[3:]) == [True] * (len(keys) - 3)
        assert engine.client.counters.misses["corrupt"] == 1
        # The client asked maintenance (the worker never produces into the request ring).
        deadline = time.monotonic() + 20
        with PageStore(store, 0, create=False) as ps:
            while ps.usage().by_state["quarantined"][0] == 0:
                assert time.monotonic() < deadline, "the corrupt object was never quarantined"
                time.sleep(0.1)
        # The damaged record kept under its own key and its pack's generation.
        kept = f"{keys[2]}.{path.name.split('.')[1]}"
        assert any(p.name == kept for p in (store / "rank-0" / "quarantine").iterdir())


@pytest.mark.parametrize("cold", [False, True], ids=["cached", "cold"])
def test_restore_worker_killed_with_loads_in_flight(tmp_path: Path, instance: str,
                                                    cold: bool) -> None:
    """Killed after writing the first chunk of the first load (the rest of the batch it
    popped dies with it; cold, with direct reads in flight): every load is reported, and
    no write reaches a reported load's blocks afterwards. Then a worker SIGSTOPped with
    loads queued: nothing is reported while it is merely silent; once the supervisor has
    killed it (heartbeat limit) every load is, and its successor drops those records as
    stale (they name the dead process) and writes nothing."""
    if cold and filesystem_of(tmp_path) in MEMORY_FILESYSTEMS:
        pytest.skip(f"{tmp_path} is in memory: nothing to evict")
    store = tmp_path / "store"
    kill = tmp_path / "kill"
    env = {KILL_AT_ENV: "restore.written", KILL_FILE_ENV: str(kill)}
    with pipeline(store, instance, {"heartbeat_timeout_s": str(HEARTBEAT_S)},
                  env=env) as engine:
        seqs = _published(engine, 16, seed=41)
        if cold:
            evict_from_page_cache(store)
        first = _worker(store, "restore")["pid"]
        plans: dict[str, list[int]] = {}
        free = list(engine.free)
        kill.touch()
        for sid, tokens in seqs.items():
            plans[sid] = [free.pop() for _ in engine.keys(tokens)]
            assert engine.client.load(sid, tokens, plans[sid])
        results = engine.wait_loaded(list(seqs), timeout=30)
        assert not kill.exists()  # the worker did die at the checkpoint
        gone = [s for s, r in results.items() if r.status == "worker_gone"]
        assert gone and all(r.status in ("ok", "worker_gone") for r in results.values())
        assert all(results[s].tokens == 0 for s in gone)
        # The engine reuses the blocks now: nothing may write them any more.
        every = [b for blocks in plans.values() for b in blocks]
        _fill(engine, every)
        wait_for(lambda: _worker(store, "restore")["pid"] not in (None, first)
              and _worker(store, "restore")["state"] == "RUNNING", 30, "restore restarted")
        time.sleep(1.0)
        assert all(_holds_sentinel(engine, every)), "a write after the load was reported"

        # A stopped worker with loads queued: silent, not dead, so nothing is reported
        # until the supervisor's heartbeat limit has it killed; then its successor drops
        # those loads as stale.
        second = _worker(store, "restore")["pid"]
        os.kill(second, signal.SIGSTOP)
        try:
            for sid, tokens in seqs.items():
                assert engine.client.load(f"{sid}-again", tokens, plans[sid])
            stopped = time.monotonic()
            while time.monotonic() - stopped < HEARTBEAT_S - 0.5:
                assert engine.client.poll_loads() == []  # stopped, not dead: no report
                time.sleep(0.05)
            assert engine.client.loads_in_flight == len(seqs)
            again = engine.wait_loaded([f"{s}-again" for s in seqs], timeout=30)
            assert not psutil.pid_exists(second) or \
                psutil.Process(second).status() == psutil.STATUS_ZOMBIE
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(second, signal.SIGKILL)
        assert {r.status for r in again.values()} == {"worker_gone"}
        wait_for(lambda: _worker(store, "restore")["pid"] not in (None, first, second)
              and _worker(store, "restore")["state"] == "RUNNING", 30, "restore restarted")
        wait_for(lambda: _restore_stats(engine).drop_stale >= len(seqs), 10,
              "the successor to drop the stale loads")
        time.sleep(0.5)
        assert all(_holds_sentinel(engine, every)), "a stale load was written"
        # The new worker takes new loads.
        sid, tokens = next(iter(seqs.items()))
        assert engine.client.load("after", tokens, plans[sid])
        assert engine.wait_loaded(["after"])["after"].status == "ok"
        assert all(engine.exact_pages(tokens, plans[sid]))
        assert _worker(store, "restore")["restarts"] == 2


def _resident_kib(pid: int, segment: str) -> int:
    """KiB of shm ``segment`` resident in process ``pid``'s mappings of it."""
    rss = 0
    inside = False
    path = f"/dev/shm/{segment.lstrip('/')}"
    with open(f"/proc/{pid}/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().removesuffix(" (deleted)").endswith(path)
            elif inside and line.startswith("Rss:"):
                rss += int(line.split()[1])
    return rss


def test_an_idle_restore_worker_maps_a_live_engines_kv_before_its_first_load(
        tmp_path: Path, instance: str) -> None:
    """A first load after an engine or worker restart used to map every page of the KV
    segment inside its TTFT; an idle worker now does it ahead. A registration whose
    engine is dead is left alone (its segment is not kept mapped)."""
    from sparkcache import registry

    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        desc = registry.read_registry(store, 0)
        segment = desc["tensors"][0]["segment"]
        pid = _worker(store, "restore")["pid"]
        kv_kib = sum(t["storage_bytes"] for t in desc["tensors"]) // 1024
        wait_for(lambda: _resident_kib(pid, segment) >= kv_kib, 15,
                 "the restore worker to map every page of the engine's KV")
        assert engine.client.loads_in_flight == 0 and _restore_stats(engine).processed == 0

        def register(owner_pid: int, owner_start: float, reg_gen: int) -> None:
            fake = {**desc, "owner_pid": owner_pid, "owner_start": owner_start,
                    "tensors": [{**desc["tensors"][0], "segment": f"{segment}-missing"}]}
            fake.pop("reg_gen"), fake.pop("block_dim")
            registry.write_registry(store, 0, reg_gen, desc["block_dim"], fake)

        dead = psutil.Popen(["true"])
        dead.wait()
        register(dead.pid, time.time() - 1, 7)
        time.sleep(3 * 1.0)  # three warm checks (WARM_CHECK_S)
        assert _restore_stats(engine).item_errors == 0  # not tried
        # The control: the same registration with a live owner is tried (and fails).
        register(os.getpid(), process_start(os.getpid()), 8)
        wait_for(lambda: _restore_stats(engine).item_errors == 1, 10,
                 "the restore worker to try the live engine's registration")


def test_a_dead_engines_kv_is_unmapped(tmp_path: Path, instance: str) -> None:
    """A registration the restore and capture workers have mapped is dropped once its
    engine is gone: the KV segment, unlinked, would otherwise live on in their mappings,
    and a restarted engine needs as much /dev/shm again for its own."""
    from sparkcache import registry

    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        desc = registry.read_registry(store, 0)
        segment = desc["tensors"][0]["segment"]
        pids = [_worker(store, role)["pid"] for role in ("restore", "capture")]
        kv_kib = sum(t["storage_bytes"] for t in desc["tensors"]) // 1024
        # The same KV registered again by an engine that then dies; restore maps it
        # while idle, capture at the first publication naming it.
        owner = psutil.Popen(["sleep", "60"])
        own_gen = engine.client._reg.reg_gen
        try:
            again = {**desc, "owner_pid": owner.pid, "owner_start": process_start(owner.pid)}
            again.pop("reg_gen"), again.pop("block_dim")
            registry.write_registry(store, 0, own_gen + 1, desc["block_dim"], again)
            engine.client._reg.reg_gen = own_gen + 1
            tokens = list(range(5000, 5000 + 2 * engine.client.cfg.page_tokens))
            assert engine.publish("named", tokens)
            engine.drain()
            for pid in pids:
                wait_for(lambda pid=pid: _resident_kib(pid, segment) >= kv_kib, 15,
                         "the workers to map the registration")
        finally:
            engine.client._reg.reg_gen = own_gen
            owner.kill()
            owner.wait()
        for pid in pids:
            wait_for(lambda pid=pid: _resident_kib(pid, segment) == 0, 10,
                     "the workers to unmap the dead engine's KV")


def test_a_corrupt_page_is_reported_before_a_missing_one_read_ahead(
        tmp_path: Path, instance: str) -> None:
    """Page 2 corrupt, pages 3-5 (the next publication's pack) gone: the worker opens
    the files ahead of the page it reads and finds 3-5 missing first, but the page it
    stopped at, 2, is the one reported and quarantined."""
    store = tmp_path / "store"
    with pipeline(store, instance) as engine:
        pt = engine.client.cfg.page_tokens
        tokens = list(range(3000, 3000 + 6 * pt))
        for sid, upto in (("first", 3), ("second", 6)):  # two packs: pages 0-2, 3-5
            assert engine.publish(sid, tokens[: upto * pt])
            engine.drain()
            assert wait_committed(engine, seqs={sid: tokens[: upto * pt]}) == {}
        keys = engine.keys(tokens)
        first, offset = _object_file(store, keys[2])
        second, _ = _object_file(store, keys[3])
        assert first != second
        raw = bytearray(first.read_bytes())
        raw[offset + HEADER_SIZE + 9] ^= 0xFF
        first.write_bytes(bytes(raw))
        kept = second.read_bytes()
        second.unlink()
        blocks = engine.free[: len(keys)]
        assert engine.client.load("victim", tokens, blocks)
        r = engine.wait_loaded(["victim"])["victim"]
        assert (r.status, r.bad_page, r.tokens) == ("corrupt", 2, 2 * pt), r
        quarantine = store / "rank-0" / "quarantine"
        deadline = time.monotonic() + 20
        while not any(quarantine.iterdir()):
            assert time.monotonic() < deadline, "nothing was quarantined"
            time.sleep(0.1)
        assert [p.name.split(".")[0] for p in quarantine.iterdir()] == [keys[2]]
        second.write_bytes(kept)  # for the final fsck: only page 2 was damaged for good
        second.chmod(0o600)



def test_what_cuda_ipc_left_of_a_gone_engine_is_unlinked(
        tmp_path: Path, instance: str) -> None:
    """An engine sharing CUDA tensors leaves two files in /dev/shm when it ends before the
    processes that opened them (torch's reference counts, named in its registration, and
    the CUDA driver's, named by its pid), as it always does beside capture and restore:
    two files an engine run, for good (an H200, 2026-12-04). The restore worker unlinks
    them once the engine is gone, and nothing else: not a link, not a name of another
    form, not another pid's."""
    from sparkcache import registry

    store = tmp_path / "store"
    dead = psutil.Popen(["true"])
    dead.wait()
    rand = secrets.randbelow(10**9)
    torch_ref = SHM_DIR / f"torch_{dead.pid}_{rand}_0"
    driver = SHM_DIR / f"cuda.shm.0.{dead.pid:x}.1"
    kept = [SHM_DIR / f"torch_{dead.pid}_{rand}_1",  # a link
            SHM_DIR / f"torchx_{dead.pid}_{rand}_0",  # not torch's form
            SHM_DIR / f"cuda.shm.0.{os.getpid():x}.{rand}"]  # a live pid's
    try:
        for p in (torch_ref, driver, *kept[1:]):
            p.write_bytes(b"\0" * 4096)
        kept[0].symlink_to(torch_ref)
        shares = [[0, "", 0, 0, ("/" + p.name).encode().hex(), 0, "", False]
                  for p in (torch_ref, *kept[:2])]
        with pipeline(store, instance):
            registry.write_registry(store, 0, 99, 0, {
                "kind": "cuda", "owner_pid": dead.pid, "owner_start": 1.0,
                "tensors": [{"share": s} for s in shares]})
            wait_for(lambda: not torch_ref.exists() and not driver.exists(), 15,
                     "the restore worker to unlink what CUDA IPC left of the gone engine")
            time.sleep(1.5)  # another idle check: what it must not touch is still there
            assert kept[0].is_symlink() and all(p.exists() for p in kept[1:])
    finally:
        for p in (torch_ref, driver, *kept):
            p.unlink(missing_ok=True)
