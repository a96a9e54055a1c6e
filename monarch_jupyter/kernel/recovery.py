"""What the controller does when ranks die, hang or will not stop; mixed into ``Mesh``.

Death
    A local rank's exit reaches the kernel from the fork server within one select() wake-up of its SIGCHLD
    (``Mesh.on_exit``); a rank that stops sending heartbeats for ``heartbeat_timeout`` seconds (a remote rank
    whose host vanished, or any rank that is SIGSTOPped or hung with the GIL held) is declared lost by the I/O
    thread (``_check_heartbeats``) and, where the launcher can, killed. Either way ``_rank_failed`` fails the
    cells it had, and ``_after_death`` interrupts the survivors of those cells and sends every survivor
    ``Abort``: each leaves the broken process group (see monarch_worker.recovery), which releases ranks blocked
    in a collective with the dead one. The cell raises ``MeshError`` as soon as every survivor has stopped, or
    ``RELEASE_GRACE`` seconds after the death; the dead rank's exit status and last output are its root cause.

Recovery
    ``restart(ranks=R)`` (``%mesh restart --rank R``) starts fresh processes for R; every other rank keeps its
    namespace and joins a fresh process group with them (``Regroup``: destroy_process_group, then a new
    TCPStore hosted by rank 0). ``interrupt(force=True)`` tears the process group down on every rank (releasing
    collectives), SIGKILLs the chosen ranks that still do not stop, and re-creates the group when no rank had
    to be killed.
"""

from __future__ import annotations

import logging
import os
import re
import signal
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import monarch_worker
from monarch_worker import protocol as P

from ..errors import (
    MeshStartError,
    MonarchError,
    RankAbortedError,
    RankDiedError,
    RemoteError,
)
from .output import write_lines
from .ranks import parse_ranks
from .stacks import rank_list, summarize

if TYPE_CHECKING:
    from .mesh import CellHandle, Mesh, RankInfo

log = logging.getLogger(__name__)

__all__ = ["RecoveryMixin", "InterruptReport", "RELEASE_GRACE", "EXIT_WAIT", "kept_for_death_report"]

#: Seconds a cell waits for surviving ranks to stop after a rank of it died, before it raises anyway.
RELEASE_GRACE = 1.0
#: Seconds to wait for a killed rank's exit to be reported.
EXIT_WAIT = 5.0
#: Seconds by which a survivor's error may precede the report of a death and still be its consequence: a gloo
#: peer sees the dead rank's connection close at about the moment the fork server sees it exit.
DEATH_SKEW = 0.5


_WORKER_DIR = os.path.dirname(os.path.abspath(monarch_worker.__file__))
_INTERNAL_TRACE = re.compile(r'^\s*File "(?:' + re.escape(_WORKER_DIR) + r'[/\\][^"]*|[^"]*[/\\]monarch_worker[/\\]'
                             r'[^"]*|<frozen runpy>)", line \d+ in ')


def kept_for_death_report(line: str) -> bool:
    """False for lines of a crash dump that only show the rank runtime's own frames (faulthandler prints every
    frame down to the fork server) or its list of extension modules: they would push the user's lines out of
    the last lines kept for the death report."""
    return not (_INTERNAL_TRACE.match(line) or line.startswith("Extension modules: "))


def _ranks_text(ranks: Iterable[int]) -> str:
    rs = sorted(ranks)
    return f"rank{'s' if len(rs) > 1 else ''} {rank_list(rs)}"


def restart_hint(dead: list[int]) -> str:
    """What to run to bring ``dead`` ranks back."""
    spec = rank_list(dead)
    return (f"{_ranks_text(dead)} {'are' if len(dead) > 1 else 'is'} dead and the process group is down: "
            f"%mesh restart --rank {spec}  starts fresh processes for {'them' if len(dead) > 1 else 'it'} "
            "(the other ranks keep their state; mesh.restart(ranks=...)), or  %mesh restart  starts a fresh mesh.")


def where_interrupted(errors: dict[int, Any]) -> str:
    """Ranks grouped by where an interrupt stopped them: "ranks 0,1: time.sleep at cell line 3 / rank 2: ..."."""
    groups: dict[str, list[int]] = {}
    for r, e in sorted(errors.items()):
        frames = getattr(e, "frames", None) or []
        groups.setdefault(summarize([tuple(f) for f in frames]) if frames else "?", []).append(r)
    return " / ".join(f"{_ranks_text(rs)}: {w}" for w, rs in groups.items())


@dataclass
class InterruptReport:
    """Outcome of ``Mesh.interrupt``: rank lists, and ``text`` to show the user."""

    interrupted: list[int] = field(default_factory=list)  # stopped the cell they ran
    stuck: list[int] = field(default_factory=list)  # still running after the grace period
    killed: list[int] = field(default_factory=list)  # SIGKILLed (force)
    idle: list[int] = field(default_factory=list)  # had nothing to interrupt
    regrouped: bool = False  # force: the process group was re-created
    stacks: str = ""  # where the stuck ranks were
    grace: float = 0.0

    @property
    def text(self) -> str:
        out: list[str] = []
        if self.interrupted:
            out.append(f"interrupted {_ranks_text(self.interrupted)}; they keep their state")
        if not (self.interrupted or self.stuck or self.killed):
            out.append(f"nothing to interrupt: {_ranks_text(self.idle)} idle")
        if self.stuck:
            out.append(f"{_ranks_text(self.stuck)} did not stop within {self.grace:g} s: {self.stacks}")
            out.append(f"Force with  %mesh interrupt --force --ranks {rank_list(self.stuck)}  (SIGKILL), or "
                       "%mesh restart  for a fresh mesh.")
        if self.killed:
            out.append(f"killed {_ranks_text(self.killed)} (did not stop within {self.grace:g} s"
                       + (f": {self.stacks}" if self.stacks else "") + ")")
            out.append(restart_hint(self.killed))
        if self.regrouped:
            out.append("the process group was re-created (collectives in flight were abandoned); "
                       "every rank kept its namespace")
        return "\n".join(out)

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


class RecoveryMixin:
    """Fault handling of ``Mesh`` (see the module docstring). Methods with a leading underscore and the note
    "under the lock" run with ``self._cond`` held."""

    # ------------------------------------------------------------------ death and loss

    def _init_recovery(self: Mesh) -> None:
        self._group_down = ""  # why the process group is broken ("" when it is fine)
        self._regrouping: set[int] = set()  # surviving ranks that get Regroup once the new store is up
        self._killing: dict[int, str] = {}  # rank -> why we killed it on purpose

    def _rank_failed(self: Mesh, info: RankInfo, returncode: int | None, reason: str) -> list[CellHandle]:
        """Under the lock: ``info``'s process is gone (or lost); fail the cells it had and return them."""
        info.state = info.state.__class__.DEAD
        info.returncode = returncode
        last = "\n".join(info.last_lines)
        now = time.monotonic()
        failed = []
        for cell in list(info.cells):
            if info.rank not in cell.finished:
                cell.errors.setdefault(info.rank, RankDiedError(info.rank, returncode, last, info.pid, reason))
                if cell._death_at is None:
                    cell._death_at = now
                cell._finish_rank(info.rank)
                failed.append(cell)
        info.cells.clear()
        self._cond.notify_all()
        return failed

    def _after_death(self: Mesh, rank: int, reason: str, cells: list[CellHandle], notify: bool = True) -> None:
        """Any thread, lock not held: interrupt the survivors of ``cells`` (the dead rank's) and tell every
        surviving rank to leave the broken process group. ``notify``: when the rank had no cell, say so in the
        last cell's output (not for ranks killed on purpose)."""
        from .mesh import RankState

        with self._lock:
            if self._stopping:
                return
            dead = [r for r, i in self._ranks.items() if i.state is RankState.DEAD]
            self._group_down = f"{_ranks_text(dead)} died"
            for cell in cells:
                for r in cell.ranks:
                    if r not in cell.finished and self._ranks[r].state is not RankState.DEAD:
                        self._post(self._ranks[r], P.Interrupt(cell.cell_id))
            for info in self._ranks.values():
                if info.identity is not None and info.state not in (RankState.DEAD, RankState.STOPPED):
                    self._post(info, P.Abort(reason=f"rank {rank} died"))
            target = self._last_cell
            rc = self._ranks[rank].returncode
        if not cells and notify and target is not None:
            # Nobody waits on this rank: say so where the user last looked.
            status = str(RankDiedError(rank, rc, reason=reason)).split("] ", 1)[1]
            write_lines([(rank, "stderr", f"{status} while idle. {restart_hint([rank])}")], target.ctx)
        self._event("rank_died", rank=rank, returncode=rc, reason=reason)

    def _check_heartbeats(self: Mesh, now: float) -> None:
        """I/O thread, after it handled every message received: declare lost the ranks silent for
        ``heartbeat_timeout`` seconds, and kill them where the launcher can (a remote one also exits by
        itself once it stops hearing from us)."""
        from .mesh import RankState

        if self.heartbeat_timeout <= 0:
            return
        lost: list[tuple[int, str, list]] = []
        with self._lock:
            if self._stopping or not self._running:
                return
            for info in self._ranks.values():
                if (info.identity is None or info.last_heard <= 0
                        or info.state in (RankState.DEAD, RankState.STOPPED)):
                    continue
                if now - info.last_heard > self.heartbeat_timeout:
                    reason = (f"no heartbeat for {self.heartbeat_timeout:g} s: stopped, hung with the GIL held, "
                              "or its host is unreachable")
                    lost.append((info.rank, reason, self._rank_failed(info, None, reason)))
        for rank, reason, cells in lost:
            log.info("rank %d: %s; declared dead", rank, reason)
            self._event("rank_state", rank=rank, state="dead", returncode=None)
            if self._launcher is not None:
                self._launcher.signal(rank, signal.SIGKILL)
            self._after_death(rank, reason, cells, notify=True)

    def _fold_errors(self: Mesh, cell: CellHandle, errors: dict[int, Any]) -> tuple[dict[int, Any], str]:
        """When ranks of ``cell`` died: deaths first (the root cause), and errors of survivors that stopped
        because of them (reported after, or ``DEATH_SKEW`` s before, the first death) become RankAbortedError.
        Returns (errors, hint)."""
        dead = [r for r, e in errors.items() if isinstance(e, RankDiedError)]
        if not dead or cell._death_at is None:
            return errors, ""
        out: dict[int, Any] = {r: errors[r] for r in dead}
        for r, e in errors.items():
            if r in out:
                continue
            if isinstance(e, RemoteError) and cell._result_seen_at.get(r, 0.0) >= cell._death_at - DEATH_SKEW:
                e = RankAbortedError(r, dead, e)
            out[r] = e
        return out, restart_hint(dead) if self._running else ""

    def _release_survivors(self: Mesh, cell: CellHandle, now: float) -> None:
        """Under the lock: ``RELEASE_GRACE`` after a death, give up on survivors that did not stop."""
        if cell._death_at is None or cell._all_done or now - cell._death_at <= RELEASE_GRACE:
            return
        dead = [r for r, e in cell.errors.items() if isinstance(e, RankDiedError)]
        for r in cell.ranks:
            if r not in cell.finished:
                cell.errors[r] = RankAbortedError(r, dead, None, still_running=True)
                cell._finish_rank(r)

    # ------------------------------------------------------------------ interrupts

    def _stuck_message(self: Mesh, stuck: list[int], grace: float) -> str:
        """What to tell the user about ranks that did not stop after an interrupt."""
        try:
            where = self.stacks(stuck, timeout=2.0).summary()
        except MonarchError:
            where = "?"
        still = "is still running" if len(stuck) == 1 else "are still running"
        return (f"{_ranks_text(stuck)} did not stop within {grace:g} s and {still} the cell: {where}\n"
                f"They may be stuck in C code or in a collective with ranks that stopped. "
                f"%mesh interrupt --force --ranks {rank_list(stuck)}  tears the process group down (releasing "
                f"collectives) and SIGKILLs ranks still stuck; %mesh restart  starts a fresh mesh.\n")

    def interrupt(self: Mesh, ranks: str | int | Iterable[int] | None = None, *, force: bool = False,
                  grace: float | None = None) -> InterruptReport:
        """Interrupt what the chosen ranks run now: KeyboardInterrupt in their main thread; they keep their state.

        Parameters
        ----------
        ranks:
            Rank selection (default: all).
        force:
            Also tear the process group down on every rank (releases ranks blocked in a collective), SIGKILL
            the chosen ranks that still run after ``grace``, and re-create the process group when none had
            to be killed (otherwise bring the killed ranks back with ``restart(ranks=...)``).
        grace:
            Seconds the ranks get to stop (default: the mesh's ``interrupt_grace``).

        Returns an InterruptReport (its ``text`` says what happened and what to do next).

        Raises
        ------
        MeshNotRunningError
            The mesh is not running.
        ValueError
            Bad rank selection.
        """
        from .mesh import INTERRUPT_RESEND, RankState

        self._check_running()
        chosen = parse_ranks(ranks, self.nproc)
        grace = self.interrupt_grace if grace is None else float(grace)
        report = InterruptReport(grace=grace)
        with self._lock:
            busy: dict[int, int] = {}
            for r in chosen:
                info = self._ranks[r]
                if info.cells and info.state is not RankState.DEAD:
                    busy[r] = info.cells[0].cell_id
                    self._post(info, P.Interrupt(busy[r]))
                else:
                    report.idle.append(r)
            if force and busy:
                self._group_down = "the process group was torn down by %mesh interrupt --force"
                for info in self._ranks.values():
                    if info.identity is not None and info.state is not RankState.DEAD:
                        self._post(info, P.Abort(reason="%mesh interrupt --force"))

            def running() -> list[int]:
                return [r for r, cid in busy.items() if self._ranks[r].state is not RankState.DEAD
                        and self._ranks[r].cells and self._ranks[r].cells[0].cell_id == cid]

            deadline = time.monotonic() + grace
            resend = time.monotonic() + INTERRUPT_RESEND
            while running() and time.monotonic() < deadline:
                self._cond.wait(0.05)
                if time.monotonic() >= resend:  # a SIGINT just before a blocking call waits for its end
                    resend = time.monotonic() + INTERRUPT_RESEND
                    for r in running():
                        self._post(self._ranks[r], P.Interrupt(busy[r]))
            stuck = running()
        report.interrupted = [r for r in busy if r not in stuck]
        if stuck:
            try:
                report.stacks = self.stacks(stuck, timeout=2.0).summary()
            except MonarchError:
                report.stacks = ""
        if not force:
            report.stuck = stuck
            return report
        if stuck:
            self._kill_ranks(stuck, "killed by %mesh interrupt --force")
            report.killed = stuck
        elif busy:
            self._regroup([], time.monotonic() + self.start_timeout)
            report.regrouped = True
        return report

    def _kill_ranks(self: Mesh, ranks: list[int], why: str) -> None:
        """SIGKILL ``ranks`` and wait (``EXIT_WAIT`` s) until their exits are reported (a remote rank that is
        gone for good never reports: the wait just ends)."""
        from .mesh import RankState

        with self._lock:
            for r in ranks:
                self._killing[r] = why
        for r in ranks:
            if self._launcher is not None:
                self._launcher.signal(r, signal.SIGKILL)
        deadline = time.monotonic() + EXIT_WAIT
        with self._lock:
            while time.monotonic() < deadline and not all(
                    self._ranks[r].state is RankState.DEAD and self._ranks[r].returncode is not None for r in ranks):
                self._cond.wait(0.05)

    # ------------------------------------------------------------------ restart of some ranks

    def _restart_ranks(self: Mesh, ranks: str | int | Iterable[int]) -> Mesh:
        """Fresh processes for ``ranks``; the others keep their namespaces and join a fresh process group."""
        from .mesh import RankState

        self._check_running()
        chosen = parse_ranks(ranks, self.nproc)
        if self._listener is not None:
            raise MonarchError(
                "these ranks were started elsewhere (torchrun, srun, a command you ran): that launcher owns their "
                "processes, so they cannot be restarted one by one from here. Run  %mesh restart  (the mesh "
                "listens again and prints the commands to start the ranks).")
        with self._lock:
            others_dead = [r for r, i in self._ranks.items() if r not in chosen and i.state is RankState.DEAD]
        if others_dead:
            raise MonarchError(
                f"{_ranks_text(others_dead)} {'are' if len(others_dead) > 1 else 'is'} dead too; restart them "
                f"together:  %mesh restart --rank {rank_list(sorted(set(chosen) | set(others_dead)))}")
        survivors = [r for r in range(self.nproc) if r not in chosen]
        with self._lock:
            busy = [r for r in survivors if self._ranks[r].cells]
        if busy:
            report = self.interrupt(busy)
            if report.stuck:
                raise MonarchError(
                    f"{_ranks_text(report.stuck)} still run a cell and did not stop within "
                    f"{self.interrupt_grace:g} s ({report.stacks}); a process group cannot be re-created around "
                    f"them. Stop them with  %mesh interrupt --force --ranks {rank_list(report.stuck)}  and "
                    f"restart them too, or run  %mesh restart  for a fresh mesh.")
        with self._lock:  # every chosen rank whose exit was not reported yet (alive, or lost by heartbeat)
            live = [r for r in chosen
                    if self._ranks[r].state is not RankState.DEAD or self._ranks[r].returncode is None]
        # Its exit must be in before a fresh process takes its place, or the report would hit the new one.
        self._kill_ranks(live, "killed by %mesh restart --rank")
        self._regroup(chosen, time.monotonic() + self.start_timeout)
        return self

    def _regroup(self: Mesh, fresh: list[int], deadline: float) -> None:
        """Start fresh processes for ``fresh`` and have every other rank join a new process group with them.

        Raises MeshStartError when a rank fails to join before ``deadline`` (then  %mesh restart  is the way).
        """
        from .mesh import RankInfo, RankState

        survivors = [r for r in range(self.nproc) if r not in fresh]
        with self._lock:
            self._store_port = None
            self._regrouping = set(survivors)
            for r in fresh:
                self._ranks[r] = RankInfo(r)
                self._killing.pop(r, None)
            for r in survivors:
                info = self._ranks[r]
                info.state = RankState.STARTING
                info.start_error = ""
            if 0 in survivors:  # rank 0 hosts the new store: on loopback, or its address toward us (joined)
                self._post_regroup(self._ranks[0], 0, "127.0.0.1" if self._listener is None else "")
            self._cond.notify_all()
        env = self._rank_env()
        for r in fresh:
            self._launcher.start(r, env, self._rank_config(r), self)
        try:
            self._wait_started(deadline)
        except MeshStartError as e:
            raise MeshStartError(f"{e.args[0]}; run  %mesh restart  for a fresh mesh", e.rank, e.detail) from None
        finally:
            with self._lock:
                self._regrouping = set()
        with self._lock:
            self._group_down = ""
        self._event("regrouped", fresh=fresh)

    def _post_regroup(self: Mesh, info: RankInfo, port: int, addr: str) -> None:
        """Any thread: tell surviving rank ``info`` to join the new process group (store at ``addr:port``;
        port 0: host it). Each rank keeps its own local rank."""
        self._post(info, P.Regroup(rank=info.rank, world_size=self.nproc, local_rank=-1, local_world_size=-1,
                                   master_addr=addr, master_port=port, backend=info.backend or self.backend))

    def _regroup_store_ready(self: Mesh, msg: P.StoreReady) -> None:
        """I/O thread, during a regroup: rank 0's new store is up; survivors regroup, fresh ranks are welcomed."""
        addr = msg.addr or "127.0.0.1"
        with self._lock:
            self._store_port = msg.port
            for info in self._ranks.values():
                if info.rank == 0 or info.identity is None:
                    continue
                if info.rank in self._regrouping:
                    self._post_regroup(info, msg.port, addr)
                else:
                    self._welcome(info, msg.port)

    def _note_group_down(self: Mesh, ranks: list[int]) -> None:
        """Before a cell runs on survivors while the process group is broken: say that collectives fail."""
        if self._group_down:
            sys.stderr.write(f"note: the process group is down ({self._group_down}): collectives fail until "
                             "%mesh restart --rank R  (or  %mesh restart)\n")
