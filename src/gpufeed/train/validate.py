"""Validation at epoch ends and at the end of a run (docs/design.md §5): top-1/top-5 and the loss on every rank's
(equal) share of the validation set, summed over ranks."""

from __future__ import annotations

from typing import Any

import torch

from gpufeed.core.world import World
from gpufeed.model import Amp
from gpufeed.train.records import ValRecord
from gpufeed.train.steps import normalize_inputs


class Validator:
    """The validation loader and what it runs: the model's weights (not DDP: no gradients to sync) under AMP."""

    def __init__(self, loader: Any, module: torch.nn.Module, amp: Amp, world: World, *, num_classes: int,
                 channels_last: bool) -> None:
        self.loader, self.module, self.amp, self.world = loader, module, amp, world
        self.device = torch.device(world.device)
        self.num_classes, self.channels_last = num_classes, channels_last

    @torch.no_grad()
    def run(self, epoch: int, step: int) -> ValRecord:
        """Top-1/top-5 on every rank's share of the validation set, summed over ranks; the model is back in
        training mode afterwards."""
        self.module.eval()
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, top1, top5, n
        k = min(5, self.num_classes)
        for batch in self.loader:
            x, y = self.loader.to_device(batch, self.device, non_blocking=True)
            inputs = normalize_inputs(x, channels_last=self.channels_last)
            with self.amp.autocast():
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
        return ValRecord(epoch=epoch, step=step, num_samples=int(stats[3]), loss=float(stats[0]) / n,
                         top1_pct=100.0 * float(stats[1]) / n, top5_pct=100.0 * float(stats[2]) / n)
