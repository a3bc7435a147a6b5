"""Fitting the tools users already have (issue 17): webdataset's ``pipe:`` forms (aws, gsutil, curl, s5cmd),
``train --shards DIR/manifest.json``, the S3 endpoint variables (AWS CLI/boto3, s5cmd) and failing fast on an
unreachable endpoint, img2dataset's own records (``NNNNN_stats.json``, ``NNNNN.parquet``) and numbered names, and
how to fix ungrouped keys. Fake ``aws``/``gsutil``/``curl``/``s5cmd`` scripts on PATH stream local files; network
tests use loopback servers only."""

from __future__ import annotations

import io
import json
import os
import stat
import time
from pathlib import Path

import pytest

from tests.common.cli import invoke, invoke_json
from tests.common.shards import write_tar, write_tiny_shards


def _jpeg() -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (8, 8), (200, 30, 30)).save(buf, "JPEG")
    return buf.getvalue()


# ------------------------------------------------------------------------------------------------- ungrouped keys


def test_ungrouped_keys_say_how_to_fix_them_in_index_and_verify(tmp_path: Path) -> None:
    d = tmp_path / "gnu"
    d.mkdir()
    j = _jpeg()  # GNU tar without --sort=name: a.jpg, b.jpg, b.cls, a.cls (directory order)
    write_tar(d / "data-000.tar", [("a.jpg", j), ("b.jpg", j), ("b.cls", b"1"), ("a.cls", b"0")])
    res = invoke(["index", d], expect=1)
    (line,) = [x for x in res.stdout.splitlines() if "come back after other keys" in x]
    assert "tar --sort=name" in line and "gpufeed shard" in line and "data-000.tar: a.cls" in line
    res = invoke(["verify", d], expect=1)
    assert "a.cls" in res.stdout and "tar --sort=name" in res.stdout and "gpufeed shard" in res.stdout


# ------------------------------------------------------------------------------------------------- train --shards FILE


@pytest.mark.timeout(240)
def test_train_takes_manifest_json_for_shards_and_val_shards(tmp_path: Path) -> None:
    train = write_tiny_shards(tmp_path / "train", [8, 8], image_px=32)
    val = write_tiny_shards(tmp_path / "val", [8], image_px=32, seed=1, prefix="val")
    res = invoke(["train", "--shards", train / "manifest.json", "--val-shards", val / "manifest.json",
                  "--arch", "resnet18", "--image-size", "32", "--num-workers", "0", "--amp", "off", "--device", "cpu",
                  "--quiet", "--threads", "1", "--steps", "1", "--batch-size", "4", "--run-dir", tmp_path / "run",
                  "--json"], expect=None)
    assert res.exit_code in (0, 1), res.stderr  # 1: a verdict of starved; never 2 (refused)
    s = json.loads(res.stdout)
    assert s["step"] == 1 and [v["num_samples"] for v in s["val"]] == [8]


# ------------------------------------------------------------------------------------------------- pipe: forms

_FAKES = {
    # each streams $FAKE_ROOT/<bucket or host>/<key> and refuses any other form of its command line (exit 64)
    "aws": '[ "$1 $2 $4 $#" = "s3 cp - 4" ] || exit 64\nu="$3"; exec cat "$FAKE_ROOT/${u#s3://}"',
    "gsutil": '[ "$1 $#" = "cat 2" ] || exit 64\nu="$2"; exec cat "$FAKE_ROOT/${u#gs://}"',
    "s5cmd": '[ "$1 $#" = "cat 2" ] || exit 64\nu="$2"; exec cat "$FAKE_ROOT/${u#s3://}"',
    "curl": 'case "$1" in -s|-fsSL) ;; *) exit 64;; esac\n[ "$#" = 2 ] || exit 64\n'
            'u="${2#http://}"; u="${u%%\\?*}"; exec cat "$FAKE_ROOT/$u"',
}

FORMS = {
    "aws": "pipe:aws s3 cp s3://bucket/set/train-{000000..000002}.tar -",
    "gsutil": "pipe:gsutil cat gs://bucket/set/train-{000000..000002}.tar",
    "s5cmd": "pipe:s5cmd cat s3://bucket/set/train-{000000..000002}.tar",
    "curl -s": "pipe:curl -s http://bucket/set/train-{000000..000002}.tar",
    "curl -fsSL": "pipe:curl -fsSL 'http://bucket/set/train-{000000..000002}.tar?token=abc'",
}


@pytest.fixture
def fake_tools(tmp_path: Path, monkeypatch) -> Path:
    """Fake aws, gsutil, s5cmd and curl first on PATH, streaming files under ``FAKE_ROOT``; returns the set's
    folder (three shards under FAKE_ROOT/bucket/set)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, body in _FAKES.items():
        script = bin_dir / name
        script.write_text(f"#!/bin/sh\n{body}\n")
        script.chmod(script.stat().st_mode | stat.S_IXUSR)
    root = tmp_path / "store"
    folder = write_tiny_shards(root / "bucket" / "set", [6, 6, 5], image_px=24)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("FAKE_ROOT", str(root))
    return folder


@pytest.mark.parametrize("form", sorted(FORMS))
def test_verify_and_index_read_the_pipe_forms_of_the_s3_gcs_and_http_tools(fake_tools: Path, tmp_path: Path,
                                                                         form: str) -> None:
    pattern = FORMS[form]
    rec = invoke_json(["verify", pattern, "--manifest", fake_tools / "manifest.json", "--workers", "1",
                       "--no-decode"])
    assert rec["ok"] and rec["num_shards"] == 3 and rec["num_samples"] == 17
    out = tmp_path / "indexed"
    rec = invoke_json(["index", pattern, "--out", out])
    assert rec["num_shards"] == 3 and rec["num_samples"] == 17
    m = json.loads((out / "manifest.json").read_text())
    assert [s["name"] for s in m["shards"]] == [f"train-00000{i}.tar" for i in range(3)]
    assert [s["sha256"] for s in m["shards"]] == [s["sha256"] for s in
                                                  json.loads((fake_tools / "manifest.json").read_text())["shards"]]


def test_a_pipe_pattern_naming_other_shards_than_the_manifest_is_refused_by_name(fake_tools: Path) -> None:
    res = invoke(["verify", "pipe:aws s3 cp s3://bucket/set/val-{000000..000002}.tar -", "--manifest",
                  fake_tools / "manifest.json"], expect=2)
    assert "shard 0 of the pattern is 'val-000000.tar'" in res.stderr and "'train-000000.tar'" in res.stderr


@pytest.mark.parametrize("command, name", [
    ("aws s3 cp s3://b/set/train-000001.tar -", "train-000001.tar"),
    ("aws s3 cp --quiet s3://b/set/train-000001.tar - 2>/dev/null", "train-000001.tar"),
    ("gsutil -q cat gs://b/x/a-7.tgz", "a-7.tgz"),
    ("curl -fsSL 'https://h/p/a-1.tar.gz?X-Amz-Signature=1&b=2'", "a-1.tar.gz"),
    ("s5cmd --endpoint-url http://127.0.0.1:9 cat s3://b/a-2.tar", "a-2.tar"),
    ("cat /x/a-1.tar 2> /tmp/log.tar", "a-1.tar"),
    ("ssh host cat /data/a-3.tar", "a-3.tar"),
    ("mycmd --get s3://b/k -", "k"),  # no shard-like word: the last word that is not an option or '-'
])
def test_a_pipe_commands_shard_name_is_the_word_holding_its_url(command: str, name: str) -> None:
    from gpufeed.shardset.source import source_name

    assert source_name(f"pipe:{command}") == name


# ------------------------------------------------------------------------------------------------- S3 endpoints

_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")


@pytest.fixture
def s3_set(s3_server, tmp_path: Path, monkeypatch):
    """Two shards under s3://data/set on moto's loopback server, no endpoint variable set; yields the endpoint.
    The filesystem cache and the endpoints seen are reset whenever a test changes the variables."""
    from gpufeed.shardset import source

    client, endpoint = s3_server
    folder = write_tiny_shards(tmp_path / "set", [5, 4], image_px=16)
    client.create_bucket(Bucket="data")
    for p in folder.iterdir():
        client.upload_file(str(p), "data", f"set/{p.name}")
    for var in _ENDPOINT_VARS:
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setattr(source, "_FS", {})
    monkeypatch.setattr(source, "_REACHED", set(), raising=False)
    return endpoint


@pytest.mark.parametrize("env", [
    {"S3_ENDPOINT_URL": "{moto}"},  # s5cmd's variable alone
    {"AWS_ENDPOINT_URL": "{moto}", "S3_ENDPOINT_URL": "{closed}"},  # the AWS CLI's wins over s5cmd's
    {"AWS_ENDPOINT_URL_S3": "{moto}", "AWS_ENDPOINT_URL": "{closed}"},  # the service-specific one wins
])
def test_the_s3_endpoint_variables_are_honoured_in_order(s3_set: str, monkeypatch, env: dict) -> None:
    from tests.common.netserver import closed_port

    closed = f"http://127.0.0.1:{closed_port()}"
    for var, value in env.items():
        monkeypatch.setenv(var, value.format(moto=s3_set, closed=closed))
    rec = invoke_json(["verify", "s3://data/set", "--workers", "1", "--no-decode"])
    assert rec["ok"] and rec["num_samples"] == 9


def test_an_unreachable_endpoint_fails_at_once_naming_it_and_the_variables(s3_set: str, monkeypatch) -> None:
    from gpufeed.shardset import source
    from tests.common.netserver import closed_port

    closed = f"http://127.0.0.1:{closed_port()}"
    monkeypatch.setenv("S3_ENDPOINT_URL", closed)
    waits: list[float] = []

    class Clock:  # gpufeed's retry waits, recorded instead of slept
        sleep = waits.append
        perf_counter = time.perf_counter
        monotonic = time.monotonic  # the read deadlines

    monkeypatch.setattr(source, "time", Clock)
    res = invoke(["verify", "s3://data/set"], expect=2)
    err = res.stderr.strip()
    assert err.startswith("error: s3://data/set/manifest.json: cannot connect (") and "\n" not in err
    assert f"endpoint {closed} from S3_ENDPOINT_URL" in err
    assert "gpufeed reads AWS_ENDPOINT_URL_S3, then AWS_ENDPOINT_URL, then S3_ENDPOINT_URL" in err
    assert waits == []  # not retried: nothing ever answered there
    fs = source.fs_for("s3://data/set")
    assert fs.retries == 1 and fs._s3._client_config.retries["total_max_attempts"] == 1  # botocore tries once too


def test_an_endpoint_that_answered_before_is_retried_when_it_stops_answering(s3_set: str, monkeypatch,
                                                                             fast_retry) -> None:
    from gpufeed.shardset import source
    from gpufeed.shardset.source import SourceError, remote_size

    monkeypatch.setenv("S3_ENDPOINT_URL", s3_set)
    assert remote_size("s3://data/set/train-000000.tar") > 0
    fs = source.fs_for("s3://data/set")

    def refused(path: str) -> int:
        raise ConnectionRefusedError(111, "Connection refused")

    monkeypatch.setattr(fs, "size", refused)
    with pytest.raises(SourceError, match=r"Connection refused after 3 attempts \(endpoint .* from S3_ENDPOINT_URL"):
        remote_size("s3://data/set/train-000001.tar")


def test_an_endpoint_variable_that_is_not_a_url_is_refused_by_name(s3_set: str, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", "minio.local:9000")
    res = invoke(["verify", "s3://data/set"], expect=2)
    assert res.stderr.startswith("error: AWS_ENDPOINT_URL='minio.local:9000' is not an S3 endpoint URL")


# ------------------------------------------------------------------------------------------------- img2dataset


def _img2dataset_folder(root: Path, shards: list[list[tuple[str, str | None]]]) -> Path:
    """An img2dataset webdataset output: per shard ``NNNNN.tar`` (KEY.jpg, KEY.txt, KEY.json for each download
    that succeeded), ``NNNNN.parquet`` (one row per URL: url, key, status, error_message, caption) and
    ``NNNNN_stats.json``, as img2dataset's writer.py and logger.py write them. ``shards``: per shard, (label,
    error message or None) per URL."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    root.mkdir(parents=True)
    j = _jpeg()
    for s, urls in enumerate(shards):
        members, rows = [], []
        status_dict: dict[str, int] = {}
        for i, (label, error) in enumerate(urls):
            key = f"{s:05d}{i:04d}"
            url = f"https://img.example/{key}.jpg"
            status = "success" if error is None else "failed_to_download"
            rows.append({"url": url, "caption": label, "key": key, "status": status, "error_message": error,
                         "width": 8 if error is None else None})
            status_dict[error or "success"] = status_dict.get(error or "success", 0) + 1
            if error is None:
                meta = json.dumps({"url": url, "caption": label, "key": key, "status": status}).encode()
                members += [(f"{key}.jpg", j), (f"{key}.txt", label.encode()), (f"{key}.json", meta)]
        write_tar(root / f"{s:05d}.tar", members)
        pq.write_table(pa.Table.from_pylist(rows), root / f"{s:05d}.parquet")
        ok = sum(e is None for _, e in urls)
        (root / f"{s:05d}_stats.json").write_text(json.dumps({
            "count": len(urls), "successes": ok, "failed_to_download": len(urls) - ok, "failed_to_resize": 0,
            "duration": 1.5, "status_dict": status_dict}, indent=4))
    return root


def test_index_reports_img2datasets_failed_downloads_next_to_the_samples(tmp_path: Path) -> None:
    shards = [[("cat", None), ("dog", None), ("cat", "HTTP Error 404: Not Found"), ("dog", None)],
              [("dog", None), ("cat", "<urlopen error timed out>"), ("cat", None)],
              [("cat", None), ("dog", "HTTP Error 403: Forbidden"), ("dog", None)]]
    folder = _img2dataset_folder(tmp_path / "laion", shards)
    res = invoke(["index", folder, "--label", "txt"])
    lines = res.stdout.splitlines()
    assert "7 samples" in lines[0]
    assert lines[1] == (
        "img2dataset records (3 _stats.json, 3 .parquet): 10 URLs, 7 downloaded, 3 failed to download, 0 failed to "
        "resize: 00000.tar: https://img.example/000000002.jpg (HTTP Error 404: Not Found); 00001.tar: "
        "https://img.example/000010001.jpg (<urlopen error timed out>); 00002.tar: https://img.example/000020001.jpg "
        "(HTTP Error 403: Forbidden)")
    rec = invoke_json(["index", folder, "--label", "txt"])["img2dataset"]
    assert (rec["count"], rec["successes"], rec["failed_to_download"], rec["num_unreadable"]) == (10, 7, 3, 0)
    m = json.loads((folder / "manifest.json").read_text())
    assert m["url_pattern"] == "{00000..00002}.tar" and m["num_samples"] == 7
    invoke(["verify", folder, "--workers", "1"])  # the records beside the shards are not shards


def test_img2dataset_records_that_do_not_read_or_do_not_match_are_named(tmp_path: Path) -> None:
    folder = _img2dataset_folder(tmp_path / "odd", [[("cat", None), ("dog", None)], [("cat", None)], [("dog", None)]])
    (folder / "00000_stats.json").write_text('{"count": 2, "successes": 5, "failed_to_download": 0}')
    (folder / "00001.parquet").write_bytes(b"PAR1 not really")
    stats = json.loads((folder / "00002_stats.json").read_text())
    (folder / "00002_stats.json").write_text(json.dumps({**stats, "successes": 3, "count": 3}))
    res = invoke(["index", folder, "--label", "txt"], expect=1)
    out = res.stdout
    assert "error: 2 img2dataset record(s) gpufeed cannot read: 00000_stats.json (" in out
    assert "00001.parquet (not a readable parquet file" in out
    assert ("error: 1 shard(s) whose samples differ from img2dataset's successes: 00002.tar: holds 1 samples, "
            "img2dataset's records say 3 downloads succeeded") in out


@pytest.mark.parametrize("names, pattern", [
    ([f"{i:05d}.tar" for i in range(13)], "{00000..00012}.tar"),
    (["train-000000.tar", "train-000001.tar"], "train-{000000..000001}.tar"),
    (["part_07.tgz", "part_08.tgz", "part_09.tgz"], "part_{07..09}.tgz"),
    (["00000.tar", "00002.tar"], ""),  # not contiguous
    (["a.tar", "b.tar"], ""),
])
def test_the_url_pattern_of_numbered_names_with_any_prefix(names: list[str], pattern: str) -> None:
    import braceexpand

    from gpufeed.index import _prefix_and_pattern

    assert _prefix_and_pattern(names)[1] == pattern
    if pattern:
        assert list(braceexpand.braceexpand(pattern)) == names
