"""The stages of one worker's epoch, torch-free (docs/design.md §3): read (with the manifest's count check) ->
shuffle -> decode under the ``on_error`` handler -> fill the quota (re-reading after losses) -> batch.

Each stage is a generator that takes an iterator and yields, as webdataset's stages with a ``handler``; the error
policy is the :class:`OnError` handler passed in, and a stage that must resume (:class:`Decode`, passing over a
resumed iteration's first samples without decoding them) holds its own small state.
"""

from __future__ import annotations

import random
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Callable, Iterator, Protocol, TypeVar

from gpufeed.core.errors import DataError, one_line
from gpufeed.loader.errors import READ_ERRORS, ShardMismatch, printable, reason
from gpufeed.loader.plan import Segment
from gpufeed.loader.reader import ShardReader
from gpufeed.shardset.keys import READ_IMAGE_EXTENSIONS
from gpufeed.shardset.source import SourceError

T = TypeVar("T")


class OnError:
    """The ``on_error`` policy as a handler: ``handler(message, lost)`` raises the message as a one-line
    :class:`DataError` (``"raise"``) or counts the ``lost`` samples in :attr:`lost` (``"skip"``)."""

    def __init__(self, policy: str):
        self.policy = policy
        self.lost = 0
        """Samples lost so far (corrupt, unreadable or surplus), one by one."""
        self.ahead = 0
        """Of :attr:`lost`, those a read-ahead stage (:class:`ThreadedDecode`) counted beyond the sample it hands
        out now: the sequential stages would count them later, so :func:`fill` leaves them out until then."""

    def __call__(self, message: str, lost: int) -> None:
        if self.policy == "raise":
            raise DataError(message.replace("\n", " "))
        self.lost += lost


def read_segments(segments: tuple[Segment, ...], reader: ShardReader, handler: OnError) -> Iterator[dict]:
    """The read stage: the samples of ``segments`` in order, each segment checked by :func:`read_segment`."""
    for seg in segments:
        yield from read_segment(seg, reader, handler)


def read_segment(seg: Segment, reader: ShardReader, handler: OnError) -> Iterator[dict]:
    """Samples ``[seg.start, seg.stop)`` of one shard, checked against the manifest's count.

    A segment that ends its shard (``stop`` == the manifest's count) holds back its last sample and reads
    on to the end of the file (only end-of-archive blocks and non-image keys there when the manifest is
    right) to notice surplus samples before the caller can stop. Each sample carries ``__ext__``, its
    image member's extension (None: no image data read), and ``__shard__``, the shard's index.
    """
    path = reader.paths[seg.shard]
    promised = reader.counts[seg.shard]
    planned = seg.stop - seg.start
    to_end = seg.stop >= promised
    total = [-1]  # the shard's sample count, set when the reader reaches its end
    got = surplus = 0
    last = None
    read = reader.new_read(seg.shard, to_end)
    try:
        for sample in reader.samples(seg.shard, seg.start, None if to_end else seg.stop, total, read):
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
    except ShardMismatch as exc:  # another file than the manifest's, or one rewritten while it was read
        lost = planned - got
        handler(f"{exc}; {lost} of its samples {seg.start}..{seg.stop - 1} are not read", lost)
    except SourceError as exc:  # a remote shard that cannot be read (after the retries, or not found)
        lost = planned - got
        handler(f"{one_line(exc)}; {lost} of its samples {seg.start}..{seg.stop - 1} cannot be read", lost)
    except READ_ERRORS as exc:
        if total[0] >= 0 and got < planned:  # read to its end, then found malformed there: say what is short
            handler(f"shard {printable(path)} holds {total[0]} samples, the manifest says {promised} (and "
                    f"{reason(exc)})", planned - got)
        else:
            lost = planned - got  # a held-back last sample (counted in got) still goes out after this
            handler(f"shard {printable(path)} is malformed ({reason(exc)}); {lost} of its samples "
                    f"{seg.start}..{seg.stop - 1} cannot be read", lost)
    else:
        if got < planned:
            handler(f"shard {printable(path)} holds {total[0]} samples, the manifest says {promised}", planned - got)
        elif surplus:
            handler(f"shard {printable(path)} holds {promised + surplus} samples, the manifest says {promised}",
                    surplus)
        elif total[0] >= 0 and (why := reader.other_samples(seg.shard, read)) is not None:  # read to its end
            # found at the end: what went out came from another shard than the manifest's, so none of the
            # segment's promised samples was read (the held-back last one is not handed out)
            last = None
            handler(f"shard {printable(path)} {why}; its {planned} samples {seg.start}..{seg.stop - 1} are "
                    f"not the manifest's", planned)
    if last is not None:
        yield last


def shuffle(items: Iterator[T], size: int, rng: random.Random) -> Iterator[T]:
    """The shuffle stage: a buffer of ``size`` items (none when ``size`` <= 1) drawn from by ``rng``."""
    if size <= 1:
        yield from items
        return
    buf: list[T] = []
    for item in items:
        if len(buf) < size:
            buf.append(item)
            continue
        k = rng.randrange(size)
        buf[k], item = item, buf[k]
        yield item
    rng.shuffle(buf)
    yield from buf


class Decode:
    """The decode stage: each sample's label and image, under the ``on_error`` handler.

    Yields ``(label, decoded)`` per good sample. The first ``skip`` good samples (a resumed iteration's, already
    used) are only checked as far as no pixel decode is needed (``check``: the image header and ``max_pixels``)
    and yield ``decoded`` False; the stage counts them down across passes (:attr:`to_skip`). ``decode(sample, ext,
    data)`` decodes the image into the batch being built. A sample that fails costs the handler one sample.
    """

    def __init__(self, label: Callable[[dict], int], check: Callable[[bytes], None],
                 decode: Callable[[dict, str, bytes], None], handler: OnError, skip: int = 0):
        self.label = label
        self.check = check
        self.decode = decode
        self.handler = handler
        self.to_skip = skip
        """Good samples still to pass over without decoding."""

    def __call__(self, samples: Iterator[dict]) -> Iterator[tuple[int, bool]]:
        for sample in samples:
            ext = sample["__ext__"]
            passing = self.to_skip > 0
            try:
                label, data = self._checked(sample, ext)
                if passing:  # before the resume point: the checks that need no decode, no pixels
                    self.check(data)
                else:
                    self.decode(sample, ext, data)
            except Exception as exc:  # noqa: BLE001 - the policy decides
                self._lost(sample, ext, exc)
                continue
            if passing:
                self.to_skip -= 1
            yield label, not passing

    def _checked(self, sample: dict, ext: str | None) -> tuple[int, bytes]:
        """``(label, image bytes)`` of a sample, or the exception that makes it a lost sample."""
        if "__duplicate__" in sample:
            raise ValueError(f"its .{sample['__duplicate__']} member appears twice (index and verify "
                             f"report it; which one is meant is not known)")
        label = self.label(sample)
        if ext is None:
            raise ValueError("no image data")
        return label, sample[ext]

    def _lost(self, sample: dict, ext: str | None, exc: Exception) -> None:
        self.handler(f"corrupt sample {sample_name(sample, ext)}: {reason(exc)}", 1)


def sample_name(sample: dict, ext: str | None) -> str:
    """A sample as a loader error names it: ``'KEY.EXT' in shard PATH``."""
    member = f"{sample.get('__key__')}.{ext}" if ext else sample.get("__key__")
    return f"{str(member)!r} in shard {printable(sample.get('__url__'))}"


class ThreadedDecode(Decode):
    """The decode stage with ``threads`` images decoding at once in this process (``decode_threads`` > 1).

    ``decode_to(sample, ext, data, out)`` runs on a thread pool and writes the image into ``out``, one of
    ``2 x threads`` reused ``[S, S, 3]`` buffers (``buffer()`` makes one); the results are taken in the samples'
    order, and ``commit(out)`` copies each good one into the batch's next row. Everything else (the label and
    header checks, the resume's passing over, each loss reported to the handler) happens in order in the calling
    thread, so the samples, their order, the crops and the counts are those of :class:`Decode`.
    """

    def __init__(self, label: Callable[[dict], int], check: Callable[[bytes], None],
                 decode_to: Callable[[dict, str, bytes, object], None], commit: Callable[[object], None],
                 buffer: Callable[[], object], handler: OnError, threads: int, skip: int = 0):
        super().__init__(label, check, lambda *a: None, handler, skip)
        self.decode_to, self.commit = decode_to, commit
        self.reported = 0
        """Losses this stage reported (the rest of ``handler.lost`` was counted upstream)."""
        self.depth = 2 * threads
        self.free = [buffer() for _ in range(self.depth)]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="gpufeed-decode")

    def __call__(self, samples: Iterator[dict]) -> Iterator[tuple[int, bool]]:
        pending: deque = deque()
        done = False
        try:
            for sample in samples:
                if self.to_skip > 0:  # resume: nothing in flight before the first decoded sample
                    yield from super().__call__(iter((sample,)))
                    continue
                pending.append((*self._submit(sample), self._upstream()))
                if len(pending) >= self.depth:
                    yield from self._take(pending.popleft())
            while pending:
                yield from self._take(pending.popleft())
            done = True
        finally:  # left early (quota reached, an error): let the threads finish with the buffers
            wait([e[3] for e in pending if isinstance(e[3], Future)])
            self.free += [e[4] for e in pending if e[4] is not None]
            if not done:  # losses read ahead of the last sample handed out: the sequential stages never reach them
                self.handler.lost -= self.handler.ahead
            self.handler.ahead = 0

    def _upstream(self) -> int:
        return self.handler.lost - self.reported

    def _lost(self, sample: dict, ext: str | None, exc: Exception) -> None:
        self.reported += 1
        super()._lost(sample, ext, exc)

    def _submit(self, sample: dict) -> tuple:
        ext = sample["__ext__"]
        try:
            label, data = self._checked(sample, ext)
        except Exception as exc:  # noqa: BLE001 - reported in order, by _take
            return sample, ext, None, exc, None
        out = self.free.pop()
        return sample, ext, label, self.pool.submit(self.decode_to, sample, ext, data, out), out

    def _take(self, entry: tuple) -> Iterator[tuple[int, bool]]:
        sample, ext, label, job, out, upstream = entry
        try:
            if not isinstance(job, Future):
                raise job
            job.result()
            self.commit(out)
        except Exception as exc:  # noqa: BLE001 - the policy decides
            self._lost(sample, ext, exc)
            return
        finally:
            if out is not None:
                self.free.append(out)
        self.handler.ahead = self._upstream() - upstream  # counted upstream after this sample was read
        yield label, True

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def fill(one_pass: Callable[[], Iterator[T]], quota: int, handler: OnError,
         empty: str) -> Iterator[tuple[T, int, int]]:
    """The quota stage: ``quota`` items from passes over the worker's range, re-reading it while losses leave it
    short. Yields ``(item, lost, repeated)``: the samples lost so far as counted (a pass after the first re-reads
    the first pass's losses, so only the first pass's count) and the items re-read so far. A pass with no good
    item raises ``empty`` as a :class:`DataError`."""
    done = repeated = passes = first_pass_lost = 0
    while done < quota:
        if passes == 1:  # re-reading the range: its lost samples were counted on the first pass
            first_pass_lost = handler.lost
        good_this_pass = 0
        for item in one_pass():
            good_this_pass += 1
            done += 1
            if passes > 0:
                repeated += 1  # every good sample of the range was used once on the first pass
            yield item, handler.lost - handler.ahead if passes == 0 else first_pass_lost, repeated
            if done >= quota:
                break
        passes += 1
        if done < quota and good_this_pass == 0:
            raise DataError(empty)


class Rows(Protocol):
    """The batch being built: :class:`Decode`'s ``decode`` writes a sample into its next row."""

    def add(self, label: int) -> bool:
        """Record the next row's label; True when the batch is full."""

    def take(self, skipped: int, repeated: int):
        """The full batch, with the samples lost and re-read since the previous one; starts a new batch."""


def batch(items: Iterator[tuple[tuple[int, bool], int, int]], rows: Rows) -> Iterator:
    """The batch stage: the decoded items of :func:`fill` into ``rows``, each full batch out with the samples lost
    and re-read since the previous batch. Items passed over for a resume (``decoded`` False) are left out."""
    lost_reported = repeated_reported = 0
    for (label, decoded), lost, repeated in items:
        if not decoded:  # the skip is a whole number of this worker's items: no batch is half-filled
            continue
        if rows.add(label):
            yield rows.take(lost - lost_reported, repeated - repeated_reported)
            lost_reported, repeated_reported = lost, repeated
