"""Values between the notebook and the ranks: push, scatter, pull, gather (the controller's side).

How the bytes travel (``via``; "auto" picks per value):

- ``shm``: every chosen rank is on this host and the value's tensor/array memory is at least
  ``shm.SHM_THRESHOLD`` bytes. The controller copies that memory once into a shared memory segment (one memcpy,
  into recycled pages when it can) and every rank maps the same segment copy-on-write: a push to N local ranks
  costs one copy, not N, and the ranks' values are views without a copy of their own.
- ``socket``: the out-of-band buffers travel as ZeroMQ frames to each rank (small values; ranks elsewhere).
- ``broadcast``: the bytes go once to one rank (the lowest chosen one on this host, else the lowest chosen), and
  the chosen ranks fan them out with ``torch.distributed.broadcast`` over their process group. "auto" uses it
  for large values to ``BROADCAST_MIN_RANKS`` or more ranks when some are on another host: the controller's link
  then carries the bytes once, and the ranks' interconnect (NCCL, or gloo over TCP) carries the rest. On one
  host it loses to ``shm`` (one memcpy against a copy per rank through the collective). bench/bench_tensors.py
  measures the routes; docs/transfers.md gives the figures behind the choice.

Pull and gather replies come back through a segment the rank writes (same host) or over the socket; the values
the notebook gets are views of the rank's segment until it drops them (then the rank may reuse the segment).

Threads: ``push``/``scatter``/``pull``/``gather`` run on the caller's thread; the segments and the replies are
segments.py's.
"""

from __future__ import annotations

import keyword
import logging
from collections.abc import Callable, Mapping
from typing import Any

from monarch_worker import protocol as P
from monarch_worker import shm
from monarch_worker.executor import MESH_NAMES
from monarch_worker.serialize import SerializationError, dumps

from ..errors import MeshError, RemoteError
from ..ranks import RankMap, parse_ranks, ranks_text
from .cells import CellHandle
from .config import check_timeout
from .segments import Segments
from .state import MeshState
from .waiting import Waiter

log = logging.getLogger(__name__)

__all__ = ["Transfers", "VIA", "choose_route", "split", "concat"]

VIA = ("auto", "shm", "socket", "broadcast")


class _Packed:
    """One value pickled for sending: its pickle, its out-of-band buffers and their layout in a segment."""

    def __init__(self, name: str, value: Any, what: str) -> None:
        try:
            self.data, self.buffers = dumps(value)
        except SerializationError as e:
            raise SerializationError(f"{what} {name!r}: {e}") from e.__cause__
        self.name = name
        self.layout, self.size = shm.layout_of(memoryview(b).nbytes for b in self.buffers)


class Transfers:
    """Push/scatter/pull/gather of one mesh, through its shared memory segments (segments.py) or the socket."""

    def __init__(self, state: MeshState, waiter: Waiter, segments: Segments, agent_held: Callable[[int], bool],
                 record: Callable[[dict[str, Any], list[int], str | None], None]) -> None:
        self.state = state
        self.waiter = waiter
        self.segments = segments
        self.agent_held = agent_held  # a host agent holds the rank (launch/hosts.py): one copy per host
        self.record = record  # what was bound where, for replacements (history.History.pushed)

    def _submit(self, per_rank: Mapping[int, tuple[P.Message, bytes, list]], cell_id: int, what: str,
                timeout: float | None) -> CellHandle:
        return self.waiter.submit(cell_id, _grouped(per_rank), what, timeout=timeout)

    def _wait(self, handle: CellHandle, timeout: float | None) -> RankMap | None:
        try:
            return self.waiter.result(handle.record,
                                      timeout if timeout is not None else (self.state.options.timeout or None))
        finally:
            self.segments.worked()

    # ------------------------------------------------------------------ routing

    def _route(self, size: int, chosen: list[int], via: str) -> str:
        remote = [r for r in chosen if not self.segments.shm_ok(r)]
        if via == "broadcast" and self.state.partition is not None:
            raise ValueError("via='broadcast' uses the mesh's process group, which a split mesh does not have "
                             "(submesh.py); use via='auto', or merge the mesh first")
        if via == "shm" and remote:
            raise ValueError(f"via='shm' needs every chosen rank on this host ({self.segments.host}) with shared "
                             f"memory; not so for {ranks_text(remote)}; use via='auto'")
        # Ranks elsewhere that a host agent holds get one copy per host, which the agent puts in shared memory:
        # only ranks that joined one process per rank count toward a broadcast.
        alone = [r for r in remote if not self.agent_held(r)]
        return choose_route(size, len(alone) + (len(chosen) - len(remote)), not alone, via)

    def _segment(self, packed: _Packed, holders: list[int]) -> dict | None:
        """Write ``packed``'s buffers into a segment lent to ``holders``; None (socket) when memory is short."""
        return self.segments.segment(packed.name, packed.buffers, packed.layout, packed.size, holders)

    # ------------------------------------------------------------------ push and scatter

    def push(self, values: dict[str, Any], ranks: Any, device: Any, timeout: float | None, via: str) -> None:
        if not values:
            raise ValueError("push needs at least one value: mesh.push(x=x) or mesh.push({'x': x})")
        for name in values:
            _check_name(name, bound=True)
        device = _device_spec(device)
        if via not in VIA:
            raise ValueError(f"via must be one of {', '.join(VIA)}; got {via!r}")
        check_timeout(timeout)
        chosen = parse_ranks(ranks, self.state.nproc)
        packed = [_Packed(name, value, "cannot push") for name, value in values.items()]
        payload = b"".join(p.data for p in packed)
        items: dict[int, list[dict]] = {r: [] for r in chosen}
        frames: dict[int, list] = {r: [] for r in chosen}
        lent: list[tuple[int, list[int]]] = []  # (segment id, holders) to give back if we fail before sending
        try:
            for p in packed:
                route = self._route(p.size, chosen, via)
                if route == "broadcast":
                    # The source gets the bytes on the socket: nothing can fail on it before the collective, which
                    # every chosen rank must enter.
                    src = min((r for r in chosen if self.segments.shm_ok(r)), default=chosen[0])
                    bcast = {"src": src, "group": chosen, "layout": p.layout, "size": p.size}
                    for r in chosen:
                        _add(items[r], frames[r], p, None, bcast, with_buffers=r == src)
                    continue
                here = {r for r in chosen if self.segments.shm_ok(r)}  # the others are held by host agents (frames)
                desc = self._segment(p, sorted(here)) if route == "shm" and here else None
                if desc is not None:
                    lent.append((desc["id"], sorted(here)))
                for r in chosen:
                    _add(items[r], frames[r], p, desc if r in here else None, None)
        except BaseException:
            self.segments.give_back(lent)
            raise

        def repack(r: int) -> tuple[list[dict], list, bytes]:
            its: list[dict] = []
            frs: list = []
            for p in packed:
                _add(its, frs, p, None, None)
            return its, frs, payload

        self._send(chosen, items, frames, dict.fromkeys(chosen, payload), device, "push of " + _names(values),
                   timeout, lent, repack)
        self.record(values, chosen, device)

    def scatter(self, name: str, value: Any, dim: int, ranks: Any, device: Any, timeout: float | None) -> None:
        _check_name(name, bound=True)
        device = _device_spec(device)
        check_timeout(timeout)
        chosen = parse_ranks(ranks, self.state.nproc)
        parts = split(name, value, len(chosen), dim)
        packed: dict[int, _Packed] = {}
        items: dict[int, list[dict]] = {}
        frames: dict[int, list] = {}
        lent: list[tuple[int, list[int]]] = []
        try:
            for r, part in zip(chosen, parts, strict=False):
                p = packed[r] = _Packed(name, part, "cannot scatter")
                desc = self._segment(p, [r]) if self._route(p.size, [r], "auto") == "shm" else None
                if desc is not None:
                    lent.append((desc["id"], [r]))
                items[r], frames[r] = [], []
                _add(items[r], frames[r], p, desc, None)
        except BaseException:
            self.segments.give_back(lent)
            raise

        def repack(r: int) -> tuple[list[dict], list, bytes]:
            its: list[dict] = []
            frs: list = []
            _add(its, frs, packed[r], None, None)
            return its, frs, packed[r].data

        self._send(chosen, items, frames, {r: packed[r].data for r in chosen}, device, f"scatter of {name!r}",
                   timeout, lent, repack)
        for r, part in zip(chosen, parts, strict=False):
            self.record({name: part}, [r], device)

    def _send(self, chosen: list[int], items: dict[int, list[dict]], frames: dict[int, list],
              payloads: dict[int, bytes], device: str | None, what: str, timeout: float | None,
              lent: list, repack: Callable[[int], tuple[list[dict], list, bytes]]) -> None:
        """Submit one Push per rank and wait until every rank bound the values. Ranks that could not map a
        segment get the same values over the socket (``repack(rank)``), once."""
        cell_id = next(self.state.ids)
        per_rank = {r: (P.Push(cell_id, items[r], device), payloads[r], frames[r]) for r in chosen}
        try:
            handle = self._submit(per_rank, cell_id, what, timeout)
        except BaseException:
            self.segments.give_back(lent)
            raise
        lent.clear()  # sent: each rank gives its segments back itself (or dies, and on_rank_exit does)
        try:
            self._wait(handle, timeout)
        except MeshError as e:
            retry = [r for r, err in e.errors.items()
                     if isinstance(err, RemoteError) and err.ename == "ShmUnavailableError"]
            if not retry:
                raise
            log.warning("rank(s) %s cannot map this kernel's shared memory (%s); they get values over the socket "
                        "from now on", retry, e.errors[retry[0]])
            self.segments.no_shm.update(retry)
            others = {r: err for r, err in e.errors.items() if r not in retry}
            cell_id = next(self.state.ids)
            resend = {}
            for r in retry:
                its, frs, data = repack(r)
                resend[r] = (P.Push(cell_id, its, device), data, frs)
            try:
                self._wait(self._submit(resend, cell_id, what, timeout), timeout)
            except MeshError as e2:
                others.update(e2.errors)
            if others:
                raise MeshError(others, e.results, what) from None

    # ------------------------------------------------------------------ pull and gather

    def pull(self, name: str, ranks: Any, timeout: float | None, op: str = "pull") -> RankMap:
        _check_name(name)
        check_timeout(timeout)
        chosen = parse_ranks(ranks, self.state.nproc)
        return self._pull(name, {r: self.segments.shm_ok(r) for r in chosen}, timeout, f"{op} of {name!r}")

    def _pull(self, name: str, use_shm: dict[int, bool], timeout: float | None, what: str) -> RankMap:
        cell_id = next(self.state.ids)
        per_rank: dict[int, tuple[P.Message, bytes, list]] = {
            r: (P.Pull(cell_id, name, shm=ok), b"", []) for r, ok in use_shm.items()}
        handle = self._submit(per_rank, cell_id, what, timeout)
        try:
            # The values must live only as long as the caller keeps them (they may be views of a rank's memory):
            # the mesh keeps its last handle (for late output), so the handle forgets them.
            return self._wait(handle, timeout) or RankMap()  # the record gave its values to the caller
        except MeshError as e:
            retry = [r for r, err in e.errors.items() if isinstance(err, RemoteError)
                     and err.ename == "ShmUnavailableError" and use_shm.get(r)]
            if not retry:
                raise
            self.segments.no_shm.update(retry)
            results = RankMap(e.results)
            others = {r: err for r, err in e.errors.items() if r not in retry}
            try:
                results.update(self._pull(name, dict.fromkeys(retry, False), timeout, what))
            except MeshError as e2:
                others.update(e2.errors)
                results.update(e2.results)
            if others:
                raise MeshError(others, RankMap(results), what) from None
            return RankMap(results)

    def gather(self, name: str, dim: int, ranks: Any, timeout: float | None) -> Any:
        parts = self.pull(name, ranks, timeout, op="gather")
        return concat(name, parts, dim)

    # ------------------------------------------------------------------ I/O thread and launcher events

# ---------------------------------------------------------------------- helpers (no mesh state)


BROADCAST_MIN_RANKS = 3
"""Fewest chosen ranks for which "auto" fans a large value out over the process group instead of sending it to
each rank: with N ranks elsewhere the socket path moves N copies over the controller's link, the broadcast one copy
plus a collective over the ranks' own interconnect, which is at least as fast as that link."""


def choose_route(size: int, nranks: int, all_local: bool, via: str = "auto") -> str:
    """How a value of ``size`` bytes (its out-of-band buffers) goes to ``nranks`` ranks: "shm", "socket" or
    "broadcast". An explicit ``via`` wins; "auto" keeps small values on the socket, uses shared memory when every
    rank is on this host, and a broadcast for large values to ``BROADCAST_MIN_RANKS`` or more ranks elsewhere."""
    if via != "auto":
        return via
    if size < shm.SHM_THRESHOLD:
        return "socket"
    if all_local:
        return "shm"
    return "broadcast" if nranks >= BROADCAST_MIN_RANKS else "socket"


def _grouped(per_rank: Mapping[int, tuple[P.Message, bytes, list]]) -> list[tuple[list[int], P.Message, bytes, list]]:
    """Ranks that get the same message, payload and buffers form one group (sent with one signature)."""
    groups: list[tuple[list[int], P.Message, bytes, list]] = []
    for r, (msg, payload, frames) in per_rank.items():
        for ranks, gmsg, gpayload, gframes in groups:
            if gmsg == msg and gpayload is payload and len(gframes) == len(frames) \
                    and all(a is b for a, b in zip(gframes, frames, strict=False)):
                ranks.append(r)
                break
        else:
            groups.append(([r], msg, payload, frames))
    return groups


def _check_name(name: Any, bound: bool = False) -> None:
    """``name`` is a variable name of a rank's namespace; ``bound``: one a push or scatter binds there, which must
    not be a name the mesh defines (it would change for every later cell)."""
    if not isinstance(name, str) or not name.isidentifier() or keyword.iskeyword(name):
        raise ValueError(f"{name!r} is not a valid Python variable name for a rank's namespace")
    if bound and name.startswith("__") and name.endswith("__"):
        raise ValueError(f"{name!r} is a special name of a rank's namespace (like __builtins__ or __name__): binding "
                         "it breaks every later cell there; send the value under another name (--as NAME)")
    if bound and name in MESH_NAMES:
        raise ValueError(f"{name!r} is a name the mesh defines on every rank ({', '.join(MESH_NAMES)}), and every "
                         "later cell would see the value sent instead: send it under another name (--as NAME, or "
                         f"push(other={name})), or assign {name} in a %%mesh cell if that is what you mean")


def _add(items: list[dict], frames: list, p: _Packed, desc: dict | None, bcast: dict | None,
         with_buffers: bool = True) -> None:
    """Append ``p`` to one rank's Push items: its bytes in segment ``desc``, or as socket frames."""
    if desc is not None:
        items.append({"name": p.name, "pickle": len(p.data), "nbufs": 0, "shm": desc, "bcast": bcast})
        return
    nbufs = len(p.buffers) if with_buffers else 0
    items.append({"name": p.name, "pickle": len(p.data), "nbufs": nbufs, "shm": None, "bcast": bcast})
    if nbufs:
        frames.extend(p.buffers)


def _names(values: dict) -> str:
    return ", ".join(repr(n) for n in values)


def _device_spec(device: Any) -> str | None:
    if device is None:
        return None
    if isinstance(device, str):
        return device
    if type(device).__name__ == "device" and type(device).__module__ == "torch":
        return str(device)
    raise TypeError(f"device must be None, 'rank', or a torch device (str or torch.device); got {device!r}")


def split(name: str, value: Any, n: int, dim: int) -> list:
    """``value`` cut into ``n`` parts along ``dim`` as torch.tensor_split does (the first parts one longer when
    it does not divide evenly). Tensors and NumPy arrays give views; lists and tuples (dim 0) give slices.

    Raises
    ------
    ValueError
        ``dim`` is out of range, or there are fewer elements along ``dim`` than ranks.
    TypeError
        ``value`` is not a tensor, array, list or tuple.
    """
    kind = type(value)
    if kind.__module__.startswith("torch") and kind.__name__ in ("Tensor", "Parameter"):
        shape = tuple(value.shape)
    elif kind.__module__ == "numpy" and kind.__name__ == "ndarray":
        shape = value.shape
    elif isinstance(value, (list, tuple)):
        shape = (len(value),)
    else:
        raise TypeError(f"scatter of {name!r}: cannot split a {kind.__module__}.{kind.__qualname__}; scatter takes "
                        "a torch.Tensor, a numpy.ndarray, a list or a tuple (push sends a whole value)")
    if not shape:
        raise ValueError(f"scatter of {name!r}: a 0-dim value has no dimension to split; use push")
    if not -len(shape) <= dim < len(shape):
        raise ValueError(f"scatter of {name!r}: dim {dim} is out of range for shape {shape}")
    dim %= len(shape)
    if shape[dim] < n:
        raise ValueError(
            f"scatter of {name!r}: {shape[dim]} element(s) along dim {dim} (shape {shape}) for {n} ranks; every "
            f"rank needs at least one: choose at most {shape[dim]} ranks or scatter along another dim")
    if isinstance(value, (list, tuple)):
        q, extra = divmod(len(value), n)
        parts, start = [], 0
        for i in range(n):
            stop = start + q + (1 if i < extra else 0)
            parts.append(value[start:stop])
            start = stop
        return parts
    if kind.__name__ == "ndarray":
        import numpy as np

        return np.array_split(value, n, axis=dim)
    import torch

    return list(torch.tensor_split(value.detach() if value.requires_grad else value, n, dim))


def concat(name: str, parts: RankMap, dim: int) -> Any:
    """Concatenate the ranks' parts in rank order along ``dim`` (tensors: torch.cat, arrays: numpy.concatenate,
    lists/tuples: one list).

    Raises
    ------
    TypeError
        The parts are not all tensors, all arrays or all lists.
    ValueError
        Their shapes do not fit together along ``dim`` (the message lists each rank's shape).
    """
    ranks = sorted(parts)
    values = [parts[r] for r in ranks]
    kinds = {type(v).__module__.split(".")[0] + "." + type(v).__name__ for v in values}
    shapes = ", ".join(f"rank {r}: {tuple(getattr(v, 'shape', ()))}" for r, v in zip(ranks, values, strict=False))
    if kinds <= {"torch.Tensor", "torch.Parameter"}:
        import torch

        if any(v.dim() == 0 for v in values):
            raise ValueError(f"gather of {name!r}: 0-dim tensors cannot be concatenated ({shapes}); use pull")
        tensors = [v.detach() if v.requires_grad else v for v in values]
        try:
            out = _cat_output(tensors, dim)
            return torch.cat(tensors, dim) if out is None else torch.cat(tensors, dim, out=out)
        except (RuntimeError, IndexError) as e:
            raise ValueError(f"gather of {name!r}: parts do not concatenate along dim {dim} ({shapes}): {e}"
                             ) from None
    if kinds == {"numpy.ndarray"}:
        import numpy as np

        try:
            return np.concatenate(values, axis=dim)
        except (ValueError, np.exceptions.AxisError) as e:
            raise ValueError(f"gather of {name!r}: parts do not concatenate along axis {dim} ({shapes}): {e}"
                             ) from None
    if all(isinstance(v, (list, tuple)) for v in values):
        if dim != 0:
            raise ValueError(f"gather of {name!r}: lists concatenate along dim 0 only, got dim {dim}")
        return [x for v in values for x in v]
    found = ", ".join(f"rank {r}: {type(v).__module__}.{type(v).__qualname__}"
                      for r, v in zip(ranks, values, strict=True))
    raise TypeError(f"gather of {name!r}: the parts must all be tensors, all numpy arrays or all lists ({found}); "
                    "use pull to get them as they are")


def _cat_output(tensors: list, dim: int) -> Any:
    """An empty CPU tensor for a large torch.cat result, in memory from NumPy's allocator, or None.

    NumPy asks the OS for huge pages for large arrays (madvise), which a fresh 64 MiB tensor from torch's
    allocator does not get: the page faults of the new memory are what a gather of 64 MiB mostly waits for.
    """
    import numpy as np
    import torch

    first = tensors[0]
    if any(t.dtype != first.dtype or t.device.type != "cpu" or t.dim() != first.dim() for t in tensors):
        return None
    dim %= first.dim()
    shape = list(first.shape)
    shape[dim] = sum(t.shape[dim] for t in tensors)
    nbytes = first.element_size() * int(np.prod(shape, dtype=np.int64))
    if nbytes < shm.SHM_THRESHOLD:
        return None
    return torch.from_numpy(np.empty(nbytes, dtype=np.uint8)).view(first.dtype).reshape(shape)
