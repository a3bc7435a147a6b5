"""The steps of ``gpufeed tune`` around the search (docs/design.md §4), in the order :func:`gpufeed.tune.tune_within`
runs them: the request's checks, the node's world, the starting point, the shard-set check, the storage probe, the
search state with its budgets, the closing notes, and the report."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable

from gpufeed.config import LayoutConfig, LoaderConfig, TuneConfig
from gpufeed.core.errors import ConfigError
from gpufeed.core.world import World
from gpufeed.measure import bounds, contention
from gpufeed.measure.metrics import Stat
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.stream import megabytes
from gpufeed.tune.decisions import Decision, classify_bound, describe
from gpufeed.tune.ranks import rank_world, staged_world
from gpufeed.tune.records import TrialRecord, TuneReport
from gpufeed.tune.search import STREAMS_LADDER, CheckFn, MeasureFn, Search, worker_ladder


def check_request(cfg: TuneConfig) -> str:
    """The request's own checks, before anything is read (ConfigError, exit 2); returns the shard set."""
    if not cfg.shards:
        raise ConfigError("tune needs a shard set: gpufeed tune SHARDS")
    shards = str(cfg.shards)
    if cfg.out:
        from gpufeed.core.records import check_writable

        check_writable(cfg.out, "--out")
    if cfg.baseline_imagefolder and not Path(cfg.baseline_imagefolder).is_dir():
        raise ConfigError(f"--baseline-imagefolder {cfg.baseline_imagefolder} is not a folder")
    if cfg.baseline_imagefolder and (cfg.nproc_per_node or 1) > 1:
        raise ConfigError("--baseline-imagefolder measures one ImageFolder loader, which cannot be compared with the "
                          f"aggregate of {cfg.nproc_per_node} ranks: use it with --nproc-per-node 1")
    return shards


def node_world(cfg: TuneConfig, world: World | None) -> World:
    """The world the trials run in: ``world``, or this process's (``cfg.device``), made the node's world of
    ``cfg.nproc_per_node`` ranks (rank r on cuda:r, as torchrun starts them)."""
    if world is None:
        world = World.from_env(cfg.device) if cfg.device != "cpu" else World.single()
    ranks = cfg.nproc_per_node or 1
    if ranks > 1 and world.world_size != ranks:  # the node's world: rank r on cuda:r, as torchrun starts them
        world = World(world_size=ranks, local_world_size=ranks, device="cuda:0" if world.is_cuda else world.device,
                      backend=world.backend)
    if ranks > 1 and world.is_cuda:
        import torch

        if torch.cuda.device_count() < ranks:
            raise ConfigError(f"--nproc-per-node {ranks} on CUDA needs {ranks} GPUs (rank r uses cuda:r); "
                              f"this node has {torch.cuda.device_count()}")
    return world


def start_point(cfg: TuneConfig, shards: str, base: LoaderConfig | None, world: World,
                installed: Callable[[str], bool]) -> tuple[LoaderConfig, World]:
    """The search's base (``base`` with ``cfg``'s batch and image size, a decode path that exists here) and the
    world of the node a staged set was made for (:func:`gpufeed.tune.ranks.staged_world`)."""
    base = base or LoaderConfig()
    base = dataclasses.replace(base, batch_size=base.batch_size if cfg.batch_size is None else cfg.batch_size,
                               image_size=base.image_size if cfg.image_size is None else cfg.image_size)
    world = staged_world(world, shards, base, cfg.manifest)
    if (base.decode == "gpu" and not world.is_cuda) or (base.decode in ("simplejpeg", "roi")
                                                         and not installed("simplejpeg")):
        base = dataclasses.replace(base, decode="pil-draft")
    return base, world


def check_shard_set(shards: str, base: LoaderConfig, world: World, manifest_file: str | None = None) -> int:
    """The checks ``gpufeed train`` makes before it starts, with the same exit code 2 (manifest, shard files present
    and readable, one batch per rank of ``world``); returns the samples per epoch."""
    from gpufeed.loader.checks import open_shards

    return int(open_shards(shards, base, dataclasses.replace(rank_world(world, 0), device="cpu", backend="gloo"),
                           manifest_file=manifest_file).manifest.num_samples)


def epoch_samples(cfg: TuneConfig, shards: str, base: LoaderConfig, world: World,
                  check_shards: CheckFn | None) -> int | None:
    """``check_shards`` before the first trial (None: no check, no count)."""
    if check_shards is None:
        return None
    if cfg.manifest:
        return check_shards(shards, base, world, manifest_file=cfg.manifest)
    return check_shards(shards, base, world)


def probe_storage(cfg: TuneConfig, shards: str, progress: Callable[[str], None] | None) -> StorageRate | None:
    """The shard set's read rate, before the budget starts (the trials get all of it); None with
    ``cfg.storage_probe_s`` 0."""
    if cfg.storage_probe_s <= 0:
        return None
    from gpufeed.measure.storage_probe import probe

    storage = probe(shards, cfg.storage_probe_s, manifest=cfg.manifest)
    if progress:
        progress(f"storage probe: {storage.bytes_per_s / 1e6:,.1f} MB/s with {storage.readers} reader(s), "
                 f"{storage.cache}")
    return storage


def open_search(cfg: TuneConfig, shards: str, base: LoaderConfig, world: World, measure: MeasureFn,
                storage: StorageRate | None, *, read_manifest: bool, progress: Callable[[str], None] | None,
                clock: Callable[[], float], installed: Callable[[str], bool]) -> Search:
    """The :class:`Search` with its budgets (cores, worker ceiling, RAM, window) and its "setup" decision;
    ``read_manifest``: a remote set's mean sample size is read from its manifest."""
    from gpufeed.core.system import total_ram_bytes, usable_cpus
    from gpufeed.layout import device_type, loader_cores, worker_ceiling
    from gpufeed.shardset.source import is_url

    ranks = cfg.nproc_per_node or 1
    usable = usable_cpus()
    cap = worker_ceiling(usable, ranks, cfg.trainer_cores, cfg.cpu_budget)
    ceiling = cap if cfg.max_workers is None else (cfg.max_workers if cfg.cpu_budget >= 1 else
                                                   min(cfg.max_workers, cap))
    ram_budget = cfg.ram_budget if cfg.ram_budget is not None else total_ram_bytes() // 2
    streams_trials = len(STREAMS_LADDER) - 1 if is_url(shards) else 0  # one is the point's
    n_expected = len(worker_ladder(ceiling)) + 3 + streams_trials + (2 if cfg.baseline_imagefolder else 0)
    window_s = cfg.window_s or min(10.0, max(0.3, cfg.budget_s / (n_expected * (cfg.repeats + 1.5))))

    s = Search(cfg, shards, base, world, measure, window_s=window_s, ram_budget=ram_budget, usable=usable,
               ceiling=ceiling, progress=progress, clock=clock, installed=installed)
    s.storage_bytes_per_s = storage.bytes_per_s if storage else None
    if s.remote and read_manifest:  # without the shard-set check (injected measures) nothing is fetched
        from gpufeed.shardset.source import open_set

        s.mean_sample_bytes = open_set(shards, cfg.manifest).manifest.mean_sample_bytes or None
    s.layout = LayoutConfig(ranks_per_node=ranks, usable_cores=usable, trainer_cores=cfg.trainer_cores,
                            device=device_type(world.device))
    s.decisions.append(Decision("search", "setup", detail={
        "usable": usable, "ranks": ranks, "trainer_cores": cfg.trainer_cores,
        "loader_cores": loader_cores(usable, ranks, cfg.trainer_cores, cfg.cpu_budget), "cpu_budget": cfg.cpu_budget,
        "ceiling": ceiling, "ram_budget": megabytes(ram_budget), "repeats": cfg.repeats, "window_s": window_s}))
    return s


def close_search(s: Search) -> None:
    """The search's closing notes: the contended-CPU warning and the stop reason."""
    cfg = s.cfg
    busy = [t.trial for t in s.trials if t.contended]
    if busy:
        s.decisions.append(Decision("search", "contended-warning", candidates=tuple(busy), detail={
            "count": len(busy), "total": len(s.trials), "trials": "#" + ", #".join(map(str, busy)),
            "threshold": contention.threshold_text(s.usable)}))
    if s.target_reached():
        s.stop_reason = f"target reached: best >= {cfg.target_rate:g} x {cfg.target_margin:g} samples/s"
    elif not s.stop_reason:
        s.stop_reason = "search complete"


def summarize(s: Search, chosen: LoaderConfig | None, best: TrialRecord | None,
              baseline: TrialRecord | None, storage: StorageRate | None = None) -> TuneReport:
    """The :class:`TuneReport` of a finished search: ``chosen`` (the LoaderConfig to write), its trial ``best``, the
    ImageFolder ``baseline``, the bound of the best trial and the one-line conclusion."""
    cfg = s.cfg
    best_stat = Stat.of(best.samples_per_s_runs) if best is not None and best.samples_per_s_runs else None
    base_stat = Stat.of(baseline.samples_per_s_runs) if baseline is not None and baseline.samples_per_s_runs else None
    ratio = best.samples_per_s / baseline.samples_per_s if best and baseline and baseline.samples_per_s else None
    bound, evidence = (classify_bound(best, s.usable, storage.bytes_per_s if storage else None) if best
                       else (None, "no successful trial"))
    target_met = None if cfg.target_rate is None else bool(best and best.samples_per_s >= cfg.target_rate)
    if best is None:
        errors = sorted({t.error for t in s.trials if t.error})
        conclusion = ("no loader configuration could be measured: " + ("; ".join(errors[:3]) if errors
                                                                           else s.stop_reason))
    else:
        per_rank = (f" per rank; node aggregate of {best.ranks} ranks" if best.ranks > 1 else "")
        slowest = (f", slowest rank {best.slowest_rank_samples_per_s:.0f}"
                   if best.slowest_rank_samples_per_s is not None else "")
        conclusion = (f"best: {describe(best, s.world.is_cuda, s.remote)}{per_rank} -> "
                      f"{best.samples_per_s:.0f} samples/s "
                      f"({best_stat.fmt() if best_stat else ''}{slowest})"
                      + (f", {ratio:.2f}x ImageFolder ({baseline.samples_per_s:.0f} samples/s)" if ratio else "")
                      + f"; {bounds.label(bound)}"
                      + (f"; target {cfg.target_rate:g} {'met' if target_met else 'NOT met'}" if cfg.target_rate else ""))
    return TuneReport(
        ok=best is not None and target_met is not False, shards=s.shards, run_dir=None, out=None, best=chosen,
        best_trial=None if best is None else best.trial, best_samples_per_s=best_stat, baseline=baseline,
        baseline_samples_per_s=base_stat, ratio_vs_baseline=ratio, bound=bound, bound_evidence=evidence,
        stop_reason=s.stop_reason, skipped=s.skipped, decisions=s.decisions, conclusion=conclusion,
        budget_s=cfg.budget_s, elapsed_s=s.elapsed(), target_rate=cfg.target_rate, target_met=target_met,
        usable_cpus=s.usable, device=s.world.device, num_trials=len(s.trials), trials=s.trials, layout=s.layout,
        slowest_rank_samples_per_s=None if best is None else best.slowest_rank_samples_per_s, storage=storage,
        remote=s.remote,
    )
