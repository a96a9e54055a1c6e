"""Serialization of user values: cloudpickle, pickle protocol 5, out-of-band tensor and array buffers.

Tensors and NumPy arrays larger than ``OOB_THRESHOLD`` bytes travel as out-of-band buffers (PEP 574): the pickle
stream holds only a small header (dtype, shape, requires_grad) and the memory goes in separate frames without a
copy into the pickle bytes (the scheme of ipyparallel.serialize). CUDA tensors are copied to the CPU on the
sender; the receiver decides where to put them.

Functions and classes defined in a notebook (module ``__main__``) are pickled by value by cloudpickle, so they
can be called on ranks that never saw the notebook.

What travels out of band: the memory of every plain ``torch.Tensor`` (also inside ``nn.Parameter``, state dicts,
modules and any container), whatever its dtype (bool, bf16, fp16, complex included), layout in memory
(non-contiguous tensors and conjugate/negative views are made contiguous and resolved first) or size (zero-size
tensors have no buffer); and the memory of NumPy arrays of non-object dtype (non-contiguous ones made contiguous
first). ``requires_grad`` is kept. Tensor subclasses other than ``nn.Parameter``, sparse and quantized tensors use
torch's own pickling.

``loads(..., device=...)`` builds every tensor on that device as it is unpickled (CPU buffers are moved once, at
rebuild, so a CUDA model arrives on the GPU without a second pass over the object).
"""

from __future__ import annotations

import contextvars
import io
import marshal
import pickle
import types
from collections import ChainMap
from typing import Any

import cloudpickle

__all__ = ["OOB_THRESHOLD", "dumps", "loads", "SerializationError", "describe_unpicklable"]

OOB_THRESHOLD = 64 * 1024
"""Buffers of at least this many bytes travel out of band (a separate frame, no copy into the pickle)."""


class SerializationError(TypeError):
    """A value could not be pickled; the message names its type and where it sits in the container."""

    def _render_traceback_(self) -> list[str]:  # IPython: the message, not the pickler's frames
        return [f"SerializationError: {self}"]


# The device tensors are rebuilt on during one loads() call (None: the CPU, as received).
_target_device: contextvars.ContextVar[Any] = contextvars.ContextVar("monarch_target_device", default=None)


def _rebuild_tensor(buf: Any, dtype: str, shape: tuple, requires_grad: bool) -> Any:
    import torch

    dt = getattr(torch, dtype)
    mv = memoryview(buf).cast("B")
    if mv.nbytes == 0:
        t = torch.empty(shape, dtype=dt)
    else:
        if mv.readonly:
            # zmq frames are read-only; torch needs writable memory for a tensor users may modify.
            mv = memoryview(bytearray(mv))
        t = torch.frombuffer(mv, dtype=torch.uint8).view(dt).reshape(shape)
    device = _target_device.get()
    if device is not None and t.device != device:
        t = t.to(device)
    if requires_grad:
        t.requires_grad_(True)
    return t


def _reduce_tensor(t: Any) -> tuple:
    import torch

    data = t.detach()
    if data.is_sparse or data.layout != torch.strided or data.is_quantized:
        return NotImplemented
    if data.device.type != "cpu":
        data = data.cpu()
    # Conjugate and negative views are lazy flags on the tensor, not in its memory: resolve them, then copy a
    # non-contiguous tensor into one contiguous block (the only copy on the sender).
    data = data.resolve_conj().resolve_neg().contiguous()
    raw = data.reshape(-1).view(torch.uint8).numpy()
    dtype = str(data.dtype).removeprefix("torch.")
    return _rebuild_tensor, (pickle.PickleBuffer(raw), dtype, tuple(data.shape), bool(t.requires_grad))


def _reduce_code(code: types.CodeType) -> tuple:
    # cloudpickle (3.1+) renames every code object's file to "<dynamic-code>", which would hide the notebook
    # cell's source in tracebacks on the ranks. marshal keeps co_filename; ranks run the same Python version as
    # the notebook (cloudpickle's by-value pickles need that anyway).
    return marshal.loads, (marshal.dumps(code),)


def _reduce_ndarray(a: Any) -> Any:
    """Non-contiguous arrays: NumPy would copy them into the pickle stream; send a contiguous copy out of band."""
    import numpy as np

    if a.dtype.hasobject or a.flags.c_contiguous or a.flags.f_contiguous:
        return NotImplemented  # NumPy's own protocol-5 reduce already sends contiguous memory out of band
    return np.ascontiguousarray(a).__reduce_ex__(5)


class _Pickler(cloudpickle.Pickler):
    dispatch_table = ChainMap({types.CodeType: _reduce_code}, cloudpickle.Pickler.dispatch_table)

    def reducer_override(self, obj: Any) -> Any:
        cls = type(obj)
        module = cls.__module__
        if module == "torch" or module.startswith("torch."):
            import torch

            if cls is torch.Tensor:
                return _reduce_tensor(obj)
            # nn.Parameter keeps its type: torch reduces it to (its .data, requires_grad), and .data, a plain
            # Tensor, comes back here.
        elif module == "numpy" and cls.__name__ == "ndarray":
            return _reduce_ndarray(obj)
        return super().reducer_override(obj)


def dumps(obj: Any, threshold: int = OOB_THRESHOLD) -> tuple[bytes, list[pickle.PickleBuffer]]:
    """Pickle ``obj``; returns (pickle bytes, out-of-band buffers).

    Raises
    ------
    SerializationError
        The value (or something inside it) cannot be pickled; the message names its type and path.
    """
    buffers: list[pickle.PickleBuffer] = []

    def keep(buf: pickle.PickleBuffer) -> bool:
        if buf.raw().nbytes >= threshold:
            buffers.append(buf)
            return False
        return True

    f = io.BytesIO()
    try:
        _Pickler(f, protocol=5, buffer_callback=keep).dump(obj)
    except Exception as e:
        raise SerializationError(describe_unpicklable(obj, e)) from e
    return f.getvalue(), buffers


def loads(data: bytes, buffers: list | tuple = (), device: Any = None) -> Any:
    """Inverse of :func:`dumps`; with ``device`` (a torch.device or str), every tensor is built on that device.

    ``buffers`` are the out-of-band buffers in order (memoryviews, bytes, or zmq frame buffers). Tensors built
    on the CPU from writable buffers are views of that memory (no copy); read-only buffers are copied once.
    """
    if device is None:
        return pickle.loads(data, buffers=buffers)
    token = _target_device.set(device)
    try:
        return pickle.loads(data, buffers=buffers)
    finally:
        _target_device.reset(token)


def _find(obj: Any, path: str, depth: int) -> tuple[str, type] | None:
    """Depth-first search for the innermost element that fails to pickle."""
    if depth > 8:
        return None
    children: list[tuple[str, Any]] = []
    if isinstance(obj, dict):
        children = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
    elif hasattr(obj, "__dict__") and not isinstance(obj, type):
        children = [(f"{path}.{k}", v) for k, v in vars(obj).items()]
    for p, child in children:
        try:
            cloudpickle.dumps(child, protocol=5)
        except Exception:
            return _find(child, p, depth + 1) or (p, type(child))
    return None


def describe_unpicklable(obj: Any, error: BaseException) -> str:
    """A message naming the type of the value that cannot be pickled and where it sits inside ``obj``."""
    where = _find(obj, "value", 0)
    if where is None:
        return f"cannot pickle a value of type {type(obj).__module__}.{type(obj).__qualname__}: {error}"
    path, typ = where
    return (
        f"cannot pickle {path} of type {typ.__module__}.{typ.__qualname__} "
        f"(inside a {type(obj).__qualname__}): {error}"
    )
