"""Attacks on a run folder someone else prepared (docs/threat-model.md, "Run folders"): ``gpufeed run`` never takes a
skipped step's output from run.json as written, never writes through a link in its run folder, and reads run.json
only with every field type-checked; ``gpufeed report`` reads no file through a link and stays bounded in memory and
output whatever its records hold. Each test failed before its fix (second attacker pass, F2, F3, F4, F6, F10)."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from tests.common import invoke, invoke_json
from tests.common.shards import write_tiny_shards

SECRET = "OUTSIDE-FILE-CONTENT-hunter2"
RUN_JSON = {"format": "gpufeed-run", "version": 1, "status": "done", "steps": []}


def _run_json(run: Path) -> dict:
    return json.loads((run / "run.json").read_text())


def _private(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "outside" / "private.json"
    p.parent.mkdir(exist_ok=True)
    p.write_text(text)
    p.chmod(0o600)
    return p


def _nowhere(text: str, folder: Path, *outputs: str) -> None:
    for out in outputs:
        assert text not in out
    for p in folder.rglob("*"):
        if p.is_file() and not p.is_symlink():
            assert text.encode() not in p.read_bytes(), p


# --------------------------------------------------------------------------- F2: skipped outputs from run.json


@pytest.fixture()
def verified_run(tmp_path: Path) -> tuple[Path, Path, Path]:
    """A run of doctor and verify over a small set, done once: (config, run folder, set)."""
    shards = write_tiny_shards(tmp_path / "set", [4, 4])
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[run]\nsteps = ["doctor", "verify"]\ndir = "{tmp_path / "rd"}"\n[train]\nshards = "{shards}"\n')
    invoke(["run", cfg, "--quiet"], expect=None)
    assert [s["status"] for s in _run_json(tmp_path / "rd")["steps"]] == ["done", "done"]
    return cfg, tmp_path / "rd", shards


def test_a_forged_output_of_a_skipped_step_is_never_passed_forward(verified_run, tmp_path: Path) -> None:
    """run.json's doctor line, whose hash anyone can compute from the config, says it output another set (a URL
    here; a folder works the same): the set passed to verify stays the config's, and doctor runs again."""
    cfg, run, shards = verified_run
    state = _run_json(run)
    state["steps"][0]["output"] = {"set": "http://127.0.0.1:9/exfil/x", "io_record": "/etc/passwd",
                                   "tuned": str(tmp_path / "elsewhere.toml")}
    (run / "run.json").write_text(json.dumps(state))
    record = invoke_json(["run", cfg, "--quiet"], expect=None)
    after = _run_json(run)
    assert record["ran"] == ["doctor"] and record["skipped"] == ["verify"], record
    assert after["steps"][1]["inputs"]["set"] == str(shards)
    assert after["steps"][0]["output"] == {}


def test_a_record_path_out_of_the_run_folder_is_refused(verified_run) -> None:
    cfg, run, _ = verified_run
    for record in ("../../etc/passwd", "/etc/passwd", "verify/../../x", ""):
        state = _run_json(run)
        state["steps"][1]["record"] = record
        (run / "run.json").write_text(json.dumps(state))
        r = invoke(["run", cfg], expect=2)
        assert "is not a gpufeed run record (a step's record must be a path inside the run folder" in r.stderr


def test_a_step_line_whose_record_is_another_file_is_not_done(verified_run) -> None:
    """A relative record path that is not the step's own summary.json (with that file's sha256) is not taken as the
    step being done: the step runs again."""
    cfg, run, _ = verified_run
    state = _run_json(run)
    state["steps"][1]["record"] = "doctor/summary.json"
    state["steps"][1]["record_sha256"] = state["steps"][0]["record_sha256"]
    (run / "run.json").write_text(json.dumps(state))
    record = invoke_json(["run", cfg, "--quiet"], expect=None)
    assert record["ran"] == ["verify"] and _run_json(run)["steps"][1]["record"] == "verify/summary.json"


def test_the_derived_output_is_compared_not_copied(tmp_path: Path) -> None:
    """Unit: a step whose run.json output differs from what its output function derives now is not done before."""
    from gpufeed.config import Config
    from gpufeed.pipeline import _done_before
    from gpufeed.pipeline.state import StepState, file_sha256
    from gpufeed.pipeline.steps import STEP_TABLE, Carry, Context

    ctx = Context(cfg=Config(), run_dir=tmp_path, carry=Carry())
    step = next(s for s in STEP_TABLE if s.name == "tune")
    (tmp_path / "tune").mkdir()
    (tmp_path / "tune" / "summary.json").write_text("{}")
    (tmp_path / "tune" / "tuned.toml").write_text("[loader]\nnum_workers = 2\n")
    prepared, _, _ = step.prepare(ctx)
    sha = file_sha256(tmp_path / "tune" / "summary.json")
    good = StepState(name="tune", status="done", hash="a" * 64, record="tune/summary.json", record_sha256=sha,
                     output=step.output(ctx, prepared))
    now = StepState(name="tune", hash="a" * 64)
    assert good.output["tuned"] == str(tmp_path / "tune" / "tuned.toml") and good.output["tuned_sha256"]
    assert _done_before(step, good, now, prepared, ctx)
    forged = StepState(**{**good.__dict__, "output": {**good.output, "tuned": str(tmp_path / "x.toml")}})
    assert not _done_before(step, forged, now, prepared, ctx)
    (tmp_path / "tune" / "tuned.toml").write_text("[loader]\nnum_workers = 3\n")  # the file changed since
    assert not _done_before(step, good, now, prepared, ctx)


# --------------------------------------------------------------------------- F3: links in the run folder


@pytest.mark.parametrize("link", ["synth/images", "shard/set", "synth"])
def test_run_never_writes_through_a_link_in_its_folder(tmp_path: Path, link: str) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    run = tmp_path / "rd"
    (run / link).parent.mkdir(parents=True, exist_ok=True)
    (run / link).symlink_to(victim)
    cfg = tmp_path / "cfg.toml"
    cfg.write_text(f'[run]\nsteps = ["synth", "shard"]\ndir = "{run}"\n[synth]\nimages = 8\nclasses = 2\n'
                   f"[shard]\nshard_samples = 4\n")
    r = invoke(["run", cfg, "--quiet"], expect=2)
    assert f"{run / link} is a symbolic link in the run folder" in r.stderr and r.stderr.count("\n") == 1
    assert list(victim.iterdir()) == []


def test_link_below_names_the_first_link() -> None:
    from gpufeed.core.safefs import link_below

    with pytest.raises(DataError, match="is not inside the run folder"):
        link_below("/tmp/a", "/tmp/b/c")
    assert link_below("/tmp", "/tmp/no-such-folder/x") is None


# --------------------------------------------------------------------------- F4: reading through links


@pytest.mark.parametrize("how", ["file", "folder"])
def test_report_reads_no_record_through_a_link(tmp_path: Path, how: str) -> None:
    private = _private(tmp_path, json.dumps({"mode": "measure", "verdict": {"status": "fed", "reason": SECRET}}))
    run = tmp_path / "rd"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(RUN_JSON))
    if how == "file":
        (run / "measure").mkdir()
        (run / "measure" / "summary.json").symlink_to(private)
    else:
        (tmp_path / "outside2").mkdir()
        (tmp_path / "outside2" / "summary.json").write_text(private.read_text())  # a real file in a linked folder
        (run / "measure").symlink_to(tmp_path / "outside2")
    r = invoke(["report", run], expect=2)
    assert "is reached through the symbolic link" in r.stderr and r.stderr.count("\n") == 1
    _nowhere(SECRET, run, r.stdout, r.stderr)
    assert not (run / "report.html").exists()


def test_run_reads_no_run_json_through_a_link(verified_run, tmp_path: Path) -> None:
    cfg, run, _ = verified_run
    private = _private(tmp_path, (run / "run.json").read_text().replace("done", SECRET))
    (run / "run.json").unlink()
    (run / "run.json").symlink_to(private)
    r = invoke(["run", cfg], expect=2)
    assert "run.json" in r.stderr and "symbolic link" in r.stderr
    assert SECRET not in r.stdout + r.stderr


def test_a_record_reached_through_a_link_is_never_hashed_as_done(verified_run, tmp_path: Path) -> None:
    """verify/summary.json replaced by a link to a copy of itself outside: the run does not count verify as done
    (file_sha256 reads only below the run folder), so verify runs again into a real folder."""
    cfg, run, _ = verified_run
    copy = tmp_path / "outside-verify"
    (run / "verify").rename(copy)
    (run / "verify").symlink_to(copy)
    r = invoke(["run", cfg, "--quiet"], expect=2)
    assert f"{run / 'verify'} is a symbolic link in the run folder" in r.stderr


def test_read_below_refuses_every_link_and_reads_real_files(tmp_path: Path) -> None:
    from gpufeed.core.safefs import read_below

    (tmp_path / "r" / "a").mkdir(parents=True)
    (tmp_path / "r" / "a" / "f").write_text("ok")
    (tmp_path / "r" / "l").symlink_to(tmp_path / "r" / "a")  # even a link inside: gpufeed writes none
    os.mkfifo(tmp_path / "r" / "fifo")
    assert read_below(tmp_path / "r" / "a" / "f", tmp_path / "r", 10) == b"ok"
    with pytest.raises(DataError, match="reached through the symbolic link"):
        read_below(tmp_path / "r" / "l" / "f", tmp_path / "r", 10)
    with pytest.raises(DataError, match="not a regular file"):
        read_below(tmp_path / "r" / "fifo", tmp_path / "r", 10)
    with pytest.raises(DataError, match="more than the 1"):
        read_below(tmp_path / "r" / "a" / "f", tmp_path / "r", 1)
    with pytest.raises(DataError, match="not inside the run folder"):
        read_below(tmp_path / "r" / ".." / "x", tmp_path / "r", 10)
    with pytest.raises(FileNotFoundError):
        read_below(tmp_path / "r" / "a" / "g", tmp_path / "r", 10)


# --------------------------------------------------------------------------- F6: the report's bounds


def _report_run(tmp_path: Path, records: dict[str, str]) -> Path:
    run = tmp_path / "rd"
    run.mkdir()
    (run / "run.json").write_text(json.dumps(RUN_JSON))
    for rel, text in records.items():
        p = run / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return run


def test_a_record_of_empty_objects_is_refused_before_parsing(tmp_path: Path) -> None:
    """{} repeated: over doctor's 1 MiB cap it is refused by size; under it, by the structure bound per byte (as a
    manifest is), in one sentence, long before gigabytes are parsed."""
    run = _report_run(tmp_path, {"doctor/summary.json": '{"checks":[' + ",".join(["{}"] * 300_000) + "]}"})
    r = invoke(["report", run], expect=2)
    assert "doctor record" in r.stderr and "objects and lists" in r.stderr
    (run / "doctor" / "summary.json").write_text('{"checks":[' + ",".join(["{}"] * (6 << 20)) + "]}")
    r = invoke(["report", run], expect=2)
    assert "more than the 1048576 gpufeed reads" in r.stderr


def test_every_table_and_chart_is_capped_and_says_how_many_were_left_out(tmp_path: Path) -> None:
    from gpufeed.report import MAX_PAGE_CHARS, MAX_ROWS, MAX_SERIES

    checks = [{"name": f"check{i}", "status": "fail", "evidence": "E" * 400, "fix": "f"} for i in range(2000)]
    per_rank = [{"rank": i, "step_s": 1.0, "data_wait_s": 0.5, "h2d_s": 0.1, "compute_s": 0.4} for i in range(500)]
    train = {"mode": "measure", "verdict": {"status": "starved", "reason": "R" * 100_000, "fixes": ["x"] * 1000},
             "modes": {"real": {"samples_per_s": 1.0, "per_rank": per_rank}},
             "gpu_health": [{"rank": i, "temperature_c": 50} for i in range(300)]}
    log = "".join(json.dumps({"step": s, "samples_per_s": 1.0, "stall_pct": 5.0, "mode": "real", "rank": r}) + "\n"
                  for r in range(40) for s in range(50))
    log += "[" * 100_000 + "\n" + "[" * 50_000 + "\n" + "[" * 30_000 + "]" * 30_000 + "\n" + '{"step": 1e999, "samples_per_s": 1' + "0" * 400 + "}\n"
    run = _report_run(tmp_path, {"doctor/summary.json": json.dumps({"checks": checks}),
                                 "measure/summary.json": json.dumps(train), "measure/log.jsonl": log})
    invoke(["report", run])
    page = (run / "report.html").read_text()
    assert len(page) < 1 << 20 and len(page) < MAX_PAGE_CHARS
    assert page.count("<tr") <= 2 * (MAX_ROWS + 1)
    assert f"{2000 - MAX_ROWS:,} more checks in the record were left out" in page
    assert f"{500 - MAX_ROWS:,} more ranks in the record were left out" in page
    assert f"{1000 - MAX_ROWS:,} more fixes in the record were left out" in page
    assert f"{40 - MAX_SERIES:,} more lines in the record were left out" in page
    assert "R" * 2000 not in page and "E" * 301 not in page
    assert "3 line(s) of log.jsonl were not JSON records" in page
    md = (run / "report.md").read_text()
    assert len(md) < 1 << 20


def test_a_log_longer_than_the_line_bound_is_cut_saying_so(tmp_path: Path) -> None:
    from gpufeed.report.runfolder import MAX_LOG_LINES, read_log

    run = _report_run(tmp_path, {"tune/trials.jsonl": "".join(
        json.dumps({"trial": i, "samples_per_s": 1.0, "other": list(range(50))}) + "\n"
        for i in range(MAX_LOG_LINES + 7))})
    rows, bad, unread = read_log(run / "tune" / "trials.jsonl", run, ("trial", "samples_per_s"))
    assert len(rows) == MAX_LOG_LINES and bad == 0 and unread == 7
    assert rows[0] == {"trial": 0, "samples_per_s": 1.0}  # only the fields drawn are kept


# --------------------------------------------------------------------------- F10: run.json's types


@pytest.mark.parametrize("field, value", [("attempts", "7"), ("output", ["x"]), ("attempts", True),
                                          ("inputs", None), ("hash", 5), ("status", "bogus"), ("wall_s", "1"),
                                          ("skipped", "yes"), ("name", ["verify"])])
def test_a_run_json_field_of_the_wrong_type_is_refused(verified_run, field: str, value: object) -> None:
    cfg, run, _ = verified_run
    state = _run_json(run)
    state["steps"][0][field] = value
    (run / "run.json").write_text(json.dumps(state))
    r = invoke(["run", cfg], expect=2)
    assert re.search(r"run\.json is not a gpufeed run record \(a step('s \w+ must be| has no name)", r.stderr), r.stderr
    assert r.stderr.count("\n") == 1


def test_a_run_json_with_bad_steps_or_too_much_structure_is_refused(verified_run) -> None:
    cfg, run, _ = verified_run
    for text in (json.dumps({**RUN_JSON, "steps": {"a": 1}}), json.dumps({**RUN_JSON, "steps": [1]}),
                 json.dumps({**RUN_JSON, "steps": [{"name": "doctor"}, {"name": "doctor"}]}),
                 json.dumps({**RUN_JSON, "x": [[]] * 500_000})):
        (run / "run.json").write_text(text)
        r = invoke(["run", cfg], expect=2)
        assert "run.json" in r.stderr and r.stderr.count("\n") == 1, r.stderr
