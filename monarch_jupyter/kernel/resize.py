"""Elastic resize of a live mesh: ``Resizer.scale(n)`` (``%mesh scale -n N``, ``mesh.scale(N)``).

A change of membership is one regroup (recovery.Restarts.regroup, the mechanism ``%mesh restart --rank`` and the
self-healing mesh use): the ranks that stay keep their processes and namespaces and join a fresh default process
group of the new size; the ranks that come are started through the mesh's launcher and join it too.

- Growing from N to M starts ranks N..M-1 (the local launcher, the fork server), then sends them what the notebook
  had sent every rank (history.py, as to a restarted rank: pushes to all ranks, notebook functions, ``--replay``
  cells, on_rejoin hooks; healing.Healer.replay).
- Shrinking from N to M stops the highest ranks M..N-1 (SIGKILL, not reported as deaths), then regroups ranks 0..M-1.

Either way ranks stay numbered 0..M-1, and every rank's RANK, WORLD_SIZE, LOCAL_WORLD_SIZE (ROLE_*, and
NUM_REPLICA_GROUPS under torchft) are those of the new world (monarch_worker.elastic_env.resized on Regroup;
GROUP_* and TORCHELASTIC_RUN_ID stay: one host, one run), and ``world_size`` in every namespace is M.

What is refused (MonarchError or ValueError, the mesh unchanged): a size below 1; more local ranks than the host
carries (launch.capacity, unless ``oversubscribe``); ranks started elsewhere (joined, host agents: their launcher
owns them); a cell running on any rank (but a torchft loop: ftscale.py scales under it), a rank being restarted,
or a dead rank.

``regroup_to(nproc, fresh)`` is the part a sub-mesh (split, merge) can use as well: set the membership, start
``fresh``, regroup everyone (ranks on several hosts, host agents or joined, numbered per host: ``state.BY_HOST``).
"""

from __future__ import annotations

import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from ..errors import MonarchError
from ..ranks import format_ranks, ranks_text
from .ftscale import FtScaler, torchft_loops
from .healing import Healer
from .launch.capacity import check_host_capacity
from .launch.local import LocalLauncher
from .lifecycle import Lifecycle
from .recovery import Restarts
from .state import BY_HOST, MeshState, RankState

__all__ = ["Resizer", "ScaleReport"]


@dataclass
class ScaleReport:
    """Outcome of ``Mesh.scale``: the sizes, the ranks started and stopped, seconds it took, what new ranks got."""

    before: int
    after: int
    started: list[int]
    stopped: list[int]
    seconds: float
    sent: str = ""  # what the new ranks got back, in words ("" when nothing)
    group: str = ""  # what happens to the default process group, when not made now (ftscale.py), in words

    @property
    def text(self) -> str:
        if self.before == self.after:
            return f"the mesh has {self.after} ranks already: nothing to do"
        how = (f"started {ranks_text(self.started)}" if self.started else f"stopped {ranks_text(self.stopped)}")
        kept = min(self.before, self.after)
        out = (f"scaled from {self.before} to {self.after} ranks in {self.seconds:.1f} s: {how}; "
               f"{ranks_text(list(range(kept)))} kept {'their namespaces' if kept > 1 else 'its namespace'}; "
               f"{self.group or f'a fresh process group of {self.after} ranks'}")
        if self.sent:
            out += f"; the new ranks got {self.sent}"
        return out

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: object, cycle: bool) -> None:
        p.text(self.text)  # type: ignore[attr-defined]


class Resizer:
    """Grows and shrinks one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, restarts: Restarts, lifecycle: Lifecycle, healer: Healer,
                 ft: Callable[[Callable[[list[int]], str]], FtScaler]) -> None:
        self.state = state
        self.restarts = restarts
        self.lifecycle = lifecycle
        self.healer = healer
        self.ft = ft(self._replay)  # under a running torchft loop (ftscale.py)

    def scale(self, n: int) -> ScaleReport:
        """Make the mesh ``n`` ranks (see the module docstring).

        Raises
        ------
        ValueError
            ``n`` is not a positive int, or the host cannot carry ``n`` local ranks (``oversubscribe`` forces), or
            under a running torchft loop ``n`` is below ``torchft_min_replicas``.
        MonarchError
            The ranks were not started by this controller, a cell runs (other than a torchft loop on every rank,
            ftscale.py), a rank is dead or being restarted, another scale runs, or a rank grown under a torchft loop
            failed to start (the loop runs on without it).
        MeshStartError
            A new rank did not join within ``start_timeout`` (then ``%mesh restart`` is the way).
        """
        state = self.state
        state.check_running()
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"a mesh needs at least 1 rank, got {n!r}: to end it, run  %mesh stop  "
                             "(mesh.stop())")
        if self.lifecycle.joined or not isinstance(state.launcher, LocalLauncher):
            raise MonarchError(
                "%mesh scale grows and shrinks local ranks (started by this kernel's fork server); these ranks "
                "were started elsewhere (%mesh listen, host agents, torchrun, srun), whose launcher owns their "
                "processes. Start the mesh with  %mesh start -n N  to scale it, or  %mesh restart  with the new "
                "size from the launcher.")
        if state.partition is not None:
            raise MonarchError("the mesh is split into sub-meshes (submesh.py): merge it first with  m.merge()  "
                               "(%mesh merge), then scale")
        before = state.nproc
        if n > before and not state.options.oversubscribe:
            check_host_capacity(n)
        with state.lock:
            busy = sorted(r for r, i in state.ranks.items() if i.cells)
            dead = sorted(r for r, i in state.ranks.items() if i.state is RankState.DEAD)
            healing = sorted(state.healing)
            loops = torchft_loops(state) if busy else []
            if state.resizing:
                raise MonarchError("another %mesh scale runs on this mesh; wait for it")
            if not (busy and not loops or dead or healing):
                state.resizing = True
        if busy and not loops:
            raise MonarchError(
                f"a cell runs on {ranks_text(busy)}: the mesh is not resized under a running cell (its process "
                "group would change beneath it). Wait for it (handle.result()), or stop it with  %mesh interrupt"
                f", then  %mesh scale -n {n}.")
        if healing:
            raise MonarchError(f"{ranks_text(healing)} {'are' if len(healing) > 1 else 'is'} being restarted "
                               "(on_rank_death=restart); scale once the restart is done")
        if dead:
            raise MonarchError(f"{ranks_text(dead)} {'are' if len(dead) > 1 else 'is'} dead: restart "
                               f"{'them' if len(dead) > 1 else 'it'} first with  %mesh restart --rank "
                               f"{format_ranks(dead)}, then scale")
        t0 = time.monotonic()
        group = ""
        try:
            if n == before:
                return ScaleReport(before, n, [], [], 0.0)
            if loops:  # ftscale.py: the running torchft loop goes on; the default group is made when it ends
                self.ft.check(before, n)
                started, stopped, sent, group = self.ft.scale(before, n, loops)
            else:
                started, stopped, sent = self._scale(before, n)
        finally:
            with state.lock:
                state.resizing = False
        report = ScaleReport(before, n, started, stopped, time.monotonic() - t0, sent, group)
        state.events.emit("resized", before=before, after=n, started=started, stopped=stopped)
        state.events.flush()  # the live views show the new ranks before the report
        return report

    def _scale(self, before: int, n: int) -> tuple[list[int], list[int], str]:
        """No cell runs: stop or start ranks, one regroup; returns (started, stopped, what new ranks got)."""
        state = self.state
        stopped = list(range(n, before))
        if stopped:
            self.restarts.kill_ranks(stopped, "stopped by %mesh scale")
            with state.lock:
                still = [r for r in stopped if state.ranks[r].state is not RankState.DEAD]
            if still:  # not reported gone within EXIT_WAIT: SIGKILL again, they must not rejoin
                assert state.launcher is not None
                for r in still:
                    state.launcher.signal(r, signal.SIGKILL)
        started = list(range(before, n))
        self.regroup_to(n, started)
        return started, stopped, self._replay(started) if started else ""

    def _replay(self, ranks: list[int]) -> str:
        """Send new ``ranks`` what the notebook sent every rank (Healer.replay), as the replayer: what it sends is
        not recorded again (history.py), and its own cells do not wait for a healing (``MeshState.healer``)."""
        state = self.state
        me = threading.current_thread()
        with state.lock:
            mine = state.healer is None
            if mine:
                state.healer = me
        try:
            return self.healer.replay(ranks)
        finally:
            if mine:
                with state.lock:
                    if state.healer is me:
                        state.healer = None

    def regroup_to(self, nproc: int, fresh: list[int]) -> None:
        """Make the mesh ranks 0..nproc-1: forget ranks from ``nproc`` on, start ``fresh`` (new numbers, or
        ranks to start afresh), and have every rank join a fresh process group of ``nproc`` ranks
        (Restarts.regroup). No cell may run. Raises as Restarts.regroup."""
        state = self.state
        with state.lock:
            for r in [r for r in state.ranks if r >= nproc]:
                del state.ranks[r]
                state.killing.pop(r, None)
            state.nproc = nproc
            local = isinstance(state.launcher, LocalLauncher) and not self.lifecycle.joined
            state.local_world = nproc if local else BY_HOST  # local ranks: one host; else numbered per host
        try:
            self.restarts.regroup(fresh, time.monotonic() + state.options.start_timeout)
        finally:
            with state.lock:
                state.local_world = -1
