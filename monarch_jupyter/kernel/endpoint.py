"""``ControllerSocket``: the controller's ZeroMQ ROUTER socket of one generation, and the Signer of its messages.

Owned by the I/O thread (iothread.py): only that thread receives and sends on it, which ``send_frames`` asserts at
every send (``owner_check``, as ipykernel's subshell manager does). The I/O thread, the host links (launch/hosts.py)
and the listener (launch/listener.py) all send through it from that thread; other threads queue messages on the
dispatcher's outbox instead.
"""

from __future__ import annotations

import threading
from typing import Any

import zmq

from monarch_worker import protocol as P
from monarch_worker.channel import send_frames

from .state import owner_check

__all__ = ["ControllerSocket"]


class ControllerSocket:
    """The ROUTER socket of the current generation (see the module docstring)."""

    def __init__(self) -> None:
        self.ctx: zmq.Context | None = None
        self.router: zmq.Socket | None = None
        self.signer = P.Signer(bytes(32))  # replaced by the generation's (open)
        self.owner: threading.Thread | None = None  # the I/O thread, while it runs

    def open(self, secret: bytes) -> zmq.Socket:
        """A fresh context and ROUTER socket for a new generation (not bound yet), signed with ``secret``."""
        self.signer = P.Signer(secret)
        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # No handover: a second connection must never take over a rank's identity (and the code sent to it).
        self.router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        return self.router

    def close(self, linger_ms: int) -> None:
        """Close the socket (``linger_ms``: how long queued messages may take to leave) and its context."""
        if self.ctx is not None and self.router is not None:
            self.router.close(linger_ms)
            self.ctx.term()
        self.ctx = None
        self.router = None

    def pack(self, msg: P.Message, payload: bytes = b"", buffers: Any = ()) -> list:
        """``msg`` signed for this generation (the I/O thread: the Signer numbers what it signs)."""
        return self.signer.pack(msg, payload, list(buffers))

    def send_frames(self, identity: bytes, frames: list) -> None:
        """Send signed ``frames`` to the peer ``identity`` (the I/O thread only)."""
        owner_check(lambda: self.owner, "the controller's ROUTER socket")
        assert self.router is not None, "no generation is open"
        send_frames(self.router, [identity, *frames])

    def send_to(self, identity: bytes, msg: P.Message) -> None:
        """Sign ``msg`` and send it to the peer ``identity`` now (the I/O thread only)."""
        self.send_frames(identity, self.pack(msg))
