"""Enough measurement (docs/design.md §4): a mode's timing windows are *settled* when there are at least
:data:`MIN_WINDOWS` of them and they disagree by less than the margins the verdict decides on, so that one hiccup
cannot move the verdict across a line.

- samples/s: (max - min) / median at most :data:`RATE_SPREAD_MAX`, the width of the 0.9 x ceiling line
  (1 - :data:`~gpufeed.measure.bounds.CEILING_FRACTION`);
- data stall: max - min at most :data:`STALL_SPREAD_MAX` points (half the 5 % line), or every window on the same
  side of :data:`~gpufeed.measure.bounds.STALL_FED_PCT`.

Pure functions of the window figures; ``gpufeed train --measure`` extends each mode window by window until they hold,
within ``--measure-seconds``.
"""

from __future__ import annotations

from dataclasses import dataclass

from gpufeed.measure.bounds import CEILING_FRACTION, STALL_FED_PCT

MIN_WINDOWS = 3
"""Fewest timing windows a mode's figures are judged on."""
RATE_SPREAD_MAX = 1.0 - CEILING_FRACTION
"""Most (max - min) / median of the windows' samples/s."""
STALL_SPREAD_MAX = STALL_FED_PCT / 2
"""Most max - min of the windows' data stall %, in points (unless all windows sit on one side of the line)."""


@dataclass(frozen=True)
class Spread:
    """How a mode's windows disagree."""

    num_windows: int
    rate_spread: float | None
    """(max - min) / median of samples/s; None without windows."""
    stall_spread_pts: float | None
    """max - min of data stall %, in points; None without windows."""
    settled: bool


def spread(rates: list[float], stalls: list[float] | None = None) -> Spread:
    """The windows' :class:`Spread` and whether they are settled (see the module docstring)."""
    from statistics import median

    stalls = stalls or []
    n = len(rates)
    rate_spread = (max(rates) - min(rates)) / median(rates) if n and median(rates) > 0 else None
    stall_spread = max(stalls) - min(stalls) if stalls else None
    rate_ok = rate_spread is not None and rate_spread <= RATE_SPREAD_MAX
    one_side = all(s < STALL_FED_PCT for s in stalls) or all(s >= STALL_FED_PCT for s in stalls)
    stall_ok = stall_spread is None or stall_spread <= STALL_SPREAD_MAX or one_side
    return Spread(n, rate_spread, stall_spread, n >= MIN_WINDOWS and rate_ok and stall_ok)


def window_steps(timed_steps: int) -> int:
    """Steps per window so that a mode's minimum timed steps make :data:`MIN_WINDOWS` windows."""
    return max(1, timed_steps // MIN_WINDOWS)
