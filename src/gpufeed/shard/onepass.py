"""The one pass (``--check header``, nothing to transcode): validate and write in one pass, each source read once
(the package docstring, "One pass"; docs/design.md §1). ``one_pass`` plans as if every candidate is accepted and
passes through unchanged, lets each worker check and write whole shards of it (``write.check_and_write_shard``),
and either keeps them (the plan from the validation results is the one assumed) or stops and hands what it
checked to the validation pass (``validate.Partial``)."""

from __future__ import annotations

import concurrent.futures as cf
import os
from typing import Any, NamedTuple

from gpufeed.core.dest import remove_temps
from gpufeed.core.safefs import open_regular
from gpufeed.shard.context import JobContext, finish_imports, preload
from gpufeed.shard.dest import STATE_DIR
from gpufeed.shard.scan import Scan
from gpufeed.shard.shardplan import (TAR_OVERHEAD_PER_SAMPLE, Plan, Shuffle, make_plan, plan_num_shards, save_plan,
                                     shard_names, split_sizes)
from gpufeed.shard.validate import Partial, Results
from gpufeed.shard.write import OnePassPart, check_and_write_shard, finish_shard

DEPTH = 2
"""Shards submitted per worker in the one pass: one being written, the next one queued (its files' names and
sizes sent), so a worker never waits for this process between shards."""

STOP_NAME = "one-pass.stop"
"""In DEST's state folder while the one pass stops: the workers' shards still running stop too."""


class Written(NamedTuple):
    """A one pass that wrote every shard: the plan (saved) and each shard's sidecar record."""

    plan: Plan
    done: dict[str, dict[str, Any]]


class _Layout(NamedTuple):
    name: str
    start: int
    count: int


def one_pass(job: JobContext, scan: Scan, fingerprint: str, shuffle: Shuffle) -> Written | Partial | None:
    """Validate and write in one pass. -> ``Written`` when every file checks out as a pass-through (the plan built
    from the validation results is the one assumed: it is saved, then the shards are renamed into place with
    their sidecars, so the bytes are those of the two passes); ``Partial``, the files checked so far, when a file
    is rejected, needs a transcode or is unreadable (every shard being written stops, its temporary file
    deleted; the caller validates the rest, then writes); None when the shards are too few to keep every worker
    busy with whole shards (no pass was made).

    Nothing is renamed before the plan is saved: a run killed during the pass leaves only ``.<shard>.tmp``
    files, and the re-run starts afresh."""
    shards = _layout(job, scan)
    if shards is None:
        return None
    run = _Pass(job, scan, shuffle)
    saved = False
    try:
        job.bar.start("validate+write", len(scan))
        run.run_here(shards) if job.pool is None else run.run_pool(shards)
        if not run.complete:
            return Partial(run.results, run.checked)
        plan = make_plan(job.cfg, scan, run.results, fingerprint, job.options, shuffle.order())
        if [(sh.name, sh.start, sh.count) for sh in plan.shards] != shards:
            raise AssertionError("the one pass planned the shards the validation results give")  # pragma: no cover
        save_plan(os.path.join(job.dest, STATE_DIR), plan)
        saved = True
    finally:
        if os.path.exists(run.stop):
            os.unlink(run.stop)
        if not saved:
            remove_temps(job.dest, run.outcome)
    return Written(plan, {sh.name: finish_shard(job.dest, sh.name, run.outcome[sh.name][0], sh.count,
                                                run.outcome[sh.name][1], run.outcome[sh.name][2]) for sh in shards})


def _layout(job: JobContext, scan: Scan) -> list[_Layout] | None:
    """The shards as the plan would make them if every candidate passes through unchanged (the plan then follows
    from the scan alone), or None when they are too few for whole shards on every worker."""
    n = len(scan)
    n_shards = plan_num_shards(n, int(scan.sizes.sum()) + TAR_OVERHEAD_PER_SAMPLE * n, job.cfg)
    if n_shards > n or (job.pool is not None and n_shards < 2 * job.workers):
        return None
    shards = []
    pos = 0
    for name, k in zip(shard_names(job.cfg.prefix, n_shards), split_sizes(n, n_shards)):
        shards.append(_Layout(name, pos, k))
        pos += k
    return shards


class _Pass:
    """The pass's state: the validation results gathered so far (``results``, the ``checked`` mask), each written
    shard's (size, sha256, DALI index) in ``outcome``, and whether every shard so far was ``complete``."""

    def __init__(self, job: JobContext, scan: Scan, shuffle: Shuffle) -> None:
        import numpy as np

        self.job, self.scan, self.shuffle = job, scan, shuffle
        n = len(scan)
        self.class_start = np.concatenate(([0], np.cumsum(np.bincount(scan.labels,
                                                                      minlength=len(scan.classes)))[:-1]))
        self.results = Results(n)
        self.checked = np.zeros(n, dtype=bool)
        self.outcome: dict[str, tuple[int, str, bytes | None]] = {}  # name -> (size, sha256, DALI index)
        self.complete = True
        self.stop = os.path.join(job.dest, STATE_DIR, STOP_NAME)
        if os.path.exists(self.stop):
            os.unlink(self.stop)

    def part(self, sh: _Layout) -> OnePassPart:
        idx = self.shuffle.take(sh.start, sh.count)
        labels = self.scan.labels[idx]
        # the names as one blob + offsets (Strings): the worker decodes them, not this serial loop
        return OnePassPart(self.scan.paths.take(idx).portable(), (idx - self.class_start[labels]).tolist(),
                           labels.tolist(), self.scan.sizes[idx].tolist(), self.scan.classes, self.stop)

    def stored(self, sh: _Layout, got: Any) -> None:
        idx = self.shuffle.take(sh.start, got.checked)
        self.results.put(idx, got.columns, 0)
        self.checked[idx] = True
        self.job.bar.update(got.checked, got.nbytes)
        if got.complete:
            self.outcome[sh.name] = (got.size, got.sha256, got.idx)
        elif self.complete:
            self.complete = False
            _touch(self.stop)

    def run_here(self, shards: list[_Layout]) -> None:
        job = self.job
        for sh in shards:
            self.stored(sh, check_and_write_shard(job.dest, job.src, sh.name, self.part(sh), job.opts))
            if not self.complete:
                break

    def run_pool(self, shards: list[_Layout]) -> None:
        job = self.job
        pending = reversed(shards)  # the last shards' files are ordered first (Shuffle)
        running: dict[Any, _Layout] = {}
        try:
            while True:
                for sh in (pending if self.complete else ()):
                    running[job.pool.submit(check_and_write_shard, job.dest, job.src, sh.name, self.part(sh),
                                            job.opts)] = sh
                    if len(running) >= DEPTH * job.workers:  # a worker's next shard waits, ready
                        break
                if not running:
                    break
                finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
                for fut in finished:
                    self.stored(running.pop(fut), fut.result())
                # While the workers write, this process waits: import what index.parquet needs. Not before the
                # first shard is back: pyarrow's import holds the GIL ~0.1 s, and the pool's threads here need
                # it to send the first shards' file lists (every worker has its next shard queued by now).
                preload(finish_imports)
        finally:
            if running:  # leaving on an error (a worker's, or an interrupt): the running shards stop too
                _touch(self.stop)
            for fut in running:
                fut.cancel()
            cf.wait(running)  # a shard being checked and written deletes its temporary file when it stops


def _touch(path: str) -> None:
    """Create the (empty) stop file ``path`` in DEST's state folder, never through a link (safefs)."""
    os.close(open_regular(path, os.O_WRONLY, what="stop file"))
