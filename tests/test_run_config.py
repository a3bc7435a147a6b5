"""gpufeed run's config: the default [run] steps (the full training when [train] epochs or steps asks for it, an
explicit steps list run as given) and the [shard.val] table (the validation set), read and resolved only: no step
runs here but a tiny shard + verify."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufeed.config import DEFAULT_STEPS, ShardConfig, load_config, render_config
from gpufeed.core.errors import ConfigError, DataError
from tests.common import invoke, invoke_json
from tests.test_run import write_images


def load(tmp_path: Path, text: str, overrides: dict | None = None):
    path = tmp_path / "run.toml"
    path.write_text(text)
    return load_config(path, overrides)


def would_run(cfg) -> list[str]:
    """The steps gpufeed run would run for ``cfg``, in order (what run_pipeline chooses)."""
    from gpufeed.pipeline import _check_plan
    from gpufeed.pipeline.steps import STEP_TABLE

    _check_plan(cfg)
    return [s.name for s in STEP_TABLE if s.name in cfg.run.steps]


# --------------------------------------------------------------------------- default steps


@pytest.mark.parametrize("train", ["epochs = 90", "steps = 500", "epochs = 1"])
def test_train_epochs_or_steps_add_the_full_training(tmp_path: Path, train: str) -> None:
    cfg = load(tmp_path, f'[shard]\nsrc = "/data/train"\n[train]\n{train}\n')
    assert would_run(cfg) == [*DEFAULT_STEPS, "train"]


def test_without_train_epochs_or_steps_the_default_stops_at_measure(tmp_path: Path) -> None:
    cfg = load(tmp_path, '[shard]\nsrc = "/data/train"\n[train]\narch = "resnet18"\n[run]\ndir = "r"\n')
    assert would_run(cfg) == list(DEFAULT_STEPS) and "train" not in cfg.run.steps


def test_explicit_steps_are_authoritative(tmp_path: Path) -> None:
    cfg = load(tmp_path, '[run]\nsteps = ["shard", "verify", "tune"]\n[shard]\nsrc = "/d"\n[train]\nepochs = 90\n')
    assert would_run(cfg) == ["shard", "verify", "tune"]
    cfg = load(tmp_path, '[run]\nsteps = ["train", "shard"]\n[shard]\nsrc = "/d"\n')  # train without epochs: given
    assert would_run(cfg) == ["shard", "train"]


def test_an_epochs_override_counts_like_the_file(tmp_path: Path) -> None:
    cfg = load(tmp_path, '[shard]\nsrc = "/d"\n', {"train.epochs": 3, "train.steps": None})
    assert cfg.run.steps[-1] == "train"


def test_presets_steps() -> None:
    root = Path(__file__).resolve().parents[1] / "configs"
    assert "train" in load_config(root / "imagenet-resnet50-8gpu.toml").run.steps
    assert "train" not in load_config(root / "single-gpu.toml").run.steps  # its explicit list leaves train out
    assert load_config(root / "default.toml").run.steps == DEFAULT_STEPS


# --------------------------------------------------------------------------- [shard.val]

VAL = """
[shard]
src = "/data/train"
dest = "/nvme/train"
multiple_of = 4
shard_samples = 6
max_size = 256
[shard.val]
src = "/data/val"
{extra}
"""


def test_shard_val_takes_shard_options_and_its_own(tmp_path: Path) -> None:
    cfg = load(tmp_path, VAL.format(extra='dest = "/nvme/val"\nshard_samples = 3'))
    val = cfg.shard_val
    assert isinstance(val, ShardConfig)
    assert (val.src, val.dest, val.prefix) == ("/data/val", "/nvme/val", "val")
    assert (val.multiple_of, val.max_size, val.shard_samples) == (4, 256, 3)  # inherited, inherited, its own
    assert (cfg.shard.src, cfg.shard.shard_samples, cfg.shard.prefix) == ("/data/train", 6, "train")


def test_no_shard_val_is_none(tmp_path: Path) -> None:
    assert load(tmp_path, '[shard]\nsrc = "/d"\n').shard_val is None


def test_shard_val_reads_back_from_config_output(tmp_path: Path) -> None:
    cfg = load(tmp_path, VAL.format(extra='quality = 80\nprefix = "valid"'))
    again = tmp_path / "again.toml"
    again.write_text(render_config(cfg))
    assert load_config(again) == cfg


@pytest.mark.parametrize("text, words", [
    (VAL.format(extra="bogus = 1"), "[shard.val]: unknown key(s) ['bogus']"),
    (VAL.format(extra="multiple_of = 0"), "[shard.val]"),
    (VAL.format(extra="[shard.val.deeper]\nx = 1"), "unknown key(s) ['deeper']"),
    ('[shard.val]\ndest = "/v"\n', "[shard.val]: src is missing"),
    ('[shard]\nval = "/data/val"\n', "[shard.val] must be a table"),
    ('[run]\nval_src = "/data/val"\n', "val_src moved to the [shard.val] table"),
    ('[loader.val]\nsrc = "/x"\n', "[loader]: unknown key(s) ['val']"),
    ('[train]\nepochs = 2\n[train.val]\nsrc = "/x"\n', "[train]: unknown key(s) ['val']"),
])
def test_bad_shard_val_is_one_sentence(tmp_path: Path, text: str, words: str) -> None:
    with pytest.raises(ConfigError) as info:
        load(tmp_path, text)
    assert words in str(info.value)


def test_shard_val_without_the_shard_step_is_refused(tmp_path: Path) -> None:
    from gpufeed.pipeline import _check_plan

    cfg = load(tmp_path, '[run]\nsteps = ["verify"]\n[train]\nshards = "/s"\n[shard.val]\nsrc = "/v"\n')
    with pytest.raises(DataError, match=r"\[shard.val\] is written by the shard step"):
        _check_plan(cfg)


def test_shard_step_prepares_the_val_set(tmp_path: Path) -> None:
    from gpufeed.pipeline.steps import Carry, Context, prepare_shard

    cfg = load(tmp_path, VAL.format(extra=""))
    (train, val), options, _inputs = prepare_shard(Context(cfg=cfg, run_dir=tmp_path / "run", carry=Carry()))
    assert val.dest == str(tmp_path / "run" / "shard" / "val") and val.src == "/data/val"
    assert options["val"]["prefix"] == "val" and options["val"]["multiple_of"] == 4
    assert train.dest == "/nvme/train"


def test_run_shards_and_verifies_the_val_set(tmp_path: Path) -> None:
    train = write_images(tmp_path / "train", per_class=6)
    val = write_images(tmp_path / "val", per_class=3)
    cfg = tmp_path / "val.toml"
    cfg.write_text(f'[run]\nsteps = ["shard", "verify"]\n[shard]\nsrc = "{train}"\nshard_samples = 4\n'
                   f'[shard.val]\nsrc = "{val}"\n')
    run_dir = tmp_path / "run"
    record = invoke_json(["run", cfg, "--run-dir", run_dir, "--quiet", "--no-report"], expect=0)
    assert record["status"] == "done", record
    manifest = json.loads((run_dir / "shard" / "val" / "manifest.json").read_text())
    assert manifest["num_samples"] == 6  # 2 classes x 3
    assert sorted(p.name for p in (run_dir / "shard" / "val").glob("val-*.tar"))
    assert (run_dir / "shard" / "val.json").is_file() and (run_dir / "verify" / "val.json").is_file()
    shard = next(s for s in json.loads((run_dir / "run.json").read_text())["steps"] if s["name"] == "shard")
    assert shard["output"]["val"] == str(run_dir / "shard" / "val") and shard["output"]["val_sha256"]
    invoke(["run", cfg, "--run-dir", run_dir, "--quiet", "--no-report"])  # same config: both skipped
    assert json.loads((run_dir / "run.json").read_text())["skipped"] == ["shard", "verify"]
