"""Help text from the config fields: ``field_help`` (docstring, default and range), read from the docstrings under
the fields in ``config/schema.py``. See docs/design.md section 7. No torch here: ``gpufeed --help`` loads it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import re
from pathlib import Path
from typing import Any

from gpufeed.config.limits import SIZE_UNITS

_NONE_MEANS = re.compile(r"[;.]\s*None = (.+?)\.?$", re.DOTALL)
"""A docstring's closing "; None = <what None means>." clause."""
_SIZE_NAMES = ("PiB", "PB", "TiB", "TB", "GiB", "GB", "MiB", "MB", "KiB", "KB")


def field_help(cls: type, name: str) -> str:
    """Help text of config field ``cls.name``: its docstring, then its default and range in brackets, e.g.
    ``"Target samples per shard.  [default: 10000; 1<=x<=10000000]"``. A closing "None = ..." clause of the
    docstring says what the default None means and is shown as the default."""
    f = {f.name: f for f in dataclasses.fields(cls)}[name]
    doc = field_doc(cls, name)
    notes = []
    if f.default is None:
        m = _NONE_MEANS.search(doc)
        if m:
            doc = doc[:m.start()] + "."
            notes.append(f"default: {m.group(1)}")
    elif f.default is not dataclasses.MISSING:
        notes.append(f"default: {help_value(f.default, f.metadata.get('size', False))}")
    if "max" in f.metadata:
        notes.append(range_text(f))
    return f"{doc}  [{'; '.join(notes)}]" if notes else doc


def range_text(f: dataclasses.Field) -> str:  # type: ignore[type-arg]
    """The range of a ``bounded`` field as ``lo<=x<=hi`` (``<`` where open), bounds as the user types them."""
    lo, hi = (help_value(f.metadata[k], f.metadata["size"]) for k in ("min", "max"))
    return f"{lo}{'<' if f.metadata['min_open'] else '<='}x{'<' if f.metadata['max_open'] else '<='}{hi}"


def field_doc(cls: type, name: str) -> str:
    """The docstring under field ``cls.name`` in ``config/schema.py`` ("" without one)."""
    return _field_docs().get(cls.__name__, {}).get(name, "")


@functools.lru_cache(maxsize=None)
def _field_docs() -> dict[str, dict[str, str]]:
    """Class name -> field name -> the docstring under that field (whitespace joined, ``markup`` dropped), read
    from the source of ``config/schema.py``: Python keeps no docstrings of attributes."""
    try:
        tree = ast.parse(Path(__file__).with_name("schema.py").read_text(encoding="utf-8"))
    except OSError:  # installed without its .py source: help shows defaults and ranges only
        return {}
    docs: dict[str, dict[str, str]] = {}
    for node in tree.body:
        if isinstance(node, ast.ClassDef):
            docs[node.name] = {
                stmt.target.id: " ".join(doc.value.value.replace("``", "").split())
                for stmt, doc in zip(node.body, node.body[1:])
                if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name)
                and isinstance(doc, ast.Expr) and isinstance(doc.value, ast.Constant)
                and isinstance(doc.value.value, str)}
    return docs


def help_value(value: Any, size: bool = False) -> str:
    """A default or bound as the user would type it: sizes in their largest exact unit, 2**63-1 as such."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return f"{value:g}"
    if isinstance(value, int) and size:
        exact = [(value // SIZE_UNITS[u.lower()], u) for u in _SIZE_NAMES
                 if value and value % SIZE_UNITS[u.lower()] == 0]
        n, unit = min(exact, default=(value, "B"))
        return f"{n}{unit}"
    if isinstance(value, int) and value >= 2**31 and (value + 1) & value == 0:
        return f"2**{value.bit_length()}-1"
    if isinstance(value, int) and value >= 2**31 and value & (value - 1) == 0:
        return f"2**{value.bit_length() - 1}"
    return str(value)
