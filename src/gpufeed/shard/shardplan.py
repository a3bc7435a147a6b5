"""Phase 3, plan: the fingerprint of the scan and options, the shard plan built from the validation results
(``make_plan``: seeded order, N equal shards) and its storage in ``DEST/.gpufeed`` (``plan.json`` + ``plan.bin``,
``PLAN_VERSION``), read back and checked in full on resume (``read_plan``: the state folder is data too).

(``gpufeed/plan.py`` is another thing: ``gpufeed plan``, the memory planner.) The plan's columns and what resume
does with them: the package docstring, "Resume"."""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import os
import re
from typing import Any, NamedTuple

from gpufeed.config import ShardConfig
from gpufeed.core.errors import DataError
from gpufeed.shard.report import FileIssue
from gpufeed.shard.scan import Scan, Strings, display
from gpufeed.shard.validate import ACTIONS, CACHE_RE, COLUMNS, EXTS, Results, cache_name

PLAN_NAME = "plan.json"
PLAN_VERSION = 3  # 2: validation and shards follow one seeded order; per-shard transcode caches; 3: columnar
PLAN_ARRAYS_NAME = "plan.bin"
SHARD_RE = re.compile(r"^[A-Za-z0-9_-]+-\d{6}\.tar$")
TAR_OVERHEAD_PER_SAMPLE = 3 * 1024 + 300  # 3 headers + padding + json member, roughly

_PLAN_COLUMNS = {**COLUMNS, "label": ("<i4", ()), "bytes": ("<i8", ()), "order": ("<i8", ()),
                 "path_offsets": ("<i8", ()), "path_blob": ("u1", ())}


def plan_options(cfg: ShardConfig) -> dict[str, Any]:
    options = {"seed": cfg.seed, "shard_samples": cfg.shard_samples, "shard_bytes": cfg.shard_bytes,
               "multiple_of": cfg.multiple_of, "prefix": cfg.prefix, "max_size": cfg.max_size,
               "quality": cfg.quality, "check": cfg.check, "max_pixels": cfg.max_pixels,
               "allow_empty_classes": cfg.allow_empty_classes}
    if cfg.classes_like != "gpufeed":  # recorded only when set: a default set's manifest and plan stay as before
        options["classes_like"] = cfg.classes_like
    return options


def plan_fingerprint(scan: Scan, options: dict[str, Any]) -> str:
    from gpufeed import __version__

    h = hashlib.sha256()
    h.update(json.dumps({"plan_version": PLAN_VERSION, "gpufeed": __version__, "options": options,
                         "classes": scan.classes}, sort_keys=True).encode())
    for column in (scan.paths.offsets, scan.labels, scan.sizes, scan.mtimes):
        h.update(column.tobytes())
    h.update(scan.paths.blob)
    for issue in scan.rejected:
        h.update(f"r\0{issue.path}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()


def plan_num_shards(num_samples: int, num_bytes: int, cfg: ShardConfig) -> int:
    """max(ceil(n / shard_samples), ceil(bytes / shard_bytes)), at least 1, rounded up to multiple_of."""
    n = max(1, math.ceil(num_samples / cfg.shard_samples), math.ceil(num_bytes / cfg.shard_bytes))
    return math.ceil(n / cfg.multiple_of) * cfg.multiple_of


def split_sizes(num_samples: int, num_shards: int) -> list[int]:
    """Shard sizes that differ by at most one, larger ones first."""
    q, r = divmod(num_samples, num_shards)
    return [q + 1 if i < r else q for i in range(num_shards)]


def shard_names(prefix: str, n: int) -> list[str]:
    return [f"{prefix}-{i:06d}.tar" for i in range(n)]


class PlannedShard(NamedTuple):
    """One shard of the plan (``plan.json`` stores each as a JSON object of these fields, in this order)."""

    name: str
    start: int
    """Its first sample's position in the plan's ``order``."""
    count: int
    est_bytes: int
    """Estimated shard bytes (stored images plus tar overhead): the free-space check."""
    caches: tuple[str, ...]
    """The transcode cache files (``enc-*.bin``) its samples are read from."""
    cache_bytes: int
    """Bytes of its samples in those cache files."""


class ShardPart(NamedTuple):
    """What a write task needs of one shard's samples, as columns (``Plan.part``): plain lists, cheap to send to a
    worker process, which builds the records (``write.samples_of``)."""

    n: list[int]
    label: list[int]
    ext: list[int]
    width: list[int]
    height: list[int]
    orig_width: list[int]
    orig_height: list[int]
    orientation: list[int]
    img_len: list[int]
    cache: list[int]
    coff: list[int]
    ident: list[tuple[int, int, int, int]]
    sha256: bytes
    """The samples' digests, 32 bytes each."""
    paths: list[str]
    classes: list[str]


_STEPWISE = True
"""Whether ``Shuffle`` replays ``random.shuffle``'s draws step by step (``Random._randbelow``, as CPython's and
PyPy's ``shuffle`` make them); tests turn it off to check the whole-shuffle fallback."""


class Shuffle:
    """The seeded order of the candidates, exactly ``random.Random(seed).shuffle(list(range(n)))``, computed in
    steps: that shuffle (Fisher-Yates) fixes the last position first, so once positions ``[start, n)`` are
    final (``advance``) the shards there can be written while the rest is shuffled (the one pass starts the last
    shards first). ``order`` finishes it."""

    def __init__(self, n: int, seed: int) -> None:
        import random
        from array import array

        self.n = n
        self.x = array("q", range(n))  # 8 bytes a sample (a list holds ~36), and no slower to shuffle
        self._order: Any = None
        self._rng = random.Random(seed)
        self._next = n - 1  # the next position the loop fixes; every one above it is final
        if not (_STEPWISE and hasattr(self._rng, "_randbelow")):  # a Random unlike CPython's: all at once, its way
            self._rng.shuffle(self.x)
            self._next = 0

    def advance(self, start: int) -> None:
        """Shuffle until positions ``[start, n)`` are final (the steps of ``random.shuffle``, same draws)."""
        x, randbelow = self.x, self._rng._randbelow
        stop = max(start, 1)  # random.shuffle's loop ends at position 1; position 0 is then final too
        for i in range(self._next, stop - 1, -1):
            j = randbelow(i + 1)
            x[i], x[j] = x[j], x[i]
        self._next = min(self._next, stop - 1)

    def take(self, start: int, count: int) -> Any:
        """Positions ``[start, start + count)`` (made final first) as an int64 array."""
        import numpy as np

        if self._order is not None:
            return self._order[start:start + count]
        self.advance(start)
        if start == 0:  # all final
            self._order = np.frombuffer(self.x, dtype=np.int64)
            return self._order[:count]
        return np.frombuffer(self.x[start:start + count], dtype=np.int64)

    def order(self) -> Any:
        """The whole order as an int64 array."""
        return self.take(0, self.n)


class Plan:
    """The plan, columnar: ``meta`` (JSON: fingerprint, options, classes, rejected files, shards as slices of
    ``order``) and per-sample numpy columns (``_PLAN_COLUMNS``) for the accepted samples in key order, i.e.
    sorted by (label, path); ``order`` is their seeded shard order. ~150 bytes a sample plus its path."""

    def __init__(self, meta: dict[str, Any], cols: dict[str, Any], paths: Strings) -> None:
        import numpy as np

        self.meta = meta
        self.cols = cols
        self.paths = paths
        self.classes: list[str] = meta["classes"]
        self.shards = [PlannedShard(s["name"], s["start"], s["count"], s["est_bytes"], tuple(s["caches"]),
                                    s["cache_bytes"]) for s in meta["shards"]]
        self.rejected = [FileIssue(i["path"], i["reason"]) for i in meta["rejected"]]
        counts = np.asarray(meta["class_counts"], dtype=np.int64)
        self.class_start = np.concatenate(([0], np.cumsum(counts)[:-1])).astype(np.int64)

    def stored(self, idx: Any) -> tuple[Any, Any, Any]:
        """(bytes, width, height) of the stored image members of the samples at ``idx`` (after any transcoding)."""
        import numpy as np

        c = self.cols
        encoded = c["enc_cache"][idx] >= 0
        return (np.where(encoded, c["enc_len"][idx], c["bytes"][idx]),
                np.where(encoded, c["enc_w"][idx], c["width"][idx]),
                np.where(encoded, c["enc_h"][idx], c["height"][idx]))

    def release_write_columns(self) -> None:
        """Drop the columns only the writer needs (digests, source identities, cache offsets, ...) before the
        index is built, so their memory is not held at the same time. A resumed plan's columns share one
        buffer, which stays."""
        for name in ("sha256", "id_size", "id_mtime", "id_ino", "id_dev", "enc_off", "enc_ext", "action", "ext",
                     "orientation"):
            self.cols.pop(name, None)

    def __len__(self) -> int:
        return len(self.cols["label"])

    def indices(self, shard: PlannedShard) -> Any:
        return self.cols["order"][shard.start:shard.start + shard.count]

    def key(self, i: int) -> str:
        label = int(self.cols["label"][i])
        return f"{label:05d}_{i - int(self.class_start[label]):07d}"

    def part(self, idx: Any) -> ShardPart:
        """What the writer needs of the samples at plan positions ``idx`` (one shard), as columns: small to send
        to a worker process, which builds the records (``_samples_of``)."""
        import numpy as np

        c = self.cols
        labels = c["label"][idx]
        caches = c["enc_cache"][idx]
        stored_len, stored_w, stored_h = self.stored(idx)
        return ShardPart(
            n=(idx - self.class_start[labels]).tolist(), label=labels.tolist(),
            ext=np.where(caches >= 0, c["enc_ext"][idx], c["ext"][idx]).tolist(),
            width=stored_w.tolist(), height=stored_h.tolist(), orig_width=c["width"][idx].tolist(),
            orig_height=c["height"][idx].tolist(), orientation=c["orientation"][idx].tolist(),
            img_len=stored_len.tolist(), cache=caches.tolist(), coff=c["enc_off"][idx].tolist(),
            ident=list(zip(c["id_size"][idx].tolist(), c["id_mtime"][idx].tolist(), c["id_ino"][idx].tolist(),
                           c["id_dev"][idx].tolist())),
            sha256=c["sha256"][idx].tobytes(), paths=[self.paths[i] for i in idx.tolist()], classes=self.classes)


def make_plan(cfg: ShardConfig, scan: Scan, results: Results, fingerprint: str,
              options: dict[str, Any], shuffled: Any) -> Plan:
    """The plan: accepted samples (keys in sorted order), split into shards following ``shuffled`` (the seeded
    permutation of the candidates; the accepted ones in that order are a seeded shuffle of the accepted list)."""
    import numpy as np

    ok = results.ok
    n = int(ok.sum())
    rejected = list(scan.rejected) + [FileIssue(display(scan.paths[k]), r) for k, r in results.reasons.items()]
    rejected.sort(key=lambda i: i.path)
    if not n:
        raise DataError(f"SRC {cfg.src} holds no valid image ({len(rejected)} rejected)")
    everything = n == len(ok)
    acc = None if everything else np.nonzero(ok)[0]  # (when all are accepted, no index column is needed)
    cols = {}
    for k in list(results.cols):  # column by column, each dropped from the results once copied: one copy at a time
        v = results.cols.pop(k)
        cols[k] = v if everything else v[acc]
        del v
    cols["label"], cols["bytes"] = (scan.labels, scan.sizes) if everything else (scan.labels[acc], scan.sizes[acc])
    paths = scan.paths if everything else scan.paths.take(acc)
    counts = np.bincount(cols["label"], minlength=len(scan.classes)).tolist()
    shuffled = np.asarray(shuffled, dtype=np.int64)
    if everything:
        order = shuffled
    else:
        rank = np.cumsum(ok) - 1  # candidate -> position among the accepted
        order = rank[shuffled[ok[shuffled]]].astype(np.int64)
        del rank
    encoded = cols["enc_cache"] >= 0
    est = np.where(encoded, cols["enc_len"], cols["bytes"])
    est += TAR_OVERHEAD_PER_SAMPLE
    n_shards = plan_num_shards(n, int(est.sum()), cfg)
    if n_shards > n:
        raise DataError(
            f"{n_shards} shards (a multiple of --multiple-of {cfg.multiple_of}) need at least {n_shards} images, "
            f"but only {n} were accepted; lower --multiple-of"
        )
    shards = []
    pos = 0
    for name, k in zip(shard_names(cfg.prefix, n_shards), split_sizes(n, n_shards)):
        idx = order[pos:pos + k]
        enc_idx = idx[encoded[idx]]
        shards.append({"name": name, "start": pos, "count": k, "est_bytes": int(est[idx].sum()),
                       "caches": [cache_name(j) for j in np.unique(cols["enc_cache"][enc_idx]).tolist()],
                       "cache_bytes": int(cols["enc_len"][enc_idx].sum())})
        pos += k
    cols["order"] = order
    meta = {"plan_version": PLAN_VERSION, "fingerprint": fingerprint, "options": options,
            "classes": scan.classes, "class_counts": counts,
            "empty_classes": [c for c, m in zip(scan.classes, counts) if m == 0],
            "num_samples": n, "shards": shards, "rejected": [i.__dict__ for i in rejected]}
    return Plan(meta, cols, paths)


def plan_problem(plan: Plan, scan: Scan, seed: int) -> str | None:
    """Why a stored plan does not follow from this scan of SRC, or None. ``plan.json``/``plan.bin`` sit in DEST,
    which someone else may write, and their fingerprint is a field of the same file: so the plan's samples must be
    SRC's candidate files, in SRC's order, with their labels and sizes, and its order the seeded shuffle of them
    (docs/threat-model.md, "Resuming in a DEST someone else can write")."""
    import numpy as np

    n, total = len(plan.cols["label"]), len(scan)
    if n > total:
        return f"it holds {n} samples, SRC {total} candidate files"
    if plan.classes != scan.classes:
        return "its class names are not SRC's"
    pos = np.empty(n, dtype=np.int64)
    j = 0
    for i, path in enumerate(plan.paths):  # both in SRC's (label, path) order: one walk
        while j < total and scan.paths[j] != path:
            j += 1
        if j == total:
            return f"its sample {i} is not a candidate file of SRC in SRC's order"
        pos[i] = j
        j += 1
    if not np.array_equal(plan.cols["label"], scan.labels[pos]) or not np.array_equal(plan.cols["bytes"],
                                                                                       scan.sizes[pos]):
        return "its labels or file sizes are not SRC's"
    kept = plan.cols["enc_cache"] < 0  # stored as they are: the source identity the writer checks is this file's
    if not np.array_equal(plan.cols["id_size"][kept], scan.sizes[pos][kept]):
        return "the identity it records of a file is not SRC's"
    ok = np.zeros(total, dtype=bool)
    ok[pos] = True
    rejected = {issue.path for issue in plan.rejected}
    if any(display(scan.paths[k]) not in rejected for k in np.flatnonzero(~ok).tolist()):
        return "a file of SRC is neither among its samples nor among its rejected files"  # never a silent loss
    shuffled = Shuffle(total, seed).order()
    rank = np.cumsum(ok) - 1
    if not np.array_equal(plan.cols["order"], rank[shuffled[ok[shuffled]]]):
        return "its sample order is not the seeded shuffle of SRC's files"
    return None


# --------------------------------------------------------------------------- stored plan


def save_plan(state: str, plan: Plan) -> None:
    """``plan.bin`` (the columns, raw little-endian arrays one after the other) then, atomically and last,
    ``plan.json`` (the metadata, each column's dtype, shape and offset, and plan.bin's sha256)."""
    import numpy as np

    from gpufeed.core.records import atomic_write_bytes, atomic_writer

    arrays = {**plan.cols, "path_offsets": plan.paths.offsets,
              "path_blob": np.frombuffer(plan.paths.blob, dtype=np.uint8)}
    spec = []
    h = hashlib.sha256()
    offset = 0
    with atomic_writer(os.path.join(state, PLAN_ARRAYS_NAME)) as f:
        for name in sorted(_PLAN_COLUMNS):
            a = np.ascontiguousarray(arrays[name], dtype=_PLAN_COLUMNS[name][0])
            spec.append([name, list(a.shape), offset])
            f.write(memoryview(a).cast("B"))
            h.update(memoryview(a).cast("B"))
            offset += a.nbytes
    meta = {**plan.meta, "arrays": {"sha256": h.hexdigest(), "bytes": offset, "columns": spec}}
    atomic_write_bytes(os.path.join(state, PLAN_NAME), json.dumps(meta).encode("utf-8"))


def _paths_inside(blob: bytes, offsets: Any) -> bool:
    """Whether every stored path (relative to SRC) stays inside SRC: not empty, not absolute, no ``..``
    component. A tampered plan could otherwise copy any readable file into a shard."""
    ends = offsets.tolist()
    for a, b in zip(ends, ends[1:]):
        raw = blob[a:b]
        if not raw or raw[:1] == b"/" or (b".." in raw and b".." in raw.split(b"/")):
            return False
    return True


_MAX_PLAN_JSON_BYTES = 1 << 32
"""``plan.json`` larger than this (4 GiB: its classes and rejected files; the columns are in plan.bin) is not read."""


def read_plan(state: str) -> Plan | None:
    """The stored plan, or None when it is missing, of another version, or inconsistent in any way (every size,
    offset and index is checked before use: the state folder is data too)."""
    import numpy as np

    from gpufeed.core.safefs import open_set_file, read_set_file

    try:  # never through a link out of the state folder, and bounded (safefs)
        meta = json.loads(read_set_file(os.path.join(state, PLAN_NAME), state, _MAX_PLAN_JSON_BYTES, what="plan",
                                        where="state folder"))
        if not isinstance(meta, dict) or meta.get("plan_version") != PLAN_VERSION:
            return None
        spec = meta["arrays"]
        with os.fdopen(open_set_file(os.path.join(state, PLAN_ARRAYS_NAME), state, what="plan", where="state folder"), "rb") as f:
            # the size comes from plan.json: read only when it is the file's own size (no huge allocation)
            if type(spec["bytes"]) is not int or spec["bytes"] != os.fstat(f.fileno()).st_size:
                return None
            data = f.read(spec["bytes"] + 1)
        if len(data) != spec["bytes"] or hashlib.sha256(data).hexdigest() != spec["sha256"]:
            return None
        n = int(meta["num_samples"])
        arrays: dict[str, Any] = {}
        for name, shape, offset in spec["columns"]:
            dt, tail = _PLAN_COLUMNS[name]
            if tuple(shape[1:]) != tail or len(shape) != 1 + len(tail) or name in arrays:
                return None
            count = math.prod(shape)
            if not 0 <= offset <= len(data) - count * np.dtype(dt).itemsize:
                return None
            arrays[name] = np.frombuffer(data, dtype=dt, count=count, offset=offset).reshape(shape)
        if set(arrays) != set(_PLAN_COLUMNS):
            return None
        offsets, blob = arrays.pop("path_offsets"), arrays.pop("path_blob")
        classes, shards = meta["classes"], meta["shards"]
        if (any(len(a) != n for a in arrays.values()) or len(offsets) != n + 1 or offsets[0] != 0
                or offsets[-1] != len(blob) or (n and np.diff(offsets).min() < 0)
                or len(meta["class_counts"]) != len(classes) or sum(meta["class_counts"]) != n
                or not n or not 0 <= arrays["label"].min() <= arrays["label"].max() < len(classes)
                or np.bincount(arrays["label"], minlength=len(classes)).tolist() != meta["class_counts"]
                or not 0 <= arrays["order"].min() <= arrays["order"].max() < n
                or not all(type(s["count"]) is int and s["count"] > 0 and SHARD_RE.match(s["name"])
                           and all(type(s[k]) is int and s[k] >= 0 for k in ("start", "est_bytes", "cache_bytes"))
                           and all(CACHE_RE.match(c) for c in s["caches"]) for s in shards)
                or [s["start"] for s in shards] != [0, *itertools.accumulate(s["count"] for s in shards)][:-1]
                or sum(s["count"] for s in shards) != n
                or arrays["ext"].max() >= len(EXTS) or arrays["enc_ext"].max() >= len(EXTS)
                or arrays["action"].max() >= len(ACTIONS)
                or arrays["enc_off"].min() < 0 or arrays["enc_len"].min() < 0
                or not _paths_inside(blob.tobytes(), offsets)
                or not _plan_fields_sound(meta, arrays, n)):
            return None
        return Plan(meta, arrays, Strings(blob.tobytes(), offsets))
    except (OSError, ValueError, KeyError, TypeError, IndexError, DataError):
        return None


def _plan_fields_sound(meta: dict[str, Any], arrays: dict[str, Any], n: int) -> bool:
    """The rest of a stored plan's consistency: ``order`` a permutation (a repeated index would write one
    sample twice and lose another), unique class names and shard names, plain int counts, bounded sizes, and
    every transcode cache a sample points at listed by a shard."""
    import numpy as np

    classes, shards, order = meta["classes"], meta["shards"], arrays["order"]
    caches = arrays["enc_cache"]
    named = {f"enc-{c:06d}.bin" for c in np.unique(caches[caches >= 0]).tolist()}
    return (type(meta["num_samples"]) is int and len(order) == n and np.bincount(order, minlength=n).max() == 1
            and all(type(c) is str and c and c.isprintable() for c in classes) and len(set(classes)) == len(classes)
            and all(type(c) is int for c in meta["class_counts"])
            and len({sh["name"] for sh in shards}) == len(shards)
            and all(sh[k] <= _MAX_PLAN_BYTES for sh in shards for k in ("est_bytes", "cache_bytes"))
            and all(type(i) is dict and type(i.get("path")) is str and type(i.get("reason")) is str
                    for i in meta["rejected"])
            and int(caches.min()) >= -1 and named <= {c for sh in shards for c in sh["caches"]}
            and int((arrays["enc_off"] + arrays["enc_len"]).max()) <= _MAX_PLAN_BYTES)


_MAX_PLAN_BYTES = 2**44
"""Largest size or offset a stored plan may name (16 TiB, the manifest's shard bound)."""
