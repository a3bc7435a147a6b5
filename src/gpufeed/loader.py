"""The loader shared by ``tune`` and ``train`` (DESIGN §2): shard set -> uint8 batches.

How an epoch is split. The manifest's shards are put in epoch order (a seeded permutation for
training, identical on every rank) and read as one sequence of ``num_samples`` samples. Rank ``r`` of
``W`` owns the contiguous range ``[r*N//W, (r+1)*N//W)`` of that sequence and splits it into
contiguous sub-ranges, one per DataLoader worker. With shards in multiples of ranks x workers
(``gpufeed shard --multiple-of``) every range is a whole number of shards; otherwise the ranges
start/stop inside a shard, so every sample still goes to exactly one (rank, worker) and no rank is
ever short. Every rank yields exactly ``len(loader) = (N // W) // batch_size`` batches; each worker
yields a fixed share of them and stops, so DDP never waits on an uneven tail. Samples beyond that
(fewer than ``W x batch_size`` plus the per-worker rounding) are dropped, randomly for training since
they are the last ones out of the shuffle buffer. Corrupt samples skipped under ``on_error = "skip"``
are replaced by reading on (a worker re-reads its range if it must), never by a short rank.

The per-sample work (decode, crop, resize, flip) is in :mod:`gpufeed.decode`. Batches are built inside
the workers directly into a shared-memory ``[B, S, S, 3]`` uint8 tensor and handed out as the
``[B, 3, S, S]`` view (channels-last memory) with one IPC message per batch.

Security: samples are read with ``webdataset.WebDataset`` without its decoders; only image members
(``manifest.READ_IMAGE_EXTENSIONS``) and ``.cls`` labels are read at all, and nothing is unpickled.
"""

from __future__ import annotations

import math
import multiprocessing
import random
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpufeed import decode as dec
from gpufeed import tarread
from gpufeed.config import LoaderConfig
from gpufeed.errors import ConfigError, DataError
from gpufeed.manifest import LABEL_EXTENSION, READ_IMAGE_EXTENSIONS, Manifest, manifest_path, read_manifest
from gpufeed.world import World

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_READ_EXTENSIONS = frozenset((*READ_IMAGE_EXTENSIONS, LABEL_EXTENSION))


# --------------------------------------------------------------------------- the epoch plan


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` (counted in stream order) of one shard."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class SlotPlan:
    """What one (rank, worker) reads in one epoch and how many batches it yields."""

    segments: tuple[Segment, ...]
    num_batches: int

    @property
    def num_samples(self) -> int:
        return sum(s.stop - s.start for s in self.segments)


def batches_per_rank(num_samples: int, world_size: int, batch_size: int) -> int:
    return (num_samples // world_size) // batch_size


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool) -> list[int]:
    order = list(range(num_shards))
    if shuffle:
        random.Random(f"gpufeed-shards-{seed}-{epoch}").shuffle(order)
    return order


def plan_slot(counts: list[int], *, rank: int, world_size: int, worker: int, num_workers: int,
              batch_size: int, seed: int = 0, epoch: int = 0, shuffle: bool = False) -> SlotPlan:
    """The shard segments and batch count of one (rank, worker) for one epoch (pure, deterministic)."""
    num_workers = max(1, num_workers)
    total = sum(counts)
    nb = batches_per_rank(total, world_size, batch_size)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    # worker w yields nb_w batches; the rank's spare samples are spread evenly for the shuffle to drop
    nbw = [nb // num_workers + (w < nb % num_workers) for w in range(num_workers)]
    spare = (hi - lo) - nb * batch_size
    sizes = [nbw[w] * batch_size + spare // num_workers + (w < spare % num_workers) for w in range(num_workers)]
    start = lo + sum(sizes[:worker])
    stop = start + sizes[worker]
    segments = []
    pos = 0
    for shard in shard_order(len(counts), seed, epoch, shuffle):
        n = counts[shard]
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            segments.append(Segment(shard, a - pos, b - pos))
        pos += n
    return SlotPlan(tuple(segments), nbw[worker])


# --------------------------------------------------------------------------- batches


@dataclass
class EncodedBatch:
    """A host batch for ``decode = "gpu"``: JPEG bytes to decode on the device, plus what the CPU decoded.

    ``cpu_images`` [B, S, S, 3] holds the samples the device cannot decode (PNG, WebP, CMYK JPEG);
    rows listed in ``index`` are filled by :meth:`ShardLoader.to_device` from ``data``.
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


class _ErrorPolicy:
    """Webdataset handler + counter for tar-level errors (truncated shard, bad member)."""

    def __init__(self, on_error: str, url: str):
        self.on_error = on_error
        self.url = url
        self.count = 0

    def __call__(self, exn: Exception) -> bool:
        if self.on_error == "skip":
            self.count += 1
            return True
        raise DataError(f"shard {self.url}: cannot read it ({type(exn).__name__}: {exn})") from exn


def _select(fname: str) -> bool:
    base = fname.rsplit("/", 1)[-1]
    return "." in base and base.split(".", 1)[1].lower() in _READ_EXTENSIONS


class ShardStream(IterableDataset):
    """One epoch of one rank: each DataLoader worker reads its planned segments and yields batches."""

    def __init__(self, paths: list[str], counts: list[int], classes: list[str], cfg: LoaderConfig, world: World,
                 train: bool, epoch_value: Any):
        self.paths = paths
        self.counts = counts
        self.class_index = {c: i for i, c in enumerate(classes)}
        self.num_classes = len(classes)
        self.cfg = cfg
        self.world = world
        self.train = train
        self.epoch_value = epoch_value
        self.per_sample = not cfg.worker_batching
        self.fast_tar = True
        """Read local plain .tar shards with :mod:`gpufeed.tarread`; False = webdataset for every shard."""

    # ------------------------------------------------------------------ reading

    def _read_segments(self, segments: tuple[Segment, ...], errors: list[int]) -> Iterator[dict]:
        import webdataset as wds

        for seg in segments:
            url = self.paths[seg.shard]
            policy = _ErrorPolicy(self.cfg.on_error, url)
            if self.fast_tar and url.endswith(".tar"):
                try:
                    for sample in tarread.iter_samples(url, _READ_EXTENSIONS, READ_IMAGE_EXTENSIONS,
                                                       seg.start, seg.stop):
                        sample["__ext__"] = next(e for e in READ_IMAGE_EXTENSIONS if e in sample)
                        yield sample
                except (OSError, ValueError, StopIteration) as exc:
                    policy(exc)  # raises DataError naming the shard, or counts it under "skip"
                errors[0] += policy.count
                continue
            ds = wds.WebDataset(url, handler=policy, shardshuffle=False, nodesplitter=None,
                                workersplitter=None, select_files=_select, empty_check=False)
            i = 0
            try:
                for sample in ds:
                    ext = next((e for e in READ_IMAGE_EXTENSIONS if e in sample), None)
                    if ext is None:
                        continue  # not an image sample (indexing does not count these either)
                    if i >= seg.start:
                        sample["__ext__"] = ext
                        yield sample
                    i += 1
                    if i >= seg.stop:
                        break
            finally:
                errors[0] += policy.count
                policy.count = 0

    def _shuffled(self, items: Iterator[dict], rng: random.Random) -> Iterator[dict]:
        size = self.cfg.shuffle_buffer if self.train else 0
        if size <= 1:
            yield from items
            return
        buf: list[dict] = []
        for item in items:
            if len(buf) < size:
                buf.append(item)
                continue
            k = rng.randrange(size)
            buf[k], item = item, buf[k]
            yield item
        rng.shuffle(buf)
        yield from buf

    def _label(self, sample: dict) -> int:
        raw = sample.get(LABEL_EXTENSION)
        if raw is None:
            raise ValueError("no .cls label member")
        text = raw.decode("utf-8").strip()
        try:
            label = int(text)
        except ValueError:
            if text not in self.class_index:
                raise ValueError(f"label {text!r} is neither a class index nor a class of the manifest") from None
            return self.class_index[text]
        if not 0 <= label < max(self.num_classes, 1) and self.num_classes:
            raise ValueError(f"label {label} is outside 0..{self.num_classes - 1}")
        return label

    # ------------------------------------------------------------------ iteration

    def __iter__(self):
        if get_worker_info() is not None:  # workers run single-threaded already (worker_init)
            yield from self._iter()
            return
        # num_workers == 0: the per-sample torch ops must not fan out to the caller's intra-op threads
        # (tiny ops on an OpenMP pool burn ~10x the CPU); restore the caller's setting around each yield.
        prev = torch.get_num_threads()
        it = self._iter()
        while True:
            torch.set_num_threads(1)
            try:
                item = next(it)
            except StopIteration:
                return
            finally:
                torch.set_num_threads(prev)
            yield item

    def _iter(self):
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        epoch = int(self.epoch_value.value)
        cfg = self.cfg
        plan = plan_slot(self.counts, rank=self.world.rank, world_size=self.world.world_size, worker=worker,
                         num_workers=num_workers, batch_size=cfg.batch_size, seed=cfg.seed, epoch=epoch,
                         shuffle=self.train)
        quota = plan.num_batches * cfg.batch_size
        if quota == 0:
            return
        rng = random.Random(f"gpufeed-samples-{cfg.seed}-{epoch}-{self.world.rank}-{worker}")
        S, B = cfg.image_size, cfg.batch_size
        shared = info is not None
        gpu = cfg.decode == "gpu"
        if self.train:
            crop_fn = partial(dec.train_crop, rng=rng)
        else:
            crop_fn = partial(dec.eval_crop, size=S, crop_ratio=getattr(cfg, "crop_ratio", 0.875))
        errors = [0]
        skipped_reported = 0
        batch = None
        filled = 0
        done = 0
        passes = 0
        first_pass_errors = 0
        while done < quota:
            if passes == 1:  # re-reading the range: its corrupt samples were counted on the first pass
                first_pass_errors = errors[0]
            good_this_pass = 0
            for sample in self._shuffled(self._read_segments(plan.segments, errors), rng):
                if batch is None:
                    batch = self._new_batch(B, S, shared, gpu)
                images, labels, enc = batch
                row = 0 if self.per_sample else filled
                try:
                    label = self._label(sample)
                    data = sample[sample["__ext__"]]
                    if gpu and self._gpu_prepare(data, sample["__ext__"], crop_fn, enc, row):
                        pass
                    else:
                        dec.decode_into(data, sample["__ext__"], cfg.decode, crop_fn, S, images[row],
                                        resize=getattr(cfg, "resize", "torch"))
                except Exception as exc:  # noqa: BLE001 - the policy decides
                    where = f"sample {sample.get('__key__')!r} in shard {sample.get('__url__')}"
                    if cfg.on_error == "raise":
                        raise DataError(f"corrupt {where}: {type(exc).__name__}: {exc}") from exc
                    errors[0] += 1
                    continue
                labels[row] = label
                good_this_pass += 1
                done += 1
                filled += 1
                if self.per_sample or filled == B:
                    total = errors[0] if passes == 0 else first_pass_errors
                    skipped = total - skipped_reported
                    skipped_reported = total
                    yield self._emit(batch, 1 if self.per_sample else B, skipped)
                    batch, filled = None, 0
                if done >= quota:
                    break
            passes += 1
            if done < quota and good_this_pass == 0:
                raise DataError(
                    f"rank {self.world.rank} worker {worker}: no readable sample in its "
                    f"{plan.num_samples} planned samples (shards {sorted({s.shard for s in plan.segments})})"
                )

    def _new_batch(self, B: int, S: int, shared: bool, gpu: bool):
        n = 1 if self.per_sample else B
        images = torch.empty((n, S, S, 3), dtype=torch.uint8)
        if shared:
            images.share_memory_()  # the worker writes straight into the memory the main process receives
        labels = torch.empty((n,), dtype=torch.int64)
        enc = EncodedBatch([], [], [], [], images, S) if gpu else None
        return images.numpy(), labels.numpy(), enc

    def _emit(self, batch, n: int, skipped: int):
        images, labels, enc = batch
        if enc is not None:
            return enc.pack(), torch.from_numpy(labels), skipped
        return torch.from_numpy(images).permute(0, 3, 1, 2), torch.from_numpy(labels), skipped

    def _gpu_prepare(self, data: bytes, ext: str, crop_fn, enc: EncodedBatch, row: int) -> bool:
        """Record a device-decodable JPEG (bytes + crop) in ``enc``; False sends the sample to the CPU path."""
        if ext not in dec.JPEG_EXTENSIONS:
            return False
        ok, w, h = dec.is_gpu_decodable(data)
        if not ok:
            return False
        crop = crop_fn(w, h)
        l, t, r, b = crop.box
        box = (float(l), float(t), float(r), float(b))
        enc.data.append(data)
        enc.index.append(row)
        enc.boxes.append(box)
        enc.flips.append(crop.flip)
        return True


def _worker_init(worker_id: int) -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- the loader


class ShardLoader:
    """Iterable over one epoch of host batches ``(images, labels)`` for this rank.

    ``images`` is uint8 ``[B, 3, S, S]`` (a channels-last view; pinned when ``cfg.pin_memory`` and the
    world is CUDA), ``labels`` int64 ``[B]``. With ``decode = "gpu"`` ``images`` is an
    :class:`EncodedBatch`; :meth:`to_device` decodes it on the device. Every rank yields ``len(self)``
    batches per epoch. ``num_skipped`` counts corrupt samples skipped so far (all epochs, all workers).
    """

    def __init__(self, shards: str | Path, cfg: LoaderConfig, world: World, *, train: bool = True, epoch: int = 0,
                 manifest: Manifest | None = None):
        self.cfg = cfg
        self.world = world
        self.train = train
        self.manifest = manifest if manifest is not None else read_manifest(shards)
        root = manifest_path(shards).parent
        if self.manifest.root:
            root = root / self.manifest.root
        self.root = root
        self.paths = [str(p) for p in self.manifest.shard_paths(root)]
        missing = [p for p in self.paths if not Path(p).is_file()]
        if missing:
            raise DataError(f"{len(missing)} shard(s) of the manifest are missing, e.g. {missing[0]}")
        counts = [s.num_samples for s in self.manifest.shards]
        self.num_batches = batches_per_rank(sum(counts), world.world_size, cfg.batch_size)
        if self.num_batches == 0:
            raise DataError(
                f"{sum(counts)} samples are not enough for one batch of {cfg.batch_size} on each of "
                f"{world.world_size} rank(s); lower batch_size"
            )
        if cfg.decode == "simplejpeg":
            dec._import_simplejpeg()
        self.num_skipped = 0
        self._epoch = multiprocessing.get_context().Value("q", epoch, lock=False)
        self._dataset = ShardStream(self.paths, counts, self.manifest.classes, cfg, world, train, self._epoch)
        nw = cfg.num_workers
        self._pin = bool(cfg.pin_memory and world.is_cuda and torch.cuda.is_available())
        self._loader = DataLoader(
            self._dataset, batch_size=None, num_workers=nw, pin_memory=self._pin and cfg.worker_batching,
            prefetch_factor=cfg.prefetch_factor if nw > 0 else None,
            persistent_workers=cfg.persistent_workers if nw > 0 else False,
            worker_init_fn=_worker_init if nw > 0 else None,
        )

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int) -> None:
        """Select the epoch (shard order, shuffle and crops derive from seed and epoch); persistent workers see it."""
        self._epoch.value = int(epoch)

    def __iter__(self):
        produced = 0
        if self.cfg.worker_batching:
            for images, labels, skipped in self._loader:
                self.num_skipped += int(skipped)
                produced += 1
                yield images, labels
        else:
            yield_count = 0
            for batch in self._batch_in_main():
                yield_count += 1
                yield batch
            produced = yield_count
        if produced != self.num_batches:  # a rank that stops early would hang DDP: fail loudly instead
            raise DataError(f"rank {self.world.rank} yielded {produced} batches, expected {self.num_batches}")

    def _batch_in_main(self):
        B, S = self.cfg.batch_size, self.cfg.image_size
        gpu = self.cfg.decode == "gpu"
        rows: list[Any] = []
        labels: list[int] = []
        for images, label, skipped in self._loader:
            self.num_skipped += int(skipped)
            rows.append(images)
            labels.append(int(label[0]))
            if len(rows) == B:
                lab = torch.tensor(labels, dtype=torch.int64)
                if gpu:
                    out = _merge_encoded(rows, S)
                else:
                    imgs = torch.empty((B, S, S, 3), dtype=torch.uint8, pin_memory=self._pin)
                    for i, r in enumerate(rows):
                        imgs[i] = r[0].permute(1, 2, 0)
                    out = imgs.permute(0, 3, 1, 2)
                    if self._pin:
                        lab = lab.pin_memory()
                yield out, lab
                rows, labels = [], []

    def to_device(self, batch, device: str | torch.device, non_blocking: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Host batch -> (uint8 [B, 3, S, S], int64 [B]) on ``device``; decodes an :class:`EncodedBatch` there."""
        images, labels = batch
        labels = labels.to(device, non_blocking=non_blocking)
        if isinstance(images, EncodedBatch):
            return gpu_decode(images, device, non_blocking=non_blocking), labels
        return images.to(device, non_blocking=non_blocking), labels


def _merge_encoded(rows: list[EncodedBatch], S: int) -> EncodedBatch:
    out = EncodedBatch([], [], [], [], torch.empty((len(rows), S, S, 3), dtype=torch.uint8), S)
    for i, r in enumerate(rows):
        out.cpu_images[i] = r.cpu_images[0]
        for d, b, f in zip(r.chunks(), r.boxes, r.flips):
            out.data.append(d.numpy().tobytes())
            out.index.append(i)
            out.boxes.append(b)
            out.flips.append(f)
    return out.pack()


def gpu_decode(batch: EncodedBatch, device: str | torch.device, non_blocking: bool = True) -> torch.Tensor:
    """Batched ``torchvision.io.decode_jpeg`` on ``device``, then crop + resize + flip of the whole batch there.

    The decoded images are padded into one tensor and cropped/resized with one ``torchvision.ops.roi_align``
    (``aligned=True``, adaptive sampling: each output pixel averages ``ceil(scale)``^2 bilinear samples of
    its bin, an antialiased downscale close to PIL's bilinear filter), so the work is a few kernels per
    batch instead of several per sample.
    """
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.ops import roi_align

    S = batch.size
    if batch.num_encoded < len(batch):  # some rows were decoded on the CPU (PNG, WebP, CMYK)
        out = batch.cpu_images.to(device, non_blocking=non_blocking).permute(0, 3, 1, 2)
        if not batch.num_encoded:
            return out
    else:
        out = torch.empty((len(batch), S, S, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    decoded = decode_jpeg(batch.chunks(), mode=ImageReadMode.RGB, device=device)
    hmax = max(int(x.shape[1]) for x in decoded)
    wmax = max(int(x.shape[2]) for x in decoded)
    padded = torch.zeros((len(decoded), 3, hmax, wmax), dtype=torch.uint8, device=device)
    for k, img in enumerate(decoded):
        h, w = int(img.shape[1]), int(img.shape[2])
        padded[k, :, :h, :w] = img
        # replicate the last row/column once: roi_align's bilinear samples within half a pixel of the
        # right/bottom edge must not blend in the zero padding (upscaled small crops)
        if w < wmax:
            padded[k, :, :h, w] = img[:, :, w - 1]
        if h < hmax:
            padded[k, :, h, : min(w + 1, wmax)] = padded[k, :, h - 1, : min(w + 1, wmax)]
    rois = torch.tensor([(k, *box) for k, box in enumerate(batch.boxes)], dtype=torch.float32).to(device)
    dtype = torch.float32
    crops = roi_align(padded.to(dtype), rois, output_size=(S, S), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    flips = torch.tensor(batch.flips, dtype=torch.bool).to(device)
    crops = torch.where(flips.view(-1, 1, 1, 1), crops.flip(-1), crops)
    crops = crops.round_().clamp_(0, 255).to(torch.uint8)
    out[torch.tensor(batch.index, dtype=torch.long).to(device)] = crops
    return out


def build_loader(shards: str | Path, cfg: LoaderConfig, world: World, *, train: bool = True,
                 epoch: int = 0) -> ShardLoader:
    """The loader over a shard set (folder or manifest.json) for this rank; see :class:`ShardLoader`."""
    return ShardLoader(shards, cfg, world, train=train, epoch=epoch)


def normalize(images_uint8: torch.Tensor, *, dtype: torch.dtype = torch.float32,
              channels_last: bool = False) -> torch.Tensor:
    """ImageNet mean/std normalisation of uint8 [B, 3, H, W] images, on their device."""
    if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4 or images_uint8.shape[1] != 3:
        raise ValueError(f"expected uint8 [B, 3, H, W], got {images_uint8.dtype} {tuple(images_uint8.shape)}")
    dev = images_uint8.device
    mean = torch.tensor([m * 255 for m in IMAGENET_MEAN], device=dev, dtype=torch.float32).view(1, 3, 1, 1)
    inv_std = torch.tensor([1 / (s * 255) for s in IMAGENET_STD], device=dev, dtype=torch.float32).view(1, 3, 1, 1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = images_uint8.to(dtype=torch.float32, memory_format=fmt)
    x = (x - mean) * inv_std
    return x.to(dtype=dtype, memory_format=fmt)
