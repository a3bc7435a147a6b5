"""Resume without replay: ``set_epoch(epoch, start_batch)`` yields the uninterrupted epoch's batches from there,
passing over the first ones without decoding; crops depend on (seed, epoch, shard, key) only."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpufeed.core.errors import DataError, GpufeedError
from gpufeed.core.world import World
from tests.common.shards import cfg, write_set

BAD = {3, 10, 17}
"""Samples whose image is not an image at all: refused from the header, under on_error = "skip"."""


def _resume_set(tmp_path, sizes):
    from tests.common.shards import encode, smooth_image

    def make(n):
        return ("jpg", b"not an image" if n in BAD else encode(smooth_image(40, 32, n), quality=95))

    return write_set(tmp_path / "set", sizes, num_classes=sum(sizes), make=make)  # label = sample id


def _loader(shards, epoch=0, **kw):
    from gpufeed.loader import build_loader

    return build_loader(shards, cfg(**{"on_error": "skip", **kw}), World.single(), epoch=epoch)


def _batches(loader):
    return [(images.clone(), labels.clone()) for images, labels in loader]


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


# 25 samples in batches of 3: 8 batches, the 3 corrupt ones replaced by spare samples and re-reads;
# 28 in batches of 4: 7 batches (one worker yields one more), no spare sample, so a worker re-reads its range
@pytest.mark.parametrize("sizes,batch", [([7, 5, 6, 7], 3), ([7, 5, 6, 7, 3], 4)])
@pytest.mark.parametrize("worker_batching", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_start_batch_yields_the_rest_of_the_uninterrupted_epoch(tmp_path, workers, worker_batching, sizes, batch):
    shards = _resume_set(tmp_path, sizes)
    kw = dict(num_workers=workers, worker_batching=worker_batching, batch_size=batch)
    first = _loader(shards, epoch=1, **kw)
    full = _batches(first)
    assert len(full) == sum(sizes) // batch
    assert first.num_skipped == len(BAD)
    for k in range(1, len(full) + 1):  # late starts pass over the corrupt samples of every worker
        loader = _loader(shards, **kw)
        loader.set_epoch(1, start_batch=k)
        rest = _batches(loader)
        assert _same(rest, full[k:]), f"start_batch={k}"
        assert loader.position.batches_consumed == len(full)
    # the start applies to one iteration: the next one is the whole epoch again
    assert _same(_batches(loader), full)


@pytest.mark.parametrize("worker_batching", [True, False])
def test_skipped_batches_are_not_decoded(tmp_path, monkeypatch, worker_batching):
    from gpufeed.loader import decode as dec

    shards = write_set(tmp_path / "set", [7, 5, 6, 4])  # 22 samples, 5 batches of 4
    calls = []
    real = dec.decode_into

    def counting(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(dec, "decode_into", counting)
    loader = _loader(shards, num_workers=0, worker_batching=worker_batching)
    loader.set_epoch(0, start_batch=3)
    assert len(list(loader)) == 2
    assert len(calls) == (5 - 3) * 4


def test_crops_of_a_sample_do_not_depend_on_the_worker_layout(tmp_path):
    shards = write_set(tmp_path / "set", [7, 5, 6, 4], num_classes=22)  # label = sample id

    def by_label(workers, epoch=0):
        return {int(l): i.numpy().tobytes() for images, labels in _loader(shards, epoch, num_workers=workers)
                for i, l in zip(images, labels)}

    one, two = by_label(1), by_label(2)
    common = one.keys() & two.keys()
    assert len(common) >= 18  # each layout drops its own 2 spare samples
    assert all(one[k] == two[k] for k in common)
    other_epoch = by_label(1, epoch=1)
    assert any(one[k] != other_epoch[k] for k in common & other_epoch.keys())  # the epoch is part of the seed


def test_position_and_resume(tmp_path):
    from gpufeed.loader import LoaderPosition

    shards = write_set(tmp_path / "set", [7, 5, 6, 4])
    full = _batches(_loader(shards, epoch=2, num_workers=2))
    loader = _loader(shards, epoch=2, num_workers=2)
    it = iter(loader)
    for _ in range(2):
        next(it)
    pos = loader.position
    assert pos == LoaderPosition(2, 2)
    del it
    stored = LoaderPosition.from_dict(pos.to_dict())
    fresh = _loader(shards, num_workers=2)
    fresh.resume(stored)
    assert fresh.position == LoaderPosition(2, 2)
    assert _same(_batches(fresh), full[2:])
    fresh.resume(LoaderPosition(2, len(fresh)))  # a finished epoch resumes at the start of the next one
    assert fresh.position == LoaderPosition(3, 0)
    with pytest.raises(GpufeedError):
        fresh.resume(LoaderPosition(2, len(fresh) + 1))


@pytest.mark.parametrize("bad", [None, [], {"epoch": 1}, {"epoch": True, "batches_consumed": 0},
                                 {"epoch": 0, "batches_consumed": -1}, {"epoch": "0", "batches_consumed": 0},
                                 {"epoch": 0, "batches_consumed": 2**70}])
def test_stored_position_is_validated(bad):
    from gpufeed.loader import LoaderPosition

    with pytest.raises(DataError):
        LoaderPosition.from_dict(bad)


class _Counted(IterableDataset):
    def __init__(self, counts):
        self.counts = counts

    def __iter__(self):
        w = get_worker_info().id
        return iter([(w, i) for i in range(self.counts[w])])


def test_items_taken_follows_torch_dataloader_order():
    """The round-robin that ``items_taken`` assumes, checked against the installed torch's DataLoader."""
    from gpufeed.loader import items_taken

    counts = [5, 3, 4]
    order = [tuple(int(v) for v in x) for x in DataLoader(_Counted(counts), batch_size=None, num_workers=3)]
    assert sorted(order) == sorted((w, i) for w, n in enumerate(counts) for i in range(n))
    for m in range(len(order) + 1):
        seen = [sum(1 for w, _ in order[:m] if w == x) for x in range(3)]
        assert items_taken(counts, m) == seen, m
    assert items_taken([8, 8, 4], 18) == [7, 7, 4]


def test_plan_and_position_import_no_torch():
    """The epoch plan and the resume position are torch-free: a fresh interpreter imports them (and the package,
    whose torch-bound names load on first use) without loading torch."""
    import subprocess
    import sys

    code = ("import sys, gpufeed.loader, gpufeed.loader.plan, gpufeed.loader.position; "
            "from gpufeed.loader import LoaderPosition, plan_slot, items_taken; "
            "assert 'torch' not in sys.modules, 'torch imported'")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr


def test_stages_reread_count_the_first_pass_losses_and_pass_over_a_resume():
    """The stages on their own: a range with a corrupt sample is re-read to fill the quota, its loss counted once
    (the first pass's) and the re-read samples as repeated; a resume's first sample is checked, not decoded; under
    ``on_error = "raise"`` the handler raises the one-line sentence."""
    from gpufeed.loader.stages import Decode, OnError, batch, fill

    samples = [{"__ext__": "jpg", "__key__": k, "jpg": b"x", "__url__": "s.tar"} for k in "abc"]
    decoded, checked = [], []

    def decode(sample, ext, data):
        if sample["__key__"] == "b":
            raise ValueError("bad")
        decoded.append(sample["__key__"])

    class Rows:
        def __init__(self):
            self.labels = []

        def add(self, label):
            self.labels.append(label)
            return len(self.labels) == 2

        def take(self, skipped, repeated):
            out, self.labels = (self.labels, skipped, repeated), []
            return out

    handler = OnError("skip")
    stage = Decode(lambda s: ord(s["__key__"]), checked.append, decode, handler, skip=1)
    out = list(batch(fill(lambda: stage(iter(samples)), 5, handler, "none readable"), Rows()))
    assert out == [([99, 97], 1, 1), ([99, 97], 0, 2)]
    assert decoded == ["c", "a", "c", "a"] and checked == [b"x"] and handler.lost == 2
    strict = Decode(lambda s: 0, checked.append, decode, OnError("raise"))
    with pytest.raises(DataError, match=r"^corrupt sample 'b.jpg' in shard s.tar: ValueError: bad$"):
        list(strict(iter(samples)))


@pytest.mark.parametrize("worker_batching", [True, False])
def test_main_process_sets_threads_once_per_batch(tmp_path, monkeypatch, worker_batching):
    """num_workers = 0: one intra-op thread while a batch is made, the caller's setting between batches."""
    from gpufeed.loader import decode as dec

    shards = write_set(tmp_path / "set", [7, 5, 6, 4])
    prev = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        calls, decoding = [], []
        real, real_decode = torch.set_num_threads, dec.decode_into
        monkeypatch.setattr(torch, "set_num_threads", lambda n: (calls.append(n), real(n)))
        monkeypatch.setattr(dec, "decode_into",
                            lambda *a, **kw: (decoding.append(torch.get_num_threads()), real_decode(*a, **kw)))
        seen = [torch.get_num_threads() for _ in _loader(shards, num_workers=0, worker_batching=worker_batching)]
        assert seen == [2] * 5
        assert decoding == [1] * 20
        assert calls == [1, 2] * 6  # five batches, then the call that finds the epoch over
    finally:
        torch.set_num_threads(prev)
