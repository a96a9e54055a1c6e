"""Sending work to ranks: a cell, call or transfer submitted once to its ranks, and single messages.

A local rank gets its work in its *work pipe* (protocol.WORK_FD), straight to the thread that runs it: the
kernel writes the signed message itself, from any thread, and never blocks; what a busy rank's full pipe cannot
take waits in that pipe's queue until the I/O thread writes it (``flush_pipes``). Ranks on other hosts, and
messages that are not work (interrupts, stack requests, debugger input), go over the ROUTER socket, which only the
I/O thread touches: other threads queue them in the ``outbox``.

``submit`` registers a cell with its ranks (cells.CellTable) and sends it, with SIGINT held (an interrupt must not
cut a message in half on its way into a work pipe, nor leave some ranks with the cell and others without). It
refuses, sending nothing, when a chosen rank is dead, or still stuck in an abandoned cell (for code: when any rank
is in the process group of a chosen rank: the mesh's, or a sub-mesh's, as a collective of the new code would
pair with the stuck one).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any

from monarch_worker import protocol as P
from monarch_worker.channel import Outbox

from ..errors import MeshError, RankBusyError, RankDiedError
from .cells import CellTable
from .hints import busy_message, group_down_note, restart_hint
from .records import CellRecord
from .state import MeshState, RankState

if TYPE_CHECKING:
    from .launch.base import WorkPipe

__all__ = ["Dispatcher", "Group", "ToRanks", "sigint_held"]

Group = tuple[Sequence[int], P.Message, bytes, list]  # ranks that get one message (signed once), its payload, buffers


class ToRanks:
    """Recipients named by rank (sorted), not by identity: the I/O thread routes them per host agent without a
    step per rank (iothread.IOThread, launch/hosts.HostLinks.deliver_ranks)."""

    __slots__ = ("ranks",)

    def __init__(self, ranks: Sequence[int]) -> None:
        self.ranks = ranks

WORK_TYPES = P.work_types()
class Dispatcher:
    """Sends work and messages to the ranks of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, cells: CellTable) -> None:
        self.state = state
        self.cells = cells
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

    def submit(self, rec: CellRecord, groups: Sequence[Group]) -> None:
        """Register ``rec`` with its ranks and send each group its message; raises KeyboardInterrupt (after
        sending everything) when SIGINT arrived meanwhile.

        Lock order: the work lock (writing order is signing order), then the mesh lock, which is held only to check
        and register; the messages are signed and written after it is released, still under the work lock, so that
        every rank gets its cells in the order they were registered.

        Raises
        ------
        MeshError
            A chosen rank is dead (nothing was sent).
        RankBusyError
            Code (a cell or call), while some rank of its process group (the mesh, or its sub-mesh) still runs an
            abandoned cell: a collective in it
            would pair with the stuck one and give wrong results. Other work (a push, a pull), when a chosen rank
            does. Nothing was sent.
        """
        state = self.state
        with sigint_held(), self._work_lock:
            with state.lock:
                runs_code = any(isinstance(msg, (P.Exec, P.Call)) for _, msg, _, _ in groups)
                self._check_ranks(rec, runs_code)
                # its process groups' (split: its sub-mesh's); no step per rank while every group is fine
                down = state.down_for(state.peers(rec.ranks)) if state.down else ""
                self.cells.register(rec)
                launcher = state.launcher
                work_pipe = launcher.work_pipe if launcher is not None and launcher.has_work_pipes else None
                sends: list[tuple[list[WorkPipe], Any, P.Message, bytes, list]] = []
                for group_ranks, msg, payload, buffers in groups:
                    if work_pipe is None:  # every rank over the socket: the I/O thread routes them by host
                        sends.append(([], ToRanks(group_ranks), msg, payload, buffers))
                        continue
                    pipes = [p for r in group_ranks if (p := work_pipe(r)) is not None]
                    identities = [state.ranks[r].identity for r in group_ranks if work_pipe(r) is None]
                    sends.append((pipes, identities, msg, payload, buffers))
            if down and state.healer is not threading.current_thread():  # survivors run cells: collectives fail
                sys.stderr.write(group_down_note(down))
            for pipes, identities, msg, payload, buffers in sends:
                if pipes:
                    self._write_work(pipes, msg, payload, buffers)
                if identities:
                    self.outbox.put((identities, msg, payload, buffers))

    def resend(self, ranks: list[int], msg: P.Message, payload: bytes, buffers: list) -> None:
        """Send ``msg`` with its payload to ``ranks`` again, registering nothing: a cell that a replacement rejoins
        (healing.py), whose record has it already (``CellTable.rejoin``)."""
        state = self.state
        with self._work_lock:
            with state.lock:
                launcher = state.launcher
                work_pipe = launcher.work_pipe if launcher is not None and launcher.has_work_pipes else None
                pipes = [p for r in ranks if work_pipe is not None and (p := work_pipe(r)) is not None]
                identities = [state.ranks[r].identity for r in ranks if work_pipe is None or work_pipe(r) is None]
            if pipes:
                self._write_work(pipes, msg, payload, buffers)
            if identities:
                self.outbox.put((identities, msg, payload, buffers))

    def _check_ranks(self, rec: CellRecord, runs_code: bool) -> None:
        """Under the lock: raise when a rank of ``rec`` is dead, or still runs an abandoned cell (for code: when any
        rank does)."""
        self.state.assert_locked()
        ranks, what, infos = rec.ranks, rec.what, self.state.ranks
        # state.dead_ranks may name a rank whose handle was replaced since (a restart): its handle says
        dead = sorted(r for r in self.state.dead_ranks if r in rec.members and infos[r].base_state is RankState.DEAD)
        if dead:
            raise MeshError({r: RankDiedError(r, infos[r].returncode, "\n".join(infos[r].last_lines), infos[r].pid,
                                              infos[r].death_reason)
                             for r in dead}, what=what, hint=restart_hint(dead, self.state.nproc), not_run=True)
        if not any(c.abandoned for c in self.state.pending.values()):
            return  # no rank is stuck in a cell
        busy = self.state.stuck(self.state.peers(ranks) if runs_code else ranks)  # code: its process group's ranks
        if busy:
            raise RankBusyError(busy_message(what, busy, [r for r in ranks if r not in busy], runs_code), busy)

    def _send_work(self, pipes: list[WorkPipe], msg: P.Message, payload: bytes, buffers: list) -> None:
        """Write ``msg`` (signed once) into local ranks' work pipes without blocking; what a full pipe cannot take
        now, the I/O thread writes later, in order."""
        with self._work_lock:
            self._write_work(pipes, msg, payload, buffers)

    def _write_work(self, pipes: list[WorkPipe], msg: P.Message, payload: bytes, buffers: list) -> None:
        """``_send_work`` with the work lock held by the caller."""
        signer = self._work_signer
        assert signer is not None, "no generation started"
        data = P.work_message(signer.pack(msg, payload, buffers))
        waiting = False
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
