"""Completion and inspection against a rank's namespace (``Mesh.complete``): asked of the rank's I/O thread, so it
answers while the rank runs a cell or waits at a pdb prompt; a rank that does not answer in time (dead, stopped,
or busy in C code holding the GIL) gets None, and the caller falls back to the kernel's own answer."""

from __future__ import annotations

import time

from monarch_worker import protocol as P

from .dispatch import Dispatcher
from .state import MeshState, RankState

__all__ = ["Completions"]

POLL = 0.02  # seconds between checks for the reply


class Completions:
    """Requests and replies of completion and inspection (replies come on the I/O thread)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self._replies: dict[int, P.CompleteReply | None] = {}

    def ask(self, rank: int, code: str, cursor_pos: int, inspect: bool, timeout: float) -> P.CompleteReply | None:
        """Rank ``rank``'s completions (``inspect``: description) of ``code`` at ``cursor_pos``; None when the mesh
        is not running, the rank is dead, or it did not answer within ``timeout`` seconds."""
        state = self.state
        with state.lock:
            info = state.ranks.get(rank)
            if not state.running or info is None or info.state is RankState.DEAD or info.identity is None:
                return None
            request_id = next(state.ids)
            self._replies[request_id] = None
        try:
            self.dispatcher.post(rank, P.Complete(request_id, code, cursor_pos, inspect))
            deadline = time.monotonic() + timeout
            with state.lock:
                while self._replies.get(request_id) is None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return None
                    state.cond.wait(min(POLL, left))
                return self._replies.get(request_id)
        finally:
            with state.lock:
                self._replies.pop(request_id, None)

    def on_reply(self, rank: int, msg: P.CompleteReply, payload: bytes, bufs: list) -> None:
        """A rank's answer (I/O thread); dropped when nobody waits for it any more."""
        with self.state.lock:
            if msg.request_id in self._replies:
                self._replies[msg.request_id] = msg
                self.state.cond.notify_all()
