"""The :class:`Trainer` of one rank (docs/design.md §4, §5): components built by the ``build_*`` functions below
and held as typed attributes (loader, model, optimizer, amp, schedule, compute, validator, logger, checkpointer,
clock), and the runs as tables of contents: :meth:`Trainer.run` picks the mode(s), :meth:`Trainer.run_real` trains,
:meth:`Trainer.run_mode` times one mode of ``--measure``, ``--synthetic`` or ``--loader-only``.

Modes: ``real`` trains on the shards (epochs/steps, validation, checkpoints, resume), here; ``synthetic``,
``loader-only`` and ``measure`` (the three briefly, in that order) are the measured modes, timed by
:mod:`gpufeed.train.modes` on this trainer's parts. Each mode has its own step (:mod:`gpufeed.train.steps`). At the
end of each mode the per-rank numbers, each tagged with its node, are all-gathered and rank 0 makes the mode's
record (:func:`gpufeed.train.modes.record_mode`, :mod:`gpufeed.train.records`).
"""

from __future__ import annotations

import dataclasses
import random
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, DataError, Interrupted, signal_name
from gpufeed.core.world import World
from gpufeed.loader import LoaderPosition
from gpufeed.measure.timing import Clock, CudaClock, HostClock, Meter, StepMarks
from gpufeed.measure.trace import TRACE_NAME, RankSpans, StepProfiler, write_trace
from gpufeed.model import Amp, LrSchedule, build_model, build_optimizer, default_warmup
from gpufeed.train.checkpoint import Checkpointer, Resume, RngState, set_identity
from gpufeed.train.logger import RunLogger
from gpufeed.train.modes import gather, record_mode, time_mode, time_modes
from gpufeed.train.preflight import check_classes, run_loader_config, steps_per_epoch
from gpufeed.train.records import ModeRecord, ValRecord
from gpufeed.train.steps import Compute, Model, SyntheticStep, describe_batch, real_step, timing_window
from gpufeed.train.stop import StopRequest
from gpufeed.train.validate import Validator

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


def param_checksum(module: torch.nn.Module) -> float:
    """Σ of every parameter in float64: equal on all ranks when DDP kept them in sync. (BatchNorm running
    statistics are not parameters: DDP re-broadcasts them from rank 0 at each forward.)"""
    with torch.no_grad():
        return float(sum(p.double().sum() for p in module.parameters()))


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
        self.current_mode = "real"
        """The mode running now: the key of :attr:`batches_seen` for the batches :meth:`to_device` moves."""

    # ---- the runs
    def run(self, on_step: Callable[[int], None] | None = None) -> tuple[dict[str, ModeRecord], list[ValRecord]]:
        """The configured mode(s): (rank 0's record per mode, validation records); other ranks get no records.
        ``real`` trains (:meth:`run_real`); the measured modes are timed by :func:`gpufeed.train.modes.time_modes`
        (with --measure each mode may extend its windows until they settle, inside its share of measure_seconds).
        Rank 0 writes every rank's step marks as trace.json into the run folder."""
        try:
            if self.cfg.mode == "real":
                rec, vals = self.run_real(on_step)
                return ({"real": rec} if rec is not None else {}), vals
            return time_modes(self), []
        finally:
            if self.run_dir is not None and self.world.is_main and self.trace:
                write_trace(self.run_dir / TRACE_NAME, self.trace)

    def run_mode(self, mode: str, num_steps: int, *, deadline: float | None = None) -> ModeRecord | None:
        """One measured mode (synthetic, loader-only or real): num_steps timed steps after its warm-up; with a
        ``deadline`` (--measure, --fix), windows until they settle or it passes
        (:func:`gpufeed.train.modes.time_mode`)."""
        return time_mode(self, mode, num_steps, deadline=deadline)

    def run_real(self, on_step: Callable[[int], None] | None = None) -> tuple[ModeRecord | None, list[ValRecord]]:
        """The training run: resume, then for each step: train, log, validate at epoch ends and at the end,
        checkpoint on the one cadence rule (:meth:`Checkpointer.should_save`). ``on_step(step)`` ends each step."""
        if self.cfg.resume:
            self.load_checkpoint()
        self.current_mode = "real"
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
                    marks = real_step(self.compute, self.clock, self._epoch_batches(), self.to_device,
                                      batch_size=self.batch_size)
                    epoch_end, run_end = self._advance()
                    prof.step()
                    self.count_step("real", marks, meter, last=run_end)
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
        return record_mode(self, "real", meter), vals

    # ---- steps
    def to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A batch to the device (non-blocking); the first of each mode described into :attr:`batches_seen`."""
        x, y = self.loader.to_device(batch, self.device, non_blocking=True)
        if self.current_mode not in self.batches_seen:
            self.batches_seen[self.current_mode] = describe_batch(x)
        return x, y

    def timing_window(self, mode: str, num_steps: int) -> tuple[int, int]:
        """(warm-up steps, timed steps) of ``mode`` in this run (:func:`gpufeed.train.steps.timing_window`)."""
        lc = self.loader_cfg
        return timing_window(mode, num_steps, warmup_steps=self.cfg.timing_warmup_steps, num_workers=lc.num_workers,
                             prefetch_factor=lc.prefetch_factor, accum=self.accum, has_loader=self.loader is not None)

    def _real_warmup(self) -> int:
        """Timing warm-up steps of run_real: at least one step is timed, however short the run."""
        return min(self.timing_window("real", 0)[0], max(0, self.total_steps - self.step - 1))

    def count_step(self, mode: str, marks: StepMarks, meter: Meter, *, last: bool) -> None:
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
