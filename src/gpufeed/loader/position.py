"""Where a rank stands in its epochs, torch-free: what a checkpoint stores to resume the loader without replay
(docs/design.md §3, "Resume")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.loader.errors import printable


@dataclass(frozen=True)
class LoaderPosition:
    """Where a rank stands in its epochs: ``batches_consumed`` batches of ``epoch`` were used.

    What a checkpoint stores to resume with :meth:`ShardLoader.resume` (no replay). :meth:`from_dict`
    validates a stored one: checkpoints are untrusted input.
    """

    epoch: int
    batches_consumed: int

    def to_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "batches_consumed": self.batches_consumed}

    @classmethod
    def from_dict(cls, obj: Any) -> "LoaderPosition":
        if not isinstance(obj, dict):
            raise DataError(f"loader position must be a mapping, got {type(obj).__name__}")
        vals = {}
        for name in ("epoch", "batches_consumed"):
            v = obj.get(name)
            if type(v) is not int or not 0 <= v < 2**62:
                raise DataError(f"loader position {name} must be a non-negative integer, got {printable(repr(v))[:80]}")
            vals[name] = v
        return cls(**vals)
