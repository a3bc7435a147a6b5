"""The fed/starved verdict (docs/design.md §4) as a list of rules over measured numbers.

Each rule is a pure function of :class:`Facts` (the :class:`VerdictInputs` and the figures derived from them once)
that returns a :class:`Verdict` carrying the numbers that made it fire, or None; :func:`classify` returns the first
that fires, in the order of :data:`RULES`: first what makes the numbers unfit to decide on (other processes on the
machine, windows too noisy, a ceiling below the end-to-end rate: ``inconclusive``), then unverified, fed, the
explained gap (low stall but well below the compute ceiling: the cause the numbers support, else ``inconclusive``),
then the starved bounds (rank imbalance, GPU decode, copy, storage, decode/CPU). The bound names and the copy/storage/idle thresholds are
:mod:`gpufeed.measure.bounds`, shared with ``gpufeed tune``. No torch here: every rule is unit-tested.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import PurePath
from statistics import median
from typing import Any, Callable, Literal, Sequence

from gpufeed.measure import bounds
from gpufeed.measure.contention import contended, threshold_text
from gpufeed.measure.settle import MIN_WINDOWS, RATE_SPREAD_MAX, STALL_SPREAD_MAX
from gpufeed.measure.bounds import CEILING_FRACTION, STALL_FED_PCT, Bound

LARGE_SAMPLE_BYTES = 48_000
"""Mean stored sample size above which decoding is needlessly expensive at training resolution
(a 224-px crop needs no 500-px-plus JPEG; ImageNet's originals average ~110 KB)."""


COMPUTE_SLOWER = 1.1
"""The real mode's compute per step counts as slower than the synthetic one's from this factor on."""
UNRELIABLE_CEILING = 1.0 / CEILING_FRACTION
"""An end-to-end rate above this factor x a ceiling means that ceiling was not measured right."""
LOADER_CORES_MIN = 0.25
"""Loader processes with fewer extra cores than this in the real mode cannot be what slowed compute (on a machine
the trainer alone does not fill)."""
LOADER_CORES_SATURATED_MIN = 0.05
"""On a machine the trainer alone fills (>= CEILING_FRACTION of its usable cores), loader work from this many cores
on lands on the trainer's: its threads wait for each other whenever one of their cores is taken, so the slowdown
can be well beyond the loader's share."""
IDLE_MACHINE_FIX = "run on an idle machine, or pin the run with taskset/cgroups"


@dataclass(frozen=True)
class ModeNeighbours:
    """What other processes did while one mode ran (:mod:`gpufeed.measure.contention`), on its busiest node."""

    mode: str
    other_cores: float
    machine_cores: float | None = None
    name: str | None = None
    """The largest other process's name and pid (None when none could be named, e.g. outside a container)."""
    pid: int | None = None
    process_cores: float | None = None
    gpu_mem_bytes: int | None = None
    """Its memory on this run's GPU, when it shares it."""
    node: int = 0


@dataclass(frozen=True)
class ModeWindows:
    """How one mode's timing windows disagreed (:mod:`gpufeed.measure.settle`)."""

    mode: str
    settled: bool
    num_windows: int
    rate_spread: float | None = None
    stall_spread_pts: float | None = None


@dataclass(frozen=True, kw_only=True)
class VerdictInputs:
    """What the instrument measured. Rates are samples/s over all ranks; None = not measured."""

    stall_pct: float
    """Σ data wait / Σ step time over all ranks of the real run, in %."""
    end_to_end_rate: float
    """Samples/s of the real run (all ranks)."""
    gpu_ceiling: float | None = None
    """Samples/s with a synthetic batch already on the device (all ranks): the compute ceiling, of the GPUs
    with ``is_cuda``, else of the CPUs."""
    loader_ceiling: float | None = None
    """Samples/s of the loader alone, batches moved to the device and dropped (all ranks)."""
    per_rank_stall_pct: tuple[float, ...] = ()
    """Data stall % of each rank in the real run."""
    copy_wait_pct: float | None = None
    """Host-to-device copy time not overlapped with compute, % of step time (all ranks)."""
    loader_cores_used: float | None = None
    """CPU cores the loader kept busy in loader-only mode, summed over all ranks (rank processes + workers)."""
    usable_cores: float | None = None
    """CPU cores usable on one node."""
    num_nodes: int = 1
    ranks_per_node: int = 1
    num_workers: int | None = None
    """Loader worker processes per rank."""
    read_bytes_per_s: float | None = None
    """Storage read rate of the loader (per node) while it ran."""
    storage_bytes_per_s: float | None = None
    """What the storage delivers, per node: the probe of ``train --measure``, a ``gpufeed io`` record or
    ``train --storage-rate``."""
    storage_source: str | None = None
    """Where storage_bytes_per_s came from: probe, io record or --storage-rate."""
    storage_ladder: tuple[tuple[int, float], ...] = ()
    """(parallel readers, bytes/s) of each step of the probe or io record, readers ascending; () = not measured."""
    remote_streams: int | None = None
    """Range requests each worker keeps in flight on a remote set (``[loader] remote_streams``); None = a local set
    (one read per worker)."""
    shards: str | None = None
    """The shard set the loader reads (the stage fix names it)."""
    set_bytes: int | None = None
    """The shard set's bytes (the manifest's total_bytes); with ``stage_nodes``, the largest node's share."""
    stage_nodes: int | None = None
    """The node count under ``[loader] shard_split = "node"`` on several nodes: each node reads, so stages, only
    its own shards (``gpufeed stage --num-nodes N --node-rank n``); None = every node reads the whole set."""
    shm_free_bytes: int | None = None
    """Free bytes in /dev/shm; None = no /dev/shm."""
    mean_sample_bytes: float | None = None
    """Mean stored bytes per sample (from the manifest)."""
    decode: str | None = None
    """The loader's decode path (pil, pil-draft, simplejpeg, gpu)."""
    is_cuda: bool = False
    """The model ran on CUDA devices; else on the CPU, and the texts name the CPU's compute, not a GPU."""
    neighbours: tuple[ModeNeighbours, ...] = ()
    """Per mode, what other processes held (empty = not measured)."""
    windows: tuple[ModeWindows, ...] = ()
    """Per mode judged by --measure, whether its windows settled (empty = not judged)."""
    real_compute_step_s: float | None = None
    """Compute seconds per optimizer step in the real mode (mean over ranks)."""
    synthetic_compute_step_s: float | None = None
    """... and in the synthetic mode: the same model and batch size on a fixed batch."""
    real_cores_used: float | None = None
    """CPU cores the run's processes (trainer + loader) kept busy in the real mode, per node."""
    synthetic_cores_used: float | None = None
    """... in the synthetic mode (the trainer alone), per node."""
    gpu_slowdowns: tuple[str, ...] = ()
    """NVML clocks-event reasons of heat or power seen in the real mode (:data:`gpufeed.measure.nvml.SLOWDOWN_LABELS`)."""
    synthetic_gpu_slowdowns: tuple[str, ...] = ()
    real_batch: str | None = None
    """The real batch as the model got it (dtype, shape, layout, device), and the synthetic one."""
    synthetic_batch: str | None = None


@dataclass(frozen=True)
class Verdict:
    status: Literal["fed", "starved", "slowed", "unverified", "inconclusive"]
    """'unverified': stall is low but no ceiling was measured, so the second condition of docs/design.md §4
    cannot be checked. 'slowed': the data keeps up, but the training step ran slower than the compute ceiling for a
    measured cause that is not the loader (a throttled GPU, other batches). 'inconclusive': the numbers cannot
    decide (``cause`` says why)."""
    bound: Bound | None
    """None unless starved; then one of :data:`gpufeed.measure.bounds.Bound`: 'rank imbalance', 'copy', 'GPU decode',
    'storage' or 'decode/CPU'."""
    reason: str
    """One sentence with the numbers that decided it."""
    fixes: list[str] = field(default_factory=list)
    """What would fix it, in numbers."""
    numbers: dict[str, Any] = field(default_factory=dict)
    """Derived figures (target rate, per-core rate, cores needed, ...)."""
    cause: str | None = None
    """Inconclusive or slowed: why, in a few words ('other processes', 'too noisy', 'unreliable ceiling',
    'unexplained', 'GPU throttle', 'batches differ')."""

    @property
    def ok(self) -> bool:
        """True when fed or unverified (an unverified run is not a failed check, but it is not called fed either);
        starved, slowed and inconclusive exit 1."""
        return self.status in ("fed", "unverified")

    def render(self) -> str:
        label = bounds.label(self.bound) if self.bound else self.cause
        head = f"verdict: {self.status.upper()}" + (f" ({label})" if label else "")
        lines = [f"{head}: {self.reason}"]
        lines += [f"  fix: {f}" for f in self.fixes]
        return "\n".join(lines)


def _known(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0


def compute_ceiling_name(is_cuda: bool) -> str:
    """What the synthetic mode measures: "GPU ceiling", or "compute ceiling (CPU)" when the model runs on the CPU."""
    return "GPU ceiling" if is_cuda else "compute ceiling (CPU)"


# --------------------------------------------------------------------------- what every rule reads


@dataclass(frozen=True)
class Facts:
    """The measured inputs and the figures derived from them once (:func:`derive`): what every rule reads."""

    v: VerdictInputs
    compute: str
    """The compute ceiling's name (:func:`compute_ceiling_name`)."""
    lower_name: str | None
    lower: float | None
    """The lower of the measured ceilings, and its name; None when none was measured."""
    stall_ok: bool
    """Data stall below :data:`STALL_FED_PCT`."""
    rate_ok: bool
    """End-to-end samples/s at least :data:`CEILING_FRACTION` x the lower ceiling (True when none was measured)."""
    target: float | None
    """What the model could take: the compute ceiling, else the rate the run would have without its stall."""
    ranks: list[float]
    """The finite per-rank stall percentages."""
    numbers: dict[str, Any]
    """The figures every verdict carries (stall, rates, ceilings, fraction of the lower ceiling)."""
    why: str
    """The opening of a starved verdict's reason ("" for a run that is fed or unverified)."""

    @property
    def per_node_target(self) -> float | None:
        return self.target / self.v.num_nodes if self.target else None


def derive(v: VerdictInputs) -> Facts:
    compute = compute_ceiling_name(v.is_cuda)
    ceilings = {k: c for k, c in ((compute, v.gpu_ceiling), ("loader ceiling", v.loader_ceiling)) if _known(c)}
    lower_name, lower = (min(ceilings.items(), key=lambda kv: kv[1]) if ceilings else (None, None))
    nums: dict[str, Any] = {"stall_pct": v.stall_pct, "end_to_end_rate": v.end_to_end_rate,
                            "gpu_ceiling": v.gpu_ceiling, "loader_ceiling": v.loader_ceiling}
    if lower is not None:
        nums["fraction_of_ceiling"] = v.end_to_end_rate / lower
    if v.read_bytes_per_s is not None:  # every verdict carries the loader's read rate (the report shows it)
        nums["read_bytes_per_s"] = v.read_bytes_per_s
    stall_ok = v.stall_pct < STALL_FED_PCT
    rate_ok = lower is None or v.end_to_end_rate >= CEILING_FRACTION * lower
    target = v.gpu_ceiling if _known(v.gpu_ceiling) else (
        v.end_to_end_rate / max(1e-9, 1 - v.stall_pct / 100) if v.stall_pct < 100 else None)
    ranks = [s for s in v.per_rank_stall_pct if s is not None and math.isfinite(s)]
    if stall_ok and rate_ok:
        why = ""
    elif stall_ok:  # then a ceiling was measured: the rate is what fails
        why = (f"data stall only {v.stall_pct:.1f}%, but {v.end_to_end_rate:.1f} samples/s is "
               f"{100 * v.end_to_end_rate / lower:.0f}% of the {lower_name} ({lower:.1f})")
    else:
        why = f"data stall {v.stall_pct:.1f}% (>= {STALL_FED_PCT:.0f}%) at {v.end_to_end_rate:.1f} samples/s"
        if lower is not None:
            why += f", {100 * v.end_to_end_rate / lower:.0f}% of the {lower_name} ({lower:.1f})"
    return Facts(v, compute, lower_name, lower, stall_ok, rate_ok, target, ranks, nums, why)


def _starved_numbers(f: Facts) -> dict[str, Any]:
    """The numbers of a starved verdict before its rule's own: the target rate and the spread of the ranks."""
    nums = {**f.numbers, "target_rate": f.target}
    if len(f.ranks) > 1:
        nums.update(rank_stall_max_pct=max(f.ranks), rank_stall_min_pct=min(f.ranks),
                    rank_stall_median_pct=median(f.ranks))
    return nums


SMALLER_IMAGES = "store images at <= 512 px (gpufeed shard --max-size 512)"
"""The fix for samples stored larger than training needs."""


def _smaller_images_fix(v: VerdictInputs) -> str | None:
    if _known(v.mean_sample_bytes) and v.mean_sample_bytes > LARGE_SAMPLE_BYTES:
        return f"{SMALLER_IMAGES}: now {v.mean_sample_bytes / 1e3:.0f} KB per sample"
    return None


# --------------------------------------------------------------------------- the rules, in the order they are tried


def _inconclusive(cause: str, reason: str, fixes: list[str], f: Facts, **nums: Any) -> Verdict:
    return Verdict("inconclusive", None, reason, fixes, {**f.numbers, **nums}, cause=cause)


def neighbours(f: Facts) -> Verdict | None:
    """Other processes held the CPU (or the GPU) in some mode: every figure after it is disturbed. (A training run
    without ceilings and with a low stall stays unverified: it claims nothing that they could disturb.)"""
    hit = [n for n in f.v.neighbours if contended(n.other_cores, n.machine_cores) or n.gpu_mem_bytes]
    if not hit or (f.lower is None and f.stall_ok):  # unverified already: no ceiling, no bound, nothing to disturb
        return None
    worst = max(hit, key=lambda n: (n.other_cores, n.gpu_mem_bytes or 0))
    modes = ", ".join(f"{n.mode} {n.other_cores:.2f}" for n in f.v.neighbours)
    where = "every mode" if len(hit) == len(f.v.neighbours) and len(hit) > 1 else f"the {worst.mode} mode"
    of = f" of {worst.machine_cores:.0f}" if worst.machine_cores else ""
    reason = (f"other processes held {worst.other_cores:.2f}{of} cores in {where} (cores others held per mode: "
              f"{modes}; the threshold is {threshold_text(worst.machine_cores)})")
    if worst.name is not None:
        reason += f"; the largest: {worst.name} (pid {worst.pid}"
        reason += f", {worst.process_cores:.2f} cores" if worst.process_cores else ""
        reason += f", {worst.gpu_mem_bytes / 1e9:.1f} GB on the GPU" if worst.gpu_mem_bytes else ""
        reason += ")"
    reason += "; the stall, the ceilings and any bound measured beside them are disturbed"
    return _inconclusive("other processes", reason, [IDLE_MACHINE_FIX], f, other_cores=worst.other_cores,
                         other_mode=worst.mode, other_pid=worst.pid, other_name=worst.name,
                         other_cores_per_mode={n.mode: n.other_cores for n in f.v.neighbours})


def too_noisy(f: Facts) -> Verdict | None:
    """A mode's windows did not settle within --measure-seconds: one hiccup could move the verdict."""
    bad = [w for w in f.v.windows if not w.settled]
    if not bad:
        return None

    def says(w: ModeWindows) -> str:
        parts = [f"{w.num_windows} window(s)"]
        if w.rate_spread is not None:
            parts.append(f"samples/s interval {100 * w.rate_spread:.0f}% wide")
        if w.stall_spread_pts is not None and w.mode != "loader-only":
            parts.append(f"stall interval {w.stall_spread_pts:.1f} points wide")
        return f"{w.mode}: " + ", ".join(parts)

    reason = ("the windows did not settle in the time measured (" + "; ".join(says(w) for w in bad) +
              f"; needed: >= {MIN_WINDOWS} windows and 90% intervals of the means no wider than "
              f"{100 * RATE_SPREAD_MAX:.0f}% of samples/s and {STALL_SPREAD_MAX:.1f} stall points, or on one side "
              f"of the {STALL_FED_PCT:g}% line)")
    return _inconclusive("too noisy", reason, [f"give it more time (--measure-seconds), or {IDLE_MACHINE_FIX}"], f,
                         unsettled={w.mode: {"num_windows": w.num_windows, "rate_spread": w.rate_spread,
                                             "stall_spread_pts": w.stall_spread_pts} for w in bad})


def unreliable_ceiling(f: Facts) -> Verdict | None:
    """The real run beat a ceiling by more than the margin: that ceiling was not measured right."""
    v = f.v
    if f.lower is None or v.end_to_end_rate <= UNRELIABLE_CEILING * f.lower:
        return None
    reason = (f"the real run reached {v.end_to_end_rate:.1f} samples/s, {100 * v.end_to_end_rate / f.lower:.0f}% of "
              f"the {f.lower_name} ({f.lower:.1f}): a ceiling below the end-to-end rate was not measured right, "
              "so no verdict is built on it")
    return _inconclusive("unreliable ceiling", reason, [f"measure again, with more time (--measure-seconds), or "
                                                        f"{IDLE_MACHINE_FIX}"], f)


def unverified(f: Facts) -> Verdict | None:
    """Low stall, but no ceiling to compare the rate with."""
    v = f.v
    if not (f.stall_ok and f.rate_ok and f.lower is None):
        return None
    reason = (f"data stall {v.stall_pct:.1f}% < {STALL_FED_PCT:.0f}% at {v.end_to_end_rate:.1f} samples/s, "
              f"but no ceiling was measured, so whether this is the {'GPU' if v.is_cuda else 'CPU'}'s own compute "
              "speed is unknown: run with --measure to compare")
    return Verdict("unverified", None, reason, [], dict(f.numbers))


def fed(f: Facts) -> Verdict | None:
    """Low stall and near the lower ceiling. The rules after this one see only runs that are not fed."""
    v = f.v
    if not (f.stall_ok and f.rate_ok and f.lower is not None):
        return None
    reason = (f"data stall {v.stall_pct:.1f}% < {STALL_FED_PCT:.0f}% and {v.end_to_end_rate:.1f} samples/s "
              f"= {100 * v.end_to_end_rate / f.lower:.0f}% of the {f.lower_name} ({f.lower:.1f})")
    if f.lower_name == f.compute:
        reason += ("; the GPU is the bound, as it should be" if v.is_cuda
                   else "; the CPU's compute is the bound, as it should be")
    return Verdict("fed", None, reason, [], dict(f.numbers))


def explained_gap(f: Facts) -> Verdict | None:
    """Low stall, yet end-to-end well below the lower ceiling: compare compute per step, real vs synthetic, and name
    the cause the numbers support (the loader's processes on the trainer's cores, a GPU that throttled, other
    batches), else inconclusive."""
    v = f.v
    if not (f.stall_ok and not f.rate_ok):
        return None
    real, synth = v.real_compute_step_s, v.synthetic_compute_step_s
    nums = dict(_starved_numbers(f), real_compute_step_s=real, synthetic_compute_step_s=synth)
    slower = _known(real) and _known(synth) and real >= COMPUTE_SLOWER * synth
    if slower:
        f_reason = (f"{f.why}; compute took {real:.3f} s per step in the real mode against {synth:.3f} s on the "
                    f"synthetic batch (+{100 * (real / synth - 1):.0f}%)")
        nums["compute_slowdown"] = real / synth
        extra = (v.real_cores_used - v.synthetic_cores_used) if (
            v.real_cores_used is not None and v.synthetic_cores_used is not None) else None
        if (extra is not None and extra >= LOADER_CORES_MIN and _known(v.usable_cores)
                and v.synthetic_cores_used + extra > CEILING_FRACTION * v.usable_cores):
            nums.update(loader_extra_cores=extra, trainer_cores=v.synthetic_cores_used)
            return Verdict(
                "starved", bounds.DECODE_CPU,
                f"{f_reason}: the loader's processes took {extra:.2f} cores on top of the {v.synthetic_cores_used:.2f} "
                f"the trainer used alone, {v.synthetic_cores_used + extra:.2f} of {v.usable_cores:.0f} usable: they "
                "ran on the trainer's cores",
                [f"give the loader cores of its own: torch threads = {max(1, math.floor(v.usable_cores - extra))} "
                 f"per node (--threads) leaves {extra:.1f} cores to the loader, or make decoding cheaper"],
                nums)
        full = saturated_trainer(v)
        if full is not None:
            loader, per_core = full
            nums.update(loader_extra_cores=loader, trainer_cores=v.synthetic_cores_used, per_core_rate=per_core)
            return Verdict(
                "starved", bounds.DECODE_CPU,
                f"{f_reason}: the trainer alone kept {v.synthetic_cores_used:.2f} of {v.usable_cores:.0f} usable "
                f"cores busy, so the loader's work (~{loader:.2f} cores at {v.end_to_end_rate:.1f} samples/s, at the "
                f"{per_core:.1f} samples/s per core it decoded in the loader-only mode) came out of the trainer's "
                "cores, whose threads then wait for each other",
                ["give the loader cores the trainer does not use: more CPU cores per process, or fewer torch threads "
                 "(--threads; that also lowers the compute ceiling, so measure both)",
                 "make decoding cheaper (smaller stored images: gpufeed shard --max-size; simplejpeg's scaled decode)"],
                nums)
        new = tuple(r for r in v.gpu_slowdowns if r not in v.synthetic_gpu_slowdowns)
        if v.is_cuda and new:
            nums["gpu_slowdowns"] = list(new)
            return Verdict("slowed", None, f"{f_reason}: the GPU throttled in the real mode ({', '.join(new)}) and not "
                           "on the synthetic batch", ["check the GPU's cooling and power limit (nvidia-smi -q -d "
                                                      "PERFORMANCE), then measure again"], nums, cause="GPU throttle")
        if v.real_batch and v.synthetic_batch and v.real_batch != v.synthetic_batch:
            nums.update(real_batch=v.real_batch, synthetic_batch=v.synthetic_batch)
            return Verdict("slowed", None, f"{f_reason}: the real batches ({v.real_batch}) differ from the synthetic "
                           f"one ({v.synthetic_batch})", ["make the loader deliver the batch the model is fastest on "
                                                          f"({v.synthetic_batch})"], nums, cause="batches differ")
    else:
        f_reason = f.why + (f"; compute per step is the same in both modes ({real:.3f} s real, {synth:.3f} s "
                            "synthetic)" if _known(real) and _known(synth) else "; compute per step not measured")
    return _inconclusive("unexplained", f"{f_reason}; no measured cause explains the gap", [
        "measure again; if it repeats, compare the real and synthetic modes in trace.json"], f, **nums)


def saturated_trainer(v: VerdictInputs) -> tuple[float, float] | None:
    """(the loader's cores at the real rate, its samples/s per core) when the trainer alone fills the machine
    (synthetic mode: >= CEILING_FRACTION of the usable cores) and the loader's work, at the per-core rate of the
    loader-only mode, reaches :data:`LOADER_CORES_SATURATED_MIN`; else None."""
    per_core = bounds.per_core_rate(v.loader_ceiling, v.loader_cores_used)
    if per_core is None or not (_known(v.synthetic_cores_used) and _known(v.usable_cores)):
        return None
    if v.synthetic_cores_used < CEILING_FRACTION * v.usable_cores:
        return None
    loader = v.end_to_end_rate / v.num_nodes / per_core
    return (loader, per_core) if loader >= LOADER_CORES_SATURATED_MIN else None


def rank_imbalance(f: Facts) -> Verdict | None:
    """Some ranks stall while others are fed (the fed ranks wait for the slow ones in the all-reduce)."""
    v = f.v
    if len(f.ranks) < 2:
        return None
    hi, lo = max(f.ranks), min(f.ranks)
    if not (hi >= STALL_FED_PCT and lo < STALL_FED_PCT and hi - lo >= max(STALL_FED_PCT, 0.5 * hi)):
        return None
    slots = max(1, v.ranks_per_node * v.num_nodes) * max(1, v.num_workers or 1)
    return Verdict(
        "starved", bounds.RANK_IMBALANCE,
        f"{f.why}; rank {f.ranks.index(hi)} stalls {hi:.1f}% while rank {f.ranks.index(lo)} stalls {lo:.1f}% "
        "(the fed ranks wait for it in the all-reduce)",
        [f"give every rank the same data and CPUs: shard count a multiple of ranks x workers "
         f"(gpufeed shard --multiple-of {slots})",
         "check CPU affinity / NUMA binding of the slow rank's loader workers (torchrun --numa-binding)"],
        _starved_numbers(f))


def gpu_decode(f: Facts) -> Verdict | None:
    """Copy-bound under GPU decode: the timed "copy" also holds nvjpeg decode and crop/resize on the device."""
    v = f.v
    if not (bounds.copy_limited(v.copy_wait_pct, v.stall_pct) and v.decode == "gpu"):
        return None
    return Verdict(
        "starved", bounds.GPU_DECODE,
        f"{f.why}; {v.copy_wait_pct:.1f}% of step time is spent moving encoded batches and decoding them on the GPU, "
        "not overlapped with compute",
        ["decode on the CPU workers instead (decode = 'simplejpeg') if they have cores to spare: compare "
         "`gpufeed tune` loader ceilings for both decode paths",
         f"{SMALLER_IMAGES}: less to decode per sample"],
        {**_starved_numbers(f), "copy_wait_pct": v.copy_wait_pct})


def copy(f: Facts) -> Verdict | None:
    """Most of the wait is host-to-device copy not overlapped with compute."""
    v = f.v
    if not bounds.copy_limited(v.copy_wait_pct, v.stall_pct):
        return None
    return Verdict(
        "starved", bounds.COPY,
        f"{f.why}; {v.copy_wait_pct:.1f}% of step time is host-to-device copy not overlapped with compute",
        ["pin_memory = true with non_blocking copies (pinned uint8 batches copy asynchronously)",
         "keep batches uint8 on the host and normalise on the device (4x fewer bytes than float32)",
         "prefetch the next batch to the device on a side CUDA stream"],
        {**_starved_numbers(f), "copy_wait_pct": v.copy_wait_pct})


def storage_at_limit(f: Facts) -> Verdict | None:
    """The loader reads at the storage's rate, at the loader's own concurrency (:func:`_storage_at_loader`)."""
    v = f.v
    storage_now, readers_now = _storage_at_loader(v)
    if not bounds.storage_limited(v.read_bytes_per_s, storage_now):
        return None
    nums = {**_starved_numbers(f), "read_bytes_per_s": v.read_bytes_per_s,
            "storage_bytes_per_s": v.storage_bytes_per_s}
    if storage_now != v.storage_bytes_per_s:
        nums["storage_bytes_per_s_at_loader"] = storage_now
    fixes: list[str] = []
    need = None
    if f.per_node_target and _known(v.mean_sample_bytes):
        need = f.per_node_target * v.mean_sample_bytes
        nums["needed_bytes_per_s"] = need
        who = "the GPUs need" if v.is_cuda else "the CPU compute needs"
        fixes.append(f"{who} ~{need / 1e6:.1f} MB/s per node at {f.per_node_target:.0f} samples/s "
                     f"x {v.mean_sample_bytes / 1e3:.0f} KB/sample; the storage delivers "
                     f"{v.storage_bytes_per_s / 1e6:.1f} MB/s")
    fixes.append(_stage_fix(v, nums))
    fixes += [fix for fix in (_streams_fix(v, need, nums), _smaller_images_fix(v)) if fix]
    src = f", {v.storage_source}" if v.storage_source else ""
    if storage_now != v.storage_bytes_per_s:  # the ladder read more with more readers than the loader uses
        limit = (f"{storage_now / 1e6:.1f} MB/s the storage delivers to {readers_now} reader(s) at once, as the "
                 f"loader reads (up to {v.storage_bytes_per_s / 1e6:.1f} MB/s with more{src})")
    else:
        limit = f"{v.storage_bytes_per_s / 1e6:.1f} MB/s the storage delivers{src}"
    return Verdict("starved", bounds.STORAGE,
                   f"{f.why}; the loader reads at the storage's limit: {v.read_bytes_per_s / 1e6:.1f} MB/s, "
                   f"{100 * v.read_bytes_per_s / storage_now:.0f}% of the {limit}", fixes, nums)


def storage_idle(f: Facts) -> Verdict | None:
    """The loader's processes sit idle while reading: they wait on I/O, not on the CPU."""
    v = f.v
    if not v.num_workers:
        return None
    busy_slots = v.ranks_per_node * v.num_nodes * v.num_workers
    if not bounds.idle_while_reading(v.loader_cores_used, min(busy_slots, (v.usable_cores or busy_slots) * v.num_nodes),
                                     v.read_bytes_per_s):
        return None
    return Verdict(
        "starved", bounds.STORAGE, f"{f.why}; loader workers idle while reading",
        [f"stage shards on a RAM disk or local NVMe: {busy_slots} loader processes kept only "
         f"{v.loader_cores_used:.1f} cores busy while reading {v.read_bytes_per_s / 1e6:.0f} MB/s "
         "(they wait on I/O, not on the CPU)"],
        {**_starved_numbers(f), "loader_cores_used": v.loader_cores_used, "read_bytes_per_s": v.read_bytes_per_s})


def decode_cpu(f: Facts) -> Verdict:
    """Everything else: the loader's CPU work cannot keep up, or it takes CPU from the training processes. Always
    fires: the last rule."""
    v = f.v
    nums = _starved_numbers(f)
    reason, fixes = f.why, []
    per_core = bounds.per_core_rate(v.loader_ceiling, v.loader_cores_used)
    if per_core is not None:
        nums.update(per_core_rate=per_core, loader_cores_used=v.loader_cores_used)
        fixes, late = _cores_fixes(f, per_core, nums)
        reason += f"; the loader decodes {per_core:.1f} samples/s per core{late}"
    if v.is_cuda and v.decode != "gpu":
        fixes.append('use GPU decode (decode = "gpu": nvJPEG through TorchCodec)')
    fixes += [fix for fix in (_smaller_images_fix(v),) if fix]
    if not fixes:
        fixes.append("run gpufeed train --measure to get the ceilings and per-core rates behind a fix")
    return Verdict("starved", bounds.DECODE_CPU, reason, fixes, nums)


Rule = Callable[[Facts], Verdict | None]

RULES: tuple[Rule, ...] = (neighbours, too_noisy, unreliable_ceiling, unverified, fed, explained_gap, rank_imbalance,
                           gpu_decode, copy, storage_at_limit, storage_idle, decode_cpu)
"""The verdict's rules in the order they are tried (docs/design.md §4): the first that fires wins. Add a cause by
adding a rule at its place."""


def classify(v: VerdictInputs, rules: Sequence[Rule] = RULES) -> Verdict:
    """Classify one measured run: the verdict of the first of ``rules`` that fires. Pure: same inputs, same
    verdict."""
    f = derive(v)
    for rule in rules:
        found = rule(f)
        if found is not None:
            return found
    raise ValueError(f"no rule fired for {v}: the last rule must always fire")


def _cores_fixes(f: Facts, per_core: float, nums: dict[str, Any]) -> tuple[list[str], str]:
    """The decode/CPU fixes in cores at the measured ``per_core`` samples/s per core (the cores needed and added to
    ``nums``), and the reason's tail when the loader suffices on average but its batches arrive late."""
    v, target, per_node_target = f.v, f.target, f.per_node_target
    if not target:
        return [], ""
    need_node = bounds.cores_needed(target, per_core) / v.num_nodes
    used_node = v.loader_cores_used / v.num_nodes
    more = max(0.0, need_node - used_node)
    nums.update(cores_needed_per_node=need_node, more_cores_per_node=more)
    where = " per node" if v.num_nodes > 1 else ""
    fixes, late = [], ""
    if v.num_workers == 0:
        fixes.append(f"num_workers = 0 decodes in the training process, in series with compute: use "
                     f"num_workers >= {max(1, math.ceil(need_node / v.ranks_per_node))} per rank "
                     "so loading overlaps compute (or let gpufeed tune pick it)")
    if more >= 0.5:
        fixes.append(f"needs ~{math.ceil(more)} more cores{where} at the measured {per_core:.1f} samples/s "
                     f"per core ({need_node:.1f} cores{where} to feed {per_node_target:.0f} samples/s; "
                     f"{used_node:.1f} busy now)")
    elif v.num_workers:
        late = (f"; the loader's rate suffices on average ({v.loader_ceiling:.1f} vs {target:.1f} samples/s "
                "needed) but batches arrive late")
        fixes.append(f"absorb the jitter: raise prefetch_factor, or num_workers to {v.num_workers + 1}+ per rank")
    if _known(v.usable_cores) and more >= 0.5:
        spare = v.usable_cores - used_node
        if need_node <= v.usable_cores and v.num_workers is not None:
            workers = max(v.num_workers + 1, math.ceil(need_node / v.ranks_per_node))
            fixes.append(f"this node has {v.usable_cores:.0f} cores ({spare:.1f} idle): raise num_workers "
                         f"to ~{workers} per rank, or let gpufeed tune pick it")
        elif need_node > v.usable_cores:
            fixes.append(f"this node has only {v.usable_cores:.0f} cores: more workers cannot close the gap")
    return fixes, late


STREAM_GAIN = 1.2
"""More parallel readers count as faster storage when they read at least this factor more than one reader."""


def _size(n: float) -> str:
    """Bytes in GB with one decimal, or in MB below 1 GB."""
    return f"{n / 1e9:.1f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _stage_fix(v: VerdictInputs, nums: dict[str, Any]) -> str:
    """Copy the set to /dev/shm when it fits there, else to local NVMe: the gpufeed stage command, with the sizes
    (under the node split on several nodes: each node's own shards, sized by the largest node's share)."""
    src = v.shards or "SHARDS"
    name = PurePath(src).parent.name if src.endswith(".json") else PurePath(src).name
    name = name or "shards"
    flags = f" --num-nodes {v.stage_nodes} --node-rank NODE" if v.stage_nodes else ""
    share = " (the largest node's share)" if v.stage_nodes else ""
    if v.set_bytes is None or v.shm_free_bytes is None:
        return (f"stage the set on a RAM disk or local NVMe: gpufeed stage {src} /dev/shm/{name}{flags} (or a local "
                f"NVMe folder)")
    nums.update(set_bytes=v.set_bytes, shm_free_bytes=v.shm_free_bytes, fits_shm=v.set_bytes <= v.shm_free_bytes)
    if v.set_bytes <= v.shm_free_bytes:
        return (f"stage the set to /dev/shm with gpufeed stage {src} /dev/shm/{name}{flags} "
                f"(fits: {_size(v.set_bytes)}{share} of {_size(v.shm_free_bytes)} free in /dev/shm)")
    return (f"stage the set to local NVMe with gpufeed stage {src} NVME_FOLDER/{name}{flags}: it does not fit in "
            f"/dev/shm ({_size(v.set_bytes)}{share}, {_size(v.shm_free_bytes)} free)")


def _readers_now(v: VerdictInputs) -> int:
    """Reads the loader of one node has in flight at once: ranks x workers (the main process when 0), x
    ``remote_streams`` on a remote set."""
    return v.ranks_per_node * max(1, v.num_workers or 0) * (v.remote_streams or 1)


def _storage_at_loader(v: VerdictInputs) -> tuple[float | None, int | None]:
    """What the storage delivers at the loader's own concurrency, and that concurrency: the ladder's rate at its
    largest rung not above :func:`_readers_now` (a per-connection limit, as object stores have, caps a loader
    with fewer streams below the ladder's best), never more than ``storage_bytes_per_s``. Without a ladder (an
    explicit --storage-rate) or when the loader reads with fewer readers than the lowest rung: the best rate."""
    best = v.storage_bytes_per_s
    ladder = sorted((r, b) for r, b in v.storage_ladder if r >= 1 and _known(b))
    now = _readers_now(v)
    below = [b for r, b in ladder if r <= now]
    if not _known(best) or not below:
        return best, None
    return min(best, max(below)), now


def _streams_fix(v: VerdictInputs, need: float | None, nums: dict[str, Any]) -> str | None:
    """"needs N parallel streams" when the ladder read more with more readers than the loader reads with now
    (ranks x workers, x ``remote_streams`` on a remote set): N = the fewest readers that delivered ``need`` bytes/s
    (the best rung when none did). The knob named is num_workers for a local set and ``[loader] remote_streams``
    (range requests per worker) for a remote one."""
    ladder = sorted((r, b) for r, b in v.storage_ladder if r >= 1 and _known(b))
    if len(ladder) < 2:
        return None
    one_readers, one = ladder[0]
    best_readers, best = max(ladder, key=lambda rung: (rung[1], -rung[0]))
    if best_readers <= one_readers or best < STREAM_GAIN * one:
        return None
    readers, rate = next(((r, b) for r, b in ladder if need is not None and b >= need), (best_readers, best))
    workers = max(1, v.num_workers or 0)
    now = _readers_now(v)
    if readers <= now:
        return None
    nums.update(streams_needed=readers, streams_now=now)
    head = (f"needs {readers} parallel streams: the storage read {one / 1e6:.1f} MB/s with {one_readers} reader(s) "
            f"and {rate / 1e6:.1f} MB/s with {readers}; the loader reads {now} at once ({v.ranks_per_node} rank(s) x "
            f"{workers} worker(s)")
    if v.remote_streams is not None:
        per_worker = math.ceil(readers / (v.ranks_per_node * workers))
        return (f"{head} x {v.remote_streams} range request(s)): set [loader] remote_streams = {per_worker} "
                f"(requests in flight per worker; or more workers)")
    per_rank = math.ceil(readers / max(1, v.ranks_per_node))
    return f"{head}): num_workers >= {per_rank} per rank"
