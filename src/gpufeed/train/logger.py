"""The run's log (docs/design.md §4): every ``log_every`` steps, one sync with the device, then a line of
log.jsonl (rank 0, with a run folder) and the progress bar's postfix (rank 0, with ``progress``; the bar is made
through :mod:`gpufeed.core.progress`)."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Any, Iterator

import torch

from gpufeed.core.records import append_jsonl, utc_now
from gpufeed.core.world import World
from gpufeed.measure.timing import Clock, Meter, RankTiming, StepMarks, resolve
from gpufeed.train.records import LOG_NAME


def memory_bytes(world: World) -> int:
    """The device's peak allocated bytes on CUDA, the process's resident bytes on the CPU."""
    if world.is_cuda:
        return int(torch.cuda.max_memory_allocated(torch.device(world.device)))
    import psutil

    return int(psutil.Process().memory_info().rss)


class RunLogger:
    """The steps since the last log record, the progress bar, and log.jsonl."""

    def __init__(self, world: World, clock: Clock, *, run_dir: Path | None, log_every: int, progress: bool) -> None:
        self.world, self.clock = world, clock
        self.run_dir, self.log_every, self.progress = run_dir, log_every, progress
        self._window: list[StepMarks] = []
        self._bar: Any = None

    @contextlib.contextmanager
    def bar(self, total: int, initial: int, desc: str) -> Iterator[None]:
        """A tqdm bar on stderr for the ``with`` body (rank 0 with ``progress`` only; :meth:`log` sets its
        postfix), closed on the way out."""
        if self.world.is_main and self.progress:
            from gpufeed.core.progress import bar

            self._bar = bar(total=total, initial=initial, desc=desc, unit="step", leave=False)
        try:
            yield
        finally:
            if self._bar is not None:
                self._bar.close()
            self._bar = None

    def count(self, mode: str, marks: StepMarks, meter: Meter, *, last: bool, step: int, epoch: int,
              loss: torch.Tensor | None, lr: float) -> None:
        """A step done: into the meter and the progress bar; every log_every steps, and after the ``last`` step
        (which ends the timed window first), the steps since the last record go to :meth:`log`."""
        meter.add(marks)
        self._window.append(marks)
        if self._bar is not None:
            self._bar.update(1)
        if last:
            meter.stop()
        if last or len(self._window) >= self.log_every:
            self.log(mode, self._window, meter, step=step, epoch=epoch, loss=loss, lr=lr)
            self._window = []

    def end(self, mode: str, meter: Meter, *, step: int, epoch: int, loss: torch.Tensor | None, lr: float) -> None:
        """The mode ends after the step just counted (--measure's windows settled or its budget ran out): the timed
        window closes, and the steps since the last record are logged."""
        meter.stop()
        self.log(mode, self._window, meter, step=step, epoch=epoch, loss=loss, lr=lr)
        self._window = []

    def window(self, timing: RankTiming, *, mode: str, step: int, epoch: int) -> None:
        """A mode measured by the loader-ceiling harness (loader-only): one log.jsonl record per timed window."""
        if self.run_dir is None or not self.world.is_main:
            return
        n = len(timing.window_rates)
        for i, rate in enumerate(timing.window_rates):
            append_jsonl(self.run_dir / LOG_NAME, {
                "time": utc_now(), "mode": mode, "step": step, "epoch": epoch, "rank": self.world.rank,
                "window": i, "num_steps": timing.num_steps // max(1, n), "samples_per_s": rate,
                "samples_per_s_all_ranks_est": rate * self.world.world_size, "stall_pct": 100.0,
                "memory_bytes": memory_bytes(self.world)})

    def log(self, mode: str, marks: list[StepMarks], meter: Meter, *, step: int, epoch: int,
            loss: torch.Tensor | None, lr: float) -> None:
        """The only place steps are read during a run: one sync, then the window's record (log.jsonl)."""
        if not marks:
            return
        window = resolve(self.clock, marks)
        meter.settle()
        step_s = sum(w[0] for w in window)
        wait = sum(w[1] + w[2] for w in window)
        samples = sum(w[4] for w in window)
        loss_value = float(loss) if loss is not None else None
        rate = samples / step_s if step_s > 0 else 0.0
        world = self.world
        if self._bar is not None:
            self._bar.set_postfix(loss=f"{loss_value:.3f}" if loss_value is not None else "-",
                                  sps=f"{rate * world.world_size:.0f}",
                                  stall=f"{100 * wait / step_s:.0f}%" if step_s else "-", refresh=False)
        if self.run_dir is None or not world.is_main:
            return
        append_jsonl(self.run_dir / LOG_NAME, {
            "time": utc_now(), "mode": mode, "step": step, "epoch": epoch, "rank": world.rank,
            "num_steps": len(window), "samples_per_s": rate, "samples_per_s_all_ranks_est": rate * world.world_size,
            "data_wait_s": wait, "next_wait_s": sum(w[1] for w in window), "h2d_s": sum(w[2] for w in window),
            "compute_s": sum(w[3] for w in window), "step_s": step_s,
            "stall_pct": 100.0 * wait / step_s if step_s > 0 else 0.0,
            "loss": loss_value, "lr": lr, "memory_bytes": memory_bytes(world),
        })
