"""Enough measurement (docs/design.md §4): a mode's timing windows are *settled* when there are at least
:data:`MIN_WINDOWS` of them and the mean they estimate is known closely enough that one hiccup cannot move the
verdict across a line.

Each window is one sample of the mode's rate (and data stall); the figure the verdict uses is their mean. Its 90%
confidence interval (Student's t, the windows taken as independent) must be

- samples/s: no wider than :data:`RATE_SPREAD_MAX` of the mean (the width of the 0.9 x ceiling line,
  1 - :data:`~gpufeed.measure.bounds.CEILING_FRACTION`);
- data stall: no wider than :data:`STALL_SPREAD_MAX` points (half the 5 % line), or wholly on one side of
  :data:`~gpufeed.measure.bounds.STALL_FED_PCT` (then the line is decided however wide it is), or every window on
  one side of it.

The interval narrows as windows accumulate (by 1/sqrt(n)), so a longer measurement settles a noisy mode; the range
of the windows, which only grows with their number, is reported (median, min-max) but not judged on. Pure
functions of the window figures; ``gpufeed train --measure`` extends each mode window by window until they hold,
within ``--measure-seconds``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gpufeed.measure.bounds import CEILING_FRACTION, STALL_FED_PCT

MIN_WINDOWS = 3
"""Fewest timing windows a mode's figures are judged on."""
RATE_SPREAD_MAX = 1.0 - CEILING_FRACTION
"""Widest 90% interval of the mean samples/s, as a fraction of that mean."""
STALL_SPREAD_MAX = STALL_FED_PCT / 2
"""Widest 90% interval of the mean data stall %, in points (unless it lies on one side of the line)."""

_T95 = (6.314, 2.920, 2.353, 2.132, 2.015, 1.943, 1.895, 1.860, 1.833, 1.812, 1.796, 1.782, 1.771, 1.761, 1.753,
        1.746, 1.740, 1.734, 1.729, 1.725, 1.721, 1.717, 1.714, 1.711, 1.708, 1.706, 1.703, 1.701, 1.699, 1.697)
"""Student's t, one-sided 95% (so a two-sided 90% interval), for 1..30 degrees of freedom."""


def t90(df: int) -> float:
    """Half-width factor of a two-sided 90% interval of a mean with ``df`` degrees of freedom (>= 1): the table,
    then the Cornish-Fisher step from the normal 1.645 (within 0.002 of the exact value past 30)."""
    if df < 1:
        raise ValueError("an interval needs at least two windows")
    if df <= len(_T95):
        return _T95[df - 1]
    z = 1.6448536
    return z + (z ** 3 + z) / (4 * df)


def interval(values: list[float]) -> tuple[float, float]:
    """(mean, half-width of its 90% interval) of at least two values."""
    n = len(values)
    mean = math.fsum(values) / n
    sd = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1))
    return mean, t90(n - 1) * sd / math.sqrt(n)


@dataclass(frozen=True)
class Spread:
    """How closely a mode's windows pin down its figures."""

    num_windows: int
    rate_spread: float | None
    """Width of the 90% interval of the mean samples/s, as a fraction of that mean; None under two windows."""
    stall_spread_pts: float | None
    """Width of the 90% interval of the mean data stall %, in points; None under two windows or without stalls."""
    settled: bool


def spread(rates: list[float], stalls: list[float] | None = None) -> Spread:
    """The windows' :class:`Spread` and whether they are settled (see the module docstring)."""
    stalls = stalls or []
    n = len(rates)
    rate_spread = None
    if n >= 2:
        mean, half = interval(rates)
        rate_spread = 2 * half / mean if mean > 0 else None
    stall_spread = None
    stall_ok = True
    if len(stalls) >= 2:
        mean, half = interval(stalls)
        stall_spread = 2 * half
        one_side = (mean + half < STALL_FED_PCT or mean - half >= STALL_FED_PCT
                    or all(s < STALL_FED_PCT for s in stalls) or all(s >= STALL_FED_PCT for s in stalls))
        stall_ok = stall_spread <= STALL_SPREAD_MAX or one_side
    rate_ok = rate_spread is not None and rate_spread <= RATE_SPREAD_MAX
    return Spread(n, rate_spread, stall_spread, n >= MIN_WINDOWS and rate_ok and stall_ok)


def window_steps(timed_steps: int) -> int:
    """Steps per window so that a mode's minimum timed steps make :data:`MIN_WINDOWS` windows."""
    return max(1, timed_steps // MIN_WINDOWS)
