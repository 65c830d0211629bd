"""Whether an engine's settings name the supervisor they are meant to: its instance (the
names of the segments it attaches to) and its store dir (where the engine registers its
KV caches and looks pages up) must belong to one running supervisor. Named apart, the
engine published to one supervisor's workers while registering in another store: every
save was rejected as unregistered, silently (docs/vllm.md, "Attached, or why not")."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from sparkcache import runtime, segments
from sparkcache.config import Config
from sparkcache.shm import SegmentError

# Reasons an engine does not attach, as its counters name them.
STORE_MISMATCH = "store_mismatch"
INSTANCE_MISMATCH = "instance_mismatch"
SUPERVISOR_ABSENT = "supervisor_absent"
MISMATCHES = (STORE_MISMATCH, INSTANCE_MISMATCH)


@dataclass(frozen=True)
class Attachment:
    """What an engine rank finds of the supervisor its settings name."""

    # None: a supervisor of the instance serves the store dir; else why not (above)
    reason: str | None
    message: str  # one line for the log, naming what was found and the remedy


def _resolved(path: Path | str) -> str:
    return str(Path(path).resolve())


def find(cfg: Config, rank: int) -> Attachment:
    """The supervisor of ``cfg.instance`` rank ``rank``, judged against ``cfg.store_dir``:
    its segments' note says which store it serves; without one, the store's
    ``runtime.json`` says which instance serves it, if any."""
    mine = _resolved(cfg.store_dir)
    try:
        note = segments.read_store_note(cfg.instance, rank)
    except SegmentError as exc:  # an entry of that name another user owns
        return Attachment(SUPERVISOR_ABSENT, f"instance {cfg.instance!r}: {exc}")
    if note is not None:
        pid = note.get("supervisor_pid")
        theirs = note.get("store_dir")
        if theirs == mine:
            return Attachment(None, f"the supervisor (pid {pid}) of instance "
                              f"{cfg.instance!r}, store {mine}")
        return Attachment(
            STORE_MISMATCH,
            f"instance {cfg.instance!r} is served by the supervisor (pid {pid}) of store "
            f"{theirs}, but this engine's store_dir is {mine}: nothing is saved or loaded "
            f"until both name one store (give the connector store_dir {theirs!r}, or the "
            f"instance of the supervisor of {mine})")
    rt, live = runtime.read_live(cfg.store_dir)
    if live and rt is not None and rt.get("instance") != cfg.instance:
        return Attachment(
            INSTANCE_MISMATCH,
            f"store {mine} is served by the supervisor (pid {rt.get('pid')}) of instance "
            f"{rt.get('instance')!r}, but this engine's instance is {cfg.instance!r}: "
            f"nothing is saved or loaded until both name one instance (give the connector "
            f"instance {rt.get('instance')!r})")
    if live and rt is not None:
        # A supervisor of a version that writes no note: its runtime file vouches.
        return Attachment(None, f"the supervisor (pid {rt.get('pid')}) of instance "
                          f"{cfg.instance!r}, store {mine}")
    return Attachment(
        SUPERVISOR_ABSENT,
        f"no supervisor of instance {cfg.instance!r} runs for store {mine}: saves and "
        f"loads are skipped until one starts (sparkcache supervise --store-dir {mine} "
        f"--instance {cfg.instance})")
