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


def open_image(data: bytes, formats: tuple[str, ...] = MEMBER_FORMATS) -> Any:
    """``PIL.Image.open`` of ``data`` trying only ``formats``; anything else raises
    ``PIL.UnidentifiedImageError`` (a corrupt sample to every caller)."""
    from PIL import Image, UnidentifiedImageError

    try:
        return Image.open(io.BytesIO(data), formats=list(formats))
    except UnidentifiedImageError:
        raise UnidentifiedImageError(f"not a {', '.join(formats)} image") from None
