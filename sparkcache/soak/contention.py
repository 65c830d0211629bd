"""How much of the engine's core other processes took: the noise floor of a probe.

On a shared machine (CI guests, or this project's 2-core one) other jobs run on the
engine's core too, and a probe's tok/s moves with them. The core's busy time from
/proc/stat less this process's own CPU time (every thread of it: the engine, and in the
inline lane the predecessor's threads) is what other processes took: SparkCache's
workers where they may run there (the unpinned lane), anyone else's work otherwise.
"""

from __future__ import annotations

import os
import time

_TICK_S = 1.0 / os.sysconf("SC_CLK_TCK")


def _core_busy_s(core: int) -> float | None:
    try:
        with open("/proc/stat") as f:
            for line in f:
                if line.startswith(f"cpu{core} "):
                    # user nice system idle iowait irq softirq steal ...
                    v = [int(x) for x in line.split()[1:]]
                    return (v[0] + v[1] + v[2] + v[5] + v[6] + v[7]) * _TICK_S
    except OSError:
        pass
    return None


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


class CoreMeter:
    """Share of ``core``'s time, between ``start`` and ``share``, that other processes
    used (None where /proc/stat is unreadable)."""

    def __init__(self, core: int) -> None:
        self.core = core
        self._busy = _core_busy_s(core)
        self._own = _own_cpu_s()
        self._at = time.monotonic()

    def share(self, besides_s: float = 0.0) -> float | None:
        """... less ``besides_s`` CPU seconds of a process known to share the core (the
        soak's control engine)."""
        busy = _core_busy_s(self.core)
        if busy is None or self._busy is None:
            return None
        elapsed = time.monotonic() - self._at
        if elapsed <= 0:
            return None
        other = (busy - self._busy) - (_own_cpu_s() - self._own) - besides_s
        return max(0.0, min(1.0, other / elapsed))
