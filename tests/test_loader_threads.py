"""Thread workers (``decode_threads`` > 1): the same batches, bit for bit, as one decode thread - same samples, order,
crops, resume and ``on_error`` counts, batch by batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gpufeed.core.world import World
from tests.common.shards import cfg, encode, smooth_image, write_set

NOT_IMAGE = {3, 17}
"""Refused from the header."""
TRUNCATED = {8, 21}
"""A valid header, then cut: fails in the decode thread."""


def _set(tmp_path, sizes=(7, 5, 6, 7, 3)):
    def make(n):
        if n in NOT_IMAGE:
            return "jpg", b"not an image"
        data = encode(smooth_image(40 + n % 5, 32 + n % 3, n), quality=95)
        return "jpg", data[: len(data) // 2] if n in TRUNCATED else data

    return write_set(tmp_path / "set", list(sizes), num_classes=sum(sizes), make=make)  # label = sample id


def _run(shards, start_batch=0, **kw):
    from gpufeed.loader import build_loader

    loader = build_loader(shards, cfg(**{"on_error": "skip", "batch_size": 4, **kw}), World.single(), epoch=1)
    loader.set_epoch(1, start_batch)
    out = []
    for images, labels in loader:
        out.append((images.clone(), labels.clone(), loader.num_skipped, loader.num_repeated))
    return out


def _same(a, b):
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) and x[2:] == y[2:]
                                    for x, y in zip(a, b))


@pytest.mark.parametrize("decode", ["pil-draft", "simplejpeg"])
@pytest.mark.parametrize("workers,worker_batching", [(0, True), (2, True), (2, False)])
def test_threads_give_the_same_batches_and_counts(tmp_path, decode, workers, worker_batching):
    shards = _set(tmp_path)
    kw = dict(decode=decode, num_workers=workers, worker_batching=worker_batching)
    ref = _run(shards, **kw)
    assert ref[-1][2] == len(NOT_IMAGE) + len(TRUNCATED)
    for threads in (2, 3):
        assert _same(_run(shards, decode_threads=threads, **kw), ref), f"decode_threads={threads}"


@pytest.mark.parametrize("workers", [0, 2])
def test_threads_resume_where_one_thread_does(tmp_path, workers):
    shards = _set(tmp_path)
    full = _run(shards, num_workers=workers)
    for k in (1, 3, len(full) - 1):
        rest = _run(shards, start_batch=k, num_workers=workers, decode_threads=2)
        ref = _run(shards, start_batch=k, num_workers=workers)
        assert _same(rest, ref) and all(torch.equal(x[0], y[0]) for x, y in zip(rest, full[k:])), f"start {k}"


def test_read_ahead_losses_past_the_quota_are_not_counted():
    """A loss the upstream reports after the last sample the quota needs: the sequential stages never read that far,
    so the threaded stage, which did (read-ahead), takes it back; losses are attributed to the same items."""
    from gpufeed.loader.stages import Decode, OnError, ThreadedDecode, fill

    def run(threaded: bool, quota: int):
        handler = OnError("skip")

        def upstream():
            for n in range(12):
                if n in (2, 9):
                    handler("a shard problem", 5)
                yield {"__ext__": "jpg", "__key__": str(n), "jpg": b"x" if n == 6 else b"ok", "n": n}

        def decode_to(sample, ext, data, out):
            if data == b"x":
                raise ValueError("broken")
            out[0] = sample["n"]

        got = []
        if threaded:
            stage = ThreadedDecode(lambda s: s["n"], lambda d: None, decode_to, lambda out: got.append(int(out[0])),
                                   lambda: np.zeros(1, np.int64), handler, threads=2)
        else:
            buf = np.zeros(1, np.int64)
            stage = Decode(lambda s: s["n"], lambda d: None,
                           lambda s, e, d: (decode_to(s, e, d, buf), got.append(int(buf[0]))), handler)
        items = [(item, lost) for item, lost, _ in fill(lambda: stage(upstream()), quota, handler, "empty")]
        if threaded:
            stage.close()
        return items, got, handler.lost

    for quota in (3, 8, 11, 15):
        assert run(True, quota) == run(False, quota), f"quota {quota}"


def test_decode_threads_is_a_tuner_knob():
    from gpufeed.config import LoaderConfig
    from gpufeed.tune import KNOBS, trial_record

    assert "decode_threads" in KNOBS
    lc = LoaderConfig(decode_threads=3)
    assert trial_record(lc, [1.0]).loader_config().decode_threads == 3
