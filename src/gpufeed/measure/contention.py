"""Noisy neighbours (docs/design.md §4): what the rest of the machine did while a mode or a tune trial ran.

One detector for ``gpufeed train`` and ``gpufeed tune``: the CPU cores other processes used are the machine's busy
cores (psutil's system-wide CPU times, steal included) minus the cores of this run's process trees on the node;
the largest of those processes is named from a per-process CPU-time diff (name and pid). On CUDA the other
processes holding the same GPU, and their memory, come from NVML (:func:`gpufeed.measure.nvml.gpu_processes`).

:func:`contended` is the one threshold: other processes held at least :data:`OTHER_CORES_MAX` cores, or more than
:data:`OTHER_MACHINE_FRACTION` of the machine. Pure functions of plain numbers, plus :class:`ContentionProbe`, which
takes the two snapshots.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Iterable

OTHER_CORES_MAX = 0.5
"""Contended when other processes held at least this many cores ..."""
OTHER_MACHINE_FRACTION = 0.10
"""... or more than this fraction of the machine's cores."""
TOP_OTHERS = 5
"""Other processes kept per measurement (the largest first)."""


@dataclass(frozen=True)
class OtherProcess:
    """A process outside this run that used the CPU (or the GPU) while it was measured."""

    pid: int
    name: str
    cores: float = 0.0
    """CPU cores it kept busy over the window."""
    gpu_mem_bytes: int | None = None
    """Its memory on this run's GPU (NVML), None when it is not on the GPU."""


@dataclass(frozen=True)
class Contention:
    """The rest of the machine over one measured window."""

    duration_s: float
    machine_cores: int
    """Logical CPUs of the machine (what psutil's system-wide times cover)."""
    machine_busy_cores: float
    """Cores the whole machine kept busy (user, nice, system, irq, softirq, steal)."""
    own_cores: float
    """Cores of the watched process tree."""
    own_pids: tuple[int, ...] = ()
    """The watched tree's processes (so that a node's ranks can leave each other out)."""
    others: list[OtherProcess] = field(default_factory=list)
    """The largest other processes on the CPU, and every other process on this run's GPU."""

    @property
    def other_cores(self) -> float:
        return other_cores(self.machine_busy_cores, self.own_cores)


def other_cores(machine_busy_cores: float, own_cores: float) -> float:
    """Cores other processes used: the machine's busy cores minus this run's (never below 0)."""
    return max(0.0, machine_busy_cores - own_cores)


def contended(other: float | None, machine_cores: float | None) -> bool:
    """Other processes held >= :data:`OTHER_CORES_MAX` cores, or > :data:`OTHER_MACHINE_FRACTION` of the machine."""
    if other is None:
        return False
    return other >= OTHER_CORES_MAX or (bool(machine_cores) and other > OTHER_MACHINE_FRACTION * machine_cores)


def threshold_text(machine_cores: float | None) -> str:
    """The threshold in words, for reasons."""
    pct = f" or > {100 * OTHER_MACHINE_FRACTION:.0f}% of {machine_cores:.0f} cores" if machine_cores else ""
    return f">= {OTHER_CORES_MAX} core{pct}"


def largest(others: Iterable[OtherProcess], exclude: Iterable[int] = ()) -> OtherProcess | None:
    """The other process that used the most CPU (then GPU memory), leaving out ``exclude``."""
    skip = set(exclude)
    rest = [o for o in others if o.pid not in skip]
    return max(rest, key=lambda o: (o.cores, o.gpu_mem_bytes or 0), default=None)


def _busy_s(t: Any) -> float:
    return sum(getattr(t, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _proc_cpu() -> dict[int, tuple[str, float]]:
    """{pid: (name, CPU seconds)} of every process psutil can read."""
    import psutil

    out: dict[int, tuple[str, float]] = {}
    for p in psutil.process_iter(["name", "cpu_times"]):
        t = p.info.get("cpu_times")
        if t is not None:
            out[p.pid] = (p.info.get("name") or "?", t.user + t.system)
    return out


class ContentionProbe:
    """Two snapshots of the machine (:meth:`start`, :meth:`stop`) and what other processes did between them
    (:meth:`result`). ``gpu`` is an ``(nvml, handle)`` pair to list the GPU's processes at the stop."""

    def __init__(self, gpu: tuple[Any, Any] | None = None) -> None:
        self.gpu = gpu
        self._t0 = self._t1 = 0.0
        self._cpu0: Any = None
        self._cpu1: Any = None
        self._procs0: dict[int, tuple[str, float]] = {}
        self._procs1: dict[int, tuple[str, float]] = {}
        self._gpu_procs: list[tuple[int, int | None]] = []

    def start(self) -> "ContentionProbe":
        import psutil

        self._procs0 = _proc_cpu()
        self._cpu0 = psutil.cpu_times()
        self._t0 = time.perf_counter()
        return self

    def stop(self) -> None:
        import psutil

        self._t1 = time.perf_counter()
        self._cpu1 = psutil.cpu_times()
        self._procs1 = _proc_cpu()
        if self.gpu is not None:
            from gpufeed.measure.nvml import gpu_processes

            self._gpu_procs = gpu_processes(*self.gpu)

    def result(self, own_pids: Iterable[int], own_cores: float) -> Contention:
        import psutil

        own = set(own_pids)
        duration = max(self._t1 - self._t0, 1e-9)
        busy = (_busy_s(self._cpu1) - _busy_s(self._cpu0)) / duration if self._cpu1 is not None else 0.0
        others: dict[int, OtherProcess] = {}
        for pid, (name, cpu1) in self._procs1.items():
            if pid in own:
                continue
            cores = (cpu1 - self._procs0.get(pid, (name, 0.0))[1]) / duration
            if cores > 0.01:
                others[pid] = OtherProcess(pid, name, round(cores, 3))
        top = sorted(others.values(), key=lambda o: -o.cores)[:TOP_OTHERS]
        for pid, mem in self._gpu_procs:
            if pid in own:
                continue
            name = self._procs1.get(pid, ("?", 0.0))[0]
            cpu = next((o.cores for o in top if o.pid == pid), 0.0)
            top = [o for o in top if o.pid != pid] + [OtherProcess(pid, name, cpu, mem if mem is not None else 0)]
        return Contention(duration_s=duration, machine_cores=psutil.cpu_count() or 1,
                          machine_busy_cores=round(busy, 3), own_cores=own_cores, own_pids=tuple(sorted(own)),
                          others=top)


def node_other_cores(samples: list[Contention]) -> tuple[float | None, OtherProcess | None, int | None]:
    """One node's ranks measured over the same window: (cores other processes held, the largest of them, the
    machine's cores). The machine's busy cores are the median of the ranks' readings; the run's own cores are the sum
    of the ranks' trees, and no rank's processes count as another's neighbour."""
    if not samples:
        return None, None, None
    from statistics import median

    busy = median(s.machine_busy_cores for s in samples)
    own = sum(s.own_cores for s in samples)
    pids = {p for s in samples for p in s.own_pids}
    big = largest((o for s in samples for o in s.others), exclude=pids)
    return other_cores(busy, own), big, max(s.machine_cores for s in samples)
