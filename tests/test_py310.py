"""pyproject says requires-python >= 3.10: none of the 3.11-only APIs most likely to slip in (add_note, tomllib,
...) in the package, tests, benchmarks or scripts.

CI (.ci/run) also runs the torch-free tests under a real Python 3.10; this static check covers every module,
including those that need torch, on whatever Python runs the suite.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
NEW_IN_311 = {
    "hashlib": {"file_digest"}, "enum": {"StrEnum"}, "asyncio": {"TaskGroup"}, "contextlib": {"chdir"},
    "datetime": {"UTC"}, "typing": {"LiteralString", "assert_never", "Self", "reveal_type", "Never"},
}
"""Module attributes that Python 3.10 lacks; besides, ``BaseException.add_note``, ``ExceptionGroup`` and ``except*``."""


def problems_in(source: str) -> list[str]:
    """``line: what`` for each 3.11-only use in ``source`` (``tomllib`` only behind a version check, as in
    config/toml_io.py)."""
    out = []
    guarded = set()
    tree = ast.parse(source)
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "version_info" in ast.unparse(node.test):
            guarded.update(id(n) for n in ast.walk(node))
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and (node.attr == "add_note" or
                                                node.attr in NEW_IN_311.get(ast.unparse(node.value), ())):
            out.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Name) and node.id in ("ExceptionGroup", "BaseExceptionGroup"):
            out.append(f"{node.lineno}: {node.id}")
        elif isinstance(node, ast.ImportFrom):
            out += [f"{node.lineno}: from {node.module} import {a.name}" for a in node.names
                    if a.name in NEW_IN_311.get(node.module or "", ())]
        if isinstance(node, (ast.Import, ast.ImportFrom)) and id(node) not in guarded:
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
            out += [f"{node.lineno}: import tomllib outside a version check" for n in names if n == "tomllib"]
        if type(node).__name__ == "TryStar":
            out.append(f"{node.lineno}: except*")
    return out


def test_the_check_finds_what_3_10_lacks() -> None:
    bad = ("import tomllib\nfrom typing import Self\nfrom hashlib import file_digest\n"
           "try:\n    pass\nexcept ValueError as exc:\n    exc.add_note('x')\n    raise ExceptionGroup('g', [exc])\n")
    assert sorted(problems_in(bad)) == ["1: import tomllib outside a version check", "2: from typing import Self",
                                        "3: from hashlib import file_digest",
                                        "7: exc.add_note", "8: ExceptionGroup"]
    ok = ("import os, sys\nos.chdir('.')\nmonkeypatch.chdir('.')\nif sys.version_info >= (3, 11):\n    import tomllib\n"
          "else:\n    import tomli as tomllib\n")
    assert problems_in(ok) == []


def test_no_python_3_11_only_api() -> None:
    found = []
    for path in sorted([*(ROOT / "src").rglob("*.py"), *(ROOT / "tests").glob("*.py"),
                        *(ROOT / "benchmarks").glob("*.py"), *(ROOT / "scripts").glob("*.py")]):
        found += [f"{path.relative_to(ROOT)}:{p}" for p in problems_in(path.read_text(encoding="utf-8"))]
    assert found == []
