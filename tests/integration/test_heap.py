"""Memory a cell or a transfer freed goes back to the OS once the rank (or the kernel) is idle (monarch_worker.heap):
RSS does not stay up by what glibc's malloc kept for reuse. A long session keeps the source of only its newest cells
that define nothing callable (monarch_worker.executor.KEPT_SOURCES), in the kernel and on every rank."""

from __future__ import annotations

import linecache
import os
import time

import psutil
import pytest

from monarch_jupyter import Mesh
from monarch_worker import executor, heap

pytestmark = pytest.mark.skipif(not heap.trim(), reason="needs glibc's malloc_trim")

MiB = 1 << 20

# Fragment the main heap the way a cell's tensors do: a freed 24 MiB mmapped block raises glibc's mmap threshold,
# so the next 16 MiB blocks come from the heap; a small block allocated after each pins it in place, so freeing
# them leaves 128 MiB resident that only malloc_trim gives back.
FRAGMENT = """
big = b'x' * (24 << 20)
del big
blocks, pins = [], []
for _ in range(8):
    blocks.append(b'x' * (16 << 20))
    pins.append(b'p' * 200_000)
del blocks
"""


def rss(pid: int) -> int:
    return psutil.Process(pid).memory_info().rss


def wait_below(pid: int, limit: int, timeout: float = 60.0) -> int:
    deadline = time.monotonic() + timeout
    while (now := rss(pid)) > limit and time.monotonic() < deadline:
        time.sleep(0.2)
    return now


@pytest.fixture(scope="module")
def mesh2() -> Mesh:
    m = Mesh(2, start_timeout=120)
    yield m
    m.stop()


def test_a_rank_gives_freed_memory_back_once_idle(mesh2: Mesh) -> None:
    pid = mesh2.status()[0]["pid"]
    mesh2.run("x = 1", ranks=0)
    before = wait_below(pid, 1 << 62, timeout=0)
    mesh2.run(FRAGMENT, ranks=0)
    # Without the trim the 128 MiB freed stay resident for as long as the rank lives.
    after = wait_below(pid, before + 48 * MiB)
    assert after <= before + 48 * MiB, f"rank RSS {before / MiB:.0f} -> {after / MiB:.0f} MiB"
    assert mesh2.run("len(pins)", ranks=0) == {0: 8}  # the rank's state is untouched


def test_the_kernel_gives_freed_memory_back_after_a_transfer(mesh2: Mesh) -> None:
    pid = os.getpid()
    before = rss(pid)
    ns: dict = {}
    exec(FRAGMENT, ns)  # in this process, the controller (the notebook kernel's role)
    mesh2.push({"v": 1})
    after = wait_below(pid, before + 48 * MiB)
    assert after <= before + 48 * MiB, f"controller RSS {before / MiB:.0f} -> {after / MiB:.0f} MiB"
    assert len(ns["pins"]) == 8


COUNT = "sum(1 for k in linecache.cache if k.startswith('<mesh cell'))"


def test_a_long_session_keeps_the_source_of_its_newest_passing_cells_only(mesh2: Mesh,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    kept, default = 20, executor.KEPT_SOURCES
    monkeypatch.setattr(executor, "KEPT_SOURCES", kept)  # the kernel's bound
    mesh2.run(f"import linecache, monarch_worker.executor as _ex\n_ex.KEPT_SOURCES = {kept}")  # the ranks'
    mesh2.run("def keeps_its_source():\n    return 7\n", filename="<mesh cell defines>")
    # Cells of earlier tests in this process that defined functions keep their source here for good: count ours.
    earlier = {k for k in linecache.cache if k.startswith("<mesh cell") and k != "<mesh cell defines>"}
    try:
        for i in range(3 * kept):
            assert mesh2.run(f"y = {i}\ny") == {0: i, 1: i}
        counts = mesh2.run(COUNT)
        assert all(c <= kept + 2 for c in counts.values()), counts  # + the definition and this cell
        assert sum(1 for k in linecache.cache if k.startswith("<mesh cell") and k not in earlier) <= kept + 2
        lines = mesh2.run("linecache.getline('<mesh cell defines>', 2)")
        assert lines == {0: "    return 7\n", 1: "    return 7\n"}
        assert linecache.getline("<mesh cell defines>", 2) == "    return 7\n"
        assert mesh2.run("keeps_its_source()") == {0: 7, 1: 7}
    finally:
        mesh2.run(f"_ex.KEPT_SOURCES = {default}")
