"""gpufeed run and gpufeed report: the demo end to end, skipping and resuming (kill -9 during tune), a changed
[tune] option, the presets, bad configs, and the report's pages for run, tune and train folders."""

from __future__ import annotations

import html
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gpufeed.core.dest import release_lock

from gpufeed.config import TrainConfig, load_config
from tests.common.cli import invoke, invoke_json

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = ROOT / "configs"


def run_json(run_dir: Path) -> dict:
    return json.loads((run_dir / "run.json").read_text())


def write_images(root: Path, per_class: int = 12, classes: int = 2) -> Path:
    """A tiny ImageFolder of 32x32 JPEGs."""
    from PIL import Image

    for c in range(classes):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(per_class):
            Image.new("RGB", (32, 32), (40 * c + i, 90, 200 - 5 * i)).save(root / f"c{c}" / f"{i}.jpg", quality=90)
    return root


TINY = """
[run]
steps = ["shard", "verify", "tune", "measure"]
[shard]
src = "{src}"
shard_samples = 6
multiple_of = 2
[loader]
batch_size = 4
image_size = 16
decode = "pil"
[tune]
budget_s = {budget}
repeats = 1
[train]
arch = "resnet18"
batch_size = 4
image_size = 16
amp = "off"
device = "cpu"
threads = 1
measure_steps = 2
timing_warmup_steps = 1
log_every = 1
storage_probe_s = 0.0
"""


# --------------------------------------------------------------------------- presets and bad configs


@pytest.mark.parametrize("name", ["demo.toml", "single-gpu.toml", "imagenet-resnet50-8gpu.toml", "multi-node.toml"])
def test_preset_loads(name: str) -> None:
    from gpufeed.pipeline import _check_plan

    cfg = load_config(CONFIGS / name)
    _check_plan(cfg)
    assert cfg.run.steps


def test_imagenet_preset_is_what_the_issue_asks() -> None:
    cfg = load_config(CONFIGS / "imagenet-resnet50-8gpu.toml")
    assert cfg.train.nproc_per_node == 8 and cfg.train.amp == "bf16" and cfg.train.channels_last
    assert cfg.shard_val and cfg.shard_val.src and cfg.shard.src and cfg.shard.multiple_of % 8 == 0
    assert cfg.shard_val.multiple_of == cfg.shard.multiple_of and cfg.shard_val.prefix == "val"


def test_multi_node_preset_stages_per_node() -> None:
    cfg = load_config(CONFIGS / "multi-node.toml")
    assert cfg.train.nnodes == "2" and cfg.train.rdzv_endpoint and "stage" in cfg.run.steps
    assert cfg.stage.num_nodes == 2 and cfg.loader.shard_split == "node"


@pytest.mark.parametrize("text, words", [
    ('[run]\nsteps = ["shard", "bogus"]\n', "must be one of"),
    ('[run]\nfoo = 1\n', "unknown key"),
    ('[run]\nsteps = ["verify"]\n', "[train] shards"),
    ('[run]\nsteps = ["stage"]\n[train]\nshards = "x"\n', "[stage] dest"),
])
def test_bad_run_config_exits_2_before_work(tmp_path: Path, text: str, words: str) -> None:
    cfg = tmp_path / "bad.toml"
    cfg.write_text(text)
    result = invoke(["run", cfg, "--run-dir", tmp_path / "r"], expect=2)
    assert words in result.stderr and result.stderr.count("\n") == 1
    assert not (tmp_path / "r" / "run.json").exists()


def test_measure_step_passes_fix_only_when_train_has_it() -> None:
    import dataclasses

    from gpufeed.pipeline.steps import _with_fix

    has_fix = "fix" in {f.name for f in dataclasses.fields(TrainConfig)}
    out = _with_fix(TrainConfig(mode="measure"))
    assert getattr(out, "fix", None) is (True if has_fix else None)


# --------------------------------------------------------------------------- the demo, end to end


@pytest.fixture(scope="module")
def demo(tmp_path_factory) -> Path:
    """configs/demo.toml run once, into a tmp run folder (cwd: a tmp folder, so runs/ lands there)."""
    here = tmp_path_factory.mktemp("demo")
    old = os.getcwd()
    os.chdir(here)
    try:
        record = invoke_json(["run", CONFIGS / "demo.toml", "--quiet"], expect=None)
    finally:
        os.chdir(old)
    run_dir = here / "runs" / "demo"
    assert record["run_dir"] == str(run_dir), record
    assert record["status"] in ("done", "check_failed"), record
    return run_dir


def test_demo_runs_every_step_and_writes_the_report(demo: Path) -> None:
    state = run_json(demo)
    names = [s["name"] for s in state["steps"]]
    assert names == ["doctor", "synth", "shard", "verify", "io", "ceiling", "tune", "measure"]
    assert all(s["status"] in ("done", "check_failed") and s["hash"] for s in state["steps"])
    assert state["ran"] == names and state["skipped"] == []
    for name in names:
        assert (demo / name / "summary.json").is_file(), name
    # passed forward: the set into tune and train, the ceiling into tune's target, the tuned loader into train
    tune = json.loads((demo / "tune" / "summary.json").read_text())
    measure = json.loads((demo / "measure" / "summary.json").read_text())
    ceiling = json.loads((demo / "ceiling" / "summary.json").read_text())
    assert tune["shards"] == str(demo / "shard" / "set")
    assert tune["target_rate"] == pytest.approx(ceiling["modes"]["synthetic"]["samples_per_s"])
    tuned = load_config(demo / "tune" / "tuned.toml").loader
    used = load_config(demo / "measure" / "config.toml").loader
    assert used.num_workers == tuned.num_workers and used.decode == tuned.decode
    page = (demo / "report.html").read_text()
    verdict = measure["verdict"]
    assert verdict["status"].upper() in page.upper() and html.escape(verdict["reason"]) in page
    assert "http://" not in page.replace('xmlns="http://www.w3.org/2000/svg"', "") and "<script" not in page
    assert (demo / "report.md").read_text().startswith("# gpufeed run")


def test_rerun_skips_every_finished_step(demo: Path) -> None:
    record = invoke_json(["run", CONFIGS / "demo.toml", "--run-dir", demo, "--quiet"], expect=None)
    state = run_json(demo)
    assert state["ran"] == [] and record["ran"] == []
    assert state["skipped"] == [s["name"] for s in state["steps"]]


def test_changed_tune_option_reruns_tune_and_train_not_shard(demo: Path, tmp_path: Path) -> None:
    text = (CONFIGS / "demo.toml").read_text().replace("repeats = 2", "repeats = 1")
    assert text != (CONFIGS / "demo.toml").read_text()
    cfg = tmp_path / "demo.toml"
    cfg.write_text(text)
    invoke_json(["run", cfg, "--run-dir", demo, "--quiet"], expect=None)
    state = run_json(demo)
    assert state["ran"] == ["tune", "measure"]
    assert {"doctor", "synth", "shard", "verify", "io", "ceiling"} <= set(state["skipped"])


def test_a_damaged_output_reruns_its_step(demo: Path, tmp_path: Path) -> None:
    """A step whose output no longer matches run.json (here: the tuned config edited) runs again, and so does
    every step after it."""
    tuned = demo / "tune" / "tuned.toml"
    tuned.write_text(tuned.read_text() + "\n# edited\n")
    invoke_json(["run", CONFIGS / "demo.toml", "--run-dir", demo, "--quiet"], expect=None)
    assert run_json(demo)["ran"] == ["tune", "measure"]


def test_report_of_single_tune_and_train_folders(demo: Path) -> None:
    for name, kind in (("tune", "tune"), ("measure", "train")):
        record = invoke_json(["report", demo / name])
        assert record["kind"] == kind and Path(record["html"]).is_file()
        assert Path(record["markdown"]).name == "report-page.md"  # the job's own report.md stays
        assert (demo / name / "report.md").is_file()


# --------------------------------------------------------------------------- kill -9 during tune, then resume


def test_sigkill_during_tune_then_rerun_continues(tmp_path: Path) -> None:
    src = write_images(tmp_path / "images")
    cfg = tmp_path / "tiny.toml"
    cfg.write_text(TINY.format(src=src, budget=8.0))
    run_dir = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", ""))
    proc = subprocess.Popen([sys.executable, "-m", "gpufeed", "run", str(cfg), "--run-dir", str(run_dir), "--quiet"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            try:
                steps = {s["name"]: s["status"] for s in run_json(run_dir)["steps"]}
            except (OSError, ValueError):
                steps = {}
            if steps.get("tune") == "running":
                break
            time.sleep(0.05)
        assert proc.poll() is None, f"the run ended before tune was killed: {proc.stderr.read().decode()}"
        time.sleep(1.0)  # well inside tune's 8 s budget
        os.killpg(proc.pid, signal.SIGKILL)  # the run and every process it started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    before = {s["name"]: s["status"] for s in run_json(run_dir)["steps"]}
    assert before == {"shard": "done", "verify": "done", "tune": "running", "measure": "pending"}
    record = invoke_json(["run", cfg, "--run-dir", run_dir, "--quiet"], expect=None)
    state = run_json(run_dir)
    assert state["skipped"] == ["shard", "verify"] and state["ran"] == ["tune", "measure"], record
    assert all(s["status"] in ("done", "check_failed") for s in state["steps"])
    assert state["steps"][2]["attempts"] == 2 and state["steps"][0]["attempts"] == 1


def test_second_run_into_a_busy_folder_is_refused(tmp_path: Path) -> None:
    from gpufeed.core.dest import release_lock, take_lock

    cfg = tmp_path / "c.toml"
    cfg.write_text(TINY.format(src=write_images(tmp_path / "images"), budget=1.0))
    (tmp_path / "run").mkdir()
    fd = take_lock(tmp_path / "run" / ".lock", what="run lock", in_use=lambda who: who)
    try:
        result = invoke(["run", cfg, "--run-dir", tmp_path / "run"], expect=2)
        assert "in use by another gpufeed run" in result.stderr
    finally:
        release_lock(fd)


def _signal_then_wait(ready, stop) -> None:
    ready.set()
    stop.wait(30)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="fork")
def test_a_forked_child_that_outlives_the_run_does_not_keep_its_lock(tmp_path: Path) -> None:
    """A flock belongs to the open file that fork shares: a persistent loader worker (started by fork) still alive
    after the run released its lock kept the run folder "in use by another gpufeed run" (the demo's re-run in
    one process, once tune chose a worker). Forked children close their copies of the lock descriptors."""
    import multiprocessing as mp

    from gpufeed.core.dest import take_lock

    lock = tmp_path / ".lock"
    fd = take_lock(lock, what="run lock", in_use=lambda who: f"in use{who}")
    ctx = mp.get_context("fork")
    ready, stop = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_signal_then_wait, args=(ready, stop))
    child.start()
    try:
        assert ready.wait(30)  # the child runs (its fork hooks have run)
        release_lock(fd)
        again = take_lock(lock, what="run lock", in_use=lambda who: f"in use{who}")  # the child still lives
        assert child.is_alive()
        release_lock(again)
    finally:
        stop.set()
        child.join(30)


# --------------------------------------------------------------------------- the report from records


def _fake_run(tmp_path: Path, train: dict | None) -> Path:
    run = tmp_path / "fake"
    (run / "measure").mkdir(parents=True)
    steps = [{"name": "measure", "status": "done", "hash": "h", "skipped": False, "wall_s": 1.0}]
    (run / "run.json").write_text(json.dumps({"format": "gpufeed-run", "version": 1, "status": "done",
                                              "steps": steps}))
    if train is not None:
        (run / "measure" / "summary.json").write_text(json.dumps(train))
    return run


def test_report_copies_the_verdict_and_lists_fixes_tried(tmp_path: Path) -> None:
    verdict = {"status": "starved", "bound": "storage", "reason": "a sentence from the record 123.4",
               "fixes": ["stage the set to /dev/shm (fits: 1 GB of 10 GB)"], "numbers": {}}
    train = {"mode": "measure", "verdict": verdict, "modes": {
        "real": {"samples_per_s": 50.0, "stall_pct": 60.0, "per_rank": [
            {"rank": 0, "step_s": 10.0, "data_wait_s": 6.0, "h2d_s": 1.0, "compute_s": 3.0}]},
        "synthetic": {"samples_per_s": 200.0}, "loader-only": {"samples_per_s": 55.0}},
        "fixes_tried": [{"fix": "num_workers 4 -> 8", "before_samples_per_s": 50.0, "after_samples_per_s": 90.5,
                         "kept": True}]}
    run = _fake_run(tmp_path, train)
    record = invoke_json(["report", run])
    page = (run / "report.html").read_text()
    assert record["verdict"] == "starved"
    assert "a sentence from the record 123.4" in page and "stage the set to /dev/shm" in page
    assert "num_workers 4 -&gt; 8: 50 → 90.5 samples/s, kept" in page
    assert "No doctor record" in page and "No shard record" in page and "No io record" in page
    assert set(record["missing"]) >= {"doctor", "shard", "io", "tune"}
    md = (run / "report.md").read_text()
    assert "# Verdict: starved — storage-bound" in md and "| rank" not in md


def test_report_without_fixes_tried_says_none_was_tried(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, {"mode": "measure", "verdict": None, "modes": {}})
    invoke(["report", run])
    page = (run / "report.html").read_text()
    assert "no fix was tried" in page and "no verdict" in page


def test_report_without_train_record_says_so(tmp_path: Path) -> None:
    run = _fake_run(tmp_path, None)
    record = invoke_json(["report", run])
    assert record["verdict"] is None and "train" in record["missing"]
    assert "No train record" in (run / "report.html").read_text()


def test_report_refuses_a_folder_without_records(tmp_path: Path) -> None:
    result = invoke(["report", tmp_path], expect=2)
    assert "neither run.json" in result.stderr
