"""``[loader] shard_split = "node"``: node n of N reads only the shards i % N == n (the ones ``gpufeed stage
--num-nodes N --node-rank n`` copies), split among its local ranks and workers as the global split splits among all
ranks; every rank of every node yields the same number of batches."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from gpufeed.core.errors import DataError
from gpufeed.core.world import World, node_from_env, node_shards
from tests.common.shards import cfg, write_set


def node_world(node: int, num_nodes: int, local_rank: int = 0, local_world_size: int = 1) -> World:
    """The World torchrun gives rank ``local_rank`` of node ``node`` (same ranks on every node)."""
    return World(rank=node * local_world_size + local_rank, world_size=num_nodes * local_world_size,
                 local_rank=local_rank, local_world_size=local_world_size, node_rank=node, num_nodes=num_nodes)


# --------------------------------------------------------------------------- the plan (pure)


def test_node_shards_are_disjoint_and_cover_the_set():
    assert node_shards(7, 0, 3) == [0, 3, 6] and node_shards(7, 1, 3) == [1, 4] and node_shards(7, 2, 3) == [2, 5]
    for m, n in [(1, 1), (5, 2), (16, 8), (9, 4)]:
        owned = [i for node in range(n) for i in node_shards(m, node, n)]
        assert sorted(owned) == list(range(m))  # disjoint (no repeats) and complete
    with pytest.raises(ValueError):
        node_shards(4, 2, 2)


def test_node_plan_covers_each_nodes_shards_once_with_equal_batches_everywhere():
    from gpufeed.loader import node_batches_per_rank, plan_slot

    counts = [7, 3, 9, 4, 6, 5, 8, 1]  # unbalanced: 2 nodes hold 25 and 18 samples, 3 nodes 16, 13 and 14
    for nodes, lws, nw, bs in [(2, 2, 3, 2), (3, 1, 2, 3), (2, 3, 1, 1), (3, 2, 4, 1)]:
        nb = node_batches_per_rank(counts, nodes, lws, bs)
        held = [sum(counts[i] for i in node_shards(len(counts), n, nodes)) for n in range(nodes)]
        assert nb == min(h // lws // bs for h in held) > 0
        for epoch in (0, 1):
            everyone = []
            for node in range(nodes):
                covered = []
                for r in range(lws):
                    rank_batches = 0
                    for w in range(nw):
                        p = plan_slot(counts, rank=r, world_size=lws, worker=w, num_workers=nw, batch_size=bs,
                                      seed=3, epoch=epoch, shuffle=True, node_rank=node, num_nodes=nodes)
                        assert p.num_samples >= p.num_batches * bs
                        rank_batches += p.num_batches
                        covered += [(s.shard, i) for s in p.segments for i in range(s.start, s.stop)]
                    assert rank_batches == nb  # every rank of every node: the same batch count
                mine = node_shards(len(counts), node, nodes)
                assert sorted(covered) == sorted((s, i) for s in mine for i in range(counts[s]))  # each sample once
                everyone += covered
            assert sorted(everyone) == sorted((s, i) for s, n in enumerate(counts) for i in range(n))


def test_node_shard_order_is_the_nodes_subset_reshuffled_per_epoch():
    from gpufeed.loader import shard_order

    orders = [shard_order(40, 0, e, True, node_rank=1, num_nodes=4) for e in range(3)]
    assert all(sorted(o) == list(range(1, 40, 4)) for o in orders)
    assert orders[0] != orders[1] != orders[2]
    assert shard_order(40, 0, 0, False, node_rank=1, num_nodes=4) == list(range(1, 40, 4))
    assert shard_order(5, 0, 0, False) == [0, 1, 2, 3, 4]  # the global split is unchanged


def test_node_from_env_reads_torchrun_then_slurm():
    assert node_from_env({}) == (None, None)
    assert node_from_env({"GROUP_RANK": "1", "GROUP_WORLD_SIZE": "4", "SLURM_NODEID": "3"}) == (1, 4)
    assert node_from_env({"SLURM_NODEID": "2", "SLURM_JOB_NUM_NODES": "3"}) == (2, 3)
    assert node_from_env({"GROUP_RANK": "x", "GROUP_WORLD_SIZE": "4"}) == (None, None)
    assert node_from_env({"GROUP_RANK": "1"}) == (None, None)


# --------------------------------------------------------------------------- the loader


def _node_copy(shards: Path, dest: Path, node: int, num_nodes: int) -> Path:
    """``shards`` copied to ``dest`` with the other nodes' shard files deleted (the manifest still lists them)."""
    shutil.copytree(shards, dest)
    m = sorted(dest.glob("*.tar"))
    for i, p in enumerate(m):
        if i % num_nodes != node:
            p.unlink()
    return dest


def _ids(loader) -> list[int]:
    return [int(x) for _, labels in loader for x in labels]


def test_each_node_reads_only_its_own_shards_over_two_epochs(tmp_path):
    from gpufeed.loader import build_loader

    sizes = [6, 5, 7, 6]  # node 0: shards 0, 2 (13 samples); node 1: shards 1, 3 (11 samples)
    shards = write_set(tmp_path / "set", sizes, num_classes=sum(sizes))  # label == sample id
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    owned = [{i for s in node_shards(4, n, 2) for i in range(starts[s], starts[s] + sizes[s])} for n in range(2)]
    for node in range(2):
        here = _node_copy(shards, tmp_path / f"node{node}", node, 2)
        c = cfg(batch_size=2, num_workers=2, on_error="raise", shard_split="node")
        loader = build_loader(here, c, node_world(node, 2))
        assert len(loader) == min(13 // 2, 11 // 2) == 5  # the smaller node's batches, on both nodes
        for epoch in range(2):
            loader.set_epoch(epoch)
            ids = _ids(loader)
            assert len(ids) == 10 and len(set(ids)) == 10 and set(ids) <= owned[node]
        with pytest.raises(DataError, match="cannot be read"):  # the global split needs every shard
            build_loader(here, cfg(batch_size=2), node_world(node, 2))
    # eval order, no shuffle: node 0 reads shard 0 then shard 2, from its first sample
    loader = build_loader(tmp_path / "node0", cfg(batch_size=2, shard_split="node"), node_world(0, 2), train=False)
    assert _ids(loader) == [0, 1, 2, 3, 4, 5, 11, 12, 13, 14]


def test_node_split_resume_yields_the_uninterrupted_batches(tmp_path):
    from gpufeed.loader import LoaderPosition, build_loader

    shards = write_set(tmp_path / "set", [12, 10, 14, 12, 9], num_classes=57)
    here = _node_copy(shards, tmp_path / "node1", 1, 2)  # node 1: shards 1, 3 (22 samples, 2 ranks)
    c = cfg(batch_size=2, num_workers=2, shard_split="node")
    world = node_world(1, 2, local_rank=1, local_world_size=2)
    full = build_loader(here, c, world, epoch=1)
    assert len(full) == min(35 // 2 // 2, 22 // 2 // 2) == 5
    batches = [(x.clone(), y.clone()) for x, y in full]
    resumed = build_loader(here, c, world)
    resumed.resume(LoaderPosition.from_dict({"epoch": 1, "batches_consumed": 2}))
    rest = list(resumed)
    assert len(rest) == 3
    for (x, y), (rx, ry) in zip(batches[2:], rest):
        assert torch.equal(x, rx) and torch.equal(y, ry)


def test_unbalanced_nodes_warn_once(tmp_path, capsys):
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [20, 2])  # node 0 holds 20 samples, node 1 two
    loader = build_loader(shards, cfg(batch_size=1, shard_split="node"), node_world(0, 2))
    assert len(loader) == 2  # global would give 11
    assert capsys.readouterr().err == ""  # built (as the launcher's check builds it): nothing said yet
    for epoch in range(2):
        loader.set_epoch(epoch)
        assert len(list(loader)) == 2
    err = capsys.readouterr().err
    assert err.count("warning:") == 1 and "18 samples (81.8% of the set)" in err  # once, at the first epoch
    other = build_loader(shards, cfg(batch_size=1, shard_split="node"),
                         node_world(0, 2, local_rank=1, local_world_size=2))
    assert len(list(other)) == 1 and other.warnings and "warning" not in capsys.readouterr().err  # local rank 0 only
    even = build_loader(write_set(tmp_path / "even", [5, 5]), cfg(batch_size=1, shard_split="node"), node_world(0, 2))
    assert len(list(even)) == 5 and even.warnings == [] and capsys.readouterr().err == ""


def test_node_split_refuses_worlds_it_cannot_serve(tmp_path):
    from gpufeed.loader import build_loader

    shards = write_set(tmp_path / "set", [4, 4])
    with pytest.raises(DataError, match="cannot split 2 shard"):
        build_loader(shards, cfg(batch_size=1, shard_split="node"), node_world(0, 3))
    uneven = World(rank=0, world_size=3, local_rank=0, local_world_size=2, node_rank=0, num_nodes=2)
    with pytest.raises(DataError, match="same number of ranks on every node"):
        build_loader(shards, cfg(batch_size=1, shard_split="node"), uneven)


def test_shard_split_is_a_validated_loader_knob(tmp_path):
    from gpufeed.config import load_config
    from gpufeed.core.errors import ConfigError

    path = tmp_path / "c.toml"
    path.write_text('[loader]\nshard_split = "node"\n')
    assert load_config(path).loader.shard_split == "node"
    assert load_config().loader.shard_split == "global"
    path.write_text('[loader]\nshard_split = "nodes"\n')
    with pytest.raises(ConfigError, match="shard_split"):
        load_config(path)


def test_world_from_env_without_group_rank_takes_the_node_from_the_rank(monkeypatch):
    """A launcher that sets RANK/LOCAL_WORLD_SIZE but not torchrun's GROUP_RANK: rank 3 of 2 nodes x 2 ranks is on
    node 1, not node 0 (node 0 for every rank would make both nodes read node 0's shards under the node split)."""
    from gpufeed.core.errors import ConfigError

    for k in ("GROUP_RANK", "GROUP_WORLD_SIZE"):
        monkeypatch.delenv(k, raising=False)
    for k, v in {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}.items():
        monkeypatch.setenv(k, v)
    w = World.from_env("cpu")
    assert (w.node_rank, w.num_nodes, w.local_rank) == (1, 2, 1)
    monkeypatch.setenv("GROUP_RANK", "0x1")
    with pytest.raises(ConfigError, match="GROUP_RANK"):
        World.from_env("cpu")
    monkeypatch.setenv("GROUP_RANK", "1")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "-2")
    with pytest.raises(ConfigError, match="LOCAL_WORLD_SIZE"):
        World.from_env("cpu")


def test_storage_probe_and_tune_read_a_node_staged_set_as_its_node(tmp_path):
    """A set staged for node 1 of 2 holds shards 1 and 3 only: the storage probe (tune's and train --measure's, and
    gpufeed io) reads those, not the absent shard 0, and tune measures it as node 1's ranks read it in training."""
    from gpufeed.measure.storage_probe import probe, resolve_location
    from gpufeed.tune import check_shard_set, measure_node, staged_world
    from tests.common.cli import invoke

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    dest = tmp_path / "n1"
    invoke(["stage", str(shards), str(dest), "--num-nodes", "2", "--node-rank", "1", "--quiet"])
    loc = resolve_location(dest, 100)
    assert sorted(Path(f).name for f, _ in loc.files) == ["train-000001.tar", "train-000003.tar"]
    assert probe(dest, 0.2).bytes_per_s > 0
    base = cfg(batch_size=2, shard_split="node")
    world = staged_world(World.single(), str(dest), base)
    assert (world.node_rank, world.num_nodes, world.world_size, world.local_world_size) == (1, 2, 2, 1)
    assert check_shard_set(str(dest), base, world) == 24
    rec = measure_node(dest, base, world, warmup_batches=1, window_s=None, window_batches=2, repeats=1)
    assert rec.error is None and rec.samples_per_s > 0
    assert staged_world(World.single(), str(shards), base) == World.single()  # a whole set: one node


def test_tune_checks_several_ranks_of_one_node_under_the_node_split(tmp_path):
    """tune --nproc-per-node 2 with shard_split = "node": the check builds rank 0 of the node's 2 ranks, not a
    2-rank world with 1 rank on its only node (refused: "needs the same number of ranks on every node")."""
    from gpufeed.tune import check_shard_set, rank_world

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    node = World(world_size=2, local_world_size=2)
    assert check_shard_set(str(shards), cfg(batch_size=2, shard_split="node"), node) == 24
    r1 = rank_world(node, 1)
    assert (r1.rank, r1.local_rank, r1.local_world_size, r1.node_rank, r1.num_nodes) == (1, 1, 2, 0, 1)
    staged = World(rank=2, world_size=4, local_world_size=2, node_rank=1, num_nodes=2)
    r1 = rank_world(staged, 1)
    assert (r1.rank, r1.local_rank, r1.local_world_size, r1.node_rank, r1.num_nodes) == (3, 1, 2, 1, 2)


def test_launch_check_under_the_node_split_takes_a_brace_pattern_as_the_loader_does(tmp_path):
    """A local brace pattern with its manifest.json next to the shards: the loader opens it, so the launcher's
    check under shard_split = "node" must too (it read the pattern as a folder: "shard folder ... does not exist")."""
    from gpufeed.config import TrainConfig
    from gpufeed.train.launch import check_data

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    pattern = str(shards / "train-{000000..000003}.tar")
    train_cfg = TrainConfig(mode="loader-only", shards=pattern, nproc_per_node=1)
    check_data(train_cfg, cfg(batch_size=2, shard_split="node"), world_size=2)
    with pytest.raises(DataError, match="not enough for one batch"):
        check_data(train_cfg, cfg(batch_size=12, shard_split="node"), world_size=2)  # node 1: 11


def test_a_resume_that_changes_the_shard_split_says_the_order_differs():
    """global -> node reads other shards in another order from the resume point on: the resume notes it as it notes
    a changed seed or batch size."""
    from gpufeed.train.checkpoint import Checkpointer
    from gpufeed.config import LoaderConfig, TrainConfig

    notes: list[str] = []
    ck = Checkpointer(TrainConfig(), LoaderConfig(shard_split="node"), World(), model=None, optimizer=None,
                      scaler=None, num_classes=2, total_steps=10, gather=None, notes=notes)
    ck._note_changes({"total_steps": 10, "loader_config": {**vars(LoaderConfig()), "shard_split": "global"}})
    assert notes == ["resume: [loader] shard_split changed since the checkpoint: the rest of the epoch reads another "
                     "sample order than an uninterrupted run"]


@pytest.mark.timeout(120)
def test_tune_measures_two_ranks_of_a_node_staged_set_at_once(tmp_path):
    """--nproc-per-node 2 on a set staged for node 1 of 2: the rank processes are global ranks 2 and 3, and each
    reports under its local rank (keyed by global rank, the trial failed with "KeyError: 0")."""
    from gpufeed.tune import measure_node, staged_world
    from tests.common.cli import invoke

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    dest = tmp_path / "n1"
    invoke(["stage", str(shards), str(dest), "--num-nodes", "2", "--node-rank", "1", "--quiet"])
    base = cfg(batch_size=2, shard_split="node")
    world = staged_world(World(world_size=2, local_world_size=2), str(dest), base)
    assert (world.world_size, world.local_world_size, world.node_rank) == (4, 2, 1)
    rec = measure_node(dest, base, world, warmup_batches=1, window_s=0.2, repeats=1)
    assert rec.error is None and rec.ranks == 2 and len(rec.rank_samples_per_s) == 2


def test_the_stage_fix_of_a_node_split_run_stages_each_nodes_share(tmp_path):
    """A storage-bound run under shard_split = "node" on 2 nodes: each node reads only its shards, so the fix is
    ``gpufeed stage ... --num-nodes 2`` sized by the largest node's share, not the whole set."""
    from gpufeed.config import LoaderConfig, TrainConfig
    from gpufeed.measure.storage_rate import StorageRate
    from gpufeed.shardset.manifest import read_manifest
    from gpufeed.train import verdict_inputs
    from gpufeed.train.records import aggregate
    from gpufeed.measure.verdict import classify
    from tests.test_storage_verdict import _timing

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    sizes = [p.stat().st_size for p in sorted(shards.glob("*.tar"))]
    train_cfg = TrainConfig(shards=str(shards), arch="resnet18", amp="off", progress=False, device="cpu", threads=1,
                            mode="measure")
    loader = LoaderConfig(batch_size=2, num_workers=0, image_size=32, decode="pil", pin_memory=False,
                          shard_split="node")
    # the Trainer's fields verdict_inputs reads (a real 2-rank Trainer needs a process group)
    trainer = SimpleNamespace(cfg=train_cfg, loader_cfg=loader, world=node_world(0, 2), num_nodes=2, cuda=False,
                              manifest=read_manifest(shards))
    modes = {"synthetic": aggregate("synthetic", [_timing(0, 0.0)]),
             "loader-only": aggregate("loader-only", [_timing(1000, 0.0)]),
             "real": aggregate("real", [_timing(1000, 0.5)])}
    vin = verdict_inputs(modes, trainer, StorageRate(bytes_per_s=1.0, source="--storage-rate"))
    assert vin.stage_nodes == 2 and vin.set_bytes == max(sizes[0] + sizes[2], sizes[1] + sizes[3])
    v = classify(dataclasses.replace(vin, shm_free_bytes=1 << 40))
    assert v.bound == "storage", v
    [fix] = [f for f in v.fixes if f.startswith("stage")]
    assert fix.startswith(f"stage the set to /dev/shm with gpufeed stage {shards} /dev/shm/set --num-nodes 2 "
                                 f"--node-rank NODE (fits: ")
    assert "(the largest node's share) of" in fix


def test_doctor_sizes_a_node_staged_set_by_the_shards_staged_there(tmp_path):
    """doctor's "fits in RAM" check on a set staged for node 1 of 2: the bytes of shards 1 and 3, not the whole set
    the manifest lists."""
    from gpufeed import doctor
    from tests.common.cli import invoke

    shards = write_set(tmp_path / "set", [6, 5, 7, 6], num_classes=4)
    sizes = [p.stat().st_size for p in sorted(shards.glob("*.tar"))]
    dest = tmp_path / "n1"
    invoke(["stage", str(shards), str(dest), "--num-nodes", "2", "--node-rank", "1", "--quiet"])
    assert doctor._path_facts(str(dest), []).set_bytes == sizes[1] + sizes[3]
    assert doctor._path_facts(str(shards), []).set_bytes == sum(sizes)
