"""``%mesh scale -n N`` under a running torchft loop (``FtScaler``, called by resize.Resizer.scale).

A torchft loop here is a ``--rejoin`` cell (``%%mesh --async --rejoin``, ``mesh.run(..., rejoin=True)``) running on
every rank of a mesh started with ``torchft=True``: each rank is one torchft replica group, and torchft's quorum
(the mesh's Lighthouse) decides at every step which replicas train. The loop needs no default process group of the
mesh, so its membership can change beneath it:

- Growing from N to M starts ranks N..M-1 as a healing replacement is started (healing.Healer.start_alone: no
  process group yet, ``REPLICA_GROUP_ID`` r and ``NUM_REPLICA_GROUPS`` M), sends them what the notebook had sent
  every rank (history.py), then the running cell, which they join (cells.CellTable.grow, Healer.rejoin): their first
  quorum finds them behind and torchft heals them live from a peer (its checkpoint transport), after which they
  train as replica groups of their own. The scale returns once they run the cell.
- Shrinking from N to M stops ranks M..N-1 (SIGKILL, not reported as deaths): they leave the cell without a result
  (cells.CellTable.drop), and the survivors' loop goes on through torchft's next quorum, which no longer has them
  (the step the stopped ranks were in is not committed: torchft retries it). Refused when M is below the loop's
  ``torchft_min_replicas``: its quorum would wait for replicas that never come.

Either way the survivors get ``NUM_REPLICA_GROUPS`` M at once (protocol.Replicas, answered by their I/O thread),
and ``world_size`` in every namespace, RANK/WORLD_SIZE and the default process group of M ranks are made when the
running cell has ended (healing.Healer.regroup_when_idle, on a thread of its own): a process group cannot be made
again beneath a cell. Until then the group shows "down" in ``%mesh status``, and cells for the new ranks wait.

A loop's ranks change once: a second scale under the same loop is refused (``scaled_under``; a shrink then a grow
under one loop left a rank waiting in the old loop's quorum). A new rank that dies before it runs the cell: with
``on_rank_death="restart"`` the healer starts it again and it rejoins the cell (within ``restart_limit``); otherwise
the scale is undone for it (the mesh is N ranks again, the loop runs on) and MonarchError says so. One that dies
once it runs the cell is any rank dying in a torchft loop.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from monarch_worker import protocol as P

from ..errors import MonarchError
from ..ranks import ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .healing import Healer
from .records import CellRecord
from .recovery import Restarts
from .state import MeshState, RankState

__all__ = ["FtScaler", "torchft_loops"]


def torchft_loops(state: MeshState) -> list[CellRecord]:
    """Under the mesh lock: the running cells when they are torchft loops the mesh can be scaled under (every cell
    in flight is a ``--rejoin`` cell on every rank of a ``torchft=True`` mesh, not interrupted), else []."""
    state.assert_locked()
    cells = [rec for rec in state.cells.values() if not rec.all_done]
    # A cell's ranks are sorted and unique: as many as the world means every rank (a list or a range).
    if (not cells or not state.options.torchft or state.partition is not None
            or any(rec.rejoin is None or rec.interrupted or len(rec.ranks) != state.nproc for rec in cells)):
        return []
    return cells


class FtScaler:
    """Grows and shrinks a mesh under a running torchft loop (see the module docstring).

    Parameters
    ----------
    replay:
        Sends new ranks what the notebook sent every rank, as the replayer: (ranks) -> what, in words
        (resize.Resizer's).
    """

    def __init__(self, state: MeshState, cells: CellTable, dispatcher: Dispatcher, restarts: Restarts,
                 healer: Healer, replay: Callable[[list[int]], str]) -> None:
        self.state = state
        self.cells = cells
        self.dispatcher = dispatcher
        self.restarts = restarts
        self.healer = healer
        self.replay = replay
        self.scaled: set[int] = set()  # the loops' cell ids this mesh was scaled under

    def scaled_under(self, loops: list[CellRecord]) -> int | None:
        """The cell id of one of ``loops`` the mesh was scaled under already (a loop's ranks change once), or None."""
        return next((rec.cell_id for rec in loops if rec.cell_id in self.scaled), None)

    def check(self, before: int, n: int) -> None:
        """Raise ValueError when ``n`` replica groups are fewer than the loop's ``torchft_min_replicas``;
        MonarchError when growing without the notebook's history (kept with ``on_rank_death="restart"`` only):
        new ranks would run the loop without the model the notebook defined."""
        if n > before and self.state.options.on_rank_death != "restart":
            raise MonarchError(
                "new ranks join the running torchft loop with what the notebook sent every rank (the model, the "
                "data), which is kept only on a self-healing mesh: start it with  %mesh start --on-rank-death "
                "restart --torchft  (Mesh(on_rank_death=\"restart\", torchft=True)), or grow it once the loop ended")
        need = self.state.options.torchft_min_replicas
        if n < need:
            raise ValueError(
                f"the running torchft loop commits a step only with {need} replica groups (torchft_min_replicas="
                f"{need}), so with {n} rank{'s' if n > 1 else ''} its quorum would wait for ever: scale to {need} or "
                "more, or stop the loop first (%mesh interrupt), then scale")

    def scale(self, before: int, n: int, loops: list[CellRecord]) -> tuple[list[int], list[int], str, str]:
        """Make the mesh ``n`` ranks under ``loops`` (torchft_loops); returns (started, stopped, what the new ranks
        got, what happens to the default process group, in words). Raises MonarchError when a new rank failed to
        start (the scale is undone for it; the loop runs on)."""
        started, stopped, sent, healer = list(range(before, n)), list(range(n, before)), "", False
        self.scaled.update(rec.cell_id for rec in loops)
        if stopped:
            self._shrink(n, stopped, loops)
        else:
            sent, healer = self._grow(n, started, loops)
        for r in range(n):
            if r not in started:
                self.dispatcher.post(r, P.Replicas(groups=n))
        if healer:  # its healing makes the group once the loop ended (healing.py)
            joined = (f"{ranks_text(started)} died as {'they' if len(started) > 1 else 'it'} started, and the healer "
                      "starts it again (on_rank_death=restart) into the running torchft loop; ")
        else:
            with self.state.lock:
                pids = {r: self.state.ranks[r].pid for r in started}
            threading.Thread(target=self._regroup_later, args=(pids,), name="monarch-ftscale", daemon=True).start()
            joined = (f"{ranks_text(started)} joined the running torchft loop, healing from a peer there; "
                      if started else "")
        later = (f"{joined}the loop goes on with {n} replica groups; the default process group of {n} ranks is made "
                 "when the running cell ends")
        return started, stopped, sent, later

    def _regroup_later(self, pids: dict[int, int | None]) -> None:
        """Make the default process group once the loop's cell ended (Healer.regroup_when_idle); then cells wait no
        more for the new ranks (rank -> its process id, ``pids``), but for one that died meanwhile: its healing
        (healing.py) makes the group and ends its wait."""
        state = self.state
        try:
            self.healer.regroup_when_idle([])
        finally:
            with state.lock:
                state.healing -= {r for r, pid in pids.items() if r in state.ranks and state.ranks[r].pid == pid
                                  and state.ranks[r].state is not RankState.DEAD}
                state.cond.notify_all()

    def _shrink(self, n: int, stopped: list[int], loops: list[CellRecord]) -> None:
        state = self.state
        with state.lock:
            for rec in loops:
                self.cells.drop(rec, stopped)
        self.restarts.kill_ranks(stopped, "stopped by %mesh scale")
        with state.lock:
            for r in stopped:
                del state.ranks[r]
                state.killing.pop(r, None)
            state.nproc = n
            state.mark_down(range(n), f"{ranks_text(stopped)} stopped by %mesh scale under the torchft loop: a "
                                      "group of the new size is made when the loop ends")
            state.cond.notify_all()

    def _grow(self, n: int, started: list[int], loops: list[CellRecord]) -> tuple[str, bool]:
        """Start ``started`` into ``loops``; returns (what they got, in words; whether one died and the healer
        starts it again)."""
        state = self.state
        with state.lock:
            was_down = dict(state.down)
            for r in started:
                state.ranks[r] = state.rank_info(r)
            state.nproc = n
            state.healing.update(started)  # cells for them wait until the default process group has them
            for rec in loops:
                self.cells.grow(rec, started)
            state.mark_down(range(n), f"{ranks_text(started)} joined the torchft loop: a group of the new size is "
                                      "made when the loop ends")
        try:
            self.healer.start_alone(started, time.monotonic() + state.options.start_timeout)
        except MonarchError as e:
            with state.lock:
                healed = state.options.on_rank_death == "restart" and any(
                    state.ranks[r].state is RankState.DEAD for r in started)
            if not healed:
                self._undo(started, loops, was_down)
                raise MonarchError(f"{ranks_text(started)} did not join the torchft loop: {e}. The mesh is "
                                   f"{min(started)} ranks again; the loop runs on") from None
            # on_rank_death="restart": the healer starts it again, and it rejoins the cell (healing.py)
            return "", True
        sent = self.replay(started)
        self.healer.rejoin(started, loops)
        with state.lock:  # what a cell that waited for them says once the group is made (waiting.py)
            state.healed_note = (f"{ranks_text(started)}, started by %mesh scale into the torchft loop, "
                                 f"{'are' if len(started) > 1 else 'is'} in the process group of {n} ranks now")
        return sent, False

    def _undo(self, started: list[int], loops: list[CellRecord], was_down: dict[int, str]) -> None:
        """New ranks that failed to start leave the mesh and the loop (killed where they still live)."""
        state = self.state
        with state.lock:
            live = [r for r in started if state.ranks[r].state is not RankState.DEAD]
        if live:
            self.restarts.kill_ranks(live, "its start by %mesh scale failed")
        with state.lock:
            for rec in loops:
                self.cells.drop(rec, started)
            for r in started:
                state.ranks.pop(r, None)
                state.killing.pop(r, None)
            state.healing -= set(started)
            state.nproc = min(started)
            state.mark_up(range(state.nproc))
            for r, why in was_down.items():
                state.mark_down([r], why)
            state.cond.notify_all()
