"""benchmarks/summarize.py: RESULTS.md's generated block is what the committed JSON records give, README.md's block
is RESULTS.md's headline table, the rest of both files is left alone, and run_all.sh runs it. No benchmark runs."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def summarize():
    spec = importlib.util.spec_from_file_location("bench_summarize", ROOT / "benchmarks" / "summarize.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_block_is_what_the_committed_records_give(summarize) -> None:
    committed = summarize.block_of((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"), "RESULTS.md")
    assert committed == summarize.render(ROOT / "benchmarks" / "results"), (
        "benchmarks/RESULTS.md's generated block is out of date: run python benchmarks/summarize.py")


def test_readme_block_is_results_headline(summarize) -> None:
    results = summarize.block_of((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"), "RESULTS.md")
    readme = summarize.block_of((ROOT / "README.md").read_text(encoding="utf-8"), "README.md")
    assert readme == summarize.readme_block(results), (
        "README.md's benchmark block differs from RESULTS.md's headline: run python benchmarks/summarize.py")
    assert "| benchmark | record | date |" in readme and "### " not in readme


def test_every_record_named_in_the_block_exists(summarize) -> None:
    block = summarize.block_of((ROOT / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8"), "RESULTS.md")
    named = {line.split("`results/")[1].split("`")[0] for line in block.splitlines() if "`results/" in line}
    assert named and all((ROOT / "benchmarks" / "results" / n).is_file() for n in named)
    assert len(named) == len(summarize.BENCHES)
    for line in block.splitlines():
        if line.startswith("Date: "):
            assert "Machine: " in line and "Command: " in line


def test_newest_record_wins_and_only_the_block_changes(summarize, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    old = {"before": "aaa", "after": "bbb", "data": "d", "rounds": 1,
           "results": {"shard_full": {"before_median": 2.0, "after_median": 1.0, "after_over_before": 0.5}}}
    new = {**old, "after": "ccc", "results": {"shard_full": {"before_median": 2.0, "after_median": 3.0,
                                                             "after_over_before": 1.5}}}
    (results / "bench_regression-20260101-000000.json").write_text(json.dumps(old))
    (results / "bench_regression-20260102-000000.json").write_text(json.dumps(new))
    (results / "bench_shard-2026-01-01.json").write_text(json.dumps({
        "date": "2026-01-01T10:00:00+00:00", "summary": {}, "ratios": {"full_vs_shardwriter": {
            "value": 3.25, "target": ">= 3.0", "met": True}}}))
    block = summarize.render(results)
    assert "ccc vs aaa: shard_full 1.50×" in block and "bbb" not in block
    assert "bench_regression-20260102-000000.json" in block and "2026-01-02 00:00:00 (file name)" in block
    assert "3.25× images/s (target >= 3.0: met)" in block and "2026-01-01 10:00:00 UTC" in block
    assert "Machine: not recorded" in block  # never made up
    text = f"# hand\n\nkept\n{summarize.BEGIN}\nstale\n{summarize.END}\n\n## after\nkept too\n"
    out = summarize.replace_block(text, block, "x.md")
    assert out.startswith("# hand\n\nkept\n") and out.endswith("\n## after\nkept too\n")
    assert summarize.block_of(out, "x.md") == block


def test_a_file_without_its_markers_is_refused(summarize) -> None:
    with pytest.raises(SystemExit, match="needs exactly one"):
        summarize.block_of("no markers here", "x.md")


def test_run_all_ends_with_summarize() -> None:
    text = (ROOT / "benchmarks" / "run_all.sh").read_text(encoding="utf-8")
    assert "benchmarks/summarize.py" in text.split("done\n")[-1]


def test_peer_and_sample_cost_records_are_summarized_from_their_numbers(summarize, tmp_path: Path) -> None:
    results = tmp_path / "results"
    results.mkdir()
    rows = [{"loader": "imagefolder", "config": "workers=3 PIL", "samples_per_s": 500.0, "min": 480.0, "max": 520.0,
             "samples_per_cpu_s": 250.0, "gpufeed_best_over_this": 2.2, "gpufeed_best_is": "gpufeed-roi"},
            {"loader": "dali-cpu", "config": "threads=2", "samples_per_s": 800.0, "min": 790.0, "max": 810.0,
             "samples_per_cpu_s": 400.0, "gpufeed_best_over_this": 1.375, "gpufeed_best_is": "gpufeed-roi"}]
    (results / "bench_peers-20260101-000000.json").write_text(json.dumps({
        "date": "2026-01-01T00:00:00+00:00", "args": {"shards": "S"}, "rows": rows,
        "machine": {"cpu_model": "Some CPU", "cores_affinity": 2}}))
    (results / "sample_cost-20260101-000000.json").write_text(json.dumps({
        "shards": "S", "images": 10, "repeats": 5, "rounds_count": 2, "min": {
            "tar read": 0.05, "decode RGB (simplejpeg)": 1.2, "crop + resize + flip": 0.2,
            "420: turbojpeg RGB": 1.0, "420: turbojpeg planes": 0.9, "resize RGB 320->224": 0.1,
            "resize planes 320->224 (Y) + 2x 160->112": 0.3}}))
    block = summarize.render(results)
    assert "gpufeed best (gpufeed-roi) ÷ ImageFolder 2.20×, DALI CPU 1.38×" in block
    assert "Machine: Some CPU, 2 usable CPUs" in block
    assert "| dali-cpu | threads=2 | 800 (790–810) | 400 | 1.38× |" in block
    assert "decode 1.200 ms, resize 0.200 ms, tar read 0.050 ms per image" in block
    assert "4:2:0 planes decode 0.90× RGB's, planes resize 3.00×" in block


def test_readme_names_every_benchmark_script() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    scripts = sorted(p.name for p in (ROOT / "benchmarks").glob("bench_*.py"))
    assert scripts and all(s.removesuffix(".py") in readme for s in scripts), scripts
