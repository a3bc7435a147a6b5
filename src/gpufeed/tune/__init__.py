"""``gpufeed tune SHARDS``: a measured, budget-aware sweep of LoaderConfig knobs (docs/design.md §4).

Two layers, kept apart so tests and other jobs can reuse them:

- **Measurement.** :func:`measure_loader` is the *loader ceiling* of docs/design.md §4: batches of the real
  loader moved to the device and dropped, worker start-up timed separately (``startup_s``), the
  prefetched backlog drained as warm-up, then steady-state samples/s over fixed windows, repeated
  (median, min, max), with process-tree telemetry (CPU per core, cores used, RSS, read bytes/s).
  :func:`measure_imagefolder` measures torchvision ``ImageFolder`` + ``DataLoader`` the same way, and
  :func:`measure_stream` is the shared core for any batch iterable (the benchmark's recipes use it).
  :func:`measure_ranks` runs N rank loaders at once in N processes, as ``train --nproc-per-node N`` will, and
  sums their rates over shared windows (:func:`measure_node` picks it for a multi-rank world).
  A trial that raises or exceeds its RAM budget comes back as a :class:`TrialRecord` with ``error`` set.
- **Search.** :func:`tune` runs phase functions over one explicit :class:`Search` state, each returning
  :class:`Decision` records (knob, chosen value, trials compared, a :data:`Reason` code and the sentence
  rendered from them). :func:`climb_workers` climbs ``num_workers`` until the gain flattens or the CPU/RAM
  budget is hit; for a set read over the network whose best trial waits on reads, :func:`climb_streams` climbs
  ``remote_streams`` (range requests in flight per worker) the same way; :func:`refine_decode`,
  :func:`refine_batching`, :func:`refine_prefetch` and :func:`refine_pinning` then try one knob at a time at that point (a change is kept only when it wins by
  ``min_gain``; on a CPU-bound loader the win is judged on samples per CPU-second, which a noisy shared
  machine moves far less than samples/s). Knobs that cannot matter on this machine are skipped with the
  reason in the report. The whole sweep, worker start-up included, stays inside ``budget_s``;
  ``target_rate`` ends the search early once the loader beats it with margin. ``measure`` is a parameter,
  so a test can drive the search with a pipeline whose speed it controls. What limits the best trial is
  named by :func:`classify_bound` in the vocabulary of :mod:`gpufeed.measure.bounds`, shared with the verdict.

The layout (``--nproc-per-node N``, ``--trainer-cores``): the worker ladder is per rank, bounded by
:func:`gpufeed.layout.worker_ceiling`, and every rate, ``target_rate`` included, is the node's aggregate.

Outputs (in the run folder): trials.jsonl, trials.parquet, summary.json, config.toml, environment.json,
tune.png, report.md, and the winning ``[loader]`` section (per rank) with the ``[layout]`` it was measured in at
``out``. Only ``cli.py`` prints.
"""

from __future__ import annotations

import dataclasses
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Literal

from gpufeed.measure import bounds
from gpufeed.measure.bounds import TrialBound
from gpufeed.config import LayoutConfig, LoaderConfig, TuneConfig, to_toml
from gpufeed.core.errors import ConfigError, GpufeedError, one_line
from gpufeed.measure.metrics import Stat
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.core.world import World

KNOBS = ("num_workers", "decode", "worker_batching", "prefetch_factor", "pin_memory", "persistent_workers",
         "shuffle_buffer", "remote_streams")
"""LoaderConfig fields the tuner may move (batch_size and image_size are fixed by the caller)."""

WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
STREAMS_LADDER = (1, 2, 4, 8, 16)
"""The remote_streams values :func:`climb_streams` may try, in order (a remote set's range requests per worker)."""
PASSWORD_REMOVED = ("the password of a URL below was removed (user:***@): give gpufeed train the URL with its "
                    "password again, on the command line or in a config file you do not share")
"""The first line of a TOML file tune writes (``--out``, the run folder's config.toml) when it hid a password."""

# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class TrialRecord:
    """One measured loader configuration (a row of trials.parquet)."""

    trial: int
    phase: str
    """workers | remote_streams | decode | worker_batching | prefetch_factor | pin_memory | baseline | exhaustive
    | ..."""
    pipeline: str
    """gpufeed | imagefolder | any name a caller gives (benchmarks)."""
    batch_size: int
    num_workers: int
    decode: str
    worker_batching: bool
    prefetch_factor: int
    pin_memory: bool
    persistent_workers: bool
    shuffle_buffer: int
    image_size: int
    samples_per_s: float | None
    """Median steady-state samples/s over the repeats (None when the trial failed)."""
    samples_per_s_min: float | None = None
    samples_per_s_max: float | None = None
    samples_per_s_runs: list[float] = field(default_factory=list)
    startup_s: float | None = None
    """Build + iterator start + first batch (worker start-up), excluded from the rate."""
    warmup_s: float | None = None
    num_warmup_batches: int = 0
    measure_s: float = 0.0
    """Seconds inside the measurement windows."""
    wall_s: float = 0.0
    """Whole trial, teardown included (what the budget pays)."""
    num_batches: int = 0
    num_samples: int = 0
    data_wait_s: float = 0.0
    """Seconds blocked in next(loader) inside the windows."""
    copy_s: float = 0.0
    """Seconds in the host-to-device move inside the windows (synchronised on CUDA)."""
    cpu_percent_per_core: list[float] = field(default_factory=list)
    cpu_percent_mean: float | None = None
    tree_cores_used: float | None = None
    """CPU seconds of this process and its workers / window seconds."""
    samples_per_core_s: float | None = None
    """samples_per_s / tree_cores_used: the per-core rate."""
    rss_max_bytes: int | None = None
    read_bytes_per_s: float | None = None
    """Storage reads of the process tree (page-cache hits excluded)."""
    disk_read_bytes_per_s: float | None = None
    num_skipped: int = 0
    """Corrupt samples the loader skipped (``on_error = "skip"``)."""
    num_repeated: int = 0
    """Samples the loader read a second time to keep its batch count."""
    truncated: bool = False
    """The budget deadline cut the trial short (fewer repeats or a shorter window)."""
    over_cpu_budget: bool = False
    over_ram_budget: bool = False
    """The loader processes exceeded the RAM budget (``error`` says by how much)."""
    contended: bool = False
    """The machine was >= 90% busy while the loader got < 75% of the cores it could use: other processes
    took CPU, so samples/s is a lower bound (samples_per_core_s still holds)."""
    ranks: int = 1
    """Rank loaders measured at once (``tune --nproc-per-node``), each on its own rank's slice. With more than one,
    samples/s is the node's aggregate (the ranks' rates summed over the same wall windows); the CPU, RSS and read
    figures are summed over the ranks, and start-up, warm-up, the windows' seconds, data wait and copy are the
    slowest rank's start-up and warm-up and the ranks' mean otherwise."""
    rank_samples_per_s: list[float] = field(default_factory=list)
    """Each rank's median samples/s, by rank (empty for a one-rank trial)."""
    slowest_rank_samples_per_s: float | None = None
    """The slowest rank's median samples/s (None for a one-rank trial): DDP steps at this rank's pace."""
    remote_streams: int = LoaderConfig.remote_streams
    """Range requests in flight per worker on a remote shard (no effect on a local set)."""
    note: str = ""
    error: str | None = None
    """Why the trial failed, one sentence."""

    @property
    def ok(self) -> bool:
        return self.error is None and self.samples_per_s is not None

    def loader_config(self, base: LoaderConfig | None = None) -> LoaderConfig:
        """The LoaderConfig this trial measured (other fields from ``base``)."""
        return dataclasses.replace(base or LoaderConfig(), **{k: getattr(self, k) for k in
                                                              (*KNOBS, "batch_size", "image_size")})


def trial_record(cfg: LoaderConfig, rates: list[float] | None = None, *, pipeline: str = "gpufeed",
                 error: str | None = None, **extra: Any) -> TrialRecord:
    """Build a TrialRecord for ``cfg`` from measured rates (or an error); used by fakes in tests too."""
    rates = [float(r) for r in (rates or [])]
    stat = Stat.of(rates) if rates else None
    if stat is not None and not error and extra.get("tree_cores_used") and "samples_per_core_s" not in extra:
        extra["samples_per_core_s"] = stat.median / extra["tree_cores_used"]
    return TrialRecord(
        trial=extra.pop("trial", 0), phase=extra.pop("phase", ""), pipeline=pipeline,
        batch_size=cfg.batch_size, num_workers=cfg.num_workers, decode=cfg.decode,
        worker_batching=cfg.worker_batching, prefetch_factor=cfg.prefetch_factor, pin_memory=cfg.pin_memory,
        persistent_workers=cfg.persistent_workers, shuffle_buffer=cfg.shuffle_buffer, image_size=cfg.image_size,
        remote_streams=cfg.remote_streams, samples_per_s=None if error or stat is None else stat.median,
        samples_per_s_min=None if stat is None else stat.min,
        samples_per_s_max=None if stat is None else stat.max,
        samples_per_s_runs=rates, error=error, **extra,
    )


@dataclass(frozen=True)
class TuneReport:
    """What ``gpufeed tune`` returns (summary.json; ``--json`` prints it)."""

    ok: bool
    shards: str
    run_dir: str | None
    out: str | None
    """The written [loader] TOML (None when no trial succeeded)."""
    best: LoaderConfig | None
    best_trial: int | None
    best_samples_per_s: Stat | None
    baseline: TrialRecord | None
    """Best ImageFolder trial (None without --baseline-imagefolder)."""
    baseline_samples_per_s: Stat | None
    ratio_vs_baseline: float | None
    bound: TrialBound | None
    """What limits the best trial, in :mod:`gpufeed.measure.bounds`' words: decode/CPU | storage | copy | GPU decode |
    unclear."""
    bound_evidence: str
    stop_reason: str
    skipped: dict[str, str]
    """Knob -> why it was not measured."""
    decisions: list[Decision]
    """The search path, one record per step (its ``sentence`` is the step in English)."""
    conclusion: str
    budget_s: float
    elapsed_s: float
    target_rate: float | None
    target_met: bool | None
    usable_cpus: int
    device: str
    num_trials: int
    trials: list[TrialRecord]
    layout: LayoutConfig | None = None
    """The layout the trials ran in ([layout] of ``out``): ranks per node, usable cores, trainer cores, device."""
    slowest_rank_samples_per_s: float | None = None
    """The best trial's slowest rank (None with one rank)."""
    storage: StorageRate | None = None
    """The shard set's read rate from the probe before the trials (None: probe off, or no shard set read)."""
    remote: bool = False
    """The shard set is read over the network (a URL): remote_streams applies and is shown."""


# --------------------------------------------------------------------------- measurement


def measure_stream(open_batches: Callable[[int], Iterable[Any]], *, to_device: Callable[[Any], Any] | None = None,
                   num_workers: int = 0, prefetch_factor: int = 2, warmup_batches: int = 2,
                   window_s: float | None = 2.0, window_batches: int | None = None, repeats: int = 3,
                   deadline: float | None = None, ram_budget_bytes: int | None = None,
                   cuda_sync: Callable[[], None] | None = None, telemetry_interval_s: float = 0.25,
                   skipped: Callable[[], int] | None = None,
                   repeated: Callable[[], int] | None = None,
                   start_barrier: Callable[[], None] | None = None) -> dict[str, Any]:
    """Measure steady-state samples/s of any batch iterable; returns TrialRecord fields.

    ``open_batches(epoch)`` returns one epoch of ``(images, labels)`` batches; epochs are chained
    endlessly (a new epoch's start-up cost counts, as it would in training). Start-up (opening the
    first epoch and its first batch) is timed apart; warm-up then drains the prefetched backlog
    (``num_workers × prefetch_factor`` batches at most, stopping early as soon as a batch has to be
    waited for) plus ``warmup_batches``. A window lasts ``window_s`` and at least 2 batches per worker
    (or exactly ``window_batches``); ``deadline`` (``time.monotonic()``) cuts windows short.
    ``skipped`` / ``repeated`` read the loader's counters at the end. ``start_barrier`` (concurrent rank loaders)
    is called after warm-up and blocks until every rank is there; the windows then end on a shared clock, window
    k at the first batch after ``k+1`` window_s from the barrier, so that all ranks measure the same wall windows
    (within one batch).
    A loader error is raised as an exception whose message is one sentence and whose ``partial`` holds
    what was measured before it; :func:`measure_loader` turns it into an error record.
    """
    import psutil

    from gpufeed.measure.telemetry import Telemetry

    if window_s is None and window_batches is None:
        raise ConfigError("measure needs window_s or window_batches")
    if start_barrier is not None and window_s is None:
        raise ConfigError("measuring ranks together needs window_s (windows on a shared clock)")
    move = to_device or _touch
    sync = cuda_sync or (lambda: None)
    out: dict[str, Any] = {}

    def endless() -> Iterator[Any]:
        epoch = 0
        while True:
            n = 0
            for batch in open_batches(epoch):
                n += 1
                yield batch
            if n == 0:
                raise RuntimeError(f"the loader yielded no batches in epoch {epoch} (too few samples per rank?)")
            epoch += 1

    def past_deadline(extra: float = 0.0) -> bool:
        return deadline is not None and time.monotonic() + extra > deadline

    stream = endless()
    try:
        t0 = time.perf_counter()
        move(next(stream))
        sync()
        t1 = time.perf_counter()
        out["startup_s"] = t1 - t0
        backlog = num_workers * prefetch_factor
        n_warm = 1
        drained = num_workers == 0
        while n_warm < 1 + warmup_batches + backlog and not past_deadline():
            ta = time.perf_counter()
            move(next(stream))
            waited = time.perf_counter() - ta
            n_warm += 1
            if waited > 0.005 and n_warm > backlog // 2:
                drained = True
            if drained and n_warm >= 1 + warmup_batches:
                break
        sync()
        out["warmup_s"] = time.perf_counter() - t1
        out["num_warmup_batches"] = n_warm
        if past_deadline():
            out["truncated"] = True
            raise _OutOfBudget(f"budget ran out during start-up/warm-up ({time.perf_counter() - t0:.1f} s)")

        runs: list[float] = []
        # with W workers delivering whole batches in turn, a window of fewer than 2W batches measures
        # the round-robin phase more than the rate
        min_batches = 2 * max(1, num_workers) if window_batches is None else 1
        me = psutil.Process()
        n_batches = n_samples = 0
        wait_s = copy_s = measure_s = 0.0
        with Telemetry(interval_s=telemetry_interval_s) as tel:
            if start_barrier is not None:
                start_barrier()
            begin = time.perf_counter()
            for r in range(repeats):
                if r > 0 and past_deadline(window_s or 0.0):
                    out["truncated"] = True
                    break
                ts = time.perf_counter()
                # on a shared clock: this window ends (r+1) windows after the barrier, whatever the last one took
                span = begin + (r + 1) * window_s - ts if start_barrier is not None and window_s else window_s
                nb = ns = 0
                while True:
                    ta = time.perf_counter()
                    batch = next(stream)
                    tb = time.perf_counter()
                    move(batch)
                    sync()
                    tc = time.perf_counter()
                    wait_s += tb - ta
                    copy_s += tc - tb
                    nb += 1
                    ns += _batch_len(batch)
                    if window_batches is not None and nb >= window_batches:
                        break
                    if span is not None and tc - ts >= span and nb >= min_batches:
                        break
                    if past_deadline():
                        out["truncated"] = True
                        break
                el = time.perf_counter() - ts
                measure_s += el
                n_batches += nb
                n_samples += ns
                runs.append(ns / el)
                if ram_budget_bytes is not None:
                    rss = _tree_rss(me)
                    if rss > ram_budget_bytes:
                        out["rss_max_bytes"] = rss
                        raise _OverRam(f"RAM budget exceeded: loader processes use {_mb(rss)} > budget "
                                       f"{_mb(ram_budget_bytes)}")
        tel_s = tel.summary()
        out.update(
            samples_per_s_runs=runs, measure_s=measure_s, num_batches=n_batches, num_samples=n_samples,
            data_wait_s=wait_s, copy_s=copy_s,
            cpu_percent_per_core=[round(c, 1) for c in tel_s.cpu_percent_per_core],
            cpu_percent_mean=tel_s.cpu_percent_mean, tree_cores_used=tel_s.tree_cores_used,
            rss_max_bytes=tel_s.rss_max_bytes,
            read_bytes_per_s=tel_s.tree_read_bytes / tel_s.duration_s,
            disk_read_bytes_per_s=None if tel_s.disk_read_bytes is None else tel_s.disk_read_bytes / tel_s.duration_s,
        )
        if ram_budget_bytes is not None and tel_s.rss_max_bytes > ram_budget_bytes:
            raise _OverRam(f"RAM budget exceeded: loader processes peaked at {_mb(tel_s.rss_max_bytes)} > "
                           f"budget {_mb(ram_budget_bytes)}")
        if skipped is not None:
            out["num_skipped"] = int(skipped())
        if repeated is not None:
            out["num_repeated"] = int(repeated())
        return out
    except _TrialError as exc:
        exc.partial = out
        raise
    except Exception as exc:
        raise _LoaderFailed(error_sentence(exc), out) from exc
    finally:
        stream.close()  # shuts DataLoader workers down


def error_sentence(exc: BaseException) -> str:
    """A failed trial in one sentence: a GpufeedError's own sentence, else the type and the first line."""
    if isinstance(exc, GpufeedError):
        return one_line(exc)
    return f"{type(exc).__name__}: {one_line(exc)}"


class _TrialError(Exception):
    """A trial that ended early; ``partial`` holds what was measured before."""

    def __init__(self, message: str, partial: dict[str, Any] | None = None) -> None:
        super().__init__(message)
        self.partial = dict(partial or {})


class _OutOfBudget(_TrialError):
    pass


class _OverRam(_TrialError):
    pass


class _LoaderFailed(_TrialError):
    """The loader raised (its cause is ``__cause__``)."""


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
    ``start_barrier``: see :func:`measure_stream` (:func:`measure_ranks` passes it).
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
        _touch(moved)
        return moved

    sync = _cuda_sync(world)
    return _run_measurement(
        lambda: measure_stream(open_batches, to_device=move, num_workers=cfg.num_workers,
                               prefetch_factor=cfg.prefetch_factor, warmup_batches=warmup_batches, window_s=window_s,
                               window_batches=window_batches, repeats=repeats, deadline=deadline,
                               ram_budget_bytes=ram_budget_bytes, cuda_sync=sync,
                               skipped=lambda: getattr(holder.get("loader"), "num_skipped", 0),
                               repeated=lambda: getattr(holder.get("loader"), "num_repeated", 0),
                               start_barrier=start_barrier),
        cfg, "gpufeed", t0, cleanup=holder.clear)


def measure_node(shards: str | Path, cfg: LoaderConfig, world: World | None = None, **kw: Any) -> TrialRecord:
    """What ``tune`` measures: :func:`measure_loader` in this process for a one-rank ``world``, and
    :func:`measure_ranks` (one process per rank, all at once) when :func:`node_ranks` ranks share the node."""
    world = world or World.single()
    if node_ranks(world) <= 1:
        return measure_loader(shards, cfg, world, **kw)
    return measure_ranks(shards, cfg, world, **kw)


def node_ranks(world: World) -> int:
    """The ranks of the node tune measures: all of ``world`` for one node; ``world_size / num_nodes`` for the node
    a set was staged for (:func:`staged_world`)."""
    return world.world_size // max(1, world.num_nodes)


def rank_world(world: World, rank: int) -> World:
    """Local rank ``rank`` of ``world``'s node (its global rank ``node_rank x ranks per node + rank``), on
    ``cuda:rank`` when the world is on CUDA, as under torchrun."""
    device = f"cuda:{rank}" if world.is_cuda else world.device
    local = node_ranks(world)
    return World(rank=world.node_rank * local + rank, world_size=world.world_size, local_rank=rank, device=device,
                 backend=world.backend, local_world_size=local, node_rank=world.node_rank, num_nodes=world.num_nodes)


def staged_world(world: World, shards: str, base: LoaderConfig, manifest_file: str | None = None) -> World:
    """Under ``shard_split = "node"``, a set staged for node n of N (``gpufeed stage --num-nodes N``) is measured as
    node n reads it in training: ``world``'s ranks become node n's ranks of N such nodes (the same shards, slices
    and batch count as train). Any other set or split: ``world`` unchanged."""
    if base.shard_split != "node":
        return world
    from gpufeed.shardset.source import open_set
    from gpufeed.shardset.manifest import staged_node

    ss = open_set(shards, manifest_file)
    staged = staged_node(ss.manifest, ss.location)
    if staged is None:
        return world
    n, nodes = staged
    local = world.world_size
    return dataclasses.replace(world, rank=n * local, world_size=nodes * local, local_world_size=local, node_rank=n,
                               num_nodes=nodes)


RANK_START_S = 120.0
"""How long a rank process may take to start (import torch, build its loader, warm up) when the trial has no
deadline; with a deadline the ranks get until it and this much again for teardown before they are ended."""


def measure_ranks(shards: str | Path, cfg: LoaderConfig, world: World, *, warmup_batches: int = 2,
                  window_s: float | None = 2.0, window_batches: int | None = None, repeats: int = 3,
                  deadline: float | None = None, ram_budget_bytes: int | None = None,
                  manifest_file: str | Path | None = None) -> TrialRecord:
    """:func:`node_ranks` rank loaders at once, as ``gpufeed train --nproc-per-node N`` runs them on one node.

    One spawned process per rank builds ``build_loader(shards, cfg, rank_world(world, r))`` (its own slice of the
    epoch, its own ``cuda:r`` and pinning there) and measures it with :func:`measure_loader`; a shared barrier
    after warm-up starts every rank's windows together, on the same clock. The RAM budget is split evenly over the
    ranks. Returns one TrialRecord (``ranks`` = N): samples/s per window is the sum of the ranks' rates in that
    window, ``rank_samples_per_s`` each rank's median and ``slowest_rank_samples_per_s`` the lowest. A failed rank
    fails the trial with its sentence; never raises for a bad trial.
    """
    import multiprocessing as mp
    import os
    import queue

    n = node_ranks(world)
    t0 = time.perf_counter()
    if window_s is None:
        return trial_record(cfg, error="measuring ranks together needs window_s", ranks=n)
    ctx = mp.get_context("spawn")  # fork would copy this process's threads and CUDA state into every rank
    barrier = ctx.Barrier(n)
    results = ctx.Queue()
    kw = dict(warmup_batches=warmup_batches, window_s=window_s, window_batches=window_batches, repeats=repeats,
              deadline=deadline, ram_budget_bytes=None if ram_budget_bytes is None else max(1, ram_budget_bytes // n),
              manifest_file=None if manifest_file is None else str(manifest_file))
    wait_s = RANK_START_S if deadline is None else max(0.0, deadline - time.monotonic()) + RANK_START_S / 4
    # rank processes start DataLoader workers of their own, so they cannot be daemons
    procs = [ctx.Process(target=_rank_main, args=(str(shards), cfg, rank_world(world, r), kw, barrier, results,
                                                  wait_s, os.getpid()), daemon=False) for r in range(n)]
    recs: dict[int, TrialRecord] = {}
    lost: dict[int, str] = {}
    give_up = time.monotonic() + wait_s + RANK_START_S / 4 + (repeats * window_s if deadline is None else 0.0)
    try:
        for p in procs:
            p.start()
        while len(recs) + len(lost) < n:
            try:
                rank, fields_ = results.get(timeout=0.2)
                recs[rank] = TrialRecord(**fields_)
                continue
            except queue.Empty:
                pass
            for r, p in enumerate(procs):
                if r not in recs and r not in lost and p.exitcode is not None and results.empty():
                    lost[r] = f"rank {r} process exited with code {p.exitcode} before reporting (killed?)"
            if time.monotonic() > give_up:
                for r in range(n):
                    if r not in recs:
                        lost.setdefault(r, f"rank {r} did not report within {give_up - t0:.0f} s")
                break
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
                p.join(timeout=5)
        results.close()
    rec = combine_ranks(cfg, [recs.get(r) for r in range(n)], lost)
    return dataclasses.replace(rec, wall_s=time.perf_counter() - t0)


def _rank_main(shards: str, cfg: LoaderConfig, world: World, kw: dict[str, Any], barrier: Any, results: Any,
               wait_s: float, parent_pid: int) -> None:
    """One rank process of :func:`measure_ranks`: measure this rank's loader and put ``(local rank, record fields)`` on
    ``results``. A rank that fails before the barrier breaks it, so that the others stop waiting."""
    import threading

    from gpufeed.core.system import die_with_parent

    die_with_parent(parent_pid)
    passed = threading.Event()

    def start() -> None:
        barrier.wait(timeout=wait_s)
        passed.set()

    try:
        if world.is_cuda:
            import torch

            torch.cuda.set_device(world.device)  # pinned memory and copies on this rank's own GPU
        rec = measure_loader(shards, cfg, world, start_barrier=start, **kw)
    except Exception as exc:  # noqa: BLE001 - reported as this rank's error record
        rec = trial_record(cfg, error=error_sentence(exc))
    if not passed.is_set():
        barrier.abort()
    results.put((world.local_rank, dataclasses.asdict(rec)))  # measure_ranks counts the node's ranks


_BARRIER_BROKEN = "BrokenBarrierError"


def combine_ranks(cfg: LoaderConfig, recs: list[TrialRecord | None], lost: dict[int, str] | None = None) -> TrialRecord:
    """One node-level TrialRecord from the ranks' records (``None`` for a rank that never reported, with its reason
    in ``lost``): rates summed window by window over the windows every rank measured; see
    :attr:`TrialRecord.ranks` for the other fields. The first rank's own failure (not a broken barrier, which only
    follows another rank's failure) is the trial's error."""
    n = len(recs)
    lost = lost or {}
    errors = [(r, lost[r]) if rec is None else (r, rec.error or "") for r, rec in enumerate(recs)
              if rec is None or not rec.ok]
    if errors:
        own = [e for e in errors if not e[1].startswith(_BARRIER_BROKEN)] or errors
        r, why = own[0]
        return trial_record(cfg, error=f"rank {r}: {why or 'no rate'}", ranks=n,
                            over_ram_budget=any(x is not None and x.over_ram_budget for x in recs))
    ok = [rec for rec in recs if rec is not None]
    k = min(len(rec.samples_per_s_runs) for rec in ok)
    rates = [sum(rec.samples_per_s_runs[i] for rec in ok) for i in range(k)]

    def total(name: str) -> Any:
        values = [getattr(rec, name) for rec in ok]
        return None if any(v is None for v in values) else sum(values)

    def mean(name: str) -> Any:
        total_ = total(name)
        return None if total_ is None else total_ / n

    medians = [float(rec.samples_per_s) for rec in ok]
    per_core = [list(rec.cpu_percent_per_core) for rec in ok if rec.cpu_percent_per_core]
    return trial_record(
        cfg, rates, ranks=n, rank_samples_per_s=medians, slowest_rank_samples_per_s=min(medians),
        startup_s=max(rec.startup_s or 0.0 for rec in ok), warmup_s=max(rec.warmup_s or 0.0 for rec in ok),
        num_warmup_batches=max(rec.num_warmup_batches for rec in ok), measure_s=mean("measure_s"),
        num_batches=total("num_batches"), num_samples=total("num_samples"), data_wait_s=mean("data_wait_s"),
        copy_s=mean("copy_s"),
        cpu_percent_per_core=[round(sum(c) / len(c), 1) for c in zip(*per_core)] if per_core else [],
        cpu_percent_mean=mean("cpu_percent_mean"), tree_cores_used=total("tree_cores_used"),
        rss_max_bytes=total("rss_max_bytes"), read_bytes_per_s=total("read_bytes_per_s"),
        disk_read_bytes_per_s=mean("disk_read_bytes_per_s"), num_skipped=total("num_skipped"),
        num_repeated=total("num_repeated"), truncated=any(rec.truncated for rec in ok))


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
        _touch(batch)
        return batch

    return _run_measurement(
        lambda: measure_stream(open_batches, to_device=move, num_workers=cfg.num_workers,
                               prefetch_factor=cfg.prefetch_factor, warmup_batches=warmup_batches, window_s=window_s,
                               window_batches=window_batches, repeats=repeats, deadline=deadline,
                               ram_budget_bytes=ram_budget_bytes, cuda_sync=_cuda_sync(world)),
        cfg, "imagefolder", t0, cleanup=holder.clear)


def _run_measurement(fn: Callable[[], dict[str, Any]], cfg: LoaderConfig, pipeline: str, t0: float,
                     cleanup: Callable[[], None]) -> TrialRecord:
    error = None
    try:
        fields_ = fn()
    except _TrialError as exc:
        fields_, error = dict(exc.partial), one_line(exc)
        if isinstance(exc, _OverRam):
            fields_["over_ram_budget"] = True
    except Exception as exc:  # a failed trial is a record; the sweep goes on
        fields_, error = {}, error_sentence(exc)
    finally:
        cleanup()
    rates = fields_.pop("samples_per_s_runs", [])
    fields_["wall_s"] = time.perf_counter() - t0
    rec = trial_record(cfg, rates, pipeline=pipeline, error=error, **fields_)
    if rec.ok and rec.tree_cores_used:
        rec = dataclasses.replace(rec, samples_per_core_s=rec.samples_per_s / rec.tree_cores_used)
    return rec


def _touch(batch: Any) -> None:
    """Read one element of each tensor so lazily produced batches are really materialised."""
    items = batch if isinstance(batch, (tuple, list)) else (batch,)
    for t in items:
        shape = getattr(t, "shape", None)
        if shape is not None and hasattr(t, "item") and all(shape) and str(getattr(t, "device", "")) == "cpu":
            t[tuple(n - 1 for n in shape)].item()  # indexing, not reshape: a strided view would be copied


def _batch_len(batch: Any) -> int:
    if isinstance(batch, (tuple, list)) and len(batch) >= 2:
        return int(len(batch[1]))
    return int(len(batch))


def _cuda_sync(world: World) -> Callable[[], None] | None:
    if not world.is_cuda:
        return None
    import torch

    return lambda: torch.cuda.synchronize(world.device)


def _tree_rss(proc: Any) -> int:
    import psutil

    total = 0
    try:
        procs = [proc, *proc.children(recursive=True)]
    except psutil.Error:
        return 0
    for p in procs:
        try:
            total += p.memory_info().rss
        except psutil.Error:
            pass
    return total


def _mb(n: float | None) -> str:
    return "-" if n is None else f"{n / 1e6:.0f} MB"


# --------------------------------------------------------------------------- decisions


Reason = Literal[
    "setup",                     # the budgets the search runs under
    "contended-remeasured",      # a worker count measured again: other processes held the CPU the first time
    "stopped-budget",            # the climb stopped: no time left for the next worker count
    "stopped-ram-budget",        # the climb stopped: a trial exceeded the RAM budget
    "gain-flattened",            # the climb stopped: more workers gained less than min_gain
    "cpu-saturated",             # the climb stopped: the loader used (nearly) all of its CPU budget
    "zero-workers-within-gain",  # 0 workers was faster, but by less than min_gain: workers kept
    "workers-chosen",            # the worker count the refinements start from
    "adopted",                   # a candidate won by min_gain: the knob moved
    "no-gain",                   # a candidate did not win by min_gain: the knob stayed
    "candidate-failed",          # the candidate's trial failed: the knob stayed
    "contended-warning",         # some trials ran while other processes held the CPU
    "streams-io-bound",          # a remote set whose best trial waits on reads: the streams climb starts
    "streams-stopped-budget",    # the streams climb stopped: no time left for the next count
    "streams-flattened",         # the streams climb stopped: more streams gained less than min_gain
    "streams-chosen",            # the range requests per worker kept for a remote set
    "chart-failed",              # tune.png could not be written (the records stand)
]
"""Why the search took a step: the code tests and tools read; :attr:`Decision.sentence` is its English."""

_SENTENCES: dict[str, str] = {
    "setup": "{usable} usable CPUs, {ranks} rank(s) per node, {trainer_cores} core(s) left to each training process, "
             "cpu_budget {cpu_budget:g} -> {loader_cores:g} cores for the loaders, up to {ceiling} workers per rank; "
             "RAM budget {ram_budget}; {repeats} windows of {window_s:.2f} s per trial",
    "contended-remeasured": "{workers} workers measured while the CPU was contended ({first:.0f} samples/s), "
                            "again: {again:.0f}",
    "stopped-budget": "stopped before {workers} workers (budget)",
    "stopped-ram-budget": "stopped at {workers} workers: {error}",
    "gain-flattened": "gain flattened at {workers} workers ({rate:.0f} vs {best_rate:.0f} samples/s at "
                      "{best_workers}, < {min_gain:.0%})",
    "cpu-saturated": "CPU budget saturated at {workers} workers (tree used {cores_used:.2f} of {cores_budget:.2f} "
                     "cores)",
    "zero-workers-within-gain": "0 workers measured {zero_rate:.0f} samples/s, within {min_gain:.0%} of {chosen} "
                                "workers: workers kept (they overlap loading with training)",
    "workers-chosen": "keep {chosen} ({rate:.0f} samples/s)",
    "adopted": "{previous!r} -> {chosen!r} ({metric} {ref:.0f} -> {value:.0f}; samples/s {ref_rate:.0f} -> "
               "{rate:.0f})",
    "no-gain": "keep {chosen!r} ({candidate!r} gave {metric} {value:.0f}, needs > {needed:.0f})",
    "candidate-failed": "keep {chosen!r} ({candidate!r} failed: {error})",
    "contended-warning": "warning: {count} of {total} trials ({trials}) ran while other processes held the CPU "
                         "(machine >= {busy_pct:.0f}% busy, loader < {saturated:.0%} of its cores): their samples/s "
                         "are lower bounds; rerun on a quiet machine to trust the worker count",
    "chart-failed": "chart not written: {error}",
    "streams-io-bound": "remote set whose loader waits on reads ({evidence}): more range requests in flight per "
                        "worker may help; trying {ladder}",
    "streams-stopped-budget": "stopped before {streams} streams (budget)",
    "streams-flattened": "gain flattened at {streams} streams ({rate:.0f} vs {best_rate:.0f} samples/s at "
                         "{best_streams}, < {min_gain:.0%})",
    "streams-chosen": "keep {chosen} streams per worker ({rate:.0f} samples/s)",
}


@dataclass(frozen=True)
class Decision:
    """One step of the search path (summary.json ``decisions``; report.md's "Search path" lists the sentences)."""

    knob: str
    """The LoaderConfig field this step decided (num_workers, decode, ...), or "search" / "outputs" for a note
    on the run as a whole."""
    reason: Reason
    chosen: Any = None
    """The knob's value after this step; None for a step that settles no value (the climb's stop, a note)."""
    candidates: tuple[int, ...] = ()
    """Numbers of the trials this step compared (the reference first)."""
    detail: dict[str, Any] = field(default_factory=dict)
    """The numbers the sentence names."""
    sentence: str = field(init=False)
    """The step in English, rendered from the fields above."""

    def __post_init__(self) -> None:
        text = _SENTENCES[self.reason].format(chosen=self.chosen, **self.detail)
        object.__setattr__(self, "sentence", text if self.knob == "search" else f"{self.knob}: {text}")


# --------------------------------------------------------------------------- search


MeasureFn = Callable[..., TrialRecord]
CheckFn = Callable[..., int]
"""``(shards, base, world[, manifest_file=...]) -> samples per epoch`` (:func:`check_shard_set`)."""

BUDGET_SATURATED = 0.9
"""The worker climb stops once the loader processes use this fraction of the CPU budget's cores."""


def check_shard_set(shards: str, base: LoaderConfig, world: World, manifest_file: str | None = None) -> int:
    """The checks ``gpufeed train`` makes before it starts, with the same exit code 2 (manifest, shard files present
    and readable, one batch per rank of ``world``); returns the samples per epoch."""
    from gpufeed.loader.checks import open_shards

    return int(open_shards(shards, base, dataclasses.replace(rank_world(world, 0), device="cpu", backend="gloo"),
                           manifest_file=manifest_file).manifest.num_samples)


class Search:
    """The state of one tune run: the trial log, the budgets and deadlines, the current point of the search
    (``point`` and the trial that measured it, ``point_rec``), the knobs left unmeasured (``skipped``) and the
    decisions taken. Phase functions read and move it; :func:`tune` runs them in order."""

    def __init__(self, cfg: TuneConfig, shards: str, base: LoaderConfig, world: World, measure: MeasureFn, *,
                 window_s: float, ram_budget: int, usable: int, ceiling: int,
                 progress: Callable[[str], None] | None) -> None:
        self.cfg, self.shards, self.base, self.world, self.measure = cfg, shards, base, world, measure
        self.window_s = window_s
        self.ram_budget = ram_budget
        self.usable = usable
        self.cores_budget = cfg.cpu_budget * usable
        self.ceiling = ceiling
        self.progress = progress or (lambda s: None)
        self.t0 = time.monotonic()
        self.deadline = self.t0 + cfg.budget_s
        self.search_deadline = self.t0 + cfg.budget_s * (0.75 if cfg.baseline_imagefolder else 1.0)
        """The gpufeed search leaves a quarter of the budget to the ImageFolder baseline when there is one."""
        self.point: LoaderConfig = base
        self.point_rec: TrialRecord | None = None
        self.trials: list[TrialRecord] = []
        self.decisions: list[Decision] = []
        self.skipped: dict[str, str] = {}
        self.cache: dict[tuple[Any, ...], TrialRecord] = {}
        self.stop_reason = ""
        self.layout: LayoutConfig | None = None
        """The layout the trials run in (set by :func:`tune`)."""
        from gpufeed.shardset.source import is_url

        self.remote = is_url(shards)
        """The set is read over the network in range requests, where remote_streams applies."""
        self.storage_bytes_per_s: float | None = None
        """The probed storage rate (set by :func:`tune`), for :func:`classify_bound`."""
        self.mean_sample_bytes: float | None = None
        """The manifest's mean bytes per sample of a remote set (set by :func:`tune`): its trials read over sockets,
        which the storage I/O counters behind ``read_bytes_per_s`` do not count, so a trial's read rate is its
        samples/s times this (as ``train`` estimates it)."""

    def elapsed(self) -> float:
        return time.monotonic() - self.t0

    def estimate_s(self, lc: LoaderConfig) -> float:
        """Expected wall time of a trial: observed overhead (start-up, warm-up, teardown) + windows."""
        overheads = [t.wall_s - t.measure_s for t in self.trials if t.num_workers == lc.num_workers and t.wall_s]
        if not overheads:
            overheads = [(t.wall_s - t.measure_s) * (lc.num_workers + 1) / (t.num_workers + 1)
                         for t in self.trials if t.wall_s]
        overhead = max(overheads) if overheads else 0.5 + 0.5 * lc.num_workers
        return overhead + self.cfg.repeats * self.window_s

    def run(self, lc: LoaderConfig, phase: str, *, measure: MeasureFn | None = None, source: str | None = None,
            deadline: float | None = None, fresh: bool = False) -> TrialRecord | None:
        """Measure ``lc`` unless it was measured already (``fresh`` measures again) or would not fit in the
        budget (-> None)."""
        key = (source or self.shards, *(getattr(lc, f) for f in (*KNOBS, "batch_size", "image_size")))
        if key in self.cache and not fresh:
            return self.cache[key]
        deadline = min(deadline or self.deadline, self.deadline)
        # the first windows may be cut short; what must fit is start-up + one window
        need = self.estimate_s(lc) - (self.cfg.repeats - 1) * self.window_s
        if time.monotonic() + need > deadline:
            self.stop_reason = self.stop_reason or f"budget: {self.cfg.budget_s:g} s spent or too little left for a trial"
            return None
        fn = measure or self.measure
        extra = {"manifest_file": self.cfg.manifest} if self.cfg.manifest and source is None else {}
        t_start = time.perf_counter()
        try:
            rec = fn(source or self.shards, lc, self.world, warmup_batches=self.cfg.warmup_batches,
                     window_s=self.window_s, repeats=self.cfg.repeats, deadline=deadline,
                     ram_budget_bytes=self.ram_budget, **extra)
        except Exception as exc:  # injected measures may raise; the sweep goes on
            rec = trial_record(lc, error=error_sentence(exc))
        if not rec.wall_s:
            rec = dataclasses.replace(rec, wall_s=time.perf_counter() - t_start)
        over = bool(rec.ok and rec.tree_cores_used is not None and self.cfg.cpu_budget < 1
                    and rec.tree_cores_used > self.cores_budget * 1.1)
        contended = bool(rec.ok and rec.cpu_percent_mean is not None and rec.tree_cores_used is not None
                         and rec.cpu_percent_mean >= bounds.MACHINE_BUSY_PCT
                         and not bounds.cpu_saturated(rec.tree_cores_used, _possible_cores(rec, self.usable)))
        rec = dataclasses.replace(rec, trial=len(self.trials), phase=phase, over_cpu_budget=over, contended=contended)
        if self.remote and self.mean_sample_bytes and rec.ok and rec.samples_per_s and source is None:
            rec = dataclasses.replace(rec, read_bytes_per_s=rec.samples_per_s * self.mean_sample_bytes)
        self.trials.append(rec)
        self.cache[key] = rec
        result = f"{rec.samples_per_s:8.1f} samples/s" if rec.ok else f"ERROR {one_line(rec.error or 'no rate')}"
        self.progress(f"trial {rec.trial:2d} {phase:16s} {describe(rec, self.world.is_cuda, self.remote):60s} {result}")
        return rec

    def target_reached(self) -> bool:
        if self.cfg.target_rate is None:
            return False
        best = self.best()
        return best is not None and best.samples_per_s >= self.cfg.target_rate * self.cfg.target_margin

    def best(self, phase_filter: Callable[[TrialRecord], bool] | None = None) -> TrialRecord | None:
        ok = [t for t in self.trials if t.ok and t.pipeline == "gpufeed" and not t.over_cpu_budget
              and (phase_filter is None or phase_filter(t))]
        return max(ok, key=lambda t: t.samples_per_s) if ok else None


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
                write: bool = True) -> TuneReport:
    """Search the fastest LoaderConfig for ``cfg.shards`` on this machine within ``cfg.budget_s``.

    ``base`` (the [loader] section) supplies the knobs the tuner does not move (seed, on_error, ...), the
    starting point (decode path, prefetch, batching), and batch_size and image_size unless ``cfg`` sets them.
    ``measure`` has :func:`measure_loader`'s signature; a test passes a fake. ``check_shards`` runs before the
    first trial (default :func:`check_shard_set`: a shard set that cannot be read is a DataError, exit 2, as in
    ``gpufeed train``) and returns the samples per epoch; None skips it (a fake ``measure`` reads no shards).
    With ``write`` the run folder and ``cfg.out`` are written. Unless ``cfg.storage_probe_s`` is 0, the shard set's
    read rate is probed first (:func:`gpufeed.measure.storage_probe.probe`, outside the budget): the bound and the storage line
    of the report compare the best trial's read rate with it.

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
    from gpufeed.core.system import total_ram_bytes, usable_cpus

    if not cfg.shards:
        raise ConfigError("tune needs a shard set: gpufeed tune SHARDS")
    shards = str(cfg.shards)
    if cfg.baseline_imagefolder and not Path(cfg.baseline_imagefolder).is_dir():
        raise ConfigError(f"--baseline-imagefolder {cfg.baseline_imagefolder} is not a folder")
    if cfg.baseline_imagefolder and (cfg.nproc_per_node or 1) > 1:
        raise ConfigError("--baseline-imagefolder measures one ImageFolder loader, which cannot be compared with the "
                          f"aggregate of {cfg.nproc_per_node} ranks: use it with --nproc-per-node 1")
    from gpufeed.layout import device_type, loader_cores, worker_ceiling

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
    base = base or LoaderConfig()
    base = dataclasses.replace(base, batch_size=base.batch_size if cfg.batch_size is None else cfg.batch_size,
                               image_size=base.image_size if cfg.image_size is None else cfg.image_size)
    world = staged_world(world, shards, base, cfg.manifest)
    if (base.decode == "gpu" and not world.is_cuda) or (base.decode == "simplejpeg" and not _has_module("simplejpeg")):
        base = dataclasses.replace(base, decode="pil-draft")
    if check_shards is None:
        epoch_samples = None
    else:
        epoch_samples = (check_shards(shards, base, world, manifest_file=cfg.manifest) if cfg.manifest
                         else check_shards(shards, base, world))
    storage = None
    if cfg.storage_probe_s > 0:  # before the budget starts: the trials get all of it
        from gpufeed.measure.storage_probe import probe

        storage = probe(shards, cfg.storage_probe_s, manifest=cfg.manifest)
        if progress:
            progress(f"storage probe: {storage.bytes_per_s / 1e6:,.1f} MB/s with {storage.readers} reader(s), "
                     f"{storage.cache}")

    usable = usable_cpus()
    cap = worker_ceiling(usable, ranks, cfg.trainer_cores, cfg.cpu_budget)
    ceiling = cap if cfg.max_workers is None else (cfg.max_workers if cfg.cpu_budget >= 1 else
                                                   min(cfg.max_workers, cap))
    ram_budget = cfg.ram_budget if cfg.ram_budget is not None else total_ram_bytes() // 2
    ladder = [w for w in WORKER_LADDER if w <= ceiling]
    if ceiling not in ladder:
        ladder.append(ceiling)
    from gpufeed.shardset.source import is_url

    streams_trials = len(STREAMS_LADDER) - 1 if is_url(shards) else 0  # one is the point's
    n_expected = len(ladder) + 3 + streams_trials + (2 if cfg.baseline_imagefolder else 0)
    window_s = cfg.window_s or min(10.0, max(0.3, cfg.budget_s / (n_expected * (cfg.repeats + 1.5))))

    s = Search(cfg, shards, base, world, measure, window_s=window_s, ram_budget=ram_budget, usable=usable,
               ceiling=ceiling, progress=progress)
    s.storage_bytes_per_s = storage.bytes_per_s if storage else None
    if s.remote and check_shards is not None:  # without the shard-set check (injected measures) nothing is fetched
        from gpufeed.shardset.source import open_set

        s.mean_sample_bytes = open_set(shards, cfg.manifest).manifest.mean_sample_bytes or None
    s.layout = LayoutConfig(ranks_per_node=ranks, usable_cores=usable, trainer_cores=cfg.trainer_cores,
                            device=device_type(world.device))
    s.decisions.append(Decision("search", "setup", detail={
        "usable": usable, "ranks": ranks, "trainer_cores": cfg.trainer_cores,
        "loader_cores": loader_cores(usable, ranks, cfg.trainer_cores, cfg.cpu_budget), "cpu_budget": cfg.cpu_budget,
        "ceiling": ceiling, "ram_budget": _mb(ram_budget), "repeats": cfg.repeats, "window_s": window_s}))
    s.decisions += climb_workers(s, ladder)
    if s.point_rec is not None and not s.target_reached():
        for phase in (climb_streams, refine_decode, refine_batching, refine_prefetch, refine_pinning):
            s.decisions += phase(s)
    best = s.point_rec  # the search path's point: a knob moved only when it won by min_gain
    chosen = settle_unmeasured(s, best, epoch_samples) if best is not None else None
    busy = [t.trial for t in s.trials if t.contended]
    if busy:
        s.decisions.append(Decision("search", "contended-warning", candidates=tuple(busy), detail={
            "count": len(busy), "total": len(s.trials), "trials": "#" + ", #".join(map(str, busy)),
            "busy_pct": bounds.MACHINE_BUSY_PCT, "saturated": bounds.SATURATED_FRACTION}))
    if s.target_reached():
        s.stop_reason = f"target reached: best >= {cfg.target_rate:g} x {cfg.target_margin:g} samples/s"
    elif not s.stop_reason:
        s.stop_reason = "search complete"
    baseline = measure_baseline_imagefolder(s, measure_baseline) if cfg.baseline_imagefolder else None

    report = _finish(s, chosen, best, baseline, storage)
    if write:
        report = write_outputs(report, cfg, base)
    return report


def climb_workers(s: Search, ladder: list[int]) -> list[Decision]:
    """Phase 1: num_workers up ``ladder`` from the base until the gain flattens or a budget is hit. The fastest
    worker count measured becomes the search point; 0 workers (loading in the training process, never overlapped
    with the step) only when it beats every worker count >= 1 by min_gain."""
    cfg, base = s.cfg, s.base
    out: list[Decision] = []
    climb_best: TrialRecord | None = None
    for w in ladder:
        if s.target_reached():
            break
        lc = dataclasses.replace(base, num_workers=w, persistent_workers=w > 0 and base.persistent_workers)
        rec = s.run(lc, "workers", deadline=s.search_deadline)
        if rec is None:
            out.append(Decision("num_workers", "stopped-budget", detail={"workers": w}))
            break
        if rec.ok and rec.contended and w >= 1:
            # other processes only ever take cores away: measure once more and keep the faster reading
            again = s.run(lc, "workers-retry", deadline=s.search_deadline, fresh=True)
            if again is not None and again.ok:
                out.append(Decision("num_workers", "contended-remeasured", candidates=(rec.trial, again.trial),
                                    detail={"workers": w, "first": rec.samples_per_s, "again": again.samples_per_s}))
                if again.samples_per_s > rec.samples_per_s:
                    rec = again
        if not rec.ok:
            if rec.over_ram_budget:
                out.append(Decision("num_workers", "stopped-ram-budget", candidates=(rec.trial,),
                                    detail={"workers": w, "error": rec.error}))
                break
            continue
        if w >= 2 and climb_best is not None and rec.samples_per_s < climb_best.samples_per_s * (1 + cfg.min_gain):
            out.append(Decision("num_workers", "gain-flattened", candidates=(climb_best.trial, rec.trial), detail={
                "workers": w, "rate": rec.samples_per_s, "best_rate": climb_best.samples_per_s,
                "best_workers": climb_best.num_workers, "min_gain": cfg.min_gain}))
            break
        if w >= 1 and (climb_best is None or rec.samples_per_s > climb_best.samples_per_s):
            climb_best = rec  # 0 workers is only a reference: 1 worker may lose to it and 2 still win
        if rec.tree_cores_used is not None and rec.tree_cores_used >= BUDGET_SATURATED * s.cores_budget \
                and w < s.ceiling:
            out.append(Decision("num_workers", "cpu-saturated", candidates=(rec.trial,), detail={
                "workers": w, "cores_used": rec.tree_cores_used, "cores_budget": s.cores_budget}))
            break
    chosen = s.best(lambda t: t.num_workers >= 1)
    zero = s.best(lambda t: t.num_workers == 0)
    if zero is not None and (chosen is None or zero.samples_per_s > chosen.samples_per_s * (1 + cfg.min_gain)):
        chosen = zero
    elif zero is not None and chosen is not None and zero.samples_per_s > chosen.samples_per_s:
        out.append(Decision("num_workers", "zero-workers-within-gain", chosen=chosen.num_workers,
                            candidates=(chosen.trial, zero.trial),
                            detail={"zero_rate": zero.samples_per_s, "min_gain": cfg.min_gain}))
    if chosen is not None:
        s.point, s.point_rec = chosen.loader_config(base), chosen
        climb = tuple(t.trial for t in s.trials if t.phase in ("workers", "workers-retry"))
        out.append(Decision("num_workers", "workers-chosen", chosen=chosen.num_workers, candidates=climb,
                            detail={"rate": chosen.samples_per_s}))
    return out


def climb_streams(s: Search) -> list[Decision]:
    """Phase 2, for a set read over the network: when the search point's trial waits on reads (storage-bound, or
    neither CPU- nor copy-bound, or "CPU-bound" only through other processes' load while the loader's own processes
    sat idle), climb ``remote_streams`` up :data:`STREAMS_LADDER` at the chosen worker count
    with the worker climb's rules: stop when a count gains less than min_gain over the best one below it, or when
    the budget is spent or a count exceeds the RAM budget (another failed count is passed over). The best count of
    the climb becomes the search point (on a tie, the fewest streams); the starting count stays only when it beat
    the climb's best by min_gain. A
    local set or a CPU/copy-bound point skips the phase, with the reason in ``skipped``."""
    ref = s.point_rec
    if ref is None:
        return []
    if not s.remote:
        s.skipped["remote_streams"] = "local shards: remote_streams only applies to a set read over the network"
        return []
    bound, evidence = classify_bound(ref, s.usable, s.storage_bytes_per_s)
    possible = _possible_cores(ref, s.usable)
    if bound == bounds.DECODE_CPU and not bounds.cpu_saturated(ref.tree_cores_used, possible):
        # "CPU" only because other processes kept the machine busy: the loader's own processes sat waiting
        evidence = (f"its processes kept {ref.tree_cores_used or 0.0:.2f} of {possible} cores busy; the machine's "
                    f"{ref.cpu_percent_mean or 0.0:.0f}% load was other work")
    elif bound not in (bounds.STORAGE, bounds.UNCLEAR):
        s.skipped["remote_streams"] = (f"not measured: the best trial's bound is {bound} ({evidence}); more range "
                                       f"requests only help a loader that waits on reads")
        return []
    cfg = s.cfg
    out = [Decision("remote_streams", "streams-io-bound", chosen=s.point.remote_streams, candidates=(ref.trial,),
                    detail={"bound": bound, "evidence": evidence,
                            "ladder": ", ".join(map(str, STREAMS_LADDER))})]
    climb_best: TrialRecord | None = None
    for n in STREAMS_LADDER:
        if s.target_reached():
            break
        rec = s.run(dataclasses.replace(s.point, remote_streams=n), "remote_streams", deadline=s.search_deadline)
        if rec is None:
            out.append(Decision("remote_streams", "streams-stopped-budget", detail={"streams": n}))
            break
        if not rec.ok:
            out.append(Decision("remote_streams", "candidate-failed", chosen=s.point.remote_streams,
                                candidates=(ref.trial, rec.trial),
                                detail={"candidate": n, "error": one_line(rec.error or "no rate")}))
            if rec.over_ram_budget:
                break  # more streams only hold more
            continue
        if climb_best is not None and rec.samples_per_s < climb_best.samples_per_s * (1 + cfg.min_gain):
            out.append(Decision("remote_streams", "streams-flattened", candidates=(climb_best.trial, rec.trial),
                                detail={"streams": n, "rate": rec.samples_per_s, "best_rate": climb_best.samples_per_s,
                                        "best_streams": climb_best.remote_streams, "min_gain": cfg.min_gain}))
            break
        climb_best = rec
    chosen = climb_best
    if chosen is None or (ref.ok and ref.samples_per_s > chosen.samples_per_s * (1 + cfg.min_gain)):
        chosen = ref
    s.point, s.point_rec = chosen.loader_config(s.base), chosen
    climb = tuple(t.trial for t in s.trials if t.phase == "remote_streams")
    out.append(Decision("remote_streams", "streams-chosen", chosen=chosen.remote_streams, candidates=climb,
                        detail={"rate": chosen.samples_per_s}))
    return out


def refine(s: Search, knob: str, values: list[Any]) -> list[Decision]:
    """Try each of ``values`` for ``knob`` at the search point; move the point when a candidate wins by min_gain
    (on the quantity :func:`_compare_on` names). A candidate the budget has no room for is noted in ``skipped``."""
    out: list[Decision] = []
    for v in values:
        ref = s.point_rec
        if ref is None or s.target_reached():
            break
        cand = dataclasses.replace(s.point, **{knob: v})
        rec = s.run(cand, knob, deadline=s.search_deadline)
        if rec is None:
            s.skipped.setdefault(knob, "budget: no time left for this trial")
            break
        previous = getattr(s.point, knob)
        pair = (ref.trial, rec.trial)
        metric, a, b = _compare_on(ref, rec, s.usable, knob)
        if not rec.ok:
            out.append(Decision(knob, "candidate-failed", chosen=previous, candidates=pair,
                                detail={"candidate": v, "error": one_line(rec.error or "no rate")}))
        elif b > a * (1 + s.cfg.min_gain):
            out.append(Decision(knob, "adopted", chosen=v, candidates=pair, detail={
                "previous": previous, "metric": metric, "ref": a, "value": b, "ref_rate": ref.samples_per_s,
                "rate": rec.samples_per_s}))
            s.point, s.point_rec = cand, rec
        else:
            out.append(Decision(knob, "no-gain", chosen=previous, candidates=pair, detail={
                "candidate": v, "metric": metric, "value": b, "needed": a * (1 + s.cfg.min_gain)}))
    return out


def refine_decode(s: Search) -> list[Decision]:
    """Phase 2: the other decode paths that exist here (simplejpeg installed, gpu on CUDA)."""
    decodes = []
    for d in ("simplejpeg", "pil-draft", "gpu"):
        if d == s.point.decode:
            continue
        if d == "simplejpeg" and not _has_module("simplejpeg"):
            s.skipped["decode=simplejpeg"] = "simplejpeg is not installed (pip install simplejpeg)"
        elif d == "gpu" and not s.world.is_cuda:
            s.skipped["decode=gpu"] = "no CUDA device"
        else:
            decodes.append(d)
    if s.point.decode != "pil":
        s.skipped["decode=pil"] = ("not measured: same libjpeg decoder as pil-draft, which only adds reduced-size "
                                   "DCT scaling when the crop allows it, so full decode cannot be faster")
    return refine(s, "decode", decodes)


def refine_batching(s: Search) -> list[Decision]:
    """Phase 3: collate in the workers or in the main process (workers only)."""
    if s.point.num_workers == 0:
        s.skipped["worker_batching"] = "best has 0 workers: batches are made in the main process either way"
        return []
    return refine(s, "worker_batching", [not s.point.worker_batching])


def refine_prefetch(s: Search) -> list[Decision]:
    """Phase 4: prefetch depth 2 <-> 4 (workers only)."""
    if s.point.num_workers == 0:
        s.skipped["prefetch_factor"] = "best has 0 workers: prefetch_factor is ignored"
        return []
    return refine(s, "prefetch_factor", [4 if s.point.prefetch_factor <= 2 else 2])


def refine_pinning(s: Search) -> list[Decision]:
    """Phase 5: pinned host memory (CUDA only)."""
    if not s.world.is_cuda:
        s.skipped["pin_memory"] = "no CUDA device: pinning only matters for host-to-GPU copies"
        return []
    return refine(s, "pin_memory", [not s.point.pin_memory])


def settle_unmeasured(s: Search, best: TrialRecord, epoch_samples: int | None) -> LoaderConfig:
    """The chosen LoaderConfig: ``best`` (the search point's trial) with the knobs not worth a trial set, each with
    its reason in ``skipped`` (persistent_workers on when there are workers; resize and shuffle_buffer as in the
    base)."""
    chosen = best.loader_config(s.base)
    if chosen.num_workers > 0:
        epoch_s = (epoch_samples / best.samples_per_s) if epoch_samples and best.samples_per_s else None
        cost = best.startup_s or 0.0
        share = f", {100 * cost / epoch_s:.1f}% of a {epoch_s:.0f}-s epoch" if epoch_s else ""
        s.skipped["persistent_workers"] = (
            f"not measured: it only changes epoch boundaries, where it saves the worker start-up "
            f"({cost:.2f} s per epoch{share}); set true, its RAM is already inside the measured RSS")
        chosen = dataclasses.replace(chosen, persistent_workers=True)
    else:
        s.skipped["persistent_workers"] = "best has 0 workers: nothing to keep alive"
    s.skipped["resize"] = (f"not measured: kept at {chosen.resize!r}; 'torch' is the loader's SIMD uint8 kernel, "
                           f"'pil' its reference path (same filter, slower)")
    s.skipped["shuffle_buffer"] = (
        f"not measured: a randomness knob, not a speed knob (a smaller buffer would 'win' by hurting "
        f"training); kept at {chosen.shuffle_buffer}; its RAM is inside the measured RSS "
        f"({_mb(best.rss_max_bytes)} of {_mb(s.ram_budget)} budget)")
    return chosen


def measure_baseline_imagefolder(s: Search, measure: MeasureFn) -> TrialRecord | None:
    """torchvision ImageFolder + DataLoader at the same batch and image size, with its own small sweep (all the
    workers the budget allows, and half of them, prefetch 2 and 4); returns its fastest trial."""
    bw = s.ceiling if s.ceiling > 0 else 1
    for w, pf in [(bw, 2), (bw, 4)] + ([(max(1, bw // 2), 2)] if bw >= 4 else []):
        lc = dataclasses.replace(LoaderConfig(), batch_size=s.base.batch_size, image_size=s.base.image_size,
                                 num_workers=w, prefetch_factor=pf, persistent_workers=True,
                                 pin_memory=s.world.is_cuda, decode="pil", worker_batching=False,
                                 shuffle_buffer=0, seed=s.base.seed)
        rec = s.run(lc, "baseline", measure=measure, source=str(s.cfg.baseline_imagefolder))
        if rec is None:
            s.skipped[f"baseline workers={w} prefetch={pf}"] = "budget: no time left for this trial"
            break
        s.trials[rec.trial] = dataclasses.replace(rec, pipeline="imagefolder")
    ok = [t for t in s.trials if t.phase == "baseline" and t.ok]
    return max(ok, key=lambda t: t.samples_per_s) if ok else None


def _compare_on(ref: TrialRecord, rec: TrialRecord, usable: int, knob: str = "") -> tuple[str, float, float]:
    """The quantity a refinement is judged on: ``(name, ref value, candidate value)``.

    At a fixed worker count on a CPU-bound loader the decode path and in-worker batching change the
    rate through their CPU cost, so those candidates are compared on samples per CPU-second of the
    loader processes, which other tenants of a shared machine barely move (they take cores away, and
    samples/s drifts 10-50% with them). Prefetch depth and pinning do not change the CPU work per
    sample (they hide latency), and storage-bound, GPU-decode or unmeasured trials have no CPU story:
    those are compared on samples/s.
    """
    if (knob not in ("prefetch_factor", "pin_memory") and rec.ok and ref.samples_per_core_s and rec.samples_per_core_s
            and "gpu" not in (ref.decode, rec.decode) and ref.num_workers == rec.num_workers
            and classify_bound(ref, usable)[0] == bounds.DECODE_CPU):
        return "samples per CPU-s", ref.samples_per_core_s, rec.samples_per_core_s
    return "samples/s", ref.samples_per_s or 0.0, rec.samples_per_s or 0.0


def _finish(s: Search, chosen: LoaderConfig | None, best: TrialRecord | None,
            baseline: TrialRecord | None, storage: StorageRate | None = None) -> TuneReport:
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


def classify_bound(t: TrialRecord, usable_cpus: int,
                   storage_bytes_per_s: float | None = None) -> tuple[TrialBound, str]:
    """Name what limits a loader-only trial, with the numbers that say so, in the vocabulary and with the
    thresholds of :mod:`gpufeed.measure.bounds` (docs/design.md §4), which ``verdict.classify`` uses too. In a trial the
    whole window is data wait: the copy is judged on its share of wait + copy, as the verdict judges it on its
    share of the data stall."""
    rate = t.samples_per_s or 0.0
    cores = t.tree_cores_used or 0.0
    possible = _possible_cores(t, usable_cpus)
    machine = t.cpu_percent_mean or 0.0
    read = t.read_bytes_per_s or 0.0
    if t.measure_s and bounds.copy_limited(100 * t.copy_s / t.measure_s,
                                           100 * (t.data_wait_s + t.copy_s) / t.measure_s):
        share = (f"took {t.copy_s:.2f} of {t.measure_s:.2f} s in the windows "
                 f"({100 * t.copy_s / t.measure_s:.0f}%; waiting for batches {t.data_wait_s:.2f} s)")
        if t.decode == "gpu":
            return bounds.GPU_DECODE, f"moving encoded batches and decoding them on the GPU {share}"
        return bounds.COPY, f"host-to-device copies {share}"
    if bounds.storage_limited(read, storage_bytes_per_s):
        return bounds.STORAGE, f"reads {read / 1e6:.0f} MB/s of a {storage_bytes_per_s / 1e6:.0f} MB/s storage rate"
    if bounds.cpu_saturated(cores, possible, machine):
        per_core = bounds.per_core_rate(rate, cores) or 0.0
        return bounds.DECODE_CPU, (
            f"loader processes kept {cores:.2f} cores busy with {t.num_workers} workers on {usable_cpus} usable "
            f"CPUs (machine {machine:.0f}% busy); {per_core:.0f} samples/s per core x {cores:.2f} cores = "
            f"{per_core * cores:.0f} ~ measured {rate:.0f}; more cores or cheaper decode (smaller stored images, "
            f"GPU decode) would help")
    if bounds.idle_while_reading(cores, possible, read):
        return bounds.STORAGE, (f"CPU mostly idle ({cores:.2f} of {possible} cores, machine {machine:.0f}%) while "
                                f"reading {read / 1e6:.1f} MB/s from storage: waiting on reads")
    if read > 0:
        return bounds.UNCLEAR, (f"CPU neither saturated nor idle ({cores:.2f} of {possible} cores, machine "
                                f"{machine:.0f}%) while reading {read / 1e6:.1f} MB/s from storage")
    return bounds.UNCLEAR, (f"CPU not saturated ({cores:.2f} of {possible} cores, machine {machine:.0f}%) and no "
                            f"storage reads (page cache): likely inter-process transfer or the main process")


def _possible_cores(t: TrialRecord, usable_cpus: int) -> int:
    """Cores a trial's loader processes could keep busy: each rank's workers (or its main process), all ranks."""
    return min(usable_cpus, max(1, t.num_workers) * max(1, t.ranks))


# --------------------------------------------------------------------------- outputs


def describe(t: TrialRecord | LoaderConfig, cuda: bool, remote: bool = False) -> str:
    """``w=2 simplejpeg wb pf=2`` (+ persist flag, + pin on CUDA, + ``streams=N`` for a remote set): the knobs that
    apply. Worker knobs need workers; pinning only matters for host-to-GPU copies, so it is not shown without
    CUDA; remote_streams only for a set read in range requests."""
    parts = [f"w={t.num_workers}", t.decode]
    if t.num_workers:
        parts += ["wb" if t.worker_batching else "nowb", f"pf={t.prefetch_factor}"]
        if t.persistent_workers:
            parts.append("persist")
    if t.pin_memory and cuda:
        parts.append("pin")
    if remote:
        parts.append(f"streams={t.remote_streams}")
    if isinstance(t, TrialRecord) and t.pipeline != "gpufeed":
        parts.insert(0, t.pipeline)
    return " ".join(parts)


def render(report: TuneReport) -> str:
    """Ranked table + the one-line conclusion (what the CLI prints)."""
    rows = sorted(report.trials, key=lambda t: (not t.ok, -(t.samples_per_s or 0.0)))
    cuda = _is_cuda(report.device)
    head = (f"{'rank':>4} {'#':>3} {'phase':15} {'config':42} {'samples/s (min-max)':>24} {'start s':>7} "
            f"{'cores':>5} {'RSS MB':>7} {'read MB/s':>10}")
    lines = [head, "-" * len(head)]
    for rank, t in enumerate(rows, 1):
        if t.ok:
            rate = f"{t.samples_per_s:8.1f} ({t.samples_per_s_min:.0f}-{t.samples_per_s_max:.0f})"
        else:
            rate = "error"
        mark = "*" if t.trial == report.best_trial else " "
        lines.append(
            f"{rank:>4}{mark}{t.trial:>3} {t.phase:15} {describe(t, cuda, report.remote)[:42]:42} {rate:>24} "
            f"{_f(t.startup_s, 2):>7} {_f(t.tree_cores_used, 2):>5} "
            f"{_f(None if t.rss_max_bytes is None else t.rss_max_bytes / 1e6, 0):>7} "
            f"{bounds.read_rate_text(t.read_bytes_per_s, t.num_samples, short=True):>10}"
            + (f"  {one_line(t.error)}" if t.error else ""))
    lines.append("")
    for what, attr in (("skipped samples", "num_skipped"), ("repeated samples", "num_repeated")):
        counts = [f"#{t.trial} {getattr(t, attr)}" for t in report.trials if getattr(t, attr)]
        if counts:
            lines.append(f"{what}: " + ", ".join(counts))
    for k, why in report.skipped.items():
        lines.append(f"skipped {k}: {why}")
    lines.append(f"stop: {report.stop_reason}; {report.num_trials} trials in {report.elapsed_s:.1f} s "
                 f"(budget {report.budget_s:g} s)")
    if report.bound:
        lines.append(f"bound: {report.bound}: {report.bound_evidence}")
    if report.storage is not None:
        lines.append(storage_line(report))
    if report.layout is not None:
        lay = report.layout
        lines.append(f"layout: {lay.ranks_per_node} rank(s) per node measured at once, {lay.usable_cores} usable "
                     f"cores, {lay.trainer_cores} left to each training process, {lay.device}"
                     + ("; samples/s is the node's aggregate, [loader] is per rank" if (lay.ranks_per_node or 1) > 1
                        else ""))
    if report.run_dir:
        lines.append(f"run folder: {report.run_dir}" + (f"; config: {report.out}" if report.out else ""))
    lines.append(report.conclusion)
    return "\n".join(lines)


def storage_line(report: TuneReport) -> str:
    """``storage: X MB/s (probe, N readers, cold); the best trial reads Y MB/s, P% of it: at the storage's limit``
    (or below it), the limit being :data:`gpufeed.measure.bounds.STORAGE_FRACTION` of the storage rate."""
    st = report.storage
    assert st is not None
    line = f"storage: {st.bytes_per_s / 1e6:,.1f} MB/s ({st.source}, {st.readers} reader(s), {st.cache})"
    best = next((t for t in report.trials if t.trial == report.best_trial), None)
    if best is None or best.read_bytes_per_s is None or st.bytes_per_s <= 0:
        return line
    read = best.read_bytes_per_s
    if read <= 0 and best.num_samples > 0:
        return line + f"; the best trial read from the {bounds.PAGE_CACHE}"
    limit = "at the storage's limit" if bounds.storage_limited(read, st.bytes_per_s) else "below the storage's limit"
    return line + f"; the best trial reads {read / 1e6:,.1f} MB/s, {100 * read / st.bytes_per_s:.0f}% of it: {limit}"


def _is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def write_outputs(report: TuneReport, cfg: TuneConfig, base: LoaderConfig) -> TuneReport:
    """Write the run folder and the [loader] TOML; returns the report with their paths set."""
    from gpufeed.core.records import atomic_write_bytes, atomic_write_text, make_run_dir, write_json, write_jsonl, write_parquet
    from gpufeed.core.redact import redact
    from gpufeed.core.system import environment_snapshot

    def hidden(text: str) -> str:
        """A file's text with the passwords of its URLs hidden, saying so (a tuned.toml is committed, a run
        folder shared; ``gpufeed train`` is given the URL with its password again)."""
        safe = redact(text)
        return safe if safe == text else (f"# {PASSWORD_REMOVED}\n" + safe)

    run = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("tune")
    run.mkdir(parents=True, exist_ok=True)
    out = None
    if report.best is not None:
        out = Path(cfg.out) if cfg.out else run / "loader.toml"
        header = (f"Written by gpufeed tune on {report.shards}\n{report.conclusion}\n"
                  f"gpufeed train --config {out.name} reads these sections ([layout]: the layout it was tuned for).")
        text = to_toml("loader", report.best, header=header)
        if report.layout is not None:  # gpufeed train warns when it runs a different layout
            text += "\n" + to_toml("layout", report.layout)
        atomic_write_bytes(out, hidden(text).encode())
    report = dataclasses.replace(report, run_dir=str(run), out=None if out is None else str(out))
    write_jsonl(run / "trials.jsonl", report.trials)
    if report.trials:
        write_parquet(run / "trials.parquet", report.trials)
    cfg_text = to_toml("tune", cfg) + "\n" + to_toml("loader", base)
    atomic_write_bytes(run / "config.toml", hidden(cfg_text).encode())
    try:
        env = environment_snapshot(with_torch=True)
    except Exception as exc:  # the snapshot must never sink the run
        env = {"error": f"{type(exc).__name__}: {exc}"}
    write_json(run / "environment.json", env)
    try:
        plot_trials(report, run / "tune.png")
    except Exception as exc:  # a chart failure is noted, the records stand
        report = dataclasses.replace(report, decisions=[*report.decisions, Decision(
            "outputs", "chart-failed", detail={"error": one_line(exc)})])
    summary = dataclasses.replace(report, trials=[])
    write_json(run / "summary.json", summary)
    text = render(report)
    atomic_write_text(run / "report.md",  # a link there is replaced, its target untouched; passwords hidden
        f"# gpufeed tune\n\n{report.conclusion}\n\n![samples/s](tune.png)\n\n```\n{text}\n```\n\n"
        "## Search path\n\n" + "".join(f"- {d.sentence}\n" for d in report.decisions))
    return report


def plot_trials(report: TuneReport, path: str | Path) -> Path:
    """PNG: samples/s against num_workers (climb) and every trial ranked, with min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [t for t in report.trials if t.ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(3.5, 0.35 * len(ok) + 1.5)),
                                   gridspec_kw={"width_ratios": [1, 1.6]})
    climb = sorted((t for t in ok if t.phase == "workers"), key=lambda t: t.num_workers)
    if climb:
        xs = [t.num_workers for t in climb]
        ys = [t.samples_per_s for t in climb]
        err = [[y - t.samples_per_s_min for y, t in zip(ys, climb)], [t.samples_per_s_max - y for y, t in zip(ys, climb)]]
        ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"decode={climb[0].decode}")
    if report.baseline is not None:
        ax1.axhline(report.baseline.samples_per_s, color="grey", ls="--", label="ImageFolder best")
    from matplotlib.ticker import MaxNLocator

    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("samples/s (median, min-max)")
    ax1.set_title("worker climb")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ranked = sorted(ok, key=lambda t: t.samples_per_s)
    labels = [f"#{t.trial} {t.phase}: {describe(t, _is_cuda(report.device), report.remote)}" for t in ranked]
    vals = [t.samples_per_s for t in ranked]
    lo = [v - t.samples_per_s_min for v, t in zip(vals, ranked)]
    hi = [t.samples_per_s_max - v for v, t in zip(vals, ranked)]
    colors = ["tab:orange" if t.trial == report.best_trial else ("tab:grey" if t.pipeline != "gpufeed" else "tab:blue")
              for t in ranked]
    ax2.barh(range(len(ranked)), vals, xerr=[lo, hi], color=colors, capsize=2)
    ax2.set_yticks(range(len(ranked)), labels, fontsize=7)
    ax2.set_xlabel("samples/s")
    ax2.set_title("all trials (orange = chosen)")
    from gpufeed.core.redact import redact

    fig.suptitle(redact(report.conclusion)[:160], fontsize=8)
    fig.tight_layout()
    from gpufeed.core.records import atomic_writer

    with atomic_writer(path) as f:  # never through a link at that name
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return Path(path)


def _has_module(name: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(name) is not None
