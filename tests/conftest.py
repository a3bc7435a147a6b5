"""Shared test helpers. Job-specific fixtures live in their own test modules."""

from __future__ import annotations

import gzip
import io
import json
import tarfile
from pathlib import Path
from typing import BinaryIO

import pytest
from click.testing import CliRunner, Result


WDS_SAMPLE = Path(__file__).resolve().parent / "fixtures" / "webdataset-sample.tgz"
"""90 samples written by the webdataset project's own tooling (see tests/fixtures/README.md)."""


def invoke(args: list[str], expect: int | None = 0) -> Result:
    """Run the gpufeed CLI in-process; on an unexpected exit code, fail showing stdout and stderr."""
    from gpufeed.cli import cli

    result = CliRunner().invoke(cli, [str(a) for a in args], catch_exceptions=False)
    if expect is not None and result.exit_code != expect:
        pytest.fail(
            f"gpufeed {' '.join(map(str, args))} exited {result.exit_code}, expected {expect}\n"
            f"--- stdout ---\n{result.stdout}\n--- stderr ---\n{result.stderr}"
        )
    return result


def invoke_json(args: list[str], expect: int | None = 0) -> dict:
    """Run with --json and parse stdout, which must be exactly one JSON object."""
    result = invoke([*args, "--json"], expect=expect)
    out = result.stdout.strip()
    try:
        obj = json.loads(out)
    except json.JSONDecodeError:
        pytest.fail(f"stdout is not one JSON object:\n{out}\n--- stderr ---\n{result.stderr}")
    assert isinstance(obj, dict)
    return obj


def write_tar(dest: Path | BinaryIO, members: list[tuple[str, bytes]], *, gz: bool = False,
              format: int = tarfile.USTAR_FORMAT, mode: str = "w") -> Path | BinaryIO:
    """Write a well-formed tar of ``members`` ((name, data), in this order, duplicates kept) to ``dest``.

    Every member is a regular file with tarfile's defaults (mode 0644, mtime 0, no owner). ``dest`` is a path or a
    binary file object. ``format`` is a tarfile format (USTAR, GNU or PAX). ``gz`` gzips the whole tar (gzip
    header mtime 0, no file name). ``mode="a"`` appends the members to an existing plain tar. Returns ``dest``.
    """
    if mode not in ("w", "a") or (gz and mode == "a"):
        raise ValueError(f"write_tar: mode {mode!r} with gz={gz} (use 'w', or 'a' on a plain tar)")
    out = io.BytesIO() if gz else dest
    where = {"name": out} if isinstance(out, (str, Path)) else {"fileobj": out}
    with tarfile.open(mode=mode, format=format, **where) as tf:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    if gz:
        data = gzip.compress(out.getvalue(), mtime=0)
        if isinstance(dest, (str, Path)):
            Path(dest).write_bytes(data)
        else:
            dest.write(data)
    return dest


def write_image(path: Path, size: tuple[int, int] = (8, 8), color: tuple[int, int, int] = (200, 30, 30),
                fmt: str = "JPEG", mode: str = "RGB", **save: object) -> Path:
    """Write a small image with a gradient (so decoders have real content to agree on)."""
    import numpy as np
    from PIL import Image

    w, h = size
    yy, xx = np.mgrid[0:h, 0:w]
    arr = np.zeros((h, w, 3), dtype=np.uint8)
    arr[..., 0] = (color[0] + 3 * xx) % 256
    arr[..., 1] = (color[1] + 5 * yy) % 256
    arr[..., 2] = (color[2] + xx + yy) % 256
    img = Image.fromarray(arr, "RGB")
    if mode != "RGB":
        img = img.convert(mode)
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt, **save)
    return path


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
    """A loopback HTTP server (tests/netserver.py) serving ``tmp_path / "www"`` (made empty); set faults through
    ``server.faults``; shut down after the test."""
    from tests.netserver import LoopbackServer

    root = tmp_path / "www"
    root.mkdir(exist_ok=True)
    server = LoopbackServer(root).start()
    try:
        yield server
    finally:
        server.stop()


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
    from tests.netserver import closed_port

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
