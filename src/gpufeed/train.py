"""``gpufeed train``: AMP + DDP ResNet training that measures whether the GPUs are fed (DESIGN §3-§5).

One code path for every device: NCCL on CUDA, gloo on CPU. Multi-process runs go through torchrun
(``python -m torch.distributed.run ... -m gpufeed.train CONFIG``); a single process runs in-process.

Modes
- ``real``: train on the shards (epochs/steps, validation, checkpoints, resume);
- ``synthetic``: a fixed uint8 batch already on the device, same step: the compute ceiling (the GPU ceiling,
  or the "compute ceiling (CPU)" when training on the CPU);
- ``loader-only``: the loader alone, batches moved to the device and dropped: the loader ceiling;
- ``measure``: synthetic, loader-only and real, briefly, in that order, then the verdict.

Per step and rank we time, on the device's own timeline (:mod:`gpufeed.timing`: CUDA events on the
compute stream; perf_counter on CPU, where the work is synchronous): the time the device sits idle while
the host waits in ``next(loader)`` (not the host's whole wait: while compute is still queued the device is
busy), the host-to-device copy that is not overlapped with compute (``loader.to_device`` on the compute
stream: the step cannot start before it ends), compute (normalise + forward + backward + optimizer) and
the step. Nothing waits for the device per step: the marks are read in bulk at log steps and at the ends
of the timed window. Data stall % = Σ (data wait + copy) / Σ step time.
At the end of each mode the per-rank numbers are all-gathered and rank 0 writes the records.

Checkpoints (``last.pt``) hold tensors and plain values only: ``--resume`` reads them with
``torch.load(weights_only=True)`` and checks them against the run (arch, classes, every shape, the RNG
states) before loading anything; nothing is unpickled into objects.

Failures: what every rank would refuse before its first step (no shards, a missing shard, too few samples,
a checkpoint that does not fit) exits 2; a failure after a rank began (a corrupt shard mid-epoch) exits 1.
Under torchrun each failed rank prints ``rank R: <one sentence>`` and the launcher repeats the first cause.

Entry points: :func:`launch` (run folder + torchrun or in-process), :func:`train` (inside one rank),
:func:`measure` (the three modes in this process, for scripts), :func:`render` (summary -> text).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import random
import subprocess
import sys
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from gpufeed.config import LoaderConfig, TrainConfig, load_config, to_toml
from gpufeed.errors import ConfigError, DataError, GpufeedError, RunError, one_line
from gpufeed.metrics import Stat
from gpufeed.records import append_jsonl, make_run_dir, to_jsonable, utc_now, write_json
from gpufeed.telemetry import Telemetry
from gpufeed.timing import Clock, CudaClock, HostClock, StepMarks, StepTimes, resolve
from gpufeed.verdict import STALL_FED_PCT, Verdict, VerdictInputs, classify, compute_ceiling_name
from gpufeed.world import World

CHECKPOINT_NAME = "last.pt"
CHECKPOINT_FORMAT = "gpufeed-train-checkpoint"
CHECKPOINT_VERSION = 2
"""2: tensors and plain values only (RNG states as tensors), loaded with ``weights_only=True``."""
LOG_NAME = "log.jsonl"
SUMMARY_NAME = "summary.json"
CONFIG_NAME = "config.toml"
MODES_MEASURE = ("synthetic", "loader-only", "real")


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class RankTiming:
    """One rank's timed window of one mode (steps after the timing warm-up)."""

    rank: int
    num_steps: int
    num_samples: int
    wall_s: float
    step_s: float
    """Σ step time."""
    data_wait_s: float
    """Σ (next_wait_s + h2d_s)."""
    next_wait_s: float
    """Σ time the device sat idle while the host waited in next(loader)."""
    h2d_s: float
    """Σ host-to-device copy not overlapped with compute (loader.to_device)."""
    compute_s: float
    samples_per_s: float
    stall_pct: float
    window_rates: list[float]
    """samples/s of consecutive windows of log_every steps."""
    cores_used: float | None = None
    """CPU cores this rank's process tree (incl. loader workers) kept busy."""
    read_bytes: int = 0
    rss_max_bytes: int = 0
    gpu: dict[str, Any] = field(default_factory=dict)


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


@dataclass(frozen=True)
class ValRecord:
    epoch: int
    step: int
    num_samples: int
    loss: float
    top1_pct: float
    top5_pct: float


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


# --------------------------------------------------------------------------- helpers


def lr_at(step: int, *, total: int, warmup: int, peak: float, floor: float = 0.0) -> float:
    """Linear warm-up to ``peak`` over ``warmup`` steps, then cosine decay to ``floor`` at ``total``."""
    if warmup > 0 and step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))


def default_warmup(total: int) -> int:
    return min(2000, total // 20)


def resolve_amp(amp: str, device: torch.device) -> tuple[str, str | None]:
    """``amp`` with ``auto`` resolved for ``device`` -> (bf16 | fp16 | off, a note saying what auto chose).

    auto: bf16 on CUDA devices with native bf16 (compute capability 8.0+), fp16 (with a GradScaler) on older
    CUDA devices, off on the CPU, where bf16 autocast is emulated, and many times slower than float32, unless the
    CPU has native bf16 instructions (AVX512-BF16, AMX): an explicit ``bf16`` is kept as asked."""
    if amp != "auto":
        return amp, None
    if device.type != "cuda":
        return "off", "amp auto -> off (CPU)"
    major, minor = torch.cuda.get_device_capability(device)
    if major >= 8:
        return "bf16", f"amp auto -> bf16 (compute capability {major}.{minor})"
    return "fp16", f"amp auto -> fp16 with a GradScaler (compute capability {major}.{minor} has no native bf16)"


def _normalize(images: torch.Tensor, *, dtype: torch.dtype = torch.float32, channels_last: bool = False) -> torch.Tensor:
    from gpufeed.loader import normalize

    return normalize(images, dtype=dtype, channels_last=channels_last)


class _Meter:
    """Accumulates one rank's step timings after the warm-up; runs telemetry over the timed window.

    Steps arrive as :class:`StepMarks` (:meth:`add`) and are read after the clock syncs (:meth:`settle`, at
    log steps; :meth:`finish`). The wall-clock window starts and ends with a sync, so that it holds the
    device work of exactly the timed steps, and pauses leave out what runs between steps (validation,
    checkpoints)."""

    def __init__(self, warmup: int, log_every: int, world: World, clock: Clock) -> None:
        self.warmup, self.log_every, self.world = warmup, log_every, world
        self.clock = clock
        self.index = 0
        self.steps: list[StepTimes] = []
        self.pending: list[StepMarks] = []
        self.t0: float | None = None
        self.t1: float | None = None
        self.paused_s = 0.0
        self._pause0: float | None = None
        self.tel: Telemetry | None = None

    def before_step(self) -> None:
        if self.index == self.warmup and self.t0 is None:
            gpu = (torch.device(self.world.device).index or 0) if self.world.is_cuda else None
            self.clock.sync()  # the warm-up's queued work stays out of the window
            self.tel = Telemetry(interval_s=0.5, gpu_index=gpu)
            self.tel.start()
            self.t0 = time.perf_counter()

    def add(self, marks: StepMarks) -> None:
        if self.t0 is not None:
            self.pending.append(marks)
        self.index += 1

    def settle(self) -> None:
        """Read the timed steps so far (one sync), keeping their seconds only."""
        if self.pending:
            self.steps += resolve(self.clock, self.pending)
            self.pending = []

    def pause(self) -> None:
        """Leave what follows (validation, checkpoints) out of the timed window."""
        if self.t0 is not None and self.t1 is None and self._pause0 is None:
            self.clock.sync()
            self._pause0 = time.perf_counter()

    def resume(self) -> None:
        if self._pause0 is not None:
            self.paused_s += time.perf_counter() - self._pause0
            self._pause0 = None

    def stop(self) -> None:
        """End the timed window right after the last step's device work (before logging and worker shutdown)."""
        if self.t1 is None:
            self.resume()
            self.clock.sync()
            self.t1 = time.perf_counter()
            if self.tel is not None:
                self.tel.stop()

    def finish(self) -> RankTiming:
        self.stop()
        self.settle()
        tel = self.tel.summary() if self.tel is not None else None
        wall = (self.t1 - self.t0 - self.paused_s) if self.t0 is not None else 0.0
        cols = list(zip(*self.steps)) if self.steps else [(), (), (), (), ()]
        step_s, next_s, h2d_s, comp_s = (float(sum(c)) for c in cols[:4])
        samples = int(sum(cols[4]))
        windows = []
        for i in range(0, len(self.steps), self.log_every):
            chunk = self.steps[i:i + self.log_every]
            if len(chunk) == self.log_every or not windows:
                t = sum(s[0] for s in chunk)
                if t > 0:
                    windows.append(sum(s[4] for s in chunk) / t)
        return RankTiming(
            rank=self.world.rank, num_steps=len(self.steps), num_samples=samples, wall_s=wall,
            step_s=step_s, data_wait_s=next_s + h2d_s, next_wait_s=next_s, h2d_s=h2d_s, compute_s=comp_s,
            samples_per_s=samples / wall if wall > 0 else 0.0,
            stall_pct=100.0 * (next_s + h2d_s) / step_s if step_s > 0 else 0.0,
            window_rates=windows,
            cores_used=tel.tree_cores_used if tel else None,
            read_bytes=tel.tree_read_bytes if tel else 0,
            rss_max_bytes=tel.rss_max_bytes if tel else 0,
            gpu=dict(tel.gpu) if tel else {},
        )


def aggregate(mode: str, ranks: list[RankTiming], num_nodes: int = 1, final_loss: float | None = None) -> ModeRecord:
    """Per-rank timings -> one ModeRecord (sums over ranks; rate over the longest window)."""
    ranks = sorted(ranks, key=lambda r: r.rank)
    wall = max((r.wall_s for r in ranks), default=0.0)
    samples = sum(r.num_samples for r in ranks)
    step_s = sum(r.step_s for r in ranks)
    wait = sum(r.data_wait_s for r in ranks)
    h2d = sum(r.h2d_s for r in ranks)
    n_win = min((len(r.window_rates) for r in ranks), default=0)
    windows = [sum(r.window_rates[i] for r in ranks) for i in range(n_win)]
    cores = [r.cores_used for r in ranks if r.cores_used is not None]
    return ModeRecord(
        mode=mode, num_ranks=len(ranks), num_steps=max((r.num_steps for r in ranks), default=0),
        num_samples=samples, wall_s=wall, samples_per_s=samples / wall if wall > 0 else 0.0,
        samples_per_s_stat=Stat.of(windows) if windows else None,
        stall_pct=100.0 * wait / step_s if step_s > 0 else 0.0,
        copy_wait_pct=100.0 * h2d / step_s if step_s > 0 else 0.0,
        data_wait_s=wait, next_wait_s=sum(r.next_wait_s for r in ranks), h2d_s=h2d,
        compute_s=sum(r.compute_s for r in ranks), step_s=step_s,
        loader_cores_used=sum(cores) if cores else None,
        read_bytes_per_s=sum(r.read_bytes for r in ranks) / wall / max(1, num_nodes) if wall > 0 else 0.0,
        per_rank=ranks, final_loss=final_loss,
    )


def _atomic_torch_save(obj: Any, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(tmp, "wb") as f:
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _rng_state(cuda: bool) -> dict[str, Any]:
    """This process's RNG states as tensors and plain values (what ``torch.load(weights_only=True)`` reads)."""
    import numpy as np

    version, key, gauss = random.getstate()
    name, np_key, pos, has_gauss, cached = np.random.get_state()
    state: dict[str, Any] = {
        "python": {"version": int(version), "key": torch.tensor(key, dtype=torch.int64), "gauss": gauss},
        "numpy": {"name": str(name), "key": torch.from_numpy(np_key.astype(np.int64)), "pos": int(pos),
                  "has_gauss": int(has_gauss), "cached_gaussian": float(cached)},
        "torch": torch.get_rng_state(),
    }
    if cuda:
        state["cuda"] = torch.cuda.get_rng_state()
    return state


@dataclass(frozen=True)
class _RngState:
    """A checkpoint's RNG states, checked by applying them to scratch generators; :meth:`apply` cannot fail."""

    python: tuple[Any, ...]
    numpy: tuple[Any, ...]
    torch: torch.Tensor
    cuda: torch.Tensor | None

    @classmethod
    def parse(cls, state: Any, where: str) -> "_RngState":
        import numpy as np

        def bad(what: str) -> DataError:
            return DataError(f"{where}: {what}")

        if not isinstance(state, dict):
            raise bad("the RNG state is not a mapping")
        py, nps, tch, cuda = state.get("python"), state.get("numpy"), state.get("torch"), state.get("cuda")
        try:
            key = py["key"]
            if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.dim() == 1):
                raise TypeError("key is not an int64 vector")
            gauss = py["gauss"]
            if gauss is not None and not isinstance(gauss, float):
                raise TypeError("gauss is not a float")
            python = (int(py["version"]), tuple(int(v) for v in key.tolist()), gauss)
            random.Random().setstate(python)  # raises on a malformed state
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise bad(f"the Python RNG state is malformed ({one_line(exc)})") from None
        try:
            key = nps["key"]
            if not (isinstance(key, torch.Tensor) and key.dtype == torch.int64 and key.dim() == 1
                    and bool(((key >= 0) & (key < 2**32)).all())):
                raise TypeError("key is not a vector of uint32 values")
            if not isinstance(nps["name"], str):
                raise TypeError("name is not a string")
            numpy = (nps["name"], key.numpy().astype(np.uint32), int(nps["pos"]), int(nps["has_gauss"]),
                     float(nps["cached_gaussian"]))
            np.random.RandomState().set_state(numpy)
        except (KeyError, TypeError, ValueError, OverflowError) as exc:
            raise bad(f"the NumPy RNG state is malformed ({one_line(exc)})") from None
        for name, t in (("torch", tch), ("CUDA", cuda)):
            if name == "CUDA" and t is None:
                continue
            if not (isinstance(t, torch.Tensor) and t.dtype == torch.uint8 and t.dim() == 1):
                raise bad(f"the {name} RNG state is not a byte vector")
        try:
            torch.Generator().set_state(tch)
        except RuntimeError as exc:
            raise bad(f"the torch RNG state is malformed ({one_line(exc)})") from None
        if cuda is not None and torch.cuda.is_available():
            want = torch.cuda.get_rng_state().numel()
            if cuda.numel() != want:
                raise bad(f"the CUDA RNG state has {cuda.numel()} bytes, this GPU's has {want}")
        return cls(python=python, numpy=numpy, torch=tch, cuda=cuda)

    def apply(self) -> None:
        import numpy as np

        random.setstate(self.python)
        np.random.set_state(self.numpy)
        torch.set_rng_state(self.torch)
        if self.cuda is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state(self.cuda)


def read_checkpoint(path: Path) -> dict[str, Any]:
    """``torch.load(path, weights_only=True)``: tensors and plain values only, nothing is unpickled into
    objects. Anything else (another format, a pickled object, a truncated or junk file) is a DataError."""
    import pickle
    import zipfile

    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; the legacy raw-pickle format is refused
        raise DataError(f"{path} is not a gpufeed checkpoint: not a torch zip archive (truncated, junk or "
                        f"an old torch format)")
    _check_archive(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch's notes on pickle protocols: the refusal below says it all
            state = torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError:
        raise DataError(f"{path} is refused: the safe loader (tensors and plain values only) rejected it, and "
                        f"loading it in full could run code") from None
    except Exception as exc:  # noqa: BLE001 - any failure to read an untrusted file is the same refusal
        raise DataError(f"{path} cannot be read: truncated or corrupt ({type(exc).__name__}: "
                        f"{one_line(exc)[:200]})") from None
    if not isinstance(state, dict) or state.get("format") != CHECKPOINT_FORMAT:
        raise DataError(f"{path} is not a gpufeed train checkpoint")
    if state.get("version") != CHECKPOINT_VERSION:
        raise DataError(f"{path} has checkpoint version {_short(state.get('version'))}, this gpufeed reads "
                        f"version {CHECKPOINT_VERSION}; start without --resume")
    return state


MAX_CHECKPOINT_ENTRIES = 100_000
"""Records in a checkpoint archive (resnet101 with momentum buffers has ~1,000)."""


def _check_archive(path: Path) -> None:
    """Refuse a checkpoint archive that would expand beyond its size before ``torch.load`` reads it.

    ``torch.save`` stores every record uncompressed; a compressed record (a few KB inflating to gigabytes) or
    declared sizes larger than the file are not ours, so memory stays bounded by the file's own size."""
    import zipfile

    size = path.stat().st_size
    try:
        with zipfile.ZipFile(path) as zf:
            infos = zf.infolist()
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise DataError(f"{path} cannot be read: not a readable zip archive ({one_line(exc)[:120]})") from None
    if len(infos) > MAX_CHECKPOINT_ENTRIES:
        raise DataError(f"{path} holds {len(infos)} records; a gpufeed checkpoint has at most {MAX_CHECKPOINT_ENTRIES:,}")
    packed = [i.filename for i in infos if i.compress_type != zipfile.ZIP_STORED]
    if packed:
        raise DataError(f"{path} is not a gpufeed checkpoint: record {packed[0][:80]!r} is compressed "
                        f"(torch.save stores records uncompressed)")
    declared = sum(i.file_size for i in infos)
    if declared > size:
        raise DataError(f"{path} declares {declared} bytes of records in a {size}-byte file")


def _short(value: Any) -> str:
    """An untrusted value for a message: a bounded repr (depth and length), at most 60 characters."""
    import reprlib

    r = reprlib.Repr()
    r.maxlevel, r.maxstring, r.maxother = 3, 40, 40
    try:
        text = r.repr(value)
    except (RecursionError, ValueError):  # a nested structure deeper than the interpreter recurses
        text = f"<{type(value).__name__}>"
    return text if len(text) <= 60 else text[:57] + "..."


def _count(state: dict[str, Any], key: str, where: Path) -> int:
    v = state.get(key)
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 2**53:
        raise DataError(f"{where}: {key} is {_short(v)}, not a non-negative integer")
    return v


def _check_like(value: Any, template: Any, what: str) -> None:
    """``value`` (from a checkpoint) has ``template``'s structure: the same keys, list lengths, tensor shapes
    and dtypes, kinds of scalars. Raises ValueError naming the first difference."""
    if isinstance(template, torch.Tensor):
        if not isinstance(value, torch.Tensor) or value.shape != template.shape or value.dtype != template.dtype:
            got = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(f"{what} is {got}, this run has {template.dtype} {tuple(template.shape)}")
    elif isinstance(template, dict):
        if not isinstance(value, dict):
            raise ValueError(f"{what} is not a mapping")
        extra = [k for k in value if k not in template]
        if extra:
            raise ValueError(f"{what} has the unknown key {_short(extra[0])}")
        missing = [k for k in template if k not in value]
        if missing:
            raise ValueError(f"{what} lacks the key {missing[0]!r}")
        for k, v in value.items():
            _check_like(v, template[k], f"{what}[{k!r}]")
    elif isinstance(template, (list, tuple)):
        if not isinstance(value, (list, tuple)) or len(value) != len(template):
            raise ValueError(f"{what} does not have {len(template)} entries")
        for i, (v, t) in enumerate(zip(value, template)):
            _check_like(v, t, f"{what}[{i}]")
    elif isinstance(template, bool) or template is None or isinstance(template, str):
        if type(value) is not type(template):
            raise ValueError(f"{what} is {_short(value)}, expected a {type(template).__name__}")
    elif isinstance(template, (int, float)):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{what} is {_short(value)}, not a finite number")
    else:
        raise ValueError(f"{what}: cannot check a {type(template).__name__}")


def run_loader_config(cfg: TrainConfig, loader_cfg: LoaderConfig) -> LoaderConfig:
    """The [loader] section with the run's seed, batch size and image size."""
    overrides: dict[str, Any] = {"seed": cfg.seed}
    if cfg.batch_size is not None:
        overrides["batch_size"] = cfg.batch_size
    if cfg.image_size is not None:
        overrides["image_size"] = cfg.image_size
    return dataclasses.replace(loader_cfg, **overrides)


def steps_per_epoch(cfg: TrainConfig, loader: Any) -> int:
    """Optimizer steps per epoch of ``loader``; a DataError when it has fewer batches than one step needs."""
    n_batches = len(loader)
    steps = n_batches // cfg.accum_steps
    if steps < 1:
        raise DataError(f"{cfg.shards}: {n_batches} batch(es) per rank per epoch at batch size "
                        f"{loader.cfg.batch_size} is fewer than accum_steps={cfg.accum_steps}")
    return steps


def open_shards(shards: str | Path, loader_cfg: LoaderConfig, world: World, *, train: bool = True) -> Any:
    """Build the loader of ``shards`` for rank 0 of ``world`` (no workers start) and open every shard once:
    the checks that can be made before a run starts (manifest, shard files present and readable, enough
    samples for one batch per rank). Raises DataError (exit 2); returns the loader."""
    from gpufeed.loader import build_loader

    loader = build_loader(shards, dataclasses.replace(loader_cfg, num_workers=0), world, train=train)
    for path in loader.paths:
        try:
            with open(path, "rb"):
                pass
        except OSError as exc:
            raise DataError(f"shard {path} cannot be opened: {exc.strerror or exc}") from None
    return loader


def check_data(cfg: TrainConfig, loader_cfg: LoaderConfig, world_size: int) -> None:
    """What every rank of a ``world_size``-rank run would refuse before its first step, refused once before
    launch (DataError/ConfigError, exit 2): no shards for a data mode, an unreadable manifest, a missing or
    unreadable shard, too few samples for one step per rank."""
    if cfg.mode not in ("real", "loader-only", "measure"):
        return
    if not cfg.shards:
        raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
    lc = run_loader_config(cfg, loader_cfg)
    world = World(world_size=world_size)
    steps_per_epoch(cfg, open_shards(cfg.shards, lc, world))
    if cfg.val_shards and cfg.mode == "real":
        open_shards(cfg.val_shards, lc, world, train=False)


def _memory_bytes(world: World) -> int:
    if world.is_cuda:
        return int(torch.cuda.max_memory_allocated(torch.device(world.device)))
    import psutil

    return int(psutil.Process().memory_info().rss)


# --------------------------------------------------------------------------- the trainer


class Trainer:
    """Everything one rank holds: model (DDP, compiled), optimizer, schedule, scaler, loaders, meters."""

    def __init__(self, cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *,
                 run_dir: str | Path | None = None) -> None:
        import torchvision

        self.cfg, self.world = cfg, world
        self.run_dir = Path(run_dir) if run_dir else None
        self.device = torch.device(world.device)
        self.cuda = world.is_cuda
        self.clock: Clock = CudaClock(self.device) if self.cuda else HostClock()
        """Marks on the device timeline (see :mod:`gpufeed.timing`); read at log steps only."""
        self.notes: list[str] = []
        self.loader_cfg = run_loader_config(cfg, loader_cfg)
        self.batch_size = self.loader_cfg.batch_size
        self.image_size = self.loader_cfg.image_size
        self.accum = cfg.accum_steps
        self.num_nodes = world.num_nodes

        if self.cuda:
            torch.cuda.set_device(self.device)  # events, streams and NCCL use the current device
            torch.backends.cudnn.benchmark = True  # fixed input shapes: let cuDNN pick the fastest kernels
        if not self.cuda:
            from gpufeed.system import usable_cpus

            torch.set_num_threads(cfg.threads or max(1, usable_cpus() // world.local_world_size))
        elif cfg.threads:
            torch.set_num_threads(cfg.threads)

        self.needs_data = cfg.mode in ("real", "loader-only", "measure")
        self.manifest = None
        self.loader = None
        if self.needs_data:
            if not cfg.shards:
                raise ConfigError(f"mode {cfg.mode} needs --shards (only --synthetic runs without data)")
            from gpufeed.loader import build_loader

            self.loader = build_loader(cfg.shards, self.loader_cfg, world, train=True, epoch=0)
            self.manifest = self.loader.manifest
        self.num_classes = cfg.num_classes or (self.manifest.num_classes if self.manifest else 1000)
        self.val_loader = None
        if cfg.val_shards and cfg.mode == "real":
            from gpufeed.loader import build_loader

            # no persistent workers: they would sit idle (holding memory) through every training epoch
            val_cfg = dataclasses.replace(self.loader_cfg, persistent_workers=False)
            self.val_loader = build_loader(cfg.val_shards, val_cfg, world, train=False, epoch=0)

        # model
        random.seed(cfg.seed)
        torch.manual_seed(cfg.seed)
        import numpy as np

        np.random.seed(cfg.seed % 2**32)
        model = getattr(torchvision.models, cfg.arch)(weights=None, num_classes=self.num_classes,
                                                       zero_init_residual=True)
        model = model.to(self.device)
        if cfg.channels_last:
            model = model.to(memory_format=torch.channels_last)
        self.module = model
        self.ddp = None
        if world.is_distributed:
            from torch.nn.parallel import DistributedDataParallel as DDP

            self.ddp = DDP(model, device_ids=[self.device.index] if self.cuda else None,
                           gradient_as_bucket_view=True)
            model = self.ddp
        self.model = torch.compile(model) if cfg.compile else model

        decay, no_decay = [], []
        for p in self.module.parameters():
            (no_decay if p.ndim <= 1 else decay).append(p)
        self.optimizer = torch.optim.SGD(
            [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
            lr=cfg.lr, momentum=cfg.momentum)
        self.criterion = torch.nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
        dev_type = "cuda" if self.cuda else "cpu"
        self.amp, note = resolve_amp(cfg.amp, self.device)
        if note:
            self.notes.append(note)
        self.amp_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "off": None}[self.amp]
        self.autocast: Callable[[], Any] = (
            (lambda: torch.autocast(device_type=dev_type, dtype=self.amp_dtype)) if self.amp_dtype is not None
            else contextlib.nullcontext)
        self.scaler = torch.amp.GradScaler(dev_type, enabled=self.amp == "fp16")

        # schedule: total steps known once the loader length is
        if self.loader is not None:
            self.steps_per_epoch = steps_per_epoch(cfg, self.loader)
        else:
            self.steps_per_epoch = cfg.steps or cfg.measure_steps
        self.total_steps = cfg.steps or cfg.epochs * self.steps_per_epoch
        self.warmup_steps = cfg.warmup_steps if cfg.warmup_steps is not None else default_warmup(self.total_steps)
        self.scheduler = self._schedule(0)

        self.step = 0
        self.epoch = 0
        self.step_in_epoch = 0
        self.last_loss: torch.Tensor | None = None
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        """The LR the last optimizer step used."""
        self.start_step = 0
        self.started = False
        """True once this rank began reading data or computing: a failure after that is a RunError (exit 1)."""
        self.resume_rng: _RngState | None = None
        """This rank's RNG state from the checkpoint, applied once the loader is back at its position."""
        self._synthetic: tuple[torch.Tensor, torch.Tensor] | None = None
        self._progress = None

    # ---- batches
    def synthetic_batch(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._synthetic is None:
            g = torch.Generator().manual_seed(self.cfg.seed + 1)
            x = torch.randint(0, 256, (self.batch_size, 3, self.image_size, self.image_size), dtype=torch.uint8,
                              generator=g)
            y = torch.randint(0, self.num_classes, (self.batch_size,), generator=g)
            self._synthetic = (x.to(self.device), y.to(self.device))
        return self._synthetic

    def _cycle(self) -> Iterator[Any]:
        """Batches across epoch boundaries (measure mode)."""
        epoch = self.epoch
        while True:
            self.loader.set_epoch(epoch)
            yield from self.loader
            epoch += 1

    # ---- compute
    def forward_backward(self, x: torch.Tensor, y: torch.Tensor, *, last: bool) -> torch.Tensor:
        """One micro-batch: normalise on the device, forward under autocast, scaled backward.

        Gradients are synchronised across ranks on the last micro-batch only (DDP ``no_sync``)."""
        sync = contextlib.nullcontext() if (self.ddp is None or last) else self.ddp.no_sync()
        with sync:
            inputs = _normalize(x, dtype=torch.float32, channels_last=self.cfg.channels_last)
            with self.autocast():
                out = self.model(inputs)
                loss = self.criterion(out.float(), y) / self.accum
            self.scaler.scale(loss).backward()
        return loss.detach()

    def optimizer_step(self) -> None:
        self.step_lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)
        self.scaler.update()
        with warnings.catch_warnings():
            # fp16: GradScaler skips steps with inf/nan gradients; the schedule still follows the step count
            warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
            self.scheduler.step()

    def _to_device(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        return self.loader.to_device(batch, self.device, non_blocking=True)

    def train_step(self, source: str, it: Iterator[Any] | None) -> StepMarks:
        """One optimizer step over accum_steps micro-batches, marked for :func:`gpufeed.timing.resolve`.

        Nothing here waits for the device: the marks are read in bulk at log steps."""
        marks = StepMarks(self.clock).begin()
        self.optimizer.zero_grad(set_to_none=True)
        loss_sum = None
        for i in range(self.accum):
            if source == "synthetic":
                x, y = self.synthetic_batch()
            else:
                x, y = marks.fetch(it, self._to_device)
            last = i == self.accum - 1

            def work() -> torch.Tensor:
                loss = self.forward_backward(x, y, last=last)
                if last:
                    self.optimizer_step()
                return loss

            loss = marks.compute(work)
            loss_sum = loss if loss_sum is None else loss_sum + loss
        self.last_loss = loss_sum
        return marks.finish(self.batch_size * self.accum)

    def loader_step(self, it: Iterator[Any]) -> StepMarks:
        """Loader ceiling: fetch accum_steps batches, move them to the device, drop them.

        The copies are not waited for: the caching allocators keep the pinned host and the device buffers
        until the stream has used them."""
        marks = StepMarks(self.clock).begin()
        for _ in range(self.accum):
            marks.fetch(it, self._to_device)
        return marks.finish(self.batch_size * self.accum)

    # ---- collectives
    def gather(self, obj: Any) -> list[Any]:
        if not self.world.is_distributed:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world.world_size
        dist.all_gather_object(out, obj)
        return out

    def param_checksum(self) -> float:
        """Σ of every parameter in float64: equal on all ranks when DDP kept them in sync. (BatchNorm running
        statistics are not parameters: DDP re-broadcasts them from rank 0 at each forward.)"""
        with torch.no_grad():
            return float(sum(p.double().sum() for p in self.module.parameters()))

    # ---- validation
    @torch.no_grad()
    def validate(self) -> ValRecord:
        """Top-1/top-5 on every rank's (equal) share of the validation set, summed over ranks."""
        self.module.eval()
        stats = torch.zeros(4, dtype=torch.float64, device=self.device)  # loss sum, top1, top5, n
        k = min(5, self.num_classes)
        for batch in self.val_loader:
            x, y = self.val_loader.to_device(batch, self.device, non_blocking=True)
            inputs = _normalize(x, dtype=torch.float32, channels_last=self.cfg.channels_last)
            with self.autocast():
                out = self.module(inputs)
            out = out.float()
            stats[0] += torch.nn.functional.cross_entropy(out, y, reduction="sum").double()
            top = out.topk(k, dim=1).indices
            hit = top.eq(y[:, None])
            stats[1] += hit[:, :1].any(dim=1).sum()
            stats[2] += hit.any(dim=1).sum()
            stats[3] += y.numel()
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.all_reduce(stats)
        self.module.train()
        n = max(1.0, float(stats[3]))
        return ValRecord(epoch=self.epoch, step=self.step, num_samples=int(stats[3]), loss=float(stats[0]) / n,
                         top1_pct=100.0 * float(stats[1]) / n, top5_pct=100.0 * float(stats[2]) / n)

    # ---- checkpoints
    def checkpoint_path(self) -> Path | None:
        return Path(self.cfg.checkpoint_dir) / CHECKPOINT_NAME if self.cfg.checkpoint_dir else None

    def save_checkpoint(self) -> Path | None:
        """Collective (RNG states are gathered from every rank); rank 0 writes last.pt atomically.

        Only tensors and plain values (what :func:`read_checkpoint` loads with ``weights_only=True``); the LR
        scheduler is not saved: the schedule is a function of the step."""
        path = self.checkpoint_path()
        if path is None:
            return None
        rngs = self.gather(_rng_state(self.cuda))
        if self.world.is_main:
            state = {
                "format": CHECKPOINT_FORMAT, "version": CHECKPOINT_VERSION,
                "arch": self.cfg.arch, "num_classes": self.num_classes,
                "model": self.module.state_dict(),
                "optimizer": self.optimizer.state_dict(),
                "scaler": self.scaler.state_dict(),
                "step": self.step, "epoch": self.epoch, "step_in_epoch": self.step_in_epoch,
                "loader_position": {"epoch": self.epoch, "batches_consumed": self.step_in_epoch * self.accum,
                                    "method": "skip"},
                "rng": rngs, "world_size": self.world.world_size,
                "config": to_jsonable(self.cfg), "loader_config": to_jsonable(self.loader_cfg),
                "total_steps": self.total_steps,
            }
            _atomic_torch_save(state, path)
        if self.world.is_distributed:
            import torch.distributed as dist

            dist.barrier()
        return path

    def load_checkpoint(self) -> dict[str, Any] | None:
        """Load last.pt into the model, optimizer and scaler after checking that it belongs to this run
        (arch, classes, every tensor's shape); this rank's RNG state is kept for :meth:`run_real`.
        A checkpoint that does not match or cannot be read is a DataError naming the file."""
        path = self.checkpoint_path()
        if path is None or not path.exists():
            self.notes.append(f"resume: no checkpoint at {path}; starting from step 0")
            return None
        state = read_checkpoint(path)
        if state.get("arch") != self.cfg.arch:
            raise DataError(f"{path} was written for arch {_short(state.get('arch'))}, this run trains "
                            f"{self.cfg.arch!r}")
        if state.get("num_classes") != self.num_classes:
            raise DataError(f"{path} was written for {_short(state.get('num_classes'))} classes, this run has "
                            f"{self.num_classes}")
        step, epoch, step_in_epoch = (_count(state, k, path) for k in ("step", "epoch", "step_in_epoch"))
        ranks = _count(state, "world_size", path)
        rngs = state.get("rng")
        if not isinstance(rngs, list) or len(rngs) != ranks or not rngs:
            raise DataError(f"{path}: the RNG states are not one per rank of its {ranks}")
        if ranks != self.world.world_size:
            self.notes.append(f"resume: the checkpoint was written by {ranks} rank(s), this run has "
                              f"{self.world.world_size}: the data order differs from an uninterrupted run")
        rng = _RngState.parse(rngs[self.world.rank] if ranks == self.world.world_size else rngs[0], str(path))
        try:
            _check_like(state.get("model"), self.module.state_dict(), "model")
            self._check_optimizer_state(state.get("optimizer"))
            scaler = state.get("scaler")
            if self.scaler.is_enabled() and scaler:
                _check_like(scaler, self.scaler.state_dict(), "scaler")
            self.module.load_state_dict(state["model"])
            self.optimizer.load_state_dict(state["optimizer"])
            if self.scaler.is_enabled() and scaler:
                self.scaler.load_state_dict(scaler)
        except (ValueError, RuntimeError, KeyError, TypeError) as exc:
            raise DataError(f"{path} does not match this run: {one_line(exc)}") from None
        if self.scaler.is_enabled() and not scaler:
            self.notes.append("resume: the checkpoint has no fp16 loss scale; the GradScaler starts afresh")
        if state.get("total_steps") != self.total_steps:
            self.notes.append(f"resume: the checkpoint planned {_short(state.get('total_steps'))} steps, this "
                              f"run {self.total_steps}; the LR schedule follows this run")
        saved = state.get("loader_config") if isinstance(state.get("loader_config"), dict) else {}
        order = ("seed", "batch_size", "num_workers", "shuffle_buffer", "worker_batching", "image_size")
        changed = [k for k in order if k in saved and saved[k] != getattr(self.loader_cfg, k)]
        if changed:
            self.notes.append(f"resume: [loader] {', '.join(changed)} changed since the checkpoint: the rest of the "
                              f"epoch reads another sample order than an uninterrupted run")
        self.scheduler = self._schedule(step)
        self.step = self.start_step = step
        self.epoch = epoch
        self.step_in_epoch = step_in_epoch
        if self.step_in_epoch >= self.steps_per_epoch:
            self.epoch += 1
            self.step_in_epoch = 0
        self.resume_rng = rng
        return state

    def _schedule(self, step: int) -> torch.optim.lr_scheduler.LambdaLR:
        """The LR schedule (:func:`lr_at` of this run) positioned after ``step`` optimizer steps: it sets each
        parameter group's LR for the next step."""
        total, warm, peak, floor = self.total_steps, self.warmup_steps, self.cfg.lr, self.cfg.min_lr
        for group in self.optimizer.param_groups:
            group["initial_lr"] = peak
        return torch.optim.lr_scheduler.LambdaLR(
            self.optimizer,
            lambda s: lr_at(s, total=total, warmup=warm, peak=peak, floor=floor) / peak if peak else 0.0,
            last_epoch=step - 1)

    def _check_optimizer_state(self, saved: Any) -> None:
        """SGD's state dict: the same parameter groups (options of the same kinds), momentum buffers shaped
        like their parameters. Raises ValueError naming the first difference."""
        ours = self.optimizer.state_dict()
        if not isinstance(saved, dict) or set(saved) != {"state", "param_groups"}:
            raise ValueError("optimizer is not an SGD state dict")
        _check_like(saved["param_groups"], ours["param_groups"], "optimizer param_groups")
        for g, (a, b) in enumerate(zip(saved["param_groups"], ours["param_groups"])):
            if list(a["params"]) != list(b["params"]):
                raise ValueError(f"optimizer param_groups[{g}] holds other parameters")
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        if not isinstance(saved["state"], dict):
            raise ValueError("optimizer state is not a mapping")
        for k, v in saved["state"].items():
            if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < len(params):
                raise ValueError(f"optimizer state names the unknown parameter {_short(k)}")
            _check_like(v, {"momentum_buffer": params[k].detach()}, f"optimizer state[{k}]")

    # ---- logging
    def log(self, mode: str, marks: list[StepMarks], meter: _Meter) -> None:
        """The only place steps are read during a run: one sync, then the window's record (log.jsonl)."""
        if not marks:
            return
        window = resolve(self.clock, marks)
        meter.settle()
        step_s = sum(w[0] for w in window)
        wait = sum(w[1] + w[2] for w in window)
        samples = sum(w[4] for w in window)
        loss = float(self.last_loss) if self.last_loss is not None else None
        lr = self.step_lr
        rate = samples / step_s if step_s > 0 else 0.0
        if self._progress is not None:
            self._progress.set_postfix(loss=f"{loss:.3f}" if loss is not None else "-", sps=f"{rate * self.world.world_size:.0f}",
                                       stall=f"{100 * wait / step_s:.0f}%" if step_s else "-", refresh=False)
        if self.run_dir is None or not self.world.is_main:
            return
        append_jsonl(self.run_dir / LOG_NAME, {
            "time": utc_now(), "mode": mode, "step": self.step, "epoch": self.epoch, "rank": self.world.rank,
            "num_steps": len(window), "samples_per_s": rate, "samples_per_s_all_ranks_est": rate * self.world.world_size,
            "data_wait_s": wait, "next_wait_s": sum(w[1] for w in window), "h2d_s": sum(w[2] for w in window),
            "compute_s": sum(w[3] for w in window), "step_s": step_s,
            "stall_pct": 100.0 * wait / step_s if step_s > 0 else 0.0,
            "loss": loss, "lr": lr, "memory_bytes": _memory_bytes(self.world),
        })

    # ---- modes
    def run_mode(self, mode: str, num_steps: int) -> ModeRecord | None:
        """synthetic / loader-only / real (measure) for num_steps timed steps after the warm-up."""
        warm, num_steps = self.timing_window(mode, num_steps)
        meter = _Meter(warm, self.cfg.log_every, self.world, self.clock)
        n = warm + num_steps
        it = None if mode == "synthetic" else self._cycle()
        self.started = True
        self.module.train()
        window: list[StepMarks] = []
        progress = self._bar(n, 0, mode)
        try:
            for _ in range(n):
                meter.before_step()
                if mode == "loader-only":
                    t = self.loader_step(it)
                else:
                    t = self.train_step("synthetic" if mode == "synthetic" else "loader", it)
                    self.step += 1
                meter.add(t)
                window.append(t)
                if progress is not None:
                    progress.update(1)
                if len(window) >= self.cfg.log_every:
                    self.log(mode, window, meter)
                    window = []
            meter.stop()
            self.log(mode, window, meter)
        finally:
            if progress is not None:
                progress.close()
            self._progress = None
            del it
        return self._aggregate(mode, meter)

    def timing_window(self, mode: str, num_steps: int) -> tuple[int, int]:
        """(warm-up steps, timed steps). With W workers prefetching P batches each, the first ~W x P batches
        come from a backlog filled during start-up: timing them would overstate the loader and hide the stall.
        So the warm-up drains that backlog, and the window holds at least two batches per worker."""
        warm = self.cfg.timing_warmup_steps
        if mode == "synthetic" or self.loader is None:
            return warm, num_steps
        w = self.loader_cfg.num_workers
        backlog = w * self.loader_cfg.prefetch_factor if w > 0 else 0
        per_step = 1 if mode == "loader-only" else self.accum
        return max(warm, -(-backlog // per_step) + 1), max(num_steps, -(-2 * w // per_step))

    def _aggregate(self, mode: str, meter: _Meter) -> ModeRecord | None:
        timing = meter.finish()
        ranks = self.gather(timing)
        loss = float(self.last_loss) if (self.last_loss is not None and mode != "loader-only") else None
        return aggregate(mode, ranks, self.num_nodes, loss) if self.world.is_main else None

    def _bar(self, total: int, initial: int, desc: str) -> Any:
        if not (self.world.is_main and self.cfg.progress):
            return None
        from tqdm import tqdm

        self._progress = tqdm(total=total, initial=initial, desc=desc, unit="step", file=sys.stderr,
                              dynamic_ncols=True, leave=False)
        return self._progress

    def run_real(self, on_step: Callable[[int], None] | None = None) -> tuple[ModeRecord | None, list[ValRecord]]:
        """The training run: epochs or steps, validation at epoch ends, checkpoints, resume."""
        cfg = self.cfg
        if cfg.resume:
            self.load_checkpoint()
        self.started = True
        # time at least one step, however short the run
        warm = min(self.timing_window("real", 0)[0], max(0, self.total_steps - self.step - 1))
        meter = _Meter(warm, cfg.log_every, self.world, self.clock)
        vals: list[ValRecord] = []
        window: list[StepMarks] = []
        progress = self._bar(self.total_steps, self.step, "train")
        self.module.train()
        try:
            while self.step < self.total_steps:
                # after --resume the first epoch starts at the checkpoint's batch: the loader passes over the
                # batches already trained on without decoding them (LoaderPosition), no replay
                self.loader.set_epoch(self.epoch, start_batch=self.step_in_epoch * self.accum)
                it = iter(self.loader)
                if self.resume_rng is not None:
                    self.resume_rng.apply()
                    self.resume_rng = None
                while self.step_in_epoch < self.steps_per_epoch and self.step < self.total_steps:
                    meter.before_step()
                    t = self.train_step("loader", it)
                    self.step += 1
                    self.step_in_epoch += 1
                    meter.add(t)
                    window.append(t)
                    if progress is not None:
                        progress.update(1)
                    if len(window) >= cfg.log_every:
                        self.log("real", window, meter)
                        window = []
                    if cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0:
                        meter.pause()
                        self.save_checkpoint()
                        meter.resume()
                    if on_step is not None:
                        on_step(self.step)
                del it
                if self.step_in_epoch >= self.steps_per_epoch:  # epoch end
                    meter.pause()
                    if self.val_loader is not None:
                        vals.append(self.validate())
                    self.epoch += 1
                    self.step_in_epoch = 0
                    if cfg.checkpoint_dir and not (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                        self.save_checkpoint()
                    meter.resume()
            meter.stop()
            self.log("real", window, meter)
            if self.val_loader is not None and (not vals or vals[-1].step != self.step) and self.step_in_epoch:
                vals.append(self.validate())
            if cfg.checkpoint_dir and self.step_in_epoch and not (
                    cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                self.save_checkpoint()
        finally:
            if progress is not None:
                progress.close()
            self._progress = None
        return self._aggregate("real", meter), vals


# --------------------------------------------------------------------------- entry points


def _init_distributed(world: World) -> bool:
    """Join the process group torchrun set up the environment for; True when this call created it."""
    if not world.is_distributed:
        return False
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    if world.is_cuda:
        torch.cuda.set_device(torch.device(world.device))
    dist.init_process_group(backend=world.backend)
    return True


def verdict_inputs(modes: dict[str, ModeRecord], trainer: Trainer) -> VerdictInputs | None:
    real = modes.get("real")
    if real is None or real.num_steps == 0:
        return None
    synth, lonly = modes.get("synthetic"), modes.get("loader-only")
    from gpufeed.system import usable_cpus

    return VerdictInputs(
        stall_pct=real.stall_pct, end_to_end_rate=real.samples_per_s,
        gpu_ceiling=synth.samples_per_s if synth else None,
        loader_ceiling=lonly.samples_per_s if lonly else None,
        per_rank_stall_pct=tuple(r.stall_pct for r in real.per_rank),
        copy_wait_pct=real.copy_wait_pct,
        loader_cores_used=lonly.loader_cores_used if lonly else None,
        usable_cores=float(usable_cpus()), num_nodes=trainer.num_nodes,
        ranks_per_node=trainer.world.local_world_size,
        num_workers=trainer.loader_cfg.num_workers,
        read_bytes_per_s=(lonly or real).read_bytes_per_s,
        storage_bytes_per_s=trainer.cfg.storage_bytes_per_s,
        mean_sample_bytes=trainer.manifest.mean_sample_bytes if trainer.manifest else None,
        decode=trainer.loader_cfg.decode, is_cuda=trainer.cuda,
    )


def train(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World, *, run_dir: str | Path | None = None,
          on_step: Callable[[int], None] | None = None) -> TrainRecord | None:
    """Run one rank. Rank 0 returns the TrainRecord (and writes summary.json/report.md into run_dir);
    other ranks return None. ``on_step(step)`` is called after every real optimizer step (tests).

    A GpufeedError raised before the rank read data or computed (a bad shard set, a refused checkpoint)
    keeps its exit code 2; one raised after that (a corrupt shard met mid-epoch) becomes a RunError (exit 1)."""
    t0 = time.perf_counter()
    started = utc_now()
    if run_dir is not None and world.is_main:
        Path(run_dir).mkdir(parents=True, exist_ok=True)
    created = _init_distributed(world)
    trainer: Trainer | None = None
    try:
        trainer = Trainer(cfg, loader_cfg, world, run_dir=run_dir)
        modes: dict[str, ModeRecord] = {}
        vals: list[ValRecord] = []
        if cfg.mode == "measure":
            for mode in MODES_MEASURE:
                rec = trainer.run_mode(mode, cfg.measure_steps)
                if rec is not None:
                    modes[mode] = rec
        elif cfg.mode == "real":
            rec, vals = trainer.run_real(on_step)
            if rec is not None:
                modes["real"] = rec
        else:
            rec = trainer.run_mode(cfg.mode, cfg.steps or cfg.measure_steps)
            if rec is not None:
                modes[cfg.mode] = rec
        checksums = trainer.gather(trainer.param_checksum())
        if not world.is_main:
            return None
        vin = verdict_inputs(modes, trainer)
        verdict = classify(vin) if vin is not None else None
        lr = trainer.step_lr
        record = TrainRecord(
            mode=cfg.mode, arch=cfg.arch, device=world.device, backend=world.backend, world_size=world.world_size,
            num_nodes=trainer.num_nodes, amp=trainer.amp, batch_size=trainer.batch_size, accum_steps=trainer.accum,
            global_batch=trainer.batch_size * trainer.accum * world.world_size, image_size=trainer.image_size,
            num_classes=trainer.num_classes, start_step=trainer.start_step, step=trainer.step,
            total_steps=trainer.total_steps, epoch=trainer.epoch,
            final_loss=float(trainer.last_loss) if trainer.last_loss is not None else None, final_lr=lr,
            modes=modes, val=vals, verdict=verdict, ok=verdict.ok if verdict else True,
            num_skipped=int(getattr(trainer.loader, "num_skipped", 0) or 0) if trainer.loader is not None else 0,
            num_repeated=int(getattr(trainer.loader, "num_repeated", 0) or 0) if trainer.loader is not None else 0,
            checkpoint=str(trainer.checkpoint_path()) if trainer.checkpoint_path() else None,
            run_dir=str(run_dir) if run_dir else None, wall_s=time.perf_counter() - t0, started=started,
            notes=trainer.notes, rank_param_checksums=checksums,
        )
        if run_dir is not None:
            write_json(Path(run_dir) / SUMMARY_NAME, record)
            summary = to_jsonable(record)
            plot = plot_summary(Path(run_dir), summary)
            (Path(run_dir) / "report.md").write_text(render_markdown(summary, plot), encoding="utf-8")
        return record
    except GpufeedError as exc:
        if trainer is not None and trainer.started and not isinstance(exc, RunError):
            raise RunError(str(exc)) from exc
        raise
    finally:
        if created:
            import torch.distributed as dist

            dist.destroy_process_group()


def measure(cfg: TrainConfig, loader_cfg: LoaderConfig, world: World | None = None, steps_per_mode: int = 20,
            *, run_dir: str | Path | None = None) -> TrainRecord | None:
    """Compute ceiling, loader ceiling and real run in this process (scripts, benchmarks): the TrainRecord with
    ``modes`` {synthetic, loader-only, real} and the verdict. Rank 0 gets the record, other ranks None."""
    world = world or World.from_env(cfg.device)
    cfg = dataclasses.replace(cfg, mode="measure", measure_steps=steps_per_mode)
    return train(cfg, loader_cfg, world, run_dir=run_dir)


def needs_torchrun(cfg: TrainConfig) -> bool:
    return cfg.nproc_per_node > 1 or cfg.nnodes != "1"


TORCHRUN_FLAG = "--torchrun"
"""``python -m gpufeed.train --torchrun ARGS``: torchrun with ARGS, run by :func:`main` (see :func:`_torchrun`)."""
RANK_ERROR = "rank-{rank}.error"
"""A failed rank's one-sentence cause, written next to the run's config.toml (JSON)."""


def torchrun_command(cfg: TrainConfig, config_path: str | Path) -> list[str]:
    """``python -m gpufeed.train --torchrun [rendezvous] -m gpufeed.train CONFIG``."""
    cmd = [sys.executable, "-m", "gpufeed.train", TORCHRUN_FLAG, "--nproc-per-node", str(cfg.nproc_per_node),
           "--nnodes", cfg.nnodes]
    if cfg.rdzv_endpoint:
        cmd += ["--rdzv-backend", "c10d", "--rdzv-endpoint", cfg.rdzv_endpoint, "--rdzv-id", cfg.rdzv_id]
    elif cfg.master_addr:
        cmd += ["--node-rank", str(cfg.node_rank or 0), "--master-addr", cfg.master_addr,
                "--master-port", str(cfg.master_port or 29500)]
    elif cfg.nnodes == "1":
        cmd += ["--standalone"]
    else:
        raise ConfigError(f"nnodes={cfg.nnodes} needs --rdzv-endpoint HOST[:PORT] or --master-addr/--master-port")
    return cmd + ["-m", "gpufeed.train", str(config_path)]


def _min_world_size(cfg: TrainConfig) -> int:
    """Ranks of the smallest world ``nnodes`` (N or MIN:MAX) allows."""
    return max(1, int(cfg.nnodes.split(":")[0])) * max(1, cfg.nproc_per_node)


def launch(cfg: TrainConfig, loader_cfg: LoaderConfig) -> dict[str, Any]:
    """Check the data, create the run folder (resolved config, environment), run every rank, return
    summary.json as a dict.

    One process runs in-process; more go through torchrun, which re-enters :func:`main` in each rank.
    Errors: what every rank would refuse before starting is refused here (exit 2, see :func:`check_data`);
    when torchrun fails, the first rank's cause (from the ``rank-R.error`` files) is raised with that
    rank's exit code: 2 when it failed before its first step, else 1 (RunError)."""
    from gpufeed.system import environment_snapshot, usable_cpus

    check_data(cfg, loader_cfg, _min_world_size(cfg))
    run_dir = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("train")
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg = dataclasses.replace(cfg, run_dir=str(run_dir))
    config_path = run_dir / CONFIG_NAME
    config_path.write_text(
        to_toml("loader", loader_cfg, header="Resolved configuration of this run (gpufeed train).") + "\n"
        + to_toml("train", cfg), encoding="utf-8")
    write_json(run_dir / "environment.json", environment_snapshot())
    if not needs_torchrun(cfg):
        world = World.from_env(cfg.device)
        record = train(cfg, loader_cfg, world, run_dir=run_dir)
        return to_jsonable(record)
    env = dict(os.environ)
    if "OMP_NUM_THREADS" not in env:
        env["OMP_NUM_THREADS"] = str(cfg.threads or max(1, usable_cpus() // cfg.nproc_per_node))
    env.setdefault("PYTHONUNBUFFERED", "1")
    cmd = torchrun_command(cfg, config_path)
    for old in run_dir.glob(RANK_ERROR.format(rank="*")):  # a reused run folder: only this run's causes count
        old.unlink()
    # rank output goes to our stderr, so that stdout stays free for --json
    proc = subprocess.run(cmd, env=env, stdout=sys.__stderr__, stderr=sys.__stderr__)
    if proc.returncode != 0:
        raise rank_failure(run_dir, proc.returncode)
    summary = run_dir / SUMMARY_NAME
    if not summary.exists():
        which = f" (node rank {cfg.node_rank})" if cfg.node_rank is not None else ""
        return {"ok": True, "run_dir": str(run_dir),
                "notes": [f"this node{which} ran its ranks; the summary and verdict are in rank 0's run folder"]}
    import json

    return json.loads(summary.read_text(encoding="utf-8"))


def rank_failure(run_dir: Path, returncode: int) -> GpufeedError:
    """The error for a failed torchrun: the first cause the ranks wrote to ``run_dir/rank-R.error``.

    A GpufeedError in a rank is a cause; an unexpected exception is usually a consequence (a peer died
    under a collective), so it is reported only when no rank named a cause. Among causes, the earliest.
    The error keeps the rank's exit code: 2 (GpufeedError) when it failed before its first step, else 1."""
    import json

    reports = []
    for path in sorted(run_dir.glob(RANK_ERROR.format(rank="*")))[:4096]:
        try:
            with open(path, "rb") as f:
                r = json.loads(f.read(65536))
            reports.append((not r["cause"], float(r["time"]), int(r["rank"]), one_line(str(r["message"])),
                            int(r["exit_code"])))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a half-written or foreign file: the other ranks' reports still count
    if not reports:
        return RunError(f"torchrun exited with {returncode} and no rank reported a cause (killed by a signal or "
                        f"out of memory?); see the output above and {run_dir}")
    _, _, rank, message, code = min(reports)
    text = f"rank {rank}: {message}"
    return GpufeedError(text) if code == 2 else RunError(text)


def _verbose() -> bool:
    return os.environ.get("GPUFEED_VERBOSE", "") not in ("", "0")


def _rank_failed(report_dir: Path, rank: int, message: str, exit_code: int, *, cause: bool) -> int:
    """One sentence on stderr (a traceback first with GPUFEED_VERBOSE=1) and in ``rank-R.error``."""
    import json

    from gpufeed.records import atomic_write_bytes

    if _verbose():
        import traceback

        traceback.print_exc(file=sys.stderr)
    print(f"rank {rank}: {message}", file=sys.stderr, flush=True)
    report = {"rank": rank, "message": message, "exit_code": exit_code, "cause": cause, "time": time.time()}
    try:
        atomic_write_bytes(report_dir / RANK_ERROR.format(rank=rank), json.dumps(report).encode())
    except OSError:
        pass  # the sentence above is on stderr; the launcher falls back to the exit code
    return exit_code


def _torchrun(args: list[str]) -> int:
    """torchrun with ``args``, ending quietly when a rank fails: the ranks printed their one sentence, and
    the launcher repeats the first cause. torchrun's own logs and its ChildFailedError report are shown
    only with GPUFEED_VERBOSE=1."""
    import logging

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import parse_args, run

    verbose = _verbose()
    if not verbose:
        logging.disable(logging.ERROR)
    try:
        run(parse_args(args))
    except ChildFailedError:
        if verbose:
            import traceback

            traceback.print_exc(file=sys.stderr)
        return 1
    except Exception as exc:  # noqa: BLE001 - rendezvous and agent failures: one sentence
        if verbose:
            import traceback

            traceback.print_exc(file=sys.stderr)
        print(f"torchrun: {type(exc).__name__}: {one_line(exc)}", file=sys.stderr, flush=True)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Rank entry point under torchrun: ``python -m gpufeed.train RUN_DIR/config.toml``; with ``--torchrun``
    first, the launcher's torchrun (:func:`_torchrun`).

    A rank that fails prints ``rank R: <one sentence>`` and writes it to ``RUN_DIR/rank-R.error``; it exits
    with the error's exit code (2: failed before its first step, 1: after, or an unexpected exception)."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == [TORCHRUN_FLAG]:
        return _torchrun(argv[1:])
    if len(argv) != 1:
        print("usage: python -m gpufeed.train CONFIG.toml (normally started by gpufeed train)", file=sys.stderr)
        return 2
    rank = int(os.environ.get("RANK", "0"))
    report_dir = Path(argv[0]).parent
    try:
        conf = load_config(argv[0])
        world = World.from_env(conf.train.device)
        train(conf.train, conf.loader, world, run_dir=conf.train.run_dir)
    except GpufeedError as exc:
        return _rank_failed(report_dir, rank, one_line(exc), exc.exit_code, cause=True)
    except Exception as exc:  # noqa: BLE001 - a bug or a consequence (a peer died): one sentence
        return _rank_failed(report_dir, rank, f"unexpected {type(exc).__name__}: {one_line(exc)}", 1, cause=False)
    return 0  # rank 0 wrote summary.json; the launcher sets the exit code from it


# --------------------------------------------------------------------------- rendering


def _fmt_rate(m: dict[str, Any]) -> str:
    st = m.get("samples_per_s_stat")
    if st:
        return f"{m['samples_per_s']:.1f} (windows {st['min']:.1f}–{st['max']:.1f}, n={st['n']})"
    return f"{m['samples_per_s']:.1f}"


def render(s: dict[str, Any]) -> str:
    """Human summary of a summary.json dict; the verdict comes last."""
    if "mode" not in s:
        return "\n".join(s.get("notes", []))
    lines = [
        f"gpufeed train: {s['arch']} on {s['world_size']} x {s['device'].split(':')[0]} ({s['backend']}), "
        f"amp {s['amp']}, batch {s['batch_size']} x accum {s['accum_steps']} x {s['world_size']} ranks = "
        f"{s['global_batch']}, {s['image_size']} px, mode {s['mode']}",
    ]
    if s["mode"] == "real":
        lines.append(f"steps {s['start_step']}→{s['step']} of {s['total_steps']}, epoch {s['epoch']}, "
                     f"loss {s['final_loss'] if s['final_loss'] is None else round(s['final_loss'], 4)}, "
                     f"lr {s['final_lr']:.4g}")
    lines.append(f"{'mode':<12} {'steps':>5} {'samples/s':>34} {'stall %':>8} {'next s':>8} {'h2d s':>8} "
                 f"{'compute s':>9} {'cores':>6}")
    for name, m in s["modes"].items():
        cores = f"{m['loader_cores_used']:.1f}" if m.get("loader_cores_used") is not None else "-"
        stall = f"{m['stall_pct']:.1f}" if name != "loader-only" else "-"
        lines.append(f"{name:<12} {m['num_steps']:>5} {_fmt_rate(m):>34} {stall:>8} {m['next_wait_s']:>8.2f} "
                     f"{m['h2d_s']:>8.2f} {m['compute_s']:>9.2f} {cores:>6}")
        util = [r["gpu"].get("util_mean_pct") for r in m["per_rank"] if r.get("gpu")]
        util = [u for u in util if u is not None]
        if util:
            lines.append(f"  GPU utilisation %: " + ", ".join(f"{u:.0f}" for u in util))
        if len(m["per_rank"]) > 1 and name != "loader-only":
            lines.append("  per rank stall %: " + ", ".join(f"r{r['rank']} {r['stall_pct']:.1f}" for r in m["per_rank"]))
    ceilings = [f"{mode_role(k, _is_cuda(s))} {m['samples_per_s']:.1f} samples/s ({k})"
                for k, m in s["modes"].items() if k in ("synthetic", "loader-only")]
    if ceilings:
        lines.append("ceilings: " + ", ".join(ceilings))
    for v in s.get("val", []):
        lines.append(f"val epoch {v['epoch']} step {v['step']}: top-1 {v['top1_pct']:.2f}%  top-5 {v['top5_pct']:.2f}%  "
                     f"loss {v['loss']:.4f} ({v['num_samples']} samples)")
    if s.get("num_skipped"):
        lines.append(f"skipped samples: {s['num_skipped']} (corrupt, rank 0)")
    if s.get("num_repeated"):
        lines.append(f"repeated samples: {s['num_repeated']} (read twice to keep the ranks' batch counts equal, "
                     f"rank 0)")
    for n in s.get("notes", []):
        lines.append(f"note: {n}")
    if s.get("checkpoint"):
        lines.append(f"checkpoint: {s['checkpoint']}")
    if s.get("run_dir"):
        lines.append(f"run folder: {s['run_dir']}")
    v = s.get("verdict")
    if v:
        head = f"verdict: {v['status'].upper()}" + (f" ({v['bound']}-bound)" if v.get("bound") else "")
        lines.append(f"{head}: {v['reason']}")
        lines += [f"  fix: {f}" for f in v.get("fixes", [])]
    return "\n".join(lines)


def _is_cuda(s: dict[str, Any]) -> bool:
    return str(s.get("device", "")).split(":")[0] == "cuda"


MODE_ROLES = {"loader-only": "loader ceiling", "real": "end to end"}
"""What each mode's rate is (the synthetic mode's name depends on the device: :func:`compute_ceiling_name`)."""


def mode_role(mode: str, cuda: bool) -> str:
    return compute_ceiling_name(cuda) if mode == "synthetic" else MODE_ROLES.get(mode, mode)


LOG_SCALE_RATIO = 20.0
"""The chart's rate axis turns logarithmic when the largest rate exceeds the smallest by more than this."""


def chart_data(s: dict[str, Any]) -> dict[str, Any]:
    """What the training chart shows, from a summary.json dict: samples/s (all ranks) per mode with its role,
    whether the rate axis is logarithmic, and the data stall % per rank of the run that trained (``real``,
    else the one timed mode that computed)."""
    cuda = _is_cuda(s)
    modes = s.get("modes", {})
    rates = [(mode, mode_role(mode, cuda), float(m["samples_per_s"])) for mode, m in modes.items()]
    positive = [r for _, _, r in rates if r > 0]
    log = len(positive) >= 2 and max(positive) > LOG_SCALE_RATIO * min(positive)
    stall_mode = "real" if "real" in modes else next((k for k in modes if k != "loader-only"), None)
    stalls = [(int(r["rank"]), float(r["stall_pct"])) for r in modes[stall_mode]["per_rank"]] if stall_mode else []
    return {"rates": rates, "log_scale": log, "stall_mode": stall_mode, "stalls": stalls}


def plot_summary(run_dir: Path, s: dict[str, Any]) -> str | None:
    """throughput.png in ``run_dir``: samples/s per mode side by side (each value printed on its bar) and the
    data stall % per rank against the 5 % fed line; None when there is nothing to plot or it fails."""
    data = chart_data(s)
    if not data["rates"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = 2 if data["stalls"] else 1
        fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
        ax1 = axes[0][0]
        labels = [f"{mode}\n({role})" for mode, role, _ in data["rates"]]
        values = [r for _, _, r in data["rates"]]
        bars = ax1.bar(range(len(values)), values, color=[f"C{k}" for k in range(len(values))])
        ax1.set_xticks(range(len(values)), labels, fontsize=8)
        for bar, v in zip(bars, values):
            ax1.annotate(f"{v:,.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                         va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        if data["log_scale"]:
            ax1.set_yscale("log")
            ax1.set_ylabel("samples/s, all ranks (log scale)")
        else:
            ax1.set_ylabel("samples/s, all ranks")
        ax1.margins(y=0.15)
        ax1.set_title("rate per mode")
        if data["stalls"]:
            ax2 = axes[0][1]
            ranks = [r for r, _ in data["stalls"]]
            pct = [p for _, p in data["stalls"]]
            colors = ["tab:green" if p < STALL_FED_PCT else "tab:red" for p in pct]
            bars = ax2.bar(range(len(pct)), pct, color=colors)
            for bar, p in zip(bars, pct):
                ax2.annotate(f"{p:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                             va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
            ax2.axhline(STALL_FED_PCT, color="grey", linestyle="--", linewidth=1,
                        label=f"fed below {STALL_FED_PCT:g} %")
            ax2.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
            ax2.set_ylim(0, max(100.0 if max(pct) > 50 else 2 * STALL_FED_PCT, max(pct) * 1.15))
            ax2.set_ylabel(f"data stall % ({data['stall_mode']})")
            ax2.set_title("data stall per rank")
            ax2.legend(fontsize=8)
        v = s.get("verdict")
        if v:
            fig.suptitle(f"verdict: {v['status']}" + (f" ({v['bound']}-bound)" if v.get("bound") else ""),
                         fontsize=10)
        fig.tight_layout()
        fig.savefig(run_dir / "throughput.png", dpi=100)
        plt.close(fig)
        return "throughput.png"
    except Exception:  # a report without a chart beats a failed run
        return None


def render_markdown(s: dict[str, Any], plot: str | None = None) -> str:
    out = [f"# gpufeed train — {s['arch']}, {s['world_size']} x {s['device'].split(':')[0]}, mode {s['mode']}", "",
           f"Started {s['started']}, {s['wall_s']:.1f} s. amp {s['amp']}, batch {s['batch_size']} per rank x accum "
           f"{s['accum_steps']} (global {s['global_batch']}), {s['image_size']} px.", "",
           "| mode | steps | samples/s | median (min–max) | stall % | copy % | next s | h2d s | compute s | cores |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in s["modes"].items():
        st = m.get("samples_per_s_stat")
        med = f"{st['median']:.1f} ({st['min']:.1f}–{st['max']:.1f})" if st else "-"
        cores = f"{m['loader_cores_used']:.1f}" if m.get("loader_cores_used") is not None else "-"
        out.append(f"| {name} ({mode_role(name, _is_cuda(s))}) | {m['num_steps']} | {m['samples_per_s']:.1f} | {med} | {m['stall_pct']:.1f} | "
                   f"{m['copy_wait_pct']:.1f} | {m['next_wait_s']:.2f} | {m['h2d_s']:.2f} | {m['compute_s']:.2f} | {cores} |")
    for name, m in s["modes"].items():
        if len(m["per_rank"]) > 1:
            out += ["", f"Per rank ({name}):", "", "| rank | samples/s | stall % | cores |", "|---:|---:|---:|---:|"]
            for r in m["per_rank"]:
                c = f"{r['cores_used']:.1f}" if r.get("cores_used") is not None else "-"
                out.append(f"| {r['rank']} | {r['samples_per_s']:.1f} | {r['stall_pct']:.1f} | {c} |")
    if s.get("val"):
        out += ["", "| epoch | step | top-1 % | top-5 % | loss |", "|---:|---:|---:|---:|---:|"]
        out += [f"| {v['epoch']} | {v['step']} | {v['top1_pct']:.2f} | {v['top5_pct']:.2f} | {v['loss']:.4f} |"
                for v in s["val"]]
    v = s.get("verdict")
    if v:
        out += ["", f"**Verdict: {v['status']}**" + (f" ({v['bound']}-bound)" if v.get("bound") else "") +
                f": {v['reason']}"]
        out += [f"- {f}" for f in v.get("fixes", [])]
    if plot:
        out += ["", f"![samples/s per mode and data stall per rank]({plot})"]
    return "\n".join(out) + "\n"


if __name__ == "__main__":
    sys.exit(main())
