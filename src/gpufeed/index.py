"""``gpufeed index SHARDS``: the manifest for tar shards that gpufeed did not write.

Users often already have WebDataset shards (written by webdataset's ``TarWriter``/``ShardWriter``,
img2dataset, ...). This scans them the way the loader reads them (webdataset's key grouping, only
image members and ``.cls`` labels) and writes a :class:`gpufeed.manifest.Manifest` so that the loader,
``tune`` and ``verify`` work on them.

- SHARDS is a folder (its ``*.tar``, ``*.tgz``, ``*.tar.gz``), a glob, a brace pattern
  (``data-{000..009}.tar``) or one file. All shards must sit in one folder.
- A sample is a key with an image member (``manifest.READ_IMAGE_EXTENSIONS``); keys without one are
  not counted (the loader ignores them too). Samples without ``.cls`` are reported.
- Classes: a ``classes.txt`` (one name per line) next to the shards wins; otherwise integer labels give
  ``["0", ..., str(max)]`` (so label == index even with gaps), and text labels give their sorted distinct
  values (the loader maps each name to its index).
- The manifest goes to ``--out DIR`` (default: the shard folder). When DIR is not the shard folder, the
  manifest's ``root`` holds the shard folder's absolute path.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.errors import DataError
from gpufeed.manifest import (LABEL_EXTENSION, MANIFEST_NAME, READ_IMAGE_EXTENSIONS, Manifest, ShardInfo,
                              manifest_path, write_manifest)

SHARD_SUFFIXES = (".tar", ".tgz", ".tar.gz")
CLASS_MAP_NAME = "classes.txt"


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
    ok: bool = True


def resolve_shards(spec: str | Path) -> list[Path]:
    """A folder, a glob, a brace pattern or a file -> sorted shard paths (all in one folder)."""
    text = str(spec)
    p = Path(text)
    if p.is_dir():
        paths = sorted(q for q in p.iterdir() if q.is_file() and q.name.endswith(SHARD_SUFFIXES)
                       and not q.name.startswith("."))
        if not paths:
            raise DataError(f"{p} holds no shards ({', '.join('*' + s for s in SHARD_SUFFIXES)})")
    elif "{" in text and "}" in text:
        import braceexpand

        paths = [Path(x) for x in braceexpand.braceexpand(text)]
        missing = [x for x in paths if not x.is_file()]
        if missing:
            raise DataError(f"{len(missing)} shard(s) of {text} do not exist, e.g. {missing[0]}")
    elif any(c in text for c in "*?["):
        paths = sorted(Path(x) for x in glob.glob(text) if Path(x).is_file())
        if not paths:
            raise DataError(f"no file matches {text}")
    elif p.is_file():
        paths = [p]
    else:
        raise DataError(f"{text} is neither a folder, a shard file, a glob nor a brace pattern")
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


def sha256_file(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def scan_shard(path: Path) -> tuple[int, int, int, list[str]]:
    """(samples, unlabeled, keys without image, label texts) as the loader will see them."""
    import webdataset as wds
    from webdataset.tariterators import group_by_keys, tar_file_expander

    from gpufeed.loader import _select

    samples = unlabeled = ignored = 0
    labels: list[str] = []
    try:
        with open(path, "rb") as f:
            files = tar_file_expander([{"url": str(path), "stream": f}], select_files=_select)
            for sample in group_by_keys(files, handler=wds.reraise_exception):
                if not any(e in sample for e in READ_IMAGE_EXTENSIONS):
                    ignored += 1
                    continue
                samples += 1
                raw = sample.get(LABEL_EXTENSION)
                if raw is None:
                    unlabeled += 1
                else:
                    labels.append(raw.decode("utf-8", errors="replace").strip())
    except DataError:
        raise
    except Exception as exc:  # tarfile.ReadError, EOFError, gzip errors, duplicate members...
        raise DataError(f"shard {path} is not a readable tar file ({type(exc).__name__}: {exc})") from None
    return samples, unlabeled, ignored, labels


def _classes(folder: Path, labels: set[str]) -> tuple[list[str], str]:
    class_map = folder / CLASS_MAP_NAME
    if class_map.is_file():
        names = [line.strip() for line in class_map.read_text(encoding="utf-8").splitlines() if line.strip()]
        return names, CLASS_MAP_NAME
    if not labels:
        return [], "none"
    if all(re.fullmatch(r"\d+", x) for x in labels):
        return [str(i) for i in range(max(int(x) for x in labels) + 1)], "integer .cls"
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
            created_by = json.loads(existing.read_text(encoding="utf-8")).get("created_by")
        except (OSError, ValueError, AttributeError):
            created_by = None
        if created_by != "gpufeed index":
            raise DataError(f"{existing} already exists (created by {created_by!r}); it is not replaced by an index "
                            f"- choose another --out DIR")
    compression = _compression(paths)
    infos: list[ShardInfo] = []
    all_labels: set[str] = set()
    total = unlabeled = ignored = 0
    for p in paths:
        n, u, ig, labels = scan_shard(p)
        total += n
        unlabeled += u
        ignored += ig
        all_labels.update(labels)
        infos.append(ShardInfo(name=p.name, num_samples=n, bytes=p.stat().st_size,
                               sha256=sha256_file(p) if hash else None))
    if total == 0:
        raise DataError(f"{shards}: no sample with an image member ({', '.join(READ_IMAGE_EXTENSIONS)}) in "
                        f"{len(paths)} shard(s)")
    classes, class_source = _classes(folder, all_labels)
    if class_source == CLASS_MAP_NAME:
        unknown = sorted(x for x in all_labels if not re.fullmatch(r"\d+", x) and x not in classes)
        bad_ints = sorted(int(x) for x in all_labels if re.fullmatch(r"\d+", x) and int(x) >= len(classes))
        if unknown or bad_ints:
            raise DataError(f"labels {(unknown + [str(b) for b in bad_ints])[:5]} are not in {folder / CLASS_MAP_NAME}")
    prefix, pattern = _prefix_and_pattern([p.name for p in paths])
    total_bytes = sum(i.bytes for i in infos)
    manifest = Manifest(
        prefix=prefix, classes=classes, shards=infos, num_samples=total, total_bytes=total_bytes,
        mean_sample_bytes=total_bytes / total, url_pattern=pattern,
        options={"source": str(shards), "hashed": hash, "class_source": class_source,
                 "num_unlabeled": unlabeled, "num_ignored_keys": ignored},
        created_by="gpufeed index", gpufeed_version=__version__, compression=compression,
        root=None if dest == folder else str(folder),
    )
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
        num_classes=len(classes), num_unlabeled=unlabeled, num_ignored_keys=ignored, total_bytes=total_bytes,
        compression=compression, hashed=hash, class_source=class_source, classes_preview=classes[:10],
        ok=unlabeled == 0,
    )


def render(report: IndexReport) -> str:
    lines = [
        f"indexed {report.num_shards} shard(s) in {report.shard_folder}: {report.num_samples} samples, "
        f"{report.num_classes} classes ({report.class_source}), {report.total_bytes / 1e6:.1f} MB"
        + (f", {report.compression}" if report.compression else "")
        + ("" if report.hashed else ", no sha256 (--no-hash)"),
        f"manifest: {report.manifest_path}",
    ]
    if report.num_ignored_keys:
        lines.append(f"ignored {report.num_ignored_keys} key(s) without an image member")
    if report.num_unlabeled:
        lines.append(f"error: {report.num_unlabeled} sample(s) have no .cls label; the loader will reject them")
    return "\n".join(lines)
