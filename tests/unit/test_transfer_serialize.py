"""Serialization of user values: out-of-band buffers for tensors and arrays, every dtype and layout kept."""

from __future__ import annotations

import pickle
import threading

import numpy as np
import pytest
import torch

from monarch_worker.serialize import OOB_THRESHOLD, SerializationError, dumps, loads

BIG = OOB_THRESHOLD // 4 * 4  # elements: at least OOB_THRESHOLD bytes for every dtype below


def roundtrip(value: object, device: object = None) -> object:
    data, buffers = dumps(value)
    # As on the wire: buffers arrive as separate, read-only frames.
    frames = [bytes(memoryview(b).cast("B")) for b in buffers]
    return loads(data, frames, device)


def oob_bytes(value: object) -> tuple[int, int]:
    """(pickle bytes, out-of-band bytes) of ``value``."""
    data, buffers = dumps(value)
    return len(data), sum(memoryview(b).nbytes for b in buffers)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.bool, torch.complex64,
                                   torch.complex128, torch.int8, torch.int64, torch.uint8])
def test_dtypes_travel_out_of_band_and_come_back_equal(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    t = (torch.randn(BIG, generator=g) * 10).to(dtype) if not dtype.is_complex else \
        torch.randn(BIG, dtype=dtype, generator=g)
    back = roundtrip(t)
    assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)
    pickled, oob = oob_bytes(t)
    assert oob == t.numel() * t.element_size()
    assert pickled < 1024, "the tensor's memory must not be copied into the pickle stream"


def test_contiguous_tensor_is_not_copied_on_the_sender() -> None:
    t = torch.arange(BIG, dtype=torch.float32)
    _, buffers = dumps(t)
    (buf,) = buffers
    assert np.frombuffer(buf, dtype=np.uint8).ctypes.data == t.data_ptr()


@pytest.mark.parametrize("make", [
    lambda: torch.arange(BIG * 2, dtype=torch.float32).reshape(-1, 64).t(),  # transposed
    lambda: torch.arange(BIG * 4, dtype=torch.float64)[::3],  # strided slice
    lambda: torch.randn(BIG, dtype=torch.complex64).conj(),  # lazy conjugate view
    lambda: -torch.randn(BIG, dtype=torch.complex64).conj().imag,  # negative view
], ids=["transposed", "strided", "conj", "neg"])
def test_non_contiguous_and_lazy_views_keep_their_values(make) -> None:  # type: ignore[no-untyped-def]
    t = make()
    back = roundtrip(t)
    assert back.shape == t.shape and back.dtype == t.dtype
    assert torch.equal(back, t.resolve_conj().resolve_neg())
    assert not back.is_conj() and back.is_contiguous()
    assert oob_bytes(t)[0] < 1024


@pytest.mark.parametrize("shape", [(0,), (0, 3), (5, 0, 2)])
def test_zero_size_tensors(shape: tuple[int, ...]) -> None:
    t = torch.empty(shape, dtype=torch.bfloat16)
    back = roundtrip(t)
    assert back.shape == t.shape and back.dtype == torch.bfloat16


def test_requires_grad_and_parameters() -> None:
    leaf = torch.randn(BIG, requires_grad=True)
    param = torch.nn.Parameter(torch.randn(BIG))
    frozen = torch.nn.Parameter(torch.randn(4), requires_grad=False)
    back = roundtrip({"leaf": leaf, "param": param, "frozen": frozen, "small": torch.ones(2, requires_grad=True)})
    assert back["leaf"].requires_grad and back["leaf"].is_leaf and torch.equal(back["leaf"], leaf)
    assert isinstance(back["param"], torch.nn.Parameter) and back["param"].requires_grad
    assert isinstance(back["frozen"], torch.nn.Parameter) and not back["frozen"].requires_grad
    assert back["small"].requires_grad
    assert oob_bytes(param)[0] < 1024


def test_module_state_dict_and_nested_containers() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(128, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10))
    value = {"sd": model.state_dict(), "arrays": [np.arange(BIG), (np.ones((3, 3)), "text")], "n": 3}
    back = roundtrip(value)
    assert list(back["sd"]) == list(model.state_dict())
    for k, v in model.state_dict().items():
        assert torch.equal(back["sd"][k], v)
    assert np.array_equal(back["arrays"][0], np.arange(BIG)) and back["arrays"][1][1] == "text"
    m2 = roundtrip(model)
    x = torch.randn(2, 128)
    assert torch.equal(m2(x), model(x))


def test_numpy_arrays_out_of_band_and_writable() -> None:
    a = np.arange(BIG, dtype=np.float32)
    assert oob_bytes(a)[0] < 1024
    back = roundtrip(a)
    assert np.array_equal(back, a)
    strided = np.arange(BIG * 4, dtype=np.int32).reshape(-1, 8)[:, ::2]  # NumPy alone would copy it in-band
    assert not strided.flags.c_contiguous
    pickled, oob = oob_bytes(strided)
    assert pickled < 1024 and oob == strided.nbytes
    assert np.array_equal(roundtrip(strided), strided)
    fortran = np.asfortranarray(np.arange(BIG, dtype=np.float64).reshape(-1, 16))
    assert np.array_equal(roundtrip(fortran), fortran)


def test_notebook_defined_class_travels_by_value() -> None:
    ns: dict = {"__name__": "__main__"}
    exec("class Point:\n    def __init__(self, x): self.x = x\n    def norm(self): return abs(self.x)\n", ns)
    p = ns["Point"](-3)
    data, _ = dumps(p)
    del ns
    back = pickle.loads(data)
    assert back.norm() == 3 and type(back).__name__ == "Point"


def test_device_builds_every_tensor_there() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(64, 1024)
    back = roundtrip({"m": model, "t": torch.ones(BIG), "a": np.ones(3)}, device=torch.device("meta"))
    assert back["m"].weight.device.type == "meta" and back["t"].device.type == "meta"
    assert isinstance(back["m"].weight, torch.nn.Parameter) and back["m"].weight.requires_grad
    assert isinstance(back["a"], np.ndarray)


def test_unpicklable_value_names_type_and_place() -> None:
    value = {"ok": torch.ones(3), "bad": [1, threading.Lock()]}
    with pytest.raises(SerializationError) as info:
        dumps(value)
    msg = str(info.value)
    assert "value['bad'][1]" in msg and "_thread.lock" in msg
    assert isinstance(info.value, TypeError)
