"""``gpufeed train --measure --fix``: the candidate table, the noise test, the loop and its budget with injected
measurements (:mod:`gpufeed.train.fix`); then one real closed loop behind a throttled loopback server."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from gpufeed.config import LoaderConfig, load_config
from gpufeed.core.records import to_jsonable
from gpufeed.measure.metrics import Stat
from gpufeed.measure.verdict import Verdict
from gpufeed.train import fix
from gpufeed.train.fix import Candidate, FixInputs, Measured, candidates, helps, run_fixes, stage_target
from gpufeed.train.records import ModeRecord
from gpufeed.train.report import render
from tests.common.cli import invoke

# --------------------------------------------------------------------------- injected measurements


def real(windows: list[float]) -> ModeRecord:
    """A real mode whose timing windows ran at ``windows`` samples/s."""
    st = Stat.of(windows)
    return ModeRecord(mode="real", num_ranks=1, num_steps=10, num_samples=100, wall_s=1.0, samples_per_s=st.median,
                      samples_per_s_stat=st, stall_pct=20.0, copy_wait_pct=0.0, data_wait_s=0.2, next_wait_s=0.2,
                      h2d_s=0.0, compute_s=0.8, step_s=1.0, loader_cores_used=1.0, read_bytes_per_s=0.0, per_rank=[])


def starved(bound: str = "decode/CPU", **numbers) -> Verdict:
    return Verdict("starved", bound, "injected", ["use num_workers >= 1 per rank",
                                                   "this node has only 2 cores: more workers cannot close the gap"],
                   numbers)


FED = Verdict("fed", None, "injected", [], {})


def inputs(verdict: Verdict, **kw) -> FixInputs:
    return FixInputs(verdict=verdict, loader=kw.pop("loader", LoaderConfig(num_workers=0)), shards="/data/set",
                     usable_cores=kw.pop("usable_cores", 4.0), **kw)


# --------------------------------------------------------------------------- the table


def test_decode_cpu_without_workers_tries_workers_first_capped_by_the_cores() -> None:
    cands = candidates(inputs(starved(cores_needed_per_node=9.0), usable_cores=4.0))
    assert cands[0].loader == {"num_workers": 4}  # 9 cores needed, 4 usable: the most worth trying
    lc = LoaderConfig(num_workers=2, decode="pil", prefetch_factor=2)
    keys = [c.loader for c in candidates(inputs(starved(more_cores_per_node=1.0, cores_needed_per_node=3.0),
                                                loader=lc, has_simplejpeg=True))]
    assert keys == [{"decode": "simplejpeg"}, {"num_workers": 3}, {"prefetch_factor": 4}]


def test_storage_tries_the_streams_the_ladder_showed_then_staging_and_a_person_fix_is_never_a_candidate() -> None:
    remote = LoaderConfig(num_workers=1, remote_streams=1)
    cands = candidates(inputs(starved("storage", streams_needed=4), loader=remote, remote=True, stage_to="/dev/shm/x"))
    assert [c.loader for c in cands] == [{"remote_streams": 4}, {}]
    assert cands[1].stage_to == "/dev/shm/x"
    assert candidates(inputs(starved("rank imbalance"))) == []  # re-sharding, NUMA binding: a person's
    assert candidates(inputs(FED)) == []
    assert fix.needs_a_person(starved()) == ["this node has only 2 cores: more workers cannot close the gap"]


def test_stage_target_names_where_and_why_not() -> None:
    assert stage_target("http://h/set", set_bytes=10, shm_free_bytes=100, stage_dir=None, can_stage=True) == \
        ("/dev/shm/gpufeed-fix-set", "")
    dest, why = stage_target("/d/set", set_bytes=200, shm_free_bytes=100, stage_dir=None, can_stage=True)
    assert dest is None and "does not fit in /dev/shm" in why
    dest, why = stage_target("/d/set", set_bytes=10, shm_free_bytes=100, stage_dir=None, can_stage=False)
    assert dest is None and "gpufeed stage" in why
    assert stage_target("/d/set/manifest.json", set_bytes=None, shm_free_bytes=None, stage_dir="/nvme",
                        can_stage=True)[0] == "/nvme/set"


# --------------------------------------------------------------------------- beyond the noise


def test_a_gain_inside_the_windows_spread_is_noise_and_one_beyond_it_is_kept() -> None:
    assert helps((100.0, 2.0), (120.0, 3.0))[0]
    kept, why = helps((100.0, 15.0), (112.0, 2.0))  # +12% but the windows before spread +-15
    assert not kept and why.startswith("dropped: 100.0 -> 112.0")
    assert not helps((100.0, 0.0), (104.0, 0.0))[0]  # under the 5% floor
    assert not helps((100.0, 0.0), (80.0, 0.0))[0]


# --------------------------------------------------------------------------- the loop


def _loop(rates: dict[tuple, list[float]], verdicts: dict[tuple, Verdict], proposals: list[Candidate], *,
          budget_s: float = 100.0, cost_s: float = 1.0):
    """run_fixes over a fake machine: a setting (its [loader] changes, shards) measures ``rates[key]`` windows and
    ``verdicts[key]``; each measure takes ``cost_s`` on the injected clock."""
    now = [0.0]
    measured: list[tuple] = []

    def key(lc: LoaderConfig, shards: str) -> tuple:
        return (lc.num_workers, lc.prefetch_factor, shards)

    def measure(lc: LoaderConfig, shards: str) -> Measured:
        now[0] += cost_s
        k = key(lc, shards)
        measured.append(k)
        return Measured({"real": real(rates[k])}, verdicts.get(k, starved()))

    def propose(v, lc, shards):
        return [c for c in proposals], ["re-shard smaller"]

    lc = LoaderConfig(num_workers=0)
    start = Measured({"real": real(rates[key(lc, "/s")])}, starved())
    out = run_fixes(start, lc, "/s", propose=propose, measure=measure, budget_s=budget_s, first_cost_s=cost_s,
                    stage=lambda src, dest: dest, clock=lambda: now[0])
    return out, measured


def test_a_fix_that_helps_is_kept_one_that_does_not_is_dropped_and_the_loop_ends_fed() -> None:
    workers = Candidate("num_workers 0 -> 1", {"num_workers": 1})
    prefetch = Candidate("prefetch_factor 2 -> 4", {"prefetch_factor": 4})
    stage = Candidate("stage the set to /shm/s", stage_to="/shm/s")
    rates = {(0, 2, "/s"): [50, 52, 51], (1, 2, "/s"): [80, 82, 81], (1, 4, "/s"): [81, 83, 80],
             (1, 2, "/shm/s"): [120, 121, 119]}
    out, measured = _loop(rates, {(1, 2, "/shm/s"): FED}, [workers, prefetch, stage])
    assert measured == [(1, 2, "/s"), (1, 4, "/s"), (1, 2, "/shm/s")]  # each tried once, on the kept settings
    assert [(r.fix, r.kept) for r in out.tried] == [(workers.fix, True), (prefetch.fix, False), (stage.fix, True)]
    assert [(r.before_samples_per_s, r.after_samples_per_s) for r in out.tried] == [(51, 81), (81, 81), (81, 120)]
    assert (out.loader.num_workers, out.loader.prefetch_factor, out.shards) == (1, 2, "/shm/s")
    assert out.measured.verdict.status == "fed" and out.tried[-1].verdict.status == "fed"
    assert out.tried[-1].changes == {"shards": "/shm/s"}
    assert "re-shard smaller" in out.not_tried
    # the schema summary.json carries
    rec = to_jsonable(out.tried[0])
    assert {"fix", "before_samples_per_s", "after_samples_per_s", "kept", "verdict"} <= set(rec)
    assert rec["verdict"]["status"] == "starved"


def test_the_budget_bounds_the_loop_and_names_what_it_left_untried() -> None:
    workers = Candidate("num_workers 0 -> 1", {"num_workers": 1})
    prefetch = Candidate("prefetch_factor 2 -> 4", {"prefetch_factor": 4})
    rates = {(0, 2, "/s"): [50.0], (1, 2, "/s"): [80.0], (1, 4, "/s"): [99.0]}
    out, measured = _loop(rates, {}, [workers, prefetch], budget_s=15.0, cost_s=10.0)
    assert measured == [(1, 2, "/s")]  # 10 s spent, the next try (10 s) would end past 15 s
    assert any(n.startswith("prefetch_factor 2 -> 4: not tried, the --fix budget (15 s)") for n in out.not_tried)
    out, measured = _loop(rates, {}, [workers], budget_s=5.0, cost_s=10.0)
    assert measured == [] and out.tried == [] and out.loader.num_workers == 0


def test_a_fix_whose_measure_fails_is_a_record_with_its_error_and_the_loop_goes_on() -> None:
    def measure(lc, shards):
        if lc.num_workers == 1:
            raise OSError("no such device")
        return Measured({"real": real([90.0])}, FED)

    start = Measured({"real": real([50.0])}, starved())
    out = run_fixes(start, LoaderConfig(num_workers=0), "/s", measure=measure, budget_s=100, first_cost_s=0,
                    propose=lambda v, lc, s: ([Candidate("w", {"num_workers": 1}), Candidate("p", {"num_workers": 2})],
                                              []))
    assert [(r.fix, r.kept, r.error is not None) for r in out.tried] == [("w", False, True), ("p", True, False)]
    assert out.loader.num_workers == 2


def test_fixed_toml_reads_back_as_the_kept_settings(tmp_path: Path) -> None:
    from gpufeed.train.records import FixRecord

    tried = [FixRecord("num_workers 0 -> 2", {"num_workers": 2}, 50.0, 80.0, True, "kept")]
    path = tmp_path / "fixed.toml"
    path.write_text(fix.fixed_toml(LoaderConfig(num_workers=2, decode="pil-draft"), "/dev/shm/x", tried))
    conf = load_config(path)
    assert (conf.loader.num_workers, conf.loader.decode, conf.train.shards) == (2, "pil-draft", "/dev/shm/x")
    assert "kept: num_workers 0 -> 2: 50.0 -> 80.0 samples/s" in path.read_text()
    assert load_config(_write(tmp_path / "b.toml", fix.fixed_toml(LoaderConfig(), None, tried))).train.shards is None


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def test_the_report_shows_before_and_after() -> None:
    from gpufeed.train.records import FixRecord

    s = {"mode": "measure", "arch": "resnet18", "world_size": 1, "device": "cpu", "backend": "gloo", "amp": "off",
         "batch_size": 4, "accum_steps": 1, "global_batch": 4, "image_size": 32, "modes": {},
         "fixes_tried": to_jsonable([FixRecord("stage the set to /dev/shm/x", {"shards": "/dev/shm/x"}, 15.2, 60.1,
                                               True, "kept", FED)]),
         "fixes_not_tried": ["re-shard smaller"], "fixed_config": "/r/fixed.toml"}
    text = render(s)
    assert "kept: stage the set to /dev/shm/x: 15.2 -> 60.1 samples/s; then fed" in text
    assert "not tried: re-shard smaller" in text and "kept settings: /r/fixed.toml" in text


def test_fix_needs_measure() -> None:
    res = invoke(["train", "--synthetic", "--fix", "--device", "cpu", "--quiet"], expect=2)
    assert "fix needs mode = measure" in res.stderr


# --------------------------------------------------------------------------- the real closed loop

TINY = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--num-workers", "0", "--amp", "off",
        "--device", "cpu", "--quiet", "--threads", "1", "--measure", "--measure-steps", "3", "--storage-probe-s", "1"]


def test_fix_stages_a_throttled_remote_set_and_keeps_it_only_because_it_measured_faster(http_server, tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """The issue's proof at tiny scale (the set-up of test_remote_storage's storage proof): one shard served at
    20 KB/s a connection binds the tiny CPU model; ``--fix`` stages it (into a temporary folder standing for
    /dev/shm), re-measures, keeps the copy because it measured faster beyond the windows' spread, and writes
    fixed.toml pointing at it. What the staged run ends as is this machine's: fed, or starved by its CPU (the
    compute here shares 2 busy cores), never storage-bound."""
    import gpufeed.measure.storage_probe as storage_probe
    import gpufeed.shardset.source as source
    from tests.common.shards import write_tiny_shards

    monkeypatch.setattr(source, "CHUNK_BYTES", 16 << 10)
    monkeypatch.setattr(storage_probe, "REMOTE_CHUNK_BYTES", 16 << 10)
    write_tiny_shards(http_server.root / "set", [64], image_px=32)
    url = f"{http_server.url}/set"
    http_server.faults.bandwidth = 20_000  # ~5 samples/s: staging wins by far more than a busy machine's noise
    conf = tmp_path / "loader.toml"
    conf.write_text("[loader]\nshuffle_buffer = 4\nremote_streams = 1\n")
    shm = Path("/dev/shm")
    base = Path(tempfile.mkdtemp(prefix="gpufeed-test-fix-", dir=shm if shm.is_dir() and os.access(shm, os.W_OK)
                                 else tmp_path))
    run = tmp_path / "run"
    try:
        invoke(["train", "--shards", url, *TINY, "--config", conf, "--run-dir", run, "--fix", "--fix-stage-dir",
                base, "--fix-budget-s", "120"], expect=None)
        s = json.loads((run / "summary.json").read_text())
        if s["verdict"]["status"] == "inconclusive" and not s["fixes_tried"]:
            # other processes held this machine's cores while it measured: no bound is built on disturbed
            # numbers, so the loop must try nothing (issue 19: never a fix from a disturbed run)
            assert "other processes" in (s["verdict"].get("cause") or "") + s["verdict"]["reason"], s["verdict"]
            pytest.skip("other processes were busy on this machine: the verdict was inconclusive and, as it must, "
                        "the loop tried no fix; the staging proof needs a quiet machine")
        staged = [r for r in s["fixes_tried"] if "shards" in r["changes"]]
        assert staged, s["fixes_tried"]
        r = staged[0]
        assert r["changes"]["shards"] == str(base / "set") and r["kept"], r
        assert r["after_samples_per_s"] > r["before_samples_per_s"], r
        assert r["verdict"]["bound"] != "storage", r["verdict"]
        assert s["verdict"]["bound"] != "storage" and s["storage"]["bytes_per_s"] > 10 * 20_000
        fixed = load_config(run / "fixed.toml")
        assert fixed.train.shards == str(base / "set") and fixed.loader.remote_streams == 1
        assert (fixed.loader.batch_size, fixed.loader.image_size) == (4, 32)  # what it was measured at
        assert (base / "set" / "manifest.json").is_file()
        assert "kept: stage the set to" in (run / "report.md").read_text()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_final_verdict_never_prescribes_a_change_this_run_measured_as_no_better() -> None:
    from gpufeed.train.records import FixRecord

    v = Verdict("starved", "decode/CPU", "r", ["num_workers = 0 decodes in the training process: use num_workers >= 1",
                                              "store images at <= 512 px (gpufeed shard --max-size 512)"], {})
    dropped = FixRecord("num_workers 0 -> 1", {"num_workers": 1}, 50.0, 48.0, False, "dropped")
    out = fix.measured_fixes(v, [dropped])
    assert out.fixes[0].startswith("measured, not kept: num_workers 0 -> 1 went 50.0 -> 48.0 samples/s")
    assert out.fixes[1] == v.fixes[1]
    # a drop measured before a later kept fix was measured on other settings: the line stays
    kept = FixRecord("stage", {"shards": "/dev/shm/x"}, 48.0, 90.0, True, "kept")
    assert fix.measured_fixes(v, [dropped, kept]).fixes == v.fixes
