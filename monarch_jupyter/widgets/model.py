"""The live per-rank model behind every view: what each rank is doing, built from Mesh events only.

A ``MeshMonitor`` listens to one mesh (``mesh.add_listener``) and keeps, per rank, the mesh-level facts (state,
host, device, memory) and, per cell the rank ran recently, that cell's state, progress, last output line, failure
and the metrics it reported (by global step). The cell's output itself is kept by the cell's view
(``record.CellOutput``), in the order the cell shows it. Views ask it for ``snapshot``s: immutable rows computed
under its lock, so a view renders without holding any lock and a slow view never slows the mesh's threads.

Events arrive on the mesh's threads (I/O thread, launcher reader thread, the submitting thread); some while the
mesh holds its own lock. The handler therefore only updates plain fields under the monitor's lock and never
calls back into the mesh while holding it.

States of a rank in a cell (``CELL_STATES``): queued (submitted behind another cell on that rank), running,
breakpoint (stopped at a breakpoint; reported by the debugger as a ``rank_state`` event), done, error, dead,
stopped (the mesh was stopped). Mesh-level states: starting, idle, running, breakpoint, dead, stopped.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import statistics
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from ..errors import describe_returncode

log = logging.getLogger(__name__)

__all__ = ["MeshMonitor", "monitor_for", "RowView", "Summary", "CELL_STATES", "FAILED_STATES", "FINAL_STATES"]

CELL_STATES = ("queued", "running", "breakpoint", "done", "error", "interrupted", "dead", "stopped")
FINAL_STATES = frozenset({"done", "error", "interrupted", "dead", "stopped"})
FAILED_STATES = frozenset({"error", "dead"})
ATTENTION_STATES = frozenset({"error", "dead", "breakpoint"})  # always shown, even when the table is folded
STATE_ORDER = ("starting", "queued", "running", "breakpoint", "error", "dead", "interrupted", "done", "idle",
               "stopped")
CELLS_KEPT = 32  # cells remembered per rank
BEHIND_BY = 0.02  # a running rank is "the slowest" when this fraction of the total behind the rank ahead
SLOWER_BY = 0.1  # a finished rank is "the slowest" when it took this fraction longer than the fastest
POINTS_KEPT = 400  # points kept per metric and rank; past that every other point is dropped (the curve stays whole)
METRICS_KEPT = 8  # metrics charted per cell (the first reported)
STEP_METRIC = "global_step"  # a reported metric of this name is the charts' x axis (not charted itself)
_DIGITS = re.compile(r"\d+")
_METRIC = re.compile(r"([A-Za-z_][\w./-]*)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])")


@dataclass
class _CellRank:
    """One rank's part in one cell (mutable; guarded by the monitor lock)."""

    cell_id: int
    submitted: float
    started: float | None = None  # None while queued
    ended: float | None = None
    state: str = "running"
    n: float | None = None
    total: float | None = None
    desc: str = ""
    postfix: str = ""
    last_line: str = ""
    output_at: float | None = None  # time.monotonic() of its last line of output in the cell
    error: str = ""
    duration: float | None = None  # seconds the rank itself measured
    metrics: dict = field(default_factory=dict)  # name -> [(x, y)]: numbers from progress postfixes, x the step
    steps: dict = field(default_factory=dict)  # loop -> (steps of its earlier runs, last n, ...): running count
    metric_loop: dict = field(default_factory=dict)  # metric name -> the loop whose steps are its x axis


@dataclass
class _Rank:
    rank: int
    state: str = "starting"
    host: str = ""
    device: str = ""
    pid: int | None = None
    rss: int = 0
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    returncode: int | None = None
    last_line: str = ""
    cells: OrderedDict = field(default_factory=OrderedDict)  # cell id -> _CellRank, oldest first


@dataclass(frozen=True)
class RowView:
    """What a view shows for one rank. Times in seconds, memory in bytes."""

    rank: int
    state: str
    host: str
    device: str
    elapsed: float | None  # time in the cell (running: so far; finished: until it ended)
    n: float | None
    total: float | None
    desc: str
    postfix: str
    last_line: str
    rss: int
    cuda_allocated: int
    cuda_reserved: int
    error: str  # "ZeroDivisionError: division by zero", "signal SIGKILL", ...
    output_at: float | None = None  # time.monotonic() of the rank's last line of output in the cell (None: none)

    @property
    def fraction(self) -> float | None:
        """Progress in [0, 1], or None when the rank reported no total."""
        if self.n is None or not self.total:
            return None
        return max(0.0, min(1.0, self.n / self.total))


@dataclass(frozen=True)
class Summary:
    """The header line of a view: ranks per state, the slowest rank, the cell's elapsed time."""

    ranks: tuple[int, ...]
    world_size: int
    by_state: dict[str, tuple[int, ...]]
    slowest: int | None
    elapsed: float | None
    finished: bool
    group: str = ""  # the process group as MeshState.group_status says (views of the mesh, not of a cell)

    @property
    def failed(self) -> tuple[int, ...]:
        return tuple(sorted(r for s in FAILED_STATES for r in self.by_state.get(s, ())))


class MeshMonitor:
    """Per-rank live state of one mesh, fed by its events. Thread-safe; cheap per event.

    ``version`` increases on every event that changes what a view shows; views re-render when it moved.
    """

    def __init__(self, mesh: Any) -> None:
        self._mesh = weakref.ref(mesh)
        self._lock = threading.Lock()
        self.version = 0
        self.world_size = mesh.nproc
        self._ranks: dict[int, _Rank] = {}
        self.status_views: list[Any] = []  # live `%mesh status` views of this mesh (see widgets.status_view)
        self._reset(mesh.status())
        self._handlers = {
            "started": self._on_started,
            "stopped": self._on_stopped,
            "cell_started": self._on_cell_started,
            "rank_result": self._on_rank_result,
            "rank_state": self._on_rank_state,
            "output": self._on_output,
            "progress": self._on_progress,
            "heartbeat": self._on_heartbeat,
        }
        self.metrics_version = 0  # moves when a cell's metrics get a point
        mesh.add_listener(self.on_event)

    @property
    def mesh(self) -> Any:
        return self._mesh()

    def close(self) -> None:
        mesh = self._mesh()
        if mesh is not None:
            mesh.remove_listener(self.on_event)

    # ------------------------------------------------------------------ events (mesh threads)

    def on_event(self, kind: str, data: dict) -> None:
        if kind == "started":  # reads mesh.status(): outside our lock
            mesh = self._mesh()
            status = mesh.status() if mesh is not None else {}
            with self._lock:
                self._reset(status)
                self.version += 1
            return
        if kind == "resized":  # %mesh scale (kernel/resize.py): the stopped ranks leave, the new ones come
            mesh = self._mesh()
            status = mesh.status() if mesh is not None else {}
            with self._lock:
                self._resize(data["after"], status)
                self.version += 1
            return
        handler = self._handlers.get(kind)
        if handler is None:
            return
        rank = data.get("rank")
        if isinstance(rank, int) and rank >= self.world_size:
            return  # a rank a %mesh scale stopped, whose exit came after the "resized" event (or one it starts)
        with self._lock:
            handler(data, time.monotonic())
            self.version += 1

    def _reset(self, status: dict[int, dict]) -> None:
        self.world_size = len(status) or self.world_size
        self._ranks = {}
        for r, s in status.items():
            self._ranks[r] = _Rank(r, state=s.get("state", "starting"), host=s.get("host", ""),
                                   device=s.get("device", ""), pid=s.get("pid"), rss=s.get("rss", 0),
                                   cuda_allocated=s.get("cuda_allocated", 0),
                                   cuda_reserved=s.get("cuda_reserved", 0), returncode=s.get("returncode"))

    def _resize(self, world_size: int, status: dict[int, dict]) -> None:
        """Ranks 0..world_size-1 from now on: the others are forgotten, the new ones read from ``status``."""
        self.world_size = world_size
        for r in [r for r in self._ranks if r >= world_size]:
            del self._ranks[r]
        for r, s in status.items():
            if r not in self._ranks:
                self._ranks[r] = _Rank(r, state=s.get("state", "starting"), host=s.get("host", ""),
                                       device=s.get("device", ""), pid=s.get("pid"), rss=s.get("rss", 0))

    def _rank(self, r: int) -> _Rank:
        info = self._ranks.get(r)
        if info is None:
            info = self._ranks[r] = _Rank(r)
        return info

    def _on_started(self, data: dict, now: float) -> None:  # handled in on_event
        pass

    def _on_stopped(self, data: dict, now: float) -> None:
        for info in self._ranks.values():
            if info.state != "dead":
                info.state = "stopped"
            for c in info.cells.values():
                if c.state not in FINAL_STATES:
                    c.state, c.ended = "stopped", now
                    c.error = c.error or "the mesh was stopped"

    def _on_cell_started(self, data: dict, now: float) -> None:
        cell_id = data["cell_id"]
        for r in data["ranks"]:
            info = self._rank(r)
            busy = any(c.state not in FINAL_STATES for c in info.cells.values())
            cell = _CellRank(cell_id, submitted=now, started=None if busy else now,
                             state="queued" if busy else "running")
            info.cells[cell_id] = cell
            while len(info.cells) > CELLS_KEPT:
                info.cells.popitem(last=False)
            if info.state != "dead":
                info.state = "running"

    def _on_rank_result(self, data: dict, now: float) -> None:
        info = self._rank(data["rank"])
        cell = info.cells.get(data["cell_id"])
        if cell is not None and cell.state not in FINAL_STATES:
            cell.ended = now
            cell.duration = data.get("duration")
            if data.get("status") == "ok":
                cell.state = "done"
                cell.error = ""  # a debugger's note ("stopped at a breakpoint ...") ends with the cell
            else:  # an interrupt (the notebook's, %mesh interrupt, a timeout) is no error of the rank's code
                cell.state = "interrupted" if data.get("interrupted") else "error"
                ename, evalue = data.get("ename", ""), data.get("evalue", "")
                cell.error = f"{ename}: {evalue}" if ename and evalue else (ename or str(data.get("error") or ""))
        self._promote(info, now)

    def _promote(self, info: _Rank, now: float) -> None:
        """The next queued cell of a rank starts when the one before it ends."""
        for c in info.cells.values():
            if c.state == "queued":
                c.state, c.started = "running", now
                return
            if c.state not in FINAL_STATES:
                return
        if info.state in ("running", "breakpoint"):
            info.state = "idle"

    def _on_rank_state(self, data: dict, now: float) -> None:
        info = self._rank(data["rank"])
        state = data["state"]
        for key in ("host", "device", "pid"):
            if data.get(key):
                setattr(info, key, data[key])
        if state in ("dead", "stopped"):
            info.returncode = data.get("returncode", info.returncode)
            why = describe_returncode(info.returncode) if state == "dead" else "the mesh was stopped"
            for c in info.cells.values():
                if c.state not in FINAL_STATES:
                    c.state, c.ended, c.error = state, now, why
            info.state = state
            info.rss = info.cuda_allocated = info.cuda_reserved = 0  # its last heartbeat's: that memory is free now
        elif state in ("breakpoint", "running"):  # the debugger stopped or resumed the rank's current cell
            for c in info.cells.values():  # none when the resume came after the cell's result: nothing to change
                if c.state in ("running", "breakpoint"):
                    c.state = state
                    c.error = data.get("note", "") if state == "breakpoint" else ""  # which debugger, if said
                    info.state = state
                    break
        else:
            if not (state == "idle" and any(c.state not in FINAL_STATES for c in info.cells.values())):
                info.state = state

    def _on_output(self, data: dict, now: float) -> None:
        info = self._rank(data["rank"])
        lines = data["lines"]
        info.last_line = lines[-1]
        cell = info.cells.get(data.get("cell_id", -1))
        if cell is not None:
            cell.last_line = lines[-1]
            cell.output_at = now

    def _on_progress(self, data: dict, now: float) -> None:
        info = self._rank(data["rank"])
        cell = info.cells.get(data.get("cell_id", -1))
        if cell is None:
            return
        n = data.get("n")
        cell.n, cell.total = n, data.get("total")
        cell.desc, cell.postfix = data.get("desc") or "", data.get("postfix") or ""
        loop = _DIGITS.sub("#", cell.desc)  # "Epoch 3" and "Epoch 4" are one loop; "Validation" another
        step = _running_step(cell.steps, loop, n, cell.total, cell.desc)
        if "=" in cell.postfix:
            found = _METRIC.findall(cell.postfix)
            named = [float(v) for k, v in found if k == STEP_METRIC]
            x = named[0] if named else step if step is not None else now - (cell.started or now)
            for name, value in found:
                if name == STEP_METRIC:
                    continue
                # A metric's x axis is the steps of the loop it was first reported in: Lightning shows the last
                # train loss during validation too, which must not be drawn against validation's steps.
                if cell.metric_loop.setdefault(name, loop) != loop and not named:
                    continue
                series = cell.metrics.get(name)
                if series is None:
                    if len(cell.metrics) >= METRICS_KEPT:
                        continue
                    series = cell.metrics[name] = []
                point = (float(x), float(value))
                if series and series[-1][0] == point[0]:
                    series[-1] = point  # the same step reported again: its latest value
                else:
                    series.append(point)
                if len(series) > POINTS_KEPT:
                    del series[1:-1:2]  # keep the first and last, every other point between
            self.metrics_version += 1

    def _on_heartbeat(self, data: dict, now: float) -> None:
        info = self._rank(data["rank"])
        info.rss = data.get("rss", 0)
        info.cuda_allocated = data.get("cuda_allocated", 0)
        info.cuda_reserved = data.get("cuda_reserved", 0)

    # ------------------------------------------------------------------ snapshots (any thread)

    def ranks(self) -> list[int]:
        with self._lock:
            return sorted(self._ranks)

    def metrics(self, cell_id: int, ranks: Iterable[int]) -> dict[str, dict[int, list[tuple[float, float]]]]:
        """name -> rank -> [(step, value)] of the numbers ranks reported in cell ``cell_id`` (``progress(...,
        loss=...)``, tqdm postfixes). x is the global step: a reported ``global_step`` metric, else a running count
        of the steps of the loop the metric was first reported in, over the whole cell (an epoch's count restarting
        at 0 adds to it); seconds into the cell where no count was given."""
        out: dict[str, dict[int, list[tuple[float, float]]]] = {}
        with self._lock:
            for r in ranks:
                info = self._ranks.get(r)
                cell = info.cells.get(cell_id) if info is not None else None
                if cell is None:
                    continue
                for name, series in cell.metrics.items():
                    out.setdefault(name, {})[r] = list(series)
        return out

    def snapshot(self, ranks: Iterable[int] | None = None, cell_id: int | None = None,
                 now: float | None = None) -> tuple[list[RowView], Summary]:
        """Rows for ``ranks`` (default: all) and the header summary.

        With ``cell_id`` each row shows the rank's part in that cell; without, the rank's mesh-level state and
        its latest cell.
        """
        now = time.monotonic() if now is None else now
        with self._lock:
            chosen = sorted(self._ranks) if ranks is None else list(ranks)
            rows = [self._row(self._rank(r), cell_id, now) for r in chosen]
            world = self.world_size
        summary = summarize(rows, world, cell_id is not None)
        mesh = self._mesh()
        if cell_id is None and mesh is not None:
            summary = dataclasses.replace(summary, group=mesh.state.group_status())
        return rows, summary

    def _row(self, info: _Rank, cell_id: int | None, now: float) -> RowView:
        if cell_id is not None:
            cell = info.cells.get(cell_id)
            state = cell.state if cell is not None else ("dead" if info.state == "dead" else "queued")
        else:
            cell = next(reversed(info.cells.values()), None) if info.cells else None
            state = info.state
        elapsed = None
        if cell is not None and cell.started is not None:
            elapsed = (cell.ended if cell.ended is not None else now) - cell.started
            if cell.duration is not None and cell.state in ("done", "error"):
                elapsed = cell.duration
        error = ""
        if cell is not None and (cell_id is not None or state in ATTENTION_STATES or cell.state in FAILED_STATES):
            error = cell.error
        if not error and state == "dead":
            error = describe_returncode(info.returncode)
        return RowView(
            rank=info.rank, state=state, host=info.host, device=info.device, elapsed=elapsed,
            n=None if cell is None else cell.n, total=None if cell is None else cell.total,
            desc="" if cell is None else cell.desc, postfix="" if cell is None else cell.postfix,
            last_line=info.last_line if cell_id is None else (cell.last_line if cell is not None else ""),
            rss=info.rss, cuda_allocated=info.cuda_allocated, cuda_reserved=info.cuda_reserved, error=error,
            output_at=None if cell is None else cell.output_at,
        )


def summarize(rows: list[RowView], world_size: int, per_cell: bool) -> Summary:
    by_state: dict[str, list[int]] = {}
    for row in rows:
        by_state.setdefault(row.state, []).append(row.rank)
    ordered = {s: tuple(by_state[s]) for s in STATE_ORDER if s in by_state}
    ordered.update({s: tuple(rs) for s, rs in by_state.items() if s not in ordered})
    finished = per_cell and all(row.state in FINAL_STATES for row in rows)
    elapsed = max((row.elapsed for row in rows if row.elapsed is not None), default=None) if per_cell else None
    return Summary(tuple(row.rank for row in rows), world_size, ordered, slowest_rank(rows), elapsed, finished)


def slowest_rank(rows: list[RowView]) -> int | None:
    """The rank holding the others up, or None.

    While ranks run: the one with the least progress, when it is ``BEHIND_BY`` behind the rank ahead or other
    ranks already finished (none while all keep pace or report no progress). When all finished: the one that
    took longest, when it took ``SLOWER_BY`` longer than the fastest.
    """
    running = [r for r in rows if r.state in ("running", "breakpoint", "queued")]
    if running:
        fractions = {r.rank: r.fraction for r in running if r.fraction is not None}
        if fractions:
            slow_rank = min(fractions, key=lambda k: (fractions[k], k))
            ahead = max(r.fraction for r in rows if r.fraction is not None)
            if len(running) < len(rows) or ahead - fractions[slow_rank] >= BEHIND_BY:
                return slow_rank
            return None
        if len(running) < len(rows):
            return running[0].rank
        return None
    took = {r.rank: r.elapsed for r in rows if r.elapsed is not None and r.state == "done"}
    if len(took) > 1:
        slowest = max(took, key=lambda k: (took[k], -k))
        fast = min(took.values())
        if took[slowest] - fast >= max(SLOWER_BY * fast, 0.05):
            return slowest
    return None


def stragglers(rows: list[RowView], limit: int = 5) -> list[RowView]:
    """Running ranks behind the others: below the median progress by more than 2 % of the total, or still
    running while some ranks already finished. Slowest first, at most ``limit``."""
    running = [r for r in rows if r.state in ("running", "queued")]
    if not running:
        return []
    fractions = [r.fraction for r in rows if r.fraction is not None and r.state not in FAILED_STATES]
    done = any(r.state == "done" for r in rows)
    if fractions:
        median = statistics.median(fractions)
        behind = [r for r in running if (r.fraction if r.fraction is not None else 0.0) < median - 0.02]
    else:
        behind = []
    if done:
        behind = running
    behind.sort(key=lambda r: (r.fraction if r.fraction is not None else -1.0, r.rank))
    return behind[:limit]


_monitors: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
_monitors_lock = threading.Lock()


def monitor_for(mesh: Any) -> MeshMonitor:
    """The monitor of ``mesh`` (created and attached on first use; one per mesh)."""
    with _monitors_lock:
        monitor = _monitors.get(mesh)
        if monitor is None:
            monitor = _monitors[mesh] = MeshMonitor(mesh)
        return monitor


def _running_step(steps: dict, loop: str, n: float | None, total: float | None, desc: str) -> float | None:
    """The running step count of ``loop`` at count ``n``: a count that goes back, or a new description after the
    last run had reached its total (the next epoch, whose first reports the rank's throttle may have dropped),
    starts on top of the steps the loop counted before. ``steps`` holds loop -> (steps before this run, last n, its
    total, its description)."""
    if n is None:
        return None
    base, last, last_total, last_desc = steps.get(loop, (0.0, None, None, desc))
    if last is not None and (n < last or (desc != last_desc and last_total and last >= last_total)):
        base += last
    steps[loop] = (base, n, total, desc)
    return base + n
