"""``run.json``: the run folder's ledger of steps (docs/design.md §8). Written atomically after every change of a
step's state, so a run killed at any point leaves a ledger the next run reads: a step is skipped only when the
ledger says it finished with the same hash and its output record still has the sha256 recorded."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.core.records import read_json_file, utc_now, write_json

RUN_JSON = "run.json"
FORMAT = "gpufeed-run"
VERSION = 1
MAX_RUN_JSON_BYTES = 4 << 20
MAX_RECORD_BYTES = 64 << 20


def sha256_json(obj: Any) -> str:
    """The hash of a plain value, key order ignored: a step's options and input identities."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode()).hexdigest()


def file_sha256(path: str | Path) -> str | None:
    """sha256 of a regular file (never through a link), or None when it is missing or not a regular file."""
    p = Path(path)
    try:
        if p.is_symlink() or not p.is_file():
            return None
        h = hashlib.sha256()
        fd = os.open(p, os.O_RDONLY | os.O_NOFOLLOW)
        with os.fdopen(fd, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
        return h.hexdigest()
    except OSError:
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


def load_previous(run_dir: Path) -> dict[str, StepState]:
    """The steps of an earlier run.json in ``run_dir``, by name ({} when there is none). A run.json that is not
    one (another format, a newer version, unreadable) is refused: the folder is someone else's."""
    path = run_dir / RUN_JSON
    if not path.exists() and not path.is_symlink():
        return {}
    data = read_json_file(path, MAX_RUN_JSON_BYTES, "run.json")
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise DataError(f"{path} is not a gpufeed run record; give [run] dir a folder of its own")
    if data.get("version") != VERSION:
        raise DataError(f"{path} is run.json version {data.get('version')!r}; this gpufeed reads version {VERSION}")
    known = {f for f in StepState.__dataclass_fields__}
    out = {}
    for raw in data.get("steps") or []:
        if isinstance(raw, dict) and isinstance(raw.get("name"), str):
            out[raw["name"]] = StepState(**{k: v for k, v in raw.items() if k in known})
    return out
