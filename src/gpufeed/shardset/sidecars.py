"""The index files other readers of a shard set look for, written from its manifest (docs/design.md §2.5):

- ``_info.json``: timm's dataset info (``timm.data.readers.reader_wds``): one split, named by the manifest's
  prefix, with each shard's file name and sample count.
- ``wids.json``: the shard index of webdataset's indexed reader (``wids.ShardListDataset``): ``wids_version`` 1
  and a ``shardlist`` of ``{url, nsamples, filesize}``. Each url is relative to the folder of ``wids.json``
  (wids resolves it there). Plain ``.tar`` sets only: wids maps tars into memory and reads no gzip.
- ``<shard>.idx``, one per plain ``.tar`` shard: DALI's webdataset index (``fn.readers.webdataset(index_paths=…)``,
  the format of DALI's ``tools/wds2idx.py``, version ``v1.2``). The first line is ``v1.2 N``; then one line per
  sample (a run of consecutive regular members with the same base name, as DALI groups them when it reads the tar
  itself), each member ``EXT OFFSET SIZE NAME`` where OFFSET is where the member's data starts in the tar file
  (a multiple of 512). Gzip shards get none (DALI reads plain tars; an offset into a gzip stream means nothing to
  it), nor does a shard with a member name holding white space (the format splits on it); the notes say which.

Nothing here imports torch. ``gpufeed shard``'s writer builds each shard's index from the layout it writes
(``shard.write._idx_line``, checked by the tests against the tar's headers). Otherwise (``index``, ``stage``, a
shard kept from an earlier run) the offsets are read from the tar files themselves, by one walk over their headers
(``tar_members``) with the checks of every gpufeed tar reader (``shardset.tar.parse_header``, ``HeaderChain``):
a shard is untrusted data, so each header moves the walk forward and every size is checked against the file.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Iterable, Iterator

from gpufeed.shardset.tar import EXTENDED_TYPES, HeaderChain, TarFormatError, check_extended_size, parse_header

WIDS_NAME = "wids.json"
IDX_SUFFIX = ".idx"
DALI_INDEX_VERSION = "v1.2"
REMOTE_NOTE = "no _info.json, wids.json or DALI .idx files for a remote set (each would name local files)"

_BLOCK = 512


def timm_info(name: str, split: str, num_classes: int, shards: list[tuple[str, int]],
              created_by: str | None = None) -> bytes:
    """timm's ``_info.json``: ``shards`` is (file name relative to the info's folder, samples) in set order;
    ``created_by``, when given, is recorded (timm reads no other key)."""
    info: dict[str, Any] = {"name": name, "num_classes": num_classes,
                            "splits": {split: {"name": split, "num_samples": sum(n for _, n in shards),
                                               "filenames": [f for f, _ in shards],
                                               "shard_lengths": [n for _, n in shards]}}}
    if created_by is not None:
        info["created_by"] = created_by
    return (json.dumps(info, indent=2) + "\n").encode()


def wids_index(name: str, shards: list[tuple[str, int, int]], created_by: str | None = None) -> bytes:
    """wids' shard index: ``shards`` is (url relative to the index's folder, samples, bytes) in set order;
    ``created_by``, when given, is recorded (wids reads no such key)."""
    desc: dict[str, Any] = {"wids_version": 1, "name": name,
                            "shardlist": [{"url": url, "nsamples": n, "filesize": size} for url, n, size in shards]}
    if created_by is not None:
        desc["created_by"] = created_by
    return (json.dumps(desc, indent=2) + "\n").encode()


def idx_name(shard: str) -> str:
    """The DALI index file of a plain shard: its name with ``.tar`` replaced by ``.idx``."""
    return (shard[:-len(".tar")] if shard.endswith(".tar") else shard) + IDX_SUFFIX


def tar_members(path: str) -> Iterator[tuple[str, int, int]]:
    """The regular members of the plain tar ``path`` as ``(name, data offset, size)``, reading only headers.
    Raises TarFormatError for a header any gpufeed reader refuses or a member that runs past the end."""
    with open(path, "rb") as f:
        file_size = os.fstat(f.fileno()).st_size
        pos = 0
        chain = HeaderChain()
        while pos + _BLOCK <= file_size:
            f.seek(pos)
            hdr = f.read(_BLOCK)
            if len(hdr) < _BLOCK:
                raise TarFormatError(f"truncated header at offset {pos}")
            if hdr.count(0) == _BLOCK:
                return  # end of archive
            name, size, typ = parse_header(hdr, pos)
            data = pos + _BLOCK
            if typ in EXTENDED_TYPES or typ == b"g":
                check_extended_size(typ, size, f"member {name[:200]!r} (header at offset {pos})")
                ext = f.read(size)
                if len(ext) < size:
                    raise TarFormatError(f"member {name[:200]!r} (header at offset {pos}): truncated member")
                chain.extended(typ, ext, f"member {name[:200]!r} (header at offset {pos})", pos)
            else:
                name, size, regular = chain.member(name, size, typ, pos)
                if data + size > file_size:
                    raise TarFormatError(f"member {name[:200]!r} (header at offset {pos}): truncated member (size "
                                         f"{size} runs past the end of the file)")
                if regular:
                    yield name, data, size
            pos = data + (size + _BLOCK - 1) // _BLOCK * _BLOCK  # > pos: every header moves the walk forward
        if pos < file_size:
            raise TarFormatError(f"truncated header at offset {pos}")


_SPACE = re.compile(r"\s")


def dali_index(members: Iterable[tuple[str, int, int]]) -> tuple[bytes | None, str]:
    """A shard's DALI index (``v1.2``) from its regular members -> (the file's bytes, "") or (None, why not)."""
    lines: list[str] = []
    group: list[str] = []
    last: str | None = None
    for name, offset, size in members:
        if _SPACE.search(name):
            return None, f"member {name[:200]!r} has white space in its name, which the index format cannot hold"
        dot = name.find(".", name.rfind("/") + 1)
        # DALI's split_name: the base name up to the first dot after the last '/', and the rest (the whole name as
        # both when there is no such dot, as its C++ reader takes it)
        base, ext = (name, name) if dot < 0 else (name[:dot], name[dot + 1:])
        if not base:
            continue  # DALI skips members whose base name is empty (".x")
        if base != last and group:
            lines.append(" ".join(group))
            group = []
        last = base
        group.append(f"{ext} {offset} {size} {name}")
    if group:
        lines.append(" ".join(group))
    if not lines:
        return None, "no member to index"
    return dali_file(lines), ""


def dali_file(lines: list[str]) -> bytes:
    """The index file of a shard from its samples' lines (each ``EXT OFFSET SIZE NAME`` a member)."""
    lines.append("")
    return f"{DALI_INDEX_VERSION} {len(lines) - 1}\n{chr(10).join(lines)}".encode("utf-8", "surrogateescape")


def write_sidecars(dest: str, shards: list[Any], shard_paths: list[str], *, prefix: str, num_classes: int,
                   compression: str | None, name: str, indexed: set[str] | None = None,
                   created_by: str | None = None) -> list[str]:
    """Write ``_info.json``, ``wids.json`` and the ``.idx`` files into the folder ``dest`` for the local shards
    ``shard_paths`` (``shards``: their ``manifest.ShardInfo``, in set order). ``prefix`` names timm's split,
    ``name`` the dataset (timm, wids); ``indexed``: shards whose ``.idx`` is already written (by ``gpufeed
    shard``'s writer, from the layout it wrote). ``created_by`` (``gpufeed index``, which writes into a folder
    it does not own): recorded in ``_info.json`` and ``wids.json``, and such a file that does not record it (the
    user's own) is kept, not replaced. -> notes, one sentence each, for what was not written and why."""
    from gpufeed.shardset.manifest import TIMM_INFO_NAME
    from gpufeed.core.records import atomic_write_bytes

    rel = [os.path.relpath(p, dest).replace(os.sep, "/") for p in shard_paths]
    counts = [s.num_samples for s in shards]
    notes: list[str] = []

    def write(file: str, data: bytes) -> None:
        path = os.path.join(dest, file)
        if created_by is not None and _created_by(path) not in (None, created_by):
            notes.append(f"{path} is kept as it is (not written by {created_by}); this set's {file} is not written")
            return
        atomic_write_bytes(path, data)

    write(TIMM_INFO_NAME, timm_info(name, prefix, num_classes, list(zip(rel, counts)), created_by))
    if compression:
        notes.append(f"no {WIDS_NAME} and no DALI {IDX_SUFFIX} files: the shards are {compression}-compressed, and "
                     f"wids and DALI read plain tar offsets")
        return notes
    write(WIDS_NAME, wids_index(name, [(r, n, s.bytes) for r, n, s in zip(rel, counts, shards)], created_by))
    for path, info in zip(shard_paths, shards):
        if indexed and info.name in indexed:
            continue
        try:
            data, why = dali_index(tar_members(path))
        except TarFormatError as exc:
            data, why = None, str(exc)
        target = os.path.join(dest, idx_name(info.name))
        if data is None:
            notes.append(f"no DALI index for {info.name}: {why}")
            if os.path.exists(target):  # an older index of another shard of that name would mislead DALI
                os.unlink(target)
            continue
        atomic_write_bytes(target, data)
    return notes


_FOREIGN = "someone else"


def _created_by(path: str) -> str | None:
    """The ``created_by`` a JSON sidecar at ``path`` records: None when there is no file, ``_FOREIGN`` when it
    records none or cannot be read (read at most 1 MiB)."""
    if not os.path.lexists(path):
        return None
    try:
        with open(path, "rb") as f:
            got = json.loads(f.read(1 << 20)).get("created_by")
    except (OSError, ValueError, AttributeError, RecursionError):
        return _FOREIGN
    return got if isinstance(got, str) else _FOREIGN
