"""Building the classes of one Lightning family into its module (``unified`` or ``standalone``), on demand."""

from __future__ import annotations

import threading
from typing import Any

__all__ = ["resolve", "TRAINER_NAMES", "FABRIC_NAMES"]

TRAINER_NAMES = ("MeshStrategy", "MeshLauncher")
FABRIC_NAMES = ("MeshFabricStrategy", "MeshFabricLauncher")

_lock = threading.RLock()


def resolve(module: str, family: str, namespace: dict, name: str) -> Any:
    """The class ``name`` of ``family``, built (with its siblings) into ``namespace`` on first use.

    Raises AttributeError for names that are not ours (as a module's ``__getattr__`` must)."""
    from . import strategies

    if name not in ("MeshEnvironment", *TRAINER_NAMES, *FABRIC_NAMES):
        raise AttributeError(f"module {module!r} has no attribute {name!r}")
    with _lock:
        if name in namespace:
            return namespace[name]
        if "MeshEnvironment" not in namespace:
            _publish(module, namespace, strategies.build_environment(family))
        env = namespace["MeshEnvironment"]
        if name in TRAINER_NAMES:
            _publish(module, namespace, strategies.build_trainer(family, env))
        elif name in FABRIC_NAMES:
            _publish(module, namespace, strategies.build_fabric(family, env))
        return namespace[name]


def _publish(module: str, namespace: dict, classes: dict[str, type]) -> None:
    for attr, cls in classes.items():
        cls.__module__ = module
        cls.__qualname__ = attr
        namespace[attr] = cls
