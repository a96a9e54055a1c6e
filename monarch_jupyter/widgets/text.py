"""Per-rank views as compact text: for terminals and scripts, and the stable ``text/plain`` of the widget.

- ``stable_text`` is what a saved notebook keeps as the dashboard's ``text/plain``: states per rank, no times,
  pids, hosts or memory, so nbval compares it run after run.
- ``TextLiveView`` prints while a cell runs (outside widget frontends): a failure the moment it happens, a
  progress line when progress or states change, a line when the ranks have been silent for a while, and a closing
  line when it printed anything before. A cell that finishes quickly and cleanly prints nothing.
- ``StatusText`` is ``%mesh status`` as a table.
"""

from __future__ import annotations

import sys
import time
from typing import Any

from ..ranks import format_ranks, ranks_text
from .model import FAILED_STATES, MeshMonitor, RowView, Summary, monitor_for, stragglers
from .view import LiveView

__all__ = ["StatusText", "TextLiveView", "stable_text", "header_text", "fmt_seconds", "fmt_bytes",
           "fmt_progress"]


def fmt_seconds(seconds: float | None) -> str:
    """'0.4 s', '12.0 s', '3 m 05 s', '2 h 01 m'; '' for None."""
    if seconds is None:
        return ""
    if seconds < 60:
        return f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} m {int(seconds % 60):02d} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60):02d} m"


def fmt_bytes(n: int) -> str:
    """'512 MiB', '1.5 GiB'; '' for 0 (unknown)."""
    if not n:
        return ""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    return f"{n / 2**20:.0f} MiB"


def fmt_memory(row: RowView) -> str:
    """RSS, and on GPU ranks CUDA allocated/reserved: '812 MiB · cuda 1.2 GiB/2.0 GiB'."""
    text = fmt_bytes(row.rss)
    if row.cuda_reserved or row.cuda_allocated:
        text += f" · cuda {fmt_bytes(row.cuda_allocated) or '0'}/{fmt_bytes(row.cuda_reserved) or '0'}"
    return text


def _num(x: float) -> str:
    return f"{x:g}" if x != int(x) else str(int(x))


def fmt_progress(row: RowView) -> str:
    """'3/10 train · loss=0.25', or '' when the rank reported no progress."""
    if row.n is None:
        return ""
    count = _num(row.n) + (f"/{_num(row.total)}" if row.total else "")
    return " · ".join(p for p in (count, row.desc, row.postfix) if p)


def _state_text(row: RowView) -> str:
    return f"{row.state} ({row.error})" if row.error and row.state in FAILED_STATES | {"stopped"} else row.state


def _tag(summary: Summary) -> str:
    """'[mesh 12.0 s]': the time the cell has run; '[mesh]' while every rank still waits to start it."""
    took = fmt_seconds(summary.elapsed)
    return f"[mesh {took}]" if took else "[mesh]"


def header_text(summary: Summary, *, times: bool = True) -> str:
    """'ranks 0-3: running on ranks 0,1 · done on rank 2 · error on rank 3 · slowest rank 1 · 2.5 s'."""
    states = " · ".join(f"{s} on {ranks_text(rs)}" for s, rs in summary.by_state.items())
    parts = [f"ranks {format_ranks(summary.ranks)}: {states}" if summary.ranks else "no ranks"]
    if summary.slowest is not None and times:
        parts.append(f"slowest rank {summary.slowest}")
    if times and summary.elapsed is not None:
        parts.append(fmt_seconds(summary.elapsed))
    return " · ".join(parts)


def stable_text(rows: list[RowView], summary: Summary, *, title: str = "mesh") -> str:
    """Text that stays the same run after run: state per rank (and a failure's type and message)."""
    lines = [f"{title}: {header_text(summary, times=False)}"]
    groups: dict[str, list[int]] = {}  # ranks with the same line are listed together ("ranks 0-30: done (cpu)")
    for row in rows:
        groups.setdefault(_state_text(row) + (f" ({row.device})" if row.device else ""), []).append(row.rank)
    for text, ranks in sorted(groups.items(), key=lambda item: item[1][0]):
        lines.append(f"  {ranks_text(ranks)}: {text}")
    return "\n".join(lines)


def table_text(rows: list[RowView]) -> list[str]:
    """One line per rank with everything (for terminals): state, device, host, and of the rank's last cell its time,
    progress and last output (so headed: an idle rank's are those of the cell before), memory; a failure (of that
    cell) on a line of its own below."""
    head = (f"{'rank':>4}  {'state':<10} {'device':<7} {'host':<14} {'last cell':>9}  {'progress':<30} "
            f"{'memory':<10} last output (last cell)")
    out = [head]
    for row in rows:
        out.append(f"{row.rank:>4}  {row.state:<10} {row.device[:7]:<7} {row.host[:14]:<14} "
                   f"{fmt_seconds(row.elapsed):>9}  {_cut(fmt_progress(row), 30):<30} {_cut(fmt_memory(row), 10):<10} "
                   f"{_cut(row.last_line, 60)}")
        if row.error:
            out.append(f"{'':>6}└ {row.error}")
    return out


def _cut(text: str, width: int) -> str:
    return text if len(text) <= width else text[: width - 1] + "…"


class StatusText:
    """``%mesh status`` as text: a header and one line per rank. Its repr is the full table (with times and
    memory); ``stable_text()`` is the part that does not change between runs."""

    def __init__(self, mesh: Any, monitor: MeshMonitor | None = None, note: str = "") -> None:
        self.mesh = mesh
        self.monitor = monitor or monitor_for(mesh)
        self.rows, self.summary = self.monitor.snapshot()
        self.note = note  # a line under the header ("auto mode: on")

    def text(self) -> str:
        group = f"\nprocess group: {self.summary.group}" if self.summary.group else ""
        return "\n".join([f"mesh: world size {self.summary.world_size}; {header_text(self.summary)}{group}",
                          *([self.note] if self.note else []), *table_text(self.rows)])

    def stable_text(self) -> str:
        return stable_text(self.rows, self.summary) + (f"\n{self.note}" if self.note else "")

    def __repr__(self) -> str:
        return self.text()

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(self.text())


class TextLiveView(LiveView):
    """Prints the live state of a cell as compact lines on ``stream`` (default: sys.stderr at print time).

    It speaks only when it has something to say, so that the ranks' own lines stay readable: a failure the moment it
    happens; a progress line when progress or the ranks' states changed (at most every ``interval`` seconds); when
    no rank has printed anything for ``silence`` seconds, one line saying so (the next after twice as long, up to a
    minute); and a closing line when it printed anything before.

    Parameters
    ----------
    interval:
        Seconds between two progress lines.
    quiet:
        Seconds a cell runs before the first progress line (fast cells print nothing).
    silence:
        Seconds without output from any rank before a "no output" line.
    """

    render_in_context = True  # its lines belong to the cell that made it
    SILENCE_MAX = 60.0  # seconds: the longest gap between two "no output" lines

    def __init__(self, monitor: MeshMonitor, ranks: list[int] | None = None, *, follow_cell: bool = True,
                 interval: float = 2.0, quiet: float = 1.0, silence: float = 5.0, stream: Any = None) -> None:
        super().__init__(monitor, ranks, follow_cell=follow_cell)
        self.interval = interval
        self.quiet = quiet
        self.silence = silence
        self.stream = stream
        self._created = time.monotonic()
        self._printed_at: float | None = None
        self._reported: dict[int, str] = {}  # rank -> failure already printed
        self._said = ""  # the last progress line, without its clock
        self._heard = self._created  # when a rank last printed, or the view last spoke
        self._gap = silence  # seconds of silence before the next "no output" line

    def _final_render(self) -> None:
        if self._waited():
            return  # the waiting thread's finish() prints the last line, after the cell's own output
        super()._final_render()

    def tick(self) -> bool:
        if self._waited() and self.finished():
            return True
        return super().tick()

    def _waited(self) -> bool:
        return self.handle is not None and self.handle.waited

    def _render(self, final: bool) -> None:
        # Most cells are fast and go well, and then this view prints nothing: skip the snapshot for them (before
        # the cell is submitted, and at the end of one that printed nothing and failed nowhere).
        quiet_end = final and self._printed_at is None and not self._reported and (
            self.handle is not None and not self.handle.snapshot().errors)
        if quiet_end or (not final and self.follow_cell and self.handle is None):
            self._seen = self.monitor.version
            self._last_render = time.monotonic()
            self.final = self.final or final
            return
        super()._render(final)

    def _write(self, line: str) -> None:
        stream = self.stream or sys.stderr
        if stream is sys.stderr:
            # The ranks' lines written to stdout before this one go out first: a kernel sends each stream on its
            # own (ipykernel's OutStream holds stdout up to 0.2 s), and this line was flushed at once, so an
            # interrupted cell's summary came above the last lines of its ranks (helper-59: 2 of 3 interrupts).
            try:
                sys.stdout.flush()
            except (OSError, ValueError):  # closed or broken: what it held is gone either way
                pass
        stream.write(line + "\n")
        stream.flush()

    def render(self, rows: list[RowView], summary: Summary, final: bool) -> None:
        now = time.monotonic()
        for row in rows:
            if row.state in FAILED_STATES | {"breakpoint"} and self._reported.get(row.rank) != row.state:
                self._reported[row.rank] = row.state
                self._write(f"[mesh] rank {row.rank} {row.state}" + (f": {row.error}" if row.error else ""))
                self._printed_at = self._printed_at or now
        if final:
            if self._printed_at is not None:
                self._write(f"[mesh] {header_text(summary)}")
            return
        if now - self._created < self.quiet:
            return
        output_at = max((r.output_at for r in rows if r.output_at is not None), default=None)
        if output_at is not None and output_at > self._heard:
            self._heard, self._gap = output_at, self.silence  # the ranks speak for themselves
        said = self._progress_text(rows, summary)
        if said and said != self._said and (self._printed_at is None or now - self._printed_at >= self.interval):
            self._said = said
            self._speak(f"{_tag(summary)} {said}", now)
        elif now - self._heard >= self._gap:
            quiet_for = "no output yet" if output_at is None else f"no output for {now - output_at:.0f} s"
            self._speak(f"{_tag(summary)} {header_text(summary, times=False)} · {quiet_for}", now)
            self._gap = min(self._gap * 2, self.SILENCE_MAX)

    def _speak(self, line: str, now: float) -> None:
        self._printed_at = self._heard = now
        self._write(line)

    @staticmethod
    def _progress_text(rows: list[RowView], summary: Summary) -> str:
        """States and progress ('ranks 0-3: running on ranks 0-3 · rank 2 14/100 · train (slowest)'), or '' when
        that says nothing new: every rank running, none reporting progress."""
        shown = [r for r in rows if r.n is not None and r.state == "running"]
        if not shown and set(summary.by_state) <= {"running"}:
            return ""
        if len(shown) > 4:
            shown = stragglers(rows, limit=2) or shown[:1]
        bits = [f"rank {r.rank} {fmt_progress(r)}" + (" (slowest)" if r.rank == summary.slowest else "")
                for r in shown]
        return " · ".join([header_text(summary, times=False), *bits])
