"""tune's decisions (docs/design.md §4): the :class:`Decision` record of each search step with its :data:`Reason`
code and sentence, what limits a trial (:func:`classify_bound`, in :mod:`gpufeed.measure.bounds`' words), the
quantity a refinement is judged on (:func:`compare_on`), and a trial's knobs in short (:func:`describe`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from gpufeed.config import LoaderConfig
from gpufeed.measure import bounds
from gpufeed.measure.bounds import TrialBound
from gpufeed.tune.records import TrialRecord


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

SENTENCES: dict[str, str] = {
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
                         "({threshold}, the detector train uses): their samples/s "
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
        text = SENTENCES[self.reason].format(chosen=self.chosen, **self.detail)
        object.__setattr__(self, "sentence", text if self.knob == "search" else f"{self.knob}: {text}")


def compare_on(ref: TrialRecord, rec: TrialRecord, usable: int, knob: str = "") -> tuple[str, float, float]:
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


def classify_bound(t: TrialRecord, usable_cpus: int,
                   storage_bytes_per_s: float | None = None) -> tuple[TrialBound, str]:
    """Name what limits a loader-only trial, with the numbers that say so, in the vocabulary and with the
    thresholds of :mod:`gpufeed.measure.bounds` (docs/design.md §4), which ``verdict.classify`` uses too. In a trial the
    whole window is data wait: the copy is judged on its share of wait + copy, as the verdict judges it on its
    share of the data stall."""
    rate = t.samples_per_s or 0.0
    cores = t.tree_cores_used or 0.0
    possible = possible_cores(t, usable_cpus)
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


def possible_cores(t: TrialRecord, usable_cpus: int) -> int:
    """Cores a trial's loader processes could keep busy: each rank's workers (or its main process), all ranks."""
    return min(usable_cpus, max(1, t.num_workers) * max(1, t.ranks))


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
