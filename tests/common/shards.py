"""Shard sets, tars and images for tests, written directly (independent of ``gpufeed.shard``).

:func:`write_shard_set` is the one writer of gpufeed-format sets (members KEY.EXT, KEY.cls, KEY.json per sample,
then manifest.json); what a test wants differently is a parameter of it or of the :class:`Sample` s it is given.
:func:`write_set`, :func:`write_tiny_shards` and :func:`make_shards` are presets many tests depend on byte for byte
(keys, labels, images, manifest): change what a preset writes only together with the tests that read it.
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import tarfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

if TYPE_CHECKING:
    import numpy as np
    from PIL import Image

    from gpufeed.config import LoaderConfig

WDS_SAMPLE = Path(__file__).resolve().parents[1] / "fixtures" / "webdataset-sample.tgz"
"""90 samples written by the webdataset project's own tooling (see tests/fixtures/README.md)."""


# --------------------------------------------------------------------------------------------- files: tar, image


def write_tar(dest: Path | BinaryIO, members: list[tuple[str, bytes]], *, gz: bool = False,
              format: int = tarfile.USTAR_FORMAT, mode: str = "w") -> Path | BinaryIO:
    """Write a well-formed tar of ``members`` ((name, data), in this order, duplicates kept) to ``dest``.

    Every member is a regular file with tarfile's defaults (mode 0644, mtime 0, no owner). ``dest`` is a path or a
    binary file object. ``format`` is a tarfile format (USTAR, GNU or PAX). ``gz`` gzips the whole tar (gzip
    header mtime 0, no file name). ``mode="a"`` appends the members to an existing plain tar. Returns ``dest``.
    """
    if mode not in ("w", "a") or (gz and mode == "a"):
        raise ValueError(f"write_tar: mode {mode!r} with gz={gz} (use 'w', or 'a' on a plain tar)")
    out = io.BytesIO() if gz else dest
    where = {"name": out} if isinstance(out, (str, Path)) else {"fileobj": out}
    with tarfile.open(mode=mode, format=format, **where) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    if gz:
        data = gzip.compress(out.getvalue(), mtime=0)
        if isinstance(dest, (str, Path)):
            Path(dest).write_bytes(data)
        else:
            dest.write(data)
    return dest


def write_image(path: Path, size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (200, 30, 30),
                fmt: str = "JPEG", mode: str = "RGB", **save: object) -> Path:
    """Write a small image with a gradient (so decoders have real content to agree on)."""
    import numpy as np
    from PIL import Image

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = (color[0] + 3 * xx) % 256
    arr[..., 1] = (color[1] + 5 * yy) % 256
    arr[..., 2] = (color[2] + xx + yy) % 256
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, **save)
    return path


def smooth_image(w: int, h: int, seed: int) -> Image.Image:
    """A smooth photo-like RGB image (gradients + a few soft blobs) so decoders have content to agree on."""
    import numpy as np
    from PIL import Image

    rng = np.random.default_rng(seed)
    yy, xx = np.mgrid[0:h, 0:w].astype(np.float32)
    arr = np.zeros((h, w, 3), np.float32)
    for c in range(3):
        arr[..., c] = 128 + 60 * np.sin(xx / (15 + 10 * rng.random()) + c) * np.cos(yy / (20 + 10 * rng.random()))
    return Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8), "RGB")


def encode(img: Image.Image, fmt: str = "JPEG", **kw) -> bytes:
    b = io.BytesIO()
    img.save(b, fmt, **kw)
    return b.getvalue()


def noise_jpeg(rng: np.random.Generator, label: int, size: int) -> bytes:
    """A ``size`` x ``size`` JPEG of noise from ``rng`` with one channel at 200 (a little class signal)."""
    import numpy as np
    from PIL import Image

    arr = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    arr[..., label % 3] = 200
    return encode(Image.fromarray(arr, "RGB"), "JPEG", quality=90)


def gradient_jpeg(size: tuple[int, int], a: int, b: int) -> bytes:
    """A JPEG of channel gradients offset by ``a`` (red) and ``b`` (green)."""
    import numpy as np
    from PIL import Image

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.stack([(a + 3 * xx) % 256, (b + 5 * yy) % 256, (xx + yy) % 256], -1).astype(np.uint8)
    return encode(Image.fromarray(arr, "RGB"), "JPEG", quality=90)


# ----------------------------------------------------------------------------------------- the one set writer


@dataclass(frozen=True)
class Sample:
    """One sample of a set: members ``KEY.EXT`` (``image``), ``KEY.cls`` (``label``) and ``KEY.json`` (``meta``)."""

    key: str
    label: int
    image: bytes
    meta: dict[str, Any] = field(default_factory=dict)
    ext: str = "jpg"


def md5_of_key(sample: Sample) -> str:
    """An ``order`` for :func:`write_shard_set`: by the md5 of the key (a fixed shuffle)."""
    return hashlib.md5(sample.key.encode()).hexdigest()


def write_shard_set(dest: Path, samples: Iterable[Sample], *, classes: Sequence[str],
                    sizes: Sequence[int] | None = None, deal: int | None = None,
                    order: Callable[[Sample], Any] | None = None, prefix: str = "train", full_manifest: bool = True,
                    created_by: str | None = None) -> Path:
    """Write ``samples`` as a gpufeed-format set in ``dest``: shards ``{prefix}-{i:06d}.tar``, then manifest.json.

    The samples go to shards in ``sizes`` consecutive runs (one shard per entry, drawn lazily from ``samples``), or
    are dealt round-robin over ``deal`` shards (sample j to shard j % deal); ``order`` (a sort key) sorts them
    first. ``classes`` are the manifest's class names (index = label). ``full_manifest`` records each shard's
    sha256 and the mean sample bytes, as ``gpufeed shard`` does; False leaves both out. ``created_by`` defaults to
    the manifest's own default. Returns ``dest``.
    """
    from gpufeed.shardset.manifest import Manifest, ShardInfo, brace_pattern, write_manifest

    if (sizes is None) == (deal is None):
        raise ValueError("write_shard_set: give exactly one of sizes and deal")
    if order is not None or deal is not None:
        samples = sorted(samples, key=order) if order is not None else list(samples)
    if deal is not None:
        parts: Iterable[Iterable[Sample]] = [samples[k::deal] for k in range(deal)]
    else:
        it = iter(samples)
        parts = ((next(it) for _ in range(n)) for n in sizes)
    dest.mkdir(parents=True, exist_ok=True)
    infos, count = [], 0
    for i, part in enumerate(parts):
        name = f"{prefix}-{i:06d}.tar"
        members, n = [], 0
        for s in part:
            members += [(f"{s.key}.{s.ext}", s.image), (f"{s.key}.cls", str(s.label).encode()),
                        (f"{s.key}.json", json.dumps(s.meta).encode())]
            n += 1
        write_tar(dest / name, members)
        raw = (dest / name).read_bytes()
        infos.append(ShardInfo(name=name, num_samples=n, bytes=len(raw),
                               sha256=hashlib.sha256(raw).hexdigest() if full_manifest else None))
        count += n
    total = sum(s.bytes for s in infos)
    extra: dict[str, Any] = {"mean_sample_bytes": total / max(1, count)} if full_manifest else {}
    if created_by is not None:
        extra["created_by"] = created_by
    write_manifest(dest, Manifest(prefix=prefix, classes=list(classes), shards=infos, num_samples=count,
                                  total_bytes=total, url_pattern=brace_pattern([s.name for s in infos]), **extra))
    return dest


# --------------------------------------------------------------------------------------------------- presets


def write_set(dest: Path, shard_sizes: list[int], *, num_classes: int = 3, size: tuple[int, int] = (40, 32),
              corrupt: set[int] = frozenset(), make=None) -> Path:
    """The loader tests' set: sample n has key s{n:05d}, label n % C, a :func:`smooth_image` JPEG (quality 95),
    meta ``{"source": KEY.EXT}``; classes c0..; no sha256 in the manifest.

    ``make(n) -> (ext, bytes)`` overrides the image of sample n; ``corrupt`` samples get truncated image bytes.
    """

    def sample(n: int) -> Sample:
        ext, data = make(n) if make else ("jpg", encode(smooth_image(*size, n), quality=95))
        if n in corrupt:
            data = data[: len(data) // 3]
        key = f"s{n:05d}"
        return Sample(key, n % num_classes, data, {"source": f"{key}.{ext}"}, ext)

    return write_shard_set(dest, (sample(n) for n in range(sum(shard_sizes))), sizes=shard_sizes,
                           classes=[f"c{i}" for i in range(num_classes)], full_manifest=False)


def write_tiny_shards(dest: Path, sizes: list[int], *, classes: int = 4, image_px: int = 40, seed: int = 0,
                      prefix: str = "train") -> Path:
    """The train tests' set: one tar per entry of ``sizes``; sample k has key s{k:06d}, label k % classes, a
    :func:`noise_jpeg` (``seed``) and meta source/class/width/height; classes class_0..; created_by "tests"."""
    import numpy as np

    rng = np.random.default_rng(seed)

    def sample(k: int) -> Sample:
        key, label = f"s{k:06d}", k % classes
        meta = {"source": f"class_{label}/{key}.jpg", "class": f"class_{label}", "width": image_px,
                "height": image_px}
        return Sample(key, label, noise_jpeg(rng, label, image_px), meta)

    return write_shard_set(dest, (sample(k) for k in range(sum(sizes))), sizes=sizes, prefix=prefix,
                           classes=[f"class_{c}" for c in range(classes)], created_by="tests")


def make_shards(dest: Path, *, classes: int = 3, per_class: int = 16, size: tuple[int, int] = (48, 40),
                num_shards: int = 4) -> Path:
    """The tune tests' set: ``per_class`` :func:`gradient_jpeg` s per class keyed c{c}_{i:04d}, ordered by the md5
    of the key and dealt over ``num_shards`` shards; meta source/class/width/height; classes class_0..."""
    w, h = size
    samples = [Sample(f"c{c}_{i:04d}", c, gradient_jpeg(size, 40 * c, 17 * i),
                      {"source": f"class_{c}/c{c}_{i:04d}.jpg", "class": f"class_{c}", "width": w, "height": h})
               for c in range(classes) for i in range(per_class)]
    return write_shard_set(dest, samples, deal=num_shards, order=md5_of_key,
                           classes=[f"class_{c}" for c in range(classes)])


# -------------------------------------------------------------------------------------- reading the sets back


def sizes_as_found(shards: Path) -> None:
    """Record each shard's size as it is now in the set's manifest: a shard damaged (or crafted) with a manifest
    that matches its size, so that the reader's own checks, not the loader's size check, must find it."""
    path = shards / "manifest.json"
    d = json.loads(path.read_text())
    for s in d["shards"]:
        s["bytes"] = (shards / s["name"]).stat().st_size
    d["total_bytes"] = sum(s["bytes"] for s in d["shards"])
    path.write_text(json.dumps(d))


def cfg(**kw) -> LoaderConfig:
    """A small in-process LoaderConfig for reading these sets (batch 4, no workers, 16 px, PIL decode)."""
    from gpufeed.config import LoaderConfig

    base = dict(batch_size=4, num_workers=0, image_size=16, shuffle_buffer=8, decode="pil", persistent_workers=False,
                prefetch_factor=2, pin_memory=False)
    base.update(kw)
    return LoaderConfig(**base)
