"""Waiting for a cell: its output written from the waiting thread, interrupts, timeouts, the outcome.

The caller's thread (the kernel's main thread in a notebook) waits on the cell's condition in 50 ms slices, so
SIGINT (the notebook's interrupt) always reaches it, and writes the cell's output lines itself as they arrive (it
flushes the mesh's OutputWriter first, so lines queued before it waited come out first), in the context the cell
was submitted from: the output of an ``--async`` cell whose ``result()`` a later cell waits for still lands in the
cell that ran it (its view), once. When the caller is
interrupted, the ranks still running the cell are interrupted too (interrupts.Interrupter); they get
``interrupt_grace`` seconds to stop, and those that do not are reported as stuck. A cell that runs past its timeout
is interrupted the same way and raises ``MeshTimeoutError`` with each rank's stack.

While it waits, the thread also asks, when a rank of the cell raised, whether the others wait for it in a
collective (releases.py), and gives up on survivors of a death after a grace period (deaths.py). A rank stopped at
``breakpoint()`` is served by the debugger's prompts from this thread (``Prompts``): time at the prompt does not
count against the cell's timeout.
"""

from __future__ import annotations

import itertools
import logging
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Protocol

from ..errors import (
    MeshError,
    MeshInterrupt,
    MeshTimeoutError,
    MonarchError,
    RankDiedError,
    RemoteError,
    mesh_interrupt,
)
from ..ranks import RankMap, format_ranks, plural, ranks_text
from .cells import CellHandle, CellTable
from .config import check_timeout
from .deaths import Deaths
from .dispatch import Dispatcher, Group
from .hints import healing_interrupted_note, healing_timeout_note, healing_wait_note
from .interrupts import RESEND, Interrupter
from .output import InterruptGuard, OutputWriter, write_lines
from .records import CellRecord
from .recovery import Restarts, keep_state, where_interrupted
from .releases import COLLECTIVE_CHECK, Releases, failed_ranks
from .stacks import StackRequests, summarize
from .state import MeshState

log = logging.getLogger(__name__)

__all__ = ["Waiter", "Prompts", "MARKER_GRACE"]

QUEUE_NOTE_AFTER = 1.0  # seconds a waited-for cell waits behind an earlier one before a note says so
MARKER_GRACE = 1.0  # seconds a rank's output marker may lag its result before the rank is finished without it


def finished_note(results: dict) -> str:
    """What an interrupt's message adds about the ranks that had finished the cell (their values: ``results``)."""
    if not results:
        return ""
    values = plural(results, "their values", "its value")
    return f"; {ranks_text(results)} had finished ({values}: the exception's .results)"


class Prompts(Protocol):
    """Debugger prompts of ranks stopped at ``breakpoint()`` (prompts.PromptServer)."""

    def has_prompt(self, cell: CellRecord) -> bool: ...

    def serve(self, cell: CellRecord) -> float: ...


class Waiter:
    """Submits cells and waits for them (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable, writer: OutputWriter,
                 stacks: StackRequests, interrupter: Interrupter, deaths: Deaths, releases: Releases,
                 restarts: Restarts, prompts: Prompts) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.cells = cells
        self.writer = writer
        self.stacks = stacks
        self.interrupter = interrupter
        self.deaths = deaths
        self.releases = releases
        self.restarts = restarts
        self.prompts = prompts

    def submit(self, cell_id: int, groups: Sequence[Group], what: str, order: str = "arrival",
               tracks_failures: bool = True, waited: bool = False, rejoin: bool = False,
               timeout: float | None = None) -> CellHandle:
        """Send one cell (``groups``: ranks that get the same message) and return its handle. ``order``: see
        ``Mesh.run``; ``tracks_failures``: its failures are the ones post-mortem opens; ``waited``: the caller
        waits for it next (``wait``), so its lines are held for that thread from the start (folding and rank
        order then see every line, also those a fast rank writes before the caller is back); ``rejoin``: a
        replacement of a rank that dies running it rejoins it (kernel/healing.py). While a chosen rank is being
        restarted (on_rank_death="restart"), it waits until that is done, with a note, ``timeout`` seconds at most
        (None: the mesh's timeout option; when that is unset too, as long as the restart takes).

        Raises
        ------
        MeshError, RankBusyError
            A chosen rank is dead or stuck (nothing was sent).
        MeshTimeoutError
            A chosen rank was still being restarted after ``timeout`` seconds (nothing was sent).
        KeyboardInterrupt
            The caller was interrupted once the cell was on its way: the ranks were interrupted too.
        """
        first = groups[0][0]
        ranks = (sorted(itertools.chain.from_iterable(g[0] for g in groups)) if len(groups) > 1
                 else first if isinstance(first, range) else sorted(first))  # every rank: a range, no list
        self._wait_healed(ranks, what, timeout)
        self._check_alignment(None, ranks)
        handle = self.cells.new(cell_id, ranks, what, order, self, tracks_failures=tracks_failures,
                                rejoin=list(groups) if rejoin else None)
        rec = handle.record
        if not waited:
            return self._send(rec, groups)
        self.claim(rec)
        try:
            return self._send(rec, groups)
        except BaseException:
            with self.state.lock:
                self.cells.set_waiting(rec, False)  # nobody will wait: lines go out as they come
            raise

    def _wait_healed(self, ranks: Sequence[int], what: str, timeout: float | None) -> None:
        """Wait while some of ``ranks`` are being restarted (``MeshState.healing``), in 50 ms slices (SIGINT reaches
        the caller), ``timeout`` seconds at most (then MeshTimeoutError); the healer's own work
        (``MeshState.healer``) does not wait."""
        state = self.state
        noted = False
        healing: list[int] = []
        timeout = timeout if timeout is not None else (state.options.timeout or None)
        deadline = None if timeout is None else time.monotonic() + timeout
        before = state.healed_note  # a note from an earlier healing is not this one's
        try:
            while True:
                with state.lock:
                    healing = (sorted(state.healing.intersection(ranks)) if state.healing and state.running
                               and state.healer is not threading.current_thread() else [])
                    if healing and noted:
                        state.cond.wait(0.05)
                if not healing:
                    if noted and state.healed_note and state.healed_note is not before:  # where the user looks now
                        sys.stderr.write(f"note: {state.healed_note}\n")
                    return
                if deadline is not None and time.monotonic() > deadline:
                    assert timeout is not None
                    raise MeshTimeoutError({r: MonarchError("still being restarted: the cell was not sent to it")
                                            for r in healing}, what=what, timeout=timeout,
                                           hint=healing_timeout_note(healing, what, timeout))
                if not noted:
                    noted = True
                    sys.stderr.write(healing_wait_note(healing, what))
        except KeyboardInterrupt:  # one line, not the controller's frames: nothing was sent
            raise mesh_interrupt(healing_interrupted_note(healing, what)) from None

    def _check_alignment(self, rec: CellRecord | None, ranks: Sequence[int] | None = None) -> None:
        """After a cell that ended with an error or an interrupt (``MeshState.unaligned``): did a rank leave a
        collective in flight that its peers never issued? (``Restarts.check_alignment``: a fresh group then.) What
        was done goes into ``rec``'s error, or, before a new cell is sent to ``ranks``, into a note on stderr."""
        text = self.restarts.check_alignment(rec.ranks if rec is not None else ranks or [])
        if not text:
            return
        if rec is None:
            sys.stderr.write(f"note: {text}\n")
            return
        with self.state.lock:
            self.cells.set_hint(rec, text)

    def claim(self, rec: CellRecord) -> None:
        """This thread writes ``rec``'s lines from now on (after what was queued before it)."""
        self.state.assert_unlocked()
        with self.state.lock:
            self.cells.set_waiting(rec, True)
        self.writer.flush()

    def _send(self, rec: CellRecord, groups: Sequence[Group]) -> CellHandle:
        try:
            self.dispatcher.submit(rec, groups)
        except KeyboardInterrupt:
            with self.state.lock:
                sent = self.state.cells.get(rec.cell_id) is rec
            if not sent:
                raise
            raise self.interrupted(rec) from None
        return rec.handle

    def result(self, rec: CellRecord, timeout: float | None) -> RankMap | None:
        """``handle.result(timeout)``, interrupting the ranks whenever the caller is interrupted (``wait`` checks
        ``timeout``)."""
        try:
            self.wait(rec, timeout, True)
            return self.outcome(rec)
        except KeyboardInterrupt as e:
            if rec.interrupted or isinstance(e, MeshInterrupt):  # the cell's own outcome: an interrupt on its ranks
                raise
            raise self.interrupted(rec) from None

    def wait(self, rec: CellRecord, timeout: float | None, raise_on_timeout: bool) -> bool:
        """Wait for ``rec`` and write its output from this thread; returns True when it finished.

        Raises MeshTimeoutError past ``timeout`` when ``raise_on_timeout``, KeyboardInterrupt when interrupted,
        TypeError or ValueError for a ``timeout`` that is not None or a number of seconds (0: look once).
        """
        check_timeout(timeout, zero=not raise_on_timeout)
        state, cells = self.state, self.cells
        deadline = None if timeout is None else time.monotonic() + timeout
        note_at: float | None = time.monotonic() + QUEUE_NOTE_AFTER
        guard = InterruptGuard()  # an interrupt never cuts a batch of lines short
        try:
            self.claim(rec)
            while True:
                with state.lock:
                    cells.wake_wait(rec, 0.05)
                    self._check_stragglers(rec)
                    failed, running = self.releases.due(rec, time.monotonic())
                    lines = cells.pop_lines(rec)
                    done = rec.all_done
                    behind = []
                    if note_at is not None and time.monotonic() >= note_at:  # once: does it wait behind a cell?
                        note_at = None
                        behind = [r for r in rec.members.without(rec.finished)
                                  if cells.queued_behind(rec, r, background=False)]
                # In the submitter's context: a handle's result() called from a later cell (an --async cell's)
                # writes the lines into the cell that ran it (its view), not into the cell that waits.
                guard.write(lines, rec.ctx)
                if behind:  # an --async cell (block=False) still runs there: say why nothing happens
                    sys.stderr.write(f"note: {ranks_text(behind)} still {plural(behind, 'run', 'runs')} an earlier "
                                     f"cell (sent with block=False or --async); {rec.what} starts there when it "
                                     "ends (%mesh interrupt  stops that cell;  %mesh inspect  reads values now)\n")
                if running:  # a rank raised; do the others wait for it in a collective?
                    self.releases.release(rec, failed, running)
                if done:
                    if rec.collective_released and not rec.collective_hint:
                        self.releases.renew_group(rec)
                    elif rec.errors and not rec.collective_hint:  # a collective left in flight? (a fresh group)
                        self._check_alignment(rec)
                    state.events.flush()  # the views saw the cell end before its result is returned
                    return True
                if self.prompts.has_prompt(rec):  # a rank stopped at breakpoint()
                    paused = self.prompts.serve(rec)
                    deadline = None if deadline is None else deadline + paused  # time at the prompt is not run time
                if deadline is not None and time.monotonic() > deadline:
                    if raise_on_timeout:
                        self._on_timeout(rec, timeout or 0.0)
                    return False
        except KeyboardInterrupt:
            guard.close()
            raise self.interrupted(rec) from None
        finally:
            guard.close()
            with state.lock:
                cells.set_waiting(rec, False)

    def _check_stragglers(self, rec: CellRecord) -> None:
        """Finish ranks whose result came but whose output marker is late, and end the cell
        promptly when a rank died (deaths.py)."""
        self.state.assert_locked()
        now = time.monotonic()
        for r, seen in list(rec.unmarked.items()):  # results in, output markers not yet
            if r in rec.finished:
                del rec.unmarked[r]
            elif now - seen > MARKER_GRACE:
                log.debug("rank %d: output marker of cell %d late; finishing without it", r, rec.cell_id)
                self.cells.finish_rank(rec, r)
        self.deaths.release_survivors(rec, now)

    def interrupted(self, rec: CellRecord) -> KeyboardInterrupt:
        """The caller was interrupted: ``interrupt_cell``, then the KeyboardInterrupt to raise, which holds the
        values of the ranks that had finished (its ``.results``) and says which they are."""
        message = self.interrupt_cell(rec)
        with self.state.lock:
            results = RankMap((r, rec.values.get(r)) for r in rec.ranks
                              if r in rec.finished and r not in rec.errors)
            if rec.all_done:  # nothing more comes for it (a handle's result() still has its values)
                self.cells.forget(rec)
        return mesh_interrupt(message + finished_note(results), results)

    def interrupt_cell(self, rec: CellRecord) -> str:
        """The caller was interrupted: interrupt the ranks still running ``rec`` and wait ``interrupt_grace``.

        Returns what to say in the KeyboardInterrupt: where the ranks stopped (stuck ones are reported on stderr).
        Ranks that had not started the cell (an earlier one, sent with ``block=False``, still runs there) are not
        waited for: they skip it when they reach it.
        """
        state, cells = self.state, self.cells
        grace = state.options.interrupt_grace
        with state.lock:
            running, queued = cells.mark_interrupted(rec)
        if not running:
            return "interrupted"  # the ranks had finished it (``interrupted`` says so)
        started = time.monotonic()

        def left() -> list[int]:
            return [r for r in rec.ranks if r not in rec.finished and r not in queued]

        def wait_slice(timeout: float) -> list:
            cells.wake_wait(rec, timeout)
            return cells.pop_lines(rec)

        self._until_stopped_or_released(rec, running, grace, left, wait_slice)
        with state.lock:
            # What the ranks wrote before they stopped, written here, inside the cell, ahead of its error (queued
            # to the writer it would come after the cell ended, in the next one's output)
            lines = cells.pop_lines(rec)
        write_lines(lines, rec.ctx)
        with state.lock:
            still = cells.abandon(rec)  # nobody waits for it now: later cells must not queue behind it
            stuck = [r for r in still if r not in queued]
            skipped = [r for r in still if r in queued]
            stopped = {r: e for r, e in rec.errors.items()
                       if r in running and isinstance(e, RemoteError) and e.interrupted}
            failed = {r: rec.errors[r] for r in failed_ranks(rec) if r not in rec.released}
        if rec.collective_released and rec.all_done and not stuck:
            self.releases.renew_group(rec)  # a fresh process group, as after a raise
        elif rec.collective_released and not rec.collective_hint:  # Restarts.renew makes it, once they stopped
            with state.lock:
                self.releases.hint_pending(rec)
        elif stuck:  # a rank that stops later releases those that wait for it then (a long finally clause)
            self.releases.watch(rec)
        realigned = ""
        if stuck:
            # A second interrupt ends the wait early: say how long the ranks really had.
            waited = min(grace, time.monotonic() - started)
            sys.stderr.write(self.restarts.stuck_message(stuck, round(waited, 1)))
        elif stopped:  # did one stop between issuing a collective and waiting for it? (a fresh group then)
            realigned = self.restarts.realign(list(stopped)) or ""
            if realigned:
                with state.lock:
                    cells.set_hint(rec, realigned)
        # The cause of a hang is often a rank that raised before a collective the others wait in: name it first,
        # as the root cause.
        cause = [f"{ranks_text([r])} had raised {e.ename}: {e.evalue}" for r, e in failed.items()
                 if isinstance(e, RemoteError)]
        if len(cause) > 1:
            cause = [f"{cause[0]} (and {ranks_text(list(failed)[1:])} raised too)"]
        parts = [*cause, f"interrupted {ranks_text(stopped)} ({keep_state(stopped)}): {where_interrupted(stopped)}"
                 if stopped else f"interrupted; {ranks_text(stuck)} did not stop" if stuck else "interrupted"]
        if realigned:
            parts.append(realigned)
        if rec.collective_hint:
            parts.append(rec.collective_hint)
        if skipped:
            parts.append(f"{ranks_text(skipped)} had not started it ({plural(skipped, 'they', 'it')} still "
                         f"{plural(skipped, 'run', 'runs')} an earlier cell, sent with block=False or --async) and "
                         f"{plural(skipped, 'skip', 'skips')} it")
        return "; ".join(parts)

    def _until_stopped_or_released(self, rec: CellRecord, running: list[int], grace: float,
                                   left: Callable[[], list[int]], wait_slice: Callable[[float], list]) -> None:
        """Wait up to ``grace`` seconds for the interrupted ranks to stop. Those that wait in a collective that the
        ranks the interrupt stopped will never issue in this cell are released as after a rank that raised
        (releases.py: the process group is torn down), asked every ``COLLECTIVE_CHECK`` seconds; once released,
        they get ``grace`` seconds more to stop."""
        end = time.monotonic() + grace
        resend = time.monotonic() + RESEND
        targets, sent = dict.fromkeys(running, rec.cell_id), False
        while True:
            still = self.interrupter.until_stopped(targets, min(COLLECTIVE_CHECK, max(0.0, end - time.monotonic())),
                                                   left, wait_slice, sent=sent)
            if not still:
                return
            targets, sent = dict.fromkeys(still, rec.cell_id), True
            with self.state.lock:  # final for this cell: stopped by the interrupt (or raised), or ended it before
                stopped = self.releases.stopped(rec)
            if stopped:  # asked at least once, however short the grace
                self.releases.release(rec, stopped, still, interrupted=True)
            if rec.collective_released:
                self.interrupter.until_stopped(targets, grace, left, wait_slice, sent=True)
                return
            if time.monotonic() >= end:
                return
            if time.monotonic() >= resend:  # as until_stopped does in a longer wait
                resend = time.monotonic() + RESEND
                self.interrupter.send(targets)

    def _on_timeout(self, rec: CellRecord, timeout: float) -> None:
        state, cells = self.state, self.cells
        grace = state.options.interrupt_grace
        with state.lock:
            late = [r for r in rec.ranks if r not in rec.finished]
            queued = [r for r in late if cells.queued_behind(rec, r)]
        running = [r for r in late if r not in queued]
        where = [self.stacks.ask(running, 5.0).text] if running else []
        if queued:
            where.append(f"{ranks_text(queued)}: not started; an earlier cell (sent with block=False or --async) "
                         f"still runs there, and {plural(queued, 'they skip', 'it skips')} this one")
        self.interrupt_cell(rec)
        with state.lock:
            # A rank that died meanwhile (often why the others waited) is a failure, named first, not a late rank.
            late = [r for r in late if not isinstance(rec.errors.get(r), RankDiedError)]
            errors: dict[int, MonarchError] = {}
            for r in rec.ranks:
                e = rec.errors.get(r)
                if r not in late:
                    if e is not None:
                        errors[r] = e  # failed before the timeout
                elif r not in rec.finished and r in rec.queued_on:
                    errors[r] = RemoteError(r, "TimeoutError", f"not started after {timeout:g} s: an earlier cell "
                                            "(sent with block=False or --async) still runs there; it skips this one")
                elif r not in rec.finished:
                    errors[r] = RemoteError(r, "TimeoutError", f"still running after {timeout:g} s; it did not stop "
                                            f"within {grace:g} s of the interrupt")
                elif isinstance(e, RemoteError) and e.interrupted:
                    errors[r] = RemoteError(r, "TimeoutError", f"interrupted after {timeout:g} s at "
                                            f"{summarize([tuple(f) for f in e.frames])}", e.traceback,
                                            frames=e.frames)
                elif e is not None:
                    errors[r] = e
            results = {r: rec.values.get(r) for r in rec.finished if r not in rec.errors}
            left = [r for r in rec.ranks if r not in rec.finished]
            stuck = [r for r in left if r not in rec.queued_on]
            if not left:
                cells.forget(rec)
        hint = "\n".join(h for h in [f"%mesh interrupt --force --ranks {format_ranks(stuck)}  stops the ranks still "
                                      "running (see the message above)" if stuck else "", rec.collective_hint] if h)
        raise MeshTimeoutError(errors, results, rec.what, "\n".join(where), timeout, hint, late)

    def outcome(self, rec: CellRecord) -> RankMap | None:
        """The cell's results, or raise its error; computed once, then the same answer on every call."""
        final = rec.final
        if final is None:
            try:
                final = (self._compute_outcome(rec), None)
            except BaseException as e:  # noqa: BLE001 - remembered, raised below
                final = (None, e)
            self.cells.set_final(rec, final)
        value, error = final
        if error is not None:
            raise error
        return value

    def _compute_outcome(self, rec: CellRecord) -> RankMap | None:
        with self.state.lock:
            errors, results, valued = self.cells.take_outcome(rec)
        if errors:
            if all(isinstance(e, RemoteError) and e.interrupted for e in errors.values()):
                hint = f"; {rec.collective_hint}" if rec.collective_hint else ""
                raise mesh_interrupt(f"interrupted {ranks_text(errors)} ({keep_state(errors)}): "
                                     f"{where_interrupted(errors)}{finished_note(results)}{hint}", results)
            errors, hint = self.deaths.fold_errors(rec, self.releases.fold_released(rec, errors))
            torn = (f"the process group of {ranks_text(rec.ranks)} was torn down while this cell ran, to release "
                    f"the ranks of another cell ({rec.torn_down}): a collective issued on it since then fails; a "
                    "fresh group is made before the next cell" if rec.torn_down else "")
            hint = "; ".join(h for h in (rec.collective_hint, torn, hint) if h)
            raise MeshError(errors, results, rec.what, hint)
        if not valued:
            return None
        return results
