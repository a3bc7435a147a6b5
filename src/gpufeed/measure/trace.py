"""The run's timeline for outside tools (docs/design.md §5): every rank's step marks as a Chrome trace,
``trace.json`` in the trace-event format that Perfetto, ``chrome://tracing`` and Holistic Trace Analysis read.

One complete (``"ph": "X"``) event per step, data wait, host-to-device copy and compute, in microseconds; ``pid`` is
the node, ``tid`` the rank, ``cat`` the mode; one event per mode and rank spans its timed window. The data-wait and
copy events of a mode add up to the data stall % the run reports for it (:func:`stall_pct`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

TRACE_NAME = "trace.json"
WAIT_KINDS = ("data wait", "copy")
"""The events the data stall % counts."""


@dataclass
class RankSpans:
    """One rank's spans of one mode: (kind, start s from the window's start, seconds), and where the window started
    (``time.time()``)."""

    mode: str
    rank: int
    node: int
    host: str
    t0_unix: float
    wall_s: float
    spans: list[tuple[str, float, float]] = field(default_factory=list)


def events(ranks: list[RankSpans]) -> list[dict[str, Any]]:
    """The trace events of every rank's spans, on one timeline that starts at the earliest window."""
    if not ranks:
        return []
    origin = min(r.t0_unix for r in ranks)
    out: list[dict[str, Any]] = []
    named: set[tuple[int, int | None]] = set()
    for r in ranks:
        if (r.node, None) not in named:
            named.add((r.node, None))
            out.append({"name": "process_name", "ph": "M", "pid": r.node, "tid": 0,
                        "args": {"name": f"node {r.node}" + (f" ({r.host})" if r.host else "")}})
        if (r.node, r.rank) not in named:
            named.add((r.node, r.rank))
            out.append({"name": "thread_name", "ph": "M", "pid": r.node, "tid": r.rank,
                        "args": {"name": f"rank {r.rank}"}})
        base = (r.t0_unix - origin) * 1e6
        out.append({"name": r.mode, "cat": "mode", "ph": "X", "ts": round(base, 3), "dur": round(r.wall_s * 1e6, 3),
                    "pid": r.node, "tid": r.rank})
        out += [{"name": kind, "cat": r.mode, "ph": "X", "ts": round(base + start * 1e6, 3),
                 "dur": round(max(0.0, dur) * 1e6, 3), "pid": r.node, "tid": r.rank}
                for kind, start, dur in r.spans]
    return out


def write_trace(path: Path, ranks: list[RankSpans]) -> Path:
    """``{"traceEvents": [...], "displayTimeUnit": "ms"}`` at ``path``, written atomically."""
    import json

    from gpufeed.core.records import atomic_write_bytes

    doc = {"traceEvents": events(ranks), "displayTimeUnit": "ms"}
    atomic_write_bytes(path, json.dumps(doc, separators=(",", ":")).encode("utf-8"))
    return Path(path)


def stall_pct(trace: dict[str, Any], mode: str) -> float:
    """Σ data wait and copy events / Σ step events of ``mode``, in %: what the run reports as its data stall."""
    evs = [e for e in trace["traceEvents"] if e.get("ph") == "X" and e.get("cat") == mode]
    step = sum(e["dur"] for e in evs if e["name"] == "step")
    wait = sum(e["dur"] for e in evs if e["name"] in WAIT_KINDS)
    return 100.0 * wait / step if step > 0 else 0.0


PROFILE_DIR = "profile"
"""The run folder's torch.profiler traces (``--profile-steps``)."""


class StepProfiler:
    """``--profile-steps N``: N training steps under ``torch.profiler`` (CPU activity, and CUDA on a GPU), after one
    step of profiler warm-up, exported as a Chrome trace ``profile/rank-R.json`` in the run folder. Call
    :meth:`step` after every step; it stops by itself after N + 1 steps (:meth:`close` stops it early)."""

    def __init__(self, num_steps: int, run_dir: Path | None, *, cuda: bool, rank: int) -> None:
        self.num_steps, self.rank, self.cuda = num_steps, rank, cuda
        self.out = Path(run_dir) / PROFILE_DIR if run_dir is not None and num_steps > 0 else None
        self.path: Path | None = None
        self._prof: Any = None
        self._count = 0

    def start(self) -> "StepProfiler":
        if self.out is None:
            return self
        from torch.profiler import ProfilerActivity, profile, schedule

        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.cuda else [])
        self._prof = profile(activities=activities, schedule=schedule(wait=0, warmup=1, active=self.num_steps,
                                                                      repeat=1), on_trace_ready=self._export)
        self._prof.__enter__()
        return self

    def _export(self, prof: Any) -> None:
        assert self.out is not None
        self.out.mkdir(parents=True, exist_ok=True)
        self.path = self.out / f"rank-{self.rank}.json"
        prof.export_chrome_trace(str(self.path))

    @property
    def active(self) -> bool:
        return self._prof is not None

    def step(self) -> None:
        if self._prof is None:
            return
        self._prof.step()
        self._count += 1
        if self._count >= self.num_steps + 1:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
