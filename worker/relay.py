"""A joined rank relays its own output: fds 1 and 2 become pipes that a reader thread turns into Stream messages.

Local ranks need none of this (the fork server reads their pipes). A rank started by torchrun, srun or a
Kubernetes Job has no such helper on its host, so it sends what it writes, byte for byte and including the
per-cell sync markers (protocol.sync_marker), as ``Stream`` messages on its own connection; the controller
splits them exactly as it splits the fork server's pipes.

Threads: the reader thread (``monarch-relay``) reads both pipes and puts Stream messages on the rank's
outbox (the I/O thread sends them). ``mark`` (main thread, at the end of a cell) returns once every byte
written before it is queued, so a cell's output always precedes its Result on the wire; it writes the cell's
sync marker only on the streams the cell wrote to (a marker ends a partial last line; a silent stream needs
none, which saves two messages per rank and cell).
"""

from __future__ import annotations

import array
import codecs
import fcntl
import logging
import os
import re
import select
import termios
import threading
import time
from typing import Any

from . import protocol as P

log = logging.getLogger(__name__)

__all__ = ["OutputRelay"]

HOLD_LIMIT = 1 << 20  # characters of output kept while the rank waits to be admitted (older is dropped)
READ_SIZE = 1 << 16
_MARKER = re.compile(re.escape(P.SYNC_PREFIX) + rb"\d+" + re.escape(P.SYNC_SUFFIX))


class OutputRelay:
    """Point fds 1 and 2 at pipes now; relay what arrives there once ``start`` is called.

    Parameters
    ----------
    tee:
        Also copy every byte to the original fds 1 and 2 (the terminal or log of whoever launched the rank).
    """

    def __init__(self, tee: bool) -> None:
        self._tee = tee
        self._streams: dict[int, tuple[str, int]] = {}  # pipe read fd -> (stream name, original fd)
        self._decoders: dict[str, Any] = {}
        for fd, name in ((1, "stdout"), (2, "stderr")):
            original = os.dup(fd)
            r, w = os.pipe()
            os.dup2(w, fd)
            os.close(w)
            self._streams[r] = (name, original)
            self._decoders[name] = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._cond = threading.Condition()  # held by the reader while it reads and queues; flush waits on it
        self._dirty = {"stdout": False, "stderr": False}  # written to since the last marker
        self._held: list[tuple[str, str]] | None = []  # None once released
        self._held_bytes = 0
        self._outbox: Any = None
        self._thread = threading.Thread(target=self._loop, name="monarch-relay", daemon=True)

    def start(self, outbox: Any) -> None:
        """Start relaying into ``outbox`` (a channel.Outbox); output is held until ``release``."""
        self._outbox = outbox
        self._thread.start()

    def release(self) -> None:
        """The controller admitted the rank: send what was held, and everything from now on."""
        with self._cond:
            held, self._held = self._held or [], None
            for name, text in held:
                self._outbox.put((P.Stream(name, text), b"", []))

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every byte written to fds 1 and 2 so far is queued; True if so."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while any(_pending(fd) for fd in self._streams):
                remaining = deadline - time.monotonic()
                if remaining <= 0 or not self._thread.is_alive():
                    return False
                self._cond.wait(min(remaining, 0.05))
        return True

    def mark(self, marker: bytes, timeout: float) -> None:
        """End of a cell: queue all its output, then ``marker`` on each stream it wrote to; waits up to
        ``timeout`` seconds for each of the two flushes."""
        self.flush(timeout)
        with self._cond:
            dirty = [name for name, d in self._dirty.items() if d]
            self._dirty = {"stdout": False, "stderr": False}
        if not dirty:
            return
        for name in dirty:
            try:
                os.write(1 if name == "stdout" else 2, marker)
            except OSError:
                pass
        self.flush(timeout)
        with self._cond:
            for name in dirty:
                self._dirty[name] = False

    def _loop(self) -> None:
        fds = list(self._streams)
        while fds:
            try:
                ready, _, _ = select.select(fds, [], [])
            except InterruptedError:
                continue
            for fd in ready:
                with self._cond:
                    try:
                        data = os.read(fd, READ_SIZE)
                    except OSError:
                        data = b""
                    if not data:
                        fds.remove(fd)
                    else:
                        self._relay(fd, data)
                    self._cond.notify_all()

    def _relay(self, fd: int, data: bytes) -> None:
        name, original = self._streams[fd]
        self._dirty[name] = True
        if self._tee:
            try:
                _write_all(original, _MARKER.sub(b"", data) if P.SYNC_PREFIX in data else data)
            except OSError:
                self._tee = False  # the launcher's side went away; keep relaying to the controller
        text = self._decoders[name].decode(data)
        if not text:
            return
        if self._held is None:
            self._outbox.put((P.Stream(name, text), b"", []))
            return
        self._held.append((name, text))
        self._held_bytes += len(text)
        while self._held_bytes > HOLD_LIMIT and len(self._held) > 1:
            _, dropped = self._held.pop(0)
            self._held_bytes -= len(dropped)


def _pending(fd: int) -> int:
    """Bytes waiting in a pipe (FIONREAD)."""
    buf = array.array("i", [0])
    try:
        fcntl.ioctl(fd, termios.FIONREAD, buf, True)
    except OSError:
        return 0
    return buf[0]


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        n = os.write(fd, view)
        view = view[n:]
