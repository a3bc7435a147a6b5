"""A lean reader for local, uncompressed tar shards (the loader's fast path).

Python's ``tarfile`` (which webdataset uses) parses every header field of every member; at ~100 KB per
sample that costs about a quarter of the decode time. This reader parses only the name, size and type,
checks the header checksum, reads only the members the loader wants, and seeks over everything else,
including whole samples before a segment's start. Samples are grouped exactly as webdataset groups
them (key = path up to the first dot of the file name, consecutive members), so counts agree with
``gpufeed index`` and with the webdataset path the loader uses for compressed or remote shards.

Handles POSIX ustar (with prefix), GNU long names (``L``) and pax headers (``x`` path/size, ``g`` ignored).
"""

from __future__ import annotations

import re
from typing import BinaryIO, Iterator

_BLOCK = 512
_META = re.compile(r"__[^/]*__($|/)")


class TarFormatError(ValueError):
    """The shard is not a well-formed tar file (bad checksum, truncated member)."""


def _octal(field: bytes) -> int:
    if field and field[0] & 0x80:  # GNU base-256 for large values
        n = 0
        for b in field[1:]:
            n = (n << 8) | b
        return n
    text = field.rstrip(b"\0 ").strip()
    return int(text, 8) if text else 0


def _pax(data: bytes) -> dict[str, str]:
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        sp = data.index(b" ", pos)
        length = int(data[pos:sp])
        kv = data[sp + 1: pos + length - 1].decode("utf-8", "replace")
        k, _, v = kv.partition("=")
        out[k] = v
        pos += length
    return out


def iter_members(f: BinaryIO, want) -> Iterator[tuple[str, bytes | None]]:
    """Regular members as ``(name, data)``; ``data`` is None (not read) unless ``want(name)``."""
    long_name: str | None = None
    pax: dict[str, str] = {}
    while True:
        hdr = f.read(_BLOCK)
        if len(hdr) < _BLOCK:
            if not hdr:
                return  # no end-of-archive blocks: tolerated, as tarfile does
            raise TarFormatError("truncated header")
        if hdr.count(0) == _BLOCK:
            return  # end of archive
        chk = _octal(hdr[148:156])
        if chk != sum(hdr[:148]) + 256 + sum(hdr[156:]):
            raise TarFormatError("bad header checksum")
        size = _octal(hdr[124:136])
        typ = hdr[156:157]
        padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
        if typ in (b"L", b"x", b"g"):
            data = f.read(padded)
            if len(data) < padded:
                raise TarFormatError("truncated member")
            data = data[:size]
            if typ == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            elif typ == b"x":
                pax = _pax(data)
            continue
        name = hdr[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        if hdr[257:263] == b"ustar\0":
            prefix = hdr[345:500].split(b"\0", 1)[0]
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        if long_name is not None:
            name, long_name = long_name, None
        if pax:
            name = pax.get("path", name)
            if "size" in pax:
                size = int(pax["size"])
                padded = (size + _BLOCK - 1) // _BLOCK * _BLOCK
            pax = {}
        if typ not in (b"0", b"\0", b"7"):  # not a regular file: skip its data (usually none)
            f.seek(padded, 1)
            continue
        if want(name):
            data = f.read(padded)
            if len(data) < padded:
                raise TarFormatError(f"truncated member {name!r}")
            yield name, data[:size] if size != padded else data
        else:
            pos = f.tell()
            f.seek(padded, 1)
            if f.tell() != pos + padded:  # pragma: no cover - seek past EOF is allowed on files
                raise TarFormatError(f"truncated member {name!r}")
            yield name, None


def split_name(name: str) -> tuple[str | None, str]:
    """webdataset's ``base_plus_ext``: ``dir/key.ext.more`` -> (``dir/key``, ``ext.more``)."""
    slash = name.rfind("/")
    dot = name.find(".", slash + 1)
    if dot < 0 or dot == slash + 1:
        return None, ""
    return name[:dot], name[dot + 1:]


def iter_samples(path: str, extensions: frozenset[str], image_extensions: tuple[str, ...], start: int = 0,
                 stop: int | None = None) -> Iterator[dict]:
    """Samples ``[start, stop)`` of a local tar shard, counting only keys with an image member.

    Each sample is ``{"__key__", "__url__", ext: bytes}`` for the members whose (lower-case) extension is in
    ``extensions``. Samples before ``start`` are skipped by seeking, without reading their data.
    """
    index = 0  # samples (keys with an image member) completed so far
    key: str | None = None
    sample: dict = {}
    has_image = False
    reading = start == 0

    def want(name: str) -> bool:  # called before the loop below sees ``name``: work out its sample index
        if not _wanted(name, extensions):
            return False
        prefix, _ = split_name(name)
        if prefix == key:
            return reading
        return index + (1 if key is not None and has_image else 0) >= start

    with open(path, "rb", buffering=1 << 20) as f:
        for name, data in iter_members(f, want):
            if _META.match(name):
                continue
            prefix, ext = split_name(name)
            if prefix is None:
                continue
            ext = ext.lower()
            if prefix != key:
                if key is not None and has_image:
                    if index >= start:
                        yield sample
                    index += 1
                    if stop is not None and index >= stop:
                        return
                key, sample, has_image = prefix, {"__key__": prefix, "__url__": path}, False
                reading = index >= start
            if ext in image_extensions:
                has_image = True
            if data is not None and ext in extensions:
                sample[ext] = data
        if key is not None and has_image and index >= start and (stop is None or index < stop):
            yield sample


def _wanted(name: str, extensions: frozenset[str]) -> bool:
    base = name[name.rfind("/") + 1:]
    dot = base.find(".")
    return dot > 0 and base[dot + 1:].lower() in extensions
