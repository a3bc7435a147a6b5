"""``gpufeed index``: manifests for foreign shards, loadable by the loader."""

from __future__ import annotations

import io
import shutil
from pathlib import Path

import pytest
import torch

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import DataError
from gpufeed.shardset.manifest import read_manifest
from gpufeed.core.world import World
from tests.common.cli import invoke, invoke_json
from tests.common.shards import WDS_SAMPLE, write_tar

FIXTURE = WDS_SAMPLE


def cfg(**kw) -> LoaderConfig:
    base = dict(batch_size=8, num_workers=0, image_size=16, shuffle_buffer=16, decode="pil-draft",
                persistent_workers=False, pin_memory=False)
    base.update(kw)
    return LoaderConfig(**base)


@pytest.fixture
def sample_set(tmp_path):
    d = tmp_path / "foreign"
    d.mkdir()
    shutil.copy(FIXTURE, d / FIXTURE.name)
    return d


@pytest.mark.parametrize("workers", [0, 2])
def test_index_fixture_and_load(sample_set, workers):
    from gpufeed.index import index_shards
    from gpufeed.loader import build_loader

    rep = index_shards(sample_set)
    assert rep.ok and rep.num_samples == 90 and rep.compression == "gzip" and rep.num_shards == 1
    m = read_manifest(sample_set)
    assert m.created_by == "gpufeed index" and m.compression == "gzip" and m.num_samples == 90
    assert m.shards[0].sha256 and len(m.shards[0].sha256) == 64
    assert m.classes == [str(i) for i in range(10)]
    loader = build_loader(sample_set, cfg(num_workers=workers), World.single())
    assert len(loader) == 90 // 8
    n = 0
    for images, labels in loader:
        assert images.dtype == torch.uint8 and tuple(images.shape) == (8, 3, 16, 16)
        assert labels.dtype == torch.int64 and 0 <= labels.min() and labels.max() <= 9
        n += 1
    assert n == len(loader)


def test_index_out_elsewhere_two_ranks(sample_set, tmp_path):
    from gpufeed.loader import build_loader

    out = tmp_path / "elsewhere"
    res = invoke_json(["index", str(sample_set / "*.tgz"), "--out", out, "--no-hash"])
    assert res["num_samples"] == 90 and res["hashed"] is False
    m = read_manifest(out)
    assert m.root == str(sample_set.resolve()) and m.shards[0].sha256 is None
    seen = []
    lens = set()
    for r in range(2):
        loader = build_loader(out, cfg(batch_size=7, num_workers=2), World(rank=r, world_size=2), train=False)
        lens.add(len(loader))
        seen.append([lab for _, l in loader for lab in l.tolist()])
    assert lens == {90 // 2 // 7} and all(len(s) == 6 * 7 for s in seen)


def _png() -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (20, 20), (10, 200, 30)).save(b, "PNG")
    return b.getvalue()


def test_index_brace_pattern_text_labels_and_unlabeled(tmp_path):
    from gpufeed.index import index_shards
    from gpufeed.loader import build_loader

    d = tmp_path / "t"
    d.mkdir()
    png = _png()
    write_tar(d / "data-000.tar", [("a.png", png), ("a.cls", b"dog"), ("b.jpeg", _jpeg()), ("b.cls", b"cat"),
                                   ("readme.txt", b"x"), ("orphan.cls", b"dog")])
    write_tar(d / "data-001.tar", [("c.webp", _webp()), ("c.cls", b"dog"), ("d.png", png), ("d.cls", b"cat")])
    rep = index_shards(str(d / "data-{000..001}.tar"))
    assert rep.num_samples == 4 and rep.num_classes == 2 and rep.class_source == "text .cls"
    assert rep.num_ignored_keys == 2 and rep.ok  # readme, orphan
    m = read_manifest(d)
    assert m.classes == ["cat", "dog"] and m.url_pattern == "data-{000..001}.tar" and m.prefix == "data"
    loader = build_loader(d, cfg(batch_size=2, num_workers=0), World.single(), train=False)
    labels = [x for _, l in loader for x in l.tolist()]
    assert labels == [1, 0, 1, 0]

    write_tar(d / "data-002.tar", [("e.png", png)])
    res = invoke_json(["index", d], expect=1)  # an unlabeled sample: manifest written, exit 1
    assert res["num_unlabeled"] == 1


def _jpeg() -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGB", (20, 20), (200, 20, 30)).save(b, "JPEG")
    return b.getvalue()


def _webp() -> bytes:
    from PIL import Image

    b = io.BytesIO()
    Image.new("RGBA", (20, 20), (20, 20, 230, 128)).save(b, "WEBP")
    return b.getvalue()


def test_index_errors(tmp_path, sample_set):
    from gpufeed.index import index_shards

    with pytest.raises(DataError, match="no shards"):
        index_shards(tmp_path.joinpath("empty").mkdir() or tmp_path / "empty")
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "x.tar").write_bytes(b"not a tar" * 100)
    with pytest.raises(DataError, match="x.tar is not a readable tar"):
        index_shards(tmp_path / "bad")


def test_index_unwritable_folder_suggests_out(sample_set, monkeypatch):
    import gpufeed.index as idx

    monkeypatch.setattr(idx.os, "access", lambda path, mode: False)  # as a read-only mount (root ignores chmod)
    r = invoke(["index", sample_set], expect=2)
    assert "not writable" in r.stderr and "--out" in r.stderr


def test_index_refuses_to_replace_a_gpufeed_shard_manifest(tmp_path):
    from gpufeed.index import index_shards
    from tests.common.shards import write_set

    d = write_set(tmp_path / "own", [3, 3])
    with pytest.raises(DataError, match="already exists"):
        index_shards(d)
    rep = index_shards(d, out=tmp_path / "idx")
    assert rep.num_samples == 6
    assert read_manifest(tmp_path / "idx").classes == ["0", "1", "2"]


def test_tune_and_verify_work_on_an_indexed_foreign_set(sample_set, tmp_path):
    """Shards that gpufeed did not write: index, then verify and tune them like our own."""
    from gpufeed.config import load_config

    invoke(["index", sample_set])
    assert invoke_json(["verify", sample_set])["ok"] is True
    out = tmp_path / "tuned.toml"
    obj = invoke_json(["tune", sample_set, "--budget", "6", "--batch-size", "8", "--image-size", "16",
                       "--max-workers", "1", "--repeats", "1", "--window", "0.2", "--run-dir", tmp_path / "run",
                       "--out", out])
    assert obj["ok"] is True and obj["best_samples_per_s"]["median"] > 0
    assert load_config(out).loader.num_workers == obj["best"]["num_workers"]


@pytest.mark.parametrize("gz", [False, True])
def test_index_refuses_a_tar_cut_at_a_member_boundary(tmp_path, gz):
    import gzip

    from gpufeed.index import index_shards
    from tests.test_verify import _cut_at_member_boundary

    d = tmp_path / "cut"
    d.mkdir()
    png = _png()
    cut = _cut_at_member_boundary([("a.png", png), ("a.cls", b"0"), ("b.png", png), ("b.cls", b"1")], 2)
    (d / ("data-000.tgz" if gz else "data-000.tar")).write_bytes(gzip.compress(cut) if gz else cut)
    with pytest.raises(DataError, match=r"data-000\.t.*: tar is truncated after member a\.cls"):
        index_shards(d)
    assert not (d / "manifest.json").exists()


def test_index_counts_and_lists_dropped_images_duplicates_and_ungrouped_keys(tmp_path):
    d = tmp_path / "odd"
    d.mkdir()
    png, jpg = _png(), _jpeg()
    write_tar(d / "data-000.tar", [("a.png", png), ("a.cls", b"0"), ("k.3.jpg", jpg), ("k.3.cls", b"1"),
                                   ("b.jpg", jpg), ("b.png", png), ("b.cls", b"1"), ("c.png", png), ("c.cls", b"0"),
                                   ("c.cls", b"1"), ("a.jpeg", jpg), ("a.cls", b"1")])
    res = invoke(["index", d], expect=1)  # manifest written (the loader reads what it can), but a check failed
    lines = res.stdout.splitlines()
    assert "4 samples" in lines[0]  # a, b, c and a again, as the loader counts them
    assert ("error: 2 image member(s) that no reader sees: data-000.tar: k.3.jpg (a dot in its key); "
            "data-000.tar: b.png (a second image; the loader reads b.jpg)") in lines
    assert "error: 1 member(s) a sample holds twice (readers keep only one): data-000.tar: c.cls" in lines
    assert ("error: 1 key(s) that come back after other keys (readers take them as more samples; re-create the "
            "tar with its members sorted by name (`tar --sort=name -cf ...`; GNU tar otherwise writes them in "
            "directory order) or write the set with `gpufeed shard`): data-000.tar: a.jpeg") in lines
    assert not any("not a readable tar" in line for line in lines)
    assert read_manifest(d).num_samples == 4


def test_index_checks_labels_with_the_loaders_rule(tmp_path):
    d = tmp_path / "mapped"
    d.mkdir()
    png = _png()
    (d / "classes.txt").write_text("cat\ndog\n")
    # "5" is a class index for every reader, but classes.txt names 2 classes: the loader rejects it
    write_tar(d / "data-000.tar", [("a.png", png), ("a.cls", b"5"), ("b.png", png), ("b.cls", b"cat"),
                                   ("c.png", png), ("c.cls", b"\xff"), ("d.png", png), ("d.cls", b"1")])
    res = invoke_json(["index", d], expect=1)
    assert res["num_bad_labels"] == 2 and res["num_classes"] == 2
    assert res["bad_labels"] == ["data-000.tar: a.cls (label 5 is outside 0..1)",
                                 "data-000.tar: c.cls (.cls member is not UTF-8 text)"]


def test_index_refuses_labels_that_mix_indices_and_names(tmp_path):
    """Labels 1, cat, dog: class "1" would be listed at index 0 while every reader reads "1" as index 1 (cat)."""
    d = tmp_path / "mixed"
    d.mkdir()
    png = _png()
    write_tar(d / "data-000.tar", [("a.png", png), ("a.cls", b"1"), ("b.png", png), ("b.cls", b"cat"),
                                   ("c.png", png), ("c.cls", b"dog"), ("e.png", png), ("e.cls", b"1")])
    res = invoke(["index", d], expect=2)
    assert "mix class indices ('1') and class names ('cat')" in res.stderr
    assert not (d / "manifest.json").exists()
    (d / "classes.txt").write_text("1\ncat\ndog\n")  # the name "1" at index 0: ambiguous with the index 1
    res = invoke(["index", d], expect=2)
    assert "names class '1' at index 0, but a .cls label '1' reads as class index 1" in res.stderr


def test_index_refuses_a_huge_class_index_before_listing_classes(tmp_path):
    """A label of 20 digits used to make index list 10**20 class names (memory until the OOM killer)."""
    d = tmp_path / "huge"
    d.mkdir()
    write_tar(d / "data-000.tar", [("a.png", _png()), ("a.cls", b"99999999999999999999"),
                                   ("b.png", _png()), ("b.cls", b"0")])
    res = invoke(["index", d], expect=1)  # no class: counted as a bad label, the manifest written
    assert "label 99999999999999999999 is outside 0..0" in res.stdout
    assert read_manifest(d).classes == ["0"]


def test_index_refuses_a_set_without_labels(tmp_path):
    from gpufeed.index import index_shards

    d = tmp_path / "nolabels"
    d.mkdir()
    write_tar(d / "data-000.tar", [("a.png", _png()), ("b.png", _png())])
    with pytest.raises(DataError, match="no sample in .* has a .cls label"):
        index_shards(d)
    assert not (d / "manifest.json").exists()
    (d / "classes.txt").write_text("\n\n")
    with pytest.raises(DataError, match="classes.txt lists no class name"):
        index_shards(d)


def _write_manifest_json(folder: Path, **changes) -> Path:
    import json

    d = {"format": "gpufeed-shards", "format_version": 1, "prefix": "data", "classes": ["cat", "dog"],
         "shards": [{"name": "data-000.tar", "num_samples": 3, "bytes": 10240, "sha256": None},
                    {"name": "data-001.tar", "num_samples": 2, "bytes": 10240, "sha256": None}],
         "num_samples": 5, "created_by": "gpufeed index"}
    d.update(changes)
    folder.mkdir(exist_ok=True)
    (folder / "manifest.json").write_text(json.dumps(d))
    return folder


def test_manifest_with_no_classes_is_refused_in_one_sentence(tmp_path):
    d = _write_manifest_json(tmp_path / "m", classes=[])
    with pytest.raises(DataError, match="classes must be a non-empty list"):
        read_manifest(d)
    res = invoke(["verify", d], expect=2)
    assert res.stderr.strip().splitlines() == [f"error: {d / 'manifest.json'}: classes must be a non-empty list "
                                               f"of class names (a label needs a class)"]


@pytest.mark.parametrize("changes, message", [
    ({"classes": ["cat", "cat"]}, "class 'cat' is listed twice"),
    ({"classes": ["cat", 3]}, "class '3' is not a class name"),
    ({"num_samples": 6}, "num_samples is 6 but the shards hold 5"),
    ({"num_samples": -1}, "num_samples must be an integer in 0..1099511627776, got -1"),
    ({"num_samples": 5.0}, "num_samples must be an integer"),
    ({"num_samples": True}, "num_samples must be an integer"),
    ({"shards": [{"name": "data-000.tar", "num_samples": 2 ** 41, "bytes": 1}]}, "num_samples must be an integer"),
    ({"shards": [{"name": "data-000.tar", "num_samples": 5, "bytes": -3}]}, "bytes must be an integer"),
    ({"shards": [{"name": "data-000.tar", "num_samples": 5, "bytes": 1, "sha256": "zz"}]}, "sha256"),
    ({"shards": [{"name": "x.tar", "num_samples": 2, "bytes": 1}, {"name": "x.tar", "num_samples": 3, "bytes": 1}]},
     "listed twice"),
    ({"shards": []}, "shards must be a non-empty list"),
    ({"compression": "pipe:zcat"}, "compression"),
    ({"format_version": 3}, "newer than this gpufeed reads"),
])
def test_manifest_fields_are_checked(tmp_path, changes, message):
    d = _write_manifest_json(tmp_path / "m", **changes)
    with pytest.raises(DataError, match=message.replace("(", r"\(").replace(")", r"\)")):
        read_manifest(d)


def test_manifest_size_is_bounded_before_parsing(tmp_path, monkeypatch):
    import gpufeed.shardset.manifest as manifest

    d = _write_manifest_json(tmp_path / "m")
    assert read_manifest(d).num_samples == 5
    monkeypatch.setattr(manifest, "MAX_MANIFEST_BYTES", 100)
    with pytest.raises(DataError, match="larger than"):
        read_manifest(d)


def test_index_and_verify_import_no_torch(sample_set):
    import subprocess
    import sys

    code = ("import sys; from gpufeed.cli import cli\n"
            "try: cli(['index', sys.argv[1]])\nexcept SystemExit: pass\n"
            "try: cli(['verify', sys.argv[1], '--workers', '1'])\nexcept SystemExit as e: assert e.code == 0, e\n"
            "assert 'torch' not in sys.modules and 'webdataset' not in sys.modules, 'imported'\n")
    subprocess.run([sys.executable, "-c", code, str(sample_set)], check=True, capture_output=True)


def test_shard_that_is_a_fifo_or_folder_is_named_not_skipped(tmp_path):
    import os

    from gpufeed.core.errors import DataError
    from gpufeed.index import resolve_shards
    from gpufeed.shardset.tar import file_problem

    (tmp_path / "a-0.tar").write_bytes(b"")
    os.mkfifo(tmp_path / "b-1.tar")
    with pytest.raises(DataError, match=r"b-1\.tar'.*is a FIFO, not a regular file"):
        resolve_shards(tmp_path)
    os.remove(tmp_path / "b-1.tar")
    (tmp_path / "c-2.tar").mkdir()
    with pytest.raises(DataError, match=r"c-2\.tar'.*is a directory, not a regular file"):
        resolve_shards(tmp_path)
    os.symlink("/dev/zero", tmp_path / "z.tar")
    assert file_problem(tmp_path / "z.tar") == "is a symbolic link to a character device (/dev/zero), not a regular file"
