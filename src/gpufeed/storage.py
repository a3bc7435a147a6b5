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

import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from gpufeed.config import IoConfig
from gpufeed.core.errors import DataError
from gpufeed.core.records import read_json_file
from gpufeed.measure.storage_probe import (MAX_RECORD_BYTES, RAM_FILESYSTEMS, REMOTE_CACHE, Location, Opener,
                                           cached_fraction, can_evict, default_max_readers, evict, filesystem_of,
                                           local_open, reader_ladder, reading, resolve_location, run_step)

MARGIN = 1.2
"""A location delivers when its read rate is at least this factor times the rate needed."""
EVICTED_BELOW = 0.05
"""Eviction counts as confirmed when less than this share of the checked pages is still cached."""
SHORT_STEP_S = 0.5
"""A step that reads the whole location faster than this gives a noisy rate; the report says so."""
REMOTE_COLD = "remote: no page cache on this side"
"""What the report says instead of a cold measurement for a remote set."""


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


# --------------------------------------------------------------------------- the job



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


def _measure_location(loc: Location, cfg: IoConfig, max_readers: int, opener: Opener,
                      progress: Callable[[str], None] | None) -> tuple[IoLocation, list[str]]:
    fs_type, mount = filesystem_of(loc.path)
    cold_ok = not loc.remote and fs_type not in RAM_FILESYSTEMS and can_evict()
    opener, read_size = reading(loc, opener)
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


