"""``python -m monarch_worker.agent``: the host agent, one per host, that forks and speaks for that host's ranks.

A launcher starts one agent per host (``torchrun --nproc-per-node 1 ... -m monarch_worker.agent --nproc-per-node
N``, ``srun --ntasks-per-node 1 ...``, a Kubernetes pod, a shell); ``%mesh listen`` prints the commands. The agent
connects to the controller over one ZeroMQ connection, proves the per-mesh secret, and once admitted forks its
``N`` ranks through a fork server of its own (``monarch_worker.forkserver``, which imports torch once for the whole
host, while the agent says hello). Then it

- gives each rank the work the controller sends once for the whole host (``Forward``): into the rank's work pipe,
  or over the rank's own socket to the agent (interrupts, pings, debugger input); a large push is written once into
  shared memory that every rank of the host maps (monarch_worker.shm);
- reads every rank's stdout and stderr pipes, records included, and sends what happened in ``HostEvents`` batches:
  lines, results (a cell that ended alike on all its ranks is one ``done`` event), messages the ranks sent, exits
  with their status (within one loop turn of the SIGCHLD), and their heartbeats;
- restarts single ranks (``Spawn``), signals them (``Signal``), and ends them all when the controller says so, when
  it goes silent for the heartbeat timeout, when its connection drops, or when the agent itself is stopped. Its
  ranks die with its fork server, which dies with the agent: nothing outlives it.

Ranks keep the variables of the launcher that started the agent, made consistent for N ranks per host: under
torchrun RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, ROLE_RANK, ROLE_WORLD_SIZE (GROUP_RANK, GROUP_WORLD_SIZE,
MASTER_ADDR, MASTER_PORT and the TORCHELASTIC_* variables as the agent got them); under srun SLURM_PROCID,
SLURM_LOCALID, SLURM_NTASKS, SLURM_TASKS_PER_NODE, ...

Environment: as for ``python -m monarch_worker`` (MONARCH_CONTROLLER, MONARCH_SECRET_FILE or MONARCH_SECRET,
MONARCH_CURVE_SERVERKEY, MONARCH_JOIN_TIMEOUT, MONARCH_RELAY_TEE, MONARCH_PDEATHSIG), plus MONARCH_NPROC_PER_NODE
(ranks on this host, when ``--nproc-per-node`` is not given). The host's number comes from its launcher
(torchrun's GROUP_RANK, SLURM_NODEID, OMPI_COMM_WORLD_RANK); without one the controller numbers hosts by name.
"""

from __future__ import annotations

import os
import signal
import socket
import sys

from . import join
from .agentconfig import ENV_NPROC, agent_config
from .hostagent import HostAgent
from .join import JoinConfigError

__all__ = ["main"]

USAGE = """python -m monarch_worker.agent --nproc-per-node N

The host agent of a monarch_jupyter mesh: run it once per host (torchrun --nproc-per-node 1, srun
--ntasks-per-node 1, one pod per host, or by hand); it forks the host's N ranks. `%mesh listen` prints the
commands. It reads the controller's address and the secret from the environment, as python -m monarch_worker does:
""" + join.USAGE + f"""{ENV_NPROC:<25}Ranks on this host, when --nproc-per-node is not given.
"""


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m monarch_worker.agent``; returns the exit code (2: bad configuration or not
    admitted, 3: lost the controller, 1: could not start the ranks)."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print(USAGE)
        return 0
    try:
        cfg = agent_config(os.environ, args)
    except JoinConfigError as e:
        sys.stderr.write(f"monarch agent on {socket.gethostname()}: {e}\n")
        return 2
    os.environ.pop(join.ENV_SECRET, None)
    if os.environ.get(join.ENV_PDEATHSIG) == "1":
        join.exit_with_parent()
    join.default_gloo_interface(cfg.controller)  # before the fork server starts: every rank inherits it
    agent = HostAgent(cfg)
    signal.signal(signal.SIGTERM, agent.on_sigterm)
    signal.signal(signal.SIGINT, agent.on_sigterm)
    return agent.run()


if __name__ == "__main__":
    sys.exit(main())
