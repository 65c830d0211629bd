"""The supervisor's HTTP endpoint: ``/metrics`` (prometheus_client's WSGI app over a
private registry holding only SparkCache's collector) and ``/healthz`` (200 while every
worker is up, 503 naming each one that is not), served from one daemon thread of the
supervisor process.

A private registry: the process's default one would add the supervisor's own Python and
process collectors, which say nothing of the workers and cost every scrape time.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import CollectorRegistry, make_wsgi_app

from sparkcache.metrics import reading
from sparkcache.metrics.collector import SparkCacheCollector
from sparkcache.metrics.reading import Source

log = logging.getLogger(__name__)

HEALTH_PATH = "/healthz"
METRICS_PATHS = ("/metrics", "/")


class MetricsServerError(RuntimeError):
    """The endpoint cannot listen (address in use, unknown host ...)."""


class _Server(ThreadingMixIn, WSGIServer):
    # A scrape in progress never holds up the supervisor's exit.
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


class _QuietHandler(WSGIRequestHandler):
    """Requests go to the log at debug level, not to stderr line by line."""

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s %s", self.address_string(), format % args)


def _family(host: str) -> type[_Server]:
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        try:
            infos = socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise MetricsServerError(
                f"SPARKCACHE_METRICS_HOST={host!r}: cannot resolve it ({exc.strerror})"
            ) from None
        return _Server6 if infos[0][0] == socket.AF_INET6 else _Server
    return _Server6 if addr.version == 6 else _Server


def make_app(registry: CollectorRegistry,
             health: Callable[[], tuple[bool, str]]) -> Callable[..., Iterable[bytes]]:
    """A WSGI app: /metrics (and /) from ``registry``, /healthz from ``health``."""
    metrics = make_wsgi_app(registry)

    def app(environ: dict, start_response: Callable) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "/")
        if path == HEALTH_PATH:
            ok, why = health()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "text/plain; charset=utf-8")])
            return [why.encode() + b"\n"]
        if path in METRICS_PATHS:
            return metrics(environ, start_response)
        start_response("404 Not Found", [("Content-Type", "text/plain; charset=utf-8")])
        return [f"not found: try /metrics or {HEALTH_PATH}\n".encode()]

    return app


class MetricsServer:
    """``/metrics`` and ``/healthz`` for one supervisor; ``start`` binds and serves from
    a daemon thread, ``stop`` closes the socket and joins it."""

    def __init__(self, source: Source) -> None:
        self.source = source
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(SparkCacheCollector(source))
        self._server: WSGIServer | None = None
        self._thread: threading.Thread | None = None

    def health(self) -> tuple[bool, str]:
        return reading.health(reading.read(self.source))

    @property
    def address(self) -> tuple[str, int]:
        """(host, port) bound: the port the kernel chose too."""
        if self._server is None:
            raise RuntimeError("the metrics server is not listening")
        return self.source.cfg.metrics_host, self._server.server_address[1]

    def start(self) -> None:
        host, port = self.source.cfg.metrics_host, self.source.cfg.metrics_port
        server_class = _family(host)
        try:
            self._server = make_server(host, port, make_app(self.registry, self.health),
                                       server_class=server_class,
                                       handler_class=_QuietHandler)
        except OSError as exc:
            raise MetricsServerError(
                f"cannot listen on {host}:{port} for /metrics ({exc.strerror or exc}); set "
                "SPARKCACHE_METRICS_PORT to a free port, or 0 for no endpoint"
            ) from None
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.2},
            name="sparkcache-metrics", daemon=True,
        )
        self._thread.start()
        log.info("metrics: http://%s:%d/metrics and %s", *self.address, HEALTH_PATH)

    def stop(self) -> None:
        """Stop serving and close the socket. Idempotent."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(5)
        self._server = self._thread = None
