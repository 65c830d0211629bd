"""A real ENOSPC: the store on a 3 MiB tmpfs, mounted in a private mount namespace
(``unshare -rm``) so nothing outside the test process tree ever sees it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import json, secrets, subprocess, sys
    from pathlib import Path
    from sparkcache.store import CommitFailed, PageStore
    from sparkcache.store.testing import make_root, page_bytes

    mnt = Path(sys.argv[1])
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m,mode=0700", "tmpfs", str(mnt)],
                   check=True)
    size = 256 * 1024
    store = PageStore(mnt / "store", 0, lease_seconds=0)
    roots, error = {}, None
    for _ in range(64):
        root_id, keys = secrets.token_hex(16), [secrets.token_hex(16) for _ in range(2)]
        try:
            store.commit(make_root(root_id, keys, size))
        except CommitFailed as exc:
            error = str(exc)
            break
        roots[root_id] = keys
    temps = [p.name for p in (mnt / "store").rglob("*.tmp")]
    files = sum(1 for p in (mnt / "store" / "rank-0" / "objects").rglob("*.*"))
    committed_at_full = len(roots)
    def intact():
        for keys in roots.values():
            bufs = [bytearray(size) for _ in keys]
            if store.restore(keys, bufs) != len(keys):
                return False
            if [bytes(b) for b in bufs] != [page_bytes(k, size) for k in keys]:
                return False
        return True
    intact_after_full = intact()
    # Free space: evict half the roots, collect, then commit again.
    victims = list(roots)[: len(roots) // 2]
    store.remove_roots(victims)
    store.collect(1000)
    for v in victims:
        del roots[v]
    again = secrets.token_hex(16)
    keys = [secrets.token_hex(16) for _ in range(2)]
    store.commit(make_root(again, keys, size))
    roots[again] = keys
    print(json.dumps({"error": error, "committed_at_full": committed_at_full, "temps": temps,
                      "files_at_full": files, "intact_after_full": intact_after_full,
                      "intact_after_freeing": intact()}))
    store.close()
    """
)


@pytest.mark.skipif(shutil.which("unshare") is None, reason="needs unshare(1)")
def test_disk_full_on_a_real_small_filesystem(tmp_path: Path) -> None:
    mnt = tmp_path / "mnt"
    mnt.mkdir(mode=0o700)
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, timeout=30)
    if probe.returncode != 0:
        pytest.skip(f"unshare -rm not allowed here: {probe.stderr.decode().strip()}")
    proc = subprocess.run(
        ["unshare", "-rm", sys.executable, str(script), str(mnt)],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/sbin:/usr/bin:/sbin:/bin"},
    )
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    error = result["error"]
    assert error is not None and ("No space left" in error or "full" in error), error
    assert result["committed_at_full"] > 0
    # Nothing of the failed commit is left: no temp files, only the committed roots' pages.
    assert result["temps"] == []
    assert result["files_at_full"] == result["committed_at_full"]  # a pack of two each
    assert result["intact_after_full"] and result["intact_after_freeing"]
