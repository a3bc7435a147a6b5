"""``gpufeed tune SHARDS``: a measured, budget-aware sweep of LoaderConfig knobs (docs/design.md §4; outputs §5).

:func:`tune` reads as the job's table of contents. Read on in this order: ``records`` (TrialRecord, TuneReport),
``trials`` (one configuration measured by :mod:`gpufeed.measure.stream`, the loader-ceiling harness), ``ranks``
(the node's ranks measured at once), ``decisions`` (the search path's records and the bound of a trial),
``search`` (the :class:`Search` state and its phases), ``phases`` (the steps around the search) and ``report``
(the table, the run folder, the chart). Only the CLI prints.
"""

from __future__ import annotations

import time
from typing import Any, Callable

from gpufeed.config import LoaderConfig, TuneConfig
from gpufeed.core.errors import RunError
from gpufeed.core.world import World
from gpufeed.tune.decisions import SENTENCES, Decision, Reason, classify_bound, compare_on, describe, possible_cores
from gpufeed.tune.phases import (check_request, check_shard_set, close_search, epoch_samples, node_world,
                                 open_search, probe_storage, start_point, summarize)
from gpufeed.tune.ranks import (RANK_START_S, combine_ranks, measure_node, measure_ranks, node_ranks, rank_world,
                                staged_world)
from gpufeed.tune.records import KNOBS, TrialRecord, TuneReport, trial_record
from gpufeed.tune.report import PASSWORD_REMOVED, plot_trials, render, storage_line, write_outputs
from gpufeed.tune.search import (BUDGET_SATURATED, STREAMS_LADDER, WORKER_LADDER, CheckFn, MeasureFn, Search,
                                 climb_streams, climb_workers, has_module, measure_baseline_imagefolder, refine,
                                 refine_batching, refine_decode, refine_pinning, refine_prefetch, refine_threads,
                                 settle_unmeasured, worker_ladder)
from gpufeed.tune.trials import measure_imagefolder, measure_loader, trial_from_stream

__all__ = [
    "BUDGET_SATURATED", "KNOBS", "PASSWORD_REMOVED", "RANK_START_S", "SENTENCES", "STREAMS_LADDER", "WORKER_LADDER",
    "CheckFn", "Decision", "MeasureFn", "Reason", "Search", "TrialRecord", "TuneReport", "check_shard_set",
    "classify_bound", "climb_streams", "climb_workers", "combine_ranks", "compare_on", "describe",
    "has_module", "measure_baseline_imagefolder", "measure_imagefolder", "measure_loader", "measure_node",
    "measure_ranks", "node_ranks", "plot_trials", "possible_cores", "rank_world", "refine",
    "refine_batching", "refine_decode", "refine_pinning", "refine_prefetch", "refine_threads", "render", "settle_unmeasured",
    "staged_world", "storage_line", "trial_from_stream", "trial_record", "tune", "tune_within", "worker_ladder",
    "write_outputs",
]


def tune(cfg: TuneConfig, base: LoaderConfig | None = None, **kw: Any) -> TuneReport:
    """:func:`tune_within` with every remote read of the job (the shard-set check, the storage probe, the trials'
    loaders and their forked workers) ending by ``cfg.storage_probe_s + cfg.budget_s`` from now
    (:func:`gpufeed.shardset.source.reads_bounded_by`): a source too slow for the budget fails the read saying so,
    instead of holding the job for minutes of read timeouts and retries."""
    from gpufeed.shardset.source import reads_bounded_by

    bound = cfg.storage_probe_s + cfg.budget_s
    with reads_bounded_by(time.monotonic() + bound, f"tune's budget of {cfg.budget_s:g} s (plus its "
                          f"{cfg.storage_probe_s:g} s storage probe) ran out while it waited on the shard set"):
        return tune_within(cfg, base, **kw)


def tune_within(cfg: TuneConfig, base: LoaderConfig | None = None, *, measure: MeasureFn = measure_node,
                measure_baseline: MeasureFn = measure_imagefolder, check_shards: CheckFn | None = check_shard_set,
                world: World | None = None, progress: Callable[[str], None] | None = None,
                write: bool = True, clock: Callable[[], float] = time.monotonic,
                installed: Callable[[str], bool] = has_module) -> TuneReport:
    """Search the fastest LoaderConfig for ``cfg.shards`` on this machine within ``cfg.budget_s``.

    ``base`` (the [loader] section) supplies the knobs the tuner does not move (seed, on_error, ...), the
    starting point (decode path, prefetch, batching), and batch_size and image_size unless ``cfg`` sets them.
    ``measure`` has :func:`measure_loader`'s signature; a test passes a fake. ``check_shards`` runs before the
    first trial (default :func:`check_shard_set`: a shard set that cannot be read is a DataError, exit 2, as in
    ``gpufeed train``) and returns the samples per epoch; None skips it (a fake ``measure`` reads no shards).
    With ``write`` the run folder and ``cfg.out`` are written. Unless ``cfg.storage_probe_s`` is 0, the shard set's
    read rate is probed first (:func:`gpufeed.measure.storage_probe.probe`, outside the budget): the bound and the storage line
    of the report compare the best trial's read rate with it. ``clock`` is the search's clock (its budget and
    deadlines) and ``installed`` says whether an optional module is installed; a test passes fakes of both.

    The layout (``cfg.nproc_per_node`` = N ranks per node): every trial measures N rank loaders at once
    (:func:`measure_node` gets a ``world`` of N ranks); the worker ladder is per rank, up to
    :func:`gpufeed.layout.worker_ceiling` (the usable CPUs x cpu_budget, less ``cfg.trainer_cores`` per rank,
    split over the ranks) unless ``cfg.max_workers`` says otherwise; samples/s, ``target_rate`` and the CPU
    budget are the node's aggregate. On CUDA rank r uses ``cuda:r``, so N GPUs are needed.

    The phases, each a function of the :class:`Search` state returning its :class:`Decision` records:
    :func:`climb_workers`, :func:`climb_streams` (a remote set only), then at that point :func:`refine_decode`,
    :func:`refine_batching`, :func:`refine_prefetch` and :func:`refine_pinning`; :func:`settle_unmeasured` fixes
    the knobs not worth a trial, and :func:`measure_baseline_imagefolder` the ImageFolder baseline.
    """
    shards = check_request(cfg)
    world = node_world(cfg, world)
    base, world = start_point(cfg, shards, base, world, installed)
    samples = epoch_samples(cfg, shards, base, world, check_shards)
    storage = probe_storage(cfg, shards, progress)  # before the budget starts: the trials get all of it
    s = open_search(cfg, shards, base, world, measure, storage, read_manifest=check_shards is not None,
                    progress=progress, clock=clock, installed=installed)

    s.decisions += climb_workers(s, worker_ladder(s.ceiling))
    if s.point_rec is not None and not s.target_reached():
        for phase in (climb_streams, refine_decode, refine_threads, refine_batching, refine_prefetch, refine_pinning):
            s.decisions += phase(s)
    best = s.point_rec  # the search path's point: a knob moved only when it won by min_gain
    chosen = settle_unmeasured(s, best, samples) if best is not None else None
    close_search(s)
    baseline = measure_baseline_imagefolder(s, measure_baseline) if cfg.baseline_imagefolder else None

    report = summarize(s, chosen, best, baseline, storage)
    if write:
        try:
            report = write_outputs(report, cfg, base)
        except OSError as exc:  # the sweep ran: a run that failed (exit 1), naming the file
            raise RunError(f"cannot write {exc.filename or 'the results'} ({exc.strerror or exc}); the sweep "
                           f"ran but its results were not saved") from None
    return report
