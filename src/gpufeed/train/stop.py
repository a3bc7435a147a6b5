"""SIGTERM inside a rank (docs/design.md §5): noted by a handler, acted on at the next step boundary by every rank at
the same step (:meth:`StopRequest.agreed`)."""

from __future__ import annotations

from typing import Any

import torch

from gpufeed.core.world import World


class StopRequest:
    """SIGTERM (a scheduler's preemption) noted by a handler, acted on at the next step boundary
    (:meth:`agreed`): the rank saves a checkpoint there when checkpoints are on, then stops with
    :class:`gpufeed.core.errors.Interrupted` (exit 143). Installed in the main thread only (elsewhere ``signum``
    stays 0 and SIGTERM keeps its handler); :meth:`restore` puts the previous handler back."""

    SIGNALS = ("SIGTERM",)

    def __init__(self) -> None:
        import signal
        import threading

        self.signum = 0
        self._old: dict[int, Any] = {}
        self._control: Any = None
        """Under NCCL, the gloo group the stop flag is all-reduced on (no device sync per step)."""
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

    def agreed(self, world: World) -> int:
        """At a step boundary: the signal to stop on, 0 to go on. Under DDP every rank's flag is all-reduced
        (max; one 4-byte all-reduce per step, on a gloo group under NCCL so that nothing waits for the device),
        so that all ranks stop after the same step, even when the signal reached only some of them."""
        local = self.signum
        if not world.is_distributed:
            return local
        import torch.distributed as dist

        if not dist.is_initialized():
            return local
        if self._control is None and world.backend != "gloo":
            self._control = dist.new_group(backend="gloo")
        flag = torch.tensor([local], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self._control)
        return int(flag.item())
