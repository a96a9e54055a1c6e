"""``MagicsHost``: what the subcommand modules of ``%mesh`` (transfer.py, debug.py, scripts.py, complete.py) use of
the magics object that calls them (``MeshMagics``), as a Protocol: they need no import of the package that imports
them."""

from __future__ import annotations

from typing import Any, Protocol

from ..kernel.mesh import Mesh
from .auto import AutoMode

__all__ = ["MagicsHost"]


class MagicsHost(Protocol):
    """The ``%mesh`` magics as their subcommands see them (``MeshMagics`` implements it)."""

    shell: Any  # IPython's InteractiveShell
    auto: AutoMode  # %mesh auto and %%local

    @property
    def user_ns(self) -> dict[str, Any]: ...

    def parse_args(self, func: Any, rest: str, sub: str | None) -> Any: ...

    def current(self, require_running: bool = True) -> Mesh: ...

    def option(self, name: str) -> Any: ...

    def setting(self, name: str) -> Any: ...
