"""The issue 21 levers side by side: gpufeed before (another checkout's src, e.g. ``git archive 21dd14d src``) and
after, with thread workers, same shards, same output (uint8 [B, 3, S, S], RandomResizedCrop + flip). Each variant runs
in its own subprocess; rounds are interleaved (order rotated); samples/s and samples per CPU-second of the process
tree (the variant's process and its workers) per window. Writes JSON under benchmarks/results/. Never asserts.

    python benchmarks/bench_loader_levers.py --shards SHARDS --before /tmp/gpufeed-before/src
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, sys, time, psutil
sys.path.insert(0, sys.argv[1])
from gpufeed.config import LoaderConfig
from gpufeed.core.world import World
from gpufeed.loader import build_loader
kw = json.loads(sys.argv[3])
lc = LoaderConfig(batch_size=128, image_size=224, decode="simplejpeg", prefetch_factor=2, persistent_workers=True,
                  pin_memory=False, **kw)
loader = build_loader(sys.argv[2], lc, World.single(), train=True)
window = float(sys.argv[4])
me = psutil.Process()
def cpu():
    procs = [me, *me.children(recursive=True)]
    return sum(sum(p.cpu_times()[:2]) for p in procs if p.is_running())
it = iter(loader); epoch = 0
def nxt():
    global it, epoch
    try:
        return next(it)
    except StopIteration:
        epoch += 1; loader.set_epoch(epoch); it = iter(loader); return next(it)
for _ in range(3): nxt()  # warm-up: workers started, backlog drained below
n = 0; c0 = cpu(); t0 = time.perf_counter()
while time.perf_counter() - t0 < window:
    images, labels = nxt(); n += images.shape[0]
t = time.perf_counter() - t0; c = cpu() - c0
print(json.dumps({"samples_per_s": n / t, "samples_per_cpu_s": n / c, "cores": c / t}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", required=True)
    ap.add_argument("--before", required=True, help="src folder of the 'before' checkout")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=6.0)
    a = ap.parse_args()
    after = str(ROOT / "src")
    variants = {
        "before: 2 workers": (a.before, {"num_workers": 2}),
        "after: 2 workers, 1 thread": (after, {"num_workers": 2}),
        "after: 1 worker, 2 threads": (after, {"num_workers": 1, "decode_threads": 2}),
        "after: 0 workers, 2 threads": (after, {"num_workers": 0, "decode_threads": 2}),
    }
    names = list(variants)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    for r in range(a.rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            src, kw = variants[name]
            out = subprocess.run([sys.executable, "-c", CHILD, src, a.shards, json.dumps(kw), str(a.window)],
                                 capture_output=True, text=True, check=True)
            runs[name].append(json.loads(out.stdout.strip().splitlines()[-1]))
            print(f"round {r + 1} {name}: {runs[name][-1]}", file=sys.stderr, flush=True)
    ref = statistics.median(x["samples_per_s"] for x in runs[names[0]])
    print("| variant | samples/s median (min-max) | x before | samples per CPU-s median | cores |")
    print("|---|---|---|---|---|")
    for name in names:
        rates = [x["samples_per_s"] for x in runs[name]]
        per = [x["samples_per_cpu_s"] for x in runs[name]]
        print(f"| {name} | {statistics.median(rates):.0f} ({min(rates):.0f}-{max(rates):.0f}) | "
              f"{statistics.median(rates) / ref:.2f} | {statistics.median(per):.0f} | "
              f"{statistics.median(x['cores'] for x in runs[name]):.2f} |")
    dest = ROOT / "benchmarks" / "results" / f"bench_loader_levers-{dt.datetime.now():%Y%m%d-%H%M%S}.json"
    dest.parent.mkdir(parents=True, exist_ok=True)
    dest.write_text(json.dumps({"args": vars(a), "variants": {n: variants[n][1] for n in names}, "runs": runs}, indent=1))
    print(f"wrote {dest}", file=sys.stderr)


if __name__ == "__main__":
    main()
