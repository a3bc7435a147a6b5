"""The one allow-list of image formats Pillow may parse (docs/threat-model.md, "Data never runs code").

Pillow picks a plugin from the bytes, not from the name: a ``.jpg`` that is really PostScript would be opened
by the EPS plugin, whose ``load()`` runs Ghostscript on it. Every ``Image.open`` in gpufeed goes through
:func:`open_image` with one of the tuples below, so any other format (EPS, PDF, the plugins that shell out or
parse rarely used containers) is "not an image" before a plugin sees it.
"""

from __future__ import annotations

import io
from typing import Any, NamedTuple

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
5.0-6.6 s in nvImageCodec (two runs, ``benchmarks/bench_scan_bomb.py``). Encoders write 6 to about 20 scans
(libjpeg's default script: 10 for colour). 256 is nvImageCodec's own limit (``NVIMGCODEC_MAX_JPEG_SCANS``)."""

MAX_JPEG_SCAN_PIXELS = 2**31
"""Most scans x pixels a progressive JPEG may ask for (256 scans up to 8.4 megapixels, 24 scans at the 89.5
megapixels of ``max_pixels``' default): 256 legal arithmetic-coded scans of a 9459 x 9459 image in 2.7 KB cost
5-7 s per decode. A 24-megapixel photo of 10 scans asks for 0.24 x 2^30."""

MAX_JPEG_HEADER_SEGMENTS = 4096
"""Most marker segments and fill bytes before a JPEG's first scan (encoders write about 10). Pillow parses the
header in Python, byte by byte where fill bytes repeat: 24 MB of them cost it 9.7 s."""

MAX_JPEG_HEADER_JUNK = 65536
"""Most bytes between a JPEG's header segments that are not part of any (libjpeg skips them with a warning;
Pillow reads them one by one in Python)."""

_SOF = frozenset(range(0xC0, 0xD0)) - {0xC4, 0xC8, 0xCC}  # frame headers (C4 DHT, C8 JPG, CC DAC are not)
_PROGRESSIVE_SOF = frozenset((0xC2, 0xC6, 0xCA, 0xCE))
_LOSSLESS_SOF = frozenset((0xC3, 0xC7, 0xCB, 0xCF))
DEVICE_SOF = frozenset((0xC0, 0xC1, 0xC2))
"""Frame types ``decode = "gpu"`` hands to nvJPEG: Huffman-coded baseline, extended and progressive."""


class JpegFrame(NamedTuple):
    """What :func:`jpeg_frame` read of a JPEG's header: its (first) frame header and first scan."""

    sof: int
    """The frame marker's second byte (C0 baseline, C1 extended, C2 progressive, C9/CA arithmetic, ...)."""
    width: int
    height: int
    components: int
    scan: int
    """Offset of the first scan's FF DA."""
    scan_components: int
    """Components in the first scan: fewer than :attr:`components` makes a multi-scan sequential file."""
    frames: int
    """Frame headers before the first scan (libjpeg refuses a second one; Pillow reports the last one's size)."""


class ImageRefused(ValueError):
    """A JPEG or PNG gpufeed refuses from its header before any decoder reads it (:func:`jpeg_problem`,
    :func:`png_problem`)."""



def jpeg_frame(data: bytes) -> JpegFrame | str | None:
    """The frame header and first scan of a JPEG, walking its marker segments as libjpeg reads them (bytes between
    segments skipped to the next FF, fill bytes FF FF skipped); a string saying why the header is refused (longer
    than :data:`MAX_JPEG_HEADER_SEGMENTS` segments and fill bytes, or more than :data:`MAX_JPEG_HEADER_JUNK` bytes
    between them); None for what is not a JPEG or ends before a frame and a scan (the decoder says what it is)."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos, junk, frame, frames = 2, 0, None, 0
    for _ in range(MAX_JPEG_HEADER_SEGMENTS):
        if pos >= n:
            return None
        if data[pos] != 0xFF:  # bytes between segments: libjpeg warns and skips to the next FF
            nxt = data.find(b"\xff", pos)
            if nxt < 0:
                return None
            junk += nxt - pos
            if junk > MAX_JPEG_HEADER_JUNK:
                return f"a JPEG with over {MAX_JPEG_HEADER_JUNK} bytes of junk between its header segments"
            pos = nxt
        if pos + 1 >= n:
            return None
        marker = data[pos + 1]
        if marker == 0xFF:  # a fill byte before the marker
            pos += 1
            continue
        if marker == 0xDA:
            if frame is None or pos + 5 > n:
                return None
            return JpegFrame(*frame, pos, data[pos + 4], frames)
        if marker in (0x00, 0x01) or 0xD0 <= marker <= 0xD8:  # no length (FF 00 is skipped as junk by libjpeg)
            pos += 2
            continue
        if pos + 4 > n:
            return None
        if marker in _SOF and pos + 10 <= n:
            frames += 1
            if frame is None:
                frame = (marker, (data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6],
                         data[pos + 9])
        pos += 2 + ((data[pos + 2] << 8) | data[pos + 3])
    return (f"a JPEG header of more than {MAX_JPEG_HEADER_SEGMENTS} marker segments and fill bytes (encoders write "
            f"about 10)")


def jpeg_problem(data: bytes) -> str | None:
    """Why gpufeed refuses a JPEG before decoding it, or None (also for anything that is not a JPEG):
    - a header refused by :func:`jpeg_frame`;
    - two frame headers (libjpeg refuses the second; Pillow would report its size);
    - a lossless frame (C3, C7, CB, CF): libjpeg-turbo writes full-size rows past the buffer of a reduced-size
      decode, so simplejpeg's draft decode overflows its heap;
    - a progressive frame with more than :data:`MAX_JPEG_SCANS` scans, or scans x pixels over
      :data:`MAX_JPEG_SCAN_PIXELS`;
    - a sequential frame whose first scan holds fewer components than the frame (libjpeg then buffers the whole
      image and passes over it again for every further scan, even an empty one) with more scans than components.
    Scans are counted as ``FF DA`` after the first one: a scan marker is always those two bytes in a row, and cannot
    occur inside entropy-coded data (an FF there is followed by 00 or a restart marker). A single-scan sequential
    file (the usual baseline JPEG) costs only the header walk: libjpeg refuses a second scan at once."""
    frame = jpeg_frame(data)
    if frame is None or isinstance(frame, str):
        return frame
    return _frame_problem(data, frame)


def _frame_problem(data: bytes, frame: JpegFrame) -> str | None:
    """:func:`jpeg_problem` for a JPEG whose header :func:`jpeg_frame` read."""
    if frame.frames > 1:
        return f"a JPEG with {frame.frames} frame headers (one image has one)"
    if frame.sof in _LOSSLESS_SOF:
        return f"a lossless JPEG (frame type {frame.sof:02X}), which gpufeed does not decode"
    progressive = frame.sof in _PROGRESSIVE_SOF
    if not progressive and frame.scan_components >= frame.components:
        return None
    scans = data.count(b"\xff\xda", frame.scan)
    if progressive:
        if scans > MAX_JPEG_SCANS:
            return (f"a progressive JPEG of {scans} scans, more than the {MAX_JPEG_SCANS} gpufeed decodes (each "
                    f"scan decodes the whole image again: a crafted file costs seconds of CPU)")
        if scans * frame.width * frame.height > MAX_JPEG_SCAN_PIXELS:
            return (f"a progressive JPEG of {scans} scans of {frame.width} x {frame.height} pixels, over the "
                    f"{MAX_JPEG_SCAN_PIXELS} scans x pixels gpufeed decodes (each scan decodes the whole image "
                    f"again)")
        return None
    if scans > frame.components:
        return (f"a sequential JPEG of {scans} scans for its {frame.components} components (each further scan "
                f"decodes the whole image again)")
    return None


def check_jpeg(data: bytes) -> JpegFrame | None:
    """Raise :class:`ImageRefused` for a JPEG :func:`jpeg_problem` refuses; else its frame as :func:`jpeg_frame`
    read it (None when the header is left to the decoder), so a caller needs no second walk."""
    frame = jpeg_frame(data)
    problem = frame if isinstance(frame, str) else None if frame is None else _frame_problem(data, frame)
    if problem is not None:
        raise ImageRefused(problem)
    return frame if isinstance(frame, JpegFrame) else None


MAX_PNG_CHUNKS = 100_000
"""Most chunks a PNG may have (libpng writes 8 KB image-data chunks: 100,000 of them hold 800 MB). Pillow reads
chunks in Python: 2 million empty ones (24 MB) cost it 2.3 s to open and 5.1 s to decode."""


def png_problem(data: bytes) -> str | None:
    """Why gpufeed refuses a PNG before Pillow reads it, or None: more than :data:`MAX_PNG_CHUNKS` chunks before
    its end chunk (walked by their length fields, at most that many steps). Anything malformed is left to Pillow."""
    n = len(data)
    if n < 8 or data[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    pos = 8
    for _ in range(MAX_PNG_CHUNKS):
        if pos + 8 > n or data[pos + 4: pos + 8] == b"IEND":
            return None
        pos += 12 + int.from_bytes(data[pos: pos + 4], "big")
    return f"a PNG of more than {MAX_PNG_CHUNKS} chunks (encoders write a few per megabyte)"


def check_image_bytes(data: bytes) -> None:
    """Raise :class:`ImageRefused` (a ValueError) for a JPEG :func:`jpeg_problem` or a PNG :func:`png_problem`
    refuses: what no decoder should be handed."""
    problem = jpeg_problem(data) if data[:2] == b"\xff\xd8" else png_problem(data)
    if problem is not None:
        raise ImageRefused(problem)


HIGH_DEPTH_MODES = ("I;16", "I;16L", "I;16B", "I;16N", "I", "F")
"""Pillow modes of 16- and 32-bit grayscale, which ``convert("RGB")`` clips (a 16-bit image turns white)."""


def to_8bit_gray(im: Any) -> Any:
    """A 16/32-bit grayscale Pillow image as 8-bit ``L``, scaled (16-bit: the high byte) instead of clipped."""
    import numpy as np
    from PIL import Image

    a = np.asarray(im)
    if im.mode == "F":
        a = np.clip(a, 0, 255)
    elif a.dtype.itemsize >= 2:
        a = np.clip(a.astype(np.int64), 0, 65535) >> 8
    return Image.fromarray(a.astype(np.uint8), "L")


def to_rgb(im: Any) -> Any:
    """Any Pillow image -> RGB, scaling 16/32-bit grayscale to 8 bits instead of clipping it (``gpufeed shard``
    and the loader read such an image alike)."""
    if im.mode in HIGH_DEPTH_MODES:
        im = to_8bit_gray(im)
    return im if im.mode == "RGB" else im.convert("RGB")


def open_image(data: bytes, formats: tuple[str, ...] = MEMBER_FORMATS) -> Any:
    """``PIL.Image.open`` of ``data`` trying only ``formats``; anything else raises
    ``PIL.UnidentifiedImageError`` (a corrupt sample to every caller). A JPEG or PNG gpufeed refuses from its
    header (:func:`check_image_bytes`) raises :class:`ImageRefused` before Pillow reads it."""
    from PIL import Image, UnidentifiedImageError

    check_image_bytes(data)
    try:
        return Image.open(io.BytesIO(data), formats=list(formats))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"not a {', '.join(formats)} image") from None
