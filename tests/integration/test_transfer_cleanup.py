"""Shared memory is given back when a rank drops a value, when the mesh stops, when a rank is killed, and when
the notebook kernel itself dies; nothing is ever left in /dev/shm."""

from __future__ import annotations

import gc
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from monarch_jupyter import Mesh, MeshError, RankDiedError
from monarch_worker import shm

pytestmark = pytest.mark.skipif(not shm.supported(), reason="needs Linux memfd_create and /proc")

MiB = 1 << 20


def dev_shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except FileNotFoundError:
        return set()


@pytest.fixture(autouse=True)
def nothing_new_in_dev_shm() -> Iterator[None]:
    before = dev_shm()
    yield
    assert dev_shm() - before == set(), "a transfer left a name in /dev/shm"


def wait_for(predicate: Any, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        gc.collect()
        time.sleep(0.05)
    return predicate()


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def mappings_of_segments_made_by(pid: int) -> list[str]:
    """Every process's mappings of a segment that process ``pid`` created (its memfd name holds the pid)."""
    found = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            found += [f"{entry}: {line}" for line in shm.memfd_mappings(entry) if f"monarch-shm-{pid} " in line]
    return found


def test_a_dropped_value_gives_the_memory_back() -> None:
    with Mesh(2, start_timeout=120) as m:
        m.transfers.segments.pool.cache_bytes = 0  # no reuse: a released segment is closed at once
        m.push(x=torch.ones(2 * MiB))
        assert m.run("len(__import__('monarch_worker.shm').shm.memfd_mappings())") == {0: 1, 1: 1}
        assert m.transfers.segments.pool.stats()["lent"] == 1 and len(shm.memfd_fds()) == 1
        m.run("del x", ranks=0)
        time.sleep(0.2)
        assert m.transfers.segments.pool.stats()["lent"] == 1, "rank 1 still holds it"
        m.run("y = x[:10]; del x", ranks=1)  # a view keeps the mapping alive
        time.sleep(0.2)
        assert m.transfers.segments.pool.stats()["lent"] == 1
        m.run("del y", ranks=1)
        # The pool drops the segment from its books, then closes it (outside its lock): wait for both.
        assert wait_for(lambda: m.transfers.segments.pool.stats()["lent"] == 0 and shm.memfd_fds() == []), \
            f"the kernel closed the segment, so the OS freed the memory: {m.transfers.segments.pool.stats()}, " \
            f"{shm.memfd_fds()}"
        assert m.run("len(__import__('monarch_worker.shm').shm.memfd_mappings())") == {0: 0, 1: 0}


def test_stop_frees_what_the_controller_holds_and_pulled_values_stay_valid() -> None:
    m = Mesh(2, start_timeout=120)
    try:
        m.push(x=torch.ones(2 * MiB))
        pulled = m.pull("x", ranks=1)  # a view of rank 1's segment
        assert len(shm.memfd_fds()) >= 1
    finally:
        m.stop()
    assert shm.memfd_fds() == [], "stop closes every segment the kernel made"
    assert pulled[1].sum().item() == 2 * MiB, "a pulled value outlives the mesh that sent it"
    del pulled
    gc.collect()
    assert shm.memfd_mappings() == []


def test_rank_killed_with_sigkill_during_a_push() -> None:
    with Mesh(2, start_timeout=120) as m:
        pid1 = m.status()[1]["pid"]
        busy = m.run("import time; time.sleep(60)", ranks=1, block=False)
        killer = threading.Timer(0.5, os.kill, (pid1, signal.SIGKILL))
        killer.start()
        try:
            with pytest.raises(MeshError) as info:
                m.push(x=torch.ones(4 * MiB), timeout=30)
        finally:
            killer.cancel()
        assert isinstance(info.value.errors[1], RankDiedError)
        assert 0 not in info.value.errors, "rank 0 got the value"
        with pytest.raises(MeshError):
            busy.result(5)
        assert m.run("x.sum().item()", ranks=0) == {0: 4.0 * MiB}
        m.run("del x", ranks=0)
        assert wait_for(lambda: m.transfers.segments.pool.stats()["lent"] == 0), "the dead rank's share was given back"
    assert shm.memfd_fds() == []


CONTROLLER = textwrap.dedent("""
    import os, sys, time, torch
    from monarch_jupyter import Mesh
    m = Mesh(2, start_timeout=120, heartbeat_timeout=3.0)
    m.push(x=torch.ones(4 << 20))
    m.run("y = torch.ones(4 << 20)")
    kept = m.pull("y")
    from monarch_jupyter.kernel.launch import local as launcher
    zygote = launcher.fork_server_pid()
    print(os.getpid(), zygote, *[s["pid"] for s in m.status().values()], flush=True)
    time.sleep(120)
""")


def test_kernel_killed_leaves_no_shared_memory_anywhere() -> None:
    proc = subprocess.Popen([sys.executable, "-c", CONTROLLER], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    try:
        line = proc.stdout.readline() if proc.stdout else ""
        pids = [int(p) for p in line.split()]
        assert len(pids) == 4, f"the controller did not start: {line!r}"
        kernel, zygote, *ranks = pids
        assert mappings_of_segments_made_by(kernel), "the ranks map the kernel's segment"
        assert any(mappings_of_segments_made_by(r) for r in ranks), "the kernel maps the ranks' segments"
        os.kill(kernel, signal.SIGKILL)
        proc.wait(10)
        assert wait_for(lambda: not any(alive(p) for p in [zygote, *ranks]), timeout=20), \
            "the fork server and the ranks exit when the kernel dies"
        for pid in pids:
            assert mappings_of_segments_made_by(pid) == []
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
