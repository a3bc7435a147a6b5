from __future__ import annotations

import subprocess
import sys

import click
import pytest

from tests.common.cli import invoke


JOB_MODULES = ("gpufeed.shard", "gpufeed.verify", "gpufeed.index", "gpufeed.tune", "gpufeed.train", "gpufeed.storage",
               "gpufeed.stage", "gpufeed.doctor", "gpufeed.memplan", "gpufeed.synth")
"""The job modules: a command imports its own when it runs, never for --help."""


def test_help_does_not_import_torch_or_a_job_module() -> None:
    code = ("import sys\n"
            "from gpufeed.cli import cli\n"
            "from gpufeed.cli.commands import COMMANDS\n"
            "for args in ([], *([job.name] for job in COMMANDS)):\n"
            "    try:\n"
            "        cli([*args, '--help'], prog_name='gpufeed')\n"
            "    except SystemExit as exc:\n"
            "        assert exc.code == 0, (args, exc.code)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.split('.')[:2] in ([*j.split('.')] for j in "
            f"{JOB_MODULES!r})), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "Usage: gpufeed train" in out.stdout and "Usage: gpufeed config" in out.stdout
    assert out.stderr.strip() == "[]"


def test_the_command_table_is_the_cli() -> None:
    from gpufeed.cli import cli
    from gpufeed.cli.commands import COMMANDS

    assert list(cli.commands) == [job.name for job in COMMANDS]
    for job in COMMANDS:  # the group's own help lists every command
        assert f"gpufeed {job.name} " in cli.help, job.name


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


def test_every_command_has_json() -> None:
    from gpufeed.cli.commands import COMMANDS

    for job in COMMANDS:
        assert "--json" in invoke([job.name, "--help"]).stdout, job.name


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

FILE_ONLY = {
    "loader": {"pin_memory", "persistent_workers", "worker_batching", "shuffle_buffer", "decode", "decode_threads",
               "on_error", "check",
               "seed", "crop_ratio", "resize", "remote_streams", "shard_split"},
    "tune": {"warmup_batches", "min_gain", "target_margin"},
    "train": {"num_classes", "min_lr", "timing_warmup_steps", "progress"},
    "layout": {"ranks_per_node", "usable_cores", "trainer_cores", "device"},
    "run": {"dir", "steps"},
}
"""Config fields set only in a file (train's progress is also --quiet, read inverted; [layout] is written by tune;
[run] is read from gpufeed run's CONFIG_FILE, whose --run-dir overrides [run] dir):
every other field of every section is an option or argument of some command."""
SAME_NAME_OTHER_MEANING = {("verify", "decode")}
"""Options named as a field of their command's sections that set something else (verify --decode: decode every
image, not the loader's decode path)."""


def _config_options() -> list[tuple[str, click.Option, str, str]]:
    """(command, option, section, field) for every option that sets a config field, from the command table. An
    option that sets a field of its command's sections by name without saying so (written by hand) fails."""
    import dataclasses

    from gpufeed.cli import cli
    from gpufeed.cli.commands import COMMANDS
    from gpufeed.cli.options import FieldParam
    from gpufeed.config import SECTIONS

    out = []
    for job in COMMANDS:
        cmd = cli.commands[job.name]
        cmd.get_help(click.Context(cmd, info_name=job.name))
        fields = {f.name for s in job.sections for f in dataclasses.fields(SECTIONS[s])}
        for opt in cmd.params:
            if isinstance(opt, FieldParam):
                assert opt in job.params and opt.field in {f.name for f in dataclasses.fields(SECTIONS[opt.section])}
                if isinstance(opt, click.Option) and not (opt.is_flag and not opt.is_bool_flag):
                    out.append((job.name, opt, opt.section, opt.field))
            elif (job.name, opt.name) not in SAME_NAME_OTHER_MEANING:
                assert opt.name not in fields, f"gpufeed {job.name} {opt.opts[0]} sets a config field by hand"
    return out


def test_every_config_field_is_an_option_or_file_only() -> None:
    import dataclasses

    from gpufeed.cli.commands import COMMANDS
    from gpufeed.cli.options import FieldParam
    from gpufeed.config import SECTIONS

    covered = {(p.section, p.field) for job in COMMANDS for p in job.params if isinstance(p, FieldParam)}
    for section, cls in SECTIONS.items():
        missing = {f.name for f in dataclasses.fields(cls) if (section, f.name) not in covered}
        assert missing == FILE_ONLY.get(section, set()), section


def test_config_option_help_is_the_field_doc_with_the_dataclass_default() -> None:
    import dataclasses
    import re

    from gpufeed.config import SECTIONS, field_help, parse_size

    options = _config_options()
    names = {(c, o.opts[0]) for c, o, _, _ in options}
    assert {("shard", "--shard-bytes"), ("verify", "--max-pixels"), ("tune", "--max-workers"),
            ("train", "--num-workers"), ("train", "--compile"), ("synth", "--images"), ("io", "--bytes"),
            ("stage", "--jobs"), ("doctor", "--prefetch-factor"), ("plan", "--measure-batches")} <= names
    assert len(options) >= 106  # today: shard 15, verify 1, tune 17, synth 5, train 38, io 7, stage 3, doctor 4, plan 16
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


def test_choices_are_the_field_literals() -> None:
    import typing

    from gpufeed.config import SECTIONS

    for cmd_name, opt, section, name in _config_options():
        hint = typing.get_type_hints(SECTIONS[section])[name]
        if typing.get_origin(hint) is typing.Literal:
            assert isinstance(opt.type, click.Choice) and list(opt.type.choices) == list(typing.get_args(hint)), \
                f"gpufeed {cmd_name} {opt.opts[0]}"


def test_an_option_sets_its_field_over_the_file(tmp_path) -> None:
    """The runner gives every field option to load_config as section.field: a value given beats the file, one
    left out keeps it (tune's nproc_per_node falls back to [train]'s)."""
    from gpufeed.config import load_config

    cfg = tmp_path / "c.toml"
    cfg.write_text("[tune]\nrepeats = 5\nbudget_s = 9.0\n[train]\nnproc_per_node = 3\nthreads = 1\n")
    conf = load_config(cfg, {"tune.budget_s": 2.0, "tune.repeats": None})
    assert (conf.tune.budget_s, conf.tune.repeats) == (2.0, 5)
    assert conf.tune.nproc_per_node is None and conf.tune_for_training().nproc_per_node == 3
    assert load_config(cfg, {"tune.nproc_per_node": 2}).tune_for_training().nproc_per_node == 2
    # tune --with-model's step gets the torch threads training gets
    assert conf.tune_for_training().model_threads == 1
    assert load_config(cfg, {"tune.model_threads": 2}).tune_for_training().model_threads == 2


def test_rendered_help_shows_the_field_default() -> None:
    out = " ".join(invoke(["tune", "--help"]).stdout.split())
    assert ("--max-workers INTEGER Largest num_workers per rank tried. [default: the loaders' share of the usable CPUs "
            "(x cpu_budget, less trainer_cores per rank) split over the ranks, rounded down;") in out
    out = " ".join(invoke(["shard", "--help"]).stdout.split())
    assert "--shard-samples INTEGER Target samples per shard" in out and "[default: 10000;" in out
