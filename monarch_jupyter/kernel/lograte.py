"""Warnings that a stranger can cause, logged at a bounded rate.

Anyone who can reach the controller's port can send it messages: each one that fails the mesh's signature, replays
an old one, or comes from a peer that never said hello is rejected, every time. Its warning, which ipykernel shows in
the running cell, is logged for the first ``burst`` of each kind per ``period`` seconds only; past them one line per
period gives the count. While such a flood goes on, later periods log only that count.

A log call opts in with ``extra=lograte.kind("messages dropped by the controller")``; other records pass untouched.
``REJECTED`` is the filter the controller's loggers share; the I/O thread calls ``REJECTED.flush()`` once per
heartbeat interval so that a count is logged when its period ends even if no further message comes.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RateLimit", "REJECTED", "kind"]

ATTR = "monarch_rate_limit"  # the LogRecord attribute naming a record's kind


def kind(what: str) -> dict[str, str]:
    """``extra=`` for a log call whose records are rate-limited as one kind, described by ``what`` (plural noun
    phrase, used in the count line: "245 more messages dropped by the controller in the last 60 s")."""
    return {ATTR: what}


@dataclass
class _Window:
    logger: str
    start: float
    burst: int  # records of this window that may still be logged
    suppressed: int = 0


class RateLimit(logging.Filter):
    """A ``logging.Filter``: per kind, the first ``burst`` records of each ``period`` (seconds) pass, the rest are
    counted, and the count is logged once the period ends. Thread-safe.

    Parameters
    ----------
    burst:
        Records of a kind logged in full per period (once a flood goes on past a period: none, only counts).
    period:
        Seconds of one period.
    clock:
        Monotonic seconds (tests pass their own).
    """

    def __init__(self, burst: int = 5, period: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__()
        self.burst = burst
        self.period = period
        self.clock = clock
        self.seen: dict[str, int] = {}  # kind -> records seen in all (logged or not)
        self._windows: dict[str, _Window] = {}
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        what = getattr(record, ATTR, None)
        if what is None:
            return True
        now = self.clock()
        counts: list[tuple[str, str, int]] = []
        with self._lock:
            self.seen[what] = self.seen.get(what, 0) + 1
            window = self._windows.get(what)
            if window is not None and now - window.start >= self.period:
                counts.append(self._close(what, window, now))
                window = self._windows.get(what)
            if window is None:
                window = self._windows[what] = _Window(record.name, now, self.burst)
            if window.burst > 0:
                window.burst -= 1
                if window.burst == 0:
                    record.msg = f"{record.msg} (more like this are counted, not logged, for {self.period:.0f} s)"
                passed = True
            else:
                window.suppressed += 1
                passed = False
        self._log_counts(counts)
        return passed

    def flush(self, now: float | None = None) -> None:
        """Log the count of every period that has ended (any thread; the I/O thread calls it periodically)."""
        now = self.clock() if now is None else now
        with self._lock:
            counts = [self._close(what, w, now) for what, w in list(self._windows.items())
                      if now - w.start >= self.period]
        self._log_counts(counts)

    def _close(self, what: str, window: _Window, now: float) -> tuple[str, str, int]:
        """End ``window`` (lock held): a flood that goes on gets a window without burst, a calm one none at all."""
        del self._windows[what]
        if window.suppressed:
            self._windows[what] = _Window(window.logger, now, 0)
        return window.logger, what, window.suppressed

    def _log_counts(self, counts: list[tuple[str, str, int]]) -> None:
        for logger, what, n in counts:
            if n:
                logging.getLogger(logger).warning("%d more %s in the last %.0f s (each one rejected)", n, what,
                                                  self.period)


REJECTED = RateLimit()
"""The filter of the controller's warnings about messages and ranks it rejected."""
