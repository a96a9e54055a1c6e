"""Elastic resize of a live mesh: ``Resizer.scale(n)`` (``%mesh scale -n N``, ``mesh.scale(N)``).

A change of membership is one regroup (recovery.Restarts.regroup, the mechanism ``%mesh restart --rank`` and the
self-healing mesh use): the ranks that stay keep their processes and namespaces and join a fresh default process
group of the new size, with the ranks that come.

- Growing from N to M starts ranks N..M-1 through the mesh's launcher: the local fork server, or the host agents
  (launch/hosts.py), which get them as launch/placement.py places them (the hosts evenly, each up to its room). They
  start without a process group (``state.solo``, as a healing replacement; ``state.growing``: their death breaks no
  group), so that one that fails to start within ``timeout``, dies or is lost with its agent is stopped and forgotten
  and the mesh is left as it was. Once all are up, every rank regroups, and the new ones get what the notebook had
  sent every rank (history.py, as to a restarted rank: pushes to all ranks, notebook functions, ``--replay`` cells,
  on_rejoin hooks; healing.Healer.replay).
- Shrinking from N to M stops the highest ranks M..N-1 (SIGKILL, not reported as deaths; through their agents, which
  then forget them), then regroups ranks 0..M-1.

Either way ranks stay numbered 0..M-1, and every rank's RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE (ROLE_*, and
REPLICA_GROUP_ID/NUM_REPLICA_GROUPS under torchft) are those of the new world (monarch_worker.elastic_env.resized on
Regroup; on several hosts numbered per host, ``state.BY_HOST``; GROUP_* and TORCHELASTIC_RUN_ID stay: the same hosts,
the same run), and ``world_size`` in every namespace is M.

What is refused (MonarchError or ValueError, the mesh unchanged): a size below 1; more local ranks than the host
carries (launch.capacity), or more than the hosts' agents have room for (launch.placement), unless
``oversubscribe``; ranks started one process per rank elsewhere (their launcher owns them); a split mesh; a cell
running on any rank (but a torchft loop on local ranks: ftscale.py scales under it), a rank being restarted, or a
dead rank.

``regroup_to(nproc, fresh)`` is the part a sub-mesh (split, merge) can use as well: set the membership, start
``fresh``, regroup everyone (ranks on several hosts, host agents or joined, numbered per host: ``state.BY_HOST``).
"""

from __future__ import annotations

import operator
import signal
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ..errors import MeshStartError, MonarchError, describe_returncode
from ..ranks import format_ranks, n_ranks, ranks_text
from .config import check_timeout
from .ftscale import FtScaler, torchft_loops
from .healing import Healer
from .hints import restarted_note
from .launch.capacity import check_host_capacity, check_local_gpus
from .launch.hosts import HostLinks
from .launch.join import JoinLauncher
from .launch.local import LocalLauncher
from .launch.placement import Placement, place
from .lifecycle import Lifecycle
from .recovery import Restarts
from .state import BY_HOST, MeshState, RankState

__all__ = ["Resizer", "ScaleReport"]

SLOW_HINT = ("Scale again once the hosts can start them (%mesh status shows each host's ranks), or give them longer: "
             "%mesh scale -n N --timeout SECONDS")


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
            return f"the mesh has {n_ranks(self.after)} already: nothing to do"
        how = (f"started {ranks_text(self.started)}" if self.started else f"stopped {ranks_text(self.stopped)}")
        kept = min(self.before, self.after)
        out = (f"scaled from {self.before} to {n_ranks(self.after)} in {self.seconds:.1f} s: {how}; "
               f"{ranks_text(list(range(kept)))} kept {'their namespaces' if kept > 1 else 'its namespace'}; "
               f"{self.group or f'a fresh process group of {n_ranks(self.after)}'}")
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

    def scale(self, n: int, timeout: float | None = None) -> ScaleReport:
        """Make the mesh ``n`` ranks (see the module docstring); new ranks have ``timeout`` seconds (default: the
        mesh's ``start_timeout``) to start.

        Raises
        ------
        TypeError
            ``n`` is not an int, or ``timeout`` not a number.
        ValueError
            ``n`` or ``timeout`` is not positive, or the host(s) cannot carry ``n`` ranks (``oversubscribe``
            forces), or under a running torchft loop ``n`` is below ``torchft_min_replicas``.
        MonarchError
            The ranks were started one by one elsewhere, a cell runs (but a torchft loop on every local rank:
            ftscale.py), a rank is dead or being restarted, another scale runs, or a rank grown under a torchft loop
            failed to start (the loop runs on without it).
        MeshStartError
            A new rank did not start within ``timeout`` (the mesh is left as it was), or a rank failed to join the
            new process group (then ``%mesh restart`` is the way).
        """
        state = self.state
        state.check_running()
        if isinstance(n, bool) or not hasattr(n, "__index__"):
            raise TypeError(f"n is the number of ranks the mesh should have, an int; got {n!r} ({type(n).__name__})")
        n = operator.index(n)  # numpy's ints too
        if n < 1:
            raise ValueError(f"a mesh needs at least 1 rank, got {n!r}: to end it, run  %mesh stop  "
                             "(mesh.stop())")
        check_timeout(timeout)  # the seconds new ranks have to start
        hosts = self._hosts()
        if hosts is None and (self.lifecycle.joined or not isinstance(state.launcher, LocalLauncher)):
            raise MonarchError(
                "%mesh scale grows and shrinks ranks this kernel starts: its own (%mesh start -n N) or those of host "
                "agents (python -m monarch_worker.agent, as %mesh listen and --launcher agent/torchrun/slurm start "
                "them); these ranks were started one process per rank elsewhere, whose launcher owns their processes. "
                "Start the mesh with  %mesh start -n N  or host agents to scale it, or  %mesh restart  with the new "
                "size from the launcher.")
        if state.partition is not None:
            raise MonarchError("the mesh is split into sub-meshes (submesh.py): merge it first with  m.merge()  "
                               "(%mesh merge), then scale")
        before = state.nproc
        placed: Placement | None = None
        if n > before:
            if hosts is not None:
                placed = place(hosts.live_agents(), before, n, state.options.oversubscribe, hosts.waiting_hosts(),
                               gpus=state.options.backend == "nccl")
            else:
                if state.options.backend == "nccl":
                    check_local_gpus(n)
                if not state.options.oversubscribe:
                    check_host_capacity(n, scaling=True)
        with state.lock:
            busy = sorted(r for r, i in state.ranks.items() if i.cells)
            dead = sorted(r for r, i in state.ranks.items() if i.state is RankState.DEAD)
            healing = sorted(state.healing)
            loops = torchft_loops(state) if busy and hosts is None else []
            if state.resizing:
                raise MonarchError("another %mesh scale runs on this mesh; wait for it")
            again = self.ft.scaled_under(loops) if n != before else None  # n == before: "nothing to do" below
            if not (busy and not loops or dead or healing or again is not None):
                state.resizing = True
        if again is not None:
            raise MonarchError(
                f"the mesh was scaled already under the running torchft loop (cell {again}): its ranks change once "
                "per loop. Scale again when the loop has ended (its default process group of "
                f"{before} ranks is made then): wait for it (handle.result()), or stop it with  %mesh interrupt")
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
        try:
            if n == before:
                return ScaleReport(before, n, [], [], 0.0)
            group = ""
            if loops:  # ftscale.py: the running torchft loop goes on; the default group is made when it ends
                self.ft.check(before, n)
                started, stopped, sent, group = self.ft.scale(before, n, loops)
            else:
                stopped = list(range(n, before))
                if stopped:
                    self.restarts.kill_ranks(stopped, "stopped by %mesh scale")
                    with state.lock:
                        still = [r for r in stopped if state.ranks[r].state is not RankState.DEAD]
                    if still and state.launcher is not None:  # not gone within EXIT_WAIT: SIGKILL again, no rejoin
                        for r in still:
                            state.launcher.signal(r, signal.SIGKILL)
                    if hosts is not None:
                        hosts.reassign({}, n)  # each agent forgets its ranks from n on
                started = list(range(before, n))
                if started:
                    wait = state.options.start_timeout if timeout is None else timeout
                    self._start_alone(started, placed, time.monotonic() + wait, wait)
                came = bool(placed and placed.admit)  # a host came: every rank's GROUP_WORLD_SIZE grows
                self.regroup_to(n, [], len(hosts.agents) if came and hosts is not None else -1)
                sent = self._replay(started) if started else ""
        finally:
            with state.lock:
                state.resizing = False
        report = ScaleReport(before, n, started, stopped, time.monotonic() - t0, sent, group)
        state.events.emit("resized", before=before, after=n, started=started, stopped=stopped)
        state.events.flush()  # the live views show the new ranks before the report
        return report

    def restart_ranks(self, ranks: str | int | Iterable[int], joined: bool) -> None:
        """``%mesh restart --rank R`` (recovery.Restarts.restart_ranks), then, on a mesh that keeps what the notebook
        sent (on_rank_death="restart"), sends the fresh ranks what it sent every rank, as a healing does; prints one
        line saying what happened. Raises as Restarts.restart_ranks."""
        chosen, ended = self.restarts.restart_ranks(ranks, joined)
        kept = self.state.options.on_rank_death == "restart"
        sent = self._replay(chosen) if kept else ""
        print(restarted_note(chosen, self.state.nproc, ended, sent, kept))

    def waiting_hosts(self) -> dict[str, int]:
        """host name -> ranks it brings, of host agents that came to this listening mesh after it was complete: they
        wait, outside the mesh, until a scale admits them (launch/placement.py)."""
        hosts = self._hosts()
        return {a.host: n for a, n in hosts.waiting_hosts()} if hosts is not None else {}

    def _hosts(self) -> HostLinks | None:
        """The host agents that hold the mesh's ranks (launch/hosts.py), or None (local ranks, or ranks started one
        by one elsewhere)."""
        launcher = self.state.launcher
        return launcher.hosts if isinstance(launcher, JoinLauncher) else None

    def _start_alone(self, ranks: list[int], placed: Placement | None, deadline: float, wait: float) -> None:
        """Start new ``ranks`` without a process group (``state.solo``, as a healing does): the others keep theirs
        until every new rank is up, so that one that does not come (``deadline``), dies or is lost with its host
        leaves the mesh as it was. Raises MeshStartError then (KeyboardInterrupt: as it came), once the new ranks
        were stopped and forgotten."""
        state = self.state
        hosts = self._hosts()
        with state.lock:
            before = state.nproc
            state.nproc = before + len(ranks)
            for r in ranks:
                state.ranks[r] = state.rank_info(r)
                state.ranks[r].host = placed.hosts.get(r, "") if placed is not None else ""
            state.solo.update(ranks)
            state.growing.update(ranks)
            state.cond.notify_all()
        try:
            if hosts is not None and placed is not None:
                for identity, its in placed.admit.items():
                    hosts.admit_late(identity, its)  # its agent forks them when welcomed
                hosts.reassign(placed.ranks, state.nproc)
            error: MeshStartError | None
            try:
                self.lifecycle.spawn([r for r in ranks if placed is None or r not in placed.admitted])
            except MeshStartError as e:  # the launcher cannot start them (their host agent went away meanwhile)
                error = MeshStartError(f"new {ranks_text(ranks)} (host {state.ranks[ranks[0]].host or '?'}) failed to "
                                       f"start ({e.args[0]})", ranks[0], getattr(e, "detail", ""))
            else:
                error = self._wait_started(ranks, deadline, wait)
            if error is None:
                with state.lock:
                    state.solo -= set(ranks)
                    state.growing -= set(ranks)
                return
        except BaseException:
            self._forget(ranks, before, hosts, placed)
            raise
        self._forget(ranks, before, hosts, placed)
        raise MeshStartError(f"{error.args[0]}: the new ranks were stopped and the mesh is as it was, {before} "
                             f"ranks in their process group. {SLOW_HINT}", error.rank, error.detail)

    def _wait_started(self, ranks: list[int], deadline: float, wait: float) -> MeshStartError | None:
        """Wait until new ``ranks`` are up (None), or say which failed to start, died or is late at ``deadline``."""
        state = self.state
        with state.lock:
            while True:
                failed = [state.ranks[r] for r in ranks
                          if state.ranks[r].start_error or state.ranks[r].state is RankState.DEAD]
                if failed:
                    info = failed[0]
                    why = info.start_error or info.death_reason or describe_returncode(info.returncode)
                    return MeshStartError(f"new rank {info.rank} (host {info.host or '?'}) failed to start ({why})",
                                          info.rank, "\n".join(info.last_lines))
                late = [r for r in ranks if state.ranks[r].state is not RankState.IDLE]
                if not late:
                    return None
                if time.monotonic() > deadline:
                    return MeshStartError(f"new {ranks_text(late)} did not start within {wait:g} s", late[0])
                state.cond.wait(0.05)

    def _forget(self, ranks: list[int], before: int, hosts: HostLinks | None, placed: Placement | None) -> None:
        """Stop new ``ranks`` that did not all start and make the mesh ``before`` ranks again, as it was (hosts it
        admitted are sent away: their agents exit)."""
        state = self.state
        self.restarts.kill_ranks(ranks, "stopped: %mesh scale gave up on the new ranks")
        if hosts is not None:
            for identity in placed.admit if placed is not None else ():
                hosts.dismiss(identity, "the %mesh scale that admitted this host gave up (see the notebook)")
            hosts.reassign({}, before)
        with state.lock:
            for r in ranks:
                del state.ranks[r]
                state.killing.pop(r, None)
            state.solo -= set(ranks)
            state.growing -= set(ranks)
            state.nproc = before
            state.cond.notify_all()
        state.events.emit("resized", before=before, after=before, started=[], stopped=[])

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

    def regroup_to(self, nproc: int, fresh: list[int], group_world: int = -1) -> None:
        """Make the mesh ranks 0..nproc-1: forget ranks from ``nproc`` on, start ``fresh`` (new numbers, or
        ranks to start afresh), and have every rank join a fresh process group of ``nproc`` ranks
        (Restarts.regroup), with GROUP_WORLD_SIZE ``group_world`` (-1: unchanged). No cell may run. Raises as
        Restarts.regroup."""
        state = self.state
        with state.lock:
            for r in [r for r in state.ranks if r >= nproc]:
                del state.ranks[r]
                state.killing.pop(r, None)
            state.nproc = nproc
            local = isinstance(state.launcher, LocalLauncher) and not self.lifecycle.joined
            state.local_world = nproc if local else BY_HOST  # local ranks: one host; else numbered per host
            state.group_world = group_world
        try:
            self.restarts.regroup(fresh, time.monotonic() + state.options.start_timeout)
        finally:
            with state.lock:
                state.local_world = state.group_world = -1
