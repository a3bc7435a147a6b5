"""``gpufeed train`` inside one rank (docs/design.md §4, §5): :func:`train` joins the process group, builds the
:class:`~gpufeed.train.trainer.Trainer`, starts the GPU health sampler, runs the configured mode(s), and rank 0
writes the record, the health series and the report (:mod:`gpufeed.train.report`); :func:`measure` runs the three
modes in this process (scripts).

Failures: a GpufeedError raised before this rank read data or computed (a bad shard set, a refused checkpoint)
keeps exit code 2; one raised after that (a corrupt shard mid-epoch) becomes a RunError (exit 1). SIGTERM is noted
(:class:`~gpufeed.train.stop.StopRequest`) and acted on at the next step boundary.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Callable

import torch

from gpufeed.config import LoaderConfig, TrainConfig
from gpufeed.core.errors import ConfigError, GpufeedError, RunError
from gpufeed.core.records import utc_now, write_jsonl
from gpufeed.core.world import World
from gpufeed.measure.health import HEALTH_NAME, GpuHealth, HealthSampler
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.verdict import classify
from gpufeed.train.records import ModeRecord, TrainRecord, ValRecord
from gpufeed.train.stop import StopRequest
from gpufeed.train.trainer import Trainer, param_checksum
from gpufeed.train.verdict_inputs import verdict_inputs


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



def start_health(world: World) -> HealthSampler | None:
    """This rank's GPU health sampler, started (:mod:`gpufeed.measure.health`); None on the CPU or without NVML."""
    if not world.is_cuda:
        return None
    import socket

    sampler = HealthSampler(torch.device(world.device).index or 0, rank=world.rank, node=world.node_rank,
                            host=socket.gethostname())
    return sampler.start() if sampler.available else None


def train(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *, run_dir: str | Path | None = None,
          on_step: Callable[[int], None] | None = None,
          health: Callable[[World], HealthSampler | None] = start_health) -> TrainRecord | None:
    """Run one rank. Rank 0 returns the TrainRecord (and writes summary.json, the chart and report.md into
    run_dir); other ranks return None. ``on_step(step)`` is called at the end of every real optimizer step
    (tests); ``health(world)`` starts this rank's GPU health sampler (:func:`start_health`).

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
        sampler = health(world)
        if storage is None and world.is_main:
            storage = probe_storage(cfg)
        modes, vals = trainer.run(on_step)
        record = _finish(trainer, sampler, modes, vals, run_dir=run_dir, t0=t0, started=started,
                         storage=storage)
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


def _finish(trainer: Trainer, sampler: HealthSampler | None, modes: dict[str, ModeRecord], vals: list[ValRecord],
            *, run_dir: str | Path | None, t0: float, started: str,
            storage: StorageRate | None) -> TrainRecord | None:
    """Collective, at the end of the modes: every rank's parameter checksum and GPU health gathered; rank 0 returns
    the record (its wall time from ``t0``) and writes the health series and the report into run_dir, the other ranks
    return None."""
    checksums = trainer.gather(param_checksum(trainer.model.module))
    if sampler is not None:
        sampler.stop()
    health = trainer.gather((sampler.result(), sampler.rows) if sampler is not None else (None, []))
    if not trainer.world.is_main:
        return None
    gpus = sorted((h for h, _ in health if h is not None), key=lambda h: h.rank)
    record = _record(trainer, modes, vals, checksums, run_dir=run_dir, wall_s=time.perf_counter() - t0, started=started,
                     storage=storage, gpu_health=gpus)
    if run_dir is not None:
        from gpufeed.train.report import write_report

        if gpus:
            write_jsonl(Path(run_dir) / HEALTH_NAME, [row for _, rows in health for row in rows])
        write_report(Path(run_dir), record)
    return record


def _record(trainer: Trainer, modes: dict[str, ModeRecord], vals: list[ValRecord], checksums: list[float], *,
            run_dir: str | Path | None, wall_s: float, started: str,
            storage: StorageRate | None = None, gpu_health: list[GpuHealth] | None = None) -> TrainRecord:
    """Rank 0's TrainRecord of the run, with the storage rate, the GPUs' health and the verdict."""
    cfg, world, loader = trainer.cfg, trainer.world, trainer.loader
    vin = verdict_inputs(modes, trainer, storage)
    verdict = classify(vin) if vin is not None else None
    return TrainRecord(
        mode=cfg.mode, arch=cfg.arch, device=world.device, backend=world.backend, world_size=world.world_size,
        num_nodes=trainer.num_nodes, amp=trainer.amp.mode, batch_size=trainer.batch_size, accum_steps=trainer.accum,
        global_batch=trainer.batch_size * trainer.accum * world.world_size, image_size=trainer.image_size,
        num_classes=trainer.num_classes, start_step=trainer.start_step, step=trainer.step,
        total_steps=trainer.total_steps, epoch=trainer.epoch,
        final_loss=float(trainer.compute.last_loss) if trainer.compute.last_loss is not None else None,
        final_lr=trainer.compute.step_lr,
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

