"""Secrets in user-typed URLs (``https://user:password@host/...``, ``https://token@host/...``) are never
printed or recorded: :func:`redact` replaces them with ``***`` in any text (a URL, a brace pattern, a ``pipe:``
command, a one-sentence error, a TOML or markdown file), and :func:`redact_obj` in every string of a record.

The text is parsed, not matched against one pattern: each ``scheme://`` in it (the scheme case-insensitive, RFC 3986
§3.1) starts an authority that runs to the first ``/``, ``?``, ``#``, line break or the end of the text, and its
userinfo is everything before the authority's LAST ``@`` (RFC 3986 §3.2: the host holds no ``@``), so a password
holding ``@``, ``:``, quotes or spaces is hidden whole. An authority without ``@`` that is no ``host[:port]`` (a
password holding ``/``, ``?`` or ``#``, which RFC 3986 wants percent-encoded: ``http://user:pa/ss@host``) is taken
to the last ``@`` of its line (within :data:`MAX_EXTENDED_USERINFO` characters). Too much hidden is the price of never too little: ``http://host failed for
me@example`` becomes ``http://***@example``. What cannot be told from a host and a path is left: a lone token
holding ``/`` (``http://tok/en@host``) or a password of digits before a ``/`` (``http://user:12/34@host``).
"""

from __future__ import annotations

import re
from typing import Any, Iterator

HIDDEN = "***"
"""What a password (or a lone token) becomes."""

_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://")
"""A URL's start: ``scheme://`` (used by :func:`split_url` at the start of a URL)."""
_SCHEME_RUN = re.compile(r"(?<![A-Za-z0-9+.\-])[A-Za-z0-9+.\-]*:/(/)?")
"""A whole run of scheme characters followed by ``:/`` or ``://``, matched once per run (the lookbehind keeps the
scan linear). A scheme starts with a letter (RFC 3986 §3.1), so the scheme is the run from its first letter:
``1https://``, ``.https://``, ``-https://`` and ``3s3://`` hold the schemes ``https`` and ``s3``. Found by
:func:`find_schemes`."""
_LETTER = re.compile(r"[A-Za-z]")
_AUTHORITY_END = re.compile(r"[/?#\r\n]")
_PORT = re.compile(r"[0-9]*")
_PATH_START = re.compile(r"[/?#]")


MAX_EXTENDED_USERINFO = 4096
"""Characters after an authority that is no ``host[:port]`` searched for the ``@`` ending its userinfo (a bound, so
a long line of such URLs is redacted in linear time)."""


def _looks_like_host(authority: str) -> bool:
    """Whether the first word of an authority without ``@`` is ``host``, ``host:port`` or ``[v6]:port`` (else: a
    userinfo whose password holds a ``/``, ``?`` or ``#``)."""
    words = authority.split()
    word = words[0] if words else ""
    if word.startswith("["):
        return True
    host, colon, port = word.rpartition(":")
    return not colon or (":" not in host and _PORT.fullmatch(port) is not None)


def _userinfo_end(text: str, start: int) -> int:
    """The index of the ``@`` that ends the userinfo of the authority starting at ``text[start]``, or -1."""
    m = _AUTHORITY_END.search(text, start)
    end = m.start() if m else len(text)
    at = text.rfind("@", start, end)
    if at >= 0 or _looks_like_host(text[start:end]):
        return at
    bound = stop = min(len(text), start + MAX_EXTENDED_USERINFO)
    for brk in "\n\r":
        i = text.find(brk, start, stop)
        stop = stop if i < 0 else i
    at = text.rfind("@", start, stop)
    if at < 0 and stop < bound:  # a password holding a line break: its userinfo ends at the @ before / ? #
        m = _PATH_START.search(text, start, bound)
        at = text.rfind("@", start, m.start() if m else bound)
    return at


def _collapsed_userinfo_end(text: str, start: int) -> int:
    """The last ``@`` of the first path segment after ``scheme:/`` at ``text[start]``, or -1."""
    m = _AUTHORITY_END.search(text, start)
    return text.rfind("@", start, m.start() if m else len(text))


def _hide(userinfo: str) -> str:
    user, colon, _ = userinfo.partition(":")
    return f"{user}:{HIDDEN}" if colon else HIDDEN


def find_schemes(text: str) -> Iterator[tuple[int, int, bool]]:
    """``(start, end, slashes)`` of every ``scheme:/`` in ``text``, wherever the scheme starts (at the first letter of
    its run of scheme characters, whatever precedes it): ``text[start:end]`` is ``scheme://`` when ``slashes``,
    else ``scheme:/`` (the form pathlib leaves of a URL made into a path: ``ftp://u:pw@host/x`` ->
    ``ftp:/u:pw@host/x``)."""
    for m in _SCHEME_RUN.finditer(text):
        letter = _LETTER.search(text, m.start(), m.end())
        if letter is not None:
            yield letter.start(), m.end(), m.group(1) is not None


def redact(text: str) -> str:
    """``text`` with the password (or lone token) of every ``scheme://user:password@`` in it replaced by
    ``***``; the user name stays. Idempotent. ``scheme:/user:pw@host/``, the collapsed form, has its first path
    segment taken as an authority only when that segment holds an ``@``."""
    if ":/" not in text:
        return text
    out, pos = [], 0
    for _, start, slashes in find_schemes(text):
        if start < pos:  # inside a userinfo already hidden
            continue
        while slashes and start < len(text) and text[start] in "/\\":  # http:///u:pw@h is u:pw@h to a URL parser
            start += 1
        at = _userinfo_end(text, start) if slashes else _collapsed_userinfo_end(text, start)
        if at < 0:
            continue
        hidden = _hide(text[start:at])
        out.append(text[pos:start])
        out.append(hidden)
        pos = at
    out.append(text[pos:])
    return "".join(out)


def redact_obj(obj: Any) -> Any:
    """A JSON-able tree (dicts, lists, strings) with :func:`redact` applied to every string, keys included."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, dict):
        return {redact_obj(k): redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [redact_obj(v) for v in obj]
    return obj


def split_url(url: str) -> tuple[str, str | None, str, str]:
    """``(scheme lower-cased, userinfo or None, host[:port], rest)`` of a URL, the authority found as
    :func:`redact` finds it (so a password holding ``@`` or ``/`` never lands in the host); ``("", None, "",
    url)`` for text that does not start with ``scheme://``."""
    m = _SCHEME.match(url)
    if not m:
        return "", None, "", url
    start = m.end()
    at = _userinfo_end(url, start)
    userinfo = None if at < 0 else url[start:at]
    host_start = start if at < 0 else at + 1
    e = _AUTHORITY_END.search(url, host_start)
    end = e.start() if e else len(url)
    return m.group(0)[:-3].lower(), userinfo, url[host_start:end], url[end:]
