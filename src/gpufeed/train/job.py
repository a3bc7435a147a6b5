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
from gpufeed.measure.verdict import Verdict, classify
from gpufeed.train.fix import FIXED_NAME, Candidate, FixInputs, FixRecord, Measured, Stager, candidates, fixed_toml, \
    measured_fixes, run_fixes, stage_target
from gpufeed.train.modes import MODES_MEASURE
from gpufeed.train.preflight import run_loader_config
from gpufeed.train.records import ModeRecord, TrainRecord, ValRecord
from gpufeed.train.stop import StopRequest
from gpufeed.train.trainer import Trainer, build_loaders, param_checksum
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
          health: Callable[[World], HealthSampler | None] = start_health,
          stager: Stager | None = None) -> TrainRecord | None:
    """Run one rank. Rank 0 returns the TrainRecord (and writes summary.json, the chart and report.md into
    run_dir); other ranks return None. ``on_step(step)`` is called at the end of every real optimizer step
    (tests); ``health(world)`` starts this rank's GPU health sampler (:func:`start_health`). With ``cfg.fix`` the
    closed loop runs after the modes (:func:`fix_loop`); ``stager`` is how it stages the set (the CLI passes
    ``gpufeed stage``, a job this one may not import), None = staging is printed, not tried.

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
        t_modes = time.perf_counter()
        modes, vals = trainer.run(on_step)
        fixed = None
        if cfg.fix and cfg.mode == "measure":
            fixed = fix_loop(trainer, modes, storage, loader_cfg, stager=stager, run_dir=run_dir,
                             first_cost_s=time.perf_counter() - t_modes)
            modes, storage = (fixed.measured.modes or modes), fixed.storage
        record = _finish(trainer, sampler, modes, vals, run_dir=run_dir, t0=t0, started=started,
                         storage=storage, fixed=fixed)
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
            storage: StorageRate | None, fixed: Fixed | None = None) -> TrainRecord | None:
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
    if fixed is not None:
        record = dataclasses.replace(record, fixes_tried=fixed.tried, fixes_not_tried=fixed.not_tried,
                                     fixed_config=fixed.config, verdict=measured_fixes(record.verdict, fixed.tried))
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



# --------------------------------------------------------------------------- --fix: the closed loop


@dataclasses.dataclass(frozen=True)
class Fixed:
    """What :func:`fix_loop` ends with (rank 0's trail; the other ranks get empty lists)."""

    measured: Measured
    storage: StorageRate | None
    tried: list[FixRecord]
    not_tried: list[str]
    config: str | None
    """fixed.toml's path, when one was written."""


def _use(trainer: Trainer, loader_cfg: LoaderConfig, shards: str) -> None:
    """Point the trainer at ``shards`` read with ``loader_cfg`` (the run's seed, batch and image size kept): the
    old loader's workers stop, a new loader is built."""
    trainer.loader = None
    cfg = dataclasses.replace(trainer.cfg, shards=shards)
    trainer.cfg, trainer.loader_cfg = cfg, run_loader_config(cfg, loader_cfg)
    trainer.loader, _ = build_loaders(cfg, trainer.loader_cfg, trainer.world)
    trainer.manifest = trainer.loader.manifest


def fix_loop(trainer: Trainer, modes: dict[str, ModeRecord], storage: StorageRate | None, loader_cfg: LoaderConfig,
             *, stager: Stager | None, run_dir: str | Path | None, first_cost_s: float) -> Fixed:
    """``--fix`` (collective): from the measured modes' verdict, try the fixes :mod:`gpufeed.train.fix` derives,
    each re-measured with the loader-only and real modes (the compute ceiling stays: no fix changes the model;
    once a fix was kept it is measured again, so the final verdict compares numbers of one period); the trainer
    ends on the settings kept, and rank 0 writes them to fixed.toml when any fix was tried."""
    from gpufeed.core.records import atomic_write_text
    from gpufeed.core.system import usable_cpus
    from gpufeed.shardset.source import is_url

    world, cfg = trainer.world, trainer.cfg
    state = {"storage": storage}
    can_stage = stager is not None and not world.is_distributed

    def verdict_of(ms: dict[str, ModeRecord], st: StorageRate | None) -> Verdict | None:
        vin = verdict_inputs(ms, trainer, st)
        return classify(vin) if vin is not None else None

    def propose(v: Verdict, lc: LoaderConfig, shards: str) -> tuple[list[Candidate], list[str]]:
        n = v.numbers
        dest, why = stage_target(shards, set_bytes=n.get("set_bytes"), shm_free_bytes=n.get("shm_free_bytes"),
                                 stage_dir=cfg.fix_stage_dir, can_stage=can_stage)
        x = FixInputs(verdict=v, loader=lc, shards=shards, remote=is_url(shards), usable_cores=float(usable_cpus()),
                      ranks_per_node=world.local_world_size, is_cuda=trainer.cuda, stage_to=dest, stage_why=why,
                      has_simplejpeg=_has_simplejpeg())
        person = [f"stage the set: {why}"] if v.bound == "storage" and dest is None and why else []
        return candidates(x), person

    def measure(lc: LoaderConfig, shards: str) -> Measured:
        moved = shards != trainer.cfg.shards
        _use(trainer, lc, shards)
        if moved and world.is_main:  # the storage rate of the new place, probed as before the modes
            state["storage"] = given_storage_rate(trainer.cfg) if cfg.storage_bytes_per_s else probe_storage(trainer.cfg)
        # judged as the first measurement was: each mode until its windows settle, within its share of
        # --measure-seconds, so a fix is kept or dropped (and the verdict after it given) on settled numbers
        steps, share = trainer.cfg.measure_steps, cfg.measure_seconds / len(MODES_MEASURE)
        lonly = trainer.run_mode("loader-only", steps, deadline=time.perf_counter() + share)
        real = trainer.run_mode("real", steps, deadline=time.perf_counter() + share)
        new = {"synthetic": modes.get("synthetic"), "loader-only": lonly, "real": real}
        if not world.is_main:
            return Measured(None, None)
        new = {k: m for k, m in new.items() if m is not None}
        return Measured(new, verdict_of(new, state["storage"]))

    created: list[str] = []

    def stage(src: str, dest: str) -> str:
        if not Path(dest).exists():
            created.append(dest)
        assert stager is not None
        return stager(src, dest)

    start = Measured(modes, verdict_of(modes, storage)) if world.is_main else Measured(None, None)
    start_storage, start_shards = storage, cfg.shards or ""
    out = run_fixes(start, loader_cfg, start_shards, propose=propose, measure=measure, budget_s=cfg.fix_budget_s,
                    first_cost_s=first_cost_s, stage=stage if can_stage else None, agree=lambda x: trainer.gather(x)[0],
                    is_main=world.is_main)
    if out.shards != trainer.cfg.shards or run_loader_config(trainer.cfg, out.loader) != trainer.loader_cfg:
        _use(trainer, out.loader, out.shards)  # the last fix tried was dropped: back to the kept settings
    for dest in created:  # a staged copy whose fix was dropped: its RAM (or disk) goes back
        if dest != out.shards:
            import shutil

            shutil.rmtree(dest, ignore_errors=True)
    kept_storage = state["storage"] if out.shards != start_shards else start_storage
    measured = out.measured
    if trainer.gather(any(r.kept for r in out.tried))[0]:
        # the compute ceiling again, beside the kept settings' modes: the final verdict compares one period's numbers
        synth = trainer.run_mode("synthetic", trainer.cfg.measure_steps,
                                 deadline=time.perf_counter() + cfg.measure_seconds / len(MODES_MEASURE))
        if world.is_main and measured.modes is not None and synth is not None:
            ms = {"synthetic": synth, **{k: m for k, m in measured.modes.items() if k != "synthetic"}}
            measured = Measured(ms, verdict_of(ms, kept_storage))
    config = None
    if world.is_main and run_dir is not None and out.tried:
        config = str(Path(run_dir) / FIXED_NAME)
        kept_loader = run_loader_config(trainer.cfg, out.loader)  # with the batch and image size it was measured at
        atomic_write_text(Path(config), fixed_toml(kept_loader, out.shards if out.shards != start_shards else None,
                                                   out.tried))
    return Fixed(measured, kept_storage, out.tried, out.not_tried, config)


def _has_simplejpeg() -> bool:
    import importlib.util

    return importlib.util.find_spec("simplejpeg") is not None
