"""Labels against torchvision's ImageFolder (``classes_like``, the hidden-folder note) and the sidecar indexes
that other readers consume (wids' shard index, DALI's ``.idx`` files, timm's ``_info.json``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError
from gpufeed.shardset.manifest import read_manifest
from gpufeed.shard import CANDIDATE_EXTENSIONS, write_shards
from tests.common.cli import invoke
from tests.common.shards import write_image


def shard(src: Path, dest: Path, **kw) -> object:
    kw.setdefault("workers", 1)
    return write_shards(ShardConfig(src=str(src), dest=str(dest), **kw), progress=False)


def jupyter_folder(root: Path) -> Path:
    """An image folder as a notebook user has it: ``.ipynb_checkpoints`` at the root (no image in it), another
    hidden folder that holds an image, hidden files and folders inside classes, an empty class, odd extensions
    (upper case, .jpeg, .ppm, .gif, none) and a nested folder."""
    write_image(root / "cat" / "a.jpg", color=(10, 20, 30))
    write_image(root / "cat" / "B.JPG", color=(11, 20, 30))
    write_image(root / "cat" / ".hidden.jpg", color=(12, 20, 30))
    write_image(root / "cat" / ".sub" / "in_hidden.png", fmt="PNG", color=(13, 20, 30))
    write_image(root / "cat" / "anim.gif", fmt="GIF", color=(14, 20, 30))
    (root / "cat" / "notes").write_text("not an image")
    write_image(root / "dog" / "c.jpeg", color=(15, 20, 30))
    write_image(root / "dog" / "nested" / "d.ppm", fmt="PPM", color=(16, 20, 30))
    write_image(root / "eel" / "e.png", fmt="PNG", color=(17, 20, 30))
    write_image(root / ".hidden_class" / "f.jpg", color=(18, 20, 30))
    (root / ".ipynb_checkpoints").mkdir()
    (root / ".ipynb_checkpoints" / "train-checkpoint.ipynb").write_text("{}")
    (root / "empty").mkdir()
    (root / ".DS_Store").write_bytes(b"\0\0\0\1Bud1")
    return root


def gpufeed_labels(dest: Path) -> dict[str, int]:
    import pyarrow.parquet as pq

    t = pq.read_table(dest / "index.parquet", columns=["source", "label"]).to_pydict()
    return dict(zip(t["source"], t["label"]))


def imagefolder_labels(src: Path) -> tuple[list[str], dict[str, int]]:
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(src), allow_empty=True)
    return ds.classes, {os.path.relpath(p, src).replace(os.sep, "/"): y for p, y in ds.samples}


def test_extensions_are_torchvisions() -> None:
    from torchvision.datasets.folder import IMG_EXTENSIONS

    assert tuple(CANDIDATE_EXTENSIONS) == tuple(IMG_EXTENSIONS)


def test_classes_like_imagefolder_matches_torchvision(tmp_path: Path) -> None:
    from torchvision.datasets.folder import find_classes

    src = jupyter_folder(tmp_path / "src")
    dest = tmp_path / "out"
    rep = shard(src, dest, classes_like="imagefolder", allow_empty_classes=True)
    classes, _ = find_classes(str(src))
    assert classes == [".hidden_class", ".ipynb_checkpoints", "cat", "dog", "eel", "empty"]
    assert rep.classes == classes and read_manifest(dest).classes == classes
    assert sorted(rep.empty_classes) == [".ipynb_checkpoints", "empty"]
    tv_classes, tv = imagefolder_labels(src)
    assert tv_classes == classes
    ours = gpufeed_labels(dest)
    # every file ImageFolder lists is a valid image here: gpufeed stores the same files under the same labels
    assert ours == tv
    assert "cat/.hidden.jpg" in ours and "cat/.sub/in_hidden.png" in ours
    assert read_manifest(dest).options["classes_like"] == "imagefolder"
    assert not any("hidden folder" in w for w in rep.warnings)


def test_classes_like_imagefolder_without_allow_empty_refuses_like_imagefolder(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    with pytest.raises(DataError, match=r"\.ipynb_checkpoints"):
        shard(src, tmp_path / "out", classes_like="imagefolder")
    from torchvision.datasets import ImageFolder

    with pytest.raises(FileNotFoundError, match=r"\.ipynb_checkpoints"):
        ImageFolder(str(src))


def test_default_skips_hidden_folders_and_says_imagefolder_would_count_them(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    dest = tmp_path / "out"
    rep = shard(src, dest, allow_empty_classes=True)
    assert rep.classes == ["cat", "dog", "eel", "empty"]
    notes = [w for w in rep.warnings if "ImageFolder" in w]
    assert len(notes) == 1
    assert ".ipynb_checkpoints" in notes[0] and ".hidden_class" in notes[0]
    assert "--classes-like imagefolder" in notes[0]
    assert {i.path for i in rep.ignored if "ImageFolder would count" in i.reason} == {".hidden_class",
                                                                                     ".ipynb_checkpoints"}
    assert "classes_like" not in read_manifest(dest).options  # a default set's manifest is as before
    # the labels differ from ImageFolder's by the two hidden classes before them, which is what the note says
    _, tv = imagefolder_labels(src)
    ours = gpufeed_labels(dest)
    assert ours and all(tv[p] == y + 2 for p, y in ours.items())
    assert "cat/.hidden.jpg" not in ours


def test_no_note_without_hidden_folders(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=2)
    (src / ".hidden_file").write_text("x")
    rep = shard(src, tmp_path / "out")
    assert not any("ImageFolder" in w for w in rep.warnings)


def test_cli_classes_like_and_note(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    r = invoke(["shard", str(src), str(tmp_path / "a"), "--workers", "1", "--quiet", "--allow-empty-classes"])
    line = [ln for ln in r.output.splitlines() if ln.strip().startswith("warning:") and "ImageFolder" in ln]
    assert len(line) == 1 and ".ipynb_checkpoints" in line[0]
    r = invoke(["shard", str(src), str(tmp_path / "b"), "--workers", "1", "--quiet", "--allow-empty-classes",
                "--classes-like", "imagefolder"])
    assert read_manifest(tmp_path / "b").classes[:2] == [".hidden_class", ".ipynb_checkpoints"]
    invoke(["shard", str(src), str(tmp_path / "c"), "--classes-like", "nope"], expect=2)


# --------------------------------------------------------------------------- sidecar indexes


def read_idx(path: Path) -> list[list[tuple[str, int, int, str]]]:
    """A DALI v1.2 index file -> per sample, its members as (ext, offset, size, name)."""
    lines = path.read_bytes().decode("utf-8", "surrogateescape").split("\n")
    version, n = lines[0].split(" ")
    assert version == "v1.2" and lines[-1] == "" and len(lines) == int(n) + 2
    out = []
    for line in lines[1:-1]:
        f = line.split(" ")
        assert len(f) % 4 == 0 and f
        out.append([(f[i], int(f[i + 1]), int(f[i + 2]), f[i + 3]) for i in range(0, len(f), 4)])
    return out


def check_idx_against_tar(idx: Path, tar: Path) -> int:
    """Every entry of ``idx`` names a regular member of ``tar`` (as Python's tarfile reads it, a reader
    independent of gpufeed's) with its data offset and size, in tar order, grouped by base name, and the bytes
    at that offset are the member's. -> samples."""
    import tarfile

    with tarfile.open(tar) as tf:
        regular = [m for m in tf.getmembers() if m.isreg()]
        want = [(m.name.split("/")[-1].split(".", 1)[1], m.offset_data, m.size, m.name) for m in regular]
        data = {m.name: tf.extractfile(m).read() for m in regular}
    samples = read_idx(idx)
    assert [c for s in samples for c in s] == want
    for s in samples:
        assert len({c[3][:c[3].find(".", c[3].rfind("/") + 1)] for c in s}) == 1  # one base name a line
        for ext, offset, size, name in s:
            assert offset % 512 == 0
            with open(tar, "rb") as f:
                f.seek(offset)
                assert f.read(size) == data[name]
    return len(samples)


def test_shard_writes_sidecars_that_wids_and_timm_read(image_folder, tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("wids")
    timm_data = pytest.importorskip("timm.data")
    import pyarrow.parquet as pq
    import wids

    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))
    src = image_folder(classes=3, per_class=5)
    dest = tmp_path / "out"
    rep = shard(src, dest, shard_samples=4)
    m = read_manifest(dest)
    assert not [w for w in rep.warnings if "DALI" in w or "wids" in w]
    for s in m.shards:  # one DALI index per shard, its offsets those of the tar
        assert check_idx_against_tar(dest / s.name.replace(".tar", ".idx"), dest / s.name) == s.num_samples
    keys = pq.read_table(dest / "index.parquet", columns=["key", "label"]).to_pydict()
    ds = wids.ShardListDataset(str(dest / "wids.json"), transformations=[])
    assert len(ds) == m.num_samples == 15
    got = [ds[i] for i in range(len(ds))]
    assert [s["__key__"] for s in got] == keys["key"]
    assert [int(s[".cls"].read()) for s in got] == keys["label"]
    assert {s["__shard__"] for s in got} == {str(dest / s.name) for s in m.shards}
    tds = timm_data.create_dataset("wds/out", root=str(dest), split="train")
    assert len(tds) == 15
    assert sorted(y for _, y in tds) == sorted(keys["label"])


def foreign_shards(folder: Path, gz: bool = False, long: bool = False) -> list[Path]:
    """Two shards as other tools write them (Python's tarfile): a directory entry, a member larger than one
    block, a key with a '/' in it; ``long``: that key is a long name (a GNU or a pax header before it, which wids'
    own tar reader does not read)."""
    import io
    import tarfile

    from tests.common.shards import write_image as _w

    img = _w(folder / "_img.jpg", size=(40, 30)).read_bytes()
    (folder / "_img.jpg").unlink()
    out = []
    sub = "k" * 120 if long else "k"
    for i, fmt in enumerate((tarfile.GNU_FORMAT, tarfile.PAX_FORMAT)):
        path = folder / (f"data-{i:03d}.tar" + (".gz" if gz else ""))
        with tarfile.open(path, "w:gz" if gz else "w", format=fmt) as tf:
            d = tarfile.TarInfo("sub")
            d.type = tarfile.DIRTYPE
            tf.addfile(d)
            for key, label in ((f"a{i}", 0), (f"sub/{sub}{i}", 1), (f"z{i}", 1)):
                for ext, data in (("jpg", img), ("cls", str(label).encode()), ("txt", b"x" * 700)):
                    info = tarfile.TarInfo(f"{key}.{ext}")
                    info.size = len(data)
                    tf.addfile(info, io.BytesIO(data))
        out.append(path)
    return out


def test_index_writes_sidecars_relative_to_out(tmp_path: Path, monkeypatch) -> None:
    wids = pytest.importorskip("wids")
    timm_data = pytest.importorskip("timm.data")
    from gpufeed.index import index_shards

    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))
    shards = tmp_path / "shards"
    shards.mkdir()
    paths = foreign_shards(shards)
    out = tmp_path / "meta"
    rep = index_shards(shards, out=out)
    assert rep.ok and rep.num_samples == 6 and rep.notes == []
    for p in paths:
        assert check_idx_against_tar(out / p.name.replace(".tar", ".idx"), p) == 3
    assert not list(shards.glob("*.idx"))  # the shard folder is left as it was
    desc = json.loads((out / "wids.json").read_text())
    assert [s["url"] for s in desc["shardlist"]] == ["../shards/data-000.tar", "../shards/data-001.tar"]
    ds = wids.ShardListDataset(str(out / "wids.json"), transformations=[])
    assert len(ds) == 6
    assert [ds[i]["__key__"] for i in range(6)] == ["a0", "sub/k0", "z0", "a1", "sub/k1", "z1"]
    assert [int(ds[i][".cls"].read()) for i in range(6)] == [0, 1, 1, 0, 1, 1]
    info = json.loads((out / "_info.json").read_text())
    assert info["splits"]["data"]["filenames"] == ["../shards/data-000.tar", "../shards/data-001.tar"]
    assert info["num_classes"] == 2
    tds = timm_data.create_dataset("wds/x", root=str(out), split="data")
    assert len(tds) == 6 and sorted(y for _, y in tds) == [0, 0, 1, 1, 1, 1]


def test_dali_index_offsets_after_long_names(tmp_path: Path) -> None:
    from gpufeed.index import index_shards

    shards = tmp_path / "shards"
    shards.mkdir()
    paths = foreign_shards(shards, long=True)
    rep = index_shards(shards)
    assert rep.ok and rep.notes == []
    for p in paths:  # GNU long-name and pax headers before a member: its data starts after them
        assert check_idx_against_tar(shards / p.name.replace(".tar", ".idx"), p) == 3


def test_index_of_gzip_shards_writes_timm_info_and_says_why_not_the_others(tmp_path: Path) -> None:
    from gpufeed.index import index_shards, render

    shards = tmp_path / "shards"
    shards.mkdir()
    foreign_shards(shards, gz=True)
    rep = index_shards(shards)
    assert json.loads((shards / "_info.json").read_text())["splits"]["data"]["num_samples"] == 6
    assert not (shards / "wids.json").exists() and not list(shards.glob("*.idx"))
    assert len(rep.notes) == 1 and "gzip" in rep.notes[0]
    assert "note: no wids.json" in render(rep)


def test_a_member_name_with_white_space_gets_no_dali_index(tmp_path: Path) -> None:
    from gpufeed.index import index_shards
    from tests.common.shards import write_tar

    img = write_image(tmp_path / "i.jpg").read_bytes()
    shards = tmp_path / "shards"
    shards.mkdir()
    write_tar(shards / "s-000.tar", [("ok.jpg", img), ("ok.cls", b"0")])
    write_tar(shards / "s-001.tar", [("has space.jpg", img), ("has space.cls", b"1")])
    rep = index_shards(shards)
    assert check_idx_against_tar(shards / "s-000.idx", shards / "s-000.tar") == 1
    assert not (shards / "s-001.idx").exists()
    assert rep.notes == ["no DALI index for s-001.tar: member 'has space.jpg' has white space in its name, which "
                         "the index format cannot hold"]
    assert (shards / "wids.json").exists()


def test_tar_members_refuses_what_every_reader_refuses(tmp_path: Path) -> None:
    from gpufeed.shardset.tar import TarFormatError
    from gpufeed.shardset.sidecars import tar_members
    from tests.common.shards import write_tar

    good = write_tar(tmp_path / "g.tar", [("a.jpg", b"x" * 1000), ("a.cls", b"1")])
    assert list(tar_members(str(good))) == [("a.jpg", 512, 1000), ("a.cls", 2048, 1)]
    data = bytearray(good.read_bytes())
    data[124:136] = b"77777777777\0"  # a size far past the end of the file
    bad = tmp_path / "b.tar"
    bad.write_bytes(bytes(data))
    with pytest.raises(TarFormatError):
        list(tar_members(str(bad)))
    data = bytearray(good.read_bytes())
    data[0] ^= 1  # checksum no longer matches
    bad.write_bytes(bytes(data))
    with pytest.raises(TarFormatError, match="checksum"):
        list(tar_members(str(bad)))


def test_dali_reads_the_index_on_cpu(image_folder, tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    src = image_folder(classes=2, per_class=3)
    dest = tmp_path / "out"
    shard(src, dest, shard_samples=2)
    m = read_manifest(dest)
    tars = [str(dest / s.name) for s in m.shards]
    idxs = [t.replace(".tar", ".idx") for t in tars]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        jpg, cls = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["jpg", "cls"], random_shuffle=False)
        return jpg, cls

    p = pipe()
    p.build()
    import pyarrow.parquet as pq

    want = pq.read_table(dest / "index.parquet", columns=["label"]).to_pydict()["label"]
    got = []
    for _ in range(m.num_samples):
        jpg, cls = p.run()
        got.append(int(bytes(cls.at(0)).decode()))
        assert bytes(jpg.at(0))[:2] == b"\xff\xd8"
    assert got == want


def test_stage_writes_the_sidecars_of_the_shards_it_stages(tmp_path: Path, monkeypatch) -> None:
    wids = pytest.importorskip("wids")
    from tests.common.cli import invoke_json
    from tests.common.shards import write_tiny_shards

    monkeypatch.setenv("WIDS_CACHE", str(tmp_path / "wids-cache"))
    src = write_tiny_shards(tmp_path / "src", [6, 5, 7])
    m = read_manifest(src)
    for node, mine in ((None, [0, 1, 2]), (1, [1])):
        dest = tmp_path / f"dest{node}"
        args = ["stage", str(src), str(dest), "--quiet"]
        if node is not None:
            args += ["--num-nodes", "2", "--node-rank", str(node)]
        invoke_json(args)
        names = [m.shards[i].name for i in mine]
        desc = json.loads((dest / "wids.json").read_text())
        assert [s["url"] for s in desc["shardlist"]] == names  # the shards here, next to it
        assert len(wids.ShardListDataset(str(dest / "wids.json"), transformations=[])) == \
            sum(m.shards[i].num_samples for i in mine)
        info = json.loads((dest / "_info.json").read_text())
        assert info["splits"][m.prefix]["filenames"] == names
        assert sorted(p.name for p in dest.glob("*.idx")) == sorted(n.replace(".tar", ".idx") for n in names)
        for n in names:
            check_idx_against_tar(dest / n.replace(".tar", ".idx"), dest / n)


def mixed_formats(root: Path) -> Path:
    """jpg sorts before the json member, png and webp after it: both member layouts of a sample."""
    for i in range(9):
        fmt, ext = (("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp"))[i % 3]
        write_image(root / f"c{i % 2}" / f"{i}.{ext}", size=(8 + i, 8), fmt=fmt, color=(i * 20, 3, 3))
    return root


@pytest.mark.parametrize("mode", ["whole", "ranges", "one_pass"])
def test_the_writers_dali_index_is_the_one_its_tar_headers_give(tmp_path: Path, mode: str) -> None:
    """``gpufeed shard`` writes each shard's .idx from the layout it writes (whole shards in a worker, runs of
    one shard, the one pass); it must be byte for byte the index read back from the tar's headers."""
    from gpufeed.shardset.sidecars import dali_index, tar_members

    src = mixed_formats(tmp_path / "src")
    kw = {"whole": {"shard_samples": 2, "workers": 1}, "ranges": {"shard_samples": 9, "workers": 2},
          "one_pass": {"shard_samples": 2, "workers": 2, "check": "header"}}[mode]
    dest = tmp_path / "out"
    shard(src, dest, **kw)
    m = read_manifest(dest)
    for s in m.shards:
        idx = dest / s.name.replace(".tar", ".idx")
        assert idx.read_bytes() == dali_index(tar_members(str(dest / s.name)))[0]
        assert check_idx_against_tar(idx, dest / s.name) == s.num_samples


def test_resume_rewrites_a_missing_dali_index_from_the_tar(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=4)
    dest = tmp_path / "out"
    shard(src, dest, shard_samples=2)
    before = {p.name: p.read_bytes() for p in dest.glob("*.idx")}
    assert len(before) == 4
    (dest / "train-000001.idx").unlink()
    rep = shard(src, dest, shard_samples=2)
    assert rep.num_shards_written == 0  # every shard kept
    assert {p.name: p.read_bytes() for p in dest.glob("*.idx")} == before


def test_dali_reads_the_index_of_an_indexed_foreign_set_on_cpu(tmp_path: Path) -> None:
    pytest.importorskip("nvidia.dali")
    from nvidia.dali import fn, pipeline_def

    from gpufeed.index import index_shards

    shards = tmp_path / "shards"
    shards.mkdir()
    paths = foreign_shards(shards, long=True)  # GNU long-name and pax headers before members
    out = tmp_path / "meta"
    index_shards(shards, out=out)
    tars = [str(p) for p in paths]
    idxs = [str(out / p.name.replace(".tar", ".idx")) for p in paths]

    @pipeline_def(batch_size=1, num_threads=1, device_id=None)
    def pipe():
        cls, txt = fn.readers.webdataset(paths=tars, index_paths=idxs, ext=["cls", "txt"], random_shuffle=False)
        return cls, txt

    p = pipe()
    p.build()
    got = []
    for _ in range(6):
        cls, txt = p.run()
        got.append(int(bytes(cls.at(0)).decode()))
        assert bytes(txt.at(0)) == b"x" * 700
    assert got == [0, 1, 1, 0, 1, 1]


def test_overwrite_clears_the_old_sets_indexes(image_folder, tmp_path: Path) -> None:
    src = image_folder(classes=2, per_class=4)
    dest = tmp_path / "out"
    shard(src, dest, shard_samples=2)
    assert len(list(dest.glob("*.idx"))) == 4
    shard(src, dest, shard_samples=4, overwrite=True)
    assert sorted(p.name for p in dest.glob("*.idx")) == ["train-000000.idx", "train-000001.idx"]
    assert len(json.loads((dest / "wids.json").read_text())["shardlist"]) == 2


def test_classes_file_sets_the_classes_and_their_order(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    listed = tmp_path / "classes.txt"
    listed.write_text("eel\n.hidden_class\ncat\n")
    dest = tmp_path / "out"
    rep = shard(src, dest, classes_file=str(listed))
    assert rep.classes == read_manifest(dest).classes == ["eel", ".hidden_class", "cat"]
    assert not any("ImageFolder" in w for w in rep.warnings)  # the user chose the classes
    ours = gpufeed_labels(dest)
    assert ours == {"eel/e.png": 0, ".hidden_class/f.jpg": 1, "cat/a.jpg": 2, "cat/B.JPG": 2}
    reasons = {i.path: i.reason for i in rep.ignored}
    assert {reasons[f] for f in ("dog", "empty", ".ipynb_checkpoints")} == {f"folder not in the class list {listed}"}


def test_classes_file_naming_what_is_not_a_folder_of_src_is_refused(tmp_path: Path) -> None:
    src = jupyter_folder(tmp_path / "src")
    listed = tmp_path / "classes.txt"
    listed.write_text("cat\n../src\nnope\n")
    r = invoke(["shard", str(src), str(tmp_path / "out"), "--classes", str(listed), "--quiet"], expect=2)
    assert f"class list {listed} names '../src', 'nope', not a folder in SRC" in r.output
    assert not (tmp_path / "out").exists()


def test_index_keeps_the_users_own_timm_info_and_wids_json(tmp_path: Path) -> None:
    from gpufeed.index import index_shards

    shards = tmp_path / "shards"
    shards.mkdir()
    foreign_shards(shards)
    theirs = {"name": "mine", "splits": {"train": {}, "validation": {}}}
    (shards / "_info.json").write_text(json.dumps(theirs))
    (shards / "wids.json").write_bytes(b"not json")
    rep = index_shards(shards)
    assert json.loads((shards / "_info.json").read_text()) == theirs
    assert (shards / "wids.json").read_bytes() == b"not json"
    assert len(rep.notes) == 2 and all("is kept as it is (not written by gpufeed index)" in n for n in rep.notes)
    assert len(list(shards.glob("*.idx"))) == 2
    # a second index replaces what the first one wrote
    (shards / "_info.json").unlink()
    (shards / "wids.json").unlink()
    index_shards(shards)
    (shards / "data-001.tar").unlink()
    rep = index_shards(shards)
    assert rep.notes == []
    assert json.loads((shards / "_info.json").read_text())["splits"]["data"]["filenames"] == ["data-000.tar"]
    assert [s["url"] for s in json.loads((shards / "wids.json").read_text())["shardlist"]] == ["data-000.tar"]


def test_verify_and_index_pass_over_the_sidecars(image_folder, tmp_path: Path) -> None:
    from gpufeed.index import resolve_shards
    from tests.common.cli import invoke_json

    dest = tmp_path / "out"
    shard(image_folder(classes=2, per_class=3), dest, shard_samples=2)
    assert (dest / "wids.json").exists() and list(dest.glob("*.idx"))
    r = invoke_json(["verify", str(dest), "--no-decode"])
    assert r["ok"] and r["warnings"] == []
    assert [p.name for p in resolve_shards(dest)] == [f"train-{i:06d}.tar" for i in range(3)]
