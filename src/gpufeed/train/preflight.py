"""The checks before a run (docs/design.md §5): the run's [loader] section, the steps of one epoch, the classes of
the training and validation sets, and :func:`check_data`, what every rank would refuse before its first step,
refused once by the launcher (exit 2)."""

from __future__ import annotations

import dataclasses
from typing import Any

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, DataError
from gpufeed.core.world import World
from gpufeed.loader.checks import open_shards


def run_loader_config(cfg: TrainConfig, loader_cfg: LoaderConfig) -> LoaderConfig:
    """The [loader] section with the run's seed, batch size and image size."""
    overrides: dict[str, Any] = {"seed": cfg.seed}
    if cfg.batch_size is not None:
        overrides["batch_size"] = cfg.batch_size
    if cfg.image_size is not None:
        overrides["image_size"] = cfg.image_size
    return dataclasses.replace(loader_cfg, **overrides)


def steps_per_epoch(cfg: TrainConfig, loader: Any) -> int:
    """Optimizer steps per epoch of ``loader``; a DataError when it has fewer batches than one step needs."""
    n_batches = len(loader)
    steps = n_batches // cfg.accum_steps
    if steps < 1:
        raise DataError(f"{cfg.shards}: {n_batches} batch(es) per rank per epoch at batch size "
                        f"{loader.cfg.batch_size} is fewer than accum_steps={cfg.accum_steps}")
    return steps


def check_classes(cfg: TrainConfig, train: Any, val: Any) -> None:
    """The model's outputs cover every label of the training set, and the validation set uses the same class
    list in the same order (its labels index its own list): else labels would be out of range mid-run or top-1
    silently wrong. ``train``/``val`` are manifests or None. Raises ConfigError/DataError (exit 2)."""
    from gpufeed.shardset.manifest import class_count_problem

    why = None if train is None else class_count_problem(train.num_classes, train.num_samples)
    if why:
        raise DataError(f"{cfg.shards} lists {why}; the model's head would be sized for classes no sample has "
                        f"(index the set again with the right --classes)")
    if train is not None and cfg.num_classes is not None and cfg.num_classes < train.num_classes:
        raise ConfigError(f"num_classes = {cfg.num_classes} is fewer than the {train.num_classes} classes of "
                          f"{cfg.shards}; labels would be out of range")
    if train is not None and val is not None and list(val.classes) != list(train.classes):
        differ = next((i for i, (a, b) in enumerate(zip(train.classes, val.classes)) if a != b),
                      min(len(train.classes), len(val.classes)))
        raise DataError(f"{cfg.val_shards} lists {val.num_classes} classes and {cfg.shards} {train.num_classes}, "
                        f"first differing at index {differ}: validation labels would not mean the training classes")


def check_data(cfg: TrainConfig, loader_cfg: LoaderConfig, world_size: int) -> None:
    """What every rank of a ``world_size``-rank run would refuse before its first step, refused once before
    launch (DataError/ConfigError, exit 2): no shards for a data mode, an unreadable manifest, a missing or
    unreadable shard, too few samples for one step per rank."""
    if cfg.mode not in ("real", "loader-only", "measure"):
        return
    if not cfg.shards:
        raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
    lc = run_loader_config(cfg, loader_cfg)
    world = World(world_size=world_size)
    if lc.shard_split == "node":  # check the shards of one node: this one when known, else the one the set was
        from gpufeed.shardset.source import open_set  # staged for, else node 0
        from gpufeed.shardset.manifest import staged_node

        nodes = max(1, world_size // max(1, cfg.nproc_per_node))
        shard_set = open_set(cfg.shards, cfg.manifest)  # any spec the loader takes (a brace pattern, a URL)
        staged = staged_node(shard_set.manifest, shard_set.location)
        node = cfg.node_rank if cfg.master_addr and cfg.node_rank is not None else staged[0] if staged else 0
        world = World(rank=node * cfg.nproc_per_node, world_size=world_size, local_world_size=cfg.nproc_per_node,
                      node_rank=min(node, nodes - 1), num_nodes=nodes)
    loader = open_shards(cfg.shards, lc, world, manifest_file=cfg.manifest)
    steps_per_epoch(cfg, loader)
    val = open_shards(cfg.val_shards, lc, world, train=False) if cfg.val_shards and cfg.mode == "real" else None
    check_classes(cfg, loader.manifest, val.manifest if val is not None else None)
