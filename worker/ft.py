"""torchft on a mesh: each rank is one replica group, the mesh's Lighthouse forms the quorums.

torchft (``pip install torchft``) expects its launcher to run a Lighthouse, to start every replica group with
``TORCHFT_LIGHTHOUSE``, ``REPLICA_GROUP_ID`` and a c10d store of its own, and to start a lost replica again. A mesh
started with ``torchft=True`` (``%mesh start --torchft``) does all of it: the Lighthouse is a process the mesh owns
(monarch_worker.lighthouse), the variables are in every rank's environment (elastic_env.py), and with
``on_rank_death="restart"`` a rank that dies is started again and rejoins the running cell (kernel/healing.py).

``manager(...)`` makes the rank's ``torchft.Manager`` as one replica group of one process: group rank 0 of 1, the
replica id from ``REPLICA_GROUP_ID``, and a TCPStore this rank hosts for its group (the mesh's own store, hosted by
rank 0, is shared by every rank and would mix their keys). Everything else is torchft's own: its managed process
group, ``Optimizer`` wrapper, and its checkpoint transport, which sends a healthy peer's ``state_dict`` to a
recovering one over HTTP (never through the notebook or a disk).

``DistributedDataParallel`` is torchft's, with one fix: in torchft 0.2.0 its gradient hook asserts that the
allreduce's future exists, which it does not when the allreduce failed because a peer died during it (torchft has
recorded the error and the step will not commit). A rank SIGKILLed at a random moment (the punisher's pattern) lands
in an allreduce most of the time, and the survivors' loops then ended with ``AssertionError`` (``assert fut._fut``
in torchft/ddp.py) in 3 of 3 runs of bench/bench_elastic.py with a kill every 3 s. The hook here returns the
bucket unchanged in that case, as torchft's own ``Manager.allreduce`` documents for a failed allreduce (the step is
discarded by ``should_commit``), and the loop goes on.

::

    from monarch_worker import ft
    from torchft import Optimizer, ProcessGroupGloo
    manager = ft.manager(ProcessGroupGloo(), state_dict=lambda: {"model": model.state_dict(), ...},
                         load_state_dict=lambda sd: ...)
    model, opt = ft.DistributedDataParallel(manager, model), Optimizer(manager, opt)
    while manager.current_step() < 1000:
        ...
        ft.report(manager, 1000, loss=loss)  # the live view: step, quorum, loss
"""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import timedelta
from typing import Any

__all__ = ["manager", "report", "replica_group", "DistributedDataParallel", "FtSetupError", "TIMEOUT"]  # noqa: F822 - made lazily

#: Seconds torchft's Manager gives a collective, a should_commit and a checkpoint transfer (its ``timeout``); the
#: quorum waits up to 10 times this. Short enough that a dead peer on another host costs seconds, not minutes.
TIMEOUT = 30.0

_store: Any = None  # this rank's TCPStore for its replica group, kept for the process's life


class FtSetupError(RuntimeError):
    """torchft cannot run here as the mesh would run it (the message names the fix)."""


def replica_group() -> dict[str, Any]:
    """The keyword arguments that make ``torchft.Manager`` one replica group of this rank alone: ``rank`` 0,
    ``world_size`` 1, ``store_addr``/``store_port`` of a TCPStore this rank hosts (made on the first call, kept),
    ``lighthouse_addr`` and ``replica_id`` (``mesh_rank<REPLICA_GROUP_ID>``).

    Raises FtSetupError when the mesh was not started with ``torchft=True`` (no ``TORCHFT_LIGHTHOUSE``)."""
    global _store
    lighthouse = os.environ.get("TORCHFT_LIGHTHOUSE", "")
    group = os.environ.get("REPLICA_GROUP_ID", "")
    if not lighthouse or not group:
        raise FtSetupError("this rank has no torchft Lighthouse (TORCHFT_LIGHTHOUSE is not set): start the mesh with "
                           "%mesh start --torchft  (Mesh(n, torchft=True)), which runs one and gives every rank its "
                           "address")
    if _store is None:
        import torch.distributed as dist

        addr = os.environ.get("MASTER_ADDR", "127.0.0.1")
        _store = dist.TCPStore(addr, 0, is_master=True, wait_for_workers=False)
    return {"rank": 0, "world_size": 1, "store_addr": os.environ.get("MASTER_ADDR", "127.0.0.1"),
            "store_port": _store.port, "lighthouse_addr": lighthouse, "replica_id": f"mesh_rank{group}"}


def manager(pg: Any = None, *, state_dict: Callable[[], Any], load_state_dict: Callable[[Any], None],
            min_replica_size: int = 1, timeout: float = TIMEOUT, **kwargs: Any) -> Any:
    """This rank's ``torchft.Manager`` (one replica group per rank; see the module docstring).

    Parameters
    ----------
    pg:
        torchft's managed process group (default ``ProcessGroupGloo``: the CPU; pass ``ProcessGroupNCCL()`` on GPUs).
    state_dict, load_state_dict:
        What a recovering rank receives from a healthy peer, and how it loads it (model and optimizer state).
    min_replica_size:
        Replica groups (ranks) a step needs to commit.
    timeout:
        Seconds for collectives, should_commit and checkpoint transfers; the quorum gets 10 times as long.
    kwargs:
        Any other ``torchft.Manager`` argument.

    Raises
    ------
    FtSetupError
        torchft is not installed on the rank, or the mesh runs no Lighthouse.
    """
    try:
        import torchft
    except ImportError as e:
        raise FtSetupError(f"torchft is not importable on this rank ({e}): pip install torchft, then restart the "
                           "mesh") from None
    if pg is None:
        pg = torchft.ProcessGroupGloo(timeout=timedelta(seconds=timeout))
    options = {**replica_group(), "timeout": timedelta(seconds=timeout),
               "quorum_timeout": timedelta(seconds=10 * timeout), "connect_timeout": timedelta(seconds=timeout),
               **kwargs}
    manager = torchft.Manager(pg=pg, state_dict=state_dict, load_state_dict=load_state_dict,
                              min_replica_size=min_replica_size, **options)
    if isinstance(pg, torchft.ProcessGroupGloo):
        _abort_on_error(manager, pg)
    return manager


def _abort_on_error(manager: Any, pg: Any) -> None:
    """Make ``manager`` abort its gloo process group as soon as it records an error (``report_error``).

    A peer SIGKILLed during an allreduce breaks only its neighbours' sockets in gloo's ring; the other survivors
    wait on neighbours that are alive but have given the collective up, and torchft closes their sockets only at
    its next reconfigure. That reconfigure needs a quorum, which (the dead replica's heartbeat still counting for
    ``HEARTBEAT_TIMEOUT_MS``) waits for the stuck survivors or for the replacement: measured on 4 CPU ranks, a
    survivor stuck 1.05 s in the allreduce while its neighbours had failed in 0.02 s. Aborting closes this rank's
    sockets at once, so every peer still in the collective fails at once too (the step is discarded all the same:
    torchft commits no step that recorded an error); the next quorum configures a fresh group, as before."""
    report = manager.report_error

    def report_error(e: Exception) -> None:
        report(e)
        pg.abort()

    manager.report_error = report_error


def report(manager: Any, total: float | None = None, **metrics: Any) -> None:
    """Show where this replica is in the live view (``%%mesh`` dashboard, ``%mesh status``): its committed step of
    ``total`` (None: unknown), the replica groups in its last quorum of the mesh's world
    (``quorum=2/2``; fewer while a peer is dead or healing) and ``metrics`` (``loss=...``), as ``progress()``.
    Call it once per step, after ``optimizer.step()``; throttled as ``progress()`` is, so cheap in a tight loop."""
    from .live import progress

    world = os.environ.get("NUM_REPLICA_GROUPS", "?")
    progress(manager.current_step(), total, desc="torchft", quorum=f"{manager.num_participants()}/{world}",
             **metrics)


def __getattr__(name: str) -> Any:
    """``DistributedDataParallel``: made on first use (it subclasses torchft's, imported only then)."""
    if name == "DistributedDataParallel":
        cls = _ddp_class()
        globals()[name] = cls
        return cls
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _ddp_class() -> type:
    """torchft's DistributedDataParallel whose gradient hook survives an allreduce that failed (module docstring)."""
    import torch
    import torchft

    class DistributedDataParallel(torchft.DistributedDataParallel):
        """torchft's ``DistributedDataParallel(manager, module)``; an allreduce that fails because a peer died
        leaves the gradients as they are (the step is not committed) instead of raising AssertionError."""

        @staticmethod
        def _comm_hook(state: Any, bucket: Any) -> Any:
            work = state.allreduce(bucket.buffer())
            work.wait()
            fut = work.get_future()
            inner = getattr(fut, "_fut", None)
            if inner is not None:
                return inner
            if type(fut) is torch.futures.Future:  # a _DummyWork's (set): the manager had errored already
                return fut
            # The allreduce failed (a peer died): torchft's managed future (a Future subclass) is never completed
            # then, and DDP's reducer would wait for it forever inside backward (measured: a survivor hung there).
            done: torch.futures.Future = torch.futures.Future()
            done.set_result(bucket.buffer())  # torchft recorded the error: should_commit discards this step
            return done

    # torch checks a hook's annotations as objects (this module's are strings: ``from __future__ import annotations``)
    DistributedDataParallel._comm_hook.__annotations__ = {
        "state": object, "bucket": torch.distributed.GradBucket, "return": torch.futures.Future[torch.Tensor]}
    return DistributedDataParallel
