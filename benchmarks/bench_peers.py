"""Peer loader benchmark: gpufeed's loader against the loaders a user would otherwise pick, side by side.

Every loader reads the same gpufeed shard set (WebDataset tars with ``.jpg``/``.cls`` members and a
``manifest.json``; ``imagefolder`` reads the JPEG folder the set was made from) and yields the same batches:
uint8 images [B, 3, 224, 224] after RandomResizedCrop(224, scale=(0.08, 1), ratio=(3/4, 4/3)) + random
horizontal flip, and int64 labels [B]. Normalisation is left to the device and not measured.

- ``imagefolder``  torchvision ImageFolder on the JPEG folder + DataLoader, PIL decode, transforms v2
                   RandomResizedCrop(antialias=True) + RandomHorizontalFlip + PILToTensor; its best num_workers
                   of ``--if-workers`` (one window each before the rounds);
- ``wds-recipe``   the webdataset README recipe: ``WebDataset(urls, shardshuffle=...).shuffle(1000).decode("pil")
                   .to_tuple("jpg", "cls").map_tuple(transform, identity).batched(B)`` in a ``WebLoader(...,
                   batch_size=None, num_workers=2)``, the same transform as ``imagefolder``;
- ``gpufeed-w2``   ``gpufeed.loader.build_loader``: 2 worker processes, simplejpeg decode, reused batch buffers
                   (``reuse_batches=True``, as ``train`` and ``tune`` build it);
- ``gpufeed-t2``   the same with no worker process and 2 decode threads;
- ``gpufeed-roi``  2 worker processes, ``decode = "roi"`` (only the crop's region decoded: gpufeed's compiled region
                   decoder over Pillow's libjpeg-turbo, else nvImageCodec's CPU backend);
- ``gpufeed-best`` the best of a small sweep of gpufeed configs (``--gpufeed-sweep``), when it is neither of those;
- ``gpufeed-before`` with ``--before REV``: gpufeed as it was at git revision REV (its ``src/`` exported with ``git
                   archive`` into a temporary folder, imported first by the measuring process), with ``gpufeed-w2``'s
                   settings: the before and after of a change, interleaved in the same run;
- ``dali-cpu``     an NVIDIA DALI CPU-only pipeline: readers.webdataset (indexes made with DALI's wds2idx before
                   the rounds, not timed) -> decoders.image_random_crop -> resize -> crop_mirror_normalize (uint8,
                   CHW, random mirror), 2 threads; labels parsed from the ``.cls`` bytes per batch in Python;
- ``spdl``         an SPDL pipeline: a tarfile source thread -> decode + crop + resize + flip on 2 threads
                   (spdl.io's FFmpeg decode and filter graph; simplejpeg + torchvision when spdl.io's FFmpeg
                   libraries are missing, see ``--spdl-decode``) -> aggregate(B) -> collate;
- ``nodes``        torchdata.nodes: IterableWrapper(tarfile source) -> ParallelMapper(decode + crop + flip with
                   torchvision.io.decode_jpeg and transforms v2, 2 threads) -> Batcher(B) -> Mapper(collate) ->
                   Prefetcher -> Loader.

``spdl`` and ``nodes`` read the tars with Python's tarfile, shard order shuffled per epoch, through a 1000-sample
shuffle buffer like the recipe's; every loader shuffles with a buffer of ``--shuffle-buffer`` samples.

How: each measurement runs in a fresh subprocess (isolated imports and threads, killable): it builds the loader
(start-up = build + first batch, recorded apart), reads ``--warmup`` batches (the first included), then times a
window of ``--window`` seconds (or ``--window-batches`` batches), and records samples/s and samples per CPU-second
(user + system of the process and all its children, e.g. DataLoader workers, sampled at the window's start and
end; threads are inside the process). Epochs roll over inside the window as in training. A run past
``--window + --timeout`` seconds is killed and its loader marked failed; a loader whose library is missing or whose
pipeline raises is reported as ``failed: reason`` and the run goes on. The first batch of every loader is checked
to be uint8 [B, 3, 224, 224] with int64 labels [B]. Rounds are interleaved, the order rotated each round (the
machine drifts). Torch runs one intra-op thread in every measured process (the parallelism is the loader's own).

Prints, per loader, the median (min–max) samples/s over rounds, the median samples per CPU-second, cores used,
start-up, and gpufeed's best median over each loader's; writes JSON (command, machine, versions, every run) to
``--out``. Never asserts on speed.

    flock /tmp/gpufeed-bench.lock .venv/bin/python benchmarks/bench_peers.py --shards SHARDS --src JPEG_FOLDER
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime as dt
import json
import math
import os
import platform
import random
import shlex
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterable, Iterator

if TYPE_CHECKING:
    import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

Batch = tuple["torch.Tensor", "torch.Tensor"]
"""(uint8 images [B, 3, S, S], int64 labels [B])."""

SCALE = (0.08, 1.0)
RATIO = (3 / 4, 4 / 3)
PEER_WORKERS = 2
"""Workers or threads every peer gets (the gpufeed-w2 / -t2 settings are the same count)."""

VARIANTS = ("imagefolder", "wds-recipe", "gpufeed-before", "gpufeed-w2", "gpufeed-t2", "gpufeed-roi", "gpufeed-best",
            "dali-cpu", "spdl", "nodes")
GPUFEED_FIXED = {"gpufeed-w2": {"num_workers": 2, "decode_threads": 1},
                 "gpufeed-t2": {"num_workers": 0, "decode_threads": 2},
                 "gpufeed-roi": {"num_workers": 2, "decode_threads": 1, "decode": "roi"}}
GPUFEED_SWEEP = ({"num_workers": 2, "decode_threads": 1}, {"num_workers": 3, "decode_threads": 1},
                 {"num_workers": 4, "decode_threads": 1}, {"num_workers": 0, "decode_threads": 2},
                 {"num_workers": 1, "decode_threads": 2}, {"num_workers": 2, "decode_threads": 2},
                 {"num_workers": 2, "decode_threads": 1, "decode": "roi"},
                 {"num_workers": 3, "decode_threads": 1, "decode": "roi"},
                 {"num_workers": 4, "decode_threads": 1, "decode": "roi"})
"""The gpufeed configs the best-of pass measures (simplejpeg decode, and roi with 2-4 workers), as ImageFolder's
worker count is swept: one window each, the best measured again in the rounds."""


@dataclasses.dataclass(frozen=True)
class Spec:
    """One measurement: what the child process builds and how long it measures."""

    loader: str
    """Key of :data:`LOADERS`."""
    shards: str
    src: str | None
    batch_size: int
    image_size: int
    seed: int
    shuffle_buffer: int
    params: dict[str, Any]
    warmup: int
    window_s: float
    window_batches: int | None
    dali_index_dir: str | None = None


# --------------------------------------------------------------------------- shared pieces of the peers


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def identity(x: Any) -> Any:
    return x


def shard_paths(shards: str) -> list[str]:
    """The set's tar files, in manifest order."""
    from gpufeed.shardset.manifest import read_manifest

    return [str(p) for p in read_manifest(shards).shard_paths(shards)]


def epochs(make: Callable[[int], Iterable[Batch]]) -> Iterator[Batch]:
    """Batches of epoch 0, 1, 2, ... of an epoch-at-a-time loader (``make(epoch)`` starts one), without end."""
    epoch = 0
    while True:
        got = False
        for batch in make(epoch):
            got = True
            yield batch
        if not got:
            raise RuntimeError(f"epoch {epoch} yielded no batch (fewer samples than one batch per worker?)")
        epoch += 1


def tar_samples(paths: list[str], seed: int, buffer: int) -> Iterator[tuple[str, bytes, int]]:
    """(key, JPEG bytes, label) from the tars with Python's tarfile, without end: the shard order shuffled per epoch,
    samples through a shuffle buffer of ``buffer`` (the recipe's ``.shuffle(1000)``). The ``.cls`` member holds the
    label as ASCII digits."""
    rng = random.Random(seed)
    pool: list[tuple[str, bytes, int]] = []
    while True:
        order = list(paths)
        rng.shuffle(order)
        read = 0
        for path in order:
            for sample in _tar_file_samples(path):
                read += 1
                if buffer <= 1:
                    yield sample
                    continue
                pool.append(sample)
                if len(pool) >= buffer:
                    i = rng.randrange(len(pool))
                    pool[i], pool[-1] = pool[-1], pool[i]
                    yield pool.pop()
        if not read:
            raise RuntimeError(f"no sample with .jpg and .cls members in {len(paths)} tar(s)")


def _tar_file_samples(path: str) -> Iterator[tuple[str, bytes, int]]:
    """One tar's samples: consecutive members sharing a key (name up to the first dot of its base name)."""
    key, parts = None, {}
    with tarfile.open(path, mode="r|") as tar:
        for member in tar:
            if not member.isfile():
                continue
            slash = member.name.rfind("/") + 1
            dot = member.name.find(".", slash)
            k, ext = member.name[:dot], member.name[dot + 1:]
            if k != key:
                if "jpg" in parts and "cls" in parts:
                    yield key, parts["jpg"], int(parts["cls"])
                key, parts = k, {}
            if ext in ("jpg", "cls"):
                parts[ext] = tar.extractfile(member).read()
    if "jpg" in parts and "cls" in parts:
        yield key, parts["jpg"], int(parts["cls"])


def rrc_box(width: int, height: int, rng: random.Random) -> tuple[int, int, int, int]:
    """torchvision's RandomResizedCrop.get_params: (left, top, crop width, crop height) of a width x height image."""
    area = width * height
    log_ratio = (math.log(RATIO[0]), math.log(RATIO[1]))
    for _ in range(10):
        target = area * rng.uniform(*SCALE)
        aspect = math.exp(rng.uniform(*log_ratio))
        w, h = round(math.sqrt(target * aspect)), round(math.sqrt(target / aspect))
        if 0 < w <= width and 0 < h <= height:
            return rng.randint(0, width - w), rng.randint(0, height - h), w, h
    ratio = width / height
    if ratio < RATIO[0]:
        w, h = width, round(width / RATIO[0])
    elif ratio > RATIO[1]:
        w, h = round(height * RATIO[1]), height
    else:
        w, h = width, height
    return (width - w) // 2, (height - h) // 2, w, h


def tensor_transform(size: int) -> Callable[["torch.Tensor"], "torch.Tensor"]:
    """transforms v2 RandomResizedCrop(antialias) + RandomHorizontalFlip on a uint8 [3, H, W] tensor."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, scale=SCALE, ratio=RATIO, antialias=True),
                       v2.RandomHorizontalFlip()])


def pil_transform(size: int) -> Callable[[Any], "torch.Tensor"]:
    """transforms v2 RandomResizedCrop(antialias) + RandomHorizontalFlip + PILToTensor (uint8 out) on a PIL image."""
    from torchvision.transforms import v2

    return v2.Compose([v2.RandomResizedCrop(size, scale=SCALE, ratio=RATIO, antialias=True),
                       v2.RandomHorizontalFlip(), v2.PILToTensor()])


def collate(items: list[tuple[Any, int]]) -> Batch:
    """[(image, label)] -> (uint8 [B, 3, S, S], int64 [B]); an image is a CHW tensor or an HWC numpy array (then the
    batch is a channels-last view, as gpufeed's)."""
    import numpy as np
    import torch

    images = [im for im, _ in items]
    labels = torch.tensor([lab for _, lab in items], dtype=torch.int64)
    if isinstance(images[0], np.ndarray):
        return torch.from_numpy(np.stack(images)).permute(0, 3, 1, 2), labels
    return torch.stack(images), labels


# --------------------------------------------------------------------------- the loaders (one function each)


def loader_imagefolder(spec: Spec) -> Iterator[Batch]:
    """torchvision ImageFolder on the JPEG folder + DataLoader (PIL decode, v2 transforms, uint8 out)."""
    import torch
    from torch.utils.data import DataLoader
    from torchvision.datasets import ImageFolder

    if not spec.src:
        raise ValueError("no --src (ImageFolder root) given")
    ds = ImageFolder(spec.src, transform=pil_transform(spec.image_size))
    nw = int(spec.params["num_workers"])
    dl = DataLoader(ds, batch_size=spec.batch_size, shuffle=True, num_workers=nw, drop_last=True,
                    persistent_workers=nw > 0, prefetch_factor=2 if nw else None,
                    generator=torch.Generator().manual_seed(spec.seed))
    return epochs(lambda epoch: dl)


def loader_wds_recipe(spec: Spec) -> Iterator[Batch]:
    """The webdataset README recipe on the shards, in a WebLoader."""
    import torch
    import webdataset as wds

    urls = shard_paths(spec.shards)
    ds = (wds.WebDataset(urls, shardshuffle=len(urls), empty_check=False, seed=spec.seed)
          .shuffle(spec.shuffle_buffer).decode("pil").to_tuple("jpg", "cls")
          .map_tuple(pil_transform(spec.image_size), identity).batched(spec.batch_size, partial=False))
    nw = int(spec.params.get("num_workers", PEER_WORKERS))
    dl = wds.WebLoader(ds, batch_size=None, num_workers=nw, persistent_workers=nw > 0,
                       prefetch_factor=2 if nw else None)
    # the recipe's labels arrive as an int64 numpy array or tensor (the DataLoader converts numpy); same bytes
    return ((images, torch.as_tensor(labels)) for images, labels in epochs(lambda epoch: dl))


def loader_gpufeed(spec: Spec) -> Iterator[Batch]:
    """gpufeed's own loader (build_loader over the shard set; simplejpeg decode unless the params say "roi"), epoch
    after epoch."""
    from gpufeed.config import LoaderConfig
    from gpufeed.core.world import World
    from gpufeed.loader import build_loader

    cfg = LoaderConfig(batch_size=spec.batch_size, image_size=spec.image_size,
                       decode=spec.params.get("decode", "simplejpeg"), pin_memory=False,
                       prefetch_factor=2, persistent_workers=True, shuffle_buffer=spec.shuffle_buffer, seed=spec.seed,
                       num_workers=int(spec.params["num_workers"]),
                       decode_threads=int(spec.params.get("decode_threads", 1)))
    import inspect

    # the batch buffers train and tune reuse (loader/ring.py), where this revision has them
    reuse = {"reuse_batches": True} if "reuse_batches" in inspect.signature(build_loader).parameters else {}
    loader = build_loader(spec.shards, cfg, World.single(), train=True, epoch=0, **reuse)

    def start(epoch: int) -> Iterable[Batch]:
        loader.set_epoch(epoch)
        return loader

    return epochs(start)


def loader_dali_cpu(spec: Spec) -> Iterator[Batch]:
    """NVIDIA DALI on the CPU only: webdataset reader -> fused decode + random crop -> resize -> mirror, CHW uint8."""
    import numpy as np
    import torch
    from nvidia.dali import fn, pipeline_def, types

    paths = shard_paths(spec.shards)
    if not spec.dali_index_dir:
        raise ValueError("no DALI index folder (made before the rounds)")
    index = [str(Path(spec.dali_index_dir) / (Path(p).stem + ".idx")) for p in paths]
    size = spec.image_size

    @pipeline_def(batch_size=spec.batch_size, num_threads=PEER_WORKERS, device_id=None, seed=spec.seed,
                  prefetch_queue_depth=2)
    def pipe() -> tuple[Any, Any]:
        jpegs, cls = fn.readers.webdataset(paths=paths, index_paths=index, ext=["jpg", "cls"], random_shuffle=True,
                                           initial_fill=spec.shuffle_buffer, name="reader")
        images = fn.decoders.image_random_crop(jpegs, device="cpu", output_type=types.RGB,
                                               random_area=list(SCALE), random_aspect_ratio=list(RATIO))
        images = fn.resize(images, resize_x=size, resize_y=size)
        images = fn.crop_mirror_normalize(images, dtype=types.UINT8, output_layout="CHW",
                                          mirror=fn.random.coin_flip())
        return images, cls

    p = pipe()
    p.build()

    def batches() -> Iterator[Batch]:
        while True:
            images, cls = p.run()
            x = torch.from_numpy(np.asarray(images.as_tensor()))
            y = torch.tensor([int(np.asarray(cls[i]).tobytes()) for i in range(len(cls))], dtype=torch.int64)
            yield x, y

    return batches()


def loader_spdl(spec: Spec) -> Iterator[Batch]:
    """SPDL pipeline: tarfile source -> decode + crop + resize + flip on threads -> aggregate(B) -> collate."""
    from spdl.pipeline import PipelineBuilder

    decode, detail = _spdl_decode_fn(spec)
    spec.params["detail"] = detail  # reported with the measurement (which decode ran)
    pipeline = (PipelineBuilder()
                .add_source(tar_samples(shard_paths(spec.shards), spec.seed, spec.shuffle_buffer))
                .pipe(decode, concurrency=PEER_WORKERS)
                .aggregate(spec.batch_size, drop_last=True)
                .pipe(collate)
                .add_sink(3)
                .build(num_threads=PEER_WORKERS))
    pipeline.start()
    return iter(pipeline.get_iterator())


def _spdl_decode_fn(spec: Spec) -> tuple[Callable[[tuple[str, bytes, int]], tuple[Any, int]], str]:
    """The SPDL thread stage: spdl.io (FFmpeg: demux, decode, crop, scale, hflip, rgb24 in one filter graph) or, when
    asked or when spdl.io cannot load its FFmpeg libraries (``--spdl-decode auto``), simplejpeg + transforms v2."""
    want = spec.params.get("decode", "auto")
    rng = random.Random(spec.seed)
    size = spec.image_size
    why = ""
    if want in ("auto", "ffmpeg"):
        try:
            import spdl.io
            import spdl.io.utils

            ff = spdl.io.utils.get_ffmpeg_versions()

            def decode_ffmpeg(item: tuple[str, bytes, int]) -> tuple[Any, int]:
                _, data, label = item
                packets = spdl.io.demux_image(data)
                left, top, w, h = rrc_box(packets.width, packets.height, rng)
                flip = ",hflip" if rng.random() < 0.5 else ""
                desc = (f"crop=w={w}:h={h}:x={left}:y={top},scale=w={size}:h={size}:flags=bilinear{flip},"
                        f"format=pix_fmts=rgb24")
                frames = spdl.io.decode_packets(packets, filter_desc=desc)
                return spdl.io.to_numpy(spdl.io.convert_frames(frames)), label

            return decode_ffmpeg, f"spdl.io decode (libavcodec {'.'.join(map(str, ff['libavcodec']))})"
        except Exception as exc:  # spdl.io needs FFmpeg's shared libraries
            if want == "ffmpeg":
                raise
            why = f" (spdl.io unavailable: {_one_line(exc, 80)})"
    import simplejpeg
    import torch

    tf = tensor_transform(size)

    def decode_simplejpeg(item: tuple[str, bytes, int]) -> tuple[Any, int]:
        _, data, label = item
        hwc = simplejpeg.decode_jpeg(data, colorspace="RGB")
        return tf(torch.from_numpy(hwc).permute(2, 0, 1)), label

    return decode_simplejpeg, "simplejpeg decode + transforms v2" + why


def loader_nodes(spec: Spec) -> Iterator[Batch]:
    """torchdata.nodes: tarfile source -> ParallelMapper(decode_crop_flip, threads) -> Batcher -> Mapper(collate)
    -> Prefetcher -> Loader."""
    import torch
    from torchdata.nodes import Batcher, IterableWrapper, Loader, Mapper, ParallelMapper, Prefetcher
    from torchvision.io import ImageReadMode, decode_jpeg

    tf = tensor_transform(spec.image_size)

    def decode_crop_flip(item: tuple[str, bytes, int]) -> tuple["torch.Tensor", int]:
        _, data, label = item
        encoded = torch.frombuffer(bytearray(data), dtype=torch.uint8)
        return tf(decode_jpeg(encoded, mode=ImageReadMode.RGB)), label

    node: Any = IterableWrapper(tar_samples(shard_paths(spec.shards), spec.seed, spec.shuffle_buffer))
    node = ParallelMapper(node, map_fn=decode_crop_flip, num_workers=PEER_WORKERS, method="thread")
    node = Batcher(node, batch_size=spec.batch_size, drop_last=True)
    node = Mapper(node, collate)
    node = Prefetcher(node, prefetch_factor=2)
    return iter(Loader(node))


LOADERS: dict[str, Callable[[Spec], Iterator[Batch]]] = {
    "imagefolder": loader_imagefolder, "wds-recipe": loader_wds_recipe, "gpufeed": loader_gpufeed,
    "dali-cpu": loader_dali_cpu, "spdl": loader_spdl, "nodes": loader_nodes,
}


# --------------------------------------------------------------------------- one measurement (child process)


def cpu_seconds() -> float:
    """User + system CPU seconds of this process (all its threads) and all its live children."""
    import psutil

    me = psutil.Process()
    total = 0.0
    for p in (me, *me.children(recursive=True)):
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.Error:  # a child that ended since the listing
            pass
    return total


def check_first(batch: Any, spec: Spec) -> str:
    """Refuse a first batch that is not (uint8 [B, 3, S, S], int64 [B]); its description otherwise."""
    import torch

    images, labels = batch
    B, S = spec.batch_size, spec.image_size
    if not (isinstance(images, torch.Tensor) and images.dtype == torch.uint8 and tuple(images.shape) == (B, 3, S, S)):
        raise AssertionError(f"images are {getattr(images, 'dtype', type(images).__name__)} "
                             f"{list(getattr(images, 'shape', []))}, not uint8 [{B}, 3, {S}, {S}]")
    if not (isinstance(labels, torch.Tensor) and labels.dtype == torch.int64 and tuple(labels.shape) == (B,)):
        raise AssertionError(f"labels are {getattr(labels, 'dtype', type(labels).__name__)} "
                             f"{list(getattr(labels, 'shape', []))}, not int64 [{B}]")
    return f"images {str(images.dtype).removeprefix('torch.')} {list(images.shape)}, labels int64 {list(labels.shape)}"


def measure(spec: Spec) -> dict[str, Any]:
    """Build the loader, read the warm-up batches, time one window: the result record."""
    import torch

    torch.set_num_threads(1)
    t0 = time.perf_counter()
    batches = LOADERS[spec.loader](spec)
    first = next(batches)
    startup = time.perf_counter() - t0
    shape = check_first(first, spec)
    for _ in range(spec.warmup - 1):
        next(batches)
    n = nb = 0
    c0, t1 = cpu_seconds(), time.perf_counter()
    while True:
        images, _ = next(batches)
        n += int(images.shape[0])
        nb += 1
        elapsed = time.perf_counter() - t1
        if (nb >= spec.window_batches) if spec.window_batches else (elapsed >= spec.window_s):
            break
    cpu = cpu_seconds() - c0
    return {"samples_per_s": n / elapsed, "samples_per_cpu_s": n / cpu if cpu > 0 else None, "cores": cpu / elapsed,
            "samples": n, "batches": nb, "window_s": elapsed, "cpu_s": cpu, "startup_s": startup,
            "first_batch": shape, "detail": spec.params.get("detail"), "loadavg_end": os.getloadavg()[0]}


def child_main(spec_path: str, out_path: str) -> None:
    """``--child SPEC OUT``: one measurement; the record (or its one-line error) goes to OUT. Exits hard so that no
    loader's teardown can hang the run (the parent then ends what is left of the process group)."""
    spec = Spec(**json.loads(Path(spec_path).read_text()))
    if spec.params.get("src"):  # gpufeed-before: that revision's package, found before this checkout's
        sys.path.insert(0, spec.params["src"])
    try:
        rec = measure(spec)
    except BaseException as exc:  # noqa: BLE001 - any failure is the loader's result
        rec = {"error": _one_line(exc)}
    Path(out_path).write_text(json.dumps(rec))
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _one_line(exc: BaseException, limit: int = 200) -> str:
    text = " ".join(str(exc).split()) or "(no message)"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= limit else text[:limit - 3] + "..."


# --------------------------------------------------------------------------- the parent: runs, rounds, report


def run_one(spec: Spec, timeout_s: float) -> dict[str, Any]:
    """Run ``spec`` in a fresh process group, killed after ``window + timeout_s`` seconds; its record or error."""
    limit = (spec.window_s if not spec.window_batches else 0.0) + timeout_s
    with tempfile.TemporaryDirectory(prefix="bench_peers-") as tmp:
        spec_path, out_path, err_path = Path(tmp, "spec.json"), Path(tmp, "out.json"), Path(tmp, "stderr.txt")
        spec_path.write_text(json.dumps(dataclasses.asdict(spec)))
        t0 = time.perf_counter()
        with open(err_path, "w") as err:
            proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", str(spec_path),
                                     str(out_path)], stdout=err, stderr=err, cwd=ROOT, start_new_session=True)
            try:
                proc.wait(timeout=limit)
                timed_out = False
            except subprocess.TimeoutExpired:
                timed_out = True
            finally:
                try:  # the child and whatever it left behind (workers, threads' processes)
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait()
        wall = time.perf_counter() - t0
        if timed_out:
            return {"error": f"timed out after {limit:.0f} s (start-up, warm-up and window)", "wall_s": wall}
        if out_path.exists():
            rec = json.loads(out_path.read_text())
        else:
            lines = [ln.strip() for ln in err_path.read_text(errors="replace").splitlines() if ln.strip()]
            rec = {"error": f"exited {proc.returncode} with no result" + (f": {lines[-1][:160]}" if lines else "")}
        rec["wall_s"] = wall
        return rec


def describe(variant: str, params: dict[str, Any]) -> str:
    if variant.startswith("gpufeed"):
        return (f"workers={params['num_workers']} threads={params.get('decode_threads', 1)} "
                f"{params.get('decode', 'simplejpeg')}" + (f" @{params['rev']}" if params.get("rev") else ""))
    if variant == "imagefolder":
        return f"workers={params['num_workers']} PIL"
    if variant == "wds-recipe":
        return f"workers={params.get('num_workers', PEER_WORKERS)} PIL"
    if variant == "spdl":
        return f"threads={PEER_WORKERS} decode={params.get('decode', 'auto')}"
    return f"threads={PEER_WORKERS}"


def export_src(rev: str, dest: Path) -> str:
    """``src/`` of git revision ``rev`` of this checkout, written under ``dest``; the folder to import gpufeed from."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(dest)], input=archive, check=True, capture_output=True)
    return str(dest / "src")


def git_commit(rev: str) -> str:
    return subprocess.run(["git", "-C", str(ROOT), "rev-parse", rev], capture_output=True, text=True).stdout.strip()


def make_dali_index(paths: list[str], dest: Path) -> float:
    """DALI's index of every tar (its wds2idx tool's IndexCreator) into ``dest``; seconds taken."""
    from wds2idx import IndexCreator

    t0 = time.perf_counter()
    for p in paths:
        with IndexCreator(p, str(dest / (Path(p).stem + ".idx")), verbose=False) as ic:
            ic.create_index()
    return time.perf_counter() - t0


def machine_info() -> dict[str, Any]:
    import psutil

    from gpufeed.core.system import cgroup_cpu_quota

    model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu_model": model or platform.processor(), "cores_affinity": len(os.sched_getaffinity(0)),
            "cpu_count": os.cpu_count(), "cgroup_cpu_quota": cgroup_cpu_quota(),
            "ram_bytes": int(psutil.virtual_memory().total), "platform": platform.platform(),
            "python": sys.version.split()[0], "hostname": platform.node()}


def versions() -> dict[str, Any]:
    """Installed versions of every library any loader uses (None: not installed), and the checkout's commit."""
    from importlib.metadata import PackageNotFoundError, distributions, version

    out: dict[str, Any] = {}
    for dist in ("gpufeed", "torch", "torchvision", "torchdata", "webdataset", "spdl", "simplejpeg", "pillow", "numpy",
                 "psutil"):
        try:
            out[dist] = version(dist)
        except PackageNotFoundError:
            out[dist] = None
    dali = sorted({(d.metadata["Name"] or "").lower(): d.version for d in distributions()
                   if (d.metadata["Name"] or "").lower().startswith("nvidia-dali")}.items())
    out["nvidia-dali"] = dict(dali) or None
    nvimg = sorted({(d.metadata["Name"] or "").lower(): d.version for d in distributions()
                    if (d.metadata["Name"] or "").lower().startswith("nvidia-nvimgcodec")}.items())
    out["nvidia-nvimgcodec"] = dict(nvimg) or None
    try:
        import spdl.io.utils

        out["spdl_ffmpeg"] = {k: ".".join(map(str, v)) for k, v in spdl.io.utils.get_ffmpeg_versions().items()}
    except Exception as exc:  # noqa: BLE001 - spdl or its FFmpeg libraries missing
        out["spdl_ffmpeg"] = f"unavailable: {_one_line(exc, 120)}"
    try:
        git = ["git", "-C", str(ROOT)]
        out["git_commit"] = subprocess.run([*git, "rev-parse", "HEAD"], capture_output=True, text=True).stdout.strip()
        out["git_dirty"] = bool(subprocess.run([*git, "status", "--porcelain", "--untracked-files=no"],
                                               capture_output=True, text=True).stdout.strip())
    except OSError:
        pass
    return out


class Runner:
    """Runs measurements for one benchmark: the specs it builds, the log lines, the loaders that failed."""

    def __init__(self, args: argparse.Namespace, shards: str):
        self.args = args
        self.shards = shards
        self.failed: dict[str, str] = {}
        """Loader label -> its one-line failure; a failed loader is not run again."""
        self.dali_index_dir: str | None = None
        self.before_src: str | None = None
        """The ``src/`` folder of ``--before REV`` (exported into a temporary folder), when asked for."""
        self._shown: set[str] = set()

    def spec(self, loader: str, params: dict[str, Any], rnd: int, window: float) -> Spec:
        a = self.args
        return Spec(loader=loader, shards=self.shards, src=str(a.src) if a.src else None, batch_size=a.batch_size,
                    image_size=a.image_size, seed=a.seed + rnd, shuffle_buffer=a.shuffle_buffer, params=dict(params),
                    warmup=max(1, a.warmup), window_s=window, window_batches=a.window_batches,
                    dali_index_dir=self.dali_index_dir)

    def run(self, label: str, spec: Spec, what: str) -> dict[str, Any]:
        """One measurement, logged (the first batch's shape once per loader)."""
        rec = run_one(spec, self.args.timeout)
        head = f"{what:9} {label:12} {describe(label, spec.params):34}"
        if "error" in rec:
            log(f"{head} failed: {rec['error']}")
            return rec
        if label not in self._shown:
            self._shown.add(label)
            log(f"{label} first batch: {rec['first_batch']}" + (f"; {rec['detail']}" if rec.get("detail") else ""))
        log(f"{head} {rec['samples_per_s']:7.1f} samples/s {_f(rec['samples_per_cpu_s'], 1):>6} /CPU-s  "
            f"cores {rec['cores']:.2f}  start-up {rec['startup_s']:.2f} s")
        return rec

    def sweep(self, label: str, loader: str, candidates: Iterable[dict[str, Any]],
              window: float) -> tuple[dict[str, Any] | None, list[dict[str, Any]]]:
        """One window per candidate config: the fastest one's params (None, and ``label`` failed, when none ran)."""
        recs = [{"params": dict(c), **self.run(label, self.spec(loader, c, 0, window), "sweep")} for c in candidates]
        ok = [r for r in recs if "error" not in r]
        if not ok:
            self.failed[label] = recs[-1]["error"] if recs else "nothing to sweep"
            return None, recs
        return max(ok, key=lambda r: r["samples_per_s"])["params"], recs


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shards", type=Path, required=True, help="gpufeed shard set (folder with manifest.json)")
    ap.add_argument("--src", type=Path, help="ImageFolder root of the same JPEGs (for imagefolder)")
    ap.add_argument("--only", help=f"comma-separated loaders of {','.join(VARIANTS)} ('gpufeed' = its three)")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--image-size", type=int, default=224)
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds, order rotated each round")
    ap.add_argument("--window", type=float, default=6.0, help="seconds per measurement window")
    ap.add_argument("--window-batches", type=int, help="a window of this many batches instead of --window seconds")
    ap.add_argument("--warmup", type=int, default=3, help="batches read before the window (the first included)")
    ap.add_argument("--sweep-window", type=float, help="window of the best-of sweeps (default: --window)")
    ap.add_argument("--if-workers", default="2,3,4", help="num_workers the imagefolder sweep tries")
    ap.add_argument("--no-gpufeed-sweep", action="store_true", help="skip the gpufeed-best pass")
    ap.add_argument("--before", metavar="REV", help="also measure gpufeed at this git revision (gpufeed-before)")
    ap.add_argument("--spdl-decode", choices=("auto", "ffmpeg", "simplejpeg"), default="auto",
                    help="spdl's decode: spdl.io (FFmpeg), simplejpeg, or spdl.io when it loads (auto)")
    ap.add_argument("--shuffle-buffer", type=int, default=1000, help="samples in every loader's shuffle buffer")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout", type=float, default=120.0,
                    help="seconds a run may take beyond its window (start-up, warm-up) before it is killed and failed")
    ap.add_argument("--out", type=Path, help="JSON path (default benchmarks/results/bench_peers-<timestamp>.json)")
    args = ap.parse_args()

    only = [v.strip() for v in (args.only or ",".join(VARIANTS)).split(",") if v.strip()]
    only = [g for v in only for g in (("gpufeed-w2", "gpufeed-t2", "gpufeed-roi", "gpufeed-best") if v == "gpufeed"
                                      else (v,))]
    unknown = sorted(set(only) - set(VARIANTS))
    if unknown:
        ap.error(f"unknown loader(s) {', '.join(unknown)}; pick from {', '.join(VARIANTS)}")
    if args.no_gpufeed_sweep and "gpufeed-best" in only:
        only.remove("gpufeed-best")
    if args.before and "gpufeed-before" not in only:
        only.append("gpufeed-before")
    elif not args.before and "gpufeed-before" in only:
        ap.error("gpufeed-before needs --before REV")
    args.selected = [v for v in VARIANTS if v in only]
    if not args.selected:
        ap.error("no loader left to run")
    try:
        args.num_shards = len(shard_paths(str(args.shards)))
    except Exception as exc:  # noqa: BLE001 - not a shard set: nothing to compare
        ap.error(f"--shards {args.shards}: {_one_line(exc)}")
    if args.src is not None and not args.src.is_dir():
        ap.error(f"--src {args.src} is not a folder")
    return args


def plan_variants(runner: Runner, record: dict[str, Any]) -> dict[str, tuple[str, dict[str, Any]]]:
    """label -> (loader key, params) of every loader the rounds measure, after the best-of sweeps (their records go
    into ``record["sweeps"]``)."""
    args, selected, failed = runner.args, runner.args.selected, runner.failed
    sweep_window = args.sweep_window or args.window
    plan: dict[str, tuple[str, dict[str, Any]]] = {}
    record["sweeps"] = {}
    if "imagefolder" in selected:
        if args.src is None:
            failed["imagefolder"] = "no --src (ImageFolder root) given"
        else:
            workers = [{"num_workers": int(x)} for x in args.if_workers.split(",") if x.strip()]
            best, record["sweeps"]["imagefolder"] = runner.sweep("imagefolder", "imagefolder", workers, sweep_window)
            if best is not None:
                plan["imagefolder"] = ("imagefolder", best)
                log(f"imagefolder: best num_workers = {best['num_workers']}")
    if "wds-recipe" in selected:
        plan["wds-recipe"] = ("wds-recipe", {"num_workers": PEER_WORKERS})
    for label, params in GPUFEED_FIXED.items():
        if label in selected:
            plan[label] = ("gpufeed", dict(params))
    if "gpufeed-before" in selected and runner.before_src:
        plan["gpufeed-before"] = ("gpufeed", {**GPUFEED_FIXED["gpufeed-w2"], "src": runner.before_src,
                                              "rev": args.before})
    if "gpufeed-best" in selected:
        best, record["sweeps"]["gpufeed"] = runner.sweep("gpufeed-best", "gpufeed", GPUFEED_SWEEP, sweep_window)
        if best is not None:
            same = next((lab for lab, p in GPUFEED_FIXED.items() if p == best and lab in selected), None)
            record["gpufeed_best"] = {"params": best, "same_as": same}
            if same:
                log(f"gpufeed-best = {same} ({describe('gpufeed', best)}): not measured twice")
            else:
                plan["gpufeed-best"] = ("gpufeed", best)
                log(f"gpufeed-best: {describe('gpufeed', best)}")
    if "dali-cpu" in selected and "dali-cpu" not in failed:
        plan["dali-cpu"] = ("dali-cpu", {})
    if "spdl" in selected:
        plan["spdl"] = ("spdl", {"decode": args.spdl_decode})
    if "nodes" in selected:
        plan["nodes"] = ("nodes", {})
    return plan


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child_main(sys.argv[2], sys.argv[3])
        return
    args = parse_args()
    stamp = dt.datetime.now(dt.timezone.utc)
    out = args.out or ROOT / "benchmarks" / "results" / f"bench_peers-{stamp:%Y%m%d-%H%M%S}.json"
    t_start = time.monotonic()
    record: dict[str, Any] = {
        "date": stamp.isoformat(timespec="seconds"), "command": shlex.join([sys.executable, *sys.argv]),
        "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "machine": {**machine_info(), "loadavg_start": os.getloadavg()}, "versions": versions(),
        "torch_threads_per_measured_process": 1, "peer_workers": PEER_WORKERS,
    }
    log(f"{args.shards} ({args.num_shards} shards): loaders {', '.join(args.selected)}; batch {args.batch_size}, "
        f"{args.rounds} round(s) of "
        + (f"{args.window_batches} batches" if args.window_batches else f"{args.window:g} s windows"))
    runner = Runner(args, str(args.shards.resolve()))

    with tempfile.TemporaryDirectory(prefix="bench_peers-dali-") as dali_dir:
        if "dali-cpu" in args.selected:  # DALI's indexes, made once and not timed (a one-off step like sharding)
            try:
                record["dali_index_s"] = make_dali_index(shard_paths(runner.shards), Path(dali_dir))
                runner.dali_index_dir = dali_dir
                log(f"DALI indexes for the shards in {record['dali_index_s']:.1f} s")
            except Exception as exc:  # noqa: BLE001 - DALI (its wds2idx) missing, or the tar tool
                runner.failed["dali-cpu"] = f"index: {_one_line(exc)}"
        if args.before:  # that revision's package, exported once (not timed)
            try:
                runner.before_src = export_src(args.before, Path(dali_dir) / "before")
                record["before"] = {"rev": args.before, "commit": git_commit(args.before)}
            except (OSError, subprocess.CalledProcessError) as exc:
                runner.failed["gpufeed-before"] = f"git archive {args.before}: {_one_line(exc)}"
        plan = plan_variants(runner, record)

        # interleaved rounds, the order rotated each round
        names = [v for v in VARIANTS if v in plan]
        runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
        for rnd in range(args.rounds):
            k = rnd % len(names) if names else 0
            for pos, name in enumerate(names[k:] + names[:k]):
                if name in runner.failed:
                    continue
                key, params = plan[name]
                r = runner.run(name, runner.spec(key, params, rnd, args.window), f"round {rnd + 1}/{args.rounds}")
                runs[name].append({"round": rnd, "position": pos, **r})
                if "error" in r:
                    runner.failed[name] = r["error"]

    rows = summarize(args.selected, plan, runs, runner.failed, record.get("gpufeed_best"))
    record.update(plan={n: {"loader": k, "params": p} for n, (k, p) in plan.items()}, runs=runs, failed=runner.failed,
                  rows=rows, total_s=time.monotonic() - t_start)
    record["machine"]["loadavg_end"] = os.getloadavg()
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(record, indent=1, default=str) + "\n")
    print_table(rows, args, record)
    print(f"wrote {out} (total {record['total_s']:.0f} s)")


def summarize(selected: list[str], plan: dict[str, tuple[str, dict[str, Any]]], runs: dict[str, list[dict[str, Any]]],
              failed: dict[str, str], gpufeed_best: dict[str, Any] | None) -> list[dict[str, Any]]:
    """One row per selected loader: medians over its rounds, or its failure; gpufeed's best median over its own."""
    rows = []
    for name in selected:
        ok = [r for r in runs.get(name, []) if "error" not in r]
        row: dict[str, Any] = {"loader": name, "config": describe(name, plan[name][1]) if name in plan else None}
        if name == "gpufeed-best" and gpufeed_best and gpufeed_best.get("same_as"):
            row["config"] = f"= {gpufeed_best['same_as']}"
            row["alias"] = gpufeed_best["same_as"]
        elif name in failed or not ok:
            row["failed"] = failed.get(name, "no run")
        if ok and "failed" not in row:
            rates = [r["samples_per_s"] for r in ok]
            per_cpu = [r["samples_per_cpu_s"] for r in ok if r["samples_per_cpu_s"]]
            row.update(samples_per_s=statistics.median(rates), min=min(rates), max=max(rates), rounds=len(ok),
                       samples_per_cpu_s=statistics.median(per_cpu) if per_cpu else None,
                       cores=statistics.median(r["cores"] for r in ok),
                       startup_s=statistics.median(r["startup_s"] for r in ok),
                       detail=next((r["detail"] for r in ok if r.get("detail")), None))
        rows.append(row)
    gp = [r for r in rows if r["loader"].startswith("gpufeed") and r["loader"] != "gpufeed-before"
          and r.get("samples_per_s")]
    best = max(gp, key=lambda r: r["samples_per_s"]) if gp else None
    for r in rows:
        r["gpufeed_best_over_this"] = (best["samples_per_s"] / r["samples_per_s"]) if best and r.get("samples_per_s") \
            else None
        r["gpufeed_best_is"] = best["loader"] if best else None
    return rows


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace, record: dict[str, Any]) -> None:
    m = record["machine"]
    best = next((r["gpufeed_best_is"] for r in rows if r.get("gpufeed_best_is")), None)
    window = f"{args.window_batches} batches" if args.window_batches else f"{args.window:g} s"
    print(f"\npeer loaders: {args.shards}, batch {args.batch_size}, {args.image_size}px uint8, {args.rounds} "
          f"interleaved round(s) x {window}; {m['cores_affinity']} cores ({m['cpu_model']}), load "
          f"{m['loadavg_start'][0]:.2f} -> {m['loadavg_end'][0]:.2f}")
    head = (f"{'loader':13} {'config':36} {'samples/s median (min-max)':>27} {'/CPU-s':>7} {'cores':>5} "
            f"{'start s':>7} {'x ' + (best or 'gpufeed'):>16}")
    print(head)
    print("-" * len(head))
    for r in rows:
        if "failed" in r:
            print(f"{r['loader']:13} {(r['config'] or '')[:36]:36} failed: {r['failed']}")
            continue
        if "alias" in r:
            print(f"{r['loader']:13} {r['config'][:36]:36} (the same config as {r['alias']})")
            continue
        rate = f"{r['samples_per_s']:.1f} ({r['min']:.1f}-{r['max']:.1f})"
        print(f"{r['loader']:13} {r['config'][:36]:36} {rate:>27} {_f(r['samples_per_cpu_s'], 1):>7} "
              f"{r['cores']:5.2f} {r['startup_s']:7.2f} {_f(r['gpufeed_best_over_this'], 2):>16}")
    for r in rows:
        if r.get("detail"):
            print(f"  {r['loader']}: {r['detail']}")
    if best:
        print(f"  last column: {best} (gpufeed's best median) / the loader's median samples/s")


def _f(v: float | None, d: int) -> str:
    return "-" if v is None else f"{v:.{d}f}"


if __name__ == "__main__":
    main()
