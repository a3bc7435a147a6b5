"""img2dataset's own records beside its shards, read by ``gpufeed index`` (docs/design.md §2.2).

img2dataset (``--output_format webdataset``) writes, for shard ``NNNNN.tar``:

- ``NNNNN_stats.json``: ``{"count", "successes", "failed_to_download", "failed_to_resize", "duration",
  "status_dict": {status or error message: count}}`` (img2dataset/logger.py ``write_stats``);
- ``NNNNN.parquet``: one row per URL of the shard, with the columns ``url``, ``key``, ``status`` (``success``,
  ``failed_to_download``, ``failed_to_resize``) and ``error_message``, among others (img2dataset/writer.py).

:func:`read_records` reads them when present, as untrusted data: each file bounded in size before it is read,
JSON checked field by field, parquet through pyarrow with only the ``status``, ``error_message`` and ``url``
columns, at most :data:`MAX_ROWS` rows (from the file's metadata, before any row is read), in batches. The counts
come from the stats file when there is one, else from the parquet's ``status`` column; the failure examples from
the parquet (URL and error message: recorded text, never opened). A record that cannot be read is counted and
named, not skipped silently; successes that differ from the samples found in the shard are listed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from pathlib import Path

from gpufeed.shardset.manifest import MAX_NUM_SAMPLES, SHARD_SUFFIXES
from gpufeed.core.errors import DataError
from gpufeed.core.redact import redact
from gpufeed.core.safefs import open_set_file, read_set_file

STATS_SUFFIX = "_stats.json"
PARQUET_SUFFIX = ".parquet"
MAX_STATS_BYTES = 64 << 20
"""A ``_stats.json`` larger than this is refused unread (img2dataset caps its status_dict at 100,000 entries)."""
MAX_PARQUET_BYTES = 256 << 20
"""A per-shard ``.parquet`` larger than this is refused unread (it holds metadata; images go to the tar)."""
MAX_PARQUET_COLUMN_BYTES = 1 << 30
"""Most uncompressed bytes of the columns read, summed over the row groups (from the file's metadata), so a
small file cannot inflate into a large read."""
MAX_ROWS = 10_000_000
"""Most rows read from one per-shard ``.parquet``."""
MAX_EXAMPLES = 5
"""Failed downloads (and unreadable records, count mismatches) listed by name."""
MAX_TEXT = 160
"""Characters of a URL or an error message kept in an example."""
COLUMNS = ("status", "error_message", "url")
STATUS_COUNTS = ("count", "successes", "failed_to_download", "failed_to_resize")


@dataclass
class Img2DatasetRecords:
    """What img2dataset's records say about the shards: URLs tried, downloaded and failed, with examples."""

    stats_files: int = 0
    parquet_files: int = 0
    count: int = 0
    """URLs img2dataset tried for the indexed shards."""
    successes: int = 0
    failed_to_download: int = 0
    failed_to_resize: int = 0
    failures: list[str] = field(default_factory=list)
    """The first failures: ``shard: URL (error message)``."""
    num_unreadable: int = 0
    unreadable: list[str] = field(default_factory=list)
    """Record files that could not be read (``file (why)``)."""
    num_mismatched: int = 0
    mismatched: list[str] = field(default_factory=list)
    """Shards whose records' successes differ from the samples found in them."""


def _text(value: object) -> str:
    """A data string as recorded text: one line, printable, at most MAX_TEXT characters, passwords hidden."""
    text = "".join(c if c.isprintable() else " " for c in str(value)[:MAX_TEXT * 2])
    text = " ".join(text.split())
    return redact(text[:MAX_TEXT] + ("..." if len(text) > MAX_TEXT else ""))


def _stem(name: str) -> str:
    for suffix in sorted(SHARD_SUFFIXES, key=len, reverse=True):
        if name.endswith(suffix):
            return name[: -len(suffix)]
    return name


def _regular(path: Path) -> bool:
    """Whether ``path`` is a regular file (or a link to one): never a FIFO or device to wait on."""
    try:
        return path.is_file()
    except OSError:
        return False


def _read_stats(path: Path, folder: Path) -> dict[str, int]:
    """The four counts of a ``_stats.json`` of the set in ``folder``. Raises ValueError (the reason), DataError
    (a link out of the set, a file too large: :func:`gpufeed.core.safefs.read_set_file`)."""
    data = read_set_file(path, folder, MAX_STATS_BYTES, what="img2dataset record")
    try:
        obj = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, RecursionError, ValueError) as exc:
        raise ValueError(f"not UTF-8 JSON ({str(exc)[:80]})") from None
    if not isinstance(obj, dict):
        raise ValueError("not a JSON object")
    counts = {}
    for key in STATUS_COUNTS:
        value = obj.get(key)
        if type(value) is not int or not 0 <= value <= MAX_NUM_SAMPLES:
            raise ValueError(f"{key} is not a count (an integer in 0..{MAX_NUM_SAMPLES})")
        counts[key] = value
    if counts["successes"] + counts["failed_to_download"] + counts["failed_to_resize"] > counts["count"]:
        raise ValueError("successes and failures add up to more than count")
    return counts


def _read_parquet(path: Path, folder: Path, shard: str, examples: list[str]) -> dict[str, int]:
    """The status counts of a per-shard ``.parquet`` of the set in ``folder``, appending failure examples. Raises
    ValueError, DataError (as :func:`_read_stats`)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    f = os.fdopen(open_set_file(path, folder, max_bytes=MAX_PARQUET_BYTES, what="img2dataset record"), "rb")
    try:
        pf = pq.ParquetFile(f)
        rows = pf.metadata.num_rows
        names = set(pf.schema_arrow.names)
        if "status" not in names:
            raise ValueError("it has no status column")
        if rows > MAX_ROWS:
            raise ValueError(f"{rows} rows, more than the {MAX_ROWS} gpufeed reads")
        columns = [c for c in COLUMNS if c in names]
        meta = pf.metadata
        wanted = [i for i in range(meta.num_columns) if meta.schema.column(i).path in columns]
        inflated = sum(meta.row_group(g).column(i).total_uncompressed_size
                       for g in range(meta.num_row_groups) for i in wanted)
        if inflated > MAX_PARQUET_COLUMN_BYTES:
            raise ValueError(f"its {', '.join(columns)} columns hold {inflated} bytes uncompressed, more than the "
                             f"{MAX_PARQUET_COLUMN_BYTES} gpufeed reads")
        counts = dict.fromkeys(STATUS_COUNTS, 0)
        seen = 0
        for batch in pf.iter_batches(batch_size=1024, columns=columns):
            seen += batch.num_rows
            if seen > rows:  # the metadata said fewer: refuse rather than read on
                raise ValueError("more rows than its metadata says")
            cols = {name: batch.column(name).to_pylist() for name in columns}
            for i, status in enumerate(cols["status"]):
                counts["count"] += 1
                if status == "success":
                    counts["successes"] += 1
                    continue
                key = status if status in ("failed_to_download", "failed_to_resize") else "failed_to_download"
                counts[key] += 1
                if len(examples) < MAX_EXAMPLES:
                    url = cols["url"][i] if "url" in cols else None
                    error = cols["error_message"][i] if "error_message" in cols else None
                    examples.append(f"{shard}: {_text(url) if url is not None else 'a URL'} "
                                    f"({_text(error) if error is not None else _text(status)})")
        return counts
    except (OSError, pa.ArrowException) as exc:  # before ValueError: pyarrow's ArrowInvalid is one too
        raise ValueError(f"not a readable parquet file ({type(exc).__name__}: {_text(exc)[:80]})") from None
    finally:
        f.close()


def read_records(folder: Path, samples: dict[str, int]) -> Img2DatasetRecords | None:
    """img2dataset's records for the shards ``samples`` (shard name -> samples found in it) in ``folder``, or
    None when no shard has a ``_stats.json`` or ``.parquet`` beside it."""
    rec = Img2DatasetRecords()
    found = False
    for shard, n in samples.items():
        stem = _stem(shard)
        stats_path, parquet_path = folder / f"{stem}{STATS_SUFFIX}", folder / f"{stem}{PARQUET_SUFFIX}"
        have_stats, have_parquet = _regular(stats_path), _regular(parquet_path)
        if not (have_stats or have_parquet):
            continue
        found = True
        counts = None
        examples: list[str] = []
        for path, have, read in ((stats_path, have_stats, lambda p: _read_stats(p, folder)),
                                 (parquet_path, have_parquet, lambda p: _read_parquet(p, folder, shard, examples))):
            if not have:
                continue
            try:
                got = read(path)
            except (ValueError, OSError, DataError) as exc:  # DataError: a link out of the set, nothing read
                rec.num_unreadable += 1
                if len(rec.unreadable) < MAX_EXAMPLES:
                    why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
                    rec.unreadable.append(f"{path.name} ({why})")
                continue
            if path is stats_path:
                rec.stats_files += 1
            else:
                rec.parquet_files += 1
            counts = counts or got  # the stats file's counts win; the parquet's stand in without one
        rec.failures.extend(examples[: MAX_EXAMPLES - len(rec.failures)])
        if counts is None:
            continue
        for key in STATUS_COUNTS:
            setattr(rec, key, getattr(rec, key) + counts[key])
        if counts["successes"] != n:
            rec.num_mismatched += 1
            if len(rec.mismatched) < MAX_EXAMPLES:
                rec.mismatched.append(f"{shard}: holds {n} samples, img2dataset's records say {counts['successes']} "
                                      f"downloads succeeded")
    return rec if found else None


def render_lines(rec: Img2DatasetRecords) -> tuple[list[str], list[str]]:
    """The report's lines: the summary (URLs tried, downloaded and failed, with examples) and the errors
    (unreadable records, shards whose samples differ from the successes)."""
    files = ", ".join(x for x in (f"{rec.stats_files} _stats.json" if rec.stats_files else "",
                                  f"{rec.parquet_files} .parquet" if rec.parquet_files else "") if x)
    summary, errors = [], []
    if rec.stats_files or rec.parquet_files:
        failed = rec.failed_to_download + rec.failed_to_resize
        line = (f"img2dataset records ({files}): {rec.count} URLs, {rec.successes} downloaded, "
                f"{rec.failed_to_download} failed to download, {rec.failed_to_resize} failed to resize")
        if failed and rec.failures:
            more = f" and {failed - len(rec.failures)} more" if failed > len(rec.failures) else ""
            line += f": {'; '.join(rec.failures)}{more}"
        summary.append(line)
    for what, count, examples in (("img2dataset record(s) gpufeed cannot read", rec.num_unreadable, rec.unreadable),
                                  ("shard(s) whose samples differ from img2dataset's successes", rec.num_mismatched,
                                   rec.mismatched)):
        if count:
            more = f" and {count - len(examples)} more" if count > len(examples) else ""
            errors.append(f"error: {count} {what}: {'; '.join(examples)}{more}")
    return summary, errors
