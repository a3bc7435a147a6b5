"""The threat model, as tests: what a downloaded shard set, checkpoint or config must never be able to do.

gpufeed trusts the command line and the user's own config file. It never trusts file names, manifests,
tar headers, image headers or checkpoints (see docs/threat-model.md). Each section below is one attack
that used to work; each test fails without its fix.
"""

from __future__ import annotations

import io

import pytest

# --------------------------------------------------------------------------- 1. a shard file name runs a shell command


PIPE_NAME = "pipe:touch PWNED;cat data.tgz"
"""A file name webdataset's gopen would run as a shell command (it creates ./PWNED)."""


def test_index_refuses_a_shard_file_named_like_a_pipe_command(tmp_path, monkeypatch):
    import shutil

    from tests.conftest import WDS_SAMPLE, invoke

    folder = tmp_path / "foreign"
    folder.mkdir()
    shutil.copy(WDS_SAMPLE, folder / "data.tgz")
    shutil.copy(WDS_SAMPLE, folder / PIPE_NAME)  # a real shard under the hostile name
    monkeypatch.chdir(folder)
    res = invoke(["index", "."], expect=2)
    (line,) = res.stderr.strip().splitlines()
    assert PIPE_NAME in line and "rename it" in line and "':'" in line
    assert not (folder / "manifest.json").exists()
    assert not (folder / "PWNED").exists()


def _manifest(folder, **changes):
    """A valid hand-written manifest for one .tgz shard of 90 samples, with ``changes`` applied."""
    import json

    d = {"format": "gpufeed-shards", "format_version": 1, "prefix": "data", "classes": [str(i) for i in range(10)],
         "shards": [{"name": "data.tgz", "num_samples": 90, "bytes": 1, "sha256": None}], "num_samples": 90,
         "created_by": "gpufeed index", "compression": "gzip"}
    d.update(changes)
    (folder / "manifest.json").write_text(json.dumps(d))
    return folder


@pytest.mark.parametrize("name", [PIPE_NAME + ".tgz", "s3://bucket/data.tgz", "http:data.tgz", "data-{0..9}.tgz",
                                  "../data.tgz", "-data.tgz", "data\x00.tgz", "|data.tgz", "data.zip",
                                  "a" * 300 + ".tgz"])
def test_manifest_refuses_shard_names_that_are_not_plain_file_names(tmp_path, monkeypatch, name):
    from gpufeed.errors import DataError
    from gpufeed.manifest import read_manifest

    monkeypatch.chdir(tmp_path)
    _manifest(tmp_path, shards=[{"name": name, "num_samples": 90, "bytes": 1, "sha256": None}])
    with pytest.raises(DataError) as exc:
        read_manifest(tmp_path)
    assert "shard name" in str(exc.value) and "refused" in str(exc.value) and "\n" not in str(exc.value)
    assert not (tmp_path / "PWNED").exists()


@pytest.mark.parametrize("root", ["pipe:touch PWNED;cat", "s3://bucket/set", "file://x", "/data/{a,b}", 7])
def test_manifest_refuses_a_root_that_is_not_a_local_folder(tmp_path, root):
    from gpufeed.errors import DataError
    from gpufeed.manifest import read_manifest

    _manifest(tmp_path, root=root)
    with pytest.raises(DataError, match="root .* is refused"):
        read_manifest(tmp_path)


def test_manifest_naming_a_pipe_shard_never_reaches_the_loader(tmp_path, monkeypatch):
    import shutil

    from gpufeed.config import LoaderConfig
    from gpufeed.errors import DataError
    from gpufeed.loader import build_loader
    from gpufeed.world import World
    from tests.conftest import WDS_SAMPLE, invoke

    shutil.copy(WDS_SAMPLE, tmp_path / PIPE_NAME)
    _manifest(tmp_path, shards=[{"name": PIPE_NAME, "num_samples": 90, "bytes": 1, "sha256": None}])
    monkeypatch.chdir(tmp_path)
    with pytest.raises(DataError, match="shard name"):
        build_loader(".", LoaderConfig(batch_size=8, num_workers=0, image_size=16), World.single())
    res = invoke(["verify", "."], expect=2)
    assert len(res.stderr.strip().splitlines()) == 1 and "shard name" in res.stderr
    assert not (tmp_path / "PWNED").exists()


# --------------------------------------------------------------------------- 2. a checkpoint runs code on --resume


# --------------------------------------------------------------------------- 3. a tar header hangs the reader


# --------------------------------------------------------------------------- 9. a tiny image asks for gigabytes


def _png_bomb(side: int = 13_000) -> bytes:
    """A real, valid 1-bit grey PNG of side x side pixels (all black) that compresses to ~20 KB."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    row = b"\0" * (1 + (side + 7) // 8)  # filter byte + packed bits
    ihdr = struct.pack(">IIBBBBB", side, side, 1, 0, 0, 0, 0)
    idat = zlib.compress(row * side, 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def test_verify_refuses_a_png_decompression_bomb_before_decoding_it(tmp_path):
    from PIL import Image

    from gpufeed.verify import render_verify, verify_shards
    from tests.test_verify import foreign_set, jpeg_bytes

    bomb = _png_bomb()
    with pytest.warns(Image.DecompressionBombWarning):  # Pillow itself calls it a bomb (and would decode it)
        assert len(bomb) < 40_000 and Image.open(io.BytesIO(bomb)).size == (13_000, 13_000)
    root = foreign_set(tmp_path, [[("ok.jpg", jpeg_bytes(tmp_path)), ("ok.cls", b"0"), ("big.png", bomb),
                                   ("big.cls", b"1")]], gzip=False)
    rep = verify_shards(root, workers=1)
    assert not rep.ok and rep.num_decoded == 1
    (problem,) = rep.problems
    assert problem.member == "big.png"
    assert problem.reason == "decompression bomb: 13000x13000 = 169000000 pixels > max_pixels 89478485"
    assert "part-0000.tar member big.png: decompression bomb" in render_verify(rep)


def test_verify_max_pixels_option_applies_to_small_images_too(tmp_path):
    from tests.conftest import invoke_json
    from tests.test_verify import foreign_set, jpeg_bytes

    root = foreign_set(tmp_path, [[("a.jpg", jpeg_bytes(tmp_path)), ("a.cls", b"0")]], gzip=False)
    assert invoke_json(["verify", root, "--workers", "1", "--no-decode"])["ok"] is True
    res = invoke_json(["verify", root, "--workers", "1", "--no-decode", "--max-pixels", "63"], expect=1)
    assert [p["reason"] for p in res["problems"]] == ["decompression bomb: 8x8 = 64 pixels > max_pixels 63"]
