"""Cells in flight: ``CellTable``, the one owner and writer of every cell's record, and ``CellHandle``, the view of a
cell its submitter holds (what ``Mesh.run(..., block=False)`` returns).

Records (records.CellRecord) change only through the table's methods, each called with the mesh lock held (it
asserts so): a result arrived (``on_result``, ``on_done``), a rank's output reached the cell's end (``on_sync``), a
rank finished or failed (``finish_rank``, ``fail_rank``, ``rank_died``), the cell was interrupted, abandoned or
its ranks released (``mark_interrupted``, ``abandon``, ``mark_released``), and the lines it collects for whoever
waits for it (``emit_lines``, ``pop_lines``, ``set_waiting``). Lines of a cell nobody waits for go to the mesh's
``OutputWriter`` (output.py), never written under the lock.
"""

from __future__ import annotations

import functools
import itertools
import threading
import time
from collections.abc import Iterable, Sequence
from typing import Any, Protocol

from monarch_worker import protocol as P
from monarch_worker.hostmessages import unpack_durations
from monarch_worker.serialize import loads

from ..errors import MonarchError, RankDiedError, RemoteError
from ..ranks import RankMap, format_ranks, ranks_text
from .output import FOLD_WINDOW, LINE_BATCH, OutputWriter, fold_lines
from .records import CellRecord, Line
from .spans import span_of
from .state import MeshState

__all__ = ["CellHandle", "CellTable", "CellWaiter", "CellSnapshot", "RECENT_CELLS"]

RECENT_CELLS = 64  # cells whose late rich output still reaches them (MeshState.recent_cells)
BOTH_STREAMS = frozenset(("stdout", "stderr"))
NO_STREAMS: frozenset[str] = frozenset()


class CellWaiter(Protocol):
    """What waits for a cell (``waiting.Waiter``)."""

    def wait(self, cell: CellRecord, timeout: float | None, raise_on_timeout: bool) -> bool: ...

    def outcome(self, cell: CellRecord) -> RankMap | None: ...

    def interrupted(self, cell: CellRecord) -> KeyboardInterrupt: ...


class CellSnapshot:
    """A consistent copy of a cell's progress (for views): finished ranks, errors and durations (seconds)."""

    __slots__ = ("finished", "errors", "durations")

    def __init__(self, finished: set[int], errors: dict[int, MonarchError], durations: dict[int, float]) -> None:
        self.finished, self.errors, self.durations = finished, errors, durations


class CellHandle:
    """One cell (or call) submitted to some ranks, as its submitter sees it: ``cell_id``, ``ranks``, ``what`` and
    ``done()``, ``wait()``, ``result()``, ``snapshot()``. It reads the controller's record of the cell (``record``,
    internal) under the mesh lock and never changes it."""

    __slots__ = ("record", "cell_id", "what", "_state", "_waiter")

    def __init__(self, record: CellRecord, state: MeshState, waiter: CellWaiter) -> None:
        self.record = record
        self.cell_id, self.what = record.cell_id, record.what
        self._state = state
        self._waiter = waiter

    @property
    def ranks(self) -> list[int]:
        """The ranks it was sent to, sorted (a fresh list: the record holds a range for the whole mesh)."""
        return list(self.record.ranks)

    @property
    def waited(self) -> bool:
        """A thread waits for the cell now (it writes the cell's lines; a snapshot)."""
        return self.record.waiting

    def snapshot(self) -> CellSnapshot:
        """Finished ranks, errors and durations, copied under the lock."""
        rec = self.record
        with self._state.lock:
            return CellSnapshot(set(rec.finished), dict(rec.errors), rec.duration_map())

    def done(self) -> bool:
        """True when every rank has finished this cell (or died)."""
        with self._state.lock:
            return self.record.all_done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever) for the cell to finish; True when it has."""
        return self._waiter.wait(self.record, timeout, False)

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
        self._waiter.wait(self.record, timeout, True)
        return self._waiter.outcome(self.record)

    def interrupted(self) -> KeyboardInterrupt:
        """The caller was interrupted between two waits for this cell (a loop of ``wait(0.1)`` and ``snapshot()``,
        where the notebook's interrupt can land outside the wait): interrupt the ranks still running it and wait up
        to ``interrupt_grace`` seconds, as an interrupt inside ``result()`` does. Returns the KeyboardInterrupt to
        raise: where the ranks stopped, and ``.results`` (the values of the ranks that had finished)."""
        return self._waiter.interrupted(self.record)

    def __repr__(self) -> str:
        with self._state.lock:
            done, failed = self.record.all_done, sorted(self.record.errors)
        state = ("running" if not done else f"failed on {ranks_text(failed)}" if failed else "done")
        return f"<CellHandle {self.what} on ranks {format_ranks(self.ranks)}: {state}>"


class CellTable:
    """The cells of one mesh (in ``MeshState.cells``): their records, and every change of their state."""

    def __init__(self, state: MeshState, writer: OutputWriter) -> None:
        self.state = state
        self.writer = writer
        self._order = itertools.count()  # the order results came in (which failure was first)

    # ------------------------------------------------------------------ new cells

    def new(self, cell_id: int, ranks: Sequence[int], what: str, order: str, waiter: CellWaiter,
            tracks_failures: bool = True, background: bool = False, rejoin: list[Any] | None = None) -> CellHandle:
        """A record for a cell about to be sent, and its handle (no lock: nobody else sees it yet). ``rejoin``: what
        a replacement of a rank that dies running it is sent (``CellRecord.rejoin``)."""
        fold = 0 < self.state.options.output_fold < len(ranks)
        rec = CellRecord(cell_id, ranks, what, order, fold, tracks_failures, background)
        rec.rejoin = rejoin
        rec.wake = threading.Condition(self.state.lock)  # type: ignore[arg-type]  # MeshLock: what Condition needs
        rec.handle = CellHandle(rec, self.state, waiter)
        return rec.handle

    def register(self, rec: CellRecord) -> None:
        """``rec`` is sent now: its ranks run it after what they run already."""
        self.state.assert_locked()
        state = self.state
        state.assert_locked()
        state.cells[rec.cell_id] = rec
        state.last_cell = rec
        state.recent_cells[rec.cell_id] = rec  # late rich output still finds its cell (rich.py)
        while len(state.recent_cells) > RECENT_CELLS:
            state.recent_cells.pop(next(iter(state.recent_cells)))
        state.pending[rec.cell_id] = rec  # its ranks' handles read it (RankInfo.cells, RankInfo.state)
        # Told before anything it causes: no line of its output can be routed before this (it needs the lock).
        state.events.emit("cell_started", cell_id=rec.cell_id, ranks=rec.ranks, handle=rec.handle)

    def mark_background(self, handle: CellHandle) -> None:
        """The package's own work (not the user's): a cell that waits behind it gets no note."""
        with self.state.lock:
            handle.record.background = True

    def get(self, cell_id: int) -> CellRecord | None:
        """The cell, while some rank has not finished it."""
        self.state.assert_locked()
        return self.state.cells.get(cell_id)

    def lookup(self, cell_id: int) -> CellRecord | None:
        """The cell, also after it ended (one of the last cells submitted), else None."""
        self.state.assert_locked()
        return self.state.cells.get(cell_id) or self.state.recent_cells.get(cell_id)

    def queued_behind(self, rec: CellRecord, rank: int, background: bool = True) -> bool:
        """``rank`` has not started ``rec``, as an earlier cell still runs there (ranks run their
        cells in the order they were sent); ``background`` False: an earlier cell of the user's."""
        self.state.assert_locked()
        if rank not in self.state.ranks:
            return False
        for c in self.state.pending.values():
            if c.cell_id >= rec.cell_id:
                break
            if (background or not c.background) and c.runs_on(rank):
                return True
        return False

    # ------------------------------------------------------------------ what ranks report (any thread)

    def on_result(self, rank: int, msg: P.Result, payload: bytes, bufs: list) -> None:
        """A rank's Result (I/O thread or output reader): its value is unpickled here, outside the lock."""
        value, error, stopped = None, None, False
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
            rec = self.state.cells.get(msg.cell_id)
            if rec is None:
                return
            rec.durations[rank] = msg.duration
            if rec.tracks_failures:
                if msg.status == "error":
                    self.state.failures[rank] = (msg.cell_id, next(self._order))
                else:
                    self.state.failures.pop(rank, None)
            rec.results_in.add(rank)
            rec.result_seen_at[rank] = now = time.monotonic()
            if error is not None:
                rec.errors[rank] = error
                # Stopped by an interrupt, and no rank failed (the views say "interrupted", not "error"): as
                # waiting.Waiter.outcome, which raises MeshInterrupt then. Survivors interrupted after a rank
                # raised or died are part of that failure (its error and death come first).
                stopped = bool(error.interrupted) and all(
                    isinstance(e, RemoteError) and e.interrupted for e in rec.errors.values())
            else:
                if value is not None:
                    rec.values[rank] = value
                rec.has_value[rank] = msg.has_value
            self.check_rank(rec, rank)
            if rank not in rec.finished:
                rec.unmarked[rank] = now  # its output markers are late (waiting.Waiter finishes it without them)
        self.state.events.emit("rank_result", rank=rank, cell_id=msg.cell_id, status=msg.status,
                               error=None if error is None else str(error), duration=msg.duration,
                               ename=getattr(error, "ename", ""), evalue=getattr(error, "evalue", ""),
                               interrupted=stopped)

    def on_done(self, cell_id: int, ranks: list[int] | range, durations: list[float] | bytes) -> None:
        """``ranks`` finished cell ``cell_id`` with no value and no error (a host agent's summary of its ranks;
        ``durations`` in seconds, in the same order, a list or float64 bytes: hostmessages.pack_durations): what
        ``on_result`` does for each, under one lock. A ``range`` of ranks with bytes costs no step per rank.

        Raises ValueError when the durations do not match the ranks in number (nothing is recorded)."""
        state = self.state
        ndur = len(durations) // 8 if isinstance(durations, bytes) else len(durations)
        if len(ranks) != ndur or (isinstance(durations, bytes) and len(durations) % 8):
            raise ValueError(f"a done event of cell {cell_id} names {len(ranks)} ranks and {ndur} durations")
        with state.lock:
            rec = state.cells.get(cell_id)
            if rec is None:
                return
            span = span_of(ranks)  # a host's ranks, in the order they finished: one range
            if rec.tracks_failures and state.failures:  # a step per earlier failure, not per rank
                if span is not None and len(state.failures) < len(span):
                    for rank in [r for r in state.failures if r in span]:
                        del state.failures[rank]
                else:
                    for rank in ranks:
                        state.failures.pop(rank, None)
            rec.duration_batches.append((ranks, durations))  # as the agent sent them (duration_map reads them)
            if span is not None:
                rec.results_in.add_range(span.start, span.stop)
            else:
                rec.results_in.update(ranks)
            launcher = state.launcher
            if launcher is not None and launcher.relays_output:  # output markers to wait for, rank by rank
                now = time.monotonic()
                for rank in ranks:
                    self.check_rank(rec, rank)
                    if rank not in rec.finished:
                        rec.unmarked[rank] = now
            else:
                self.finish_ranks(rec, span if span is not None else ranks)
        if state.events.listening:  # views (one queueing for the batch; the events are documented per rank)
            seconds = unpack_durations(durations) if isinstance(durations, bytes) else durations
            state.events.emit_all([("rank_result", {"rank": rank, "cell_id": cell_id, "status": "ok", "error": None,
                                                    "duration": duration, "ename": "", "evalue": ""})
                                   for rank, duration in zip(ranks, seconds, strict=True)])

    def on_sync(self, rank: int, stream: str, cell_id: int) -> None:
        """Under the lock: ``rank``'s ``stream`` reached the end of cell ``cell_id`` (a sync marker)."""
        self.state.assert_locked()
        rec = self.state.cells.get(cell_id)
        if rec is not None and rank in rec.members:
            rec.synced.setdefault(rank, set()).add(stream)
            self.check_rank(rec, rank)

    def end_output(self, rec: CellRecord, rank: int) -> None:
        """Under the lock: both of ``rank``'s streams reached the end of ``rec`` (its Result came as a record, which
        the rank writes after its stderr)."""
        self.state.assert_locked()
        if rank in rec.members:
            rec.synced.setdefault(rank, set()).update(("stdout", "stderr"))

    def target(self, rank: int, stream: str, cells: Iterable[CellRecord]) -> CellRecord | None:
        """The cell a line of ``rank`` on ``stream`` belongs to: the oldest of its ``cells`` whose
        output on that stream is not complete, else the last cell submitted."""
        self.state.assert_locked()
        for rec in cells:
            if rank in rec.members and stream not in rec.synced.get(rank, ()):
                return rec
        return self.state.last_cell

    # ------------------------------------------------------------------ finishing (under the lock)

    def check_rank(self, rec: CellRecord, rank: int) -> None:
        """Finish ``rank`` once its result is in and, where the launcher reads output pipes, both
        of its streams reached the cell's end."""
        self.state.assert_locked()
        launcher = self.state.launcher
        relays = launcher is not None and launcher.relays_output
        if rank in rec.results_in and (not relays or rec.synced.get(rank, NO_STREAMS) >= BOTH_STREAMS):
            self.finish_rank(rec, rank)

    def finish_rank(self, rec: CellRecord, rank: int) -> None:
        """``rank`` is done with the cell (result and output in, or it died)."""
        self.state.assert_locked()
        if rank not in rec.finished:
            self.finish_ranks(rec, [rank])

    def finish_ranks(self, rec: CellRecord, ranks: list[int] | range) -> None:
        """Each of ``ranks`` is done with the cell, with one wake-up of its waiter (a host agent's
        summary finishes many ranks at once: no output markers to wait for there)."""
        self.state.assert_locked()
        state = self.state
        if isinstance(ranks, range):
            rec.finished.add_range(ranks.start, ranks.stop)
        elif len(ranks) == 1:
            rec.finished.add(ranks[0])
        else:
            rec.finished.update(ranks)
        if rec.unmarked:
            for rank in ranks:
                rec.unmarked.pop(rank, None)
        if rec.all_done:
            state.pending.pop(rec.cell_id, None)  # no rank runs it any more (RankInfo.cells, RankInfo.state)
            if rec.abandoned:  # its error was told already and nobody takes its outcome from the table: it goes
                state.cells.pop(rec.cell_id, None)
            if rec.errors and not rec.collective_released:  # torn down already when released
                state.unaligned.update(rec.ranks)  # did a rank leave a collective in flight? (check_alignment)
        if rec.order == "rank" and rec.held:
            frontier = self._frontier(rec)
            for r in sorted(rec.held):
                if frontier is not None and r > frontier:
                    break
                rec.lines.extend(rec.held.pop(r))
        if rec.order == "rank" and not rec.waiting:
            self._deliver(rec)
        if rec.all_done or rec.lines:
            rec.wake.notify_all()
        if rec.all_done:
            done = functools.partial(state.events.emit, "cell_done", cell_id=rec.cell_id, handle=rec.handle)
            if rec.waiting:  # its waiter writes its lines (and flushed the writer first)
                done()
            else:  # behind the lines queued for it: its view closes on cell_done and must have them all
                self.writer.then(done)

    def fail_rank(self, rec: CellRecord, rank: int, error: MonarchError) -> None:
        """``rank`` will not finish the cell (it died, the mesh stopped, or it was given up on)."""
        self.state.assert_locked()
        rec.errors.setdefault(rank, error)
        self.finish_rank(rec, rank)

    def rank_died(self, rec: CellRecord, rank: int, error: RankDiedError, now: float) -> None:
        """``rank``'s process is gone while it ran the cell (``now``: time.monotonic())."""
        self.state.assert_locked()
        if rec.death_at is None:
            rec.death_at = now
        self.fail_rank(rec, rank, error)

    def rank_left(self, rec: CellRecord, rank: int) -> None:
        """``rank``'s process died running ``rec``, which its replacement rejoins (``CellRecord.rejoin``): the cell
        waits for the replacement's result instead of failing (what the dead process wrote has all been read)."""
        self.state.assert_locked()
        rec.left.add(rank)
        rec.synced.pop(rank, None)
        rec.results_in.discard(rank)
        rec.unmarked.pop(rank, None)

    def rejoin(self, rec: CellRecord, rank: int) -> bool:
        """``rank``'s replacement is sent ``rec`` now (after what it was sent before); False when the cell ended
        meanwhile (nothing to rejoin)."""
        self.state.assert_locked()
        if rank not in rec.left or self.state.cells.get(rec.cell_id) is not rec:
            return False
        rec.left.discard(rank)  # it runs the cell again (RankInfo.cells)
        self.state.pending.setdefault(rec.cell_id, rec)
        return True

    def grow(self, rec: CellRecord, ranks: list[int]) -> None:
        """New ``ranks`` (``%mesh scale`` under a running torchft loop: kernel/ftscale.py) join ``rec``, a
        ``--rejoin`` cell, as replacements do: left until ``rejoin`` sends them the cell (its first group's
        message), which ends only once they finished it too."""
        self.state.assert_locked()
        assert rec.rejoin is not None
        rec.ranks = sorted(set(rec.ranks) | set(ranks))
        rec.members.update(ranks)
        rec.left.update(ranks)
        _, msg, payload, buffers = rec.rejoin[0]
        rec.rejoin.append((list(ranks), msg, payload, buffers))

    def drop(self, rec: CellRecord, ranks: list[int]) -> None:
        """``ranks`` leave ``rec`` without a result or an error (``%mesh scale`` stops them under a running torchft
        loop: kernel/ftscale.py); the cell ends if the others have finished it."""
        self.state.assert_locked()
        gone = set(ranks)
        rec.ranks = [r for r in rec.ranks if r not in gone]
        for r in gone:
            rec.members.discard(r)
            rec.finished.discard(r)
            rec.results_in.discard(r)
            for table in (rec.values, rec.has_value, rec.errors, rec.synced, rec.durations, rec.result_seen_at,
                          rec.unmarked, rec.held):
                table.pop(r, None)
        rec.left -= gone
        self.finish_ranks(rec, [])  # it may be done now

    def stop_all(self) -> int:
        """The mesh stopped; every cell ends, each unfinished rank with a RankDiedError. Returns how many cells
        had ranks still running."""
        self.state.assert_locked()
        ended = 0
        for rec in list(self.state.cells.values()):
            unfinished = list(rec.members.without(rec.finished))
            ended += bool(unfinished)
            for r in unfinished:
                self.fail_rank(rec, r, RankDiedError(r, None, reason="the mesh was stopped"))
        return ended

    # ------------------------------------------------------------------ interrupts and releases (under the lock)

    def mark_interrupted(self, rec: CellRecord) -> tuple[list[int], set[int]]:
        """Under the lock: the cell is interrupted; returns (the ranks still running it, those of them that had
        not started it: an earlier cell still runs there, and they skip it)."""
        self.state.assert_locked()
        rec.interrupted = True
        running = rec.members.without(rec.finished)
        rec.queued_on = {r for r in running if self.queued_behind(rec, r)}
        return running, rec.queued_on

    def abandon(self, rec: CellRecord) -> list[int]:
        """Under the lock: nobody waits for the cell any more; returns the ranks that still run it (later cells
        must not queue behind it there: dispatch.py refuses code while a rank is stuck in it)."""
        self.state.assert_locked()
        left = rec.members.without(rec.finished)
        rec.abandoned = bool(left)
        return left

    def mark_released(self, rec: CellRecord, reason: str, released: dict[int, str]) -> None:
        """Under the lock: the process group was torn down (``reason``) to release ``released`` (rank -> the
        collective it waited in) from a collective a rank that raised never joined."""
        self.state.assert_locked()
        rec.collective_released = reason
        rec.released = dict(released)

    def set_hint(self, rec: CellRecord, hint: str) -> None:
        """What the cell's error adds about its release (and the fresh group)."""
        self.state.assert_locked()
        rec.collective_hint = hint

    def keep_outcome(self, rec: CellRecord) -> None:
        """A handle the caller holds (``block=False``): its result may be asked again."""
        with self.state.lock:
            rec.keep_outcome = True

    def set_final(self, rec: CellRecord, final: tuple[Any, BaseException | None]) -> None:
        """The cell's outcome (value, error), computed once (waiting.py)."""
        with self.state.lock:
            if rec.keep_outcome:
                rec.final = final

    def take_outcome(self, rec: CellRecord) -> tuple[dict[int, Any], RankMap, bool]:
        """Under the lock: (errors, results, whether any rank had a value or an error); the cell leaves the table
        and its values go to the caller (the record may live on, for late output)."""
        self.state.assert_locked()
        self.state.cells.pop(rec.cell_id, None)
        errors = dict(rec.errors)
        valued = bool(errors) or any(rec.has_value.values())
        results = (RankMap((r, rec.values.get(r)) for r in rec.ranks if r in rec.finished and r not in errors)
                   if valued else RankMap())
        rec.values = {}
        return errors, results, valued

    def forget(self, rec: CellRecord) -> None:
        """The cell leaves the table (every rank ended it, and its outcome was told)."""
        self.state.assert_locked()
        self.state.cells.pop(rec.cell_id, None)

    # ------------------------------------------------------------------ lines (under the lock)

    def emit(self, rec: CellRecord, rank: int, stream: str, item: Any) -> None:
        """One line (or, stream "display", a rich output) of ``rank``."""
        self.state.assert_locked()
        self._emit(rec, rank, (rank, stream, item))

    def emit_lines(self, rec: CellRecord, rank: int, stream: str, texts: list[str]) -> None:
        """Under the lock: lines the cell's ``rank`` wrote, in order: held for the waiter, or queued to be written
        (as one run, ``records.Line``: no object per line)."""
        self.state.assert_locked()
        self._emit(rec, rank, (rank, stream, texts))

    def _emit(self, rec: CellRecord, rank: int, line: Line) -> None:
        if rec.order == "rank" and not self._released(rec, rank):
            rec.held.setdefault(rank, []).append(line)  # nothing to write yet: nobody is woken
            return
        now = time.monotonic()
        if not rec.lines:
            rec.lines_since = now
        rec.lines.append(line)
        if not rec.waiting:
            self._deliver(rec)
        elif now >= rec.lines_due:  # else the waiter comes for them at lines_due (wake_wait): one wake per batch
            rec.wake.notify()

    def pop_lines(self, rec: CellRecord) -> list[Line]:
        """Under the lock: the lines collected for the waiter, now taken (folded where the cell folds; the lines of
        a folding cell are held until they are ``FOLD_WINDOW`` seconds old or the cell is done)."""
        self.state.assert_locked()
        if not rec.lines:  # the usual wake of a quiet cell
            return []
        now = time.monotonic()
        if rec.fold and not rec.all_done and now - rec.lines_since < FOLD_WINDOW:
            return []
        lines, rec.lines = rec.lines, []
        if lines:
            rec.lines_due = now + LINE_BATCH
        return fold_lines(lines) if rec.fold else list(lines)  # type: ignore[arg-type]

    def set_waiting(self, rec: CellRecord, waiting: bool) -> None:
        """Under the lock: whether a thread waits for the cell (it then writes the lines itself; it flushes the
        writer first, see output.py). Lines collected so far are queued when nobody waits any more."""
        self.state.assert_locked()
        rec.waiting = waiting
        if not waiting:
            self._deliver(rec)

    def wake_all(self, rec: CellRecord) -> None:
        """Wake whoever waits for the cell (something changed, e.g. a rank stopped in pdb)."""
        self.state.assert_locked()
        rec.wake.notify_all()

    def wake_wait(self, rec: CellRecord, timeout: float) -> None:
        """Sleep until lines arrive or the cell is done, at most ``timeout`` seconds."""
        self.state.assert_locked()
        if rec.all_done:
            return
        if not rec.lines:
            rec.wake.wait(timeout)
        elif rec.fold:  # lines wait for the same line from other ranks
            left = rec.lines_since + FOLD_WINDOW - time.monotonic()
            if left > 0:
                rec.wake.wait(min(timeout, left))
        else:  # lines came soon after the last ones written: they are written together at lines_due
            left = rec.lines_due - time.monotonic()
            if left > 0:
                rec.wake.wait(min(timeout, left))

    def _deliver(self, rec: CellRecord) -> None:
        lines, rec.lines = rec.lines, []
        self.writer.put(fold_lines(lines) if rec.fold else lines, rec.ctx)  # type: ignore[arg-type]

    @staticmethod
    def _frontier(rec: CellRecord) -> int | None:
        """The first of ``rec``'s ranks that has not finished it (None: all have)."""
        return rec.members.first_not_in(rec.finished)

    @classmethod
    def _released(cls, rec: CellRecord, rank: int) -> bool:
        """Order "rank": every rank before ``rank`` finished the cell, so its lines go out now."""
        frontier = cls._frontier(rec)
        return frontier is None or rank <= frontier
