"""SparkCache configuration: one frozen dataclass, read from ``SPARKCACHE_*`` variables
and CLI flags generated from the same fields.

Every field carries its help text in ``metadata["help"]``; the CLI flags, their help and
the environment variable names all come from here, so a setting cannot exist in one place
and be missing in another.
"""

from __future__ import annotations

import dataclasses
import errno
import ipaddress
import os
import re
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import psutil

from sparkcache.filesystems import filesystem_problem
from sparkcache.fleet.cluster import key_prefix_problem, url_problem

ENV_PREFIX = "SPARKCACHE_"

KiB = 1024
MiB = 1024 * KiB
GiB = 1024 * MiB
TiB = 1024 * GiB

_SIZE_UNITS = {"": 1, "B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*$")
_INSTANCE_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
# A DNS host name (RFC 1123 labels); an address is checked by ipaddress instead.
_HOSTNAME_RE = re.compile(
    r"^(?=.{1,253}$)[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
    r"(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*$"
)
# Workers beat at least every 0.2 s when idle, and at least once a second while a long step
# makes progress (workers.lifecycle.checkpoint); a shorter limit would kill healthy ones.
MIN_HEARTBEAT_TIMEOUT_S = 1.0


class AccessMode(str, Enum):
    """What the store may do for the engine."""

    READ_WRITE = "read-write"
    RESTORE_ONLY = "restore-only"
    OFF = "off"


def _default_store_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "sparkcache"


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True)
class Config:
    """Settings of one SparkCache instance (all ranks of one serving node)."""

    store_dir: Path = field(
        default_factory=_default_store_dir,
        metadata=_help("Directory holding rank-<r>/ stores; created 0700 if missing."),
    )
    instance: str = field(
        default="default",
        metadata=_help("Name that namespaces shared-memory segments: [A-Za-z0-9_-], 1-32."),
    )
    ranks: int = field(default=1, metadata=_help("Tensor-parallel ranks served, >= 1."))
    max_bytes: int = field(
        default=40 * GiB,
        metadata=_help("High watermark per rank; crossing it starts eviction (e.g. 40GiB)."),
    )
    low_watermark_bytes: int = field(
        default=32 * GiB,
        metadata=_help("Eviction stops once used bytes per rank fall to this (< max bytes)."),
    )
    min_free_bytes: int = field(
        default=GiB,
        metadata=_help(
            "Free space kept on the store's filesystem: below it maintenance evicts as it "
            "does past max bytes, whatever fills the disk (e.g. 1GiB; 0: none kept)."
        ),
    )
    access_mode: AccessMode = field(
        default=AccessMode.READ_WRITE,
        metadata=_help("read-write, restore-only (no capture) or off."),
    )
    # 4 x 240 MiB: with the rings, under 1 GiB of /dev/shm per rank. A publication larger
    # than a slot goes in parts, so the slots bound the memory, not what may be stored.
    capture_slots: int = field(
        default=4,
        metadata=_help("Capture slots per rank: parts of publications in flight, >= 1."),
    )
    capture_slot_bytes: int = field(
        default=240 * MiB,
        metadata=_help(
            "Bytes of one capture slot: a publication larger than one goes a slot at a "
            "time; must hold at least one page."
        ),
    )
    lease_seconds: float = field(
        default=300.0,
        metadata=_help(
            "Seconds a new or restoring root is kept from eviction, >= 0; at the cap the "
            "oldest leases yield."
        ),
    )
    lookup_lease_seconds: float = field(
        default=30.0,
        metadata=_help(
            "Seconds a lookup protects the prefix it counted, so the restore that follows "
            "finds it, > 0."
        ),
    )
    release_timeout_seconds: float = field(
        default=5.0,
        metadata=_help(
            "Seconds the engine lends a publication's blocks to capture before taking "
            "them back, for each arena (slots x slot bytes) of its pages, > 0; capture "
            "refuses publications whose deadline lies further ahead."
        ),
    )
    page_tokens: int = field(default=16, metadata=_help("Tokens per page, >= 1."))
    cpus: tuple[int, ...] | None = field(
        default=None,
        metadata=_help("Cores for SparkCache workers, e.g. 6-7 or 2,3; default: any."),
    )
    heartbeat_timeout_s: float = field(
        default=10.0,
        metadata=_help(
            "Seconds a running worker may go without a heartbeat before the supervisor "
            "kills and restarts it (hung or stopped), >= 1."
        ),
    )
    maintenance_slice_roots: int = field(
        default=16,
        metadata=_help("Roots one maintenance slice may evict or cut short, >= 1."),
    )
    maintenance_slice_bytes: int = field(
        default=64 * MiB,
        metadata=_help(
            "Bytes one maintenance slice may handle: page references it drops from roots "
            "plus objects it collects (e.g. 64MiB)."
        ),
    )
    maintenance_slice_ms: float = field(
        default=20.0,
        metadata=_help(
            "Milliseconds one maintenance slice may run, > 0 and at most the duty cap's "
            "share of a second (maintenance duty x 1000)."
        ),
    )
    maintenance_duty: float = field(
        default=0.2,
        metadata=_help(
            "Share of any second maintenance slices may take, > 0 and <= 1: it pauses "
            "between slices to stay under it."
        ),
    )
    maintenance_duty_max: float = field(
        default=0.5,
        metadata=_help(
            "Share of a second slices may take as used bytes reach the hard cap, > 0 and "
            "<= 1 (the maintenance duty where that is higher): past max bytes the duty "
            "rises in proportion, so reclaiming speeds up before publications are refused."
        ),
    )
    maintenance_io_bytes_per_s: int = field(
        default=GiB,
        metadata=_help(
            "Bytes per second maintenance may unlink and write to the index (e.g. 1GiB); "
            "reclaiming can never outpace it."
        ),
    )
    maintenance_pool_bytes: int = field(
        default=256 * MiB,
        metadata=_help(
            "Bytes of collected files kept per rank for the next commits to overwrite "
            "instead of creating files (e.g. 256MiB), at most the gap between the "
            "watermarks; 0: none kept."
        ),
    )
    maintenance_halve_bytes: int = field(
        default=MiB,
        metadata=_help(
            "A collected file the pool does not take and larger than this (e.g. 1MiB) "
            "is removed in two units of a maintenance slice, its back half cut off "
            "first (in pieces of the slice's bytes where half is more): with online "
            "discard, freeing a whole file at once can take longer than a slice."
        ),
    )
    read_ahead_bytes: int = field(
        default=2 * GiB,
        metadata=_help(
            "Bytes per rank of the most recently used roots the restore worker reads into "
            "the page cache after it starts, while idle, so the first turns after a "
            "restart or a reboot find them in memory (e.g. 2GiB); 0: none."
        ),
    )
    share_cluster_url: str = field(
        default="",
        metadata=_help(
            "The fleet's Redis Cluster (redis://HOST:PORT, rediss:// for TLS): a share "
            "worker per rank copies durable pages to it (docs/fleet.md); empty: off. "
            "No credentials in it: the password comes from $SPARKCACHE_REDIS_PASSWORD or "
            "the share password file."
        ),
    )
    share_key_prefix: str = field(
        default="sparkcache",
        metadata=_help("Names in the cluster start with it: one per deployment, 1-64 "
                       "characters of A-Z a-z 0-9 _ . -."),
    )
    share_username: str = field(
        default="", metadata=_help("The cluster's ACL user; empty: the default user."))
    share_password_file: str = field(
        default="",
        metadata=_help("A file holding the cluster's password, readable by its owner "
                       "alone; empty: $SPARKCACHE_REDIS_PASSWORD, or none."),
    )
    share_tls_ca_file: str = field(
        default="", metadata=_help("CA certificate for rediss://; empty: the system's."))
    share_bytes_per_s: int = field(
        default=256 * MiB,
        metadata=_help("Bytes per second a share worker may send to the cluster (e.g. "
                       "256MiB), per rank."),
    )
    share_duty: float = field(
        default=0.2,
        metadata=_help("Share of any second a share worker may work, > 0 and <= 1."),
    )
    share_roots: str = field(
        default="all",
        metadata=_help("Which roots are shared: all (newest first) or hit (only those "
                       "restored at least once, most recently restored first)."),
    )
    share_lookup_timeout_s: float = field(
        default=0.1,
        metadata=_help(
            "Read-through: how long a prefix lookup may ask the cluster for the pages "
            "the local store lacks (the request waits that long at most; the restore "
            "worker then fetches them). 0: no read-through, the node only shares."
        ),
    )
    metrics_host: str = field(
        default="127.0.0.1",
        metadata=_help(
            "Address the supervisor's /metrics and /healthz endpoint binds: an IP address "
            "(0.0.0.0 or :: for every interface) or a host name."
        ),
    )
    metrics_port: int = field(
        default=9464,
        metadata=_help("Port of the supervisor's /metrics and /healthz endpoint; 0: none."),
    )

    @property
    def pool_cap_bytes(self) -> int:
        """What the pool of collected files may hold (store/pool.py): the setting, within
        the gap an episode frees, so pooled bytes never take more room than eviction made."""
        return min(self.maintenance_pool_bytes, self.max_bytes - self.low_watermark_bytes)

    @property
    def read_through(self) -> bool:
        """Whether lookups and loads reach into the fleet's cluster for the pages the
        local store lacks (docs/fleet.md): a cluster named and a lookup time-out."""
        return bool(self.share_cluster_url) and self.share_lookup_timeout_s > 0

    @property
    def hard_cap_bytes(self) -> int:
        """Beyond max_bytes by the gap between the watermarks: maintenance had that much
        room to catch up; past it publications are refused rather than overrunning."""
        return self.max_bytes + (self.max_bytes - self.low_watermark_bytes)

    def check_page_fits(self, page_bytes: int) -> None:
        """Raise ConfigError if one page (known once the KV caches are registered) does not
        fit a capture slot."""
        if page_bytes > self.capture_slot_bytes:
            raise ConfigError(
                [
                    Problem(
                        "capture_slot_bytes",
                        str(self.capture_slot_bytes),
                        f"at least one page: {page_bytes} bytes "
                        f"({self.page_tokens} tokens across all layers)",
                    )
                ]
            )


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(Config)}


def env_name(field_name: str) -> str:
    return ENV_PREFIX + field_name.upper()


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


@dataclass(frozen=True)
class Problem:
    """One invalid setting: which, its value and what is allowed."""

    field_name: str
    value: str
    allowed: str

    def __str__(self) -> str:
        where = f"{env_name(self.field_name)} ({flag_name(self.field_name)})"
        return f"{where}={self.value!r} is invalid: expected {self.allowed}"


class ConfigError(ValueError):
    """One or more settings are invalid; ``problems`` lists each."""

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("\n".join(str(p) for p in problems))


def parse_size(text: str) -> int:
    """``40GiB``, ``512MiB``, ``1.5GiB``, ``4096`` -> bytes. Binary suffixes only: ``GB``
    is refused rather than guessed, since 10^9 and 2^30 differ by 7 %."""
    m = _SIZE_RE.match(text)
    if not m or m.group(2) not in _SIZE_UNITS:
        raise ValueError("a size: plain bytes or a number with KiB, MiB, GiB or TiB")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


def parse_cpus(text: str) -> tuple[int, ...]:
    """``0-3,6`` -> (0, 1, 2, 3, 6)."""
    cores: set[int] = set()
    for part in text.split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError("a CPU list such as 0-3,6")
        first, last = int(lo), int(hi) if sep else int(lo)
        if last < first:
            raise ValueError("a CPU list such as 0-3,6 (ranges ascending)")
        cores.update(range(first, last + 1))
    return tuple(sorted(cores))


def _parse_field(name: str, text: str) -> Any:
    """Convert one raw string to the type of field ``name``; ValueError names what is allowed."""
    if name in ("max_bytes", "low_watermark_bytes", "min_free_bytes", "capture_slot_bytes",
                "maintenance_slice_bytes", "maintenance_io_bytes_per_s",
                "maintenance_pool_bytes", "maintenance_halve_bytes", "read_ahead_bytes",
                "share_bytes_per_s"):
        return parse_size(text)
    if name in ("ranks", "capture_slots", "page_tokens", "metrics_port",
                "maintenance_slice_roots"):
        try:
            return int(text)
        except ValueError:
            raise ValueError("a whole number") from None
    if name in ("lease_seconds", "lookup_lease_seconds", "release_timeout_seconds",
                "heartbeat_timeout_s", "share_lookup_timeout_s"):
        try:
            return float(text)
        except ValueError:
            raise ValueError("a number of seconds") from None
    if name == "maintenance_slice_ms":
        try:
            return float(text)
        except ValueError:
            raise ValueError("a number of milliseconds") from None
    if name in ("maintenance_duty", "maintenance_duty_max", "share_duty"):
        try:
            return float(text)
        except ValueError:
            raise ValueError("a share of a second such as 0.2") from None
    if name == "access_mode":
        try:
            return AccessMode(text)
        except ValueError:
            allowed = ", ".join(m.value for m in AccessMode)
            raise ValueError(f"one of {allowed}") from None
    if name == "cpus":
        return parse_cpus(text)
    if name == "store_dir":
        return Path(text).expanduser()
    return text


def load(
    env: Mapping[str, str] | None = None,
    overrides: Mapping[str, str | None] | None = None,
    *,
    check_store_dir: bool = True,
) -> Config:
    """Build and validate a Config: defaults, then ``SPARKCACHE_*`` variables, then CLI
    ``overrides`` (field name -> raw text; None means not given). Every problem found is
    reported at once in one ConfigError."""
    env = os.environ if env is None else env
    raw: dict[str, str] = {}
    for name in FIELDS:
        if env_name(name) in env:
            raw[name] = env[env_name(name)]
    for name, text in (overrides or {}).items():
        if name not in FIELDS:
            raise KeyError(f"unknown setting {name!r}")
        if text is not None:
            raw[name] = text

    problems: list[Problem] = []
    values: dict[str, Any] = {}
    for name, text in raw.items():
        try:
            values[name] = _parse_field(name, text)
        except ValueError as e:
            problems.append(Problem(name, text, str(e)))
    cfg = Config(**values)
    failed = {p.field_name for p in problems}
    problems.extend(validate(cfg, check_store_dir=check_store_dir, skip=failed, given=raw))
    if problems:
        raise ConfigError(problems)
    return cfg


def validate(
    cfg: Config,
    *,
    check_store_dir: bool = True,
    skip: frozenset[str] | set[str] = frozenset(),
    given: Mapping[str, str] | None = None,
) -> list[Problem]:
    """All problems of ``cfg``; fields in ``skip`` already failed to parse. A message
    quotes the text the operator gave (``given``) where there is one."""
    out: list[Problem] = []
    given = given or {}

    def bad(name: str, allowed: str) -> None:
        if name not in skip:
            out.append(Problem(name, given.get(name, _show(getattr(cfg, name))), allowed))

    if not _INSTANCE_RE.match(cfg.instance):
        bad("instance", "1-32 characters from A-Z a-z 0-9 _ -")
    if cfg.ranks < 1:
        bad("ranks", "at least 1")
    if cfg.max_bytes <= 0:
        bad("max_bytes", "a positive size")
    if cfg.low_watermark_bytes >= cfg.max_bytes:
        bad("low_watermark_bytes", f"a size below max bytes ({_show(cfg.max_bytes)})")
    if cfg.capture_slots < 1:
        bad("capture_slots", "at least 1")
    if cfg.page_tokens < 1:
        bad("page_tokens", "at least 1")
    if cfg.capture_slot_bytes < cfg.page_tokens:
        # The page size is only known once the engine registers its KV caches
        # (check_page_fits); a slot smaller than one byte per token can never hold one.
        bad("capture_slot_bytes", f"at least one page (>= {cfg.page_tokens} bytes)")
    if cfg.lease_seconds < 0:
        bad("lease_seconds", "zero or more seconds")
    for name in ("lookup_lease_seconds", "release_timeout_seconds"):
        value = getattr(cfg, name)
        if not 0 < value <= 3600:
            bad(name, "more than 0 and at most 3600 seconds")
    if not cfg.heartbeat_timeout_s >= MIN_HEARTBEAT_TIMEOUT_S:  # also refuses NaN
        bad("heartbeat_timeout_s", f"a number of seconds >= {MIN_HEARTBEAT_TIMEOUT_S:g}")
    _validate_maintenance(cfg, bad)
    if cfg.share_cluster_url and "share_cluster_url" not in skip:
        problem = url_problem(cfg.share_cluster_url)
        if problem is not None:
            # The URL as given may hold a password: never repeated into a log.
            out.append(Problem("share_cluster_url", redacted_url(cfg.share_cluster_url),
                               problem))
    if key_prefix_problem(cfg.share_key_prefix):
        bad("share_key_prefix", key_prefix_problem(cfg.share_key_prefix) or "")
    if cfg.share_bytes_per_s <= 0:
        bad("share_bytes_per_s", "a positive size")
    if not 0 < cfg.share_duty <= 1:
        bad("share_duty", "a share of a second above 0 and at most 1, such as 0.2")
    if cfg.share_roots not in ("all", "hit"):
        bad("share_roots", "all or hit")
    if not 0 <= cfg.share_lookup_timeout_s <= 10:
        bad("share_lookup_timeout_s", "0 (no read-through) to 10 seconds, such as 0.1")
    if not 0 <= cfg.metrics_port <= 65535:
        bad("metrics_port", "a port from 0 to 65535 (0: no endpoint)")
    if not is_host(cfg.metrics_host):
        bad("metrics_host", "an IP address such as 127.0.0.1, 0.0.0.0 or ::1, or a host name "
            "such as localhost")
    if cfg.cpus is not None:
        count = psutil.cpu_count(logical=True) or 1
        missing = [c for c in cfg.cpus if c >= count]
        if missing:
            bad("cpus", f"cores that exist on this machine: 0-{count - 1} (no core {missing})")
    if check_store_dir and "store_dir" not in skip:
        reason = store_dir_problem(cfg.store_dir)
        if reason:
            out.append(Problem("store_dir", str(cfg.store_dir), reason))
    return out


def _validate_maintenance(cfg: Config, bad: Callable[[str, str], None]) -> None:
    if cfg.maintenance_slice_roots < 1:
        bad("maintenance_slice_roots", "at least 1")
    for name in ("maintenance_slice_bytes", "maintenance_io_bytes_per_s",
                 "maintenance_halve_bytes"):
        if getattr(cfg, name) <= 0:
            bad(name, "a positive size")
    for name in ("maintenance_pool_bytes", "read_ahead_bytes", "min_free_bytes"):
        if getattr(cfg, name) < 0:
            bad(name, "a size, 0 or more")
    duty = cfg.maintenance_duty
    if not 0 < duty <= 1:  # also refuses NaN
        bad("maintenance_duty", "a share of a second above 0 and at most 1, such as 0.2")
        return
    if not 0 < cfg.maintenance_duty_max <= 1:
        bad("maintenance_duty_max", "a share of a second above 0 and at most 1, such as 0.5")
    # A slice must fit the duty cap's share of a second (maintenance_policy.DutyCycle).
    if not 0 < cfg.maintenance_slice_ms <= duty * 1000:
        bad("maintenance_slice_ms",
            f"more than 0 and at most {duty * 1000:g} milliseconds (the maintenance duty, "
            f"{duty:g}, of a second)")


def redacted_url(url: str) -> str:
    """``url`` without what precedes an ``@`` in its authority (credentials)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    authority, slash, path = rest.partition("/")
    return f"{scheme}://{authority.rpartition('@')[2]}{slash}{path}" if "@" in authority \
        else url


def is_host(text: str) -> bool:
    """An IPv4 or IPv6 address, or a syntactically valid host name (not resolved here:
    the supervisor resolves it when it binds, and says so if that fails)."""
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return bool(_HOSTNAME_RE.match(text)) and not text.replace(".", "").isdigit()
    return True


def store_dir_problem(path: Path) -> str | None:
    """Why ``path`` cannot be the store dir, or None. A missing dir is fine if it can be
    created. Writability is probed with a real file, since root passes ``os.access``; the
    filesystem must be a local one (``sparkcache.filesystems``)."""
    probe = path
    while not probe.exists():
        if probe.parent == probe:
            break
        probe = probe.parent
    if not probe.is_dir():
        return "a directory (this path is not one)" if probe == path else (
            f"a directory that can be created ({probe} is not a directory)"
        )
    try:
        with tempfile.TemporaryFile(dir=probe, prefix=".sparkcache-probe-"):
            pass
    except OSError as e:
        what = "a writable directory" if probe == path else f"a creatable directory ({probe}"
        detail = errno.errorcode.get(e.errno or 0, str(e))
        return f"{what}{')' if probe != path else ''}: writing there fails with {detail}"
    return filesystem_problem(probe)


def _show(value: Any) -> str:
    if isinstance(value, Enum):
        return str(value.value)
    if isinstance(value, tuple):
        return ",".join(map(str, value))
    return str(value)


def describe(cfg: Config) -> dict[str, str]:
    """Field name -> value as an operator would write it."""
    return {name: _show(getattr(cfg, name)) for name in FIELDS}
