"""Attacks on remote shard sets (issue 10): hostile HTTP servers on 127.0.0.1 and hostile user input. Each test
asserts the safe behaviour and names the finding it guards."""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import textwrap
import time
import tracemalloc

import pytest

from gpufeed.core.errors import DataError
from gpufeed.shardset import source
from tests.common.netserver import HandlerServer


@pytest.fixture
def hostile(monkeypatch):
    monkeypatch.setattr(source, "_FS", {})
    server = HandlerServer()
    try:
        yield server
    finally:
        server.stop()


def _headers(req, status: int, length: int | None, **extra) -> None:
    req.send_response(status)
    if length is not None:
        req.send_header("Content-Length", str(length))
    for k, v in extra.items():
        req.send_header(k.replace("_", "-"), v)
    req.end_headers()


def read_all(url: str, size: int, retry=None, chunk_bytes: int = 64 << 10) -> bytes:
    with source.open_shard(url, size=size, retry=retry, chunk_bytes=chunk_bytes) as f:
        return f.read()


# Finding A: a server answering a range request with a 200 and the whole (huge or endless) object made
# cat_file read all of it into memory before the size check ("does not honour range requests").
def test_a_server_ignoring_range_is_refused_before_its_body_is_read(hostile):
    body = 96 << 20

    def handler(req):
        if req.command == "HEAD":
            return _headers(req, 200, 1 << 20)
        _headers(req, 200, body)
        piece = b"\0" * (1 << 20)
        for _ in range(body >> 20):
            req.write(piece)

    hostile.handler = handler
    with pytest.raises(source.SourceError, match=r"range"):
        read_all(f"{hostile.url}/a.tar", 1 << 20, retry=source.Retry(attempts=1))
    time.sleep(0.3)
    assert hostile.sent < 32 << 20  # the client stopped reading; main read all 96 MiB


# Finding B: aiohttp asks for gzip and inflates the response; a 206 with Content-Encoding: gzip inflating to
# 64 MiB was held in memory whole before the length check. A range of a remote shard must be the raw bytes.
def test_a_gzip_encoded_range_is_refused_without_inflating_it(hostile):
    bomb = gzip.compress(b"\0" * (64 << 20), 9)

    def handler(req):
        if req.command == "HEAD":
            return _headers(req, 200, 1 << 20)
        _headers(req, 206, len(bomb), Content_Encoding="gzip", Content_Range=f"bytes 0-{(1 << 20) - 1}/{1 << 20}")
        req.write(bomb)

    hostile.handler = handler
    tracemalloc.start()
    try:
        with pytest.raises(source.SourceError):
            read_all(f"{hostile.url}/a.tar", 1 << 20, retry=source.Retry(attempts=1))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20


# Finding C: every try brought one byte of "progress", which reset the retry count: a shard of N bytes took N
# requests (unbounded in practice). Progress must be real for the count to start over.
def test_one_byte_of_progress_per_try_does_not_reset_the_retry_bound(hostile):
    size = 4096

    def handler(req):
        if hostile.gets > 200:  # main: ends here instead of after 4096 requests
            return _headers(req, 404, 0)
        start = int(req.headers["Range"].split("=")[1].split("-")[0])
        _headers(req, 206, 1, Content_Range=f"bytes {start}-{start}/{size}")  # one byte of each range asked
        req.write(b"x")

    hostile.handler = handler
    with pytest.raises(source.SourceError):
        read_all(f"{hostile.url}/a.tar", size, retry=source.Retry(attempts=3, first_wait_s=0.001, max_wait_s=0.01))
    assert hostile.gets <= 10


# Finding D: the read timeout is per socket read and there was no bound on one request: a server trickling a
# byte every 0.2 s held a read for as long as it liked. A range request must end within READ_TIMEOUT_S plus its
# size at MIN_BYTES_PER_S.
def test_a_trickling_server_times_out(hostile, monkeypatch):
    monkeypatch.setattr(source, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(source, "MIN_BYTES_PER_S", 1000, raising=False)
    size = 30

    def handler(req):
        _headers(req, 206, size, Content_Range=f"bytes 0-{size - 1}/{size}")
        for _ in range(size):
            req.write(b"x")
            req.wfile.flush()
            time.sleep(0.2)

    hostile.handler = handler
    with pytest.raises(source.SourceError, match="timed out"):
        read_all(f"{hostile.url}/a.tar", size, retry=source.Retry(attempts=1))


# Finding E: braceexpand materializes a numeric range before islice sees it: 'a{0..999999999}.tar' took all
# memory (the process was OOM-killed). The pattern's size must be checked before it is expanded. Run in a child
# whose address space is capped at 1 GiB, so the unsafe behaviour fails there instead of eating the machine.
def test_a_brace_pattern_of_a_billion_shards_is_refused_before_expanding():
    code = textwrap.dedent("""
        import resource, sys
        resource.setrlimit(resource.RLIMIT_AS, (1 << 30, 1 << 30))
        from gpufeed.core.errors import DataError
        from gpufeed.shardset.source import expand_pattern
        for p in ("http://h/a-{0..999999999}.tar", "http://h/a-{0..9999}-{0..9999}.tar"):
            try:
                expand_pattern(p)
            except DataError as exc:
                print(exc)
        print(expand_pattern("h/a-{0..2..2}-{x,y}.tar"))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-300:]
    assert run.stdout.splitlines() == [
        "http://h/a-{0..999999999}.tar: the pattern names more than 10000000 shards",
        "http://h/a-{0..9999}-{0..9999}.tar: the pattern names more than 10000000 shards",
        "['h/a-0-x.tar', 'h/a-0-y.tar', 'h/a-2-x.tar', 'h/a-2-y.tar']"]


# Finding F: a password in a user-typed URL (http://user:pass@host/) was printed in one-sentence errors.
def test_a_password_in_the_url_is_not_printed(http_server, fast_retry):
    with pytest.raises(DataError) as err:
        source.open_set(f"http://alice:s3cr3t@127.0.0.1:{http_server.port}/nothing/")
    text = str(err.value)
    assert "s3cr3t" not in text and "127.0.0.1" in text and "not found" in text


# Finding F (records): index wrote the user-typed URL, password included, into manifest.json (options.source)
# and its report; verify's report named the set by it.
def test_a_password_in_the_url_is_not_written_to_records(http_server, tmp_path):
    from gpufeed.index import index_shards
    from gpufeed.verify import verify_shards
    from tests.common.shards import write_set

    write_set(http_server.root / "set", [3, 2], num_classes=5)
    url = f"http://alice:s3cr3t@127.0.0.1:{http_server.port}/set/train-{{000000..000001}}.tar"
    report = index_shards(url, out=tmp_path / "m")
    text = (tmp_path / "m" / "manifest.json").read_text()
    assert "s3cr3t" not in text and "s3cr3t" not in json.dumps(report.__dict__, default=str)
    assert "alice:***@127.0.0.1" in json.loads(text)["options"]["source"]
    vr = verify_shards(url, manifest=str(tmp_path / "m" / "manifest.json"))
    assert "s3cr3t" not in json.dumps(vr.__dict__, default=str)


# Finding G: a redirect loop was reported as "HTTP 0".
def test_a_redirect_loop_is_named(hostile):
    hostile.handler = lambda req: _headers(req, 302, 0, Location=f"{hostile.url}/a.tar")
    with pytest.raises(source.SourceError, match=r"a\.tar: too many redirects$"):
        read_all(f"{hostile.url}/a.tar", 100, retry=source.Retry(attempts=1))


# Finding H: shard names (and root parts) were URL-quoted for s3:// too, where s3fs takes the key literally: a
# shard named 'train é 0.tar' (a valid name) was looked up as 'train%20%C3%A9%200.tar' and not found.
def test_an_s3_shard_name_with_a_space_and_unicode_is_read(s3_server, tmp_path):
    from tests.common.shards import write_set
    from tests.test_remote import batches

    client, _ = s3_server
    folder = write_set(tmp_path / "set", [3, 2], num_classes=5)
    m = json.loads((folder / "manifest.json").read_text())
    m["shards"][1]["name"] = "train é 1.tar"
    m.pop("url_pattern", None)
    (folder / "train-000001.tar").rename(folder / "train é 1.tar")
    (folder / "manifest.json").write_text(json.dumps(m))
    client.create_bucket(Bucket="data")
    for p in folder.iterdir():
        client.upload_file(str(p), "data", f"sub dir/{p.name}")
    m["root"] = "sub dir"
    client.put_object(Bucket="data", Key="manifest.json", Body=json.dumps(m).encode())
    _, local = batches(folder, 0, batch_size=1)
    for spec in ("s3://data/sub dir", "s3://data"):
        loader, remote = batches(spec, 0, batch_size=1)
        assert len(remote) == len(local) == 5 and loader.num_skipped == 0


# Finding F (run records): train's summary.json records the user-typed shards location; JSON records (and
# --json output) go through records.dumps, which must not write a URL's password.
def test_json_records_do_not_hold_a_password(tmp_path):
    from gpufeed.core.records import write_json

    record = {"shards": "https://alice:s3cr3t@h/set/", "other": "x://y", "at": "c@d"}
    out = write_json(tmp_path / "summary.json", record)
    assert json.loads(out.read_text()) == {"shards": "https://alice:***@h/set/", "other": "x://y", "at": "c@d"}


# Finding I: closing a pipe: stream early killed only the shell; a process the command started (here the sleep
# of a command list) lived on, one per abandoned shard.
def test_closing_a_pipe_stream_early_ends_every_process_of_the_command(tmp_path):
    import os

    (tmp_path / "a.tar").write_bytes(b"\0" * 4096)
    marker = "7.123457"  # a sleep no other process runs

    def sleeping() -> list[str]:
        out = []
        for pid in os.listdir("/proc"):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as c:
                    if c.read() == b"sleep\0" + marker.encode() + b"\0":
                        out.append(pid)
            except OSError:
                pass
        return out

    f = source.open_shard(f"pipe:cat {tmp_path / 'a.tar'}; sleep {marker}; true")
    assert f.raw.readinto(bytearray(10)) == 10
    for _ in range(100):  # until the command has started its sleep
        if sleeping():
            break
        time.sleep(0.02)
    f.close()
    for _ in range(50):  # SIGKILL is delivered at once; the loop only waits for the kernel to reap
        if not sleeping():
            break
        time.sleep(0.05)
    assert sleeping() == []


# Finding J: a pipe: command's output was read through a second 1 MiB buffer that waits to be full: a read of
# the first bytes waited for 1 MiB or the command's end (a slow producer stalled the loader that long).
def test_a_pipe_read_returns_what_the_command_has_written(tmp_path):
    (tmp_path / "a.tar").write_bytes(b"\1" * 4096)
    with source.open_shard(f"pipe:cat {tmp_path / 'a.tar'}; sleep 30; true") as f:
        assert f.read(10) == b"\1" * 10
        assert f.raw._proc.poll() is None  # the command still runs: the read did not wait for its end


# Finding D (size queries): the HEAD that asks a shard's or manifest's size had no total bound either: a server
# trickling its headers held it as long as it liked.
def test_a_size_query_answered_by_trickled_headers_times_out(hostile, monkeypatch):
    monkeypatch.setattr(source, "READ_TIMEOUT_S", 1.0)
    monkeypatch.setattr(source, "CONNECT_TIMEOUT_S", 1.0)

    def handler(req):
        req.wfile.write(b"HTTP/1.1 200 OK\r\nContent-Length: 30\r\n")
        for _ in range(30):
            req.wfile.write(b"X: y\r\n")
            req.wfile.flush()
            time.sleep(0.2)
        req.wfile.write(b"\r\n")

    hostile.handler = handler
    with pytest.raises(source.SourceError, match="timed out"):
        source.remote_size(f"{hostile.url}/a.tar", source.Retry(attempts=1))
