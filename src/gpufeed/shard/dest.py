"""DEST and its state folder ``DEST/.gpufeed``, besides the shards themselves: the run's lock, what is already
there (resume, refuse, or clear with ``--overwrite``: ``load_plan``), the transcode cache and leftovers of
killed runs, the free-space checks and the one-sentence OS errors (package docstring, "Resume" and "Disk
space")."""

from __future__ import annotations

import os
import re
import shutil

from gpufeed.config import ShardConfig
from gpufeed.core.dest import LOCK_NAME, take_lock
from gpufeed.core.errors import DataError, GpufeedError, RunError
from gpufeed.shard.shardplan import PLAN_NAME, SHARD_RE, Plan, read_plan

STATE_DIR = ".gpufeed"
_IDX_RE = re.compile(r"^[A-Za-z0-9_-]+-\d{6}\.idx$")
"""A shard's DALI index (``gpufeed.shardset.sidecars``): one of our outputs."""
_IDX_TMP_RE = re.compile(r"^\.[A-Za-z0-9_-]+-\d{6}\.idx\..*\.tmp$")


def lock_dest(dest: str, cfg: ShardConfig, name: str = LOCK_NAME) -> int:
    """An exclusive ``flock`` on DEST/.gpufeed/lock for the whole run (:func:`gpufeed.core.dest.take_lock`: a second
    run into the same DEST is refused, naming the holder's pid, which the file records). The forked pool workers
    close their copy (``system.die_with_parent``), so the lock dies with this process: a run killed with -9 leaves
    a lock the next run simply takes. ``name``: a static split's node lock (``split.NodeSplit.lock_name``)."""
    path = os.path.join(dest, STATE_DIR, name)
    return take_lock(
        path, what="shard lock",
        in_use=lambda who: (f"DEST {cfg.dest} is in use by another `gpufeed shard` run{who}; wait for it to finish "
                            f"or choose another DEST"),
        unopenable=lambda exc: f"{path} cannot be opened ({exc.strerror or exc}); DEST {cfg.dest} is not writable")


def _our_outputs(dest: str) -> list[str]:
    out = []
    for name in sorted(os.listdir(dest)):
        if name in ("manifest.json", "index.parquet", "_info.json", "wids.json", STATE_DIR) or SHARD_RE.match(name) \
                or _IDX_RE.match(name) or (name.startswith(".") and name.endswith(".tar.tmp")):
            out.append(name)
    return out


def load_plan(dest: str, fingerprint: str, cfg: ShardConfig) -> Plan | None:
    """The stored plan when it matches; refuse a different one unless overwrite (then clear our files)."""
    if not os.path.isdir(dest):
        return None
    plan_path = os.path.join(dest, STATE_DIR, PLAN_NAME)
    existing = _our_outputs(dest)
    if not [n for n in existing if n != STATE_DIR and not n.endswith(".tar.tmp")] and not os.path.exists(plan_path):
        # Only leftovers of a run interrupted before its plan was saved: start afresh.
        for name in existing:
            _remove(dest, name)
        return None
    if os.path.exists(plan_path):
        plan = read_plan(os.path.join(dest, STATE_DIR))
        if plan is not None and plan.meta["fingerprint"] == fingerprint:
            return plan
        why = "was planned from different input files or options"
    else:
        why = "already holds a shard set not written by this command"
    if not cfg.overwrite:
        raise DataError(f"DEST {cfg.dest} {why}; re-run with --overwrite to replace it")
    # Manifest first, so a half-cleared folder is never taken for a complete set.
    for name in ["manifest.json"] + [n for n in existing if n != "manifest.json"]:
        _remove(dest, name)
    return None


def _remove(dest: str, name: str) -> None:
    """Remove one of our outputs; the state folder keeps its lock file (held by this run)."""
    p = os.path.join(dest, name)
    if name == STATE_DIR:
        for inner in os.listdir(p):
            if inner != LOCK_NAME:
                q = os.path.join(p, inner)
                shutil.rmtree(q) if os.path.isdir(q) and not os.path.islink(q) else os.unlink(q)
    elif os.path.isdir(p) and not os.path.islink(p):
        shutil.rmtree(p)
    elif os.path.lexists(p):
        os.unlink(p)


def atomic_leftover(name: str) -> bool:
    """A temporary file that ``records.atomic_write_bytes`` left in DEST when a run was killed mid-write."""
    return name.endswith(".tmp") and (name.startswith(tuple(f".{n}." for n in ("manifest.json", "index.parquet",
                                                                                "_info.json", "wids.json")))
                                      or bool(_IDX_TMP_RE.match(name)))


def clear_cache(state: str) -> None:
    """Delete the transcode cache files and the temporary files of interrupted atomic writes in the state folder."""
    for name in os.listdir(state):
        if (name.startswith("enc-") and name.endswith(".bin")) or (name.startswith(".") and name.endswith(".tmp")):
            os.unlink(os.path.join(state, name))


def cache_bytes(state: str) -> int:
    """Bytes of the transcode cache files (``enc-*.bin``, re-encoded images awaiting their shards) in ``state``."""
    total = 0
    for name in os.listdir(state):
        if name.startswith("enc-") and name.endswith(".bin"):
            try:
                total += os.path.getsize(os.path.join(state, name))
            except OSError:
                pass
    return total


def _amount(nbytes: int) -> str:
    """Bytes for a message: MB (1e6) from 0.1 MB up, else the byte count (never "0.0 MB")."""
    return f"{nbytes / 1e6:.1f} MB" if nbytes >= 100_000 else f"{nbytes} bytes"


def check_free_space(dest: str, est_bytes: int, cfg: ShardConfig, cached: int = 0) -> None:
    """Refuse when DEST lacks ``est_bytes`` (+2% and 16 MB); ``cached``: bytes of gpufeed's transcode cache already
    in DEST/.gpufeed (the estimate counts it as space the shards get back as they are written)."""
    if est_bytes <= 0:
        return
    needed = int(est_bytes * 1.02) + (16 << 20)
    free = shutil.disk_usage(dest).free
    if free < needed:
        cache = (f"; {_amount(cached)} of DEST is gpufeed's own transcode cache of re-encoded images under "
                 f"{os.path.join(cfg.dest, STATE_DIR)}, which the shards replace as they are written" if cached else "")
        raise DataError(
            f"DEST {cfg.dest} has {_amount(free)} free but the shards need about {_amount(needed)} "
            f"({needed} bytes needed, {free} bytes free){cache}; free space or choose another DEST"
        )


def os_error(exc: OSError, cfg: ShardConfig, need: int | None, *, cache_deleted: int = 0, cache_kept: int = 0,
             shards_done: int = 0, writing: bool = False) -> GpufeedError:
    """An OS error while writing DEST (or reading SRC) as one sentence naming the path and the reason: a
    :class:`RunError` (exit 1) once the shards are being written (``writing``), else a :class:`DataError`.

    DEST full: ``need`` is the estimate of the bytes the job still had to write (None: not known, e.g. the index
    and manifest after the shards); ``cache_deleted``/``cache_kept`` are the bytes of gpufeed's own transcode cache
    under DEST/.gpufeed that took part of the space (deleted now / kept for the re-run); ``shards_done`` counts
    complete shards a re-run keeps."""
    import errno

    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        try:
            free = shutil.disk_usage(cfg.dest).free
        except OSError:
            free = 0
        if need is None:
            what = "the job could not finish"
            if shards_done:
                what += f" writing the index and manifest after its {shards_done} complete shard(s), which a re-run keeps"
            counts = f"{free} bytes free"
        else:
            what = f"the job needed about {_amount(need)} more"
            counts = f"{need} bytes needed, {free} bytes free"
        cache = ""
        if cache_deleted:
            cache = (f"; {_amount(cache_deleted)} of the space was gpufeed's own transcode cache of re-encoded "
                     f"images under {os.path.join(cfg.dest, STATE_DIR)}, now deleted (re-encoding needs room for "
                     f"that cache and the shards)")
        elif cache_kept:
            cache = (f"; {_amount(cache_kept)} of it is gpufeed's own transcode cache of re-encoded images under "
                     f"{os.path.join(cfg.dest, STATE_DIR)}, kept for the re-run (each file is deleted once its "
                     f"shards are written)")
        return (RunError if writing else DataError)(
            f"DEST {cfg.dest} is full ({exc.strerror}): {what}, {_amount(free)} are free now ({counts}){cache}; "
            f"free space or choose another DEST, then re-run"
        )
    where = exc.filename if exc.filename is not None else cfg.dest
    return (RunError if writing else DataError)(
        f"{os.fsdecode(where)}: {exc.strerror or exc} (while sharding into {cfg.dest})")
