"""Removing a finished lane's store while the next lane starts.

A store the soak aged holds tens of thousands of page files, and removing them takes
seconds of the filesystem's time (3-4 s here for 320 MiB). The next lane's start-up
(a supervisor importing and attaching its segments on the other cores, or the inline
model's threads) measures nothing, so the removal runs beside it; every lane waits for
it to end before its first probe, so no figure of a lane shares the disk or the engine's
core with it.
"""

from __future__ import annotations

import logging
import shutil
import threading
from pathlib import Path

log = logging.getLogger(__name__)


class StoreRemover:
    def __init__(self) -> None:
        self._thread: threading.Thread | None = None

    def remove(self, path: Path) -> None:
        """Start removing ``path`` (after any removal still running)."""
        self.wait()
        self._thread = threading.Thread(target=self._rmtree, args=(path,),
                                        name="soak-store-remover")
        self._thread.start()

    def wait(self) -> None:
        """Until every removal started has ended."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    @staticmethod
    def _rmtree(path: Path) -> None:
        try:
            shutil.rmtree(path)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("soak: could not remove %s: %s", path, exc)
