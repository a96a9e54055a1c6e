"""Where a job of ``strategy="mesh"`` runs: a whole mesh, or one sub-mesh of a split mesh (docs/submeshes.md).

The strategy's ``mesh`` decides: a ``Mesh``, a ``SubMesh`` (``MeshStrategy(mesh=sub)``), or None. None takes the
sub-mesh of the ``with sub:`` block the Trainer (or Fabric) is built in, and keeps it (``strategy.mesh`` is set), so
that ``fit`` runs there from any thread; outside such a block, the current mesh (``current_mesh()``), looked up
again at each launch. A split mesh has no world of its own: a job on it without a sub-mesh is refused.

Inside a sub-mesh ranks are numbered 0..k-1 (its RANK and WORLD_SIZE): ``hosts``, ``status`` and the results of
``local`` use those numbers, as Lightning does; ``ranks`` holds the mesh's numbers, which calls and interrupts on
the mesh take (and errors show).
"""

from __future__ import annotations

from typing import Any

from ..errors import MeshNotRunningError
from ..kernel import Mesh, RankMap, current_mesh
from ..kernel.submesh import SubMesh, selected
from ..ranks import format_ranks
from .errors import MeshLightningError

__all__ = ["Target", "resolve"]


class Target:
    """One mesh, or one sub-mesh of it (``sub``), as a job of ``strategy="mesh"`` sees it."""

    def __init__(self, mesh: Mesh, sub: SubMesh | None = None) -> None:
        self.mesh, self.sub = mesh, sub

    @property
    def ranks(self) -> list[int]:
        """The mesh's numbers of the ranks the job runs on."""
        return list(self.sub.ranks) if self.sub is not None else list(range(self.mesh.world_size))

    @property
    def call_ranks(self) -> list[int] | None:
        """``ranks=`` for ``Mesh.call`` and ``Mesh.push``: None (every rank) for a whole mesh."""
        return list(self.sub.ranks) if self.sub is not None else None

    @property
    def world_size(self) -> int:
        return self.sub.nproc if self.sub is not None else int(self.mesh.world_size)

    @property
    def first(self) -> int:
        """The mesh's number of the job's rank 0."""
        return self.sub.ranks[0] if self.sub is not None else 0

    @property
    def label(self) -> str:
        """"the mesh", or "sub-mesh 'NAME'" (in messages)."""
        return f"sub-mesh {self.sub.name!r}" if self.sub is not None else "the mesh"

    def hosts(self) -> dict[str, list[int]]:
        """host -> the job's ranks there, in the job's numbers ({} while the mesh is not running)."""
        if not self.mesh.running:
            return {}
        out: dict[str, list[int]] = {}
        for host, rs in self.mesh.hosts().items():
            mine = [self._local(r) for r in rs if r in self.ranks]
            if mine:
                out[host] = sorted(mine)
        return out

    def status(self) -> dict[int, dict[str, Any]]:
        """The job's ranks (its numbers) -> ``Mesh.status()`` of each."""
        every = self.mesh.status()
        return {self._local(r): s for r, s in every.items() if r in self.ranks}

    def local(self, result: RankMap | None) -> RankMap:
        """A call's results (keyed by the mesh's ranks) keyed by the job's ranks."""
        values = dict(result or {})
        if self.sub is None:
            return RankMap(sorted(values.items()))
        return RankMap(sorted((self.sub.ranks.index(r), v) for r, v in values.items()))

    def _local(self, r: int) -> int:
        return self.sub.ranks.index(r) if self.sub is not None else r

    def where(self) -> str:
        """" (mesh ranks 2,3)" for a sub-mesh, "" for a whole mesh."""
        return f" (mesh ranks {format_ranks(self.sub.ranks)})" if self.sub is not None else ""


def resolve(strategy: Any) -> Target:
    """The mesh or sub-mesh ``strategy`` runs on (see the module docstring).

    Raises
    ------
    MeshNotRunningError
        No mesh runs, or the chosen one is stopped.
    MonarchError
        The chosen sub-mesh no longer exists (merged, or the mesh restarted).
    MeshLightningError
        The mesh is split and no sub-mesh was chosen.
    """
    chosen = strategy.mesh
    if chosen is None:
        chosen = selected()
        if chosen is not None:
            strategy.mesh = chosen  # built inside `with sub:`: it runs there, wherever fit is called from
    if chosen is None:
        try:
            chosen = current_mesh()
        except MeshNotRunningError:
            raise MeshNotRunningError(
                "strategy='mesh' runs on a mesh, and none is running: start one first with  %mesh start -n N  "
                "(or monarch_jupyter.Mesh(nproc=N)), N = devices x num_nodes, or pass  MeshStrategy(mesh=...)"
            ) from None
    if isinstance(chosen, SubMesh):
        mesh, sub = chosen.mesh, chosen
    else:
        mesh, sub = chosen, None
    if not mesh.running and not mesh.listening:
        raise MeshNotRunningError("the mesh of strategy='mesh' is stopped: start it with  %mesh restart  (or "
                                  "mesh.restart())")
    if sub is not None:
        sub.check()
    else:
        subs = dict(getattr(mesh, "subs", None) or {})
        if subs:
            names = ", ".join(subs)
            first = next(iter(subs))
            raise MeshLightningError(
                f"the mesh is split into sub-meshes ({names}): strategy='mesh' runs on one of them. Pass it, "
                f"Trainer(strategy=MeshStrategy(mesh={first})), or build the Trainer inside  with {first}:  ; or "
                "merge the mesh first ( %mesh merge ) to train on every rank")
    return Target(mesh, sub)
