"""The loader-ceiling harness (docs/design.md §4): steady-state samples/s of any batch iterable, batches moved to
the device and dropped, worker start-up and warm-up timed apart, repeated windows, process-tree telemetry.

``gpufeed tune`` measures every trial with :func:`measure_stream`; the benchmarks use it for their recipes. It
imports no job: give it ``open_batches(epoch)`` and, on CUDA, a ``cuda_sync`` (:func:`device_sync`) so that each
batch's copy is waited for. A loader error is a :class:`StreamError` whose ``partial`` holds what was measured.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator

from gpufeed.core.errors import ConfigError, GpufeedError, one_line
from gpufeed.measure.contention import Contention
from gpufeed.core.world import World


@dataclass(frozen=True, kw_only=True)
class StreamOptions:
    """How :func:`measure_stream` measures: the loader's shape, warm-up, windows and limits."""

    num_workers: int = 0
    """The loader's worker processes (sizes the prefetched backlog drained as warm-up, and the window)."""
    prefetch_factor: int = 2
    warmup_batches: int = 2
    """Batches drawn after the backlog is drained, before the windows."""
    window_s: float | None = 2.0
    """A window lasts this long and at least 2 batches per worker."""
    window_batches: int | None = None
    """A window of exactly this many batches instead (with ``min_window_s``: at least this many)."""
    min_window_s: float | None = None
    """With ``window_batches``: a window also lasts at least this long."""
    repeats: int = 3
    """Windows to time; with ``min_repeats``, the most windows (see :func:`measure_stream`'s ``settled``)."""
    min_repeats: int | None = None
    """With ``settled``: windows go on past this many only until ``settled(window rates)`` is true."""
    deadline: float | None = None
    """``time.monotonic()`` after which windows are cut short (``truncated``)."""
    ram_budget_bytes: int | None = None
    """RSS of the process tree above this fails the measurement (:class:`OverRamBudget`)."""
    telemetry_interval_s: float = 0.25


@dataclass(frozen=True, kw_only=True)
class StreamResult:
    """What :func:`measure_stream` measured (the TrialRecord fields of the same names); the defaults are what a
    measurement that ended early had not reached."""

    startup_s: float | None = None
    """Opening the first epoch and its first batch (worker start-up), excluded from the rate."""
    warmup_s: float | None = None
    num_warmup_batches: int = 0
    truncated: bool = False
    """The deadline cut the measurement short (fewer repeats or a shorter window)."""
    samples_per_s_runs: list[float] = field(default_factory=list)
    """Samples/s of each window."""
    measure_s: float = 0.0
    num_batches: int = 0
    num_samples: int = 0
    data_wait_s: float = 0.0
    """Seconds blocked in next(batches) inside the windows."""
    copy_s: float = 0.0
    """Seconds in ``to_device`` (and ``cuda_sync``) inside the windows."""
    cpu_percent_per_core: list[float] = field(default_factory=list)
    cpu_percent_mean: float | None = None
    tree_cores_used: float | None = None
    rss_max_bytes: int | None = None
    read_bytes_per_s: float | None = None
    disk_read_bytes_per_s: float | None = None
    num_skipped: int = 0
    num_repeated: int = 0
    contention: Contention | None = None
    """What the rest of the machine did over the windows (:mod:`gpufeed.measure.contention`)."""

    @property
    def samples_per_s(self) -> float | None:
        """The median window's samples/s (None before any window)."""
        from gpufeed.measure.metrics import Stat

        return Stat.of(self.samples_per_s_runs).median if self.samples_per_s_runs else None


class StreamError(Exception):
    """A measurement that ended early; ``partial`` holds what was measured before."""

    def __init__(self, message: str, partial: StreamResult | None = None) -> None:
        super().__init__(message)
        self.partial = partial or StreamResult()


class OutOfBudget(StreamError):
    """The deadline passed during start-up or warm-up."""


class OverRamBudget(StreamError):
    """The loader processes exceeded ``ram_budget_bytes``."""


class LoaderFailed(StreamError):
    """The loader raised (its cause is ``__cause__``)."""


def measure_stream(open_batches: Callable[[int], Iterable[Any]], opts: StreamOptions | None = None, *,
                   to_device: Callable[[Any], Any] | None = None, cuda_sync: Callable[[], None] | None = None,
                   skipped: Callable[[], int] | None = None, repeated: Callable[[], int] | None = None,
                   start_barrier: Callable[[], None] | None = None,
                   settled: Callable[[list[float]], bool] | None = None,
                   on_batch: Callable[[float, float, float], None] | None = None) -> StreamResult:
    """Measure steady-state samples/s of any batch iterable.

    ``open_batches(epoch)`` returns one epoch of ``(images, labels)`` batches; epochs are chained endlessly (a new
    epoch's start-up cost counts, as it would in training). Start-up (opening the first epoch and its first batch)
    is timed apart; warm-up then drains the prefetched backlog (``num_workers × prefetch_factor`` batches at most,
    stopping early as soon as a batch has to be waited for) plus ``warmup_batches``. Each batch goes through
    ``to_device`` (default: one element of each CPU tensor is read) and ``cuda_sync`` inside the windows.
    ``skipped`` / ``repeated`` read the loader's counters at the end. ``start_barrier`` (concurrent rank loaders)
    is called after warm-up and blocks until every rank is there; the windows then end on a shared clock, window
    k at the first batch after ``k+1`` window_s from the barrier, so that all ranks measure the same wall windows
    (within one batch). A loader error is raised as a :class:`LoaderFailed` whose message is one sentence and whose
    ``partial`` holds what was measured before it.

    ``settled(rates)`` (with ``opts.min_repeats``) ends the windows once at least ``min_repeats`` were timed and it
    returns True for their samples/s (``repeats`` stays the most). ``on_batch(t_wait, t_got, t_copied)`` is called
    with the perf_counter readings around each timed batch (``gpufeed train`` places them on its timeline).
    """
    opts = opts or StreamOptions()
    if opts.window_s is None and opts.window_batches is None:
        raise ConfigError("measure needs window_s or window_batches")
    if start_barrier is not None and opts.window_s is None:
        raise ConfigError("measuring ranks together needs window_s (windows on a shared clock)")
    out: dict[str, Any] = {}
    stream = _endless(open_batches)
    try:
        _warm_up(stream, opts, to_device or touch, cuda_sync or (lambda: None), out)
        _windows(stream, opts, to_device or touch, cuda_sync or (lambda: None), start_barrier, out, settled=settled,
                 on_batch=on_batch)
        if skipped is not None:
            out["num_skipped"] = int(skipped())
        if repeated is not None:
            out["num_repeated"] = int(repeated())
        return StreamResult(**out)
    except StreamError as exc:
        exc.partial = StreamResult(**out)
        raise
    except Exception as exc:
        raise LoaderFailed(error_sentence(exc), StreamResult(**out)) from exc
    finally:
        stream.close()  # shuts DataLoader workers down


def _endless(open_batches: Callable[[int], Iterable[Any]]) -> Iterator[Any]:
    epoch = 0
    while True:
        n = 0
        for batch in open_batches(epoch):
            n += 1
            yield batch
        if n == 0:
            raise RuntimeError(f"the loader yielded no batches in epoch {epoch} (too few samples per rank?)")
        epoch += 1


def _past(deadline: float | None, extra: float = 0.0) -> bool:
    return deadline is not None and time.monotonic() + extra > deadline


def _warm_up(stream: Iterator[Any], opts: StreamOptions, move: Callable[[Any], Any], sync: Callable[[], None],
             out: dict[str, Any]) -> None:
    """Start-up (the first batch) and warm-up (the prefetched backlog, then ``warmup_batches``) into ``out``."""
    t0 = time.perf_counter()
    move(next(stream))
    sync()
    t1 = time.perf_counter()
    out["startup_s"] = t1 - t0
    backlog = opts.num_workers * opts.prefetch_factor
    n_warm = 1
    drained = opts.num_workers == 0
    while n_warm < 1 + opts.warmup_batches + backlog and not _past(opts.deadline):
        ta = time.perf_counter()
        move(next(stream))
        waited = time.perf_counter() - ta
        n_warm += 1
        if waited > 0.005 and n_warm > backlog // 2:
            drained = True
        if drained and n_warm >= 1 + opts.warmup_batches:
            break
    sync()
    out["warmup_s"] = time.perf_counter() - t1
    out["num_warmup_batches"] = n_warm
    if _past(opts.deadline):
        out["truncated"] = True
        raise OutOfBudget(f"budget ran out during start-up/warm-up ({time.perf_counter() - t0:.1f} s)")


def _windows(stream: Iterator[Any], opts: StreamOptions, move: Callable[[Any], Any], sync: Callable[[], None],
             start_barrier: Callable[[], None] | None, out: dict[str, Any], *,
             settled: Callable[[list[float]], bool] | None = None,
             on_batch: Callable[[float, float, float], None] | None = None) -> None:
    """The measurement windows, under telemetry, into ``out``."""
    import psutil

    from gpufeed.measure.telemetry import Telemetry

    window_s, window_batches, deadline = opts.window_s, opts.window_batches, opts.deadline
    runs: list[float] = []
    # with W workers delivering whole batches in turn, a window of fewer than 2W batches measures
    # the round-robin phase more than the rate
    min_batches = 2 * max(1, opts.num_workers) if window_batches is None else 1
    me = psutil.Process()
    n_batches = n_samples = 0
    wait_s = copy_s = measure_s = 0.0
    with Telemetry(interval_s=opts.telemetry_interval_s) as tel:
        if start_barrier is not None:
            start_barrier()
        begin = time.perf_counter()
        for r in range(opts.repeats):
            if r > 0 and _past(deadline, window_s or 0.0):
                out["truncated"] = True
                break
            if settled is not None and opts.min_repeats is not None and r >= opts.min_repeats and settled(runs):
                break
            ts = time.perf_counter()
            # on a shared clock: this window ends (r+1) windows after the barrier, whatever the last one took
            span = begin + (r + 1) * window_s - ts if start_barrier is not None and window_s else window_s
            nb = ns = 0
            while True:
                ta = time.perf_counter()
                batch = next(stream)
                tb = time.perf_counter()
                move(batch)
                sync()
                tc = time.perf_counter()
                wait_s += tb - ta
                copy_s += tc - tb
                if on_batch is not None:
                    on_batch(ta, tb, tc)
                nb += 1
                ns += _batch_len(batch)
                if window_batches is not None and nb >= window_batches and tc - ts >= (opts.min_window_s or 0.0):
                    break
                if window_batches is None and span is not None and tc - ts >= span and nb >= min_batches:
                    break
                if _past(deadline):
                    out["truncated"] = True
                    break
            el = time.perf_counter() - ts
            measure_s += el
            n_batches += nb
            n_samples += ns
            runs.append(ns / el)
            _check_ram(me, opts.ram_budget_bytes, out)
    tel_s = tel.summary()
    out.update(
        samples_per_s_runs=runs, measure_s=measure_s, num_batches=n_batches, num_samples=n_samples,
        data_wait_s=wait_s, copy_s=copy_s,
        cpu_percent_per_core=[round(c, 1) for c in tel_s.cpu_percent_per_core],
        cpu_percent_mean=tel_s.cpu_percent_mean, tree_cores_used=tel_s.tree_cores_used,
        rss_max_bytes=tel_s.rss_max_bytes,
        read_bytes_per_s=tel_s.tree_read_bytes / tel_s.duration_s,
        disk_read_bytes_per_s=None if tel_s.disk_read_bytes is None else tel_s.disk_read_bytes / tel_s.duration_s,
        contention=tel_s.contention,
    )
    if opts.ram_budget_bytes is not None and tel_s.rss_max_bytes > opts.ram_budget_bytes:
        raise OverRamBudget(f"RAM budget exceeded: loader processes peaked at {megabytes(tel_s.rss_max_bytes)} > "
                            f"budget {megabytes(opts.ram_budget_bytes)}")


def _check_ram(me: Any, budget: int | None, out: dict[str, Any]) -> None:
    """After each window: the RSS of ``me``'s process tree over the budget ends the measurement."""
    if budget is None:
        return
    rss = _tree_rss(me)
    if rss > budget:
        out["rss_max_bytes"] = rss
        raise OverRamBudget(f"RAM budget exceeded: loader processes use {megabytes(rss)} > budget "
                            f"{megabytes(budget)}")


def error_sentence(exc: BaseException) -> str:
    """A failed trial in one sentence: a GpufeedError's own sentence, else the type and the first line."""
    if isinstance(exc, GpufeedError):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)}"


def touch(batch: Any) -> None:
    """Read one element of each tensor so lazily produced batches are really materialised."""
    items = batch if isinstance(batch, (tuple, list)) else (batch,)
    for t in items:
        shape = getattr(t, "shape", None)
        if shape is not None and hasattr(t, "item") and all(shape) and str(getattr(t, "device", "")) == "cpu":
            t[tuple(n - 1 for n in shape)].item()  # indexing, not reshape: a strided view would be copied


def device_sync(world: World) -> Callable[[], None] | None:
    """``cuda_sync`` for ``world``: wait for its CUDA device (None on CPU, where copies are synchronous)."""
    if not world.is_cuda:
        return None
    import torch

    return lambda: torch.cuda.synchronize(world.device)


def megabytes(n: float | None) -> str:
    """``123 MB`` (``-`` for None)."""
    return "-" if n is None else f"{n / 1e6:.0f} MB"


def _batch_len(batch: Any) -> int:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return int(len(batch[1]))
    return int(len(batch))


def _tree_rss(proc: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total

