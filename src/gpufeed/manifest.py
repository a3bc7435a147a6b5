"""The shard-set contract shared by every job (DESIGN §1).

A shard set is a folder holding ``PREFIX-NNNNNN.tar`` shards, ``index.parquet`` (one row per sample)
and ``manifest.json``, written last and atomically: its presence means the set is complete.

``gpufeed shard`` writes all three; ``gpufeed index`` writes a manifest for shards made by other tools.
Readers (loader, tune, train, verify) only need :func:`read_manifest`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.errors import DataError
from gpufeed.records import write_json

FORMAT_NAME = "gpufeed-shards"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
INDEX_NAME = "index.parquet"
TIMM_INFO_NAME = "_info.json"

IMAGE_EXTENSIONS = ("jpg", "png", "webp")
"""Member extensions gpufeed writes for images; the extension names the real encoded format."""
READ_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
"""Member extensions readers accept as images (other tools also write .jpeg)."""
LABEL_EXTENSION = "cls"
META_EXTENSION = "json"

INDEX_COLUMNS = ("key", "shard", "class", "label", "source", "bytes", "width", "height")
"""index.parquet columns: key (str), shard (str, file name), class (str), label (int64), source
(str, path relative to SRC), bytes (int64, encoded image bytes as stored), width, height (int32, stored image)."""


@dataclass(frozen=True)
class ShardInfo:
    name: str
    """File name relative to the manifest's folder, e.g. ``train-000003.tar``."""
    num_samples: int
    bytes: int
    """Size of the shard file."""
    sha256: str | None
    """Hex digest of the whole shard file (None only for a foreign set indexed with --no-hash)."""


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
    format_version: int = FORMAT_VERSION
    compression: str | None = None
    """None for plain tar; 'gzip' for .tgz/.tar.gz shards (foreign sets)."""
    root: str | None = None
    """Folder holding the shards, absolute or relative to the manifest's folder; None = the manifest's folder."""

    @property
    def num_classes(self) -> int:
        return len(self.classes)

    def shard_paths(self, root: str | Path) -> list[Path]:
        root = Path(root)
        return [root / s.name for s in self.shards]

    def to_dict(self) -> dict[str, Any]:
        from gpufeed.records import to_jsonable

        d = to_jsonable(self)
        d["num_classes"] = self.num_classes
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any], where: str = "manifest") -> "Manifest":
        try:
            if d.get("format") != FORMAT_NAME:
                raise DataError(f"{where}: format is {d.get('format')!r}, expected {FORMAT_NAME!r}")
            if int(d.get("format_version", 0)) > FORMAT_VERSION:
                raise DataError(
                    f"{where}: format_version {d['format_version']} is newer than this gpufeed reads "
                    f"({FORMAT_VERSION}); upgrade gpufeed"
                )
            shards = [ShardInfo(name=s["name"], num_samples=int(s["num_samples"]), bytes=int(s["bytes"]),
                                sha256=s.get("sha256")) for s in d["shards"]]
            for s in shards:
                if "/" in s.name or "\\" in s.name or s.name in ("", ".", ".."):
                    raise DataError(f"{where}: shard name {s.name!r} must be a plain file name in the set's folder")
            return cls(
                prefix=str(d["prefix"]),
                classes=[str(c) for c in d["classes"]],
                shards=shards,
                num_samples=int(d["num_samples"]),
                num_rejected=int(d.get("num_rejected", 0)),
                total_bytes=int(d.get("total_bytes", 0)),
                mean_sample_bytes=float(d.get("mean_sample_bytes", 0.0)),
                url_pattern=str(d.get("url_pattern", "")),
                options=dict(d.get("options", {})),
                created_by=str(d.get("created_by", "")),
                gpufeed_version=str(d.get("gpufeed_version", "")),
                format=str(d["format"]),
                format_version=int(d.get("format_version", FORMAT_VERSION)),
                compression=d.get("compression"),
                root=d.get("root"),
            )
        except DataError:
            raise
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(f"{where}: malformed manifest ({type(exc).__name__}: {exc})") from None


MAX_LABEL_BYTES = 1024
"""A ``.cls`` member longer than this is not a label (a class name or a decimal index is short)."""


class LabelError(ValueError):
    """A ``.cls`` member that is not a label of the set."""


def parse_label(raw: bytes | None, classes: list[str] | tuple[str, ...],
                class_index: dict[str, int] | None = None) -> int:
    """The one label rule of every reader (loader, verify, index): the ``.cls`` member holds either a decimal
    class index in ``0..C-1`` or one of the manifest's class names (UTF-8, surrounding white space ignored).

    ``class_index`` (name -> index) may be passed to avoid rebuilding it per sample. Raises LabelError.
    """
    if raw is None:
        raise LabelError("no .cls label member")
    if len(raw) > MAX_LABEL_BYTES:
        raise LabelError(f".cls member is {len(raw)} bytes; a label is at most {MAX_LABEL_BYTES}")
    try:
        text = raw.decode("utf-8").strip()
    except UnicodeDecodeError:
        raise LabelError(".cls member is not UTF-8 text") from None
    n = len(classes)
    if text.isascii() and text.isdigit():
        label = int(text)
        if not 0 <= label < n:
            raise LabelError(f"label {label} is outside 0..{n - 1}" if n else f"label {label}: the set has no classes")
        return label
    index = class_index if class_index is not None else {c: i for i, c in enumerate(classes)}
    if text not in index:
        raise LabelError(f"label {text[:80]!r} is neither a class index nor a class of the manifest")
    return index[text]


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
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise DataError(f"{path} is not readable JSON: {exc}") from None
    if not isinstance(data, dict):
        raise DataError(f"{path} is not a JSON object")
    return Manifest.from_dict(data, where=str(path))


def write_manifest(folder: str | Path, manifest: Manifest) -> Path:
    """Write ``manifest.json`` atomically (call this last: its presence means the set is complete)."""
    return write_json(Path(folder) / MANIFEST_NAME, manifest.to_dict())
