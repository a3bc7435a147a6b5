"""Phase 1, scan: walk SRC into the candidate files as columns (``Scan``): the class folders are walked in the
job's workers (``_class_columns``), their columns joined in label order by the main process.

The input rules it applies (classes, walked sub-folders, candidate extensions, each file stored once, what is
ignored or rejected before any file is opened) are in the package docstring (``gpufeed.shard``), "Input rules"
and "Names"."""

from __future__ import annotations

import codecs
import itertools
import os
import sys
from dataclasses import dataclass, field
from typing import Any, Iterator

from gpufeed.core.errors import DataError
from gpufeed.shard.report import FileIssue

CANDIDATE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")
"""torchvision ImageFolder's IMG_EXTENSIONS: the files considered images (matched case-insensitively)."""


class Strings:
    """A column of file names kept as one bytes blob plus offsets (``os.fsencode``d, so names that are not UTF-8
    round-trip): ~N + 8 bytes a name instead of a Python ``str`` object each."""

    def __init__(self, blob: bytes, offsets: Any) -> None:
        self.blob = blob
        self.offsets = offsets  # int64 (numpy, or array.array: ``portable``), len(self) + 1, non-decreasing, from 0

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> str:
        return os.fsdecode(self.blob[self.offsets[i]:self.offsets[i + 1]])

    def __iter__(self) -> Iterator[str]:
        blob, o = self.blob, self.offsets.tolist()
        return (os.fsdecode(blob[a:b]) for a, b in zip(o, o[1:]))

    def portable(self) -> Strings:
        """The same names with ``array.array`` offsets: sent to a worker, they unpickle without numpy (a worker
        that only checks plain JPEG headers never imports it, ~0.1 s a process)."""
        from array import array

        offsets = array("q")
        offsets.frombytes(self.offsets.astype("=i8").tobytes())  # array("q") reads this machine's byte order
        return Strings(self.blob, offsets)

    def take(self, idx: Any) -> Strings:
        import numpy as np

        idx = np.asarray(idx, dtype=np.int64)
        starts, ends = self.offsets[idx], self.offsets[idx + 1]
        blob = self.blob
        joined = b"".join([blob[a:b] for a, b in zip(starts.tolist(), ends.tolist())])
        return Strings(joined, np.concatenate(([0], np.cumsum(ends - starts))).astype(np.int64))


@dataclass
class Scan:
    classes: list[str]
    """Class names as recorded (``display``: non-UTF-8 bytes become U+FFFD), in label order."""
    paths: Strings
    """Candidate files (relative to SRC, real names), sorted by (label, path); the arrays below follow them."""
    labels: Any  # numpy int32
    sizes: Any  # numpy int64
    mtimes: Any  # numpy int64 (st_mtime_ns); None once the fingerprint is taken (nothing else reads them)
    ignored: list[FileIssue]
    rejected: list[FileIssue]
    class_counts: list[int]
    dirs: list[str] = field(default_factory=list)
    """The class folders' real names (file system access), in label order."""
    duplicates: list[int] = field(default_factory=list)
    """Per class: files rejected because the same file (device, inode) is already stored under another path."""
    notes: list[str] = field(default_factory=list)
    """Class folders reached through a symbolic link that leads out of SRC, each named with where it points
    (:func:`gpufeed.core.safefs.folder_link_note`); the job reports them as warnings."""
    hidden_dirs: list[str] = field(default_factory=list)
    """Hidden folders at SRC's root that were not made classes (``classes_like = "gpufeed"``), as recorded:
    ImageFolder would count each as a class."""

    def __len__(self) -> int:
        return len(self.labels)


def _rel(path: str, root: str) -> str:
    return display(os.path.relpath(path, root))


def display(rel: str) -> str:
    """Relative path as recorded: '/' separators; bytes that are not UTF-8 become U+FFFD (the file is still read
    under its real name, which the plan keeps)."""
    return rel.replace(os.sep, "/").encode("utf-8", "surrogateescape").decode("utf-8", "replace")


_Found = tuple  # (path relative to SRC (real name), size, mtime_ns, device, inode, reached through a symlink)
"""A candidate file as the walk finds it: a plain tuple (sorted by its path, the first field, which is unique),
~0.3 us a file cheaper than a NamedTuple (100k files: ~0.03 s a worker)."""

_FS_UTF8 = codecs.lookup(sys.getfilesystemencoding()).name == "utf-8"


def _class_columns(src: str, name: str,
                   hidden: bool = False) -> tuple[tuple[Any, ...], list[FileIssue], list[FileIssue]]:
    """Walk one class folder (``_walk_class``) -> its candidates in path order as columns (names ``fsencode``d
    as one blob, their lengths, sizes, mtimes, devices, inodes, reached-via-a-link flags), then what was
    ignored and rejected. Runs in a worker process when the job has a pool: compact to send back. ``hidden``:
    hidden files and folders are candidates too (``classes_like = "imagefolder"``)."""
    from array import array

    found: list[_Found] = []
    ignored: list[FileIssue] = []
    rejected: list[FileIssue] = []
    _walk_class(src, os.path.join(src, name), found, ignored, rejected, hidden)
    if not found:
        return (b"", array("q"), array("q"), array("q"), array("Q"), array("Q"), b""), ignored, rejected
    found.sort()  # by path: unique, so the other fields are never compared
    raws, sizes, mtimes, devs, inos, via = zip(*found)
    # os.fsencode of each name, joined: one encode when every name is one byte a character (UTF-8 encodes each
    # character on its own, so the lengths are then the names' lengths)
    blob = "".join(raws).encode("utf-8", sys.getfilesystemencodeerrors()) if _FS_UTF8 else b""
    if _FS_UTF8 and len(blob) == sum(map(len, raws)):
        lengths = array("q", map(len, raws))
    else:
        names = [os.fsencode(r) for r in raws]
        blob, lengths = b"".join(names), array("q", map(len, names))
    cols = (blob, lengths, array("q", sizes), array("q", mtimes), array("Q", devs), array("Q", inos), bytes(via))
    return cols, ignored, rejected


_SCAN_DEPTH = 4
"""Walk tasks in flight per worker."""

_SCAN_GROUP_MAX = 64
"""Class folders walked by one task, at most."""


def _group_columns(src: str, names: list[str],
                   hidden: bool = False) -> list[tuple[tuple[Any, ...], list[FileIssue], list[FileIssue]]]:
    """``_class_columns`` of a few consecutive class folders (one worker task)."""
    return [_class_columns(src, name, hidden) for name in names]


def _walked(src: str, classes: list[str], pool: Any, workers: int, hidden: bool = False,
            group_max: int = _SCAN_GROUP_MAX, depth: int = _SCAN_DEPTH) -> Any:
    """``_class_columns`` of each class folder, in label order: walked by the pool's workers (a few tasks in
    flight each, so the results are never all held at once) or, without a pool, here. A task walks a group of
    consecutive classes (about ``workers * 8`` groups, at most ``_SCAN_GROUP_MAX`` classes each): every task is a
    round trip through this process's pool threads, which may wait for the GIL (an import in the preload thread)
    while the workers, given one small class at a time, would wait for them."""
    if pool is None:
        for name in classes:
            yield _class_columns(src, name, hidden)
        return
    ex = pool
    size = max(1, min(group_max, len(classes) // (workers * 8)))
    pending = (classes[i:i + size] for i in range(0, len(classes), size))
    running: list[Any] = []
    try:
        while True:
            for group in pending:
                running.append(ex.submit(_group_columns, src, group, hidden))
                if len(running) >= depth * workers:
                    break
            if not running:
                return
            yield from running.pop(0).result()
    finally:
        for fut in running:
            fut.cancel()


def scan_src(src: str, pool: Any = None, workers: int = 1, classes_like: str = "gpufeed",
             class_list: tuple[str, list[str]] | None = None, *, group_max: int = _SCAN_GROUP_MAX,
             depth: int = _SCAN_DEPTH) -> Scan:
    """Walk SRC (the class folders in the pool's workers when ``pool`` is given) into the candidates' columns.

    ``classes_like``: ``"gpufeed"`` skips hidden folders at SRC's root (recorded in ``hidden_dirs``) and hidden
    files and folders inside the classes; ``"imagefolder"`` follows torchvision's ImageFolder exactly: every
    entry of SRC that is a folder (``entry.is_dir()``, symlinks followed, hidden included) is a class, in sorted
    name order (``find_classes``), and hidden files in class folders are candidates (``make_dataset``).
    ``class_list``: (the file it was read from, class names in label order): the classes are those folders of SRC
    in that order, other folders are ignored; a name that is not a folder of SRC is refused. ``group_max`` and
    ``depth``: class folders a walk task takes at most, and tasks in flight per worker."""
    import numpy as np
    from array import array

    like_imagefolder = classes_like == "imagefolder"
    classes, hidden_dirs, notes, ignored = _classes(src, like_imagefolder, class_list)
    rejected: list[FileIssue] = []
    # Columns, in (label, path) order: one class' walk at a time is held as records, then appended here,
    # column by column.
    blob, ends = bytearray(), array("q")
    labels, sizes, mtimes, devs, inos, via = array("i"), array("q"), array("q"), array("Q"), array("Q"), bytearray()
    for label, (cols, class_ignored, class_rejected) in enumerate(_walked(src, classes, pool, workers, like_imagefolder,
                                                                          group_max, depth)):
        ignored += class_ignored
        rejected += class_rejected
        names, lengths, size, mtime, dev, ino, link = cols
        if not lengths:
            continue
        cum = itertools.accumulate(lengths, initial=len(blob))
        next(cum)  # the initial value: the previous end
        ends.extend(cum)
        blob += names
        labels.extend(array("i", [label]) * len(lengths))
        sizes.extend(size)
        mtimes.extend(mtime)
        devs.extend(dev)
        inos.extend(ino)
        via.extend(link)
        del cols, names, lengths, size, mtime, dev, ino, link
    paths = Strings(bytes(blob), np.concatenate(([0], np.frombuffer(ends, np.int64))).astype(np.int64))
    del blob, ends
    lab = np.frombuffer(labels, np.int32).copy()
    keep, duplicates = _store_once(paths, lab, np.frombuffer(devs, np.uint64), np.frombuffer(inos, np.uint64),
                                   np.frombuffer(via, np.uint8), rejected, len(classes))
    siz, mt = np.frombuffer(sizes, np.int64).copy(), np.frombuffer(mtimes, np.int64).copy()
    if keep is not None:
        paths, lab, siz, mt = paths.take(keep), lab[keep], siz[keep], mt[keep]
    counts = np.bincount(lab, minlength=len(classes)).tolist()
    ignored.sort(key=lambda i: i.path)
    shown = [display(c) for c in classes]  # sorted by the real names, as ImageFolder sorts them (or listed)
    if len(set(shown)) != len(shown):
        dup = sorted({c for c in shown if shown.count(c) > 1})
        raise DataError(f"class folders whose names are not valid UTF-8 read the same once shown ({', '.join(dup)}); "
                        f"rename them")
    return Scan(shown, paths, lab, siz, mt, ignored, rejected, counts, dirs=classes, duplicates=duplicates,
                 notes=notes, hidden_dirs=hidden_dirs)


def _classes(src: str, like_imagefolder: bool,
             class_list: tuple[str, list[str]] | None) -> tuple[list[str], list[str], list[str], list[FileIssue]]:
    """SRC's entries -> (the class folders' real names in label order, the hidden folders not made classes, notes
    on class folders linked out of SRC, what was ignored at the root); ``scan_src`` says which entries are
    classes."""
    from gpufeed.core.safefs import folder_link_note

    classes: list[str] = []
    hidden_dirs: list[str] = []
    notes: list[str] = []
    ignored: list[FileIssue] = []
    with os.scandir(src) as it:
        entries = sorted(it, key=lambda e: e.name)
    listed = None if class_list is None else set(class_list[1])
    for e in entries:
        if listed is not None and e.is_dir():
            if e.name in listed:
                classes.append(e.name)
            else:
                ignored.append(FileIssue(_rel(e.path, src), f"folder not in the class list {class_list[0]}"))
        elif e.name.startswith(".") and not like_imagefolder:
            if e.is_dir():
                hidden_dirs.append(display(e.name))
                ignored.append(FileIssue(_rel(e.path, src), "hidden folder (not a class; ImageFolder would count "
                                                            "it as one)"))
            else:
                ignored.append(FileIssue(_rel(e.path, src), "hidden (never a class)"))
        elif e.is_dir():
            classes.append(e.name)
            if e.is_symlink() and (note := folder_link_note(e.path, src)):
                notes.append(f"class folder {display(note)}")
        elif e.is_symlink() and not os.path.exists(e.path):
            ignored.append(FileIssue(_rel(e.path, src), "dangling symlink at the root (not in a class folder)"))
        else:
            ignored.append(FileIssue(_rel(e.path, src), "file at the root (not in a class folder)"))
    if class_list is not None:
        missing = [c for c in class_list[1] if c not in set(classes)]
        if missing:
            raise DataError(f"class list {class_list[0]} names {', '.join(repr(c) for c in missing[:5])}"
                            f"{f' and {len(missing) - 5} more' if len(missing) > 5 else ''}, not a folder in SRC "
                            f"{src}")
        classes = list(class_list[1])
    return classes, hidden_dirs, notes, ignored


def _store_once(paths: Strings, labels: Any, devs: Any, inos: Any, via: Any, rejected: list[FileIssue],
                num_classes: int) -> tuple[Any, list[int]]:
    """Every file once: paths that reach the same file (device, inode) through symlinks or hard links, in one
    class or several, keep one path (one reached without a symlink first, then the lowest label, then the path);
    the others are rejected naming it. The candidates are in (label, path) order, so the rule is the lowest
    (via_link, position). -> (indices to keep, or None when all are kept; duplicates per class)."""
    import numpy as np

    n = len(labels)
    pos = np.arange(n, dtype=np.int64)
    order = np.lexsort((pos, via, inos, devs))  # by device, inode, then the keeping rule
    first = np.ones(n, dtype=bool)
    first[1:] = (devs[order][1:] != devs[order][:-1]) | (inos[order][1:] != inos[order][:-1])
    kept = np.empty(n, dtype=np.int64)
    kept[order] = order[first][np.cumsum(first) - 1]
    dup = np.nonzero(kept != pos)[0]
    duplicates = np.bincount(labels[dup], minlength=num_classes).tolist()
    if not len(dup):
        return None, duplicates
    for i in dup.tolist():
        k = int(kept[i])
        where = "" if labels[k] == labels[i] else " in another class"
        rejected.append(FileIssue(display(paths[i]), f"same file as {display(paths[k])}{where} (symlink or hard "
                                                      f"link); stored once"))
    return np.nonzero(kept == pos)[0], duplicates


def _walk_class(src: str, top: str, out: list[_Found], ignored: list, rejected: list, hidden: bool = False) -> None:
    """Collect a class' candidate files into ``out``. Sub-folders are followed through symlinks, each folder (device, inode) once, so
    loops end; folders reached without a symlink are walked first, so a folder also linked from elsewhere in the
    class is listed under its own path. ``hidden``: hidden files and folders are walked like the others (as
    ImageFolder's ``os.walk`` does)."""
    seen: set[tuple[int, int]] = set()
    stack = [(top, os.path.islink(top))]  # real folders: walked first
    linked: list[tuple[str, bool]] = []  # folders reached through a symlink: walked once ``stack`` is empty
    while stack or linked:
        d, via_link = stack.pop() if stack else linked.pop()
        try:
            st = os.stat(d)
        except OSError as exc:
            ignored.append(FileIssue(_rel(d, src), f"unreadable folder ({exc.strerror})"))
            continue
        if (st.st_dev, st.st_ino) in seen:
            ignored.append(FileIssue(_rel(d, src), "folder already walked in this class (symlink loop or second link)"))
            continue
        seen.add((st.st_dev, st.st_ino))
        try:
            with os.scandir(d) as it:
                entries = sorted(it, key=lambda e: e.name)
        except OSError as exc:
            ignored.append(FileIssue(_rel(d, src), f"unreadable folder ({exc.strerror})"))
            continue
        subdirs = []
        base = os.path.relpath(d, src) + os.sep  # + an entry's name = its path relative to SRC, real name
        for e in entries:
            name = e.name
            if name.startswith(".") and not hidden:
                ignored.append(FileIssue(display(base + name), "hidden file or folder"))
                continue
            is_image_name = name.lower().endswith(CANDIDATE_EXTENSIONS)
            try:
                if e.is_dir():
                    subdirs.append((e.path, via_link or e.is_symlink()))
                    continue
                link = e.is_symlink()
                if link and not os.path.exists(e.path):
                    (rejected if is_image_name else ignored).append(FileIssue(display(base + name),
                                                                              "dangling symlink"))
                    continue
                if not e.is_file():
                    ignored.append(FileIssue(display(base + name), "not a regular file"))
                    continue
                if not is_image_name:
                    ext = os.path.splitext(name)[1] or "(none)"
                    ignored.append(FileIssue(display(base + name), f"not an image file extension ({ext})"))
                    continue
                st = e.stat()
            except OSError as exc:
                rejected.append(FileIssue(display(base + name), f"unreadable ({exc.strerror})"))
                continue
            if st.st_size == 0:
                rejected.append(FileIssue(display(base + name), "empty file (0 bytes)"))
                continue
            out.append((base + name, st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino, via_link or link))
        stack.extend(sd for sd in reversed(subdirs) if not sd[1])
        linked.extend(sd for sd in reversed(subdirs) if sd[1])
