"""``gpufeed index SHARDS``: the manifest for tar shards that gpufeed did not write.

Users often already have WebDataset shards (written by webdataset's ``TarWriter``/``ShardWriter``,
img2dataset, ...). This scans them the way the loader reads them (webdataset's key grouping, only
image members and label members) and writes a :class:`gpufeed.shardset.manifest.Manifest` so that the loader,
``tune``, ``train`` and ``verify`` work on them.

- SHARDS is a folder (its ``*.tar``, ``*.tgz``, ``*.tar.gz``), a glob, a brace pattern
  (``data-{000..009}.tar``) or one file. All shards must sit in one folder.
- Shard file names are plain local file names (:func:`gpufeed.shardset.manifest.shard_name_problem`): a shard-looking
  file whose name holds URL or shell syntax (``pipe:...``) is refused with a sentence asking to rename it.
- Each shard is read once (sha256 included) with :class:`gpufeed.shardset.tar.TarPass` and grouped with
  :class:`gpufeed.shardset.keys.SampleGrouper`, as verify reads it, so index and verify read a shard alike: a
  tar without its end-of-archive blocks (cut short) or with a bad header after a member is refused, not
  indexed in part.
- Labels are taken where ``--label`` says (the manifest's ``label``, :func:`gpufeed.shardset.manifest.read_label`):
  ``cls`` (default, the ``.cls`` member), ``txt`` (the ``.txt`` member, as img2dataset writes captions or
  class names) or ``json:FIELD`` (a top-level FIELD of the ``.json`` member: an integer is a class index, a
  string a class name).
- A sample is a key with an image member (``shardset.keys.READ_IMAGE_EXTENSIONS``); keys without one are
  not counted (the loader ignores them too). Counted and listed (and the exit status is 1, as verify would
  fail them): samples without a label (no label member, or no FIELD in the ``.json``), samples whose label
  :func:`gpufeed.shardset.manifest.read_label` refuses, images no reader sees (behind a dot in the key, or a second
  image in a sample), members a sample holds twice and keys that come back after other keys. The manifest
  is written all the same.
- Classes: ``--classes FILE``, else a ``classes.txt`` next to the shards (one name per line, in label
  order) wins; otherwise integer labels (decimal text, or JSON integers) give ``["0", ..., str(max)]`` (so
  label == index even with gaps), and text labels give their sorted distinct values (the loader maps each
  name to its index). A set without any label and without a class list is refused.
- The manifest goes to ``--out DIR`` (default: the shard folder). When DIR is not the shard folder, the
  manifest's ``root`` holds the shard folder's absolute path.
- The sidecar indexes of other readers (timm's ``_info.json``, ``wids.json``, DALI's ``.idx`` per plain tar:
  :mod:`gpufeed.shardset.sidecars`) go to DIR too, before the manifest, for a local set; their shard paths are relative
  to DIR.
"""

from __future__ import annotations

import glob
import os
import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.shardset.img2dataset import Img2DatasetRecords, read_records, render_lines
from gpufeed.shardset.manifest import (DEFAULT_LABEL_SOURCE, MANIFEST_NAME, MAX_CLASSES, MAX_LABEL_BYTES, SHARD_SUFFIXES,
                              LabelError, Manifest, MissingLabel, ShardInfo, class_count_problem, first_duplicate,
                              label_index, label_member, label_member_bytes, label_source_problem, label_value,
                              manifest_path, shard_name_problem, write_manifest)
from gpufeed.shardset.keys import (LABEL_EXTENSION, META_EXTENSION, READ_IMAGE_EXTENSIONS, TEXT_EXTENSION,
                                   UNGROUPED_FIX, KeyDigest, SampleGrouper, dotted_image, split_member)
from gpufeed.core.redact import redact
from gpufeed.shardset.source import SourceError, check_location, expand_pattern, is_pipe, is_remote, open_shard, source_name
from gpufeed.shardset.tar import TarFormatError, TarPass, TruncatedMember, file_problem

CLASS_MAP_NAME = "classes.txt"
MAX_CLASS_MAP_BYTES = 256 << 20
"""A class list (``classes.txt``, ``--classes FILE``) larger than this (256 MiB) is refused before it is read."""
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
    """The shards' folder (for a URL or pipe: pattern: the pattern as typed)."""
    num_shards: int
    num_samples: int
    num_classes: int
    num_unlabeled: int
    """Samples without a label (no label member, or no FIELD in the .json): the loader cannot train on them."""
    num_ignored_keys: int
    """Keys without an image member (not samples)."""
    total_bytes: int
    compression: str | None
    hashed: bool
    class_source: str
    classes_preview: list[str] = field(default_factory=list)
    unlabeled: list[str] = field(default_factory=list)
    """The first samples without a label (``shard: key (why)``)."""
    num_bad_labels: int = 0
    """Samples whose label read_label refuses (the loader refuses them too)."""
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
    label: str = DEFAULT_LABEL_SOURCE
    """Where the labels were taken from (``cls``, ``txt``, ``json:FIELD``), as the manifest records it."""
    ok: bool = True
    img2dataset: Img2DatasetRecords | None = None
    """img2dataset's own records beside the shards (``NNNNN_stats.json``, ``NNNNN.parquet``), when there are any:
    URLs tried, downloaded and failed (:mod:`gpufeed.shardset.img2dataset`)."""
    notes: list[str] = field(default_factory=list)
    """The sidecar indexes (``gpufeed.shardset.sidecars``) not written, and why."""


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
    check_location(spec)
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
    # a folder, glob or pattern names a set: no shard may be a link out of its folder; a file typed alone may be
    odd = [(q, why) for q in paths if (why := file_problem(q, None if len(paths) == 1 and p.is_file() else q.parent))]
    if odd:
        more = f" (and {len(odd) - 1} more)" if len(odd) > 1 else ""
        raise DataError(f"refusing shard file {str(odd[0][0])!r}: it {odd[0][1]}{more}; a shard must be a regular "
                        f"file in the set folder - replace it or move it out of the folder")
    folders = {q.resolve().parent for q in paths}
    if len(folders) > 1:
        raise DataError(f"the shards of {text} are spread over {len(folders)} folders; index one folder at a time")
    if len({q.name for q in paths}) != len(paths):
        raise DataError(f"{text} names some shards twice")
    return paths


def resolve_remote_shards(spec: str) -> list[str]:
    """A user-typed URL brace pattern or ``pipe:`` command pattern (or one URL) -> its shard locations, in
    order. The shard names (the basenames) must be plain, distinct shard file names: DataError otherwise."""
    if not is_pipe(spec) and "{" not in spec and not spec.endswith(SHARD_SUFFIXES):
        raise DataError(f"{spec}: a remote folder cannot be listed; name its shards with a brace pattern, e.g. "
                        f"'{spec}/train-{{000000..000127}}.tar'")
    urls = expand_pattern(spec)
    names = [source_name(u) for u in urls]
    for u, n in zip(urls, names):
        why = shard_name_problem(n)
        if why:
            raise DataError(f"refusing shard {u!r}: its name {n[:80]!r} {why}")
    dup = first_duplicate(names)
    if dup is not None:
        raise DataError(f"{spec} names shard {dup!r} twice")
    return urls


def _compression(paths: list[Any]) -> str | None:
    kinds = {("gzip" if str(q).endswith((".tgz", ".tar.gz")) else None) for q in paths}
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
    """Label value (:func:`gpufeed.shardset.manifest.label_value`: a text or a JSON integer) -> samples with it."""
    label_examples: dict = field(default_factory=dict)
    """Label value -> the first sample carrying it (``shard: key.ext``)."""
    unlabeled: Problems = field(default_factory=Problems)
    unreadable: Problems = field(default_factory=Problems)
    """Samples whose label member is not a label (too large, not UTF-8, not JSON, a FIELD of another type)."""
    label_members: set = field(default_factory=set)
    """Which of the label members (cls, txt, json) the samples hold: hints when the labels are elsewhere."""
    dropped: Problems = field(default_factory=Problems)
    duplicates: Problems = field(default_factory=Problems)
    ungrouped: Problems = field(default_factory=Problems)
    bytes: int = 0
    """Bytes of the shard file (all of it is read)."""
    keys: KeyDigest = field(default_factory=KeyDigest)
    """The digest of its samples' keys in order (the manifest's ``keys_sha256``, which the loader checks)."""


def scan_shard(path: Path | str, hash: bool = True, label: str = DEFAULT_LABEL_SOURCE) -> ShardScan:
    """Read one shard in one pass: samples, labels (where the label source ``label`` says), problems, size and
    sha256. ``path`` is a local file (opened here, never through a URL opener) or a user-typed URL or ``pipe:``
    command (:func:`gpufeed.shardset.source.open_shard`). A shard that does not read to its end-of-archive blocks
    raises DataError."""
    scan = ShardScan()
    member_ext = label_member(label)
    member_bytes = label_member_bytes(label)
    remote = is_remote(path)
    name = source_name(str(path)) if remote else Path(path).name
    kinds = {"duplicate": scan.duplicates, "ungrouped": scan.ungrouped}

    def bad(member: str, reason: str, kind: str) -> None:
        if kind in kinds:
            kinds[kind].add(f"{name}: {member}")

    def want(member: str, size: int) -> bool:  # only labels are read; images are counted, not decoded
        split = split_member(member)
        return split is not None and split[1] == member_ext and size <= member_bytes

    def finish(key: str, parts: dict) -> None:
        images = [e for e in parts if e in READ_IMAGE_EXTENSIONS]
        if not images:
            scan.ignored += 1
            member = dotted_image(key, parts)
            if member:
                scan.dropped.add(f"{name}: {member} (a dot in its key)")
            return
        scan.samples += 1
        scan.keys.update(key)
        for e in images[1:]:
            scan.dropped.add(f"{name}: {key}.{e} (a second image; the loader reads {key}.{images[0]})")
        scan.label_members.update(e for e in (LABEL_EXTENSION, TEXT_EXTENSION, META_EXTENSION) if e in parts)
        try:
            value = label_value(parts, label)
        except MissingLabel as exc:
            scan.unlabeled.add(f"{name}: {key} ({exc})")
            return
        except LabelError as exc:
            scan.unreadable.add(f"{name}: {key}.{member_ext} ({exc})")
            return
        if value not in scan.labels and len(scan.labels) >= MAX_CLASSES:
            raise DataError(f"shard {path} holds more than {MAX_CLASSES:,} distinct labels ({label}); a set has at "
                            f"most {MAX_CLASSES:,} classes - is {label!r} where its labels are?")
        scan.labels[value] += 1
        scan.label_examples.setdefault(value, f"{name}: {key}.{member_ext}")

    grouper = SampleGrouper(bad)
    tar = None
    try:
        with (open_shard(str(path)) if remote else open(path, "rb")) as f:
            tar = TarPass(f, gzip=name.endswith((".tgz", ".tar.gz")), hash=hash)
            for key, parts in grouper.samples((member, data) for member, _, data in tar.members(want)):
                finish(key, parts)
            end = tar.end_problem()
    except SourceError:
        raise
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
    scan.bytes = tar.raw.n
    return scan


def class_lines(text: str) -> list[str]:
    """The class names of a class-list text, one per line: a UTF-8 byte-order mark at its start is dropped, lines
    end only at ``\\n`` (and ``\\r\\n``), never at U+2028, U+0085 or another character ``str.splitlines`` takes for
    a line end (a class name may hold them), and surrounding white space and blank lines are skipped."""
    text = text[1:] if text.startswith("\ufeff") else text
    return [n for n in (line.strip() for line in text.split("\n")) if n]


def read_class_list(path: Path, set_root: Path | None = None) -> list[str]:
    """Class names in label order from a text file, one per line (blank lines skipped): at most
    :data:`MAX_CLASS_MAP_BYTES` of UTF-8, each name at most ``MAX_LABEL_BYTES``, no name twice, at most
    ``MAX_CLASSES``. Raises DataError naming the file. ``set_root``: the folder of the set the file came with
    (``classes.txt``): a symbolic link out of it is refused, its target never read (:mod:`gpufeed.core.safefs`); a file
    the user named (``--classes``) may be a link but must be a regular file too."""
    from gpufeed.core.safefs import read_set_file, read_user_file

    try:
        if set_root is not None:
            raw = read_set_file(path, set_root, MAX_CLASS_MAP_BYTES, what="class list")
        else:
            raw = read_user_file(path, MAX_CLASS_MAP_BYTES, what="class list")
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise DataError(f"{path} is not UTF-8 text") from None
    except OSError as exc:
        raise DataError(f"cannot read class list {path} ({exc.strerror or exc})") from None
    if len(text) > MAX_CLASS_MAP_BYTES:
        raise DataError(f"{path} is larger than {MAX_CLASS_MAP_BYTES >> 20} MiB; it is not a class list")
    names = class_lines(text)
    if not names:
        raise DataError(f"{path} lists no class name; write one name per line")
    if len(names) > MAX_CLASSES:
        raise DataError(f"{path} lists {len(names):,} classes; a set has at most {MAX_CLASSES:,}")
    long = next((n for n in names if len(n.encode("utf-8")) > MAX_LABEL_BYTES), None)
    if long is not None:
        raise DataError(f"{path} names class {long[:40]!r}... longer than {MAX_LABEL_BYTES} bytes")
    dup = first_duplicate(names)
    if dup is not None:
        raise DataError(f"{path} lists class {dup[:80]!r} twice")
    return names


def _describe(label: str) -> str:
    """How messages name a label source: ``.cls``, ``.txt``, ``json:FIELD``."""
    return label if label.startswith("json:") else f".{label}"


def _classes(folder: Path, labels: set, label: str, classes_file: Path | None = None,
             hint: str = "", labelled: int | None = None) -> tuple[list[str], str]:
    """The class list and where it came from: ``classes_file``, else ``classes.txt`` next to the shards, else
    derived from the distinct label values (texts and JSON integers). ``hint`` ends the sentence that refuses
    a set without any label. An index label at or above :data:`MAX_CLASSES` (or below 0) is no class: it is left
    out here, so it counts as a bad label. Derived integer classes ``0..max`` are refused when ``max + 1`` is more
    than :func:`gpufeed.shardset.manifest.class_count_problem` allows for the ``labelled`` samples carrying a label."""
    what = _describe(label)
    texts = {x for x in labels if isinstance(x, str)}
    class_map = classes_file if classes_file is not None else folder / CLASS_MAP_NAME
    if classes_file is not None or os.path.lexists(class_map):
        names = read_class_list(class_map, None if classes_file is not None else folder)
        position = {c: i for i, c in enumerate(names)}
        for x in sorted(texts):  # read_label reads digits as an index: a class named "7" must be class 7
            if x.isascii() and x.isdigit() and x in position and position[x] != int(x):
                raise DataError(f"{class_map} names class {x!r} at index {position[x]}, but a {what} label {x!r} "
                                f"reads as class index {int(x)}; the label is ambiguous")
        return names, str(classes_file) if classes_file is not None else CLASS_MAP_NAME
    digits = {x for x in texts if x.isascii() and x.isdigit()}
    numbers = {str(x) for x in labels if isinstance(x, int) and 0 <= x < MAX_CLASSES} | {
        x for x in digits if len(x.lstrip("0")) <= len(str(MAX_CLASSES)) and int(x) < MAX_CLASSES}
    names = texts - digits
    if not numbers and not names:
        if digits or any(isinstance(x, int) for x in labels):
            raise DataError(f"no {what} label in {folder} is a class index below {MAX_CLASSES:,} or a class name, "
                            f"so there are no classes to train on")
        raise DataError(f"no sample in {folder} has a {what} label, so there are no classes to train on{hint}")
    if numbers and names:
        name = next(iter(sorted(names)))
        raise DataError(f"the {what} labels in {folder} mix class indices ({min(numbers, key=len)!r}) and class "
                        f"names ({name[:80]!r}), so an index cannot be told from a name; write the class names in "
                        f"order to {CLASS_MAP_NAME} next to the shards or pass them with --classes FILE")
    if numbers:
        top = max(int(x) for x in numbers)
        why = class_count_problem(top + 1, labelled if labelled is not None else len(numbers))
        if why:
            raise DataError(f"a {what} label in {folder} is {top}, so its classes would be 0..{top}: {why}; pass the "
                            f"class names with --classes FILE (or write {CLASS_MAP_NAME} next to the shards)")
        return [str(i) for i in range(top + 1)], f"integer {what}"
    return sorted(names), f"text {what}"


def _prefix_and_pattern(names: list[str]) -> tuple[str, str]:
    """The manifest's ``prefix`` and ``url_pattern``: for a contiguous run of equally wide numbers before the
    suffix, with any prefix or none (``train-000000.tar``, ``00000.tar`` as img2dataset names them,
    ``part_07.tgz``), the brace pattern (``{00000..00012}.tar``); otherwise an empty pattern."""
    parts = [re.fullmatch(r"(.*?)(\d+)(\.[^\d].*)", n) for n in names]
    if all(parts) and len({(m.group(1), m.group(3), len(m.group(2))) for m in parts}) == 1:
        nums = [int(m.group(2)) for m in parts]
        prefix = parts[0].group(1).rstrip("-_.")
        if nums == list(range(nums[0], nums[0] + len(nums))):
            m0, m1 = parts[0], parts[-1]
            pattern = names[0] if len(names) == 1 else f"{m0.group(1)}{{{m0.group(2)}..{m1.group(2)}}}{m0.group(3)}"
            return prefix, pattern
        return prefix, ""
    stem = names[0].split(".", 1)[0]
    return stem, names[0] if len(names) == 1 else ""


def _no_label_hint(label: str, members: set, unlabeled: Problems) -> str:
    """The end of the sentence refusing a set without labels: where its labels may be instead."""
    if label.startswith("json:") and "json" in members and unlabeled.examples:
        return f" (e.g. {unlabeled.examples[0]}); name a field it has with --label json:FIELD"
    others = [f"--label {e}" if e != "json" else "--label json:FIELD" for e in ("cls", "txt", "json")
              if e in members and e != label_member(label)]
    if others:
        return (f"; its samples have {', '.join('.' + e for e in sorted(members))} members: take the labels from "
                f"them with {' or '.join(others)}")
    return "; add label members, or take them from another member with --label cls|txt|json:FIELD"


def _locate(shards: str | Path, out: str | Path | None, remote: bool) -> tuple[list[Any], Path, Path]:
    """The shards (local paths, or a remote set's locations), the folder the manifest goes to and the folder
    ``classes.txt`` is looked up in: a local set's shard folder; for a remote set, which cannot be listed, DEST
    (``--out``, which it needs)."""
    if remote:
        if out is None:
            raise DataError(f"{shards}: a remote set's manifest is written to a local folder; add --out DIR")
        paths: list[Any] = resolve_remote_shards(str(shards))
        dest = Path(out).resolve()
        folder = dest  # classes.txt is looked up in DIR; the manifest has no root (readers pass the pattern)
    else:
        paths = resolve_shards(shards)
        folder = paths[0].resolve().parent
        dest = Path(out).resolve() if out is not None else folder
    return paths, dest, folder


def _check_replaceable(dest: Path) -> None:
    """Refuse (DataError) to write over a manifest in ``dest`` that ``gpufeed index`` did not write (a set of
    ``gpufeed shard``, an unreadable file): an index only replaces an index."""
    existing = manifest_path(dest)
    if existing.is_file():
        import json

        from gpufeed.core.safefs import read_set_file

        try:  # never read through a link out of DEST (its target's text would be quoted below)
            created_by = json.loads(read_set_file(existing, dest, 1 << 20, what="manifest", where="output folder")).get("created_by")
        except (OSError, ValueError, AttributeError, RecursionError, DataError):
            created_by = None
        if created_by != "gpufeed index":
            raise DataError(f"{existing} already exists (created by {str(created_by)[:80]!r}); it is not replaced "
                            f"by an index - choose another --out DIR")


def _scan_set(paths: list[Any], *, hash: bool, label: str, remote: bool,
              folder: Path) -> tuple[list[ShardInfo], ShardScan]:
    """Scan every shard (:func:`scan_shard`), in order: the manifest's entry for each, and what they hold together
    in one ShardScan (samples, ignored keys, labels and the first place of each, the label members met, each kind
    of problem; its sha256, bytes and keys stay unset). Raises DataError as soon as the shards hold more than
    MAX_CLASSES distinct labels."""
    infos: list[ShardInfo] = []
    sums = ShardScan()
    for p in paths:
        scan = scan_shard(p, hash=hash, label=label)
        sums.samples += scan.samples
        sums.ignored += scan.ignored
        sums.labels.update(scan.labels)
        if len(sums.labels) > MAX_CLASSES:
            raise DataError(f"the shards of {folder} hold more than {MAX_CLASSES:,} distinct labels ({label}); a set "
                            f"has at most {MAX_CLASSES:,} classes - is {label!r} where its labels are?")
        sums.label_members |= scan.label_members
        for value, where in scan.label_examples.items():
            sums.label_examples.setdefault(value, where)
        for mine, theirs in ((sums.unlabeled, scan.unlabeled), (sums.unreadable, scan.unreadable),
                             (sums.dropped, scan.dropped), (sums.duplicates, scan.duplicates),
                             (sums.ungrouped, scan.ungrouped)):
            mine.merge(theirs)
        infos.append(ShardInfo(name=source_name(p) if remote else p.name, num_samples=scan.samples,
                               bytes=scan.bytes if remote else p.stat().st_size, sha256=scan.sha256,
                               keys_sha256=scan.keys.hexdigest()))
    return infos, sums


def _bad_labels(sums: ShardScan, classes: list[str]) -> Problems:
    """The samples whose label the class list does not accept (the loader's rule, :func:`label_index`, decides),
    then those whose label member is no label at all (``sums.unreadable``)."""
    class_index = {c: i for i, c in enumerate(classes)}
    bad_labels = Problems()
    for value, n in sums.labels.items():
        try:
            label_index(value, classes, class_index)
        except LabelError as exc:
            bad_labels.add(f"{sums.label_examples[value]} ({exc})", n)
    bad_labels.merge(sums.unreadable)
    return bad_labels


def _write_set(dest: Path, manifest: Manifest, paths: list[Any], *, remote: bool, folder: Path,
               out: str | Path | None) -> tuple[Path, list[str]]:
    """Write the sidecar indexes of other readers (a local set's) and then, last, the manifest to ``dest``: the
    manifest's path and the notes on the sidecars not written. Raises DataError when ``dest`` cannot be written."""
    try:
        dest.mkdir(parents=True, exist_ok=True)
        if not os.access(dest, os.W_OK):
            raise PermissionError(f"{dest} is not writable")
        from gpufeed.shardset.sidecars import REMOTE_NOTE, write_sidecars

        notes = [REMOTE_NOTE] if remote else write_sidecars(
            str(dest), manifest.shards, [str(p.resolve()) for p in paths], prefix=manifest.prefix,
            num_classes=len(manifest.classes), compression=manifest.compression, name=folder.name or "gpufeed",
            created_by="gpufeed index")
        written = write_manifest(dest, manifest)  # last, after the sidecar indexes
    except OSError as exc:
        hint = "" if out is not None else "; write it elsewhere with --out DIR"
        raise DataError(f"cannot write {dest / MANIFEST_NAME} ({exc.strerror or exc}){hint}") from None
    return written, notes


def index_shards(shards: str | Path, *, out: str | Path | None = None, hash: bool = True,
                 label: str = DEFAULT_LABEL_SOURCE, classes_file: str | Path | None = None) -> IndexReport:
    """Scan foreign shards and write ``manifest.json`` to ``out`` (default: the shard folder), labels taken
    from ``label`` (``cls``, ``txt``, ``json:FIELD``) and classes from ``classes_file`` when given."""
    from gpufeed import __version__

    why = label_source_problem(label)
    if why:
        raise DataError(f"--label {str(label)[:80]!r} is refused: {why}")
    remote = is_remote(shards)
    paths, dest, folder = _locate(shards, out, remote)
    _check_replaceable(dest)
    compression = _compression(paths)
    infos, sums = _scan_set(paths, hash=hash, label=label, remote=remote, folder=folder)
    total, ignored, unlabeled = sums.samples, sums.ignored, sums.unlabeled
    if total == 0:
        raise DataError(f"{shards}: no sample with an image member ({', '.join(READ_IMAGE_EXTENSIONS)}) in "
                        f"{len(paths)} shard(s)")
    classes, class_source = _classes(folder, set(sums.labels), label,
                                     None if classes_file is None else Path(classes_file),
                                     hint=_no_label_hint(label, sums.label_members, unlabeled),
                                     labelled=sum(sums.labels.values()))
    bad_labels = _bad_labels(sums, classes)
    prefix, pattern = _prefix_and_pattern([i.name for i in infos])
    records = None if remote else read_records(folder, {i.name: i.num_samples for i in infos})
    total_bytes = sum(i.bytes for i in infos)
    manifest = Manifest(
        prefix=prefix, classes=classes, shards=infos, num_samples=total, total_bytes=total_bytes,
        mean_sample_bytes=total_bytes / total, url_pattern=pattern,
        options={"source": redact(str(shards)), "hashed": hash, "class_source": class_source,
                 "num_unlabeled": unlabeled.count, "num_ignored_keys": ignored},
        created_by="gpufeed index", gpufeed_version=__version__, compression=compression,
        root=None if remote or dest == folder else str(folder), label=label,
    )
    Manifest.from_dict(manifest.to_dict(), where=f"the manifest for {folder}")  # never write what readers refuse
    written, notes = _write_set(dest, manifest, paths, remote=remote, folder=folder, out=out)
    dropped, duplicates, ungrouped = sums.dropped, sums.duplicates, sums.ungrouped
    return IndexReport(
        manifest_path=str(written), shard_folder=redact(str(shards)) if remote else str(folder), num_shards=len(paths),
        num_samples=total, num_classes=len(classes), num_unlabeled=unlabeled.count, num_ignored_keys=ignored,
        total_bytes=total_bytes, compression=compression, hashed=hash, class_source=class_source,
        classes_preview=classes[:10],
        unlabeled=unlabeled.examples, num_bad_labels=bad_labels.count, bad_labels=bad_labels.examples,
        num_dropped_images=dropped.count, dropped_images=dropped.examples,
        num_duplicate_members=duplicates.count, duplicate_members=duplicates.examples,
        num_ungrouped_keys=ungrouped.count, ungrouped_keys=ungrouped.examples, label=label, notes=notes,
        ok=not (unlabeled.count or bad_labels.count or dropped.count or duplicates.count or ungrouped.count
                or (records is not None and (records.num_unreadable or records.num_mismatched))),
        img2dataset=records,
    )


def _line(what: str, count: int, examples: list[str]) -> str:
    more = f" and {count - len(examples)} more" if count > len(examples) else ""
    return f"error: {count} {what}: {'; '.join(examples)}{more}"


def render(report: IndexReport) -> str:
    """Summary, manifest path, then one line per kind of problem (count and first examples)."""
    r = report
    i2d_summary, i2d_errors = render_lines(r.img2dataset) if r.img2dataset is not None else ([], [])
    lines = [
        f"indexed {r.num_shards} shard(s) in {r.shard_folder}: {r.num_samples} samples, "
        f"{r.num_classes} classes ({r.class_source}), labels from {_describe(r.label)}, {r.total_bytes / 1e6:.1f} MB"
        + (f", {r.compression}" if r.compression else "")
        + ("" if r.hashed else ", no sha256 (--no-hash)"),
        *i2d_summary,
        f"manifest: {r.manifest_path}",
    ]
    if r.num_ignored_keys:
        lines.append(f"ignored {r.num_ignored_keys} key(s) without an image member")
    lines += [f"note: {n}" for n in r.notes]
    for what, count, examples in (
        (f"sample(s) have no {_describe(r.label)} label; the loader will reject them", r.num_unlabeled, r.unlabeled),
        ("sample(s) have a label the loader rejects", r.num_bad_labels, r.bad_labels),
        ("image member(s) that no reader sees", r.num_dropped_images, r.dropped_images),
        ("member(s) a sample holds twice (readers keep only one)", r.num_duplicate_members, r.duplicate_members),
        (f"key(s) that come back after other keys (readers take them as more samples; {UNGROUPED_FIX})",
         r.num_ungrouped_keys, r.ungrouped_keys),
    ):
        if count:
            lines.append(_line(what, count, examples))
    lines.extend(i2d_errors)
    return "\n".join(lines)
