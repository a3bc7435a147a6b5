"""The shard-set schema: manifest, index table, labels and shard names (docs/design.md §2).

A shard set is a folder holding ``PREFIX-NNNNNN.tar`` shards, ``index.parquet`` (one row per sample)
and ``manifest.json``, written last and atomically: its presence means the set is complete.

``gpufeed shard`` writes all three; ``gpufeed index`` writes a manifest for shards made by other tools.
Readers (loader, tune, train, verify) only need :func:`read_manifest`. The members inside the shards (key
rule, extensions, grouping) and the tar layer are :mod:`gpufeed.shardset`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.core.records import read_file_bytes, write_json
from gpufeed.core.world import node_shards

FORMAT_NAME = "gpufeed-shards"
FORMAT_VERSION = 2
"""The newest format this gpufeed reads (and refuses anything newer). 2 added ``label``: a manifest whose label
source is not ``cls`` is written as version 2, so a reader from before the field refuses it instead of labelling
by ``.cls``; a ``.cls`` set's manifest is still written as version 1, byte for byte as before."""
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.parquet"
TIMM_INFO_NAME = "_info.json"
DEFAULT_LABEL_SOURCE = "cls"
"""The label source of a manifest without ``label``: the ``.cls`` member (:func:`read_label`)."""

INDEX_TYPES = {"key": "string", "shard": "string", "class": "string", "label": "int64", "source": "string",
               "bytes": "int64", "width": "int32", "height": "int32"}
"""index.parquet columns and their pyarrow types: key, shard (file name), class, label, source (path relative to
SRC), bytes (encoded image bytes as stored), width, height (stored image)."""
INDEX_COLUMNS = tuple(INDEX_TYPES)
INDEX_DICTIONARY_COLUMNS = ("shard", "class")
"""The index columns written dictionary-encoded (few distinct values); ``key`` and ``source`` are unique, where a
dictionary only costs: half the write time of 100k rows, and a smaller file."""


def index_table(columns: dict[str, Any]) -> Any:
    """The ``index.parquet`` table (a ``pyarrow.Table`` with :data:`INDEX_TYPES`) from one list or Arrow array per
    column.
    Raises ValueError when the columns are not exactly :data:`INDEX_COLUMNS` or differ in length."""
    import pyarrow as pa

    if tuple(columns) != INDEX_COLUMNS:
        raise ValueError(f"index columns are {tuple(columns)}, expected {INDEX_COLUMNS}")
    if len({len(v) for v in columns.values()}) > 1:
        raise ValueError("index columns differ in length")
    schema = pa.schema([(c, getattr(pa, t)()) for c, t in INDEX_TYPES.items()])

    def column(c: str) -> Any:
        v, t = columns[c], schema.field(c).type
        return v.cast(t) if isinstance(v, (pa.Array, pa.ChunkedArray)) else pa.array(v, t)

    return pa.table({c: column(c) for c in INDEX_COLUMNS}, schema=schema)


@dataclass(frozen=True)
class ShardInfo:
    name: str
    """File name relative to the manifest's folder, e.g. ``train-000003.tar``."""
    num_samples: int
    bytes: int
    """Size of the shard file."""
    sha256: str | None
    """Hex digest of the whole shard file (None only for a foreign set indexed with --no-hash)."""
    keys_sha256: str | None = None
    """Optional: the digest of the shard's key sequence (:class:`gpufeed.shardset.keys.KeyDigest`), which the
    loader compares as it reads the shard; None in manifests written before the field (not checked then)."""


@dataclass(frozen=True)
class Manifest:
    prefix: str
    classes: list[str]
    """Class names; the list index is the label."""
    shards: list[ShardInfo]
    num_samples: int
    num_rejected: int = 0
    total_bytes: int = 0
    """Sum of shard file sizes."""
    mean_sample_bytes: float = 0.0
    """total_bytes / num_samples: what a reader moves per sample."""
    url_pattern: str = ""
    """Brace pattern over the shards, e.g. ``train-{000000..000127}.tar``."""
    options: dict[str, Any] = field(default_factory=dict)
    """The options the set was written with (seed, sizes, re-encoding, check)."""
    created_by: str = "gpufeed shard"
    gpufeed_version: str = ""
    format: str = FORMAT_NAME
    format_version: int = 1
    """The version this manifest needs (:meth:`to_dict` writes the lowest one that reads it right)."""
    compression: str | None = None
    """None for plain tar; 'gzip' for .tgz/.tar.gz shards (foreign sets)."""
    root: str | None = None
    """Folder holding the shards, absolute or relative to the manifest's folder; None = the manifest's folder."""
    label: str = DEFAULT_LABEL_SOURCE
    """Where each sample's label is (:func:`read_label`): ``cls``, ``txt`` or ``json:FIELD``; written to the
    manifest only when it is not ``cls``."""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def shard_paths(self, root: str | Path) -> list[Path]:
        root = Path(root)
        return [root / s.name for s in self.shards]

    def to_dict(self) -> dict[str, Any]:
        from gpufeed.core.records import to_jsonable

        d = to_jsonable(self)
        d["num_classes"] = self.num_classes
        for s in d["shards"]:  # optional: a manifest without key digests stays as it was before the field
            if s.get("keys_sha256") is None:
                s.pop("keys_sha256", None)
        if self.label == DEFAULT_LABEL_SOURCE:  # optional: a .cls set's manifest stays as it was before the field
            del d["label"]
            d["format_version"] = 1
        else:  # readers from before `label` must refuse the set, not label it by .cls members it may also hold
            d["format_version"] = 2
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> "Manifest":
        """Build a manifest from untrusted JSON, checking every field: types, bounds, shard names, the root
        folder, the classes, the label source and that the per-shard counts add up. Raises DataError (one sentence)."""
        if not isinstance(d, dict):
            raise DataError(f"{where}: a manifest is a JSON object")
        if d.get("format") != FORMAT_NAME:
            raise DataError(f"{where}: format is {str(d.get('format'))[:80]!r}, expected {FORMAT_NAME!r}")
        version = _count(d, "format_version", where, 2 ** 31, default=FORMAT_VERSION)
        if version > FORMAT_VERSION:
            raise DataError(f"{where}: format_version {version} is newer than this gpufeed reads "
                            f"({FORMAT_VERSION}); upgrade gpufeed")
        raw_shards = d.get("shards")
        if not isinstance(raw_shards, list) or not raw_shards:
            raise DataError(f"{where}: shards must be a non-empty list")
        if len(raw_shards) > MAX_SHARDS:
            raise DataError(f"{where}: {len(raw_shards)} shards; a manifest lists at most {MAX_SHARDS}")
        shards = []
        names: set[str] = set()
        for i, s in enumerate(raw_shards):
            shards.append(_shard_info(i, s, names, where))
        num_samples = _count(d, "num_samples", where, MAX_NUM_SAMPLES)
        listed = sum(s.num_samples for s in shards)
        if listed != num_samples:
            raise DataError(f"{where}: num_samples is {num_samples} but the shards hold {listed}")
        classes = _checked_classes(d.get("classes"), where)
        root = d.get("root")
        if root is not None:
            why = root_problem(root)
            if why:
                raise DataError(f"{where}: root {str(root)[:80]!r} is refused: {why}")
        compression = d.get("compression")
        if compression not in (None, "gzip"):
            raise DataError(f"{where}: compression is {str(compression)[:20]!r}, expected null or 'gzip'")
        label = d.get("label", DEFAULT_LABEL_SOURCE)
        if label_source_problem(label):
            raise DataError(f"{where}: label source {str(label)[:80]!r} is not one this gpufeed reads (cls, txt or "
                            f"json:FIELD); upgrade gpufeed, or index the shards again with a --label it reads")
        options = d.get("options", {})
        if not isinstance(options, dict):
            raise DataError(f"{where}: options must be an object")
        mean = d.get("mean_sample_bytes", 0.0)
        if isinstance(mean, bool) or not isinstance(mean, (int, float)) or not 0 <= mean <= MAX_SHARD_BYTES:
            raise DataError(f"{where}: mean_sample_bytes must be a number in 0..{MAX_SHARD_BYTES}")
        strings = {}
        for key in ("prefix", "url_pattern", "created_by", "gpufeed_version"):
            value = d.get(key, "")
            if not isinstance(value, str):
                raise DataError(f"{where}: {key} must be a string")
            strings[key] = value
        for info in shards:  # last: every other field is checked first
            samples_bytes_problem(info, compression == "gzip", where)
        return cls(
            prefix=strings["prefix"], classes=list(classes), shards=shards, num_samples=num_samples,
            num_rejected=_count(d, "num_rejected", where, MAX_NUM_SAMPLES, default=0),
            total_bytes=_count(d, "total_bytes", where, MAX_NUM_SAMPLES * MAX_SHARD_BYTES, default=0),
            mean_sample_bytes=float(mean), url_pattern=strings["url_pattern"], options=options,
            created_by=strings["created_by"], gpufeed_version=strings["gpufeed_version"], format=FORMAT_NAME,
            format_version=version, compression=compression, root=root, label=label,
        )


MAX_MANIFEST_BYTES = 256 << 20
"""A ``manifest.json`` larger than this (256 MiB) is refused before it is parsed (10 M shards fit)."""
MAX_SHARDS = 10_000_000
"""Most shards a manifest may list."""
MAX_NUM_SAMPLES = 2 ** 40
"""Most samples a manifest (or one shard of it) may count."""
MAX_SHARD_BYTES = 2 ** 44
"""Largest shard file size (16 TiB) a manifest may record."""
MAX_CLASSES = 10_000_000
"""Most classes a manifest may list."""
CLASS_ALLOWANCE = 65_536
"""Classes any set may have whatever its sample count; more classes than that need as many samples (a class list
far larger than the samples carrying its labels is one bad label away from a huge model head)."""
MAX_SHARD_NAME_BYTES = 255
"""Longest shard file name in UTF-8 bytes (the usual file-system limit)."""
MAX_ROOT_CHARS = 4096
"""Longest ``root`` folder a manifest may name (PATH_MAX)."""
SHARD_SUFFIXES = (".tar", ".tgz", ".tar.gz")
"""File name endings of shard files (plain or gzip-compressed tar)."""
URL_SYNTAX = frozenset(':/\\{}[]*?#|;&$<>`\'"')
"""Characters refused in shard names: path separators, URL scheme and query syntax (``pipe:``, ``s3://``,
``?``, ``#``), webdataset's brace expansion, glob and shell syntax. A shard name is a plain local file name."""
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:")


MIN_SAMPLE_TAR_BYTES = 512
"""The fewest tar bytes a sample takes: the header of its image member (its data, its label, the archive's end
blocks add more)."""
MAX_GZIP_RATIO = 1032
"""The most bytes deflate expands one compressed byte to (RFC 1951's longest match per shortest code)."""


def samples_bytes_problem(info: ShardInfo, gzip: bool, where: str) -> None:
    """Refuse (DataError) a shard whose claimed sample count cannot fit in its claimed bytes (a plain tar holds at
    most ``bytes / 512`` samples, a gzip one ``1032 x`` that): counts derived from it (the class bound, the model
    head, the epoch's length) are then bounded by the bytes, which the loader checks against the file."""
    tar_bytes = info.bytes * MAX_GZIP_RATIO + 1024 if gzip or info.name.endswith((".tgz", ".tar.gz")) else info.bytes
    if info.num_samples * MIN_SAMPLE_TAR_BYTES > tar_bytes:
        raise DataError(f"{where}: shard {info.name!r} claims {info.num_samples} samples in {info.bytes} bytes; a "
                        f"sample takes at least {MIN_SAMPLE_TAR_BYTES} bytes of tar")


def class_count_problem(num_classes: int, num_samples: int) -> str | None:
    """Why ``num_classes`` classes are absurd for a set of ``num_samples`` (labelled) samples, None when they are
    not: at most :data:`MAX_CLASSES`, and more than :data:`CLASS_ALLOWANCE` only with as many samples."""
    if num_classes > MAX_CLASSES:
        return f"{num_classes:,} classes are more than the {MAX_CLASSES:,} a set may have"
    if num_classes > max(CLASS_ALLOWANCE, num_samples):
        return (f"{num_classes:,} classes for {num_samples:,} samples; a set has at most {CLASS_ALLOWANCE:,} "
                f"classes or one per sample")
    return None


def shard_name_problem(name: str) -> str | None:
    """Why ``name`` is not a plain local shard file name (None when it is one).

    Shard names come from directory listings and manifests, never from the user, so they must never reach a
    URL opener or a shell as anything but a file name: no URL or shell syntax, no path, no control character.
    """
    if name in ("", ".", ".."):
        return "it is not a file name"
    if len(name.encode("utf-8", "surrogatepass")) > MAX_SHARD_NAME_BYTES:
        return f"it is longer than {MAX_SHARD_NAME_BYTES} bytes"
    bad = sorted({c for c in name if c in URL_SYNTAX or ord(c) < 32 or ord(c) == 127})
    if bad:
        return (f"it holds {', '.join(repr(c) for c in bad)} (URL, path, shell or control characters); shard names "
                f"are plain file names")
    if name[0] in "-~ " or name[-1] == " ":
        return "it starts with '-', '~' or a space, or ends with a space"
    if not name.endswith(SHARD_SUFFIXES):
        return f"it does not end in {', '.join(SHARD_SUFFIXES)}"
    return None


def root_problem(root: object) -> str | None:
    """Why a manifest's ``root`` is not a local folder path (None when it is one): a string path, absolute or
    relative to the manifest's folder, without a URL scheme (``pipe:``, ``s3://``), brace pattern or control
    characters."""
    if not isinstance(root, str) or not root:
        return "it is not a folder path"
    if len(root) > MAX_ROOT_CHARS:
        return f"it is longer than {MAX_ROOT_CHARS} characters"
    if any(ord(c) < 32 or ord(c) == 127 for c in root):
        return "it holds control characters"
    if _SCHEME.match(root) or root[0] in "|-":
        return "it looks like a URL or a command, not a local folder"
    if "{" in root or "}" in root:
        return "it holds brace-pattern syntax ('{', '}')"
    return None


def _count(d: dict[str, Any], key: str, where: str, limit: int, default: int | None = None) -> int:
    value = d.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= limit:
        raise DataError(f"{where}: {key} must be an integer in 0..{limit}, got {str(value)[:40]}")
    return value


def _shard_info(i: int, s: object, names: set[str], where: str) -> ShardInfo:
    """One entry of a manifest's ``shards`` (the ``i``-th), checked: an object with a plain shard file name not in
    ``names`` (the names before it; this one is added), hex digests and bounded counts. Raises DataError."""
    if not isinstance(s, dict):
        raise DataError(f"{where}: shards[{i}] is not an object")
    name = s.get("name")
    if not isinstance(name, str):
        raise DataError(f"{where}: shards[{i}] has no name")
    why = shard_name_problem(name)
    if why:
        raise DataError(f"{where}: shard name {name[:80]!r} is refused: {why}")
    if name in names:
        raise DataError(f"{where}: shard {name!r} is listed twice")
    names.add(name)
    sha = s.get("sha256")
    if sha is not None and not (isinstance(sha, str) and re.fullmatch(r"[0-9a-f]{64}", sha)):
        raise DataError(f"{where}: shard {name!r} has a sha256 that is not 64 lower-case hex digits")
    keys_sha = s.get("keys_sha256")
    if keys_sha is not None and not (isinstance(keys_sha, str) and re.fullmatch(r"[0-9a-f]{64}", keys_sha)):
        raise DataError(f"{where}: shard {name!r} has a keys_sha256 that is not 64 lower-case hex digits")
    return ShardInfo(name=name, num_samples=_count(s, "num_samples", f"{where}: shard {name!r}", MAX_NUM_SAMPLES),
                     bytes=_count(s, "bytes", f"{where}: shard {name!r}", MAX_SHARD_BYTES),
                     sha256=sha, keys_sha256=keys_sha)


def _checked_classes(classes: object, where: str) -> list[Any]:
    """A manifest's ``classes``, checked: a non-empty list of at most MAX_CLASSES distinct class names, each a
    non-empty string of at most MAX_LABEL_BYTES. Raises DataError."""
    if not isinstance(classes, list) or not classes:
        raise DataError(f"{where}: classes must be a non-empty list of class names (a label needs a class)")
    if len(classes) > MAX_CLASSES:
        raise DataError(f"{where}: {len(classes)} classes; a manifest lists at most {MAX_CLASSES}")
    for c in classes:
        if not isinstance(c, str) or not c or len(c.encode("utf-8", "surrogatepass")) > MAX_LABEL_BYTES:
            raise DataError(f"{where}: class {str(c)[:80]!r} is not a class name (a non-empty string of at most "
                            f"{MAX_LABEL_BYTES} bytes)")
    dup = first_duplicate(classes)
    if dup is not None:
        raise DataError(f"{where}: class {dup[:80]!r} is listed twice")
    return classes


MAX_LABEL_BYTES = 1024
"""A label member (``.cls``, ``.txt``) or a JSON label string longer than this is not a label (a class name or a
decimal index is short)."""
MAX_LABEL_JSON_BYTES = 64 << 10
"""A ``.json`` member larger than this (64 KiB) is not read for a label (``--label json:FIELD``)."""
MAX_LABEL_FIELD_CHARS = 64
"""Longest FIELD of a ``json:FIELD`` label source."""
_LABEL_FIELD = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_-]*")


class LabelError(ValueError):
    """A sample without a label of the set: no label member, an unreadable one, or a label the classes refuse."""


class MissingLabel(LabelError):
    """A sample without its label member (or, for ``json:FIELD``, without FIELD in its ``.json`` member)."""


def label_source_problem(source: object) -> str | None:
    """Why ``source`` is not a label source this gpufeed reads (None when it is one): ``"cls"`` (the ``.cls``
    member), ``"txt"`` (the ``.txt`` member) or ``"json:FIELD"`` (FIELD of the ``.json`` member's object), where
    FIELD is a plain key (letters, digits, ``_`` and ``-``, not starting with ``-``) of at most
    :data:`MAX_LABEL_FIELD_CHARS` characters."""
    if source in ("cls", "txt"):
        return None
    if not isinstance(source, str) or not source.startswith("json:"):
        return "label sources are cls, txt or json:FIELD"
    name = source[5:]
    if not name or len(name) > MAX_LABEL_FIELD_CHARS or not _LABEL_FIELD.fullmatch(name):
        return (f"FIELD of json:FIELD must be 1..{MAX_LABEL_FIELD_CHARS} letters, digits, '_' or '-' (a top-level "
                f"key of the .json member)")
    return None


def label_member(source: str) -> str:
    """The member extension a label source reads: ``cls``, ``txt`` or ``json``."""
    return "json" if source.startswith("json:") else source


def label_member_bytes(source: str) -> int:
    """The largest label member ``source`` reads: :data:`MAX_LABEL_JSON_BYTES` for a ``.json`` member,
    :data:`MAX_LABEL_BYTES` otherwise."""
    return MAX_LABEL_JSON_BYTES if source.startswith("json:") else MAX_LABEL_BYTES


def _label_text(raw: bytes, member: str) -> str:
    if len(raw) > MAX_LABEL_BYTES:
        raise LabelError(f".{member} member is {len(raw)} bytes; a label is at most {MAX_LABEL_BYTES}")
    try:
        return raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise LabelError(f".{member} member is not UTF-8 text") from None


def label_index(value: str | int, classes: list[str] | tuple[str, ...],
                class_index: dict[str, int] | None = None) -> int:
    """A label value's class index: an int, or a text of ASCII digits, is an index in ``0..C-1``; any other
    text must be one of ``classes``. Raises LabelError."""
    n = len(classes)
    if isinstance(value, str) and value.isascii() and value.isdigit():
        value = int(value)
    if isinstance(value, int):
        if not 0 <= value < n:
            text = str(value) if abs(value) < 10 ** 40 else f"{str(value)[:20]}..."
            raise LabelError(f"label {text} is outside 0..{n - 1}" if n else f"label {text}: the set has no classes")
        return value
    index = class_index if class_index is not None else {c: i for i, c in enumerate(classes)}
    if value not in index:
        raise LabelError(f"label {value[:80]!r} is neither a class index nor a class of the manifest")
    return index[value]


def parse_label(raw: bytes | None, classes: list[str] | tuple[str, ...],
                class_index: dict[str, int] | None = None, member: str = "cls") -> int:
    """The one label rule of every reader (loader, verify, index): a label member (``.cls``, or ``.txt`` named by
    ``member``) holds either a decimal class index in ``0..C-1`` or one of the manifest's class names (UTF-8, at
    most :data:`MAX_LABEL_BYTES`, surrounding white space ignored).

    ``class_index`` (name -> index) may be passed to avoid rebuilding it per sample. Raises LabelError
    (MissingLabel when ``raw`` is None).
    """
    if raw is None:
        raise MissingLabel(f"no .{member} label member")
    return label_index(_label_text(raw, member), classes, class_index)


def label_value(members: dict[str, Any], source: str) -> str | int:
    """The raw label of a sample (``members``: extension -> bytes) as ``source`` names it, not yet mapped to a
    class: the stripped text of the ``.cls`` or ``.txt`` member, or the FIELD value of the ``.json`` member's
    object (a stripped string or an int). A member present with None data is one its reader skipped as over
    :func:`label_member_bytes`. Raises MissingLabel when the member (or FIELD) is absent, LabelError when it is
    not a label: too large, not UTF-8, not a JSON object, or a FIELD value that is neither a string nor an int.
    """
    ext = label_member(source)
    if ext not in members:
        raise MissingLabel(f"no .{ext} member" if ext == "json" else f"no .{ext} label member")
    raw = members[ext]
    bound = label_member_bytes(source)
    if raw is None or len(raw) > bound:
        size = "" if raw is None else f" ({len(raw)} bytes)"
        raise LabelError(f".{ext} member is over {bound} bytes{size}; it is not read for a label")
    if ext != "json":
        return _label_text(raw, ext)
    name = source[5:]
    try:
        obj = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise LabelError(f".json member is not UTF-8 JSON ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise LabelError(f".json member is not a JSON object, so it has no field {name!r}")
    if name not in obj:
        fields = [str(k)[:40] for k in list(obj)[:8]]
        more = ", ..." if len(obj) > 8 else ""
        raise MissingLabel(f"no field {name!r} in its .json member (its fields: {', '.join(fields) or 'none'}{more})")
    value = obj[name]
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise LabelError(f"field {name!r} of the .json member is {type(value).__name__} {str(value)[:40]}, not a "
                         f"class index (an integer) or a class name (a string)")
    if isinstance(value, str):
        try:
            encoded = value.encode("utf-8")
        except UnicodeEncodeError:
            raise LabelError(f"field {name!r} of the .json member is not UTF-8 text") from None
        if len(encoded) > MAX_LABEL_BYTES:
            raise LabelError(f"field {name!r} of the .json member is {len(encoded)} bytes; a label is at most "
                             f"{MAX_LABEL_BYTES}")
        value = value.strip()
    return value


def read_label(members: dict[str, Any], source: str, classes: list[str] | tuple[str, ...],
               class_index: dict[str, int] | None = None) -> int:
    """A sample's class index, its label taken where the manifest's label ``source`` says (``cls``, ``txt``,
    ``json:FIELD``; :func:`label_value`) and mapped to ``classes`` by the rule of :func:`parse_label`
    (:func:`label_index`). Every reader (loader, verify) labels samples with it. Raises LabelError."""
    return label_index(label_value(members, source), classes, class_index)


def brace_pattern(names: list[str]) -> str:
    """``train-000000.tar … train-000127.tar`` -> ``train-{000000..000127}.tar`` (webdataset/braceexpand syntax)."""
    if not names:
        return ""
    if len(names) == 1:
        return names[0]
    first, last = names[0], names[-1]
    prefix, suffix = first.rsplit("-", 1)[0], "." + first.split(".", 1)[1]
    a = first[len(prefix) + 1: -len(suffix)]
    b = last[len(prefix) + 1: -len(suffix)]
    return f"{prefix}-{{{a}..{b}}}{suffix}"


def manifest_path(shards: str | Path) -> Path:
    """Accept a shard-set folder or a manifest.json path."""
    p = Path(shards)
    return p if p.name.endswith(".json") and p.is_file() else p / MANIFEST_NAME


def shard_root(m: Manifest, location: str | Path) -> Path:
    """The local folder that holds the shards of the set whose manifest ``m`` was read from ``location`` (its folder
    or manifest.json, as :func:`manifest_path` takes it): the manifest's folder, joined with its ``root`` when it
    names one. The one rule of where a local set's shards are."""
    here = manifest_path(location).parent
    return here / m.root if m.root else here


def first_duplicate(items: list[str]) -> str | None:
    """The first item that appeared before, in one pass (lists from data can hold millions of names)."""
    seen: set[str] = set()
    for item in items:
        if item in seen:
            return item
        seen.add(item)
    return None


MAX_MANIFEST_DEPTH = 64
"""Deepest nesting of objects and lists a manifest may hold (a valid one nests 3 deep, its ``options`` a few
more); counted before parsing, so no reader or writer of a manifest ever recurses deeper."""
MANIFEST_BYTES_PER_CONTAINER = 32
"""A manifest holds at most one object or list per this many bytes (plus :data:`MANIFEST_FREE_VALUES`): a shard
record, the smallest container of a valid manifest, is over 40 bytes; ``{},{},...`` would cost ~27 bytes of
memory per byte read."""
MANIFEST_BYTES_PER_VALUE = 8
"""A manifest holds at most one value (list item or object entry) per this many bytes (plus
:data:`MANIFEST_FREE_VALUES`): gpufeed writes one per indented line."""
MANIFEST_FREE_VALUES = 65_536
"""Containers and values any manifest may hold whatever its size (a small set's compact class list)."""
_JSON_STRING = re.compile(rb'"[^"]*"')
_NOT_STRUCTURE = bytes(b for b in range(256) if b not in b'"{}[],')
_INNERMOST = re.compile(rb"\[\]|\{\}")


def json_structure_problem(raw: bytes, *, depth: int = MAX_MANIFEST_DEPTH,
                           bytes_per_container: int = MANIFEST_BYTES_PER_CONTAINER,
                           bytes_per_value: int = MANIFEST_BYTES_PER_VALUE,
                           free: int = MANIFEST_FREE_VALUES) -> str | None:
    """Why the JSON text ``raw`` holds more structure than a manifest of its size may (None when it does not),
    found before it is parsed, at C speed: strings are cut out (a compiled pattern), what remains is reduced to
    its brackets and commas, which are counted, and innermost pairs are removed pass by pass, at most ``depth``
    passes. Text that is not JSON is left for the parser to refuse."""
    # escapes first (left to right, as JSON reads them), so every '"' left opens or closes a string; then only
    # quotes, brackets and commas are kept, and the strings (now empty or holding brackets) cut out
    rest = raw.replace(b"\\\\", b"").replace(b'\\"', b"").translate(None, _NOT_STRUCTURE)
    rest = _JSON_STRING.sub(b"", rest)
    containers = rest.count(b"{") + rest.count(b"[")
    if containers > free + len(raw) // bytes_per_container:
        return (f"it holds {containers:,} objects and lists in {len(raw):,} bytes; a manifest holds at most one per "
                f"{bytes_per_container} bytes")
    values = rest.count(b",") + containers
    if values > free + len(raw) // bytes_per_value:
        return (f"it holds {values:,} values in {len(raw):,} bytes; a manifest holds at most one per "
                f"{bytes_per_value} bytes")
    rest = rest.translate(None, b",")
    for _ in range(depth):
        if not rest:
            return None
        shorter = _INNERMOST.sub(b"", rest)
        if len(shorter) == len(rest):
            return None  # unbalanced: not JSON, which the parser says
        rest = shorter
    if rest and len(_INNERMOST.sub(b"", rest)) < len(rest):
        return f"its objects and lists nest deeper than {depth} levels"
    return None


def parse_manifest(raw: bytes, where: str) -> Manifest:
    """The checked manifest in the bytes ``raw`` (read from ``where``, at most :data:`MAX_MANIFEST_BYTES`): its
    structure bounded (:func:`json_structure_problem`) before it is parsed, then every field checked
    (:meth:`Manifest.from_dict`). Every manifest reader, local or remote, calls it. Raises DataError."""
    if len(raw) > MAX_MANIFEST_BYTES:
        raise DataError(f"{where} is larger than {MAX_MANIFEST_BYTES >> 20} MiB; it is not a manifest")
    why = json_structure_problem(raw)
    if why:
        raise DataError(f"{where} is refused as a manifest: {why}")
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise DataError(f"{where} is not readable JSON, so not a manifest ({str(exc)[:160]})") from None
    return Manifest.from_dict(data, where=where)


def read_manifest(shards: str | Path) -> Manifest:
    """Load and check a shard set's manifest. Raises DataError with a fix when it is missing or bad."""
    path = manifest_path(shards)
    if not path.parent.exists():
        raise DataError(f"shard folder {path.parent} does not exist")
    if not path.exists():
        raise DataError(
            f"{path.parent} has no {MANIFEST_NAME}: the shard set is incomplete or was not written by gpufeed "
            f"(for shards written by other tools, run `gpufeed index {path.parent}`)"
        )
    # found in a set folder, it is a file of the set (no link out of it); a manifest file the user named may be a link
    inside = path.parent if Path(shards).is_dir() else None
    return parse_manifest(read_file_bytes(path, MAX_MANIFEST_BYTES, "a manifest", set_root=inside), str(path))


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically (call this last: its presence means the set is complete). The contract
    (shard names, classes) is written as it is, since it is read back; ``options``, the record of how the set was
    made, has the passwords of its URLs hidden (:func:`gpufeed.core.redact.redact_obj`)."""
    from gpufeed.core.redact import redact_obj

    d = manifest.to_dict()
    if isinstance(d.get("options"), dict):
        d["options"] = redact_obj(d["options"])
    return write_json(Path(folder) / MANIFEST_NAME, d, redact=False)


STAGED_NODE = "staged_node"
"""The key of a node-staged DEST manifest's ``options`` that records the node (:func:`staged_node`)."""
def staged_node(m: Manifest, where: str = "manifest") -> tuple[int, int] | None:
    """``(node_rank, num_nodes)`` of a DEST staged for one node (its manifest's ``options["staged_node"]``), None
    for a whole set. The record is untrusted: a malformed one is a DataError (one sentence naming ``where``)."""
    rec = m.options.get(STAGED_NODE) if isinstance(m.options, dict) else None
    if rec is None:
        return None
    keys = ("node_rank", "num_nodes", "num_shards")
    if not isinstance(rec, dict) or set(rec) != set(keys) or any(type(rec[k]) is not int for k in keys):
        raise DataError(f"{where}: options.{STAGED_NODE} must be an object of the integers {', '.join(keys)}")
    n, N, k = rec["node_rank"], rec["num_nodes"], rec["num_shards"]
    if not (2 <= N <= len(m.shards) and 0 <= n < N) or k != len(node_shards(len(m.shards), n, N)):
        raise DataError(f"{where}: options.{STAGED_NODE} (node {n} of {N}, {k} shards) does not fit the manifest's "
                        f"{len(m.shards)} shards")
    return n, N
