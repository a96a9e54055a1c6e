"""The writing end of a rank's work pipe (protocol.WORK_FD): messages queued from any thread, never blocking.

Both the notebook kernel (for its local ranks) and a host agent (for the ranks of its host) hold one per rank.
"""

from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import threading
import weakref
from collections import deque

__all__ = ["WorkPipe", "PIPE_SIZE", "BufferCache", "receive_buffers"]

PIPE_SIZE = 1 << 20
"""Bytes asked of the kernel for each work pipe (Linux ``F_SETPIPE_SZ``; capped by /proc/sys/fs/pipe-max-size):
a large push then crosses it in a few writes rather than one per 64 KiB."""


class WorkPipe:
    """The writer's end of a rank's work pipe: ``send`` from any thread never blocks.

    What the pipe cannot take now (the rank is busy and the pipe is full) waits here, in order, until ``flush``
    (the owner's I/O thread, when the pipe is writable: ``fd`` polled for POLLOUT) moves it on.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        try:
            fcntl.fcntl(fd, fcntl.F_SETPIPE_SZ, PIPE_SIZE)
        except (OSError, AttributeError):  # an older kernel, or above pipe-max-size for this user: keep 64 KiB
            pass
        self._lock = threading.Lock()
        self._pending: deque[memoryview] = deque()
        self.closed = False

    def send(self, parts: list) -> bool:
        """Queue one framed message (``protocol.work_message``: its pieces, bytes-like, in order); False when part
        of it waits for ``flush``."""
        with self._lock:
            if self.closed:
                return True  # the rank is gone; its death is reported by whoever reaps it
            if len(parts) == 1 and not self._pending:  # the common case: one small message, the pipe has room
                rest = self._write(memoryview(parts[0]).cast("B"))
                if rest is None:
                    return True
                self._pending.append(rest)
                return False
            views = [memoryview(p).cast("B") for p in parts]
            if not self._pending:
                while views:
                    rest = self._write(views[0])
                    if self.closed:
                        return True
                    if rest is not None:
                        views[0] = rest
                        break
                    views.pop(0)
                if not views:
                    return True
            self._pending.extend(views)
            return False

    def _write(self, view: memoryview) -> memoryview | None:
        """Write what the pipe takes now; the rest, or None when all of it went (or the rank is gone)."""
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except BlockingIOError:
            return view
        except OSError:  # the rank exited (EPIPE): nothing more to deliver
            self.closed = True
            self._pending.clear()
        return None

    def flush(self) -> bool:
        """Write what waits, as far as the pipe takes it; True when nothing waits any more."""
        with self._lock:
            while self._pending and not self.closed:
                rest = self._write(self._pending[0])
                if rest is not None:
                    self._pending[0] = rest
                    return False
                self._pending.popleft()
            return True

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._pending.clear()
                try:
                    os.close(self.fd)
                except OSError:
                    pass


class BufferCache:
    """Anonymous memory for large messages read from a work pipe, recycled once nothing uses it any more.

    Memory a process touches for the first time costs page faults, which on a VM cost several times the copy
    itself (64 MiB: about 60 ms against 10 ms here). The tensors of a large push are built on the buffer the pipe
    filled, so that buffer lives as long as they do; when the last of them is gone its mapping comes back here and
    the next large message is read into pages that already exist. At most ``max_bytes`` wait here (thread-safe:
    buffers come back from finalizers, on any thread).
    """

    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._free: list[mmap.mmap] = []
        self._lock = threading.Lock()

    def take(self, nbytes: int) -> memoryview:
        """``nbytes`` writable bytes (contents undefined), as a memoryview of format "B"."""
        mm = None
        with self._lock:
            for i, cand in enumerate(self._free):
                if nbytes <= len(cand) <= 2 * nbytes:  # never pin a much larger mapping for a small message
                    mm = self._free.pop(i)
                    break
        if mm is None:
            mm = mmap.mmap(-1, nbytes)
            if hasattr(mmap, "MADV_HUGEPAGE"):
                try:
                    mm.madvise(mmap.MADV_HUGEPAGE)
                except OSError:
                    pass
        owner = (ctypes.c_char * len(mm)).from_buffer(mm)  # the exporter whose end says the memory is free
        weakref.finalize(owner, self._give_back, mm)
        return memoryview(owner).cast("B")[:nbytes]

    def _give_back(self, mm: mmap.mmap) -> None:
        with self._lock:
            self._free.append(mm)
            total = sum(len(m) for m in self._free)
            while self._free and total > self.max_bytes:
                total -= len(self._free.pop(0))  # the oldest goes back to the OS

    @property
    def cached_bytes(self) -> int:
        with self._lock:
            return sum(len(m) for m in self._free)


RECEIVE_CACHE_BYTES = 256 << 20
receive_buffers = BufferCache(RECEIVE_CACHE_BYTES)
"""The buffers a rank reads large work messages into (protocol.WorkReader)."""
