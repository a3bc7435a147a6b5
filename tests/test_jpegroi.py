"""gpufeed's compiled region decoder (``gpufeed.loader._jpegroi`` through :mod:`gpufeed.loader.jpegroi`): the pixels
of any box of a JPEG equal a whole-image decode's, bit for bit, over every sampling it meets (4:2:0, 4:2:2, 4:4:4,
grey, progressive, restart markers, odd sizes) and every edge of the image; broken data, boxes outside the image
and buffers too small are refused with a ValueError before anything is written out of bounds, and nothing is
printed; a library of another libjpeg API is refused at load time."""

from __future__ import annotations

import io
import random
import subprocess
import sys
import threading
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from gpufeed.loader import jpegroi
from tests.common.shards import encode, smooth_image

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def mod():
    found = jpegroi.region_decoder()
    if found is None:
        pytest.skip(f"gpufeed's region decoder is unavailable: {jpegroi.unavailable_reason()}")
    return found


def _restart_jpeg(img: Image.Image) -> bytes:
    raw = io.BytesIO()
    img.save(raw, "JPEG", quality=90, restart_marker_blocks=3)
    return raw.getvalue()


def _images() -> list[tuple[str, bytes]]:
    rgb = smooth_image(203, 157, 3)  # odd sizes: partial iMCUs on the right and at the bottom
    return [
        ("420", encode(rgb, quality=90, subsampling=2)),
        ("422", encode(rgb, quality=90, subsampling=1)),
        ("444", encode(rgb, quality=90, subsampling=0)),
        ("gray", encode(rgb.convert("L"), quality=90)),
        ("420-progressive", encode(rgb, quality=90, subsampling=2, progressive=True)),
        ("gray-progressive", encode(rgb.convert("L"), quality=90, progressive=True)),
        ("420-restarts", _restart_jpeg(rgb)),
        ("tiny", encode(smooth_image(9, 7, 4), quality=90, subsampling=2)),
    ]


def _whole(data: bytes) -> np.ndarray:
    sj = pytest.importorskip("simplejpeg")
    return sj.decode_jpeg(data, colorspace="RGB")


def _boxes(w: int, h: int, rng: random.Random) -> list[tuple[int, int, int, int]]:
    edges = [(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, w, h), (0, h - 1, w, h), (w - 1, 0, w, h),
             (min(16, w - 1), min(16, h - 1), w, h), (1, 1, w - 1, h - 1),
             (0, 0, 1, h), (0, h // 2, 1, h), (0, 0, 2, h), (w - 1, 0, w, h // 2 + 1)]  # 1-2 columns at the edges
    rand = []
    for _ in range(25):
        l, t = rng.randrange(w), rng.randrange(h)
        rand.append((l, t, rng.randrange(l + 1, w + 1), rng.randrange(t + 1, h + 1)))
    return edges + rand


@pytest.mark.parametrize("name,data", _images(), ids=[n for n, _ in _images()])
def test_a_box_decodes_to_the_whole_images_pixels_bit_for_bit(mod, name, data):
    whole = _whole(data)
    h, w = whole.shape[:2]
    buf = np.empty(h * w * 3, np.uint8)
    for box in _boxes(w, h, random.Random(name)):
        l, t, r, b = box
        buf[:] = 0x5A
        region = jpegroi.decode_region(mod, data, box, buf)
        assert region.shape == (b - t, r - l, 3)
        assert np.array_equal(region, whole[t:b, l:r]), (name, box)


def test_rows_below_the_box_are_never_read(mod):
    """The box's rows decode from the data up to them: the rest of the file cut off (and its end marker put back)
    still decodes the box; the same cut refuses a box that reaches the missing rows."""
    rgb = smooth_image(160, 480, 5)
    data = encode(rgb, quality=90, subsampling=2)
    whole = _whole(data)
    buf = np.empty(480 * 160 * 3, np.uint8)
    cut = data[: len(data) // 2] + b"\xff\xd9"
    top = jpegroi.decode_region(mod, cut, (10, 0, 150, 40), buf)
    assert np.array_equal(top, whole[0:40, 10:150])
    with pytest.raises(ValueError, match="(?i)premature end|corrupt|marker"):
        jpegroi.decode_region(mod, cut, (10, 400, 150, 470), buf)


@pytest.mark.parametrize("data,match", [
    (b"", "(?i)empty|not a jpeg|premature"),
    (b"not a jpeg at all" * 10, "(?i)not a jpeg|marker"),
    (b"\xff\xd8\xff\xe0" + b"\0" * 64, "(?i)premature|marker|corrupt|bogus"),
])
def test_data_that_is_not_a_jpeg_is_refused(mod, data, match):
    with pytest.raises(ValueError, match=match):
        jpegroi.decode_region(mod, data, (0, 0, 1, 1), np.empty(3, np.uint8))


def test_corrupt_entropy_data_is_refused_and_nothing_is_printed(mod, capfd):
    """A warning from libjpeg (corrupt data) is a failure, as simplejpeg's strict decode makes it; libjpeg's
    messages go nowhere (the loader says what failed, in one sentence)."""
    data = bytearray(encode(smooth_image(64, 64, 6), quality=90))
    sos = data.index(b"\xff\xda")
    for i in range(sos + 20, len(data) - 4, 7):
        data[i] = 0xFF if data[i + 1] not in (0x00, 0xD9) else data[i]
    failures = 0
    buf = np.empty(64 * 64 * 3, np.uint8)
    for box in ((0, 0, 64, 64), (8, 8, 40, 40)):
        try:
            jpegroi.decode_region(mod, bytes(data), box, buf)
        except ValueError:
            failures += 1
    assert failures == 2
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_cmyk_jpeg_is_refused(mod):
    data = encode(smooth_image(32, 32, 7).convert("CMYK"), quality=90)
    with pytest.raises(ValueError, match="not a YCbCr, grey or RGB JPEG"):
        jpegroi.decode_region(mod, data, (0, 0, 8, 8), np.empty(32 * 32 * 3, np.uint8))


def test_boxes_scales_and_buffers_are_checked_before_anything_is_written(mod):
    data = encode(smooth_image(48, 32, 8), quality=90)
    buf = np.full(64 * 64 * 3, 0x33, np.uint8)  # room for any box asked below: the image is what refuses it
    for box, why in (((0, 0, 49, 32), "outside"), ((0, 0, 48, 33), "outside"), ((5, 5, 5, 9), "empty"),
                     ((9, 5, 4, 9), "empty"), ((-1, 0, 4, 4), "negative"), ((0, -3, 4, 4), "negative")):
        with pytest.raises(ValueError, match=why):
            mod.decode_region(data, buf, *box)
    with pytest.raises(ValueError, match="outside"):  # 1/2 scale: 24 x 16 pixels
        mod.decode_region(data, buf, 0, 0, 25, 16, scale=2)
    for scale in (0, 3, 16, -2):
        with pytest.raises(ValueError, match="scale"):
            mod.decode_region(data, buf, 0, 0, 4, 4, scale)
    with pytest.raises(ValueError, match="does not fit"):  # 11 rows of 48 into a buffer of 10
        mod.decode_region(data, buf[: 48 * 3 * 10], 0, 0, 48, 11)
    with pytest.raises(ValueError, match="does not fit"):
        mod.decode_region(data, buf[:2], 0, 0, 1, 1)
    with pytest.raises(TypeError):  # a read-only output
        mod.decode_region(data, bytes(100), 0, 0, 4, 4)
    with pytest.raises(OverflowError):  # not wrapped round to a small number
        mod.decode_region(data, buf, 2**32 + 1, 0, 2**32 + 4, 4)
    with pytest.raises(TypeError):  # a strided output (the buffer protocol refuses it)
        mod.decode_region(data, np.zeros((64, 64, 3), np.uint8)[:, ::2], 0, 0, 4, 4)
    assert (buf == 0x33).all()  # every refusal came before a write
    exact = np.full(10 * 7 * 3 + 8, 0x44, np.uint8)
    mod.decode_region(data, exact[: 10 * 7 * 3], 3, 2, 13, 9)  # the box fills its bytes, and no more
    assert (exact[10 * 7 * 3:] == 0x44).all()
    assert np.array_equal(exact[: 10 * 7 * 3].reshape(7, 10, 3), _whole(data)[2:9, 3:13])


@pytest.mark.parametrize("scale", [2, 4, 8])
@pytest.mark.parametrize("name,data", _images()[:5], ids=[n for n, _ in _images()[:5]])
def test_a_box_at_a_dct_scale_is_that_scales_whole_decode_cropped(mod, name, data, scale):
    sj = pytest.importorskip("simplejpeg")
    h, w = sj.decode_jpeg_header(data)[:2]
    dw, dh = -(-w // scale), -(-h // scale)
    whole = sj.decode_jpeg(data, colorspace="RGB", min_width=dw, min_height=dh)
    assert whole.shape[:2] == (dh, dw)
    buf = np.empty(dh * dw * 3, np.uint8)
    for box in _boxes(dw, dh, random.Random(scale)):
        l, t, r, b = box
        assert np.array_equal(jpegroi.decode_region(mod, data, box, buf, scale), whole[t:b, l:r]), (name, box)


def test_threads_decode_at_once_with_the_same_pixels(mod):
    """The GIL is released while decoding: four threads decoding different boxes at once get what one thread
    gets."""
    name, data = _images()[0]
    whole = _whole(data)
    h, w = whole.shape[:2]
    boxes = _boxes(w, h, random.Random(11))
    wrong: list = []

    def work(k: int) -> None:
        buf = np.empty(h * w * 3, np.uint8)
        for _ in range(20):
            for box in boxes[k::4]:
                l, t, r, b = box
                if not np.array_equal(jpegroi.decode_region(mod, data, box, buf), whole[t:b, l:r]):
                    wrong.append(box)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=120)
    assert not wrong and not any(th.is_alive() for th in threads)


_OTHER_LIBRARY = """
import sys
sys.path.insert(0, sys.argv[1])
from gpufeed.loader import jpegroi
jpegroi.pillow_libjpeg = lambda: sys.argv[2]
print(jpegroi.region_decoder() is None, jpegroi.unavailable_reason())
"""


def _other_libraries() -> list[str]:
    import ctypes.util
    import glob
    import os

    import torchvision

    found = sorted(glob.glob(os.path.join(os.path.dirname(os.path.dirname(torchvision.__file__)), "torchvision.libs",
                                          "libjpeg*.so*")))
    libz = ctypes.util.find_library("z")
    return found[:1] + ([libz] if libz else [])


@pytest.mark.parametrize("path", _other_libraries() + ["/nonexistent/libjpeg.so.62"])
def test_a_library_of_another_api_or_none_is_refused_at_load(mod, path):
    """torchvision bundles a libjpeg-turbo built for the jpeg 8 API (a decompress struct of another layout):
    libjpeg's own version check refuses it in the self-test; a library without the libjpeg API, or no library,
    is refused when loading. Each in a fresh process, since a process loads one library."""
    res = subprocess.run([sys.executable, "-c", _OTHER_LIBRARY, str(ROOT / "src"), path], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-500:]
    refused, _, reason = res.stdout.strip().partition(" ")
    assert refused == "True", res.stdout
    assert any(s in reason for s in ("Wrong JPEG library version", "has no jpeg_", "cannot load")), reason


_NOT_BUILT = """
import sys
sys.path.insert(0, sys.argv[1])
sys.modules["gpufeed.loader._jpegroi"] = None  # as where the install found no C compiler: the import fails
from gpufeed.loader import decode, jpegroi
print(jpegroi.region_decoder() is None, "|", jpegroi.unavailable_reason())
try:
    decode.require_roi()
    print("roi runs through nvImageCodec")
except Exception as e:
    print(type(e).__name__, e)
"""


def test_without_the_compiled_module_roi_says_why_or_uses_nvimgcodec():
    res = subprocess.run([sys.executable, "-c", _NOT_BUILT, str(ROOT / "src")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr[-500:]
    first, second = res.stdout.strip().splitlines()
    assert first.startswith("True |") and "was not built" in first
    import importlib.util

    if importlib.util.find_spec("nvidia.nvimgcodec") is not None:
        assert second == "roi runs through nvImageCodec"
    else:
        assert second.startswith("ConfigError") and "was not built" in second and "gpufeed[roi]" in second
