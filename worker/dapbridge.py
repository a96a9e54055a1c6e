"""The rank's end of a relayed DAP stream: the kernel's visual debugger on a rank of another host.

The rank's debugpy adapter listens on its own loopback only (``dapside.listen``); a kernel on another host cannot
connect to it and nothing is opened to the network for it. Instead the kernel sends ``DapOpen(stream, port)`` over
the mesh's own signed connection (through the host agent, when there is one); this rank's I/O thread hands it to
``DapBridge``, which connects to ``127.0.0.1:port`` and then passes the bytes through both ways as ``DapData``
messages (DAP's framing untouched), until either side sends or sees the end (``DapClose``).

Threads: ``on_*`` run on the rank's I/O thread and never block on the adapter: connecting and writing happen on the
stream's writer thread (``monarch-dap-wN``), reading on its reader thread (``monarch-dap-rN``), which sends with the
rank's thread-safe ``send``. Both end when the stream ends; the process ending ends them all.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable

from . import protocol as P

log = logging.getLogger(__name__)

__all__ = ["DapBridge", "CHUNK", "CONNECT_TIMEOUT"]

CHUNK = 65536  # bytes read from the adapter at most per DapData message
CONNECT_TIMEOUT = 10.0  # seconds to connect to the rank's own adapter on its loopback


class _Stream:
    def __init__(self, stream: int, port: int, send: Callable[[P.Message], None],
                 forget: Callable[[int], None]) -> None:
        self.stream = stream
        self.port = port
        self.send = send
        self.forget = forget
        self.outgoing: queue.SimpleQueue[bytes | None] = queue.SimpleQueue()
        self.sock: socket.socket | None = None
        self.ended = False
        self.lock = threading.Lock()
        self.closed_by_kernel = False
        threading.Thread(target=self._write, name=f"monarch-dap-w{stream}", daemon=True).start()

    def _write(self) -> None:
        try:
            self.sock = socket.create_connection(("127.0.0.1", self.port), timeout=CONNECT_TIMEOUT)
            self.sock.settimeout(None)
        except OSError as e:
            self._end(f"cannot connect to this rank's debug adapter on 127.0.0.1:{self.port}: {e}")
            return
        threading.Thread(target=self._read, name=f"monarch-dap-r{self.stream}", daemon=True).start()
        while (data := self.outgoing.get()) is not None:
            try:
                self.sock.sendall(data)
            except OSError as e:
                self._end(f"the debug adapter's connection failed: {e}")
                return
        self._end("")

    def _read(self) -> None:
        assert self.sock is not None
        while True:
            try:
                data = self.sock.recv(CHUNK)
            except OSError:
                data = b""
            if not data:
                break
            self.send(P.DapData(self.stream, data))
        self._end("the debug adapter closed the connection")

    def _end(self, reason: str) -> None:
        with self.lock:
            if self.ended:
                return
            self.ended = True
        self.forget(self.stream)
        if self.sock is not None:
            try:
                self.sock.shutdown(socket.SHUT_RDWR)  # wakes the reader
            except OSError:
                pass
            self.sock.close()
        self.outgoing.put(None)  # wakes the writer
        if not self.closed_by_kernel:
            self.send(P.DapClose(self.stream, reason))


class DapBridge:
    """This rank's relayed DAP streams (stream id -> its connection to the rank's adapter).

    Parameters
    ----------
    send:
        The rank's ``send`` (any thread): queues a message for the controller.
    """

    def __init__(self, send: Callable[[P.Message], None]) -> None:
        self._send = send
        self._lock = threading.Lock()
        self._streams: dict[int, _Stream] = {}

    def on_open(self, msg: P.DapOpen, payload: bytes, bufs: list) -> None:
        """(I/O thread) Connect stream ``msg.stream`` to this rank's adapter (in the stream's own thread)."""
        with self._lock:
            self._streams[msg.stream] = _Stream(msg.stream, msg.port, self._send, self._forget)

    def on_data(self, msg: P.DapData, payload: bytes, bufs: list) -> None:
        """(I/O thread) Bytes from the kernel's client for the adapter; dropped for a stream that ended."""
        with self._lock:
            s = self._streams.get(msg.stream)
        if s is not None:
            s.outgoing.put(bytes(msg.data))

    def on_close(self, msg: P.DapClose, payload: bytes, bufs: list) -> None:
        """(I/O thread) The kernel's client left: close the connection to the adapter (it keeps listening)."""
        with self._lock:
            s = self._streams.get(msg.stream)
        if s is not None:
            s.closed_by_kernel = True
            s.outgoing.put(None)

    def _forget(self, stream: int) -> None:
        with self._lock:
            self._streams.pop(stream, None)
