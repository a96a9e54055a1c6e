"""Which frontend drives the kernel's visual debugger when two attach to one kernel (issue 28): the last one.

Two JupyterLab pages on one kernel (two browser tabs, or one page reloaded: its old page never said goodbye) both
send ``initialize`` when their debugger is switched on; the kernel's debugpy has one session. The frontend that
switches it on last takes the session over: it gets the session's capabilities (the kernel's debugpy answers one
``initialize`` per session, and its ``attach`` only once) and drives every rank from then on. A frontend that was
taken over from is told so by each request it sends (its Debug Console prints it), and its ``disconnect`` (its tab
closed, its bug icon off) ends only its own view: the other frontend's session goes on. Frontends are told apart
by the client session of their control messages (``header.session``: one per JupyterLab kernel connection).
"""

from __future__ import annotations

import logging
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["Frontends", "NOT_OWNER", "response"]

NOT_OWNER = ("the debugger of this kernel was switched on in another frontend (another browser tab, or this page "
             "reloaded) after this one, and that one drives it now: switch the debugger off and on here to take "
             "it back")


def response(message: dict, success: bool, body: dict, text: str = "") -> dict:
    """A DAP response to ``message`` (its seq as ``request_seq`` and ``seq``: ipykernel's convention)."""
    out = {"type": "response", "seq": message.get("seq"), "request_seq": message.get("seq"), "success": success,
           "command": message.get("command"), "body": body}
    if not success:
        out["message"] = text
    return out


class Frontends:
    """The frontend that drives the debugger (``owner``: its client session) and what is answered for it here.

    Called on the kernel's control thread, one request at a time (ipykernel's control lock).
    """

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel  # ipykernel's kernel: get_parent("control") is the request being answered
        self.owner: str | None = None
        self.taken_over = False  # the owner took the session over: its attach is answered here
        self.capabilities: dict | None = None  # the body of the kernel debugpy's initialize reply

    def client(self) -> str | None:
        """The client session of the frontend whose request is being answered (None: unknown)."""
        try:
            parent = self.kernel.get_parent("control") if self.kernel is not None else None
        except Exception:  # noqa: BLE001 - an ipykernel without get_parent: frontends are not told apart
            return None
        return ((parent or {}).get("header") or {}).get("session") or None

    def before(self, message: dict, started: bool) -> dict | None:
        """The answer to ``message`` when it is given here, else None (the debugger answers it).

        ``started``: the kernel's debugger is on (a frontend sent ``initialize`` and no ``disconnect`` since)."""
        command, client = message.get("command"), self.client()
        if command == "initialize":
            if started:  # on already: in another frontend, or in this one before the extension was loaded
                log.info("the debugger was switched on in frontend %s: it takes over from %s", client, self.owner)
                self.taken_over = True
                if self.capabilities is not None:
                    self.owner = client
                    return response(message, True, self.capabilities)
            self.owner = client
            return None
        if command == "attach" and self.taken_over:  # the kernel's debugpy is attached already: it stays
            self.taken_over = False
            return response(message, True, {})
        if not started or None in (client, self.owner) or client == self.owner or command == "debugInfo":
            return None
        if command == "disconnect":  # its own view ends; the owner's session goes on
            return response(message, True, {})
        if command == "evaluate":  # the Debug Console prints a result; a failure only "Evaluation resulted in an error"
            return response(message, True, {"result": NOT_OWNER, "variablesReference": 0})
        return response(message, False, {}, NOT_OWNER)

    def after(self, message: dict, reply: dict) -> None:
        """Note what the debugger answered to ``message`` (passed on because ``before`` returned None)."""
        command = message.get("command")
        if command == "initialize" and reply.get("success"):
            self.capabilities = reply.get("body")
        elif command == "disconnect":
            self.owner, self.taken_over = None, False
