"""Durably writing object files: step 2 of the commit protocol, and undoing it.

Each page goes to ``<key>.<generation>.tmp``; one background thread fsyncs a page while the
committer writes and checksums the next (fsync releases the GIL, so disk and CPU overlap);
then every temp file is renamed to its final name and every fan-out directory touched is
fsynced. Only after that may an index row name the file.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from collections.abc import Iterable
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as futures_wait
from dataclasses import dataclass

from sparkcache.store.fileops import FileOps, StepHook
from sparkcache.store.layout import fanout, new_generation, object_name, open_subdir, temp_name
from sparkcache.store.objects import sync_and_close, write_temp

log = logging.getLogger(__name__)


@dataclass
class WrittenFile:
    """A file this process wrote for a commit, under its temp or (once renamed) final name."""

    key: str
    generation: str
    renamed: bool = False


class ObjectWriter:
    """Writes and removes the object files of one rank's ``objects/`` directory."""

    def __init__(self, ops: FileOps, hook: StepHook, objects_fd: int) -> None:
        self._ops = ops
        self._hook = hook
        self._objects_fd = objects_fd
        self._pool: ThreadPoolExecutor | None = None

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
            self._pool = None

    def write(
        self, keys: list[str], data: dict[str, list[memoryview]],
        written: dict[str, WrittenFile],
    ) -> None:
        """Write, fsync, rename and directory-fsync the pages of ``keys``.

        Every file is entered in ``written`` before it is created, so on any exception the
        caller can ``discard`` exactly what exists.
        """
        if not keys:
            return
        by_dir: dict[str, list[str]] = {}
        for key in keys:
            by_dir.setdefault(fanout(key), []).append(key)
        dir_fds: dict[str, int] = {}
        failed = threading.Event()
        pending: list[Future[None]] = []
        try:
            for fan in by_dir:
                dir_fds[fan] = open_subdir(fan, self._objects_fd, create=True)
            fresh = []
            for fan, group in by_dir.items():
                for key in group:
                    if failed.is_set():
                        break
                    w = WrittenFile(key, new_generation())
                    written[key] = w
                    fresh.append(w)
                    fd = write_temp(
                        self._ops, dir_fds[fan], key, w.generation, data[key], self._hook
                    )
                    pending.append(self._syncer().submit(self._sync_task, fd, failed))
            for future in pending:
                future.result()
            for w in fresh:
                fd = dir_fds[fanout(w.key)]
                self._ops.rename(
                    temp_name(w.key, w.generation), object_name(w.key, w.generation), fd, fd
                )
                w.renamed = True
                self._hook("commit.rename")
            for fd in dir_fds.values():
                self._ops.fsync(fd)
            self._hook("commit.dir_fsync")
        finally:
            # Every temp descriptor is closed by its task; wait so cleanup sees them closed.
            futures_wait(pending)
            for fd in dir_fds.values():
                os.close(fd)

    def _syncer(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="sparkcache-fsync")
        return self._pool

    def _sync_task(self, fd: int, failed: threading.Event) -> None:
        """fsync and close one temp file; after a failure only close (never fsync twice)."""
        if failed.is_set():
            self._ops.close(fd)
            return
        try:
            sync_and_close(self._ops, fd, self._hook)
        except BaseException:
            failed.set()
            raise

    def exists(self, w: WrittenFile) -> bool:
        """Whether ``w``'s final file is still in place as a regular file."""
        try:
            fd = open_subdir(fanout(w.key), self._objects_fd, create=False)
        except FileNotFoundError:
            return False
        try:
            st = os.stat(object_name(w.key, w.generation), dir_fd=fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        finally:
            os.close(fd)
        return stat.S_ISREG(st.st_mode)

    def discard(self, files: Iterable[WrittenFile]) -> None:
        """Unlink files that no index row references (their own generation only)."""
        for w in list(files):
            name = (object_name if w.renamed else temp_name)(w.key, w.generation)
            try:
                fd = open_subdir(fanout(w.key), self._objects_fd, create=False)
            except FileNotFoundError:
                continue
            try:
                self._ops.unlink(name, fd)
            except FileNotFoundError:
                pass
            except OSError as exc:
                # Left for reconcile(): an unreferenced file is an orphan, never data.
                log.warning("could not remove unreferenced %s: %s", name, exc)
            finally:
                os.close(fd)
