"""Real ``redis-server`` processes as a Redis Cluster on local ports, for the shared
tier's tests: three masters with a replica each, made by ``redis-cli --cluster create``
as an operator makes one, torn down (every process ended) when the test ends."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path

import pytest


def require_redis() -> None:
    if not (shutil.which("redis-server") and shutil.which("redis-cli")):
        pytest.skip("needs redis-server and redis-tools (scripts/setup installs them)")


def _free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def _ports(n: int) -> list[int]:
    """``n`` ports free with their cluster bus ports (+10000)."""
    found: list[int] = []
    while len(found) < n:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 55000 and port not in found and _free(port + 10000):
            found.append(port)
    return found


@dataclass
class Cluster:
    ports: list[int]
    procs: dict[int, subprocess.Popen]
    password: str | None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}"

    def cli(self, port: int, *args: str) -> str:
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        return subprocess.run(["redis-cli", "-p", str(port), *auth, *args], check=True,
                              capture_output=True, text=True, timeout=30).stdout

    def masters(self) -> list[int]:
        """Ports of the nodes that are masters now."""
        out = []
        for port, proc in self.procs.items():
            if proc.poll() is None and "role:master" in self.cli(port, "INFO", "replication"):
                out.append(port)
        return out

    def kill(self, port: int) -> None:
        self.procs[port].kill()
        self.procs[port].wait()

    def wait_ok(self, timeout: float = 30.0) -> None:
        """Until every live node says the cluster is ok (all slots served)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            live = [p for p, proc in self.procs.items() if proc.poll() is None]
            with suppress(subprocess.SubprocessError):
                if all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO") for p in live):
                    return
            time.sleep(0.2)
        raise AssertionError("the cluster is not ok")


@contextmanager
def redis_cluster(where: Path, masters: int = 3, password: str | None = None,
                  conf: tuple[str, ...] = ()) -> Iterator[Cluster]:
    """``conf``: more lines of each server's configuration (``maxmemory 1mb``, say)."""
    require_redis()
    ports = _ports(masters * 2)
    procs: dict[int, subprocess.Popen] = {}
    try:
        for port in ports:
            d = where / f"redis-{port}"
            d.mkdir(parents=True)
            # The password in a file the server reads, not on its command line.
            lines = [f"port {port}", "bind 127.0.0.1", "cluster-enabled yes",
                    "cluster-config-file nodes.conf", "cluster-node-timeout 1500",
                    "save \"\"", "appendonly no", f"dir {d}", "protected-mode no"]
            if password:
                lines += [f"requirepass {password}", f"masterauth {password}"]
            (d / "redis.conf").write_text("\n".join([*lines, *conf]) + "\n")
            (d / "redis.conf").chmod(0o600)
            with open(d / "log", "w") as out:  # the server keeps its own descriptor
                procs[port] = subprocess.Popen(["redis-server", str(d / "redis.conf")],
                                               stdout=out, stderr=subprocess.STDOUT)
        cluster = Cluster(ports, procs, password)
        deadline = time.monotonic() + 20
        for port in ports:
            while True:
                with suppress(subprocess.SubprocessError):
                    if "PONG" in cluster.cli(port, "PING"):
                        break
                if time.monotonic() > deadline:
                    raise AssertionError(f"redis-server on {port} did not start")
                time.sleep(0.05)
        auth = ["--no-auth-warning", "-a", password] if password else []
        subprocess.run(["redis-cli", *auth, "--cluster", "create",
                        *(f"127.0.0.1:{p}" for p in ports), "--cluster-replicas", "1",
                        "--cluster-yes"], check=True, capture_output=True, timeout=60)
        cluster.wait_ok()
        yield cluster
    finally:
        for proc in procs.values():
            proc.terminate()
        for proc in procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
