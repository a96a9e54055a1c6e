"""The current mesh of this process: the one started (or listening) last, which ``%mesh`` magics act on."""

from __future__ import annotations

import threading
from typing import TYPE_CHECKING

from ..errors import MeshNotRunningError

if TYPE_CHECKING:
    from .mesh import Mesh

__all__ = ["current_mesh", "set_current", "clear_current", "peek_current"]

_lock = threading.Lock()
_current: Mesh | None = None


def current_mesh() -> Mesh:
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


def peek_current() -> Mesh | None:
    """The current mesh, or None (no error)."""
    with _lock:
        return _current


def set_current(mesh: Mesh | None) -> None:
    global _current
    with _lock:
        _current = mesh


def clear_current(mesh: Mesh) -> None:
    """``mesh`` stopped: it is no longer current (another mesh that became current since stays)."""
    global _current
    with _lock:
        if _current is mesh:
            _current = None
