"""The shard files of one set as the loader reads them, torch-free: a shard's samples, with the checks that it is the
manifest's shard (docs/design.md §3, "The shard is the manifest's"); security in §3, "Safety"."""

from __future__ import annotations

import os
from typing import Iterator

from gpufeed.loader.errors import ShardMismatch, printable
from gpufeed.shardset.keys import READ_IMAGE_EXTENSIONS
from gpufeed.shardset.manifest import DEFAULT_LABEL_SOURCE, label_member
from gpufeed.shardset.source import SourceError, is_pipe, is_remote, open_shard, remote_size
from gpufeed.shardset.tar import ShardRead, iter_samples


def read_extensions(label: str) -> frozenset[str]:
    """The member extensions the loader reads for a manifest's label source: the images and the label member."""
    return frozenset((*READ_IMAGE_EXTENSIONS, label_member(label)))


READ_EXTENSIONS = read_extensions(DEFAULT_LABEL_SOURCE)
"""What the loader reads from a set labelled by ``.cls`` members (the default label source)."""


class ShardReader:
    """Opens the shards of one set by index and checks each against the manifest (size, keys, sha256).

    One per dataset, copied into each DataLoader worker; it remembers which shards this process has hashed.
    """

    def __init__(self, paths: list[str], counts: list[int], *, label: str = DEFAULT_LABEL_SOURCE,
                 sizes: list[int] | None = None,
                 keys: list[str | None] | None = None, sha256: list[str | None] | None = None,
                 check: str = "keys", remote_streams: int = 1, fast_tar: bool = True):
        self.paths = paths
        """One per shard: an absolute local path, or a URL / ``pipe:`` command (:mod:`gpufeed.shardset.source`)."""
        self.counts = counts
        """The manifest's sample count of each shard."""
        self.sizes = sizes
        """The manifest's byte size of each shard (a remote shard is read up to it, never past; a local one of
        another size is refused before it is read)."""
        self.keys = keys
        """The manifest's ``keys_sha256`` of each shard (None: not recorded), compared when a shard is read to its end."""
        self.sha256 = sha256
        """The manifest's ``sha256`` of each shard, compared with ``check = "sha256"``."""
        self.check = check
        self.remote_streams = remote_streams
        self.read_extensions = read_extensions(label)
        self.fast_tar = fast_tar
        """Read plain .tar shards with the lean seeking reader; False = the one-pass stream reader of gzip shards
        (``shardset.tar.TarPass``) for every shard."""
        self._hashed: set[int] = set()
        """Shards whose sha256 this process has checked (each is hashed once per process, the first time it is
        read to its end)."""

    def new_read(self, shard: int, to_end: bool) -> ShardRead:
        """What reading ``shard`` gathers: its key digest, and its sha256 when it is read to its end and must be
        checked (``check = "sha256"``, a manifest sha256, not yet hashed in this process)."""
        return ShardRead(sha256=to_end and self.check == "sha256" and self.sha256 is not None
                         and self.sha256[shard] is not None and shard not in self._hashed)

    def other_samples(self, shard: int, read: ShardRead) -> str | None:
        """After a shard was read to its end with the promised count: why it is not the manifest's shard (its key
        sequence, or with ``check = "sha256"`` its sha256, differs from the manifest's), or None."""
        want = self.keys[shard] if self.keys is not None else None
        if want is not None and read.keys.hexdigest() != want:
            return ("holds other samples than the manifest lists (its keys differ from the manifest's keys_sha256: "
                    "a copy of another shard, or a shard rewritten since the manifest was written)")
        if read.want_sha256:
            want = self.sha256[shard] if self.sha256 is not None else None
            if read.sha256 != want:
                return (f"has sha256 {str(read.sha256)[:16]}..., the manifest says {str(want)[:16]}... (check = "
                        f"\"sha256\")")
            self._hashed.add(shard)
        return None

    def samples(self, shard: int, start: int, stop: int | None, total: list[int],
                read: ShardRead | None = None) -> Iterator[dict]:
        """Image samples ``[start, stop)`` (``stop`` None: to the end) of shard ``shard``, plain or
        gzip-compressed (:func:`gpufeed.shardset.tar.iter_samples`): a local file is opened by path; a URL or
        ``pipe:`` command through :func:`gpufeed.shardset.source.open_shard`, streamed from its start (a URL with
        ``remote_streams`` range requests in flight).

        A local shard whose size is not the manifest's raises :class:`ShardMismatch` before anything is read, and
        so does one whose size or modification time changes while it is read (checked before each sample goes
        out: one ``fstat``). So does a URL shard whose size, as the store reports it (one size query), is not the
        manifest's; where none is reported it is never read past the manifest's size anyway, so a larger object
        reads as a shard without its end (refused), a shorter one as a stream cut short."""
        path = self.paths[shard]
        want = self.sizes[shard] if self.sizes is not None else None
        if is_remote(path):
            if want is not None and not is_pipe(path):
                try:  # one size query per shard read: the length the store reports
                    found = remote_size(path)
                except SourceError:  # no size reported (or not reachable): the stream read says what is wrong
                    found = None
                if found is not None and found != want:
                    raise ShardMismatch(f"shard {printable(path)} is {found} bytes, the manifest says {want}: it is "
                                        f"not the shard the manifest lists (replaced or rewritten)")
            fileobj = open_shard(path, size=want, streams=self.remote_streams)
            yield from iter_samples(path, self.read_extensions, READ_IMAGE_EXTENSIONS, start, stop, total,
                                    fileobj=fileobj, read=read)
            return
        f = open(path, "rb", buffering=1 << 20)
        try:
            first = os.fstat(f.fileno())
            if want is not None and first.st_size != want:
                raise ShardMismatch(f"shard {printable(path)} is {first.st_size} bytes, the manifest says {want}: it "
                                    f"is not the shard the manifest lists (replaced or rewritten)")
        except BaseException:
            f.close()
            raise
        samples = iter_samples(path, self.read_extensions, READ_IMAGE_EXTENSIONS, start, stop, total,
                               stream=not self.fast_tar, fileobj=f, seekable=True, read=read)
        try:
            for sample in samples:
                now = os.fstat(f.fileno())
                if (now.st_size, now.st_mtime_ns) != (first.st_size, first.st_mtime_ns):
                    raise ShardMismatch(f"shard {printable(path)} changed while it was read ({first.st_size} -> "
                                        f"{now.st_size} bytes, modified)")
                yield sample
        finally:
            samples.close()
            f.close()
