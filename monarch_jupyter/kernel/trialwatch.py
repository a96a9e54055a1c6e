"""What a sweep's trial hears from its ranks: the metrics its sub-mesh reports reach the Optuna trial, the
experiment table, and the pruner, which stops the trial's ranks (sweep.py uses it).

``MetricRouter`` is one mesh listener for a whole sweep: a ``progress`` event of a sub-mesh's first rank (its rank 0,
which reports what ``monarch_worker.progress(step, total, loss=...)`` and Lightning's ``self.log`` through
``monarch_worker.lightning_progress.ReportMetrics`` give) goes to the ``TrialWatch`` of the trial that leased that
sub-mesh. The events thread only queues it: Optuna's storage (SQLite, say) may block.

``TrialWatch`` has a thread of its own while its trial's objective runs: it logs each report into the table row
and, for the metric named ``report``, calls ``trial.report(value, step)`` (step: the report's ``global_step``
metric, else its count ``n``; a step not after the last reported one is skipped, as Optuna would warn) and
``trial.should_prune()``. When the pruner says so, it interrupts the sub-mesh's running cell (``SubMesh.interrupt``:
KeyboardInterrupt on its ranks, which keep their state), and the sweep ends the trial as pruned.
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

log = logging.getLogger(__name__)

__all__ = ["MetricRouter", "TrialWatch", "stop_cells", "STOP_GRACE", "STEP_METRIC"]

STOP_GRACE = 1.0  # seconds a trial's ranks get to stop at an interrupt before their group is torn down
STEP_METRIC = "global_step"  # a reported metric of this name is the step (as the live view's charts take it)


class TrialWatch:
    """The metrics of one running trial (see the module docstring). ``pruned_at``: the step at which the pruner
    stopped it (None: not pruned); ``last``: the last value of ``report`` (None: none yet); ``seen``: the names
    of the metrics reported so far."""

    def __init__(self, trial: Any, sub: Any, run: Any, table: Any, report: str | None) -> None:
        self.trial, self.sub, self.run, self.table, self.report = trial, sub, run, table, report
        self.pruned_at: int | None = None
        self.last: float | None = None
        self.seen: set[str] = set()  # the names of every metric reported (read once ``stop`` returned)
        self.regrouped = ""  # why stopping the pruned trial re-created its sub-mesh's process group ("": it did not)
        self._last_step = -1
        self._queue: queue.Queue[tuple[float, dict] | None] = queue.Queue()
        self._thread = threading.Thread(target=self._loop, name=f"monarch-trial{trial.number}", daemon=True)
        self._thread.start()

    def put(self, step: float, metrics: dict) -> None:
        """Queue a report (the events thread; never blocks)."""
        self._queue.put((step, metrics))

    def stop(self, timeout: float = 30.0) -> None:
        """Handle what is queued, then end the thread (waits up to ``timeout`` seconds; again: at once)."""
        if not self._thread.is_alive():
            return
        self._queue.put(None)
        self._thread.join(timeout)

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            try:
                self._handle(*item)
            except Exception:  # noqa: BLE001 - a storage error must not kill the watch; the trial's own calls raise it
                log.exception("trial %d: handling a metric report failed", self.trial.number)

    def _handle(self, step: float, metrics: dict) -> None:
        self.table.log(self.run, step, metrics)
        self.seen.update(metrics)
        if self.report is None or self.report not in metrics or self.pruned_at is not None:
            return
        value, at = float(metrics[self.report]), int(step)
        self.last = value
        if at <= self._last_step:
            return
        self._last_step = at
        self.trial.report(value, at)
        if self.trial.should_prune():
            self.pruned_at = at
            self.regrouped = stop_cells(self.sub)


def stop_cells(sub: Any, grace: float = STOP_GRACE) -> str:
    """Stop what ``sub`` (a sub-mesh, or the mesh) runs: KeyboardInterrupt on its ranks; ranks that still run after
    ``grace`` seconds (blocked in a collective whose peer left it) are released by tearing the sub-mesh's process
    group down and making a new one (``interrupt(force=True)``; a rank that still does not stop is killed). Ranks
    that all stopped with a collective left in flight get a fresh group too (``Mesh.interrupt``): what it says is
    returned ("" otherwise). Errors (a dead rank, a sub-mesh merged meanwhile) are logged: the trial's own cell
    reports them."""
    try:
        report = sub.interrupt(grace=grace)
        if report.stuck:
            sub.interrupt(force=True, grace=grace)
        return str(report.realigned)
    except Exception:  # noqa: BLE001 - see the docstring
        log.info("stopping the cells of %r failed", sub, exc_info=True)
        return ""


class MetricRouter:
    """A mesh listener that hands each progress report of a leased sub-mesh's rank 0 to its trial's watch."""

    def __init__(self) -> None:
        self._watches: dict[int, TrialWatch] = {}  # mesh rank (a sub-mesh's first) -> its trial's watch
        self._lock = threading.Lock()

    def attach(self, rank: int, watch: TrialWatch) -> None:
        with self._lock:
            self._watches[rank] = watch

    def detach(self, rank: int) -> None:
        with self._lock:
            self._watches.pop(rank, None)

    def __call__(self, kind: str, data: dict) -> None:
        if kind != "progress" or not data.get("metrics"):
            return
        with self._lock:
            watch = self._watches.get(data["rank"])
        if watch is not None:
            metrics = dict(data["metrics"])
            step = metrics.pop(STEP_METRIC, data.get("n") or 0.0)
            watch.put(float(step), metrics)
