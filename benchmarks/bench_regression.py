"""Before/after: does a change slow `gpufeed shard` or the loader? Two source trees, one interleaved run.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_regression.py \\
        --before c4d2dfa --after HEAD --data bench-data/synth-3000 --rounds 5

``--before``/``--after`` are git revisions of this repository (checked out into temporary worktrees) or
folders holding a gpufeed checkout. Every measurement is a subprocess that imports gpufeed from one tree
(``PYTHONPATH=<tree>/src``) with this venv's packages, so the two differ only in gpufeed's own code.

Variants, run A B A B ... in each round:

* ``shard_full``   ``gpufeed shard SRC DEST --json`` (full validation, 2 workers), wall seconds
* ``shard_header`` ``gpufeed shard SRC DEST --check header --json``, wall seconds
* ``loader_eval``  samples/s of ``build_loader`` over one shard set (written once, by the *after* tree: the
                   format did not change), 2 workers, simplejpeg, batch 64, 224 px, eval crops (resize +
                   centre crop: the same decode work in both trees); the first 3 batches are warm-up, then 30
                   batches are timed (1,920 samples)
* ``loader_train`` the same with training crops, seed = the round number (the same seed for both trees in a
                   round). Random crops set the decode scale, so one seed's 1,920 crops can cost ±10% more than
                   another's; and a change of the crop RNG draws other crops from the same seed: compare the
                   median over rounds, not one round

Reports the median per variant and tree, and after/before ratios (wall: < 1 is faster; samples/s: > 1 is
faster). The machine is shared and noisy: trust ratios within ~10% as "no change". Saves JSON.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

LOADER_SNIPPET = r"""
import json, sys, time
from gpufeed.config import LoaderConfig
from gpufeed.loader import build_loader
try:
    from gpufeed.core.world import World
except ImportError:  # a tree from before the packages (issue 18)
    from gpufeed.world import World
cfg = LoaderConfig(batch_size=64, num_workers=2, image_size=224, decode="simplejpeg", pin_memory=False,
                   seed=int(sys.argv[3]))
loader = build_loader(sys.argv[1], cfg, World.single(), train=sys.argv[2] == "train")
it = iter(loader)
for _ in range(3):
    next(it)
t0 = time.perf_counter()
n = 0
for _ in range(30):
    images, labels = next(it)
    n += int(labels.shape[0])
dt = time.perf_counter() - t0
print(json.dumps({"samples_per_s": n / dt, "seconds": dt}))
"""


def tree(rev: str, tmp: Path, name: str) -> Path:
    """A folder holding gpufeed's sources at ``rev`` (a git revision, or an existing checkout folder)."""
    if Path(rev).is_dir():
        return Path(rev).resolve()
    dest = tmp / name
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(dest), rev], check=True,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return dest


def run(src_tree: Path, cmd: list[str]) -> tuple[float, str]:
    env = dict(os.environ, PYTHONPATH=str(src_tree / "src"))
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {proc.stderr.strip()[-400:]}")
    return wall, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "synth-3000", help="an ImageFolder")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--work", type=Path, default=Path("/dev/shm/gpufeed-bench-regression"))
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = ap.parse_args()
    py = sys.executable
    tmp = Path(tempfile.mkdtemp(prefix="gpufeed-trees-"))
    trees = {"before": tree(args.before, tmp, "before"), "after": tree(args.after, tmp, "after")}
    revs = {k: subprocess.run(["git", "-C", str(v), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True).stdout.strip() or str(v) for k, v in trees.items()}
    args.work.mkdir(parents=True, exist_ok=True)
    shards = args.work / "loader-shards"
    if shards.exists():
        shutil.rmtree(shards)
    run(trees["after"], [py, "-m", "gpufeed.cli", "shard", str(args.data), str(shards), "--shard-samples", "500",
                         "--multiple-of", "2", "--json"])
    subprocess.run(["cat", *map(str, sorted(args.data.rglob("*.jpg")))], stdout=subprocess.DEVNULL)  # page cache
    results: dict[str, dict[str, list[float]]] = {v: {"before": [], "after": []}
                                                  for v in ("shard_full", "shard_header", "loader_eval", "loader_train")}
    for r in range(args.rounds):
        for which in ("before", "after") if r % 2 == 0 else ("after", "before"):
            t = trees[which]
            for variant, extra in (("shard_full", []), ("shard_header", ["--check", "header"])):
                dest = args.work / f"out-{which}"
                shutil.rmtree(dest, ignore_errors=True)
                wall, _ = run(t, [py, "-m", "gpufeed.cli", "shard", str(args.data), str(dest), "--workers", "2",
                                  *extra, "--json"])
                shutil.rmtree(dest, ignore_errors=True)
                results[variant][which].append(wall)
            for mode in ("eval", "train"):
                _, out = run(t, [py, "-c", LOADER_SNIPPET, str(shards), mode, str(r)])
                results[f"loader_{mode}"][which].append(json.loads(out.strip().splitlines()[-1])["samples_per_s"])
            print(f"round {r + 1} {which}: " + ", ".join(f"{v} {results[v][which][-1]:.2f}" for v in results),
                  flush=True)
    summary = {}
    for v, per in results.items():
        b, a = statistics.median(per["before"]), statistics.median(per["after"])
        summary[v] = {"before_median": b, "after_median": a, "after_over_before": a / b,
                      "before": per["before"], "after": per["after"]}
    print(f"\nbefore = {revs['before']}, after = {revs['after']}, data = {args.data}, {args.rounds} interleaved rounds")
    print(f"{'variant':14} {'before':>10} {'after':>10} {'after/before':>13}")
    for v, s in summary.items():
        unit = "samples/s" if v.startswith("loader") else "s"
        print(f"{v:14} {s['before_median']:10.2f} {s['after_median']:10.2f} {s['after_over_before']:13.3f}  ({unit}, median)")
    args.out.mkdir(parents=True, exist_ok=True)
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    path = args.out / f"bench_regression-{stamp}.json"
    path.write_text(json.dumps({"before": revs["before"], "after": revs["after"], "data": str(args.data),
                                "rounds": args.rounds, "results": summary}, indent=2) + "\n")
    print(f"saved {path}")
    for name in ("before", "after"):
        if trees[name].parent == tmp:
            subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force", str(trees[name])],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
