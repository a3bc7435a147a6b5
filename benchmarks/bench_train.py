"""Train benchmark (the train issue's proof): is a 2-process DDP ResNet run fed, with num_workers 0 vs a tuned loader?

For each variant, ``gpufeed train --measure`` (2 gloo processes through torchrun) measures, in order:
the GPU ceiling (here: the CPU compute ceiling, a synthetic batch), the loader ceiling (the loader alone)
and the real run; it reports the data stall %, samples/s (median and min–max over windows) and the verdict.
Variants run interleaved round by round (the machine drifts). Writes JSON under benchmarks/results/;
never asserts.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_train.py

Data: the gpufeed synth folder bench-data/synth-3000 (made if missing), sharded with gpufeed shard; the
tuned [loader] section comes from ``gpufeed tune --out`` at the same batch and image size.
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

from gpufeed.core.records import write_json  # noqa: E402
from gpufeed.core.system import environment_snapshot  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def gpufeed(*args: Any, check: bool = True) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "gpufeed.cli", *map(str, args)]
    log("$ gpufeed " + " ".join(map(str, args)))
    return subprocess.run(cmd, check=check, cwd=ROOT, stdout=subprocess.PIPE, text=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", type=Path, default=ROOT / "bench-data" / "synth-3000", help="gpufeed synth folder")
    ap.add_argument("--images", type=int, default=3000)
    ap.add_argument("--work", type=Path, default=ROOT / "bench-data" / "bench-train")
    ap.add_argument("--arch", default="resnet18")
    ap.add_argument("--image-size", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=32, help="per rank")
    ap.add_argument("--nproc", type=int, default=2)
    ap.add_argument("--measure-steps", type=int, default=10)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--tune-budget", type=float, default=40.0)
    ap.add_argument("--tuned", type=Path, help="an existing tuned [loader] TOML (skips gpufeed tune)")
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    a = ap.parse_args()

    if not any(a.data.glob("*/*")):
        gpufeed("synth", a.data, "--images", a.images, "--seed", "0")
    shards = a.work / "shards"
    if not (shards / "manifest.json").exists():
        gpufeed("shard", a.data, shards, "--multiple-of", 2 * a.nproc, "--shard-samples", 250, "--quiet")
    tuned = a.tuned or a.work / "tuned.toml"
    if not tuned.exists():
        gpufeed("tune", shards, "--budget", a.tune_budget, "--batch-size", a.batch_size, "--image-size",
                a.image_size, "--out", tuned, "--run-dir", a.work / "tune-run")
    workers0 = a.work / "workers0.toml"
    workers0.write_text("[loader]\nnum_workers = 0\n", encoding="utf-8")

    # the tuner measures the loader alone; "tuned+1 worker" applies the verdict's fix for a serial loader
    variants = {"num_workers=0": (workers0, []), "tuned": (tuned, []), "tuned+1 worker": (tuned, ["--num-workers", 1])}
    results: dict[str, list[dict[str, Any]]] = {k: [] for k in variants}
    for rnd in range(a.rounds):
        for name, (cfg, extra) in variants.items():
            slug = "".join(c if c.isalnum() else "-" for c in name)
            run = a.work / "runs" / f"{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}-{slug}"
            t0 = time.perf_counter()
            gpufeed("train", "--shards", shards, "--config", cfg, "--arch", a.arch, "--image-size", a.image_size,
                    "--batch-size", a.batch_size, "--amp", "off", "--device", "cpu", "--nproc-per-node", a.nproc,
                    "--measure", "--measure-steps", a.measure_steps, "--log-every", 2, "--run-dir", run, "--quiet",
                    *extra, check=False)
            summary = json.loads((run / "summary.json").read_text())
            summary["bench_wall_s"] = time.perf_counter() - t0
            summary["bench_round"] = rnd
            summary["loader_config"] = (run / "config.toml").read_text()
            results[name].append(summary)
            m = summary["modes"]
            log(f"{name}: real {m['real']['samples_per_s']:.1f}/s stall {m['real']['stall_pct']:.1f}% | ceilings "
                f"synthetic {m['synthetic']['samples_per_s']:.1f}/s loader {m['loader-only']['samples_per_s']:.1f}/s "
                f"| {summary['verdict']['status']} {summary['verdict'].get('bound') or ''}")

    rows = []
    for name, runs in results.items():
        for s in runs:
            m = s["modes"]
            rows.append({
                "variant": name, "round": s["bench_round"],
                "end_to_end_samples_per_s": m["real"]["samples_per_s"],
                "end_to_end_windows": m["real"]["samples_per_s_stat"],
                "stall_pct": m["real"]["stall_pct"],
                "per_rank_stall_pct": [r["stall_pct"] for r in m["real"]["per_rank"]],
                "gpu_ceiling": m["synthetic"]["samples_per_s"],
                "loader_ceiling": m["loader-only"]["samples_per_s"],
                "loader_cores_used": m["loader-only"]["loader_cores_used"],
                "verdict": s["verdict"],
            })
    out = {
        "bench": "train", "time": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "args": {k: str(v) for k, v in vars(a).items()}, "environment": environment_snapshot(),
        "rows": rows, "runs": results,
    }
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / f"train-{dt.datetime.now(dt.timezone.utc):%Y%m%d-%H%M%S}.json"
    write_json(path, out)
    print(f"{'variant':<15} {'e2e samples/s':>14} {'stall %':>8} {'GPU ceil':>9} {'loader ceil':>11}  verdict")
    for r in rows:
        v = r["verdict"]
        print(f"{r['variant']:<15} {r['end_to_end_samples_per_s']:>14.1f} {r['stall_pct']:>8.1f} "
              f"{r['gpu_ceiling']:>9.1f} {r['loader_ceiling']:>11.1f}  {v['status']} {v.get('bound') or ''}")
        for f in v.get("fixes", []):
            print(f"{'':>15} fix: {f}")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
