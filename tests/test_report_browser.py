"""The report page in a real headless Chromium (Debian's package, installed here when missing): it loads with no
console error and no network request, every chart (<svg>) and image has a non-zero size, and a screenshot is saved
under the test's tmp dir. Skipped, with the reason, where Chromium cannot be installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.browser import install_chromium, open_page
from tests.common.cli import invoke


@pytest.fixture(scope="module")
def chromium() -> str:
    path, why = install_chromium()
    if path is None:
        pytest.skip(f"no headless Chromium: {why}")
    return path


def _run_folder(tmp_path: Path) -> Path:
    """A run folder with every section's records: the repository's demo records when present, else a fake one
    holding the kinds of records each chart reads."""
    run = tmp_path / "run"
    for step in ("measure", "io", "tune", "doctor", "shard"):
        (run / step).mkdir(parents=True)
    steps = [{"name": n, "status": "done", "hash": "h", "skipped": False, "wall_s": 1.5}
             for n in ("doctor", "shard", "io", "tune", "measure")]
    (run / "run.json").write_text(json.dumps({"format": "gpufeed-run", "version": 1, "status": "done",
                                              "steps": steps, "config": "demo.toml"}))
    (run / "doctor" / "summary.json").write_text(json.dumps({"ok": True, "checks": [
        {"name": "gpu", "status": "warn", "evidence": "no GPU", "fix": "-"},
        {"name": "cpu", "status": "ok", "evidence": "2 cores", "fix": ""}]}))
    (run / "shard" / "summary.json").write_text(json.dumps({"dest": "set", "num_samples": 120, "num_classes": 4,
                                                            "num_shards": 4, "total_bytes": 1.3e7, "num_rejected": 1,
                                                            "rejected": [{"path": "a/b.jpg", "reason": "truncated"}]}))
    (run / "io" / "summary.json").write_text(json.dumps({"locations": [{"path": "set", "steps": [
        {"readers": r, "cache": c, "mb_per_s": 100.0 * r + (50 if c == "warm" else 0)}
        for r in (1, 2, 4) for c in ("cold", "warm")]}], "notes": []}))
    (run / "tune" / "summary.json").write_text(json.dumps({"best_samples_per_s": {"median": 300.0}, "best_trial": 1,
                                                           "best": {"num_workers": 2, "decode": "pil"},
                                                           "conclusion": "best w=2", "decisions": []}))
    (run / "tune" / "trials.jsonl").write_text("".join(json.dumps({"trial": i, "phase": "workers", "num_workers": i,
                                                                   "samples_per_s": 150.0 * (i + 1)}) + "\n"
                                                       for i in range(2)))
    ranks = [{"rank": r, "step_s": 10.0, "data_wait_s": 3.0 + r, "h2d_s": 0.5, "compute_s": 6.5 - r} for r in (0, 1)]
    (run / "measure" / "summary.json").write_text(json.dumps({"mode": "measure", "verdict": {
        "status": "starved", "bound": "decode/CPU", "reason": "stall 40%", "fixes": ["more cores"]}, "modes": {
        "synthetic": {"samples_per_s": 500.0}, "loader-only": {"samples_per_s": 300.0},
        "real": {"samples_per_s": 280.0, "stall_pct": 40.0, "per_rank": ranks}}}))
    (run / "measure" / "log.jsonl").write_text("".join(json.dumps({"mode": "real", "rank": 0, "step": s,
                                                                   "samples_per_s": 250 + s, "stall_pct": 40 - s})
                                                       + "\n" for s in range(1, 9)))
    return run


def test_report_page_in_headless_chromium(chromium: str, tmp_path: Path) -> None:
    run = _run_folder(tmp_path)
    invoke(["report", run])
    page = open_page(chromium, run / "report.html")
    (tmp_path / "report.png").write_bytes(page.screenshot)
    assert page.screenshot.startswith(b"\x89PNG") and len(page.screenshot) > 10_000
    assert page.errors == [], page.errors
    assert page.requests == [], page.requests
    svgs = [b for b in page.boxes if b["tag"].lower() == "svg"]
    assert len(svgs) >= 6, page.boxes  # ladder, trials, rates, stalls, two timelines
    assert all(b["width"] > 0 and b["height"] > 0 for b in page.boxes), page.boxes
    assert page.title.startswith("gpufeed run")
