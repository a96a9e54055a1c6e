"""A hyperparameter sweep on persistent ranks with Optuna as its engine: ``sweep(mesh, objective, study, n_trials,
ranks_per_trial)`` (``monarch_jupyter.sweep``; the optional extra ``sweep`` installs Optuna).

The mesh is split into ``nproc // ranks_per_trial`` sub-meshes (submesh.py), which form a pool; Optuna's own
``study.optimize(..., n_jobs=k)`` runs up to k trials at once, each in a thread of its own that leases a free
sub-mesh from the pool (waiting for one when all are leased: the experiment table's note shows the queue), calls
``objective(trial, sub)`` and gives the sub-mesh back, whatever the trial's outcome. The objective runs its cells
with ``sub.run`` / ``sub.call`` and may report and prune as with any Optuna objective (``trial.report``,
``trial.should_prune``, ``raise optuna.TrialPruned``).

With ``report="val_loss"`` the ranks report for the trial: every value of that metric that the sub-mesh's rank 0
reports (``monarch_worker.progress(step, total, val_loss=...)``; Lightning's ``self.log`` with the callback
``monarch_worker.lightning_progress.ReportMetrics``) becomes ``trial.report(value, step)`` while the cell runs, and
when the study's pruner prunes, the sub-mesh's running cell is interrupted (KeyboardInterrupt on its ranks, which
keep their state) and the trial ends PRUNED (trialwatch.py). An objective that returns None then takes the last
value reported as the trial's value.

Every trial is a row of the experiment table (``monarch_jupyter.experiments``): its parameters, the mesh ranks it
used (also ``trial.user_attrs["ranks"]``, and ``"sub_mesh"``), every metric its rank 0 reported, the final and best
values, wall time, and ``trial.user_attrs["checkpoint"]`` when the objective sets it; ``trial.user_attrs
["regrouped"]`` says why a pruned trial's sub-mesh got a fresh process group (its interrupt left a collective in
flight, recovery.Restarts.realign). A trial whose objective raises
(a MeshError from a rank, a dead rank) is recorded as failed by Optuna (``catch``) and the sweep goes on; a
MeshError reaches Optuna (and its warning) as a TrialFailedError, one line naming each failed rank (the mesh's
number) and its error's first line, whose ``__cause__`` is the full MeshError (the table's row has it too). With
self-healing on (``on_rank_death="restart"``) the sub-mesh of a rank that died waits for the rank's replacement,
which joins that sub-mesh's group, then goes back to the pool. Without, or when the healing gave up, it leaves the
pool (the others go on), and the mesh stays split then, as a warning and the table's note say (restart the rank:
``%mesh restart --rank R`` ends the split); once no sub-mesh is left the sweep stops and raises a MonarchError
naming the dead ranks.

An interrupt (the notebook's stop button, KeyboardInterrupt) stops every running trial: their cells are
interrupted, they are recorded as failed, no trial starts after, the mesh is merged back and KeyboardInterrupt is
raised again; the study keeps every trial. Storage errors end the sweep the same way, a locked SQLite file with a
MonarchError saying so (Optuna's RDBStorage waits for SQLite's lock timeout first; give it a longer one with
``RDBStorage(url, engine_kwargs={"connect_args": {"timeout": 60}})``).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from .. import experiments
from ..errors import MeshError, MonarchError, TrialFailedError
from ..ranks import format_ranks, ranks_text
from .submesh import SubMesh
from .trialwatch import STEP_METRIC, MetricRouter, TrialWatch, stop_cells

__all__ = ["sweep"]

LEASE_POLL = 0.2  # seconds between two looks at the pool by a waiting trial
HEAL_SLACK = 30.0  # seconds a returned sub-mesh waits for its rank's healing beyond start_timeout + interrupt_grace


def sweep(mesh: Any, objective: Callable[[Any, Any], float | None], study: Any, n_trials: int,
          ranks_per_trial: int, *, report: str | None = None, timeout: float | None = None,
          catch: tuple[type[BaseException], ...] = (Exception,), table: experiments.Experiments | None = None) -> Any:
    """Run ``n_trials`` trials of ``study`` (an ``optuna.Study``), each on a sub-mesh of ``ranks_per_trial`` ranks
    of ``mesh``, as many at once as the mesh holds (see the module docstring). Returns ``study``.

    Parameters
    ----------
    objective:
        ``objective(trial, sub) -> float | None``: ``sub`` is the leased sub-mesh (the mesh itself when
        ``ranks_per_trial`` is the mesh's size), ranks numbered 0..ranks_per_trial-1 inside it.
    report:
        The name of a metric the ranks report (``progress(..., name=value)``): its values go to ``trial.report``
        and prune the trial (None: the objective reports itself). A trial whose ranks report other metrics but
        never this one fails with a MonarchError that lists the names they reported; the sweep then starts no more
        trials and raises it once the running ones ended.
    timeout:
        Seconds after which Optuna starts no new trial (None: no limit), as ``study.optimize``'s.
    catch:
        Exceptions of an objective that mark its trial failed instead of ending the sweep (Optuna's ``catch``).
    table:
        The experiment table that gets a row per trial (default: the notebook's, ``experiments.table()``).

    Raises
    ------
    ImportError
        Optuna is not installed (``pip install 'monarch_jupyter[sweep]'``).
    TypeError
        ``report`` is not a str.
    ValueError
        ``ranks_per_trial`` does not divide the mesh's ranks, ``n_trials`` is not positive, or ``report`` is empty
        or ``"global_step"`` (the step, not a metric).
    MonarchError
        The mesh is split already or cannot be split now (submesh.py); the study's SQLite file stayed locked; the
        ranks never reported the metric ``report`` names (they reported others); every sub-mesh lost a rank (without
        self-healing), so no trial could run any more (the message names the dead ranks and ``%mesh restart``).
    KeyboardInterrupt
        The sweep was interrupted (after every trial stopped and the mesh was merged back).
    """
    try:
        import optuna
    except ImportError:
        raise ImportError("sweep needs Optuna: pip install 'monarch_jupyter[sweep]' (or pip install optuna)") from None
    nproc = mesh.nproc
    if not isinstance(ranks_per_trial, int) or ranks_per_trial < 1 or nproc % ranks_per_trial:
        raise ValueError(f"ranks_per_trial must divide the mesh's {nproc} ranks, got {ranks_per_trial!r}")
    if not isinstance(n_trials, int) or n_trials < 1:
        raise ValueError(f"n_trials must be a positive number of trials, got {n_trials!r}")
    if mesh.subs:
        raise MonarchError("the mesh is split already: merge it first (m.merge(), %mesh merge); a sweep splits it "
                           "into its own sub-meshes")
    _check_report(report)
    table = table if table is not None else experiments.table()
    if report is not None and list(study.directions) == [optuna.study.StudyDirection.MAXIMIZE]:
        table.maximize.add(report)
    k = nproc // ranks_per_trial
    subs: list[Any] = mesh.split(k, [f"trial{i}" for i in range(k)]) if k > 1 else [mesh]
    pool = _Pool(subs, table, n_trials)
    router = MetricRouter()
    stopping = threading.Event()
    outcome: dict[str, BaseException] = {}

    def leased(trial: Any) -> float | None:
        if stopping.is_set():
            study.stop()
            raise MonarchError("the sweep was interrupted before this trial started")
        try:
            sub = pool.lease(trial.number)
        except MonarchError as e:  # every sub-mesh lost a rank: no trial can run any more
            outcome.setdefault("pool", e)
            study.stop()
            raise
        ranks = list(sub.ranks) if isinstance(sub, SubMesh) else list(range(nproc))
        trial.set_user_attr("ranks", ranks)
        trial.set_user_attr("sub_mesh", sub.name if isinstance(sub, SubMesh) else "mesh")
        run = table.start(f"trial {trial.number}", kind="trial", ranks=ranks)
        watch = TrialWatch(trial, sub, run, table, report)
        router.attach(ranks[0], watch)
        try:
            value = objective(trial, sub)
        except BaseException as e:
            if watch.pruned_at is None and not isinstance(e, optuna.TrialPruned):
                _end(watch, "failed", error=f"{type(e).__name__}: {e}")
                if isinstance(e, MeshError) and not isinstance(e, TrialFailedError):
                    # Optuna's warning shows the exception's repr: one short line; the full error is its cause.
                    where = (f"sub-mesh {sub.name} (mesh ranks {format_ranks(ranks)})" if isinstance(sub, SubMesh)
                             else "")
                    short = TrialFailedError.of(trial.number, e, where)
                    if isinstance(short, catch) == isinstance(e, catch):  # never changes what `catch` catches
                        raise short from e
                raise
            _end(watch, "pruned")
            if isinstance(e, optuna.TrialPruned):
                raise
            raise optuna.TrialPruned(f"pruned at step {watch.pruned_at} of {report}") from None
        finally:
            _quiet(mesh, watch, ranks[0], router)  # the watch never interrupts the sub-mesh once it is back in the pool
            pool.give_back(sub)
        if watch.pruned_at is not None:
            _end(watch, "pruned")
            raise optuna.TrialPruned(f"pruned at step {watch.pruned_at} of {report}")
        if report is not None:
            if watch.last is None and watch.seen:  # report= names a metric the ranks do not report
                error = _unreported(trial.number, report, watch.seen)
                _end(watch, "failed", error=str(error))
                outcome.setdefault("report", error)
                study.stop()  # every trial would fail the same way: start no more
                raise error
            if value is None:
                value = watch.last
        if value is None:
            _end(watch, "failed", error="the objective returned None and its ranks reported no "
                                        f"{report or 'metric to report'}")
            raise MonarchError(f"the objective of trial {trial.number} returned None: return the trial's value, or "
                               "give sweep(..., report=NAME) with a metric its ranks report (progress(step, total, "
                               "NAME=value))")
        _end(watch, "complete", value=float(value))
        return value

    def stop_when_asked(study_: Any, trial: Any) -> None:
        if stopping.is_set():
            study_.stop()

    def drive() -> None:
        try:
            study.optimize(leased, n_trials=n_trials, n_jobs=k, timeout=timeout, catch=catch,
                           callbacks=[stop_when_asked])
        except BaseException as e:  # noqa: BLE001 - raised again in the notebook's thread
            outcome["error"] = e

    mesh.add_listener(router)
    driver = threading.Thread(target=drive, name="monarch-sweep", daemon=True)
    interrupted = False
    try:
        driver.start()
        while driver.is_alive():
            try:
                driver.join(0.1)
            except KeyboardInterrupt:
                interrupted = True
                stopping.set()
                pool.stop(subs)
    finally:
        mesh.remove_listener(router)
        table.set_note(_merge(mesh, k, pool))
    if interrupted:
        raise KeyboardInterrupt("the sweep was interrupted: every running trial was stopped; the study keeps the "
                                "trials so far")
    if "error" in outcome:
        _raise_storage(outcome["error"])
    for key in ("report", "pool"):
        if key in outcome:
            raise outcome[key]
    return study


def _check_report(report: object) -> None:
    """Raise TypeError/ValueError when ``report`` is no metric name (None is fine)."""
    if report is None:
        return
    if not isinstance(report, str):
        raise TypeError(f"report must be the name of a metric the ranks report (a str, e.g. report='val_loss'), "
                        f"got {type(report).__name__} {report!r}")
    if not report.strip():
        raise ValueError("report must be the name of a metric the ranks report (e.g. report='val_loss'), got an "
                         "empty name; leave report=None when the objective reports itself")
    if report == STEP_METRIC:
        raise ValueError(f"report={STEP_METRIC!r} is the step the ranks report metrics at, not a metric: name the "
                         "metric to optimise, e.g. report='val_loss'")


def _unreported(number: int, report: str, seen: set[str]) -> MonarchError:
    """The error of trial ``number`` whose ranks reported the metrics ``seen`` but never ``report``."""
    names = ", ".join(repr(n) for n in sorted(seen))
    return MonarchError(f"trial {number}: its ranks reported {names} but never {report!r}, the metric "
                        f"sweep(..., report={report!r}) names; fix report= (one of {names}), or report it on the "
                        f"ranks: progress(step, total, {report}=value). The sweep started no more trials.")


def _quiet(mesh: Any, watch: TrialWatch, rank: int, router: MetricRouter) -> None:
    """End ``watch`` once every report of its trial's last cell reached it (the events thread delivers them in
    order; the sub-mesh's first rank is ``rank``), and wait for what it is doing: a prune's interrupt may still be
    re-forming the sub-mesh's process group, which must end before the next trial leases the sub-mesh."""
    mesh.events.flush()
    router.detach(rank)
    state = mesh.state
    watch.stop(state.options.start_timeout + 2 * state.options.interrupt_grace + HEAL_SLACK)


def _end(watch: TrialWatch, state: str, *, value: float | None = None, error: str = "") -> None:
    mesh = watch.sub.mesh if isinstance(watch.sub, SubMesh) else watch.sub
    mesh.events.flush()  # the reports of the trial's last cell reach the watch before it ends
    watch.stop()
    trial = watch.trial
    if watch.regrouped:  # its prune left a collective in flight: the sub-mesh got a fresh process group
        trial.set_user_attr("regrouped", watch.regrouped)
    watch.run.settings = dict(trial.params)
    watch.table.finish(watch.run, state, value=value, error=error, checkpoint=trial.user_attrs.get("checkpoint"))


class _Pool:
    """The free sub-meshes; a sub-mesh with a dead rank leaves it. The table's note shows the trials that wait."""

    def __init__(self, subs: list[Any], table: experiments.Experiments, n_trials: int) -> None:
        self.free: queue.Queue[Any] = queue.Queue()
        for sub in subs:
            self.free.put(sub)
        self.live = len(subs)
        self.table = table
        self.waiting: list[int] = []
        self.retired: list[Any] = []
        self._lock = threading.Lock()

    def lease(self, number: int) -> Any:
        """A free sub-mesh for trial ``number`` (waits for one). Raises MonarchError when none is left."""
        with self._lock:
            self.waiting.append(number)
        self._note()
        try:
            while True:
                try:
                    return self.free.get(timeout=LEASE_POLL)
                except queue.Empty:
                    if not self.live:
                        dead = self.dead()
                        raise MonarchError(f"no sub-mesh is left for trial {number}: {ranks_text(dead)} died, one "
                                           "in each sub-mesh, so the sweep stopped (the study keeps its trials); "
                                           f"restart them with  %mesh restart --rank {format_ranks(dead)}  and run "
                                           "the sweep again") from None
        finally:
            with self._lock:
                self.waiting.remove(number)
            self._note()

    def give_back(self, sub: Any) -> None:
        """Put ``sub`` back in the pool; one with a dead rank leaves it, once its self-healing (when on) ended."""
        _wait_healed(sub)
        dead = [r for r, s in sub.mesh.status().items() if s["state"] == "dead"] if isinstance(sub, SubMesh) else \
            [r for r, s in sub.status().items() if s["state"] == "dead"]
        ranks = sub.ranks if isinstance(sub, SubMesh) else list(range(sub.nproc))
        if any(r in dead for r in ranks):
            with self._lock:
                self.live -= 1
                self.retired.append(sub)
            self._note()
            return
        self.free.put(sub)

    def dead(self) -> list[int]:
        """The dead mesh ranks of the retired sub-meshes."""
        with self._lock:
            retired = list(self.retired)
        if not retired:
            return []
        status = (retired[0].mesh if isinstance(retired[0], SubMesh) else retired[0]).status()
        return sorted(r for r, s in status.items() if s["state"] == "dead")

    def stop(self, subs: list[Any]) -> None:
        """Stop what every sub-mesh runs (the sweep was interrupted), each in a thread of its own."""
        threads = [threading.Thread(target=stop_cells, args=(sub,), daemon=True) for sub in subs]
        for t in threads:
            t.start()
        for t in threads:
            t.join()

    def _note(self) -> None:
        with self._lock:
            waiting, retired = list(self.waiting), list(self.retired)
        parts = []
        if waiting:
            parts.append(f"trials {', '.join(map(str, waiting))} wait for a free sub-mesh")
        if retired:
            parts.append("out of the pool (a rank died): " + ", ".join(
                f"mesh ranks {format_ranks(s.ranks)}" for s in retired if isinstance(s, SubMesh)))
        self.table.set_note("sweep: " + "; ".join(parts) if parts else "")


def _wait_healed(sub: Any) -> None:
    """Wait while a rank of ``sub`` is being replaced (``on_rank_death="restart"``, healing.py), at most as long
    as a healing may take."""
    mesh = sub.mesh if isinstance(sub, SubMesh) else sub
    state = mesh.state
    ranks = set(sub.ranks if isinstance(sub, SubMesh) else range(sub.nproc))
    deadline = time.monotonic() + state.options.start_timeout + state.options.interrupt_grace + HEAL_SLACK
    with state.lock:
        while state.running and state.healing & ranks and time.monotonic() < deadline:
            state.cond.wait(LEASE_POLL)


def _merge(mesh: Any, k: int, pool: _Pool) -> str:
    """Merge the sweep's sub-meshes back, unless a rank died: then the mesh stays split, and a warning says so
    and how to fix it; that text is returned (the table's note keeps it), else ""."""
    if k == 1 or not mesh.subs:
        return ""
    if pool.retired:
        import warnings

        dead = sorted(r for r, s in mesh.status().items() if s["state"] == "dead")
        text = (f"sweep: the mesh is left split, since {ranks_text(dead)} died; restart "
                f"{'them' if len(dead) > 1 else 'it'} with  %mesh restart --rank {format_ranks(dead)}  "
                f"(m.restart(ranks={dead!r})), which merges the mesh back")
        warnings.warn(text, stacklevel=3)
        return text
    mesh.merge()
    return ""


def _raise_storage(error: BaseException) -> None:
    """Raise ``error``, as a MonarchError when it is SQLite's lock held by another process."""
    text, cause = str(error), error.__cause__ or error.__context__
    while cause is not None and "database is locked" not in text:
        text, cause = str(cause), cause.__cause__ or cause.__context__
    if "database is locked" in text:
        raise MonarchError("the study's SQLite file is locked by another process (database is locked): the sweep "
                           "stopped; the study keeps the trials so far. Let the other process finish, or give "
                           "SQLite a longer wait: optuna.storages.RDBStorage(url, engine_kwargs={'connect_args': "
                           "{'timeout': 60}})") from error
    raise error
