"""GPU health during ``gpufeed train``: each CUDA rank samples its own GPU through NVML (:mod:`gpufeed.measure.nvml`) in a
daemon thread, every ``interval_s``, for the whole run (all modes).

Each sample stands for the time since the previous one (the first for none), so the throttle seconds of a
reason are the sum of the sample intervals whose reason mask had its bit set. The summary
(:class:`GpuHealth`: max temperature, mean/max power against the limit, mean utilisation, min/mean SM clock,
throttle seconds per reason) is accumulated over every sample. The time series kept for ``gpu_health.jsonl`` is
bounded: a row holds the samples of one span of ``span_s`` seconds (``interval_s`` at first); when the series
reaches ``max_rows`` rows the span doubles and the rows of each doubled span merge, so a long run keeps at most
``max_rows`` rows of coarser spans. A row's ``n`` counts its samples, ``dt_s`` the time they stand for; a merged
row keeps the mean of util, power, fan and SM clock over its samples, the max of temperature, memory and power
limit, and the union of the reasons seen.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from gpufeed.measure.nvml import HEALTH_FIELDS, SLOWDOWN_LABELS, THROTTLE_BITS, decode_reasons, open_device, read_health

HEALTH_NAME = "gpu_health.jsonl"
"""The run folder's time series: one row per sample span and rank."""
INTERVAL_S = 1.0
MAX_ROWS = 600
"""Rows kept per GPU (10 min at 1 s; longer runs merge rows into coarser spans, so memory stays bounded)."""
THROTTLE_NOTE_S = 2.0
THROTTLE_NOTE_FRACTION = 0.01
"""A GPU is reported as throttled when a heat/power/board reason (:data:`gpufeed.measure.nvml.SLOWDOWN_LABELS`) held
its clocks back for more than THROTTLE_NOTE_S seconds and more than this fraction of the sampled time."""

_MEAN = ("util_pct", "power_w", "fan_pct", "sm_clock_mhz")
_MAX = ("mem_used_bytes", "power_limit_w", "temp_c")


@dataclass(frozen=True)
class GpuHealth:
    """One rank's GPU over the run (summary.json ``gpu_health``)."""

    rank: int
    node: int
    host: str
    gpu: int
    """torch's device index (``cuda:gpu``) of the rank."""
    num_samples: int
    duration_s: float
    """Time covered by the samples (first to last)."""
    temp_max_c: float | None = None
    power_mean_w: float | None = None
    power_max_w: float | None = None
    power_limit_w: float | None = None
    """The highest power limit in force seen."""
    util_mean_pct: float | None = None
    sm_clock_min_mhz: float | None = None
    sm_clock_mean_mhz: float | None = None
    mem_used_max_bytes: float | None = None
    fan_mean_pct: float | None = None
    """None where the GPU has no fan (SXM boards) or does not report it."""
    throttle_s: dict[str, float] = field(default_factory=dict)
    """Seconds per clocks-event reason that was set (benign ones such as gpu_idle included)."""


class _Stat:
    """Running count, sum, min and max of one field."""

    def __init__(self) -> None:
        self.n, self.total, self.lo, self.hi = 0, 0.0, None, None

    def add(self, x: float | None) -> None:
        if x is None:
            return
        self.n += 1
        self.total += x
        self.lo = x if self.lo is None else min(self.lo, x)
        self.hi = x if self.hi is None else max(self.hi, x)

    @property
    def mean(self) -> float | None:
        return self.total / self.n if self.n else None


class HealthSampler:
    """Samples one GPU: :meth:`start` / :meth:`stop` run the thread; :meth:`sample` takes one sample (tests call
    it directly with an injected ``nvml`` module and ``clock``)."""

    def __init__(self, gpu: int, *, rank: int = 0, node: int = 0, host: str = "", interval_s: float = INTERVAL_S,
                 max_rows: int = MAX_ROWS, nvml: Any = None, clock: Callable[[], float] = time.monotonic) -> None:
        if max_rows < 2:
            raise ValueError("max_rows must be at least 2")
        self.gpu, self.rank, self.node, self.host = gpu, rank, node, host
        self.interval_s, self.max_rows, self.clock = interval_s, max_rows, clock
        self.nvml, self.handle, self.error = open_device(gpu, nvml)
        self.rows: list[dict[str, Any]] = []
        self.span_s = interval_s
        """Time one row covers before a new row starts (doubles at each merge)."""
        self.stats = {k: _Stat() for k in HEALTH_FIELDS}
        self.throttle_s: dict[str, float] = {}
        self.num_samples = 0
        self._t0: float | None = None
        self._last: float | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def available(self) -> bool:
        return self.handle is not None

    def sample(self) -> None:
        """Read the GPU once: into the running summary and the series."""
        if self.handle is None:
            return
        s = read_health(self.nvml, self.handle)
        now = self.clock()
        dt = 0.0 if self._last is None else max(0.0, now - self._last)
        if self._t0 is None:
            self._t0 = now
        self._last = now
        self.num_samples += 1
        for k in HEALTH_FIELDS:
            self.stats[k].add(s[k])
        names = decode_reasons(s["reasons"])
        for name in names:
            self.throttle_s[name] = self.throttle_s.get(name, 0.0) + dt
        self._add_row(now - self._t0, dt, s, names)

    def _add_row(self, t: float, dt: float, s: dict[str, Any], names: tuple[str, ...]) -> None:
        row = {"rank": self.rank, "gpu": self.gpu, "t_s": round(t, 3), "dt_s": round(dt, 3), "n": 1,
               **{k: s[k] for k in HEALTH_FIELDS}, "reasons": list(names)}
        if self.rows and self._bucket(self.rows[-1]) == self._bucket(row):
            self.rows[-1] = _merge(self.rows[-1], row)
            return
        while len(self.rows) >= self.max_rows:
            self.span_s *= 2
            merged: list[dict[str, Any]] = []
            for r in self.rows:
                if merged and self._bucket(merged[-1]) == self._bucket(r):
                    merged[-1] = _merge(merged[-1], r)
                else:
                    merged.append(r)
            self.rows = merged
        self.rows.append(row)

    def _bucket(self, row: dict[str, Any]) -> int:
        """The span of ``span_s`` seconds (counted from the first sample) a row starts in."""
        return int(row["t_s"] // self.span_s)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self.sample()

    def start(self) -> "HealthSampler":
        if self.handle is not None and self._thread is None:
            self.sample()
            self._thread = threading.Thread(target=self._run, name="gpufeed-health", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self.sample()
        try:
            self.nvml.nvmlShutdown()
        except Exception:  # noqa: BLE001 - NVML counts inits; a failed shutdown leaves nothing to undo
            pass

    def result(self) -> GpuHealth | None:
        """The summary (the series is :attr:`rows`); None when this GPU could not be opened through NVML."""
        if self.handle is None:
            return None
        st = self.stats
        duration = (self._last - self._t0) if self._t0 is not None and self._last is not None else 0.0
        return GpuHealth(
            rank=self.rank, node=self.node, host=self.host, gpu=self.gpu, num_samples=self.num_samples,
            duration_s=duration, temp_max_c=st["temp_c"].hi, power_mean_w=st["power_w"].mean,
            power_max_w=st["power_w"].hi, power_limit_w=st["power_limit_w"].hi, util_mean_pct=st["util_pct"].mean,
            sm_clock_min_mhz=st["sm_clock_mhz"].lo, sm_clock_mean_mhz=st["sm_clock_mhz"].mean,
            mem_used_max_bytes=st["mem_used_bytes"].hi, fan_mean_pct=st["fan_pct"].mean,
            throttle_s={k: round(v, 3) for k, v in self.throttle_s.items()})


def _merge(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """Row ``a`` extended by the later row ``b``: one row over both (see the module docstring)."""
    out = dict(a, dt_s=round(a["dt_s"] + b["dt_s"], 3), n=a["n"] + b["n"])
    for k in _MEAN:
        x, y = a[k], b[k]
        out[k] = (y if x is None else x) if x is None or y is None else (x * a["n"] + y * b["n"]) / out["n"]
    for k in _MAX:
        vals = [v for v in (a[k], b[k]) if v is not None]
        out[k] = max(vals) if vals else None
    out["reasons"] = [n for n in THROTTLE_BITS.values() if n in a["reasons"] or n in b["reasons"]]
    return out


def slowdowns(h: dict[str, Any]) -> dict[str, float]:
    """{reason: seconds} of a GpuHealth dict's heat/power/board reasons (benign ones left out)."""
    return {r: float(s) for r, s in (h.get("throttle_s") or {}).items() if r in SLOWDOWN_LABELS and s}


def throttled(h: dict[str, Any]) -> dict[str, float]:
    """The slowdowns of a GpuHealth dict above the note threshold (:data:`THROTTLE_NOTE_S`,
    :data:`THROTTLE_NOTE_FRACTION`)."""
    duration = float(h.get("duration_s") or 0.0)
    return {r: s for r, s in slowdowns(h).items()
            if s > THROTTLE_NOTE_S and s > THROTTLE_NOTE_FRACTION * duration}
