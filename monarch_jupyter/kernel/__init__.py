"""The controller: the Mesh façade and its parts (docs/architecture.md has the module map)."""

from __future__ import annotations

from ..ranks import RankMap, format_ranks, parse_ranks
from .cells import CellHandle
from .mesh import Mesh
from .registry import current_mesh
from .state import RankState

__all__ = ["Mesh", "CellHandle", "RankState", "RankMap", "current_mesh", "parse_ranks", "format_ranks"]
