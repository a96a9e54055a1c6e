"""Queues between threads that a consumer can wait on together with sockets and pipes.

ZeroMQ sockets must be used by one thread only. Other threads put items in an ``Outbox``; the owning I/O thread
polls ``wake_fd`` together with its socket and sends what ``drain`` returns, in the order the items were put. A
``Mailbox`` is the same queue for a consumer that takes one item at a time (a rank's main thread, which waits on
its work pipe as well).
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

import zmq

__all__ = ["Outbox", "Mailbox", "send_frames", "recv_frames"]


class _WakeQueue:
    """A FIFO whose ``wake_fd`` becomes readable when an item is put (``put`` from any thread)."""

    def __init__(self) -> None:
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self.wake_fd, self._wake_w = os.pipe()
        os.set_blocking(self.wake_fd, False)
        os.set_blocking(self._wake_w, False)
        self._closing = threading.Lock()  # a put never writes to a descriptor that close() gave back

    def put(self, item: Any) -> None:
        self._q.put(item)
        with self._closing:
            if self._wake_w < 0:
                return  # closed: nobody waits on it any more
            try:
                os.write(self._wake_w, b"\0")
            except BlockingIOError:
                pass  # the pipe already holds wake-ups

    def clear_wake(self) -> None:
        """Consume the wake-ups ``wake_fd`` holds (look for items after: one put meanwhile has lost its own)."""
        try:
            os.read(self.wake_fd, 65536)
        except BlockingIOError:
            pass

    def get_nowait(self) -> Any:
        """The next item, or None (no system call)."""
        try:
            return self._q.get_nowait()
        except queue.Empty:
            return None

    def close(self) -> None:
        with self._closing:
            fds, self._wake_w = (self.wake_fd, self._wake_w), -1
        for fd in fds:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.wake_fd = -1


class Outbox(_WakeQueue):
    """FIFO of outgoing items; ``put`` from any thread, ``drain`` from the owning I/O thread only."""

    def drain(self) -> list:
        self.clear_wake()
        items = []
        while (item := self.get_nowait()) is not None or not self._q.empty():
            items.append(item)
        return items


class Mailbox(_WakeQueue):
    """FIFO for one consumer thread that may also wait on other file descriptors (items are never None)."""

    def get(self, timeout: float | None = None) -> Any:
        """The next item; None when none came within ``timeout`` seconds (None: wait as long as it takes)."""
        try:
            return self._q.get(timeout=timeout) if timeout != 0 else self._q.get_nowait()
        except queue.Empty:
            pass
        self.clear_wake()  # nothing waits: clear the wake-ups, then look again for an item put meanwhile
        return self.get_nowait()


# Lean multipart send/receive for the I/O threads' hot path. pyzmq's send_multipart/recv_multipart go through
# flag enums and a getsockopt(RCVMORE) per frame; Frame.more and plain int flags do the same work for less.
_SNDMORE = int(zmq.SNDMORE)
_NOBLOCK = int(zmq.NOBLOCK)
_COPY_THRESHOLD = 64 * 1024  # frames smaller than this are copied (zero-copy costs more for small frames)


def send_frames(sock: zmq.Socket, frames: list) -> None:
    """Send ``frames`` as one multipart message (owning thread only)."""
    last = len(frames) - 1
    for i, frame in enumerate(frames):
        big = not isinstance(frame, bytes) or len(frame) >= _COPY_THRESHOLD
        sock.send(frame, _SNDMORE if i < last else 0, copy=not big)


def recv_frames(sock: zmq.Socket) -> list | None:
    """Receive one multipart message without blocking; None when none is waiting (owning thread only).

    Frames come back as memoryviews (zero-copy for large ones)."""
    try:
        frame = sock.recv(_NOBLOCK, copy=False)
    except zmq.Again:
        return None
    frames = [frame.buffer]
    while frame.more:
        frame = sock.recv(0, copy=False)
        frames.append(frame.buffer)
    return frames
