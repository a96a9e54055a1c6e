"""``python -m monarch_worker``: a rank that joins a listening controller, started by any launcher.

The launcher stays in charge of placement: torchrun, srun, mpirun or a Kubernetes Job starts this module on
each host, and the rank takes its number and the process group's size from the launcher's environment. It
reads everything it needs from the environment, never from its command line (a secret on a command line is
visible to every user of the host in ``ps``).

Environment
-----------
MONARCH_CONTROLLER       ``tcp://HOST:PORT`` of the controller (``%mesh listen`` prints it). Required.
MONARCH_SECRET_FILE      A file (mode 0600) holding the per-mesh secret, hex.      } one of the two
MONARCH_SECRET           The secret itself (removed from the environment once read). }
MONARCH_CURVE_SERVERKEY  The controller's CurveZMQ public key (Z85) when it encrypts the connection.
MONARCH_JOIN_TIMEOUT     Seconds to wait until the controller admits this rank (default 600).
MONARCH_RELAY_TEE        1 (default): also write the rank's output to this process's stdout/stderr.
MONARCH_PDEATHSIG        1: exit when the parent process (the launcher's agent) dies.

Rank numbers, in this order of precedence (one launcher's variables are never mixed with another's):
torchrun or by hand (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE), SLURM's srun (SLURM_PROCID,
SLURM_NTASKS, SLURM_LOCALID, SLURM_STEP_TASKS_PER_NODE), Open MPI (OMPI_COMM_WORLD_*). Without any of them
the controller numbers the ranks, grouped by host. With MASTER_ADDR and MASTER_PORT set (torchrun sets them)
the process group uses the launcher's rendezvous (``env://``); otherwise rank 0 hosts a c10d store on its
address toward the controller and the controller tells the other ranks where it is.
"""

from __future__ import annotations

import ctypes
import os
import re
import signal
import socket
import stat
import sys
from collections.abc import Mapping
from urllib.parse import urlsplit

from .addresses import address_toward, interface_of
from .config import RankConfig

__all__ = ["config_from_env", "address_toward", "interface_of", "launcher_ranks", "main", "JoinConfigError",
           "default_gloo_interface", "exit_with_parent", "read_secret"]

ENV_CONTROLLER = "MONARCH_CONTROLLER"
ENV_SECRET_FILE = "MONARCH_SECRET_FILE"
ENV_SECRET = "MONARCH_SECRET"
ENV_CURVE_SERVERKEY = "MONARCH_CURVE_SERVERKEY"
ENV_JOIN_TIMEOUT = "MONARCH_JOIN_TIMEOUT"
ENV_RELAY_TEE = "MONARCH_RELAY_TEE"
ENV_PDEATHSIG = "MONARCH_PDEATHSIG"

DEFAULT_JOIN_TIMEOUT = 600.0

# (rank, world size, local rank, local world size) variables of each launcher, in order of precedence.
LAUNCHERS = (
    ("torchrun", ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")),
    ("slurm", ("SLURM_PROCID", "SLURM_NTASKS", "SLURM_LOCALID", None)),
    ("openmpi", ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK",
                 "OMPI_COMM_WORLD_LOCAL_SIZE")),
)

# Variables reported to the controller (shown in status and used to cancel a SLURM step).
REPORTED = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "GROUP_RANK", "SLURM_JOB_ID", "SLURM_STEP_ID",
            "SLURM_NODEID", "SLURMD_NODENAME", "HOSTNAME")


class JoinConfigError(ValueError):
    """The environment does not say how to join (the message names the variable and the fix)."""


def read_secret(environ: Mapping[str, str]) -> str:
    """The per-mesh secret (hex) from MONARCH_SECRET_FILE or MONARCH_SECRET.

    Raises
    ------
    JoinConfigError
        Neither is set, the file cannot be read, or the secret is not at least 16 bytes of hex.
    """
    path = environ.get(ENV_SECRET_FILE)
    if path:
        try:
            with open(path) as f:
                secret = f.read().strip()
            mode = os.stat(path).st_mode
        except OSError as e:
            raise JoinConfigError(f"cannot read {ENV_SECRET_FILE}={path}: {e.strerror}; the file must exist on this "
                                  f"host (a shared filesystem), or pass the secret in {ENV_SECRET} instead") from None
        if mode & (stat.S_IRWXG | stat.S_IRWXO):
            sys.stderr.write(f"monarch_worker: warning: {path} is readable by other users; chmod 600 it\n")
    elif environ.get(ENV_SECRET):
        secret = environ[ENV_SECRET].strip()
    else:
        raise JoinConfigError(f"no secret: set {ENV_SECRET_FILE} to the key file that `%mesh listen` wrote "
                              f"(or {ENV_SECRET} to its content); never pass it on a command line")
    if not re.fullmatch(r"[0-9a-fA-F]{32,}", secret):
        raise JoinConfigError(f"the mesh secret must be at least 32 hex digits (16 bytes); check {ENV_SECRET_FILE}"
                              f" / {ENV_SECRET}")
    return secret.lower()


def launcher_ranks(environ: Mapping[str, str]) -> tuple[str, int, int, int, int]:
    """(launcher, rank, world size, local rank, local world size) from the launcher's variables; -1 where unknown.

    Raises JoinConfigError for a variable that is not a number.
    """
    for name, keys in LAUNCHERS:
        if keys[0] in environ:
            values = [_int(environ, k) if k else -1 for k in keys]
            if name == "slurm":
                values[3] = _slurm_local_world_size(environ)
            return (name, *values)  # type: ignore[return-value]
    return ("none", -1, -1, -1, -1)


def _int(environ: Mapping[str, str], key: str) -> int:
    value = environ.get(key)
    if value is None or value == "":
        return -1
    try:
        return int(value)
    except ValueError:
        raise JoinConfigError(f"{key}={value!r} is not a number") from None


def _slurm_local_world_size(environ: Mapping[str, str]) -> int:
    """Tasks of this step on this node, from SLURM_STEP_TASKS_PER_NODE ("2(x3),1") and SLURM_NODEID."""
    spec = environ.get("SLURM_STEP_TASKS_PER_NODE") or environ.get("SLURM_TASKS_PER_NODE") or ""
    node = _int(environ, "SLURM_NODEID")
    counts: list[int] = []
    for part in filter(None, spec.split(",")):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part)
        if not m:
            return -1
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts[node] if 0 <= node < len(counts) else -1


def config_from_env(environ: Mapping[str, str]) -> RankConfig:
    """The RankConfig of a joined rank, from the environment (see the module docstring).

    Raises
    ------
    JoinConfigError
        MONARCH_CONTROLLER or the secret is missing or malformed.
    """
    controller = environ.get(ENV_CONTROLLER, "")
    if not controller:
        raise JoinConfigError(f"{ENV_CONTROLLER} is not set: run `%mesh listen --world-size N` in the notebook and "
                              "use the commands it prints")
    url = urlsplit(controller)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise JoinConfigError(f"{ENV_CONTROLLER}={controller!r} is not an address like tcp://10.0.0.1:5555")
    secret = read_secret(environ)
    _, rank, world_size, local_rank, local_world_size = launcher_ranks(environ)
    if world_size == 0 or (world_size > 0 and not 0 <= rank < world_size):
        raise JoinConfigError(f"the launcher says rank {rank} of world size {world_size}")
    try:
        join_timeout = float(environ.get(ENV_JOIN_TIMEOUT) or DEFAULT_JOIN_TIMEOUT)
    except ValueError:
        raise JoinConfigError(f"{ENV_JOIN_TIMEOUT} must be a number of seconds") from None
    reported = {k: environ[k] for k in REPORTED if k in environ}
    if not ("MASTER_ADDR" in reported and "MASTER_PORT" in reported and rank >= 0):
        reported.pop("MASTER_ADDR", None)  # env:// needs all three; without them the controller relays a store
        reported.pop("MASTER_PORT", None)
    return RankConfig(
        controller=controller,
        secret=secret,
        rank=rank,
        world_size=world_size,
        local_rank=local_rank,
        local_world_size=local_world_size,
        join_timeout=join_timeout,
        relay_output=True,
        relay_tee=environ.get(ENV_RELAY_TEE, "1") != "0",
        curve_serverkey=environ.get(ENV_CURVE_SERVERKEY, ""),
        launcher_env=reported,
    )


def default_gloo_interface(controller: str) -> None:
    """gloo binds to the address of this host's name; where that is loopback (Debian's 127.0.1.1) or unknown,
    ranks on other hosts could not reach it: use the interface toward the controller instead."""
    if "GLOO_SOCKET_IFNAME" in os.environ:
        return
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)}
    except OSError:
        addrs = set()
    if addrs and not all(str(a).startswith("127.") for a in addrs):
        return
    try:
        name = interface_of(address_toward(controller))
    except OSError:
        return
    if name:
        os.environ["GLOO_SOCKET_IFNAME"] = name


def exit_with_parent() -> None:
    """Linux: SIGKILL this process when its parent (the launcher's agent) dies, so no rank outlives it."""
    parent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL, 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


USAGE = __doc__.split("Environment\n-----------\n", 1)[1]


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``python -m monarch_worker``; returns the exit code."""
    args = sys.argv[1:] if argv is None else argv
    if args in (["-h"], ["--help"]):
        print("python -m monarch_worker: join a listening monarch_jupyter controller as one rank.\n\n" + USAGE)
        return 0
    if args:
        sys.stderr.write("monarch_worker takes no arguments (a secret on a command line would show in `ps`); it "
                         "reads the environment:\n\n" + USAGE)
        return 2
    try:
        config = config_from_env(os.environ)
    except JoinConfigError as e:
        sys.stderr.write(f"monarch_worker: {e}\n")
        return 2
    os.environ.pop(ENV_SECRET, None)  # user code and its subprocesses need not see it
    if os.environ.get(ENV_PDEATHSIG) == "1":
        exit_with_parent()
    if config.local_world_size > 1:  # as torchrun: N ranks on a host do not oversubscribe it (set before any
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # library reads it; unknown here: set when admitted)
    default_gloo_interface(config.controller)
    from .startup import run_rank

    return run_rank(config)
