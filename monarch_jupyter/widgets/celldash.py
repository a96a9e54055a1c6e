"""A ``%%mesh`` cell's live dashboard: the per-rank table, live metric charts and each rank's own output.

Cost. Most cells are short, and a widget costs a comm (its whole state), its display and an update at its end:
three messages through ipykernel's IOPub thread, over 1 ms of the kernel's time per cell. So a cell shows nothing
for its first ``DEFER`` seconds. A cell that ends sooner gets one display at its end: its final table as static
HTML (each rank's output in a ``<details>``, charts as SVG), no widget. A cell still running after ``DEFER``
seconds gets the live widget then (displayed from the ticker thread, in the cell's context). Both displays carry
the same ``text/plain`` (stable: nbval compares it) and a ``text/html`` (the static form; for the widget, what
frontends without widgets show, updated to the final state at the end); notebooks/nbval_sanitize.cfg folds the
dashboard's HTML, whose times and memory vary, into one token.

The live widget (ipywidgets 8, no extension of ours): the dashboard (``dashboard.MeshDashboard`` or
``FoldedDashboard``), an HTML widget with the charts (``outputs.render_charts``: numbers from ``progress(...,
loss=...)`` and tqdm postfixes, one line per rank, points capped by the monitor) and a ``Tab`` strip with one tab
per rank holding that rank's whole output in the cell, rich outputs included (tabs switch in the browser, with no
round trip to the busy kernel). Past ``fold_threshold`` ranks the strip has tabs only for failed, stopped or lagging
ranks, and an "other ranks" tab with a selector for the rest (the selector is answered by the kernel, so while a
cell keeps the kernel busy it shows its choice once the cell ends).

Every update goes through ``LiveView``'s ticker, at most 4 a second; a rank's output tab at most once a second while
the cell runs.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from .dashboard import DashboardView, html_page, render_body, shared
from .model import ATTENTION_STATES, MeshMonitor, RowView, Summary, stragglers
from .outputs import render_charts, render_details, render_rank_output

__all__ = ["CellDashboardView", "DEFER", "OUTPUT_TICK", "TABS_FOLDED"]

DEFER = 0.3  # seconds a cell runs before its view becomes a live widget
OUTPUT_TICK = 1.0  # seconds between two renders of one rank's output tab while the cell runs
TABS_FOLDED = 8  # rank tabs of a folded dashboard (failed or lagging ranks), besides "other ranks"


class CellDashboardView(DashboardView):
    """The live view of one cell in a widget frontend (see the module docstring).

    ``publish(bundle, display_id, update)`` sends display data (widgets.publish_bundle in the kernel).
    """

    def __init__(self, monitor: MeshMonitor, ranks: list[int], *, title: str, fold_threshold: int, plain: str,
                 publish: Any, defer: float = DEFER) -> None:
        self.display_id = f"mj-dash-{uuid.uuid4().hex}"
        self._publish = publish
        self._born = time.monotonic()
        self.defer = defer
        self._fold_threshold = fold_threshold
        self.outputs: widgets.Tab | None = None
        self.charts: widgets.HTML | None = None
        self.picker: widgets.Dropdown | None = None
        self.picked: widgets.HTML | None = None
        self._tab_ranks: list[int] = []
        self._tab_logged: dict[int, int] = {}
        self._tab_time: dict[int, float] = {}
        self._metrics_seen = -1
        super().__init__(monitor, ranks, follow_cell=True, title=title, fold_threshold=fold_threshold, plain=plain,
                         lazy=True)

    def show(self) -> None:
        """With ``defer`` 0: display the live widget now. Otherwise nothing is shown yet (see the module docstring)."""
        if self.defer <= 0:
            self._make_live(*self.snapshot())

    def wants_render(self) -> bool:
        return self.widget_made is None and time.monotonic() - self._born >= self.defer

    def _on_mesh_event(self, kind: str, data: dict) -> None:
        if (kind == "cell_done" and self.widget_made is None and self.handle is not None
                and data.get("handle") is self.handle):
            # A quick cell: the thread that waited for it renders the final state in finish() (the magic calls it
            # before returning the result), which costs less than a render on the events thread that the waiting
            # thread would wait for; where nobody calls finish(), the ticker renders it within TICK seconds.
            return
        super()._on_mesh_event(kind, data)

    # ------------------------------------------------------------------ rendering (under the view lock)

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        if self.widget_made is None:
            if final:  # a fast cell: one display, its final state as static HTML
                self._publish({"text/plain": self.fixed_plain, "text/html": self._static(rows, summary, True)},
                              self.display_id, False)
                return
            if time.monotonic() - self._born < self.defer:
                return
            self._make_live(rows, summary)
        super().render(rows, summary, final)
        self._render_extras(rows, final)
        if final:  # frontends without widgets (nbconvert, GitHub) show the final state too
            self._publish(self._bundle(self._static(rows, summary, True)), self.display_id, True)

    def _static(self, rows: list[RowView], summary: Summary, final: bool) -> str:
        cell = self.cell_id if self.cell_id is not None else -1
        ranks = [r.rank for r in rows]
        charts = render_charts(self.monitor.metrics(cell, ranks))
        details = render_details({r: self.monitor.rank_log(cell, r)[1] for r in ranks}) if final else ""
        return html_page(render_body(rows, summary, self.title, self.folded) + charts + details, final)

    def _bundle(self, static: str) -> dict:
        assert self.widget_made is not None
        return {"text/plain": self.fixed_plain, "text/html": static,
                "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                             "model_id": self.widget_made.model_id}}

    def _make_live(self, rows: list[RowView], summary: Summary) -> None:
        core = self.make_widget(rows, summary)
        self.charts = _html()
        self.outputs = widgets.Tab(children=[], layout=widgets.Layout(display="none"))
        box = widgets.VBox([core, self.charts, self.outputs], layout=shared("layout", widgets.Layout))
        box.plain = self.fixed_plain
        self.widget_made = box
        self._publish(self._bundle(self._static(rows, summary, False)), self.display_id, False)

    def _render_extras(self, rows: list[RowView], final: bool) -> None:
        cell = self.cell_id
        if cell is None or self.outputs is None or self.charts is None:
            return
        ranks = [r.rank for r in rows]
        if self.monitor.metrics_version != self._metrics_seen:
            self._metrics_seen = self.monitor.metrics_version
            charts = render_charts(self.monitor.metrics(cell, ranks))
            if charts != self.charts.value:
                self.charts.value = charts
        logged = self.monitor.logged(cell, ranks)
        if not any(logged.values()):
            return
        wanted = self._tab_choice(rows, logged)
        now = time.monotonic()
        with self.outputs.hold_sync():
            if wanted != self._tab_ranks:
                self._set_tabs(wanted, ranks)
            for i, r in enumerate(self._tab_ranks):
                if logged.get(r, 0) == self._tab_logged.get(r, 0):
                    continue
                if not final and now - self._tab_time.get(r, 0.0) < OUTPUT_TICK:
                    continue
                self._tab_logged[r], self._tab_time[r] = logged[r], now
                child = self.outputs.children[i]
                if isinstance(child, widgets.HTML):
                    child.value = render_rank_output(self.monitor.rank_log(cell, r)[1], r)
            if self.picker is not None and self.picked is not None and self.picker.value is not None:
                self._show_picked(self.picker.value)
            if self.outputs.layout.display == "none":
                self.outputs.layout.display = ""

    def _tab_choice(self, rows: list[RowView], logged: dict[int, int]) -> list[int]:
        if not self.folded:
            return [r.rank for r in rows if logged.get(r.rank)]
        attention = [r.rank for r in rows if r.state in ATTENTION_STATES]
        behind = [r.rank for r in stragglers(rows, limit=TABS_FOLDED)]
        return sorted(dict.fromkeys(attention + behind))[:TABS_FOLDED]

    def _set_tabs(self, wanted: list[int], ranks: list[int]) -> None:
        assert self.outputs is not None
        old = dict(zip(self._tab_ranks, self.outputs.children, strict=False))
        children = [old.get(r) or _html() for r in wanted]
        titles = [f"rank {r}" for r in wanted]
        for r in wanted:
            if r not in old:
                self._tab_logged.pop(r, None)
                self._tab_time.pop(r, None)
        if self.folded:
            if self.picker is None:
                self.picker = widgets.Dropdown(options=ranks, value=None, description="rank")
                self.picked = _html()
                self.picker.observe(lambda change: self._show_picked(change["new"]), "value")
            children.append(widgets.VBox([self.picker, self.picked]))
            titles.append("other ranks")
        self._tab_ranks = wanted
        self.outputs.children = children
        self.outputs.titles = tuple(titles)

    def _show_picked(self, rank: Any) -> None:
        if rank is None or self.picked is None or self.cell_id is None:
            return
        value = render_rank_output(self.monitor.rank_log(self.cell_id, int(rank))[1], int(rank))
        if value != self.picked.value:
            self.picked.value = value

    def close(self) -> None:
        if self.widget_made is not None:
            for w in (self.charts, self.outputs, self.picker, self.picked):
                if w is not None:
                    w.close()
            super().close()


def _html() -> widgets.HTML:
    """An HTML widget sharing the dashboards' layout and style models (no comm of its own for them)."""
    return widgets.HTML(value="", layout=shared("layout", widgets.Layout), style=shared("style", HTMLStyle))
