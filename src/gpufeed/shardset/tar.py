"""Tar shards: the header reader and writer, the lean sample reader and the checking pass (docs/design.md §2).

- :func:`parse_header` and :class:`HeaderChain` read headers exactly as ``tarfile`` does and refuse what tar
  readers disagree on. Every reader of gpufeed runs them on every header: :func:`iter_members` (the lean reader)
  and :class:`TarPass` (``gpufeed index``/``verify`` and the loader's gzip path), so all read a shard alike or
  all refuse it. Every reader refuses a member it would read that is over :data:`MAX_MEMBER_BYTES`.
- :func:`iter_samples` is the loader's reader. For local, uncompressed shards it is a fast path: Python's
  ``tarfile`` parses every header field of every member; at ~100 KB per sample that costs about a quarter
  of the decode time. :func:`iter_members` parses only the name, size and type, checks the header checksum,
  reads only the members the loader wants, and seeks over everything else, including whole samples before a
  segment's start. Gzip-compressed shards are read through :class:`TarPass`. Samples are grouped by the key
  rule of :mod:`gpufeed.shardset.keys` (webdataset's), so counts agree with ``gpufeed index``.
- :class:`TarPass` streams a whole shard (plain or gzip) once through ``tarfile``: for index and verify (sha256,
  members, and the end-of-archive check) and for the loader's gzip shards.
- :func:`ustar_header` is the fixed-field header ``gpufeed shard`` writes.

Handles POSIX ustar (with prefix), GNU long names (``L``) and pax headers (``x`` path/size; ``g`` only when it
sets neither path, linkpath nor size).

Shards are untrusted: every size read from a header (octal, GNU base-256, pax ``size``) must be a
non-negative integer whose data lies inside the file, pax records must be well formed, long names and pax
headers are bounded (:data:`MAX_LONG_NAME_BYTES`, :data:`MAX_PAX_BYTES`), and every header moves the read
position forward by at least one block, so a malformed shard raises :class:`TarFormatError` (naming the
member and its offset) instead of looping or allocating without bound.
"""
from __future__ import annotations

import collections
import gzip as gzip_module
import hashlib
import os
import re
import tarfile
from typing import Any, BinaryIO, Callable, Iterator

from gpufeed.shardset.keys import KeyDigest, is_metadata, split_member, wanted

_BLOCK = 512
_OCTAL = re.compile(rb"[0-7]+")
_DECIMAL = re.compile(r"[0-9]+")

MAX_LONG_NAME_BYTES = 64 * 1024
"""Largest GNU long-name (``L``) member accepted: a path, even a very long one, is far shorter."""
MAX_PAX_BYTES = 64 * 1024
"""Largest pax extended header (``x``/``g``) accepted: gpufeed reads only ``path`` and ``size`` from it."""
MAX_MEMBER_BYTES = 1 << 30
"""Largest member any gpufeed reader reads into memory (the loader, ``index``, ``verify``): a wanted member whose
header declares more is refused before its data is read (members that are not wanted are passed over)."""
EXTENDED_TYPES = (b"L", b"K", b"x", b"X")
"""Headers whose data describes the next member: GNU long name/link name, pax (``X``: Solaris, read as pax by
tarfile). At most one may precede a member."""
REGULAR_TYPES = (b"0", b"\0", b"7")
"""Regular file members (``7``: contiguous file)."""
_NO_DATA_TYPES = (b"1", b"2", b"3", b"4", b"5", b"6")
"""Hard/symbolic links, devices, directories, FIFOs: tarfile reads no data after their header."""
_NUMERIC_FIELDS = ((100, 108), (108, 116), (116, 124), (136, 148), (329, 337), (337, 345))
"""mode, uid, gid, mtime, devmajor, devminor: tarfile refuses a header whose field is not a number."""
_CHECKED_FIELDS: set[bytes] = set()
"""Byte strings of those fields already found valid (a shard's headers nearly always share them): checked once."""
_MAX_CHECKED_FIELDS = 256
MAX_PAX_LENGTH_DIGITS = 20
"""Most digits in a pax record's length field (a record is at most MAX_PAX_BYTES long anyway)."""


class TarFormatError(ValueError):
    """The shard is not a well-formed tar file (bad checksum, bad size field, truncated member)."""


def _show(name: str) -> str:
    """A member name for a one-line message (quoted; control characters escaped)."""
    return repr(name[:200])


def _where(name: str, pos: int) -> str:
    """Where a header problem is, for its message (built only when there is one)."""
    return f"member {_show(name)} (header at offset {pos})"


def _octal(field: bytes) -> int:
    """A numeric header field: NUL/space-terminated octal, or GNU base-256 (first byte 0x80: positive,
    0xff: negative, two's complement), read as ``tarfile`` reads it. Raises ValueError on anything else."""
    if field and field[0] & 0x80:
        if field[0] not in (0x80, 0xFF):
            raise ValueError(f"bad base-256 marker 0x{field[0]:02x}")
        n = int.from_bytes(field[1:], "big")
        return n - 256 ** (len(field) - 1) if field[0] == 0xFF else n
    text = field.split(b"\0", 1)[0].strip(b" ")
    if not text:
        return 0
    if not _OCTAL.fullmatch(text):
        raise ValueError("not an octal number")  # the field is any bytes of the file: never shown
    return int(text, 8)


def _pax(data: bytes, where: str) -> dict[str, str]:
    """Parse pax records ``"%d %s=%s\\n"``; raises TarFormatError (naming ``where``) on a malformed record."""
    out: dict[str, str] = {}
    pos = 0
    while pos < len(data):
        if data[pos] == 0:  # NUL padding after the last record
            break
        sp = data.find(b" ", pos, pos + MAX_PAX_LENGTH_DIGITS + 1)
        if sp < 0 or not data[pos:sp].isdigit():
            raise TarFormatError(f"{where}: malformed pax record at byte {pos}")
        length = int(data[pos:sp])
        end = pos + length
        if length <= sp - pos + 1 or end > len(data) or data[end - 1:end] != b"\n":
            raise TarFormatError(f"{where}: pax record at byte {pos} has a bad length {length}")
        kv = data[sp + 1: end - 1].decode("utf-8", "surrogateescape")
        k, eq, v = kv.partition("=")
        if not eq:
            raise TarFormatError(f"{where}: pax record at byte {pos} has no '='")
        out[k] = v
        pos = end  # length > 0: always moves forward
    return out


def _padded(size: int) -> int:
    return (size + _BLOCK - 1) // _BLOCK * _BLOCK


def parse_header(hdr: bytes, pos: int) -> tuple[str, int, bytes]:
    """One 512-byte (non-zero) header block read as ``tarfile.TarInfo.frombuf`` reads it: ``(name, size, type)``.

    The checksum may be the unsigned or the signed byte sum (tarfile accepts both); every numeric field must be
    octal or base-256 (stricter than tarfile, so anything accepted here reads alike in both); the ustar prefix
    is joined to the name whatever the magic, except for GNU ``L``/``K``/``S`` headers, as tarfile does; a
    ``\\0``-type member whose name ends with ``/`` is a directory (type ``5``). Raises TarFormatError.
    """
    raw_name = hdr[0:100].split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
    try:
        chk = _octal(hdr[148:156])
        size = _octal(hdr[124:136])
        fixed = hdr[100:124] + hdr[136:148] + hdr[329:345]
        if fixed not in _CHECKED_FIELDS:  # mode, uid, gid, mtime, dev: usually the same in every header
            for a, b in _NUMERIC_FIELDS:
                _octal(hdr[a:b])
            if len(_CHECKED_FIELDS) >= _MAX_CHECKED_FIELDS:
                _CHECKED_FIELDS.clear()
            _CHECKED_FIELDS.add(fixed)
    except ValueError as exc:
        # the name of a header that does not check out is any bytes of the file: never shown
        raise TarFormatError(f"header at offset {pos}: bad numeric field ({exc})") from None
    unsigned = sum(hdr) - sum(hdr[148:156]) + 256
    if chk != unsigned:
        signed = unsigned - 256 * (sum(1 for x in hdr[:148] if x > 127) + sum(1 for x in hdr[156:] if x > 127))
        if chk != signed:
            raise TarFormatError(f"header at offset {pos}: bad header checksum")
    typ = hdr[156:157]
    if typ == b"\0" and raw_name.endswith("/"):
        typ = b"5"  # tarfile: an old-style directory
    name = raw_name
    prefix = hdr[345:500].split(b"\0", 1)[0]
    if prefix and typ not in (b"L", b"K", b"S"):
        name = prefix.decode("utf-8", "surrogateescape") + "/" + name
    return name, size, typ


class HeaderChain:
    """The extended headers before one member, applied as ``tarfile`` applies them. Where tar readers differ
    (tarfile vs. this reader, or tar implementations among themselves) it raises TarFormatError: a second
    extended header (``L``, ``K``, ``x``, ``X``) before one member, a global ``g`` header that sets ``path``,
    ``linkpath`` or ``size``, GNU sparse data (an ``S`` member or ``GNU.sparse.*`` pax records), and a link,
    device, FIFO or directory member with data (tarfile reads its data as the next header, others skip it).
    Both the loader (:func:`iter_members`) and ``gpufeed index``/``verify`` (:class:`TarPass`) use it."""

    def __init__(self) -> None:
        self.long_name: str | None = None
        self.pax: dict[str, str] | None = None
        self.extended_at: int | None = None

    def extended(self, typ: bytes, data: bytes, where: str, pos: int) -> None:
        """An extended header (``typ`` in :data:`EXTENDED_TYPES` or ``g``) and its data."""
        if typ == b"g":
            pax = _pax(data, where)
            bad = sorted(k for k in pax if k in ("path", "linkpath", "size") or k.startswith("GNU.sparse."))
            if bad:
                raise TarFormatError(f"{where}: global pax header sets {bad[0]!r} for every later member (tar "
                                     f"readers disagree on it)")
            return
        if self.extended_at is not None:
            raise TarFormatError(f"{where}: a second extended header before one member (the first at offset "
                                 f"{self.extended_at}; tar readers disagree on which applies)")
        self.extended_at = pos
        if typ == b"L":
            self.long_name = data.split(b"\0", 1)[0].decode("utf-8", "surrogateescape")
        elif typ in (b"x", b"X"):
            self.pax = _pax(data, where)
            sparse = [k for k in self.pax if k.startswith("GNU.sparse.")]
            if sparse:
                raise TarFormatError(f"{where}: pax header holds {sparse[0]!r} (GNU sparse file; not supported)")

    def member(self, name: str, size: int, typ: bytes, pos: int) -> tuple[str, int, bool]:
        """The member header that ends the chain -> ``(name, size, regular)``; resets the chain."""
        pax = self.pax or {}
        if self.long_name is not None:
            name = self.long_name
        elif "path" in pax:
            name = pax["path"].rstrip("/")  # as tarfile's _apply_pax_info
        self.long_name = self.pax = self.extended_at = None
        if not pax and size >= 0 and typ != b"S" and (typ not in _NO_DATA_TYPES or not size):
            return name, size, typ in REGULAR_TYPES  # the common member: nothing to refuse
        where = _where(name, pos)
        if "size" in pax:
            if not _DECIMAL.fullmatch(pax["size"]):
                raise TarFormatError(f"{where}: pax size {pax['size'][:20]!r} is not a non-negative decimal")
            size = int(pax["size"])
        if size < 0:
            raise TarFormatError(f"{where}: negative size {size}")
        if typ == b"S":
            raise TarFormatError(f"{where}: GNU sparse member (tar readers disagree on its data; not supported)")
        if typ in _NO_DATA_TYPES and size:
            raise TarFormatError(f"{where}: a type-{typ.decode('latin-1')!r} member (link, device, FIFO or "
                                 f"directory) with {size} bytes of data (tar readers disagree on where the next "
                                 f"header is)")
        return name, size, typ in REGULAR_TYPES


_ZEROS = bytes(_BLOCK)
_USTAR_MODE_IDS = b"0000644\0" b"0000000\0" b"0000000\0"
_USTAR_MTIME = b"00000000000\0"
_USTAR_TAIL = (b"0" + b"\0" * 100 + b"ustar\x0000" + b"\0" * 32 + b"\0" * 32 + b"\0" * 8 + b"\0" * 8
               + b"\0" * 155).ljust(_BLOCK - 156, b"\0")
_USTAR_FIXED_SUM = sum(_USTAR_MODE_IDS) + sum(_USTAR_MTIME) + 8 * ord(" ") + sum(_USTAR_TAIL)
"""Checksum of the header's fixed fields (the checksum field counting as 8 spaces); name and size add theirs."""


def ustar_header(name: str, size: int) -> bytes:
    """The 512-byte USTAR header tarfile writes for a regular file with gpufeed's fixed metadata (mtime 0,
    uid/gid 0, empty user/group names, mode 0644), built directly from precomputed fixed fields: tarfile's
    generic path costs more than the I/O. Raises ValueError for a name over 100 UTF-8 bytes or a size outside
    0..8 GiB (no prefix, no pax)."""
    nb = name.encode("utf-8")
    if len(nb) > 100 or not 0 <= size < 8**11:
        raise ValueError(f"{name!r} ({size} bytes) does not fit a plain USTAR header")
    size_field = b"%011o\0" % size
    checksum = _USTAR_FIXED_SUM + sum(nb) + sum(size_field)
    return b"".join([nb.ljust(100, b"\0"), _USTAR_MODE_IDS, size_field, _USTAR_MTIME, b"%06o\0 " % checksum,
                     _USTAR_TAIL])


def ustar_headers(key: str, members: tuple[tuple[str, int], ...]) -> list[bytes]:
    """``[ustar_header(f"{key}.{ext}", size) for ext, size in members]``: the headers of one sample's members,
    the key encoded and summed once (the writer's per-sample cost)."""
    kb = key.encode("utf-8")
    ks = _USTAR_FIXED_SUM + sum(kb)
    room = 100 - len(kb)
    out = []
    for ext, size in members:
        suffix = _SUFFIXES.get(ext)
        if suffix is None:
            suffix = (b"." + ext.encode("utf-8"), sum(b"." + ext.encode("utf-8")))
            if len(_SUFFIXES) < 64:
                _SUFFIXES[ext] = suffix
        sb, ss = suffix
        if room < len(sb) or not 0 <= size < 8**11:
            raise ValueError(f"{key + '.' + ext!r} ({size} bytes) does not fit a plain USTAR header")
        size_field = b"%011o\0" % size
        out.append(b"".join((kb, sb, _ZEROS[:room - len(sb)], _USTAR_MODE_IDS, size_field, _USTAR_MTIME,
                             b"%06o\0 " % (ks + ss + sum(size_field)), _USTAR_TAIL)))
    return out


_SUFFIXES: dict[str, tuple[bytes, int]] = {}
"""``ustar_headers``' cache: a member extension -> (b"." + it, the sum of those bytes)."""


def iter_members(f: BinaryIO, want) -> Iterator[tuple[str, bytes | None]]:
    """Regular members as ``(name, data)``; ``data`` is None (not read) unless ``want(name)``.

    ``f`` must be a seekable file; its size bounds every member. Raises TarFormatError on a malformed header
    or one that :class:`HeaderChain` refuses.
    """
    file_size = os.fstat(f.fileno()).st_size
    pos = f.tell()
    chain = HeaderChain()
    while True:
        hdr = f.read(_BLOCK)
        if len(hdr) < _BLOCK:
            if not hdr:
                return  # no end-of-archive blocks: tolerated, as tarfile does
            raise TarFormatError(f"truncated header at offset {pos}")
        if hdr.count(0) == _BLOCK:
            return  # end of archive
        name, size, typ = parse_header(hdr, pos)
        data_start = pos + _BLOCK
        if typ in EXTENDED_TYPES or typ == b"g":
            where = _where(name, pos)
            check_extended_size(typ, size, where)
            if data_start + size > file_size:
                raise TarFormatError(f"{where}: truncated member (size {size} runs past the end of the file)")
            padded = _padded(size)
            data = f.read(padded)
            if len(data) < size:
                raise TarFormatError(f"{where}: truncated member")
            chain.extended(typ, data[:size], where, pos)
            pos = data_start + padded
            continue
        name, size, regular = chain.member(name, size, typ, pos)
        if data_start + size > file_size:
            raise TarFormatError(f"{_where(name, pos)}: truncated member (size {size} runs past the end of the file)")
        padded = _padded(size)
        pos = data_start + padded  # > the header's offset: every header moves forward
        if not regular:  # not a regular file: skip its data (none for links, devices, FIFOs, directories)
            f.seek(pos)
            continue
        if want(name):
            check_member_size(size, _where(name, pos - padded - _BLOCK))
            data = f.read(size)  # the data alone (no copy to drop the padding), then past the padding
            if len(data) < size:
                raise TarFormatError(f"{_where(name, pos - padded - _BLOCK)}: truncated member")
            if padded != size:
                f.seek(pos)
            yield name, data
        else:
            f.seek(pos)
            yield name, None


def check_member_size(size: int, where: str) -> None:
    """A member about to be read must not declare more than :data:`MAX_MEMBER_BYTES`."""
    if size > MAX_MEMBER_BYTES:
        raise TarFormatError(f"{where}: member is {size} bytes, more than the {MAX_MEMBER_BYTES} a reader of "
                             f"gpufeed reads")


def check_extended_size(typ: bytes, size: int, where: str) -> None:
    """An extended header's data size must be within its bound (:data:`MAX_LONG_NAME_BYTES`,
    :data:`MAX_PAX_BYTES`)."""
    bound = MAX_LONG_NAME_BYTES if typ in (b"L", b"K") else MAX_PAX_BYTES
    if not 0 <= size <= bound:
        raise TarFormatError(f"{where}: {'long-name' if typ in (b'L', b'K') else 'pax'} header size {size} "
                             f"is outside 0..{bound}")


class ShardRead:
    """What one read of a shard by :func:`iter_samples` found, for the loader to compare with the manifest: the
    digest of every key it passed (``keys``, from the shard's first sample, those before ``start`` included) and,
    when asked (``sha256=True``: the shard is then streamed whole), the file's sha256 once the end is read."""

    def __init__(self, sha256: bool = False) -> None:
        self.keys = KeyDigest()
        self.want_sha256 = sha256
        self.sha256: str | None = None


def _shard_members(f: BinaryIO, path: str, want: Callable[[str], bool], stream: bool, piped: bool,
                   read: ShardRead | None) -> tuple[TarPass | None, Iterator[tuple[str, bytes | None]]]:
    """The members of the shard open as ``f``, as ``(name, data)`` with data read only when ``want(name)``, for
    :func:`iter_samples`: through a :class:`TarPass` (returned too, for the end-of-shard check) for a gzip shard, a
    ``stream``, a ``piped`` file (one that cannot seek) or a ``read`` that asks for the sha256; else with
    :func:`iter_members`."""
    gzip = path.endswith((".tgz", ".tar.gz"))
    hash_file = read is not None and read.want_sha256
    tar_pass = TarPass(f, gzip, hash=hash_file) if gzip or stream or piped or hash_file else None
    if tar_pass is not None:
        return tar_pass, ((name, data) for name, _, data in tar_pass.members(lambda name, _: want(name)))
    return None, iter_members(f, want)


def _end_problem(tar_pass: TarPass | None, read: ShardRead | None) -> str | None:
    """Once :func:`iter_samples` has read the last member: what is wrong with the shard's end, or None. A stream
    read to the end must also end as index and verify demand (end blocks, nothing but zeros after them, the gzip
    CRC and length intact); when it does, its sha256 goes to ``read``."""
    problem = tar_pass.end_problem() if tar_pass is not None else None
    if read is not None and tar_pass is not None and problem is None:
        read.sha256 = tar_pass.sha256
    return problem


def iter_samples(path: str, extensions: frozenset[str], image_extensions: tuple[str, ...], start: int = 0,
                 stop: int | None = None, total: list[int] | None = None, stream: bool = False,
                 fileobj: BinaryIO | None = None, seekable: bool = False,
                 read: ShardRead | None = None) -> Iterator[dict]:
    """Samples ``[start, stop)`` of a tar shard, counting only keys with an image member: the local file at
    ``path``, or ``fileobj`` (a shard opened by :func:`gpufeed.shardset.source.open_shard`, read in one pass
    from its start and closed at the end; ``path`` then only names it).

    Each sample is ``{"__key__", "__url__", ext: bytes}`` for the members whose (lower-case) extension is in
    ``extensions``, plus ``"__duplicate__": ext`` when one of them appears twice in the sample (the caller
    refuses such a sample: index and verify report it). Samples before ``start`` are not read (a plain tar seeks over them). When the reader reaches
    the end of the shard (before ``stop``), ``total[0]`` is set to the shard's sample count.

    A gzip shard (``.tgz``, ``.tar.gz``), a ``fileobj``, or any shard with ``stream``, is read in one pass through
    :meth:`TarPass.members` (the same header checks, tarfile's reading, the same member cap); a plain one through
    :func:`iter_members`. Both group members with the same key rule, so both yield the same samples. Raises
    TarFormatError on a malformed shard, and what :class:`TarPass` documents on a gzip or stream read.

    ``seekable``: ``fileobj`` is a local file the caller opened (read like ``path``: by seeking when plain).
    ``read``: a :class:`ShardRead` fed every sample key (and the sha256, when it asks for it).
    """
    index = 0  # samples (keys with an image member) completed so far
    key: str | None = None
    sample: dict = {}
    has_image = False
    reading = start == 0

    def want(name: str) -> bool:  # called before the loop below sees ``name``: work out its sample index
        if not wanted(name, extensions):
            return False
        prefix, _ = split_member(name)
        if prefix == key:
            return reading
        return index + (1 if key is not None and has_image else 0) >= start

    with (open(path, "rb", buffering=1 << 20) if fileobj is None else fileobj) as f:
        tar_pass, members = _shard_members(f, path, want, stream, fileobj is not None and not seekable, read)
        for name, data in members:
            split = None if is_metadata(name) else split_member(name)
            if split is None:
                continue
            prefix, ext = split
            if prefix != key:
                if key is not None and has_image:
                    if read is not None:
                        read.keys.update(key)
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
                if ext in sample:  # a member name twice in one sample: which one is meant is not known
                    sample["__duplicate__"] = ext
                sample[ext] = data
        problem = _end_problem(tar_pass, read)  # checked before the last sample goes out, raised after it
        if key is not None and has_image:
            if read is not None:
                read.keys.update(key)
            if index >= start and (stop is None or index < stop):
                yield sample
            index += 1
        if total is not None:
            total[0] = index
        if problem is not None:
            raise TarFormatError(f"after member {tar_pass.last!r}: {problem}")


def file_problem(path: str | os.PathLike, set_root: str | os.PathLike | None = None) -> str | None:
    """Why ``path`` cannot be read as a shard file (``"is missing"``, ``"is a FIFO, not a regular file"``, ...),
    or None for a regular file (a symbolic link to one included). Never opens the path (a FIFO would block).
    ``set_root``: the folder of the set the shard belongs to; a symbolic link out of it is a problem too
    (:func:`gpufeed.core.safefs.set_link_problem`)."""
    import stat

    if set_root is not None:
        from gpufeed.core.safefs import set_link_problem

        why = set_link_problem(path, set_root)
        if why:
            return why
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return "is a broken symbolic link" if os.path.islink(path) else "is missing"
    except OSError as exc:
        return f"cannot be read ({exc.strerror or exc})"
    if stat.S_ISREG(mode):
        return None
    kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
            "a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a file")
    link = f"a symbolic link to {kind} ({os.path.realpath(path)})" if os.path.islink(path) else kind
    return f"is {link}, not a regular file"


# --------------------------------------------------------------------------- the checking pass (index, verify)

_TAIL_KEEP = 1 << 16
"""Decompressed bytes :class:`TarPass` keeps to check what follows the last member (tarfile reads 10 KiB ahead)."""


class _HashingReader:
    def __init__(self, f: Any, hash: bool = True) -> None:
        self.f = f
        self.h = hashlib.sha256() if hash else None
        self.n = 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        if self.h is not None:
            self.h.update(b)
        self.n += len(b)
        return b

    def drain(self) -> None:
        while self.read(1 << 20):
            pass


class _TailReader:
    """Counts the bytes read from a (decompressed) stream and keeps the last ones."""

    def __init__(self, f: Any) -> None:
        self.f = f
        self.n = 0
        self.tail = bytearray()

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.n += len(b)
        if len(b) >= _TAIL_KEEP:
            self.tail = bytearray(b[-_TAIL_KEEP:])
        else:
            self.tail += b
            if len(self.tail) > 2 * _TAIL_KEEP:
                del self.tail[:-_TAIL_KEEP]
        return b


class _HeaderCheck:
    """Reads through to the (decompressed) tar stream and parses each header as it passes, with the loader's
    :func:`parse_header` and :class:`HeaderChain`: a header they refuse raises :class:`TarFormatError` before
    tarfile sees it, and ``regular`` queues each regular member's (name, size) as the loader reads it, for
    :meth:`TarPass.members` to compare with tarfile's. Holds at most one header block and one extended header's
    data (bounded); stops at the first zero block, as both readers do.
    """

    def __init__(self, f: Any) -> None:
        self.f = f
        self.pos = 0  # offset of the block being assembled
        self.need = 512  # bytes the next piece (header block or extended data) needs
        self.buf = bytearray()
        self.skip = 0  # data bytes (member data, padding) to pass over
        self.ext: tuple[bytes, str, int, int] | None = None  # (type, where, header offset, size) of extended data
        self.chain = HeaderChain()
        self.done = False
        self.regular: collections.deque[tuple[str, int]] = collections.deque()

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        if not b and size != 0 and not self.done and (self.skip or self.buf or self.ext is not None):
            # the data ends inside a member (or its header): tarfile would seek over a declared size that is not
            # there block by block, for as long as the header says (2**80 bytes: forever)
            raise TruncatedMember(f"the tar ends {self.skip} bytes before the end of the member data its last "
                                  f"header declares" if self.skip else
                                  f"the tar ends inside a header or an extended header's data (offset {self.pos})")
        i, n = 0, len(b)
        while i < n and not self.done:
            if self.skip:
                k = min(self.skip, n - i)
                self.skip -= k
                i += k
                continue
            k = min(self.need - len(self.buf), n - i)
            self.buf += b[i:i + k]
            i += k
            if len(self.buf) == self.need:
                piece = bytes(self.buf)
                self.buf.clear()
                self._piece(piece)
        return b

    def _piece(self, piece: bytes) -> None:
        if self.ext is not None:  # an extended header's data
            typ, where, at, size = self.ext
            self.ext, self.need = None, 512
            self.skip = _padded(size) - size
            self.chain.extended(typ, piece, where, at)
            return
        if piece.count(0) == 512:
            self.done = True  # end of archive: what follows is end_problem's business
            return
        at = self.pos
        name, size, typ = parse_header(piece, at)
        where = f"member {name[:200]!r} (header at offset {at})"
        if typ in EXTENDED_TYPES or typ == b"g":
            check_extended_size(typ, size, where)
            self.pos = at + 512 + _padded(size)
            if size:
                self.ext, self.need = (typ, where, at, size), size
            else:
                self.chain.extended(typ, b"", where, at)
            return
        name, size, regular = self.chain.member(name, size, typ, at)
        self.pos = at + 512 + _padded(size)
        self.skip = _padded(size)
        if regular:
            self.regular.append((name, size))


class TruncatedMember(ValueError):
    """A member's data ends before its header's size."""


class TarPass:
    """One streaming pass over an open shard file: the file's sha256 and size, its regular members, and the
    end-of-archive check (the tar, decompressed for gzip shards, must end with two zero blocks after the last
    member and hold nothing but zeros after them; a tar cut at a member boundary or a bad header after a
    member reads as a shorter, clean-looking shard to every tar reader, so only this check catches it).

    Call :meth:`members` to the end, then :meth:`end_problem`. Unreadable data raises ``tarfile.TarError``,
    ``EOFError``, ``OSError`` (gzip), ``zlib.error`` or :class:`TruncatedMember`; a header the loader's reader
    (:func:`iter_members`) refuses or reads differently raises :class:`TarFormatError`.
    """

    def __init__(self, f: Any, gzip: bool, hash: bool = True) -> None:
        self.raw = _HashingReader(f, hash)
        self.stream = _TailReader(gzip_module.GzipFile(fileobj=self.raw, mode="rb") if gzip else self.raw)
        self.check = _HeaderCheck(self.stream)
        self.offset = 0
        self.last: str | None = None
        """Name of the last member read (for messages)."""

    def members(self, want: Callable[[str, int], bool]) -> Iterator[tuple[str, int, bytes | None]]:
        """Regular members as ``(name, size, data)``; data is read only when ``want(name, size)``. Every header
        passes the loader's checks first (:class:`_HeaderCheck`), and each member must be the one the loader reads
        there (same name and size), else :class:`TarFormatError`; a wanted member over :data:`MAX_MEMBER_BYTES` raises
        :class:`TarFormatError` before its data is read."""
        with tarfile.open(fileobj=self.check, mode="r|") as tar:
            for m in tar:
                self.last = m.name
                if not m.isreg():
                    continue
                theirs = self.check.regular.popleft() if self.check.regular else None
                if theirs != (m.name, m.size):
                    raise TarFormatError(f"member {m.name[:200]!r} (header at offset {m.offset}): tar readers "
                                         f"disagree (tarfile reads {m.size} bytes named {m.name[:200]!r}, the loader "
                                         f"{theirs!r})")
                data = None
                if want(m.name, m.size):
                    check_member_size(m.size, f"member {m.name[:200]!r} (header at offset {m.offset})")
                    fobj = tar.extractfile(m)
                    data = fobj.read() if fobj is not None else b""
                    if len(data) != m.size:
                        raise TruncatedMember(f"member {m.name} is truncated: {len(data)} of {m.size} bytes")
                yield m.name, m.size, data
            self.offset = tar.offset

    def end_problem(self) -> str | None:
        """After :meth:`members`: read the rest of the file; a sentence when the tar does not end cleanly."""
        read = self.stream.n
        ahead = read - self.offset  # bytes tarfile read past the last member, kept in the tail
        garbage = ahead > 0 and bool(bytes(self.stream.tail[-ahead:]).strip(b"\0"))
        while b := self.stream.read(1 << 20):
            garbage = garbage or bool(b.strip(b"\0"))
        self.raw.drain()
        if self.stream.n - self.offset < 1024:
            return ("tar is truncated after this member: it ends without its end-of-archive blocks (the tar does "
                    "not read to the end; the shard was probably cut short)")
        if garbage:
            return (f"invalid tar header after this member (byte {self.offset} of the tar): readers stop here and "
                    f"silently lose the rest of the shard")
        return None

    @property
    def sha256(self) -> str | None:
        return self.raw.h.hexdigest() if self.raw.h is not None else None
