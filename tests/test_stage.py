"""``gpufeed stage SRC DEST``: checked copies, the DEST set is usable, corrupt sources refused, resume after a
partial or killed run, the free-space check, and per-node subsets (``--num-nodes``/``--node-rank``)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_tiny_shards

SIDE = ".gpufeed-stage"


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.glob("*.tar"))}


def _no_temporaries(folder: Path) -> None:
    assert sorted(p.name for p in folder.glob(".*.tmp")) == []


@pytest.fixture()
def src(tmp_path: Path) -> Path:
    return write_tiny_shards(tmp_path / "src", [6, 5, 7, 6])


def test_stage_copies_a_set_that_verifies_and_loads(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    r = invoke_json(["stage", src / "manifest.json", dest, "--quiet"])
    assert (r["num_shards"], r["shards_copied"], r["shards_kept"], r["checked"]) == (4, 4, 0, "sha256")
    assert r["bytes_copied"] == sum(len(b) for b in _files(src).values())
    assert _files(dest) == _files(src)
    written = json.loads((dest / "manifest.json").read_text())
    assert written["root"] is None and written["num_samples"] == 24
    assert [s["name"] for s in written["shards"]] == sorted(_files(src))
    invoke(["verify", dest], expect=0)

    from gpufeed.config import LoaderConfig
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World

    loader = build_loader(dest, LoaderConfig(batch_size=4, num_workers=0, decode="pil", image_size=16),
                          World.single(), train=False)
    labels = [int(v) for _, y in loader for v in y]
    assert labels == [k % 4 for k in range(24)]  # every sample, in shard order, from DEST
    assert str(dest) in loader.paths[0]


def test_stage_of_a_set_indexed_elsewhere_puts_shards_next_to_the_manifest(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    invoke(["index", src, "--out", out])
    dest = tmp_path / "dest"
    invoke_json(["stage", out, dest, "--quiet"])
    assert json.loads((dest / "manifest.json").read_text())["root"] is None
    assert _files(dest) == _files(src)
    invoke(["verify", dest], expect=0)


def test_corrupt_source_shard_is_refused_by_name_and_not_staged(src: Path, tmp_path: Path) -> None:
    bad = src / "train-000002.tar"
    data = bytearray(bad.read_bytes())
    data[700] ^= 0xFF  # same size, one byte flipped: only the sha256 can tell
    bad.write_bytes(bytes(data))
    dest = tmp_path / "dest"
    result = invoke(["stage", src, dest, "--quiet"], expect=1)
    assert "train-000002.tar" in result.stderr and "sha256" in result.stderr
    assert not (dest / "train-000002.tar").exists()
    assert not (dest / SIDE / "train-000002.tar.done.json").exists()
    assert not (dest / "manifest.json").exists()  # the DEST set is incomplete
    _no_temporaries(dest)


def test_missing_source_shard_is_an_input_error(src: Path, tmp_path: Path) -> None:
    (src / "train-000001.tar").unlink()
    result = invoke(["stage", src, tmp_path / "dest", "--quiet"], expect=2)
    assert "train-000001.tar is missing" in result.stderr
    assert not (tmp_path / "dest" / "train-000000.tar").exists()


def test_resume_keeps_complete_shards_and_recopies_the_rest(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    invoke_json(["stage", src, dest, "--quiet"])
    old = 1_000_000_000
    # shard 0: complete but its sidecar is gone -> kept after a re-hash; its mtime shows it was not rewritten
    (dest / SIDE / "train-000000.tar.done.json").unlink()
    os.utime(dest / "train-000000.tar", ns=(old, old))
    # shard 1: lost, with a half-written temporary of a killed run
    (dest / "train-000001.tar").unlink()
    (dest / ".train-000001.tar.tmp").write_bytes(_files(src)["train-000001.tar"][:5000])
    # shard 3: right size, wrong bytes (and so another mtime than its sidecar) -> copied again
    data = bytearray((dest / "train-000003.tar").read_bytes())
    data[600] ^= 0xFF
    (dest / "train-000003.tar").write_bytes(bytes(data))
    os.utime(dest / "train-000003.tar", ns=(old, old))
    (dest / "manifest.json").unlink()

    r = invoke_json(["stage", src, dest, "--quiet"])
    assert (r["shards_copied"], r["shards_kept"]) == (2, 2)
    assert os.stat(dest / "train-000000.tar").st_mtime_ns == old
    assert _files(dest) == _files(src)
    _no_temporaries(dest)
    invoke(["verify", dest], expect=0)
    again = invoke_json(["stage", src, dest, "--quiet"])  # everything has a sidecar now
    assert (again["shards_copied"], again["shards_kept"]) == (0, 4)


def kill_stage_mid_copy(args: list[str], dest: Path, *, chunk_bytes: int, nonempty: bool = False) -> None:
    """Run ``gpufeed stage ARGS --jobs 1 --quiet`` in a subprocess reading ``chunk_bytes`` per read and SIGKILL it
    once one shard is complete and the next one's temporary exists (``nonempty``: and holds bytes); bounded by
    60 s. Fails when the copy ended before it could be killed."""
    env = {**os.environ, "GPUFEED_STAGE_CHUNK_BYTES": str(chunk_bytes),
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1] / "src"),
                                          os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed.cli", "stage", *args, "--jobs", "1", "--quiet"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and proc.poll() is None:
            tmps = list(dest.glob(".*.tmp"))
            if (list((dest / SIDE).glob("*.done.json")) and tmps
                    and (not nonempty or any(p.stat().st_size > 0 for p in tmps))):
                break  # one shard complete, the next one started
            time.sleep(0.005)
        assert proc.poll() is None, f"stage finished before it could be killed: {proc.stderr.read()!r}"
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=30)


def test_kill_9_mid_copy_then_rerun_gives_identical_set(tmp_path: Path) -> None:
    src = write_tiny_shards(tmp_path / "src", [8] * 10, image_px=128)
    dest = tmp_path / "dest"
    kill_stage_mid_copy([str(src), str(dest)], dest, chunk_bytes=1)  # one byte per read: seconds, not ms
    assert not (dest / "manifest.json").exists()
    assert list(dest.glob(".*.tmp"))  # the kill left a temporary behind
    r = invoke_json(["stage", src, dest, "--quiet"])
    assert r["shards_kept"] >= 1 and r["shards_copied"] >= 1 and r["shards_kept"] + r["shards_copied"] == 10
    assert _files(dest) == _files(src)
    _no_temporaries(dest)
    invoke(["verify", dest, "--no-decode"], expect=0)


def test_no_hash_manifest_is_checked_by_size_and_says_so(src: Path, tmp_path: Path) -> None:
    out = tmp_path / "idx"
    invoke(["index", src, "--out", out, "--no-hash"])
    dest = tmp_path / "dest"
    r = invoke_json(["stage", out, dest, "--quiet"])
    assert r["checked"] == "size" and r["shards_copied"] == 4
    assert any("no sha256 for 4 shard(s)" in w for w in r["warnings"])
    assert _files(dest) == _files(src)
    assert invoke_json(["stage", out, dest, "--quiet"])["shards_kept"] == 4  # kept by their sidecars


def test_dest_holding_another_set_is_refused(src: Path, tmp_path: Path) -> None:
    other = write_tiny_shards(tmp_path / "other", [3, 3], seed=1)
    result = invoke(["stage", src, other, "--quiet"], expect=2)
    assert "holds another shard set" in result.stderr


def test_two_nodes_each_stage_their_own_shards_and_read_them(tmp_path: Path) -> None:
    src = write_tiny_shards(tmp_path / "src", [6, 5, 7, 6, 4])
    names = sorted(_files(src))
    src_manifest = json.loads((src / "manifest.json").read_text())
    for node, mine in [(0, [0, 2, 4]), (1, [1, 3])]:
        dest = tmp_path / f"node{node}"
        r = invoke_json(["stage", src, dest, "--num-nodes", "2", "--node-rank", node, "--quiet"])
        assert (r["num_shards"], r["set_shards"], r["shards_copied"], r["node_rank"]) == (len(mine), 5, len(mine), node)
        assert r["bytes_copied"] == sum(len(_files(src)[names[i]]) for i in mine)
        assert sorted(_files(dest)) == [names[i] for i in mine]
        written = json.loads((dest / "manifest.json").read_text())
        assert written["shards"] == src_manifest["shards"]  # every shard listed: counts, sizes, sha256 unchanged
        assert written["options"]["staged_node"] == {"node_rank": node, "num_nodes": 2, "num_shards": len(mine)}
        out = invoke(["verify", dest], expect=0).stdout
        assert f"node {node} of 2: {len(mine)} of 5 shards staged here" in out

        from gpufeed.config import LoaderConfig
        from gpufeed.loader import build_loader
        from gpufeed.core.world import World

        world = World(rank=node, world_size=2, node_rank=node, num_nodes=2)
        c = LoaderConfig(batch_size=2, num_workers=0, decode="pil", image_size=16, shard_split="node")
        assert len(build_loader(dest, c, world)) == min(17 // 2, 11 // 2)
        with pytest.raises(DataError, match='other nodes\' shards are missing here.*shard_split = "node"'):
            build_loader(dest, LoaderConfig(batch_size=2, num_workers=0), world)  # the global split refuses
        other = World(rank=1 - node, world_size=2, node_rank=1 - node, num_nodes=2)
        with pytest.raises(DataError, match=f"staged for node {node} of 2"):
            build_loader(dest, c, other)
    text = invoke(["stage", src, tmp_path / "node1", "--num-nodes", "2", "--node-rank", "1", "--quiet"]).stdout
    assert "staged 2 shards (node 1 of 2: 2 of 5) to" in text and "2 kept" in text  # resume
    assert 'note: train with [loader] shard_split = "node"' in text


def test_a_node_stage_needs_only_its_own_source_shards(src: Path, tmp_path: Path) -> None:
    (src / "train-000001.tar").unlink()  # node 1's: node 0 of 2 neither checks nor copies it
    r = invoke_json(["stage", src, tmp_path / "dest", "--num-nodes", "2", "--node-rank", "0", "--quiet"])
    assert r["shards_copied"] == 2
    result = invoke(["stage", src, tmp_path / "dest1", "--num-nodes", "2", "--node-rank", "1", "--quiet"], expect=2)
    assert "train-000001.tar is missing" in result.stderr


def test_a_node_stage_from_http_asks_and_copies_only_its_shards(http_server, tmp_path: Path) -> None:
    folder = write_tiny_shards(http_server.root / "set", [6, 5, 7, 6])
    url = f"{http_server.url}/set"
    http_server.faults.missing.add("/set/train-000001.tar")  # node 1's shard: node 0 never asks for it
    dest = tmp_path / "dest"
    r = invoke_json(["stage", url, dest, "--num-nodes", "2", "--node-rank", "0", "--quiet"])
    assert (r["shards_copied"], r["set_shards"]) == (2, 4)
    assert _files(dest) == {n: b for n, b in _files(folder).items() if n in ("train-000000.tar", "train-000002.tar")}
    invoke(["verify", dest], expect=0)
    r = invoke(["stage", url, tmp_path / "dest1", "--num-nodes", "2", "--node-rank", "1", "--quiet"], expect=2)
    assert "train-000001.tar cannot be read: not found (HTTP 404)" in r.stderr


def test_whole_set_after_a_node_stage_drops_the_node_record(src: Path, tmp_path: Path) -> None:
    dest = tmp_path / "dest"
    invoke_json(["stage", src, dest, "--num-nodes", "2", "--node-rank", "1", "--quiet"])
    r = invoke_json(["stage", src, dest, "--quiet"])
    assert (r["shards_kept"], r["shards_copied"], r["node_rank"]) == (2, 2, None)
    assert "staged_node" not in json.loads((dest / "manifest.json").read_text())["options"]
    invoke(["verify", dest], expect=0)


def test_node_from_the_launchers_environment_and_the_command_line_wins(src: Path, tmp_path: Path,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("GROUP_WORLD_SIZE", "2")
    r = invoke_json(["stage", src, tmp_path / "a", "--quiet"])
    assert (r["node_rank"], r["num_nodes"]) == (1, 2) and sorted(_files(tmp_path / "a")) == [
        "train-000001.tar", "train-000003.tar"]
    r = invoke_json(["stage", src, tmp_path / "b", "--node-rank", "0", "--quiet"])
    assert (r["node_rank"], r["num_nodes"]) == (0, 2)
    r = invoke_json(["stage", src, tmp_path / "c", "--num-nodes", "1", "--quiet"])
    assert (r["node_rank"], r["num_shards"]) == (None, 4)  # the whole set


def test_node_subsets_that_cannot_work_are_refused(src: Path, tmp_path: Path) -> None:
    result = invoke(["stage", src, tmp_path / "dest", "--num-nodes", "8", "--node-rank", "3"], expect=2)
    assert "--num-nodes 8 is more than the set's 4 shard(s)" in result.stderr
    assert not (tmp_path / "dest").exists()
    result = invoke(["stage", src, tmp_path / "dest", "--num-nodes", "2", "--node-rank", "2"], expect=2)
    assert "node_rank (2) must be below num_nodes (2)" in result.stderr


def test_short_space_is_refused_before_copying(tmp_path: Path) -> None:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    src = write_tiny_shards(tmp_path / "src", [8] * 10, image_px=128)
    assert sum(len(b) for b in _files(src).values()) > 1 << 20
    mnt = tmp_path / "small"
    mnt.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mnt)], capture_output=True,
                      timeout=30).returncode != 0:
        pytest.skip("tmpfs cannot be mounted here")
    try:
        result = invoke(["stage", src, mnt / "dest", "--quiet"], expect=2)
        assert "free, staging needs" in result.stderr and "RAM file system" in result.stderr
        assert list((mnt / "dest").glob("*.tar")) == []
    finally:
        subprocess.run(["umount", str(mnt)], timeout=30, check=True)


def test_node_rank_alone_takes_the_node_count_from_the_launcher(src: Path, tmp_path: Path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """--node-rank 1 with SLURM's 2 nodes in the environment: node 1 of 2 (the command line wins for the rank, the
    count comes from the launcher), not "node_rank (1) must be below num_nodes (1)"."""
    for k in ("GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("SLURM_NODEID", "0")
    monkeypatch.setenv("SLURM_JOB_NUM_NODES", "2")
    r = invoke_json(["stage", src, tmp_path / "a", "--node-rank", "1", "--quiet"])
    assert (r["node_rank"], r["num_nodes"]) == (1, 2)
    assert sorted(_files(tmp_path / "a")) == ["train-000001.tar", "train-000003.tar"]
    monkeypatch.delenv("SLURM_JOB_NUM_NODES")  # no node count anywhere: one node, so rank 1 is refused
    result = invoke(["stage", src, tmp_path / "b", "--node-rank", "1"], expect=2)
    assert "node rank 1 of 1 node(s)" in result.stderr and not (tmp_path / "b").exists()
