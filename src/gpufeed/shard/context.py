"""What every phase of the job shares (docs/design.md §1, ``shard/``): ``JobContext`` (the config, the folders, the
checks a worker makes, the worker pool, the progress bar), and the process set-up: the pool, glibc's mmap
threshold, and the imports preloaded in a thread while the workers work, off this process's serial path."""

from __future__ import annotations

import os
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import Any, Callable

from gpufeed.config import ShardConfig
from gpufeed.shard.dest import STATE_DIR
from gpufeed.shard.report import Bar
from gpufeed.shard.validate import CheckOptions


@dataclass
class JobContext:
    """One run of ``write_shards``: what its phases read (``opts`` gains the pixel limit for the one pass)."""

    cfg: ShardConfig
    src: str
    """SRC, absolute."""
    dest: str
    """DEST, absolute."""
    workers: int
    options: dict[str, Any]
    """The output-affecting options (``shardplan.plan_options``): the plan's fingerprint and the manifest."""
    opts: CheckOptions
    pool: Executor | None
    """The worker processes (None: ``workers`` is 1, everything runs here)."""
    bar: Bar
    warnings: list[str]
    split: Any = None
    """This node's part of a static split (``split.NodeSplit``), or None."""

    @property
    def state(self) -> str:
        """DEST's state folder."""
        return os.path.join(self.dest, STATE_DIR)


def map_large_blocks() -> None:
    """Keep glibc's mmap threshold at its initial 128 KiB (``mallopt(M_MMAP_THRESHOLD)``; nothing on other C
    libraries): every block above it (the plan's numpy columns, the index's blocks) is then mapped on its own and
    given back to the OS when freed. glibc otherwise raises the threshold up to 32 MiB the first time such a block
    is freed, later columns come from the heap, and the RSS keeps the high-water mark of every phase. (A write
    task's buffer is then mapped and unmapped each time too: ~5% more CPU when this process writes, --workers 1.)"""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


def early_imports() -> None:
    """What this process needs right after the scan: numpy (joins the scan's columns), Pillow (the one pass's
    pixel limit) and the package version (the plan's fingerprint reads it from the installed metadata)."""
    import numpy  # noqa: F401
    from PIL import Image  # noqa: F401

    import gpufeed

    gpufeed.__version__  # noqa: B018 - looked up once, then cached


def finish_imports() -> None:
    """What ``index.parquet`` needs (~0.15 s)."""
    import pyarrow.compute  # noqa: F401
    import pyarrow.parquet  # noqa: F401


_preloading: set[Any] = set()


def preload(load: Callable[[], None]) -> None:
    """Run ``load`` (imports) in a thread while the workers work, instead of on this process's serial path; a
    second call with the same function does nothing. Started once the pool's workers are forked (the pool forks
    only while this process has one thread), and late enough that the thread's share of the GIL does not slow
    this process's own serial steps (the shuffle, the first shards' file lists). An error is left to the code
    that needs the module: it imports it again and reports it there."""
    import threading

    if load in _preloading:
        return
    _preloading.add(load)

    def run() -> None:
        try:
            load()
        except Exception:  # noqa: BLE001 - see above
            pass

    threading.Thread(target=run, name="gpufeed-preload", daemon=True).start()


def make_pool(workers: int, lock_fd: int) -> Executor:
    """The job's process pool (:func:`gpufeed.core.system.process_pool`: fork where safe, else spawn; workers die with
    this process and a forked one closes its copy of the DEST lock), started at once so that its start-up
    overlaps the scan."""
    from gpufeed.core.system import process_pool

    ex = process_pool(workers, close_fds=(lock_fd,))
    ex.submit(_noop)  # start the workers now (spawn: their start-up overlaps the scan)
    return ex


def _noop() -> None:
    return None


def warm_worker() -> None:
    """Import what validating needs (Pillow) before the first batch arrives."""
    from PIL import Image  # noqa: F401
