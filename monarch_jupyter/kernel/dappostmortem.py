"""``%mesh debug`` in the visual debugger: a rank's post-mortem opens in JupyterLab's sidebar, not at pdb's prompt.

While a frontend's debugger is attached (``dap.attached_debugger``), ``%mesh debug [--rank R]`` stops rank R at the
failing frame of its last failed cell (``PostMortem.in_sidebar``): the rank starts its debugpy adapter without
dropping the traceback it keeps, the kernel's debugger attaches to it (``MeshDebugger.attach_ranks``), and the
rank stops there through debugpy (``monarch_worker.dapside.post_mortem``). The sidebar shows that frame's stack and
variables; Continue ends the post-mortem and the ``%mesh debug`` cell.
"""

from __future__ import annotations

from typing import Any

from ..errors import MonarchError
from . import dap
from .dapsession import SessionClosed

__all__ = ["open_in_sidebar"]


def open_in_sidebar(shell: Any, mesh: Any, rank: int | None) -> int | None:
    """Post-mortem of ``rank`` (None: the first rank that failed) in the attached visual debugger; returns the rank
    once Continue ended it, or None when no frontend's debugger is attached (then pdb is the way, as before). A rank
    on another host is reached through the mesh's own connection (``dap.connector``).

    Raises
    ------
    NothingToDebugError
        No rank keeps a traceback, or the rank's error has no frames of notebook code.
    MonarchError
        The rank is not idle, or the debugger could not attach to it (the message says why).
    ValueError
        ``rank`` is not a rank of this mesh.
    """
    dbg = dap.attached_debugger(shell)
    if dbg is None:
        return None

    def connect(r: int, port: int) -> None:
        pids = {k: s["pid"] for k, s in mesh.status().items()}
        dbg.events = mesh.events
        try:
            dbg.attach_ranks({r: port}, pids, dap.connector(mesh))
        except (OSError, TimeoutError, SessionClosed) as e:
            raise MonarchError(f"the debugger cannot attach to rank {r} for its post-mortem: {e}") from None
        print(f"rank {r} is stopped at the failing frame of its last cell: its stack and variables are in the "
              "debugger's sidebar; Continue ends the post-mortem", flush=True)

    return mesh.debugger.post_mortem_in_sidebar(rank, connect)
