"""Launchers of ranks that join (admitted by launch/listener.py), and what a person needs to start them.

``JoinLauncher`` starts nothing: ``%mesh listen`` prints the commands (``JoinCommands``: torchrun, an sbatch
script, plain ``python -m monarch_worker``) for a person or a scheduler to run. ``ProcessLauncher`` is the
base of the engines the controller runs itself (torchrun.TorchrunLauncher, slurm.SlurmLauncher): one process
for the whole world, its log kept in a file, its exit reported as the exit of every rank still running.
``resolve_address`` turns ``--address`` (an interface, an address, a host name, ``*``) into where to bind.

Threads: ``launch``/``kill``/``wait`` on the caller's thread; ``note_rank`` on the mesh's I/O thread; a
ProcessLauncher's exit event on its waiter thread.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shlex
import signal
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from monarch_worker import join as wjoin

from .base import Launcher, LaunchError
from .isolation import spawn_unpatched

if TYPE_CHECKING:
    from collections.abc import Callable

    from .hosts import HostLinks

log = logging.getLogger(__name__)

__all__ = ["JoinLauncher", "ProcessLauncher", "JoinCommands", "resolve_address", "default_nproc_per_node",
           "write_secret_file", "open_rdzv_store"]

LOOPBACK = ("", "127.0.0.1", "localhost", "lo")
LOG_TAIL = 30  # lines of a launcher's log shown when it fails

# ---------------------------------------------------------------------------------------------------- addresses


def _interface_ipv4(name: str) -> str | None:
    SIOCGIFADDR = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            res = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return None
    return socket.inet_ntoa(res[20:24])


def resolve_address(address: str | None) -> tuple[str, str]:
    """(address to bind, address ranks connect to) for ``address``: None or loopback, an interface name
    (``eth0``, ``ib0``), an IPv4 address or host name of this host, or ``*`` / ``0.0.0.0`` (every interface;
    ranks are told the address of the interface of the default route).

    Raises
    ------
    ValueError
        Not an interface, address or resolvable host name (the message lists this host's interfaces).
    """
    address = (address or "").strip()
    if address in LOOPBACK:
        return "127.0.0.1", "127.0.0.1"
    if address in ("*", "0.0.0.0"):
        try:
            advertised = wjoin.address_toward("tcp://192.0.2.1:9")  # the default route's address; sends nothing
        except OSError:
            advertised = socket.gethostname()
        return "0.0.0.0", advertised
    names = [n for _, n in socket.if_nameindex()]
    if address in names:
        ip = _interface_ipv4(address)
        if ip is None:
            raise ValueError(f"interface {address} has no IPv4 address; choose another of: {', '.join(names)}")
        return ip, ip
    try:
        ip = str(socket.getaddrinfo(address, None, socket.AF_INET)[0][4][0])
    except (OSError, IndexError):
        raise ValueError(f"address {address!r} is neither an interface of this host ({', '.join(names)}) nor an "
                         "IPv4 address or a host name that resolves") from None
    return ip, ip


def write_secret_file(path: str | None, secret: bytes) -> str:
    """Write ``secret`` (hex) to a new 0600 file at ``path`` (None: Jupyter's runtime directory); returns its path."""
    if path is None:
        try:
            from jupyter_core.paths import jupyter_runtime_dir

            folder = jupyter_runtime_dir()
        except ImportError:
            folder = os.path.join(os.path.expanduser("~"), ".local", "share", "jupyter", "runtime")
        os.makedirs(folder, mode=0o700, exist_ok=True)
        prefix = f"monarch-mesh-{socket.gethostname()}-"  # the host: a home folder may be shared by many
        sweep_stale(folder, prefix, ".key")
        path = os.path.join(folder, f"{prefix}{os.getpid()}-{os.urandom(4).hex()}.key")
    path = os.path.abspath(path)
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret.hex() + "\n")
    return path


def sweep_stale(folder: str, prefix: str, suffix: str) -> None:
    """Remove the files ``{prefix}{pid}-...{suffix}`` in ``folder`` whose process ``pid`` (on this host) is gone:
    what a kernel killed by SIGKILL could not remove. The files of live processes, and those another user owns
    (the unlink fails), stay."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    for name in names:
        pid = name[len(prefix):].split("-", 1)[0] if name.startswith(prefix) and name.endswith(suffix) else ""
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive (or, PermissionError below, another user's)
        except ProcessLookupError:
            pass
        except OSError:
            continue
        try:
            os.unlink(os.path.join(folder, name))
        except OSError:
            pass


def open_rdzv_store(address: str, timeout: float) -> Any:
    """A c10d store on ``address`` (a free port) for torchrun's rendezvous, hosted by the controller so that the
    torchrun command is the same on every host (``timeout`` in seconds). c10d stores listen on every interface
    and do not authenticate; this one carries only torchrun's rendezvous."""
    from datetime import timedelta

    import torch.distributed as dist

    return dist.TCPStore(address, 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=timeout))


# ---------------------------------------------------------------------------------------------------- commands


@dataclass(frozen=True)
class JoinCommands:
    """Ready-to-paste commands that start a listening mesh: one host agent per host (``python -m
    monarch_worker.agent --nproc-per-node N``, which forks that host's ranks) under torchrun, SLURM or by hand, and
    the one-process-per-rank form (``python -m monarch_worker`` per rank). None of them holds the secret: they name
    the 0600 file that holds it (on a shared filesystem), or the environment carries it.

    ``rdzv_endpoint`` is a c10d store that the controller hosts for torchrun's own rendezvous, so that the
    torchrun command is the same on every host ("" when the mesh fits one host: ``--standalone``).
    ``join_timeout``: seconds an agent or rank waits to be admitted (the mesh's start timeout, and a little).
    """

    controller: str
    secret_file: str
    world_size: int
    nproc_per_node: int
    curve_serverkey: str = ""
    rdzv_endpoint: str = ""
    rdzv_id: str = ""
    python: str = "python"
    env_extra: dict = field(default_factory=dict)
    join_timeout: float = 0.0

    @property
    def nnodes(self) -> int:
        return self.world_size // self.nproc_per_node

    @property
    def env(self) -> dict[str, str]:
        """The environment every agent or rank needs (no secret in it: the secret's file)."""
        env = {wjoin.ENV_CONTROLLER: self.controller, wjoin.ENV_SECRET_FILE: self.secret_file}
        if self.curve_serverkey:
            env[wjoin.ENV_CURVE_SERVERKEY] = self.curve_serverkey
        if self.join_timeout:
            env[wjoin.ENV_JOIN_TIMEOUT] = f"{self.join_timeout:g}"
        env.update(self.env_extra)
        return env

    @property
    def agent_args(self) -> list[str]:
        """``-m monarch_worker.agent --nproc-per-node N``: what every launcher runs once per host."""
        return ["-m", "monarch_worker.agent", "--nproc-per-node", str(self.nproc_per_node)]

    def torchrun_args(self, per_rank: bool = False) -> list[str]:
        """torchrun's arguments (after ``torchrun``), the same on every host: one host agent per host, or with
        ``per_rank`` one ``monarch_worker`` process per rank."""
        if self.nnodes == 1:
            rdzv = ["--standalone"]
        else:
            rdzv = ["--rdzv-backend", "c10d", "--rdzv-endpoint", self.rdzv_endpoint, "--rdzv-id", self.rdzv_id]
        nproc = self.nproc_per_node if per_rank else 1
        module = ["-m", "monarch_worker"] if per_rank else self.agent_args
        return ["--nnodes", str(self.nnodes), "--nproc-per-node", str(nproc), *rdzv, "--max-restarts", "0", *module]

    def _env_prefix(self) -> str:
        return " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())

    @property
    def torchrun(self) -> str:
        return f"{self._env_prefix()} \\\n  torchrun {shlex.join(self.torchrun_args())}"

    @property
    def torchrun_per_rank(self) -> str:
        return f"{self._env_prefix()} \\\n  torchrun {shlex.join(self.torchrun_args(per_rank=True))}"

    @property
    def sbatch(self) -> str:
        lines = ["#!/bin/bash", "#SBATCH --job-name=monarch-mesh", f"#SBATCH --nodes={self.nnodes}",
                 "#SBATCH --ntasks-per-node=1", f"#SBATCH --cpus-per-task={self.nproc_per_node}"]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in self.env.items()]
        lines.append(f"srun {self.python} {shlex.join(self.agent_args)}")
        return "\n".join(lines)

    @property
    def generic(self) -> str:
        return f"{self._env_prefix()} {self.python} {shlex.join(self.agent_args)}"

    @property
    def generic_per_rank(self) -> str:
        return f"{self._env_prefix()} {self.python} -m monarch_worker"

    def __str__(self) -> str:
        enc = "; encrypted (CurveZMQ)" if self.curve_serverkey else ""
        return "\n".join([
            f"The mesh listens on {self.controller} for {self.world_size} ranks{enc}: {self.nnodes} host(s) with "
            f"{self.nproc_per_node} ranks each. Start one host agent per host (it forks the host's ranks) with one of:",
            "",
            f"# torchrun: on each of the {self.nnodes} host(s)",
            self.torchrun,
            "",
            "# SLURM: sbatch this script (or run its srun line inside salloc)",
            self.sbatch,
            "",
            "# any launcher, once per host",
            self.generic,
            "",
            "# or one process per rank, without agents (RANK/WORLD_SIZE/LOCAL_RANK optional: without them the mesh "
            "numbers ranks by host), e.g.",
            self.torchrun_per_rank,
            "",
            f"# The secret is in {self.secret_file} (mode 0600); hosts without that file can get it in "
            f"{wjoin.ENV_SECRET} instead (export MONARCH_SECRET=$(cat FILE); never on a command line).",
        ])

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        p.text(str(self))


def default_nproc_per_node(world_size: int) -> int:
    """The largest divisor of ``world_size`` up to 8 (a typical host)."""
    return max(d for d in range(1, min(world_size, 8) + 1) if world_size % d == 0)


# ---------------------------------------------------------------------------------------------------- launchers


class JoinLauncher(Launcher):
    """Ranks started by someone else with the commands of ``%mesh listen``; nothing is started here.

    Parameters
    ----------
    nproc_per_node:
        Ranks per host in the printed torchrun and sbatch commands (default: the largest divisor of the world
        size up to 8).
    """

    joins = True
    name = "join"
    #: True when the controller starts the ranks itself (start() then waits until they joined)
    starts_ranks = False
    #: True when every rank runs on this host (torchrun and agent): a start checks this host's room, as a local one
    on_this_host = False

    def __init__(self, nproc_per_node: int | None = None) -> None:
        if nproc_per_node is not None and nproc_per_node < 1:
            raise ValueError(f"--nproc-per-node (nproc_per_node) must be at least 1, got {nproc_per_node}")
        self.nproc_per_node = nproc_per_node
        self._links: HostLinks | None = None  # the mesh's host agents, while a generation runs (bind)
        self._exited: Callable[[float], bool] | None = None  # waits until every admitted rank exited (bind)
        self.placement: Callable[[], dict[int, dict[str, Any]]] = dict  # rank -> where it is (bind)
        self._ranks: dict[int, tuple[int, str]] = {}  # rank -> (pid, host)
        self._killed = False

    def ranks_per_host(self, world_size: int) -> int:
        """Ranks per host of a start with ``world_size`` ranks: ``nproc_per_node``, else the largest divisor of the
        world size up to 8."""
        return self.nproc_per_node or default_nproc_per_node(world_size)

    def bind(self, hosts: HostLinks | None, exited: Callable[[float], bool],
             placement: Callable[[], dict[int, dict[str, Any]]]) -> None:
        """The generation about to start: its host agents (launch/hosts.py), what waits until every admitted rank
        exited (``exited(timeout)``) and what tells where the admitted ranks are (``placement()``): the
        listener's."""
        self._links, self._exited, self.placement = hosts, exited, placement

    def launch(self, commands: JoinCommands, env: dict[str, str], secret: str, sink: Any) -> None:
        """Start the whole world (engines that place ranks themselves); here: nothing, a person runs the
        commands. ``secret`` goes only into the environment of what is started, never on its command line."""
        self._ranks = {}
        self._killed = False

    def note_rank(self, rank: int, pid: int, host: str) -> None:
        """The controller admitted ``rank`` (I/O thread)."""
        self._ranks[rank] = (pid, host)

    @property
    def hosts(self) -> HostLinks | None:
        """The host agents of the mesh (launch/hosts.py), when its ranks came through agents."""
        hosts = self._links
        return hosts if hosts is not None and hosts.agents else None

    def start(self, rank: int, env: dict[str, str], config: dict, sink: Any) -> None:
        """A fresh process for ``rank`` (``restart --rank``): forked by the host agent that holds it."""
        hosts = self.hosts
        why = "ranks started one by one elsewhere" if hosts is None else hosts.restartable([rank])
        if why:
            raise LaunchError(f"cannot start rank {rank} again from here: {why}")
        assert hosts is not None
        hosts.spawn([rank])

    def restartable(self, ranks: list[int]) -> str:
        """"" when ``ranks`` can get fresh processes from here (their host agents are up), else why not."""
        hosts = self.hosts
        if hosts is None:
            return ("these ranks were started one process per rank elsewhere (torchrun, srun, a command you ran): "
                    "that launcher owns their processes")
        return hosts.restartable(ranks)

    def note_exit(self, rank: int) -> None:
        """``rank`` exited (it said goodbye, or its engine ended): no signal goes to its pid any more."""
        self._ranks.pop(rank, None)

    def signal(self, rank: int, sig: int) -> None:
        """Signals reach ranks through their host agent, or by pid the ranks started one by one on this host."""
        hosts = self.hosts
        if hosts is not None:
            hosts.signal([rank], sig)
            return
        here = socket.gethostname()
        for r, (pid, host) in list(self._ranks.items()):
            if rank in (-1, r) and host == here:
                try:
                    os.kill(pid, sig)
                except (ProcessLookupError, PermissionError):
                    pass

    def kill(self) -> None:
        """SIGKILL the ranks (through their host agents, which then exit; else those on this host: ranks elsewhere
        exit when the controller's heartbeats stop)."""
        self.signal(-1, signal.SIGKILL)
        if self.hosts is not None:
            self.hosts.stop_agents()
        self._killed = True

    def wait(self, timeout: float) -> bool:
        """Wait until every admitted rank said goodbye (exited), up to ``timeout`` seconds (not after kill:
        a killed rank says nothing)."""
        if self._killed or self._exited is None:
            return True
        return self._exited(timeout)

    def log_tail(self) -> str:
        """The last lines of the launcher's own output ("" when there is none)."""
        return ""


class ProcessLauncher(JoinLauncher):
    """An engine the controller runs as one process for the whole world (torchrun, srun).

    The process's stdout and stderr go to a log file (the ranks send their own output to the notebook); when
    it exits, every rank not yet gone is reported exited with its status.
    """

    starts_ranks = True

    def __init__(self, nproc_per_node: int | None = None) -> None:
        super().__init__(nproc_per_node)
        self.proc: subprocess.Popen | None = None
        self.log_path = ""
        self._waiter: threading.Thread | None = None
        self.pass_fds: tuple[int, ...] = ()  # file descriptors the engine inherits (besides stdio)

    def command(self, commands: JoinCommands) -> list[str]:
        raise NotImplementedError

    def extra_env(self) -> dict[str, str]:
        return {}

    def launch(self, commands: JoinCommands, env: dict[str, str], secret: str, sink: Any) -> None:
        super().launch(commands, env, secret, sink)
        argv = self.command(commands)
        env = {**env, **commands.env, wjoin.ENV_RELAY_TEE: "0", **self.extra_env()}
        env.pop(wjoin.ENV_SECRET_FILE, None)
        env[wjoin.ENV_SECRET] = secret  # environment only (readable by this user and root), never argv
        prefix = f"monarch-{self.name}-"  # then the kernel's pid: a later kernel sweeps what a killed one left
        sweep_stale(tempfile.gettempdir(), prefix, ".log")
        fd, self.log_path = tempfile.mkstemp(prefix=f"{prefix}{os.getpid()}-", suffix=".log")
        try:
            with spawn_unpatched():  # a Python launcher must not be re-run under the kernel's debugger
                self.proc = subprocess.Popen(argv, env=env, stdin=subprocess.DEVNULL, stdout=fd,
                                             stderr=subprocess.STDOUT, start_new_session=True, close_fds=True,
                                             pass_fds=self.pass_fds)
        except OSError as e:
            raise LaunchError(f"cannot run {argv[0]}: {e.strerror}") from None
        finally:
            os.close(fd)
        log.info("%s started (pid %d): %s; log %s", self.name, self.proc.pid, shlex.join(argv), self.log_path)
        proc = self.proc
        self._waiter = threading.Thread(target=self._wait_exit, args=(proc, sink, commands.world_size),
                                        name=f"monarch-{self.name}", daemon=True)
        self._waiter.start()

    def _wait_exit(self, proc: subprocess.Popen, sink: Any, world_size: int) -> None:
        rc = proc.wait()
        if proc is self.proc:  # not a process of an earlier generation
            sink.on_launcher_exit(rc)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds for the engine to exit. Host agents stay up after their ranks exit (a
        rank may be restarted through them): once the ranks said goodbye, they are told to go, so the engine ends
        now rather than at ``kill``."""
        if self.proc is None:
            return True
        deadline = time.monotonic() + timeout
        if self.hosts is not None:
            super().wait(timeout)
            self.hosts.stop_agents()
        try:
            self.proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            return False
        return True

    def kill(self) -> None:
        """SIGTERM to the engine (it stops its ranks), SIGKILL to it and to the ranks on this host after 3 s."""
        if self.proc is not None and self.proc.poll() is None:
            try:
                os.killpg(self.proc.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            try:
                self.proc.wait(3.0)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(self.proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        super().kill()

    def log_tail(self) -> str:
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, errors="replace") as f:
                lines = deque(f, maxlen=LOG_TAIL)
        except OSError:
            return ""
        return "".join(lines).rstrip("\n")

    def cleanup(self) -> None:
        """Remove the log file (after the mesh stopped)."""
        if self.log_path:
            try:
                os.unlink(self.log_path)
            except OSError:
                pass
            self.log_path = ""
