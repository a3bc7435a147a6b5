"""kill -9 of a running `gpufeed shard` (as the OOM killer does): its workers die with it, the DEST lock is free at
once, and the re-run resumes to the bytes of an uninterrupted run."""

from __future__ import annotations

import hashlib
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from gpufeed.config import ShardConfig
from gpufeed.shard import write_shards
from tests.common.cli import cli_argv
from tests.common.shards import write_image

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
    proc = subprocess.Popen(cli_argv("shard", src, dest, "--workers", "2", "--shard-samples", "20", "--quiet"),
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
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


def test_spawned_pool_workers_die_with_their_parent(tmp_path: Path) -> None:
    """verify's pool (spawn) uses the same initializer: its workers die with a parent killed by -9."""
    code = (
        "import concurrent.futures as cf, multiprocessing as mp, os, sys, time\n"
        "from gpufeed.core.system import die_with_parent\n"
        "if __name__ == '__main__':\n"
        "    ex = cf.ProcessPoolExecutor(1, mp_context=mp.get_context('spawn'), initializer=die_with_parent,\n"
        "                                initargs=(os.getpid(),))\n"
        "    print(ex.submit(os.getpid).result(), flush=True)\n"
        "    time.sleep(120)\n"
    )
    script = tmp_path / "pool.py"
    script.write_text(code)
    proc = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = None
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        assert ready, "the pool did not start within 60 s"
        worker = psutil.Process(int(proc.stdout.readline()))
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
        gone, alive = psutil.wait_procs([worker], timeout=10)
        assert not alive, "the spawned worker outlived its parent"
    finally:
        if worker is not None and worker.is_running():
            worker.kill()
        if proc.poll() is None:
            proc.kill()
        proc.wait(timeout=30)


def test_a_worker_whose_parent_is_already_gone_exits() -> None:
    code = "from gpufeed.core.system import die_with_parent\ndie_with_parent(parent_pid=-1)\nprint('working')\n"
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert res.returncode == 1 and res.stdout == ""
