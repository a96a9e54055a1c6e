"""The kernel's visual debugger speaks for the mesh: one DAP conversation for the kernel's debugpy and its ranks.

JupyterLab's debugger talks DAP to the kernel (``debug_request`` on the control channel, ``debug_event`` on IOPub);
ipykernel relays it to the kernel's own debugpy (``kernel.debugger``, ipykernel.debugger.Debugger). When the
extension is loaded, ``install`` puts a ``MeshDebugger`` in front of it, which

- passes every request to the kernel's own debugger first, so the kernel's cells debug as before;
- attaches one debugpy session per rank when a ``%%mesh`` cell runs while a frontend is attached
  (``prepare_cell``: the rank listens on a loopback port, ``monarch_worker.dapside``; ``RankSession`` connects, or,
  for ranks that joined from elsewhere, the connection is relayed over the mesh's own, ``DapRelay.open``), and
  compiles the cell on the ranks under the path JupyterLab gave that cell (``dumpCell``: a Murmur2 hash of the
  cell's code, ipykernel.compiler.get_file_name), the ``%%mesh`` line counted, so gutter breakpoints hit;
- copies a rank's value into the notebook (``copyToGlobals``: pickled on the rank, unpickled here);
- gives each rank's threads, frames and variable references virtual ids (``VirtualIds``), lists ranks' threads as
  ``rank N: MainThread`` in ``threads``, and sends requests about a rank's ids (``stackTrace``, ``scopes``,
  ``variables``, ``evaluate``, ``next``, ``stepIn``, ``stepOut``, ``pause``, ...) to that rank, and names its
  frames ``rank N: <module>`` (JupyterLab's call stack shows no thread names);
- copies ``setBreakpoints`` and ``setExceptionBreakpoints`` to every rank session, and forwards ranks' ``stopped``,
  ``continued`` and ``thread`` events with their ids mapped.

``continue`` on a rank's thread resumes every stopped rank: SPMD ranks meet in collectives, so a rank continued
alone would only wait in the next one for the ranks still stopped. Steps act on the selected rank only.
Disconnecting (the bug icon off, or the frontend gone) disconnects every rank session, and debugpy resumes ranks
that were stopped.
"""

from __future__ import annotations

import asyncio
import base64
import concurrent.futures
import itertools
import logging
import os
import re
import socket
import sys
import threading
from collections.abc import Callable
from typing import Any

from ..ranks import ranks_text
from .dapfrontends import Frontends, response
from .dapsession import RankSession, SessionClosed

log = logging.getLogger(__name__)

__all__ = ["MeshDebugger", "VirtualIds", "Connect", "install", "uninstall", "prepare_cell", "attached_debugger",
           "connector"]

ATTACH_TIMEOUT = 60.0  # seconds for a rank to start listening and for its debugpy session to attach
REQUEST_TIMEOUT = 30.0  # seconds for a rank's answer to one request
_SHIFT = 24  # virtual id = (rank + 1) << 24 | the rank's own id; the kernel's own ids stay below 1 << 24
# Arguments and body fields that hold thread, frame or variable ids.
_ID_KEYS = ("threadId", "frameId", "variablesReference", "srcFrameId")
# Rank events passed on to the frontend (others, such as "initialized" or "process", belong to one session).
_EVENTS = ("stopped", "continued", "thread", "output")
# The rank picker: typed in the debugger's "Evaluate Code" dialog (any frame), it shows rank R in the sidebar.
# Where the live view says a rank stopped, by the stopped event's reason (others: "at a breakpoint").
_AT = {"exception": "at an exception", "pause": "(paused)", "step": "after a step"}
#: How the debugger connects to rank ``rank``'s adapter on port ``port`` of that rank's loopback: a connected socket.
Connect = Callable[[int, int], socket.socket]
_SELECT = re.compile(r"^\s*%mesh\s+select(?:\s+(\S+))?\s*$")


class VirtualIds:
    """Ids of one rank as the frontend sees them: ``(rank + 1) << 24 | id`` (ids of the kernel's own debugpy pass
    unchanged). debugpy numbers threads, frames and variable references from 1 per process."""

    @staticmethod
    def to_virtual(rank: int, real: int) -> int:
        if real <= 0:
            return real  # 0: "no reference"
        if real >= 1 << _SHIFT:
            raise ValueError(f"rank {rank}'s debugger id {real} does not fit a virtual id")
        return ((rank + 1) << _SHIFT) | real

    @staticmethod
    def rank_of(virtual: Any) -> int | None:
        """The rank a virtual id belongs to, or None for the kernel's own."""
        if not isinstance(virtual, int) or virtual < 1 << _SHIFT:
            return None
        return (virtual >> _SHIFT) - 1

    @staticmethod
    def to_real(virtual: int) -> int:
        return virtual & ((1 << _SHIFT) - 1) if virtual >= 1 << _SHIFT else virtual

    @classmethod
    def rewrite(cls, value: Any, rank: int, outward: bool) -> Any:
        """A copy of a DAP body or arguments with every id field mapped (outward: rank -> virtual)."""
        if isinstance(value, list):
            return [cls.rewrite(v, rank, outward) for v in value]
        if not isinstance(value, dict):
            return value
        out = {}
        for key, v in value.items():
            if key in _ID_KEYS and isinstance(v, int):
                out[key] = cls.to_virtual(rank, v) if outward else cls.to_real(v)
            elif key == "id" and isinstance(v, int) and outward:  # threads[].id, stackFrames[].id
                out[key] = cls.to_virtual(rank, v)
            elif key == "id" and isinstance(v, int):
                out[key] = cls.to_real(v)
            else:
                out[key] = cls.rewrite(v, rank, outward)
        return out


class MeshDebugger:
    """Stands where ipykernel keeps ``kernel.debugger``; the kernel's own debugger is ``inner``.

    ``process_request`` runs on the kernel's control thread (asyncio); ``prepare_cell`` on its main thread; rank
    events arrive on each session's reader thread. ``_lock`` guards the sessions and the stopped threads.
    """

    def __init__(self, inner: Any, kernel: Any = None) -> None:
        self.inner = inner
        self.frontends = Frontends(kernel)  # which frontend drives it (two attached: the last one)
        self.sessions: dict[int, RankSession] = {}
        self.stopped: dict[int, set[int]] = {}  # rank -> its stopped (real) thread ids
        self.stopped_events: dict[int, dict] = {}  # rank -> the body of its last stopped event, as sent
        self.shown: int | None = None  # the (virtual) thread of the last stopped event sent: the one the sidebar shows
        self.breakpoints: dict[str, dict] = {}  # source path -> the last setBreakpoints arguments
        self.exception_breakpoints: dict | None = None
        self.missing_note_shown = False
        self.events: Any = None  # the mesh's events (prepare_cell): the live view shows ranks stopped here
        self._lock = threading.Lock()
        # The seq of each event it sends: DAP wants every message of one side numbered uniquely, and the ranks'
        # adapters each count from 1, as the kernel's own debugpy does; these start past any count of theirs.
        self._seq = itertools.count(1 << 30)

    @property
    def attached(self) -> bool:
        """Whether a frontend's debugger is on (ipykernel's ``is_started``: from ``initialize`` to ``disconnect``)."""
        return bool(getattr(self.inner, "is_started", False))

    # ---- what ipykernel uses of its debugger

    @property
    def tcp_client(self) -> Any:
        return self.inner.tcp_client

    async def handle_stopped_event(self) -> None:
        await self.inner.handle_stopped_event()

    async def process_request(self, message: dict) -> dict:
        """Answer one DAP request from the frontend (the content of a ``debug_request``)."""
        command = message.get("command")
        args = message.get("arguments") or {}
        if (answer := self.frontends.before(message, self.attached)) is not None:
            return answer
        if command == "evaluate" and (picked := _SELECT.match(str(args.get("expression", "")))):
            return self._select(message, picked.group(1))
        rank = next((r for k in _ID_KEYS if (r := VirtualIds.rank_of(args.get(k))) is not None), None)
        if rank is not None:
            return await self._rank_request(rank, message)
        if command == "continue" and not getattr(self.inner, "stopped_threads", None):
            with self._lock:
                stopped = sorted(r for r, ts in self.stopped.items() if ts)
            if stopped:  # JupyterLab sends threadId 1 when it lost track of the rank's thread: the ranks go on
                return await self._continue_all(message, stopped[0])
        reply = await self.inner.process_request(message)
        self.frontends.after(message, reply)
        if command == "threads" and reply.get("success"):
            reply["body"]["threads"] = reply["body"].get("threads", []) + await self._rank_threads()
        elif command == "setBreakpoints":
            self.breakpoints[args.get("source", {}).get("path", "")] = args
            await self._broadcast("setBreakpoints", args)
        elif command == "setExceptionBreakpoints":
            self.exception_breakpoints = args
            await self._broadcast("setExceptionBreakpoints", args)
        elif command == "debugInfo" and reply.get("success"):
            with self._lock:
                ranks = [VirtualIds.to_virtual(r, t) for r, ts in self.stopped.items() for t in ts]
            # JupyterLab shows the first stopped thread after it asks again (e.g. when the Debug Console takes the
            # focus): the one shown, else the sidebar would fall back to the lowest rank after '%mesh select R'
            ranks.sort(key=lambda t: t != self.shown)
            reply["body"]["stoppedThreads"] = list(reply["body"].get("stoppedThreads", [])) + ranks
        elif command == "disconnect":
            self.missing_note_shown = False
            self.breakpoints.clear()
            self.exception_breakpoints = None
            await asyncio.get_running_loop().run_in_executor(None, self.detach_ranks)
        return reply

    def _select(self, message: dict, which: str | None) -> dict:
        """``%mesh select R`` in the Evaluate dialog: the sidebar shows rank R. JupyterLab shows the thread of the
        last ``stopped`` event it got (its callstack has no thread list), so rank R's is sent again, after a
        ``continued`` one for it: JupyterLab 4 blanks the Variables panel on every evaluate reply and loads it
        again only when the current frame changes, which it does not when R is the rank shown already (the
        ``continued`` clears its frames, so the ``stopped`` after it makes R's frame current anew).

        A rank that is not stopped is refused in the answer's result, as a REPL prints a message (JupyterLab's
        Debug Console shows only "Evaluation resulted in an error" for a failed evaluate), and the rank shown
        stays (sent again: the reply blanked its variables)."""
        with self._lock:
            stopped = dict(self.stopped_events)
        rank = int(which) if which is not None and which.isdigit() else None
        if rank is not None and rank in stopped:
            text = f"rank {rank}: its stack and variables are in the sidebar"
        else:
            now = f"stopped now: {ranks_text(sorted(stopped))}" if stopped else "no rank is stopped now"
            why = "which rank?" if which is None else f"rank {which} is not stopped at a breakpoint"
            text = f"{why} ({now}). %mesh select R shows rank R's stack and variables"
            rank = next((r for r, body in stopped.items() if body.get("threadId") == self.shown), None)
        if rank is not None:
            self._publish({"type": "event", "event": "continued",
                           "body": {"threadId": stopped[rank]["threadId"], "allThreadsContinued": False}})
            self.shown = stopped[rank]["threadId"]
            self._publish({"type": "event", "event": "stopped", "body": stopped[rank]})
        return {"type": "response", "seq": message.get("seq"), "request_seq": message.get("seq"), "success": True,
                "command": "evaluate", "body": {"result": text, "variablesReference": 0}}

    # ---- requests about a rank

    async def _rank_request(self, rank: int, message: dict) -> dict:
        command = message["command"]
        session = self.sessions.get(rank)
        if session is None or not session.alive:
            return _failure(message, f"rank {rank} is not attached to the debugger any more (it ended or the mesh "
                                     "restarted); run the cell again")
        args = VirtualIds.rewrite(message.get("arguments") or {}, rank, outward=False)
        if command == "continue":
            return await self._continue_all(message, rank)
        if command == "richInspectVariables":
            return await self._rich_inspect(session, message, args)
        if command == "copyToGlobals":
            return await self._copy_to_globals(session, message, args)
        try:
            resp = await asyncio.wrap_future(session.request(command, args))
        except SessionClosed as e:
            return _failure(message, str(e))
        if command == "threads":
            resp["body"] = {"threads": _label_threads(rank, resp.get("body", {}).get("threads", []))}
        elif resp.get("body"):
            resp["body"] = VirtualIds.rewrite(resp["body"], rank, outward=True)
            if command == "stackTrace":  # JupyterLab's call stack shows frames only: each says whose it is
                resp["body"]["stackFrames"] = [{**f, "name": f"rank {rank}: {f.get('name', '')}"}
                                               for f in resp["body"].get("stackFrames", [])]
        return {**resp, "request_seq": message.get("seq"), "seq": message.get("seq")}

    async def _continue_all(self, message: dict, selected: int) -> dict:
        with self._lock:
            stopped = {r: set(ts) for r, ts in self.stopped.items() if ts}
        stopped.setdefault(selected, set())
        futures = []
        for r, threads in stopped.items():
            session = self.sessions.get(r)
            if session is None or not session.alive:
                continue
            tid = min(threads) if threads else VirtualIds.to_real(message["arguments"]["threadId"])
            futures.append(asyncio.wrap_future(session.request("continue", {"threadId": tid})))
        results = await asyncio.gather(*futures, return_exceptions=True)
        ok = any(isinstance(r, dict) and r.get("success") for r in results)
        for r, threads in stopped.items():  # the frontend forgets every rank thread that runs again
            if ok and threads and self.events is not None:
                self.events.emit("rank_state", rank=r, state="running")
            for t in threads:
                self._publish({"type": "event", "seq": 0, "event": "continued",
                               "body": {"threadId": VirtualIds.to_virtual(r, t), "allThreadsContinued": False}})
        return {"type": "response", "seq": message.get("seq"), "request_seq": message.get("seq"), "success": ok,
                "command": "continue", "body": {"allThreadsContinued": False}}

    async def _rich_inspect(self, session: RankSession, message: dict, args: dict) -> dict:
        name = args.get("variableName", "")
        if not name.isidentifier():
            return {**_failure(message, ""), "success": name in ("special variables", "function variables"),
                    "body": {"data": {}, "metadata": {}}}
        resp = await asyncio.wrap_future(session.request("evaluate", {
            "expression": name, "frameId": args.get("frameId"), "context": "clipboard"}))
        data = {"text/plain": resp["body"]["result"]} if resp.get("success") else {}
        return {"type": "response", "seq": message.get("seq"), "request_seq": message.get("seq"),
                "success": bool(resp.get("success")), "command": message["command"],
                "body": {"data": data, "metadata": {}}}

    async def _copy_to_globals(self, session: RankSession, message: dict, args: dict) -> dict:
        """Copy a rank's value (pickled there with cloudpickle, base64 through ``evaluate``) into the notebook."""
        src, dst = args.get("srcVariableName", ""), args.get("dstVariableName", "")
        if not (src.isidentifier() and dst.isidentifier()):
            return _failure(message, "dstVariableName and srcVariableName must be valid identifiers")
        expr = f"__import__('base64').b64encode(__import__('cloudpickle').dumps({src})).decode()"
        resp = await asyncio.wrap_future(session.request("evaluate", {
            "expression": expr, "frameId": args.get("srcFrameId"), "context": "clipboard"}))
        if not resp.get("success"):
            return _failure(message, f"rank {session.rank} cannot send {src}: {resp.get('message', '')}")
        import cloudpickle
        from IPython import get_ipython

        text = resp["body"]["result"].strip("'\"")
        get_ipython().user_ns[dst] = cloudpickle.loads(base64.b64decode(text))
        return {"type": "response", "seq": message.get("seq"), "request_seq": message.get("seq"), "success": True,
                "command": message["command"], "body": {}}

    async def _rank_threads(self) -> list[dict]:
        sessions = [s for s in list(self.sessions.values()) if s.alive]
        replies = await asyncio.gather(*(asyncio.wrap_future(s.request("threads")) for s in sessions),
                                       return_exceptions=True)
        threads: list[dict] = []
        for s, rep in zip(sessions, replies, strict=True):
            if isinstance(rep, dict) and rep.get("success"):
                threads += _label_threads(s.rank, rep.get("body", {}).get("threads", []))
        return threads

    async def _broadcast(self, command: str, args: dict) -> None:
        sessions = [s for s in list(self.sessions.values()) if s.alive]
        await asyncio.gather(*(asyncio.wrap_future(s.request(command, args)) for s in sessions),
                             return_exceptions=True)

    # ---- rank sessions

    def attached_to(self, rank: int, pid: int | None) -> bool:
        """Whether a live session debugs rank ``rank`` as the process ``pid`` (a restarted rank is a new process)."""
        session = self.sessions.get(rank)
        if session is not None and session.alive and session.pid == pid:
            return True
        if session is not None:
            self.sessions.pop(rank, None)
            session.close()
        return False

    def attach_ranks(self, ports: dict[int, int], pids: dict[int, int | None],
                     connect: Connect | None = None) -> None:
        """Connect to each rank's adapter (rank -> port; ``pids``: rank -> its process) and run DAP's attach
        sequence, all ranks at once (kernel main thread). ``connect(rank, port)`` makes the connection (default: to
        ``127.0.0.1:port``, a rank of this host; ``DapRelay.open`` relays it to a rank of another host).

        Raises
        ------
        OSError, TimeoutError, SessionClosed
            A rank's adapter did not accept or answer in time (the sessions of the other ranks stay).
        """
        todo = {r: p for r, p in ports.items() if not self.attached_to(r, pids.get(r))}
        if not todo:
            return
        with concurrent.futures.ThreadPoolExecutor(min(len(todo), 16), thread_name_prefix="monarch-dap-attach") as ex:
            futures = {r: ex.submit(self._attach_one, r, p, connect or _connect_local) for r, p in todo.items()}
        errors = []
        for rank, fut in sorted(futures.items()):
            try:
                session = fut.result()
            except (OSError, TimeoutError, SessionClosed) as e:
                errors.append(e)
                continue
            session.pid = pids.get(rank)
            self.sessions[rank] = session
        if errors:
            raise errors[0]

    def _attach_one(self, rank: int, port: int, connect: Connect) -> RankSession:
        import monarch_worker

        initialized = threading.Event()

        def on_event(r: int, event: dict) -> None:
            if event.get("event") == "initialized":
                initialized.set()
            self._on_rank_event(r, event)

        session = RankSession(rank, connect(rank, port), on_event)
        try:
            session.call("initialize", {"clientID": "monarch-jupyter", "adapterID": "python", "pathFormat": "path",
                                        "linesStartAt1": True, "columnsStartAt1": True,
                                        "supportsVariableType": True}, ATTACH_TIMEOUT)
            attach = session.request("attach", {
                "justMyCode": True, "subProcess": False, "redirectOutput": False,
                # the rank's own runtime (cells are run from it) is never shown or stepped into; code run by name
                # ("<mesh cell 7>": m.run, cells run before the debugger was on) is the user's (pydevd takes
                # any "<...>" file for a library's)
                "rules": [{"path": os.path.dirname(monarch_worker.__file__), "include": False},
                          {"path": "<mesh *>", "include": True}]})
            if not initialized.wait(ATTACH_TIMEOUT):
                raise TimeoutError(f"rank {rank}'s debugger did not initialize within {ATTACH_TIMEOUT:g} s")
            for args in list(self.breakpoints.values()):
                session.call("setBreakpoints", args, REQUEST_TIMEOUT)
            if self.exception_breakpoints is not None:
                session.call("setExceptionBreakpoints", self.exception_breakpoints, REQUEST_TIMEOUT)
            session.call("configurationDone", None, REQUEST_TIMEOUT)
            attach.result(ATTACH_TIMEOUT)
        except BaseException:
            session.close()
            raise
        return session

    def detach_ranks(self) -> None:
        """Disconnect every rank session; debugpy resumes a rank that was stopped (any thread)."""
        sessions, self.sessions = list(self.sessions.values()), {}
        for s in sessions:
            try:
                s.call("disconnect", {"restart": False, "terminateDebuggee": False}, REQUEST_TIMEOUT)
            except (SessionClosed, TimeoutError, OSError):
                pass
            s.close()
        with self._lock:
            self.stopped.clear()
            self.stopped_events.clear()

    def _on_rank_event(self, rank: int, event: dict) -> None:
        name, body = event.get("event"), dict(event.get("body") or {})
        gone: set[int] = set()
        with self._lock:
            threads = self.stopped.setdefault(rank, set())
            was_stopped = bool(threads)
            if name == "stopped":
                threads.add(body.get("threadId", 0))
            elif name == "continued":
                if body.get("allThreadsContinued", True):
                    threads.clear()
                else:
                    threads.discard(body.get("threadId", 0))
            elif name == "closed":
                gone, threads = set(threads), set()
                self.stopped[rank] = threads
            if not threads:
                self.stopped_events.pop(rank, None)
        if name == "closed":  # the rank ended (or its adapter did): the frontend forgets its threads
            for t in gone:
                self._publish({"type": "event", "seq": 0, "event": "continued",
                               "body": {"threadId": VirtualIds.to_virtual(rank, t), "allThreadsContinued": False}})
            for t in gone:
                self._publish({"type": "event", "seq": 0, "event": "thread",
                               "body": {"reason": "exited", "threadId": VirtualIds.to_virtual(rank, t)}})
            if self.sessions.get(rank) is not None and not self.sessions[rank].alive:
                self.sessions.pop(rank, None)
            return
        if name not in _EVENTS:
            return
        if name == "stopped":
            body["allThreadsStopped"] = False  # only this rank's thread; the others run on
            body["description"] = f"rank {rank}: {body.get('description') or body.get('reason', 'paused')}"
        elif name == "continued":
            body["allThreadsContinued"] = False
        elif name == "output" and "output" in body:
            body["output"] = f"[rank{rank}]: {body['output']}"
        body = VirtualIds.rewrite(body, rank, outward=True)
        events = self.events
        if events is not None and name == "stopped":  # the live view: the rank waits in the sidebar, not at pdb
            events.emit("rank_state", rank=rank, state="breakpoint",
                        note=f"stopped {_AT.get(body.get('reason'), 'at a breakpoint')} in the visual debugger: its "
                             f"stack and variables are in the "
                             f"sidebar (%mesh select {rank} in its Debug Console shows this rank)")
        elif events is not None and name == "continued" and was_stopped:
            events.emit("rank_state", rank=rank, state="running")
        if name == "stopped":
            with self._lock:
                if self.stopped.get(rank):
                    self.stopped_events[rank] = body
                    self.shown = body.get("threadId")
        self._publish({**event, "body": body})

    def _publish(self, event: dict) -> None:
        """Send ``event`` to the frontend (any thread) under a seq of its own (two ranks' events, or a rank's and
        the kernel's, would otherwise share one: a fresh user saw two ``stopped`` events with the same seq)."""
        self.inner.event_callback({**event, "seq": next(self._seq)})


def _connect_local(rank: int, port: int) -> socket.socket:
    """A connection to the adapter of rank ``rank`` of this host (its loopback ``port``)."""
    return socket.create_connection(("127.0.0.1", port), timeout=ATTACH_TIMEOUT)


def _label_threads(rank: int, threads: list[dict]) -> list[dict]:
    return [{**t, "id": VirtualIds.to_virtual(rank, t["id"]), "name": f"rank {rank}: {t.get('name', '')}"}
            for t in threads]


def _failure(message: dict, text: str) -> dict:
    return response(message, False, {}, text)


# ---------------------------------------------------------------------------- the kernel side of a %%mesh cell


def install(shell: Any) -> MeshDebugger | None:
    """Put a MeshDebugger in front of the kernel's debugger (idempotent); None outside a kernel with debugpy."""
    kernel: Any = getattr(shell, "kernel", None)
    inner = getattr(kernel, "debugger", None)
    if inner is None or not hasattr(inner, "process_request"):
        return None
    if isinstance(inner, MeshDebugger):
        return inner
    kernel.debugger = MeshDebugger(inner, kernel)
    return kernel.debugger


def uninstall(shell: Any) -> None:
    """Give the kernel its own debugger back (rank sessions disconnected)."""
    kernel: Any = getattr(shell, "kernel", None)
    current = getattr(kernel, "debugger", None)
    if isinstance(current, MeshDebugger):
        current.detach_ranks()
        kernel.debugger = current.inner


def attached_debugger(shell: Any) -> MeshDebugger | None:
    """The kernel's MeshDebugger while a frontend's debugger is attached to it, else None."""
    dbg = getattr(getattr(shell, "kernel", None), "debugger", None)
    return dbg if isinstance(dbg, MeshDebugger) and dbg.attached else None


def prepare_cell(shell: Any, mesh: Any, cell: str, ranks: Any) -> tuple[str, str] | None:
    """``(code, filename)`` to run a ``%%mesh`` cell under the kernel's debugger, or None when no frontend is
    attached (then the cell runs as always: this is all it costs).

    ``ranks`` is the cell's rank selection (``--ranks``; None: all). Attaches the chosen ranks that have no session
    yet. The code keeps the cell's line numbers (blank lines stand for the ``%%mesh`` line and what precedes it) and
    the filename is the path JupyterLab gave the cell.
    Where debugpy is missing on the ranks, or they do not attach in time, prints why to stderr once and returns None.
    """
    dbg = attached_debugger(shell)
    if dbg is None:
        return None
    raw = _raw_cell(shell)
    offset = _body_offset(raw, cell) if raw is not None else None
    if offset is None:
        return None
    from ipykernel.compiler import get_file_name

    from monarch_worker import dapside

    from ..errors import MonarchError
    from ..ranks import parse_ranks, ranks_text

    status = mesh.status()
    pids = {r: s["pid"] for r, s in status.items()}
    need = [r for r in parse_ranks(ranks, mesh.nproc) if not dbg.attached_to(r, pids.get(r))]
    busy = [r for r in need if status[r]["state"] != "idle"]
    if busy:  # attaching runs on the rank's main thread: it would wait behind (or time out) what the rank runs
        print(f"the debugger attaches to {ranks_text(busy)} when idle (busy with an earlier cell now), so this cell "
              "runs there without breakpoints", file=sys.stderr)
        return None
    dbg.events = mesh.events
    if need:
        try:
            ports = mesh.call(dapside.listen, ranks=need, timeout=ATTACH_TIMEOUT)
            dbg.attach_ranks({r: int(p) for r, p in ports.items()}, pids, connector(mesh))
        except (MonarchError, OSError, TimeoutError, SessionClosed) as e:
            _note_once(dbg, f"the debugger cannot attach to the ranks, so this cell runs without breakpoints: {e}")
            return None
    return "\n" * offset + cell, get_file_name(raw)


def connector(mesh: Any) -> Connect | None:
    """How the debugger reaches ``mesh``'s ranks: None (their adapters on this host's loopback) for local ranks;
    ``DapRelay.open`` (relayed over the mesh's own connection) for ranks that joined, which may be on other hosts:
    their adapters listen on their own loopback, never on the network."""
    return mesh.parts.dap.open if mesh.lifecycle.joined else None


def _note_once(dbg: MeshDebugger, text: str) -> None:
    """Tell the user (stderr, in the cell) why ranks are not debugged, once per debugger session."""
    if not dbg.missing_note_shown:
        dbg.missing_note_shown = True
        print(text, file=sys.stderr)


def _raw_cell(shell: Any) -> str | None:
    """The code of the execute_request that runs now, as the frontend sent it (what JupyterLab hashed)."""
    try:
        parent = shell.kernel.get_parent("shell")
    except Exception:
        return None
    code = (parent or {}).get("content", {}).get("code")
    return code if isinstance(code, str) else None


def _body_offset(raw: str, cell: str) -> int | None:
    """Lines of ``raw`` before the body ``cell`` of its ``%%mesh`` magic, or None when ``raw`` is not that cell."""
    start = raw.find("%%mesh")
    if start < 0 or raw[:start].strip():
        return None
    end = raw.find("\n", start)
    if end < 0:
        return None
    if raw[end + 1:].rstrip("\n") != cell.rstrip("\n"):
        return None
    return raw.count("\n", 0, end + 1)
