"""The live per-rank dashboard for widget frontends (ipywidgets 8).

One row per rank: rank, host, device, state, time in the cell, a progress bar, the last line of output and
memory (RSS; CUDA allocated/reserved on GPU ranks). A header line sums up ranks per state, the slowest rank and
the cell's elapsed time. Past ``fold_threshold`` ranks the table folds into the per-state summary plus the
stragglers and failed ranks; the full table sits in a collapsed accordion, opened in the browser without a round
trip to the (busy) kernel.

The widget is one standard ``HTML`` widget (a ``VBox`` with an ``Accordion`` once folded), so every frontend with
ipywidgets 8 shows it without an extension of ours, and a new cell's dashboard costs one comm. Its ``text/plain``
is stable (state per rank, no times) so saved notebooks compare under nbval; rows carry ``data-rank``,
``data-state``, ``data-n`` and ``data-total`` attributes for tests.
"""

from __future__ import annotations

import html
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from ..ranks import ranks_text
from .model import ATTENTION_STATES, MeshMonitor, RowView, Summary, stragglers
from .text import fmt_memory, fmt_progress, fmt_seconds, stable_text
from .view import LiveView

__all__ = ["MeshDashboard", "FoldedDashboard", "DashboardView", "render_table", "render_header", "render_folded",
           "render_body", "html_page", "shared"]

STATE_COLORS = {
    "starting": "#8a8a8a", "queued": "#8a8a8a", "idle": "#8a8a8a", "stopped": "#8a8a8a",
    "running": "#1f6fd1", "done": "#2e8540", "breakpoint": "#c77700", "error": "#c62828", "dead": "#7b1010",
}
LAST_LINE_CHARS = 100  # of the last output line shown in a row (the full line is its tooltip, up to 500)

_STYLE = """<style>
.mj-dashboard table{border-collapse:collapse;font-family:var(--jp-code-font-family,monospace);
  font-size:var(--jp-code-font-size,12px);line-height:1.5}
.mj-dashboard th,.mj-dashboard td{padding:1px 8px;text-align:left;white-space:nowrap}
.mj-dashboard th{border-bottom:1px solid var(--jp-border-color1,#ccc)}
.mj-dashboard .mj-state{color:#fff;border-radius:3px;padding:0 5px}
.mj-dashboard .mj-bar{display:inline-block;width:120px;height:9px;vertical-align:middle;
  background:var(--jp-layout-color3,#ddd);border-radius:3px}
.mj-dashboard .mj-fill{height:100%;border-radius:3px}
.mj-dashboard .mj-last{display:inline-block;max-width:60ch;overflow:hidden;text-overflow:ellipsis;
  vertical-align:bottom}
.mj-dashboard .mj-error{color:#c62828}
.mj-dashboard .mj-header{margin:2px 0 4px 0}
.mj-dashboard .mj-note{margin-top:4px}
.mj-out{margin:0;white-space:pre-wrap;font-size:var(--jp-code-font-size,12px)}
.mj-err{color:#c62828}
.mj-rank-details summary{cursor:pointer}
</style>"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _badge(state: str) -> str:
    color = STATE_COLORS.get(state, "#8a8a8a")
    return f'<span class="mj-state" style="background:{color}">{_e(state)}</span>'


def _bar(row: RowView) -> str:
    frac = row.fraction
    color = STATE_COLORS["running"] if row.state in ("running", "queued") else STATE_COLORS.get(row.state, "#888")
    width = 0.0 if frac is None else 100.0 * frac  # a count without a total: an empty bar and the count
    value = "" if row.n is None else f' aria-valuenow="{row.n:g}"'
    vmax = "" if not row.total else f' aria-valuemax="{row.total:g}"'
    return (f'<div class="mj-bar" role="progressbar"{value}{vmax}>'
            f'<div class="mj-fill" style="width:{width:.1f}%;background:{color}"></div></div>')


def render_header(summary: Summary, title: str) -> str:
    """'mesh cell · ranks 0-3 · [running] 2 · [done] 2 · slowest: rank 1 · 2.5 s'."""
    parts = [f"<b>{_e(title)}</b>", _e(ranks_text(summary.ranks)) if summary.ranks else "no ranks"]
    for state, ranks in summary.by_state.items():
        parts.append(f"{_badge(state)} {len(ranks)}")
    if summary.slowest is not None:
        parts.append(f"slowest: rank {summary.slowest}")
    if summary.elapsed is not None:
        parts.append(_e(fmt_seconds(summary.elapsed)))
    if summary.group:
        parts.append(f"process group {_e(summary.group)}")
    return f'<div class="mj-header">{" · ".join(parts)}</div>'


def render_table(rows: list[RowView]) -> str:
    """An HTML table, one row per rank (all text escaped)."""
    heads = ("rank", "host", "device", "state", "time", "progress", "last output", "memory")
    out = ['<table class="mj-table"><thead><tr>', *(f"<th>{h}</th>" for h in heads), "</tr></thead><tbody>"]
    for row in rows:
        attrs = f'data-rank="{row.rank}" data-state="{_e(row.state)}"'
        if row.n is not None:
            attrs += f' data-n="{row.n:g}"'
        if row.total:
            attrs += f' data-total="{row.total:g}"'
        line = row.last_line
        last = _e(line[:LAST_LINE_CHARS] + ("…" if len(line) > LAST_LINE_CHARS else ""))
        if row.error:
            last = f'<span class="mj-error">{_e(row.error[:300])}</span>'
        cells = (str(row.rank), _e(row.host), _e(row.device), _badge(row.state), _e(fmt_seconds(row.elapsed)),
                 f"{_bar(row)} {_e(fmt_progress(row))}",
                 f'<span class="mj-last" title="{_e(line[:500])}">{last}</span>', _e(fmt_memory(row)))
        out.append(f'<tr class="mj-row" {attrs}>' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "".join(out)


def render_folded(rows: list[RowView], summary: Summary, limit: int = 8) -> str:
    """Per-state summary, then the ranks that need a look: failed or at a breakpoint, and stragglers."""
    out = ['<table class="mj-summary">']
    for state, ranks in summary.by_state.items():
        out.append(f"<tr><td>{_badge(state)}</td><td>{len(ranks)}</td><td>{_e(ranks_text(ranks))}</td></tr>")
    out.append("</table>")
    attention = [r for r in rows if r.state in ATTENTION_STATES][:limit]
    behind = [r for r in stragglers(rows, limit=limit) if r not in attention]
    pick = sorted(attention + behind[: max(0, limit - len(attention))], key=lambda r: r.rank)
    if pick:
        out.append('<div class="mj-note">failed, at a breakpoint, or behind:</div>')
        out.append(render_table(pick))
    return "".join(out)


def shared(name: str, factory: Any) -> Any:
    """A Layout/Style widget shared by every dashboard (one comm for all of them, not one per cell)."""
    widget = _SHARED.get(name)
    if widget is None or getattr(widget, "comm", None) is None:  # first use, or closed (Widget.close_all)
        widget = _SHARED[name] = factory()
    return widget


_SHARED: dict[str, Any] = {}


def html_page(body: str, final: bool) -> str:
    """The dashboard's HTML around ``body`` (its style, and ``data-final`` for tests)."""
    return f'{_STYLE}<div class="mj-dashboard" data-final="{str(final).lower()}">{body}</div>'


def render_body(rows: list[RowView], summary: Summary, title: str, folded: bool) -> str:
    """The header and the table (or, folded, the summary and the ranks that need a look)."""
    return render_header(summary, title) + (render_folded(rows, summary) if folded else render_table(rows))


class MeshDashboard(widgets.HTML):
    """The dashboard: one HTML widget with the header and the per-rank table.

    Made and updated by ``DashboardView``, at most 4 times a second, one comm message per update. Its layout
    and style models are shared by all dashboards, so a new cell's dashboard costs one comm. Its ``text/plain``
    is ``plain``: stable text for saved notebooks (nbval compares it).
    """

    def __init__(self, value: str = "", plain: str = "mesh", **kwargs: Any) -> None:
        super().__init__(value=value, layout=shared("layout", widgets.Layout),
                         style=shared("style", HTMLStyle), _dom_classes=("monarch-dashboard",), **kwargs)
        self.plain = plain
        self.full: widgets.HTML | None = None  # set on folded dashboards (FoldedDashboard)

    @property
    def html(self) -> MeshDashboard:
        return self

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return {"text/plain": self.plain,
                "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                             "model_id": self.model_id}}


class FoldedDashboard(widgets.VBox):
    """A dashboard of many ranks: the header, the per-state summary and the ranks that need a look, then the
    full table in a collapsed accordion, opened in the browser without a round trip to the (busy) kernel."""

    def __init__(self, value: str = "", plain: str = "mesh", ranks: int = 0) -> None:
        self.html = MeshDashboard(value, plain)
        self.full = widgets.HTML(value="", layout=shared("layout", widgets.Layout),
                                 style=shared("style", HTMLStyle))
        self.more = widgets.Accordion(children=[self.full], titles=(f"all {ranks} ranks",), selected_index=None)
        super().__init__(children=[self.html, self.more], layout=shared("layout", widgets.Layout))

    @property
    def plain(self) -> str:
        return self.html.plain

    @plain.setter
    def plain(self, text: str) -> None:
        self.html.plain = text

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        return {"text/plain": self.plain,
                "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                             "model_id": self.model_id}}

    def close(self) -> None:
        for w in (self.html, self.full, self.more):
            w.close()
        super().close()


class DashboardView(LiveView):
    """A live view rendered by a ``MeshDashboard`` (or, past ``fold_threshold`` ranks, a ``FoldedDashboard``).

    ``plain`` fixes the widget's text/plain (a cell's view is displayed before its state is known); without it,
    the text/plain follows the state (stable: no times).
    """

    def __init__(self, monitor: MeshMonitor, ranks: list[int] | None = None, *, follow_cell: bool = False,
                 title: str = "mesh", fold_threshold: int = 16, plain: str | None = None, lazy: bool = False) -> None:
        super().__init__(monitor, ranks, follow_cell=follow_cell)
        self.title = title
        self.fixed_plain = plain
        self._seen = monitor.version  # the widget starts with this state; start() renders only what changed
        rows, summary = self.snapshot()
        self.folded = len(rows) > fold_threshold
        self.widget: MeshDashboard | FoldedDashboard | None = None  # the dashboard widget, once made
        self.widget_made: Any = None  # what is displayed (the dashboard, or a box around it); None: not yet
        if not lazy:
            self.widget_made = self.make_widget(rows, summary)

    def make_widget(self, rows: list[RowView], summary: Summary) -> MeshDashboard | FoldedDashboard:
        """Make the dashboard widget showing ``rows`` (a lazy view makes it when it first needs it)."""
        value = self._html(rows, summary, False)
        text = self.fixed_plain or stable_text(rows, summary, title=self.title)
        self.widget = FoldedDashboard(value, text, len(rows)) if self.folded else MeshDashboard(value, text)
        return self.widget

    def _html(self, rows: list[RowView], summary: Summary, final: bool) -> str:
        return html_page(render_body(rows, summary, self.title, self.folded), final)

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        widget = self.widget
        if widget is None:
            return
        with widget.hold_sync():
            widget.html.value = self._html(rows, summary, final)
            if widget.full is not None:
                widget.full.value = html_page(render_table(rows), final)
        if self.fixed_plain is None:
            widget.plain = stable_text(rows, summary, title=self.title)

    def close(self) -> None:
        if self.widget is not None:
            self.widget.close()
