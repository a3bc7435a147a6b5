"""A resumable destination folder, shared by ``gpufeed shard`` and ``gpufeed stage`` (docs/design.md §1): the
run's lock in the job's state folder, each output written to a temporary ``.<name>.tmp`` and renamed into place,
then recorded by its ``<name>.done.json`` sidecar, which a re-run reads to keep what is complete.

Every file is opened through :mod:`gpufeed.core.safefs`: the lock never through a link (a link there is replaced,
its target untouched), a sidecar never read through a link out of the state folder, and bounded."""

from __future__ import annotations

import json
import os
from typing import Any, Callable

from gpufeed.core.errors import DataError

LOCK_NAME = "lock"
"""The lock file in a job's state folder; it records the holder's pid."""

_LOCK_PID_BYTES = 32
"""Bytes of the lock file read for the holder's pid (it holds one decimal number and a newline)."""


_HELD: set[int] = set()
"""Descriptors of the locks this process holds (:func:`take_lock` adds, :func:`release_lock` removes)."""


def _close_held_in_child() -> None:
    """In a forked child (a DataLoader or pool worker started by fork): close its copies of the lock descriptors.
    A ``flock`` belongs to the open file, which fork shares, so a child that outlives the run (a persistent loader
    worker not yet reaped) would otherwise keep the run's lock held after the run released it."""
    for fd in list(_HELD):
        try:
            os.close(fd)
        except OSError:
            pass
    _HELD.clear()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_close_held_in_child)


def hold_lock(fd: int) -> int:
    """Count ``fd`` (a flocked descriptor) among this process's locks: forked children close their copy."""
    _HELD.add(fd)
    return fd


def release_lock(fd: int) -> None:
    """Release a lock :func:`take_lock` returned (close its descriptor)."""
    _HELD.discard(fd)
    os.close(fd)


def take_lock(path: str | os.PathLike, *, what: str, in_use: Callable[[str], str],
              unopenable: Callable[[OSError], str] | None = None) -> int:
    """An exclusive ``flock`` on the lock file ``path`` for the whole run, recording this pid -> its descriptor
    (:func:`release_lock` releases it; forked children close their copies, so only this process holds it).
    Close-on-exec, so the lock dies with this process: a run killed with -9 leaves a lock file the next run simply
    takes. A held lock is refused (DataError) with ``in_use(who)``, ``who``
    naming the holder's pid (" (pid N)") when the file records one, else "". ``unopenable(exc)``: the sentence
    when the file cannot be opened (else the OSError propagates)."""
    import fcntl

    from gpufeed.core.safefs import lock_file

    try:  # never through a link: a link there is replaced by a regular file, its target left untouched
        fd = lock_file(path, what=what)
    except OSError as exc:
        if unopenable is None:
            raise
        raise DataError(unopenable(exc)) from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        holder = os.pread(fd, _LOCK_PID_BYTES, 0).strip()
        os.close(fd)
        who = f" (pid {int(holder)})" if holder.isdigit() and len(holder) <= 10 else ""
        raise DataError(in_use(who)) from None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    return hold_lock(fd)


def temp_path(folder: str | os.PathLike, name: str) -> str:
    """Where output ``name`` of ``folder`` is written before it is complete: ``folder/.<name>.tmp``."""
    return os.path.join(folder, f".{name}.tmp")


def remove_temps(folder: str | os.PathLike, names: Any) -> None:
    """Delete the temporary files of outputs ``names`` (a killed run's, or a stopped write's), where present."""
    for name in names:
        try:
            os.unlink(temp_path(folder, name))
        except FileNotFoundError:
            pass


def publish(folder: str | os.PathLike, name: str) -> None:
    """Rename the complete temporary file of output ``name`` into place (atomic against a killed process)."""
    os.replace(temp_path(folder, name), os.path.join(folder, name))


def done_path(state: str | os.PathLike, name: str) -> str:
    """The sidecar of output ``name`` in the state folder ``state``: ``<name>.done.json``."""
    return os.path.join(state, f"{name}.done.json")


def write_done(state: str | os.PathLike, name: str, record: dict[str, Any], *, pretty: bool = False) -> None:
    """Record output ``name`` as complete: its sidecar, written atomically after the output is in place.
    ``pretty``: indented JSON and a newline (``records.write_json``, stage's sidecars), else one compact line
    (one C-encoder call, shard's)."""
    from gpufeed.core.records import atomic_write_bytes, write_json

    if pretty:
        write_json(done_path(state, name), record)
    else:
        atomic_write_bytes(done_path(state, name), json.dumps(record).encode("utf-8"))


def read_done(state: str | os.PathLike, name: str, max_bytes: int, *, what: str) -> dict[str, Any] | None:
    """The sidecar of output ``name`` as a dict, or None when it is missing, unreadable, not a JSON object, larger
    than ``max_bytes``, or a link out of the state folder (safefs: never read through it)."""
    from gpufeed.core.safefs import read_set_file

    try:
        data = json.loads(read_set_file(done_path(state, name), state, max_bytes, what=what, where="state folder"))
    except (OSError, ValueError, DataError):
        return None
    return data if isinstance(data, dict) else None
