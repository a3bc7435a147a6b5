"""Phase 4, write: the shards' bytes (tar layout: docs/design.md §2; how the work is split: the package
docstring).

Records: ``_samples_of`` builds a shard's ``Sample`` records from its plan columns (``Plan.part``). Write tasks
(in the workers): ``write_range`` writes a run of samples at their offsets (one ``pwrite`` of the members, image
bytes over ``_INLINE_BYTES`` by ``sendfile``), after checking each pass-through source against its validated
identity; ``_write_shard`` writes and hashes a whole shard; ``check_and_write_shard`` is the one pass's task
(validates and writes a whole shard from one read of each source; the package docstring, "One pass"). Main side: ``_ShardJob`` lays a shard out and hashes
it in order as its ranges complete; ``write_all`` gives each worker whole shards or ranges of one shard.
``finish_shard`` renames a finished shard into place and leaves its ``.done.json`` sidecar, which
``shard_complete`` checks on resume."""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import os
import tarfile
from json.encoder import encode_basestring
from typing import Any, Callable, NamedTuple

from gpufeed.core.dest import publish, read_done, temp_path, write_done
from gpufeed.core.errors import RunError
from gpufeed.core.safefs import open_regular
from gpufeed.shard.dest import STATE_DIR
from gpufeed.shard.report import Bar
from gpufeed.shard.scan import Strings, display
from gpufeed.shard.shardplan import ShardPart
from gpufeed.shard.validate import EXT, EXTS, CheckOptions, batch_columns, cache_name, inspect_bytes, read_whole
from gpufeed.shardset.tar import ustar_headers


# --------------------------------------------------------------------------- the records of a shard's samples


class Sample(NamedTuple):
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


def sample_json(s: Sample) -> bytes:
    """``KEY.json``: exactly ``json.dumps(meta, sort_keys=True, ensure_ascii=False)`` of the sample's metadata
    (``source``, ``class``, ``label``, stored ``width``/``height``, ``format``, ``sha256``, ``exif_orientation``
    when not 1, ``orig_width``/``orig_height`` when resized), written out directly: the generic encoder costs more
    than the rest of the sample."""
    return _meta_json(encode_basestring(s.cname), s.label, s.ext, s.width, s.height, s.sha256,
                      encode_basestring(s.source), s.orientation, s.orig_width, s.orig_height)


def _meta_json(cname_json: str, label: int, ext: str, width: int, height: int, sha256: str, source_json: str,
               orientation: int = 1, orig_width: int | None = None, orig_height: int | None = None) -> bytes:
    """``sample_json`` from the fields (``*_json``: ``json.encoder.encode_basestring`` of the name; ``orig_*``
    None: not resized): the one pass builds it without a ``Sample``."""
    if orientation == 1 and (orig_width is None or (orig_width, orig_height) == (width, height)):
        return (f'{{"class": {cname_json}, "format": "{ext}", "height": {height}, "label": {label}, '
                f'"sha256": "{sha256}", "source": {source_json}, "width": {width}}}').encode("utf-8")
    parts = [f'{{"class": {cname_json}, ']
    if orientation != 1:
        parts.append(f'"exif_orientation": {orientation}, ')
    parts.append(f'"format": "{ext}", "height": {height}, "label": {label}, ')
    if orig_width is not None and (orig_width, orig_height) != (width, height):
        parts.append(f'"orig_height": {orig_height}, "orig_width": {orig_width}, ')
    parts.append(f'"sha256": "{sha256}", "source": {source_json}, "width": {width}}}')
    return "".join(parts).encode("utf-8")


def _samples_of(part: ShardPart, src: str, state: str) -> list[Sample]:
    """The records of one shard's samples from ``Plan.part``."""
    classes, digests = part.classes, part.sha256
    base = os.path.join(src, "")  # + a relative path: os.path.join's result, without its cost per sample
    out = []
    for k, (raw, n, label, e, w, h, ow, oh, orientation, length, j, coff, idt) in enumerate(zip(
            part.paths, part.n, part.label, part.ext, part.width, part.height, part.orig_width,
            part.orig_height, part.orientation, part.img_len, part.cache, part.coff, part.ident)):
        encoded = j >= 0
        out.append(Sample(f"{label:05d}_{n:07d}", base + raw, label, classes[label], display(raw),
                           orientation, EXTS[e], w, h, ow, oh, digests[32 * k:32 * k + 32].hex(), length,
                           None if encoded else idt, os.path.join(state, cache_name(j)) if encoded else None,
                           coff))
    return out


# --------------------------------------------------------------------------- write tasks (run in the workers)

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
    # device 0: validated on another node of a static split, whose mount of the shared file system has its own
    # device number (size, mtime and inode are the file system's own)
    if (st.st_size, st.st_mtime_ns, st.st_ino, st.st_dev if ident[3] else 0) != ident or st.st_size != nbytes:
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


class Item(NamedTuple):
    """One sample of a write task: its offset in the shard, member names and small members, and where its image
    bytes come from (``cache`` None: the source file ``path``, else ``cache`` at ``coff``, whose bytes must hash to
    ``sha256``, the digest validation recorded: a cache offset or length forged in DEST never goes into a shard)."""

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
    sha256: str = ""


_INLINE_BYTES = 1 << 20
"""Image members up to this size are read into the write task's buffer, which goes out in one ``pwrite``; larger
ones are copied by ``sendfile``."""

_ZEROS = bytes(512)


def _around_image(key: str, ext: str, img_len: int, cls_b: bytes, json_b: bytes) -> tuple[bytes, bytes]:
    """A sample's members in name order, split around its image bytes -> (what precedes them: the ``cls``
    member, the ``json`` member when the image sorts after it, the image's header; what follows the image's
    padding: the ``json`` member when the image sorts before it, else nothing). "cls" sorts before every image
    extension."""
    cls_h, json_h, img_h = ustar_headers(key, (("cls", len(cls_b)), ("json", len(json_b)), (ext, img_len)))
    if ext < "json":
        return (b"".join((cls_h, cls_b, _ZEROS[:-len(cls_b) % 512], img_h)),
                b"".join((json_h, json_b, _ZEROS[:-len(json_b) % 512])))
    return b"".join((cls_h, cls_b, _ZEROS[:-len(cls_b) % 512], json_h, json_b, _ZEROS[:-len(json_b) % 512],
                     img_h)), b""


def _open_cache(path: str) -> Any:
    """A transcode cache file of the state folder, never through a link out of it (safefs: its target's bytes
    would go into a shard) and only a regular file; RunError naming it otherwise."""
    from gpufeed.core.errors import DataError
    from gpufeed.core.safefs import open_set_file

    try:
        return os.fdopen(open_set_file(path, os.path.dirname(path), what="transcode cache", where="state folder"), "rb")
    except (DataError, FileNotFoundError) as exc:
        raise RunError(f"{exc if isinstance(exc, DataError) else f'the transcode cache {path} is missing'}; re-run "
                       f"with --overwrite") from None


def _idx_line(key: str, ext: str, offset: int, img_len: int, cls_len: int, json_len: int) -> str:
    """The DALI index line (``gpufeed.shardset.sidecars``: ``EXT OFFSET SIZE NAME`` a member, OFFSET where its data starts)
    of one sample written at ``offset``, its members laid out as ``_around_image`` lays them (each behind one
    512-byte header). The tests check it against the index read back from the tar's headers."""
    cls_at = offset + 512
    first = cls_at + _padded(cls_len) + 512
    if ext < "json":
        return (f"cls {cls_at} {cls_len} {key}.cls {ext} {first} {img_len} {key}.{ext} "
                f"json {first + _padded(img_len) + 512} {json_len} {key}.json")
    return (f"cls {cls_at} {cls_len} {key}.cls json {first} {json_len} {key}.json "
            f"{ext} {first + _padded(json_len) + 512} {img_len} {key}.{ext}")


def _dali_index(lines: list[str]) -> bytes | None:
    """A shard's DALI index from its samples' ``_idx_line``."""
    from gpufeed.shardset.sidecars import dali_file

    return dali_file(lines) if lines else None


def write_range(tmp: str, items: list[Item]) -> None:
    """Write a run of samples into the shard file ``tmp`` (created at its final size by the main process) at
    the offsets the main process computed. Tar blocks are position-independent, so any number of processes can
    write disjoint ranges of one shard; the end-of-archive blocks (and the padding after an image copied by
    ``sendfile``) are the file's zeros. Everything else is gathered in one buffer and written at once."""
    fd = os.open(tmp, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)  # never through a link (safefs)
    try:
        buf: list[bytes] = []
        start = pos = items[0].offset if items else 0
        for it in items:
            if it.offset != pos:
                _pwrite_all(fd, b"".join(buf), start)
                buf, start = [], it.offset
            head, tail = _around_image(it.key, it.ext, it.img_len, it.cls_b, it.json_b)
            buf.append(head)
            pos = it.offset + len(head)
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
                    with _open_cache(it.cache) as f:
                        f.seek(it.coff)
                        data = f.read(it.img_len)
                    if len(data) != it.img_len:
                        raise RunError(f"the transcode cache {it.cache} is incomplete; re-run with --overwrite")
                    if hashlib.sha256(data).hexdigest() != it.sha256:
                        raise RunError(f"the transcode cache {it.cache} does not hold the bytes validated for "
                                       f"{it.rel} (their sha256 differs); re-run with --overwrite")
                buf.append(data)
                buf.append(_ZEROS[:-len(data) % 512])
            pos += _padded(it.img_len)
            if tail:
                buf.append(tail)
                pos += len(tail)
        if buf:
            _pwrite_all(fd, b"".join(buf), start)
    finally:
        os.close(fd)


def _write_shard(dest: str, src: str, name: str, part: dict[str, Any]) -> tuple[int, str, int, bytes | None]:
    """Write one whole shard in this (worker) process: records, layout, bytes, then its sha256 -> (size, sha256,
    image bytes, DALI index). The same layout and writer as the parallel runs of ``write_all``, so the same
    bytes."""
    job = _ShardJob(dest, name, _samples_of(part, src, os.path.join(dest, STATE_DIR)))
    try:
        for items, _end, _nbytes in job.ranges:
            write_range(job.tmp, items)
        return job.size, _sha256_file(job.tmp), sum(r[2] for r in job.ranges), job.idx
    except BaseException:
        job.abort()
        raise


_STOP_EVERY = 256
"""The one pass looks for the stop file every this many files."""


class OnePassShard(NamedTuple):
    """What ``check_and_write_shard`` did: ``complete``, the shard is written (``size``, ``sha256``); else it
    stopped, its temporary file deleted. Either way ``columns`` (``batch_columns``) are the validation results
    of the first ``checked`` files, every one accepted as a pass-through."""

    complete: bool
    checked: int
    nbytes: int
    columns: dict[str, Any]
    size: int = 0
    sha256: str = ""
    idx: bytes | None = None
    """The shard's DALI index (``gpufeed.shardset.sidecars``)."""


class OnePassPart(NamedTuple):
    """A one-pass task's shard: its files in order, as the scan found them (cheap to send to a worker: names with
    ``array`` offsets, plain lists)."""

    paths: Strings
    """Relative to SRC (``Strings.portable``: no numpy needed to read them)."""
    n: list[int]
    """With ``label``, their keys."""
    label: list[int]
    bytes: list[int]
    """Their sizes at the scan, which the plan records: a file of another size stops the pass too (the write
    after the validation pass refuses it as changed)."""
    classes: list[str]
    stop: str
    """The stop file: once it exists, the task stops (another shard stopped)."""


def check_and_write_shard(dest: str, src: str, name: str, part: OnePassPart, opts: CheckOptions) -> OnePassShard:
    """The one pass (``--check header``, nothing to transcode): validate and write one whole shard whose plan
    assumed every file is accepted and passes through unchanged. Each source is read once: its header is
    checked from those bytes (``inspect_bytes``, as the validation pass does), and the same bytes are written
    and hashed in order as the shard grows. Stops, deleting the temporary file, at the first file that is
    unreadable, rejected, needs a transcode or changed size since the scan (the plan was wrong; the validation
    pass checks it again and reports it), or once the file ``part.stop`` exists (another shard stopped)."""
    tmp = temp_path(dest, name)
    classes = part.classes
    checked = []
    members = []  # each sample's _idx_line
    h = hashlib.sha256()
    pos = nbytes = 0
    src_fd = os.open(src, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        fd = open_regular(tmp, os.O_WRONLY | os.O_TRUNC, what="shard")  # never through a link
    except BaseException:
        os.close(src_fd)
        raise
    ok = False
    try:
        buf: list[bytes] = []
        held = 0
        cls_b = [str(label).encode("ascii") for label in range(len(classes))]
        cname_json: dict[int, str] = {}
        stop = part.stop
        for k, (raw, n, label, scanned) in enumerate(zip(part.paths, part.n, part.label, part.bytes)):
            if k % _STOP_EVERY == 0 and os.path.exists(stop):  # from the first file: a queued shard stops at once
                return OnePassShard(False, k, nbytes, batch_columns(checked))
            try:
                data, st = read_whole(raw, src_fd)
            except OSError:
                return OnePassShard(False, k, nbytes, batch_columns(checked))
            r = inspect_bytes(data, st, opts)  # a plain JPEG: _plain_copy, with the main process's pixel limit
            size = len(data)
            if not r.ok or r.what != "copy" or size != scanned:
                return OnePassShard(False, k, nbytes, batch_columns(checked))
            checked.append(r)
            ext = EXT[r.fmt]
            cj = cname_json.get(label)
            if cj is None:
                cj = cname_json[label] = encode_basestring(classes[label])
            json_b = _meta_json(cj, label, ext, r.width, r.height, r.sha256.hex(), encode_basestring(display(raw)),
                                r.orientation)
            key = f"{label:05d}_{n:07d}"
            members.append(_idx_line(key, ext, pos + held, size, len(cls_b[label]), len(json_b)))
            head, tail = _around_image(key, ext, size, cls_b[label], json_b)
            pad = _ZEROS[:-size % 512]
            buf += (head, data, pad, tail)
            held += len(head) + size + len(pad) + len(tail)
            nbytes += size
            if held >= _RANGE_BYTES:
                pos = _write_hashed(fd, h, buf, pos)
                buf, held = [], 0
        end = pos + held + 1024
        buf.append(bytes(1024 + (-end % tarfile.RECORDSIZE)))  # end-of-archive, padded like tarfile
        pos = _write_hashed(fd, h, buf, pos)
        ok = True
        return OnePassShard(True, len(checked), nbytes, batch_columns(checked), pos, h.hexdigest(),
                             _dali_index(members))
    finally:
        os.close(fd)
        os.close(src_fd)
        if not ok:
            os.unlink(tmp)


def _write_hashed(fd: int, h: Any, parts: list[bytes], pos: int) -> int:
    """Write ``parts`` at ``pos`` and feed them to the hash ``h`` -> the position after them."""
    data = b"".join(parts)
    h.update(data)
    _pwrite_all(fd, data, pos)
    return pos + len(data)


# --------------------------------------------------------------------------- main side


class _ShardJob:
    """One shard being written: its layout, temporary file, write ranges and in-order hashing."""

    def __init__(self, dest: str, name: str, samples: list[Sample]) -> None:
        import queue

        self.name = name
        self.num_samples = len(samples)
        self.final = os.path.join(dest, name)
        self.tmp = temp_path(dest, name)
        items = []
        members = []
        pos = 0
        for s in samples:
            json_b = sample_json(s)
            cls_b = str(s.label).encode("ascii")
            items.append(Item(pos, s.key, s.ext, s.img_len, cls_b, json_b, s.path, s.source, s.ident, s.cache,
                               s.coff, s.sha256))
            members.append(_idx_line(s.key, s.ext, pos, s.img_len, len(cls_b), len(json_b)))
            pos += 3 * 512 + _padded(s.img_len) + _padded(len(cls_b)) + _padded(len(json_b))
        self.idx = _dali_index(members)
        """The shard's DALI index (``gpufeed.shardset.sidecars``), from the layout."""
        self.size = pos + 1024 + (-(pos + 1024) % tarfile.RECORDSIZE)  # end-of-archive, padded like tarfile
        # Contiguous runs of samples, each one write task: [(items, end offset, image bytes)].
        self.ranges: list[tuple[list[Item], int, int]] = []
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
        fd = open_regular(self.tmp, os.O_WRONLY | os.O_TRUNC, what="shard")  # never through a link
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


def finish_shard(dest: str, name: str, size: int, num_samples: int, digest: str,
                 idx: bytes | None = None) -> dict[str, Any]:
    """Rename a fully written and hashed shard into place, then leave its ``.done.json`` sidecar
    (:mod:`gpufeed.core.dest`) -> the sidecar's record. ``idx``: its DALI index, written first
    (``DEST/<shard>.idx``).

    No fsync of the shard: the rename makes it atomic against a killed process; after a power loss, resume and
    verify compare the file with the sha256 its (durable) sidecar records, so a torn shard is rewritten, never
    trusted.
    """
    from gpufeed.core.records import atomic_write_bytes
    from gpufeed.shardset.sidecars import idx_name

    if idx is not None:
        atomic_write_bytes(os.path.join(dest, idx_name(name)), idx)
    publish(dest, name)
    result = {"name": name, "num_samples": num_samples, "bytes": size, "sha256": digest}
    write_done(os.path.join(dest, STATE_DIR), name, result)
    return result


def _sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def shard_complete(dest: str, name: str, keys: Callable[[], list[str]] | None = None) -> dict[str, Any] | None:
    """The sidecar of a complete shard whose file still matches it (size and sha256) and, with ``keys`` (the plan's
    keys of the shard, in order), holds exactly those samples' members in that order, else None (the shard is
    written again). The sidecar lives in DEST, which someone else may write: its sha256 proves only that the
    file is the one it names, so the member layout is checked against the plan, which is recomputed from SRC."""
    info = read_done(os.path.join(dest, STATE_DIR), name, 1 << 16, what="shard sidecar")
    try:
        if info is not None and os.path.getsize(os.path.join(dest, name)) == info["bytes"] \
                and _sha256_file(os.path.join(dest, name)) == info["sha256"] \
                and (keys is None or _member_keys(os.path.join(dest, name)) == keys()):
            return info
    except (OSError, KeyError, TypeError, ValueError):
        pass
    return None


def _member_keys(path: str) -> list[str] | None:
    """The sample keys of a gpufeed shard in member order (three consecutive members a sample, with the same key:
    ``.cls``, ``.json`` and the image), or None when its members are not laid out so."""
    from gpufeed.shardset.keys import split_member
    from gpufeed.shardset.tar import iter_members

    keys: list[str] = []
    exts: set[str] = set()
    with open(path, "rb") as f:
        for i, (member, _) in enumerate(iter_members(f, lambda _name: False)):
            parts = split_member(member)
            if parts is None or (i % 3 and parts[0] != keys[-1]):
                return None
            if i % 3 == 0:
                keys.append(parts[0])
                exts = set()
            exts.add(parts[1])
            if i % 3 == 2 and not {"cls", "json"} < exts:
                return None
    return keys if len(exts) == 3 or not keys else None


class WriteTask(NamedTuple):
    """A shard to write: its name, its number of samples and a function giving ``Plan.part`` of its samples
    (called when the shard is started, so only the shards in flight are held as records)."""

    name: str
    count: int
    part: Callable[[], ShardPart]


def write_all(dest: str, src: str, tasks: list[WriteTask], pool: Any,
              bar: Bar, on_done: Callable[[str], None] = lambda name: None, workers: int = 1,
              whole: bool = False) -> dict[str, Any]:
    """Write the shards. ``tasks``: (shard name, number of samples, a function giving ``Plan.part`` of its
    samples), so only the shards in flight are held as records; as many shards are in flight as workers (the
    DEST space check counts on it).

    With at least two shards a worker, each worker writes and hashes whole shards (``_write_shard``): the
    records, member layout and hashing all happen in the workers. With fewer, every shard is split into runs
    of consecutive samples written in parallel at their offsets (``write_range``, in the worker processes, or
    one thread without a pool), while one thread per shard hashes it in order as its runs complete, so a
    one-shard plan uses every worker too. Either way a shard is renamed once written and hashed. ``whole``:
    whole shards always (Ray: a task on another machine writes and hashes its own file)."""
    total = sum(t.count for t in tasks)
    bar.start("write", total)
    out: dict[str, Any] = {}
    if not tasks:
        return out
    own = pool is None
    ex = cf.ThreadPoolExecutor(max_workers=1, thread_name_prefix="gpufeed-write") if own else pool
    try:
        if whole or len(tasks) >= 2 * max(1, workers):
            _write_whole(dest, src, tasks, ex, bar, on_done, workers, out)
        else:
            _write_ranges(dest, src, tasks, ex, bar, on_done, workers, out)
    finally:
        if own:
            ex.shutdown(wait=True)
    return out


def _write_whole(dest: str, src: str, tasks: list[WriteTask], ex: Any, bar: Bar, on_done: Callable[[str], None],
                 workers: int, out: dict[str, Any]) -> None:
    pending = iter(tasks)
    running: dict[Any, tuple[str, int]] = {}
    try:
        while True:
            while len(running) < max(1, workers):
                nxt = next(pending, None)
                if nxt is None:
                    break
                running[ex.submit(_write_shard, dest, src, nxt.name, nxt.part())] = (nxt.name, nxt.count)
            if not running:
                return
            finished, _ = cf.wait(running, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                name, count = running.pop(fut)
                size, digest, nbytes, idx = fut.result()
                out[name] = finish_shard(dest, name, size, count, digest, idx)
                on_done(name)
                bar.update(count, nbytes)
    except BaseException:
        for fut in running:
            fut.cancel()
        cf.wait(running)  # the shards being written abort themselves (their temporary files go)
        raise


def _write_ranges(dest: str, src: str, tasks: list[WriteTask], ex: Any, bar: Bar, on_done: Callable[[str], None],
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
                    current = _ShardJob(dest, nxt.name, _samples_of(nxt.part(), src, state))
                    jobs.append(current)
                    fut = hashers.submit(_hash_file_ranges, current.tmp, current.blocks)
                    hashing[fut] = current
                i = current.submitted
                running[ex.submit(write_range, current.tmp, current.ranges[i][0])] = (current, i)
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
                    out[job.name] = finish_shard(dest, job.name, job.size, job.num_samples, fut.result(), job.idx)
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
