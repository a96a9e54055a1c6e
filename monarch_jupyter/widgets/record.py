"""The one copy of a cell's output that its view shows: what the cell's ranks wrote and displayed, in the order the
notebook would have shown it.

A cell's view captures its output (``kernel.output.OUTPUT_SINK``): the lines and rich outputs that would have become
the cell's stream and display_data messages come here instead, already ordered (``--order rank``) and folded
(identical lines of many ranks) as they would have been written. The view shows them as the merged view and the rank
tabs, and puts their flat text (``[rankN]: line``, torchrun's prefix) into the ``text/plain`` of its display, which
is what frontends without widgets, nbval and a saved notebook's plain view read.

A rank's ``update_display`` replaces that rank's display in place; its ``clear_output`` clears that rank's items
(the other ranks' output and the dashboard stay).

Threads: ``take`` is called by whichever thread writes the cell's output (the waiting thread, the output reader,
the I/O thread), possibly under the mesh lock; it only appends under the record's own lock (a leaf lock). Views
read ``items()`` copies from any thread.
"""

from __future__ import annotations

import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import groupby
from operator import itemgetter
from typing import Any

from monarch_worker.options import NotebookOptions

from ..kernel.output import label

__all__ = ["CellOutput", "Item", "LINES_KEPT", "last_lines"]

LINES_KEPT = NotebookOptions.output_lines  # lines a cell's record keeps by default (the oldest go first)

_SEQ = itertools.count(1)  # item ids, unique in the process (a view keys what it rendered by them)


@dataclass
class Item:
    """One thing shown: a run of lines of one rank (or one folded group of ranks) on one stream, or one display.

    ``kind`` is "stdout", "stderr" or "display"; ``lines`` holds a run's lines (no newlines); ``data`` a display's
    MIME bundle (its ``text/plain`` labelled ``[rankN]: ``). ``changed`` counts the changes of a display (updates).
    """

    seq: int
    ranks: tuple[int, ...]
    kind: str
    lines: list[str] = field(default_factory=list)
    data: dict = field(default_factory=dict)
    display_id: str = ""
    changed: int = 0

    def copy(self) -> Item:
        return Item(self.seq, self.ranks, self.kind, list(self.lines), self.data, self.display_id, self.changed)


_WHO_STREAM = itemgetter(0, 1)  # (rank or ranks, stream) of a batch's item

RUN_LINES = 200  # lines of one run at most: a long run is several items, so a view re-renders only the last one


class CellOutput:
    """A cell's output as its view shows it (see the module docstring)."""

    def __init__(self, lines_kept: int = LINES_KEPT) -> None:
        self._lock = threading.Lock()
        self._items: list[Item] = []
        self._lines = 0  # lines held in _items
        self.lines_kept = lines_kept
        self.dropped = 0  # lines let go (the oldest), past lines_kept
        self.version = 0  # changes so far (views re-render when it moved)
        self.closed = False

    # ------------------------------------------------------------------ the sink (any thread)

    def take(self, batch: Sequence[tuple[Any, str, Any]]) -> bool:
        """Record a batch of (rank or ranks, stream, text or rich output) as ``kernel.output.write_lines`` would
        write it (``text`` a list: a run of lines); False (nothing recorded) once the record is closed, so the output
        is written as usual. The lines of one rank that come together are recorded at once (no Python work per
        line)."""
        with self._lock:
            if self.closed:
                return False
            for (who, stream), group in groupby(batch, _WHO_STREAM):
                if stream == "display":
                    for _, _, what in group:
                        self._display(what)
                else:
                    texts: list[str] = []
                    for _, _, text in group:
                        if type(text) is list:  # a run of lines (kernel.records.Line)
                            texts += text
                        else:
                            texts.append(text)
                    self._run(who if isinstance(who, tuple) else (who,), stream, texts)
            if self._lines > self.lines_kept:
                self._drop(self._lines - self.lines_kept)
            self.version += 1
        return True

    def close(self, seen: int | None = None) -> bool:
        """Take no more output: what comes later is written to the notebook's streams as usual. With ``seen`` (the
        ``version`` its view last rendered), only if nothing came since: False, still open, when something did (the
        view renders it first; checked and closed under one lock, so no batch lands unseen in a closed record)."""
        with self._lock:
            if seen is not None and self.version != seen and not self.closed:
                return False
            self.closed = True
            return True

    def _run(self, ranks: tuple[int, ...], stream: str, texts: list[str]) -> None:
        """Lines of ``ranks`` on ``stream``, in order: the last item takes what it has room for, then new items of
        ``RUN_LINES`` lines each."""
        kind = "stdout" if stream == "stdout" else "stderr"
        last = self._items[-1] if self._items else None
        start = 0
        if last is not None and last.kind == kind and last.ranks == ranks and len(last.lines) < RUN_LINES:
            start = RUN_LINES - len(last.lines)
            last.lines.extend(texts[:start])
        for i in range(start, len(texts), RUN_LINES):
            self._items.append(Item(next(_SEQ), ranks, kind, texts[i:i + RUN_LINES]))
        self._lines += len(texts)

    def _display(self, rich: Any) -> None:
        rank, kind = int(rich.rank), rich.kind
        if kind == "clear":
            kept = [i for i in self._items if i.ranks != (rank,)]
            self._lines -= sum(len(i.lines) for i in self._items if i.ranks == (rank,))
            self._items = kept
            return
        if kind == "update":
            for item in self._items:
                if item.kind == "display" and item.ranks == (rank,) and item.display_id == rich.display_id:
                    item.data, item.changed = rich.data, item.changed + 1
            return
        self._items.append(Item(next(_SEQ), (rank,), "display", data=rich.data, display_id=rich.display_id or ""))

    def _drop(self, n: int) -> None:
        """Let the ``n`` oldest lines go (displays stay)."""
        self.dropped += n
        self._lines -= n
        for item in self._items:
            if n <= 0:
                break
            if item.kind != "display" and item.lines:
                cut = min(n, len(item.lines))
                del item.lines[:cut]
                item.changed += 1
                n -= cut
        self._items = [i for i in self._items if i.kind == "display" or i.lines]

    # ------------------------------------------------------------------ reading (any thread)

    def items(self) -> tuple[int, list[Item]]:
        """(version, copies of the items), oldest first."""
        with self._lock:
            return self.version, [i.copy() for i in self._items]

    def tail(self, lines: int, align: int = 1) -> tuple[int, int, list[Item]]:
        """(first, hidden, copies of the items from index ``first`` on): the items that hold the last ``lines``
        lines, as ``last_lines`` tells, copied without the older ones (a view re-renders the tail of a long output
        at each tick: its cost does not grow with the output)."""
        with self._lock:
            first, hidden = last_lines(self._items, lines, align)
            return first, hidden, [i.copy() for i in self._items[first:]]

    def empty(self) -> bool:
        with self._lock:
            return not self._items

    def ranks(self) -> set[int]:
        """The ranks that have something recorded."""
        with self._lock:
            return {r for i in self._items for r in i.ranks}

    def text(self) -> str:
        """The flat text: each line ``[rankN]: line`` (torchrun's prefix; ``[rank0-3]:`` for a folded line) and each
        display's labelled ``text/plain``, in order; '' when nothing was recorded."""
        with self._lock:
            out = [f"({self.dropped} earlier lines not kept: `%config MeshMagics.output_lines = N` keeps more, "
                   "`%%mesh --no-widget` streams every line)"] if self.dropped else []
            for item in self._items:
                if item.kind == "display":
                    out.append(str(item.data.get("text/plain", "")))
                else:
                    prefix = label(item.ranks if len(item.ranks) > 1 else item.ranks[0]) + " "
                    if item.lines:  # one join per item, not a string per line
                        out.append(prefix + ("\n" + prefix).join(item.lines))
            return "\n".join(out)


def last_lines(items: list[Item], lines: int, align: int = 1) -> tuple[int, int]:
    """(first, hidden): the items from index ``first`` on hold the last ``lines`` lines (displays count as one),
    ``first`` a multiple of ``align``; ``hidden`` lines come before it."""
    total, first = 0, len(items)
    while first > 0 and total < lines:
        first -= 1
        total += len(items[first].lines) or 1
    first -= first % align
    hidden = sum(len(i.lines) for i in items[:first])
    return first, hidden
