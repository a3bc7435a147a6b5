"""CLI habits (issue 17): progress bars only on a terminal, --quiet everywhere, --json errors as one object,
``python -m gpufeed`` and shell completion, ``gpufeed config --defaults``, io's report, "page cache" for a zero read
rate, declared dependencies and the tested torch versions."""

from __future__ import annotations

import ast
import io
import json
import re
import sys
from pathlib import Path

import pytest

from gpufeed.config import ShardConfig
from gpufeed.shard import write_shards
from tests.common.cli import invoke, python_m

ROOT = Path(__file__).resolve().parent.parent
SRC = ROOT / "src" / "gpufeed"


def one_json(stdout: str) -> dict:
    """stdout must be exactly one JSON object (one line)."""
    lines = [line for line in stdout.splitlines() if line.strip()]
    assert len(lines) == 1, stdout
    obj = json.loads(lines[0])
    assert isinstance(obj, dict)
    return obj


@pytest.fixture
def shard_set(image_folder, tmp_path: Path) -> Path:
    dest = tmp_path / "set"
    write_shards(ShardConfig(src=str(image_folder(classes=2, per_class=3)), dest=str(dest), shard_samples=3,
                             workers=1), progress=False)
    return dest


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


# --------------------------------------------------------------------------- progress bars and --quiet


def test_progress_bars_are_drawn_only_on_a_terminal_unless_forced(monkeypatch: pytest.MonkeyPatch) -> None:
    from gpufeed.core.progress import PROGRESS_ENV, bar, progress_enabled

    monkeypatch.delenv(PROGRESS_ENV, raising=False)
    assert progress_enabled(stream=_Tty()) and not progress_enabled(stream=io.StringIO())
    assert not progress_enabled(quiet=True, stream=_Tty())
    for stream, drawn in ((io.StringIO(), False), (_Tty(), True)):
        b = bar(total=3, desc="probe", file=stream)
        b.update(3)
        b.close()
        assert ("probe" in stream.getvalue()) is drawn
    monkeypatch.setenv(PROGRESS_ENV, "1")
    assert progress_enabled(stream=io.StringIO()) and not progress_enabled(quiet=True, stream=io.StringIO())
    monkeypatch.setenv(PROGRESS_ENV, "0")
    assert not progress_enabled(stream=_Tty())


def test_every_tqdm_bar_is_made_by_the_progress_helper() -> None:
    """One decision point: no module but gpufeed/progress.py constructs a tqdm bar."""
    offenders = []
    for path in SRC.rglob("*.py"):
        if path.name == "progress.py" and path.parent == SRC / "core":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Call):
                f = node.func
                name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else ""
                if name in ("tqdm", "trange"):
                    offenders.append(f"{path.relative_to(SRC)}:{node.lineno}")
    assert offenders == []


def test_shard_and_stage_draw_no_bar_when_stderr_is_not_a_terminal(image_folder, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("GPUFEED_PROGRESS", raising=False)
    src = image_folder(classes=2, per_class=3)
    res = invoke(["shard", src, tmp_path / "set", "--workers", 1, "--shard-samples", 3], expect=None)
    assert res.exit_code == 0, res.stderr
    assert "%|" not in res.stderr and "img/s" not in res.stderr  # no tqdm bar
    res = invoke(["stage", tmp_path / "set", tmp_path / "staged"], expect=None)
    assert res.exit_code == 0, res.stderr
    assert "%|" not in res.stderr
    # forced on, the same runs draw their bars; --quiet wins over the force
    forced = invoke(["stage", tmp_path / "set", tmp_path / "staged2"], expect=None, env={"GPUFEED_PROGRESS": "1"})
    assert forced.exit_code == 0 and "stage: 100%|" in forced.stderr
    quiet = invoke(["stage", tmp_path / "set", tmp_path / "staged3", "--quiet"], expect=None,
                   env={"GPUFEED_PROGRESS": "1"})
    assert quiet.exit_code == 0 and "%|" not in quiet.stderr


def test_every_command_and_the_group_take_quiet() -> None:
    from gpufeed.cli import cli

    assert "--quiet" in invoke(["--help"]).stdout
    for name, cmd in cli.commands.items():
        assert any("--quiet" in p.opts for p in cmd.params), f"gpufeed {name} has no --quiet"


@pytest.mark.parametrize("where", ["command", "group"])
def test_quiet_drops_progress_lines_and_notes_but_not_the_json_record(image_folder, tmp_path: Path,
                                                                      where: str) -> None:
    folder = image_folder(classes=1, per_class=3)
    args = ["io", folder, "--max-readers", 1, "--seconds", 0.2, "--json"]
    loud = invoke([*args, "--run-dir", tmp_path / "a"], expect=None)
    assert loud.exit_code == 0 and "reader(s)" in loud.stderr  # the step lines and the human summary
    quiet_args = [*args, "--quiet"] if where == "command" else ["--quiet", *args]
    quiet = invoke([*quiet_args, "--run-dir", tmp_path / "b"], expect=None)
    assert quiet.exit_code == 0 and quiet.stderr == ""
    assert one_json(quiet.stdout)["locations"][0]["path"] == str(folder)


# --------------------------------------------------------------------------- --json errors


def test_json_usage_errors_are_one_json_object_with_exit_2(tmp_path: Path, image_folder) -> None:
    # an input error found by the job
    res = invoke(["verify", tmp_path / "nowhere", "--json"], expect=None)
    obj = one_json(res.stdout)
    assert res.exit_code == 2 and obj["exit_code"] == 2 and obj["command"] == "verify"
    assert "does not exist" in obj["error"] and f"error: {obj['error']}" in res.stderr
    # a config file the option loader refuses
    bad = tmp_path / "bad.toml"
    bad.write_text("[shard]\nshard_samples = 0\n")
    res = invoke(["shard", image_folder(), tmp_path / "out", "--config", bad, "--json"], expect=None)
    obj = one_json(res.stdout)
    assert res.exit_code == 2 and obj["exit_code"] == 2 and obj["command"] == "shard"
    assert "shard_samples" in obj["error"] and str(bad) in obj["error"]
    # a usage error Click finds (unknown option, bad value), even before --json is parsed
    for args in (["index", tmp_path, "--json", "--bogus"], ["io", tmp_path, "--seconds", "soon", "--json"]):
        res = invoke(args, expect=None)
        obj = one_json(res.stdout)
        assert res.exit_code == 2 and obj["exit_code"] == 2 and obj["command"] == args[0], res.stdout
        assert "Usage:" in res.stderr
    # without --json stdout stays empty
    res = invoke(["verify", tmp_path / "nowhere"], expect=None)
    assert res.exit_code == 2 and res.stdout == ""


def test_json_failed_checks_are_one_json_object_with_exit_1(shard_set: Path, image_folder, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    shard = next(shard_set.glob("*.tar"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 3] ^= 0xFF
    shard.write_bytes(bytes(data))
    res = invoke(["verify", shard_set, "--workers", 1, "--json"], expect=None)
    assert res.exit_code == 1 and one_json(res.stdout)["ok"] is False
    res = invoke(["io", image_folder(classes=1, per_class=2), "--max-readers", 1, "--seconds", 0.2,
                  "--target-rate", 1e9, "--run-dir", tmp_path / "r", "--json"], expect=None)
    assert res.exit_code == 1 and one_json(res.stdout)["ok"] is False
    # a started run that fails (RunError, exit 1) is the error object
    from gpufeed import verify
    from gpufeed.core.errors import RunError

    def broken(*_a, **_k):
        raise RunError("shard x.tar: the disk went away")

    monkeypatch.setattr(verify, "verify_shards", broken)
    res = invoke(["verify", shard_set, "--json"], expect=None)
    assert res.exit_code == 1
    assert one_json(res.stdout) == {"error": "shard x.tar: the disk went away", "exit_code": 1, "command": "verify"}


# --------------------------------------------------------------------------- python -m gpufeed, completion


def test_python_m_gpufeed_is_the_gpufeed_command() -> None:
    from importlib.metadata import version

    out = python_m("--version")
    assert out.returncode == 0 and out.stdout.strip() == f"gpufeed, version {version('gpufeed')}"
    out = python_m("--help")
    assert out.returncode == 0 and out.stdout.startswith("Usage: gpufeed [OPTIONS] COMMAND")


def test_shell_completion_scripts_and_completions() -> None:
    marks = {"bash_source": "complete -o nosort -F _gpufeed_completion gpufeed", "zsh_source": "#compdef gpufeed",
             "fish_source": "complete --no-files --command gpufeed"}
    for shell, mark in marks.items():
        out = python_m(env={"_GPUFEED_COMPLETE": shell})
        assert out.returncode == 0 and mark in out.stdout, (shell, out.stdout[:300], out.stderr[-300:])
    out = python_m(env={"_GPUFEED_COMPLETE": "bash_complete", "COMP_WORDS": "gpufeed con", "COMP_CWORD": "1"})
    assert out.returncode == 0 and out.stdout.split() == ["plain,config"]


# --------------------------------------------------------------------------- gpufeed config


def test_config_defaults_is_the_default_config_and_configs_default_toml(tmp_path: Path) -> None:
    from gpufeed.config import Config, load_config, tomllib

    text = invoke(["config", "--defaults"], expect=None).stdout
    tomllib.loads(text)  # parses
    path = tmp_path / "d.toml"
    path.write_text(text, encoding="utf-8")
    assert load_config(path) == Config()
    assert text == (ROOT / "configs" / "default.toml").read_text(encoding="utf-8"), (
        "configs/default.toml is out of date: regenerate it with gpufeed config --defaults > configs/default.toml")


def test_config_prints_a_file_resolved_over_the_defaults(tmp_path: Path) -> None:
    from gpufeed.config import load_config

    mine = tmp_path / "mine.toml"
    mine.write_text('[loader]\nbatch_size = 8\n[tune]\nram_budget = "3GiB"\n[train]\nsteps = 7\n')
    res = invoke(["config", "--config", mine], expect=None)
    assert res.exit_code == 0
    again = tmp_path / "again.toml"
    again.write_text(res.stdout, encoding="utf-8")
    assert load_config(again) == load_config(mine) != load_config(None)
    assert 'ram_budget = "3GiB"' in res.stdout and "\nsteps = 7\n" in res.stdout
    assert invoke(["config"], expect=None).exit_code == 2
    assert invoke(["config", "--defaults", "--config", mine], expect=None).exit_code == 2


# --------------------------------------------------------------------------- io's run folder


def test_io_leaves_report_md_and_a_chart(image_folder, shard_set: Path, tmp_path: Path) -> None:
    folder = image_folder(classes=1, per_class=4, name="imgs")
    run = tmp_path / "run"
    res = invoke(["io", shard_set, folder, "--max-readers", 2, "--seconds", 0.2, "--run-dir", run, "--quiet"], expect=None)
    assert res.exit_code == 0, res.stderr
    assert (run / "io.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    summary = json.loads((run / "summary.json").read_text())
    report = (run / "report.md").read_text()
    assert "](io.png)" in report
    for loc in summary["locations"]:
        assert loc["path"] in report
        for step in loc["steps"]:
            assert f"{step['mb_per_s']:,.1f}" in report and f"{step['files_per_s']:,.1f}" in report
    assert not list(run.glob("*.tmp*")) and not list(run.glob(".*"))


# --------------------------------------------------------------------------- "page cache"


def test_tune_says_page_cache_when_no_read_reached_the_device() -> None:
    import dataclasses

    from gpufeed.config import LoaderConfig
    from gpufeed.measure.storage_rate import StorageRate
    from gpufeed.tune import TuneReport, render, trial_record

    cfg = LoaderConfig(batch_size=8)
    trials = [trial_record(cfg, [100.0], trial=0, read_bytes_per_s=0.0, num_samples=800),
              trial_record(cfg, [90.0], trial=1, read_bytes_per_s=5e6, num_samples=700)]
    report = TuneReport(
        ok=True, shards="s", run_dir=None, out=None, best=cfg, best_trial=0, best_samples_per_s=100.0, baseline=None,
        baseline_samples_per_s=None, ratio_vs_baseline=None, bound=None, bound_evidence="", stop_reason="done",
        skipped={}, decisions=[], conclusion="best: ...", budget_s=5, elapsed_s=1, target_rate=None,
        target_met=None, usable_cpus=2, device="cpu", num_trials=2, trials=trials,
        storage=StorageRate(bytes_per_s=100e6, source="probe", readers=4, cache="cold"))
    lines = render(report).splitlines()
    rows = {line.split()[1]: line for line in lines[2:4]}  # by trial number
    assert rows["0"].endswith(" page cache") and rows["1"].endswith(" 5.0")
    storage = next(line for line in lines if line.startswith("storage:"))
    assert storage.endswith("the best trial read from the page cache (no device reads)") and " 0.0 MB/s" not in storage
    # a trial that read nothing at all is not a page-cache hit
    empty = dataclasses.replace(report, trials=[trial_record(cfg, [0.0], trial=0, read_bytes_per_s=0.0)])
    assert "page cache" not in render(empty)


def test_train_says_page_cache_when_the_loader_read_nothing_from_the_device() -> None:
    from gpufeed.train.report import storage_line

    s = {"storage": {"bytes_per_s": 2e8, "source": "probe", "readers": 2, "cache": "cold"},
         "loader_read_bytes_per_s": 0.0, "modes": {"loader-only": {"samples_per_s": 500.0, "read_bytes_per_s": 0.0}}}
    assert storage_line(s) == ("storage: 200.0 MB/s (probe, 2 reader(s), cold); the loader read from the page cache "
                               "(no device reads)")
    s["loader_read_bytes_per_s"] = 3.5e6
    assert storage_line(s).endswith("; the loader read 3.5 MB/s")


# --------------------------------------------------------------------------- dependencies and tested versions


IMPORT_TO_DIST = {"PIL": "pillow", "skimage": "scikit-image", "pynvml": "nvidia-ml-py", "yaml": "pyyaml",
                  "sklearn": "scikit-learn", "cv2": "opencv-python", "nvidia": "nvidia-nvimgcodec-cu12"}
"""Import names that differ from their distribution's name (``nvidia`` is a namespace many NVIDIA wheels share;
the only ``nvidia.*`` that src/ imports is ``nvidia.nvimgcodec``, decode = "roi")."""


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def test_every_third_party_import_is_declared() -> None:
    from gpufeed.config import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    requirements = list(project["dependencies"])
    requirements += [r for extra, reqs in project.get("optional-dependencies", {}).items() if extra != "dev"
                     for r in reqs]
    declared = {_norm(re.match(r"[A-Za-z0-9._-]+", r).group(0)) for r in requirements}
    imported: dict[str, str] = {}
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                     [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module else [])
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in ("gpufeed", "__future__", "tomllib"):
                    imported.setdefault(top, f"{path.relative_to(SRC)}:{node.lineno}")
    assert "braceexpand" in imported  # the scan sees lazy imports inside functions
    missing = {top: where for top, where in imported.items() if _norm(IMPORT_TO_DIST.get(top, top)) not in declared}
    assert missing == {}, f"imported but not declared in pyproject.toml: {missing}"


def test_tested_versions_are_constraints_txt() -> None:
    from gpufeed.core.tested import TESTED_VERSIONS

    pins = dict(re.findall(r"^([A-Za-z0-9._-]+)==(\S+)", (ROOT / "constraints.txt").read_text(), re.MULTILINE))
    assert {k: pins[k] for k in ("torch", "torchvision")} == TESTED_VERSIONS


def test_doctor_notes_torch_other_than_the_tested_version() -> None:
    from gpufeed import doctor as d
    from gpufeed.config import LoaderConfig
    from gpufeed.core.tested import TESTED_VERSIONS

    same = {k: f"{v}+cu130" for k, v in TESTED_VERSIONS.items()}
    assert d.check_tested(d.Facts(versions=same)).status == "ok"
    newer = {**same, "torch": "99.0.0+cu999"}
    c = d.check_tested(d.Facts(versions=newer))
    assert c.status == "warn" and "torch 99.0.0+cu999" in c.evidence and f"torch {TESTED_VERSIONS['torch']}" in c.evidence
    assert f"torch=={TESTED_VERSIONS['torch']}" in c.fix and "torchvision 0" not in c.evidence.split(";")[0]
    report = d.run_checks(d.Facts(versions=newer, usable_cpus=8, host_cpus=8, affinity_cpus=8, ram_total=10**10,
                                  ram_available=10**10, shm_total=10**10, shm_free=10**10, nofile_soft=65536),
                          LoaderConfig())
    assert report.ok and "tested versions" in {ch.name for ch in report.checks}
