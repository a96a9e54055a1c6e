"""When ranks die or are lost: ``Deaths`` (what the controller does about it) and ``RankEvents`` (what launchers
report: pids, output bytes, exits).

A local rank's exit reaches the kernel from the fork server within one select() wake-up of its SIGCHLD
(``RankEvents.on_exit``); a rank that stops sending heartbeats for ``heartbeat_timeout`` seconds (a remote rank whose
host vanished, or any rank that is SIGSTOPped or hung with the GIL held) is declared lost by the I/O thread
(``check_heartbeats``) and, where the launcher can, killed. Either way ``rank_failed`` fails the cells it had, and
``after_death`` interrupts the survivors of those cells and sends every survivor ``Abort``: each leaves the broken
process group (see monarch_worker.recovery), which releases ranks blocked in a collective with the dead one. The cell
raises ``MeshError`` as soon as every survivor has stopped, or ``RELEASE_GRACE`` seconds after the death; the dead
rank's exit status and last output are its root cause (``fold_errors``).
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from monarch_worker import protocol as P

from ..errors import RankAbortedError, RankDiedError, RemoteError
from ..ranks import ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .hints import heal_hint, restart_hint
from .interrupts import Interrupter
from .output import OutputWriter
from .records import CellRecord
from .routing import OutputRouter
from .state import MeshState, RankInfo, RankState

log = logging.getLogger(__name__)

__all__ = ["Deaths", "RankEvents", "RELEASE_GRACE", "DEATH_SKEW"]

#: Seconds a cell waits for surviving ranks to stop after a rank of it died, before it raises anyway.
RELEASE_GRACE = 1.0
#: Seconds by which a survivor's error may precede the report of a death and still be its consequence: a gloo
#: peer sees the dead rank's connection close at about the moment the fork server sees it exit.
DEATH_SKEW = 0.5


class Deaths:
    """Deaths and losses of one mesh's ranks (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable, interrupter: Interrupter,
                 writer: OutputWriter, heal: Callable[[int], None], admit: Callable[[int, float], str]) -> None:
        """``heal``: takes a rank that died by itself when ``on_rank_death`` is "restart" (healing.DeathQueue.put);
        ``admit``: under the lock, as such a rank dies, "" when it is to be restarted, else why not
        (healing.DeathQueue.admit)."""
        self.state = state
        self.dispatcher = dispatcher
        self.cells = cells
        self.interrupter = interrupter
        self.writer = writer
        self.heal = heal
        self.admit = admit
        self.given_up: dict[int, str] = {}  # rank -> why it is not restarted, since its last death (lock held)

    def heals(self, natural: bool) -> bool:
        """A death (``natural``: not the controller's doing) is healed: on_rank_death is "restart"."""
        return natural and self.state.options.on_rank_death == "restart"

    def rank_failed(self, info: RankInfo, returncode: int | None, reason: str,
                    natural: bool = False) -> list[CellRecord]:
        """Under the lock: ``info``'s process is gone (or lost); fail the cells it had and return them. A cell its
        replacement rejoins (``--rejoin``, when the death is ``natural`` and healed) is not failed: it waits for
        the replacement."""
        self.state.assert_locked()
        now = time.monotonic()
        self.given_up.pop(info.rank, None)
        heals = self.heals(natural)
        given_up = False
        if heals:  # decided before anything reports the death, so no report says "restarted" of a rank given up
            why_not = self.admit(info.rank, now)
            if why_not:
                self.given_up[info.rank] = why_not
                heals, given_up = False, True
                if info.rank in self.state.healing:  # a replacement that died while it healed: cells that wait
                    self.state.healing.discard(info.rank)  # for it (a --rejoin cell it left) fail now
                    for rec in list(self.state.cells.values()):
                        if info.rank in rec.left:
                            self.cells.rank_died(rec, info.rank, RankDiedError(info.rank, returncode,
                                                                               reason="not restarted"), now)
            else:  # before a caller its cells fail wakes: the cell it runs next waits for the healing
                self.state.healing.add(info.rank)
        info.state = RankState.DEAD
        info.returncode = returncode
        info.death_reason = reason
        self.state.failures.pop(info.rank, None)  # its kept traceback died with it
        failed = []
        for rec in list(info.cells):
            if (heals or given_up) and rec.rejoin is not None and info.rank not in rec.finished and not rec.interrupted:
                if heals:
                    self.cells.rank_left(rec, info.rank)  # its replacement rejoins it (healing.py)
                else:  # not failed: the survivors go on without it (a torchft loop needs no peer to go on)
                    self.cells.rank_died(rec, info.rank, RankDiedError(info.rank, returncode, reason="not restarted"),
                                         now)
            elif info.rank not in rec.finished:
                last, earlier = info.last_output(rec.cell_id)
                self.cells.rank_died(rec, info.rank,
                                     RankDiedError(info.rank, returncode, last, info.pid, reason, earlier), now)
                failed.append(rec)
        self.state.cond.notify_all()  # each of its cells has it finished, or left (info.cells is empty now)
        return failed

    def after_death(self, rank: int, reason: str, cells: list[CellRecord], notify: bool = True) -> None:
        """Interrupt the survivors of ``cells`` (the dead rank's) and tell every surviving rank to
        leave the broken process group. ``notify``: when the rank had no cell, say so in the last cell's output
        (not for ranks killed on purpose)."""
        self.state.assert_unlocked()
        state, post = self.state, self.dispatcher.post
        with state.lock:
            if state.stopping:
                return
            if rank in state.growing:  # a new rank of a scale, in no group yet: the scale reports it (resize.py)
                state.cond.notify_all()
                return
            group = state.group_of(rank)  # its process group (split: its sub-mesh's) is down, no other
            dead = [r for r in group if state.ranks[r].state is RankState.DEAD]
            state.mark_down(group, f"{ranks_text(dead)} died")
            targets = {r: rec.cell_id for rec in cells for r in rec.ranks
                       if r not in rec.finished and state.ranks[r].state is not RankState.DEAD}
            alive = [info.rank for info in state.ranks.values() if info.identity is not None and info.alive
                     and info.rank in state.group_of(rank)]  # its process group (split: its sub-mesh's)
            target = state.last_cell
            rc = state.ranks[rank].returncode
            given_up = self.given_up.get(rank, "") if notify else ""
        self.interrupter.send(targets)
        for r in alive:
            post(r, P.Abort(reason=f"rank {rank} died"))
        if self.heals(notify) and not given_up:
            self.heal(rank)  # the healer restarts it and says so (healing.py)
        elif given_up and not any(rec.tracks_failures for rec in cells):
            # No cell of the user's reports it (idle, or a replacement that died while it got its replay back).
            self.writer.put([(rank, "stderr", given_up)], target.ctx if target is not None else None)
        elif not cells and notify and target is not None:
            # Nobody waits on this rank: say so where the user last looked.
            status = str(RankDiedError(rank, rc, reason=reason)).split("] ", 1)[1]
            alone = state.launcher.restartable([rank]) if state.launcher is not None else ""
            hint = (f"It cannot be restarted alone ({alone}):  %mesh restart  starts a fresh mesh." if alone
                    else restart_hint([rank], state.nproc))
            self.writer.put([(rank, "stderr", f"{status} while idle. {hint}")], target.ctx)
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
            # the cheap test first: ``alive`` reads the cells in flight
            silent = [info.rank for info in state.ranks.values() if now - info.last_heard > window
                      and info.last_heard > 0 and info.identity is not None and info.alive]
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
                    lost.append((r, reason, self.rank_failed(info, None, reason, natural=True)))
        for rank, reason, cells in lost:
            log.info("rank %d: %s; declared dead", rank, reason)
            state.events.emit("rank_state", rank=rank, state="dead", returncode=None)
            if state.launcher is not None:
                state.launcher.signal(rank, signal.SIGKILL)
            self.after_death(rank, reason, cells, notify=True)

    def release_survivors(self, rec: CellRecord, now: float) -> None:
        """Under the lock: ``RELEASE_GRACE`` after a death, give up on survivors that did not stop."""
        self.state.assert_locked()
        if rec.death_at is None or rec.all_done or now - rec.death_at <= RELEASE_GRACE:
            return
        dead = [r for r, e in rec.errors.items() if isinstance(e, RankDiedError)]
        for r in rec.ranks:
            if r not in rec.finished:
                self.cells.fail_rank(rec, r, RankAbortedError(r, dead, None, still_running=True))

    def fold_errors(self, rec: CellRecord, errors: dict[int, Any]) -> tuple[dict[int, Any], str]:
        """When ranks of ``rec`` died: errors that came before the first death and are not its consequence (more
        than ``DEATH_SKEW`` s before it, or the raising ranks that a release tore the group down for) stay first,
        then the deaths (the root cause when nothing came before), and errors of survivors that stopped because of
        them (reported after, or ``DEATH_SKEW`` s before, the first death) become RankAbortedError. Returns
        (errors, hint)."""
        dead = [r for r, e in errors.items() if isinstance(e, RankDiedError)]
        death_at = rec.death_at
        if not dead or death_at is None:
            return errors, ""

        def before(r: int, e: Any) -> bool:
            seen = rec.result_seen_at.get(r, death_at)
            if rec.collective_released and r not in rec.released and isinstance(e, RemoteError):
                return seen <= death_at  # it raised; the release (and what followed) came of it
            return isinstance(e, RemoteError) and seen < death_at - DEATH_SKEW

        out: dict[int, Any] = {r: e for r, e in errors.items() if before(r, e)}
        out.update((r, errors[r]) for r in dead)
        for r, e in errors.items():
            if r in out:
                continue
            if isinstance(e, RemoteError) and rec.result_seen_at.get(r, 0.0) >= death_at - DEATH_SKEW:
                e = RankAbortedError(r, dead, e)
            out[r] = e
        if not self.state.running:
            return out, ""
        given_up = [self.given_up[r] for r in dead if r in self.given_up]
        if given_up:  # on_rank_death="restart", past restart_limit (or not restartable): the error says so
            return out, " ".join(given_up)
        healing = self.state.options.on_rank_death == "restart" and set(dead) <= set(self.state.healing)
        return out, heal_hint(dead) if healing else restart_hint(dead, self.state.nproc)


class RankEvents:
    """What launchers report about ranks (their ``LauncherEvents`` sink): pids, output bytes, exits."""

    def __init__(self, state: MeshState, router: OutputRouter, deaths: Deaths,
                 exit_hooks: list[Callable[[int], None]]) -> None:
        self.state = state
        self.router = router
        self.deaths = deaths
        self.exit_hooks = exit_hooks  # called with the rank when a rank exits (launcher's thread, no lock held)

    def on_spawned(self, rank: int, pid: int) -> None:
        with self.state.lock:
            if rank in self.state.ranks:
                self.state.ranks[rank].pid = pid

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        self.router.on_output(rank, stream, data)

    def on_exit(self, rank: int, returncode: int, cause: str = "") -> None:
        """``rank``'s process exited (launcher's reader thread): expected when the mesh stops, else a death;
        ``cause``: what the launcher knows of why (its fork server died), said with the exit status."""
        state = self.state
        self.router.flush_rank(rank)  # its last lines written without a newline, first
        for hook in self.exit_hooks:
            hook(rank)
        with state.lock:
            info = state.ranks.get(rank)
            if info is None:
                return
            if info.state is RankState.DEAD:  # declared lost before (no heartbeat): only its status is new
                info.returncode = returncode
                state.killing.pop(rank, None)
                state.cond.notify_all()
                return
            expected = state.stopping
            killed = state.killing.pop(rank, None)
            failed: list[CellRecord] = []
            if expected:
                info.returncode = returncode
                info.state = RankState.STOPPED
                state.failures.pop(rank, None)
                state.cond.notify_all()
            else:
                failed = self.deaths.rank_failed(info, returncode, killed or cause, natural=killed is None)
        if not expected:
            self.deaths.after_death(rank, killed or cause, failed, notify=killed is None)
        state.events.emit("rank_state", rank=rank, state=info.state.value, returncode=returncode)
