"""The shape of the package (docs/design.md §1): the import graph of src/gpufeed, read with ast, has no cycle and
no job importing another job; and the light commands stay light (no torch for index, verify and io, no trainer for
``tune --help``)."""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from pathlib import Path

import gpufeed
from tests.common.shards import WDS_SAMPLE

SRC = Path(gpufeed.__file__).resolve().parent
JOBS = ("shard", "verify", "index", "tune", "train", "storage", "stage", "doctor", "memplan", "synth")
"""The job modules and packages: each is one command's library; the CLI imports them, they import no other job."""
KNOWN_JOB_IMPORTS = {
    ("gpufeed.shard.job", "gpufeed.index"),  # the index table of a written set (issue 18 item 6)
}
"""Job -> job imports that are still being removed; empty it as they go (a new one fails the test)."""


def module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def runtime_nodes(tree: ast.AST) -> list[ast.AST]:
    """Every node of ``tree`` but those under ``if TYPE_CHECKING:`` (annotations only: no import at run time)."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            skip.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    return [n for n in ast.walk(tree) if id(n) not in skip]


def import_graph() -> dict[str, set[str]]:
    """Module -> the gpufeed modules it imports anywhere in its text (lazy imports in functions included)."""
    files = {module_name(p): p for p in SRC.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        targets: set[str] = set()
        for node in runtime_nodes(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    base = ".".join(package[:len(package) - node.level + 1] + ([base] if base else []))
                names = [f"{base}.{a.name}" if f"{base}.{a.name}" in files else base for a in node.names]
            else:
                continue
            for name in names:
                while name and name not in files:
                    name = name.rpartition(".")[0]
                if name.startswith("gpufeed") and name != mod:
                    targets.add(name)
        graph[mod] = targets
    return graph


def job_of(mod: str) -> str | None:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in JOBS else None


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_import_graph_has_no_cycle() -> None:
    graph = import_graph()
    assert "gpufeed.measure.verdict" in graph and "gpufeed.shardset.manifest" in graph["gpufeed.verify"]  # it reads imports
    assert cycles(graph) == []


def test_cycles_are_found() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_job_imports_another_job() -> None:
    graph = import_graph()
    found = {(mod, dep) for mod, deps in graph.items() for dep in deps
             if job_of(mod) and job_of(dep) and job_of(mod) != job_of(dep)}
    assert found - KNOWN_JOB_IMPORTS == set(), "a job imports another job: move what they share below the jobs"
    assert KNOWN_JOB_IMPORTS - found == set(), "an allowed job import is gone: remove it from KNOWN_JOB_IMPORTS"


def test_nothing_below_the_cli_imports_it() -> None:
    graph = import_graph()
    entries = ("gpufeed.cli", "gpufeed.__main__")  # `python -m gpufeed` is the CLI too
    assert [mod for mod, deps in graph.items() if "gpufeed.cli" in deps and not mod.startswith(entries)] == []


# --------------------------------------------------------------------------- what a command loads

WRAPPER = """
import atexit, sys
atexit.register(lambda: print("LOADED", *sorted(m for m in sys.modules if m == "torch" or m.startswith(
    ("gpufeed.train", "gpufeed.tune"))), file=sys.stderr))
sys.argv = ["gpufeed", *sys.argv[1:]]
from gpufeed.cli import main
main()
"""
"""Runs ``gpufeed ARGS`` in a fresh interpreter and names, on stderr's last line, the heavy modules it loaded."""


def loaded(args: list[object], tmp_path: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC.parent), os.environ.get("PYTHONPATH", "")])}
    res = subprocess.run([sys.executable, "-c", WRAPPER, *map(str, args)], capture_output=True, text=True,
                         env=env, cwd=tmp_path, timeout=300)
    assert res.returncode == 0, res.stdout + res.stderr
    last = res.stderr.strip().splitlines()[-1].split()
    assert last[0] == "LOADED", res.stderr
    return last[1:]


def test_import_of_the_cli_loads_no_torch() -> None:
    res = subprocess.run([sys.executable, "-X", "importtime", "-c", "import gpufeed.cli"], capture_output=True,
                         text=True, check=True)
    imported = {line.rsplit("|", 1)[-1].strip() for line in res.stderr.splitlines() if "|" in line}
    assert "gpufeed.cli" in imported and "torch" not in imported


def test_index_verify_and_io_load_no_torch_and_tune_help_no_trainer(tmp_path: Path) -> None:
    shards = tmp_path / "shards"
    shards.mkdir()
    shutil.copy(WDS_SAMPLE, shards / "sample-000000.tgz")
    meta = tmp_path / "meta"
    assert loaded(["index", shards, "--out", meta, "--quiet"], tmp_path) == []
    assert loaded(["verify", meta, "--workers", "1", "--quiet"], tmp_path) == []
    assert loaded(["io", meta, "--seconds", "0.05", "--max-readers", "1", "--run-dir", tmp_path / "io", "--quiet"],
                  tmp_path) == []
    assert [m for m in loaded(["tune", "--help"], tmp_path) if m.startswith("gpufeed.train")] == []
