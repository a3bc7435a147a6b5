"""Background telemetry for tune and train trials (docs/design.md §4).

A daemon thread samples, every ``interval_s``:
- CPU % per core of the machine and CPU seconds of a process tree (this process and all of its
  descendants, i.e. DataLoader workers), from psutil;
- RSS summed over that tree (shared pages are counted once per process, so this is an upper bound);
- storage read bytes of the tree (psutil ``io_counters().read_bytes``, page-cache hits excluded) and
  the machine's disk read bytes;
- GPU utilisation, memory, power, temperature, SM clock and clocks-event (throttle) reasons through NVML when
  nvidia-ml-py and a GPU exist;
- what the rest of the machine did over the window (:mod:`gpufeed.measure.contention`): the cores other processes
  used and the largest of them, and the other processes on the GPU.

Usage::

    with Telemetry() as tel:
        run_trial()
    summary = tel.summary()
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from statistics import fmean
from typing import Any

import psutil

from gpufeed.measure.contention import Contention, ContentionProbe
from gpufeed.measure.nvml import clock_slowdowns, open_device, read_health


@dataclass(frozen=True)
class TelemetrySummary:
    duration_s: float
    num_samples: int
    cpu_percent_per_core: list[float]
    """Mean busy % of each core of the machine over the window."""
    cpu_percent_mean: float
    """Mean busy % over all cores of the machine."""
    tree_cpu_s: float
    """CPU seconds used by the watched process tree during the window."""
    tree_cores_used: float
    """tree_cpu_s / duration_s: how many cores the tree kept busy."""
    tree_num_processes_max: int
    rss_max_bytes: int
    rss_mean_bytes: float
    tree_read_bytes: int
    """Storage read bytes of the tree (page-cache hits are not counted)."""
    disk_read_bytes: int | None
    """Machine-wide disk read bytes (None where psutil cannot tell)."""
    gpu: dict[str, Any] = field(default_factory=dict)
    """NVML readings (util_mean_pct, mem_used_max_bytes, power_mean_w, temp_max_c, sm_clock_mean_mhz, slowdowns:
    the heat/power clocks-event reasons seen in any sample) or {}."""
    contention: Contention | None = None
    """The rest of the machine over the window (other processes' cores, the largest of them, the GPU's others)."""


class _Nvml:
    """Thin NVML reader (:mod:`gpufeed.measure.nvml`); ``None`` handle when no GPU or no nvidia-ml-py."""

    def __init__(self, index: int | None) -> None:
        self.nvml: Any = None
        self.handle: Any = None
        self.error: str | None = None
        if index is not None:
            self.nvml, self.handle, self.error = open_device(index)

    def read(self) -> dict[str, float] | None:
        """util_pct, mem_used_bytes, power_w, temp_c, sm_clock_mhz: those this GPU answers; None without one."""
        if self.handle is None:
            return None
        sample = read_health(self.nvml, self.handle)
        out: dict[str, Any] = {k: sample[k] for k in _TELEMETRY_FIELDS if sample[k] is not None}
        out["slowdowns"] = clock_slowdowns(sample.get("reasons"))
        return out


_TELEMETRY_FIELDS = ("util_pct", "mem_used_bytes", "power_w", "temp_c", "sm_clock_mhz")


class Telemetry:
    def __init__(self, *, interval_s: float = 0.5, root_pid: int | None = None, gpu_index: int | None = None) -> None:
        self.interval_s = interval_s
        self.root = psutil.Process(root_pid or os.getpid())
        self._nvml = _Nvml(gpu_index)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._cpu_base: dict[int, float] = {}
        self._cpu_last: dict[int, float] = {}
        self._io_base: dict[int, int] = {}
        self._io_last: dict[int, int] = {}
        self._ppid: dict[int, int] = {}
        self._alive: set[int] = set()
        self._rss: list[int] = []
        self._nprocs: list[int] = []
        self._gpu: list[dict[str, float]] = []
        self._t0 = self._t1 = 0.0
        self._disk0: Any = None
        self._disk1: Any = None
        self._probe = ContentionProbe((self._nvml.nvml, self._nvml.handle) if self._nvml.handle is not None else None)

    def _tree(self) -> list[psutil.Process]:
        try:
            return [self.root, *self.root.children(recursive=True)]
        except psutil.Error:
            return []

    def _sample(self, first: bool = False) -> None:
        rss = 0
        procs = self._tree()
        alive = {p.pid for p in procs}
        for gone in self._alive - alive:
            # Linux adds a reaped child's I/O counters to its parent's: shift the parent's base by what this
            # child had already been counted for, so its bytes are counted once
            parent = self._ppid.get(gone)
            if parent in self._io_base:
                self._io_base[parent] += self._io_last.get(gone, 0)
        self._alive = alive
        for p in procs:
            try:
                with p.oneshot():
                    t = p.cpu_times()
                    cpu = t.user + t.system
                    rss += p.memory_info().rss
                    try:
                        rb = p.io_counters().read_bytes
                    except (psutil.Error, AttributeError):
                        rb = 0
            except psutil.Error:
                continue
            if p.pid not in self._cpu_base:
                # processes alive at start count from now; processes born later count from zero
                self._cpu_base[p.pid] = cpu if first else 0.0
                self._io_base[p.pid] = rb if first else 0
                try:
                    self._ppid[p.pid] = p.ppid()
                except psutil.Error:
                    pass
            self._cpu_last[p.pid] = cpu
            self._io_last[p.pid] = rb
        self._rss.append(rss)
        self._nprocs.append(len(procs))
        g = self._nvml.read()
        if g:
            self._gpu.append(g)

    def _run(self) -> None:
        while not self._stop.wait(self.interval_s):
            self._sample()

    def __enter__(self) -> "Telemetry":
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self) -> None:
        psutil.cpu_percent(percpu=True)  # prime the per-core counters
        self._disk0 = _disk_read()
        self._probe.start()
        self._t0 = time.perf_counter()
        self._sample(first=True)
        self._thread = threading.Thread(target=self._run, name="gpufeed-telemetry", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        if self._thread is None:
            return
        self._sample()
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._t1 = time.perf_counter()
        self._per_core = psutil.cpu_percent(percpu=True)
        self._disk1 = _disk_read()
        self._probe.stop()

    def summary(self) -> TelemetrySummary:
        duration = max(self._t1 - self._t0, 1e-9)
        cpu_s = sum(self._cpu_last[p] - self._cpu_base.get(p, 0.0) for p in self._cpu_last)
        io = sum(self._io_last[p] - self._io_base.get(p, 0) for p in self._io_last)
        per_core = list(getattr(self, "_per_core", []))
        gpu: dict[str, Any] = {}
        if self._gpu:
            def col(k: str) -> list[float]:
                return [g[k] for g in self._gpu if k in g]
            gpu = {
                "util_mean_pct": _mean(col("util_pct")),
                "mem_used_max_bytes": max(col("mem_used_bytes"), default=None),
                "power_mean_w": _mean(col("power_w")),
                "temp_max_c": max(col("temp_c"), default=None),
                "sm_clock_mean_mhz": _mean(col("sm_clock_mhz")),
                "slowdowns": sorted({r for g in self._gpu for r in g.get("slowdowns", ())}),
                "num_samples": len(self._gpu),
            }
        elif self._nvml.error:
            gpu = {"error": self._nvml.error}
        disk = None
        if self._disk0 is not None and self._disk1 is not None:
            disk = int(self._disk1 - self._disk0)
        return TelemetrySummary(
            duration_s=duration,
            num_samples=len(self._rss),
            cpu_percent_per_core=per_core,
            cpu_percent_mean=fmean(per_core) if per_core else 0.0,
            tree_cpu_s=max(cpu_s, 0.0),
            tree_cores_used=max(cpu_s, 0.0) / duration,
            tree_num_processes_max=max(self._nprocs, default=0),
            rss_max_bytes=max(self._rss, default=0),
            rss_mean_bytes=fmean(self._rss) if self._rss else 0.0,
            tree_read_bytes=max(int(io), 0),
            disk_read_bytes=disk,
            gpu=gpu,
            contention=self._probe.result(self._cpu_last, max(cpu_s, 0.0) / duration) if self._t1 else None,
        )


def _disk_read() -> int | None:
    try:
        c = psutil.disk_io_counters()
        return None if c is None else int(c.read_bytes)
    except Exception:
        return None


def _mean(xs: list[float]) -> float | None:
    return fmean(xs) if xs else None
