"""The one decision about progress bars: every tqdm bar gpufeed draws is made by :func:`bar`.

A bar is drawn only when the caller asked for progress (no ``--quiet``) and stderr is a terminal: in a CI log or
a file a bar is a stream of carriage-return lines. ``GPUFEED_PROGRESS=1`` forces bars on (a terminal that is not
detected, e.g. behind a pipe to ``tee``), ``GPUFEED_PROGRESS=0`` forces them off. torchrun ranks inherit the
environment and the launcher's stderr, so they decide the same way.
"""

from __future__ import annotations

import os
import sys
from typing import Any, TextIO

PROGRESS_ENV = "GPUFEED_PROGRESS"
"""1 forces progress bars on, 0 off; unset (or anything else) = on only when stderr is a terminal."""


def progress_enabled(quiet: bool = False, stream: TextIO | None = None) -> bool:
    """True when a progress bar should be drawn on ``stream`` (default stderr): never with ``quiet``, else as
    ``GPUFEED_PROGRESS`` says, else only when the stream is a terminal."""
    if quiet:
        return False
    forced = os.environ.get(PROGRESS_ENV, "").strip()
    if forced == "1":
        return True
    if forced == "0":
        return False
    stream = sys.stderr if stream is None else stream
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def bar(*, quiet: bool = False, **kwargs: Any) -> Any:
    """A tqdm bar on stderr (``dynamic_ncols``), disabled (every call a no-op) unless :func:`progress_enabled`."""
    from tqdm import tqdm

    kwargs.setdefault("file", sys.stderr)
    kwargs.setdefault("dynamic_ncols", True)
    return tqdm(disable=not progress_enabled(quiet, kwargs["file"]), **kwargs)
