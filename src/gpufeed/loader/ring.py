"""Batch buffers a DataLoader worker reuses once the main process has let go of them (docs/design.md §3, "Batches").

A worker decodes each batch straight into shared memory and torch hands the main process that memory by its handle.
A new shared-memory buffer per batch costs its pages again (the kernel zeroes and maps ~2,400 of them for a batch
of 64 at 224 px: ~70 µs per sample on a 2-core Xeon, measured), so each worker keeps a few buffers, its *slots*,
and reuses one only when the main process says that nothing there still reads it.

The protocol is one shared byte per slot, written by each side in turn:

- a worker takes a slot whose byte is 0 (free), sets it to 1 and decodes the batch into the slot's buffer; with no
  free slot it takes a new buffer outside the ring (slot -1), as it would without one, and never waits;
- the main process, on receiving a batch from slot ``k``, keeps an alias of its memory and sets the byte back to 0
  only once nothing but that alias holds the memory (the caller and every view it made have let go, seen from the
  memory's use count), or at once when the DataLoader's pin thread has already copied the batch out.

The main process frees each received batch once, and the worker takes only a byte at 0, so a slot is never written
while anything in the main process reads it. That needs one process per worker number for the loader's whole life,
so the ring runs only with persistent workers (one DataLoader iterator, reset between epochs). A batch the main
process never receives (dropped when an epoch is left early, or a batch half made then) keeps its slot at 1 until
the next iteration: the DataLoader's reset drains every worker's earlier work before the workers start again, so
the slots taken then and never received are given back right after it (:meth:`MainReturns.stranded`).

What the use count cannot see: a hold in another process (a batch sent through a ``torch.multiprocessing`` queue
shares this memory) and a storage object kept without any tensor (torch reuses one Python storage object per
storage, so the count reads the same). So the ring is the caller's choice (``build_loader(..., reuse_batches=True)``:
``train`` and ``tune``, which drop every batch after its step), never a default.
"""

from __future__ import annotations

import multiprocessing
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    import torch

SPARE_SLOTS = 3
"""Slots per worker beyond its ``prefetch_factor`` batches in flight: the one it fills, the one the caller holds and
one for the caller's training step to let go of the previous batch late."""


def ring_runs(cfg: Any) -> bool:
    """Whether a loader with ``cfg`` (a LoaderConfig) reuses its workers' batch buffers: worker processes that live
    as long as the loader (``persistent_workers``), whole batches made in them, CPU decode."""
    return cfg.num_workers > 0 and bool(cfg.persistent_workers) and bool(cfg.worker_batching) and cfg.decode != "gpu"


def buffers_per_worker(cfg: Any) -> int:
    """How many batch buffers one worker holds at most in steady state: its slots with the ring, else its
    ``prefetch_factor`` batches in flight."""
    return cfg.prefetch_factor + (SPARE_SLOTS if ring_runs(cfg) else 0)


def use_count_available() -> bool:
    """Whether this torch tells a storage's use count (a private function, so the ring is off without it)."""
    import torch

    return callable(getattr(torch._C, "_storage_Use_Count", None))


def _use_count(alias: torch.Tensor) -> int:
    import torch

    return int(torch._C._storage_Use_Count(alias.untyped_storage()._cdata))


class SlotFlags:
    """The shared bytes of every worker's slots (made before the workers start, handed to them with the dataset)."""

    def __init__(self, workers: int, slots: int):
        self.slots = slots
        self.bytes = multiprocessing.get_context().RawArray("b", workers * slots)

    def index(self, worker: int, slot: int) -> int:
        return worker * self.slots + slot


class WorkerRing:
    """One worker's slots: :meth:`take` gives a buffer to decode a batch into and its slot number (-1: outside)."""

    def __init__(self, flags: SlotFlags, worker: int, make: Callable[[], torch.Tensor]):
        self.flags, self.worker, self.make = flags, worker, make
        self.buffers: list[torch.Tensor | None] = [None] * flags.slots

    def take(self) -> tuple[torch.Tensor, int]:
        for slot in range(self.flags.slots):
            i = self.flags.index(self.worker, slot)
            if self.flags.bytes[i] == 0:
                self.flags.bytes[i] = 1
                if self.buffers[slot] is None:
                    self.buffers[slot] = self.make()
                return self.buffers[slot], slot
        return self.make(), -1


class MainReturns:
    """The main process's side: an alias of each slot's memory (kept, so torch finds the mapping in its cache when the
    slot comes back) and the slots received and not yet given back."""

    def __init__(self, flags: SlotFlags):
        self.flags = flags
        self.alias: dict[int, torch.Tensor] = {}
        """Flag index -> a tensor over the memory last received from that slot."""
        self.pending: set[int] = set()
        """Flag indices received and not yet given back."""

    def received(self, worker: int, slot: int, images: torch.Tensor, copied: bool) -> None:
        """A batch from ``slot`` of ``worker`` (``copied``: the pin thread copied it out, nothing reads it now)."""
        i = self.flags.index(worker, slot)
        if copied:
            self.flags.bytes[i] = 0
            return
        import torch

        storage = images.untyped_storage()
        known = self.alias.get(i)
        if known is None or known.untyped_storage().data_ptr() != storage.data_ptr():
            self.alias[i] = torch.empty(0, dtype=images.dtype).set_(storage)
        self.pending.add(i)

    def stranded(self) -> list[int]:
        """Slots taken and never received (batches dropped with an epoch left early, or one half made): before the
        next iteration's ``iter()`` on the DataLoader, which drops whatever was still in flight (the persistent
        workers' reset) before the workers take new slots."""
        return [i for i in range(len(self.flags.bytes)) if self.flags.bytes[i] == 1 and i not in self.pending]

    def release(self, slots: list[int]) -> None:
        """Give back :meth:`stranded`'s slots once the DataLoader's reset has dropped their batches."""
        for i in slots:
            self.flags.bytes[i] = 0

    def sweep(self) -> None:
        """Give back every received slot whose memory nothing holds but the alias (2 uses: the alias and the count's
        own handle)."""
        for i in [i for i in self.pending if _use_count(self.alias[i]) <= 2]:
            self.pending.discard(i)
            self.flags.bytes[i] = 0
