"""No copy the loader does not need (issue 21): a worker's batch leaves as the shared tensor it was decoded into,
a main-process batch for CUDA is decoded straight into pinned memory, and the train resize writes into the batch row
(flipping the crop on the way in), with the same pixels as resizing, then flipping, then copying."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from gpufeed.core.world import World
from gpufeed.loader import decode as dec
from gpufeed.loader.dataset import BatchRows
from tests.common.shards import cfg, write_set


def test_a_workers_batch_is_the_shared_tensor_it_was_decoded_into():
    """torch sends a shared tensor by handle; a tensor it does not see as shared (a NumPy view of one) is copied into
    new shared memory when it is sent, a whole batch per batch."""
    rows = BatchRows(2, 8, shared=True, gpu=False)
    for label in (3, 4):
        images, _, row = rows.target()
        images[row] = label
        rows.add(label)
    images, labels, skipped, repeated = rows.take(0, 0)
    assert images.is_shared()
    assert images.shape == (2, 3, 8, 8) and images[1].eq(4).all() and labels.tolist() == [3, 4]


def _reference(arr: np.ndarray, box, flip: bool, size: int) -> np.ndarray:
    l, t, r, b = box
    src = torch.from_numpy(arr[t:b, l:r]).permute(2, 0, 1).unsqueeze(0).contiguous(memory_format=torch.channels_last)
    y = F.interpolate(src, size=(size, size), mode="bilinear", antialias=True, align_corners=False)
    if flip:
        y = y.flip(-1)
    return y[0].permute(1, 2, 0).numpy()


@pytest.mark.parametrize("direct", [True, False], ids=["into-the-row", "public-kernel"])
def test_the_train_resize_gives_resize_then_flip_pixels(monkeypatch, direct):
    if not direct:  # a torch without the kernel's out= form: F.interpolate and a copy
        monkeypatch.setattr(dec, "_AA_OUT", [None])
    rng = np.random.default_rng(0)
    arr = rng.integers(0, 256, (90, 120, 3), dtype=np.uint8)
    pick = random.Random(1)
    for _ in range(40):
        h, w = pick.randint(1, 90), pick.randint(1, 120)
        t, l = pick.randint(0, 90 - h), pick.randint(0, 120 - w)
        flip, size = pick.random() < 0.5, pick.choice((16, 32, 57))
        out = np.zeros((size, size, 3), np.uint8)
        dec.resize_array_into(arr, dec.Crop((l, t, l + w, t + h), flip), size, out)
        assert np.array_equal(out, _reference(arr, (l, t, l + w, t + h), flip, size)), (l, t, w, h, flip, size)


def test_a_non_contiguous_row_takes_the_copying_path():
    arr = np.random.default_rng(2).integers(0, 256, (40, 50, 3), dtype=np.uint8)
    wide = np.zeros((16, 32, 3), np.uint8)
    out = wide[:, ::2]  # a strided row: the kernel's out= would not write it in place
    dec.resize_array_into(arr, dec.Crop((3, 4, 40, 30), True), 16, out)
    assert np.array_equal(out, _reference(arr, (3, 4, 40, 30), True, 16)) and not wide[:, 1::2].any()


def _fake_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(World, "is_cuda", property(lambda self: True))


@pytest.mark.parametrize("workers", [0, 2])
def test_pinning_for_cuda_is_done_once(tmp_path, monkeypatch, workers):
    """num_workers = 0: the batch is made in pinned memory and the DataLoader pins nothing again; with workers the
    DataLoader's pin thread copies the workers' shared batches into pinned memory (the one copy left there)."""
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [4, 4])
    _fake_cuda(monkeypatch)
    loader = build_loader(shards, cfg(batch_size=2, num_workers=workers, pin_memory=True), World.single())
    assert loader._dataset.pin_rows is (workers == 0)
    assert loader._loader.pin_memory is (workers > 0)
    loader = build_loader(shards, cfg(batch_size=2, num_workers=0, pin_memory=False), World.single())
    assert loader._dataset.pin_rows is False and loader._loader.pin_memory is False


@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs CUDA")
def test_main_process_batches_are_pinned_on_cuda(tmp_path):  # pragma: no cover - runs on a GPU machine
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [4, 4])
    loader = build_loader(shards, cfg(batch_size=2, num_workers=0, pin_memory=True), World.single("cuda"))
    images, labels = next(iter(loader))
    assert images.is_pinned() and labels.is_pinned()
