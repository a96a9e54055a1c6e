"""The rank side of the notebook's visual debugger: debugpy, loaded only when a debugger attaches.

Nothing here runs, and debugpy is not imported, until the kernel's debugger (JupyterLab's bug icon) asks for this
rank: then the kernel calls ``listen`` on the rank's main thread (an ordinary mesh call), which starts debugpy's
adapter on a loopback port and returns the port. Only the kernel connects to it (docs/debugging.md says why a
loopback port and what it exposes). The rank keeps listening until it ends; a later attach reuses the port.

``stop_here`` is what ``breakpoint()`` does while a debugger client is connected: it stops in that client,
as ipykernel's ``breakpoint()`` does for the kernel's own cells (without one, the rank's pdb prompt stays).
``post_mortem`` is ``%mesh debug`` then: it stops at the failing frame of a kept traceback.
"""

from __future__ import annotations

import os
import sys
import types
from typing import Any

__all__ = ["DebugpyMissing", "listen", "client_connected", "release_thread", "stop_here", "post_mortem"]

_PORT: list[int] = []  # the port of this rank's debugpy adapter, once it listens


class DebugpyMissing(ImportError):
    """debugpy cannot be imported on this rank."""


def listen(host: str = "127.0.0.1") -> int:
    """Start debugpy's adapter on ``host`` (loopback) in this rank, once; returns its TCP port.

    Runs on the rank's main thread, so that thread (the one that runs cells) is traced from here on.

    Raises
    ------
    DebugpyMissing
        debugpy is not installed in the rank's Python (``pip install 'monarch-jupyter[debug]'`` there).
    """
    if _PORT:
        sys.modules["debugpy"].trace_this_thread(True)  # pdb may have had this thread since the last client left
        return _PORT[0]
    hook = sys.breakpointhook  # the rank's (monarch_worker.debugger): debugpy puts its own in; the rank's decides
    try:
        import debugpy
    except ImportError as e:
        raise DebugpyMissing(
            f"debugpy is not installed in this rank's Python ({sys.executable}): the visual debugger needs it on "
            "every rank; install it there with  pip install 'monarch-jupyter[debug]'  (or pip install debugpy) "
            f"and restart the mesh ({e})") from None
    # Cells are compiled from strings, not frozen modules: pydevd's warning about frozen modules would only be noise
    # in every rank's output.
    os.environ.setdefault("PYDEVD_DISABLE_FILE_VALIDATION", "1")
    # The rank's own children (a DataLoader's workers, a TensorBoard server) are not debugged.
    debugpy.configure(subProcess=False)
    _host, port = debugpy.listen((host, 0))
    sys.breakpointhook = hook
    _PORT.append(int(port))
    return _PORT[0]


def client_connected() -> bool:
    """Whether a debugger client (the kernel, for the notebook's debugger) is connected to this rank now."""
    if not _PORT:
        return False
    debugpy: Any = sys.modules.get("debugpy")
    return bool(debugpy is not None and debugpy.is_client_connected())


def release_thread() -> None:
    """Let pdb trace this thread while no client is connected (a no-op where debugpy never listened here).

    Once debugpy listened, pydevd keeps tracing and ignores ``sys.settrace`` calls of others, also after its client
    left: the rank's pdb (``breakpoint()`` with no debugger attached) would never stop.
    """
    if not _PORT:
        return
    sys.modules["debugpy"].trace_this_thread(False)
    import pydevd_tracing  # type: ignore[import-not-found]  # on sys.path once debugpy was imported (listen)

    pydevd_tracing.restore_sys_set_trace_func()


def stop_here(frame: types.FrameType) -> None:
    """Stop in the connected debugger client at ``frame`` (``breakpoint()`` while one is connected).

    As ``debugpy.breakpoint()`` does, through pydevd's ``settrace`` (debugpy's own function would stop in the frame of
    the rank's hook that calls it, not in the user's).
    """
    import pydevd  # type: ignore[import-not-found]  # on sys.path once debugpy was imported (listen)

    pydevd.settrace(suspend=True, trace_only_current_thread=True, patch_multiprocessing=False, stop_at_frame=frame,
                    notify_stdin=False)


def post_mortem(exc: BaseException, tb: types.TracebackType) -> None:
    """Stop in the connected debugger client at the innermost frame of ``tb`` (``exc``'s traceback, from its first
    frame of notebook code), as ``pdb.post_mortem`` does: its frames and their variables can be inspected, not
    stepped through (they have finished). Returns when the client continues (or leaves); a no-op when none is
    connected.

    debugpy's ``trigger_exception_handler`` with ``as_uncaught=False`` stops whatever the client's exception
    breakpoint filters say (debugpy >= 1.8.22).
    """
    import debugpy

    debugpy.trigger_exception_handler((type(exc), exc, tb), as_uncaught=False)
