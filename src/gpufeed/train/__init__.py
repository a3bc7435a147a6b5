"""``gpufeed train`` inside one rank: AMP + DDP ResNet training that measures whether the GPUs are fed
(docs/design.md §4).

One code path for every device: NCCL on CUDA, gloo on CPU. :mod:`gpufeed.train.launch` starts the ranks (in this
process, or through torchrun: ``python -m gpufeed.train CONFIG`` is each rank's entry point); :func:`train`
runs one rank and rank 0 writes the summary (:mod:`gpufeed.train.report`).

Modes
- ``real``: train on the shards (epochs/steps, validation, checkpoints, resume): :meth:`Trainer.run_real`;
- ``synthetic``: a fixed uint8 batch already on the device, same step: the compute ceiling (the GPU ceiling,
  or the "compute ceiling (CPU)" when training on the CPU);
- ``loader-only``: the loader alone, batches moved to the device and dropped: the loader ceiling;
- ``measure``: synthetic, loader-only and real, briefly, in that order, then the verdict.

Per step and rank we time, on the device's own timeline (:mod:`gpufeed.measure.timing`: CUDA events on the
compute stream; perf_counter on CPU, where the work is synchronous): the time the device sits idle while
the host waits in ``next(loader)`` (not the host's whole wait: while compute is still queued the device is
busy), the host-to-device copy that is not overlapped with compute (``loader.to_device`` on the compute
stream: the step cannot start before it ends), compute (normalise + forward + backward + optimizer) and
the step. Nothing waits for the device per step: the marks are read in bulk at log steps and at the ends
of the timed window. Data stall % = Σ (data wait + copy) / Σ step time.
At the end of each mode the per-rank numbers, each tagged with its node (torchrun's GROUP_RANK), are
all-gathered and rank 0 writes the records, per rank and per node (:mod:`gpufeed.train.records`).

Each CUDA rank samples its GPU's health through NVML for the whole run (:mod:`gpufeed.measure.health`); rank 0 writes
the series (gpu_health.jsonl) and the per-GPU summary (summary.json ``gpu_health``).

Checkpoints (:mod:`gpufeed.train.checkpoint`) are saved on one cadence rule and checked before ``--resume`` loads them.

Failures: a GpufeedError raised before this rank read data or computed (a bad shard set, a refused checkpoint)
keeps exit code 2; one raised after that (a corrupt shard mid-epoch) becomes a RunError (exit 1). SIGTERM is
noted (:class:`StopRequest`) and acted on at the next step boundary, by every rank at the same step: a checkpoint
when checkpoints are on, then :class:`gpufeed.core.errors.Interrupted` (exit 143), and no summary.

Entry points: :func:`train` (inside one rank), :func:`measure` (the three modes in this process, for scripts).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import random
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gpufeed.train.checkpoint import Checkpointer, Resume, RngState, set_identity
from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, DataError, GpufeedError, Interrupted, RunError, signal_name
from gpufeed.measure.health import HEALTH_NAME, GpuHealth, HealthSampler
from gpufeed.loader import LoaderPosition
from gpufeed.core.records import append_jsonl, utc_now, write_jsonl
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.timing import Clock, CudaClock, HostClock, Meter, StepMarks, resolve
from gpufeed.train.records import LOG_NAME, ModeRecord, TrainRecord, ValRecord, aggregate
from gpufeed.measure.verdict import VerdictInputs, classify
from gpufeed.core.world import World

MODES_MEASURE = ("synthetic", "loader-only", "real")


class StopRequest:
    """SIGTERM (a scheduler's preemption) noted by a handler, acted on at the next step boundary
    (:meth:`Trainer.stop_signal`): the rank saves a checkpoint there when checkpoints are on, then stops with
    :class:`gpufeed.core.errors.Interrupted` (exit 143). Installed in the main thread only (elsewhere ``signum``
    stays 0 and SIGTERM keeps its handler); :meth:`restore` puts the previous handler back."""

    SIGNALS = ("SIGTERM",)

    def __init__(self) -> None:
        import signal
        import threading

        self.signum = 0
        self._old: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for name in self.SIGNALS:
                sig = getattr(signal, name)
                self._old[sig] = signal.signal(sig, self._note)

    def _note(self, signum: int, _frame: Any) -> None:
        self.signum = self.signum or signum

    def restore(self) -> None:
        import signal

        for sig, old in self._old.items():
            signal.signal(sig, old if old is not None else signal.SIG_DFL)
        self._old = {}


# --------------------------------------------------------------------------- helpers


def lr_at(step: int, *, total: int, warmup: int, peak: float, floor: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_warmup(total: int) -> int:
    return min(2000, total // 20)


def resolve_amp(amp: str, device: torch.device) -> tuple[str, str | None]:
    """``amp`` with ``auto`` resolved for ``device`` -> (bf16 | fp16 | off, a note saying what auto chose).

    auto: bf16 on CUDA devices with native bf16 (compute capability 8.0+), fp16 (with a GradScaler) on older
    CUDA devices, off on the CPU, where bf16 autocast is emulated, and many times slower than float32, unless the
    CPU has native bf16 instructions (AVX512-BF16, AMX): an explicit ``bf16`` is kept as asked."""
    if amp != "auto":
        return amp, None
    if device.type != "cuda":
        return "off", "amp auto -> off (CPU)"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return "bf16", f"amp auto -> bf16 (compute capability {major}.{minor})"
    return "fp16", f"amp auto -> fp16 with a GradScaler (compute capability {major}.{minor} has no native bf16)"


def _normalize(images: torch.Tensor, *, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    from gpufeed.loader import normalize

    return normalize(images, dtype=dtype, channels_last=channels_last)


def run_loader_config(cfg: TrainConfig, loader_cfg: LoaderConfig) -> LoaderConfig:
    """The [loader] section with the run's seed, batch size and image size."""
    overrides: dict[str, Any] = {"seed": cfg.seed}
    if cfg.batch_size is not None:
        overrides["batch_size"] = cfg.batch_size
    if cfg.image_size is not None:
        overrides["image_size"] = cfg.image_size
    return dataclasses.replace(loader_cfg, **overrides)


def steps_per_epoch(cfg: TrainConfig, loader: Any) -> int:
    """Optimizer steps per epoch of ``loader``; a DataError when it has fewer batches than one step needs."""
    n_batches = len(loader)
    steps = n_batches // cfg.accum_steps
    if steps < 1:
        raise DataError(f"{cfg.shards}: {n_batches} batch(es) per rank per epoch at batch size "
                        f"{loader.cfg.batch_size} is fewer than accum_steps={cfg.accum_steps}")
    return steps


def check_classes(cfg: TrainConfig, train: Any, val: Any) -> None:
    """The model's outputs cover every label of the training set, and the validation set uses the same class
    list in the same order (its labels index its own list): else labels would be out of range mid-run or top-1
    silently wrong. ``train``/``val`` are manifests or None. Raises ConfigError/DataError (exit 2)."""
    from gpufeed.shardset.manifest import class_count_problem

    why = None if train is None else class_count_problem(train.num_classes, train.num_samples)
    if why:
        raise DataError(f"{cfg.shards} lists {why}; the model's head would be sized for classes no sample has "
                        f"(index the set again with the right --classes)")
    if train is not None and cfg.num_classes is not None and cfg.num_classes < train.num_classes:
        raise ConfigError(f"num_classes = {cfg.num_classes} is fewer than the {train.num_classes} classes of "
                          f"{cfg.shards}; labels would be out of range")
    if train is not None and val is not None and list(val.classes) != list(train.classes):
        differ = next((i for i, (a, b) in enumerate(zip(train.classes, val.classes)) if a != b),
                      min(len(train.classes), len(val.classes)))
        raise DataError(f"{cfg.val_shards} lists {val.num_classes} classes and {cfg.shards} {train.num_classes}, "
                        f"first differing at index {differ}: validation labels would not mean the training classes")




def _memory_bytes(world: World) -> int:
    if world.is_cuda:
        return int(torch.cuda.max_memory_allocated(torch.device(world.device)))
    import psutil

    return int(psutil.Process().memory_info().rss)

# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Everything one rank holds: model (DDP, compiled), optimizer, LR schedule, AMP, loaders, checkpointer.

    :meth:`run` runs the configured mode: :meth:`run_real` trains, :meth:`run_mode` times one mode of
    ``--measure``, ``--synthetic`` or ``--loader-only``."""

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
        self.batch_size = self.loader_cfg.batch_size
        self.image_size = self.loader_cfg.image_size
        self.accum = cfg.accum_steps
        self.num_nodes = world.num_nodes
        self._set_up_device()

        self.loader, self.val_loader = self._build_loaders()
        self.manifest = self.loader.manifest if self.loader is not None else None
        self.num_classes = cfg.num_classes or (self.manifest.num_classes if self.manifest else 1000)
        check_classes(cfg, self.manifest, self.val_loader.manifest if self.val_loader is not None else None)
        self.module, self.ddp, self.model = self._build_model()
        self.optimizer = self._build_optimizer()
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        self._set_up_amp()

        # schedule: total steps known once the loader length is
        if self.loader is not None:
            self.steps_per_epoch = steps_per_epoch(cfg, self.loader)
        else:
            self.steps_per_epoch = cfg.steps or cfg.measure_steps
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(self.total_steps)
        self.scheduler = self._schedule(0)
        self.checkpointer = Checkpointer(cfg, self.loader_cfg, world, model=self.module, optimizer=self.optimizer,
                                         scaler=self.scaler, num_classes=self.num_classes,
                                         total_steps=self.total_steps, gather=self.gather, notes=self.notes,
                                         shard_set=set_identity(self.manifest) if self.manifest is not None else None)

        self.step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.last_loss: torch.Tensor | None = None
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        """The LR the last optimizer step used."""
        self.start_step = 0
        self.started = False
        """True once this rank began reading data or computing: a failure after that is a RunError (exit 1)."""
        self.resume_rng: RngState | None = None
        self.resume_position: LoaderPosition | None = None
        """The checkpoint's loader position, for the first epoch after --resume."""
        """This rank's RNG state from the checkpoint, applied once the loader is back at its position."""
        self._batches: Iterator[Any] | None = None
        """The current epoch's batches (run_real), opened at the epoch's first step."""
        self._window: list[StepMarks] = []
        """The steps since the last log record."""
        self._synthetic: tuple[torch.Tensor, torch.Tensor] | None = None
        self._progress = None
        self.stop: StopRequest | None = None
        """Set by :func:`train`: the SIGTERM this rank was sent, checked at every step boundary."""
        self._control: Any = None
        """Under NCCL, the gloo group the stop flag is all-reduced on (no device sync per step)."""

    # ---- set-up
    def _set_up_device(self) -> None:
        if self.cuda:
            torch.cuda.set_device(self.device)  # events, streams and NCCL use the current device
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
            if self.cfg.threads:
                torch.set_num_threads(self.cfg.threads)
        else:
            from gpufeed.core.system import usable_cpus

            torch.set_num_threads(self.cfg.threads or max(1, usable_cpus() // self.world.local_world_size))

    def _build_loaders(self) -> tuple[Any, Any]:
        """(training loader or None, validation loader or None) for this rank."""
        cfg = self.cfg
        if cfg.mode not in ("real", "loader-only", "measure"):
            return None, None
        if not cfg.shards:
            raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
        from gpufeed.loader import build_loader

        loader = build_loader(cfg.shards, self.loader_cfg, self.world, train=True, epoch=0, manifest_file=cfg.manifest)
        val_loader = None
        if cfg.val_shards and cfg.mode == "real":
            # no persistent workers: they would sit idle (holding memory) through every training epoch
            val_cfg = dataclasses.replace(self.loader_cfg, persistent_workers=False)
            val_loader = build_loader(cfg.val_shards, val_cfg, self.world, train=False, epoch=0)
        return loader, val_loader

    def _build_model(self) -> tuple[torch.nn.Module, Any, Any]:
        """(the model, its DDP wrapper or None, what the steps call: DDP or the model, compiled with --compile);
        weights seeded from cfg.seed."""
        import numpy as np
        import torchvision

        cfg = self.cfg
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        np.random.seed(cfg.seed % 2**32)
        module = getattr(torchvision.models, cfg.arch)(weights=None, num_classes=self.num_classes,
                                                        zero_init_residual=True)
        module = module.to(self.device)
        if cfg.channels_last:
            module = module.to(memory_format=torch.channels_last)
        model, ddp = module, None
        if self.world.is_distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            ddp = DDP(module, device_ids=[self.device.index] if self.cuda else None, gradient_as_bucket_view=True)
            model = ddp
        return module, ddp, torch.compile(model) if cfg.compile else model

    def _build_optimizer(self) -> torch.optim.Optimizer:
        """SGD with momentum; no weight decay on biases and BatchNorm parameters."""
        decay, no_decay = [], []
        for p in self.module.parameters():
            (no_decay if p.ndim <= 1 else decay).append(p)
        return torch.optim.SGD(
            [{"params": decay, "weight_decay": self.cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=self.cfg.lr, momentum=self.cfg.momentum)

    def _set_up_amp(self) -> None:
        """amp (auto resolved, with a note), the autocast context and the GradScaler (enabled for fp16)."""
        dev_type = "cuda" if self.cuda else "cpu"
        self.amp, note = resolve_amp(self.cfg.amp, self.device)
        if note:
            self.notes.append(note)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[self.amp]
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device_type=dev_type, dtype=self.amp_dtype)) if self.amp_dtype is not None
            else contextlib.nullcontext)
        self.scaler = torch.amp.GradScaler(dev_type, enabled=self.amp == "fp16")

    def synthetic_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._synthetic is None:
            g = torch.Generator().manual_seed(self.cfg.seed + 1)
            x = torch.randint(0, 256, (self.batch_size, 3, self.image_size, self.image_size), dtype=torch.uint8,
                              generator=g)
            y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g)
            self._synthetic = (x.to(self.device), y.to(self.device))
        return self._synthetic

    def _cycle(self) -> Iterator[Any]:
        """Batches across epoch boundaries (measure mode)."""
        epoch = self.epoch
        while True:
            self.loader.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    # ---- compute
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, last: bool) -> torch.Tensor:
        """One micro-batch: normalise on the device, forward under autocast, scaled backward.

        Gradients are synchronised across ranks on the last micro-batch only (DDP ``no_sync``)."""
        sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
        with sync:
            inputs = _normalize(x, dtype=torch.float32, channels_last=self.cfg.channels_last)
            with self.autocast():
                out = self.model(inputs)
                loss = self.criterion(out.float(), y) / self.accum
            self.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with warnings.catch_warnings():
            # fp16: GradScaler skips steps with inf/nan gradients; the schedule still follows the step count
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.to_device(batch, self.device, non_blocking=True)

    def train_step(self, source: str, it: Iterator[Any] | None) -> StepMarks:
        """One optimizer step over accum_steps micro-batches, marked for :func:`gpufeed.measure.timing.resolve`.

        Nothing here waits for the device: the marks are read in bulk at log steps."""
        marks = StepMarks(self.clock).begin()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = None
        for i in range(self.accum):
            if source == "synthetic":
                x, y = self.synthetic_batch()
            else:
                x, y = marks.fetch(it, self._to_device)
            last = i == self.accum - 1

            def work() -> torch.Tensor:
                loss = self.forward_backward(x, y, last=last)
                if last:
                    self.optimizer_step()
                return loss

            loss = marks.compute(work)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        self.last_loss = loss_sum
        return marks.finish(self.batch_size * self.accum)

    def loader_step(self, it: Iterator[Any]) -> StepMarks:
        """Loader ceiling: fetch accum_steps batches, move them to the device, drop them.

        The copies are not waited for: the caching allocators keep the pinned host and the device buffers
        until the stream has used them."""
        marks = StepMarks(self.clock).begin()
        for _ in range(self.accum):
            marks.fetch(it, self._to_device)
        return marks.finish(self.batch_size * self.accum)

    # ---- collectives
    def gather(self, obj: Any) -> list[Any]:
        if not self.world.is_distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj)
        return out

    def param_checksum(self) -> float:
        """Σ of every parameter in float64: equal on all ranks when DDP kept them in sync. (BatchNorm running
        statistics are not parameters: DDP re-broadcasts them from rank 0 at each forward.)"""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.module.parameters()))

    # ---- validation
    @torch.no_grad()
    def validate(self) -> ValRecord:
        """Top-1/top-5 on every rank's (equal) share of the validation set, summed over ranks."""
        self.module.eval()
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, top1, top5, n
        k = min(5, self.num_classes)
        for batch in self.val_loader:
            x, y = self.val_loader.to_device(batch, self.device, non_blocking=True)
            inputs = _normalize(x, dtype=torch.float32, channels_last=self.cfg.channels_last)
            with self.autocast():
                out = self.module(inputs)
            out = out.float()
            stats[0] += torch.nn.functional.cross_entropy(out, y, reduction="sum").double()
            top = out.topk(k, dim=1).indices
            hit = top.eq(y[:, None])
            stats[1] += hit[:, :1].any(dim=1).sum()
            stats[2] += hit.any(dim=1).sum()
            stats[3] += y.numel()
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.all_reduce(stats)
        self.module.train()
        n = max(1.0, float(stats[3]))
        return ValRecord(epoch=self.epoch, step=self.step, num_samples=int(stats[3]), loss=float(stats[0]) / n,
                         top1_pct=100.0 * float(stats[1]) / n, top5_pct=100.0 * float(stats[2]) / n)

    # ---- checkpoints
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
        self.scheduler = self._schedule(resume.step)
        self.step = self.start_step = resume.step
        self.epoch, self.step_in_epoch = resume.epoch, resume.step_in_epoch
        if self.step_in_epoch == self.steps_per_epoch:  # written at the end of an epoch
            self._next_epoch()
        self.resume_rng = resume.rng
        self.resume_position = resume.position
        return resume

    def _schedule(self, step: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The LR schedule (:func:`lr_at` of this run) positioned after ``step`` optimizer steps: it sets each
        parameter group's LR for the next step."""
        total, warm, peak, floor = self.total_steps, self.warmup_steps, self.cfg.lr, self.cfg.min_lr
        for group in self.optimizer.param_groups:
            group["initial_lr"] = peak
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_at(s, total=total, warmup=warm, peak=peak, floor=floor) / peak if peak else 0.0,
            last_epoch=step - 1)

    # ---- logging
    def log(self, mode: str, marks: list[StepMarks], meter: Meter) -> None:
        """The only place steps are read during a run: one sync, then the window's record (log.jsonl)."""
        if not marks:
            return
        window = resolve(self.clock, marks)
        meter.settle()
        step_s = sum(w[0] for w in window)
        wait = sum(w[1] + w[2] for w in window)
        samples = sum(w[4] for w in window)
        loss = float(self.last_loss) if self.last_loss is not None else None
        lr = self.step_lr
        rate = samples / step_s if step_s > 0 else 0.0
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{loss:.3f}" if loss is not None else "-", sps=f"{rate * self.world.world_size:.0f}",
                                       stall=f"{100 * wait / step_s:.0f}%" if step_s else "-", refresh=False)
        if self.run_dir is None or not self.world.is_main:
            return
        append_jsonl(self.run_dir / LOG_NAME, {
            "time": utc_now(), "mode": mode, "step": self.step, "epoch": self.epoch, "rank": self.world.rank,
            "num_steps": len(window), "samples_per_s": rate, "samples_per_s_all_ranks_est": rate * self.world.world_size,
            "data_wait_s": wait, "next_wait_s": sum(w[1] for w in window), "h2d_s": sum(w[2] for w in window),
            "compute_s": sum(w[3] for w in window), "step_s": step_s,
            "stall_pct": 100.0 * wait / step_s if step_s > 0 else 0.0,
            "loss": loss, "lr": lr, "memory_bytes": _memory_bytes(self.world),
        })

    # ---- modes
    def run(self, on_step: Callable[[int], None] | None = None) -> tuple[dict[str, ModeRecord], list[ValRecord]]:
        """The configured mode(s): (rank 0's record per mode, validation records); other ranks get no records."""
        cfg = self.cfg
        if cfg.mode == "real":
            rec, vals = self.run_real(on_step)
            return ({"real": rec} if rec is not None else {}), vals
        modes, steps = (MODES_MEASURE, cfg.measure_steps) if cfg.mode == "measure" else \
            ((cfg.mode,), cfg.steps or cfg.measure_steps)
        records = {mode: self.run_mode(mode, steps) for mode in modes}
        return {mode: rec for mode, rec in records.items() if rec is not None}, []

    def run_mode(self, mode: str, num_steps: int) -> ModeRecord | None:
        """synthetic / loader-only / real (measure) for num_steps timed steps after the warm-up."""
        warm, num_steps = self.timing_window(mode, num_steps)
        meter = Meter(warm, self.cfg.log_every, self.world, self.clock)
        n = warm + num_steps
        it = None if mode == "synthetic" else self._cycle()
        self.started = True
        self.module.train()
        try:
            with self._progress_bar(n, 0, mode):
                for i in range(n):
                    meter.before_step()
                    if mode == "loader-only":
                        marks = self.loader_step(it)
                    else:
                        marks = self.train_step("synthetic" if mode == "synthetic" else "loader", it)
                        self.step += 1
                    self._count_step(mode, marks, meter, last=i == n - 1)
                    signum = self.stop_signal()
                    if signum:
                        raise Interrupted(f"interrupted by {signal_name(signum)} in {mode} mode after step "
                                          f"{i + 1} of {n}", signum)
        finally:
            del it  # the loader's workers stop here
        return self._aggregate(mode, meter)

    def run_real(self, on_step: Callable[[int], None] | None = None) -> tuple[ModeRecord | None, list[ValRecord]]:
        """The training run: resume, then for each step: train, log, validate at epoch ends and at the end,
        checkpoint on the one cadence rule (:meth:`Checkpointer.should_save`). ``on_step(step)`` ends each step."""
        if self.cfg.resume:
            self.load_checkpoint()
        self.started = True
        meter = Meter(self._real_warmup(), self.cfg.log_every, self.world, self.clock)
        vals: list[ValRecord] = []
        self.module.train()
        try:
            with self._progress_bar(self.total_steps, self.step, "train"):
                while self.step < self.total_steps:
                    meter.before_step()
                    marks = self.train_step("loader", self._epoch_batches())
                    epoch_end, run_end = self._advance()
                    self._count_step("real", marks, meter, last=run_end)
                    if epoch_end or run_end:
                        self._batches = None  # the loader's workers stop before validation
                    if self.val_loader is not None and (epoch_end or run_end):
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
            self._batches = None
        return self._aggregate("real", meter), vals

    def stop_signal(self) -> int:
        """At a step boundary: the signal to stop on, 0 to go on. Under DDP every rank's flag is all-reduced
        (max; one 4-byte all-reduce per step, on a gloo group under NCCL so that nothing waits for the device),
        so that all ranks stop after the same step, even when the signal reached only some of them."""
        local = self.stop.signum if self.stop is not None else 0
        if not self.world.is_distributed:
            return local
        import torch.distributed as dist

        if not dist.is_initialized():
            return local
        if self._control is None and self.world.backend != "gloo":
            self._control = dist.new_group(backend="gloo")
        flag = torch.tensor([local], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control)
        return int(flag.item())

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

    def _real_warmup(self) -> int:
        """Timing warm-up steps of run_real: at least one step is timed, however short the run."""
        return min(self.timing_window("real", 0)[0], max(0, self.total_steps - self.step - 1))

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

    def _count_step(self, mode: str, marks: StepMarks, meter: Meter, *, last: bool) -> None:
        """A step done: into the meter and the progress bar; every log_every steps, and after the ``last`` step
        (which ends the timed window first), the steps since the last record go to :meth:`log`."""
        meter.add(marks)
        self._window.append(marks)
        if self._progress is not None:
            self._progress.update(1)
        if last:
            meter.stop()
        if last or len(self._window) >= self.cfg.log_every:
            self.log(mode, self._window, meter)
            self._window = []

    def timing_window(self, mode: str, num_steps: int) -> tuple[int, int]:
        """(warm-up steps, timed steps). With W workers prefetching P batches each, the first ~W x P batches
        come from a backlog filled during start-up: timing them would overstate the loader and hide the stall.
        So the warm-up drains that backlog, and the window holds at least two batches per worker."""
        warm = self.cfg.timing_warmup_steps
        if mode == "synthetic" or self.loader is None:
            return warm, num_steps
        w = self.loader_cfg.num_workers
        backlog = w * self.loader_cfg.prefetch_factor if w > 0 else 0
        per_step = 1 if mode == "loader-only" else self.accum
        return max(warm, -(-backlog // per_step) + 1), max(num_steps, -(-2 * w // per_step))

    def _aggregate(self, mode: str, meter: Meter) -> ModeRecord | None:
        """This rank's timed window, tagged with its node, all-gathered; rank 0 gets the mode's record (with the
        per-node sums), the other ranks None."""
        import socket

        timing = dataclasses.replace(meter.finish(), node=self.world.node_rank, host=socket.gethostname())
        ranks = self.gather(timing)
        loss = float(self.last_loss) if (self.last_loss is not None and mode != "loader-only") else None
        return aggregate(mode, ranks, self.num_nodes, loss) if self.world.is_main else None

    @contextlib.contextmanager
    def _progress_bar(self, total: int, initial: int, desc: str) -> Iterator[None]:
        """A tqdm bar on stderr for the ``with`` body (rank 0 with cfg.progress only; :meth:`log` sets its
        postfix), closed on the way out."""
        if self.world.is_main and self.cfg.progress:
            from gpufeed.core.progress import bar

            self._progress = bar(total=total, initial=initial, desc=desc, unit="step", leave=False)
        try:
            yield
        finally:
            if self._progress is not None:
                self._progress.close()
            self._progress = None



# --------------------------------------------------------------------------- entry points


def _init_distributed(world: World) -> bool:
    """Join the process group torchrun set up the environment for; True when this call created it. The launch
    environment is checked first (:func:`gpufeed.core.world.check_launch_env`, exit 2) and the rendezvous is bounded
    (:func:`gpufeed.core.world.join`: a RunError naming the ranks that did not come)."""
    from gpufeed.core.world import check_launch_env, join

    check_launch_env()
    if not world.is_distributed:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if world.is_cuda:
        torch.cuda.set_device(torch.device(world.device))
    store = join(world)
    dist.init_process_group(backend=world.backend, store=store, rank=world.rank, world_size=world.world_size)
    return True


def given_storage_rate(cfg: TrainConfig) -> StorageRate | None:
    """The storage rate the user gave: ``--storage-rate`` or a ``gpufeed io`` record of the shard set's folder
    (``storage_record``; DataError, exit 2, when it is not one); None when neither was given."""
    if cfg.storage_bytes_per_s is not None:
        return StorageRate(bytes_per_s=cfg.storage_bytes_per_s, source="--storage-rate", path=cfg.shards)
    if cfg.storage_record is not None:
        if not cfg.shards:
            raise ConfigError("storage_record needs --shards: it is the read rate of the shard set's folder")
        from gpufeed.measure.storage_probe import io_record_rate

        return io_record_rate(cfg.storage_record, cfg.shards)
    return None


def probe_storage(cfg: TrainConfig) -> StorageRate | None:
    """``--measure`` without a given rate: probe the shard set's read rate for ``cfg.storage_probe_s`` seconds
    (:func:`gpufeed.measure.storage_probe.probe`), before the modes; None when the probe is off (0 s) or there are no shards.
    The probe reads from this node only: on several nodes it stands for each node's storage."""
    if cfg.mode != "measure" or cfg.storage_probe_s <= 0 or not cfg.shards:
        return None
    from gpufeed.measure.storage_probe import probe

    return probe(cfg.shards, cfg.storage_probe_s, manifest=cfg.manifest)


def _shm_free_bytes() -> int | None:
    """Free bytes in /dev/shm; None where there is none."""
    import shutil

    try:
        return int(shutil.disk_usage("/dev/shm").free)
    except OSError:
        return None


def verdict_inputs(modes: dict[str, ModeRecord], trainer: Trainer,
                   storage: StorageRate | None = None) -> VerdictInputs | None:
    """The verdict's numbers: the modes' records, the run's layout, and the storage rate with the sizes its
    stage fix names (the set's bytes, /dev/shm's free bytes)."""
    real = modes.get("real")
    if real is None or real.num_steps == 0:
        return None
    synth, lonly = modes.get("synthetic"), modes.get("loader-only")
    from gpufeed.core.system import usable_cpus

    manifest = trainer.manifest
    read_rate = (lonly or real).read_bytes_per_s
    from gpufeed.shardset.source import is_url

    remote = is_url(str(trainer.cfg.shards or ""))
    if manifest is not None and remote:
        # a remote set is read over sockets, which the storage I/O counters behind read_bytes do not count: the
        # loader moves the manifest's mean bytes per sample, so it reads its samples/s (per node) times that
        read_rate = (lonly or real).samples_per_s / max(1, trainer.num_nodes) * manifest.mean_sample_bytes
    set_bytes = manifest.total_bytes if manifest else None
    stage_nodes = trainer.num_nodes if trainer.loader_cfg.shard_split == "node" and trainer.num_nodes > 1 else None
    if manifest is not None and stage_nodes:  # each node stages only its own shards: the largest share must fit
        from gpufeed.core.world import node_shards

        set_bytes = max(sum(manifest.shards[i].bytes for i in node_shards(len(manifest.shards), n, stage_nodes))
                        for n in range(stage_nodes))

    return VerdictInputs(
        stall_pct=real.stall_pct, end_to_end_rate=real.samples_per_s,
        gpu_ceiling=synth.samples_per_s if synth else None,
        loader_ceiling=lonly.samples_per_s if lonly else None,
        per_rank_stall_pct=tuple(r.stall_pct for r in real.per_rank),
        copy_wait_pct=real.copy_wait_pct,
        loader_cores_used=lonly.loader_cores_used if lonly else None,
        usable_cores=float(usable_cpus()), num_nodes=trainer.num_nodes,
        ranks_per_node=trainer.world.local_world_size,
        num_workers=trainer.loader_cfg.num_workers,
        remote_streams=trainer.loader_cfg.remote_streams if remote else None,
        read_bytes_per_s=read_rate,
        storage_bytes_per_s=storage.bytes_per_s if storage else None,
        storage_source=storage.source if storage else None,
        storage_ladder=tuple((int(r), float(b)) for r, b in storage.ladder) if storage else (),
        shards=trainer.cfg.shards, set_bytes=set_bytes, stage_nodes=stage_nodes,
        shm_free_bytes=_shm_free_bytes(),
        mean_sample_bytes=manifest.mean_sample_bytes if manifest else None,
        decode=trainer.loader_cfg.decode, is_cuda=trainer.cuda,
    )


def train(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *, run_dir: str | Path | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainRecord | None:
    """Run one rank. Rank 0 returns the TrainRecord (and writes summary.json, the chart and report.md into
    run_dir); other ranks return None. ``on_step(step)`` is called at the end of every real optimizer step
    (tests).

    A GpufeedError or OSError raised before the rank read data or computed (a bad shard set, a refused
    checkpoint) keeps its exit code 2; one raised after that (a corrupt shard met mid-epoch, a full disk while
    checkpointing) becomes a RunError (exit 1)."""
    t0 = time.perf_counter()
    started = utc_now()
    if run_dir is not None and world.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    created = _init_distributed(world)
    trainer: Trainer | None = None
    sampler: HealthSampler | None = None
    stop: StopRequest | None = None
    try:
        storage = given_storage_rate(cfg) if world.is_main else None
        trainer = Trainer(cfg, loader_cfg, world, run_dir=run_dir)
        trainer.stop = stop = StopRequest()
        sampler = start_health(world)
        if storage is None and world.is_main:
            storage = probe_storage(cfg)
        modes, vals = trainer.run(on_step)
        checksums = trainer.gather(trainer.param_checksum())
        if sampler is not None:
            sampler.stop()
        health = trainer.gather((sampler.result(), sampler.rows) if sampler is not None else (None, []))
        record = None
        if world.is_main:
            gpus = sorted((h for h, _ in health if h is not None), key=lambda h: h.rank)
            record = _record(trainer, modes, vals, checksums, run_dir=run_dir, wall_s=time.perf_counter() - t0,
                             started=started, storage=storage, gpu_health=gpus)
            if run_dir is not None:
                from gpufeed.train.report import write_report

                if gpus:
                    write_jsonl(Path(run_dir) / HEALTH_NAME, [row for _, rows in health for row in rows])
                write_report(Path(run_dir), record)
        if created:
            # leave together: a rank that tears gloo down while rank 0 still writes its report can abort at exit
            # ("terminate called without an active exception") and fail a run that finished
            import torch.distributed as dist

            dist.barrier()
        return record
    except GpufeedError as exc:
        if trainer is not None and trainer.started and not isinstance(exc, RunError):
            raise RunError(str(exc)) from exc
        raise
    except OSError as exc:  # a full disk or an I/O error while checkpointing or writing the report
        if trainer is not None and trainer.started:
            where = f" ({exc.filename})" if exc.filename else ""
            raise RunError(f"{exc.strerror or exc}{where}") from exc
        raise
    finally:
        if stop is not None:
            stop.restore()
        if sampler is not None:
            sampler.stop()
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def start_health(world: World) -> HealthSampler | None:
    """This rank's GPU health sampler, started (:mod:`gpufeed.measure.health`); None on the CPU or without NVML."""
    if not world.is_cuda:
        return None
    import socket

    sampler = HealthSampler(torch.device(world.device).index or 0, rank=world.rank, node=world.node_rank,
                            host=socket.gethostname())
    return sampler.start() if sampler.available else None


def _record(trainer: Trainer, modes: dict[str, ModeRecord], vals: list[ValRecord], checksums: list[float], *,
            run_dir: str | Path | None, wall_s: float, started: str,
            storage: StorageRate | None = None, gpu_health: list[GpuHealth] | None = None) -> TrainRecord:
    """Rank 0's TrainRecord of the run, with the storage rate, the GPUs' health and the verdict."""
    cfg, world, loader = trainer.cfg, trainer.world, trainer.loader
    vin = verdict_inputs(modes, trainer, storage)
    verdict = classify(vin) if vin is not None else None
    return TrainRecord(
        mode=cfg.mode, arch=cfg.arch, device=world.device, backend=world.backend, world_size=world.world_size,
        num_nodes=trainer.num_nodes, amp=trainer.amp, batch_size=trainer.batch_size, accum_steps=trainer.accum,
        global_batch=trainer.batch_size * trainer.accum * world.world_size, image_size=trainer.image_size,
        num_classes=trainer.num_classes, start_step=trainer.start_step, step=trainer.step,
        total_steps=trainer.total_steps, epoch=trainer.epoch,
        final_loss=float(trainer.last_loss) if trainer.last_loss is not None else None, final_lr=trainer.step_lr,
        modes=modes, val=vals, verdict=verdict, ok=verdict.ok if verdict else True,
        num_skipped=int(getattr(loader, "num_skipped", 0) or 0) if loader is not None else 0,
        num_repeated=int(getattr(loader, "num_repeated", 0) or 0) if loader is not None else 0,
        checkpoint=str(trainer.checkpointer.path) if trainer.checkpointer.path else None,
        run_dir=str(run_dir) if run_dir else None, wall_s=wall_s, started=started,
        notes=trainer.notes, rank_param_checksums=checksums, storage=storage, gpu_health=gpu_health or [],
        loader_read_bytes_per_s=vin.read_bytes_per_s if vin is not None else None,
    )


def measure(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World | None = None, steps_per_mode: int = 20,
            *, run_dir: str | Path | None = None) -> TrainRecord | None:
    """Compute ceiling, loader ceiling and real run in this process (scripts, benchmarks): the TrainRecord with
    ``modes`` {synthetic, loader-only, real} and the verdict. Rank 0 gets the record, other ranks None."""
    world = world or World.from_env(cfg.device)
    cfg = dataclasses.replace(cfg, mode="measure", measure_steps=steps_per_mode)
    return train(cfg, loader_cfg, world, run_dir=run_dir)

