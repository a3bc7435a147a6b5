"""The loader shared by ``tune`` and ``train``: shard set -> uint8 batches for this rank (docs/design.md §3).

Read in this order: :mod:`~gpufeed.loader.plan` (the torch-free epoch arithmetic: which samples each rank and
worker reads, resume slots), :mod:`~gpufeed.loader.position` (what a checkpoint stores), :mod:`~gpufeed.loader.reader`
(a shard's samples, checked to be the manifest's), :mod:`~gpufeed.loader.stages` (read -> shuffle -> decode under
the ``on_error`` handler -> fill -> batch), :mod:`~gpufeed.loader.dataset` (one worker's epoch),
:mod:`~gpufeed.loader.ring` (the batch buffers persistent workers reuse), :mod:`~gpufeed.loader.shard_loader`
(:class:`ShardLoader`, :func:`build_loader`), :mod:`~gpufeed.loader.decode` and
:mod:`~gpufeed.loader.gpu` (per-sample decode on the CPU, batched decode on the device), and
:mod:`~gpufeed.loader.checks` (the pre-run checks). Importing this package loads no torch: the names that need it
are imported when first used.
"""

from __future__ import annotations

import importlib
from typing import Any

from gpufeed.loader.plan import (
    Segment,
    SlotPlan,
    batches_per_rank,
    crop_rng,
    items_taken,
    node_batches_per_rank,
    plan_slot,
    resume_slot,
    shard_order,
    split_batches,
    split_of,
    worker_batches,
)
from gpufeed.loader.position import LoaderPosition
from gpufeed.loader.reader import READ_EXTENSIONS

_LAZY = {
    "ShardLoader": "shard_loader", "build_loader": "shard_loader", "normalize": "shard_loader",
    "IMAGENET_MEAN": "shard_loader", "IMAGENET_STD": "shard_loader", "NODE_IMBALANCE_WARN": "shard_loader",
    "ShardStream": "dataset",
    "EncodedBatch": "gpu", "gpu_decode": "gpu", "crop_window": "gpu", "crop_buffer_shape": "gpu", "CROP_MARGIN": "gpu",
}
"""Public names whose modules import torch, by module: loaded on first use."""

__all__ = ["Segment", "SlotPlan", "batches_per_rank", "crop_rng", "items_taken", "node_batches_per_rank", "plan_slot",
           "resume_slot", "shard_order", "split_batches", "split_of", "worker_batches", "LoaderPosition",
           "READ_EXTENSIONS", *_LAZY]


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        value = getattr(importlib.import_module(f"gpufeed.loader.{_LAZY[name]}"), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})
