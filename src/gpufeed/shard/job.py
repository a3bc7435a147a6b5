"""The job: ``write_shards`` checks SRC and DEST, takes the DEST lock and runs the phases in order (``_run``):
scan -> validate -> plan (or the stored plan, on resume) -> write -> finish, then returns the ``ShardReport``.
Also the process set-up of the run: the worker pool, glibc's mmap threshold, pyarrow preloaded while the
workers validate."""

from __future__ import annotations

import concurrent.futures as cf
import os
import time
from typing import Any, Callable, NamedTuple

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError
from gpufeed.core.safefs import make_state_folder, open_regular
from gpufeed.shard.dest import (LOCK_NAME, STATE_DIR, _atomic_leftover, _cache_bytes, _check_free_space,
                                _clear_cache, _load_plan, _lock, _os_error)
from gpufeed.shard.finish import _finish
from gpufeed.shard.report import ShardReport, _Bar
from gpufeed.shard.scan import _scan
from gpufeed.shard.shardplan import (_TAR_OVERHEAD_PER_SAMPLE, _fingerprint, _make_plan, _options, _save_plan,
                                     _shard_names, _Shuffle, plan_num_shards, split_sizes)
from gpufeed.shard.validate import _ACTIONS, _Results, _pixel_limit, _validate
from gpufeed.shard.write import _check_and_write_shard, _finish_shard, _shard_complete, _write_all


def write_shards(cfg: ShardConfig, progress: bool = True) -> ShardReport:
    """Convert ``cfg.src`` (an ImageFolder) into a deterministic WebDataset shard set at ``cfg.dest``."""
    t0 = time.perf_counter()
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
    from gpufeed.core.system import usable_cpus

    workers = cfg.workers or usable_cpus()
    options = _options(cfg)
    opts = {"check": cfg.check, "max_pixels": cfg.max_pixels, "max_size": cfg.max_size, "quality": cfg.quality}
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
    lock = _lock(dest, cfg)
    try:
        return _run(cfg, src, dest, workers, options, opts, progress, t0, lock)
    except DataError:
        if created and os.listdir(state) == [LOCK_NAME]:  # refused before writing: leave DEST as it was
            os.unlink(os.path.join(state, LOCK_NAME))
            for folder in created:
                try:
                    os.rmdir(folder)  # only while empty
                except OSError:
                    break
        raise
    finally:
        os.close(lock)


def _run(cfg: ShardConfig, src: str, dest: str, workers: int, options: dict[str, Any], opts: dict[str, Any],
         progress: bool, t0: float, lock_fd: int) -> ShardReport:
    state = os.path.join(dest, STATE_DIR)
    pool = _make_pool(workers, lock_fd) if workers > 1 else None
    _map_large_blocks()  # this process only: the forked workers keep glibc's default (their write buffers churn)
    _preload(_early_imports)  # after the pool has forked its workers (numpy may start threads)
    bar = _Bar(progress)
    try:
        class_list = None
        if cfg.classes_file is not None:
            from pathlib import Path

            from gpufeed.index import read_class_list

            class_list = (cfg.classes_file, read_class_list(Path(cfg.classes_file)))
        scan = _scan(src, pool, workers, cfg.classes_like, class_list)
        one_pass = (_ONE_PASS and opts["check"] == "header" and opts["quality"] is None and opts["max_size"] is None)
        if pool is not None and not one_pass:
            for _ in range(workers):  # while this process plans: Pillow, which every check needs
                pool[0].submit(_warm_worker)
        if not scan.classes:
            raise DataError(f"SRC {cfg.src} has no class folders (expected SRC/<class>/<image>, as ImageFolder "
                            f"reads)")
        warn: list[str] = list(scan.notes)  # class folders linked out of SRC
        if scan.hidden_dirs:
            shown = ", ".join(scan.hidden_dirs[:5]) + (f" and {len(scan.hidden_dirs) - 5} more"
                                                       if len(scan.hidden_dirs) > 5 else "")
            warn.append(f"hidden folder(s) {shown} in SRC skipped, not classes: torchvision's ImageFolder would count "
                        f"each as a class and shift the labels after it; pass --classes-like imagefolder for "
                        f"ImageFolder's labels")
        _check_empty(cfg, scan.classes, scan.class_counts, warn, duplicates=scan.duplicates)
        fingerprint = _fingerprint(scan, options)
        scan.mtimes = None  # 8 bytes a sample, not held through validation

        plan = _load_plan(dest, fingerprint, cfg)
        done: dict[str, dict[str, Any]] = {}
        if plan is not None:
            for s in plan.shards:
                info = _shard_complete(dest, s["name"])
                if info is not None:
                    done[s["name"]] = info
            lost = [c for s in plan.shards if s["name"] not in done for c in s["caches"]
                    if not os.path.exists(os.path.join(state, c))]
            if lost:  # transcoded bytes are gone (cleared after use): redo the deterministic validation
                plan = None
        resumed = plan is not None  # the earlier run's plan is used as it is (validation skipped)
        written: dict[str, Any] | None = None  # set by the one pass: every shard written with the validation
        shuffle: _Shuffle | None = None
        partial: tuple[Any, ...] = ()  # a stopped one pass: its validation results, as _validate takes them
        one_pass_s = 0.0

        t_val = time.perf_counter()
        if plan is None:
            # Before anything is written: the input size is the estimate (pass-through bytes are the output;
            # re-encodes to --max-size/--quality are rarely larger). The exact check follows validation.
            kept = sum(i["bytes"] for i in done.values())
            est = int(scan.sizes.sum()) + _TAR_OVERHEAD_PER_SAMPLE * len(scan) - kept
            _check_free_space(dest, est, cfg)
            shuffle = _Shuffle(len(scan), cfg.seed)
            if one_pass and not done:
                opts = dict(opts, pixel_limit=_pixel_limit(opts))  # Pillow's limit, once (as the workers would)
                try:
                    one = _one_pass(cfg, scan, src, dest, opts, options, fingerprint, pool, bar, shuffle, workers)
                except OSError as exc:
                    raise _os_error(exc, cfg, est, writing=True) from None
                if isinstance(one, _Partial):
                    partial = one
                    bar.note("a file is rejected or needs a transcode: validating the rest, then writing")
                elif one is not None:
                    plan, written = one
                    done.update(written)
                    one_pass_s = time.perf_counter() - t_val
        if plan is None:
            order = shuffle.order()
            shuffle = None  # ``order`` holds it; the plan may build another (when files are rejected)
            _preload(_finish_imports)
            try:
                results = _validate(scan, src, state, opts, pool, bar, order, workers, *partial)
            except OSError as exc:
                cached = _cache_bytes(state)
                _clear_cache(state)  # useless without a plan: give the space back
                raise _os_error(exc, cfg, est, cache_deleted=cached) from None
            plan = _make_plan(cfg, scan, results, fingerprint, options, order)
            del results, order
            _check_empty(cfg, plan.classes, plan.meta["class_counts"], warn, after_validation=True)
            try:
                _save_plan(state, plan)
            except OSError as exc:
                raise _os_error(exc, cfg, None, cache_kept=_cache_bytes(state)) from None
        elif written is not None:
            _check_empty(cfg, plan.classes, plan.meta["class_counts"], warn, after_validation=True)
        else:
            bar.note("resume: the plan matches; validation skipped")
            _check_empty(cfg, plan.classes, plan.meta["class_counts"], warn, after_validation=True)
        validate_s = time.perf_counter() - t_val - one_pass_s
        ignored = scan.ignored
        del scan  # the plan holds what the rest needs

        # ---- write
        t_w = time.perf_counter()
        names = [s["name"] for s in plan.shards]
        todo = plan.shards  # the one pass wrote them all
        if written is None:
            if not resumed or not done:
                for name in names:
                    info = _shard_complete(dest, name)
                    if info is not None:
                        done[name] = info
            todo = [s for s in plan.shards if s["name"] not in done]
            # Each transcode cache file is deleted once every shard that reads it is written, so DEST peaks near
            # the output size: the cache turns into shards as they are written.
            users: dict[str, int] = {}
            for s in todo:
                for c in s["caches"]:
                    users[c] = users.get(c, 0) + 1
            for name in os.listdir(state):
                if name.startswith("enc-") and name.endswith(".bin") and name not in users:
                    os.unlink(os.path.join(state, name))
            cached = sum(os.path.getsize(os.path.join(state, c)) for c in users)
            in_flight = sum(sorted((s["cache_bytes"] for s in todo), reverse=True)[:workers])
            need = max(0, sum(s["est_bytes"] for s in todo) - cached) + in_flight
            _check_free_space(dest, need, cfg, cached)
            for leftover in os.listdir(dest):
                if leftover.startswith(".") and leftover.endswith(".tar.tmp") or _atomic_leftover(leftover):
                    os.unlink(os.path.join(dest, leftover))
            tasks = [(s["name"], s["count"], (lambda s=s: plan.part(plan.indices(s)))) for s in todo]
            caches_of = {s["name"]: s["caches"] for s in todo}

            def shard_done(name: str) -> None:
                for c in caches_of[name]:
                    users[c] -= 1
                    if users[c] == 0:
                        try:
                            os.unlink(os.path.join(state, c))
                        except FileNotFoundError:
                            pass

            try:
                written = _write_all(dest, src, tasks, pool, bar, shard_done, workers=workers)
            except OSError as exc:
                raise _os_error(exc, cfg, need, cache_kept=_cache_bytes(state), writing=True) from None
            done.update(written)
        write_s = time.perf_counter() - t_w + one_pass_s
    finally:
        bar.close()
        if pool is not None:
            pool[0].shutdown(wait=True, cancel_futures=True)

    import numpy as np

    per_action = np.bincount(plan.cols["action"], minlength=len(_ACTIONS)).tolist()
    transforms = {a: k for a, k in sorted(zip(_ACTIONS, per_action)) if k}
    num_exif_oriented = int((plan.cols["orientation"] != 1).sum())
    plan.release_write_columns()

    # ---- index, timm info, manifest (last)
    infos = [done[n] for n in names]
    try:
        manifest = _finish(dest, cfg, plan, infos, options, warn, indexed=set(written))
    except OSError as exc:
        raise _os_error(exc, cfg, None, shards_done=len(infos), writing=True) from None
    _clear_cache(state)  # the transcode cache is only needed until every shard is complete
    input_bytes = int(plan.cols["bytes"].sum())
    elapsed = time.perf_counter() - t0
    # Rates count what this run wrote (a resume that keeps every shard converts nothing).
    n_written = sum(i["num_samples"] for i in written.values())
    in_written = sum(int(plan.cols["bytes"][plan.indices(s)].sum()) for s in todo if s["name"] in written)
    rejected = plan.rejected
    if rejected:
        warn.append(f"{len(rejected)} file(s) rejected")
    return ShardReport(
        src=src, dest=dest, prefix=cfg.prefix, num_classes=len(plan.classes),
        num_samples=len(plan), num_rejected=len(rejected), num_ignored=len(ignored),
        num_shards=len(names), num_shards_written=len(written), num_shards_skipped=len(names) - len(written),
        total_bytes=manifest.total_bytes, input_bytes=input_bytes,
        written_samples=n_written, written_bytes=sum(i["bytes"] for i in written.values()),
        written_input_bytes=in_written, elapsed_s=elapsed, validate_s=validate_s,
        write_s=write_s, samples_per_s=n_written / elapsed if elapsed > 0 else 0.0,
        mb_per_s=in_written / 1e6 / elapsed if elapsed > 0 else 0.0, workers=workers, strict=cfg.strict,
        resumed=resumed, transforms=transforms,
        num_exif_oriented=num_exif_oriented,
        classes=list(plan.classes), empty_classes=list(plan.meta["empty_classes"]), warnings=warn,
        rejected=rejected, ignored=ignored, shards=names, url_pattern=manifest.url_pattern,
        manifest=os.path.join(dest, "manifest.json"),
    )


_ONE_PASS = True
"""Whether ``--check header`` without transcoding options tries the one pass (``_one_pass``); tests turn it off
to compare with the two passes."""


_ONE_PASS_DEPTH = 2
"""Shards submitted per worker in the one pass: one being written, the next one queued (its files' names and
sizes sent), so a worker never waits for this process between shards."""

_STOP_NAME = "one-pass.stop"
"""In DEST's state folder while the one pass stops: the workers' shards still running stop too."""


class _Partial(NamedTuple):
    """The validation results of a one pass that stopped: the candidates it ``checked`` (a mask), all accepted
    as pass-throughs, in ``results``."""

    results: _Results
    checked: Any


def _one_pass(cfg: ShardConfig, scan: Any, src: str, dest: str, opts: dict[str, Any], options: dict[str, Any],
              fingerprint: str, pool: Any, bar: _Bar, shuffle: _Shuffle,
              workers: int) -> tuple[Any, dict[str, dict[str, Any]]] | _Partial | None:
    """Validate and write in one pass, each source read once: plan as if every candidate is accepted and passes
    through unchanged (then the plan follows from the scan alone), and let each worker check and write whole
    shards of it (``_check_and_write_shard``). When every file checks out as such, the plan built from the
    validation results is the one assumed: it is saved, then the shards are renamed into place with their
    sidecars, so the bytes are those of the two passes. -> (plan, each shard's sidecar).

    A file that is rejected or needs a transcode (or is unreadable) stops the pass: every shard being written
    stops (the stop file), their temporary files are deleted, and -> ``_Partial``, the files checked so far,
    which the validation pass then skips (the caller validates the rest, then writes). -> None when the shards
    are too few to keep every worker busy with whole shards (no pass was made).

    Nothing is renamed before the plan is saved: a run killed during the pass leaves only ``.<shard>.tmp``
    files, and the re-run starts afresh."""
    import numpy as np

    n = len(scan)
    n_shards = plan_num_shards(n, int(scan.sizes.sum()) + _TAR_OVERHEAD_PER_SAMPLE * n, cfg)
    if n_shards > n or (pool is not None and n_shards < 2 * workers):
        return None
    class_start = np.concatenate(([0], np.cumsum(np.bincount(scan.labels, minlength=len(scan.classes)))[:-1]))
    shards = []
    pos = 0
    for name, k in zip(_shard_names(cfg.prefix, n_shards), split_sizes(n, n_shards)):
        shards.append((name, pos, k))
        pos += k
    stop = os.path.join(dest, STATE_DIR, _STOP_NAME)
    if os.path.exists(stop):
        os.unlink(stop)

    def part(start: int, count: int) -> dict[str, Any]:
        idx = shuffle.take(start, count)
        labels = scan.labels[idx]
        # the names as one blob + offsets (_Strings): the worker decodes them, not this serial loop
        return {"paths": scan.paths.take(idx).portable(), "n": (idx - class_start[labels]).tolist(),
                "label": labels.tolist(), "bytes": scan.sizes[idx].tolist(), "classes": scan.classes, "stop": stop}

    results = _Results(n)
    checked = np.zeros(n, dtype=bool)
    outcome: dict[str, tuple[int, str, bytes | None]] = {}  # name -> (size, sha256, DALI index), as they complete
    saved = False
    complete = True

    def stored(name: str, start: int, count: int, got: Any) -> None:
        nonlocal complete
        idx = shuffle.take(start, got.checked)
        results.put(idx, got.columns, 0)
        checked[idx] = True
        bar.update(got.checked, got.nbytes)
        if got.complete:
            outcome[name] = (got.size, got.sha256, got.idx)
        elif complete:
            complete = False
            _touch(stop)

    bar.start("validate+write", n)
    try:
        if pool is None:
            for name, start, count in shards:
                stored(name, start, count, _check_and_write_shard(dest, src, name, part(start, count), opts))
                if not complete:
                    break
        else:
            ex = pool[0]
            pending = reversed(shards)  # the last shards' files are ordered first (_Shuffle)
            running: dict[Any, tuple[str, int, int]] = {}
            try:
                while True:
                    for sh in (pending if complete else ()):
                        running[ex.submit(_check_and_write_shard, dest, src, sh[0], part(sh[1], sh[2]), opts)] = sh
                        if len(running) >= _ONE_PASS_DEPTH * workers:  # a worker's next shard waits, ready
                            break
                    if not running:
                        break
                    finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                    for fut in finished:
                        stored(*running.pop(fut), fut.result())
                    # While the workers write, this process waits: import what index.parquet needs. Not before the
                    # first shard is back: pyarrow's import holds the GIL ~0.1 s, and the pool's threads here need
                    # it to send the first shards' file lists (every worker has its next shard queued by now).
                    _preload(_finish_imports)
            finally:
                if running:  # leaving on an error (a worker's, or an interrupt): the running shards stop too
                    _touch(stop)
                for fut in running:
                    fut.cancel()
                cf.wait(running)  # a shard being checked and written deletes its temporary file when it stops
        if not complete:
            return _Partial(results, checked)
        plan = _make_plan(cfg, scan, results, fingerprint, options, shuffle.order())
        if [(sh["name"], sh["start"], sh["count"]) for sh in plan.shards] != shards:
            raise AssertionError("the one pass planned the shards the validation results give")  # pragma: no cover
        _save_plan(os.path.join(dest, STATE_DIR), plan)
        saved = True
    finally:
        if os.path.exists(stop):
            os.unlink(stop)
        if not saved:
            _remove_temporaries(dest, outcome)
    return plan, {name: _finish_shard(dest, name, outcome[name][0], count, outcome[name][1], outcome[name][2])
                  for name, _start, count in shards}


def _remove_temporaries(dest: str, names: Any) -> None:
    for name in names:
        try:
            os.unlink(os.path.join(dest, f".{name}.tmp"))
        except FileNotFoundError:
            pass


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


def _map_large_blocks() -> None:
    """Keep glibc's mmap threshold at its initial 128 KiB (``mallopt(M_MMAP_THRESHOLD)``; nothing on other C
    libraries): every block above it (the plan's numpy columns, the index's blocks) is then mapped on its own and
    given back to the OS when freed. glibc otherwise raises the threshold up to 32 MiB the first time such a block
    is freed, later columns come from the heap, and the RSS keeps the high-water mark of every phase. (A write
    task's buffer is then mapped and unmapped each time too: ~5% more CPU when this process writes, --workers 1.)"""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def _early_imports() -> None:
    """What this process needs right after the scan: numpy (joins the scan's columns), Pillow (the one pass's
    pixel limit) and the package version (the plan's fingerprint reads it from the installed metadata)."""
    import numpy  # noqa: F401
    from PIL import Image  # noqa: F401

    import gpufeed

    gpufeed.__version__  # noqa: B018 - looked up once, then cached


def _finish_imports() -> None:
    """What ``index.parquet`` needs (~0.15 s)."""
    import pyarrow.compute  # noqa: F401
    import pyarrow.parquet  # noqa: F401


_preloading: set[Any] = set()


def _preload(load: Callable[[], None]) -> None:
    """Run ``load`` (imports) in a thread while the workers work, instead of on this process's serial path; a
    second call with the same function does nothing. Started once the pool's workers are forked (the pool forks
    only while this process has one thread), and late enough that the thread's share of the GIL does not slow
    this process's own serial steps (the shuffle, the first shards' file lists). An error is left to the code
    that needs the module: it imports it again and reports it there."""
    import threading

    if load in _preloading:
        return
    _preloading.add(load)

    def run() -> None:
        try:
            load()
        except Exception:  # noqa: BLE001 - see above
            pass

    threading.Thread(target=run, name="gpufeed-preload", daemon=True).start()


def _make_pool(workers: int, lock_fd: int) -> tuple[Any, Any]:
    """The job's process pool (:func:`gpufeed.core.system.process_pool`: fork where safe, else spawn; workers die with
    this process and a forked one closes its copy of the DEST lock), started at once so that its start-up
    overlaps the scan."""
    from gpufeed.core.system import process_pool

    ex = process_pool(workers, close_fds=(lock_fd,))
    ex.submit(_noop)  # start the workers now (spawn: their start-up overlaps the scan)
    return ex, None


def _noop() -> None:
    return None


def _warm_worker() -> None:
    """Import what validating needs (Pillow) before the first batch arrives."""
    from PIL import Image  # noqa: F401


def _touch(path: str) -> None:
    """Create the (empty) stop file ``path`` in DEST's state folder, never through a link (safefs)."""
    os.close(open_regular(path, os.O_WRONLY, what="stop file"))
