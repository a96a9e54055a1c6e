"""Rank output to the cells that caused it: bytes -> lines, sync markers and records -> cells.

A local rank's stdout and stderr pipes are read by the launcher's reader thread (launch/local.py), which calls
``on_output`` with the bytes; a rank that relays its own output (one that joined from elsewhere) sends them as
``Stream`` messages, handled on the I/O thread (``on_stream``). Either way each (rank, stream) has one
``StreamSplitter`` fed by one thread.

- A line goes to the oldest cell of its rank whose output on that stream is not complete (else to the last cell
  submitted), labelled ``[rankN]:``, and is kept for the rank's death report.
- A sync marker completes a cell's output on its stream.
- A record (protocol.RECORD_PREFIX) is a message the rank's main thread wrote into its stdout pipe behind its
  output (a cell's ``Result``, progress, debugger prompts): put together and verified by the reading thread once
  all its parts are in, then handled by the handler of its route (``Message.ROUTE``), all outside the lock
  (handlers unpickle values). A ``Result`` record also completes the cell's output on both streams: the launcher
  passes on a rank's stderr ahead of each stdout read, and the rank wrote its stderr before the record.
- Lines of no cell are queued to the mesh's OutputWriter; nothing is written here.
"""

from __future__ import annotations

import logging
import os
import re
from typing import Any

import monarch_worker
from monarch_worker import protocol as P

from .cells import CellTable
from .output import OutputWriter
from .state import LAST_LINES, Handler, MeshState, RankInfo

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

    def __init__(self, state: MeshState, cells: CellTable, writer: OutputWriter, routes: dict[str, Handler]) -> None:
        """``routes``: the handler of each route a rank's record may name (``Message.ROUTE``; its progress reports
        are this router's own)."""
        self.state = state
        self.cells = cells
        self.writer = writer
        self._routes = {**routes, "progress": self.on_progress}
        self._record_signer = P.Signer(bytes(32))  # the generation's replaces it; verifies records (reader thread)

    def new_generation(self, secret: bytes) -> None:
        self._record_signer = P.Signer(secret)

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        """Bytes a rank wrote on ``stream`` (the one thread that reads that rank's output: its splitters and its
        record parts are that thread's own, so records are put together and verified outside the lock)."""
        state = self.state
        info = state.ranks.get(rank)
        if info is None:
            return
        events = info.splitters[stream].feed_runs(data)
        i, n = 0, len(events)
        while i < n:
            with state.lock:
                # A run of lines between two sync markers goes to one cell: it is routed as one batch (the rank's
                # stderr lines embedded in its stdout, "errlines", as runs of their own, in place).
                while i < n and events[i][0] != "msg":
                    kind, value = events[i]
                    i += 1
                    if kind == "lines":
                        self.route_lines(info, stream, value)  # type: ignore[arg-type]
                    elif kind == "errlines":
                        self.route_lines(info, "stderr", value, via=stream)  # type: ignore[arg-type]
                    else:
                        self.cells.on_sync(rank, stream, int(value))  # type: ignore[call-overload]
            if i == n:
                return
            part: Any = events[i][1]  # (flags, body) of a record
            flags, body = int(part[0]), bytes(part[1])
            i += 1
            record = self._take_record(info, flags, body)
            if record is None:
                continue
            msg, payload, bufs = record
            if isinstance(msg, P.Result) and flags & P.RECORD_SYNC:
                self._ended(info, msg.cell_id)
            try:  # its handler unpickles values: outside the lock, as for socket messages
                self._routes[msg.ROUTE](rank, msg, payload, bufs)
            except Exception:  # noqa: BLE001 - keep the reader thread alive whatever a rank sent
                log.exception("handling %s from rank %d failed", msg.TYPE, rank)

    def on_stream(self, rank: int, msg: P.Stream, payload: bytes, bufs: list) -> None:
        """Output that a rank relays itself (I/O thread)."""
        self.on_output(rank, msg.name, msg.data.encode())

    def on_progress(self, rank: int, msg: P.Progress, payload: bytes, bufs: list) -> None:
        """A rank's progress report (from the socket, or a record in its output: any thread). The two ways can
        cross: a report older (by ``seq``) than the newest one of this rank process is dropped."""
        with self.state.lock:
            info = self.state.ranks[rank]
            if msg.seq and msg.seq <= info.progress_seq:
                return
            info.progress, info.progress_seq = (msg.n, msg.total, msg.desc), msg.seq
            self.state.events.emit("progress", rank=rank, n=msg.n, total=msg.total, desc=msg.desc,  # in seq order
                                   cell_id=msg.cell_id, postfix=msg.postfix, metrics=dict(msg.metrics))

    def _take_record(self, info: RankInfo, flags: int, body: bytes) -> tuple[Any, bytes, list] | None:
        """The verified message of a record once all of its parts are in, else None (the reading thread; no
        lock: verifying a signature is work the mesh lock never waits for)."""
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
        if not type(msg).RECORD or msg.ROUTE not in self._routes:
            log.warning("rank %d sent an unexpected %s record", info.rank, msg.TYPE)
            return None
        return msg, payload, bufs

    def _ended(self, info: RankInfo, cell_id: int) -> None:
        """``info``'s Result record for ``cell_id`` came: the rank wrote its stderr before it, so every line of the
        cell is in; a last stderr line without a newline belongs to that cell."""
        with self.state.lock:
            rec = self.cells.get(cell_id)
            if rec is None or info.rank not in rec.members:
                return
            for _, text in info.splitters["stderr"].end_line():  # the cell that wrote it ended
                self.route_line(info, "stderr", str(text))
            self.cells.end_output(rec, info.rank)

    def route_line(self, info: RankInfo, stream: str, text: str) -> None:
        """One line of ``info``'s output to its cell."""
        self.state.assert_locked()
        self.route_lines(info, stream, [text])

    def route_lines(self, info: RankInfo, stream: str, texts: list[str], via: str | None = None) -> None:
        """Under the lock: lines of ``info``'s output, in order, to the cell they belong to (one cell: no sync
        marker between them); one "output" event for all of them."""
        self.state.assert_locked()
        if not texts:
            return
        kept: list[str] = []  # the last LAST_LINES kept lines are all that can stay in info.last_lines
        for text in reversed(texts):
            if kept_for_death_report(text):
                kept.append(text)
                if len(kept) == LAST_LINES:
                    break
        target = self.cells.target(info.rank, via or stream, info.cells)
        info.last_lines.extend(reversed(kept))
        info.last_line_cells.extend([-1 if target is None else target.cell_id] * len(kept))
        if target is None and self.state.held_output is not None:  # a start of many ranks: folded later
            self.state.held_output.append((info.rank, stream, texts))
        elif target is None:
            self.writer.put([(info.rank, stream, texts)], None)
        else:
            self.cells.emit_lines(target, info.rank, stream, texts)
        self.state.events.emit("output", rank=info.rank, stream=stream, lines=texts, text="\n".join(texts),
                               cell_id=None if target is None else target.cell_id)

    def flush_rank(self, rank: int) -> None:
        """``rank`` exited (the thread that read its output): route the last lines it wrote without a newline."""
        info = self.state.ranks.get(rank)
        if info is None:
            return
        lines = [("stderr" if kind == "errline" else stream, str(value)) for stream, splitter in info.splitters.items()
                 for kind, value in splitter.flush() if kind in ("line", "errline")]
        if lines:
            with self.state.lock:
                for stream, text in lines:
                    self.route_line(info, stream, text)
