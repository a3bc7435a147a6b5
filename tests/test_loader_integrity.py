"""The loader checks what it reads against the manifest: short, empty, cut and over-full shards, wrong counts,
every lost sample counted, duplicates counted apart, one-sentence errors from workers."""

from __future__ import annotations

import json
import tarfile
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from gpufeed.core.world import World
from tests.common.shards import cfg, sizes_as_found, write_set


def _ids_set(tmp_path: Path, sizes=(6, 6)) -> Path:
    """Shards whose label is the sample id (num_classes = number of samples)."""
    return write_set(tmp_path / "set", list(sizes), num_classes=sum(sizes), size=(16, 12))


def _load(shards: Path, fast: bool = True, **kw):
    from gpufeed.loader import build_loader

    loader = build_loader(shards, cfg(**{"batch_size": 3, "shuffle_buffer": 0, **kw}), World.single(), fast_tar=fast)
    ids = [int(x) for _, labels in loader for x in labels]
    return loader, ids


def _member_offset(path: Path, name: str) -> int:
    """Byte offset of the header of member ``name``."""
    with tarfile.open(path) as tf:
        return tf.getmember(name).offset


@pytest.mark.parametrize("fast", [True, False])
def test_empty_shard_is_an_error_and_counted_under_skip(tmp_path, fast):
    shards = _ids_set(tmp_path)
    (shards / "train-000001.tar").write_bytes(b"")
    with pytest.raises(DataError, match=r"train-000001\.tar"):
        _load(shards, fast)
    loader, ids = _load(shards, fast, on_error="skip")
    assert len(ids) == 12 and set(ids) == set(range(6))
    assert loader.num_skipped == 6
    assert loader.num_repeated == 6


@pytest.mark.parametrize("fast", [True, False])
def test_shard_cut_at_a_member_boundary(tmp_path, fast):
    """A shard cut just before sample 9's first member reads as a valid 3-sample tar: the manifest says 6."""
    shards = _ids_set(tmp_path)
    p = shards / "train-000001.tar"
    p.write_bytes(p.read_bytes()[: _member_offset(p, "s00009.jpg")])
    sizes_as_found(shards)
    with pytest.raises(DataError, match=r"train-000001\.tar holds 3 samples, the manifest says 6"):
        _load(shards, fast)
    loader, ids = _load(shards, fast, on_error="skip")
    assert set(ids) == set(range(9))
    assert loader.num_skipped == 3 and loader.num_repeated == 3


def test_truncated_member_counts_every_lost_sample(tmp_path):
    """Cut inside sample 8's image: samples 7..11 are lost (5, not 1: sample 7 ends only where the next
    readable header begins); the 5 re-read to fill the epoch are counted apart."""
    shards = _ids_set(tmp_path)
    p = shards / "train-000001.tar"
    p.write_bytes(p.read_bytes()[: _member_offset(p, "s00008.jpg") + 512 + 10])
    sizes_as_found(shards)
    with pytest.raises(DataError, match=r"train-000001\.tar.*'s00008\.jpg'"):
        _load(shards)
    loader, ids = _load(shards, on_error="skip")
    assert len(ids) == 12 and set(ids) == set(range(7))
    assert loader.num_skipped == 5 and loader.num_repeated == 5


def test_truncated_gzip_shard_counts_every_lost_sample(tmp_path):
    """The gzip path (TarPass): whatever it could not deliver is counted, sample by sample."""
    import gzip

    from gpufeed.shardset.manifest import read_manifest, write_manifest

    shards = _ids_set(tmp_path)
    m = read_manifest(shards)
    for s in m.shards:
        src = shards / s.name
        data = gzip.compress(src.read_bytes())
        if s.name.endswith("1.tar"):
            data = data[: len(data) * 2 // 3]
        (shards / (src.stem + ".tgz")).write_bytes(data)
        src.unlink()
    import dataclasses

    m = dataclasses.replace(m, shards=[dataclasses.replace(s, name=s.name[:-4] + ".tgz") for s in m.shards],
                            compression="gzip")
    (shards / "manifest.json").unlink()
    write_manifest(shards, m)
    sizes_as_found(shards)
    with pytest.raises(DataError, match=r"train-000001\.tgz"):
        _load(shards)
    loader, ids = _load(shards, on_error="skip")
    good = len(set(ids))
    assert 6 <= good < 12 and len(ids) == 12
    assert loader.num_skipped == 12 - good and loader.num_repeated == 12 - good


def _set_counts(shards: Path, counts: list[int]) -> None:
    path = shards / "manifest.json"
    d = json.loads(path.read_text())
    for s, n in zip(d["shards"], counts):
        s["num_samples"] = n
    d["num_samples"] = sum(counts)
    path.write_text(json.dumps(d))


def test_manifest_promising_more_than_the_shards_hold(tmp_path):
    shards = _ids_set(tmp_path)
    _set_counts(shards, [12, 12])  # x2
    with pytest.raises(DataError, match=r"train-00000[01]\.tar holds 6 samples, the manifest says 12"):
        _load(shards)
    loader, ids = _load(shards, on_error="skip")
    assert len(ids) == 24 and set(ids) == set(range(12))
    assert loader.num_skipped == 12 and loader.num_repeated == 12


def test_manifest_promising_fewer_than_the_shards_hold(tmp_path):
    shards = _ids_set(tmp_path)
    _set_counts(shards, [4, 6])  # shard 0 really holds 6: samples 4 and 5 would never be read
    with pytest.raises(DataError, match=r"train-000000\.tar holds 6 samples, the manifest says 4"):
        _load(shards, batch_size=5)  # 10 promised samples, 2 batches: every segment is read to its end
    loader, ids = _load(shards, batch_size=5, on_error="skip")
    assert sorted(ids) == [0, 1, 2, 3, 6, 7, 8, 9, 10, 11]
    assert loader.num_skipped == 2 and loader.num_repeated == 0


def test_right_counts_report_nothing(tmp_path):
    loader, ids = _load(_ids_set(tmp_path), on_error="skip")
    assert sorted(ids) == list(range(12))
    assert loader.num_skipped == 0 and loader.num_repeated == 0


@pytest.mark.parametrize("worker_batching", [True, False])
def test_worker_error_is_one_sentence(tmp_path, worker_batching):
    """Raised in a DataLoader worker, the error reaches the caller as one line naming shard and member."""
    shards = write_set(tmp_path / "bad", [6, 6], corrupt={8}, size=(16, 12))
    with pytest.raises(DataError) as info:
        _load(shards, num_workers=1, worker_batching=worker_batching)
    msg = str(info.value)
    assert "\n" not in msg
    assert "'s00008.jpg'" in msg and "train-000001.tar" in msg and "Traceback" not in msg


def test_worker_shard_error_is_one_sentence(tmp_path):
    shards = _ids_set(tmp_path)
    (shards / "train-000001.tar").write_bytes(bytes(6 * 1024))  # end-of-archive blocks only: no sample in it
    sizes_as_found(shards)
    with pytest.raises(DataError) as info:
        _load(shards, num_workers=1)
    assert "\n" not in str(info.value)
    assert str(info.value).endswith("train-000001.tar holds 0 samples, the manifest says 6")


def test_a_sample_with_a_member_twice_is_refused_not_silently_one_of_them(tmp_path):
    """index and verify report a repeated member name in one sample; the loader used to keep the later one."""
    import json

    from gpufeed.config import LoaderConfig
    from gpufeed.core.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.shardset.manifest import FORMAT_NAME
    from gpufeed.core.world import World
    from tests.common.shards import encode, smooth_image, write_tar

    jpg = encode(smooth_image(16, 12, 0))
    members = [("a.jpg", jpg), ("a.cls", b"0"), ("b.jpg", jpg), ("b.cls", b"0"), ("b.cls", b"1"),
               ("c.jpg", jpg), ("c.cls", b"1")]
    write_tar(tmp_path / "a.tar", members)
    (tmp_path / "manifest.json").write_text(json.dumps({
        "format": FORMAT_NAME, "format_version": 1, "prefix": "a", "classes": ["0", "1"], "num_samples": 3,
        "shards": [{"name": "a.tar", "num_samples": 3, "bytes": (tmp_path / "a.tar").stat().st_size,
                    "sha256": None}]}))
    cfg = LoaderConfig(batch_size=1, num_workers=0, image_size=16, decode="pil", shuffle_buffer=0)
    with pytest.raises(DataError, match=r"corrupt sample 'b.jpg' .*its .cls member appears twice"):
        list(build_loader(tmp_path, cfg, World.single(), train=False))
    loader = build_loader(tmp_path, LoaderConfig(**{**cfg.__dict__, "on_error": "skip"}), World.single(), train=False)
    labels = [int(y) for _, y in loader]  # 3 batches promised: the lost one is filled by a counted re-read
    assert labels == [0, 1, 0] and loader.num_skipped == 1 and loader.num_repeated == 1
