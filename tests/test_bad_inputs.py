"""Real-world, messy input: every case is handled without crash, hang or silent mislabel, with a reason."""

from __future__ import annotations

import hashlib
import io
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError
from gpufeed.shard import write_shards
from tests.common.cli import invoke
from tests.common.shards import write_image

LONG = "l" + "o" * 120 + "ng.name.jpg"  # > 100 bytes: does not fit a plain USTAR name
MAX_PIXELS = 20_000  # the real-pixel bomb below is 200 x 200


def noisy_jpeg(path: Path, size: tuple[int, int] = (64, 48), **save: object) -> Path:
    rng = np.random.default_rng(0)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)).save(path, "JPEG", **save)
    return path


def png_header_bomb(path: Path, width: int = 100_000, height: int = 100_000) -> Path:
    """A 60-byte PNG that declares 10 gigapixels (never decoded: refused from its header)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    ihdr = struct.pack(">IIBBBBB", width, height, 1, 0, 0, 0, 0)
    path.write_bytes(b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(b"\0" * 64))
                     + chunk(b"IEND", b""))
    return path


@pytest.fixture
def messy(tmp_path: Path) -> Path:
    src = tmp_path / "src"
    cats, dogs = src / "cats", src / "dogs"
    write_image(cats / "ok.jpg")
    write_image(dogs / "ok.jpg", color=(10, 200, 10))  # same file name in two classes
    write_image(cats / "UPPER.JPG")
    write_image(cats / "upper2.JPEG")
    write_image(cats / "up.PNG", fmt="PNG")
    data = noisy_jpeg(tmp_path / "full.jpg").read_bytes()
    (cats / "truncated.jpg").write_bytes(data[: len(data) * 6 // 10])
    (cats / "zero.jpg").write_bytes(b"")
    (cats / "notimage.jpg").write_text("<html>this is not a JPEG</html>\n")
    png_header_bomb(cats / "bomb.png")
    Image.new("1", (200, 200)).save(cats / "pixelbomb.png")
    write_image(cats / "cmyk.jpg", mode="CMYK")
    write_image(cats / "gray.jpg", mode="L")
    write_image(cats / "palette.png", fmt="PNG", mode="P")
    write_image(cats / "onebit.png", fmt="PNG", mode="1")
    write_image(cats / "rgba.png", fmt="PNG", mode="RGBA")
    write_image(cats / "la.png", fmt="PNG", mode="LA")
    Image.fromarray((np.arange(96, dtype=np.uint16).reshape(8, 12) * 600)).save(cats / "gray16.png")
    exif = Image.Exif()
    exif[0x0112] = 6
    write_image(cats / "exif6.jpg", size=(16, 8), exif=exif.tobytes())
    write_image(cats / "webp_inside.jpg", fmt="WEBP", lossless=True)
    write_image(cats / "png_inside.jpg", fmt="PNG")
    write_image(cats / "bitmap.bmp", fmt="BMP")
    write_image(cats / "many.dots.in.name.jpg")
    write_image(cats / "with space.jpg")
    write_image(cats / "ünïcödé 写真.jpg")
    write_image(cats / LONG)
    write_image(cats / "same.jpg")
    write_image(cats / "same.png", fmt="PNG")
    write_image(cats / ".hidden.jpg")
    write_image(cats / ".hiddendir" / "x.jpg")
    write_image(cats / "nested" / "deeper" / "n.jpg")
    write_image(cats / "folder.jpg" / "inner.jpg")  # a directory whose name ends in .jpg
    os.symlink(cats / "ok.jpg", cats / "link.jpg")
    os.symlink(cats / "gone.jpg", cats / "dangling.jpg")
    (cats / "notes.txt").write_text("not an image")
    write_image(src / ".hidden_class" / "x.jpg")
    (src / "stray.txt").write_text("stray")
    write_image(src / "stray.jpg")
    (src / "empty").mkdir()
    return src


EXPECTED_REJECTED = {
    "cats/truncated.jpg": "decode failed",
    "cats/zero.jpg": "empty file",
    "cats/notimage.jpg": "not an image",
    "cats/bomb.png": "decompression bomb",
    "cats/pixelbomb.png": "decompression bomb",
    "cats/dangling.jpg": "dangling symlink",
    "cats/link.jpg": "same file as cats/ok.jpg (symlink or hard link); stored once",
}
EXPECTED_IGNORED = {
    ".hidden_class": "hidden", "stray.txt": "root", "stray.jpg": "root", "cats/.hidden.jpg": "hidden",
    "cats/.hiddendir": "hidden", "cats/notes.txt": "extension",
}


def run(src: Path, dest: Path, **kw) -> object:
    kw.setdefault("workers", 1)
    kw.setdefault("max_pixels", MAX_PIXELS)
    return write_shards(ShardConfig(src=str(src), dest=str(dest), **kw), progress=False)


def samples_by_source(dest: Path) -> dict[str, dict]:
    import webdataset as wds

    urls = [str(p) for p in sorted(dest.glob("*.tar"))]
    return {json.loads(s["json"])["source"]: s for s in wds.WebDataset(urls, shardshuffle=False)}


def image_member(sample: dict) -> tuple[str, bytes]:
    (ext,) = [e for e in ("jpg", "png", "webp") if e in sample]
    return ext, sample[ext]


def test_empty_class_is_an_error_by_default(messy: Path, tmp_path: Path) -> None:
    with pytest.raises(DataError, match="empty.*--allow-empty-classes"):
        run(messy, tmp_path / "out")
    res = invoke(["shard", messy, tmp_path / "out2", "--workers", "1", "--quiet"], expect=2)
    assert "empty" in res.stderr and "Traceback" not in res.stderr


def test_messy_folder(messy: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    rep = run(messy, dest, allow_empty_classes=True)
    # Classes: hidden folders never, empty kept with its label and a warning.
    assert rep.classes == ["cats", "dogs", "empty"] and rep.empty_classes == ["empty"]
    assert any("'empty' (label 2)" in w for w in rep.warnings)
    rejected = {r.path: r.reason for r in rep.rejected}
    assert set(rejected) == set(EXPECTED_REJECTED), rejected
    for path, why in EXPECTED_REJECTED.items():
        assert why in rejected[path], (path, rejected[path])
    ignored = {i.path: i.reason for i in rep.ignored}
    for path, why in EXPECTED_IGNORED.items():
        assert why in ignored[path], (path, ignored.get(path))
    assert not any(p.endswith("x.jpg") for p in rejected)

    got = samples_by_source(dest)
    assert rep.num_samples == len(got) == 24
    for name in ["ok.jpg", "UPPER.JPG", "upper2.JPEG", "up.PNG", "many.dots.in.name.jpg", "with space.jpg",
                 "ünïcödé 写真.jpg", LONG, "same.jpg", "same.png", "nested/deeper/n.jpg", "folder.jpg/inner.jpg"]:
        assert f"cats/{name}" in got, name
    keys = [s["__key__"] for s in got.values()]
    assert len(set(keys)) == len(keys) and not any("." in k for k in keys)
    # No silent mislabel: every sample's label is its top-level folder's index.
    for source, s in got.items():
        assert int(s["cls"]) == rep.classes.index(source.split("/")[0])
    assert got["dogs/ok.jpg"]["jpg"] == (messy / "dogs/ok.jpg").read_bytes()
    assert "cats/link.jpg" not in got  # the symlink to cats/ok.jpg: that file is stored once, under its own path

    # The member extension names the real format.
    assert image_member(got["cats/webp_inside.jpg"])[0] == "webp"
    assert image_member(got["cats/png_inside.jpg"])[0] == "png"
    assert image_member(got["cats/bitmap.bmp"])[0] == "png"
    assert image_member(got["cats/gray16.png"])[0] == "png"
    assert image_member(got["cats/cmyk.jpg"])[0] == "jpg"
    assert rep.transforms == {"16bit_to_png8": 1, "cmyk_to_rgb_jpeg": 1, "copy": 21, "to_png": 1}

    # Every accepted sample decodes to 3-channel RGB; pass-through ones equal the source pixel for pixel.
    for source, s in got.items():
        ext, data = image_member(s)
        rgb = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
        assert rgb.ndim == 3 and rgb.shape[2] == 3
        meta = json.loads(s["json"])
        assert (meta["width"], meta["height"]) == (rgb.shape[1], rgb.shape[0])
        assert meta["sha256"] == hashlib.sha256(data).hexdigest()
        src_img = Image.open(messy / source)
        if source.endswith(("cmyk.jpg", "gray16.png")):
            continue
        assert np.array_equal(rgb, np.asarray(src_img.convert("RGB"))), source
    # CMYK: converted by Pillow, re-encoded at quality 95: close to Pillow's own conversion.
    cmyk = np.asarray(Image.open(io.BytesIO(got["cats/cmyk.jpg"]["jpg"])).convert("RGB")).astype(int)
    ref = np.asarray(Image.open(messy / "cats/cmyk.jpg").convert("RGB")).astype(int)
    assert np.abs(cmyk - ref).mean() < 4
    # 16-bit gray is scaled to 8 bits, not clipped to white.
    g16 = np.asarray(Image.open(io.BytesIO(got["cats/gray16.png"]["png"])))
    assert g16.dtype == np.uint8 and np.array_equal(g16, np.asarray(Image.open(messy / "cats/gray16.png")) >> 8)

    # EXIF orientation: recorded, not applied; bytes unchanged, pixels in stored order.
    ex = got["cats/exif6.jpg"]
    meta = json.loads(ex["json"])
    assert meta["exif_orientation"] == 6 and (meta["width"], meta["height"]) == (16, 8)
    assert ex["jpg"] == (messy / "cats/exif6.jpg").read_bytes()
    assert rep.num_exif_oriented == 1

    # The set verifies, decode included, and the summary names rejects and ignores with reasons.
    from gpufeed.shard import render_shard
    from gpufeed.verify import verify_shards

    assert verify_shards(dest, workers=1).ok
    text = render_shard(rep)
    assert "cats/truncated.jpg: decode failed" in text and "stray.txt: file at the root" in text


def test_messy_folder_is_deterministic_across_workers(messy: Path, tmp_path: Path) -> None:
    a = run(messy, tmp_path / "a", allow_empty_classes=True, shard_samples=6)
    b = run(messy, tmp_path / "b", allow_empty_classes=True, shard_samples=6, workers=2)
    assert a.num_shards == b.num_shards == 4
    for p in sorted((tmp_path / "a").glob("*.tar")):
        assert p.read_bytes() == (tmp_path / "b" / p.name).read_bytes(), p.name


def test_header_check_catches_less_and_verify_catches_the_rest(messy: Path, tmp_path: Path) -> None:
    dest = tmp_path / "out"
    rep = run(messy, dest, allow_empty_classes=True, check="header")
    rejected = {r.path for r in rep.rejected}
    assert "cats/truncated.jpg" not in rejected  # its header is fine
    assert {"cats/zero.jpg", "cats/notimage.jpg", "cats/bomb.png", "cats/pixelbomb.png"} <= rejected
    res = invoke(["verify", dest, "--workers", "1"], expect=1)
    key = [k for k, s in samples_by_source(dest).items() if k == "cats/truncated.jpg"]
    assert key
    truncated_key = samples_by_source(dest)["cats/truncated.jpg"]["__key__"]
    assert f"member {truncated_key}.jpg" in res.stdout and "does not decode" in res.stdout


def test_pillow_limit_is_never_disabled(messy: Path, tmp_path: Path) -> None:
    from gpufeed.config import MAX_PIXELS_LIMIT

    png_header_bomb(messy / "cats" / "gigapixel.png", 40_000, 25_000)  # 1 Gpx: under the highest max_pixels
    run(messy, tmp_path / "out", allow_empty_classes=True, max_pixels=MAX_PIXELS_LIMIT)
    assert Image.MAX_IMAGE_PIXELS == 89_478_485
    rep = run(messy, tmp_path / "out2", allow_empty_classes=True, max_pixels=MAX_PIXELS_LIMIT)
    rejected = {r.path: r.reason for r in rep.rejected}
    assert "decompression bomb" in rejected["cats/bomb.png"]
    assert "exceeds limit of 178956970 pixels" in rejected["cats/gigapixel.png"]  # Pillow's own guard


def test_file_name_that_is_not_utf8(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_image(src / "a" / "ok.jpg")
    raw = os.fsencode(src / "a") + b"/caf\xe9.jpg"  # Latin-1 bytes: not valid UTF-8
    with open(raw, "wb") as f:
        f.write((src / "a" / "ok.jpg").read_bytes())
    rep = run(src, tmp_path / "out")
    assert rep.num_samples == 2 and rep.num_rejected == 0
    assert "a/caf\ufffd.jpg" in samples_by_source(tmp_path / "out")


def test_class_folder_name_that_is_not_utf8(tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    from gpufeed.shardset.manifest import read_manifest
    from gpufeed.shard import render_shard

    src = tmp_path / "src"
    write_image(src / "ok" / "b.jpg")
    raw = os.fsencode(src) + b"/caf\xe9"  # Latin-1 bytes: not valid UTF-8; still read under its real name
    os.mkdir(raw)
    with open(raw + b"/a.jpg", "wb") as f:
        f.write((src / "ok" / "b.jpg").read_bytes())
    dest = tmp_path / "out"
    rep = run(src, dest)
    assert rep.num_samples == 2 and rep.classes == ["caf\ufffd", "ok"]  # labels in the real names' order
    assert read_manifest(dest).classes == ["caf\ufffd", "ok"]
    meta = json.loads(samples_by_source(dest)["caf\ufffd/a.jpg"]["json"])
    assert meta["class"] == "caf\ufffd" and meta["label"] == 0
    assert sorted(pq.read_table(dest / "index.parquet").column("class").to_pylist()) == ["caf\ufffd", "ok"]
    assert json.loads((dest / "_info.json").read_text(encoding="utf-8"))["num_classes"] == 2
    render_shard(rep).encode("utf-8")  # printable
    out = json.loads(invoke(["shard", src, tmp_path / "out2", "--workers", "1", "--json"]).stdout)
    assert out["classes"] == ["caf\ufffd", "ok"]
    assert invoke(["verify", dest]).exit_code == 0


# --------------------------------------------------------------------------- one file, stored once


def test_class_folder_symlinked_to_another_class(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_image(src / "cats" / "a.jpg")
    write_image(src / "cats" / "b.jpg", color=(0, 90, 0))
    os.symlink(src / "cats", src / "dogs")
    with pytest.raises(DataError) as err:
        run(src, tmp_path / "out")
    assert str(err.value).startswith("class folder(s) dogs holds no image file of its own (only files already "
                                     "stored under another path, symlinks or hard links: dogs (2))")
    rep = run(src, tmp_path / "out2", allow_empty_classes=True)
    assert rep.classes == ["cats", "dogs"] and rep.num_samples == 2 and rep.empty_classes == ["dogs"]
    assert {r.path: r.reason for r in rep.rejected} == {
        "dogs/a.jpg": "same file as cats/a.jpg in another class (symlink or hard link); stored once",
        "dogs/b.jpg": "same file as cats/b.jpg in another class (symlink or hard link); stored once"}
    assert sorted(samples_by_source(tmp_path / "out2")) == ["cats/a.jpg", "cats/b.jpg"]


def test_symlink_loop_inside_a_class_ends(tmp_path: Path) -> None:
    src = tmp_path / "src"
    write_image(src / "cats" / "sub" / "a.jpg")
    os.symlink(src / "cats", src / "cats" / "sub" / "loop")  # cats/sub/loop/sub/loop/... forever
    os.symlink(src / "cats" / "sub", src / "cats" / "alias")  # sorts before "sub": walked after it anyway
    write_image(src / "dogs" / "d.jpg")
    rep = run(src, tmp_path / "out")
    assert rep.num_samples == 2 and rep.rejected == []
    assert sorted(samples_by_source(tmp_path / "out")) == ["cats/sub/a.jpg", "dogs/d.jpg"]
    ignored = {i.path: i.reason for i in rep.ignored}
    assert ignored == {"cats/alias": "folder already walked in this class (symlink loop or second link)",
                       "cats/sub/loop": "folder already walked in this class (symlink loop or second link)"}


def test_file_symlinked_into_two_classes(tmp_path: Path) -> None:
    src = tmp_path / "src"
    outside = write_image(tmp_path / "elsewhere" / "x.jpg")
    write_image(src / "cats" / "c.jpg")
    write_image(src / "dogs" / "d.jpg", color=(0, 0, 200))
    write_image(src / "dogs" / "e.jpg", color=(0, 60, 200))
    os.symlink(outside, src / "cats" / "x.jpg")
    os.symlink(outside, src / "dogs" / "x.jpg")
    os.link(src / "dogs" / "d.jpg", src / "cats" / "hard.jpg")  # a hard link is the same file too
    rep = run(src, tmp_path / "out")
    assert rep.num_samples == 4
    assert {r.path: r.reason for r in rep.rejected} == {
        "dogs/x.jpg": "same file as cats/x.jpg in another class (symlink or hard link); stored once",
        "dogs/d.jpg": "same file as cats/hard.jpg in another class (symlink or hard link); stored once"}
    got = samples_by_source(tmp_path / "out")
    assert sorted(got) == ["cats/c.jpg", "cats/hard.jpg", "cats/x.jpg", "dogs/e.jpg"]
    assert got["cats/x.jpg"]["jpg"] == outside.read_bytes()
