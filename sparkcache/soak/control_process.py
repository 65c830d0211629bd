"""The control engine's process (``sparkcache.soak.control``): a twin of the soak's
engine with no store, on the engine's core, running each probe it is asked for and
answering what it measured, a line each way over stdin and stdout."""

from __future__ import annotations

import json
import os
import signal
import sys

import torch

from sparkcache import exit_signal
from sparkcache.soak.backend import NullBackend
from sparkcache.soak.control import kv_blocks
from sparkcache.soak.engine import SoakEngine
from sparkcache.soak.model import ToyModel
from sparkcache.soak.params import SoakParams
from sparkcache.soak.workload import run_probe


def _serve(params: SoakParams) -> None:
    # A SIGTERM to the soak's process group (kill, timeout) ends this process through
    # the finally below, as Ctrl-C does: by default it would die at once and leave its
    # KV cache's segment in /dev/shm.
    exit_signal.install(signal.SIGTERM)
    torch.set_num_threads(1)
    os.sched_setaffinity(0, {params.engine_core})
    # Named after the soak's process, as its lanes' instances are (lanes.run_lane).
    engine = SoakEngine(f"soak{os.getppid()}ctl", params.page_tokens, kv_blocks(params),
                        ToyModel())
    engine.backend = NullBackend()
    try:
        run_probe(engine, params, engine.namespace, "warmup", 0)
        print("ready", flush=True)
        for line in sys.stdin:
            exit_signal.exit_if_signalled()
            phase, index = line.split()
            probe = run_probe(engine, params, engine.namespace, phase, int(index))
            print(json.dumps({"decode_cpu_s": probe.decode_cpu_s, "cpu_s": probe.cpu_s}),
                  flush=True)
    finally:
        engine.close()


def main(argv: list[str]) -> None:
    fields = json.loads(argv[0])  # SoakParams.describe() of the soak's parameters
    _serve(SoakParams(**{**fields, "lanes": tuple(fields["lanes"])}))


if __name__ == "__main__":
    main(sys.argv[1:])
