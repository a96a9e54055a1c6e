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
           "render_body", "html_page", "shared", "STYLE", "HEAD_STYLE"]

# Colours are JupyterLab's theme variables (light, dark and high-contrast themes define them), with fallbacks for
# frontends that do not (VS Code, nbconvert's HTML, GitHub).
STATE_COLORS = {
    "starting": "var(--jp-layout-color4,#757575)", "queued": "var(--jp-layout-color4,#757575)",
    "idle": "var(--jp-layout-color4,#757575)", "stopped": "var(--jp-layout-color4,#757575)",
    "running": "var(--jp-brand-color1,#1976d2)", "done": "var(--jp-success-color1,#388e3c)",
    "breakpoint": "var(--jp-warn-color1,#f57c00)", "interrupted": "var(--jp-warn-color1,#f57c00)",
    "error": "var(--jp-error-color1,#d32f2f)",
    "dead": "var(--jp-error-color0,#b71c1c)",
}
LAST_LINE_CHARS = 300  # of the last output line put in a row (shown cut with an ellipsis; the full line is its tooltip)

# Every selector starts with the dashboard's own classes and is more specific than JupyterLab's rendered-HTML rules
# (`.jp-RenderedHTMLCommon tbody tr:nth-child(odd)` and the like), which therefore never restyle these tables. The
# table scrolls sideways in its own box rather than being clipped; "last output" and progress are bounded, with an
# ellipsis, and narrower when the output area is narrow (a container query).
STYLE = """<style>
.mj-dashboard{container-type:inline-size;max-width:100%;min-width:0;color:var(--jp-ui-font-color1,inherit);
  font-family:var(--jp-ui-font-family,system-ui,sans-serif);font-size:var(--jp-ui-font-size1,13px);line-height:1.4}
.mj-dashboard .mj-header{display:flex;flex-wrap:wrap;align-items:center;gap:2px 6px;margin:2px 0 4px 0}
.mj-dashboard .mj-sep{opacity:.5}
.mj-dashboard .mj-scroll{overflow-x:auto;max-width:100%}
.mj-dashboard table.mj-table,.mj-dashboard table.mj-summary{border-collapse:collapse;border-spacing:0;border:none;
  margin:0;table-layout:auto;width:auto;color:inherit;font-family:var(--jp-code-font-family,monospace);
  font-size:var(--jp-code-font-size,12px)}
.mj-dashboard table.mj-table th,.mj-dashboard table.mj-table td,.mj-dashboard table.mj-summary td{padding:1px 8px;
  text-align:left;vertical-align:middle;white-space:nowrap;border:none;background:none;line-height:1.5;
  max-width:none;font-size:inherit}
.mj-dashboard table.mj-table thead th{font-weight:600;border-bottom:1px solid var(--jp-border-color1,#bdbdbd)}
.mj-dashboard table.mj-table tbody tr,.mj-dashboard table.mj-table tbody tr:nth-child(odd),
.mj-dashboard table.mj-table tbody tr:nth-child(even),.mj-dashboard table.mj-table tbody tr:hover,
.mj-dashboard table.mj-summary tbody tr:nth-child(odd),.mj-dashboard table.mj-summary tbody tr:hover{
  background:transparent}
.mj-dashboard .mj-state{display:inline-block;color:#fff;border-radius:3px;padding:0 5px;line-height:1.45;
  font-family:var(--jp-ui-font-family,sans-serif);font-size:var(--jp-ui-font-size0,11px)}
.mj-dashboard .mj-bar{display:inline-block;width:80px;height:8px;margin-right:6px;vertical-align:middle;
  background:var(--jp-layout-color3,#e0e0e0);border-radius:3px;overflow:hidden}
.mj-dashboard .mj-fill{height:100%;background:var(--jp-brand-color1,#1976d2)}
.mj-dashboard .mj-cut{display:inline-block;overflow:hidden;text-overflow:ellipsis;white-space:nowrap;
  vertical-align:bottom}
.mj-dashboard .mj-prog{max-width:30ch}
.mj-dashboard .mj-last{max-width:44ch}
.mj-dashboard .mj-muted{color:var(--jp-ui-font-color2,#757575)}
.mj-dashboard .mj-error{color:var(--jp-error-color1,#d32f2f)}
.mj-dashboard .mj-note{color:var(--jp-ui-font-color2,#757575);margin:2px 0}
@container (max-width:760px){.mj-dashboard .mj-last{max-width:16ch}.mj-dashboard .mj-prog{max-width:14ch}
  .mj-dashboard .mj-bar{width:40px;margin-right:4px}
  .mj-dashboard table.mj-table th,.mj-dashboard table.mj-table td{padding:1px 5px}}
.mj-dashboard .mj-charts{display:flex;flex-wrap:wrap;gap:4px 12px;margin:6px 0 2px 0}
.mj-dashboard figure.mj-chart-box{margin:0;padding:0;max-width:100%}
.mj-dashboard svg.mj-chart{display:block;max-width:100%;height:auto;overflow:visible;
  color:var(--jp-ui-font-color1,currentColor);font:10px var(--jp-ui-font-family,sans-serif)}
.mj-dashboard .mj-legend{display:flex;flex-wrap:wrap;gap:0 10px;font-size:var(--jp-ui-font-size0,11px);
  color:var(--jp-ui-font-color2,inherit);padding-left:4px}
.mj-dashboard .mj-legend i{display:inline-block;width:12px;height:3px;margin:0 4px 3px 0;vertical-align:middle}
.mj-outputs{margin-top:4px;max-width:100%;min-width:0}
.mj-outputs-box .mj-outputs{margin-top:0}
.mj-outputs-box>.widget-html,.mj-cellview>.widget-html{margin-top:0;margin-bottom:0}
.mj-outputs .mj-item{display:grid;grid-template-columns:6.5em minmax(0,1fr);column-gap:6px;align-items:start}
.mj-outputs .mj-who{font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,12px);
  line-height:var(--jp-code-line-height,1.4);white-space:nowrap;overflow:hidden;text-overflow:ellipsis;
  padding:1px 0 0 5px;border-left:3px solid transparent;color:var(--jp-ui-font-color2,inherit)}
.mj-outputs pre.mj-text{margin:0;padding:1px 4px;border:none;background:none;color:inherit;white-space:pre-wrap;
  overflow-wrap:anywhere;font-family:var(--jp-code-font-family,monospace);font-size:var(--jp-code-font-size,12px);
  line-height:var(--jp-code-line-height,1.4)}
.mj-outputs .mj-stderr pre.mj-text{background:var(--jp-rendermime-error-background,#fdd)}
.mj-outputs .mj-rich{min-width:0;max-width:100%;overflow-x:auto;padding:2px 0 6px 0}
.mj-outputs .mj-rich img{max-width:100%;height:auto}
.mj-outputs .mj-rich table{margin-left:0;margin-right:0}
.mj-outputs .mj-error,.mj-outputs .mj-note{font-family:var(--jp-code-font-family,monospace);padding:1px 4px;
  font-size:var(--jp-code-font-size,12px);line-height:var(--jp-code-line-height,1.4)}
.mj-outputs .mj-error{color:var(--jp-error-color1,#d32f2f)}
.mj-outputs .mj-note{color:var(--jp-ui-font-color2,#757575)}
.mj-outputs details.mj-tb summary{cursor:pointer;color:var(--jp-ui-font-color2,#757575);padding:0 4px}
</style>"""


# What a header line alone needs (a cell's placeholder, a quick cell's compact result): a few hundred bytes, not the
# whole STYLE, in the message every cell sends.
HEAD_STYLE = """<style>
.mj-dashboard{color:var(--jp-ui-font-color1,inherit);font-family:var(--jp-ui-font-family,system-ui,sans-serif);
  font-size:var(--jp-ui-font-size1,13px);line-height:1.4}
.mj-dashboard .mj-header{display:flex;flex-wrap:wrap;align-items:center;gap:2px 6px;margin:2px 0 4px 0}
.mj-dashboard .mj-sep{opacity:.5}
.mj-dashboard .mj-state{display:inline-block;color:#fff;border-radius:3px;padding:0 5px;line-height:1.45;
  font-family:var(--jp-ui-font-family,sans-serif);font-size:var(--jp-ui-font-size0,11px)}
</style>"""


def _e(text: Any) -> str:
    return html.escape(str(text), quote=True)


def _badge(state: str) -> str:
    color = STATE_COLORS.get(state, STATE_COLORS["idle"])
    # White on the theme's warn orange is about 2.2:1 (dark theme) to 2.7:1 (light); dark text is over 7:1.
    text = ";color:rgba(0,0,0,.87)" if color == STATE_COLORS["breakpoint"] else ""
    return f'<span class="mj-state" style="background:{color}{text}">{_e(state)}</span>'


def _bar(row: RowView) -> str:
    """A bar for a rank that reported a count of a known total; nothing otherwise (an empty bar reads as 0 %)."""
    frac = row.fraction
    if frac is None:
        return ""
    color = STATE_COLORS["running"] if row.state in ("running", "queued") else STATE_COLORS.get(row.state, "")
    value = "" if row.n is None else f' aria-valuenow="{row.n:g}"'
    return (f'<div class="mj-bar" role="progressbar"{value} aria-valuemax="{row.total:g}">'
            f'<div class="mj-fill" style="width:{100.0 * frac:.1f}%;background:{color}"></div></div>')


def render_header(summary: Summary, title: str) -> str:
    """'mesh cell · ranks 0-3 · [running] 2 · [done] 2 · slowest: rank 1 · 2.5 s'."""
    parts = [f"<b>{_e(title)}</b>", _e(ranks_text(summary.ranks)) if summary.ranks else "no ranks"]
    for state, ranks in summary.by_state.items():
        parts.append(f"<span>{_badge(state)} {len(ranks)}</span>")
    if summary.slowest is not None:
        parts.append(f"<span>slowest: rank {summary.slowest}</span>")
    if summary.elapsed is not None:
        parts.append(f"<span>{_e(fmt_seconds(summary.elapsed))}</span>")
    if summary.group:
        parts.append(f"<span>process group {_e(summary.group)}</span>")
    sep = '<span class="mj-sep">·</span>'
    return f'<div class="mj-header">{sep.join(parts)}</div>'


def render_table(rows: list[RowView], *, status: bool = False) -> str:
    """An HTML table, one row per rank (all text escaped), in a box that scrolls sideways when it is too wide.

    ``status``: rows of the mesh (``%mesh status``), not of one cell: time and last output are those of each rank's
    last cell, and say so (greyed for ranks that are idle now).
    """
    progress = any(row.n is not None for row in rows)
    heads = ["rank", "host", "device", "state", "last cell" if status else "time"]
    heads += ["progress"] if progress else []
    heads += ["last output (last cell)" if status else "last output", "memory"]
    out = ['<div class="mj-scroll"><table class="mj-table"><thead><tr>', *(f"<th>{h}</th>" for h in heads),
           "</tr></thead><tbody>"]
    for row in rows:
        attrs = f'data-rank="{row.rank}" data-state="{_e(row.state)}"'
        if row.n is not None:
            attrs += f' data-n="{row.n:g}"'
        if row.total:
            attrs += f' data-total="{row.total:g}"'
        muted = status and row.state == "idle"
        if row.error:  # an interrupt and a debugger's note are not errors of the rank's code: grey, not red
            kind = "mj-error" if row.state in ("error", "dead") else "mj-muted"
            full, shown = row.error, f'<span class="{kind}">{_e(row.error[:LAST_LINE_CHARS])}</span>'
        else:
            full, shown = row.last_line, _e(row.last_line[:LAST_LINE_CHARS])
        tip = f"from rank {row.rank}'s last cell: " if muted and full else ""
        cut = "mj-cut mj-last mj-muted" if muted else "mj-cut mj-last"
        last = f'<span class="{cut}" title="{_e(tip + full[:1000])}">{shown}</span>'
        took = _e(fmt_seconds(row.elapsed))
        cells = [str(row.rank), _e(row.host), _e(row.device), _badge(row.state),
                 f'<span class="mj-muted">{took}</span>' if muted else took]
        if progress:
            text = fmt_progress(row)
            cells.append(f'{_bar(row)}<span class="mj-cut mj-prog" title="{_e(text)}">{_e(text)}</span>')
        cells += [last, _e(fmt_memory(row))]
        out.append(f'<tr class="mj-row" {attrs}>' + "".join(f"<td>{c}</td>" for c in cells) + "</tr>")
    out.append("</tbody></table></div>")
    return "".join(out)


def render_folded(rows: list[RowView], summary: Summary, limit: int = 8) -> str:
    """Per-state summary, then the ranks that need a look: failed or at a breakpoint, and stragglers."""
    out = ['<div class="mj-scroll"><table class="mj-summary"><tbody>']
    for state, ranks in summary.by_state.items():
        out.append(f"<tr><td>{_badge(state)}</td><td>{len(ranks)}</td><td>{_e(ranks_text(ranks))}</td></tr>")
    out.append("</tbody></table></div>")
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


def html_page(body: str, final: bool, style: str = STYLE) -> str:
    """The dashboard's HTML around ``body`` (its ``style``, and ``data-final`` for tests)."""
    return f'{style}<div class="mj-dashboard" data-final="{str(final).lower()}">{body}</div>'


def render_body(rows: list[RowView], summary: Summary, title: str, folded: bool, *, status: bool = False) -> str:
    """The header and the table (or, folded, the summary and the ranks that need a look)."""
    table = render_folded(rows, summary) if folded else render_table(rows, status=status)
    return render_header(summary, title) + table


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
        self.widget: MeshDashboard | FoldedDashboard | None = None  # the dashboard widget, once made
        self.widget_made: Any = None  # what is displayed (the dashboard, or a box around it); None: not yet
        if lazy and ranks is not None:  # (a cell's view: no snapshot until it shows something)
            self.folded = len(ranks) > fold_threshold
            return
        rows, summary = self.snapshot()
        self.folded = len(rows) > fold_threshold
        if not lazy:
            self.widget_made = self.make_widget(rows, summary)

    def make_widget(self, rows: list[RowView], summary: Summary) -> MeshDashboard | FoldedDashboard:
        """Make the dashboard widget showing ``rows`` (a lazy view makes it when it first needs it)."""
        value = self._html(rows, summary, False)
        text = self.fixed_plain or stable_text(rows, summary, title=self.title)
        self.widget = FoldedDashboard(value, text, len(rows)) if self.folded else MeshDashboard(value, text)
        return self.widget

    def _html(self, rows: list[RowView], summary: Summary, final: bool) -> str:
        return html_page(render_body(rows, summary, self.title, self.folded, status=not self.follow_cell), final)

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        widget = self.widget
        if widget is None:
            return
        with widget.hold_sync():
            widget.html.value = self._html(rows, summary, final)
            if widget.full is not None:
                widget.full.value = html_page(render_table(rows, status=not self.follow_cell), final)
        if self.fixed_plain is None:
            widget.plain = stable_text(rows, summary, title=self.title)

    def close(self) -> None:
        if self.widget is not None:
            self.widget.close()
