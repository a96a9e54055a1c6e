"""Interrupts of what ranks run, and restarts of some ranks: ``Restarts``.

``interrupt`` (``%mesh interrupt``) interrupts the cell each chosen rank runs (interrupts.Interrupter), waits
``interrupt_grace`` seconds, and reports the ranks that did not stop; with ``force`` it first tears the process group
down on every rank (``Abort``: releasing collectives), SIGKILLs the chosen ranks that still do not stop, and
re-creates the group when no rank had to be killed and none is dead.

``restart_ranks(R)`` (``%mesh restart --rank R``) starts fresh processes for R; every other rank keeps its namespace
and joins a fresh process group with them (``regroup``: ``Regroup`` to the survivors, then a new TCPStore hosted by
rank 0). Deaths are deaths.py; the release of ranks that wait for one that raised is releases.py.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from monarch_worker import protocol as P

from ..errors import MeshStartError, MonarchError, mesh_interrupt
from ..ranks import format_ranks, parse_ranks, plural, ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .hints import restart_hint, stuck_message
from .interrupts import Interrupter
from .iothread import post_regroup
from .lifecycle import Lifecycle
from .releases import unmatched
from .stacks import StackRequests, summarize
from .state import MeshState, RankState

log = logging.getLogger(__name__)

__all__ = ["Restarts", "InterruptReport", "where_interrupted", "keep_state", "EXIT_WAIT"]

#: Seconds to wait for a killed rank's exit to be reported.
EXIT_WAIT = 5.0


def where_interrupted(errors: dict[int, Any]) -> str:
    """Ranks grouped by where an interrupt stopped them: "ranks 0,1: time.sleep at cell line 3 / rank 2: ...".
    A rank whose traceback has no frame outside the worker's own code was stopped as the cell began (worker/
    executor.py strips those frames): "before the cell's first line"."""
    groups: dict[str, list[int]] = {}
    for r, e in sorted(errors.items()):
        frames = getattr(e, "frames", None) or []
        groups.setdefault(summarize([tuple(f) for f in frames]) if frames else "before the cell's first line",
                          []).append(r)
    return " / ".join(f"{ranks_text(rs)}: {w}" for w, rs in groups.items())


def keep_state(ranks: list[int] | dict) -> str:
    """What interrupted ranks keep, in the number of ``ranks``."""
    return plural(ranks, "they keep their state", "it keeps its state")


@dataclass
class InterruptReport:
    """Outcome of ``Mesh.interrupt``: rank lists, and ``text`` to show the user."""

    world_size: int  # ranks in the mesh
    interrupted: list[int] = field(default_factory=list)  # stopped the cell they ran
    stuck: list[int] = field(default_factory=list)  # still running after the grace period
    killed: list[int] = field(default_factory=list)  # SIGKILLed (force)
    idle: list[int] = field(default_factory=list)  # had nothing to interrupt
    regrouped: bool = False  # force: the process group was re-created
    realigned: str = ""  # not forced: the ranks had issued unmatched collectives, so the group was re-created
    dead: list[int] = field(default_factory=list)  # force: dead ranks of the mesh, so no group was re-created
    stacks: str = ""  # where the stuck ranks were
    grace: float = 0.0  # seconds the ranks had

    @property
    def text(self) -> str:
        out: list[str] = []
        if self.interrupted:
            out.append(f"interrupted {ranks_text(self.interrupted)}; {keep_state(self.interrupted)}")
        if not (self.interrupted or self.stuck or self.killed):
            out.append(f"nothing to interrupt: {ranks_text(self.idle)} idle")
        if self.stuck:
            out.append(f"{ranks_text(self.stuck)} did not stop within {self.grace:g} s: {self.stacks}")
            out.append(f"New code is refused until they stop (a collective would pair with the one they may be stuck "
                       f"in). Force with  %mesh interrupt --force --ranks {format_ranks(self.stuck)}  (it releases "
                       "collectives, then SIGKILLs ranks still stuck), or "
                       "%mesh restart  for a fresh mesh.")
        if self.killed:
            out.append(f"killed {ranks_text(self.killed)} (did not stop within {self.grace:g} s"
                       + (f": {self.stacks}" if self.stacks else "") + ")")
            out.append(restart_hint(self.killed, self.world_size))
        if self.dead:
            out.append(f"the process group was torn down; no fresh one was made, since {ranks_text(self.dead)} "
                       f"{plural(self.dead, 'are', 'is')} dead: {restart_hint(self.dead, self.world_size)}")
        if self.regrouped:
            out.append("the process group was re-created (collectives in flight were abandoned); "
                       "every rank kept its namespace")
        if self.realigned:
            out.append(self.realigned)
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


class Restarts:
    """Interrupts and restarts of some ranks of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable, interrupter: Interrupter,
                 stacks: StackRequests, lifecycle: Lifecycle) -> None:
        self.state = state
        self.cells = cells
        self.dispatcher = dispatcher
        self.interrupter = interrupter
        self.stacks = stacks
        self.lifecycle = lifecycle
        # One regroup at a time: a regroup owns MeshState.regrouping, store_port and group_down until it ends, so two
        # sub-meshes released at once (a sweep's trials, interrupted together) regroup one after the other.
        self._regroup_lock = threading.Lock()
        self._aligning = threading.Lock()  # one comparison of collective numbers at a time (realign)
        self._interrupting: list[set[int]] = []  # the process groups of interrupts under way (under the state lock)

    def stuck_message(self, stuck: list[int], grace: float) -> str:
        """What to tell the user about ranks that did not stop after an interrupt (their stacks asked now)."""
        try:
            where = self.stacks.ask(stuck, 2.0).summary()
        except MonarchError:
            where = "?"
        return stuck_message(stuck, grace, where)

    def interrupt(self, ranks: str | int | Iterable[int] | None, force: bool, grace: float | None) -> InterruptReport:
        """``Mesh.interrupt`` (its docstring says what it does)."""
        chosen = parse_ranks(ranks, self.state.nproc)
        with self.state.lock:
            mine = set(self.state.peers(chosen))
            self._interrupting.append(mine)
        try:  # its own realign judges these groups and reports it: check_alignment leaves them meanwhile
            return self._interrupt(chosen, force, grace)
        finally:
            with self.state.lock:
                self._interrupting.remove(mine)

    def _interrupt(self, chosen: list[int], force: bool, grace: float | None) -> InterruptReport:
        state, post = self.state, self.dispatcher.post
        grace = state.options.interrupt_grace if grace is None else float(grace)
        report = InterruptReport(grace=grace, world_size=self.state.nproc)
        busy: dict[int, int] = {}
        with state.lock:
            for r in chosen:
                info = state.ranks[r]
                if info.cells and info.state is not RankState.DEAD:
                    busy[r] = info.cells[0].cell_id
                else:
                    report.idle.append(r)
            alive = [i.rank for i in state.ranks.values() if i.identity is not None and i.state is not RankState.DEAD
                     and (not state.partition or i.rank in state.peers(list(busy)))]  # split: their sub-meshes
            group = state.peers(list(busy)) if state.partition else None
            if force and busy:
                state.mark_down(state.peers(list(busy)), "the process group was torn down by %mesh interrupt --force")
        self.interrupter.send(busy)
        if force and busy:
            for r in alive:
                post(r, P.Abort(reason="%mesh interrupt --force"))

        def running() -> list[int]:
            return [r for r, cid in busy.items() if state.ranks[r].state is not RankState.DEAD
                    and state.ranks[r].cells and state.ranks[r].cells[0].cell_id == cid]

        def wait_slice(timeout: float) -> list:
            state.cond.wait(timeout)
            return []

        stuck = self.interrupter.until_stopped(busy, grace, running, wait_slice, sent=True) if busy else []
        report.interrupted = [r for r in busy if r not in stuck]
        if stuck:
            try:
                report.stacks = self.stacks.ask(stuck, 2.0).summary()
            except MonarchError:
                report.stacks = ""
        if force and not busy:  # idle, and a release left their group down: make it again
            report.realigned = self.renew(chosen)
        if not force:
            report.stuck = stuck
            self._abandon({busy[r] for r in stuck})
            if report.interrupted and not stuck:
                report.realigned = self.realign(report.interrupted) or ""
            return report
        if stuck:
            self.kill_ranks(stuck, "killed by %mesh interrupt --force")
            report.killed = stuck
        # no group can be made without its dead ranks (split: its sub-mesh's): restarting them makes one
        elif busy and (dead := [r for r in state.dead() if group is None or r in group]):
            report.dead = dead
        elif busy:
            self.regroup([], time.monotonic() + state.options.start_timeout, group)
            report.regrouped = True
        return report

    def check_alignment(self, ranks: Sequence[int]) -> str:
        """``realign`` for each process group of ``ranks`` (split: their sub-meshes') that ran a cell which ended
        with an error or an interrupt since its numbers were last compared (``MeshState.unaligned``): a rank may
        have issued a collective (``async_op=True``, or an interrupt between issuing and waiting) that its peers
        never issued. Cheap when none did (no question is asked). Returns what was found and done, "" if nothing."""
        renewed = self.renew(ranks) if self.state.unrenewed else ""
        if not self.state.unaligned or not self._flagged(ranks):  # the usual cell: no lock taken
            return renewed
        with self._aligning:  # one check at a time (sweep trials submit from threads of their own)
            why = "a cell that ended with an error or an interrupt left it in flight"
            return "; ".join(t for t in [renewed, *(self._realign(g, why) for g in self._flagged(ranks))] if t)

    def renew(self, ranks: Sequence[int]) -> str:
        """A fresh process group for each group of ``ranks`` (split: their sub-meshes) that a release tore down
        while a rank of it still ran the cell (``MeshState.unrenewed``: it stopped after the interrupt's grace, or
        a second interrupt cut the wait short), once every rank of it is idle; a group with a dead rank waits for
        that rank's restart, which makes one. Returns what was done ("" if nothing)."""
        state = self.state
        with self._aligning, state.lock:
            groups: list[list[int]] = []
            for r in ranks:
                if r in state.unrenewed and not any(r in g for g in groups):
                    groups.append(state.peers([r]))
            ready = [(g, state.down_for(g)) for g in groups if all(
                not state.ranks[p].cells and state.ranks[p].state is not RankState.DEAD
                and state.ranks[p].identity is not None for p in g)]
        done: list[str] = []
        for group, why in ready:
            try:
                self.regroup([], time.monotonic() + state.options.start_timeout, group if state.partition else None)
            except MonarchError as e:
                done.append(f"the process group torn down earlier ({why}) could not be made again ({e}); "
                            "%mesh restart  starts a fresh mesh")
                continue
            done.append(f"the process group torn down earlier ({why}) was made again now that its ranks stopped; every "
                        "rank kept its namespace (groups made with dist.new_group, and DDP models, must be made again)")
        return "; ".join(done)

    def _flagged(self, ranks: Sequence[int]) -> list[list[int]]:
        """The process groups of ``ranks`` (split: their sub-meshes) that ``MeshState.unaligned`` names."""
        state = self.state
        with state.lock:
            if not state.unaligned:
                return []
            busy = set().union(*self._interrupting)
            groups: list[list[int]] = []
            covered: set[int] = set()
            for r in ranks:
                if r in state.unaligned and r not in busy and r not in covered:
                    groups.append(state.peers([r]))
                    covered.update(groups[-1])
            return groups

    def realign(self, ranks: list[int], why: str = "an interrupt left it in flight") -> str | None:
        """When every rank of the process group of ``ranks`` (split: their sub-mesh's) has ended its cells and they
        issued different numbers of collectives on it (``releases.unmatched``: one was interrupted between issuing
        a collective and waiting for it, or raised or ended before waiting for one issued with
        ``async_op=True``), tear the group down and make a fresh one, as ``interrupt(force=True)`` does, so that no
        later collective pairs with the abandoned one; every rank keeps its namespace. Returns what was found and
        done, "" when the numbers agree, None when nothing could be judged (a rank of the group still runs a
        cell, is dead, or did not answer: ``MeshState.unaligned`` keeps it for a later check)."""
        with self._aligning:
            return self._realign(ranks, why)

    def _realign(self, ranks: list[int], why: str) -> str | None:
        state = self.state
        with state.lock:
            peers = state.peers(ranks)
            if state.stopping or not peers or any(
                    state.ranks[r].cells or state.ranks[r].state is RankState.DEAD or state.ranks[r].identity is None
                    for r in peers):
                return None
        try:
            replies = self.stacks.ask(peers, 2.0).replies
        except MonarchError:
            return None
        if any(r not in replies for r in peers):
            return None
        skew = unmatched({r: replies[r].collective for r in peers}, peers)
        with state.lock:
            if any(state.ranks[r].cells for r in peers):  # a cell came meanwhile: it runs in the group as it is
                return None
            state.unaligned.difference_update(peers)
            if not skew:
                return ""
            reason = f"{skew} ({why})"
            state.mark_down(peers, reason)
        for r in peers:
            self.dispatcher.post(r, P.Abort(reason=reason))
        log.info("%s: the process group is re-created", reason)
        try:
            self.regroup([], time.monotonic() + state.options.start_timeout, peers if state.partition else None)
        except MonarchError as e:
            return f"{reason}; a fresh process group could not be made ({e}):  %mesh restart  starts a fresh mesh"
        return (f"{reason}: the process group was re-created, so that no later collective pairs with it; every "
                "rank kept its namespace (groups made with dist.new_group, and DDP models, must be made again)")

    def _abandon(self, cell_ids: set[int]) -> None:
        """The cells that ranks did not stop after ``interrupt``: interrupted and abandoned, as a notebook interrupt
        leaves a blocking cell (waiting.py), so that code is refused (RankBusyError) while a rank still runs one: a
        collective of new code would pair with the one it is stuck in."""
        with self.state.lock:
            for cid in cell_ids:
                rec = self.cells.get(cid)
                if rec is not None:
                    self.cells.mark_interrupted(rec)
                    self.cells.abandon(rec)

    def kill_ranks(self, ranks: list[int], why: str) -> None:
        """SIGKILL ``ranks`` and wait (``EXIT_WAIT`` s) until their exits are reported (a remote rank that is
        gone for good never reports: the wait just ends)."""
        state = self.state
        with state.lock:
            for r in ranks:
                state.killing[r] = why
        for r in ranks:
            if state.launcher is not None:
                state.launcher.signal(r, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_WAIT
        with state.lock:
            while time.monotonic() < deadline and not all(
                    state.ranks[r].state is RankState.DEAD and state.ranks[r].returncode is not None for r in ranks):
                state.cond.wait(0.05)

    # ------------------------------------------------------------------ restart of some ranks

    def restart_ranks(self, ranks: str | int | Iterable[int], joined: bool) -> tuple[list[int], list[str]]:
        """Fresh processes for ``ranks``; the others keep their namespaces and join a fresh process group (on a split
        mesh, one of the whole mesh: the split ends). Returns the ranks restarted and the sub-meshes that ended.

        Raises MonarchError when the ranks were started elsewhere (``joined``), other ranks are dead too, or
        survivors do not stop; MeshStartError when a rank fails to join.
        """
        state = self.state
        chosen = parse_ranks(ranks, state.nproc)
        why = state.launcher.restartable(chosen) if joined and state.launcher is not None else ""
        if why:
            raise MonarchError(
                f"cannot restart {ranks_text(chosen)} one by one: {why}. Run  %mesh restart  (a fresh mesh; one "
                "that listens for its hosts prints their commands again).")
        with state.lock:
            others_dead = [r for r, i in state.ranks.items() if r not in chosen and i.state is RankState.DEAD]
        if others_dead:
            together = sorted(set(chosen) | set(others_dead))
            if len(together) == state.nproc:  # nothing keeps state: a fresh mesh is the same, and simpler
                raise MonarchError(f"{ranks_text(others_dead)} {'are' if len(others_dead) > 1 else 'is'} dead too, "
                                   "so every rank is: run  %mesh restart  (a fresh mesh)")
            raise MonarchError(
                f"{ranks_text(others_dead)} {'are' if len(others_dead) > 1 else 'is'} dead too; restart them "
                f"together:  %mesh restart --rank {format_ranks(together)}")
        survivors = [r for r in range(state.nproc) if r not in chosen]
        with state.lock:
            ended = list(state.sub_names) if state.partition else []  # the sub-meshes this restart ends
            state.partition = None  # a split mesh regroups whole: the restart ends its sub-meshes (submesh.py)
            busy = [r for r in survivors if state.ranks[r].cells]
        if busy:
            report = self.interrupt(busy, False, None)
            if report.stuck:
                raise MonarchError(
                    f"{ranks_text(report.stuck)} still run a cell and did not stop within "
                    f"{state.options.interrupt_grace:g} s ({report.stacks}); a process group cannot be re-created "
                    f"around them. Stop them with  %mesh interrupt --force --ranks {format_ranks(report.stuck)}  "
                    "and restart them too, or run  %mesh restart  for a fresh mesh.")
        with state.lock:  # every chosen rank whose exit was not reported yet (alive, or lost by heartbeat)
            live = [r for r in chosen
                    if state.ranks[r].state is not RankState.DEAD or state.ranks[r].returncode is None]
        # Its exit must be in before a fresh process takes its place, or the report would hit the new one.
        self.kill_ranks(live, "killed by %mesh restart --rank")
        self.regroup(chosen, time.monotonic() + state.options.start_timeout)
        return chosen, ended

    def regroup(self, fresh: list[int], deadline: float, only: list[int] | None = None) -> None:
        """Start fresh processes for ``fresh`` and have every other rank join a new process group with them: each
        its own (the mesh's, or on a split mesh its sub-mesh's, ``MeshState.group_of``). ``only``: just these
        ranks regroup (whole sub-meshes of a split mesh; the others keep their groups and may run cells meanwhile).

        Raises MonarchError when a rank that is not in ``fresh`` is dead (it would never join); MeshStartError when
        a rank fails to join before ``deadline`` (then  %mesh restart  is the way). Regroups run one at a time
        (another thread's waits for this one to end).
        """
        with self._regroup_lock:
            self._regroup(fresh, deadline, only)

    def _regroup(self, fresh: list[int], deadline: float, only: list[int] | None) -> None:
        state = self.state
        survivors = [r for r in (range(state.nproc) if only is None else only) if r not in fresh]
        dead = [r for r in state.dead() if r in survivors]
        if dead:  # they would never join: fail now, not after the start timeout
            raise MonarchError(f"a process group cannot be made while {ranks_text(dead)} "
                               f"{plural(dead, 'are', 'is')} dead: {restart_hint(dead, state.nproc)}")
        with state.lock:
            state.store_port = None
            state.regrouping = set(survivors)
            state.regroup_active = True
            for r in fresh:
                state.ranks[r] = state.rank_info(r)
                state.killing.pop(r, None)
            for r in survivors:
                info = state.ranks[r]
                info.state = RankState.STARTING
                info.start_error = ""
            # The first rank of each group (rank 0; split: each sub-mesh's first) hosts its new store: on loopback,
            # or its address toward us (joined). A fresh rank 0 hosts it when it says hello (iothread.py).
            for leader in sorted({state.group_of(r)[0] for r in survivors}):
                if leader in survivors:
                    post_regroup(state, self.dispatcher, state.ranks[leader], 0,
                                 "" if self.lifecycle.joined else "127.0.0.1")
            state.cond.notify_all()
        self.lifecycle.spawn(fresh)
        interrupted = False
        try:
            while True:
                try:
                    self.lifecycle.wait_started(deadline, None if only is None else sorted(set(only) | set(fresh)))
                    break
                except KeyboardInterrupt:  # ranks half way into a new group would never join one: finish first
                    interrupted = True     # (bounded by the deadline), then say so
        except MeshStartError as e:
            raise MeshStartError(f"{e.args[0]}; run  %mesh restart  for a fresh mesh", e.rank, e.detail) from None
        finally:
            with state.lock:
                state.regrouping = set()
                state.regroup_active = False
        with state.lock:
            if only is None:
                state.down = {}  # the whole mesh regrouped (a scale may have dropped ranks that were down)
                state.unrenewed = set()
            else:
                state.mark_up([*survivors, *fresh])
        state.events.emit("regrouped", fresh=fresh)
        if interrupted:
            raise mesh_interrupt(f"interrupted while the ranks joined a fresh process group of {state.nproc}; that "
                                 "completed first, so the mesh is whole (%mesh status shows it)")
