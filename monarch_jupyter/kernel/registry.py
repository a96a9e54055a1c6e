"""The current mesh of this process: the one started (or listening) last, which ``%mesh`` magics act on.

It holds the mesh as a plain object, so that it imports nothing of the controller (kernel/__init__.py gives the
typed ``current_mesh``).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from ..errors import MeshNotRunningError

__all__ = ["current", "set_current", "clear_current", "peek_current", "on_start", "started"]

log = logging.getLogger(__name__)

_lock = threading.Lock()
_current: Any = None
_start_hooks: list[Callable[[Any], None]] = []


def current() -> Any:
    """The mesh started last in this process (by ``%mesh start`` or ``Mesh(...)``).

    Raises
    ------
    MeshNotRunningError
        No mesh was started, or the last one was stopped.
    """
    mesh = peek_current()
    if mesh is None:
        raise MeshNotRunningError("no mesh is running: start one with  %mesh start -n N  (N ranks, e.g. -n 4; "
                                  "Mesh(nproc=N) in Python)")
    return mesh


def peek_current() -> Any:
    """The current mesh, or None (no error)."""
    with _lock:
        return _current


def set_current(mesh: Any) -> None:
    global _current
    with _lock:
        _current = mesh


def clear_current(mesh: Any) -> None:
    """``mesh`` stopped: it is no longer current (another mesh that became current since stays)."""
    global _current
    with _lock:
        if _current is mesh:
            _current = None


def on_start(fn: Callable[[Any], None]) -> None:
    """Call ``fn(mesh)`` each time a mesh of this process has started (``Mesh.start``, a full restart), on the thread
    that started it, after its listeners saw the start. ``fn`` must return at once (send work with ``block=False``);
    what it raises is logged, never raised to the caller. Registering the same function again does nothing."""
    with _lock:
        if fn not in _start_hooks:
            _start_hooks.append(fn)


def started(mesh: Any) -> None:
    """``mesh`` has started: run the ``on_start`` hooks."""
    with _lock:
        hooks = list(_start_hooks)
    for fn in hooks:
        try:
            fn(mesh)
        except Exception:  # noqa: BLE001 - a head start (e.g. Lightning's warm-up) must never fail a start
            log.debug("start hook %r failed", fn, exc_info=True)
