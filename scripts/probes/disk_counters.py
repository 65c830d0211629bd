"""Throwaway probe (packs-wip): the disk's counters (/proc/diskstats: writes, discards,
flushes per second) and the commit p99 during each of bench_maintenance's empty and full
scenarios, two rounds of 15 s. Run from the repository root with .venv/bin/python."""
import sys, time, json, argparse, tempfile, multiprocessing as mp, os
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import bench_maintenance as bm
def snap():
    for line in open("/proc/diskstats"):
        f = line.split()
        if f[2] == "vda":
            v = list(map(int, f[3:]))
            return {"writes": v[4], "wsect": v[6], "discards": v[11] if len(v) > 11 else 0,
                    "dsect": v[13] if len(v) > 13 else 0, "flushes": v[15] if len(v) > 15 else 0}
def main():
    args = argparse.Namespace(seconds=15.0, rate=16.0, pages=16, page_kib=256, conversations=16, turns=8, prompt_pages=8, max_mib=512, low_mib=384, lease_s=2.0, settings={})
    page = os.urandom(256*1024)
    ctx = mp.get_context("spawn")
    out = {}
    orig_write = bm.write
    def timed_write(*a, **k):
        s0 = snap(); t0 = time.monotonic()
        r = orig_write(*a, **k)
        s1 = snap(); dt = time.monotonic() - t0
        out.setdefault(bm._cur, []).append({k: round((s1[k]-s0[k])/dt, 1) for k in s0} | {"p99": round(sorted(r.commits)[int(0.99*len(r.commits))]*1000,1)})
        return r
    bm.write = timed_write
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        for rnd in range(2):
            for name in ("empty", "full"):
                bm._cur = name
                bm.scenario(Path(d), name, args, page, ctx)
    print(json.dumps(out))
if __name__ == "__main__":
    main()
