"""Fixtures shared by the test modules (the helpers they use are in tests/common/). Job-specific fixtures live in
their own test modules."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.common.shards import write_image


@pytest.fixture
def image_folder(tmp_path: Path):
    """Factory: ``image_folder(classes=3, per_class=4, size=(16, 12))`` -> an ImageFolder of small JPEGs."""

    def make(classes: int = 3, per_class: int = 4, size: tuple[int, int] = (16, 12), name: str = "src") -> Path:
        root = tmp_path / name
        for c in range(classes):
            for i in range(per_class):
                write_image(root / f"class_{c}" / f"img_{i:03d}.jpg", size=size,
                            color=(40 * c % 256, 17 * i % 256, 90), quality=95)
        return root

    return make


@pytest.fixture
def http_server(tmp_path: Path):
    """A loopback HTTP server (tests/common/netserver.py) serving ``tmp_path / "www"`` (made empty); set faults through
    ``server.faults``; shut down after the test."""
    from tests.common.netserver import LoopbackServer

    root = tmp_path / "www"
    root.mkdir(exist_ok=True)
    server = LoopbackServer(root).start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def raw_server():
    """Factory: ``raw_server(respond)`` -> a loopback :class:`~tests.common.netserver.RawServer` answering with
    ``respond``; every one made is closed after the test."""
    from tests.common.netserver import RawServer

    made = []

    def make(respond):
        made.append(RawServer(respond))
        return made[-1]

    yield make
    for s in made:
        s.close()


@pytest.fixture
def fast_retry(monkeypatch):
    """Small retry bounds for remote reads (3 tries, waits of 0.05 s then 0.1 s), so failure tests take no time."""
    from gpufeed.shardset import source

    retry = source.Retry(attempts=3, first_wait_s=0.05, max_wait_s=0.5)
    monkeypatch.setattr(source, "RETRY", retry)
    return retry


@pytest.fixture
def s3_server(monkeypatch):
    """moto's S3 server on 127.0.0.1 with dummy credentials in the environment (AWS_ENDPOINT_URL points at it);
    yields ``(boto3 client, endpoint)``. Skipped when moto or boto3 is missing."""
    pytest.importorskip("s3fs")
    moto_server = pytest.importorskip("moto.server")
    boto3 = pytest.importorskip("boto3")
    from tests.common.netserver import closed_port

    port = closed_port()
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    for k, v in {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                 "AWS_DEFAULT_REGION": "us-east-1", "AWS_SESSION_TOKEN": "testing"}.items():
        monkeypatch.setenv(k, v)
    from gpufeed.shardset import source

    monkeypatch.setattr(source, "_FS", {})  # a filesystem made before the endpoint was set must not be reused
    try:
        yield boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1"), endpoint
    finally:
        server.stop()
