"""The loader: shapes, rank/worker splitting, decode agreement with PIL, corrupt samples, determinism."""

from __future__ import annotations

import io
import random
import tarfile
import warnings

import numpy as np
import pytest
import torch
from PIL import Image

from gpufeed.core.errors import DataError
from gpufeed.core.world import World
from tests.common.shards import cfg, encode, smooth_image, write_set, write_tar


@pytest.fixture
def shard_set(tmp_path):
    return write_set(tmp_path / "set", [7, 5, 6, 4])  # 22 samples, uneven shards


@pytest.mark.parametrize("workers", [0, 2])
def test_shapes_dtypes_labels(shard_set, workers):
    from gpufeed.loader import build_loader

    loader = build_loader(shard_set, cfg(num_workers=workers), World.single())
    assert len(loader) == 22 // 4
    batches = list(loader)
    assert len(batches) == len(loader)
    for images, labels in batches:
        assert images.dtype == torch.uint8 and tuple(images.shape) == (4, 3, 16, 16)
        assert labels.dtype == torch.int64 and tuple(labels.shape) == (4,)
        assert labels.min() >= 0 and labels.max() < 3
    assert loader.num_skipped == 0


def _seen(shards, world_size, workers, batch_size, epoch=0, **kw):
    """Per rank: list of sample ids, recovered from labels of a set whose label is the sample id."""
    from gpufeed.loader import build_loader

    out = []
    for r in range(world_size):
        loader = build_loader(shards, cfg(num_workers=workers, batch_size=batch_size, **kw),
                              World(rank=r, world_size=world_size), epoch=epoch)
        ids = [int(x) for _, labels in loader for x in labels]
        out.append((len(loader), ids))
    return out


def test_two_ranks_two_workers_disjoint_cover_equal(tmp_path):
    sizes = [7, 5, 6, 4, 9]  # 31 samples over 5 shards: divides by neither ranks nor workers
    shards = write_set(tmp_path / "ids", sizes, num_classes=sum(sizes))  # label == sample id
    per_rank = _seen(shards, 2, 2, 3)
    lens = {n for n, _ in per_rank}
    assert lens == {31 // 2 // 3}
    all_ids = [i for _, ids in per_rank for i in ids]
    assert all(len(ids) == n * 3 for n, ids in per_rank)
    assert len(all_ids) == len(set(all_ids)), "a sample was seen twice"
    assert len(all_ids) == 5 * 3 * 2 and len(all_ids) >= 31 - 2 * (3 + 2)  # covers the epoch up to drop-last

    # no shuffle: coverage is exactly the first samples of each (rank, worker) range
    per_rank = _seen(shards, 2, 2, 3, shuffle_buffer=0)
    assert sorted(i for _, ids in per_rank for i in ids) == sorted(set(i for _, ids in per_rank for i in ids))


def test_plan_covers_every_sample_once():
    from gpufeed.loader import plan_slot

    counts = [7, 5, 6, 4, 9, 1]
    for ws, nw, bs in [(2, 2, 3), (3, 1, 2), (1, 4, 5), (4, 3, 1)]:
        covered = []
        for r in range(ws):
            nb = 0
            for w in range(nw):
                p = plan_slot(counts, rank=r, world_size=ws, worker=w, num_workers=nw, batch_size=bs, seed=1,
                              epoch=2, shuffle=True)
                assert p.num_samples >= p.num_batches * bs
                nb += p.num_batches
                covered += [(s.shard, i) for s in p.segments for i in range(s.start, s.stop)]
            assert nb == sum(counts) // ws // bs
        assert sorted(covered) == sorted((s, i) for s, n in enumerate(counts) for i in range(n))


def test_epochs_and_seed_determinism(tmp_path):
    shards = write_set(tmp_path / "ids", [6, 6, 6, 6], num_classes=24)
    from gpufeed.loader import build_loader

    def run(epoch, seed=0, workers=2):
        loader = build_loader(shards, cfg(num_workers=workers, seed=seed, shuffle_buffer=10), World.single(), epoch=epoch)
        return [(labels.tolist(), images.sum().item()) for images, labels in loader]

    a, b = run(0), run(0)
    assert a == b
    assert run(1) != a
    assert run(0, seed=5) != a

    loader = build_loader(shards, cfg(num_workers=2, persistent_workers=True), World.single())
    e0 = [l.tolist() for _, l in loader]
    loader.set_epoch(1)
    e1 = [l.tolist() for _, l in loader]
    assert e0 != e1 and sorted(sum(e0, [])) != [] and len(e1) == len(e0)


def test_eval_is_ordered_and_unflipped(tmp_path):
    shards = write_set(tmp_path / "ids", [5, 5, 5], num_classes=15)
    from gpufeed.loader import build_loader

    loader = build_loader(shards, cfg(num_workers=0, batch_size=5), World.single(), train=False)
    labels = [i for _, l in loader for i in l.tolist()]
    assert labels == list(range(15))


def test_per_sample_mode_matches_worker_batching(shard_set):
    from gpufeed.loader import build_loader

    a = [(i.clone(), l) for i, l in build_loader(shard_set, cfg(num_workers=2), World.single())]
    b = [(i.clone(), l) for i, l in build_loader(shard_set, cfg(num_workers=2, worker_batching=False), World.single())]
    assert len(a) == len(b)

    def samples(batches):  # per-sample mode interleaves the workers sample by sample, not batch by batch
        return sorted((int(l), i.numpy().tobytes()) for images, labels in batches for i, l in zip(images, labels))

    assert samples(a) == samples(b)


# --------------------------------------------------------------------------- decode agreement


def torchvision_reference(data: bytes, size: int, crop_ratio: float = 0.875) -> np.ndarray:
    import torchvision.transforms as T

    img = Image.open(io.BytesIO(data)).convert("RGB")
    img = T.CenterCrop(size)(T.Resize(int(size / crop_ratio))(img))
    return np.asarray(img)


@pytest.mark.parametrize("resize", ["torch", "pil"])
@pytest.mark.parametrize("method,tol", [("pil", 0.6), ("pil-draft", 3.0), ("simplejpeg", 3.0)])
def test_decode_paths_agree_with_torchvision_pil(method, tol, resize):
    """Eval transform; mean abs diff vs PIL full decode + torchvision Resize/CenterCrop, on smooth images.

    pil: same pixels up to rounding (<= 0.6; torch's uint8 kernel is PIL's filter within 1 grey level);
    pil-draft and simplejpeg decode at a reduced DCT scale (different IDCT downsampling and upsampling):
    <= 3.0 grey levels.
    """
    if method == "simplejpeg":
        pytest.importorskip("simplejpeg")
    from gpufeed.loader import decode as dec

    S = 32
    for seed, (w, h) in enumerate([(300, 200), (150, 210), (97, 61), (64, 64)]):
        data = encode(smooth_image(w, h, seed), quality=95)
        ref = torchvision_reference(data, S).astype(np.float32)
        out = np.empty((S, S, 3), np.uint8)
        dec.decode_into(data, "jpg", method, lambda ww, hh: dec.eval_crop(ww, hh, S), S, out, resize=resize)
        diff = np.abs(out.astype(np.float32) - ref)
        assert diff.mean() <= tol, (method, w, h, diff.mean())


@pytest.mark.parametrize("resize", ["torch", "pil"])
def test_train_crop_matches_torchvision_random_resized_crop(resize):
    """Same crop box as torchvision's RandomResizedCrop + flip; same pixels but at the box edges (mean <= 0.1)."""
    import torchvision.transforms.functional as TF

    from gpufeed.loader import decode as dec

    S = 24
    data = encode(smooth_image(120, 90, 3), quality=95)
    for k in range(5):
        rng = random.Random(k)
        crop = dec.train_crop(120, 90, rng)
        out = np.empty((S, S, 3), np.uint8)
        dec.decode_into(data, "jpg", "pil", lambda w, h: crop, S, out, resize=resize)
        l, t, r, b = crop.box
        img = TF.resized_crop(Image.open(io.BytesIO(data)).convert("RGB"), t, l, b - t, r - l, [S, S])
        if crop.flip:
            img = TF.hflip(img)
        # torch: same kernel within 1 grey level; PIL resize(box=...) also sees the pixels just outside the box
        diff = np.abs(np.asarray(img).astype(np.int16) - out)
        assert diff.mean() <= 0.1 and diff.max() <= 3


def test_crop_params_follow_torchvision_rules():
    from gpufeed.loader.decode import random_resized_crop_params

    rng = random.Random(0)
    for _ in range(300):
        i, j, h, w = random_resized_crop_params(200, 100, rng)
        assert 0 <= i and i + h <= 100 and 0 <= j and j + w <= 200
        assert 0.08 * 0.9 <= h * w / 20000 <= 1.0
    # the fallback (a very wide image): centre crop clamped to the ratio range, as torchvision
    import torchvision.transforms as T

    assert random_resized_crop_params(1000, 10, random.Random(0)) == T.RandomResizedCrop.get_params(
        torch.zeros(3, 10, 1000), scale=[0.08, 1.0], ratio=[3 / 4, 4 / 3])


def test_decode_leaves_the_warning_filters_alone():
    """Importing gpufeed.loader.decode adds no process-wide filter; its resize of a read-only array (np.asarray of a PIL
    image) silences torch's 'not writable' warning at that call only, so it passes even with warnings as errors."""
    import subprocess
    import sys

    code = "\n".join([
        "import warnings, numpy as np, PIL.Image, torch, gpufeed.config, gpufeed.core.errors",  # they add their own filters
        "before = list(warnings.filters)",
        "from gpufeed.loader import decode as dec",
        "assert warnings.filters == before, [f for f in warnings.filters if f not in before]",
        "warnings.simplefilter('error')",
        "arr = np.asarray(PIL.Image.new('RGB', (24, 20), (9, 99, 199)))",
        "assert not arr.flags.writeable",
        "out = np.zeros((8, 8, 3), np.uint8)",
        "dec.resize_array_into(arr, dec.Crop((2, 2, 20, 18)), 8, out)",
        "assert (out == (9, 99, 199)).all()",
    ])
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


@pytest.mark.parametrize("mode", ["L", "CMYK", "P", "RGBA"])
def test_every_mode_becomes_rgb(mode):
    from gpufeed.loader import decode as dec

    img = smooth_image(60, 50, 1)
    fmt = "PNG" if mode in ("P", "RGBA") else "JPEG"
    data = encode(img.convert(mode), fmt)
    ext = "png" if fmt == "PNG" else "jpg"
    methods = ["pil", "pil-draft"] + (["simplejpeg"] if _has_simplejpeg() else [])
    ref = torchvision_reference(data, 16).astype(np.float32)
    for m in methods:
        out = np.empty((16, 16, 3), np.uint8)
        dec.decode_into(data, ext, m, lambda w, h: dec.eval_crop(w, h, 16), 16, out)
        assert np.abs(out - ref).mean() <= 3.0, (mode, m)


@pytest.mark.parametrize("subsampling", [0, 2])
def test_cmyk_jpeg_with_any_sampling_decodes_on_every_path(subsampling):
    """TurboJPEG's header parser rejects CMYK JPEGs with 4:2:0 sampling: simplejpeg must fall back to PIL."""
    from gpufeed.loader import decode as dec

    buf = io.BytesIO()
    smooth_image(60, 50, 2).convert("CMYK").save(buf, "JPEG", quality=95, subsampling=subsampling)
    data = buf.getvalue()
    ref = torchvision_reference(data, 16).astype(np.float32)
    methods = ["pil", "pil-draft"] + (["simplejpeg"] if _has_simplejpeg() else [])
    for m in methods:
        out = np.empty((16, 16, 3), np.uint8)
        dec.decode_into(data, "jpg", m, lambda w, h: dec.eval_crop(w, h, 16), 16, out)
        assert np.abs(out - ref).mean() <= 3.0, (subsampling, m)


def _has_simplejpeg() -> bool:
    try:
        import simplejpeg  # noqa: F401
    except ImportError:
        return False
    return True


def test_gpu_path_prepares_encoded_batches_and_decodes_on_cpu(tmp_path):
    """decode='gpu': workers ship JPEG bytes + crops; to_device decodes them (here with torchvision on CPU)."""
    from gpufeed.loader import EncodedBatch, build_loader

    def make(n):
        img = smooth_image(48, 40, n)
        return ("png", encode(img, "PNG")) if n % 4 == 0 else ("jpg", encode(img, quality=95))

    shards = write_set(tmp_path / "mix", [6, 6], make=make, size=(48, 40))
    kw = dict(num_workers=2, batch_size=4, image_size=16)
    per_sample = build_loader(shards, cfg(decode="gpu", worker_batching=False, **kw), World.single(), train=False)
    assert [len(e) for e, _ in per_sample] == [4, 4, 4]
    g = build_loader(shards, cfg(decode="gpu", **kw), World.single(), train=False)
    p = build_loader(shards, cfg(decode="pil", **kw), World.single(), train=False)
    for (enc, lg), (ref, lp) in zip(g, p):
        assert isinstance(enc, EncodedBatch) and enc.num_encoded >= 2 and len(enc) == 4
        images, labels = g.to_device((enc, lg), "cpu")
        assert images.dtype == torch.uint8 and tuple(images.shape) == (4, 3, 16, 16)
        assert torch.equal(labels, lp)
        assert (images.float() - ref.float()).abs().mean() <= 2.0  # roi_align vs PIL bilinear: ~0.4 on photos


@pytest.mark.gpu
def test_gpu_decode_on_cuda(shard_set):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    from gpufeed.loader import build_loader

    g = build_loader(shard_set, cfg(decode="gpu", num_workers=2), World.single("cuda:0"), train=False)
    p = build_loader(shard_set, cfg(decode="pil", num_workers=2), World.single(), train=False)
    for b, (ref, _) in zip(g, p):
        images, labels = g.to_device(b, "cuda:0")
        assert images.is_cuda and images.dtype == torch.uint8
        assert (images.cpu().float() - ref.float()).abs().mean() <= 4.0


# --------------------------------------------------------------------------- corrupt samples


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_sample_raise_names_shard_and_key(tmp_path, workers):
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "bad", [6, 6], corrupt={8})
    loader = build_loader(shards, cfg(num_workers=workers, batch_size=3), World.single())
    with pytest.raises(DataError, match=r"s00008.*train-000001\.tar"):
        list(loader)


@pytest.mark.parametrize("workers", [0, 2])
def test_corrupt_sample_skip_counts_and_keeps_batch_count(tmp_path, workers):
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "bad", [6, 6], corrupt={1, 8})
    loader = build_loader(shards, cfg(num_workers=workers, batch_size=3, on_error="skip"), World.single())
    batches = list(loader)
    assert len(batches) == len(loader) == 4
    assert loader.num_skipped == 2
    assert loader.num_repeated == 2  # the 12-sample epoch is filled by re-reading 2 samples


def test_normalize():
    from gpufeed.loader import IMAGENET_MEAN, IMAGENET_STD, normalize

    x = torch.full((2, 3, 4, 4), 255, dtype=torch.uint8)
    y = normalize(x, channels_last=True)
    assert y.dtype == torch.float32 and y.is_contiguous(memory_format=torch.channels_last)
    assert torch.allclose(y[0, :, 0, 0], torch.tensor([(1 - m) / s for m, s in zip(IMAGENET_MEAN, IMAGENET_STD)]))
    assert normalize(x, dtype=torch.bfloat16).dtype == torch.bfloat16


def test_missing_manifest_and_too_small_set(tmp_path, shard_set):
    from gpufeed.loader import build_loader

    with pytest.raises(DataError, match="gpufeed index"):
        build_loader(tmp_path / "nothing-here", cfg(), World.single()) if (tmp_path / "nothing-here").mkdir() is None else None
    with pytest.raises(DataError, match="batch_size"):
        build_loader(shard_set, cfg(batch_size=64), World.single())


# --------------------------------------------------------------------------- the fast tar reader


def test_fast_tar_reader_matches_webdataset(tmp_path):
    """gpufeed.shardset.tar groups and counts exactly as webdataset (ustar, GNU and pax long names, dirs)."""
    import webdataset as wds

    from functools import partial

    from gpufeed.loader.reader import READ_EXTENSIONS
    from gpufeed.shardset.keys import READ_IMAGE_EXTENSIONS, wanted

    _select = partial(wanted, extensions=READ_EXTENSIONS)  # the members the loader reads, for webdataset
    from gpufeed.shardset.tar import iter_samples

    long_dir = "d" * 120
    members = [("a.jpg", b"1"), ("a.cls", b"0"), ("a.json", b"{}"), ("dir/b.png", b"22"), ("dir/b.cls", b"1"),
               ("orphan.cls", b"3"), (f"{long_dir}/c.JPEG", b"333"), (f"{long_dir}/c.cls", b"2"),
               ("e.seg.png", b"4"), ("e.cls", b"1"), ("f.webp", b"5" * 1000)]
    for fmt in (tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT):
        path = tmp_path / f"x{fmt}.tar"
        first = [] if fmt == tarfile.USTAR_FORMAT else [("dir", b"")]  # an empty regular member named "dir"
        write_tar(path, first + [(name, data) for name, data in members if not (
            fmt == tarfile.USTAR_FORMAT and len(name) > 100 and "/" not in name[-100:])], format=fmt)
        ref = []
        for s in wds.WebDataset(str(path), shardshuffle=False, nodesplitter=None, workersplitter=None,
                                select_files=_select, empty_check=False):
            if any(e in s for e in READ_IMAGE_EXTENSIONS):
                ref.append({k: v for k, v in s.items() if not k.startswith("__")} | {"__key__": s["__key__"]})
        got = [{k: v for k, v in s.items() if k != "__url__"} for s in
               iter_samples(str(path), READ_EXTENSIONS, READ_IMAGE_EXTENSIONS)]
        assert got == ref, fmt
        assert len(got) >= 4
        assert [s["__key__"] for s in iter_samples(str(path), READ_EXTENSIONS, READ_IMAGE_EXTENSIONS, 1, 3)] == \
            [s["__key__"] for s in ref[1:3]]


@pytest.mark.parametrize("fast", [True, False])
def test_truncated_shard_under_both_policies(tmp_path, fast):
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "trunc", [6, 6])
    p = shards / "train-000001.tar"
    p.write_bytes(p.read_bytes()[: p.stat().st_size // 2 + 100])
    loader = build_loader(shards, cfg(batch_size=3), World.single(), fast_tar=fast)
    with pytest.raises(DataError, match="train-000001.tar"):
        list(loader)
    loader = build_loader(shards, cfg(batch_size=3, on_error="skip"), World.single(), fast_tar=fast)
    assert len(list(loader)) == 4 and loader.num_skipped >= 1


def test_loads_gpufeed_shard_output(tmp_path, image_folder):
    """The loader reads what ``gpufeed shard`` writes: ImageFolder labels, every sample once (eval, no shuffle)."""
    shard_mod = pytest.importorskip("gpufeed.shard")
    from gpufeed.config import ShardConfig
    from gpufeed.loader import build_loader

    src = image_folder(classes=3, per_class=5, size=(40, 30))
    dest = tmp_path / "shards"
    shard_mod.write_shards(ShardConfig(src=str(src), dest=str(dest), shard_samples=4, workers=1), progress=False)
    seen = []
    for r in range(2):
        loader = build_loader(dest, cfg(batch_size=2, num_workers=2), World(rank=r, world_size=2), train=False)
        assert len(loader) == 15 // 2 // 2 and loader.manifest.classes == ["class_0", "class_1", "class_2"]
        seen += [int(x) for _, labels in loader for x in labels]
    assert len(seen) == 12 and set(seen) <= {0, 1, 2}


# --------------------------------------------------------------------------- device decode memory


def _gpu_decode_padded_whole(batch, device):
    """The former gpu_decode: every whole image padded to the batch's largest (reference for the crop-first one)."""
    from torchvision.ops import roi_align

    from gpufeed.loader.gpu import jpeg_decoder

    S = batch.size
    decoded = jpeg_decoder()(batch.chunks(), device)
    hmax = max(int(x.shape[1]) for x in decoded)
    wmax = max(int(x.shape[2]) for x in decoded)
    padded = torch.zeros((len(decoded), 3, hmax, wmax), dtype=torch.uint8, device=device)
    for k, img in enumerate(decoded):
        h, w = int(img.shape[1]), int(img.shape[2])
        padded[k, :, :h, :w] = img
        if w < wmax:
            padded[k, :, :h, w] = img[:, :, w - 1]
        if h < hmax:
            padded[k, :, h, : min(w + 1, wmax)] = padded[k, :, h - 1, : min(w + 1, wmax)]
    rois = torch.tensor([(k, *box) for k, box in enumerate(batch.boxes)], dtype=torch.float32)
    crops = roi_align(padded.float(), rois, output_size=(S, S), spatial_scale=1.0, sampling_ratio=-1, aligned=True)
    crops = torch.where(torch.tensor(batch.flips).view(-1, 1, 1, 1), crops.flip(-1), crops)
    return crops.round_().clamp_(0, 255).to(torch.uint8)


def test_gpu_decode_crops_before_padding(monkeypatch):
    """Mixed sizes (300x200, 40x30, 64x64) with train, eval, whole-image, edge and upscaled crops: same pixels as
    padding whole images (within 1 level), while roi_align sees a buffer bounded by the crops, not the images."""
    import torchvision.ops

    from gpufeed.loader import decode as dec
    from gpufeed.loader import EncodedBatch, crop_buffer_shape, crop_window, gpu_decode

    S = 16
    sizes = [(300, 200), (40, 30), (64, 64), (300, 200), (40, 30)]
    crops = [dec.Crop((10, 20, 50, 61), flip=True), dec.eval_crop(40, 30, S), dec.Crop((40, 44, 64, 64)),
             dec.Crop((283.5, 0.25, 300, 17.75)), dec.Crop((0, 0, 40, 30), flip=True)]
    data = [encode(smooth_image(w, h, k), quality=95) for k, (w, h) in enumerate(sizes)]
    batch = EncodedBatch([], [], [], [], torch.zeros((5, S, S, 3), dtype=torch.uint8), S)
    for k, (d, c) in enumerate(zip(data, crops)):
        batch.data.append(d)
        batch.index.append(k)
        batch.boxes.append(tuple(float(v) for v in c.box))
        batch.flips.append(c.flip)
    batch.pack()
    seen = []
    real = torchvision.ops.roi_align

    def spy(x, *args, **kw):
        seen.append(tuple(x.shape))
        return real(x, *args, **kw)

    monkeypatch.setattr(torchvision.ops, "roi_align", spy)

    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # TorchCodec, not torchvision.io's deprecated decode_jpeg
        warnings.simplefilter("error", UserWarning)
        out = gpu_decode(batch, "cpu")
    windows = [crop_window(b, w, h) for b, (w, h) in zip(batch.boxes, sizes)]
    assert seen == [(5, 3, *crop_buffer_shape(windows))]
    assert crop_buffer_shape(windows) == (43, 42)  # the 40 x 41 crop + 1 px each side; images are up to 300 x 200
    assert windows[0] == (9, 19, 51, 62) and windows[3] == (282, 0, 300, 19)
    ref = _gpu_decode_padded_whole(batch, "cpu")
    assert tuple(out.shape) == (5, 3, S, S)
    assert (out.int() - ref.int()).abs().max() <= 1
