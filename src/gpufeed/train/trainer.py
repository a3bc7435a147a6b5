"""The :class:`Trainer` of one rank (docs/design.md §4, §5): components built by the ``build_*`` functions below
and held as typed attributes (loader, model, optimizer, amp, schedule, compute, validator, logger, checkpointer,
clock), and the runs as tables of contents: :meth:`Trainer.run` picks the mode(s), :meth:`Trainer.run_mode` times
one mode of ``--measure``, ``--synthetic`` or ``--loader-only``, :meth:`Trainer.run_real` trains.

Modes: ``real`` trains on the shards (epochs/steps, validation, checkpoints, resume); ``synthetic`` steps on a
fixed uint8 batch already on the device (the compute ceiling); ``loader-only`` moves the loader's batches to the
device and drops them (the loader ceiling); ``measure`` runs the three briefly, in that order. Each mode has its own
step (:mod:`gpufeed.train.steps`). At the end of each mode the per-rank numbers, each tagged with its node, are
all-gathered and rank 0 makes the mode's record (:mod:`gpufeed.train.records`).
"""

from __future__ import annotations

import dataclasses
import functools
import random
import socket
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, DataError, Interrupted, signal_name
from gpufeed.core.world import World
from gpufeed.loader import LoaderPosition
from gpufeed.measure.settle import spread, window_steps
from gpufeed.measure.timing import Clock, CudaClock, HostClock, Meter, RankTiming, StepMarks
from gpufeed.measure.trace import TRACE_NAME, RankSpans, StepProfiler, write_trace
from gpufeed.model import Amp, LrSchedule, build_model, build_optimizer, default_warmup
from gpufeed.train.checkpoint import Checkpointer, Resume, RngState, set_identity
from gpufeed.train.logger import RunLogger
from gpufeed.train.preflight import check_classes, run_loader_config, steps_per_epoch
from gpufeed.train.records import ModeRecord, ValRecord, aggregate
from gpufeed.train.steps import Compute, Model, SyntheticStep, describe_batch, real_step, timing_window
from gpufeed.train.stop import StopRequest
from gpufeed.train.validate import Validator

MODES_MEASURE = ("synthetic", "loader-only", "real")
LOADER_WINDOW_S = 0.5
"""--measure: a loader-only window lasts at least this long (a window of a few fast batches measures jitter)."""

# --------------------------------------------------------------------------- building the parts


def set_up_device(cfg: TrainConfig, world: World) -> None:
    """The current CUDA device and cuDNN autotuning, or the CPU's threads for this rank."""
    if world.is_cuda:
        torch.cuda.set_device(torch.device(world.device))  # events, streams and NCCL use the current device
        torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        if cfg.threads:
            torch.set_num_threads(cfg.threads)
    else:
        from gpufeed.core.system import usable_cpus

        torch.set_num_threads(cfg.threads or max(1, usable_cpus() // world.local_world_size))


def build_loaders(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World) -> tuple[Any, Any]:
    """(training loader or None, validation loader or None) for this rank."""
    if cfg.mode not in ("real", "loader-only", "measure"):
        return None, None
    if not cfg.shards:
        raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
    from gpufeed.loader import build_loader

    loader = build_loader(cfg.shards, loader_cfg, world, train=True, epoch=0, manifest_file=cfg.manifest,
                          reuse_batches=True)  # every batch is dropped after its step
    val_loader = None
    if cfg.val_shards and cfg.mode == "real":
        # no persistent workers: they would sit idle (holding memory) through every training epoch
        val_cfg = dataclasses.replace(loader_cfg, persistent_workers=False)
        val_loader = build_loader(cfg.val_shards, val_cfg, world, train=False, epoch=0, reuse_batches=True)
    return loader, val_loader


def build_train_model(cfg: TrainConfig, world: World, num_classes: int) -> Model:
    """The model (:func:`gpufeed.model.build_model`, weights seeded from cfg.seed), wrapped in DDP across ranks and
    compiled with --compile."""
    import numpy as np

    random.seed(cfg.seed)
    torch.manual_seed(cfg.seed)
    np.random.seed(cfg.seed % 2**32)
    device = torch.device(world.device)
    module = build_model(cfg.arch, num_classes, device, channels_last=cfg.channels_last)
    forward, ddp = module, None
    if world.is_distributed:
        from torch.nn.parallel import DistributedDataParallel as DDP

        ddp = DDP(module, device_ids=[device.index] if world.is_cuda else None, gradient_as_bucket_view=True)
        forward = ddp
    return Model(module=module, ddp=ddp, forward=torch.compile(forward) if cfg.compile else forward)


def gather(world: World, obj: Any) -> list[Any]:
    """``obj`` of every rank, in rank order (all_gather_object); ``[obj]`` on one rank."""
    if not world.is_distributed:
        return [obj]
    import torch.distributed as dist

    out: list[Any] = [None] * world.world_size
    dist.all_gather_object(out, obj)
    return out


def param_checksum(module: torch.nn.Module) -> float:
    """Σ of every parameter in float64: equal on all ranks when DDP kept them in sync. (BatchNorm running
    statistics are not parameters: DDP re-broadcasts them from rank 0 at each forward.)"""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in module.parameters()))


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


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Everything one rank holds, as parts: see the module docstring."""

    def __init__(self, cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *,
                 run_dir: str | Path | None = None) -> None:
        self.cfg, self.world = cfg, world
        self.run_dir = Path(run_dir) if run_dir else None
        self.device = torch.device(world.device)
        self.cuda = world.is_cuda
        self.clock: Clock = CudaClock(self.device) if self.cuda else HostClock()
        """Marks on the device timeline (see :mod:`gpufeed.measure.timing`); read at log steps only."""
        self.notes: list[str] = []
        self.loader_cfg = run_loader_config(cfg, loader_cfg)
        self.batch_size, self.image_size = self.loader_cfg.batch_size, self.loader_cfg.image_size
        self.accum, self.num_nodes = cfg.accum_steps, world.num_nodes
        set_up_device(cfg, world)

        self.loader, val_loader = build_loaders(cfg, self.loader_cfg, world)
        self.manifest = self.loader.manifest if self.loader is not None else None
        self.num_classes = cfg.num_classes or (self.manifest.num_classes if self.manifest else 1000)
        check_classes(cfg, self.manifest, val_loader.manifest if val_loader is not None else None)
        self.model = build_train_model(cfg, world, self.num_classes)
        self.optimizer = build_optimizer(self.model.module, lr=cfg.lr, momentum=cfg.momentum,
                                         weight_decay=cfg.weight_decay)
        criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self.amp = Amp.build(cfg.amp, self.device)
        if self.amp.note:
            self.notes.append(self.amp.note)

        # schedule: total steps known once the loader length is
        self.steps_per_epoch = steps_per_epoch(cfg, self.loader) if self.loader is not None else \
            cfg.steps or cfg.measure_steps
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        warmup = cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(self.total_steps)
        self.schedule = LrSchedule(self.optimizer, total=self.total_steps, warmup=warmup, peak=cfg.lr,
                                   floor=cfg.min_lr)
        self.compute = Compute(self.model, self.optimizer, self.amp, self.schedule, criterion, accum=self.accum,
                               channels_last=cfg.channels_last)
        self.synthetic_step = SyntheticStep(self.compute, self.clock, seed=cfg.seed, batch_size=self.batch_size,
                                            image_size=self.image_size, num_classes=self.num_classes,
                                            device=self.device)
        self.validator = Validator(val_loader, self.model.module, self.amp, world, num_classes=self.num_classes,
                                   channels_last=cfg.channels_last) if val_loader is not None else None
        self.logger = RunLogger(world, self.clock, run_dir=self.run_dir, log_every=cfg.log_every,
                                progress=cfg.progress)
        self.checkpointer = Checkpointer(
            cfg, self.loader_cfg, world, model=self.model.module, optimizer=self.optimizer, scaler=self.amp.scaler,
            num_classes=self.num_classes, total_steps=self.total_steps, gather=self.gather, notes=self.notes,
            shard_set=set_identity(self.manifest) if self.manifest is not None else None, position=LoaderPosition)

        self.step = self.start_step = self.epoch = self.step_in_epoch = 0
        self.started = False
        """True once this rank began reading data or computing: a failure after that is a RunError (exit 1)."""
        self.resume_rng: RngState | None = None
        """This rank's RNG state from the checkpoint, applied once the loader is back at its position."""
        self.resume_position: LoaderPosition | None = None
        """The checkpoint's loader position, for the first epoch after --resume."""
        self._batches: Iterator[Any] | None = None
        """The current epoch's batches (run_real), opened at the epoch's first step."""
        self.stop: StopRequest | None = None
        """Set by :func:`gpufeed.train.train`: the SIGTERM this rank was sent, checked at every step boundary."""
        self.trace: list[RankSpans] = []
        """Rank 0: every rank's spans of each mode, written as trace.json (:mod:`gpufeed.measure.trace`)."""
        self.batches_seen: dict[str, str] = {}
        """The first batch of each mode as the model got it (:func:`describe_batch`)."""
        self._mode = "real"

    # ---- the runs
    def run(self, on_step: Callable[[int], None] | None = None) -> tuple[dict[str, ModeRecord], list[ValRecord]]:
        """The configured mode(s): (rank 0's record per mode, validation records); other ranks get no records.
        With --measure each mode may extend its windows until they settle, inside its share of measure_seconds.
        Rank 0 writes every rank's step marks as trace.json into the run folder."""
        cfg = self.cfg
        try:
            if cfg.mode == "real":
                rec, vals = self.run_real(on_step)
                return ({"real": rec} if rec is not None else {}), vals
            measure = cfg.mode == "measure"
            modes, steps = (MODES_MEASURE, cfg.measure_steps) if measure else \
                ((cfg.mode,), cfg.steps or cfg.measure_steps)
            t0, records = time.perf_counter(), {}
            for k, mode in enumerate(modes):
                deadline = t0 + cfg.measure_seconds * (k + 1) / len(modes) if measure else None
                records[mode] = self.run_mode(mode, steps, deadline=deadline)
            if cfg.profile_steps and "real" in modes:
                self.profile_real()
            return {mode: rec for mode, rec in records.items() if rec is not None}, []
        finally:
            if self.run_dir is not None and self.world.is_main and self.trace:
                write_trace(self.run_dir / TRACE_NAME, self.trace)

    def run_mode(self, mode: str, num_steps: int, *, deadline: float | None = None) -> ModeRecord | None:
        """synthetic / loader-only / real (measure) for num_steps timed steps after the warm-up. With a
        ``deadline`` (--measure), the mode is judged on windows of a third of those steps and goes on window by
        window, while its windows have not settled (:func:`gpufeed.measure.settle.spread`), until the deadline."""
        self._mode = mode
        if mode == "loader-only":
            return self.run_loader_only(num_steps, deadline=deadline)
        warm, timed = self.timing_window(mode, num_steps)
        meter = Meter(warm, self.cfg.log_every, self.world, self.clock)
        judge = deadline is not None
        window = meter.window_steps = window_steps(timed) if judge else None
        n = warm + timed
        step = self._step_of(mode)
        it = None if mode == "synthetic" else self._cycle()
        if mode == "synthetic":
            self.batches_seen[mode] = describe_batch(self.synthetic_step.batch()[0])
        self.started = True
        self.model.module.train()
        try:
            with self.logger.bar(n, 0, mode):
                i = 0
                while True:
                    meter.before_step()
                    marks = step(it)
                    self.step += 1
                    i += 1
                    self._count_step(mode, marks, meter, last=i == n and not judge)
                    signum = self.stop_signal()
                    if signum:
                        raise Interrupted(f"interrupted by {signal_name(signum)} in {mode} mode after step "
                                          f"{i} of {n}", signum)
                    if judge and i >= n and (i - warm) % window == 0 and not self._go_on(meter, window, deadline):
                        self.logger.end(mode, meter, step=self.step, epoch=self.epoch, loss=self.compute.last_loss,
                                        lr=self.compute.step_lr)
                        break
                    if not judge and i == n:
                        break
        finally:
            del it  # the loader's workers stop here
        return self._aggregate(mode, meter, judge=judge)

    def profile_real(self) -> StepProfiler:
        """--profile-steps N after the measured modes: N + 1 real steps under torch.profiler, outside every timed
        window (the profiler's cost stays out of the verdict's numbers), into the run folder's profile/."""
        prof = StepProfiler(self.cfg.profile_steps, self.run_dir, cuda=self.cuda, rank=self.world.rank).start()
        step, it = self._step_of("real"), self._cycle()
        try:
            while prof.active:
                step(it)
                prof.step()
        finally:
            prof.close()
            del it
        return prof

    def _go_on(self, meter: Meter, window: int, deadline: float | None) -> bool:
        """Collective, at a window's end: go on when some rank's windows have not settled and every rank is inside
        the deadline."""
        meter.settle()
        mine = spread(meter.window_rates(window), meter.window_stalls(window)).settled
        inside = deadline is not None and time.perf_counter() < deadline
        votes = self.gather((mine, inside))
        return not all(s for s, _ in votes) and all(t for _, t in votes)

    def run_loader_only(self, num_steps: int, *, deadline: float | None = None) -> ModeRecord | None:
        """The loader ceiling, measured by the one harness ``gpufeed tune`` uses
        (:func:`gpufeed.measure.stream.measure_stream`; on CUDA each batch's copy is waited for): warm-up drains the
        prefetched backlog, then windows of batches moved to the device and dropped. With a ``deadline``
        (--measure): windows of a third of the timed steps, on until they settle or the deadline passes."""
        from gpufeed.measure.stream import LoaderFailed, StreamOptions, device_sync, measure_stream
        from gpufeed.measure.settle import MIN_WINDOWS

        lc, accum, judge = self.loader_cfg, self.accum, deadline is not None
        _, timed = self.timing_window("loader-only", num_steps)
        if judge:
            per, windows = window_steps(timed), MIN_WINDOWS
        else:
            windows = -(-timed // self.cfg.log_every)
            per = -(-timed // windows)
        opts = StreamOptions(num_workers=lc.num_workers, prefetch_factor=lc.prefetch_factor,
                             warmup_batches=self.cfg.timing_warmup_steps * accum,
                             window_s=None, min_window_s=LOADER_WINDOW_S if judge else None,
                             window_batches=per * accum, repeats=10_000 if judge else windows,
                             min_repeats=windows if judge else None)
        spans = RankSpans("loader-only", self.world.rank, self.world.node_rank, "", 0.0, 0.0)
        origin: list[float] = []

        def on_batch(ta: float, tb: float, tc: float) -> None:
            if not origin:
                origin.append(ta)
                spans.t0_unix = time.time() - (time.perf_counter() - ta)
            spans.spans += [("data wait", ta - origin[0], tb - ta), ("copy", tb - origin[0], tc - tb)]
            if self.stop is not None and self.stop.signum:
                raise Interrupted(f"interrupted by {signal_name(self.stop.signum)} in loader-only mode",
                                  self.stop.signum)

        def settled(rates: list[float]) -> bool:
            return spread(rates).settled or time.perf_counter() >= deadline

        def open_batches(epoch: int) -> Any:
            self.loader.set_epoch(self.epoch + epoch)
            return self.loader

        self.started = True
        try:
            res = measure_stream(open_batches, opts, to_device=self._to_device, cuda_sync=device_sync(self.world),
                                 settled=settled if judge else None, on_batch=on_batch)
        except LoaderFailed as exc:
            cause = exc.__cause__
            raise (cause if isinstance(cause, Exception) else exc) from None
        timing = stream_timing(res, self.world.rank, accum)
        spans.wall_s = timing.wall_s
        self.logger.window(timing, mode="loader-only", step=self.step, epoch=self.epoch)
        rec, trace = mode_record("loader-only", timing, self.world, None, spans=spans, judge=judge)
        self.trace += trace
        return rec

    def run_real(self, on_step: Callable[[int], None] | None = None) -> tuple[ModeRecord | None, list[ValRecord]]:
        """The training run: resume, then for each step: train, log, validate at epoch ends and at the end,
        checkpoint on the one cadence rule (:meth:`Checkpointer.should_save`). ``on_step(step)`` ends each step."""
        if self.cfg.resume:
            self.load_checkpoint()
        self._mode = "real"
        self.started = True
        meter = Meter(self._real_warmup(), self.cfg.log_every, self.world, self.clock)
        prof = StepProfiler(self.cfg.profile_steps, self.run_dir, cuda=self.cuda, rank=self.world.rank).start()
        if prof.active:
            self.notes.append(f"the first {self.cfg.profile_steps + 1} steps ran under torch.profiler "
                              f"(--profile-steps), in {prof.out}")
        vals: list[ValRecord] = []
        self.model.module.train()
        try:
            with self.logger.bar(self.total_steps, self.step, "train"):
                while self.step < self.total_steps:
                    meter.before_step()
                    marks = real_step(self.compute, self.clock, self._epoch_batches(), self._to_device,
                                      batch_size=self.batch_size)
                    epoch_end, run_end = self._advance()
                    prof.step()
                    self._count_step("real", marks, meter, last=run_end)
                    if epoch_end or run_end:
                        self._batches = None  # the loader's workers stop before validation
                    if self.validator is not None and (epoch_end or run_end):
                        with meter.paused():
                            vals.append(self.validate())
                    if epoch_end:
                        self._next_epoch()
                    saved = self.checkpointer.should_save(self.step, epoch_end=epoch_end, run_end=run_end)
                    if saved:
                        with meter.paused():
                            self.save_checkpoint()
                    if on_step is not None:
                        on_step(self.step)
                    signum = self.stop_signal() if not run_end else 0  # the last step: the run ends anyway
                    if signum:
                        with meter.paused():
                            self._stop(signum, saved=saved)
        finally:
            prof.close()
            self._batches = None
        return self._aggregate("real", meter), vals

    # ---- steps
    def _step_of(self, mode: str) -> Callable[[Iterator[Any] | None], StepMarks]:
        """The step of ``mode`` (:mod:`gpufeed.train.steps`), taking the mode's batches (None for synthetic)."""
        if mode == "synthetic":
            return self.synthetic_step
        return functools.partial(real_step, self.compute, self.clock, to_device=self._to_device,
                                 batch_size=self.batch_size)

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        x, y = self.loader.to_device(batch, self.device, non_blocking=True)
        if self._mode not in self.batches_seen:
            self.batches_seen[self._mode] = describe_batch(x)
        return x, y

    def _cycle(self) -> Iterator[Any]:
        """Batches across epoch boundaries (measure mode)."""
        epoch = self.epoch
        while True:
            self.loader.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    def timing_window(self, mode: str, num_steps: int) -> tuple[int, int]:
        """(warm-up steps, timed steps) of ``mode`` in this run (:func:`gpufeed.train.steps.timing_window`)."""
        lc = self.loader_cfg
        return timing_window(mode, num_steps, warmup_steps=self.cfg.timing_warmup_steps, num_workers=lc.num_workers,
                             prefetch_factor=lc.prefetch_factor, accum=self.accum, has_loader=self.loader is not None)

    def _real_warmup(self) -> int:
        """Timing warm-up steps of run_real: at least one step is timed, however short the run."""
        return min(self.timing_window("real", 0)[0], max(0, self.total_steps - self.step - 1))

    def _count_step(self, mode: str, marks: StepMarks, meter: Meter, *, last: bool) -> None:
        """A step done: to the meter, the progress bar and, every log_every steps, log.jsonl (:class:`RunLogger`)."""
        self.logger.count(mode, marks, meter, last=last, step=self.step, epoch=self.epoch,
                          loss=self.compute.last_loss, lr=self.compute.step_lr)

    # ---- position in the run
    def _epoch_batches(self) -> Iterator[Any]:
        """This epoch's batches, opened at its first step. After --resume the first epoch starts at the
        checkpoint's batch: the loader passes over the batches already trained on without decoding them
        (LoaderPosition), no replay; the checkpoint's RNG states apply from there."""
        if self._batches is None:
            position, self.resume_position = self.resume_position, None
            if position is not None and position.epoch == self.epoch:
                self.loader.resume(position)
            else:  # a fresh epoch (or the one after a checkpoint written at an epoch's end)
                self.loader.set_epoch(self.epoch)
            self._batches = iter(self.loader)
            if self.resume_rng is not None:
                self.resume_rng.apply()
                self.resume_rng = None
        return self._batches

    def _advance(self) -> tuple[bool, bool]:
        """Count one optimizer step of run_real: (it ended the epoch, it ended the run)."""
        self.step += 1
        self.step_in_epoch += 1
        return self.step_in_epoch >= self.steps_per_epoch, self.step >= self.total_steps

    def _next_epoch(self) -> None:
        self.epoch += 1
        self.step_in_epoch = 0

    # ---- validation, checkpoints, stops
    def validate(self) -> ValRecord:
        """Top-1/top-5 on the validation set at this point of the run (:class:`Validator`)."""
        assert self.validator is not None
        return self.validator.run(self.epoch, self.step)

    def save_checkpoint(self) -> Path | None:
        """Collective: :meth:`Checkpointer.save` at this run's position."""
        return self.checkpointer.save(self.step, self.epoch, self.step_in_epoch)

    def load_checkpoint(self) -> Resume | None:
        """--resume: the checkpointer's checked load, then the run's position and LR schedule from it; this
        rank's RNG states are kept for the epoch's first batch (:meth:`_epoch_batches`)."""
        resume = self.checkpointer.load()
        if resume is None:
            return None
        if resume.step_in_epoch > self.steps_per_epoch:  # another shard set, batch size or world size
            raise DataError(f"{self.checkpointer.path}: step {resume.step_in_epoch} of its epoch is beyond this "
                            f"run's {self.steps_per_epoch} steps per epoch (another shard set, batch size or "
                            f"number of ranks); start without --resume")
        self.schedule.seek(resume.step)
        self.step = self.start_step = resume.step
        self.epoch, self.step_in_epoch = resume.epoch, resume.step_in_epoch
        if self.step_in_epoch == self.steps_per_epoch:  # written at the end of an epoch
            self._next_epoch()
        self.resume_rng = resume.rng
        self.resume_position = resume.position
        return resume

    def stop_signal(self) -> int:
        """At a step boundary: the signal every rank stops on (:meth:`StopRequest.agreed`), 0 to go on."""
        return self.stop.agreed(self.world) if self.stop is not None else 0

    def _stop(self, signum: int, *, saved: bool) -> None:
        """Stop run_real at this step boundary: a checkpoint first, when checkpoints are on and the cadence did
        not just write one (the same collective save, so the resume from it is exact); then Interrupted."""
        where = ""
        if self.checkpointer.path is not None:
            if not saved:
                self.save_checkpoint()
            where = f"; checkpoint at step {self.step} in {self.checkpointer.path} (continue with --resume)"
        raise Interrupted(f"interrupted by {signal_name(signum)} after step {self.step} of {self.total_steps}{where}",
                          signum)

    # ---- collectives
    def gather(self, obj: Any) -> list[Any]:
        return gather(self.world, obj)

    def _aggregate(self, mode: str, meter: Meter, *, judge: bool = False) -> ModeRecord | None:
        """Collective: the mode's record on rank 0 (with the batch the model got), its spans into :attr:`trace`."""
        timing = meter.finish()
        spans = RankSpans(mode, self.world.rank, self.world.node_rank, "", meter.t0_unix or time.time(),
                          timing.wall_s, meter.spans)
        rec, trace = mode_record(mode, timing, self.world, self.compute.last_loss, spans=spans, judge=judge)
        self.trace += trace
        if rec is not None and mode in self.batches_seen:
            rec = dataclasses.replace(rec, batch=self.batches_seen[mode])
        return rec
