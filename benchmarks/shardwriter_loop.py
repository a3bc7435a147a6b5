"""The script users write today: one process, ``webdataset.ShardWriter``, the same validation as gpufeed.

    python benchmarks/shardwriter_loop.py SRC DEST [--maxcount 10000] [--maxsize 1e9] [--seed 0]

Classes are the sorted folder names (as torchvision's ImageFolder); every image is validated the way
``gpufeed shard --check full`` does (PIL open + full decode + convert to RGB, width/height read), its bytes
are stored unchanged as ``KEY.jpg`` with ``KEY.cls`` and a ``KEY.json`` (source, class, width, height).
The list is shuffled with a seed (so each shard holds many classes). Note: ``import webdataset`` imports
torch (webdataset 1.x), which costs seconds of start-up: that is part of what users pay.
Prints one JSON line: samples, rejected, elapsed_s, import_s.
"""

from __future__ import annotations

import json
import os
import random
import sys
import time

t_start = time.perf_counter()
import webdataset as wds  # noqa: E402
from PIL import Image  # noqa: E402

import_s = time.perf_counter() - t_start

EXTS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def main(argv: list[str]) -> None:
    import argparse

    p = argparse.ArgumentParser()
    p.add_argument("src")
    p.add_argument("dest")
    p.add_argument("--maxcount", type=int, default=10_000)
    p.add_argument("--maxsize", type=float, default=1e9)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)

    classes = sorted(d.name for d in os.scandir(a.src) if d.is_dir() and not d.name.startswith("."))
    files = []
    for label, name in enumerate(classes):
        for root, dirs, names in os.walk(os.path.join(a.src, name)):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))
            for n in sorted(names):
                if not n.startswith(".") and n.lower().endswith(EXTS):
                    files.append((os.path.join(root, n), label, name))
    random.Random(a.seed).shuffle(files)

    os.makedirs(a.dest, exist_ok=True)
    written = rejected = 0
    with wds.ShardWriter(os.path.join(a.dest, "train-%06d.tar"), maxcount=a.maxcount, maxsize=a.maxsize,
                         verbose=0) as sink:
        for path, label, name in files:
            try:
                with open(path, "rb") as f:
                    data = f.read()
                with Image.open(path) as im:
                    im.load()
                    rgb = im.convert("RGB")
                    width, height = rgb.size
            except Exception as exc:  # what a user's loop does: skip and count
                print(f"skip {path}: {exc}", file=sys.stderr)
                rejected += 1
                continue
            key = f"{label:05d}_{written:07d}"
            sink.write({
                "__key__": key,
                "jpg": data,
                "cls": str(label).encode(),
                "json": json.dumps({"source": os.path.relpath(path, a.src), "class": name,
                                    "width": width, "height": height}).encode(),
            })
            written += 1
    print(json.dumps({"samples": written, "rejected": rejected,
                      "elapsed_s": time.perf_counter() - t_start, "import_s": import_s}))


if __name__ == "__main__":
    main(sys.argv[1:])
