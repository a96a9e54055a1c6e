"""HTML of what ranks produced in a cell, for the dashboard: the ranks' output items (``record.Item``: runs of lines
and rich outputs, each under its rank's name) and line charts of the numbers ranks report (inline SVG, one chart per
metric, one line per rank).

Pure functions of their arguments: no widgets here. Everything is scoped by the classes in ``dashboard.STYLE`` and
coloured with JupyterLab's CSS variables (or ``currentColor``), so the light, dark and high-contrast themes all read.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable
from typing import Any

from ..ranks import format_ranks
from .record import Item

__all__ = ["render_items", "render_item", "render_charts", "rank_color", "who", "COLORS", "CHART_RANKS"]

# matplotlib's default cycle: mid-tones that read on light and dark backgrounds alike.
COLORS = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22",
          "#17becf")
CHART_W, CHART_H = 300, 130  # pixels of one chart
CHART_RANKS = 16  # lines drawn per chart (the first ranks; the legend says how many were left out)
LEGEND_GROUPS = 6  # legend entries of a chart (more: one entry naming the ranks drawn)

_WHAT = {"dead": "died: ", "stopped": "stopped: "}  # before a failure's text ("error": the exception says it)
_IMAGES = ("image/png", "image/jpeg", "image/gif", "image/webp")
_ANSI = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]|\x1b\][^\x07]*\x07")


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def rank_color(rank: int) -> str:
    """The colour of ``rank`` in charts and output labels (the same in every view)."""
    return COLORS[rank % len(COLORS)]


def who(ranks: tuple[int, ...] | list[int]) -> str:
    """The one spelling of rank names in the views: 'rank 0', 'ranks 0-3'."""
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {format_ranks(list(ranks))}"


def _label(ranks: tuple[int, ...]) -> str:
    """The rank's name in the theme's text colour, marked with the rank's colour (coloured text would not read)."""
    color = rank_color(ranks[0]) if len(ranks) == 1 else "var(--jp-border-color1,#999)"
    return f'<span class="mj-who" style="border-left-color:{color}">{_e(who(ranks))}</span>'


def _attr(ranks: tuple[int, ...]) -> str:
    """``data-ranks=" 0 3 "``: the views filter items by rank with ``[data-ranks~="3"]``."""
    return f'data-ranks=" {" ".join(map(str, ranks))} "'


def _display_html(bundle: dict) -> str:
    """The richest HTML form of one display's MIME bundle."""
    if "text/html" in bundle:
        return str(bundle["text/html"])
    if "image/svg+xml" in bundle:
        return str(bundle["image/svg+xml"])
    for mime in _IMAGES:
        if mime in bundle:
            return f'<img src="data:{mime};base64,{bundle[mime]}" alt="figure"/>'
    for mime in ("text/markdown", "text/latex", "application/json"):
        if mime in bundle:
            return f'<pre class="mj-text">{_e(bundle[mime])}</pre>'
    text = str(bundle.get("text/plain", ""))
    text = "\n".join(line.split(" ", 1)[1] if line.startswith("[rank") and " " in line else line
                     for line in text.splitlines())  # the label is the item's own
    return f'<pre class="mj-text">{_e(text)}</pre>'


def render_item(item: Item) -> str:
    """One item: a run of lines under its rank's name (stderr styled as JupyterLab styles it), or a display."""
    if item.kind == "display":
        return (f'<div class="mj-item mj-display" {_attr(item.ranks)}>{_label(item.ranks)}'
                f'<div class="mj-rich jp-RenderedHTMLCommon">{_display_html(item.data)}</div></div>')
    text = _e(_ANSI.sub("", "\n".join(item.lines)))
    return (f'<div class="mj-item mj-{item.kind}" {_attr(item.ranks)}>{_label(item.ranks)}'
            f'<pre class="mj-text">{text}</pre></div>')


def render_failure(rank: int, state: str, error: str, traceback: str = "") -> str:
    """A failed (or interrupted) rank's error (``traceback`` collapsed under it), or a rank stopped at a breakpoint
    (``error``: where to look, when not at its pdb prompt)."""
    if state == "breakpoint":
        body = error or f"stopped at a breakpoint: answer at its (Pdb rank {rank}) prompt below"
        return (f'<div class="mj-item mj-prompt" {_attr((rank,))}>{_label((rank,))}'
                f'<div class="mj-note">{_e(body)}</div></div>')
    tb = _ANSI.sub("", traceback).rstrip()
    details = (f'<details class="mj-tb"><summary>traceback</summary><pre class="mj-text">{_e(tb)}</pre></details>'
               if tb else "")
    kind = "mj-note" if state == "interrupted" else "mj-error"  # an interrupt is no error of the rank's code
    return (f'<div class="mj-item mj-failure" {_attr((rank,))}>{_label((rank,))}'
            f'<div><div class="{kind}">{_e(_WHAT.get(state, "") + error)}</div>{details}</div></div>')


def render_items(items: list[Item]) -> str:
    """The items in order (the merged view; rank tabs filter it by ``data-ranks``)."""
    return "".join(render_item(i) for i in items)


# ---------------------------------------------------------------------------------------------------- charts


def _fmt(v: float, digits: int = 3) -> str:
    return f"{v:.{digits}g}"


def _same_curve(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> bool:
    """``a`` and ``b`` are one curve sampled at different steps (reports are throttled on each rank): equal values at
    every step both have, and enough such steps to tell."""
    ya = dict(a)
    shared = [(ya[x], y) for x, y in b if x in ya]
    if len(shared) < max(2, 0.3 * min(len(a), len(b))):
        return False
    return all(math.isclose(p, q, rel_tol=1e-6, abs_tol=1e-12) for p, q in shared)


def _groups(per_rank: dict[int, list[tuple[float, float]]]) -> list[tuple[list[int], list[tuple[float, float]]]]:
    """Ranks whose series are one curve share one line (its legend names them all), drawn through all their
    points."""
    out: list[tuple[list[int], list[tuple[float, float]]]] = []
    for r in sorted(per_rank):
        points = per_rank[r]
        for ranks, merged in out:
            if _same_curve(merged, points):
                ranks.append(r)
                merged[:] = sorted(dict(merged + points).items())
                break
        else:
            out.append(([r], list(points)))
    return out


def _y_range(series: list[list[tuple[float, float]]]) -> tuple[float, float, bool]:
    """(low, high, clipped): the y range of the points, leaving out early points that lie far outside the rest (a
    first loss of 15 before the curve settles near 0.4); then ``clipped`` is True and those points leave the chart.

    The range is that of each series' points after its first tenth (at least the first point), widened to take in
    the early points within twice that range's span.
    """
    everything = [y for s in series for _, y in s]
    if all(len(s) >= 4 for s in series):
        tail = [y for s in series for _, y in s[max(1, len(s) // 10):]]
        head = [y for s in series for _, y in s[:max(1, len(s) // 10)]]
        lo, hi = min(tail), max(tail)
        span = (hi - lo) or abs(hi) or 1.0
        inside = [y for y in head if lo - 2 * span <= y <= hi + 2 * span]
        if len(inside) < len(head):
            return min(tail + inside), max(tail + inside), True
    return min(everything), max(everything), False


def _chart(name: str, per_rank: dict[int, list[tuple[float, float]]], uid: str,
           label: Callable[[list[int]], str] = who) -> str:
    ranks = sorted(per_rank)[:CHART_RANKS]
    left = len(per_rank) - len(ranks)
    groups = _groups({r: [p for p in per_rank[r] if math.isfinite(p[1])] for r in ranks})
    groups = [(rs, pts) for rs, pts in groups if pts]
    if not groups:
        return ""
    xs = [x for _, pts in groups for x, _ in pts]
    x0, x1 = min(xs), max(xs)
    y0, y1, clipped = _y_range([pts for _, pts in groups])
    if y0 == y1:
        y0, y1 = y0 - (abs(y0) or 1.0) * 0.05, y1 + (abs(y1) or 1.0) * 0.05
    ticks = [y0, (y0 + y1) / 2, y1]
    labels = [_fmt(t) for t in ticks]
    pad_l = 8 + 6 * max(len(t) for t in labels)  # 10 px sans-serif: about 6 px a character
    pad_t, pad_b, pad_r = 20, 16, 8
    w, h = CHART_W - pad_l - pad_r, CHART_H - pad_t - pad_b
    xs_, ys_ = (x1 - x0) or 1.0, (y1 - y0) or 1.0

    def px(x: float) -> float:
        return pad_l + (x - x0) / xs_ * w

    def py(y: float) -> float:
        return pad_t + h - (y - y0) / ys_ * h

    clip = f"mj-clip-{uid}"
    parts = [f'<clipPath id="{clip}"><rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}"/></clipPath>',
             f'<text class="mj-chart-title" x="{pad_l}" y="12" font-weight="bold" fill="currentColor">{_e(name)}'
             "</text>",
             f'<rect x="{pad_l}" y="{pad_t}" width="{w}" height="{h}" fill="none" stroke="currentColor" '
             'stroke-opacity="0.3"/>']
    for t, text in zip(ticks, labels, strict=True):
        y = py(t)
        parts.append(f'<text class="mj-axis" x="{pad_l - 4}" y="{y + 3:.1f}" text-anchor="end" fill="currentColor" '
                     f'fill-opacity="0.75">{text}</text>')
        parts.append(f'<line x1="{pad_l}" x2="{pad_l + w}" y1="{y:.1f}" y2="{y:.1f}" stroke="currentColor" '
                     'stroke-opacity="0.12"/>')
    parts.append(f'<text class="mj-axis" x="{pad_l}" y="{CHART_H - 3}" fill="currentColor" fill-opacity="0.75">'
                 f"step {_fmt(x0, 6)}</text>")
    parts.append(f'<text class="mj-axis" x="{pad_l + w}" y="{CHART_H - 3}" text-anchor="end" fill="currentColor" '
                 f'fill-opacity="0.75">{_fmt(x1, 6)}</text>')
    legend = []
    for i, (ranks_, pts) in enumerate(groups):
        color = rank_color(ranks_[0])
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in pts)
        # Lines drawn later are narrower, so a curve that lies on an earlier one leaves that one's edges showing.
        width = max(1.25, 3.5 - 0.75 * i) if len(groups) > 1 else 1.75
        parts.append(f'<polyline data-ranks="{" ".join(map(str, ranks_))}" fill="none" stroke="{color}" '
                     f'stroke-width="{width}" clip-path="url(#{clip})" points="{coords}">'
                     f"<title>{_e(label(ranks_))}: last {_fmt(pts[-1][1], 4)}</title></polyline>")
        if len(pts) == 1:
            parts.append(f'<circle cx="{px(pts[0][0]):.1f}" cy="{py(pts[0][1]):.1f}" r="2" fill="{color}"/>')
        legend.append((ranks_, color))
    note = ""
    if clipped:
        note = '<span class="mj-note" title="a first value far outside the rest is left off the scale">first ' \
               "value off scale</span>"
    if len(legend) > LEGEND_GROUPS:
        entries = f'<span>{_e(label(ranks))} ({len(legend)} lines)</span>'
    else:
        entries = "".join(f'<span><i style="background:{c}"></i>{_e(label(rs))}</span>' for rs, c in legend)
    more = f'<span class="mj-note">+{left} ranks not drawn</span>' if left > 0 else ""
    points = sum(len(p) for _, p in groups)
    return (f'<figure class="mj-chart-box"><svg class="mj-chart" data-metric="{_e(name)}" data-points="{points}" '
            f'width="{CHART_W}" height="{CHART_H}" viewBox="0 0 {CHART_W} {CHART_H}" '
            f'xmlns="http://www.w3.org/2000/svg" role="img" aria-label="{_e(name)} by step">{"".join(parts)}</svg>'
            f'<figcaption class="mj-legend">{entries}{more}{note}</figcaption></figure>')


def render_charts(metrics: dict[str, dict[int, list[tuple[float, float]]]], uid: str = "0",
                  label: Callable[[list[int]], str] = who) -> str:
    """One small line chart per metric (inline SVG), one line per rank, x the global step; '' without metrics.

    ``uid`` keeps the SVG ids of this chart set apart from other dashboards on the page. ``label`` names the keys of
    a line in its legend (``who``: "rank 3"; the experiment table's chart keys lines by run).
    """
    charts = [_chart(name, per_rank, f"{uid}-{i}", label) for i, (name, per_rank) in enumerate(metrics.items())]
    charts = [c for c in charts if c]
    return f'<div class="mj-charts">{"".join(charts)}</div>' if charts else ""

