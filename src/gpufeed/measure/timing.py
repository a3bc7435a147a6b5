"""Step timing on the device's own timeline, one code path for CUDA and CPU.

A :class:`Clock` makes *marks* on the device timeline and reads the time between two of them later:

- :class:`CudaClock`: a mark is a CUDA event recorded on the current stream. The device reaches it once
  all work enqueued before it is done *and* the host has recorded it, so the time between a mark made
  before ``next(loader)`` and one made after it is the time the device sat idle waiting for the batch:
  while the host waits with work still queued, the device is busy and that part is not counted.
  Events are read (``elapsed_time``) only after :meth:`Clock.sync` waits for the last one, which the
  trainer does at log steps and at the ends of the timed window, never per step.
- :class:`HostClock`: ``time.perf_counter`` readings. The CPU "device" runs the work synchronously, so
  the time the host waits for data is time the device is idle.

The trainer builds one :class:`StepMarks` per optimizer step (:meth:`StepMarks.fetch` around each
``next(loader)`` + copy, :meth:`StepMarks.compute` around each micro-batch's compute) and resolves it
after a sync into the step's seconds: (step, next wait, copy, compute, samples).

A :class:`Meter` holds one rank's timed window of one mode: the steps after the timing warm-up, the
wall-clock window (without the pauses for validation and checkpoints) and the telemetry over it, summed into
a :class:`~gpufeed.train.records.RankTiming` (docs/design.md §4).
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol

from gpufeed.measure.contention import Contention
from gpufeed.measure.telemetry import Telemetry
from gpufeed.core.world import World

MAX_TRACE_STEPS = 20_000
"""Steps of one mode whose spans are kept for trace.json (a long training run keeps its first ones)."""


@dataclass(frozen=True)
class RankTiming:
    """One rank's timed window of one mode (steps after the timing warm-up)."""

    rank: int
    num_steps: int
    num_samples: int
    wall_s: float
    step_s: float
    """Σ step time."""
    data_wait_s: float
    """Σ (next_wait_s + h2d_s)."""
    next_wait_s: float
    """Σ time the device sat idle while the host waited in next(loader)."""
    h2d_s: float
    """Σ host-to-device copy not overlapped with compute (loader.to_device)."""
    compute_s: float
    samples_per_s: float
    stall_pct: float
    window_rates: list[float]
    """samples/s of consecutive windows of log_every steps (--measure: of the mode's window steps)."""
    window_stalls: list[float] = field(default_factory=list)
    """Data stall % of the same windows."""
    cores_used: float | None = None
    """CPU cores this rank's process tree (incl. loader workers) kept busy."""
    read_bytes: int = 0
    rss_max_bytes: int = 0
    gpu: dict[str, Any] = field(default_factory=dict)
    node: int = 0
    """The rank's node (torchrun's GROUP_RANK)."""
    host: str = ""
    """The node's host name."""
    contention: Contention | None = None
    """What the rest of the machine did over the window (:mod:`gpufeed.measure.contention`)."""


class Clock(Protocol):
    def mark(self) -> Any:
        """A point on the device timeline, reached when the work enqueued before it is done."""

    def sync(self) -> None:
        """Wait until the device has reached every mark made so far (then :meth:`elapsed` may read them)."""

    def elapsed(self, a: Any, b: Any) -> float:
        """Seconds on the device timeline from mark ``a`` to mark ``b`` (both reached)."""


class HostClock:
    """The CPU device: marks are host timestamps (``now``, perf_counter unless a test injects one)."""

    def __init__(self, now: Callable[[], float] = time.perf_counter) -> None:
        self.now = now

    def mark(self) -> float:
        return self.now()

    def sync(self) -> None:
        pass

    def elapsed(self, a: float, b: float) -> float:
        return b - a


class CudaClock:
    """Marks are timing events recorded on the current CUDA stream of ``device``."""

    def __init__(self, device: Any) -> None:
        import torch

        self.torch, self.device = torch, device
        self._last: Any = None

    def mark(self) -> Any:
        e = self.torch.cuda.Event(enable_timing=True)
        e.record(self.torch.cuda.current_stream(self.device))
        self._last = e
        return e

    def sync(self) -> None:
        if self._last is not None:
            self._last.synchronize()

    def elapsed(self, a: Any, b: Any) -> float:
        return a.elapsed_time(b) / 1000.0


StepTimes = tuple[float, float, float, float, int]
"""(step_s, next_s, h2d_s, compute_s, samples) of one step, in device time."""


@dataclass
class StepMarks:
    """The marks of one step, resolved into :data:`StepTimes` once the clock has synced."""

    clock: Clock
    start: Any = None
    waits: list[tuple[Any, Any]] = field(default_factory=list)
    copies: list[tuple[Any, Any]] = field(default_factory=list)
    computes: list[tuple[Any, Any]] = field(default_factory=list)
    end: Any = None
    samples: int = 0
    origin: Any = None
    """A mark of the mode's timed window (set by :meth:`Meter.add`): the step's spans are placed from it."""
    spans: list[tuple[str, float, float]] = field(default_factory=list)
    """(kind, start s from ``origin``, seconds) of the step and each of its waits, copies and computes, once
    resolved with an origin: the rows of trace.json (:mod:`gpufeed.measure.trace`)."""
    _times: StepTimes | None = None

    def begin(self) -> "StepMarks":
        self.start = self.clock.mark()
        return self

    def fetch(self, it: Iterator[Any], to_device: Callable[[Any], Any]) -> Any:
        """``to_device(next(it))`` with a mark before and after the wait and after the copy."""
        w0 = self.clock.mark()
        batch = next(it)
        w1 = self.clock.mark()
        out = to_device(batch)
        c1 = self.clock.mark()
        self.waits.append((w0, w1))
        self.copies.append((w1, c1))
        return out

    def compute(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` (enqueue the compute) between two marks."""
        c0 = self.clock.mark()
        out = fn()
        self.computes.append((c0, self.clock.mark()))
        return out

    def finish(self, samples: int) -> "StepMarks":
        self.end = self.clock.mark()
        self.samples = samples
        return self

    def times(self) -> StepTimes:
        """The step's seconds; the clock must have synced since :meth:`finish` (resolved once, then cached)."""
        if self._times is None:
            el = self.clock.elapsed
            self._times = (el(self.start, self.end), sum(el(a, b) for a, b in self.waits),
                           sum(el(a, b) for a, b in self.copies), sum(el(a, b) for a, b in self.computes),
                           self.samples)
            if self.origin is not None:
                o = self.origin
                self.spans = [("step", el(o, self.start), self._times[0])]
                for kind, pairs in (("data wait", self.waits), ("copy", self.copies), ("compute", self.computes)):
                    self.spans += [(kind, el(o, a), el(a, b)) for a, b in pairs]
                self.origin = None
            self.start = self.end = None  # drop the events
            self.waits, self.copies, self.computes = [], [], []
        return self._times


def resolve(clock: Clock, steps: list[StepMarks]) -> list[StepTimes]:
    """One sync, then every step's seconds."""
    clock.sync()
    return [s.times() for s in steps]


class Meter:
    """Accumulates one rank's step timings after the warm-up; runs telemetry over the timed window.

    Steps arrive as :class:`StepMarks` (:meth:`add`) and are read after the clock syncs (:meth:`settle`, at
    log steps; :meth:`finish`). The wall-clock window starts and ends with a sync, so that it holds the
    device work of exactly the timed steps, and pauses leave out what runs between steps (validation,
    checkpoints)."""

    def __init__(self, warmup: int, log_every: int, world: World, clock: Clock,
                 wall: Callable[[], float] = time.perf_counter) -> None:
        self.wall = wall
        """The wall clock of the window (injectable for tests)."""
        self.warmup, self.log_every, self.world = warmup, log_every, world
        self.window_steps: int | None = None
        """Steps per timing window (None: log_every)."""
        self.clock = clock
        self.index = 0
        self.steps: list[StepTimes] = []
        self.pending: list[StepMarks] = []
        self.t0: float | None = None
        self.t1: float | None = None
        self.paused_s = 0.0
        self._pause0: float | None = None
        self.tel: Telemetry | None = None
        self.origin: Any = None
        """The first timed step's start mark (spans are placed from it)."""
        self.t0_unix: float | None = None
        """time.time() at the window's start: where the spans sit on the run's timeline."""
        self.spans: list[tuple[str, float, float]] = []

    def before_step(self) -> None:
        if self.index == self.warmup and self.t0 is None:
            import torch

            gpu = (torch.device(self.world.device).index or 0) if self.world.is_cuda else None
            self.clock.sync()  # the warm-up's queued work stays out of the window
            self.tel = Telemetry(interval_s=0.5, gpu_index=gpu)
            self.tel.start()
            self.t0_unix = time.time()
            self.t0 = self.wall()

    def add(self, marks: StepMarks) -> None:
        if self.t0 is not None:
            if self.origin is None:
                self.origin = marks.start
            if len(self.steps) + len(self.pending) < MAX_TRACE_STEPS:
                marks.origin = self.origin
            self.pending.append(marks)
        self.index += 1

    def settle(self) -> None:
        """Read the timed steps so far (one sync), keeping their seconds only."""
        if self.pending:
            self.steps += resolve(self.clock, self.pending)
            for m in self.pending:
                self.spans += m.spans
                m.spans = []
            self.pending = []

    def _chunks(self, window_steps: int) -> list[list[StepTimes]]:
        """Consecutive windows of ``window_steps`` settled steps (a last partial window only when it is the first),
        each with some step time."""
        out: list[list[StepTimes]] = []
        for i in range(0, len(self.steps), window_steps):
            chunk = self.steps[i:i + window_steps]
            if (len(chunk) == window_steps or not out) and sum(s[0] for s in chunk) > 0:
                out.append(chunk)
        return out

    def window_rates(self, window_steps: int) -> list[float]:
        """samples/s of each window (:meth:`_chunks`)."""
        return [sum(s[4] for s in c) / sum(s[0] for s in c) for c in self._chunks(window_steps)]

    def window_stalls(self, window_steps: int) -> list[float]:
        """Data stall % of each window (:meth:`_chunks`)."""
        return [100.0 * sum(s[1] + s[2] for s in c) / sum(s[0] for s in c) for c in self._chunks(window_steps)]

    def pause(self) -> None:
        """Leave what follows (validation, checkpoints) out of the timed window."""
        if self.t0 is not None and self.t1 is None and self._pause0 is None:
            self.clock.sync()
            self._pause0 = self.wall()

    def resume(self) -> None:
        if self._pause0 is not None:
            self.paused_s += self.wall() - self._pause0
            self._pause0 = None

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """:meth:`pause` ... :meth:`resume` around the ``with`` body."""
        self.pause()
        try:
            yield
        finally:
            self.resume()

    def stop(self) -> None:
        """End the timed window right after the last step's device work (before logging and worker shutdown)."""
        if self.t1 is None:
            self.resume()
            self.clock.sync()
            self.t1 = self.wall()
            if self.tel is not None:
                self.tel.stop()

    def finish(self) -> RankTiming:
        self.stop()
        self.settle()
        tel = self.tel.summary() if self.tel is not None else None
        wall = (self.t1 - self.t0 - self.paused_s) if self.t0 is not None else 0.0
        cols = list(zip(*self.steps)) if self.steps else [(), (), (), (), ()]
        step_s, next_s, h2d_s, comp_s = (float(sum(c)) for c in cols[:4])
        samples = int(sum(cols[4]))
        windows = self.window_rates(self.window_steps or self.log_every)
        stalls = self.window_stalls(self.window_steps or self.log_every)
        return RankTiming(
            rank=self.world.rank, num_steps=len(self.steps), num_samples=samples, wall_s=wall,
            step_s=step_s, data_wait_s=next_s + h2d_s, next_wait_s=next_s, h2d_s=h2d_s, compute_s=comp_s,
            samples_per_s=samples / wall if wall > 0 else 0.0,
            stall_pct=100.0 * (next_s + h2d_s) / step_s if step_s > 0 else 0.0,
            window_rates=windows, window_stalls=stalls,
            cores_used=tel.tree_cores_used if tel else None,
            read_bytes=tel.tree_read_bytes if tel else 0,
            rss_max_bytes=tel.rss_max_bytes if tel else 0,
            gpu=dict(tel.gpu) if tel else {},
            contention=tel.contention if tel else None,
        )
