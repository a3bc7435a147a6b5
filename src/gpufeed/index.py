"""``gpufeed index SHARDS``: the manifest for tar shards that gpufeed did not write.

Users often already have WebDataset shards (written by webdataset's ``TarWriter``/``ShardWriter``,
img2dataset, ...). This scans them the way the loader reads them (webdataset's key grouping, only
image members and ``.cls`` labels) and writes a :class:`gpufeed.manifest.Manifest` so that the loader,
``tune`` and ``verify`` work on them.

- SHARDS is a folder (its ``*.tar``, ``*.tgz``, ``*.tar.gz``), a glob, a brace pattern
  (``data-{000..009}.tar``) or one file. All shards must sit in one folder.
- Shard file names are plain local file names (:func:`gpufeed.manifest.shard_name_problem`): a shard-looking
  file whose name holds URL or shell syntax (``pipe:...``) is refused with a sentence asking to rename it.
- Each shard is read once (sha256 included) with :class:`gpufeed.shardset.tar.TarPass` and grouped with
  :class:`gpufeed.shardset.keys.SampleGrouper`, as verify reads it, so index and verify read a shard alike: a
  tar without its end-of-archive blocks (cut short) or with a bad header after a member is refused, not
  indexed in part.
- A sample is a key with an image member (``shardset.keys.READ_IMAGE_EXTENSIONS``); keys without one are
  not counted (the loader ignores them too). Counted and listed (and the exit status is 1, as verify would
  fail them): samples without ``.cls`` or with a label :func:`gpufeed.manifest.parse_label` refuses, images
  no reader sees (behind a dot in the key, or a second image in a sample), members a sample holds twice
  and keys that come back after other keys.
- Classes: a ``classes.txt`` (one name per line) next to the shards wins; otherwise decimal labels give
  ``["0", ..., str(max)]`` (so label == index even with gaps), and text labels give their sorted distinct
  values (the loader maps each name to its index). A set without any ``.cls`` label is refused.
- The manifest goes to ``--out DIR`` (default: the shard folder). When DIR is not the shard folder, the
  manifest's ``root`` holds the shard folder's absolute path.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.errors import DataError
from gpufeed.manifest import (MANIFEST_NAME, MAX_CLASSES, MAX_LABEL_BYTES, SHARD_SUFFIXES, LabelError, Manifest,
                              ShardInfo, first_duplicate, manifest_path, parse_label, shard_name_problem,
                              write_manifest)
from gpufeed.shardset.keys import LABEL_EXTENSION, READ_IMAGE_EXTENSIONS, SampleGrouper, dotted_image, split_member
from gpufeed.shardset.tar import TarFormatError, TarPass, TruncatedMember, file_problem

CLASS_MAP_NAME = "classes.txt"
MAX_CLASS_MAP_BYTES = 256 << 20
"""A ``classes.txt`` larger than this (256 MiB) is refused before it is read."""
MAX_EXAMPLES = 5
"""Examples listed per kind of problem in an index record."""


@dataclass
class Problems:
    """One kind of problem: how many, and the first few places (``shard: member``)."""

    count: int = 0
    examples: list[str] = field(default_factory=list)

    def add(self, where: str, n: int = 1) -> None:
        self.count += n
        if len(self.examples) < MAX_EXAMPLES:
            self.examples.append(where)

    def merge(self, other: "Problems") -> None:
        self.count += other.count
        self.examples.extend(other.examples[:MAX_EXAMPLES - len(self.examples)])


@dataclass(frozen=True)
class IndexReport:
    manifest_path: str
    shard_folder: str
    num_shards: int
    num_samples: int
    num_classes: int
    num_unlabeled: int
    """Samples without a .cls member (the loader cannot train on them)."""
    num_ignored_keys: int
    """Keys without an image member (not samples)."""
    total_bytes: int
    compression: str | None
    hashed: bool
    class_source: str
    classes_preview: list[str] = field(default_factory=list)
    unlabeled: list[str] = field(default_factory=list)
    """The first samples without a .cls member (``shard: key``)."""
    num_bad_labels: int = 0
    """Samples whose .cls label parse_label refuses (the loader refuses them too)."""
    bad_labels: list[str] = field(default_factory=list)
    num_dropped_images: int = 0
    """Image members no reader sees: behind a dot in the key (``k.3.jpg``) or a second image in a sample."""
    dropped_images: list[str] = field(default_factory=list)
    num_duplicate_members: int = 0
    """Members a sample already holds (same key and extension); readers keep only one of them."""
    duplicate_members: list[str] = field(default_factory=list)
    num_ungrouped_keys: int = 0
    """Keys that come back after other keys in a shard: readers take them as further samples."""
    ungrouped_keys: list[str] = field(default_factory=list)
    ok: bool = True


def _check_name(path: Path) -> None:
    why = shard_name_problem(path.name)
    if why:
        raise DataError(f"refusing shard file {str(path)!r}: {why}; rename it (or move it out of the folder)")


def resolve_shards(spec: str | Path) -> list[Path]:
    """A folder, a glob, a brace pattern or a file -> sorted shard paths (all in one folder).

    Every shard's file name must be a plain local file name (no URL or shell syntax) and every shard-like name
    (``*.tar``, ...) a regular file (a symbolic link to one is fine), not a FIFO, device or folder: DataError
    otherwise.
    """
    text = str(spec)
    p = Path(text)
    if p.is_dir():
        paths = sorted(q for q in p.iterdir() if q.name.endswith(SHARD_SUFFIXES) and not q.name.startswith("."))
        if not paths:
            raise DataError(f"{p} holds no shards ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    elif "{" in text and "}" in text:
        import braceexpand

        paths = [Path(x) for x in braceexpand.braceexpand(text)]
        missing = [x for x in paths if file_problem(x) == "is missing"]
        if missing:
            raise DataError(f"{len(missing)} shard(s) of {text} do not exist, e.g. {missing[0]}")
    elif any(c in text for c in "*?["):
        paths = sorted(Path(x) for x in glob.glob(text) if Path(x).name.endswith(SHARD_SUFFIXES) or Path(x).is_file())
        if not paths:
            raise DataError(f"no file matches {text}")
    elif p.is_file() or (p.exists() and p.name.endswith(SHARD_SUFFIXES)):
        paths = [p]
    else:
        raise DataError(f"{text} is neither a folder, a shard file, a glob nor a brace pattern")
    for q in paths:
        _check_name(q)
    odd = [(q, why) for q in paths if (why := file_problem(q))]
    if odd:
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        raise DataError(f"refusing shard file {str(odd[0][0])!r}: it {odd[0][1]}{more}; a shard must be a regular "
                        f"file - replace it or move it out of the folder")
    folders = {q.resolve().parent for q in paths}
    if len(folders) > 1:
        raise DataError(f"the shards of {text} are spread over {len(folders)} folders; index one folder at a time")
    if len({q.name for q in paths}) != len(paths):
        raise DataError(f"{text} names some shards twice")
    return paths


def _compression(paths: list[Path]) -> str | None:
    kinds = {("gzip" if q.name.endswith((".tgz", ".tar.gz")) else None) for q in paths}
    if len(kinds) > 1:
        raise DataError("the shards mix plain .tar and gzip-compressed files; index them separately")
    return kinds.pop()


@dataclass
class ShardScan:
    """What one shard holds, as the loader will see it."""

    samples: int = 0
    ignored: int = 0
    """Keys without an image member."""
    sha256: str | None = None
    labels: Counter = field(default_factory=Counter)
    """Raw .cls bytes -> samples with that label (None for a .cls member too large to be a label)."""
    label_examples: dict = field(default_factory=dict)
    """Raw .cls bytes -> the first sample carrying it (``shard: key``)."""
    unlabeled: Problems = field(default_factory=Problems)
    dropped: Problems = field(default_factory=Problems)
    duplicates: Problems = field(default_factory=Problems)
    ungrouped: Problems = field(default_factory=Problems)


def scan_shard(path: Path, hash: bool = True) -> ShardScan:
    """Read one shard file (opened here, never through a URL opener) in one pass: samples, labels, problems
    and sha256. A shard that does not read to its end-of-archive blocks raises DataError."""
    scan = ShardScan()
    name = path.name
    kinds = {"duplicate": scan.duplicates, "ungrouped": scan.ungrouped}

    def bad(member: str, reason: str, kind: str) -> None:
        if kind in kinds:
            kinds[kind].add(f"{name}: {member}")

    def want(member: str, size: int) -> bool:  # only labels are read; images are counted, not decoded
        split = split_member(member)
        return split is not None and split[1] == LABEL_EXTENSION and size <= MAX_LABEL_BYTES

    def finish(key: str, parts: dict) -> None:
        images = [e for e in parts if e in READ_IMAGE_EXTENSIONS]
        if not images:
            scan.ignored += 1
            member = dotted_image(key, parts)
            if member:
                scan.dropped.add(f"{name}: {member} (a dot in its key)")
            return
        scan.samples += 1
        for e in images[1:]:
            scan.dropped.add(f"{name}: {key}.{e} (a second image; the loader reads {key}.{images[0]})")
        if LABEL_EXTENSION not in parts:
            scan.unlabeled.add(f"{name}: {key}")
        else:
            raw = parts[LABEL_EXTENSION]
            scan.labels[raw] += 1
            scan.label_examples.setdefault(raw, f"{name}: {key}.cls")

    grouper = SampleGrouper(bad)
    tar = None
    try:
        with open(path, "rb") as f:
            tar = TarPass(f, gzip=name.endswith((".tgz", ".tar.gz")), hash=hash)
            for key, parts in grouper.samples((member, data) for member, _, data in tar.members(want)):
                finish(key, parts)
            end = tar.end_problem()
    except TruncatedMember as exc:
        raise DataError(f"shard {path} is truncated ({exc}); index refuses to count part of a shard") from None
    except TarFormatError as exc:
        raise DataError(f"shard {path} is not a readable tar file: {exc}; the loader refuses it, so index does too") from None
    except Exception as exc:  # tarfile.ReadError, EOFError, gzip and zlib errors...
        last = f" after member {tar.last}" if tar is not None and tar.last else ""
        raise DataError(f"shard {path} is not a readable tar file{last} ({type(exc).__name__}: {exc})") from None
    if end:
        raise DataError(f"shard {path}: {end.replace('this member', f'member {tar.last}')}; index refuses to "
                        f"count part of a shard")
    scan.sha256 = tar.sha256
    return scan


def _label_text(raw: bytes | None) -> str | None:
    """A label's text as parse_label reads it (None when it is not UTF-8 or too long)."""
    if raw is None or len(raw) > MAX_LABEL_BYTES:
        return None
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        return None


def _classes(folder: Path, labels: set[str]) -> tuple[list[str], str]:
    class_map = folder / CLASS_MAP_NAME
    if class_map.is_file():
        if class_map.stat().st_size > MAX_CLASS_MAP_BYTES:
            raise DataError(f"{class_map} is larger than {MAX_CLASS_MAP_BYTES >> 20} MiB; it is not a class list")
        try:
            text = class_map.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            raise DataError(f"{class_map} is not UTF-8 text") from None
        names = [line.strip() for line in text.splitlines() if line.strip()]
        if not names:
            raise DataError(f"{class_map} lists no class name; write one name per line")
        dup = first_duplicate(names)
        if dup is not None:
            raise DataError(f"{class_map} lists class {dup[:80]!r} twice")
        position = {c: i for i, c in enumerate(names)}
        for x in sorted(labels):  # parse_label reads digits as an index: a class named "7" must be class 7
            if x.isascii() and x.isdigit() and x in position and position[x] != int(x):
                raise DataError(f"{class_map} names class {x!r} at index {position[x]}, but a .cls label {x!r} "
                                f"reads as class index {int(x)}; the label is ambiguous")
        return names, CLASS_MAP_NAME
    if not labels:
        raise DataError(f"no sample in {folder} has a .cls label, so there are no classes to train on; add "
                        f".cls members or a {CLASS_MAP_NAME} next to the shards")
    numbers = {x for x in labels if x.isascii() and x.isdigit()}
    if numbers and len(numbers) < len(labels):
        name = next(iter(sorted(labels - numbers)))
        raise DataError(f"the .cls labels in {folder} mix class indices ({min(numbers, key=len)!r}) and class names "
                        f"({name[:80]!r}), so an index cannot be told from a name; write the class names in order "
                        f"to {CLASS_MAP_NAME} next to the shards")
    if numbers:
        top = max(numbers, key=lambda x: (len(x.lstrip("0")), x.lstrip("0")))
        if len(top.lstrip("0")) > len(str(MAX_CLASSES)) or int(top) >= MAX_CLASSES:
            raise DataError(f"a .cls label in {folder} is {top[:40]!r}: class indices must be below {MAX_CLASSES:,}")
        return [str(i) for i in range(int(top) + 1)], "integer .cls"
    return sorted(labels), "text .cls"


def _prefix_and_pattern(names: list[str]) -> tuple[str, str]:
    parts = [re.fullmatch(r"(.+)-(\d+)(\..+)", n) for n in names]
    if all(parts) and len({(m.group(1), m.group(3), len(m.group(2))) for m in parts}) == 1:
        nums = [int(m.group(2)) for m in parts]
        if nums == list(range(nums[0], nums[0] + len(nums))):
            m0, m1 = parts[0], parts[-1]
            pattern = names[0] if len(names) == 1 else f"{m0.group(1)}-{{{m0.group(2)}..{m1.group(2)}}}{m0.group(3)}"
            return m0.group(1), pattern
        return parts[0].group(1), ""
    stem = names[0].split(".", 1)[0]
    return stem, names[0] if len(names) == 1 else ""


def index_shards(shards: str | Path, *, out: str | Path | None = None, hash: bool = True) -> IndexReport:
    """Scan foreign shards and write ``manifest.json`` to ``out`` (default: the shard folder)."""
    from gpufeed import __version__

    paths = resolve_shards(shards)
    folder = paths[0].resolve().parent
    dest = Path(out).resolve() if out is not None else folder
    existing = manifest_path(dest)
    if existing.is_file():
        import json

        try:
            with open(existing, "rb") as f:
                created_by = json.loads(f.read(1 << 20)).get("created_by")
        except (OSError, ValueError, AttributeError, RecursionError):
            created_by = None
        if created_by != "gpufeed index":
            raise DataError(f"{existing} already exists (created by {str(created_by)[:80]!r}); it is not replaced "
                            f"by an index - choose another --out DIR")
    compression = _compression(paths)
    infos: list[ShardInfo] = []
    labels: Counter = Counter()
    label_examples: dict = {}
    unlabeled, dropped, duplicates, ungrouped = Problems(), Problems(), Problems(), Problems()
    total = ignored = 0
    for p in paths:
        scan = scan_shard(p, hash=hash)
        total += scan.samples
        ignored += scan.ignored
        labels.update(scan.labels)
        for raw, where in scan.label_examples.items():
            label_examples.setdefault(raw, where)
        for mine, theirs in ((unlabeled, scan.unlabeled), (dropped, scan.dropped), (duplicates, scan.duplicates),
                             (ungrouped, scan.ungrouped)):
            mine.merge(theirs)
        infos.append(ShardInfo(name=p.name, num_samples=scan.samples, bytes=p.stat().st_size, sha256=scan.sha256))
    if total == 0:
        raise DataError(f"{shards}: no sample with an image member ({', '.join(READ_IMAGE_EXTENSIONS)}) in "
                        f"{len(paths)} shard(s)")
    texts = {t for t in map(_label_text, labels) if t is not None}
    classes, class_source = _classes(folder, texts)
    class_index = {c: i for i, c in enumerate(classes)}
    bad_labels = Problems()
    for raw, n in labels.items():  # the loader's rule decides which labels the manifest's classes accept
        try:
            parse_label(raw, classes, class_index)
        except LabelError as exc:
            why = f"a .cls member over {MAX_LABEL_BYTES} bytes" if raw is None else str(exc)
            bad_labels.add(f"{label_examples[raw]} ({why})", n)
    prefix, pattern = _prefix_and_pattern([p.name for p in paths])
    total_bytes = sum(i.bytes for i in infos)
    manifest = Manifest(
        prefix=prefix, classes=classes, shards=infos, num_samples=total, total_bytes=total_bytes,
        mean_sample_bytes=total_bytes / total, url_pattern=pattern,
        options={"source": str(shards), "hashed": hash, "class_source": class_source,
                 "num_unlabeled": unlabeled.count, "num_ignored_keys": ignored},
        created_by="gpufeed index", gpufeed_version=__version__, compression=compression,
        root=None if dest == folder else str(folder),
    )
    Manifest.from_dict(manifest.to_dict(), where=f"the manifest for {folder}")  # never write what readers refuse
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if not os.access(dest, os.W_OK):
            raise PermissionError(f"{dest} is not writable")
        written = write_manifest(dest, manifest)
    except OSError as exc:
        hint = "" if out is not None else "; write it elsewhere with --out DIR"
        raise DataError(f"cannot write {dest / MANIFEST_NAME} ({exc.strerror or exc}){hint}") from None
    return IndexReport(
        manifest_path=str(written), shard_folder=str(folder), num_shards=len(paths), num_samples=total,
        num_classes=len(classes), num_unlabeled=unlabeled.count, num_ignored_keys=ignored, total_bytes=total_bytes,
        compression=compression, hashed=hash, class_source=class_source, classes_preview=classes[:10],
        unlabeled=unlabeled.examples, num_bad_labels=bad_labels.count, bad_labels=bad_labels.examples,
        num_dropped_images=dropped.count, dropped_images=dropped.examples,
        num_duplicate_members=duplicates.count, duplicate_members=duplicates.examples,
        num_ungrouped_keys=ungrouped.count, ungrouped_keys=ungrouped.examples,
        ok=not (unlabeled.count or bad_labels.count or dropped.count or duplicates.count or ungrouped.count),
    )


def _line(what: str, count: int, examples: list[str]) -> str:
    more = f" and {count - len(examples)} more" if count > len(examples) else ""
    return f"error: {count} {what}: {'; '.join(examples)}{more}"


def render(report: IndexReport) -> str:
    """Summary, manifest path, then one line per kind of problem (count and first examples)."""
    r = report
    lines = [
        f"indexed {r.num_shards} shard(s) in {r.shard_folder}: {r.num_samples} samples, "
        f"{r.num_classes} classes ({r.class_source}), {r.total_bytes / 1e6:.1f} MB"
        + (f", {r.compression}" if r.compression else "")
        + ("" if r.hashed else ", no sha256 (--no-hash)"),
        f"manifest: {r.manifest_path}",
    ]
    if r.num_ignored_keys:
        lines.append(f"ignored {r.num_ignored_keys} key(s) without an image member")
    for what, count, examples in (
        ("sample(s) have no .cls label; the loader will reject them", r.num_unlabeled, r.unlabeled),
        ("sample(s) have a label the loader rejects", r.num_bad_labels, r.bad_labels),
        ("image member(s) that no reader sees", r.num_dropped_images, r.dropped_images),
        ("member(s) a sample holds twice (readers keep only one)", r.num_duplicate_members, r.duplicate_members),
        ("key(s) that come back after other keys (readers take them as more samples)", r.num_ungrouped_keys,
         r.ungrouped_keys),
    ):
        if count:
            lines.append(_line(what, count, examples))
    return "\n".join(lines)
