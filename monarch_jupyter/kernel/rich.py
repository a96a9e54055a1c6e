"""Rich output of ranks in the notebook: ``Display`` messages -> display_data, update_display_data, clear_output.

A rank's ``display()`` (monarch_worker.display) sends a MIME bundle whose binary parts are raw bytes, in the
message's buffers or, when large, in a shared memory segment of the rank. ``RichRouter.on_display`` (the output
reader thread for records, the I/O thread for the socket) rebuilds the bundle as Jupyter wants it (base64 for
binary types), labels it with the rank and hands it to the cell that caused it, in order with that cell's text
lines: it is published by whoever writes the cell's lines, inside the context captured when the cell was submitted,
so it lands in that cell even when it arrives after the cell returned.

Labels (stable under nbval, which compares text and skips metadata and images): ``metadata["monarch_jupyter"]``
holds ``{"rank": r}``; ``text/plain`` is prefixed ``[rankN]: `` like the rank's text lines; display ids are made
per rank, so ``update_display`` on one rank changes that rank's display only. Without an IPython shell (a script
using the Python API) the ``text/plain`` is printed, labelled, like a line.

Each display also becomes a mesh event ``display`` (rank, cell_id, display_kind, display_id, data, metadata) for
the views.
"""

from __future__ import annotations

import base64
import json
import logging
from typing import Any

from monarch_worker import protocol as P
from monarch_worker import shm

from .cells import CellTable
from .dispatch import Dispatcher
from .output import OutputWriter, label, write_lines
from .state import MeshState

log = logging.getLogger(__name__)

__all__ = ["RichOutput", "RichRouter", "METADATA_KEY"]

METADATA_KEY = "monarch_jupyter"


class RichOutput:
    """One rich output of a rank, ready to publish (``publish`` runs in the cell's context)."""

    __slots__ = ("rank", "kind", "data", "metadata", "display_id", "wait")

    def __init__(self, rank: int, kind: str, data: dict, metadata: dict, display_id: str = "",
                 wait: bool = False) -> None:
        self.rank, self.kind, self.data, self.metadata = rank, kind, data, metadata
        self.display_id, self.wait = display_id, wait

    def publish(self) -> None:
        """Send it to the notebook (display_data, update_display_data or clear_output), or print its text."""
        from IPython.core.interactiveshell import InteractiveShell

        if not InteractiveShell.initialized():
            if self.kind != "clear":
                write_lines([(self.rank, "stdout", line) for line in _unlabelled(self.data).splitlines() or [""]])
            return
        if self.kind == "clear":
            from IPython.display import clear_output

            clear_output(wait=self.wait)
            return
        from IPython.display import publish_display_data

        transient = {"display_id": self.display_id} if self.display_id else None
        publish_display_data(self.data, self.metadata, transient=transient, update=self.kind == "update")

    def __repr__(self) -> str:
        return f"<RichOutput {self.kind} of rank {self.rank}: {', '.join(self.data)}>"


def _unlabelled(data: dict) -> str:
    text = str(data.get("text/plain", ""))
    return "\n".join(line.split(" ", 1)[1] if line.startswith("[rank") and " " in line else line
                     for line in text.splitlines())


def labelled_text(rank: int, text: str) -> str:
    """``text`` with each line prefixed ``[rankN]: `` (as the rank's output lines are)."""
    return "\n".join(f"{label(rank)} {line}" for line in (text.splitlines() or [""]))


class RichRouter:
    """Turns ranks' ``Display`` messages into rich outputs of their cells (see the module docstring)."""

    def __init__(self, state: MeshState, cells: CellTable, dispatcher: Dispatcher, writer: OutputWriter) -> None:
        self.state = state
        self.cells = cells
        self.dispatcher = dispatcher
        self.writer = writer

    def on_display(self, rank: int, msg: P.Display, payload: bytes, bufs: list) -> None:
        """A rank's display (output reader or I/O thread): decode it here, then queue it in its cell."""
        item = self.decode(rank, msg, bufs)
        if item is None:
            return
        state = self.state
        with state.lock:
            rec = self.cells.lookup(msg.cell_id) or state.last_cell
            if rec is None:
                self.writer.put([(rank, "display", item)], None)
            else:
                self.cells.emit(rec, rank, "display", item)
        state.events.emit("display", rank=rank, cell_id=msg.cell_id, display_kind=item.kind, display_id=item.display_id,
                          data=item.data, metadata=item.metadata)

    def decode(self, rank: int, msg: P.Display, bufs: list) -> RichOutput | None:
        """The bundle as Jupyter wants it (binary types base64), labelled; None when its bytes are gone."""
        buffers: list[Any] = list(bufs)
        if msg.shm:
            try:
                buffers = shm.open_segment(msg.shm, lambda seg_id: self._release(rank, seg_id))
            except shm.ShmUnavailableError as e:
                self._release(rank, msg.shm["id"])
                log.warning("a display of rank %d is lost: %s", rank, e)
                item = RichOutput(rank, "display", {"text/plain": labelled_text(
                    rank, f"(a display of {msg.shm.get('length', 0):,} bytes could not be read: {e})")}, {})
                return item
        data: dict[str, Any] = {}
        for mime, text in msg.data.items():
            if mime in msg.json:
                try:
                    data[mime] = json.loads(text)
                except ValueError:
                    data[mime] = text
            else:
                data[mime] = text
        for mime, buf in zip(msg.binary, buffers, strict=False):
            data[mime] = base64.b64encode(buf).decode("ascii")
        del buffers  # the shared memory goes back to the rank
        if msg.kind != "clear":
            data["text/plain"] = labelled_text(rank, str(data.get("text/plain", "")))
        try:
            metadata = json.loads(msg.metadata or "{}")
        except ValueError:
            metadata = {}
        if not isinstance(metadata, dict):
            metadata = {}
        metadata[METADATA_KEY] = {"rank": rank}
        display_id = f"mj-rank{rank}-{msg.display_id}" if msg.display_id else ""
        return RichOutput(rank, msg.kind, data, metadata, display_id, msg.wait)

    def _release(self, rank: int, seg_id: int) -> None:
        """Tell ``rank`` we no longer map its segment (any thread; from a finalizer)."""
        try:
            # No lock: a finalizer may run on a thread that holds the mesh lock (reading a dict and a flag is safe).
            alive = rank in self.state.ranks and self.state.running
            if alive:
                self.dispatcher.post(rank, P.ShmRelease(ids=[seg_id]))
        except Exception:  # noqa: BLE001 - at shutdown the mesh may be gone; the rank's pool goes with it
            pass
