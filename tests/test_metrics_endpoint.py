"""The supervisor's HTTP endpoint under abuse, on a real supervisor: a flood of idle and
half-sent connections neither keeps out a health probe nor adds threads to the process
that restarts workers; a request that never completes is closed; an oversized one is
refused; any other method is refused."""

from __future__ import annotations

import resource
import socket
import time
from pathlib import Path

import psutil
from pipeline_util import free_port, runtime, start_supervisor, stop_supervisor
from test_metrics import get

from sparkcache.metrics import server

FLOOD = 1000


def raw_request(port: int, data: bytes, timeout: float = 10.0) -> bytes:
    """Send ``data`` and read until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def test_a_flood_of_idle_connections_leaves_healthz_answering_and_threads_bounded(
        tmp_path: Path, instance: str) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < FLOOD + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, FLOOD + 200), hard))
    port = free_port()
    sup = start_supervisor(tmp_path / "store", instance, "--metrics-port", str(port))
    flood: list[socket.socket] = []
    try:
        pid = runtime(tmp_path / "store")["pid"]
        assert get(port, "/healthz")[0] == 200
        threads = psutil.Process(pid).num_threads()
        for i in range(FLOOD):
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
            if i % 2:
                s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # never finished
            flood.append(s)
        took = []
        for _ in range(5):
            begun = time.perf_counter()
            status, why = get(port, "/healthz")
            took.append(time.perf_counter() - begun)
            assert status == 200, why
        assert max(took) < 0.1, took
        # One thread serves every connection: none was added for the flood.
        assert psutil.Process(pid).num_threads() <= threads, (threads,)
        # At most MAX_CONNECTIONS of them are still open at the supervisor.
        open_there = [c for c in psutil.Process(pid).net_connections("tcp")
                      if c.laddr and c.laddr[1] == port and c.status == psutil.CONN_ESTABLISHED]
        assert len(open_there) <= server.MAX_CONNECTIONS, len(open_there)
    finally:
        for s in flood:
            s.close()
        code, err = stop_supervisor(sup)
    assert code == 0, err[-2000:]


def test_slow_oversized_and_unknown_requests_are_closed_with_a_clear_answer(
        tmp_path: Path, instance: str) -> None:
    port = free_port()
    sup = start_supervisor(tmp_path / "store", instance, "--metrics-port", str(port))
    try:
        assert get(port, "/healthz")[0] == 200
        # Half a request: closed once REQUEST_TIMEOUT_S has passed, with no answer.
        begun = time.monotonic()
        assert raw_request(port, b"GET /healthz HTTP/1.1\r\n") == b""
        assert server.REQUEST_TIMEOUT_S - 0.5 < time.monotonic() - begun \
            < server.REQUEST_TIMEOUT_S + 3
        big = b"GET /metrics HTTP/1.1\r\nX-Pad: " + b"a" * server.MAX_REQUEST_BYTES + b"\r\n\r\n"
        assert raw_request(port, big).startswith(b"HTTP/1.1 431 ")
        assert raw_request(port, b"POST /healthz HTTP/1.1\r\n\r\n").startswith(b"HTTP/1.1 405 ")
        assert raw_request(port, b"nonsense\r\n\r\n").startswith(b"HTTP/1.1 400 ")
        head = raw_request(port, b"HEAD /healthz HTTP/1.1\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 200 ") and head.endswith(b"\r\n\r\n")
        # OpenMetrics when asked for, as prometheus_client negotiates it.
        answer = raw_request(port, b"GET /metrics HTTP/1.1\r\n"
                             b"Accept: application/openmetrics-text; version=1.0.0\r\n\r\n")
        assert b"application/openmetrics-text" in answer.split(b"\r\n\r\n")[0]
        assert answer.rstrip().endswith(b"# EOF")
        assert get(port, "/nowhere")[0] == 404
    finally:
        code, err = stop_supervisor(sup)
    assert code == 0, err[-2000:]
