"""The loader ``tune`` and ``train`` use (docs/design.md §3): :class:`ShardLoader` over a shard set, one epoch of
host batches per iteration for this rank, with its counters, resume position and device hand-off."""

from __future__ import annotations

import multiprocessing
import os
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import DataError, GpufeedError
from gpufeed.core.world import World, node_shards
from gpufeed.loader import decode as dec
from gpufeed.loader import ring
from gpufeed.loader.dataset import ShardStream
from gpufeed.loader.errors import WorkerFailure
from gpufeed.loader.gpu import DeviceDecodeError, EncodedBatch, gpu_decode_rows, merge_encoded, refused
from gpufeed.loader.plan import batches_per_rank, split_batches, split_of
from gpufeed.loader.position import LoaderPosition
from gpufeed.loader.reader import ShardReader
from gpufeed.shardset.manifest import Manifest, shard_root
from gpufeed.shardset.source import ShardSet, open_set
from gpufeed.shardset.tar import file_problem

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _worker_init(worker_id: int) -> None:
    torch.set_num_threads(1)


class ShardLoader:
    """Iterable over one epoch of host batches ``(images, labels)`` for this rank.

    ``images`` is uint8 ``[B, 3, S, S]`` (a channels-last view; pinned when ``cfg.pin_memory`` and the
    world is CUDA), ``labels`` int64 ``[B]``. With ``decode = "gpu"`` ``images`` is an
    :class:`EncodedBatch`; :meth:`to_device` decodes it on the device. Every rank yields ``len(self)``
    batches per epoch.

    Counters (all epochs, all workers, updated as batches arrive), under ``on_error = "skip"``:

    - ``num_skipped``: samples lost, one by one: a corrupt or oversized sample counts 1; a shard that ends
      early or cannot be read further counts every planned sample it did not deliver; a shard holding
      more samples than the manifest says counts each surplus sample.
    - ``num_repeated``: samples read a second time to fill a worker's quota after losses (duplicates
      within the epoch that keep every rank at ``len(self)`` batches).

    A data error (``on_error = "raise"``) is raised as a one-sentence :class:`DataError` naming the shard
    and member, also when it happens in a DataLoader worker.

    ``reuse_batches`` (what ``train`` and ``tune`` pass): with persistent workers, each worker reuses a batch's
    shared memory once nothing in this process holds the batch any more (:mod:`gpufeed.loader.ring`; ~70 µs per
    sample less on a 2-core Xeon). The caller then must not keep a batch's storage object without the tensor, nor
    hand a batch to another process, without ``clone()``: another process's hold, and a bare storage object's, are
    not seen. Off by default.

    Resume: :attr:`position` says how far the current iteration got; ``resume(position)`` (or
    ``set_epoch(epoch, start_batch)``) makes the next iteration start there without decoding what it passes
    over (docs/design.md §3, "Resume"). Under ``num_workers = 0`` the per-sample torch ops run on one intra-op
    thread while a batch is made (tiny ops on an OpenMP pool burn ~10x the CPU); the caller's setting is
    restored before each batch is handed out.
    """

    def __init__(self, shards: str | Path, cfg: LoaderConfig, world: World, *, train: bool = True, epoch: int = 0,
                 manifest: Manifest | None = None, manifest_file: str | Path | None = None, fast_tar: bool = True,
                 reuse_batches: bool = False):
        self.cfg = cfg
        self.world = world
        self.train = train
        shard_set = _shard_set(shards, manifest, manifest_file)
        self.manifest = shard_set.manifest
        self.shard_set = shard_set
        # absolute local paths (a name like "-" stays a file name wherever it is used), or user-typed URLs
        self.paths = list(shard_set.urls)
        counts = [s.num_samples for s in self.manifest.shards]
        split = split_of(cfg, world)
        self.shards_here = _own_shards(str(shards), self.manifest, world, split)
        """Indices of the shards this rank's node reads: all of them under the global split."""
        _check_readable(shard_set, self.paths, self.shards_here, world, split)
        self.num_batches = split_batches(counts, cfg.batch_size, **split)
        self.warnings: list[str] = []
        """Findings that do not stop the loader: local rank 0 prints them to stderr when it is first iterated (a
        loader built only to check the set, as the launcher does, prints nothing)."""
        self._warned = False
        if self.num_batches == 0:
            raise _too_few(counts, cfg.batch_size, world, split)
        if split.get("node_rank") is not None:
            self.warnings += _imbalance(counts, world, cfg.batch_size, self.num_batches)
        if cfg.decode in ("simplejpeg", "roi"):
            dec._import_simplejpeg()
        if cfg.decode == "roi":
            dec.require_roi()
        self.num_skipped = 0
        self.num_repeated = 0
        self._epoch = multiprocessing.get_context().Value("q", epoch, lock=False)
        self._start = multiprocessing.get_context().Value("q", 0, lock=False)
        self._settings = 0
        """How many times set_epoch ran: an iteration resets the start it used only when none ran since it began."""
        self._consumed = 0
        shards_meta = self.manifest.shards
        reader = ShardReader(self.paths, counts, label=self.manifest.label, sizes=[s.bytes for s in shards_meta],
                             keys=[s.keys_sha256 for s in shards_meta], sha256=[s.sha256 for s in shards_meta],
                             check=getattr(cfg, "check", "keys"), remote_streams=cfg.remote_streams, fast_tar=fast_tar)
        self._dataset = ShardStream(reader, self.manifest.classes, cfg, world, train, self._epoch, self._start,
                                    label=self.manifest.label)
        self._pin = bool(cfg.pin_memory and world.is_cuda and torch.cuda.is_available())
        nw = cfg.num_workers
        # num_workers = 0: this process makes the batches, straight into pinned memory (no pinning copy after)
        self._dataset.pin_rows = self._pin and cfg.worker_batching and nw == 0
        self._returns: ring.MainReturns | None = None
        """The workers' reused batch buffers, main side (:mod:`gpufeed.loader.ring`), when they run."""
        if reuse_batches and ring.ring_runs(cfg) and ring.use_count_available():
            flags = ring.SlotFlags(nw, ring.buffers_per_worker(cfg))
            self._dataset.ring_flags = flags
            self._returns = ring.MainReturns(flags)
        self._loader = DataLoader(
            self._dataset, batch_size=None, num_workers=nw, pin_memory=self._pin and cfg.worker_batching and nw > 0,
            prefetch_factor=cfg.prefetch_factor if nw > 0 else None,
            persistent_workers=cfg.persistent_workers if nw > 0 else False,
            worker_init_fn=_worker_init if nw > 0 else None,
        )

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def __len__(self) -> int:
        return self.num_batches

    def set_epoch(self, epoch: int, start_batch: int = 0) -> None:
        """Select the epoch (shard order, shuffle and crops derive from seed and epoch); persistent workers see it.

        ``start_batch``: the next iteration yields only batches ``start_batch..len(self)-1`` of the epoch,
        the batches an uninterrupted iteration yields from there (same samples, crops and order), passing
        over the first ones without decoding them. It applies to that one iteration; later ones start at 0.
        """
        epoch, start_batch = int(epoch), int(start_batch)
        if epoch < 0 or not 0 <= start_batch <= self.num_batches:
            raise GpufeedError(f"set_epoch({epoch}, start_batch={start_batch}): the epoch must be >= 0 and "
                               f"start_batch in 0..{self.num_batches}")
        self._epoch.value = epoch
        self._start.value = start_batch
        self._consumed = start_batch
        self._settings += 1

    @property
    def position(self) -> LoaderPosition:
        """The epoch and the batches of it handed out so far (counting a resume's ``start_batch``)."""
        return LoaderPosition(self.epoch, self._consumed)

    def resume(self, position: LoaderPosition) -> None:
        """Continue after ``position``: its epoch from the next batch, or the next epoch when it was complete.

        A position beyond this loader's epoch (another shard set or batch size) raises :class:`GpufeedError`.
        """
        if position.batches_consumed == self.num_batches:
            self.set_epoch(position.epoch + 1)
        else:
            self.set_epoch(position.epoch, position.batches_consumed)

    def __iter__(self):
        if not self._warned and self.world.local_rank == 0:
            from gpufeed.core.redact import redact

            for w in self.warnings:
                print(redact(f"warning: {w}"), file=sys.stderr)
        self._warned = True
        start, settings = int(self._start.value), self._settings
        self._consumed = start
        batches = self._loader_batches()
        produced = 0
        try:
            while True:
                with self._one_thread():
                    batch = next(batches, None)
                if batch is None:
                    break
                produced += 1
                self._consumed += 1
                yield batch
                batch = None  # not held here while the next one is fetched: its ring slot can go back
        finally:
            # every worker has read the start by now, unless the caller left early (then that iteration is dropped);
            # a set_epoch since this iteration began is for the next one, so it stays
            if self._settings == settings:
                self._start.value = 0
        if produced != self.num_batches - start:  # a rank that stops early would hang DDP: fail loudly instead
            raise DataError(f"rank {self.world.rank} yielded {produced} batches, expected {self.num_batches - start}")

    @contextmanager
    def _one_thread(self):
        """With ``num_workers = 0``: torch on one intra-op thread while a batch is made, then the caller's setting."""
        prev = torch.get_num_threads()
        if self.cfg.num_workers > 0 or prev == 1:
            yield
            return
        torch.set_num_threads(1)
        try:
            yield
        finally:
            torch.set_num_threads(prev)

    def _loader_batches(self):
        if self.cfg.worker_batching:
            # slots taken by batches that never arrived (an epoch left early): the DataLoader's reset, inside iter(),
            # drops whatever was still in flight before it starts the workers on this iteration
            stranded = self._returns.stranded() if self._returns is not None else []
            items = iter(self._loader)
            if stranded:
                self._returns.release(stranded)
            for item in items:
                yield self._count(item)
        else:
            yield from self._batch_in_main()

    def _count(self, item) -> tuple[Any, torch.Tensor]:
        """Add a worker item's counters; raise a worker's data error here, as the sentence it sent."""
        if isinstance(item, WorkerFailure):
            raise DataError(item.message)
        images, labels, skipped, repeated, worker, slot = item
        self.num_skipped += int(skipped)
        self.num_repeated += int(repeated)
        if self._returns is not None:
            self._returns.sweep()
            if slot >= 0:
                self._returns.received(int(worker), int(slot), images, copied=self._loader.pin_memory)
        return images, labels

    def _batch_in_main(self):
        B, S = self.cfg.batch_size, self.cfg.image_size
        gpu = self.cfg.decode == "gpu"
        rows: list[Any] = []
        labels: list[int] = []
        for item in self._loader:
            images, label = self._count(item)
            rows.append(images)
            labels.append(int(label[0]))
            if len(rows) == B:
                lab = torch.tensor(labels, dtype=torch.int64)
                if gpu:
                    out = merge_encoded(rows, S)
                else:
                    imgs = torch.empty((B, S, S, 3), dtype=torch.uint8, pin_memory=self._pin)
                    for i, r in enumerate(rows):
                        imgs[i] = r[0].permute(1, 2, 0)
                    out = imgs.permute(0, 3, 1, 2)
                    if self._pin:
                        lab = lab.pin_memory()
                yield out, lab
                rows, labels = [], []

    def to_device(self, batch, device: str | torch.device, non_blocking: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """Host batch -> (uint8 [B, 3, S, S], int64 [B]) on ``device``; decodes an :class:`EncodedBatch` there.

        An image the device decoder refuses (its header passed the worker's checks) is a corrupt sample like any
        other: with ``on_error = "raise"`` a :class:`DataError` naming it; with ``"skip"`` it is counted in
        ``num_skipped`` and its row (image and label) repeats another of the batch, counted in ``num_repeated``."""
        images, labels = batch
        labels = labels.to(device, non_blocking=non_blocking)
        if not isinstance(images, EncodedBatch):
            return images.to(device, non_blocking=non_blocking), labels
        try:
            out, failures, fills = gpu_decode_rows(images, device, non_blocking=non_blocking)
        except DeviceDecodeError as exc:
            raise DataError(str(exc)) from None
        if failures:
            _row, name, why = failures[0]
            if self.cfg.on_error == "raise":
                raise DataError(refused(name, why))
            self.num_skipped += len(failures)
            self.num_repeated += len(failures)
            for row, source in fills:
                labels[row] = labels[source]
        return out, labels


NODE_IMBALANCE_WARN = 0.02
"""Under ``shard_split = "node"``: warn when stopping every rank at the smallest node's batch count leaves more
than this fraction of the set unread each epoch, beyond what the global split drops."""


def _shard_set(shards: str | Path, manifest: Manifest | None, manifest_file: str | Path | None) -> ShardSet:
    """The set to read: from ``manifest`` when the caller read it already (the shards are where it says, next to
    ``shards``), else opened from ``shards`` (:func:`gpufeed.shardset.source.open_set`)."""
    if manifest is None:
        return open_set(shards, manifest=manifest_file)
    root = shard_root(manifest, shards)
    return ShardSet(manifest, [str(p.absolute()) for p in manifest.shard_paths(root)], str(shards), False)


def _check_readable(shard_set: ShardSet, paths: list[str], here: list[int], world: World,
                    split: dict[str, Any]) -> None:
    """Refuse (DataError) a local set whose shards read here are missing, not files, or links out of its folder."""
    unreadable = [] if shard_set.remote else [  # a set's shards: no link out of its folder
        (paths[i], why) for i in here if (why := file_problem(paths[i], os.path.dirname(paths[i])))]
    if unreadable:
        whose = "" if split.get("node_rank") is None else f" owned by node {world.node_rank}"
        raise DataError(f"{len(unreadable)} shard(s){whose} of the manifest cannot be read, e.g. "
                        f"{unreadable[0][0]} {unreadable[0][1]}")


def _too_few(counts: list[int], batch_size: int, world: World, split: dict[str, Any]) -> DataError:
    """The error for a set too small for one batch per rank (of the smallest node's ranks under the node split)."""
    if split.get("node_rank") is None:
        return DataError(
            f"{sum(counts)} samples are not enough for one batch of {batch_size} on each of "
            f"{world.world_size} rank(s); lower batch_size"
        )
    held = [sum(counts[i] for i in node_shards(len(counts), n, world.num_nodes)) for n in range(world.num_nodes)]
    least = min(range(world.num_nodes), key=lambda n: held[n])
    return DataError(
        f"node {least}'s {held[least]} samples "
        f"(shard_split = \"node\") are not enough for one batch of {batch_size} on each of its "
        f"{world.local_world_size} rank(s); lower batch_size"
    )


def _own_shards(where: str, manifest: Manifest, world: World, split: dict[str, Any]) -> list[int]:
    """The shards this rank's node reads: all under the global split, else its :func:`node_shards`. Refuses (one
    sentence, DataError) a world the node split cannot serve, a set staged per node (``gpufeed stage
    --num-nodes``) read with the global split, and a set staged for another node or node count."""
    from gpufeed.shardset.manifest import staged_node

    num_shards = len(manifest.shards)
    staged = staged_node(manifest, where)
    if split.get("node_rank") is None:
        if staged is not None:
            raise DataError(f"{where} holds only node {staged[0]} of {staged[1]}'s shards (gpufeed stage --num-nodes "
                            f"{staged[1]}) and the other nodes' shards are missing here, so shard_split = \"global\" "
                            f"cannot read it: set [loader] shard_split = \"node\"")
        return list(range(num_shards))
    n, N = world.node_rank, world.num_nodes
    if not (0 <= n < N and 0 <= world.local_rank < world.local_world_size
            and N * world.local_world_size == world.world_size):
        raise DataError(f"shard_split = \"node\" needs the same number of ranks on every node; this world has "
                        f"{world.world_size} rank(s) on {N} node(s), {world.local_world_size} on node {n}")
    if N > num_shards:
        raise DataError(f"shard_split = \"node\" cannot split {num_shards} shard(s) of {where} over {N} nodes: every "
                        f"node needs at least one")
    if staged is not None and staged != (n, N):
        raise DataError(f"{where} was staged for node {staged[0]} of {staged[1]}, but this rank runs on node {n} of "
                        f"{N}; stage it again with --node-rank {n} --num-nodes {N}")
    return node_shards(num_shards, n, N)


def _imbalance(counts: list[int], world: World, batch_size: int, num_batches: int) -> list[str]:
    """One warning when the node split's common batch count drops more than :data:`NODE_IMBALANCE_WARN` of the
    samples beyond what the global split would drop (the nodes hold unequal numbers of samples); else none."""
    total = sum(counts)
    held = [sum(counts[i] for i in node_shards(len(counts), n, world.num_nodes)) for n in range(world.num_nodes)]
    extra = (batches_per_rank(total, world.world_size, batch_size) - num_batches) * world.world_size * batch_size
    if extra <= NODE_IMBALANCE_WARN * total:
        return []
    return [f"shard_split = \"node\": the {world.num_nodes} nodes hold {min(held)} to {max(held)} samples and every "
            f"rank stops at the smallest node's {num_batches} batches, so {extra} samples ({100 * extra / total:.1f}% "
            f"of the set) more than the global split drops are not read each epoch; make the shards even in size and "
            f"their number a multiple of the nodes"]


def build_loader(shards: str | Path, cfg: LoaderConfig, world: World, *, train: bool = True,
                 epoch: int = 0, manifest_file: str | Path | None = None, fast_tar: bool = True,
                 reuse_batches: bool = False) -> ShardLoader:
    """The loader over a shard set for this rank (any spec :func:`gpufeed.shardset.source.open_set` takes: a
    folder, manifest.json, URL or brace pattern, with ``manifest_file`` its manifest); see :class:`ShardLoader`
    (and its ``reuse_batches`` contract). ``fast_tar`` False reads plain ``.tar`` shards with the one-pass stream
    reader gzip shards use (tests run both)."""
    return ShardLoader(shards, cfg, world, train=train, epoch=epoch, manifest_file=manifest_file, fast_tar=fast_tar,
                       reuse_batches=reuse_batches)


def normalize(images_uint8: torch.Tensor, *, dtype: torch.dtype = torch.float32,
              channels_last: bool = False) -> torch.Tensor:
    """ImageNet mean/std normalisation of uint8 [B, 3, H, W] images, on their device."""
    if images_uint8.dtype != torch.uint8 or images_uint8.dim() != 4 or images_uint8.shape[1] != 3:
        raise ValueError(f"expected uint8 [B, 3, H, W], got {images_uint8.dtype} {tuple(images_uint8.shape)}")
    dev = images_uint8.device
    mean = torch.tensor([m * 255 for m in IMAGENET_MEAN], device=dev, dtype=torch.float32).view(1, 3, 1, 1)
    inv_std = torch.tensor([1 / (s * 255) for s in IMAGENET_STD], device=dev, dtype=torch.float32).view(1, 3, 1, 1)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    x = images_uint8.to(dtype=torch.float32, memory_format=fmt)
    x = (x - mean) * inv_std
    return x.to(dtype=dtype, memory_format=fmt)
