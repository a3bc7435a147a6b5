"""Secrets in user-typed URLs (``https://user:password@host/...``, ``https://token@host/...``) are never
printed or recorded: :func:`redact` replaces them with ``***`` in any text (a URL, a brace pattern, a
one-sentence error)."""

from __future__ import annotations

import re

_USERINFO = re.compile(r"""(?i)\b([a-z][a-z0-9+.-]*://)([^/@\s"'<>]+)@""")


def _hide(m: re.Match) -> str:
    user, colon, _ = m.group(2).partition(":")
    return f"{m.group(1)}{user + ':' if colon else ''}***@"


def redact(text: str) -> str:
    """``text`` with the password (or lone token) of every ``scheme://user:password@`` in it replaced by
    ``***``; the user name stays."""
    return _USERINFO.sub(_hide, text)
