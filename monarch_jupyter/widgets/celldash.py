"""A ``%%mesh`` cell's view: the per-rank table, metric charts, and the cell's output, all in one display.

One place. The view captures the cell's output (``capture()``, ``kernel.output.OUTPUT_SINK``): what the ranks print
and display becomes part of this view instead of stream and display_data messages beside it, so each line and
figure shows once. The flat form (``[rankN]: line``) goes into the display's ``text/plain`` at the end, which is
what frontends without widgets, nbval and a saved notebook's plain view read; its ``text/html`` is the static form
(table, charts, every rank's output under its name) for nbconvert, GitHub and VS Code without ipywidgets.

A stable place, and few messages. Where a person watches (the request allows stdin: JupyterLab, Notebook 7, VS Code),
the view shows nothing as the cell starts: a cell that ends within ``DEFER`` seconds gets one display, its compact
result (a header line and the output, no table, no widget), and nothing else, or no display at all when it went well
on every rank and printed, displayed and reported nothing (as a Python cell: its result is its ``Out``); a cell still
running then gets the live widget, as its first display. When the kernel itself is about to print into the cell
before that (a pdb prompt, a note; ``kernel.output.hold_place``), the view first shows a one-line placeholder, so
what the kernel prints lands below it. Where nobody watches (nbval, nbconvert, papermill run with stdin off), the
view is one display at the cell's end (a placeholder at the start only for ``--async`` cells).

The live widget (ipywidgets 8, no extension of ours), a ``VBox``: the dashboard (``dashboard.MeshDashboard`` or
``FoldedDashboard``), an HTML widget with the charts (``outputs.render_charts``), a ``Tab`` strip ("all ranks", then a
tab per rank) and the output itself: one copy of every item, in HTML widgets of a few items each (only the last
one changes as output grows). The tabs filter that copy in the browser with CSS (``:has()`` on Lumino's current
tab), so switching tabs needs no round trip to the busy kernel and no item is in the page twice; a rank's tab shows
once it has output, an error or a prompt. Past ``fold_threshold`` ranks the strip has tabs only for the ranks that
failed, stopped or lag (at most ``TABS_FOLDED``), and "other ranks" with a selector answered by the kernel (so while
a cell keeps the kernel busy it shows its choice once the cell ends).

Every update goes through ``LiveView``'s ticker, at most 4 a second; the output at most once a second while the cell
runs.
"""

from __future__ import annotations

import contextlib
import html
import time
import uuid
from collections.abc import Iterator
from typing import Any

import ipywidgets as widgets
from ipywidgets.widgets.widget_string import HTMLStyle

from ..kernel.output import OUTPUT_SINK, PLACE_HOLDER
from ..ranks import ranks_text
from .dashboard import HEAD_STYLE, STYLE, DashboardView, html_page, render_body, render_header, shared
from .model import ATTENTION_STATES, FAILED_STATES, MeshMonitor, RowView, Summary, stragglers
from .outputs import render_charts, render_failure, render_item, render_items
from .record import LINES_KEPT, CellOutput

__all__ = ["CellDashboardView", "DEFER", "OUTPUT_TICK", "TABS_FOLDED", "SEGMENT_ITEMS"]

DEFER = 0.3  # seconds a cell runs before its view becomes a live widget
OUTPUT_TICK = 1.0  # seconds between two renders of the cell's output while it runs
TABS_FOLDED = 8  # rank tabs of a folded dashboard (failed or lagging ranks), besides "all ranks" and "other ranks"
SEGMENT_ITEMS = 8  # output items per HTML widget of the live view (a change re-sends only its widget)
LINES_SHOWN = 5000  # lines of output the view shows, the last ones (the flat text/plain keeps them all)
MERGED = "all ranks"


class CellDashboardView(DashboardView):
    """The view of one cell in a widget frontend (see the module docstring).

    Parameters
    ----------
    publish:
        ``publish(bundle, display_id, update)`` sends display data in the cell's context (widgets.publish_bundle).
    defer:
        Seconds before the live widget replaces the placeholder (0: at once).
    live:
        Make the live widget at all (False where nobody watches: one display, at the end).
    placeholder:
        Show the placeholder when the view is shown (``show``), not only at the end; with ``live``, only when the
        kernel is about to print into the cell before the view showed anything (``hold_place``).
    lines_kept:
        Lines of output the cell's record keeps (``record.CellOutput``; the option ``output_lines``).
    """

    def __init__(self, monitor: MeshMonitor, ranks: list[int], *, title: str, fold_threshold: int, plain: str,
                 publish: Any, defer: float = DEFER, live: bool = True, placeholder: bool = True,
                 lines_kept: int = LINES_KEPT) -> None:
        self.uid = uuid.uuid4().hex
        self.display_id = f"mj-dash-{self.uid}"
        self.output = CellOutput(lines_kept)
        self._publish = publish
        self._born = time.monotonic()
        self.defer = defer
        self.live = live
        self.placeholder = placeholder
        self._shown = False  # something is displayed under display_id
        self._output_seen = -1  # the record's version at the last render of the output
        self._output_time = 0.0
        self._fold_threshold = fold_threshold
        self.charts: widgets.HTML | None = None
        self.outputs: widgets.Tab | None = None  # the tab strip (its panels are empty: the output is below it)
        self.segments: widgets.VBox | None = None  # the output items, a few per HTML widget
        self.failures: widgets.HTML | None = None  # failed ranks and ranks at a prompt, after the output
        self.picker: widgets.Dropdown | None = None
        self.picked: widgets.HTML | None = None
        self._other: widgets.VBox | None = None  # the "other ranks" panel (folded): the selector and its output
        self._tab_ranks: list[int] = []
        self._segments: dict[int, tuple[tuple, widgets.HTML]] = {}  # chunk index -> (its items' key, widget)
        self._metrics_seen = -1
        self._metrics_born = monitor.metrics_version
        self._static_bundle: dict | None = None  # the final state without the widget (``retire`` shows it)
        self.retired = False
        super().__init__(monitor, ranks, follow_cell=True, title=title, fold_threshold=fold_threshold, plain=plain,
                         lazy=True)

    # ------------------------------------------------------------------ capture and show (the cell's thread)

    @contextlib.contextmanager
    def capture(self) -> Iterator[CellOutput]:
        """Within this block, the output of cells submitted from this context comes to the view (submit the cell in
        it: its context is captured at submission, so output that arrives later comes here too)."""
        token = OUTPUT_SINK.set(self.output.take)
        holder = PLACE_HOLDER.set(self.hold_place)
        try:
            yield self.output
        finally:
            PLACE_HOLDER.reset(holder)
            OUTPUT_SINK.reset(token)

    def show(self) -> None:
        """Display the live widget now (``defer`` 0), or the placeholder (``placeholder`` where nobody watches: an
        ``--async`` cell); else nothing yet (a watched cell's first display is its result or its live widget)."""
        if self.live and self.defer <= 0:
            self._make_live(*self.snapshot())
        elif self.placeholder and not self.live:
            self._send(self._compact_bundle())

    def hold_place(self) -> None:
        """The kernel is about to print into the cell: show the placeholder first if nothing is shown yet."""
        with self.lock:
            if not self._shown and not self.final and self.placeholder:
                self._send(self._compact_bundle())

    def _compact_bundle(self) -> dict:
        """The placeholder, which is also the whole final view of a quick cell that went well and printed nothing:
        one line naming the cell and its ranks (its result follows as the cell's own ``Out``)."""
        assert self.fixed_plain is not None
        head = f'<div class="mj-header"><b>{_e(self.title)}</b><span class="mj-sep">·</span>' \
               f"{_e(self.fixed_plain.rsplit(' on ', 1)[-1])}</div>"
        return {"text/plain": self.fixed_plain,
                "text/html": f'{HEAD_STYLE}<div class="mj-dashboard mj-compact">{head}</div>'}

    def wants_render(self) -> bool:
        if self.widget_made is None:
            return self.live and time.monotonic() - self._born >= self.defer
        return self.output.version != self._output_seen

    def _on_mesh_event(self, kind: str, data: dict) -> None:
        if (kind == "cell_done" and self.widget_made is None and self.handle is not None
                and data.get("handle") is self.handle):
            # A quick cell: the thread that waited for it renders the final state in finish() (the magic calls it
            # before returning the result), which costs less than a render on the events thread that the waiting
            # thread would wait for; where nobody calls finish(), the ticker renders it within TICK seconds.
            return
        super()._on_mesh_event(kind, data)

    def finish(self) -> None:
        """Render the final state now (see ``LiveView.finish``); output that reached the view after the final render
        on ``cell_done`` (the waiting thread writes the cell's last lines after that) is rendered again. From then
        on, output of the cell (a rank's thread printing late) is written to the notebook as usual."""
        super().finish()
        if self.final and self.handle is not None:  # (a cell that never started was abandoned: nothing to show)
            with self.lock:
                if self.output.version != self._output_seen:
                    self.render_again()
                self._close_output()  # else lines came meanwhile: the ticker shows them (lingers)

    def lingers(self) -> bool:
        """The record is still open after the final render: lines may still come (see ``after_final``)."""
        return self.handle is not None and not self.output.closed

    def after_final(self) -> bool:
        """A final view whose record is still open: a thread waits for the cell (``h.result()`` in a later cell of an
        ``--async`` cell, where no ``finish()`` comes) and writes its last lines after the final render on
        ``cell_done``, or lines came between a render and the close: they are rendered at the next tick, and the
        record closes once nobody waits and nothing came since that render."""
        if self.handle is None or self.output.closed:
            return False
        waited = self.handle.waited  # before the version: the waiter writes its last lines before it stops waiting
        if self.output.version != self._output_seen:
            self.render_again()
        return waited or not self._close_output()

    def retire(self) -> bool:
        """A finished cell's live widget becomes its final state as static HTML, in place (update_display under
        its display_id, which also changes what a saved notebook keeps), and its widget models are closed: a long
        session keeps the comms of its last few cells only (widgets.LIVE_CELL_VIEWS). False, doing nothing, while
        the cell runs or output may still come, or when the view has no live widget."""
        with self.lock:
            if (self.retired or not self.final or self.lingers() or self.widget_made is None
                    or self._static_bundle is None):
                return False
            self._publish(self._static_bundle, self.display_id, True)
            self.close()
            self.retired = True
            return True

    def abandon(self) -> None:
        """The cell never started: the placeholder goes (the error shows in its place)."""
        self.output.close()
        if self._shown:
            from IPython.display import clear_output

            self.ctx.run(clear_output)
            self._shown = False
        super().abandon()

    # ------------------------------------------------------------------ rendering (under the view lock)

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        if self.widget_made is None:
            # A cell still running at ``defer`` gets the live widget, even where the ticker was late to make it and
            # the cell ended first: what a person sees depends on how long the cell ran, not on the ticker's timing.
            quick = self._quick()
            late = self.live and not quick
            if final and not late:  # a quick cell (or nobody watches): one display of its final state
                self._output_seen = self.output.version
                if quick and self._clean(summary):
                    # Where a person watches, nothing: a Python cell that printed nothing shows nothing either (its
                    # result is its Out). Where nobody does, the header records where it ran. Shown already: the
                    # placeholder says it all, no message at all.
                    if not self._shown and not self.live:
                        self._send(self._compact_bundle())
                else:
                    self._send(self._final_bundle(rows, summary, compact=quick))
                self._close_if_unwaited()
                return
            if not late:
                return
            self._make_live(rows, summary)
        super().render(rows, summary, final)
        self._render_extras(rows, final)
        if final:  # frontends without widgets (nbconvert, GitHub) show the final state too
            bundle = self._final_bundle(rows, summary, compact=False)
            self._static_bundle = dict(bundle)
            assert self.widget_made is not None
            bundle["application/vnd.jupyter.widget-view+json"] = self._view_json()
            self._send(bundle)
            self._close_if_unwaited()

    def _quick(self) -> bool:
        return time.monotonic() - self._born < self.defer

    def final_shown(self) -> bool:
        """A quick cell that went well and printed nothing: under its placeholder, that is its final view; where a
        person watches and nothing is shown yet, nothing is (``render``), and nothing needs rendering to know it."""
        handle = self.handle
        if not ((self._shown or self.live) and self.widget_made is None and self._quick() and self.output.version == 0
                and self.monitor.metrics_version == self._metrics_born and handle is not None):
            return False
        snap = handle.snapshot()
        if snap.errors or len(snap.finished) != len(handle.ranks):
            return False
        self._output_seen = self.output.version
        return True

    def _clean(self, summary: Summary) -> bool:
        """Every rank is done, none printed or displayed anything, none reported a metric."""
        return (self.output.version == 0 and set(summary.by_state) == {"done"}
                and self.monitor.metrics_version == self._metrics_born)

    def _close_if_unwaited(self) -> None:
        """At the final render: nobody waits for the cell (``--async``), so its output is all in; later output of
        the cell goes to the notebook as usual. A waited cell's record closes in ``finish()``."""
        if self.handle is None or not self.handle.waited:
            self._close_output()  # else lines came since this render: the ticker shows them (lingers)

    def _close_output(self) -> bool:
        """Close the record unless output came since the last render (-1: none yet, which nothing taken matches)."""
        return self.output.close(max(self._output_seen, 0))

    def _send(self, bundle: dict) -> None:
        self._publish(bundle, self.display_id, self._shown)
        self._shown = True

    def _final_bundle(self, rows: list[RowView], summary: Summary, compact: bool) -> dict:
        """The final display: the flat text as ``text/plain``, the static form as ``text/html``."""
        flat = self.output.text()
        states = " · ".join(f"{s} on {ranks_text(rs)}" for s, rs in summary.by_state.items())
        plain = f"{self.fixed_plain}: {states}" if set(summary.by_state) != {"done"} else str(self.fixed_plain)
        return {"text/plain": plain + (f"\n{flat}" if flat else ""),
                "text/html": self._static(rows, summary, compact)}

    def _static(self, rows: list[RowView], summary: Summary, compact: bool) -> str:
        """The final state as static HTML: the header, the table (not for a quick cell), charts and the output."""
        cell = self.cell_id if self.cell_id is not None else -1
        charts = render_charts(self.monitor.metrics(cell, [r.rank for r in rows]), self.uid)
        _, hidden, items = self.output.tail(LINES_SHOWN)
        body = render_header(summary, self.title) if compact else render_body(rows, summary, self.title, self.folded)
        out = _hidden_note(hidden + self.output.dropped) + render_items(items)
        out += self._failures_html(rows, final=True)
        style = HEAD_STYLE if compact and not out and not charts else STYLE
        return html_page(body + charts + (f'<div class="mj-outputs">{out}</div>' if out else ""), True, style)

    def _failures_html(self, rows: list[RowView], final: bool) -> str:
        """Failed and interrupted ranks (with their tracebacks at the end) and ranks stopped at a prompt."""
        shown = [r for r in rows if r.state in FAILED_STATES or r.state in ("breakpoint", "interrupted")]
        if not shown:
            return ""
        errors = self.handle.snapshot().errors if final and self.handle is not None else {}
        return "".join(render_failure(r.rank, r.state, r.error, getattr(errors.get(r.rank), "traceback", ""))
                       for r in shown)

    def _view_json(self) -> dict:
        assert self.widget_made is not None
        return {"version_major": 2, "version_minor": 0, "model_id": self.widget_made.model_id}

    def _make_live(self, rows: list[RowView], summary: Summary) -> None:
        # Every model is made with its final state (classes, children, titles): each later change is a comm message
        # more. The charts and the failures are made when they first have something to show (most cells have
        # neither): two models, and the charts' own layout, fewer per cell.
        core = self.make_widget(rows, summary)
        layout = shared("layout", widgets.Layout)
        self.segments = widgets.VBox([], layout=layout, _dom_classes=("mj-outputs-box",))
        ranks = [r.rank for r in rows]
        children, titles = self._tabs([] if self.folded else ranks, ranks, None)
        self.outputs = widgets.Tab(children=children, titles=titles, layout=layout, _dom_classes=("mj-tabs",))
        box = widgets.VBox([core, self.outputs, self.segments], layout=layout,
                           _dom_classes=("mj-cellview", f"mj-cv-{self.uid}"))
        box.plain = self.fixed_plain
        self.widget_made = box
        head = render_header(summary, self.title)
        self._send({"text/plain": self.fixed_plain, "text/html": html_page(head, False),
                    "application/vnd.jupyter.widget-view+json": self._view_json()})

    def _render_extras(self, rows: list[RowView], final: bool) -> None:
        cell, box = self.cell_id, self.widget_made
        if cell is None or self.outputs is None or self.segments is None or box is None:
            return
        ranks = [r.rank for r in rows]
        if self.monitor.metrics_version != self._metrics_seen:
            self._metrics_seen = self.monitor.metrics_version
            # The dashboard's own HTML carries the style (dashboard.STYLE) of everything in the view.
            charts = render_charts(self.monitor.metrics(cell, ranks), self.uid)
            charts = f'<div class="mj-dashboard">{charts}</div>' if charts else ""
            if self.charts is None and charts:  # under the table
                self.charts = _html(charts)
                box.children = (box.children[0], self.charts, *box.children[1:])
            elif self.charts is not None and charts != self.charts.value:
                self.charts.value = charts
        failures = self._failures_html(rows, final)
        failures = f'<div class="mj-outputs">{failures}</div>' if failures else ""
        if self.failures is None and failures:  # after the output
            self.failures = _html(failures)
            box.children = (*box.children, self.failures)
        elif self.failures is not None and failures != self.failures.value:
            self.failures.value = failures
        version = self.output.version
        now = time.monotonic()
        if version == self._output_seen or (not final and now - self._output_time < OUTPUT_TICK):
            return
        self._output_seen, self._output_time = version, now
        if self.folded:
            self._fold_tabs(rows, ranks)
        self._set_segments()
        if self.picker is not None and self.picked is not None and self.picker.value is not None:
            self._show_picked(self.picker.value)

    def _set_segments(self) -> None:
        """Put the last ``LINES_SHOWN`` lines' items into the HTML widgets of the output, ``SEGMENT_ITEMS`` items a
        widget: only a widget whose items changed is sent again (as output grows, the last one)."""
        assert self.segments is not None
        first, hidden, tail = self.output.tail(LINES_SHOWN, SEGMENT_ITEMS)
        hidden += self.output.dropped
        old, self._segments = self._segments, {}
        for start in range(first, first + len(tail), SEGMENT_ITEMS):
            chunk = tail[start - first:start - first + SEGMENT_ITEMS]
            key = (hidden if start == first else 0, *((i.seq, i.changed, len(i.lines)) for i in chunk))
            k = start // SEGMENT_ITEMS
            was = old.pop(k, None)
            if was is not None and was[0] == key:
                self._segments[k] = was
                continue
            note = _hidden_note(hidden) if start == first else ""
            value = f'<div class="mj-outputs">{note}{"".join(render_item(i) for i in chunk)}</div>'
            if was is not None:
                was[1].value = value
                self._segments[k] = (key, was[1])
            else:
                self._segments[k] = (key, _html(value))
        children = [w for _, w in self._segments.values()]
        if children != list(self.segments.children):
            self.segments.children = children
        for _, w in old.values():
            w.close()

    # ------------------------------------------------------------------ tabs

    def _set_tabs(self, wanted: list[int], ranks: list[int]) -> None:
        """Tabs "all ranks", then ``wanted`` (each shown once its rank has an item), then "other ranks" (folded)."""
        assert self.outputs is not None
        children, titles = self._tabs(wanted, ranks, self.outputs.children[0])
        with self.outputs.hold_sync():
            self.outputs.children = children
            self.outputs.titles = titles

    def _tabs(self, wanted: list[int], ranks: list[int], first: widgets.HTML | None) -> tuple[list, tuple[str, ...]]:
        """The tab strip's children and titles for ``_set_tabs``; ``first``: the first tab's panel, which holds the
        style that filters the output by the current tab (None: make it)."""
        self._tab_ranks = list(wanted)
        style = self._tab_style(wanted)
        if first is None:
            first = _html(style)
        elif first.value != style:
            first.value = style
        children: list = [first, *[shared("empty", _html)] * len(wanted)]  # the panels stay empty: one serves all
        titles = [MERGED] + [f"rank {r}" for r in wanted]
        if self.folded:
            if self.picker is None:
                self.picker = widgets.Dropdown(options=ranks, value=None, description="rank")
                self.picked = _html()
                self.picker.observe(lambda change: self._show_picked(change["new"]), "value")
                self._other = widgets.VBox([self.picker, self.picked])
            children.append(self._other)
            titles.append("other ranks")
        return children, tuple(titles)

    def _tab_style(self, tab_ranks: list[int]) -> str:
        """CSS that filters the output by the current tab (scoped to this cell's widget)."""
        cv = f".mj-cv-{self.uid}"
        tab = ".mj-tabs li.lm-TabBar-tab"
        rules = [f"{cv}:not(:has(.mj-item)) .mj-tabs{{display:none}}"]
        if self.folded:  # the selector's panel shows only when "other ranks" is current; the output then hides
            rules.append(f"{cv}:not(:has({tab}:last-child.lm-mod-current)) .mj-tabs .widget-tab-contents"
                         "{display:none}")
            rules.append(f"{cv}:has({tab}:last-child.lm-mod-current) .mj-outputs-box{{display:none}}")
        else:
            rules.append(f"{cv} .mj-tabs .widget-tab-contents{{display:none}}")
        for k, r in enumerate(tab_ranks, start=2):
            rules.append(f'{cv}:not(:has(.mj-item[data-ranks~="{r}"])) {tab}:nth-child({k}){{display:none}}')
            rules.append(f'{cv}:has({tab}:nth-child({k}).lm-mod-current) .mj-item:not([data-ranks~="{r}"])'
                         "{display:none}")
        return "<style>" + "\n".join(rules) + "</style>"

    def _fold_tabs(self, rows: list[RowView], ranks: list[int]) -> None:
        """Folded: a tab for each rank that failed, stopped or lags (appended, so that tabs never move)."""
        attention = [r.rank for r in rows if r.state in ATTENTION_STATES]
        behind = [r.rank for r in stragglers(rows, limit=TABS_FOLDED)]
        wanted = list(self._tab_ranks)
        for r in dict.fromkeys(attention + behind):
            if r not in wanted and len(wanted) < TABS_FOLDED:
                wanted.append(r)
        if wanted != self._tab_ranks or self.picker is None:
            self._set_tabs(wanted, ranks)

    def _show_picked(self, rank: Any) -> None:
        if rank is None or self.picked is None:
            return
        _, items = self.output.items()
        mine = [i for i in items if int(rank) in i.ranks]
        value = f'<div class="mj-outputs">{render_items(mine) or "no output"}</div>'
        if value != self.picked.value:
            self.picked.value = value

    def close(self) -> None:
        if self.widget_made is not None:
            assert self.segments is not None and self.outputs is not None
            common = {id(shared("layout", widgets.Layout)), id(shared("style", HTMLStyle))}
            for w in (*self.segments.children, self.segments, self.outputs.children[0], *self.outputs.children[1:],
                      self.outputs, self.charts, self.failures, self.picker, self.picked, self.widget_made):
                if w is None or id(w) in common or w is shared("empty", _html):
                    continue
                # Its own layout and style models too (the charts' layout, the rank selector's): ipywidgets closes
                # a widget's comm only, and they would stay for the session.
                for part in (getattr(w, "layout", None), getattr(w, "style", None)):
                    if part is not None and id(part) not in common:
                        part.close()
                w.close()
            super().close()


def _hidden_note(lines: int) -> str:
    """A note for the lines before those shown (the text/plain of the view has them, up to its lines_kept)."""
    return f'<div class="mj-note">{lines} earlier lines not shown here</div>' if lines else ""


def _html(value: str = "") -> widgets.HTML:
    """An HTML widget sharing the dashboards' layout and style models (no comm of its own for them)."""
    return widgets.HTML(value=value, layout=shared("layout", widgets.Layout), style=shared("style", HTMLStyle))


def plain_header(title: str, ranks: list[int]) -> str:
    """The first line of a cell view's ``text/plain``: '<title> on ranks 0,1' (then, where not every rank is done,
    ': error on rank 1 · done on rank 0', and the ranks' lines)."""
    return f"{title} on {ranks_text(ranks)}"


def _e(text: str) -> str:
    return html.escape(text, quote=True)
