"""Mesh events for listeners (the live views), delivered from one thread, outside the mesh lock.

Any part of the controller calls ``EventBus.emit(kind, **data)``, from any thread and with or without the mesh
lock held: the event is queued in order. One thread, ``monarch-events``, calls every listener for every event, in
the order they were emitted; it never holds the mesh lock while it does, so a listener may call back into the mesh
(``mesh.status()``, ``handle.done()``). With no listener, ``emit`` does nothing and no thread runs. "output" events
(``LAZY``) wait for the thread's next batch, at most ``EVENT_BATCH`` seconds: a flood of lines wakes it once per
batch, not once per read of a rank's pipe; every other event wakes it at once.

``flush`` lets the thread that waited for a cell make sure the listeners saw the cell end (``cell_done``) before it
returns the cell's result: the final state of a cell's view is never behind its result. It must be called without
the mesh lock held.

Events and their data: ``started`` (ready_seconds), ``stopped``, ``cell_started`` (cell_id, ranks, handle),
``cell_done`` (cell_id, handle; of a cell nobody waits for, emitted once the lines queued for it are written:
output.OutputWriter.then), ``rank_result`` (rank, cell_id, status, error, duration, ename, evalue), ``rank_state``
(rank, state: idle/dead/stopped, or breakpoint/running from the debugger; returncode, host, device, pid where
known), ``rank_joined`` (host, pid, rank, joined, world_size), ``rank_died`` (rank, returncode, reason),
``regrouped`` (fresh), ``output`` (rank, stream, cell_id, lines: the lines, without newlines, that came together,
in order; text: the same joined by newlines), ``progress`` (rank, cell_id, n, total, desc, postfix; metrics:
name -> float, the numbers among the report's metrics), ``heartbeat`` (rank, rss, cuda_allocated,
cuda_reserved; bytes), ``display`` (rank, cell_id, display_kind: display/update/clear, display_id, data: the MIME
bundle as published, metadata; kernel/rich.py).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["EventBus", "Listener", "EVENT_BATCH", "LAZY"]

Listener = Callable[[str, dict], None]


EVENT_BATCH = 0.05
"""Seconds the events thread waits, after delivering a batch, before it delivers the next one when only "output"
events came meanwhile (a flood of lines: one wake of that thread per batch, not per read of a rank's pipe). Any
other event, and ``flush``, is delivered at once."""

LAZY = frozenset({"output"})
"""Kinds of event that wait for the next batch (``EVENT_BATCH``) rather than wake the events thread."""


class EventBus:
    """Queue of mesh events and the thread that delivers them (see the module docstring)."""

    def __init__(self) -> None:
        self._listeners: list[Listener] = []
        self._queue: deque[tuple[str, dict]] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._emitted = 0  # events queued so far
        self._delivered = 0  # events every listener has seen
        self._due = 0.0  # time.monotonic() before which lazy events wait for the thread's next batch
        self._urgent = False  # an event that must not wait (or a flush) is queued

    def add(self, fn: Listener) -> None:
        """Call ``fn(kind, data)`` on every event from now on (on the events thread; it must not block)."""
        with self._cond:
            if fn not in self._listeners:
                self._listeners.append(fn)

    def remove(self, fn: Listener) -> None:
        with self._cond:
            if fn in self._listeners:
                self._listeners.remove(fn)

    @property
    def listening(self) -> bool:
        """Someone listens (an emit would be delivered): callers skip building events nobody reads."""
        return bool(self._listeners)

    def emit(self, kind: str, **data: Any) -> None:
        """Queue an event (any thread, any lock held)."""
        if self._listeners:
            self.emit_all([(kind, data)])

    def emit_all(self, events: list[tuple[str, dict]]) -> None:
        """Queue several events (kind, data), in order, at the cost of one (a rank's burst of output lines). Events
        of the kinds in ``LAZY`` are delivered with the next batch, at most ``EVENT_BATCH`` seconds later."""
        if not self._listeners or not events:
            return
        urgent = any(kind not in LAZY for kind, _ in events)
        with self._cond:
            idle = not self._queue  # the events thread waits only while the queue is empty: wake it only then
            self._queue.extend(events)
            self._emitted += len(events)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="monarch-events", daemon=True)
                self._thread.start()
            if urgent and not self._urgent:
                self._urgent = True
                self._cond.notify_all()
            elif idle and time.monotonic() >= self._due:  # else the thread comes for them at _due
                self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` seconds until every event emitted so far has reached every listener; True when
        it has. Call it without the mesh lock (listeners may take it). A no-op on the events thread itself."""
        with self._cond:
            if threading.current_thread() is self._thread:
                return True
            target = self._emitted
            if self._delivered < target and not self._urgent:
                self._urgent = True  # what waits for the next batch goes now
                self._cond.notify_all()
            return self._cond.wait_for(lambda: self._delivered >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                while True:
                    if self._queue and (self._urgent or time.monotonic() >= self._due):
                        break
                    if not self._queue and not self._listeners:
                        self._thread = None  # a later emit starts a new one
                        return
                    # Until _due, lazy events come without a wake (this wait ends then); after it, they wake it.
                    left = self._due - time.monotonic()
                    self._cond.wait(left if left > 0 else 1.0)
                batch = list(self._queue)
                self._queue.clear()
                self._urgent = False
                listeners = list(self._listeners)
            for kind, data in batch:
                for fn in listeners:
                    try:
                        fn(kind, data)
                    except Exception:  # noqa: BLE001 - a broken listener must not break the mesh
                        log.exception("mesh listener failed on %s", kind)
            with self._cond:
                self._delivered += len(batch)
                self._due = time.monotonic() + EVENT_BATCH
                self._cond.notify_all()
