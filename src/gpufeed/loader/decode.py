"""Per-sample CPU work of the loader: decode, crop, resize, flip, all in uint8.

Crop parameters are drawn from the stored image size (read from the header, before decoding), exactly
as torchvision defines them, then the crop region alone is resized to ``size x size``:

- train: ``RandomResizedCrop(size, scale=(0.08, 1), ratio=(3/4, 4/3))`` (same sampling as
  ``torchvision.transforms.RandomResizedCrop.get_params``) + ``RandomHorizontalFlip()``;
- eval: ``Resize(int(size / crop_ratio))`` (shorter side) + ``CenterCrop(size)``, mapped back to a box
  in the stored image so the crop happens before the resize.

The resize is torch's uint8 antialiased bilinear kernel (``resize = "torch"``, the default: SIMD,
channels-last, 4-5x faster than PIL's and within 1 grey level of it) on the contiguous crop region for
train, and torchvision's exact resize-whole-then-centre-crop for eval; ``resize = "pil"`` uses PIL's
``resize(..., box=...)`` over the crop box instead (same filter scale and centre as torchvision).
Reduced-size decodes (PIL ``draft``, simplejpeg ``min_width``/``min_height``) pick a DCT scale that keeps
the crop region at least ``size`` pixels on both sides, so no resolution is lost.

``decode = "roi"`` decodes only the crop's region (libjpeg-turbo's crop and skip of scanlines): through gpufeed's
own C module over Pillow's libjpeg-turbo (:mod:`gpufeed.loader.jpegroi`, built at install), else NVIDIA
nvImageCodec's CPU backend (``pip install 'gpufeed[roi]'``). The same pixels as the simplejpeg path (a whole
decode, at the same DCT scale, cropped afterwards) for less decode work; eval crops, crops of most of the image and
anything the region decoder refuses take the simplejpeg path.

Every path reads the stored width x height from the image header first and refuses an image over
``max_pixels`` (:class:`ImageTooLarge`) before any pixel is decoded: a few KB of PNG can declare
13,000 x 13,000 pixels and cost gigabytes once decoded.

Every path returns 3-channel RGB (CMYK, gray, palette and alpha are converted as PIL's ``convert("RGB")``
does, which is what torchvision's ImageFolder loader does). Non-JPEG images always go through PIL.
"""

from __future__ import annotations

import math
import random
import threading
import warnings
from dataclasses import dataclass
from typing import Literal

import numpy as np
from PIL import Image

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import ConfigError
from gpufeed.loader import jpegroi
from gpufeed.shardset.images import (DEVICE_SOF, HIGH_DEPTH_MODES, JpegFrame, check_jpeg, jpeg_frame, open_image,
                                     to_8bit_gray)

DecodeMethod = Literal["pil", "pil-draft", "simplejpeg", "roi", "gpu"]
JPEG_EXTENSIONS = ("jpg", "jpeg")

DEFAULT_MAX_PIXELS = LoaderConfig.max_pixels
"""Decompression-bomb limit (stored width x height) when the caller passes none: ``LoaderConfig``'s default."""

_BILINEAR = Image.Resampling.BILINEAR
_FLIP = Image.Transpose.FLIP_LEFT_RIGHT


@dataclass(frozen=True)
class Crop:
    """A crop of the stored image: ``(left, top, right, bottom)`` in stored pixels, plus a flip.

    Eval crops also carry torchvision's exact recipe: resize the whole image to ``resize`` (w, h), then
    take ``size x size`` at ``offset`` (left, top); ``box`` is that region mapped back to stored pixels.
    """

    box: tuple[float, float, float, float]
    flip: bool = False
    resize: tuple[int, int] | None = None
    offset: tuple[int, int] | None = None

    @property
    def width(self) -> float:
        return self.box[2] - self.box[0]

    @property
    def height(self) -> float:
        return self.box[3] - self.box[1]


# --------------------------------------------------------------------------- crop parameters


def random_resized_crop_params(width: int, height: int, rng: random.Random,
                               scale: tuple[float, float] = (0.08, 1.0),
                               ratio: tuple[float, float] = (3 / 4, 4 / 3)) -> tuple[int, int, int, int]:
    """``(top, left, h, w)`` as ``torchvision.transforms.RandomResizedCrop.get_params`` draws them.

    Same algorithm (10 attempts of area/log-ratio sampling, then the centre-crop fallback clamped to
    ``ratio``); the random numbers come from ``rng`` instead of torch's global generator.
    """
    area = height * width
    log_ratio = (math.log(ratio[0]), math.log(ratio[1]))
    for _ in range(10):
        target_area = area * rng.uniform(scale[0], scale[1])
        aspect_ratio = math.exp(rng.uniform(log_ratio[0], log_ratio[1]))
        w = int(round(math.sqrt(target_area * aspect_ratio)))
        h = int(round(math.sqrt(target_area / aspect_ratio)))
        if 0 < w <= width and 0 < h <= height:
            i = rng.randint(0, height - h)
            j = rng.randint(0, width - w)
            return i, j, h, w
    # Fallback to central crop
    in_ratio = float(width) / float(height)
    if in_ratio < min(ratio):
        w = width
        h = int(round(w / min(ratio)))
    elif in_ratio > max(ratio):
        h = height
        w = int(round(h * max(ratio)))
    else:  # whole image
        w = width
        h = height
    i = (height - h) // 2
    j = (width - w) // 2
    return i, j, h, w


def train_crop(width: int, height: int, rng: random.Random) -> Crop:
    """RandomResizedCrop(scale=(0.08, 1), ratio=(3/4, 4/3)) + horizontal flip with p=0.5."""
    i, j, h, w = random_resized_crop_params(width, height, rng)
    return Crop((j, i, j + w, i + h), flip=rng.random() < 0.5)


def eval_crop(width: int, height: int, size: int, crop_ratio: float = 0.875) -> Crop:
    """``Resize(int(size / crop_ratio))`` on the shorter side then ``CenterCrop(size)``, as a box in the stored image.

    Output sizes and offsets follow torchvision's ``_compute_resized_output_size`` and ``center_crop``.
    """
    resize = int(size / crop_ratio)
    short, long = (width, height) if width <= height else (height, width)
    new_short, new_long = resize, int(resize * long / short)
    rw, rh = (new_short, new_long) if width <= height else (new_long, new_short)
    if rw < size or rh < size:  # torchvision pads here; crop_ratio <= 1 makes it impossible
        raise ConfigError(f"eval resize {resize} is smaller than image_size {size} (crop_ratio must be <= 1)")
    top = int(round((rh - size) / 2.0))
    left = int(round((rw - size) / 2.0))
    sx, sy = width / rw, height / rh
    return Crop((left * sx, top * sy, (left + size) * sx, (top + size) * sy), flip=False, resize=(rw, rh),
                offset=(left, top))


def draft_scale(crop: Crop, size: int) -> int:
    """Largest JPEG DCT scale (1, 2, 4, 8) that keeps the crop region >= ``size`` pixels on both sides."""
    for s in (8, 4, 2):
        if crop.width / s >= size and crop.height / s >= size:
            return s
    return 1


# --------------------------------------------------------------------------- decoding


class ImageTooLarge(ValueError):
    """An image whose header declares more pixels than ``max_pixels`` (refused before decoding)."""


def check_pixels(width: int, height: int, max_pixels: int) -> None:
    """Raise :class:`ImageTooLarge` when ``width x height`` (from the header) exceeds ``max_pixels``."""
    if width * height > max_pixels:
        raise ImageTooLarge(f"image is {width} x {height} = {width * height} pixels, over max_pixels = {max_pixels}")


def image_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from the header only (no pixel decode)."""
    with open_image(data) as img:
        return img.size


def check_header(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """What can be checked without decoding pixels: PIL reads the header and the size is within ``max_pixels``.

    The loader's resume applies this to the samples it passes over; an image that passes may still fail to
    decode (its pixel data is only read by a decode).
    """
    check_pixels(*image_size(data), max_pixels)


def _finish(img: Image.Image, crop: Crop, size: int, out: np.ndarray, scale_x: float = 1.0,
            scale_y: float = 1.0, resize: str = "torch") -> None:
    """Crop + resize (+ flip) ``img`` into ``out`` [S, S, 3]; ``scale`` maps stored pixels to ``img`` pixels."""
    if img.mode in HIGH_DEPTH_MODES:  # 16/32-bit grey: scaled to 8 bits as `gpufeed shard` does (convert clips it)
        img = to_8bit_gray(img)
    if img.mode != "RGB" and (resize == "torch" or img.mode != "L"):
        img = img.convert("RGB")  # as ImageFolder: palette, alpha, CMYK -> RGB before any resize
    if resize == "torch":
        resize_array_into(np.asarray(img), crop, size, out, scale_x, scale_y)
        return
    l, t, r, b = crop.box
    box = (l * scale_x, t * scale_y, r * scale_x, b * scale_y)
    img = img.resize((size, size), _BILINEAR, box=box)
    if crop.flip:
        img = img.transpose(_FLIP)
    if img.mode == "L":
        out[...] = np.asarray(img)[:, :, None]
    else:
        out[...] = np.asarray(img)


def resize_array_into(arr: np.ndarray, crop: Crop, size: int, out: np.ndarray, scale_x: float = 1.0,
                      scale_y: float = 1.0) -> None:
    """Crop + antialiased bilinear resize (+ flip) of an RGB uint8 [H, W, 3] array into ``out``, in uint8.

    Uses torch's uint8 antialiased bilinear kernel (SIMD, channels-last; same filter as PIL's BILINEAR,
    within 1 grey level) on the crop region made contiguous: several times faster than PIL's resize.
    Train crops are integer boxes (as torchvision's RandomResizedCrop); on a reduced-size decode the box
    is mapped and rounded to whole decoded pixels. Eval crops follow torchvision exactly: resize the whole
    image to ``crop.resize``, then take the centre ``size x size``.
    """
    import torch
    import torch.nn.functional as F

    if arr.flags.writeable:
        x = torch.from_numpy(arr)
    else:  # np.asarray(PIL image) is read-only; the resize only reads it, so torch's warning about that is noise
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="The given NumPy array is not writable", category=UserWarning)
            x = torch.from_numpy(arr)
    if crop.resize is not None:  # eval: torchvision's resize of the whole image, then its centre crop
        rw, rh = crop.resize
        left, top = crop.offset or (0, 0)
        y = F.interpolate(_channels_last(x), size=(rh, rw), mode="bilinear", antialias=True, align_corners=False)
        torch.from_numpy(out).copy_(y[0, :, top: top + size, left: left + size].permute(1, 2, 0))
        return
    dh, dw = arr.shape[:2]
    l, t, r, b = pixel_box(crop.box, dw, dh, scale_x, scale_y)
    region = x[t:b, l:r]
    if crop.flip:  # flipped in the copy the kernel needs anyway: the kernel is mirror-symmetric, so the same pixels
        region = region.flip(1)
    src = _channels_last(region)
    if not _resize_into(src, size, out):
        y = F.interpolate(src, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
        torch.from_numpy(out).copy_(y[0].permute(1, 2, 0))


def pixel_box(box: tuple[float, float, float, float], dw: int, dh: int, scale_x: float = 1.0,
              scale_y: float = 1.0) -> tuple[int, int, int, int]:
    """A crop box of stored pixels as whole pixels of a ``dw`` x ``dh`` decode (``scale``: decoded pixels per stored
    pixel, rounded there), at least one pixel and inside the decode."""
    l, t, r, b = box
    if scale_x != 1.0 or scale_y != 1.0:
        l, r = int(round(l * scale_x)), int(round(r * scale_x))
        t, b = int(round(t * scale_y)), int(round(b * scale_y))
    l, t = min(max(int(l), 0), dw - 1), min(max(int(t), 0), dh - 1)
    r, b = min(max(int(r), l + 1), dw), min(max(int(b), t + 1), dh)
    return l, t, r, b


def _channels_last(hwc):
    """An [H, W, 3] tensor as the [1, 3, H, W] channels-last contiguous input torch's SIMD uint8 kernel reads (a copy
    only when the view is not already that: a crop's rows are strided)."""
    import torch

    src = hwc.permute(2, 0, 1).unsqueeze(0)
    if not src.is_contiguous(memory_format=torch.channels_last):
        src = src.contiguous(memory_format=torch.channels_last)
    return src


_AA_OUT: list = []
"""``[kernel]`` once :func:`_resize_into` found torch's antialiased bilinear kernel with an ``out=`` argument,
``[None]`` when this torch has none (then the caller resizes through ``F.interpolate`` and copies)."""


def _resize_into(src, size: int, out: np.ndarray) -> bool:
    """Antialiased bilinear resize of ``src`` (uint8 [1, 3, h, w], channels-last) straight into ``out`` [S, S, 3]
    (the batch row: no intermediate tensor, no copy), with the kernel ``F.interpolate(..., antialias=True)`` runs.
    False when this torch does not expose that kernel with ``out=`` (a private name, so it is looked up once)."""
    import torch

    if not _AA_OUT:
        kernel = getattr(getattr(torch._C, "_nn", None), "_upsample_bilinear2d_aa", None)
        try:  # probe it once on a tiny image: a torch where the private kernel changed takes the public path
            probe = np.empty((2, 2, 3), np.uint8)
            kernel(torch.zeros((1, 3, 4, 4), dtype=torch.uint8).contiguous(memory_format=torch.channels_last), (2, 2),
                   False, out=torch.from_numpy(probe).permute(2, 0, 1).unsqueeze(0))
        except Exception:  # noqa: BLE001 - missing or another signature: the public path
            kernel = None
        _AA_OUT.append(kernel)
    kernel = _AA_OUT[0]
    if kernel is None or not out.flags.c_contiguous:
        return False
    kernel(src, (size, size), False, out=torch.from_numpy(out).permute(2, 0, 1).unsqueeze(0))
    return True


def decode_pil(data: bytes, crop_fn, size: int, out: np.ndarray, *, draft: bool = False,
               resize: str = "torch", max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """PIL decode (full, or reduced-size DCT with ``draft`` for JPEG), crop, resize into ``out``.

    ``Image.open`` reads only the header: the size is checked against ``max_pixels`` before ``load``.
    """
    img = open_image(data)
    w, h = img.size
    check_pixels(w, h, max_pixels)
    crop = crop_fn(w, h)
    sx = sy = 1.0
    if draft and img.format == "JPEG":
        s = draft_scale(crop, size)
        if s > 1:
            img.draft("RGB", (max(1, w // s), max(1, h // s)))
            sx = sy = 1.0 / s  # libjpeg's scaled pixel i covers stored pixels [i*s, (i+1)*s)
    img.load()
    _finish(img, crop, size, out, sx, sy, resize)


_simplejpeg = None


def _import_simplejpeg():
    global _simplejpeg
    if _simplejpeg is None:
        try:
            import simplejpeg
        except ImportError:
            raise ConfigError(
                "decode = 'simplejpeg' needs the simplejpeg package (libjpeg-turbo): "
                "pip install simplejpeg, or choose decode = 'pil-draft'"
            ) from None
        _simplejpeg = simplejpeg
    return _simplejpeg


def decode_simplejpeg(data: bytes, crop_fn, size: int, out: np.ndarray, *, resize: str = "torch",
                      max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """libjpeg-turbo decode at 1/2, 1/4 or 1/8 scale when the crop stays >= ``size`` there, into this thread's reused
    buffer; CMYK goes to PIL.

    The header's size is checked against ``max_pixels`` before decoding (by PIL when TurboJPEG cannot read it).
    """
    sj = _import_simplejpeg()
    try:
        h, w, colorspace, _ = sj.decode_jpeg_header(data)
    except (ValueError, KeyError):  # e.g. CMYK with unusual sampling factors (TurboJPEG cannot say), or a sampling
        colorspace = "unknown"       # simplejpeg has no name for (4:4:1 raises KeyError 6): PIL can (or raises)
    if colorspace not in ("YCbCr", "Gray", "RGB"):  # CMYK / YCCK: libjpeg-turbo cannot output RGB
        decode_pil(data, crop_fn, size, out, draft=True, resize=resize, max_pixels=max_pixels)
        return
    check_pixels(w, h, max_pixels)
    check_jpeg(data)
    crop = crop_fn(w, h)
    scale = draft_scale(crop, size)  # 1/2, 1/4, 1/8 when the crop keeps >= size pixels; other M/8 scales gain nothing
    min_w, min_h = -(-w // scale), -(-h // scale)  # libjpeg's 1/scale output size: the M/8 scale picked is 1/scale
    dh, dw = (h, w) if scale == 1 else sj.decode_jpeg_header(data, min_height=min_h, min_width=min_w)[:2]
    arr = sj.decode_jpeg(data, colorspace="RGB", min_height=min_h, min_width=min_w, buffer=_decode_buffer(dh * dw * 3))
    dh, dw = arr.shape[:2]
    if resize == "torch":
        resize_array_into(arr, crop, size, out, dw / w, dh / h)
    else:
        _finish(Image.fromarray(arr), crop, size, out, dw / w, dh / h, resize)


def _roi_decoder():
    """This thread's nvImageCodec decoder (CPU backend, one thread of its own: the loader's workers and decode
    threads are the parallelism), made at first use. nvImageCodec prints a line to stderr for every GPU codec it
    cannot load when imported; on a CPU decode those lines say nothing, so the import runs with stderr muted."""
    dec = getattr(_scratch, "roi", None)
    if dec is None:
        nv = _import_nvimgcodec()
        dec = _scratch.roi = nv.Decoder(device_id=nv.NVIMGCODEC_DEVICE_CPU_ONLY, max_num_cpu_threads=1,
                                        backends=[nv.Backend(nv.BackendKind.CPU_ONLY)])
    return dec


_nvimgcodec = None


def require_roi() -> None:
    """Raise :class:`ConfigError` (saying what to install) unless ``decode = "roi"`` can run here."""
    if jpegroi.region_decoder() is None:
        _import_nvimgcodec()


def roi_available() -> bool:
    """Whether ``decode = "roi"`` can run here: gpufeed's region decoder loaded, or nvImageCodec importable."""
    if jpegroi.region_decoder() is not None:
        return True
    try:
        _import_nvimgcodec()
    except ConfigError:
        return False
    return True


def _import_nvimgcodec():
    global _nvimgcodec
    if _nvimgcodec is None:
        import importlib.util
        import os
        import sys

        try:
            found = importlib.util.find_spec("nvidia.nvimgcodec") is not None
        except ImportError:  # no nvidia package at all
            found = False
        if not found:
            raise ConfigError(f"decode = 'roi' needs gpufeed's region decoder ({jpegroi.unavailable_reason()}) or "
                              "NVIDIA nvImageCodec's CPU backend: reinstall gpufeed where a C compiler is found, or "
                              "pip install 'gpufeed[roi]', or choose decode = 'simplejpeg'")
        # nvImageCodec's own log lines (one per image it fails on, before gpufeed says why in one sentence) are off
        # unless the user set a level; read when the module loads
        os.environ.setdefault("PYNVIMGCODEC_VERBOSITY", "0")
        with _LOAD_LOCK:
            sys.stderr.flush()
            saved = os.dup(2)
            try:
                with open(os.devnull, "wb") as null:
                    os.dup2(null.fileno(), 2)
                from nvidia import nvimgcodec
            finally:
                os.dup2(saved, 2)
                os.close(saved)
        _nvimgcodec = nvimgcodec
    return _nvimgcodec


_LOAD_LOCK = threading.Lock()

ROI_MAX_AREA = 0.8
"""decode = "roi" with gpufeed's region decoder decodes a crop's region only when the crop covers at most this
fraction of the image; a larger crop takes the simplejpeg path. Measured by ``benchmarks/bench_sample_cost.py``
(its "roi by crop area": 500 ImageNet-like images per set, full-size and 320-px shards; median per fifth of the
area of region decode over simplejpeg's whole decode, the better of 3 each): 0.61-0.68 under 20% of the area,
0.71-0.80 at 20-40%, 0.84-0.91 at 40-60%, 0.91-0.92 at 60-80%, 0.95-1.00 over 80% (an earlier run: 0.98-0.99 at
60-80%, 1.03-1.06 over 80%): above 80% the two are even."""

ROI_MAX_AREA_NVIMGCODEC = 0.5
"""The same limit for nvImageCodec's region decode (used where gpufeed's did not build). Measured the same way:
0.62-0.66 under 20% of the area, 0.82-0.84 at 20-40%, 0.92-1.01 at 40-60%, 1.11-1.13 at 60-80%, 1.32-1.37 over 80%
(nvImageCodec's libjpeg-turbo decodes a whole image ~20-30% slower than simplejpeg's, so a region pays only when it
skips enough)."""


EOI_TAIL = 4096
"""decode = "roi" decodes a region only when a JPEG end-of-image marker (FF D9) lies in the data's last this many
bytes; other files (truncated, or with a longer trailer after the image) take the whole-image decode."""


def ends_like_jpeg(data: bytes, frame: JpegFrame | None = None) -> bool:
    """Whether ``data`` holds an end-of-image marker in its last :data:`EOI_TAIL` bytes, after its first scan. A
    region decode never reads the rows below its crop, so a file cut short there would decode without error for
    some crops and not for others; checking that the file ends keeps a truncated JPEG refused whatever the crop,
    as the other paths do. The marker must follow the first scan: an Exif thumbnail's own end marker comes before
    it, in the header. (In entropy-coded data FF is always followed by 00 or a restart marker, so FF D9 there is
    the end; a crafted file can still put one in a table segment between two scans of a progressive image.)
    ``frame``: the header as :func:`check_jpeg` already read it (else it is read here)."""
    end = data.rfind(b"\xff\xd9", max(0, len(data) - EOI_TAIL))
    if end < 0:
        return False
    if frame is None:
        read = jpeg_frame(data)
        frame = read if isinstance(read, JpegFrame) else None
    return frame is not None and end > frame.scan


def decode_roi(data: bytes, crop_fn, size: int, out: np.ndarray, *, resize: str = "torch",
               max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Decode only the train crop's region of a JPEG, then resize it as the simplejpeg path does. The same pixels
    as decoding the whole image and cropping. The region decoder is gpufeed's own (:mod:`gpufeed.loader.jpegroi`:
    libjpeg-turbo's scanline crop and skip, rows below the crop never read) where it built, else nvImageCodec's CPU
    backend. A crop the simplejpeg path decodes at a DCT scale (1/2, 1/4, 1/8) is region-decoded at that scale by
    gpufeed's decoder (nvImageCodec's has no scale: simplejpeg's path). Crops over the decoder's area limit
    (:data:`ROI_MAX_AREA`), eval crops (the whole image is resized), CMYK and whatever the region decoder refuses go
    to :func:`decode_simplejpeg`, which raises for a broken image as every path does."""
    sj = _import_simplejpeg()
    try:
        h, w, colorspace, _ = sj.decode_jpeg_header(data)
    except (ValueError, KeyError):
        colorspace = "unknown"
    if colorspace not in ("YCbCr", "Gray", "RGB"):
        decode_simplejpeg(data, crop_fn, size, out, resize=resize, max_pixels=max_pixels)
        return
    check_pixels(w, h, max_pixels)
    frame = check_jpeg(data)
    crop = crop_fn(w, h)
    native = jpegroi.region_decoder()
    scale = draft_scale(crop, size)  # the simplejpeg path's DCT scale, which only gpufeed's region decoder takes too
    if crop.resize is not None or (scale > 1 and native is None):
        decode_simplejpeg(data, lambda _w, _h: crop, size, out, resize=resize, max_pixels=max_pixels)
        return
    dw, dh = -(-w // scale), -(-h // scale)  # libjpeg's size at 1/scale
    l, t, r, b = pixel_box(crop.box, dw, dh, dw / w, dh / h)  # as the simplejpeg path maps the crop to its decode
    limit = ROI_MAX_AREA if native is not None else ROI_MAX_AREA_NVIMGCODEC
    arr = None
    if (r - l) * (b - t) <= limit * dw * dh and ends_like_jpeg(data, frame):  # else too little to skip (the whole
        # decode is cheaper), or no end-of-image marker near the end: a truncated file is refused whatever the crop
        arr = _region(native, data, (l, t, r, b), scale)
    if arr is None:
        decode_simplejpeg(data, lambda _w, _h: crop, size, out, resize=resize, max_pixels=max_pixels)
        return
    region = Crop((0.0, 0.0, float(r - l), float(b - t)), crop.flip)
    if resize == "torch":
        resize_array_into(arr, region, size, out)
    else:
        _finish(Image.fromarray(arr), region, size, out, 1.0, 1.0, resize)


def _region(native, data: bytes, box: tuple[int, int, int, int], scale: int) -> np.ndarray | None:
    """The box's RGB pixels [b - t, r - l, 3] of the image decoded at 1/``scale`` from the region decoder
    (``native``: gpufeed's; None: nvImageCodec's, scale 1 only), or None where it refused the data (the caller
    then decodes the whole image, which raises if it is broken)."""
    l, t, r, b = box
    if native is not None:
        try:
            return jpegroi.decode_region(native, data, box, _decode_buffer((b - t) * (r - l) * 3), scale)
        except ValueError:
            return None
    nv = _import_nvimgcodec()
    try:
        stream = nv.CodeStream(data).get_sub_code_stream(region=nv.Region(start=(t, l), end=(b, r)))
        img = _roi_decoder().decode(stream)
        arr = np.asarray(img.cpu()) if img is not None else None
    except (RuntimeError, ValueError):
        return None
    return arr if arr is not None and arr.shape == (b - t, r - l, 3) else None


_scratch = threading.local()


def _decode_buffer(nbytes: int) -> np.ndarray:
    """This thread's reused decode output buffer, at least ``nbytes`` (grown by half again when too small)."""
    buf = getattr(_scratch, "buf", None)
    if buf is None or buf.size < nbytes:
        buf = _scratch.buf = np.empty(max(nbytes, 3 * (buf.size if buf is not None else 0) // 2), dtype=np.uint8)
    return buf


def decode_into(data: bytes, ext: str, method: DecodeMethod, crop_fn, size: int, out: np.ndarray, *,
                resize: str = "torch", max_pixels: int = DEFAULT_MAX_PIXELS) -> None:
    """Decode one encoded image into ``out`` (uint8 [size, size, 3]) with the chosen CPU path.

    ``resize``: "torch" (default, torch's uint8 SIMD kernel) or "pil" (PIL ``resize(box=...)``).
    Raises :class:`ImageTooLarge` (before decoding) when the image has more than ``max_pixels`` pixels.
    """
    is_jpeg = ext in JPEG_EXTENSIONS
    if method == "simplejpeg" and is_jpeg:
        decode_simplejpeg(data, crop_fn, size, out, resize=resize, max_pixels=max_pixels)
    elif method == "roi" and is_jpeg:
        decode_roi(data, crop_fn, size, out, resize=resize, max_pixels=max_pixels)
    else:
        decode_pil(data, crop_fn, size, out, draft=(method != "pil" and is_jpeg), resize=resize,
                   max_pixels=max_pixels)


def is_gpu_decodable(data: bytes, max_pixels: int = DEFAULT_MAX_PIXELS) -> tuple[bool, int, int]:
    """(True, width, height) when nvjpeg can decode ``data`` to RGB (a baseline/progressive YCbCr or gray JPEG).

    Reads the header only; raises :class:`ImageTooLarge` when the image has more than ``max_pixels`` pixels
    (whatever its format: the CPU fallback would decode it too).
    """
    with open_image(data) as img:  # refuses what gpufeed decodes nowhere (jpeg_problem), e.g. two frame headers
        w, h = img.size
        ok = img.format == "JPEG" and img.mode in ("RGB", "L")
    check_pixels(w, h, max_pixels)
    if ok:  # nvJPEG gets Huffman-coded baseline, extended and progressive frames; the rest decodes on the CPU
        frame = jpeg_frame(data)
        ok = frame is not None and not isinstance(frame, str) and frame.sof in DEVICE_SOF
    return ok, w, h
