"""Where a rank's files live, how they are named, and refusing unsafe directories.

``<store>/rank-<r>/index.sqlite`` (+ SQLite's own ``-wal``/``-shm``),
``<store>/rank-<r>/objects/<ab>/<key>.<generation>`` (``<ab>`` = first two hex digits of the
key), temporary files ``<key>.<generation>.tmp`` beside them, and
``<store>/rank-<r>/quarantine/`` for objects that failed verification, and
``<store>/rank-<r>/free/`` for collected files kept for reuse (``store/pool.py``).

Names are built only from validated hex digests. Directories below the rank directory are
opened with ``O_NOFOLLOW | O_DIRECTORY`` and files relative to those descriptors with
``O_NOFOLLOW``, so a symlink planted anywhere under ``objects/`` is never followed.

The store dir's own files (``runtime.json``, ``kv-r<r>.json``, ``supervisor.lock``) go
through ``open_store_dir`` (the dir checked like every other, then opened without
following a link) and ``write_file`` (a fresh temporary name opened ``O_EXCL |
O_NOFOLLOW`` relative to that descriptor, then renamed over the target), so neither a
planted link nor a directory swapped after the check is ever written through.
"""

from __future__ import annotations

import errno
import os
import re
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from sparkcache.filesystems import filesystem_problem
from sparkcache.identity import KEY_HEX_LEN, require_hex
from sparkcache.store.records import StoreError, UnsafeStoreDir

GENERATION_HEX_LEN = 16
TEMP_SUFFIX = ".tmp"
INDEX_NAME = "index.sqlite"
# Maintenance's preallocated room for the index on a full disk (store/space.py).
BALLAST_NAME = "ballast"
DIR_MODE = 0o700
FILE_MODE = 0o600
DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_OBJECT_RE = re.compile(
    rf"(?P<key>[0-9a-f]{{{KEY_HEX_LEN}}})\.(?P<gen>[0-9a-f]{{{GENERATION_HEX_LEN}}})"
    rf"(?P<tmp>{re.escape(TEMP_SUFFIX)})?"
)
_RANK_RE = re.compile(r"rank-(\d+)")
_FANOUT_RE = re.compile(r"[0-9a-f]{2}")


def new_generation() -> str:
    """A random generation: unique per write without any coordination between processes."""
    return secrets.token_hex(GENERATION_HEX_LEN // 2)


def fanout(key: str) -> str:
    return require_hex(key, "page key")[:2]


def is_fanout(name: str) -> bool:
    return _FANOUT_RE.fullmatch(name) is not None


def object_name(key: str, generation: str) -> str:
    require_hex(key, "page key")
    require_hex(generation, "generation", GENERATION_HEX_LEN)
    return f"{key}.{generation}"


def temp_name(key: str, generation: str) -> str:
    return object_name(key, generation) + TEMP_SUFFIX


def parse_object_name(name: str) -> tuple[str, str, bool] | None:
    """``(key, generation, is_temp)`` for a store-made file name, None for anything else."""
    m = _OBJECT_RE.fullmatch(name)
    if m is None:
        return None
    return m["key"], m["gen"], m["tmp"] is not None


def check_stat(st: os.stat_result, what: str) -> None:
    """Refuse anything but a directory we own that neither group nor others can write,
    read or enter: the pages are the KV of users' prompts."""
    if stat.S_ISLNK(st.st_mode):
        raise UnsafeStoreDir(f"{what} is a symlink; refusing to follow it")
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeStoreDir(f"{what} is not a directory")
    if st.st_uid != os.geteuid():
        raise UnsafeStoreDir(
            f"{what} is owned by uid {st.st_uid}, not by this user (uid {os.geteuid()})"
        )
    if st.st_mode & 0o022:
        raise UnsafeStoreDir(
            f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: writable by group or others; "
            f"expected {DIR_MODE:04o}"
        )
    if st.st_mode & 0o055:
        raise UnsafeStoreDir(
            f"{what} has mode {stat.S_IMODE(st.st_mode):04o}: readable by group or others "
            f"(its pages are the KV of users' prompts); expected {DIR_MODE:04o}: "
            f"chmod {DIR_MODE:o} {what}"
        )


def ensure_dir(path: Path, create: bool) -> None:
    """Create ``path`` with mode 0700 if asked and missing, then check it is safe."""
    if create:
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
    check_stat(os.lstat(path), str(path))


def open_subdir(name: str, dir_fd: int, create: bool) -> int:
    """Open (and optionally create) directory ``name`` under ``dir_fd`` without following links.

    A newly made directory entry is made durable by fsyncing the parent, so a file renamed
    into it later cannot vanish with it in a crash.
    """
    try:
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except FileNotFoundError:
        if not create:
            raise
        try:
            os.mkdir(name, DIR_MODE, dir_fd=dir_fd)
            os.fsync(dir_fd)
        except FileExistsError:
            pass
        fd = os.open(name, DIR_FLAGS, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            raise UnsafeStoreDir(f"{name!r} under the store is not a plain directory") from exc
        raise
    try:
        check_stat(os.fstat(fd), repr(name))
    except UnsafeStoreDir:
        os.close(fd)
        raise
    return fd


def open_store_dir(path: Path, create: bool) -> int:
    """The store dir itself, opened without following a link and checked (``check_stat``)
    on the descriptor; created 0700 (with its parents) if asked and missing. Raises
    UnsafeStoreDir naming the dir and what is wrong. Callers make files relative to it."""
    what = f"store dir {path}"
    if create:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.mkdir(path, DIR_MODE)
        except FileExistsError:
            pass
    try:
        fd = os.open(path, DIR_FLAGS)
    except OSError as exc:
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):
            check_stat(os.lstat(path), what)  # says which: a link, or not a directory
        raise
    try:
        check_stat(os.fstat(fd), what)
    except UnsafeStoreDir:
        os.close(fd)
        raise
    return fd


FILE_FLAGS = os.O_NOFOLLOW | os.O_CLOEXEC


def write_file(dir_fd: int, name: str, data: bytes) -> None:
    """Replace ``name`` under ``dir_fd`` with ``data`` (mode 0600) atomically: written to
    a fresh random temporary name (``O_EXCL | O_NOFOLLOW``: nothing planted there is
    followed or reused), then renamed over ``name`` (a rename replaces a link, never its
    target)."""
    tmp = f".{name}.{secrets.token_hex(8)}{TEMP_SUFFIX}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | FILE_FLAGS, FILE_MODE,
                 dir_fd=dir_fd)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        try:
            os.unlink(tmp, dir_fd=dir_fd)
        except FileNotFoundError:
            pass
        raise


def read_file(store_dir: Path, name: str) -> bytes:
    """The bytes of the plain file ``name`` in the store dir, which must be safe
    (``open_store_dir``: UnsafeStoreDir otherwise), never through a link (OSError
    otherwise). What ``write_file`` wrote is only ever read back from such a dir: a file
    in a dir others can write may have been planted there."""
    dir_fd = open_store_dir(store_dir, create=False)
    try:
        fd = os.open(name, os.O_RDONLY | FILE_FLAGS, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(errno.EINVAL, f"{store_dir / name} is not a plain file")
        return f.read()


@dataclass(frozen=True)
class RankLayout:
    store_dir: Path
    rank: int

    @property
    def rank_dir(self) -> Path:
        return self.store_dir / f"rank-{self.rank}"

    @property
    def objects_dir(self) -> Path:
        return self.rank_dir / "objects"

    @property
    def quarantine_dir(self) -> Path:
        return self.rank_dir / "quarantine"

    @property
    def free_dir(self) -> Path:
        return self.rank_dir / "free"

    @property
    def index_path(self) -> Path:
        return self.rank_dir / INDEX_NAME

    def prepare(self, create: bool) -> None:
        """Create (if asked) and check the store, rank, objects, quarantine and free
        directories; a store made before the free directory existed may lack it unless
        created (``os.path.lexists``: a link in its place is refused, not skipped).

        Creating also makes all 256 fan-out directories up front, so commits do not pay a
        mkdir and a parent fsync the first time they touch one.
        """
        problem = filesystem_problem(self.store_dir)  # before anything is created there
        if problem:
            raise UnsafeStoreDir(f"store dir: expected {problem}")
        for path in (self.store_dir, self.rank_dir, self.objects_dir, self.quarantine_dir):
            ensure_dir(path, create)
        if create or os.path.lexists(self.free_dir):
            ensure_dir(self.free_dir, create)
        if create:
            fd = os.open(self.objects_dir, DIR_FLAGS)
            try:
                made = 0
                for i in range(256):
                    try:
                        os.mkdir(f"{i:02x}", DIR_MODE, dir_fd=fd)
                        made += 1
                    except FileExistsError:
                        pass  # checked by open_subdir() whenever it is used
                if made:
                    os.fsync(fd)
            finally:
                os.close(fd)


def list_ranks(store_dir: Path) -> list[int]:
    """Ranks that have a directory under ``store_dir``, in order."""
    try:
        ensure_dir(store_dir, create=False)
    except FileNotFoundError:
        raise StoreError(f"no store at {store_dir}: nothing was ever stored there (a "
                         "supervisor makes it at its first start)") from None
    ranks = []
    for entry in os.scandir(store_dir):
        m = _RANK_RE.fullmatch(entry.name)
        if m and entry.is_dir(follow_symlinks=False):
            ranks.append(int(m[1]))
    return sorted(ranks)
