"""Rank output to the cells that caused it: bytes -> lines, sync markers and records -> cells.

A local rank's stdout and stderr pipes are read by the launcher's reader thread (launch/local.py), which calls
``on_output`` with the bytes; a rank that relays its own output (one that joined from elsewhere) sends them as
``Stream`` messages, handled on the I/O thread (``on_stream``). Either way each (rank, stream) has one
``StreamSplitter`` fed by one thread.

- A line goes to the oldest cell of its rank whose output on that stream is not complete (else to the last cell
  submitted), labelled ``[rankN]:``, and is kept for the rank's death report.
- A sync marker completes a cell's output on its stream.
- A record (protocol.RECORD_PREFIX) is a message the rank's main thread wrote into its stdout pipe behind its
  output (a cell's ``Result``, progress, debugger prompts): verified here under the lock once all its parts are
  in, then handled outside the lock (handlers unpickle values). A ``Result`` record also completes the cell's
  output on both streams: the launcher passes on a rank's stderr ahead of each stdout read, and the rank wrote its
  stderr before the record.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import monarch_worker
from monarch_worker import protocol as P

from .cells import CellTable
from .iothread import Handler
from .output import write_lines
from .state import LAST_LINES, MeshState, RankInfo

log = logging.getLogger(__name__)

__all__ = ["OutputRouter", "kept_for_death_report"]

_WORKER_DIR = os.path.dirname(os.path.abspath(monarch_worker.__file__))
_INTERNAL_TRACE = re.compile(r'^\s*File "(?:' + re.escape(_WORKER_DIR) + r'[/\\][^"]*|[^"]*[/\\]monarch_worker[/\\]'
                             r'[^"]*|<frozen runpy>)", line \d+ in ')


def kept_for_death_report(line: str) -> bool:
    """False for lines of a crash dump that only show the rank runtime's own frames (faulthandler prints every
    frame down to the fork server) or its list of extension modules: they would push the user's lines out of
    the last lines kept for the death report."""
    return not (_INTERNAL_TRACE.match(line) or line.startswith("Extension modules: "))


class OutputRouter:
    """Routes the output of one mesh's ranks (see the module docstring)."""

    def __init__(self, state: MeshState, cells: CellTable) -> None:
        self.state = state
        self.cells = cells
        self.record_handlers: dict[type, Handler] = {}  # what ranks may send as records (protocol.record_types)
        self._record_signer = P.Signer(bytes(32))  # the generation's replaces it; verifies records (reader thread)

    def new_generation(self, secret: bytes) -> None:
        self._record_signer = P.Signer(secret)

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        """Bytes a rank wrote on ``stream`` (the reader thread of that rank's pipes)."""
        state = self.state
        info = state.ranks.get(rank)
        if info is None:
            return
        events = info.splitters[stream].feed(data)  # the splitters are this thread's own
        i, n = 0, len(events)
        while i < n:
            with state.lock:
                # A run of lines between two sync markers goes to one cell: it is routed as one batch.
                run: list[str] = []
                while i < n and events[i][0] != "msg":
                    kind, value = events[i]
                    i += 1
                    if kind == "line":
                        run.append(str(value))
                        continue
                    self.route_lines(info, stream, run)
                    run = []
                    self.cells.on_sync(rank, stream, int(value))  # type: ignore[call-overload]
                self.route_lines(info, stream, run)
                if i == n:
                    return
                record = self._take_record(info, *events[i][1])  # type: ignore[misc]
                i += 1
            if record is not None:  # its handler unpickles values: outside the lock, as for socket messages
                msg, payload, bufs = record
                try:
                    self.record_handlers[type(msg)](rank, msg, payload, bufs)
                except Exception:  # noqa: BLE001 - keep the reader thread alive whatever a rank sent
                    log.exception("handling %s from rank %d failed", msg.TYPE, rank)

    def on_stream(self, rank: int, msg: P.Stream, payload: bytes, bufs: list) -> None:
        """Output that a rank relays itself (I/O thread)."""
        self.on_output(rank, msg.name, msg.data.encode())

    def _take_record(self, info: RankInfo, flags: int, body: bytes) -> tuple[Any, bytes, list] | None:
        """Under the lock: the verified message of a record once all of its parts are in, else None."""
        if flags & P.RECORD_MORE:
            info.record_parts.append(body)
            return None
        parts, info.record_parts = [*info.record_parts, body], []
        error: Exception | None = None
        for start in range(len(parts)):  # leading parts that fail to verify came from output that looked like one
            try:
                msg, payload, bufs = self._record_signer.unpack(P.unpack_frames(b"".join(parts[start:])))
                break
            except (P.ProtocolError, ValueError, TypeError, KeyError) as e:
                error = e
        else:
            log.warning("dropped a record of rank %d: %s", info.rank, error)
            return None
        if type(msg) not in self.record_handlers:
            log.warning("rank %d sent an unexpected %s record", info.rank, msg.TYPE)
            return None
        if isinstance(msg, P.Result) and flags & P.RECORD_SYNC:
            cell = self.cells.get(msg.cell_id)
            if cell is not None and info.rank in cell.synced:
                for _, text in info.splitters["stderr"].end_line():  # the cell that wrote it ended
                    self.route_line(info, "stderr", str(text))
                cell.synced[info.rank].update(("stdout", "stderr"))
        return msg, payload, bufs

    def route_line(self, info: RankInfo, stream: str, text: str) -> None:
        """Under the lock: one line of ``info``'s output to its cell."""
        self.route_lines(info, stream, [text])

    def route_lines(self, info: RankInfo, stream: str, texts: list[str]) -> None:
        """Under the lock: lines of ``info``'s output, in order, to the cell they belong to (one cell: no sync
        marker between them); one "output" event for all of them."""
        if not texts:
            return
        kept: list[str] = []  # the last LAST_LINES kept lines are all that can stay in info.last_lines
        for text in reversed(texts):
            if kept_for_death_report(text):
                kept.append(text)
                if len(kept) == LAST_LINES:
                    break
        target = self.cells.target(info.rank, stream, info.cells)
        info.last_lines.extend(reversed(kept))
        info.last_line_cells.extend([-1 if target is None else target.cell_id] * len(kept))
        if target is None and self.state.held_output is not None:  # a start of many ranks: folded later
            self.state.held_output.extend((info.rank, stream, text) for text in texts)
        elif target is None:
            write_lines([(info.rank, stream, text) for text in texts])
        else:
            target.emit_lines(info.rank, stream, texts)
        self.state.events.emit("output", rank=info.rank, stream=stream, lines=texts, text="\n".join(texts),
                               cell_id=None if target is None else target.cell_id)

    def flush_rank(self, info: RankInfo) -> None:
        """Under the lock: ``info`` exited; route the last lines it wrote without a newline."""
        for stream, splitter in info.splitters.items():
            for kind, value in splitter.flush():
                if kind == "line":
                    self.route_line(info, stream, str(value))
