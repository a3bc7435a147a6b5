"""One step of each mode (docs/design.md §4), marked for :func:`gpufeed.measure.timing.resolve`: the real step
(micro-batches from the loader), the synthetic step (a fixed batch already on the device: the compute ceiling)
and :func:`timing_window`, the warm-up and timed steps of a mode. (The loader-only mode, the loader ceiling, is
measured by the harness tune uses: :func:`gpufeed.measure.stream.measure_stream`.)

Nothing here waits for the device: the marks are read in bulk at log steps.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch

from gpufeed.measure.timing import Clock, StepMarks
from gpufeed.model import Amp, LrSchedule

Batch = tuple[torch.Tensor, torch.Tensor]
ToDevice = Callable[[Any], Batch]


@dataclass
class Model:
    """The model as the steps hold it: its weights, its DDP wrapper (None on one rank) and what the steps call
    (DDP or the module, compiled with --compile)."""

    module: torch.nn.Module
    ddp: Any
    forward: Callable[[torch.Tensor], torch.Tensor]


def normalize_inputs(images: torch.Tensor, *, channels_last: bool) -> torch.Tensor:
    from gpufeed.loader import normalize

    return normalize(images, dtype=torch.float32, channels_last=channels_last)


class Compute:
    """Forward, backward and the optimizer step over ``accum`` micro-batches; the last loss and LR are kept for
    the log and the record."""

    def __init__(self, model: Model, optimizer: torch.optim.Optimizer, amp: Amp, schedule: LrSchedule,
                 criterion: torch.nn.Module, *, accum: int, channels_last: bool) -> None:
        self.model, self.optimizer, self.amp, self.schedule = model, optimizer, amp, schedule
        self.criterion, self.accum, self.channels_last = criterion, accum, channels_last
        self.last_loss: torch.Tensor | None = None
        self.step_lr: float = optimizer.param_groups[0]["lr"]
        """The LR the last optimizer step used."""

    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, last: bool) -> torch.Tensor:
        """One micro-batch: normalise on the device, forward under autocast, scaled backward.

        Gradients are synchronised across ranks on the last micro-batch only (DDP ``no_sync``)."""
        ddp = self.model.ddp
        sync = contextlib.nullcontext() if (ddp is None or last) else ddp.no_sync()
        with sync:
            inputs = normalize_inputs(x, channels_last=self.channels_last)
            with self.amp.autocast():
                out = self.model.forward(inputs)
                loss = self.criterion(out.float(), y) / self.accum
            self.amp.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.amp.scaler.step(self.optimizer)
        self.amp.scaler.update()
        self.schedule.step()

    def accumulate(self, marks: StepMarks, next_batch: Callable[[], Batch]) -> None:
        """One optimizer step over ``accum`` micro-batches from ``next_batch``, the compute of each marked."""
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = None
        for i in range(self.accum):
            x, y = next_batch()
            last = i == self.accum - 1

            def work() -> torch.Tensor:
                loss = self.forward_backward(x, y, last=last)
                if last:
                    self.optimizer_step()
                return loss

            loss = marks.compute(work)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        self.last_loss = loss_sum


def real_step(compute: Compute, clock: Clock, batches: Iterator[Any], to_device: ToDevice, *,
              batch_size: int) -> StepMarks:
    """A training step on the loader's batches: each fetch (the wait in next() and the copy) and compute marked."""
    marks = StepMarks(clock).begin()
    compute.accumulate(marks, lambda: marks.fetch(batches, to_device))
    return marks.finish(batch_size * compute.accum)


class SyntheticStep:
    """The compute ceiling: the training step on one fixed uint8 batch made on the device (seeded from ``seed``, in the
    loader's memory layout), with no fetch."""

    def __init__(self, compute: Compute, clock: Clock, *, seed: int, batch_size: int, image_size: int,
                 num_classes: int, device: torch.device) -> None:
        self.compute, self.clock = compute, clock
        self.seed, self.batch_size, self.image_size = seed, batch_size, image_size
        self.num_classes, self.device = num_classes, device
        self._batch: Batch | None = None

    def batch(self) -> Batch:
        if self._batch is None:
            g = torch.Generator().manual_seed(self.seed + 1)
            x = torch.randint(0, 256, (self.batch_size, 3, self.image_size, self.image_size), dtype=torch.uint8,
                              generator=g)
            y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g)
            # laid out as the loader delivers its batches (NHWC memory, :mod:`gpufeed.loader.dataset`), so that the
            # ceiling pays the same layout conversion in normalize as the real step does
            x = x.contiguous(memory_format=torch.channels_last)
            self._batch = (x.to(self.device), y.to(self.device))
        return self._batch

    def __call__(self, _batches: Iterator[Any] | None = None) -> StepMarks:
        marks = StepMarks(self.clock).begin()
        self.compute.accumulate(marks, self.batch)
        return marks.finish(self.batch_size * self.compute.accum)


def timing_window(mode: str, num_steps: int, *, warmup_steps: int, num_workers: int, prefetch_factor: int,
                  accum: int, has_loader: bool) -> tuple[int, int]:
    """(warm-up steps, timed steps) of ``mode``. With W workers prefetching P batches each, the first ~W x P
    batches come from a backlog filled during start-up: timing them would overstate the loader and hide the stall.
    So the warm-up drains that backlog, and the window holds at least two batches per worker."""
    if mode == "synthetic" or not has_loader:
        return warmup_steps, num_steps
    backlog = num_workers * prefetch_factor if num_workers > 0 else 0
    per_step = 1 if mode == "loader-only" else accum
    return max(warmup_steps, -(-backlog // per_step) + 1), max(num_steps, -(-2 * num_workers // per_step))


def describe_batch(x: torch.Tensor) -> str:
    """The batch as the model gets it, before normalisation: ``uint8 [4, 3, 32, 32] contiguous cpu`` (the layout is
    ``channels_last``, ``contiguous`` or ``strided``): real and synthetic batches compare by this."""
    if x.dim() == 4 and not x.is_contiguous() and x.is_contiguous(memory_format=torch.channels_last):
        layout = "channels_last"
    else:
        layout = "contiguous" if x.is_contiguous() else "strided"
    return f"{str(x.dtype).removeprefix('torch.')} {list(x.shape)} {layout} {x.device.type}"
