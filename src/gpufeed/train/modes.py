"""The measured modes of a :class:`~gpufeed.train.trainer.Trainer` (docs/design.md §4, §5): ``synthetic`` steps on
a fixed uint8 batch already on the device (the compute ceiling), ``loader-only`` moves the loader's batches to the
device and drops them (the loader ceiling), ``real`` trains for a timed window; ``--measure`` runs the three
briefly, in that order. :func:`time_modes` runs the configured mode(s), :func:`time_mode` times one (its warm-up,
then its timed steps; with --measure, windows until they settle or its deadline passes), :func:`time_loader_only`
times the loader with the harness ``gpufeed tune`` uses, and :func:`profile_real` runs --profile-steps after them.
At the end of each mode, the training run's too (:func:`record_mode`), the per-rank numbers, each tagged with its
node, are all-gathered and rank 0 makes the mode's record (:mod:`gpufeed.train.records`).

The functions take the trainer ``t`` and work on its parts as its own methods do: they read its config, loader,
steps, clock and logger, and move its step, ``started``, ``current_mode``, ``batches_seen`` and ``trace``. The
trainer imports this module and never the other way round, so ``t`` is typed Any.
"""

from __future__ import annotations

import dataclasses
import functools
import socket
import time
from typing import Any, Callable, Iterator

import torch

from gpufeed.core.errors import Interrupted, signal_name
from gpufeed.core.world import World
from gpufeed.measure.settle import spread, window_steps
from gpufeed.measure.timing import Meter, RankTiming, StepMarks
from gpufeed.measure.trace import RankSpans, StepProfiler
from gpufeed.train.records import ModeRecord, aggregate
from gpufeed.train.steps import describe_batch, real_step

MODES_MEASURE = ("synthetic", "loader-only", "real")
LOADER_WINDOW_S = 0.5
"""--measure: a loader-only window lasts at least this long (a window of a few fast batches measures jitter)."""


def time_modes(t: Any) -> dict[str, ModeRecord]:
    """The measured mode(s) of ``t``'s config: rank 0's record per mode, none on the other ranks. --measure runs
    :data:`MODES_MEASURE` for measure_steps each, every mode inside its share of measure_seconds; --synthetic or
    --loader-only runs the one mode for --steps (else measure_steps); --profile-steps follows the real mode."""
    cfg = t.cfg
    measure = cfg.mode == "measure"
    modes, steps = (MODES_MEASURE, cfg.measure_steps) if measure else \
        ((cfg.mode,), cfg.steps or cfg.measure_steps)
    t0, records = time.perf_counter(), {}
    for k, mode in enumerate(modes):
        deadline = t0 + cfg.measure_seconds * (k + 1) / len(modes) if measure else None
        records[mode] = time_mode(t, mode, steps, deadline=deadline)
    if cfg.profile_steps and "real" in modes:
        profile_real(t)
    return {mode: rec for mode, rec in records.items() if rec is not None}


def time_mode(t: Any, mode: str, num_steps: int, *, deadline: float | None = None) -> ModeRecord | None:
    """synthetic / loader-only / real (measure) for num_steps timed steps after the warm-up. With a
    ``deadline`` (--measure), the mode is judged on windows of a third of those steps and goes on window by
    window, while its windows have not settled (:func:`gpufeed.measure.settle.spread`), until the deadline."""
    t.current_mode = mode
    if mode == "loader-only":
        return time_loader_only(t, num_steps, deadline=deadline)
    warm, timed = t.timing_window(mode, num_steps)
    meter = Meter(warm, t.cfg.log_every, t.world, t.clock)
    judge = deadline is not None
    window = meter.window_steps = window_steps(timed) if judge else None
    n = warm + timed
    step = _step_of(t, mode)
    it = None if mode == "synthetic" else _cycle(t)
    if mode == "synthetic":
        t.batches_seen[mode] = describe_batch(t.synthetic_step.batch()[0])
    t.started = True
    t.model.module.train()
    try:
        with t.logger.bar(n, 0, mode):
            i = 0
            while True:
                meter.before_step()
                marks = step(it)
                t.step += 1
                i += 1
                t.count_step(mode, marks, meter, last=i == n and not judge)
                signum = t.stop_signal()
                if signum:
                    raise Interrupted(f"interrupted by {signal_name(signum)} in {mode} mode after step "
                                      f"{i} of {n}", signum)
                if judge and i >= n and (i - warm) % window == 0 and not _go_on(t, meter, window, deadline):
                    t.logger.end(mode, meter, step=t.step, epoch=t.epoch, loss=t.compute.last_loss,
                                 lr=t.compute.step_lr)
                    break
                if not judge and i == n:
                    break
    finally:
        del it  # the loader's workers stop here
    return record_mode(t, mode, meter, judge=judge)


def profile_real(t: Any) -> StepProfiler:
    """--profile-steps N after the measured modes: N + 1 real steps under torch.profiler, outside every timed
    window (the profiler's cost stays out of the verdict's numbers), into the run folder's profile/."""
    prof = StepProfiler(t.cfg.profile_steps, t.run_dir, cuda=t.cuda, rank=t.world.rank).start()
    step, it = _step_of(t, "real"), _cycle(t)
    try:
        while prof.active:
            step(it)
            prof.step()
    finally:
        prof.close()
        del it
    return prof


def _go_on(t: Any, meter: Meter, window: int, deadline: float | None) -> bool:
    """Collective, at a window's end: go on when some rank's windows have not settled and every rank is inside
    the deadline."""
    meter.settle()
    mine = spread(meter.window_rates(window), meter.window_stalls(window)).settled
    inside = deadline is not None and time.perf_counter() < deadline
    votes = t.gather((mine, inside))
    return not all(s for s, _ in votes) and all(ok for _, ok in votes)


def time_loader_only(t: Any, num_steps: int, *, deadline: float | None = None) -> ModeRecord | None:
    """The loader ceiling, measured by the one harness ``gpufeed tune`` uses
    (:func:`gpufeed.measure.stream.measure_stream`; on CUDA each batch's copy is waited for): warm-up drains the
    prefetched backlog, then windows of batches moved to the device and dropped. With a ``deadline``
    (--measure): windows of a third of the timed steps, on until they settle or the deadline passes."""
    from gpufeed.measure.stream import LoaderFailed, StreamOptions, device_sync, measure_stream
    from gpufeed.measure.settle import MIN_WINDOWS

    lc, accum, judge = t.loader_cfg, t.accum, deadline is not None
    _, timed = t.timing_window("loader-only", num_steps)
    if judge:
        per, windows = window_steps(timed), MIN_WINDOWS
    else:
        windows = -(-timed // t.cfg.log_every)
        per = -(-timed // windows)
    opts = StreamOptions(num_workers=lc.num_workers, prefetch_factor=lc.prefetch_factor,
                         warmup_batches=t.cfg.timing_warmup_steps * accum,
                         window_s=None, min_window_s=LOADER_WINDOW_S if judge else None,
                         window_batches=per * accum, repeats=10_000 if judge else windows,
                         min_repeats=windows if judge else None)
    spans = RankSpans("loader-only", t.world.rank, t.world.node_rank, "", 0.0, 0.0)
    origin: list[float] = []

    def on_batch(ta: float, tb: float, tc: float) -> None:
        if not origin:
            origin.append(ta)
            spans.t0_unix = time.time() - (time.perf_counter() - ta)
        spans.spans += [("data wait", ta - origin[0], tb - ta), ("copy", tb - origin[0], tc - tb)]
        if t.stop is not None and t.stop.signum:
            raise Interrupted(f"interrupted by {signal_name(t.stop.signum)} in loader-only mode",
                              t.stop.signum)

    def settled(rates: list[float]) -> bool:
        return spread(rates).settled or time.perf_counter() >= deadline

    def open_batches(epoch: int) -> Any:
        t.loader.set_epoch(t.epoch + epoch)
        return t.loader

    t.started = True
    try:
        res = measure_stream(open_batches, opts, to_device=t.to_device, cuda_sync=device_sync(t.world),
                             settled=settled if judge else None, on_batch=on_batch)
    except LoaderFailed as exc:
        cause = exc.__cause__
        raise (cause if isinstance(cause, Exception) else exc) from None
    timing = stream_timing(res, t.world.rank, accum)
    spans.wall_s = timing.wall_s
    t.logger.window(timing, mode="loader-only", step=t.step, epoch=t.epoch)
    rec, trace = mode_record("loader-only", timing, t.world, None, spans=spans, judge=judge)
    t.trace += trace
    return rec


def _step_of(t: Any, mode: str) -> Callable[[Iterator[Any] | None], StepMarks]:
    """The step of ``mode`` (:mod:`gpufeed.train.steps`), taking the mode's batches (None for synthetic)."""
    if mode == "synthetic":
        return t.synthetic_step
    return functools.partial(real_step, t.compute, t.clock, to_device=t.to_device, batch_size=t.batch_size)


def _cycle(t: Any) -> Iterator[Any]:
    """Batches across epoch boundaries (measure mode)."""
    epoch = t.epoch
    while True:
        t.loader.set_epoch(epoch)
        yield from t.loader
        epoch += 1


# --------------------------------------------------------------------------- a mode's record


def record_mode(t: Any, mode: str, meter: Meter, *, judge: bool = False) -> ModeRecord | None:
    """Collective: the mode's record on rank 0 (with the batch the model got), its spans into ``t.trace``."""
    timing = meter.finish()
    spans = RankSpans(mode, t.world.rank, t.world.node_rank, "", meter.t0_unix or time.time(),
                      timing.wall_s, meter.spans)
    rec, trace = mode_record(mode, timing, t.world, t.compute.last_loss, spans=spans, judge=judge)
    t.trace += trace
    if rec is not None and mode in t.batches_seen:
        rec = dataclasses.replace(rec, batch=t.batches_seen[mode])
    return rec


def gather(world: World, obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (all_gather_object); ``[obj]`` on one rank."""
    if not world.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def mode_record(mode: str, timing: RankTiming, world: World, loss: torch.Tensor | None, *,
                spans: RankSpans | None = None, judge: bool = False) -> tuple[ModeRecord | None, list[RankSpans]]:
    """Collective: this rank's timed window, tagged with its node, all-gathered with its spans; rank 0 gets the
    mode's record (with the per-node sums and ``loss``; ``judge``: whether its windows settled) and every rank's
    spans, the other ranks (None, [])."""
    timing = dataclasses.replace(timing, node=world.node_rank, host=socket.gethostname())
    if spans is not None:
        spans.node, spans.host = world.node_rank, timing.host
    gathered = gather(world, (timing, spans))
    if not world.is_main:
        return None, []
    rec = aggregate(mode, [t for t, _ in gathered], world.num_nodes, float(loss) if loss is not None else None,
                    judge=judge)
    return rec, [sp for _, sp in gathered if sp is not None]


def stream_timing(res: Any, rank: int, accum: int) -> RankTiming:
    """One rank's loader-only window from the loader-ceiling harness (:class:`gpufeed.measure.stream.StreamResult`):
    every timed batch is a data wait plus its copy, with no compute."""
    wall = res.measure_s
    wait = res.data_wait_s + res.copy_s
    stalls = [100.0] * len(res.samples_per_s_runs)
    return RankTiming(
        rank=rank, num_steps=res.num_batches // max(1, accum), num_samples=res.num_samples, wall_s=wall, step_s=wall,
        data_wait_s=wait, next_wait_s=res.data_wait_s, h2d_s=res.copy_s, compute_s=0.0,
        samples_per_s=res.num_samples / wall if wall > 0 else 0.0, stall_pct=100.0 * wait / wall if wall > 0 else 0.0,
        window_rates=list(res.samples_per_s_runs), window_stalls=stalls, cores_used=res.tree_cores_used,
        read_bytes=int((res.read_bytes_per_s or 0.0) * wall), rss_max_bytes=res.rss_max_bytes or 0,
        contention=res.contention)
