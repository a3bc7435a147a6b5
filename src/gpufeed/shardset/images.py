"""The one allow-list of image formats Pillow may parse (docs/threat-model.md, "Data never runs code").

Pillow picks a plugin from the bytes, not from the name: a ``.jpg`` that is really PostScript would be opened
by the EPS plugin, whose ``load()`` runs Ghostscript on it. Every ``Image.open`` in gpufeed goes through
:func:`open_image` with one of the tuples below, so any other format (EPS, PDF, the plugins that shell out or
parse rarely used containers) is "not an image" before a plugin sees it.
"""

from __future__ import annotations

import io
from typing import Any

MEMBER_FORMATS = ("JPEG", "PNG", "WEBP")
"""Formats of an image member of a shard (gpufeed writes JPEG, PNG and WebP). Pillow's JPEG opener also
yields the multi-picture camera JPEGs (format "MPO"), which have no opener of their own."""

SOURCE_FORMATS = MEMBER_FORMATS + ("PPM", "BMP", "TIFF")
"""Formats ``gpufeed shard`` reads from SRC: those of torchvision ImageFolder's extensions
(``shard.scan.CANDIDATE_EXTENSIONS``; PPM covers .pgm and .ppm)."""


MAX_JPEG_SCANS = 256
"""Most scans a progressive JPEG may have. Each scan makes the decoder pass over the whole image's coefficients
again, so a small crafted file of thousands of scans costs seconds of CPU per decode: 52 KB and 2,010 scans of a
2000 x 2000 image took 4.5-5.5 s in Pillow, 4.6-4.7 s in simplejpeg (which refuses it only at the end) and
5.0-6.6 s in nvImageCodec (two runs, ``benchmarks/bench_scan_bomb.py``). Encoders write 6 to about 20 scans (libjpeg's default script: 10 for colour). 256 is nvImageCodec's
own limit (``NVIMGCODEC_MAX_JPEG_SCANS``, from the libjpeg-turbo security review it cites)."""

MAX_JPEG_HEADER_SEGMENTS = 4096
"""Most marker segments walked before a JPEG's first scan when looking for its frame type. A header longer than
that (a crafted one: encoders write about 10) is not walked to its end; every scan marker of the file is counted
instead, as for a progressive frame."""

_PROGRESSIVE_SOF = frozenset((0xC2, 0xC6, 0xCA, 0xCE))


def jpeg_scan_problem(data: bytes) -> str | None:
    """Why a JPEG must not be decoded for its scans, or None: a progressive JPEG with more than
    :data:`MAX_JPEG_SCANS` scans.

    Walks the marker segments up to the first scan as libjpeg reads them (bytes between segments are skipped to
    the next FF, fill bytes FF FF are skipped), at most :data:`MAX_JPEG_HEADER_SEGMENTS` of them; then, for a
    progressive frame or a header too long to walk, counts the scan markers ``FF DA`` after that point. A scan
    marker is always those two bytes in a row (libjpeg skips only further FF bytes between them), and cannot occur
    inside entropy-coded data, where an FF is followed by 00 or a restart marker. A file with no scan, or whose
    header ends early, is left to the decoder (None)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos, progressive = 2, False
    for _ in range(MAX_JPEG_HEADER_SEGMENTS):
        if pos >= n:
            return None
        if data[pos] != 0xFF:  # bytes between segments: libjpeg warns and skips to the next FF
            pos = data.find(b"\xff", pos)
            if pos < 0:
                return None
        if pos + 1 >= n:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker == 0xDA:
            break
        if marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD8:  # no length (FF 00 is skipped as junk by libjpeg)
            pos += 2
            continue
        if pos + 4 > n:
            return None
        progressive = progressive or marker in _PROGRESSIVE_SOF
        pos += 2 + int.from_bytes(data[pos + 2: pos + 4], "big")
    else:  # a header too long to walk: count every scan marker of the file
        pos, progressive = 2, True
    if not progressive:
        return None
    scans = data.count(b"\xff\xda", pos)
    if scans > MAX_JPEG_SCANS:
        return (f"a progressive JPEG of {scans} scans, more than the {MAX_JPEG_SCANS} gpufeed decodes (each scan "
                f"decodes the whole image again: a crafted file costs seconds of CPU)")
    return None


class TooManyScans(ValueError):
    """A progressive JPEG with more scans than :data:`MAX_JPEG_SCANS`, refused before any decoder sees it."""


def check_jpeg_scans(data: bytes) -> None:
    """Raise :class:`TooManyScans` for a JPEG :func:`jpeg_scan_problem` refuses."""
    problem = jpeg_scan_problem(data)
    if problem is not None:
        raise TooManyScans(problem)


def open_image(data: bytes, formats: tuple[str, ...] = MEMBER_FORMATS) -> Any:
    """``PIL.Image.open`` of ``data`` trying only ``formats``; anything else raises
    ``PIL.UnidentifiedImageError`` (a corrupt sample to every caller). A JPEG with too many scans raises
    :class:`TooManyScans` (:func:`check_jpeg_scans`) before Pillow reads it."""
    from PIL import Image, UnidentifiedImageError

    check_jpeg_scans(data)
    try:
        return Image.open(io.BytesIO(data), formats=list(formats))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"not a {', '.join(formats)} image") from None
