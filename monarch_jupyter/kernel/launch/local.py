"""Ranks on this host: ``LocalLauncher`` forks them through the fork server (:mod:`monarch_worker.forkserver`).

The fork server is a fresh interpreter that imported torch once, never a fork of the kernel: the kernel may hold
CUDA contexts, OpenMP pools and threads that a forked child would inherit broken. One fork server serves every
local mesh of this kernel (``ForkServer.get``); ``prewarm`` starts it early, ``shutdown`` stops it and its ranks.

The fork server's reader thread (``monarch-forkserver``) owns the receiving side of its control socket and every
rank's stdout and stderr pipes: it reads them and reports output bytes, pids and exit statuses to each rank's
``LauncherEvents`` sink.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time

from monarch_worker import protocol as P
from monarch_worker.reaper import END_WAIT

from ...errors import describe_returncode
from ..state import owner_check
from .base import Launcher, LauncherEvents, LaunchError, WorkPipe
from .isolation import spawn_unpatched, without_debugger_env
from .pacing import ReadPacer

log = logging.getLogger(__name__)

__all__ = ["LocalLauncher", "ForkServer", "prewarm", "preload", "shutdown", "fork_server_pid", "fork_server_clone"]

READ_SIZE = 1 << 16  # bytes of one read of a rank's output pipe (its default capacity)
READER_JOIN = 10.0  # seconds ForkServer.close waits for its reader thread to report the ranks' exits


class ForkServer:
    """The kernel's handle on the fork server process; shared by every local mesh of this kernel.

    One Unix socket carries frames both ways (protocol.FORK_SERVER_HEADER) and hands over file descriptors
    (SCM_RIGHTS): each rank's work pipe goes to the fork server with the spawn request, and the read ends of the rank's
    stdout and stderr pipes come back with FS_SPAWNED. The reader thread owns the receiving side of the socket and
    every rank's output pipes; ``_send`` (any thread) sends under a lock.
    """

    _instance: ForkServer | None = None
    _instance_lock = threading.Lock()
    preloaded: list[str] = []  # modules every fork server of this kernel imports (``preload``), in order

    @classmethod
    def get(cls, start_timeout: float) -> ForkServer:
        with cls._instance_lock:
            if cls._instance is None or cls._instance.proc.poll() is not None:
                cls._instance = cls(start_timeout)
            return cls._instance

    @classmethod
    def shutdown_all(cls) -> None:
        with cls._instance_lock:
            z, cls._instance = cls._instance, None
        if z is not None:
            z.close()

    def __init__(self, start_timeout: float) -> None:
        self._ctl, ctl_child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        env = without_debugger_env(os.environ)  # never the kernel's debugpy session (isolation.py)
        with spawn_unpatched():
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "monarch_worker.forkserver"],
                stdin=ctl_child.fileno(),
                env=env,
                start_new_session=True,  # the kernel's SIGINT (sent to its process group) must not reach ranks
                close_fds=True,
            )
        ctl_child.close()
        self._selector = selectors.DefaultSelector()  # the reader thread's: the socket and the output pipes
        self._outputs: dict[int, tuple[int, int]] = {}  # spawn id -> read fds of its (stdout, stderr) pipes
        self._work: dict[int, WorkPipe] = {}  # spawn id -> the kernel's end of that rank's work pipe
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sinks: dict[int, tuple[LauncherEvents, int]] = {}  # spawn id -> (sink, rank)
        self._pids: dict[int, int] = {}  # spawn id -> pid
        self._alive: set[int] = set()
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._pacer = ReadPacer()  # the reader thread's: it rests between reads while output floods in (pacing.py)
        self._reader = threading.Thread(target=self._read_loop, name="monarch-forkserver", daemon=True)
        self._reader.start()
        self._start_timeout = start_timeout
        if self.preloaded:  # read once it has imported torch, before any spawn request
            self.import_modules(self.preloaded)

    @classmethod
    def preload(cls, modules: list[str]) -> None:
        """See the module function ``preload``."""
        with cls._instance_lock:
            new = [m for m in modules if m not in cls.preloaded]
            cls.preloaded.extend(new)
            server = cls._instance
        if new and server is not None and server.proc.poll() is None:
            server.import_modules(new)

    def import_modules(self, modules: list[str]) -> None:
        """Ask this fork server to import ``modules`` now (it does before its next fork); never raises."""
        try:
            self._send(P.FS_IMPORT, -1, {"modules": list(modules)})
        except OSError:
            pass  # it is gone: the next one imports ``preloaded`` when it starts

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise LaunchError(
                    f"the local fork server exited with code {self.proc.returncode} while importing torch; "
                    f"run `{sys.executable} -c 'import torch, zmq, cloudpickle'` to see why"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"the local fork server did not import torch within {timeout:g} s (the start "
                                  "timeout): raise it,  %mesh start --timeout S  or  Mesh(start_timeout=S); a first "
                                  "import of torch on a busy machine can take a minute")

    def _send(self, kind: int, sid: int, body: dict, fds: list[int] | None = None) -> None:
        frame = P.fork_server_json(kind, sid, body)
        with self._lock:
            sent = socket.send_fds(self._ctl, [frame], fds) if fds else 0
            self._ctl.sendall(frame[sent:])

    def spawn(self, rank: int, env: dict, config: dict, sink: LauncherEvents) -> int:
        sid = next(self._ids)
        work_r, work_w = os.pipe()
        with self._cond:
            self._sinks[sid] = (sink, rank)
            self._alive.add(sid)
            self._work[sid] = WorkPipe(work_w)
        try:
            self._send(P.FS_SPAWN, sid, {"env": env, "cwd": os.getcwd(), "sys_path": sys.path, "config": config,
                                        "work_pipe": True}, [work_r])
        finally:
            os.close(work_r)  # the fork server holds its own copy now
        return sid

    def clone(self) -> socket.socket:
        """A fork server of its own for a host agent on this host, forked from this one, so torch and every
        preloaded module are imported already (monarch_worker.forkserver, "Clones"); returns the socket the agent
        controls it through (pass it to the agent, then close it here). The request waits, if this fork server is
        still importing torch, until it is done. Raises OSError when this fork server is gone."""
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            self._send(P.FS_CLONE, next(self._ids), {}, [theirs.fileno()])
        except OSError:
            ours.close()
            raise
        finally:
            theirs.close()
        return ours

    def work_pipe(self, sid: int) -> WorkPipe | None:
        return self._work.get(sid)

    def pid_of(self, sid: int) -> int | None:
        """The pid of spawn ``sid`` while it is alive."""
        return self._pids.get(sid)

    def signal(self, sid: int, sig: int) -> None:
        try:
            self._send(P.FS_KILL, sid, {"signal": int(sig)})
        except OSError:
            pass  # the fork server is gone, and with it every rank

    def wait_exit(self, sids: set[int], timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._alive & sids:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.proc.poll() is not None:
                    return not (self._alive & sids) or self.proc.poll() is not None
                self._cond.wait(min(remaining, 0.1))
        return True

    def _read_loop(self) -> None:
        hs = P.FORK_SERVER_HEADER.size
        buf = b""
        fds: list[int] = []  # received with SCM_RIGHTS, not claimed by a frame yet
        self._selector.register(self._ctl, selectors.EVENT_READ, None)
        alive = True
        while alive:
            self._pacer.before_select()
            for key, _ in self._selector.select():
                if key.data is not None:  # a rank's output pipe
                    if self._selector.get_map().get(key.fd) is key:  # not closed by an earlier key of this batch
                        self._read_output(key.fd, *key.data)
                    continue
                try:
                    data, new_fds, _, _ = socket.recv_fds(self._ctl, 1 << 16, 64)
                except OSError:
                    data, new_fds = b"", []
                fds.extend(new_fds)
                if not data:
                    alive = False
                    break
                buf += data
                pos = 0
                while len(buf) - pos >= hs:
                    kind, sid, n = P.FORK_SERVER_HEADER.unpack_from(buf, pos)
                    if len(buf) - pos < hs + n:
                        break
                    self._dispatch(kind, sid, buf[pos + hs:pos + hs + n], fds)
                    pos += hs + n
                buf = buf[pos:]
        # The fork server is gone: every rank it had is gone too.
        for sid in list(self._outputs):
            self._drain_outputs(sid)
        for fd in fds:
            os.close(fd)
        with self._cond:
            lost = list(self._alive)
            self._alive.clear()
            works, self._work = list(self._work.values()), {}
            self._cond.notify_all()
        for work in works:
            work.close()
        why = self._death() if lost else ""
        for sid in lost:
            sink, rank = self._sinks.get(sid, (None, -1))
            if sink is not None:
                sink.on_exit(rank, -signal.SIGKILL, why)
        self._selector.close()

    def _death(self) -> str:
        """Why this fork server's ranks are gone, once its control socket closed (reader thread)."""
        try:
            rc: int | None = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            rc = None
        how = f" ({describe_returncode(rc)})" if rc is not None else ""
        return (f"the fork server that forked it (pid {self.proc.pid}) died{how}, and every rank it forked with it: "
                "%mesh restart starts the mesh again")

    def _read_output(self, fd: int, sid: int, stream: str, until_empty: bool = False) -> None:
        """Read a rank's output pipe (non-blocking) and pass it on; reader thread only.

        Before bytes read from stdout are passed on, whatever the rank's stderr pipe holds is: a rank writes its
        stderr before the stdout record that ends a cell (protocol.RECORD_SYNC), so the mesh sees every line of
        the cell on both streams before that record.
        """
        owner_check(lambda: self._reader, "the ranks' output pipes")
        sink, rank = self._sinks.get(sid, (None, -1))
        for _ in range(256 if until_empty else 1):  # bounded: a process the rank started may write on and on
            try:
                data = os.read(fd, READ_SIZE)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not data:  # every writer closed it: the rank (and anything it started) exited
                self._close_output(sid, fd)
                return
            self._pacer.read(len(data), len(data) == READ_SIZE)
            if stream == "stdout":
                pipes = self._outputs.get(sid)
                if pipes is not None and pipes[1] >= 0:
                    self._read_output(pipes[1], sid, "stderr", until_empty=True)
            if sink is not None:
                sink.on_output(rank, stream, data)

    def _close_output(self, sid: int, fd: int) -> None:
        self._selector.unregister(fd)
        os.close(fd)
        out, err = self._outputs.get(sid, (-1, -1))
        out, err = (-1 if out == fd else out), (-1 if err == fd else err)
        if out < 0 and err < 0:
            self._outputs.pop(sid, None)
        else:
            self._outputs[sid] = (out, err)

    def _drain_outputs(self, sid: int) -> None:
        """Pass on what a rank that exited left in its pipes, then stop reading them (a process it started may
        still hold them open)."""
        out = self._outputs.get(sid, (-1, -1))[0]
        if out >= 0:
            self._read_output(out, sid, "stdout", until_empty=True)
        err = self._outputs.get(sid, (-1, -1))[1]
        if err >= 0:
            self._read_output(err, sid, "stderr", until_empty=True)
        for fd in self._outputs.pop(sid, (-1, -1)):
            if fd >= 0:
                self._selector.unregister(fd)
                os.close(fd)

    def _dispatch(self, kind: int, sid: int, body: bytes, fds: list[int]) -> None:
        if kind == P.FS_READY:
            self._ready.set()
            return
        sink, rank = self._sinks.get(sid, (None, -1))
        if kind == P.FS_SPAWNED:
            out, err = fds.pop(0), fds.pop(0)  # the rank's stdout and stderr pipes came with this frame
            for fd, stream in ((out, "stdout"), (err, "stderr")):
                os.set_blocking(fd, False)
                self._selector.register(fd, selectors.EVENT_READ, (sid, stream))
            self._outputs[sid] = (out, err)
            pid = json.loads(body)["pid"]
            self._pids[sid] = pid
            if sink is not None:
                sink.on_spawned(rank, pid)
        elif kind == P.FS_EXITED:
            self._drain_outputs(sid)  # what it printed before it exited comes first
            rc = json.loads(body)["returncode"]
            with self._cond:
                self._alive.discard(sid)
                self._sinks.pop(sid, None)
                self._pids.pop(sid, None)
                work = self._work.pop(sid, None)
                self._cond.notify_all()
            if work is not None:
                work.close()
            if sink is not None:
                sink.on_exit(rank, rc)

    def close(self) -> None:
        try:
            self._ctl.shutdown(socket.SHUT_WR)  # EOF: the fork server kills its ranks and exits
        except OSError:
            pass
        try:
            self.proc.wait(END_WAIT + 2)  # it ends what the ranks started first (worker/reaper.py), END_WAIT at most
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)
        # Its reader thread reports the ranks' exits: before this returns, so that they reach the mesh generation
        # they belong to (a restart right after, as in `shutdown(); %mesh restart`, would take a late one for its
        # own rank's death). Bounded: never a hang.
        if self._reader is not threading.current_thread():
            self._reader.join(READER_JOIN)


atexit.register(ForkServer.shutdown_all)


def fork_server_pid() -> int | None:
    """The pid of this kernel's fork server, or None when none runs."""
    with ForkServer._instance_lock:
        server = ForkServer._instance
    return None if server is None or server.proc.poll() is not None else server.proc.pid


def preload(modules: list[str]) -> None:
    """Have this kernel's fork server import ``modules`` (now if it runs, else when it starts), so that ranks forked
    from then on start with them instead of importing them themselves (Lightning: seconds per rank). Returns at once;
    the fork server imports them before it forks the next rank."""
    ForkServer.preload(modules)


def fork_server_clone(start_timeout: float = 60.0) -> socket.socket | None:
    """The control socket of a clone of this kernel's fork server (started now if none runs), for a host agent on
    this host (``ForkServer.clone``), or None when the fork server cannot be reached: the agent then starts a fork
    server of its own."""
    try:
        return ForkServer.get(start_timeout).clone()
    except OSError:
        return None


def prewarm(start_timeout: float = 60.0) -> None:
    """Start the local fork server now (it imports torch in the background); returns at once."""
    ForkServer.get(start_timeout)


def shutdown() -> None:
    """Stop the local fork server and every rank it started."""
    ForkServer.shutdown_all()


class LocalLauncher(Launcher):
    """Ranks on this host, forked by a fresh fork-server interpreter that imported torch once."""

    relays_output = True
    has_work_pipes = True

    def __init__(self, start_timeout: float = 60.0) -> None:
        self._fork_server = ForkServer.get(start_timeout)
        self._fork_server.wait_ready(start_timeout)
        self._sids: dict[int, int] = {}  # rank -> spawn id

    def warm(self, modules: list[str]) -> None:
        self._fork_server.import_modules(modules)

    def start(self, rank: int, env: dict[str, str], config: dict, sink: LauncherEvents) -> None:
        # This kernel reads the rank's stdout and stderr pipes itself: its main thread reports in records there.
        config = {**config, "output_records": True}
        self._sids[rank] = self._fork_server.spawn(rank, env, config, sink)

    def signal(self, rank: int, sig: int) -> None:
        if rank == -1:
            for sid in self._sids.values():
                self._fork_server.signal(sid, sig)
        elif rank in self._sids:
            self._fork_server.signal(self._sids[rank], sig)

    def wait(self, timeout: float) -> bool:
        return self._fork_server.wait_exit(set(self._sids.values()), timeout)

    def work_pipe(self, rank: int) -> WorkPipe | None:
        """The kernel's end of ``rank``'s work pipe (protocol.WORK_FD), or None when it has exited."""
        sid = self._sids.get(rank)
        return None if sid is None else self._fork_server.work_pipe(sid)

    def pids(self) -> dict[int, int]:
        """rank -> pid of the ranks still alive."""
        pids = {r: self._fork_server.pid_of(s) for r, s in self._sids.items()}
        return {r: pid for r, pid in pids.items() if pid is not None}
