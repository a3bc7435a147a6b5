"""The model, its optimizer, AMP and the LR schedule, as ``gpufeed train`` runs them and ``gpufeed plan`` measures
them (docs/design.md §1): one set-up, so that the plan's memory is the memory of the steps train takes.

:func:`build_model` (a torchvision ResNet, ``zero_init_residual``, channels_last when asked),
:func:`build_optimizer` (SGD with momentum or AdamW; no weight decay on biases and BatchNorm),
:func:`resolve_amp` and :class:`Amp` (the autocast context factory and the GradScaler, enabled for fp16), and
:func:`lr_at`/:class:`LrSchedule` (linear warm-up, then cosine decay). No DDP, no data: the trainer adds those.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from dataclasses import dataclass
from typing import Any, ContextManager

import torch

AMP_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}
"""Resolved ``amp`` -> the autocast dtype (None: no autocast)."""


def build_model(arch: str, num_classes: int, device: torch.device, *, channels_last: bool) -> torch.nn.Module:
    """torchvision ``arch`` with random weights (from the torch RNG as it stands), on ``device``."""
    import torchvision

    module = getattr(torchvision.models, arch)(weights=None, num_classes=num_classes, zero_init_residual=True)
    module = module.to(device)
    if channels_last:
        module = module.to(memory_format=torch.channels_last)
    return module


def build_optimizer(module: torch.nn.Module, *, name: str = "sgd", lr: float, momentum: float = 0.9,
                    weight_decay: float) -> torch.optim.Optimizer:
    """SGD with momentum (``sgd``) or AdamW (``adamw``) over two parameter groups: weight decay on the weights,
    none on biases and BatchNorm parameters (ndim <= 1)."""
    decay, no_decay = [], []
    for p in module.parameters():
        (no_decay if p.ndim <= 1 else decay).append(p)
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if name == "adamw":
        return torch.optim.AdamW(groups, lr=lr)
    return torch.optim.SGD(groups, lr=lr, momentum=momentum)


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


@dataclass(frozen=True)
class Amp:
    """Mixed precision on one device: :meth:`autocast` (a context factory) and the GradScaler (enabled for fp16
    only; a no-op otherwise)."""

    mode: str
    """bf16 | fp16 | off (``auto`` resolved)."""
    note: str | None
    """What ``auto`` chose, for the run's notes; None when amp was given."""
    device_type: str
    scaler: torch.amp.GradScaler

    @classmethod
    def build(cls, amp: str, device: torch.device, *, init_scale: float = 2.0**16) -> "Amp":
        mode, note = resolve_amp(amp, device)
        return cls(mode=mode, note=note, device_type=device.type,
                   scaler=torch.amp.GradScaler(device.type, init_scale=init_scale, enabled=mode == "fp16"))

    @property
    def dtype(self) -> torch.dtype | None:
        return AMP_DTYPES[self.mode]

    def autocast(self) -> ContextManager[Any]:
        dtype = self.dtype
        if dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)


def lr_at(step: int, *, total: int, warmup: int, peak: float, floor: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_warmup(total: int) -> int:
    return min(2000, total // 20)


class LrSchedule:
    """:func:`lr_at` of one run on ``optimizer``: it sets each parameter group's LR for the next step. Not saved in
    checkpoints: :meth:`seek` puts it after any step, since the schedule is a function of the step."""

    def __init__(self, optimizer: torch.optim.Optimizer, *, total: int, warmup: int, peak: float,
                 floor: float) -> None:
        self.optimizer = optimizer
        self.total, self.warmup, self.peak, self.floor = total, warmup, peak, floor
        self.scheduler = self._at(0)

    def _at(self, step: int) -> torch.optim.lr_scheduler.LambdaLR:
        total, warm, peak, floor = self.total, self.warmup, self.peak, self.floor
        for group in self.optimizer.param_groups:
            group["initial_lr"] = peak
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_at(s, total=total, warmup=warm, peak=peak, floor=floor) / peak if peak else 0.0,
            last_epoch=step - 1)

    def seek(self, step: int) -> None:
        """Position the schedule after ``step`` optimizer steps (a resume)."""
        self.scheduler = self._at(step)

    def step(self) -> None:
        with warnings.catch_warnings():
            # fp16: GradScaler skips steps with inf/nan gradients; the schedule still follows the step count
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()
