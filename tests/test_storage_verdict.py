"""The live storage verdict: measure.storage_probe.probe, gpufeed io records as the storage rate, what train
--measure records in summary.json (``storage``) and how the verdict's storage fixes are fed from train.py."""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest

from gpufeed.config import IoConfig, LoaderConfig, TrainConfig
from gpufeed.core.errors import DataError
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.measure.storage_probe import RAM_FILESYSTEMS, filesystem_of, io_record_rate, local_open, probe
from gpufeed.storage import measure_io
from gpufeed.train.records import RankTiming, aggregate
from gpufeed.measure.verdict import classify
from gpufeed.core.world import World
from tests.common.cli import invoke
from tests.common.shards import write_tiny_shards

TINY = ["--arch", "resnet18", "--image-size", "32", "--batch-size", "4", "--num-workers", "0", "--amp", "off",
        "--device", "cpu", "--quiet", "--threads", "1", "--measure", "--measure-steps", "3"]


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    return write_tiny_shards(tmp_path_factory.mktemp("sv") / "train", [16, 16, 16, 16])


def test_probe_reads_the_shard_files_within_its_byte_bound(shards: Path) -> None:
    read = []

    def counting(path: str):
        read.append(path)
        return local_open(path)

    total = sum(p.stat().st_size for p in shards.glob("*.tar"))
    rate = probe(shards, 0.5, max_readers=4, opener=counting)
    assert rate.source == "probe" and rate.bytes_per_s > 0 and rate.path == str(shards)
    assert [r for r, _ in rate.ladder] == [1, 2, 4] and rate.readers in (1, 2, 4)
    assert rate.bytes_per_s == max(b for _, b in rate.ladder)
    assert rate.cache == ("warm" if filesystem_of(shards)[0] in RAM_FILESYSTEMS else "cold")
    assert {Path(p).name for p in read} <= {p.name for p in shards.glob("*.tar")}
    # 3 steps of at most 1000 bytes each: the probe reads 3000 bytes of the larger set, no more
    got = [0]

    class Counting:
        def __init__(self, path: str) -> None:
            self.f = local_open(path)

        def readinto(self, view) -> int:
            n = self.f.readinto(view) or 0
            got[0] += n
            return n

        def __enter__(self):
            return self

        def __exit__(self, *exc) -> None:
            self.f.close()

    probe(shards, 5.0, max_readers=4, max_bytes=3 * 1000, opener=Counting)
    assert got[0] == 3000 < total


def test_an_io_record_of_the_shard_folder_gives_its_best_cold_rate(shards: Path, tmp_path: Path) -> None:
    report = measure_io([str(shards)], IoConfig(seconds=0.2, max_readers=2, run_dir=str(tmp_path / "io")))
    rec = Path(report.run_dir) / "summary.json"
    rate = io_record_rate(rec, shards / "manifest.json")  # the manifest names the same folder
    loc = report.locations[0]
    best = loc.best_cold_mb_per_s if loc.best_cold_mb_per_s is not None else loc.best_warm_mb_per_s
    assert rate.source == "io record" and rate.bytes_per_s == pytest.approx(best * 1e6)
    assert rate.cache == ("cold" if loc.best_cold_mb_per_s is not None else "warm")
    other = tmp_path / "other"
    other.mkdir()
    with pytest.raises(DataError, match=f"measured {shards}, not the shard set's folder {other}"):
        io_record_rate(rec, other)


@pytest.mark.parametrize("content, says", [
    (b"not json", "is not readable JSON, so not a gpufeed io summary.json"),
    (b"[1, 2]", "is not a gpufeed io summary.json (no locations)"),
    (b'{"locations": [{"path": "SHARDS", "steps": [{"readers": true, "cache": "cold", "mb_per_s": 5}]}]}',
     "holds no measured steps for"),
])
def test_a_bad_storage_record_is_exit_2_in_one_sentence(shards: Path, tmp_path: Path, content: bytes,
                                                         says: str) -> None:
    bad = tmp_path / "summary.json"
    bad.write_bytes(content.replace(b"SHARDS", str(shards).encode()))
    res = invoke(["train", "--shards", shards, *TINY, "--storage-record", bad, "--run-dir", tmp_path / "run"],
                 expect=2)
    assert res.stderr.startswith("error: ") and says in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "run" / "summary.json").exists()


def test_a_storage_record_larger_than_the_bound_is_refused(shards: Path, tmp_path: Path) -> None:
    big = tmp_path / "summary.json"
    big.write_text(json.dumps({"locations": []}))
    with pytest.raises(DataError, match="is larger than 0 MiB; it is not a gpufeed io summary.json"):
        io_record_rate(big, shards, max_bytes=10)


def test_train_measure_records_the_probed_storage_rate(shards: Path, tmp_path: Path) -> None:
    run = tmp_path / "run"
    res = invoke(["train", "--shards", shards, *TINY, "--storage-probe-s", "0.5", "--run-dir", run], expect=None)
    s = json.loads((run / "summary.json").read_text())
    st = s["storage"]
    assert st["source"] == "probe" and st["bytes_per_s"] > 0 and st["readers"] >= 1 and st["cache"] in ("cold", "warm")
    assert f"storage: {st['bytes_per_s'] / 1e6:,.1f} MB/s (probe, {st['readers']} reader(s), {st['cache']})" in res.stdout
    assert res.exit_code == (0 if s["ok"] else 1)


def test_train_records_a_given_storage_rate_and_no_probe_when_disabled(shards: Path, tmp_path: Path) -> None:
    invoke(["train", "--shards", shards, *TINY, "--storage-rate", "1", "--run-dir", tmp_path / "a"], expect=None)
    s = json.loads((tmp_path / "a" / "summary.json").read_text())
    assert (s["storage"]["source"], s["storage"]["bytes_per_s"], s["storage"]["ladder"]) == ("--storage-rate", 1.0, [])
    invoke(["train", "--shards", shards, *TINY, "--storage-probe-s", "0", "--run-dir", tmp_path / "b"], expect=None)
    assert json.loads((tmp_path / "b" / "summary.json").read_text())["storage"] is None


def _timing(read_bytes: int, data_wait_s: float) -> RankTiming:
    return RankTiming(rank=0, num_steps=3, num_samples=12, wall_s=1.0, step_s=1.0, data_wait_s=data_wait_s,
                      next_wait_s=data_wait_s, h2d_s=0.0, compute_s=1.0 - data_wait_s, samples_per_s=12.0,
                      stall_pct=100 * data_wait_s, window_rates=[12.0], cores_used=1.0, read_bytes=read_bytes)


def test_a_tiny_storage_rate_makes_a_starved_run_storage_bound_with_the_stage_fix(shards: Path) -> None:
    """train.verdict_inputs feeds the verdict the storage rate, the set's bytes (manifest) and /dev/shm's free
    space: a run reading 1000 B/s from a 1 B/s storage is storage-bound, and the fix is the stage command."""
    from gpufeed.train import Trainer, verdict_inputs

    cfg = TrainConfig(shards=str(shards), arch="resnet18", amp="off", progress=False, device="cpu", threads=1,
                      mode="measure")
    loader = LoaderConfig(batch_size=4, num_workers=0, image_size=32, decode="pil", pin_memory=False)
    trainer = Trainer(cfg, loader, World.single())
    modes = {"synthetic": aggregate("synthetic", [_timing(0, 0.0)]),
             "loader-only": aggregate("loader-only", [_timing(1000, 0.0)]),
             "real": aggregate("real", [_timing(1000, 0.5)])}
    vin = verdict_inputs(modes, trainer, StorageRate(bytes_per_s=1.0, source="--storage-rate"))
    assert (vin.storage_bytes_per_s, vin.storage_source) == (1.0, "--storage-rate")
    assert vin.set_bytes == sum(p.stat().st_size for p in shards.glob("*.tar"))
    v = classify(vin)
    assert (v.status, v.bound) == ("starved", "storage")
    if Path("/dev/shm").is_dir():
        free = shutil.disk_usage("/dev/shm").free
        assert f"stage the set to /dev/shm with gpufeed stage {shards} /dev/shm/train (fits: " in v.fixes[1]
        assert v.numbers["set_bytes"] == vin.set_bytes and abs(v.numbers["shm_free_bytes"] - free) < 1 << 30
    no_storage = classify(dataclasses.replace(vin, storage_bytes_per_s=None))
    assert no_storage.bound != "storage"
