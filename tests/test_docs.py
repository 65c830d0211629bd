"""The README and docs/ say only what exists: every command, flag, setting, file and code
name they mention is there, and no endpoint is promised that nothing serves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from typer.main import get_command

from sparkcache import config
from sparkcache.cli import app

REPO = Path(__file__).resolve().parent.parent
DOCS = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
CODE_DIRS = ("sparkcache", "workers", "shm")
# Names the docs quote from outside the project (libc, glibc tunables).
FOREIGN = {"sem_timedwait", "x86_non_temporal_threshold",
           # symbols in perf profiles the docs quote (CPython's collector, the kernel's copy)
           "gc_collect_main", "_copy_to_iter"}
# vLLM's own names that docs/vllm.md explains the connector by.
VLLM_NAMES = {"finished_sending"}
# Names made at run time: prometheus_client adds "_total" to a counter's name, and the
# connector's skip reasons are "<what>_<reason>" (sparkcache/vllm/*_side.py totals()).
COMPOSED = {
    "sparkcache_lookups_total", "_hit_tokens_total", "_loaded_tokens_total",
    "_load_seconds_total", "_load_errors_total", "_saves_total", "_saved_pages_total",
    "sparkcache_skips_total", "rank_skips", "lookup_unavailable", "publish_supervisor_absent",
    "publish_store_full", "events_block_size",
}
FOREIGN |= VLLM_NAMES | COMPOSED


def _code() -> str:
    return "\n".join(p.read_text() for d in CODE_DIRS for p in sorted((REPO / d).rglob("*.py")))


def _command_claims(text: str) -> list[tuple[str, str]]:
    """(command, rest of the line) for each ``sparkcache <command> ...`` the text shows:
    lines of code blocks (comments dropped) and inline code spans."""
    claims = []
    for block in re.findall(r"```[^\n]*\n(.*?)```", text, re.S):
        for line in block.splitlines():
            m = re.match(r"\s*sparkcache ([a-z][\w-]*)(.*)", line.split("#")[0])
            if m:
                claims.append((m.group(1), m.group(2)))
    claims += re.findall(r"`sparkcache ([a-z][\w-]*)([^`]*)`", text)
    return claims


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_command_and_flag_named_exists(doc: Path) -> None:
    group = get_command(app)
    claims = _command_claims(doc.read_text())
    if doc.name == "README.md":
        assert {c for c, _ in claims} >= {"supervise", "status", "fsck", "config"}
    for cmd, rest in claims:
        assert cmd in group.commands, f"{doc.name}: `sparkcache {cmd}` is not a command"
        params = group.commands[cmd].params
        flags = {o for p in params for o in (*p.opts, *p.secondary_opts)} | {"--help"}
        for flag in re.findall(r"--[a-z][\w-]*", rest):
            assert flag in flags, f"{doc.name}: `sparkcache {cmd}` has no {flag}"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_variable_named_exists(doc: Path) -> None:
    """A SPARKCACHE_* variable is a setting (config field) or a hook the code reads
    (``"SPARKCACHE_KILL_AT"``); `` `_PORT` `` after `` `SPARKCACHE_METRICS_HOST` `` is
    SPARKCACHE_METRICS_PORT."""
    settings = {config.env_name(name) for name in config.FIELDS}
    code = _code()
    for line in doc.read_text().splitlines():
        names = re.findall(r"SPARKCACHE_[A-Z0-9_]*[A-Z0-9]", line)
        for short in re.findall(r"`(_[A-Z0-9_]+)`", line):
            names.append(names[-1].rsplit("_", 1)[0] + short)
        for name in names:
            assert name in settings or f'"{name}"' in code, f"{doc.name}: {name} does not exist"


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: p.name)
def test_every_file_and_code_name_named_exists(doc: Path) -> None:
    """Paths in code spans and links are files of the repository (or the end of one's
    path); snake_case names in code spans are names in the code (so a removed helper
    cannot stay documented)."""
    text = doc.read_text()
    scripts = [p for p in (REPO / "scripts").iterdir() if p.is_file()]
    words = set(re.findall(r"\w+", "\n".join(
        [_code(), (REPO / "pyproject.toml").read_text(), *(p.read_text() for p in scripts)]
    ))) | {p.stem for p in scripts}
    paths = re.findall(r"\]\(([\w./-]+)\)", text)
    for span in re.findall(r"`([^`\n]+)`", text):
        if re.fullmatch(r"[\w./-]+\.(?:py|md|toml|c)", span):
            paths.append(span)
            continue
        for name in re.findall(r"\b[a-z_][a-z0-9]*_[a-z0-9_]+\b", span):
            if name.startswith("sparkcache_"):
                # A metric: the collector composes "vllm:sparkcache_" + its short name.
                name = re.sub(r"_(total|bucket|count|sum)$", "", name[len("sparkcache_"):])
            assert name in words or name in FOREIGN, f"{doc.name}: `{name}` is not in the code"
    files = [f"/{p.relative_to(REPO)}" for d in (*CODE_DIRS, "scripts", "tests", "docs")
             for p in (REPO / d).rglob("*") if p.is_file()]
    for path in paths:
        # The docs stand alone: a path outside the repository is one a user lacks.
        assert not path.startswith(".."), f"{doc.name}: {path} lies outside the repository"
        # Docs shorten paths ("store/layout.py", "commit.py" after "workers/capture.py").
        found = (doc.parent / path).exists() or any(f.endswith(f"/{path}") for f in files)
        assert found, f"{doc.name}: {path} does not exist"


