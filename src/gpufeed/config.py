"""Typed configuration: one frozen dataclass per job, one TOML section per dataclass.

Precedence is CLI > file > defaults. Unknown sections and keys are errors, and every value is
type-checked against the field's annotation before the dataclass' own ``__post_init__`` checks run.

This module must stay free of torch imports: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import dataclasses
import re
import sys
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from gpufeed.errors import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "kib": 1024, "ki": 1024,
    "m": 1000**2, "mb": 1000**2, "mib": 1024**2, "mi": 1024**2,
    "g": 1000**3, "gb": 1000**3, "gib": 1024**3, "gi": 1024**3,
    "t": 1000**4, "tb": 1000**4, "tib": 1024**4, "ti": 1024**4,
    "p": 1000**5, "pb": 1000**5, "pib": 1024**5, "pi": 1024**5,
}


def parse_size(value: int | float | str) -> int:
    """Parse a byte size such as ``1GB``, ``512MiB``, ``1e9`` or ``4096`` into bytes."""
    if isinstance(value, bool):
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ConfigError(f"a size must be >= 0, got {value!r}")
        return int(value)
    m = _SIZE_RE.match(str(value))
    if not m or m.group(2) is None and not m.group(1):
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got {value!r}")
    unit = (m.group(2) or "").lower()
    if unit not in _SIZE_UNITS:
        raise ConfigError(f"unknown size unit in {value!r} (use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def size_field(default: int | None, doc: str = "") -> Any:
    """A byte-size field: accepts ints or strings such as ``1GB`` in files and on the CLI."""
    return field(default=default, metadata={"size": True, "doc": doc})


# --------------------------------------------------------------------------- job configs


@dataclass(frozen=True, kw_only=True)
class ShardConfig:
    """``gpufeed shard SRC DEST``: image folder -> WebDataset shards + manifest."""

    src: str | None = None
    """Input image folder in ImageFolder layout (one sub-folder per class)."""
    dest: str | None = None
    """Output folder for the shard set (NVMe or a RAM disk)."""
    workers: int | None = None
    """Worker processes; None = the CPUs this process may use (affinity and cgroup aware)."""
    seed: int = 0
    """Seed of the sample shuffle that spreads classes over shards."""
    shard_samples: int = 10_000
    """Target samples per shard (the plan takes whichever of samples/bytes gives more shards)."""
    shard_bytes: int = size_field(1_000_000_000, "Target bytes per shard.")
    """Target bytes per shard."""
    multiple_of: int = 1
    """Round the shard count up to a multiple of this (set it to ranks x workers)."""
    prefix: str = "train"
    """Shard file prefix: train, val, ..."""
    max_size: int | None = None
    """Re-encode: resize the long side down to this many pixels (never up)."""
    quality: int | None = None
    """Re-encode JPEG quality (1-95); implies re-encoding."""
    check: Literal["full", "header"] = "full"
    """full = decode every image; header = read headers only (faster, catches less)."""
    strict: bool = False
    """Exit 1 if any input was rejected."""
    overwrite: bool = False
    """Replace an existing shard set at DEST whose plan differs."""
    allow_empty_classes: bool = False
    """Keep empty class folders as classes (with a warning) instead of refusing the input."""
    max_pixels: int = 89_478_485
    """Decompression-bomb limit in pixels (Pillow's default); larger images are rejected."""

    def __post_init__(self) -> None:
        _check_positive(self, "shard_samples", "shard_bytes", "multiple_of", "max_pixels")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.max_size is not None and self.max_size < 8:
            raise ConfigError(f"max_size must be >= 8 pixels, got {self.max_size}")
        if self.quality is not None and not 1 <= self.quality <= 95:
            raise ConfigError(f"quality must be in 1..95, got {self.quality}")
        if not re.fullmatch(r"[A-Za-z0-9_-]+", self.prefix):
            raise ConfigError(f"prefix must use letters, digits, '_' or '-' only, got {self.prefix!r}")


@dataclass(frozen=True, kw_only=True)
class LoaderConfig:
    """The DataLoader over a shard set, shared by ``tune`` and ``train``. ``tune`` writes this section."""

    batch_size: int = 256
    """Samples per batch (per rank)."""
    num_workers: int = 4
    """DataLoader worker processes per rank."""
    pin_memory: bool = True
    """Pin host batches (only meaningful with CUDA; ignored on CPU)."""
    prefetch_factor: int = 2
    """Batches prefetched per worker (ignored when num_workers == 0)."""
    persistent_workers: bool = True
    """Keep workers alive between epochs (ignored when num_workers == 0)."""
    worker_batching: bool = True
    """Collate batches inside the workers (one IPC message per batch instead of per sample)."""
    shuffle_buffer: int = 2_000
    """Samples in the seeded shuffle buffer (0 = no shuffle)."""
    decode: Literal["pil", "pil-draft", "simplejpeg", "gpu"] = "simplejpeg"
    """Decode path: PIL full, PIL reduced-size draft, simplejpeg (libjpeg-turbo) or GPU nvjpeg."""
    image_size: int = 224
    """Output side in pixels."""
    on_error: Literal["raise", "skip"] = "raise"
    """Corrupt sample policy: raise, or skip and count it."""
    seed: int = 0
    """Seed for shard order, shuffle buffer and random crops."""
    crop_ratio: float = 0.875
    """Eval transform: resize the shorter side to image_size / crop_ratio, then centre-crop image_size."""
    resize: Literal["torch", "pil"] = "torch"
    """Crop+resize kernel (uint8, antialiased bilinear): torch's SIMD kernel (fast) or PIL resize(box=...)."""
    max_pixels: int = 89_478_485
    """Decompression-bomb limit (width x height) for a stored image, as in ``shard``: larger images are refused
    (``on_error = "raise"``) or skipped and counted (``"skip"``) before they are decoded."""

    def __post_init__(self) -> None:
        _check_positive(self, "batch_size", "prefetch_factor", "image_size", "max_pixels")
        _check_non_negative(self, "num_workers", "shuffle_buffer")
        if not 0 < self.crop_ratio <= 1:
            raise ConfigError(f"crop_ratio must be in (0, 1], got {self.crop_ratio}")


@dataclass(frozen=True, kw_only=True)
class TuneConfig:
    """``gpufeed tune SHARDS``: a measured, budget-aware sweep of LoaderConfig knobs."""

    shards: str | None = None
    """The shard set to read."""
    budget_s: float = 300.0
    """Wall-clock budget of the whole sweep in seconds."""
    batch_size: int = 256
    """Batch size used in every trial."""
    max_workers: int | None = None
    """Largest num_workers tried; None = the usable CPUs."""
    cpu_budget: float = 1.0
    """Fraction of the usable CPUs the loader may use (as tf.data AUTOTUNE's cpu_budget)."""
    ram_budget: int | None = size_field(None, "RAM the loader processes may use; None = half of RAM.")
    """RAM the loader processes may use (bytes or '8GB'); None = half of the machine's RAM."""
    target_rate: float | None = None
    """Samples/s the GPU needs; the search stops once the loader beats it with margin."""
    baseline_imagefolder: str | None = None
    """An ImageFolder of the same images: measure torchvision ImageFolder + DataLoader as baseline."""
    out: str | None = None
    """Where to write the winning [loader] section (TOML)."""
    image_size: int = 224
    """Output side in pixels, as in training."""
    run_dir: str | None = None
    """Run folder for trials, chart and summary; None = runs/tune-<UTC timestamp>/."""
    repeats: int = 3
    """Measurement windows per trial (median and spread are reported)."""
    window_s: float | None = None
    """Seconds per measurement window; None = sized from the budget (0.5-10 s)."""
    warmup_batches: int = 2
    """Batches read and discarded after start-up before measuring (start-up is reported separately)."""
    min_gain: float = 0.05
    """A knob change must win by this fraction to be kept; the worker climb stops below it."""
    target_margin: float = 1.2
    """Stop once the best rate >= target_rate x this margin."""
    device: str = "auto"
    """Where batches are moved: auto (CUDA when present), cpu, cuda or cuda:N."""

    def __post_init__(self) -> None:
        _check_positive(self, "budget_s", "batch_size", "image_size", "repeats", "window_s", "target_rate")
        _check_non_negative(self, "warmup_batches", "min_gain")
        if not 0 < self.cpu_budget <= 1:
            raise ConfigError(f"cpu_budget must be in (0, 1], got {self.cpu_budget}")
        if self.max_workers is not None and self.max_workers < 0:
            raise ConfigError(f"max_workers must be >= 0, got {self.max_workers}")
        if self.target_margin < 1:
            raise ConfigError(f"target_margin must be >= 1, got {self.target_margin}")


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """``gpufeed train``: AMP + DDP ResNet training that measures data stall."""

    shards: str | None = None
    """Training shard set."""
    val_shards: str | None = None
    """Validation shard set (top-1/top-5 at the end of each epoch)."""
    arch: Literal["resnet18", "resnet34", "resnet50", "resnet101"] = "resnet50"
    """torchvision ResNet architecture."""
    num_classes: int | None = None
    """Classifier outputs; None = the training set's class count (1000 with --synthetic and no shards)."""
    epochs: int = 1
    """Epochs to train (ignored when steps is set)."""
    steps: int | None = None
    """Optimizer steps to train; overrides epochs."""
    batch_size: int | None = None
    """Samples per micro-batch per rank (per GPU); None = the [loader] batch_size."""
    accum_steps: int = 1
    """Micro-batches accumulated per optimizer step (DDP syncs gradients on the last one only)."""
    image_size: int | None = None
    """Training image side in pixels; None = the [loader] image_size."""
    amp: Literal["bf16", "fp16", "off"] = "bf16"
    """Autocast dtype (fp16 uses a GradScaler)."""
    channels_last: bool = False
    """Use the channels_last memory format (faster convolutions on tensor-core GPUs)."""
    compile: bool = False
    """torch.compile the model."""
    lr: float = 0.1
    """Peak learning rate (SGD); reached after the warm-up, then cosine decay."""
    warmup_steps: int | None = None
    """Linear LR warm-up in optimizer steps; None = 5% of the run (at most 2000 steps)."""
    min_lr: float = 0.0
    """Learning rate at the end of the cosine decay."""
    momentum: float = 0.9
    """SGD momentum (Nesterov off)."""
    weight_decay: float = 1e-4
    """SGD weight decay (not applied to BatchNorm and bias parameters)."""
    label_smoothing: float = 0.1
    """Cross-entropy label smoothing."""
    checkpoint_dir: str | None = None
    """Folder for atomic checkpoints (last.pt); None = no checkpoints."""
    checkpoint_every: int = 0
    """Checkpoint every N optimizer steps (0 = at epoch ends and at the end of the run only)."""
    resume: bool = False
    """Continue from checkpoint_dir/last.pt (same step, LR, optimizer and loader position)."""
    seed: int = 0
    """Seed for model init and data order."""
    mode: Literal["real", "synthetic", "loader-only", "measure"] = "real"
    """real = train; synthetic = fixed batch on the device (GPU ceiling); loader-only = loader alone (loader
    ceiling); measure = synthetic, loader-only and real, briefly, in that order, then the verdict."""
    measure_steps: int = 20
    """Timed steps per mode with mode = measure."""
    timing_warmup_steps: int = 3
    """Steps at the start of each mode left out of the timing (start-up, cudnn autotune, compile)."""
    log_every: int = 10
    """Optimizer steps per JSONL log record."""
    device: str = "auto"
    """auto (CUDA when present), cpu or cuda."""
    threads: int | None = None
    """torch CPU threads per rank; None = usable CPUs / processes on this node."""
    storage_bytes_per_s: float | None = None
    """Measured read rate of the shard storage (e.g. from gpufeed io); lets the verdict call a storage bound."""
    nproc_per_node: int = 1
    """Processes (GPUs) per node; > 1 or nnodes > 1 launches through torchrun."""
    nnodes: str = "1"
    """Nodes (torchrun syntax: N or MIN:MAX)."""
    node_rank: int | None = None
    """This node's rank for static rendezvous (with master_addr)."""
    master_addr: str | None = None
    """Static rendezvous host (rank 0's node)."""
    master_port: int | None = None
    """Static rendezvous port."""
    rdzv_endpoint: str | None = None
    """c10d rendezvous endpoint HOST[:PORT] (instead of master_addr/master_port)."""
    rdzv_id: str = "gpufeed"
    """Rendezvous job id (same on all nodes)."""
    run_dir: str | None = None
    """Run folder; None = runs/train-<UTC timestamp>/."""
    progress: bool = True
    """tqdm progress bar on rank 0."""

    def __post_init__(self) -> None:
        _check_positive(self, "epochs", "steps", "batch_size", "accum_steps", "image_size", "num_classes",
                        "measure_steps", "log_every", "nproc_per_node", "threads", "storage_bytes_per_s")
        _check_non_negative(self, "lr", "min_lr", "momentum", "weight_decay", "checkpoint_every",
                            "timing_warmup_steps", "warmup_steps", "node_rank")
        if not 0 <= self.label_smoothing < 1:
            raise ConfigError(f"label_smoothing must be in [0, 1), got {self.label_smoothing}")
        if self.device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d+", self.device):
            raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {self.device!r}")
        if not re.fullmatch(r"\d+(:\d+)?", self.nnodes):
            raise ConfigError(f"nnodes must be N or MIN:MAX, got {self.nnodes!r}")
        if self.resume and not self.checkpoint_dir:
            raise ConfigError("resume needs checkpoint_dir (the folder holding last.pt)")
        if self.master_port is not None and not 0 < self.master_port < 65536:
            raise ConfigError(f"master_port must be in 1..65535, got {self.master_port}")


@dataclass(frozen=True, kw_only=True)
class SynthConfig:
    """``gpufeed synth DEST``: a small ImageNet-like ImageFolder of JPEGs for demos, tests and benchmarks."""

    dest: str | None = None
    """Output folder; class sub-folders n0000, n0001, ... are created in it."""
    images: int = 1_000
    """Images to write in all (spread evenly over the classes)."""
    classes: int = 10
    """Class folders."""
    seed: int = 0
    """Same seed => byte-identical files (with the same Pillow/libjpeg build), whatever the workers."""
    workers: int | None = None
    """Worker processes; None = the CPUs this process may use. The output does not depend on it."""
    overwrite: bool = False
    """Replace an earlier synth folder at DEST (folders holding other files are refused)."""

    def __post_init__(self) -> None:
        _check_positive(self, "images", "classes")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {self.workers}")
        if self.classes > self.images:
            raise ConfigError(f"classes ({self.classes}) must not exceed images ({self.images}): "
                              "every class folder needs at least one image")


SECTIONS: dict[str, type] = {
    "shard": ShardConfig,
    "loader": LoaderConfig,
    "tune": TuneConfig,
    "train": TrainConfig,
    "synth": SynthConfig,
}


@dataclass(frozen=True, kw_only=True)
class Config:
    """All sections of a configuration file, each resolved."""

    shard: ShardConfig = field(default_factory=ShardConfig)
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    tune: TuneConfig = field(default_factory=TuneConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)


# --------------------------------------------------------------------------- loading


def read_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file, turning syntax errors into ConfigError naming the file."""
    p = Path(path)
    try:
        with p.open("rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {p} does not exist") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config file {p} is not valid TOML: {exc}") from None


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
            value = parse_size(value)
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


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, str):
        return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise ConfigError(f"cannot write {value!r} to TOML")


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
        raise ConfigError(errors[0] if errors else f"{where}: bad value {value!r}")
    if origin is Literal:
        if value not in args:
            raise ConfigError(f"{where} must be one of {list(args)}, got {value!r}")
        return value
    if origin in (tuple, list):
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        inner = args[0] if args else Any
        items = [_coerce(v, inner, where) for v in value]
        return tuple(items) if origin is tuple else items
    if hint is Any:
        return value
    if hint is bool:
        if isinstance(value, bool):
            return value
        raise ConfigError(f"{where} must be true or false, got {value!r}")
    if hint is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        raise ConfigError(f"{where} must be an integer, got {value!r}")
    if hint is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        raise ConfigError(f"{where} must be a number, got {value!r}")
    if hint is str:
        if isinstance(value, (str, Path)):
            return str(value)
        raise ConfigError(f"{where} must be a string, got {value!r}")
    return value


def _check_positive(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value <= 0:
            raise ConfigError(f"{name} must be > 0, got {value}")


def _check_non_negative(cfg: Any, *names: str) -> None:
    for name in names:
        value = getattr(cfg, name)
        if value is not None and value < 0:
            raise ConfigError(f"{name} must be >= 0, got {value}")
