"""Stack reports: where each rank's main thread is, identical stacks grouped.

A rank's I/O thread answers ``StacksRequest`` with the user part of its main thread's stack (outermost first)
and, when torch.distributed's flight recorder is on, the last collective it issued. ``StackReport`` folds ranks
with the same stack into one entry whose first line reads like::

    ranks 0,1,3: all_reduce at cell line 4  [last collective: gloo:all_reduce #12]
    rank 2: time.sleep at cell line 6  [last collective: gloo:all_reduce #11]

"what" is the innermost Python function (or, when the innermost frame is the user's own code blocked in a C
function, the call it runs: the rank sends the source of the running instruction, PEP 657 positions, and the
first call on the line stands in when it has none); "where" is the innermost frame of the user's own code:
"cell line N" for the running cell, else file:line in function. Different collective sequence numbers show which
ranks skipped or added a collective.
"""

from __future__ import annotations

import os
import re
import sysconfig
import time
from collections.abc import Iterable
from typing import Any

import monarch_worker
from monarch_worker import protocol as P

from ..ranks import parse_ranks, ranks_text
from .config import check_timeout
from .dispatch import Dispatcher
from .state import MeshState, RankState

__all__ = ["StackReport", "StackRequests", "summarize"]

Frame = tuple  # (filename, lineno, function, source line[, source of the running instruction])

_LIBRARY_DIRS = tuple({p for k in ("stdlib", "platstdlib", "purelib", "platlib")
                       if (p := sysconfig.get_paths().get(k))})
# The rank runtime's own files (progress(), display, records) are not the user's code, wherever it is installed (an
# editable install has them outside site-packages): a rank interrupted while it sends a report stopped "at the cell
# line that called progress", not "at worker/protocol.py:94 in _digest".
_RUNTIME_DIR = os.path.dirname(os.path.abspath(monarch_worker.__file__)) + os.sep
_CALL = re.compile(r"([A-Za-z_][\w.]*)\s*\(")
_KEYWORDS = {"if", "while", "for", "return", "assert", "not", "and", "or", "in", "with", "elif", "yield", "await",
             "lambda", "del", "raise"}


def _is_library(filename: str) -> bool:
    return ("site-packages" in filename or "dist-packages" in filename or filename.startswith(_LIBRARY_DIRS)
            or filename.startswith(("<frozen ", _RUNTIME_DIR)))


def _short(filename: str) -> str:
    """A library path from its package on (".../site-packages/torch/x.py" -> "torch/x.py")."""
    if filename.startswith(_RUNTIME_DIR):
        return "monarch_worker/" + filename[len(_RUNTIME_DIR):]
    for marker in ("site-packages/", "dist-packages/"):
        if marker in filename:
            return filename.split(marker, 1)[1]
    for d in _LIBRARY_DIRS:
        if filename.startswith(d + "/"):
            return filename[len(d) + 1:]
    return filename


def _called(line: str) -> str:
    """The first function called on a source line ("time.sleep(100)" -> "time.sleep"), or ""."""
    for m in _CALL.finditer(line):
        if m.group(1) not in _KEYWORDS:
            return m.group(1)
    return ""


def cell_file(frames: list[Frame]) -> str:
    """The running cell's file name: the outermost frame when it is a cell's module code."""
    if frames and frames[0][2] == "<module>" and str(frames[0][0]).startswith("<"):
        return str(frames[0][0])
    return ""


def where(frame: Frame, cell: str) -> str:
    filename, lineno, fn = frame[:3]
    if filename == cell:
        return f"cell line {lineno}"
    return f"{_short(filename)}:{lineno} in {fn}"


def summarize(frames: list[Frame]) -> str:
    """One line for a stack (outermost first): "all_reduce at cell line 4"."""
    if not frames:
        return "idle"
    cell = cell_file(frames)
    user = [f for f in frames if not _is_library(str(f[0]))]
    anchor = user[-1] if user else frames[-1]
    innermost = frames[-1]
    if innermost is anchor:
        running = str(anchor[4]) if len(anchor) > 4 else ""
        what = _called(running) or _called(str(anchor[3])) or anchor[2]
    else:
        # The innermost public function below the user's frame: not a wrapper's or a private helper's name (torch's
        # c10d logger runs _get_msg_dict while a collective's error unwinds, its frame gone), else the line's call.
        below = frames[frames.index(anchor) + 1:]
        named = [f for f in below if not str(f[2]).startswith(("_", "<")) and f[2] != "wrapper"
                 and not str(f[0]).startswith(_RUNTIME_DIR)]  # progress()'s helpers: the call on the line says more
        running = str(anchor[4]) if len(anchor) > 4 else ""
        what = named[-1][2] if named else _called(running) or _called(str(anchor[3])) or innermost[2]
    return f"{what} at {where(anchor, cell)}"


def _collective(c: dict) -> str:
    if not c:
        return ""
    return f"  [last collective: {c.get('name', '?')} #{c.get('seq', '?')}]"


class StackReport:
    """Stacks of several ranks, identical stacks grouped: "ranks 0,1,3: all_reduce at cell line 4".

    ``ranks``: the ranks asked; ``replies``: rank -> Stacks reply; ``states``: rank -> RankState (for ranks that
    did not answer). ``text`` is the report; ``groups()`` the (ranks, key) pairs behind it.
    """

    def __init__(self, ranks: list[int], replies: dict[int, P.Stacks], states: dict[int, Any]) -> None:
        self.ranks = ranks
        self.replies = replies
        self.states = states

    def groups(self) -> list[tuple[list[int], tuple]]:
        """[(ranks, key)] where key is ("no answer", state) | ("idle",) | (frames, collective summary)."""
        groups: dict[tuple, list[int]] = {}
        for r in self.ranks:
            reply = self.replies.get(r)
            if reply is None:
                state = self.states.get(r)
                key: tuple = ("no answer", getattr(state, "value", str(state)))
            elif not reply.frames:
                key = ("idle",)
            else:
                key = (tuple(tuple(f) for f in reply.frames), _collective(reply.collective))
            groups.setdefault(key, []).append(r)
        return [(rs, key) for key, rs in groups.items()]

    @property
    def text(self) -> str:
        out: list[str] = []
        for rs, key in self.groups():
            who = ranks_text(rs)
            if key[0] == "no answer":
                why = "dead" if key[1] == "dead" else "its I/O thread is not responding: stopped (SIGSTOP) or hung"
                out.append(f"{who}: no answer ({why})")
                continue
            if key == ("idle",):
                out.append(f"{who}: idle")
                continue
            frames, collective = key
            cell = cell_file(list(frames))
            out.append(f"{who}: {summarize(list(frames))}{collective}")
            for frame in frames:
                line = str(frame[3])
                out.append(f"    {where(frame, cell)}" + (f": {line}" if line else ""))
        return "\n".join(out)

    def summary(self) -> str:
        """The first line of each group only ("ranks 0,1,3: all_reduce at cell line 4 / rank 2: ...")."""
        return " / ".join(line for line in self.text.splitlines() if not line.startswith(" "))

    def __str__(self) -> str:
        return self.text

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text)


class StackRequests:
    """Asks ranks where their main thread is (``StacksRequest``), answered by each rank's I/O thread: it answers
    while the main thread blocks in a collective, or runs a ``block=False`` cell."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self._requests: dict[int, dict[int, P.Stacks]] = {}  # request id -> rank -> reply (under the mesh lock)

    def ask(self, ranks: str | int | Iterable[int] | None, timeout: float) -> StackReport:
        """Where each chosen rank is now; ranks that do not answer within ``timeout`` seconds (dead, stopped) are
        listed as such.

        Raises
        ------
        TypeError, ValueError
            Bad rank selection, or ``timeout`` not a number of seconds above 0.
        """
        state = self.state
        check_timeout(timeout)
        chosen = parse_ranks(ranks, state.nproc)
        request_id = next(state.ids)
        with state.lock:
            replies: dict[int, P.Stacks] = {}
            self._requests[request_id] = replies
            asked = {r: state.ranks[r] for r in chosen if state.ranks[r].state is not RankState.DEAD}
            for r in asked:
                self.dispatcher.post(r, P.StacksRequest(request_id))
            deadline = time.monotonic() + timeout
            try:  # a rank that dies (or is replaced) meanwhile never answers: no wait for it
                while time.monotonic() < deadline and any(
                        r not in replies and state.ranks[r] is info and info.state is not RankState.DEAD
                        for r, info in asked.items()):
                    state.cond.wait(0.05)
            finally:
                self._requests.pop(request_id, None)
            states = {r: state.ranks[r].state for r in chosen}
        return StackReport(chosen, dict(replies), states)

    def on_reply(self, rank: int, msg: P.Stacks, payload: bytes, bufs: list) -> None:
        """A rank's answer (I/O thread)."""
        with self.state.lock:
            replies = self._requests.get(msg.request_id)
            if replies is not None:
                replies[rank] = msg
                self.state.cond.notify_all()
