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

    assert name in cli.commands
    assert "--json" in invoke([name, "--help"]).stdout


def test_input_error_is_one_sentence_and_exit_2(tmp_path) -> None:
    res = invoke(["verify", str(tmp_path / "nowhere")], expect=2)
    assert "Traceback" not in res.stderr
    assert "does not exist" in res.stderr


def test_os_error_becomes_input_error(tmp_path, image_folder) -> None:
    src = image_folder(classes=2, per_class=2)
    afile = tmp_path / "afile"
    afile.write_text("x")
    res = invoke(["shard", str(src), str(afile / "out"), "--quiet"], expect=2)
    assert "Traceback" not in res.stderr
    assert "afile" in res.stderr
