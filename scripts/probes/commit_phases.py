"""Throwaway probe (packs-wip): times each step of every commit in bench_maintenance's
empty and full scenarios (PageStore's step hook) and prints the median, p99 and the
slowest 1 % per step. Run from the repository root with .venv/bin/python."""
import sys, time, json, statistics, argparse, tempfile, multiprocessing as mp
from pathlib import Path
ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "scripts"))
import bench_maintenance as bm
from sparkcache.store import PageStore
phases = {}
class Timed(PageStore):
    def __init__(self, *a, **k):
        self._marks = []
        super().__init__(*a, hook=self._mark, **k)
    def _mark(self, step):
        self._marks.append((step, time.perf_counter()))
    def commit(self, root):
        self._marks = [("start", time.perf_counter())]
        rb0 = int(open("/proc/self/io").read().split("read_bytes: ")[1].split()[0])
        r = super().commit(root)
        rb1 = int(open("/proc/self/io").read().split("read_bytes: ")[1].split()[0])
        self._marks.append(("end", time.perf_counter()))
        m = self._marks; d = {}
        t = dict()
        for s, ts in m: t.setdefault(s, ts); t[s + "_last"] = ts
        if "commit.written" in t:
            d["open+first"] = t["commit.written"] - t["start"]
            d["write"] = t["commit.written_last"] - t["commit.written"]
            d["rename"] = t["commit.rename"] - t["commit.written_last"]
            d["sync"] = t["commit.durable"] - t["commit.rename"]
            d["txn"] = t["commit.index_txn"] - t["commit.durable"]
        else:
            d["txn"] = t.get("commit.index_txn", t["end"]) - t["start"]
        d["post"] = t["end"] - t.get("commit.index_txn", t["end"])
        d["total"] = t["end"] - t["start"]
        d["read_kib"] = (rb1 - rb0) / 1024000  # shown x1000 below: KiB
        phases.setdefault(self._name, []).append(d)
        return r
bm.PageStore = Timed
def main():
    p = argparse.ArgumentParser(); 
    args = argparse.Namespace(seconds=15.0, rate=16.0, pages=16, page_kib=256, conversations=16, turns=8, prompt_pages=8, max_mib=512, low_mib=384, lease_s=2.0, settings={})
    page = bytes(256*1024)
    import os; page = os.urandom(256*1024)
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory(dir=ROOT) as d:
        for rnd in range(2):
            for name in ("empty", "full"):
                Timed._name = name
                bm.scenario(Path(d), name, args, page, ctx)
    out = {}
    for name, rows in phases.items():
        keys = sorted({k for r in rows for k in r})
        out[name] = {k: (round(statistics.median([r[k] for r in rows if k in r])*1000, 2), round(sorted([r[k] for r in rows if k in r])[int(0.99*len([r for r in rows if k in r]))-1]*1000, 2)) for k in keys}
        # phases of the slowest 1%
        slow = sorted(rows, key=lambda r: r["total"])[-max(1, len(rows)//100):]
        out[name + "_slowest"] = {k: round(statistics.mean([r.get(k, 0) for r in slow])*1000, 2) for k in keys}
    print(json.dumps(out, indent=0))

if __name__ == "__main__":
    main()
