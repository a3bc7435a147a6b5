"""Links in DEST, run folders and shard sets (docs/threat-model.md, "Files gpufeed writes, and how" and "Files read
from a set"): gpufeed never writes through a symbolic link it finds where it writes, and never reads a set's file
through a link that leads out of the set. Each test failed before :mod:`gpufeed.core.safefs` was routed in."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_tar, write_tiny_shards

SECRET = "AWS_SECRET_ACCESS_KEY=hunter2-do-not-leak"


@pytest.fixture()
def secret(tmp_path: Path) -> Path:
    """A user's private file outside every set and DEST (0600)."""
    p = tmp_path / "private" / "credentials"
    p.parent.mkdir()
    p.write_text(SECRET + "\n")
    p.chmod(0o600)
    return p


def _untouched(secret: Path) -> None:
    assert secret.read_text() == SECRET + "\n"
    assert secret.stat().st_mode & 0o777 == 0o600


def _nowhere(text: str, *folders: Path) -> None:
    """``text`` (the secret) is in no file under ``folders``."""
    for folder in folders:
        for p in folder.rglob("*"):
            if p.is_file() and not p.is_symlink():
                assert text.encode() not in p.read_bytes(), p


def _all_output(r) -> str:
    return r.stdout + r.stderr


# ---------------------------------------------------------------------------------------------------- locks


def test_a_shard_lock_that_is_a_link_is_replaced_its_target_untouched(tmp_path: Path, secret: Path,
                                                                      image_folder) -> None:
    src = image_folder(classes=2, per_class=2)
    dest = tmp_path / "dest"
    (dest / ".gpufeed").mkdir(parents=True)
    os.symlink(secret, dest / ".gpufeed" / "lock")
    invoke(["shard", src, dest, "--quiet", "--workers", "1"])
    _untouched(secret)
    lock = dest / ".gpufeed" / "lock"
    assert not lock.is_symlink() and lock.is_file()  # the link was replaced by gpufeed's own lock file
    assert lock.read_text().strip().isdigit()


def test_a_stage_lock_that_is_a_link_is_replaced_its_target_untouched(tmp_path: Path, secret: Path) -> None:
    src = write_tiny_shards(tmp_path / "src", [3, 2])
    dest = tmp_path / "dest"
    (dest / ".gpufeed-stage").mkdir(parents=True)
    os.symlink(secret, dest / ".gpufeed-stage" / "lock")
    invoke(["stage", src, dest, "--quiet"])
    _untouched(secret)
    lock = dest / ".gpufeed-stage" / "lock"
    assert not lock.is_symlink() and lock.read_text().strip().isdigit()


@pytest.mark.parametrize("state", [".gpufeed-stage", ".gpufeed"])
def test_a_state_folder_that_is_a_link_is_refused(tmp_path: Path, image_folder, state: str) -> None:
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    os.symlink(elsewhere, dest / state)
    if state == ".gpufeed":
        r = invoke(["shard", image_folder(classes=2, per_class=2), dest, "--quiet", "--workers", "1"], expect=2)
    else:
        r = invoke(["stage", write_tiny_shards(tmp_path / "src", [3]), dest, "--quiet"], expect=2)
    assert f"{dest / state} is not a folder (a symbolic link or a file)" in r.stderr
    assert list(elsewhere.iterdir()) == []  # nothing was written through the link


def test_a_fifo_where_gpufeed_writes_is_refused_not_waited_on(tmp_path: Path) -> None:
    from gpufeed.core.safefs import lock_file, open_append

    os.mkfifo(tmp_path / "lock")
    with pytest.raises(DataError, match="lock is not a regular file, so gpufeed does not write its lock there"):
        lock_file(tmp_path / "lock")
    (tmp_path / "log.jsonl").mkdir()
    with pytest.raises(DataError, match="log.jsonl is not a regular file"):
        open_append(tmp_path / "log.jsonl")


# ------------------------------------------------------------------------------------------------ run folders


def test_run_folder_config_report_and_log_links_are_replaced(tmp_path: Path, secret: Path, monkeypatch) -> None:
    """config.toml (launch), report.md and throughput.png (train_report), log.jsonl (records.append_jsonl, which the
    training loop appends to): each a link to the user's file in a run folder someone else prepared."""
    import gpufeed.train.report as train_report
    from gpufeed.config import LoaderConfig, TrainConfig
    from gpufeed.train.launch import write_run_config
    from gpufeed.core.records import append_jsonl

    run = tmp_path / "run"
    run.mkdir()
    names = ["config.toml", "report.md", "log.jsonl", "summary.json"]
    for name in names:
        os.symlink(secret, run / name)
    write_run_config(run / "config.toml", TrainConfig(), LoaderConfig())
    monkeypatch.setattr(train_report, "plot_summary", lambda run_dir, summary: None)
    monkeypatch.setattr(train_report, "render_markdown", lambda summary, plot: "# report\n")
    train_report.write_report(run, {"ok": True})  # type: ignore[arg-type]
    append_jsonl(run / "log.jsonl", {"step": 1})
    append_jsonl(run / "log.jsonl", {"step": 2})
    _untouched(secret)
    for name in names:
        assert not (run / name).is_symlink(), name
    assert "[loader]" in (run / "config.toml").read_text()
    assert (run / "report.md").read_text() == "# report\n"
    assert [json.loads(line)["step"] for line in (run / "log.jsonl").read_text().splitlines()] == [1, 2]


def test_a_chart_link_in_a_run_folder_is_replaced(tmp_path: Path, secret: Path, monkeypatch) -> None:
    """throughput.png: matplotlib's savefig opens a path through a link; gpufeed hands it its atomic file."""
    pytest.importorskip("matplotlib")
    import gpufeed.train.report as train_report

    monkeypatch.setattr(train_report, "chart_data", lambda s: {"rates": [("real", "trained", 10.0)], "stalls": [],
                                                               "log_scale": False, "stall_mode": "real"})
    os.symlink(secret, tmp_path / "throughput.png")
    assert train_report.plot_summary(tmp_path, {}) == "throughput.png"
    _untouched(secret)
    assert not (tmp_path / "throughput.png").is_symlink()
    assert (tmp_path / "throughput.png").read_bytes().startswith(b"\x89PNG")


# ---------------------------------------------------------------------------------------- files of a shard set


@pytest.mark.parametrize("side", ["index.parquet", "_info.json"])
def test_stage_refuses_a_side_file_linked_out_of_the_set(tmp_path: Path, secret: Path, side: str) -> None:
    src = write_tiny_shards(tmp_path / "src", [3, 2])
    os.symlink(secret, src / side)
    dest = tmp_path / "dest"
    r = invoke(["stage", src, dest, "--quiet", "--json"], expect=2)
    err = [line for line in r.stderr.splitlines() if line.startswith("error")]
    assert len(err) == 1 and f"{src / side} is a symbolic link that leads out of the set folder" in err[0], r.stderr
    assert "hunter2" not in _all_output(r)
    assert not (dest / side).exists()
    _nowhere("hunter2", dest)
    _untouched(secret)


def test_stage_refuses_proc_environ_behind_info_json(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "hunter2-from-the-environment")
    src = write_tiny_shards(tmp_path / "src", [3])
    os.symlink("/proc/self/environ", src / "_info.json")
    dest = tmp_path / "dest"
    r = invoke(["stage", src, dest, "--quiet"], expect=2)
    assert "_info.json is a symbolic link that leads out of the set folder" in r.stderr
    assert "hunter2" not in _all_output(r)
    _nowhere("hunter2", dest)


def test_stage_copies_a_side_file_linked_inside_the_set(tmp_path: Path) -> None:
    src = write_tiny_shards(tmp_path / "src", [3])
    (src / "index-v1.parquet").write_bytes(b"PAR1 the index, as copied PAR1")
    os.symlink("index-v1.parquet", src / "index.parquet")  # a link that stays in the set folder is followed
    dest = tmp_path / "dest"
    invoke(["stage", src, dest, "--quiet"])
    assert not (dest / "index.parquet").is_symlink()
    assert (dest / "index.parquet").read_bytes() == (src / "index-v1.parquet").read_bytes()


def test_a_shard_linked_out_of_the_set_is_refused_by_stage_index_and_the_loader(tmp_path: Path,
                                                                                 secret: Path) -> None:
    src = write_tiny_shards(tmp_path / "src", [3, 2])
    outside = tmp_path / "outside.tar"
    os.replace(src / "train-000001.tar", outside)
    os.symlink(outside, src / "train-000001.tar")
    dest = tmp_path / "dest"
    r = invoke(["stage", src, dest, "--quiet"], expect=2)
    assert f"source shard {src / 'train-000001.tar'} is a symbolic link that leads out of the set folder" in r.stderr
    assert not (dest / "train-000001.tar").exists()
    r = invoke(["index", src, "--out", tmp_path / "idx", "--no-hash"], expect=2)
    assert "train-000001.tar': it is a symbolic link that leads out of the set folder" in r.stderr

    from gpufeed.config import LoaderConfig
    from gpufeed.loader import build_loader
    from gpufeed.core.world import World

    with pytest.raises(DataError, match="is a symbolic link that leads out of the set folder"):
        build_loader(src, LoaderConfig(batch_size=2, num_workers=0, decode="pil", image_size=16), World.single(),
                     train=False)
    r = invoke(["verify", src, "--workers", "1"], expect=1)
    assert "is a symbolic link that leads out of the set folder" in r.stdout + r.stderr


def test_a_manifest_linked_out_of_its_folder_is_refused_unless_the_user_named_it(tmp_path: Path) -> None:
    from gpufeed.shardset.manifest import read_manifest

    real = write_tiny_shards(tmp_path / "real", [3])
    other = tmp_path / "other"
    other.mkdir()
    os.symlink(real / "manifest.json", other / "manifest.json")
    with pytest.raises(DataError, match="manifest.json is a symbolic link that leads out of the set folder"):
        read_manifest(other)
    assert read_manifest(other / "manifest.json").num_samples == 3  # the user typed that file: their choice


def _labelled_shard(folder: Path) -> Path:
    from tests.common.shards import write_image

    folder.mkdir()
    img = (write_image(folder / "x.jpg")).read_bytes()
    os.unlink(folder / "x.jpg")
    return write_tar(folder / "part-0.tar", [("a.jpg", img), ("a.txt", b"0"), ("b.jpg", img), ("b.txt", b"1")])


def test_index_refuses_a_classes_txt_linked_out_of_the_set(tmp_path: Path, secret: Path) -> None:
    folder = tmp_path / "set"
    _labelled_shard(folder)
    os.symlink(secret, folder / "classes.txt")
    r = invoke(["index", folder, "--label", "txt", "--json"], expect=2)
    assert f"class list {folder / 'classes.txt'} is a symbolic link that leads out of the set folder" in r.stderr
    assert "hunter2" not in _all_output(r)
    assert not (folder / "manifest.json").exists()
    _untouched(secret)


def test_index_reads_a_classes_file_the_user_named_even_through_a_link(tmp_path: Path) -> None:
    folder = tmp_path / "set"
    _labelled_shard(folder)
    (tmp_path / "names.txt").write_text("cat\ndog\n")
    os.symlink(tmp_path / "names.txt", tmp_path / "link.txt")
    r = invoke_json(["index", folder, "--label", "txt", "--classes", tmp_path / "link.txt"])
    assert r["classes_preview"] == ["cat", "dog"]
    os.mkfifo(tmp_path / "fifo.txt")  # still a regular file only: a FIFO would block the read
    r = invoke(["index", folder, "--label", "txt", "--classes", tmp_path / "fifo.txt"], expect=2)
    assert "fifo.txt cannot be read: it is not a regular file" in r.stderr


def test_a_class_folder_linked_out_of_src_gets_a_note(tmp_path: Path, image_folder) -> None:
    src = image_folder(classes=2, per_class=2)
    elsewhere = image_folder(classes=1, per_class=2, name="elsewhere") / "class_0"
    os.symlink(elsewhere, src / "linked")
    inside = src / "class_0"
    os.symlink(inside, src / "alias")  # a link that stays inside SRC: no note (its files are stored once anyway)
    r = invoke_json(["shard", src, tmp_path / "dest", "--quiet", "--workers", "1", "--allow-empty-classes"])
    notes = [w for w in r["warnings"] if "symbolic link out of" in w]
    assert notes == [f"class folder {src / 'linked'} is a symbolic link out of {src} (to {elsewhere}); its files are read from there"]
    r = invoke(["shard", src, tmp_path / "dest2", "--workers", "1", "--allow-empty-classes"])
    assert f"warning: class folder {src / 'linked'} is a symbolic link out of {src}" in r.stdout + r.stderr


def test_dest_state_files_linked_out_are_not_read(tmp_path: Path, image_folder) -> None:
    """plan.json and a shard's sidecar in DEST/.gpufeed: a link out of the state folder is not read (a valid plan
    and a valid sidecar moved out and linked back): the plan is taken as missing, the shard as not complete."""
    import hashlib

    from gpufeed.shard.shardplan import read_plan
    from gpufeed.shard.write import shard_complete

    dest = tmp_path / "dest"
    invoke(["shard", image_folder(classes=2, per_class=2), dest, "--quiet", "--workers", "1"])
    state = dest / ".gpufeed"
    assert read_plan(str(state)) is not None
    os.replace(state / "plan.json", tmp_path / "plan.json")
    os.symlink(tmp_path / "plan.json", state / "plan.json")
    assert read_plan(str(state)) is None
    (dest / "a.tar").write_bytes(b"x")
    (tmp_path / "side.json").write_text(json.dumps({"bytes": 1, "sha256": hashlib.sha256(b"x").hexdigest()}))
    os.symlink(tmp_path / "side.json", state / "a.tar.done.json")
    assert shard_complete(str(dest), "a.tar") is None


def test_tune_run_folder_links_are_replaced(tmp_path: Path, secret: Path, monkeypatch) -> None:
    """gpufeed tune's run folder: report.md, config.toml and the chart, each a link to the user's file."""
    import gpufeed.core.system
    import gpufeed.tune as tune
    from gpufeed.config import LoaderConfig, TuneConfig

    run = tmp_path / "run"
    run.mkdir()
    for name in ("report.md", "config.toml", "tune.png", "summary.json"):
        os.symlink(secret, run / name)
    monkeypatch.setattr(gpufeed.core.system, "environment_snapshot", lambda **kw: {})
    monkeypatch.setattr(tune.report, "render", lambda report: "table")
    report = tune.TuneReport(
        ok=True, shards="s", run_dir=None, out=None, best=None, best_trial=None, best_samples_per_s=None,
        baseline=None, baseline_samples_per_s=None, ratio_vs_baseline=None, bound=None, bound_evidence="",
        stop_reason="", skipped={}, decisions=[], conclusion="done", budget_s=1.0, elapsed_s=1.0, target_rate=None,
        target_met=None, usable_cpus=1, device="cpu", num_trials=0, trials=[])
    tune.write_outputs(report, TuneConfig(run_dir=str(run)), LoaderConfig())
    _untouched(secret)
    assert not (run / "report.md").is_symlink() and "table" in (run / "report.md").read_text()
    assert not (run / "config.toml").is_symlink()


def test_a_config_file_the_user_named_may_be_a_link_but_not_a_fifo(tmp_path: Path) -> None:
    from gpufeed.config import read_toml
    from gpufeed.core.errors import ConfigError

    (tmp_path / "real.toml").write_text("[loader]\nbatch_size = 8\n")
    os.symlink(tmp_path / "real.toml", tmp_path / "link.toml")
    assert read_toml(tmp_path / "link.toml")["loader"]["batch_size"] == 8
    os.mkfifo(tmp_path / "fifo.toml")
    with pytest.raises(ConfigError, match="config file .*fifo.toml cannot be read: it is not a regular file"):
        read_toml(tmp_path / "fifo.toml")  # before: open() waited for a writer forever


def test_a_rank_report_linked_out_of_the_run_folder_or_a_fifo_is_passed_over(tmp_path: Path) -> None:
    from gpufeed.train.launch import rank_failure

    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"rank": 0, "message": SECRET, "exit_code": 2, "cause": True, "time": 1.0}))
    run = tmp_path / "run"
    run.mkdir()
    os.symlink(outside, run / "rank-0.error")
    err = rank_failure(run, 1)
    assert "hunter2" not in str(err) and "no rank reported a cause" in str(err)
    os.mkfifo(run / "rank-1.error")  # open() would wait for a writer forever
    assert "no rank reported a cause" in str(rank_failure(run, 1))


def test_a_transcode_cache_linked_out_of_the_state_folder_never_reaches_a_shard(tmp_path: Path, secret: Path) -> None:
    from gpufeed.core.errors import RunError
    from gpufeed.shard.write import Item, write_range

    state = tmp_path / "dest" / ".gpufeed"
    state.mkdir(parents=True)
    os.symlink(secret, state / "enc-000000.bin")
    tmp = tmp_path / "dest" / ".a.tar.tmp"
    tmp.write_bytes(bytes(4096))
    item = Item(0, "k", "jpg", len(SECRET), b"0", b"{}", "", "c/k.jpg", None, str(state / "enc-000000.bin"), 0)
    with pytest.raises(RunError, match="transcode cache .* is a symbolic link that leads out of the state folder"):
        write_range(str(tmp), [item])
    assert b"hunter2" not in tmp.read_bytes()
