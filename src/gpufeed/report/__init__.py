"""``gpufeed report RUN_DIR``: one self-contained HTML page (inline SVG, inline CSS, no script, nothing fetched) and
its Markdown twin, from the records of a ``gpufeed run`` folder, or of a single ``tune`` or ``train`` run folder
(docs/design.md §8).

Every number on the page is read from a record (JSON / JSONL files); the verdict is copied from the train record,
never re-derived; a record that is missing is said to be missing. This package imports no job: only core and
config."""

from __future__ import annotations

import html
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gpufeed.core.errors import DataError
from gpufeed.core.records import atomic_write_text, utc_now
from gpufeed.core.redact import redact
from gpufeed.report import svg
from gpufeed.report.runfolder import MAX_RECORD_BYTES, MAX_RUN_JSON_BYTES, read_json, read_log
from gpufeed.report.svg import fmt

__all__ = ["WrittenReport", "build", "report", "write_report", "render"]

STEP_FOLDERS = ("doctor", "synth", "shard", "verify", "io", "stage", "ceiling", "tune", "measure", "train")
RECORD_BYTES = {"doctor": 1 << 20, "synth": 1 << 20, "io": 4 << 20, "stage": 4 << 20, "shard": 64 << 20}
"""A step's summary.json at most, by step (others :data:`MAX_RECORD_BYTES`): shard's lists every rejected file."""
MAX_ROWS = 50
"""Rows of a table, items of a list, bars of a chart and ranks of a stacked chart, at most; the page says how many
more the record held."""
MAX_TRIAL_BARS = 40
"""Trials drawn in tune's chart at most (the first ones)."""
MAX_SERIES = 16
"""Lines of a line chart at most."""
MAX_POINTS = 1_000
"""Points of one line at most (evenly thinned beyond, saying so)."""
MAX_CELL_CHARS = 300
"""Characters of a value from a record in a table cell, a list item or a label (cut with '…')."""
MAX_PARA_CHARS = 2_000
"""Characters of a paragraph (a verdict's reason, a note)."""
MAX_PAGE_CHARS = 8 << 20
"""The page at most: the caps above keep it far below (every section is bounded); a page past it is refused."""
TRIAL_FIELDS = ("trial", "phase", "num_workers", "samples_per_s", "error", "pipeline")
LOG_FIELDS = ("step", "samples_per_s", "stall_pct", "mode", "rank")
HEALTH_FIELDS = ("t_s", "time_s", "rank", "temperature_c", "power_w", "sm_clock_mhz")


def _cut(value: Any, limit: int = MAX_CELL_CHARS) -> str:
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "…"


MAX_VALUE = 1e15
"""The largest magnitude a record's number may have to be shown or charted (no rate, step, byte count or time
gpufeed measures comes near it); past it the number is taken as missing, so a crafted 1e308 cannot overflow
a chart's scale."""


def _num(value: Any) -> float | None:
    """A finite number of a record: a plain one, or the median of a ``Stat`` ({median, min, max, ...}); else
    None."""
    if isinstance(value, dict):
        value = value.get("median")
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        return None
    try:
        number = float(value)
    except OverflowError:  # an integer past the floats
        return None
    return number if math.isfinite(number) and abs(number) <= MAX_VALUE else None


def _list(value: Any) -> list[Any]:
    """A list of a record (anything else, a string or an object where a list belongs, as none)."""
    return value if isinstance(value, list) else []


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _capped(items: list[Any], what: str, page: "Page") -> list[Any]:
    """The first :data:`MAX_ROWS` of ``items`` for a chart; the page says how many more were left out."""
    if len(items) > MAX_ROWS:
        page.para(_left_out(MAX_ROWS, len(items), what), "note")
    return items[:MAX_ROWS]


def _lines(page: Page, by_name: dict[str, list[tuple[float, float]]]) -> list[tuple[str, list[tuple[float, float]]]]:
    """The series of a line chart: at most :data:`MAX_SERIES` lines of at most :data:`MAX_POINTS` points each
    (evenly thinned), the page saying what was left out."""
    names = list(by_name)
    if len(names) > MAX_SERIES:
        page.para(_left_out(MAX_SERIES, len(names), "lines"), "note")
    out = []
    for name in names[:MAX_SERIES]:
        pts = by_name[name]
        if len(pts) > MAX_POINTS:
            stride = -(-len(pts) // MAX_POINTS)
            page.para(f"{_cut(name, 80)}: every {stride}th of its {len(pts):,} points is drawn.", "note")
            pts = pts[::stride]
        out.append((_cut(name, 80), pts))
    return out


def _left_out(shown: int, total: int, what: str) -> str:
    return f"{total - shown:,} more {what} in the record were left out (the page shows the first {shown:,})."


class Records:
    """The run folder's records, by step (``tune``, ``measure``, ...), read once."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self.run = read_json(folder / "run.json", folder, "run.json", MAX_RUN_JSON_BYTES)
        self.kind = "run"
        self.by_step: dict[str, dict[str, Any]] = {}
        self.dirs: dict[str, Path] = {}
        if self.run is not None:
            for name in STEP_FOLDERS:
                rec = read_json(folder / name / "summary.json", folder, f"{name} record",
                                RECORD_BYTES.get(name, MAX_RECORD_BYTES))
                if isinstance(rec, dict):
                    self.by_step[name], self.dirs[name] = rec, folder / name
            val = read_json(folder / "shard" / "val.json", folder, "shard record", RECORD_BYTES["shard"])
            if isinstance(val, dict):
                self.by_step["shard.val"] = val
            return
        rec = read_json(folder / "summary.json", folder, "record")
        if not isinstance(rec, dict):
            raise DataError(f"{folder} holds neither run.json (a gpufeed run folder) nor summary.json (a tune or "
                            f"train run folder)")
        if "modes" in rec:
            self.kind, step = "train", ("measure" if rec.get("mode") == "measure" else "train")
        elif "decisions" in rec or "best_samples_per_s" in rec:
            self.kind, step = "tune", "tune"
        else:
            raise DataError(f"{folder}/summary.json is neither a tune nor a train record")
        self.by_step[step], self.dirs[step] = rec, folder

    def train(self) -> tuple[str | None, dict[str, Any] | None]:
        """The train record the verdict comes from: the full training's, else the measurement's."""
        for name in ("train", "measure"):
            if name in self.by_step and self.by_step[name].get("verdict") is not None:
                return name, self.by_step[name]
        for name in ("train", "measure"):
            if name in self.by_step:
                return name, self.by_step[name]
        return None, None


class Page:
    """Sections of HTML and Markdown, written side by side."""

    def __init__(self) -> None:
        self.html: list[str] = []
        self.md: list[str] = []
        self.missing: list[str] = []

    def section(self, title: str) -> None:
        self.html.append(f"<h2>{html.escape(title)}</h2>")
        self.md.append(f"\n## {title}\n")

    def para(self, text: str, cls: str = "") -> None:
        text = _cut(text, MAX_PARA_CHARS)
        c = f' class="{cls}"' if cls else ""
        self.html.append(f"<p{c}>{html.escape(text)}</p>")
        self.md.append(text + "\n")

    def missing_record(self, what: str, why: str) -> None:
        self.missing.append(what)
        self.para(f"No {what} record in this folder ({why}).", "missing")

    def items(self, rows: list[str], what: str = "items") -> None:
        total, rows = len(rows), [_cut(r, MAX_PARA_CHARS) for r in rows[:MAX_ROWS]]
        if total > len(rows):
            rows.append(_left_out(len(rows), total, what))
        self.html.append("<ul>" + "".join(f"<li>{html.escape(r)}</li>" for r in rows) + "</ul>")
        self.md.append("".join(f"- {r}\n" for r in rows))

    def table(self, head: list[str], rows: list[list[Any]], classes: list[str] | None = None,
              what: str = "rows") -> None:
        total, rows = len(rows), [[_cut("" if x is None else x) for x in r] for r in rows[:MAX_ROWS]]
        body = []
        for i, r in enumerate(rows):
            c = f' class="{classes[i]}"' if classes and classes[i] else ""
            body.append(f"<tr{c}>" + "".join(f"<td>{html.escape(str(x))}</td>" for x in r) + "</tr>")
        self.html.append('<table><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in head)
                         + "</tr></thead><tbody>" + "".join(body) + "</tbody></table>")
        self.md.append("| " + " | ".join(head) + " |\n|" + "---|" * len(head) + "\n"
                       + "".join("| " + " | ".join(str(x).replace("|", "\\|") for x in r) + " |\n" for r in rows))
        if total > len(rows):
            self.para(_left_out(len(rows), total, what), "note")

    def chart(self, svg_text: str, caption: str) -> None:
        self.html.append(f'<figure>{svg_text}<figcaption>{html.escape(caption)}</figcaption></figure>')
        self.md.append(f"_{caption} (chart in report.html)_\n")


# --------------------------------------------------------------------------- sections


def _verdict(page: Page, rec: Records) -> str | None:
    name, train = rec.train()
    tune = rec.by_step.get("tune")
    verdict = (train or {}).get("verdict")
    status = verdict.get("status") if isinstance(verdict, dict) else None
    status = _cut(status, 40) if status is not None else None
    if train is None:
        page.html.append('<div class="verdict none"><div class="big">no verdict</div>')
        page.md.append("# Verdict: none\n")
        page.missing.append("train")
        page.para("No train record in this folder: the verdict comes from train --measure, which did not run here.")
    elif status is None:
        page.html.append('<div class="verdict none"><div class="big">no verdict</div>')
        page.md.append("# Verdict: none\n")
        page.para(f"The {name} record holds no verdict (mode {train.get('mode')!r}: only --measure gives one).")
    else:
        bound = verdict.get("bound")
        big = status + (f" — {_cut(bound, 40)}-bound" if bound else "")
        page.html.append(f'<div class="verdict {html.escape(status)}"><div class="big">{html.escape(big)}</div>')
        page.md.append(f"# Verdict: {big}\n")
        page.para(str(verdict.get("reason") or ""), "reason")
    changed = []
    if tune is not None:
        first = _first_trial(rec)
        best = _num(tune.get("best_samples_per_s"))
        if first is not None and best is not None:
            changed.append(f"tune: loader {fmt(first)} → {fmt(best)} samples/s (first trial → best, "
                           f"{_loader_words(tune.get('best'))})")
        elif best is not None:
            changed.append(f"tune: best loader {fmt(best)} samples/s ({_loader_words(tune.get('best'))})")
    fixes_tried = (train or {}).get("fixes_tried")
    if isinstance(fixes_tried, list) and fixes_tried:
        for f in fixes_tried:
            if isinstance(f, dict):
                kept = "kept" if f.get("kept") else "not kept"
                changed.append(f"fix {f.get('fix')}: {fmt(_num(f.get('before_samples_per_s')))} → "
                               f"{fmt(_num(f.get('after_samples_per_s')))} samples/s, {kept}")
    elif train is not None:
        changed.append("no fix was tried (the train record has no fixes_tried)")
    page.html.append('<div class="cols"><div><h3>What gpufeed changed</h3>')
    page.md.append("\n**What gpufeed changed**\n")
    page.items(changed or ["nothing: neither tune nor train ran here"])
    page.html.append("</div><div><h3>What is left for you</h3>")
    page.md.append("\n**What is left for you**\n")
    fixes = _list(verdict.get("fixes")) if isinstance(verdict, dict) else []
    if fixes:
        page.items([str(f) for f in fixes], "fixes")
    elif status == "fed":
        page.items(["nothing: the GPUs are fed; train with the tuned config"])
    else:
        page.items(["no fixes in the record"])
    page.html.append("</div></div></div>")
    return status


def _first_trial(rec: Records) -> float | None:
    folder = rec.dirs.get("tune")
    if folder is None:
        return None
    rows, _, _ = read_log(folder / "trials.jsonl", rec.folder, TRIAL_FIELDS)
    ok = [r for r in rows if _num(r.get("samples_per_s")) is not None and not r.get("error")
          and r.get("pipeline", "gpufeed") == "gpufeed"]
    return _num(ok[0]["samples_per_s"]) if ok else None


def _loader_words(best: Any) -> str:
    if not isinstance(best, dict):
        return "no loader recorded"
    return (f"{best.get('num_workers')} workers, decode {best.get('decode')}, batch {best.get('batch_size')}, "
            f"prefetch {best.get('prefetch_factor')}")


def _run_steps(page: Page, rec: Records) -> None:
    run = rec.run
    if not isinstance(run, dict):
        return
    page.section("Steps")
    rows, classes = [], []
    for s in _list(run.get("steps")):
        if not isinstance(s, dict):
            continue
        took = "skipped (done before)" if s.get("skipped") else (f"{fmt(_num(s.get('wall_s')))} s"
                                                                 if s.get("wall_s") is not None else "-")
        rows.append([s.get("name"), s.get("status"), took, s.get("error") or ""])
        classes.append("bad" if s.get("status") in ("failed", "check_failed", "interrupted") else "")
    page.table(["step", "status", "time", "error"], rows, classes, "steps")
    page.para(f"Run {run.get('status')}, started {run.get('started')}, updated {run.get('updated')}; config "
              f"{run.get('config')}.")


def _machine(page: Page, rec: Records) -> None:
    page.section("The machine")
    doc = rec.by_step.get("doctor")
    if doc is None:
        page.missing_record("doctor", "the doctor step did not run")
        return
    order = {"fail": 0, "warn": 1, "ok": 2}
    checks = sorted((c for c in _list(doc.get("checks")) if isinstance(c, dict)),
                    key=lambda c: order.get(str(c.get("status")), 3))
    page.table(["check", "status", "evidence", "fix"],
               [[c.get("name"), c.get("status"), c.get("evidence"), c.get("fix") or ""] for c in checks],
               [{"fail": "bad", "warn": "warn"}.get(str(c.get("status")), "") for c in checks[:MAX_ROWS]], "checks")


def _shards(page: Page, rec: Records) -> None:
    page.section("The shard set")
    sh = rec.by_step.get("shard")
    if sh is None:
        page.missing_record("shard", "the shard step did not run")
    else:
        rows = [[which, r.get("dest"), fmt(_num(r.get("num_samples"))), fmt(_num(r.get("num_classes"))),
                 fmt(_num(r.get("num_shards"))), f"{fmt((_num(r.get('total_bytes')) or 0) / 1e6)} MB",
                 fmt(_num(r.get("num_rejected")))]
                for which, r in (("train", sh), ("val", rec.by_step.get("shard.val"))) if isinstance(r, dict)]
        page.table(["set", "folder", "samples", "classes", "shards", "bytes", "rejected"], rows)
        rejected = [r for r in _list(sh.get("rejected")) if isinstance(r, dict)]
        if rejected:
            page.para(f"Rejected files ({len(rejected)}; first 20):")
            page.table(["file", "reason"], [[r.get("path") or r.get("file"), r.get("reason")] for r in rejected[:20]])
    ver = rec.by_step.get("verify")
    if ver is not None:
        state = "passed" if ver.get("ok") else f"FAILED ({ver.get('num_problems')} problem(s))"
        page.para(f"verify {state}: {ver.get('num_shards')} shards, {ver.get('num_samples')}/"
                  f"{ver.get('num_expected')} samples, {ver.get('num_decoded')} images decoded.")
    elif rec.kind == "run":
        page.missing_record("verify", "the verify step did not run")


def _storage(page: Page, rec: Records) -> None:
    page.section("Storage")
    io = rec.by_step.get("io")
    if io is None:
        page.missing_record("io", "the io step did not run")
    else:
        by_name: dict[str, list[tuple[float, float]]] = {}
        for loc in _list(io.get("locations")):
            if not isinstance(loc, dict):
                continue
            for cache in ("cold", "warm"):
                pts = [(x, y) for x, y in ((_num(s.get("readers")), _num(s.get("mb_per_s")))
                                           for s in _list(loc.get("steps")) if isinstance(s, dict)
                                           and s.get("cache") == cache) if x is not None and y is not None]
                if pts:
                    by_name[f"{Path(_cut(loc.get('path'))).name} {cache}"] = pts
        if by_name:
            page.chart(svg.lines("Storage ladder: read rate by readers", _lines(page, by_name), "readers", "MB/s"),
                       "MB/s read with 1, 2, 4, ... readers, cold (page cache dropped) and warm, from io/summary.json")
        else:
            page.para("The io record holds no measured steps.")
        for note in _list(io.get("notes"))[:5]:
            page.para(f"note: {note}", "note")
    st = rec.by_step.get("stage")
    if st is not None:
        page.para(f"Staged to {st.get('dest')}: {st.get('num_shards')} shards, "
                  f"{fmt((_num(st.get('bytes_copied')) or 0) / 1e6)} MB copied at {fmt(_num(st.get('mb_per_s')))} "
                  f"MB/s, checked: {st.get('checked')}.")


def _tuning(page: Page, rec: Records) -> None:
    page.section("Loader tuning")
    tune = rec.by_step.get("tune")
    if tune is None:
        page.missing_record("tune", "the tune step did not run")
        return
    rows, _, unread = read_log(rec.dirs["tune"] / "trials.jsonl", rec.folder, TRIAL_FIELDS)
    if len(rows) + unread > MAX_TRIAL_BARS:
        page.para(_left_out(min(len(rows), MAX_TRIAL_BARS), len(rows) + unread, "trials"), "note")
    items, notes = [], []
    best = tune.get("best_trial")
    for r in rows[:MAX_TRIAL_BARS]:
        label = _cut(f"#{r.get('trial')} {r.get('phase') or ''} w={r.get('num_workers')}", 60)
        items.append((label, None if r.get("error") else _num(r.get("samples_per_s"))))
        notes.append("best" if r.get("trial") == best else (f"error: {r.get('error')}"[:60] if r.get("error") else ""))
    if items:
        page.chart(svg.bars("Tuning trials (samples/s)", items, "samples/s", notes=notes),
                   "samples/s of each trial of tune, from tune/trials.jsonl")
    else:
        page.para("No trials in tune/trials.jsonl.")
    ratio = _num(tune.get("ratio_vs_baseline"))
    if ratio is not None:
        page.para(f"Baseline (ImageFolder + DataLoader): {fmt(_num(tune.get('baseline_samples_per_s')))} samples/s; "
                  f"the tuned loader is {fmt(ratio)}x the baseline.")
    else:
        page.para("No baseline was measured (tune's baseline_imagefolder was not set), so there is no baseline "
                  "ratio.")
    page.para(f"{tune.get('conclusion') or ''}. Stopped: {tune.get('stop_reason')}; "
              f"{fmt(_num(tune.get('elapsed_s')))} s of {fmt(_num(tune.get('budget_s')))} s budget.")


def _train_or_missing(page: Page, rec: Records) -> tuple[str | None, dict[str, Any] | None]:
    """The train record a section draws (see :meth:`Records.train`), or the page's line saying it is missing."""
    name, train = rec.train()
    if train is None:
        page.missing_record("train", "train --measure did not run")
    return name, train


def _rates(page: Page, rec: Records) -> None:
    page.section("Rates: compute ceiling, loader ceiling, end to end")
    name, train = _train_or_missing(page, rec)
    if train is None or name is None:
        return
    modes = _dict(train.get("modes"))
    ceiling = _dict(_dict(rec.by_step.get("ceiling")).get("modes")).get("synthetic")

    def rate(mode: str) -> float | None:
        m = modes.get(mode)
        return _num(m.get("samples_per_s")) if isinstance(m, dict) else None

    compute = rate("synthetic")
    if compute is None and isinstance(ceiling, dict):
        compute = _num(ceiling.get("samples_per_s"))
    items = [("compute ceiling", compute), ("loader ceiling", rate("loader-only")), ("end to end", rate("real"))]
    page.chart(svg.bars("Samples/s", items, "samples/s", colors=("#2563eb", "#d97706", "#16a34a")),
               f"modes synthetic, loader-only and real of {name}/summary.json, all ranks")


def _stalls(page: Page, rec: Records) -> None:
    page.section("Where each rank's step time goes")
    name, train = _train_or_missing(page, rec)
    if train is None or name is None:
        return
    real = _dict(train.get("modes")).get("real")
    if not isinstance(real, dict) or not _list(real.get("per_rank")):
        page.para(f"The {name} record holds no real-mode ranks (mode {train.get('mode')!r}).", "missing")
        return
    rows = []
    for r in _capped([r for r in real["per_rank"] if isinstance(r, dict)], "ranks", page):
        step = _num(r.get("step_s")) or 0.0
        parts = [_num(r.get(k)) or 0.0 for k in ("data_wait_s", "h2d_s", "compute_s")]
        rows.append((_cut(f"rank {r.get('rank')}", 40), [100.0 * p / step if step > 0 else 0.0 for p in parts]))
    page.chart(svg.stacked("Step time per rank (%)", rows, ["waiting for data", "copy", "compute"]),
               f"data wait, host-to-device copy and compute as % of each rank's step time, real mode of "
               f"{name}/summary.json; data stall {fmt(_num(real.get('stall_pct')))} %")


def _timeline(page: Page, rec: Records) -> None:
    page.section("Timeline")
    name, train = _train_or_missing(page, rec)
    if train is None or name is None:
        return
    rows, bad, unread = read_log(rec.dirs[name] / "log.jsonl", rec.folder, LOG_FIELDS)
    if unread:
        page.para(f"The first {len(rows) + bad:,} lines of {name}/log.jsonl are drawn; {unread:,} more were left out.",
                  "note")
    if not rows:
        page.para(f"No rows in {name}/log.jsonl.", "missing")
        return
    by_mode: dict[str, list[tuple[float, float]]] = {}
    stall: dict[str, list[tuple[float, float]]] = {}
    for r in rows:
        step, rate, pct = _num(r.get("step")), _num(r.get("samples_per_s")), _num(r.get("stall_pct"))
        key = f"{r.get('mode')} rank {r.get('rank')}"
        if step is not None and rate is not None:
            by_mode.setdefault(key, []).append((step, rate))
        if step is not None and pct is not None:
            stall.setdefault(key, []).append((step, pct))
    page.chart(svg.lines("Samples/s over steps", _lines(page, by_mode), "step", "samples/s"),
               f"samples/s per log interval, from {name}/log.jsonl")
    page.chart(svg.lines("Data wait over steps (% of step time)", _lines(page, stall), "step", "data stall %",
                         y_max=100.0), f"data stall % per log interval, from {name}/log.jsonl")
    if bad:
        page.para(f"{bad} line(s) of log.jsonl were not JSON records and were left out.", "note")


def _gpu_health(page: Page, rec: Records) -> None:
    page.section("GPU health")
    name, train = rec.train()
    health = [h for h in _list((train or {}).get("gpu_health")) if isinstance(h, dict)]
    folder = rec.dirs.get(name) if name else None
    rows, _, unread = read_log(folder / "gpu_health.jsonl", rec.folder, HEALTH_FIELDS) if folder else ([], 0, 0)
    if unread:
        page.para(f"{unread:,} more lines of gpu_health.jsonl were left out.", "note")
    if not health and not rows:
        page.para("Not sampled: no GPU was read through NVML in this run (a CPU run, or no driver).", "missing")
        return
    for field, unit in (("temperature_c", "°C"), ("power_w", "W"), ("sm_clock_mhz", "MHz")):
        series: dict[str, list[tuple[float, float]]] = {}
        for r in rows:
            t, v = _num(r.get("t_s") if "t_s" in r else r.get("time_s")), _num(r.get(field))
            if t is not None and v is not None:
                series.setdefault(f"rank {r.get('rank')}", []).append((t, v))
        if series:
            page.chart(svg.lines(f"{field}", _lines(page, series), "seconds", unit), f"{field} from gpu_health.jsonl")
    for h in _capped(health, "ranks", page):
        values = [f"{_cut(k, 40)} {_cut(v, 80)}" for k, v in h.items()
                  if k != "rank" and not isinstance(v, (list, dict))]
        page.para(f"rank {_cut(h.get('rank'), 40)}: " + ", ".join(values[:MAX_ROWS]))


CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;margin:0 auto;max-width:980px;padding:24px;
color:#111827;line-height:1.45}
h1{font-size:20px;margin:0 0 12px}h2{font-size:18px;border-bottom:1px solid #e5e7eb;padding-bottom:4px;margin-top:32px}
h3{font-size:14px;margin:8px 0}
.verdict{border-radius:10px;padding:18px 22px;border:2px solid #9ca3af;background:#f9fafb}
.verdict.fed{border-color:#16a34a;background:#f0fdf4}.verdict.starved{border-color:#dc2626;background:#fef2f2}
.verdict.unverified{border-color:#d97706;background:#fffbeb}
.big{font-size:40px;font-weight:700;text-transform:uppercase;letter-spacing:.02em}
.reason{font-size:17px}.cols{display:flex;gap:24px;flex-wrap:wrap}.cols>div{flex:1 1 300px}
table{border-collapse:collapse;width:100%;font-size:13px}td,th{border-bottom:1px solid #e5e7eb;padding:4px 6px;
text-align:left;vertical-align:top}tr.bad td{background:#fef2f2}tr.warn td{background:#fffbeb}
figure{margin:12px 0}figcaption{font-size:12px;color:#6b7280}svg{max-width:100%;height:auto}
.missing{color:#6b7280;font-style:italic}.note{color:#4b5563;font-size:13px}
footer{margin-top:32px;font-size:12px;color:#6b7280}
@media print{body{max-width:none;padding:0}h2{break-after:avoid}figure,table{break-inside:avoid}}
"""


def build(folder: str | Path) -> tuple[str, str, str, str | None, list[str]]:
    """The page for ``folder`` (a run folder, or a tune or train run folder): its kind (run, tune or train), HTML,
    Markdown, verdict status (None without one) and the records it says are missing."""
    folder = Path(folder)
    if not folder.is_dir():
        raise DataError(f"{folder} is not a folder")
    rec = Records(folder)
    page = Page()
    title = {"run": "gpufeed run", "tune": "gpufeed tune", "train": "gpufeed train"}[rec.kind]
    status = _verdict(page, rec)
    head_html, head_md = page.html, page.md
    page.html, page.md = [], []
    _run_steps(page, rec)
    if rec.kind == "run":
        _machine(page, rec)
        _shards(page, rec)
        _storage(page, rec)
    if rec.kind in ("run", "tune"):
        _tuning(page, rec)
    if rec.kind in ("run", "train"):
        _rates(page, rec)
        _stalls(page, rec)
        _timeline(page, rec)
        _gpu_health(page, rec)
    name = html.escape(str(folder))
    body = "".join(head_html + page.html)
    doc = (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8">'
           f'<meta name="viewport" content="width=device-width, initial-scale=1">'
           f"<title>{html.escape(title)}: {name}</title><style>{CSS}</style></head><body>"
           f"<h1>{html.escape(title)} — {name}</h1>{body}"
           f"<footer>Written by gpufeed report at {utc_now()} from the records in {name}. Every number is "
           f"read from those records.</footer></body></html>\n")
    md = f"# {title}: {folder}\n\n" + "\n".join(head_md + page.md)
    if len(doc) > MAX_PAGE_CHARS or len(md) > MAX_PAGE_CHARS:  # the caps above keep every section far below
        raise DataError(f"the report of {folder} would be more than {MAX_PAGE_CHARS:,} characters; it was not written")
    return rec.kind, redact(doc), redact(md), status, sorted(set(page.missing))


def write_report(folder: str | Path) -> tuple[Path, Path]:
    """Write report.html and its Markdown (report.md in a run folder; report-page.md beside a job's own report.md)
    atomically; return their paths."""
    written = report(folder)
    return Path(written.html), Path(written.markdown)


@dataclass(frozen=True)
class WrittenReport:
    """What ``gpufeed report`` returns: the folder, its kind (run, tune or train), the files written, the verdict
    status copied from the train record (None without one) and the records the page says are missing."""

    folder: str
    kind: str
    html: str
    markdown: str
    verdict: str | None
    missing: list[str]
    ok: bool = True


def report(folder: str | Path) -> WrittenReport:
    """Build the page for ``folder`` and write it (see :func:`write_report`)."""
    kind, page, markdown, verdict, missing = build(folder)
    html_path = Path(folder) / "report.html"
    md_path = Path(folder) / ("report.md" if kind == "run" else "report-page.md")
    atomic_write_text(html_path, page)
    atomic_write_text(md_path, markdown)
    return WrittenReport(folder=str(folder), kind=kind, html=str(html_path), markdown=str(md_path), verdict=verdict,
                         missing=missing)


def render(record: Any) -> str:
    get = record.get if isinstance(record, dict) else lambda k: getattr(record, k)
    lines = [f"report ({get('kind')} folder): {get('html')}", f"markdown: {get('markdown')}",
             f"verdict: {get('verdict') or 'none'}"]
    if get("missing"):
        lines.append(f"missing records: {', '.join(get('missing'))}")
    return "\n".join(lines)
