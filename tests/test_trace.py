"""trace.json (gpufeed.measure.trace): every rank's step marks in the trace-event format, agreeing with the stall %
the run reports; --profile-steps' torch.profiler plumbing on the CPU."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gpufeed.core.world import World
from gpufeed.measure.trace import RankSpans, events, stall_pct
from gpufeed.measure.verdict import classify
from gpufeed.train import train
from tests.test_train import LOADER, shards, tiny  # noqa: F401 - the module-scoped shard set fixture

X_KEYS = {"name", "cat", "ph", "ts", "dur", "pid", "tid"}


def test_events_place_each_rank_on_its_node_and_thread() -> None:
    a = RankSpans("real", 0, 0, "h0", 100.0, 2.0, [("step", 0.0, 1.0), ("data wait", 0.0, 0.25), ("copy", 0.25, 0.05),
                                                   ("compute", 0.3, 0.7)])
    b = RankSpans("real", 3, 1, "h1", 100.5, 2.0, [("step", 0.0, 1.0), ("data wait", 0.0, 0.5)])
    evs = events([a, b])
    xs = [e for e in evs if e["ph"] == "X"]
    assert all(X_KEYS <= set(e) for e in xs)
    assert {(e["pid"], e["tid"]) for e in xs} == {(0, 0), (1, 3)}
    assert next(e for e in xs if e["tid"] == 3 and e["name"] == "data wait")["ts"] == pytest.approx(0.5e6)
    names = {e["args"]["name"] for e in evs if e["ph"] == "M"}
    assert {"node 0 (h0)", "node 1 (h1)", "rank 0", "rank 3"} <= names
    assert stall_pct({"traceEvents": evs}, "real") == pytest.approx(100 * 0.8 / 2.0)


@pytest.mark.timeout(300)
def test_measure_writes_a_trace_that_agrees_with_the_reported_stall(shards, tmp_path: Path) -> None:  # noqa: F811
    run = tmp_path / "run"
    rec = train(tiny(mode="measure", measure_steps=3, measure_seconds=0.0, shards=str(shards["train"]),
                     storage_probe_s=0.0, profile_steps=1), LOADER, World.single(), run_dir=run)
    trace = json.loads((run / "trace.json").read_text())
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert xs and all(X_KEYS <= set(e) and e["dur"] >= 0 for e in xs)
    assert {e["cat"] for e in xs} == {"synthetic", "loader-only", "real", "mode"}
    for mode in ("synthetic", "real"):
        assert abs(stall_pct(trace, mode) - rec.modes[mode].stall_pct) <= 1.0, mode
        steps = [e for e in xs if e["cat"] == mode and e["name"] == "step"]
        assert len(steps) == rec.modes[mode].num_steps
    assert sum(e["name"] == "data wait" for e in xs if e["cat"] == "loader-only") == \
        rec.modes["loader-only"].num_steps * rec.accum_steps

    summary = json.loads((run / "summary.json").read_text())
    for name, m in summary["modes"].items():
        assert m["other_cores"] >= 0.0 and m["per_node"][0]["other_cores"] == m["other_cores"], name
        assert m["settled"] in (True, False) and m["samples_per_s_stat"]["n"] >= 3
    assert summary["modes"]["real"]["batch"] == summary["modes"]["synthetic"]["batch"] == "uint8 [4, 3, 32, 32] channels_last cpu"
    # the verdict follows its rules from the recorded numbers, and exits 1 unless fed or unverified
    assert rec.ok == (rec.verdict.status in ("fed", "unverified"))
    if rec.verdict.status == "inconclusive":
        assert rec.verdict.cause in ("other processes", "too noisy", "unreliable ceiling", "unexplained")

    # --profile-steps: a torch.profiler Chrome trace beside it, outside the timed modes
    prof = json.loads((run / "profile" / "rank-0.json").read_text())
    assert prof["traceEvents"]
