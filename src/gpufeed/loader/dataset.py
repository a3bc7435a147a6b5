"""One epoch of one rank as a torch ``IterableDataset`` (docs/design.md §3): each DataLoader worker reads its planned
segments (:mod:`gpufeed.loader.plan`) through the stages of :mod:`gpufeed.loader.stages` and yields batches built in
shared memory."""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import GpufeedError
from gpufeed.core.world import World
from gpufeed.loader import decode as dec
from gpufeed.loader.errors import WorkerFailure
from gpufeed.loader.gpu import EncodedBatch, prepare_encoded
from gpufeed.loader.plan import crop_rng, plan_slot, resume_slot, shuffle_rng, split_of
from gpufeed.loader.reader import ShardReader
from gpufeed.loader.ring import SlotFlags, WorkerRing
from gpufeed.loader.stages import (Decode, OnError, ThreadedDecode, batch, fill, read_segments, sample_name,
                                   shuffle)
from gpufeed.shardset.manifest import DEFAULT_LABEL_SOURCE, read_label


class BatchRows:
    """The batch a worker fills: uint8 images ``[n, S, S, 3]`` (in shared memory inside a worker, pinned in a main
    process that feeds CUDA), int64 labels and, for ``decode = "gpu"``, its :class:`EncodedBatch`; ``n`` is the batch
    size, or 1 per sample (the main process then makes the batches).

    :meth:`take` hands out the very tensors allocated here, never a new tensor over their memory: torch passes a
    worker's batch to the main process by the shared-memory handle only when the tensor is the shared one (a view
    made through NumPy is not recognised and would be copied into new shared memory, a whole batch per batch), and
    CUDA's pinned-memory allocator keeps a block out of reuse until a copy from it has finished only when the copy
    reads the tensor it allocated."""

    def __init__(self, n: int, size: int, shared: bool, gpu: bool, pinned: bool = False,
                 ring: WorkerRing | None = None, worker: int = 0):
        self.n, self.size, self.shared, self.gpu, self.pinned = n, size, shared, gpu, pinned
        self.ring, self.worker = ring, worker
        """The worker's reused batch buffers (:mod:`gpufeed.loader.ring`) and its number, or None."""
        self.slot = -1
        """The ring slot the batch being filled is in (-1: a buffer of its own)."""
        self.filled = 0
        self._batch: tuple[Any, Any, Any, Any, EncodedBatch | None] | None = None

    def target(self) -> tuple[Any, EncodedBatch | None, int]:
        """``(images, enc, row)``: where the next sample goes (a new batch is made when none is being filled)."""
        if self._batch is None:
            images, self.slot = self.ring.take() if self.ring is not None else (self.new_images(), -1)
            labels = torch.empty((self.n,), dtype=torch.int64, pin_memory=self.pinned)
            enc = EncodedBatch([], [], [], [], images, self.size) if self.gpu else None
            self._batch = images, labels, images.numpy(), labels.numpy(), enc
        _, _, rows, _, enc = self._batch
        return rows, enc, self.filled

    def new_images(self) -> torch.Tensor:
        """A batch buffer of its own (in shared memory inside a worker, which writes straight into the memory the main
        process receives)."""
        images = torch.empty((self.n, self.size, self.size, 3), dtype=torch.uint8, pin_memory=self.pinned)
        return images.share_memory_() if self.shared else images

    def add(self, label: int) -> bool:
        self._batch[3][self.filled] = label
        self.filled += 1
        return self.filled == self.n

    def take(self, skipped: int, repeated: int):
        """``(images, labels, skipped, repeated, worker, slot)``: the samples lost and re-read since the previous
        batch, and which ring slot of which worker holds the images (slot -1: none)."""
        images, labels, _, _, enc = self._batch
        self._batch, self.filled = None, 0
        if enc is not None:
            return enc.pack(), labels, skipped, repeated, self.worker, -1
        return images.permute(0, 3, 1, 2), labels, skipped, repeated, self.worker, self.slot


class ShardStream(IterableDataset):
    """One epoch of one rank: each DataLoader worker reads its planned segments and yields batches."""

    def __init__(self, reader: ShardReader, classes: list[str], cfg: LoaderConfig, world: World, train: bool,
                 epoch_value: Any, start_value: Any, label: str = DEFAULT_LABEL_SOURCE):
        self.reader = reader
        """The set's shards, checked against the manifest as they are read."""
        self.counts = reader.counts
        self.classes = list(classes)
        self.class_index = {c: i for i, c in enumerate(classes)}
        self.label = label
        """The manifest's label source (``cls``, ``txt``, ``json:FIELD``)."""
        self.cfg = cfg
        self.world = world
        self.train = train
        self.epoch_value = epoch_value
        self.start_value = start_value
        """Batches of the epoch the next iteration passes over without decoding (see ShardLoader.set_epoch)."""
        self.per_sample = not cfg.worker_batching
        self.pin_rows = False
        """Batches made in the main process (``num_workers = 0``) are allocated pinned, so the copy to the device is
        the batch's only copy (:class:`ShardLoader` sets it when it pins for CUDA; the DataLoader then pins nothing)."""
        self.ring_flags: SlotFlags | None = None
        """The shared slot bytes of the workers' batch rings (:mod:`gpufeed.loader.ring`), when :class:`ShardLoader`
        runs them (persistent workers, whole batches made in the workers, CPU decode)."""
        self._ring: WorkerRing | None = None
        """This worker process's ring (made at its first epoch, kept for the next ones)."""

    def __iter__(self):
        # num_workers == 0 runs this in the main process; ShardLoader keeps its torch ops on one thread
        if get_worker_info() is not None:  # workers run single-threaded already (worker_init)
            try:
                yield from self._iter()
            except GpufeedError as exc:  # hand the main process the sentence, not a worker traceback
                yield WorkerFailure(str(exc))
            return
        yield from self._iter()

    def _iter(self):
        """This worker's batches of the epoch: its slot's plan through read -> shuffle -> decode -> fill -> batch."""
        info = get_worker_info()
        worker, num_workers = (info.id, info.num_workers) if info is not None else (0, 1)
        cfg, split = self.cfg, split_of(self.cfg, self.world)
        slot, skip = resume_slot(self.counts, cfg.batch_size, split, int(self.start_value.value), worker,
                                 num_workers, self.per_sample)
        epoch = int(self.epoch_value.value)
        plan = plan_slot(self.counts, **split, worker=slot, num_workers=num_workers, batch_size=cfg.batch_size,
                         seed=cfg.seed, epoch=epoch, shuffle=self.train)
        quota = plan.num_batches * cfg.batch_size
        if quota == 0 or skip >= quota:
            return
        handler = OnError(cfg.on_error)
        rng = shuffle_rng(cfg.seed, epoch, self.world.rank, slot)
        buffer = cfg.shuffle_buffer if self.train else 0
        rows = BatchRows(1 if self.per_sample else cfg.batch_size, cfg.image_size, info is not None,
                         cfg.decode == "gpu", pinned=info is None and self.pin_rows, worker=worker)
        if info is not None and self.ring_flags is not None:
            if self._ring is None:
                self._ring = WorkerRing(self.ring_flags, worker, rows.new_images)
            rows.ring = self._ring
        check = partial(dec.check_header, max_pixels=cfg.max_pixels)
        threads = cfg.decode_threads if cfg.decode != "gpu" else 1
        if threads > 1:
            S = cfg.image_size
            decode = ThreadedDecode(self._label, check, partial(self._decode_to, epoch), partial(_commit, rows),
                                    lambda: np.empty((S, S, 3), dtype=np.uint8), handler, threads, skip)
        else:
            decode = Decode(self._label, check, partial(self._decode, rows, epoch), handler, skip)

        def one_pass():
            return decode(shuffle(read_segments(plan.segments, self.reader, handler), buffer, rng))

        empty = (f"rank {self.world.rank} worker {slot}: no readable sample in its {plan.num_samples} planned "
                 f"samples (shards {sorted({s.shard for s in plan.segments})})")
        try:
            yield from batch(fill(one_pass, quota, handler, empty), rows)
        finally:
            if isinstance(decode, ThreadedDecode):
                decode.close()

    def _label(self, sample: dict) -> int:
        return read_label(sample, self.label, self.classes, self.class_index)

    def _crop_fn(self, sample: dict, epoch: int):
        if self.train:
            rng = crop_rng(self.cfg.seed, epoch, sample["__shard__"], sample.get("__key__"))
            return partial(dec.train_crop, rng=rng)
        return partial(dec.eval_crop, size=self.cfg.image_size, crop_ratio=getattr(self.cfg, "crop_ratio", 0.875))

    def _decode_to(self, epoch: int, sample: dict, ext: str, data: bytes, out: np.ndarray) -> None:
        """Decode one sample into ``out`` (a decode thread's buffer; :func:`_commit` copies it into the batch)."""
        cfg = self.cfg
        dec.decode_into(data, ext, cfg.decode, self._crop_fn(sample, epoch), cfg.image_size, out,
                        resize=getattr(cfg, "resize", "torch"), max_pixels=cfg.max_pixels)

    def _decode(self, rows: BatchRows, epoch: int, sample: dict, ext: str, data: bytes) -> None:
        """Decode one sample into the next row of ``rows`` (or record its JPEG for the device)."""
        images, enc, row = rows.target()
        cfg = self.cfg
        if enc is not None and prepare_encoded(enc, row, data, ext, self._crop_fn(sample, epoch), cfg.max_pixels,
                                               sample_name(sample, ext)):
            return
        dec.decode_into(data, ext, cfg.decode, self._crop_fn(sample, epoch), cfg.image_size, images[row],
                        resize=getattr(cfg, "resize", "torch"), max_pixels=cfg.max_pixels)


def _commit(rows: BatchRows, out: np.ndarray) -> None:
    """A decoded image into the next row of the batch being built."""
    images, _, row = rows.target()
    images[row] = out
