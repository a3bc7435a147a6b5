"""Layout benchmark (the layout issue's proof): a loader tuned alone, then run in N ranks, against one tuned with
``--nproc-per-node N``.

1. ``gpufeed tune --nproc-per-node 1 --trainer-cores 0`` -> config A: one loader with the whole machine to itself
   (what ``gpufeed tune`` measured before it knew the layout);
2. ``gpufeed tune --nproc-per-node N`` -> config B: N concurrent rank loaders, a core left to each trainer;
3. N concurrent rank loaders with A and with B (``measure_ranks``), interleaved round by round (the machine drifts):
   the node's aggregate samples/s and each rank's;
4. with ``--train``: ``gpufeed train --measure --nproc-per-node N`` (resnet18, CPU) with each config, whose
   data stall % says what over-subscription costs once the training processes want their cores too.

Prints a table and writes JSON under benchmarks/results/. Never asserts.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_layout.py --data bench-data/synth-600 --train
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from gpufeed.config import LoaderConfig, TuneConfig, load_config  # noqa: E402
from gpufeed.measure.metrics import Stat  # noqa: E402
from gpufeed.core.records import write_json  # noqa: E402
from gpufeed.core.system import usable_cpus  # noqa: E402
from gpufeed.tune import describe, measure_ranks, tune  # noqa: E402
from gpufeed.core.world import World  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpufeed_cli(*args: Any, capture: bool = False) -> str:
    cmd = [sys.executable, "-m", "gpufeed.cli", *map(str, args)]
    log("$ gpufeed " + " ".join(map(str, args)))
    proc = subprocess.run(cmd, cwd=ROOT, stdout=subprocess.PIPE if capture else None, text=True)
    if proc.returncode not in (0, 1):  # 1: a starved verdict, which is a result here
        raise SystemExit(f"gpufeed {args[0]} exited {proc.returncode}")
    return proc.stdout or ""


def ensure_shards(data: Path, images: int, shards: Path) -> Path:
    if not any(data.glob("*/*")):
        gpufeed_cli("synth", data, "--images", images, "--seed", "0")
    if not (shards / "manifest.json").exists():
        gpufeed_cli("shard", data, shards, "--multiple-of", 4, "--quiet")
    return shards


def tuned(shards: Path, out: Path, run_dir: Path, nproc: int, trainer_cores: int, args: argparse.Namespace) -> LoaderConfig:
    cfg = TuneConfig(shards=str(shards), budget_s=args.budget, batch_size=args.batch_size, image_size=args.image_size,
                     nproc_per_node=nproc, trainer_cores=trainer_cores, repeats=2, out=str(out), run_dir=str(run_dir))
    report = tune(cfg, LoaderConfig(), progress=log)
    log(report.conclusion)
    if report.best is None:
        raise SystemExit(f"tune --nproc-per-node {nproc} found no working config: {report.conclusion}")
    return load_config(out).loader


def stall(shards: Path, config: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """``gpufeed train --measure`` in the benchmark's layout: real-mode data stall % and samples/s."""
    text = gpufeed_cli("train", "--shards", shards, "--config", config, "--measure", "--nproc-per-node", args.nproc,
                       "--arch", "resnet18", "--batch-size", args.batch_size, "--image-size", args.image_size,
                       "--device", "cpu", "--amp", "off", "--measure-steps", args.measure_steps, "--run-dir", run_dir,
                       "--quiet", "--json", capture=True)
    rec = json.loads(text.strip().splitlines()[-1])
    modes = rec.get("modes") or {}
    real, loader_only = modes.get("real") or {}, modes.get("loader-only") or {}
    return {"real_stall_pct": real.get("stall_pct"), "real_samples_per_s": real.get("samples_per_s"),
            "loader_only_samples_per_s": loader_only.get("samples_per_s"),
            "verdict": (rec.get("verdict") or {}).get("status")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "synth-600")
    ap.add_argument("--images", type=int, default=600)
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data" / "layout")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--budget", type=float, default=25.0, help="tune budget per config, seconds")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--window", type=float, default=2.0)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--train", action="store_true", help="also train --measure with each config")
    ap.add_argument("--measure-steps", type=int, default=8)
    args = ap.parse_args()

    work = args.work
    work.mkdir(parents=True, exist_ok=True)
    shards = ensure_shards(args.data, args.images, work / "shards")
    stamp = dt.datetime.now(dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    configs = {
        "A tuned alone": tuned(shards, work / "A.toml", work / f"tune-A-{stamp}", 1, 0, args),
        f"B tuned --nproc-per-node {args.nproc}": tuned(shards, work / "B.toml", work / f"tune-B-{stamp}", args.nproc, 1,
                                                        args),
    }
    paths = dict(zip(configs, (work / "A.toml", work / "B.toml")))
    node = World(world_size=args.nproc, local_world_size=args.nproc)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in configs}
    for r in range(args.rounds):
        for name, cfg in configs.items():
            rec = measure_ranks(shards, cfg, node, window_s=args.window, repeats=2)
            runs[name].append({"aggregate": rec.samples_per_s_runs, "per_rank": rec.rank_samples_per_s,
                               "error": rec.error})
            log(f"round {r} {name}: {rec.samples_per_s or 0:.0f} samples/s (ranks {rec.rank_samples_per_s})"
                + (f" ERROR {rec.error}" if rec.error else ""))
    trains = {name: stall(shards, paths[name], work / f"train-{name[0]}-{stamp}", args) for name in configs} \
        if args.train else {}

    usable = usable_cpus()
    rows = []
    for name, cfg in configs.items():
        agg = [x for run in runs[name] for x in run["aggregate"]]
        slow = [min(run["per_rank"]) for run in runs[name] if run["per_rank"]]
        stat = Stat.of(agg) if agg else None
        rows.append({"config": name, "loader": describe(cfg, False), "num_workers": cfg.num_workers,
                     "processes": args.nproc * cfg.num_workers, "usable_cores": usable,
                     "aggregate": None if stat is None else stat.fmt(),
                     "aggregate_median": None if stat is None else stat.median,
                     "slowest_rank_median": Stat.of(slow).median if slow else None, **trains.get(name, {})})
    head = (f"| config | per-rank [loader] | workers x ranks on {usable} cores | aggregate samples/s (median, min-max) "
            f"| slowest rank | train --measure stall % | train samples/s |")
    print(head)
    print("|" + "---|" * 7)
    for row in rows:
        print(f"| {row['config']} | {row['loader']} | {row['num_workers']} x {args.nproc} = {row['processes']} | "
              f"{row['aggregate']} | {_f(row['slowest_rank_median'])} | {_f(row.get('real_stall_pct'), 1)} | "
              f"{_f(row.get('real_samples_per_s'))} |")
    out = ROOT / "benchmarks" / "results" / f"bench_layout-{stamp}.json"
    write_json(out, {"args": {k: str(v) for k, v in vars(args).items()}, "rows": rows, "runs": runs})
    log(f"wrote {out}")


def _f(v: float | None, digits: int = 0) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


if __name__ == "__main__":
    main()
