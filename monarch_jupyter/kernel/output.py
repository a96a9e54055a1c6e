"""Rank output: labelled lines written to the notebook (the splitting of raw bytes into lines, sync markers and
records is monarch_worker.streams.StreamSplitter, shared with host agents).

Output reaches the cell that caused it: each cell captures the caller's ``contextvars`` context when it is
submitted (ipykernel keeps the cell's parent header in a ContextVar), and lines are written inside that context,
from whichever thread delivers them (the pattern of ipykernel's IOPubThread and set_parent).

Who writes: the thread that waits for a cell writes that cell's lines itself; every other line (a cell nobody waits
for, output of no cell) is queued to the mesh's ``OutputWriter`` (any thread, any lock held), whose thread
``monarch-output`` writes it in the order queued, outside the mesh lock. A waiter that starts waiting flushes the
writer first, so the lines of a cell come out in the order its ranks wrote them. What must follow the lines
queued so far (a cell nobody waits for ends: its view closes) goes behind them (``OutputWriter.then``).

A view that shows a cell's output itself (the cell's live dashboard, monarch_jupyter.widgets) sets ``OUTPUT_SINK``
in the context the cell is submitted from: the lines and rich outputs written in that context then go to the view,
in the order they would have been written, instead of to sys.stdout / sys.stderr, so each shows once.
"""

from __future__ import annotations

import contextvars
import heapq
import logging
import signal
import sys
import threading
from collections import Counter, deque
from collections.abc import Callable, Sequence
from itertools import groupby, repeat
from operator import itemgetter
from typing import Any

from monarch_worker.streams import StreamSplitter, temp_file_sink

from ..ranks import format_ranks
from .records import Who

__all__ = ["StreamSplitter", "temp_file_sink", "label", "write_lines", "InterruptGuard", "fold_lines", "one_per_line",
           "OutputWriter", "FOLD_WINDOW", "LINE_BATCH", "MESSAGE_LIMIT", "OUTPUT_SINK", "OutputSink", "PLACE_HOLDER",
           "hold_place"]

log = logging.getLogger(__name__)


FOLD_WINDOW = 0.1
"""Seconds the lines of a folding cell wait for the same line from other ranks before they are shown."""

LINE_BATCH = 0.05
"""Seconds between two writes of a cell's lines by the thread that waits for it, while lines keep coming: the first
line after a quiet spell wakes it at once, the lines of a flood are written in batches (one wake of that thread per
batch, not per read of a rank's pipe; a kernel's output stream sends what it holds every 0.2 s anyway)."""

Batch = tuple[Sequence[tuple[Who, str, Any]], contextvars.Context | None]  # lines, and where to write them
Step = Batch | Callable[[], None]  # what the writer's thread does next: write a batch, or call (OutputWriter.then)

OutputSink = Callable[[Sequence[tuple[Who, str, Any]]], bool]
"""Takes a batch of (rank, stream, text) items as ``write_lines`` would write them (``text``: one line, or a run of
lines as a list, see ``records.Line``; stream "display": a rich output, ``kernel.rich.RichOutput``); returns False to
have them written as usual (e.g. its view has ended). Called from any thread (never under the mesh lock): it must
only record them, never block or call into the mesh."""

OUTPUT_SINK: contextvars.ContextVar[OutputSink | None] = contextvars.ContextVar("monarch_output_sink", default=None)
"""Where the output written in this context goes instead of the notebook's streams (None: the streams)."""

PLACE_HOLDER: contextvars.ContextVar[Callable[[], None] | None] = contextvars.ContextVar("monarch_place_holder",
                                                                                        default=None)
"""Called (``hold_place``) just before the kernel itself writes into the running cell (a pdb prompt, a note): a
cell's view that has not shown itself yet (it shows its first state at its first render) shows now, so that what
the kernel writes lands below it. None: nothing to hold a place for."""


def hold_place() -> None:
    """Let the view of the running cell take its place before the kernel writes into the cell (``PLACE_HOLDER``).
    Call it from the thread that writes, without the mesh lock; it never raises."""
    fn = PLACE_HOLDER.get()
    if fn is not None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - a view's failure must not stop the prompt
            log.debug("the cell's view could not take its place", exc_info=True)


def label(rank: Who) -> str:
    """The prefix of each output line of ``rank``; the same as torchrun's ``--tee`` line prefix. A folded line
    (a tuple of ranks) is labelled with all of them: ``[rank0-63]:``."""
    if isinstance(rank, tuple):
        return f"[rank{format_ranks(rank)}]:"
    return f"[rank{rank}]:"


def one_per_line(lines: Sequence[tuple[Who, str, Any]]) -> list[tuple[Who, str, Any]]:
    """``lines`` with every run of lines (a list as the text, ``records.Line``) made one item per line."""
    out: list[tuple[Who, str, Any]] = []
    for item in lines:
        if type(item[2]) is list:
            out.extend(zip(repeat(item[0]), repeat(item[1]), item[2]))
        else:
            out.append(item)
    return out


def fold_lines(lines: list[tuple[int, str, Any]]) -> list[tuple[Who, str, Any]]:
    """Lines (rank, stream, text) with byte-identical lines of several ranks made one line with all their ranks (a
    tuple). Lines that differ never fold, and each rank's own lines keep their order; within that, lines come in
    the order they arrived, and a line is shown as soon as every rank that will print it in this batch is at it
    (a rank's own different lines, like its loss, go first and the common line then shows once). Rich outputs
    (stream "display") never fold. A run of lines (``records.Line``) counts as its lines.
    """
    if not lines:  # a quiet cell's end: no step (the cell table asks at every cell's end)
        return []
    lines = one_per_line(lines)  # type: ignore[assignment]
    seqs: dict[int, deque[tuple[int, tuple[str, Any]]]] = {}
    items: dict[tuple[str, Any], Any] = {}  # the display items, by their own key
    for i, (rank, stream, text) in enumerate(lines):
        own: tuple[str, Any] = (stream, text) if stream != "display" else ("display", i)
        if stream == "display":
            items[own] = text
        seqs.setdefault(rank, deque()).append((i, own))
    left = Counter(key for seq in seqs.values() for _, key in seq)  # occurrences not shown yet
    heads: dict[tuple[str, Any], set[int]] = {}  # ranks whose next line is this
    first: dict[tuple[str, Any], int] = {}  # the earliest arrival among those next lines
    ready: list[tuple[int, int, tuple[str, Any]]] = []  # (first, arrival, key) of lines all their ranks are at
    waiting: list[tuple[int, int]] = []  # (arrival, rank) of every rank's next line (stale entries skipped)

    def advance(rank: int) -> None:
        if not seqs[rank]:
            return
        i, key = seqs[rank][0]
        heads.setdefault(key, set()).add(rank)
        first[key] = min(first.get(key, i), i)
        heapq.heappush(waiting, (i, rank))
        if len(heads[key]) == left[key]:
            heapq.heappush(ready, (first[key], i, key))

    for rank in seqs:
        advance(rank)
    out: list[tuple[Who, str, str]] = []
    while waiting or ready:
        key: tuple[str, Any] | None = None
        while ready and key is None:
            _, _, cand = heapq.heappop(ready)
            if cand in heads and len(heads[cand]) == left[cand]:
                key = cand
        while key is None and waiting:  # nothing is ready everywhere: the earliest line goes first
            i, rank = heapq.heappop(waiting)
            if seqs[rank] and seqs[rank][0][0] == i:
                key = seqs[rank][0][1]
        if key is None:
            break
        group = sorted(heads.pop(key))
        first.pop(key, None)
        out.append((tuple(group) if len(group) > 1 else group[0], key[0], items.get(key, key[1])))
        for rank in group:
            seqs[rank].popleft()
            left[key] -= 1
            advance(rank)
    return out


def write_lines(lines: Sequence[tuple[Who, str, Any]], ctx: contextvars.Context | None = None) -> None:
    """Write (rank, stream, text) lines to sys.stdout / sys.stderr, labelled, inside ``ctx`` if given (``rank`` a
    tuple: a folded line, see ``fold_lines``; ``text`` a list: a run of lines, see ``records.Line``). Where that
    context has an ``OUTPUT_SINK`` that takes them, they go there instead.

    An item whose stream is "display" carries a rich output (``kernel.rich.RichOutput``) in place of the text: it
    is published there, in order with the lines around it.
    """
    if not lines:
        return
    if ctx is None:
        _write_here(lines)
    else:  # a copy (O(1)): the cell's own context may be entered in another thread (its waiter, writing too), and
        ctx.copy().run(_write_here, lines)  # Context.run refuses that; writing only reads its variables


class InterruptGuard:
    """For the thread that waits for a cell and writes its lines (waiting.Waiter.wait): ``write`` is
    ``write_lines``, except that in the main thread a SIGINT (the notebook's interrupt) that comes while a batch
    is written raises its KeyboardInterrupt once the batch is written. Raised in the middle, it dropped the rest of
    the batch, which the waiter had already taken: thousands of lines of a flood, in 18 of 26 interrupts
    (helper-58). A second SIGINT meanwhile raises at once (a write that blocks, on a stuck terminal, can still be
    cut short); between batches a SIGINT raises at once, as before. The handler goes in at the first batch and
    ``close`` puts the previous one back: one pair of ``sigaction`` calls for a cell that prints, none for one that
    does not. Other threads get no SIGINT: nothing changes there."""

    def __init__(self) -> None:
        self._previous: Any = None  # the SIGINT handler this one stands in front of (None: not installed)
        self._writing = False
        self._held = False

    def write(self, lines: Sequence[tuple[Who, str, Any]], ctx: contextvars.Context | None = None) -> None:
        """``write_lines(lines, ctx)``; KeyboardInterrupt once written when a SIGINT came meanwhile."""
        if not lines:
            return
        if self._previous is None and threading.current_thread() is threading.main_thread():
            previous = signal.getsignal(signal.SIGINT)
            if callable(previous):  # else SIGINT is ignored or left to the OS: nothing to hold
                signal.signal(signal.SIGINT, self._on_sigint)
                self._previous = previous
        self._writing = True
        try:
            write_lines(lines, ctx)
        finally:
            self._writing = False
        if self._held:
            self._held = False
            self._previous(signal.SIGINT, None)

    def close(self) -> None:
        """Put the previous SIGINT handler back (the thread that wrote; again: nothing)."""
        previous, self._previous = self._previous, None
        if previous is not None:
            signal.signal(signal.SIGINT, previous)

    def _on_sigint(self, signum: int, frame: Any) -> None:
        if self._writing and not self._held:
            self._held = True
            return
        self._previous(signum, frame)


def _write_here(lines: Sequence[tuple[Who, str, Any]]) -> None:
    """``write_lines`` in the calling context."""
    sink = OUTPUT_SINK.get()
    if sink is not None and sink(lines):
        return
    if "display" in map(_STREAM, lines):  # (C: no Python work per line)
        start = 0
        for i, (_, stream, item) in enumerate(lines):
            if stream == "display":
                _write_streams(lines[start:i])
                _flush(sys.stdout, sys.stderr)  # the lines before a rich output are shown before it
                item.publish()
                start = i + 1
        _write_streams(lines[start:])
        return
    _write_streams(lines)


def _write_streams(lines: Sequence[tuple[Who, str, Any]]) -> None:
    for stream, text in _by_stream(lines):
        target = sys.stdout if stream == "stdout" else sys.stderr
        other = sys.stderr if stream == "stdout" else sys.stdout
        if _last_written[0] is other:
            _flush(other)  # what the other stream holds came first: it is shown first
        _write_capped(target, text, FLOOD_MESSAGE if _flushes_itself(target) else MESSAGE_LIMIT)
        _last_written[0] = target
        if not _flushes_itself(target):
            _flush(target)


_last_written: list[Any] = [None]  # the stream the last write_lines wrote to (an order, not a resource)

MESSAGE_LIMIT = 1 << 18
"""Characters of rank output (at most 1 MiB of UTF-8) in one stream message to the frontend: a longer batch of
lines is sent as several messages, cut at line ends where it can be (a kernel's output stream sends what it holds
as one message when flushed). One line is at most ``output_line_limit`` bytes and a note."""


FLOOD_MESSAGE = 1 << 16
"""Characters of one stream message to a kernel's frontend when a batch of lines is longer (a flood): it is sent as
several messages of at most this size, each flushed at once, rather than left for the kernel's output stream to send
as one message of up to a second's output. Encoding a message holds the GIL from start to end; a smaller one lets
the kernel's control channel in sooner."""


def _write_capped(target: Any, text: str, limit: int = MESSAGE_LIMIT) -> None:
    """``target.write(text)``, as messages of at most ``limit`` characters."""
    if len(text) <= limit:
        target.write(text)
        return
    _flush(target)  # what it holds goes first, in a message of its own
    start, n = 0, len(text)
    while start < n:
        end = min(start + limit, n)
        if end < n:
            cut = text.rfind("\n", start, end)
            end = cut + 1 if cut > start else end  # a line longer than the limit (no line limit): cut inside it
        target.write(text[start:end])
        _flush(target)
        start = end


def _by_stream(lines: Sequence[tuple[Who, str, Any]]) -> list[tuple[str, str]]:
    """Labelled text per run of consecutive lines of one stream, in order. The lines of one rank that come together
    are labelled with one join (no Python work per line: a flood of lines costs a few operations per batch)."""
    runs: list[tuple[str, list[str]]] = []
    for (rank, stream), group in groupby(lines, _RANK_STREAM):
        stream = "stdout" if stream == "stdout" else "stderr"
        texts: list[str] = []
        for _, _, text in group:
            if type(text) is list:
                texts += text
            else:
                texts.append(str(text))
        prefix = label(rank) + " "
        text = prefix + ("\n" + prefix).join(texts) + "\n"
        if runs and runs[-1][0] == stream:
            runs[-1][1].append(text)
        else:
            runs.append((stream, [text]))
    return [(stream, "".join(parts)) for stream, parts in runs]


_RANK_STREAM = itemgetter(0, 1)  # (rank, stream) of a line
_STREAM = itemgetter(1)  # its stream


def _flushes_itself(stream: Any) -> bool:
    """A kernel's output stream (ipykernel's OutStream) sends what it holds every ``flush_interval`` seconds from
    its own thread; flushing it after every write would wait for that thread each time (a round trip per batch of
    lines, while the mesh lock is held)."""
    return getattr(stream, "flush_interval", None) is not None


def _flush(*streams: Any) -> None:
    for stream in streams:
        try:
            stream.flush()
        except (OSError, ValueError):  # closed or broken: what it held is gone either way
            pass


class OutputWriter:
    """Writes queued lines from one thread, ``monarch-output``, in the order they were queued (see the module
    docstring). The thread starts with the first batch and ends after a second with nothing to write."""

    def __init__(self) -> None:
        self._queue: deque[Step] = deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._queued = 0  # batches queued so far
        self._written = 0  # batches written

    def put(self, lines: Sequence[tuple[Who, str, Any]], ctx: contextvars.Context | None) -> None:
        """Queue ``lines`` to be written inside ``ctx`` (any thread, any lock held: nothing is written here)."""
        if lines:
            self._push((lines, ctx))

    def then(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once every batch queued so far is written: at once, on this thread, when none is left to
        write, else on the writer's thread right after them (any thread, any lock held; ``fn`` must not block or
        raise). A cell nobody waits for announces its end this way, so its view has its last lines before it
        closes (cells.CellTable.finish_rank)."""
        with self._cond:
            if self._written < self._queued:
                self._push(fn)
                return
        fn()

    def _push(self, step: Step) -> None:
        with self._cond:
            self._queue.append(step)
            self._queued += 1
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="monarch-output", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def flush(self, timeout: float = 5.0) -> bool:
        """Wait up to ``timeout`` seconds until every batch queued so far is written; True when it is. Call it
        without the mesh lock (the writer may wait for a kernel's output stream). A no-op on the writer's thread."""
        with self._cond:
            if threading.current_thread() is self._thread:
                return True
            target = self._queued
            return self._cond.wait_for(lambda: self._written >= target, timeout)

    def _run(self) -> None:
        while True:
            with self._cond:
                if not self._queue and not self._cond.wait_for(lambda: bool(self._queue), 1.0):
                    self._thread = None  # a later put starts a new one
                    return
                batch = list(self._queue)
                self._queue.clear()
            for step in batch:
                try:
                    if callable(step):
                        step()
                    else:
                        write_lines(*step)
                except Exception:  # noqa: BLE001 - a broken stream must not stop later output
                    log.exception("writing rank output failed")
            with self._cond:
                self._written += len(batch)
                self._cond.notify_all()
