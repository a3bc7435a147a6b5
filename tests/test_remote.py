"""Shard sets read from anywhere: the loader, verify and index over a loopback HTTP server, moto's S3 server and
pipe: commands, with real sockets and injected faults (tests/netserver.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from gpufeed.core.errors import DataError
from gpufeed.core.world import World
from tests.common.cli import invoke, invoke_json
from tests.common.netserver import closed_port
from tests.common.shards import cfg, write_set, write_tiny_shards

SIZES = [7, 5, 6, 4]  # 22 samples, labels = sample ids (write_set)


@pytest.fixture
def served(http_server):
    """A four-shard set under the server's ``set/``: (server, local folder, URL of the folder)."""
    folder = write_set(http_server.root / "set", SIZES, num_classes=22)
    return http_server, folder, f"{http_server.url}/set"


def batches(spec, workers, world=None, manifest_file=None, **kw):
    from gpufeed.loader import build_loader

    loader = build_loader(spec, cfg(num_workers=workers, **kw), world or World.single(), manifest_file=manifest_file)
    out = [(images.clone(), labels.clone()) for images, labels in loader]
    return loader, out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x[0], y[0]) and torch.equal(x[1], y[1]) for x, y in zip(a, b))


@pytest.mark.parametrize("workers", [0, 2])
def test_loader_over_http_yields_what_the_local_folder_yields(served, workers):
    server, folder, url = served
    _, local = batches(folder, workers)
    loader, remote = batches(url, workers)
    assert len(remote) == len(loader) == 22 // 4
    assert same(local, remote)
    assert server.gets("/set/train-000003.tar") >= 1  # the shards came over the socket


def test_remote_streams_overlap_requests_and_keep_samples_and_order(served, monkeypatch):
    """[loader] remote_streams = 4 keeps four range requests in flight on a slow-first-byte server (the server sees
    them at once) and yields exactly the samples, in the same order, of one stream and of the local folder."""
    from gpufeed.shardset import source

    server, folder, url = served
    monkeypatch.setattr(source, "CHUNK_BYTES", 2048)  # tiny shards: several ranges per shard
    server.faults.first_byte_delay = 0.1
    _, local = batches(folder, 0)
    seen = {}
    for streams in (1, 4):
        server.max_in_flight = 0
        _, seen[streams] = batches(url, 0, remote_streams=streams)
        assert server.max_in_flight == streams
    assert same(seen[1], seen[4]) and same(local, seen[4]) and len(local) == 22 // 4


def test_tune_on_a_slow_first_byte_pattern_with_its_own_manifest_climbs_remote_streams(served, monkeypatch,
                                                                                       tmp_path):
    """`tune PATTERN --manifest FILE` on a server whose every response waits 50 ms: the trials read the pattern with
    that manifest (none is served next to it), the loader waits on reads, and more streams win clearly."""
    from gpufeed.config import load_config
    from gpufeed.shardset import source

    server, folder, url = served
    monkeypatch.setattr(source, "CHUNK_BYTES", 4096)  # ~25 KB shards: several ranges per shard
    manifest = tmp_path / "m" / "manifest.json"
    manifest.parent.mkdir()
    (folder / "manifest.json").rename(manifest)
    server.faults.first_byte_delay = 0.05
    config = tmp_path / "cfg.toml"
    config.write_text('[loader]\ndecode = "pil"\nremote_streams = 1\nshuffle_buffer = 0\n')
    out = tmp_path / "tuned.toml"
    obj = invoke_json(["tune", f"{url}/train-{{000000..000003}}.tar", "--manifest", manifest, "--config", config,
                       "--max-workers", "0", "--batch-size", "4", "--image-size", "16", "--repeats", "1",
                       "--window", "0.5", "--budget", "90", "--storage-probe-s", "0", "--device", "cpu",
                       "--run-dir", tmp_path / "run", "--out", out])
    assert not [t["error"] for t in obj["trials"] if t["error"]]
    reasons = [d["reason"] for d in obj["decisions"] if d["knob"] == "remote_streams"]
    assert reasons[0] == "streams-io-bound" and reasons[-1] == "streams-chosen"
    chosen = obj["decisions"][[d["reason"] for d in obj["decisions"]].index("streams-chosen")]["chosen"]
    assert chosen >= 4 and obj["best"]["remote_streams"] == chosen == load_config(out).loader.remote_streams
    assert server.max_in_flight >= 4 and server.gets("/set/manifest.json") == 0
    # socket reads are not in the I/O counters: a remote trial reads its samples/s x the manifest's mean bytes
    mean = json.loads(manifest.read_text())["mean_sample_bytes"]
    assert all(t["read_bytes_per_s"] == pytest.approx(t["samples_per_s"] * mean) for t in obj["trials"])


def test_loader_over_s3_yields_what_the_local_folder_yields(s3_server, tmp_path):
    client, _ = s3_server
    folder = write_set(tmp_path / "set", SIZES, num_classes=22)
    client.create_bucket(Bucket="data")
    for p in folder.iterdir():
        client.upload_file(str(p), "data", f"set/{p.name}")
    _, local = batches(folder, 2)
    _, remote = batches("s3://data/set", 2)
    assert same(local, remote) and len(remote) == 5


def test_reset_mid_stream_is_retried_and_yields_the_same_samples(served, fast_retry):
    server, folder, url = served
    server.faults.reset["/set/train-000001.tar"] = (1500, 2)
    _, local = batches(folder, 0)
    loader, remote = batches(url, 0)
    assert same(local, remote) and loader.num_skipped == 0
    assert server.gets("/set/train-000001.tar") == 3


@pytest.mark.parametrize("workers", [0, 2])
def test_reset_on_every_request_is_one_sentence_after_the_bound(served, fast_retry, workers):
    server, folder, url = served
    server.faults.reset["/set/train-000001.tar"] = (1500, -1)
    with pytest.raises(DataError) as err:
        batches(url, workers)
    text = str(err.value).splitlines()[0]
    assert text.startswith(f"{url}/train-000001.tar: stream ended at byte 0 of ")
    assert "after 3 attempts; 5 of its samples 0..4 cannot be read" in text


def test_unreadable_remote_shard_is_counted_as_skipped_and_batches_stay(served, fast_retry):
    server, folder, url = served
    server.faults.reset["/set/train-000001.tar"] = (1500, -1)
    # one slot per rank (with more workers, a worker whose whole plan is the unreadable shard has no sample to
    # repeat and fails, as for a local shard)
    loaders = [batches(url, 0, World(rank=r, world_size=2), on_error="skip") for r in range(2)]
    assert [len(b) for _, b in loaders] == [len(loader) for loader, _ in loaders] == [2, 2]  # 22 // (2 * 4)
    assert sum(loader.num_skipped for loader, _ in loaders) == 5  # the unreadable shard's samples, one by one
    ids = {int(x) for _, b in loaders for _, labels in b for x in labels}
    assert not ids & set(range(7, 12))  # shard 1 holds samples 7..11: none of them came out


def test_slow_first_byte_under_the_timeout_is_fine(served):
    server, folder, url = served
    server.faults.first_byte_delay = 0.2
    _, local = batches(folder, 0)
    _, remote = batches(url, 0)
    assert same(local, remote)


def test_missing_set_is_one_sentence_and_exit_2(served):
    server, _, url = served
    r = invoke(["verify", f"{server.url}/nothing"], expect=2)
    assert r.stderr.strip() == f"error: {server.url}/nothing/manifest.json: not found (HTTP 404)"


def test_missing_shard_is_a_verify_problem(served):
    server, _, url = served
    server.faults.missing.add("/set/train-000002.tar")
    report = invoke_json(["verify", url, "--workers", "1"], expect=1)
    reasons = [p["reason"] for p in report["problems"]]
    assert f"{url}/train-000002.tar: not found (HTTP 404)" in reasons


def test_connection_refused_is_one_sentence_in_bounded_time(fast_retry):
    url = f"http://127.0.0.1:{closed_port()}/set"
    with pytest.raises(DataError) as err:
        batches(url, 0)
    text = str(err.value)  # nothing ever answered there: unreachable, failed at once (tests/test_interop.py)
    assert text.startswith(f"{url}/manifest.json: cannot connect (") and "attempts" not in text and "\n" not in text


def test_index_a_url_pattern_then_verify_and_load_with_the_manifest(http_server, tmp_path):
    folder = write_tiny_shards(http_server.root / "foreign", [3, 2], image_px=16)
    (folder / "manifest.json").unlink()  # foreign shards: no manifest next to them
    pattern = f"{http_server.url}/foreign/train-{{000000..000001}}.tar"
    r = invoke(["index", pattern], expect=2)
    assert "add --out DIR" in r.stderr
    out = tmp_path / "meta"
    report = invoke_json(["index", pattern, "--out", out])
    assert report["num_shards"] == 2 and report["num_samples"] == 5 and report["shard_folder"] == pattern
    m = json.loads((out / "manifest.json").read_text())
    assert "root" not in m or m["root"] is None
    assert [s["bytes"] for s in m["shards"]] == [(folder / f"train-00000{i}.tar").stat().st_size for i in (0, 1)]
    v = invoke_json(["verify", pattern, "--manifest", out / "manifest.json", "--workers", "1"])
    assert v["num_samples"] == 5 and v["num_problems"] == 0
    _, remote = batches(pattern, 0, manifest_file=out / "manifest.json", batch_size=1, shuffle_buffer=0)
    assert len(remote) == 5


def _serve_manifest(folder: Path, **changes) -> None:
    m = json.loads((folder / "manifest.json").read_text())
    m.update(changes)
    (folder / "manifest.json").write_text(json.dumps(m))


@pytest.mark.parametrize("root", ["../x", "/srv/x"])
def test_remote_manifest_root_outside_its_folder_is_refused(served, root):
    server, folder, url = served
    _serve_manifest(folder, root=root)
    r = invoke(["verify", url], expect=2)
    assert r.stderr.strip().startswith(f"error: {url}/manifest.json: root {root!r} is refused")
    assert server.gets("/set/train-000000.tar") == 0


def test_pattern_and_manifest_naming_other_shards_is_refused(served):
    server, folder, url = served
    r = invoke(["verify", f"{url}/train-{{000000,000001,000003,000002}}.tar"], expect=2)
    assert "shard 2 of the pattern is 'train-000003.tar'" in r.stderr and "lists 'train-000002.tar'" in r.stderr
    assert server.gets("/set/train-000003.tar") == 0


def test_pipe_pattern_with_manifest_and_failing_command(served):
    _, folder, _ = served
    pattern = f"pipe:cat {folder}/train-{{000000..000003}}.tar"
    _, local = batches(folder, 0)
    _, piped = batches(pattern, 0, manifest_file=folder / "manifest.json")
    assert same(local, piped)
    tiny = write_tiny_shards(folder.parent / "tiny", [3, 2], image_px=16)
    v = invoke_json(["verify", f"pipe:cat {tiny}/train-{{000000..000001}}.tar", "--manifest", tiny / "manifest.json",
                     "--workers", "1"])
    assert v["num_problems"] == 0 and v["num_samples"] == 5
    (folder / "train-000002.tar").rename(folder / "gone.tar")
    with pytest.raises(DataError, match=r"pipe:cat \S+/train-000002\.tar: the command exited with status 1"):
        batches(pattern, 0, manifest_file=folder / "manifest.json")
