"""Sub-meshes: ``Splitter.split`` (``mesh.split(k)``, ``%mesh split``) and ``Splitter.merge`` (``%mesh merge``).

A split is one regroup (resize.Resizer.regroup_to, hence recovery.Restarts.regroup: the mechanism ``%mesh scale``,
``%mesh restart --rank`` and self-healing use) with the mesh's ranks partitioned (``MeshState.partition``): every
rank keeps its process and namespace and joins a fresh default process group made of its sub-mesh's ranks only,
whose first rank hosts the group's TCPStore. Inside a sub-mesh ranks are numbered 0..k-1: torch.distributed's rank
and world size, RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (ROLE_*) and ``rank``/``world_size``/``local_rank``
in the namespace (monarch_worker.recovery.regroup, elastic_env.resized); LOCAL_RANK and LOCAL_WORLD_SIZE count
the sub-mesh's ranks on the rank's host (ranks on several hosts, behind host agents or joined, split the same way;
a sub-mesh may span hosts). ``merge`` regroups every rank into one group of the whole mesh again, numbered as
before the split.

``with sub:`` selects a sub-mesh, in the calling thread only (a ContextVar: ``selected``), for ``strategy="mesh"``:
a Lightning Trainer or Fabric built inside the block trains there (lightning/target.py); nesting another
sub-mesh's block is refused; the block never merges.

Each ``SubMesh`` runs cells on its own ranks (``run``, ``call``, ``%%mesh --mesh NAME``): a cell on one sub-mesh
runs while a cell on another does (``block=False``, ``--async``), since their collectives use different groups.
The dispatcher refuses code while a rank is stuck in an abandoned cell only within that rank's process group
(dispatch.py), so a stuck sub-mesh never blocks another. Results are keyed by the sub-mesh's rank numbers; errors
(MeshError) name ranks by the mesh's numbers, as ``%mesh status``, ``%mesh restart --rank`` and stacks do.

What is refused (ValueError for the shape of the split, MonarchError for the mesh's state; the mesh unchanged):
groups that do not cover the ranks, overlap, are empty, or name a rank outside the mesh; a split of a split mesh;
a cell running on any rank, a dead rank, a rank being restarted, a scale running; nccl (a sub-mesh's LOCAL_RANK
would name another rank's GPU). With ``on_rank_death="restart"`` a rank that dies is replaced inside its sub-mesh
(healing.py): only that sub-mesh regroups, the split stays. ``merge`` is refused while a sub-mesh runs a cell or
a rank is dead. A sub-mesh used after a merge (or after a restart, which ends the split) raises MonarchError.
``%mesh restart --rank R`` on a split mesh ends the split: the whole mesh regroups with the fresh ranks, and the
restart prints a line that says so (hints.split_ended_note).
"""

from __future__ import annotations

import contextvars
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from ..errors import MonarchError
from ..ranks import RankMap, format_ranks, n_ranks, parse_ranks, plural, ranks_text
from .cells import CellHandle
from .lifecycle import Lifecycle
from .resize import Resizer
from .state import MeshState, RankState

__all__ = ["Splitter", "SubMesh", "SubHandle", "partition", "selected"]

_SELECTED: contextvars.ContextVar[tuple[SubMesh, ...]] = contextvars.ContextVar("monarch_submesh", default=())
"""The sub-meshes of the ``with sub:`` blocks this thread (context) is in, innermost last."""


def selected() -> SubMesh | None:
    """The sub-mesh of the innermost ``with sub:`` block of the calling thread (None outside one). A thread
    started inside a block is outside it (Python starts threads in a fresh context); asyncio tasks inherit it."""
    stack = _SELECTED.get()
    return stack[-1] if stack else None


def partition(spec: int | Sequence[Sequence[int]], nproc: int) -> list[list[int]]:
    """The groups of global ranks that ``spec`` asks for: ``k`` (k equal groups of consecutive ranks) or a list
    of rank lists that together hold every rank of ``0..nproc-1`` exactly once.

    Raises ValueError naming what is wrong (uneven split, missing, repeated or unknown ranks) and how to fix it.
    """
    if isinstance(spec, bool):
        raise ValueError(f"split takes a number of sub-meshes or a list of rank lists, got {spec!r}")
    if isinstance(spec, int):
        if spec < 2 or spec > nproc or nproc % spec:
            if nproc < 2:
                raise ValueError(f"a mesh of {nproc} rank does not split: start one of 2 or more ranks")
            half = [list(range(nproc // 2)), list(range(nproc // 2, nproc))]  # an example that fits this mesh
            raise ValueError(f"{nproc} ranks do not split into {spec} equal sub-meshes (2 or more, dividing "
                             f"{nproc}); give the groups instead, e.g.  m.split({half})  or  "
                             f"%mesh split {' '.join(format_ranks(g) for g in half)}")
        size = nproc // spec
        return [list(range(i * size, (i + 1) * size)) for i in range(spec)]
    try:
        groups = [[int(r) for r in g] for g in spec]
    except (TypeError, ValueError):
        raise ValueError(f"split takes a number of sub-meshes or a list of rank lists, e.g. [[0, 1], [2, 3]]; got "
                         f"{spec!r}") from None
    if len(groups) < 2 or any(not g for g in groups):
        raise ValueError(f"a split needs 2 or more non-empty groups of ranks, got {groups!r}")
    seen: list[int] = [r for g in groups for r in g]
    unknown = sorted({r for r in seen if not 0 <= r < nproc})
    repeated = sorted({r for r in seen if seen.count(r) > 1})
    missing = sorted(set(range(nproc)) - set(seen))
    problems = []
    if unknown:
        problems.append(f"{ranks_text(unknown)} {'are' if len(unknown) > 1 else 'is'} not in the mesh "
                        f"(ranks 0-{nproc - 1})")
    if repeated:
        problems.append(f"{ranks_text(repeated)} {'are' if len(repeated) > 1 else 'is'} in more than one group")
    if missing:
        problems.append(f"{ranks_text(missing)} {'are' if len(missing) > 1 else 'is'} in no group")
    if problems:
        raise ValueError(f"the groups {groups!r} do not split the mesh: {'; '.join(problems)}. Every rank goes "
                         "into exactly one sub-mesh (e.g. [[0, 1], [2, 3]] for 4 ranks).")
    return [sorted(g) for g in groups]


BACKGROUND_WAIT = 120.0
"""Seconds a split or merge waits for the package's own background work on the ranks (Lightning's warm-up import)
before it refuses as for any running cell."""

class SubHandle:
    """A cell submitted to a sub-mesh (``SubMesh.run(..., block=False)``, ``%%mesh --mesh NAME --async``): the
    mesh's CellHandle (``handle``), whose ``result()`` is keyed by the sub-mesh's ranks."""

    __slots__ = ("handle", "sub")

    def __init__(self, handle: CellHandle, sub: SubMesh) -> None:
        self.handle, self.sub = handle, sub

    @property
    def cell_id(self) -> int:
        return self.handle.cell_id

    @property
    def ranks(self) -> list[int]:
        """The sub-mesh's ranks the cell runs on (its numbers)."""
        return [self.sub.ranks.index(r) for r in self.handle.ranks]

    def done(self) -> bool:
        return self.handle.done()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: no limit); True when the cell ended."""
        return self.handle.wait(timeout)

    def result(self, timeout: float | None = None) -> RankMap | None:
        """The cell's results, sub-mesh rank -> value; raises as CellHandle.result (MeshError, MeshTimeoutError)."""
        return self.sub.local(self.handle.result(timeout))

    def __repr__(self) -> str:
        return f"<SubHandle of {self.sub.name}: {self.handle!r}>"


class SubMesh:
    """Some ranks of a mesh with their own default process group (see the module docstring): ``name``,
    ``ranks`` (the mesh's numbers of its ranks 0..k-1), ``nproc``, and ``run``, ``call``, ``interrupt``."""

    def __init__(self, name: str, ranks: list[int], mesh: Any, splitter: Splitter, token: object) -> None:
        self.name, self.ranks, self.mesh = name, list(ranks), mesh
        self._splitter, self._token = splitter, token

    @property
    def nproc(self) -> int:
        """Its number of ranks (its world size)."""
        return len(self.ranks)

    @property
    def alive(self) -> bool:
        """False once merged back (``mesh.merge()``) or ended by a restart."""
        return self._splitter.token is self._token and self.mesh.state.partition is not None

    def check(self) -> None:
        """Raise MonarchError when this sub-mesh no longer exists (merged, or the mesh restarted)."""
        if not self.alive:
            raise MonarchError(f"sub-mesh {self.name!r} no longer exists: the mesh was merged back (or restarted) "
                               "since; run code on the mesh itself, or split it again with  m.split(...)  "
                               "(%mesh split)")

    def to_global(self, ranks: str | int | Iterable[int] | None) -> list[int]:
        """The mesh's numbers of the sub-mesh's ``ranks`` (a selection as ``Mesh.run`` takes, in its numbers).
        Raises ValueError for a rank outside 0..nproc-1."""
        return [self.ranks[r] for r in parse_ranks(ranks, self.nproc)]

    def local(self, result: RankMap | None) -> RankMap | None:
        """``result`` keyed by the mesh's ranks, keyed by this sub-mesh's."""
        if result is None:
            return None
        return RankMap({self.ranks.index(r): v for r, v in result.items()})

    def run(self, code: str, ranks: str | int | Iterable[int] | None = None, **kwargs: Any) -> Any:
        """``Mesh.run`` on this sub-mesh's ``ranks`` (its numbers; default all): RankMap keyed by them, None, or a
        SubHandle (``block=False``). Raises as ``Mesh.run``, MonarchError once merged, ValueError for a bad rank."""
        self.check()
        out = self.mesh.run(code, self.to_global(ranks), **kwargs)
        return SubHandle(out, self) if isinstance(out, CellHandle) else self.local(out)

    def call(self, fn: Callable[..., Any], *args: Any, ranks: str | int | Iterable[int] | None = None,
             **kwargs: Any) -> Any:
        """``Mesh.call`` on this sub-mesh's ``ranks`` (its numbers): results keyed by them."""
        self.check()
        out = self.mesh.call(fn, *args, ranks=self.to_global(ranks), **kwargs)
        return SubHandle(out, self) if isinstance(out, CellHandle) else self.local(out)

    def interrupt(self, ranks: str | int | Iterable[int] | None = None, *, force: bool = False,
                  grace: float | None = None) -> Any:
        """``Mesh.interrupt`` of what this sub-mesh's ``ranks`` run (its numbers; default all)."""
        self.check()
        return self.mesh.interrupt(self.to_global(ranks), force=force, grace=grace)

    def __enter__(self) -> SubMesh:
        """``with sub:`` selects this sub-mesh, in the calling thread only, for ``strategy="mesh"``: a Trainer or
        Fabric built inside the block runs there (``monarch_jupyter.lightning``). It does not merge at the end.

        Raises MonarchError when the sub-mesh no longer exists, or when the thread is inside ``with other:`` of
        another sub-mesh (a block selects one; the same sub-mesh again is fine)."""
        self.check()
        stack = _SELECTED.get()
        if stack and stack[-1] is not self:
            outer = stack[-1].name
            raise MonarchError(f"already inside  with {outer}:  in this thread: a with block selects one sub-mesh "
                               f"for strategy='mesh'. Leave it first, or pass the sub-mesh itself:  "
                               f"Trainer(strategy=MeshStrategy(mesh={self.name}))")
        _SELECTED.set((*stack, self))
        return self

    def __exit__(self, *exc: object) -> None:
        stack = _SELECTED.get()
        if stack and stack[-1] is self:
            _SELECTED.set(stack[:-1])

    def __repr__(self) -> str:
        where = f"mesh ranks {format_ranks(self.ranks)}" if self.alive else "merged"
        return f"<SubMesh {self.name}: {n_ranks(self.nproc)}, {where}>"


class Splitter:
    """Splits one mesh into sub-meshes and merges them back (see the module docstring)."""

    def __init__(self, state: MeshState, resizer: Resizer, lifecycle: Lifecycle) -> None:
        self.state = state
        self.resizer = resizer
        self.lifecycle = lifecycle
        self.token: object = None  # the current split (its sub-meshes hold it); None when not split
        self.subs: dict[str, SubMesh] = {}
        self._lock = threading.Lock()  # one split or merge at a time

    def current(self) -> dict[str, SubMesh]:
        """The live sub-meshes by name ({} when the mesh is not split)."""
        if self.token is None or self.state.partition is None:
            return {}
        return dict(self.subs)

    def split(self, mesh: Any, spec: int | Sequence[Sequence[int]],
              names: Sequence[str] | None = None) -> list[SubMesh]:
        """Split ``mesh`` into sub-meshes (see the module docstring); returns them in order.

        Raises
        ------
        ValueError
            ``spec`` does not partition the ranks, or ``names`` are not distinct Python names, one per group.
        MonarchError
            The mesh's state does not allow it (already split, a cell runs, a dead rank, nccl).
        MeshStartError
            A rank did not join its new group within ``start_timeout`` (then ``%mesh restart``).
        """
        state = self.state
        state.check_running()
        groups = partition(spec, state.nproc)
        names = list(names) if names is not None else [f"sub{i}" for i in range(len(groups))]
        if len(names) != len(groups) or len(set(names)) != len(names) or not all(
                isinstance(n, str) and n.isidentifier() for n in names):
            raise ValueError(f"names must be {len(groups)} distinct Python names, one per group; got {names!r}")
        if state.options.backend == "nccl" or any(i.backend == "nccl" for i in state.ranks.values()):
            raise MonarchError("sub-meshes of nccl ranks are not supported yet: a sub-mesh's LOCAL_RANK would name "
                               "another rank's GPU. Use a gloo mesh (%mesh start --backend gloo) to split.")
        with self._lock:
            if state.partition is not None:
                raise MonarchError(f"the mesh is split already ({', '.join(self.subs)}); merge it first with  "
                                   "m.merge()  (%mesh merge), then split again")
            self._claim("split")
            try:
                with state.lock:
                    state.partition, state.sub_names = groups, list(names)
                token = object()
                self.token = token
                self.subs = {n: SubMesh(n, g, mesh, self, token) for n, g in zip(names, groups, strict=True)}
                self.resizer.regroup_to(state.nproc, [])
            except BaseException:
                with state.lock:
                    state.partition = None
                self.token, self.subs = None, {}
                raise
            finally:
                self._release()
        state.events.emit("split", groups=groups, names=names)
        return list(self.subs.values())

    def merge(self) -> None:
        """Regroup every rank into one process group of the whole mesh (see the module docstring).

        Raises MonarchError when the mesh is not split, a sub-mesh runs a cell, or a rank is dead; MeshStartError
        as ``split``.
        """
        state = self.state
        state.check_running()
        with self._lock:
            if state.partition is None:
                raise MonarchError("the mesh is not split: there is nothing to merge (m.split(k) makes sub-meshes)")
            self._claim("merge")
            try:
                with state.lock:
                    state.partition = None
                    self.token, self.subs = None, {}
                self.resizer.regroup_to(state.nproc, [])
            finally:
                self._release()
        state.events.emit("merged", nproc=state.nproc)

    def _claim(self, what: str) -> None:
        """Under ``_lock``: refuse while a cell runs, a rank is dead or being restarted, or a scale runs; else mark
        the mesh as regrouping (``state.resizing``: scales wait), so nothing else re-forms its groups meanwhile."""
        state = self.state
        self._wait_background()
        with state.lock:
            busy = sorted(r for r, i in state.ranks.items() if i.cells)
            stuck = state.stuck(busy)  # interrupted and did not stop: only --force frees them
            dead = sorted(r for r, i in state.ranks.items() if i.state is RankState.DEAD)
            healing, resizing = sorted(state.healing), state.resizing
            if not (busy or dead or healing or resizing):
                state.resizing = True
                return
        if busy:
            where = [f"{n} (mesh {ranks_text([r for r in s.ranks if r in busy])})" for n, s in self.subs.items()
                     if any(r in busy for r in s.ranks)] or [ranks_text(busy)]
            if stuck:
                how = (f"{ranks_text(stuck)} did not stop when interrupted (blocked in a collective?): release "
                       f"{plural(stuck, 'them', 'it')} with  %mesh interrupt --force --ranks {format_ranks(stuck)}  "
                       f"(or  %mesh restart), then {what}.")
            else:
                how = (f"Wait for it (handle.result()), or stop it with  %mesh interrupt --ranks {format_ranks(busy)}"
                       f"  (--force when it does not stop), then {what}.")
            raise MonarchError(f"a cell runs on {', '.join(where)}: no {what} while a cell runs (its process group "
                               f"would change beneath it). {how}")
        if dead:
            raise MonarchError(f"{ranks_text(dead)} {'are' if len(dead) > 1 else 'is'} dead: restart with  "
                               f"%mesh restart --rank {format_ranks(dead)}  (on a split mesh that merges it back), "
                               f"then {what}")
        if healing:
            raise MonarchError(f"{ranks_text(healing)} {'are' if len(healing) > 1 else 'is'} being restarted; "
                               f"{what} once that is done")
        raise MonarchError(f"a %mesh scale runs on this mesh; {what} once it is done")

    def _wait_background(self) -> None:
        """Wait, up to ``BACKGROUND_WAIT`` seconds, for the package's own background work on the ranks (Lightning's
        warm-up import after ``import lightning`` in the notebook): it is no cell of the user's, so a split or merge
        is not refused for it. Work still running after that is refused as any cell is."""
        state = self.state
        with state.lock:
            background = [c.handle for c in state.pending.values() if c.background and c.handle is not None]
        deadline = time.monotonic() + BACKGROUND_WAIT
        for handle in background:
            handle.wait(max(0.0, deadline - time.monotonic()))

    def _release(self) -> None:
        with self.state.lock:
            self.state.resizing = False
