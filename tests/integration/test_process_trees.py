"""Nothing a rank started outlives it: processes a rank starts (plain children, ``setsid`` ones, a self-daemonizing
program, a forked worker like a DataLoader's) end when the rank is restarted (``%mesh restart --rank R``), dies, when
the mesh restarts or stops, and when the kernel is SIGKILLed; a process started with ``keep_alive()`` survives all
of it. Driven through a real Jupyter kernel (jupyter_client), with real processes checked in /proc."""

from __future__ import annotations

import ast
import os
import re
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from tests.integration.test_kernel_faults import alive, execute, kernel, start_mesh, wait_gone, worker_pids

__all__ = ["kernel"]  # the fixture, imported

pytestmark = [pytest.mark.kernel, pytest.mark.slow]

# Defined on the ranks: start one process of each kind and return their pids. The daemon forks twice and calls
# setsid() in between, like a server that puts itself in the background: its parent is gone at once.
SPAWN = r'''
import multiprocessing, os, subprocess, sys, time
from monarch_worker import keep_alive
_DAEMON = ("import os, sys, time\nif os.fork(): os._exit(0)\nos.setsid()\nif os.fork(): os._exit(0)\n"
           "print(os.getpid(), flush=True)\ntime.sleep(300)\n")
def spawn_tree(keep=False):
    pids = [subprocess.Popen(["sleep", "300"]).pid,
            subprocess.Popen(["setsid", "sleep", "300"]).pid]
    d = subprocess.Popen([sys.executable, "-c", _DAEMON], stdout=subprocess.PIPE, text=True)
    pids.append(int(d.stdout.readline()))
    w = multiprocessing.get_context("fork").Process(target=time.sleep, args=(300,))
    w.start()
    pids.append(w.pid)
    if keep:
        pids.append(-subprocess.Popen(["sleep", "300"], **keep_alive()).pid)  # negative: kept on purpose
    return pids
'''


@pytest.fixture()
def started() -> Iterator[set[int]]:
    """Every pid the test's ranks started; whatever is still alive at the end is SIGKILLed (and fails the test
    through its own assertions, never through a leak)."""
    pids: set[int] = set()
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def spawn(kc: Any, started: set[int], ranks: str = "", keep: bool = False) -> dict[int, list[int]]:
    """Start one tree on each rank of ``ranks``; returns rank -> pids (every process is alive)."""
    r = execute(kc, f"%%mesh {ranks}\n" + SPAWN + f"spawn_tree(keep={keep})")
    assert r.status == "ok", r.traceback
    trees = ast.literal_eval(r.results[0])
    for pids in trees.values():
        started.update(abs(p) for p in pids)
        assert all(alive(abs(p)) for p in pids), trees
    return trees


def test_process_trees_end_with_their_rank_and_the_kernel(kernel: tuple[KernelManager, Any],
                                                          started: set[int]) -> None:
    km, kc = kernel
    start_mesh(kc)

    # restart --rank 1: rank 1's processes end, rank 0's stay.
    trees = spawn(kc, started)
    assert execute(kc, "%mesh restart --rank 1").status == "ok"
    assert not wait_gone(trees[1]), "processes of rank 1 outlived %mesh restart --rank 1"
    assert all(alive(p) for p in trees[0]), "rank 0's processes were ended by a restart of rank 1"

    # A rank dies: its processes end with it.
    r = execute(kc, "%%mesh --ranks 1\n" + SPAWN + "print('PIDS', spawn_tree(), flush=True)\nos._exit(3)\n")
    assert r.ename == "MeshError" and "[rank1] died (exit code 3)" in r.traceback, r.traceback
    dead = ast.literal_eval(re.search(r"PIDS (\[.*\])", r.stdout).group(1))
    started.update(dead)
    assert not wait_gone(dead), "processes of a rank that died outlived it"
    assert all(alive(p) for p in trees[0]), "rank 0's processes were ended by the death of rank 1"

    # %mesh restart: every rank's processes end.
    assert execute(kc, "%mesh restart").status == "ok"
    assert not wait_gone(trees[0]), "processes of rank 0 outlived %mesh restart"

    # %mesh stop.
    trees = spawn(kc, started)
    r = execute(kc, "%mesh stop")
    assert r.status == "ok", r.traceback
    assert not wait_gone([p for pids in trees.values() for p in pids]), "processes outlived %mesh stop"

    # The kernel is SIGKILLed: everything ends but the process kept on purpose.
    assert execute(kc, "m = %mesh start -n 2").status == "ok"
    trees = spawn(kc, started, keep=True)
    kept = [-p for pids in trees.values() for p in pids if p < 0]
    doomed = [p for pids in trees.values() for p in pids if p > 0]
    ranks = worker_pids(kc)
    os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert not wait_gone(ranks), "ranks outlived a SIGKILLed kernel"
    assert not wait_gone(doomed), "processes started by ranks outlived a SIGKILLed kernel"
    assert len(kept) == 2 and all(alive(p) for p in kept), "a process started with keep_alive() was ended"


def tagged(tag: str) -> dict[int, bool]:
    """Live processes started with ``MONARCH_PROCESS_TREE=tag`` in their environment -> kept on purpose
    (``MONARCH_KEEP_ALIVE=1``)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"MONARCH_PROCESS_TREE={tag}".encode() in env and alive(int(entry)):
            found[int(entry)] = b"MONARCH_KEEP_ALIVE=1" in env
    return found


def wait_tagged(tag: str, expected: dict[int, bool], timeout: float = 15.0) -> dict[int, bool]:
    """Wait until the processes carrying ``tag`` are ``expected``; returns what carries it then. A process that
    ``Popen`` just returned shows an empty /proc/PID/environ for a moment: the kernel sets the new environment's
    bounds after the exec has closed the pipe ``Popen`` waits on."""
    deadline = time.monotonic() + timeout
    while True:
        found = tagged(tag)
        if found == expected or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def wait_untagged(tag: str, timeout: float = 15.0) -> dict[int, bool]:
    """Wait until no process but kept ones carries ``tag``; returns what carries it then."""
    deadline = time.monotonic() + timeout
    while True:
        left = tagged(tag)
        if all(left.values()) or time.monotonic() > deadline:
            return left
        time.sleep(0.05)


# A kept process and, next to it, a plain child, a setsid() one and a multithreaded one (its threads outlive its
# main thread when it is killed) of rank 0: the rank's tag and the pids.
SIBLINGS = r'''%%mesh --ranks 0
import os, subprocess, sys
from monarch_worker import keep_alive
_T = ("import threading, time\n"
      "for _ in range(4): threading.Thread(target=time.sleep, args=(300,), daemon=True).start()\n"
      "time.sleep(300)\n")
kept = subprocess.Popen(["sleep", "300"], **keep_alive())
plain = [subprocess.Popen(["sleep", "300"]), subprocess.Popen(["setsid", "sleep", "300"]),
         subprocess.Popen([sys.executable, "-c", _T])]
(os.environ["MONARCH_PROCESS_TREE"], kept.pid, [p.pid for p in plain])
'''


@pytest.mark.parametrize("end", ["shutdown", "restart", "sigkill"])
def test_kernel_end_leaves_only_kept_processes(kernel: tuple[KernelManager, Any], started: set[int],
                                               end: str) -> None:
    """However the kernel ends (shut down, restarted, SIGKILLed), the fork server ends every process its ranks
    started before it exits, but the one started with keep_alive(): none is left to init."""
    km, kc = kernel
    start_mesh(kc)
    r = execute(kc, SIBLINGS)
    assert r.status == "ok", r.traceback
    value = ast.literal_eval(r.results[0])
    tag, kept, plain = value[0] if isinstance(value, dict) else value
    started.update([kept, *plain])
    expected = {kept: True, **dict.fromkeys(plain, False)}
    assert wait_tagged(tag, expected) == expected
    ranks = worker_pids(kc)
    if end == "shutdown":
        km.shutdown_kernel()
    elif end == "restart":
        km.restart_kernel()
    else:
        os.kill(km.provisioner.process.pid, signal.SIGKILL)
    assert not wait_gone(ranks), f"ranks or their fork server outlived the kernel's {end}"
    assert wait_untagged(tag) == {kept: True}, f"processes started by a rank outlived the kernel's {end}"
    assert alive(kept), "a process started with keep_alive() was ended"
