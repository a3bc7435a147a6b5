"""gpufeed's own JPEG region decode for ``decode = "roi"``: the C module ``_jpegroi`` (built when gpufeed is
installed, where a C compiler is found) calling libjpeg-turbo's scanline crop and skip in the libjpeg-turbo that
Pillow already loaded. Rows above the crop are entropy-decoded only, rows below it are never read, and only the
crop's columns (widened to whole iMCUs, plus one column each side for the chroma upsampling) go through the inverse
DCT and colour conversion. The box's pixels are those of a whole-image decode, bit for bit.

Nothing is compiled of libjpeg itself: the module is built against libjpeg-turbo's public headers (``_jpeg/``) and
looks up the library at run time. Before first use the library passes two checks: libjpeg's own (API version and
struct size, in ``jpeg_CreateDecompress``) and a self-test decode compared with Pillow's decode of the same bytes.
Where the module did not build, or the library fails a check, :func:`region_decoder` is None and says why.
"""

from __future__ import annotations

import io
import os
import threading

import numpy as np

_LOCK = threading.Lock()
_STATE: list = []
"""``[module]`` once loaded and checked, ``[None]`` once that failed (the reason in ``_REASON``)."""
_REASON: list[str] = []


def pillow_libjpeg() -> str | None:
    """The path of the libjpeg Pillow's ``_imaging`` module loaded: from ``/proc/self/maps`` on Linux (the file
    mapped, whatever its name), else the one a Pillow wheel bundles beside its package (macOS's ``.dylibs``)."""
    import PIL
    from PIL import _imaging  # noqa: F401 - loads Pillow's libjpeg into this process

    pil_dir = os.path.dirname(os.path.abspath(PIL.__file__))
    site = os.path.dirname(pil_dir)
    found: list[str] = []
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                parts = line.split(None, 5)
                if len(parts) == 6 and os.path.basename(parts[5].strip()).startswith("libjpeg"):
                    path = parts[5].strip()
                    if path not in found:
                        found.append(path)
    except OSError:  # no /proc (macOS): a wheel's bundled copy
        bundled = os.path.join(pil_dir, ".dylibs")
        if os.path.isdir(bundled):
            found = [os.path.join(bundled, n) for n in sorted(os.listdir(bundled)) if n.startswith("libjpeg")]
    # Pillow's own copy first (pillow.libs beside the package, or inside it); then a system libjpeg.so.62
    ranked = sorted(found, key=lambda p: (not p.startswith((site + os.sep + "pillow.libs", pil_dir)),
                                          ".so.62" not in p))
    return ranked[0] if ranked else None


def _self_test(mod) -> str | None:
    """None when a region decode of a small 4:2:0 JPEG made here equals Pillow's decode of it, cropped; else why."""
    from PIL import Image

    yy, xx = np.mgrid[0:40, 0:56]
    pattern = np.stack([(xx * 7 + yy * 3) % 256, (xx * 2 + yy * 11) % 256, ((xx ^ yy) * 5) % 256], axis=2)
    raw = io.BytesIO()
    Image.fromarray(pattern.astype(np.uint8)).save(raw, "JPEG", quality=90, subsampling=2)
    data = raw.getvalue()
    with Image.open(io.BytesIO(data)) as img:
        whole = np.asarray(img.convert("RGB"))
    buf = np.zeros(40 * 56 * 3, np.uint8)
    try:
        region = decode_region(mod, data, (9, 5, 43, 33), buf)
    except ValueError as e:
        return f"its self-test decode failed ({e})"
    worst = int(np.abs(region.astype(np.int16) - whole[5:33, 9:43]).max())
    return None if worst <= 2 else f"its self-test decode differs from Pillow's by {worst} levels"


def region_decoder():
    """The loaded and checked ``_jpegroi`` module, or None (then :func:`unavailable_reason` says why)."""
    if _STATE:
        return _STATE[0]
    with _LOCK:
        if not _STATE:
            mod, reason = None, None
            try:
                from gpufeed.loader import _jpegroi as mod
            except ImportError:
                reason = "gpufeed's _jpegroi module was not built (no C compiler when gpufeed was installed)"
            if mod is not None:
                path = pillow_libjpeg()
                if path is None:
                    reason = "no libjpeg is loaded by Pillow in this process"
                else:
                    try:
                        mod.open(path)
                        reason = _self_test(mod)
                    except OSError as e:
                        reason = str(e)
            _STATE.append(None if reason else mod)
            _REASON.append(reason or "")
    return _STATE[0]


def unavailable_reason() -> str:
    """Why :func:`region_decoder` is None ("" when it is not)."""
    region_decoder()
    return _REASON[0]


def decode_region(mod, data: bytes, box: tuple[int, int, int, int], buf: np.ndarray, scale: int = 1) -> np.ndarray:
    """RGB pixels of ``box`` (left, top, right, bottom; whole pixels inside the image at that scale) of the JPEG
    ``data`` decoded at ``1/scale`` (1, 2, 4 or 8: libjpeg's DCT scaling): a contiguous [bottom - top, right - left,
    3] view of ``buf`` (at least that many bytes). Raises ValueError with libjpeg's reason for any error or
    warning."""
    left, top, right, bottom = box
    n = (bottom - top) * (right - left) * 3
    mod.decode_region(data, buf, left, top, right, bottom, scale)
    return buf[:n].reshape(bottom - top, right - left, 3)
