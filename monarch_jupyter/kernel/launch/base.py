"""What every launcher shares: the small base class (start, signal, kill, wait; the shape of jupyter_client's
KernelProvisionerBase), the events a launcher reports, and the kernel's end of a local rank's work pipe
(``WorkPipe``, from monarch_worker.pipes: a host agent holds the same for the ranks of its host).

Events from a launcher (output bytes, pid, exit status) go to a ``LauncherEvents`` sink, called from the
launcher's reader or waiter thread.
"""

from __future__ import annotations

import signal
from typing import Protocol

from monarch_worker.pipes import WorkPipe

from ...errors import MeshStartError

__all__ = ["Launcher", "LauncherEvents", "LaunchError", "WorkPipe"]


class LaunchError(MeshStartError):
    """The launcher could not start ranks (the message says why and what to do)."""


class LauncherEvents(Protocol):
    """Receives launcher events; called from the launcher's reader thread."""

    def on_spawned(self, rank: int, pid: int) -> None: ...

    def on_output(self, rank: int, stream: str, data: bytes) -> None: ...

    def on_exit(self, rank: int, returncode: int, cause: str = "") -> None: ...


class Launcher:
    """Start, signal and kill the ranks of one mesh generation."""

    #: True when the launcher relays rank output itself (ranks then need not send Stream messages).
    relays_output = False
    #: True when ``work_pipe`` can return a pipe (the kernel writes work into local ranks' pipes).
    has_work_pipes = False

    def start(self, rank: int, env: dict[str, str], config: dict, sink: LauncherEvents) -> None:
        raise NotImplementedError

    def work_pipe(self, rank: int) -> WorkPipe | None:
        """The kernel's end of ``rank``'s work pipe (protocol.WORK_FD); None: work goes over the socket."""
        return None

    def signal(self, rank: int, sig: int) -> None:
        """Send ``sig`` to ``rank``; ``rank`` -1 means every rank this launcher started."""
        raise NotImplementedError

    def restartable(self, ranks: list[int]) -> str:
        """"" when ``start`` can give ``ranks`` fresh processes (``restart --rank``), else why not."""
        return ""

    def warm(self, modules: list[str]) -> None:
        """Have the ranks this launcher starts from now on begin with ``modules`` imported, where it can (a fork
        server imports them once; other launchers do nothing). Returns at once; never raises."""

    def kill(self) -> None:
        """Kill every rank (SIGKILL) without waiting."""
        self.signal(-1, signal.SIGKILL)

    def wait(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds until every rank has exited; True when they all have."""
        raise NotImplementedError
