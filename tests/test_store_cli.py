"""``status`` and ``fsck`` operator commands."""

from __future__ import annotations

import json
import re
import secrets
from pathlib import Path

import pytest
from typer.testing import CliRunner

from sparkcache.cli import app
from sparkcache.store import PageStore
from sparkcache.store.testing import make_root
from sparkcache.store_cli import fsck_command, status

SIZE = 1 << 20


@pytest.fixture
def store_dir(tmp_path: Path) -> Path:
    store_dir = tmp_path / "store"
    for rank in (0, 1):
        with PageStore(store_dir, rank) as store:
            for _ in range(3):
                keys = [secrets.token_hex(16) for _ in range(2)]
                store.commit(make_root(secrets.token_hex(16), keys, SIZE))
    return store_dir


def test_status_line(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status(store_dir, json_out=False) == 0
    line = capsys.readouterr().out.strip()
    assert line == "sparkcache: capacity ranks=2 entries=6 used=0.0/80.0GiB healthy=yes"
    assert re.fullmatch(
        r"sparkcache: capacity ranks=\d+ entries=\d+ used=\d+\.\d/\d+\.\dGiB healthy=(yes|no)",
        line,
    )


def test_status_json_and_over_capacity(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert status(store_dir, json_out=True, max_bytes=4 * SIZE) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["ranks"] == 2 and data["entries"] == 6 and data["healthy"] is False
    assert data["used_bytes"] == 12 * SIZE and data["capacity_bytes"] == 8 * SIZE


def test_status_of_a_missing_store_is_unhealthy(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert status(tmp_path / "nope", json_out=False) == 1
    assert capsys.readouterr().out.strip().endswith("healthy=no")


def test_fsck_clean_then_finds_and_repairs_damage(
    store_dir: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert fsck_command(store_dir, json_out=True, repair=False) == 0
    assert json.loads(capsys.readouterr().out) == {
        "ok": True,
        "roots": 6,
        "objects": 12,
        "quarantined": 0,
        "problems": [],
    }
    victim = sorted((store_dir / "rank-1" / "objects").rglob("*.*"))[0]
    data = bytearray(victim.read_bytes())
    data[-1] ^= 0x80
    victim.write_bytes(data)
    orphan = victim.with_name(victim.parent.name + "0" * 30 + "." + "0" * 16)
    orphan.write_bytes(b"old")
    assert fsck_command(store_dir, json_out=True, repair=False, grace_seconds=0) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["ok"] is False
    assert any("checksum mismatch" in p for p in report["problems"])
    assert any("orphan file" in p for p in report["problems"])
    assert fsck_command(store_dir, json_out=False, repair=True, grace_seconds=0) == 0
    assert "quarantined=1" in capsys.readouterr().out
    assert not orphan.exists()


def test_fsck_reports_refcount_drift(store_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with PageStore(store_dir, 0) as store, store._wconn as conn:
        conn.execute("UPDATE objects SET refcount = refcount + 1")
    assert fsck_command(store_dir, json_out=False, repair=False) == 1
    assert "refcount 2 != 1 references" in capsys.readouterr().out


def test_cli_commands(store_dir: Path) -> None:
    runner = CliRunner()
    result = runner.invoke(
        app, ["status", "--store-dir", str(store_dir), "--max-bytes", "1GiB",
              "--low-watermark-bytes", "512MiB"]
    )
    assert result.exit_code == 0 and "ranks=2 entries=6" in result.output
    assert "/2.0GiB" in result.output
    result = runner.invoke(app, ["status", "--store-dir", str(store_dir), "--max-bytes", "1GB"])
    assert result.exit_code == 2 and "SPARKCACHE_MAX_BYTES (--max-bytes)='1GB'" in result.output
    result = runner.invoke(app, ["fsck", "--store-dir", str(store_dir), "--json"])
    assert result.exit_code == 0 and json.loads(result.output)["ok"] is True
