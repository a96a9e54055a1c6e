"""Giving freed heap memory back to the OS once a process goes idle.

glibc's malloc keeps memory a program freed for its next allocations: blocks freed below the top of a heap stay
mapped, and after a large block allocated with mmap is freed, the mmap threshold rises to its size (up to 32 MiB on
64-bit, mallopt(3) ``M_MMAP_THRESHOLD``), so later blocks of up to that size come from the heap and stay resident
after they are freed. A rank that ran a cell allocating and freeing tens of MiB of tensors (or a kernel that pulled
them) keeps that much more RSS, never used again while the notebook sits between cells. ``malloc_trim(0)`` (glibc
2.8+: it also releases free pages inside every arena with ``madvise(MADV_DONTNEED)``) gives it back; Dask's workers
do the same for the same reason (distributed's docs, "Worker memory management: memory not released back to the
OS").

A trim runs only once a process has been idle ``IDLE_DELAY`` seconds after work that may have freed memory, never
on a cell's path, so a training loop does not pay for the pages it would fault in again. Elsewhere than glibc
(musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import threading
import time
from typing import Any

__all__ = ["IDLE_DELAY", "IdleTrim", "trim"]

IDLE_DELAY = 2.0  # seconds without work before freed heap memory goes back to the OS

_malloc_trim: Any = None
_loaded = False
_load_lock = threading.Lock()


def _load() -> Any:
    global _malloc_trim, _loaded
    with _load_lock:
        if not _loaded:
            _loaded = True
            try:
                libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
                fn = libc.malloc_trim
                fn.argtypes, fn.restype = [ctypes.c_size_t], ctypes.c_int
                _malloc_trim = fn
            except (OSError, AttributeError):  # not glibc: nothing to call
                _malloc_trim = None
    return _malloc_trim


def trim() -> bool:
    """Return free heap memory to the OS (glibc ``malloc_trim(0)``); False where there is no such call.

    Thread-safe (malloc takes each arena's lock in turn); costs about a millisecond per hundred MiB released.
    """
    fn = _load()
    if fn is None:
        return False
    fn(0)
    return True


class IdleTrim:
    """When a trim is due: ``IDLE_DELAY`` seconds after the last work that may have freed memory.

    The thread that waits for work calls ``worked()`` when work ends, waits at most ``timeout()`` seconds for the
    next, and calls ``maybe_trim()`` when none came. Thread-safe.

    Parameters
    ----------
    delay:
        Seconds of idleness after work before the trim.
    """

    def __init__(self, delay: float = IDLE_DELAY) -> None:
        self.delay = delay
        self.trims = 0  # trims done (for tests and benchmarks)
        self._due: float | None = None  # time.monotonic() at which a trim is due; None: nothing to trim
        self._lock = threading.Lock()

    def worked(self) -> None:
        """Work ended now: trim once ``delay`` seconds pass without more."""
        with self._lock:
            self._due = time.monotonic() + self.delay

    def timeout(self) -> float | None:
        """Seconds until the trim is due (0.0 when it is); None when nothing is pending."""
        with self._lock:
            return None if self._due is None else max(0.0, self._due - time.monotonic())

    def maybe_trim(self) -> bool:
        """Trim if one is due; True when it ran."""
        with self._lock:
            if self._due is None or time.monotonic() < self._due:
                return False
            self._due = None
            self.trims += 1
        trim()
        return True
