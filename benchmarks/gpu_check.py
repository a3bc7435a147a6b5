"""One prepared GPU check for issues 3 and 4 (runs in a few minutes on one H200 with 16 cores).

Steps, each timed and recorded even if a later one fails:
  1. environment (torch, CUDA, GPU, usable CPUs);
  2. `gpufeed synth` an ImageNet-like folder and `gpufeed shard` it into /dev/shm (RAM disk), plus a
     stored-size-reduced copy (`--max-size 320`);
  3. loader ceilings at 224 px, batch 256 (docs/design.md §4: batches to the GPU and dropped) for CPU decode
     (PIL draft, simplejpeg; ``roi`` when nvImageCodec is installed) and GPU decode (``gpu``: nvJPEG through
     TorchCodec, or torchvision when TorchCodec is missing; ``gpu-torchvision``: the deprecated
     ``torchvision.io.decode_jpeg`` forced, the old API, for the before/after of issue 21), median of repeats;
  4. `gpufeed.train.measure`: resnet50, AMP bf16, channels_last, batch 256: synthetic (GPU ceiling),
     loader-only and real end-to-end, stall %, GPU telemetry, verdict, once per decode path.

Usage: python benchmarks/gpu_check.py --out DIR [--images 4000] [--steps 40]
Issue 21's ceilings: ``--workers 4 8 15 --decodes simplejpeg roi gpu gpu-torchvision --skip-train``.

On the lent device machine (its image has torch, torchvision, scikit-image, pyarrow, psutil, nvidia-ml-py, but not
webdataset): carry wheels of webdataset, braceexpand and simplejpeg for Python 3.12 in .whl/ and run
``python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && PYTHONPATH=/tmp/site:src
python3 benchmarks/gpu_check.py --out $OUT``.
Writes DIR/gpu_check.json (updated after every step) and prints a summary table. Never asserts.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


@contextlib.contextmanager
def old_gpu_api(on: bool):  # noqa: ANN201
    """With ``on``, ``decode = "gpu"`` decodes through the deprecated ``torchvision.io.decode_jpeg`` (the API before
    TorchCodec) for the duration: the old and new GPU decode measured in one run."""
    if not on:
        yield
        return
    import warnings

    from torchvision.io import ImageReadMode, decode_jpeg

    from gpufeed.loader import gpu

    saved = gpu.jpeg_decoder
    gpu.jpeg_decoder = lambda: (lambda chunks, device: decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device))
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # its deprecation warning, once per call
            yield
    finally:
        gpu.jpeg_decoder = saved


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True)
    ap.add_argument("--work", default="/dev/shm/gpufeed-check")
    ap.add_argument("--images", type=int, default=4000)
    ap.add_argument("--classes", type=int, default=100)
    ap.add_argument("--steps", type=int, default=40, help="timed steps per train mode")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--arch", default="resnet50")
    ap.add_argument("--workers", type=int, nargs="*", default=None, help="loader workers to try (default: cpus-1)")
    ap.add_argument("--decodes", nargs="*", default=["pil-draft", "simplejpeg", "gpu"])
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--device", default="auto")
    ap.add_argument("--skip-train", action="store_true")
    args = ap.parse_args()

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(args.work)
    results: dict[str, Any] = {"args": vars(args), "steps": {}}
    t_start = time.perf_counter()

    def save() -> None:
        from gpufeed.core.records import to_jsonable

        (out / "gpu_check.json").write_text(json.dumps(to_jsonable(results), indent=2))

    def step(name: str, fn):  # noqa: ANN001
        t0 = time.perf_counter()
        print(f"\n=== {name} (t={t0 - t_start:.0f}s)", flush=True)
        try:
            value = fn()
            results["steps"][name] = {"ok": True, "elapsed_s": time.perf_counter() - t0, "result": value}
        except Exception as exc:  # record and go on: a later step may still work
            traceback.print_exc()
            results["steps"][name] = {"ok": False, "elapsed_s": time.perf_counter() - t0,
                                      "error": f"{type(exc).__name__}: {exc}"}
            value = None
        print(f"=== {name}: {time.perf_counter() - t0:.1f}s", flush=True)
        save()
        return value

    from gpufeed.core.system import environment_snapshot, usable_cpus

    env = step("environment", lambda: environment_snapshot())
    cpus = usable_cpus()
    workers_list = args.workers or [max(1, cpus - 1)]

    gf = [sys.executable, "-m", "gpufeed.cli"]

    import os

    sub_env = dict(os.environ)  # the CLI subprocesses import gpufeed from this checkout, installed or not
    sub_env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH")) if p)

    def run(cmd: list[str]) -> dict[str, Any]:
        p = subprocess.run(cmd + ["--json"], capture_output=True, text=True, env=sub_env)
        sys.stderr.write(p.stderr[-3000:])
        if p.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd)} exited {p.returncode}: {p.stderr[-500:]}")
        return json.loads(p.stdout)

    images, shards, small = work / "images", work / "shards", work / "shards-320"
    if not (images / ".done").exists():
        def synth() -> dict[str, Any]:
            r = run(gf + ["synth", str(images), "--images", str(args.images), "--classes", str(args.classes),
                          "--seed", "0", "--overwrite"])
            (images / ".done").write_text("ok")
            return r
        step("synth", synth)
    mult = str(max(1, cpus))
    step("shard", lambda: run(gf + ["shard", str(images), str(shards), "--shard-samples", "250", "--multiple-of",
                                    mult, "--overwrite"]))
    step("shard-max-size-320", lambda: run(gf + ["shard", str(images), str(small), "--shard-samples", "250",
                                                 "--multiple-of", mult, "--max-size", "320", "--overwrite"]))

    import torch

    from gpufeed.config import LoaderConfig, TrainConfig
    from gpufeed.tune import measure_loader
    from gpufeed.core.world import World

    world = World.from_env(args.device)
    results["device"] = world.device
    print(f"device {world.device}, usable cpus {cpus}, torch {torch.__version__}", flush=True)

    def loader_cfg(decode: str, workers: int) -> LoaderConfig:
        return LoaderConfig(batch_size=args.batch_size, image_size=args.image_size, decode=decode,
                            num_workers=workers, prefetch_factor=4, pin_memory=world.is_cuda,
                            shuffle_buffer=1000)

    ceilings: dict[str, float] = {}

    def ceiling(set_dir: Path, decode: str, workers: int) -> dict[str, Any]:
        with old_gpu_api(decode == "gpu-torchvision"):
            rec = measure_loader(set_dir, loader_cfg("gpu" if decode.startswith("gpu") else decode, workers), world,
                                 warmup_batches=3, window_s=args.window_s, repeats=args.repeats)
        d = dataclasses.asdict(rec)
        if rec.error is None:
            ceilings[f"{set_dir.name}/{decode}/w{workers}"] = rec.samples_per_s
        print(f"loader ceiling {set_dir.name} decode={decode} workers={workers}: "
              f"{rec.samples_per_s} samples/s (error={rec.error})", flush=True)
        return d

    for decode in args.decodes:
        if decode.startswith("gpu") and not world.is_cuda:
            continue
        for w in workers_list:
            step(f"loader-ceiling/shards/{decode}/w{w}", lambda d=decode, w=w: ceiling(shards, d, w))
    for decode in ("pil-draft",):
        w = workers_list[-1]
        step(f"loader-ceiling/shards-320/{decode}/w{w}", lambda d=decode, w=w: ceiling(small, d, w))
    results["loader_ceilings"] = ceilings
    save()

    if not args.skip_train:
        from gpufeed.train import measure

        best_cpu = max((k for k in ceilings if k.startswith("shards/") and "/gpu" not in k),
                       key=lambda k: ceilings[k], default=None)
        variants: list[tuple[str, Path, str, int]] = []
        if best_cpu:
            _, dec, w = best_cpu.split("/")
            variants.append(("cpu-decode", shards, dec, int(w[1:])))
        if world.is_cuda and "gpu" in args.decodes:
            variants.append(("gpu-decode", shards, "gpu", workers_list[-1]))
        variants.append(("cpu-decode-320px-stored", small, "pil-draft", workers_list[-1]))
        for name, set_dir, dec, w in variants:
            def train_measure(set_dir: Path = set_dir, dec: str = dec, w: int = w) -> dict[str, Any]:
                cfg = TrainConfig(shards=str(set_dir), arch=args.arch, batch_size=args.batch_size,
                                  image_size=args.image_size, amp="bf16", channels_last=True, device=args.device,
                                  progress=False, log_every=10, timing_warmup_steps=5)
                rec = measure(cfg, loader_cfg(dec, w), world, steps_per_mode=args.steps,
                              run_dir=out / f"train-{set_dir.name}-{dec}")
                from gpufeed.core.records import to_jsonable

                d = to_jsonable(rec)
                for mode, m in (d.get("modes") or {}).items():
                    gpu = (m.get("per_rank") or [{}])[0].get("gpu") or {}
                    print(f"  {name} {mode}: {m['samples_per_s']:.0f} samples/s, stall {m['stall_pct']:.1f}%, "
                          f"GPU util {gpu.get('util_mean_pct')}%, power {gpu.get('power_mean_w')} W", flush=True)
                v = d.get("verdict") or {}
                print(f"  verdict: {v.get('status')} ({v.get('bound')}): {v.get('reason')}", flush=True)
                return d
            step(f"train-measure/{name}", train_measure)

    results["total_s"] = time.perf_counter() - t_start
    save()
    print(f"\ntotal {results['total_s']:.0f}s; results in {out / 'gpu_check.json'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
