"""What the controller does when ranks die, hang or will not stop.

Death
    A local rank's exit reaches the kernel from the fork server within one select() wake-up of its SIGCHLD
    (``RankEvents.on_exit``); a rank that stops sending heartbeats for ``heartbeat_timeout`` seconds (a remote rank
    whose host vanished, or any rank that is SIGSTOPped or hung with the GIL held) is declared lost by the I/O
    thread (``check_heartbeats``) and, where the launcher can, killed. Either way ``rank_failed`` fails the cells
    it had, and ``after_death`` interrupts the survivors of those cells and sends every survivor ``Abort``: each
    leaves the broken process group (see monarch_worker.recovery), which releases ranks blocked in a collective
    with the dead one. The cell raises ``MeshError`` as soon as every survivor has stopped, or ``RELEASE_GRACE``
    seconds after the death; the dead rank's exit status and last output are its root cause.

Recovery
    ``restart_ranks(R)`` (``%mesh restart --rank R``) starts fresh processes for R; every other rank keeps its
    namespace and joins a fresh process group with them (``Regroup``: destroy_process_group, then a new
    TCPStore hosted by rank 0). ``interrupt(force=True)`` tears the process group down on every rank (releasing
    collectives), SIGKILLs the chosen ranks that still do not stop, and re-creates the group when no rank had
    to be killed.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from monarch_worker import protocol as P

from ..errors import MeshStartError, MonarchError, RankAbortedError, RankDiedError, RemoteError
from ..ranks import format_ranks, parse_ranks, plural, ranks_text
from .cells import CellHandle
from .dispatch import Dispatcher, restart_hint
from .iothread import post_regroup
from .lifecycle import Lifecycle
from .output import write_lines
from .routing import OutputRouter
from .stacks import StackRequests, summarize
from .state import MeshState, RankInfo, RankState

log = logging.getLogger(__name__)

__all__ = ["Recovery", "RankEvents", "InterruptReport", "where_interrupted", "keep_state", "failed_ranks",
           "waiting_for", "COLLECTIVE_CHECK", "RELEASE_GRACE", "EXIT_WAIT"]

#: Seconds a cell waits for surviving ranks to stop after a rank of it died, before it raises anyway.
RELEASE_GRACE = 1.0
COLLECTIVE_CHECK = 0.5
"""Seconds between the questions, to the ranks still running a cell that another rank of it raised in, which
collectives they have issued (``waiting_for``): a rank that issued one the raising rank never issued waits for it
forever, so the process group is torn down to release it (torchrun's fail-fast, which ends every worker when one
fails, kept to the cell: namespaces stay)."""
#: Seconds to wait for a killed rank's exit to be reported.
EXIT_WAIT = 5.0
#: Seconds by which a survivor's error may precede the report of a death and still be its consequence: a gloo
#: peer sees the dead rank's connection close at about the moment the fork server sees it exit.
DEATH_SKEW = 0.5
#: Seconds between interrupts sent to ranks that still run what was interrupted.
RESEND = 1.0


def where_interrupted(errors: dict[int, Any]) -> str:
    """Ranks grouped by where an interrupt stopped them: "ranks 0,1: time.sleep at cell line 3 / rank 2: ..."."""
    groups: dict[str, list[int]] = {}
    for r, e in sorted(errors.items()):
        frames = getattr(e, "frames", None) or []
        groups.setdefault(summarize([tuple(f) for f in frames]) if frames else "?", []).append(r)
    return " / ".join(f"{ranks_text(rs)}: {w}" for w, rs in groups.items())


def waiting_for(failed: dict[int, dict], running: dict[int, dict]) -> dict[int, str]:
    """Which ranks of ``running`` wait for a rank of ``failed`` in a collective it will never issue.

    ``failed``, ``running``: rank -> its flight-recorder summary (``Stacks.collective``, monarch_worker.recovery
    ``last_collective``: ``groups`` maps a process group to ``[seq, ranks, name]``). The ranks of ``failed`` raised
    and left the cell, so their numbers are final. A running rank that has issued collective number ``seq`` on a
    group of which a failed rank is a member, while that failed rank issued fewer there, is in (or past, for a
    collective that completes one-sidedly) a collective that cannot complete: it waits whatever frame it waits
    in (Python, DDP's C++ reducer, autograd's engine, ``Work.wait()``, NCCL's later synchronisation).

    Returns rank -> the collective it waits in ("gloo:all_reduce #5"); ranks without a recorder summary are left
    out (the caller falls back to their stacks).
    """
    out: dict[int, str] = {}
    for r, c in running.items():
        for group, (seq, members, name) in (c.get("groups") or {}).items():
            peers = [f for f in failed if f in members]
            if not peers:  # a group without the raising ranks (or whose ranks are unknown): not waiting for them
                continue
            behind = min(int(((failed[f].get("groups") or {}).get(group) or [0])[0]) for f in peers)
            if int(seq) > behind:
                out[r] = f"{name or 'collective'} #{seq}"
                break
    return out


def keep_state(ranks: list[int] | dict) -> str:
    """What interrupted ranks keep, in the number of ``ranks``."""
    return plural(ranks, "they keep their state", "it keeps its state")


def failed_ranks(cell: CellHandle) -> list[int]:
    """Under the lock: the ranks that finished ``cell`` by raising (not interrupted, not dead)."""
    return sorted(r for r in cell.finished
                  if isinstance(e := cell.errors.get(r), RemoteError) and not e.interrupted)


@dataclass
class InterruptReport:
    """Outcome of ``Mesh.interrupt``: rank lists, and ``text`` to show the user."""

    world_size: int  # ranks in the mesh
    interrupted: list[int] = field(default_factory=list)  # stopped the cell they ran
    stuck: list[int] = field(default_factory=list)  # still running after the grace period
    killed: list[int] = field(default_factory=list)  # SIGKILLed (force)
    idle: list[int] = field(default_factory=list)  # had nothing to interrupt
    regrouped: bool = False  # force: the process group was re-created
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
            out.append(f"Force with  %mesh interrupt --force --ranks {format_ranks(self.stuck)}  (it releases "
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
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


class Recovery:
    """Deaths, lost ranks, interrupts of what ranks run, and restarts of some ranks (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, stacks: StackRequests, lifecycle: Lifecycle) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.stacks = stacks
        self.lifecycle = lifecycle

    # ------------------------------------------------------------------ death and loss

    def rank_failed(self, info: RankInfo, returncode: int | None, reason: str) -> list[CellHandle]:
        """Under the lock: ``info``'s process is gone (or lost); fail the cells it had and return them."""
        info.state = RankState.DEAD
        info.returncode = returncode
        info.death_reason = reason
        self.state.failures.pop(info.rank, None)  # its kept traceback died with it
        now = time.monotonic()
        failed = []
        for cell in list(info.cells):
            if info.rank not in cell.finished:
                if cell.death_at is None:
                    cell.death_at = now
                last, earlier = info.last_output(cell.cell_id)
                cell.fail_rank(info.rank, RankDiedError(info.rank, returncode, last, info.pid, reason, earlier))
                failed.append(cell)
        info.cells.clear()
        self.state.cond.notify_all()
        return failed

    def after_death(self, rank: int, reason: str, cells: list[CellHandle], notify: bool = True) -> None:
        """Lock not held: interrupt the survivors of ``cells`` (the dead rank's) and tell every surviving rank to
        leave the broken process group. ``notify``: when the rank had no cell, say so in the last cell's output
        (not for ranks killed on purpose)."""
        state, post = self.state, self.dispatcher.post
        with state.lock:
            if state.stopping:
                return
            dead = [r for r, i in state.ranks.items() if i.state is RankState.DEAD]
            state.group_down = f"{ranks_text(dead)} died"
            for cell in cells:
                for r in cell.ranks:
                    if r not in cell.finished and state.ranks[r].state is not RankState.DEAD:
                        post(r, P.Interrupt(cell.cell_id))
            for info in state.ranks.values():
                if info.identity is not None and info.alive:
                    post(info.rank, P.Abort(reason=f"rank {rank} died"))
            target = state.last_cell
            rc = state.ranks[rank].returncode
        if not cells and notify and target is not None:
            # Nobody waits on this rank: say so where the user last looked.
            status = str(RankDiedError(rank, rc, reason=reason)).split("] ", 1)[1]
            write_lines([(rank, "stderr", f"{status} while idle. {restart_hint([rank], state.nproc)}")], target.ctx)
        state.events.emit("rank_died", rank=rank, returncode=rc, reason=reason)

    def check_heartbeats(self, now: float) -> None:
        """I/O thread, after it handled every message received: declare lost the ranks silent for
        ``heartbeat_timeout`` seconds, and kill them where the launcher can (a remote one also exits by itself
        once it stops hearing from us)."""
        state = self.state
        window = state.options.heartbeat_timeout
        if window <= 0:
            return
        with state.lock:
            silent = [info.rank for info in state.ranks.values() if info.identity is not None
                      and info.last_heard > 0 and info.alive and now - info.last_heard > window]
        if silent:
            self.ranks_lost(silent, f"no heartbeat for {window:g} s: stopped, hung with the GIL held, or its host is "
                                    "unreachable")

    def ranks_lost(self, ranks: list[int], reason: str) -> None:
        """(any thread) ``ranks`` are gone without an exit status (silent, or their host agent vanished): fail
        their cells, tell the survivors, and kill them where the launcher can."""
        state = self.state
        lost: list[tuple[int, str, list]] = []
        with state.lock:
            if state.stopping or not state.running:
                return
            for r in ranks:
                info = state.ranks[r]
                if info.alive:
                    lost.append((r, reason, self.rank_failed(info, None, reason)))
        for rank, reason, cells in lost:
            log.info("rank %d: %s; declared dead", rank, reason)
            state.events.emit("rank_state", rank=rank, state="dead", returncode=None)
            if state.launcher is not None:
                state.launcher.signal(rank, signal.SIGKILL)
            self.after_death(rank, reason, cells, notify=True)

    def fold_errors(self, cell: CellHandle, errors: dict[int, Any]) -> tuple[dict[int, Any], str]:
        """When ranks of ``cell`` died: errors that came before the first death and are not its consequence (more
        than ``DEATH_SKEW`` s before it, or the raising ranks that a release tore the group down for) stay first,
        then the deaths (the root cause when nothing came before), and errors of survivors that stopped because of
        them (reported after, or ``DEATH_SKEW`` s before, the first death) become RankAbortedError. Returns
        (errors, hint)."""
        dead = [r for r, e in errors.items() if isinstance(e, RankDiedError)]
        if not dead or cell.death_at is None:
            return errors, ""

        death_at = cell.death_at

        def before(r: int, e: Any) -> bool:
            seen = cell.result_seen_at.get(r, death_at)
            if cell.collective_released and r not in cell.released and isinstance(e, RemoteError):
                return seen <= death_at  # it raised; the release (and what followed) came of it
            return isinstance(e, RemoteError) and seen < death_at - DEATH_SKEW

        out: dict[int, Any] = {r: e for r, e in errors.items() if before(r, e)}
        out.update((r, errors[r]) for r in dead)
        for r, e in errors.items():
            if r in out:
                continue
            if isinstance(e, RemoteError) and cell.result_seen_at.get(r, 0.0) >= cell.death_at - DEATH_SKEW:
                e = RankAbortedError(r, dead, e)
            out[r] = e
        return out, restart_hint(dead, self.state.nproc) if self.state.running else ""

    def release_survivors(self, cell: CellHandle, now: float) -> None:
        """Under the lock: ``RELEASE_GRACE`` after a death, give up on survivors that did not stop."""
        if cell.death_at is None or cell.all_done or now - cell.death_at <= RELEASE_GRACE:
            return
        dead = [r for r, e in cell.errors.items() if isinstance(e, RankDiedError)]
        for r in cell.ranks:
            if r not in cell.finished:
                cell.errors[r] = RankAbortedError(r, dead, None, still_running=True)
                cell.finish_rank(r)

    # ------------------------------------------------------------------ a failed rank's peers in a collective

    def waiting_for_failed(self, cell: CellHandle, now: float) -> tuple[list[int], list[int]]:
        """Under the lock: every ``COLLECTIVE_CHECK`` s while a rank of ``cell`` has raised and others still run
        it, (the ranks that raised, the ranks still running it) for ``release_collective``; else ([], [])."""
        if cell.all_done or cell.interrupted or cell.collective_released or not cell.errors:
            return [], []
        failed = failed_ranks(cell)
        if not failed or now < cell.collective_check_at:
            return [], []
        cell.collective_check_at = now + COLLECTIVE_CHECK
        running = [r for r in cell.ranks if r not in cell.finished and self.state.ranks[r].state is not RankState.DEAD]
        return failed, running

    def release_collective(self, cell: CellHandle, failed: list[int], running: list[int]) -> None:
        """Lock not held: when ranks of ``running`` wait in a collective that ranks of ``failed`` (which raised in
        ``cell``) never issued (``waiting_for``, from the flight recorder; from their Python stacks where it is
        off), tear the process group down (``Abort`` to every rank) to release them; the waiter makes a fresh
        group once the cell ended (``cell.collective_released`` says why, ``cell.released`` where they were)."""
        try:
            report = self.stacks.ask(failed + running, 1.0)
        except MonarchError:
            return
        replies = report.replies
        known = {r: replies[r].collective for r in failed if r in replies}
        recorded = {r: replies[r].collective for r in running if r in replies and "groups" in replies[r].collective}
        waiting = waiting_for(known, recorded) if len(known) == len(failed) else {}
        # A group's own count (no flight recorder: torch before 2.8 with gloo) holds point-to-point operations
        # too, which another peer may be serving: such a rank waits only when its count stood still since the
        # last question (COLLECTIVE_CHECK s before).
        counts = {r: c["groups"] for r, c in recorded.items() if c.get("source") == "sequence"}
        with self.state.lock:
            waiting = {r: w for r, w in waiting.items() if r not in counts or cell.counts_seen.get(r) == counts[r]}
            cell.counts_seen = counts
        for r in running:  # no flight recorder there (TORCH_FR_BUFFER_SIZE=0): a collective's Python frames
            if r in replies and r not in recorded and any(
                    "torch/distributed/" in str(f[0]) or "torch/nn/parallel/" in str(f[0]) for f in replies[r].frames):
                waiting[r] = "a collective"
        state, post = self.state, self.dispatcher.post
        with state.lock:
            failed = failed_ranks(cell)
            waiting = {r: w for r, w in waiting.items() if r not in cell.finished}
            if not waiting or not failed or cell.all_done or cell.interrupted or state.stopping:
                return
            first = cell.errors[failed[0]]
            reason = (f"{ranks_text(failed)} raised {getattr(first, 'ename', 'an error')} while "
                      f"{ranks_text(sorted(waiting))} waited for it in a collective")
            cell.collective_released = reason
            cell.released = waiting
            state.group_down = reason
            for info in state.ranks.values():
                if info.identity is not None and info.alive:
                    post(info.rank, P.Abort(reason=reason))
        log.info("cell %d: %s: process group torn down to release them", cell.cell_id, reason)

    def fold_released(self, cell: CellHandle, errors: dict[int, Any]) -> dict[int, Any]:
        """After ``release_collective``: the ranks that raised first (the root cause), then the released ranks'
        errors (their collective failed as the group was torn down) as RankAbortedError."""
        if not cell.released:
            return errors
        failed = [r for r in errors if r not in cell.released and isinstance(errors[r], RemoteError)]
        raised = getattr(errors[failed[0]], "ename", "an error") if failed else "an error"
        out = {r: errors[r] for r in failed}
        for r, e in errors.items():
            if r in out:
                continue
            if r in cell.released and isinstance(e, RemoteError) and not isinstance(e, RankAbortedError):
                e = RankAbortedError(r, failed, e, raised=raised, collective=cell.released[r])
            out[r] = e
        return out

    def renew_group(self, cell: CellHandle) -> str:
        """Lock not held: after ``release_collective``'s cell ended, a fresh process group for every rank (as
        ``%mesh interrupt --force`` makes one). Returns the hint for the cell's error."""
        them = plural(cell.released, "them", "it")
        dead = self.dead_ranks()
        if dead:  # a rank of the mesh died meanwhile: no group can be made without it (its restart makes one)
            return (f"{cell.collective_released}: the process group was torn down to release {them}; no fresh one "
                    f"was made, since {ranks_text(dead)} {plural(dead, 'are', 'is')} dead")
        try:
            self.regroup([], time.monotonic() + self.state.options.start_timeout)
        except MonarchError as e:
            return (f"{cell.collective_released}: the process group was torn down to release {them}, and a fresh "
                    f"one could not be made ({e}); %mesh restart  starts a fresh mesh")
        return (f"{cell.collective_released}: the process group was torn down to release {them} and a fresh one "
                "was made (every rank kept its namespace)")

    # ------------------------------------------------------------------ interrupts

    def stuck_message(self, stuck: list[int], grace: float) -> str:
        """What to tell the user about ranks that did not stop after an interrupt."""
        try:
            where = self.stacks.ask(stuck, 2.0).summary()
        except MonarchError:
            where = "?"
        still = "is still running" if len(stuck) == 1 else "are still running"
        return (f"{ranks_text(stuck)} did not stop within {grace:g} s and {still} the cell: {where}\n"
                f"{plural(stuck, 'They', 'It')} may be stuck in C code or in a collective with ranks that stopped. "
                f"%mesh interrupt --force --ranks {format_ranks(stuck)}  tears the process group down (releasing "
                f"collectives) and SIGKILLs ranks still stuck; %mesh restart  starts a fresh mesh.\n")

    def interrupt(self, ranks: str | int | Iterable[int] | None, force: bool, grace: float | None) -> InterruptReport:
        """``Mesh.interrupt`` (its docstring says what it does)."""
        state, post = self.state, self.dispatcher.post
        chosen = parse_ranks(ranks, state.nproc)
        grace = state.options.interrupt_grace if grace is None else float(grace)
        report = InterruptReport(grace=grace, world_size=self.state.nproc)
        with state.lock:
            busy: dict[int, int] = {}
            for r in chosen:
                info = state.ranks[r]
                if info.cells and info.state is not RankState.DEAD:
                    busy[r] = info.cells[0].cell_id
                    post(r, P.Interrupt(busy[r]))
                else:
                    report.idle.append(r)
            if force and busy:
                state.group_down = "the process group was torn down by %mesh interrupt --force"
                for info in state.ranks.values():
                    if info.identity is not None and info.state is not RankState.DEAD:
                        post(info.rank, P.Abort(reason="%mesh interrupt --force"))

            def running() -> list[int]:
                return [r for r, cid in busy.items() if state.ranks[r].state is not RankState.DEAD
                        and state.ranks[r].cells and state.ranks[r].cells[0].cell_id == cid]

            deadline = time.monotonic() + grace
            resend = time.monotonic() + RESEND
            while running() and time.monotonic() < deadline:
                state.cond.wait(0.05)
                if time.monotonic() >= resend:  # a SIGINT just before a blocking call waits for its end
                    resend = time.monotonic() + RESEND
                    for r in running():
                        post(r, P.Interrupt(busy[r]))
            stuck = running()
        report.interrupted = [r for r in busy if r not in stuck]
        if stuck:
            try:
                report.stacks = self.stacks.ask(stuck, 2.0).summary()
            except MonarchError:
                report.stacks = ""
        if not force:
            report.stuck = stuck
            return report
        if stuck:
            self.kill_ranks(stuck, "killed by %mesh interrupt --force")
            report.killed = stuck
        elif busy and (dead := self.dead_ranks()):  # no group can be made without them: restarting them makes one
            report.dead = dead
        elif busy:
            self.regroup([], time.monotonic() + state.options.start_timeout)
            report.regrouped = True
        return report

    def dead_ranks(self) -> list[int]:
        """The ranks of the mesh that are dead (a fresh process group needs them restarted first)."""
        with self.state.lock:
            return [r for r, info in self.state.ranks.items() if info.state is RankState.DEAD]

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

    def restart_ranks(self, ranks: str | int | Iterable[int], joined: bool) -> None:
        """Fresh processes for ``ranks``; the others keep their namespaces and join a fresh process group.

        Raises MonarchError when the ranks were started elsewhere (``joined``), other ranks are dead too, or
        survivors do not stop; MeshStartError when a rank fails to join.
        """
        state = self.state
        chosen = parse_ranks(ranks, state.nproc)
        why = state.launcher.restartable(chosen) if joined and state.launcher is not None else ""
        if why:
            raise MonarchError(
                f"{why}, so they cannot be restarted one by one from here. Run  %mesh restart  (a fresh mesh: a "
                "listening one listens again and prints the commands to start it).")
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

    def regroup(self, fresh: list[int], deadline: float) -> None:
        """Start fresh processes for ``fresh`` and have every other rank join a new process group with them.

        Raises MonarchError when a rank that is not in ``fresh`` is dead (it would never join); MeshStartError when
        a rank fails to join before ``deadline`` (then  %mesh restart  is the way).
        """
        state = self.state
        survivors = [r for r in range(state.nproc) if r not in fresh]
        dead = [r for r in self.dead_ranks() if r in survivors]
        if dead:  # they would never join: fail now, not after the start timeout
            raise MonarchError(f"a process group cannot be made while {ranks_text(dead)} "
                               f"{plural(dead, 'are', 'is')} dead: {restart_hint(dead, state.nproc)}")
        with state.lock:
            state.store_port = None
            state.regrouping = set(survivors)
            for r in fresh:
                state.ranks[r] = state.rank_info(r)
                state.killing.pop(r, None)
            for r in survivors:
                info = state.ranks[r]
                info.state = RankState.STARTING
                info.start_error = ""
            if 0 in survivors:  # rank 0 hosts the new store: on loopback, or its address toward us (joined)
                post_regroup(state, self.dispatcher, state.ranks[0], 0, "" if self.lifecycle.joined else "127.0.0.1")
            state.cond.notify_all()
        self.lifecycle.spawn(fresh)
        try:
            self.lifecycle.wait_started(deadline)
        except MeshStartError as e:
            raise MeshStartError(f"{e.args[0]}; run  %mesh restart  for a fresh mesh", e.rank, e.detail) from None
        finally:
            with state.lock:
                state.regrouping = set()
        with state.lock:
            state.group_down = ""
        state.events.emit("regrouped", fresh=fresh)


class RankEvents:
    """What launchers report about ranks (their ``LauncherEvents`` sink): pids, output bytes, exits."""

    def __init__(self, state: MeshState, router: OutputRouter, recovery: Recovery,
                 exit_hooks: list[Callable[[int], None]]) -> None:
        self.state = state
        self.router = router
        self.recovery = recovery
        self.exit_hooks = exit_hooks  # called with the rank, under the lock, when a rank exits

    def on_spawned(self, rank: int, pid: int) -> None:
        with self.state.lock:
            if rank in self.state.ranks:
                self.state.ranks[rank].pid = pid

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        self.router.on_output(rank, stream, data)

    def on_exit(self, rank: int, returncode: int) -> None:
        """``rank``'s process exited (launcher's reader thread): expected when the mesh stops, else a death."""
        state = self.state
        with state.lock:
            info = state.ranks.get(rank)
            if info is None:
                return
            self.router.flush_rank(info)
            for hook in self.exit_hooks:
                hook(rank)
            if info.state is RankState.DEAD:  # declared lost before (no heartbeat): only its status is new
                info.returncode = returncode
                state.killing.pop(rank, None)
                state.cond.notify_all()
                return
            expected = state.stopping
            killed = state.killing.pop(rank, None)
            failed: list[CellHandle] = []
            if expected:
                info.returncode = returncode
                info.state = RankState.STOPPED
                state.failures.pop(rank, None)
                state.cond.notify_all()
            else:
                failed = self.recovery.rank_failed(info, returncode, killed or "")
        if not expected:
            self.recovery.after_death(rank, killed or "", failed, notify=killed is None)
        state.events.emit("rank_state", rank=rank, state=info.state.value, returncode=returncode)
