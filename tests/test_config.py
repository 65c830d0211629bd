"""Configuration: parsing, defaults, and one clear message per problem."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from sparkcache import config
from sparkcache.config import AccessMode, ConfigError, GiB, MiB, load


def _problems(env: dict[str, str], **overrides: str) -> list[str]:
    with pytest.raises(ConfigError) as e:
        load(env, overrides)
    return [str(p) for p in e.value.problems]


def test_defaults_and_sizes(tmp_path):
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path)})
    assert cfg.max_bytes == 40 * GiB and cfg.low_watermark_bytes == 32 * GiB
    assert cfg.access_mode is AccessMode.READ_WRITE and cfg.metrics_host == "127.0.0.1"
    cfg = load(
        {"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_MAX_BYTES": "1.5GiB",
         "SPARKCACHE_LOW_WATERMARK_BYTES": "512MiB", "SPARKCACHE_CPUS": "0"},
        {"capture_slot_bytes": "4096"},
    )
    assert (cfg.max_bytes, cfg.low_watermark_bytes, cfg.capture_slot_bytes) == (
        int(1.5 * GiB), 512 * MiB, 4096)
    assert cfg.cpus == (0,)


def test_heartbeat_timeout_default_and_override(tmp_path):
    assert load({"SPARKCACHE_STORE_DIR": str(tmp_path)}).heartbeat_timeout_s == 10.0
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_HEARTBEAT_TIMEOUT_S": "30"},
               {"heartbeat_timeout_s": "2.5"})
    assert cfg.heartbeat_timeout_s == 2.5


def test_maintenance_budget_defaults_and_overrides(tmp_path):
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path)})
    assert (cfg.maintenance_slice_roots, cfg.maintenance_slice_bytes,
            cfg.maintenance_slice_ms, cfg.maintenance_duty,
            cfg.maintenance_io_bytes_per_s) == (16, 64 * MiB, 20.0, 0.2, GiB)
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_MAINTENANCE_DUTY": "0.5"},
               {"maintenance_slice_ms": "400", "maintenance_slice_bytes": "1GiB"})
    assert (cfg.maintenance_duty, cfg.maintenance_slice_ms,
            cfg.maintenance_slice_bytes) == (0.5, 400.0, GiB)


def test_flags_override_environment(tmp_path):
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_ACCESS_MODE": "off"},
               {"access_mode": "restore-only"})
    assert cfg.access_mode is AccessMode.RESTORE_ONLY


def test_every_field_has_help_env_and_flag():
    for name, f in config.FIELDS.items():
        assert f.metadata.get("help"), name
        assert config.env_name(name) == "SPARKCACHE_" + name.upper()
        assert config.flag_name(name) == "--" + name.replace("_", "-")


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({"SPARKCACHE_LOW_WATERMARK_BYTES": "40GiB"},
         "SPARKCACHE_LOW_WATERMARK_BYTES (--low-watermark-bytes)='40GiB' is invalid: "
         "expected a size below max bytes (42949672960)"),
        ({"SPARKCACHE_MAX_BYTES": "40GB"},
         "SPARKCACHE_MAX_BYTES (--max-bytes)='40GB' is invalid: expected a size: plain bytes "
         "or a number with KiB, MiB, GiB or TiB"),
        ({"SPARKCACHE_READ_AHEAD_BYTES": "-1"},
         "SPARKCACHE_READ_AHEAD_BYTES (--read-ahead-bytes)='-1' is invalid: expected a size: "
         "plain bytes or a number with KiB, MiB, GiB or TiB"),
        ({"SPARKCACHE_CAPTURE_SLOT_BYTES": "8"},
         "SPARKCACHE_CAPTURE_SLOT_BYTES (--capture-slot-bytes)='8' is invalid: expected at "
         "least one page (>= 16 bytes)"),
        ({"SPARKCACHE_ACCESS_MODE": "write-only"},
         "SPARKCACHE_ACCESS_MODE (--access-mode)='write-only' is invalid: expected one of "
         "read-write, restore-only, off"),
        ({"SPARKCACHE_LEASE_SECONDS": "-1"},
         "SPARKCACHE_LEASE_SECONDS (--lease-seconds)='-1' is invalid: expected zero or more "
         "seconds"),
        ({"SPARKCACHE_HEARTBEAT_TIMEOUT_S": "0.5"},
         "SPARKCACHE_HEARTBEAT_TIMEOUT_S (--heartbeat-timeout-s)='0.5' is invalid: expected "
         "a number of seconds >= 1"),
        ({"SPARKCACHE_HEARTBEAT_TIMEOUT_S": "nan"},
         "SPARKCACHE_HEARTBEAT_TIMEOUT_S (--heartbeat-timeout-s)='nan' is invalid: expected "
         "a number of seconds >= 1"),
        ({"SPARKCACHE_HEARTBEAT_TIMEOUT_S": "soon"},
         "SPARKCACHE_HEARTBEAT_TIMEOUT_S (--heartbeat-timeout-s)='soon' is invalid: expected "
         "a number of seconds"),
        ({"SPARKCACHE_CPUS": "0,9999"},
         f"SPARKCACHE_CPUS (--cpus)='0,9999' is invalid: expected cores that exist on this "
         f"machine: 0-{psutil.cpu_count() - 1} (no core [9999])"),
        ({"SPARKCACHE_CPUS": "3-1"},
         "SPARKCACHE_CPUS (--cpus)='3-1' is invalid: expected a CPU list such as 0-3,6 "
         "(ranges ascending)"),
        ({"SPARKCACHE_RANKS": "two"},
         "SPARKCACHE_RANKS (--ranks)='two' is invalid: expected a whole number"),
        ({"SPARKCACHE_MAINTENANCE_SLICE_ROOTS": "0"},
         "SPARKCACHE_MAINTENANCE_SLICE_ROOTS (--maintenance-slice-roots)='0' is invalid: "
         "expected at least 1"),
        ({"SPARKCACHE_MAINTENANCE_SLICE_BYTES": "0"},
         "SPARKCACHE_MAINTENANCE_SLICE_BYTES (--maintenance-slice-bytes)='0' is invalid: "
         "expected a positive size"),
        ({"SPARKCACHE_MAINTENANCE_IO_BYTES_PER_S": "1GB"},
         "SPARKCACHE_MAINTENANCE_IO_BYTES_PER_S (--maintenance-io-bytes-per-s)='1GB' is "
         "invalid: expected a size: plain bytes or a number with KiB, MiB, GiB or TiB"),
        ({"SPARKCACHE_MAINTENANCE_SLICE_MS": "500"},
         "SPARKCACHE_MAINTENANCE_SLICE_MS (--maintenance-slice-ms)='500' is invalid: expected "
         "more than 0 and at most 200 milliseconds (the maintenance duty, 0.2, of a second)"),
        ({"SPARKCACHE_MAINTENANCE_SLICE_MS": "0"},
         "SPARKCACHE_MAINTENANCE_SLICE_MS (--maintenance-slice-ms)='0' is invalid: expected "
         "more than 0 and at most 200 milliseconds (the maintenance duty, 0.2, of a second)"),
        ({"SPARKCACHE_MAINTENANCE_SLICE_MS": "soon"},
         "SPARKCACHE_MAINTENANCE_SLICE_MS (--maintenance-slice-ms)='soon' is invalid: "
         "expected a number of milliseconds"),
        ({"SPARKCACHE_MAINTENANCE_DUTY": "1.5"},
         "SPARKCACHE_MAINTENANCE_DUTY (--maintenance-duty)='1.5' is invalid: expected a share "
         "of a second above 0 and at most 1, such as 0.2"),
        ({"SPARKCACHE_MAINTENANCE_DUTY": "nan"},
         "SPARKCACHE_MAINTENANCE_DUTY (--maintenance-duty)='nan' is invalid: expected a share "
         "of a second above 0 and at most 1, such as 0.2"),
        ({"SPARKCACHE_MAINTENANCE_DUTY_MAX": "0"},
         "SPARKCACHE_MAINTENANCE_DUTY_MAX (--maintenance-duty-max)='0' is invalid: expected "
         "a share of a second above 0 and at most 1, such as 0.5"),
        ({"SPARKCACHE_INSTANCE": "a b"},
         "SPARKCACHE_INSTANCE (--instance)='a b' is invalid: expected 1-32 characters from "
         "A-Z a-z 0-9 _ -"),
    ],
)
def test_each_bad_value_names_variable_value_and_what_is_allowed(tmp_path, env, expected):
    assert _problems({"SPARKCACHE_STORE_DIR": str(tmp_path), **env}) == [expected]


def test_store_dir_that_is_a_file(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    assert _problems({"SPARKCACHE_STORE_DIR": str(f)}) == [
        f"SPARKCACHE_STORE_DIR (--store-dir)='{f}' is invalid: expected a directory "
        "(this path is not one)"
    ]


def test_store_dir_that_is_not_writable():
    # /proc/self refuses new files even to root, which passes every permission check.
    msgs = _problems({"SPARKCACHE_STORE_DIR": "/proc/self"})
    assert msgs == [
        "SPARKCACHE_STORE_DIR (--store-dir)='/proc/self' is invalid: expected a writable "
        "directory: writing there fails with ENOENT"
    ]


def test_missing_store_dir_under_writable_parent_is_fine(tmp_path):
    assert load({"SPARKCACHE_STORE_DIR": str(tmp_path / "new" / "deeper")}).store_dir == Path(
        tmp_path / "new" / "deeper")


def test_all_problems_reported_at_once(tmp_path):
    msgs = _problems({"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_RANKS": "0",
                      "SPARKCACHE_CAPTURE_SLOTS": "0"})
    assert len(msgs) == 2 and "SPARKCACHE_RANKS" in msgs[0] and "CAPTURE_SLOTS" in msgs[1]


def test_page_that_does_not_fit_a_slot(tmp_path):
    cfg = load({"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_CAPTURE_SLOT_BYTES": "1MiB"})
    cfg.check_page_fits(MiB)
    with pytest.raises(ConfigError, match=r"CAPTURE_SLOT_BYTES.*at least one page: 2097152"):
        cfg.check_page_fits(2 * MiB)
