"""Results are plain records: frozen dataclasses -> JSON / JSONL / Parquet, written atomically.

Run folders (``runs/<job>-<timestamp>/``) hold the resolved config, an environment snapshot,
the records, ``summary.json`` and a human report.
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime as _dt
import errno
import json
import math
import os
import tempfile
from pathlib import Path
from typing import Any, BinaryIO, Iterable, Iterator


def to_jsonable(obj: Any) -> Any:
    """Dataclasses, paths, tuples, numpy scalars and non-finite floats -> plain JSON values."""
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return {f.name: to_jsonable(getattr(obj, f.name)) for f in dataclasses.fields(obj)}
    if isinstance(obj, dict):
        return {str(k): to_jsonable(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [to_jsonable(v) for v in obj]
    if isinstance(obj, Path):
        return str(obj)
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, (str, int, bool)) or obj is None:
        return obj
    if hasattr(obj, "item") and callable(obj.item):  # numpy / torch scalars
        return to_jsonable(obj.item())
    return str(obj)


@contextlib.contextmanager
def atomic_writer(path: str | Path, mode: int | None = None, limit: int = 0o777) -> Iterator[BinaryIO]:
    """THE atomic writer: yields a temporary file in ``path``'s folder; on a clean exit it is fsynced, renamed
    over ``path`` and the folder fsynced, so ``path`` holds either its old content or all that was written, even
    after a power loss; on an exception the temporary file is removed. The file gets ``mode`` (default
    ``0666 & ~umask``; 0600 for a file holding a secret, which then is never readable by others, not even
    before the rename). ``limit``: permission bits the file may have at most (a copy's: its source's)."""
    path = Path(path)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    except OSError as exc:
        raise _named(exc, path) from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), (0o666 & ~_umask() if mode is None else mode) & limit)  # mkstemp makes 0600
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        if isinstance(exc, OSError) and exc.filename in (None, tmp):  # the write's own failure, not the caller's
            raise _named(exc, path) from None
        raise
    fsync_dir(path.parent)


def _named(exc: OSError, path: Path) -> OSError:
    """``exc`` naming ``path``, the file being written, rather than its temporary (or nothing)."""
    return type(exc)(exc.errno, exc.strerror, str(path)) if exc.errno else exc


def check_writable(path: str | Path, what: str) -> None:
    """ConfigError (exit 2) unless a file can be written at ``path`` (its folder, made as :func:`atomic_writer`
    would make it, takes a new file): an output checked before the work whose result it will hold."""
    from gpufeed.core.errors import ConfigError

    p = Path(path)
    try:
        p.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{p.name}.", suffix=".tmp", dir=p.parent)
    except OSError as exc:
        raise ConfigError(f"{what} {p} cannot be written: {exc.strerror or exc} ({p.parent})") from None
    os.close(fd)
    os.unlink(tmp)


MAX_TEMP_SCAN = 100_000
"""Folder entries :func:`remove_stale_temporaries` looks at, at most."""


def remove_stale_temporaries(path: str | Path) -> list[Path]:
    """Remove what :func:`atomic_writer` left of ``path`` when its process was killed mid-write: the files named
    ``.NAME.XXXXXXXX.tmp`` (mkstemp's 8 characters) in ``path``'s folder, regular files only (a link or a folder
    of that name is left alone; ``unlink`` never follows a link). Only for a ``path`` that no other process
    writes at the same time (rank 0's checkpoint). Bounded: at most :data:`MAX_TEMP_SCAN` entries are looked at.
    Returns the removed paths; a file that cannot be removed is left."""
    import re

    path = Path(path)
    ours = re.compile(re.escape(f".{path.name}.") + r"[a-z0-9_]{8}\.tmp")
    removed: list[Path] = []
    try:
        entries = os.scandir(path.parent)
    except OSError:
        return removed
    with entries:
        for n, entry in enumerate(entries):
            if n >= MAX_TEMP_SCAN:
                break
            if not ours.fullmatch(entry.name):
                continue
            try:
                if entry.is_file(follow_symlinks=False):
                    os.unlink(entry.path)
                    removed.append(Path(entry.path))
            except OSError:
                continue
    return removed


def atomic_write_bytes(path: str | Path, data: bytes, mode: int | None = None) -> None:
    """Write ``data`` to ``path`` with :func:`atomic_writer` (``mode``: its permission bits)."""
    with atomic_writer(path, mode) as f:
        f.write(data)


def atomic_write_text(path: str | Path, text: str, encoding: str = "utf-8") -> None:
    """``atomic_write_bytes`` for text a person reads (report.md): the password of every URL in it hidden, as in
    every record (:func:`gpufeed.core.redact.redact`)."""
    from gpufeed.core.redact import redact

    atomic_write_bytes(path, redact(text).encode(encoding))


def fsync_dir(folder: str | Path) -> None:
    """Make a rename (or creation) in ``folder`` durable; a no-op where folders cannot be fsynced."""
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def read_file_bytes(path: str | Path, max_bytes: int, what: str, *, set_root: str | Path | None = None) -> bytes:
    """The bytes of ``path``, a file that came with data (a manifest, a run record): it must be a regular file (a
    FIFO would block ``open`` forever) of at most ``max_bytes``, else a DataError naming it as ``what`` in one
    sentence. ``set_root``: the folder of the set ``path`` belongs to; then a symbolic link out of that folder is
    refused too (:func:`gpufeed.core.safefs.read_set_file`). The message never quotes the file's contents."""
    import stat

    from gpufeed.core.errors import DataError
    from gpufeed.core.safefs import open_set_file, set_link_problem

    p = Path(path)
    try:
        if set_root is not None and (why := set_link_problem(p, set_root)):
            raise DataError(f"{p} {why}, so it is not read as {what}")
        if not stat.S_ISREG(p.stat().st_mode):
            raise DataError(f"{p} is not a regular file, so not {what}")
        if set_root is not None:
            with os.fdopen(open_set_file(p, set_root, what=what), "rb") as f:
                raw = f.read(max_bytes + 1)
        else:
            with open(p, "rb") as f:
                raw = f.read(max_bytes + 1)
    except OSError as exc:
        raise DataError(f"{p} is not readable, so not {what} ({exc.strerror or exc})") from None
    if len(raw) > max_bytes:
        raise DataError(f"{p} is larger than {max_bytes >> 20} MiB; it is not {what}")
    return raw


def read_json_file(path: str | Path, max_bytes: int, what: str, *, set_root: str | Path | None = None) -> Any:
    """The JSON value in ``path`` (read by :func:`read_file_bytes`): UTF-8 and valid JSON, else a DataError naming
    it as ``what`` in one sentence that never quotes the file's bytes."""
    from gpufeed.core.errors import DataError, one_line

    raw = read_file_bytes(path, max_bytes, what, set_root=set_root)
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        if isinstance(exc, json.JSONDecodeError):  # never echo the file's bytes
            why = f"{exc.msg}: line {exc.lineno} column {exc.colno} (char {exc.pos})"
        elif isinstance(exc, UnicodeDecodeError):
            why = f"{type(exc).__name__} at byte {exc.start}"
        else:
            why = one_line(exc)[:160]
        raise DataError(f"{Path(path)} is not readable JSON, so not {what} ({why})") from None


def dumps(obj: Any, *, indent: int | None = 2, redact: bool = True) -> str:
    """``obj`` as JSON text for a record or ``--json`` output, the password of every URL in its strings replaced
    by ``***`` (:func:`gpufeed.core.redact.redact_obj`: each string is redacted before it is quoted, so a password
    holding quotes or backslashes is hidden whole). ``redact=False`` only for data that is read back as written
    (a manifest)."""
    from gpufeed.core.redact import redact_obj

    value = to_jsonable(obj)
    return json.dumps(redact_obj(value) if redact else value, indent=indent, sort_keys=False, ensure_ascii=False)


def write_json(path: str | Path, obj: Any, *, redact: bool = True) -> Path:
    """``obj`` as a JSON file (:func:`dumps`: URLs' passwords hidden unless ``redact=False``), atomically."""
    atomic_write_bytes(path, (dumps(obj, redact=redact) + "\n").encode("utf-8"))
    return Path(path)


def write_jsonl(path: str | Path, records: Iterable[Any]) -> Path:
    lines = "".join(dumps(r, indent=None) + "\n" for r in records)
    atomic_write_bytes(path, lines.encode("utf-8"))
    return Path(path)


def append_jsonl(path: str | Path, record: Any) -> None:
    """Append one record (for logs written while a run goes on), never through a link
    (:func:`gpufeed.core.safefs.open_append`)."""
    from gpufeed.core.safefs import open_append

    with open_append(path, what="log") as f:
        f.write(dumps(record, indent=None) + "\n")


def write_parquet(path: str | Path, records: list[Any]) -> Path:
    """Records (dataclasses or dicts) -> one Parquet table; nested values are stored as JSON text."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from gpufeed.core.redact import redact_obj

    rows = [redact_obj(to_jsonable(r)) for r in records]
    columns: dict[str, list[Any]] = {}
    for row in rows:
        for key in row:
            columns.setdefault(key, [])
    for key in columns:
        values = [row.get(key) for row in rows]
        if any(isinstance(v, (dict, list)) for v in values):
            values = [None if v is None else json.dumps(v) for v in values]
        columns[key] = values
    table = pa.table(columns) if columns else pa.table({})
    buf = pa.BufferOutputStream()
    pq.write_table(table, buf)
    atomic_write_bytes(path, buf.getvalue().to_pybytes())
    return Path(path)


def make_run_dir(job: str, root: str | Path = "runs") -> Path:
    """Create ``root/<job>-<UTC timestamp>[-N]/`` and return it."""
    stamp = _dt.datetime.now(_dt.timezone.utc).strftime("%Y%m%d-%H%M%S")
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    for n in range(1000):
        run = root / (f"{job}-{stamp}" if n == 0 else f"{job}-{stamp}-{n}")
        try:
            run.mkdir()
            return run
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a run folder under {root}")


def utc_now() -> str:
    return _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds")
