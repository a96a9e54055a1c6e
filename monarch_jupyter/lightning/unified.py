"""``strategy="mesh"`` for the ``lightning`` package (``lightning.pytorch``, ``lightning.fabric``).

The classes are built on first access (importing this module imports nothing of Lightning), so that pickle finds
them here by name on the ranks: ``MeshStrategy``, ``MeshLauncher``, ``MeshFabricStrategy``,
``MeshFabricLauncher``, ``MeshEnvironment``.
"""

from __future__ import annotations

from typing import Any

from ._namespace import resolve

FAMILY = "lightning"


def __getattr__(name: str) -> Any:
    return resolve(__name__, FAMILY, globals(), name)
