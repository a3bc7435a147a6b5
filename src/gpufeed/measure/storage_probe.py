"""The read-rate instrument of ``gpufeed io``, ``train --measure`` and ``tune`` (docs/design.md §4): locations (a
shard set's files in manifest order, local or remote, or an image folder's files), bounded read steps of R parallel
readers with the page cache evicted first where that is possible, the reader ladder, the bounded :func:`probe` of
a run's shard set, and the storage rate of a ``gpufeed io`` record (:func:`io_record_rate`). How a step reads, and
what cold, warm and remote mean: :mod:`gpufeed.storage` (the ``io`` job), which reports these steps."""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Callable

from gpufeed.core.errors import DataError
from gpufeed.core.records import read_json_file
from gpufeed.measure.storage_rate import StorageRate

READ_SIZE = 8 << 20
"""Bytes per read of a sequential reader (and of a large image file)."""
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files live in the page cache: nothing to evict, cold is not measurable."""
EVICTION_CHECK_FILES = 64
"""Files of a location whose page-cache residency mincore checks after an eviction."""
EVICTION_CHECK_BYTES = 1 << 30
"""Bytes per file that mincore checks (the start of the file)."""
MAX_RECORD_BYTES = 64 << 20
"""Largest record read: a train summary.json for its GPU ceiling, a gpufeed io summary.json for its rate."""
REMOTE_CHUNK_BYTES = 1 << 20
"""Bytes per range request of a remote reader (small, so a step's seconds bound is kept on a slow source)."""
STEP_GRACE_S = 5.0
"""Seconds past a step's ``seconds`` that a remote read under way may take before it is abandoned (a stalled or
trickling server then ends the step: ``shardset.source.reads_bounded_by``)."""
STEP_BOUND = "the io step's --seconds bound ran out while this read waited"
REMOTE_CACHE = "remote"
"""The ``cache`` of a remote step: no page cache on this side, so neither cold nor warm."""
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
"""Files of an image folder that are read (case-insensitive); other files are not images and are left out."""

Opener = Callable[[str], BinaryIO]


def local_open(path: str) -> BinaryIO:
    """The local opener: an unbuffered binary file (reads go straight to the kernel)."""
    return open(path, "rb", buffering=0)


# --------------------------------------------------------------------------- locations


@dataclass(frozen=True)
class Location:
    path: Path | str
    """A local path, or the URL the user typed."""
    kind: str
    files: list[tuple[str, int]]
    """(absolute path or URL, size) in read order."""
    sample_bytes: float
    truncated: bool
    remote: bool = False


def remote_opener(files: list[tuple[str, int]]) -> Opener:
    """The opener of a remote location: :func:`gpufeed.shardset.source.open_shard` with the manifest's size of
    each URL and ``REMOTE_CHUNK_BYTES`` ranges."""
    from gpufeed.shardset.source import open_shard

    sizes = dict(files)
    return lambda url: open_shard(url, size=sizes[url], chunk_bytes=REMOTE_CHUNK_BYTES)


def reading(loc: Location, opener: Opener = local_open) -> tuple[Opener, int]:
    """How a location is read: ``opener`` in ``READ_SIZE`` reads, or a remote set through :func:`remote_opener` in
    ``REMOTE_CHUNK_BYTES`` range requests."""
    if loc.remote:
        return remote_opener(loc.files), REMOTE_CHUNK_BYTES
    return opener, READ_SIZE


def shards_here(m: Any, where: str) -> list[int]:
    """Indices of the shards a set holds: all of them, or for a set staged for one node (``gpufeed stage
    --num-nodes``, :func:`gpufeed.stage.staged_node`) that node's own, the only ones there and the only ones its
    loader reads."""
    from gpufeed.shardset.manifest import staged_node
    from gpufeed.core.world import node_shards

    staged = staged_node(m, where)
    return list(range(len(m.shards))) if staged is None else node_shards(len(m.shards), *staged)


def shard_location(path: Path) -> Location:
    from gpufeed.shardset.manifest import read_manifest, shard_root

    m = read_manifest(path)
    root = shard_root(m, path)
    files = []
    here = set(shards_here(m, str(path)))
    for i, p in enumerate(m.shard_paths(root)):
        if i not in here:
            continue
        try:
            st = p.stat()
        except OSError as exc:
            raise DataError(f"shard {p} of the manifest cannot be read ({exc.strerror or exc})") from None
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"shard {p} of the manifest is not a regular file")
        files.append((str(p.absolute()), st.st_size))
    return Location(path, "shards", files, m.mean_sample_bytes, False)


def image_location(path: Path, max_files: int) -> Location:
    """Image files under ``path`` in sorted walk order, at most ``max_files`` (symlinked folders not followed)."""
    files: list[tuple[str, int]] = []
    truncated = False
    for folder, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        for name in sorted(names):
            if name.startswith(".") or not name.lower().endswith(IMAGE_EXTENSIONS):
                continue
            full = os.path.join(folder, name)
            try:
                st = os.stat(full)
            except OSError:
                continue  # a dangling link: nothing to read
            if not stat.S_ISREG(st.st_mode):
                continue
            if len(files) == max_files:
                truncated = True
                break
            files.append((os.path.abspath(full), st.st_size))
        if truncated:
            break
    if not files:
        raise DataError(f"{path} holds no shard set (no manifest.json) and no image files")
    return Location(path, "images", files, sum(s for _, s in files) / len(files), truncated)


def resolve_location(path: str | Path, max_files: int) -> Location:
    """A shard set (folder with manifest.json, or a manifest .json; local or a remote URL) or an image folder."""
    from gpufeed.shardset.source import is_pipe, is_url

    if is_url(path):
        return set_location(path, None)
    if is_pipe(path):
        raise DataError(f"{path}: gpufeed io measures folders and URLs, not pipe: commands")
    p = Path(path)
    if p.suffix == ".json" or (p / "manifest.json").exists():
        return shard_location(p)
    if not p.is_dir():
        raise DataError(f"{p} is neither a shard set nor an image folder")
    return image_location(p, max_files)


def filesystem_of(path: str | Path) -> tuple[str, str]:
    """(filesystem type, mount point) of ``path`` (:func:`gpufeed.core.system.mount_of`); ("unknown", "") where
    /proc/mounts cannot be read. For a URL: (its scheme, its host or bucket)."""
    from gpufeed.core.system import mount_of

    if isinstance(path, str) and "://" in path:
        from gpufeed.core.redact import split_url

        scheme, _, host, _ = split_url(path)  # the host only: a password is no part of a record
        return scheme, host

    _, point, fs_type = mount_of(path)
    return fs_type, point


# --------------------------------------------------------------------------- eviction


def can_evict() -> bool:
    """Whether this platform has posix_fadvise (Linux and most Unixes; not macOS or Windows)."""
    return hasattr(os, "posix_fadvise")


def evict(files: list[tuple[str, int]]) -> None:
    """Write back and drop every file from the page cache (fsync + POSIX_FADV_DONTNEED); needs ``can_evict``."""
    for path, _ in files:
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue  # it will fail again, in one sentence, when read
        try:
            try:
                os.fsync(fd)  # dirty pages are not dropped; write them back first
            except OSError:
                pass
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


_LIBC: Any = None


def _libc() -> Any:
    global _LIBC
    if _LIBC is None:
        lib = ctypes.CDLL(None, use_errno=True)
        lib.mmap.restype = ctypes.c_void_p
        lib.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                             ctypes.c_long]
        lib.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
        lib.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]
        _LIBC = lib
    return _LIBC


def cached_fraction(files: list[tuple[str, int]]) -> float | None:
    """Share of the pages still in the page cache over the first ``EVICTION_CHECK_FILES`` non-empty files (their
    first ``EVICTION_CHECK_BYTES`` each), by mincore(2); None where mincore cannot be called (not Linux)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        lib = _libc()
    except (OSError, AttributeError):
        return None
    page = mmap.PAGESIZE
    cached = total = 0
    for path, size in [f for f in files if f[1] > 0][:EVICTION_CHECK_FILES]:
        length = min(size, EVICTION_CHECK_BYTES)
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            addr = lib.mmap(None, length, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr is None or addr == ctypes.c_void_p(-1).value:
                return None
            try:
                pages = (length + page - 1) // page
                vec = (ctypes.c_ubyte * pages)()
                if lib.mincore(addr, length, vec) != 0:
                    return None
                cached += sum(b & 1 for b in vec)
                total += pages
            finally:
                lib.munmap(addr, length)
        finally:
            os.close(fd)
    return cached / total if total else None


# --------------------------------------------------------------------------- one step


class _Budget:
    """The step's shared byte budget and deadline: each read is reserved before it is made."""

    def __init__(self, limit: int, deadline: float):
        self.left = limit
        self.deadline = deadline
        self.lock = threading.Lock()
        self.hit = ""

    def take(self, want: int) -> int:
        """Bytes granted for the next read (0: stop)."""
        with self.lock:
            if time.perf_counter() >= self.deadline:
                self.hit = self.hit or "seconds"
                return 0
            if self.left <= 0:
                self.hit = self.hit or "bytes"
                return 0
            got = min(want, self.left)
            self.left -= got
            return got

    def give_back(self, n: int) -> None:
        with self.lock:
            self.left += n


def _read_file(path: str, size: int, budget: _Budget, buf: bytearray, opener: Opener) -> tuple[int, bool]:
    """Read the ``size`` listed bytes of ``path`` sequentially within the budget: (bytes read, read to its end)."""
    done = 0
    view = memoryview(buf)
    with opener(path) as f:
        while done < size:
            grant = budget.take(min(len(buf), size - done))
            if grant == 0:
                return done, False
            n = f.readinto(view[:grant]) or 0
            if n < grant:
                budget.give_back(grant - n)
            done += n
            if n == 0:  # the file shrank since it was listed: its end
                break
    return done, True


def run_step(loc_files: list[tuple[str, int]], kind: str, readers: int, *, seconds: float, limit: int,
             opener: Opener = local_open, read_size: int = READ_SIZE) -> tuple[int, int, float, str]:
    """One step: ``readers`` threads over ``loc_files``, ``read_size`` bytes a read -> (bytes, whole files,
    seconds, stopped_by)."""
    errors: list[BaseException] = []
    counts = [[0, 0] for _ in range(readers)]
    next_file = [0]
    lock = threading.Lock()
    start = time.perf_counter()
    budget = _Budget(limit, start + seconds)

    def claim(own: list[tuple[str, int]], pos: list[int]) -> tuple[str, int] | None:
        if kind == "shards":
            if pos[0] >= len(own):
                return None
            pos[0] += 1
            return own[pos[0] - 1]
        with lock:
            if next_file[0] >= len(loc_files):
                return None
            next_file[0] += 1
            return loc_files[next_file[0] - 1]

    def reader(r: int) -> None:
        buf = bytearray(read_size)
        own = loc_files[r::readers] if kind == "shards" else []
        pos = [0]
        try:
            while (item := claim(own, pos)) is not None:
                got, whole = _read_file(item[0], item[1], budget, buf, opener)
                counts[r][0] += got
                counts[r][1] += int(whole)
                if not whole:
                    return
        except BaseException as exc:  # noqa: BLE001 - re-raised in the calling thread
            if STEP_BOUND in str(exc):  # a remote read still waiting at the step's end: the step's seconds
                budget.hit = budget.hit or "seconds"
                return
            errors.append(exc)

    threads = [threading.Thread(target=reader, args=(r,), name=f"gpufeed-io-{r}", daemon=True)
               for r in range(readers)]
    from gpufeed.shardset.source import reads_bounded_by

    with reads_bounded_by(time.monotonic() + seconds + STEP_GRACE_S, STEP_BOUND):  # every remote read of the step
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    elapsed = time.perf_counter() - start
    if errors:
        exc = errors[0]
        if isinstance(exc, OSError):
            raise DataError(f"{exc.filename or 'a file'} cannot be read ({exc.strerror or exc})") from None
        raise exc  # a remote read's SourceError is already one sentence naming the URL
    return sum(c[0] for c in counts), sum(c[1] for c in counts), elapsed, budget.hit or "end"


def reader_ladder(max_readers: int) -> list[int]:
    """1, 2, 4, ... up to ``max_readers``, which is always the last rung."""
    out, r = [], 1
    while r < max_readers:
        out.append(r)
        r *= 2
    return out + [max_readers]


def default_max_readers() -> int:
    from gpufeed.core.system import usable_cpus

    return min(16, 4 * usable_cpus())


# --------------------------------------------------------------------------- the storage rate of a run


PROBE_BYTES = 1 << 30
"""Bytes a probe reads at most, over all its steps."""




def probe(location: str | Path, seconds: float = 3.0, *, max_readers: int | None = None,
          max_bytes: int = PROBE_BYTES, opener: Opener = local_open, manifest: str | Path | None = None
          ) -> StorageRate:
    """A bounded ``gpufeed io`` of one location (the shard files the loader reads): the reader ladder 1, 2, 4, ...
    up to ``max_readers`` (default :func:`default_max_readers`, never more than the files), each step given
    ``seconds / steps`` seconds and ``max_bytes / steps`` bytes. Each step is cold where cold is measurable (the
    files the step may reach are evicted first, as in ``gpufeed io``; eviction time is not counted), else warm;
    a remote set (a URL, or a brace pattern of URLs or ``pipe:`` commands with ``manifest``) is read through
    ``open_shard`` as ``gpufeed io`` reads it, and its rate is "remote". ``location`` and ``manifest`` are what
    the loader is given (:func:`gpufeed.shardset.source.open_set`). Returns the best rate with its reader count
    and the ladder."""
    from gpufeed.shardset.source import is_remote

    text = str(location)
    if manifest is not None or is_remote(text) or ("{" in text and "}" in text):
        loc = set_location(location, manifest)
    else:
        loc = resolve_location(location, 100_000)
    opener, read_size = reading(loc, opener)
    cold = not loc.remote and filesystem_of(loc.path)[0] not in RAM_FILESYSTEMS and can_evict()
    rungs = reader_ladder(max(1, min(max_readers or default_max_readers(), len(loc.files))))
    step_s, step_bytes = seconds / len(rungs), max(1, max_bytes // len(rungs))
    ladder: list[tuple[int, float]] = []
    total_s = 0.0
    for readers in rungs:
        if cold:
            evict(_reachable(loc.files, readers, step_bytes))
        nbytes, _, secs, _ = run_step(loc.files, loc.kind, readers, seconds=step_s, limit=step_bytes, opener=opener,
                                      read_size=read_size)
        total_s += secs
        ladder.append((readers, nbytes / max(secs, 1e-9)))
    readers, rate = max(ladder, key=lambda rung: (rung[1], -rung[0]))
    return StorageRate(bytes_per_s=rate, source="probe", readers=readers,
                       cache=REMOTE_CACHE if loc.remote else "cold" if cold else "warm",
                       seconds=total_s, ladder=ladder, path=str(loc.path))


def set_location(spec: str | Path, manifest: str | Path | None) -> Location:
    """The shard set the loader reads (open_set of ``spec`` and ``manifest``), sizes from the manifest."""
    from gpufeed.shardset.source import open_set

    ss = open_set(spec, manifest)
    here = shards_here(ss.manifest, ss.location)
    files = [(ss.urls[i], ss.manifest.shards[i].bytes) for i in here]
    return Location(str(spec), "shards", files, ss.manifest.mean_sample_bytes, False, remote=ss.remote)


def _reachable(files: list[tuple[str, int]], readers: int, limit: int) -> list[tuple[str, int]]:
    """The files a shard step of ``readers`` readers can touch within ``limit`` bytes: reader r reads files
    r, r + readers, ... and no reader reads more than ``limit``."""
    out = []
    for r in range(readers):
        got = 0
        for f in files[r::readers]:
            if got >= limit:
                break
            out.append(f)
            got += f[1]
    return out


def io_record_rate(record_path: str | Path, shards: str | Path, *, max_bytes: int = MAX_RECORD_BYTES) -> StorageRate:
    """The storage rate of the shard set ``shards`` from a ``gpufeed io`` summary.json (at most ``max_bytes``): the
    location whose folder is the shard set's folder (or URL), its best cold rate (warm where cold was not measured;
    remote for a URL). DataError (one sentence) when the file is not such a record or measured another location."""
    p = Path(record_path)
    data = read_json_file(p, max_bytes, "a gpufeed io summary.json")
    locations = data.get("locations") if isinstance(data, dict) else None
    if not isinstance(locations, list) or not locations:
        raise DataError(f"{p} is not a gpufeed io summary.json (no locations)")
    want = _folder(shards)
    seen = []
    for loc in locations[:10_000]:
        where = loc.get("path") if isinstance(loc, dict) else None
        if not isinstance(where, str) or not where or "\0" in where:
            continue
        seen.append(where)
        if _folder(where) != want:
            continue
        steps = loc.get("steps")
        rungs = [s for s in steps[:10_000] if isinstance(s, dict)] if isinstance(steps, list) else []
        for cache in ("cold", "warm", REMOTE_CACHE):
            ladder = sorted((s["readers"], s["mb_per_s"] * 1e6) for s in rungs
                            if s.get("cache") == cache and _count(s.get("readers")) and _rate(s.get("mb_per_s")))
            if ladder:
                readers, rate = max(ladder, key=lambda rung: (rung[1], -rung[0]))
                return StorageRate(bytes_per_s=rate, source="io record", readers=readers, cache=cache,
                                   ladder=ladder, path=where)
        raise DataError(f"{p} holds no measured steps for {where}")
    raise DataError(f"{p} measured {', '.join(seen[:3]) or 'no location'}, not the shard set's folder {want}")


def _folder(path: str | Path) -> str:
    """The real folder of a shard set given as its folder or its manifest .json (a URL: the folder URL, its
    password hidden as records hide it, so the URL typed matches the one an io record holds)."""
    from gpufeed.core.redact import redact
    from gpufeed.shardset.source import is_url, normal_url

    if is_url(path):
        url = redact(normal_url(str(path))).rstrip("/")
        return url.rsplit("/", 1)[0] if url.endswith(".json") else url
    p = Path(path)
    return os.path.realpath(p.parent if p.suffix == ".json" else p)


def _count(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 1 <= x <= 1_000_000


def _rate(x: Any) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and 0 < x <= 1e9
