"""Connecting to the fleet's Redis Cluster (or Valkey's), and the names pages take there.

Credentials never travel on a command line, where ``ps`` shows them to every user: the
password comes from an environment variable or a file only this user may read, and a URL
carrying one is refused. TLS is the ``rediss://`` scheme, with a CA (and a client
certificate) where the cluster wants them. Every name starts with the deployment's key
prefix, so fleets sharing a cluster never meet; the page key after it is a hex digest that
already names the namespace (model, KV layout, tenant salt), so pages of different
namespaces never meet either; the rank is in the name too, since tensor-parallel ranks
share their keys, each for its own heads.
"""

from __future__ import annotations

import os
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from sparkcache.identity import KEY_BYTES

DEFAULT_PASSWORD_ENV = "SPARKCACHE_REDIS_PASSWORD"
_PREFIX_RE = re.compile(r"[A-Za-z0-9_.-]{1,64}")


@dataclass(frozen=True)
class ClusterSettings:
    """Where the cluster is and how to reach it."""

    url: str  # redis://host:port or rediss://host:port: any node; the rest are discovered
    key_prefix: str = "sparkcache"
    username: str | None = None  # an ACL user; None: the default user
    password_env: str = DEFAULT_PASSWORD_ENV
    password_file: Path | None = None
    tls_ca_file: Path | None = None
    tls_cert_file: Path | None = None
    tls_key_file: Path | None = None
    timeout_s: float = 1.0  # each connect and each command, so a dead node costs this once

    def __post_init__(self) -> None:
        problem = url_problem(self.url)
        if problem is not None:
            raise ValueError(f"cluster URL: expected {problem}")
        problem = key_prefix_problem(self.key_prefix)
        if problem is not None:
            raise ValueError(f"key prefix {self.key_prefix!r}: expected {problem}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout {self.timeout_s!r}: more than 0 seconds")

    @property
    def tls(self) -> bool:
        return urlsplit(self.url).scheme == "rediss"

    def password(self, env: Mapping[str, str] = os.environ) -> str | None:
        """From the environment variable, else the file (which only its owner may read:
        a secret readable by others is refused); None: no password."""
        if env.get(self.password_env):
            return env[self.password_env]
        if self.password_file is None:
            return None
        st = os.stat(self.password_file)
        if stat.S_IMODE(st.st_mode) & 0o077:
            raise ValueError(f"password file {self.password_file}: readable by others "
                             f"(mode {stat.S_IMODE(st.st_mode):04o}); chmod 600 it")
        return self.password_file.read_text().strip()


def url_problem(url: str) -> str | None:
    """What a cluster URL should be, if ``url`` is not that; None if it is."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises on a port that is not a number)
    except ValueError:
        parts = None
    if parts is None or parts.scheme not in ("redis", "rediss") or not parts.hostname:
        return "redis://HOST:PORT, or rediss://HOST:PORT for TLS"
    if parts.username or parts.password:
        return (f"no credentials in the URL (a command line is visible to every user): "
                f"the user as the share username, the password in ${DEFAULT_PASSWORD_ENV} "
                f"or the share password file")
    return None


def key_prefix_problem(prefix: str) -> str | None:
    return None if _PREFIX_RE.fullmatch(prefix) else "1-64 characters of A-Z a-z 0-9 _ . -"


def page_name(prefix: str, rank: int, key: bytes) -> bytes:
    """The cluster's name of rank ``rank``'s page whose raw key is ``key`` (every rank
    computes the same keys, each for its own heads: ``identity``)."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"page key of {len(key)} bytes, not {KEY_BYTES}")
    return f"{prefix}:r{rank}:page:{key.hex()}".encode()


def connect(settings: ClusterSettings, env: Mapping[str, str] = os.environ) -> Any:
    """A ``redis.cluster.RedisCluster`` for ``settings``: it finds every master from the
    node named, follows slot moves and failovers, and pipelines by node. Raises
    redis' own errors where the cluster cannot be reached."""
    from redis.cluster import RedisCluster

    parts = urlsplit(settings.url)
    kwargs: dict[str, Any] = {
        "host": parts.hostname, "port": parts.port or 6379,
        "username": settings.username, "password": settings.password(env),
        "socket_timeout": settings.timeout_s, "socket_connect_timeout": settings.timeout_s,
        # Raw bytes both ways: pages are binary.
        "decode_responses": False,
    }
    if settings.tls:
        kwargs.update(ssl=True, ssl_ca_certs=settings.tls_ca_file and str(settings.tls_ca_file),
                      ssl_certfile=settings.tls_cert_file and str(settings.tls_cert_file),
                      ssl_keyfile=settings.tls_key_file and str(settings.tls_key_file))
    return RedisCluster(**kwargs)
