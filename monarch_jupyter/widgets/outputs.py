"""HTML of what ranks produced in a cell, for the dashboard: each rank's whole output (text lines and rich
outputs), and live line charts of the numbers ranks report (inline SVG, one chart per metric, one line per rank).

Pure functions of the monitor's data (``MeshMonitor.rank_log`` and ``MeshMonitor.metrics``): no widgets here.
"""

from __future__ import annotations

import html
from typing import Any

from ..ranks import format_ranks

__all__ = ["render_rank_output", "render_charts", "render_details", "COLORS", "LINES_SHOWN"]

COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
LINES_SHOWN = 500  # text lines of one rank shown (the last ones); the rest are counted
CHART_W, CHART_H = 260, 110  # pixels of one chart
CHART_RANKS = 16  # ranks drawn per chart (the first ones; the legend says how many were left out)

_IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _display_html(data: dict) -> str:
    """The richest HTML form of one display's MIME bundle."""
    bundle = data.get("data") or {}
    if "text/html" in bundle:
        return str(bundle["text/html"])
    if "image/svg+xml" in bundle:
        return str(bundle["image/svg+xml"])
    for mime in _IMAGES:
        if mime in bundle:
            return f'<img src="data:{mime};base64,{bundle[mime]}" style="max-width:100%"/>'
    for mime in ("text/markdown", "text/latex", "application/json"):
        if mime in bundle:
            return f'<pre class="mj-out">{_e(bundle[mime])}</pre>'
    return f'<pre class="mj-out">{_e(bundle.get("text/plain", ""))}</pre>'


def _resolve(items: list) -> list:
    """Apply update_display and clear_output to a rank's log: what a notebook cell would show now."""
    out: list = []
    for stream, item in items:
        if stream != "display":
            out.append((stream, item))
            continue
        kind = item.get("display_kind", "display")
        if kind == "clear":
            out = []
        elif kind == "update":
            did = item.get("display_id")
            out = [(s, item if s == "display" and i.get("display_id") == did and did else i) for s, i in out]
        else:
            out.append((stream, item))
    return out


def render_rank_output(items: list, rank: int) -> str:
    """One rank's output in a cell: its text lines (stderr in red) and rich outputs, in order."""
    shown = _resolve(items)
    lines = sum(1 for s, _ in shown if s != "display")
    skip = max(0, lines - LINES_SHOWN)
    parts = [f'<div class="mj-rank-output" data-rank="{rank}">']
    if skip:
        parts.append(f'<div class="mj-note">{skip} earlier lines not shown</div>')
    text: list[str] = []

    def flush_text() -> None:
        if text:
            parts.append('<pre class="mj-out">' + "\n".join(text) + "</pre>")
            text.clear()

    for stream, item in shown:
        if stream == "display":
            flush_text()
            parts.append(f'<div class="mj-display">{_display_html(item)}</div>')
        elif skip:
            skip -= 1
        else:
            line = _e(item)
            text.append(f'<span class="mj-err">{line}</span>' if stream == "stderr" else line)
    flush_text()
    if len(parts) == 1:
        parts.append('<div class="mj-note">no output</div>')
    parts.append("</div>")
    return "".join(parts)


def render_details(logs: dict[int, list]) -> str:
    """Static per-rank outputs (a finished fast cell): one collapsed ``<details>`` per rank that wrote something."""
    parts = []
    for rank, items in logs.items():
        if not items:
            continue
        n_lines = sum(1 for s, _ in items if s != "display")
        n_disp = sum(1 for s, _ in items if s == "display")
        what = ", ".join(x for x in (f"{n_lines} lines" if n_lines else "", f"{n_disp} rich outputs" if n_disp
                                     else "") if x)
        parts.append(f'<details class="mj-rank-details" data-rank="{rank}"><summary>rank {rank} output · {what}'
                     f"</summary>{render_rank_output(items, rank)}</details>")
    return "".join(parts)


def _fmt(v: float) -> str:
    return f"{v:.4g}"


def render_charts(metrics: dict[str, dict[int, list[tuple[float, float]]]]) -> str:
    """One small line chart per metric (inline SVG), one line per rank; empty string without metrics."""
    if not metrics:
        return ""
    charts = []
    for name, per_rank in metrics.items():
        ranks = sorted(per_rank)[:CHART_RANKS]
        points = [p for r in ranks for p in per_rank[r]]
        if not points:
            continue
        x0, x1 = min(p[0] for p in points), max(p[0] for p in points)
        y0, y1 = min(p[1] for p in points), max(p[1] for p in points)
        xs, ys = (x1 - x0) or 1.0, (y1 - y0) or 1.0
        pad_l, pad_b, pad_t = 42, 14, 14
        w, h = CHART_W - pad_l - 4, CHART_H - pad_b - pad_t
        lines = []
        for i, r in enumerate(ranks):
            pts = " ".join(f"{pad_l + (x - x0) / xs * w:.1f},{pad_t + h - (y - y0) / ys * h:.1f}"
                           for x, y in per_rank[r])
            color = COLORS[i % len(COLORS)]
            lines.append(f'<polyline data-rank="{r}" fill="none" stroke="{color}" stroke-width="1.5" '
                         f'points="{pts}"><title>rank {r}</title></polyline>')
        left = len(per_rank) - len(ranks)
        legend = f"ranks {format_ranks(ranks)}" + (f" (+{left} more)" if left > 0 else "")
        charts.append(
            f'<svg class="mj-chart" data-metric="{_e(name)}" data-points="{len(points)}" width="{CHART_W}" '
            f'height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" xmlns="http://www.w3.org/2000/svg" '
            'style="font:10px sans-serif;margin:2px 8px 2px 0">'
            f'<text x="{pad_l}" y="10" font-weight="bold">{_e(name)}</text>'
            f'<text x="{CHART_W - 4}" y="10" text-anchor="end" fill="#888">{_e(legend)}</text>'
            f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="#ccc"/>'
            f'<text x="{pad_l - 3}" y="{pad_t + 8}" text-anchor="end" fill="#666">{_fmt(y1)}</text>'
            f'<text x="{pad_l - 3}" y="{pad_t + h}" text-anchor="end" fill="#666">{_fmt(y0)}</text>'
            f'<text x="{pad_l}" y="{CHART_H - 2}" fill="#666">{_fmt(x0)}</text>'
            f'<text x="{CHART_W - 4}" y="{CHART_H - 2}" text-anchor="end" fill="#666">{_fmt(x1)}</text>'
            + "".join(lines) + "</svg>")
    return f'<div class="mj-charts">{"".join(charts)}</div>' if charts else ""
