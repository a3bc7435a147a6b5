"""system.process_pool: the one process-pool policy (shard, verify, synth)."""

from __future__ import annotations

import os
import sys

import pytest

from gpufeed.core.system import process_pool

_INIT: list[str] = []


def _mark(tag: str) -> None:
    _INIT.append(tag)


def _probe(_: int) -> tuple[int, int, list[str]]:
    """(death signal this worker gets when its parent dies, its parent pid, what the initializer recorded)."""
    import ctypes

    sig = ctypes.c_int(0)
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(2, ctypes.byref(sig), 0, 0, 0)  # PR_GET_PDEATHSIG
    return sig.value, os.getppid(), list(_INIT)


@pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG is a Linux feature")
def test_pool_workers_die_with_their_parent_and_run_the_initializer():
    import signal

    with process_pool(2, initializer=_mark, initargs=("ready",)) as pool:
        results = list(pool.map(_probe, range(4)))
    assert {r[0] for r in results} == {int(signal.SIGKILL)}
    assert {r[1] for r in results} == {os.getpid()}
    assert all(r[2] == ["ready"] for r in results)


def test_environment_snapshot_without_torch_imports_no_torch() -> None:
    """The library versions are read from package metadata: webdataset is not imported, so neither is torch."""
    import subprocess

    code = ("import sys; from gpufeed.core.system import environment_snapshot as e; s = e(with_torch=False); "
            "print(sorted(m for m in ('torch', 'webdataset', 'PIL', 'pyarrow') if m in sys.modules)); "
            "print(s['webdataset_version'], s['pil_version'], s['numpy_version'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split("\n")
    import PIL
    import webdataset

    assert out[0] == "[]"
    assert out[1].split() == [webdataset.__version__, PIL.__version__, __import__("numpy").__version__]
