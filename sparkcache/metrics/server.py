"""The supervisor's HTTP endpoint: ``/metrics`` (prometheus_client's exposition of a
private registry holding only SparkCache's collector) and ``/healthz`` (200 while every
worker is up, 503 naming each one that is not), served by one asyncio loop on a daemon
thread of the supervisor process.

A private registry: the process's default one would add the supervisor's own Python and
process collectors, which say nothing of the workers and cost every scrape time.

Why an event loop and not a thread per connection (the first version: wsgiref with
``ThreadingMixIn``): the endpoint listens in the process that must fork to restart
workers, and any local user can connect to it. 300 half-sent requests held 300 threads
and descriptors there indefinitely. Here an open connection costs a descriptor and a
coroutine, never a thread; a request must arrive whole within ``REQUEST_TIMEOUT_S`` and
``MAX_REQUEST_BYTES``; at most ``MAX_CONNECTIONS`` are open, a new one closing the oldest,
so a flood of idle connections cannot keep out a health probe (each answer is one
request, then the connection closes). A scrape runs on the loop's thread: it reads shared
memory and takes milliseconds.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
import threading
from collections.abc import Callable
from http import HTTPStatus
from urllib.parse import urlsplit

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

from sparkcache.metrics import reading
from sparkcache.metrics.collector import SparkCacheCollector
from sparkcache.metrics.reading import Source
from sparkcache.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"
METRICS_PATHS = ("/metrics", "/")
REQUEST_TIMEOUT_S = 5.0  # to receive a request's head, and again to send the answer
MAX_REQUEST_BYTES = 8192  # a request's head; a scraper's is a few hundred bytes
MAX_CONNECTIONS = 64
BACKLOG = 256  # connections the kernel queues before the loop accepts them
_TEXT = "text/plain; charset=utf-8"


class MetricsServerError(RuntimeError):
    """The endpoint cannot listen (address in use, unknown host ...)."""


def _family(host: str) -> socket.AddressFamily:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise MetricsServerError(
                f"SPARKCACHE_METRICS_HOST={host!r}: cannot resolve it ({exc.strerror})"
            ) from None
        return infos[0][0]
    return socket.AF_INET6 if addr.version == 6 else socket.AF_INET


def _response(status: HTTPStatus, content_type: str, body: bytes, send_body: bool = True,
              ) -> bytes:
    """The bytes of one answer; HEAD's has the length of the body it leaves out."""
    head = (f"HTTP/1.1 {status.value} {status.phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode("latin-1")
    return head + body if send_body else head


def respond(head: bytes, registry: CollectorRegistry,
            health: Callable[[], tuple[bool, str]]) -> bytes:
    """The answer to one request's head (request line and headers)."""
    lines = head.decode("latin-1").split("\r\n")
    parts = lines[0].split()
    if len(parts) != 3 or not parts[2].startswith("HTTP/"):
        return _response(HTTPStatus.BAD_REQUEST, _TEXT, b"bad request line\n")
    method, target, _ = parts
    if method not in ("GET", "HEAD"):
        return _response(HTTPStatus.METHOD_NOT_ALLOWED, _TEXT, b"only GET and HEAD\n")
    send_body = method == "GET"
    path = urlsplit(target).path
    if path == HEALTH_PATH:
        ok, why = health()
        return _response(HTTPStatus.OK if ok else HTTPStatus.SERVICE_UNAVAILABLE, _TEXT,
                         why.encode() + b"\n", send_body)
    if path in METRICS_PATHS:
        accept = next((line.split(":", 1)[1].strip() for line in lines[1:]
                       if line.lower().startswith("accept:")), None)
        encoder, content_type = choose_encoder(accept)
        return _response(HTTPStatus.OK, content_type, encoder(registry), send_body)
    return _response(HTTPStatus.NOT_FOUND, _TEXT,
                     f"not found: try /metrics or {HEALTH_PATH}\n".encode(), send_body)


class MetricsServer:
    """``/metrics`` and ``/healthz`` for one supervisor; ``start`` binds and serves from
    a daemon thread, ``stop`` closes every connection and the socket and joins it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SparkCacheCollector(source))
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        # Open connections, oldest first (dicts keep insertion order).
        self._open: dict[asyncio.StreamWriter, None] = {}
        self.evicted = 0  # connections closed to make room for a newer one
        self._rare = RateLimitedLog(log)

    def health(self) -> tuple[bool, str]:
        return reading.health(reading.read(self.source))

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) bound: the port the kernel chose too."""
        if self._sock is None:
            raise RuntimeError("the metrics server is not listening")
        return self.source.cfg.metrics_host, self._sock.getsockname()[1]

    def start(self) -> None:
        host, port = self.source.cfg.metrics_host, self.source.cfg.metrics_port
        try:
            self._sock = socket.create_server((host, port), family=_family(host),
                                              backlog=BACKLOG)
        except OSError as exc:
            raise MetricsServerError(
                f"cannot listen on {host}:{port} for /metrics ({exc.strerror or exc}); set "
                "SPARKCACHE_METRICS_PORT to a free port, or 0 for no endpoint"
            ) from None
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(started,),
                                        name="sparkcache-metrics", daemon=True)
        self._thread.start()
        started.wait()
        log.info("metrics: http://%s:%d/metrics and %s", *self.address, HEALTH_PATH)

    def _run(self, started: threading.Event) -> None:
        loop = self._loop
        assert loop is not None and self._sock is not None
        asyncio.set_event_loop(loop)
        server = loop.run_until_complete(asyncio.start_server(
            self._serve, sock=self._sock, limit=MAX_REQUEST_BYTES))
        started.set()
        try:
            loop.run_forever()
        finally:
            server.close()
            for writer in list(self._open):
                writer.close()
            tasks = asyncio.all_tasks(loop)
            for task in tasks:
                task.cancel()
            loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))
            loop.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._open[writer] = None
        if len(self._open) > MAX_CONNECTIONS:
            oldest = next(iter(self._open))
            self._open.pop(oldest)
            oldest.close()
            self.evicted += 1
            self._rare.warning("evicted", "metrics: more than %d connections open: the "
                               "oldest closed (%d so far)", MAX_CONNECTIONS, self.evicted)
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), REQUEST_TIMEOUT_S)
            writer.write(respond(head, self.registry, self.health))
            await asyncio.wait_for(writer.drain(), REQUEST_TIMEOUT_S)
        except asyncio.LimitOverrunError:
            writer.write(_response(HTTPStatus.REQUEST_HEADER_FIELDS_TOO_LARGE, _TEXT,
                                   f"a request head is at most {MAX_REQUEST_BYTES} bytes\n"
                                   .encode()))
        except (TimeoutError, asyncio.IncompleteReadError, ConnectionError):
            pass  # too slow, gone, or closed for a newer connection
        except Exception:
            log.exception("metrics: a request failed")
        finally:
            self._open.pop(writer, None)
            writer.close()

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._loop is None:
            return
        self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(5)
        if self._sock is not None:
            self._sock.close()
        self._loop = self._thread = self._sock = None
