"""push / scatter / pull / gather on real ranks, through the Python API and through the magics."""

from __future__ import annotations

import gc
import os
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell

from monarch_jupyter import (
    Mesh,
    MeshError,
    RankMap,
    RemoteError,
    load_ipython_extension,
)
from monarch_worker import shm
from monarch_worker.serialize import SerializationError

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux memfd_create and /proc")

MiB = 1 << 20

# Helpers defined on every rank and in this process: a byte-exact description of a value, and whether a tensor's
# memory lies in a shared memory segment.
HELPERS = textwrap.dedent('''
    def _digest(v):
        import hashlib, numpy, torch
        if isinstance(v, torch.Tensor):
            c = v.detach().resolve_conj().resolve_neg().contiguous()
            raw = c.reshape(-1).view(torch.uint8).numpy().tobytes() if c.numel() else b""
            return ("tensor", type(v).__name__, str(v.dtype), tuple(v.shape), v.requires_grad,
                    hashlib.sha256(raw).hexdigest())
        if isinstance(v, numpy.ndarray):
            return ("ndarray", str(v.dtype), v.shape, hashlib.sha256(numpy.ascontiguousarray(v).tobytes()).hexdigest())
        if isinstance(v, dict):
            return {k: _digest(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)):
            return [_digest(x) for x in v]
        return repr(v)

    def _in_shm(t):
        from monarch_worker import shm
        p = t.data_ptr()
        for line in shm.memfd_mappings():
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= p < hi:
                return True
        return False
''')
_ns: dict[str, Any] = {}
exec(HELPERS, _ns)
digest, in_shm = _ns["_digest"], _ns["_in_shm"]


@pytest.fixture(scope="module")
def tmesh() -> Iterator[Mesh]:
    m = Mesh(4, start_timeout=120)
    try:
        m.run(HELPERS)
        yield m
    finally:
        m.stop()


def on_ranks(m: Mesh, code: str, **kw: Any) -> Any:
    return m.run(textwrap.dedent(code), **kw)


def wait_for(predicate: Any, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        gc.collect()
        time.sleep(0.05)
    return predicate()


def notebook_class() -> type:
    ns: dict[str, Any] = {"__name__": "__main__"}
    exec("class Point:\n    def __init__(self, x): self.x = x\n    def norm(self): return abs(self.x)\n"
         "    def __repr__(self): return f'Point({self.x})'\n", ns)
    return ns["Point"]


def every_kind() -> dict[str, Any]:
    g = torch.Generator().manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10))
    return {
        "f32": torch.randn(MiB // 4, generator=g),  # 1 MiB: shared memory
        "bf16": torch.randn(1000, generator=g).bfloat16(),  # small: socket
        "big_bf16": torch.randn(MiB, generator=g).bfloat16(),
        "fp16": torch.randn(MiB, generator=g).half(),
        "mask": torch.rand(2 * MiB, generator=g) > 0.5,
        "cplx": torch.randn(MiB // 8, dtype=torch.complex64, generator=g),
        "conj": torch.randn(MiB // 8, dtype=torch.complex64, generator=g).conj(),
        "tr": torch.randn(1024, 512, generator=g).t(),
        "empty": torch.empty(0, 3),
        "grad": torch.randn(MiB // 4, generator=g).requires_grad_(),
        "param": torch.nn.Parameter(torch.randn(MiB // 4, generator=g)),
        "arr": np.arange(MiB // 4, dtype=np.float64),
        "strided_arr": np.arange(MiB, dtype=np.int32).reshape(-1, 8)[:, ::2],
        "nested": {"a": [np.ones(3), torch.ones(2)], "s": "text", "t": (1, torch.zeros(MiB // 2))},
        "sd": model.state_dict(),
        "obj": notebook_class()(-3),
    }


# ---------------------------------------------------------------------------------------------------- push


def test_push_every_kind_of_value_and_pull_it_back(tmesh: Mesh) -> None:
    values = every_kind()
    tmesh.push(values)
    names = ", ".join(values)
    on_rank = on_ranks(tmesh, f"{{k: _digest(v) for k, v in zip({list(values)!r}, [{names}])}}")
    expected = {k: digest(v) for k, v in values.items()}
    for r in range(4):
        assert on_rank[r] == expected
    assert on_ranks(tmesh, "(obj.norm(), type(obj).__name__, isinstance(param, torch.nn.Parameter))") == \
        dict.fromkeys(range(4), (3, "Point", True))
    for name, value in values.items():
        back = tmesh.pull(name, ranks=2)
        assert isinstance(back, RankMap) and list(back) == [2]
        assert digest(back[2]) == digest(value), name


def test_large_values_are_views_of_one_segment_and_stay_each_ranks_own(tmesh: Mesh) -> None:
    x = torch.arange(MiB, dtype=torch.float32)
    tmesh.push(x=x, small=torch.ones(10))
    assert on_ranks(tmesh, "(_in_shm(x), _in_shm(small))") == dict.fromkeys(range(4), (True, False))
    assert tmesh.transfers.segments.pool.stats()["lent"] >= 1
    on_ranks(tmesh, "x += 1", ranks=0)  # copy-on-write: rank 0 gets private pages
    sums = on_ranks(tmesh, "x[:4].tolist()")
    assert sums[0] == [1.0, 2.0, 3.0, 4.0]
    assert sums[1] == sums[2] == sums[3] == [0.0, 1.0, 2.0, 3.0]
    assert x[:4].tolist() == [0.0, 1.0, 2.0, 3.0]


def test_push_to_some_ranks_and_devices(tmesh: Mesh) -> None:
    tmesh.push(only13=torch.ones(3), ranks="1,3")
    assert on_ranks(tmesh, "'only13' in globals()") == {0: False, 1: True, 2: False, 3: True}
    w = torch.ones(MiB)
    tmesh.push(w=w, device="rank")
    assert on_ranks(tmesh, "(str(w.device), _in_shm(w))") == dict.fromkeys(range(4), ("cpu", True))
    tmesh.push({"w": w, "m": torch.nn.Linear(4, 4)}, device=torch.device("meta"))
    assert on_ranks(tmesh, "(w.device.type, m.weight.device.type)") == dict.fromkeys(range(4), ("meta", "meta"))


def test_cuda_on_a_mesh_without_gpus_is_a_clear_per_rank_error(tmesh: Mesh) -> None:
    tmesh.push(before=torch.zeros(2))
    lent = tmesh.transfers.segments.pool.lent_ids()
    with pytest.raises(MeshError) as info:
        tmesh.push(before=torch.ones(2), extra=torch.ones(MiB), device="cuda")
    assert sorted(info.value.errors) == [0, 1, 2, 3]
    for r, err in info.value.errors.items():
        assert isinstance(err, RemoteError) and err.ename == "RuntimeError"
        assert f"rank {r} has no CUDA device" in err.evalue and "device='rank'" in err.evalue
    # Nothing was bound (a push binds all its values or none), and the mesh works.
    assert on_ranks(tmesh, "(before.tolist(), 'extra' in globals())") == {r: ([0.0, 0.0], False) for r in range(4)}
    with pytest.raises(MeshError, match="not a torch device"):
        tmesh.push(y=torch.ones(2), device="gpu please")
    with pytest.raises(TypeError, match="device must be"):
        tmesh.push(y=torch.ones(2), device=3)
    # Every rank gave the failed push's segment back (segments lent before it may come back meanwhile, under load).
    assert wait_for(lambda: not tmesh.transfers.segments.pool.lent_ids() - lent)


def test_bad_names_and_routes(tmesh: Mesh) -> None:
    with pytest.raises(ValueError, match="not a valid Python variable name"):
        tmesh.push({"not a name": 1})
    with pytest.raises(ValueError, match="at least one value"):
        tmesh.push()
    with pytest.raises(ValueError, match="via must be one of"):
        tmesh.push(a=1, via="carrier pigeon")
    with pytest.raises(ValueError, match="not in this mesh"):
        tmesh.push(a=1, ranks=7)
    for name in ("rank", "world_size", "dist"):  # the mesh's own names: every later cell would see the value sent
        with pytest.raises(ValueError, match=f"'{name}' is a name the mesh defines on every rank"):
            tmesh.push({name: 7})
    with pytest.raises(ValueError, match="'device' is a name the mesh defines"):
        tmesh.scatter("device", torch.arange(4))
    for name in ("__builtins__", "__name__"):  # binding one breaks every later cell on the rank
        with pytest.raises(ValueError, match=f"'{name}' is a special name of a rank's namespace"):
            tmesh.push({name: 7})
    assert tmesh.run("(rank, world_size)") == {r: (r, 4) for r in range(4)}


def test_unpicklable_values_name_their_type_and_place(tmesh: Mesh) -> None:
    with pytest.raises(SerializationError) as info:
        tmesh.push(ok=torch.ones(2), bad={"inner": [1, threading.Lock()]})
    msg = str(info.value)
    assert "'bad'" in msg and "value['inner'][1]" in msg and "_thread.lock" in msg
    assert on_ranks(tmesh, "'bad' in globals()") == dict.fromkeys(range(4), False)
    on_ranks(tmesh, "import threading; lk = [threading.Lock()]")
    with pytest.raises(MeshError) as info2:
        tmesh.pull("lk", ranks="0,1")
    err = info2.value.errors[0]
    assert err.ename == "SerializationError" and "'lk'" in err.evalue and "_thread.lock" in err.evalue
    assert tmesh.run("1") == dict.fromkeys(range(4), 1)


def test_broadcast_and_socket_routes_give_the_same_values(tmesh: Mesh) -> None:
    x = torch.randn(MiB // 2, dtype=torch.float64)
    for via, ranks in (("broadcast", None), ("broadcast", "1-3"), ("socket", None), ("shm", "0,2")):
        tmesh.push(rx=x, via=via, ranks=ranks)
        got = on_ranks(tmesh, "(_digest(rx), _in_shm(rx))", ranks=ranks)
        for r, (d, shared) in got.items():
            assert d == digest(x), (via, ranks, r)
            assert shared == (via == "shm"), (via, ranks, r)
        on_ranks(tmesh, "del rx", ranks=ranks)


def test_ranks_that_cannot_map_shared_memory_get_the_socket(tmesh: Mesh, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(shm.Segment, "path", property(lambda self: f"/proc/{os.getpid()}/fd/999999"))
    x = torch.randn(MiB)
    lent = tmesh.transfers.segments.pool.lent_ids()
    try:
        tmesh.push(nomap=x)
        assert tmesh.transfers.segments.no_shm == {0, 1, 2, 3}
        assert on_ranks(tmesh, "(_digest(nomap), _in_shm(nomap))") == {r: (digest(x), False) for r in range(4)}
        tmesh.scatter("nomap", x)  # now straight over the socket
        assert on_ranks(tmesh, "_in_shm(nomap)") == dict.fromkeys(range(4), False)
    finally:
        tmesh.transfers.segments.no_shm.clear()
    # (segments lent before it may come back meanwhile, under load)
    assert wait_for(lambda: not tmesh.transfers.segments.pool.lent_ids() - lent), "the unmappable segment came back"


def test_beyond_free_shared_memory_falls_back_to_the_socket(tmesh: Mesh, monkeypatch: pytest.MonkeyPatch,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("MONARCH_JUPYTER_SHM_LIMIT", str(MiB))
    x = torch.randn(2 * MiB)
    with pytest.warns(RuntimeWarning, match="goes over the socket"):
        tmesh.push(huge=x)
    assert on_ranks(tmesh, "(_digest(huge), _in_shm(huge))") == {r: (digest(x), False) for r in range(4)}
    on_ranks(tmesh, "import os; os.environ['MONARCH_JUPYTER_SHM_LIMIT'] = '1024'")
    try:
        back = tmesh.pull("huge", ranks=1)
        assert torch.equal(back[1], x)
        assert "[rank1]: pull of 'huge' goes over the socket, not through shared memory: 8388608 bytes needed" \
            in capsys.readouterr().err
    finally:
        on_ranks(tmesh, "del os.environ['MONARCH_JUPYTER_SHM_LIMIT']; del huge")


# ---------------------------------------------------------------------------------------------------- scatter


def test_scatter_uneven_parts_in_rank_order_and_gather_back(tmesh: Mesh) -> None:
    t = torch.arange(30, dtype=torch.float32).reshape(10, 3)
    tmesh.scatter("part", t)
    got = on_ranks(tmesh, "part.tolist()")
    assert got == {r: p.tolist() for r, p in enumerate(torch.tensor_split(t, 4))}
    assert torch.equal(tmesh.gather("part"), t)
    big = torch.randn(64, 4 * MiB // 256)  # 4 MiB, split along dim 1: non-contiguous parts
    tmesh.scatter("cols", big, dim=1, device="rank")
    assert on_ranks(tmesh, "(tuple(cols.shape), _in_shm(cols))") == dict.fromkeys(range(4), ((64, 4096), True))
    assert torch.equal(tmesh.gather("cols", dim=1), big)
    a = np.arange(21.0).reshape(7, 3)
    tmesh.scatter("arr", a, ranks="1-3")
    assert on_ranks(tmesh, "arr.shape", ranks="1-3") == {1: (3, 3), 2: (2, 3), 3: (2, 3)}
    assert np.array_equal(tmesh.gather("arr", ranks="1-3"), a)
    tmesh.scatter("items", ["a", "b", "c", "d", "e"])
    assert tmesh.gather("items") == ["a", "b", "c", "d", "e"]


def test_scatter_with_fewer_elements_than_ranks(tmesh: Mesh) -> None:
    with pytest.raises(ValueError, match=r"3 element\(s\) along dim 0 .* for 4 ranks"):
        tmesh.scatter("few", torch.ones(3, 8))
    tmesh.scatter("few", torch.ones(3, 8), ranks="0-2")
    assert on_ranks(tmesh, "'few' in globals()") == {0: True, 1: True, 2: True, 3: False}


# ---------------------------------------------------------------------------------------------------- pull


STATS = "__import__('monarch_worker.transfer').transfer.pool_stats()"


def test_pull_large_values_are_views_until_dropped(tmesh: Mesh) -> None:
    on_ranks(tmesh, "v = torch.full((1 << 20,), float(rank))")
    before = len(shm.memfd_mappings())
    got = tmesh.pull("v")
    assert {r: got[r][0].item() for r in got} == {r: float(r) for r in range(4)}
    assert len(shm.memfd_mappings()) == before + 4, "one mapping of each rank's segment"
    assert {r: s["lent"] for r, s in on_ranks(tmesh, STATS).items()} == dict.fromkeys(range(4), 1)
    got[0].add_(1)  # the notebook's copy-on-write pages: the rank's value is untouched
    assert on_ranks(tmesh, "v[0].item()", ranks=0) == {0: 0.0}
    del got
    gc.collect()
    assert wait_for(lambda: all(s["lent"] == 0 for s in on_ranks(tmesh, STATS).values()))
    assert len(shm.memfd_mappings()) == before
    again = tmesh.pull("v", ranks=3)
    assert again[3][0].item() == 3.0
    assert on_ranks(tmesh, STATS, ranks=3)[3]["reused"] >= 1, "the released segment serves the next pull"


def test_pull_when_the_notebook_cannot_map_a_ranks_segment(tmesh: Mesh) -> None:
    on_ranks(tmesh, """
        import monarch_worker.shm as _shm
        _real_path = _shm.Segment.path
        _shm.Segment.path = property(lambda self: "/proc/self/fd/999999")
        u = torch.full((1 << 20,), float(rank))
    """, ranks="1,2")
    try:
        got = tmesh.pull("u", ranks="1,2")
        assert {r: t[-1].item() for r, t in got.items()} == {1: 1.0, 2: 2.0}
        assert tmesh.transfers.segments.no_shm == {1, 2}
    finally:
        tmesh.transfers.segments.no_shm.clear()
        on_ranks(tmesh, "_shm.Segment.path = _real_path; del u", ranks="1,2")
    assert wait_for(lambda: all(s["lent"] == 0 for s in on_ranks(tmesh, STATS, ranks="1,2").values()))


def test_missing_name_on_some_ranks_is_a_per_rank_error(tmesh: Mesh) -> None:
    tmesh.push(only01=torch.ones(2), ranks="0,1")
    with pytest.raises(MeshError) as info:
        tmesh.pull("only01")
    assert sorted(info.value.errors) == [2, 3]
    for r, err in info.value.errors.items():
        assert err.ename == "NameError" and f"name 'only01' is not defined on rank {r}" in err.evalue
    assert sorted(info.value.results) == [0, 1]
    with pytest.raises(MeshError, match="gather of 'only01' failed on rank"):
        tmesh.gather("only01")
    assert torch.equal(tmesh.gather("only01", ranks="0,1"), torch.ones(4))


def test_gather_of_mismatched_parts_names_each_rank(tmesh: Mesh) -> None:
    on_ranks(tmesh, "g = torch.ones(2, rank + 1)")
    with pytest.raises(ValueError, match=r"rank 0: \(2, 1\), rank 1: \(2, 2\)"):
        tmesh.gather("g")
    assert tmesh.gather("g", dim=1).shape == (2, 10)


# ---------------------------------------------------------------------------------------------------- magics


@pytest.fixture(scope="module")
def shell(tmesh: Mesh) -> Iterator[InteractiveShell]:
    ip = InteractiveShell.instance()
    # What %load_ext monarch_jupyter calls; direct, because other test modules load and unload the extension
    # under its other name (monarch), which leaves IPython's bookkeeping believing this one is still loaded.
    load_ipython_extension(ip)
    yield ip


def test_magics_push_pull_scatter_gather(shell: InteractiveShell, tmesh: Mesh) -> None:
    ns = shell.user_ns
    ns["x"], ns["y"] = torch.arange(6.0), {"lr": 0.1}
    shell.run_line_magic("mesh", "push x y")
    assert on_ranks(tmesh, "(x.tolist(), y)") == {r: ([0, 1, 2, 3, 4, 5], {"lr": 0.1}) for r in range(4)}
    shell.run_line_magic("mesh", "push x --as x2 --ranks 1-2 --device meta")
    assert on_ranks(tmesh, "x2.device.type", ranks="1-2") == {1: "meta", 2: "meta"}
    shell.run_line_magic("mesh", "pull y")
    assert isinstance(ns["y"], RankMap) and ns["y"] == {r: {"lr": 0.1} for r in range(4)}
    shell.run_line_magic("mesh", "pull x --ranks ::2 --as got")
    assert list(ns["got"]) == [0, 2] and torch.equal(ns["got"][2], torch.arange(6.0))
    ns["data"] = torch.arange(40.0).reshape(4, 10)
    shell.run_line_magic("mesh", "scatter data --dim 1 --as shard")
    assert on_ranks(tmesh, "tuple(shard.shape)") == {0: (4, 3), 1: (4, 3), 2: (4, 2), 3: (4, 2)}
    shell.run_line_magic("mesh", "gather shard --dim 1 --as whole")
    assert torch.equal(ns["whole"], ns["data"])
    shell.run_line_magic("mesh", "gather shard --dim 1")
    assert torch.equal(ns["shard"], ns["data"])


def test_magics_bad_input(shell: InteractiveShell, tmesh: Mesh) -> None:
    with pytest.raises(UsageError, match="no notebook variable 'nothing_here'"):
        shell.run_line_magic("mesh", "push nothing_here")
    shell.user_ns["few"] = torch.ones(2)
    with pytest.raises(UsageError, match=r"2 element\(s\) along dim 0"):
        shell.run_line_magic("mesh", "scatter few")
    with pytest.raises(UsageError, match="--as names one destination"):
        shell.run_line_magic("mesh", "pull a b --as c")
    with pytest.raises(UsageError, match=r"'rank' is a name the mesh defines on every rank .* \(--as NAME"):
        shell.run_line_magic("mesh", "push few --as rank")
    # Pull and gather do not replace what the notebook's own code relies on.
    tmesh.push(u=torch.ones(2))
    shell.user_ns.update(torch=torch, tmesh_handle=tmesh)
    with pytest.raises(UsageError, match="%mesh pull: the notebook's 'torch' is the module torch, which the value"):
        shell.run_line_magic("mesh", "pull torch")
    with pytest.raises(UsageError, match="%mesh gather: the notebook's 'tmesh_handle' is a Mesh"):
        shell.run_line_magic("mesh", "gather u --as tmesh_handle")
    with pytest.raises(UsageError, match="'__builtins__' is a special name of the notebook's namespace"):
        shell.run_line_magic("mesh", "pull u --as __builtins__")
    for dest, whose in (("get_ipython", "IPython's"), ("print", "a Python builtin")):  # every magic would break
        with pytest.raises(UsageError, match=f"%mesh pull: '{dest}' is {whose}, which the notebook"):
            shell.run_line_magic("mesh", f"pull u --as {dest}")
    shell.user_ns.pop("dist", None)
    with pytest.raises(UsageError, match=r"%mesh pull: 'dist' is a module on the ranks \(torch.distributed\); "
                                         r"import it in the notebook instead"):
        shell.run_line_magic("mesh", "pull dist")
    with pytest.raises(UsageError, match="--as needs a Python name, got 'class'"):
        shell.run_line_magic("mesh", "push few --as class")
    assert shell.user_ns["torch"] is torch and shell.user_ns["tmesh_handle"] is tmesh and "dist" not in shell.user_ns
    assert callable(shell.user_ns["get_ipython"])
    with pytest.raises(UsageError, match="%mesh gather"):
        shell.run_line_magic("mesh", "gather x --dim notanint")
    with pytest.raises(MeshError, match="pull of 'never_defined'"):
        shell.run_line_magic("mesh", "pull never_defined")
    assert tmesh.run("1") == dict.fromkeys(range(4), 1)
