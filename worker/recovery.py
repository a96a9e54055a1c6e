"""Faults on a rank: leaving a broken process group, joining a fresh one, and crash diagnostics.

When a rank of the mesh dies, every other rank's process group is broken: a collective that includes the dead
rank never completes. The controller then sends ``Abort`` to each survivor:

- its I/O thread aborts the NCCL communicators (``_abort_process_group``), which makes a collective blocked on
  the main thread return with an error. gloo's ``abort()`` does not release a waiting collective (torch 2.13),
  but a gloo collective fails at once when a peer closes its connection;
- its main thread, as soon as it is free (the cell was interrupted or its collective failed), destroys the
  process group. That closes its gloo connections, which releases the peers that were waiting on *it*, and so
  on around the ring: every survivor gets out of the collective, and keeps its namespace.

``Regroup`` (answered on the main thread) then joins a fresh process group with a new TCPStore, so restarted
ranks and survivors form one group again.

Diagnostics set up in every rank process (``prepare_process``): faulthandler writes the Python stack of a
segfault to stderr (relayed to the notebook with the rank's last output), C stdio is line-buffered so a C
extension's last ``printf`` lines reach the notebook even when the process dies without flushing, and
``last_collective`` reads torch.distributed's flight recorder (enabled by TORCH_FR_BUFFER_SIZE, which the
controller sets by default) for stack reports.
"""

from __future__ import annotations

import ctypes
import faulthandler
import json
import logging
import os
import socket
import sys
from typing import TYPE_CHECKING

from . import protocol as P
from .executor import format_error

if TYPE_CHECKING:
    from .runtime import Rank

log = logging.getLogger(__name__)

__all__ = ["prepare_process", "abort_communicators", "destroy_group", "regroup", "last_collective"]

_IOLBF = 1  # setvbuf mode: line buffered (glibc value)


def prepare_process() -> None:
    """Crash diagnostics for this rank process: faulthandler on stderr, line-buffered C stdout."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=False)
    except (RuntimeError, ValueError, OSError):
        pass  # stderr without a file descriptor
    try:
        libc = ctypes.CDLL(None)
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, _IOLBF, 0)
    except (OSError, AttributeError, ValueError):
        pass  # not glibc: C stdout keeps its default buffering


def abort_communicators(reason: str) -> None:
    """I/O thread: abort the NCCL communicators so a collective blocked on the main thread returns.

    A no-op for gloo (see the module docstring) and when no process group exists.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if dist.get_backend() != "nccl":
            return
        log.warning("aborting NCCL communicators: %s", reason)
        dist.distributed_c10d._abort_process_group()
    except Exception:  # noqa: BLE001 - best effort; the main thread's destroy_group follows
        log.exception("aborting the process group failed")


def destroy_group(rank: Rank, msg: P.Abort, payload: bytes, bufs: list) -> None:
    """Main thread: leave the broken process group (closing its connections releases waiting peers)."""
    import torch.distributed as dist

    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down cleanly; it is gone either way
            log.exception("rank %d: destroying the process group failed", rank.rank)
    log.info("rank %d left its process group: %s", rank.rank, msg.reason)


def regroup(rank: Rank, msg: P.Regroup, payload: bytes, bufs: list) -> None:
    """Main thread: leave the current process group, join a fresh one, answer Ready (or StartFailed)."""
    import torch.distributed as dist

    try:
        if dist.is_initialized():
            dist.destroy_process_group()
        local_rank = msg.local_rank if msg.local_rank >= 0 else int(os.environ.get("LOCAL_RANK", msg.rank))
        local_world = (msg.local_world_size if msg.local_world_size >= 0
                       else int(os.environ.get("LOCAL_WORLD_SIZE", msg.world_size)))
        device, backend = rank.init_group(msg.rank, msg.world_size, local_rank, local_world, msg.master_addr,
                                          msg.master_port, msg.backend)
    except BaseException as e:  # noqa: BLE001 - tell the controller why; the rank itself stays up
        rank.send(P.StartFailed(error=format_error(e)["traceback"]))
        return
    rank.rank = msg.rank
    rank.device = device
    if rank.ns is not None:
        rank.ns.ns["device"] = device
    rank.send(P.Ready(device=str(device), backend=backend, host=socket.gethostname(), pid=os.getpid()))


def last_collective() -> dict:
    """The newest entry of torch.distributed's flight recorder: {"name", "seq", "group", "state"} or {}.

    Safe on the I/O thread while the main thread blocks in a collective (the recorder has its own lock).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {}
    try:
        from torch._C import _distributed_c10d as c10d

        entries = json.loads(c10d._dump_fr_trace_json(True, False)).get("entries") or []
    except Exception:  # noqa: BLE001 - recorder off (TORCH_FR_BUFFER_SIZE=0) or not in this torch build
        return {}
    if not entries:
        return {}
    e = max(entries, key=lambda x: (x.get("time_created_ns", 0), x.get("record_id", 0)))
    group = e.get("process_group") or ["", ""]
    return {"name": str(e.get("profiling_name", "")), "seq": int(e.get("collective_seq_id", 0)),
            "group": str(group[1] if len(group) > 1 else group[0]), "state": str(e.get("state", ""))}
