"""Every lane of a soak, one after another, in this process: the engine is this process,
pinned to its core for the whole run."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path

import torch

from sparkcache.soak.control import ControlEngine
from sparkcache.soak.lanes import LaneResult, run_lane
from sparkcache.soak.model import ToyModel
from sparkcache.soak.params import SoakParams
from sparkcache.soak.remover import StoreRemover

log = logging.getLogger(__name__)

Progress = Callable[[str, str, float], None]  # (lane, what it is doing, share done)


def run(params: SoakParams, progress: Progress, work_dir: Path | None = None
        ) -> dict[str, LaneResult]:
    """Run every lane of ``params``; their results by lane name. Raises SoakParamError
    for bad parameters before anything starts."""
    params.check()
    all_cores = sorted(os.sched_getaffinity(0))
    old_threads = torch.get_num_threads()
    # A one-core engine: vLLM's worker drives its device from one thread.
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {params.engine_core})
    root = Path(tempfile.mkdtemp(prefix="sparkcache-soak-", dir=work_dir))
    results: dict[str, LaneResult] = {}
    finished = False
    control: ControlEngine | None = None
    remover = StoreRemover()
    try:
        model = ToyModel()
        control = ControlEngine(params, root / "control.log")
        for name in params.lanes:
            log.info("soak: lane %s", name)
            results[name] = run_lane(name, params, model, root, all_cores,
                                     lambda what, share, n=name: progress(n, what, share),
                                     remover, control)
            progress(name, "done", 1.0)
        finished = True
    finally:
        remover.wait()
        if control is not None:
            control.close()
        os.sched_setaffinity(0, all_cores)
        torch.set_num_threads(old_threads)
        _clean(root, keep_logs=not finished)
    return results


def _clean(root: Path, keep_logs: bool) -> None:
    """Remove the soak's stores; after a failure keep its supervisors' logs (the error
    names them), which are small, and say where."""
    if not keep_logs:
        shutil.rmtree(root, ignore_errors=True)
        return
    for entry in root.iterdir():
        if entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
        elif entry.suffix != ".log":
            entry.unlink()
    log.error("soak: the supervisors' logs are kept in %s", root)
