"""What a host agent is told: its configuration from the environment and command line (``AgentConfig``), and the
environment it gives each of its ranks (``rank_environment``). monarch_worker.agent documents the agent."""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from dataclasses import dataclass

from . import join
from .join import JoinConfigError

__all__ = ["AgentConfig", "agent_config", "rank_environment", "ENV_NPROC"]

ENV_NPROC = "MONARCH_NPROC_PER_NODE"


@dataclass(frozen=True)
class AgentConfig:
    """What an agent needs, from its environment and arguments. Times in seconds."""

    controller: str
    secret: str
    nproc: int
    launcher: str  # "torchrun", "slurm", "openmpi" or "none": whose variables number this host
    group_rank: int
    group_world_size: int
    launcher_env: dict
    join_timeout: float
    tee: bool
    curve_serverkey: str = ""


def agent_config(environ: Mapping[str, str], argv: list[str]) -> AgentConfig:
    """The AgentConfig from ``environ`` and the command line (``--nproc-per-node N``).

    Raises
    ------
    JoinConfigError
        A variable is missing or malformed, no rank count was given, or the launcher started several agents on
        one host (the message names the fix).
    """
    parser = argparse.ArgumentParser(prog="python -m monarch_worker.agent", add_help=False)
    parser.add_argument("--nproc-per-node", type=int, default=None)
    try:
        args, extra = parser.parse_known_args(argv)
    except SystemExit:
        raise JoinConfigError("--nproc-per-node takes a number of ranks") from None
    if extra:
        raise JoinConfigError(f"unknown arguments {' '.join(extra)}: the agent takes --nproc-per-node N only (a "
                              "secret on a command line would show in `ps`; it reads the environment)")
    base = join.config_from_env(environ)
    nproc = args.nproc_per_node
    if nproc is None and environ.get(ENV_NPROC):
        try:
            nproc = int(environ[ENV_NPROC])
        except ValueError:
            raise JoinConfigError(f"{ENV_NPROC}={environ[ENV_NPROC]!r} is not a number") from None
    if nproc is None or nproc < 1:
        raise JoinConfigError(f"how many ranks on this host? pass --nproc-per-node N (or set {ENV_NPROC})")
    launcher, rank, world, local_rank, local_world = join.launcher_ranks(environ)
    group_rank, group_world = -1, -1
    if launcher == "torchrun":
        if local_world > 1 or local_rank > 0:
            raise JoinConfigError(f"torchrun started {local_world} agents on this host: run one agent per host, "
                                  f"`torchrun --nproc-per-node 1 ... -m monarch_worker.agent --nproc-per-node N`")
        group_rank = _int(environ, "GROUP_RANK", rank)
        group_world = _int(environ, "GROUP_WORLD_SIZE", world)
    elif launcher == "slurm":
        if local_rank > 0 or (local_world > 1):
            raise JoinConfigError("srun started several agents on this host: run one per host, `srun "
                                  "--ntasks-per-node 1 python -m monarch_worker.agent --nproc-per-node N`")
        group_rank = _int(environ, "SLURM_NODEID", rank)
        group_world = _int(environ, "SLURM_STEP_NUM_NODES", _int(environ, "SLURM_NNODES", world))
    elif launcher == "openmpi":
        group_rank, group_world = rank, world
    return AgentConfig(controller=base.controller, secret=base.secret, nproc=nproc, launcher=launcher,
                       group_rank=group_rank, group_world_size=group_world, launcher_env=dict(base.launcher_env),
                       join_timeout=base.join_timeout, tee=base.relay_tee, curve_serverkey=base.curve_serverkey)


def _int(environ: Mapping[str, str], key: str, default: int) -> int:
    try:
        return int(environ[key])
    except (KeyError, ValueError):
        return default


def rank_environment(base: Mapping[str, str], launcher: str, ranks: list[int], local_rank: int, world_size: int,
                     group_rank: int, group_world_size: int) -> dict[str, str]:
    """The environment of local rank ``local_rank`` of this host (global ranks ``ranks``): the agent's, with the
    launcher's variables as that launcher gives them with ``len(ranks)`` ranks per host."""
    env = dict(base)
    env.pop(join.ENV_SECRET, None)
    nproc, rank = len(ranks), ranks[local_rank]
    if launcher == "torchrun":
        env.update({"RANK": str(rank), "LOCAL_RANK": str(local_rank), "WORLD_SIZE": str(world_size),
                    "LOCAL_WORLD_SIZE": str(nproc), "ROLE_RANK": str(rank), "ROLE_WORLD_SIZE": str(world_size),
                    "GROUP_RANK": str(group_rank), "GROUP_WORLD_SIZE": str(group_world_size)})
        error_file = env.get("TORCHELASTIC_ERROR_FILE", "")
        if error_file.endswith("/0/error.json"):  # torchrun's per-worker file: one folder per local rank
            folder = f"{error_file[:-len('/0/error.json')]}/{local_rank}"
            env["TORCHELASTIC_ERROR_FILE"] = f"{folder}/error.json"
    elif launcher == "slurm":
        per_node = f"{nproc}(x{group_world_size})" if group_world_size > 1 else str(nproc)
        env.update({"SLURM_PROCID": str(rank), "SLURM_LOCALID": str(local_rank), "SLURM_NTASKS": str(world_size),
                    "SLURM_NPROCS": str(world_size), "SLURM_STEP_NUM_TASKS": str(world_size),
                    "SLURM_TASKS_PER_NODE": per_node, "SLURM_STEP_TASKS_PER_NODE": per_node,
                    "SLURM_GTIDS": ",".join(map(str, ranks))})
    elif launcher == "openmpi":
        env.update({"OMPI_COMM_WORLD_RANK": str(rank), "OMPI_COMM_WORLD_SIZE": str(world_size),
                    "OMPI_COMM_WORLD_LOCAL_RANK": str(local_rank), "OMPI_COMM_WORLD_LOCAL_SIZE": str(nproc)})
    if nproc > 1:
        env.setdefault("OMP_NUM_THREADS", "1")  # as torchrun: N ranks on a host do not oversubscribe it
    return env
