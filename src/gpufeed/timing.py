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
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator, Protocol


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
            self.start = self.end = None  # drop the events
            self.waits, self.copies, self.computes = [], [], []
        return self._times


def resolve(clock: Clock, steps: list[StepMarks]) -> list[StepTimes]:
    """One sync, then every step's seconds."""
    clock.sync()
    return [s.times() for s in steps]
