"""Cells in flight: ``CellHandle`` (one cell, call or transfer submitted to some ranks) and ``CellTable`` (the
cells by id, and what ranks report about them).

A handle collects each rank's value or error, its output lines and when it finished. Output lines are written by
whoever waits for the cell (``wait``/``result``) or, when nobody waits, by the thread that delivers them, inside
the context captured when the cell was submitted, so they land in the cell that caused them.

Locking: methods documented "under the lock" expect the caller to hold the mesh lock (``MeshState.lock``); the
others take it themselves. Other parts of the controller read a handle's state through the locked methods
(``done``, ``snapshot``, ``take_lines``), never through its private fields.
"""

from __future__ import annotations

import contextvars
import itertools
import threading
import time
from typing import TYPE_CHECKING, Any, Protocol

from monarch_worker import protocol as P
from monarch_worker.serialize import loads

from ..errors import MonarchError, RankDiedError, RemoteError
from ..ranks import RankMap, format_ranks
from .output import FOLD_WINDOW, Who, fold_lines, write_lines
from .state import MeshState, RankState

if TYPE_CHECKING:
    from collections.abc import Iterable

__all__ = ["CellHandle", "CellTable", "CellWaiter", "CellSnapshot"]


class CellWaiter(Protocol):
    """What waits for a handle (``waiting.Waiter``)."""

    def wait(self, cell: CellHandle, timeout: float | None, raise_on_timeout: bool) -> bool: ...

    def outcome(self, cell: CellHandle) -> RankMap | None: ...


class CellSnapshot:
    """A consistent copy of a handle's progress (for views): finished ranks, errors and durations (seconds)."""

    __slots__ = ("finished", "errors", "durations")

    def __init__(self, finished: set[int], errors: dict[int, MonarchError], durations: dict[int, float]) -> None:
        self.finished, self.errors, self.durations = finished, errors, durations


class CellHandle:
    """One cell (or call) submitted to some ranks; what ``Mesh.run(..., block=False)`` returns.

    Public: ``cell_id``, ``ranks``, ``what`` and the methods ``done``, ``wait``, ``result``.
    """

    def __init__(self, state: MeshState, waiter: CellWaiter, cell_id: int, ranks: list[int], what: str,
                 order: str) -> None:
        self._state = state
        self._waiter = waiter
        self.cell_id = cell_id
        self.ranks = ranks
        self.what = what
        self.order = order
        self.ctx = contextvars.copy_context()
        self.submitted = time.monotonic()
        self.values: dict[int, Any] = {}
        self.has_value: dict[int, bool] = {}
        self.errors: dict[int, MonarchError] = {}
        self.results_in: set[int] = set()
        self.synced: dict[int, set[str]] = {r: set() for r in ranks}  # streams whose end marker came, per rank
        self.finished: set[int] = set()
        self.durations: dict[int, float] = {}
        self.result_seen_at: dict[int, float] = {}  # time.monotonic() when each rank's result came
        self.death_at: float | None = None  # when the first of its ranks died (recovery.py)
        self.collective_check_at = 0.0  # when to ask next whether its ranks wait for one that raised (recovery.py)
        self.collective_released = ""  # why the process group was torn down to release its ranks (recovery.py)
        self.released: dict[int, str] = {}  # rank -> the collective it was released from (recovery.py)
        self.counts_seen: dict[int, dict] = {}  # rank -> its groups' operation counts at the last check (recovery.py)
        self.collective_hint = ""  # what the cell's error says about it (and the fresh group)
        self.interrupted = False  # its ranks were sent an interrupt
        self.abandoned = False  # interrupted or timed out while some ranks still ran it
        # Ranks that had not started it when it was interrupted (an earlier cell still ran there): they skip it.
        self.queued_on: set[int] = set()
        self.background = False  # the package's own work (Lightning's warm-up import): no note says a cell waits
        self.keep_outcome = False  # a handle the caller holds (block=False): result() may be asked again
        self.tracks_failures = True  # its failures are the ones post-mortem opens (not a post-mortem's own)
        self.final: tuple[Any, BaseException | None] | None = None  # the outcome, once computed
        self._lines: list[tuple[int, str, Any]] = []
        self._lines_since = 0.0  # when the oldest line in _lines came
        # Many ranks: identical lines of several ranks show once (output.fold_lines), gathered for FOLD_WINDOW s.
        self.fold = 0 < state.options.output_fold < len(ranks)
        self._held: dict[int, list] = {r: [] for r in ranks} if order == "rank" else {}  # lines not yet released
        self._wake = threading.Condition(state.lock)  # notified when lines arrive for a waiter, or when done
        self._waiting = False

    # ------------------------------------------------------------------ under the lock

    @property
    def all_done(self) -> bool:
        """Every rank finished it (under the lock, or as a snapshot)."""
        return len(self.finished) == len(self.ranks)

    def queued_behind(self, rank: int, background: bool = True) -> bool:
        """Under the lock: ``rank`` has not started it, as an earlier cell still runs there (ranks run their cells
        in the order they were sent); ``background`` False: an earlier cell of the user's."""
        info = self._state.ranks.get(rank)
        return info is not None and any(c.cell_id < self.cell_id and rank not in c.finished
                                        and (background or not c.background) for c in info.cells)

    def emit(self, rank: int, stream: str, text: Any) -> None:
        """Under the lock: a line the cell's ``rank`` wrote; written now unless someone waits for the cell."""
        self.emit_lines(rank, stream, [text])

    def emit_lines(self, rank: int, stream: str, texts: list[Any]) -> None:
        """Under the lock: lines the cell's ``rank`` wrote, in order; written now unless someone waits for the cell."""
        if self.order == "rank" and not self._released(rank):
            self._held[rank].extend((rank, stream, text) for text in texts)
        else:
            if not self._lines:
                self._lines_since = time.monotonic()
            self._lines.extend((rank, stream, text) for text in texts)
        if not self._waiting:
            self.deliver()
        else:
            self._wake.notify()

    def deliver(self) -> None:
        """Under the lock: write the lines collected so far, in the cell's context."""
        lines, self._lines = self._lines, []
        write_lines(fold_lines(lines) if self.fold else lines, self.ctx)

    def _released(self, rank: int) -> bool:
        for r in self.ranks:
            if r == rank:
                return True
            if r not in self.finished:
                return False
        return True

    def finish_rank(self, rank: int) -> None:
        """Under the lock: ``rank`` is done with this cell (result and output in, or it died)."""
        if rank in self.finished:
            return
        self.finished.add(rank)
        info = self._state.ranks.get(rank)
        if info is not None:
            if self in info.cells:
                info.cells.remove(self)
            if not info.cells and info.state is RankState.RUNNING:
                info.state = RankState.IDLE
        if self.order == "rank":
            for r in self.ranks:
                if self._held[r] and self._released(r):
                    self._lines.extend(self._held[r])
                    self._held[r] = []
            if not self._waiting:
                self.deliver()
        if self.all_done or self._lines:
            self._wake.notify_all()
        if self.all_done:
            self._state.events.emit("cell_done", cell_id=self.cell_id, handle=self)

    def finish_ranks(self, ranks: list[int]) -> None:
        """Under the lock: ``finish_rank`` for each of ``ranks`` whose result is in (no output markers to wait for:
        a host agent's ranks), with one wake-up of the waiter."""
        launcher = self._state.launcher
        if launcher is not None and launcher.relays_output or self.order == "rank":
            for rank in ranks:
                self.check_rank(rank)
            return
        infos = self._state.ranks
        for rank in ranks:
            if rank in self.finished:
                continue
            self.finished.add(rank)
            info = infos.get(rank)
            if info is not None:
                if info.cells and info.cells[0] is self:
                    info.cells.popleft()
                elif self in info.cells:
                    info.cells.remove(self)
                if not info.cells and info.state is RankState.RUNNING:
                    info.state = RankState.IDLE
        if self.all_done or self._lines:
            self._wake.notify_all()
        if self.all_done:
            self._state.events.emit("cell_done", cell_id=self.cell_id, handle=self)

    def check_rank(self, rank: int) -> None:
        """Under the lock: finish ``rank`` once its result is in and, where the launcher reads output pipes, both
        of its streams reached the cell's end."""
        launcher = self._state.launcher
        relays = launcher is not None and launcher.relays_output
        if rank in self.results_in and (not relays or self.synced[rank] >= {"stdout", "stderr"}):
            self.finish_rank(rank)

    def fail_rank(self, rank: int, error: MonarchError) -> None:
        """Under the lock: ``rank`` will not finish the cell (it died, or the mesh stopped)."""
        self.errors.setdefault(rank, error)
        self.finish_rank(rank)

    def wake_all(self) -> None:
        """Under the lock: wake whoever waits for the cell (something changed, e.g. a rank stopped in pdb)."""
        self._wake.notify_all()

    def wake_wait(self, timeout: float) -> None:
        """Under the lock: sleep until lines arrive or the cell is done, at most ``timeout`` seconds."""
        if self.all_done:
            return
        if not self._lines:
            self._wake.wait(timeout)
        elif self.fold:  # lines wait for the same line from other ranks
            left = self._lines_since + FOLD_WINDOW - time.monotonic()
            if left > 0:
                self._wake.wait(min(timeout, left))

    def pop_lines(self) -> list[tuple[Who, str, Any]]:
        """Under the lock: the lines collected for the waiter, now taken (folded where the cell folds; the lines of
        a folding cell are held until they are ``FOLD_WINDOW`` seconds old or the cell is done)."""
        if (self.fold and self._lines and not self.all_done
                and time.monotonic() - self._lines_since < FOLD_WINDOW):
            return []
        lines, self._lines = self._lines, []
        return fold_lines(lines) if self.fold else list(lines)

    def set_waiting(self, waiting: bool) -> None:
        """Under the lock: whether a thread waits for the cell (it then writes the lines itself)."""
        self._waiting = waiting
        if not waiting:
            self.deliver()

    # ------------------------------------------------------------------ any thread

    @property
    def waited(self) -> bool:
        """A thread waits for the cell now (it writes the cell's lines; a snapshot)."""
        return self._waiting

    def take_lines(self) -> list[tuple[Who, str, Any]]:
        """The lines collected for the waiter, now taken (takes the lock)."""
        with self._state.lock:
            return self.pop_lines()

    def snapshot(self) -> CellSnapshot:
        """Finished ranks, errors and durations, copied under the lock."""
        with self._state.lock:
            return CellSnapshot(set(self.finished), dict(self.errors), dict(self.durations))

    def done(self) -> bool:
        """True when every rank has finished this cell (or died)."""
        with self._state.lock:
            return self.all_done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever) for the cell to finish; True when it has."""
        return self._waiter.wait(self, timeout, False)

    def result(self, timeout: float | None = None) -> RankMap | None:
        """Wait for the cell and return rank -> value of its last expression (None when no rank had one).

        Raises
        ------
        MeshError
            The cell raised on some ranks, or some ranks died; ``.results`` holds the others' values.
        MeshTimeoutError
            The cell did not finish within ``timeout`` seconds (the report says where each rank was); the cell is
            then interrupted on every rank, as ``%%mesh --timeout`` does. To wait without interrupting, use
            ``wait(timeout)``.
        KeyboardInterrupt
            The cell was interrupted (``%mesh interrupt``, the notebook's interrupt, a timeout); ``.results`` holds
            the values of the ranks that had finished it. Not an ``Exception``: ``except Exception`` does not catch it.
        """
        self._waiter.wait(self, timeout, True)
        return self._waiter.outcome(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<CellHandle {self.what} on ranks {format_ranks(self.ranks)}: {state}>"


class CellTable:
    """The cells of one mesh by id (in ``MeshState.cells``), and the results ranks report for them."""

    def __init__(self, state: MeshState) -> None:
        self.state = state
        self._order = itertools.count()  # the order results came in (which failure was first)

    def get(self, cell_id: int) -> CellHandle | None:
        """Under the lock: the cell, while some rank has not finished it."""
        return self.state.cells.get(cell_id)

    def lookup(self, cell_id: int) -> CellHandle | None:
        """Under the lock: the cell, also after it ended (one of the last cells submitted), else None."""
        return self.state.cells.get(cell_id) or self.state.recent_cells.get(cell_id)

    def on_result(self, rank: int, msg: P.Result, payload: bytes, bufs: list) -> None:
        """A rank's Result (I/O thread or output reader): its value is unpickled here, outside the lock."""
        value, error = None, None
        if msg.status == "ok" and msg.has_value:
            try:
                value = loads(payload, bufs)
            except Exception as e:  # noqa: BLE001 - e.g. a module the notebook lacks
                error = RemoteError(rank, type(e).__qualname__,
                                    f"the rank's result could not be unpickled in the notebook: {e}")
        elif msg.status == "error":
            err = msg.error or {}
            error = RemoteError(rank, err.get("type", "Exception"), err.get("message", ""),
                                err.get("traceback", ""), err.get("module", ""), err.get("frames"),
                                bool(err.get("interrupted")))
        with self.state.lock:
            cell = self.state.cells.get(msg.cell_id)
            if cell is None:
                return
            cell.durations[rank] = msg.duration
            if cell.tracks_failures:
                if msg.status == "error":
                    self.state.failures[rank] = (msg.cell_id, next(self._order))
                else:
                    self.state.failures.pop(rank, None)
            cell.results_in.add(rank)
            cell.result_seen_at[rank] = time.monotonic()
            if error is not None:
                cell.errors[rank] = error
            else:
                cell.values[rank] = value
                cell.has_value[rank] = msg.has_value
            cell.check_rank(rank)
        self.state.events.emit("rank_result", rank=rank, cell_id=msg.cell_id, status=msg.status,
                               error=None if error is None else str(error), duration=msg.duration,
                               ename=getattr(error, "ename", ""), evalue=getattr(error, "evalue", ""))

    def on_done(self, cell_id: int, ranks: list[int], durations: list[float]) -> None:
        """``ranks`` finished cell ``cell_id`` with no value and no error (a host agent's summary of its ranks;
        ``durations`` in seconds, in the same order): what ``on_result`` does for each, under one lock."""
        state = self.state
        with state.lock:
            cell = state.cells.get(cell_id)
            if cell is None:
                return
            now = time.monotonic()
            if cell.tracks_failures and state.failures:
                for rank in ranks:
                    state.failures.pop(rank, None)
            cell.durations.update(zip(ranks, durations, strict=True))
            cell.results_in.update(ranks)
            cell.result_seen_at.update(dict.fromkeys(ranks, now))
            cell.values.update(dict.fromkeys(ranks))
            cell.has_value.update(dict.fromkeys(ranks, False))
            cell.finish_ranks(ranks)
        if state.events.listening:
            for rank, duration in zip(ranks, durations, strict=True):
                state.events.emit("rank_result", rank=rank, cell_id=cell_id, status="ok", error=None,
                                  duration=duration, ename="", evalue="")

    def on_sync(self, rank: int, stream: str, cell_id: int) -> None:
        """Under the lock: ``rank``'s ``stream`` reached the end of cell ``cell_id`` (a sync marker)."""
        cell = self.state.cells.get(cell_id)
        if cell is not None and rank in cell.synced:
            cell.synced[rank].add(stream)
            cell.check_rank(rank)

    def target(self, rank: int, stream: str, cells: Iterable[CellHandle]) -> CellHandle | None:
        """Under the lock: the cell a line of ``rank`` on ``stream`` belongs to: the oldest of its ``cells`` whose
        output on that stream is not complete, else the last cell submitted."""
        for cell in cells:
            synced = cell.synced.get(rank)
            if synced is not None and stream not in synced:
                return cell
        return self.state.last_cell

    def stop_all(self) -> None:
        """Under the lock: the mesh stopped; every cell ends, each unfinished rank with a RankDiedError."""
        for cell in list(self.state.cells.values()):
            for r in cell.ranks:
                if r not in cell.finished:
                    cell.fail_rank(r, RankDiedError(r, None, reason="the mesh was stopped"))
        self.state.cells.clear()
