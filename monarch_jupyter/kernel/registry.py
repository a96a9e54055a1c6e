"""The current mesh of this process: the one started (or listening) last, which ``%mesh`` magics act on.

It holds the mesh as a plain object, so that it imports nothing of the controller (kernel/__init__.py gives the
typed ``current_mesh``).
"""

from __future__ import annotations

import threading
from typing import Any

from ..errors import MeshNotRunningError

__all__ = ["current", "set_current", "clear_current", "peek_current"]

_lock = threading.Lock()
_current: Any = None


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
