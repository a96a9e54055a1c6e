"""Waiting for a cell: its output written from the waiting thread, interrupts, timeouts, the outcome.

The caller's thread (the kernel's main thread in a notebook) waits on the cell's condition in 50 ms slices, so
SIGINT (the notebook's interrupt) always reaches it, and writes the cell's output lines itself as they arrive.
When the caller is interrupted, the ranks still running the cell are interrupted too (and again every
``INTERRUPT_RESEND`` seconds: a SIGINT that lands just before a blocking call waits for that call to end); the
ranks get ``interrupt_grace`` seconds to stop, and those that do not are reported as stuck. A cell that runs past
its timeout is interrupted the same way and raises ``MeshTimeoutError`` with each rank's stack.

A rank stopped at ``breakpoint()`` is served by the debugger from this thread (``Prompts``): time at the prompt
does not count against the cell's timeout.
"""

from __future__ import annotations

import logging
import sys
import time
from typing import Protocol

from monarch_worker import protocol as P

from ..errors import MeshError, MeshTimeoutError, MonarchError, RemoteError, mesh_interrupt
from ..ranks import RankMap, format_ranks, plural, ranks_text
from .cells import CellHandle
from .dispatch import Dispatcher, Group
from .output import write_lines
from .recovery import Recovery, failed_ranks, keep_state, where_interrupted
from .stacks import StackRequests, summarize
from .state import MeshState

log = logging.getLogger(__name__)

__all__ = ["Waiter", "Prompts", "INTERRUPT_RESEND", "MARKER_GRACE"]

INTERRUPT_RESEND = 1.0  # seconds between interrupts sent to ranks that still run an interrupted cell
QUEUE_NOTE_AFTER = 1.0  # seconds a waited-for cell waits behind an earlier one before a note says so
MARKER_GRACE = 1.0  # seconds a rank's output marker may lag its result before the rank is finished without it


def finished_note(results: dict) -> str:
    """What an interrupt's message adds about the ranks that had finished the cell (their values: ``results``)."""
    if not results:
        return ""
    values = plural(results, "their values", "its value")
    return f"; {ranks_text(results)} had finished ({values}: the exception's .results)"


class Prompts(Protocol):
    """Debugger prompts of ranks stopped at ``breakpoint()`` (debugger.MeshDebugger)."""

    def has_prompt(self, cell: CellHandle) -> bool: ...

    def serve(self, cell: CellHandle) -> float: ...


class Waiter:
    """Submits cells and waits for them (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, stacks: StackRequests, recovery: Recovery) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.stacks = stacks
        self.recovery = recovery
        self.prompts: Prompts | None = None

    def submit(self, cell_id: int, groups: list[Group], what: str, order: str = "arrival",
               tracks_failures: bool = True, waited: bool = False) -> CellHandle:
        """Send one cell (``groups``: ranks that get the same message) and return its handle. ``order``: see
        ``Mesh.run``; ``tracks_failures``: its failures are the ones post-mortem opens; ``waited``: the caller
        waits for it next (``wait``), so its lines are held for that thread from the start (folding and rank
        order then see every line, also those a fast rank writes before the caller is back).

        Raises
        ------
        MeshError, RankBusyError
            A chosen rank is dead or stuck (nothing was sent).
        KeyboardInterrupt
            The caller was interrupted once the cell was on its way: the ranks were interrupted too.
        """
        ranks = sorted(r for group in groups for r in group[0])
        handle = CellHandle(self.state, self, cell_id, ranks, what, order)
        handle.tracks_failures = tracks_failures
        if not waited:
            return self._send(handle, groups)
        with self.state.lock:
            handle.set_waiting(True)
        try:
            return self._send(handle, groups)
        except BaseException:
            with self.state.lock:
                handle.set_waiting(False)  # nobody will wait: lines go out as they come
            raise

    def _send(self, handle: CellHandle, groups: list[Group]) -> CellHandle:
        cell_id, ranks = handle.cell_id, handle.ranks
        try:
            self.dispatcher.submit(handle, groups)
        except KeyboardInterrupt:
            with self.state.lock:
                sent = self.state.cells.get(cell_id) is handle
            if not sent:
                raise
            raise self.interrupted(handle) from None
        # From here on the ranks run it: an interrupt that lands before the caller waits must reach them too
        # (a fast cell's first output can be on screen, and interrupted, before that).
        try:
            self.state.events.emit("cell_started", cell_id=cell_id, ranks=ranks, handle=handle)
        except KeyboardInterrupt:
            raise self.interrupted(handle) from None
        return handle

    def result(self, handle: CellHandle, timeout: float | None) -> RankMap | None:
        """``handle.result(timeout)``, interrupting the ranks whenever the caller is interrupted."""
        try:
            return handle.result(timeout)
        except KeyboardInterrupt as e:
            if handle.interrupted or hasattr(e, "results"):  # the cell's own outcome: an interrupt on its ranks
                raise
            raise self.interrupted(handle) from None

    def wait(self, cell: CellHandle, timeout: float | None, raise_on_timeout: bool) -> bool:
        """Wait for ``cell`` and write its output from this thread; returns True when it finished.

        Raises MeshTimeoutError past ``timeout`` when ``raise_on_timeout``, KeyboardInterrupt when interrupted.
        """
        state = self.state
        deadline = None if timeout is None else time.monotonic() + timeout
        note_at: float | None = time.monotonic() + QUEUE_NOTE_AFTER
        try:
            with state.lock:
                cell.set_waiting(True)
            while True:
                with state.lock:
                    cell.wake_wait(0.05)
                    self._check_stragglers(cell)
                    failed, running = self.recovery.waiting_for_failed(cell, time.monotonic())
                    lines = cell.pop_lines()
                    done = cell.all_done
                    behind = []
                    if note_at is not None and time.monotonic() >= note_at:  # once: does it wait behind a cell?
                        note_at = None
                        behind = [r for r in cell.ranks if r not in cell.finished
                                  and cell.queued_behind(r, background=False)]
                write_lines(lines)
                if behind:  # an --async cell (block=False) still runs there: say why nothing happens
                    sys.stderr.write(f"note: {ranks_text(behind)} still {plural(behind, 'run', 'runs')} an earlier "
                                     f"cell (sent with block=False or --async); {cell.what} starts there when it "
                                     "ends (%mesh interrupt  stops that cell;  %mesh inspect  reads values now)\n")
                if running:  # a rank raised; do the others wait for it in a collective?
                    self.recovery.release_collective(cell, failed, running)
                if done:
                    if cell.collective_released and not cell.collective_hint:
                        cell.collective_hint = self.recovery.renew_group(cell)
                    state.events.flush()  # the views saw the cell end before its result is returned
                    return True
                if self.prompts is not None and self.prompts.has_prompt(cell):  # a rank stopped at breakpoint()
                    paused = self.prompts.serve(cell)
                    deadline = None if deadline is None else deadline + paused  # time at the prompt is not run time
                if deadline is not None and time.monotonic() > deadline:
                    if raise_on_timeout:
                        self._on_timeout(cell, timeout or 0.0)
                    return False
        except KeyboardInterrupt:
            raise self.interrupted(cell) from None
        finally:
            with state.lock:
                cell.set_waiting(False)

    def _check_stragglers(self, cell: CellHandle) -> None:
        """Under the lock: finish ranks whose result came but whose output marker is late, and end the cell
        promptly when a rank died (recovery.py)."""
        now = time.monotonic()
        for r in cell.results_in - cell.finished:  # results in, output markers not yet
            if now - cell.result_seen_at[r] > MARKER_GRACE:
                log.debug("rank %d: output marker of cell %d late; finishing without it", r, cell.cell_id)
                cell.finish_rank(r)
        self.recovery.release_survivors(cell, now)

    def interrupted(self, cell: CellHandle) -> KeyboardInterrupt:
        """The caller was interrupted: ``interrupt_cell``, then the KeyboardInterrupt to raise, which holds the
        values of the ranks that had finished (its ``.results``) and says which they are."""
        message = self.interrupt_cell(cell)
        with self.state.lock:
            results = RankMap((r, cell.values.get(r)) for r in cell.ranks
                              if r in cell.finished and r not in cell.errors)
            if cell.all_done:  # nothing more comes for it (a handle's result() still has its values)
                self.state.cells.pop(cell.cell_id, None)
        return mesh_interrupt(message + finished_note(results), results)

    def interrupt_cell(self, cell: CellHandle) -> str:
        """The caller was interrupted: interrupt the ranks still running ``cell`` and wait ``interrupt_grace``.

        Returns what to say in the KeyboardInterrupt: where the ranks stopped (stuck ones are reported on stderr).
        Ranks that had not started the cell (an earlier one, sent with ``block=False``, still runs there) are not
        waited for: they skip it when they reach it.
        """
        state, post = self.state, self.dispatcher.post
        grace = state.options.interrupt_grace
        with state.lock:
            cell.interrupted = True
            running = [r for r in cell.ranks if r not in cell.finished]
            cell.queued_on = {r for r in running if cell.queued_behind(r)}
            for r in running:
                post(r, P.Interrupt(cell.cell_id))
        if not running:
            return "interrupted"  # the ranks had finished it (``interrupted`` says so)
        queued = cell.queued_on
        started = time.monotonic()
        deadline = started + grace
        resend = started + INTERRUPT_RESEND
        try:
            while time.monotonic() < deadline:
                with state.lock:
                    if all(r in cell.finished or r in queued for r in cell.ranks):
                        break
                    cell.wake_wait(0.05)
                    lines = cell.pop_lines()
                    if time.monotonic() >= resend:
                        # A SIGINT that lands just before a rank's blocking call starts (time.sleep, a socket
                        # read) waits for that call to end: a second one interrupts the call itself.
                        resend = time.monotonic() + INTERRUPT_RESEND
                        for r in cell.ranks:
                            if r not in cell.finished:
                                post(r, P.Interrupt(cell.cell_id))
                write_lines(lines)
        except KeyboardInterrupt:
            pass  # a second interrupt: stop waiting now
        with state.lock:
            left = [r for r in cell.ranks if r not in cell.finished]
            cell.abandoned = bool(left)  # nobody waits for it now: later cells must not queue behind it
            stuck = [r for r in left if r not in queued]
            skipped = [r for r in left if r in queued]
            stopped = {r: e for r, e in cell.errors.items()
                       if r in running and isinstance(e, RemoteError) and e.interrupted}
            failed = {r: cell.errors[r] for r in failed_ranks(cell)}
        if stuck:
            # A second interrupt ends the wait early: say how long the ranks really had.
            waited = min(grace, time.monotonic() - started)
            sys.stderr.write(self.recovery.stuck_message(stuck, round(waited, 1)))
        # The cause of a hang is often a rank that raised before a collective the others wait in: name it.
        # First, as the root cause.
        cause = [f"{ranks_text([r])} had raised {e.ename}: {e.evalue}" for r, e in failed.items()
                 if isinstance(e, RemoteError)]
        if len(cause) > 1:
            cause = [f"{cause[0]} (and {ranks_text(list(failed)[1:])} raised too)"]
        parts = [*cause, f"interrupted {ranks_text(stopped)} ({keep_state(stopped)}): {where_interrupted(stopped)}"
                 if stopped else f"interrupted; {ranks_text(stuck)} did not stop" if stuck else "interrupted"]
        if skipped:
            parts.append(f"{ranks_text(skipped)} had not started it ({plural(skipped, 'they', 'it')} still "
                         f"{plural(skipped, 'run', 'runs')} an earlier cell, sent with block=False or --async) and "
                         f"{plural(skipped, 'skip', 'skips')} it")
        return "; ".join(parts)

    def _on_timeout(self, cell: CellHandle, timeout: float) -> None:
        state = self.state
        grace = state.options.interrupt_grace
        with state.lock:
            late = [r for r in cell.ranks if r not in cell.finished]
            queued = [r for r in late if cell.queued_behind(r)]
        running = [r for r in late if r not in queued]
        where = [self.stacks.ask(running, 5.0).text] if running else []
        if queued:
            where.append(f"{ranks_text(queued)}: not started; an earlier cell (sent with block=False or --async) "
                         f"still runs there, and {plural(queued, 'they skip', 'it skips')} this one")
        self.interrupt_cell(cell)
        with state.lock:
            errors: dict[int, MonarchError] = {}
            for r in cell.ranks:
                e = cell.errors.get(r)
                if r not in late:
                    if e is not None:
                        errors[r] = e  # failed before the timeout
                elif r not in cell.finished and r in cell.queued_on:
                    errors[r] = RemoteError(r, "TimeoutError", f"not started after {timeout:g} s: an earlier cell "
                                            "(sent with block=False or --async) still runs there; it skips this one")
                elif r not in cell.finished:
                    errors[r] = RemoteError(r, "TimeoutError", f"still running after {timeout:g} s; it did not stop "
                                            f"within {grace:g} s of the interrupt")
                elif isinstance(e, RemoteError) and e.interrupted:
                    errors[r] = RemoteError(r, "TimeoutError", f"interrupted after {timeout:g} s at "
                                            f"{summarize([tuple(f) for f in e.frames])}", e.traceback,
                                            frames=e.frames)
                elif e is not None:
                    errors[r] = e
            results = {r: cell.values.get(r) for r in cell.finished if r not in cell.errors}
            left = [r for r in cell.ranks if r not in cell.finished]
            stuck = [r for r in left if r not in cell.queued_on]
            if not left:
                state.cells.pop(cell.cell_id, None)
        hint = (f"%mesh interrupt --force --ranks {format_ranks(stuck)}  stops the ranks still running "
                "(see the message above)" if stuck else "")
        raise MeshTimeoutError(errors, results, cell.what, "\n".join(where), timeout, hint, late)

    def outcome(self, cell: CellHandle) -> RankMap | None:
        """The cell's results, or raise its error; computed once, then the same answer on every call."""
        final = cell.final
        if final is None:
            try:
                final = (self._compute_outcome(cell), None)
            except BaseException as e:  # noqa: BLE001 - remembered, raised below
                final = (None, e)
            if cell.keep_outcome:  # a handle the caller holds (block=False): result() may be asked again
                cell.final = final
        value, error = final
        if error is not None:
            raise error
        return value

    def _compute_outcome(self, cell: CellHandle) -> RankMap | None:
        state = self.state
        with state.lock:
            state.cells.pop(cell.cell_id, None)
            errors = dict(cell.errors)
            valued = errors or any(cell.has_value.values())
            results = (RankMap((r, cell.values.get(r)) for r in cell.ranks if r in cell.finished and r not in errors)
                       if valued else RankMap())
            cell.values = {}  # the handle may live on (late output); the results belong to the caller now
        if errors:
            if all(isinstance(e, RemoteError) and e.interrupted for e in errors.values()):
                raise mesh_interrupt(f"interrupted {ranks_text(errors)} ({keep_state(errors)}): "
                                     f"{where_interrupted(errors)}{finished_note(results)}", results)
            errors, hint = self.recovery.fold_errors(cell, self.recovery.fold_released(cell, errors))
            hint = "; ".join(h for h in (cell.collective_hint, hint) if h)
            raise MeshError(errors, results, cell.what, hint)
        if not valued:
            return None
        return results
