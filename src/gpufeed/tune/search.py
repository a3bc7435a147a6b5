"""tune's search (docs/design.md §4): one explicit :class:`Search` state and the phase functions that move it, each
returning its :class:`Decision` records: :func:`climb_workers`, :func:`climb_streams` (a remote set), the one-knob
refinements (:func:`refine_decode`, :func:`refine_batching`, :func:`refine_prefetch`, :func:`refine_pinning`),
:func:`settle_unmeasured` and :func:`measure_baseline_imagefolder`."""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable

from gpufeed.config import LayoutConfig, LoaderConfig, TuneConfig
from gpufeed.core.errors import one_line
from gpufeed.core.world import World
from gpufeed.measure import bounds, contention
from gpufeed.measure.stream import error_sentence, megabytes
from gpufeed.tune.decisions import Decision, classify_bound, compare_on, describe, possible_cores
from gpufeed.tune.records import KNOBS, TrialRecord, trial_record


WORKER_LADDER = (0, 1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128)
STREAMS_LADDER = (1, 2, 4, 8, 16)
"""The remote_streams values :func:`climb_streams` may try, in order (a remote set's range requests per worker)."""


MeasureFn = Callable[..., TrialRecord]
"""What measures a trial: :func:`gpufeed.tune.ranks.measure_node`'s signature (a test passes a fake)."""
CheckFn = Callable[..., int]
"""``(shards, base, world[, manifest_file=...]) -> samples per epoch`` (:func:`gpufeed.tune.phases.check_shard_set`)."""

def worker_ladder(ceiling: int) -> list[int]:
    """The worker counts :func:`climb_workers` may try, in order: :data:`WORKER_LADDER` up to ``ceiling``, and the
    ceiling itself."""
    ladder = [w for w in WORKER_LADDER if w <= ceiling]
    if ceiling not in ladder:
        ladder.append(ceiling)
    return ladder


BUDGET_SATURATED = 0.9
"""The worker climb stops once the loader processes use this fraction of the CPU budget's cores."""


class Search:
    """The state of one tune run: the trial log, the budgets and deadlines, the current point of the search
    (``point`` and the trial that measured it, ``point_rec``), the knobs left unmeasured (``skipped``) and the
    decisions taken. Phase functions read and move it; :func:`tune` runs them in order."""

    def __init__(self, cfg: TuneConfig, shards: str, base: LoaderConfig, world: World, measure: MeasureFn, *,
                 window_s: float, ram_budget: int, usable: int, ceiling: int,
                 progress: Callable[[str], None] | None, clock: Callable[[], float] = time.monotonic,
                 installed: Callable[[str], bool] | None = None) -> None:
        self.cfg, self.shards, self.base, self.world, self.measure = cfg, shards, base, world, measure
        self.window_s = window_s
        self.ram_budget = ram_budget
        self.usable = usable
        self.cores_budget = cfg.cpu_budget * usable
        self.ceiling = ceiling
        self.progress = progress or (lambda s: None)
        self.clock = clock
        """The search's clock (``time.monotonic``; a test passes a fake one): its budget, deadlines and elapsed time."""
        self.installed = installed or has_module
        """Whether an optional module (simplejpeg) is installed here."""
        self.t0 = clock()
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
        return self.clock() - self.t0

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
        if self.clock() + need > deadline:
            self.stop_reason = self.stop_reason or f"budget: {self.cfg.budget_s:g} s spent or too little left for a trial"
            return None
        fn = measure or self.measure
        extra = {"manifest_file": self.cfg.manifest} if self.cfg.manifest and source is None else {}
        if self.cfg.with_model and source is None:  # the training step beside the loader (not the baseline's)
            extra["model"] = self.cfg.with_model
            if self.cfg.model_threads:
                extra["model_threads"] = self.cfg.model_threads
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
        contended = bool(rec.ok and trial_other_cores(rec, self.usable) is not None
                         and contention.contended(trial_other_cores(rec, self.usable), machine_cores(rec, self.usable)))
        rec = dataclasses.replace(rec, trial=len(self.trials), phase=phase, over_cpu_budget=over, contended=contended)
        if self.remote and self.mean_sample_bytes and rec.ok and rec.samples_per_s and source is None:
            rec = dataclasses.replace(rec, read_bytes_per_s=rec.samples_per_s * self.mean_sample_bytes)
        self.trials.append(rec)
        self.cache[key] = rec
        result = f"{rec.samples_per_s:8.1f} samples/s" if rec.ok else f"ERROR {one_line(rec.error or 'no rate')}"
        self.progress(f"trial {rec.trial:2d} {phase:16s} {describe(rec, self.world.is_cuda, self.remote):60s} {result}")
        return rec

    def target_reached(self) -> bool:
        """Whether the search may stop: the best trial reached target_rate x target_margin. Never with
        ``with_model``: a trial then holds the model's step, so its rate is the end-to-end rate, which no target
        bounds from below (whether one more worker overlaps more of the step is only known by measuring it, and
        train's verdict judges that same rate); a trial past a compute ceiling taken as the target
        (target / CEILING_FRACTION, the verdict's unreliable line) is noted: that ceiling was measured low."""
        if self.cfg.target_rate is None:
            return False
        best = self.best()
        if best is None:
            return False
        target = self.cfg.target_rate
        if not self.cfg.with_model:
            return best.samples_per_s >= target * self.cfg.target_margin
        if best.samples_per_s > target / bounds.CEILING_FRACTION and not any(
                d.reason == "target-below-trial" for d in self.decisions):
            self.decisions.append(Decision("search", "target-below-trial", detail={
                "trial": best.trial, "rate": best.samples_per_s, "target": target}))
        return False

    def best(self, phase_filter: Callable[[TrialRecord], bool] | None = None) -> TrialRecord | None:
        ok = [t for t in self.trials if t.ok and t.pipeline == "gpufeed" and not t.over_cpu_budget
              and (phase_filter is None or phase_filter(t))]
        return max(ok, key=lambda t: t.samples_per_s) if ok else None


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
    possible = possible_cores(ref, s.usable)
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


def refine(s: Search, knob: str, values: list[Any], also: dict[str, Any] | None = None) -> list[Decision]:
    """Try each of ``values`` for ``knob`` at the search point (with the changes in ``also``); move the point when a
    candidate wins by min_gain (on the quantity :func:`compare_on` names). A candidate the budget has no room for
    is noted in ``skipped``."""
    out: list[Decision] = []
    for v in values:
        ref = s.point_rec
        if ref is None or s.target_reached():
            break
        cand = dataclasses.replace(s.point, **{knob: v, **(also or {})})
        rec = s.run(cand, knob, deadline=s.search_deadline)
        if rec is None:
            s.skipped.setdefault(knob, "budget: no time left for this trial")
            break
        previous = getattr(s.point, knob)
        pair = (ref.trial, rec.trial)
        metric, a, b = compare_on(ref, rec, s.usable, knob)
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
    """Phase 2: the other decode paths that exist here (simplejpeg installed, roi with simplejpeg and a region decoder
    installed: gpufeed's compiled one or nvImageCodec, gpu on CUDA)."""
    decodes = []
    for d in ("simplejpeg", "roi", "pil-draft", "gpu"):
        if d == s.point.decode:
            continue
        if d == "simplejpeg" and not s.installed("simplejpeg"):
            s.skipped["decode=simplejpeg"] = "simplejpeg is not installed (pip install simplejpeg)"
        elif d == "roi" and not (s.installed("simplejpeg") and (s.installed(ROI_MODULE)
                                                                 or s.installed("nvidia.nvimgcodec"))):
            s.skipped["decode=roi"] = ("no region decoder here (gpufeed's was not compiled at install and nvImageCodec "
                                       "is not installed: pip install 'gpufeed[roi]'), or simplejpeg is missing")
        elif d == "gpu" and not s.world.is_cuda:
            s.skipped["decode=gpu"] = "no CUDA device"
        else:
            decodes.append(d)
    if s.point.decode != "pil":
        s.skipped["decode=pil"] = ("not measured: same libjpeg decoder as pil-draft, which only adds reduced-size "
                                   "DCT scaling when the crop allows it, so full decode cannot be faster")
    return refine(s, "decode", decodes)


def refine_threads(s: Search) -> list[Decision]:
    """Phase 2b: decode threads x worker processes (CPU decode): 2 decode threads in half the worker processes
    (the same cores busy, half the processes and no sample pickled between them), or 2 threads in the one process
    that decodes (0 or 1 workers)."""
    if s.point.decode == "gpu":
        s.skipped["decode_threads"] = "decode = gpu: the device decodes, threads only read"
        return []
    w = s.point.num_workers
    return refine(s, "decode_threads", [2], also={"num_workers": w // 2} if w > 1 else None)


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
        f"({megabytes(best.rss_max_bytes)} of {megabytes(s.ram_budget)} budget)")
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


ROI_MODULE = "gpufeed.loader._jpegroi"
"""gpufeed's compiled region decoder (decode = "roi"), present where gpufeed was installed with a C compiler."""


def has_module(name: str) -> bool:
    """Whether ``name`` can be imported here (without importing it)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except ImportError:  # a dotted name whose parent package is missing
        return False


def machine_cores(rec: TrialRecord, usable: int) -> int:
    """The machine's cores as the trial's telemetry saw them (one busy % per core), else the usable CPUs."""
    return len(rec.cpu_percent_per_core) or usable


def trial_other_cores(rec: TrialRecord, usable: int) -> float | None:
    """Cores other processes held during a trial (:mod:`gpufeed.measure.contention`, the detector train uses): the
    machine's busy cores minus the trial's process tree; None when not measured."""
    if rec.cpu_percent_mean is None or rec.tree_cores_used is None:
        return None
    return contention.other_cores(rec.cpu_percent_mean / 100.0 * machine_cores(rec, usable), rec.tree_cores_used)
