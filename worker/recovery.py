"""Faults on a rank: leaving a broken process group, joining a fresh one, and crash diagnostics.

When a rank of the mesh dies, every other rank's process group is broken: a collective that includes the dead
rank never completes. The controller then sends ``Abort`` to each survivor, and its I/O thread releases a main
thread blocked in a collective:

- NCCL: ``_abort_process_group`` aborts the communicators; the blocked collective returns with an error.
- gloo: neither ``abort()`` nor ``shutdown()`` releases a waiting collective (torch 2.13), and destroying the group
  closes nothing while any object still refers to it (a DDP model in the namespace, a kept traceback). But a gloo
  collective fails at once when one of its connections closes. So the I/O thread shuts down (``shutdown(2)``) the
  TCP connections that ``init_process_group`` opened (``GroupSockets``, recorded when the group was made): this
  rank's collective fails, and so does every peer's that waits on this rank.

The main thread then destroys the process group as soon as it is free (the cell was interrupted or its
collective failed). Every survivor keeps its namespace.

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
import time
from typing import TYPE_CHECKING, Any

from . import elastic_env
from . import protocol as P
from .executor import format_error

if TYPE_CHECKING:
    from .rankside import RankSide

log = logging.getLogger(__name__)

__all__ = ["prepare_process", "flush_c_stdio", "GroupSockets", "abort_communicators", "destroy_group", "regroup",
           "last_collective"]

_IOLBF = 1  # setvbuf mode: line buffered (glibc value)
_group_since_ns = 0  # wall clock (ns) when the current process group was made (GroupSockets)
# The flight recorder's pg_id (a count of the groups this process made) of the first group made with the current
# process group: entries of a lower id are of older groups, such as a dist.new_group kept over a regroup, whose
# name a fresh group reuses (names are counted from "0" again after destroy_process_group).
_first_pg_id = 0
_fflush = None  # libc's fflush, once prepare_process found it
# Process groups left after an Abort, kept alive for the rank's lifetime: a gloo group's destructor joins its work
# thread, which may still wait in a collective its peers abandoned (shutting its connections down does not always
# wake it), and the main thread would then never reach the fresh group. One stuck thread per such regroup is leaked.
_abandoned: list[Any] = []


def prepare_process() -> None:
    """Crash diagnostics for this rank process: faulthandler on stderr, line-buffered C stdout."""
    try:
        faulthandler.enable(file=sys.stderr, all_threads=False)
    except (RuntimeError, ValueError, OSError):
        pass  # stderr without a file descriptor
    global _fflush
    try:
        libc = ctypes.CDLL(None)
        _fflush = libc.fflush
        libc.setvbuf(ctypes.c_void_p.in_dll(libc, "stdout"), None, _IOLBF, 0)
    except (OSError, AttributeError, ValueError):
        pass  # not glibc: C stdout keeps its default buffering


def flush_c_stdio() -> None:
    """``fflush(NULL)``: what C code wrote through stdio and did not flush (a ``printf`` without a newline) goes to
    its file descriptor now. Called at the end of every cell, before its result, so that it shows in that cell."""
    if _fflush is not None:
        _fflush(None)


_TCP_LISTEN = "0A"  # socket state in /proc/net/tcp


def _tcp_inodes() -> set[int]:
    """Inodes of this process's TCP connections, listening sockets excluded (Linux /proc).

    gloo's listener must never be shut down: its accept() failing aborts the process."""
    inodes: set[int] = set()
    for name in ("tcp", "tcp6"):
        try:
            with open(f"/proc/self/net/{name}") as f:
                next(f)
                for line in f:
                    fields = line.split()
                    if fields[3] != _TCP_LISTEN:
                        inodes.add(int(fields[9]))
        except (OSError, StopIteration, IndexError, ValueError):
            pass
    return inodes


def _socket_fds() -> dict[int, int]:
    """socket inode -> file descriptor, for this process."""
    fds: dict[int, int] = {}
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:
        return fds
    for name in names:
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            fds[int(target[8:-1])] = int(name)
    return fds


class GroupSockets:
    """The TCP connections a process group opened, recorded around ``init_process_group``; ``cut`` shuts them
    down so that gloo collectives on them fail at once, here and on the peers (see the module docstring).

    Only sockets that appeared during the group's creation are touched: the controller's connection, the
    TCPStore client and sockets of the user's own code opened before or after are left alone.
    """

    def __init__(self) -> None:
        self._before: set[int] = set()
        self.inodes: set[int] = set()

    def __enter__(self) -> GroupSockets:
        global _group_since_ns, _first_pg_id
        self._before = _tcp_inodes()
        _group_since_ns = time.time_ns()  # the flight recorder's entries before this are of a destroyed group
        _first_pg_id = _next_pg_id()  # and those of groups made before, whenever they were issued
        return self

    def __exit__(self, *exc: object) -> None:
        self.inodes = _tcp_inodes() - self._before

    def record(self, make: Any, *args: Any, **kwargs: Any) -> Any:
        """``make(*args, **kwargs)`` (a group of the user's own: ``dist.new_group``), whose connections ``cut``
        shuts down too: a collective blocked on such a group is released, and one issued on it after the group it
        belongs to was re-created fails at once instead of pairing with one left in flight."""
        before = _tcp_inodes()
        try:
            return make(*args, **kwargs)
        finally:
            self.inodes |= _tcp_inodes() - before

    def cut(self) -> int:
        """Shut down every recorded connection still open (any thread); returns how many."""
        import socket as socketlib

        cut = 0
        live = _tcp_inodes()
        for inode, fd in _socket_fds().items():
            if inode not in self.inodes or inode not in live:
                continue
            try:
                dup = os.dup(fd)
            except OSError:
                continue  # closed meanwhile
            try:
                if os.fstat(dup).st_ino != inode:
                    continue  # the descriptor was reused for something else
                s = socketlib.socket(fileno=dup)
                dup = -1  # the socket object owns it now
                try:
                    s.shutdown(socketlib.SHUT_RDWR)
                    cut += 1
                except OSError:
                    pass  # a listening or already closed socket
                finally:
                    s.close()
            finally:
                if dup >= 0:
                    os.close(dup)
        self.inodes = set()
        return cut


def abort_communicators(reason: str, sockets: GroupSockets | None = None) -> None:
    """I/O thread: make a collective blocked on the main thread return (NCCL: abort the communicators; gloo:
    shut down the group's connections). A no-op when no process group exists."""
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return
    try:
        if dist.get_backend() == "nccl":
            log.warning("aborting NCCL communicators: %s", reason)
            dist.distributed_c10d._abort_process_group()
        elif sockets is not None:
            n = sockets.cut()
            log.info("shut down %d connections of the process group: %s", n, reason)
    except Exception:  # noqa: BLE001 - best effort; the main thread's destroy_group follows
        log.exception("aborting the process group failed")


def destroy_group(rank: RankSide, msg: P.Abort, payload: bytes, bufs: list) -> None:
    """Main thread: leave the broken process group (closing its connections releases waiting peers)."""
    import torch.distributed as dist

    groups = getattr(getattr(rank, "transfers", None), "_groups", None)
    if isinstance(groups, dict):
        _abandoned.extend(groups.values())
        groups.clear()  # sub-groups of the old process group (transfer broadcasts) die with it
    if dist.is_initialized():
        # The I/O thread cuts the connections when the Abort comes (abort_communicators), but only while the group
        # exists: a main thread that was idle (an Abort after the cells ended, the realign of an unmatched
        # collective) may destroy it first. Cut here too, or a collective left in flight on a dist.new_group group
        # keeps its connections, and the next one issued on that group waits for it forever.
        try:
            if dist.get_backend() != "nccl":
                rank.group_sockets.cut()
        except Exception:  # noqa: BLE001 - best effort, as in abort_communicators
            log.exception("rank %d: shutting down the process group's connections failed", rank.rank)
        _abandoned.append(dist.group.WORLD)  # never destroyed here (see _abandoned)
        try:
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001 - a broken group may fail to tear down cleanly; it is gone either way
            log.exception("rank %d: destroying the process group failed", rank.rank)
    log.info("rank %d left its process group: %s", rank.rank, msg.reason)


def regroup(rank: RankSide, msg: P.Regroup, payload: bytes, bufs: list) -> None:
    """Main thread: leave the current process group, join a fresh one, answer Ready (or StartFailed)."""
    import torch.distributed as dist

    try:
        groups = getattr(getattr(rank, "transfers", None), "_groups", None)
        if isinstance(groups, dict):
            groups.clear()
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
    rank.device = device  # rank.rank stays the controller's number for this rank (a sub-mesh numbers it anew)
    elastic_env.resized(rank=msg.rank, world_size=msg.world_size, local_rank=local_rank,
                        local_world_size=local_world, group_world_size=msg.group_world_size)  # after %mesh scale
    if rank.ns is not None:
        rank.ns.ns.update(device=device, rank=msg.rank, world_size=msg.world_size, local_rank=local_rank)
    rank.send(P.Ready(device=str(device), backend=backend, host=socket.gethostname(), pid=os.getpid()))


def last_collective() -> dict:
    """What this rank issued on its process groups: {"name", "seq", "group", "state", "groups", "source"} (and
    "complete" from the recorder) or {}.

    ``groups`` maps each process group to ``[seq, ranks, name]``: the sequence number of the newest collective
    this rank issued on it (counted per group as the rank enqueues them, before they complete), the group's global
    ranks ([] when unknown) and that collective's name ("gloo:all_reduce"). A rank that has issued a collective
    its peer never issued waits for that peer in it, whatever Python or C++ frame it waits in (a DDP reducer's
    hook, autograd's engine, ``Work.wait()``, a later NCCL synchronisation): the controller compares these numbers
    to release ranks that wait for one that raised (monarch_jupyter.kernel.recovery).

    ``source`` says where the numbers come from:

    - "recorder": torch.distributed's flight recorder (``collective_seq_id`` of its entries; gloo records from
      torch 2.8 on, with TORCH_FR_BUFFER_SIZE, which the controller sets). Point-to-point operations are left
      out (numbered apart, they pair with one peer only), and "name", "seq", "group" and "state" describe the
      newest entry, for stack reports. "complete" is False when the recorder's ring buffer is full of entries
      made since the group was: older ones of a group may have been dropped.
    - "sequence": each group's own count (``ProcessGroup._get_sequence_number_for_group``, in every torch this
      package supports), where the recorder has nothing: it counts point-to-point operations too, so the
      controller also asks that the count stood still between two questions. "name" is "gloo:collective".

    Safe on the I/O thread while the main thread blocks in a collective (the recorder has its own lock; a group's
    count is one integer).
    """
    dist = sys.modules.get("torch.distributed")
    if dist is None or not dist.is_available() or not dist.is_initialized():
        return {}
    groups = _group_table(dist)
    try:
        from torch._C import _distributed_c10d as c10d

        dump = c10d._dump_fr_trace_json  # type: ignore[attr-defined]  # the flight recorder; not in torch's stubs
        entries = json.loads(dump(True, False)).get("entries") or []
    except Exception:  # noqa: BLE001 - recorder off (TORCH_FR_BUFFER_SIZE=0) or not in this torch build
        entries = []
    size = int(os.environ.get("TORCH_FR_BUFFER_SIZE") or 0)
    # Nothing made since the group was dropped from the ring buffer: it still holds an older entry, or is not full.
    complete = not size or len(entries) < size or any(
        int(x.get("time_created_ns", 0)) < _group_since_ns for x in entries)
    entries = [x for x in entries if int(x.get("time_created_ns", 0)) >= _group_since_ns
               and int(x.get("pg_id", _first_pg_id)) >= _first_pg_id]
    if not entries:  # entries of a group destroyed by a regroup share the new one's name, not its numbering
        return _sequence_summary(dist, groups)
    e = max(entries, key=lambda x: (x.get("time_created_ns", 0), x.get("record_id", 0)))
    group = e.get("process_group") or ["", ""]
    newest: dict[str, tuple[int, str]] = {}  # group name -> (seq, profiling name) of its newest collective
    for x in entries:
        if x.get("is_p2p"):
            continue
        name = str((x.get("process_group") or [""])[0])
        seq = int(x.get("collective_seq_id", 0))
        if seq >= newest.get(name, (0, ""))[0]:
            newest[name] = (seq, str(x.get("profiling_name", "")))
    return {"name": str(e.get("profiling_name", "")), "seq": int(e.get("collective_seq_id", 0)),
            "group": str(group[1] if len(group) > 1 else group[0]), "state": str(e.get("state", "")),
            "source": "recorder", "complete": complete,
            "groups": {name: [seq, groups[name][1] if name in groups else [], what]
                       for name, (seq, what) in newest.items()}}


def _next_pg_id() -> int:
    """The flight recorder's id for the next group this process makes: one past the highest id it has seen (0 when
    it has seen none, or is off). A group made before and never used has no entries, so it may have an id at or
    above this one; a collective on it after a regroup is the first on it on every rank, so none is one ahead."""
    try:
        from torch._C import _distributed_c10d as c10d

        status = json.loads(c10d._dump_fr_trace_json(False, False)).get("pg_status") or {}  # type: ignore[attr-defined]
        return max((int(k) for k in status), default=-1) + 1
    except Exception:  # noqa: BLE001 - recorder off or not in this torch build: no id filter
        return 0


def _sequence_summary(dist: object, groups: dict[str, tuple[object, list[int]]]) -> dict:
    """``last_collective`` from each group's own count of the operations this rank issued on it ({} when this
    torch has no such count)."""
    out: dict[str, list] = {}
    for name, (pg, ranks) in groups.items():
        try:
            seq = int(pg._get_sequence_number_for_group())  # type: ignore[attr-defined]
            backend = str(dist.get_backend(pg))  # type: ignore[attr-defined]
        except Exception:  # noqa: BLE001 - a backend without a count, or a group being destroyed meanwhile
            continue
        if seq:
            out[name] = [seq, ranks, f"{backend}:collective"]
    if not out:
        return {}
    name, (seq, _, what) = max(out.items(), key=lambda kv: kv[1][0])
    return {"name": what, "seq": seq, "group": name, "state": "", "source": "sequence", "groups": out}


def _group_table(dist: object) -> dict[str, tuple[object, list[int]]]:
    """Process group name (as the flight recorder names it) -> (the group, its global ranks), for this rank's
    groups: the default group always (public API), the others from torch's own table of groups (there is no
    public list)."""
    out: dict[str, tuple[object, list[int]]] = {}
    try:
        world = dist.group.WORLD  # type: ignore[attr-defined]
        out[str(world.group_name)] = (world, list(range(dist.get_world_size())))  # type: ignore[attr-defined]
        c10d = dist.distributed_c10d  # type: ignore[attr-defined]
        names = dict(c10d._world.pg_names)  # a copy: the main thread may make a group meanwhile
        for pg, name in names.items():
            out[str(name)] = (pg, sorted(int(r) for r in c10d.get_process_group_ranks(pg)))
    except Exception:  # noqa: BLE001 - torch's bookkeeping differs or changed meanwhile: those ranks unknown
        pass
    return out
