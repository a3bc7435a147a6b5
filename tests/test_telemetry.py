from __future__ import annotations

import multiprocessing as mp
import os
import time
from pathlib import Path

import pytest

from gpufeed.measure.telemetry import Telemetry


def _read_all(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 20):
            pass


@pytest.mark.skipif(not hasattr(os, "posix_fadvise"), reason="needs posix_fadvise to evict the page cache")
def test_storage_reads_of_a_reaped_worker_are_counted_once(tmp_path: Path) -> None:
    """Linux adds a reaped child's I/O to its parent's counters; telemetry must not count it twice."""
    path = tmp_path / "big.bin"
    size = 16 << 20
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the child's reads must reach storage
    os.close(fd)
    with Telemetry(interval_s=0.05) as tel:
        p = mp.get_context("fork").Process(target=_read_all, args=(str(path),))
        p.start()
        time.sleep(0.3)  # sampled while alive...
        p.join()
        time.sleep(0.2)  # ...and after it was reaped
    read = tel.summary().tree_read_bytes
    if read < size // 2:
        pytest.skip(f"storage reads not visible here ({read} bytes): page cache or filesystem without io accounting")
    assert read < 1.5 * size, f"{read} bytes counted for a {size}-byte file"


def test_summary_has_cpu_and_rss() -> None:
    with Telemetry(interval_s=0.05) as tel:
        # 0.2 s of this process's own CPU time, however busy the machine is (bounded by 30 s of wall clock)
        c0, t0 = time.process_time(), time.perf_counter()
        while time.process_time() - c0 < 0.2 and time.perf_counter() - t0 < 30:
            pass
    s = tel.summary()
    assert s.tree_cpu_s > 0.05 and s.rss_max_bytes > 0 and s.num_samples >= 2
    assert 0.0 < s.tree_cores_used <= os.cpu_count()
