"""``gpufeed shard SRC DEST``: an ImageFolder -> deterministic WebDataset tar shards + manifest.

Pipeline (DESIGN §1): scan -> validate (parallel, batched per task) -> plan (seeded shuffle, N equal
shards) -> write -> ``index.parquet``, timm's ``_info.json`` and, last and atomically, ``manifest.json``.
No torch import anywhere on this path.

Writing is parallel within a shard as well as across shards (a 3,000-image folder plans one shard): tar
blocks are position-independent and every header follows from the plan, so the main process computes each
member's offset, creates the shard's temporary file at its final size (holes read as the zero padding and
end-of-archive blocks), and the workers write runs of consecutive samples at their offsets (``pwrite``, image
bytes by ``sendfile``) while a thread of the main process hashes the file in order as the runs complete; the
file is renamed only once fully written and hashed. The bytes are the same for any ``--workers``.

Input rules
-----------
* Classes are the sorted names of the non-hidden folders in SRC (``entry.is_dir()``, symlinks followed), so
  labels agree with ``torchvision.datasets.ImageFolder`` (which would also count hidden folders as classes).
* Inside a class folder every sub-folder is walked (as ImageFolder does), symlinks followed, each folder
  (device, inode) once per class, so loops end.
  Candidates carry one of ImageFolder's extensions (``.jpg .jpeg .png .ppm .bmp .pgm .tif .tiff .webp``,
  any case). A directory named ``x.jpg`` is just a folder. Hidden files/folders, other extensions, stray
  files at SRC's root, special files (FIFOs, sockets) are *ignored* (file + reason in the report).
* Every file is stored once: paths that reach the same file (device, inode; symlinks followed, hard links
  included), in one class or in several, keep one path (one reached without a symlink first, then the lowest
  label, then the path); the others are *rejected* naming it. A class folder that is a symlink to another class
  thus holds no file of its own and is refused as empty (the message says why).
* A candidate is *rejected* (file + reason in the report, never an exception) when it is empty, a
  dangling symlink, not an image, undecodable or truncated (``--check full`` decodes every image;
  ``--check header`` only parses headers), or larger than ``max_pixels`` (decompression bombs; Pillow's own
  ``MAX_IMAGE_PIXELS`` guard is never disabled).
* An empty class (no accepted image) is an error naming the folder; with ``allow_empty_classes`` it keeps its
  label (no renumbering) and the report warns.

Stored bytes, colour modes and orientation
------------------------------------------
* The image member's extension names the real encoded format (``jpg``, ``png`` or ``webp``), never the input
  file name: a PNG saved as ``x.jpg`` is stored as ``KEY.png``.
* By default image bytes pass through unchanged ("copy"). Grayscale, palette, 1-bit, alpha (LA/RGBA/PA) and
  16-bit *RGB* images pass through: Pillow's ``Image.open(...).convert("RGB")`` yields 3-channel RGB for them
  (alpha is dropped, not flattened, exactly as ImageFolder's loader does).
* A few inputs are transcoded (counted in the report under ``transforms``) because a plain
  ``.convert("RGB")`` or a libjpeg-turbo / nvjpeg decoder would get them wrong:
  - ``cmyk_to_rgb_jpeg``: CMYK/YCCK JPEGs are converted to RGB by Pillow (which handles Adobe's inverted CMYK)
    and re-encoded as JPEG at quality 95 (or ``--quality``): simplejpeg / nvjpeg cannot convert CMYK.
  - ``16bit_to_png8``: 16-bit / 32-bit grayscale (Pillow mode ``I;16``/``I``/``F``) is scaled to 8 bits
    (``>> 8``) and stored as an 8-bit PNG, because ``.convert("RGB")`` would clip it to white.
  - ``to_png``: BMP/TIFF/PPM/PGM content is stored losslessly as an RGB PNG.
* ``--max-size PX`` re-encodes images whose long side exceeds PX (JPEG DCT-domain reduction where it applies, then
  Pillow's antialiased bicubic resize; never up; other
  images pass through); ``--quality Q`` re-encodes every image. Re-encoded output is always RGB JPEG
  (quality Q, default 90, 4:2:0, baseline, no metadata); alpha is dropped as above.
* EXIF orientation is **not applied**, consistently for every path: pass-through bytes keep their EXIF but
  are stored pixel-for-pixel, which is what ImageFolder's PIL loader, webdataset, simplejpeg and nvjpeg
  decode by default; re-encoded images are encoded from the stored pixel order and carry no EXIF.
  The tag is recorded as ``exif_orientation`` in ``KEY.json`` (when it is not 1) and counted in the report.

Members and keys
----------------
A sample is ``KEY.<jpg|png|webp>``, ``KEY.cls`` (label, ASCII decimal) and ``KEY.json`` (``source`` path
relative to SRC, ``class``, ``label``, stored ``width``/``height``, ``format``, ``sha256`` of the image
member, optional ``exif_orientation``, ``orig_width``/``orig_height`` when resized). KEY is
``{label:05d}_{n:07d}`` with n the position of the file among its class' accepted files in sorted path
order: no dots, unique, deterministic. Tar headers are fixed (USTAR, mtime 0, uid/gid 0, empty user/group
names, mode 0644) and members are written in plan order, so the bytes do not depend on ``--workers``.

Resume
------
The plan (fingerprint of the scanned files' paths, sizes and mtimes and of every output-affecting option,
plus the validated sample list) is kept in ``DEST/.gpufeed/plan.json``; each completed shard leaves
``DEST/.gpufeed/<shard>.done.json`` with its size and sha256. A re-run with the same fingerprint skips shards
whose file matches its sidecar and writes the rest; a different fingerprint is refused unless ``overwrite``.
A run holds ``fcntl.flock`` on ``DEST/.gpufeed/lock`` (which records its pid): a second run into the same DEST is
refused, naming that pid. The worker processes die with the main process and never keep the lock, so after a
``kill -9`` (or the OOM killer) the next run takes the lock at once. A killed run leaves at most ``.<shard>.tmp``
files (full-sized but never renamed), which the next run deletes. A run refused before it wrote anything removes
the folders it created (DEST included).

A pass-through file is hashed once, at validation (its sha256 goes into ``KEY.json``), which also records the
opened file's identity (size, mtime_ns, inode, device). When its shard is written, the opened source must
still have that identity, else the run is refused ("changed while sharding"): any rewrite in place moves mtime
and a replacement by rename changes the inode. Not caught: a rewrite at the same size that keeps (or restores,
``touch -d``) the exact mtime_ns — re-hashing would catch it, at the cost of a third SHA-256 pass over the
input. (Plans written before identities were recorded fall back to comparing the sha256.)

Disk space
----------
The candidates are validated in the seeded shard order (the accepted ones in that order are the shuffled
list), so each transcode cache file ``DEST/.gpufeed/enc-*.bin`` (``--max-size``/``--quality``/CMYK/16-bit/...)
feeds one or a few consecutive shards and is deleted as soon as they are written: DEST peaks near the output
size. Free space is checked before anything is written (estimate: the input bytes) and again, exactly, before
the shards are written. Any OS error while writing (DEST full included) is a ``DataError`` naming path and reason.

Names
-----
Class folder names and file paths are recorded (manifest, ``.json``, ``index.parquet``, report) with bytes that
are not UTF-8 replaced by U+FFFD; files are read under their real names; labels follow the real names' order.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import json
import math
import os
import random
import re
import shutil
import sys
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpufeed.config import ShardConfig
from gpufeed.errors import DataError

CANDIDATE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision ImageFolder's IMG_EXTENSIONS: the files considered images (matched case-insensitively)."""
STATE_DIR = ".gpufeed"
PLAN_NAME = "plan.json"
PLAN_VERSION = 2  # 2: validation and shards follow one seeded order; per-shard transcode caches
LOCK_NAME = "lock"
DEFAULT_REENCODE_QUALITY = 90
CMYK_QUALITY = 95
_SHARD_RE = re.compile(r"^[A-Za-z0-9_-]+-\d{6}\.tar$")
_CHUNK = 32  # files per validation task: amortises IPC, small enough for a smooth bar and balance
_TAR_OVERHEAD_PER_SAMPLE = 3 * 1024 + 300  # 3 headers + padding + json member, roughly


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class FileIssue:
    """One input file that was rejected or ignored, and why."""

    path: str
    """Path relative to SRC."""
    reason: str


@dataclass(frozen=True)
class ShardReport:
    """What ``write_shards`` did. ``ok`` is False only when ``strict`` and something was rejected."""

    src: str
    dest: str
    prefix: str
    num_classes: int
    num_samples: int
    """Images converted into the shard set."""
    num_rejected: int
    num_ignored: int
    num_shards: int
    num_shards_written: int
    num_shards_skipped: int
    """Shards already complete from an earlier, interrupted run (resume)."""
    total_bytes: int
    """Sum of the set's shard file sizes (kept and written)."""
    input_bytes: int
    """Bytes of the accepted input files."""
    written_samples: int
    """Samples in the shards written by this run (skipped shards of a resume excluded)."""
    written_bytes: int
    """Bytes of the shards written by this run."""
    written_input_bytes: int
    """Input bytes of the samples written by this run."""
    elapsed_s: float
    validate_s: float
    write_s: float
    samples_per_s: float
    """Samples written by this run per second of the whole run."""
    mb_per_s: float
    """Input MB (1e6 bytes) written by this run per second of the whole run."""
    workers: int
    strict: bool
    resumed: bool
    transforms: dict[str, int]
    """Samples per storage action: copy, reencode, cmyk_to_rgb_jpeg, 16bit_to_png8, to_png."""
    num_exif_oriented: int
    """Images with an EXIF orientation other than 1 (recorded, not applied)."""
    classes: list[str]
    empty_classes: list[str]
    warnings: list[str]
    rejected: list[FileIssue]
    ignored: list[FileIssue]
    shards: list[str]
    url_pattern: str
    manifest: str
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", not (self.strict and self.num_rejected > 0))


# --------------------------------------------------------------------------- scan


@dataclass
class _Scan:
    classes: list[str]
    """Class names as recorded (``_display``: non-UTF-8 bytes become U+FFFD), in label order."""
    candidates: list[tuple[str, int, int, int]]  # (relpath, label, size, mtime_ns)
    ignored: list[FileIssue]
    rejected: list[FileIssue]
    class_counts: list[int]
    dirs: list[str] = field(default_factory=list)
    """The class folders' real names (file system access), in label order."""
    duplicates: list[int] = field(default_factory=list)
    """Per class: files rejected because the same file (device, inode) is already stored under another path."""


def _rel(path: str, root: str) -> str:
    return _display(os.path.relpath(path, root))


def _display(rel: str) -> str:
    """Relative path as recorded: '/' separators; bytes that are not UTF-8 become U+FFFD (the file is still read
    under its real name, which the plan keeps)."""
    return rel.replace(os.sep, "/").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


def _scan(src: str) -> _Scan:
    classes: list[str] = []
    ignored: list[FileIssue] = []
    rejected: list[FileIssue] = []
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    for e in entries:
        if e.name.startswith("."):
            ignored.append(FileIssue(_rel(e.path, src), "hidden (never a class)"))
        elif e.is_dir():
            classes.append(e.name)
        elif e.is_symlink() and not os.path.exists(e.path):
            ignored.append(FileIssue(_rel(e.path, src), "dangling symlink at the root (not in a class folder)"))
        else:
            ignored.append(FileIssue(_rel(e.path, src), "file at the root (not in a class folder)"))
    found: list[tuple[str, int, int, int, tuple[int, int], bool]] = []
    for label, name in enumerate(classes):
        _walk_class(src, os.path.join(src, name), label, found, ignored, rejected)
    candidates, duplicates = _store_once(found, rejected, len(classes))
    counts = [0] * len(classes)
    for c in candidates:
        counts[c[1]] += 1
    ignored.sort(key=lambda i: i.path)
    shown = [_display(c) for c in classes]  # sorted by the real names, as ImageFolder sorts them
    if len(set(shown)) != len(shown):
        dup = sorted({c for c in shown if shown.count(c) > 1})
        raise DataError(f"class folders whose names are not valid UTF-8 read the same once shown ({', '.join(dup)}); "
                        f"rename them")
    return _Scan(shown, candidates, ignored, rejected, counts, dirs=classes, duplicates=duplicates)


def _store_once(found: list[tuple], rejected: list[FileIssue], num_classes: int
                ) -> tuple[list[tuple[str, int, int, int]], list[int]]:
    """Every file once: paths that reach the same file (device, inode) through symlinks or hard links, in one
    class or several, keep one path (one reached without a symlink first, then the lowest label, then the path);
    the others are rejected naming it. -> (candidates sorted by (label, path), duplicates per class)."""
    first: dict[tuple[int, int], tuple] = {}
    for f in sorted(found, key=lambda f: (f[5], f[1], f[0])):
        first.setdefault(f[4], f)
    candidates = []
    duplicates = [0] * num_classes
    for raw, label, size, mtime, ident, _via_link in found:
        kept = first[ident]
        if kept[0] == raw and kept[1] == label:
            candidates.append((raw, label, size, mtime))
            continue
        duplicates[label] += 1
        where = "" if kept[1] == label else " in another class"
        rejected.append(FileIssue(_display(raw), f"same file as {_display(kept[0])}{where} (symlink or hard link); "
                                                 f"stored once"))
    candidates.sort(key=lambda c: (c[1], c[0]))
    return candidates, duplicates


def _walk_class(src: str, top: str, label: int, out: list, ignored: list, rejected: list) -> None:
    """Collect a class' candidate files into ``out`` as (relpath, label, size, mtime_ns, (device, inode),
    reached_through_a_symlink). Sub-folders are followed through symlinks, each folder (device, inode) once, so
    loops end; folders reached without a symlink are walked first, so a folder also linked from elsewhere in the
    class is listed under its own path."""
    seen: set[tuple[int, int]] = set()
    stack = [(top, os.path.islink(top))]  # real folders: walked first
    linked: list[tuple[str, bool]] = []  # folders reached through a symlink: walked once ``stack`` is empty
    while stack or linked:
        d, via_link = stack.pop() if stack else linked.pop()
        try:
            st = os.stat(d)
        except OSError as exc:
            ignored.append(FileIssue(_rel(d, src), f"unreadable folder ({exc.strerror})"))
            continue
        if (st.st_dev, st.st_ino) in seen:
            ignored.append(FileIssue(_rel(d, src), "folder already walked in this class (symlink loop or second link)"))
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            ignored.append(FileIssue(_rel(d, src), f"unreadable folder ({exc.strerror})"))
            continue
        subdirs = []
        for e in entries:
            raw = os.path.relpath(e.path, src)
            rel = _display(raw)
            if e.name.startswith("."):
                ignored.append(FileIssue(rel, "hidden file or folder"))
                continue
            is_image_name = e.name.lower().endswith(CANDIDATE_EXTENSIONS)
            try:
                if e.is_dir():
                    subdirs.append((e.path, via_link or e.is_symlink()))
                    continue
                if e.is_symlink() and not os.path.exists(e.path):
                    (rejected if is_image_name else ignored).append(FileIssue(rel, "dangling symlink"))
                    continue
                if not e.is_file():
                    ignored.append(FileIssue(rel, "not a regular file"))
                    continue
                if not is_image_name:
                    ext = os.path.splitext(e.name)[1] or "(none)"
                    ignored.append(FileIssue(rel, f"not an image file extension ({ext})"))
                    continue
                st = e.stat()
            except OSError as exc:
                rejected.append(FileIssue(rel, f"unreadable ({exc.strerror})"))
                continue
            if st.st_size == 0:
                rejected.append(FileIssue(rel, "empty file (0 bytes)"))
                continue
            out.append((raw, label, st.st_size, st.st_mtime_ns, (st.st_dev, st.st_ino), via_link or e.is_symlink()))
        stack.extend(sd for sd in reversed(subdirs) if not sd[1])
        linked.extend(sd for sd in reversed(subdirs) if sd[1])


# --------------------------------------------------------------------------- validation (worker side)


def _detect(data: bytes) -> str | None:
    if data[:3] == b"\xff\xd8\xff":
        return "JPEG"
    if data[:8] == b"\x89PNG\r\n\x1a\n":
        return "PNG"
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "WEBP"
    return None


def _out_size(w: int, h: int, max_size: int | None) -> tuple[int, int]:
    if not max_size or max(w, h) <= max_size:
        return w, h
    s = max_size / max(w, h)
    return max(1, round(w * s)), max(1, round(h * s))


def _to_rgb(im: Any) -> Any:
    """Any Pillow image -> RGB, scaling 16/32-bit grayscale to 8 bits instead of clipping it."""
    if im.mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        im = _to_8bit_gray(im)
    return im if im.mode == "RGB" else im.convert("RGB")


def _to_8bit_gray(im: Any) -> Any:
    import numpy as np
    from PIL import Image

    a = np.asarray(im)
    if im.mode == "F":
        a = np.clip(a, 0, 255)
    elif a.dtype.itemsize >= 2:
        a = np.clip(a.astype(np.int64), 0, 65535) >> 8
    return Image.fromarray(a.astype(np.uint8), "L")


def _action(fmt: str, mode: str, w: int, h: int, max_size: int | None, quality: int | None) -> str:
    if quality is not None or (max_size is not None and max(w, h) > max_size):
        return "reencode"
    if fmt == "JPEG" and mode in ("CMYK", "YCCK"):
        return "cmyk_to_rgb_jpeg"
    if mode in ("I;16", "I;16L", "I;16B", "I;16N", "I", "F"):
        return "16bit_to_png8"
    if fmt not in ("JPEG", "PNG", "WEBP"):
        return "to_png"
    return "copy"


_EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def _encode(data: bytes, action: str, opts: dict[str, Any]) -> tuple[bytes, str, int, int]:
    """Apply a storage action -> (bytes, ext, width, height). Deterministic for given input and options."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        im = Image.open(io.BytesIO(data))
        if action == "reencode":
            target = _out_size(im.width, im.height, opts["max_size"])
            if im.format in ("JPEG", "MPO") and target != im.size:
                im.draft("RGB", target)  # DCT-domain downscale: still decodes the whole bitstream
            im = _to_rgb(im)
            if im.size != target:
                im = im.resize(target, Image.Resampling.BICUBIC)
            q = opts["quality"] or DEFAULT_REENCODE_QUALITY
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=q)
            return buf.getvalue(), "jpg", im.width, im.height
        if action == "cmyk_to_rgb_jpeg":
            im = _to_rgb(im)
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=opts["quality"] or CMYK_QUALITY)
            return buf.getvalue(), "jpg", im.width, im.height
        if action == "16bit_to_png8":
            im = _to_8bit_gray(im)
        else:  # to_png
            im = _to_rgb(im)
        buf = io.BytesIO()
        im.save(buf, "PNG")
        return buf.getvalue(), "png", im.width, im.height
    raise AssertionError(action)  # pragma: no cover


def _inspect(path: str, opts: dict[str, Any]) -> tuple:
    """Validate one file -> (ok, reason_or_action, fmt, width, height, orientation[, transcoded, sha256, ident]).

    ``ident`` is the opened file's identity (size, mtime_ns, inode, device) after reading it: the writer checks
    the source it copies against it instead of hashing the bytes a second time."""
    from PIL import Image, UnidentifiedImageError

    try:
        with open(path, "rb") as f:
            data = f.read()
            st = os.fstat(f.fileno())
    except OSError as exc:
        return (False, f"unreadable ({exc.strerror or exc})", None, 0, 0, 1)
    if not data:
        return (False, "empty file (0 bytes)", None, 0, 0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            return (False, f"decompression bomb ({exc})", None, 0, 0, 1)
        except UnidentifiedImageError:
            return (False, "not an image (content not recognised)", None, 0, 0, 1)
        except Exception as exc:  # noqa: BLE001 - any parser failure is a per-file reject
            return (False, f"unreadable image header ({type(exc).__name__}: {exc})", None, 0, 0, 1)
        fmt, mode, (w, h) = im.format or "", im.mode, im.size
        if fmt == "MPO":  # multi-picture camera JPEGs: the stream is a baseline JPEG (first picture) plus extras
            fmt = "JPEG"
        if w <= 0 or h <= 0:
            return (False, f"image has no pixels ({w}x{h})", fmt, w, h, 1)
        if w * h > opts["max_pixels"]:
            return (False, f"decompression bomb: {w}x{h} = {w * h} pixels > max_pixels {opts['max_pixels']}",
                    fmt, w, h, 1)
        if fmt in ("JPEG", "PNG", "WEBP") and _detect(data) != fmt:
            return (False, f"unsupported {fmt} variant", fmt, w, h, 1)
        try:
            orientation = int(im.getexif().get(0x0112, 1) or 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block is not a broken image
            orientation = 1
        action = _action(fmt, mode, w, h, opts["max_size"], opts["quality"])
        try:
            if action != "copy":
                # Transcoding decodes the whole image (the validation) and its output is kept for the writer.
                out, ext, ow, oh = _encode(data, action, opts)
                return (True, action, fmt, w, h, orientation, (out, ext, ow, oh), hashlib.sha256(out).hexdigest(),
                        None)
            if opts["check"] == "full":
                if fmt == "JPEG":
                    # Scaled IDCT: libjpeg still parses and entropy-decodes every coefficient of the whole
                    # bitstream (truncation and corrupt markers fail exactly as at full size), at ~half the cost.
                    im.draft(mode, (max(1, w // 8), max(1, h // 8)))
                im.load()
                if mode not in ("RGB", "L"):
                    im.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - truncated / corrupt data is a per-file reject
            return (False, f"decode failed ({type(exc).__name__}: {exc})", fmt, w, h, orientation)
    ident = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    return (True, action, fmt, w, h, orientation, None, hashlib.sha256(data).hexdigest(), ident)


def _validate_chunk(paths: list[str], opts: dict[str, Any], cache: str | None = None) -> list[tuple]:
    """Validate a batch of files. Transcoded outputs go to one cache file per batch: (offset, length, ext, w, h)."""
    results = []
    blobs = []
    offset = 0
    for p in paths:
        r = _inspect(p, opts)
        if r[0] and r[6] is not None:
            out, ext, ow, oh = r[6]
            blobs.append(out)
            r = r[:6] + ((offset, len(out), ext, ow, oh),) + r[7:]
            offset += len(out)
        elif not r[0]:
            r = r + (None, None, None)
        results.append(r)
    if blobs:
        assert cache is not None
        from gpufeed.records import atomic_write_bytes

        atomic_write_bytes(cache, b"".join(blobs))
    return results


# --------------------------------------------------------------------------- writing (worker side)

_RANGE_BYTES = 8 << 20
"""Target bytes of one write task (a run of consecutive samples of one shard): small enough that hashing the
shard in order trails the writers by little, large enough to amortise the per-task IPC."""
_RANGE_SAMPLES = 256


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header tarfile writes for a regular file with our fixed metadata (mtime 0, uid/gid 0,
    empty user/group names, mode 0644), built directly: tarfile's generic path costs more than the I/O."""
    nb = name.encode("utf-8")
    if len(nb) > 100 or size >= 8**11:
        raise ValueError(f"{name!r} ({size} bytes) does not fit a plain USTAR header")
    buf = b"".join([
        nb.ljust(100, b"\0"), b"0000644\0", b"0000000\0", b"0000000\0", b"%011o\0" % size, b"00000000000\0",
        b" " * 8, b"0", b"\0" * 100, b"ustar\x0000", b"\0" * 32, b"\0" * 32, b"\0" * 8, b"\0" * 8, b"\0" * 155,
    ]).ljust(512, b"\0")
    return buf[:148] + b"%06o\0" % sum(buf) + buf[155:]


def _member(name: str, data: bytes) -> bytes:
    return ustar_header(name, len(data)) + data + b"\0" * (-len(data) % 512)


def _padded(n: int) -> int:
    return n + (-n % 512)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _changed(rel: str) -> DataError:
    return DataError(f"{rel} changed while sharding (it is not the file that was validated: size, mtime, inode "
                     f"or device differ, or its bytes do); re-run (with --overwrite when asked)")


def _copy_source(fd: int, pos: int, path: str, rel: str, nbytes: int, ident: list[int] | None,
                 digest: str) -> None:
    """Copy a pass-through source into the shard at ``pos`` (``sendfile``: no user-space copy), after checking
    that the opened file is the one validated (``os.fstat`` identity; plans without one: sha256 again)."""
    sfd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(sfd)
        if st.st_size != nbytes:
            raise _changed(rel)
        if ident is not None:
            if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) != tuple(ident):
                raise _changed(rel)
        else:  # a plan written before identities were recorded
            data = os.pread(sfd, nbytes + 1, 0)
            if len(data) != nbytes or hashlib.sha256(data).hexdigest() != digest:
                raise _changed(rel)
            _pwrite_all(fd, data, pos)
            return
        done = 0
        try:
            os.lseek(fd, pos, os.SEEK_SET)
            while done < nbytes:
                n = os.sendfile(fd, sfd, done, nbytes - done)
                if n == 0:  # the file shrank after the check
                    raise _changed(rel)
                done += n
        except OSError as exc:
            import errno

            if done or exc.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
                raise
            data = os.pread(sfd, nbytes, 0)  # no sendfile between these file systems
            if len(data) != nbytes:
                raise _changed(rel) from None
            _pwrite_all(fd, data, pos)
    finally:
        os.close(sfd)


def _write_range(tmp: str, items: list[tuple]) -> None:
    """Write a run of samples into the shard file ``tmp`` (created at its final size by the main process) at
    the offsets the main process computed. Tar blocks are position-independent, so any number of processes can
    write disjoint ranges of one shard; padding and the end-of-archive blocks are the file's zeros."""
    fd = os.open(tmp, os.O_WRONLY)
    try:
        for offset, key, ext, img_len, cls_b, json_b, source in items:
            pos = start = offset
            buf: list[bytes] = []
            for name, payload in sorted([(ext, None), ("cls", cls_b), ("json", json_b)], key=lambda m: m[0]):
                size = img_len if payload is None else len(payload)
                buf.append(ustar_header(f"{key}.{name}", size))
                pos += 512
                if payload is not None:
                    buf.append(payload)
                    buf.append(b"\0" * (-size % 512))
                    pos += _padded(size)
                    continue
                _pwrite_all(fd, b"".join(buf), start)
                if source[0] == "file":
                    _, path, rel, ident, digest = source
                    _copy_source(fd, pos, path, rel, img_len, ident, digest)
                else:  # transcoded during validation; read back from the batch cache
                    _, cache, coff = source
                    with open(cache, "rb") as f:
                        f.seek(coff)
                        data = f.read(img_len)
                    if len(data) != img_len:
                        raise DataError(f"the transcode cache {cache} is incomplete; re-run with --overwrite")
                    _pwrite_all(fd, data, pos)
                pos += _padded(size)
                buf, start = [], pos
            if buf:
                _pwrite_all(fd, b"".join(buf), start)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- writing (main side)


class _ShardJob:
    """One shard being written: its layout, temporary file, write ranges and in-order hashing."""

    def __init__(self, dest: str, name: str, samples: list[tuple]) -> None:
        import queue

        self.name = name
        self.final = os.path.join(dest, name)
        self.tmp = os.path.join(dest, f".{name}.tmp")
        self.rows: list[tuple] = []
        items = []
        pos = 0
        for key, path, label, cname, rel, action, orientation, ext, w, h, digest, nbytes, enc, ident in samples:
            ow, oh = w, h
            if enc is None:
                img_len = nbytes
                source: tuple = ("file", path, rel, ident, digest)
            else:
                cache, coff, img_len, ext, w, h = enc
                source = ("cache", cache, coff)
            meta: dict[str, Any] = {"source": rel, "class": cname, "label": label, "width": w, "height": h,
                                    "format": ext, "sha256": digest}
            if orientation != 1:
                meta["exif_orientation"] = orientation
            if (ow, oh) != (w, h):
                meta["orig_width"], meta["orig_height"] = ow, oh
            json_b = json.dumps(meta, sort_keys=True, ensure_ascii=False).encode("utf-8")
            cls_b = str(label).encode("ascii")
            items.append((pos, key, ext, img_len, cls_b, json_b, source))
            pos += 3 * 512 + _padded(img_len) + _padded(len(cls_b)) + _padded(len(json_b))
            self.rows.append((key, img_len, w, h))
        self.size = pos + 1024 + (-(pos + 1024) % tarfile.RECORDSIZE)  # end-of-archive, padded like tarfile
        # Contiguous runs of samples, each one write task: [(items, end offset)].
        self.ranges: list[tuple[list[tuple], int, int]] = []
        first = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i][0] - items[first][0] >= _RANGE_BYTES or i - first >= _RANGE_SAMPLES:
                end = self.size if i == len(items) else items[i][0]
                self.ranges.append((items[first:i], end, sum(it[3] for it in items[first:i])))
                first = i
        self.done = [False] * len(self.ranges)
        self.hashed_to = 0  # ranges [0, hashed_to) are queued for hashing
        self.submitted = 0
        self.blocks: Any = queue.SimpleQueue()
        self.hash_future: Any = None
        fd = os.open(self.tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
        try:
            os.ftruncate(fd, self.size)  # holes read as zeros: the padding and the end-of-archive blocks
        finally:
            os.close(fd)

    def range_done(self, i: int) -> None:
        self.done[i] = True
        while self.hashed_to < len(self.ranges) and self.done[self.hashed_to]:
            start = 0 if self.hashed_to == 0 else self.ranges[self.hashed_to - 1][1]
            self.blocks.put((start, self.ranges[self.hashed_to][1]))
            self.hashed_to += 1
        if self.hashed_to == len(self.ranges):
            self.blocks.put(None)

    def abort(self) -> None:
        self.blocks.put(None)
        try:
            os.unlink(self.tmp)  # a half-written shard only takes space (DEST may be full)
        except OSError:
            pass


def _hash_file_ranges(path: str, blocks: Any) -> str:
    """sha256 of ``path`` fed in order by (start, end) ranges as they are written (hashlib releases the GIL)."""
    h = hashlib.sha256()
    buf = bytearray(4 << 20)
    with open(path, "rb", buffering=0) as f:
        while (r := blocks.get()) is not None:
            start, end = r
            while start < end:
                view = memoryview(buf)[:min(len(buf), end - start)]
                n = os.preadv(f.fileno(), [view], start)
                if n <= 0:
                    raise OSError(f"{path} ended early while hashing")
                h.update(view[:n])
                start += n
    return h.hexdigest()


def _finish_shard(dest: str, job: _ShardJob, digest: str) -> dict[str, Any]:
    """Rename a fully written and hashed shard into place, then leave its ``.done.json`` sidecar.

    No fsync of the shard: the rename makes it atomic against a killed process; after a power loss, resume and
    verify compare the file with the sha256 its (durable) sidecar records, so a torn shard is rewritten, never
    trusted.
    """
    from gpufeed.records import atomic_write_bytes

    os.replace(job.tmp, job.final)
    result = {"name": job.name, "num_samples": len(job.rows), "bytes": job.size, "sha256": digest,
              "rows": job.rows}
    # One C-encoder call: json.dump streams through the pure-Python encoder.
    atomic_write_bytes(os.path.join(dest, STATE_DIR, f"{job.name}.done.json"), json.dumps(result).encode("utf-8"))
    return result


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def _shard_complete(dest: str, name: str) -> dict[str, Any] | None:
    """The sidecar of a complete shard whose file still matches it, else None."""
    side = os.path.join(dest, STATE_DIR, f"{name}.done.json")
    path = os.path.join(dest, name)
    try:
        info = json.loads(Path(side).read_text())
        if os.path.getsize(path) == info["bytes"] and _sha256_file(path) == info["sha256"]:
            return info
    except (OSError, ValueError, KeyError):
        pass
    return None


# --------------------------------------------------------------------------- planning


def _options(cfg: ShardConfig) -> dict[str, Any]:
    return {"seed": cfg.seed, "shard_samples": cfg.shard_samples, "shard_bytes": cfg.shard_bytes,
            "multiple_of": cfg.multiple_of, "prefix": cfg.prefix, "max_size": cfg.max_size,
            "quality": cfg.quality, "check": cfg.check, "max_pixels": cfg.max_pixels,
            "allow_empty_classes": cfg.allow_empty_classes}


def _fingerprint(scan: _Scan, options: dict[str, Any]) -> str:
    from gpufeed import __version__

    h = hashlib.sha256()
    h.update(json.dumps({"plan_version": PLAN_VERSION, "gpufeed": __version__, "options": options,
                         "classes": scan.classes}, sort_keys=True).encode())
    for rel, label, size, mtime in scan.candidates:
        h.update(f"{label}\0{rel}\0{size}\0{mtime}\n".encode("utf-8", "surrogateescape"))
    for issue in scan.rejected:
        h.update(f"r\0{issue.path}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def plan_num_shards(num_samples: int, num_bytes: int, cfg: ShardConfig) -> int:
    """max(ceil(n / shard_samples), ceil(bytes / shard_bytes)), at least 1, rounded up to multiple_of."""
    n = max(1, math.ceil(num_samples / cfg.shard_samples), math.ceil(num_bytes / cfg.shard_bytes))
    return math.ceil(n / cfg.multiple_of) * cfg.multiple_of


def split_sizes(num_samples: int, num_shards: int) -> list[int]:
    """Shard sizes that differ by at most one, larger ones first."""
    q, r = divmod(num_samples, num_shards)
    return [q + 1 if i < r else q for i in range(num_shards)]


def _shard_names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:06d}.tar" for i in range(n)]


# --------------------------------------------------------------------------- the job


def write_shards(cfg: ShardConfig, progress: bool = True) -> ShardReport:
    """Convert ``cfg.src`` (an ImageFolder) into a deterministic WebDataset shard set at ``cfg.dest``."""
    t0 = time.perf_counter()
    if not cfg.src or not cfg.dest:
        raise DataError("shard needs SRC (an image folder) and DEST (the output folder)")
    src = os.path.abspath(cfg.src)
    dest = os.path.abspath(cfg.dest)
    if not os.path.isdir(src):
        raise DataError(f"SRC {cfg.src} is not a folder" if os.path.exists(src) else f"SRC {cfg.src} does not exist")
    if os.path.commonpath([src, dest]) == src:
        raise DataError(f"DEST {cfg.dest} is inside SRC {cfg.src}; choose a folder outside the input")
    if os.path.exists(dest) and not os.path.isdir(dest):
        raise DataError(f"DEST {cfg.dest} exists and is not a folder")
    from gpufeed.system import usable_cpus

    workers = cfg.workers or usable_cpus()
    options = _options(cfg)
    opts = {"check": cfg.check, "max_pixels": cfg.max_pixels, "max_size": cfg.max_size, "quality": cfg.quality}
    state = os.path.join(dest, STATE_DIR)
    created = []  # the folders this run creates, innermost first: DEST/.gpufeed, DEST, missing parents of DEST
    d = state
    while not os.path.isdir(d) and os.path.dirname(d) != d:
        created.append(d)
        d = os.path.dirname(d)
    try:
        os.makedirs(state, exist_ok=True)
    except OSError as exc:
        raise DataError(f"DEST {cfg.dest} cannot be created ({exc.strerror or exc})") from None
    lock = _lock(dest, cfg)
    try:
        return _run(cfg, src, dest, workers, options, opts, progress, t0, lock)
    except DataError:
        if created and os.listdir(state) == [LOCK_NAME]:  # refused before writing: leave DEST as it was
            os.unlink(os.path.join(state, LOCK_NAME))
            for folder in created:
                try:
                    os.rmdir(folder)  # only while empty
                except OSError:
                    break
        raise
    finally:
        os.close(lock)


_LOCK_PID_BYTES = 32
"""Bytes of the lock file read for the holder's pid (it holds one decimal number and a newline)."""


def _lock(dest: str, cfg: ShardConfig) -> int:
    """An exclusive ``flock`` on DEST/.gpufeed/lock for the whole run (a second run into the same DEST is refused,
    naming the holder's pid, which the file records). The descriptor is close-on-exec and the forked pool workers
    close their copy (``system.die_with_parent``), so the lock dies with this process: a run killed with -9 leaves
    a lock the next run simply takes."""
    import fcntl

    path = os.path.join(dest, STATE_DIR, LOCK_NAME)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o666)
    except OSError as exc:
        raise DataError(f"{path} cannot be opened ({exc.strerror or exc}); DEST {cfg.dest} is not writable") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, _LOCK_PID_BYTES, 0).strip()
        os.close(fd)
        who = f" (pid {int(holder)})" if holder.isdigit() and len(holder) <= 10 else ""
        raise DataError(f"DEST {cfg.dest} is in use by another `gpufeed shard` run{who}; wait for it to finish or "
                        f"choose another DEST") from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return fd


def _run(cfg: ShardConfig, src: str, dest: str, workers: int, options: dict[str, Any], opts: dict[str, Any],
         progress: bool, t0: float, lock_fd: int) -> ShardReport:
    state = os.path.join(dest, STATE_DIR)
    pool = _make_pool(workers, lock_fd) if workers > 1 else None
    _preload_finish_imports()
    bar = _Bar(progress)
    try:
        scan = _scan(src)
        if not scan.classes:
            raise DataError(f"SRC {cfg.src} has no class folders (expected SRC/<class>/<image>, as ImageFolder "
                            f"reads)")
        warn: list[str] = []
        _check_empty(cfg, scan.classes, scan.class_counts, warn, duplicates=scan.duplicates)
        fingerprint = _fingerprint(scan, options)

        plan = _load_plan(dest, fingerprint, cfg)
        resumed = plan is not None
        done: dict[str, dict[str, Any]] = {}
        if plan is not None:
            for s in plan["shards"]:
                info = _shard_complete(dest, s["name"])
                if info is not None:
                    done[s["name"]] = info
            lost = [c for s in plan["shards"] if s["name"] not in done for c in s["caches"]
                    if not os.path.exists(os.path.join(state, c))]
            if lost:  # transcoded bytes are gone (cleared after use): redo the deterministic validation
                plan = None

        t_val = time.perf_counter()
        if plan is None:
            # Before anything is written: the input size is the estimate (pass-through bytes are the output;
            # re-encodes to --max-size/--quality are rarely larger). The exact check follows validation.
            kept = sum(i["bytes"] for i in done.values())
            est = sum(c[2] + _TAR_OVERHEAD_PER_SAMPLE for c in scan.candidates) - kept
            _check_free_space(dest, est, cfg)
            order = list(range(len(scan.candidates)))
            random.Random(cfg.seed).shuffle(order)
            try:
                results = _validate(scan, src, state, opts, pool, bar, order)
            except OSError as exc:
                cached = _cache_bytes(state)
                _clear_cache(state)  # useless without a plan: give the space back
                raise _os_error(exc, cfg, est, cache_deleted=cached) from None
            plan = _make_plan(cfg, scan, results, fingerprint, options, order)
            _check_empty(cfg, plan["classes"], plan["class_counts"], warn, after_validation=True)
            from gpufeed.records import atomic_write_bytes

            try:
                atomic_write_bytes(os.path.join(state, PLAN_NAME), json.dumps(plan).encode("utf-8"))
            except OSError as exc:
                raise _os_error(exc, cfg, None, cache_kept=_cache_bytes(state)) from None
        else:
            bar.note("resume: the plan matches; validation skipped")
            _check_empty(cfg, plan["classes"], plan["class_counts"], warn, after_validation=True)
        validate_s = time.perf_counter() - t_val

        # ---- write
        t_w = time.perf_counter()
        names = [s["name"] for s in plan["shards"]]
        if not resumed or not done:
            for name in names:
                info = _shard_complete(dest, name)
                if info is not None:
                    done[name] = info
        todo = [s for s in plan["shards"] if s["name"] not in done]
        # Each transcode cache file is deleted once every shard that reads it is written, so DEST peaks near
        # the output size: the cache turns into shards as they are written.
        users: dict[str, int] = {}
        for s in todo:
            for c in s["caches"]:
                users[c] = users.get(c, 0) + 1
        for name in os.listdir(state):
            if name.startswith("enc-") and name.endswith(".bin") and name not in users:
                os.unlink(os.path.join(state, name))
        cached = sum(os.path.getsize(os.path.join(state, c)) for c in users)
        in_flight = sum(sorted((s["cache_bytes"] for s in todo), reverse=True)[:workers])
        need = max(0, sum(s["est_bytes"] for s in todo) - cached) + in_flight
        _check_free_space(dest, need, cfg, cached)
        for leftover in os.listdir(dest):
            if leftover.startswith(".") and leftover.endswith(".tar.tmp") or _atomic_leftover(leftover):
                os.unlink(os.path.join(dest, leftover))
        samples = plan["samples"]
        tasks = []
        for s in todo:
            rows = [samples[i] for i in s["samples"]]
            tasks.append((s["name"], [
                (r["key"], os.path.join(src, r["path"]), r["label"], plan["classes"][r["label"]], r["source"],
                 r["action"], r["orientation"], r["ext"], r["width"], r["height"], r["sha256"], r["bytes"],
                 None if r["enc"] is None else (os.path.join(state, r["enc"][0]), *r["enc"][1:]), r.get("ident"))
                for r in rows], sum(r["bytes"] for r in rows)))
        caches_of = {s["name"]: s["caches"] for s in todo}

        def shard_done(name: str) -> None:
            for c in caches_of[name]:
                users[c] -= 1
                if users[c] == 0:
                    try:
                        os.unlink(os.path.join(state, c))
                    except FileNotFoundError:
                        pass

        try:
            written = _write_all(dest, tasks, opts, pool, bar, shard_done, workers=workers)
        except OSError as exc:
            raise _os_error(exc, cfg, need, cache_kept=_cache_bytes(state)) from None
        done.update(written)
        write_s = time.perf_counter() - t_w
    finally:
        bar.close()
        if pool is not None:
            pool[0].shutdown(wait=True, cancel_futures=True)

    # ---- index, timm info, manifest (last)
    infos = [done[n] for n in names]
    try:
        manifest = _finish(dest, cfg, plan, infos, options)
    except OSError as exc:
        raise _os_error(exc, cfg, None, shards_done=len(infos)) from None
    _clear_cache(state)  # the transcode cache is only needed until every shard is complete
    input_bytes = sum(r["bytes"] for r in plan["samples"])
    elapsed = time.perf_counter() - t0
    # Rates count what this run wrote (a resume that keeps every shard converts nothing).
    n_written = sum(i["num_samples"] for i in written.values())
    in_written = sum(plan["samples"][j]["bytes"] for s in todo if s["name"] in written for j in s["samples"])
    transforms: dict[str, int] = {}
    for r in plan["samples"]:
        transforms[r["action"]] = transforms.get(r["action"], 0) + 1
    rejected = [FileIssue(**i) for i in plan["rejected"]]
    ignored = scan.ignored
    if rejected:
        warn.append(f"{len(rejected)} file(s) rejected")
    return ShardReport(
        src=src, dest=dest, prefix=cfg.prefix, num_classes=len(plan["classes"]),
        num_samples=len(plan["samples"]), num_rejected=len(rejected), num_ignored=len(ignored),
        num_shards=len(names), num_shards_written=len(written), num_shards_skipped=len(names) - len(written),
        total_bytes=manifest.total_bytes, input_bytes=input_bytes,
        written_samples=n_written, written_bytes=sum(i["bytes"] for i in written.values()),
        written_input_bytes=in_written, elapsed_s=elapsed, validate_s=validate_s,
        write_s=write_s, samples_per_s=n_written / elapsed if elapsed > 0 else 0.0,
        mb_per_s=in_written / 1e6 / elapsed if elapsed > 0 else 0.0, workers=workers, strict=cfg.strict,
        resumed=resumed, transforms=dict(sorted(transforms.items())),
        num_exif_oriented=sum(1 for r in plan["samples"] if r["orientation"] != 1),
        classes=list(plan["classes"]), empty_classes=list(plan["empty_classes"]), warnings=warn,
        rejected=rejected, ignored=ignored, shards=names, url_pattern=manifest.url_pattern,
        manifest=os.path.join(dest, "manifest.json"),
    )


def _preload_finish_imports() -> None:
    """Import pyarrow (~0.15 s with numpy) in a thread while the workers validate, instead of on the serial tail
    before ``index.parquet`` (after the pool is started: it forks only while this process has one thread)."""
    import threading

    def load() -> None:
        try:
            import pyarrow.parquet  # noqa: F401
        except Exception:  # noqa: BLE001 - _finish imports it again and reports the error there
            pass

    threading.Thread(target=load, name="gpufeed-preload", daemon=True).start()


def _atomic_leftover(name: str) -> bool:
    """A temporary file that ``records.atomic_write_bytes`` left in DEST when a run was killed mid-write."""
    return name.endswith(".tmp") and name.startswith(tuple(f".{n}." for n in ("manifest.json", "index.parquet",
                                                                               "_info.json")))


def _clear_cache(state: str) -> None:
    """Delete the transcode cache files and the temporary files of interrupted atomic writes in the state folder."""
    for name in os.listdir(state):
        if (name.startswith("enc-") and name.endswith(".bin")) or (name.startswith(".") and name.endswith(".tmp")):
            os.unlink(os.path.join(state, name))


def _amount(nbytes: int) -> str:
    """Bytes for a message: MB (1e6) from 0.1 MB up, else the byte count (never "0.0 MB")."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes} bytes"


def _cache_bytes(state: str) -> int:
    """Bytes of the transcode cache files (``enc-*.bin``, re-encoded images awaiting their shards) in ``state``."""
    total = 0
    for name in os.listdir(state):
        if name.startswith("enc-") and name.endswith(".bin"):
            try:
                total += os.path.getsize(os.path.join(state, name))
            except OSError:
                pass
    return total


def _os_error(exc: OSError, cfg: ShardConfig, need: int | None, *, cache_deleted: int = 0, cache_kept: int = 0,
              shards_done: int = 0) -> DataError:
    """An OS error while writing DEST (or reading SRC) as one sentence naming the path and the reason.

    DEST full: ``need`` is the estimate of the bytes the job still had to write (None: not known, e.g. the index
    and manifest after the shards); ``cache_deleted``/``cache_kept`` are the bytes of gpufeed's own transcode cache
    under DEST/.gpufeed that took part of the space (deleted now / kept for the re-run); ``shards_done`` counts
    complete shards a re-run keeps."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(cfg.dest).free
        except OSError:
            free = 0
        if need is None:
            what = "the job could not finish"
            if shards_done:
                what += f" writing the index and manifest after its {shards_done} complete shard(s), which a re-run keeps"
            counts = f"{free} bytes free"
        else:
            what = f"the job needed about {_amount(need)} more"
            counts = f"{need} bytes needed, {free} bytes free"
        cache = ""
        if cache_deleted:
            cache = (f"; {_amount(cache_deleted)} of the space was gpufeed's own transcode cache of re-encoded "
                     f"images under {os.path.join(cfg.dest, STATE_DIR)}, now deleted (re-encoding needs room for "
                     f"that cache and the shards)")
        elif cache_kept:
            cache = (f"; {_amount(cache_kept)} of it is gpufeed's own transcode cache of re-encoded images under "
                     f"{os.path.join(cfg.dest, STATE_DIR)}, kept for the re-run (each file is deleted once its "
                     f"shards are written)")
        return DataError(
            f"DEST {cfg.dest} is full ({exc.strerror}): {what}, {_amount(free)} are free now ({counts}){cache}; "
            f"free space or choose another DEST, then re-run"
        )
    where = exc.filename if exc.filename is not None else cfg.dest
    return DataError(f"{os.fsdecode(where)}: {exc.strerror or exc} (while sharding into {cfg.dest})")


def _check_empty(cfg: ShardConfig, classes: list[str], counts: list[int], warn: list[str],
                 after_validation: bool = False, duplicates: list[int] | None = None) -> None:
    """Refuse empty classes (or keep them with a warning). ``duplicates``: per class, the files rejected as the
    same file as one stored under another path (an empty class of only those is a symlink to another class)."""
    empty = [c for c, n in zip(classes, counts) if n == 0]
    if not empty:
        return
    what = "has no valid image after validation" if after_validation else "holds no image file"
    shown = ", ".join(empty[:5]) + (f" and {len(empty) - 5} more" if len(empty) > 5 else "")
    dup = [f"{c} ({duplicates[classes.index(c)]})" for c in empty if duplicates and duplicates[classes.index(c)]]
    why = (f" of its own (only files already stored under another path, symlinks or hard links: "
           f"{', '.join(dup[:5])})" if dup else "")
    if not cfg.allow_empty_classes:
        raise DataError(
            f"class folder(s) {shown} {what}{why}; remove them or pass --allow-empty-classes to keep their labels"
        )
    for c in empty:
        msg = f"class {c!r} (label {classes.index(c)}) is empty; its label is kept (no renumbering)"
        if msg not in warn:
            warn.append(msg)


def _our_outputs(dest: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(dest)):
        if name in ("manifest.json", "index.parquet", "_info.json", STATE_DIR) or _SHARD_RE.match(name) \
                or (name.startswith(".") and name.endswith(".tar.tmp")):
            out.append(name)
    return out


def _load_plan(dest: str, fingerprint: str, cfg: ShardConfig) -> dict[str, Any] | None:
    """The stored plan when it matches; refuse a different one unless overwrite (then clear our files)."""
    if not os.path.isdir(dest):
        return None
    plan_path = os.path.join(dest, STATE_DIR, PLAN_NAME)
    existing = _our_outputs(dest)
    if not [n for n in existing if n != STATE_DIR and not n.endswith(".tar.tmp")] and not os.path.exists(plan_path):
        # Only leftovers of a run interrupted before its plan was saved: start afresh.
        for name in existing:
            _remove(dest, name)
        return None
    if os.path.exists(plan_path):
        try:
            plan = json.loads(Path(plan_path).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            plan = None
        if plan is not None and plan.get("fingerprint") == fingerprint:
            return plan
        why = "was planned from different input files or options"
    else:
        why = "already holds a shard set not written by this command"
    if not cfg.overwrite:
        raise DataError(f"DEST {cfg.dest} {why}; re-run with --overwrite to replace it")
    # Manifest first, so a half-cleared folder is never taken for a complete set.
    for name in ["manifest.json"] + [n for n in existing if n != "manifest.json"]:
        _remove(dest, name)
    return None


def _remove(dest: str, name: str) -> None:
    """Remove one of our outputs; the state folder keeps its lock file (held by this run)."""
    p = os.path.join(dest, name)
    if name == STATE_DIR:
        for inner in os.listdir(p):
            if inner != LOCK_NAME:
                q = os.path.join(p, inner)
                shutil.rmtree(q) if os.path.isdir(q) and not os.path.islink(q) else os.unlink(q)
    elif os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)


def _check_free_space(dest: str, est_bytes: int, cfg: ShardConfig, cached: int = 0) -> None:
    """Refuse when DEST lacks ``est_bytes`` (+2% and 16 MB); ``cached``: bytes of gpufeed's transcode cache already
    in DEST/.gpufeed (the estimate counts it as space the shards get back as they are written)."""
    if est_bytes <= 0:
        return
    needed = int(est_bytes * 1.02) + (16 << 20)
    free = shutil.disk_usage(dest).free
    if free < needed:
        cache = (f"; {_amount(cached)} of DEST is gpufeed's own transcode cache of re-encoded images under "
                 f"{os.path.join(cfg.dest, STATE_DIR)}, which the shards replace as they are written" if cached else "")
        raise DataError(
            f"DEST {cfg.dest} has {_amount(free)} free but the shards need about {_amount(needed)} "
            f"({needed} bytes needed, {free} bytes free){cache}; free space or choose another DEST"
        )


def _make_plan(cfg: ShardConfig, scan: _Scan, results: list[tuple], fingerprint: str,
               options: dict[str, Any], shuffled: list[int]) -> dict[str, Any]:
    """The plan: accepted samples (keys in sorted order), split into shards following ``shuffled`` (the seeded
    permutation of the candidates; the accepted ones in that order are a seeded shuffle of the accepted list)."""
    accepted = []
    rejected = list(scan.rejected)
    position: dict[int, int] = {}
    for c, ((rel, label, size, _mtime), res) in enumerate(zip(scan.candidates, results)):
        ok, what, fmt, w, h, orientation, enc, digest, ident = res
        if not ok:
            rejected.append(FileIssue(_display(rel), what))
            continue
        position[c] = len(accepted)
        sample = {"source": _display(rel), "path": rel, "label": label, "bytes": size, "action": what,
                  "ext": _EXT.get(fmt, ""),
                  "width": w, "height": h, "orientation": orientation, "enc": None, "est_bytes": size,
                  "sha256": digest, "ident": None if ident is None else list(ident)}
        if enc is not None:
            sample["enc"] = list(enc)  # [cache file, offset, length, ext, width, height]
            sample["est_bytes"] = enc[2]
        accepted.append(sample)
    rejected.sort(key=lambda i: i.path)
    counts = [0] * len(scan.classes)
    for a in accepted:  # already sorted by (label, source)
        a["key"] = f"{a['label']:05d}_{counts[a['label']]:07d}"
        counts[a["label"]] += 1
    if not accepted:
        raise DataError(f"SRC {cfg.src} holds no valid image ({len(rejected)} rejected)")
    order = [position[c] for c in shuffled if c in position]
    est_total = sum(a["est_bytes"] + _TAR_OVERHEAD_PER_SAMPLE for a in accepted)
    n_shards = plan_num_shards(len(accepted), est_total, cfg)
    if n_shards > len(accepted):
        raise DataError(
            f"{n_shards} shards (a multiple of --multiple-of {cfg.multiple_of}) need at least {n_shards} images, "
            f"but only {len(accepted)} were accepted; lower --multiple-of"
        )
    shards = []
    pos = 0
    for name, k in zip(_shard_names(cfg.prefix, n_shards), split_sizes(len(accepted), n_shards)):
        idx = order[pos:pos + k]
        pos += k
        caches = sorted({accepted[i]["enc"][0] for i in idx if accepted[i]["enc"] is not None})
        shards.append({"name": name, "samples": idx,
                       "est_bytes": sum(accepted[i]["est_bytes"] + _TAR_OVERHEAD_PER_SAMPLE for i in idx),
                       "caches": caches,
                       "cache_bytes": sum(accepted[i]["enc"][2] for i in idx if accepted[i]["enc"] is not None)})
    return {"plan_version": PLAN_VERSION, "fingerprint": fingerprint, "options": options,
            "classes": scan.classes, "class_counts": counts,
            "empty_classes": [c for c, n in zip(scan.classes, counts) if n == 0],
            "samples": accepted, "shards": shards, "rejected": [i.__dict__ for i in rejected],
            "warnings": []}


def _finish(dest: str, cfg: ShardConfig, plan: dict[str, Any], infos: list[dict[str, Any]],
            options: dict[str, Any]) -> Any:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpufeed import __version__
    from gpufeed.manifest import INDEX_NAME, TIMM_INFO_NAME, Manifest, ShardInfo, brace_pattern, write_manifest
    from gpufeed.records import atomic_write_bytes

    by_key = {s["key"]: s for s in plan["samples"]}
    cols: dict[str, list[Any]] = {c: [] for c in ("key", "shard", "class", "label", "source", "bytes",
                                                    "width", "height")}
    for info in infos:
        for key, nbytes, w, h in info["rows"]:
            s = by_key[key]
            cols["key"].append(key)
            cols["shard"].append(info["name"])
            cols["class"].append(plan["classes"][s["label"]])
            cols["label"].append(s["label"])
            cols["source"].append(s["source"])
            cols["bytes"].append(nbytes)
            cols["width"].append(w)
            cols["height"].append(h)
    table = pa.table({
        "key": pa.array(cols["key"], pa.string()), "shard": pa.array(cols["shard"], pa.string()),
        "class": pa.array(cols["class"], pa.string()), "label": pa.array(cols["label"], pa.int64()),
        "source": pa.array(cols["source"], pa.string()), "bytes": pa.array(cols["bytes"], pa.int64()),
        "width": pa.array(cols["width"], pa.int32()), "height": pa.array(cols["height"], pa.int32()),
    })
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    atomic_write_bytes(os.path.join(dest, INDEX_NAME), buf.getvalue().to_pybytes())

    names = [i["name"] for i in infos]
    shard_infos = [ShardInfo(name=i["name"], num_samples=i["num_samples"], bytes=i["bytes"], sha256=i["sha256"])
                   for i in infos]
    total = sum(i["bytes"] for i in infos)
    n = sum(i["num_samples"] for i in infos)
    timm = {"name": os.path.basename(dest.rstrip("/")) or "gpufeed", "num_classes": len(plan["classes"]),
            "splits": {cfg.prefix: {"name": cfg.prefix, "num_samples": n, "filenames": names,
                                    "shard_lengths": [i["num_samples"] for i in infos]}}}
    atomic_write_bytes(os.path.join(dest, TIMM_INFO_NAME), (json.dumps(timm, indent=2) + "\n").encode())
    manifest = Manifest(
        prefix=cfg.prefix, classes=list(plan["classes"]), shards=shard_infos, num_samples=n,
        num_rejected=len(plan["rejected"]), total_bytes=total, mean_sample_bytes=total / n if n else 0.0,
        url_pattern=brace_pattern(names), options=options, created_by="gpufeed shard",
        gpufeed_version=__version__,
    )
    write_manifest(dest, manifest)  # last: its presence means the set is complete
    return manifest


# --------------------------------------------------------------------------- parallel plumbing


class _Bar:
    """One tqdm bar on stderr: samples/s, plus MB/s in the postfix."""

    def __init__(self, enabled: bool) -> None:
        self.bar = None
        self.enabled = enabled
        self.t0 = time.perf_counter()
        self.mb = 0.0

    def start(self, desc: str, total: int) -> None:
        if not self.enabled:
            return
        from tqdm import tqdm

        if self.bar is None:
            self.bar = tqdm(total=total, desc=desc, unit="img", file=sys.stderr, dynamic_ncols=True,
                            smoothing=0.1)
        else:
            self.bar.reset(total=total)
            self.bar.set_description(desc)
        self.t0 = time.perf_counter()
        self.mb = 0.0

    def update(self, n: int, nbytes: int = 0) -> None:
        if self.bar is None:
            return
        self.mb += nbytes / 1e6
        self.bar.update(n)
        dt = time.perf_counter() - self.t0
        if dt > 0:
            self.bar.set_postfix_str(f"{self.mb / dt:.1f} MB/s", refresh=False)

    def note(self, text: str) -> None:
        if self.enabled:
            print(text, file=sys.stderr)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
            self.bar = None


def _make_pool(workers: int, lock_fd: int) -> tuple[cf.ProcessPoolExecutor, Any]:
    """A process pool (fork where safe, else spawn), started at once so its start-up overlaps the scan. Its
    workers die with this process and do not keep the DEST lock (``system.die_with_parent``)."""
    import multiprocessing as mp

    import threading

    from gpufeed.system import die_with_parent

    # fork starts in milliseconds but is only safe while this process runs a single thread; ProcessPoolExecutor
    # forks every worker at the first submit, which happens right here. Otherwise spawn (slower, always safe).
    method = "fork" if sys.platform == "linux" and threading.active_count() == 1 else "spawn"
    # Only a forked worker inherits the lock descriptor (spawn starts a fresh program; the fd is close-on-exec).
    inherited = (lock_fd,) if method == "fork" else ()
    ex = cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context(method),
                                initializer=die_with_parent, initargs=(os.getpid(), inherited))
    ex.submit(_noop)  # start the workers now (spawn: their start-up overlaps the scan)
    return ex, None


def _noop() -> None:
    return None


def _validate(scan: _Scan, src: str, state: str, opts: dict[str, Any], pool: Any, bar: _Bar,
              order: list[int]) -> list[tuple]:
    """Validate the candidates in the seeded shard order (so each transcode cache file feeds one or a few
    consecutive shards and can be deleted once they are written); results in candidate order."""
    paths = [os.path.join(src, scan.candidates[k][0]) for k in order]
    sizes = [scan.candidates[k][2] for k in order]
    bar.start("validate", len(paths))
    chunks = [(i, paths[i:i + _CHUNK]) for i in range(0, len(paths), _CHUNK)]
    results: list[Any] = [None] * len(chunks)
    cache = [f"enc-{j:06d}.bin" for j in range(len(chunks))]
    if pool is None:
        for j, (i, chunk) in enumerate(chunks):
            results[j] = _validate_chunk(chunk, opts, os.path.join(state, cache[j]))
            bar.update(len(chunk), sum(sizes[i:i + len(chunk)]))
    else:
        ex = pool[0]
        futs = {ex.submit(_validate_chunk, chunk, opts, os.path.join(state, cache[j])): (j, i, len(chunk))
                for j, (i, chunk) in enumerate(chunks)}
        for fut in cf.as_completed(futs):
            j, i, k = futs[fut]
            results[j] = fut.result()
            bar.update(k, sum(sizes[i:i + k]))
    out: list[Any] = [None] * len(order)
    pos = 0
    for j, chunk_results in enumerate(results):
        for r in chunk_results:
            out[order[pos]] = r if r[6] is None else r[:6] + ((cache[j], *r[6]),) + r[7:]
            pos += 1
    return out


def _write_all(dest: str, tasks: list[tuple], opts: dict[str, Any], pool: Any, bar: _Bar,
               on_done: Callable[[str], None] = lambda name: None, workers: int = 1) -> dict[str, Any]:
    """Write the shards: every shard is split into runs of consecutive samples written in parallel at their
    offsets (``_write_range``, in the worker processes, or one thread without a pool), while one thread per
    shard hashes it in order as its runs complete; a shard is renamed once written and hashed. Several shards
    are in flight at once, so a one-shard plan uses every worker too."""
    total = sum(len(t[1]) for t in tasks)
    bar.start("write", total)
    out: dict[str, Any] = {}
    if not tasks:
        return out
    own = pool is None
    ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufeed-write") if own else pool[0]
    hashers = cf.ThreadPoolExecutor(max_workers=max(2, workers), thread_name_prefix="gpufeed-sha256")
    depth = 2 * max(1, workers)  # write tasks in flight
    pending = iter(tasks)
    jobs: list[_ShardJob] = []  # opened, not yet finished
    current: _ShardJob | None = None
    running: dict[Any, tuple[_ShardJob, int]] = {}
    hashing: dict[Any, _ShardJob] = {}
    try:
        while True:
            while len(running) < depth:
                if current is None or current.submitted == len(current.ranges):
                    if len(jobs) >= max(1, workers):  # as many shards in flight as workers (DEST space check)
                        break
                    nxt = next(pending, None)
                    if nxt is None:
                        break
                    current = _ShardJob(dest, nxt[0], nxt[1])
                    jobs.append(current)
                    fut = hashers.submit(_hash_file_ranges, current.tmp, current.blocks)
                    hashing[fut] = current
                i = current.submitted
                running[ex.submit(_write_range, current.tmp, current.ranges[i][0])] = (current, i)
                current.submitted += 1
            if not running and not hashing:
                break
            finished, _ = cf.wait(list(running) + list(hashing), return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                if fut in running:
                    job, i = running.pop(fut)
                    fut.result()
                    job.range_done(i)
                    items, _end, nbytes = job.ranges[i]
                    bar.update(len(items), nbytes)
                else:
                    job = hashing.pop(fut)
                    out[job.name] = _finish_shard(dest, job, fut.result())
                    jobs.remove(job)
                    on_done(job.name)
    except BaseException:
        for fut in running:
            fut.cancel()
        for job in jobs:
            job.abort()
        raise
    finally:
        hashers.shutdown(wait=True)
        if own:
            ex.shutdown(wait=True)
    return out


# --------------------------------------------------------------------------- rendering


def render_shard(report: ShardReport, max_items: int = 20) -> str:
    """A short human summary: converted, rejected (file + reason), ignored (file + reason), shards, bytes."""
    r = report
    lines = [
        f"converted {r.num_samples} images in {r.num_classes} classes -> {r.num_shards} shards "
        f"({r.url_pattern}) in {r.dest}",
        f"  set: {r.total_bytes / 1e6:.1f} MB in {r.num_shards} shards from {r.input_bytes / 1e6:.1f} MB input",
        f"  this run: {r.num_shards_written} shard(s), {r.written_samples} images, {r.written_bytes / 1e6:.1f} MB "
        f"written in {r.elapsed_s:.1f} s ({r.samples_per_s:.0f} images/s, {r.mb_per_s:.1f} MB/s input, "
        f"{r.workers} workers; validate {r.validate_s:.1f} s, write {r.write_s:.1f} s)",
    ]
    if r.resumed:
        lines.append(f"  resumed: {r.num_shards_skipped} complete shard(s) kept, {r.num_shards_written} written")
    stored = ", ".join(f"{k} {v}" for k, v in r.transforms.items())
    lines.append(f"  stored: {stored}; EXIF orientation recorded, not applied: {r.num_exif_oriented}")
    for title, items in (("rejected", r.rejected), ("ignored", r.ignored)):
        lines.append(f"  {title}: {len(items)}")
        for it in items[:max_items]:
            lines.append(f"    {it.path}: {it.reason}")
        if len(items) > max_items:
            lines.append(f"    ... and {len(items) - max_items} more (see --json)")
    for w in r.warnings:
        lines.append(f"  warning: {w}")
    if not r.ok:
        lines.append(f"FAILED (--strict): {r.num_rejected} file(s) rejected")
    return "\n".join(lines)
