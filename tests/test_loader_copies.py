"""No copy or allocation the loader does not need (issue 21): a worker's batch leaves as the shared tensor it was
decoded into, workers reuse batch buffers once nothing in the main process reads them (and never sooner), a
main-process batch for CUDA is decoded straight into pinned memory, and the train resize writes into the batch row
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
    images, labels, skipped, repeated, worker, slot = rows.take(0, 0)
    assert images.is_shared() and slot == -1
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


def _ring(shards, **kw):
    """A loader whose workers reuse their batch buffers, as train and tune build it."""
    from gpufeed.loader import build_loader

    on = {"batch_size": 2, "num_workers": 2, "prefetch_factor": 1, "persistent_workers": True}
    return build_loader(shards, cfg(**{**on, **kw}), World.single(), reuse_batches=True)


def _epochs(shards, epochs: int, hold: bool, **kw) -> list:
    """Every batch of ``epochs`` epochs: kept as handed out (``hold``: no copy, the loader's memory itself) or cloned."""
    loader = _ring(shards, **kw)
    out = []
    for epoch in range(epochs):
        loader.set_epoch(epoch)
        out += [(images, labels) if hold else (images.clone(), labels.clone()) for images, labels in loader]
    return out, loader


def _same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


def test_batches_kept_by_the_caller_are_never_rewritten(tmp_path):
    """The caller keeps every batch: no slot goes back, each later batch takes memory of its own, and every kept batch
    still holds its own pixels at the end (as a run that cloned each batch at once)."""
    shards = write_set(tmp_path / "set", [6, 6, 6, 6])
    held, loader = _epochs(shards, 3, hold=True)
    cloned, _ = _epochs(shards, 3, hold=False)
    assert len(held) == 36 and _same(held, cloned)
    assert loader._returns is not None and loader._returns.pending  # held: none given back


def test_batches_the_caller_lets_go_of_are_reused(tmp_path):
    """Batches dropped at once go back to their worker: few distinct buffers serve many batches, with the same
    pixels as a run that cloned each batch."""
    shards = write_set(tmp_path / "set", [6, 6, 6, 6])
    loader = _ring(shards)
    seen, pixels = set(), []
    for epoch in range(3):
        loader.set_epoch(epoch)
        for images, labels in loader:
            seen.add(images.untyped_storage().data_ptr())
            pixels.append((images.clone(), labels.clone()))
            del images, labels
    cloned, _ = _epochs(shards, 3, hold=False)
    slots = loader._returns.flags.slots * 2
    assert len(pixels) == 36 and _same(pixels, cloned) and len(seen) <= slots, (len(seen), slots)


def test_a_view_the_caller_keeps_holds_the_slot(tmp_path):
    """A view (or NumPy array) of a batch keeps its memory in use: the slot stays out until it is dropped."""
    shards = write_set(tmp_path / "set", [6, 6, 6, 6])
    it = iter(_ring(shards))
    first, _ = next(it)
    kept, want = first[0].numpy(), first[0].clone()
    del first
    rest = [images.clone() for images, _ in it]
    assert len(rest) == 11 and np.array_equal(kept, want.numpy())


def test_epochs_left_early_give_their_slots_back(tmp_path, monkeypatch):
    """Batches in flight when an epoch is left early never arrive; the next iteration gives their slots back (after
    the DataLoader's reset has dropped them). So after eight cut epochs, two full ones with the caller dropping every
    batch take no buffer outside the ring, and every batch is the one a clone-at-once run got."""
    import itertools

    from gpufeed.loader.shard_loader import ShardLoader

    slots: list[int] = []
    count = ShardLoader._count
    monkeypatch.setattr(ShardLoader, "_count", lambda self, item: (slots.append(item[5]), count(self, item))[1])
    shards = write_set(tmp_path / "set", [6, 6, 6, 6])

    def run(loader, cut_epochs: int) -> list:
        out = []
        for epoch in range(cut_epochs + 2):
            loader.set_epoch(epoch)
            keep = len(loader) - 1 - epoch % 3 if epoch < cut_epochs else len(loader)
            if epoch == cut_epochs:
                slots.clear()
            for images, labels in itertools.islice(loader, keep):
                out.append((images.clone(), labels.clone()))
                del images, labels
        return out

    got = run(_ring(shards, prefetch_factor=2), 8)
    assert len(slots) == 24 and -1 not in slots, slots
    assert _same(got, run(_ring(shards, prefetch_factor=2, persistent_workers=False), 8))


def test_a_set_epoch_made_while_an_earlier_iteration_is_open_holds(tmp_path):
    """set_epoch(e, start) while an earlier iteration is suspended: dropping that iteration must not undo the start
    (the next one yields the epoch from ``start``, not from 0)."""
    import gc

    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [6, 6, 6, 6])
    loader = build_loader(shards, cfg(batch_size=2), World.single())
    it = iter(loader)
    next(it)
    loader.set_epoch(1, 2)
    del it
    gc.collect()
    assert sum(1 for _ in loader) == len(loader) - 2


@pytest.mark.parametrize("kw", [{"persistent_workers": False}, {"num_workers": 0}, {"decode": "gpu"},
                                {"worker_batching": False}, {}], ids=str)
def test_the_ring_runs_only_where_asked_and_one_process_per_worker_serves_the_loader(tmp_path, kw):
    """Off by default: another process's hold on a batch, and a bare storage object's, are not seen by the use count
    (the ``reuse_batches`` contract); on when asked, with persistent workers, batches made in the workers, CPU decode."""
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [4, 4])
    on = {"batch_size": 2, "num_workers": 2, "persistent_workers": True}
    assert build_loader(shards, cfg(**{**on, **kw}), World.single())._returns is None
    ring = build_loader(shards, cfg(**{**on, **kw}), World.single(), reuse_batches=True)._returns
    assert (ring is not None) is (kw == {})
