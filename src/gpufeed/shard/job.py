"""The job: ``write_shards`` checks SRC and DEST, takes the DEST lock and runs the phases in order (``_run``, a
table of contents): scan -> plan (the stored plan on resume; else the one pass, or validate then plan) -> write ->
finish, then returns the ``ShardReport`` (docs/design.md §1, ``shard/``)."""

from __future__ import annotations

import os
import time
from concurrent.futures import Executor
from typing import Any, Callable, NamedTuple

from gpufeed.config import ShardConfig
from gpufeed.core.dest import LOCK_NAME, release_lock
from gpufeed.core.errors import DataError
from gpufeed.core.safefs import make_state_folder
from gpufeed.shard.context import (JobContext, early_imports, finish_imports, make_pool, map_large_blocks, preload,
                                   warm_worker)
from gpufeed.shard.dest import (STATE_DIR, atomic_leftover, cache_bytes, check_free_space, clear_cache, load_plan,
                                lock_dest, os_error)
from gpufeed.shard.finish import finish_set
from gpufeed.shard.onepass import Written, one_pass
from gpufeed.shard.report import Bar, ShardReport
from gpufeed.shard.scan import Scan, scan_src
from gpufeed.shard.shardplan import (PLAN_NAME, TAR_OVERHEAD_PER_SAMPLE, Plan, Shuffle, make_plan, plan_problem,
                                     plan_fingerprint, plan_options, read_plan, save_plan)
from gpufeed.shard.validate import ACTIONS, CheckOptions, Partial, pixel_limit, validate_candidates
from gpufeed.shard.split import (BatchStore, claim_split, clear_split_state, finish_lock, leftovers, node_split,
                                 plan_difference, split_record)
from gpufeed.shard.write import WriteTask, shard_complete, write_all

PoolFactory = Callable[[int, int], Executor]
"""``(workers, lock descriptor) -> the job's process pool`` (``context.make_pool``)."""


def write_shards(cfg: ShardConfig, progress: bool = True, *, try_one_pass: bool = True,
                 pool_factory: PoolFactory = make_pool) -> ShardReport:
    """Convert ``cfg.src`` (an ImageFolder) into a deterministic WebDataset shard set at ``cfg.dest``.

    ``try_one_pass``: whether ``--check header`` without transcoding options first tries the one pass (the bytes
    are the same either way; tests turn it off to compare). ``pool_factory``: how the worker pool is made (with
    ``cfg.workers`` > 1)."""
    t0 = time.perf_counter()
    if cfg.finish:
        return finish_dest(cfg, progress)
    split = node_split(cfg)
    src, dest = _check_folders(cfg)
    from gpufeed.core.system import usable_cpus

    workers = cfg.workers or usable_cpus()
    state = os.path.join(dest, STATE_DIR)
    created = []  # the folders this run creates, innermost first: DEST/.gpufeed, DEST, missing parents of DEST
    d = state
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(dest, exist_ok=True)
        make_state_folder(state)  # a link there is refused: its target would receive the run's files
    except OSError as exc:
        raise DataError(f"DEST {cfg.dest} cannot be created ({exc.strerror or exc})") from None
    lock_name = LOCK_NAME if split is None else split.lock_name
    lock = lock_dest(dest, cfg, lock_name)
    try:
        if cfg.engine == "ray":
            from gpufeed.shard.engine_ray import ray_pool

            workers, pool = ray_pool(cfg)
        else:
            pool = pool_factory(workers, lock) if workers > 1 else None
        job = JobContext(cfg, src, dest, workers, plan_options(cfg), CheckOptions.of(cfg), pool, Bar(progress), [],
                         split)
        return _run(job, t0, try_one_pass and split is None)
    except DataError:
        if created and os.listdir(state) == [lock_name]:  # refused before writing: leave DEST as it was
            os.unlink(os.path.join(state, lock_name))
            for folder in created:
                try:
                    os.rmdir(folder)  # only while empty
                except OSError:
                    break
        raise
    finally:
        release_lock(lock)


def _check_folders(cfg: ShardConfig) -> tuple[str, str]:
    """SRC and DEST, absolute, once checked: SRC a folder, DEST not inside it and not a file."""
    if not cfg.src or not cfg.dest:
        raise DataError("shard needs SRC (an image folder) and DEST (the output folder)")
    src = os.path.abspath(cfg.src)
    dest = os.path.abspath(cfg.dest)
    if not os.path.isdir(src):
        raise DataError(f"SRC {cfg.src} is not a folder" if os.path.exists(src) else f"SRC {cfg.src} does not exist")
    if os.path.commonpath([src, dest]) == src:
        raise DataError(f"DEST {cfg.dest} is inside SRC {cfg.src}; choose a folder outside the input")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise DataError(f"DEST {cfg.dest} exists and is not a folder")
    return src, dest


class _Planned(NamedTuple):
    """The plan phase's outcome."""

    plan: Plan
    done: dict[str, dict[str, Any]]
    """Complete shards' sidecar records (kept from an earlier run, or written by the one pass)."""
    written: dict[str, dict[str, Any]] | None
    """Set by the one pass: every shard was written with the validation."""
    resumed: bool
    """The earlier run's plan is used as it is (validation skipped)."""
    validate_s: float
    one_pass_s: float
    ignored: list[Any]


def _run(job: JobContext, t0: float, try_one_pass: bool) -> ShardReport:
    """The phases in order; the pool and the bar are closed whatever happens."""
    map_large_blocks()  # this process only: the forked workers keep glibc's default (their write buffers churn)
    preload(early_imports)  # after the pool has forked its workers (numpy may start threads)
    try:
        try_one_pass = try_one_pass and job.opts.header_only
        scan, fingerprint = _scan_phase(job, warm=not try_one_pass)
        planned = _plan_phase(job, scan, fingerprint, try_one_pass)
        del scan  # the plan holds what the rest needs
        t_w = time.perf_counter()
        written = planned.written
        if written is None:
            written = _write_phase(job, planned.plan, planned.done, planned.resumed)
        write_s = time.perf_counter() - t_w + planned.one_pass_s
    finally:
        job.bar.close()
        if job.pool is not None:
            job.pool.shutdown(wait=True, cancel_futures=True)
    if job.split is None:
        return _finish_phase(job, planned, written, t0, write_s)
    missing = _others_complete(job, planned)
    if missing:
        return _node_report(job, planned, written, t0, write_s, missing)
    return _finish_locked(job, planned, written, t0, write_s)


def _finish_locked(job: JobContext, planned: _Planned, written: dict[str, dict[str, Any]], t0: float,
                   write_s: float) -> ShardReport:
    """A static split's finish, under the finish lock (``split.finish_lock``): a killed finisher's temporary
    files go first."""
    lock = finish_lock(job.state)
    try:
        for leftover in leftovers(job.dest, [], finishing=True):
            os.unlink(os.path.join(job.dest, leftover))
        return _finish_phase(job, planned, written, t0, write_s)
    finally:
        release_lock(lock)


def _scan_phase(job: JobContext, warm: bool) -> tuple[Scan, str]:
    """Walk SRC, refuse what cannot be a set (no classes; empty ones unless allowed), note what ImageFolder would
    read otherwise -> the scan and its fingerprint. ``warm``: import Pillow in the workers meanwhile."""
    cfg = job.cfg
    class_list = None
    if cfg.classes_file is not None:
        from pathlib import Path

        from gpufeed.index import read_class_list

        class_list = (cfg.classes_file, read_class_list(Path(cfg.classes_file)))
    scan = scan_src(job.src, job.pool, job.workers, cfg.classes_like, class_list)
    if job.pool is not None and warm:
        for _ in range(job.workers):  # while this process plans: Pillow, which every check needs
            job.pool.submit(warm_worker)
    if not scan.classes:
        raise DataError(f"SRC {cfg.src} has no class folders (expected SRC/<class>/<image>, as ImageFolder "
                        f"reads)")
    job.warnings += scan.notes  # class folders linked out of SRC
    if scan.hidden_dirs:
        shown = ", ".join(scan.hidden_dirs[:5]) + (f" and {len(scan.hidden_dirs) - 5} more"
                                                   if len(scan.hidden_dirs) > 5 else "")
        job.warnings.append(f"hidden folder(s) {shown} in SRC skipped, not classes: torchvision's ImageFolder would "
                            f"count each as a class and shift the labels after it; pass --classes-like imagefolder "
                            f"for ImageFolder's labels")
    _check_empty(cfg, scan.classes, scan.class_counts, job.warnings, duplicates=scan.duplicates)
    fingerprint = plan_fingerprint(scan, job.options)
    scan.mtimes = None  # 8 bytes a sample, not held through validation
    return scan, fingerprint


def _resume(job: JobContext, fingerprint: str, scan: Scan) -> tuple[Plan | None, dict[str, dict[str, Any]]]:
    """The stored plan when it matches (else None; a different one is refused unless ``overwrite``) and the
    complete shards it keeps. A plan whose transcode cache is gone (cleared after use) is not used: the
    deterministic validation is redone. A static split's node keeps only its own shards (and never clears DEST)."""
    if job.split is None:
        plan = load_plan(job.dest, fingerprint, job.cfg)
    else:
        plan = stored_plan(job, fingerprint)
    done: dict[str, dict[str, Any]] = {}
    if plan is not None and (why := plan_problem(plan, scan, job.cfg.seed)) is not None:
        if job.split is None and job.cfg.overwrite:  # as for a plan of other inputs: cleared, planned again
            os.unlink(os.path.join(job.state, PLAN_NAME))
            return load_plan(job.dest, fingerprint, job.cfg), {}
        again = ("empty DEST and start every node again" if job.split is not None
                 else "re-run with --overwrite to plan it again")
        raise DataError(f"{os.path.join(job.state, PLAN_NAME)} does not follow from SRC ({why}): it was changed "
                        f"after gpufeed wrote it; {again}")
    if plan is not None:
        for s in _mine(job, plan):
            info = shard_complete(job.dest, s.name, plan_keys(plan, s))
            if info is not None:
                done[s.name] = info
        lost = [c for s in _mine(job, plan) if s.name not in done for c in s.caches
                if not os.path.exists(os.path.join(job.state, c))]
        if lost:
            plan = None
    return plan, done


def _mine(job: JobContext, plan: Plan) -> list[Any]:
    """The shards this run writes: all, or a static split node's (``split.NodeSplit.owns``)."""
    return [s for i, s in enumerate(plan.shards) if job.split is None or job.split.owns(i)]


def stored_plan(job: JobContext, fingerprint: str) -> Plan | None:
    """A static split's stored plan (None: no node has saved it yet); one of other inputs or options, or one that
    does not check out, is refused naming the difference (a split never clears DEST)."""
    path = os.path.join(job.state, PLAN_NAME)
    if not os.path.exists(path):
        return None
    plan = read_plan(job.state)
    if plan is None:
        raise DataError(f"{path} is not a plan this gpufeed can read (another version, or damaged); empty DEST "
                        f"{job.cfg.dest} and start every node again")
    if plan.meta["fingerprint"] != fingerprint:
        raise DataError(f"DEST {job.cfg.dest} holds a plan made from other inputs or options "
                        f"({plan_difference(plan.meta, job.options)}); start this node like the others, or empty "
                        f"DEST and start every node again")
    return plan


def _plan_phase(job: JobContext, scan: Scan, fingerprint: str, try_one_pass: bool) -> _Planned:
    """The plan: the stored one (resume), or the one pass's, or validation then ``make_plan``; saved. A static
    split's node first records the split or checks it against the first node's (``split.claim_split``)."""
    if job.split is not None:
        claim_split(job.state, split_record(job.split, job.src, fingerprint, job.options, len(scan), scan.classes),
                    job.cfg.dest)
    plan, done = _resume(job, fingerprint, scan)
    resumed = plan is not None
    written: dict[str, dict[str, Any]] | None = None
    partial: Partial | None = None
    one_pass_s = 0.0
    t_val = time.perf_counter()
    if plan is None:
        # Before anything is written: the input size is the estimate (pass-through bytes are the output;
        # re-encodes to --max-size/--quality are rarely larger). The exact check follows validation.
        kept = sum(i["bytes"] for i in done.values())
        est = int(scan.sizes.sum()) + TAR_OVERHEAD_PER_SAMPLE * len(scan) - kept
        check_free_space(job.dest, est, job.cfg)
        shuffle = Shuffle(len(scan), job.cfg.seed)
        if try_one_pass and not done:
            job.opts = job.opts._replace(pixel_limit=pixel_limit(job.opts))  # Pillow's limit, once (as the workers)
            try:
                one = one_pass(job, scan, fingerprint, shuffle)
            except OSError as exc:
                raise os_error(exc, job.cfg, est, writing=True) from None
            if isinstance(one, Partial):
                partial = one
                job.bar.note("a file is rejected or needs a transcode: validating the rest, then writing")
            elif isinstance(one, Written):
                plan, written = one
                done.update(written)
                one_pass_s = time.perf_counter() - t_val
        if plan is None:
            plan = _validate_and_plan(job, scan, fingerprint, shuffle.order(), partial, est)
    else:
        job.bar.note("resume: the plan matches; validation skipped")
    if written is not None or resumed:
        _check_empty(job.cfg, plan.classes, plan.meta["class_counts"], job.warnings, after_validation=True)
    validate_s = time.perf_counter() - t_val - one_pass_s
    return _Planned(plan, done, written, resumed, validate_s, one_pass_s, scan.ignored)


def _validate_and_plan(job: JobContext, scan: Scan, fingerprint: str, order: Any, partial: Partial | None,
                       est: int) -> Plan:
    """Validate the candidates (those a stopped one pass did not check) in the seeded ``order``, then plan and
    save the plan. ``est``: the bytes the job expects to write (for a DEST-full message)."""
    preload(finish_imports)
    try:
        shared = {} if job.split is None else {"store": BatchStore(job.state, job.split, job.opts)}  # a split's batches
        results = validate_candidates(scan, job.src, job.state, job.opts, job.pool, job.bar, order, job.workers,
                                      partial, **shared)
    except OSError as exc:
        cached = cache_bytes(job.state)
        clear_cache(job.state)  # useless without a plan: give the space back
        raise os_error(exc, job.cfg, est, cache_deleted=cached) from None
    plan = make_plan(job.cfg, scan, results, fingerprint, job.options, order)
    del results, order
    _check_empty(job.cfg, plan.classes, plan.meta["class_counts"], job.warnings, after_validation=True)
    try:
        if job.split is None or stored_plan(job, fingerprint) is None:  # a split's plan: saved by the first node
            save_plan(job.state, plan)
    except OSError as exc:
        raise os_error(exc, job.cfg, None, cache_kept=cache_bytes(job.state)) from None
    return plan



def plan_keys(plan: Plan, s: Any) -> Callable[[], list[str]]:
    """The keys the plan gives shard ``s``, in order (computed when asked: only for a shard found complete)."""
    return lambda: [plan.key(int(i)) for i in plan.indices(s)]


def _write_phase(job: JobContext, plan: Plan, done: dict[str, dict[str, Any]],
                 resumed: bool) -> dict[str, dict[str, Any]]:
    """Write the shards not yet complete (``done`` gains them) -> the sidecar records of those written. Each
    transcode cache file is deleted once every shard that reads it is written, so DEST peaks near the output
    size: the cache turns into shards as they are written."""
    if not resumed or not done:
        for s in _mine(job, plan):
            info = shard_complete(job.dest, s.name, plan_keys(plan, s))
            if info is not None:
                done[s.name] = info
    todo = [s for s in _mine(job, plan) if s.name not in done]
    caches = _CacheUsers(job.state, todo, shared=job.split is not None)
    in_flight = sum(sorted((s.cache_bytes for s in todo), reverse=True)[:job.workers])
    need = max(0, sum(s.est_bytes for s in todo) - caches.cached) + in_flight
    check_free_space(job.dest, need, job.cfg, caches.cached)
    if job.split is None:
        for leftover in os.listdir(job.dest):
            if leftover.startswith(".") and leftover.endswith(".tar.tmp") or atomic_leftover(leftover):
                os.unlink(os.path.join(job.dest, leftover))
    else:  # only this node's: the others' may be being written
        for leftover in leftovers(job.dest, [s.name for s in todo], finishing=False):
            os.unlink(os.path.join(job.dest, leftover))
    tasks = [WriteTask(s.name, s.count, (lambda s=s: plan.part(plan.indices(s)))) for s in todo]
    try:
        written = write_all(job.dest, job.src, tasks, job.pool, job.bar, caches.shard_done, workers=job.workers,
                            whole=job.cfg.engine == "ray")
    except OSError as exc:
        raise os_error(exc, job.cfg, need, cache_kept=cache_bytes(job.state), writing=True) from None
    done.update(written)
    return written


class _CacheUsers:
    """The transcode cache files (``enc-*.bin``) the shards still to write read, each deleted once the last of
    them is written; the others are deleted at once. ``shared``: a static split's, whose other nodes read the
    cache too: nothing is deleted before the set is finished."""

    def __init__(self, state: str, todo: list[Any], shared: bool = False) -> None:
        self.state = state
        self.shared = shared
        self.caches_of = {s.name: s.caches for s in todo}
        self.users: dict[str, int] = {}
        for s in todo:
            for c in s.caches:
                self.users[c] = self.users.get(c, 0) + 1
        for name in os.listdir(state):
            if name.startswith("enc-") and name.endswith(".bin") and name not in self.users and not shared:
                os.unlink(os.path.join(state, name))
        self.cached = sum(os.path.getsize(os.path.join(state, c)) for c in self.users)
        """Bytes of the cache files still needed."""

    def shard_done(self, name: str) -> None:
        if self.shared:
            return
        for c in self.caches_of[name]:
            self.users[c] -= 1
            if self.users[c] == 0:
                try:
                    os.unlink(os.path.join(self.state, c))
                except FileNotFoundError:
                    pass


def _finish_phase(job: JobContext, planned: _Planned, written: dict[str, dict[str, Any]], t0: float,
                  write_s: float) -> ShardReport:
    """The index, the sidecar indexes and the manifest (last), then the report."""
    import numpy as np

    cfg, plan, dest = job.cfg, planned.plan, job.dest
    per_action = np.bincount(plan.cols["action"], minlength=len(ACTIONS)).tolist()
    transforms = {a: k for a, k in sorted(zip(ACTIONS, per_action)) if k}
    num_exif_oriented = int((plan.cols["orientation"] != 1).sum())
    plan.release_write_columns()
    names = [s.name for s in plan.shards]
    infos = [planned.done[n] for n in names]
    try:
        manifest = finish_set(dest, cfg, plan, infos, job.options, job.warnings, indexed=set(written))
    except OSError as exc:
        raise os_error(exc, cfg, None, shards_done=len(infos), writing=True) from None
    clear_cache(job.state)  # the transcode cache is only needed until every shard is complete
    clear_split_state(job.state)
    input_bytes = int(plan.cols["bytes"].sum())
    elapsed = time.perf_counter() - t0
    # Rates count what this run wrote (a resume that keeps every shard converts nothing).
    n_written = sum(i["num_samples"] for i in written.values())
    in_written = sum(int(plan.cols["bytes"][plan.indices(s)].sum()) for s in plan.shards if s.name in written)
    rejected = plan.rejected
    if rejected:
        job.warnings.append(f"{len(rejected)} file(s) rejected")
    return ShardReport(
        src=job.src, dest=dest, prefix=cfg.prefix, num_classes=len(plan.classes),
        num_samples=len(plan), num_rejected=len(rejected), num_ignored=len(planned.ignored),
        num_shards=len(names), num_shards_written=len(written), num_shards_skipped=len(names) - len(written),
        total_bytes=manifest.total_bytes, input_bytes=input_bytes,
        written_samples=n_written, written_bytes=sum(i["bytes"] for i in written.values()),
        written_input_bytes=in_written, elapsed_s=elapsed, validate_s=planned.validate_s,
        write_s=write_s, samples_per_s=n_written / elapsed if elapsed > 0 else 0.0,
        mb_per_s=in_written / 1e6 / elapsed if elapsed > 0 else 0.0, workers=job.workers, strict=cfg.strict,
        resumed=planned.resumed, transforms=transforms,
        num_exif_oriented=num_exif_oriented,
        classes=list(plan.classes), empty_classes=list(plan.meta["empty_classes"]), warnings=job.warnings,
        rejected=rejected, ignored=planned.ignored, shards=names, url_pattern=manifest.url_pattern,
        manifest=os.path.join(dest, "manifest.json"),
        **_node_fields(job),
    )


def _others_complete(job: JobContext, planned: _Planned) -> list[str]:
    """A static split node's look at the other nodes' shards: those complete join ``planned.done`` -> the names of
    those not complete yet."""
    missing = []
    for s in planned.plan.shards:
        if s.name not in planned.done:
            info = shard_complete(job.dest, s.name, plan_keys(planned.plan, s))
            if info is None:
                missing.append(s.name)
            else:
                planned.done[s.name] = info
    return missing


def _node_fields(job: JobContext) -> dict[str, int]:
    return {} if job.split is None else {"num_nodes": job.split.num_nodes, "node_rank": job.split.node_rank}


def _node_report(job: JobContext, planned: _Planned, written: dict[str, dict[str, Any]], t0: float,
                 write_s: float, missing: list[str]) -> ShardReport:
    """What a static split's node did while other nodes' shards are not complete (no index, no manifest yet)."""
    plan = planned.plan
    elapsed = time.perf_counter() - t0
    n_written = sum(i["num_samples"] for i in written.values())
    in_written = sum(int(plan.cols["bytes"][plan.indices(s)].sum()) for s in plan.shards if s.name in written)
    names = [s.name for s in plan.shards]
    return ShardReport(
        src=job.src, dest=job.dest, prefix=job.cfg.prefix, num_classes=len(plan.classes), num_samples=len(plan),
        num_rejected=len(plan.rejected), num_ignored=len(planned.ignored), num_shards=len(names),
        num_shards_written=len(written), num_shards_skipped=len(planned.done) - len(written),
        total_bytes=sum(i["bytes"] for i in planned.done.values()), input_bytes=int(plan.cols["bytes"].sum()),
        written_samples=n_written, written_bytes=sum(i["bytes"] for i in written.values()),
        written_input_bytes=in_written, elapsed_s=elapsed, validate_s=planned.validate_s, write_s=write_s,
        samples_per_s=n_written / elapsed if elapsed > 0 else 0.0,
        mb_per_s=in_written / 1e6 / elapsed if elapsed > 0 else 0.0, workers=job.workers, strict=job.cfg.strict,
        resumed=planned.resumed, transforms={}, num_exif_oriented=0, classes=list(plan.classes),
        empty_classes=list(plan.meta["empty_classes"]), warnings=job.warnings, rejected=plan.rejected,
        ignored=planned.ignored, shards=names, url_pattern="", manifest="", num_shards_missing=len(missing),
        **_node_fields(job))


def finish_dest(cfg: ShardConfig, progress: bool = True) -> ShardReport:
    """``gpufeed shard DEST --finish``: once every shard of DEST's stored plan is complete (each checked against
    its sidecar: size and sha256), write the index, the sidecar indexes and the manifest, as the local engine
    and the last node of a static split do (the same bytes). SRC is not read; a shard not complete is a RunError
    naming it and the node that owns it."""
    from dataclasses import replace

    from gpufeed.core.errors import RunError
    from gpufeed.shard.split import read_split

    t0 = time.perf_counter()
    if not cfg.dest:
        raise DataError("shard --finish needs DEST (the folder the shards were written to)")
    dest = os.path.abspath(cfg.dest)
    state = os.path.join(dest, STATE_DIR)
    if not os.path.isfile(os.path.join(state, PLAN_NAME)):
        raise DataError(f"DEST {cfg.dest} holds no shard plan ({os.path.join(cfg.dest, STATE_DIR, PLAN_NAME)} is "
                        f"missing): run gpufeed shard SRC DEST first")
    lock = finish_lock(state)
    try:
        plan = read_plan(state)
        if plan is None:
            raise DataError(f"{os.path.join(cfg.dest, STATE_DIR, PLAN_NAME)} is not a plan this gpufeed can read "
                            f"(another version, or damaged); run gpufeed shard SRC DEST again")
        record = read_split(state) or {}
        nodes = record.get("num_nodes") if type(record.get("num_nodes")) is int else 1
        done = {}
        missing = []
        for i, s in enumerate(plan.shards):
            info = shard_complete(dest, s.name, plan_keys(plan, s))
            if info is None:
                missing.append(f"{s.name} (node {i % nodes})" if nodes > 1 else s.name)
            else:
                done[s.name] = info
        if missing:
            shown = ", ".join(missing[:8]) + (f" and {len(missing) - 8} more" if len(missing) > 8 else "")
            raise RunError(f"DEST {cfg.dest} cannot be finished: {len(missing)} of {len(plan.shards)} shards are not "
                           f"complete ({shown}); run those nodes again with the same command")
        options = plan.meta["options"]
        src = record.get("src") if isinstance(record.get("src"), str) else ""
        cfg = replace(cfg, src=src, prefix=options.get("prefix", cfg.prefix), finish=False)
        job = JobContext(cfg, src, dest, 1, options, CheckOptions.of(cfg), None, Bar(progress), [])
        planned = _Planned(plan, done, {}, True, 0.0, 0.0, [])
        for leftover in leftovers(dest, [], finishing=True):
            os.unlink(os.path.join(dest, leftover))
        return _finish_phase(job, planned, {}, t0, 0.0)
    finally:
        release_lock(lock)


def _check_empty(cfg: ShardConfig, classes: list[str], counts: list[int], warn: list[str],
                 after_validation: bool = False, duplicates: list[int] | None = None) -> None:
    """Refuse empty classes (or keep them with a warning). ``duplicates``: per class, the files rejected as the
    same file as one stored under another path (an empty class of only those is a symlink to another class)."""
    empty = [c for c, n in zip(classes, counts) if n == 0]
    if not empty:
        return
    what = "has no valid image after validation" if after_validation else "holds no image file"
    shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
    dup = [f"{c} ({duplicates[classes.index(c)]})" for c in empty if duplicates and duplicates[classes.index(c)]]
    why = (f" of its own (only files already stored under another path, symlinks or hard links: "
           f"{', '.join(dup[:5])})" if dup else "")
    if not cfg.allow_empty_classes:
        raise DataError(
            f"class folder(s) {shown} {what}{why}; remove them or pass --allow-empty-classes to keep their labels"
        )
    for c in empty:
        msg = f"class {c!r} (label {classes.index(c)}) is empty; its label is kept (no renumbering)"
        if msg not in warn:
            warn.append(msg)

