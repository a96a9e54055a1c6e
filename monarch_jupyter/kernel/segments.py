"""The shared memory of one mesh's transfers (``Segments``): the pool of segments the controller lends to ranks on
this host, the ranks' segments the notebook maps for pulled values, and the heap trim after transfers.

Segments are per generation (``open`` at each start, ``close`` at each stop). Threads: ``segment`` and
``give_back`` run on the caller's thread; ``on_pull_reply`` and ``on_release`` on the mesh's I/O thread (or the
output reader); ``on_rank_exit`` on the launcher's reader thread; ``release_to`` from finalizers of pulled values,
on whatever thread drops them, maybe while it holds the mesh lock: it takes only this part's own lock, never the
mesh's. The segment pool is thread-safe. transfer.py moves the values; docs/transfers.md tells the routes.
"""

from __future__ import annotations

import functools
import logging
import socket
import threading
import warnings
from typing import Any

from monarch_worker import heap, shm
from monarch_worker import protocol as P

from .cells import CellTable
from .dispatch import Dispatcher
from .state import MeshState

log = logging.getLogger(__name__)

__all__ = ["Segments"]


class Segments:
    """Shared memory segments of one mesh's transfers (see the module docstring)."""

    def __init__(self, state: MeshState, dispatcher: Dispatcher, cells: CellTable) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.cells = cells
        self.pool = shm.SegmentPool()
        self.idle = heap.IdleTrim()  # polled by the I/O thread (idle_tick)
        self.host = socket.gethostname()
        self.no_shm: set[int] = set()  # ranks that could not map our segments: the socket from now on
        # Reentrant: release_to runs from finalizers, which garbage collection may call on a thread holding it.
        self._lock = threading.RLock()
        self._closed = True

    def open(self) -> None:
        """A new generation: a fresh segment pool."""
        with self._lock:
            if not self._closed:
                return
            self.pool = shm.SegmentPool()
            self.no_shm = set()
            self._closed = False

    def close(self) -> None:
        """The mesh stops: free every segment we hold (ranks' mappings die with them)."""
        with self._lock:
            self._closed = True
        self.pool.close()

    def shm_ok(self, rank: int) -> bool:
        """``rank`` maps this host's shared memory (it is on this host, and it could so far)."""
        info = self.state.ranks[rank]
        return shm.supported() and info.host == self.host and rank not in self.no_shm

    def segment(self, name: str, buffers: list, layout: Any, size: int, holders: list[int]) -> dict | None:
        """Write ``buffers`` (``layout``, ``size`` bytes in all) into a segment lent to ``holders``; its
        description, or None (send over the socket) when memory is short."""
        try:
            seg = self.pool.acquire_filled(buffers, layout, size)
        except shm.ShmError as e:
            warnings.warn(f"{name!r} ({size} bytes) goes over the socket, not through shared memory: {e}",
                          RuntimeWarning, stacklevel=5)
            return None
        self.pool.lend(seg, holders)
        return seg.describe(layout, size)

    def give_back(self, lent: list[tuple[int, list[int]]]) -> None:
        """Segments lent for a transfer that was not sent: back to the pool."""
        for seg_id, holders in lent:
            for r in holders:
                self.pool.give_back(seg_id, r)
        lent.clear()

    def worked(self) -> None:
        """A transfer ended: what it freed goes back to the OS once the kernel idles (heap.py)."""
        self.idle.worked()

    # ------------------------------------------------------------------ I/O thread and launcher events

    def on_pull_reply(self, rank: int, msg: P.PullReply, payload: bytes, bufs: list) -> None:
        """Map the rank's segment (or take the frames) and hand the reply to the mesh as a cell Result."""
        status, error, buffers = msg.status, msg.error, None
        if status == "ok" and msg.shm:
            try:
                buffers = shm.open_segment(msg.shm, functools.partial(self.release_to, rank))
            except shm.ShmUnavailableError as e:
                self.release_to(rank, msg.shm["id"])
                status = "error"
                error = {"type": "ShmUnavailableError", "module": "monarch_worker.shm",
                         "message": f"the notebook cannot map rank {rank}'s shared memory: {e}", "traceback": ""}
        elif status == "ok":
            buffers = [_writable(b) for b in bufs]
        result = P.Result(msg.cell_id, status, has_value=status == "ok", error=error, duration=msg.duration)
        self.cells.on_result(rank, result, payload, buffers or [])

    def release_to(self, rank: int, seg_id: int) -> None:
        """Tell ``rank`` we no longer map its segment (any thread; from a finalizer, maybe long after)."""
        with self._lock:
            if self._closed:
                return
            if rank in self.state.ranks:
                self.dispatcher.post(rank, P.ShmRelease(ids=[seg_id]))

    def on_release(self, rank: int, msg: P.ShmRelease, payload: bytes, bufs: list) -> None:
        """``rank`` dropped the values it built on these segments of ours."""
        for seg_id in msg.ids:
            self.pool.give_back(int(seg_id), rank)

    def idle_tick(self, now: float) -> None:
        """I/O thread, once per heartbeat interval: give freed heap memory back if idle since a transfer (heap)."""
        self.idle.maybe_trim()

    def on_rank_exit(self, rank: int) -> None:
        self.pool.drop_holder(rank)


def _writable(buf: Any) -> Any:
    mv = memoryview(buf)
    return bytearray(mv) if mv.readonly else mv
