"""Facts about the machine this process runs on. No torch at import time."""

from __future__ import annotations

import os
import platform
import sys
from pathlib import Path
from typing import Any


def usable_cpus() -> int:
    """CPUs this process may actually use: CPU affinity, then the cgroup CPU quota (containers, SLURM).

    The host-wide CPU count over-subscribes containers and batch jobs.
    """
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # macOS / Windows
        n = getattr(os, "process_cpu_count", os.cpu_count)() or 1  # Python 3.13+ honours affinity here too
    quota = cgroup_cpu_quota()
    if quota is not None:
        n = min(n, max(1, int(quota + 0.999)))
    return max(1, n)


def cgroup_cpu_quota() -> float | None:
    """CPU quota in CPUs from cgroup v2 ``cpu.max`` or v1 ``cpu.cfs_quota_us``; None when unlimited."""
    try:
        text = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if text and text[0] != "max":
            return int(text[0]) / int(text[1])
        return None
    except (OSError, ValueError, IndexError):
        pass
    try:
        quota = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
        period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
        if quota > 0 and period > 0:
            return quota / period
    except (OSError, ValueError):
        pass
    return None


def total_ram_bytes() -> int:
    import psutil

    return int(psutil.virtual_memory().total)


LIBRARIES = (("webdataset", "webdataset"), ("PIL", "pillow"), ("numpy", "numpy"), ("pyarrow", "pyarrow"),
             ("simplejpeg", "simplejpeg"))
"""(module, distribution) of the libraries whose versions every record names (``<module>_version``)."""


def package_version(dist: str) -> str | None:
    """The installed version of the distribution ``dist``, read from its metadata without importing it (importing
    webdataset imports torch); None when it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def environment_snapshot(*, with_torch: bool = True) -> dict[str, Any]:
    """Versions and hardware facts stored next to every record. Imports torch only when asked."""
    import psutil

    from gpufeed import __version__

    snap: dict[str, Any] = {
        "gpufeed": __version__,
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "machine": platform.machine(),
        "hostname": platform.node(),
        "usable_cpus": usable_cpus(),
        "ram_bytes": int(psutil.virtual_memory().total),
    }
    for mod, dist in LIBRARIES:
        snap[f"{mod.lower()}_version"] = package_version(dist)
    if with_torch:
        import torch

        snap["torch_version"] = torch.__version__
        snap["torchvision_version"] = _torchvision_version()
        snap["cuda_available"] = torch.cuda.is_available()
        snap["cuda_version"] = torch.version.cuda
        snap["cudnn_version"] = torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None
        if torch.cuda.is_available():
            snap["gpus"] = [
                {"name": torch.cuda.get_device_name(i),
                 "memory_bytes": torch.cuda.get_device_properties(i).total_memory}
                for i in range(torch.cuda.device_count())
            ]
            try:
                snap["nccl_version"] = ".".join(map(str, torch.cuda.nccl.version()))
            except Exception:
                snap["nccl_version"] = None
    return snap


def _torchvision_version() -> str | None:
    try:
        import torchvision

        return torchvision.__version__
    except Exception:
        return None


_PR_SET_PDEATHSIG = 1  # <linux/prctl.h>


def die_with_parent(parent_pid: int | None = None, close_fds: tuple[int, ...] = ()) -> None:
    """Process-pool initializer: this worker is SIGKILLed when its parent dies (Linux ``PR_SET_PDEATHSIG``), as
    when the OOM killer or ``kill -9`` takes the main process, so no orphan keeps working or holds a file.

    ``parent_pid`` (default: multiprocessing's record of the parent) closes the race of a parent that died before
    the call: the worker exits at once. ``close_fds`` are descriptors a forked worker inherited but must not keep
    (the DEST lock: a flock lives as long as any process holds its open file). Elsewhere than Linux only the
    parent check and the closing are done. The signal follows the *thread* that started the worker: start pools
    from a thread that outlives them (the main thread does)."""
    for fd in close_fds:
        try:
            os.close(fd)
        except OSError:
            pass
    if parent_pid is None:
        import multiprocessing

        parent = multiprocessing.parent_process()
        parent_pid = parent.pid if parent is not None else None
    if sys.platform.startswith("linux"):
        import ctypes
        import signal

        try:
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        except (OSError, AttributeError):  # no prctl in this libc: only the parent check below
            pass
    if parent_pid is not None and os.getppid() != parent_pid:
        os._exit(1)  # the parent is already gone (we were re-parented): do not start work for nobody


def _pool_init(parent_pid: int, close_fds: tuple[int, ...], initializer: Any, initargs: tuple) -> None:
    die_with_parent(parent_pid, close_fds)
    if initializer is not None:
        initializer(*initargs)


def process_pool(workers: int, *, initializer: Any = None, initargs: tuple = (),
                 close_fds: tuple[int, ...] = ()) -> Any:
    """The one process-pool policy of every job (shard, verify, synth): a ``ProcessPoolExecutor``.

    - Start method: ``fork`` while this process runs a single thread (workers start in milliseconds and
      inherit what was imported), else ``spawn`` (forking a threaded process can deadlock in the child).
    - Every worker dies with this process (:func:`die_with_parent`); a forked one first closes ``close_fds``
      (descriptors it inherited but must not hold, such as a lock).
    - ``initializer(*initargs)`` runs after that in each worker.
    """
    import concurrent.futures as cf
    import multiprocessing as mp
    import threading

    method = "fork" if sys.platform.startswith("linux") and threading.active_count() == 1 else "spawn"
    # only a forked worker inherits descriptors (spawn starts a fresh program: the same number may be another file)
    inherited = tuple(close_fds) if method == "fork" else ()
    return cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method), initializer=_pool_init,
                                  initargs=(os.getpid(), inherited, initializer, tuple(initargs)))


def mounts() -> list[tuple[str, str, str]]:
    """(source, mount point, filesystem type) of each line of /proc/mounts (octal escapes in paths undone);
    empty where it cannot be read (not Linux)."""
    try:
        with open("/proc/mounts", encoding="utf-8", errors="replace") as f:
            lines = f.read(4 << 20).splitlines()
    except OSError:
        return []
    out = []
    for line in lines:
        parts = line.split()
        if len(parts) >= 3:
            point = parts[1]
            for code, ch in (("\\040", " "), ("\\011", "\t"), ("\\012", "\n"), ("\\134", "\\")):
                point = point.replace(code, ch)
            out.append((parts[0], point, parts[2]))
    return out


def mount_of(path: str | os.PathLike, table: list[tuple[str, str, str]] | None = None) -> tuple[str, str, str]:
    """(source, mount point, filesystem type) of the file system holding ``path``: the longest mount point above
    it (the last mounted wins a tie); ("", "", "unknown") where /proc/mounts cannot be read."""
    real = os.path.realpath(path)
    best = ("", "", "unknown")
    for source, point, fs_type in (mounts() if table is None else table):
        if (real == point or real.startswith(point.rstrip("/") + "/")) and len(point) >= len(best[1]):
            best = (source, point, fs_type)
    return best
