from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import invoke


def test_help_does_not_import_torch() -> None:
    code = "import sys; from gpufeed.cli import cli; assert 'torch' not in sys.modules; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "ok"


def test_every_command_has_help() -> None:
    from gpufeed.cli import cli

    assert cli.commands, "no commands registered"
    for name in cli.commands:
        res = invoke([name, "--help"])
        assert "--help" in res.stdout


@pytest.mark.parametrize("name", ["shard", "verify", "index", "tune", "train", "synth"])
def test_every_job_command_has_json(name: str) -> None:
    from gpufeed.cli import cli

    if name not in cli.commands:
        pytest.skip(f"{name} not implemented yet")
    assert "--json" in invoke([name, "--help"]).stdout
