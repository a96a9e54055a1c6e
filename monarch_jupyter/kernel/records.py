"""``CellRecord``: what the controller knows of one cell (or call, or transfer) in flight.

A record is internal to the controller. Its one writer is the cell table (cells.CellTable): every change of state
(a result arrived, the end of a rank's output, a rank finished or failed, the cell was interrupted, abandoned or its
ranks released) is a method there, called with the mesh lock held. Other parts read a record's fields under the
mesh lock and never assign them (tests/unit/test_structure.py checks). The user holds a ``CellHandle``, a view of
the record (cells.py).

The record knows nothing of the mesh: its module imports no other part, so that ``MeshState`` (which lists the
records of each rank) and the cell table can both name it.
"""

from __future__ import annotations

import contextvars
import time
from typing import Any

__all__ = ["CellRecord", "Who", "Line"]

Who = int | tuple[int, ...]  # a line's rank, or the ranks of a folded line
Line = tuple[Who, str, Any]  # (rank, stream, text); stream "display" carries a rich output instead of text


class CellRecord:
    """One cell in flight (see the module docstring). Fields are read under the mesh lock; only the cell table
    writes them."""

    __slots__ = ("cell_id", "ranks", "what", "order", "ctx", "submitted", "tracks_failures", "background", "fold",
                 "values", "has_value", "errors", "results_in", "synced", "finished", "durations", "result_seen_at",
                 "death_at", "collective_released", "released", "collective_hint", "interrupted", "abandoned",
                 "queued_on", "keep_outcome", "final", "lines", "lines_since", "held", "waiting", "wake", "handle",
                 "rejoin", "left")

    def __init__(self, cell_id: int, ranks: list[int], what: str, order: str, fold: bool, tracks_failures: bool,
                 background: bool) -> None:
        self.cell_id = cell_id
        self.ranks = ranks
        self.what = what  # how messages name it: "the cell", "call of f", "push of x"
        self.order = order  # "arrival" or "rank": the order its lines are shown in
        self.ctx = contextvars.copy_context()  # the submitter's context: its output lands in the submitter's cell
        self.submitted = time.monotonic()
        self.tracks_failures = tracks_failures  # its failures are the ones post-mortem opens
        self.background = background  # the package's own work (Lightning's warm-up): no note says a cell waits
        self.fold = fold  # identical lines of several ranks show once (output.fold_lines)
        self.values: dict[int, Any] = {}
        self.has_value: dict[int, bool] = {}
        self.errors: dict[int, Any] = {}  # rank -> MonarchError, in the order they came
        self.results_in: set[int] = set()
        self.synced: dict[int, set[str]] = {r: set() for r in ranks}  # streams whose end marker came, per rank
        self.finished: set[int] = set()
        self.durations: dict[int, float] = {}  # seconds each rank ran it
        self.result_seen_at: dict[int, float] = {}  # time.monotonic() when each rank's result came
        self.death_at: float | None = None  # when the first of its ranks died
        self.collective_released = ""  # why the process group was torn down to release its ranks (releases.py)
        self.released: dict[int, str] = {}  # rank -> the collective it was released from
        self.collective_hint = ""  # what the cell's error says about that (and the fresh group)
        self.interrupted = False  # its ranks were sent an interrupt
        self.abandoned = False  # interrupted or timed out while some ranks still ran it
        self.queued_on: set[int] = set()  # ranks that had not started it when it was interrupted: they skip it
        self.keep_outcome = False  # a handle the caller holds (block=False): result() may be asked again
        self.final: tuple[Any, BaseException | None] | None = None  # the outcome, once computed (waiting.py)
        self.lines: list[Line] = []  # lines for the thread that waits for it
        self.lines_since = 0.0  # when the oldest of ``lines`` came
        self.held: dict[int, list[Line]] = {r: [] for r in ranks} if order == "rank" else {}  # not yet released
        self.waiting = False  # a thread waits for it (and writes its lines)
        self.wake: Any = None  # threading.Condition on the mesh lock: lines came, or it is done (set by the table)
        self.handle: Any = None  # the submitter's view of it (cells.CellHandle), told to views with its events
        # What a replacement of a rank that died running it is sent to rejoin it (``%%mesh --rejoin``: the groups of
        # dispatch.Group it was sent as), or None: a death fails it (kernel/healing.py).
        self.rejoin: list[Any] | None = None
        self.left: set[int] = set()  # ranks whose process died running it, and whose replacement has not rejoined

    @property
    def all_done(self) -> bool:
        """Every rank finished it (under the lock, or as a snapshot)."""
        return len(self.finished) == len(self.ranks)

    def __repr__(self) -> str:
        return f"<CellRecord {self.cell_id} {self.what} on {len(self.ranks)} ranks: {len(self.finished)} finished>"
