"""A store whose filesystem fills up, for real: a small tmpfs in a mount namespace of the
test's own (root), a real supervisor and a synthetic engine (``disk_full_scenario.py``).
And the pieces that need no mount: what counts as a full disk, and maintenance staying
up when its index cannot grow."""

from __future__ import annotations

import errno
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from pathlib import Path

import pytest
from eviction_util import FakeClock
from test_maintenance_worker import SETTINGS, drive, maintenance_record, put
from worker_rig import rig

from sparkcache.store.eviction import RECORD, UNLINK
from sparkcache.store.index import OutcomeUnknown
from sparkcache.store.records import CommitFailed
from sparkcache.store.space import Space, is_disk_full, reserve_shortfall

HERE = Path(__file__).resolve().parent
REPO = HERE.parent


def real_sqlite_full() -> sqlite3.Error:
    """What SQLite raises when a database cannot grow (here: ``max_page_count``)."""
    conn = sqlite3.connect(":memory:")
    conn.execute("CREATE TABLE t(x)")
    conn.execute(f"PRAGMA max_page_count = {conn.execute('PRAGMA page_count').fetchone()[0]}")
    try:
        conn.executemany("INSERT INTO t VALUES (?)", [(os.urandom(512),)] * 100)
    except sqlite3.Error as exc:
        return exc
    finally:
        conn.close()
    raise AssertionError("the database grew past max_page_count")


def real_enospc() -> OSError:
    try:
        with open("/dev/full", "wb", buffering=0) as f:
            f.write(b"x")
    except OSError as exc:
        return exc
    raise AssertionError("/dev/full took a write")


def test_a_full_disk_is_told_from_other_faults_through_the_causes() -> None:
    full, enospc = real_sqlite_full(), real_enospc()
    assert enospc.errno == errno.ENOSPC and is_disk_full(enospc)
    assert is_disk_full(full) and is_disk_full(OSError(errno.EDQUOT, "quota"))
    # As the store raises it: a commit failed because its COMMIT failed because SQLite
    # found no room.
    try:
        try:
            try:
                raise full
            except sqlite3.Error as exc:
                raise OutcomeUnknown("index COMMIT failed") from exc
        except OutcomeUnknown as exc:
            raise CommitFailed("commit x failed") from exc
    except CommitFailed as exc:
        assert is_disk_full(exc)
    assert not is_disk_full(CommitFailed("commit x failed: a race"))
    assert not is_disk_full(OSError(errno.EIO, "I/O error"))
    assert not is_disk_full(sqlite3.OperationalError("database is locked"))
    assert not is_disk_full(None)


def test_the_reserve_is_shared_by_the_ranks_of_a_filesystem() -> None:
    assert reserve_shortfall(Space(100, 50), 40, 2) == 0
    assert reserve_shortfall(Space(100, 10), 40, 1) == 30
    assert reserve_shortfall(Space(100, 10), 40, 4) == 8  # each rank evicts its share
    assert reserve_shortfall(Space(100, 10), 0, 1) == 0


def test_maintenance_stays_up_while_its_index_cannot_grow_and_evicts_once_it_can(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """A full disk failed a slice's COMMIT; maintenance took it for an unusable
    environment, exited 4 and stayed down (FATAL), and every lookup then missed."""
    clock = FakeClock(tick=1e-4)
    with rig(tmp_path / "store", instance, clock=clock, min_free_bytes="4MiB",
             **SETTINGS) as r:
        for _ in range(8):
            put(r, 4)  # 512 KiB: past max_bytes
        store = r.maintenance.store
        ballast = store.layout.rank_dir / "ballast"
        drive(r, clock, 1)
        assert ballast.stat().st_blocks * 512 >= 1 << 20  # a quarter of the reserve, allocated
        evicted = maintenance_record(r).evicted_roots
        evict = store.evict
        error = real_sqlite_full()

        def full(*args, **kwargs):
            raise OutcomeUnknown(f"index COMMIT failed: {error}") from error

        monkeypatch.setattr(store, "evict", full)
        with caplog.at_level("WARNING"):
            drive(r, clock, 30)
        rec = maintenance_record(r)
        assert rec.disk_full >= 10 and rec.evicted_roots == evicted
        lines = [m for m in caplog.messages if "filesystem is full" in m]
        # Once a minute, not once a slice; and the ballast given up, once.
        assert len(lines) == 2 and "gave up the 1048576-byte ballast" in lines[1], lines
        assert not ballast.exists()
        monkeypatch.setattr(store, "evict", evict)  # space is back
        drive(r, clock, 50)
        assert not ballast.exists()  # not within a minute of the last failure
        clock.now += 60
        drive(r, clock, 5)
        rec = maintenance_record(r)
        assert rec.evicted_roots > evicted and rec.used_bytes <= 320 * 1024
        assert ballast.exists()  # taken again: the reserve holds with room for it


def test_collection_goes_on_while_short_of_the_reserve_with_unlinks_dearer_than_a_slice(
        tmp_path: Path, instance: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Short of the reserve, every slice began by asking the (empty) pool for its files
    and counted that as a unit of work, so no slice was fresh; an unlink the cost model
    had learnt above a slice's budget (on a loaded machine) runs only in a fresh slice,
    so the collected files were never unlinked and the disk stayed full (seen on the
    tmpfs test beside a busy suite: 297 objects waiting for 4 minutes)."""
    clock = FakeClock(tick=1e-4)
    with rig(tmp_path / "store", instance, clock=clock, min_free_bytes="4MiB",
             **SETTINGS) as r:
        for _ in range(8):
            put(r, 4)
        store = r.maintenance.store
        monkeypatch.setattr(store, "space", lambda: Space(64 << 20, 0))  # full, for good
        for kind in (UNLINK, RECORD):
            r.maintenance.costs.observe(kind, 1, 1.0)  # far above the 20 ms budget
        drive(r, clock, 400)
        rec = maintenance_record(r)
        assert rec.used_bytes == 0 and rec.evicted_roots == 8
        assert store.unlinking.objects == 0 and rec.collectable_objects == 0
        objects = store.layout.rank_dir / "objects"
        assert not [p for p in objects.rglob("*") if p.is_file()]


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                    reason="mounts a small tmpfs in a mount namespace of its own (root)")
def test_a_full_filesystem_fails_commits_not_the_workers_and_the_reserve_evicts(
        tmp_path: Path, instance: str) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    script = ('mount -t tmpfs -o size=48m,mode=0700 tmpfs "$0" || exit 77; '
              'exec "$1" "$2" "$0" "$3"')
    result = subprocess.run(
        ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(mnt),
         sys.executable, str(HERE / "disk_full_scenario.py"), instance],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    if result.returncode == 77:
        pytest.skip("cannot mount a tmpfs here")
    assert result.returncode == 0, result.stderr[-4000:]
    seen = json.loads(result.stdout)
    # A full disk: every commit fails, counted; the workers stay up; what is stored is
    # still served; publishing resumes by itself once space is back.
    assert seen["before"] == "durable" and seen["free_when_full"] < 64 << 10
    assert all(outcome != "durable" for outcome in seen["while_full"]), seen
    assert seen["commit_disk_full"] == len(seen["while_full"])
    assert seen["restored_while_full"] == [32, 32]
    assert seen["after"][-1] == "durable" and len(seen["after"]) <= 2, seen["after"]
    assert seen["restored_after"] == [32, 32]
    assert all(state == "RUNNING" and restarts == 0
               for state, restarts in seen["first_workers"].values()), seen["first_workers"]
    # Once a minute per worker (commit's, and maintenance's if a slice met it too), not
    # once a commit.
    assert 1 <= seen["first_log"].count("the store's filesystem is full") <= 2, \
        seen["first_log"][-3000:]
    assert seen["first_rc"] == 0 and "the store dir's filesystem holds" not in seen["first_log"]
    # The reserve: another file took the disk, and maintenance evicted the store's own
    # roots until 8 MiB were free again; publications are stored.
    assert seen["free_after_reserve"] >= 8 << 20 and seen["evicted_roots"] > 0, (
        {k: v for k, v in seen.items() if not k.endswith("_log")},
        [line for line in seen["second_log"].splitlines() if "maintenance" in line][-20:])
    # Only what the reserve lacked went: the pool and the punches waiting for their delay
    # gave their space first, and were counted as freed (it once evicted everything).
    assert seen["used_before"] - (12 << 20) < seen["used_after"] <= seen["used_before"] - (4 << 20)
    assert seen["after_reserve"] == "durable" and seen["second_rc"] == 0
    # Where eviction's COMMIT found no room on the full disk, the ballast made it.
    assert (seen["second_maintenance_disk_full"] == 0
            or "gave up the 2097152-byte ballast" in seen["second_log"])
    assert all(state == "RUNNING" for state, _ in seen["second_workers"].values())
    # 48 MiB of hard cap plus 8 MiB kept free: more than the 48 MiB filesystem.
    assert "the store dir's filesystem holds 48.0MiB" in seen["second_log"]
