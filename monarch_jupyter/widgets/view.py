"""A live view follows one cell (or the whole mesh) and re-renders on a shared ticker thread.

Threads
-------
- The ticker (``monarch-live``, one per process, started on demand, gone when no view is live) wakes every
  ``TICK`` seconds and asks each live view to render if its monitor changed (or, while something runs, once a
  second for the clocks). So updates are batched: however many events arrive, a view renders at most
  ``1 / TICK`` times a second.
- Renders run inside the ``contextvars`` context captured where the view was made (the notebook cell), so what
  they send (widget state, text) belongs to that cell, as rank output does.
- ``finish()`` renders the final state from the caller's thread before a blocking cell returns, so the final
  state is part of the cell (saved widget state in nbconvert/nbval runs) and never lags behind the result.

A view renders under its own lock; it takes the monitor's lock only briefly to snapshot, and never the mesh's.
"""

from __future__ import annotations

import contextvars
import logging
import threading
import time
from typing import Any

from .model import MeshMonitor, RowView, Summary

log = logging.getLogger(__name__)

__all__ = ["LiveView", "TICK"]

TICK = 0.25  # seconds between renders of a live view (at most 4 a second)
CLOCK_TICK = 1.0  # seconds between renders when only the clocks moved


class _Ticker:
    """One background thread that drives every live view."""

    def __init__(self) -> None:
        self._views: list[LiveView] = []
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def add(self, view: LiveView) -> None:
        with self._lock:
            if view not in self._views:
                self._views.append(view)
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="monarch-live", daemon=True)
                self._thread.start()

    def remove(self, view: LiveView) -> None:
        with self._lock:
            if view in self._views:
                self._views.remove(view)

    def live_views(self) -> list[LiveView]:
        with self._lock:
            return list(self._views)

    def _run(self) -> None:
        while True:
            time.sleep(TICK)
            with self._lock:
                views = list(self._views)
                if not views:
                    self._thread = None
                    return
            for view in views:
                try:
                    keep = view.tick()
                except Exception:  # noqa: BLE001 - one broken view must not stop the others
                    log.exception("live view failed to render; it stops updating")
                    keep = False
                if not keep:
                    self.remove(view)


TICKER = _Ticker()


class LiveView:
    """Base of the widget and text views: follow a cell or the mesh, render snapshots of the monitor.

    Parameters
    ----------
    monitor:
        The mesh's monitor (``monitor_for(mesh)``).
    ranks:
        Ranks shown (default: all; a followed cell's own ranks replace them).
    follow_cell:
        True: bind to the next cell submitted to the mesh (call before ``Mesh.run``); the view is final when
        that cell is done. False: show the mesh's state until it stops.
    """

    def __init__(self, monitor: MeshMonitor, ranks: list[int] | None = None, *, follow_cell: bool = False) -> None:
        self.monitor = monitor
        self.ranks = ranks
        self.follow_cell = follow_cell
        self.cell_id: int | None = None
        self.handle: Any = None
        self.final = False
        self.ctx = contextvars.copy_context()
        self._lock = threading.RLock()
        self._seen = -1
        self._last_render = 0.0
        self._active = False  # some shown rank was running at the last render (its clock moves)
        if follow_cell:
            monitor.mesh.add_listener(self._bind)

    # ------------------------------------------------------------------ following

    def _bind(self, kind: str, data: dict) -> None:
        """Mesh listener: the first cell submitted after this view was made is the one it shows."""
        if kind != "cell_started" or self.handle is not None:
            return
        self.handle, self.cell_id, self.ranks = data.get("handle"), data["cell_id"], list(data["ranks"])
        self.monitor.mesh.remove_listener(self._bind)

    def start(self) -> LiveView:
        """Render now and keep rendering on the ticker until final."""
        self.render_now()
        if not self.final:
            TICKER.add(self)
        return self

    def _finished(self) -> bool:
        if self.follow_cell:
            return self.handle is not None and self.handle.done()
        mesh = self.monitor.mesh
        return mesh is None or not mesh.running

    # ------------------------------------------------------------------ rendering

    def snapshot(self) -> tuple[list[RowView], Summary]:
        cell_id = None
        if self.follow_cell:  # before its cell is submitted, a cell's ranks show as queued
            cell_id = self.cell_id if self.cell_id is not None else -1
        return self.monitor.snapshot(self.ranks, cell_id)

    def tick(self) -> bool:
        """Render if something changed; False once the view is final (the ticker then drops it)."""
        with self._lock:
            if self.final:
                return False
            if self.follow_cell and self.handle is None:
                return True  # not bound yet
            finished = self._finished()
            now = time.monotonic()
            moved = self.monitor.version != self._seen
            clocks = self._active and now - self._last_render >= CLOCK_TICK
            if moved or clocks or finished:
                self._render(final=finished)
            return not finished

    def render_now(self) -> None:
        with self._lock:
            if not self.final:
                bound = self.handle is not None or not self.follow_cell
                self._render(final=bound and self._finished())

    def finish(self) -> None:
        """Render now, from the thread that ran the cell: the final state when the cell is done (the view then
        stops following); otherwise (interrupted, timed out) the ticker keeps following it until it is done."""
        with self._lock:
            if self.follow_cell and self.handle is None:
                self.abandon()
                return
            if self.final:
                return
            done = self._finished()
            self._render(final=done)
        if done:
            TICKER.remove(self)

    def freeze(self) -> None:
        """Render once more and stop updating (the view keeps showing that state)."""
        with self._lock:
            if not self.final:
                self._render(final=True)
        TICKER.remove(self)

    def abandon(self) -> None:
        """The cell never started (it did not compile, bad arguments): take the view away."""
        with self._lock:
            self.final = True
            if self.follow_cell and self.handle is None:
                self.monitor.mesh.remove_listener(self._bind)
            self.close()
        TICKER.remove(self)

    def _render(self, final: bool) -> None:
        self._seen = self.monitor.version
        self._last_render = time.monotonic()
        rows, summary = self.snapshot()
        self._active = any(r.state in ("running", "queued", "breakpoint") for r in rows)
        if final:
            rows, summary = self._reconcile(rows, summary)
            self.final = True
        self.ctx.run(self.render, rows, summary, final)

    def _reconcile(self, rows: list[RowView], summary: Summary) -> tuple[list[RowView], Summary]:
        """At the end of a cell, ranks the mesh gave up on (timeout, stuck after a death) show its verdict."""
        handle = self.handle
        if handle is None or not getattr(handle, "errors", None):
            return rows, summary
        from dataclasses import replace

        from .model import FINAL_STATES, _summarize

        fixed = []
        for row in rows:
            err = handle.errors.get(row.rank)
            if err is not None and row.state not in FINAL_STATES:
                name = getattr(err, "ename", "") or type(err).__name__
                evalue = getattr(err, "evalue", "") or str(err)
                row = replace(row, state="error", error=f"{name}: {evalue}")
            fixed.append(row)
        return fixed, _summarize(fixed, summary.world_size, True)

    # ------------------------------------------------------------------ for subclasses

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        """Show ``rows`` (called under the view's lock, inside the cell's context)."""
        raise NotImplementedError

    def close(self) -> None:
        """Release what the view holds (widgets)."""
