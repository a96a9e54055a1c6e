"""Ranks placed by SLURM: ``%mesh start --launcher slurm -n N [--nodes K] [--srun-args "..."]``.

Run from a notebook inside an allocation (``salloc``, an ``sbatch`` job, or a Jupyter server started in one),
this runs ``srun`` as one job step with one task per node, the host agent (``python -m monarch_worker.agent``), which
forks that node's ranks from one import of torch and speaks for them (launch/hosts.py); ranks are numbered by node
(SLURM_NODEID) and see SLURM's variables as srun would give them with one task per rank. The secret travels in
the step's environment (srun propagates it), never on srun's command line. Stop and restart cancel the step with
``scancel JOB.STEP``, so no task outlives the mesh; outside an allocation srun makes its own job, which is
cancelled the same way.
"""

from __future__ import annotations

import logging
import os
import shlex
import shutil
import signal
import subprocess
import sys

from .base import LaunchError
from .join import JoinCommands, ProcessLauncher

log = logging.getLogger(__name__)

__all__ = ["SlurmLauncher"]

SLURM_CMD_TIMEOUT = 15.0  # seconds for squeue / scancel


class SlurmLauncher(ProcessLauncher):
    """srun, one job step for the whole mesh.

    Parameters
    ----------
    nodes:
        ``--nodes`` for srun (default: SLURM's choice within the allocation).
    srun_args:
        Extra srun arguments, e.g. ``"--partition gpu --gpus-per-task 1"`` or ``"--overlap"`` when the
        notebook itself runs as a step that holds the allocation's CPUs.
    ntasks_per_node:
        ``--ntasks-per-node`` for srun.
    srun:
        The srun executable.
    """

    name = "slurm"

    def __init__(self, nodes: int | None = None, srun_args: str = "", ntasks_per_node: int | None = None,
                 srun: str = "srun") -> None:
        if nodes is not None and nodes < 1:
            raise ValueError(f"--nodes must be at least 1, got {nodes}")
        try:
            shlex.split(srun_args)
        except ValueError as e:
            raise ValueError(f"cannot parse --srun-args {srun_args!r}: {e}") from None
        super().__init__(ntasks_per_node)
        self.nodes = nodes
        self.srun_args = srun_args
        self.srun = srun
        self._job_name = ""

    def command(self, commands: JoinCommands) -> list[str]:
        srun = shutil.which(self.srun)
        if srun is None:
            raise LaunchError(f"{self.srun} not found: --launcher slurm needs SLURM's srun on this host (run the "
                              "notebook inside an allocation: salloc, or a Jupyter server started by sbatch)")
        if "SLURM_JOB_ID" not in os.environ:
            log.warning("not inside a SLURM allocation: srun will request one (and wait for it)")
        world = commands.world_size
        nodes = self.node_count(world)
        self._job_name = f"monarch-{commands.rdzv_id.rsplit('-', 1)[-1]}-{os.getpid()}"
        # One task per node: the host agent, which forks that node's ranks (one import of torch per node).
        argv = [srun, f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
                f"--job-name={self._job_name}", *shlex.split(self.srun_args)]
        return [*argv, sys.executable, "-m", "monarch_worker.agent", "--nproc-per-node", str(world // nodes)]

    def node_count(self, world: int) -> int:
        """Nodes of the step: ``nodes``, else the world over ``ntasks_per_node``, else the allocation's nodes that
        divide the world evenly, else 1.

        Raises LaunchError when the ranks do not spread evenly over the nodes asked for."""
        nodes = self.nodes
        if nodes is None and self.nproc_per_node:
            nodes = max(1, world // self.nproc_per_node)
        if nodes is None:
            try:
                alloc = int(os.environ.get("SLURM_JOB_NUM_NODES") or os.environ.get("SLURM_NNODES") or 1)
            except ValueError:
                alloc = 1
            nodes = alloc if alloc >= 1 and world % alloc == 0 else 1
        if world % nodes or (self.nproc_per_node and self.nproc_per_node * nodes != world):
            raise LaunchError(f"{world} ranks do not spread evenly over {nodes} node(s)"
                              + (f" with {self.nproc_per_node} per node" if self.nproc_per_node else "")
                              + ": choose -n, --nodes and --nproc-per-node so that ranks = nodes x ranks per node")
        return nodes

    def step_id(self) -> str:
        """``JOB.STEP`` of the ranks (from what they reported, else from squeue by name), or "" if unknown."""
        for info in self.placement().values():
            env = info["launcher_env"]
            if "SLURM_JOB_ID" in env and "SLURM_STEP_ID" in env:
                return f"{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
        if not self._job_name:
            return ""
        for args in (["-s", "-o", "%i %j"], ["-o", "%i %j"]):  # a step of our allocation, or srun's own job
            out = _run(["squeue", "-h", *args])
            for line in out.splitlines():
                ident, _, name = line.strip().partition(" ")
                if name == self._job_name:
                    return ident
        return ""

    def signal(self, rank: int, sig: int) -> None:
        """``rank`` -1: every task of the step (``scancel --signal``); one rank: only where it is on this host."""
        if rank != -1:
            super().signal(rank, sig)
            return
        step = self.step_id()
        if step:
            _run(["scancel", f"--signal={signal.Signals(sig).name.removeprefix('SIG')}", step])

    def kill(self) -> None:
        """Cancel the step (SLURM signals and reaps every task on every node), then stop srun."""
        if self.proc is not None and self.proc.poll() is None:
            step = self.step_id()
            if step:
                log.info("scancel %s", step)
                _run(["scancel", step])
                try:
                    self.proc.wait(5.0)
                except subprocess.TimeoutExpired:
                    pass
        super().kill()


def _run(argv: list[str]) -> str:
    try:
        res = subprocess.run(argv, capture_output=True, text=True, timeout=SLURM_CMD_TIMEOUT)
    except (OSError, subprocess.TimeoutExpired) as e:
        log.warning("%s failed: %s", shlex.join(argv), e)
        return ""
    if res.returncode != 0:
        log.warning("%s: %s", shlex.join(argv), res.stderr.strip())
    return res.stdout
