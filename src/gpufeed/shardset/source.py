"""Where a shard set lives: a local folder, a URL (http, https, s3, gs) or a ``pipe:`` command.

:func:`open_set` turns what the user typed into a :class:`ShardSet` (the checked manifest plus one location per
shard); :func:`open_shard` opens one shard for reading: a local file, a ``pipe:`` command's output, or a remote
object streamed in ranges through fsspec (never downloaded whole), retried from the byte where it broke.

Trust: only what the user typed (a folder, URL, brace pattern or ``pipe:`` command, and ``manifest=``) is ever
handed to fsspec or a shell. Shard names and ``root`` come from the manifest, which is data: names are plain file
names (:func:`gpufeed.shardset.manifest.shard_name_problem`), and for a remote set ``root`` must be a relative path without
``..``; both are joined to the user's base URL (URL-quoted for http and https; s3 and gs keys are literal).

Torch-free; fsspec (and aiohttp, s3fs, gcsfs) are imported only when a remote location is opened.
"""

from __future__ import annotations

import collections
import contextlib
import io
import itertools
import os
import posixpath
import re
import signal
import subprocess
import threading
import time
import urllib.parse
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Iterator

from gpufeed.core.errors import DataError
from gpufeed.shardset.manifest import (
    MANIFEST_NAME, MAX_MANIFEST_BYTES, MAX_SHARDS, SHARD_SUFFIXES, Manifest, parse_manifest,
    read_manifest, shard_root,
    root_problem,
)

REMOTE_PREFIXES = ("http://", "https://", "s3://", "gs://")
"""URL schemes read through fsspec, lower case; a scheme is case-insensitive (RFC 3986 §3.1): test a location with
:func:`is_url`, never with ``startswith``."""
PIPE_PREFIX = "pipe:"
"""A user-typed shell command whose standard output is a shard (webdataset's convention)."""

CHUNK_BYTES = 8 << 20
"""Bytes a remote shard's range requests ask for together: one stream asks for this much per request, N streams
for a 1/N share each (no less than :data:`MIN_CHUNK_BYTES`), so N streams hold about as much in flight as one."""
MIN_CHUNK_BYTES = 1 << 20
"""The smallest range a stream asks for by default (smaller ranges pay a request's latency for too few bytes)."""
STREAMS = 1
"""Range requests :class:`RemoteStream` keeps in flight when not told (the loader passes ``[loader]
remote_streams``)."""
MAX_STREAMS = 64
"""Most range requests one :class:`RemoteStream` keeps in flight."""
CONNECT_TIMEOUT_S = 10.0
"""Seconds to wait for a TCP connection to a remote store."""
READ_TIMEOUT_S = 60.0
"""Seconds to wait for the next bytes of a response (a first byte included) before the request counts as failed."""
MIN_BYTES_PER_S = 64 << 10
"""The slowest rate a range request may run at: one that takes longer than ``READ_TIMEOUT_S`` plus its size at
this rate counts as failed (timed out), so a server trickling bytes cannot hold a read forever."""
MAX_TIMEOUTS_IN_A_ROW = 2
"""Tries of one range that may time out in a row (each waited its whole time bound and brought no progress)
before a read with no deadline (a shard read by verify or stage) fails, whatever ``Retry.attempts`` allows: a stalled
or trickling server is not waited on 5 times. A read with a deadline (a manifest, a job's budget) ends by it."""
MAX_TIMED_OUT_READS_IN_A_ROW = 3
"""The job-level bound over a job's reads (``verify``): once this many shards in a row (in the set's order) failed
because their reads timed out (:class:`ReadTimedOut`), the job stops, saying so, instead of waiting a read's whole
bound on every later shard of a stalled or trickling server. ``stage`` already stops at its first failed shard."""
MIN_PROGRESS_BYTES = 1 << 20
"""Bytes a cut-short try must bring for the retry bound to count from zero again (a try bringing fewer, or a
range's last bytes, is a failure): a server sending one byte per request ends within the bound."""


@dataclass(frozen=True)
class Retry:
    """The bound on retrying one range of a remote shard: at most ``attempts`` tries in a row without progress,
    waiting ``first_wait_s``, then twice as long each time, never more than ``max_wait_s`` in all."""

    attempts: int = 5
    first_wait_s: float = 1.0
    max_wait_s: float = 30.0

    def waits(self) -> list[float]:
        """The waits before tries 2..``attempts``: doubling from ``first_wait_s``, cut so they sum to at most
        ``max_wait_s``."""
        out, left = [], self.max_wait_s
        for i in range(max(self.attempts - 1, 0)):
            w = min(self.first_wait_s * (2 ** i), left)
            out.append(w)
            left -= w
        return out


RETRY = Retry()
"""The retry bound :func:`open_shard` and :func:`open_set` use when not given one (tests set a small one)."""

Deadline = tuple[float, str]
"""``(time.monotonic() deadline, the sentence saying which bound it is)``: a remote read still waiting then fails
with that sentence. Linux's monotonic clock is the machine's, so a forked loader worker keeps its parent's."""
_JOB_DEADLINE: Deadline | None = None


@contextlib.contextmanager
def reads_bounded_by(deadline: float, why: str) -> Iterator[None]:
    """Within the block, and in loader workers forked within it, every remote read (size query, range request,
    retry wait) ends by ``deadline`` (``time.monotonic()``), failing with SourceError ``why``: a job's own
    budget (``gpufeed tune --budget``) bounds its waits on a slow source."""
    global _JOB_DEADLINE
    before = _JOB_DEADLINE
    if before is None or deadline < before[0]:
        _JOB_DEADLINE = (deadline, why)
    try:
        yield
    finally:
        _JOB_DEADLINE = before


def _earliest(own: Deadline | None) -> Deadline | None:
    """The earlier of ``own`` and the job's deadline (:func:`reads_bounded_by`)."""
    job = _JOB_DEADLINE
    if own is None or (job is not None and job[0] < own[0]):
        return job
    return own


def _left(bound: Deadline | None, url: str, where: str = "") -> float | None:
    """Seconds left before ``bound`` (None: unbounded); a SourceError naming ``url`` and the bound when none."""
    if bound is None:
        return None
    left = bound[0] - time.monotonic()
    if left <= 0:
        raise SourceError(f"{url}: {bound[1]}{where}")
    return left


class SourceError(DataError):
    """A shard or manifest that cannot be read from where it lives (one sentence naming the location)."""


class ReadTimedOut(SourceError):
    """A remote read that failed because its tries timed out (:data:`MAX_TIMEOUTS_IN_A_ROW`, or a size query whose
    every try did): what :data:`MAX_TIMED_OUT_READS_IN_A_ROW` counts."""


def is_url(spec: str | Path) -> bool:
    """Whether ``spec`` is a URL read through fsspec (``http``, ``https``, ``s3``, ``gs``; the scheme in any case:
    ``HTTP://`` is a URL, not a local path)."""
    return isinstance(spec, str) and spec[:8].lower().startswith(REMOTE_PREFIXES)


_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def check_location(spec: str | Path) -> None:
    """Refuse (DataError, exit 2) a typed location holding a ``scheme://`` gpufeed does not read (``ftp://``,
    ``file://``, ``HTTPS+X://``, or any ``scheme://`` after other text: ``1https://``, ``-https://``, ``x/https://``):
    pathlib would make a path of it, turning ``//`` into ``/`` and so the URL's password into text that no longer
    looks like one. The scheme is found wherever it starts (:func:`gpufeed.core.redact.find_schemes`: at the first
    letter of its run), not only at the start of the text. Also refused: a URL holding a control character. The
    message shows the location with its password hidden. A ``pipe:`` command (which may hold URLs) is not checked."""
    if not isinstance(spec, str) or is_pipe(spec):
        return
    from gpufeed.core.redact import find_schemes

    scheme = next(((a, b) for a, b, slashes in find_schemes(spec) if slashes), None)
    shown = repr(spec) if _CONTROL.search(spec) else spec  # one line, its password hidden whole
    if scheme is None:
        return
    if not is_url(spec):
        name = spec[scheme[0]:scheme[1]]
        if scheme[0] == 0:
            raise DataError(f"{shown}: gpufeed does not read {name} URLs (only http://, https://, s3://, gs://, "
                            f"a pipe: command or a local path)")
        raise DataError(f"{shown}: holds {name} after other text, so it is neither a URL gpufeed reads (one starts "
                        f"with http://, https://, s3:// or gs://) nor a local path")
    if _CONTROL.search(spec):
        raise DataError(f"{shown}: a URL may not hold a control character (a line break, a tab)")
    if spec[scheme[1]:scheme[1] + 1] in ("/", "\\", ""):
        raise DataError(f"{shown}: a URL with no host after its {spec[scheme[0]:scheme[1]]} (a third slash?)")


def normal_url(spec: str) -> str:
    """``spec`` with the scheme of a URL (:func:`is_url`) in lower case, as fsspec and the checks here take it;
    anything else as it is."""
    if not is_url(spec):
        return spec
    scheme, sep, rest = spec.partition("://")
    return scheme.lower() + sep + rest


def is_remote(spec: str | Path) -> bool:
    """Whether ``spec`` is a URL read through fsspec or a ``pipe:`` command (not a local path)."""
    text = str(spec) if isinstance(spec, str) else ""
    return is_url(text) or text.startswith(PIPE_PREFIX)


def is_pipe(spec: str | Path) -> bool:
    """Whether ``spec`` is a ``pipe:`` command."""
    return isinstance(spec, str) and spec.startswith(PIPE_PREFIX)


@dataclass(frozen=True)
class ShardSet:
    manifest: Manifest
    urls: list[str]
    """One per shard, in manifest order: an absolute local path, a URL, or a ``pipe:`` command."""
    location: str
    """What the user typed (for messages)."""
    remote: bool
    """True when the shards are URLs or ``pipe:`` commands."""


# ---------------------------------------------------------------------------------------------- filesystems

_FS: dict[tuple[int, str], Any] = {}
_FS_LOCK = threading.Lock()


def _protocol(url: str) -> str:
    return url.split("://", 1)[0].lower()


def fs_for(url: str) -> Any:
    """The fsspec filesystem for ``url`` (one per protocol and process: a forked DataLoader worker makes its own,
    as an aiohttp session belongs to the loop of the process that made it). Raises SourceError naming the extra
    to install when the protocol's driver is missing."""
    proto = _protocol(url)
    key = (os.getpid(), proto)
    with _FS_LOCK:
        if key in _FS:
            return _FS[key]
        extra = {"s3": "s3", "gs": "gs"}.get(proto)
        try:
            import fsspec

            if proto in ("http", "https"):
                import aiohttp

                # a size query (HEAD) ends within this total; a range request sets its own (_read_range)
                timeout = aiohttp.ClientTimeout(total=CONNECT_TIMEOUT_S + READ_TIMEOUT_S,
                                                sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)
                fs = fsspec.filesystem(proto, skip_instance_cache=True, client_kwargs={"timeout": timeout})
            elif proto == "s3":
                endpoint, _ = s3_endpoint()
                fs = fsspec.filesystem(proto, skip_instance_cache=True, config_kwargs=S3_CONFIG,
                                       **({"endpoint_url": endpoint} if endpoint else {}))
                fs.retries = 1  # gpufeed's Retry is the one retry layer (s3fs's own tries would multiply it)
            else:
                fs = fsspec.filesystem(proto, skip_instance_cache=True)
        except ImportError as exc:
            pkg = {"s3": "s3fs", "gs": "gcsfs"}.get(proto, str(exc.name or "fsspec"))
            hint = f"install gpufeed[{extra}] ({pkg})" if extra else f"install {pkg}"
            raise SourceError(f"{url}: reading {proto}:// needs {pkg}; {hint}") from None
        except ValueError as exc:  # fsspec: unknown protocol
            raise SourceError(f"{url}: {proto}:// is not a protocol this gpufeed reads ({exc})") from None
        _FS[key] = fs
        return fs


S3_ENDPOINT_VARS = ("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL", "S3_ENDPOINT_URL")
"""The environment variables that name the S3 endpoint, the first one set wins: the AWS CLI's and boto3's
(``AWS_ENDPOINT_URL_S3`` before ``AWS_ENDPOINT_URL``, their own order), then s5cmd's ``S3_ENDPOINT_URL``. None set:
botocore's choice (``endpoint_url`` in ~/.aws/config, else AWS's endpoint for the region)."""
S3_CONFIG = {"connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S,
             "retries": {"mode": "standard", "total_max_attempts": 1}}
"""botocore's client settings for s3: one try per call, as :class:`Retry` retries (botocore's own tries would
multiply its bound: an unreachable endpoint took a minute to fail)."""
_ENDPOINT = re.compile(r"https?://[^\s/?#@]+(?:/[^\s?#]*)?", re.IGNORECASE)


def s3_endpoint() -> tuple[str | None, str | None]:
    """``(endpoint URL, the variable it came from)`` from :data:`S3_ENDPOINT_VARS` (the first one set), or
    ``(None, None)``. A value that is not an ``http(s)://HOST[:PORT][/PATH]`` URL raises SourceError naming the
    variable."""
    for var in S3_ENDPOINT_VARS:
        value = os.environ.get(var, "").strip()
        if value:
            if not _ENDPOINT.fullmatch(value):
                raise SourceError(f"{var}={value[:80]!r} is not an S3 endpoint URL (http:// or https://HOST[:PORT]); "
                                  f"set it like https://s3.example.com or unset it (gpufeed reads "
                                  f"{', then '.join(S3_ENDPOINT_VARS)})")
            return value, var
    return None, None


def _endpoint_note(url: str) -> str:
    """For an s3 URL, the end of a failure's sentence: the endpoint tried, the variable it came from and the
    variables gpufeed reads; empty for other URLs."""
    if not url.startswith("s3://"):
        return ""
    from gpufeed.core.redact import redact

    client = getattr(_FS.get((os.getpid(), "s3")), "_s3", None)
    tried = getattr(getattr(client, "meta", None), "endpoint_url", None)
    try:
        value, var = s3_endpoint()
    except SourceError:
        value, var = None, None
    tried = tried or value
    where = f"endpoint {redact(tried)}" if tried else "AWS's default endpoint"
    origin = f" from {var}" if var and tried == value else ""
    unset = "" if var else ", none of them set"
    return f" ({where}{origin}; gpufeed reads {', then '.join(S3_ENDPOINT_VARS)}{unset})"


_REACHED: set[str] = set()
"""Endpoints (``scheme://host`` for http(s), the endpoint for s3, the protocol for gs) that answered a request in
this process (a forked worker inherits the parent's)."""


def _endpoint_key(url: str) -> str:
    if url.startswith(("http://", "https://")):
        parts = urllib.parse.urlsplit(url)
        return f"{parts.scheme}://{parts.netloc}"
    if url.startswith("s3://"):
        try:
            return f"s3 {s3_endpoint()[0] or ''}"
        except SourceError:
            return "s3"
    return _protocol(url)


def _unreachable(exc: BaseException) -> bool:
    """Whether ``exc`` says no connection could be made at all (refused, or the connect timed out)."""
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        return _unreachable(exc.__cause__)
    os_error = getattr(exc, "os_error", None)
    return (isinstance(exc, ConnectionRefusedError) or isinstance(os_error, ConnectionRefusedError)
            or type(exc).__name__ in ("EndpointConnectionError", "ConnectTimeoutError", "ConnectionTimeoutError",
                                      "ClientConnectorError"))


def _classify_for(url: str, exc: BaseException) -> tuple[bool, str]:
    """:func:`_classify`, except that an endpoint that never answered in this process and cannot be connected to
    fails at once (it is unreachable, not busy); the reason of such a failure, or of an unknown host, names the
    endpoint for s3 (a failure after the retries does too)."""
    transient, reason = _classify(exc)
    if transient and _unreachable(exc) and _endpoint_key(url) not in _REACHED:
        return False, f"cannot connect ({reason}){_endpoint_note(url)}"
    if reason.startswith("cannot resolve the host"):
        reason += _endpoint_note(url)
    return transient, reason


def _fs_path(url: str) -> str:
    """The path fsspec's filesystem takes: the whole URL for http(s), ``bucket/key`` for s3/gs."""
    return url if _is_http(url) else url.split("://", 1)[1]


def _is_http(url: str) -> bool:
    return url[:8].lower().startswith(("http://", "https://"))


# ---------------------------------------------------------------------------------------------- errors

_TRANSIENT_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


def _classify(exc: BaseException) -> tuple[bool, str]:
    """``(transient, reason)`` for an exception raised by a remote read."""
    if isinstance(exc, FileNotFoundError) and exc.__cause__ is not None:
        return _classify(exc.__cause__)  # fsspec's http info() turns every failure into FileNotFoundError
    if type(exc).__name__ == "TooManyRedirects":  # aiohttp's, with status 0
        return False, "too many redirects"
    kinds = {k.__name__ for k in type(exc).__mro__}
    if "RedirectClientError" in kinds:  # aiohttp's: a redirect to file://, data:, or no URL at all
        target = _short(exc)
        scheme = target.split(":", 1)[0].lower() if ":" in target else ""
        what = f"redirects to {scheme}://" if scheme and scheme.isascii() and scheme.isalpha() else "such redirects"
        return False, (f"{what} are refused: gpufeed follows a redirect only to an http(s) URL (the server "
                       f"redirected to {target[:80]!r})")
    cause = exc.__cause__
    if ("ClientResponseError" in kinds and cause is not None
            and "HttpProcessingError" in {k.__name__ for k in type(cause).__mro__}):
        # aiohttp reports a reply it cannot parse as a ClientResponseError of status 400: no server sent it
        detail = " ".join(str(getattr(cause, "message", "") or cause).split())[:100]
        return False, (f"the server's reply is not valid HTTP, not an HTTP error it sent ({detail}; bytes past "
                       f"the Content-Length a reply announced read so)")
    status = getattr(exc, "status", None)  # aiohttp's ClientResponseError
    response = getattr(exc, "response", None)  # botocore's ClientError (S3)
    if isinstance(response, dict):
        status = (response.get("ResponseMetadata") or {}).get("HTTPStatusCode")
        if (response.get("Error") or {}).get("Code") in ("NoSuchKey", "NoSuchBucket"):
            status = 404
    if isinstance(exc, FileNotFoundError) or status == 404:
        return False, "not found (HTTP 404)"
    if isinstance(exc, PermissionError):
        return False, f"access denied ({_short(exc)})"
    if isinstance(status, int):
        if status in (401, 403):
            return False, f"access denied (HTTP {status})"
        if status == 416:
            return False, "HTTP 416 (the object is shorter than the manifest says)"
        if status in _TRANSIENT_STATUS or status >= 500:
            return True, f"HTTP {status}"
        return False, f"HTTP {status}"
    import asyncio
    import socket

    if isinstance(exc, asyncio.TimeoutError):  # not a TimeoutError before Python 3.11
        return True, "timed out"
    name = type(exc).__name__
    os_error = getattr(exc, "os_error", None)
    if isinstance(os_error, socket.gaierror) or isinstance(exc, socket.gaierror) or name == "ClientConnectorDNSError":
        return False, f"cannot resolve the host ({_short(os_error or exc)})"
    if isinstance(exc, (TimeoutError, ConnectionError)) or name in (
            "ServerTimeoutError", "ClientConnectorError", "ClientOSError", "ServerDisconnectedError",
            "ClientPayloadError", "ConnectionTimeoutError", "SocketTimeoutError", "EndpointConnectionError",
            "ReadTimeoutError", "ConnectTimeoutError", "ResponseStreamingError", "IncompleteReadError"):
        return True, _short(exc) or name
    if isinstance(exc, OSError):
        return True, _short(exc) or name
    return False, _short(exc) or name


def _short(exc: BaseException | None) -> str:
    text = str(exc or "").strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:160]


class _ShortRead(Exception):
    """A range that came back shorter than asked (the stream ended early): retried from where it stopped."""


class _TimedOutPartly(Exception):
    """A range request that timed out after some bytes had arrived (a trickle): the bytes are kept (``data``) and the
    try counts as timed out."""

    def __init__(self, data: bytes) -> None:
        super().__init__("timed out")
        self.data = data


# ---------------------------------------------------------------------------------------------- remote stream

class RemoteStream(io.RawIOBase):
    """A read-only, forward-only stream over ``[offset, size)`` of a remote object, fetched in consecutive ranges
    with ``streams`` range requests in flight at once, each on its own thread and connection (a slow first byte is
    waited for N at a time, and a store that throttles each connection delivers up to N times as much). A range is
    ``chunk_bytes``, by default :data:`CHUNK_BYTES` / ``streams`` but at least :data:`MIN_CHUNK_BYTES`. The ranges
    are handed out in order, so the bytes are those of one sequential read; at most ``streams + 1`` ranges are
    held in memory (the one being read and those in flight). A failed range is retried
    from the byte where it broke, within ``retry``; then, or at once for a permanent error (not found, access
    denied, unknown host), reads raise :class:`SourceError` naming the URL. Never reads past ``size``."""

    def __init__(self, url: str, size: int, offset: int = 0, retry: Retry | None = None,
                 chunk_bytes: int | None = None, streams: int | None = None, deadline: Deadline | None = None) -> None:
        super().__init__()
        self.url = url
        self.deadline = _earliest(deadline)
        """Reads still waiting then fail (:data:`Deadline`; the earlier of ``deadline`` and the job's)."""
        self.size = size
        self.pos = offset
        self.retry = retry or RETRY
        self.streams = min(max(int(streams or STREAMS), 1), MAX_STREAMS)
        self.chunk = max(int(chunk_bytes or max(CHUNK_BYTES // self.streams, min(MIN_CHUNK_BYTES, CHUNK_BYTES))), 1)
        self._fs = fs_for(url)
        self._path = _fs_path(url)
        self._buf = memoryview(b"")
        self._next = offset  # the first byte not yet asked for
        self._pool = ThreadPoolExecutor(max_workers=self.streams, thread_name_prefix="gpufeed-fetch")
        self._ahead: collections.deque[Future] = collections.deque()
        self._ask()

    def readable(self) -> bool:
        return True

    def tell(self) -> int:
        """The offset in the object of the next byte this stream returns."""
        return self.pos

    def _ask(self) -> None:
        """Keep ``streams`` ranges in flight (fewer near the end of the object)."""
        while len(self._ahead) < self.streams and self._next < self.size:
            end = min(self._next + self.chunk, self.size)
            self._ahead.append(self._pool.submit(self._fetch, self._next, end))
            self._next = end

    def _fetch(self, start: int, end: int) -> bytes:
        """Bytes ``[start, end)``, retried within the bound from wherever a try stopped."""
        parts: list[bytes] = []
        got = start
        waits = self.retry.waits()
        failures = timeouts = 0
        while True:
            left = _left(self.deadline, self.url, f" (at byte {got} of {self.size})")
            try:
                try:
                    data = _read_range(self._fs, self.url, self._path, got, end, left)
                    timed_out = False
                except _TimedOutPartly as partly:  # the bytes that came before the time bound count
                    data, timed_out = partly.data, True
                _REACHED.add(_endpoint_key(self.url))
                parts.append(data)
                got += len(data)
                if got >= end:
                    return b"".join(parts)
                if len(data) >= MIN_PROGRESS_BYTES:
                    failures = timeouts = 0  # progress: the bounds count tries in a row that bring (almost) nothing
                raise _TimedOutPartly(b"") if timed_out else _ShortRead()
            except SourceError:
                raise
            except Exception as exc:  # noqa: BLE001 - every failure is classified below
                transient, reason = ((True, "stream cut short") if isinstance(exc, _ShortRead)
                                     else (True, "timed out") if isinstance(exc, _TimedOutPartly)
                                     else _classify_for(self.url, exc))
                if not transient:
                    raise SourceError(f"{self.url}: {reason}") from None
                failures += 1
                timeouts = timeouts + 1 if reason == "timed out" else 0
                if timeouts >= MAX_TIMEOUTS_IN_A_ROW and self.deadline is None:  # a bounded read says its bound
                    raise ReadTimedOut(f"{self.url}: stream ended at byte {got} of {self.size}: {timeouts} tries in a "
                                      f"row timed out (slower than {MIN_BYTES_PER_S >> 10} KiB/s, or no answer in "
                                      f"{READ_TIMEOUT_S:g} s){_endpoint_note(self.url)}") from None
                left = _left(self.deadline, self.url, f" (at byte {got} of {self.size}, {reason})")
                if failures >= self.retry.attempts:
                    detail = "" if isinstance(exc, _ShortRead) else f" ({reason})"
                    raise SourceError(f"{self.url}: stream ended at byte {got} of {self.size}{detail} after "
                                      f"{failures} attempts{_endpoint_note(self.url)}") from None
                wait_s = waits[failures - 1] if failures - 1 < len(waits) else 0.0
                time.sleep(wait_s if left is None else min(wait_s, left))

    def readinto(self, b: Any) -> int:
        if self.closed:
            raise ValueError("read from a closed stream")
        while not self._buf:
            if not self._ahead:
                return 0
            data = self._ahead.popleft().result()
            self._ask()
            self._buf = memoryview(data)
        n = min(len(b), len(self._buf))
        b[:n] = self._buf[:n]
        self._buf = self._buf[n:]
        self.pos += n
        return n

    def close(self) -> None:
        if not self.closed:
            for fut in self._ahead:
                fut.cancel()
            self._ahead.clear()
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._buf = memoryview(b"")
        super().close()


def _read_range(fs: Any, url: str, path: str, start: int, end: int, limit_s: float | None = None) -> bytes:
    """Bytes ``[start, end)`` of a remote object, or fewer when the response ends early. An http(s) range is read
    here as it arrives (raw bytes: no content encoding is accepted; at most one byte past the range is read before
    a server that ignores the range is refused; the request is bounded in time by :data:`MIN_BYTES_PER_S`);
    s3 and gs through their fsspec driver. ``limit_s`` (seconds left to the caller's deadline) shortens the http(s)
    request's time bound. Raises SourceError, or what the driver raises."""
    if not _is_http(url):
        return fs.cat_file(path, start=start, end=end)
    import asyncio

    import aiohttp
    from fsspec.asyn import sync

    want = end - start
    total = READ_TIMEOUT_S + want / MIN_BYTES_PER_S
    timeout = aiohttp.ClientTimeout(total=total if limit_s is None else max(min(total, limit_s), 0.001),
                                    sock_connect=CONNECT_TIMEOUT_S, sock_read=READ_TIMEOUT_S)

    async def get() -> bytes:
        session = await fs.set_session()
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        async with session.get(fs.encode_url(path), headers=headers, timeout=timeout) as r:
            if r.status >= 400:
                r.raise_for_status()  # ClientResponseError: its status is classified
            if r.headers.get("Content-Encoding", "identity").lower() not in ("", "identity"):
                raise SourceError(f"{url}: the server sent the shard {r.headers['Content-Encoding'][:40]}-encoded; "
                                  f"gpufeed reads shards as stored")
            if r.status != 206 and start > 0:
                raise SourceError(f"{url}: the server answered a range request with HTTP {r.status} (it does not "
                                  f"honour range requests)")
            data = bytearray()
            try:
                while len(data) <= want:
                    more = await r.content.read(want + 1 - len(data))
                    if not more:
                        break
                    data += more
            except (asyncio.TimeoutError, TimeoutError):  # aiohttp's time bounds
                if data and len(data) <= want and r.status == 206:  # kept only where the next range is answered
                    raise _TimedOutPartly(bytes(data)) from None
                raise
        if len(data) > want:
            raise SourceError(f"{url}: the server sent more than the {want} bytes of a range (it does not honour "
                              f"range requests)")
        return bytes(data)

    return sync(fs.loop, get)


class _PipeStream(io.RawIOBase):
    """A ``pipe:`` command's standard output; at its end a non-zero exit status raises SourceError naming the
    command. Closing early ends the command and every process it started (it runs in a session of its own)."""

    def __init__(self, command: str) -> None:
        super().__init__()
        self.command = command
        # a shell, as webdataset runs pipe: specs: the command is one the user typed (command line or their own
        # config); open_set builds none from data, and a manifest naming "pipe:..." is refused (manifest.py)
        self._proc = subprocess.Popen(command, shell=True, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                                      bufsize=0, start_new_session=True)  # unbuffered: a read returns what is there

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        assert self._proc.stdout is not None
        n = self._proc.stdout.readinto(b)
        if not n:
            status = self._proc.wait()
            if status != 0:
                raise SourceError(f"{PIPE_PREFIX}{self.command}: the command exited with status {status}")
        return n or 0

    def close(self) -> None:
        if not self.closed:
            try:
                os.killpg(self._proc.pid, signal.SIGKILL)  # the shell and what it started, still running or not
            except (ProcessLookupError, PermissionError):
                pass
            if self._proc.stdout is not None:
                self._proc.stdout.close()
            self._proc.wait()
        super().close()


def remote_size(url: str, retry: Retry | None = None, deadline: Deadline | None = None) -> int:
    """The size in bytes of the remote object at ``url`` (retried within the bound, no try started after
    ``deadline`` or the job's). Raises SourceError."""
    url = normal_url(url)
    fs, path = fs_for(url), _fs_path(url)
    retry = retry or RETRY
    waits = retry.waits()
    bound = _earliest(deadline)
    for attempt in range(1, retry.attempts + 1):
        _left(bound, url, " (asking for its size)")
        try:
            size = fs.size(path)
            _REACHED.add(_endpoint_key(url))
            if not isinstance(size, int) or size < 0:
                raise SourceError(f"{url}: the server does not report the size")
            return size
        except SourceError:
            raise
        except Exception as exc:  # noqa: BLE001 - classified below
            transient, reason = _classify_for(url, exc)
            if not transient:
                raise SourceError(f"{url}: {reason}") from None
            left = _left(bound, url, f" (asking for its size: {reason})")
            if attempt >= retry.attempts:
                error = ReadTimedOut if reason == "timed out" else SourceError
                raise error(f"{url}: {reason} after {attempt} attempts{_endpoint_note(url)}") from None
            time.sleep(waits[attempt - 1] if left is None else min(waits[attempt - 1], left))
    raise AssertionError("unreachable")  # pragma: no cover


def open_shard(url: str, *, size: int | None = None, offset: int = 0, retry: Retry | None = None,
               chunk_bytes: int | None = None, streams: int | None = None,
               deadline: Deadline | None = None) -> BinaryIO:
    """Open one shard for reading from ``offset``: a local path (a plain file), a ``pipe:`` command (its output;
    ``offset`` must be 0) or a remote URL (:class:`RemoteStream` with ``streams`` range requests in flight,
    buffered; ``size`` unknown is asked of the server); ``streams`` is ignored for a local path or a command.
    ``url`` must come from :func:`open_set` or the user, never from data. Raises SourceError (remote, pipe) or
    OSError (local)."""
    url = normal_url(url)
    if url.startswith(PIPE_PREFIX):
        if offset:
            raise SourceError(f"{url}: a pipe: command is read from its start only")
        return io.BufferedReader(_PipeStream(url[len(PIPE_PREFIX):]), 1 << 20)  # type: ignore[return-value]
    if is_url(url):
        if size is None:
            size = remote_size(url, retry, deadline)
        if not 0 <= offset <= size:
            raise SourceError(f"{url}: offset {offset} is outside the shard's {size} bytes")
        stream = RemoteStream(url, size, offset, retry, chunk_bytes, streams, deadline)
        return io.BufferedReader(stream, 1 << 20)  # type: ignore[return-value]
    f = open(url, "rb", buffering=1 << 20)
    if offset:
        f.seek(offset)
    return f


def read_bytes(url: str, limit: int, what: str = "file", retry: Retry | None = None) -> bytes:
    """The whole of a small user-named file (a manifest), local or remote, refused when over ``limit`` bytes."""
    url = normal_url(url)
    deadline = None
    if not is_url(url):
        p = Path(url)
        if not p.is_file():
            raise SourceError(f"{url}: no such {what}")
        size = p.stat().st_size
    else:
        t0 = time.monotonic()
        size = remote_size(url, retry, (t0 + CONNECT_TIMEOUT_S + READ_TIMEOUT_S, f"the {what} did not answer"
                                        f" within {CONNECT_TIMEOUT_S + READ_TIMEOUT_S:g} s"))
        if size <= limit:  # the whole read, retries included, ends by this: a trickling server cannot hold it
            total = CONNECT_TIMEOUT_S + READ_TIMEOUT_S + size / MIN_BYTES_PER_S
            deadline = (t0 + total, f"the {what} came slower than {MIN_BYTES_PER_S >> 10} KiB/s (not all of its "
                                    f"{size} bytes in {total:.1f} s: {CONNECT_TIMEOUT_S:g} s to connect, "
                                    f"{READ_TIMEOUT_S:g} s of read timeout, and its size at that rate)")
    if size > limit:
        raise SourceError(f"{url}: the {what} is {size} bytes, more than the {limit} gpufeed reads")
    with open_shard(url, size=size, retry=retry, deadline=deadline) as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise SourceError(f"{url}: the {what} is more than the {limit} bytes gpufeed reads")
    return data


def _load_manifest(url: str, retry: Retry | None = None) -> Manifest:
    return parse_manifest(read_bytes(url, MAX_MANIFEST_BYTES, "manifest", retry), url)


# ---------------------------------------------------------------------------------------------- shard sets

MAX_PATTERN_SHARDS = MAX_SHARDS
"""Most shards a brace pattern may expand to."""


def expand_pattern(pattern: str) -> list[str]:
    """The locations a user-typed brace pattern names (braceexpand syntax), in order, at most
    :data:`MAX_PATTERN_SHARDS`. Raises DataError."""
    import braceexpand

    if _pattern_bound(pattern) > MAX_PATTERN_SHARDS:  # braceexpand holds a whole numeric range in memory
        raise DataError(f"{pattern}: the pattern names more than {MAX_PATTERN_SHARDS} shards")
    out = list(itertools.islice(braceexpand.braceexpand(pattern), MAX_PATTERN_SHARDS + 1))
    if len(out) > MAX_PATTERN_SHARDS:
        raise DataError(f"{pattern}: the pattern names more than {MAX_PATTERN_SHARDS} shards")
    return out


_INT_RANGE = re.compile(r"\{(-?\d+)\.\.(-?\d+)(?:\.\.-?(\d+))?\}")


def _pattern_bound(pattern: str) -> int:
    """At least the number of names a brace pattern expands to: the product of the lengths of its numeric
    ranges (``{a..b}``, ``{a..b..step}``), counted without building them; sequences and letter ranges are
    bounded by the pattern's length."""
    n = 1
    for a, b, step in _INT_RANGE.findall(pattern):
        n *= abs(int(b) - int(a)) // (int(step or 1) or 1) + 1
        if n > MAX_PATTERN_SHARDS:
            break
    return n


def _url_part(base: str, part: str) -> str:
    """One path part (data) as it goes after ``base``: URL-quoted for http(s); as is for s3 and gs, whose
    drivers take the key literally."""
    return urllib.parse.quote(part, safe="") if _is_http(base) else part


def _remote_root(base: str, root: str | None, where: str) -> str:
    """``base`` joined with a manifest's ``root`` (data): a relative path without ``..``, each part quoted
    (:func:`_url_part`)."""
    if not root:
        return base
    why = root_problem(root)
    parts = [p for p in root.replace("\\", "/").split("/") if p not in ("", ".")]
    if why is None and (root.startswith(("/", "\\")) or ".." in parts):
        why = "a remote set's root must be a relative path without '..'"
    if why is None and not parts:
        return base
    if why:
        raise DataError(f"{where}: root {root[:80]!r} is refused: {why}")
    return base + "/" + "/".join(_url_part(base, p) for p in parts)


_URL_WORD = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://")
_REDIRECT = re.compile(r"(?:\d*|&)(?:>>?|<)&?")


def _word_name(word: str) -> str:
    """The file name one word of a location names: the basename of a URL's path (any scheme: the query and
    fragment are not part of it) or of a path."""
    if word.startswith(REMOTE_PREFIXES) or _URL_WORD.match(word):
        word = urllib.parse.unquote(urllib.parse.urlsplit(word).path)
    return posixpath.basename(word.replace("\\", "/"))


def pipe_target(command: str) -> str:
    """The word of a user-typed ``pipe:`` command that names its shard: the last word (shell quoting undone)
    whose file name ends in a shard suffix (``.tar``, ``.tgz``, ``.tar.gz``) - the URL of ``aws s3 cp URL -``,
    ``gsutil cat URL``, ``curl -s URL``, ``curl -fsSL URL``, ``s5cmd cat URL``, the path of ``cat PATH``, wherever
    it stands among options, ``-`` and redirections - else the last word that is not an option, ``-`` or a
    redirection. Only compared with manifest names, never changed or run."""
    import shlex

    try:
        words = shlex.split(command, comments=False, posix=True)
    except ValueError:  # unbalanced quotes: the shell will say so when it runs; the name is the plain words'
        words = command.split()
    kept, after_redirect = [], False
    for w in words:  # drop redirections (2>/dev/null, > log, <in) and the word a bare operator takes
        if after_redirect:
            after_redirect = False
        elif _REDIRECT.match(w):
            after_redirect = _REDIRECT.fullmatch(w) is not None
        else:
            kept.append(w)
    shard_like = [w for w in kept if _word_name(w).endswith(SHARD_SUFFIXES)]
    if shard_like:
        return shard_like[-1]
    plain = [w for w in kept[1:] if w != "-" and not w.startswith(("-", "|", "&", ";"))]
    return plain[-1] if plain else (words[-1] if words else "")


def source_name(location: str) -> str:
    """The file name a pattern element names: the basename of a URL's path or a local path; for a ``pipe:``
    command, that of the word naming its shard (:func:`pipe_target`)."""
    if location.startswith(PIPE_PREFIX):
        return _word_name(pipe_target(location[len(PIPE_PREFIX):]))
    if is_url(location):
        location = urllib.parse.unquote(urllib.parse.urlsplit(location).path)
    return posixpath.basename(location.replace("\\", "/"))


def _check_pattern(manifest: Manifest, urls: list[str], spec: str, where: str) -> None:
    names = [s.name for s in manifest.shards]
    for i, (name, url) in enumerate(zip(names, urls)):
        got = source_name(url)
        if got != name:
            raise DataError(f"{spec}: shard {i} of the pattern is {got!r} but {where} lists {name!r}; the pattern "
                            f"and the manifest must name the same shards in the same order")
    if len(names) != len(urls):
        raise DataError(f"{spec}: the pattern names {len(urls)} shards but {where} lists {len(names)}")


def open_set(spec: str | Path, manifest: str | Path | None = None, retry: Retry | None = None) -> ShardSet:
    """The shard set the user named: a local folder or ``manifest.json`` (shards under the manifest's ``root``);
    a URL folder or manifest URL (the manifest fetched; shards = base URL + ``/`` + quoted name); or a brace
    pattern (local, URL, or ``pipe:CMD``) with ``manifest`` (a local path or URL of a manifest.json; by default
    the one next to the pattern, required for ``pipe:``), whose shard names must be the pattern's basenames in
    order. A folder given together with ``manifest`` holds the shards that manifest names (its ``root`` is not
    used). Raises DataError (one sentence)."""
    check_location(spec)
    check_location(manifest)
    text = normal_url(str(spec))
    pipe = text.startswith(PIPE_PREFIX)
    remote = pipe or is_url(text)
    if manifest is not None and str(manifest).startswith(PIPE_PREFIX):
        raise DataError(f"{manifest}: a manifest is a file or URL, not a pipe: command")
    mtext = None if manifest is None else normal_url(str(manifest))
    if pipe or ("{" in text and "}" in text) or (remote and text.endswith((".tar", ".tgz", ".tar.gz"))):
        urls = expand_pattern(text)
        if mtext is None:
            if pipe:
                raise DataError(f"{text}: a pipe: pattern needs --manifest (the set's manifest.json, e.g. from "
                                f"`gpufeed index ... --out DIR`)")
            mtext = (posixpath.dirname(urls[0]) if remote else str(Path(urls[0]).parent)) + "/" + MANIFEST_NAME
        m = _read_any_manifest(mtext, retry)
        if not remote:
            urls = [str(Path(u).absolute()) for u in urls]
        _check_pattern(m, urls, text, mtext)
        return ShardSet(manifest=m, urls=urls, location=text, remote=remote)
    if not remote:
        if mtext is not None:  # the folder (or its manifest.json) holds the shards the other manifest names
            m = read_manifest(mtext)
            root = Path(text).parent if text.endswith(".json") else Path(text)
        else:
            m = read_manifest(text)
            root = shard_root(m, text)
        # absolute local paths: a name like "-" must stay a file name wherever it is used
        return ShardSet(manifest=m, urls=[str(p.absolute()) for p in m.shard_paths(root)], location=text,
                        remote=False)
    base = text.rstrip("/")
    if base.endswith(".json"):
        murl, base = base, posixpath.dirname(base)
    else:
        murl = base + "/" + MANIFEST_NAME
    if mtext is not None:  # the URL folder holds the shards the given manifest names
        m = _read_any_manifest(mtext, retry)
    else:
        m = _load_manifest(murl, retry)
        base = _remote_root(base, m.root, murl)
    return ShardSet(manifest=m, urls=[base + "/" + _url_part(base, s.name) for s in m.shards],
                    location=text, remote=True)


def _read_any_manifest(where: str, retry: Retry | None) -> Manifest:
    return _load_manifest(where, retry) if is_url(where) else read_manifest(where)
