"""A hyperparameter sweep on persistent ranks with Optuna as its engine: ``sweep(mesh, objective, study, n_trials,
ranks_per_trial)`` (``monarch_jupyter.sweep``; the optional extra ``sweep`` installs Optuna).

The mesh is split into ``nproc // ranks_per_trial`` sub-meshes (submesh.py), which form a pool; Optuna's own
``study.optimize(..., n_jobs=k)`` runs up to k trials at once, each in a thread of its own that leases a free
sub-mesh from the pool (waiting for one when all are leased), calls ``objective(trial, sub)`` and gives the
sub-mesh back, whatever the trial's outcome. The objective runs its cells with ``sub.run`` / ``sub.call`` and
may report intermediate values and prune as with any Optuna objective (``trial.report``, ``trial.should_prune``,
``raise optuna.TrialPruned``). Each trial records the mesh ranks it used (``trial.user_attrs["ranks"]``) and its
sub-mesh's name (``"sub_mesh"``). A trial whose objective raises (a MeshError from a rank, a dead rank) is recorded
as failed by Optuna (``catch``) and the sweep goes on. When the sweep ends (or is interrupted), the mesh is merged
back into one process group; the study keeps every trial that finished.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from typing import Any

from ..errors import MonarchError
from .submesh import SubMesh

__all__ = ["sweep"]


def sweep(mesh: Any, objective: Callable[[Any, Any], float], study: Any, n_trials: int, ranks_per_trial: int, *,
          timeout: float | None = None, catch: tuple[type[BaseException], ...] = (Exception,)) -> Any:
    """Run ``n_trials`` trials of ``study`` (an ``optuna.Study``), each on a sub-mesh of ``ranks_per_trial`` ranks
    of ``mesh``, as many at once as the mesh holds (see the module docstring). Returns ``study``.

    Parameters
    ----------
    objective:
        ``objective(trial, sub) -> float``: ``sub`` is the leased sub-mesh (the mesh itself when
        ``ranks_per_trial`` is the mesh's size), ranks numbered 0..ranks_per_trial-1 inside it.
    timeout:
        Seconds after which Optuna starts no new trial (None: no limit), as ``study.optimize``'s.
    catch:
        Exceptions of an objective that mark its trial failed instead of ending the sweep (Optuna's ``catch``).

    Raises
    ------
    ImportError
        Optuna is not installed (``pip install 'monarch_jupyter[sweep]'``).
    ValueError
        ``ranks_per_trial`` does not divide the mesh's ranks, or ``n_trials`` is not positive.
    MonarchError
        The mesh is split already, or cannot be split now (submesh.py).
    """
    try:
        import optuna  # noqa: F401 - the engine; checked before anything changes
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
    k = nproc // ranks_per_trial
    subs: list[Any] = mesh.split(k, [f"trial{i}" for i in range(k)]) if k > 1 else [mesh]
    pool: queue.Queue[Any] = queue.Queue()
    for sub in subs:
        pool.put(sub)

    def leased(trial: Any) -> float:
        sub = pool.get()  # waits while every sub-mesh runs a trial
        try:
            trial.set_user_attr("ranks", list(sub.ranks) if isinstance(sub, SubMesh) else list(range(nproc)))
            trial.set_user_attr("sub_mesh", sub.name if isinstance(sub, SubMesh) else "mesh")
            return objective(trial, sub)
        finally:
            pool.put(sub)

    try:
        study.optimize(leased, n_trials=n_trials, n_jobs=k, timeout=timeout, catch=catch)
    finally:
        if k > 1 and mesh.subs:
            mesh.merge()
    return study
