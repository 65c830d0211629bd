"""A worker's connection to the cluster: opened when first needed, closed by a fault and
opened again only after a back-off, so a cluster that is down costs each node a
connection attempt now and then, never a wait on every request."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

from sparkcache.fleet.cluster import ClusterSettings, connect
from sparkcache.ratelog import RateLimitedLog

if TYPE_CHECKING:
    from sparkcache.config import Config

log = logging.getLogger(__name__)

BACKOFF_S = (1.0, 60.0)  # after a failure: first wait, longest wait
T = TypeVar("T")


class ClusterLink:
    def __init__(self, settings: ClusterSettings, purpose: str) -> None:
        """``purpose``: what this process uses the cluster for, for its log lines."""
        self.settings = settings
        self.purpose = purpose
        self.failures = 0  # calls the cluster failed
        self.retry_at = 0.0  # time.monotonic() before which the cluster is not asked
        self._backoff = BACKOFF_S[0]
        self._client: Any = None
        self._rare = RateLimitedLog(log)
        # The connection and the back-off, between the threads that call (the restore
        # worker fetches on two); what they send runs outside it.
        self._lock = threading.Lock()

    def call(self, fn: Callable[[Any], T]) -> T | None:
        """``fn(client)``; None while backing off, or where connecting or ``fn`` raised
        (a fault: counted in ``failures``, logged once per kind, backed off)."""
        try:
            with self._lock:
                client = self._connected()
            if client is None:
                return None
            out = fn(client)
        except Exception as exc:  # the cluster's faults: a miss, no more
            with self._lock:
                self._failed(exc)
            return None
        with self._lock:
            self._backoff = BACKOFF_S[0]
        return out

    def _connected(self) -> Any | None:
        """The cluster's client, connected now if needed; None while backing off.
        Raises redis' errors where connecting fails."""
        if self._client is None:
            if time.monotonic() < self.retry_at:
                return None
            self._client = connect(self.settings)
            log.info("%s: the cluster at %s (prefix %r)", self.purpose, self.settings.url,
                     self.settings.key_prefix)
        return self._client

    def _failed(self, exc: BaseException) -> None:
        """Count, log once per kind of error, drop the connection, back off (doubling
        from 1 s to 60 s)."""
        self.failures += 1
        self._rare.warning(type(exc).__name__, "%s: the cluster at %s failed (%s: %s); "
                           "asked again in %.0f s", self.purpose, self.settings.url,
                           type(exc).__name__, brief(exc), self._backoff)
        self.retry_at = time.monotonic() + self._backoff
        self._backoff = min(BACKOFF_S[1], self._backoff * 2)
        self._close()

    def close(self) -> None:
        with self._lock:
            self._close()

    def _close(self) -> None:
        if self._client is not None:
            client, self._client = self._client, None
            try:
                client.close()
            except Exception as exc:  # a connection already broken
                log.debug("closing the cluster's client: %r", exc)


def brief(exc: BaseException) -> str:
    """An error's message for a log line: redis-py's pipeline errors quote the command
    that failed, a page's bytes included."""
    text = str(exc).rsplit(" caused error: ", 1)[-1]  # the server's reply, not the command
    text = text.splitlines()[0] if text else ""
    return text if len(text) <= 160 else text[:160] + "..."


def settings_of(cfg: Config) -> ClusterSettings:
    """The cluster a SparkCache config names (``share_*``); its URL must be set."""
    return ClusterSettings(
        cfg.share_cluster_url, key_prefix=cfg.share_key_prefix,
        username=cfg.share_username or None,
        password_file=Path(cfg.share_password_file) if cfg.share_password_file else None,
        tls_ca_file=Path(cfg.share_tls_ca_file) if cfg.share_tls_ca_file else None)
