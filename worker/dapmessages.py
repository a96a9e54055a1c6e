"""The messages of the visual debugger's relay, registered with the others (``messages.MESSAGE_TYPES``).

monarch_worker.protocol re-exports them with every other message. They carry a DAP stream between the kernel's
debugger and a rank's debugpy adapter on that rank's own loopback (kernel/daprelay.py, monarch_worker.dapbridge):
the controller sends ``DapOpen``, then ``DapData`` travels both ways until either side sends ``DapClose``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from .messages import Message, register

__all__ = ["DapOpen", "DapData", "DapClose"]


@register
@dataclass(frozen=True)
class DapOpen(Message):
    """Controller -> rank (I/O thread): connect stream ``stream`` to this rank's debugpy adapter on its loopback
    port ``port`` (``dapside.listen``); the bytes then travel as ``DapData`` both ways."""

    TYPE: ClassVar[str] = "dap_open"
    stream: int
    port: int


@register
@dataclass(frozen=True)
class DapData(Message):
    """Either way: bytes of DAP stream ``stream`` (debugpy's framing, passed through unchanged). The bytes are a
    header field, so they are signed like the rest of the header (buffers are not)."""

    TYPE: ClassVar[str] = "dap_data"
    ROUTE: ClassVar[str] = "dap"
    stream: int
    data: bytes


@register
@dataclass(frozen=True)
class DapClose(Message):
    """Either way: stream ``stream`` ended (the client left, the adapter closed, or it could not connect:
    ``reason``)."""

    TYPE: ClassVar[str] = "dap_close"
    ROUTE: ClassVar[str] = "dap"
    stream: int
    reason: str = ""
