"""Member names: the key rule, member extensions and sample grouping (docs/design.md §2.1).

A member ``dir/KEY.ext.more`` belongs to sample ``dir/KEY`` with extension ``ext.more`` (lower-cased): the key
is the path up to the first dot of the base name, webdataset's ``base_plus_ext``. Names without such a dot (or
with an empty stem, ``.cls``) belong to no sample, and webdataset's metadata members (``__...__``) are skipped.
Every reader applies the rule through :func:`split_member`, :func:`wanted`, :func:`is_metadata` and
:class:`SampleGrouper`: the lean tar reader (:func:`gpufeed.shardset.tar.iter_samples`, plain and gzip shards:
the loader), ``gpufeed index`` and ``gpufeed verify``.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable, Iterator

READ_IMAGE_EXTENSIONS = ("jpg", "jpeg", "png", "webp")
"""Member extensions readers accept as images (gpufeed writes jpg, png and webp; other tools also .jpeg)."""
LABEL_EXTENSION = "cls"
"""The label member gpufeed writes (and readers' default label source)."""
TEXT_EXTENSION = "txt"
"""The text member other tools write (img2dataset: the caption); a label source with ``--label txt``."""
META_EXTENSION = "json"

_META = re.compile(r"__[^/]*__($|/)")


def split_member(name: str) -> tuple[str, str] | None:
    """``dir/key.ext.more`` -> (``dir/key``, ``ext.more`` lower-cased, as readers match it), or None for a member
    of no sample: exactly webdataset's ``base_plus_ext`` (regex ``((?:.*/|)[^.]+)[.]([^/]*)``), in linear time.

    The key ends at the first dot of the base name and must end in a non-empty run of non-dots that starts at the
    name's start or after a ``/`` with no newline before it (``.`` in the regex does not match a newline). So
    ``.cls`` and ``d.x/.cls`` belong to no sample, while ``dir/.cls`` is extension ``cls`` of key ``dir/``.
    """
    dot = name.find(".", name.rfind("/") + 1)
    if dot <= 0:
        return None
    key = name[:dot]
    start = key.rfind(".") + 1  # the run of non-dots starts here or later
    if start:
        slash = key.find("/", start)
        if not 0 <= slash < dot - 1 or "\n" in name[:slash]:
            return None
    return key, name[dot + 1:].lower()


def wanted(name: str, extensions: frozenset[str] | set[str]) -> bool:
    """Whether member ``name`` belongs to a sample and has one of ``extensions`` (lower-case)."""
    split = split_member(name)
    return split is not None and split[1] in extensions


def is_metadata(name: str) -> bool:
    """webdataset's metadata members (``__key__``, ``__dir__/...``; its two rules): skipped by every reader."""
    return _META.match(name) is not None or ("/" not in name and name.startswith("__") and name.endswith("__"))


def dotted_image(key: str, parts: dict[str, Any]) -> str | None:
    """For a key without an image member: a member that is an image behind a dot in its key (``k.3.jpg`` is
    key ``k``, extension ``3.jpg``), which no reader ever sees."""
    for e in sorted(parts):
        if "." in e and e.rsplit(".", 1)[1] in READ_IMAGE_EXTENSIONS:
            return f"{key}.{e}"
    return None


UNGROUPED_FIX = ("re-create the tar with its members sorted by name (`tar --sort=name -cf ...`; GNU tar otherwise "
                 "writes them in directory order) or write the set with `gpufeed shard`")
"""How to fix a shard whose keys are not grouped (said wherever such keys are reported)."""

ProblemSink = Callable[[str, str, str], None]
"""``bad(member, reason, kind)``: how :class:`SampleGrouper` reports a problem; kind is ``"name"``,
``"duplicate"`` or ``"ungrouped"``."""


class SampleGrouper:
    """Groups members into samples as the loader does: consecutive members with the same KEY form a sample;
    metadata members (:func:`is_metadata`) are skipped. Reports (through ``bad``) names without an extension,
    a member a sample already has (readers keep one of them) and a key that comes back after other keys in the
    same shard (readers take it as another sample, so it is yielded again). ``gpufeed index`` and
    ``gpufeed verify`` group with it."""

    def __init__(self, bad: ProblemSink) -> None:
        self.bad = bad
        self.key: str | None = None
        self.parts: dict[str, bytes | None] = {}
        self.seen: set[str] = set()

    def add(self, name: str, data: bytes | None) -> tuple[str, dict[str, bytes | None]] | None:
        """Add one member; returns the sample it ends (key, {ext: data}), if any."""
        if is_metadata(name):
            return None
        split = split_member(name)
        if split is None:
            self.bad(name, "member name has no extension (expected KEY.ext)", "name")
            return None
        key, ext = split
        done = None
        if key != self.key:
            done = self.close()
            if key in self.seen:
                self.bad(name, f"key {key!r} appears again after other samples (not grouped): readers take "
                               f"it as another sample; {UNGROUPED_FIX}", "ungrouped")
            self.seen.add(key)
            self.key, self.parts = key, {}
        if ext in self.parts:
            self.bad(name, "duplicate member in the sample: readers keep only one of them", "duplicate")
        else:
            self.parts[ext] = data
        return done

    def samples(self, members: Iterable[tuple[str, bytes | None]]) -> Iterator[tuple[str, dict[str, bytes | None]]]:
        """Every sample of ``members`` (``(name, data)`` in tar order) as (key, {ext: data}), the last included."""
        for name, data in members:
            done = self.add(name, data)
            if done:
                yield done
        done = self.close()
        if done:
            yield done

    def close(self) -> tuple[str, dict[str, bytes | None]] | None:
        """The last sample (call once the members are exhausted)."""
        done = (self.key, self.parts) if self.key is not None else None
        self.key, self.parts = None, {}
        return done


class KeyDigest:
    """The digest of a shard's key sequence (the manifest's per-shard ``keys_sha256``): the keys of its samples
    (keys with an image member) in tar order. ``sha256(sha256(each key's UTF-8 length as 4 little-endian bytes)
    || sha256(the keys' UTF-8 bytes, concatenated))``, so the sequence is unambiguous whatever bytes a key holds,
    and it can be fed a key at a time (the loader, ``gpufeed index``) or a column at a time (``gpufeed shard``'s
    index, :meth:`update_arrow`), with the same result."""

    def __init__(self) -> None:
        import hashlib

        self._lengths = hashlib.sha256()
        self._data = hashlib.sha256()
        self.count = 0

    def update(self, key: str) -> None:
        b = key.encode("utf-8", "surrogateescape")  # tar names are decoded with surrogateescape: the stored bytes
        self._lengths.update(len(b).to_bytes(4, "little"))
        self._data.update(b)
        self.count += 1

    def update_arrow(self, keys: Any) -> None:
        """Feed a pyarrow ``string`` array of keys, in order (its buffers, no per-key Python work)."""
        import numpy as np

        n = len(keys)
        if not n:
            return
        bufs = keys.buffers()
        offsets = np.frombuffer(bufs[1], dtype=np.int32)[keys.offset: keys.offset + n + 1]
        self._lengths.update(np.diff(offsets).astype("<u4").tobytes())
        if bufs[2] is not None:
            self._data.update(memoryview(bufs[2])[int(offsets[0]): int(offsets[-1])])
        self.count += n

    def hexdigest(self) -> str:
        import hashlib

        return hashlib.sha256(self._lengths.digest() + self._data.digest()).hexdigest()
