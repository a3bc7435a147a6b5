"""The static split (``gpufeed shard SRC DEST --num-nodes N``): N nodes write exactly the local engine's bytes,
a killed node resumes, ``--finish`` writes the index and manifest, and a node started differently is refused."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from PIL import Image

from gpufeed.config import ShardConfig
from gpufeed.core.errors import ConfigError
from gpufeed.shard import write_shards
from gpufeed.shard.split import BatchStore, NodeSplit, node_split, val_name
from tests.common.cli import cli_argv, invoke
from tests.common.shards import write_image

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="the kill test uses fork and SIGKILL")


def outputs(dest: Path) -> dict[str, str]:
    """Every output file of a set (the state folder excluded) -> its sha256."""
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dest.iterdir()) if p.is_file()}


def folder_with_rejects(root: Path, per_class: int = 30) -> Path:
    """Three classes of JPEGs, a file that is no image (rejected) and a BMP (transcoded to PNG: the cache)."""
    for c in range(3):
        for i in range(per_class):
            write_image(root / f"c{c}" / f"{i:03d}.jpg", color=(c * 70, i * 5 % 256, 9), quality=90)
    (root / "c0" / "broken.jpg").write_bytes(b"not an image")
    Image.new("RGB", (20, 10), (1, 2, 3)).save(root / "c1" / "x.bmp")
    return root


def local_set(tmp_path: Path, src: Path, **kw) -> Path:
    ref = tmp_path / "local" / "out"  # the same folder name as the split's (_info.json names it)
    write_shards(ShardConfig(src=str(src), dest=str(ref), **kw), progress=False)
    return ref


def test_two_nodes_write_the_local_bytes_with_rejects_and_transcodes(tmp_path: Path) -> None:
    src = folder_with_rejects(tmp_path / "src")
    opts = {"shard_samples": 10, "workers": 2, "max_size": 12}
    ref = local_set(tmp_path, src, **opts)
    dest = tmp_path / "split" / "out"
    first = write_shards(ShardConfig(src=str(src), dest=str(dest), num_nodes=2, node_rank=0, **opts), progress=False)
    assert first.num_shards_missing == 5 and not (dest / "manifest.json").exists()
    assert first.manifest == "" and (first.num_nodes, first.node_rank) == (2, 0)
    last = write_shards(ShardConfig(src=str(src), dest=str(dest), num_nodes=2, node_rank=1, **opts), progress=False)
    assert last.num_shards_missing == 0 and last.num_shards_written == 5 and last.num_rejected == 1
    assert outputs(dest) == outputs(ref)
    state = dest / ".gpufeed"
    assert not [p for p in state.iterdir() if p.name.startswith(("val-", "enc-"))]  # cleared once finished


def test_three_nodes_in_any_order(tmp_path: Path) -> None:
    src = folder_with_rejects(tmp_path / "src", per_class=10)
    ref = local_set(tmp_path, src, shard_samples=7, workers=1)
    dest = tmp_path / "split" / "out"
    for rank in (2, 0, 1):
        write_shards(ShardConfig(src=str(src), dest=str(dest), shard_samples=7, workers=1, num_nodes=3,
                                 node_rank=rank), progress=False)
    assert outputs(dest) == outputs(ref)


def _node(src: Path, dest: Path, rank: int, *extra: str) -> subprocess.Popen:
    return subprocess.Popen(cli_argv("shard", src, dest, "--workers", "1", "--shard-samples", "4", "--num-nodes", "2",
                                     "--node-rank", rank, "--quiet", *extra),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


def test_two_node_processes_one_killed_and_rerun_then_finish(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in range(2):
        for i in range(120):
            write_image(src / f"c{c}" / f"{i:03d}.jpg", color=(c * 90, i % 256, 40), quality=90)
    ref = local_set(tmp_path, src, shard_samples=4, workers=1)
    dest = tmp_path / "split" / "out"
    n0, n1 = _node(src, dest, 0), _node(src, dest, 1)
    state = dest / ".gpufeed"
    deadline = time.monotonic() + 120
    while not list(state.glob("*1.tar.done.json")) if state.exists() else True:  # node 1 wrote a shard
        assert time.monotonic() < deadline and n1.poll() is None, "node 1 ended before it could be killed"
        time.sleep(0.01)
    os.kill(n1.pid, signal.SIGKILL)
    assert n1.wait(timeout=30) == -signal.SIGKILL
    assert n0.wait(timeout=120) == 0, n0.stderr.read().decode()
    assert not (dest / "manifest.json").exists()  # node 1's shards are not all there
    res = invoke(["shard", dest, "--finish"], expect=1)  # refused, naming what is missing
    assert "not complete" in res.stderr and "(node 1)" in res.stderr and "Traceback" not in res.stderr
    rerun = _node(src, dest, 1)
    assert rerun.wait(timeout=120) == 0, rerun.stderr.read().decode()
    assert outputs(dest) == outputs(ref)  # the re-run node completed the last shard and finished the set
    for name in ("manifest.json", "index.parquet", "_info.json", "wids.json"):
        (dest / name).unlink()
    invoke(["shard", dest, "--finish", "--quiet"])
    assert outputs(dest) == outputs(ref)
    invoke(["verify", dest, "--workers", "1", "--quiet"])


def test_a_node_started_differently_is_refused(tmp_path: Path, image_folder) -> None:
    src = image_folder(classes=2, per_class=6)
    dest = tmp_path / "out"
    base = ["shard", src, dest, "--workers", "1", "--shard-samples", "3", "--quiet"]
    invoke(base + ["--num-nodes", "2", "--node-rank", "0"])
    res = invoke(base + ["--num-nodes", "2", "--node-rank", "1", "--seed", "7"], expect=2)
    assert "option seed = 7 here, 0 there" in res.stderr and "Traceback" not in res.stderr
    res = invoke(base + ["--num-nodes", "3", "--node-rank", "1"], expect=2)
    assert "--num-nodes 3 here, 2 there" in res.stderr
    write_image(src / "class_0" / "new.jpg")
    res = invoke(base + ["--num-nodes", "2", "--node-rank", "1"], expect=2)
    assert "SRC's files differ (candidate files: 13 here, 12 there)" in res.stderr
    res = invoke(base + ["--num-nodes", "2", "--node-rank", "1", "--overwrite"], expect=2)
    assert "--overwrite cannot be used with --num-nodes" in res.stderr
    res = invoke(base + ["--node-rank", "1"], expect=2)
    assert "needs --num-nodes" in res.stderr


def test_rank_from_the_launchers_environment() -> None:
    cfg = ShardConfig(num_nodes=4)
    assert node_split(cfg, {"SLURM_ARRAY_TASK_ID": "2", "SLURM_ARRAY_TASK_COUNT": "4"}) == NodeSplit(4, 2)
    assert node_split(cfg, {"SLURM_ARRAY_TASK_ID": "5", "SLURM_ARRAY_TASK_MIN": "4"}) == NodeSplit(4, 1)
    assert node_split(cfg, {"JOB_COMPLETION_INDEX": "3"}) == NodeSplit(4, 3)
    assert node_split(cfg, {"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "4"}) == NodeSplit(4, 1)
    assert node_split(ShardConfig(num_nodes=4, node_rank=0), {"JOB_COMPLETION_INDEX": "3"}) == NodeSplit(4, 0)
    assert node_split(ShardConfig(), {"SLURM_ARRAY_TASK_ID": "1"}) is None  # a split only with --num-nodes
    with pytest.raises(ConfigError, match="SLURM_ARRAY_TASK_COUNT=3"):
        node_split(cfg, {"SLURM_ARRAY_TASK_ID": "1", "SLURM_ARRAY_TASK_COUNT": "3"})
    with pytest.raises(ConfigError, match=r"not in 0\.\.3"):
        node_split(cfg, {"JOB_COMPLETION_INDEX": "4"})
    with pytest.raises(ConfigError, match="not a non-negative integer"):
        node_split(cfg, {"JOB_COMPLETION_INDEX": "-1"})
    with pytest.raises(ConfigError, match="needs this node's rank"):
        node_split(cfg, {})


def test_a_damaged_batch_file_is_validated_again(tmp_path: Path) -> None:
    from gpufeed.shard.validate import batch_columns, inspect_file, CheckOptions

    img = write_image(tmp_path / "a.jpg")
    bad = tmp_path / "b.jpg"
    bad.write_bytes(b"junk")
    opts = CheckOptions.of(ShardConfig())
    batch = batch_columns([inspect_file(str(img), opts), inspect_file(str(bad), opts)])
    store = BatchStore(str(tmp_path), NodeSplit(2, 0))
    saved = store.save(3, batch)
    back = store.load(3, 2)
    assert back is not None and back["reasons"] == {1: batch["reasons"][1]} and back["ok"] == batch["ok"]
    assert bytes(back["sha256"]) == bytes(saved["sha256"]) and bytes(back["id_dev"]) == bytes(8)
    assert store.load(3, 3) is None  # another batch size: not this batch
    path = tmp_path / val_name(3)
    data = path.read_bytes()
    for damaged in (data[:-1], data + b"x", b"{}\n" + data.partition(b"\n")[2], data.replace(b'"n": 1', b'"n": 2')):
        path.write_bytes(damaged)
        assert store.load(3, 2) is None
