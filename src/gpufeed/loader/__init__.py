"""The loader shared by ``tune`` and ``train`` (docs/design.md §3): shard set -> uint8 batches.

How an epoch is split. The manifest's shards are put in epoch order (a seeded permutation for
training, identical on every rank) and read as one sequence of ``num_samples`` samples. Rank ``r`` of
``W`` owns the contiguous range ``[r*N//W, (r+1)*N//W)`` of that sequence and splits it into
contiguous sub-ranges, one per DataLoader worker. With shards in multiples of ranks x workers
(``gpufeed shard --multiple-of``) every range is a whole number of shards; otherwise the ranges
start/stop inside a shard, so every sample still goes to exactly one (rank, worker) and no rank is
ever short. Every rank yields exactly ``len(loader) = (N // W) // batch_size`` batches; each worker
yields a fixed share of them and stops, so DDP never waits on an uneven tail. Samples beyond that
(fewer than ``W x batch_size`` plus the per-worker rounding) are dropped, randomly for training since
they are the last ones out of the shuffle buffer. Corrupt samples skipped under ``on_error = "skip"``
are replaced by reading on (a worker re-reads its range if it must), never by a short rank.
That is ``shard_split = "global"``: over the epochs every node reads every shard. With ``shard_split = "node"``
node ``n`` of ``M`` owns the fixed shards ``i % M == n`` (:func:`gpufeed.core.world.node_shards`, also what ``gpufeed
stage --num-nodes`` copies); each epoch only those are put in a seeded order (seed, epoch, node) and split among
the node's ``L`` local ranks and their workers as above (``r`` is the local rank). Every rank of every node
yields ``min over nodes of (node samples // L) // batch_size`` batches (from the manifest's counts, the same on
every node); nodes holding more samples drop the rest, and local rank 0 warns once when that is more than
:data:`NODE_IMBALANCE_WARN` of the set beyond what the global split drops. Only the node's own shards must be
present; a set staged for one node is refused under the global split.

What is read is checked against the manifest: a shard that ends before its promised sample count
(a 0-byte shard, a shard cut at a member boundary, a manifest count too high) or holds more samples than
promised is a :class:`DataError` under ``on_error = "raise"``; under ``"skip"`` every sample lost is
counted (``num_skipped``: a corrupt sample counts 1, an unreadable rest of a segment counts each of its
samples, surplus samples count each), and samples re-read to fill a worker's quota are counted apart
(``num_repeated``). Images larger than ``max_pixels`` are refused from their header, before decoding.
That the shard is the manifest's is checked too (``[loader] check``, docs/design.md §3): a shard of another size
(local: fstat; URL: the size its store reports) is refused before it is read, and one whose size or mtime changes while it is read from that sample on; a
shard read to its end must have the manifest's ``keys_sha256`` (the digest of its key sequence) and, with
``check = "sha256"``, its sha256 (then each shard is streamed whole and hashed the first time a process reads it to
its end). Under ``"skip"`` the promised samples are counted: all of a size mismatch, the rest after a change, the
whole range of a key or sha256 mismatch (what went out came from another shard).
A data error met in a DataLoader worker reaches the main process as one sentence (shard, member, reason).

Randomness. The shuffle buffer draws from one RNG per (seed, epoch, rank, worker slot). A training sample's
crop and flip draw from its own RNG seeded by (seed, epoch, shard, key) (:func:`crop_rng`), so they do not
depend on the worker layout or on the sample's position in the stream.

Resume without replay. ``set_epoch(epoch, start_batch=k)`` makes the next iteration yield only batches
``k..len-1`` of the epoch, the same batches an uninterrupted iteration yields from there: each worker works
out how many of its own samples the first ``k`` batches took (in-order DataLoader iteration takes the
workers' items round-robin, skipping exhausted ones: :func:`items_taken`) and passes over that many without
decoding them; as the DataLoader always asks worker 0 first, the workers' slots (shares of the epoch) are
rotated so that the interleaving continues where it stopped (:meth:`ShardStream.resume_slot`). To lose the
same samples the first pass lost (``on_error = "skip"``), the skipped part applies the checks that need no
pixel decode: the label, an image member, PIL reading the image header, and ``max_pixels``. Residual case:
an image whose header is valid but whose pixel data fails to decode (a truncated JPEG body, say) passes
these checks, so it counts as delivered and that worker's remaining batches start one sample later than in
the uninterrupted epoch (the sample left over at the end of its quota is dropped with the spare ones); the
batch count stays right, but that sample is missing from ``num_skipped`` and the batches are no longer
bit-identical. Losses the checks do find in the skipped part are counted in ``num_skipped`` of the resumed
loader (the first ``start_batch`` batches' losses, as the uninterrupted loader counted them).
:class:`LoaderPosition` is what a checkpoint stores; it is only valid for the same shard set, seed,
batch size, shuffle buffer, number of workers, world size and shard split (and node count).

The per-sample work (decode, crop, resize, flip) is in :mod:`gpufeed.loader.decode`. Batches are built inside
the workers directly into a shared-memory ``[B, S, S, 3]`` uint8 tensor and handed out as the
``[B, 3, S, S]`` view (channels-last memory) with one IPC message per batch.

Remote shards. A set named by a URL (http, https, s3, gs) or a ``pipe:`` command is read through
:func:`gpufeed.shardset.source.open_shard`: a URL shard is streamed in byte ranges, ``remote_streams`` requests in
flight per worker, never downloaded whole and never read past the manifest's byte size. A worker whose segment
starts mid-shard still streams that shard from byte 0 and passes over the samples before its segment, so with
many workers or ranks per shard each reads the prefix it skips (neither the manifest nor index.parquet records
member byte offsets); shards in multiples of ranks x workers avoid it.

Security: local shards are opened by the loader itself by path. Only what the user typed is ever a URL or a shell
command: the set's location (a folder URL, manifest URL, brace pattern or ``pipe:`` command) and ``manifest_file``.
A shard name or ``root`` from a manifest (data) is only ever a URL-quoted path component joined under the user's
base URL (:func:`gpufeed.shardset.source.open_set`); it never becomes a URL scheme or a command (webdataset's
``gopen`` runs ``pipe:`` names as shell commands); a ``pipe:`` pattern's commands are the user's own (each one's
last word must be the manifest's shard name, in order). Shards, plain ``.tar`` and
gzip-compressed, are read by :mod:`gpufeed.shardset.tar` (every header size and offset validated, every member
read capped at ``shardset.tar.MAX_MEMBER_BYTES``); webdataset's readers and decoders are not used. Only image
members (``shardset.keys.READ_IMAGE_EXTENSIONS``) and the label member the manifest's label source names
(``.cls``, ``.txt`` or ``.json``) are read at all, labels follow :func:`gpufeed.shardset.manifest.read_label`, and
nothing is unpickled.
"""

from __future__ import annotations

import hashlib
import math
import multiprocessing
import os
import random
import sys
import tarfile
import zlib
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any, Iterator

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from gpufeed.loader import decode as dec
from gpufeed.config import LoaderConfig
from gpufeed.core.errors import DataError, GpufeedError, one_line
from gpufeed.shardset.manifest import DEFAULT_LABEL_SOURCE, Manifest, label_member, read_label, shard_root
from gpufeed.shardset.keys import READ_IMAGE_EXTENSIONS
from gpufeed.shardset.source import ShardSet, SourceError, is_pipe, is_remote, open_set, open_shard, remote_size
from gpufeed.shardset.tar import ShardRead, file_problem, iter_samples
from gpufeed.core.world import World, node_shards

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)


def _read_extensions(label: str) -> frozenset[str]:
    """The member extensions the loader reads for a manifest's label source: the images and the label member."""
    return frozenset((*READ_IMAGE_EXTENSIONS, label_member(label)))


_READ_EXTENSIONS = _read_extensions(DEFAULT_LABEL_SOURCE)
"""What the loader reads from a set labelled by ``.cls`` members (the default label source)."""


# --------------------------------------------------------------------------- the epoch plan


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


# --------------------------------------------------------------------------- batches


@dataclass
class EncodedBatch:
    """A host batch for ``decode = "gpu"``: JPEG bytes to decode on the device, plus what the CPU decoded.

    ``cpu_images`` [B, S, S, 3] holds the samples the device cannot decode (PNG, WebP, CMYK JPEG);
    rows listed in ``index`` are filled by :meth:`ShardLoader.to_device` from ``data``.
    """

    data: list[bytes]
    """Encoded JPEG bytes of the device-decoded samples while the batch is built (empty once packed)."""
    index: list[int]
    """Batch rows of the device-decoded samples."""
    boxes: list[tuple[float, float, float, float]]
    """Crop boxes (left, top, right, bottom) in stored pixels, one per device-decoded sample."""
    flips: list[bool]
    cpu_images: torch.Tensor
    size: int
    blob: torch.Tensor | None = None
    """All encoded bytes in one uint8 tensor (one shared-memory block per batch instead of one per sample)."""
    lengths: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.cpu_images.shape[0]

    @property
    def num_encoded(self) -> int:
        return len(self.index)

    def pack(self) -> "EncodedBatch":
        if self.data:
            self.lengths = [len(d) for d in self.data]
            self.blob = torch.frombuffer(bytearray(b"".join(self.data)), dtype=torch.uint8)
            self.data = []
        return self

    def chunks(self) -> list[torch.Tensor]:
        """The encoded images as uint8 1-D tensors (views of ``blob``)."""
        if self.blob is None:
            return [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in self.data]
        return list(torch.split(self.blob, self.lengths))


def _text(value: object) -> str:
    """``value`` as text for a one-line message: names from data may hold newlines or control characters."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def _reason(exc: BaseException) -> str:
    """``Type: message`` of a reading error, on one line (webdataset appends its stream objects to ``args``)."""
    msg = str(exc.args[0]) if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
    msg = msg.split(" @ <", 1)[0]  # webdataset's tar_file_iterator appends " @ <stream repr>"
    return _text(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)


_READ_ERRORS = (OSError, EOFError, ValueError, tarfile.TarError, zlib.error)
"""What reading a malformed shard raises: shardset.tar.TarFormatError (a ValueError), tarfile and gzip errors."""


class _Tally:
    """Samples a worker lost (corrupt, unreadable or surplus) in the pass that counts them."""

    def __init__(self) -> None:
        self.lost = 0


class _ShardMismatch(Exception):
    """The shard file is not the one the manifest lists (another size), or it changed while it was read."""


class _WorkerFailure:
    """What a worker yields instead of a batch after a data error: the one-sentence message.

    The main process raises it as a :class:`DataError`; raising inside the worker would reach the user
    as torch's re-raised worker traceback.
    """

    def __init__(self, message: str):
        self.message = message


def crop_rng(seed: int, epoch: int, shard: int, key: str) -> random.Random:
    """The RNG of one training sample's crop and flip: a function of (seed, epoch, shard index, key) only.

    The shard index keeps samples apart whose keys repeat across shards. Seeding from a BLAKE2b digest
    (~6 us per sample, against milliseconds to decode one) works for any key, surrogates included.
    """
    text = f"gpufeed-crop-{seed}-{epoch}-{shard}-{key}".encode("utf-8", "surrogatepass")
    return random.Random(int.from_bytes(hashlib.blake2b(text, digest_size=16).digest(), "little"))


@dataclass(frozen=True)
class LoaderPosition:
    """Where a rank stands in its epochs: ``batches_consumed`` batches of ``epoch`` were used.

    What a checkpoint stores to resume with :meth:`ShardLoader.resume` (no replay). :meth:`from_dict`
    validates a stored one: checkpoints are untrusted input.
    """

    epoch: int
    batches_consumed: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    @classmethod
    def from_dict(cls, obj: Any) -> "LoaderPosition":
        if not isinstance(obj, dict):
            raise DataError(f"loader position must be a mapping, got {type(obj).__name__}")
        vals = {}
        for name in ("epoch", "batches_consumed"):
            v = obj.get(name)
            if type(v) is not int or not 0 <= v < 2**62:
                raise DataError(f"loader position {name} must be a non-negative integer, got {_text(repr(v))[:80]}")
            vals[name] = v
        return cls(**vals)




class ShardStream(IterableDataset):
    """One epoch of one rank: each DataLoader worker reads its planned segments and yields batches."""

    def __init__(self, paths: list[str], counts: list[int], classes: list[str], cfg: LoaderConfig, world: World,
                 train: bool, epoch_value: Any, start_value: Any, label: str = DEFAULT_LABEL_SOURCE,
                 sizes: list[int] | None = None, keys: list[str | None] | None = None,
                 sha256: list[str | None] | None = None):
        self.paths = paths
        """One per shard: an absolute local path, or a URL / ``pipe:`` command (:mod:`gpufeed.shardset.source`)."""
        self.counts = counts
        self.sizes = sizes
        """The manifest's byte size of each shard (a remote shard is read up to it, never past; a local one of
        another size is refused before it is read)."""
        self.keys = keys
        """The manifest's ``keys_sha256`` of each shard (None: not recorded), compared when a shard is read to its end."""
        self.sha256 = sha256
        """The manifest's ``sha256`` of each shard, compared with ``cfg.check = "sha256"``."""
        self._hashed: set[int] = set()
        """Shards whose sha256 this process has checked (each is hashed once per process, the first time it is
        read to its end)."""
        self.classes = list(classes)
        self.class_index = {c: i for i, c in enumerate(classes)}
        self.label = label
        """The manifest's label source (``cls``, ``txt``, ``json:FIELD``)."""
        self.read_extensions = _read_extensions(label)
        self.cfg = cfg
        self.world = world
        self.train = train
        self.epoch_value = epoch_value
        self.start_value = start_value
        """Batches of the epoch the next iteration passes over without decoding (see ShardLoader.set_epoch)."""
        self.per_sample = not cfg.worker_batching
        self.fast_tar = True
        """Read plain .tar shards with the lean seeking reader; False = the one-pass stream reader of gzip shards
        (``shardset.tar.TarPass``) for every shard."""

    # ------------------------------------------------------------------ reading

    def _refuse(self, message: str, lost: int, tally: _Tally) -> None:
        """Apply ``on_error`` to ``lost`` samples: raise a one-line DataError, or count them."""
        if self.cfg.on_error == "raise":
            raise DataError(message.replace("\n", " "))
        tally.lost += lost

    def _read_segments(self, segments: tuple[Segment, ...], tally: _Tally) -> Iterator[dict]:
        for seg in segments:
            yield from self._read_segment(seg, tally)

    def _read_segment(self, seg: Segment, tally: _Tally) -> Iterator[dict]:
        """Samples ``[seg.start, seg.stop)`` of one shard, checked against the manifest's count.

        A segment that ends its shard (``stop`` == the manifest's count) holds back its last sample and reads
        on to the end of the file (only end-of-archive blocks and non-image keys there when the manifest is
        right) to notice surplus samples before the caller can stop. Each sample carries ``__ext__``, its
        image member's extension (None: no image data read), and ``__shard__``, the shard's index.
        """
        path = self.paths[seg.shard]
        promised = self.counts[seg.shard]
        planned = seg.stop - seg.start
        to_end = seg.stop >= promised
        total = [-1]  # the shard's sample count, set when the reader reaches its end
        got = surplus = 0
        last = None
        read = ShardRead(sha256=to_end and getattr(self.cfg, "check", "keys") == "sha256" and self.sha256 is not None
                         and self.sha256[seg.shard] is not None and seg.shard not in self._hashed)
        try:
            for sample in self._shard_samples(seg.shard, seg.start, None if to_end else seg.stop, total, read):
                if got >= planned:
                    surplus += 1  # not yielded: read on only to count them
                    continue
                sample["__ext__"] = next((e for e in READ_IMAGE_EXTENSIONS if e in sample), None)
                sample["__shard__"] = seg.shard
                got += 1
                if to_end and got == planned:
                    last = sample
                else:
                    yield sample
        except _ShardMismatch as exc:  # another file than the manifest's, or one rewritten while it was read
            lost = planned - got
            self._refuse(f"{exc}; {lost} of its samples {seg.start}..{seg.stop - 1} are not read", lost, tally)
        except SourceError as exc:  # a remote shard that cannot be read (after the retries, or not found)
            lost = planned - got
            self._refuse(f"{one_line(exc)}; {lost} of its samples {seg.start}..{seg.stop - 1} cannot be read",
                         lost, tally)
        except _READ_ERRORS as exc:
            if total[0] >= 0 and got < planned:  # read to its end, then found malformed there: say what is short
                self._refuse(f"shard {_text(path)} holds {total[0]} samples, the manifest says {promised} (and "
                             f"{_reason(exc)})", planned - got, tally)
            else:
                lost = planned - got  # a held-back last sample (counted in got) still goes out after this
                self._refuse(f"shard {_text(path)} is malformed ({_reason(exc)}); {lost} of its samples "
                             f"{seg.start}..{seg.stop - 1} cannot be read", lost, tally)
        else:
            if got < planned:
                self._refuse(f"shard {_text(path)} holds {total[0]} samples, the manifest says {promised}",
                             planned - got, tally)
            elif surplus:
                self._refuse(f"shard {_text(path)} holds {promised + surplus} samples, the manifest says {promised}",
                             surplus, tally)
            elif total[0] >= 0 and (why := self._other_samples(seg.shard, read)) is not None:  # read to its end
                # found at the end: what went out came from another shard than the manifest's, so none of the
                # segment's promised samples was read (the held-back last one is not handed out)
                last = None
                self._refuse(f"shard {_text(path)} {why}; its {planned} samples {seg.start}..{seg.stop - 1} are "
                             f"not the manifest's", planned, tally)
        if last is not None:
            yield last

    def _other_samples(self, shard: int, read: ShardRead) -> str | None:
        """After a shard was read to its end with the promised count: why it is not the manifest's shard (its key
        sequence, or with ``check = "sha256"`` its sha256, differs from the manifest's), or None."""
        want = self.keys[shard] if self.keys is not None else None
        if want is not None and read.keys.hexdigest() != want:
            return ("holds other samples than the manifest lists (its keys differ from the manifest's keys_sha256: "
                    "a copy of another shard, or a shard rewritten since the manifest was written)")
        if read.want_sha256:
            want = self.sha256[shard] if self.sha256 is not None else None
            if read.sha256 != want:
                return (f"has sha256 {str(read.sha256)[:16]}..., the manifest says {str(want)[:16]}... (check = "
                        f"\"sha256\")")
            self._hashed.add(shard)
        return None

    def _shard_samples(self, shard: int, start: int, stop: int | None, total: list[int],
                       read: ShardRead | None = None) -> Iterator[dict]:
        """Image samples ``[start, stop)`` (``stop`` None: to the end) of shard ``shard``, plain or
        gzip-compressed (:func:`gpufeed.shardset.tar.iter_samples`): a local file is opened by path; a URL or
        ``pipe:`` command through :func:`gpufeed.shardset.source.open_shard`, streamed from its start (a URL with
        ``cfg.remote_streams`` range requests in flight).

        A local shard whose size is not the manifest's raises :class:`_ShardMismatch` before anything is read, and
        so does one whose size or modification time changes while it is read (checked before each sample goes
        out: one ``fstat``). So does a URL shard whose size, as the store reports it (one size query), is not the
        manifest's; where none is reported it is never read past the manifest's size anyway, so a larger object
        reads as a shard without its end (refused), a shorter one as a stream cut short."""
        path = self.paths[shard]
        want = self.sizes[shard] if self.sizes is not None else None
        if is_remote(path):
            if want is not None and not is_pipe(path):
                try:  # one size query per shard read: the length the store reports
                    found = remote_size(path)
                except SourceError:  # no size reported (or not reachable): the stream read says what is wrong
                    found = None
                if found is not None and found != want:
                    raise _ShardMismatch(f"shard {_text(path)} is {found} bytes, the manifest says {want}: it is not "
                                         f"the shard the manifest lists (replaced or rewritten)")
            fileobj = open_shard(path, size=self.sizes[shard] if self.sizes is not None else None,
                                 streams=self.cfg.remote_streams)
            yield from iter_samples(path, self.read_extensions, READ_IMAGE_EXTENSIONS, start, stop, total,
                                    fileobj=fileobj, read=read)
            return
        f = open(path, "rb", buffering=1 << 20)
        try:
            first = os.fstat(f.fileno())
            if want is not None and first.st_size != want:
                raise _ShardMismatch(f"shard {_text(path)} is {first.st_size} bytes, the manifest says {want}: it is "
                                     f"not the shard the manifest lists (replaced or rewritten)")
        except BaseException:
            f.close()
            raise
        samples = iter_samples(path, self.read_extensions, READ_IMAGE_EXTENSIONS, start, stop, total,
                               stream=not self.fast_tar, fileobj=f, seekable=True, read=read)
        try:
            for sample in samples:
                now = os.fstat(f.fileno())
                if (now.st_size, now.st_mtime_ns) != (first.st_size, first.st_mtime_ns):
                    raise _ShardMismatch(f"shard {_text(path)} changed while it was read ({first.st_size} -> "
                                         f"{now.st_size} bytes, modified)")
                yield sample
        finally:
            samples.close()
            f.close()

    def _shuffled(self, items: Iterator[dict], rng: random.Random) -> Iterator[dict]:
        size = self.cfg.shuffle_buffer if self.train else 0
        if size <= 1:
            yield from items
            return
        buf: list[dict] = []
        for item in items:
            if len(buf) < size:
                buf.append(item)
                continue
            k = rng.randrange(size)
            buf[k], item = item, buf[k]
            yield item
        rng.shuffle(buf)
        yield from buf

    def _label(self, sample: dict) -> int:
        return read_label(sample, self.label, self.classes, self.class_index)

    # ------------------------------------------------------------------ iteration

    def __iter__(self):
        # num_workers == 0 runs this in the main process; ShardLoader keeps its torch ops on one thread
        if get_worker_info() is not None:  # workers run single-threaded already (worker_init)
            try:
                yield from self._iter()
            except GpufeedError as exc:  # hand the main process the sentence, not a worker traceback
                yield _WorkerFailure(str(exc))
            return
        yield from self._iter()

    def resume_slot(self, start_batch: int, worker: int, num_workers: int) -> tuple[int, int]:
        """``(slot, skip)``: the part of the epoch DataLoader worker ``worker`` reads when the iteration starts
        at batch ``start_batch``, and how many samples of that part the first ``start_batch`` batches hold.

        A slot is a worker's share of the epoch (its plan, its shuffle); without a resume, worker ``w`` reads
        slot ``w``. The DataLoader asks worker 0 first on every iteration, so a resume rotates the roles:
        worker 0 takes the slot whose item comes next in the uninterrupted order, worker 1 the one after,
        and the passes over the workers then follow that order exactly (:func:`items_taken`).
        """
        B = self.cfg.batch_size
        nbw = worker_batches(split_batches(self.counts, B, **split_of(self.cfg, self.world)), num_workers)
        if self.per_sample:  # one item per sample; the main process makes batches of B consecutive items
            counts, per_item, taken = [n * B for n in nbw], 1, items_taken([n * B for n in nbw], start_batch * B)
        else:
            counts, per_item, taken = nbw, B, items_taken(nbw, start_batch)
        open_slots = [s for s, n in enumerate(counts) if taken[s] < n]
        first = 0
        if open_slots:  # the next item is the first open slot of the lowest pass still open
            low = min(taken[s] for s in open_slots)
            first = next(s for s in open_slots if taken[s] == low)
        slot = (first + worker) % len(counts)
        return slot, taken[slot] * per_item

    def _crop_fn(self, sample: dict, epoch: int):
        if self.train:
            rng = crop_rng(self.cfg.seed, epoch, sample["__shard__"], sample.get("__key__"))
            return partial(dec.train_crop, rng=rng)
        return partial(dec.eval_crop, size=self.cfg.image_size, crop_ratio=getattr(self.cfg, "crop_ratio", 0.875))

    def _iter(self):
        info = get_worker_info()
        num_workers = info.num_workers if info is not None else 1
        slot, skip = self.resume_slot(int(self.start_value.value), info.id if info is not None else 0, num_workers)
        epoch = int(self.epoch_value.value)
        cfg = self.cfg
        plan = plan_slot(self.counts, **split_of(cfg, self.world), worker=slot, num_workers=num_workers,
                         batch_size=cfg.batch_size, seed=cfg.seed, epoch=epoch, shuffle=self.train)
        quota = plan.num_batches * cfg.batch_size
        if quota == 0 or skip >= quota:
            return
        rng = random.Random(f"gpufeed-samples-{cfg.seed}-{epoch}-{self.world.rank}-{slot}")  # the shuffle
        S, B = cfg.image_size, cfg.batch_size
        shared = info is not None
        gpu = cfg.decode == "gpu"
        tally = _Tally()
        lost_reported = repeated = repeated_reported = 0
        batch = None
        filled = 0
        done = 0
        passes = 0
        first_pass_lost = 0
        while done < quota:
            if passes == 1:  # re-reading the range: its lost samples were counted on the first pass
                first_pass_lost = tally.lost
            good_this_pass = 0
            for sample in self._shuffled(self._read_segments(plan.segments, tally), rng):
                if batch is None:
                    batch = self._new_batch(B, S, shared, gpu)
                images, labels, enc = batch
                row = 0 if self.per_sample else filled
                ext = sample["__ext__"]
                try:
                    if "__duplicate__" in sample:
                        raise ValueError(f"its .{sample['__duplicate__']} member appears twice (index and verify "
                                         f"report it; which one is meant is not known)")
                    label = self._label(sample)
                    if ext is None:
                        raise ValueError("no image data")
                    data = sample[ext]
                    if done < skip:  # before the resume point: the checks that need no decode, no pixels
                        dec.check_header(data, cfg.max_pixels)
                    elif gpu and self._gpu_prepare(data, ext, self._crop_fn(sample, epoch), enc, row):
                        pass
                    else:
                        dec.decode_into(data, ext, cfg.decode, self._crop_fn(sample, epoch), S, images[row],
                                        resize=getattr(cfg, "resize", "torch"), max_pixels=cfg.max_pixels)
                except Exception as exc:  # noqa: BLE001 - the policy decides
                    member = f"{sample.get('__key__')}.{ext}" if ext else sample.get("__key__")
                    self._refuse(f"corrupt sample {str(member)!r} in shard {_text(sample.get('__url__'))}: "
                                 f"{_reason(exc)}", 1, tally)
                    continue
                good_this_pass += 1
                done += 1
                if passes > 0:
                    repeated += 1  # every good sample of the range was used once on the first pass
                if done <= skip:  # skip is a whole number of this worker's items: no batch is half-filled
                    continue
                labels[row] = label
                filled += 1
                if self.per_sample or filled == B:
                    lost = tally.lost if passes == 0 else first_pass_lost
                    yield self._emit(batch, lost - lost_reported, repeated - repeated_reported)
                    lost_reported, repeated_reported = lost, repeated
                    batch, filled = None, 0
                if done >= quota:
                    break
            passes += 1
            if done < quota and good_this_pass == 0:
                raise DataError(
                    f"rank {self.world.rank} worker {slot}: no readable sample in its "
                    f"{plan.num_samples} planned samples (shards {sorted({s.shard for s in plan.segments})})"
                )

    def _new_batch(self, B: int, S: int, shared: bool, gpu: bool):
        n = 1 if self.per_sample else B
        images = torch.empty((n, S, S, 3), dtype=torch.uint8)
        if shared:
            images.share_memory_()  # the worker writes straight into the memory the main process receives
        labels = torch.empty((n,), dtype=torch.int64)
        enc = EncodedBatch([], [], [], [], images, S) if gpu else None
        return images.numpy(), labels.numpy(), enc

    def _emit(self, batch, skipped: int, repeated: int):
        """``(images, labels, skipped, repeated)``: the samples lost and re-read since the previous batch."""
        images, labels, enc = batch
        if enc is not None:
            return enc.pack(), torch.from_numpy(labels), skipped, repeated
        return torch.from_numpy(images).permute(0, 3, 1, 2), torch.from_numpy(labels), skipped, repeated

    def _gpu_prepare(self, data: bytes, ext: str, crop_fn, enc: EncodedBatch, row: int) -> bool:
        """Record a device-decodable JPEG (bytes + crop) in ``enc``; False sends the sample to the CPU path."""
        if ext not in dec.JPEG_EXTENSIONS:
            return False
        ok, w, h = dec.is_gpu_decodable(data, self.cfg.max_pixels)
        if not ok:
            return False
        crop = crop_fn(w, h)
        l, t, r, b = crop.box
        box = (float(l), float(t), float(r), float(b))
        enc.data.append(data)
        enc.index.append(row)
        enc.boxes.append(box)
        enc.flips.append(crop.flip)
        return True


def _worker_init(worker_id: int) -> None:
    torch.set_num_threads(1)


# --------------------------------------------------------------------------- the loader


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

    Resume: :attr:`position` says how far the current iteration got; ``resume(position)`` (or
    ``set_epoch(epoch, start_batch)``) makes the next iteration start there without decoding what it passes
    over (see the module docstring). Under ``num_workers = 0`` the per-sample torch ops run on one intra-op
    thread while a batch is made (tiny ops on an OpenMP pool burn ~10x the CPU); the caller's setting is
    restored before each batch is handed out.
    """

    def __init__(self, shards: str | Path, cfg: LoaderConfig, world: World, *, train: bool = True, epoch: int = 0,
                 manifest: Manifest | None = None, manifest_file: str | Path | None = None):
        self.cfg = cfg
        self.world = world
        self.train = train
        if manifest is not None:  # the caller read it already: the shards are where it says, next to `shards`
            root = shard_root(manifest, shards)
            shard_set = ShardSet(manifest, [str(p.absolute()) for p in manifest.shard_paths(root)], str(shards),
                                 False)
        else:
            shard_set = open_set(shards, manifest=manifest_file)
        self.manifest = shard_set.manifest
        self.shard_set = shard_set
        # absolute local paths (a name like "-" stays a file name wherever it is used), or user-typed URLs
        self.paths = list(shard_set.urls)
        counts = [s.num_samples for s in self.manifest.shards]
        split = split_of(cfg, world)
        self.shards_here = _own_shards(str(shards), self.manifest, world, split)
        """Indices of the shards this rank's node reads: all of them under the global split."""
        unreadable = [] if shard_set.remote else [  # a set's shards: no link out of its folder
            (self.paths[i], why) for i in self.shards_here
            if (why := file_problem(self.paths[i], os.path.dirname(self.paths[i])))]
        if unreadable:
            whose = "" if split.get("node_rank") is None else f" owned by node {world.node_rank}"
            raise DataError(f"{len(unreadable)} shard(s){whose} of the manifest cannot be read, e.g. "
                            f"{unreadable[0][0]} {unreadable[0][1]}")
        self.num_batches = split_batches(counts, cfg.batch_size, **split)
        self.warnings: list[str] = []
        """Findings that do not stop the loader: local rank 0 prints them to stderr when it is first iterated (a
        loader built only to check the set, as the launcher does, prints nothing)."""
        self._warned = False
        if self.num_batches == 0:
            if split.get("node_rank") is None:
                raise DataError(
                    f"{sum(counts)} samples are not enough for one batch of {cfg.batch_size} on each of "
                    f"{world.world_size} rank(s); lower batch_size"
                )
            least = min(range(world.num_nodes), key=lambda n: sum(counts[i] for i in node_shards(len(counts), n,
                                                                                                   world.num_nodes)))
            raise DataError(
                f"node {least}'s {sum(counts[i] for i in node_shards(len(counts), least, world.num_nodes))} samples "
                f"(shard_split = \"node\") are not enough for one batch of {cfg.batch_size} on each of its "
                f"{world.local_world_size} rank(s); lower batch_size"
            )
        if split.get("node_rank") is not None:
            self.warnings += _imbalance(counts, world, cfg.batch_size, self.num_batches)
        if cfg.decode == "simplejpeg":
            dec._import_simplejpeg()
        self.num_skipped = 0
        self.num_repeated = 0
        self._epoch = multiprocessing.get_context().Value("q", epoch, lock=False)
        self._start = multiprocessing.get_context().Value("q", 0, lock=False)
        self._consumed = 0
        self._dataset = ShardStream(self.paths, counts, self.manifest.classes, cfg, world, train, self._epoch,
                                    self._start, label=self.manifest.label,
                                    sizes=[s.bytes for s in self.manifest.shards],
                                    keys=[s.keys_sha256 for s in self.manifest.shards],
                                    sha256=[s.sha256 for s in self.manifest.shards])
        nw = cfg.num_workers
        self._pin = bool(cfg.pin_memory and world.is_cuda and torch.cuda.is_available())
        self._loader = DataLoader(
            self._dataset, batch_size=None, num_workers=nw, pin_memory=self._pin and cfg.worker_batching,
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
        start = int(self._start.value)
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
        finally:
            # every worker has read the start by now, unless the caller left early (then that iteration is dropped)
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
            for item in self._loader:
                yield self._count(item)
        else:
            yield from self._batch_in_main()

    def _count(self, item) -> tuple[Any, torch.Tensor]:
        """Add a worker item's counters; raise a worker's data error here, as the sentence it sent."""
        if isinstance(item, _WorkerFailure):
            raise DataError(item.message)
        images, labels, skipped, repeated = item
        self.num_skipped += int(skipped)
        self.num_repeated += int(repeated)
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
                    out = _merge_encoded(rows, S)
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
        """Host batch -> (uint8 [B, 3, S, S], int64 [B]) on ``device``; decodes an :class:`EncodedBatch` there."""
        images, labels = batch
        labels = labels.to(device, non_blocking=non_blocking)
        if isinstance(images, EncodedBatch):
            return gpu_decode(images, device, non_blocking=non_blocking), labels
        return images.to(device, non_blocking=non_blocking), labels


def _merge_encoded(rows: list[EncodedBatch], S: int) -> EncodedBatch:
    out = EncodedBatch([], [], [], [], torch.empty((len(rows), S, S, 3), dtype=torch.uint8), S)
    for i, r in enumerate(rows):
        out.cpu_images[i] = r.cpu_images[0]
        for d, b, f in zip(r.chunks(), r.boxes, r.flips):
            out.data.append(d.numpy().tobytes())
            out.index.append(i)
            out.boxes.append(b)
            out.flips.append(f)
    return out.pack()


CROP_MARGIN = 1
"""Pixels kept around a crop box (after rounding it out to whole pixels) when ``gpu_decode`` cuts each decoded
image to its crop: roi_align's bilinear samples of the box read at most one pixel beyond it."""


def crop_window(box: tuple[float, float, float, float], width: int, height: int) -> tuple[int, int, int, int]:
    """``(x0, y0, x1, y1)``: the pixels of a ``width x height`` image that roi_align (``aligned=True``) reads
    for ``box`` - the box rounded out to whole pixels plus :data:`CROP_MARGIN`, clipped to the image (never empty)."""
    l, t, r, b = box
    x0 = min(max(math.floor(l) - CROP_MARGIN, 0), width - 1)
    y0 = min(max(math.floor(t) - CROP_MARGIN, 0), height - 1)
    x1 = max(min(math.ceil(r) + CROP_MARGIN, width), x0 + 1)
    y1 = max(min(math.ceil(b) + CROP_MARGIN, height), y0 + 1)
    return x0, y0, x1, y1


def crop_buffer_shape(windows: list[tuple[int, int, int, int]]) -> tuple[int, int]:
    """``(height, width)`` of the padded buffer ``gpu_decode`` hands roi_align: the largest crop window,
    so its size is bounded by the crop boxes (each side at most the box's + 2 + 2 x CROP_MARGIN), not by the images."""
    return max(y1 - y0 for _, y0, _, y1 in windows), max(x1 - x0 for x0, _, x1, _ in windows)


def gpu_decode(batch: EncodedBatch, device: str | torch.device, non_blocking: bool = True) -> torch.Tensor:
    """``torchvision.io.decode_jpeg`` of the batch's JPEGs on ``device``, then crop + resize + flip there.

    One batched decode call; then, per image, its crop window (:func:`crop_window`) is copied into a zero
    buffer of :func:`crop_buffer_shape` (the window's last row/column replicated once into the padding, so
    bilinear samples at an image's right/bottom edge do not blend in zeros) and the decoded image is freed.
    One ``torchvision.ops.roi_align`` over that buffer (``aligned=True``, adaptive sampling: each output
    pixel averages ``ceil(scale)``^2 bilinear samples of its bin, an antialiased downscale close to PIL's
    bilinear filter) resizes every crop to ``S x S``, then flips and the uint8 cast are batched. Memory
    besides the decoded JPEGs is bounded by the crops: ``K x 3 x window`` uint8 and float32.
    """
    from torchvision.io import ImageReadMode, decode_jpeg
    from torchvision.ops import roi_align

    S = batch.size
    if batch.num_encoded < len(batch):  # some rows were decoded on the CPU (PNG, WebP, CMYK)
        out = batch.cpu_images.to(device, non_blocking=non_blocking).permute(0, 3, 1, 2)
        if not batch.num_encoded:
            return out
    else:
        out = torch.empty((len(batch), S, S, 3), dtype=torch.uint8, device=device).permute(0, 3, 1, 2)
    decoded = decode_jpeg(batch.chunks(), mode=ImageReadMode.RGB, device=device)
    windows = [crop_window(box, int(img.shape[2]), int(img.shape[1])) for img, box in zip(decoded, batch.boxes)]
    hmax, wmax = crop_buffer_shape(windows)
    padded = torch.zeros((len(decoded), 3, hmax, wmax), dtype=torch.uint8, device=device)
    rois = []
    for k, (x0, y0, x1, y1) in enumerate(windows):
        h, w = y1 - y0, x1 - x0
        padded[k, :, :h, :w] = decoded[k][:, y0:y1, x0:x1]
        decoded[k] = None  # free the full image as soon as its window is copied
        if w < wmax:
            padded[k, :, :h, w] = padded[k, :, :h, w - 1]
        if h < hmax:
            padded[k, :, h, : min(w + 1, wmax)] = padded[k, :, h - 1, : min(w + 1, wmax)]
        l, t, r, b = batch.boxes[k]
        rois.append((k, l - x0, t - y0, r - x0, b - y0))
    del decoded
    rois_t = torch.tensor(rois, dtype=torch.float32).to(device)
    crops = roi_align(padded.to(torch.float32), rois_t, output_size=(S, S), spatial_scale=1.0, sampling_ratio=-1,
                      aligned=True)
    flips = torch.tensor(batch.flips, dtype=torch.bool).to(device)
    crops = torch.where(flips.view(-1, 1, 1, 1), crops.flip(-1), crops)
    crops = crops.round_().clamp_(0, 255).to(torch.uint8)
    out[torch.tensor(batch.index, dtype=torch.long).to(device)] = crops
    return out


NODE_IMBALANCE_WARN = 0.02
"""Under ``shard_split = "node"``: warn when stopping every rank at the smallest node's batch count leaves more
than this fraction of the set unread each epoch, beyond what the global split drops."""


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
                 epoch: int = 0, manifest_file: str | Path | None = None) -> ShardLoader:
    """The loader over a shard set for this rank (any spec :func:`gpufeed.shardset.source.open_set` takes: a
    folder, manifest.json, URL or brace pattern, with ``manifest_file`` its manifest); see :class:`ShardLoader`."""
    return ShardLoader(shards, cfg, world, train=train, epoch=epoch, manifest_file=manifest_file)


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
