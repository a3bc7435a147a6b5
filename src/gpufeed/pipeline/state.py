"""``run.json``: the run folder's ledger of steps (docs/design.md §8). Written atomically after every change of a
step's state, so a run killed at any point leaves a ledger the next run reads: a step is skipped only when the
ledger says it finished with the same hash and its output record still has the sha256 recorded."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass, field, fields
from pathlib import Path, PurePosixPath
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.core.records import utc_now, write_json
from gpufeed.core.safefs import open_below
from gpufeed.report.runfolder import MAX_RUN_JSON_BYTES, read_json

RUN_JSON = "run.json"
FORMAT = "gpufeed-run"
VERSION = 1
MAX_RECORD_BYTES = 64 << 20
STATUSES = ("pending", "running", "done", "check_failed", "failed", "interrupted")
MAX_STEPS = 64
"""Step lines run.json may hold (gpufeed writes one per step it knows, ten)."""
MAX_ATTEMPTS = 1_000_000


def sha256_json(obj: Any) -> str:
    """The hash of a plain value, key order ignored: a step's options and input identities."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def below(path: str | Path, root: str | Path) -> bool:
    """Whether ``path`` lies in the folder ``root`` (lexically, both made absolute; links are not followed)."""
    rel = os.path.relpath(os.path.abspath(path), os.path.abspath(root))
    return rel != os.pardir and not rel.startswith(os.pardir + os.sep)


def file_sha256(path: str | Path, run_dir: str | Path | None = None) -> str | None:
    """sha256 of a regular file, or None when it is missing, not a regular file or not readable. A file in the run
    folder ``run_dir`` is opened below it (:func:`gpufeed.core.safefs.open_below`: None when any component below
    the run folder is a link); any other file (the config, a set the config names) never through a link at its
    name."""
    p = Path(path)
    try:
        if run_dir is not None and below(p, run_dir):
            fd = open_below(p, run_dir, what="file")
        else:
            if p.is_symlink() or not p.is_file():
                return None
            fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        h = hashlib.sha256()
        with os.fdopen(fd, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except (OSError, DataError):
        return None


@dataclass
class StepState:
    """One step's line in run.json."""

    name: str
    status: str = "pending"
    """pending, running, done, check_failed (ran; its record says a check failed), failed, interrupted."""
    hash: str | None = None
    """sha256 of the step's resolved options and its inputs' identities."""
    inputs: dict[str, Any] = field(default_factory=dict)
    """What the hash covers besides the options: the identities of the step's inputs."""
    folder: str = ""
    """The step's sub-folder, relative to the run folder."""
    record: str | None = None
    """The step's record (summary.json), relative to the run folder."""
    record_sha256: str | None = None
    output: dict[str, Any] = field(default_factory=dict)
    """What later steps take from it (the set's path and manifest sha256, the tuned config, a rate)."""
    skipped: bool = False
    """True when this invocation found it done and did not run it."""
    ok: bool | None = None
    started: str | None = None
    finished: str | None = None
    wall_s: float | None = None
    error: str | None = None
    attempts: int = 0


@dataclass
class RunState:
    """run.json."""

    config: str
    config_sha256: str | None
    run_dir: str
    steps: list[StepState]
    format: str = FORMAT
    version: int = VERSION
    status: str = "running"
    """running, done, check_failed, failed, interrupted."""
    ok: bool | None = None
    started: str = field(default_factory=utc_now)
    updated: str = field(default_factory=utc_now)
    skipped: list[str] = field(default_factory=list)
    """The steps this invocation skipped (done before, same hash, output intact)."""
    ran: list[str] = field(default_factory=list)
    """The steps this invocation ran."""
    invocations: int = 1
    report: str | None = None
    error: str | None = None

    def step(self, name: str) -> StepState:
        return next(s for s in self.steps if s.name == name)

    def save(self, run_dir: Path) -> None:
        self.updated = utc_now()
        write_json(run_dir / RUN_JSON, self)


def _is_text(v: Any) -> bool:
    return isinstance(v, str) and len(v) <= 4096


def _is_sha(v: Any) -> bool:
    return isinstance(v, str) and len(v) == 64 and all(c in "0123456789abcdef" for c in v)


def _is_relative(v: Any) -> bool:
    """A path relative to the run folder, inside it: no root, no '..', no empty or '.' part, no control char."""
    if not _is_text(v) or not v or any(ord(c) < 32 for c in v) or "\\" in v:
        return False
    parts = PurePosixPath(v).parts
    return not PurePosixPath(v).is_absolute() and all(p not in ("..", ".") for p in parts) and \
        "/".join(parts) == v


def _is_count(v: Any) -> bool:
    return type(v) is int and 0 <= v <= MAX_ATTEMPTS


def _is_seconds(v: Any) -> bool:
    return v is None or (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v >= 0)


STEP_FIELD_CHECKS: dict[str, tuple[Any, str]] = {
    "name": (lambda v: _is_text(v) and v.isidentifier(), "a step name"),
    "status": (lambda v: v in STATUSES, f"one of {', '.join(STATUSES)}"),
    "hash": (lambda v: v is None or _is_sha(v), "a sha256 or null"),
    "inputs": (lambda v: isinstance(v, dict), "an object"),
    "folder": (lambda v: v == "" or _is_relative(v), "a path inside the run folder"),
    "record": (lambda v: v is None or _is_relative(v), "a path inside the run folder or null"),
    "record_sha256": (lambda v: v is None or _is_sha(v), "a sha256 or null"),
    "output": (lambda v: isinstance(v, dict), "an object"),
    "skipped": (lambda v: isinstance(v, bool), "true or false"),
    "ok": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "started": (lambda v: v is None or _is_text(v), "a time or null"),
    "finished": (lambda v: v is None or _is_text(v), "a time or null"),
    "wall_s": (_is_seconds, "a number of seconds or null"),
    "error": (lambda v: v is None or isinstance(v, str), "a sentence or null"),
    "attempts": (_is_count, f"an integer in 0..{MAX_ATTEMPTS}"),
}
"""What each field of a step line of run.json must be (run.json is read from a folder someone else may have
prepared: every field is checked before it is used)."""


def step_state(raw: Any, where: str) -> StepState:
    """The step line ``raw`` of run.json, every field checked (:data:`STEP_FIELD_CHECKS`; unknown fields are left
    out); DataError naming the field otherwise."""
    if not isinstance(raw, dict):
        raise DataError(f"{where} is not a gpufeed run record (a step is not an object)")
    values = {}
    for f in fields(StepState):
        if f.name not in raw:
            if f.name == "name":
                raise DataError(f"{where} is not a gpufeed run record (a step has no name)")
            continue
        ok, what = STEP_FIELD_CHECKS[f.name]
        if not ok(raw[f.name]):
            raise DataError(f"{where} is not a gpufeed run record (a step's {f.name} must be {what})")
        values[f.name] = raw[f.name]
    return StepState(**values)


def load_previous(run_dir: Path) -> dict[str, StepState]:
    """The steps of an earlier run.json in ``run_dir``, by name ({} when there is none). run.json is read below the
    run folder (no link, bounded, its structure bounded before parsing: :func:`gpufeed.report.runfolder.read_json`)
    and every field it passes on is type-checked (:func:`step_state`). A run.json that is not one (another format,
    a newer version, a field of the wrong type, unreadable) is refused: the folder is someone else's."""
    path = run_dir / RUN_JSON
    data = read_json(path, run_dir, "run.json", MAX_RUN_JSON_BYTES)
    if data is None:
        return {}
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{path} is not a gpufeed run record; give [run] dir a folder of its own")
    if data.get("version") != VERSION:
        version = data.get("version")
        shown = repr(version) if type(version) is int and abs(version) < 10 ** 6 else "another"
        raise DataError(f"{path} is run.json version {shown}; this gpufeed reads version {VERSION}")
    steps = data.get("steps", [])
    if not isinstance(steps, list) or len(steps) > MAX_STEPS:
        raise DataError(f"{path} is not a gpufeed run record (steps must be a list of at most {MAX_STEPS})")
    out: dict[str, StepState] = {}
    for raw in steps:
        st = step_state(raw, str(path))
        if st.name in out:
            raise DataError(f"{path} is not a gpufeed run record (it names a step twice)")
        out[st.name] = st
    return out
