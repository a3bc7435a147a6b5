"""``gpufeed stage SRC DEST``: copy a shard set to fast local storage (NVMe, a RAM disk) before training.

SRC is a shard-set folder or its ``manifest.json``, local or a URL (``http(s)://``, ``s3://``, ``gs://``, read
through :mod:`gpufeed.shardset.source`); DEST is a local folder. In order:

1. The manifest is read and every source shard (of this node: see Node subsets) is checked to be a regular file of
   the size the manifest records (a missing or resized shard is an input error, exit 2, before anything is
   copied). For a remote SRC the sizes are asked of the server (``--jobs`` requests at a time); a shard the
   server does not have (404), refuses (403) or cannot be reached is named in one sentence, exit 2.
2. ``DEST/.gpufeed-stage/lock`` is taken (``flock``; a second run into the same DEST is refused, naming the pid;
   the lock dies with the process, so a run killed with -9 leaves nothing the next run must clear). Temporary
   files a killed run left (``DEST/.<shard>.tmp``) are removed.
3. Resume: a shard already at DEST is kept when its size matches and its sha256 matches the manifest, proven
   either by its sidecar ``DEST/.gpufeed-stage/<shard>.done.json`` (size, mtime_ns and sha256 written after the
   rename; a file changed since has another mtime or size) or, without a sidecar, by re-hashing it. A manifest
   without sha256 (``gpufeed index --no-hash``) can only be compared by size: such a shard is kept only with a
   sidecar written by an earlier stage run, and the report says the copies were checked by size and tar structure only.
4. Free space: the bytes still to copy (plus 1%) must fit in ``shutil.disk_usage(DEST).free``. When DEST is on
   tmpfs/ramfs (``/dev/shm``) the staged set lives in RAM: the report (and a refusal) names how much, next to
   the RAM available now (``psutil.virtual_memory().available``), since it comes out of the page cache.
5. Copy: a bounded thread pool (``--jobs``, default min(8, shards to copy); the work is I/O) streams each shard
   in ``CHUNK_BYTES`` reads into ``DEST/.<shard>.tmp``, hashing as it goes, fsyncs it, checks size and sha256
   against the manifest, renames it to its name, fsyncs the folder and writes the sidecar. A shard whose bytes
   differ from the manifest is refused (:class:`RunError`, exit 1, naming it) and its temporary file removed;
   the other copies stop at their next chunk. Ctrl-C stops the same way; complete shards are kept.
6. ``index.parquet`` and ``_info.json`` next to the SRC manifest are copied (atomically) when present (for a
   remote SRC: when the server has them; a 404 means absent; for a local SRC each is checked before anything is
   copied: a regular file of at most ``MAX_SIDE_BYTES``, not a symbolic link out of the SRC folder, else exit 2
   naming it: :mod:`gpufeed.core.safefs`); the other readers' indexes (``_info.json``,
   ``wids.json``, DALI's ``.idx`` files: :mod:`gpufeed.shardset.sidecars`) are then written for the shards staged here,
   and last
   the manifest is written to ``DEST/manifest.json`` with ``root`` None (the shards sit next to it), the same
   shards and counts otherwise: ``tune``, ``train`` and ``verify`` use DEST directly. While a run copies, a DEST
   manifest from an earlier run is removed first, so its presence still means the set at DEST is complete.

Node subsets: with ``--num-nodes N`` (N > 1) and ``--node-rank n`` (each taken from the launcher's environment
when not given: torchrun's GROUP_RANK / GROUP_WORLD_SIZE, else SLURM's SLURM_NODEID / SLURM_JOB_NUM_NODES; the
command line wins) only node n's shards are checked, counted for free space and copied: the shards ``i`` with
``i % N == n`` (:func:`gpufeed.core.world.node_shards`, the rule the loader's ``shard_split = "node"`` reads by). DEST's
manifest still lists every shard of the set (counts, sizes and sha256 unchanged, so every node's loader computes
the same batch count) and records the node in ``options["staged_node"]`` (``{"node_rank", "num_nodes",
"num_shards"}``, read back by :func:`staged_node`, which validates it). The loader refuses such a set under
``shard_split = "global"``; ``gpufeed verify`` checks only the shards staged here. N must not exceed the shards.

Sources are opened through :class:`LocalSource` or :class:`RemoteSource` (``open(name)`` gives a binary file
object, ``size(name)`` the size, ``path(name)`` the location named in messages); the copy (:func:`copy_shard`)
only reads from the object it is given. A remote shard is streamed in range requests (``open_shard``: retried
within its bound, never held whole in memory) and hashed as it is written. A read that fails mid-copy after the
retries is a RunError (exit 1) naming the URL. Shard names come from the manifest, which checked them to be plain
file names; a remote shard's URL is the user's URL plus the quoted name (``open_set``).

``GPUFEED_STAGE_CHUNK_BYTES`` overrides the read size; only the tests use it (to make a copy slow enough to kill).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import stat
import threading
import time
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, BinaryIO, Callable, Iterator

from gpufeed.config import MAX_NODES, StageConfig
from gpufeed.core.errors import DataError, RunError
from gpufeed.shardset.manifest import INDEX_NAME, MANIFEST_NAME, TIMM_INFO_NAME, Manifest, ShardInfo, manifest_path, \
    read_manifest, shard_root, write_manifest
from gpufeed.core.dest import (LOCK_NAME, done_path, publish, read_done, release_lock, remove_temps, take_lock,
                               temp_path, write_done)
from gpufeed.core.records import atomic_writer, fsync_dir
from gpufeed.core.world import node_from_env, node_shards
from gpufeed.shardset.manifest import STAGED_NODE

STATE_DIR = ".gpufeed-stage"
CHUNK_BYTES = 8 << 20
"""Bytes per read of a source shard (8 MiB)."""
MAX_JOBS_DEFAULT = 8
"""Default concurrent copies (at most one per shard to copy)."""
SPACE_MARGIN = 0.01
"""Free space required beyond the bytes to copy: 1% of them."""
SIDE_FILES = (INDEX_NAME, TIMM_INFO_NAME)
"""Files next to the SRC manifest that are copied along when present."""
_RAM_FS = ("tmpfs", "ramfs")
_MAX_SIDECAR_BYTES = 4096
NODE_REMINDER = ('train with [loader] shard_split = "node" (the global split refuses this set: the other nodes\' '
                 'shards are not here)')


@dataclass(frozen=True)
class StageReport:
    src: str
    """The SRC manifest read (a path or URL; a brace pattern as given)."""
    dest: str
    num_shards: int
    shards_copied: int
    shards_kept: int
    """Shards already complete at DEST (resume), not copied again."""
    bytes_copied: int
    bytes_kept: int
    elapsed_s: float
    mb_per_s: float
    """Bytes copied / elapsed seconds, in MB/s (10^6)."""
    jobs: int
    checked: str
    """"sha256", or "size" when the manifest has no sha256 for some shards (indexed with --no-hash)."""
    ram_fs: bool
    """DEST is on tmpfs/ramfs: the staged set is held in RAM."""
    manifest: str
    warnings: list[str] = field(default_factory=list)
    ok: bool = True
    node_rank: int | None = None
    """The node staged for (``--num-nodes`` > 1); None = the whole set."""
    num_nodes: int = 1
    set_shards: int = 0
    """Shards of the whole set (``num_shards`` counts those staged here)."""




def node_of(cfg: StageConfig, environ: dict[str, str] | None = None) -> tuple[int, int]:
    """``(node_rank, num_nodes)`` to stage for: the command line's, each missing one from the launcher's environment
    (:func:`gpufeed.core.world.node_from_env`; ignored when its node count differs from the command line's), else node 0
    of 1. Refuses a rank outside 0..num_nodes-1."""
    env_rank, env_nodes = node_from_env(environ)
    if cfg.num_nodes is not None and env_nodes != cfg.num_nodes:
        env_rank = env_nodes = None
    num_nodes = cfg.num_nodes if cfg.num_nodes is not None else (env_nodes or 1)
    node_rank = cfg.node_rank if cfg.node_rank is not None else (env_rank or 0)
    if not 1 <= num_nodes <= MAX_NODES or not 0 <= node_rank < num_nodes:
        raise DataError(f"node rank {node_rank} of {num_nodes} node(s) (from the command line or the launcher's "
                        f"environment) must be in 0..num_nodes-1")
    return node_rank, num_nodes


class LocalSource:
    """Shards of a local folder. The interface a remote source (fsspec) would implement: ``problem(name)`` (why
    a shard cannot be read, or None), ``size(name)`` and ``open(name)`` (a binary file object, read sequentially)."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> str:
        return str((self.root / name).absolute())

    def problem(self, name: str) -> str | None:
        from gpufeed.shardset.tar import file_problem

        return file_problem(self.path(name), self.root)  # a symbolic link out of the set is refused

    def size(self, name: str) -> int:
        return os.stat(self.path(name)).st_size

    def open(self, name: str) -> BinaryIO:
        # safefs: a FIFO or a link out of the set swapped in after problem() is refused, never read
        from gpufeed.core.safefs import open_set_file

        try:
            fd = open_set_file(self.path(name), self.root, what="source shard")
        except DataError as exc:
            raise RunError(str(exc)) from None
        return os.fdopen(fd, "rb", buffering=0)


class RemoteSource:
    """Shards of a remote set (:func:`gpufeed.shardset.source.open_set`): the same interface as LocalSource.
    ``problem`` asks the server for the size (one request; SourceError reasons such as "not found (HTTP 404)")
    and remembers it; ``open`` streams the shard with that size, so a copy never reads past it."""

    def __init__(self, names: list[str], urls: list[str]) -> None:
        self.urls = dict(zip(names, urls))
        self.sizes: dict[str, int] = {}

    def path(self, name: str) -> str:
        return self.urls[name]

    def problem(self, name: str) -> str | None:
        from gpufeed.shardset.source import SourceError, remote_size

        try:
            self.sizes[name] = remote_size(self.urls[name])
        except SourceError as exc:
            return f"cannot be read: {str(exc).removeprefix(self.urls[name] + ': ')}"
        return None

    def size(self, name: str) -> int:
        if name not in self.sizes:
            why = self.problem(name)
            if why:
                raise DataError(f"source shard {self.urls[name]} {why}")
        return self.sizes[name]

    def open(self, name: str) -> BinaryIO:
        from gpufeed.shardset.source import open_shard

        return open_shard(self.urls[name], size=self.size(name), chunk_bytes=chunk_bytes())


def chunk_bytes() -> int:
    raw = os.environ.get("GPUFEED_STAGE_CHUNK_BYTES", "")
    return max(1, min(int(raw), CHUNK_BYTES)) if raw.isdigit() else CHUNK_BYTES


@contextlib.contextmanager
def _writing(path: Path, outcome: str) -> Iterator[None]:
    """Turn an OSError met while writing ``path`` (a full disk, a quota, an I/O error) into the RunError of a
    started run (exit 1) naming the file and the reason, ending with ``outcome``."""
    try:
        yield
    except OSError as exc:
        raise RunError(f"cannot write {exc.filename or path} ({exc.strerror or exc}); {outcome}") from None


def copy_mode(src: Any) -> int:
    """The mode a copy of the open file ``src`` is created with: ``0666`` (less the umask), and never a
    permission its source lacks (a local source's mode bits; a remote one has none to keep)."""
    try:
        return 0o666 & os.fstat(src.fileno()).st_mode
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is an OSError and a ValueError
        return 0o666


def _check_unhashed_copy(path: Path, info: ShardInfo, where: str) -> None:
    """For a shard the manifest gives no sha256: the copy must read as a tar (every header, the end blocks)
    holding the manifest's samples (and key sequence, when it has one), else RunError; the reason never quotes
    the file."""
    from gpufeed.shardset.keys import READ_IMAGE_EXTENSIONS
    from gpufeed.shardset.tar import ShardRead, iter_samples

    read, total = ShardRead(), [0]
    try:  # read under the shard's name: a .tgz is read as gzip
        for _ in iter_samples(info.name, frozenset(), READ_IMAGE_EXTENSIONS, total=total, stream=True,
                              fileobj=open(path, "rb"), seekable=True, read=read):
            pass
    except Exception:  # noqa: BLE001 - whatever it fails on, the message never quotes the file
        raise RunError(f"source shard {where} does not read as a tar (the manifest has no sha256 for it, so its "
                       f"structure was checked); it was not staged") from None
    if total[0] != info.num_samples:
        raise RunError(f"source shard {where} holds {total[0]} samples, the manifest says {info.num_samples}; it was "
                       f"not staged")
    if info.keys_sha256 and read.keys.hexdigest() != info.keys_sha256:
        raise RunError(f"source shard {where} holds other sample keys than the manifest's keys_sha256; it was not "
                       f"staged")


def copy_shard(source: LocalSource | RemoteSource, info: ShardInfo, dest: Path, *, chunk: int, stop: threading.Event,
               progress: Callable[[int], None]) -> str:
    """Copy one shard to ``dest/.<name>.tmp`` (hashing as it reads), fsync, check size and sha256 against
    ``info``, rename it to ``dest/<name>`` and return its sha256. Raises RunError (naming the shard) on a
    mismatch or a remote read that failed after its retries, with the temporary file removed; stops with
    RunError when ``stop`` is set."""
    from gpufeed.shardset.source import SourceError

    tmp = Path(temp_path(dest, info.name))
    final = dest / info.name
    h = hashlib.sha256()
    got = 0
    limit = info.bytes + 1  # read at most one byte past the promised size: a grown source is refused, not copied
    try:
        with source.open(info.name) as src:
            with _writing(tmp, f"{info.name} was not staged"):
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, copy_mode(src))
            with os.fdopen(fd, "wb") as out:
                while got < limit:
                    if stop.is_set():
                        raise RunError(f"copy of {info.name} stopped")
                    try:
                        data = src.read(min(chunk, limit - got))
                    except SourceError as exc:  # found while copying: the run failed (exit 1)
                        raise RunError(f"{exc}; {info.name} was not staged") from None
                    if not data:
                        break
                    h.update(data)
                    with _writing(tmp, f"{info.name} was not staged"):
                        out.write(data)
                    got += len(data)
                    progress(len(data))
                with _writing(tmp, f"{info.name} was not staged"):
                    out.flush()
                    os.fsync(out.fileno())
        if got != info.bytes:
            size = "grew past" if got > info.bytes else f"is {got} bytes, not"
            raise RunError(f"source shard {source.path(info.name)} {size} the {info.bytes} bytes the manifest says; "
                           f"it was not staged")
        digest = h.hexdigest()
        if info.sha256 is not None and digest != info.sha256:
            raise RunError(f"source shard {source.path(info.name)} has sha256 {digest[:16]}..., the manifest says "
                           f"{info.sha256[:16]}...; it is corrupt and was not staged")
        if info.sha256 is None:
            _check_unhashed_copy(tmp, info, source.path(info.name))
        with _writing(final, f"{info.name} was not staged"):
            publish(dest, info.name)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise
    fsync_dir(dest)
    return digest


def stage(cfg: StageConfig, *, progress: bool = True) -> StageReport:
    """Stage the shard set ``cfg.src`` into ``cfg.dest`` (module docstring). Returns the report; raises DataError
    (exit 2) for a problem found before copying, RunError (exit 1) for one found while copying."""
    t0 = time.perf_counter()
    if cfg.src is None or cfg.dest is None:
        raise DataError("stage needs SRC (a shard set) and DEST (a folder)")
    node_rank, num_nodes = node_of(cfg)
    from gpufeed.shardset.source import is_url

    dest = Path(cfg.dest)
    if dest.exists() and not dest.is_dir():
        raise DataError(f"DEST {dest} is not a folder")
    src_dirs: list[Path] = []
    if is_url(str(cfg.src)):
        m, source, src_label, sides = _remote_src(str(cfg.src), cfg.jobs, node_rank, num_nodes)
        mine = _node_subset(m, node_rank, num_nodes)
    else:
        src_manifest = manifest_path(cfg.src)
        m = read_manifest(cfg.src)
        mine = _node_subset(m, node_rank, num_nodes)
        src_root = shard_root(m, cfg.src)
        source = LocalSource(src_root)
        src_label, src_dirs = str(src_manifest), [src_root, src_manifest.parent]
        sides = _local_sides(src_manifest.parent)
        for info in mine:
            why = source.problem(info.name)
            if why:
                raise DataError(f"source shard {source.path(info.name)} {why}")
    for info in mine:
        size = source.size(info.name)
        if size != info.bytes:
            raise DataError(f"source shard {source.path(info.name)} is {size} bytes, the manifest says {info.bytes}")
    dest.mkdir(parents=True, exist_ok=True)
    if any(dest.resolve() == d.resolve() for d in src_dirs):
        raise DataError(f"DEST {dest} is the SRC folder; choose another folder")
    state = dest / STATE_DIR
    from gpufeed.core.safefs import make_state_folder

    make_state_folder(state, what="stage state folder")  # a link there is refused: its target would get our files
    lock = _lock(state / LOCK_NAME, dest)
    try:
        return _run(cfg, m, src_label, sides, source, dest, state, progress, t0, mine,
                    node_rank if num_nodes > 1 else None, num_nodes)
    finally:
        release_lock(lock)


@dataclass(frozen=True)
class _Side:
    """A file next to the SRC manifest that is copied along (index.parquet, _info.json)."""

    name: str
    size: int
    open: Callable[[], BinaryIO]


MAX_SIDE_BYTES = 16 << 30
"""A side file (``index.parquet``, ``_info.json``) of a local SRC larger than this (16 GiB) is refused."""


def _local_sides(folder: Path) -> list[_Side]:
    """The side files next to a local SRC manifest, each checked now (:func:`gpufeed.core.safefs.open_set_file`: a
    regular file of at most ``MAX_SIDE_BYTES``, no symbolic link out of ``folder``; refused in one sentence naming
    it, before anything is copied) and opened the same way when it is copied."""
    from gpufeed.core.safefs import open_set_file

    sides = []
    for name in SIDE_FILES:
        path = folder / name
        try:
            fd = open_set_file(path, folder, max_bytes=MAX_SIDE_BYTES, what=f"SRC's {name}")
        except FileNotFoundError:
            continue  # absent (or a link inside the set to nothing): not copied, as before
        try:
            size = os.fstat(fd).st_size
        finally:
            os.close(fd)
        sides.append(_Side(name, size, _opener(path, folder)))
    return sides


def _opener(path: Path, folder: Path) -> Callable[[], BinaryIO]:
    from gpufeed.core.safefs import open_set_file

    return lambda: os.fdopen(open_set_file(path, folder, max_bytes=MAX_SIDE_BYTES, what=f"SRC's {path.name}"), "rb")


def _node_subset(m: Manifest, node_rank: int, num_nodes: int) -> list[ShardInfo]:
    """The shards node ``node_rank`` of ``num_nodes`` stages (all of them for one node)."""
    if num_nodes > len(m.shards):
        raise DataError(f"--num-nodes {num_nodes} is more than the set's {len(m.shards)} shard(s): every node needs at "
                        f"least one")
    return [m.shards[i] for i in node_shards(len(m.shards), node_rank, num_nodes)]


def _remote_src(src: str, jobs: int | None, node_rank: int = 0, num_nodes: int = 1
                ) -> tuple[Manifest, RemoteSource, str, list[_Side]]:
    """A remote SRC: its manifest (open_set), the source with the size of every shard node ``node_rank`` of
    ``num_nodes`` stages asked of the server (``jobs`` requests at a time; the first shard that cannot be read is
    a DataError naming it), the manifest URL, and the side files the server has next to the manifest (none for a
    brace pattern)."""
    from gpufeed.shardset.source import SourceError, open_set, open_shard, remote_size

    ss = open_set(src)
    source = RemoteSource([info.name for info in ss.manifest.shards], ss.urls)
    names = [info.name for info in _node_subset(ss.manifest, node_rank, num_nodes)]
    pattern = ("{" in src and "}" in src) or src.endswith((".tar", ".tgz", ".tar.gz"))
    base = src.rstrip("/")
    folder = base.rsplit("/", 1)[0] if base.endswith(".json") else base
    label = src if pattern else (base if base.endswith(".json") else f"{folder}/{MANIFEST_NAME}")
    with ThreadPoolExecutor(max_workers=max(1, min(jobs or MAX_JOBS_DEFAULT, len(names))),
                            thread_name_prefix="gpufeed-stage-size") as pool:
        for name, why in zip(names, pool.map(source.problem, names)):
            if why:
                raise DataError(f"source shard {source.path(name)} {why}")
    sides = []
    for name in () if pattern else SIDE_FILES:
        url = f"{folder}/{name}"
        try:
            size = remote_size(url)
        except SourceError as exc:
            if str(exc).endswith("not found (HTTP 404)"):
                continue  # the server has no such file next to the manifest
            raise
        sides.append(_Side(name, size, lambda url=url, size=size: open_shard(url, size=size)))
    return ss.manifest, source, label, sides


def _run(cfg: StageConfig, m: Manifest, src_label: str, sides: list[_Side], source: LocalSource | RemoteSource,
         dest: Path, state: Path, progress: bool, t0: float, mine: list[ShardInfo], node_rank: int | None,
         num_nodes: int) -> StageReport:
    """Stage the shards ``mine`` (node ``node_rank`` of ``num_nodes``'s, or all of ``m``'s with ``node_rank``
    None) and write DEST's manifest, listing every shard of ``m``."""
    _refuse_other_set(dest, m)
    # temporaries of a killed run: this run holds the lock, nobody else writes them
    remove_temps(dest, [info.name for info in m.shards])
    kept = [info for info in mine if _complete(dest, state, info)]
    kept_names = {i.name for i in kept}
    todo = [info for info in mine if info.name not in kept_names]
    need = sum(i.bytes for i in todo) + sum(side.size for side in sides)
    ram_fs = _on_ram_fs(dest)
    warnings = []
    ram_note = ""
    if ram_fs:
        import psutil

        staged = sum(i.bytes for i in mine)
        ram_note = (f"DEST {dest} is on a RAM file system: the staged set holds {_mb(staged)} of RAM, out of the page "
                    f"cache ({_mb(psutil.virtual_memory().available)} available now)")
        warnings.append(ram_note)
    free = shutil.disk_usage(dest).free
    if need + int(need * SPACE_MARGIN) > free:
        raise DataError(f"DEST {dest} has {_mb(free)} free, staging needs {_mb(need)} plus a 1% margin"
                        + (f"; {ram_note}" if ram_note else ""))
    unhashed = sum(i.sha256 is None for i in mine)
    if unhashed:
        warnings.append(f"the manifest has no sha256 for {unhashed} shard(s) (indexed with --no-hash): their copies "
                        f"were checked by size and tar structure only")
    jobs = cfg.jobs if cfg.jobs is not None else min(MAX_JOBS_DEFAULT, max(1, len(todo)))
    if todo:
        try:  # the set at DEST is incomplete until this run writes the manifest again
            os.unlink(dest / MANIFEST_NAME)
        except FileNotFoundError:
            pass
        _copy_all(source, todo, dest, state, jobs, progress)
    for side in sides:
        with _writing(dest / side.name, "the set at DEST is incomplete"):
            with side.open() as f, atomic_writer(dest / side.name, limit=copy_mode(f)) as out:
                copied = 0
                while data := f.read(min(CHUNK_BYTES, side.size + 1 - copied)):  # never more than it said, plus 1
                    out.write(data)
                    copied += len(data)
                    if copied > side.size:
                        raise RunError(f"SRC's {side.name} grew while it was copied; it was not staged")
    from gpufeed.shardset.sidecars import write_sidecars

    # the other readers' indexes, for the shards staged here (their paths relative to DEST; _info.json rewritten)
    with _writing(dest, "the set at DEST is incomplete"):
        warnings += write_sidecars(str(dest), mine, [str(dest / i.name) for i in mine], prefix=m.prefix,
                                   num_classes=len(m.classes), compression=m.compression,
                                   name=dest.name or "gpufeed")
    options = {k: v for k, v in m.options.items() if k != STAGED_NODE}  # a record of SRC's own staging is not ours
    if node_rank is not None:
        options[STAGED_NODE] = {"node_rank": node_rank, "num_nodes": num_nodes, "num_shards": len(mine)}
    with _writing(dest / MANIFEST_NAME, "the set at DEST is incomplete"):
        out_manifest = write_manifest(dest, replace(m, root=None, options=options))
    elapsed = time.perf_counter() - t0
    copied = sum(i.bytes for i in todo)
    return StageReport(
        src=src_label, dest=str(dest), num_shards=len(mine), shards_copied=len(todo),
        shards_kept=len(kept), bytes_copied=copied, bytes_kept=sum(i.bytes for i in kept), elapsed_s=elapsed,
        mb_per_s=copied / 1e6 / elapsed if elapsed > 0 else 0.0, jobs=jobs,
        checked="size" if unhashed else "sha256", ram_fs=ram_fs, manifest=str(out_manifest), warnings=warnings,
        node_rank=node_rank, num_nodes=num_nodes, set_shards=len(m.shards))


def _copy_all(source: LocalSource | RemoteSource, todo: list[ShardInfo], dest: Path, state: Path, jobs: int,
              progress: bool) -> None:
    """Copy ``todo`` with ``jobs`` threads; the first failure (or Ctrl-C) stops the others at their next chunk and
    is raised once they have cleaned up."""
    bar = None
    if progress:
        from gpufeed.core.progress import bar as progress_bar

        bar = progress_bar(total=sum(i.bytes for i in todo), desc="stage", unit="B", unit_scale=True,
                           unit_divisor=1000, smoothing=0.1)
    lock = threading.Lock()

    def tick(n: int) -> None:
        if bar is not None:
            with lock:
                bar.update(n)

    stop = threading.Event()
    chunk = chunk_bytes()

    def one(info: ShardInfo) -> None:
        digest = copy_shard(source, info, dest, chunk=chunk, stop=stop, progress=tick)
        st = os.stat(dest / info.name)
        with _writing(Path(done_path(state, info.name)), f"{info.name} was staged but its record was not written"):
            _record(state, info.name, st, digest)

    pool = ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="gpufeed-stage")
    try:
        futures = [pool.submit(one, info) for info in todo]
        wait(futures, return_when=FIRST_EXCEPTION)
        failed = next((f for f in futures if f.done() and not f.cancelled() and f.exception() is not None), None)
        if failed is not None:
            stop.set()
            for f in futures:
                f.cancel()
            raise failed.exception()  # type: ignore[misc]
    finally:
        stop.set()  # Ctrl-C (or a failure): running copies stop at their next chunk and remove their temporaries
        pool.shutdown(wait=True, cancel_futures=True)
        if bar is not None:
            bar.close()


def _complete(dest: Path, state: Path, info: ShardInfo) -> bool:
    """Whether ``dest/<name>`` already holds this shard: its size matches and its sha256 matches, by its sidecar
    (same size and mtime as when it was written) or by re-hashing it (then the sidecar is written). Without a
    sha256 in the manifest only a sidecar can vouch for it."""
    path = dest / info.name
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    if not stat.S_ISREG(st.st_mode) or st.st_size != info.bytes:
        return False
    side = read_done(state, info.name, _MAX_SIDECAR_BYTES, what="stage sidecar")  # never through a link out
    if side is not None and side.get("size") == st.st_size and side.get("mtime_ns") == st.st_mtime_ns and (
            info.sha256 is None or side.get("sha256") == info.sha256):
        return True
    if info.sha256 is None:
        return False
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while data := f.read(CHUNK_BYTES):
            h.update(data)
    if h.hexdigest() != info.sha256:
        return False
    _record(state, info.name, st, info.sha256)
    return True


def _record(state: Path, name: str, st: os.stat_result, sha256: str) -> None:
    """The sidecar of a staged shard (:func:`gpufeed.core.dest.write_done`): its size, mtime_ns and sha256."""
    write_done(state, name, {"name": name, "size": st.st_size, "mtime_ns": st.st_mtime_ns, "sha256": sha256},
               pretty=True)


def _refuse_other_set(dest: Path, m: Manifest) -> None:
    """Refuse a DEST whose manifest lists other shards or classes: staging would mix two sets."""
    if not (dest / MANIFEST_NAME).exists():
        return
    try:
        old = read_manifest(dest)
    except DataError:
        return  # an unreadable manifest is replaced at the end like any stale one
    if old.shards != m.shards or old.classes != m.classes:
        raise DataError(f"DEST {dest} holds another shard set (its {MANIFEST_NAME} lists other shards or classes); "
                        f"choose an empty folder or remove that set first")


def _on_ram_fs(path: Path) -> bool:
    """Whether ``path`` is on tmpfs or ramfs (:func:`gpufeed.core.system.mount_of`); False where unknown."""
    from gpufeed.core.system import mount_of

    return mount_of(path)[2] in _RAM_FS


def _lock(path: Path, dest: Path) -> int:
    """An exclusive ``flock`` on ``path`` for the whole run, recording this pid (:func:`gpufeed.core.dest.take_lock`);
    a held lock is refused naming its holder. Close-on-exec, so it dies with this process."""
    return take_lock(path, what="stage lock", in_use=lambda who: (f"DEST {dest} is in use by another `gpufeed stage` "
                                                                 f"run{who}; wait for it to finish"))


def _mb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def render_stage(r: StageReport) -> str:
    """One line for the summary, then one per warning."""
    rate = f"{r.mb_per_s:.1f} MB/s, {r.jobs} jobs" if r.shards_copied else "nothing to copy"
    node = "" if r.node_rank is None else f" (node {r.node_rank} of {r.num_nodes}: {r.num_shards} of {r.set_shards})"
    line = (f"staged {r.num_shards} shards{node} to {r.dest}: {r.shards_copied} copied ({_mb(r.bytes_copied)}), "
            f"{r.shards_kept} kept ({_mb(r.bytes_kept)}), {r.elapsed_s:.1f} s, {rate}, checked by {r.checked}")
    note = [] if r.node_rank is None else [f"note: {NODE_REMINDER}"]
    return "\n".join([line, *note, *(f"warning: {w}" for w in r.warnings)])


def stage_copy(src: str, dest: str) -> str:
    """Stage the set ``src`` to ``dest`` with the defaults and no progress bar; returns ``dest``: the stager that
    ``train --fix`` is handed (by the CLI and ``gpufeed run``, which may import this job; train may not)."""
    stage(StageConfig(src=src, dest=dest), progress=False)
    return dest
