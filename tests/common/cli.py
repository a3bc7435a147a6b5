"""Running the gpufeed CLI from tests: in-process through Click's runner (:func:`invoke`, :func:`invoke_json`), or
as a child process (:func:`python_m`, :func:`cli_argv`, and :func:`kill_tree` to end one)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

SRC = Path(__file__).resolve().parents[2] / "src"

CLI_CODE = "import sys\nfrom gpufeed.cli import cli\nsys.argv[0] = 'gpufeed'\ncli()\n"
"""``python -c CLI_CODE ARGS...`` runs ``gpufeed ARGS...`` (see :func:`cli_argv`)."""


def invoke(args: list, expect: int | None = 0, env: dict[str, str] | None = None) -> Result:
    """Run the gpufeed CLI in-process, stdout and stderr captured apart (neither is a terminal), with ``env`` set
    for the run; on an exit code other than ``expect`` (None: any), fail showing stdout and stderr."""
    from gpufeed.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False, env=env)
    if expect is not None and result.exit_code != expect:
        pytest.fail(
            f"gpufeed {' '.join(map(str, args))} exited {result.exit_code}, expected {expect}\n"
            f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        )
    return result


def invoke_json(args: list, expect: int | None = 0) -> dict:
    """Run with --json and parse stdout, which must be exactly one JSON object."""
    result = invoke([*args, "--json"], expect=expect)
    out = result.stdout.strip()
    try:
        obj = json.loads(out)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object:\n{out}\n--- stderr ---\n{result.stderr}")
    assert isinstance(obj, dict)
    return obj


def cli_argv(*args: object) -> list[str]:
    """The argv of a child process that runs ``gpufeed ARGS...`` from this interpreter (for Popen, to kill it)."""
    return [sys.executable, "-c", CLI_CODE, *map(str, args)]


def python_m(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``python -m gpufeed ARGS...`` in a child process with src/ on PYTHONPATH and ``env`` added; text output."""
    full = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]),
            **(env or {})}
    return subprocess.run([sys.executable, "-m", "gpufeed", *args], capture_output=True, text=True, env=full,
                          timeout=120)


def kill_tree(proc: subprocess.Popen) -> None:
    """SIGKILL a launcher that is still running, its process group, and its descendants (torchrun starts each
    rank in a session of its own, out of the launcher's group)."""
    import psutil

    if proc.poll() is not None:
        return
    try:
        family = psutil.Process(proc.pid).children(recursive=True)
    except psutil.NoSuchProcess:
        family = []
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for p in family:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    proc.wait(timeout=30)
