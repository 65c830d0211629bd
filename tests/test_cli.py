"""The CLI's configuration handling: flags generated from Config, errors as exit 2."""

from __future__ import annotations

import importlib.metadata
import inspect
import json

from typer.testing import CliRunner

from sparkcache import __version__, config
from sparkcache.cli import app


def test_config_flags_match_config_fields():
    out = CliRunner().invoke(app, ["config", "--help"], env={"COLUMNS": "200"}).output
    for name in config.FIELDS:
        assert config.flag_name(name) in out


def test_help_fits_80_columns():
    # typer prints a docstring's line breaks as they are: a long line wraps mid-sentence.
    out = CliRunner().invoke(app, ["--help"], env={"COLUMNS": "80"}).output
    rows = {" ".join(line.strip(" │").split()) for line in out.splitlines()}
    for command in app.registered_commands:
        summary, *detail = inspect.getdoc(command.callback).splitlines()
        assert f"{command.name} {summary}" in rows  # the summary on one row of the list
        assert all(len(line) <= 76 for line in detail), command.name


def test_version_is_the_installed_one():
    out = CliRunner().invoke(app, ["--version"]).output
    assert out == f"sparkcache {__version__}\n"
    assert importlib.metadata.version("sparkcache") == __version__  # pyproject reads it


def test_config_prints_effective_values(tmp_path):
    result = CliRunner().invoke(
        app,
        ["config", "--json", "--max-bytes", "2GiB", "--low-watermark-bytes", "1GiB"],
        env={"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_RANKS": "4"},
    )
    assert result.exit_code == 0
    values = json.loads(result.output)
    assert values["max_bytes"] == str(2 * config.GiB) and values["ranks"] == "4"


def test_bad_values_exit_2_with_one_line_each(tmp_path):
    result = CliRunner().invoke(
        app,
        ["config", "--access-mode", "sometimes"],
        env={"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_LEASE_SECONDS": "-5"},
    )
    assert result.exit_code == 2
    lines = [x for x in result.output.splitlines() if x.startswith("sparkcache: ")]
    assert len(lines) == 2
    assert "SPARKCACHE_ACCESS_MODE (--access-mode)='sometimes'" in lines[0]
    assert "SPARKCACHE_LEASE_SECONDS (--lease-seconds)='-5'" in lines[1]


def test_supervise_refuses_pids_that_cannot_be_processes(tmp_path):
    for avoid in ("-5", "0", "12,-1"):
        result = CliRunner().invoke(
            app, ["supervise", f"--avoid={avoid}"],
            env={"SPARKCACHE_STORE_DIR": str(tmp_path), "SPARKCACHE_INSTANCE": "tavoid"},
        )
        assert result.exit_code == 2, (avoid, result.output, result.exception)
        assert f"--avoid='{avoid}' is invalid: expected PID[,PID]" in result.output
