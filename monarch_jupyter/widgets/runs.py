"""A live chart that compares the runs of the experiment table (monarch_jupyter/experiments.py) on one metric.

``Experiments.chart("val_loss")`` makes a ``RunChart``. In a widget frontend it is one ipywidgets HTML widget: the
chart (``outputs.render_charts``, the cell dashboards' SVG line charts, one line per run, x the step) above the
table, redrawn at most ``REDRAW_INTERVAL`` seconds apart while runs report, and once more when the table changes
last. Elsewhere (a terminal, nbconvert, mode="text") it is text: each run's state and its last and best values of
the metric, as of when it is shown (``text()``). ``close()`` stops the updates.
"""

from __future__ import annotations

import threading
import time
import uuid
from typing import Any

from . import choose_mode
from .outputs import render_charts

__all__ = ["RunChart", "REDRAW_INTERVAL"]

REDRAW_INTERVAL = 0.5  # seconds between two redraws of a live chart


class RunChart:
    """A chart of ``metric`` across the runs of ``table`` (see the module docstring).

    Raises ValueError for an unknown ``mode`` (``widgets.MODES``).
    """

    def __init__(self, table: Any, metric: str, *, mode: str = "auto") -> None:
        self.table, self.metric = table, str(metric)
        self.mode = choose_mode(mode)
        self.uid = f"runs-{uuid.uuid4().hex[:8]}"
        self.widget: Any = None
        self._lock = threading.Lock()
        self._last = 0.0
        self._timer: threading.Timer | None = None
        if self.mode == "widget":
            import ipywidgets as widgets

            self.widget = widgets.HTML(value=self.html())
            table.add_listener(self._changed)

    def text(self) -> str:
        """Each run's state and its last and best values of the metric (plain text)."""
        series = self.table.series(self.metric)
        rows = {r["run"]: r for r in self.table.rows()}
        lines = [f"{self.metric} by run (last, best over steps):"]
        for number, pts in sorted(series.items()):
            name = self.table.name_of([number])
            row = rows.get(name, {})
            up = self.metric in self.table.maximize
            best = (max if up else min)(v for _, v in pts)
            lines.append(f"  {name:<10} {row.get('state', ''):<8} step {pts[-1][0]:g}: {pts[-1][1]:.4g}  "
                         f"best {best:.4g}")
        if not series:
            lines.append(f"  no run has reported {self.metric} yet")
        return "\n".join(lines)

    def html(self) -> str:
        """The chart and the table as HTML."""
        from .dashboard import STYLE, html_page  # ipywidgets: only where a view shows HTML

        chart = render_charts({self.metric: self.table.series(self.metric)}, self.uid, self.table.name_of)
        return html_page(chart + self.table.html(), False, STYLE)

    def _changed(self) -> None:
        """A table listener (any thread): redraw now, or schedule one redraw at the end of the interval."""
        with self._lock:
            if self.widget is None:
                return
            wait = REDRAW_INTERVAL - (time.monotonic() - self._last)
            if wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._redraw)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._last = time.monotonic()
        self._redraw(timer=False)

    def _redraw(self, timer: bool = True) -> None:
        with self._lock:
            if timer:
                self._timer = None
                self._last = time.monotonic()
            widget = self.widget
        if widget is not None:
            widget.value = self.html()

    def close(self) -> None:
        """Stop the updates and close the widget."""
        self.table.remove_listener(self._changed)
        with self._lock:
            widget, self.widget = self.widget, None
            if self._timer is not None:
                self._timer.cancel()
        if widget is not None:
            widget.close()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict:
        if self.widget is not None:
            return {"text/plain": self.text(),
                    "application/vnd.jupyter.widget-view+json": {"version_major": 2, "version_minor": 0,
                                                                 "model_id": self.widget.model_id}}
        return {"text/plain": self.text()}

    def __repr__(self) -> str:
        return self.text()
