"""``Interrupter``: the one way the controller interrupts what ranks run.

An interrupt is an ``Interrupt(cell_id)`` message to each rank; the rank's I/O thread raises KeyboardInterrupt in
its main thread if it still runs that cell. A SIGINT that lands just before a blocking call starts (``time.sleep``,
a socket read) waits for that call to end, so the interrupt is sent again every ``RESEND`` seconds to the ranks that
still run the cell, until they stop or the grace period is over. The caller's own interrupt (a second Ctrl-C) ends
the wait early.

Used for the cell the caller waits for (waiting.py), for ``%mesh interrupt`` (recovery.py) and, once, for the
survivors of a rank's death (deaths.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from monarch_worker import protocol as P

from .dispatch import Dispatcher
from .output import write_lines
from .records import Line
from .state import MeshState

__all__ = ["Interrupter", "RESEND", "SLICE"]

RESEND = 1.0  # seconds between interrupts sent to ranks that still run what was interrupted
SLICE = 0.05  # seconds of each wait, so that the caller's SIGINT is seen promptly


class Interrupter:
    """Interrupts cells on ranks and waits for them to stop (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher

    def send(self, targets: dict[int, int]) -> None:
        """Interrupt cell ``targets[rank]`` on each rank (any thread, any lock)."""
        for rank, cell_id in targets.items():
            self.dispatcher.post(rank, P.Interrupt(cell_id))

    def until_stopped(self, targets: dict[int, int], grace: float, running: Callable[[], list[int]],
                      wait_slice: Callable[[float], list[Line]], sent: bool = False) -> list[int]:
        """Interrupt ``targets`` (rank -> cell id; ``sent``: the caller just did) and wait up to
        ``grace`` seconds for them to stop.

        ``running`` (called under the lock) says which ranks of ``targets`` still run their cell; ``wait_slice``
        (under the lock) waits at most the seconds it is given on a condition of the mesh lock and returns lines to
        write (written here, outside the lock). Returns the ranks still running at the end.
        """
        self.state.assert_unlocked()
        state = self.state
        if not sent:
            self.send(targets)
        now = time.monotonic()
        deadline, resend = now + grace, now + RESEND
        try:
            while time.monotonic() < deadline:
                with state.lock:
                    left = running()
                    if not left:
                        break
                    lines = wait_slice(SLICE)
                    if time.monotonic() >= resend:
                        resend = time.monotonic() + RESEND
                        self.send({r: targets[r] for r in running()})
                write_lines(lines)
        except KeyboardInterrupt:
            pass  # a second interrupt: stop waiting now
        with state.lock:
            return running()
