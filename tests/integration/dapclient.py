"""A DAP client that speaks to a real Jupyter kernel as JupyterLab's debugger does: ``debug_request`` on the control
channel, ``debug_reply`` back, ``debug_event`` on IOPub; cells on the shell channel, read while events come."""

from __future__ import annotations

import os
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from jupyter_client.manager import KernelManager, start_new_kernel
from jupyter_client.session import Session

TIMEOUT = 180.0


@dataclass
class CellRun:
    msg_id: str
    reply: dict = field(default_factory=dict)
    stdout: str = ""
    results: list[str] = field(default_factory=list)
    errors: list[dict] = field(default_factory=list)
    idle: bool = False


class Frontend:
    """DAP on one client's control channel, as one JupyterLab page sends it (its own client session)."""

    def __init__(self, kc: Any) -> None:
        self.kc = kc
        self.seq = 0

    def dap(self, command: str, timeout: float = TIMEOUT, **arguments: Any) -> dict:
        """Send one DAP request as a ``debug_request``; the ``debug_reply`` content."""
        self.seq += 1
        msg = self.kc.session.msg("debug_request", {"type": "request", "seq": self.seq, "command": command,
                                                    "arguments": arguments})
        self.kc.control_channel.send(msg)
        deadline = time.monotonic() + timeout
        while True:
            reply = self.kc.get_control_msg(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply["content"]

    def debugger_on(self) -> None:
        """What JupyterLab sends when the bug icon is clicked."""
        rep = self.dap("initialize", clientID="jupyterlab", clientName="JupyterLab", adapterID="python",
                       pathFormat="path", linesStartAt1=True, columnsStartAt1=True, supportsVariableType=True,
                       supportsVariablePaging=True, supportsRunInTerminalRequest=True, locale="en")
        assert rep["success"], rep
        rep = self.dap("attach")
        assert rep["success"], rep
        rep = self.dap("configurationDone")
        assert rep["success"], rep

    def close(self) -> None:
        self.kc.stop_channels()


class DapKernel:
    """One kernel, its channels, and a thread that sorts IOPub and shell messages (events, cells)."""

    def __init__(self, cwd: str) -> None:
        self.km: KernelManager
        self.km, self.kc = start_new_kernel(kernel_name="python3", env=dict(os.environ), cwd=cwd)
        self.frontend = Frontend(self.kc)
        self.events: queue.Queue[dict] = queue.Queue()
        self.event_seqs: list[int] = []  # the seq of every debug event the kernel sent, in order
        self.cells: dict[str, CellRun] = {}
        self.lock = threading.Condition()
        self._stop = False
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        kc = self.kc
        while not self._stop:
            busy = False
            for get, ready in ((kc.get_iopub_msg, kc.iopub_channel.msg_ready),
                               (kc.get_shell_msg, kc.shell_channel.msg_ready)):
                while not self._stop and ready():
                    busy = True
                    self._sort(get(timeout=1))
            if not busy:
                time.sleep(0.01)

    def _sort(self, msg: dict) -> None:
        kind, content = msg["msg_type"], msg["content"]
        if kind == "debug_event":
            self.event_seqs.append(content.get("seq"))
            self.events.put(content)
            return
        with self.lock:
            run = self.cells.get(msg["parent_header"].get("msg_id", ""))
            if run is None:
                return
            if kind == "execute_reply":
                run.reply = content
            elif kind == "stream":
                run.stdout += content["text"]
            elif kind == "execute_result":
                run.results.append(content["data"]["text/plain"])
            elif kind == "error":
                run.errors.append(content)
            elif kind == "status" and content["execution_state"] == "idle":
                run.idle = True
            self.lock.notify_all()

    def close(self) -> None:
        self._stop = True
        self._reader.join(5)
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=True)

    # ------------------------------------------------------------------ DAP

    def dap(self, command: str, timeout: float = TIMEOUT, **arguments: Any) -> dict:
        """Send one DAP request as a ``debug_request``; the ``debug_reply`` content."""
        return self.frontend.dap(command, timeout, **arguments)

    def debugger_on(self) -> None:
        """What JupyterLab sends when the bug icon is clicked."""
        self.frontend.debugger_on()

    def other_frontend(self) -> Frontend:
        """A second frontend of this kernel (another browser tab: a client session of its own), DAP only."""
        session = Session(key=self.km.session.key, signature_scheme=self.km.session.signature_scheme)
        kc = self.km.client(session=session)
        kc.start_channels(shell=False, iopub=False, stdin=False, hb=False, control=True)
        return Frontend(kc)

    def wait_event(self, pred: Any, timeout: float = TIMEOUT, what: str = "event") -> dict:
        deadline = time.monotonic() + timeout
        seen = []
        while True:
            try:
                ev = self.events.get(timeout=max(0.01, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no {what} within {timeout:g} s; saw {seen}") from None
            if pred(ev):
                return ev
            seen.append((ev.get("event"), ev.get("body")))

    # ------------------------------------------------------------------ cells

    def submit(self, code: str) -> CellRun:
        with self.lock:  # the reader thread drops replies of unknown cells: a fast reply must find this one
            msg_id = self.kc.execute(code, stop_on_error=False)
            run = self.cells[msg_id] = CellRun(msg_id)
        return run

    def wait(self, run: CellRun, timeout: float = TIMEOUT) -> CellRun:
        deadline = time.monotonic() + timeout
        with self.lock:
            while not (run.idle and run.reply):
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"no end of cell; output so far:\n{run.stdout}"
                self.lock.wait(min(remaining, 0.5))
        return run

    def wait_output(self, run: CellRun, text: str, timeout: float = TIMEOUT) -> None:
        """Wait until the cell's output holds ``text``."""
        deadline = time.monotonic() + timeout
        with self.lock:
            while text not in run.stdout:
                remaining = deadline - time.monotonic()
                assert remaining > 0, f"{text!r} not in the cell's output:\n{run.stdout}"
                self.lock.wait(min(remaining, 0.5))

    def execute(self, code: str, timeout: float = TIMEOUT) -> CellRun:
        return self.wait(self.submit(code), timeout)
