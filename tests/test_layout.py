"""The node layout: the per-rank worker ceiling, the [layout] section, and train's one-line warning."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from gpufeed.config import LayoutConfig, LoaderConfig, TrainConfig, load_config
from gpufeed.core.errors import ConfigError
from gpufeed.layout import check, loader_cores, worker_ceiling


@pytest.mark.parametrize("usable, ranks, trainer, budget, loaders, ceiling", [
    (16, 1, 1, 1.0, 15, 15),   # one rank: every core but the trainer's
    (16, 8, 1, 1.0, 8, 1),     # 8 ranks: 8 cores left for 8 loaders
    (16, 8, 0, 1.0, 16, 2),    # --trainer-cores 0: the old whole-machine budget, split
    (2, 2, 1, 1.0, 0, 0),      # this machine, 2 ranks: the trainers take both cores, load in the trainer
    (16, 2, 1, 0.5, 8, 4),     # cpu_budget caps below what the trainers leave
    (4, 8, 1, 1.0, 0, 0),      # more trainers than cores: nothing left, never negative
])
def test_worker_ceiling_leaves_each_trainer_its_cores(usable: int, ranks: int, trainer: int, budget: float,
                                                       loaders: float, ceiling: int) -> None:
    assert loader_cores(usable, ranks, trainer, budget) == loaders
    assert worker_ceiling(usable, ranks, trainer, budget) == ceiling
    assert ranks * ceiling <= max(0, usable - ranks * trainer)


def test_warning_names_the_issue_over_subscription_in_numbers() -> None:
    tuned_alone = LayoutConfig(ranks_per_node=1, usable_cores=16, trainer_cores=1, device="cuda")
    line = check(LoaderConfig(num_workers=15), tuned_alone, ranks=8, usable=16, device="cuda:0")
    assert line is not None and "\n" not in line
    assert line == ("warning: [loader] was tuned for 1 rank per node on 16 usable cores (cuda), this run has "
                    "8 ranks on 16 (cuda); 8 ranks x 15 workers = 120 processes on 16 usable cores (8 after 8 "
                    "training processes x 1 core); re-tune with gpufeed tune --nproc-per-node 8")


def test_no_warning_for_the_tuned_layout() -> None:
    tuned = LayoutConfig(ranks_per_node=8, usable_cores=16, trainer_cores=1, device="cuda")
    assert check(LoaderConfig(num_workers=1), tuned, ranks=8, usable=16, device="cuda:3") is None
    # the same layout with workers raised by hand (train --num-workers 4) over-subscribes: named
    line = check(LoaderConfig(num_workers=4), tuned, ranks=8, usable=16, device="cuda")
    assert line is not None and "8 ranks x 4 workers = 32 processes on 16 usable cores" in line
    assert "tuned for" not in line


def test_warning_for_another_device_or_core_count_and_trainer_cores_in_the_hint() -> None:
    tuned = LayoutConfig(ranks_per_node=2, usable_cores=32, trainer_cores=2, device="cpu")
    line = check(LoaderConfig(num_workers=2), tuned, ranks=2, usable=16, device="cuda:0")
    assert line is not None
    assert "tuned for 2 ranks per node on 32 usable cores (cpu), this run has 2 ranks on 16 (cuda)" in line
    assert "processes" not in line  # 2 x 2 workers fit in 16 - 2 x 2
    assert line.endswith("re-tune with gpufeed tune --nproc-per-node 2 --trainer-cores 2")


def test_without_a_tuned_layout_only_multi_rank_over_subscription_is_named() -> None:
    none = LayoutConfig()
    assert check(LoaderConfig(num_workers=4), none, ranks=1, usable=2, device="cpu") is None
    assert check(LoaderConfig(num_workers=0), none, ranks=8, usable=4, device="cpu") is None
    line = check(LoaderConfig(num_workers=4), none, ranks=2, usable=2, device="cpu")
    assert line == ("warning: 2 ranks x 4 workers = 8 processes on 2 usable cores (0 after 2 training processes "
                    "x 1 core); re-tune with gpufeed tune --nproc-per-node 2")


def test_layout_section_is_bounded_and_typed(tmp_path: Path) -> None:
    path = tmp_path / "c.toml"
    path.write_text('[layout]\nranks_per_node = 8\nusable_cores = 16\ntrainer_cores = 1\ndevice = "cuda"\n')
    assert load_config(path).layout == LayoutConfig(ranks_per_node=8, usable_cores=16, trainer_cores=1,
                                                    device="cuda")
    for bad, word in (("ranks_per_node = 0", "ranks_per_node"), ("usable_cores = -1", "usable_cores"),
                      ('device = "tpu"', "device"), ("trainer_cores = 1e9", "trainer_cores"),
                      ("workers = 3", "unknown key")):
        path.write_text(f"[layout]\n{bad}\n")
        with pytest.raises(ConfigError, match=word):
            load_config(path)


def test_launch_prints_the_warning_once_before_it_starts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                         capsys: pytest.CaptureFixture[str]) -> None:
    """The [layout] of a tuned config reaches launch(), which names the mismatch on stderr, then runs."""
    import gpufeed.train.launch
    import gpufeed.core.system

    ran: list[Any] = []
    monkeypatch.setattr(gpufeed.train.launch, "train",
                        lambda cfg, lc, world, run_dir, **kw: ran.append(cfg) or {"ok": True})
    monkeypatch.setattr(gpufeed.core.system, "usable_cpus", lambda: 16)
    path = tmp_path / "tuned.toml"
    path.write_text("[loader]\nnum_workers = 15\n\n"
                    '[layout]\nranks_per_node = 8\nusable_cores = 16\ntrainer_cores = 1\ndevice = "cpu"\n')
    conf = load_config(path, {"train.mode": "synthetic", "train.device": "cpu", "train.run_dir": str(tmp_path / "r")})
    gpufeed.train.launch.launch(conf.train, conf.loader, conf.layout)
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["warning: [loader] was tuned for 8 ranks per node on 16 usable cores (cpu), this run has 1 rank "
                   "on 16 (cpu); re-tune with gpufeed tune --nproc-per-node 1"]
    assert len(ran) == 1
    gpufeed.train.launch.launch(TrainConfig(mode="synthetic", device="cpu", run_dir=str(tmp_path / "r2")), conf.loader)
    assert capsys.readouterr().err == ""  # no [layout], one rank: nothing to say
