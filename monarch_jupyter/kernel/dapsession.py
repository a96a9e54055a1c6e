"""One DAP client session with one rank's debugpy adapter (``monarch_worker.dapside.listen``).

The rank's adapter listens on a loopback port of the rank's host. The session is given a connected socket: to that
port for a rank on this host, or one end of a socket pair relayed over the mesh's own connection for a rank on
another host (kernel/daprelay.py, ``DapRelay.open``); it cannot tell them apart. Framing is debugpy's own
(``debugpy.common.messaging.JsonIOStream``: ``Content-Length`` headers and JSON bodies); this module only matches
responses to requests and hands events to a callback. Its reader thread (``monarch-dap-rankN``) owns the receiving
side; ``request`` may be called from any thread (writes are serialized by a lock).
"""

from __future__ import annotations

import concurrent.futures
import itertools
import logging
import socket
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["RankSession", "SessionClosed"]


class SessionClosed(ConnectionError):
    """The rank's debug adapter closed the connection (the rank ended, or its adapter did)."""


class RankSession:
    """A connected DAP client for rank ``rank``.

    Parameters
    ----------
    rank:
        The rank this session debugs.
    sock:
        A connected stream socket to its debugpy adapter (the session owns it from here on, and closes it).
    on_event:
        Called as ``on_event(rank, event)`` on the reader thread for every DAP event, and once with
        ``{"event": "closed"}`` when the connection ends.
    """

    def __init__(self, rank: int, sock: socket.socket, on_event: Callable[[int, dict], None]) -> None:
        from debugpy.common import messaging  # the kernel's debugger is debugpy: present when this is used

        self.rank = rank
        self.pid: int | None = None  # the rank's process, once attached (set by the debugger)
        self._closed_error = messaging.NoMoreMessages
        self._stream = messaging.JsonIOStream.from_socket(sock, f"rank{rank}")
        self._on_event = on_event
        self._seq = itertools.count(1)
        self._lock = threading.Lock()
        self._pending: dict[int, concurrent.futures.Future] = {}
        self.alive = True
        self._reader = threading.Thread(target=self._read, name=f"monarch-dap-rank{rank}", daemon=True)
        self._reader.start()

    def request(self, command: str, arguments: dict[str, Any] | None = None) -> concurrent.futures.Future:
        """Send a request; the Future gets the response message (a dict; ``success`` may be False).

        The Future fails with SessionClosed when the connection ends before the response.
        """
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._lock:
            if not self.alive:
                fut.set_exception(SessionClosed(f"rank {self.rank}'s debugger connection is closed"))
                return fut
            seq = next(self._seq)
            self._pending[seq] = fut
            try:
                self._stream.write_json({"type": "request", "seq": seq, "command": command,
                                         "arguments": arguments or {}})
            except (OSError, self._closed_error):
                self._pending.pop(seq, None)
                fut.set_exception(SessionClosed(f"rank {self.rank}'s debugger connection is closed"))
        return fut

    def call(self, command: str, arguments: dict[str, Any] | None = None, timeout: float = 30.0) -> dict:
        """``request`` and wait up to ``timeout`` seconds for its response.

        Raises
        ------
        SessionClosed
            The connection ended first.
        TimeoutError
            No response within ``timeout``.
        """
        return self.request(command, arguments).result(timeout)

    def close(self) -> None:
        """Close the connection (the rank's adapter keeps listening for the next client)."""
        with self._lock:
            self.alive = False
        self._stream.close()

    def _read(self) -> None:
        try:
            while True:
                msg = self._stream.read_json()
                if msg.get("type") == "response":
                    with self._lock:
                        fut = self._pending.pop(msg.get("request_seq"), None)
                    if fut is not None:
                        fut.set_result(msg)
                elif msg.get("type") == "event":
                    self._on_event(self.rank, msg)
        except (OSError, ValueError, self._closed_error) as e:
            log.debug("rank %d's debugger connection ended: %s", self.rank, e)
        except Exception:  # a bug in a callback must not leave requests waiting forever
            log.exception("rank %d's debugger connection failed", self.rank)
        with self._lock:
            self.alive = False
            pending, self._pending = list(self._pending.values()), {}
        for fut in pending:
            fut.set_exception(SessionClosed(f"rank {self.rank}'s debugger connection closed"))
        self._stream.close()
        self._on_event(self.rank, {"type": "event", "event": "closed", "body": {}})
