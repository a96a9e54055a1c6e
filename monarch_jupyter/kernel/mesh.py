"""The Mesh: the notebook kernel as single controller of persistent ranks.

Threads
-------
- The caller's thread (the kernel's main thread in a notebook) submits work and waits for it. Its waits are
  short, interruptible condition waits, so SIGINT (the notebook's interrupt) always reaches it; it never joins
  a collective.
- The I/O thread (``monarch-io``) owns the ZeroMQ ROUTER socket and the Signer: it receives, verifies and
  dispatches every rank message, drives the rendezvous handshake, sends what the outbox holds and pings ranks.
- The launcher's reader thread delivers rank output bytes and exit statuses (``on_output``, ``on_exit``).
All shared state is guarded by ``self._cond``'s lock.
"""

from __future__ import annotations

import ast
import atexit
import contextlib
import contextvars
import enum
import functools
import inspect
import itertools
import linecache
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import zmq

from monarch_worker import protocol as P
from monarch_worker.channel import Outbox, recv_frames, send_frames
from monarch_worker.serialize import dumps, loads

from ..errors import (
    MeshError,
    MeshNotRunningError,
    MeshStartError,
    MeshTimeoutError,
    MonarchError,
    RankBusyError,
    RankDiedError,
    RemoteError,
    describe_returncode,
    mesh_interrupt,
)
from .debugger import MeshDebugger
from .join import Listener
from .launcher import Launcher, LocalLauncher, WorkPipe
from .output import StreamSplitter, write_lines
from .ranks import RankMap, format_ranks, parse_ranks
from .remote import JoinCommands, make_launcher
from .transfer import Transfers
from .recovery import RecoveryMixin, kept_for_death_report, restart_hint, where_interrupted
from .stacks import StackReport, rank_list, summarize

log = logging.getLogger(__name__)

__all__ = ["Mesh", "RankState", "CellHandle", "StackReport", "current_mesh"]

_current: Mesh | None = None

LAST_LINES = 20  # lines of output kept per rank for death reports


def current_mesh() -> Mesh:
    """The mesh started last in this process (by ``%mesh start`` or ``Mesh(...)``).

    Raises
    ------
    MeshNotRunningError
        No mesh was started.
    """
    if _current is None:
        raise MeshNotRunningError("no mesh is running: start one with  %mesh start -n 4  (or Mesh(nproc=4))")
    return _current


class RankState(str, enum.Enum):
    """Lifecycle of a rank as the controller sees it."""

    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class RankInfo:
    """Live handle of one rank (mutable; guarded by the mesh lock)."""

    rank: int
    state: RankState = RankState.STARTING
    pid: int | None = None
    host: str = ""
    device: str = ""
    backend: str = ""
    identity: bytes | None = None
    returncode: int | None = None
    start_error: str = ""
    rss: int = 0
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    last_heard: float = 0.0
    cells: deque = field(default_factory=deque)  # cells submitted to this rank, not yet finished on it
    last_lines: deque = field(default_factory=lambda: deque(maxlen=LAST_LINES))
    splitters: dict = field(default_factory=lambda: {"stdout": StreamSplitter(),
                                                     "stderr": StreamSplitter(records=False)})
    progress: tuple | None = None
    record_parts: list = field(default_factory=list)  # bodies of a record message not complete yet


class CellHandle:
    """One cell (or call) submitted to some ranks; what ``Mesh.run(..., block=False)`` returns.

    Output lines arrive in ``_lines`` and are written by whoever waits (``wait``/``result``) or, when nobody
    waits, by the thread that receives them, inside the submitter's context.
    """

    def __init__(self, mesh: Mesh, cell_id: int, ranks: list[int], what: str, order: str) -> None:
        self.mesh = mesh
        self.cell_id = cell_id
        self.ranks = ranks
        self.what = what
        self.order = order
        self.ctx = contextvars.copy_context()
        self.submitted = time.monotonic()
        self.values: dict[int, Any] = {}
        self.has_value: dict[int, bool] = {}
        self.errors: dict[int, MonarchError] = {}
        self.results_in: set[int] = set()
        self.synced: dict[int, set[str]] = {r: set() for r in ranks}
        self.finished: set[int] = set()
        self.durations: dict[int, float] = {}
        self._lines: list[tuple[int, str, str]] = []
        self._held: dict[int, list] = {r: [] for r in ranks}  # order == "rank": lines not yet released
        self._final: tuple[Any, BaseException | None] | None = None  # outcome, once computed
        self._keep_outcome = False
        self._abandoned = False  # interrupted or timed out while some ranks still ran it
        self._interrupted = False  # its ranks were sent an interrupt (Mesh._on_interrupt)
        self._wake = threading.Condition(mesh._lock)  # notified when lines arrive for a waiter, or when done
        self._waiting = False
        self._result_seen_at: dict[int, float] = {}
        self._death_at: float | None = None  # when the first of its ranks died (see recovery.py)

    # All methods below with a leading underscore run under the mesh lock.

    def _emit(self, rank: int, stream: str, text: str) -> None:
        if self.order == "rank" and not self._released(rank):
            self._held[rank].append((rank, stream, text))
        else:
            self._lines.append((rank, stream, text))
        if not self._waiting:
            self._deliver_now()
        else:
            self._wake.notify()

    def _released(self, rank: int) -> bool:
        for r in self.ranks:
            if r == rank:
                return True
            if r not in self.finished:
                return False
        return True

    def _release_held(self) -> None:
        for r in self.ranks:
            if self._held[r] and self._released(r):
                self._lines.extend(self._held[r])
                self._held[r] = []

    def _deliver_now(self) -> None:
        lines, self._lines = self._lines, []
        write_lines(lines, self.ctx)

    def _finish_rank(self, rank: int) -> None:
        if rank in self.finished:
            return
        self.finished.add(rank)
        info = self.mesh._ranks.get(rank)
        if info is not None:
            if self in info.cells:
                info.cells.remove(self)
            if not info.cells and info.state is RankState.RUNNING:
                info.state = RankState.IDLE
        if self.order == "rank":
            self._release_held()
            if not self._waiting:
                self._deliver_now()
        if self._all_done or self._lines:
            self._wake.notify_all()
        if self._all_done:  # under the mesh lock: listeners see it before any waiter can
            self.mesh._event("cell_done", cell_id=self.cell_id, handle=self)

    def _check_rank(self, rank: int) -> None:
        if rank in self.results_in and (not self.mesh._launcher.relays_output
                                        or self.synced[rank] >= {"stdout", "stderr"}):
            self._finish_rank(rank)

    @property
    def _all_done(self) -> bool:
        return len(self.finished) == len(self.ranks)

    # Public API.

    def done(self) -> bool:
        """True when every rank has finished this cell (or died)."""
        with self.mesh._lock:
            return self._all_done

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: forever) for the cell to finish; True when it has."""
        return self.mesh._wait(self, timeout, raise_on_timeout=False)

    def result(self, timeout: float | None = None) -> RankMap | None:
        """Wait for the cell and return rank -> value of its last expression (None when no rank had one).

        Raises
        ------
        MeshError
            The cell raised on some ranks, or some ranks died; ``.results`` holds the others' values.
        MeshTimeoutError
            The cell did not finish within ``timeout`` seconds (the report says where each rank was).
        """
        self.mesh._wait(self, timeout, raise_on_timeout=True)
        return self.mesh._outcome(self)

    def __repr__(self) -> str:
        state = "done" if self.done() else "running"
        return f"<CellHandle {self.what} on ranks {format_ranks(self.ranks)}: {state}>"


class Mesh(RecoveryMixin):
    """A mesh of persistent worker processes, one per rank, each with torch.distributed initialized.

    Parameters
    ----------
    nproc:
        Number of ranks (world size), started on this host.
    backend:
        "gloo", "nccl" or "auto" (nccl when CUDA is available with at least ``nproc`` GPUs, else gloo).
    start_timeout:
        Seconds for every rank to start and join the process group before ``start`` fails.
    timeout:
        Default seconds a cell may run (None: no limit); a cell over it is interrupted and its stacks reported.
    heartbeat_timeout:
        Seconds of silence after which a rank exits (it lost the controller: no orphans) and after which the
        controller declares a rank lost (dead), e.g. a remote rank whose host vanished; 0 turns the
        controller's check off.
    heartbeat_interval:
        Seconds between heartbeats (both ways).
    pg_timeout:
        Seconds a collective may block in torch.distributed before it fails (its own timeout).
    interrupt_grace:
        Seconds ranks get to stop after an interrupt (or a cell timeout) before they are reported as stuck.
    env:
        Extra environment variables for the ranks.
    start:
        Start at once (default). Otherwise call ``start()``.
    launcher:
        "local" (default: a fork server on this host), "join" (ranks started elsewhere join; see ``listen``),
        "torchrun" (torchrun on this host), "slurm" (srun inside an allocation), or a launcher object
        (``JoinLauncher``, ``TorchrunLauncher(...)``, ``SlurmLauncher(nodes=..., srun_args=...)``).
        docs/multihost.md explains each.
    address:
        Where the controller listens for ranks that join (not "local"): None (loopback), an interface name
        (``eth0``), an address or host name of this host, or ``*``. Anything but loopback must be asked for.
    port:
        TCP port to listen on for joining ranks (0: any free port).
    encrypt:
        Encrypt joining ranks' connections with CurveZMQ (for networks you do not trust; the secret always
        authenticates both sides).
    secret_file:
        Where to write the per-mesh secret (mode 0600) for joining ranks (default: Jupyter's runtime dir).

    Ranks see RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT as torchrun sets them,
    and names ``rank``, ``world_size``, ``local_rank``, ``device``, ``dist`` and ``torch`` in their namespace.

    Raises
    ------
    MeshStartError
        A rank failed to start or to join within ``start_timeout`` (its error and output are in the message);
        every process started is gone when it is raised.
    """

    def __init__(
        self,
        nproc: int = 4,
        *,
        backend: str = "auto",
        start_timeout: float = 60.0,
        timeout: float | None = None,
        heartbeat_timeout: float = 30.0,
        heartbeat_interval: float = 1.0,
        pg_timeout: float = 1800.0,
        interrupt_grace: float = 5.0,
        env: dict[str, str] | None = None,
        start: bool = True,
        launcher: str | Launcher = "local",
        address: str | None = None,
        port: int = 0,
        encrypt: bool = False,
        secret_file: str | None = None,
    ) -> None:
        if not isinstance(nproc, int) or nproc < 1:
            raise ValueError(f"nproc must be a positive number of ranks, got {nproc!r}")
        if backend not in ("auto", "gloo", "nccl"):
            raise ValueError(f"backend must be 'gloo', 'nccl' or 'auto', got {backend!r}")
        if backend == "nccl":
            _check_gpus(nproc)
        self.nproc = nproc
        self.backend = backend
        self.start_timeout = float(start_timeout)
        self.timeout = timeout
        self.heartbeat_timeout = float(heartbeat_timeout)
        self.heartbeat_interval = float(heartbeat_interval)
        self.pg_timeout = float(pg_timeout)
        self.interrupt_grace = float(interrupt_grace)
        self.env = dict(env or {})
        self._listener: Listener | None = None  # ranks that join (launcher other than "local"); see join.py
        if launcher != "local":
            self._listener = Listener(self, make_launcher(launcher, nproc), address, port, encrypt, secret_file)
        elif address not in (None, "127.0.0.1", "localhost") or encrypt:
            raise ValueError("address and encrypt are for ranks that join (launcher 'join', 'torchrun' or 'slurm'); "
                             "local ranks always talk to the controller over loopback")
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)  # mesh-wide changes: ranks joining, dying, stack replies
        self._ranks: dict[int, RankInfo] = {}
        self._cells: dict[int, CellHandle] = {}
        self._stack_requests: dict[int, dict[int, P.Stacks]] = {}  # request id -> rank -> reply
        self._cell_ids = itertools.count(1)
        self._last_cell: CellHandle | None = None
        self._listeners: list[Callable[[str, dict], None]] = []
        self._running = False
        self._stopping = False
        self._launcher: Launcher | None = None
        self._xfer: Transfers | None = None
        self._ctx: zmq.Context | None = None
        self._io: threading.Thread | None = None
        self._init_recovery()
        self.address = ""
        self.started_at = 0.0
        self.ready_seconds = 0.0
        self.debugger = MeshDebugger(self)  # breakpoint() prompts, post-mortem, inspect (debugger.py)
        if start:
            self.start()

    # ------------------------------------------------------------------ lifecycle

    @property
    def world_size(self) -> int:
        return self.nproc

    @property
    def running(self) -> bool:
        return self._running

    @property
    def listening(self) -> bool:
        """True while the mesh waits for ranks to join (``listen``); ``run`` then waits for them first."""
        return (not self._running and self._listener is not None and self._listener.is_open
                and not self._listener.failed)

    @property
    def start_failure(self) -> str:
        """Why the ranks of a listening mesh did not all join in time ("" when they did or are still joining);
        the next ``run`` or ``wait_ready`` raises it as MeshStartError and stops the mesh."""
        return self._listener.failed if self._listener is not None and self._listener.is_open else ""

    @classmethod
    def listen(cls, world_size: int, *, address: str | None = None, timeout: float = 300.0, port: int = 0,
               encrypt: bool = False, nproc_per_node: int | None = None, secret_file: str | None = None,
               show: bool = True, **kwargs: Any) -> Mesh:
        """Open the controller to ``world_size`` ranks started elsewhere, print the commands that start them
        (torchrun, sbatch/srun, plain python) and return at once; the mesh is ready when all have joined.

        ``address``, ``port``, ``encrypt``, ``secret_file`` as for ``Mesh``; ``timeout``: seconds for every
        rank to join (after it, the report says who is missing); ``nproc_per_node``: ranks per host in the
        printed commands; other keyword arguments go to ``Mesh``. ``wait_ready()`` (or the first ``run``)
        waits for the ranks; ``join_commands()`` returns the commands again.

        Raises
        ------
        ValueError
            Bad address, port or world size.
        """
        from .remote import JoinLauncher

        mesh = cls(world_size, launcher=JoinLauncher(nproc_per_node), address=address, port=port,
                   encrypt=encrypt, secret_file=secret_file, start_timeout=timeout, start=False, **kwargs)
        mesh.start(wait=False)
        if show:
            print(mesh.join_commands())
        return mesh

    def join_commands(self) -> JoinCommands:
        """The commands that start this mesh's ranks elsewhere (a mesh with a launcher other than "local").

        Raises MeshNotRunningError when the mesh is not listening."""
        if self._listener is None or self._listener.commands is None or not self._listener.is_open:
            raise MeshNotRunningError("this mesh does not listen for ranks: use Mesh.listen(N) or  %mesh listen")
        return self._listener.commands

    def wait_ready(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds (None: until the start timeout passed) for every rank of a listening
        mesh to join; True when the mesh is running.

        Raises
        ------
        MeshStartError
            The start timeout passed first (the message names who joined and who is missing) or a rank failed;
            the mesh is stopped then.
        """
        if self._running:
            return True
        if self._listener is None or not self._listener.is_open:
            raise MeshNotRunningError("this mesh is not running: start it with  %mesh start -n N  (or restart())")
        if timeout is None:  # until the start timeout passed and the report is out
            deadline = self._listener.deadline + 3 * self.heartbeat_interval + 2
        else:
            deadline = time.monotonic() + timeout
        try:
            ready = self._listener.wait_ready(deadline)
        except MeshStartError:
            self._teardown(graceful=False)
            raise
        if ready:
            self._mark_started(self._listener.opened_at)
        return ready

    def start(self, wait: bool | None = None) -> Mesh:
        """Start every rank and wait until each has joined the process group (``start_timeout`` seconds).

        ``wait`` False (the default for launcher "join", where someone else starts the ranks) returns once the
        controller listens; ``wait_ready`` or the first ``run`` waits for the ranks.

        Raises
        ------
        MeshStartError
            A rank failed to start or to join in time; nothing is left running.
        """
        global _current
        if self._running:
            raise MonarchError("this mesh is already running; use restart() for fresh processes")
        t0 = time.monotonic()
        self._stopping = False
        self._secret = os.urandom(32)
        self._signer = P.Signer(self._secret)
        self._record_signer = P.Signer(self._secret)  # verifies records (on the launcher's reader thread)
        self._work_signer = P.Signer(self._secret)  # signs what goes through work pipes (under _work_lock)
        self._work_lock = threading.Lock()
        self._pipes_waiting: set[WorkPipe] = set()  # work pipes with bytes the I/O thread still has to write
        self._outbox = Outbox()
        self._ctx = zmq.Context()
        self._router = self._ctx.socket(zmq.ROUTER)
        self._router.setsockopt(zmq.LINGER, 0)
        # No handover: a second connection must never take over a rank's identity (and the code sent to it).
        self._router.setsockopt(zmq.ROUTER_HANDOVER, 0)
        if self._listener is None:
            port = self._router.bind_to_random_port("tcp://127.0.0.1")
            self.address = f"tcp://127.0.0.1:{port}"
        self._ranks = {r: RankInfo(r) for r in range(self.nproc)}
        self._store_port: int | None = None
        self._xfer = Transfers(self)
        self._init_recovery()
        self._io_stop = threading.Event()
        self._io = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._io.start()
        deadline = t0 + self.start_timeout
        try:
            if self._listener is not None:  # ranks that join (join.py)
                self.address = self._listener.open(self._router, self._secret)
                self._launcher = self._listener.launch(self._launch_env())
                if wait is None:
                    wait = self._listener.launcher.starts_ranks
                if not wait:
                    _current = self
                    return self
                if not self._listener.wait_ready(deadline):
                    raise MeshStartError(f"the ranks did not join within {self.start_timeout:g} s; "
                                         f"{self._listener.missing_report()}")
                self._mark_started(t0)
                return self
            self._launcher = LocalLauncher(self.start_timeout)
            env = self._rank_env()
            for r in range(self.nproc):
                self._launcher.start(r, env, self._rank_config(r), self)
            self._wait_started(deadline)
        except BaseException:
            self._teardown(graceful=False)
            raise
        self._mark_started(t0)
        return self

    def _mark_started(self, t0: float) -> None:
        global _current
        self._running = True
        self.ready_seconds = time.monotonic() - t0
        self.started_at = time.time()
        _current = self
        atexit.register(self._exit_quietly)  # runs before the launcher's own atexit kills the ranks
        self._event("started", ready_seconds=self.ready_seconds)

    def _launch_env(self) -> dict[str, str]:
        """Environment of an engine that starts joining ranks (torchrun, srun): this one plus ``env``."""
        env = dict(os.environ)
        env.update(self.env)
        for key in ("JPY_PARENT_PID", "MPLBACKEND"):
            env.pop(key, None)
        return env

    def _rank_config(self, r: int) -> dict:
        """The RankConfig fields of rank ``r`` (sent by the launcher)."""
        return {
            "controller": self.address,
            "secret": self._secret.hex(),
            "rank": r,
            "world_size": self.nproc,
            "local_rank": r,
            "local_world_size": self.nproc,
            "backend": self.backend,
            "join_timeout": self.start_timeout,
            "pg_timeout": self.pg_timeout,
            "heartbeat_interval": self.heartbeat_interval,
            "heartbeat_timeout": self.heartbeat_timeout,
            "env": {},
        }

    def _rank_env(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(self.env)
        # As torchrun: one OpenMP thread per rank when several share this host, unless the user chose, so N ranks
        # do not oversubscribe its cores (the rank applies it: monarch_worker.runtime.apply_thread_settings).
        if self.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        # Local ranks talk over loopback; this also silences gloo's hostname-resolution warning.
        env.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
        # torch.distributed's flight recorder: the last collectives of each rank, shown by stack reports
        # (docs/faults.md lists what else helps with hangs). 0 turns it off.
        env.setdefault("TORCH_FR_BUFFER_SIZE", "1024")
        env["MASTER_ADDR"] = "127.0.0.1"
        for key in ("JPY_PARENT_PID", "MPLBACKEND"):
            env.pop(key, None)
        return env

    def _wait_started(self, deadline: float) -> None:
        with self._lock:
            while True:
                failed = [i for i in self._ranks.values() if i.start_error or i.state is RankState.DEAD]
                if failed:
                    info = failed[0]
                    self._cond.release()
                    try:
                        time.sleep(0.2)  # let its last output arrive
                    finally:
                        self._cond.acquire()
                    detail = info.start_error or ""
                    if info.last_lines:
                        detail += "\nits last output:\n" + "\n".join(f"  {line}" for line in info.last_lines)
                    why = "failed to join" if info.start_error else f"died ({describe_returncode(info.returncode)})"
                    raise MeshStartError(f"rank {info.rank} {why} while the mesh was starting", info.rank,
                                         detail.strip("\n"))
                if all(i.state is RankState.IDLE for i in self._ranks.values()):
                    return
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waiting = [i.rank for i in self._ranks.values() if i.state is not RankState.IDLE]
                    raise MeshStartError(
                        f"rank(s) {format_ranks(waiting)} did not join within {self.start_timeout:g} s; "
                        "raise the start timeout (--timeout) or look at their output above", waiting[0])
                self._cond.wait(min(remaining, 0.1))

    def _exit_quietly(self) -> None:
        """At interpreter exit the ranks die with the fork server: expected, so not reported as deaths."""
        self._stopping = True

    def stop(self) -> None:
        """Stop every rank (Shutdown, then SIGKILL after 3 s) and release the controller's socket."""
        global _current
        atexit.unregister(self._exit_quietly)
        self._teardown(graceful=True)
        if _current is self:
            _current = None
        self._event("stopped")

    def restart(self, ranks: str | int | Iterable[int] | None = None) -> Mesh:
        """Stop and start again: fresh processes, fresh namespaces, a fresh process group.

        A mesh whose ranks were started elsewhere (``listen``) listens again and prints the new commands.

        ``ranks``: restart only these (e.g. the ones that died): fresh processes for them, while every other
        rank keeps its namespace and joins a fresh process group with them. Objects bound to the old group
        (DistributedDataParallel wrappers, ``new_group`` handles) must be created again. Only for ranks this
        controller starts (the local launcher).

        Raises
        ------
        MeshStartError
            Ranks did not start or join within ``start_timeout``.
        MonarchError
            ``ranks`` given but other ranks are dead too, survivors are stuck in a cell, or the ranks were
            started elsewhere (the message says what to run instead).
        """
        if ranks is not None:
            return self._restart_ranks(ranks)
        self._teardown(graceful=True)
        self.start()
        if self.listening:
            print(self.join_commands())
        return self

    def _teardown(self, graceful: bool) -> None:
        self._stopping = True
        was_running = self._running
        self._running = False
        if self._xfer is not None:
            self._xfer.close()
        launcher = self._launcher
        if graceful and was_running and launcher is not None:
            with self._lock:
                targets = [i for i in self._ranks.values() if i.identity and i.state is not RankState.DEAD]
            for info in targets:
                self._post(info, P.Shutdown())
            launcher.wait(3.0)
        if launcher is not None:
            launcher.kill()
            launcher.wait(5.0)
        if self._listener is not None:
            self._listener.reject_pending("the mesh was stopped")
        if self._io is not None and self._io.is_alive():
            self._io_stop.set()
            self._outbox.put(None)
            self._io.join(5.0)
        with self._lock:
            for info in self._ranks.values():
                if info.state is not RankState.DEAD:
                    info.state = RankState.STOPPED
            for cell in list(self._cells.values()):
                for r in cell.ranks:
                    if r not in cell.finished:
                        cell.errors.setdefault(r, RankDiedError(r, None, reason="the mesh was stopped"))
                        cell._finish_rank(r)
            self._cells.clear()
            self._cond.notify_all()
        if self._ctx is not None:
            # Joined ranks may be on other hosts: give Shutdown/Rejected up to 1 s to leave.
            self._router.close(0 if self._listener is None else 1000)
            self._ctx.term()
            self._ctx = None
            self._outbox.close()
        if self._listener is not None:
            self._listener.close()

    def __enter__(self) -> Mesh:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ running code

    def run(
        self,
        code: str,
        ranks: str | int | Iterable[int] | None = None,
        *,
        timeout: float | None = None,
        block: bool = True,
        namespace: dict[str, Any] | None = None,
        filename: str | None = None,
        order: str = "arrival",
    ) -> RankMap | None | CellHandle:
        """Run ``code`` (a cell) on ``ranks`` (default: all) in their persistent namespaces.

        Parameters
        ----------
        code:
            Python source. Its last expression's value on each rank comes back, as in IPython's Out.
        ranks:
            Rank selection: None/"all", an int, a list, or a spec like "0,2", "1-3", "::2".
        timeout:
            Seconds before the cell is interrupted and reported with each rank's stack (default: the mesh's).
        block:
            False returns a CellHandle at once (``done()``, ``wait(timeout)``, ``result()``).
        namespace:
            The notebook's namespace: functions and classes defined there that the cell refers to are sent
            with it (by value, with their source for tracebacks) unless a rank defined that name itself.
        filename:
            Name of the cell in tracebacks (default ``<mesh cell N>``).
        order:
            "arrival" writes output lines as they arrive; "rank" writes rank r's lines only after every lower
            rank of the cell finished it, so the output is the same every run (rank 0 still streams live).

        Returns
        -------
        RankMap (rank -> value) when any rank's last expression had a value, else None; a CellHandle when
        ``block`` is False.

        Raises
        ------
        SyntaxError
            The code does not compile (reported once, nothing runs).
        MeshError
            It raised on some ranks or some ranks died; the other ranks' results are in ``.results``.
        MeshTimeoutError
            It ran past ``timeout``.
        KeyboardInterrupt
            Interrupted (the ranks were interrupted too and keep their state).
        """
        self._check_running()
        if order not in ("arrival", "rank"):
            raise ValueError(f"order must be 'arrival' or 'rank', got {order!r}")
        chosen = parse_ranks(ranks, self.nproc)
        cell_id = next(self._cell_ids)
        filename = filename or f"<mesh cell {cell_id}>"
        linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)
        try:
            compiled = compile(code, filename, "exec", dont_inherit=True)  # SyntaxError here, before anything runs
        except SyntaxError as e:
            # IPython shows the offending line and caret, not the controller's frames.
            e._render_traceback_ = functools.partial(_render_syntax_error, e)  # type: ignore[attr-defined]
            raise e.with_traceback(None) from None
        refs, sources = _notebook_refs(code, namespace, compiled) if namespace is not None else ({}, {})
        msg = P.Exec(cell_id, code, filename, sources)
        handle = self._submit(cell_id, chosen, msg, refs if refs else None, bool(refs), "the cell", order)
        if not block:
            handle._keep_outcome = True
            return handle
        return self._result(handle, timeout if timeout is not None else self.timeout)

    def call(
        self,
        fn: Callable[..., Any],
        *args: Any,
        ranks: str | int | Iterable[int] | None = None,
        timeout: float | None = None,
        block: bool = True,
        **kwargs: Any,
    ) -> RankMap | None | CellHandle:
        """Call ``fn(*args, **kwargs)`` on each chosen rank; returns rank -> return value.

        ``fn`` may be defined in the notebook (sent by value with cloudpickle). Raises as ``run`` does.
        """
        self._check_running()
        chosen = parse_ranks(ranks, self.nproc)
        cell_id = next(self._cell_ids)
        sources = _sources_of([fn])
        handle = self._submit(cell_id, chosen, P.Call(cell_id, sources), (fn, args, kwargs), True,
                              f"call of {getattr(fn, '__qualname__', fn)!s}", "arrival")
        if not block:
            handle._keep_outcome = True
            return handle
        return self._result(handle, timeout if timeout is not None else self.timeout)

    # ------------------------------------------------------------------ values between notebook and ranks

    def push(
        self,
        values: dict[str, Any] | None = None,
        /,
        *,
        ranks: str | int | Iterable[int] | None = None,
        device: Any = None,
        timeout: float | None = None,
        via: str = "auto",
        **kwvalues: Any,
    ) -> None:
        """Bind each value under its name in every chosen rank's namespace; returns when every rank has.

        ``mesh.push(x=x, w=model.state_dict())`` or ``mesh.push({"x": x})`` (the dict form also takes the names
        ``ranks``, ``device``, ``timeout`` and ``via``). Any picklable value works: tensors, NumPy arrays,
        nested containers of them, state dicts, modules, notebook-defined classes. Tensor and array memory
        travels out of band: to ranks on this host through one shared memory segment that they all map (one
        copy in the notebook, none on the ranks), else over the socket (see kernel/transfer.py).

        Parameters
        ----------
        ranks:
            Rank selection (None/"all", an int, a list, "0,2", "1-3", "::2").
        device:
            None: tensors stay on the CPU as they arrive (views of shared memory where it was used). "rank": each
            rank's own device (cuda:LOCAL_RANK, or cpu). A device string or torch.device: that device.
        timeout:
            Seconds to wait for every rank (default: the mesh's ``timeout``).
        via:
            "auto", "shm", "socket" or "broadcast" (the bytes go to one rank and the ranks broadcast them
            over their process group); "auto" chooses per value.

        Raises
        ------
        ValueError
            A name is not a Python identifier, ranks or via are invalid, or via="shm" for ranks elsewhere.
        monarch_worker.serialize.SerializationError
            A value cannot be pickled; the message names the type and where it sits inside the value. Nothing
            is sent then.
        MeshError
            Some ranks failed (e.g. ``device='cuda'`` on a rank without GPUs); each rank's error is in ``.errors``.
            A rank binds all of the values or none of them.
        """
        merged = dict(values or {})
        merged.update(kwvalues)
        self._check_running()
        assert self._xfer is not None
        self._xfer.push(merged, ranks, device, timeout, via)

    def scatter(self, name: str, value: Any, dim: int = 0, *, ranks: str | int | Iterable[int] | None = None,
                device: Any = None, timeout: float | None = None) -> None:
        """Split ``value`` along ``dim`` as torch.tensor_split does and bind part i as ``name`` on the i-th
        chosen rank (parts may differ in size by one: 10 rows on 4 ranks give 3, 3, 2, 2).

        ``value`` is a torch.Tensor (parts keep its dtype; they arrive on the CPU or on ``device``), a NumPy array
        (numpy.array_split) or a list/tuple (dim 0). ``device`` and ``timeout`` are as for ``push``.

        Raises
        ------
        ValueError
            Fewer elements along ``dim`` than chosen ranks, ``dim`` out of range, or a 0-dim value.
        TypeError
            ``value`` cannot be split (push sends whole values).
        MeshError
            Some ranks failed; as for ``push``.
        """
        self._check_running()
        assert self._xfer is not None
        self._xfer.scatter(name, value, dim, ranks, device, timeout)

    def pull(self, name: str, ranks: str | int | Iterable[int] | None = None, *,
             timeout: float | None = None) -> RankMap:
        """Fetch the value bound to ``name`` on each chosen rank: a RankMap rank -> value.

        CUDA tensors come back as CPU tensors (same dtype, shape and requires_grad). Large values from ranks on
        this host arrive through shared memory and are views of it until dropped.

        Raises
        ------
        MeshError
            ``name`` is not defined on some ranks (a NameError per rank, naming it), or the value cannot be
            pickled there; the other ranks' values are in ``.results``.
        """
        self._check_running()
        assert self._xfer is not None
        return self._xfer.pull(name, ranks, timeout)

    def gather(self, name: str, dim: int = 0, *, ranks: str | int | Iterable[int] | None = None,
               timeout: float | None = None) -> Any:
        """Pull ``name`` from each chosen rank and concatenate the parts in rank order along ``dim``.

        Tensors give one CPU tensor (torch.cat), NumPy arrays one array, lists one list. The inverse of
        ``scatter``: ``gather(n, d)`` after ``scatter(n, t, d)`` equals ``t``.

        Raises
        ------
        MeshError
            As for ``pull``.
        TypeError, ValueError
            The parts are of different kinds or do not fit together along ``dim`` (each rank's shape is named).
        """
        self._check_running()
        assert self._xfer is not None
        return self._xfer.gather(name, dim, ranks, timeout)

    def _submit(self, cell_id: int, ranks: list[int], msg: P.Message, value: Any, with_value: bool,
                what: str, order: str) -> CellHandle:
        payload, buffers = dumps(value) if with_value else (b"", [])
        return self._submit_groups(cell_id, [(ranks, msg, payload, buffers)], what, order)

    def _submit_groups(self, cell_id: int, groups: list[tuple[list[int], P.Message, bytes, list]], what: str,
                       order: str) -> CellHandle:
        """Send one cell as ``groups`` of (ranks, message, payload, buffers): each group's ranks get the same
        message (signed once). Raises MeshError, sending nothing, when a chosen rank is dead."""
        ranks = sorted(r for group in groups for r in group[0])
        handle = CellHandle(self, cell_id, ranks, what, order)
        sent = False
        try:
            # An interrupt must not cut a message in half on its way into a work pipe, nor leave some ranks with
            # the cell and others without: it is held until the cell is on its way to every rank, then raised.
            with _sigint_held(), self._lock:
                dead = [r for r in ranks if self._ranks[r].state is RankState.DEAD]
                if dead:
                    raise MeshError({r: RankDiedError(r, self._ranks[r].returncode,
                                                      "\n".join(self._ranks[r].last_lines)) for r in dead},
                                    what=what + " (not run)", hint=restart_hint(dead))
                busy = [r for r in ranks
                        if any(c._abandoned and r not in c.finished for c in self._ranks[r].cells)]
                if busy:
                    raise RankBusyError(
                        f"{what} was not run: rank(s) {rank_list(busy)} still run an earlier cell that was "
                        "interrupted or timed out and did not stop (blocked in a collective?); new code there could "
                        "pair its collectives with the stuck ones. Run  %mesh stacks  to see where,  %mesh interrupt "
                        f"--force --ranks {rank_list(busy)}  to release them, or  %mesh restart.", busy)
                self._note_group_down(ranks)
                self._cells[cell_id] = handle
                self._last_cell = handle
                launcher = self._launcher
                for group_ranks, msg, payload, buffers in groups:
                    identities, pipes = [], []
                    for r in group_ranks:
                        info = self._ranks[r]
                        info.cells.append(handle)
                        info.state = RankState.RUNNING
                        pipe = launcher.work_pipe(r) if launcher is not None else None
                        if pipe is not None:
                            pipes.append(pipe)
                        else:
                            identities.append(info.identity)
                    if pipes:
                        self._send_work(pipes, msg, payload, buffers)
                    if identities:
                        self._outbox.put((identities, msg, payload, buffers))
                sent = True
        except KeyboardInterrupt:
            if not sent:
                raise
            raise mesh_interrupt(self._on_interrupt(handle)) from None
        # From here on the ranks run it: an interrupt that lands before the caller waits must reach them too
        # (a fast cell's first output can be on screen, and interrupted, before that).
        try:
            self._event("cell_started", cell_id=cell_id, ranks=ranks, handle=handle)
        except KeyboardInterrupt:
            raise mesh_interrupt(self._on_interrupt(handle)) from None
        return handle

    def _result(self, handle: CellHandle, timeout: float | None) -> RankMap | None:
        """``handle.result(timeout)``, interrupting the ranks whenever the caller is interrupted."""
        try:
            return handle.result(timeout)
        except KeyboardInterrupt:
            if handle._interrupted:
                raise
            raise mesh_interrupt(self._on_interrupt(handle)) from None

    def _wait(self, cell: CellHandle, timeout: float | None, raise_on_timeout: bool) -> bool:
        """Wait for ``cell`` and write its output from this thread; returns True when it finished."""
        deadline = None if timeout is None else time.monotonic() + timeout
        try:
            with self._lock:
                cell._waiting = True
            while True:
                with self._lock:
                    if not cell._lines and not cell._all_done:
                        cell._wake.wait(0.05)
                    self._check_stragglers(cell)
                    lines, cell._lines = cell._lines, []
                    done = cell._all_done
                write_lines(lines)
                if done:
                    return True
                if self.debugger.has_prompt(cell):  # a rank stopped at breakpoint(): talk to it (debugger.py)
                    paused = self.debugger.serve(cell)
                    deadline = None if deadline is None else deadline + paused  # time at the prompt is not run time
                if deadline is not None and time.monotonic() > deadline:
                    if raise_on_timeout:
                        self._on_timeout(cell, timeout or 0.0)
                    return False
        except KeyboardInterrupt:
            summary = self._on_interrupt(cell)
            raise mesh_interrupt(summary) from None
        finally:
            with self._lock:
                cell._waiting = False
                cell._deliver_now()

    def _check_stragglers(self, cell: CellHandle) -> None:
        """Under the lock: finish ranks whose result came but whose output marker is late (1 s), and end the
        cell promptly (``RELEASE_GRACE`` s at most) when a rank died."""
        now = time.monotonic()
        for r, seen in cell._result_seen_at.items():
            if r not in cell.finished and now - seen > 1.0:
                log.debug("rank %d: output marker of cell %d late; finishing without it", r, cell.cell_id)
                cell._finish_rank(r)
        self._release_survivors(cell, now)  # a rank died: survivors were interrupted (recovery.py)

    def _on_interrupt(self, cell: CellHandle) -> str:
        """The caller was interrupted: interrupt the ranks still running the cell and wait ``interrupt_grace``.

        Returns what to say in the KeyboardInterrupt: where the ranks stopped (stuck ones are reported on stderr).
        """
        with self._lock:
            cell._interrupted = True
            running = [r for r in cell.ranks if r not in cell.finished]
            for r in running:
                self._post(self._ranks[r], P.Interrupt(cell.cell_id))
        if not running:
            return "interrupted (the ranks had finished the cell)"
        started = time.monotonic()
        deadline = started + self.interrupt_grace
        resend = started + INTERRUPT_RESEND
        try:
            while time.monotonic() < deadline:
                with self._lock:
                    if cell._all_done:
                        break
                    cell._wake.wait(0.05)
                    lines, cell._lines = cell._lines, []
                    if time.monotonic() >= resend:
                        # A SIGINT that lands just before a rank's blocking call starts (time.sleep, a socket
                        # read) waits for that call to end: a second one interrupts the call itself.
                        resend = time.monotonic() + INTERRUPT_RESEND
                        for r in cell.ranks:
                            if r not in cell.finished:
                                self._post(self._ranks[r], P.Interrupt(cell.cell_id))
                write_lines(lines)
        except KeyboardInterrupt:
            pass  # a second interrupt: stop waiting now
        with self._lock:
            stuck = [r for r in cell.ranks if r not in cell.finished]
            cell._abandoned = bool(stuck)  # nobody waits for it now: later cells must not queue behind it
            stopped = {r: e for r, e in cell.errors.items()
                       if r in running and isinstance(e, RemoteError) and e.interrupted}
        if stuck:
            # A second interrupt ends the wait early: say how long the ranks really had.
            waited = min(self.interrupt_grace, time.monotonic() - started)
            sys.stderr.write(self._stuck_message(stuck, round(waited, 1)))
        if not stopped:
            return f"interrupted; rank(s) {rank_list(stuck)} did not stop"
        return f"interrupted rank(s) {rank_list(stopped)} (they keep their state): {where_interrupted(stopped)}"

    def _on_timeout(self, cell: CellHandle, timeout: float) -> None:
        with self._lock:
            late = [r for r in cell.ranks if r not in cell.finished]
        report = self.stacks(ranks=late)
        self._on_interrupt(cell)
        with self._lock:
            errors: dict[int, MonarchError] = {}
            for r in cell.ranks:
                e = cell.errors.get(r)
                if r not in late:
                    if e is not None:
                        errors[r] = e  # failed before the timeout
                elif r not in cell.finished:
                    errors[r] = RemoteError(r, "TimeoutError", f"still running after {timeout:g} s; it did not stop "
                                            f"within {self.interrupt_grace:g} s of the interrupt")
                elif isinstance(e, RemoteError) and e.interrupted:
                    errors[r] = RemoteError(r, "TimeoutError", f"interrupted after {timeout:g} s at "
                                            f"{summarize([tuple(f) for f in e.frames])}", e.traceback,
                                            frames=e.frames)
                elif e is not None:
                    errors[r] = e
            results = {r: cell.values.get(r) for r in cell.finished if r not in cell.errors}
            stuck = [r for r in cell.ranks if r not in cell.finished]
            if not stuck:
                self._cells.pop(cell.cell_id, None)
        hint = (f"%mesh interrupt --force --ranks {rank_list(stuck)}  stops the ranks still running "
                "(see the message above)" if stuck else "")
        raise MeshTimeoutError(errors, results, cell.what, report.text, timeout, hint)

    def _outcome(self, cell: CellHandle) -> RankMap | None:
        """The cell's results, or raise its error; computed once, then the same answer on every call."""
        final = cell._final
        if final is None:
            try:
                final = (self._compute_outcome(cell), None)
            except BaseException as e:  # noqa: BLE001 - remembered, raised below
                final = (None, e)
            if cell._keep_outcome:  # a handle the caller holds (block=False): result() may be asked again
                cell._final = final
        value, error = final
        if error is not None:
            raise error
        return value

    def _compute_outcome(self, cell: CellHandle) -> RankMap | None:
        with self._lock:
            self._cells.pop(cell.cell_id, None)
            errors = dict(cell.errors)
            results = RankMap((r, cell.values.get(r)) for r in cell.ranks if r in cell.finished and r not in errors)
            cell.values = {}  # the handle may live on (late output); the results belong to the caller now
        if errors:
            if all(isinstance(e, RemoteError) and e.interrupted for e in errors.values()):
                raise mesh_interrupt(f"interrupted rank(s) {rank_list(errors)} (they keep their state): "
                                     f"{where_interrupted(errors)}")
            errors, hint = self._fold_errors(cell, errors)
            raise MeshError(errors, results, cell.what, hint)
        if not any(cell.has_value.get(r) for r in cell.ranks):
            return None
        return results

    # ------------------------------------------------------------------ introspection

    def status(self) -> dict[int, dict[str, Any]]:
        """rank -> {"state", "pid", "host", "device", "rss", "cuda_allocated", "cuda_reserved" (bytes),
        "returncode", "backend"}."""
        with self._lock:
            return {
                r: {"state": i.state.value, "pid": i.pid, "host": i.host, "device": i.device, "rss": i.rss,
                    "cuda_allocated": i.cuda_allocated, "cuda_reserved": i.cuda_reserved,
                    "returncode": i.returncode, "backend": i.backend}
                for r, i in self._ranks.items()
            }

    def hosts(self) -> dict[str, list[int]]:
        """host name -> its ranks (the ranks that joined, or all of this host's for a local mesh)."""
        out: dict[str, list[int]] = {}
        for r, s in self.status().items():
            out.setdefault(s["host"] or "?", []).append(r)
        return out

    def stacks(self, ranks: str | int | Iterable[int] | None = None, timeout: float = 5.0) -> StackReport:
        """Where each rank's main thread is now, asked of its I/O thread (works while it blocks in a
        collective, and while a ``block=False`` cell runs). Identical stacks are grouped:
        "ranks 0,1,3: all_reduce at cell line 4". Ranks that do not answer within ``timeout`` seconds (dead,
        stopped) are listed as such."""
        self._check_running()
        chosen = parse_ranks(ranks, self.nproc)
        request_id = next(self._cell_ids)
        with self._lock:
            replies: dict[int, P.Stacks] = {}
            self._stack_requests[request_id] = replies
            asked = [r for r in chosen if self._ranks[r].state is not RankState.DEAD]
            for r in asked:
                self._post(self._ranks[r], P.StacksRequest(request_id))
            deadline = time.monotonic() + timeout
            try:
                while len(replies) < len(asked) and time.monotonic() < deadline:
                    self._cond.wait(0.05)
            finally:
                self._stack_requests.pop(request_id, None)
            states = {r: self._ranks[r].state for r in chosen}
        return StackReport(chosen, dict(replies), states)

    def add_listener(self, fn: Callable[[str, dict], None]) -> None:
        """Call ``fn(kind, data)`` on every mesh event (from background threads; it must not block, and some
        events come while the mesh holds its lock: never wait there for another thread that takes it).

        Events and their data: ``started`` (ready_seconds), ``stopped``, ``cell_started`` (cell_id, ranks,
        handle), ``cell_done`` (cell_id, handle; under the lock), ``rank_result`` (rank, cell_id, status, error,
        duration, ename, evalue), ``rank_state`` (rank, state: idle/dead/stopped, or breakpoint/running from the
        debugger; returncode, host, device, pid where known), ``output`` (rank, stream, text, cell_id; under the
        lock), ``progress`` (rank, cell_id, n, total, desc, postfix), ``heartbeat`` (rank, rss, cuda_allocated,
        cuda_reserved; bytes).
        """
        self._listeners.append(fn)

    def remove_listener(self, fn: Callable[[str, dict], None]) -> None:
        if fn in self._listeners:
            self._listeners.remove(fn)

    def _event(self, kind: str, **data: Any) -> None:
        for fn in list(self._listeners):
            try:
                fn(kind, data)
            except Exception:  # noqa: BLE001 - a broken listener must not break the mesh
                log.exception("mesh listener failed on %s", kind)

    def __repr__(self) -> str:
        if not self._ranks:
            return f"<Mesh {self.nproc} ranks: not started>"
        states: dict[str, list[int]] = {}
        for r, i in self._ranks.items():
            states.setdefault(i.state.value, []).append(r)
        backend = next((i.backend for i in self._ranks.values() if i.backend), self.backend)
        summary = ", ".join(f"{s}: {format_ranks(rs)}" for s, rs in states.items())
        return f"<Mesh world_size={self.nproc} backend={backend} ({summary})>"

    def _check_running(self) -> None:
        if not self._running and self._listener is not None and self._listener.is_open:
            self.wait_ready()  # ranks started elsewhere: wait until all joined (or the start timeout passes)
        if not self._running:
            raise MeshNotRunningError("this mesh is not running: start it with  %mesh start -n N  "
                                      "(or mesh.start() / mesh.restart())")

    # ------------------------------------------------------------------ I/O thread

    def _post(self, info: RankInfo, msg: P.Message) -> None:
        """Queue a message without payload for ``info`` (any thread)."""
        if isinstance(msg, _WORK_TYPES) and self._launcher is not None:
            pipe = self._launcher.work_pipe(info.rank)
            if pipe is not None:
                self._send_work([pipe], msg, b"", [])
                return
        if info.identity is not None:
            self._outbox.put(([info.identity], msg, b"", []))

    def _send_work(self, pipes: list[WorkPipe], msg: P.Message, payload: bytes, buffers: list) -> None:
        """Write ``msg`` (signed once) into local ranks' work pipes (protocol.WORK_FD), from any thread without
        blocking; what a full pipe cannot take now, the I/O thread writes later, in order."""
        waiting = False
        with self._work_lock:  # signing order is writing order: each rank checks that sequence numbers increase
            data = P.work_message(self._work_signer.pack(msg, payload, buffers))
            for pipe in pipes:
                if not pipe.send(data):
                    self._pipes_waiting.add(pipe)
                    waiting = True
        if waiting:
            self._outbox.put(None)  # wakes the I/O thread

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._router, zmq.POLLIN)
        poller.register(self._outbox.wake_fd, zmq.POLLIN)
        handlers: dict[type, Callable] = {
            P.StoreReady: self._on_store_ready,
            P.Ready: self._on_ready,
            P.StartFailed: self._on_start_failed,
            P.Result: self._on_result,
            P.Stream: self._on_stream,
            P.Stacks: self._on_stacks,
            P.Heartbeat: self._on_heartbeat,
            P.Progress: self._on_progress,
            P.PullReply: self._xfer.on_pull_reply,
            P.ShmRelease: self._xfer.on_release,
            P.DebugOutput: self.debugger.on_message,
            P.DebugPrompt: self.debugger.on_message,
            P.DebugResumed: self.debugger.on_message,
            P.DebugReply: self.debugger.on_message,
            P.Goodbye: self._on_goodbye,
        }
        by_identity: dict[bytes, int] = {}
        next_ping = 0.0
        while not self._io_stop.is_set():
            # While some work pipe is full, retry it every few milliseconds (a pipe that closes meanwhile must not
            # sit in the poller).
            wait_ms = 5 if self._pipes_waiting else int(self.heartbeat_interval * 1000)
            events = dict(poller.poll(wait_ms))
            for pipe in list(self._pipes_waiting):
                if pipe.flush():
                    self._pipes_waiting.discard(pipe)
            if self._router in events:
                while (frames := recv_frames(self._router)) is not None:
                    identity = bytes(frames[0])
                    try:
                        msg, payload, bufs = self._signer.unpack(frames[1:])
                    except (P.ProtocolError, ValueError, TypeError, KeyError) as e:
                        log.warning("dropped a message from %r: %s", identity[:32], e)
                        continue
                    if isinstance(msg, P.Hello):
                        self._on_hello(identity, msg, by_identity)
                        continue
                    rank = by_identity.get(identity)
                    if rank is None and self._listener is not None and self._listener.on_unknown(identity, msg):
                        continue  # a rank waiting for the others to join
                    if rank is None:
                        log.warning("dropped %s from a peer that did not say hello", msg.TYPE)
                        continue
                    handler = handlers.get(type(msg))
                    if handler is None:
                        log.warning("rank %d sent an unexpected %s", rank, msg.TYPE)
                        continue
                    try:
                        handler(rank, msg, payload, bufs)
                    except Exception:  # noqa: BLE001 - keep the I/O thread alive whatever a rank sent
                        log.exception("handling %s from rank %d failed", msg.TYPE, rank)
            if self._outbox.wake_fd in events:
                self._send_outbox()
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + self.heartbeat_interval
                with self._lock:
                    idents = [i.identity for i in self._ranks.values()
                              if i.identity and i.state is not RankState.DEAD]
                for ident in idents:
                    send_frames(self._router, [ident, *self._signer.pack(P.Ping())])
                self._check_heartbeats(now)  # after every message received was handled (recovery.py)
                if self._listener is not None:
                    self._listener.check(now)
        self._send_outbox()  # what was queued while stopping (Shutdown, Rejected)

    def _send_outbox(self) -> None:
        """Send what other threads queued (I/O thread only)."""
        for item in self._outbox.drain():
            if item is None:
                continue
            identities, msg, payload, buffers = item
            # One signature for every recipient: each rank checks replays per sender session.
            frames = self._signer.pack(msg, payload, buffers)
            for identity in identities:
                if identity is not None:
                    send_frames(self._router, [identity, *frames])

    @functools.cached_property
    def _record_handlers(self) -> dict[type, Callable]:
        """Handlers of the messages ranks send as records (protocol.record_types)."""
        return {
            P.Result: self._on_result,
            P.Progress: self._on_progress,
            P.DebugOutput: self.debugger.on_message,
            P.DebugPrompt: self.debugger.on_message,
            P.DebugResumed: self.debugger.on_message,
        }

    def _welcome(self, info: RankInfo, port: int) -> None:
        msg = P.Welcome(rank=info.rank, world_size=self.nproc, local_rank=info.rank, local_world_size=self.nproc,
                        master_addr="127.0.0.1", master_port=port)
        send_frames(self._router, [info.identity, *self._signer.pack(msg)])

    def _on_hello(self, identity: bytes, msg: P.Hello, by_identity: dict[bytes, int]) -> None:
        if self._listener is not None:
            self._listener.on_hello(identity, msg, by_identity)
            return
        if msg.version != P.PROTOCOL_VERSION:
            log.warning("rank %d speaks protocol %d, controller %d; ignored", msg.rank, msg.version,
                        P.PROTOCOL_VERSION)
            return
        with self._lock:
            info = self._ranks.get(msg.rank)
            if info is None or info.identity is not None:
                log.warning("rejected hello for rank %d (unknown or taken)", msg.rank)
                return
            info.identity = identity
            info.host = msg.host
            info.pid = info.pid or msg.pid
            info.last_heard = time.monotonic()
            by_identity[identity] = msg.rank
            if msg.rank == 0:
                self._welcome(info, 0)
            elif self._store_port is not None:
                self._welcome(info, self._store_port)

    def _on_store_ready(self, rank: int, msg: P.StoreReady, payload: bytes, bufs: list) -> None:
        if self._regrouping:  # a new process group for survivors and restarted ranks (recovery.py)
            self._regroup_store_ready(msg)
            return
        if self._listener is not None:
            self._listener.on_store_ready(rank, msg)
            return
        with self._lock:
            self._store_port = msg.port
            for info in self._ranks.values():
                if info.rank != 0 and info.identity is not None:
                    self._welcome(info, msg.port)

    def _on_ready(self, rank: int, msg: P.Ready, payload: bytes, bufs: list) -> None:
        with self._lock:
            info = self._ranks[rank]
            info.state = RankState.IDLE
            info.device, info.backend, info.host = msg.device, msg.backend, msg.host
            self._cond.notify_all()
        self._event("rank_state", rank=rank, state="idle", host=msg.host, device=msg.device, pid=msg.pid)

    def _on_start_failed(self, rank: int, msg: P.StartFailed, payload: bytes, bufs: list) -> None:
        with self._lock:
            self._ranks[rank].start_error = msg.error
            self._cond.notify_all()

    def _on_result(self, rank: int, msg: P.Result, payload: bytes, bufs: list) -> None:
        value, error = None, None
        if msg.status == "ok" and msg.has_value:
            try:
                value = loads(payload, bufs)
            except Exception as e:  # noqa: BLE001 - e.g. a module the notebook lacks
                error = RemoteError(rank, type(e).__qualname__,
                                    f"the rank's result could not be unpickled in the notebook: {e}")
        elif msg.status == "error":
            err = msg.error or {}
            error = RemoteError(rank, err.get("type", "Exception"), err.get("message", ""),
                                err.get("traceback", ""), err.get("module", ""), err.get("frames"))
        with self._lock:
            cell = self._cells.get(msg.cell_id)
            if cell is None:
                return
            cell.durations[rank] = msg.duration
            cell.results_in.add(rank)
            cell._result_seen_at[rank] = time.monotonic()
            if error is not None:
                cell.errors[rank] = error
            else:
                cell.values[rank] = value
                cell.has_value[rank] = msg.has_value
            cell._check_rank(rank)
        self._event("rank_result", rank=rank, cell_id=msg.cell_id, status=msg.status,
                    error=None if error is None else str(error), duration=msg.duration,
                    ename=getattr(error, "ename", ""), evalue=getattr(error, "evalue", ""))

    def _on_stream(self, rank: int, msg: P.Stream, payload: bytes, bufs: list) -> None:
        self.on_output(rank, msg.name, msg.data.encode())

    def _on_stacks(self, rank: int, msg: P.Stacks, payload: bytes, bufs: list) -> None:
        with self._lock:
            replies = self._stack_requests.get(msg.request_id)
            if replies is not None:
                replies[rank] = msg
                self._cond.notify_all()

    def _on_heartbeat(self, rank: int, msg: P.Heartbeat, payload: bytes, bufs: list) -> None:
        with self._lock:
            info = self._ranks[rank]
            info.rss = msg.rss
            info.cuda_allocated, info.cuda_reserved = msg.cuda_allocated, msg.cuda_reserved
            info.last_heard = time.monotonic()
        self._event("heartbeat", rank=rank, rss=msg.rss, cuda_allocated=msg.cuda_allocated,
                    cuda_reserved=msg.cuda_reserved)

    def _on_goodbye(self, rank: int, msg: P.Goodbye, payload: bytes, bufs: list) -> None:
        if self._listener is not None:  # local ranks' exits come from the fork server
            self._listener.on_goodbye(rank, msg)

    def _on_progress(self, rank: int, msg: P.Progress, payload: bytes, bufs: list) -> None:
        with self._lock:
            self._ranks[rank].progress = (msg.n, msg.total, msg.desc)
        self._event("progress", rank=rank, n=msg.n, total=msg.total, desc=msg.desc, cell_id=msg.cell_id,
                    postfix=msg.postfix)

    # ------------------------------------------------------------------ launcher events (reader thread)

    def on_spawned(self, rank: int, pid: int) -> None:
        with self._lock:
            if rank in self._ranks:
                self._ranks[rank].pid = pid

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        info = self._ranks.get(rank)
        if info is None:
            return
        events = info.splitters[stream].feed(data)  # the splitters are the reader thread's own
        i, n = 0, len(events)
        while i < n:
            with self._lock:
                while i < n and events[i][0] != "msg":
                    kind, value = events[i]
                    i += 1
                    if kind == "line":
                        self._route_line(info, stream, str(value))
                        continue
                    cell = self._cells.get(int(value))  # type: ignore[arg-type]
                    if cell is not None and rank in cell.synced:
                        cell.synced[rank].add(stream)
                        cell._check_rank(rank)
                if i == n:
                    return
                record = self._take_record(info, *events[i][1])  # type: ignore[misc]
                i += 1
            if record is not None:  # its handler unpickles values: outside the lock, as for socket messages
                msg, payload, bufs = record
                try:
                    self._record_handlers[type(msg)](rank, msg, payload, bufs)
                except Exception:  # noqa: BLE001 - keep the reader thread alive whatever a rank sent
                    log.exception("handling %s from rank %d failed", msg.TYPE, rank)

    def _take_record(self, info: RankInfo, flags: int, body: bytes) -> tuple | None:
        """A record the rank wrote into its stdout pipe (protocol.RECORD_PREFIX), behind its output, under the
        lock: its verified message once all of its parts are in, else None. A cell's ``Result`` record also
        completes the cell's output on both streams: the launcher passes on a rank's stderr ahead of each stdout
        read, and the rank wrote its stderr before the record."""
        if flags & P.RECORD_MORE:
            info.record_parts.append(body)
            return None
        parts, info.record_parts = info.record_parts + [body], []
        error: Exception | None = None
        for start in range(len(parts)):  # leading parts that fail to verify came from output that looked like one
            try:
                msg, payload, bufs = self._record_signer.unpack(P.unpack_frames(b"".join(parts[start:])))
                break
            except (P.ProtocolError, ValueError, TypeError, KeyError) as e:
                error = e
        else:
            log.warning("dropped a record of rank %d: %s", info.rank, error)
            return None
        if type(msg) not in self._record_handlers:
            log.warning("rank %d sent an unexpected %s record", info.rank, msg.TYPE)
            return None
        if isinstance(msg, P.Result) and flags & P.RECORD_SYNC:
            cell = self._cells.get(msg.cell_id)
            if cell is not None and info.rank in cell.synced:
                self._flush_partial(info, "stderr")
                cell.synced[info.rank].update(("stdout", "stderr"))
        return msg, payload, bufs

    def _flush_partial(self, info: RankInfo, stream: str) -> None:
        """Route the last line of ``stream`` that has no newline yet (the cell that wrote it ended)."""
        for _, text in info.splitters[stream].end_line():
            self._route_line(info, stream, str(text))

    def _route_line(self, info: RankInfo, stream: str, text: str) -> None:
        if kept_for_death_report(text):
            info.last_lines.append(text)
        target = None
        for cell in info.cells:  # the oldest cell whose output on this stream is not complete yet
            if stream not in cell.synced.get(info.rank, {stream}):
                target = cell
                break
        if target is None:
            target = self._last_cell
        if target is None:
            write_lines([(info.rank, stream, text)])
        else:
            target._emit(info.rank, stream, text)
        self._event("output", rank=info.rank, stream=stream, text=text,
                    cell_id=None if target is None else target.cell_id)

    def on_exit(self, rank: int, returncode: int) -> None:
        with self._lock:
            info = self._ranks.get(rank)
            if info is None:
                return
            for stream, splitter in info.splitters.items():
                for kind, value in splitter.flush():
                    if kind == "line":
                        self._route_line(info, stream, str(value))
            if self._xfer is not None:
                self._xfer.on_rank_exit(rank)
            if info.state is RankState.DEAD:  # declared lost before (no heartbeat): only its status is new
                info.returncode = returncode
                self._killing.pop(rank, None)
                self._cond.notify_all()
                return
            expected = self._stopping
            killed = self._killing.pop(rank, None)
            failed: list[CellHandle] = []
            if expected:
                info.returncode = returncode
                info.state = RankState.STOPPED
                self._cond.notify_all()
            else:
                failed = self._rank_failed(info, returncode, killed or "")
        if not expected:
            self._after_death(rank, killed or "", failed, notify=killed is None)  # recovery.py
        self._event("rank_state", rank=rank, state=info.state.value, returncode=returncode)


_WORK_TYPES = P.work_types()


@contextlib.contextmanager
def _sigint_held() -> Iterator[None]:
    """On the main thread: a SIGINT that arrives inside the block is raised (KeyboardInterrupt) when it ends."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[tuple] = []
    try:
        previous = signal.signal(signal.SIGINT, lambda *args: caught.append(args))
    except ValueError:  # not the main interpreter
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(*caught[0])
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt
INTERRUPT_RESEND = 1.0  # seconds between interrupts sent to ranks that still run an interrupted cell


def _render_syntax_error(e: SyntaxError) -> list[str]:
    import traceback

    return "".join(traceback.format_exception_only(type(e), e)).rstrip("\n").splitlines()


def _loopback_ifname() -> str:
    try:
        for _idx, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


def _check_gpus(nproc: int) -> None:
    try:
        import torch
    except ImportError:
        raise MeshStartError("backend 'nccl' needs torch with CUDA; torch is not importable here") from None
    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if n < nproc:
        raise MeshStartError(
            f"backend 'nccl' needs one GPU per rank: {nproc} ranks but {n} CUDA device(s) visible; "
            "use --backend gloo or fewer ranks")


def _notebook_refs(code: str, namespace: dict[str, Any],
                   compiled: Any = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Functions and classes defined in the notebook (module __main__) that ``code`` refers to.

    ``compiled`` (the code object of ``code``) lets most cells skip the syntax tree: its names, and those of the
    functions and classes it defines, are a superset of the names it loads.
    """
    if compiled is not None and not any(_notebook_defined(namespace.get(n)) for n in _code_names(compiled)):
        return {}, {}
    try:
        tree = ast.parse(code)
    except SyntaxError:
        return {}, {}
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
    refs = {name: namespace[name] for name in names if _notebook_defined(namespace.get(name))}
    return refs, _sources_of(refs.values())


def _notebook_defined(value: Any) -> bool:
    return (inspect.isfunction(value) or inspect.isclass(value)) and getattr(value, "__module__", None) == "__main__"


def _code_names(code: Any) -> set[str]:
    """Global and attribute names used by a code object and the code objects nested in it."""
    names = set(code.co_names)
    for const in code.co_consts:
        if hasattr(const, "co_names"):
            names |= _code_names(const)
    return names


def _sources_of(objs: Iterable[Any]) -> dict[str, str]:
    """Source text of the files that define ``objs`` when they are notebook cells (linecache entries)."""
    files: set[str] = set()
    for obj in objs:
        fns = [obj] if not inspect.isclass(obj) else [v for v in vars(obj).values() if inspect.isfunction(v)]
        for fn in fns:
            code = getattr(fn, "__code__", None)
            if code is not None:
                files.add(code.co_filename)
    sources = {}
    for filename in files:
        if os.path.exists(filename):
            continue  # a real file: the rank reads it itself
        lines = linecache.getlines(filename)
        if lines:
            sources[filename] = "".join(lines)
    return sources
