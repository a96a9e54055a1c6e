"""What a rank needs to join a mesh (``RankConfig``), sent by its launcher, never on a command line.

The settings a mesh's options decide (backend, timeouts, environment) take their defaults from the one declaration
of the options (``monarch_worker.options``); the controller sends their values (``options.rank_settings``) with
the spawn request of a local rank, or in ``Welcome.settings`` to a rank that joined.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .options import DEFAULTS

__all__ = ["RankConfig"]


@dataclass(frozen=True)
class RankConfig:
    """What a rank needs to join a mesh. Times are in seconds."""

    controller: str  # ZeroMQ address of the controller's ROUTER socket, e.g. "tcp://127.0.0.1:5555"
    secret: str  # per-mesh secret, hex
    rank: int = -1
    world_size: int = -1
    local_rank: int = -1
    local_world_size: int = -1
    backend: str = DEFAULTS.backend  # "auto", "gloo" or "nccl"
    join_timeout: float = DEFAULTS.start_timeout  # the mesh's start_timeout
    pg_timeout: float = DEFAULTS.pg_timeout  # torch.distributed collective timeout
    heartbeat_interval: float = DEFAULTS.heartbeat_interval
    heartbeat_timeout: float = DEFAULTS.heartbeat_timeout  # exit when the controller is silent this long
    relay_output: bool = False  # True: this process sends its own stdout/stderr (no kernel reads its pipes)
    relay_tee: bool = False  # with relay_output: also copy the output to this process's original fds 1 and 2
    output_records: bool = False  # fd 1 is a pipe the kernel reads: the main thread reports in records there
    work_fd: int = -1  # the read end of the kernel's work pipe (protocol.WORK_FD), or -1: work comes by socket
    env: dict = field(default_factory=dict)
    curve_serverkey: str = ""  # the controller's CurveZMQ public key (Z85) when it encrypts; "" for plain TCP
    connect: str = ""  # where the socket connects instead of ``controller``: the host agent's (ipc://@...)
    launcher_env: dict = field(default_factory=dict)  # what the launcher told this rank (sent in Hello)
