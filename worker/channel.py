"""A thread-safe outbox drained by the thread that owns a ZeroMQ socket.

ZeroMQ sockets must be used by one thread only. Other threads put items here; the owning I/O thread polls
``wake_fd`` together with its socket and sends what ``drain`` returns, in the order the items were put.
"""

from __future__ import annotations

import os
import queue
from typing import Any

__all__ = ["Outbox"]


class Outbox:
    """FIFO of outgoing items; ``put`` from any thread, ``drain`` from the owning I/O thread only."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)

    def put(self, item: Any) -> None:
        self._q.put(item)
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:
            pass  # the pipe already holds wake-ups

    def drain(self) -> list:
        try:
            os.read(self.wake_fd, 65536)
        except BlockingIOError:
            pass
        items = []
        while True:
            try:
                items.append(self._q.get_nowait())
            except queue.Empty:
                return items

    def close(self) -> None:
        for fd in (self.wake_fd, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
