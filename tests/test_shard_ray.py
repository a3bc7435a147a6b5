"""``gpufeed shard --engine ray``, run in an interpreter of its own: the cases are in ``tests/ray_cases.py``.

Ray's driver lives inside the process that calls ``ray.init``, and its C++ core can end that process without a word
(``_exit(1)`` when it gives up on its GCS, an abort on a failed check). In-process, that once ended a whole CI run
after the Ray tests with exit 1 and no pytest summary; here it is one failing test that shows Ray's own log."""

from __future__ import annotations

import glob
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="Ray is not installed (pip install 'gpufeed[ray]')")

ROOT = Path(__file__).parent.parent


def _ray_driver_log_tail(temp_dir: Path, lines: int = 20) -> str:
    """The last lines of the Ray driver's own log in ``temp_dir`` (where Ray writes why it ended a process)."""
    logs = sorted(glob.glob(str(temp_dir / "**" / "python-core-driver-*.log"), recursive=True))
    if not logs:
        return "(no Ray driver log)"
    return "\n".join(Path(logs[-1]).read_text(errors="replace").splitlines()[-lines:])


def test_the_ray_engine_cases_in_their_own_interpreter() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}  # Ray's defaults, not another test's
    # Ray's logs, kept for the failure message below; a short path (its socket paths must stay under 108 bytes)
    with tempfile.TemporaryDirectory(prefix="gf-ray-", dir="/tmp") as temp:
        env["RAY_TMPDIR"] = temp
        run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "tests/ray_cases.py"],
                             cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
        assert run.returncode == 0, (f"exit {run.returncode}\n{run.stdout[-6000:]}\n{run.stderr[-3000:]}\n"
                                     f"Ray driver log:\n{_ray_driver_log_tail(Path(temp))}")
    assert " passed" in run.stdout and "4 passed" in run.stdout, run.stdout[-2000:]
