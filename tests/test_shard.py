"""gpufeed shard: round trip, labels, plan, determinism, resume, free space, re-encoding, CLI."""

from __future__ import annotations

import hashlib
import io
import json
import os
import subprocess
import sys
import tarfile
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError, RunError
from gpufeed.shardset.manifest import read_manifest
from gpufeed.shard import plan_num_shards, split_sizes, write_shards
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_image


def shard(src: Path, dest: Path, try_one_pass: bool = True, pool_factory=None, **kw) -> object:
    """``write_shards`` of SRC into DEST with the config fields ``kw`` (one worker unless given), no bar; the job's
    seams ``try_one_pass`` and ``pool_factory`` passed through when given."""
    kw.setdefault("workers", 1)
    seams = {"try_one_pass": try_one_pass} | ({} if pool_factory is None else {"pool_factory": pool_factory})
    return write_shards(ShardConfig(src=str(src), dest=str(dest), **kw), progress=False, **seams)


def digests(dest: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dest.glob("*.tar"))}


def wds_samples(dest: Path) -> list[dict]:
    import webdataset as wds

    urls = [str(p) for p in sorted(dest.glob("*.tar"))]
    return list(wds.WebDataset(urls, shardshuffle=False))


def test_round_trip_with_plain_webdataset(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=3, per_class=5)
    dest = tmp_path / "out"
    rep = shard(src, dest, shard_samples=4, multiple_of=2)
    assert rep.ok and rep.num_samples == 15 and rep.num_rejected == 0
    assert rep.num_shards == 4  # ceil(15 / 4) = 4, already a multiple of 2
    samples = wds_samples(dest)
    assert len(samples) == 15
    m = read_manifest(dest)
    assert m.classes == ["class_0", "class_1", "class_2"] and m.num_samples == 15
    assert [s.num_samples for s in m.shards] == [4, 4, 4, 3]
    assert m.url_pattern == "train-{000000..000003}.tar"
    assert m.created_by == "gpufeed shard" and m.options["seed"] == 0
    for s in samples:
        key = s["__key__"]
        assert "." not in key
        meta = json.loads(s["json"])
        label = int(s["cls"])
        assert m.classes[label] == meta["class"] == meta["source"].split("/")[0]
        source = src / meta["source"]
        assert s["jpg"] == source.read_bytes()  # pass-through, byte for byte
        got = np.asarray(Image.open(io.BytesIO(s["jpg"])).convert("RGB"))
        want = np.asarray(Image.open(source).convert("RGB"))
        assert np.array_equal(got, want)
        assert (meta["width"], meta["height"]) == (16, 12)
        assert meta["sha256"] == hashlib.sha256(s["jpg"]).hexdigest()
    assert len({s["__key__"] for s in samples}) == 15
    # Shuffled: the first shard does not hold one class only.
    first = [int(s["cls"]) for s in samples[:4]]
    assert len(set(first)) > 1
    # index.parquet and timm's _info.json
    import pyarrow.parquet as pq

    from gpufeed.shardset.manifest import INDEX_COLUMNS

    table = pq.read_table(dest / "index.parquet")
    assert tuple(table.column_names) == INDEX_COLUMNS and table.num_rows == 15
    rows = table.to_pylist()
    assert [r["key"] for r in rows] == [s["__key__"] for s in samples]
    meta = pq.ParquetFile(dest / "index.parquet").metadata.row_group(0)
    encoded = {meta.column(i).path_in_schema: "DICTIONARY" in " ".join(meta.column(i).encodings)
               for i in range(meta.num_columns)}
    assert [c for c in INDEX_COLUMNS if encoded[c] and c not in ("label", "bytes", "width", "height")] == \
        ["shard", "class"]  # key and source are unique: no dictionary
    info = json.loads((dest / "_info.json").read_text())
    assert info["splits"]["train"]["num_samples"] == 15
    assert info["splits"]["train"]["shard_lengths"] == [4, 4, 4, 3]
    assert info["splits"]["train"]["filenames"] == [f"train-{i:06d}.tar" for i in range(4)]


def test_tar_headers_are_fixed(image_folder, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    shard(image_folder(classes=2, per_class=2), dest)
    with tarfile.open(dest / "train-000000.tar") as tar:
        members = tar.getmembers()
    assert [m.name.split(".", 1)[1] for m in members[:3]] == ["cls", "jpg", "json"]
    for m in members:
        assert (m.mtime, m.uid, m.gid, m.uname, m.gname, m.mode) == (0, 0, 0, "", "", 0o644)


def test_labels_agree_with_torchvision_imagefolder(tmp_path: Path) -> None:
    from torchvision.datasets import ImageFolder

    src = tmp_path / "src"
    for name in ["b", "B", "a_1", "a", "zeta", "10", "9"]:  # case and digit ordering
        write_image(src / name / "x.jpg")
        write_image(src / name / "sub" / "y.png", fmt="PNG")
    (src / "stray.jpg").write_bytes((src / "a" / "x.jpg").read_bytes())
    ref = ImageFolder(str(src))
    rep = shard(src, tmp_path / "out")
    assert rep.classes == ref.classes
    want = Counter((os.path.relpath(p, src), label) for p, label in ref.samples)
    got = Counter((json.loads(s["json"])["source"], int(s["cls"])) for s in wds_samples(tmp_path / "out"))
    assert got == want


def test_plan_arithmetic() -> None:
    cfg = ShardConfig(shard_samples=10, shard_bytes=1000, multiple_of=4)
    assert plan_num_shards(25, 100, cfg) == 4  # ceil(25/10) = 3 -> 4
    assert plan_num_shards(25, 4500, cfg) == 8  # bytes win: 5 -> 8
    assert split_sizes(10, 4) == [3, 3, 2, 2]
    assert max(split_sizes(1001, 7)) - min(split_sizes(1001, 7)) <= 1


def test_shard_bytes_target(image_folder, tmp_path: Path) -> None:
    rep = shard(image_folder(classes=2, per_class=6), tmp_path / "out", shard_bytes=8000)
    assert rep.num_shards >= 3
    sizes = [s.num_samples for s in read_manifest(tmp_path / "out").shards]
    assert max(sizes) - min(sizes) <= 1 and sum(sizes) == 12


def test_multiple_of_larger_than_inputs_is_refused(image_folder, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="multiple-of"):
        shard(image_folder(classes=1, per_class=3), tmp_path / "out", multiple_of=8)


def test_deterministic_across_workers_and_runs(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=3, per_class=30)
    a = shard(src, tmp_path / "a", shard_samples=20, workers=1)
    b = shard(src, tmp_path / "b", shard_samples=20, workers=2)
    c = shard(src, tmp_path / "c", shard_samples=20, workers=2)
    assert a.num_shards == 5 and b.workers == 2
    assert digests(tmp_path / "a") == digests(tmp_path / "b") == digests(tmp_path / "c")
    ma, mb = (json.loads((tmp_path / d / "manifest.json").read_text()) for d in "ab")
    assert ma["shards"] == mb["shards"]
    # A different seed shuffles differently.
    d = shard(src, tmp_path / "d", shard_samples=20, seed=1)
    assert d.num_samples == a.num_samples and digests(tmp_path / "d") != digests(tmp_path / "a")


def test_one_shard_written_by_two_workers_is_byte_identical(image_folder, tmp_path: Path, monkeypatch) -> None:
    """A one-shard plan is split into ranges written by several processes at their offsets: same bytes."""
    import gpufeed.shard.write as mod

    src = image_folder(classes=3, per_class=12)
    write_image(src / "class_0" / "cmyk.jpg", mode="CMYK")  # one transcoded sample (from the batch cache)
    monkeypatch.setattr(mod, "_RANGE_SAMPLES", 5)  # many ranges per shard
    a = shard(src, tmp_path / "a", workers=1)
    b = shard(src, tmp_path / "b", workers=2)
    monkeypatch.setattr(mod, "_RANGE_SAMPLES", 1000)  # one range
    c = shard(src, tmp_path / "c", workers=2)
    assert a.num_shards == b.num_shards == c.num_shards == 1 and b.workers == 2
    assert a.transforms.get("cmyk_to_rgb_jpeg") == 1
    assert digests(tmp_path / "a") == digests(tmp_path / "b") == digests(tmp_path / "c")
    for d in "bc":
        for f in ("manifest.json", "index.parquet"):
            assert (tmp_path / d / f).read_bytes() == (tmp_path / "a" / f).read_bytes()
    with tarfile.open(tmp_path / "b" / "train-000000.tar") as tf:
        assert len(tf.getmembers()) == 3 * a.num_samples
    assert not list((tmp_path / "b").glob(".*.tmp"))


def tree(dest: Path) -> dict[str, str]:
    """sha256 of every file under DEST but the lock (it records the pid): shards, sidecars, plan, index, manifest."""
    return {str(p.relative_to(dest)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(dest.rglob("*")) if p.is_file() and p.name != "lock"}


@pytest.mark.parametrize("workers", [1, 2])
def test_check_header_one_pass_or_fallback_is_byte_identical(tmp_path: Path, monkeypatch, workers: int) -> None:
    """--check header without transcoding options validates and writes in one pass (each source read once) when
    every file passes through unchanged; a rejected file or one that needs a transcode stops it, and the run
    validates the files it had not checked, then writes. Either way every output file (shards, sidecars, plan,
    index, manifest) has the bytes of the two passes (forced with ``write_shards(..., try_one_pass=False)``)."""
    import gpufeed.shard.job as job
    import gpufeed.shard.validate as validate

    src = tmp_path / "src"
    exif = Image.Exif()
    exif[0x0112] = 6
    for c in range(3):
        for i in range(8):
            write_image(src / f"c{c}" / f"{i}.jpg", size=(8 + i, 9), color=(c * 70, i * 20, 9))
    write_image(src / "c0" / "png.jpg", fmt="PNG")  # a PNG named .jpg: Pillow's header path, stored as .png
    write_image(src / "c1" / "exif.jpg", exif=exif.tobytes())  # Pillow's path; orientation 6 in KEY.json
    calls = []  # per validation pass: how many candidates the stopped one pass had checked already
    real_validate = job.validate_candidates
    def counted(scan, src_, state, opts_, pool, bar, order, workers=1, partial=None):  # the phase's public API
        calls.append(None if partial is None else int(partial.checked.sum()))
        return real_validate(scan, src_, state, opts_, pool, bar, order, workers, partial)

    monkeypatch.setattr(job, "validate_candidates", counted)
    monkeypatch.setattr(validate, "_HEADER_CHUNK", 4)  # validation batches smaller than shards: some are skipped
    opts = {"check": "header", "shard_samples": 5, "workers": workers}  # 6 shards: whole shards per worker

    def both(name: str) -> tuple[object, object]:
        calls.clear()
        one = shard(src, tmp_path / name / "out", **opts)
        validated = len(calls)
        two = shard(src, tmp_path / f"{name}-two" / "out", try_one_pass=False, **opts)
        assert tree(tmp_path / name / "out") == tree(tmp_path / f"{name}-two" / "out")
        assert not list((tmp_path / name / "out").glob(".*.tmp"))
        return one, validated

    rep, validated = both("clean")
    assert validated == 0 and rep.num_shards == 6 and rep.num_samples == 26
    metas = []
    for path in sorted((tmp_path / "clean" / "out").glob("*.tar")):
        with tarfile.open(path) as tf:
            metas += [json.loads(tf.extractfile(m).read()) for m in tf.getmembers() if m.name.endswith(".json")]
    assert len(metas) == 26 and [m["format"] for m in metas].count("png") == 1
    assert [m["exif_orientation"] for m in metas if "exif_orientation" in m] == [6]

    (src / "c2" / "text.jpg").write_bytes(b"not an image")  # rejected at validation
    rep, validated = both("rejected")
    assert validated == 1 and rep.num_samples == 26 and [i.path for i in rep.rejected] == ["c2/text.jpg"]
    # The files the stopped one pass checked (whole shards before the one that holds text.jpg, and part of
    # that one) are not validated again: 19 with one worker. Two workers stop at a moment that depends on the
    # machine's timing (seen from 0 to 19 on a loaded machine): only the byte identity above holds for them.
    assert calls[0] == 19 if workers == 1 else 0 <= calls[0] <= 27
    (src / "c2" / "text.jpg").unlink()
    write_image(src / "c2" / "cmyk.jpg", mode="CMYK")  # transcoded
    rep, validated = both("cmyk")
    assert validated == 1 and rep.num_samples == 27 and rep.transforms["cmyk_to_rgb_jpeg"] == 1


def test_one_pass_worker_error_stops_the_running_shards_and_leaves_no_temporary(tmp_path: Path,
                                                                                monkeypatch) -> None:
    """A worker's OSError in the one pass (here the disk filling up in one shard) ends the run with one sentence;
    the shards still being written stop too (the stop file) and delete their temporary files, so DEST holds no
    ``.tmp`` and the re-run starts clean."""
    import errno

    import gpufeed.shard.validate as validate
    import gpufeed.shard.write as write

    src = tmp_path / "src"
    for c in range(2):
        for i in range(12):
            write_image(src / f"c{c}" / f"{i}.jpg", size=(8 + i, 9))
    real_read, real_task = validate.read_whole, write.check_and_write_shard

    def slow_read(path, dir_fd=None):  # workers are forked after the patch: each file takes 50 ms there
        time.sleep(0.05)
        return real_read(path, dir_fd)

    def task(dest, src_, name, part, opts):
        if name == "train-000004.tar":
            raise OSError(errno.ENOSPC, "No space left on device", os.path.join(dest, f".{name}.tmp"))
        return real_task(dest, src_, name, part, opts)

    task.__module__, task.__qualname__ = real_task.__module__, real_task.__qualname__  # pickled by name
    monkeypatch.setattr(write, "read_whole", slow_read)
    monkeypatch.setattr(write, "check_and_write_shard", task)
    monkeypatch.setattr(write, "_STOP_EVERY", 1)
    import gpufeed.shard.onepass as onepass

    monkeypatch.setattr(onepass, "check_and_write_shard", task)

    def fork_pool(workers: int, lock_fd: int):  # the patches reach the workers only by fork (after a test has
        import concurrent.futures as cf  # left a thread, tqdm's monitor say, the job's pool would spawn them)
        import multiprocessing as mp

        return cf.ProcessPoolExecutor(workers, mp_context=mp.get_context("fork"))

    dest = tmp_path / "out"
    with pytest.raises(RunError, match="No space left|full"):  # 6 shards; 5 and 4 go first, 4 fails
        shard(src, dest, check="header", workers=2, shard_samples=4, pool_factory=fork_pool)
    assert not [p.name for p in dest.rglob("*.tmp")]
    assert not (dest / ".gpufeed" / "one-pass.stop").exists() and not list(dest.glob("*.tar"))


def test_scan_in_workers_walks_groups_of_classes_into_the_same_columns(tmp_path: Path, monkeypatch) -> None:
    """With a pool the class folders are walked a group per task (here 3 classes a task, 2 tasks a worker in
    flight): the columns, in label order, are those of the walk in this process."""
    from gpufeed.shard.context import make_pool
    from gpufeed.shard.scan import scan_src

    src = tmp_path / "src"
    for c in range(40):
        for i in range(c % 3):  # some classes empty
            (src / f"k{c:02d}").mkdir(parents=True, exist_ok=True)
            (src / f"k{c:02d}" / f"{i}.jpg").write_bytes(bytes([c, i]) * (c + 1))
        (src / f"k{c:02d}").mkdir(parents=True, exist_ok=True)
    here = scan_src(str(src))
    pool = make_pool(2, -1)
    try:
        there = scan_src(str(src), pool, 2, group_max=3, depth=2)
    finally:
        pool.shutdown()
    assert list(there.paths) == list(here.paths) and len(here) == 39
    assert there.labels.tolist() == here.labels.tolist() and there.sizes.tolist() == here.sizes.tolist()
    assert there.class_counts == here.class_counts and there.classes == here.classes


@pytest.mark.parametrize("n", [0, 1, 2, 7, 1000])
def test_shard_order_shuffled_in_steps_is_random_shuffle(n: int, monkeypatch) -> None:
    """The one pass shuffles in steps, starting the last shards while the rest is shuffled: every step, and the
    whole order, are those of ``random.Random(seed).shuffle`` (what the plan has always recorded)."""
    import random

    import gpufeed.shard.shardplan as shardplan
    from gpufeed.shard.shardplan import Shuffle

    for seed, stepwise in [(0, True), (1, True), (2**40 + 3, True), (5, False)]:  # False: the fallback
        want = list(range(n))
        random.Random(seed).shuffle(want)
        monkeypatch.setattr(shardplan, "_STEPWISE", stepwise)
        s = Shuffle(n, seed)
        for start in sorted({n - 1, n * 2 // 3, n // 3}, reverse=True):  # the one pass: the last shards first
            if start >= 0:
                assert s.take(start, 5).tolist() == want[start:start + 5]
        assert s.order().tolist() == want
        assert s.take(n // 2, 3).tolist() == want[n // 2:n // 2 + 3]


def test_one_pass_worker_on_plain_jpegs_imports_neither_numpy_nor_pillow(tmp_path: Path) -> None:
    """A one-pass task (``check_and_write_shard``) in a fresh process, as a forked worker starts: its file list
    (names with ``array`` offsets) and the pixel limit the main process computed are all it needs for plain
    JPEGs, so it imports neither numpy nor Pillow (~0.1 s each a worker, on the serial path of a small set)."""
    import pickle

    from gpufeed.shard.scan import scan_src
    from gpufeed.shard.validate import CheckOptions, pixel_limit
    from gpufeed.shard.write import OnePassPart

    src = tmp_path / "src"
    for i in range(6):
        write_image(src / f"c{i % 2}" / f"{i}.jpg", size=(8 + i, 9))
    scan = scan_src(str(src))
    opts = CheckOptions(check="header", max_pixels=10**8, max_size=None, quality=None)
    part = OnePassPart(paths=scan.paths.portable(), n=[0, 1, 2, 0, 1, 2], label=scan.labels.tolist(),
                       bytes=scan.sizes.tolist(), classes=scan.classes, stop=str(tmp_path / "stop"))
    (tmp_path / "out").mkdir()
    args = (str(tmp_path / "out"), str(src), "t-000000.tar", part, opts._replace(pixel_limit=pixel_limit(opts)))
    (tmp_path / "args.pickle").write_bytes(pickle.dumps(args))
    code = ("import pickle, sys; import gpufeed.shard.job; from gpufeed.shard.write import check_and_write_shard; "
            f"got = check_and_write_shard(*pickle.load(open({str(tmp_path / 'args.pickle')!r}, 'rb'))); "
            "print(got.complete, got.checked, 'numpy' in sys.modules, 'PIL' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "6", "False", "False"]
    assert (tmp_path / "out" / ".t-000000.tar.tmp").stat().st_size > 6 * 1536
    assert list(part.paths) == list(scan.paths)  # the array offsets, in this machine's byte order

    # A shard queued behind one that stopped (the stop file exists) stops before its first file.
    from gpufeed.shard.write import check_and_write_shard

    (tmp_path / "stop").touch()
    got = check_and_write_shard(*args)
    assert (got.complete, got.checked, got.nbytes) == (False, 0, 0)
    assert not (tmp_path / "out" / ".t-000000.tar.tmp").exists()


def test_resume_after_lost_shards_is_byte_identical(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=10)
    ref = tmp_path / "ref"
    shard(src, ref, shard_samples=5)
    dest = tmp_path / "out"
    shard(src, dest, shard_samples=5)
    # Simulate an interrupted run: no manifest, one shard missing, one truncated, one leftover temp file.
    (dest / "manifest.json").unlink()
    (dest / "train-000001.tar").unlink()
    data = (dest / "train-000002.tar").read_bytes()
    (dest / "train-000002.tar").write_bytes(data[: len(data) // 2])
    (dest / ".train-000003.tar.tmp").write_bytes(b"partial")
    rep = shard(src, dest, shard_samples=5)
    assert rep.resumed and rep.num_shards_written == 2 and rep.num_shards_skipped == 2
    assert digests(dest) == digests(ref)
    assert (dest / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
    assert not (dest / ".train-000003.tar.tmp").exists()
    # Re-running a complete set writes nothing.
    again = shard(src, dest, shard_samples=5)
    assert again.num_shards_written == 0 and digests(dest) == digests(ref)


def test_resume_after_kill_9(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=40, size=(64, 48))
    ref = tmp_path / "ref"
    shard(src, ref, shard_samples=4)
    dest = tmp_path / "out"
    code = (
        "import time, gpufeed.shard as s, gpufeed.shard.write as w\n"
        "orig = w.finish_shard\n"
        "def slow(*a, **k):\n"
        "    r = orig(*a, **k); time.sleep(0.3); return r\n"
        "w.finish_shard = slow\n"
        "from gpufeed.config import ShardConfig\n"
        f"s.write_shards(ShardConfig(src={str(src)!r}, dest={str(dest)!r}, shard_samples=4, workers=1),"
        " progress=False)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code])
    deadline = time.time() + 60
    while time.time() < deadline and len(list(dest.glob("*.tar"))) < 3:
        time.sleep(0.02)
    proc.kill()
    proc.wait()
    assert not (dest / "manifest.json").exists()
    done_before = len(list(dest.glob("*.tar")))
    assert 3 <= done_before < 20
    rep = shard(src, dest, shard_samples=4)
    assert rep.resumed and rep.num_shards_skipped >= done_before - 1
    assert digests(dest) == digests(ref)
    assert (dest / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()


def test_changed_input_or_options_are_refused_unless_overwrite(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=4)
    dest = tmp_path / "out"
    shard(src, dest)
    with pytest.raises(DataError, match="--overwrite"):
        shard(src, dest, seed=3)
    write_image(src / "class_0" / "new.jpg")
    with pytest.raises(DataError, match="different input"):
        shard(src, dest)
    (dest / "keep.txt").write_text("user file")
    rep = shard(src, dest, seed=3, overwrite=True)
    assert rep.num_samples == 9 and not rep.resumed
    assert (dest / "keep.txt").exists()


def test_refuses_foreign_set_in_dest(image_folder, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    dest.mkdir()
    (dest / "train-000000.tar").write_bytes(b"")
    with pytest.raises(DataError, match="--overwrite"):
        shard(image_folder(), dest)


def test_free_space_is_checked(image_folder, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    dest = tmp_path / "out"
    with pytest.raises(DataError) as err:
        shard(image_folder(), dest)
    msg = str(err.value)
    assert str(dest) in msg and "1000 bytes free" in msg and "needed" in msg
    assert not list(dest.glob("*.tar"))


def test_reencode_max_size_and_quality(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_image(src / "a" / "big.jpg", size=(200, 100), quality=95)
    write_image(src / "a" / "small.jpg", size=(40, 30), quality=95)
    write_image(src / "b" / "tall.png", size=(30, 120), fmt="PNG")
    rep = shard(src, tmp_path / "out", max_size=64)
    assert rep.transforms == {"copy": 1, "reencode": 2}
    got = {json.loads(s["json"])["source"]: s for s in wds_samples(tmp_path / "out")}
    big = got["a/big.jpg"]
    meta = json.loads(big["json"])
    assert (meta["width"], meta["height"], meta["orig_width"]) == (64, 32, 200)
    assert Image.open(io.BytesIO(big["jpg"])).size == (64, 32)
    assert "jpg" in got["b/tall.png"] and Image.open(io.BytesIO(got["b/tall.png"]["jpg"])).size == (16, 64)
    assert got["a/small.jpg"]["jpg"] == (src / "a" / "small.jpg").read_bytes()  # never up: passes through
    # --quality re-encodes everything, deterministically.
    q1 = shard(src, tmp_path / "q1", quality=50)
    q2 = shard(src, tmp_path / "q2", quality=50, workers=2)
    assert q1.transforms == {"reencode": 3}
    assert digests(tmp_path / "q1") == digests(tmp_path / "q2")


def test_missing_src_and_dest_inside_src(tmp_path: Path, image_folder) -> None:
    with pytest.raises(DataError, match="does not exist"):
        shard(tmp_path / "nope", tmp_path / "out")
    src = image_folder()
    with pytest.raises(DataError, match="inside SRC"):
        shard(src, src / "out")
    (tmp_path / "flat").mkdir()
    write_image(tmp_path / "flat" / "x.jpg")
    with pytest.raises(DataError, match="no class folders"):
        shard(tmp_path / "flat", tmp_path / "out2")


# --------------------------------------------------------------------------- CLI


def test_cli_shard_json_then_verify(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=3)
    dest = tmp_path / "out"
    out = invoke_json(["shard", src, dest, "--workers", "1", "--shard-samples", "2", "--multiple-of", "3",
                       "--quiet"])
    assert out["ok"] is True and out["num_samples"] == 6 and out["num_shards"] == 3
    assert out["shards"] == ["train-000000.tar", "train-000001.tar", "train-000002.tar"]
    ver = invoke_json(["verify", dest, "--workers", "1"])
    assert ver["ok"] is True and ver["num_samples"] == 6


def test_cli_usage_errors_exit_2(tmp_path: Path, image_folder) -> None:
    res = invoke(["shard", tmp_path / "missing", tmp_path / "out"], expect=2)
    assert "does not exist" in res.stderr and "Traceback" not in res.stderr
    res = invoke(["shard", image_folder(), tmp_path / "out", "--quality", "120"], expect=2)
    assert "quality" in res.stderr
    invoke(["shard", image_folder(name="s2"), tmp_path / "o2", "--check", "nope"], expect=2)


def test_cli_strict_exits_1_on_rejects(tmp_path: Path, image_folder) -> None:
    src = image_folder(classes=2, per_class=2)
    (src / "class_0" / "broken.jpg").write_bytes(b"not an image at all")
    out = invoke_json(["shard", src, tmp_path / "a", "--workers", "1", "--quiet"])
    assert out["ok"] is True and out["num_rejected"] == 1
    assert out["rejected"][0]["path"] == "class_0/broken.jpg"
    out = invoke_json(["shard", src, tmp_path / "b", "--workers", "1", "--quiet", "--strict"], expect=1)
    assert out["ok"] is False
    res = invoke(["shard", src, tmp_path / "c", "--workers", "1", "--quiet", "--strict"], expect=1)
    assert "class_0/broken.jpg" in res.stdout and "not an image" in res.stdout


def test_cli_config_file(tmp_path: Path, image_folder) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('[shard]\nshard_samples = 2\nprefix = "val"\nworkers = 1\n')
    out = invoke_json(["shard", image_folder(classes=1, per_class=4), tmp_path / "out", "--config", cfg,
                       "--quiet"])
    assert out["num_shards"] == 2 and out["shards"][0] == "val-000000.tar"
    cfg.write_text("[shard]\nbogus = 1\n")
    invoke(["shard", image_folder(name="s3"), tmp_path / "o3", "--config", cfg], expect=2)


def test_ustar_headers_match_tarfile() -> None:
    from gpufeed.shardset.tar import ustar_headers

    for name, size in [("00000_0000000.jpg", 0), ("00012_0001234.json", 511), ("k" * 96 + ".cls", 8**11 - 1)]:
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        stem, _, ext = name.rpartition(".")
        assert ustar_headers(stem, ((ext, size),)) == [ti.tobuf(format=tarfile.USTAR_FORMAT)]


def test_shard_bytes_equal_a_tarfile_written_archive(image_folder, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    shard(image_folder(classes=2, per_class=3), dest)
    ours = (dest / "train-000000.tar").read_bytes()
    buf = io.BytesIO()
    with tarfile.open(dest / "train-000000.tar") as src, tarfile.open(fileobj=buf, mode="w",
                                                                        format=tarfile.USTAR_FORMAT) as out:
        for m in src.getmembers():
            out.addfile(m, src.extractfile(m))
    assert buf.getvalue() == ours


def test_run_interrupted_before_its_plan_restarts(image_folder, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    (dest / ".gpufeed").mkdir(parents=True)
    (dest / ".gpufeed" / "enc-000000.bin").write_bytes(b"junk")
    rep = shard(image_folder(classes=1, per_class=2), dest)
    assert rep.num_samples == 2 and not rep.resumed


def test_resume_with_reencoded_images(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in range(2):
        for i in range(6):
            write_image(src / f"c{c}" / f"{i}.jpg", size=(90, 40 + i), color=(c * 90, i * 20, 5))
    ref = tmp_path / "ref"
    shard(src, ref, max_size=32, shard_samples=3)
    assert not list((ref / ".gpufeed").glob("enc-*.bin"))  # the cache goes once the set is complete
    dest = tmp_path / "out"
    shard(src, dest, max_size=32, shard_samples=3, workers=2)
    assert digests(dest) == digests(ref)
    (dest / "manifest.json").unlink()
    (dest / "train-000002.tar").unlink()
    rep = shard(src, dest, max_size=32, shard_samples=3)  # the cache was cleared: transcoded again, same bytes
    assert rep.num_shards_written == 1 and rep.num_shards_skipped == 3
    assert not rep.resumed  # the plan was validated afresh (the cache it needs was gone), the shards kept
    from gpufeed.shard import render_shard

    assert "re-validated (the transcode cache was gone): 3 complete shard(s) kept, 1 written" in render_shard(rep)
    assert digests(dest) == digests(ref) and rep.transforms == {"reencode": 12}


def noise_folder(root: Path, classes: int = 2, per_class: int = 48, size: tuple[int, int] = (40, 30)) -> Path:
    rng = np.random.default_rng(0)
    for c in range(classes):
        for i in range(per_class):
            p = root / f"c{c}" / f"{i:03d}.jpg"
            p.parent.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(p, quality=90)
    return root


def test_free_space_is_checked_before_the_transcode_cache_is_written(tmp_path: Path, monkeypatch) -> None:
    import shutil

    src = noise_folder(tmp_path / "src", per_class=4)
    real = shutil.disk_usage
    monkeypatch.setattr(shutil, "disk_usage", lambda p: real(p)._replace(free=1000))
    dest = tmp_path / "out"
    with pytest.raises(DataError, match="1000 bytes free"):
        shard(src, dest, max_size=16)
    assert not [p for p in dest.rglob("*") if p.is_file()]  # nothing written, not even the cache


def test_reencode_peak_dest_use_stays_near_the_output_size(tmp_path: Path, monkeypatch) -> None:
    import gpufeed.shard.job as job
    import gpufeed.shard.write as write

    src = noise_folder(tmp_path / "src")  # 96 images: 3 validation batches, 6 shards
    dest = tmp_path / "out"

    def usage() -> tuple[int, int]:
        files = [p for p in dest.rglob("*") if p.is_file()]
        cache = sum(p.stat().st_size for p in files if p.name.startswith("enc-"))
        # A shard being written is created at its final size with holes: count the space it uses.
        used = [p.stat().st_blocks * 512 if p.name.endswith(".tar.tmp") else p.stat().st_size for p in files]
        return sum(used), cache

    seen = []
    real_write, real_finish = write.write_range, job.finish_set
    monkeypatch.setattr(write, "write_range", lambda *a, **k: (seen.append(usage()), real_write(*a, **k))[1])
    monkeypatch.setattr(job, "finish_set", lambda *a, **k: (seen.append(usage()), real_finish(*a, **k))[1])
    rep = shard(src, dest, max_size=24, shard_samples=16)
    assert rep.num_shards == 6 and rep.transforms == {"reencode": 96}
    full_cache = seen[0][1]
    assert full_cache > 0 and seen[-1][1] == 0  # every cache file is gone once its shards are written
    output = sum(p.stat().st_size for p in dest.glob("*.tar"))
    assert max(total for total, _ in seen) <= output + full_cache / 2  # old code: output + the whole cache


def test_disk_full_names_dest_and_is_a_run_error_once_writing(image_folder, tmp_path: Path, monkeypatch) -> None:
    """DEST full while the shards are written: RunError (exit 1, the run had started); while validating (the
    transcode cache), before any shard is written: DataError (exit 2)."""
    import errno

    import gpufeed.shard.validate as validate
    import gpufeed.shard.write as write

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    src = noise_folder(tmp_path / "src", per_class=3)
    dest = tmp_path / "out"
    monkeypatch.setattr(write, "write_range", full)
    with pytest.raises(RunError) as err:
        shard(src, dest)
    assert err.value.exit_code == 1
    assert f"DEST {dest} is full" in str(err.value) and "bytes needed" in str(err.value)
    assert not list(dest.glob("*.tar*")) and not list(dest.glob(".*.tmp"))
    monkeypatch.undo()
    monkeypatch.setattr(validate, "inspect_file", full)  # while the transcode cache is written
    with pytest.raises(DataError, match="is full") as err:
        shard(src, tmp_path / "out2", quality=80)
    assert not isinstance(err.value, RunError) and err.value.exit_code == 2
    assert not list((tmp_path / "out2").rglob("enc-*"))


@pytest.mark.parametrize("inline", [True, False], ids=["read", "sendfile"])
def test_source_rewritten_at_the_same_size_is_refused(tmp_path: Path, monkeypatch, inline: bool) -> None:
    import gpufeed.shard.job as job
    import gpufeed.shard.write as write

    if not inline:
        monkeypatch.setattr(write, "_INLINE_BYTES", 0)  # the copy of large images
    src = tmp_path / "src"
    for i in range(3):
        write_image(src / "a" / f"{i}.jpg", color=(i * 50, 0, 0))
    victim = src / "a" / "1.jpg"
    real = job.make_plan

    def plan_then_swap(*a, **k):
        plan = real(*a, **k)
        st = victim.stat()
        victim.write_bytes(b"\xff\xd8\xff" + b"\0" * (st.st_size - 3))  # same size, garbage
        # A rewrite moves mtime (the writer checks size, mtime_ns, inode and device, not the bytes); set it
        # explicitly, as a rewrite within one tick of a coarse file system clock might not.
        os.utime(victim, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))
        return plan

    monkeypatch.setattr(job, "make_plan", plan_then_swap)
    with pytest.raises(RunError, match=r"a/1\.jpg changed while sharding.*re-run"):
        shard(src, tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()


@pytest.mark.parametrize("one_pass", [True, False], ids=["one-pass", "two-pass"])
def test_source_resized_after_the_scan_is_refused(tmp_path: Path, monkeypatch, one_pass: bool) -> None:
    """The plan records each file's size at the scan: one that grew before it was read is refused as changed, by
    the one pass (which stops, and the write after validation refuses it) as by the two passes."""
    import gpufeed.shard.job as job

    src = tmp_path / "src"
    for i in range(4):
        write_image(src / "a" / f"{i}.jpg", color=(i * 50, 0, 0))
    victim = src / "a" / "2.jpg"
    real = job.plan_fingerprint

    def scan_then_grow(*a, **k):
        victim.write_bytes(victim.read_bytes() + b"\0" * 100)  # still a valid JPEG, 100 bytes longer
        return real(*a, **k)

    monkeypatch.setattr(job, "plan_fingerprint", scan_then_grow)
    with pytest.raises(RunError, match=r"a/2\.jpg changed while sharding"):
        shard(src, tmp_path / "out", check="header", shard_samples=1, try_one_pass=one_pass)
    assert not (tmp_path / "out" / "manifest.json").exists()


def test_plan_of_an_older_version_or_damaged_is_refused_then_replanned(tmp_path: Path) -> None:
    """plan.json v2 (one dict per sample) or a plan.bin that does not match plan.json is never used: the run is
    refused as for a different plan, and --overwrite replans to the same bytes."""
    src = tmp_path / "src"
    for i in range(4):
        write_image(src / "a" / f"{i}.jpg", color=(i * 50, 0, 0))
    dest = tmp_path / "out"
    ref = shard(src, dest, shard_samples=2)
    want = digests(dest)
    state = dest / ".gpufeed"
    meta = json.loads((state / "plan.json").read_text())
    assert meta["plan_version"] == 3 and "samples" not in meta and meta["num_samples"] == 4
    # 137 bytes a sample plus its path: numeric columns, the 32-byte digest, path offset; paths in one blob.
    paths = sum(len(f"a/{i}.jpg") for i in range(4))
    assert (state / "plan.bin").stat().st_size == 4 * 129 + 5 * 8 + paths
    old = {"plan_version": 2, "fingerprint": meta["fingerprint"], "samples": [], "shards": []}
    (state / "plan.json").write_text(json.dumps(old))
    (dest / "train-000001.tar").unlink()
    with pytest.raises(DataError, match="planned from different input files or options.*--overwrite"):
        shard(src, dest, shard_samples=2)
    (state / "plan.json").write_text(json.dumps(meta))
    blob = bytearray((state / "plan.bin").read_bytes())
    blob[-1] ^= 1  # a path byte
    (state / "plan.bin").write_bytes(bytes(blob))
    with pytest.raises(DataError, match="planned from different input files or options"):
        shard(src, dest, shard_samples=2)
    again = shard(src, dest, shard_samples=2, overwrite=True)
    assert not again.resumed and again.num_samples == ref.num_samples and digests(dest) == want


def test_tampered_plan_is_never_used_and_never_crashes(tmp_path: Path) -> None:
    """DEST/.gpufeed is data too: a plan.json/plan.bin whose sizes, fields or paths are wrong (a path out of SRC
    would copy any readable file into a shard) makes read_plan return None (replan / refuse without
    --overwrite), never OverflowError, MemoryError or TypeError."""
    import hashlib

    import numpy as np

    import gpufeed.shard.shardplan as mod

    src = tmp_path / "src"
    for i in range(4):
        write_image(src / "a" / f"{i}.jpg", color=(i * 50, 0, 0))
    dest = tmp_path / "out"
    shard(src, dest, shard_samples=2)
    state = dest / ".gpufeed"
    meta0, bin0 = json.loads((state / "plan.json").read_text()), (state / "plan.bin").read_bytes()
    cols = {name: offset for name, _, offset in meta0["arrays"]["columns"]}

    def plan_with(edit_meta=None, column=None, at=0, raw=b""):
        meta, data = json.loads(json.dumps(meta0)), bytearray(bin0)
        if column is not None:
            data[cols[column] + at:cols[column] + at + len(raw)] = raw
            meta["arrays"]["sha256"] = hashlib.sha256(data).hexdigest()
        if edit_meta is not None:
            edit_meta(meta)
        (state / "plan.json").write_text(json.dumps(meta))
        (state / "plan.bin").write_bytes(bytes(data))
        return mod.read_plan(str(state))

    assert plan_with() is not None
    assert plan_with(column="path_blob", raw=b"a/..jpg") is not None  # '..jpg' is a name, not '..'
    refused = {
        "bytes 2**63": dict(edit_meta=lambda m: m["arrays"].update(bytes=2**63)),
        "bytes 2**40": dict(edit_meta=lambda m: m["arrays"].update(bytes=2**40)),
        "bytes as text": dict(edit_meta=lambda m: m["arrays"].update(bytes=str(len(bin0)))),
        "est_bytes not an int": dict(edit_meta=lambda m: m["shards"][0].update(est_bytes="9")),
        "cache_bytes negative": dict(edit_meta=lambda m: m["shards"][1].update(cache_bytes=-1)),
        "start moved": dict(edit_meta=lambda m: m["shards"][1].update(start=1)),
        "start a float": dict(edit_meta=lambda m: m["shards"][0].update(start=0.0)),
        "absolute path": dict(column="path_blob", raw=b"/a0.jpg"),
        "dot-dot path": dict(column="path_blob", raw=b"../.jpg"),
        "inner dot-dot path": dict(column="path_blob", at=7, raw=b"a/../1x"),
        "negative enc_off": dict(column="enc_off", raw=np.int64(-1).tobytes()),
        "negative enc_len": dict(column="enc_len", at=8, raw=np.int64(-5).tobytes()),
        # a repeated order index would write one sample twice and silently lose another
        "order not a permutation": dict(column="order", raw=np.zeros(4, dtype=np.int64).tobytes()),
        "duplicate class": dict(edit_meta=lambda m: m.update(classes=["a", "a"], class_counts=[4, 0])),
        "class not a string": dict(edit_meta=lambda m: m.update(classes=[7])),
        "class with a newline": dict(edit_meta=lambda m: m.update(classes=["a\nb"])),
        "duplicate shard name": dict(edit_meta=lambda m: m["shards"][1].update(name=m["shards"][0]["name"])),
        "class count a float": dict(edit_meta=lambda m: m.update(class_counts=[4.0])),
        "num_samples as text": dict(edit_meta=lambda m: m.update(num_samples="4")),
        "est_bytes huge": dict(edit_meta=lambda m: m["shards"][0].update(est_bytes=10**24)),
        "cache no shard lists": dict(column="enc_cache", raw=np.int64(7).tobytes()),
    }
    for what, kw in refused.items():
        assert plan_with(**kw) is None, what
    plan_with(**refused["bytes 2**63"])
    with pytest.raises(DataError, match="planned from different input files or options"):
        shard(src, dest, shard_samples=2)  # used to end as an unexpected OverflowError (exit 1)
    plan_with(**refused["dot-dot path"])
    again = shard(src, dest, shard_samples=2, overwrite=True)
    assert not again.resumed and again.num_samples == 4


def test_resume_report_counts_only_what_this_run_wrote(image_folder, tmp_path: Path) -> None:
    from gpufeed.shard import render_shard

    src = image_folder(classes=2, per_class=4)
    dest = tmp_path / "out"
    first = shard(src, dest, shard_samples=2)
    assert first.written_samples == 8 and first.written_bytes == first.total_bytes
    again = shard(src, dest, shard_samples=2)
    assert again.num_shards_written == 0 and again.written_samples == again.written_bytes == 0
    assert again.samples_per_s == 0 and again.mb_per_s == 0 and again.total_bytes == first.total_bytes
    assert "this run: 0 shard(s), 0 images, 0.0 MB" in render_shard(again)
    (dest / "train-000001.tar").unlink()
    part = shard(src, dest, shard_samples=2)
    assert part.num_shards_written == 1 and part.written_samples == 2
    assert part.written_bytes == (dest / "train-000001.tar").stat().st_size < part.total_bytes


def test_concurrent_run_into_the_same_dest_is_refused(image_folder, tmp_path: Path) -> None:
    import fcntl

    src = image_folder(classes=1, per_class=2)
    dest = tmp_path / "out"
    (dest / ".gpufeed").mkdir(parents=True)
    with open(dest / ".gpufeed" / "lock", "a+b") as held:  # what a running `gpufeed shard` holds
        fcntl.flock(held.fileno(), fcntl.LOCK_EX)
        held.write(b"4242\n")  # the holder's pid, as a run records it
        held.flush()
        with pytest.raises(DataError, match=r"in use by another `gpufeed shard` run \(pid 4242\)"):
            shard(src, dest)
    assert shard(src, dest).num_samples == 2  # released: runs
    assert (dest / ".gpufeed" / "lock").read_bytes() == f"{os.getpid()}\n".encode()


def test_refused_run_leaves_no_dest_behind(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=1, per_class=2)
    dest = tmp_path / "new" / "deeper" / "out"
    with pytest.raises(DataError, match="need at least 4 images"):
        shard(src, dest, multiple_of=4)
    assert not (tmp_path / "new").exists()  # every folder the refused run created is gone
    existing = tmp_path / "existing"
    existing.mkdir()
    with pytest.raises(DataError, match="need at least 4 images"):
        shard(src, existing, multiple_of=4)
    assert existing.is_dir() and not list(existing.iterdir())  # the user's folder stays, empty as it was


def test_atomic_writer_syncs_file_and_folder(tmp_path: Path, monkeypatch) -> None:
    import stat

    from gpufeed.core import records

    synced = []
    real_fsync = os.fsync
    monkeypatch.setattr(records.os, "fsync", lambda fd: (synced.append(stat.S_ISDIR(os.fstat(fd).st_mode)),
                                                          real_fsync(fd))[1])
    records.atomic_write_text(tmp_path / "a.json", "{}\n")
    assert (tmp_path / "a.json").read_text() == "{}\n" and synced == [False, True]  # the file, then its folder
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


def test_leftovers_of_killed_atomic_writes_are_cleaned(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=2)
    dest = tmp_path / "out"
    shard(src, dest)
    (dest / "manifest.json").unlink()  # as if killed before the end
    for name in (".index.parquet.k3j2.tmp", ".gpufeed/.plan.json.x8y.tmp", ".gpufeed/.enc-000000.bin.abc.tmp"):
        (dest / name).write_bytes(b"partial")
    rep = shard(src, dest)
    assert rep.resumed and rep.num_shards_written == 0
    assert sorted(p.name for p in dest.rglob("*.tmp")) == []


def test_disk_full_at_finish_names_no_made_up_need(image_folder, tmp_path: Path, monkeypatch) -> None:
    import errno

    import gpufeed.shard.job as job

    def full(*a, **k):
        raise OSError(errno.ENOSPC, "No space left on device")

    src = image_folder(classes=2, per_class=3)
    dest = tmp_path / "out"
    monkeypatch.setattr(job, "finish_set", full)  # the index/manifest write after every shard is complete
    with pytest.raises(RunError) as err:
        shard(src, dest, shard_samples=3)
    msg = str(err.value)
    assert f"DEST {dest} is full" in msg and "0.0 MB more" not in msg and "needed" not in msg
    assert "after its 2 complete shard(s), which a re-run keeps" in msg and "bytes free" in msg
    monkeypatch.undo()
    assert shard(src, dest, shard_samples=3).num_shards_skipped == 2


def test_disk_full_while_reencoding_names_gpufeeds_own_cache(tmp_path: Path, monkeypatch) -> None:
    import errno

    from gpufeed.core import records

    src = noise_folder(tmp_path / "src", per_class=24)  # 48 images: two validation batches, two cache files
    dest = tmp_path / "out"
    real = records.atomic_write_bytes
    calls = []

    def second_fills_the_disk(path, data):
        calls.append((path, len(data)))
        if len(calls) == 2:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(path, data)

    monkeypatch.setattr(records, "atomic_write_bytes", second_fills_the_disk)
    with pytest.raises(DataError) as err:
        shard(src, dest, quality=80)
    (first, first_bytes), _ = calls
    msg = str(err.value)
    assert os.path.basename(first) == "enc-000000.bin" and not os.path.exists(first)  # written, then deleted
    assert f"DEST {dest} is full" in msg
    assert f"{first_bytes} bytes of the space was gpufeed's own transcode cache of re-encoded images" in msg
    assert f"under {dest / '.gpufeed'}, now deleted" in msg
    assert not list(dest.rglob("enc-*"))


def test_free_space_check_after_reencoding_names_the_cache(tmp_path: Path, monkeypatch) -> None:
    import shutil

    src = noise_folder(tmp_path / "src", per_class=4)
    real = shutil.disk_usage
    calls = []
    # The first check (before validation) passes; the exact one after it finds the disk full.
    monkeypatch.setattr(shutil, "disk_usage",
                        lambda p: (calls.append(p), real(p) if len(calls) == 1 else real(p)._replace(free=1000))[1])
    dest = tmp_path / "out"
    with pytest.raises(DataError) as err:
        shard(src, dest, max_size=16)
    cached = sum(p.stat().st_size for p in (dest / ".gpufeed").glob("enc-*.bin"))
    assert cached > 0 and len(calls) == 2
    assert (f"; {cached} bytes of DEST is gpufeed's own transcode cache of re-encoded images under "
            f"{dest / '.gpufeed'}") in str(err.value)


def mixed_folder(root: Path) -> Path:
    """A small ImageFolder with the cases the plan carries: nested folders, PNG stored under .jpg, CMYK, 16-bit
    grayscale, BMP, an EXIF orientation, a non-UTF-8 name, a non-image, an empty file, an ignored extension."""
    write_image(root / "a" / "0.jpg", size=(16, 12), color=(10, 20, 30), quality=95)
    write_image(root / "a" / "sub" / "1.jpg", size=(40, 20), color=(50, 60, 70), quality=90)
    write_image(root / "a" / "png_named.jpg", size=(9, 9), fmt="PNG")
    write_image(root / "a" / "cmyk.jpg", size=(12, 12), mode="CMYK", color=(1, 2, 3))
    write_image(root / "b" / "bmp.bmp", size=(10, 7), fmt="BMP", color=(9, 9, 9))
    exif = Image.Exif()
    exif[0x0112] = 6
    write_image(root / "b" / "rot.jpg", size=(14, 10), color=(100, 0, 0), exif=exif.tobytes())
    Image.fromarray((np.arange(64, dtype=np.uint16).reshape(8, 8) * 1000)).save(root / "b" / "g16.png")
    write_image(root / "b" / os.fsdecode(b"n\xe9.jpg"), size=(8, 8), color=(7, 7, 7))
    (root / "b" / "text.jpg").write_bytes(b"not an image at all")
    (root / "b" / "empty.png").write_bytes(b"")
    (root / "b" / "notes.txt").write_text("x")
    write_image(root / "c" / "x.webp", size=(11, 5), fmt="WEBP", lossless=True)
    for i in range(5):
        write_image(root / "c" / f"{i}.jpg", size=(8 + i, 8), color=(i * 40, 5, 5))
    return root


# sha256 of every output file for mixed_folder, written by the code before the plan became columnar (commit
# bb927f7, Pillow 13): the plan's in-memory and on-disk form may change, the output bytes may not. The one
# deliberate change since: index.parquet dictionary-encodes only its shard and class columns
# (manifest.INDEX_DICTIONARY_COLUMNS; same table, other bytes), and manifest.json lists each shard's keys_sha256
# (the loader's key check; every other file is unchanged).
MIXED_GOLDEN = {
    "default": {
        "_info.json": "ce746bc0422fff7b7c32bd70841c8c7e710a7723e2cb5a1ce47d950a21aaa8d4",
        "index.parquet": "675e09d50a28ed8f7227f110dfeed20dc5922e580ad86c8f4aaee3492b5e18b8",
        "manifest.json": "52f64ce5f918eae48ff9c577bea61b5a872396d53fdd79de8c1beaba3f1ef931",
        "train-000000.tar": "95d37549ecf69322bf340dddc4848fa839d98ae37d78a4194745d62d6d0ae125",
        "train-000001.tar": "8fd8820f48be21a66928002df083e7c76514f3bb165265020dd08e067c9ce797",
        "train-000002.tar": "350f3f772b1688e165074a232d8884cba18d5d4e33ed1569990b346a981f6ffe",
        "train-000003.tar": "f204daaaf65cf4dc92ab8c5a8665777666a3227418131f8ff8c74acfc4eb0f28",
    },
    "max_size": {
        "_info.json": "dbb8275ac8ad5617bdc4b7fde594867e2ddbe9c213835c165a9b29a314136f46",
        "index.parquet": "5c3251ee6cf63a0f273d47812702212cbefbb210c290ad5c27b8b6f3f7d955d5",
        "manifest.json": "640363bc4f927ced6fa770dbb9cb331e21d3eb4a5c62b218b6e3a2dd40dfd3bd",
        "train-000000.tar": "97ddfac815efb2ca724ac5a097299c3aecd5228a6697f09904d46a7b6fe32c3f",
        "train-000001.tar": "62ce31f127abbb24ceef0a52796bb9326891200bd9c913e47791edfc6246b2a5",
        "train-000002.tar": "95f282c84371558ad8cfdbafe6a02f09255daa607bb90f488ac403eb2efb3093",
    },
    "header_w2": {
        "_info.json": "de4f6da3605e36c1d4ccc1515d871c155c64ad089516af4f5de4ea76b2223b84",
        "index.parquet": "be2429ab6fc8ca02b3ab01d76182bd7355b8bbc811b4b285934513038133de2b",
        "manifest.json": "265fbb3b10754258cc0c6ed57e0c4a3bc640430030304df1dada4c82265fe0e2",
        "train-000000.tar": "a0d51174cca539a32dbd2be26d5991ca7fc7202a8593466aea87748b949509d0",
        "train-000001.tar": "1430559f0f3e29b8d792f9a6d240bbe5cb29f8b838c05f488f34bfb4567bcbe4",
        "train-000002.tar": "897e57450c18e261dca9bc92ceaf087fe787e2873892d0aa0e324e00afd3ef75",
        "train-000003.tar": "72f167e853deda432eb411733415365c83c55a2a56c6431acec1e7de6e785749",
        "train-000004.tar": "bc9c3e3f51dc37a111d9bd6eba63d429fa6bb8d8dc7a561a5e76fb313c999b43",
    },
    "range_w2": {
        "_info.json": "67cdedb78b8b8d70d23c4745147eb85a7cce3c8c302540ba9e61d50c5f9ff330",
        "index.parquet": "6179638a24a459e7e1854eb8f2431f10cd44ffbede6e6c9940898da8c805be60",
        "manifest.json": "99db2411f64aeb791dbae202def6c346bd358a274690b53942c0a3253f8e5035",
        "train-000000.tar": "d207092e9cee1660312bccbf41551ed6bbb999d8b260877224a2efec0f2cb1ae",
        "train-000001.tar": "3bc5092ee3517d5be14eb8b9fb0eac17ed27fceab5a15e3fa181578d66ab9d41",
    },
}


@pytest.mark.parametrize("case", ["default", "max_size", "header_w2", "range_w2"])
def test_output_bytes_match_the_pre_columnar_plan(tmp_path: Path, case: str) -> None:
    src = mixed_folder(tmp_path / "src")
    kw = {"default": {"shard_samples": 4}, "max_size": {"max_size": 10, "shard_samples": 5},
          "header_w2": {"check": "header", "workers": 2, "shard_samples": 3},
          "range_w2": {"workers": 2, "shard_samples": 8}}[case]  # 2 shards for 2 workers: written in runs
    dest = tmp_path / "out"
    rep = shard(src, dest, **kw)
    got = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dest.iterdir()) if p.is_file()
           and p.name != "wids.json" and p.suffix != ".idx"}  # the other readers' indexes: test_imagefolder_sidecars
    assert got == MIXED_GOLDEN[case], json.dumps(got, indent=1)
    assert rep.num_rejected == 2 and rep.num_ignored == 1


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_plain_jpeg_fast_path_agrees_with_pillow_on_damaged_headers(tmp_path: Path, monkeypatch) -> None:
    """--check header reads plain JPEG headers itself; for every truncation and many one-byte corruptions of the
    header its verdict (accept with size, or let Pillow decide) equals Pillow's."""
    import gpufeed.shard.validate as mod

    opts = mod.CheckOptions(check="header", max_pixels=178_956_970, max_size=None, quality=None)
    exif = Image.Exif()
    exif[0x0112] = 3
    sources = [
        write_image(tmp_path / "rgb.jpg", size=(21, 13), quality=90),
        write_image(tmp_path / "gray.jpg", size=(9, 17), mode="L"),
        write_image(tmp_path / "prog.jpg", size=(30, 8), progressive=True, optimize=True),
        write_image(tmp_path / "exif.jpg", size=(12, 12), exif=exif.tobytes()),
        write_image(tmp_path / "cmyk.jpg", size=(8, 8), mode="CMYK"),
    ]
    real_fast = mod.plain_jpeg_size
    assert [real_fast(p.read_bytes(), 10**9) for p in sources] == [(21, 13), (9, 17), (30, 8), None, None]
    probe = tmp_path / "probe.jpg"
    fast_hits = 0

    def both(data: bytes) -> None:
        nonlocal fast_hits
        probe.write_bytes(data)
        monkeypatch.setattr(mod, "plain_jpeg_size", real_fast)
        fast = mod.inspect_file(str(probe), opts)
        monkeypatch.setattr(mod, "plain_jpeg_size", lambda *a: None)
        slow = mod.inspect_file(str(probe), opts)
        assert fast == slow, (len(data), fast, slow)
        fast_hits += real_fast(data, 10**9) is not None

    for src in sources:
        data = src.read_bytes()
        sos = data.index(b"\xff\xda")
        for cut in range(0, sos + 16):
            both(data[:cut])
        for i in range(2, sos + 14):
            for v in (0x00, 0x03, 0xC0, 0xFF, data[i] ^ 0x80):
                both(data[:i] + bytes([v]) + data[i + 1:])
    assert fast_hits > 500  # the fast path did take part


def test_sample_json_is_exactly_json_dumps() -> None:
    from gpufeed.shard.write import Sample, sample_json

    for cname, source, orientation, size in [("cat", "cat/1.jpg", 1, (8, 8)),
                                             ('ü"\\\x1f', 'ü/"a\\b\u2028.jpg', 1, (8, 8)),
                                             ('q"\\\n\t\x01é\u2028', 'd/"x"\\é\x7f.jpg', 6, (30, 20)),
                                             ("x", "x/\ufffd.png", 70000, (8, 9))]:
        s = Sample("00001_0000002", "/abs", 1, cname, source, orientation, "png", 8, 8, *size, "ab" * 32, 10,
                    None, None, 0)
        meta = {"source": source, "class": cname, "label": 1, "width": 8, "height": 8, "format": "png",
                "sha256": "ab" * 32}
        if orientation != 1:
            meta["exif_orientation"] = orientation
        if size != (8, 8):
            meta["orig_width"], meta["orig_height"] = size
        assert sample_json(s) == json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")


def test_small_and_large_images_are_copied_to_the_same_bytes(image_folder, tmp_path: Path, monkeypatch) -> None:
    """Write tasks read small images into one buffer and copy large ones by sendfile: the bytes do not depend on
    which."""
    import gpufeed.shard.write as mod

    src = image_folder(classes=2, per_class=6)
    write_image(src / "class_0" / "cmyk.jpg", mode="CMYK")  # one transcoded sample (from the batch cache)
    write_image(src / "class_1" / "a.png", fmt="PNG")  # a member after "json" in name order
    a = shard(src, tmp_path / "a", shard_samples=5, workers=1)
    monkeypatch.setattr(mod, "_INLINE_BYTES", 0)
    b = shard(src, tmp_path / "b", shard_samples=5, workers=1)
    monkeypatch.setattr(mod, "_INLINE_BYTES", 300)  # some of each in one task (the PNG read, the JPEGs sent)
    c = shard(src, tmp_path / "c", shard_samples=5, workers=1)
    assert a.num_shards == 3 and a.transforms.get("cmyk_to_rgb_jpeg") == 1
    assert digests(tmp_path / "a") == digests(tmp_path / "b") == digests(tmp_path / "c")


def test_index_is_written_in_row_groups_in_shard_order(image_folder, tmp_path: Path, monkeypatch) -> None:
    """index.parquet is built and written a block of rows at a time (one row group each), in shard order,
    whatever the block size."""
    import pyarrow.parquet as pq

    import gpufeed.shard.finish as mod

    src = image_folder(classes=3, per_class=7)
    shard(src, tmp_path / "whole", shard_samples=4)
    monkeypatch.setattr(mod, "_INDEX_BLOCK", 5)  # blocks that straddle shards and classes
    rep = shard(src, tmp_path / "blocks", shard_samples=4)
    f = pq.ParquetFile(tmp_path / "blocks" / "index.parquet")
    assert f.metadata.num_row_groups == 5  # 21 rows
    table = f.read()
    assert table.to_pydict() == pq.read_table(tmp_path / "whole" / "index.parquet").to_pydict()
    in_tars = []
    for name in rep.shards:
        with tarfile.open(tmp_path / "blocks" / name) as tf:
            in_tars += [(m.name.split(".")[0], name) for m in tf.getmembers() if m.name.endswith(".cls")]
    assert list(zip(table["key"].to_pylist(), table["shard"].to_pylist())) == in_tars
    assert len(in_tars) == 21
