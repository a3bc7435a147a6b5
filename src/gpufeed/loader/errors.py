"""How the loader words and carries a data error (docs/design.md §3, "Integrity"): one printable line naming the
shard and member, and what a DataLoader worker hands the main process instead of a traceback."""

from __future__ import annotations

import tarfile
import zlib


def printable(value: object) -> str:
    """``value`` as text for a one-line message: names from data may hold newlines or control characters."""
    text = str(value)
    return text if text.isprintable() else repr(text)


def reason(exc: BaseException) -> str:
    """``Type: message`` of a reading error, on one line (webdataset appends its stream objects to ``args``)."""
    msg = str(exc.args[0]) if len(exc.args) > 1 and isinstance(exc.args[0], str) else str(exc)
    msg = msg.split(" @ <", 1)[0]  # webdataset's tar_file_iterator appends " @ <stream repr>"
    return printable(f"{type(exc).__name__}: {msg}" if msg else type(exc).__name__)


READ_ERRORS = (OSError, EOFError, ValueError, tarfile.TarError, zlib.error)
"""What reading a malformed shard raises: shardset.tar.TarFormatError (a ValueError), tarfile and gzip errors."""


class ShardMismatch(Exception):
    """The shard file is not the one the manifest lists (another size), or it changed while it was read."""


class WorkerFailure:
    """What a worker yields instead of a batch after a data error: the one-sentence message.

    The main process raises it as a :class:`~gpufeed.core.errors.DataError`; raising inside the worker would reach
    the user as torch's re-raised worker traceback.
    """

    def __init__(self, message: str):
        self.message = message
