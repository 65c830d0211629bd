"""SparkCache's connector under vLLM 0.33's real Scheduler, with a real supervisor."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tests.pipeline_util import start_supervisor, stop_supervisor
from tests.with_vllm.harness import BLOCK, request, rig

pytest.importorskip("vllm.v1.core.kv_cache_planning", reason="needs vLLM 0.33's scheduler")


def run_turn(r, rid: str, prompt: list[int], max_tokens: int = 2) -> None:
    r.sched.add_request(request(rid, prompt, max_tokens))
    r.run_until_idle()


def wait_stored(r, pages: int, timeout: float = 30.0) -> None:
    """Step an idle scheduler until the scheduler side's lookup sees ``pages`` pages of a
    probe request (what the next turn will look up)."""
    side = r.sched.get_kv_connector()._scheduler
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        r.step()
        if side.namespace() is not None:
            # Readers snapshot per call: a plain count of live roots is enough here.
            readers = [side.lookup._reader(rank) for rank in range(r.tp)]
            if all(rd.conn.execute("SELECT COALESCE(SUM(pages),0) FROM roots").fetchone()[0]
                   >= pages for rd in readers):
                return
        time.sleep(0.05)
    raise AssertionError(f"{pages} pages not stored within {timeout}s")


@pytest.fixture
def supervisor(tmp_path: Path, instance: str):
    store = tmp_path / "store"
    proc = start_supervisor(store, instance)
    try:
        yield store
    finally:
        code, err = stop_supervisor(proc)
        assert code == 0, err[-2000:]


def test_first_turn_saved_second_loaded_async_byte_exact(supervisor: Path, instance: str) -> None:
    prefix = list(range(10, 10 + 5 * BLOCK))  # 5 full pages
    with rig(supervisor, instance) as r:
        run_turn(r, "A", [*prefix, 7, 8, 9])
        assert "A" in r.finished_sending  # its blocks were held until saved, then freed
        wait_stored(r, 5)
        r.sched.add_request(request("B", prefix + list(range(300, 310)), max_tokens=2))
        so = r.step()
        # An async load: B waits for the load, nothing of it is computed yet.
        assert not so.num_scheduled_tokens.get("B")
        for _ in range(20):
            if "B" in r.finished_recving:
                break
            r.step()
        assert "B" in r.finished_recving and not r.load_errors
        table = r.tables.get("B") or list(
            r.sched.kv_cache_manager.get_blocks("B").get_block_ids()[0])
        so = r.step()
        assert so.num_scheduled_tokens["B"] == len(prefix) + 10 - 5 * BLOCK
        for page in range(5):
            assert r.block_holds(0, table[page], prefix[page * BLOCK:(page + 1) * BLOCK],
                                 page * BLOCK), f"page {page} not restored exactly"
        r.run_until_idle()
