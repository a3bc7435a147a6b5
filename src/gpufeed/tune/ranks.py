"""tune's node layout (docs/design.md §4): the ranks of one node measured at once, as ``gpufeed train
--nproc-per-node N`` runs them (:func:`measure_ranks`, one spawned process per rank, rates summed over shared
windows by :func:`combine_ranks`), each rank's world (:func:`rank_world`), and the node a staged set was made for
(:func:`staged_world`). :func:`measure_node` picks one rank or many."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

from gpufeed.config import LoaderConfig
from gpufeed.core.world import World
from gpufeed.measure.stream import error_sentence
from gpufeed.tune.records import TrialRecord, trial_record
from gpufeed.tune.trials import measure_loader


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
                  manifest_file: str | Path | None = None, model: str | None = None,
                  model_threads: int | None = None) -> TrialRecord:
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
              manifest_file=None if manifest_file is None else str(manifest_file), model=model,
              model_threads=model_threads)
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
