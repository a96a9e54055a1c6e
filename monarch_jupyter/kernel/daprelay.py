"""The kernel's end of a relayed DAP stream (``mesh.parts.dap``): the visual debugger on ranks of other hosts.

A rank's debugpy adapter listens on that rank's loopback only. For a rank on this host the kernel connects to it
(dapsession.py); for one elsewhere ``open`` returns one end of a ``socket.socketpair()`` and pumps the other end
to and from the rank as signed ``DapData`` messages over the mesh's own connection (through its host agent), and
the rank connects to its adapter (monarch_worker.dapbridge). Everything above the socket (debugpy's JSON framing,
``RankSession``, ``MeshDebugger``) is the same for both.

Threads: each stream's pump thread (``monarch-dap-relay-rankN``) reads the kernel's end and posts ``DapData``;
``on_message`` runs on the I/O thread and writes what the rank sent into the socket pair. A stream ends when
either end closes it, or when its rank exits (``on_rank_exit``, the launcher's thread): the kernel's end then
reads EOF, as a connection to a local rank's adapter does when that rank dies.
"""

from __future__ import annotations

import logging
import select
import socket
import threading
import time

from monarch_worker import protocol as P

from .dispatch import Dispatcher
from .state import MeshState, RankState

log = logging.getLogger(__name__)

__all__ = ["DapRelay", "CHUNK", "WRITE_TIMEOUT"]

CHUNK = 65536  # bytes per DapData message at most
WRITE_TIMEOUT = 30.0  # seconds the I/O thread waits for the kernel's client to take a rank's bytes


class _Pair:
    def __init__(self, rank: int, inner: socket.socket) -> None:
        self.rank = rank
        self.inner = inner  # the relay's end (the client holds the other); blocking: the pump waits in recv


class DapRelay:
    """The relayed DAP streams of one mesh (stream id -> the rank and the relay's end of its socket pair)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self._lock = threading.Lock()  # a part's own small lock (never around a call into another part)
        self._pairs: dict[int, _Pair] = {}  # streams open
        self._pumps: dict[int, int] = {}  # stream -> its rank, while its pump thread runs

    def open(self, rank: int, port: int) -> socket.socket:
        """A connected socket to rank ``rank``'s debugpy adapter on that rank's loopback port ``port``, relayed over
        the mesh's connection (any thread). The socket reads EOF when the rank's adapter closes, the rank cannot
        reach it, or the rank exits.

        Raises
        ------
        ConnectionError
            The rank is not running.
        """
        with self.state.lock:
            info = self.state.ranks.get(rank)
            if not self.state.running or info is None or info.state is RankState.DEAD or info.identity is None:
                raise ConnectionError(f"rank {rank} is not running, so the debugger cannot connect to it")
            stream = next(self.state.ids)
        outer, inner = socket.socketpair()
        pair = _Pair(rank, inner)
        with self._lock:
            self._pairs[stream] = pair
            self._pumps[stream] = rank
        self.dispatcher.post(rank, P.DapOpen(stream, port))
        threading.Thread(target=self._pump, args=(stream, pair), name=f"monarch-dap-relay-rank{rank}",
                         daemon=True).start()
        return outer

    def _pump(self, stream: int, pair: _Pair) -> None:
        while True:
            try:
                data = pair.inner.recv(CHUNK)
            except OSError:
                data = b""
            if not data:
                break
            self.dispatcher.post(pair.rank, P.DapData(stream, data))
        ended_here = self._end(stream)
        pair.inner.close()
        if ended_here:  # the client left: the rank closes its connection to the adapter
            self.dispatcher.post(pair.rank, P.DapClose(stream))
        with self._lock:
            self._pumps.pop(stream, None)

    def ranks(self) -> list[int]:
        """The ranks with a relayed stream whose pump thread still runs (one entry per stream, sorted)."""
        with self._lock:
            return sorted(self._pumps.values())

    def on_message(self, rank: int, msg: P.DapData | P.DapClose, payload: bytes, bufs: list) -> None:
        """(I/O thread) Bytes from the rank's adapter, or its end of the stream."""
        with self._lock:
            pair = self._pairs.get(msg.stream)
        if pair is None or pair.rank != rank:
            return
        if isinstance(msg, P.DapClose):
            if msg.reason:
                log.info("rank %d's relayed debugger connection ended: %s", rank, msg.reason)
            self._end(msg.stream)
            return
        try:
            _send_within(pair.inner, msg.data, WRITE_TIMEOUT)
        except OSError as e:  # the client stopped reading (or left): end the stream rather than hold the I/O thread
            log.warning("rank %d's relayed debugger connection failed: %s", rank, e)
            if self._end(msg.stream):
                self.dispatcher.post(rank, P.DapClose(msg.stream))

    def on_rank_exit(self, rank: int) -> None:
        """(Launcher's thread) ``rank`` exited: its streams end (the client reads EOF)."""
        with self._lock:
            streams = [s for s, p in self._pairs.items() if p.rank == rank]
        for s in streams:
            self._end(s)

    def close(self) -> None:
        """End every stream (the mesh stops)."""
        with self._lock:
            streams = list(self._pairs)
        for s in streams:
            self._end(s)

    def _end(self, stream: int) -> bool:
        """Forget ``stream`` and shut its socket pair down (wakes its pump); False when it had ended already."""
        with self._lock:
            pair = self._pairs.pop(stream, None)
        if pair is None:
            return False
        try:
            pair.inner.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        return True


def _send_within(sock: socket.socket, data: bytes, timeout: float) -> None:
    """Write all of ``data`` into the blocking ``sock`` without blocking longer than ``timeout`` seconds in all
    (MSG_DONTWAIT: a timeout on the socket would make its file non-blocking for the pump's reads too).

    Raises
    ------
    TimeoutError
        The reader did not take the bytes in time.
    OSError
        The socket is closed.
    """
    view = memoryview(data)
    deadline = time.monotonic() + timeout
    while view:
        try:
            view = view[sock.send(view, socket.MSG_DONTWAIT):]
        except BlockingIOError:
            pass
        if view:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                raise TimeoutError(f"the debugger's client took no bytes for {timeout:g} s")
