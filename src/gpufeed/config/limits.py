"""The ranges of config values: byte sizes (``parse_size``), the ``MAX_*`` limits, ``bounded`` fields and the one
check that applies them (``check_bounds``). See docs/design.md section 7.

Every numeric field declares its range next to it, so a value from a file or the command line can never reach a
DataLoader, an allocation or a loop unchecked. No torch here: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import field
from typing import Any

from gpufeed.core.errors import ConfigError

_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:e[+-]?[0-9]{1,3})?)\s*([kmgtp]?i?b?)?\s*$", re.IGNORECASE)
SIZE_UNITS = {
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
            raise ConfigError(f"a size must be >= 0, got {show_value(value)}")
        return int(value)
    text = str(value)
    if len(text) > _MAX_SIZE_TEXT:
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got a {len(text)}-character string")
    m = _SIZE_RE.match(text)
    if not m or m.group(2) is None and not m.group(1):
        raise ConfigError(f"expected a size such as 1GB or 512MiB, got {value!r}")
    unit = (m.group(2) or "").lower()
    if unit not in SIZE_UNITS:
        raise ConfigError(f"unknown size unit in {value!r} (use B, KB, MB, GB, TB or KiB, MiB, GiB, TiB)")
    size = float(m.group(1)) * SIZE_UNITS[unit]
    if not math.isfinite(size):
        raise ConfigError(f"a size must be a finite number, got {value!r}")
    return int(size)


_MAX_SIZE_TEXT = 64
"""Longest size string parsed (``"1.5GiB"`` needs a few characters); longer text is refused unread."""


# --------------------------------------------------------------------------- ranges
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
MAX_DECODE_THREADS = 256
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
            raise ConfigError(f"{f.name} must be {'>' if f.metadata['min_open'] else '>='} {lo}, got {show_value(value)}")
        if value > hi or (f.metadata["max_open"] and value == hi):
            raise ConfigError(f"{f.name} must be {'<' if f.metadata['max_open'] else '<='} {hi}, got {show_value(value)}")


def show_value(value: Any) -> str:
    """A value for a one-sentence message: huge integers by their size (printing one can take seconds, or fail),
    long text cut short."""
    if isinstance(value, int) and value.bit_length() > 200:
        return f"an integer of about {int(value.bit_length() * 0.30103)} digits"
    text = repr(value)
    return text if len(text) <= 80 else f"{text[:60]}... ({len(text)} characters)"



def check_device(device: str) -> None:
    """``auto``, ``cpu``, ``cuda`` or ``cuda:N``, else a ConfigError."""
    if device not in ("auto", "cpu", "cuda") and not re.fullmatch(r"cuda:\d{1,4}", device):
        raise ConfigError(f"device must be auto, cpu, cuda or cuda:N, got {device[:40]!r}")
