"""``gpufeed run CONFIG.toml``: one config drives doctor -> synth -> shard -> verify -> io -> stage -> ceiling ->
tune -> measure -> train, passing results forward, in one run folder (docs/design.md §8).

The orchestrator sits above the jobs: it calls their public entry functions (``steps.STEP_TABLE``) and reads their
records; only the CLI imports it. Each step's hash covers its resolved options and its inputs' identities; a step
whose hash matches run.json's and whose output files are intact is skipped, and once a feeding step runs every
later step runs too. run.json is written atomically at every change, so a run stopped by Ctrl-C or kill -9
continues where it stopped."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from gpufeed.config import Config, load_config
from gpufeed.core.errors import DataError, GpufeedError, one_line
from gpufeed.core.records import utc_now
from gpufeed.pipeline.state import RunState, StepState, file_sha256, load_previous, sha256_json
from gpufeed.pipeline.steps import STEP_TABLE, Carry, Context, Step, check_no_link, manifest_sha256

__all__ = ["RunRecord", "run_pipeline", "render", "default_run_dir"]


@dataclass(frozen=True)
class StepLine:
    name: str
    status: str
    skipped: bool
    wall_s: float | None
    ok: bool | None


@dataclass(frozen=True)
class RunRecord:
    """What ``gpufeed run`` returns (the CLI's --json record)."""

    run_dir: str
    status: str
    ok: bool
    skipped: list[str]
    ran: list[str]
    steps: list[StepLine]
    report_html: str | None
    report_md: str | None
    verdict: dict[str, Any] | None = None
    """Copied from the last train record (measure, or the full train)."""
    wall_s: float = 0.0
    notes: list[str] = field(default_factory=list)


def default_run_dir(config_path: str | Path) -> Path:
    return Path("runs") / Path(config_path).name.removesuffix(".toml")


def _initial_carry(cfg: Config, run_dir: Path) -> Carry:
    """What the run starts from when a producing step is not in it: the config's own paths."""
    carry = Carry(images=cfg.shard.src, loader=cfg.loader, layout=cfg.layout)
    if "shard" not in cfg.run.steps:
        carry.set = cfg.train.shards or cfg.tune.shards
        carry.set_sha256 = manifest_sha256(carry.set, run_dir)
        carry.val = cfg.train.val_shards
        carry.val_sha256 = manifest_sha256(carry.val, run_dir)
    return carry


def _check_plan(cfg: Config) -> None:
    """Refuse, before any work, a run whose steps lack what they need (exit 2)."""
    steps = set(cfg.run.steps)
    if "shard" in steps and cfg.shard.src is None and "synth" not in steps:
        raise DataError("the shard step needs [shard] src (an image folder) or the synth step")
    if "shard" not in steps and steps & {"verify", "io", "stage", "ceiling", "tune", "measure", "train"} \
            and not (cfg.train.shards or cfg.tune.shards):
        raise DataError("without the shard step, give the shard set as [train] shards")
    if cfg.shard_val is not None and "shard" not in steps:
        raise DataError("[shard.val] is written by the shard step, which [run] steps leaves out: add \"shard\" to "
                        "steps, or give the validation set as [train] val_shards")
    if "stage" in steps and cfg.stage.dest is None:
        raise DataError("the stage step needs [stage] dest (the folder to copy the shard set to)")
    if "synth" in steps and "shard" in steps and cfg.shard.src is not None:
        raise DataError("[shard] src is set and the synth step writes the images shard reads: drop one of them")


def _fresh(folder: Path) -> None:
    """Empty a step's folder before the step runs (its job writes it from scratch); never through a link."""
    if folder.is_symlink():
        raise DataError(f"{folder} is a symbolic link; a run folder's step folders must be real folders")
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)


def _done_before(step: Step, before: StepState | None, st: StepState, prepared: Any, ctx: Context) -> bool:
    """Whether run.json's line ``before`` shows ``step`` done with this hash, its record the one the step writes
    (``<step>/summary.json``) with the sha256 recorded, and its output what the config resolves to now: the paths
    derived from it and the identities read back from the files (set manifests, the tuned config), the ceiling
    read back from its record. Nothing of run.json's output is used, only compared."""
    if before is None or before.status not in ("done", "check_failed") or before.hash != st.hash:
        return False
    record = ctx.record(step.name)
    if before.record != str(record.relative_to(ctx.run_dir)):
        return False
    if file_sha256(record, ctx.run_dir) != before.record_sha256:
        return False
    return step.output(ctx, prepared) == before.output


def _check_writes(step: Step, prepared: Any, ctx: Context) -> None:
    """Refuse (DataError naming it) a symbolic link on the way to any path the step's job writes in the run folder:
    its folder and the paths the pipeline derives there (synth's images, shard's set, tune's tuned config, ...)."""
    for path in [ctx.folder(step.name), *step.writes(prepared)]:
        check_no_link(ctx.run_dir, path, f"the {step.name} step's output")


def run_pipeline(config_path: str | Path, *, run_dir: str | Path | None = None, quiet: bool = False,
                 lines: Callable[[str], None] | None = None, report: bool = True) -> RunRecord:
    """Run the steps ``[run] steps`` names, in pipeline order, into one run folder; write the report last."""
    from gpufeed.core.dest import release_lock, take_lock

    t0 = time.perf_counter()
    cfg = load_config(config_path)
    _check_plan(cfg)
    out_dir = Path(run_dir or cfg.run.dir or default_run_dir(config_path)).absolute()  # resumable from any cwd
    if out_dir.is_symlink():
        raise DataError(f"run folder {out_dir} is a symbolic link; give a real folder")
    out_dir.mkdir(parents=True, exist_ok=True)
    lock = take_lock(out_dir / ".lock", what="run lock",
                     in_use=lambda who: f"run folder {out_dir} is in use by another gpufeed run{who}")
    say = lines or (lambda _line: None)
    try:
        previous = load_previous(out_dir)
        chosen = [s for s in STEP_TABLE if s.name in cfg.run.steps]
        state = RunState(config=str(config_path), config_sha256=file_sha256(config_path), run_dir=str(out_dir),
                         steps=[StepState(name=s.name, folder=s.name) for s in chosen])
        state.invocations = 1 + max((p.attempts for p in previous.values()), default=0)
        ctx = Context(cfg=cfg, run_dir=out_dir, carry=_initial_carry(cfg, out_dir), quiet=quiet, lines=lines)
        state.save(out_dir)
        try:
            _run_steps(chosen, state, previous, ctx, say)
        except KeyboardInterrupt:
            _stop(state, out_dir, "interrupted", "interrupted (Ctrl-C)")
            raise
        except GpufeedError as exc:
            _stop(state, out_dir, "interrupted" if getattr(exc, "signum", None) else "failed", one_line(exc))
            raise
        except Exception as exc:  # a bug in a step: still recorded, then the CLI's one sentence
            _stop(state, out_dir, "failed", f"{type(exc).__name__}: {one_line(exc)}")
            raise
        finally:
            if report:
                _write_report(out_dir, state, say)
        return _record(state, out_dir, time.perf_counter() - t0)
    finally:
        release_lock(lock)


def _run_steps(chosen: list[Step], state: RunState, previous: dict[str, StepState], ctx: Context,
               say: Callable[[str], None]) -> None:
    dirty = False
    for step in chosen:
        st = state.step(step.name)
        prepared, options, inputs = step.prepare(ctx)
        st.inputs = inputs
        st.hash = sha256_json({"step": step.name, "options": options, "inputs": inputs})
        before = previous.get(step.name)
        st.attempts = before.attempts if before else 0
        if not dirty and _done_before(step, before, st, prepared, ctx):
            assert before is not None
            for key in ("status", "record", "record_sha256", "output", "ok", "started", "finished", "wall_s"):
                setattr(st, key, getattr(before, key))
            st.skipped = True
            state.skipped.append(step.name)
            ctx.carry.apply(step.output(ctx, prepared), ctx.run_dir)
            state.save(ctx.run_dir)
            say(f"run: {step.name}: skipped (done before, same options and inputs)")
            if st.status == "check_failed" and step.name in ("shard", "verify", "stage"):
                break
            continue
        changed = before is not None and before.hash != st.hash
        folder = ctx.folder(step.name)
        _check_writes(step, prepared, ctx)
        if step.fresh_folder:
            _fresh(folder)
        else:
            if folder.is_symlink():
                raise DataError(f"{folder} is a symbolic link; a run folder's step folders must be real folders")
            folder.mkdir(parents=True, exist_ok=True)
        st.status, st.started, st.attempts = "running", utc_now(), st.attempts + 1
        state.ran.append(step.name)
        state.save(ctx.run_dir)
        say(f"run: {step.name}: running" + (" (options or inputs changed)" if changed else ""))
        t = time.perf_counter()
        outcome = step.execute(ctx, prepared, folder, changed)
        st.wall_s = round(time.perf_counter() - t, 3)
        st.finished, st.ok = utc_now(), outcome.ok
        st.status = "done" if outcome.ok else "check_failed"
        st.record = str(outcome.record.relative_to(ctx.run_dir))
        st.record_sha256 = file_sha256(outcome.record, ctx.run_dir)
        st.output = step.output(ctx, prepared)
        ctx.carry.apply(st.output, ctx.run_dir)
        state.save(ctx.run_dir)
        say(f"run: {step.name}: {st.status} in {st.wall_s:.1f} s")
        if step.feeds:
            dirty = True
        if outcome.stop:
            break
    failed = [s for s in state.steps if s.status == "check_failed"]
    pending = [s.name for s in state.steps if s.status == "pending"]
    state.status = "check_failed" if failed else "done"
    state.ok = not failed
    if pending:
        state.error = f"stopped after a failed check; not run: {', '.join(pending)}"
    state.save(ctx.run_dir)


def _stop(state: RunState, run_dir: Path, status: str, message: str) -> None:
    for st in state.steps:
        if st.status == "running":
            st.status, st.error, st.finished = status, message, utc_now()
    state.status, state.ok, state.error = status, False, message
    state.save(run_dir)


def _write_report(run_dir: Path, state: RunState, say: Callable[[str], None]) -> None:
    from gpufeed.report import write_report

    try:
        html, _md = write_report(run_dir)
    except GpufeedError as exc:  # the run's own outcome stands; the report's failure is a note
        say(f"note: report not written: {one_line(exc)}")
        return
    state.report = str(html.relative_to(run_dir))
    state.save(run_dir)


def _record(state: RunState, run_dir: Path, wall_s: float) -> RunRecord:
    from gpufeed.report.runfolder import MAX_RECORD_BYTES, read_json

    verdict = None
    for name in ("train", "measure"):
        st = next((s for s in state.steps if s.name == name and s.record), None)
        if st is not None:
            record = read_json(run_dir / st.record, run_dir, f"{name} record", MAX_RECORD_BYTES)
            verdict = record.get("verdict") if isinstance(record, dict) else None
            verdict = verdict if isinstance(verdict, dict) else None
            break
    report = run_dir / "report.html"
    notes = [state.error] if state.error else []
    return RunRecord(run_dir=str(run_dir), status=state.status, ok=bool(state.ok), skipped=list(state.skipped),
                     ran=list(state.ran), steps=[StepLine(s.name, s.status, s.skipped, s.wall_s, s.ok)
                                                for s in state.steps],
                     report_html=str(report) if report.exists() else None,
                     report_md=str(run_dir / "report.md") if (run_dir / "report.md").exists() else None,
                     verdict=verdict, wall_s=round(wall_s, 3), notes=notes)


def render(record: Any) -> str:
    get = record.get if isinstance(record, dict) else lambda k, d=None: getattr(record, k, d)
    lines = [f"gpufeed run: {get('status')} in {get('wall_s'):.1f} s, run folder {get('run_dir')}"]
    for s in get("steps") or []:
        s = s if isinstance(s, dict) else s.__dict__
        took = "skipped (done before)" if s["skipped"] else (f"{s['wall_s']:.1f} s" if s["wall_s"] is not None
                                                             else "-")
        lines.append(f"  {s['name']:<8} {s['status']:<13} {took}")
    verdict = get("verdict")
    if verdict:
        lines.append(f"verdict: {verdict.get('status')}: {verdict.get('reason') or verdict.get('summary') or ''}"
                     .rstrip(": "))
    for note in get("notes") or []:
        lines.append(f"note: {note}")
    if get("report_html"):
        lines.append(f"report: {get('report_html')}")
    return "\n".join(lines)
