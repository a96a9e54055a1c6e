"""Launchers: who starts the ranks of a mesh. One class per engine, one place that chooses among them.

- ``local`` (launch/local.py): the fork server on this host forks every rank (the default).
- ``join`` (launch/join.py): nobody here starts them; ``%mesh listen`` prints the torchrun, sbatch and plain
  commands that do, and the ranks join (admitted by launch/listener.py).
- ``torchrun`` (launch/torchrun.py): torchrun's elastic agent on this host.
- ``agent`` (launch/torchrun.py): one host agent on this host, without torchrun (the controller pays per host).
- ``slurm`` (launch/slurm.py): srun inside a SLURM allocation.
"""

from __future__ import annotations

from typing import Any

from .base import Launcher, LauncherEvents, LaunchError, WorkPipe
from .join import JoinCommands, JoinLauncher, ProcessLauncher
from .slurm import SlurmLauncher
from .torchrun import AgentLauncher, TorchrunLauncher

__all__ = ["Launcher", "LauncherEvents", "LaunchError", "WorkPipe", "JoinLauncher", "ProcessLauncher",
           "JoinCommands", "TorchrunLauncher", "AgentLauncher", "SlurmLauncher", "LAUNCHERS", "launcher_for"]

LAUNCHERS = ("local", "join", "torchrun", "agent", "slurm")


def launcher_for(spec: Any, world_size: int, *, nproc_per_node: int | None = None, nnodes: int = 1,
                 nodes: int | None = None, srun_args: str = "") -> JoinLauncher | None:
    """The launcher for ``Mesh(launcher=spec)`` and ``%mesh start --launcher``: None for "local" (the fork
    server), a new launcher for "join", "torchrun", "agent" or "slurm", or ``spec`` itself when it is a JoinLauncher.

    ``nproc_per_node`` (torchrun, slurm: ranks per node), ``nnodes`` (torchrun: must be 1), ``nodes`` and
    ``srun_args`` (slurm) configure the engine.

    Raises
    ------
    ValueError
        An unknown ``spec``, or options that do not fit it (the message says which).
    """
    if isinstance(spec, JoinLauncher):
        return spec
    engine_options = (nproc_per_node, nnodes, nodes, srun_args) != (None, 1, None, "")
    if spec == "local":
        if engine_options:
            raise ValueError("--nodes/--srun-args/--nnodes/--nproc-per-node are for --launcher torchrun, agent or "
                             "slurm (local ranks use the fork server)")
        return None
    if spec == "join":
        return JoinLauncher(nproc_per_node)
    if spec == "torchrun":
        if nodes is not None or srun_args:
            raise ValueError("--nodes and --srun-args are for --launcher slurm")
        return _one_host(TorchrunLauncher(world_size, nnodes), nproc_per_node, world_size)
    if spec == "agent":
        if nodes is not None or srun_args or nnodes != 1:
            raise ValueError("--launcher agent starts one host agent on this host: --nodes, --srun-args and --nnodes "
                             "are for --launcher slurm or torchrun")
        return _one_host(AgentLauncher(world_size), nproc_per_node, world_size)
    if spec == "slurm":
        if nnodes != 1:
            raise ValueError("--nnodes is for --launcher torchrun; with slurm use --nodes")
        return SlurmLauncher(nodes, srun_args, nproc_per_node)
    raise ValueError(f"launcher must be one of {', '.join(LAUNCHERS)} or a JoinLauncher object, got {spec!r}")


def _one_host(launcher: JoinLauncher, nproc_per_node: int | None, world_size: int) -> JoinLauncher:
    """``launcher`` (torchrun, agent: every rank on this host), once ``--nproc-per-node`` is checked against it."""
    if nproc_per_node not in (None, world_size):
        raise ValueError(f"--nproc-per-node {nproc_per_node} differs from the world size {world_size} (-n): "
                         f"--launcher {launcher.name} starts every rank on this host; leave --nproc-per-node out")
    return launcher
