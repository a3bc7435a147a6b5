"""Phase 2, validate: every candidate file checked (``--check header``/``full``), in batches on the workers.

Worker side: ``inspect_file`` reads one file once, checks it (``inspect_bytes``, which the one pass also uses: ``plain_jpeg_size`` for plain JPEG headers,
Pillow for everything else), picks its storage action and transcodes it when the action says so (``_encode``);
``_validate_chunk`` runs a batch and writes its transcoded bytes to one cache file (``enc-*.bin``);
``batch_columns`` returns the batch as columns (``COLUMNS``, ``array`` buffers: no numpy in a worker). Main side: ``validate_candidates`` feeds the batches
in the seeded shard order and gathers them into ``Results`` (skipping whole batches a stopped one pass checked). The rules (stored formats, colour modes,
orientation) are in the package docstring, "Stored bytes, colour modes and orientation"."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import os
import re
import warnings
from typing import TYPE_CHECKING, Any, NamedTuple

from gpufeed.shard.report import Bar
from gpufeed.shardset.images import (SOURCE_FORMATS, ImageRefused, jpeg_problem, open_image, to_8bit_gray,
                                     to_rgb)
from gpufeed.shard.scan import Scan

if TYPE_CHECKING:
    from gpufeed.config import ShardConfig

DEFAULT_REENCODE_QUALITY = 90
CMYK_QUALITY = 95
_CHUNK = 32  # files per validation task: amortises IPC, small enough for a smooth bar and balance
_HEADER_CHUNK = 512  # the same for --check header without re-encoding options (no decode: ~20 us a file)
ACTIONS = ("copy", "reencode", "cmyk_to_rgb_jpeg", "16bit_to_png8", "to_png")
EXTS = ("", "jpg", "png", "webp")

COLUMNS = {  # per-sample columns of validation results and of the plan: numpy dtype, trailing shape
    "action": ("u1", ()), "ext": ("u1", ()), "width": ("<i4", ()), "height": ("<i4", ()),
    "orientation": ("<u2", ()), "sha256": ("u1", (32,)), "id_size": ("<i8", ()), "id_mtime": ("<i8", ()),
    "id_ino": ("<u8", ()), "id_dev": ("<u8", ()), "enc_cache": ("<i8", ()), "enc_off": ("<i8", ()),
    "enc_len": ("<i8", ()), "enc_ext": ("u1", ()), "enc_w": ("<i4", ()), "enc_h": ("<i4", ()),
}
"""``id_*``: the pass-through source's identity at validation; ``enc_*``: transcoded bytes in cache file
``enc-{enc_cache:06d}.bin`` (-1: none) at ``enc_off``, with their ext code and stored size."""


class CheckOptions(NamedTuple):
    """What a worker needs to check and store a file (sent with every validation batch and one-pass shard: a few
    fields, cheap to pickle)."""

    check: str
    """``"header"`` or ``"full"``."""
    max_pixels: int
    max_size: int | None
    quality: int | None
    pixel_limit: int | None = None
    """Set by the main process (``pixel_limit``) for the one pass: a worker then checks plain JPEGs without Pillow."""

    @classmethod
    def of(cls, cfg: ShardConfig) -> CheckOptions:
        return cls(cfg.check, cfg.max_pixels, cfg.max_size, cfg.quality)

    @property
    def header_only(self) -> bool:
        """``--check header`` with nothing to re-encode: the batches are cheap, and the one pass may be tried."""
        return self.check == "header" and self.quality is None and self.max_size is None


def cache_name(j: int) -> str:
    return f"enc-{j:06d}.bin"


CACHE_RE = re.compile(r"^enc-\d{6,}\.bin$")


# --------------------------------------------------------------------------- worker side


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


EXT = {"JPEG": "jpg", "PNG": "png", "WEBP": "webp"}


def _encode(data: bytes, action: str, opts: CheckOptions) -> tuple[bytes, str, int, int]:
    """Apply a storage action -> (bytes, ext, width, height). Deterministic for given input and options."""
    from PIL import Image

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        im = open_image(data, SOURCE_FORMATS)
        if action == "reencode":
            target = _out_size(im.width, im.height, opts.max_size)
            if im.format in ("JPEG", "MPO") and target != im.size:
                im.draft("RGB", target)  # DCT-domain downscale: still decodes the whole bitstream
            im = to_rgb(im)
            if im.size != target:
                im = im.resize(target, Image.Resampling.BICUBIC)
            q = opts.quality or DEFAULT_REENCODE_QUALITY
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=q)
            return buf.getvalue(), "jpg", im.width, im.height
        if action == "cmyk_to_rgb_jpeg":
            im = to_rgb(im)
            buf = io.BytesIO()
            im.save(buf, "JPEG", quality=opts.quality or CMYK_QUALITY)
            return buf.getvalue(), "jpg", im.width, im.height
        if action == "16bit_to_png8":
            im = to_8bit_gray(im)
        else:  # to_png
            im = to_rgb(im)
        buf = io.BytesIO()
        im.save(buf, "PNG")
        return buf.getvalue(), "png", im.width, im.height
    raise AssertionError(action)  # pragma: no cover


_SKIPPED_SEGMENTS = frozenset((0xC4, 0xDD, 0xFE))  # DHT, DRI, COM: Pillow reads them whole, nothing more


def plain_jpeg_size(data: bytes, max_image_pixels: int) -> tuple[int, int] | None:
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


def read_whole(path: str, dir_fd: int | None = None) -> tuple[bytes, os.stat_result]:
    """The file's bytes and its ``os.fstat`` once they are read: one read of the size ``fstat`` gives (plus one
    byte, to see a file that grew), more only when the size changed (then ``fstat`` again, after the reads).
    ``dir_fd``: a relative ``path`` is opened from that folder (the one pass: SRC's path is resolved once)."""
    fd = os.open(path, os.O_RDONLY, dir_fd=dir_fd)
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


def inspect_file(path: str, opts: CheckOptions) -> _Checked:
    """Validate one file.

    ``ident`` is the opened file's identity (size, mtime_ns, inode, device) after reading it: the writer checks
    the source it copies against it instead of hashing the bytes a second time."""
    try:
        data, st = read_whole(path)
    except OSError as exc:
        return _reject(f"unreadable ({exc.strerror or exc})")
    return inspect_bytes(data, st, opts)


def pixel_limit(opts: CheckOptions) -> int:
    """The pixel count above which a file is not taken as a plain JPEG: ``max_pixels``, or Pillow's own limit
    when lower (``plain_jpeg_size``); ``opts.pixel_limit`` when the main process put it there (then a worker
    that meets only plain JPEGs never imports Pillow)."""
    if opts.pixel_limit is not None:
        return opts.pixel_limit
    from PIL import Image

    return min(opts.max_pixels, Image.MAX_IMAGE_PIXELS or opts.max_pixels)


def _plain_copy(data: bytes, st: os.stat_result, pixel_limit: int, max_size: int | None) -> _Checked | None:
    """``--check header`` without re-encoding: the result for a plain JPEG (``plain_jpeg_size``) stored as it
    is, else None (Pillow decides); ``inspect_bytes`` tries it first."""
    size = plain_jpeg_size(data, pixel_limit)
    if size is None or (max_size is not None and max(size) > max_size) or jpeg_problem(data) is not None:
        return None  # Pillow's path decides (and open_image refuses a JPEG gpufeed does not decode, saying why)
    return _Checked(True, "copy", "JPEG", size[0], size[1], 1, None, hashlib.sha256(data).digest(),
                    (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev))


def inspect_bytes(data: bytes, st: os.stat_result, opts: CheckOptions) -> _Checked:
    """``inspect_file`` of a file's bytes ``data`` and its ``os.fstat`` ``st`` once they were read."""
    if not data:
        return _reject("empty file (0 bytes)")
    if opts.check == "header" and opts.quality is None:
        plain = _plain_copy(data, st, pixel_limit(opts), opts.max_size)
        if plain is not None:
            return plain
    from PIL import Image, UnidentifiedImageError

    ident = (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", Image.DecompressionBombWarning)
        try:
            im = open_image(data, SOURCE_FORMATS)
        except Image.DecompressionBombError as exc:
            return _reject(f"decompression bomb ({exc})")
        except UnidentifiedImageError:
            return _reject("not an image (content not recognised)")
        except ImageRefused as exc:
            return _reject(str(exc))
        except Exception as exc:  # noqa: BLE001 - any parser failure is a per-file reject
            return _reject(f"unreadable image header ({type(exc).__name__}: {exc})")
        fmt, mode, (w, h) = im.format or "", im.mode, im.size
        if fmt == "MPO":  # multi-picture camera JPEGs: the stream is a baseline JPEG (first picture) plus extras
            fmt = "JPEG"
        if w <= 0 or h <= 0:
            return _reject(f"image has no pixels ({w}x{h})", fmt, w, h)
        if w * h > opts.max_pixels:
            return _reject(f"decompression bomb: {w}x{h} = {w * h} pixels > max_pixels {opts.max_pixels}",
                           fmt, w, h)
        if fmt in ("JPEG", "PNG", "WEBP") and _detect(data) != fmt:
            return _reject(f"unsupported {fmt} variant", fmt, w, h)
        try:
            orientation = int(im.getexif().get(0x0112, 1) or 1)
        except Exception:  # noqa: BLE001 - a broken EXIF block is not a broken image
            orientation = 1
        if not 0 <= orientation <= 0xFFFF:  # not an EXIF SHORT: a broken EXIF block too
            orientation = 1
        action = _action(fmt, mode, w, h, opts.max_size, opts.quality)
        try:
            if action != "copy":
                # Transcoding decodes the whole image (the validation) and its output is kept for the writer.
                out, ext, ow, oh = _encode(data, action, opts)
                return _Checked(True, action, fmt, w, h, orientation, _Encoded(out, len(out), ext, ow, oh),
                                hashlib.sha256(out).digest())
            if opts.check == "full":
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


def _validate_chunk(paths: list[str], opts: CheckOptions, cache: str | None = None) -> dict[str, Any]:
    """Validate a batch of files -> their results as columns (``batch_columns``). Transcoded outputs go to one
    cache file per batch."""
    results = []
    blobs = []
    offset = 0
    for p in paths:
        r = inspect_file(p, opts)
        if r.enc is not None:
            blobs.append(r.enc.data)
            r = r._replace(enc=r.enc._replace(data=offset))
            offset += r.enc.length
        results.append(r)
    if blobs:
        assert cache is not None
        from gpufeed.core.records import atomic_write_bytes

        atomic_write_bytes(cache, b"".join(blobs))
    return batch_columns(results)


def batch_columns(results: list[_Checked]) -> dict[str, Any]:
    """A batch's results as columns of its accepted files (``COLUMNS``, as ``array.array`` buffers:
    ``_column`` views them; ``enc_cache`` 0 marks a transcoded file, whose cache the main process numbers),
    ``ok`` per file (bytes) and ``reasons`` {position: reason}: built in the worker, so the main process only
    scatters a few arrays per batch. No numpy here: a worker that only checks plain JPEG headers never imports
    it (~0.1 s a process)."""
    from array import array

    acc = [r for r in results if r.ok]
    none = _Encoded(0, 0, "", 0, 0)
    encs = [r.enc or none for r in acc]
    ids = [r.ident or (0, 0, 0, 0) for r in acc]
    values = {
        "action": [ACTIONS.index(r.what) for r in acc],
        "ext": [EXTS.index(EXT.get(r.fmt or "", "")) for r in acc],
        "width": [r.width for r in acc], "height": [r.height for r in acc],
        "orientation": [r.orientation for r in acc],
        "id_size": [i[0] for i in ids], "id_mtime": [i[1] for i in ids], "id_ino": [i[2] for i in ids],
        "id_dev": [i[3] for i in ids], "enc_cache": [-1 if r.enc is None else 0 for r in acc],
        "enc_off": [e.data for e in encs], "enc_len": [e.length for e in encs],
        "enc_ext": [EXTS.index(e.ext) for e in encs], "enc_w": [e.width for e in encs],
        "enc_h": [e.height for e in encs],
    }
    out: dict[str, Any] = {k: array(_ARRAY_CODES[dt], values[k]) for k, (dt, _shape) in COLUMNS.items()
                           if k != "sha256"}
    out["sha256"] = b"".join(r.sha256 for r in acc)
    out["n"] = len(acc)
    out["ok"] = bytes(r.ok for r in results)
    out["reasons"] = {i: r.what for i, r in enumerate(results) if not r.ok}
    return out


_ARRAY_CODES = {"u1": "B", "<i4": "i", "<u2": "H", "<i8": "q", "<u8": "Q"}
"""``array.array`` type codes of the ``COLUMNS`` dtypes (native order: the worker and the main process are one
machine)."""


def _column(batch: dict[str, Any], name: str) -> Any:
    """Column ``name`` of a ``batch_columns`` batch as a numpy array (a view of its buffer)."""
    import numpy as np

    dt, shape = COLUMNS[name]
    return np.frombuffer(batch[name], dtype=np.dtype(dt).newbyteorder("=")).reshape(batch["n"], *shape)


# --------------------------------------------------------------------------- main side


class Results:
    """Validation results in columns, indexed like the scan's candidates; reasons of the rejected by index."""

    def __init__(self, n: int) -> None:
        import numpy as np

        self.ok = np.zeros(n, dtype=bool)
        self.cols = {k: np.zeros((n, *shape), dtype=dt) for k, (dt, shape) in COLUMNS.items()}
        self.cols["enc_cache"][:] = -1
        self.reasons: dict[int, str] = {}

    def put(self, ks: Any, batch: dict[str, Any], cache: int) -> None:
        """Store a batch's columns (``batch_columns``) for candidates ``ks`` (``cache``: the batch's cache file
        number)."""
        import numpy as np

        ok = np.frombuffer(batch["ok"], dtype=bool)
        if len(ok) != len(ks):
            raise AssertionError("a validation batch returned a result per file")  # pragma: no cover
        self.ok[ks] = ok
        sel = ks[ok]
        for name in COLUMNS:
            self.cols[name][sel] = _column(batch, name)
        self.cols["enc_cache"][sel[_column(batch, "enc_cache") >= 0]] = cache
        for i, reason in batch["reasons"].items():
            self.reasons[int(ks[i])] = reason


_VALIDATE_DEPTH = 4
"""Validation batches in flight per worker: enough to keep the workers busy, few enough that the batches' paths
and results are never all held at once."""


class Partial(NamedTuple):
    """The validation results of a one pass that stopped: the candidates it ``checked`` (a mask), all accepted
    as pass-throughs, in ``results``."""

    results: Results
    checked: Any


def validate_candidates(scan: Scan, src: str, state: str, opts: CheckOptions, pool: Any, bar: Bar,
                        order: Any, workers: int = 1, partial: Partial | None = None, store: Any = None) -> Results:
    """Validate the candidates in the seeded shard order (so each transcode cache file feeds one or a few
    consecutive shards and can be deleted once they are written); results in candidate order. ``pool``: the
    job's process pool, or None (here). ``partial``: what a stopped one pass validated already; a batch whose
    files are all checked is skipped (the batches, and so the cache files' numbers, stay those of a whole
    validation). ``store``: a static split's batch results shared through DEST (``split.BatchStore``): batches
    in its order, each one read from it when another node validated it, else validated and saved to it."""
    n = len(order)
    results = Results(n) if partial is None else partial.results
    checked = None if partial is None else partial.checked
    bar.start("validate", n)
    # Header checks of pass-through files take microseconds a file: bigger batches amortise the IPC.
    chunk = _HEADER_CHUNK if opts.header_only else _CHUNK
    batches = list(enumerate(range(0, n, chunk)))
    if checked is not None:
        left = [(j, i) for j, i in batches if not checked[order[i:i + chunk]].all()]
        bar.update(n - sum(len(order[i:i + chunk]) for _, i in left))
        batches = left
    if store is not None:
        batches = store.order(batches)
    starts = iter(batches)
    base = os.path.join(src, "")  # + a relative path: os.path.join's result, without its cost per file

    def batch(i: int) -> tuple[Any, list[str]]:
        ks = order[i:i + chunk]
        return ks, [base + scan.paths[k] for k in ks.tolist()]

    def stored(ks: Any, j: int, res: dict[str, Any]) -> None:
        if store is not None:
            res = store.save(j, res)
        results.put(ks, res, j)
        bar.update(len(ks), int(scan.sizes[ks].sum()))

    def reused(ks: Any, j: int) -> bool:
        """Whether batch ``j`` was validated by another node (its results are then stored)."""
        kept = None if store is None else store.load(j, len(ks))
        if kept is not None:
            results.put(ks, kept, j)
            bar.update(len(ks), int(scan.sizes[ks].sum()))
        return kept is not None

    if pool is None:
        for j, i in starts:
            ks, paths = batch(i)
            if not reused(ks, j):
                stored(ks, j, _validate_chunk(paths, opts, os.path.join(state, cache_name(j))))
        return results
    ex = pool
    running: dict[Any, tuple[list[int], int]] = {}
    while True:
        for j, i in starts:
            ks, paths = batch(i)
            if reused(ks, j):
                continue
            running[ex.submit(_validate_chunk, paths, opts, os.path.join(state, cache_name(j)))] = (ks, j)
            if len(running) >= _VALIDATE_DEPTH * workers:
                break
        if not running:
            return results
        finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
        for fut in finished:
            ks, j = running.pop(fut)
            stored(ks, j, fut.result())
