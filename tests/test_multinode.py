"""Two nodes on this machine: two ``gpufeed train --nnodes 2`` launchers meet at a loopback c10d rendezvous,
one rank each (gloo, CPU). The multi-node code paths (rank -> node mapping, per-node records, num_nodes in
the summary and the report, the note of the node without rank 0) run as they would on two machines."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.common.cli import kill_tree
from tests.common.netserver import closed_port
from tests.common.shards import write_tiny_shards


def run_nodes(commands: list[list[str]], timeout: float = 150) -> tuple[list[subprocess.Popen], list[tuple[str, str]]]:
    """Start one ``gpufeed`` launcher per node (each in its own session, as on separate machines), wait for all of
    them (bounded) and kill whatever is left; returns the processes and their (stdout, stderr)."""
    procs = [subprocess.Popen([sys.executable, "-m", "gpufeed.cli", *cmd], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, start_new_session=True) for cmd in commands]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=timeout))
    finally:
        for p in procs:
            kill_tree(p)
    return procs, outs


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_two_nodes_over_a_loopback_rendezvous(tmp_path: Path) -> None:
    shards = write_tiny_shards(tmp_path / "shards", [16, 16, 16, 16])
    port = closed_port()
    args = ["--shards", str(shards), "--arch", "resnet18", "--image-size", "32", "--batch-size", "4",
            "--num-workers", "0", "--amp", "off", "--steps", "2", "--device", "cpu", "--threads", "1", "--quiet",
            "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-endpoint", f"127.0.0.1:{port}",
            "--rdzv-id", f"test-{port}", "--json"]
    runs = [tmp_path / "node-a", tmp_path / "node-b"]  # each launcher its own run folder, as on two machines
    procs, outs = run_nodes([["train", *args, "--run-dir", str(run)] for run in runs])

    # torchrun numbers the nodes itself: node 0 is the launcher whose run folder holds the summary
    zero = [i for i, run in enumerate(runs) if (run / "summary.json").is_file()]
    assert len(zero) == 1, outs
    head, other = zero[0], 1 - zero[0]
    s = json.loads(outs[head][0])
    assert s == json.loads((runs[head] / "summary.json").read_text())
    assert procs[head].returncode == (0 if s["ok"] else 1), outs[head][1]
    assert (s["num_nodes"], s["world_size"], s["global_batch"], s["step"]) == (2, 2, 8, 2)
    real = s["modes"]["real"]
    assert [(r["rank"], r["node"]) for r in real["per_rank"]] == [(0, 0), (1, 1)]
    assert [(n["node"], n["ranks"]) for n in real["per_node"]] == [(0, [0]), (1, [1])]
    assert [n["num_samples"] for n in real["per_node"]] == [r["num_samples"] for r in real["per_rank"]] == [4, 4]
    assert len(s["rank_param_checksums"]) == 2 and s["rank_param_checksums"][0] == s["rank_param_checksums"][1]
    report = (runs[head] / "report.md").read_text()
    assert report.startswith("# gpufeed train — resnet18, 2 x cpu over 2 nodes, mode real")
    assert "Per node (real):" in report

    # the other node ran its rank and says where the summary is
    assert procs[other].returncode == 0, outs[other][1]
    note = json.loads(outs[other][0])
    assert note["ok"] is True and note["run_dir"] == str(runs[other])
    assert note["notes"][0].startswith("this node ran its ranks; the summary and verdict are in the run folder "
                                       "of node 0")
    assert not (runs[other] / "summary.json").exists()


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_node_split_over_node_staged_copies_keeps_every_rank_in_step(tmp_path: Path) -> None:
    """``gpufeed stage --num-nodes 2`` gives each node its own shards (node 0: shards 0 and 2, 32 samples; node 1:
    shard 1, 8), then ``train`` with ``shard_split = "node"`` over a static rendezvous: each node reads only its
    copy, and both ranks stop at node 1's 2 batches an epoch, so two epochs are 4 DDP steps on both nodes."""
    from tests.common.cli import invoke

    shards = write_tiny_shards(tmp_path / "shards", [16, 8, 16])
    copies = [tmp_path / "node0-nvme", tmp_path / "node1-nvme"]
    for node, dest in enumerate(copies):
        invoke(["stage", shards, dest, "--num-nodes", "2", "--node-rank", node, "--quiet"])
    assert sorted(p.name for p in copies[1].glob("*.tar")) == ["train-000001.tar"]
    config = tmp_path / "gpufeed.toml"
    config.write_text('[loader]\nshard_split = "node"\n')
    port = closed_port()
    args = ["--config", str(config), "--arch", "resnet18", "--image-size", "32", "--batch-size", "4",
            "--num-workers", "0", "--amp", "off", "--epochs", "2", "--device", "cpu", "--threads", "1", "--quiet",
            "--nnodes", "2", "--nproc-per-node", "1", "--master-addr", "127.0.0.1", "--master-port", str(port),
            "--json"]
    runs = [tmp_path / "node-a", tmp_path / "node-b"]
    procs, outs = run_nodes([["train", *args, "--shards", str(copies[node]), "--node-rank", str(node),
                              "--run-dir", str(run)] for node, run in enumerate(runs)])
    assert [p.returncode for p in procs] == [0, 0], outs
    s = json.loads((runs[0] / "summary.json").read_text())
    assert (s["num_nodes"], s["world_size"], s["step"]) == (2, 2, 4)
    per_rank = s["modes"]["real"]["per_rank"]
    assert [r["node"] for r in per_rank] == [0, 1] and per_rank[0]["num_samples"] == per_rank[1]["num_samples"]
    for _, err in outs:  # each node's local rank 0 says, once, that the smaller node sets the pace
        assert err.count('warning: shard_split = "node": the 2 nodes hold 8 to 32 samples') == 1, err
