"""tune's records (docs/design.md §4, §5): a measured loader configuration (:class:`TrialRecord`, a row of
trials.parquet), one step of the search path (:class:`Decision`) and what ``gpufeed tune`` returns (:class:`TuneReport`, summary.json)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

from gpufeed.config import LayoutConfig, LoaderConfig
from gpufeed.measure.bounds import TrialBound
from gpufeed.measure.metrics import Stat
from gpufeed.measure.storage_rate import StorageRate


KNOBS = ("num_workers", "decode", "worker_batching", "prefetch_factor", "pin_memory", "persistent_workers",
         "shuffle_buffer", "remote_streams", "decode_threads")
"""LoaderConfig fields the tuner may move (batch_size and image_size are fixed by the caller)."""


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
    "target-below-trial",        # with the model's step, a trial beat the target: a ceiling measured low
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
    "target-below-trial": "trial #{trial} measured {rate:.1f} samples/s with the model's step beside the loader, "
                          "more than the target {target:g} allows as a compute ceiling (measured low?)",
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
    model_step_s: float = 0.0
    """``tune --with-model``: seconds of the model's training step inside the windows (not in copy_s)."""
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
    decode_threads: int = LoaderConfig.decode_threads
    """Decode threads per loader process."""
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
        remote_streams=cfg.remote_streams, decode_threads=cfg.decode_threads,
        samples_per_s=None if error or stat is None else stat.median,
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
