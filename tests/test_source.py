"""gpufeed.shardset.source: where a shard set lives (local, http, pipe:), against a real loopback server."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gpufeed.core.errors import DataError
from gpufeed.shardset import source
from gpufeed.shardset.source import Retry, SourceError, is_remote, open_set, open_shard
from tests.common.netserver import closed_port
from tests.common.shards import write_tiny_shards


@pytest.fixture
def served(http_server, tmp_path):
    """A two-shard set written under the server's folder ``set/``; returns (server, local folder)."""
    folder = write_tiny_shards(http_server.root / "set", [5, 3], image_px=16)
    return http_server, folder


def test_is_remote():
    assert [is_remote(s) for s in ("http://h/x", "https://h/x", "s3://b/k", "gs://b/k", "pipe:cat x",
                                   "/data/set", "relative/http://x", Path("s3:/x"))] == [True] * 5 + [False] * 3


def test_retry_waits_double_and_are_bounded():
    assert Retry(attempts=5, first_wait_s=1, max_wait_s=30).waits() == [1, 2, 4, 8]
    assert Retry(attempts=5, first_wait_s=4, max_wait_s=10).waits() == [4, 6, 0, 0]


def test_local_set_and_url_folder_name_the_same_shards(served):
    server, folder = served
    local = open_set(folder)
    assert not local.remote and local.urls == [str(folder / "train-000000.tar"), str(folder / "train-000001.tar")]
    for spec in (f"{server.url}/set", f"{server.url}/set/", f"{server.url}/set/manifest.json"):
        remote = open_set(spec)
        assert remote.remote and remote.location == spec
        assert remote.urls == [f"{server.url}/set/train-000000.tar", f"{server.url}/set/train-000001.tar"]
        assert remote.manifest == local.manifest


def test_remote_stream_reads_the_exact_bytes_in_small_ranges(served):
    server, folder = served
    data = (folder / "train-000000.tar").read_bytes()
    url = f"{server.url}/set/train-000000.tar"
    with open_shard(url, size=len(data), chunk_bytes=1000) as f:
        assert f.read() == data
    ranges = [r for m, p, r in server.requests if m == "GET" and p == "/set/train-000000.tar"]
    assert len(ranges) == -(-len(data) // 1000) and ranges[0] == "bytes=0-999"
    with open_shard(url, offset=1536, chunk_bytes=4096) as f:  # size from HEAD
        assert f.read() == data[1536:]


@pytest.mark.parametrize("streams", [1, 4])
def test_parallel_streams_keep_that_many_range_requests_in_flight(served, streams):
    """A slow first byte on every response: with N streams the server answers N ranges at once, and the bytes
    come back whole and in order."""
    server, folder = served
    server.faults.first_byte_delay = 0.3
    data = (folder / "train-000000.tar").read_bytes()
    url = f"{server.url}/set/train-000000.tar"
    with open_shard(url, size=len(data), chunk_bytes=1000, streams=streams) as f:
        assert f.read() == data
    assert server.max_in_flight == streams
    ranges = [r for m, p, r in server.requests if m == "GET" and p == "/set/train-000000.tar"]
    assert sorted(ranges, key=lambda r: int(r[6:].split("-")[0])) == [
        f"bytes={a}-{min(a + 1000, len(data)) - 1}" for a in range(0, len(data), 1000)]


def test_streams_share_the_chunk_down_to_the_minimum(served):
    server, folder = served
    url = f"{server.url}/set/train-000000.tar"
    chunks = {}
    for n in (1, 4, 16):
        with source.RemoteStream(url, 100, streams=n) as stream:
            chunks[n] = stream.chunk
    assert chunks == {1: 8 << 20, 4: 2 << 20, 16: 1 << 20}


def test_reset_mid_stream_is_retried_from_the_byte_it_broke(served, fast_retry):
    server, folder = served
    data = (folder / "train-000000.tar").read_bytes()
    server.faults.reset["/set/train-000000.tar"] = (3000, 2)
    with open_shard(f"{server.url}/set/train-000000.tar", size=len(data)) as f:
        assert f.read() == data
    assert server.gets("/set/train-000000.tar") == 3


def test_reset_on_every_request_fails_after_the_bound(served, fast_retry):
    server, folder = served
    size = (folder / "train-000000.tar").stat().st_size
    server.faults.reset["/set/train-000000.tar"] = (3000, -1)
    url = f"{server.url}/set/train-000000.tar"
    with pytest.raises(SourceError) as err, open_shard(url, size=size) as f:
        f.read()
    assert str(err.value).startswith(f"{url}: stream ended at byte 0 of {size}")
    assert str(err.value).endswith("after 3 attempts") and "\n" not in str(err.value)
    assert server.gets("/set/train-000000.tar") == 3


def test_not_found_fails_at_once(served, fast_retry):
    server, _ = served
    url = f"{server.url}/set/nothing.tar"
    with pytest.raises(SourceError, match=r"^http://127\.0\.0\.1:\d+/set/nothing\.tar: not found \(HTTP 404\)$"):
        open_shard(url, size=100).read()
    assert server.gets("/set/nothing.tar") == 1
    with pytest.raises(DataError, match=r"/nope/manifest\.json: not found \(HTTP 404\)$"):
        open_set(f"{server.url}/nope")


def test_connection_refused_is_one_sentence_at_once(fast_retry):
    url = f"http://127.0.0.1:{closed_port()}/set"
    with pytest.raises(SourceError) as err:
        open_set(url)
    text = str(err.value)  # nothing ever answered there: unreachable, not retried (tests/test_interop.py)
    assert text.startswith(f"{url}/manifest.json: cannot connect (") and "attempts" not in text and "\n" not in text


def test_slow_first_byte_under_the_timeout_is_fine(served):
    server, folder = served
    server.faults.first_byte_delay = 0.3
    data = (folder / "train-000001.tar").read_bytes()
    with open_shard(f"{server.url}/set/train-000001.tar", size=len(data)) as f:
        assert f.read() == data


def test_reading_stops_at_the_manifest_size(served):
    server, folder = served
    data = (folder / "train-000000.tar").read_bytes()
    with open_shard(f"{server.url}/set/train-000000.tar", size=1024) as f:
        assert f.read() == data[:1024]
    assert all(r in ("bytes=0-1023",) for m, p, r in server.requests if m == "GET")


def _rewrite(folder: Path, **changes) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    m.update(changes)
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("root", ["../x", "/abs/x", "a/../../x"])
def test_remote_root_outside_the_base_is_refused(served, root):
    server, folder = served
    _rewrite(folder, root=root)
    with pytest.raises(DataError, match=r"root .* is refused"):
        open_set(f"{server.url}/set")


def test_remote_root_is_quoted_and_joined(served):
    server, folder = served
    (folder / "sub dir").mkdir()
    for p in folder.glob("*.tar"):
        shutil.move(p, folder / "sub dir" / p.name)
    _rewrite(folder, root="./sub dir")
    s = open_set(f"{server.url}/set")
    assert s.urls[0] == f"{server.url}/set/sub%20dir/train-000000.tar"
    with open_shard(s.urls[1], size=s.manifest.shards[1].bytes) as f:
        assert f.read() == (folder / "sub dir" / "train-000001.tar").read_bytes()


def test_pattern_with_manifest_and_name_mismatch(served, tmp_path):
    server, folder = served
    s = open_set(f"{server.url}/set/train-{{000000..000001}}.tar")  # the manifest next to the pattern
    assert s.urls == [f"{server.url}/set/train-000000.tar", f"{server.url}/set/train-000001.tar"]
    local = open_set(str(folder / "train-{000000..000001}.tar"), manifest=folder / "manifest.json")
    assert local.urls == [str(folder / "train-000000.tar"), str(folder / "train-000001.tar")]
    with pytest.raises(DataError, match=r"shard 1 of the pattern is 'train-000002\.tar' but .* lists "
                                        r"'train-000001\.tar'"):
        open_set(f"{server.url}/set/train-{{000000,000002}}.tar", manifest=folder / "manifest.json")
    with pytest.raises(DataError, match=r"the pattern names 1 shards but .* lists 2"):
        open_set(f"{server.url}/set/train-000000.tar", manifest=folder / "manifest.json")


def test_pipe_set_and_failing_command(served):
    _, folder = served
    s = open_set(f"pipe:cat {folder}/train-{{000000..000001}}.tar", manifest=folder / "manifest.json")
    assert s.remote and s.urls[1] == f"pipe:cat {folder}/train-000001.tar"
    with open_shard(s.urls[1]) as f:
        assert f.read() == (folder / "train-000001.tar").read_bytes()
    with pytest.raises(DataError, match="needs --manifest"):
        open_set(f"pipe:cat {folder}/train-{{000000..000001}}.tar")
    with pytest.raises(SourceError,
                       match=r"^pipe:cat /nonexistent/x\.tar 2>/dev/null: the command exited with status 1$"):
        with open_shard("pipe:cat /nonexistent/x.tar 2>/dev/null") as f:
            f.read()


def test_s3_set_reads_like_the_local_one(s3_server, tmp_path):
    client, _ = s3_server
    folder = write_tiny_shards(tmp_path / "set", [4, 2], image_px=16)
    client.create_bucket(Bucket="bkt")
    for p in folder.iterdir():
        client.upload_file(str(p), "bkt", f"sets/a/{p.name}")
    s = open_set("s3://bkt/sets/a/")
    assert s.urls == ["s3://bkt/sets/a/train-000000.tar", "s3://bkt/sets/a/train-000001.tar"]
    with open_shard(s.urls[0], size=s.manifest.shards[0].bytes, chunk_bytes=2048) as f:
        assert f.read() == (folder / "train-000000.tar").read_bytes()
    with pytest.raises(SourceError, match=r"^s3://bkt/sets/a/none\.tar: not found"):
        open_shard("s3://bkt/sets/a/none.tar", size=10).read()


def test_missing_driver_names_the_extra(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_gcsfs(name, *a, **kw):
        if name.startswith("gcsfs"):
            raise ImportError(name=name)
        return real(name, *a, **kw)

    monkeypatch.setattr(builtins, "__import__", no_gcsfs)
    monkeypatch.setattr(source, "_FS", {})
    with pytest.raises(SourceError, match=r"^gs://b/k: reading gs:// needs gcsfs; install gpufeed\[gs\] \(gcsfs\)$"):
        source.fs_for("gs://b/k")


def test_unknown_host_fails_at_once(fast_retry):
    t = source.Retry(attempts=3, first_wait_s=5.0, max_wait_s=10.0)  # a retry would show as a 5 s wait
    with pytest.raises(SourceError, match=r"^http://no-such-host\.invalid/set/manifest\.json: cannot resolve the "
                                          r"host"):
        open_set("http://no-such-host.invalid/set", retry=t)
