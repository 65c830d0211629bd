#!/usr/bin/env python3
"""The synthetic engine beside a running supervisor: publish sequences that share
prefixes, wait for capture and commit, restore every one into zeroed blocks and check
each page byte for byte. Settings come from SPARKCACHE_* like every command.

    SPARKCACHE_STORE_DIR=... .venv/bin/python scripts/demo_engine.py [--sequences 200]
"""

from __future__ import annotations

import argparse
import signal
import sys
import time

from sparkcache import config, exit_signal
from sparkcache.instance import NoSupervisor, running
from sparkcache.synthetic import MODEL_ID, SyntheticEngine, sequences


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=200)
    ap.add_argument("--model-id", default=MODEL_ID,
                    help="the model identity page keys are namespaced by")
    args = ap.parse_args()
    try:
        cfg = config.load()
    except config.ConfigError as e:
        print(f"demo: {e}", file=sys.stderr)
        return 2
    # Made before the handler goes in: this first use of numpy.random imports its Cython
    # modules, which can lose the handler's exit (sparkcache.exit_signal).
    seqs = sequences(args.sequences, cfg.page_tokens)
    # A SIGTERM (kill, timeout, a container stopping) unwinds through the finally below,
    # as Ctrl-C does: by default the process would die at once and leave its KV cache's
    # segment in /dev/shm until the next engine or supervisor of the rank.
    exit_signal.install(signal.SIGTERM)
    try:
        # Without one every publication is skipped, and retried for seconds each.
        running(cfg.store_dir)
        engine = SyntheticEngine.create(cfg, model_id=args.model_id)
    except (NoSupervisor, ValueError) as e:  # ValueError: a --model-id it refuses
        print(f"demo: {e}", file=sys.stderr)
        return 2
    try:
        t0 = time.monotonic()
        published = 0
        for sid, tokens in seqs.items():
            exit_signal.exit_if_signalled()
            published += engine.publish(sid, tokens)
        engine.drain()  # every publication's blocks back and its durability known
        durable = len(engine.acknowledged)
        print(f"demo: published {published}/{len(seqs)} sequences in "
              f"{time.monotonic() - t0:.1f}s, {durable} durable; slowest engine call "
              f"{engine.max_call_s * 1e3:.2f} ms; skipped {dict(engine.client.counters.skipped)}")
        pages = exact = 0
        for tokens in engine.accepted.values():
            exit_signal.exit_if_signalled()
            _, ok = engine.restore_exact(tokens)
            pages += len(engine.keys(tokens))
            exact += ok
        print(f"demo: restored {exact}/{pages} pages byte-exact")
        return 0 if exact == pages and published == durable == len(seqs) else 1
    finally:
        engine.close()


if __name__ == "__main__":
    sys.exit(main())
