"""pdb on a rank, driven from the notebook: ``breakpoint()``, ``pdb.set_trace()``, post-mortem, live inspection.

A rank has no terminal. ``RemotePdb`` is a ``pdb.Pdb`` whose stdin and stdout are backed by the protocol:

- what pdb writes is sent to the controller as ``DebugOutput`` (complete lines) and, when pdb asks for a line,
  the rest (its prompt) goes out as ``DebugPrompt`` with pdb's current location;
- the main thread then blocks until the rank's I/O thread receives the ``DebugInput`` for that prompt and hands
  the line over through a queue;
- when pdb lets the program go on (``c``, ``n``, ``s``, ...) the rank sends ``DebugResumed``.

Threads: pdb runs in the thread that called ``breakpoint()`` (the main thread for cell code; one interaction at a
time per process). ``on_input``, ``on_interrupt`` and ``on_clear`` run on the I/O thread and never block;
``Inspect`` is evaluated on a short-lived helper thread, so an expression that takes long (or blocks) delays
neither the heartbeats nor the main thread.

The traceback of the last failed cell is kept (``keeping``) for ``%mesh debug`` until the next cell starts on
this rank or the controller sends ``DebugClear``; it keeps the failing frames' locals (tensors included) alive.
"""

from __future__ import annotations

import bdb
import cmd
import code
import contextlib
import io
import itertools
import logging
import os
import pdb
import queue
import sys
import threading
import traceback
import types
from collections.abc import Callable, Iterator
from typing import IO, TYPE_CHECKING, Any, cast

from . import dapside
from . import protocol as P
from .executor import is_internal, main_thread_stack

if TYPE_CHECKING:
    from .rankside import RankSide

log = logging.getLogger(__name__)

__all__ = ["RankDebugger", "RemotePdb"]

MAX_REPR = 20_000  # characters of an inspected value's repr sent back; the rest is cut with a note
_EXIT_LINES = {"exit()", "quit()", "exit", "quit", "\x04"}  # end pdb's `interact` console (there is no Ctrl-D)


class _DebugStdout(io.TextIOBase):
    """pdb's stdout: buffers text; complete lines go out on ``flush``, the rest with the next prompt."""

    encoding = "utf-8"

    def __init__(self, dbg: RankDebugger) -> None:
        super().__init__()
        self._dbg = dbg
        self._buf: list[str] = []
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def write(self, s: str) -> int:
        with self._lock:
            self._buf.append(s)
        return len(s)

    def flush(self) -> None:
        with self._lock:
            text = "".join(self._buf)
            head, nl, tail = text.rpartition("\n")
            self._buf = [tail] if tail else []
        if head or nl:
            self._dbg.send(P.DebugOutput(text=head + nl))

    def take(self) -> str:
        with self._lock:
            text = "".join(self._buf)
            self._buf = []
        return text


class _DebugStdin(io.TextIOBase):
    """pdb's stdin: ``readline`` sends a prompt and waits for the controller's answer."""

    encoding = "utf-8"

    def __init__(self, dbg: RankDebugger) -> None:
        super().__init__()
        self._dbg = dbg

    def readable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False

    def readline(self, size: int | None = -1) -> str:  # type: ignore[override]  # a text stream: str lines
        return self._dbg.read_line("pdb")


class _Console(code.InteractiveConsole):
    """pdb's ``interact`` console on a rank: lines come from the notebook, output goes back to it."""

    def __init__(self, ns: dict, dbg: RankDebugger) -> None:
        super().__init__(ns)
        self._dbg = dbg

    def raw_input(self, prompt: str = "") -> str:
        self._dbg.stdout.write(prompt)
        line = self._dbg.read_line("interact")
        if line.rstrip("\n").strip() in _EXIT_LINES:
            raise EOFError
        return line.rstrip("\n")

    def write(self, data: str) -> None:
        self._dbg.stdout.write(data)


class RemotePdb(pdb.Pdb):
    """A pdb.Pdb whose terminal is the notebook cell (see the module docstring).

    The debugged stack ends at the frame that a cell (or a ``Mesh.call`` function) runs in: ``w`` and ``u`` show
    the user's frames, not the runtime's.
    """

    def __init__(self, dbg: RankDebugger) -> None:
        self._dbg = dbg
        self._how = "continue"
        super().__init__(stdin=cast(IO[str], dbg.stdin), stdout=cast(IO[str], dbg.stdout), nosigint=True,
                         readrc=False)
        self.prompt = "(Pdb) "

    def trace_from(self, frame: types.FrameType) -> None:
        """``Bdb.set_trace`` limited to the user's frames: trace ``frame`` and its callers up to the cell frame."""
        self.reset()
        f: types.FrameType | None = frame
        while f is not None:
            f.f_trace = self.trace_dispatch
            self.botframe = f
            if f.f_back is None or is_internal(f.f_back.f_code.co_filename):
                break
            f = f.f_back
        self.set_step()
        self._dbg.traced()
        sys.settrace(self.trace_dispatch)

    def trace_dispatch(self, frame: types.FrameType, event: str, arg: Any) -> Any:
        try:
            return super().trace_dispatch(frame, event, arg)
        except bdb.BdbQuit as e:
            if e.args:
                raise
            raise bdb.BdbQuit("pdb's quit (q) on this rank; c lets a rank go on instead") from None

    # How the program goes on after the prompt (reported to the controller as DebugResumed.how).

    def set_step(self) -> None:
        self._how = "step"
        super().set_step()

    def set_next(self, frame: types.FrameType) -> None:
        self._how = "step"
        super().set_next(frame)

    def set_return(self, frame: types.FrameType) -> None:
        self._how = "step"
        super().set_return(frame)

    def set_until(self, frame: types.FrameType, lineno: int | None = None) -> None:
        self._how = "step"
        super().set_until(frame, lineno)

    def set_continue(self) -> None:
        self._how = "continue"
        super().set_continue()

    def set_quit(self) -> None:
        self._how = "quit"
        super().set_quit()

    def interaction(self, frame: types.FrameType | None, tb: types.TracebackType | None) -> None:
        self._how = "continue"
        with self._dbg.prompting(self, lambda: self._how) as raise_now:
            super().interaction(frame, tb)
        if raise_now[0]:
            if tb is None:
                self.set_continue()
            self._dbg.note_interrupt()
            raise KeyboardInterrupt("interrupted at the debugger prompt")

    def do_interact(self, arg: str) -> None:
        assert self.curframe is not None
        ns = {**self.curframe.f_globals, **self.curframe_locals}
        console = _Console(ns, self._dbg)
        saved = sys.stdout, sys.stderr
        sys.stdout = sys.stderr = self.stdout
        try:
            console.interact(banner="*interactive* (exit() returns to pdb)", exitmsg="")
        finally:
            sys.stdout, sys.stderr = saved

    do_interact.__doc__ = pdb.Pdb.do_interact.__doc__


class RankDebugger:
    """The debugging side of one rank (see the module docstring for the threads)."""

    def __init__(self, rank: RankSide) -> None:
        self._rank = rank
        self.stdout = _DebugStdout(self)
        self.stdin = _DebugStdin(self)
        self._lock = threading.Lock()  # guards _waiting_id, _detach, _raise
        self._interaction = threading.RLock()  # one pdb interaction at a time in this process
        self._inputs: queue.SimpleQueue = queue.SimpleQueue()
        self._prompt_ids = itertools.count(1)
        self._waiting_id = 0  # the prompt the debugged thread waits on (0: none)
        self._detach = False  # answer every prompt with "continue" until the interaction ends
        self._raise = False  # then raise KeyboardInterrupt at the current line
        # The main thread reports that pdb left its prompt, or keeps a cell's exception: a SIGINT then waits
        # (sigint_pending) instead of raising inside that code.
        self.leaving = False
        self.sigint_pending = False
        self._active: RemotePdb | None = None
        self._traced = False
        self._in_post_mortem = False
        self.error: BaseException | None = None  # the last failed cell's exception (post-mortem)

    def install(self) -> None:
        """Route ``breakpoint()`` and ``pdb.set_trace()`` on this rank to the notebook."""
        sys.breakpointhook = self.breakpointhook
        pdb.set_trace = self.set_trace

    # ---- entry points (the thread that stops)

    def breakpointhook(self, *args: Any, **kwargs: Any) -> None:
        """``sys.breakpointhook``: stop in the caller's frame. PYTHONBREAKPOINT=0 turns breakpoints off."""
        if os.environ.get("PYTHONBREAKPOINT") == "0":
            return
        if dapside.client_connected():  # the notebook's visual debugger is attached: stop there, not at a prompt
            dapside.stop_here(sys._getframe(1))
            return
        dapside.release_thread()
        self._trace(sys._getframe(1), None)

    def set_trace(self, *, header: str | None = None) -> None:
        """``pdb.set_trace`` on a rank: stop in the caller's frame."""
        self._trace(sys._getframe(1), header)

    def _trace(self, frame: types.FrameType, header: str | None) -> None:
        p = RemotePdb(self)
        if header is not None:
            p.message(header)
        p.trace_from(frame)

    def post_mortem(self, mode: str = "pdb") -> tuple[bool, Any]:
        """Open pdb on the kept traceback (main thread, run as a cell). Returns (True, {"debugged", "reason"}).

        ``mode`` "sidebar" stops in the attached visual debugger instead (until its Continue); "listen" only
        starts this rank's debugpy adapter for that and adds its ``"port"`` (see ``P.DebugPostMortem``)."""
        exc = self.error
        if exc is None:
            return True, {"debugged": False, "reason": f"rank {self._rank.rank} keeps no traceback: its last cell "
                          "did not raise, or the traceback was cleared"}
        tb = exc.__traceback__
        while tb is not None and is_internal(tb.tb_frame.f_code.co_filename):
            tb = tb.tb_next
        if tb is None:
            return True, {"debugged": False, "reason": f"the error of rank {self._rank.rank} has no frames of "
                          "the notebook's code to debug"}
        if mode == "listen":
            return True, {"debugged": False, "reason": "", "port": dapside.listen()}
        if mode == "sidebar":
            if not dapside.client_connected():
                return True, {"debugged": False, "reason": f"rank {self._rank.rank} is not attached to the visual "
                              "debugger (is the debugger on in the notebook's toolbar?)"}
            self._in_post_mortem = True
            try:
                dapside.post_mortem(exc, tb)
            finally:
                self._in_post_mortem = False
            return True, {"debugged": True, "reason": ""}
        p = RemotePdb(self)
        p.reset()
        p.message("".join(traceback.format_exception_only(type(exc), exc)).rstrip("\n"))
        self._in_post_mortem = True
        try:
            p.interaction(None, tb)
        except KeyboardInterrupt:
            pass  # "raise" at a post-mortem prompt: there is nothing left to interrupt
        finally:
            self._in_post_mortem = False
        return True, {"debugged": True, "reason": ""}

    # ---- the debugged thread's side of the conversation

    def read_line(self, kind: str) -> str:
        """Send what pdb wrote and a prompt; wait for the controller's line (with its newline)."""
        text = self.stdout.take()
        body, nl, prompt = text.rpartition("\n")
        if body or nl:
            self.send(P.DebugOutput(text=body + nl))
        with self._lock:
            if self._detach:
                return self._leave(kind)
            prompt_id = next(self._prompt_ids)
            self._waiting_id = prompt_id
        frame, lineno = None, 0
        active = self._active
        if active is not None and active.stack:
            frame, lineno = active.stack[active.curindex]  # pdb's current frame (after u/d) and its line
        self.send(P.DebugPrompt(
            prompt_id=prompt_id, prompt=prompt, kind=kind, cell_id=self._rank.current_cell,
            filename=frame.f_code.co_filename if frame else "", lineno=lineno,
            function=frame.f_code.co_name if frame else ""))
        try:
            line, action = self._inputs.get()
        finally:
            with self._lock:
                self._waiting_id = 0
        if action:
            with self._lock:
                self._detach = True
                self._raise = self._raise or action == "raise"
                return self._leave(kind)
        return line + "\n"

    @staticmethod
    def _leave(kind: str) -> str:
        if kind == "interact":
            raise EOFError  # ends the console; pdb's next prompt continues
        return "continue\n"

    def _end_interaction(self, how: str) -> bool:
        """pdb left its prompt: report it; True when the program should raise KeyboardInterrupt now."""
        rest = self.stdout.take()
        if rest:
            self.send(P.DebugOutput(text=rest if rest.endswith("\n") else rest + "\n"))
        with self._lock:
            raise_now, self._raise, self._detach = self._raise, False, False
        self.send(P.DebugResumed(how="raise" if raise_now else how))
        return raise_now

    def send(self, msg: P.Message) -> None:
        """Send a debug message to the controller (any thread)."""
        self._rank.send(msg)

    def traced(self) -> None:
        """A pdb of this rank set a trace: the next cell's end removes it."""
        self._traced = True

    @contextlib.contextmanager
    def prompting(self, active: RemotePdb, how: Callable[[], str]) -> Iterator[list[bool]]:
        """One pdb interaction of ``active`` (one at a time in this process); on leaving, the rank reports how the
        program goes on (``how()``) and the yielded list holds whether to raise KeyboardInterrupt at the line where
        it stopped (an interrupt came, or is held: runtime.on_sigint)."""
        raise_now = [False]
        with self._interaction:
            with self._lock:
                self._detach = self._raise = False  # left over from an interrupt that came as it ended
            self._active = active
            try:
                yield raise_now
            finally:
                self._active = None
                # An interrupt that comes while the rank reports leaving the prompt is held (runtime.on_sigint) and
                # raised at the line where it stopped, not inside the report.
                self.leaving = True
                try:
                    raise_now[0] = self._end_interaction(how())
                finally:
                    self.leaving = False
                raise_now[0], self.sigint_pending = raise_now[0] or self.sigint_pending, False

    def note_interrupt(self) -> None:
        """The KeyboardInterrupt about to be raised at a prompt is an interrupt, not the cell's own exception."""
        self._rank.note_interrupt(self._rank.current_cell)

    # ---- cells (main thread, called by the runtime)

    def keeping(self) -> _Keeping:
        """Around a cell's code: drop the previous cell's exception, keep this one's if it raises (only cells
        and calls, not transfers, so a failed pull does not replace what post-mortem shows)."""
        return _Keeping(self)

    def keep_error(self, exc: BaseException) -> None:
        """Keep a failed cell's exception for post-mortem. When pdb raised it (``q``, or an interrupt at the
        prompt), the frames of pdb and bdb at the end of its traceback are dropped: it was raised in the user's
        frame, and that is where tracebacks and post-mortem should show it."""
        if self._in_post_mortem:
            return
        entries = []
        tb = exc.__traceback__
        while tb is not None:
            entries.append((tb.tb_frame, tb.tb_lasti, tb.tb_lineno))
            tb = tb.tb_next
        keep = len(entries)
        while keep > 1 and _is_debugger_frame(entries[keep - 1][0]):
            keep -= 1
        if keep < len(entries):
            rebuilt = None
            for frame, lasti, lineno in reversed(entries[:keep]):
                rebuilt = types.TracebackType(rebuilt, frame, lasti, lineno)
            exc.__traceback__ = rebuilt
        self.error = exc

    def cell_finished(self) -> None:
        """Stop tracing: a breakpoint (or ``b``) of the cell must not slow the next cells down."""
        if self._traced:
            sys.settrace(None)
            self._traced = False
        if self._rank.ns is not None:  # pdb marks returns in the frame's locals: the namespace, for a cell
            self._rank.ns.ns.pop("__return__", None)
            self._rank.ns.ns.pop("__exception__", None)
        with self._lock:
            self._detach = self._raise = False

    # ---- I/O thread

    def on_input(self, msg: P.DebugInput, payload: bytes, bufs: list) -> None:
        with self._lock:
            if msg.prompt_id != self._waiting_id or self._waiting_id == 0:
                log.debug("rank %d: dropped input for prompt %d", self._rank.rank, msg.prompt_id)
                return
            self._waiting_id = -1  # one answer per prompt
            if msg.action == "raise":  # from now on an interrupt of this cell finds the rank leaving to raise
                self._raise = self._detach = True
            self._inputs.put((msg.line, msg.action))

    def on_interrupt(self, cell_id: int) -> bool:
        """An interrupt of ``cell_id`` arrived. True when the debugger took it (no SIGINT must be sent)."""
        with self._lock:
            if self._rank.current_cell != cell_id or self._active is None:
                return False
            raising = self._raise  # the prompt was answered "raise": the rank raises where it stopped anyway
            self._raise = self._detach = True
            if self._waiting_id > 0:  # at the prompt: answer it
                self._waiting_id = -1
                self._inputs.put(("", "raise"))
                return True
        # Raising already: a SIGINT too could land in the cell's ending, after pdb raised, and replace that
        # KeyboardInterrupt before post-mortem keeps it. In a pdb command: SIGINT stops it, the next prompt raises.
        return raising

    def on_clear(self, msg: P.DebugClear, payload: bytes, bufs: list) -> None:
        had = self.error is not None
        self.error = None
        self.send(P.DebugReply(msg.request_id, True, "cleared" if had else "none"))

    def on_inspect(self, msg: P.Inspect, payload: bytes, bufs: list) -> None:
        threading.Thread(target=self._inspect, args=(msg,), name="monarch-inspect", daemon=True).start()

    def _inspect(self, msg: P.Inspect) -> None:
        rank = self._rank
        cell = rank.current_cell
        main = sys._current_frames().get(rank.main_ident or -1)
        stack = main_thread_stack(main) if cell >= 0 else []
        # Where in the notebook's code (a library call it is in, like os.path.exists, is not where the user looks).
        in_cell = _innermost_cell_frame(main) if main is not None and cell >= 0 else None
        where = _where(in_cell) if in_cell is not None else (
            f"{stack[-1][0]} line {stack[-1][1]}, in {stack[-1][2]}" if stack else "")
        active = self._active
        if active is not None and active.curframe is not None:
            where = _where(active.curframe)
        ns = rank.ns.ns if rank.ns is not None else {}
        local_ns = None
        if msg.frame and main is not None and cell >= 0:
            frame = active.curframe if active is not None else _innermost_cell_frame(main)
            if frame is not None:
                local_ns = frame.f_locals
                where = _where(frame)
        try:
            value = eval(compile(msg.expr, "<inspect>", "eval"), ns, local_ns)  # noqa: S307 - the user's request
            text, ok = repr(value), True
        except BaseException as e:  # noqa: BLE001 - report whatever the expression raised
            text, ok = "".join(traceback.format_exception_only(type(e), e)).rstrip("\n"), False
        if len(text) > MAX_REPR:
            text = text[:MAX_REPR] + f"... ({len(text) - MAX_REPR} more characters)"
        state = ("debugging" if active is not None else "running") if cell >= 0 else "idle"
        self.send(P.DebugReply(msg.request_id, ok, text, state, where, cell))


class _Keeping:
    """``RankDebugger.keeping()``: a class, not contextlib, so the traceback keep_error trims is the one that
    propagates (contextlib puts the original back)."""

    def __init__(self, dbg: RankDebugger) -> None:
        self._dbg = dbg

    def __enter__(self) -> None:
        self._dbg.error = None

    def __exit__(self, typ: type | None, exc: BaseException | None, tb: types.TracebackType | None) -> None:
        # The cell is ending: a SIGINT now (a late or re-sent interrupt of this cell) is held by runtime.on_sigint
        # and dropped here, so it cannot replace the exception being kept (pdb's KeyboardInterrupt, say).
        dbg = self._dbg
        dbg.leaving = True
        try:
            if exc is not None:
                dbg.keep_error(exc)
        finally:
            dbg.leaving = dbg.sigint_pending = False


_DEBUGGER_FILES = {os.path.abspath(str(m.__file__)) for m in (bdb, pdb, code, cmd)}


def _is_debugger_frame(frame: types.FrameType) -> bool:
    name = frame.f_code.co_filename
    return is_internal(name) or os.path.abspath(name) in _DEBUGGER_FILES


def _innermost_cell_frame(frame: types.FrameType) -> types.FrameType | None:
    """The innermost frame of notebook code (cells and the functions they define: files named "<...>")."""
    f: types.FrameType | None = frame
    while f is not None:
        name = f.f_code.co_filename
        if name.startswith("<") and not name.startswith("<frozen") and name != "<inspect>":
            return f
        f = f.f_back
    return None


def _where(frame: types.FrameType) -> str:
    return f"{frame.f_code.co_filename} line {frame.f_lineno}, in {frame.f_code.co_name}"
