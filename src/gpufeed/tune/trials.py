"""tune's trials (docs/design.md §4): one loader configuration measured by the loader-ceiling harness
(:func:`gpufeed.measure.stream.measure_stream`) and returned as a :class:`TrialRecord`, never raised: gpufeed's
loader (:func:`measure_loader`) or torchvision's ImageFolder (:func:`measure_imagefolder`)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any, Callable, Iterable

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import one_line
from gpufeed.core.world import World
from gpufeed.measure.stream import (OverRamBudget, StreamError, StreamOptions, StreamResult, device_sync,
                                    error_sentence, measure_stream, touch)
from gpufeed.tune.records import TrialRecord, trial_record


def measure_loader(shards: str | Path, cfg: LoaderConfig, world: World | None = None, *, warmup_batches: int = 2,
                   window_s: float | None = 2.0, window_batches: int | None = None, repeats: int = 3,
                   deadline: float | None = None, ram_budget_bytes: int | None = None,
                   start_barrier: Callable[[], None] | None = None,
                   manifest_file: str | Path | None = None) -> TrialRecord:
    """The loader ceiling (docs/design.md §4) of ``build_loader(shards, cfg, world, manifest_file=...)``: never
    raises for a bad trial.

    Batches go to ``world.device`` (synchronised on CUDA; on CPU they are touched) and are dropped.
    Returns a TrialRecord with median/min/max samples/s over ``repeats`` windows of ``window_s``
    seconds (or ``window_batches`` batches), start-up and telemetry; ``error`` is set when the loader
    raised, the RAM budget was exceeded, or ``deadline`` passed before anything was measured.
    ``start_barrier``: see :func:`gpufeed.measure.stream.measure_stream` (:func:`measure_ranks` passes it).
    """
    world = world or World.single()
    t0 = time.perf_counter()
    holder: dict[str, Any] = {}

    def open_batches(epoch: int) -> Iterable[Any]:
        from gpufeed.loader import build_loader

        if "loader" not in holder:
            holder["loader"] = build_loader(shards, cfg, world, train=True, epoch=epoch, manifest_file=manifest_file)
        loader = holder["loader"]
        if epoch and hasattr(loader, "set_epoch"):
            loader.set_epoch(epoch)
        return loader

    def move(batch: Any) -> Any:
        loader = holder["loader"]
        if hasattr(loader, "to_device"):
            moved = loader.to_device(batch, world.device, non_blocking=True)
        else:
            moved = batch
        touch(moved)
        return moved

    opts = StreamOptions(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                         warmup_batches=warmup_batches, window_s=window_s, window_batches=window_batches,
                         repeats=repeats, deadline=deadline, ram_budget_bytes=ram_budget_bytes)
    sync = device_sync(world)
    return trial_from_stream(
        lambda: measure_stream(open_batches, opts, to_device=move, cuda_sync=sync,
                               skipped=lambda: getattr(holder.get("loader"), "num_skipped", 0),
                               repeated=lambda: getattr(holder.get("loader"), "num_repeated", 0),
                               start_barrier=start_barrier),
        cfg, "gpufeed", t0, cleanup=holder.clear)


def measure_imagefolder(src: str | Path, cfg: LoaderConfig, world: World | None = None, *, warmup_batches: int = 2,
                        window_s: float | None = 2.0, window_batches: int | None = None, repeats: int = 3,
                        deadline: float | None = None, ram_budget_bytes: int | None = None,
                        normalize: bool = False) -> TrialRecord:
    """The same measurement for torchvision ``ImageFolder`` + ``DataLoader`` (the usual recipe).

    Transform: ``RandomResizedCrop(image_size)`` + ``RandomHorizontalFlip()`` + ``PILToTensor()`` (uint8,
    same output as gpufeed's loader; normalisation would happen on the device). With ``normalize`` the
    PyTorch ImageNet example's ``ToTensor()`` + ``Normalize(mean, std)`` on the CPU instead (float32), which is
    what most hand-written pipelines do. Uses ``cfg``'s
    batch_size, num_workers, prefetch_factor, pin_memory (CUDA only) and persistent_workers.
    """
    world = world or World.single()
    t0 = time.perf_counter()
    holder: dict[str, Any] = {}

    def open_batches(epoch: int) -> Iterable[Any]:
        import torch
        from torchvision import datasets, transforms

        if "loader" not in holder:
            tail = ([transforms.ToTensor(), transforms.Normalize([0.485, 0.456, 0.406], [0.229, 0.224, 0.225])]
                    if normalize else [transforms.PILToTensor()])
            tf = transforms.Compose([transforms.RandomResizedCrop(cfg.image_size), transforms.RandomHorizontalFlip(),
                                     *tail])
            ds = datasets.ImageFolder(str(src), transform=tf)
            g = torch.Generator()
            g.manual_seed(cfg.seed)
            kw: dict[str, Any] = {}
            if cfg.num_workers > 0:
                kw = {"prefetch_factor": cfg.prefetch_factor, "persistent_workers": cfg.persistent_workers}
            holder["loader"] = torch.utils.data.DataLoader(
                ds, batch_size=cfg.batch_size, shuffle=True, num_workers=cfg.num_workers,
                pin_memory=cfg.pin_memory and world.is_cuda, drop_last=True, generator=g, **kw)
        return holder["loader"]

    def move(batch: Any) -> Any:
        images, labels = batch
        if world.is_cuda:
            batch = (images.to(world.device, non_blocking=True), labels.to(world.device, non_blocking=True))
        touch(batch)
        return batch

    opts = StreamOptions(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                         warmup_batches=warmup_batches, window_s=window_s, window_batches=window_batches,
                         repeats=repeats, deadline=deadline, ram_budget_bytes=ram_budget_bytes)
    return trial_from_stream(lambda: measure_stream(open_batches, opts, to_device=move, cuda_sync=device_sync(world)),
                             cfg, "imagefolder", t0, cleanup=holder.clear)


def trial_from_stream(fn: Callable[[], StreamResult], cfg: LoaderConfig, pipeline: str, t0: float,
                      cleanup: Callable[[], None]) -> TrialRecord:
    """The TrialRecord of ``cfg`` from a measurement ``fn`` (a :func:`measure_stream` call) started at ``t0``
    (``time.perf_counter()``): what it measured, or what it had measured when it failed, with ``error`` set;
    ``cleanup`` runs either way."""
    error = None
    try:
        fields_ = dataclasses.asdict(fn())
    except StreamError as exc:
        fields_, error = dataclasses.asdict(exc.partial), one_line(exc)
        if isinstance(exc, OverRamBudget):
            fields_["over_ram_budget"] = True
    except Exception as exc:  # a failed trial is a record; the sweep goes on
        fields_, error = {}, error_sentence(exc)
    finally:
        cleanup()
    rates = fields_.pop("samples_per_s_runs", [])
    fields_.pop("contention", None)  # tune judges contention from cpu_percent_mean and tree_cores_used (search.py)
    fields_["wall_s"] = time.perf_counter() - t0
    rec = trial_record(cfg, rates, pipeline=pipeline, error=error, **fields_)
    if rec.ok and rec.tree_cores_used:
        rec = dataclasses.replace(rec, samples_per_core_s=rec.samples_per_s / rec.tree_cores_used)
    return rec
