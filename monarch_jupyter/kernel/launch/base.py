"""What every launcher shares: the small base class (start, signal, kill, wait; the shape of jupyter_client's
KernelProvisionerBase), the events a launcher reports, and the kernel's end of a local rank's work pipe.

Events from a launcher (output bytes, pid, exit status) go to a ``LauncherEvents`` sink, called from the
launcher's reader or waiter thread.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Protocol

from ...errors import MeshStartError

__all__ = ["Launcher", "LauncherEvents", "LaunchError", "WorkPipe"]


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

    def work_pipe(self, rank: int) -> WorkPipe | None:
        """The kernel's end of ``rank``'s work pipe (protocol.WORK_FD); None: work goes over the socket."""
        return None

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to ``rank``; ``rank`` -1 means every rank this launcher started."""
        raise NotImplementedError

    def kill(self) -> None:
        """Kill every rank (SIGKILL) without waiting."""
        self.signal(-1, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every rank has exited; True when they all have."""
        raise NotImplementedError


class WorkPipe:
    """The kernel's end of a local rank's work pipe (protocol.WORK_FD): ``send`` from any thread never blocks.

    What the pipe cannot take now (the rank is busy and the pipe's 64 KiB are full) waits here, in order, until
    ``flush`` (the mesh's I/O thread, when the pipe is writable) moves it on.
    """

    def __init__(self, fd: int) -> None:
        self.fd = fd
        os.set_blocking(fd, False)
        self._lock = threading.Lock()
        self._pending: list[memoryview] = []
        self.closed = False

    def send(self, data: bytes) -> bool:
        """Queue ``data`` (one framed message); False when part of it waits for ``flush``."""
        with self._lock:
            if self.closed:
                return True  # the rank is gone; its death is reported by the launcher
            if not self._pending:
                view = self._write(memoryview(data))
                if view is None:
                    return True
            else:
                view = memoryview(data)
            self._pending.append(view)
            return False

    def _write(self, view: memoryview) -> memoryview | None:
        """Write what the pipe takes now; the rest, or None when all of it went."""
        try:
            while view:
                view = view[os.write(self.fd, view):]
        except BlockingIOError:
            return view
        except OSError:  # the rank exited (EPIPE): nothing more to deliver
            self.closed = True
            self._pending.clear()
        return None

    def flush(self) -> bool:
        """Write what waits, as far as the pipe takes it; True when nothing waits any more."""
        with self._lock:
            while self._pending and not self.closed:
                rest = self._write(self._pending[0])
                if rest is not None:
                    self._pending[0] = rest
                    return False
                self._pending.pop(0)
            return True

    @property
    def pending(self) -> bool:
        return bool(self._pending)

    def close(self) -> None:
        with self._lock:
            if not self.closed:
                self.closed = True
                self._pending.clear()
                try:
                    os.close(self.fd)
                except OSError:
                    pass
