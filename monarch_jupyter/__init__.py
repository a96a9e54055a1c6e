"""monarch_jupyter: the notebook kernel as single controller of a mesh of persistent PyTorch ranks.

In a notebook::

    %load_ext monarch
    m = %mesh start -n 4
    %%mesh
    t = torch.ones(3) * rank
    dist.all_reduce(t)
    t.sum().item()

From a script, the same through the Python API that the magics call::

    from monarch_jupyter import Mesh
    with Mesh(nproc=4) as mesh:
        print(mesh.run("rank * 2"))

Nothing happens at import time; ``load_ipython_extension`` registers the magics.
"""

from __future__ import annotations

from typing import Any

from .errors import (
    MeshError,
    MeshNotRunningError,
    MeshStartError,
    MeshTimeoutError,
    MonarchError,
    RankBusyError,
    RankDiedError,
    RemoteError,
)
from .kernel import CellHandle, Mesh, RankState, current_mesh
from .kernel.sweep import sweep
from .ranks import RankMap

__version__ = "0.1.0"

__all__ = [
    "Mesh",
    "CellHandle",
    "RankMap",
    "RankState",
    "current_mesh",
    "sweep",
    "MonarchError",
    "MeshError",
    "MeshStartError",
    "MeshNotRunningError",
    "MeshTimeoutError",
    "RankDiedError",
    "RankBusyError",
    "RemoteError",
    "load_ipython_extension",
    "unload_ipython_extension",
]


def load_ipython_extension(ipython: Any) -> None:
    """Register ``%mesh`` / ``%%mesh`` (called by ``%load_ext monarch_jupyter`` or ``%load_ext monarch``)."""
    from .magics import load

    load(ipython)
    from .lightning import register  # strategy "mesh" for Lightning: now if imported, else when it is (cheap)

    register()


def unload_ipython_extension(ipython: Any) -> None:
    """Stop the meshes the magics started and remove the magics."""
    from .magics import unload

    unload(ipython)
