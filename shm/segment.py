"""Named POSIX shared-memory segments with a checked header.

Byte layout of every segment (little-endian), defined once in ``HEADER``:

    offset  size  field
    0       8     magic            b"SPKSHM\\0\\0"
    8       4     header_version   HEADER_VERSION
    12      4     layout_version   version of the payload layout (ring, arena, stats ...)
    16      16    kind             ASCII tag of the payload type, NUL padded
    32      8     fingerprint      hash of the payload's record dtype (0 if none)
    40      8     total_size       bytes of the whole segment
    48      4     creator_pid
    52      4     (pad)
    56      8     creator_start    the creator's start, ``process_start`` (pid-reuse guard)
    64      ...   payload (PAYLOAD_OFFSET), cache-line aligned

Names are ``/sparkcache.<instance>.r<rank>.<role>``: the instance and rank namespace them
so two instances on one host never meet, and ``sweep`` can find one instance's leftovers.
The creator owns the name and unlinks it; attachers only close their mapping.

Ownership: /dev/shm is writable by every user, so a name can be taken by someone else
before we create it. Attaching (segments here, semaphores through ``open_semaphore``)
checks that the entry is a plain file owned by this user with mode 0600, and refuses
otherwise, naming the entry and its owner: descriptors and KV bytes never go into a segment
another user can read or write. ``Segment.create`` names the owner of a name that already
exists; ``sweep`` leaves entries that are not ours alone and ``foreign_entries`` lists them,
so the supervisor can refuse to start with one clear line instead of failing (or hanging,
on a FIFO) later.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import mmap
import os
import pwd
import re
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import posix_ipc
import psutil

log = logging.getLogger(__name__)

MAGIC = b"SPKSHM\0\0"
HEADER_VERSION = 2  # 1 had creator_start in wall-clock time (psutil create_time)
HEADER = np.dtype(
    [
        ("magic", "S8"),
        ("header_version", "<u4"),
        ("layout_version", "<u4"),
        ("kind", "S16"),
        ("fingerprint", "<u8"),
        ("total_size", "<u8"),
        ("creator_pid", "<u4"),
        ("pad", "<u4"),
        ("creator_start", "<f8"),
    ]
)
PAYLOAD_OFFSET = 64
CACHE_LINE = 128  # 2 x 64 B: arm64 and x86 prefetchers pull line pairs; keep hot fields apart
assert HEADER.itemsize == PAYLOAD_OFFSET

SHM_DIR = Path("/dev/shm")
_CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
NAME_PREFIX = "sparkcache."
_PART_RE = re.compile(r"^[A-Za-z0-9_-]{1,32}$")
_ROLE_RE = re.compile(r"^[A-Za-z0-9_.-]{1,48}$")
# A segment whose header was never written (creator died inside create) is left alone
# this long, so a sweep never races a creator that is still filling it in.
UNWRITTEN_GRACE_S = 10.0


class SegmentError(RuntimeError):
    """A segment is missing, or is not what the caller expected."""


class LayoutMismatch(SegmentError):
    """The segment exists but its header says another layout; never read it."""


class ForeignSegment(SegmentError):
    """A segment or semaphore is not a plain file of this user's with mode 0600."""


SEGMENT_MODE = 0o600


def user(uid: int) -> str:
    """``uid 1000 (alice)``; the name left out if the uid has none."""
    try:
        return f"uid {uid} ({pwd.getpwuid(uid).pw_name})"
    except KeyError:
        return f"uid {uid}"


def _kind(st: os.stat_result) -> str:
    for test, what in ((stat.S_ISLNK, "a symlink"), (stat.S_ISDIR, "a directory"),
                       (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):
        if test(st.st_mode):
            return what
    return "not a plain file"


def check_owned(st: os.stat_result, what: str) -> None:
    """Refuse (ForeignSegment) anything but a plain file owned by this user, mode 0600."""
    me = os.geteuid()
    if not stat.S_ISREG(st.st_mode):
        raise ForeignSegment(f"{what} is {_kind(st)}, owned by {user(st.st_uid)}; refusing "
                             "to use it")
    if st.st_uid != me:
        raise ForeignSegment(
            f"{what} is owned by {user(st.st_uid)}, not by this user ({user(me)}); refusing "
            "to use it"
        )
    mode = stat.S_IMODE(st.st_mode)
    if mode != SEGMENT_MODE:
        raise ForeignSegment(
            f"{what} has mode {mode:04o} (owner {user(st.st_uid)}), expected "
            f"{SEGMENT_MODE:04o}; refusing to use it"
        )


def describe_entry(entry: str) -> str:
    """``/dev/shm/<entry>`` for a message: its owner and mode, or what else it is."""
    try:
        st = os.lstat(SHM_DIR / entry)
    except FileNotFoundError:
        return f"{SHM_DIR / entry} (gone)"
    if not stat.S_ISREG(st.st_mode):
        return f"{SHM_DIR / entry} ({_kind(st)}, owner {user(st.st_uid)})"
    return f"{SHM_DIR / entry} (owner {user(st.st_uid)}, mode {stat.S_IMODE(st.st_mode):04o})"


def open_semaphore(name: str) -> posix_ipc.Semaphore:
    """Open the existing POSIX semaphore ``name`` (``/dev/shm/sem.<name>``) once it is
    checked like a segment (``check_owned``). A semaphore has no descriptor to fstat, so
    the entry is checked before opening and must be the same file after."""
    path = SHM_DIR / ("sem." + name.lstrip("/"))
    what = f"semaphore {name}"
    try:
        before = os.lstat(path)
    except FileNotFoundError:
        raise posix_ipc.ExistentialError(f"No semaphore named {name} exists") from None
    check_owned(before, what)
    sem = posix_ipc.Semaphore(name)
    try:
        after = os.lstat(path)
        if (after.st_dev, after.st_ino) != (before.st_dev, before.st_ino):
            raise ForeignSegment(f"{what} was replaced while it was opened; refusing to use it")
        check_owned(after, what)
    except BaseException:
        sem.close()
        raise
    return sem


def dtype_fingerprint(dtype: np.dtype) -> int:
    """64-bit hash of a dtype's field names, types, offsets and size."""
    text = repr((dtype.descr, dtype.itemsize)).encode()
    return int.from_bytes(hashlib.blake2b(text, digest_size=8).digest(), "little")


def instance_prefix(instance: str) -> str:
    """What every /dev/shm name of ``instance`` begins with (no slash): the user's id
    comes first, so two users' instances of one name (each one's ``default``) never
    meet. Sharing names, the second user's supervisor found the first one's segments
    and refused to start."""
    return f"{user_prefix()}{instance}."


def user_prefix() -> str:
    """What every /dev/shm name of this user's instances begins with (no slash)."""
    return f"{NAME_PREFIX}u{os.geteuid()}."


def segment_name(instance: str, rank: int, role: str) -> str:
    if not _PART_RE.match(instance):
        raise ValueError(f"instance {instance!r}: expected 1-32 characters of A-Z a-z 0-9 _ -")
    if rank < 0:
        raise ValueError(f"rank {rank}: expected 0 or more")
    if not _ROLE_RE.match(role):
        raise ValueError(f"role {role!r}: expected 1-48 characters of A-Z a-z 0-9 _ . -")
    return f"/{instance_prefix(instance)}r{rank}.{role}"


def _other_users(name: str) -> str:
    """For a missing segment ``name``: the users whose segments of that instance, rank
    and role exist (an engine run under another account than its supervisor's looks
    for its own user's names), as a clause; empty if none."""
    mine = user_prefix()
    if not name.startswith("/" + mine):
        return ""
    rest = name[len(mine) + 1:]
    owners = sorted({user(st.st_uid) for p in SHM_DIR.glob(f"{NAME_PREFIX}u*.{rest}")
                     if (st := _lstat(p)) is not None and st.st_uid != os.geteuid()})
    if not owners:
        return ""
    return (f"; {', '.join(owners)} run(s) that instance: segments are per user, so run "
            "the engine under the supervisor's account")


def _lstat(path: Path) -> os.stat_result | None:
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def process_start(pid: int) -> float:
    """When ``pid`` started, in seconds since boot (``starttime`` of /proc/<pid>/stat);
    0.0 if it cannot be read. With the pid it names one process: a later one given the
    same pid started later. It is what every pid recorded beside a start time is checked
    against, for equality.

    Not psutil's ``create_time``: that adds ``btime`` from /proc/stat, read afresh at
    each call, a whole number of seconds worked out from the wall clock, which a clock
    step moves. The same live process then read a second apart from its own recorded
    start, and was taken for dead (commit read a slot its live writer had not announced).
    Time since boot moves for no clock change."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat_line = f.read()
        # Fields after the command name, which may itself hold spaces or parentheses:
        # the first is field 3 (state), so starttime (field 22) is the 20th.
        ticks = int(stat_line[stat_line.rindex(b")") + 2 :].split()[19])
    except (OSError, ValueError, IndexError):
        return 0.0
    return ticks / _CLOCK_TICKS


@dataclass(frozen=True)
class SegmentSpec:
    """What a caller expects of a segment: checked on attach."""

    kind: str
    layout_version: int
    fingerprint: int = 0


class Segment:
    """A mapped shared-memory segment. ``buf`` is the whole mapping; ``payload`` starts
    after the header. Create with ``Segment.create``, attach with ``Segment.attach``."""

    def __init__(self, name: str, mm: mmap.mmap, owner: bool) -> None:
        self.name = name
        self.mm = mm
        self.owner = owner
        # A one-element array, not a scalar, so field writes land in shared memory.
        self.header = np.frombuffer(mm, HEADER, count=1)

    @property
    def size(self) -> int:
        return len(self.mm)

    def array(self, dtype: np.dtype | str, offset: int, count: int = -1) -> np.ndarray:
        """A numpy view of the payload at ``offset`` bytes past the header. Views must be
        dropped before ``close`` (a mapping cannot close under a live view)."""
        return np.frombuffer(self.mm, dtype, count=count, offset=PAYLOAD_OFFSET + offset)

    @classmethod
    def create(cls, name: str, spec: SegmentSpec, payload_size: int,
               reserve: bool = False) -> Segment:
        """Create ``name`` (mode 0600, fails if it exists) and write its header.
        ``reserve`` allocates every page now, so a /dev/shm too small for it fails here
        (OSError ENOSPC, nothing left behind) instead of with a SIGBUS at first touch."""
        total = PAYLOAD_OFFSET + payload_size
        try:
            mem = posix_ipc.SharedMemory(name, posix_ipc.O_CREX, mode=SEGMENT_MODE, size=total)
        except posix_ipc.ExistentialError:
            raise SegmentError(
                f"shared-memory segment {name} already exists: {describe_entry(name[1:])}"
            ) from None
        try:
            os.fchmod(mem.fd, SEGMENT_MODE)  # shm_open applies the umask; be explicit
            if reserve:
                # The header's page only, for now: the header is written before the rest
                # is allocated. ``sweep`` takes a segment without one for one whose
                # creator died, once UNWRITTEN_GRACE_S is past, and allocating an engine's
                # KV cache (tens of GiB) can take longer than that: a supervisor starting
                # meanwhile unlinked the live engine's segment.
                os.posix_fallocate(mem.fd, 0, PAYLOAD_OFFSET)
            mm = mmap.mmap(mem.fd, total)
        except BaseException:
            mem.close_fd()
            posix_ipc.unlink_shared_memory(name)
            raise
        seg = cls(name, mm, owner=True)
        try:
            h = seg.header[0]
            h["header_version"] = HEADER_VERSION
            h["layout_version"] = spec.layout_version
            h["kind"] = spec.kind.encode()
            h["fingerprint"] = spec.fingerprint
            h["total_size"] = total
            h["creator_pid"] = os.getpid()
            h["creator_start"] = process_start(os.getpid())
            h["magic"] = MAGIC  # last: a header with magic is complete
            del h
            if reserve:
                os.posix_fallocate(mem.fd, 0, total)  # ENOSPC here, not SIGBUS later
        except BaseException:
            seg.close()  # unlinks
            raise
        finally:
            mem.close_fd()
        return seg

    @classmethod
    def attach(cls, name: str, spec: SegmentSpec) -> Segment:
        """Map an existing segment after checking its header against ``spec``."""
        try:
            mem = posix_ipc.SharedMemory(name)
        except posix_ipc.ExistentialError:
            raise SegmentError(f"shared-memory segment {name} does not exist"
                           f"{_other_users(name)}") from None
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise
            # shm_open never follows a link (O_NOFOLLOW).
            raise ForeignSegment(
                f"shared-memory segment {name} is {describe_entry(name[1:])}; refusing to "
                "use it"
            ) from None
        try:
            check_owned(os.fstat(mem.fd), f"shared-memory segment {name}")
            if mem.size < PAYLOAD_OFFSET:
                raise LayoutMismatch(
                    f"segment {name} is {mem.size} bytes, smaller than its header"
                )
            mm = mmap.mmap(mem.fd, mem.size)
        finally:
            mem.close_fd()
        seg = cls(name, mm, owner=False)
        try:
            seg._check(spec)
        except BaseException:
            seg.close()
            raise
        return seg

    def _check(self, spec: SegmentSpec) -> None:
        h = self.header[0]
        if bytes(h["magic"]) != MAGIC.rstrip(b"\0"):
            raise LayoutMismatch(f"segment {self.name} has no SparkCache header")
        got = [
            ("header version", int(h["header_version"]), HEADER_VERSION),
            ("kind", bytes(h["kind"]).decode(errors="replace"), spec.kind),
            ("layout version", int(h["layout_version"]), spec.layout_version),
            ("record dtype fingerprint", int(h["fingerprint"]), spec.fingerprint),
            ("size", int(h["total_size"]), self.size),
        ]
        for what, found, expected in got:
            if found != expected:
                raise LayoutMismatch(
                    f"segment {self.name}: {what} is {found!r}, this code expects "
                    f"{expected!r}; refusing to read it (restart the supervisor so both "
                    "sides run the same version)"
                )

    def close(self) -> None:
        """Drop this process's mapping; the creator also unlinks the name."""
        del self.header
        try:
            self.mm.close()
        except BufferError:
            # A numpy view still exists somewhere; the mapping goes when it does.
            log.debug("segment %s still has views; mapping freed later", self.name)
        if self.owner:
            unlink_quietly(self.name)
            self.owner = False

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def unlink_quietly(name: str) -> bool:
    try:
        posix_ipc.unlink_shared_memory(name)
        return True
    except posix_ipc.ExistentialError:
        return False


def _ours(st: os.stat_result) -> bool:
    return stat.S_ISREG(st.st_mode) and st.st_uid == os.geteuid()


def read_creator(path: Path) -> tuple[int, float] | None:
    """(pid, start time) from a segment file's header, or None if it has none yet (or is
    not a plain file of ours: never follow a link, never wait on a FIFO)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        if not _ours(os.fstat(fd)):
            return None
        raw = os.pread(fd, PAYLOAD_OFFSET, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    if len(raw) < PAYLOAD_OFFSET:
        return None
    h = np.frombuffer(raw, HEADER, count=1)[0]
    if bytes(h["magic"]) != MAGIC.rstrip(b"\0"):
        return None
    pid = int(h["creator_pid"])
    # Nothing orders the creator's stores for this read: on arm64 the magic, written last,
    # may show before the pid it follows. A new segment's pages are zeros, so a pid not
    # visible yet reads 0, which creator_alive calls dead: it counts as no header yet
    # (sweep then waits UNWRITTEN_GRACE_S), or a live engine's segment was unlinked.
    if pid <= 0:
        return None
    if int(h["header_version"]) != HEADER_VERSION:
        # Another SparkCache version's start is not ours to compare (1 was wall-clock
        # time): its creator is then judged by pid alone, which may keep a reused pid's
        # leftovers, where a wrong start would unlink a live engine's KV cache.
        return pid, 0.0
    return pid, float(h["creator_start"])


def creator_alive(pid: int, start: float) -> bool:
    """Whether the process ``pid`` that started at ``start`` (``process_start``) still
    runs. A zombie does not
    (it exited and holds no mapping; only its parent has not reaped it yet: an engine's
    KV segment of tens of GiB waited for that). What psutil cannot tell counts as alive:
    unlinking a live process's segment breaks it, keeping a dead one's only delays."""
    if not psutil.pid_exists(pid):
        return False
    actual = process_start(pid)
    # A different start means the pid was reused by an unrelated process. 0.0 is a start
    # nobody could read: the pid alone then says.
    if actual != 0.0 and start != 0.0 and actual != start:
        return False
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False
    except psutil.Error:
        return True


def process_gone(pid: int, start: float) -> bool:
    """True once the process ``pid`` that started at ``start`` (``process_start``) has
    exited: the pid is gone, is a zombie (exited, not yet reaped: its memory and files
    are released), or names a process started at another time. Whatever psutil cannot
    tell counts as alive: reporting a live writer dead could let it write into memory
    its reader has reused, while a late report only delays."""
    return pid <= 0 or not creator_alive(pid, start)


def sweep(instance: str, only: Callable[[str], bool] | None = None) -> list[str]:
    """Unlink the segments (and their semaphores) of ``instance`` whose creator is dead,
    of those whose name (without the slash) ``only`` accepts if given. Segments of live
    creators, of other instances and of other users (or not plain files: see
    ``foreign_entries``) are never touched. Returns the names removed."""
    prefix = instance_prefix(instance)
    removed: list[str] = []
    live_segments: set[str] = set()
    for path in sorted(SHM_DIR.glob(prefix + "*")):
        if only is not None and not only(path.name):
            live_segments.add(path.name)  # not to be judged here: nor its semaphores
            continue
        try:
            if not _ours(os.lstat(path)):
                live_segments.add(path.name)  # not ours to judge; keeps its semaphores too
                continue
        except FileNotFoundError:
            continue
        creator = read_creator(path)
        if creator is None:
            try:
                age = time.time() - path.stat().st_mtime
            except OSError:
                continue
            if age < UNWRITTEN_GRACE_S:
                live_segments.add(path.name)
                continue
        elif creator_alive(*creator):
            live_segments.add(path.name)
            continue
        if unlink_quietly("/" + path.name):
            removed.append("/" + path.name)
    # Semaphores are named after their segment plus a suffix ("<segment>.data").
    for path in sorted(SHM_DIR.glob("sem." + prefix + "*")):
        sem_name = path.name[len("sem.") :]
        owner = sem_name.rsplit(".", 1)[0]
        if owner in live_segments or (only is not None and not only(owner)):
            continue
        # A ring is made segment first, then its semaphores: a segment that is there now
        # but was not listed above was made since, by a live process (a second
        # supervisor of the instance starting beside this one unlinked the first one's
        # semaphores, and no end could attach to its rings).
        if "/" + owner not in removed and os.path.lexists(SHM_DIR / owner):
            continue
        try:
            if not _ours(os.lstat(path)):
                continue
        except FileNotFoundError:
            continue
        try:
            posix_ipc.unlink_semaphore("/" + sem_name)
            removed.append("/" + sem_name)
        except posix_ipc.ExistentialError:
            pass
    if removed:
        log.info("swept %d leftovers of instance %s: %s", len(removed), instance, removed)
    return removed


def instance_entries(instance: str) -> list[str]:
    """Every /dev/shm entry (segments and semaphores) of ``instance``."""
    prefix = instance_prefix(instance)
    return sorted(
        p.name for p in SHM_DIR.iterdir() if p.name.startswith((prefix, "sem." + prefix))
    )


def foreign_entries(instance: str) -> list[str]:
    """Entries of ``instance`` in /dev/shm (segments and semaphores) that are not plain
    files of this user's with mode 0600, described for a message (``describe_entry``)."""
    out = []
    for entry in instance_entries(instance):
        try:
            check_owned(os.lstat(SHM_DIR / entry), entry)
        except FileNotFoundError:
            continue
        except ForeignSegment:
            out.append(describe_entry(entry))
    return out
