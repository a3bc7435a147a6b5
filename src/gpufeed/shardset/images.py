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
"""Most marker segments read before a JPEG's first scan when looking for its frame type (each is at least 2 bytes,
so a well-formed header has far fewer; a longer run is left to the decoder, which refuses it or reads it)."""

_PROGRESSIVE_SOF = frozenset((0xC2, 0xC6, 0xCA, 0xCE))


def jpeg_scan_problem(data: bytes) -> str | None:
    """Why a JPEG must not be decoded for its scans, or None: a progressive JPEG with more than
    :data:`MAX_JPEG_SCANS` scans. Reads the marker segments up to the first scan (bounded), then, only for a
    progressive frame, counts the scan markers after it (``FF DA`` cannot occur inside entropy-coded data: an FF
    there is followed by 00 or a restart marker). Anything malformed is left to the decoder (None)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos, progressive = 2, False
    for _ in range(MAX_JPEG_HEADER_SEGMENTS):
        if pos + 4 > n or data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker == 0xDA:
            break
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            pos += 2
            continue
        progressive = progressive or marker in _PROGRESSIVE_SOF
        pos += 2 + int.from_bytes(data[pos + 2: pos + 4], "big")
    else:
        return None
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
