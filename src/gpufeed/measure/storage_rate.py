"""What the storage of a shard set delivers, as ``train --measure`` and ``tune`` record it: the record that the
``io`` job's probe returns and that the verdict reads (docs/design.md §4)."""

from __future__ import annotations

from dataclasses import dataclass, field

@dataclass(frozen=True)
class StorageRate:
    """What the storage of a shard set delivers, as ``train --measure`` and ``tune`` record it (``storage`` in
    their summary.json)."""

    bytes_per_s: float
    """The best rate of the ladder (cold where cold was measured)."""
    source: str
    """probe, io record or --storage-rate."""
    readers: int | None = None
    """Parallel readers of the best rate (None: --storage-rate)."""
    cache: str | None = None
    """cold or warm: the page cache state the rate was read in; remote for a remote set (None: --storage-rate)."""
    seconds: float | None = None
    """The probe's reading time, all steps (None: not a probe)."""
    ladder: list[tuple[int, float]] = field(default_factory=list)
    """(readers, bytes/s) of each step, reader counts ascending."""
    path: str | None = None
    """The location measured."""
