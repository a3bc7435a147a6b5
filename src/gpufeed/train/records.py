"""The records of a ``gpufeed train`` run (what ``summary.json`` and ``log.jsonl`` hold; docs/design.md §4, §5;
``gpu_health.jsonl`` is :mod:`gpufeed.measure.health`'s)
and :func:`aggregate`, which turns the ranks' timings of one mode into its record."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from gpufeed.measure.contention import OtherProcess, node_other_cores
from gpufeed.measure.health import GpuHealth
from gpufeed.measure.metrics import Stat
from gpufeed.measure.settle import spread
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.timing import RankTiming
from gpufeed.measure.verdict import Verdict

LOG_NAME = "log.jsonl"
SUMMARY_NAME = "summary.json"
CONFIG_NAME = "config.toml"
"""The run folder's files (docs/design.md §5)."""



@dataclass(frozen=True)
class NodeRecord:
    """One node's ranks of one mode, summed (a slow or starved node shows here, not only in the rank list)."""

    node: int
    host: str
    ranks: list[int]
    num_samples: int
    """Timed samples, this node's ranks."""
    samples_per_s: float
    """num_samples / the longest timed window of this node's ranks."""
    stall_pct: float
    """Σ (data wait + copy) / Σ step time over this node's ranks."""
    copy_wait_pct: float
    loader_cores_used: float | None
    """Σ cores busy over this node's ranks (rank processes + their loader workers)."""
    read_bytes_per_s: float
    other_cores: float | None = None
    """CPU cores other processes on this node held over the window (:mod:`gpufeed.measure.contention`)."""
    other_process: OtherProcess | None = None
    """The largest of those processes (name, pid, cores; GPU memory when it shares this run's GPU)."""
    machine_cores: int | None = None


@dataclass(frozen=True)
class ModeRecord:
    """One mode, aggregated over ranks."""

    mode: str
    num_ranks: int
    num_steps: int
    """Timed steps per rank."""
    num_samples: int
    """Timed samples, all ranks."""
    wall_s: float
    """Longest timed window of any rank."""
    samples_per_s: float
    """All ranks: num_samples / wall_s."""
    samples_per_s_stat: Stat | None
    """Median and spread over windows of log_every steps (all ranks summed per window)."""
    stall_pct: float
    copy_wait_pct: float
    data_wait_s: float
    next_wait_s: float
    h2d_s: float
    compute_s: float
    step_s: float
    loader_cores_used: float | None
    """Σ cores busy over ranks (rank processes + their loader workers)."""
    read_bytes_per_s: float
    per_rank: list[RankTiming]
    final_loss: float | None = None
    per_node: list[NodeRecord] = field(default_factory=list)
    """The ranks grouped by node (:func:`per_node`), in node order."""
    other_cores: float | None = None
    """CPU cores other processes held over the window, on the node where they held the most (per node:
    ``per_node[].other_cores``); None when not measured."""
    other_process: OtherProcess | None = None
    """The largest process outside the run on that node."""
    machine_cores: int | None = None
    """That node's logical CPUs."""
    stall_pct_stat: Stat | None = None
    """Median and spread of the windows' data stall %."""
    settled: bool | None = None
    """--measure: at least 3 windows that disagree by less than the verdict's margins (:mod:`gpufeed.measure.settle`);
    None when the mode was not judged (a plain training run)."""
    rate_spread: float | None = None
    """(max - min) / median of the windows' samples/s."""
    stall_spread_pts: float | None = None
    """max - min of the windows' data stall %, in points."""
    batch: str | None = None
    """The batch the model got, as :func:`gpufeed.train.steps.describe_batch` writes it (dtype, shape, layout, device)."""


@dataclass(frozen=True)
class ValRecord:
    epoch: int
    step: int
    num_samples: int
    loss: float
    top1_pct: float
    top5_pct: float


@dataclass(frozen=True)
class FixRecord:
    """One fix ``train --measure --fix`` applied and re-measured (:mod:`gpufeed.train.fix`)."""

    fix: str
    """What was changed, in words (``num_workers 0 -> 1``, ``stage the set to /dev/shm/...``)."""
    changes: dict[str, Any]
    """The [loader] keys changed, and ``shards`` when the set was staged."""
    before_samples_per_s: float
    """End-to-end samples/s (median of the real mode's windows) of the settings kept so far."""
    after_samples_per_s: float | None
    """The same with this fix; None when the re-measure failed (``error``)."""
    kept: bool
    why: str
    """Why it was kept or dropped: the gain next to the windows' spread."""
    verdict: Verdict | None = None
    """The verdict measured with this fix applied."""
    error: str | None = None
    seconds: float = 0.0
    """Wall-clock seconds this fix took: staging and the re-measure."""


@dataclass(frozen=True)
class TrainRecord:
    mode: str
    arch: str
    device: str
    backend: str
    world_size: int
    num_nodes: int
    amp: str
    batch_size: int
    """Per rank, per micro-batch."""
    accum_steps: int
    global_batch: int
    image_size: int
    num_classes: int
    start_step: int
    """First step of this run (> 0 after --resume)."""
    step: int
    """Optimizer steps done at the end."""
    total_steps: int
    epoch: int
    final_loss: float | None
    final_lr: float
    """The LR of the last optimizer step."""
    modes: dict[str, ModeRecord]
    val: list[ValRecord]
    verdict: Verdict | None
    ok: bool
    num_skipped: int = 0
    """Corrupt samples skipped (``on_error = "skip"``), rank 0's loader."""
    num_repeated: int = 0
    """Samples read a second time to keep the ranks' batch counts equal, rank 0's loader."""
    checkpoint: str | None = None
    run_dir: str | None = None
    wall_s: float = 0.0
    started: str = ""
    notes: list[str] = field(default_factory=list)
    rank_param_checksums: list[float] = field(default_factory=list)
    """Σ of the parameters per rank at the end (DDP keeps them equal)."""
    storage: StorageRate | None = None
    """The shard storage's read rate the verdict used, and its source (probe, io record, --storage-rate);
    None = not known (no --measure, or the probe disabled)."""
    loader_read_bytes_per_s: float | None = None
    """The loader's read rate per node the verdict compared with ``storage`` (loader-only mode, else real): the
    storage I/O counters for a local set; samples/s x the manifest's mean sample bytes for a set behind a URL,
    whose socket reads those counters do not see. None without a verdict."""
    gpu_health: list[GpuHealth] = field(default_factory=list)
    """Each CUDA rank's GPU over the run (:mod:`gpufeed.measure.health`), by rank; empty when no GPU was sampled through
    NVML (CPU runs, no driver or no nvidia-ml-py)."""
    fixes_tried: list[FixRecord] = field(default_factory=list)
    """``--fix``: each fix applied and re-measured, in order; the modes and the verdict above are those of the
    settings kept at the end."""
    fixes_not_tried: list[str] = field(default_factory=list)
    """``--fix``: the fixes that need a person (more cores, re-sharding, another GPU) or did not fit the budget."""
    fixed_config: str | None = None
    """``--fix``: fixed.toml in the run folder (the [loader] kept, and [train] shards when the set was staged)."""



def _pct(part: float, whole: float) -> float:
    return 100.0 * part / whole if whole > 0 else 0.0


def per_node(ranks: list[RankTiming]) -> list[NodeRecord]:
    """The ranks' timings grouped by their node: sums over each node's ranks, rate over its longest window; the
    cores other processes held on its host (:func:`gpufeed.measure.contention.node_other_cores`)."""
    nodes: dict[int, list[RankTiming]] = {}
    for r in sorted(ranks, key=lambda r: r.rank):
        nodes.setdefault(r.node, []).append(r)
    out = []
    for node, rs in sorted(nodes.items()):
        wall = max(r.wall_s for r in rs)
        samples = sum(r.num_samples for r in rs)
        step_s = sum(r.step_s for r in rs)
        cores = [r.cores_used for r in rs if r.cores_used is not None]
        # the machine is the host: ranks of other nodes on the same host (tests, a node per socket) are not neighbours
        same_host = [r for r in ranks if r.host == rs[0].host] if rs[0].host else rs
        other, big, machine = node_other_cores([r.contention for r in same_host if r.contention is not None])
        out.append(NodeRecord(
            node=node, host=rs[0].host, ranks=[r.rank for r in rs], num_samples=samples,
            samples_per_s=samples / wall if wall > 0 else 0.0,
            stall_pct=_pct(sum(r.data_wait_s for r in rs), step_s),
            copy_wait_pct=_pct(sum(r.h2d_s for r in rs), step_s),
            loader_cores_used=sum(cores) if cores else None,
            read_bytes_per_s=sum(r.read_bytes for r in rs) / wall if wall > 0 else 0.0,
            other_cores=other, other_process=big, machine_cores=machine))
    return out


def aggregate(mode: str, ranks: list[RankTiming], num_nodes: int = 1, final_loss: float | None = None, *,
              judge: bool = False) -> ModeRecord:
    """Per-rank timings -> one ModeRecord (sums over ranks; rate over the longest window), with the per-node
    sums and the cores other processes held (the node where they held most). ``read_bytes_per_s`` is per node: the
    read rate of all ranks / ``num_nodes``. ``judge`` (--measure): whether the windows settled."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    wall = max((r.wall_s for r in ranks), default=0.0)
    samples = sum(r.num_samples for r in ranks)
    step_s = sum(r.step_s for r in ranks)
    wait = sum(r.data_wait_s for r in ranks)
    h2d = sum(r.h2d_s for r in ranks)
    n_win = min((len(r.window_rates) for r in ranks), default=0)
    windows = [sum(r.window_rates[i] for r in ranks) for i in range(n_win)]
    n_stall = min((len(r.window_stalls) for r in ranks), default=0)
    stalls = [sum(r.window_stalls[i] for r in ranks) / len(ranks) for i in range(n_stall)]
    cores = [r.cores_used for r in ranks if r.cores_used is not None]
    nodes = per_node(ranks)
    worst = max((n for n in nodes if n.other_cores is not None), key=lambda n: n.other_cores, default=None)
    sp = spread(windows, stalls if mode != "loader-only" else None) if judge else None
    return ModeRecord(
        mode=mode, num_ranks=len(ranks), num_steps=max((r.num_steps for r in ranks), default=0),
        num_samples=samples, wall_s=wall, samples_per_s=samples / wall if wall > 0 else 0.0,
        samples_per_s_stat=Stat.of(windows) if windows else None,
        stall_pct=_pct(wait, step_s), copy_wait_pct=_pct(h2d, step_s),
        data_wait_s=wait, next_wait_s=sum(r.next_wait_s for r in ranks), h2d_s=h2d,
        compute_s=sum(r.compute_s for r in ranks), step_s=step_s,
        loader_cores_used=sum(cores) if cores else None,
        read_bytes_per_s=sum(r.read_bytes for r in ranks) / wall / max(1, num_nodes) if wall > 0 else 0.0,
        per_rank=ranks, final_loss=final_loss, per_node=nodes,
        other_cores=worst.other_cores if worst else None, other_process=worst.other_process if worst else None,
        machine_cores=worst.machine_cores if worst else None,
        stall_pct_stat=Stat.of(stalls) if stalls else None,
        settled=sp.settled if sp else None, rate_spread=sp.rate_spread if sp else None,
        stall_spread_pts=sp.stall_spread_pts if sp else None,
    )

