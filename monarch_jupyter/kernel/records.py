"""``CellRecord``: what the controller knows of one cell (or call, or transfer) in flight.

A record is internal to the controller. Its one writer is the cell table (cells.CellTable): every change of state
(a result arrived, the end of a rank's output, a rank finished or failed, the cell was interrupted, abandoned or its
ranks released) is a method there, called with the mesh lock held. Other parts read a record's fields under the
mesh lock and never assign them (tests/unit/test_structure.py checks). The user holds a ``CellHandle``, a view of
the record (cells.py).

The record knows nothing of the mesh: its module imports no other part but spans.py, so that ``MeshState`` (which
lists the records in flight) and the cell table can both name it.

Ranks that act alike are kept as ranges (spans.RankSpans: ``members``, ``results_in``, ``finished``) and a host's
durations as the list its agent sent (``duration_batches``): a cell's dispatch, a host's ``done`` batch and the
cell's end cost the same whatever the number of ranks behind a host. Per-rank entries exist only for ranks that
differ: a value, an error, output markers or held lines (``synced``, ``held``), a result not finished yet.
"""

from __future__ import annotations

import contextvars
import time
from collections.abc import Sequence
from typing import Any

from monarch_worker.hostmessages import unpack_durations

from .spans import RankSpans

__all__ = ["CellRecord", "Who", "Line"]

Who = int | tuple[int, ...]  # a line's rank, or the ranks of a folded line
Line = tuple[Who, str, Any]
"""(rank, stream, text): ``text`` is one line (str), or a run of that rank's consecutive lines on that stream
(list[str], as they came in one read: a flood costs one item per read, not one per line); stream "display" carries a
rich output instead of text (output.py)."""


class CellRecord:
    """One cell in flight (see the module docstring). Fields are read under the mesh lock; only the cell table
    writes them."""

    __slots__ = ("cell_id", "ranks", "what", "order", "ctx", "submitted", "tracks_failures", "background", "fold",
                 "members", "values", "has_value", "errors", "results_in", "synced", "finished", "durations",
                 "duration_batches", "result_seen_at", "unmarked", "torn_down",
                 "death_at", "collective_released", "released", "collective_hint", "interrupted", "abandoned",
                 "queued_on", "keep_outcome", "final", "lines", "lines_since", "lines_due", "held", "waiting", "wake",
                 "handle", "rejoin", "left")

    def __init__(self, cell_id: int, ranks: Sequence[int], what: str, order: str, fold: bool, tracks_failures: bool,
                 background: bool) -> None:
        self.cell_id = cell_id
        self.ranks = ranks  # sorted
        self.members = RankSpans.of_sorted(ranks)
        self.what = what  # how messages name it: "the cell", "call of f", "push of x"
        self.order = order  # "arrival" or "rank": the order its lines are shown in
        self.ctx = contextvars.copy_context()  # the submitter's context: its output lands in the submitter's cell
        self.submitted = time.monotonic()
        self.tracks_failures = tracks_failures  # its failures are the ones post-mortem opens
        self.background = background  # the package's own work (Lightning's warm-up): no note says a cell waits
        self.fold = fold  # identical lines of several ranks show once (output.fold_lines)
        self.values: dict[int, Any] = {}  # rank -> value, for ranks that sent one (others: None)
        self.has_value: dict[int, bool] = {}  # rank -> whether its Result had a value (ranks that sent a Result)
        self.errors: dict[int, Any] = {}  # rank -> MonarchError, in the order they came
        self.results_in = RankSpans()
        # Streams whose end marker came, for ranks that sent one (local ranks: the launcher reads their pipes)
        self.synced: dict[int, set[str]] = {}
        self.finished = RankSpans()
        self.durations: dict[int, float] = {}  # seconds each rank ran it, for ranks that sent their own Result
        # a host's ``done``: (ranks, seconds), as it sent them (a range and float64 bytes for a ``span``)
        self.duration_batches: list[tuple[list[int] | range, list[float] | bytes]] = []
        self.result_seen_at: dict[int, float] = {}  # time.monotonic() when a rank's own Result came
        self.unmarked: dict[int, float] = {}  # ranks whose result came before their output markers -> when
        self.death_at: float | None = None  # when the first of its ranks died
        self.collective_released = ""  # why the process group was torn down to release its ranks (releases.py)
        self.released: dict[int, str] = {}  # rank -> the collective it was released from
        self.collective_hint = ""  # what the cell's error says about that (and the fresh group)
        self.torn_down = ""  # why its ranks' process group was torn down while it ran (another cell's release)
        self.interrupted = False  # its ranks were sent an interrupt
        self.abandoned = False  # interrupted or timed out while some ranks still ran it
        self.queued_on: set[int] = set()  # ranks that had not started it when it was interrupted: they skip it
        self.keep_outcome = False  # a handle the caller holds (block=False): result() may be asked again
        self.final: tuple[Any, BaseException | None] | None = None  # the outcome, once computed (waiting.py)
        self.lines: list[Line] = []  # lines for the thread that waits for it
        self.lines_since = 0.0  # when the oldest of ``lines`` came
        # Lines that come before this time.monotonic() do not wake the waiter: it takes them when this time comes
        # (it writes at most every output.LINE_BATCH seconds while lines keep coming; cells.pop_lines sets it).
        self.lines_due = 0.0
        self.held: dict[int, list[Line]] = {}  # order "rank": lines of ranks not yet released (ranks that wrote)
        self.waiting = False  # a thread waits for it (and writes its lines)
        self.wake: Any = None  # threading.Condition on the mesh lock: lines came, or it is done (set by the table)
        self.handle: Any = None  # the submitter's view of it (cells.CellHandle), told to views with its events
        # What a replacement of a rank that died running it is sent to rejoin it (``%%mesh --rejoin``: the groups of
        # dispatch.Group it was sent as), or None: a death fails it (kernel/healing.py).
        self.rejoin: list[Any] | None = None
        self.left: set[int] = set()  # ranks whose process died running it, and whose replacement has not rejoined

    def duration_map(self) -> dict[int, float]:
        """rank -> seconds it ran the cell, for the ranks whose result came (a copy, built on demand)."""
        out: dict[int, float] = {}
        for ranks, seconds in self.duration_batches:
            out.update(zip(ranks, unpack_durations(seconds) if isinstance(seconds, bytes) else seconds, strict=True))
        out.update(self.durations)
        return out

    def runs_on(self, rank: int) -> bool:
        """``rank`` was sent the cell and has not finished it (nor died running a cell it rejoins)."""
        return rank in self.members and rank not in self.finished and rank not in self.left

    @property
    def all_done(self) -> bool:
        """Every rank finished it (under the lock, or as a snapshot)."""
        return len(self.finished) == len(self.ranks)

    def __repr__(self) -> str:
        return f"<CellRecord {self.cell_id} {self.what} on {len(self.ranks)} ranks: {len(self.finished)} finished>"
