"""``gpufeed verify DEST``: re-read every shard of a set against its manifest.

Per shard (in parallel over processes, one streaming pass per file): the file exists, its size and sha256
match the manifest (sha256 is skipped when the manifest has none, e.g. ``gpufeed index --no-hash``), the tar
reads to the end and ends with its end-of-archive blocks (gzip shards of foreign sets included), its sample
count matches, every member name is ``KEY.ext``, keys are unique across the whole set and each key's members
are consecutive (grouped), no sample holds a member twice, each sample has exactly one image member and a
label, where the manifest's label source says (``.cls``, ``.txt`` or a field of ``.json``), that
:func:`gpufeed.shardset.manifest.read_label` accepts (the loader's rule), every image is at most
``max_pixels`` (width x height, read from its header before any pixel is decoded) and (``decode``, default on)
decodes to 3-channel RGB with Pillow. For sets written by ``gpufeed shard``, each sample must have a ``KEY.json``
that parses, names the class of the label, and carries the sha256 of the image member, which pins a flipped bit
to its member, and ``index.parquet`` must exist and list exactly the (key, shard) pairs found. Foreign sets
(``gpufeed index``) are read as webdataset and the loader read them: KEY is the name up to the first dot (so
``x.seg.png`` is a member of sample ``x``, not a key with a dot) and keys without an image member are not
samples. The shards are looked up in the manifest's ``root`` when it has one. Every failure is a problem naming
shard, member and reason; ``ok`` is True when there is none. Shard-like files in the set's folder that the
manifest does not list are a warning (the loader never reads them), not a failure. A set staged for one node
(``gpufeed stage --num-nodes N --node-rank n``; its manifest's ``options["staged_node"]``) is checked for the
shards staged there only (:func:`gpufeed.core.world.node_shards`): the other nodes' shards are absent by design, and
index.parquet's rows and the sample count are compared for those shards only.

Shards are read with :class:`gpufeed.shardset.tar.TarPass` and grouped with
:class:`gpufeed.shardset.keys.SampleGrouper`, as ``gpufeed index`` reads them.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import tarfile
import time
import zlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from gpufeed.config import LoaderConfig
from gpufeed.core.errors import RunError, one_line
from gpufeed.shardset.manifest import (DEFAULT_LABEL_SOURCE, INDEX_NAME, SHARD_SUFFIXES, LabelError, MissingLabel, label_member,
                              manifest_path, read_label, shard_root)
from gpufeed.shardset.keys import (LABEL_EXTENSION, META_EXTENSION, READ_IMAGE_EXTENSIONS, SampleGrouper, dotted_image,
                                   split_member)
from gpufeed.core.redact import redact
from gpufeed.shardset.source import (MAX_TIMED_OUT_READS_IN_A_ROW, ReadTimedOut, SourceError, is_pipe, is_remote,
                                     open_set, open_shard, remote_size)
from gpufeed.shardset.images import open_image
from gpufeed.shardset.tar import MAX_MEMBER_BYTES, TarFormatError, TarPass, TruncatedMember, file_problem
from gpufeed.shardset.manifest import staged_node
from gpufeed.core.world import node_shards

_KNOWN = set(READ_IMAGE_EXTENSIONS) | {LABEL_EXTENSION, META_EXTENSION, "txt", "cls2", "pth", "npy", "id"}

DEFAULT_MAX_PIXELS = LoaderConfig.max_pixels
"""Decompression-bomb limit (width x height) verify applies by default: the same as ``shard`` and the loader."""
MAX_SHARD_PROBLEMS = 200
"""Problems recorded per shard; more are counted in ``num_problems`` but not listed."""
MAX_REPORTED_PROBLEMS = 10_000
"""Problems listed in a verify record (the JSON stays bounded); ``num_problems`` counts them all."""
MAX_LISTED = 5
"""Examples listed per grouped problem line, extra-file warning or index problem kind."""


@dataclass(frozen=True)
class VerifyProblem:
    shard: str
    """Shard file name ('' for set-wide problems)."""
    member: str | None
    """Tar member (or sample key) concerned; None when the whole shard is."""
    reason: str


@dataclass(frozen=True)
class VerifyReport:
    path: str
    num_shards: int
    num_samples: int
    """Samples found in the shards."""
    num_expected: int
    """Samples the manifest promises."""
    num_decoded: int
    """Images decoded (0 with decode off)."""
    total_bytes: int
    elapsed_s: float
    decode: bool
    created_by: str
    problems: list[VerifyProblem]
    """The problems, at most MAX_SHARD_PROBLEMS per shard and MAX_REPORTED_PROBLEMS in all."""
    num_problems: int = 0
    """All problems found (``problems`` lists the first ones)."""
    max_pixels: int = DEFAULT_MAX_PIXELS
    warnings: list[str] = field(default_factory=list)
    """Findings that do not fail the set (shard-like files the manifest does not list)."""
    node: str | None = None
    """For a set staged per node: "node n of N: k of M shards staged here" (only those k are verified)."""
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", not self.problems and not self.num_problems)


def _check_image(member: str, data: bytes, decode: bool, max_pixels: int, bad: Callable[[str, str], None]) -> bool:
    """The image's size from its header against ``max_pixels`` first, then (``decode``) a full decode to RGB.
    True when it was decoded."""
    from PIL import Image

    prev = Image.MAX_IMAGE_PIXELS
    # Pillow's own bomb check (a warning up to 2x its limit) is replaced by the max_pixels check below, made on
    # the header before any pixel is decoded.
    Image.MAX_IMAGE_PIXELS = None
    try:
        im = open_image(data)
        w, h = im.size
        if w * h > max_pixels:
            bad(member, f"decompression bomb: {w}x{h} = {w * h} pixels > max_pixels {max_pixels}")
            return False
        if not decode:
            return False
        im.load()
        rgb = im.convert("RGB")
        if rgb.mode != "RGB" or len(rgb.getbands()) != 3:
            bad(member, f"does not convert to 3-channel RGB (mode {im.mode})")
        return True
    except Exception as exc:  # noqa: BLE001 - any decoder failure is a problem record
        bad(member, f"image does not decode ({type(exc).__name__}: {exc})")
        return False
    finally:
        Image.MAX_IMAGE_PIXELS = prev


def _shard_size(path: str, name: str, remote: bool) -> tuple[int | None, dict[str, Any] | None]:
    """The shard file's size in bytes before it is read (None for a ``pipe:`` command: its output's size is known
    only once it is read), or, second, the whole result of a shard that cannot be read at all: a local file that
    is missing, not a regular file or a link out of the set's folder, or a URL whose server gives no size."""
    try:
        if remote:  # a URL's size from the server; a pipe: command's is known only once it is read
            return (None if is_pipe(path) else remote_size(path)), None
        why = file_problem(path, os.path.dirname(path))  # a set's shards: no link out of its folder
        if why:
            return None, {"name": name, "problems": [(None, f"shard file {why}")], "num_problems": 1, "keys": [],
                          "found": 0, "decoded": 0}
        return os.path.getsize(path), None
    except SourceError as exc:
        return None, {"name": name, "problems": [(None, redact(one_line(exc)))], "num_problems": 1, "keys": [],
                      "found": 0, "decoded": 0, "timed_out": isinstance(exc, ReadTimedOut)}


def _sample_label(key: str, parts: dict[str, bytes | None], label_source: str, classes: list[str],
                  class_index: dict[str, int], bad: Callable[[str | None, str], None]) -> int | None:
    """The sample's label as the loader reads it (:func:`read_label`), or None after reporting why it has none.
    None without a further problem for a label member over MAX_MEMBER_BYTES (not read: ``want`` reported it)."""
    member = label_member(label_source)
    if parts.get(member, b"") is None:
        return None
    try:
        return read_label(parts, label_source, classes, class_index)
    except MissingLabel as exc:
        bad(key, f"sample has {exc}")
    except LabelError as exc:
        bad(f"{key}.{member}", str(exc))
    return None


def _check_meta(key: str, raw: bytes, label: int | None, classes: list[str], image: bytes | None,
                image_member: str | None, bad: Callable[[str | None, str], None]) -> None:
    """A gpufeed sample's ``KEY.json``: a JSON object naming the class of the sample's label and carrying the
    sha256 of its image member (which pins a flipped bit to that member)."""
    try:
        meta = json.loads(raw)
        if not isinstance(meta, dict):
            raise ValueError("not a JSON object")
    except ValueError as exc:
        bad(f"{key}.json", f"not valid JSON ({exc})")
        return
    if label is not None and meta.get("class") != classes[label]:
        bad(f"{key}.json", f"class {str(meta.get('class'))[:80]!r} does not match label {label} "
                           f"({classes[label]!r})")
    digest = meta.get("sha256")
    if digest and image is not None and hashlib.sha256(image).hexdigest() != digest:
        bad(image_member, "image bytes do not match the sha256 recorded in its .json")


def _check_imageless_key(key: str, parts: dict[str, bytes | None], bad: Callable[[str | None, str], None]) -> None:
    """A foreign set's key without an image member. The loader and `gpufeed index` skip it: not a sample. But an
    image behind a dot in its key (`k.3.jpg` -> key `k`, extension `3.jpg`) is an image the loader never reads."""
    member = dotted_image(key, parts)
    if member:
        bad(member, f"key holds a dot: readers take {key!r} as the key and "
                    f"{member[len(key) + 1:]!r} as the extension, so no reader sees this image")


def _check_sample(key: str, parts: dict[str, bytes | None], images: list[str], ours: bool, classes: list[str],
                  class_index: dict[str, int], label_source: str, decode: bool, max_pixels: int,
                  bad: Callable[[str | None, str], None]) -> bool:
    """Check one sample (a key with an image member, or any key of a gpufeed set): one image, a label the loader
    accepts, an image within ``max_pixels`` that decodes (``decode``) and, for a gpufeed set, its ``.json``.
    True when its image was decoded."""
    if len(images) != 1:
        bad(key, f"sample has {len(images)} image members ({', '.join(sorted(parts))}); expected exactly one")
    label = _sample_label(key, parts, label_source, classes, class_index, bad)
    image = parts[images[0]] if images else None
    decoded = image is not None and _check_image(f"{key}.{images[0]}", image, decode, max_pixels, bad)
    if ours and META_EXTENSION not in parts:
        bad(key, "sample has no .json member (every gpufeed sample has one)")
    elif ours and parts[META_EXTENSION] is not None:
        _check_meta(key, parts[META_EXTENSION], label, classes, image, f"{key}.{images[0]}" if images else None, bad)
    return decoded


def _dotted_keys(members: Iterator[tuple[str, int, bytes | None]], ours: bool,
                 bad: Callable[[str | None, str], None]) -> Iterator[tuple[str, bytes | None]]:
    """The members as ``(name, data)``, reporting on the way, in a gpufeed set, a member whose key holds a dot."""
    for member, _, data in members:
        split = split_member(member)
        # Foreign sets: webdataset (and so the loader and `gpufeed index`) keys a member by its name up to
        # the first dot, so `x.seg.png` is member "seg.png" of sample "x", not a bad key.
        if ours and split and "." in split[1] and split[1] not in _KNOWN:
            bad(member, f"key holds a dot: readers take {split[0]!r} as the key and {split[1]!r} as the "
                        f"extension")
        yield member, data


def _check_whole_file(tar: TarPass | None, size: int | None, expected: dict[str, Any], found: int,
                      bad: Callable[[str | None, str], None]) -> None:
    """Once the shard is read: its size (a pipe: command's output, known only now) and sha256 against the manifest's,
    and its sample count. The sha256 is compared only when the whole file was read."""
    if size is None and tar is not None and expected.get("bytes") and tar.raw.n != expected["bytes"]:
        bad(None, f"size is {tar.raw.n} bytes, manifest says {expected['bytes']}")  # a pipe: command's output
    if tar is not None and tar.sha256 is not None:
        got = tar.sha256
        if tar.raw.n == (size if size is not None else expected.get("bytes")) and got != expected["sha256"]:
            bad(None, f"sha256 {got[:16]}... does not match the manifest's {expected['sha256'][:16]}...")
    if expected.get("num_samples") is not None and found != expected["num_samples"]:
        bad(None, f"holds {found} samples, manifest says {expected['num_samples']}")


def _verify_shard(path: str, name: str, expected: dict[str, Any], classes: list[str], gzip: bool, decode: bool,
                  ours: bool, max_pixels: int = DEFAULT_MAX_PIXELS, label_source: str = DEFAULT_LABEL_SOURCE
                  ) -> dict[str, Any]:
    problems: list[tuple[str | None, str]] = []
    count = [0]  # all problems, listed or not
    keys: list[str] = []  # distinct keys of samples, in order (for the set-wide uniqueness check)
    found = 0  # samples as readers count them (a key that comes back is another sample)
    decoded = 0
    class_index = {c: i for i, c in enumerate(classes)}

    def bad(member: str | None, reason: str, kind: str = "") -> None:
        count[0] += 1
        if len(problems) < MAX_SHARD_PROBLEMS:
            problems.append((member, reason))

    remote = is_remote(path)
    size, failed = _shard_size(path, name, remote)
    if failed is not None:
        return failed
    if expected.get("bytes") and size is not None and size != expected["bytes"]:
        bad(None, f"size is {size} bytes, manifest says {expected['bytes']}")
    listed: set[str] = set()

    def finish(key: str, parts: dict[str, bytes | None]) -> None:
        nonlocal decoded, found
        images = [e for e in parts if e in READ_IMAGE_EXTENSIONS]
        if not ours and not images:
            _check_imageless_key(key, parts, bad)
            return
        found += 1
        if key not in listed:
            listed.add(key)
            keys.append(key)
        if _check_sample(key, parts, images, ours, classes, class_index, label_source, decode, max_pixels, bad):
            decoded += 1

    def want(member: str, member_size: int) -> bool:
        if member_size > MAX_MEMBER_BYTES:
            bad(member, f"member is {member_size} bytes, more than the {MAX_MEMBER_BYTES} verify reads")
            return False
        return True

    tar = None
    grouper = SampleGrouper(bad)
    timed_out = False
    try:
        with (open_shard(path, size=size) if remote else open(path, "rb")) as f:
            tar = TarPass(f, gzip, hash=bool(expected.get("sha256")))
            for key, parts in grouper.samples(_dotted_keys(tar.members(want), ours, bad)):
                finish(key, parts)
            end = tar.end_problem()
            if end:
                bad(tar.last, end)
    except SourceError as exc:  # a remote shard that stopped answering (after the retries)
        bad(tar.last if tar else None, redact(one_line(exc)))
        timed_out = isinstance(exc, ReadTimedOut)
    except TruncatedMember as exc:
        bad(tar.last if tar else None, f"{exc}; the tar does not read to the end")
    except TarFormatError as exc:
        bad(None, f"{exc}; the loader refuses this shard")
    except (tarfile.TarError, EOFError, OSError, ValueError, zlib.error) as exc:
        last = tar.last if tar else None
        where = f"after member {last}" if last else "at the start"
        bad(last, f"tar does not read to the end ({type(exc).__name__}: {exc}) {where}")
    _check_whole_file(tar, size, expected, found, bad)
    return {"name": name, "problems": problems, "num_problems": count[0], "keys": keys, "found": found,
            "decoded": decoded, "timed_out": timed_out}


def _within_timeout_bound(results: Iterator[dict[str, Any]], total: int, location: str) -> list[dict[str, Any]]:
    """The shards' results in the set's order, stopping the job (RunError, exit 1) once
    ``source.MAX_TIMED_OUT_READS_IN_A_ROW`` shards in a row failed because their reads timed out: a stalled or
    trickling server would otherwise hold verify a read's whole bound per shard."""
    out: list[dict[str, Any]] = []
    in_a_row = 0
    for r in results:
        out.append(r)
        in_a_row = in_a_row + 1 if r.get("timed_out") else 0
        if in_a_row >= MAX_TIMED_OUT_READS_IN_A_ROW:
            raise RunError(f"{redact(location)}: verify stopped after {in_a_row} shards in a row whose reads timed out "
                           f"(the job's bound, MAX_TIMED_OUT_READS_IN_A_ROW; the last: {r['name']}); "
                           f"{total - len(out)} of {total} shards were not verified")
    return out


class _ProblemLog:
    """The set's problems: every one counted in ``num_problems``, the first MAX_REPORTED_PROBLEMS listed (the
    verify record stays bounded)."""

    def __init__(self) -> None:
        self.problems: list[VerifyProblem] = []
        self.num_problems = 0

    def add(self, problem: VerifyProblem, counted: int = 1) -> None:
        self.num_problems += counted
        if len(self.problems) < MAX_REPORTED_PROBLEMS:
            self.problems.append(problem)


def _run_jobs(jobs: list[tuple[Any, ...]], workers: int, location: str) -> list[dict[str, Any]]:
    """Each shard's :func:`_verify_shard` result, in the set's order, read over ``workers`` processes when more
    than one, within :func:`_within_timeout_bound`'s bound. A job stopped early cancels the shards not started."""
    if workers > 1:
        from gpufeed.core.system import process_pool

        with process_pool(workers) as ex:
            futures = [ex.submit(_verify_shard, *j) for j in jobs]
            try:
                return _within_timeout_bound((f.result() for f in futures), len(jobs), location)
            except BaseException:
                ex.shutdown(wait=False, cancel_futures=True)  # only the shards being read are waited for
                raise
    return _within_timeout_bound((_verify_shard(*j) for j in jobs), len(jobs), location)


def _merge_results(results: list[dict[str, Any]], log: _ProblemLog) -> tuple[dict[str, str], int]:
    """The shards' problems into ``log`` (a shard's count includes those it did not list), plus a problem for each
    key also used in an earlier shard. Returns each key's shard and the samples found in all."""
    seen: dict[str, str] = {}
    found = 0
    for r in results:
        for member, reason in r["problems"]:
            log.add(VerifyProblem(r["name"], member, reason), 0)
        log.num_problems += r["num_problems"]
        found += r["found"]
        for k in r["keys"]:
            if k in seen:
                log.add(VerifyProblem(r["name"], k, f"key {k!r} is also used in {seen[k]}"))
            else:
                seen[k] = r["name"]
    return seen, found


def verify_shards(path: str | Path, decode: bool = True, workers: int | None = None,
                  max_pixels: int = DEFAULT_MAX_PIXELS, manifest: str | Path | None = None) -> VerifyReport:
    """Verify the shard set at ``path``: any spec :func:`gpufeed.shardset.source.open_set` takes (a folder or
    manifest.json, a URL, a brace pattern or ``pipe:`` command with ``manifest``). Input errors raise DataError."""
    from gpufeed.core.system import usable_cpus

    t0 = time.perf_counter()
    shard_set = open_set(path, manifest)
    m = shard_set.manifest
    root = index = None  # a local set's shard folder and index.parquet (a remote set's are not listed or read)
    if not shard_set.remote:
        here = manifest_path(manifest if manifest is not None else path).parent
        index = here / INDEX_NAME
        if manifest is not None:
            root = Path(shard_set.urls[0]).parent
        else:  # `gpufeed index --out` elsewhere: the shards stay in their folder (as the loader reads them)
            root = shard_root(m, path)
    ours = m.created_by.startswith("gpufeed shard")
    gzip = m.compression == "gzip"
    staged = staged_node(m, shard_set.location)
    here = range(len(m.shards)) if staged is None else node_shards(len(m.shards), *staged)
    node = (None if staged is None
            else f"node {staged[0]} of {staged[1]}: {len(here)} of {len(m.shards)} shards staged here")
    shards = [m.shards[i] for i in here]
    jobs = [(shard_set.urls[i], m.shards[i].name, {"bytes": m.shards[i].bytes, "sha256": m.shards[i].sha256,
                                                   "num_samples": m.shards[i].num_samples},
             m.classes, gzip or m.shards[i].name.endswith((".tgz", ".tar.gz")), decode, ours, max_pixels, m.label)
            for i in here]
    workers = min(workers or usable_cpus(), max(1, len(jobs)))
    results = _run_jobs(jobs, workers, shard_set.location)

    log = _ProblemLog()
    seen, found = _merge_results(results, log)
    warnings = [] if root is None else _extra_files(root, {s.name for s in m.shards})
    if ours and index is None:
        warnings.append(f"{INDEX_NAME} of a remote set is not checked (verify a local copy for that)")
    elif ours:
        if index.exists():
            for p in _check_index(index, seen, None if staged is None else {s.name for s in shards}):
                log.add(p)
        else:
            log.add(VerifyProblem("index.parquet", None, "missing (every gpufeed shard set has one)"))
    expected = sum(s.num_samples for s in shards)
    if found != expected and not any(p.member is None and "samples" in p.reason for p in log.problems):
        what = "the set holds" if staged is None else "the shards staged here hold"
        log.add(VerifyProblem("", None, f"{what} {found} samples, manifest says {expected}"))
    return VerifyReport(
        path=redact(shard_set.location) if root is None else str(root), num_shards=len(shards), num_samples=found,
        num_expected=expected,
        num_decoded=sum(r["decoded"] for r in results), total_bytes=sum(s.bytes for s in shards),
        elapsed_s=time.perf_counter() - t0, decode=decode, created_by=m.created_by, problems=log.problems,
        num_problems=log.num_problems, max_pixels=max_pixels, warnings=warnings, node=node,
    )


def _extra_files(root: Path, listed: set[str]) -> list[str]:
    """One warning naming the shard-like files in ``root`` that the manifest does not list (none: [])."""
    try:
        extra = sorted(e.name for e in os.scandir(root)
                       if e.name.endswith(SHARD_SUFFIXES) and not e.name.startswith(".") and e.name not in listed)
    except OSError:
        return []
    if not extra:
        return []
    more = f" and {len(extra) - MAX_LISTED} more" if len(extra) > MAX_LISTED else ""
    return [f"{len(extra)} shard-like file(s) in {root} are not in the manifest, so no reader uses them: "
            f"{', '.join(extra[:MAX_LISTED])}{more}"]


def _check_index(index: Path, seen: dict[str, str], only: set[str] | None = None) -> list[VerifyProblem]:
    """index.parquet of a gpufeed set lists exactly the (key, shard) pairs found in the shards (``only``: of the
    rows, only those of these shards are compared: the shards a node-staged folder holds)."""
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(index, columns=["key", "shard"])
    except Exception as exc:  # noqa: BLE001 - unreadable index is a problem record
        return [VerifyProblem("index.parquet", None, f"unreadable ({type(exc).__name__}: {exc})")]
    pairs = list(zip(table.column("key").to_pylist(), table.column("shard").to_pylist()))
    if only is not None:
        pairs = [p for p in pairs if p[1] in only]
    rows = set(pairs)
    num_rows = len(pairs)
    want = set(seen.items())
    out = []
    for key, shard in sorted(rows - want)[:20]:
        out.append(VerifyProblem("index.parquet", key, f"row says {shard}, but no such sample is there"))
    for key, shard in sorted(want - rows)[:20]:
        out.append(VerifyProblem("index.parquet", key, f"sample in {shard} has no row"))
    if num_rows != len(rows):
        out.append(VerifyProblem("index.parquet", None, f"{num_rows - len(rows)} duplicate row(s)"))
    return out


def _where(p: VerifyProblem) -> str:
    return (p.shard or "(set)") + (f" member {p.member}" if p.member else "")


def _shape(reason: str) -> str:
    """A problem's reason without its particulars (quoted names, numbers): problems of one shape group."""
    return re.sub(r"\d+", "N", re.sub(r"'[^']*'", "'_'", reason))


def render_verify(report: VerifyReport, max_items: int = 30) -> str:
    """The verdict line, then one line per kind of problem: a problem met once as ``SHARD member M: reason``,
    a problem met many times as one line with its count and the first few places."""
    r = report
    head = (f"{r.num_shards} shards, {r.num_samples}/{r.num_expected} samples, "
            f"{r.num_decoded} images decoded, {r.total_bytes / 1e6:.1f} MB in {r.elapsed_s:.1f} s")
    warn = ([r.node] if r.node else []) + [f"warning: {w}" for w in r.warnings]
    if r.ok:
        return "\n".join([f"OK {r.path}: {head}", *warn])
    lines = [f"FAILED {r.path}: {r.num_problems} problem(s); {head}"]
    groups: dict[str, list[VerifyProblem]] = {}
    for p in r.problems:
        groups.setdefault(_shape(p.reason), []).append(p)
    for members in list(groups.values())[:max_items]:
        first = members[0]
        if len(members) == 1:
            lines.append(f"  {_where(first)}: {first.reason}")
            continue
        also = ", ".join(_where(p) for p in members[1:MAX_LISTED])
        more = f" and {len(members) - MAX_LISTED} more" if len(members) > MAX_LISTED else ""
        lines.append(f"  {len(members)} x {first.reason} ({_where(first)}; also {also}{more})")
    if len(groups) > max_items:
        lines.append(f"  ... and {len(groups) - max_items} more kinds of problem (see --json)")
    if r.num_problems > len(r.problems):
        lines.append(f"  ({r.num_problems - len(r.problems)} more problem(s) are counted but not listed)")
    return "\n".join(lines + warn)
