"""The epoch plan, torch-free: which samples each (rank, DataLoader worker) reads in an epoch, how many batches
it yields, and where a resumed iteration starts (docs/design.md §3, "Epoch split", "Node split" and "Resume").
Pure integer arithmetic of the manifest's counts, seed and epoch: the same on every rank and in every process."""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from gpufeed.core.world import node_shards

if TYPE_CHECKING:
    from gpufeed.config import LoaderConfig
    from gpufeed.core.world import World


@dataclass(frozen=True)
class Segment:
    """Samples ``[start, stop)`` (counted in stream order) of one shard."""

    shard: int
    start: int
    stop: int


@dataclass(frozen=True)
class SlotPlan:
    """What one (rank, worker) reads in one epoch and how many batches it yields."""

    segments: tuple[Segment, ...]
    num_batches: int

    @property
    def num_samples(self) -> int:
        return sum(s.stop - s.start for s in self.segments)


def batches_per_rank(num_samples: int, world_size: int, batch_size: int) -> int:
    return (num_samples // world_size) // batch_size


def node_batches_per_rank(counts: list[int], num_nodes: int, local_world_size: int, batch_size: int) -> int:
    """Batches per rank under the node split: the fewest any node's ranks can all make from that node's shards
    (:func:`gpufeed.core.world.node_shards`), so every rank of every node yields the same number."""
    return min(batches_per_rank(sum(counts[i] for i in node_shards(len(counts), n, num_nodes)), local_world_size,
                                batch_size) for n in range(num_nodes))


def split_batches(counts: list[int], batch_size: int, *, world_size: int, node_rank: int | None = None,
                  num_nodes: int = 1, rank: int = 0) -> int:
    """Batches per rank of the split ``split_of`` describes (``rank`` is accepted and unused, so a split's
    keywords can be passed whole)."""
    if node_rank is None:
        return batches_per_rank(sum(counts), world_size, batch_size)
    return node_batches_per_rank(counts, num_nodes, world_size, batch_size)


def split_of(cfg: LoaderConfig, world: World) -> dict[str, Any]:
    """The keywords of :func:`plan_slot` that place this rank: its rank of all ranks (``shard_split = "global"``),
    or its local rank of the node's ranks plus the node (``"node"``)."""
    if getattr(cfg, "shard_split", "global") == "node":
        return {"rank": world.local_rank, "world_size": world.local_world_size, "node_rank": world.node_rank,
                "num_nodes": world.num_nodes}
    return {"rank": world.rank, "world_size": world.world_size}


def shard_order(num_shards: int, seed: int, epoch: int, shuffle: bool, node_rank: int | None = None,
                num_nodes: int = 1) -> list[int]:
    """The epoch's shards in reading order: all of them (``node_rank`` None), or node ``node_rank``'s own
    (:func:`gpufeed.core.world.node_shards`), shuffled by (seed, epoch[, node]) when ``shuffle``."""
    if node_rank is None:
        order = list(range(num_shards))
        if shuffle:
            random.Random(f"gpufeed-shards-{seed}-{epoch}").shuffle(order)
        return order
    order = node_shards(num_shards, node_rank, num_nodes)
    if shuffle:
        random.Random(f"gpufeed-node-shards-{seed}-{epoch}-{node_rank}-{num_nodes}").shuffle(order)
    return order


def worker_batches(num_batches: int, num_workers: int) -> list[int]:
    """Batches each DataLoader worker of a rank yields: an even split, the first workers take one more."""
    num_workers = max(1, num_workers)
    return [num_batches // num_workers + (w < num_batches % num_workers) for w in range(num_workers)]


def items_taken(counts: list[int], m: int) -> list[int]:
    """How many items of each worker the first ``m`` items of a DataLoader iteration hold.

    Worker ``w`` yields ``counts[w]`` items. In-order DataLoader iteration over an IterableDataset asks the
    workers in turn (0, 1, ..., 0, 1, ...) and leaves out a worker once it is exhausted (torch's
    ``_MultiProcessingDataLoaderIter``: ``_try_put_index`` cycles over the active workers, ``_next_data``
    skips the tasks of exhausted ones; the cycle restarts at worker 0 every iteration). So the items come
    in passes: pass ``j`` holds item ``j`` of every worker with more than ``j`` items, in worker order.
    """
    taken = [0] * len(counts)
    level, left = 0, max(0, m)
    while left > 0:
        active = [w for w, n in enumerate(counts) if n > level]
        if not active:
            break
        top = min(counts[w] for w in active)  # every active worker has items up to this pass
        full = (top - level) * len(active)
        if left >= full:
            for w in active:
                taken[w] = top
            left -= full
            level = top
            continue
        passes, rest = divmod(left, len(active))
        for i, w in enumerate(active):
            taken[w] = level + passes + (i < rest)
        break
    return taken


def plan_slot(counts: list[int], *, rank: int, world_size: int, worker: int, num_workers: int,
              batch_size: int, seed: int = 0, epoch: int = 0, shuffle: bool = False, node_rank: int | None = None,
              num_nodes: int = 1) -> SlotPlan:
    """The shard segments and batch count of one (rank, worker) for one epoch (pure, deterministic).

    ``node_rank`` None: the global split, ``rank`` of ``world_size`` over all shards. Given: the node split,
    ``rank`` of ``world_size`` is the local rank of the node's ranks, over node ``node_rank``'s shards only, and
    the batch count is :func:`node_batches_per_rank`."""
    num_workers = max(1, num_workers)
    order = shard_order(len(counts), seed, epoch, shuffle, node_rank, num_nodes)
    total = sum(counts[i] for i in order)
    nb = split_batches(counts, batch_size, world_size=world_size, node_rank=node_rank, num_nodes=num_nodes)
    lo, hi = rank * total // world_size, (rank + 1) * total // world_size
    # worker w yields nb_w batches; the rank's spare samples are spread evenly for the shuffle to drop
    nbw = worker_batches(nb, num_workers)
    spare = (hi - lo) - nb * batch_size
    sizes = [nbw[w] * batch_size + spare // num_workers + (w < spare % num_workers) for w in range(num_workers)]
    start = lo + sum(sizes[:worker])
    stop = start + sizes[worker]
    segments = []
    pos = 0
    for shard in order:
        n = counts[shard]
        a, b = max(start, pos), min(stop, pos + n)
        if a < b:
            segments.append(Segment(shard, a - pos, b - pos))
        pos += n
    return SlotPlan(tuple(segments), nbw[worker])



def resume_slot(counts: list[int], batch_size: int, split: dict[str, Any], start_batch: int, worker: int,
                num_workers: int, per_sample: bool) -> tuple[int, int]:
    """``(slot, skip)``: the part of the epoch DataLoader worker ``worker`` reads when the iteration starts
    at batch ``start_batch``, and how many samples of that part the first ``start_batch`` batches hold.

    A slot is a worker's share of the epoch (its plan, its shuffle); without a resume, worker ``w`` reads
    slot ``w``. The DataLoader asks worker 0 first on every iteration, so a resume rotates the roles:
    worker 0 takes the slot whose item comes next in the uninterrupted order, worker 1 the one after,
    and the passes over the workers then follow that order exactly (:func:`items_taken`). ``split`` is
    :func:`split_of`; ``per_sample``: the workers yield one item per sample (``worker_batching`` off).
    """
    B = batch_size
    nbw = worker_batches(split_batches(counts, B, **split), num_workers)
    if per_sample:  # one item per sample; the main process makes batches of B consecutive items
        items, per_item, taken = [n * B for n in nbw], 1, items_taken([n * B for n in nbw], start_batch * B)
    else:
        items, per_item, taken = nbw, B, items_taken(nbw, start_batch)
    open_slots = [s for s, n in enumerate(items) if taken[s] < n]
    first = 0
    if open_slots:  # the next item is the first open slot of the lowest pass still open
        low = min(taken[s] for s in open_slots)
        first = next(s for s in open_slots if taken[s] == low)
    slot = (first + worker) % len(items)
    return slot, taken[slot] * per_item


def crop_rng(seed: int, epoch: int, shard: int, key: str) -> random.Random:
    """The RNG of one training sample's crop and flip: a function of (seed, epoch, shard index, key) only.

    The shard index keeps samples apart whose keys repeat across shards. Seeding from a BLAKE2b digest
    (~6 us per sample, against milliseconds to decode one) works for any key, surrogates included.
    """
    text = f"gpufeed-crop-{seed}-{epoch}-{shard}-{key}".encode("utf-8", "surrogatepass")
    return random.Random(int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "little"))


def shuffle_rng(seed: int, epoch: int, rank: int, slot: int) -> random.Random:
    """The RNG of the shuffle buffer of one (rank, worker slot) in one epoch."""
    return random.Random(f"gpufeed-samples-{seed}-{epoch}-{rank}-{slot}")
