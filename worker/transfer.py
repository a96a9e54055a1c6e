"""The rank's side of push, scatter, pull and gather (``Push``/``Pull`` messages; see protocol.py).

Both handlers run on the rank's main thread, in order with cells, through ``Rank.run_work``: a push binds its values
between the cells around it, a pull sees what the cells before it left, and either can be interrupted like a
cell. The bytes of a value arrive in one of three ways, chosen by the controller:

- shared memory (same host, large values): the segment the controller wrote is mapped copy-on-write and tensors
  and arrays are built on that memory without a copy (monarch_worker.shm);
- the socket: out-of-band ZeroMQ frames (small values, other hosts);
- a torch.distributed broadcast from one rank that received them (``bcast``): the controller sends the bytes once
  and the ranks fan them out over their process group.

Large pull replies travel back through a shared memory segment of this rank's own ``SegmentPool``.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

from . import protocol as P
from . import shm
from .serialize import SerializationError, dumps, loads

if TYPE_CHECKING:
    from .rankside import RankSide

log = logging.getLogger(__name__)

__all__ = ["RankTransfers", "resolve_device", "pool_stats", "CONTROLLER"]

CONTROLLER = "controller"
"""The holder name of segments this rank lends to the controller."""

RANK_CACHE_BYTES = min(shm.CACHE_BYTES, 512 << 20)
"""Bytes of released pull-reply segments a rank keeps for reuse."""


def resolve_device(spec: str | None, own: Any, rank: int) -> Any:
    """The torch.device a push targets on this rank: None keeps tensors where they arrive (the CPU).

    ``spec`` is None, "rank" (``own``: this rank's device, cuda:LOCAL_RANK or cpu) or a torch device string.

    Raises
    ------
    ValueError
        ``spec`` is not a device name.
    RuntimeError
        The device does not exist on this rank (e.g. "cuda" on a rank without GPUs).
    """
    if spec is None:
        return None
    import torch

    if spec == "rank":
        return own
    try:
        dev = torch.device(spec)
    except (RuntimeError, TypeError):
        raise ValueError(f"device {spec!r} is not a torch device; use None, 'rank', 'cpu', 'cuda' or 'cuda:N'"
                         ) from None
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise RuntimeError(f"device {spec!r}: rank {rank} has no CUDA device (torch.cuda.is_available() is "
                               f"False); use device='rank' (this rank's own device, {own}) or device='cpu'")
        if dev.index is not None and dev.index >= count:
            raise RuntimeError(f"device {spec!r}: rank {rank} sees {count} CUDA device(s) (cuda:0..cuda:{count - 1})")
    return dev


_current: RankTransfers | None = None


def pool_stats() -> dict[str, int]:
    """Statistics of this rank's pool of pull-reply segments (see SegmentPool.stats); call it from a cell."""
    stats = None if _current is None else _current.pool_stats()
    return stats or {"lent": 0, "lent_bytes": 0, "cached": 0, "cached_bytes": 0, "allocated": 0, "reused": 0}


def _writable(buf: Any) -> Any:
    """ZeroMQ frames are read-only; copy once so arrays and tensors built on them can be modified."""
    mv = memoryview(buf)
    return bytearray(mv) if mv.readonly else mv


class RankTransfers:
    """Transfer handlers of one rank; ``push``/``pull`` on the main thread, ``on_release`` on the I/O thread."""

    def __init__(self, rank: RankSide) -> None:
        global _current
        self.rank = rank
        self._pool: shm.SegmentPool | None = None
        self._groups: dict[tuple[int, ...], Any] = {}
        _current = self

    @property
    def pool(self) -> shm.SegmentPool:
        if self._pool is None:
            self._pool = shm.SegmentPool(cache_bytes=RANK_CACHE_BYTES)
        return self._pool

    def pool_stats(self) -> dict[str, int] | None:
        """Statistics of the pool of pull-reply segments (SegmentPool.stats); None before the first pull reply."""
        return None if self._pool is None else self._pool.stats()

    # ---- push (main thread)

    def push(self, msg: P.Push, payload: bytes, bufs: list) -> None:
        # Map every segment before anything else can fail, so each is given back exactly once: by its mapping's
        # finalizer when the values built on it are dropped, or here when it could not be mapped.
        mapped: dict[int, list] = {}
        failure: BaseException | None = None
        for i, item in enumerate(msg.items):
            desc = item.get("shm")
            if not desc:
                continue
            try:
                mapped[i] = shm.open_segment(desc, self._release_to_controller)
            except shm.ShmUnavailableError as e:
                self._release_to_controller(desc["id"])
                failure = failure or e

        def body() -> tuple[bool, Any]:
            assert self.rank.ns is not None
            buffers: dict[int, list] = {}
            nbuf = 0
            for i, item in enumerate(msg.items):
                if i in mapped:
                    buffers[i] = mapped.pop(i)
                elif item.get("bcast"):  # read once into the broadcast buffer: no writable copy needed
                    buffers[i] = bufs[nbuf:nbuf + item["nbufs"]]
                    nbuf += item["nbufs"]
                else:
                    buffers[i] = [_writable(b) for b in bufs[nbuf:nbuf + item["nbufs"]]]
                    nbuf += item["nbufs"]
            values: dict[str, Any] = {}
            try:
                # Every rank of a broadcast must enter it, so broadcasts come before anything that may raise.
                for i, item in enumerate(msg.items):
                    if item.get("bcast"):
                        buffers[i] = self._broadcast(item["bcast"], buffers.get(i, []))
                if failure is not None:
                    raise failure
                device = resolve_device(msg.device, self.rank.device, self.rank.rank)
                pos = 0
                for i, item in enumerate(msg.items):
                    data = payload[pos:pos + item["pickle"]]
                    pos += item["pickle"]
                    values[item["name"]] = loads(data, buffers.pop(i, []), device)
            except BaseException:
                # The error's traceback keeps this frame (post-mortem keeps the last failure): drop the views of the
                # mapped segments now, so their finalizers give them back, not whenever that traceback goes.
                buffers.clear()
                values.clear()
                raise
            self.rank.ns.ns.update(values)  # all names at once: a failed push binds none of them
            return False, None

        try:
            self.rank.run_work(msg.cell_id, body)
        finally:
            mapped.clear()

    def _broadcast(self, spec: dict, buffers: list) -> list:
        """Receive a value's buffers by a broadcast from rank ``spec["src"]`` over the process group."""
        import numpy as np
        import torch
        import torch.distributed as dist

        layout, size, src = spec["layout"], spec["size"], spec["src"]
        if size == 0:  # everything was in the pickle (every rank sees the same spec and skips alike)
            return []
        dest = np.empty(size, dtype=np.uint8)  # NumPy's allocator asks for huge pages: fewer page faults
        flat = torch.from_numpy(dest)
        if self.rank.rank == src:
            for buf, (offset, nbytes) in zip(buffers, layout, strict=False):
                np.copyto(dest[offset:offset + nbytes], np.frombuffer(memoryview(buf).cast("B"), dtype=np.uint8))
        buffers = []
        group = self._group(spec["group"])
        if dist.get_backend(group) == "nccl":  # NCCL moves CUDA memory only
            wire = flat.to(self.rank.device)
            dist.broadcast(wire, src, group=group)
            flat = wire.cpu()
        else:
            dist.broadcast(flat, src, group=group)
        whole = memoryview(flat.numpy().data)
        return [whole[offset:offset + nbytes] for offset, nbytes in layout]

    def _group(self, ranks: list[int]) -> Any:
        import torch.distributed as dist

        key = tuple(sorted(ranks))
        if key == tuple(range(dist.get_world_size())):
            return None
        if key not in self._groups:
            # Only the members call this (use_local_synchronization); every member sees the same pushes in the
            # same order, so they create their groups in the same order too.
            self._groups[key] = dist.new_group(list(key), use_local_synchronization=True)
        return self._groups[key]

    def _release_to_controller(self, seg_id: int) -> None:
        """A segment of the controller is no longer mapped here (any thread; from a finalizer)."""
        try:
            self.rank.send(P.ShmRelease(ids=[seg_id]))
        except Exception:  # noqa: BLE001 - at exit the outbox may be gone; the controller drops us then anyway
            pass

    # ---- pull (main thread)

    def pull(self, msg: P.Pull, payload: bytes, bufs: list) -> None:
        name = msg.name

        def body() -> tuple[bool, Any]:
            assert self.rank.ns is not None
            try:
                return True, self.rank.ns.ns[name]
            except KeyError:
                raise NameError(f"name {name!r} is not defined on rank {self.rank.rank}", name=name) from None

        def reply(result: P.Result, value: Any) -> None:
            self._reply(msg, result, value)

        self.rank.run_work(msg.cell_id, body, reply=reply)

    def _reply(self, msg: P.Pull, result: P.Result, value: Any) -> None:
        out = self.rank.outbox
        if result.status != "ok":
            out.put((P.PullReply(msg.cell_id, "error", result.error, result.duration), b"", []))
            return
        try:
            data, buffers = dumps(value)
        except SerializationError as e:
            err = {"type": "SerializationError", "module": "monarch_worker.serialize",
                   "message": f"{msg.name!r} cannot be sent to the notebook: {e}", "traceback": "",
                   "interrupted": False}
            out.put((P.PullReply(msg.cell_id, "error", err, result.duration), b"", []))
            return
        layout, total = shm.layout_of(memoryview(b).nbytes for b in buffers)
        if msg.shm and total >= shm.SHM_THRESHOLD and shm.supported():
            try:
                seg = self.pool.acquire_filled(buffers, layout, total)
            except shm.ShmError as e:
                log.warning("pull of %r goes over the socket, not through shared memory: %s", msg.name, e)
            else:
                self.pool.lend(seg, [CONTROLLER])
                reply = P.PullReply(msg.cell_id, "ok", duration=result.duration, shm=seg.describe(layout, total))
                out.put((reply, data, []))
                return
        # The I/O thread sends later; copy large buffers now so a following cell that changes the value in place
        # cannot change the bytes in flight.
        frames = [bytes(memoryview(b).cast("B")) for b in buffers]
        out.put((P.PullReply(msg.cell_id, "ok", duration=result.duration), data, frames))

    # ---- I/O thread

    def on_release(self, msg: P.ShmRelease, payload: bytes, bufs: list) -> None:
        """The controller dropped the values it built on these segments of ours."""
        if self._pool is None:
            return
        for seg_id in msg.ids:
            self._pool.give_back(int(seg_id), CONTROLLER)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.close()
