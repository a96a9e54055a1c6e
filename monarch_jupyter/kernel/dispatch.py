"""Sending work to ranks: a cell, call or transfer submitted once to its ranks, and single messages.

A local rank gets its work in its *work pipe* (protocol.WORK_FD), straight to the thread that runs it: the
kernel writes the signed message itself, from any thread, and never blocks; what a busy rank's full pipe cannot
take waits in that pipe's queue until the I/O thread writes it (``flush_pipes``). Ranks on other hosts, and
messages that are not work (interrupts, stack requests, debugger input), go over the ROUTER socket, which only the
I/O thread touches: other threads queue them in the ``outbox``.

``submit`` registers a cell with its ranks and sends it, atomically under the mesh lock and with SIGINT held
(an interrupt must not cut a message in half on its way into a work pipe, nor leave some ranks with the cell
and others without). It refuses, sending nothing, when a chosen rank is dead, or still stuck in an abandoned cell
(for code: when any rank is, as a collective of the new code would pair with the stuck one).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from monarch_worker import protocol as P
from monarch_worker.channel import Outbox

from ..errors import MeshError, RankBusyError, RankDiedError
from ..ranks import format_ranks, plural, ranks_text
from .state import MeshState, RankState

if TYPE_CHECKING:
    from .cells import CellHandle
    from .launch.base import WorkPipe

__all__ = ["Dispatcher", "Group", "restart_hint", "sigint_held"]

Group = tuple[list[int], P.Message, bytes, list]  # ranks that get one message (signed once), its payload, buffers

WORK_TYPES = P.work_types()
RECENT_CELLS = 64  # cells whose late rich output still reaches them (MeshState.recent_cells)


def restart_hint(dead: list[int], world_size: int) -> str:
    """What to run to bring ``dead`` ranks (of a mesh of ``world_size`` ranks) back."""
    if len(set(dead)) >= world_size:  # no survivor keeps state: a fresh mesh is the whole answer
        return (f"every rank is dead ({ranks_text(dead)}): %mesh restart  starts a fresh mesh "
                "(mesh.restart() from Python).")
    them = "them" if len(dead) > 1 else "it"
    return (f"{ranks_text(dead)} {'are' if len(dead) > 1 else 'is'} dead and the process group is down: "
            f"%mesh restart --rank {format_ranks(dead)}  starts fresh processes for {them} "
            "(the other ranks keep their state; mesh.restart(ranks=...)), or  %mesh restart  starts a fresh mesh.")


class Dispatcher:
    """Sends work and messages to the ranks of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState) -> None:
        self.state = state
        self.outbox = Outbox()  # (identities, message, payload, buffers) for the I/O thread to send
        self._work_signer: P.Signer | None = None
        self._work_lock = threading.Lock()  # signing order is writing order: ranks check sequence numbers
        self._pipes_waiting: set[WorkPipe] = set()  # work pipes with bytes the I/O thread still has to write

    def new_generation(self, secret: bytes) -> None:
        """A start or restart: a fresh outbox and a signer for the new secret (the last generation's I/O thread
        has stopped: its outbox, and the wake-up pipe it holds, are closed)."""
        old, self.outbox = self.outbox, Outbox()
        old.close()
        self._work_signer = P.Signer(secret)
        self._pipes_waiting = set()

    # ------------------------------------------------------------------ any thread

    def post(self, rank: int, msg: P.Message) -> None:
        """Send ``msg`` (no payload) to ``rank``: work into its work pipe, anything else over the socket."""
        state = self.state
        launcher = state.launcher
        if isinstance(msg, WORK_TYPES) and launcher is not None:
            pipe = launcher.work_pipe(rank)
            if pipe is not None:
                self._send_work([pipe], msg, b"", [])
                return
        info = state.ranks.get(rank)
        if info is not None and info.identity is not None:
            self.outbox.put(([info.identity], msg, b"", []))

    def submit(self, handle: CellHandle, groups: list[Group]) -> None:
        """Register ``handle`` with its ranks and send each group its message; raises KeyboardInterrupt (after
        sending everything) when SIGINT arrived meanwhile.

        Raises
        ------
        MeshError
            A chosen rank is dead (nothing was sent).
        RankBusyError
            Code (a cell or call), on any ranks, while some rank still runs an abandoned cell: a collective in it
            would pair with the stuck one and give wrong results. Other work (a push, a pull), when a chosen rank
            does. Nothing was sent.
        """
        state = self.state
        with sigint_held(), state.lock:
            runs_code = any(isinstance(msg, (P.Exec, P.Call)) for _, msg, _, _ in groups)
            self._check_ranks(handle, runs_code)
            if state.group_down:
                # Cells run on survivors while the process group is broken: say that collectives fail.
                sys.stderr.write(f"note: the process group is down ({state.group_down}): collectives fail until "
                                 "%mesh restart --rank R  (or  %mesh restart)\n")
            state.cells[handle.cell_id] = handle
            state.last_cell = handle
            state.recent_cells[handle.cell_id] = handle  # late rich output still finds its cell (rich.py)
            while len(state.recent_cells) > RECENT_CELLS:
                state.recent_cells.pop(next(iter(state.recent_cells)))
            launcher = state.launcher
            work_pipe = launcher.work_pipe if launcher is not None and launcher.has_work_pipes else None
            infos = state.ranks
            running = RankState.RUNNING
            for group_ranks, msg, payload, buffers in groups:
                identities, pipes = [], []
                for r in group_ranks:
                    info = infos[r]
                    info.cells.append(handle)
                    info.state = running
                    pipe = work_pipe(r) if work_pipe is not None else None
                    if pipe is not None:
                        pipes.append(pipe)
                    else:
                        identities.append(info.identity)
                if pipes:
                    self._send_work(pipes, msg, payload, buffers)
                if identities:
                    self.outbox.put((identities, msg, payload, buffers))

    def _check_ranks(self, handle: CellHandle, runs_code: bool) -> None:
        """Raise when a rank of ``handle`` is dead, or still runs an abandoned cell (for code: when any rank does)."""
        ranks, what, infos = handle.ranks, handle.what, self.state.ranks
        dead = [r for r in ranks if infos[r].state is RankState.DEAD]
        if dead:
            raise MeshError({r: RankDiedError(r, infos[r].returncode, "\n".join(infos[r].last_lines), infos[r].pid,
                                              infos[r].death_reason)
                             for r in dead}, what=what, hint=restart_hint(dead, self.state.nproc), not_run=True)
        busy = self._stuck(sorted(infos) if runs_code else ranks)
        if busy and not runs_code:  # a push or pull: those ranks would get to it only after the stuck cell
            others = format_ranks([r for r in ranks if r not in busy])
            raise RankBusyError(
                f"{what} was not run: {ranks_text(busy)} still {plural(busy, 'run', 'runs')} an earlier cell that was "
                "interrupted or timed out and did not stop (blocked in a collective?), and would get to it only after "
                f"that. Leave {plural(busy, 'them', 'it')} out"
                + (f" (--ranks {others})" if others else "")
                + f", or release {plural(busy, 'them', 'it')}:  %mesh interrupt --force --ranks {format_ranks(busy)}"
                "  (or  %mesh restart).", busy)
        if busy:
            raise RankBusyError(
                f"{what} was not run: {ranks_text(busy)} still {plural(busy, 'run', 'runs')} an earlier cell that was "
                "interrupted or timed out and did not stop (blocked in a collective?); a collective of new code on any "
                f"rank would pair with the one {plural(busy, 'they are', 'it is')} stuck in and give wrong results. "
                f"Run  %mesh stacks  to see where,  %mesh interrupt --force --ranks {format_ranks(busy)}  to release "
                f"{plural(busy, 'them', 'it')}, or  %mesh restart  (%mesh inspect  reads values meanwhile).", busy)

    def _stuck(self, ranks: list[int]) -> list[int]:
        """Those of ``ranks`` that still run a cell that was interrupted or timed out and did not stop (not those
        that had not started it: they skip it)."""
        infos = self.state.ranks
        return [r for r in ranks if r in infos and any(c.abandoned and r not in c.finished and r not in c.queued_on
                                                       for c in infos[r].cells)]

    def _send_work(self, pipes: list[WorkPipe], msg: P.Message, payload: bytes, buffers: list) -> None:
        """Write ``msg`` (signed once) into local ranks' work pipes without blocking; what a full pipe cannot take
        now, the I/O thread writes later, in order."""
        waiting = False
        signer = self._work_signer
        assert signer is not None, "no generation started"
        with self._work_lock:
            data = P.work_message(signer.pack(msg, payload, buffers))
            for pipe in pipes:
                if not pipe.send(data):
                    self._pipes_waiting.add(pipe)
                    waiting = True
        if waiting:
            self.outbox.put(None)  # wakes the I/O thread

    # ------------------------------------------------------------------ I/O thread

    @property
    def pipes_waiting(self) -> bool:
        """Some work pipe holds bytes its rank could not take yet."""
        return bool(self._pipes_waiting)

    def waiting_fds(self) -> list[int]:
        """The work pipes (fds) that hold bytes their rank could not take yet: the I/O thread polls them for
        POLLOUT (I/O thread)."""
        return [pipe.fd for pipe in list(self._pipes_waiting) if not pipe.closed]

    def flush_pipes(self) -> None:
        """Write what waits in work pipes, as far as each pipe takes it (I/O thread).

        Under ``_work_lock``, as ``_send_work`` queues bytes and adds the pipe under it: between a flush that
        emptied a pipe and dropping it from the waiting set, no send may queue new bytes there, or they would wait
        with nobody to write them (tests/unit/test_dispatch_race.py). Writes are non-blocking: the lock is held for
        what each pipe takes at once."""
        with self._work_lock:
            for pipe in list(self._pipes_waiting):
                if pipe.flush():
                    self._pipes_waiting.discard(pipe)

    def drain(self) -> list[tuple[list[Any], P.Message, bytes, list]]:
        """What other threads queued for the socket (I/O thread)."""
        return [item for item in self.outbox.drain() if item is not None]


@contextlib.contextmanager
def sigint_held() -> Iterator[None]:
    """On the main thread: a SIGINT that arrives inside the block is raised (KeyboardInterrupt) when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
