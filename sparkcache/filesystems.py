"""Which filesystem a store dir lives on, and refusing those the store cannot run on.

The store is local by design, and two of its parts do not work over a network or
cluster filesystem: SQLite's write-ahead log keeps its index in a memory-mapped ``-shm``
file that every process must see coherently (SQLite's documentation: WAL does not work
over a network filesystem), and the lookup gate and the supervisor's lock are POSIX
locks, which such filesystems emulate loosely or per host. A store there would corrupt
its index or let eviction race lookups, silently; refusing it up front names the
problem while nothing is stored yet.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

# Kernel network and cluster filesystems, and FUSE mounts of remote storage, by the type
# the kernel reports in /proc/self/mounts.
NETWORK_FILESYSTEMS = frozenset({
    "nfs", "nfs4", "cifs", "smb3", "smbfs", "ncpfs", "9p", "afs", "ceph", "glusterfs",
    "lustre", "gpfs", "beegfs", "ocfs2", "gfs2", "fuse.sshfs", "fuse.s3fs",
    "fuse.gcsfuse", "fuse.rclone", "fuse.glusterfs", "fuse.cephfs", "fuse.juicefs",
})
# Filesystems that hold the store in memory: it works, but a reboot empties it and its
# bytes count against the machine's memory.
MEMORY_FILESYSTEMS = frozenset({"tmpfs", "ramfs"})


def filesystem_of(path: Path) -> str | None:
    """The type of the filesystem holding ``path``, as the kernel names it (``ext4``,
    ``nfs4``, ``tmpfs``): for a path not made yet, the one it would be made on. None where
    the mount table cannot be read."""
    real = os.path.realpath(path)
    found, found_len = None, -1
    try:
        mounts = psutil.disk_partitions(all=True)
    except (OSError, RuntimeError):
        return None
    for mount in mounts:  # mount points decoded (\040: a space) by getmntent
        point = mount.mountpoint
        inside = real == point or real.startswith(point.rstrip("/") + "/")
        # Longest mount point wins; among equals the last listed, which is the one on top.
        if inside and len(point) >= found_len:
            found, found_len = mount.fstype, len(point)
    return found


def filesystem_problem(path: Path) -> str | None:
    """Why the store cannot live at ``path`` because of its filesystem, or None."""
    fstype = filesystem_of(path)
    if fstype in NETWORK_FILESYSTEMS:
        return (f"a directory on a local filesystem such as ext4 or xfs ({path} is on "
                f"{fstype}, a network filesystem: the store's SQLite index and its locks "
                f"do not work there)")
    return None
