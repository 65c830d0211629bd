"""Whether this machine is a guest that hands its free memory back to its host.

A VM's kernel with free page reporting (virtio-balloon) reports free memory to the host,
which takes it back; the next use of it costs the host's faults, which the guest sees as
a slow kernel copy. A cold read allocates page cache, so the store and restore benches
meet it: their slow rounds here came with it (docs/vllm.md, "The slow rounds are the
host re-backing memory"). The benches say so beside their ratios, so that a reader can
tell a run on such a guest from one on a machine that keeps its memory.
"""

from __future__ import annotations

from pathlib import Path

# The guest kernel's count of what it reported since boot; not in every kernel.
REPORTED_KIB = Path("/sys/module/page_reporting/parameters/reported_kib")


def reports_free_memory() -> bool | None:
    """True if free memory was reported to the host since boot, False if the kernel
    reports none, None if it does not say."""
    if not REPORTED_KIB.parent.parent.exists():
        return False  # no page reporting in this kernel
    try:
        return int(REPORTED_KIB.read_text()) > 0
    except (OSError, ValueError):
        return None
