"""The shard-set format home (gpufeed.shardset, gpufeed.shardset.manifest): one key rule, one header writer, one index
schema, and the jobs that read shards import it rather than each other."""

from __future__ import annotations

import gzip
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest

from gpufeed.shardset.keys import SampleGrouper, is_metadata, split_member, wanted
from gpufeed.shardset.tar import iter_members, iter_samples, ustar_header
from tests.common.shards import write_tar


@pytest.mark.parametrize("name, expected", [
    ("a.jpg", ("a", "jpg")),
    ("dir/sub/k.JPEG", ("dir/sub/k", "jpeg")),
    ("x.seg.PNG", ("x", "seg.png")),
    ("d.v1/k.cls", ("d.v1/k", "cls")),
    ("noext", None),
    (".cls", None),
    ("d.x/.cls", None),
    ("dir/.cls", ("dir/", "cls")),
    ("dir.x/", None),
])
def test_split_member_is_webdatasets_rule(name, expected):
    from webdataset.tariterators import base_plus_ext

    assert split_member(name) == expected
    prefix, suffix = base_plus_ext(name)
    assert (None if prefix is None else (prefix, suffix.lower())) == expected


def test_wanted_and_metadata():
    exts = frozenset({"jpg", "cls"})
    assert [n for n in ("a.JPG", "a.cls", "a.json", "a.seg.jpg", ".jpg", "d/b.cls", "jpg") if wanted(n, exts)] == \
        ["a.JPG", "a.cls", "d/b.cls"]
    assert [n for n in ("__key__", "__dir__/a.jpg", "___", "a__b__.jpg", "d/__key__", "__a.jpg")
            if is_metadata(n)] == ["__key__", "__dir__/a.jpg", "___"]


def test_grouper_and_lean_reader_group_alike(tmp_path: Path):
    """index/verify (SampleGrouper over tarfile) and the loader (iter_samples) find the same samples."""
    names = ["a.jpg", "a.cls", "a.seg.png", "d/b.png", "d/b.cls", "__meta__", "c.cls", "e.JPEG", "e.cls",
             "noext", "a.jpg"]
    path = tmp_path / "s.tar"
    write_tar(path, [(n, str(i).encode()) for i, n in enumerate(names)])
    problems: list[tuple[str, str]] = []
    grouper = SampleGrouper(lambda member, reason, kind: problems.append((member, kind)))
    with tarfile.open(path) as tf:
        groups = list(grouper.samples((m.name, tf.extractfile(m).read()) for m in tf))
    images = ("jpg", "jpeg", "png", "webp")
    ours = [(k, sorted(p)) for k, p in groups if any(e in p for e in images)]
    assert ours == [("a", ["cls", "jpg", "seg.png"]), ("d/b", ["cls", "png"]), ("e", ["cls", "jpeg"]),
                    ("a", ["jpg"])]
    assert problems == [("noext", "name"), ("a.jpg", "ungrouped")]
    lean = [(s["__key__"], sorted(k for k in s if not k.startswith("__")))
            for s in iter_samples(str(path), frozenset({*images, "cls"}), images)]
    assert lean == [("a", ["cls", "jpg"]), ("d/b", ["cls", "png"]), ("e", ["cls", "jpeg"]), ("a", ["jpg"])]
    # the loader's gzip path (and the stream path) group exactly like the plain one, data included
    gz = tmp_path / "s.tgz"
    gz.write_bytes(gzip.compress(path.read_bytes()))
    exts = frozenset({*images, "cls"})
    plain = [{k: v for k, v in s.items() if k != "__url__"} for s in iter_samples(str(path), exts, images)]
    assert plain[0] == {"__key__": "a", "jpg": b"0", "cls": b"1"}
    for p, stream in ((gz, False), (path, True)):
        assert [{k: v for k, v in s.items() if k != "__url__"}
                for s in iter_samples(str(p), exts, images, stream=stream)] == plain
        total = [-1]
        assert [s["__key__"] for s in iter_samples(str(p), exts, images, 1, None, total, stream=stream)] == \
            ["d/b", "e", "a"] and total == [4]


@pytest.mark.parametrize("compress", [False, True])
def test_every_reader_refuses_a_wanted_member_over_the_cap(tmp_path: Path, monkeypatch, compress):
    """A member over MAX_MEMBER_BYTES is refused before it is read by the lean reader and by TarPass (index,
    verify, the loader's gzip path); one that is not wanted is passed over."""
    import gpufeed.shardset.tar as tar

    monkeypatch.setattr(tar, "MAX_MEMBER_BYTES", 1000)
    path = write_tar(tmp_path / "s.tar", [("a.cls", b"1"), ("big.jpg", b"\0" * 1001), ("c.jpg", b"x" * 1000)],
                     gz=compress)
    refused = r"member 'big\.jpg' \(header at offset 1024\): member is 1001 bytes, more than the 1000"
    if not compress:
        with open(path, "rb") as f:
            assert [(n, d) for n, d in iter_members(f, lambda n: n != "big.jpg")] == \
                [("a.cls", b"1"), ("big.jpg", None), ("c.jpg", b"x" * 1000)]
        with open(path, "rb") as f, pytest.raises(tar.TarFormatError, match=refused):
            list(iter_members(f, lambda n: True))
    with open(path, "rb") as f:
        assert [(n, s, d) for n, s, d in tar.TarPass(f, compress).members(lambda n, s: n != "big.jpg")] == \
            [("a.cls", 1, b"1"), ("big.jpg", 1001, None), ("c.jpg", 1000, b"x" * 1000)]
    with open(path, "rb") as f, pytest.raises(tar.TarFormatError, match=refused):
        list(tar.TarPass(f, compress).members(lambda n, s: True))


CASES = [("00000_0000000.jpg", 0), ("00012_0001234.json", 511), ("00012_0001234.cls", 512), ("k" * 100, 8**11 - 1),
         ("dir/ünï.webp", 70000)]


def test_ustar_header_is_shards_and_reads_back_with_both_readers(tmp_path: Path):
    from gpufeed.shardset.tar import ustar_headers

    for name, size in CASES:
        hdr = ustar_header(name, size)
        stem, dot, ext = name.rpartition(".")
        if dot:  # the writer's form: a sample's members share their key
            assert ustar_headers(stem, ((ext, size), ("cls", 3))) == [hdr, ustar_header(f"{stem}.cls", 3)]
        ti = tarfile.TarInfo(name)
        ti.size, ti.mtime, ti.mode, ti.uid, ti.gid, ti.uname, ti.gname = size, 0, 0o644, 0, 0, "", ""
        assert hdr == ti.tobuf(format=tarfile.USTAR_FORMAT, encoding="utf-8")
    small = [(n, s) for n, s in CASES if s < 1 << 20]
    path = tmp_path / "t.tar"
    with open(path, "wb") as f:
        for name, size in small:
            f.write(ustar_header(name, size) + bytes([size % 251]) * size + b"\0" * (-size % 512))
        f.write(b"\0" * 1024)
    with open(path, "rb") as f:
        lean = [(n, d) for n, d in iter_members(f, lambda n: True)]
    with tarfile.open(path, encoding="utf-8") as tf:
        theirs = [(m.name, tf.extractfile(m).read()) for m in tf]
        assert all((m.mtime, m.mode, m.uid, m.gid, m.uname, m.gname) == (0, 0o644, 0, 0, "", "") for m in tf)
    expected = [(n, bytes([s % 251]) * s) for n, s in small]
    assert lean == theirs == expected


@pytest.mark.parametrize("name, size", [("k" * 101, 1), ("é" * 51, 1), ("a.jpg", 8**11), ("a.jpg", -1)])
def test_ustar_header_refuses_what_does_not_fit(name, size):
    with pytest.raises(ValueError, match="does not fit a plain USTAR header"):
        ustar_header(name, size)
    from gpufeed.shardset.tar import ustar_headers

    stem, _, ext = name.rpartition(".")
    with pytest.raises(ValueError, match="does not fit a plain USTAR header"):
        ustar_headers(stem or name[:-1], ((ext if stem else name[-1:], size),))


def test_index_table_has_the_schema(tmp_path: Path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpufeed.shardset.manifest import INDEX_COLUMNS, index_table

    cols = {"key": ["00000_0000000"], "shard": ["train-000000.tar"], "class": ["cat"], "label": [0],
            "source": ["cat/a.jpg"], "bytes": [1234], "width": [32], "height": [24]}
    pq.write_table(index_table(cols), tmp_path / "index.parquet")
    table = pq.read_table(tmp_path / "index.parquet")
    assert tuple(table.column_names) == INDEX_COLUMNS
    assert [table.schema.field(c).type for c in INDEX_COLUMNS] == [
        pa.string(), pa.string(), pa.string(), pa.int64(), pa.string(), pa.int64(), pa.int32(), pa.int32()]
    assert table.to_pylist() == [{c: v[0] for c, v in cols.items()}]
    with pytest.raises(ValueError, match="expected"):
        index_table({c: v for c, v in cols.items() if c != "source"})
    with pytest.raises(ValueError, match="differ in length"):
        index_table(cols | {"height": [24, 25]})


def test_index_and_verify_import_the_format_not_each_other():
    for job, other in (("index", "verify"), ("verify", "index")):
        code = (f"import sys, gpufeed.{job}\nassert 'gpufeed.{other}' not in sys.modules, '{job} imports {other}'\n"
                "assert 'gpufeed.shardset.tar' in sys.modules and 'torch' not in sys.modules\n")
        subprocess.run([sys.executable, "-c", code], check=True, capture_output=True)


def test_split_member_equals_webdataset_on_every_short_name():
    import itertools

    from webdataset.tariterators import base_plus_ext

    for n in range(8):
        for chars in itertools.product("a./\n", repeat=n):
            name = "".join(chars)
            prefix, suffix = base_plus_ext(name)
            assert split_member(name) == (None if prefix is None else (prefix, suffix.lower())), repr(name)
