"""Bounds on what data may make gpufeed spend (issue 16, round 2): manifest structure counted before parsing,
class counts relative to the samples that carry them, labels out of any range counted, class files split only on
newlines, remote waits bounded by a minimum rate and a deadline, a full disk during ``stage``, denormal rates in
``plan --record`` and ``doctor``'s thread counts and data paths."""

from __future__ import annotations

import errno
import io
import json
import os
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_tar, write_tiny_shards


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (120, 30, 200)).save(buf, "JPEG")
    return buf.getvalue()


def _set(folder: Path, labels: list[bytes], ext: str = "cls") -> Path:
    """One shard of ``len(labels)`` samples, sample i labelled by ``labels[i]`` in its ``.ext`` member."""
    folder.mkdir(parents=True, exist_ok=True)
    jpg = _jpeg()
    members = []
    for i, lab in enumerate(labels):
        members += [(f"s{i:04d}.jpg", jpg), (f"s{i:04d}.{ext}", lab)]
    write_tar(folder / "foreign-000000.tar", members)
    return folder


# ------------------------------------------------------------------------------------- manifest structure

def _deep_options(src: Path, levels: int) -> Path:
    """Rewrite the manifest of ``src`` with ``options`` holding lists nested ``levels`` deep."""
    d = json.loads((src / "manifest.json").read_text())
    d["options"] = {"deep": "HERE"}
    text = json.dumps(d).replace('"HERE"', "[" * levels + "]" * levels)
    (src / "manifest.json").write_text(text)
    return src


def test_structure_check_counts_containers_values_and_depth_outside_strings() -> None:
    from gpufeed.shardset.manifest import json_structure_problem

    assert json_structure_problem(b'{"a": [1, 2, {"b": "}}]]\\"{{{[[["}], "c": "x\\\\"}') is None
    assert "objects and lists" in json_structure_problem(b"[" + b"{}," * 100_000 + b"{}]")
    assert "values" in json_structure_problem(b"[0" + b",0" * 200_000 + b"]")
    assert json_structure_problem(b"[" * 64 + b"]" * 64) is None
    assert "deeper than 64" in json_structure_problem(b"[" * 65 + b"]" * 65)
    assert "deeper than 64" in json_structure_problem(b'{"x": ' + b"[{" * 40 + b"}]" * 40 + b"}")
    assert json_structure_problem(b"[[[") is None  # not JSON: the parser says so


def test_a_manifest_of_empty_objects_is_refused_before_it_is_parsed(tmp_path: Path, monkeypatch) -> None:
    from gpufeed.shardset import manifest

    src = write_tiny_shards(tmp_path / "src", [3, 3])
    d = json.loads((src / "manifest.json").read_text())
    d["options"] = {"pad": [{}] * 200_000}
    (src / "manifest.json").write_text(json.dumps(d, separators=(",", ":")))
    parsed = []
    real = json.loads
    monkeypatch.setattr(manifest.json, "loads", lambda *a, **k: parsed.append(1) or real(*a, **k))
    with pytest.raises(DataError, match="objects and lists in .* bytes; a manifest holds at most one per 32"):
        manifest.read_manifest(src)
    assert parsed == []  # refused from the bytes, never parsed


def test_options_nested_500_deep_are_refused_by_verify_and_stage_in_one_sentence(tmp_path: Path) -> None:
    src = _deep_options(write_tiny_shards(tmp_path / "src", [3, 3]), 500)
    r = invoke(["verify", src], expect=2)
    assert "nest deeper than 64 levels" in r.stderr and "manifest.json" in r.stderr
    assert "Recursion" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    dest = tmp_path / "dest"
    r = invoke(["stage", src, dest, "--quiet"], expect=2)
    assert "nest deeper than 64 levels" in r.stderr
    assert not dest.exists() or not list(dest.glob("*.tar"))  # refused before any copy


def test_a_remote_manifest_goes_through_the_same_structure_check(http_server, fast_retry) -> None:
    from gpufeed.shardset.source import open_set

    _deep_options(write_tiny_shards(http_server.root / "set", [2]), 70)
    with pytest.raises(DataError, match="nest deeper than 64"):
        open_set(http_server.url + "/set")


# ------------------------------------------------------------------------------------- classes and labels

def test_one_huge_cls_index_cannot_make_ten_million_classes(tmp_path: Path) -> None:
    folder = _set(tmp_path / "set", [b"0", b"1", b"9999999", b"1"])
    r = invoke(["index", folder], expect=2)
    assert "9999999" in r.stderr and "10,000,000 classes for 4 samples" in r.stderr and "--classes" in r.stderr
    assert not (folder / "manifest.json").exists()
    (tmp_path / "classes.txt").write_text("a\nb\n")
    r = invoke_json(["index", folder, "--classes", tmp_path / "classes.txt"], expect=1)  # with names: counted
    assert r["num_classes"] == 2 and r["num_bad_labels"] == 1


def test_sparse_indices_within_the_allowance_still_index(tmp_path: Path) -> None:
    folder = _set(tmp_path / "set", [b"0", b"999", b"3"])
    r = invoke_json(["index", folder])
    assert r["num_classes"] == 1000 and r["ok"]


def test_a_json_label_of_10_to_the_30_is_counted_and_the_manifest_written(tmp_path: Path) -> None:
    folder = _set(tmp_path / "set", [b'{"y": 0}', b'{"y": 1}', b'{"y": 1000000000000000000000000000000}',
                                     b'{"y": -4}', b'{"y": 1}'], ext="json")
    r = invoke_json(["index", folder, "--label", "json:y"], expect=1)
    assert r["num_classes"] == 2 and r["num_bad_labels"] == 2 and r["num_samples"] == 5
    assert any("1000000000" in b and "outside 0..1" in b for b in r["bad_labels"])
    from gpufeed.shardset.manifest import read_manifest

    assert read_manifest(folder).classes == ["0", "1"]


def test_digit_text_labels_past_the_class_limit_are_counted_too(tmp_path: Path) -> None:
    folder = _set(tmp_path / "set", [b"2", b"0", b"123456789012345678901234567890"])
    r = invoke_json(["index", folder], expect=1)
    assert r["num_classes"] == 3 and r["num_bad_labels"] == 1


def test_train_refuses_a_manifest_with_classes_no_sample_has(tmp_path: Path) -> None:
    from gpufeed.config import TrainConfig
    from gpufeed.shardset.manifest import Manifest, ShardInfo
    from gpufeed.train import check_classes

    m = Manifest(prefix="t", classes=[str(i) for i in range(10_000_000)],
                 shards=[ShardInfo("t-000000.tar", 4, 10240, None)], num_samples=4)
    with pytest.raises(DataError, match="10,000,000 classes for 4 samples"):
        check_classes(TrainConfig(shards=str(tmp_path)), m, None)
    check_classes(TrainConfig(shards=str(tmp_path)), Manifest(
        prefix="t", classes=[str(i) for i in range(1000)], shards=[ShardInfo("t-000000.tar", 4, 10240, None)],
        num_samples=4), None)


def test_class_file_with_a_bom_and_a_u2028_name_labels_like_its_lines(tmp_path: Path) -> None:
    from gpufeed.index import class_lines, read_class_list

    names = ["cat", "sea\u2028lion", "naïve\x85x", "dog"]
    f = tmp_path / "classes.txt"
    f.write_bytes(b"\xef\xbb\xbf" + "\r\n".join(names).encode("utf-8") + b"\r\n\n")
    assert read_class_list(f) == names
    assert class_lines("\ufeffa\nb\u2029c\n") == ["a", "b\u2029c"]
    folder = _set(tmp_path / "set", [b"cat", "sea\u2028lion".encode(), b"dog"])
    r = invoke_json(["index", folder, "--classes", f])
    assert r["ok"] and r["num_classes"] == 4
    from gpufeed.shardset.manifest import read_manifest

    assert read_manifest(folder).classes == names  # cat -> 0, sea lion -> 1, dog -> 3, as the file's lines say


# ------------------------------------------------------------------------------------- stage on a full disk

def test_a_full_disk_during_stage_is_a_failed_run_naming_the_file(tmp_path: Path, monkeypatch) -> None:
    src = write_tiny_shards(tmp_path / "src", [3, 3])
    dest = tmp_path / "dest"
    real = os.fdopen

    class Full(io.RawIOBase):  # the copy's temporary file on a disk that fills up at its first write
        def __init__(self, fd: int) -> None:
            self.f = real(fd, "wb")

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

        def close(self) -> None:
            self.f.close()
            super().close()

    monkeypatch.setattr(os, "fdopen",
                        lambda fd, mode="r", *a, **k: Full(fd) if "w" in mode else real(fd, mode, *a, **k))
    r = invoke(["stage", src, dest, "--quiet", "--jobs", "1"], expect=1)
    assert "No space left on device" in r.stderr and ".train-00000" in r.stderr and ".tar.tmp" in r.stderr
    assert str(dest) in r.stderr and "was not staged" in r.stderr
    assert not list(dest.glob(".*.tmp")) and not (dest / "manifest.json").exists()


# ------------------------------------------------------------------------------------- plan --record

@pytest.mark.parametrize("record", [
    {"best_trial": 0, "trials": [{"trial": 0, "num_workers": 2, "samples_per_core_s": 5e-324}]},
    {"modes": {"loader-only": {"samples_per_s": 900.0, "loader_cores_used": 3.0},
               "synthetic": {"samples_per_s": 5e-324}}},
    {"modes": {"loader-only": {"samples_per_s": 5e-324, "loader_cores_used": 3.0}}},
])
def test_a_denormal_rate_in_a_record_is_not_a_measurement(tmp_path: Path, record: dict) -> None:
    p = tmp_path / "summary.json"
    p.write_text(json.dumps(record))
    r = invoke(["plan", "--arch", "resnet18", "--device", "cpu", "--record", p, "--target-rate", "10"], expect=2)
    assert "is 4.94066e-324, not a measured rate" in r.stderr and "inf" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# ------------------------------------------------------------------------------------- doctor

@pytest.mark.parametrize("value", ["-3", "0", "two", "4.5", "", "4,-1"])
def test_doctor_fails_an_omp_num_threads_that_is_no_thread_count(value: str) -> None:
    from gpufeed import doctor as d
    from gpufeed.config import LoaderConfig

    report = d.run_checks(d.Facts(env={"OMP_NUM_THREADS": value}), LoaderConfig())
    env = next(c for c in report.checks if c.name == "environment")
    assert env.status == "fail" and f"OMP_NUM_THREADS={value!r}" in env.evidence and not report.ok
    for good in ("1", "8", "4,2"):
        env = next(c for c in d.run_checks(d.Facts(env={"OMP_NUM_THREADS": good}), LoaderConfig()).checks
                   if c.name == "environment")
        assert env.status == "ok"


def test_doctor_fails_a_fifo_proc_sys_or_dev_null_as_a_data_path(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/null", "/proc", "/proc/self", "/sys"):
        r = invoke_json(["doctor", str(path)], expect=1)
        check = next(c for c in r["checks"] if c["name"] == f"data {path}")
        assert check["status"] == "fail", check
        assert ("FIFO" in check["evidence"] if path == fifo else True)
    r = invoke_json(["doctor", str(tmp_path)])  # a folder is still ok
    assert next(c for c in r["checks"] if c["name"] == f"data {tmp_path}")["status"] == "ok"


def test_dev_shm_is_still_a_data_path() -> None:
    from gpufeed import doctor as d

    assert not d.pseudo_path("/dev/shm/set", "tmpfs")
    assert d.pseudo_path("/dev/disk", "tmpfs") and d.pseudo_path("/x", "proc") and d.pseudo_path("/sys/fs", "sysfs")


# ------------------------------------------------------------------------------------- remote waits and replies

def _head_ok(size: int) -> bytes:
    return f"HTTP/1.1 200 OK\r\nContent-Length: {size}\r\nAccept-Ranges: bytes\r\n\r\n".encode()


def test_a_manifest_dribbled_at_one_byte_a_tick_fails_at_the_minimum_rate_bound(raw_server, monkeypatch,
                                                                                 fast_retry) -> None:
    from gpufeed.shardset import source

    monkeypatch.setattr(source, "READ_TIMEOUT_S", 0.5)
    monkeypatch.setattr(source, "CONNECT_TIMEOUT_S", 0.5)
    monkeypatch.setattr(source, "RETRY", source.Retry(attempts=50, first_wait_s=0.01, max_wait_s=5.0))
    size = 400

    def dribble(req: bytes):
        if req.startswith(b"HEAD"):
            return [(_head_ok(size), 0)]
        return [(_head_ok(size), 0)] + [(b" ", 0.02)] * size  # 50 bytes/s, well under 64 KiB/s

    server = raw_server(dribble)
    with pytest.raises(DataError, match=r"the manifest came slower than 64 KiB/s .*0.5 s to connect, 0.5 s of read"):
        source.read_bytes(server.url + "/manifest.json", 1 << 20, "manifest")
    assert sum(r.startswith(b"GET") for r in server.requests) <= 2  # not 50 tries of 0.5 s: the deadline ended it


def test_a_jobs_deadline_bounds_every_remote_read_and_says_whose(raw_server, fast_retry) -> None:
    import time

    from gpufeed.shardset import source

    size = 4 << 20

    def slow(req: bytes):
        if req.startswith(b"HEAD"):
            return [(_head_ok(size), 0)]
        return [(b"HTTP/1.1 206 Partial Content\r\nContent-Length: 1048576\r\nContent-Range: bytes 0-1048575/"
                  + str(size).encode() + b"\r\n\r\n", 0)] + [(b"\0" * 100, 0.05)] * 40

    server = raw_server(slow)
    with source.reads_bounded_by(time.monotonic() + 0.5, "tune's budget of 0.5 s ran out"):
        with pytest.raises(DataError, match=r"tune's budget of 0.5 s ran out \(at byte [1-9]\d* of 4194304"):
            with source.open_shard(server.url + "/a.tar") as f:
                f.read(1 << 20)
    assert source._JOB_DEADLINE is None


def test_tune_budget_bounds_its_wait_on_a_slow_source(http_server, fast_retry) -> None:
    from gpufeed.config import TuneConfig
    from gpufeed.tune import tune

    write_tiny_shards(http_server.root / "set", [4, 4])
    http_server.faults.bandwidth = 100  # bytes/s: the manifest alone takes over 10 s
    with pytest.raises(DataError, match=r"tune's budget of 1 s \(plus its 0 s storage probe\) ran out"):
        tune(TuneConfig(shards=http_server.url + "/set", budget_s=1.0, storage_probe_s=0.0, batch_size=8,
                        image_size=16), write=False)


def test_a_redirect_to_file_is_refused_with_the_reason(raw_server, fast_retry) -> None:
    from gpufeed.shardset import source

    server = raw_server(lambda req: [(b"HTTP/1.1 302 Found\r\nLocation: file:///etc/passwd\r\n"
                                      b"Content-Length: 0\r\n\r\n", 0)])
    with pytest.raises(DataError, match=r"redirects to file:// are refused: gpufeed follows a redirect only to an "
                                        r"http\(s\) URL \(the server redirected to 'file:///etc/passwd'\)"):
        source.read_bytes(server.url + "/manifest.json", 1 << 20, "manifest")


def test_a_body_longer_than_its_content_length_is_not_reported_as_http_400(raw_server, fast_retry) -> None:
    from gpufeed.shardset import source

    def longer(req: bytes):
        if req.startswith(b"HEAD"):
            return [(_head_ok(10), 0)]
        return [(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\n0123456789 AND TWENTY MORE BYTES", 0)]

    server = raw_server(longer)
    with pytest.raises(DataError) as err:
        source.read_bytes(server.url + "/manifest.json", 1 << 20, "manifest")
    assert "HTTP 400" not in str(err.value) and "not valid HTTP" in str(err.value)


def test_tune_budget_bounds_the_reads_of_its_trials_and_their_workers(http_server, fast_retry) -> None:
    """The manifest is local (fast); the shards come at 100 bytes/s: the trials' loaders (in the process, and in a
    forked worker) stop reading when the budget runs out, saying so, instead of minutes of timeouts and retries."""
    from gpufeed.config import TuneConfig
    from gpufeed.tune import tune

    src = write_tiny_shards(http_server.root / "set", [40, 40])
    http_server.faults.bandwidth = 100
    r = tune(TuneConfig(shards=http_server.url + "/set/train-{000000..000001}.tar",
                        manifest=str(src / "manifest.json"), budget_s=2.0, storage_probe_s=0.0, max_workers=1,
                        batch_size=8, image_size=16), check_shards=None, write=False)
    assert r.trials and all(not t.ok for t in r.trials)
    assert all("tune's budget of 2 s (plus its 0 s storage probe) ran out" in t.error for t in r.trials)
    assert {t.num_workers for t in r.trials} <= {0, 1}
