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
                   manifest_file: str | Path | None = None, model: str | None = None,
                   model_threads: int | None = None) -> TrialRecord:
    """The loader ceiling (docs/design.md §4) of ``build_loader(shards, cfg, world, manifest_file=...)``: never
    raises for a bad trial.

    Batches go to ``world.device`` (synchronised on CUDA; on CPU they are touched) and are dropped.
    Returns a TrialRecord with median/min/max samples/s over ``repeats`` windows of ``window_s``
    seconds (or ``window_batches`` batches), start-up and telemetry; ``error`` is set when the loader
    raised, the RAM budget was exceeded, or ``deadline`` passed before anything was measured.
    ``start_barrier``: see :func:`gpufeed.measure.stream.measure_stream` (:func:`measure_ranks` passes it).
    ``model`` (``tune --with-model``): each batch also goes through that model's training step
    (:func:`training_step`, with ``model_threads`` torch threads on the CPU), so the rate is what training gets,
    not the loader's ceiling.
    """
    world = world or World.single()
    t0 = time.perf_counter()
    holder: dict[str, Any] = {}

    def open_batches(epoch: int) -> Iterable[Any]:
        from gpufeed.loader import build_loader

        if "loader" not in holder:
            holder["loader"] = build_loader(shards, cfg, world, train=True, epoch=epoch, manifest_file=manifest_file,
                                            reuse_batches=True)  # each batch is dropped after its window step
            if model:
                holder["step"] = training_step(model, world, holder["loader"].manifest.num_classes or 1,
                                               threads=model_threads)
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
        if "step" in holder:
            t = time.perf_counter()
            holder["step"](moved)
            holder.setdefault("step_s", []).append(time.perf_counter() - t)
        return moved

    def stream() -> StreamResult:
        result = measure_stream(open_batches, opts, to_device=move, cuda_sync=sync,
                                skipped=lambda: getattr(holder.get("loader"), "num_skipped", 0),
                                repeated=lambda: getattr(holder.get("loader"), "num_repeated", 0),
                                start_barrier=start_barrier)
        # the windows' batches are the last num_batches moved: their training steps are compute, not copy
        step_s = sum(holder.get("step_s", [])[-result.num_batches:]) if result.num_batches else 0.0
        holder["model_step_s"] = step_s
        return dataclasses.replace(result, copy_s=max(0.0, result.copy_s - step_s))

    opts = StreamOptions(num_workers=cfg.num_workers, prefetch_factor=cfg.prefetch_factor,
                         warmup_batches=warmup_batches, window_s=window_s, window_batches=window_batches,
                         repeats=repeats, deadline=deadline, ram_budget_bytes=ram_budget_bytes)
    sync = device_sync(world)
    steps: dict[str, float] = {}
    rec = trial_from_stream(stream, cfg, "gpufeed", t0,
                            cleanup=lambda: (steps.update(s=holder.get("model_step_s", 0.0)), holder.clear()))
    return dataclasses.replace(rec, model_step_s=steps["s"]) if model else rec


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
            ds = datasets.ImageFolder(str(src), transform=tf, loader=imagefolder_loader)
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


def imagefolder_loader(path: str) -> Any:
    """The ImageFolder baseline's loader: torchvision's ``pil_loader`` (the file opened by Pillow, converted to RGB)
    but through the one allow-list, ``shardset.images.open_image(..., SOURCE_FORMATS)``, as ``gpufeed shard`` reads
    the same folder: torchvision's default loader lets Pillow pick any plugin (an EPS named ``.jpg`` runs
    Ghostscript). Only a regular file is read (a FIFO named ``.jpg`` is refused, never waited on), at most
    ``shardset.tar.MAX_MEMBER_BYTES``. Module-level, so DataLoader workers can pickle it."""
    import os
    import stat

    from gpufeed.shardset.images import SOURCE_FORMATS, open_image
    from gpufeed.shardset.tar import MAX_MEMBER_BYTES

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > MAX_MEMBER_BYTES:
            raise OSError(f"{path}: not a regular file of at most {MAX_MEMBER_BYTES} bytes")
        data = f.read(MAX_MEMBER_BYTES + 1)
    if len(data) > MAX_MEMBER_BYTES:
        raise OSError(f"{path}: larger than {MAX_MEMBER_BYTES} bytes")
    with open_image(data, SOURCE_FORMATS) as img:
        return img.convert("RGB")


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


def training_step(arch: str, world: World, num_classes: int, *, threads: int | None = None) -> Callable[[Any], None]:
    """``tune --with-model``: a training step of ``arch`` (random weights, SGD, fp32) on ``world``'s device, taking a
    moved ``(uint8 images, labels)`` batch. On the CPU it gets the torch threads a training rank gets (``threads``,
    the [train] threads; else the usable CPUs over the node's ranks, as ``gpufeed train`` sets them), so it takes
    the cores training would take."""
    import torch

    from gpufeed.core.system import usable_cpus
    from gpufeed.model import build_model, build_optimizer

    device = torch.device(world.device)
    if not world.is_cuda:
        torch.set_num_threads(threads or max(1, usable_cpus() // max(1, world.local_world_size)))
    module = build_model(arch, num_classes, device, channels_last=True)
    optimizer = build_optimizer(module, lr=0.01, weight_decay=0.0)
    criterion = torch.nn.CrossEntropyLoss()

    def step(batch: Any) -> None:
        images, labels = batch
        x = images.to(device, non_blocking=True).float().div_(255.0)
        loss = criterion(module(x), labels.to(device, non_blocking=True) % num_classes)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        if world.is_cuda:
            torch.cuda.synchronize(device)

    return step
