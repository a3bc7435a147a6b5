from __future__ import annotations

import subprocess
import sys

import click
import pytest

from tests.conftest import invoke


def test_help_does_not_import_torch() -> None:
    code = ("import sys\n"
            "from gpufeed.cli import cli\n"
            "for args in ([], ['shard'], ['verify'], ['index'], ['tune'], ['train'], ['synth']):\n"
            "    try:\n"
            "        cli([*args, '--help'], prog_name='gpufeed')\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, (args, exc.code)\n"
            "print('torch' in sys.modules, file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Usage: gpufeed train" in out.stdout
    assert out.stderr.strip() == "False"


def test_every_command_has_help() -> None:
    from gpufeed.cli import cli

    assert cli.commands, "no commands registered"
    for name in cli.commands:
        res = invoke([name, "--help"])
        assert "--help" in res.stdout


def test_version_is_the_installed_package_version() -> None:
    from importlib.metadata import version

    assert invoke(["--version"]).stdout.strip() == f"gpufeed, version {version('gpufeed')}"


def test_option_help_from_config_fields_is_there_for_completion_and_info() -> None:
    """That help is written when shown (not at import): shell completion and ``to_info_dict`` show it too."""
    from click.shell_completion import ShellComplete

    from gpufeed.cli import cli
    from gpufeed.config import TuneConfig, field_help

    items = ShellComplete(cli, {}, "gpufeed", "_GPUFEED_COMPLETE").get_completions(["tune"], "--max-w")
    assert [(i.value, i.help) for i in items] == [("--max-workers", field_help(TuneConfig, "max_workers"))]
    info = cli.commands["shard"].to_info_dict(click.Context(cli.commands["shard"], info_name="shard"))
    assert all(p["help"] for p in info["params"] if p["name"] == "shard_samples")


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


# --------------------------------------------------------------------------- help from the config dataclasses

SECTION_OF = {"shard": "shard", "tune": "tune", "train": "train", "synth": "synth"}
"""The config section each command's options set, by option name (as cli.py passes them to load/load_config)."""
ELSEWHERE = {("train", "num_workers"): "loader", ("verify", "max_pixels"): "loader"}
NOT_CONFIG = {"quiet", "config_path", "as_json", "help", "mode"}
"""Options of those commands that set no field by their name (train's --synthetic/--loader-only/--measure each
pick one mode and say so; --quiet sets train's progress but reads inverted)."""


def _config_options() -> list[tuple[str, click.Option, str, str]]:
    """(command, option, section, field) for every option that sets a config field."""
    import dataclasses

    from gpufeed.cli import cli
    from gpufeed.config import SECTIONS

    out = []
    for cmd_name, cmd in cli.commands.items():
        cmd.get_help(click.Context(cmd, info_name=cmd_name))  # the help from config fields is written when shown
        for opt in cmd.params:
            if not isinstance(opt, click.Option):
                continue
            name = opt.name.rstrip("_")
            section = ELSEWHERE.get((cmd_name, name)) or SECTION_OF.get(cmd_name)
            if section and name in {f.name for f in dataclasses.fields(SECTIONS[section])}:
                if not (opt.is_flag and not opt.is_bool_flag):
                    out.append((cmd_name, opt, section, name))
            elif cmd_name in SECTION_OF:
                assert name in NOT_CONFIG, f"gpufeed {cmd_name} {opt.opts[0]} sets no [{SECTION_OF[cmd_name]}] field"
    return out


def test_config_option_help_is_the_field_doc_with_the_dataclass_default() -> None:
    import dataclasses
    import re

    from gpufeed.config import SECTIONS, field_help, parse_size

    options = _config_options()
    names = {(c, o.opts[0]) for c, o, _, _ in options}
    assert {("shard", "--shard-bytes"), ("verify", "--max-pixels"), ("tune", "--max-workers"),
            ("train", "--num-workers"), ("train", "--compile"), ("synth", "--images")} <= names
    assert len(options) >= 66  # today: shard 13, verify 1, tune 13, synth 5, train 34
    for cmd_name, opt, section, name in options:
        f = {f.name: f for f in dataclasses.fields(SECTIONS[section])}[name]
        where = f"gpufeed {cmd_name} {opt.opts[0]}"
        assert opt.help == field_help(SECTIONS[section], name), f"{where}: help written by hand"
        shown = re.search(r"\[default: (.+?)(?:;|\]$)", opt.help)
        if f.default is None:
            assert "None" not in opt.help, where
            continue
        assert shown, f"{where} shows no default"
        text = shown.group(1)
        if f.metadata.get("size"):
            assert parse_size(text) == f.default, where
        elif isinstance(f.default, bool):
            assert text == str(f.default).lower(), where
        else:
            assert type(f.default)(text) == f.default, where


def test_rendered_help_shows_the_field_default() -> None:
    out = " ".join(invoke(["tune", "--help"]).stdout.split())
    assert ("--max-workers INTEGER Largest num_workers per rank tried. [default: the loaders' share of the usable CPUs "
            "(x cpu_budget, less trainer_cores per rank) split over the ranks, rounded down;") in out
    out = " ".join(invoke(["shard", "--help"]).stdout.split())
    assert "--shard-samples INTEGER Target samples per shard" in out and "[default: 10000;" in out
