"""Tiny gpufeed-format shard sets for the train tests, written directly (independent of gpufeed.shard)."""

from __future__ import annotations

import hashlib
import io
import json
from pathlib import Path

import numpy as np
from PIL import Image

from gpufeed.shardset.manifest import Manifest, ShardInfo, brace_pattern, write_manifest
from tests.conftest import write_tar


def _jpeg(rng: np.random.Generator, label: int, size: int) -> bytes:
    arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    arr[..., label % 3] = 200  # a little class signal
    buf = io.BytesIO()
    Image.fromarray(arr, "RGB").save(buf, "JPEG", quality=90)
    return buf.getvalue()


def write_tiny_shards(dest: Path, sizes: list[int], *, classes: int = 4, image_px: int = 40, seed: int = 0,
                      prefix: str = "train") -> Path:
    """One tar per entry of ``sizes`` (samples in it); members KEY.jpg, KEY.cls, KEY.json; manifest last."""
    dest.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    infos, k, total = [], 0, 0
    for s, n in enumerate(sizes):
        name = f"{prefix}-{s:06d}.tar"
        members = []
        for _ in range(n):
            key = f"s{k:06d}"
            label = k % classes
            meta = {"source": f"class_{label}/{key}.jpg", "class": f"class_{label}",
                    "width": image_px, "height": image_px}
            members += [(f"{key}.jpg", _jpeg(rng, label, image_px)), (f"{key}.cls", str(label).encode()),
                        (f"{key}.json", json.dumps(meta).encode())]
            k += 1
        write_tar(dest / name, members)
        data = (dest / name).read_bytes()
        total += len(data)
        infos.append(ShardInfo(name=name, num_samples=n, bytes=len(data), sha256=hashlib.sha256(data).hexdigest()))
    m = Manifest(prefix=prefix, classes=[f"class_{c}" for c in range(classes)], shards=infos, num_samples=k,
                 total_bytes=total, mean_sample_bytes=total / max(1, k),
                 url_pattern=brace_pattern([i.name for i in infos]), created_by="tests")
    write_manifest(dest, m)
    return dest
