"""``gpufeed synth DEST``: a small ImageNet-like ImageFolder made offline from real photographs.

The content comes from scikit-image's bundled sample photos (the optional extra ``gpufeed[synth]``):
each image is a random crop of one photo, scaled to an ImageNet-like size, maybe flipped,
colour-shifted, given fine texture and sensor grain (JPEGs of smooth, upscaled photos are far
smaller than real ones), and saved as a JPEG of quality 75-95.

Layout: ``DEST/n0000/n0000_00000000.jpg`` ... ; image ``i`` belongs to class ``i % classes``. Each
class draws from one source photo with its own colour cast, so the classes are (weakly) learnable.

Determinism: image ``i`` is made from its own random stream, seeded by ``(seed, i)``, so the same
seed gives byte-identical files whatever the worker count (with the same Pillow / libjpeg build).
"""

from __future__ import annotations

import math
import os
import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufeed.config import SynthConfig
from gpufeed.core.errors import ConfigError, DataError

# Colour photographs bundled with scikit-image (no download needed).
_COLOUR_SOURCES = (
    "astronaut", "coffee", "chelsea", "rocket", "immunohistochemistry",
    "hubble_deep_field", "retina", "stereo_motorcycle",
)
# Grayscale photographs, tinted into colour.
_GRAY_SOURCES = ("camera", "coins", "clock", "moon")
# Grayscale textures: their fine detail is added to every image.
_TEXTURES = ("gravel", "grass")

# Size mix (fractions of images).
_P_TINY = 0.02          # long side 32-120 px
_P_LARGE = 0.03         # long side 1000-2000 px
_P_PORTRAIT = 0.22      # height > width
_P_GRAY = 0.02          # stored as 1-channel grayscale JPEG
_P_CMYK = 0.003         # stored as CMYK JPEG (ImageNet has a few)
# Detail levels, tuned so the mean file lands near 115 KB like ImageNet's (JPEGs of smooth, upscaled
# crops are far smaller than real photos): texture amplitude (grey levels), texture scale, luminance
# grain sigma, chroma grain as a fraction of it, JPEG quality ~ 75 + 20 * Beta(a, b), share of 4:4:4
# chroma, unsharp-mask strength (%).
_TEXTURE_AMP = (8.0, 18.0)
_TEXTURE_SCALE = (0.6, 1.2)
_GRAIN_SIGMA = (3.0, 6.0)
_CHROMA_GRAIN = 0.3
_QUALITY_BETA = (2.0, 1.0)
_P_444 = 0.2
_SHARPEN_PERCENT = (100, 300)

_CLASS_RE = re.compile(r"^n\d{4,}$")
_FILE_RE = re.compile(r"^\.?n\d{4,}_\d{8}\.jpg(\.tmp)?$")  # our files, and temporaries left by an interrupt


@dataclass(frozen=True)
class SynthReport:
    """What ``gpufeed synth`` wrote."""

    dest: str
    num_images: int
    num_classes: int
    seed: int
    total_bytes: int
    mean_bytes: float
    mean_width: float
    mean_height: float
    num_portrait: int
    """Images taller than wide."""
    num_large: int
    """Images with a side over 1000 px."""
    num_tiny: int
    """Images with a side under 128 px."""
    num_grayscale: int
    num_cmyk: int
    workers: int
    elapsed_s: float


@dataclass(frozen=True)
class _ImageStat:
    index: int
    bytes: int
    width: int
    height: int
    mode: str


def synthesize(cfg: SynthConfig) -> SynthReport:
    """Write ``cfg.images`` JPEGs in ``cfg.classes`` class folders under ``cfg.dest``."""
    from gpufeed.core.system import usable_cpus

    if not cfg.dest:
        raise ConfigError("synth needs a destination folder (DEST)")
    _require_skimage()
    dest = Path(cfg.dest)
    _prepare_dest(dest, cfg.overwrite)
    for c in range(cfg.classes):
        (dest / _class_name(c)).mkdir(parents=True, exist_ok=True)

    workers = cfg.workers if cfg.workers is not None else usable_cpus()
    workers = max(1, min(workers, cfg.images))
    chunk = max(1, min(32, math.ceil(cfg.images / (4 * workers))))  # any split gives the same files
    t0 = time.perf_counter()
    jobs = [(cfg.seed, cfg.classes, str(dest), lo, min(lo + chunk, cfg.images))
            for lo in range(0, cfg.images, chunk)]
    stats: list[_ImageStat] = []
    if workers == 1:
        for job in jobs:
            stats.extend(_render_range(job))
    else:
        from gpufeed.core.system import process_pool

        with process_pool(workers, initializer=_load_sources) as pool:
            for part in pool.map(_render_range, jobs):
                stats.extend(part)
    elapsed = time.perf_counter() - t0

    n = len(stats)
    total = sum(s.bytes for s in stats)
    return SynthReport(
        dest=str(dest),
        num_images=n,
        num_classes=cfg.classes,
        seed=cfg.seed,
        total_bytes=total,
        mean_bytes=total / n if n else 0.0,
        mean_width=sum(s.width for s in stats) / n if n else 0.0,
        mean_height=sum(s.height for s in stats) / n if n else 0.0,
        num_portrait=sum(s.height > s.width for s in stats),
        num_large=sum(max(s.width, s.height) > 1000 for s in stats),
        num_tiny=sum(min(s.width, s.height) < 128 for s in stats),
        num_grayscale=sum(s.mode == "L" for s in stats),
        num_cmyk=sum(s.mode == "CMYK" for s in stats),
        workers=workers,
        elapsed_s=elapsed,
    )


def render_synth(report: SynthReport) -> str:
    """One human paragraph for the CLI."""
    r = report
    return (
        f"wrote {r.num_images} images in {r.num_classes} classes to {r.dest} "
        f"({r.total_bytes / 1e6:.1f} MB, mean {r.mean_bytes / 1e3:.0f} KB, "
        f"mean {r.mean_width:.0f}x{r.mean_height:.0f} px; {r.num_portrait} portrait, {r.num_large} over 1000 px, "
        f"{r.num_tiny} tiny, {r.num_grayscale} grayscale, {r.num_cmyk} CMYK) "
        f"in {r.elapsed_s:.1f} s with {r.workers} worker(s), seed {r.seed}"
    )


# --------------------------------------------------------------------------- internals


def _require_skimage() -> None:
    try:
        import skimage.data  # noqa: F401
    except ImportError:
        raise ConfigError(
            "gpufeed synth needs scikit-image for its bundled sample photos: pip install 'gpufeed[synth]'"
        ) from None


def _class_name(c: int) -> str:
    return f"n{c:04d}"


def _prepare_dest(dest: Path, overwrite: bool) -> None:
    if dest.exists() and not dest.is_dir():
        raise DataError(f"DEST {dest} exists and is not a folder")
    if not dest.exists():
        dest.mkdir(parents=True)
        return
    entries = [e for e in dest.iterdir()]
    if not entries:
        return
    if not overwrite:
        raise DataError(f"DEST {dest} is not empty; pass --overwrite to replace an earlier synth folder there")
    foreign = [e.name for e in entries if not (e.is_dir() and not e.is_symlink() and _CLASS_RE.match(e.name))]
    for e in entries:
        if e.is_dir() and not e.is_symlink() and _CLASS_RE.match(e.name):
            foreign += [f"{e.name}/{f.name}" for f in e.iterdir() if not _FILE_RE.match(f.name)]
    if foreign:
        raise DataError(
            f"DEST {dest} holds files gpufeed synth did not write (e.g. {sorted(foreign)[:3]}); "
            "refusing to overwrite it, choose an empty folder"
        )
    for e in entries:
        shutil.rmtree(e)


_SOURCES: list[Any] | None = None
_TEXTURE_HP: list[Any] | None = None


def _load_sources() -> None:
    """Load the photos once per process: RGB uint8 arrays, plus high-passed float32 textures."""
    global _SOURCES, _TEXTURE_HP
    if _SOURCES is not None:
        return
    import numpy as np
    import skimage.data as data
    from PIL import Image, ImageFilter

    sources = []
    for name in _COLOUR_SOURCES:
        arr = getattr(data, name)()
        if isinstance(arr, tuple):  # stereo_motorcycle -> (left, right, disparity)
            arr = arr[0]
        sources.append(np.ascontiguousarray(arr[..., :3], dtype=np.uint8))
    tints = np.array([[1.0, 0.85, 0.65], [0.75, 0.9, 1.05], [0.95, 1.0, 0.8], [1.05, 0.95, 1.0]])
    for name, tint in zip(_GRAY_SOURCES, tints):
        g = getattr(data, name)().astype(np.float32)
        sources.append(np.clip(g[..., None] * tint[None, None, :], 0, 255).astype(np.uint8))
    textures = []
    for name in _TEXTURES:
        img = Image.fromarray(getattr(data, name)())
        blur = np.asarray(img.filter(ImageFilter.GaussianBlur(3)), dtype=np.float32)
        hp = np.asarray(img, dtype=np.float32) - blur
        textures.append(hp / max(float(hp.std()), 1e-6))  # unit variance fine detail
    _SOURCES, _TEXTURE_HP = sources, textures


def _render_range(job: tuple[int, int, str, int, int]) -> list[_ImageStat]:
    seed, classes, dest, lo, hi = job
    _load_sources()
    return [_render_one(seed, classes, Path(dest), i) for i in range(lo, hi)]


def _image_size(rng: Any) -> tuple[int, int]:
    u = rng.random()
    if u < _P_TINY:
        long_side = int(rng.integers(32, 121))
    elif u < _P_TINY + _P_LARGE:
        long_side = int(rng.integers(1001, 2001))
    elif u < 0.72:
        long_side = 500  # the most common ImageNet size
    else:
        long_side = int(rng.integers(300, 801))
    aspect = float(rng.choice([4 / 3, 4 / 3, 4 / 3, 3 / 2, 3 / 2, 1.0, 16 / 9, 5 / 4]))
    aspect *= float(rng.uniform(0.97, 1.03))
    short_side = max(16, int(round(long_side / aspect)))
    if rng.random() < _P_PORTRAIT:
        return short_side, long_side
    return long_side, short_side


def _render_one(seed: int, classes: int, dest: Path, i: int) -> _ImageStat:
    import numpy as np
    from PIL import Image, ImageFilter

    assert _SOURCES is not None and _TEXTURE_HP is not None
    c = i % classes
    rng = np.random.default_rng([seed, i])
    crng = np.random.default_rng([seed, 1_000_003, c])  # the class' own colour cast
    w, h = _image_size(rng)

    # Crop: a random window of the class' photo with the output's aspect ratio.
    src = _SOURCES[c % len(_SOURCES)]
    sh, sw = src.shape[:2]
    frac = float(rng.uniform(0.35, 1.0))
    cw = min(sw, max(8, int(round(math.sqrt(frac * sw * sh * w / h)))))
    ch = min(sh, max(8, int(round(cw * h / w))))
    cw = min(sw, max(8, int(round(ch * w / h))))
    x0 = int(rng.integers(0, sw - cw + 1))
    y0 = int(rng.integers(0, sh - ch + 1))
    img = Image.fromarray(src[y0:y0 + ch, x0:x0 + cw])
    resample = Image.Resampling.BICUBIC if (w * h) > (cw * ch) else Image.Resampling.LANCZOS
    img = img.resize((w, h), resample)
    if rng.random() < 0.5:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)

    # Colour: the class' channel mix and cast, then per-image brightness, contrast and saturation.
    arr = np.asarray(img, dtype=np.float32)
    mix = np.eye(3) * (1 - 0.35) + 0.35 * crng.dirichlet(np.ones(3), size=3)
    mix = mix * crng.uniform(0.85, 1.15, size=(3, 1))
    arr = arr @ mix.T.astype(np.float32)
    gray = arr.mean(axis=2, keepdims=True)
    sat = float(rng.uniform(0.7, 1.3))
    contrast = float(rng.uniform(0.8, 1.2))
    bright = float(rng.uniform(-20, 20))
    arr = (gray + (arr - gray) * sat - 128.0) * contrast + 128.0 + bright
    arr += rng.uniform(-8, 8, size=3).astype(np.float32)

    # Detail: fine texture (scaled, wrapped crop of a high-passed texture photo) and sensor grain.
    tex = _TEXTURE_HP[int(rng.integers(len(_TEXTURE_HP)))]
    scale = float(rng.uniform(*_TEXTURE_SCALE))
    tw, th = max(4, int(round(w / scale))), max(4, int(round(h / scale)))
    ty = (int(rng.integers(tex.shape[0])) + np.arange(th)) % tex.shape[0]
    tx = (int(rng.integers(tex.shape[1])) + np.arange(tw)) % tex.shape[1]
    patch = Image.fromarray(tex[np.ix_(ty, tx)], mode="F").resize((w, h), Image.Resampling.BILINEAR)
    amp = float(rng.uniform(*_TEXTURE_AMP))
    shade = np.clip(arr.mean(axis=2, keepdims=True) * (1 / 128.0), 0.25, 1.5)  # detail follows the light
    arr += (amp * shade) * np.asarray(patch, dtype=np.float32)[..., None]
    # Camera-style sharpening: upscaled crops are softer than real photos.
    sharp = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "RGB")
    sharp = sharp.filter(ImageFilter.UnsharpMask(radius=float(rng.uniform(1.0, 2.5)),
                                                 percent=int(rng.integers(*_SHARPEN_PERCENT)), threshold=0))
    arr = np.asarray(sharp, dtype=np.float32)
    sigma = float(rng.uniform(*_GRAIN_SIGMA))  # luminance grain survives chroma subsampling, as in photos
    arr += rng.standard_normal((h, w, 1), dtype=np.float32) * sigma
    arr += rng.standard_normal((h, w, 3), dtype=np.float32) * (sigma * _CHROMA_GRAIN)
    out = Image.fromarray(np.clip(arr + 0.5, 0, 255).astype(np.uint8), "RGB")

    u = rng.random()
    if u < _P_GRAY:
        out = out.convert("L")
    elif u < _P_GRAY + _P_CMYK:
        out = out.convert("CMYK")
    quality = 75 + int(round(20 * float(rng.beta(*_QUALITY_BETA))))  # skewed to 85-95, as on photo sites
    subsampling = "4:4:4" if rng.random() < _P_444 else "4:2:0"
    name = dest / _class_name(c) / f"{_class_name(c)}_{i:08d}.jpg"
    tmp = name.with_name(f".{name.name}.tmp")
    out.save(tmp, "JPEG", quality=quality, subsampling=subsampling)
    os.replace(tmp, name)
    return _ImageStat(index=i, bytes=name.stat().st_size, width=w, height=h, mode=out.mode)

