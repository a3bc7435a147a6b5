"""gpufeed io (gpufeed.storage): read rates per location and reader count, bounded steps, the need and fit lines."""

from __future__ import annotations

import json
import math
import shutil
import tempfile
import time
from pathlib import Path

import pytest

from gpufeed.config import IoConfig
from gpufeed.shardset.manifest import read_manifest
from gpufeed.measure.storage_probe import filesystem_of, reader_ladder
from gpufeed.storage import measure_io
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_tiny_shards


@pytest.fixture
def shards(tmp_path: Path) -> Path:
    return write_tiny_shards(tmp_path / "shards", [12, 12, 12, 12], image_px=48)


def _steps(loc: dict) -> list[dict]:
    assert loc["steps"], loc
    return loc["steps"]


def test_shard_set_figures_are_positive_and_each_step_honours_bytes(shards: Path, tmp_path: Path) -> None:
    bound = 50_000  # well below the set's size: every step must stop at it, not at the end of the data
    assert read_manifest(shards).total_bytes > 4 * bound
    run = tmp_path / "run"
    rec = invoke_json(["io", shards, "--bytes", bound, "--seconds", 30, "--max-readers", 4, "--run-dir", run])
    (loc,) = rec["locations"]
    assert loc["kind"] == "shards" and loc["files"] == 4
    assert [s["readers"] for s in loc["steps"] if s["cache"] == "warm"] == [1, 2, 4]
    for s in _steps(loc):
        assert math.isfinite(s["mb_per_s"]) and s["mb_per_s"] > 0
        assert math.isfinite(s["files_per_s"]) and s["files_per_s"] >= 0
        assert 0 < s["bytes"] <= bound  # reads are reserved from one budget: never past it, whatever the readers
        assert s["stopped_by"] == "bytes"
    assert json.loads((run / "summary.json").read_text())["locations"][0]["steps"] == loc["steps"]
    assert (run / "environment.json").is_file()


def test_a_step_stops_at_its_seconds_bound(image_folder) -> None:
    folder = image_folder(classes=4, per_class=10)  # 40 files at 0.05 s a read: 2 s unbounded

    class Slow:
        def __init__(self, path: str):
            self.f = open(path, "rb", buffering=0)

        def readinto(self, view) -> int:
            time.sleep(0.05)
            return self.f.readinto(view)

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    bound = 0.2
    rep = measure_io([str(folder)], IoConfig(seconds=bound, max_readers=1), opener=Slow, write_run=False)
    (loc,) = rep.locations
    assert loc.kind == "images" and loc.files == 40
    for s in loc.steps:
        assert s.stopped_by == "seconds"
        assert 0 < s.files < 40
        assert s.seconds <= bound + 0.05 + 0.5  # the bound, one read in flight, scheduling slack


def test_two_locations_give_two_groups_and_image_rates(shards: Path, image_folder, tmp_path: Path) -> None:
    folder = image_folder(classes=2, per_class=3)
    rec = invoke_json(["io", shards, folder, "--max-readers", 2, "--seconds", 5, "--run-dir", tmp_path / "r"])
    assert [(loc["path"], loc["kind"]) for loc in rec["locations"]] == [(str(shards), "shards"),
                                                                        (str(folder), "images")]
    images = rec["locations"][1]
    assert images["files"] == 6
    assert images["total_bytes"] == sum(p.stat().st_size for p in folder.rglob("*.jpg"))
    for s in _steps(images):
        assert s["stopped_by"] == "end" and s["files"] == 6 and s["bytes"] == images["total_bytes"]
        assert math.isfinite(s["files_per_s"]) and s["files_per_s"] > 0
    assert rec["target_rate"] is None and rec["locations"][0]["need"] is None and rec["ok"] is True
    assert any("rates are noisy" in note for note in rec["notes"])  # a few KB read in milliseconds


def test_need_and_fit_lines_say_the_computed_bandwidth(shards: Path, tmp_path: Path) -> None:
    rate = 1234.5
    need = rate * read_manifest(shards).mean_sample_bytes / 1e6
    args = ["io", shards, "--max-readers", 1, "--seconds", 5, "--target-rate", rate]
    rec = invoke_json([*args, "--run-dir", tmp_path / "a"])
    got = rec["locations"][0]["need"]
    assert got["need_mb_per_s"] == pytest.approx(need, rel=1e-12)
    assert got["delivers"] == (got["best_mb_per_s"] >= 1.2 * need)
    assert got["fits_page_cache"] is True  # a few hundred KB
    text = invoke([*args, "--run-dir", tmp_path / "b"]).stdout
    assert f"= {need:,.1f} MB/s" in text
    assert "in the page cache" in text and "/dev/shm" in text
    assert rec["ok"] is got["delivers"]


def test_an_unreachable_target_fails_the_check(shards: Path, tmp_path: Path) -> None:
    rec = invoke_json(["io", shards, "--max-readers", 1, "--target-rate", 1e9, "--run-dir", tmp_path / "r"], expect=1)
    assert rec["ok"] is False and rec["locations"][0]["need"]["delivers"] is False
    assert "does NOT deliver it" in invoke(["io", shards, "--max-readers", 1, "--target-rate", 1e9,
                                            "--run-dir", tmp_path / "s"], expect=1).stdout


def test_gpu_ceiling_from_a_train_record(shards: Path, tmp_path: Path) -> None:
    record = tmp_path / "summary.json"
    record.write_text(json.dumps({"modes": {"synthetic": {"samples_per_s": 800.0}}}))
    rec = invoke_json(["io", shards, "--max-readers", 1, "--gpu-ceiling", record, "--run-dir", tmp_path / "r"])
    assert rec["target_rate"] == 800.0 and rec["target_source"] == str(record)
    assert rec["locations"][0]["need"]["need_mb_per_s"] == pytest.approx(
        800.0 * read_manifest(shards).mean_sample_bytes / 1e6)
    record.write_text(json.dumps({"modes": {"real": {"samples_per_s": 800.0}}}))
    err = invoke(["io", shards, "--gpu-ceiling", record], expect=2).stderr
    assert err.startswith("error: ") and "no synthetic samples/s" in err and len(err.strip().splitlines()) == 1


@pytest.mark.skipif(filesystem_of("/dev/shm")[0] != "tmpfs", reason="/dev/shm is not tmpfs here")
def test_a_copy_on_tmpfs_reports_cold_as_not_measurable(shards: Path, tmp_path: Path) -> None:
    shm = Path(tempfile.mkdtemp(prefix="gpufeed-io-test-", dir="/dev/shm"))
    try:
        copy = shutil.copytree(shards, shm / "shards")
        rec = invoke_json(["io", shards, copy, "--max-readers", 2, "--run-dir", tmp_path / "r"])
        local, ram = rec["locations"]
        assert local["cold"] == "measured" and local["best_cold_mb_per_s"] > 0
        assert {s["cache"] for s in local["steps"]} == {"cold", "warm"}
        assert all(s["eviction"] for s in local["steps"] if s["cache"] == "cold")
        assert ram["fs_type"] == "tmpfs" and ram["cold"].startswith("not measurable on tmpfs")
        assert {s["cache"] for s in ram["steps"]} == {"warm"} and ram["best_cold_mb_per_s"] is None
        assert "cold not measurable on tmpfs" in invoke(["io", copy, "--max-readers", 1,
                                                        "--run-dir", tmp_path / "s"]).stdout
    finally:
        shutil.rmtree(shm)


def test_bad_options_and_paths_are_one_sentence_exit_2(tmp_path: Path) -> None:
    for args in (["--seconds", 0], ["--max-readers", 0], ["--bytes", "lots"]):
        err = invoke(["io", tmp_path, *args], expect=2).stderr
        assert err.startswith("error: ") and len(err.strip().splitlines()) == 1
    err = invoke(["io", tmp_path], expect=2).stderr  # an empty folder: neither shards nor images
    assert "no shard set" in err and str(tmp_path) in err


def test_reader_ladder() -> None:
    assert reader_ladder(1) == [1]
    assert reader_ladder(16) == [1, 2, 4, 8, 16]
    assert reader_ladder(12) == [1, 2, 4, 8, 12]
