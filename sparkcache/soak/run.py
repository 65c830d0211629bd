"""Every lane of a soak, one after another, in this process: the engine is this process,
pinned to its core for the whole run."""

from __future__ import annotations

import logging
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path

import torch

from sparkcache import config, exit_signal, segments
from sparkcache.config import MiB
from sparkcache.soak import control as control_mod
from sparkcache.soak import engine as engine_mod
from sparkcache.soak.control import ControlEngine
from sparkcache.soak.lanes import LaneResult, kv_blocks, run_lane, slot_bytes
from sparkcache.soak.model import ToyModel
from sparkcache.soak.params import LANES, SoakParamError, SoakParams
from sparkcache.soak.remover import StoreRemover
from sparkcache.soak.service import settings

log = logging.getLogger(__name__)

Progress = Callable[[str, str, float], None]  # (lane, what it is doing, share done)


def run(params: SoakParams, progress: Progress, work_dir: Path | None = None
        ) -> dict[str, LaneResult]:
    """Run every lane of ``params``; their results by lane name. Raises SoakParamError
    for bad parameters before anything starts (``check``)."""
    check(params, work_dir)
    all_cores = sorted(os.sched_getaffinity(0))
    old_threads = torch.get_num_threads()
    # A one-core engine: vLLM's worker drives its device from one thread.
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {params.engine_core})
    root = Path(tempfile.mkdtemp(prefix="sparkcache-soak-", dir=work_dir))
    results: dict[str, LaneResult] = {}
    failed = False
    control: ControlEngine | None = None
    remover = StoreRemover()
    main = threading.current_thread() is threading.main_thread()
    old_handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        # A SIGTERM (kill, timeout, a CI job cancelled) ends the soak as Ctrl-C does,
        # through the finally blocks that stop its supervisors and engines and remove its
        # stores: Python's default ends the process at once and leaves them all behind.
        # Ctrl-C goes through the same handler so that one lost in C code is not
        # forgotten (exit_signal).
        if main:
            exit_signal.install(signal.SIGTERM, signal.SIGINT)
        model = ToyModel()
        control = ControlEngine(params, root / "control.log")
        for name in params.lanes:
            exit_signal.exit_if_signalled()
            log.info("soak: lane %s", name)
            results[name] = run_lane(name, params, model, root, all_cores,
                                     lambda what, share, n=name: progress(n, what, share),
                                     remover, control)
            progress(name, "done", 1.0)
    except Exception:
        failed = True  # not on Ctrl-C or SIGTERM: nothing to read in the logs then
        raise
    finally:
        remover.wait()
        if control is not None:
            control.close()
        os.sched_setaffinity(0, all_cores)
        torch.set_num_threads(old_threads)
        _clean(root, keep_logs=failed)
        if main:
            for sig, handler in old_handlers.items():
                signal.signal(sig, handler if handler is not None else signal.SIG_DFL)
    return results


def check(params: SoakParams, work_dir: Path | None = None) -> None:
    """Raise SoakParamError, naming the flag and what is allowed, for anything that
    would stop the soak once it has started: ``params`` (``SoakParams.check``),
    ``work_dir``, settings the lanes' supervisors refuse, a /dev/shm too small."""
    params.check()
    if work_dir is not None and not work_dir.is_dir():
        raise SoakParamError(f"--work-dir={str(work_dir)!r}: expected an existing directory")
    base = Path(tempfile.gettempdir()) if work_dir is None else work_dir
    supervised = 0  # /dev/shm a lane's supervisor takes, at most
    for name in params.lanes:
        lane = LANES[name]
        if lane.placement not in ("isolated", "unpinned"):
            continue
        cpus = params.worker_cores if lane.placement == "isolated" else None
        env = settings(params, base / "sparkcache-soak-check", f"soak{os.getpid()}",
                       lane.access_mode, cpus, slot_bytes(params))
        try:
            cfg = config.load(env=env)
        except config.ConfigError as e:
            p = e.problems[0]
            given = _FLAGS.get(p.field_name, "--" + p.field_name.replace("_", "-"))
            raise SoakParamError(f"{given}: the lanes' supervisors refuse "
                                 f"{config.env_name(p.field_name)}={p.value}: expected "
                                 f"{p.allowed}") from None
        supervised = max(supervised, sum(segments.shm_needed(cfg).values()))
    _check_shm(params, supervised)


# Supervisor settings a soak derives from a flag of another name.
_FLAGS = {"store_dir": "--work-dir", "capture_slot_bytes": "--context-max"}


def _check_shm(params: SoakParams, supervised: int, shm_dir: Path = segments.SHM_DIR
               ) -> None:
    """/dev/shm must hold a lane's engine KV cache, the control engine's and the lane's
    supervisor's segments at once: tmpfs allocates on first touch, so a smaller one (a
    container's default is 64 MiB) is found out by a SIGBUS that kills the soak and
    leaves its segment there."""
    st = os.statvfs(shm_dir)
    if st.f_blocks == 0:
        return  # a tmpfs mounted without a size limit reports no blocks at all
    free = st.f_bavail * st.f_frsize
    page = engine_mod.page_bytes(params.page_tokens)
    kv = (kv_blocks(params) + control_mod.kv_blocks(params)) * page
    if kv + supervised <= free:
        return
    raise SoakParamError(
        f"{shm_dir} has {free / MiB:.1f}MiB free; the soak needs {(kv + supervised) / MiB:.1f}"
        f"MiB there: {kv / MiB:.1f}MiB of KV cache ({kv_blocks(params)} blocks for "
        f"--conversations {params.conversations} of up to --context-max "
        f"{params.context_max} tokens) and {supervised / MiB:.1f}MiB of a supervisor's "
        "segments (two capture slots of a whole conversation); lower --conversations or "
        f"--context-max, or give {shm_dir} more room (docker run --shm-size)")


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
