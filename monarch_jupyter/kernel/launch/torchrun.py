"""Ranks on this host behind one host agent: under torchrun's elastic agent (``%mesh start --launcher torchrun``), or
the agent alone (``%mesh start --launcher agent``).

torchrun (``python -m torch.distributed.run --standalone``) starts one host agent (``python -m monarch_worker.agent``),
which forks the ranks from one import of torch and speaks for them over one connection (launch/hosts.py); they get
torchrun's variables as torchrun would give N workers, and its store for their rendezvous. For ranks on several
hosts, run the torchrun command that ``%mesh listen`` prints on each host.

``--launcher agent`` starts the same host agent without torchrun: the layout of each host of a larger mesh, on this
host. The controller then pays per host, not per rank (docs/scale.md, "Per-cell cost"): at 32 ranks a trivial cell
costs it about a third of what 32 forked local ranks cost. Its fork server is a clone of the kernel's
(monarch_worker.forkserver, "Clones"): torch is imported already, so the start costs about what a local mesh's does.
"""

from __future__ import annotations

import shlex
import sys
from typing import Any

from monarch_worker import join as wjoin
from monarch_worker.hostlink import ENV_FORK_SERVER_FD

from .join import JoinCommands, ProcessLauncher
from .local import fork_server_clone

__all__ = ["TorchrunLauncher", "AgentLauncher"]


class TorchrunLauncher(ProcessLauncher):
    """torchrun on this host, one agent for the whole mesh.

    Parameters
    ----------
    nproc_per_node:
        Ranks at the start: the mesh's world size (``launcher_for`` refuses any other number, since there is one
        node); a restart after ``%mesh scale`` starts the new world size.
    nnodes:
        Must be 1: torchrun started from the notebook runs on the notebook's host.
    torchrun_args:
        Extra torchrun arguments, e.g. ``"--log-dir /tmp/tr"``.

    Raises
    ------
    ValueError
        ``nnodes`` is not 1.
    """

    name = "torchrun"
    on_this_host = True

    def __init__(self, nproc_per_node: int | None = None, nnodes: int = 1, torchrun_args: str = "") -> None:
        if nnodes != 1:
            raise ValueError(f"--launcher torchrun runs torchrun on this host only (--nnodes 1), got --nnodes "
                             f"{nnodes}; for ranks on several hosts run  %mesh listen  and the torchrun command it "
                             "prints on each host, or use --launcher slurm inside an allocation")
        super().__init__(nproc_per_node)
        self.torchrun_args = torchrun_args

    def ranks_per_host(self, world_size: int) -> int:
        """One node: every rank, at every start (also a restart after ``%mesh scale``)."""
        return world_size

    def command(self, commands: JoinCommands) -> list[str]:
        world = commands.world_size
        # One host agent (it forks the ranks from one import of torch), as on every host of a larger mesh.
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nnodes", "1",
                "--nproc-per-node", "1", "--max-restarts", "0", *shlex.split(self.torchrun_args),
                "-m", "monarch_worker.agent", "--nproc-per-node", str(world)]

    def extra_env(self) -> dict[str, str]:
        return {wjoin.ENV_PDEATHSIG: "1"}  # the host agent (and its ranks) go with torchrun, even on SIGKILL


class AgentLauncher(ProcessLauncher):
    """One host agent (``python -m monarch_worker.agent``) on this host, started by the controller, forks every rank.

    The ranks get the variables of ranks started by hand (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE; the
    process group's store is rank 0's, as in docs/multihost.md), restarts and ``%mesh scale`` go through the agent,
    and the agent and its ranks die with the kernel (``MONARCH_PDEATHSIG``).
    """

    name = "agent"
    on_this_host = True

    def ranks_per_host(self, world_size: int) -> int:
        """One host: every rank, at every start (also a restart after ``%mesh scale``)."""
        return world_size

    def command(self, commands: JoinCommands) -> list[str]:
        world = commands.world_size
        return [sys.executable, "-m", "monarch_worker.agent", "--nproc-per-node", str(world)]

    def launch(self, commands: JoinCommands, env: dict[str, str], secret: str, sink: Any) -> None:
        """Start the agent with a clone of the kernel's fork server (torch imported) as its fork server; without
        one (the kernel's cannot be reached) the agent starts its own."""
        ctl = fork_server_clone()
        if ctl is None:
            super().launch(commands, env, secret, sink)
            return
        self.pass_fds = (ctl.fileno(),)
        try:
            super().launch(commands, {**env, ENV_FORK_SERVER_FD: str(ctl.fileno())}, secret, sink)
        finally:
            self.pass_fds = ()
            ctl.close()  # the agent holds it now: when the agent is gone, the clone gets end of file

    def extra_env(self) -> dict[str, str]:
        return {wjoin.ENV_PDEATHSIG: "1"}  # the host agent (and its ranks) go with the kernel, even on SIGKILL
