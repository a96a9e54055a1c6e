"""The environment a rank sees: what torchrun's elastic agent exports to each worker, and the threads it implies.

torchrun (``torch.distributed.run``, its ``LocalElasticAgent``) starts every worker with RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE, ROLE_RANK, ROLE_NAME, ROLE_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT, TORCHELASTIC_RESTART_COUNT, TORCHELASTIC_MAX_RESTARTS, TORCHELASTIC_RUN_ID,
TORCHELASTIC_USE_AGENT_STORE, TORCHELASTIC_ERROR_FILE, TORCHELASTIC_SIGNALS_TO_HANDLE,
TORCH_NCCL_ASYNC_ERROR_HANDLING, and OMP_NUM_THREADS=1 when several workers share the host and the user has not
set it. Frameworks decide how they were launched from these (``torch.distributed.is_torchelastic_launched()`` reads
TORCHELASTIC_RUN_ID; Lightning then picks its TorchElasticEnvironment and checks ``devices`` against WORLD_SIZE),
so every rank of every kind of mesh gets them all, with the values torchrun would give (``apply``):

- ranks started by torchrun itself (``%mesh start --launcher torchrun``, or the printed torchrun command) keep
  what their agent exported;
- local ranks (the fork server), SLURM tasks and ranks started by hand get the same variables from here: the rank
  numbers the controller gave them, the node ("group") of their host, the mesh's run id, restart count 0 (a mesh
  restart is a new run of fresh processes, not an elastic restart) and ``TORCHELASTIC_USE_AGENT_STORE=True``: the
  store at MASTER_ADDR:MASTER_PORT (the mesh's, hosted by rank 0 for the whole generation) is already up, so code
  that rendezvouses with ``env://`` itself connects to it as a client, as under torchrun.

A mesh started with ``torchft=True`` also gives each rank torchft's launcher variables: ``TORCHFT_LIGHTHOUSE``
(the mesh's Lighthouse, in the rank's environment from the start), ``REPLICA_GROUP_ID`` (the rank: one replica group
per rank) and ``NUM_REPLICA_GROUPS`` (the world size).

Threads (``apply_thread_settings``): a rank forked from the fork server inherits the OpenMP/MKL settings torch read
when the fork server imported it, so the rank's own OMP_NUM_THREADS / MKL_NUM_THREADS are applied after the fork
with ``torch.set_num_threads``, as a fresh interpreter would apply them.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Mapping, MutableMapping

__all__ = ["TORCHRUN_VARIABLES", "torchrun_env", "apply", "apply_thread_settings", "cleanup", "SIGNALS_TO_HANDLE"]

#: Every variable torchrun's elastic agent exports to a worker (torch 2.4-2.13), besides OMP_NUM_THREADS.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_NAME", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
                      "TORCHELASTIC_RESTART_COUNT", "TORCHELASTIC_MAX_RESTARTS", "TORCHELASTIC_RUN_ID",
                      "TORCHELASTIC_USE_AGENT_STORE", "TORCHELASTIC_ERROR_FILE", "TORCHELASTIC_SIGNALS_TO_HANDLE",
                      "TORCH_NCCL_ASYNC_ERROR_HANDLING")
#: torchrun's default for TORCHELASTIC_SIGNALS_TO_HANDLE (its --signals-to-handle)
SIGNALS_TO_HANDLE = "SIGTERM,SIGINT,SIGHUP,SIGQUIT"

_error_dir = ""  # the folder of this process's TORCHELASTIC_ERROR_FILE, made here (removed by cleanup)
_error_root = ""  # where those folders are made: the fork server's own folder (keep_error_files_under), else TMPDIR


def keep_error_files_under(folder: str) -> None:
    """Make the error-file folders of ranks forked from now on inside ``folder`` (the fork server's, which it
    removes as it exits): a rank that is SIGKILLed, scaled away or ended with the kernel cannot remove its own."""
    global _error_root
    _error_root = folder


def torchrun_env(*, rank: int, world_size: int, local_rank: int, local_world_size: int, group_rank: int,
                 group_world_size: int, run_id: str, error_file: str, environ: Mapping[str, str]) -> dict[str, str]:
    """The variables torchrun's agent would export to this worker (MASTER_ADDR/MASTER_PORT excepted: the process
    group's rendezvous sets them), given the environment ``environ`` the worker would inherit."""
    env = {
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": str(local_rank),
        "LOCAL_WORLD_SIZE": str(local_world_size),
        "GROUP_RANK": str(group_rank),
        "GROUP_WORLD_SIZE": str(group_world_size),
        "ROLE_RANK": str(rank),  # one role ("default"), so the role's numbers are the world's
        "ROLE_NAME": "default",
        "ROLE_WORLD_SIZE": str(world_size),
        "TORCHELASTIC_RESTART_COUNT": "0",
        "TORCHELASTIC_MAX_RESTARTS": "0",
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        "TORCHELASTIC_ERROR_FILE": error_file,
        "TORCHELASTIC_SIGNALS_TO_HANDLE": environ.get("TORCHELASTIC_SIGNALS_TO_HANDLE", SIGNALS_TO_HANDLE),
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": environ.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1"),
    }
    if local_world_size > 1 and "OMP_NUM_THREADS" not in environ:
        env["OMP_NUM_THREADS"] = "1"  # torchrun: one thread per worker when several share the host
    return env


def apply(*, rank: int, world_size: int, local_rank: int, local_world_size: int, elastic: Mapping[str, object],
          launched_by_torchrun: bool, environ: MutableMapping[str, str] | None = None) -> None:
    """Export torchrun's variables into this rank's environment (``os.environ``) and apply its thread settings.

    ``elastic``: what only the controller knows (``group_rank``, ``group_world_size``, ``run_id``; Welcome's
    field). ``launched_by_torchrun``: this process is a worker of torchrun's agent, whose values stay (only
    the rank numbers, which the controller may have assigned, are set).
    """
    env = os.environ if environ is None else environ
    numbers = {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
               "LOCAL_WORLD_SIZE": str(local_world_size)}
    if launched_by_torchrun:
        env.update(numbers)
    else:
        env.update(torchrun_env(rank=rank, world_size=world_size, local_rank=local_rank,
                                local_world_size=local_world_size,
                                group_rank=int(str(elastic.get("group_rank", 0))),
                                group_world_size=int(str(elastic.get("group_world_size", 1))),
                                run_id=str(elastic.get("run_id", "")) or "none",
                                error_file=_error_file(local_rank), environ=env))
    if "TORCHFT_LIGHTHOUSE" in env:  # a mesh with torchft: each rank is one replica group (monarch_worker.ft)
        env["REPLICA_GROUP_ID"] = str(rank)
        env["NUM_REPLICA_GROUPS"] = str(world_size)
    if env is os.environ:
        apply_thread_settings()


def resized(*, rank: int, world_size: int, local_rank: int, local_world_size: int, group_world_size: int = -1,
            environ: MutableMapping[str, str] | None = None) -> None:
    """After a change of the mesh's membership (``%mesh scale``, a Regroup): the numbers torchelastic's agent
    gives its workers when it restarts them in a new world (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, and
    ROLE_RANK, ROLE_WORLD_SIZE, REPLICA_GROUP_ID, NUM_REPLICA_GROUPS where set; GROUP_WORLD_SIZE when a host came,
    ``group_world_size`` >= 0); the rest (GROUP_RANK, the run id, the error file) is kept. Unchanged numbers leave
    the environment as it was."""
    env = os.environ if environ is None else environ
    env.update({"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local_rank),
                "LOCAL_WORLD_SIZE": str(local_world_size)})
    if group_world_size >= 0:
        env["GROUP_WORLD_SIZE"] = str(group_world_size)
    for key, value in (("ROLE_RANK", rank), ("ROLE_WORLD_SIZE", world_size), ("REPLICA_GROUP_ID", rank),
                       ("NUM_REPLICA_GROUPS", world_size)):
        if key in env:
            env[key] = str(value)


def replicas(groups: int, environ: MutableMapping[str, str] | None = None) -> None:
    """The mesh now has ``groups`` torchft replica groups (``%mesh scale`` under a running torchft loop): set
    NUM_REPLICA_GROUPS where it is set (a torchft mesh); RANK and WORLD_SIZE wait for the next Regroup, which makes
    the default process group of the new size."""
    env = os.environ if environ is None else environ
    if "NUM_REPLICA_GROUPS" in env:
        env["NUM_REPLICA_GROUPS"] = str(groups)


def _error_file(local_rank: int) -> str:
    """A fresh TORCHELASTIC_ERROR_FILE path, laid out as torchrun's (``.../attempt_0/LOCAL_RANK/error.json``):
    ``torch.distributed.elastic.multiprocessing.errors.record`` writes a failing entry point's error there."""
    global _error_dir
    if not _error_dir:
        _error_dir = tempfile.mkdtemp(prefix="torchelastic_", dir=_error_root or None)
    folder = os.path.join(_error_dir, "attempt_0", str(local_rank))
    os.makedirs(folder, exist_ok=True)
    return os.path.join(folder, "error.json")


def cleanup() -> None:
    """Remove the folder of this process's error file (made by ``apply``); at the rank's exit."""
    global _error_dir
    if _error_dir:
        shutil.rmtree(_error_dir, ignore_errors=True)
        _error_dir = ""


def apply_thread_settings() -> None:
    """Give torch the intra-op thread count a fresh interpreter with this environment would have.

    A rank forked from the fork server inherits the OpenMP and MKL settings torch read when the fork server imported
    it, so the OMP_NUM_THREADS / MKL_NUM_THREADS of the rank's own environment (torchrun sets OMP_NUM_THREADS=1
    when several ranks share a host) would have no effect. torch's own rule (ATen's
    ``intraop_default_num_threads``) applies: MKL_NUM_THREADS wins over OMP_NUM_THREADS; with neither set, the
    fork server's default (the same machine, the same default) stands. Inter-op threads need nothing: the fork
    server never started its pool, so each rank sizes it on first use, as a fresh process does.
    """
    value = os.environ.get("MKL_NUM_THREADS") or os.environ.get("OMP_NUM_THREADS")
    if not value:
        return
    try:
        n = int(value)
    except ValueError:
        return  # torch ignores a value it cannot parse; so do we
    if n > 0:
        import torch

        torch.set_num_threads(n)
