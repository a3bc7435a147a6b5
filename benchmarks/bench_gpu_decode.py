"""Loader ceilings: CPU decode paths vs GPU decode (torchvision.io.decode_jpeg on CUDA), batches moved to the device.

Writes synthetic ~500x400 JPEG shards (scikit-image sample photos, cropped and resized), then for each
decode path and worker count runs whole epochs of ``build_loader`` with ``to_device`` and reports the
steady-state samples/s (first batch of each epoch excluded; median and spread over epochs).

    python benchmarks/bench_gpu_decode.py --samples 4000 --workers 4,8,15 --out results.jsonl
"""

from __future__ import annotations

import argparse
import io
import json
import random
import statistics
import sys
import time
from pathlib import Path

import numpy as np


def make_shards(dest: Path, samples: int, shards: int) -> Path:
    from PIL import Image
    from skimage import data

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from tests.common.shards import write_set

    if (dest / "manifest.json").exists():
        return dest
    names = ("astronaut", "chelsea", "coffee", "rocket", "hubble_deep_field", "immunohistochemistry")
    srcs = [Image.fromarray(getattr(data, n)()[..., :3]) for n in names]
    rng = random.Random(0)

    def make(n):
        s = srcs[n % len(srcs)]
        w, h = rng.randint(450, 520), rng.randint(350, 420)
        x0, y0 = rng.randint(0, s.width - 300), rng.randint(0, s.height - 250)
        img = s.crop((x0, y0, min(s.width, x0 + 400), min(s.height, y0 + 330))).resize((w, h))
        b = io.BytesIO()
        img.save(b, "JPEG", quality=90)
        return "jpg", b.getvalue()

    per = [samples // shards + (i < samples % shards) for i in range(shards)]
    return write_set(dest, per, num_classes=100, make=make)


def measure(shards: Path, device: str, epochs: int, **kw) -> dict:
    import torch

    from gpufeed.config import LoaderConfig
    from gpufeed.loader import build_loader, normalize
    from gpufeed.core.world import World

    cfg = LoaderConfig(**kw)
    world = World.single(device)
    loader = build_loader(shards, cfg, world)
    rates = []
    for ep in range(epochs):
        loader.set_epoch(ep)
        it = iter(loader)
        x, y = loader.to_device(next(it), device)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        n, t = 0, time.perf_counter()
        for batch in it:
            x, y = loader.to_device(batch, device)
            normalize(x, dtype=torch.bfloat16, channels_last=True)
            n += y.shape[0]
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        rates.append(n / (time.perf_counter() - t))
    return {**kw, "device": device, "samples_per_s": statistics.median(rates), "min": min(rates), "max": max(rates),
            "epochs": epochs, "batches_per_epoch": len(loader)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dest", default="/tmp/gpufeed-bench-shards")
    ap.add_argument("--samples", type=int, default=4000)
    ap.add_argument("--shards", type=int, default=16)
    ap.add_argument("--workers", default="4,8,15")
    ap.add_argument("--decodes", default="pil-draft,simplejpeg,gpu")
    ap.add_argument("--batch-size", type=int, default=256)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    shards = make_shards(Path(a.dest), a.samples, a.shards)
    device = a.device
    results = []
    for decode in a.decodes.split(","):
        for w in [int(x) for x in a.workers.split(",")]:
            try:
                r = measure(shards, device, a.epochs, decode=decode, num_workers=w, batch_size=a.batch_size,
                            image_size=224, shuffle_buffer=1000, pin_memory=True, prefetch_factor=4,
                            persistent_workers=True)
            except Exception as exc:  # noqa: BLE001 - a failed trial is a record
                r = {"decode": decode, "num_workers": w, "error": f"{type(exc).__name__}: {exc}"}
            results.append(r)
            print(json.dumps(r), flush=True)
    if a.out:
        Path(a.out).write_text("".join(json.dumps(r) + "\n" for r in results))


if __name__ == "__main__":
    main()
