"""A mesh that heals itself (``on_rank_death="restart"``): ``DeathQueue`` (deaths to heal) and ``Healer``.

When a rank dies by itself (not killed by the controller), deaths.py fails its cells as always (the survivors are
interrupted and leave the broken process group), except the cells marked ``--rejoin``, which wait for the rank's
replacement, and puts the rank in the ``DeathQueue``. The healer's thread (``monarch-heal``) then, for every rank
that died (several deaths close together are healed at once):

1. takes only the deaths ``DeathQueue.admit`` admitted as the rank died: a rank that died more than
   ``restart_limit`` times within ``restart_window`` seconds, or whose launcher cannot start it again (ranks that
   joined one process per rank), is given up there, and the cell that saw the death says so in its error (the
   decision is taken before anything reports the death, so no report says "restarted" of a rank given up);
2. waits until the survivors have stopped the cells that failed (``interrupt_grace`` plus a second at most);
3. starts a fresh process for it through the launcher that started it (the local fork server, or its host agent);
   while another rank of its group stays dead (given up in 1.), the replacement starts without a process group
   and gets back what the notebook had sent: cells that use no collective run on it, and  %mesh restart --rank R
   of the dead rank makes the group of every rank;
4. when no survivor runs a cell: makes a fresh process group of every rank (recovery.Restarts.regroup, as
   ``%mesh restart --rank R``), then sends the replacement what the notebook had sent (history.py); on a split
   mesh (submesh.py) only the dead rank's sub-mesh regroups: its replacement starts without a group, then joins
   its sub-mesh's fresh one, numbered inside it, while the other sub-meshes go on running;
   when survivors run a ``--rejoin`` cell (a torchft loop goes on without the dead rank): the replacement joins no
   process group yet (``protocol.NO_GROUP``), gets what the notebook had sent and the running cell, which it
   rejoins (torchft heals it from a live peer), and the process group is made once those cells have ended;
5. writes one line to the notebook saying what happened (hints.healed_note).

While a rank heals, cells, calls and transfers that include it wait (waiting.Waiter), with a note. A replacement that
dies while it heals is one more death of that rank: it is healed again, within the same limit.

Threads: ``DeathQueue.put`` from the thread that saw the death (the fork server's reader, the I/O thread); the
healing on ``monarch-heal``, which holds no lock while it waits, sends or writes. That thread is started by a death
and ends once no death came for ``SERVE_IDLE`` seconds: a mesh that loses no rank, or has stopped, keeps none.
"""

from __future__ import annotations

import collections
import contextvars
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

from monarch_worker import protocol as P
from monarch_worker.serialize import dumps

from ..errors import MeshError, MonarchError, RankDiedError, describe_returncode
from ..ranks import ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .hints import give_up_note, heal_failed_note, healed_note, not_restartable_note, replay_failed_note
from .history import History, Replay
from .lifecycle import Lifecycle
from .output import OutputWriter
from .records import CellRecord
from .recovery import Restarts
from .state import MeshState, RankState

log = logging.getLogger(__name__)

__all__ = ["DeathQueue", "Healer", "SETTLE", "SERVE_IDLE", "REPLAY_TIMEOUT"]

#: Seconds the healer waits after a death for more (two deaths at once are healed together).
SETTLE = 0.1
#: Seconds the healer's thread waits for another death before it ends (the next death starts a new one).
SERVE_IDLE = 5.0
#: Seconds one replayed item (a cell, a push, a hook) may take on the replacement before it is reported as failed.
REPLAY_TIMEOUT = 300.0


class DeathQueue:
    """Ranks that died by themselves under on_rank_death="restart", for the healer (made before deaths.py, which
    puts them; read by the healer's thread)."""

    def __init__(self, state: MeshState) -> None:
        self.state = state
        self.cond = threading.Condition()
        self.pending: list[tuple[int, float]] = []  # (rank, time.monotonic() of the death)
        self.deaths: dict[int, collections.deque[float]] = {}  # rank -> times it died (the mesh lock guards it)
        self.healer: weakref.ref | None = None  # the Healer, for the thread that ``put`` starts
        self._thread: threading.Thread | None = None  # the healer's thread while deaths come (under ``cond``)

    def admit(self, rank: int, when: float) -> str:
        """Under the mesh lock, as ``rank`` dies by itself at ``when`` (time.monotonic()): "" when it is to be
        restarted, else why not (hints.give_up_note: past ``restart_limit`` deaths within ``restart_window``
        seconds; hints.not_restartable_note: its launcher cannot start it again)."""
        self.state.assert_locked()
        options, launcher = self.state.options, self.state.launcher
        why = launcher.restartable([rank]) if launcher is not None else ""
        if why:
            return not_restartable_note([rank], why)
        times = self.deaths.setdefault(rank, collections.deque())
        times.append(when)
        while times and when - times[0] > options.restart_window:
            times.popleft()
        if len(times) > options.restart_limit:
            count = len(times)
            times.clear()
            return give_up_note(rank, count, options.restart_limit, options.restart_window)
        return ""

    def put(self, rank: int) -> None:
        """``rank`` died (any thread, the mesh lock not held): cells that need it wait until it heals."""
        with self.state.lock:
            self.state.healing.add(rank)
        with self.cond:
            self.pending.append((rank, time.monotonic()))
            self.cond.notify_all()
            if self._thread is None and self.healer is not None:  # none runs: a mesh that loses no rank has none
                self._thread = threading.Thread(target=_serve, args=(self.healer, self), name="monarch-heal",
                                                daemon=True)
                self._thread.start()

    def take(self, timeout: float) -> list[tuple[int, float]]:
        """The deaths queued so far, waiting up to ``timeout`` seconds for the first."""
        with self.cond:
            if not self.pending:
                self.cond.wait(timeout)
            taken, self.pending = self.pending, []
            return taken

    @property
    def serving(self) -> bool:
        """Whether the healer's thread runs now (a death started it; it ends ``SERVE_IDLE`` s after the last)."""
        with self.cond:
            return self._thread is not None

    def next_deaths(self, idle: float) -> list[tuple[int, float]] | None:
        """The healer's thread: the deaths queued, waiting up to ``idle`` seconds for the first; None when none
        came: the thread ends (decided under ``cond``, so the next ``put`` starts another)."""
        with self.cond:
            if not self.pending:
                self.cond.wait(idle)
            if not self.pending:
                self._thread = None
                return None
            taken, self.pending = self.pending, []
            return taken


class Healer:
    """Restarts the ranks that die by themselves (see the module docstring).

    Parameters
    ----------
    replay_push:
        Binds values on one rank: (values, rank, device) -> None (transfer.Transfers.push); raises as a push does.
    """

    def __init__(self, state: MeshState, queue: DeathQueue, cells: CellTable, dispatcher: Dispatcher,
                 restarts: Restarts, lifecycle: Lifecycle, history: History, writer: OutputWriter,
                 submit: Callable[..., Any], replay_push: Callable[[dict[str, Any], int, str | None], None]) -> None:
        self.state = state
        self.queue = queue
        self.cells = cells
        self.dispatcher = dispatcher
        self.restarts = restarts
        self.lifecycle = lifecycle
        self.history = history
        self.writer = writer
        self.submit = submit  # waiting.Waiter.submit
        self.replay_push = replay_push
        self.healed = 0  # ranks restarted so far
        self.last_seconds = 0.0  # seconds from the death to the replacement's Ready, last time
        queue.healer = weakref.ref(self)  # the queue starts the healer's thread at a death (``_serve``)

    # ------------------------------------------------------------------ the healer's thread

    def heal(self, deaths: list[tuple[int, float]]) -> None:
        """Heal the ranks of ``deaths`` (rank, when), and any that die meanwhile (healer thread)."""
        state = self.state
        time.sleep(SETTLE)  # two deaths at once are healed together
        deaths += self.queue.take(0)
        with state.lock:
            state.healer = threading.current_thread()
            ctx = (state.last_cell.ctx if state.last_cell is not None else contextvars.copy_context()).copy()
        try:
            ctx.run(self._heal, deaths)  # its lines land in the cell the user last ran, as the rank's own would
        except Exception as e:  # noqa: BLE001 - the healer's thread must go on; the ranks stay dead
            log.exception("healing failed")
            ranks = sorted({r for r, _ in deaths})
            self._give_up(ranks, heal_failed_note(ranks, str(e), state.nproc))
        finally:
            with state.lock:
                state.healer = None

    def _heal(self, deaths: list[tuple[int, float]]) -> None:
        state = self.state
        with state.lock:
            if not state.running or state.stopping:
                state.healing.clear()
                return
        first = min(t for _, t in deaths)
        ranks = sorted({r for r, _ in deaths})  # DeathQueue.admit let them through as they died
        why = state.launcher.restartable(ranks) if state.launcher is not None else "the mesh is not running"
        if why:
            self._give_up(ranks, not_restartable_note(ranks, why))
            return
        with state.lock:
            lost = [r for r in ranks if state.ranks[r].returncode is None]  # lost by heartbeat: its exit is due
            why_dead = "; ".join(sorted({_death(state.ranks[r]) for r in ranks}))
        if lost:
            self.restarts.kill_ranks(lost, "lost; killed before its restart")
        if not self._survivors_stopped(ranks):
            return
        rejoining = self._rejoining(ranks)
        with state.lock:  # survivors that run a cell (a --rejoin one, or any other): no group can be made now
            group = state.peers(ranks) if state.partition else None  # split: only the dead ranks' sub-meshes
            alone = any(i.cells for i in state.ranks.values()
                        if i.rank not in ranks and (group is None or i.rank in group))
            # Ranks given up earlier (past restart_limit) stay dead: no group can be made with them until the user
            # restarts them, so the replacements start without one (a cell then waited forever for a regroup).
            blocked = [i.rank for i in state.ranks.values() if i.state is RankState.DEAD
                       and i.rank not in state.healing and (group is None or i.rank in group)]
            before = {r: state.ranks[r] for r in ranks}
        deadline = time.monotonic() + state.options.start_timeout
        try:
            if alone or blocked:
                self.start_alone(ranks, deadline)
            elif group is not None:  # the replacement starts alone, then its sub-mesh regroups (the others run on)
                self.start_alone(ranks, deadline)
                self.restarts.regroup([], deadline, group)
            else:
                self.restarts.regroup(ranks, deadline)
        except MonarchError as e:
            with state.lock:  # a replacement that died is queued again; one never started is given up here
                again = [r for r in ranks if state.ranks[r].state is RankState.DEAD and state.ranks[r] is not before[r]]
            if not again:  # its replacement failed to join, or none was started: nobody else reports it
                self._give_up(ranks, heal_failed_note(ranks, str(e), state.nproc))
            return  # a replacement that died is queued again: healed within the same limit
        self.last_seconds = time.monotonic() - first
        sent = self.replay(ranks)
        rejoined = self.rejoin(ranks, rejoining)
        with state.lock:
            if any(state.ranks[r].state is RankState.DEAD for r in ranks):
                return  # it died while it got back what it had: that death is healed next, within the limit
            if not alone or blocked:
                state.healing -= set(ranks)
                state.cond.notify_all()
        self.healed += len(ranks)
        note = healed_note(ranks, why_dead, self.last_seconds, sent, rejoined, not alone, blocked, group is not None)
        with state.lock:
            state.healed_note = note
        self._say(note, ranks)
        state.events.emit("healed", ranks=ranks, seconds=self.last_seconds, rejoined=rejoined)
        if alone and not blocked:
            self.regroup_when_idle(ranks, group)

    def _give_up(self, ranks: list[int], text: str) -> None:
        """``ranks`` stay dead: cells that waited for them run (and fail), ``text`` says why."""
        state = self.state
        with state.lock:
            state.healing -= set(ranks)
            for rec in list(state.cells.values()):
                for r in ranks:
                    if r in rec.left:
                        self.cells.rank_died(rec, r, RankDiedError(r, state.ranks[r].returncode,
                                                                   reason="not restarted"),
                                             time.monotonic())
            state.cond.notify_all()
        self._say(text, ranks)

    def _say(self, text: str, ranks: list[int]) -> None:
        """One line to the notebook, as ``ranks``' first (in the cell the user last ran)."""
        with self.state.lock:
            ctx = self.state.last_cell.ctx if self.state.last_cell is not None else None
        self.writer.put([(ranks[0] if len(ranks) == 1 else tuple(ranks), "stderr", text)], ctx)

    def _survivors_stopped(self, ranks: list[int]) -> bool:
        """Wait until no survivor runs a cell that failed with the death of ``ranks`` (``interrupt_grace`` + 1 s at
        most); False (given up, with a message) when some still do."""
        state = self.state
        dead = set(ranks)
        deadline = time.monotonic() + state.options.interrupt_grace + 1.0
        with state.lock:
            while True:
                busy = [i.rank for i in state.ranks.values() if i.rank not in dead and i.alive
                        and any(set(rec.ranks) & dead and not (rec.left & dead) for rec in i.cells)]
                if not busy or time.monotonic() > deadline or not state.running:
                    break
                state.cond.wait(0.05)
            running = state.running
        if busy:
            self._give_up(ranks, heal_failed_note(ranks, f"{ranks_text(busy)} still run the cell that failed and "
                                                         "did not stop, so no process group can be made with them",
                                                  state.nproc))
        return not busy and running

    def _rejoining(self, ranks: list[int]) -> list[CellRecord]:
        """The ``--rejoin`` cells ``ranks`` left, which the survivors still run."""
        with self.state.lock:
            return [rec for rec in self.state.cells.values() if rec.left & set(ranks) and not rec.all_done]

    def start_alone(self, ranks: list[int], deadline: float) -> None:
        """Start replacements for ``ranks`` without a process group (the others run a cell they rejoin) and wait
        until each is ready. Raises MonarchError when one fails to start."""
        state = self.state
        with state.lock:
            for r in ranks:
                state.ranks[r] = state.rank_info(r)
                state.killing.pop(r, None)
                state.solo.add(r)
        try:
            self.lifecycle.spawn(ranks)
            with state.lock:
                while True:
                    infos = [state.ranks[r] for r in ranks]
                    failed = [i for i in infos if i.start_error or i.state is RankState.DEAD]
                    if failed:
                        raise MonarchError(f"its replacement {'failed to join' if failed[0].start_error else 'died'}"
                                           f" ({failed[0].start_error or describe_returncode(failed[0].returncode)})")
                    if all(i.state is RankState.IDLE for i in infos):
                        return
                    if time.monotonic() > deadline or not state.running:
                        raise MonarchError(f"its replacement did not join within {state.options.start_timeout:g} s")
                    state.cond.wait(0.05)
        finally:
            with state.lock:
                state.solo -= set(ranks)

    def replay(self, ranks: list[int]) -> str:
        """Send each replacement (or new rank: resize.py) what the notebook had sent it (history.py); returns
        what, in words."""
        said = ""
        for r in ranks:
            plan = self.history.plan(r)
            said = said or self.history.counts(plan)
            for item in plan:
                error = self._replay_one(r, item)
                with self.state.lock:
                    died = self.state.ranks[r].state is RankState.DEAD
                if died:  # it died again: that death is reported (and healed, or given up) on its own
                    break
                if error:
                    self._say(replay_failed_note(r, item.what, error), [r])
        return said

    def _replay_one(self, rank: int, item: Replay) -> str:
        """Send ``item`` to ``rank`` and wait for it; returns its error ("" when it worked)."""
        try:
            if item.kind == "push":
                self.replay_push(item.values, rank, item.device)
                return ""
            cell_id = next(self.state.ids)
            if item.kind == "hook":
                payload, buffers = dumps((item.fn, (), {}))
                msg: P.Message = P.Call(cell_id, {})
            else:
                payload, buffers = dumps(item.refs) if item.refs else (b"", [])
                msg = P.Exec(cell_id, item.code, item.filename or "<replay>", item.sources)
            handle = self.submit(cell_id, [([rank], msg, payload, buffers)], item.what, tracks_failures=False)
            handle.result(REPLAY_TIMEOUT)
        except MeshError as e:  # the rank's own error, not the fold of it
            first = next(iter(e.errors.values()), e)
            return f"{getattr(first, 'ename', type(first).__name__)}: {getattr(first, 'evalue', first)}"
        except Exception as e:  # noqa: BLE001 - reported; the rank runs on without it
            return f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        return ""

    def rejoin(self, ranks: list[int], rejoining: list[CellRecord]) -> list[str]:
        """Send each replacement the ``--rejoin`` cells it left; returns the cells' names."""
        names: list[str] = []
        for rec in rejoining:
            assert rec.rejoin is not None
            for r in ranks:
                with self.state.lock:
                    if not self.cells.rejoin(rec, r):
                        continue
                for group_ranks, msg, payload, buffers in rec.rejoin:
                    if r in group_ranks:
                        self.dispatcher.resend([r], msg, payload, buffers)
                name = getattr(rec.rejoin[0][1], "filename", rec.what)
                if name not in names:
                    names.append(name)
        return names

    def regroup_when_idle(self, ranks: list[int], group: list[int] | None = None) -> None:
        """Once no rank runs a cell (the rejoined ones ended), make a fresh process group of every rank (split:
        of ``group``, the ranks' sub-meshes, once they run none); cells for ``ranks`` wait until then."""
        state = self.state
        try:
            with state.lock:
                while state.running and not state.stopping and any(
                        i.cells for i in state.ranks.values() if group is None or i.rank in group):
                    if self.queue.pending or any(i.state is RankState.DEAD for i in state.ranks.values()):
                        return  # another death: its healing makes the group
                    state.cond.wait(0.5)
                if (not state.running or state.stopping or self.queue.pending
                        or any(i.state is RankState.DEAD for i in state.ranks.values())):
                    return  # stopped, or another death: its healing makes the group
            self.restarts.regroup([], time.monotonic() + state.options.start_timeout, group)
        except MonarchError as e:
            self._say(f"no fresh process group could be made after the restart: {e}", ranks)
        finally:
            with state.lock:
                state.healing -= set(ranks)
                state.cond.notify_all()


def _death(info: Any) -> str:
    """How a rank died, in a few words."""
    return info.death_reason or describe_returncode(info.returncode)


def _serve(ref: weakref.ref, queue: DeathQueue) -> None:
    """The healer's thread: heal the deaths the queue holds; it ends once none came for ``SERVE_IDLE`` seconds (a
    stopped mesh keeps no thread), or with the healer."""
    while (deaths := queue.next_deaths(SERVE_IDLE)) is not None:
        healer = ref()
        if healer is None:
            return
        healer.heal(deaths)
        del healer
