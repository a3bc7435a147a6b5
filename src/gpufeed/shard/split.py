"""The static split (``gpufeed shard SRC DEST --num-nodes N [--node-rank R]``): N processes, one a node, each
launched by a scheduler (a SLURM job array, a Kubernetes indexed Job, torchrun), shard SRC into one DEST on
storage every node sees, with no engine between them (docs/design.md §1, ``shard/``).

Every node scans SRC and computes the same fingerprint (``shardplan.plan_fingerprint``). The first to arrive
records it with the node count in ``DEST/.gpufeed/split.json`` (created once: ``os.link`` of a complete temporary
file fails when the name exists); every other node compares its own with it and is refused, naming the
difference, when they differ. Validation is split too: batch ``j`` (the batches of a whole validation, in the
seeded order) is validated first by node ``j % N``, which saves its results to ``DEST/.gpufeed/val-<j>.bin``
(``BatchStore``); a node then takes every batch no other node has saved yet (results are deterministic, so a
batch validated twice saves the same record), so no node ever waits for another: an array whose tasks run one
after the other still completes. With every batch known, each node builds the same plan; ``plan.json`` is saved
by whoever comes first (the others read it). Shard ``i`` belongs to node ``i % N`` (``world.node_shards``), a
pure function of the plan; a node writes only its own, each renamed into place once complete, as the local
engine does. The node that finds every shard complete writes ``index.parquet``, the sidecar indexes and
``manifest.json`` (two nodes doing so at once write the same bytes, each file atomically), as does
``gpufeed shard DEST --finish``.

State shared through DEST: ``split.json``, ``plan.json``/``plan.bin``, ``val-*.bin``, the transcode cache
``enc-*.bin`` (each written atomically, the same bytes by any node) and each shard's ``.done.json``. Each node
holds its own lock (``lock-node-<R>``: the same rank started twice is refused); nothing else is locked, and no
node deletes a file another may be writing: the cache and batch results go once the set is finished.

Not supported with a split: ``--overwrite`` (one node would delete what the others are writing) and the one pass
(two nodes would write one shard's temporary file)."""

from __future__ import annotations

import json
import os
import re
from typing import Any, Mapping, NamedTuple

from gpufeed.config import ShardConfig
from gpufeed.core.errors import ConfigError, DataError

SPLIT_NAME = "split.json"
"""The split's record in DEST's state folder: node count, SRC, the options and the fingerprint of the first node."""
VAL_RE = re.compile(r"^val-\d{6,}\.bin$")
_MAX_SPLIT_JSON_BYTES = 1 << 20
_MAX_BATCH_FILE_BYTES = 64 << 20
"""A batch's results (at most 512 files, ~150 bytes each) are far below this."""
_MAX_BATCH_HEAD_BYTES = 4 << 20
"""A batch's JSON line: 512 reasons of at most ``MAX_REASON_CHARS`` characters (each up to 6 bytes escaped)."""

RANK_ENV = ("SLURM_ARRAY_TASK_ID", "JOB_COMPLETION_INDEX", "GROUP_RANK", "SLURM_NODEID")
"""Where a node's rank comes from without ``--node-rank``, in this order: a SLURM job array's task (less
``SLURM_ARRAY_TASK_MIN``), a Kubernetes indexed Job's index, torchrun's node rank, a SLURM job's node."""
COUNT_ENV = {"SLURM_ARRAY_TASK_ID": "SLURM_ARRAY_TASK_COUNT", "GROUP_RANK": "GROUP_WORLD_SIZE",
             "SLURM_NODEID": "SLURM_JOB_NUM_NODES"}
"""The launcher's own node count beside each rank variable: when set it must equal ``--num-nodes``."""


class NodeSplit(NamedTuple):
    """This node's part of a static split."""

    num_nodes: int
    node_rank: int

    def owns(self, shard_index: int) -> bool:
        """THE ownership rule (``world.node_shards``): shard ``i`` is node ``i % num_nodes``'s."""
        return shard_index % self.num_nodes == self.node_rank

    @property
    def lock_name(self) -> str:
        return f"lock-node-{self.node_rank:06d}"


def _env_number(env: Mapping[str, str], name: str) -> int:
    raw = env[name]
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise ConfigError(f"environment variable {name}={raw[:40]!r} is not a non-negative integer (set by the "
                          f"launcher)")
    return int(raw)


def node_split(cfg: ShardConfig, environ: Mapping[str, str] | None = None) -> NodeSplit | None:
    """This node's split (None: no split, ``num_nodes`` not set): the rank is ``node_rank``, else the first of
    :data:`RANK_ENV` that is set; a launcher's node count (:data:`COUNT_ENV`) that disagrees with ``num_nodes``
    is refused (ConfigError, exit 2), as is a rank without a node count."""
    env = os.environ if environ is None else environ
    if cfg.num_nodes is None:
        if cfg.node_rank is not None:
            raise ConfigError(f"--node-rank {cfg.node_rank} needs --num-nodes (the number of nodes of the split)")
        return None
    if cfg.overwrite:
        raise ConfigError("--overwrite cannot be used with --num-nodes (one node would delete the shards the others "
                          "write); empty DEST first, then start every node")
    rank, source = cfg.node_rank, "--node-rank"
    if rank is None:
        for name in RANK_ENV:
            if name in env:
                rank, source = _env_number(env, name), name
                if name == "SLURM_ARRAY_TASK_ID" and "SLURM_ARRAY_TASK_MIN" in env:
                    rank -= _env_number(env, "SLURM_ARRAY_TASK_MIN")
                count = COUNT_ENV.get(name)
                if count in env and _env_number(env, count) != cfg.num_nodes:
                    raise ConfigError(f"--num-nodes {cfg.num_nodes} disagrees with the launcher's {count}="
                                      f"{env[count]}; pass the launcher's node count")
                break
        else:
            raise ConfigError(f"--num-nodes {cfg.num_nodes} needs this node's rank: pass --node-rank, or run under "
                              f"a launcher that sets one of {', '.join(RANK_ENV)}")
    if not 0 <= rank < cfg.num_nodes:
        raise ConfigError(f"node rank {rank} (from {source}) is not in 0..{cfg.num_nodes - 1} (--num-nodes "
                          f"{cfg.num_nodes})")
    return NodeSplit(cfg.num_nodes, rank)


# --------------------------------------------------------------------------- split.json: one record, checked by all


def split_record(split: NodeSplit, src: str, fingerprint: str, options: dict[str, Any], num_files: int,
                 classes: list[str]) -> dict[str, Any]:
    from gpufeed import __version__

    return {"num_nodes": split.num_nodes, "src": src, "gpufeed_version": __version__, "options": options,
            "num_files": num_files, "num_classes": len(classes), "fingerprint": fingerprint}


def claim_split(state: str, record: dict[str, Any], dest_arg: str) -> None:
    """Record the split in ``state`` (the first node; created once, atomically) or check this node's ``record``
    against it: a DataError naming every difference when the node was started with other inputs or options."""
    import tempfile

    path = os.path.join(state, SPLIT_NAME)
    if not os.path.exists(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{SPLIT_NAME}.", suffix=".tmp", dir=state)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(json.dumps(record, sort_keys=True).encode("utf-8"))
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, path)  # fails when another node was first: its record is then checked below
            except FileExistsError:
                pass
        finally:
            os.unlink(tmp)
    theirs = read_split(state)
    if theirs is None:
        raise DataError(f"{path} is not a split record written by gpufeed shard; empty DEST {dest_arg} and start "
                        f"every node again")
    diff = split_difference(theirs, record)
    if diff:
        raise DataError(f"DEST {dest_arg} is being written by a split whose first node was started differently: "
                        f"{diff}; start every node with the same SRC, options and --num-nodes (or use another "
                        f"DEST)")


def read_split(state: str) -> dict[str, Any] | None:
    from gpufeed.core.safefs import read_set_file

    try:
        data = json.loads(read_set_file(os.path.join(state, SPLIT_NAME), state, _MAX_SPLIT_JSON_BYTES,
                                        what="split record", where="state folder"))
    except (OSError, ValueError, DataError):
        return None
    if not isinstance(data, dict) or not isinstance(data.get("options"), dict):
        return None
    return data


def split_difference(theirs: dict[str, Any], ours: dict[str, Any]) -> str:
    """What differs between the first node's split record and this node's, as a clause ("" when they agree)."""
    out = []
    if theirs.get("num_nodes") != ours["num_nodes"]:
        out.append(f"--num-nodes {ours['num_nodes']} here, {theirs.get('num_nodes')!r} there")
    if theirs.get("src") != ours["src"]:
        out.append(f"SRC {ours['src']} here, {theirs.get('src')!r} there")
    if theirs.get("gpufeed_version") != ours["gpufeed_version"]:
        out.append(f"gpufeed {ours['gpufeed_version']} here, {theirs.get('gpufeed_version')!r} there")
    t_opts, o_opts = theirs["options"], ours["options"]
    for k in sorted(set(t_opts) | set(o_opts)):
        if t_opts.get(k) != o_opts.get(k):
            out.append(f"option {k} = {o_opts.get(k)!r} here, {t_opts.get(k)!r} there")
    if not out and theirs.get("fingerprint") != ours["fingerprint"]:
        what = (f"{ours['num_files']} here, {theirs.get('num_files')!r} there"
                if theirs.get("num_files") != ours["num_files"] else "as many, but other paths, sizes or times")
        out.append(f"SRC's files differ (candidate files: {what})")
    return "; ".join(out)


def plan_difference(meta: dict[str, Any], options: dict[str, Any]) -> str:
    """Why a stored plan is not this node's: the options that differ, else SRC's files."""
    stored = meta.get("options") if isinstance(meta.get("options"), dict) else {}
    out = [f"option {k} = {options.get(k)!r} here, {stored.get(k)!r} in the stored plan"
           for k in sorted(set(stored) | set(options)) if stored.get(k) != options.get(k)]
    return "; ".join(out) or "SRC's files (paths, sizes or modification times) or the gpufeed version differ"


# --------------------------------------------------------------------------- validation batches shared through DEST


def val_name(j: int) -> str:
    return f"val-{j:06d}.bin"


MAX_REASON_CHARS = 500
"""A rejected file's reason as a batch records it: one printable line of at most this many characters (saved so by
:meth:`BatchStore.save`, required so by :meth:`BatchStore.load`)."""
_UNPRINTABLE = re.compile(r"[\x00-\x1f\x7f-\x9f\u2028\u2029]")


def reason_line(reason: str) -> str:
    """``reason`` as a batch records it: control characters (a line break, ESC) as spaces, cut to
    :data:`MAX_REASON_CHARS`."""
    text = _UNPRINTABLE.sub(" ", reason)
    return text if len(text) <= MAX_REASON_CHARS else text[:MAX_REASON_CHARS - 1] + "\u2026"


class BatchStore:
    """The validation batches of a split, shared through DEST's state folder: this node's first (``order``), each
    saved once validated (``save``) and read back when another node saved it (``load``). The file: one JSON line
    (counts, reasons, column sizes), then ``ok`` (a byte a file), the columns in ``validate.COLUMNS`` order and
    the digests; every size and every value is checked before use (the state folder is data too:
    :func:`batch_problem`), and a file that does not check out is validated again."""

    def __init__(self, state: str, split: NodeSplit, opts: Any = None) -> None:
        self.state = state
        self.split = split
        self.opts = opts
        """The job's ``validate.CheckOptions`` (the same on every node: ``split.json`` compares the options)."""

    def order(self, batches: list[tuple[int, int]]) -> list[tuple[int, int]]:
        """This node's batches (``j % N == rank``), then the others (validated here unless another node has)."""
        mine = [b for b in batches if b[0] % self.split.num_nodes == self.split.node_rank]
        return mine + [b for b in batches if b[0] % self.split.num_nodes != self.split.node_rank]

    def save(self, j: int, batch: dict[str, Any]) -> dict[str, Any]:
        """Save batch ``j``'s results (``validate.batch_columns``) -> the batch as every node uses it: each
        source's device number is 0 (each node's mount of a shared file system has its own; the writer then
        checks size, mtime and inode), each reason one bounded line (:func:`reason_line`)."""
        from array import array

        from gpufeed.core.records import atomic_write_bytes
        from gpufeed.shard.validate import COLUMNS

        batch = {**batch, "id_dev": array("Q", bytes(8 * batch["n"])),
                 "reasons": {i: reason_line(r) for i, r in batch["reasons"].items()}}
        cols = [bytes(batch[name]) if name == "sha256" else batch[name].tobytes() for name in COLUMNS]
        head = {"n_files": len(batch["ok"]), "n": batch["n"], "reasons": {str(i): r for i, r in
                                                                          batch["reasons"].items()},
                "columns": [[name, len(c)] for name, c in zip(COLUMNS, cols)]}
        atomic_write_bytes(os.path.join(self.state, val_name(j)),
                           b"".join([json.dumps(head).encode("utf-8"), b"\n", bytes(batch["ok"]), *cols]))
        return batch

    def load(self, j: int, n_files: int) -> dict[str, Any] | None:
        """Batch ``j``'s results when another node saved them and they check out (:func:`batch_problem`), else
        None (the batch is then validated here)."""
        from gpufeed.core.safefs import read_set_file

        try:
            data = read_set_file(os.path.join(self.state, val_name(j)), self.state, _MAX_BATCH_FILE_BYTES,
                                 what="validation batch", where="state folder")
        except (OSError, DataError):
            return None
        batch = parse_batch(data, n_files)
        if batch is None or batch_problem(batch, self.opts, lambda: self._cache_size(j)):
            return None
        return batch

    def _cache_size(self, j: int) -> int | None:
        """The size of batch ``j``'s transcode cache file (None: missing, a link out, not a regular file)."""
        from gpufeed.core.safefs import open_set_file
        from gpufeed.shard.validate import cache_name

        try:
            fd = open_set_file(os.path.join(self.state, cache_name(j)), self.state, what="transcode cache",
                               where="state folder")
        except (OSError, DataError):
            return None
        try:
            return os.fstat(fd).st_size
        finally:
            os.close(fd)


def parse_batch(data: bytes, n_files: int) -> dict[str, Any] | None:
    """A saved batch's fields (``ok``, ``n``, ``reasons`` by position, one buffer per column), every size checked,
    or None."""
    import numpy as np

    from gpufeed.shard.validate import COLUMNS

    line, _, rest = data.partition(b"\n")
    if len(line) > _MAX_BATCH_HEAD_BYTES:
        return None
    try:
        head = json.loads(line)
        n, reasons, spec = head["n"], head["reasons"], head["columns"]
        if (head["n_files"] != n_files or type(n) is not int or not isinstance(reasons, dict)
                or not isinstance(spec, list) or [c[0] for c in spec] != list(COLUMNS)):
            return None
        ok = rest[:n_files]
        pos = n_files
        out: dict[str, Any] = {"n": n, "ok": ok}
        for name, size in spec:
            dt, shape = COLUMNS[name]
            if type(size) is not int or size != n * np.dtype(dt).itemsize * int(np.prod(shape or (1,))):
                return None
            out[name] = rest[pos:pos + size]
            pos += size
        if not all(type(i) is str and i.isascii() and i.isdigit() and str(int(i)) == i for i in reasons):
            return None
        rejected = {int(i): r for i, r in reasons.items()}
        if (pos != len(rest) or len(ok) != n_files or set(ok) - {0, 1} or sum(ok) != n
                or set(rejected) != {i for i, b in enumerate(ok) if not b}):
            return None
        out["reasons"] = rejected
        return out
    except (ValueError, KeyError, TypeError, IndexError, RecursionError):
        return None


def batch_problem(batch: dict[str, Any], opts: Any, cache_size: Any) -> str:
    """Why the values of a parsed batch (:func:`parse_batch`) cannot be results ``validate`` gave ("" when they
    can): each code in range; a pass-through (``copy``) with no cache fields and a non-empty source; a transcoded
    file with its bytes in the batch's cache file, one after the other from offset 0 and filling it exactly
    (``cache_size()``: its size, None when it is missing), the stored size within the original; sizes positive,
    within ``opts.max_pixels`` (and ``max_size``); ``quality`` set: every file re-encoded; each reason one printable
    line of at most :data:`MAX_REASON_CHARS` characters. The checks are numpy's over whole columns."""
    import numpy as np

    from gpufeed.shard.validate import ACTIONS, COLUMNS, EXTS
    from gpufeed.shardset.tar import MAX_MEMBER_BYTES

    for reason in batch["reasons"].values():
        if type(reason) is not str or not reason or reason_line(reason) != reason:
            return "a reason that is not one printable line"
    n = batch["n"]
    col = {name: np.frombuffer(batch[name], dtype=dt).reshape(n, *shape) for name, (dt, shape) in COLUMNS.items()}
    if not n:
        return ""
    action, ext = col["action"].astype(np.int64), col["ext"].astype(np.int64)
    w, h = col["width"].astype(np.int64), col["height"].astype(np.int64)
    copy = action == ACTIONS.index("copy")
    enc = ~copy
    if (action >= len(ACTIONS)).any() or (ext >= len(EXTS)).any() or (copy & (ext == 0)).any():
        return "an action or format code out of range"
    max_pixels = getattr(opts, "max_pixels", None) or (1 << 31)
    if (w <= 0).any() or (h <= 0).any() or (w * h > max_pixels).any():
        return "an image size out of range"
    if (col["id_dev"] != 0).any():
        return "a device number (a batch records none)"
    e_cache, e_off, e_len = col["enc_cache"], col["enc_off"], col["enc_len"]
    e_ext, e_w, e_h = col["enc_ext"].astype(np.int64), col["enc_w"].astype(np.int64), col["enc_h"].astype(np.int64)
    if ((copy & ((e_cache != -1) | (e_off != 0) | (e_len != 0) | (e_ext != 0) | (e_w != 0) | (e_h != 0)
                 | (col["id_size"] <= 0))).any()):
        return "a pass-through file with transcode fields"
    jpg, png = EXTS.index("jpg"), EXTS.index("png")
    to_jpg = (action == ACTIONS.index("reencode")) | (action == ACTIONS.index("cmyk_to_rgb_jpeg"))
    if ((enc & ((e_cache != 0) | (e_len <= 0) | (e_len > MAX_MEMBER_BYTES) | (col["id_size"] != 0) | (e_w <= 0) | (e_h <= 0) | (e_w > w)
                | (e_h > h))).any() or (to_jpg & (e_ext != jpg)).any() or ((enc & ~to_jpg) & (e_ext != png)).any()):
        return "a transcoded file's fields out of range"
    max_size = getattr(opts, "max_size", None)
    if max_size and ((copy & (np.maximum(w, h) > max_size)).any() or (enc & (np.maximum(e_w, e_h) > max_size)).any()):
        return "an image larger than max_size"
    if getattr(opts, "quality", None) is not None and (action != ACTIONS.index("reencode")).any():
        return "a file not re-encoded although quality is set"
    if enc.any():
        lengths = e_len[enc]
        if (e_off[enc] != np.concatenate(([0], np.cumsum(lengths)[:-1]))).any():
            return "transcoded bytes not one after the other in the cache"
        if cache_size() != int(lengths.sum()):
            return "a transcode cache that does not hold the batch's bytes"
    return ""


def clear_split_state(state: str) -> None:
    """Delete the validation batches once the set is finished (the split record and the plan stay: a late
    node started again finds the set complete)."""
    for name in os.listdir(state):
        if VAL_RE.match(name):
            try:
                os.unlink(os.path.join(state, name))
            except FileNotFoundError:
                pass


def finish_lock(state: str) -> int:
    """The finish lock (``lock-finish`` in the state folder), waited for: one node at a time writes the index, the
    sidecar indexes and the manifest -> its descriptor (``release_lock`` releases it)."""
    import fcntl

    from gpufeed.core.dest import hold_lock
    from gpufeed.core.safefs import lock_file

    fd = lock_file(os.path.join(state, "lock-finish"), what="shard lock")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return hold_lock(fd)


def leftovers(dest: str, names: list[str], finishing: bool) -> list[str]:
    """The temporary files a killed node left in DEST: its shards' (``.<shard>.tmp``) and their DALI indexes'
    atomic writes; with ``finishing`` (the finish lock held, every shard complete: no node writes there any more),
    every atomic write's (the index, the manifest, the DALI indexes)."""
    from gpufeed.shard.dest import atomic_leftover
    from gpufeed.shardset.sidecars import idx_name

    mine = tuple(f".{idx_name(n)}." for n in names)
    return [f for f in os.listdir(dest) if f.endswith(".tmp") and (
        f.startswith(mine) or f[1:-4] in names or (finishing and atomic_leftover(f)))]

