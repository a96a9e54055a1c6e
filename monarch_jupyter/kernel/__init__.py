"""The controller: the Mesh façade and its parts (docs/architecture.md has the module map)."""

from __future__ import annotations

from ..ranks import RankMap, format_ranks, parse_ranks
from . import registry
from .cells import CellHandle
from .mesh import Mesh
from .state import RankState

__all__ = ["Mesh", "CellHandle", "RankState", "RankMap", "current_mesh", "parse_ranks", "format_ranks"]


def current_mesh() -> Mesh:
    """The mesh started last in this process (by ``%mesh start`` or ``Mesh(...)``).

    Raises
    ------
    MeshNotRunningError
        No mesh was started, or the last one was stopped.
    """
    mesh: Mesh = registry.current()
    return mesh
