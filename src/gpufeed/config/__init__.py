"""Typed configuration: one frozen dataclass per job, one TOML section per dataclass.

Precedence is CLI > file > defaults. Unknown sections and keys are errors, and every value is
type-checked against the field's annotation before the dataclass' own ``__post_init__`` checks run. Every
numeric field declares its range (``bounded``, limits ``MAX_*`` below), checked however the dataclass is built.
A config file is read only up to ``MAX_CONFIG_BYTES`` and must be UTF-8.

The docstring under each field is also that option's ``gpufeed CMD --help`` text (``field_help`` adds the
default and range); an optional field's docstring ends with "None = ..." saying what None means.

This module must stay free of torch imports: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import math
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpufeed.core.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]{1,3})?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pib": 1024**5, "pi": 1024**5,
}


def parse_size(value: int | float | str) -> int:
    """Parse a byte size such as ``1GB``, ``512MiB``, ``1.5e9`` or ``4096`` into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"a size must be a finite number, got {value!r}")
        if value < 0:
            raise ConfigError(f"a size must be >= 0, got {_show(value)}")
        return int(value)
    text = str(value)
    if len(text) > _MAX_SIZE_TEXT:
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got a {len(text)}-character string")
    m = _SIZE_RE.match(text)
    if not m or m.group(2) is None and not m.group(1):
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got {value!r}")
    unit = (m.group(2) or "").lower()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown size unit in {value!r} (use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)")
    size = float(m.group(1)) * _SIZE_UNITS[unit]
    if not math.isfinite(size):
        raise ConfigError(f"a size must be a finite number, got {value!r}")
    return int(size)


_MAX_SIZE_TEXT = 64
"""Longest size string parsed (``"1.5GiB"`` needs a few characters); longer text is refused unread."""


# --------------------------------------------------------------------------- limits
# Every numeric field declares its range next to it (``bounded``); ``check_bounds`` enforces all of them, so a
# value from a file or the command line can never reach a DataLoader, an allocation or a loop unchecked.

MAX_CONFIG_BYTES = 1 << 20
"""Largest config file read (1 MiB): real ones are a few KiB; a larger file is refused before it is parsed."""
MAX_SEED = 2**63 - 1
"""Seeds are 0..2**63-1: every consumer (random, numpy after ``% 2**32``, torch.manual_seed) takes them."""
MAX_WORKERS = 1024
"""Worker processes / threads per rank or job: above the CPU count of any single machine sold today."""
MAX_BATCH_SIZE = 65_536
"""Samples per batch: 64 Ki 224-px images are already ~10 GB of uint8 per batch."""
MAX_PREFETCH_FACTOR = 64
"""Batches prefetched per DataLoader worker; beyond a few, prefetching only costs RAM."""
MAX_REMOTE_STREAMS = 64
"""Range requests in flight per worker on a remote shard (each of at least 1 MiB)."""
MAX_SHUFFLE_BUFFER = 10_000_000
"""Samples held in the shuffle buffer: 10 M encoded ImageNet samples are ~1 TB of RAM."""
MAX_IMAGE_SIZE = 8192
"""Loader/training output side in pixels: an 8192^2 RGB sample is 200 MB."""
MAX_IMAGE_SIDE = 65_535
"""``shard --max-size`` long side: the largest side a JPEG can have."""
MAX_PIXELS_LIMIT = 2**31
"""Largest decompression-bomb limit (``max_pixels``) accepted: 2 Gpx, 6 GB as RGB; Pillow's default is 89 Mpx."""
MAX_SHARD_SAMPLES = 10_000_000
"""Target samples per shard."""
MAX_SHARD_BYTES = 2**40
"""Target bytes per shard (1 TiB)."""
MAX_MULTIPLE_OF = 65_536
"""Shard-count multiple (ranks x workers)."""
MAX_RAM_BYTES = 2**50
"""``tune --ram-budget`` (1 PiB)."""
MAX_DURATION_S = 7 * 24 * 3600.0
"""Wall-clock budgets in seconds: one week."""
MAX_WINDOW_S = 3600.0
"""One measurement window in seconds."""
MAX_RATE = 1e9
"""Samples/s targets: a billion samples a second is beyond any loader."""
MAX_REPEATS = 1000
"""Measurement windows per trial."""
MAX_WARMUP_BATCHES = 100_000
"""Batches read and discarded before measuring."""
MAX_MIN_GAIN = 10.0
"""``tune`` min_gain: a knob must win by at most 1000%."""
MAX_TARGET_MARGIN = 100.0
"""``tune`` target_margin (a factor)."""
MAX_CLASSES = 1_000_000
"""Classifier outputs / synth class folders (ImageNet-21k has 21,841)."""
MAX_EPOCHS = 100_000
"""Training epochs."""
MAX_STEPS = 10**9
"""Optimizer steps, warm-up steps, checkpoint and log intervals."""
MAX_ACCUM_STEPS = 65_536
"""Micro-batches accumulated per optimizer step."""
MAX_LR = 100.0
"""Learning rates (SGD diverges long before)."""
MAX_MEASURE_STEPS = 1_000_000
"""Timed / untimed steps per mode of ``train --mode measure``."""
MAX_STORAGE_BYTES_PER_S = 1e15
"""Measured storage read rate (1 PB/s)."""
MAX_NPROC_PER_NODE = 1024
"""Processes (GPUs) per node."""
MAX_NODES = 65_536
"""Nodes of a job (node_rank < this)."""
MAX_SYNTH_IMAGES = 10_000_000
"""Images ``gpufeed synth`` writes."""
MAX_IO_READERS = 256
"""``gpufeed io`` parallel readers: each holds an 8 MiB buffer, so 256 readers hold 2 GiB."""
MAX_IO_FILES = 10_000_000
"""Files ``gpufeed io`` lists in an image folder (ImageNet-21k has 14 M; a sample of 10 M is plenty)."""


def bounded(default: Any, lo: float, hi: float, *, min_open: bool = False, max_open: bool = False,
            size: bool = False) -> Any:
    """A numeric field with its range: ``lo <= value <= hi`` (``min_open``/``max_open``: strict), checked by
    ``check_bounds``; None (where the type allows it) means "not set". ``size`` fields also accept strings such
    as ``1GB`` in files and on the CLI."""
    return field(default=default, metadata={"min": lo, "max": hi, "min_open": min_open, "max_open": max_open,
                                            "size": size})


def check_bounds(cfg: Any) -> None:
    """Refuse any numeric field outside its declared range (and NaN/inf): one sentence naming key and bound."""
    for f in dataclasses.fields(cfg):
        if "max" not in f.metadata:
            continue
        value = getattr(cfg, f.name)
        if value is None:
            continue
        lo, hi = f.metadata["min"], f.metadata["max"]
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{f.name} must be a finite number, got {value!r}")
        if value < lo or (f.metadata["min_open"] and value == lo):
            raise ConfigError(f"{f.name} must be {'>' if f.metadata['min_open'] else '>='} {lo}, got {_show(value)}")
        if value > hi or (f.metadata["max_open"] and value == hi):
            raise ConfigError(f"{f.name} must be {'<' if f.metadata['max_open'] else '<='} {hi}, got {_show(value)}")


def _show(value: Any) -> str:
    """A value for a one-sentence message: huge integers by their size (printing one can take seconds, or fail),
    long text cut short."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"


# --------------------------------------------------------------------------- job configs


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """``gpufeed shard SRC DEST``: image folder -> WebDataset shards + manifest."""

    src: str | None = None
    """Input image folder in ImageFolder layout (one sub-folder per class)."""
    dest: str | None = None
    """Output folder for the shard set (NVMe or a RAM disk)."""
    workers: int | None = bounded(None, 1, MAX_WORKERS)
    """Worker processes; None = the CPUs this process may use (affinity and cgroup aware)."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed of the sample shuffle that spreads classes over shards."""
    shard_samples: int = bounded(10_000, 1, MAX_SHARD_SAMPLES)
    """Target samples per shard (the plan takes whichever of samples/bytes gives more shards)."""
    shard_bytes: int = bounded(1_000_000_000, 1, MAX_SHARD_BYTES, size=True)
    """Target bytes per shard (bytes or a size such as 1GB, 512MiB)."""
    multiple_of: int = bounded(1, 1, MAX_MULTIPLE_OF)
    """Round the shard count up to a multiple of this (set it to ranks x workers)."""
    prefix: str = "train"
    """Shard file prefix: train, val, ..."""
    max_size: int | None = bounded(None, 8, MAX_IMAGE_SIDE)
    """Re-encode: resize the long side down to this many pixels (never up)."""
    quality: int | None = bounded(None, 1, 95)
    """Re-encode every image as JPEG of this quality."""
    check: Literal["full", "header"] = "full"
    """full = decode every image; header = read headers only (faster, catches less)."""
    strict: bool = False
    """Exit 1 if any input was rejected."""
    overwrite: bool = False
    """Replace an existing shard set at DEST whose plan differs."""
    allow_empty_classes: bool = False
    """Keep empty class folders as classes (with a warning) instead of refusing the input."""
    max_pixels: int = bounded(89_478_485, 1, MAX_PIXELS_LIMIT)
    """Decompression-bomb limit in pixels (Pillow's default); larger images are rejected."""
    classes_like: Literal["gpufeed", "imagefolder"] = "gpufeed"
    """Class folders: gpufeed = skip hidden folders (.ipynb_checkpoints) and hidden files; imagefolder = exactly
    torchvision's ImageFolder (every folder in SRC, hidden included, and hidden files in class folders)."""
    classes_file: str | None = None
    """Class names in label order, one per line, each a folder of SRC (others are ignored); default: the folders'
    sorted names."""
    engine: Literal["local", "ray"] = "local"
    """Where validation and writing run: local = this machine's worker processes; ray = Ray tasks (the gpufeed[ray]
    extra) on the cluster at ray_address, else a local Ray instance. The output bytes are the same."""
    ray_address: str | None = None
    """The Ray cluster to join with engine = ray (HOST:6379, ray://HOST:10001); None = RAY_ADDRESS, else a local one."""
    num_nodes: int | None = bounded(None, 1, MAX_NODES)
    """Static split over this many nodes sharing DEST: this node writes shards i with i % num_nodes == node_rank; the
    last to finish writes the index and manifest. None = no split."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank in the static split; None = SLURM_ARRAY_TASK_ID, JOB_COMPLETION_INDEX, GROUP_RANK or
    SLURM_NODEID."""
    finish: bool = False
    """Only finish DEST (gpufeed shard DEST --finish): once every shard is complete, write the index and manifest."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.node_rank is not None and self.num_nodes is not None and self.node_rank >= self.num_nodes:
            raise ConfigError(f"node_rank ({self.node_rank}) must be below num_nodes ({self.num_nodes})")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.prefix):
            raise ConfigError(f"prefix must use letters, digits, '_' or '-' only, got {self.prefix!r}")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """The DataLoader over a shard set, shared by ``tune`` and ``train``. ``tune`` writes this section."""

    batch_size: int = bounded(256, 1, MAX_BATCH_SIZE)
    """Samples per batch (per rank)."""
    num_workers: int = bounded(4, 0, MAX_WORKERS)
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host batches (only meaningful with CUDA; ignored on CPU)."""
    prefetch_factor: int = bounded(2, 1, MAX_PREFETCH_FACTOR)
    """Batches prefetched per worker (ignored when num_workers == 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs (ignored when num_workers == 0)."""
    worker_batching: bool = True
    """Collate batches inside the workers (one IPC message per batch instead of per sample)."""
    shuffle_buffer: int = bounded(2_000, 0, MAX_SHUFFLE_BUFFER)
    """Samples in the seeded shuffle buffer (0 = no shuffle)."""
    decode: Literal["pil", "pil-draft", "simplejpeg", "gpu"] = "simplejpeg"
    """Decode path: PIL full, PIL reduced-size draft, simplejpeg (libjpeg-turbo) or GPU nvjpeg."""
    image_size: int = bounded(224, 1, MAX_IMAGE_SIZE)
    """Output side in pixels."""
    on_error: Literal["raise", "skip"] = "raise"
    """Corrupt sample policy: raise, or skip and count it."""
    check: Literal["keys", "sha256"] = "keys"
    """What the loader compares with the manifest as it reads each shard, besides the sample count: keys = each
    local shard's size before it is read (and that it does not change while read) and the digest of its key
    sequence (keys_sha256) at its end, at no extra cost; sha256 = also the whole file's sha256 the first time a
    worker reads the shard to its end (the shard is then streamed whole: it reads the bytes a worker's range
    skips, and costs hashing). A mismatch is a refusal or, with on_error = skip, the shard's samples counted."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed for shard order, shuffle buffer and random crops."""
    crop_ratio: float = bounded(0.875, 0.0, 1.0, min_open=True)
    """Eval transform: resize the shorter side to image_size / crop_ratio, then centre-crop image_size."""
    resize: Literal["torch", "pil"] = "torch"
    """Crop+resize kernel (uint8, antialiased bilinear): torch's SIMD kernel (fast) or PIL resize(box=...)."""
    max_pixels: int = bounded(89_478_485, 1, MAX_PIXELS_LIMIT)
    """Decompression-bomb limit (width x height, from the image header) for a stored image, as in ``shard``: a
    larger image is refused before it is decoded (the loader treats it as a corrupt sample, per on_error)."""
    remote_streams: int = bounded(4, 1, MAX_REMOTE_STREAMS)
    """Range requests each worker keeps in flight on a remote (http, https, s3, gs) shard, each on its own
    connection: more hide a slow first byte and add up per-connection throttles. Each asks for 8 MiB / remote_streams
    (at least 1 MiB), so a worker holds about 8 MiB in flight plus the range it reads (more above 8 streams:
    remote_streams x 1 MiB). Ignored for local shards and pipe: commands; tune searches it for a remote set."""
    shard_split: Literal["global", "node"] = "global"
    """How an epoch's shards are split: global = every rank takes a range of all shards in a seeded per-epoch order
    (every node reads every shard over the epochs); node = node n of N reads only the shards i with i % N == n, the
    ones ``gpufeed stage --num-nodes N --node-rank n`` copies (required for a set staged per node)."""

    def __post_init__(self) -> None:
        check_bounds(self)


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """``gpufeed tune SHARDS``: a measured, budget-aware sweep of LoaderConfig knobs."""

    shards: str | None = None
    """The shard set to read: a folder, manifest.json, URL (http, https, s3, gs) or brace pattern."""
    manifest: str | None = None
    """The set's manifest.json (a path or URL) when ``shards`` is a brace pattern or ``pipe:`` command (e.g. from
    ``gpufeed index PATTERN --out DIR``); None = the manifest next to ``shards``."""
    budget_s: float = bounded(300.0, 0.0, MAX_DURATION_S, min_open=True)
    """Wall-clock budget of the whole sweep in seconds."""
    batch_size: int | None = bounded(None, 1, MAX_BATCH_SIZE)
    """Batch size used in every trial; None = the [loader] batch_size."""
    max_workers: int | None = bounded(None, 0, MAX_WORKERS)
    """Largest num_workers per rank tried; None = the loaders' share of the usable CPUs (x cpu_budget, less
    trainer_cores per rank) split over the ranks, rounded down."""
    cpu_budget: float = bounded(1.0, 0.0, 1.0, min_open=True)
    """Fraction of the usable CPUs the loader may use (as tf.data AUTOTUNE's cpu_budget)."""
    ram_budget: int | None = bounded(None, 1, MAX_RAM_BYTES, size=True)
    """RAM the loader processes may use (bytes or '8GB'); None = half of the machine's RAM."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s the node's GPUs need together (GPUs x one GPU's ceiling); the search stops once the ranks'
    aggregate beats it with margin."""
    baseline_imagefolder: str | None = None
    """An ImageFolder of the same images: measure torchvision ImageFolder + DataLoader as baseline."""
    out: str | None = None
    """Where to write the winning [loader] section (TOML)."""
    image_size: int | None = bounded(None, 1, MAX_IMAGE_SIZE)
    """Output side in pixels, as in training; None = the [loader] image_size."""
    run_dir: str | None = None
    """Run folder for trials, chart and summary; None = runs/tune-<UTC timestamp>/."""
    repeats: int = bounded(3, 1, MAX_REPEATS)
    """Measurement windows per trial (median and spread are reported)."""
    window_s: float | None = bounded(None, 0.0, MAX_WINDOW_S, min_open=True)
    """Seconds per measurement window; None = sized from the budget (0.3-10 s)."""
    warmup_batches: int = bounded(2, 0, MAX_WARMUP_BATCHES)
    """Batches read and discarded after start-up before measuring (start-up is reported separately)."""
    min_gain: float = bounded(0.05, 0.0, MAX_MIN_GAIN)
    """A knob change must win by this fraction to be kept; the worker climb stops below it."""
    target_margin: float = bounded(1.2, 1.0, MAX_TARGET_MARGIN)
    """Stop once the best rate >= target_rate x this margin."""
    device: str = "auto"
    """Where batches are moved: auto (CUDA when present), cpu, cuda or cuda:N."""
    nproc_per_node: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """Training processes (GPUs) per node to tune for: that many rank loaders run at once, each on its own slice;
    None = the [train] nproc_per_node."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores left to each training process, kept out of its loader's worker budget."""
    storage_probe_s: float = bounded(3.0, 0.0, MAX_WINDOW_S)
    """Seconds spent probing the shard set's read rate before the trials (gpufeed io's reader ladder, cold where
    measurable), so the bound line can say whether the loader reads at the storage's limit; 0 = no probe."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)


@dataclass(frozen=True, kw_only=True)
class LayoutConfig:
    """The node layout a [loader] section was tuned for: ``gpufeed tune`` writes it next to [loader] and
    ``gpufeed train`` warns when it runs a different one."""

    ranks_per_node: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """Rank loaders measured at once on the node; None = no tuned layout recorded."""
    usable_cores: int | None = bounded(None, 1, MAX_WORKERS)
    """CPUs the tuning process could use (affinity and cgroup aware); None = not recorded."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores left to each training process, kept out of its loader's worker budget."""
    device: Literal["cpu", "cuda"] | None = None
    """Device type the batches went to; None = not recorded."""

    def __post_init__(self) -> None:
        check_bounds(self)


def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, else a ConfigError."""
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d{1,4}", device):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device[:40]!r}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """``gpufeed train``: AMP + DDP ResNet training that measures data stall."""

    shards: str | None = None
    """Training shard set: a folder, manifest.json, URL (http, https, s3, gs) or brace pattern."""
    manifest: str | None = None
    """The training set's manifest.json (a path or URL) when ``shards`` is a brace pattern or ``pipe:`` command
    (e.g. from ``gpufeed index PATTERN --out DIR``); None = the manifest next to ``shards``."""
    val_shards: str | None = None
    """Validation shard set (top-1/top-5 at the end of each epoch)."""
    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50"
    """torchvision ResNet architecture."""
    num_classes: int | None = bounded(None, 1, MAX_CLASSES)
    """Classifier outputs; None = the training set's class count (1000 with --synthetic and no shards)."""
    epochs: int = bounded(1, 1, MAX_EPOCHS)
    """Epochs to train (ignored when steps is set)."""
    steps: int | None = bounded(None, 1, MAX_STEPS)
    """Optimizer steps to train; overrides epochs."""
    batch_size: int | None = bounded(None, 1, MAX_BATCH_SIZE)
    """Samples per micro-batch per rank (per GPU); None = the [loader] batch_size."""
    accum_steps: int = bounded(1, 1, MAX_ACCUM_STEPS)
    """Micro-batches accumulated per optimizer step (DDP syncs gradients on the last one only)."""
    image_size: int | None = bounded(None, 1, MAX_IMAGE_SIZE)
    """Training image side in pixels; None = the [loader] image_size."""
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    """Autocast dtype (fp16 uses a GradScaler); auto = bf16 on CUDA devices with native bf16 (compute capability
    8.0+), fp16 on older ones, off on the CPU (bf16 autocast is emulated, and many times slower than float32, on
    CPUs without native bf16 instructions; ask for bf16 explicitly on one that has them)."""
    channels_last: bool = False
    """Use the channels_last memory format (faster convolutions on tensor-core GPUs)."""
    compile: bool = False
    """torch.compile the model."""
    lr: float = bounded(0.1, 0.0, MAX_LR)
    """Peak learning rate (SGD); reached after the warm-up, then cosine decay."""
    warmup_steps: int | None = bounded(None, 0, MAX_STEPS)
    """Linear LR warm-up in optimizer steps; None = 5% of the run (at most 2000 steps)."""
    min_lr: float = bounded(0.0, 0.0, MAX_LR)
    """Learning rate at the end of the cosine decay."""
    momentum: float = bounded(0.9, 0.0, 1.0)
    """SGD momentum (Nesterov off)."""
    weight_decay: float = bounded(1e-4, 0.0, 1.0)
    """SGD weight decay (not applied to BatchNorm and bias parameters)."""
    label_smoothing: float = bounded(0.1, 0.0, 1.0, max_open=True)
    """Cross-entropy label smoothing."""
    checkpoint_dir: str | None = None
    """Folder for atomic checkpoints (last.pt); None = no checkpoints."""
    checkpoint_every: int = bounded(0, 0, MAX_STEPS)
    """Checkpoint every N optimizer steps (0 = at epoch ends and at the end of the run only)."""
    resume: bool = False
    """Continue from checkpoint_dir/last.pt (same step, LR, optimizer and loader position)."""
    resume_other_set: bool = False
    """With resume: accept a checkpoint written for another shard set (its identity is recorded in it): keep its
    step, weights and LR, and read its epoch of this set from the beginning. Without it such a resume is refused."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Seed for model init and data order."""
    mode: Literal["real", "synthetic", "loader-only", "measure"] = "real"
    """real = train; synthetic = fixed batch on the device (GPU ceiling); loader-only = loader alone (loader
    ceiling); measure = synthetic, loader-only and real, briefly, in that order, then the verdict."""
    measure_steps: int = bounded(20, 1, MAX_MEASURE_STEPS)
    """Timed steps per mode with mode = measure."""
    timing_warmup_steps: int = bounded(3, 0, MAX_MEASURE_STEPS)
    """Steps at the start of each mode left out of the timing (start-up, cudnn autotune, compile)."""
    log_every: int = bounded(10, 1, MAX_STEPS)
    """Optimizer steps per JSONL log record."""
    device: str = "auto"
    """auto (CUDA when present), cpu, cuda or cuda:N; under torchrun each rank takes cuda:LOCAL_RANK."""
    threads: int | None = bounded(None, 1, MAX_WORKERS)
    """torch CPU threads per rank; None = usable CPUs / processes on this node."""
    storage_bytes_per_s: float | None = bounded(None, 0.0, MAX_STORAGE_BYTES_PER_S, min_open=True)
    """Measured read rate of the shard storage in bytes/s (e.g. with fio); lets the verdict call a storage bound.
    Given, it replaces the probe (storage_probe_s) and storage_record."""
    storage_record: str | None = None
    """A ``gpufeed io`` summary.json that measured the shard set's folder: its best rate is the storage rate
    (instead of the probe); None = not used."""
    storage_probe_s: float = bounded(3.0, 0.0, MAX_WINDOW_S)
    """Seconds ``--measure`` spends probing the shard set's read rate (gpufeed io's reader ladder, cold where
    measurable) before the modes, unless storage_bytes_per_s or storage_record is given; 0 = no probe."""
    nproc_per_node: int = bounded(1, 1, MAX_NPROC_PER_NODE)
    """Processes (GPUs) per node; > 1 or nnodes > 1 launches through torchrun."""
    nnodes: str = "1"
    """Nodes (torchrun syntax: N or MIN:MAX)."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank for static rendezvous (with master_addr); None = 0."""
    master_addr: str | None = None
    """Static rendezvous host (rank 0's node)."""
    master_port: int | None = bounded(None, 1, 65535)
    """Static rendezvous port; None = 29500."""
    rdzv_endpoint: str | None = None
    """c10d rendezvous endpoint HOST[:PORT] (instead of master_addr/master_port)."""
    rdzv_id: str = "gpufeed"
    """Rendezvous job id (same on all nodes)."""
    run_dir: str | None = None
    """Run folder; None = runs/train-<UTC timestamp>/."""
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)
        if not re.fullmatch(r"\d+(:\d+)?", self.nnodes):
            raise ConfigError(f"nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (the folder holding last.pt)")
        if self.storage_bytes_per_s is not None and self.storage_record is not None:
            raise ConfigError("give storage_bytes_per_s (--storage-rate) or storage_record, not both")


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """``gpufeed synth DEST``: a small ImageNet-like ImageFolder of JPEGs for demos, tests and benchmarks."""

    dest: str | None = None
    """Output folder; class sub-folders n0000, n0001, ... are created in it."""
    images: int = bounded(1_000, 1, MAX_SYNTH_IMAGES)
    """Images to write in all (spread evenly over the classes)."""
    classes: int = bounded(10, 1, MAX_CLASSES)
    """Class folders."""
    seed: int = bounded(0, 0, MAX_SEED)
    """Same seed => byte-identical files (with the same Pillow/libjpeg build), whatever the workers."""
    workers: int | None = bounded(None, 1, MAX_WORKERS)
    """Worker processes (the output does not depend on them); None = the CPUs this process may use."""
    overwrite: bool = False
    """Replace an earlier synth folder at DEST (folders holding other files are refused)."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.classes > self.images:
            raise ConfigError(f"classes ({self.classes}) must not exceed images ({self.images}): "
                              "every class folder needs at least one image")


@dataclass(frozen=True, kw_only=True)
class IoConfig:
    """``gpufeed io PATH [PATH ...]``: read rates of shard sets and image folders, cold and warm, per reader count."""

    seconds: float = bounded(3.0, 0.0, MAX_WINDOW_S, min_open=True)
    """Wall-clock bound of one measurement step (one reader count, cold or warm) in seconds."""
    bytes: int = bounded(2_000_000_000, 1, MAX_RAM_BYTES, size=True)
    """Bytes one step may read at most (bytes or a size such as 2GB, 512MiB)."""
    max_readers: int | None = bounded(None, 1, MAX_IO_READERS)
    """Largest reader count of the ladder 1, 2, 4, ...; None = min(16, 4 x the CPUs this process may use)."""
    max_files: int = bounded(100_000, 1, MAX_IO_FILES)
    """Files listed at most in an image folder (the walk stops there and says so)."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s the GPUs need; with it, each location gets the bandwidth needed and a verdict; None = no need
    line unless gpu_ceiling is given."""
    gpu_ceiling: str | None = None
    """A summary.json of a previous train --measure run: its synthetic samples/s is the target rate; None = not
    used."""
    run_dir: str | None = None
    """Run folder; None = runs/io-<UTC timestamp>/."""

    def __post_init__(self) -> None:
        check_bounds(self)
        if self.target_rate is not None and self.gpu_ceiling is not None:
            raise ConfigError("give target_rate or gpu_ceiling, not both")


@dataclass(frozen=True, kw_only=True)
class StageConfig:
    """``gpufeed stage SRC DEST``: copy a shard set to local NVMe or a RAM disk, checked, resumable."""

    src: str | None = None
    """The shard set to copy: a shard-set folder or its manifest.json."""
    dest: str | None = None
    """Local folder the set is staged into (its manifest is written there)."""
    jobs: int | None = bounded(None, 1, MAX_WORKERS)
    """Concurrent shard copies (threads); None = min(8, shards to copy)."""
    node_rank: int | None = bounded(None, 0, MAX_NODES - 1)
    """This node's rank (0..num_nodes-1); None = the launcher's (torchrun GROUP_RANK, SLURM_NODEID), else 0."""
    num_nodes: int | None = bounded(None, 1, MAX_NODES)
    """Nodes of the job; above 1 only this node's shards (i % num_nodes == node_rank) are copied, for
    [loader] shard_split = "node"; None = the launcher's (GROUP_WORLD_SIZE, SLURM_JOB_NUM_NODES), else 1."""

    def __post_init__(self) -> None:
        check_bounds(self)
        # only when both are given: a missing num_nodes comes from the launcher's environment (stage.node_of checks)
        if self.node_rank is not None and self.num_nodes is not None and self.node_rank >= self.num_nodes:
            raise ConfigError(f"node_rank ({self.node_rank}) must be below num_nodes ({self.num_nodes})")


@dataclass(frozen=True, kw_only=True)
class PlanConfig:
    """``gpufeed plan``: peak training memory from real steps (will the batch fit?) and the loader's cores per GPU."""

    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50"
    """torchvision ResNet architecture, built as gpufeed train builds it."""
    num_classes: int = bounded(1000, 1, MAX_CLASSES)
    """Classifier outputs."""
    batch_size: int = bounded(256, 1, MAX_BATCH_SIZE)
    """Samples per micro-batch per GPU to plan for."""
    image_size: int = bounded(224, 1, MAX_IMAGE_SIZE)
    """Training image side in pixels (every step is measured at this size)."""
    amp: Literal["auto", "bf16", "fp16", "off"] = "auto"
    """Autocast dtype, as gpufeed train: auto = bf16 on CUDA devices with compute capability 8.0+, fp16 on older
    ones, off on the CPU."""
    channels_last: bool = False
    """Use the channels_last memory format, as gpufeed train --channels-last."""
    optimizer: Literal["sgd", "adamw"] = "sgd"
    """sgd = gpufeed train's optimizer (SGD, momentum 0.9: one buffer per parameter); adamw = AdamW (two)."""
    device: str = "auto"
    """Where the steps are measured: auto (CUDA when present), cpu, cuda or cuda:N."""
    measure_batches: tuple[int, ...] | None = None
    """The two batch sizes measured for the linear model; None = b and 2b, b the smallest power of two (at least 2
    on the CPU, 16 on a GPU) whose activations are twice the gradients."""
    check_batch: int | None = bounded(None, 0, MAX_BATCH_SIZE)
    """A third batch size measured to check the model's estimate (0 = no check); None = twice the larger
    measured one."""
    gpu_memory: int | None = bounded(None, 1, MAX_RAM_BYTES, size=True)
    """GPU memory to plan for (bytes or a size such as 80GiB); None = the measuring GPU's total, none on the CPU."""
    headroom: float = bounded(0.10, 0.0, 0.9)
    """Fraction of the GPU memory kept free for allocator fragmentation, the CUDA context and workspace spikes."""
    target_rate: float | None = bounded(None, 0.0, MAX_RATE, min_open=True)
    """Samples/s ONE GPU consumes (e.g. its train --measure synthetic rate); None = the train record's synthetic
    rate per rank, when record is a train summary.json."""
    record: str | None = None
    """A gpufeed tune or train summary.json: the loader's measured samples/s per core (tune: the best trial;
    train: the loader-only mode); None = no cores-per-GPU answer."""
    gpus: int | None = bounded(None, 1, MAX_NPROC_PER_NODE)
    """GPUs per node sharing this machine's usable cores; None = the CUDA devices here (1 when there are none)."""
    trainer_cores: int = bounded(1, 0, MAX_WORKERS)
    """Cores each training process keeps for itself, on top of its loader's."""

    def __post_init__(self) -> None:
        check_bounds(self)
        check_device(self.device)
        if self.measure_batches is not None:
            mb = self.measure_batches
            if len(mb) != 2 or not all(isinstance(b, int) and 2 <= b <= MAX_BATCH_SIZE for b in mb) or mb[0] >= mb[1]:
                raise ConfigError(f"measure_batches must be two batch sizes, smaller first, within 2..{MAX_BATCH_SIZE} "
                                  f"(BatchNorm trains on 2 samples or more), got {_show(mb)}")
        if self.check_batch == 1:
            raise ConfigError("check_batch must be 0 (no check) or at least 2 (BatchNorm trains on 2 samples or more)")
        if self.measure_batches is not None and self.check_batch in self.measure_batches:
            raise ConfigError(f"check_batch {self.check_batch} is one of measure_batches "
                              f"{_show(self.measure_batches)}: the check must measure a third batch size, or its "
                              f"error says nothing")
        if self.target_rate is not None and self.record is None:
            raise ConfigError("target_rate needs record (a gpufeed tune or train summary.json that measured the "
                              "loader's samples/s per core)")


SECTIONS: dict[str, type] = {
    "shard": ShardConfig,
    "loader": LoaderConfig,
    "tune": TuneConfig,
    "train": TrainConfig,
    "synth": SynthConfig,
    "layout": LayoutConfig,
    "io": IoConfig,
    "stage": StageConfig,
    "plan": PlanConfig,
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """All sections of a configuration file, each resolved."""

    shard: ShardConfig = field(default_factory=ShardConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    layout: LayoutConfig = field(default_factory=LayoutConfig)
    io: IoConfig = field(default_factory=IoConfig)
    stage: StageConfig = field(default_factory=StageConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)


# --------------------------------------------------------------------------- loading


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of at most ``MAX_CONFIG_BYTES``, turning every failure into one ConfigError naming it."""
    import os

    from gpufeed.core.errors import DataError
    from gpufeed.core.safefs import open_user_file

    p = Path(path)
    try:  # a regular file (a link is fine: the user named it), never a FIFO that would block the read
        with os.fdopen(open_user_file(p, what="config file"), "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except DataError as exc:
        raise ConfigError(str(exc)) from None
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"config file {p} cannot be read ({exc.strerror or exc})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {p} is larger than {MAX_CONFIG_BYTES} bytes; a config file is a few KiB")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {p} is not UTF-8 text (byte {exc.start} is {raw[exc.start]:#04x}); "
                          f"TOML files must be UTF-8") from None
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None
    except ValueError as exc:  # e.g. an integer of more digits than Python converts (sys.get_int_max_str_digits)
        raise ConfigError(f"config file {p} holds a value that cannot be read ({str(exc)[:120]})") from None
    except RecursionError:
        raise ConfigError(f"config file {p} nests arrays or tables too deeply") from None


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> Config:
    """Resolve every section: CLI ``overrides`` ("section.key" -> value, None = not given) > file > defaults."""
    data = read_toml(path) if path is not None else {}
    where = f"config file {path}" if path is not None else "config"
    unknown = sorted(set(data) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{where}: unknown section(s) {unknown}; known: {sorted(SECTIONS)}")
    for name in SECTIONS:
        if not isinstance(data.get(name, {}), dict):
            raise ConfigError(f"{where}: [{name}] must be a table")
    per_section: dict[str, dict[str, Any]] = {name: dict(data.get(name, {})) for name in SECTIONS}
    for dotted, value in (overrides or {}).items():
        if value is None:
            continue
        section_name, _, key = dotted.partition(".")
        if section_name not in SECTIONS or not key:
            raise ConfigError(f"bad override key {dotted!r}: expected 'section.key'")
        per_section[section_name][key] = value
    built = {name: build_section(SECTIONS[name], values, f"{where} [{name}]") for name, values in per_section.items()}
    return Config(**built)


def build_section(cls: type, values: dict[str, Any], where: str = "config") -> Any:
    """Build one config dataclass from a plain mapping, rejecting unknown keys and wrong types."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - set(fields))
    if unknown:
        raise ConfigError(f"{where}: unknown key(s) {unknown}; known: {sorted(fields)}")
    hints = typing.get_type_hints(cls)
    checked = {}
    for key, value in values.items():
        f = fields[key]
        if f.metadata.get("size") and value is not None:
            try:
                value = parse_size(value)
            except ConfigError as exc:
                raise ConfigError(f"{where} {key}: {exc}") from None
        checked[key] = _coerce(value, hints[key], f"{where} {key}")
    try:
        return cls(**checked)
    except ConfigError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{where}: {exc}") from None


def to_toml(section: str, cfg: Any, *, skip_none: bool = True, header: str = "") -> str:
    """Render one config dataclass as a TOML section that ``load_config`` reads back."""
    lines = [f"# {line}" for line in header.splitlines()] + [f"[{section}]"]
    for f in dataclasses.fields(cfg):
        value = getattr(cfg, f.name)
        if value is None and skip_none:
            continue
        lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


CONFIG_HEADER = """gpufeed configuration, one section per job: gpufeed CMD --config FILE reads it.
Precedence: CLI > this file > built-in defaults. Unknown sections and keys are errors; every number is
range-checked. Sizes accept "1GB", "512MiB" or plain bytes. A commented-out key has no default value: its
comment says what leaving it out means.
Generated from the config classes (src/gpufeed/config.py) by: gpufeed config --defaults"""


def render_config(cfg: Config | None = None, header: str = CONFIG_HEADER) -> str:
    """Every section and key of ``cfg`` (default: the built-in defaults) as commented TOML that ``load_config``
    reads back to ``cfg``: each key under its field's docstring and range, sizes as ``1GB``, unset (None) keys
    commented out. ``gpufeed config --defaults`` prints it; ``configs/default.toml`` is this text."""
    import textwrap

    cfg = Config() if cfg is None else cfg
    docs = _field_docs()
    lines = [f"# {line}" if line else "#" for line in header.splitlines()]
    for name, cls in SECTIONS.items():
        section = getattr(cfg, name)
        about = " ".join((cls.__doc__ or "").replace("``", "").split())
        lines += ["", f"[{name}]"] + textwrap.wrap(about, 116, initial_indent="# ", subsequent_indent="# ")
        for f in dataclasses.fields(cls):
            doc = docs.get(cls.__name__, {}).get(f.name, "")
            if "max" in f.metadata:
                lo, hi = (_help_value(f.metadata[k], f.metadata["size"]) for k in ("min", "max"))
                doc += f"  [{lo}{'<' if f.metadata['min_open'] else '<='}x{'<' if f.metadata['max_open'] else '<='}{hi}]"
            lines += [""] + textwrap.wrap(doc, 116, initial_indent="# ", subsequent_indent="# ")
            value = getattr(section, f.name)
            if value is None:
                lines.append(f"# {f.name} =")
            elif f.metadata.get("size") and isinstance(value, int) and not isinstance(value, bool):
                lines.append(f"{f.name} = {_toml_value(_help_value(value, size=True))}")
            else:
                lines.append(f"{f.name} = {_toml_value(value)}")
    return "\n".join(lines) + "\n"


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return _toml_string(value)
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


def _toml_string(text: str) -> str:
    """A TOML basic string: quotes, backslashes and control characters escaped, so that every string (a path
    holding a tab or a newline included) reads back as it was written."""
    out = ['"']
    for ch in text:
        o = ord(ch)
        if ch in '"\\':
            out.append("\\" + ch)
        elif o < 0x20 or o == 0x7F:
            out.append(f"\\u{o:04x}")
        elif 0xD800 <= o <= 0xDFFF:
            raise ConfigError(f"cannot write {text[:80]!r} to TOML: it holds bytes that are not UTF-8 text")
        else:
            out.append(ch)
    out.append('"')
    return "".join(out)


def _coerce(value: Any, hint: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, where)
            except ConfigError as exc:
                errors.append(str(exc))
        raise ConfigError(errors[0] if errors else f"{where}: bad value {_show(value)}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {_show(value)}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {_show(value)}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {_show(value)}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {_show(value)}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                return float(value)
            except OverflowError:
                raise ConfigError(f"{where} is too large, got {_show(value)}") from None
        raise ConfigError(f"{where} must be a number, got {_show(value)}")
    if hint is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {_show(value)}")
    return value


# --------------------------------------------------------------------------- help text


_NONE_MEANS = re.compile(r"[;.]\s*None = (.+?)\.?$", re.DOTALL)
"""A docstring's closing "; None = <what None means>." clause."""
_SIZE_NAMES = ("PiB", "PB", "TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB")


def field_help(cls: type, name: str) -> str:
    """Help text of config field ``cls.name``: its docstring, then its default and range in brackets, e.g.
    ``"Target samples per shard.  [default: 10000; 1<=x<=10000000]"``. A closing "None = ..." clause of the
    docstring says what the default None means and is shown as the default."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    doc = _field_docs().get(cls.__name__, {}).get(name, "")
    notes = []
    if f.default is None:
        m = _NONE_MEANS.search(doc)
        if m:
            doc = doc[:m.start()] + "."
            notes.append(f"default: {m.group(1)}")
    elif f.default is not dataclasses.MISSING:
        notes.append(f"default: {_help_value(f.default, f.metadata.get('size', False))}")
    if "max" in f.metadata:
        lo, hi = (_help_value(f.metadata[k], f.metadata["size"]) for k in ("min", "max"))
        notes.append(f"{lo}{'<' if f.metadata['min_open'] else '<='}x{'<' if f.metadata['max_open'] else '<='}{hi}")
    return f"{doc}  [{'; '.join(notes)}]" if notes else doc


@functools.lru_cache(maxsize=None)
def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring under that field (whitespace joined, ``markup`` dropped), read
    from this module's source: Python keeps no docstrings of attributes."""
    try:
        tree = ast.parse(Path(__file__).read_text(encoding="utf-8"))
    except OSError:  # installed without its .py source: help shows defaults and ranges only
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {
                stmt.target.id: " ".join(doc.value.value.replace("``", "").split())
                for stmt, doc in zip(node.body, node.body[1:])
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)}
    return docs


def _help_value(value: Any, size: bool = False) -> str:
    """A default or bound as the user would type it: sizes in their largest exact unit, 2**63-1 as such."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and size:
        exact = [(value // _SIZE_UNITS[u.lower()], u) for u in _SIZE_NAMES if value and value % _SIZE_UNITS[u.lower()] == 0]
        n, unit = min(exact, default=(value, "B"))
        return f"{n}{unit}"
    if isinstance(value, int) and value >= 2**31 and (value + 1) & value == 0:
        return f"2**{value.bit_length()}-1"
    if isinstance(value, int) and value >= 2**31 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)
