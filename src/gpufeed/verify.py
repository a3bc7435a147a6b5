"""``gpufeed verify DEST``: re-read every shard of a set against its manifest.

Per shard (in parallel over processes, one streaming pass per file): the file exists, its size and sha256
match the manifest (sha256 is skipped when the manifest has none, e.g. ``gpufeed index --no-hash``), the tar
reads to the end (gzip shards of foreign sets included), its sample count matches, every member name is
``KEY.ext`` with a dot-free KEY and a known extension, keys are unique across the whole set, each sample has
exactly one image member and a ``.cls`` label in ``0..C-1``, and (``decode``, default on) every image
decodes to 3-channel RGB with Pillow. For sets written by ``gpufeed shard``, each sample must have a ``KEY.json``
that parses, names the class of the label, and carries the sha256 of the image member, which pins a flipped bit
to its member, and ``index.parquet`` must exist and list exactly the (key, shard) pairs found. Foreign sets
(``gpufeed index``) are read as webdataset and the loader read them: KEY is the name up to the first dot (so
``x.seg.png`` is a member of sample ``x``, not a key with a dot) and keys without an image member are not
samples. The shards are looked up in the manifest's ``root`` when it has one. Every failure is a problem naming
shard, member and reason; ``ok`` is True when there is none.
"""

from __future__ import annotations

import concurrent.futures as cf
import hashlib
import io
import json
import os
import tarfile
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.manifest import LABEL_EXTENSION, META_EXTENSION, READ_IMAGE_EXTENSIONS, read_manifest

_KNOWN = set(READ_IMAGE_EXTENSIONS) | {LABEL_EXTENSION, META_EXTENSION, "txt", "cls2", "pth", "npy", "id"}


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
    ok: bool = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "ok", not self.problems)


class _HashingReader:
    def __init__(self, f: Any) -> None:
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def read(self, size: int = -1) -> bytes:
        b = self.f.read(size)
        self.h.update(b)
        self.n += len(b)
        return b

    def drain(self) -> bool:
        """Read to the end; True when everything left is zero padding (a cleanly ended tar)."""
        clean = True
        while b := self.read(1 << 20):
            clean = clean and not b.strip(b"\0")
        return clean


def _split(name: str) -> tuple[str, str] | None:
    """webdataset's rule: KEY is the path up to the first dot of the base name; the rest is the extension."""
    d, _, base = name.rpartition("/")
    if "." not in base:
        return None
    stem, ext = base.split(".", 1)
    return (f"{d}/{stem}" if d else stem), ext


def _verify_shard(path: str, name: str, expected: dict[str, Any], num_classes: int, classes: list[str],
                  gzip: bool, decode: bool, ours: bool, max_problems: int = 200) -> dict[str, Any]:
    problems: list[tuple[str | None, str]] = []
    keys: list[str] = []
    decoded = 0

    def bad(member: str | None, reason: str) -> None:
        if len(problems) < max_problems:
            problems.append((member, reason))

    if not os.path.isfile(path):
        return {"name": name, "problems": [(None, "shard file is missing")], "keys": [], "decoded": 0}
    size = os.path.getsize(path)
    if expected.get("bytes") and size != expected["bytes"]:
        bad(None, f"size is {size} bytes, manifest says {expected['bytes']}")

    samples: dict[str, dict[str, bytes]] = {}
    order: list[str] = []
    last = None

    def finish(key: str) -> None:
        nonlocal decoded
        parts = samples.pop(key)
        images = [e for e in parts if e.lower() in READ_IMAGE_EXTENSIONS]
        if not ours and not images:
            # The loader and `gpufeed index` skip keys without an image member: not a sample. But an image
            # behind a dot in its key (`k.3.jpg` -> key `k`, extension `3.jpg`) is an image the loader never reads.
            keys.pop()  # (the key just finished is the last one)
            for e in sorted(parts):
                if "." in e and e.rsplit(".", 1)[1].lower() in READ_IMAGE_EXTENSIONS:
                    bad(f"{key}.{e}", f"key holds a dot: readers take {key!r} as the key and {e!r} as the "
                                      f"extension, so no reader sees this image")
                    break
            return
        if len(images) != 1:
            bad(key, f"sample has {len(images)} image members ({', '.join(sorted(parts))}); expected exactly one")
        label = None
        if LABEL_EXTENSION not in parts:
            bad(key, "sample has no .cls label member")
        else:
            text = parts[LABEL_EXTENSION].decode("ascii", "replace").strip()
            try:
                label = int(text)
            except ValueError:
                bad(f"{key}.cls", f"label {text!r} is not an integer")
            else:
                if not 0 <= label < num_classes:
                    bad(f"{key}.cls", f"label {label} is outside 0..{num_classes - 1}")
        if images and decode:
            member = f"{key}.{images[0]}"
            try:
                from PIL import Image

                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", Image.DecompressionBombWarning)
                    im = Image.open(io.BytesIO(parts[images[0]]))
                    im.load()
                    rgb = im.convert("RGB")
                if rgb.mode != "RGB" or len(rgb.getbands()) != 3:
                    bad(member, f"does not convert to 3-channel RGB (mode {im.mode})")
                decoded += 1
            except Exception as exc:  # noqa: BLE001 - any decoder failure is a problem record
                bad(member, f"image does not decode ({type(exc).__name__}: {exc})")
        if ours and META_EXTENSION not in parts:
            bad(key, "sample has no .json member (every gpufeed sample has one)")
        elif ours:
            try:
                meta = json.loads(parts[META_EXTENSION])
            except ValueError as exc:
                bad(f"{key}.json", f"not valid JSON ({exc})")
            else:
                if label is not None and 0 <= label < num_classes and meta.get("class") != classes[label]:
                    bad(f"{key}.json", f"class {meta.get('class')!r} does not match label {label} "
                                       f"({classes[label]!r})")
                digest = meta.get("sha256")
                if digest and images and hashlib.sha256(parts[images[0]]).hexdigest() != digest:
                    bad(f"{key}.{images[0]}", "image bytes do not match the sha256 recorded in its .json")

    reader = None
    try:
        with open(path, "rb") as f:
            reader = _HashingReader(f)
            with tarfile.open(fileobj=reader, mode="r|gz" if gzip else "r|") as tar:
                for m in tar:
                    last = m.name
                    if not m.isfile():
                        continue
                    split = _split(m.name)
                    if split is None:
                        bad(m.name, "member name has no extension (expected KEY.ext)")
                        continue
                    key, ext = split
                    # Foreign sets: webdataset (and so the loader and `gpufeed index`) keys a member by its name
                    # up to the first dot, so `x.seg.png` is member "seg.png" of sample "x", not a bad key.
                    if ours and "." in ext and ext.lower() not in _KNOWN:
                        bad(m.name, f"key holds a dot: readers take {key!r} as the key and {ext!r} as the "
                                    f"extension")
                    fobj = tar.extractfile(m)
                    data = fobj.read() if fobj is not None else b""
                    if len(data) != m.size:
                        bad(m.name, f"member is truncated: {len(data)} of {m.size} bytes; the tar does not read "
                                    f"to the end")
                        break
                    if key not in samples:
                        if order and order[-1] in samples:
                            finish(order[-1])
                        keys.append(key)
                        order.append(key)
                        samples[key] = {}
                    elif order[-1] != key:
                        bad(m.name, f"key {key!r} appears again after other samples (not grouped)")
                    if ext in samples[key]:
                        bad(m.name, "duplicate member in the sample")
                    samples[key][ext] = data
                if order and order[-1] in samples:
                    finish(order[-1])
            end = reader.n
            clean = reader.drain()
            if not gzip and tar.offset + 1024 > size:
                bad(last, f"tar is truncated: it ends at byte {size} without its end-of-archive blocks "
                          f"(the tar does not read to the end)")
            elif not clean:
                bad(last, f"invalid tar header after this member (byte {end} of {size}): readers stop here "
                          f"and silently lose the rest of the shard")
    except (tarfile.TarError, EOFError, OSError, ValueError) as exc:
        where = f"after member {last}" if last else "at the start"
        bad(last, f"tar does not read to the end ({type(exc).__name__}: {exc}) {where}")
    if reader is not None and expected.get("sha256"):
        got = reader.h.hexdigest()
        if reader.n == size and got != expected["sha256"]:
            bad(None, f"sha256 {got[:16]}... does not match the manifest's {expected['sha256'][:16]}...")
    if expected.get("num_samples") is not None and len(keys) != expected["num_samples"]:
        bad(None, f"holds {len(keys)} samples, manifest says {expected['num_samples']}")
    return {"name": name, "problems": problems, "keys": keys, "decoded": decoded}


def verify_shards(path: str | Path, decode: bool = True, workers: int | None = None) -> VerifyReport:
    """Verify the shard set at ``path`` (folder or manifest.json). Input errors raise DataError."""
    from gpufeed.manifest import manifest_path
    from gpufeed.system import usable_cpus

    t0 = time.perf_counter()
    m = read_manifest(path)
    root = manifest_path(path).parent
    if m.root:  # `gpufeed index --out` elsewhere: the shards stay in their folder (as the loader reads them)
        root = root / m.root
    ours = m.created_by.startswith("gpufeed shard")
    gzip = (m.compression or "").lower() in ("gzip", "gz")
    jobs = [(str(root / s.name), s.name, {"bytes": s.bytes, "sha256": s.sha256, "num_samples": s.num_samples},
             m.num_classes, m.classes, gzip or s.name.endswith((".tgz", ".tar.gz")), decode, ours)
            for s in m.shards]
    workers = min(workers or usable_cpus(), max(1, len(jobs)))
    if workers > 1:
        import multiprocessing as mp

        from gpufeed.system import die_with_parent  # the workers die with this process (kill -9, OOM killer)

        with cf.ProcessPoolExecutor(max_workers=workers, mp_context=mp.get_context("spawn"),
                                    initializer=die_with_parent, initargs=(os.getpid(),)) as ex:
            results = list(ex.map(_verify_shard, *zip(*jobs)))
    else:
        results = [_verify_shard(*j) for j in jobs]

    problems: list[VerifyProblem] = []
    seen: dict[str, str] = {}
    found = 0
    for r in results:
        problems.extend(VerifyProblem(r["name"], member, reason) for member, reason in r["problems"])
        found += len(r["keys"])
        for k in r["keys"]:
            if k in seen:
                problems.append(VerifyProblem(r["name"], k, f"key {k!r} is also used in {seen[k]}"))
            else:
                seen[k] = r["name"]
    index = manifest_path(path).parent / "index.parquet"
    if ours:
        if index.exists():
            problems.extend(_check_index(index, seen))
        else:
            problems.append(VerifyProblem("index.parquet", None, "missing (every gpufeed shard set has one)"))
    if found != m.num_samples and not any(p.member is None and "samples" in p.reason for p in problems):
        problems.append(VerifyProblem("", None, f"the set holds {found} samples, manifest says {m.num_samples}"))
    return VerifyReport(
        path=str(root), num_shards=len(m.shards), num_samples=found, num_expected=m.num_samples,
        num_decoded=sum(r["decoded"] for r in results), total_bytes=sum(s.bytes for s in m.shards),
        elapsed_s=time.perf_counter() - t0, decode=decode, created_by=m.created_by, problems=problems,
    )


def _check_index(index: Path, seen: dict[str, str]) -> list[VerifyProblem]:
    """index.parquet of a gpufeed set lists exactly the (key, shard) pairs found in the shards."""
    try:
        import pyarrow.parquet as pq

        table = pq.read_table(index, columns=["key", "shard"])
    except Exception as exc:  # noqa: BLE001 - unreadable index is a problem record
        return [VerifyProblem("index.parquet", None, f"unreadable ({type(exc).__name__}: {exc})")]
    rows = set(zip(table.column("key").to_pylist(), table.column("shard").to_pylist()))
    want = set(seen.items())
    out = []
    for key, shard in sorted(rows - want)[:20]:
        out.append(VerifyProblem("index.parquet", key, f"row says {shard}, but no such sample is there"))
    for key, shard in sorted(want - rows)[:20]:
        out.append(VerifyProblem("index.parquet", key, f"sample in {shard} has no row"))
    if table.num_rows != len(rows):
        out.append(VerifyProblem("index.parquet", None, f"{table.num_rows - len(rows)} duplicate row(s)"))
    return out


def render_verify(report: VerifyReport, max_items: int = 30) -> str:
    r = report
    head = (f"{r.num_shards} shards, {r.num_samples}/{r.num_expected} samples, "
            f"{r.num_decoded} images decoded, {r.total_bytes / 1e6:.1f} MB in {r.elapsed_s:.1f} s")
    if r.ok:
        return f"OK {r.path}: {head}"
    lines = [f"FAILED {r.path}: {len(r.problems)} problem(s); {head}"]
    for p in r.problems[:max_items]:
        where = p.shard or "(set)"
        if p.member:
            where += f" member {p.member}"
        lines.append(f"  {where}: {p.reason}")
    if len(r.problems) > max_items:
        lines.append(f"  ... and {len(r.problems) - max_items} more (see --json)")
    return "\n".join(lines)
