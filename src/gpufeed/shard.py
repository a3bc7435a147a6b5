"""``gpufeed shard SRC DEST``: an ImageFolder -> deterministic WebDataset tar shards + manifest.

Pipeline (the format it writes: docs/design.md §2): scan -> validate (parallel, batched per task) -> plan
(seeded shuffle, N equal shards) -> write -> ``index.parquet``, timm's ``_info.json`` and, last and atomically, ``manifest.json``.
No torch import anywhere on this path.

Writing: with at least two shards a worker, each worker writes and hashes whole shards, from the plan's
columns for that shard. With fewer (a 3,000-image folder plans one shard), writing is parallel within a shard:
tar blocks are position-independent and every header follows from the plan, so the main process computes each
member's offset, creates the shard's temporary file at its final size (holes read as the zero padding and
end-of-archive blocks), and the workers write runs of consecutive samples at their offsets (one ``pwrite`` of the
run's members, image bytes over 1 MiB by ``sendfile``) while a thread of the main process hashes the file in order
as the runs complete. Either
way a file is renamed only once fully written and hashed, and the bytes are the same for any ``--workers``.

The plan is columnar (numpy arrays and one blob of file names, ~140 bytes a sample plus its path), never a
Python object per sample; records are built one shard at a time. ``--check header`` reads plain JFIF headers
itself (``_plain_jpeg_size``) and leaves every other file to Pillow.

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
plus the validated sample list) is kept in ``DEST/.gpufeed/plan.json`` (metadata) and ``plan.bin`` (the samples
as columns: 137 bytes a sample plus its path, in memory as on disk; plan.json records its sha256 and a plan that
does not check out is treated as a different plan); each completed shard leaves
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
input.

Disk space
----------
The candidates are validated in the seeded shard order (the accepted ones in that order are the shuffled
list), so each transcode cache file ``DEST/.gpufeed/enc-*.bin`` (``--max-size``/``--quality``/CMYK/16-bit/...)
feeds one or a few consecutive shards and is deleted as soon as they are written: DEST peaks near the output
size. Free space is checked before anything is written (estimate: the input bytes) and again, exactly, before
the shards are written. Any OS error (DEST full included) is one sentence naming path and reason: a ``DataError``
(exit 2) before the shards are written, a ``RunError`` (exit 1) once writing them has begun, as is a source file
that changed since validation.

Names
-----
Class folder names and file paths are recorded (manifest, ``.json``, ``index.parquet``, report) with bytes that
are not UTF-8 replaced by U+FFFD; files are read under their real names; labels follow the real names' order.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import itertools
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
from typing import Any, Callable, NamedTuple

from gpufeed.config import ShardConfig
from gpufeed.errors import DataError, GpufeedError, RunError
from gpufeed.shardset.tar import ustar_header

CANDIDATE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision ImageFolder's IMG_EXTENSIONS: the files considered images (matched case-insensitively)."""
STATE_DIR = ".gpufeed"
PLAN_NAME = "plan.json"
PLAN_VERSION = 3  # 2: validation and shards follow one seeded order; per-shard transcode caches; 3: columnar
LOCK_NAME = "lock"
DEFAULT_REENCODE_QUALITY = 90
CMYK_QUALITY = 95
_SHARD_RE = re.compile(r"^[A-Za-z0-9_-]+-\d{6}\.tar$")
_CACHE_RE = re.compile(r"^enc-\d{6,}\.bin$")
_CHUNK = 32  # files per validation task: amortises IPC, small enough for a smooth bar and balance
_HEADER_CHUNK = 512  # the same for --check header without re-encoding options (no decode: ~20 us a file)
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
    """The earlier run's plan was used as it was (validation skipped); complete shards can be kept without it."""
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


class _Strings:
    """A column of file names kept as one bytes blob plus offsets (``os.fsencode``d, so names that are not UTF-8
    round-trip): ~N + 8 bytes a name instead of a Python ``str`` object each."""

    def __init__(self, blob: bytes, offsets: Any) -> None:
        self.blob = blob
        self.offsets = offsets  # numpy int64, len(self) + 1, non-decreasing, from 0 to len(blob)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return os.fsdecode(self.blob[self.offsets[i]:self.offsets[i + 1]])

    def take(self, idx: Any) -> _Strings:
        import numpy as np

        o = self.offsets
        parts = [self.blob[o[i]:o[i + 1]] for i in idx]
        lengths = np.fromiter((len(b) for b in parts), np.int64, len(parts))
        return _Strings(b"".join(parts), np.concatenate(([0], np.cumsum(lengths))).astype(np.int64))


@dataclass
class _Scan:
    classes: list[str]
    """Class names as recorded (``_display``: non-UTF-8 bytes become U+FFFD), in label order."""
    paths: _Strings
    """Candidate files (relative to SRC, real names), sorted by (label, path); the arrays below follow them."""
    labels: Any  # numpy int32
    sizes: Any  # numpy int64
    mtimes: Any  # numpy int64 (st_mtime_ns); None once the fingerprint is taken (nothing else reads them)
    ignored: list[FileIssue]
    rejected: list[FileIssue]
    class_counts: list[int]
    dirs: list[str] = field(default_factory=list)
    """The class folders' real names (file system access), in label order."""
    duplicates: list[int] = field(default_factory=list)
    """Per class: files rejected because the same file (device, inode) is already stored under another path."""

    def __len__(self) -> int:
        return len(self.labels)


def _rel(path: str, root: str) -> str:
    return _display(os.path.relpath(path, root))


def _display(rel: str) -> str:
    """Relative path as recorded: '/' separators; bytes that are not UTF-8 become U+FFFD (the file is still read
    under its real name, which the plan keeps)."""
    return rel.replace(os.sep, "/").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


class _Found(NamedTuple):
    """A candidate file as the walk finds it."""

    raw: str
    """Path relative to SRC, real name."""
    size: int
    mtime_ns: int
    dev: int
    ino: int
    via_link: bool
    """Reached through a symlink (file or folder)."""


def _scan(src: str) -> _Scan:
    import numpy as np
    from array import array

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
    # Columns, in (label, path) order: one class' walk at a time is held as records, then appended here,
    # column by column.
    blob, ends = bytearray(), array("q")
    labels, sizes, mtimes, devs, inos, via = array("i"), array("q"), array("q"), array("Q"), array("Q"), bytearray()
    for label, name in enumerate(classes):
        found: list[_Found] = []
        _walk_class(src, os.path.join(src, name), found, ignored, rejected)
        if not found:
            continue
        found.sort(key=lambda f: f.raw)
        raw, size, mtime, dev, ino, link = zip(*found)
        del found
        names = [os.fsencode(r) for r in raw]
        cum = itertools.accumulate(map(len, names), initial=len(blob))
        next(cum)  # the initial value: the previous end
        ends.extend(cum)
        blob += b"".join(names)
        labels.extend([label] * len(raw))
        sizes.extend(size)
        mtimes.extend(mtime)
        devs.extend(dev)
        inos.extend(ino)
        via.extend(link)
        del raw, size, mtime, dev, ino, link, names
    paths = _Strings(bytes(blob), np.concatenate(([0], np.frombuffer(ends, np.int64))).astype(np.int64))
    del blob, ends
    lab = np.frombuffer(labels, np.int32).copy()
    keep, duplicates = _store_once(paths, lab, np.frombuffer(devs, np.uint64), np.frombuffer(inos, np.uint64),
                                   np.frombuffer(via, np.uint8), rejected, len(classes))
    siz, mt = np.frombuffer(sizes, np.int64).copy(), np.frombuffer(mtimes, np.int64).copy()
    if keep is not None:
        paths, lab, siz, mt = paths.take(keep), lab[keep], siz[keep], mt[keep]
    counts = np.bincount(lab, minlength=len(classes)).tolist()
    ignored.sort(key=lambda i: i.path)
    shown = [_display(c) for c in classes]  # sorted by the real names, as ImageFolder sorts them
    if len(set(shown)) != len(shown):
        dup = sorted({c for c in shown if shown.count(c) > 1})
        raise DataError(f"class folders whose names are not valid UTF-8 read the same once shown ({', '.join(dup)}); "
                        f"rename them")
    return _Scan(shown, paths, lab, siz, mt, ignored, rejected, counts, dirs=classes, duplicates=duplicates)


def _store_once(paths: _Strings, labels: Any, devs: Any, inos: Any, via: Any, rejected: list[FileIssue],
                num_classes: int) -> tuple[Any, list[int]]:
    """Every file once: paths that reach the same file (device, inode) through symlinks or hard links, in one
    class or several, keep one path (one reached without a symlink first, then the lowest label, then the path);
    the others are rejected naming it. The candidates are in (label, path) order, so the rule is the lowest
    (via_link, position). -> (indices to keep, or None when all are kept; duplicates per class)."""
    import numpy as np

    n = len(labels)
    pos = np.arange(n, dtype=np.int64)
    order = np.lexsort((pos, via, inos, devs))  # by device, inode, then the keeping rule
    first = np.ones(n, dtype=bool)
    first[1:] = (devs[order][1:] != devs[order][:-1]) | (inos[order][1:] != inos[order][:-1])
    kept = np.empty(n, dtype=np.int64)
    kept[order] = order[first][np.cumsum(first) - 1]
    dup = np.nonzero(kept != pos)[0]
    duplicates = np.bincount(labels[dup], minlength=num_classes).tolist()
    if not len(dup):
        return None, duplicates
    for i in dup.tolist():
        k = int(kept[i])
        where = "" if labels[k] == labels[i] else " in another class"
        rejected.append(FileIssue(_display(paths[i]), f"same file as {_display(paths[k])}{where} (symlink or hard "
                                                      f"link); stored once"))
    return np.nonzero(kept == pos)[0], duplicates


def _walk_class(src: str, top: str, out: list[_Found], ignored: list, rejected: list) -> None:
    """Collect a class' candidate files into ``out``. Sub-folders are followed through symlinks, each folder (device, inode) once, so
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
        base = os.path.relpath(d, src) + os.sep  # + an entry's name = its path relative to SRC, real name
        for e in entries:
            name = e.name
            if name.startswith("."):
                ignored.append(FileIssue(_display(base + name), "hidden file or folder"))
                continue
            is_image_name = name.lower().endswith(CANDIDATE_EXTENSIONS)
            try:
                if e.is_dir():
                    subdirs.append((e.path, via_link or e.is_symlink()))
                    continue
                link = e.is_symlink()
                if link and not os.path.exists(e.path):
                    (rejected if is_image_name else ignored).append(FileIssue(_display(base + name),
                                                                              "dangling symlink"))
                    continue
                if not e.is_file():
                    ignored.append(FileIssue(_display(base + name), "not a regular file"))
                    continue
                if not is_image_name:
                    ext = os.path.splitext(name)[1] or "(none)"
                    ignored.append(FileIssue(_display(base + name), f"not an image file extension ({ext})"))
                    continue
                st = e.stat()
            except OSError as exc:
                rejected.append(FileIssue(_display(base + name), f"unreadable ({exc.strerror})"))
                continue
            if st.st_size == 0:
                rejected.append(FileIssue(_display(base + name), "empty file (0 bytes)"))
                continue
            out.append(_Found(base + name, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, via_link or link))
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


_SKIPPED_SEGMENTS = frozenset((0xC4, 0xDD, 0xFE))  # DHT, DRI, COM: Pillow reads them whole, nothing more


def _plain_jpeg_size(data: bytes, max_image_pixels: int) -> tuple[int, int] | None:
    """(width, height) of a plain JFIF/baseline or progressive 8-bit, 1- or 3-component JPEG whose header Pillow
    opens without a doubt, else None (then Pillow decides: its answer for every other file stays the rule).

    ``--check header`` spends most of its per-file time in Pillow's Python JPEG marker parser; for the common
    plain file this walks the same segments with the same checks Pillow makes (segment lengths within the data,
    quantization tables whole, one SOF with 8-bit samples and whole component records, a complete SOS
    segment), and gives up on anything else: other APPn segments (Exif, XMP and ICC profiles, MPF, Adobe),
    other SOF types, padding or junk between segments, a second SOF, no pixels, more than Pillow's
    ``MAX_IMAGE_PIXELS``. Such a file has no EXIF orientation (1), mode L or RGB, format JPEG."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8:
        return None
    pos = 2
    size = None
    while pos + 4 <= n:  # indices into ``data``, no slices: this runs once a file
        if data[pos] != 0xFF:
            return None
        marker = data[pos + 1]
        length = (data[pos + 2] << 8) | data[pos + 3]
        end = pos + 2 + length
        if length < 2 or end > n:
            return None
        if marker == 0xDA:  # start of scan: Pillow stops here
            if size is None:
                return None
            w, h = size
            return size if 0 < w * h <= max_image_pixels else None
        if marker == 0xDB:  # DQT: whole tables only
            k = pos + 4
            while k < end:
                qt = 1 + (64 if data[k] < 16 else 128)
                if end - k < qt:
                    return None
                k += qt
        elif marker in (0xC0, 0xC1, 0xC2):  # SOF
            if (size is not None or length < 8 or data[pos + 4] != 8 or data[pos + 9] not in (1, 3)
                    or (length - 8) % 3):
                return None
            size = ((data[pos + 7] << 8) | data[pos + 8], (data[pos + 5] << 8) | data[pos + 6])
        elif marker == 0xE0:  # APP0: Pillow reads the JFIF version at bytes 5-6
            if data.startswith(b"JFIF", pos + 4, end) and length < 9:
                return None
        elif marker not in _SKIPPED_SEGMENTS:
            return None
        pos = end
    return None


class _Encoded(NamedTuple):
    """A transcoded image: worker side, ``data`` holds its bytes; in a batch's result, ``data`` is its offset in
    the batch's cache file."""

    data: bytes | int
    length: int
    ext: str
    width: int
    height: int


class _Checked(NamedTuple):
    """One validated file."""

    ok: bool
    what: str
    """The reason (rejected) or the storage action (accepted)."""
    fmt: str | None
    width: int
    height: int
    orientation: int
    enc: _Encoded | None = None
    sha256: bytes = b""
    """Digest of the stored image bytes (accepted files)."""
    ident: tuple[int, int, int, int] | None = None
    """(size, mtime_ns, inode, device) of the opened source, for pass-through files."""


def _reject(reason: str, fmt: str | None = None, w: int = 0, h: int = 0, orientation: int = 1) -> _Checked:
    return _Checked(False, reason, fmt, w, h, orientation)


def _read_whole(path: str) -> tuple[bytes, os.stat_result]:
    """The file's bytes and its ``os.fstat`` once they are read: one read of the size ``fstat`` gives (plus one
    byte, to see a file that grew), more only when the size changed (then ``fstat`` again, after the reads)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        st = os.fstat(fd)
        data = os.read(fd, st.st_size + 1)
        if len(data) != st.st_size:
            parts = [data]
            while chunk := os.read(fd, 1 << 20):
                parts.append(chunk)
            data = b"".join(parts)
            st = os.fstat(fd)
        return data, st
    finally:
        os.close(fd)


def _inspect(path: str, opts: dict[str, Any]) -> _Checked:
    """Validate one file.

    ``ident`` is the opened file's identity (size, mtime_ns, inode, device) after reading it: the writer checks
    the source it copies against it instead of hashing the bytes a second time."""
    from PIL import Image, UnidentifiedImageError

    try:
        data, st = _read_whole(path)
    except OSError as exc:
        return _reject(f"unreadable ({exc.strerror or exc})")
    if not data:
        return _reject("empty file (0 bytes)")
    ident = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    if opts["check"] == "header" and opts["quality"] is None:
        size = _plain_jpeg_size(data, min(opts["max_pixels"], Image.MAX_IMAGE_PIXELS or opts["max_pixels"]))
        if size is not None and (opts["max_size"] is None or max(size) <= opts["max_size"]):
            return _Checked(True, "copy", "JPEG", size[0], size[1], 1, None, hashlib.sha256(data).digest(), ident)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = Image.open(io.BytesIO(data))
        except Image.DecompressionBombError as exc:
            return _reject(f"decompression bomb ({exc})")
        except UnidentifiedImageError:
            return _reject("not an image (content not recognised)")
        except Exception as exc:  # noqa: BLE001 - any parser failure is a per-file reject
            return _reject(f"unreadable image header ({type(exc).__name__}: {exc})")
        fmt, mode, (w, h) = im.format or "", im.mode, im.size
        if fmt == "MPO":  # multi-picture camera JPEGs: the stream is a baseline JPEG (first picture) plus extras
            fmt = "JPEG"
        if w <= 0 or h <= 0:
            return _reject(f"image has no pixels ({w}x{h})", fmt, w, h)
        if w * h > opts["max_pixels"]:
            return _reject(f"decompression bomb: {w}x{h} = {w * h} pixels > max_pixels {opts['max_pixels']}",
                           fmt, w, h)
        if fmt in ("JPEG", "PNG", "WEBP") and _detect(data) != fmt:
            return _reject(f"unsupported {fmt} variant", fmt, w, h)
        try:
            orientation = int(im.getexif().get(0x0112, 1) or 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block is not a broken image
            orientation = 1
        if not 0 <= orientation <= 0xFFFF:  # not an EXIF SHORT: a broken EXIF block too
            orientation = 1
        action = _action(fmt, mode, w, h, opts["max_size"], opts["quality"])
        try:
            if action != "copy":
                # Transcoding decodes the whole image (the validation) and its output is kept for the writer.
                out, ext, ow, oh = _encode(data, action, opts)
                return _Checked(True, action, fmt, w, h, orientation, _Encoded(out, len(out), ext, ow, oh),
                                hashlib.sha256(out).digest())
            if opts["check"] == "full":
                if fmt == "JPEG":
                    # Scaled IDCT: libjpeg still parses and entropy-decodes every coefficient of the whole
                    # bitstream (truncation and corrupt markers fail exactly as at full size), at ~half the cost.
                    im.draft(mode, (max(1, w // 8), max(1, h // 8)))
                im.load()
                if mode not in ("RGB", "L"):
                    im.convert("RGB")
        except Exception as exc:  # noqa: BLE001 - truncated / corrupt data is a per-file reject
            return _reject(f"decode failed ({type(exc).__name__}: {exc})", fmt, w, h, orientation)
    return _Checked(True, action, fmt, w, h, orientation, None, hashlib.sha256(data).digest(), ident)


def _validate_chunk(paths: list[str], opts: dict[str, Any], cache: str | None = None) -> dict[str, Any]:
    """Validate a batch of files -> their results as columns (``_batch_columns``). Transcoded outputs go to one
    cache file per batch."""
    results = []
    blobs = []
    offset = 0
    for p in paths:
        r = _inspect(p, opts)
        if r.enc is not None:
            blobs.append(r.enc.data)
            r = r._replace(enc=r.enc._replace(data=offset))
            offset += r.enc.length
        results.append(r)
    if blobs:
        assert cache is not None
        from gpufeed.records import atomic_write_bytes

        atomic_write_bytes(cache, b"".join(blobs))
    return _batch_columns(results)


def _batch_columns(results: list[_Checked]) -> dict[str, Any]:
    """A batch's results as numpy columns of its accepted files (``_COLUMNS``; ``enc_cache`` 0 marks a transcoded
    file, whose cache the main process numbers), ``ok`` per file and ``reasons`` {position: reason}: built in the
    worker, so the main process only scatters a few arrays per batch."""
    import numpy as np

    acc = [r for r in results if r.ok]
    none = _Encoded(0, 0, "", 0, 0)
    encs = [r.enc or none for r in acc]
    ids = [r.ident or (0, 0, 0, 0) for r in acc]
    values = {
        "action": [_ACTIONS.index(r.what) for r in acc],
        "ext": [_EXTS.index(_EXT.get(r.fmt or "", "")) for r in acc],
        "width": [r.width for r in acc], "height": [r.height for r in acc],
        "orientation": [r.orientation for r in acc],
        "sha256": np.frombuffer(b"".join(r.sha256 for r in acc), np.uint8).reshape(len(acc), 32),
        "id_size": [i[0] for i in ids], "id_mtime": [i[1] for i in ids], "id_ino": [i[2] for i in ids],
        "id_dev": [i[3] for i in ids], "enc_cache": [-1 if r.enc is None else 0 for r in acc],
        "enc_off": [e.data for e in encs], "enc_len": [e.length for e in encs],
        "enc_ext": [_EXTS.index(e.ext) for e in encs], "enc_w": [e.width for e in encs],
        "enc_h": [e.height for e in encs],
    }
    out: dict[str, Any] = {k: np.asarray(values[k], dtype=dt).reshape(len(acc), *shape)
                           for k, (dt, shape) in _COLUMNS.items()}
    out["ok"] = np.array([r.ok for r in results], dtype=bool)
    out["reasons"] = {i: r.what for i, r in enumerate(results) if not r.ok}
    return out


# --------------------------------------------------------------------------- writing (worker side)

_RANGE_BYTES = 8 << 20
"""Target bytes of one write task (a run of consecutive samples of one shard): small enough that hashing the
shard in order trails the writers by little, large enough to amortise the per-task IPC."""
_RANGE_SAMPLES = 256


def _padded(n: int) -> int:
    return n + (-n % 512)


def _pwrite_all(fd: int, data: bytes | memoryview, offset: int) -> None:
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view = view[n:]
        offset += n


def _changed(rel: str) -> RunError:
    return RunError(f"{rel} changed while sharding (it is not the file that was validated: size, mtime, inode "
                    f"or device differ, or its bytes do); re-run (with --overwrite when asked)")


def _open_source(path: str, rel: str, nbytes: int, ident: tuple[int, int, int, int]) -> int:
    """Open a pass-through source -> its descriptor, after checking that the opened file is the one validated
    (``os.fstat`` identity)."""
    sfd = os.open(path, os.O_RDONLY)
    st = os.fstat(sfd)
    if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev) != ident or st.st_size != nbytes:
        os.close(sfd)
        raise _changed(rel)
    return sfd


def _read_source(path: str, rel: str, nbytes: int, ident: tuple[int, int, int, int]) -> bytes:
    """A small pass-through source's bytes (``_open_source``'s check), for the write task's buffer."""
    sfd = _open_source(path, rel, nbytes, ident)
    try:
        data = os.read(sfd, nbytes)
        while len(data) < nbytes:
            more = os.read(sfd, nbytes - len(data))
            if not more:  # the file shrank after the check
                raise _changed(rel)
            data += more
        return data
    finally:
        os.close(sfd)


def _copy_source(fd: int, pos: int, path: str, rel: str, nbytes: int, ident: tuple[int, int, int, int]) -> None:
    """Copy a large pass-through source into the shard at ``pos`` (``sendfile``: no user-space copy), after
    ``_open_source``'s check."""
    sfd = _open_source(path, rel, nbytes, ident)
    try:
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


class _Item(NamedTuple):
    """One sample of a write task: its offset in the shard, member names and small members, and where its image
    bytes come from (``cache`` None: the source file ``path``, else ``cache`` at ``coff``)."""

    offset: int
    key: str
    ext: str
    img_len: int
    cls_b: bytes
    json_b: bytes
    path: str
    rel: str
    ident: tuple[int, int, int, int] | None
    cache: str | None
    coff: int


_INLINE_BYTES = 1 << 20
"""Image members up to this size are read into the write task's buffer, which goes out in one ``pwrite``; larger
ones are copied by ``sendfile``."""
_ZEROS = bytes(512)


def _member(name: str, payload: bytes) -> bytes:
    """A small member: header, bytes, zero padding to the next block."""
    return b"".join((ustar_header(name, len(payload)), payload, _ZEROS[:-len(payload) % 512]))


def _write_range(tmp: str, items: list[_Item]) -> None:
    """Write a run of samples into the shard file ``tmp`` (created at its final size by the main process) at
    the offsets the main process computed. Tar blocks are position-independent, so any number of processes can
    write disjoint ranges of one shard; the end-of-archive blocks (and the padding after an image copied by
    ``sendfile``) are the file's zeros. Everything else is gathered in one buffer and written at once."""
    fd = os.open(tmp, os.O_WRONLY)
    try:
        buf: list[bytes] = []
        start = pos = items[0].offset if items else 0
        for it in items:
            if it.offset != pos:
                _pwrite_all(fd, b"".join(buf), start)
                buf, start = [], it.offset
            cls_m = _member(f"{it.key}.cls", it.cls_b)
            json_m = _member(f"{it.key}.json", it.json_b)
            # Members in name order: "cls" sorts before every image extension; the image before or after "json".
            img_first = it.ext < "json"
            buf.append(cls_m)
            if not img_first:
                buf.append(json_m)
            buf.append(ustar_header(f"{it.key}.{it.ext}", it.img_len))
            pos = it.offset + len(cls_m) + (0 if img_first else len(json_m)) + 512
            if it.cache is None and it.img_len > _INLINE_BYTES:
                assert it.ident is not None
                _pwrite_all(fd, b"".join(buf), start)
                _copy_source(fd, pos, it.path, it.rel, it.img_len, it.ident)
                buf, start = [], pos + _padded(it.img_len)
            else:
                if it.cache is None:
                    assert it.ident is not None
                    data = _read_source(it.path, it.rel, it.img_len, it.ident)
                else:  # transcoded during validation; read back from the batch cache
                    with open(it.cache, "rb") as f:
                        f.seek(it.coff)
                        data = f.read(it.img_len)
                    if len(data) != it.img_len:
                        raise RunError(f"the transcode cache {it.cache} is incomplete; re-run with --overwrite")
                buf.append(data)
                buf.append(_ZEROS[:-len(data) % 512])
            pos += _padded(it.img_len)
            if img_first:
                buf.append(json_m)
                pos += len(json_m)
        if buf:
            _pwrite_all(fd, b"".join(buf), start)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- writing (main side)


class _Sample(NamedTuple):
    """One planned sample, as the writer needs it (built from the plan's columns one shard at a time)."""

    key: str
    path: str
    """Absolute path of the source."""
    label: int
    cname: str
    source: str
    """Path relative to SRC as recorded."""
    orientation: int
    ext: str
    width: int
    """Stored width (after any re-encoding)."""
    height: int
    orig_width: int
    orig_height: int
    sha256: str
    img_len: int
    """Bytes of the stored image member."""
    ident: tuple[int, int, int, int] | None
    """Pass-through: the validated source's identity; transcoded: None."""
    cache: str | None
    """Transcoded: the cache file holding the bytes, at ``coff``."""
    coff: int


def _sample_json(s: _Sample) -> bytes:
    """``KEY.json``: exactly ``json.dumps(meta, sort_keys=True, ensure_ascii=False)`` of the sample's metadata
    (``source``, ``class``, ``label``, stored ``width``/``height``, ``format``, ``sha256``, ``exif_orientation``
    when not 1, ``orig_width``/``orig_height`` when resized), written out directly: the generic encoder costs more
    than the rest of the sample."""
    from json.encoder import encode_basestring

    parts = [f'{{"class": {encode_basestring(s.cname)}, ']
    if s.orientation != 1:
        parts.append(f'"exif_orientation": {s.orientation}, ')
    parts.append(f'"format": {encode_basestring(s.ext)}, "height": {s.height}, "label": {s.label}, ')
    if (s.orig_width, s.orig_height) != (s.width, s.height):
        parts.append(f'"orig_height": {s.orig_height}, "orig_width": {s.orig_width}, ')
    parts.append(f'"sha256": "{s.sha256}", "source": {encode_basestring(s.source)}, "width": {s.width}}}')
    return "".join(parts).encode("utf-8")


class _ShardJob:
    """One shard being written: its layout, temporary file, write ranges and in-order hashing."""

    def __init__(self, dest: str, name: str, samples: list[_Sample]) -> None:
        import queue

        self.name = name
        self.num_samples = len(samples)
        self.final = os.path.join(dest, name)
        self.tmp = os.path.join(dest, f".{name}.tmp")
        items = []
        pos = 0
        for s in samples:
            json_b = _sample_json(s)
            cls_b = str(s.label).encode("ascii")
            items.append(_Item(pos, s.key, s.ext, s.img_len, cls_b, json_b, s.path, s.source, s.ident, s.cache,
                               s.coff))
            pos += 3 * 512 + _padded(s.img_len) + _padded(len(cls_b)) + _padded(len(json_b))
        self.size = pos + 1024 + (-(pos + 1024) % tarfile.RECORDSIZE)  # end-of-archive, padded like tarfile
        # Contiguous runs of samples, each one write task: [(items, end offset, image bytes)].
        self.ranges: list[tuple[list[_Item], int, int]] = []
        first = 0
        for i in range(1, len(items) + 1):
            if i == len(items) or items[i].offset - items[first].offset >= _RANGE_BYTES or i - first >= _RANGE_SAMPLES:
                end = self.size if i == len(items) else items[i].offset
                self.ranges.append((items[first:i], end, sum(it.img_len for it in items[first:i])))
                first = i
        self.done = [False] * len(self.ranges)
        self.hashed_to = 0  # ranges [0, hashed_to) are queued for hashing
        self.submitted = 0
        self.blocks: Any = queue.SimpleQueue()
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


def _finish_shard(dest: str, name: str, size: int, num_samples: int, digest: str) -> dict[str, Any]:
    """Rename a fully written and hashed shard into place, then leave its ``.done.json`` sidecar.

    No fsync of the shard: the rename makes it atomic against a killed process; after a power loss, resume and
    verify compare the file with the sha256 its (durable) sidecar records, so a torn shard is rewritten, never
    trusted.
    """
    from gpufeed.records import atomic_write_bytes

    os.replace(os.path.join(dest, f".{name}.tmp"), os.path.join(dest, name))
    result = {"name": name, "num_samples": num_samples, "bytes": size, "sha256": digest}
    # One C-encoder call: json.dump streams through the pure-Python encoder.
    atomic_write_bytes(os.path.join(dest, STATE_DIR, f"{name}.done.json"), json.dumps(result).encode("utf-8"))
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
    for column in (scan.paths.offsets, scan.labels, scan.sizes, scan.mtimes):
        h.update(column.tobytes())
    h.update(scan.paths.blob)
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
    _map_large_blocks()  # this process only: the forked workers keep glibc's default (their write buffers churn)
    import numpy as np  # after the pool has forked its workers (numpy may start threads)

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
        scan.mtimes = None  # 8 bytes a sample, not held through validation

        plan = _load_plan(dest, fingerprint, cfg)
        done: dict[str, dict[str, Any]] = {}
        if plan is not None:
            for s in plan.shards:
                info = _shard_complete(dest, s["name"])
                if info is not None:
                    done[s["name"]] = info
            lost = [c for s in plan.shards if s["name"] not in done for c in s["caches"]
                    if not os.path.exists(os.path.join(state, c))]
            if lost:  # transcoded bytes are gone (cleared after use): redo the deterministic validation
                plan = None
        resumed = plan is not None  # the earlier run's plan is used as it is (validation skipped)

        t_val = time.perf_counter()
        if plan is None:
            # Before anything is written: the input size is the estimate (pass-through bytes are the output;
            # re-encodes to --max-size/--quality are rarely larger). The exact check follows validation.
            kept = sum(i["bytes"] for i in done.values())
            est = int(scan.sizes.sum()) + _TAR_OVERHEAD_PER_SAMPLE * len(scan) - kept
            _check_free_space(dest, est, cfg)
            shuffled = list(range(len(scan)))
            random.Random(cfg.seed).shuffle(shuffled)
            order = np.array(shuffled, dtype=np.int64)
            del shuffled
            try:
                results = _validate(scan, src, state, opts, pool, bar, order, workers)
            except OSError as exc:
                cached = _cache_bytes(state)
                _clear_cache(state)  # useless without a plan: give the space back
                raise _os_error(exc, cfg, est, cache_deleted=cached) from None
            plan = _make_plan(cfg, scan, results, fingerprint, options, order)
            del results, order
            _check_empty(cfg, plan.classes, plan.meta["class_counts"], warn, after_validation=True)
            try:
                _save_plan(state, plan)
            except OSError as exc:
                raise _os_error(exc, cfg, None, cache_kept=_cache_bytes(state)) from None
        else:
            bar.note("resume: the plan matches; validation skipped")
            _check_empty(cfg, plan.classes, plan.meta["class_counts"], warn, after_validation=True)
        validate_s = time.perf_counter() - t_val
        ignored = scan.ignored
        del scan  # the plan holds what the rest needs

        # ---- write
        t_w = time.perf_counter()
        names = [s["name"] for s in plan.shards]
        if not resumed or not done:
            for name in names:
                info = _shard_complete(dest, name)
                if info is not None:
                    done[name] = info
        todo = [s for s in plan.shards if s["name"] not in done]
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
        tasks = [(s["name"], s["count"], (lambda s=s: plan.part(plan.indices(s)))) for s in todo]
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
            written = _write_all(dest, src, tasks, pool, bar, shard_done, workers=workers)
        except OSError as exc:
            raise _os_error(exc, cfg, need, cache_kept=_cache_bytes(state), writing=True) from None
        done.update(written)
        write_s = time.perf_counter() - t_w
    finally:
        bar.close()
        if pool is not None:
            pool[0].shutdown(wait=True, cancel_futures=True)

    per_action = np.bincount(plan.cols["action"], minlength=len(_ACTIONS)).tolist()
    transforms = {a: k for a, k in sorted(zip(_ACTIONS, per_action)) if k}
    num_exif_oriented = int((plan.cols["orientation"] != 1).sum())
    plan.release_write_columns()

    # ---- index, timm info, manifest (last)
    infos = [done[n] for n in names]
    try:
        manifest = _finish(dest, cfg, plan, infos, options)
    except OSError as exc:
        raise _os_error(exc, cfg, None, shards_done=len(infos), writing=True) from None
    _clear_cache(state)  # the transcode cache is only needed until every shard is complete
    input_bytes = int(plan.cols["bytes"].sum())
    elapsed = time.perf_counter() - t0
    # Rates count what this run wrote (a resume that keeps every shard converts nothing).
    n_written = sum(i["num_samples"] for i in written.values())
    in_written = sum(int(plan.cols["bytes"][plan.indices(s)].sum()) for s in todo if s["name"] in written)
    rejected = plan.rejected
    if rejected:
        warn.append(f"{len(rejected)} file(s) rejected")
    return ShardReport(
        src=src, dest=dest, prefix=cfg.prefix, num_classes=len(plan.classes),
        num_samples=len(plan), num_rejected=len(rejected), num_ignored=len(ignored),
        num_shards=len(names), num_shards_written=len(written), num_shards_skipped=len(names) - len(written),
        total_bytes=manifest.total_bytes, input_bytes=input_bytes,
        written_samples=n_written, written_bytes=sum(i["bytes"] for i in written.values()),
        written_input_bytes=in_written, elapsed_s=elapsed, validate_s=validate_s,
        write_s=write_s, samples_per_s=n_written / elapsed if elapsed > 0 else 0.0,
        mb_per_s=in_written / 1e6 / elapsed if elapsed > 0 else 0.0, workers=workers, strict=cfg.strict,
        resumed=resumed, transforms=transforms,
        num_exif_oriented=num_exif_oriented,
        classes=list(plan.classes), empty_classes=list(plan.meta["empty_classes"]), warnings=warn,
        rejected=rejected, ignored=ignored, shards=names, url_pattern=manifest.url_pattern,
        manifest=os.path.join(dest, "manifest.json"),
    )


def _map_large_blocks() -> None:
    """Keep glibc's mmap threshold at its initial 128 KiB (``mallopt(M_MMAP_THRESHOLD)``; nothing on other C
    libraries): every block above it (the plan's numpy columns, the index's blocks) is then mapped on its own and
    given back to the OS when freed. glibc otherwise raises the threshold up to 32 MiB the first time such a block
    is freed, later columns come from the heap, and the RSS keeps the high-water mark of every phase. (A write
    task's buffer is then mapped and unmapped each time too: ~5% more CPU when this process writes, --workers 1.)"""
    import ctypes

    try:
        ctypes.CDLL(None).mallopt(-3, 128 * 1024)  # M_MMAP_THRESHOLD
    except (OSError, AttributeError):  # not glibc
        pass


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
              shards_done: int = 0, writing: bool = False) -> GpufeedError:
    """An OS error while writing DEST (or reading SRC) as one sentence naming the path and the reason: a
    :class:`RunError` (exit 1) once the shards are being written (``writing``), else a :class:`DataError`.

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
        return (RunError if writing else DataError)(
            f"DEST {cfg.dest} is full ({exc.strerror}): {what}, {_amount(free)} are free now ({counts}){cache}; "
            f"free space or choose another DEST, then re-run"
        )
    where = exc.filename if exc.filename is not None else cfg.dest
    return (RunError if writing else DataError)(
        f"{os.fsdecode(where)}: {exc.strerror or exc} (while sharding into {cfg.dest})")


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


def _load_plan(dest: str, fingerprint: str, cfg: ShardConfig) -> _Plan | None:
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
        plan = _read_plan(os.path.join(dest, STATE_DIR))
        if plan is not None and plan.meta["fingerprint"] == fingerprint:
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


_ACTIONS = ("copy", "reencode", "cmyk_to_rgb_jpeg", "16bit_to_png8", "to_png")
_EXTS = ("", "jpg", "png", "webp")
_COLUMNS = {  # per-sample columns of validation results and of the plan: numpy dtype, trailing shape
    "action": ("u1", ()), "ext": ("u1", ()), "width": ("<i4", ()), "height": ("<i4", ()),
    "orientation": ("<u2", ()), "sha256": ("u1", (32,)), "id_size": ("<i8", ()), "id_mtime": ("<i8", ()),
    "id_ino": ("<u8", ()), "id_dev": ("<u8", ()), "enc_cache": ("<i8", ()), "enc_off": ("<i8", ()),
    "enc_len": ("<i8", ()), "enc_ext": ("u1", ()), "enc_w": ("<i4", ()), "enc_h": ("<i4", ()),
}
"""``id_*``: the pass-through source's identity at validation; ``enc_*``: transcoded bytes in cache file
``enc-{enc_cache:06d}.bin`` (-1: none) at ``enc_off``, with their ext code and stored size."""
_PLAN_COLUMNS = {**_COLUMNS, "label": ("<i4", ()), "bytes": ("<i8", ()), "order": ("<i8", ()),
                 "path_offsets": ("<i8", ()), "path_blob": ("u1", ())}
PLAN_ARRAYS_NAME = "plan.bin"


class _Results:
    """Validation results in columns, indexed like the scan's candidates; reasons of the rejected by index."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.ok = np.zeros(n, dtype=bool)
        self.cols = {k: np.zeros((n, *shape), dtype=dt) for k, (dt, shape) in _COLUMNS.items()}
        self.cols["enc_cache"][:] = -1
        self.reasons: dict[int, str] = {}

    def put(self, ks: Any, batch: dict[str, Any], cache: int) -> None:
        """Store a batch's columns (``_batch_columns``) for candidates ``ks`` (``cache``: the batch's cache file
        number)."""
        ok = batch["ok"]
        if len(ok) != len(ks):
            raise AssertionError("a validation batch returned a result per file")  # pragma: no cover
        self.ok[ks] = ok
        sel = ks[ok]
        for name in _COLUMNS:
            self.cols[name][sel] = batch[name]
        self.cols["enc_cache"][sel[batch["enc_cache"] >= 0]] = cache
        for i, reason in batch["reasons"].items():
            self.reasons[int(ks[i])] = reason


def _cache_name(j: int) -> str:
    return f"enc-{j:06d}.bin"


class _Plan:
    """The plan, columnar: ``meta`` (JSON: fingerprint, options, classes, rejected files, shards as slices of
    ``order``) and per-sample numpy columns (``_PLAN_COLUMNS``) for the accepted samples in key order, i.e.
    sorted by (label, path); ``order`` is their seeded shard order. ~150 bytes a sample plus its path."""

    def __init__(self, meta: dict[str, Any], cols: dict[str, Any], paths: _Strings) -> None:
        import numpy as np

        self.meta = meta
        self.cols = cols
        self.paths = paths
        self.classes: list[str] = meta["classes"]
        self.shards: list[dict[str, Any]] = meta["shards"]
        self.rejected = [FileIssue(i["path"], i["reason"]) for i in meta["rejected"]]
        counts = np.asarray(meta["class_counts"], dtype=np.int64)
        self.class_start = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)

    def stored(self, idx: Any) -> tuple[Any, Any, Any]:
        """(bytes, width, height) of the stored image members of the samples at ``idx`` (after any transcoding)."""
        import numpy as np

        c = self.cols
        encoded = c["enc_cache"][idx] >= 0
        return (np.where(encoded, c["enc_len"][idx], c["bytes"][idx]),
                np.where(encoded, c["enc_w"][idx], c["width"][idx]),
                np.where(encoded, c["enc_h"][idx], c["height"][idx]))

    def release_write_columns(self) -> None:
        """Drop the columns only the writer needs (digests, source identities, cache offsets, ...) before the
        index is built, so their memory is not held at the same time. A resumed plan's columns share one
        buffer, which stays."""
        for name in ("sha256", "id_size", "id_mtime", "id_ino", "id_dev", "enc_off", "enc_ext", "action", "ext",
                     "orientation"):
            self.cols.pop(name, None)

    def __len__(self) -> int:
        return len(self.cols["label"])

    def indices(self, shard: dict[str, Any]) -> Any:
        return self.cols["order"][shard["start"]:shard["start"] + shard["count"]]

    def key(self, i: int) -> str:
        label = int(self.cols["label"][i])
        return f"{label:05d}_{i - int(self.class_start[label]):07d}"

    def part(self, idx: Any) -> dict[str, Any]:
        """What the writer needs of the samples at plan positions ``idx`` (one shard), as columns: small to send
        to a worker process, which builds the records (``_samples_of``)."""
        import numpy as np

        c = self.cols
        labels = c["label"][idx]
        caches = c["enc_cache"][idx]
        stored_len, stored_w, stored_h = self.stored(idx)
        return {"n": (idx - self.class_start[labels]).tolist(), "label": labels.tolist(),
                "ext": np.where(caches >= 0, c["enc_ext"][idx], c["ext"][idx]).tolist(),
                "width": stored_w.tolist(), "height": stored_h.tolist(), "orig_width": c["width"][idx].tolist(),
                "orig_height": c["height"][idx].tolist(), "orientation": c["orientation"][idx].tolist(),
                "img_len": stored_len.tolist(), "cache": caches.tolist(), "coff": c["enc_off"][idx].tolist(),
                "ident": list(zip(c["id_size"][idx].tolist(), c["id_mtime"][idx].tolist(),
                                  c["id_ino"][idx].tolist(), c["id_dev"][idx].tolist())),
                "sha256": c["sha256"][idx].tobytes(), "paths": [self.paths[i] for i in idx.tolist()],
                "classes": self.classes}


def _samples_of(part: dict[str, Any], src: str, state: str) -> list[_Sample]:
    """The records of one shard's samples from ``_Plan.part``."""
    classes, digests = part["classes"], part["sha256"]
    base = os.path.join(src, "")  # + a relative path: os.path.join's result, without its cost per sample
    out = []
    for k, (raw, n, label, e, w, h, ow, oh, orientation, length, j, coff, idt) in enumerate(zip(
            part["paths"], part["n"], part["label"], part["ext"], part["width"], part["height"],
            part["orig_width"], part["orig_height"], part["orientation"], part["img_len"], part["cache"],
            part["coff"], part["ident"])):
        encoded = j >= 0
        out.append(_Sample(f"{label:05d}_{n:07d}", base + raw, label, classes[label], _display(raw),
                           orientation, _EXTS[e], w, h, ow, oh, digests[32 * k:32 * k + 32].hex(), length,
                           None if encoded else idt, os.path.join(state, _cache_name(j)) if encoded else None,
                           coff))
    return out


def _make_plan(cfg: ShardConfig, scan: _Scan, results: _Results, fingerprint: str,
               options: dict[str, Any], shuffled: Any) -> _Plan:
    """The plan: accepted samples (keys in sorted order), split into shards following ``shuffled`` (the seeded
    permutation of the candidates; the accepted ones in that order are a seeded shuffle of the accepted list)."""
    import numpy as np

    ok = results.ok
    n = int(ok.sum())
    rejected = list(scan.rejected) + [FileIssue(_display(scan.paths[k]), r) for k, r in results.reasons.items()]
    rejected.sort(key=lambda i: i.path)
    if not n:
        raise DataError(f"SRC {cfg.src} holds no valid image ({len(rejected)} rejected)")
    everything = n == len(ok)
    acc = None if everything else np.nonzero(ok)[0]  # (when all are accepted, no index column is needed)
    cols = {}
    for k in list(results.cols):  # column by column, each dropped from the results once copied: one copy at a time
        v = results.cols.pop(k)
        cols[k] = v if everything else v[acc]
        del v
    cols["label"], cols["bytes"] = (scan.labels, scan.sizes) if everything else (scan.labels[acc], scan.sizes[acc])
    paths = scan.paths if everything else scan.paths.take(acc)
    counts = np.bincount(cols["label"], minlength=len(scan.classes)).tolist()
    shuffled = np.asarray(shuffled, dtype=np.int64)
    if everything:
        order = shuffled
    else:
        rank = np.cumsum(ok) - 1  # candidate -> position among the accepted
        order = rank[shuffled[ok[shuffled]]].astype(np.int64)
        del rank
    encoded = cols["enc_cache"] >= 0
    est = np.where(encoded, cols["enc_len"], cols["bytes"])
    est += _TAR_OVERHEAD_PER_SAMPLE
    n_shards = plan_num_shards(n, int(est.sum()), cfg)
    if n_shards > n:
        raise DataError(
            f"{n_shards} shards (a multiple of --multiple-of {cfg.multiple_of}) need at least {n_shards} images, "
            f"but only {n} were accepted; lower --multiple-of"
        )
    shards = []
    pos = 0
    for name, k in zip(_shard_names(cfg.prefix, n_shards), split_sizes(n, n_shards)):
        idx = order[pos:pos + k]
        enc_idx = idx[encoded[idx]]
        shards.append({"name": name, "start": pos, "count": k, "est_bytes": int(est[idx].sum()),
                       "caches": [_cache_name(j) for j in np.unique(cols["enc_cache"][enc_idx]).tolist()],
                       "cache_bytes": int(cols["enc_len"][enc_idx].sum())})
        pos += k
    cols["order"] = order
    meta = {"plan_version": PLAN_VERSION, "fingerprint": fingerprint, "options": options,
            "classes": scan.classes, "class_counts": counts,
            "empty_classes": [c for c, m in zip(scan.classes, counts) if m == 0],
            "num_samples": n, "shards": shards, "rejected": [i.__dict__ for i in rejected]}
    return _Plan(meta, cols, paths)


def _save_plan(state: str, plan: _Plan) -> None:
    """``plan.bin`` (the columns, raw little-endian arrays one after the other) then, atomically and last,
    ``plan.json`` (the metadata, each column's dtype, shape and offset, and plan.bin's sha256)."""
    import numpy as np

    from gpufeed.records import atomic_write_bytes, atomic_writer

    arrays = {**plan.cols, "path_offsets": plan.paths.offsets,
              "path_blob": np.frombuffer(plan.paths.blob, dtype=np.uint8)}
    spec = []
    h = hashlib.sha256()
    offset = 0
    with atomic_writer(os.path.join(state, PLAN_ARRAYS_NAME)) as f:
        for name in sorted(_PLAN_COLUMNS):
            a = np.ascontiguousarray(arrays[name], dtype=_PLAN_COLUMNS[name][0])
            spec.append([name, list(a.shape), offset])
            f.write(memoryview(a).cast("B"))
            h.update(memoryview(a).cast("B"))
            offset += a.nbytes
    meta = {**plan.meta, "arrays": {"sha256": h.hexdigest(), "bytes": offset, "columns": spec}}
    atomic_write_bytes(os.path.join(state, PLAN_NAME), json.dumps(meta).encode("utf-8"))


def _paths_inside(blob: bytes, offsets: Any) -> bool:
    """Whether every stored path (relative to SRC) stays inside SRC: not empty, not absolute, no ``..``
    component. A tampered plan could otherwise copy any readable file into a shard."""
    ends = offsets.tolist()
    for a, b in zip(ends, ends[1:]):
        raw = blob[a:b]
        if not raw or raw[:1] == b"/" or (b".." in raw and b".." in raw.split(b"/")):
            return False
    return True


def _read_plan(state: str) -> _Plan | None:
    """The stored plan, or None when it is missing, of another version, or inconsistent in any way (every size,
    offset and index is checked before use: the state folder is data too)."""
    import numpy as np

    try:
        meta = json.loads(Path(state, PLAN_NAME).read_text(encoding="utf-8"))
        if not isinstance(meta, dict) or meta.get("plan_version") != PLAN_VERSION:
            return None
        spec = meta["arrays"]
        with open(os.path.join(state, PLAN_ARRAYS_NAME), "rb") as f:
            # the size comes from plan.json: read only when it is the file's own size (no huge allocation)
            if type(spec["bytes"]) is not int or spec["bytes"] != os.fstat(f.fileno()).st_size:
                return None
            data = f.read(spec["bytes"] + 1)
        if len(data) != spec["bytes"] or hashlib.sha256(data).hexdigest() != spec["sha256"]:
            return None
        n = int(meta["num_samples"])
        arrays: dict[str, Any] = {}
        for name, shape, offset in spec["columns"]:
            dt, tail = _PLAN_COLUMNS[name]
            if tuple(shape[1:]) != tail or len(shape) != 1 + len(tail) or name in arrays:
                return None
            count = math.prod(shape)
            if not 0 <= offset <= len(data) - count * np.dtype(dt).itemsize:
                return None
            arrays[name] = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape)
        if set(arrays) != set(_PLAN_COLUMNS):
            return None
        offsets, blob = arrays.pop("path_offsets"), arrays.pop("path_blob")
        classes, shards = meta["classes"], meta["shards"]
        if (any(len(a) != n for a in arrays.values()) or len(offsets) != n + 1 or offsets[0] != 0
                or offsets[-1] != len(blob) or (n and np.diff(offsets).min() < 0)
                or len(meta["class_counts"]) != len(classes) or sum(meta["class_counts"]) != n
                or not n or not 0 <= arrays["label"].min() <= arrays["label"].max() < len(classes)
                or np.bincount(arrays["label"], minlength=len(classes)).tolist() != meta["class_counts"]
                or not 0 <= arrays["order"].min() <= arrays["order"].max() < n
                or not all(type(s["count"]) is int and s["count"] > 0 and _SHARD_RE.match(s["name"])
                           and all(type(s[k]) is int and s[k] >= 0 for k in ("start", "est_bytes", "cache_bytes"))
                           and all(_CACHE_RE.match(c) for c in s["caches"]) for s in shards)
                or [s["start"] for s in shards] != [0, *itertools.accumulate(s["count"] for s in shards)][:-1]
                or sum(s["count"] for s in shards) != n
                or arrays["ext"].max() >= len(_EXTS) or arrays["enc_ext"].max() >= len(_EXTS)
                or arrays["action"].max() >= len(_ACTIONS)
                or arrays["enc_off"].min() < 0 or arrays["enc_len"].min() < 0
                or not _paths_inside(blob.tobytes(), offsets)
                or not _plan_fields_sound(meta, arrays, n)):
            return None
        return _Plan(meta, arrays, _Strings(blob.tobytes(), offsets))
    except (OSError, ValueError, KeyError, TypeError, IndexError):
        return None


def _plan_fields_sound(meta: dict[str, Any], arrays: dict[str, Any], n: int) -> bool:
    """The rest of a stored plan's consistency: ``order`` a permutation (a repeated index would write one
    sample twice and lose another), unique class names and shard names, plain int counts, bounded sizes, and
    every transcode cache a sample points at listed by a shard."""
    import numpy as np

    classes, shards, order = meta["classes"], meta["shards"], arrays["order"]
    caches = arrays["enc_cache"]
    named = {f"enc-{c:06d}.bin" for c in np.unique(caches[caches >= 0]).tolist()}
    return (type(meta["num_samples"]) is int and len(order) == n and np.bincount(order, minlength=n).max() == 1
            and all(type(c) is str and c and c.isprintable() for c in classes) and len(set(classes)) == len(classes)
            and all(type(c) is int for c in meta["class_counts"])
            and len({sh["name"] for sh in shards}) == len(shards)
            and all(sh[k] <= _MAX_PLAN_BYTES for sh in shards for k in ("est_bytes", "cache_bytes"))
            and all(type(i) is dict and type(i.get("path")) is str and type(i.get("reason")) is str
                    for i in meta["rejected"])
            and int(caches.min()) >= -1 and named <= {c for sh in shards for c in sh["caches"]}
            and int((arrays["enc_off"] + arrays["enc_len"]).max()) <= _MAX_PLAN_BYTES)


_MAX_PLAN_BYTES = 2**44
"""Largest size or offset a stored plan may name (16 TiB, the manifest's shard bound)."""


_INDEX_BLOCK = 65536
"""Rows of ``index.parquet`` built and written at a time (one row group each)."""


def _index_keys(plan: _Plan, rows: Any, labels: Any) -> Any:
    """The ``key`` column (``{label:05d}_{n:07d}``) as an Arrow string array, digits computed with numpy a block
    at a time (wider numbers, which ``:05d``/``:07d`` would not pad to a fixed width, go through ``plan.key``)."""
    import numpy as np
    import pyarrow as pa

    n = rows - plan.class_start[labels]
    if len(rows) and (labels.max() >= 10**5 or n.max() >= 10**7):
        return pa.concat_arrays([pa.array([plan.key(i) for i in rows[b:b + _INDEX_BLOCK].tolist()], pa.string())
                                 for b in range(0, len(rows), _INDEX_BLOCK)])
    blocks = []
    for b in range(0, len(rows), _INDEX_BLOCK):
        lab, num = labels[b:b + _INDEX_BLOCK].astype(np.int64), n[b:b + _INDEX_BLOCK]
        chars = np.empty((len(lab), 13), dtype=np.uint8)
        chars[:, :5] = lab[:, None] // 10 ** np.arange(4, -1, -1) % 10 + 48
        chars[:, 5] = ord("_")
        chars[:, 6:] = num[:, None] // 10 ** np.arange(6, -1, -1) % 10 + 48
        offsets = np.arange(0, 13 * (len(lab) + 1), 13, dtype=np.int32)
        blocks.append(pa.Array.from_buffers(pa.string(), len(lab), [None, pa.py_buffer(offsets),
                                                                    pa.py_buffer(chars.tobytes())]))
    return pa.concat_arrays(blocks) if blocks else pa.array([], pa.string())


def _path_names(plan: _Plan) -> Any:
    """Every path of the plan as one Arrow binary array over the path blob (no copy of the names), or None when
    the blob is too large for 32-bit offsets or paths are not '/'-separated."""
    import pyarrow as pa

    if os.sep != "/" or len(plan.paths.blob) >= 2**31:
        return None
    return pa.Array.from_buffers(pa.binary(), len(plan.paths), [
        None, pa.py_buffer(plan.paths.offsets.astype("int32")), pa.py_buffer(plan.paths.blob)])


def _index_sources(plan: _Plan, rows: Any, names: Any) -> Any:
    """The ``source`` column (``_display`` of each path) as an Arrow string array: straight from ``names``
    (``_path_names``) when every name is UTF-8 (then ``_display`` is the name itself), else name by name."""
    import pyarrow as pa

    if names is not None:
        try:
            return names.take(pa.array(rows)).cast(pa.string())
        except pa.ArrowInvalid:  # a name that is not UTF-8
            pass
    return pa.concat_arrays([pa.array([_display(plan.paths[i]) for i in rows[b:b + _INDEX_BLOCK].tolist()],
                                      pa.string()) for b in range(0, len(rows), _INDEX_BLOCK)])


def _write_index(path: str, plan: _Plan) -> None:
    """``index.parquet`` in plan order (shard by shard: the shards are consecutive slices of ``order``), built
    and written a row group of ``_INDEX_BLOCK`` rows at a time, so only one block's columns are held besides
    the plan."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpufeed.manifest import index_table
    from gpufeed.records import atomic_writer

    order = plan.cols["order"]
    starts = np.array([s["start"] for s in plan.shards], dtype=np.int64)
    shard_names = pa.array([s["name"] for s in plan.shards], pa.string())
    class_names = pa.array(plan.classes, pa.string())
    names = _path_names(plan)
    with atomic_writer(path) as f:
        writer = None
        for b in range(0, len(order), _INDEX_BLOCK):
            rows = order[b:b + _INDEX_BLOCK]
            shard_of = np.searchsorted(starts, np.arange(b, b + len(rows)), side="right") - 1
            labels = plan.cols["label"][rows]
            nbytes, width, height = plan.stored(rows)
            table = index_table({
                "key": _index_keys(plan, rows, labels),
                "shard": shard_names.take(pa.array(shard_of)),
                "class": class_names.take(pa.array(labels)),
                "label": pa.array(labels.astype(np.int64), pa.int64()),
                "source": _index_sources(plan, rows, names),
                "bytes": pa.array(nbytes.astype(np.int64), pa.int64()),
                "width": pa.array(width.astype(np.int32), pa.int32()),
                "height": pa.array(height.astype(np.int32), pa.int32()),
            })
            if writer is None:
                writer = pq.ParquetWriter(f, table.schema, memory_pool=pa.default_memory_pool())
            writer.write_table(table)
            del table
        assert writer is not None  # a plan has at least one sample
        writer.close()


def _finish(dest: str, cfg: ShardConfig, plan: _Plan, infos: list[dict[str, Any]],
            options: dict[str, Any]) -> Any:
    import pyarrow as pa

    from gpufeed import __version__
    from gpufeed.manifest import INDEX_NAME, TIMM_INFO_NAME, Manifest, ShardInfo, brace_pattern, write_manifest
    from gpufeed.records import atomic_write_bytes

    # The index's arrays come from the system allocator (``_map_large_blocks``: its large blocks go back to the OS
    # when freed); pyarrow's default pool (mimalloc or jemalloc) keeps what it frees for a while.
    pool = pa.default_memory_pool()
    pa.set_memory_pool(pa.system_memory_pool())
    try:
        _write_index(os.path.join(dest, INDEX_NAME), plan)
    finally:
        pa.set_memory_pool(pool)

    names = [i["name"] for i in infos]
    shard_infos = [ShardInfo(name=i["name"], num_samples=i["num_samples"], bytes=i["bytes"], sha256=i["sha256"])
                   for i in infos]
    total = sum(i["bytes"] for i in infos)
    n = sum(i["num_samples"] for i in infos)
    timm = {"name": os.path.basename(dest.rstrip("/")) or "gpufeed", "num_classes": len(plan.classes),
            "splits": {cfg.prefix: {"name": cfg.prefix, "num_samples": n, "filenames": names,
                                    "shard_lengths": [i["num_samples"] for i in infos]}}}
    atomic_write_bytes(os.path.join(dest, TIMM_INFO_NAME), (json.dumps(timm, indent=2) + "\n").encode())
    manifest = Manifest(
        prefix=cfg.prefix, classes=list(plan.classes), shards=shard_infos, num_samples=n,
        num_rejected=len(plan.rejected), total_bytes=total, mean_sample_bytes=total / n if n else 0.0,
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


def _make_pool(workers: int, lock_fd: int) -> tuple[Any, Any]:
    """The job's process pool (:func:`gpufeed.system.process_pool`: fork where safe, else spawn; workers die with
    this process and a forked one closes its copy of the DEST lock), started at once so that its start-up
    overlaps the scan."""
    from gpufeed.system import process_pool

    ex = process_pool(workers, close_fds=(lock_fd,))
    ex.submit(_noop)  # start the workers now (spawn: their start-up overlaps the scan)
    return ex, None


def _noop() -> None:
    return None


_VALIDATE_DEPTH = 4
"""Validation batches in flight per worker: enough to keep the workers busy, few enough that the batches' paths
and results are never all held at once."""


def _validate(scan: _Scan, src: str, state: str, opts: dict[str, Any], pool: Any, bar: _Bar,
              order: Any, workers: int = 1) -> _Results:
    """Validate the candidates in the seeded shard order (so each transcode cache file feeds one or a few
    consecutive shards and can be deleted once they are written); results in candidate order."""
    n = len(order)
    results = _Results(n)
    bar.start("validate", n)
    # Header checks of pass-through files take microseconds a file: bigger batches amortise the IPC.
    cheap = opts["check"] == "header" and opts["quality"] is None and opts["max_size"] is None
    chunk = _HEADER_CHUNK if cheap else _CHUNK
    starts = iter(enumerate(range(0, n, chunk)))
    base = os.path.join(src, "")  # + a relative path: os.path.join's result, without its cost per file

    def batch(i: int) -> tuple[Any, list[str]]:
        ks = order[i:i + chunk]
        return ks, [base + scan.paths[k] for k in ks.tolist()]

    def stored(ks: Any, j: int, res: dict[str, Any]) -> None:
        results.put(ks, res, j)
        bar.update(len(ks), int(scan.sizes[ks].sum()))

    if pool is None:
        for j, i in starts:
            ks, paths = batch(i)
            stored(ks, j, _validate_chunk(paths, opts, os.path.join(state, _cache_name(j))))
        return results
    ex = pool[0]
    running: dict[Any, tuple[list[int], int]] = {}
    while True:
        for j, i in starts:
            ks, paths = batch(i)
            running[ex.submit(_validate_chunk, paths, opts, os.path.join(state, _cache_name(j)))] = (ks, j)
            if len(running) >= _VALIDATE_DEPTH * workers:
                break
        if not running:
            return results
        finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
        for fut in finished:
            ks, j = running.pop(fut)
            stored(ks, j, fut.result())


def _write_shard(dest: str, src: str, name: str, part: dict[str, Any]) -> tuple[int, str, int]:
    """Write one whole shard in this (worker) process: records, layout, bytes, then its sha256 -> (size, sha256,
    image bytes). The same layout and writer as the parallel runs of ``_write_all``, so the same bytes."""
    job = _ShardJob(dest, name, _samples_of(part, src, os.path.join(dest, STATE_DIR)))
    try:
        for items, _end, _nbytes in job.ranges:
            _write_range(job.tmp, items)
        return job.size, _sha256_file(job.tmp), sum(r[2] for r in job.ranges)
    except BaseException:
        job.abort()
        raise


def _write_all(dest: str, src: str, tasks: list[tuple[str, int, Callable[[], dict[str, Any]]]], pool: Any,
               bar: _Bar, on_done: Callable[[str], None] = lambda name: None, workers: int = 1) -> dict[str, Any]:
    """Write the shards. ``tasks``: (shard name, number of samples, a function giving ``_Plan.part`` of its
    samples), so only the shards in flight are held as records; as many shards are in flight as workers (the
    DEST space check counts on it).

    With at least two shards a worker, each worker writes and hashes whole shards (``_write_shard``): the
    records, member layout and hashing all happen in the workers. With fewer, every shard is split into runs
    of consecutive samples written in parallel at their offsets (``_write_range``, in the worker processes, or
    one thread without a pool), while one thread per shard hashes it in order as its runs complete, so a
    one-shard plan uses every worker too. Either way a shard is renamed once written and hashed."""
    total = sum(t[1] for t in tasks)
    bar.start("write", total)
    out: dict[str, Any] = {}
    if not tasks:
        return out
    own = pool is None
    ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufeed-write") if own else pool[0]
    try:
        if len(tasks) >= 2 * max(1, workers):
            _write_whole(dest, src, tasks, ex, bar, on_done, workers, out)
        else:
            _write_ranges(dest, src, tasks, ex, bar, on_done, workers, out)
    finally:
        if own:
            ex.shutdown(wait=True)
    return out


def _write_whole(dest: str, src: str, tasks: list[tuple], ex: Any, bar: _Bar, on_done: Callable[[str], None],
                 workers: int, out: dict[str, Any]) -> None:
    pending = iter(tasks)
    running: dict[Any, tuple[str, int]] = {}
    try:
        while True:
            while len(running) < max(1, workers):
                nxt = next(pending, None)
                if nxt is None:
                    break
                running[ex.submit(_write_shard, dest, src, nxt[0], nxt[2]())] = (nxt[0], nxt[1])
            if not running:
                return
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                name, count = running.pop(fut)
                size, digest, nbytes = fut.result()
                out[name] = _finish_shard(dest, name, size, count, digest)
                on_done(name)
                bar.update(count, nbytes)
    except BaseException:
        for fut in running:
            fut.cancel()
        cf.wait(running)  # the shards being written abort themselves (their temporary files go)
        raise


def _write_ranges(dest: str, src: str, tasks: list[tuple], ex: Any, bar: _Bar, on_done: Callable[[str], None],
                  workers: int, out: dict[str, Any]) -> None:
    hashers = cf.ThreadPoolExecutor(max_workers=max(2, workers), thread_name_prefix="gpufeed-sha256")
    state = os.path.join(dest, STATE_DIR)
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
                    current = _ShardJob(dest, nxt[0], _samples_of(nxt[2](), src, state))
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
                    out[job.name] = _finish_shard(dest, job.name, job.size, job.num_samples, fut.result())
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
    if r.resumed or r.num_shards_skipped:
        how = "resumed" if r.resumed else "re-validated (the transcode cache was gone)"
        lines.append(f"  {how}: {r.num_shards_skipped} complete shard(s) kept, {r.num_shards_written} written")
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
