"""Pacing of the thread that reads the ranks' output pipes while output floods in (``ReadPacer``).

A rank's prints go to its pipe unbuffered (monarch_worker.startup: in order with C-level writes), a few hundred bytes
a write. A reader that wakes for each write makes a flood of 400,000 lines some ten thousand reads, each one routed,
labelled and handed on with the kernel's GIL held: the notebook's control channel then waits behind them. While
output floods in, the reader instead rests ``pause`` seconds before it looks at the pipes again, so that each read
takes what gathered meanwhile: a few large reads instead of many small ones, and the GIL free in between.

A trickle of output (a cell's result, a line now and then) is never delayed: the reader rests only once it read at
least ``rate`` bytes a second over its last ``pause`` seconds or more, idle time included. A read that filled its
buffer never makes it rest either: the writer is waiting for the reader then, and resting would only slow it down.
"""

from __future__ import annotations

import time
from collections.abc import Callable

__all__ = ["ReadPacer", "FLOOD_RATE", "FLOOD_PAUSE"]

FLOOD_RATE = 1 << 20
"""Bytes a second of output, all ranks together, from which the reader rests between reads (a flood)."""

FLOOD_PAUSE = 0.01
"""Seconds the reader rests between two looks at the pipes while output floods in (the most a line of a flood
waits for it; a pipe fills in about 40 ms at the rate of a flood of short prints, and a faster writer fills it: then
the reader does not rest)."""


class ReadPacer:
    """Tells the reader thread when to rest (see the module docstring). One reader thread's own: not thread-safe.

    Parameters
    ----------
    rate:
        Bytes a second from which output is a flood.
    pause:
        Seconds to rest before each look at the pipes while it is one.
    clock, sleep:
        Monotonic seconds, and how to wait (tests pass their own).
    """

    def __init__(self, rate: float = FLOOD_RATE, pause: float = FLOOD_PAUSE,
                 clock: Callable[[], float] = time.monotonic, sleep: Callable[[float], None] = time.sleep) -> None:
        self.rate = rate
        self.pause = pause
        self.clock = clock
        self.sleep = sleep
        self.flooding = False
        self.rests = 0  # rests so far
        self._start = clock()
        self._bytes = 0  # read since _start
        self._full = False  # a read since the last look filled its buffer

    def read(self, nbytes: int, full: bool) -> None:
        """The reader read ``nbytes``; ``full``: the read filled its buffer (more is waiting)."""
        self._bytes += nbytes
        self._full = self._full or full

    def before_select(self) -> None:
        """Call before each look at the pipes: rests ``pause`` seconds while output floods in."""
        now = self.clock()
        span = now - self._start
        if span >= self.pause:  # measured over at least one pause (idle time counts: a burst after a rest is not one)
            self.flooding = self._bytes >= self.rate * span
            self._start, self._bytes = now, 0
        full, self._full = self._full, False
        if self.flooding and not full:
            self.rests += 1
            self.sleep(self.pause)
