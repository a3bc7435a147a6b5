"""Opening files without following links: the one place gpufeed opens a file it writes in DEST or a run folder,
and a file it reads from a shard set (docs/threat-model.md, "Files gpufeed writes, and how" and "Files read from a
set"). Stdlib only; torch-free.

Writes. A file gpufeed writes is never opened through a symbolic link:

- whole files (manifest, index, records, reports, config.toml, sidecars) are written to a temporary file created
  with ``O_CREAT | O_EXCL | O_NOFOLLOW`` (``tempfile.mkstemp``) and renamed over the name
  (:func:`gpufeed.core.records.atomic_writer`): a link at the name is replaced, its target never opened;
- files opened in place (locks, appended logs, shard temporaries, stop files) go through :func:`open_regular`:
  ``O_NOFOLLOW | O_NONBLOCK``, a symbolic link at the name is removed and a regular file created in its place
  (``O_EXCL``), and an existing file that is not a regular file (a FIFO, a device, a folder) is refused in one
  sentence. The link's target is never opened, truncated or written.

Reads. A file read from a set (:func:`open_set_file`, :func:`read_set_file`) must be a regular file, within its
size bound, and not a link that leads out of the set's folder: a symbolic link is followed only when its resolved
target lies inside that folder (a set that links ``index.parquet`` to a sibling in the same folder still works);
otherwise it is refused, naming the file, never its contents. Files the user typed (``--config``, ``--classes``)
may be links, since the user chose them, but must still be regular files within their bound
(:func:`read_user_file`).
"""

from __future__ import annotations

import errno
import os
import stat

from gpufeed.core.errors import DataError

_REPLACE_TRIES = 3
"""Times :func:`open_regular` replaces a symbolic link at its name before it gives up (a race with someone who
keeps putting one back)."""


def _strerror(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def open_regular(path: str | os.PathLike, flags: int, *, mode: int = 0o666, what: str = "file") -> int:
    """A descriptor of ``path`` opened with ``flags`` (``os.O_WRONLY``/``O_RDWR`` plus e.g. ``O_APPEND``,
    ``O_TRUNC``), created when missing, never through a link: ``O_NOFOLLOW | O_NONBLOCK | O_CLOEXEC``; a symbolic
    link at ``path`` is removed and a regular file created in its place; an existing FIFO, device or folder is
    refused (DataError naming ``path`` as ``what``). The descriptor is blocking once it is checked."""
    p = os.fspath(path)
    base = flags | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    trunc = base & os.O_TRUNC
    base &= ~os.O_TRUNC  # truncate only once the file is known to be a regular file
    for _ in range(_REPLACE_TRIES):
        try:
            fd = os.open(p, base | os.O_CREAT, mode)
        except OSError as exc:
            if exc.errno == errno.ELOOP:  # a symbolic link: replace it, never open its target
                try:
                    if stat.S_ISLNK(os.lstat(p).st_mode):
                        os.unlink(p)
                except FileNotFoundError:
                    pass
                continue
            if exc.errno in (errno.ENXIO, errno.EISDIR, errno.EOPNOTSUPP):  # a FIFO without reader, a folder
                raise DataError(f"{p} is not a regular file, so gpufeed does not write its {what} there; remove "
                                f"it") from None
            raise
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise DataError(f"{p} is not a regular file, so gpufeed does not write its {what} there; remove it")
            if trunc:
                os.ftruncate(fd, 0)
            os.set_blocking(fd, True)
        except BaseException:
            os.close(fd)
            raise
        return fd
    raise DataError(f"{p} keeps being replaced by a symbolic link; gpufeed does not write its {what} through a link")


def open_append(path: str | os.PathLike, *, what: str = "log"):  # -> TextIO
    """A text file appending to ``path`` (:func:`open_regular` with ``O_APPEND``), for logs written as a run goes."""
    fd = open_regular(path, os.O_WRONLY | os.O_APPEND, what=what)
    return os.fdopen(fd, "a", encoding="utf-8")


def open_write(path: str | os.PathLike, *, what: str = "file"):  # -> BinaryIO
    """A binary file writing ``path`` from its start (truncated), :func:`open_regular` with ``O_TRUNC``."""
    fd = open_regular(path, os.O_WRONLY | os.O_TRUNC, what=what)
    return os.fdopen(fd, "wb")


def lock_file(path: str | os.PathLike, *, what: str = "lock") -> int:
    """A read-write descriptor of the lock file ``path`` for ``flock`` (not truncated: the caller truncates once it
    holds the lock), opened by :func:`open_regular`."""
    return open_regular(path, os.O_RDWR, what=what)


def _inside(target: str, root: str) -> bool:
    try:
        return os.path.commonpath([target, root]) == root
    except ValueError:
        return False


def set_link_problem(path: str | os.PathLike, root: str | os.PathLike, *, where: str = "set folder") -> str | None:
    """Why ``path``, a file of the set in folder ``root``, must not be read: a symbolic link whose target lies
    outside ``root`` (None: not a link, or a link inside the set). Missing files are not a problem here.
    ``where`` names the folder in the sentence ("set folder", "state folder", "run folder")."""
    p = os.fspath(path)
    try:
        if not stat.S_ISLNK(os.lstat(p).st_mode):
            return None
    except OSError:
        return None
    real_root = os.path.realpath(os.fspath(root))
    if _inside(os.path.realpath(p), real_root):
        return None
    return (f"is a symbolic link that leads out of the {where} {os.fspath(root)}; gpufeed reads only files inside "
            f"it (copy the file in instead of linking it)")


def open_set_file(path: str | os.PathLike, root: str | os.PathLike, *, max_bytes: int | None = None,
                  what: str = "file of the set", where: str = "set folder") -> int:
    """A read-only descriptor of ``path``, a file of the set in folder ``root``: refused (DataError naming the file,
    never its contents) when it is a symbolic link out of ``root`` (:func:`set_link_problem`), not a regular file,
    or larger than ``max_bytes``. A link inside the set is opened by its resolved target with ``O_NOFOLLOW``; a
    missing file raises FileNotFoundError."""
    p = os.fspath(path)
    why = set_link_problem(p, root, where=where)
    if why:
        raise DataError(f"{what} {p} {why}")
    target = os.path.realpath(p) if os.path.islink(p) else p
    try:
        fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise DataError(f"{what} {p} became a symbolic link while it was opened; it was not read") from None
        if exc.errno == errno.ENOENT:
            raise
        raise DataError(f"cannot read {what} {p} ({_strerror(exc)})") from None
    return _regular_read_fd(fd, p, max_bytes, what)


def _regular_read_fd(fd: int, p: str, max_bytes: int | None, what: str) -> int:
    """``fd``, opened non-blocking for reading ``p``, checked to be a regular file of at most ``max_bytes`` and made
    blocking; else closed, and DataError naming ``p`` as ``what``."""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{what} {p} is not a regular file; it was not read")
        if max_bytes is not None and st.st_size > max_bytes:
            raise DataError(f"{what} {p} is {st.st_size} bytes, more than the {max_bytes} gpufeed reads; it was not "
                            f"read")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _read_bounded(fd: int, p: str, max_bytes: int, what: str) -> bytes:
    with os.fdopen(fd, "rb") as f:
        data = f.read(max_bytes + 1)  # st_size can lie (/proc, a growing file): the read itself is bounded
    if len(data) > max_bytes:
        raise DataError(f"{what} {p} is more than the {max_bytes} bytes gpufeed reads; it was not read")
    return data


def read_set_file(path: str | os.PathLike, root: str | os.PathLike, max_bytes: int, *,
                  what: str = "file of the set", where: str = "set folder") -> bytes:
    """The bytes of ``path``, a file of the set in folder ``root`` (:func:`open_set_file`), at most ``max_bytes``."""
    fd = open_set_file(path, root, max_bytes=max_bytes, what=what, where=where)
    return _read_bounded(fd, os.fspath(path), max_bytes, what)


def open_user_file(path: str | os.PathLike, *, what: str = "file", max_bytes: int | None = None) -> int:
    """A read-only descriptor of ``path``, a file the user named (it may be a link): a regular file (checked on the
    open descriptor, so a FIFO never blocks) of at most ``max_bytes`` when given, else DataError naming it. A
    missing file raises FileNotFoundError."""
    p = os.fspath(path)
    try:
        fd = os.open(p, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as exc:
        raise DataError(f"cannot read {what} {p} ({_strerror(exc)})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise DataError(f"{what} {p} cannot be read: it is not a regular file")
        if max_bytes is not None and st.st_size > max_bytes:
            raise DataError(f"{what} {p} is {st.st_size} bytes, more than the {max_bytes} gpufeed reads")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_user_file(path: str | os.PathLike, max_bytes: int, *, what: str = "file") -> bytes:
    """The bytes of ``path``, a file the user named (:func:`open_user_file`), at most ``max_bytes``."""
    return _read_bounded(open_user_file(path, what=what, max_bytes=max_bytes), os.fspath(path), max_bytes, what)


def folder_link_note(folder: str | os.PathLike, root: str | os.PathLike) -> str | None:
    """A note when ``folder`` (under ``root``) is reached through a symbolic link that leads out of ``root``: the
    folder and where it points; None otherwise."""
    real_root = os.path.realpath(os.fspath(root))
    real = os.path.realpath(os.fspath(folder))
    if _inside(real, real_root):
        return None
    return f"{os.fspath(folder)} is a symbolic link out of {os.fspath(root)} (to {real}); its files are read from there"



def make_state_folder(path: str | os.PathLike, *, what: str = "state folder") -> None:
    """Create gpufeed's own folder ``path`` (in DEST) when missing; an existing one must be a real folder, not a
    symbolic link (whose target would receive gpufeed's files) or a file: DataError naming it otherwise."""
    p = os.fspath(path)
    try:
        os.mkdir(p)
    except FileExistsError:
        pass
    if not stat.S_ISDIR(os.lstat(p).st_mode):
        raise DataError(f"{p} is not a folder (a symbolic link or a file), so gpufeed does not use it as its {what}; "
                        f"remove it")


def _parts_below(root: str, path: str, what: str, where: str) -> list[str]:
    """The components of ``path`` below the folder ``root`` (both made absolute, lexically); DataError when
    ``path`` is not below ``root``."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    if rel == os.curdir:
        return []
    parts = rel.split(os.sep)
    if os.path.isabs(rel) or os.pardir in parts:
        raise DataError(f"{what} {path} is not inside the {where} {root}; gpufeed reads and writes only there")
    return parts


def link_below(root: str | os.PathLike, path: str | os.PathLike, *, what: str = "path",
               where: str = "run folder") -> str | None:
    """The first component of ``path`` below the folder ``root`` that is a symbolic link (or None: none is; the
    walk ends at the first missing component, which whoever writes there creates as a real one). ``root`` itself
    may be a link: the user named it. DataError when ``path`` is not below ``root``."""
    r, p = os.fspath(root), os.fspath(path)
    cur = os.path.abspath(r)
    for part in _parts_below(r, p, what, where):
        cur = os.path.join(cur, part)
        try:
            if stat.S_ISLNK(os.lstat(cur).st_mode):
                return cur
        except FileNotFoundError:
            return None
    return None


def _is_link(name: str, dir_fd: int) -> bool:
    try:
        return stat.S_ISLNK(os.lstat(name, dir_fd=dir_fd).st_mode)
    except OSError:
        return False


def open_below(path: str | os.PathLike, root: str | os.PathLike, *, max_bytes: int | None = None,
               what: str = "file", where: str = "run folder") -> int:
    """A read-only descriptor of ``path``, a file below the folder ``root`` (a run folder someone else may have
    prepared), opened one component at a time from ``root`` with ``O_NOFOLLOW``: no folder on the way and not the
    file may be a symbolic link (gpufeed writes none there), the file must be a regular file of at most
    ``max_bytes``; else DataError naming it, never its contents. A missing file raises FileNotFoundError."""
    r, p = os.fspath(root), os.fspath(path)
    parts = _parts_below(r, p, what, where)
    if not parts:
        raise DataError(f"{what} {p} is the {where} itself, not a file in it")
    walk = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
    fd = os.open(r, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)  # the root may be a link: the user named it
    try:
        for i, part in enumerate(parts):
            last = i == len(parts) - 1
            try:
                nxt = os.open(part, walk | (os.O_NONBLOCK if last else os.O_DIRECTORY), dir_fd=fd)
            except OSError as exc:
                if exc.errno == errno.ENOENT:
                    raise
                if exc.errno in (errno.ELOOP, errno.ENOTDIR) and _is_link(part, fd):
                    link = os.path.join(os.path.abspath(r), *parts[:i + 1])
                    raise DataError(f"{what} {p} is reached through the symbolic link {link}; gpufeed reads only "
                                    f"real files and folders inside the {where} {r}") from None
                raise DataError(f"cannot read {what} {p} ({_strerror(exc)})") from None
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return _regular_read_fd(fd, p, max_bytes, what)


def read_below(path: str | os.PathLike, root: str | os.PathLike, max_bytes: int, *, what: str = "file",
               where: str = "run folder") -> bytes:
    """The bytes of ``path``, a file below the folder ``root`` (:func:`open_below`), at most ``max_bytes``."""
    fd = open_below(path, root, max_bytes=max_bytes, what=what, where=where)
    return _read_bounded(fd, os.fspath(path), max_bytes, what)


__all__ = ["open_regular", "open_append", "open_write", "lock_file", "set_link_problem", "open_set_file",
           "read_set_file", "open_user_file", "read_user_file", "folder_link_note", "make_state_folder", "link_below",
           "open_below", "read_below"]
