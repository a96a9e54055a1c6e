"""The notebook's side of ``strategy="mesh"``: check the mesh, ship the job, run it, bring the results back.

Flow of ``trainer.fit(model, datamodule=dm)`` (Lightning calls ``MeshLauncher.launch(trainer._fit_impl, model,
..., trainer=trainer)`` from inside ``fit``):

1. ``configure`` (when the Trainer is built, and again at each launch): the mesh (``mesh=`` or the current one)
   must run; ``devices x num_nodes`` must equal its world size (``num_nodes`` is derived from its hosts when left
   at 1); a GPU accelerator needs a GPU on every rank.
2. The job (the Trainer, its bound entry point and arguments, the notebook's RNG state and seed variables) is
   pickled by ``shipping.pickle_job``: notebook classes by value, large tensors out of band, data sets kept on
   the ranks by identity.
3. One ``mesh.call(rank.run_job, ...)`` runs it on every rank, under the cell's live per-rank view; output,
   errors (the rank's frames), deaths, ``breakpoint()`` and interrupts go through the mesh as for ``%%mesh``.
4. Rank 0's ``WorkerOutput`` is applied to the notebook's objects (as Lightning's
   ``_recover_results_in_main_process`` does): the model's weights, the trainer's state, loop progress
   (current_epoch, global_step), callback states (best_model_path...), metrics, logger versions; ``predict``
   puts every rank's predictions back in dataloader order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import threading
import time
import weakref
from typing import Any

from ..errors import MeshError, MeshNotRunningError, MeshTimeoutError, RankDiedError, RemoteError
from ..kernel import CellHandle, Mesh, RankMap, current_mesh
from ..ranks import format_ranks, ranks_text
from . import rank as rank_side
from .errors import MeshLightningError, TrainingInterrupted, UnpicklableJobError, fabric_interrupt
from .predictions import assemble_predictions
from .reports import FoldedRemoteError, cell_names, name_cells
from .shipping import KeptObjects, pickle_job
from .target import Target, resolve
from .tracking import record_fit

log = logging.getLogger(__name__)

__all__ = ["configure", "launch_trainer", "launch_fabric", "assemble_predictions", "PUSH_THRESHOLD"]

PUSH_THRESHOLD = 8 << 20
"""New kept objects of at least this many bytes (in all) go to the ranks by ``Mesh.push`` (shared memory on this
host, one copy) before the call; smaller ones travel with the call."""

# Per mesh: the ranks a job ran on (all of them, or a sub-mesh's) -> (mesh generation, their identity table). Two
# fits on two sub-meshes may run at once (from two threads): each has its own table, and _lock guards the map.
_kept: weakref.WeakKeyDictionary[Mesh, dict[tuple[int, ...], tuple[float, KeptObjects]]] = weakref.WeakKeyDictionary()
_lock = threading.Lock()

# Loggers whose version the notebook took from rank 0 (so that trainer.logger.log_dir is right after a fit): the
# version they had then. The next job ships them without it, so it logs into a new version directory, as a new
# run: Lightning's CSV logger deletes the metrics file of a directory it opens anew.
_borrowed_versions: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()


# ------------------------------------------------------------------------------------------------ configuration


def configure(strategy: Any, who: str) -> Target:
    """Check ``strategy`` against its mesh or sub-mesh (``target.resolve``); derive ``num_nodes`` from its hosts;
    returns where the job runs.

    Raises
    ------
    MeshNotRunningError
        No mesh runs.
    MonarchError
        The strategy's sub-mesh no longer exists (merged, or the mesh restarted).
    MeshLightningError
        devices x num_nodes differs from the (sub-)mesh's world size, or hosts hold different numbers of ranks, or a
        GPU accelerator meets ranks without GPUs, or the mesh is split and no sub-mesh was chosen. The message says
        what to change.
    """
    target = resolve(strategy)
    mesh = target.mesh
    devices = len(strategy.parallel_devices or []) or 1
    num_nodes = int(strategy.num_nodes or 1)
    world = target.world_size
    hosts = target.hosts()
    n_hosts = len(hosts) or 1
    where = "; ".join(f"{h}: {ranks_text(rs)}" for h, rs in sorted(hosts.items(), key=lambda kv: kv[1][0]))
    if num_nodes == 1 and n_hosts > 1:
        num_nodes = n_hosts  # a multi-node mesh: one node per host
    if devices * num_nodes != world and target.sub is not None:
        wanted, total = devices * num_nodes, int(target.mesh.world_size)
        if wanted == total:
            other = f"or merge the mesh ( %mesh merge ) to train on its {total} ranks"
        elif wanted < total and total % wanted == 0:
            other = (f"or split the mesh into sub-meshes of {wanted} ranks ( %mesh merge  then  %mesh split "
                     f"{total // wanted} )")
        else:
            other = f"or choose devices that fit: the mesh has {total} ranks"
        raise MeshLightningError(
            f"{who}(strategy='mesh', devices={devices}, num_nodes={num_nodes}) wants {wanted} ranks, but "
            f"{target.label} has {world}{target.where()}. devices x num_nodes must equal the sub-mesh's world size: "
            f"use {who}(strategy='mesh', devices={world}) on it, {other}")
    if devices * num_nodes != world:
        per_node = world // num_nodes if world % num_nodes == 0 else None
        nodes = f", num_nodes={num_nodes}" if num_nodes > 1 else ""
        fix = f"use {who}(strategy='mesh', devices={per_node}{nodes})" if per_node else \
            f"use devices x num_nodes = {world}"
        raise MeshLightningError(
            f"{who}(strategy='mesh', devices={devices}, num_nodes={num_nodes}) wants {devices * num_nodes} ranks, but "
            f"the mesh has {world}{' (' + where + ')' if where else ''}. devices x num_nodes must equal the mesh's "
            f"world size: {fix}, or start a mesh of {devices * num_nodes} ranks ( %mesh stop  then  %mesh start -n "
            f"{devices * num_nodes} )")
    if hosts and num_nodes != n_hosts:
        raise MeshLightningError(
            f"{who}(strategy='mesh', num_nodes={num_nodes}) but the mesh's ranks are on {n_hosts} host(s) ({where}): "
            f"leave num_nodes out (it is derived from the hosts) or use num_nodes={n_hosts}")
    uneven = {h: len(rs) for h, rs in hosts.items() if len(rs) != devices}
    if hosts and uneven:
        raise MeshLightningError(
            f"{who}(strategy='mesh', devices={devices}) needs {devices} ranks on every host, but {where}: start the "
            "mesh with the same number of ranks per host")
    node_of = {}
    for index, (_h, rs) in enumerate(sorted(hosts.items(), key=lambda kv: kv[1][0])):
        for r in rs:
            node_of[r] = index
    accelerator = type(getattr(strategy, "accelerator", None)).__name__
    gpu = accelerator in ("CUDAAccelerator",) or any(getattr(d, "type", "") == "cuda"
                                                     for d in strategy.parallel_devices or [])
    if gpu and mesh.running:
        cpu_only = [r for r, s in target.status().items() if not str(s.get("device") or "").startswith("cuda")]
        if cpu_only:
            raise MeshLightningError(
                f"{who}(strategy='mesh', accelerator='gpu') but {ranks_text(cpu_only)} have no GPU (their "
                f"device is cpu): use accelerator='cpu' (or 'auto'), or start the mesh where every rank has a GPU "
                "(%mesh start -n N --backend nccl)")
    strategy.node_ranks = node_of
    if mesh.running:
        warm_up(getattr(strategy, "family", "lightning"), mesh)
    if hasattr(strategy, "num_nodes"):
        strategy.num_nodes = num_nodes
    for name in ("set_world_ranks", "_set_world_ranks"):
        if hasattr(strategy, name):
            getattr(strategy, name)()
            break
    return target


# ------------------------------------------------------------------------------------------------ running

_warmed: weakref.WeakKeyDictionary[Mesh, float] = weakref.WeakKeyDictionary()


def warm_up(family: str = "lightning", mesh: Mesh | None = None) -> None:
    """Have the ranks import Lightning in the background (a non-blocking call), once per started mesh, so the
    first fit does not wait for it (seconds per rank). Does nothing without a running mesh or on a rank."""
    if rank_side.in_job():
        return
    try:
        mesh = mesh or current_mesh()
    except MeshNotRunningError:
        return
    if not mesh.running or _warmed.get(mesh) == mesh.generation:
        return
    if any(s.get("state") != "idle" for s in mesh.status().values()):
        return  # never queue behind (or in front of) the user's own work: the fit imports Lightning anyway
    _warmed[mesh] = mesh.generation
    try:
        handle = mesh.call(rank_side.warm_up, family, block=False)
        assert isinstance(handle, CellHandle)
        mesh.parts.cells.mark_background(handle)  # a cell that waits behind it gets no note: the user did not send it
    except Exception:  # noqa: BLE001 - only a head start; the fit imports Lightning anyway
        log.debug("could not warm the ranks up", exc_info=True)


def _kept_for(target: Target) -> KeptObjects:
    mesh = target.mesh
    with _lock:
        tables = _kept.setdefault(mesh, {})
        started, kept = tables.get(tuple(target.ranks), (None, None))
        if kept is None or started != mesh.generation:
            if kept is not None:  # a restarted mesh: fresh ranks hold nothing
                kept.sent.clear()
            else:
                kept = KeptObjects()
            tables[tuple(target.ranks)] = (mesh.generation, kept)
        return kept


def _live_view_mode(strategy: Any) -> tuple[str, int]:
    mode = getattr(strategy, "live_view", None)
    fold = 16
    ipython_mod = sys.modules.get("IPython")
    shell = ipython_mod.get_ipython() if ipython_mod is not None else None
    magics = shell.magics_manager.registry.get("MeshMagics") if shell is not None else None
    if magics is not None:
        fold = int(getattr(magics, "dashboard_fold", fold))
        if mode is None:
            mode = getattr(magics, "live_view", None)
    return (mode or "auto"), fold


def _global_state(family: str) -> Any:
    import importlib

    mod = importlib.import_module(f"{rank_side.PYTORCH[family]}.strategies.launchers.multiprocessing")
    return mod._GlobalStateSnapshot.capture()


def _job_parts(job: rank_side.Job) -> list[tuple[str, Any]]:
    """What a job sends, named as the user knows it: model, datamodule=..., the launched function..."""
    import inspect

    parts: list[tuple[str, Any]] = []
    if job.kind == "trainer":
        try:
            bound = inspect.signature(job.fn).bind(*job.args, **job.kwargs)
            parts += [(name, value) for name, value in bound.arguments.items() if value is not None]
        except (TypeError, ValueError):
            parts += [(f"argument {i}", a) for i, a in enumerate(job.args)]
        parts.append(("the Trainer", job.trainer))
    else:
        inner = getattr(job.fn, "args", ())
        if inner:
            parts.append(("the launched function", inner[0]))
        parts += [(f"argument {i}", a) for i, a in enumerate(job.args[1:], 1)]
        parts += [(f"{k}=", v) for k, v in job.kwargs.items()]
        parts.append(("the Fabric object", job.trainer))
    return parts


def _describe_unpicklable(job: rank_side.Job, error: BaseException) -> str:
    import cloudpickle

    from monarch_worker.serialize import describe_unpicklable

    for label, value in _job_parts(job):
        try:
            cloudpickle.dumps(value)
        except Exception as e:  # noqa: BLE001
            detail = describe_unpicklable(value, e).replace("value", label, 1)
            return (f"cannot send {label} ({type(value).__name__}) to the ranks: {detail}. Make that attribute "
                    "picklable, or create it where it is used (in setup() or configure_model(), which run on the "
                    "ranks), or drop it in __getstate__. Nothing was sent; the mesh is unchanged.")
    return f"cannot send the job to the ranks: {error}. Nothing was sent; the mesh is unchanged."


def _run(target: Target, strategy: Any, job: rank_side.Job) -> RankMap:
    """Ship ``job`` and run it on every rank of ``target``; returns rank -> value (the job's rank numbers). Raises
    as the mesh does (errors name the mesh's ranks), except that an interrupt (KeyboardInterrupt) leaves the ranks
    free again (stuck collectives are released) before it is raised again."""
    mesh = target.mesh
    if mesh.listening and not mesh.running:
        mesh.wait_ready()
    kept = _kept_for(target)
    for _attempt in range(3):
        try:
            shipment = pickle_job(job, kept)
        except Exception as e:  # noqa: BLE001
            raise UnpicklableJobError(_describe_unpicklable(job, e)) from None
        new = shipment.new
        if new and shipment.new_bytes >= PUSH_THRESHOLD:
            mesh.push({rank_side.INBOX: new}, ranks=target.call_ranks)
            new = {}
        mode, fold = _live_view_mode(strategy)
        view = None
        captured = contextlib.ExitStack()  # the job's output shows in its view, not beside it (widgets.cell_view)
        if mode != "off":
            from ..widgets import cell_view

            title = f"mesh cell on {target.sub.name}" if target.sub is not None else "mesh cell"
            view = cell_view(mesh, target.ranks, mode=mode, fold_threshold=fold, title=title)
            if view is not None:
                captured.enter_context(view.capture())
        handle = mesh.call(rank_side.run_job, shipment.data, shipment.slots, new, kept.take_dropped(),
                           shipment.tokens, shipment.sources, job.family, ranks=target.call_ranks, block=False)
        assert isinstance(handle, CellHandle)
        names = cell_names(shipment.sources)
        released: list[int] = []
        try:
            released = _watch(mesh, handle)
            results = handle.result()
        except KeyboardInterrupt as e:
            if not str(e) and not handle.done():  # it landed between two of _watch's waits: as result() would
                e = handle.interrupted()
            if not handle.done():  # some ranks are blocked in a collective that the others left
                report = mesh.interrupt(target.call_ranks, force=True)
                print(f"strategy='mesh': released the ranks still running after the interrupt: "
                      f"{name_cells(report.text, names)}", file=sys.stderr)
            raise _Interrupted(name_cells(str(e), names), list(handle.ranks)) from None
        except MeshError as e:
            if isinstance(e, MeshTimeoutError):
                raise
            errors = {r: FoldedRemoteError.of(err, names) if type(err) is RemoteError else err
                      for r, err in e.errors.items()}
            failed = [r for r in errors if r not in released]
            for r in released:
                if r in errors and failed:
                    orig = errors.pop(r)
                    errors[r] = RemoteError(r, "Released", f"waited in a collective for rank(s) "
                                            f"{format_ranks(failed)}, which failed; released by the mesh "
                                            f"({getattr(orig, 'ename', type(orig).__name__)})")
            raise MeshError(errors, e.results, what=job.what, hint=e.hint) from None
        finally:
            captured.close()
            if view is not None:
                view.finish()
        values = dict(target.local(results))
        missing = sorted({t for v in values.values() if isinstance(v, rank_side.Missing) for t in v.tokens})
        if not missing:
            kept.sent.update(shipment.tokens)
            return RankMap(sorted(values.items()))
        log.info("rank(s) lack %d kept object(s) (restarted?); sending them again", len(missing))
        kept.forget(missing)
    raise MeshLightningError("the ranks kept losing the job's data between attempts; run  %mesh restart  and retry")


def _watch(mesh: Mesh, handle: Any) -> list[int]:
    """Wait for the job; when it failed on some ranks while others still run, release those.

    A rank that raised (in training_step, say) leaves its peers blocked in the next collective (DDP's gradient
    all_reduce) until the process group's timeout: torchrun would kill them, the mesh keeps them. After
    ``RELEASE_AFTER`` seconds the survivors are released like ``%mesh interrupt --force`` does (the process group
    is torn down, which fails their collective, and re-created; every rank keeps its namespace), so the fit fails
    at once with the first rank's error as the root cause. Returns the ranks released.
    """
    failed_at = None
    while not handle.wait(0.1):
        snap = handle.snapshot()
        if not snap.errors:
            continue
        if any(isinstance(e, RankDiedError) for e in snap.errors.values()):
            return []  # a death: the mesh itself releases the survivors (docs/faults.md)
        now = time.monotonic()
        failed_at = failed_at or now
        if now - failed_at < RELEASE_AFTER:
            continue
        running = [r for r in handle.ranks if r not in snap.finished]
        if running:
            log.info("releasing rank(s) %s after rank(s) %s failed", running, sorted(snap.errors))
            mesh.interrupt(running, force=True)
        return running
    return []


RELEASE_AFTER = 1.0
"""Seconds the other ranks get to finish by themselves once one rank's job failed (then they are released)."""


class _Interrupted(Exception):
    def __init__(self, message: str, ranks: list[int]) -> None:
        super().__init__(message)
        self.ranks = ranks


def _base_job(strategy: Any, family: str, kind: str) -> dict:
    return {
        "family": family,
        "kind": kind,
        "env": {**{k: os.environ.get(k) for k in rank_side.ENV_KEYS},
                **{k: v for k, v in os.environ.items() if k.startswith(rank_side.ENV_PREFIXES)}},
        "node_ranks": dict(getattr(strategy, "node_ranks", {}) or {}),
    }


def launch_trainer(strategy: Any, family: str, function: Any, args: tuple, kwargs: dict, trainer: Any) -> Any:
    """``MeshLauncher.launch``: run a Trainer entry point on the ranks and update the notebook's objects."""
    target = configure(strategy, "Trainer")
    if trainer is not None:
        for logger in trainer.loggers:
            if logger in _borrowed_versions and getattr(logger, "_version", None) == _borrowed_versions[logger]:
                logger._version = None
    job = rank_side.Job(fn=function, args=tuple(args), kwargs=dict(kwargs), trainer=trainer,
                        global_state=_global_state(family), progress=bool(getattr(strategy, "progress", True)),
                        **_base_job(strategy, family, "trainer"))
    fitting = getattr(function, "__name__", "") == "_fit_impl" and trainer is not None
    started = time.monotonic()
    # A KeyboardInterrupt must never leave this launcher: Lightning would answer it with SIG_IGN and sys.exit(1).
    try:
        try:
            results = _run(target, strategy, job)
        except _Interrupted as e:
            _recover_partial(target, trainer)
            if fitting:
                record_fit(trainer, target.ranks, started, e)
            raise TrainingInterrupted(
                f"{e} ; trainer.interrupted is True and the ranks keep running: the next fit works as usual",
                e.ranks) from None
        except MeshError as e:
            if not isinstance(e, MeshTimeoutError):  # after a timeout, ranks may still run the job
                _recover_partial(target, trainer)
            if fitting:
                record_fit(trainer, target.ranks, started, e)
            raise
        output = results.get(0)
        if trainer is None or not isinstance(output, rank_side.WorkerOutput):
            return output
        _recover(trainer, output)
        if fitting:
            record_fit(trainer, target.ranks, started)
        if output.predictions is not None:
            per_rank = [output.predictions] + [results[r] for r in sorted(results) if r != 0]
            return assemble_predictions([p for p in per_rank if isinstance(p, rank_side.PredictOutput)])
        return output.results
    except KeyboardInterrupt as e:
        raise TrainingInterrupted(f"interrupted ({e or 'in the notebook'}); trainer.interrupted is True and the "
                                  "ranks keep running: the next fit works as usual") from None


def launch_fabric(strategy: Any, family: str, function: Any, args: tuple, kwargs: dict) -> Any:
    """``MeshFabricLauncher.launch``: run ``function(*args, **kwargs)`` on every rank; rank 0's value, or every
    rank's (``return_all``)."""
    target = configure(strategy, "Fabric")
    fabric = args[0] if args else None
    job = rank_side.Job(fn=function, args=tuple(args), kwargs=dict(kwargs), trainer=fabric,
                        global_state=_global_state(family), **_base_job(strategy, family, "fabric"))
    try:
        results = _run(target, strategy, job)
    except _Interrupted as e:
        raise fabric_interrupt(f"{e} ; the ranks keep running: the next launch works as usual") from None
    strategy.rank_results = results
    if getattr(strategy, "return_all", False):
        return results
    return results.get(0)


# ------------------------------------------------------------------------------------------------ results


def _recover(trainer: Any, out: rank_side.WorkerOutput) -> None:
    """Rank 0's results into the notebook's Trainer and model (Lightning's _recover_results_in_main_process)."""
    module = trainer.lightning_module
    if out.weights is not None and module is not None:
        # Not strict, as Lightning's own launcher: configure_model() on the ranks may have added layers.
        module.load_state_dict(out.weights, strict=False)
    for name, state in out.loops.items():
        loop = getattr(trainer, name, None)
        if loop is None:
            continue
        try:
            _restore_progress(loop, state, "")
        except Exception:  # noqa: BLE001 - progress counters are a convenience; never fail a finished fit
            log.debug("could not restore %s", name, exc_info=True)
    by_key = {}
    for cb in trainer.callbacks:
        try:
            by_key[cb.state_key] = cb
        except Exception:  # noqa: BLE001
            continue
    for key, state in out.callbacks.items():
        cb = by_key.get(key)
        if cb is None or not state:
            continue
        try:
            if "dirpath" in state and hasattr(cb, "dirpath"):
                cb.dirpath = state["dirpath"]  # resolved on the ranks (ModelCheckpoint keeps its paths only then)
            cb.load_state_dict(state)
        except Exception:  # noqa: BLE001
            log.debug("could not restore the state of callback %s", key, exc_info=True)
    trainer.state = out.trainer_state
    for attr, key in (("callback_metrics", "callback"), ("logged_metrics", "logged"),
                      ("progress_bar_metrics", "progress_bar")):
        target = getattr(trainer, attr)
        target.clear()
        target.update(out.metrics.get(key, {}))
    for logger, ids in zip(trainer.loggers, out.logger_runs, strict=False):
        for attr, value in ids.items():  # MLFlowLogger's run: the notebook's logger names rank 0's
            if getattr(logger, attr, None) is None:
                setattr(logger, attr, value)
    for logger, version in zip(trainer.loggers, out.logger_versions, strict=False):
        if version is not None and hasattr(logger, "_version") and logger._version is None:
            logger._version = version
            try:
                _borrowed_versions[logger] = version
            except TypeError:
                pass


PARTIAL_TIMEOUT = 30.0
"""Seconds the notebook waits for rank 0's counters after a failed or interrupted fit (then it goes without)."""


def _recover_partial(target: Target, trainer: Any) -> None:
    """After a failed or interrupted job: rank 0's counters, metrics, callback states and weights so far into the
    notebook's Trainer and model, as a local Trainer holds them after an exception (``global_step`` counts the
    steps that ran). Nothing when rank 0 is gone or busy; never raises (the job's own error is what the cell
    shows)."""
    mesh = target.mesh
    if trainer is None or not mesh.running:
        return
    try:
        got = mesh.call(rank_side.take_partial, ranks=[target.first], timeout=PARTIAL_TIMEOUT)
        output = got.get(target.first) if isinstance(got, RankMap) else None
        if isinstance(output, rank_side.WorkerOutput):
            _recover(trainer, output)
    except BaseException:  # noqa: BLE001 - an interrupt here, a dead or busy rank 0: the counters stay as they were
        log.debug("no counters from rank 0 after the failed job", exc_info=True)


def _restore_progress(loop: Any, state: dict, prefix: str) -> None:
    """Rank 0's progress counters into a loop of the notebook's Trainer and its child loops (current_epoch,
    global_step...). Not ``loop.load_state_dict``: that marks the loops as resumed from a checkpoint, and the next
    fit would then behave as a resumed one instead of going on as a local Trainer does."""
    for key, value in vars(loop).items():
        name = prefix + key
        if hasattr(value, "load_state_dict") and type(value).__name__.endswith("Progress") and name in state:
            value.load_state_dict(state[name])
        elif hasattr(value, "restarting") and hasattr(value, "state_dict") and hasattr(value, "trainer"):
            _restore_progress(value, state, name + ".")
    extra = state.get(prefix + "state_dict") or {}
    if "_batches_that_stepped" in extra and hasattr(loop, "_batches_that_stepped"):
        loop._batches_that_stepped = extra["_batches_that_stepped"]  # the logging step
