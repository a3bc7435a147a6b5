"""Measurement vocabulary shared by tune, train and reports (docs/design.md §4): repeated measurements
summarised as median and spread, never a single run."""

from __future__ import annotations

from dataclasses import dataclass
from statistics import median


@dataclass(frozen=True)
class Stat:
    """Median and spread of repeated measurements of one quantity."""

    median: float
    min: float
    max: float
    q1: float
    q3: float
    n: int

    @property
    def spread_pct(self) -> float:
        """(max - min) / median in %: how far repeats disagree."""
        return 100.0 * (self.max - self.min) / self.median if self.median else 0.0

    @classmethod
    def of(cls, values: list[float]) -> "Stat":
        if not values:
            raise ValueError("Stat.of needs at least one value")
        xs = sorted(float(v) for v in values)
        return cls(median=median(xs), min=xs[0], max=xs[-1], q1=_quantile(xs, 0.25), q3=_quantile(xs, 0.75), n=len(xs))

    def fmt(self, unit: str = "", digits: int = 1) -> str:
        """``1234.5 samples/s (1200.0–1250.3, n=3)``"""
        u = f" {unit}" if unit else ""
        return f"{self.median:.{digits}f}{u} ({self.min:.{digits}f}–{self.max:.{digits}f}, n={self.n})"


def _quantile(xs: list[float], q: float) -> float:
    """Linear-interpolated quantile of sorted values."""
    if len(xs) == 1:
        return xs[0]
    pos = q * (len(xs) - 1)
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)
