"""Post-mortem debugging, inspection of busy ranks, and the tracebacks ranks keep: the request/answer side of
``mesh.debugger`` (the prompt conversation itself is prompts.py; the user's façade debugger.py).

- ``post_mortem`` submits ``DebugPostMortem`` to one idle rank like a cell; the rank opens pdb on the traceback of
  its last failed cell, and the prompts are served while the controller waits for that "cell" (waiting.py).
- ``inspect`` and ``clear`` (``Inspector``) are requests answered off the rank's main thread (``DebugReply``), so
  they work while it is busy.

Which rank failed first comes from the results of cells (``MeshState.failures``, kept by cells.CellTable).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from monarch_worker import protocol as P

from ..errors import MonarchError
from ..ranks import parse_ranks, ranks_text
from .dispatch import Dispatcher
from .state import MeshState, RankState

__all__ = ["Inspection", "NothingToDebugError", "PostMortem", "Inspector"]

POLL = 0.05  # seconds between checks while waiting for answers


class NothingToDebugError(MonarchError):
    """Post-mortem debugging found no traceback to open (no failed cell, or it was cleared)."""


@dataclass(frozen=True)
class Inspection:
    """The answer of ``MeshDebugger.inspect``: ``text`` is the value's repr (or the error, when ``ok`` is False).

    ``state`` is what the rank's main thread was doing ("running", "debugging" or "idle"); ``where`` is where.
    """

    rank: int
    expr: str
    ok: bool
    text: str
    state: str
    where: str
    cell_id: int = -1

    @property
    def note(self) -> str:
        if self.state == "idle":
            return f"rank {self.rank} (idle)"
        doing = "stopped in pdb" if self.state == "debugging" else "running"
        where = f" at {self.where}" if self.where else ""
        return (f"rank {self.rank} ({doing}{where}): live state, read while its main thread runs; values may "
                "change as it goes on")

    def __str__(self) -> str:
        return f"{self.note}\n{self.text}"

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


class ScriptedPrompts(Protocol):
    """The prompt server's ``options`` (scripted answers for the prompts of the cells waited for inside it) and
    its knowledge of post-mortem sessions (prompts.PromptServer)."""

    def options(self, commands: str | Iterable[str] | None = None,
                on_interrupt: str | None = None) -> contextlib.AbstractContextManager[Any]: ...

    def post_mortem_session(self, cell_id: int) -> None: ...


class CellRunner(Protocol):
    """What submits a cell and returns its handle (waiting.Waiter)."""

    def submit(self, cell_id: int, groups: list, what: str, order: str = "arrival", tracks_failures: bool = True,
               waited: bool = False) -> Any: ...


class PostMortem:
    """Post-mortem sessions of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, waiter: CellRunner, prompts: ScriptedPrompts, inspector: Inspector) -> None:
        self.state = state
        self.waiter = waiter
        self.prompts = prompts
        self.inspector = inspector

    def post_mortem(self, rank: int | None = None, commands: str | Iterable[str] | None = None,
                    timeout: float | None = None) -> None:
        """Open pdb at the failing frame of ``rank``'s last failed cell (default: the first rank that failed).

        Parameters
        ----------
        rank:
            The rank to debug; None picks the first failure of the most recent failed cell.
        commands:
            Scripted pdb lines (``"p x; up; p y"``); when they are used up the session ends. None: ask a person.
        timeout:
            Seconds the session may last (None: no limit).

        Raises
        ------
        NothingToDebugError
            No rank keeps a traceback (its last cell did not fail, or ``clear()`` dropped it).
        MonarchError
            The rank is not idle (it runs a cell, or it is dead).
        ValueError
            ``rank`` is not a rank of this mesh.
        """
        rank = self._idle_rank(rank)
        cell_id = next(self.state.ids)
        self.prompts.post_mortem_session(cell_id)
        with self._scripted(commands):
            outcome = self._run(rank, cell_id, "pdb", timeout)
        if not outcome.get("debugged"):
            raise NothingToDebugError(outcome.get("reason") or f"rank {rank} has nothing to debug")

    def in_sidebar(self, rank: int | None, connect: Callable[[int, int], None], timeout: float | None = None) -> int:
        """Stop ``rank`` (None: as ``post_mortem``) in the visual debugger at the failing frame of its last failed
        cell; returns the rank once the debugger continues it (or ``timeout`` seconds passed; None: no limit).

        The rank's debugpy adapter starts first (its traceback stays kept) and ``connect(rank, port)`` attaches the
        kernel's debugger to it (the TCP port on the rank's loopback).

        Raises
        ------
        NothingToDebugError, MonarchError, ValueError
            As ``post_mortem``; and whatever ``connect`` raises.
        """
        rank = self._idle_rank(rank)
        opened = self._run(rank, next(self.state.ids), "listen", timeout)
        if "port" not in opened:
            raise NothingToDebugError(opened.get("reason") or f"rank {rank} has nothing to debug")
        connect(rank, int(opened["port"]))
        outcome = self._run(rank, next(self.state.ids), "sidebar", timeout)
        if not outcome.get("debugged"):
            raise NothingToDebugError(outcome.get("reason") or f"rank {rank} has nothing to debug")
        return rank

    def _idle_rank(self, rank: int | None) -> int:
        state = self.state
        state.check_running()
        if rank is None:
            rank = self.inspector.last_failed_rank()
            if rank is None:
                raise NothingToDebugError("no rank keeps a traceback to debug: no cell failed since the last one "
                                          "that ran on it (pass a rank to try one anyway)")
        (rank,) = parse_ranks(int(rank), state.nproc)
        with state.lock:
            rank_state = state.ranks[rank].state
        if rank_state is not RankState.IDLE:
            raise MonarchError(f"rank {rank} is {rank_state.value}; post-mortem debugging needs an idle rank "
                               "(use  %mesh inspect  to look at a busy one)")
        return rank

    def _run(self, rank: int, cell_id: int, mode: str, timeout: float | None) -> dict[str, Any]:
        """Run the rank's side of a post-mortem (``P.DebugPostMortem``) as a cell; its outcome (a dict)."""
        what = f"post-mortem of rank {rank}"
        handle = self.waiter.submit(cell_id, [([rank], P.DebugPostMortem(cell_id, mode), b"", [])], what,
                                    tracks_failures=False)
        values = handle.result(timeout)
        return (values.get(rank) if values else None) or {}

    def _scripted(self, commands: str | Iterable[str] | None) -> contextlib.AbstractContextManager[Any]:
        return self.prompts.options(commands=commands) if commands is not None else contextlib.nullcontext()



class Inspector:
    """Inspect and clear: requests to ranks answered off their main thread (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self._replies: dict[int, dict[int, P.DebugReply]] = {}  # request id -> rank -> reply (under the lock)

    def last_failed_rank(self) -> int | None:
        """The rank whose error came first in the most recent failed cell (None: no rank keeps one)."""
        with self.state.lock:
            failed = {r: f for r, f in self.state.failures.items()
                      if r in self.state.ranks and self.state.ranks[r].alive}
            if not failed:
                return None
            return min(failed, key=lambda r: (-failed[r][0], failed[r][1]))

    def inspect(self, expr: str, rank: int, *, frame: bool = False, timeout: float = 10.0) -> Inspection:
        """Evaluate ``expr`` on ``rank`` beside its main thread, which may be busy (live state, read as it runs).

        Parameters
        ----------
        expr:
            A Python expression, evaluated in the rank's namespace.
        rank:
            The rank to ask.
        frame:
            Evaluate with the locals of the innermost frame of notebook code the rank runs (or of pdb's frame when
            it is stopped), e.g. a loop variable inside a function defined in a cell.
        timeout:
            Seconds to wait for the answer.

        Raises
        ------
        SyntaxError
            ``expr`` is not an expression (checked here, nothing is sent).
        MonarchError
            The rank did not answer within ``timeout`` seconds (dead, or the expression blocks).
        """
        compile(expr, "<inspect>", "eval")  # syntax only; it runs on the rank
        (rank,) = parse_ranks(int(rank), self.state.nproc)
        replies = self._request([rank], lambda rid: P.Inspect(rid, expr, frame), timeout)
        reply = replies.get(rank)
        if reply is None:
            raise MonarchError(f"rank {rank} did not answer within {timeout:g} s (is it dead, or does the "
                               "expression block?)")
        return Inspection(rank, expr, reply.ok, reply.text, reply.state, reply.where, reply.cell_id)

    def clear(self, ranks: str | int | Iterable[int] | None = None, timeout: float = 5.0) -> list[int]:
        """Drop the tracebacks ranks keep for post-mortem (and the frames and tensors they hold alive).

        Returns the ranks that had one. Raises MonarchError when some rank did not answer within ``timeout`` s.
        """
        state = self.state
        chosen = parse_ranks(ranks, state.nproc)
        with state.lock:
            alive = [r for r in chosen if state.ranks[r].alive]
            for r in chosen:
                state.failures.pop(r, None)
        replies = self._request(alive, P.DebugClear, timeout)
        missing = [r for r in alive if r not in replies]
        if missing:
            raise MonarchError(f"{ranks_text(missing)} did not answer within {timeout:g} s")
        return sorted(r for r, rep in replies.items() if rep.text == "cleared")

    def on_reply(self, rank: int, msg: P.DebugReply, payload: bytes, bufs: list) -> None:
        """A rank's answer to inspect or clear (I/O thread)."""
        with self.state.lock:
            replies = self._replies.get(msg.request_id)
            if replies is not None:
                replies[rank] = msg
            self.state.cond.notify_all()

    def _request(self, ranks: list[int], make: Callable[[int], P.Message], timeout: float) -> dict[int, P.DebugReply]:
        state = self.state
        state.check_running()
        request_id = next(state.ids)
        with state.lock:
            replies: dict[int, P.DebugReply] = {}
            self._replies[request_id] = replies
            for r in ranks:
                self.dispatcher.post(r, make(request_id))
            deadline = time.monotonic() + timeout
            try:
                while len(replies) < len(ranks) and time.monotonic() < deadline:
                    state.cond.wait(POLL)
            finally:
                self._replies.pop(request_id, None)
            return dict(replies)
