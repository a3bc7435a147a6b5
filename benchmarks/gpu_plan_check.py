"""Prepared GPU check of ``gpufeed plan`` (issue 11): its estimated peak against gpufeed train's real one.

For each batch size (default 128 and 256) two fresh processes run, one after the other:

1. ``gpufeed plan --arch resnet50 --amp bf16 --channels-last --batch-size N --device cuda --json``: its estimated
   peak (linear model from two small measured batches, 16 and 32 by default on a GPU);
2. ``gpufeed train --synthetic --steps S --log-every 1 ...`` with the same model settings: log.jsonl's
   ``memory_bytes`` is ``torch.cuda.max_memory_allocated`` of the training process, its maximum over the steps the
   real peak.

One JSON line per batch on stdout: estimate, measured, error %, plan's own check at its third batch, whether the
estimate fits the GPU, seconds. Never asserts.

    python benchmarks/gpu_plan_check.py                 # on the H200: a few minutes
    python benchmarks/gpu_plan_check.py --smoke         # on a CPU: resnet18, 32 px, batches 16 and 32, ~1 min

With ``--smoke`` both processes run on the CPU, where ``memory_bytes`` is the training process' RSS (interpreter
and libraries included), so the line carries ``comparable: false`` and no error: the smoke checks the plumbing only.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpufeed(args: list[str], timeout: float) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT / "src"), os.environ.get("PYTHONPATH")])))
    return subprocess.run([sys.executable, "-m", "gpufeed.cli", *args], capture_output=True, text=True, env=env,
                          timeout=timeout)


def check_batch(n: int, model: list[str], plan_args: list[str], device: str, steps: int, timeout: float) -> dict:
    line: dict = {"batch_size": n, "device": device}
    t0 = time.perf_counter()
    p = gpufeed(["plan", *model, *plan_args, "--batch-size", str(n), "--device", device, "--json"], timeout)
    line["plan_s"] = round(time.perf_counter() - t0, 2)
    if p.returncode not in (0, 1):
        line["error"] = f"plan exited {p.returncode}: {p.stderr.strip()[-400:]}"
        return line
    rep = json.loads(p.stdout)
    line.update(estimate_bytes=rep["estimate"]["peak_bytes"], fits=rep["fits"], max_batch_size=rep["max_batch_size"],
                plan_measured_batches=[m["batch_size"] for m in rep["measurements"]],
                plan_check_batch=rep["check"]["batch_size"] if rep["check"] else None,
                plan_check_error_pct=rep["check_error_pct"], device_name=rep["device_name"])
    with tempfile.TemporaryDirectory(prefix="gpufeed-plancheck-") as run_dir:
        t0 = time.perf_counter()
        p = gpufeed(["train", "--synthetic", *model, "--batch-size", str(n), "--device", device, "--steps",
                     str(steps), "--log-every", "1", "--quiet", "--run-dir", run_dir], timeout)
        line["train_s"] = round(time.perf_counter() - t0, 2)
        log = Path(run_dir) / "log.jsonl"
        if p.returncode != 0 or not log.exists():
            line["error"] = f"train exited {p.returncode}: {p.stderr.strip()[-400:]}"
            return line
        mem = [json.loads(x).get("memory_bytes") or 0 for x in log.read_text().splitlines() if x.strip()]
    measured = max(mem)
    comparable = device.startswith("cuda")
    line.update(measured_bytes=measured, measured_kind="cuda max_memory_allocated" if comparable else "cpu rss",
                comparable=comparable,
                error_pct=round((line["estimate_bytes"] - measured) / measured * 100, 2) if comparable else None)
    return line


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", type=int, nargs="+", default=None, help="default: 128 256 (smoke: 16 32)")
    ap.add_argument("--steps", type=int, default=None, help="train steps per batch (default 5; smoke 2)")
    ap.add_argument("--smoke", action="store_true", help="CPU, resnet18, 32 px, plan measured at 4 and 8: plumbing only")
    ap.add_argument("--timeout", type=float, default=280.0, help="seconds per gpufeed process")
    args = ap.parse_args()
    if args.smoke:
        model = ["--arch", "resnet18", "--amp", "off", "--image-size", "32"]
        plan_args = ["--measure-batches", "4", "8"]
        device, batches, steps = "cpu", args.batches or [16, 32], args.steps or 2
    else:
        model = ["--arch", "resnet50", "--amp", "bf16", "--channels-last", "--image-size", "224"]
        plan_args = []
        device, batches, steps = "cuda", args.batches or [128, 256], args.steps or 5
    for n in batches:
        try:
            line = check_batch(n, model, plan_args, device, steps, args.timeout)
        except (subprocess.TimeoutExpired, ValueError, KeyError) as exc:
            line = {"batch_size": n, "device": device, "error": f"{type(exc).__name__}: {exc}"[:400]}
        print(json.dumps(line), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
