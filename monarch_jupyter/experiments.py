"""The notebook's experiment table: one row per run (a sweep's trial, a fit), with its settings, the mesh ranks it
used, its final and best metrics, its wall time and its checkpoint.

``monarch_jupyter.sweep`` adds a row per trial and fills its metrics while the trial trains (what its ranks report
with ``monarch_worker.progress(..., loss=...)`` or, in Lightning, ``self.log`` with
``monarch_worker.lightning_progress.ReportMetrics``). Other code adds finished runs with ``record(...)`` (the Lightning
integration calls it for a fit)::

    from monarch_jupyter import experiments
    experiments.record("fit 3", settings={"lr": 0.01}, ranks=[0, 1], metrics={"val_loss": [(0, 0.9), (100, 0.4)]},
                       wall_time=12.5, checkpoint="ckpt/last.ckpt")
    experiments.table()                 # shows the table (HTML in a notebook, text elsewhere)
    experiments.table().chart("val_loss")  # a live chart comparing the runs on one metric while they train
    df = experiments.to_dataframe()     # pandas, one row per run

Columns (as in Optuna's ``trials_dataframe``): ``run``, ``kind``, ``state`` (running, complete, pruned, failed),
``value``, ``ranks``, ``wall_time_s`` (seconds), ``checkpoint``, ``params_<name>`` per setting, ``final_<metric>``
(the last value reported) and ``best_<metric>`` (the lowest, or the highest for metrics in ``maximize``) per metric.
The table lives in the notebook's process only (a kernel restart empties it); ``to_dataframe()`` keeps a copy.
pandas is imported by ``to_dataframe`` only.
"""

from __future__ import annotations

import html
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from .ranks import format_ranks

__all__ = ["Run", "Experiments", "table", "record", "to_dataframe"]

STATES = ("running", "complete", "pruned", "failed")


@dataclass
class Run:
    """One row of the table. ``metrics``: name -> [(step, value)] in the order reported; times in seconds."""

    number: int
    name: str
    kind: str = "fit"
    settings: dict = field(default_factory=dict)
    ranks: list = field(default_factory=list)
    state: str = "running"
    value: float | None = None
    metrics: dict = field(default_factory=dict)
    checkpoint: str | None = None
    started: float = field(default_factory=time.monotonic)
    wall_time: float | None = None
    error: str = ""

    def final(self) -> dict[str, float]:
        """metric -> its last reported value."""
        return {k: pts[-1][1] for k, pts in self.metrics.items() if pts}

    def best(self, maximize: Iterable[str] = ()) -> dict[str, float]:
        """metric -> its lowest value (highest for the names in ``maximize``)."""
        up = set(maximize)
        return {k: (max if k in up else min)(v for _, v in pts) for k, pts in self.metrics.items() if pts}

    def seconds(self) -> float:
        """Wall time so far (running) or in all (ended), seconds."""
        return self.wall_time if self.wall_time is not None else time.monotonic() - self.started


class Experiments:
    """A table of runs (see the module docstring); thread-safe: sweeps fill it from their trials' threads and from
    the mesh's events thread. ``maximize``: metric names whose best value is the highest."""

    def __init__(self) -> None:
        self.runs: list[Run] = []
        self.maximize: set[str] = set()
        self.note = ""  # one line about what waits (a sweep's queue), shown above the table
        self._lock = threading.Lock()
        self._listeners: list[Callable[[], None]] = []

    # ---- writing ---------------------------------------------------------------------------------------------

    def start(self, name: str, *, kind: str = "fit", settings: Mapping[str, Any] | None = None,
              ranks: Iterable[int] = ()) -> Run:
        """Add a running row and return it (``log`` its metrics, ``finish`` it)."""
        with self._lock:
            run = Run(len(self.runs), str(name), kind, dict(settings or {}), list(ranks))
            self.runs.append(run)
        self._changed()
        return run

    def log(self, run: Run, step: float, metrics: Mapping[str, float]) -> None:
        """Add ``metrics`` (name -> number) at ``step`` to ``run``; a step not after the last one of a metric
        replaces the points from it on (a restarted loop)."""
        if not metrics:
            return
        with self._lock:
            for name, value in metrics.items():
                pts = run.metrics.setdefault(str(name), [])
                while pts and pts[-1][0] >= step:
                    pts.pop()
                pts.append((float(step), float(value)))
        self._changed()

    def finish(self, run: Run, state: str, *, value: float | None = None, checkpoint: str | None = None,
               error: str = "") -> None:
        """End ``run`` as ``state`` (complete, pruned, failed). Raises ValueError for another state."""
        if state not in STATES[1:]:
            raise ValueError(f"a run ends as one of {', '.join(STATES[1:])}; got {state!r}")
        with self._lock:
            run.state, run.value, run.error = state, value, error
            run.checkpoint = checkpoint if checkpoint is not None else run.checkpoint
            run.wall_time = time.monotonic() - run.started
        self._changed()

    def record(self, name: str, *, settings: Mapping[str, Any] | None = None, ranks: Iterable[int] = (),
               metrics: Mapping[str, Any] | None = None, value: float | None = None, wall_time: float | None = None,
               checkpoint: str | None = None, state: str = "complete", kind: str = "fit") -> Run:
        """Add a finished run in one call (e.g. a Lightning fit). ``metrics``: name -> a number (its final value)
        or a list of (step, value); ``wall_time`` in seconds. Raises ValueError for an unknown ``state``."""
        if state not in STATES[1:]:
            raise ValueError(f"a run ends as one of {', '.join(STATES[1:])}; got {state!r}")
        run = Run(0, str(name), kind, dict(settings or {}), list(ranks), state, value,
                  {k: [(float(s), float(y)) for s, y in v] if isinstance(v, (list, tuple)) else [(0.0, float(v))]
                   for k, v in (metrics or {}).items()}, checkpoint, wall_time=wall_time)
        with self._lock:
            run.number = len(self.runs)
            self.runs.append(run)
        self._changed()
        return run

    def set_note(self, note: str) -> None:
        """Set the line shown above the table (a sweep's queue of waiting trials)."""
        if note != self.note:
            self.note = note
            self._changed()

    def clear(self) -> None:
        """Forget every run."""
        with self._lock:
            self.runs.clear()
            self.note = ""
        self._changed()

    # ---- reading ---------------------------------------------------------------------------------------------

    def rows(self) -> list[dict[str, Any]]:
        """One dict per run, the columns of the module docstring."""
        with self._lock:
            runs = list(self.runs)
            up = set(self.maximize)
            out = []
            for r in runs:
                row: dict[str, Any] = {"run": r.name, "kind": r.kind, "state": r.state, "value": r.value,
                                       "ranks": list(r.ranks), "wall_time_s": round(r.seconds(), 3),
                                       "checkpoint": r.checkpoint}
                row.update({f"params_{k}": v for k, v in r.settings.items()})
                row.update({f"final_{k}": v for k, v in r.final().items()})
                row.update({f"best_{k}": v for k, v in r.best(up).items()})
                out.append(row)
        return out

    def series(self, metric: str) -> dict[int, list[tuple[float, float]]]:
        """run number -> [(step, value)] of ``metric``, for the runs that reported it."""
        with self._lock:
            return {r.number: list(r.metrics[metric]) for r in self.runs if r.metrics.get(metric)}

    def name_of(self, numbers: list[int]) -> str:
        """The legend text of runs ``numbers`` (their names, joined)."""
        with self._lock:
            return ", ".join(self.runs[n].name for n in numbers if n < len(self.runs))

    def to_dataframe(self) -> Any:
        """The table as a ``pandas.DataFrame``, one row per run (a copy). Raises ImportError without pandas."""
        try:
            import pandas as pd  # type: ignore[import-untyped]
        except ImportError:
            raise ImportError("to_dataframe needs pandas: pip install pandas (rows() gives the same as dicts)") \
                from None
        return pd.DataFrame(self.rows())

    def chart(self, metric: str, *, mode: str = "auto") -> Any:
        """A live chart comparing the runs on ``metric`` while they train (widgets/runs.py): an ipywidgets view in a
        notebook, a text summary elsewhere (``mode`` as the live views': auto, widget, text)."""
        from .widgets.runs import RunChart

        return RunChart(self, metric, mode=mode)

    def text(self, columns: int = 8) -> str:
        """The table as plain text: one line per run, its state, ranks, value, settings and final metrics."""
        rows = self.rows()
        lines = [self.note] if self.note else []
        if not rows:
            return "\n".join([*lines, "no runs yet"])
        for row in rows:
            params = ", ".join(f"{k[7:]}={_fmt(v)}" for k, v in row.items() if k.startswith("params_"))
            finals = ", ".join(f"{k[6:]}={_fmt(v)}" for k, v in row.items() if k.startswith("final_"))
            extra = f"  ckpt {row['checkpoint']}" if row["checkpoint"] else ""
            lines.append(f"{row['run']:<10} {row['state']:<8} ranks {format_ranks(row['ranks']) or '-':<6} "
                         f"value {_fmt(row['value']):<8} {row['wall_time_s']:7.1f} s  {params}  {finals}{extra}")
        return "\n".join(lines)

    def html(self) -> str:
        """The table as an HTML table (escaped)."""
        rows = self.rows()
        note = f"<p>{html.escape(self.note)}</p>" if self.note else ""
        if not rows:
            return note + "<p>no runs yet</p>"
        cols: list[str] = []
        for row in rows:
            cols += [c for c in row if c not in cols]
        head = "".join(f"<th>{html.escape(c)}</th>" for c in cols)
        body = "".join("<tr>" + "".join(f"<td>{html.escape(_cell(row.get(c)))}</td>" for c in cols) + "</tr>"
                       for row in rows)
        return f'{note}<table class="mj-experiments"><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>'

    def _repr_html_(self) -> str:
        return self.html()

    def __repr__(self) -> str:
        return self.text()

    # ---- listeners -------------------------------------------------------------------------------------------

    def add_listener(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` after each change (any thread; it must not block)."""
        with self._lock:
            self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if fn in self._listeners:
                self._listeners.remove(fn)

    def _changed(self) -> None:
        with self._lock:
            listeners = list(self._listeners)
        for fn in listeners:
            fn()


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _cell(value: Any) -> str:
    if isinstance(value, list):
        return format_ranks(value)
    return _fmt(value)


_TABLE = Experiments()


def table() -> Experiments:
    """The notebook's experiment table (one per process)."""
    return _TABLE


def record(name: str, **kwargs: Any) -> Run:
    """Add a finished run to the notebook's table: ``Experiments.record`` (its parameters)."""
    return _TABLE.record(name, **kwargs)


def to_dataframe() -> Any:
    """The notebook's table as a pandas DataFrame (``Experiments.to_dataframe``)."""
    return _TABLE.to_dataframe()
