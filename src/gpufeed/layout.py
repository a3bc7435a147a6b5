"""The node layout a loader runs in: ranks per node, usable cores, cores left to each training process, device.

``gpufeed tune --nproc-per-node N`` sizes each rank's workers from :func:`worker_ceiling` and records the layout
it measured in a ``[layout]`` section (:class:`gpufeed.config.LayoutConfig`) next to ``[loader]``.
``gpufeed train`` asks :func:`run_warning` before it starts its ranks: one line when the run's layout is not the
tuned one or over-subscribes the node's cores, with the numbers, which the caller shows (nothing here prints).
Pure arithmetic apart from the node facts :func:`run_warning` reads; no torch at import time.
"""

from __future__ import annotations

import math
from typing import Literal

from gpufeed.config import LayoutConfig, LoaderConfig, TrainConfig

DeviceType = Literal["cpu", "cuda"]


def device_type(device: str) -> DeviceType:
    """``cuda`` for ``cuda`` / ``cuda:N``, else ``cpu``."""
    return "cuda" if device.split(":")[0] == "cuda" else "cpu"


def loader_cores(usable: int, ranks: int, trainer_cores: int, cpu_budget: float = 1.0) -> float:
    """Cores the loaders of all ``ranks`` may share: ``cpu_budget`` x the usable cores, and never more than what
    is left after each training process got its ``trainer_cores`` (0 when nothing is left)."""
    return max(0.0, min(cpu_budget * usable, float(usable - ranks * trainer_cores)))


def worker_ceiling(usable: int, ranks: int, trainer_cores: int, cpu_budget: float = 1.0) -> int:
    """Most DataLoader workers per rank: the loaders' cores split evenly over the ranks, rounded down (0 = load in
    the training process). So ``ranks x ceiling <= usable - ranks x trainer_cores``."""
    return math.floor(loader_cores(usable, ranks, trainer_cores, cpu_budget) / max(1, ranks) + 1e-9)


def check(loader: LoaderConfig, layout: LayoutConfig, *, ranks: int, usable: int, device: str) -> str | None:
    """The one-line warning for a run of ``ranks`` per node on ``usable`` cores with batches on ``device``, or None.

    It warns when the [layout] that was tuned (``layout.ranks_per_node`` set) differs from the run's in ranks per
    node, usable cores or device type, or when ``ranks x num_workers`` worker processes exceed the cores left
    after each training process got its ``layout.trainer_cores``. Without a tuned layout only the over-subscription
    of a multi-rank run is named: a single process with more workers than cores is the loader's own default, not a
    layout mistake.
    """
    tc = layout.trainer_cores
    workers = loader.num_workers
    procs = ranks * workers
    left = max(0, usable - ranks * tc)
    over = procs > left and workers > 0
    tuned = layout.ranks_per_node is not None
    parts = []
    if tuned:
        now: dict[str, object] = {"ranks": ranks, "cores": usable, "device": device_type(device)}
        then: dict[str, object] = {"ranks": layout.ranks_per_node, "cores": layout.usable_cores or usable,
                                   "device": layout.device or device_type(device)}
        if now != then:
            parts.append(f"[loader] was tuned for {_ranks(then['ranks'])} per node on {then['cores']} usable cores "
                         f"({then['device']}), this run has {_ranks(ranks)} on {usable} ({now['device']})")
    if over and (tuned or ranks > 1):
        parts.append(f"{_ranks(ranks)} x {workers} workers = {procs} processes on {usable} usable cores "
                     f"({left} after {ranks} training process{'es' if ranks != 1 else ''} x {tc} core"
                     f"{'s' if tc != 1 else ''})")
    if not parts:
        return None
    retune = f"re-tune with gpufeed tune --nproc-per-node {ranks}" + (f" --trainer-cores {tc}" if tc != 1 else "")
    return "warning: " + "; ".join(parts) + f"; {retune}"


def _ranks(n: object) -> str:
    return f"{n} rank{'s' if n != 1 else ''}"


def run_warning(cfg: TrainConfig, loader: LoaderConfig, layout: LayoutConfig) -> str | None:
    """:func:`check` for a ``gpufeed train`` run on this node (its usable cores, its device): the one-line warning,
    or None."""
    from gpufeed.core.system import usable_cpus

    device = cfg.device
    if device == "auto":
        import torch

        device = "cuda" if torch.cuda.is_available() else "cpu"
    return check(loader, layout, ranks=cfg.nproc_per_node, usable=usable_cpus(), device=device)
