"""``gpufeed train --measure --fix``: the closed loop (docs/design.md §4).

A starved verdict names a bound and the numbers behind it. :data:`TABLE` maps each bound to the changes gpufeed can
make itself, each a pure function of the verdict's numbers and the run's [loader] (:func:`candidates`); the rest
of the verdict's fixes need a person (more cores, re-sharding, another GPU) and are printed, never tried
(:func:`needs_a_person`). :func:`run_fixes` applies one candidate at a time, re-measures, keeps it only when the
end-to-end rate rose beyond the spread of the timing windows (:func:`helps`), and repeats within a wall-clock
budget. :func:`fixed_toml` is what ``fixed.toml`` in the run folder holds.

Staging needs ``gpufeed stage``, a job that ``train`` may not import (docs/design.md §1): the caller that may
import jobs (the CLI) hands it down as a ``stager(src, dest) -> dest`` callable; without one (a library call, the
ranks under torchrun) staging is printed, not tried. No torch here: the loop is tested with injected measurements.
"""

from __future__ import annotations

import dataclasses
import json
import math
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any, Callable, Iterable

from gpufeed.config import LoaderConfig, to_toml
from gpufeed.config.limits import MAX_PREFETCH_FACTOR, MAX_REMOTE_STREAMS
from gpufeed.measure import bounds
from gpufeed.measure.verdict import Verdict
from gpufeed.train.records import FixRecord, ModeRecord

FIXED_NAME = "fixed.toml"
"""The run folder's file with the settings ``--fix`` kept (docs/design.md §5)."""
MIN_FIX_GAIN = 0.05
"""A fix is kept only when the end-to-end rate rises by at least this fraction ..."""
# ... and by more than the spread of the windows on either side (:func:`helps`).
PERSON = ("more cores", "cores of its own", "cannot close the gap", "gpufeed shard", "numa", "affinity",
          "another gpu", "nvme_folder")
"""Words that mark a verdict fix as one that needs a person (hardware, re-sharding, binding, a place to stage);
the verdict's other lines are changes gpufeed tries itself, or the numbers behind them."""

Stager = Callable[[str, str], str]
"""``stager(src, dest)`` copies the shard set ``src`` to the local folder ``dest`` and returns the set to read."""


# --------------------------------------------------------------------------- what a fix is derived from


@dataclass(frozen=True, kw_only=True)
class FixInputs:
    """What the candidates are derived from: the verdict and the run's settings."""

    verdict: Verdict
    loader: LoaderConfig
    shards: str
    remote: bool = False
    """The set is read over the network (http, s3, gs)."""
    usable_cores: float | None = None
    """CPU cores usable on one node."""
    ranks_per_node: int = 1
    is_cuda: bool = False
    stage_to: str | None = None
    """Where the set can be staged (:func:`stage_target`); None = staging cannot be tried (``stage_why``)."""
    stage_why: str = ""
    has_simplejpeg: bool = True


@dataclass(frozen=True)
class Candidate:
    """One change gpufeed can apply: [loader] keys, or staging the set to ``stage_to``."""

    fix: str
    loader: dict[str, Any] = field(default_factory=dict)
    stage_to: str | None = None

    @property
    def key(self) -> tuple[Any, ...]:
        return tuple(sorted(self.loader.items())), self.stage_to


def _max_workers(x: FixInputs) -> int:
    """The most workers per rank worth trying: the node's usable cores split over its ranks (at least 1)."""
    if x.usable_cores is None or not math.isfinite(x.usable_cores):
        return max(1, x.loader.num_workers + 1)
    return max(1, int(x.usable_cores // max(1, x.ranks_per_node)))


def _workers(x: FixInputs, n: int, why: str) -> Candidate | None:
    n = min(n, _max_workers(x))
    now = x.loader.num_workers
    return Candidate(f"num_workers {now} -> {n} ({why})", {"num_workers": n}) if n > now else None


def _storage(x: FixInputs) -> list[Candidate | None]:
    """Storage-bound: more parallel reads when the storage ladder showed they read more, then staging."""
    nums, lc = x.verdict.numbers, x.loader
    out: list[Candidate | None] = []
    need = nums.get("streams_needed")
    if need:
        if x.remote:
            per_worker = min(MAX_REMOTE_STREAMS, math.ceil(need / (x.ranks_per_node * max(1, lc.num_workers))))
            if per_worker > lc.remote_streams:
                out.append(Candidate(f"remote_streams {lc.remote_streams} -> {per_worker} (the storage read more "
                                     f"with {need} parallel streams)", {"remote_streams": per_worker}))
        else:
            out.append(_workers(x, math.ceil(need / x.ranks_per_node), f"the storage read more with {need} readers"))
    if x.stage_to is not None:
        out.append(Candidate(f"stage the set to {x.stage_to}", stage_to=x.stage_to))
    return out


def _decode_cpu(x: FixInputs) -> list[Candidate | None]:
    """Decode/CPU-bound: workers of its own when there are none, a cheaper decode path, more workers, deeper
    prefetch; each only when the node's cores allow it."""
    nums, lc = x.verdict.numbers, x.loader
    need = nums.get("cores_needed_per_node")
    per_rank = math.ceil(need / x.ranks_per_node) if need else 1
    out: list[Candidate | None] = []
    if lc.num_workers == 0:
        out.append(_workers(x, max(1, per_rank), "load beside compute, not in series with it"))
    if x.is_cuda and lc.decode != "gpu":
        out.append(Candidate(f"decode {lc.decode} -> gpu (nvjpeg)", {"decode": "gpu"}))
    elif lc.decode in ("pil", "pil-draft") and x.has_simplejpeg:
        out.append(Candidate(f"decode {lc.decode} -> simplejpeg (libjpeg-turbo)", {"decode": "simplejpeg"}))
    elif lc.decode == "pil":
        out.append(Candidate("decode pil -> pil-draft (reduced-size decode)", {"decode": "pil-draft"}))
    if lc.num_workers > 0:
        if (nums.get("more_cores_per_node") or 0) >= 0.5:
            out.append(_workers(x, max(lc.num_workers + 1, per_rank), "more cores to decode with"))
        if lc.prefetch_factor < MAX_PREFETCH_FACTOR:
            pf = min(MAX_PREFETCH_FACTOR, 2 * lc.prefetch_factor)
            out.append(Candidate(f"prefetch_factor {lc.prefetch_factor} -> {pf} (absorb late batches)",
                                 {"prefetch_factor": pf}))
        out.append(_workers(x, lc.num_workers + 1, "absorb late batches"))
    return out


def _copy(x: FixInputs) -> list[Candidate | None]:
    """Copy-bound: pinned host batches copy asynchronously (CUDA only)."""
    if x.is_cuda and not x.loader.pin_memory:
        return [Candidate("pin_memory false -> true (asynchronous copies)", {"pin_memory": True})]
    return []


def _gpu_decode(x: FixInputs) -> list[Candidate | None]:
    """GPU-decode-bound: decode on the CPU workers instead."""
    if x.has_simplejpeg:
        return [Candidate("decode gpu -> simplejpeg (on the CPU workers)", {"decode": "simplejpeg"})]
    return []


TABLE: dict[str, Callable[[FixInputs], list[Candidate | None]]] = {
    bounds.STORAGE: _storage,
    bounds.DECODE_CPU: _decode_cpu,
    bounds.COPY: _copy,
    bounds.GPU_DECODE: _gpu_decode,
}
"""Bound -> the changes gpufeed can apply, in the order they are tried. Rank imbalance has none: its fixes (shard
count, NUMA binding) need a person."""


def candidates(x: FixInputs) -> list[Candidate]:
    """The changes to try for a starved verdict, in order (none for any other verdict)."""
    if x.verdict.status != "starved" or x.verdict.bound not in TABLE:
        return []
    seen: set[tuple[Any, ...]] = set()
    out = []
    for c in TABLE[x.verdict.bound](x):
        if c is not None and c.key not in seen:
            seen.add(c.key)
            out.append(c)
    return out


def needs_a_person(verdict: Verdict | None) -> list[str]:
    """The verdict's fixes that need a person (:data:`PERSON`): printed, never tried."""
    if verdict is None or verdict.status != "starved":
        return []
    return [f for f in verdict.fixes if any(k in f.lower() for k in PERSON)]


def stage_target(shards: str, *, set_bytes: int | None, shm_free_bytes: int | None, stage_dir: str | None,
                 can_stage: bool) -> tuple[str | None, str]:
    """(where ``--fix`` would stage ``shards``, or None; why not, when None)."""
    src = shards.rstrip("/")
    name = PurePath(src).parent.name if src.endswith(".json") else PurePath(src).name
    name = "".join(ch if ch.isalnum() or ch in "-_." else "_" for ch in (name or "shards"))
    if not can_stage:
        return None, ("staging is not tried here (only a single-process gpufeed train stages): run gpufeed stage, "
                      "then train on the copy")
    if stage_dir:
        return str(PurePath(stage_dir) / name), ""
    if src.startswith("/dev/shm/"):
        return None, "the set is already on a RAM disk"
    if set_bytes is None or shm_free_bytes is None:
        return None, "/dev/shm's free space or the set's size is unknown: give --fix-stage-dir"
    if set_bytes > shm_free_bytes:
        return None, (f"the set ({set_bytes / 1e9:.1f} GB) does not fit in /dev/shm ({shm_free_bytes / 1e9:.1f} GB "
                      f"free): give --fix-stage-dir on local NVMe")
    return f"/dev/shm/gpufeed-fix-{name}", ""


# --------------------------------------------------------------------------- judging a fix


def rate_of(real: ModeRecord) -> tuple[float, float]:
    """(end-to-end samples/s, its noise): the median of the windows when there are any, and the half-width of the
    90% interval of their mean when the mode was judged (:mod:`gpufeed.measure.settle`), else half their range."""
    st = real.samples_per_s_stat
    if st is None:
        return real.samples_per_s, 0.0
    if real.rate_spread is not None:
        return st.median, real.rate_spread * st.median / 2
    return st.median, (st.max - st.min) / 2


def helps(before: tuple[float, float], after: tuple[float, float], min_gain: float = MIN_FIX_GAIN
          ) -> tuple[bool, str]:
    """Whether a fix helped beyond the noise: (rate, noise) before and after (:func:`rate_of`). The gain must
    reach ``min_gain`` of the rate before and exceed the two noises combined (root of the sum of squares)."""
    (b, b_noise), (a, a_noise) = before, after
    gain = a - b
    bar = max(min_gain * b, math.hypot(b_noise, a_noise))
    pct = 100 * gain / b if b > 0 else math.inf
    text = (f"{b:.1f} -> {a:.1f} samples/s ({pct:+.0f}%), against a bar of {bar:.1f} samples/s "
            f"(the larger of {100 * min_gain:.0f}% and the noise of both measurements, +-{b_noise:.1f} / "
            f"+-{a_noise:.1f})")
    return gain > bar, ("kept: " if gain > bar else "dropped: ") + text


# --------------------------------------------------------------------------- the loop


@dataclass(frozen=True)
class Measured:
    """One measurement of a setting: the modes and the verdict (rank 0; None on the other ranks)."""

    modes: dict[str, ModeRecord] | None
    verdict: Verdict | None

    @property
    def rate(self) -> tuple[float, float]:
        assert self.modes is not None
        return rate_of(self.modes["real"])


@dataclass(frozen=True)
class FixOutcome:
    """What the loop ends with: the kept settings, their measurement, and the trail."""

    loader: LoaderConfig
    shards: str
    measured: Measured
    tried: list[FixRecord]
    not_tried: list[str]


def run_fixes(start: Measured, loader: LoaderConfig, shards: str, *,
              propose: Callable[[Verdict, LoaderConfig, str], tuple[list[Candidate], list[str]]],
              measure: Callable[[LoaderConfig, str], Measured], budget_s: float, first_cost_s: float,
              stage: Stager | None = None, agree: Callable[[Any], Any] = lambda x: x, is_main: bool = True,
              clock: Callable[[], float] = time.monotonic) -> FixOutcome:
    """Try ``propose``'s candidates one at a time while the kept settings are starved: apply, ``measure``, keep
    only when :func:`helps`. A fix starts only when the budget still holds the longest measurement so far
    (``first_cost_s`` before any). ``agree(x)`` gives every rank rank 0's ``x`` (the decisions); only rank 0
    (``is_main``) proposes and judges. ``stage(src, dest)`` stages the set for a staging candidate."""
    t0, cost = clock(), first_cost_s
    current, tried, not_tried, done = start, [], [], set()
    while True:
        pick: Candidate | None = None
        if is_main and current.verdict is not None and current.verdict.status == "starved":
            cands, person = propose(current.verdict, loader, shards)
            not_tried = _merge(not_tried, person)
            todo = [c for c in cands if c.key not in done]
            if todo and clock() - t0 + cost > budget_s:
                not_tried = _merge(not_tried, [f"{c.fix}: not tried, the --fix budget ({budget_s:.0f} s) would be "
                                               f"exceeded (one try takes ~{cost:.0f} s)" for c in todo])
            elif todo:
                pick = todo[0]
        pick = agree(pick)
        if pick is None:
            break
        done.add(pick.key)
        t = clock()
        new_loader = dataclasses.replace(loader, **pick.loader)
        new_shards, error, after = shards, None, None
        try:
            if pick.stage_to is not None:
                if stage is None:
                    raise RuntimeError("no stager")
                new_shards = stage(shards, pick.stage_to) if is_main else pick.stage_to
                new_shards = agree(new_shards)
            after = measure(new_loader, new_shards)
        except Exception as exc:  # noqa: BLE001 - a fix that fails is a record with error set; the loop goes on
            error = f"{type(exc).__name__}: {exc}"
        seconds = clock() - t
        cost = max(cost, seconds)
        kept = False
        if is_main:
            if error is None and after is not None and after.modes is not None:
                kept, why = helps(current.rate, after.rate)
                rate = after.rate[0]
            else:
                why, rate = f"dropped: the re-measure failed ({error})", None
            tried.append(FixRecord(fix=pick.fix, changes={**pick.loader, **({"shards": new_shards}
                                                                               if pick.stage_to else {})},
                                   before_samples_per_s=current.rate[0], after_samples_per_s=rate, kept=kept,
                                   why=why, verdict=after.verdict if after is not None else None, error=error,
                                   seconds=seconds))
        if agree(kept):
            current, loader, shards = after, new_loader, new_shards
    if is_main:
        not_tried = _merge(not_tried, needs_a_person(current.verdict))
    return FixOutcome(loader=loader, shards=shards, measured=current, tried=tried, not_tried=not_tried)


def _merge(into: list[str], more: Iterable[str]) -> list[str]:
    return into + [m for m in more if m not in into]


def measured_fixes(verdict: Verdict | None, tried: list[FixRecord]) -> Verdict | None:
    """The verdict with each fix line that names a change ``--fix`` measured on the settings kept (after the last
    fix kept) and dropped replaced by that measurement: a verdict never prescribes what its own run measured as no
    better."""
    if verdict is None or not verdict.fixes:
        return verdict
    last_kept = max((i for i, r in enumerate(tried) if r.kept), default=-1)
    dropped = [r for r in tried[last_kept + 1:] if not r.kept and r.after_samples_per_s is not None]
    if not dropped:
        return verdict

    def names(line: str, r: FixRecord) -> bool:
        return any((k == "shards" and "gpufeed stage" in line) or (k != "shards" and k in line) for k in r.changes)

    fixes = []
    for line in verdict.fixes:
        r = next((r for r in dropped if names(line, r)), None)
        fixes.append(line if r is None else
                     f"measured, not kept: {r.fix} went {r.before_samples_per_s:.1f} -> {r.after_samples_per_s:.1f} "
                     f"samples/s in this run (--fix), not beyond the noise; instead of: {line}")
    return dataclasses.replace(verdict, fixes=fixes)


def fixed_toml(loader: LoaderConfig, shards: str | None, tried: list[FixRecord]) -> str:
    """fixed.toml: the [loader] kept, and ``[train] shards`` when the set was staged (``shards`` not None), under a
    header naming each fix tried with its before -> after."""
    head = ["Settings kept by gpufeed train --measure --fix: use with gpufeed train --config fixed.toml."]
    head += [f"{'kept' if r.kept else 'dropped'}: {r.fix}: {r.before_samples_per_s:.1f} -> "
             + (f"{r.after_samples_per_s:.1f} samples/s" if r.after_samples_per_s is not None else "failed")
             for r in tried]
    text = to_toml("loader", loader, header="\n".join(head))
    if shards is not None:
        text += f"\n[train]\nshards = {json.dumps(shards)}\n"
    return text
