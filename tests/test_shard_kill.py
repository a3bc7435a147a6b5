"""kill -9 of a running `gpufeed shard` (as the OOM killer does): its workers die with it, the DEST lock is free at
once, and the re-run resumes to the bytes of an uninterrupted run."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpufeed.config import ShardConfig
from gpufeed.shard import write_shards
from tests.conftest import write_image

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and fork are Linux features")


def digests(dest: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(dest.glob("*.tar"))}


def wait_for(check, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail(f"timed out after {timeout_s} s waiting for {what}")


def test_kill_9_of_the_main_process_frees_dest(tmp_path: Path) -> None:
    src = tmp_path / "src"
    for c in range(3):
        for i in range(100):
            write_image(src / f"c{c}" / f"{i:03d}.jpg", color=(c * 70, i % 256, 9), quality=90)
    ref = tmp_path / "ref"
    write_shards(ShardConfig(src=str(src), dest=str(ref), shard_samples=20, workers=2), progress=False)
    dest = tmp_path / "out"
    code = "import sys\nfrom gpufeed.cli import cli\nsys.argv[0] = 'gpufeed'\ncli()\n"
    proc = subprocess.Popen([sys.executable, "-c", code, "shard", str(src), str(dest), "--workers", "2",
                             "--shard-samples", "20", "--quiet"], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    workers: list[psutil.Process] = []
    try:
        main = psutil.Process(proc.pid)
        lock = dest / ".gpufeed" / "lock"
        # Running: the lock records the main process' pid and both pool workers are alive.
        wait_for(lambda: lock.exists() and lock.read_bytes().strip() == str(proc.pid).encode(), 60, "the lock")
        workers = wait_for(lambda: [p for p in main.children() if p.status() != psutil.STATUS_ZOMBIE][:2]
                           if len(main.children()) >= 2 else None, 60, "two workers")
        assert not (dest / "manifest.json").exists(), "the run finished before it could be killed"
        os.kill(proc.pid, signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
        # The workers die with their parent (PR_SET_PDEATHSIG), instead of holding the lock as orphans.
        gone, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive, f"orphaned workers still running: {[p.pid for p in alive]}"
        assert lock.read_bytes().strip() == str(proc.pid).encode()  # a stale record, not a held lock
        rep = write_shards(ShardConfig(src=str(src), dest=str(dest), shard_samples=20, workers=2), progress=False)
    finally:
        for p in [*workers, psutil.Process(proc.pid) if proc.poll() is None else None]:
            if p is not None:
                try:
                    p.kill()
                except psutil.NoSuchProcess:
                    pass
        proc.wait(timeout=30)
    assert rep.num_samples == 300 and rep.num_shards == 15
    assert digests(dest) == digests(ref)
    assert (dest / "manifest.json").read_bytes() == (ref / "manifest.json").read_bytes()
    assert (dest / "index.parquet").read_bytes() == (ref / "index.parquet").read_bytes()
    assert lock.read_bytes().strip() == str(os.getpid()).encode()  # the re-run (this process) took the lock
