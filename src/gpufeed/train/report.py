"""The human side of a ``gpufeed train`` summary: :func:`render` (terminal text, the verdict last),
:func:`render_markdown` (report.md), :func:`chart_data` and :func:`plot_summary` (throughput.png), and
:func:`write_report`, which writes summary.json, the chart and report.md into the run folder (docs/design.md §5).

Everything here reads plain summary dicts (``to_jsonable(TrainRecord)``) and never imports torch."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpufeed.measure import bounds
from gpufeed.measure.health import HEALTH_NAME, INTERVAL_S, THROTTLE_NOTE_FRACTION, THROTTLE_NOTE_S, slowdowns, throttled
from gpufeed.measure.nvml import SLOWDOWN_LABELS
from gpufeed.core.records import atomic_write_text, to_jsonable, write_json
from gpufeed.train.records import SUMMARY_NAME, TrainRecord
from gpufeed.measure.verdict import STALL_FED_PCT, compute_ceiling_name

REPORT_NAME = "report.md"


def write_report(run_dir: Path, record: TrainRecord) -> None:
    """summary.json, throughput.png (when there is something to plot) and report.md in ``run_dir``."""
    from gpufeed.core.redact import redact_obj

    write_json(run_dir / SUMMARY_NAME, record)
    summary = redact_obj(to_jsonable(record))  # report.md and the chart show what summary.json holds
    plot = plot_summary(run_dir, summary)
    atomic_write_text(run_dir / REPORT_NAME, render_markdown(summary, plot))  # a link there is replaced


def _fmt_rate(m: dict[str, Any]) -> str:
    st = m.get("samples_per_s_stat")
    if st:
        return f"{m['samples_per_s']:.1f} (windows {st['min']:.1f}–{st['max']:.1f}, n={st['n']})"
    return f"{m['samples_per_s']:.1f}"


def render(s: dict[str, Any]) -> str:
    """Human summary of a summary.json dict; the verdict comes last."""
    if "mode" not in s:
        return "\n".join(s.get("notes", []))
    lines = [
        f"gpufeed train: {s['arch']} on {s['world_size']} x {s['device'].split(':')[0]}{_over_nodes(s)} "
        f"({s['backend']}), "
        f"amp {s['amp']}, batch {s['batch_size']} x accum {s['accum_steps']} x {s['world_size']} ranks = "
        f"{s['global_batch']}, {s['image_size']} px, mode {s['mode']}",
    ]
    if s["mode"] == "real":
        lines.append(f"steps {s['start_step']}→{s['step']} of {s['total_steps']}, epoch {s['epoch']}, "
                     f"loss {s['final_loss'] if s['final_loss'] is None else round(s['final_loss'], 4)}, "
                     f"lr {s['final_lr']:.4g}")
    lines.append(f"{'mode':<12} {'steps':>5} {'samples/s':>34} {'stall %':>8} {'next s':>8} {'h2d s':>8} "
                 f"{'compute s':>9} {'cores':>6}")
    for name, m in s["modes"].items():
        cores = f"{m['loader_cores_used']:.1f}" if m.get("loader_cores_used") is not None else "-"
        stall = f"{m['stall_pct']:.1f}" if name != "loader-only" else "-"
        lines.append(f"{name:<12} {m['num_steps']:>5} {_fmt_rate(m):>34} {stall:>8} {m['next_wait_s']:>8.2f} "
                     f"{m['h2d_s']:>8.2f} {m['compute_s']:>9.2f} {cores:>6}")
        util = [r["gpu"].get("util_mean_pct") for r in m["per_rank"] if r.get("gpu")]
        util = [u for u in util if u is not None]
        if util:
            lines.append("  GPU utilisation %: " + ", ".join(f"{u:.0f}" for u in util))
        if len(m["per_rank"]) > 1 and name != "loader-only":
            lines.append("  per rank stall %: " + ", ".join(f"r{r['rank']} {r['stall_pct']:.1f}" for r in m["per_rank"]))
        lines += mode_notes(name, m)
        if len(m.get("per_node", [])) > 1:
            lines.append("  per node: " + "; ".join(
                f"node {n['node']} ({_ranks(n['ranks'])}) {n['samples_per_s']:.1f} samples/s"
                + (f", stall {n['stall_pct']:.1f} %" if name != "loader-only" else "") for n in m["per_node"]))
    ceilings = [f"{mode_role(k, _is_cuda(s))} {m['samples_per_s']:.1f} samples/s ({k})"
                for k, m in s["modes"].items() if k in ("synthetic", "loader-only")]
    if ceilings:
        lines.append("ceilings: " + ", ".join(ceilings))
    for v in s.get("val", []):
        lines.append(f"val epoch {v['epoch']} step {v['step']}: top-1 {v['top1_pct']:.2f}%  top-5 {v['top5_pct']:.2f}%  "
                     f"loss {v['loss']:.4f} ({v['num_samples']} samples)")
    if s.get("num_skipped"):
        lines.append(f"skipped samples: {s['num_skipped']} (corrupt, rank 0)")
    if s.get("num_repeated"):
        lines.append(f"repeated samples: {s['num_repeated']} (read twice to keep the ranks' batch counts equal, "
                     f"rank 0)")
    if s.get("storage"):
        lines.append(storage_line(s))
    for n in s.get("notes", []):
        lines.append(f"note: {n}")
    if s.get("checkpoint"):
        lines.append(f"checkpoint: {s['checkpoint']}")
    if s.get("run_dir"):
        lines.append(f"run folder: {s['run_dir']}")
        if s.get("modes"):
            lines.append(f"timeline: {s['run_dir']}/trace.json (Perfetto, chrome://tracing)")
    lines += fix_lines(s)
    v = s.get("verdict")
    if v:
        label = f"{v['bound']}-bound" if v.get("bound") else v.get("cause")
        head = f"verdict: {v['status'].upper()}" + (f" ({label})" if label else "")
        lines.append(f"{head}: {v['reason']}")
        lines += [f"  note: {n}" for n in throttle_notes(s)]
        lines += [f"  fix: {f}" for f in v.get("fixes", [])]
    else:
        lines += [f"note: {n}" for n in throttle_notes(s)]
    return "\n".join(lines)


def fix_lines(s: dict[str, Any]) -> list[str]:
    """``--fix``: each fix tried, before -> after samples/s and whether it was kept; the fixes not tried; where
    the kept settings are. Empty without --fix."""
    tried, not_tried = s.get("fixes_tried") or [], s.get("fixes_not_tried") or []
    if not tried and not not_tried:
        return []
    lines = [f"fixes tried: {len(tried)}, kept {sum(1 for r in tried if r['kept'])}"]
    for r in tried:
        after = f"{r['after_samples_per_s']:.1f}" if r.get("after_samples_per_s") is not None else "failed"
        v = r.get("verdict") or {}
        then = f"; then {v['status']}" + (f" ({v['bound']}-bound)" if v.get("bound") else "") if v else ""
        lines.append(f"  {'kept' if r['kept'] else 'dropped'}: {r['fix']}: {r['before_samples_per_s']:.1f} -> "
                     f"{after} samples/s{then}")
    lines += [f"  not tried: {n}" for n in not_tried]
    if s.get("fixed_config"):
        lines.append(f"  kept settings: {s['fixed_config']}")
    return lines


def mode_notes(name: str, m: dict[str, Any]) -> list[str]:
    """A mode's stall over its windows (median, min–max), the cores other processes held beside it (and the largest
    of them), and windows that did not settle."""
    out = []
    st = m.get("stall_pct_stat")
    if st and name != "loader-only" and st["n"] > 1:
        out.append(f"  stall % over windows: {st['median']:.1f} ({st['min']:.1f}–{st['max']:.1f}, n={st['n']})")
    if m.get("other_cores") is not None:
        p = m.get("other_process")
        big = f"; largest {p['name']} (pid {p['pid']}, {p['cores']:.2f} cores)" if p else ""
        of = f" of {m['machine_cores']}" if m.get("machine_cores") else ""
        out.append(f"  other processes: {m['other_cores']:.2f}{of} cores{big}")
    if m.get("settled") is False:
        rs, ss = m.get("rate_spread"), m.get("stall_spread_pts")
        out.append("  windows did not settle: samples/s interval " + ("-" if rs is None else f"{100 * rs:.0f}% wide")
                   + ("" if ss is None or name == "loader-only" else f", stall interval {ss:.1f} points wide"))
    return out


def _gpu_label(s: dict[str, Any], h: dict[str, Any]) -> str:
    """"GPU 0", or "GPU 0 on host" for a run over several nodes."""
    return f"GPU {h['gpu']}" + (f" on {h['host']}" if int(s.get("num_nodes") or 1) > 1 else "")


def throttle_notes(s: dict[str, Any]) -> list[str]:
    """One sentence per GPU of a summary dict that a heat/power/board reason held back beyond the threshold
    (:func:`gpufeed.measure.health.throttled`): a GPU ceiling measured while it ran faster may overstate what it delivered."""
    out = []
    for h in s.get("gpu_health") or []:
        slow = throttled(h)
        if slow:
            if len(slow) == 1:
                (r, sec), = slow.items()
                what = f"({SLOWDOWN_LABELS[r]}) for {sec:.0f} s"
            else:
                what = "(" + ", ".join(f"{SLOWDOWN_LABELS[r]} {sec:.0f} s" for r, sec in slow.items()) + ")"
            out.append(f"{_gpu_label(s, h)} throttled {what} of {float(h['duration_s']):.0f} s sampled: the GPU "
                       f"ceiling measured before the run may overstate what it delivered")
    return out


def _f(x: Any, fmt: str = ".0f") -> str:
    return "-" if x is None else format(float(x), fmt)


def health_markdown(s: dict[str, Any]) -> list[str]:
    """report.md's "GPU health" section: a row per sampled GPU, or one line when none was sampled."""
    gpus = s.get("gpu_health") or []
    if not gpus:
        return ["GPU health: not sampled (no NVML GPU)"]
    out = ["## GPU health", "",
           "| GPU | rank | samples | max temp C | power mean/max W | limit W | util % | SM min/mean MHz | fan % | "
           "throttled |", "|---|---:|---:|---:|---|---:|---:|---|---:|---|"]
    for h in gpus:
        slow = slowdowns(h)
        thr = ", ".join(f"{SLOWDOWN_LABELS[r]} {sec:.0f} s" for r, sec in slow.items()) or "none"
        out.append(f"| {_gpu_label(s, h)} | {h['rank']} | {h['num_samples']} | {_f(h.get('temp_max_c'))} | "
                   f"{_f(h.get('power_mean_w'))}/{_f(h.get('power_max_w'))} | {_f(h.get('power_limit_w'))} | "
                   f"{_f(h.get('util_mean_pct'))} | {_f(h.get('sm_clock_min_mhz'))}/{_f(h.get('sm_clock_mean_mhz'))} | "
                   f"{_f(h.get('fan_mean_pct'))} | {thr} |")
    out += ["", f"Throttled: seconds a heat, power or board reason held the clocks back (NVML clocks-event reasons, "
                f"sampled every {INTERVAL_S:g} s); the verdict notes a GPU held back more than {THROTTLE_NOTE_S:g} s "
                f"and {100 * THROTTLE_NOTE_FRACTION:g} % of the time sampled. Series: {HEALTH_NAME}."]
    if not s.get("verdict"):
        out += [""] + throttle_notes(s)
    return out


def storage_line(s: dict[str, Any]) -> str:
    """``storage: X MB/s (probe, N reader(s), cold); the loader read Y MB/s`` from a summary dict with ``storage``."""
    st = s["storage"]
    how = ", ".join(str(x) for x in (st["source"], f"{st['readers']} reader(s)" if st.get("readers") else None,
                                     st.get("cache")) if x)
    line = f"storage: {st['bytes_per_s'] / 1e6:,.1f} MB/s ({how})"
    read = s.get("loader_read_bytes_per_s")
    m = s["modes"].get("loader-only") or s["modes"].get("real")
    if read is None:  # a record from before the field: the storage I/O counters of the loader-only (or real) mode
        read = m["read_bytes_per_s"] if m is not None else None
    if read is not None:
        rate = bounds.read_rate_text(read, m.get("samples_per_s") if m is not None else None)
        line += f"; the loader read from the {rate}" if rate == bounds.PAGE_CACHE else f"; the loader read {rate}"
    return line


def _over_nodes(s: dict[str, Any]) -> str:
    """" over N nodes" for a multi-node run, else nothing."""
    n = int(s.get("num_nodes") or 1)
    return f" over {n} nodes" if n > 1 else ""


def _ranks(ranks: list[int]) -> str:
    """"rank 0" or "ranks 0-7" (contiguous, as torchrun numbers them) or "ranks 0, 2"."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    if ranks == list(range(ranks[0], ranks[0] + len(ranks))):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return "ranks " + ", ".join(map(str, ranks))


def _is_cuda(s: dict[str, Any]) -> bool:
    return str(s.get("device", "")).split(":")[0] == "cuda"


MODE_ROLES = {"loader-only": "loader ceiling", "real": "end to end"}
"""What each mode's rate is (the synthetic mode's name depends on the device: :func:`compute_ceiling_name`)."""


def mode_role(mode: str, cuda: bool) -> str:
    return compute_ceiling_name(cuda) if mode == "synthetic" else MODE_ROLES.get(mode, mode)


LOG_SCALE_RATIO = 20.0
"""The chart's rate axis turns logarithmic when the largest rate exceeds the smallest by more than this."""


def chart_data(s: dict[str, Any]) -> dict[str, Any]:
    """What the training chart shows, from a summary.json dict: samples/s (all ranks) per mode with its role,
    whether the rate axis is logarithmic, and the data stall % per rank of the run that trained (``real``,
    else the one timed mode that computed)."""
    cuda = _is_cuda(s)
    modes = s.get("modes", {})
    rates = [(mode, mode_role(mode, cuda), float(m["samples_per_s"])) for mode, m in modes.items()]
    positive = [r for _, _, r in rates if r > 0]
    log = len(positive) >= 2 and max(positive) > LOG_SCALE_RATIO * min(positive)
    stall_mode = "real" if "real" in modes else next((k for k in modes if k != "loader-only"), None)
    stalls = [(int(r["rank"]), float(r["stall_pct"])) for r in modes[stall_mode]["per_rank"]] if stall_mode else []
    return {"rates": rates, "log_scale": log, "stall_mode": stall_mode, "stalls": stalls}


def plot_summary(run_dir: Path, s: dict[str, Any]) -> str | None:
    """throughput.png in ``run_dir``: samples/s per mode side by side (each value printed on its bar) and the
    data stall % per rank against the 5 % fed line; None when there is nothing to plot or it fails."""
    data = chart_data(s)
    if not data["rates"]:
        return None
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        panels = 2 if data["stalls"] else 1
        fig, axes = plt.subplots(1, panels, figsize=(5 * panels + 1, 4), squeeze=False)
        ax1 = axes[0][0]
        labels = [f"{mode}\n({role})" for mode, role, _ in data["rates"]]
        values = [r for _, _, r in data["rates"]]
        bars = ax1.bar(range(len(values)), values, color=[f"C{k}" for k in range(len(values))])
        ax1.set_xticks(range(len(values)), labels, fontsize=8)
        for bar, v in zip(bars, values):
            ax1.annotate(f"{v:,.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                         va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
        if data["log_scale"]:
            ax1.set_yscale("log")
            ax1.set_ylabel("samples/s, all ranks (log scale)")
        else:
            ax1.set_ylabel("samples/s, all ranks")
        ax1.margins(y=0.15)
        ax1.set_title("rate per mode")
        if data["stalls"]:
            ax2 = axes[0][1]
            ranks = [r for r, _ in data["stalls"]]
            pct = [p for _, p in data["stalls"]]
            colors = ["tab:green" if p < STALL_FED_PCT else "tab:red" for p in pct]
            bars = ax2.bar(range(len(pct)), pct, color=colors)
            for bar, p in zip(bars, pct):
                ax2.annotate(f"{p:.1f}", (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center",
                             va="bottom", fontsize=8, xytext=(0, 2), textcoords="offset points")
            ax2.axhline(STALL_FED_PCT, color="grey", linestyle="--", linewidth=1,
                        label=f"fed below {STALL_FED_PCT:g} %")
            ax2.set_xticks(range(len(ranks)), [f"rank {r}" for r in ranks], fontsize=8)
            ax2.set_ylim(0, max(100.0 if max(pct) > 50 else 2 * STALL_FED_PCT, max(pct) * 1.15))
            ax2.set_ylabel(f"data stall % ({data['stall_mode']})")
            ax2.set_title("data stall per rank")
            ax2.legend(fontsize=8)
        v = s.get("verdict")
        if v:
            fig.suptitle(f"verdict: {v['status']}" + (f" ({v['bound']}-bound)" if v.get("bound") else ""),
                         fontsize=10)
        fig.tight_layout()
        from gpufeed.core.records import atomic_writer

        with atomic_writer(run_dir / "throughput.png") as f:  # never through a link at that name
            fig.savefig(f, format="png", dpi=100)
        plt.close(fig)
        return "throughput.png"
    except Exception:  # a report without a chart beats a failed run
        return None


def render_markdown(s: dict[str, Any], plot: str | None = None) -> str:
    out = [f"# gpufeed train — {s['arch']}, {s['world_size']} x {s['device'].split(':')[0]}{_over_nodes(s)}, "
           f"mode {s['mode']}", "",
           f"Started {s['started']}, {s['wall_s']:.1f} s. amp {s['amp']}, batch {s['batch_size']} per rank x accum "
           f"{s['accum_steps']} (global {s['global_batch']}), {s['image_size']} px.", "",
           "| mode | steps | samples/s | median (min–max) | stall % | copy % | next s | h2d s | compute s | cores |",
           "|---|---:|---:|---|---:|---:|---:|---:|---:|---:|"]
    for name, m in s["modes"].items():
        st = m.get("samples_per_s_stat")
        med = f"{st['median']:.1f} ({st['min']:.1f}–{st['max']:.1f})" if st else "-"
        cores = f"{m['loader_cores_used']:.1f}" if m.get("loader_cores_used") is not None else "-"
        out.append(f"| {name} ({mode_role(name, _is_cuda(s))}) | {m['num_steps']} | {m['samples_per_s']:.1f} | {med} | {m['stall_pct']:.1f} | "
                   f"{m['copy_wait_pct']:.1f} | {m['next_wait_s']:.2f} | {m['h2d_s']:.2f} | {m['compute_s']:.2f} | {cores} |")
    for name, m in s["modes"].items():
        if len(m["per_rank"]) > 1:
            out += ["", f"Per rank ({name}):", "", "| rank | samples/s | stall % | cores |", "|---:|---:|---:|---:|"]
            for r in m["per_rank"]:
                c = f"{r['cores_used']:.1f}" if r.get("cores_used") is not None else "-"
                out.append(f"| {r['rank']} | {r['samples_per_s']:.1f} | {r['stall_pct']:.1f} | {c} |")
    for name, m in s["modes"].items():
        if len(m.get("per_node", [])) > 1:
            out += ["", f"Per node ({name}):", "", "| node | host | ranks | samples/s | stall % | cores |",
                    "|---:|---|---|---:|---:|---:|"]
            for n in m["per_node"]:
                c = f"{n['loader_cores_used']:.1f}" if n.get("loader_cores_used") is not None else "-"
                stall = f"{n['stall_pct']:.1f}" if name != "loader-only" else "-"
                out.append(f"| {n['node']} | {n['host']} | {_ranks(n['ranks']).split(' ', 1)[1]} | "
                           f"{n['samples_per_s']:.1f} | {stall} | {c} |")
    if s.get("val"):
        out += ["", "| epoch | step | top-1 % | top-5 % | loss |", "|---:|---:|---:|---:|---:|"]
        out += [f"| {v['epoch']} | {v['step']} | {v['top1_pct']:.2f} | {v['top5_pct']:.2f} | {v['loss']:.4f} |"
                for v in s["val"]]
    if s.get("storage"):
        out += ["", storage_line(s).replace("storage: ", "Storage: ", 1)]
    out += [""] + health_markdown(s)
    if s.get("fixes_tried") or s.get("fixes_not_tried"):
        out += ["", "Fixes (`--fix`):", ""] + [f"- {line.strip()}" for line in fix_lines(s)[1:]]
    v = s.get("verdict")
    if v:
        label = f"{v['bound']}-bound" if v.get("bound") else v.get("cause")
        out += ["", f"**Verdict: {v['status']}**" + (f" ({label})" if label else "") + f": {v['reason']}"]
        out += [f"- **Note:** {n}" for n in throttle_notes(s)]
        out += [f"- {f}" for f in v.get("fixes", [])]
    if plot:
        out += ["", f"![samples/s per mode and data stall per rank]({plot})"]
    return "\n".join(out) + "\n"
