"""What one host can carry of local ranks: checked before a local mesh starts anything.

A local rank is a process forked from the fork server, idle at about ``IDLE_RANK_BYTES`` of private memory, and its
process group connects every rank with every other (gloo opens a full mesh: the connections, and the rendezvous
through one TCPStore, grow with the square of the world size). Far more ranks than cores, or more than memory or
file descriptors allow, does not fail fast: on 2 cores, ``%mesh start -n 1000`` ran 70 s at a load average of 116
and printed about 15,000 lines of C++ traces before the start timeout. So a start past these limits is refused with
what to expect, unless asked for (``oversubscribe=True``, ``%mesh start --force``), as Open MPI's ``mpirun`` refuses
more processes than slots without ``--oversubscribe``.

Measured here (2 cores, torch 2.13, gloo): 32 ranks ready in 3.4 s, 64 in 5.5 s, 120 not within 15 s.
"""

from __future__ import annotations

from monarch_worker.hostlimits import host_limits

__all__ = ["host_limits", "check_host_capacity", "check_local_gpus", "host_room", "world_fds_problem",
           "RANKS_PER_CORE", "IDLE_RANK_BYTES", "FDS_PER_PEER"]

RANKS_PER_CORE = 32
"""Local ranks per CPU core this process may use before a start is refused (64 on 2 cores starts in 5.5 s)."""
IDLE_RANK_BYTES = 16 << 20
"""Private memory of an idle rank, in bytes (measured: 7-8 MiB dirty after the fork; twice that, for headroom)."""
FDS_PER_PEER = 2
"""File descriptors a rank holds per other rank of its process group (gloo's pairs), for the limit check."""
_FDS_BASE = 64  # a rank's own: pipes, sockets, shared libraries


def check_host_capacity(nproc: int, limits: tuple[int, int, int] | None = None, scaling: bool = False) -> None:
    """Refuse ``nproc`` local ranks that this host cannot carry (see the module docstring).

    ``limits``: (cores, available memory in bytes, open-file limit), default ``host_limits()``; ``scaling``: the
    ranks come from ``%mesh scale`` (the way out is then another size, or a mesh started with ``--force``).

    Raises
    ------
    ValueError
        More than ``RANKS_PER_CORE`` ranks per core, idle ranks that need more memory than is available, or more
        file descriptors per rank than the open-file limit; the message says what to expect and the way out.
    """
    cores, available, files = limits or host_limits()
    problems = []
    if nproc > RANKS_PER_CORE * cores:
        problems.append(f"{nproc} ranks on {cores} CPU {'core' if cores == 1 else 'cores'}, more than "
                        f"{RANKS_PER_CORE} per core (which start in seconds)")
    need = nproc * IDLE_RANK_BYTES
    if available and need > available:
        problems.append(f"about {need / 2**30:.1f} GiB of memory for the idle ranks alone "
                        f"({available / 2**30:.1f} GiB available)")
    fds = _FDS_BASE + FDS_PER_PEER * (nproc - 1)
    if fds > files:
        problems.append(f"about {fds} open files per rank for its process group's connections (the limit is "
                        f"{files}: raise it with  ulimit -n)")
    if problems:
        raise ValueError(
            f"{nproc} ranks on this host are more than it can carry: {'; '.join(problems)}. A start like this takes "
            "minutes (the process group connects every rank with every other) and may fail at the start timeout. "
            + ("Scale to fewer ranks (ranks on other hosts join with  %mesh listen), or scale a mesh started with  "
               "%mesh start --force  (Mesh(..., oversubscribe=True)), which is not held to this."
               if scaling else
               "Start fewer ranks (ranks on other hosts join with  %mesh listen, or with --launcher slurm), or "
               "start anyway with  %mesh start --force  (Mesh(..., oversubscribe=True))."))


def check_local_gpus(nproc: int) -> None:
    """Refuse ``nproc`` local ranks of backend nccl (one CUDA device per rank) beyond this host's CUDA devices.

    Raises
    ------
    ValueError
        Fewer CUDA devices than ``nproc`` (or torch is not importable); the message names the count and the way
        out.
    """
    try:
        import torch
    except ImportError:
        raise ValueError("backend 'nccl' needs torch with CUDA; torch is not importable here") from None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if nproc > n:
        raise ValueError(f"backend 'nccl' needs one GPU per rank: {nproc} ranks but {n} CUDA device(s) visible on "
                         "this host; use --backend gloo or fewer ranks")


def host_room(limits: tuple[int, int, int] | list[int]) -> int | None:
    """How many ranks a host with ``limits`` (cores, available memory in bytes before its ranks started, open-file
    limit; as a host agent measured them) carries by the rules of ``check_host_capacity``: ``RANKS_PER_CORE`` per
    core, ``IDLE_RANK_BYTES`` each; None when ``limits`` is unknown (``[]``: an older agent)."""
    if len(limits) < 2:
        return None
    cores, available = int(limits[0]), int(limits[1])
    room = RANKS_PER_CORE * max(cores, 1)
    if available:
        room = min(room, available // IDLE_RANK_BYTES)
    return room


def world_fds_problem(nproc: int, files: int) -> str:
    """"" when a rank of a process group of ``nproc`` ranks fits the open-file limit ``files``, else why not."""
    fds = _FDS_BASE + FDS_PER_PEER * (nproc - 1)
    if fds > files:
        return (f"about {fds} open files per rank for its process group's connections (the limit is {files}: raise "
                "it with  ulimit -n)")
    return ""
