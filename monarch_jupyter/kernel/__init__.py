"""Controller side: the Mesh, launchers, output routing."""

from __future__ import annotations

from .mesh import CellHandle, Mesh, RankState, current_mesh
from .ranks import RankMap, format_ranks, parse_ranks

__all__ = ["Mesh", "CellHandle", "RankState", "RankMap", "current_mesh", "parse_ranks", "format_ranks"]
