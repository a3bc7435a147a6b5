"""gpufeed verify: good sets pass; bit flips, truncation, missing shards and bad members are named."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import pytest

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError
from gpufeed.shardset.manifest import Manifest, ShardInfo, write_manifest
from gpufeed.shard import write_shards
from gpufeed.verify import render_verify, verify_shards
from tests.common.cli import invoke, invoke_json
from tests.common.shards import WDS_SAMPLE, write_image, write_tar


@pytest.fixture
def shard_set(image_folder, tmp_path: Path) -> Path:
    dest = tmp_path / "set"
    write_shards(ShardConfig(src=str(image_folder(classes=3, per_class=4)), dest=str(dest), shard_samples=4,
                             workers=1), progress=False)
    return dest


def member_offsets(path: Path) -> dict[str, tuple[int, int]]:
    with tarfile.open(path) as tar:
        return {m.name: (m.offset_data, m.size) for m in tar.getmembers()}


def test_good_set_passes(shard_set: Path) -> None:
    rep = verify_shards(shard_set, workers=2)
    assert rep.ok and rep.num_samples == rep.num_expected == 12 and rep.num_decoded == 12
    assert render_verify(rep).startswith("OK")
    out = invoke_json(["verify", shard_set, "--workers", "1", "--no-decode"])
    assert out["ok"] is True and out["num_decoded"] == 0


def test_bit_flip_in_image_names_shard_and_member(shard_set: Path) -> None:
    shard = shard_set / "train-000001.tar"
    name = next(n for n in member_offsets(shard) if n.endswith(".jpg"))
    off, size = member_offsets(shard)[name]
    data = bytearray(shard.read_bytes())
    data[off + size // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    rep = verify_shards(shard_set, workers=1)
    assert not rep.ok
    reasons = {(p.shard, p.member): p.reason for p in rep.problems}
    assert ("train-000001.tar", name) in reasons
    assert any("sha256" in r for (s, m), r in reasons.items() if s == "train-000001.tar" and m is None)
    res = invoke(["verify", shard_set, "--workers", "1"], expect=1)
    assert f"train-000001.tar member {name}" in res.stdout


def test_bit_flip_in_header_is_not_silent(shard_set: Path) -> None:
    shard = shard_set / "train-000000.tar"
    offsets = member_offsets(shard)
    third = sorted(offsets.values())[3][0] - 512  # header block of the 4th member
    data = bytearray(shard.read_bytes())
    data[third + 10] ^= 0x20
    shard.write_bytes(bytes(data))
    rep = verify_shards(shard_set, workers=1)
    assert not rep.ok
    assert any(p.shard == "train-000000.tar" and "samples" in p.reason for p in rep.problems)


def test_truncated_and_missing_shards(shard_set: Path) -> None:
    data = (shard_set / "train-000002.tar").read_bytes()
    (shard_set / "train-000002.tar").write_bytes(data[:3000])
    (shard_set / "train-000000.tar").unlink()
    rep = verify_shards(shard_set, workers=2)
    by_shard = {}
    for p in rep.problems:
        by_shard.setdefault(p.shard, []).append(p.reason)
    assert any("missing" in r for r in by_shard["train-000000.tar"])
    assert any("does not read to the end" in r for r in by_shard["train-000002.tar"])
    assert any("size is 3000 bytes" in r for r in by_shard["train-000002.tar"])
    res = invoke(["verify", shard_set, "--workers", "1"], expect=1)
    assert "train-000000.tar: shard file is missing" in res.stdout


def test_no_manifest_is_a_usage_error(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="manifest"):
        verify_shards(tmp_path / "empty")
    res = invoke(["verify", tmp_path / "empty"], expect=2)
    assert "gpufeed index" in res.stderr


# --------------------------------------------------------------------------- foreign sets (gpufeed index)


def jpeg_bytes(tmp_path: Path, color: tuple[int, int, int] = (1, 2, 3)) -> bytes:
    return write_image(tmp_path / f"j{color}.jpg", color=color).read_bytes()


def foreign_set(tmp_path: Path, samples: list[list[tuple[str, bytes]]], gzip: bool, classes: int = 2,
                sha: bool = False) -> Path:
    root = tmp_path / "foreign"
    root.mkdir()
    infos = []
    for i, members in enumerate(samples):
        name = f"part-{i:04d}.tgz" if gzip else f"part-{i:04d}.tar"
        write_tar(root / name, members, gz=gzip)
        body = (root / name).read_bytes()
        n = len({m.split(".", 1)[0] for m, _ in members})
        infos.append(ShardInfo(name=name, num_samples=n, bytes=len(body),
                               sha256=hashlib.sha256(body).hexdigest() if sha else None))
    write_manifest(root, Manifest(prefix="part", classes=[str(c) for c in range(classes)], shards=infos,
                                  num_samples=sum(s.num_samples for s in infos), created_by="gpufeed index",
                                  compression="gzip" if gzip else None))
    return root


def test_foreign_gzip_set_without_sha(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [
        [("a/s1.jpeg", j), ("a/s1.cls", b"0"), ("a/s2.jpeg", j), ("a/s2.cls", b"1")],
        [("b/s1.jpeg", j), ("b/s1.cls", b"1")],
    ], gzip=True)
    rep = verify_shards(root, workers=1)
    assert rep.ok, rep.problems
    assert rep.num_samples == 3 and rep.created_by == "gpufeed index"


def test_foreign_set_problems_are_named(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [
        [("k1.jpg", j), ("k1.cls", b"0"), ("k2.jpg", j), ("k2.cls", b"7"), ("k.3.jpg", j), ("k.3.cls", b"1")],
        [("k1.jpg", j), ("k1.cls", b"1"), ("k4.png", b"garbage"), ("k4.cls", b"0"), ("k5.jpg", j)],
    ], gzip=False, sha=True)
    rep = verify_shards(root, workers=1)
    assert not rep.ok
    text = render_verify(rep)
    found = {(p.shard, p.member): p.reason for p in rep.problems}
    assert "outside 0..1" in found[("part-0000.tar", "k2.cls")]
    assert "key holds a dot" in found[("part-0000.tar", "k.3.jpg")]
    assert "also used in part-0000.tar" in found[("part-0001.tar", "k1")]
    assert "does not decode" in found[("part-0001.tar", "k4.png")]
    assert "no .cls" in found[("part-0001.tar", "k5")]
    assert "part-0001.tar member k4.png" in text


def test_index_parquet_must_match_the_shards(shard_set: Path) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(shard_set / "index.parquet")
    pq.write_table(table.slice(1), shard_set / "index.parquet")
    rep = verify_shards(shard_set, workers=1, decode=False)
    (problem,) = rep.problems
    assert problem.shard == "index.parquet" and problem.member == table.column("key")[0].as_py()


def test_verify_reads_shards_from_the_manifest_root(tmp_path: Path) -> None:
    import shutil

    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(WDS_SAMPLE, shards / "sample-000000.tgz")
    invoke(["index", shards, "--out", tmp_path / "meta"])
    assert not (tmp_path / "meta" / "sample-000000.tgz").exists()
    rep = verify_shards(tmp_path / "meta", workers=1)
    assert rep.ok, rep.problems
    assert rep.num_samples == rep.num_expected == 90
    # the one rule of where a local set's shards are, as verify, io, stage, the loader and open_set use it
    from gpufeed.shardset.manifest import read_manifest, shard_root
    from gpufeed.shardset.source import open_set

    meta = tmp_path / "meta"
    m = read_manifest(meta)
    assert shard_root(m, meta) == shard_root(m, meta / "manifest.json") == Path(m.root) == shards.absolute()
    assert open_set(meta).urls == [str(shards.absolute() / "sample-000000.tgz")]


def test_gpufeed_set_needs_its_json_members_and_index(shard_set: Path) -> None:
    from gpufeed.shardset.manifest import read_manifest

    first = shard_set / "train-000000.tar"
    with tarfile.open(first) as tar:
        members = [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]
    dropped = next(n for n, _ in members if n.endswith(".json"))
    write_tar(first, [(name, data) for name, data in members if name != dropped])
    m = read_manifest(shard_set)
    body = first.read_bytes()
    m.shards[0] = ShardInfo(name=first.name, num_samples=m.shards[0].num_samples, bytes=len(body),
                            sha256=hashlib.sha256(body).hexdigest())
    write_manifest(shard_set, m)
    (shard_set / "index.parquet").unlink()
    rep = verify_shards(shard_set, workers=1, decode=False)
    found = {(p.shard, p.member): p.reason for p in rep.problems}
    assert found == {("train-000000.tar", dropped.split(".")[0]): "sample has no .json member (every gpufeed "
                     "sample has one)", ("index.parquet", None): "missing (every gpufeed shard set has one)"}


def test_foreign_multi_dot_extension_is_a_member_not_a_dotted_key(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [
        [("x.jpg", j), ("x.seg.png", b"mask"), ("x.cls", b"0"), ("y.jpg", j), ("y.cls", b"1")],
    ], gzip=False, sha=True)
    rep = verify_shards(root, workers=1)
    assert rep.ok, rep.problems
    assert rep.num_samples == 2


def test_verify_accepts_text_labels_like_index_and_the_loader(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = tmp_path / "text"
    root.mkdir()
    write_tar(root / "data-000.tar", [("a.jpg", j), ("a.cls", b"dog"), ("b.jpg", j), ("b.cls", b"cat\n"),
                                      ("c.jpg", j), ("c.cls", b"cat")])
    invoke(["index", root])
    rep = verify_shards(root, workers=1)
    assert rep.ok, rep.problems
    assert rep.num_samples == 3
    # with a classes.txt, indices and names may mix: "1" is class 1 (dog) for index, verify and the loader
    (root / "manifest.json").unlink()
    (root / "classes.txt").write_text("cat\ndog\n")
    write_tar(root / "data-000.tar", [("d.jpg", j), ("d.cls", b"1")], mode="a")
    invoke(["index", root])
    rep = verify_shards(root, workers=1)
    assert rep.ok, rep.problems
    assert rep.num_samples == 4


def test_verify_names_a_key_that_comes_back_as_not_grouped(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [
        [("a.jpg", j), ("a.cls", b"0"), ("b.jpg", j), ("b.cls", b"1"), ("a.png", j), ("a.cls", b"1")],
    ], gzip=False)
    rep = verify_shards(root, workers=1)  # the manifest says 2 samples: readers count 3
    found = {(p.shard, p.member): p.reason for p in rep.problems}
    assert found == {
        ("part-0000.tar", "a.png"): "key 'a' appears again after other samples (not grouped): readers take it as "
                                    "another sample; re-create the tar with its members sorted by name (`tar "
                                    "--sort=name -cf ...`; GNU tar otherwise writes them in directory order) or "
                                    "write the set with `gpufeed shard`",
        ("part-0000.tar", None): "holds 3 samples, manifest says 2",
    }


def test_verify_duplicate_member_is_a_problem(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [[("a.jpg", j), ("a.cls", b"0"), ("a.cls", b"1")]], gzip=False)
    (problem,) = verify_shards(root, workers=1).problems
    assert (problem.member, problem.reason) == ("a.cls", "duplicate member in the sample: readers keep only one "
                                                          "of them")


def test_verify_groups_a_repeated_problem_into_one_line(tmp_path: Path) -> None:
    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [[(f"k{i:02d}.jpg", j) for i in range(12)]], gzip=False)
    rep = verify_shards(root, workers=1)
    assert rep.num_problems == 12 and len(rep.problems) == 12
    text = render_verify(rep)
    lines = [line for line in text.splitlines() if "no .cls" in line]
    assert lines == ["  12 x sample has no .cls label member (part-0000.tar member k00; also part-0000.tar member "
                     "k01, part-0000.tar member k02, part-0000.tar member k03, part-0000.tar member k04 and 7 more)"]
    assert text.splitlines()[0].startswith("FAILED") and "12 problem(s)" in text.splitlines()[0]


def test_verify_warns_about_shard_files_the_manifest_does_not_list(tmp_path: Path) -> None:
    import shutil

    j = jpeg_bytes(tmp_path)
    root = foreign_set(tmp_path, [[("a.jpg", j), ("a.cls", b"0")]], gzip=False)
    shutil.copy(root / "part-0000.tar", root / "part-0001.tar")
    rep = verify_shards(root, workers=1)
    assert rep.ok and rep.warnings == [f"1 shard-like file(s) in {root} are not in the manifest, so no reader uses "
                                       f"them: part-0001.tar"]
    res = invoke(["verify", root, "--workers", "1"])
    assert res.stdout.splitlines()[1] == f"warning: {rep.warnings[0]}"


def _cut_at_member_boundary(members: list[tuple[str, bytes]], keep: int) -> bytes:
    """A tar of ``members`` cut right after the first ``keep`` members (no end-of-archive blocks)."""
    body = write_tar(io.BytesIO(), members).getvalue()
    with tarfile.open(fileobj=io.BytesIO(body)) as tar:
        cut = tar.getmembers()[keep].offset
    return body[:cut]


@pytest.mark.parametrize("gzip", [False, True])
def test_verify_finds_a_tar_cut_at_a_member_boundary(tmp_path: Path, gzip: bool) -> None:
    import gzip as gz

    j = jpeg_bytes(tmp_path)
    members = [("a.jpg", j), ("a.cls", b"0"), ("b.jpg", j), ("b.cls", b"1")]
    root = foreign_set(tmp_path, [members[:2]], gzip=gzip)  # the manifest of the cut shard: 1 sample
    cut = _cut_at_member_boundary(members, 2)
    name = "part-0000.tgz" if gzip else "part-0000.tar"
    (root / name).write_bytes(gz.compress(cut) if gzip else cut)
    rep = verify_shards(root, workers=1)
    assert rep.num_samples == rep.num_expected == 1  # the count alone cannot tell
    assert ("a.cls", "tar is truncated after this member") in [(p.member, p.reason.split(":")[0])
                                                               for p in rep.problems]


# --------------------------------------------------------------------------- a set staged for one node


def _node_staged(tmp_path):
    from tests.common.shards import write_tiny_shards

    src = write_tiny_shards(tmp_path / "src", [6, 5, 7, 6, 4])
    dest = tmp_path / "node1"
    invoke(["stage", src, dest, "--num-nodes", "2", "--node-rank", "1", "--quiet"])
    return dest


def test_verify_of_a_node_staged_set_checks_the_shards_staged_there(tmp_path):
    dest = _node_staged(tmp_path)
    r = invoke_json(["verify", dest])
    assert (r["ok"], r["num_shards"], r["num_samples"], r["num_expected"]) == (True, 2, 11, 11)
    assert r["node"] == "node 1 of 2: 2 of 5 shards staged here"
    (dest / "train-000003.tar").unlink()  # one of node 1's own shards: a failure
    result = invoke(["verify", dest], expect=1)
    assert "train-000003.tar" in result.stdout and "shard file is missing" in result.stdout


def test_verify_refuses_a_malformed_node_record(tmp_path):
    dest = _node_staged(tmp_path)
    m = json.loads((dest / "manifest.json").read_text())
    for bad in ({"node_rank": 1, "num_nodes": 2, "num_shards": 3}, {"node_rank": 2, "num_nodes": 2, "num_shards": 2},
                {"node_rank": "1", "num_nodes": 2, "num_shards": 2}, [1, 2]):
        m["options"]["staged_node"] = bad
        (dest / "manifest.json").write_text(json.dumps(m))
        result = invoke(["verify", dest], expect=2)
        assert "options.staged_node" in result.stderr and result.stderr.count("\n") == 1


def test_verify_of_a_node_staged_gpufeed_set_compares_its_shards_index_rows(shard_set, tmp_path):
    dest = tmp_path / "node0"
    invoke(["stage", shard_set, dest, "--num-nodes", "2", "--node-rank", "0", "--quiet"])
    assert sorted(p.name for p in dest.glob("*.tar")) == ["train-000000.tar", "train-000002.tar"]
    r = invoke_json(["verify", dest])  # index.parquet lists node 1's samples too: not a problem here
    assert (r["ok"], r["num_shards"], r["num_samples"]) == (True, 2, 8)
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pq.read_table(dest / "index.parquet")
    keep = [i for i, s in enumerate(table.column("shard").to_pylist()) if s != "train-000002.tar"]
    pq.write_table(table.take(pa.array(keep)), dest / "index.parquet")  # node 0's shard 2 loses its rows
    result = invoke(["verify", dest], expect=1)
    assert "train-000002.tar has no row" in result.stdout
