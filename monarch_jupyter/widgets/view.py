"""A live view follows one cell (or the whole mesh) and re-renders on a shared ticker thread.

Threads
-------
- The ticker (``monarch-live``, one per process, started on demand, gone when no view is live) wakes every
  ``TICK`` seconds and asks each live view to render if its monitor changed (or, while something runs, once a
  second for the clocks). So updates are batched: however many events arrive, a view renders at most
  ``1 / TICK`` times a second.
- The final render of a cell's view happens synchronously on the mesh's ``cell_done`` event (emitted under the
  mesh lock by whichever thread finished the cell), so it is sent before ``Mesh.run``/``CellHandle.wait`` can
  return: the final state is never behind the result, and it is part of whatever cell is executing then (saved
  widget state in nbconvert/nbval runs). A view of the whole mesh renders its final state on ``stopped``.
- Text views print inside the ``contextvars`` context captured where the view was made (the notebook cell), as
  rank output does. Widget views send comm messages, which frontends route by widget, not by cell.

Lock order: mesh lock -> view lock -> monitor lock. A view never takes the mesh lock while holding its own
(``handle.done()`` is read before taking it), and the monitor never calls into the mesh while holding its lock.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from typing import Any

from ..errors import RankDiedError, describe_returncode
from .model import FINAL_STATES, MeshMonitor, RowView, Summary, summarize

log = logging.getLogger(__name__)

__all__ = ["LiveView", "TICKER", "TICK"]

TICK = 0.25  # seconds between renders of a live view (at most 4 a second)
CLOCK_TICK = 1.0  # seconds between renders when only the clocks moved
TICKER_LINGER = 5.0  # seconds the ticker thread stays without live views before it ends


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
        idle_since = None
        while True:
            time.sleep(TICK)
            with self._lock:
                views = list(self._views)
                if not views:
                    # Linger a while: a notebook runs cells in bursts, and a thread start per cell costs.
                    idle_since = idle_since or time.monotonic()
                    if time.monotonic() - idle_since >= TICKER_LINGER:
                        self._thread = None
                        return
                    continue
                idle_since = None
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
        True: bind to the next cell submitted to the mesh on one of ``ranks`` (make the view just before
        ``Mesh.run``); the view is final when that cell is done. False: show the mesh's state until it stops.
    """

    #: Render inside the context captured at creation (text views: their lines belong to that cell).
    render_in_context = False

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
        self._listening = False

    # ------------------------------------------------------------------ following (mesh threads)

    def _on_mesh_event(self, kind: str, data: dict) -> None:
        if self.follow_cell:
            if kind == "cell_started" and self.handle is None and (
                    self.ranks is None or set(self.ranks) & set(data["ranks"])):
                # The first cell submitted after this view was made, on its ranks, is the one it shows (a cell on
                # other ranks is another thread's: e.g. a fit on another sub-mesh that starts at the same time).
                self.handle, self.cell_id, self.ranks = data.get("handle"), data["cell_id"], list(data["ranks"])
            elif kind == "cell_done" and self.handle is not None and data.get("handle") is self.handle:
                self._final_render()
        elif kind == "stopped":
            self._final_render()

    def _stop_listening(self) -> None:
        if self._listening:
            self._listening = False
            mesh = self.monitor.mesh
            if mesh is not None:
                mesh.remove_listener(self._on_mesh_event)
        if self.final and self.lingers():
            TICKER.add(self)  # its ticks go to after_final
        else:
            TICKER.remove(self)

    def _final_render(self) -> None:
        with self._lock:
            if not self.final:
                self._render(final=True)
        self._stop_listening()

    # ------------------------------------------------------------------ public

    @property
    def lock(self) -> threading.RLock:
        """The view's lock: renders happen under it (lock order: mesh lock -> this -> the monitor's)."""
        return self._lock

    def start(self) -> LiveView:
        """Start following (a cell view: the next cell submitted), render now, keep rendering until final."""
        if not self._listening and not self.final:
            self._listening = True
            self.monitor.mesh.add_listener(self._on_mesh_event)
        finished = self.finished()
        with self._lock:
            if not self.final and (finished or self.monitor.version != self._seen):
                self._render(final=finished)
        if self.final:
            self._stop_listening()
        else:
            TICKER.add(self)
        return self

    def finish(self) -> None:
        """Render now, from the thread that ran the cell: the final state when the cell is done (normally
        already rendered on ``cell_done``); otherwise (interrupted, timed out) the view keeps following it."""
        if self.follow_cell and self.handle is None:
            self.abandon()
            return
        finished = self.finished()
        with self._lock:
            if not self.final:
                self._render(final=finished)
        if self.final:
            self._stop_listening()

    @contextlib.contextmanager
    def capture(self) -> Iterator[Any]:
        """Submit the cell inside this block to have its output shown by the view instead of beside it (views that
        show output do; this one does not: the output streams as usual)."""
        yield None

    def render_again(self) -> None:
        """Render the current state once more (a final view: its final state again, e.g. after late output)."""
        with self._lock:
            self._render(final=self.final)

    def freeze(self) -> None:
        """Render once more and stop updating (the view keeps showing that state)."""
        self._final_render()

    def abandon(self) -> None:
        """The cell never started (it did not compile, bad arguments): take the view away."""
        with self._lock:
            self.final = True
            self.close()
        self._stop_listening()

    def snapshot(self) -> tuple[list[RowView], Summary]:
        cell_id = None
        if self.follow_cell:  # before its cell is submitted, a cell's ranks show as queued
            cell_id = self.cell_id if self.cell_id is not None else -1
        return self.monitor.snapshot(self.ranks, cell_id)

    # ------------------------------------------------------------------ ticker

    def tick(self) -> bool:
        """Render if something changed; False once the view is final (the ticker then drops it)."""
        if self.follow_cell and self.handle is None:
            return not self.final  # not bound yet
        finished = self.finished()  # takes the mesh lock: never under our own
        with self._lock:
            if self.final:
                return self.after_final()
            moved = self.monitor.version != self._seen
            clocks = self._active and time.monotonic() - self._last_render >= CLOCK_TICK
            if moved or clocks or finished or self.wants_render():
                self._render(final=finished)
        if finished:
            self._stop_listening()
        return not finished or (self.final and self.lingers())

    def lingers(self) -> bool:
        """After its final render: the view still has work (output that may still come, see ``after_final``), so the
        ticker keeps it (it calls ``after_final`` instead of rendering)."""
        return False

    def after_final(self) -> bool:
        """Called by the ticker on a final view (under the view lock): True to keep it ticking (after late output)."""
        return False

    def finished(self) -> bool:
        """The view has nothing more to follow: its cell is done (a cell view) or the mesh stopped."""
        if self.follow_cell:
            return self.handle is not None and self.handle.done()
        mesh = self.monitor.mesh
        return mesh is None or not mesh.running

    # ------------------------------------------------------------------ rendering (under the view lock)

    def _render(self, final: bool) -> None:
        if final and self.final_shown():
            self.final = True
            return
        self._seen = self.monitor.version
        self._last_render = time.monotonic()
        rows, summary = self.snapshot()
        self._active = any(r.state in ("running", "queued", "breakpoint") for r in rows)
        if final:
            rows, summary = self._reconcile(rows, summary)
            self.final = True
        if self.render_in_context:
            self.ctx.run(self.render, rows, summary, final)
        else:
            self.render(rows, summary, final)

    def _reconcile(self, rows: list[RowView], summary: Summary) -> tuple[list[RowView], Summary]:
        """At the end of a cell the handle is the authority: its events may still be on their way to the
        monitor (``cell_done`` comes first), and ranks the mesh gave up on (stuck after a death) show its verdict."""
        handle = self.handle
        if handle is None:
            return rows, summary
        snap = handle.snapshot()
        errors, finished, durations = snap.errors, snap.finished, snap.durations
        fixed = []
        for row in rows:
            err = errors.get(row.rank)
            if err is None and row.rank in finished and row.state not in FINAL_STATES:
                # done without error: no note of a state it left (a debugger's "stopped at a breakpoint ...")
                row = replace(row, state="done", elapsed=durations.get(row.rank, row.elapsed), error="")
            elif err is not None and row.state not in FINAL_STATES:
                if isinstance(err, RankDiedError):  # the exit event reaches the monitor just after cell_done
                    dead = err.returncode is not None
                    row = replace(row, state="dead" if dead else "stopped",
                                  error=describe_returncode(err.returncode) if dead else "the mesh was stopped")
                else:
                    name = getattr(err, "ename", "") or type(err).__name__
                    evalue = getattr(err, "evalue", None)
                    if evalue is None:  # not a rank's exception: its own message
                        evalue = str(err)
                    stopped = all(getattr(e, "interrupted", False) for e in errors.values())  # Waiter.outcome's test
                    row = replace(row, state="interrupted" if stopped else "error",
                                  error=f"{name}: {evalue}" if evalue else name)
            fixed.append(row)
        return fixed, summarize(fixed, summary.world_size, True)

    # ------------------------------------------------------------------ for subclasses

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        """Show ``rows`` (called under the view's lock)."""
        raise NotImplementedError

    def final_shown(self) -> bool:
        """True when what the view shows already is its final state (checked before the final render, which it
        then skips: the common quick cell costs no snapshot)."""
        return False

    def wants_render(self) -> bool:
        """True when the view must render at the next tick although nothing changed (a deferred widget)."""
        return False

    def close(self) -> None:
        """Release what the view holds (widgets)."""
