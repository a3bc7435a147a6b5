"""``gpufeed io PATH [PATH ...]``: how fast each location reads a shard set or an image folder, and whether that
covers what the GPUs need.

Each PATH is a *location*: a shard set (its folder or manifest.json; the shard files are read in manifest order)
or an image folder (ImageFolder layout; at most ``max_files`` files are listed). Each location is measured the
same way, on a ladder of parallel readers 1, 2, 4, ... up to ``max_readers``:

- **shards**: reader i of R reads shards i, i+R, i+2R, ... sequentially in ``READ_SIZE`` reads, so the readers
  never share a file.
- **images**: R threads take whole files from one shared queue, in listing order: small-file reads.

The ladder stops at the file count (more readers would sit idle) and says so.

Every step (one reader count, cold or warm) stops at the first of: ``seconds`` elapsed, ``bytes`` read (the
readers reserve each read from one shared budget, so a step never reads more), or the end of the data. A step's
``seconds`` is its own duration, from the first read to the last reader's end.

- **cold**: before the step every file of the location is written back (``fsync``, so no dirty page stays) and
  dropped from the page cache with ``posix_fadvise(POSIX_FADV_DONTNEED)``, which needs no root. Whether the pages
  really left is checked with ``mincore(2)`` on a sample of the files (``eviction``: ``confirmed``, ``not confirmed``
  with the share still cached, or ``requested`` where mincore cannot be called). On tmpfs and ramfs the files *are*
  the page cache: cold is not measurable there and is reported so.
- **warm**: the same reader count reads again from the start, up to the bytes the cold step read (the full
  ``bytes`` bound where there is no cold step), so it re-reads what is cached.

Files are opened through an *opener*: a callable from a path to a binary file with ``readinto``. Local files use
``local_open``; a remote shard set (``http(s)://``, ``s3://``, ``gs://`` folder or manifest URL, resolved by
:func:`gpufeed.shardset.source.open_set`) is read through :func:`gpufeed.shardset.source.open_shard` with the
manifest's shard sizes, in ``REMOTE_CHUNK_BYTES`` range requests, so each reader is one stream (one connection at
a time). A remote step has no cold/warm: nothing on this side caches the object store, so each rung is measured
once (``cache`` "remote"), and the report gives the aggregate and the per-stream MB/s (aggregate / readers). A
remote stream keeps one range in flight ahead; at a step's end that range is abandoned, so a step may leave up to
one ``REMOTE_CHUNK_BYTES`` request per reader finishing on the wire (not counted in any step), and a range under
way at the deadline is waited for, so a remote step may run past ``seconds`` by one range at its stream's rate.

With a target rate (``target_rate``, or the synthetic samples/s of a ``train --measure`` summary.json), each
location gets the bandwidth needed, ``rate x mean sample bytes / 1e6`` MB/s (the manifest's
``mean_sample_bytes``; for an image folder the mean size of the listed files), and a verdict: it *delivers* when
its best rate is at least ``MARGIN`` x that, cold where cold was measured (an epoch over a set larger than the
page cache reads cold), warm otherwise (a remote set: its remote rate). It also says whether the set fits in the
memory the page cache may use (psutil ``available``) and in /dev/shm's free space. The record's ``ok`` is false
when a target was given and no location delivers it (exit 1).
"""

from __future__ import annotations

import ctypes
import math
import mmap
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, Callable

from gpufeed.config import IoConfig
from gpufeed.measure.storage_rate import StorageRate
from gpufeed.core.errors import DataError
from gpufeed.core.records import read_json_file

READ_SIZE = 8 << 20
"""Bytes per read of a sequential reader (and of a large image file)."""
MARGIN = 1.2
"""A location delivers when its read rate is at least this factor times the rate needed."""
RAM_FILESYSTEMS = ("tmpfs", "ramfs")
"""Filesystems whose files live in the page cache: nothing to evict, cold is not measurable."""
EVICTION_CHECK_FILES = 64
"""Files of a location whose page-cache residency mincore checks after an eviction."""
EVICTION_CHECK_BYTES = 1 << 30
"""Bytes per file that mincore checks (the start of the file)."""
EVICTED_BELOW = 0.05
"""Eviction counts as confirmed when less than this share of the checked pages is still cached."""
SHORT_STEP_S = 0.5
"""A step that reads the whole location faster than this gives a noisy rate; the report says so."""
MAX_RECORD_BYTES = 64 << 20
"""Largest train summary.json read for its GPU ceiling."""
REMOTE_CHUNK_BYTES = 1 << 20
"""Bytes per range request of a remote reader (small, so a step's seconds bound is kept on a slow source)."""
STEP_GRACE_S = 5.0
"""Seconds past a step's ``seconds`` that a remote read under way may take before it is abandoned (a stalled or
trickling server then ends the step: ``shardset.source.reads_bounded_by``)."""
STEP_BOUND = "the io step's --seconds bound ran out while this read waited"
REMOTE_CACHE = "remote"
"""The ``cache`` of a remote step: no page cache on this side, so neither cold nor warm."""
REMOTE_COLD = "remote: no page cache on this side"
"""What the report says instead of a cold measurement for a remote set."""
IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff", ".ppm", ".pgm", ".pbm")
"""Files of an image folder that are read (case-insensitive); other files are not images and are left out."""

Opener = Callable[[str], BinaryIO]


def local_open(path: str) -> BinaryIO:
    """The local opener: an unbuffered binary file (reads go straight to the kernel)."""
    return open(path, "rb", buffering=0)


# --------------------------------------------------------------------------- records


@dataclass(frozen=True)
class IoStep:
    """One measurement step of one location."""

    readers: int
    cache: str
    """cold, warm, or remote (a remote set: no page cache on this side)."""
    mb_per_s: float
    """bytes / seconds / 1e6: the aggregate of all readers."""
    files_per_s: float
    """Whole files read per second (shards or images)."""
    bytes: int
    files: int
    """Files read to their end."""
    seconds: float
    """The step's own duration: first read to the last reader's end."""
    stopped_by: str
    """seconds, bytes (the bound was reached) or end (all the data was read)."""
    eviction: str | None = None
    """Cold steps: confirmed, not confirmed (X% still cached) or requested (not checkable here)."""
    per_stream_mb_per_s: float = 0.0
    """mb_per_s / readers: what one reader (one stream) got on average."""


@dataclass(frozen=True)
class IoNeed:
    """The bandwidth the target rate needs from one location, and the verdicts."""

    need_mb_per_s: float
    sample_bytes: float
    """Mean bytes per sample used (manifest mean_sample_bytes, or the mean listed file size)."""
    best_mb_per_s: float
    basis: str
    """cold, warm or remote: which rate the verdict uses."""
    delivers: bool
    """best_mb_per_s >= MARGIN x need_mb_per_s."""
    fits_page_cache: bool
    """The location's bytes fit in the memory the page cache may use (psutil available)."""
    fits_shm: bool | None
    """The location's bytes fit in /dev/shm's free space (None: no /dev/shm)."""


@dataclass(frozen=True)
class IoLocation:
    path: str
    kind: str
    """shards or images."""
    fs_type: str
    """The filesystem type, or the URL scheme (http, https, s3, gs) of a remote set."""
    mount: str
    """The mount point, or the host (bucket) of a remote set."""
    files: int
    """Files measured (shards of the manifest, or image files listed)."""
    total_bytes: int
    listing_truncated: bool
    """The image-folder walk stopped at max_files."""
    cold: str
    """measured, or why not (not measurable on tmpfs; REMOTE_COLD for a remote set)."""
    steps: list[IoStep]
    best_cold_mb_per_s: float | None
    best_warm_mb_per_s: float
    """The best rate of the steps that are not cold (the remote steps of a remote set)."""
    need: IoNeed | None = None
    remote: bool = False


@dataclass(frozen=True)
class IoReport:
    locations: list[IoLocation]
    target_rate: float | None
    target_source: str | None
    """--target-rate, or the summary.json the GPU ceiling came from."""
    seconds_per_step: float
    bytes_per_step: int
    max_readers: int
    page_cache_available_bytes: int
    shm_free_bytes: int | None
    ok: bool
    notes: list[str] = field(default_factory=list)
    run_dir: str | None = None
    wall_s: float = 0.0


# --------------------------------------------------------------------------- locations


@dataclass(frozen=True)
class _Location:
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


def _shards_here(m: Any, where: str) -> list[int]:
    """Indices of the shards a set holds: all of them, or for a set staged for one node (``gpufeed stage
    --num-nodes``, :func:`gpufeed.stage.staged_node`) that node's own, the only ones there and the only ones its
    loader reads."""
    from gpufeed.shardset.manifest import staged_node
    from gpufeed.core.world import node_shards

    staged = staged_node(m, where)
    return list(range(len(m.shards))) if staged is None else node_shards(len(m.shards), *staged)


def _shard_location(path: Path) -> _Location:
    from gpufeed.shardset.manifest import manifest_path, read_manifest

    m = read_manifest(path)
    root = manifest_path(path).parent
    if m.root:
        root = root / m.root
    files = []
    here = set(_shards_here(m, str(path)))
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
    return _Location(path, "shards", files, m.mean_sample_bytes, False)


def _image_location(path: Path, max_files: int) -> _Location:
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
    return _Location(path, "images", files, sum(s for _, s in files) / len(files), truncated)


def resolve_location(path: str | Path, max_files: int) -> _Location:
    """A shard set (folder with manifest.json, or a manifest .json; local or a remote URL) or an image folder."""
    from gpufeed.shardset.source import is_pipe, is_url

    if is_url(path):
        return _set_location(path, None)
    if is_pipe(path):
        raise DataError(f"{path}: gpufeed io measures folders and URLs, not pipe: commands")
    p = Path(path)
    if p.suffix == ".json" or (p / "manifest.json").exists():
        return _shard_location(p)
    if not p.is_dir():
        raise DataError(f"{p} is neither a shard set nor an image folder")
    return _image_location(p, max_files)


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


# --------------------------------------------------------------------------- the job


def default_max_readers() -> int:
    from gpufeed.core.system import usable_cpus

    return min(16, 4 * usable_cpus())


def gpu_ceiling(record_path: str) -> float:
    """The synthetic (compute-ceiling) samples/s of a ``train --measure`` summary.json; DataError if absent."""
    p = Path(record_path)
    data = read_json_file(p, MAX_RECORD_BYTES, "a train summary.json")
    modes = data.get("modes") if isinstance(data, dict) else None
    synthetic = modes.get("synthetic") if isinstance(modes, dict) else None
    rate = synthetic.get("samples_per_s") if isinstance(synthetic, dict) else None
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not math.isfinite(rate) or not 0 < rate <= 1e9:
        raise DataError(f"{p} holds no synthetic samples/s (run gpufeed train --measure to record the GPU ceiling)")
    return float(rate)


def _shm_free() -> int | None:
    try:
        st = os.statvfs("/dev/shm")
    except OSError:
        return None
    return st.f_bavail * st.f_frsize


def _measure_location(loc: _Location, cfg: IoConfig, max_readers: int, opener: Opener,
                      progress: Callable[[str], None] | None) -> tuple[IoLocation, list[str]]:
    fs_type, mount = filesystem_of(loc.path)
    cold_ok = not loc.remote and fs_type not in RAM_FILESYSTEMS and can_evict()
    if loc.remote:
        opener = remote_opener(loc.files)
    read_size = REMOTE_CHUNK_BYTES if loc.remote else READ_SIZE
    notes = []
    top = min(max_readers, len(loc.files))
    if top < max_readers:
        notes.append(f"{loc.path}: {len(loc.files)} file(s), so at most {top} reader(s) (a reader reads whole files)")
    steps: list[IoStep] = []

    def record(readers: int, cache: str, got: tuple[int, int, float, str], eviction: str | None) -> None:
        nbytes, files, secs, why = got
        secs = max(secs, 1e-9)
        rate = nbytes / secs / 1e6
        steps.append(IoStep(readers=readers, cache=cache, mb_per_s=rate, files_per_s=files / secs,
                            bytes=nbytes, files=files, seconds=secs, stopped_by=why, eviction=eviction,
                            per_stream_mb_per_s=rate / readers))
        if progress:
            per = f", {rate / readers:,.1f} MB/s per stream" if loc.remote else ""
            progress(f"  {loc.path} {readers:>3} reader(s) {cache}: {rate:,.1f} MB/s{per} "
                     f"({files / secs:,.1f} files/s, {why})")

    for readers in reader_ladder(top):
        limit = cfg.bytes
        if cold_ok:
            evict(loc.files)
            share = cached_fraction(loc.files)
            eviction = ("requested" if share is None else "confirmed" if share < EVICTED_BELOW
                        else f"not confirmed ({share:.0%} still cached)")
            got = run_step(loc.files, loc.kind, readers, seconds=cfg.seconds, limit=cfg.bytes, opener=opener)
            record(readers, "cold", got, eviction)
            limit = max(1, got[0])
        got = run_step(loc.files, loc.kind, readers, seconds=cfg.seconds, limit=limit, opener=opener,
                       read_size=read_size)
        record(readers, REMOTE_CACHE if loc.remote else "warm", got, None)
    if any(s.stopped_by == "end" and s.seconds < SHORT_STEP_S for s in steps):
        notes.append(f"{loc.path}: some steps read all {len(loc.files)} file(s) in under {SHORT_STEP_S:g} s; "
                     f"their rates are noisy (measure a larger set for steady figures)")
    cold = [s.mb_per_s for s in steps if s.cache == "cold"]
    return IoLocation(
        path=str(loc.path), kind=loc.kind, fs_type=fs_type, mount=mount, files=len(loc.files),
        total_bytes=sum(s for _, s in loc.files), listing_truncated=loc.truncated,
        cold=(REMOTE_COLD if loc.remote else "measured" if cold_ok else "not measurable here (no posix_fadvise)"
              if not can_evict() else f"not measurable on {fs_type} (its files are the page cache)"),
        steps=steps, best_cold_mb_per_s=max(cold) if cold else None,
        best_warm_mb_per_s=max(s.mb_per_s for s in steps if s.cache != "cold"), remote=loc.remote), notes


def measure_io(paths: list[str], cfg: IoConfig, *, opener: Opener = local_open,
               progress: Callable[[str], None] | None = None, write_run: bool = True) -> IoReport:
    """Measure every location of ``paths`` (design: this module's docstring) and write the run folder."""
    import dataclasses

    import psutil

    if not paths:
        raise DataError("give at least one PATH (a shard set or an image folder)")
    t0 = time.perf_counter()
    target, source = cfg.target_rate, "--target-rate" if cfg.target_rate is not None else None
    if cfg.gpu_ceiling is not None:
        target, source = gpu_ceiling(cfg.gpu_ceiling), cfg.gpu_ceiling
    max_readers = cfg.max_readers or default_max_readers()
    locs = [resolve_location(p, cfg.max_files) for p in paths]  # every input is checked before any reading
    available = int(psutil.virtual_memory().available)
    shm = _shm_free()
    measured, notes = [], []
    for loc in locs:
        if loc.truncated:
            notes.append(f"{loc.path}: listed the first {cfg.max_files} image files only (--max-files)")
        result, more = _measure_location(loc, cfg, max_readers, opener, progress)
        notes += more
        if target is not None:
            need = target * loc.sample_bytes / 1e6
            basis = ("cold" if result.best_cold_mb_per_s is not None else
                     REMOTE_CACHE if result.remote else "warm")
            best = result.best_cold_mb_per_s if result.best_cold_mb_per_s is not None else result.best_warm_mb_per_s
            result = dataclasses.replace(result, need=IoNeed(
                need_mb_per_s=need, sample_bytes=loc.sample_bytes, best_mb_per_s=best, basis=basis,
                delivers=best >= MARGIN * need, fits_page_cache=result.total_bytes <= available,
                fits_shm=None if shm is None else result.total_bytes <= shm))
        measured.append(result)
    ok = target is None or any(loc.need is not None and loc.need.delivers for loc in measured)
    report = IoReport(locations=measured, target_rate=target, target_source=source, seconds_per_step=cfg.seconds,
                      bytes_per_step=cfg.bytes, max_readers=max_readers, page_cache_available_bytes=available,
                      shm_free_bytes=shm, ok=ok, notes=notes, wall_s=time.perf_counter() - t0)
    if write_run:
        report = _write_run(report, cfg)
    return report


def _write_run(report: IoReport, cfg: IoConfig) -> IoReport:
    import dataclasses

    from gpufeed.core.records import atomic_write_text, make_run_dir, write_json
    from gpufeed.core.system import environment_snapshot

    run = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("io")
    run.mkdir(parents=True, exist_ok=True)
    report = dataclasses.replace(report, run_dir=str(run))
    write_json(run / "environment.json", environment_snapshot(with_torch=False))
    chart: str | None = CHART_NAME
    try:
        plot_io(report, run / CHART_NAME)
    except Exception as exc:  # a chart failure is noted, the records stand
        from gpufeed.core.errors import one_line

        chart = None
        report = dataclasses.replace(report, notes=[*report.notes, f"no chart: {one_line(exc)}"])
    write_json(run / "summary.json", report)
    atomic_write_text(run / "report.md", render_markdown(report, chart))
    return report


CHART_NAME = "io.png"


def render_markdown(report: IoReport, chart: str | None = CHART_NAME) -> str:
    """report.md of a ``gpufeed io`` run folder, as tune's and train's: the chart, then the text of :func:`render`
    (every step's numbers, as in summary.json; the need and fit lines; the notes)."""
    lines = ["# gpufeed io", ""]
    if chart:
        lines += [f"![MB/s per reader count]({chart})", ""]
    lines += ["```", render(report), "```", ""]
    return "\n".join(lines)


def plot_io(report: IoReport, path: str | Path) -> Path:
    """PNG: MB/s against the reader count, one panel per location, cold and warm (or remote) as lines, the need of
    the target rate as a dashed line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = max(1, len(report.locations))
    fig, axes = plt.subplots(1, n, figsize=(5.5 * n, 4), squeeze=False)
    for ax, loc in zip(axes[0], report.locations):
        for cache in dict.fromkeys(st.cache for st in loc.steps):
            steps = [st for st in loc.steps if st.cache == cache]
            ax.plot([st.readers for st in steps], [st.mb_per_s for st in steps], marker="o", label=cache)
        if loc.need is not None:
            ax.axhline(loc.need.need_mb_per_s, color="grey", ls="--", label="needed")
        ax.set_xscale("log", base=2)
        ladder = sorted({st.readers for st in loc.steps})
        ax.set_xticks(ladder, [str(r) for r in ladder])
        ax.minorticks_off()
        ax.set_xlabel("readers")
        ax.set_ylabel("MB/s")
        ax.set_title(str(loc.path)[-60:], fontsize=8)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    from gpufeed.core.records import atomic_writer

    try:
        with atomic_writer(path) as f:
            fig.savefig(f, format="png", dpi=100)
    finally:
        plt.close(fig)
    return Path(path)


# --------------------------------------------------------------------------- text


def _gb(n: float) -> str:
    """A byte count in GB, or in MB below 1 GB."""
    return f"{n / 1e9:,.1f} GB" if n >= 1e9 else f"{n / 1e6:,.1f} MB"


def render(report: IoReport) -> str:
    lines = [f"gpufeed io: {len(report.locations)} location(s), <= {report.seconds_per_step:g} s and "
             f"<= {_gb(report.bytes_per_step)} per step, up to {report.max_readers} reader(s)"]
    for loc in report.locations:
        lines.append("")
        where = (f"{loc.fs_type} from {loc.mount or '?'}; {loc.cold}" if loc.remote else
                 f"{loc.fs_type} on {loc.mount or '?'}; cold {loc.cold}")
        lines.append(f"{loc.path}  ({loc.kind}, {loc.files} files, {_gb(loc.total_bytes)}, {where})")
        if loc.remote:
            lines.append(f"  {'streams':>7}  {'MB/s':>10}  {'per stream':>10}  {'files/s':>10}  {'MB read':>9}  "
                         f"{'seconds':>7}  stopped by")
            for s in loc.steps:
                lines.append(f"  {s.readers:>7}  {s.mb_per_s:>10,.1f}  {s.per_stream_mb_per_s:>10,.1f}  "
                             f"{s.files_per_s:>10,.1f}  {s.bytes / 1e6:>9,.1f}  {s.seconds:>7.2f}  {s.stopped_by}")
        else:
            lines.append(f"  {'readers':>7}  {'cache':<5}  {'MB/s':>10}  {'files/s':>10}  {'MB read':>9}  "
                         f"{'seconds':>7}  {'stopped by':<10}  eviction")
            for s in loc.steps:
                lines.append(f"  {s.readers:>7}  {s.cache:<5}  {s.mb_per_s:>10,.1f}  {s.files_per_s:>10,.1f}  "
                             f"{s.bytes / 1e6:>9,.1f}  {s.seconds:>7.2f}  {s.stopped_by:<10}  {s.eviction or '-'}")
        if loc.need is not None:
            n = loc.need
            verdict = "delivers it" if n.delivers else "does NOT deliver it"
            lines.append(f"  need: {report.target_rate:,.1f} samples/s x {n.sample_bytes:,.0f} B = "
                         f"{n.need_mb_per_s:,.1f} MB/s; best {n.basis} {n.best_mb_per_s:,.1f} MB/s {verdict} "
                         f"with {MARGIN:g}x margin")
            shm = ("no /dev/shm" if n.fits_shm is None else
                   f"{'fits' if n.fits_shm else 'does NOT fit'} in /dev/shm ({_gb(report.shm_free_bytes or 0)} free)")
            lines.append(f"  fit: {_gb(loc.total_bytes)} {'fits' if n.fits_page_cache else 'does NOT fit'} in the "
                         f"page cache ({_gb(report.page_cache_available_bytes)} RAM available); {shm}")
    if report.target_rate is not None:
        lines.append("")
        lines.append(f"target: {report.target_rate:,.1f} samples/s ({report.target_source})")
    for note in report.notes:
        lines.append(f"note: {note}")
    if report.run_dir:
        lines.append(f"run folder: {report.run_dir}")
    return "\n".join(lines)


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
        loc = _set_location(location, manifest)
    else:
        loc = resolve_location(location, 100_000)
    if loc.remote:
        cold, opener, read_size = False, remote_opener(loc.files), REMOTE_CHUNK_BYTES
    else:
        fs_type, _ = filesystem_of(loc.path)
        cold, read_size = fs_type not in RAM_FILESYSTEMS and can_evict(), READ_SIZE
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


def _set_location(spec: str | Path, manifest: str | Path | None) -> _Location:
    """The shard set the loader reads (open_set of ``spec`` and ``manifest``), sizes from the manifest."""
    from gpufeed.shardset.source import open_set

    ss = open_set(spec, manifest)
    here = _shards_here(ss.manifest, ss.location)
    files = [(ss.urls[i], ss.manifest.shards[i].bytes) for i in here]
    return _Location(str(spec), "shards", files, ss.manifest.mean_sample_bytes, False, remote=ss.remote)


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


def io_record_rate(record_path: str | Path, shards: str | Path) -> StorageRate:
    """The storage rate of the shard set ``shards`` from a ``gpufeed io`` summary.json: the location whose folder
    is the shard set's folder (or URL), its best cold rate (warm where cold was not measured; remote for a URL).
    DataError (one sentence) when the file is not such a record or measured another location."""
    p = Path(record_path)
    data = read_json_file(p, MAX_RECORD_BYTES, "a gpufeed io summary.json")
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
