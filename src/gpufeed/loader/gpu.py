"""``decode = "gpu"``: the host batch of JPEG bytes and crop boxes a worker builds, and its decode, crop and resize on
the device (docs/design.md §3, "Batches")."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Callable

import torch

from gpufeed.loader import decode as dec


@dataclass
class EncodedBatch:
    """A host batch for ``decode = "gpu"``: JPEG bytes to decode on the device, plus what the CPU decoded.

    ``cpu_images`` [B, S, S, 3] holds the samples the device cannot decode (PNG, WebP, CMYK JPEG);
    rows listed in ``index`` are filled by :meth:`gpufeed.loader.ShardLoader.to_device` from ``data``.
    """

    data: list[bytes]
    """Encoded JPEG bytes of the device-decoded samples while the batch is built (empty once packed)."""
    index: list[int]
    """Batch rows of the device-decoded samples."""
    boxes: list[tuple[float, float, float, float]]
    """Crop boxes (left, top, right, bottom) in stored pixels, one per device-decoded sample."""
    flips: list[bool]
    cpu_images: torch.Tensor
    size: int
    blob: torch.Tensor | None = None
    """All encoded bytes in one uint8 tensor (one shared-memory block per batch instead of one per sample)."""
    lengths: list[int] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    """Each device-decoded sample as an error names it (``'KEY.jpg' in shard PATH``), for a decode that fails."""

    def __len__(self) -> int:
        return self.cpu_images.shape[0]

    @property
    def num_encoded(self) -> int:
        return len(self.index)

    def pack(self) -> "EncodedBatch":
        if self.data:
            self.lengths = [len(d) for d in self.data]
            self.blob = torch.frombuffer(bytearray(b"".join(self.data)), dtype=torch.uint8)
            self.data = []
        return self

    def chunks(self) -> list[torch.Tensor]:
        """The encoded images as uint8 1-D tensors (views of ``blob``)."""
        if self.blob is None:
            return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in self.data]
        return list(torch.split(self.blob, self.lengths))


def prepare_encoded(enc: EncodedBatch, row: int, data: bytes, ext: str, crop_fn: Callable, max_pixels: int,
                    name: str = "") -> bool:
    """Record a device-decodable JPEG (bytes + crop) for batch row ``row`` in ``enc``; False sends the sample to
    the CPU path. ``name`` says which sample it is, should its device decode fail."""
    if ext not in dec.JPEG_EXTENSIONS:
        return False
    ok, w, h = dec.is_gpu_decodable(data, max_pixels)
    if not ok:
        return False
    crop = crop_fn(w, h)
    l, t, r, b = crop.box
    box = (float(l), float(t), float(r), float(b))
    enc.data.append(data)
    enc.index.append(row)
    enc.boxes.append(box)
    enc.flips.append(crop.flip)
    enc.names.append(name)
    return True


def merge_encoded(rows: list[EncodedBatch], S: int) -> EncodedBatch:
    """One batch of ``S x S`` images from one-sample batches (``worker_batching`` off)."""
    out = EncodedBatch([], [], [], [], torch.empty((len(rows), S, S, 3), dtype=torch.uint8), S)
    for i, r in enumerate(rows):
        out.cpu_images[i] = r.cpu_images[0]
        names = r.names if len(r.names) == len(r.boxes) else [""] * len(r.boxes)
        for d, b, f, n in zip(r.chunks(), r.boxes, r.flips, names):
            out.data.append(d.numpy().tobytes())
            out.index.append(i)
            out.boxes.append(b)
            out.flips.append(f)
            out.names.append(n)
    return out.pack()


CROP_MARGIN = 1
"""Pixels kept around a crop box (after rounding it out to whole pixels) when ``gpu_decode`` cuts each decoded
image to its crop: roi_align's bilinear samples of the box read at most one pixel beyond it."""


def crop_window(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)``: the pixels of a ``width x height`` image that roi_align (``aligned=True``) reads
    for ``box`` - the box rounded out to whole pixels plus :data:`CROP_MARGIN`, clipped to the image (never empty)."""
    l, t, r, b = box
    x0 = min(max(math.floor(l) - CROP_MARGIN, 0), width - 1)
    y0 = min(max(math.floor(t) - CROP_MARGIN, 0), height - 1)
    x1 = max(min(math.ceil(r) + CROP_MARGIN, width), x0 + 1)
    y1 = max(min(math.ceil(b) + CROP_MARGIN, height), y0 + 1)
    return x0, y0, x1, y1


def crop_buffer_shape(windows: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    """``(height, width)`` of the padded buffer ``gpu_decode`` hands roi_align: the largest crop window,
    so its size is bounded by the crop boxes (each side at most the box's + 2 + 2 x CROP_MARGIN), not by the images."""
    return max(y1 - y0 for _, y0, _, y1 in windows), max(x1 - x0 for x0, _, x1, _ in windows)


def jpeg_decoder() -> Callable[[list[torch.Tensor], str | torch.device], list[torch.Tensor]]:
    """The batched JPEG decode ``gpu_decode`` calls: ``decoder(chunks, device)`` -> RGB uint8 ``[3, H, W]`` tensors.

    TorchCodec's ``decode_jpeg`` (nvJPEG on CUDA, libjpeg-turbo on the CPU; one nvJPEG call for the batch), the
    successor of ``torchvision.io.decode_jpeg`` (deprecated since torchvision 0.29). Without the ``torchcodec``
    package it falls back to torchvision's, which still works but prints its deprecation warning.
    """
    try:
        from torchcodec.decoders import decode_jpeg
    except ImportError:  # torchcodec not installed (pip install torchcodec)
        from torchvision.io import ImageReadMode
        from torchvision.io import decode_jpeg as tv_decode_jpeg

        return lambda chunks, device: tv_decode_jpeg(chunks, mode=ImageReadMode.RGB, device=device)
    return lambda chunks, device: decode_jpeg(chunks, mode="RGB", device=device)


class DeviceDecodeError(ValueError):
    """A JPEG of the batch that the device decoder refused (its header passed every check the worker made)."""


def refused(name: str, why: str) -> str:
    """The one sentence for an image the device decoder refused."""
    return f"corrupt sample {name or '(unnamed)'}: the device decode failed: {why}"


def _decode_each(decoder: Callable, chunks: list[torch.Tensor], device) -> tuple[list, list[tuple[int, str]]]:
    """The batch in one decoder call; when that call fails, image by image: ``(images, failures)``, a failed
    image's place None and ``(its position, why)`` in failures. A batch call that fails while every image decodes
    alone is not the data's fault: its error is raised."""
    try:
        return list(decoder(chunks, device)), []
    except Exception as exc:  # noqa: BLE001 - one bad image fails the whole call: find which
        first = exc
    images: list = []
    failures: list[tuple[int, str]] = []
    for k, chunk in enumerate(chunks):
        try:
            images.append(decoder([chunk], device)[0])
        except Exception as exc:  # noqa: BLE001 - reported for this image, per on_error
            images.append(None)
            failures.append((k, f"{type(exc).__name__}: {' '.join(str(exc).split())[:200]}"))
    if not failures:
        raise first
    return images, failures


def gpu_decode(batch: EncodedBatch, device: str | torch.device, non_blocking: bool = True) -> torch.Tensor:
    """:func:`gpu_decode_rows` for a batch that must decode whole: raises :class:`DeviceDecodeError` naming the
    first image the device refused."""
    out, failures, _ = gpu_decode_rows(batch, device, non_blocking)
    if failures:
        _row, name, why = failures[0]
        raise DeviceDecodeError(refused(name, why))
    return out


def gpu_decode_rows(batch: EncodedBatch, device: str | torch.device, non_blocking: bool = True
                    ) -> tuple[torch.Tensor, list[tuple[int, str, str]], list[tuple[int, int]]]:
    """Batched JPEG decode (:func:`jpeg_decoder`) of the batch's JPEGs on ``device``, then crop + resize + flip there:
    ``(images, failures, fills)``. ``failures`` lists ``(row, name, why)`` of each image the device refused; its row
    is filled with a copy of a good row, and ``fills`` lists ``(row, source row)`` (the caller repeats the label
    too). Raises :class:`DeviceDecodeError` when no row of the batch decoded.

    One batched decode call; then, per image, its crop window (:func:`crop_window`) is copied into a zero
    buffer of :func:`crop_buffer_shape` (the window's last row/column replicated once into the padding, so
    bilinear samples at an image's right/bottom edge do not blend in zeros) and the decoded image is freed.
    One ``torchvision.ops.roi_align`` over that buffer (``aligned=True``, adaptive sampling: each output
    pixel averages ``ceil(scale)``^2 bilinear samples of its bin, an antialiased downscale close to PIL's
    bilinear filter) resizes every crop to ``S x S``, then flips and the uint8 cast are batched. Memory
    besides the decoded JPEGs is bounded by the crops: ``K x 3 x window`` uint8 and float32. When the batched call
    fails, the images are decoded one by one and those the device refuses are reported (:func:`_decode_each`).
    """
    S = batch.size
    if batch.num_encoded < len(batch):  # some rows were decoded on the CPU (PNG, WebP, CMYK)
        out = batch.cpu_images.to(device, non_blocking=non_blocking).permute(0, 3, 1, 2)
        if not batch.num_encoded:
            return out, [], []
    else:
        out = torch.empty((len(batch), S, S, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    decoded, failed = _decode_each(jpeg_decoder(), batch.chunks(), device)
    failures: list[tuple[int, str, str]] = []
    if failed:
        names = batch.names if len(batch.names) == len(batch.boxes) else [""] * len(batch.boxes)
        failures = [(batch.index[k], names[k], why) for k, why in failed]
        keep = [k for k in range(len(decoded)) if decoded[k] is not None]
        batch = dataclasses.replace(batch, index=[batch.index[k] for k in keep], boxes=[batch.boxes[k] for k in keep],
                                    flips=[batch.flips[k] for k in keep], names=[])
        decoded = [decoded[k] for k in keep]
    out = _crop_resize(batch, decoded, out, device)
    fills: list[tuple[int, int]] = []
    if failures:
        bad = {row for row, _, _ in failures}
        good = [r for r in range(len(out)) if r not in bad]
        if not good:
            raise DeviceDecodeError(f"corrupt sample {failures[0][1] or '(unnamed)'}: the device decode failed, as "
                                    f"for every image of its batch: {failures[0][2]}")
        for row, _, _ in failures:
            out[row] = out[good[0]]
            fills.append((row, good[0]))
    return out, failures, fills


def _crop_resize(batch: EncodedBatch, decoded: list, out: torch.Tensor, device) -> torch.Tensor:
    """Crop, resize and flip the ``decoded`` images (one per ``batch.index`` row) into their rows of ``out``."""
    from torchvision.ops import roi_align

    S = batch.size
    if not decoded:
        return out
    windows = [crop_window(box, int(img.shape[2]), int(img.shape[1])) for img, box in zip(decoded, batch.boxes)]
    hmax, wmax = crop_buffer_shape(windows)
    padded = torch.zeros((len(decoded), 3, hmax, wmax), dtype=torch.uint8, device=device)
    rois = []
    for k, (x0, y0, x1, y1) in enumerate(windows):
        h, w = y1 - y0, x1 - x0
        padded[k, :, :h, :w] = decoded[k][:, y0:y1, x0:x1]
        decoded[k] = None  # free the full image as soon as its window is copied
        if w < wmax:
            padded[k, :, :h, w] = padded[k, :, :h, w - 1]
        if h < hmax:
            padded[k, :, h, : min(w + 1, wmax)] = padded[k, :, h - 1, : min(w + 1, wmax)]
        l, t, r, b = batch.boxes[k]
        rois.append((k, l - x0, t - y0, r - x0, b - y0))
    del decoded
    rois_t = torch.tensor(rois, dtype=torch.float32).to(device)
    crops = roi_align(padded.to(torch.float32), rois_t, output_size=(S, S), spatial_scale=1.0, sampling_ratio=-1,
                      aligned=True)
    flips = torch.tensor(batch.flips, dtype=torch.bool).to(device)
    crops = torch.where(flips.view(-1, 1, 1, 1), crops.flip(-1), crops)
    crops = crops.round_().clamp_(0, 255).to(torch.uint8)
    out[torch.tensor(batch.index, dtype=torch.long).to(device)] = crops
    return out
