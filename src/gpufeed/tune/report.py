"""tune's outputs (docs/design.md §5): the ranked table the CLI prints (:func:`render`), the storage line, the run
folder (trials.jsonl, trials.parquet, summary.json, config.toml, environment.json, tune.png, report.md) and the
winning ``[loader]`` TOML with its ``[layout]`` (:func:`write_outputs`), and the chart (:func:`plot_trials`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gpufeed.config import LoaderConfig, TuneConfig, to_toml
from gpufeed.core.errors import one_line
from gpufeed.measure import bounds
from gpufeed.tune.decisions import Decision, describe
from gpufeed.tune.records import TuneReport


PASSWORD_REMOVED = ("the password of a URL below was removed (user:***@): give gpufeed train the URL with its "
                    "password again, on the command line or in a config file you do not share")
"""The first line of a TOML file tune writes (``--out``, the run folder's config.toml) when it hid a password."""


def render(report: TuneReport) -> str:
    """Ranked table + the one-line conclusion (what the CLI prints)."""
    rows = sorted(report.trials, key=lambda t: (not t.ok, -(t.samples_per_s or 0.0)))
    cuda = _is_cuda(report.device)
    head = (f"{'rank':>4} {'#':>3} {'phase':15} {'config':42} {'samples/s (min-max)':>24} {'start s':>7} "
            f"{'cores':>5} {'RSS MB':>7} {'read MB/s':>10}")
    lines = [head, "-" * len(head)]
    for rank, t in enumerate(rows, 1):
        if t.ok:
            rate = f"{t.samples_per_s:8.1f} ({t.samples_per_s_min:.0f}-{t.samples_per_s_max:.0f})"
        else:
            rate = "error"
        mark = "*" if t.trial == report.best_trial else " "
        lines.append(
            f"{rank:>4}{mark}{t.trial:>3} {t.phase:15} {describe(t, cuda, report.remote)[:42]:42} {rate:>24} "
            f"{_f(t.startup_s, 2):>7} {_f(t.tree_cores_used, 2):>5} "
            f"{_f(None if t.rss_max_bytes is None else t.rss_max_bytes / 1e6, 0):>7} "
            f"{bounds.read_rate_text(t.read_bytes_per_s, t.num_samples, short=True):>10}"
            + (f"  {one_line(t.error)}" if t.error else ""))
    lines.append("")
    for what, attr in (("skipped samples", "num_skipped"), ("repeated samples", "num_repeated")):
        counts = [f"#{t.trial} {getattr(t, attr)}" for t in report.trials if getattr(t, attr)]
        if counts:
            lines.append(f"{what}: " + ", ".join(counts))
    for k, why in report.skipped.items():
        lines.append(f"skipped {k}: {why}")
    lines.append(f"stop: {report.stop_reason}; {report.num_trials} trials in {report.elapsed_s:.1f} s "
                 f"(budget {report.budget_s:g} s)")
    if report.bound:
        lines.append(f"bound: {report.bound}: {report.bound_evidence}")
    if report.storage is not None:
        lines.append(storage_line(report))
    if report.layout is not None:
        lay = report.layout
        lines.append(f"layout: {lay.ranks_per_node} rank(s) per node measured at once, {lay.usable_cores} usable "
                     f"cores, {lay.trainer_cores} left to each training process, {lay.device}"
                     + ("; samples/s is the node's aggregate, [loader] is per rank" if (lay.ranks_per_node or 1) > 1
                        else ""))
    if report.run_dir:
        lines.append(f"run folder: {report.run_dir}" + (f"; config: {report.out}" if report.out else ""))
    lines.append(report.conclusion)
    return "\n".join(lines)


def storage_line(report: TuneReport) -> str:
    """``storage: X MB/s (probe, N readers, cold); the best trial reads Y MB/s, P% of it: at the storage's limit``
    (or below it), the limit being :data:`gpufeed.measure.bounds.STORAGE_FRACTION` of the storage rate."""
    st = report.storage
    assert st is not None
    line = f"storage: {st.bytes_per_s / 1e6:,.1f} MB/s ({st.source}, {st.readers} reader(s), {st.cache})"
    best = next((t for t in report.trials if t.trial == report.best_trial), None)
    if best is None or best.read_bytes_per_s is None or st.bytes_per_s <= 0:
        return line
    read = best.read_bytes_per_s
    if read <= 0 and best.num_samples > 0:
        return line + f"; the best trial read from the {bounds.PAGE_CACHE}"
    limit = "at the storage's limit" if bounds.storage_limited(read, st.bytes_per_s) else "below the storage's limit"
    return line + f"; the best trial reads {read / 1e6:,.1f} MB/s, {100 * read / st.bytes_per_s:.0f}% of it: {limit}"


def _is_cuda(device: str) -> bool:
    return device.split(":")[0] == "cuda"


def _f(v: float | None, digits: int) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def write_outputs(report: TuneReport, cfg: TuneConfig, base: LoaderConfig) -> TuneReport:
    """Write the run folder and the [loader] TOML; returns the report with their paths set."""
    from gpufeed.core.records import atomic_write_bytes, atomic_write_text, make_run_dir, write_json, write_jsonl, write_parquet
    from gpufeed.core.redact import redact
    from gpufeed.core.system import environment_snapshot

    def hidden(text: str) -> str:
        """A file's text with the passwords of its URLs hidden, saying so (a tuned.toml is committed, a run
        folder shared; ``gpufeed train`` is given the URL with its password again)."""
        safe = redact(text)
        return safe if safe == text else (f"# {PASSWORD_REMOVED}\n" + safe)

    run = Path(cfg.run_dir) if cfg.run_dir else make_run_dir("tune")
    run.mkdir(parents=True, exist_ok=True)
    out = None
    if report.best is not None:
        out = Path(cfg.out) if cfg.out else run / "loader.toml"
        header = (f"Written by gpufeed tune on {report.shards}\n{report.conclusion}\n"
                  f"gpufeed train --config {out.name} reads these sections ([layout]: the layout it was tuned for).")
        text = to_toml("loader", report.best, header=header)
        if report.layout is not None:  # gpufeed train warns when it runs a different layout
            text += "\n" + to_toml("layout", report.layout)
        atomic_write_bytes(out, hidden(text).encode())
    report = dataclasses.replace(report, run_dir=str(run), out=None if out is None else str(out))
    write_jsonl(run / "trials.jsonl", report.trials)
    if report.trials:
        write_parquet(run / "trials.parquet", report.trials)
    cfg_text = to_toml("tune", cfg) + "\n" + to_toml("loader", base)
    atomic_write_bytes(run / "config.toml", hidden(cfg_text).encode())
    try:
        env = environment_snapshot(with_torch=True)
    except Exception as exc:  # the snapshot must never sink the run
        env = {"error": f"{type(exc).__name__}: {exc}"}
    write_json(run / "environment.json", env)
    try:
        plot_trials(report, run / "tune.png")
    except Exception as exc:  # a chart failure is noted, the records stand
        report = dataclasses.replace(report, decisions=[*report.decisions, Decision(
            "outputs", "chart-failed", detail={"error": one_line(exc)})])
    summary = dataclasses.replace(report, trials=[])
    write_json(run / "summary.json", summary)
    text = render(report)
    atomic_write_text(run / "report.md",  # a link there is replaced, its target untouched; passwords hidden
        f"# gpufeed tune\n\n{report.conclusion}\n\n![samples/s](tune.png)\n\n```\n{text}\n```\n\n"
        "## Search path\n\n" + "".join(f"- {d.sentence}\n" for d in report.decisions))
    return report


def plot_trials(report: TuneReport, path: str | Path) -> Path:
    """PNG: samples/s against num_workers (climb) and every trial ranked, with min-max bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [t for t in report.trials if t.ok]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(3.5, 0.35 * len(ok) + 1.5)),
                                   gridspec_kw={"width_ratios": [1, 1.6]})
    climb = sorted((t for t in ok if t.phase == "workers"), key=lambda t: t.num_workers)
    if climb:
        xs = [t.num_workers for t in climb]
        ys = [t.samples_per_s for t in climb]
        err = [[y - t.samples_per_s_min for y, t in zip(ys, climb)], [t.samples_per_s_max - y for y, t in zip(ys, climb)]]
        ax1.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=f"decode={climb[0].decode}")
    if report.baseline is not None:
        ax1.axhline(report.baseline.samples_per_s, color="grey", ls="--", label="ImageFolder best")
    from matplotlib.ticker import MaxNLocator

    ax1.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax1.set_xlabel("num_workers")
    ax1.set_ylabel("samples/s (median, min-max)")
    ax1.set_title("worker climb")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    ranked = sorted(ok, key=lambda t: t.samples_per_s)
    labels = [f"#{t.trial} {t.phase}: {describe(t, _is_cuda(report.device), report.remote)}" for t in ranked]
    vals = [t.samples_per_s for t in ranked]
    lo = [v - t.samples_per_s_min for v, t in zip(vals, ranked)]
    hi = [t.samples_per_s_max - v for v, t in zip(vals, ranked)]
    colors = ["tab:orange" if t.trial == report.best_trial else ("tab:grey" if t.pipeline != "gpufeed" else "tab:blue")
              for t in ranked]
    ax2.barh(range(len(ranked)), vals, xerr=[lo, hi], color=colors, capsize=2)
    ax2.set_yticks(range(len(ranked)), labels, fontsize=7)
    ax2.set_xlabel("samples/s")
    ax2.set_title("all trials (orange = chosen)")
    from gpufeed.core.redact import redact

    fig.suptitle(redact(report.conclusion)[:160], fontsize=8)
    fig.tight_layout()
    from gpufeed.core.records import atomic_writer

    with atomic_writer(path) as f:  # never through a link at that name
        fig.savefig(f, format="png", dpi=100)
    plt.close(fig)
    return Path(path)
