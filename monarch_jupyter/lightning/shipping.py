"""Shipping a Lightning job from the notebook to the ranks, and keeping large data there by identity.

A job (the Trainer or Fabric object, the LightningModule, datamodule, dataloaders, callbacks, loggers: whatever
``fit`` was given) is pickled here with cloudpickle, so classes and functions defined in the notebook travel by
value. Two kinds of tensor are taken out of the pickle stream (``persistent_id``):

- **slots**: parameters, and other tensors of at least ``SLOT_THRESHOLD`` bytes that are not kept, go in a list
  beside the pickle; the mesh sends them out of band (no copy into the pickle bytes).
- **kept objects**: tensors (not parameters) and NumPy arrays of at least ``KEEP_THRESHOLD`` bytes, typically a
  data set held in the notebook. Each is sent once, under a token; ranks keep it, and later jobs send only the
  token while the notebook's object is the same one, unchanged. "Unchanged" is torch's version counter for a
  tensor (every in-place change bumps it; a rank that changed its copy in place gets it again) and a CRC-32 of
  the bytes for an array. Entries die with the notebook's object (a weak reference), and the ranks drop them at
  the next job. A rank that lost them (``%mesh restart``) says so and gets them again.

The model's parameters are always sent: the notebook's model is the source of truth for the next fit (the
weights it holds after a fit are rank 0's).
"""

from __future__ import annotations

import functools
import io
import itertools
import linecache
import marshal
import os
import pickle
import types
import weakref
import zlib
from collections import ChainMap
from dataclasses import dataclass, field
from typing import Any

import cloudpickle

__all__ = ["KEEP_THRESHOLD", "SLOT_THRESHOLD", "Shipment", "KeptObjects", "pickle_job"]

KEEP_THRESHOLD = 1 << 20
"""Tensors (other than parameters) and arrays of at least this many bytes are kept on the ranks by identity."""

SLOT_THRESHOLD = 64 * 1024
"""Tensors of at least this many bytes travel beside the pickle stream, out of band."""


@dataclass
class Shipment:
    """A pickled job: ``data`` (pickle bytes), ``slots`` (tensors sent out of band), ``tokens`` (kept objects it
    refers to), ``new`` (token -> object the ranks do not have yet), ``sources`` (filename -> source of the
    notebook cells whose code it carries, for tracebacks and pdb on the ranks)."""

    data: bytes
    slots: list
    tokens: list
    new: dict
    sources: dict = field(default_factory=dict)

    @property
    def new_bytes(self) -> int:
        return sum(_nbytes(v) for v in self.new.values())


def _nbytes(obj: Any) -> int:
    try:
        if hasattr(obj, "untyped_storage"):
            return int(obj.numel() * obj.element_size())
        return int(obj.nbytes)
    except Exception:  # noqa: BLE001
        return 0


_TOKENS = itertools.count(1)
"""Tokens of every table in this process: a rank keeps objects of several tables (the whole mesh's, its sub-mesh's),
so one table's token must never name another table's object."""


@dataclass
class _Entry:
    ref: Any
    token: int
    signature: tuple


class KeptObjects:
    """The notebook's half of the identity table of one mesh: id(object) -> token and signature.

    ``sent`` holds the tokens every rank received; a rank that reports them missing makes ``forget`` drop them
    so the next shipment sends them again.
    """

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}
        self._tokens = _TOKENS
        self.sent: set[int] = set()
        self.dropped: list[int] = []

    def lookup(self, obj: Any) -> tuple[int, bool]:
        """Token of ``obj`` and whether the ranks already have it."""
        signature = _signature(obj)
        entry = self._entries.get(id(obj))
        if entry is not None and (entry.ref() is not obj or entry.signature != signature):
            self._drop(id(obj))
            entry = None
        if entry is None:
            token = next(self._tokens)
            key = id(obj)
            try:
                ref = weakref.ref(obj, functools.partial(self._on_gone, key, token))
            except TypeError:
                return token, False
            entry = _Entry(ref, token, signature)
            self._entries[key] = entry
        return entry.token, entry.token in self.sent

    def _on_gone(self, key: int, token: int, _ref: Any) -> None:
        self._expired(key, token)

    def _expired(self, key: int, token: int) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.token == token:
            del self._entries[key]
        self.sent.discard(token)
        self.dropped.append(token)

    def _drop(self, key: int) -> None:
        entry = self._entries.pop(key, None)
        if entry is not None:
            self.sent.discard(entry.token)
            self.dropped.append(entry.token)

    def take_dropped(self) -> list[int]:
        out, self.dropped = self.dropped, []
        return out

    def forget(self, tokens: list[int]) -> None:
        for t in tokens:
            self.sent.discard(t)

    def __len__(self) -> int:
        return len(self._entries)


def _signature(obj: Any) -> tuple:
    import torch

    if isinstance(obj, torch.Tensor):
        return ("tensor", int(obj._version), obj.data_ptr(), tuple(obj.shape), tuple(obj.stride()), str(obj.dtype),
                str(obj.device))
    # NumPy arrays have no version counter: a CRC-32 of the bytes (about 1 ms per MiB) notices in-place changes.
    return ("array", obj.__array_interface__["data"][0], obj.shape, obj.strides, str(obj.dtype),
            zlib.crc32(memoryview(obj).cast("B")) if obj.flags.c_contiguous else id(obj))


def _reduce_code(code: types.CodeType) -> tuple:
    # Keep co_filename (cloudpickle renames it): tracebacks and pdb on the ranks show the notebook cell's lines.
    return marshal.loads, (marshal.dumps(code),)


class JobPickler(cloudpickle.Pickler):
    """cloudpickle with tensors and arrays out of the stream (see the module docstring)."""

    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def __init__(self, file: Any, kept: KeptObjects) -> None:
        super().__init__(file, protocol=pickle.HIGHEST_PROTOCOL)
        self.kept = kept
        self.slots: list = []
        self.slot_of: dict[int, int] = {}
        self.tokens: list[int] = []
        self.new: dict[int, Any] = {}
        self.filenames: set[str] = set()
        import torch

        self._torch = torch
        import numpy  # a declared dependency

        self._ndarray = numpy.ndarray

    def persistent_id(self, obj: Any) -> Any:
        torch = self._torch
        if isinstance(obj, torch.Tensor):
            cls = type(obj)
            if cls not in (torch.Tensor, torch.nn.Parameter) or obj.is_sparse or obj.layout != torch.strided:
                return None
            size = obj.numel() * obj.element_size()
            if cls is torch.Tensor and size >= KEEP_THRESHOLD and not obj.requires_grad:
                return self._kept(obj)
            if size >= SLOT_THRESHOLD or cls is torch.nn.Parameter:
                index = self.slot_of.get(id(obj))
                if index is None:
                    index = self.slot_of[id(obj)] = len(self.slots)
                    self.slots.append(obj)
                return ("slot", index)
            return None
        if type(obj) is self._ndarray and not obj.dtype.hasobject and obj.nbytes >= KEEP_THRESHOLD:
            return self._kept(obj)
        if isinstance(obj, types.CodeType):
            self.filenames.add(obj.co_filename)
        return None

    def _kept(self, obj: Any) -> tuple[str, int]:
        token, present = self.kept.lookup(obj)
        if token not in self.tokens:
            self.tokens.append(token)
            if not present:
                self.new[token] = obj
        return ("kept", token)


def pickle_job(job: Any, kept: KeptObjects) -> Shipment:
    """Pickle ``job`` for the ranks.

    Raises
    ------
    Exception
        Whatever pickling raised (``describe_unpicklable`` names the failing attribute; launch.py does that).
    """
    f = io.BytesIO()
    pickler = JobPickler(f, kept)
    pickler.dump(job)
    sources = {}
    for name in pickler.filenames:
        if name.startswith("<") or not os.path.exists(name):  # notebook cells (ipykernel keeps them in linecache)
            lines = linecache.getlines(name)
            if lines:
                sources[name] = "".join(lines)
    return Shipment(f.getvalue(), pickler.slots, list(pickler.tokens), dict(pickler.new), sources)
