"""The one reader of a run folder's files (run.json, each step's summary.json, the logs), for ``gpufeed report`` and
``gpufeed run``. A run folder may have been prepared by someone else, so what it holds is untrusted input: every
file is read below the folder without following any link (:func:`gpufeed.core.safefs.read_below`), capped at a
size fit for its kind, and a JSON record's structure is bounded per byte before it is parsed (the manifest's bound,
:func:`gpufeed.shardset.manifest.json_structure_problem`), so no record can take the report's memory or recursion."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.core.safefs import read_below
from gpufeed.shardset.manifest import json_structure_problem

MAX_RUN_JSON_BYTES = 4 << 20
"""run.json: ten steps' lines (gpufeed writes a few KiB)."""
MAX_RECORD_BYTES = 16 << 20
"""A step's summary.json (verify's lists at most 10,000 problems, a few MiB)."""
MAX_LOG_BYTES = 64 << 20
"""A log read line by line (trials.jsonl, log.jsonl, gpu_health.jsonl)."""
MAX_LOG_LINE_BYTES = 64 << 10
"""One line of a log: gpufeed writes a few hundred bytes; a longer line is counted as not a record."""
MAX_LOG_LINES = 50_000
"""Lines of a log read at most (the rest is left out, and said to be)."""
MAX_LOG_TEXT = 200
"""Characters kept of a string value of a log row."""


def _parse(raw: bytes, path: Path, what: str) -> Any:
    why = json_structure_problem(raw)
    if why:
        raise DataError(f"{path} is refused as {what}: {why}")
    try:
        return json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        where = f" (char {exc.pos})" if isinstance(exc, json.JSONDecodeError) else ""
        raise DataError(f"{path} is not readable JSON, so not {what}{where}") from None


def read_json(path: Path, root: Path, what: str, max_bytes: int = MAX_RECORD_BYTES) -> Any | None:
    """The JSON value of ``path`` in the run folder ``root``, or None when it is not there; DataError (one sentence
    naming the file, never its contents) when it is reached through a link, is not a regular file, is larger than
    ``max_bytes``, holds more structure than its size allows or is not JSON."""
    try:
        raw = read_below(path, root, max_bytes, what=what)
    except FileNotFoundError:
        return None
    return _parse(raw, path, what)


def read_log(path: Path, root: Path, fields: tuple[str, ...]) -> tuple[list[dict[str, Any]], int, int]:
    """The rows of a JSON-lines log in the run folder ``root`` (([], 0, 0) when it is not there), each cut to
    ``fields`` holding a number, a bool or a string (cut to :data:`MAX_LOG_TEXT`); how many lines were not JSON
    objects (or longer than :data:`MAX_LOG_LINE_BYTES`), and how many were left unread past
    :data:`MAX_LOG_LINES`."""
    try:
        raw = read_below(path, root, MAX_LOG_BYTES, what="log")
    except FileNotFoundError:
        return [], 0, 0
    rows: list[dict[str, Any]] = []
    bad = start = seen = 0
    while start < len(raw):
        end = raw.find(b"\n", start)
        end = len(raw) if end < 0 else end
        if seen == MAX_LOG_LINES:  # the lines from here on (blank ones too) are left out
            return rows, bad, raw.count(b"\n", start) + (not raw.endswith(b"\n"))
        line, start = raw[start:end], end + 1
        if not line.strip():
            continue
        seen += 1
        row = None
        if len(line) <= MAX_LOG_LINE_BYTES and json_structure_problem(line) is None:
            try:
                row = json.loads(line.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):
                row = None
        if not isinstance(row, dict):
            bad += 1
            continue
        rows.append({k: (v[:MAX_LOG_TEXT] if isinstance(v, str) else v) for k, v in row.items()
                     if k in fields and (v is None or isinstance(v, (int, float, str, bool)))})
    return rows, bad, 0
