"""The rank side of ``strategy="mesh"``: what runs inside each rank when the notebook calls ``fit``,
``validate``, ``test``, ``predict`` or ``Fabric.launch``.

This module imports only the standard library, torch, Lightning (when a job runs) and ``monarch_worker``: never
IPython, ipywidgets or the controller. The controller (``launch.py``) sends one call per job::

    run_job(job_bytes, slots, new_objects, drop, tokens, sources)

- ``job_bytes``: the job (trainer or Fabric function, its arguments, global state) pickled in the notebook by
  ``shipping.JobPickler``. Tensors in it are references: ``("slot", i)`` is ``slots[i]`` (large tensors, sent
  out of band by the mesh), ``("kept", token)`` is an object this rank keeps from an earlier job (data sets:
  tensors and arrays of at least ``shipping.KEEP_THRESHOLD`` bytes, kept by identity, see shipping.py).
- ``new_objects``: token -> object, kept from now on; ``drop``: tokens the notebook no longer holds.
- ``tokens``: every kept token the job refers to. If any rank lacks one (it was restarted), every rank answers
  ``Missing`` (they agree through one all_reduce first, so no rank starts a collective alone) and the notebook
  sends those objects again.

Results: rank 0 returns a ``WorkerOutput`` (its weights, trainer state, loop and callback states, metrics), as
Lightning's multiprocessing launcher does through a queue, without a temporary checkpoint file; every rank returns
its predictions with their sample indices, so the notebook can put them back in dataloader order.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import pickle
import sys
import time
from dataclasses import dataclass, field
from typing import Any

__all__ = ["run_job", "warm_up", "in_job", "take_partial", "Job", "WorkerOutput", "Missing", "PredictOutput",
           "MIN_REPORT_INTERVAL"]

MIN_REPORT_INTERVAL = 0.1  # seconds between two progress reports of the progress bar callback

# Objects shipped by earlier jobs, kept by identity: token -> (object, torch version counter or None).
_KEPT: dict[int, tuple[Any, int | None]] = {}

# Environment variables of the notebook that Lightning reads on the ranks (seed_everything, deterministic mode).
ENV_KEYS = ("PL_GLOBAL_SEED", "PL_SEED_WORKERS", "CUBLAS_WORKSPACE_CONFIG")

ENV_PREFIXES = ("MLFLOW_",)
"""Variables that loggers read (MLFlowLogger: MLFLOW_TRACKING_URI, MLFLOW_ALLOW_FILE_STORE...): those set in the
notebook hold on the ranks while the job runs, as torchrun's workers inherit them from its shell."""

PYTORCH = {"lightning": "lightning.pytorch", "standalone": "pytorch_lightning"}
FABRIC = {"lightning": "lightning.fabric", "standalone": "lightning_fabric"}


@dataclass
class Job:
    """One launch: ``fn(*args, **kwargs)`` on every rank.

    ``kind`` is "trainer" (``fn`` is a bound Trainer method such as ``_fit_impl``; ``trainer`` is that Trainer) or
    "fabric" (``fn`` wraps the user's function with Fabric's set-up). ``family`` is "lightning" (``import
    lightning``) or "standalone" (``pytorch_lightning`` / ``lightning_fabric``). ``global_state`` is Lightning's
    ``_GlobalStateSnapshot`` of the notebook (RNG states, deterministic flags), ``env`` the notebook's values of
    ``ENV_KEYS`` (None: unset), ``node_ranks`` rank -> node index.
    """

    kind: str
    family: str
    fn: Any
    args: tuple
    kwargs: dict
    trainer: Any = None
    global_state: Any = None
    env: dict = field(default_factory=dict)
    node_ranks: dict = field(default_factory=dict)
    progress: bool = True
    return_all: bool = False

    @property
    def what(self) -> str:
        """How errors name the job: "trainer.fit", "fabric.launch(train)"."""
        name = getattr(self.fn, "__name__", "")
        if self.kind == "trainer":
            return f"trainer.{name.strip('_').removesuffix('_impl')}"
        inner = getattr(self.fn, "args", None)
        target = getattr(inner[0], "__name__", "") if inner else ""
        return f"fabric.launch({target})"


@dataclass
class Missing:
    """The job did not run: some rank lacks kept objects. ``tokens``: the ones this rank lacks."""

    tokens: list


@dataclass
class WorkerOutput:
    """What rank 0 sends back after a Trainer job (the shape of Lightning's ``_WorkerOutput``)."""

    trainer_state: Any
    weights: dict | None
    loops: dict
    callbacks: dict
    metrics: dict
    logger_versions: list
    results: Any
    predictions: Any = None
    logger_runs: list = field(default_factory=list)  # per logger: its run's ids on rank 0 (LOGGER_RUN_ATTRS)


LOGGER_RUN_ATTRS = ("_run_id", "_experiment_id")
"""Attributes naming the run a logger made on rank 0 (MLFlowLogger's, CometLogger's...): the notebook's logger takes
them after a fit, so that its ``run_id`` is that run, not a new empty one made in the notebook."""


def _logger_runs(trainer: Any) -> list:
    return [{a: getattr(lg, a) for a in LOGGER_RUN_ATTRS if getattr(lg, a, None) is not None}
            for lg in trainer.loggers]


@dataclass
class PredictOutput:
    """A rank's predictions (one list per dataloader) and the dataset indices of each batch."""

    predictions: Any
    batch_indices: dict
    num_dataloaders: int = 1


# ----------------------------------------------------------------------------------------------------- unpickling


class _JobUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, slots: list) -> None:
        super().__init__(file)
        self.slots = slots

    def persistent_load(self, pid: Any) -> Any:
        kind, key = pid
        if kind == "slot":
            return self.slots[key]
        if kind == "kept":
            return _KEPT[key][0]
        raise pickle.UnpicklingError(f"unknown reference {pid!r}")


def _version_of(obj: Any) -> int | None:
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return int(obj._version)
    return None


def _keep(new_objects: dict, drop: list) -> None:
    for token in drop:
        _KEPT.pop(token, None)
    for token, obj in new_objects.items():
        _KEPT[token] = (obj, _version_of(obj))


def _missing(tokens: list) -> list:
    """Tokens this rank does not hold, or holds modified in place by an earlier job (torch's version counter)."""
    out = []
    for token in tokens:
        entry = _KEPT.get(token)
        if entry is None or (entry[1] is not None and _version_of(entry[0]) != entry[1]):
            _KEPT.pop(token, None)
            out.append(token)
    return out


def _agree_missing(count: int) -> int:
    """Sum of every rank's missing count (one all_reduce on the mesh's process group)."""
    import torch
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return count
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    t = torch.tensor([count], dtype=torch.int64, device=device)
    dist.all_reduce(t)
    return int(t.item())


def run_job(job_bytes: bytes, slots: list, new_objects: dict, drop: list, tokens: list,
            sources: dict, family: str = "lightning") -> Any:
    """Entry point of one job on a rank (called by the mesh): see the module docstring."""
    from monarch_worker.executor import register_source

    _check_lightning(family)

    for filename, source in sources.items():
        register_source(filename, source)
    inbox = sys.modules["__main__"].__dict__.pop(INBOX, None)  # large new objects pushed through shared memory
    if inbox:
        new_objects = {**new_objects, **inbox}
    _keep(new_objects, drop)
    missing = _missing(tokens)
    if _agree_missing(len(missing)):
        return Missing(missing)
    job = _JobUnpickler(io.BytesIO(job_bytes), [_aligned(t) for t in slots]).load()
    return _run(job)


def _aligned(t: Any) -> Any:
    """``t`` in memory of torch's own allocator (64-byte aligned) when it arrived in a transport buffer that is not:
    the model's parameters are read and written at every step, vectorized kernels prefer aligned memory."""
    import torch

    if not isinstance(t, torch.Tensor) or t.data_ptr() % 64 == 0 or t.numel() == 0:
        return t
    copy = t.detach().clone()
    if isinstance(t, torch.nn.Parameter):
        return torch.nn.Parameter(copy, requires_grad=t.requires_grad)
    return copy.requires_grad_(t.requires_grad)


def _check_lightning(family: str) -> None:
    try:
        importlib.import_module(PYTORCH[family])
    except ImportError as e:
        import socket

        package = "lightning" if family == "lightning" else "pytorch-lightning"
        raise ModuleNotFoundError(
            f"{package} cannot be imported where this rank runs ({socket.gethostname()}, {sys.executable}): {e}. "
            f"Install it there too:  pip install 'monarch-jupyter[lightning]'  (the ranks need the same Lightning "
            "as the notebook)") from None


def modules(family: str) -> tuple[str, ...]:
    """The modules a rank needs for a job of ``family`` ("lightning" or "standalone"), slowest first."""
    return PYTORCH[family], f"{PYTORCH[family]}.trainer.call", FABRIC[family]


def warm_up(family: str) -> None:
    """Import Lightning now (the controller asks for it in the background when a mesh meets Lightning), so that
    the first fit does not wait seconds for it."""
    for name in modules(family):
        importlib.import_module(name)


INBOX = "_monarch_lightning_inbox"
"""Name under which the controller pushes large new objects (shared memory) just before ``run_job``."""


# ----------------------------------------------------------------------------------------------------- running


@contextlib.contextmanager
def _notebook_env(env: dict, node_rank: int | None) -> Any:
    """The notebook's Lightning variables for the duration of the job (then the rank's own again)."""
    saved = {k: os.environ.get(k) for k in (*env, "NODE_RANK")}
    try:
        for key, value in env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if node_rank is not None and "NODE_RANK" not in os.environ and "GROUP_RANK" not in os.environ:
            os.environ["NODE_RANK"] = str(node_rank)
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _check_process_group() -> None:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("this rank has no process group (the mesh's was torn down): run  %mesh restart  "
                           "(or mesh.restart()) before the next fit; strategy='mesh' never creates one itself")


_in_job = False


def in_job() -> bool:
    """True while this process runs a job as a rank (MeshEnvironment then reads the rank's environment)."""
    return _in_job


def _run(job: Job) -> Any:
    global _in_job
    _check_process_group()
    rank = int(os.environ.get("RANK", "0"))
    with _notebook_env(job.env, job.node_ranks.get(rank)):
        if job.global_state is not None:
            job.global_state.restore()
        _in_job = True
        try:
            if job.kind == "fabric":
                return _run_fabric(job)
            return _run_trainer(job, rank)
        finally:
            _in_job = False


def _run_fabric(job: Job) -> Any:
    apply_func = importlib.import_module(f"{FABRIC[job.family]}.utilities.apply_func")
    value = job.fn(*job.args, **job.kwargs)
    return apply_func.move_data_to_device(value, "cpu")


def _run_trainer(job: Job, rank: int) -> Any:
    pl = PYTORCH[job.family]
    call = importlib.import_module(f"{pl}.trainer.call")
    states = importlib.import_module(f"{pl}.trainer.states")
    apply_func = importlib.import_module(f"{FABRIC[job.family]}.utilities.apply_func")
    trainer = job.trainer
    _PARTIAL.clear()
    if job.progress:
        _replace_progress_bar(trainer, job.family)
    recorder = None
    if getattr(job.fn, "__name__", "") == "_predict_impl":
        recorder = _prediction_recorder(job.family)()
        trainer.callbacks.append(recorder)
    try:
        results = job.fn(*job.args, **job.kwargs)
    except BaseException as exc:
        # What Lightning's _call_and_handle_interrupt does in the main process: on_exception hooks, loggers
        # finalized as "failed", the strategy torn down (never the process group). KeyboardInterrupt included:
        # Lightning's own handler would ignore SIGINT and sys.exit() the rank.
        with contextlib.suppress(Exception):
            call._interrupt(trainer, exc)
        with contextlib.suppress(Exception):
            trainer._teardown()
        trainer.state.stage = None
        if rank == 0:
            with contextlib.suppress(Exception):
                _PARTIAL[0] = _partial_output(trainer, job.family, states, apply_func)
        raise
    finally:
        if recorder is not None:
            with contextlib.suppress(ValueError):
                trainer.callbacks.remove(recorder)
    module = trainer.lightning_module
    fitting = trainer.state.fn == states.TrainerFn.FITTING
    # Every rank computes the state dict (torchmetrics Metrics in the module may sync in state_dict()).
    weights = module.state_dict() if (fitting and module is not None) else None
    predictions = None
    if recorder is not None:
        predictions = PredictOutput(apply_func.move_data_to_device(results, "cpu"), recorder.indices,
                                    int(getattr(trainer.predict_loop, "num_dataloaders", 1) or 1))
        if rank != 0:
            return predictions
    elif rank != 0:
        return None
    if weights is not None:
        weights = {k: v.detach().cpu() for k, v in weights.items()}
    return WorkerOutput(
        trainer_state=trainer.state,
        weights=weights,
        loops=_loop_states(trainer),
        callbacks=_callback_states(trainer, job.family),
        metrics=_metrics(trainer, apply_func),
        logger_versions=[getattr(lg, "_version", None) for lg in trainer.loggers],
        logger_runs=_logger_runs(trainer),
        results=None if recorder is not None else apply_func.move_data_to_device(results, "cpu"),
        predictions=predictions,
    )


_PARTIAL: dict[int, WorkerOutput] = {}  # 0 -> rank 0's output of its last job, when that job raised


def _partial_output(trainer: Any, family: str, states: Any, apply_func: Any) -> WorkerOutput:
    """What rank 0 had when its job raised (an interrupt, an error here or on a peer): the counters, metrics and
    callback states a local Trainer would hold, and the weights trained so far. The weights are read from the
    parameters and buffers themselves, not ``state_dict()``: its hooks may sync (torchmetrics) with peers that
    are gone."""
    module = trainer.lightning_module
    weights = None
    if module is not None and trainer.state.fn == states.TrainerFn.FITTING:
        weights = {name: t.detach().cpu().clone() for name, t in
                   [*module.named_parameters(), *module.named_buffers()]}
    return WorkerOutput(trainer_state=trainer.state, weights=weights, loops=_loop_states(trainer),
                        callbacks=_callback_states(trainer, family), metrics=_metrics(trainer, apply_func),
                        logger_versions=[getattr(lg, "_version", None) for lg in trainer.loggers],
                        logger_runs=_logger_runs(trainer), results=None)


def take_partial() -> WorkerOutput | None:
    """Rank 0's output of its last job if that job raised (then forgotten), else None. The notebook asks for it
    after a failed or interrupted fit, so that its Trainer's counters are true (as after a local fit)."""
    return _PARTIAL.pop(0, None)


def _loop_states(trainer: Any) -> dict:
    out = {}
    for name in ("fit_loop", "validate_loop", "test_loop", "predict_loop"):
        loop = getattr(trainer, name, None)
        if loop is not None:
            with contextlib.suppress(Exception):
                out[name] = loop.state_dict()
    return out


def _callback_states(trainer: Any, family: str) -> dict:
    progress_bar = importlib.import_module(f"{PYTORCH[family]}.callbacks.progress.progress_bar")
    out = {}
    for cb in trainer.callbacks:
        if isinstance(cb, progress_bar.ProgressBar):
            continue
        with contextlib.suppress(Exception):
            out[cb.state_key] = cb.state_dict()
    return out


def _metrics(trainer: Any, apply_func: Any) -> dict:
    def cpu(d: Any) -> dict:
        return apply_func.move_data_to_device(dict(d), "cpu")

    return {"callback": cpu(trainer.callback_metrics), "logged": cpu(trainer.logged_metrics),
            "progress_bar": cpu(trainer.progress_bar_metrics)}


# ----------------------------------------------------------------------------------------------------- progress

_BAR_CLASSES: dict[str, type] = {}
_RECORDER_CLASSES: dict[str, type] = {}


def _replace_progress_bar(trainer: Any, family: str) -> None:
    """Swap Lightning's text progress bars (tqdm, rich) for one that reports to the mesh's live view."""
    pl = PYTORCH[family]
    tqdm_mod = importlib.import_module(f"{pl}.callbacks.progress.tqdm_progress")
    kinds: tuple = (tqdm_mod.TQDMProgressBar,)
    with contextlib.suppress(Exception):
        rich_mod = importlib.import_module(f"{pl}.callbacks.progress.rich_progress")
        kinds += (rich_mod.RichProgressBar,)
    for i, cb in enumerate(trainer.callbacks):
        if isinstance(cb, kinds):
            trainer.callbacks[i] = mesh_progress_bar_class(family)()


def mesh_progress_bar_class(family: str) -> type:
    """The progress bar callback for ranks (a subclass of Lightning's ``ProgressBar`` of ``family``)."""
    cls = _BAR_CLASSES.get(family)
    if cls is not None:
        return cls
    base = importlib.import_module(f"{PYTORCH[family]}.callbacks.progress.progress_bar").ProgressBar
    from monarch_worker.live import progress

    class MeshProgressBar(base):  # type: ignore[misc, valid-type]
        """Reports Lightning's progress through ``monarch_worker.live.progress`` on every rank: a progress row per
        rank in the cell's dashboard, logged ``prog_bar`` metrics as its values. Prints nothing."""

        def __init__(self) -> None:
            super().__init__()
            self._enabled = True
            self._last = 0.0
            self._n = 0  # batches done in this training epoch
            self._m = 0  # batches done in the current evaluation loop

        def disable(self) -> None:  # every rank reports its own row (Lightning disables ranks other than 0)
            pass

        def enable(self) -> None:
            self._enabled = True

        @property
        def is_enabled(self) -> bool:
            return self._enabled

        def _report(self, n: float, total: float, desc: str, trainer: Any, pl_module: Any, force: bool) -> None:
            now = time.monotonic()
            final = total == total and total != float("inf") and n >= total
            if not (force or final) and now - self._last < MIN_REPORT_INTERVAL:
                return  # progress() throttles too; this also spares the metrics' .item() calls
            self._last = now
            try:
                metrics = (self.get_metrics(trainer, pl_module) if trainer.is_global_zero
                           else dict(trainer.progress_bar_metrics))
            except Exception:  # noqa: BLE001 - a metric that cannot be read must not stop training
                metrics = {}
            reserved = ("n", "total", "desc")
            values = {(f"{k}_" if k in reserved else str(k)): v for k, v in metrics.items()}
            total_arg = None if total == float("inf") or total != total else float(total)
            progress(float(n), total_arg, desc=desc, **values)

        def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
            self._report(0, float("nan"), self.sanity_check_description, trainer, pl_module, True)

        def on_train_epoch_start(self, trainer: Any, pl_module: Any) -> None:
            self._report(0, self.total_train_batches, f"Epoch {trainer.current_epoch}", trainer, pl_module, True)

        def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
            self._n = batch_idx + 1
            self._report(self._n, self.total_train_batches, f"Epoch {trainer.current_epoch}", trainer, pl_module,
                         False)

        def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
            self._report(self._n, self.total_train_batches, f"Epoch {trainer.current_epoch}", trainer, pl_module,
                         True)

        def _eval_total(self, name: str) -> float:
            try:
                return float(getattr(self, name))
            except Exception:  # noqa: BLE001 - no dataloader index yet (no batch), or an exotic loader
                return float("nan")

        def _eval_batch(self, name: str, desc: str, trainer: Any, pl_module: Any, batch_idx: int,
                        dataloader_idx: int) -> None:
            self.has_dataloader_changed(dataloader_idx)
            self._m = batch_idx + 1
            self._report(self._m, self._eval_total(name), desc, trainer, pl_module, False)

        def _eval_end(self, name: str, desc: str, trainer: Any, pl_module: Any) -> None:
            self._report(self._m, self._eval_total(name), desc, trainer, pl_module, True)
            self.reset_dataloader_idx_tracker()
            self._m = 0

        def on_validation_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                    dataloader_idx: int = 0) -> None:
            desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
            self._eval_batch("total_val_batches_current_dataloader", desc, trainer, pl_module, batch_idx,
                             dataloader_idx)

        def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
            desc = self.sanity_check_description if trainer.sanity_checking else self.validation_description
            self._eval_end("total_val_batches_current_dataloader", desc, trainer, pl_module)

        def on_test_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                              dataloader_idx: int = 0) -> None:
            self._eval_batch("total_test_batches_current_dataloader", self.test_description, trainer, pl_module,
                             batch_idx, dataloader_idx)

        def on_test_end(self, trainer: Any, pl_module: Any) -> None:
            self._eval_end("total_test_batches_current_dataloader", self.test_description, trainer, pl_module)

        def on_predict_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int,
                                 dataloader_idx: int = 0) -> None:
            self._eval_batch("total_predict_batches_current_dataloader", self.predict_description, trainer,
                             pl_module, batch_idx, dataloader_idx)

        def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
            self._eval_end("total_predict_batches_current_dataloader", self.predict_description, trainer, pl_module)

    MeshProgressBar.__qualname__ = "MeshProgressBar"
    _BAR_CLASSES[family] = MeshProgressBar
    return MeshProgressBar


def _prediction_recorder(family: str) -> type:
    """A prediction writer that records the dataset indices of every batch (Lightning tracks them for writers)."""
    cls = _RECORDER_CLASSES.get(family)
    if cls is not None:
        return cls
    base = importlib.import_module(f"{PYTORCH[family]}.callbacks.prediction_writer").BasePredictionWriter

    class IndexRecorder(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__(write_interval="batch")
            self.indices: dict[int, list] = {}

        def write_on_batch_end(self, trainer: Any, pl_module: Any, prediction: Any, batch_indices: Any, batch: Any,
                               batch_idx: int, dataloader_idx: int = 0) -> None:
            self.indices.setdefault(dataloader_idx, []).append(list(batch_indices or []))

    _RECORDER_CLASSES[family] = IndexRecorder
    return IndexRecorder
