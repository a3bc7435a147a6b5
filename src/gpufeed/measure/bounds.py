"""What limits a data pipeline: one vocabulary and one set of thresholds (docs/design.md §4).

``verdict.classify`` (a real training run) and ``tune.classify_bound`` (one loader-only trial) both name
their bound with these words and decide it with these predicates, so "storage" or "copy" means the same
thing in ``gpufeed tune`` and ``gpufeed train``. Pure functions of plain numbers; no torch.
"""

from __future__ import annotations

import math
from typing import Literal

Bound = Literal["rank imbalance", "copy", "GPU decode", "storage", "decode/CPU"]
"""What starves a run, in the order the verdict checks them."""
TrialBound = Literal["copy", "GPU decode", "storage", "decode/CPU", "unclear"]
"""What limits one loader-only trial (``tune``): no ranks to compare, and "unclear" when nothing is saturated."""

RANK_IMBALANCE: Bound = "rank imbalance"
COPY: Bound = "copy"
GPU_DECODE: Bound = "GPU decode"
STORAGE: Bound = "storage"
DECODE_CPU: Bound = "decode/CPU"
UNCLEAR: TrialBound = "unclear"

COPY_SHARE = 0.5
"""Copy-bound when the host-to-device copy is at least this share of the data wait (wait + copy) ..."""
MIN_COPY_PCT = 1.0
"""... and at least this % of the measured time (less is noise)."""
STORAGE_FRACTION = 0.8
"""Storage-bound when the loader reads at least this fraction of what the storage delivers."""
IDLE_FRACTION = 0.5
"""Storage-bound also when the loader processes keep fewer than this fraction of their cores busy while reading."""
SATURATED_FRACTION = 0.75
"""The loader's CPU is saturated when its processes keep at least this fraction of their cores busy ..."""
STALL_FED_PCT = 5.0
"""A run is fed only below this data stall % (the verdict's line; :mod:`gpufeed.measure.settle` sizes its windows'
spread from it) ..."""
CEILING_FRACTION = 0.9
"""... and only when end-to-end samples/s reach this fraction of the lower ceiling."""
MACHINE_BUSY_PCT = 90.0
"""... or the whole machine is at least this % busy."""


def label(bound: str) -> str:
    """``decode/CPU-bound``, ``storage-bound``, ...; ``bound unclear`` for "unclear"."""
    return "bound unclear" if bound == UNCLEAR else f"{bound}-bound"


def copy_limited(copy_pct: float | None, stall_pct: float) -> bool:
    """Host-to-device copy (``copy_pct`` % of the time) makes up most of the data stall (``stall_pct`` %,
    wait + copy, of the same time)."""
    return copy_pct is not None and copy_pct >= MIN_COPY_PCT and copy_pct >= COPY_SHARE * max(stall_pct, 1e-9)


def storage_limited(read_bytes_per_s: float | None, storage_bytes_per_s: float | None) -> bool:
    """The loader reads at the storage's limit (both rates known)."""
    return (_known(read_bytes_per_s) and _known(storage_bytes_per_s)
            and read_bytes_per_s >= STORAGE_FRACTION * storage_bytes_per_s)


def idle_while_reading(cores_used: float | None, cores: float, read_bytes_per_s: float | None) -> bool:
    """The loader processes, which could use ``cores`` cores, keep fewer than IDLE_FRACTION of them busy while
    they read from storage: they wait on reads, not on the CPU."""
    return (_known(cores_used) and _known(read_bytes_per_s) and cores > 0
            and cores_used < IDLE_FRACTION * cores)


def cpu_saturated(cores_used: float | None, cores: float, machine_busy_pct: float | None = None) -> bool:
    """The loader processes keep at least SATURATED_FRACTION of the ``cores`` they could use busy, or the machine
    is at least MACHINE_BUSY_PCT busy."""
    return ((cores_used or 0.0) >= SATURATED_FRACTION * cores
            or (machine_busy_pct or 0.0) >= MACHINE_BUSY_PCT)


def per_core_rate(rate: float | None, cores_used: float | None) -> float | None:
    """Samples/s per busy core (None when either is unknown or zero)."""
    return rate / cores_used if _known(rate) and _known(cores_used) else None


def cores_needed(target_rate: float, per_core: float) -> float:
    """Cores that decode ``target_rate`` samples/s at ``per_core`` samples/s per core."""
    return target_rate / per_core


PAGE_CACHE = "page cache (no device reads)"
"""What a read rate of 0 means when samples were read: the storage I/O counters exclude page-cache hits, so every
read was one."""


def read_rate_text(read_bytes_per_s: float | None, samples: float | None, *, short: bool = False) -> str:
    """A measured storage read rate as text: ``12.3 MB/s`` (``12.3`` with ``short``, for a MB/s column), "page cache
    (no device reads)" (``page cache``) when it is 0 while ``samples`` (a count or a rate) were read, "-" unknown."""
    if read_bytes_per_s is None or not math.isfinite(read_bytes_per_s):
        return "-"
    if read_bytes_per_s <= 0 and (samples or 0) > 0:
        return PAGE_CACHE.split(" (")[0] if short else PAGE_CACHE
    return f"{read_bytes_per_s / 1e6:.1f}" if short else f"{read_bytes_per_s / 1e6:,.1f} MB/s"


def _known(x: float | None) -> bool:
    return x is not None and math.isfinite(x) and x > 0
