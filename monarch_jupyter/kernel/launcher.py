"""Launchers start, signal and reap rank processes; one class per engine.

``Launcher`` is the small shared base (the shape of jupyter_client's KernelProvisionerBase). ``LocalLauncher``
starts ranks on this host through a fork server (:mod:`monarch_worker.zygote`) that is a fresh interpreter,
never a fork of the kernel: the kernel may hold CUDA contexts, OpenMP pools and threads that a forked child
would inherit broken.

Events from the launcher (output bytes, pid, exit status) go to a ``LauncherEvents`` sink, called from the
launcher's reader thread.
"""

from __future__ import annotations

import atexit
import itertools
import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from typing import Protocol

from monarch_worker import protocol as P

from ..errors import MeshStartError

log = logging.getLogger(__name__)

__all__ = ["Launcher", "LocalLauncher", "LauncherEvents", "LaunchError", "prewarm", "shutdown"]


class LaunchError(MeshStartError):
    """The launcher could not start ranks (the message says why and what to do)."""


class LauncherEvents(Protocol):
    """Receives launcher events; called from the launcher's reader thread."""

    def on_spawned(self, rank: int, pid: int) -> None: ...

    def on_output(self, rank: int, stream: str, data: bytes) -> None: ...

    def on_exit(self, rank: int, returncode: int) -> None: ...


class Launcher:
    """Start, signal and kill the ranks of one mesh generation."""

    #: True when the launcher relays rank output itself (ranks then need not send Stream messages).
    relays_output = False

    def start(self, rank: int, env: dict[str, str], config: dict, sink: LauncherEvents) -> None:
        raise NotImplementedError

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to ``rank``; ``rank`` -1 means every rank this launcher started."""
        raise NotImplementedError

    def kill(self) -> None:
        """Kill every rank (SIGKILL) without waiting."""
        self.signal(-1, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every rank has exited; True when they all have."""
        raise NotImplementedError


class _Zygote:
    """The kernel's handle on one fork server process; shared by every local mesh of this kernel.

    The reader thread owns the event pipe; ``_send`` (any thread) writes the control pipe under a lock.
    """

    _instance: _Zygote | None = None
    _instance_lock = threading.Lock()

    @classmethod
    def get(cls, start_timeout: float) -> _Zygote:
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
        ctl_r, self._ctl_w = os.pipe()
        self._ev_r, ev_w = os.pipe()
        env = dict(os.environ)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "monarch_worker.zygote"],
            stdin=ctl_r,
            stdout=ev_w,
            env=env,
            start_new_session=True,  # the kernel's SIGINT (sent to its process group) must not reach ranks
            close_fds=True,
        )
        os.close(ctl_r)
        os.close(ev_w)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        self._sinks: dict[int, tuple[LauncherEvents, int]] = {}  # spawn id -> (sink, rank)
        self._pids: dict[int, int] = {}  # spawn id -> pid
        self._alive: set[int] = set()
        self._cond = threading.Condition()
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._read_loop, name="monarch-zygote", daemon=True)
        self._reader.start()
        self._start_timeout = start_timeout

    def wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while not self._ready.wait(0.05):
            if self.proc.poll() is not None:
                raise LaunchError(
                    f"the local fork server exited with code {self.proc.returncode} while importing torch; "
                    f"run `{sys.executable} -c 'import torch, zmq, cloudpickle'` to see why"
                )
            if time.monotonic() > deadline:
                raise LaunchError(f"the local fork server did not import torch within {timeout:.0f} s")

    def _send(self, kind: int, sid: int, body: dict) -> None:
        frame = P.zygote_json(kind, sid, body)
        with self._lock:
            os.write(self._ctl_w, frame)

    def spawn(self, rank: int, env: dict, config: dict, sink: LauncherEvents) -> int:
        sid = next(self._ids)
        with self._cond:
            self._sinks[sid] = (sink, rank)
            self._alive.add(sid)
        self._send(P.Z_SPAWN, sid, {"env": env, "cwd": os.getcwd(), "sys_path": sys.path, "config": config})
        return sid

    def signal(self, sid: int, sig: int) -> None:
        try:
            self._send(P.Z_KILL, sid, {"signal": int(sig)})
        except OSError:
            pass  # the zygote is gone, and with it every rank

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
        hs = P.ZYGOTE_HEADER.size
        buf = b""
        while True:
            try:
                data = os.read(self._ev_r, 1 << 20)
            except OSError:
                data = b""
            if not data:
                break
            buf += data
            frames = []
            pos = 0
            while len(buf) - pos >= hs:
                kind, sid, n = P.ZYGOTE_HEADER.unpack_from(buf, pos)
                if len(buf) - pos < hs + n:
                    break
                frames.append((kind, sid, buf[pos + hs:pos + hs + n]))
                pos += hs + n
            buf = buf[pos:]
            for kind, sid, body in frames:
                self._dispatch(kind, sid, body)
        # The zygote is gone: every rank it had is gone too.
        with self._cond:
            lost = list(self._alive)
            self._alive.clear()
            self._cond.notify_all()
        for sid in lost:
            sink, rank = self._sinks.get(sid, (None, -1))
            if sink is not None:
                sink.on_exit(rank, -signal.SIGKILL)

    def _dispatch(self, kind: int, sid: int, body: bytes) -> None:
        if kind == P.Z_READY:
            self._ready.set()
            return
        sink, rank = self._sinks.get(sid, (None, -1))
        if kind in (P.Z_STDOUT, P.Z_STDERR):
            if sink is not None:
                sink.on_output(rank, "stdout" if kind == P.Z_STDOUT else "stderr", body)
        elif kind == P.Z_SPAWNED:
            pid = json.loads(body)["pid"]
            self._pids[sid] = pid
            if sink is not None:
                sink.on_spawned(rank, pid)
        elif kind == P.Z_EXITED:
            rc = json.loads(body)["returncode"]
            with self._cond:
                self._alive.discard(sid)
                self._sinks.pop(sid, None)
                self._pids.pop(sid, None)
                self._cond.notify_all()
            if sink is not None:
                sink.on_exit(rank, rc)

    def close(self) -> None:
        try:
            os.close(self._ctl_w)  # EOF: the zygote kills its ranks and exits
        except OSError:
            pass
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(5)


atexit.register(_Zygote.shutdown_all)


def prewarm(start_timeout: float = 60.0) -> None:
    """Start the local fork server now (it imports torch in the background); returns at once."""
    _Zygote.get(start_timeout)


def shutdown() -> None:
    """Stop the local fork server and every rank it started."""
    _Zygote.shutdown_all()


class LocalLauncher(Launcher):
    """Ranks on this host, forked by a fresh fork-server interpreter that imported torch once."""

    relays_output = True

    def __init__(self, start_timeout: float = 60.0) -> None:
        self._zygote = _Zygote.get(start_timeout)
        self._zygote.wait_ready(start_timeout)
        self._sids: dict[int, int] = {}  # rank -> spawn id

    def start(self, rank: int, env: dict[str, str], config: dict, sink: LauncherEvents) -> None:
        # The fork server relays the rank's stdout and stderr in order: its main thread reports in records.
        config = {**config, "output_records": True}
        self._sids[rank] = self._zygote.spawn(rank, env, config, sink)

    def signal(self, rank: int, sig: int) -> None:
        if rank == -1:
            for sid in self._sids.values():
                self._zygote.signal(sid, sig)
        elif rank in self._sids:
            self._zygote.signal(self._sids[rank], sig)

    def wait(self, timeout: float) -> bool:
        return self._zygote.wait_exit(set(self._sids.values()), timeout)

    def pids(self) -> dict[int, int]:
        """rank -> pid of the ranks still alive."""
        return {r: self._zygote._pids[s] for r, s in self._sids.items() if s in self._zygote._pids}
