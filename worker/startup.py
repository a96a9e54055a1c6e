"""The start of a rank process: its environment and streams, then the Rank runtime until it stops.

``run_rank`` is what the fork server's child (local ranks) and ``python -m monarch_worker`` (ranks that join) run.
"""

from __future__ import annotations

import io
import os
import signal
import sys
from typing import Any

from . import display, elastic_env, live, recovery
from . import protocol as P
from .config import RankConfig
from .elastic_env import apply_thread_settings
from .executor import format_error
from .runtime import JoinRejected, Rank

__all__ = ["run_rank", "apply_thread_settings"]


class OrderedStderr(io.RawIOBase):
    """Python-level stderr of a rank whose stdout pipe is read by its controller or host agent: what is written
    goes into the stdout pipe as embedded pieces (protocol.err_pieces, each one atomic write), so a progress bar on
    stderr and the prints around it show in the order the rank wrote them. ``fileno()`` is still fd 2: C code and
    subprocesses given it write to the stderr pipe, as before."""

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return 2

    def isatty(self) -> bool:
        return False

    def write(self, data: Any) -> int:
        data = bytes(data)
        for piece in P.err_pieces(data):
            view = memoryview(piece)
            while view:  # a piece is at most PIPE_BUF bytes: one write on a blocking pipe, in practice
                view = view[os.write(1, view):]
        return len(data)


def _unbuffered_std_streams(ordered_stderr: bool) -> None:
    """Python-level prints go straight to fds 1 and 2, in order with C-level writes to the same fds; with
    ``ordered_stderr``, Python-level stderr goes into the stdout pipe, in order with stdout (OrderedStderr)."""
    for fd, name in ((1, "stdout"), (2, "stderr")):
        raw: Any = OrderedStderr() if fd == 2 and ordered_stderr else io.FileIO(fd, "w", closefd=False)
        stream = io.TextIOWrapper(raw, encoding="utf-8", errors="backslashreplace", write_through=True,
                                  line_buffering=False)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def run_rank(config: RankConfig) -> int:
    """Run one rank to completion; returns the process exit code (2: the controller did not admit it)."""
    os.environ.update(config.env)
    apply_thread_settings()
    relay = None
    if config.relay_output:
        from .relay import OutputRelay

        relay = OutputRelay(tee=config.relay_tee)  # fds 1 and 2 feed it from now on
    # A rank that relays its own output (one process per rank) keeps its stderr on fd 2: its relay may tee both
    # streams to a terminal as they are.
    _unbuffered_std_streams(ordered_stderr=relay is None)
    recovery.prepare_process()
    rank = Rank(config)
    signal.signal(signal.SIGINT, rank.on_sigint)
    live.install(rank.send, lambda: rank.current_cell)
    rank.group.current_cell = lambda: rank.current_cell  # its notes show once per cell
    if relay is not None:
        relay.start(rank.outbox)
        rank.relay = relay
    rank.start_io()
    code = 0
    try:
        rank.join()
    except JoinRejected as e:
        sys.stderr.write(f"monarch_worker: not admitted to the mesh: {e}\n")
        code = 2
    except BaseException as e:  # noqa: BLE001 - tell the controller why, then exit
        err = format_error(e)
        sys.stderr.write(err["traceback"])
        rank.send(P.StartFailed(error=err["traceback"]))
        code = 1
    else:
        rank.debugger.install()
        rank.rich = display.Publisher(lambda msg, bufs: rank.send(msg, buffers=bufs), lambda: rank.current_cell,
                                      lambda: rank.transfers.pool, lambda: rank.writes_records)
        display.install(rank.rich, rank.ns.ns if rank.ns is not None else None)
        rank.serve()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:  # noqa: BLE001 - a user may have replaced or closed it
            pass
    recovery.flush_c_stdio()  # os._exit does not flush C stdio
    if relay is not None:
        relay.flush(1.0)
    rank.send(P.Goodbye(returncode=code))
    rank.close(2.0)
    elastic_env.cleanup()
    return code
