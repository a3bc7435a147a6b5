"""Inline SVG charts for the report page: horizontal bars, stacked bars and line charts. Plain strings, no
dependencies, explicit width and height (so every chart has a size before any CSS), text escaped."""

from __future__ import annotations

import html
import math
from typing import Sequence

MAX_MARKS = 400
"""Points marked with a circle and a tooltip in one line chart at most (shared among its lines)."""
PALETTE = ("#2563eb", "#dc2626", "#16a34a", "#d97706", "#7c3aed", "#0891b2", "#be185d", "#4b5563")
FONT = 'font-family="system-ui, -apple-system, Segoe UI, Roboto, sans-serif"'


def _e(text: object) -> str:
    return html.escape(str(text), quote=True)


def fmt(value: float | None, digits: int = 3) -> str:
    """A number for a label: 3 significant digits, thousands separated; '-' for None."""
    if value is None or (isinstance(value, float) and not math.isfinite(value)):
        return "-"
    if abs(value) >= 1000:
        return f"{value:,.0f}"
    if value == 0:
        return "0"
    return f"{value:.{digits}g}"


def _nice_max(value: float) -> float:
    if value <= 0 or not math.isfinite(value):
        return 1.0
    exp = 10.0 ** math.floor(math.log10(value))  # a float: 10 ** 308 as an int overflows the float math below
    for m in (1, 2, 2.5, 5, 10):
        if value <= m * exp:
            return m * exp
    return 10 * exp


def _open(width: int, height: int, title: str) -> list[str]:
    return [f'<svg xmlns="http://www.w3.org/2000/svg" role="img" width="{width}" height="{height}" '
            f'viewBox="0 0 {width} {height}" {FONT} font-size="12"><title>{_e(title)}</title>']


def bars(title: str, items: Sequence[tuple[str, float | None]], unit: str, *, width: int = 640,
         colors: Sequence[str] | None = None, notes: Sequence[str] | None = None) -> str:
    """Horizontal bars, one per (label, value); a None value is drawn as 'not measured'."""
    row, left, right = 30, 170, 110
    height = 34 + row * len(items)
    top = max((v for _, v in items if v is not None), default=0.0)
    scale = (width - left - right) / _nice_max(top)
    out = _open(width, height, title)
    out.append(f'<text x="0" y="16" font-weight="600" font-size="13">{_e(title)}</text>')
    for i, (label, value) in enumerate(items):
        y = 28 + i * row
        color = (colors or PALETTE)[i % len(colors or PALETTE)]
        out.append(f'<text x="{left - 8}" y="{y + 15}" text-anchor="end">{_e(label)}</text>')
        if value is None:
            out.append(f'<text x="{left}" y="{y + 15}" fill="#6b7280">not measured</text>')
            continue
        w = max(1.0, value * scale)
        out.append(f'<rect x="{left}" y="{y + 2}" width="{w:.1f}" height="{row - 10}" fill="{color}" rx="2"/>')
        note = f" {notes[i]}" if notes and notes[i] else ""
        out.append(f'<text x="{left + w + 6:.1f}" y="{y + 15}">{_e(fmt(value))} {_e(unit)}{_e(note)}</text>')
    out.append("</svg>")
    return "".join(out)


def stacked(title: str, rows: Sequence[tuple[str, Sequence[float]]], parts: Sequence[str], unit: str = "%", *,
            width: int = 640, total: float | None = 100.0) -> str:
    """Horizontal stacked bars: one row per (label, values of ``parts``), scaled to ``total`` (or the largest)."""
    row, left, right = 28, 110, 20
    legend_h = 24
    height = 30 + legend_h + row * len(rows) + 18
    full = total or _nice_max(max((sum(v) for _, v in rows), default=0.0))
    scale = (width - left - right) / full
    out = _open(width, height, title)
    out.append(f'<text x="0" y="16" font-weight="600" font-size="13">{_e(title)}</text>')
    x = left
    for j, part in enumerate(parts):
        out.append(f'<rect x="{x}" y="26" width="12" height="12" fill="{PALETTE[j % len(PALETTE)]}"/>'
                   f'<text x="{x + 16}" y="36">{_e(part)}</text>')
        x += 24 + 8 * len(part)
    for i, (label, values) in enumerate(rows):
        y = 30 + legend_h + i * row
        out.append(f'<text x="{left - 8}" y="{y + 14}" text-anchor="end">{_e(label)}</text>')
        x0 = float(left)
        for j, v in enumerate(values):
            w = max(0.0, v * scale)
            if w > 0:
                out.append(f'<rect x="{x0:.1f}" y="{y + 2}" width="{w:.1f}" height="{row - 8}" '
                           f'fill="{PALETTE[j % len(PALETTE)]}"><title>{_e(parts[j])}: {_e(fmt(v))} {_e(unit)}'
                           f'</title></rect>')
                if w > 34:
                    out.append(f'<text x="{x0 + w / 2:.1f}" y="{y + 15}" text-anchor="middle" fill="#fff">'
                               f'{_e(fmt(v, 2))}</text>')
            x0 += w
    axis_y = 30 + legend_h + row * len(rows) + 12
    out.append(f'<text x="{left}" y="{axis_y}" fill="#6b7280">0</text>'
               f'<text x="{width - right}" y="{axis_y}" text-anchor="end" fill="#6b7280">{_e(fmt(full))} '
               f'{_e(unit)}</text>')
    out.append("</svg>")
    return "".join(out)


def lines(title: str, series: Sequence[tuple[str, Sequence[tuple[float, float]]]], x_label: str, y_label: str, *,
          width: int = 640, height: int = 240, y_max: float | None = None) -> str:
    """A line chart (points marked) of several (name, [(x, y), ...]) series on one linear scale from 0."""
    left, right, top, bottom = 64, 16, 44, 40
    pts = [p for _, s in series for p in s]
    xs = [p[0] for p in pts] or [0.0, 1.0]
    x_lo, x_hi = min(xs), max(xs)
    if x_hi == x_lo:
        x_lo, x_hi = x_lo - 1, x_hi + 1
    y_hi = y_max or _nice_max(max((p[1] for p in pts), default=0.0))
    pw, ph = width - left - right, height - top - bottom

    def sx(x: float) -> float:
        return left + (x - x_lo) / (x_hi - x_lo) * pw

    def sy(y: float) -> float:
        return top + ph - min(y, y_hi) / y_hi * ph

    out = _open(width, height, title)
    out.append(f'<text x="0" y="16" font-weight="600" font-size="13">{_e(title)}</text>')
    x = left
    for j, (name, _) in enumerate(series):
        out.append(f'<rect x="{x}" y="24" width="12" height="4" fill="{PALETTE[j % len(PALETTE)]}"/>'
                   f'<text x="{x + 16}" y="30">{_e(name)}</text>')
        x += 28 + 7 * len(name)
    for k in range(5):
        y = y_hi * k / 4
        out.append(f'<line x1="{left}" x2="{width - right}" y1="{sy(y):.1f}" y2="{sy(y):.1f}" stroke="#e5e7eb"/>'
                   f'<text x="{left - 6}" y="{sy(y) + 4:.1f}" text-anchor="end" fill="#6b7280">{_e(fmt(y))}</text>')
    out.append(f'<text x="{left}" y="{height - 22}" fill="#6b7280">{_e(fmt(x_lo))}</text>'
               f'<text x="{width - right}" y="{height - 22}" text-anchor="end" fill="#6b7280">{_e(fmt(x_hi))}</text>'
               f'<text x="{left + pw / 2:.0f}" y="{height - 6}" text-anchor="middle">{_e(x_label)}</text>'
               f'<text x="12" y="{top + ph / 2:.0f}" text-anchor="middle" transform="rotate(-90 12 '
               f'{top + ph / 2:.0f})">{_e(y_label)}</text>')
    marks = MAX_MARKS  # points marked (with a tooltip) in the whole chart: the first of each line
    for j, (name, s) in enumerate(series):
        color = PALETTE[j % len(PALETTE)]
        ordered = sorted(s)
        if len(ordered) > 1:
            path = " ".join(f"{sx(a):.1f},{sy(b):.1f}" for a, b in ordered)
            out.append(f'<polyline points="{path}" fill="none" stroke="{color}" stroke-width="2"/>')
        share = max(marks // max(len(series) - j, 1), 0)
        marks -= min(share, len(ordered))
        for a, b in ordered[:share]:
            out.append(f'<circle cx="{sx(a):.1f}" cy="{sy(b):.1f}" r="2.5" fill="{color}"><title>{_e(name)} '
                       f'{_e(fmt(a))}: {_e(fmt(b))}</title></circle>')
    out.append("</svg>")
    return "".join(out)
