"""``--launcher agent`` (issue 30, item 1, "local meshes get the same treatment"): one host agent on this host,
started by the controller without torchrun, forks every rank; the controller talks to the agent only, so its cost
per cell follows hosts, not ranks (bench/bench_scale.py's "local behind one agent" rows). The ranks get the
variables of ranks started by hand, scale and stop through the agent, and nothing they or the agent started outlives
the mesh or the process that holds it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest

from monarch_jupyter import Mesh, MeshError, MeshStartError, RankDiedError
from monarch_jupyter.kernel import registry
from monarch_jupyter.kernel.launch import AgentLauncher
from monarch_jupyter.kernel.launch.local import fork_server_pid, preload
from tests.conftest import magic_shell, wait_gone, worker_pids

pytestmark = pytest.mark.slow

WAIT = 120.0
ENV = ("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
       "(t.item(), tuple(os.environ.get(k) for k in ('RANK', 'LOCAL_RANK', 'WORLD_SIZE', 'LOCAL_WORLD_SIZE')), "
       "os.getppid())")


def parent_of(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_one_agent_forks_every_rank_which_scale_and_stop_through_it() -> None:
    before = worker_pids()
    with Mesh(3, launcher="agent", start_timeout=WAIT) as m:
        assert isinstance(m.state.launcher, AgentLauncher)
        agent = m.state.launcher.proc.pid
        got = m.run(ENV)
        forkservers = {got[r][2] for r in range(3)}
        assert len(forkservers) == 1, "every rank is forked by the agent's one fork server"
        clone = forkservers.pop()
        # A clone of the kernel's fork server (torch imported), not a fresh interpreter of the agent's.
        assert parent_of(clone) == fork_server_pid()
        assert parent_of(agent) == os.getpid()  # no torchrun underneath
        for r in range(3):
            assert got[r][:2] == (3.0, (str(r), str(r), "3", "3")), got[r]
        m.run("kept = rank * 10")
        assert m.scale(4).started == [3]
        assert m.run("t = torch.ones(1); dist.all_reduce(t); (t.item(), globals().get('kept'))") == {
            0: (4.0, 0), 1: (4.0, 10), 2: (4.0, 20), 3: (4.0, None)}
        assert m.scale(2).stopped == [2, 3]
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
        started = worker_pids() - before - {fork_server_pid()}
        assert {agent, clone} <= started and len(started) >= 4  # the agent, its fork server and two ranks
    assert not wait_gone(started | {agent}, timeout=30)
    assert fork_server_pid() is not None  # the kernel's own fork server stays, for the next mesh


@pytest.mark.parametrize("launcher", ["agent", "torchrun"])
def test_a_restart_after_scale_starts_the_scaled_world(launcher: str) -> None:
    """One host: a restart starts as many ranks as the mesh has now (it kept the start's rank count, and a restart
    after a scale failed with the mesh already stopped)."""
    with Mesh(2, launcher=launcher, start_timeout=WAIT) as m:
        m.scale(3)
        m.restart()
        got = m.run(ENV)
        assert sorted(got) == [0, 1, 2]
        for r in range(3):
            assert got[r][:2] == (3.0, (str(r), str(r), "3", "3")), got[r]
        m.scale(1)
        m.restart()
        assert m.run("import os; t = torch.ones(1); dist.all_reduce(t); (t.item(), os.environ['WORLD_SIZE'])") == {
            0: (1.0, "1")}


@pytest.mark.parametrize("launcher", ["agent", "torchrun", "local"])
def test_restarting_every_rank_by_name_makes_a_fresh_group(launcher: str) -> None:
    """``restart --rank`` naming every rank: fresh processes whose new group has a fresh store (with no survivor,
    the ranks behind an agent were sent the last generation's store, and the group never formed)."""
    with Mesh(2, launcher=launcher, start_timeout=60) as m:
        for ranks in ([1], [0, 1], [0, 1]):
            m.restart(ranks=ranks)
            assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_agent_takes_its_ranks_and_fails_the_cell(sig: signal.Signals) -> None:
    m = Mesh(2, launcher="agent", start_timeout=WAIT)
    try:
        pids = {m.status()[r]["pid"] for r in range(2)}
        handle = m.run("import time; time.sleep(60)", block=False)
        os.kill(m.state.launcher.proc.pid, sig)
        with pytest.raises(MeshError) as info:
            handle.result(timeout=60)
        assert all(isinstance(e, RankDiedError) for e in info.value.errors.values())
        assert "its host agent" in str(info.value), str(info.value)  # the cause, not "died (signal SIGKILL)"
        if sig == signal.SIGTERM:  # it says goodbye first, with the signal that stopped it
            assert "exited (signal SIGTERM)" in str(info.value), str(info.value)
        assert not wait_gone(pids, timeout=30)
    finally:
        m.stop()


def test_nothing_outlives_a_killed_process_that_held_an_agent_mesh(tmp_path: Any) -> None:
    """Nor the ranks' error-file folders: the clone's is inside the kernel's fork server's, which that fork server
    removes as it ends (it SIGKILLs the clone, which cannot remove its own)."""
    before = worker_pids()
    code = textwrap.dedent("""
        from monarch_jupyter import Mesh
        m = Mesh(2, launcher="agent", start_timeout=120)
        m.run("x = 1")
        print("ready", flush=True)
        import time; time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True,
                            env={**os.environ, "TMPDIR": str(tmp_path)})
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        started = worker_pids() - before
        assert len(started) >= 4, started  # the agent, its fork server, two ranks
    finally:
        proc.kill()
        proc.wait()
    assert not wait_gone(started, timeout=30)
    assert not list(tmp_path.glob("monarch-ranks-*")), sorted(p.name for p in tmp_path.glob("**/*"))[:20]


def test_the_magic_starts_an_agent_mesh() -> None:
    shell = magic_shell()
    saved = registry.peek_current()
    registry.set_current(None)
    try:
        shell.run_line_magic("mesh", "start -n 2 --launcher agent --timeout 120")
        mesh = registry.peek_current()
        assert mesh is not None and isinstance(mesh.state.launcher, AgentLauncher)
        assert mesh.run("rank + 1") == {0: 1, 1: 2}
        shell.run_line_magic("mesh", "stop")
    finally:
        if registry.peek_current() is not None:
            registry.peek_current().stop()
        registry.set_current(saved)


def test_an_agent_meshs_ranks_start_with_what_the_kernels_fork_server_imported() -> None:
    """The agent's fork server is a clone of the kernel's: what the kernel's imported (torch, and modules the notebook
    imported, ``preload``) is imported in the ranks before their first cell, as in a local mesh's."""
    preload(["colorsys"])  # a module no rank imports by itself (the control below is one more such module)
    # The clone request reaches the kernel's fork server after the import request: its clone has them.
    with Mesh(2, launcher="agent", start_timeout=WAIT) as m:
        got = m.run("import sys; ('colorsys' in sys.modules, 'tabnanny' in sys.modules)")
    assert got == {0: (True, False), 1: (True, False)}, got


@pytest.mark.parametrize("launcher", ["agent", "local"])
def test_a_killed_kernel_fork_server_takes_the_ranks_it_forked_and_fails_the_cell(launcher: str) -> None:
    """The kernel's fork server forks local ranks, and the fork server of an agent on this host (a clone, which dies
    with it: PR_SET_PDEATHSIG). Killed, it takes those ranks: the running cell fails naming the cause (not only
    "SIGKILL"), nothing is left behind, and the next mesh gets a new fork server."""
    before = worker_pids()
    m = Mesh(2, launcher=launcher, start_timeout=WAIT)
    try:
        ranks = {m.status()[r]["pid"] for r in range(2)}
        forker = parent_of(next(iter(ranks)))
        server = fork_server_pid()
        assert server is not None
        assert (parent_of(forker) if launcher == "agent" else forker) == server
        handle = m.run("import time; time.sleep(60)", block=False)
        os.kill(server, signal.SIGKILL)
        with pytest.raises(MeshError) as info:
            handle.result(timeout=60)
        assert all(isinstance(e, RankDiedError) for e in info.value.errors.values()), info.value
        assert "fork server" in str(info.value) and "died" in str(info.value), str(info.value)
        assert not wait_gone(ranks | {forker}, timeout=30)
    finally:
        m.stop()
    assert not wait_gone(worker_pids() - before - {fork_server_pid()}, timeout=30)
    with Mesh(1, launcher=launcher, start_timeout=WAIT) as m:
        assert m.run("rank + 1") == {0: 1}


def children_of(pid: int) -> list[int]:
    kids = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                if parent_of(int(entry)) == pid:
                    kids.append(int(entry))
    return kids


@pytest.mark.parametrize("delay", [0.0, 0.05], ids=["at once", "after 50 ms"])
def test_a_fork_server_killed_while_the_agent_starts_its_ranks_is_named_as_the_cause(delay: float) -> None:
    """Killed while the agent asks it for ranks, the agent's fork server was reported as "the host agent failed:
    BrokenPipeError" (a request to a dead fork server); now as its death, at start or in the first cell. The
    cause is in the report itself, not only in the agent's output quoted after it: an agent not welcomed yet said
    nothing (the report said "disconnected: it was killed, or its host or network went down"), and the agent's
    exit, seen before its last words were read, said "agent exited (exit code 1) before every rank joined"."""
    with Mesh(1, start_timeout=WAIT) as m:  # the kernel's fork server, warm
        m.run("1")
    server = fork_server_pid()
    assert server is not None
    before = set(children_of(server))
    m = Mesh(4, launcher="agent", start=False, start_timeout=WAIT)
    try:
        m.start(wait=False)
        deadline = time.monotonic() + WAIT
        while not (clones := set(children_of(server)) - before) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert clones, "the agent's fork server (a clone of the kernel's) never started"
        time.sleep(delay)
        for pid in clones:
            os.kill(pid, signal.SIGKILL)
        try:  # where the start had got to is a race: either way the cause is named
            m.wait_ready(WAIT)
            m.run("1", timeout=WAIT)
        except (MeshStartError, MeshError) as e:
            message = str(e)  # a MeshStartError's includes its detail
        else:
            pytest.fail("the ranks outlived their fork server")
        assert "fork server died" in message.split("agent output:")[0], message
        assert "BrokenPipe" not in message and "Broken pipe" not in message, message
    finally:
        m.stop()
    with Mesh(1, launcher="agent", start_timeout=WAIT) as m:
        assert m.run("rank + 1") == {0: 1}


FLOOD = """
import threading, os
_flood_stop = threading.Event()
def _flood():
    while not _flood_stop.is_set():
        os.write(1, b"x" * 5000 + b"\\n")
_flooder = threading.Thread(target=_flood, daemon=True)
_flooder.start()
"""


def test_a_flood_of_output_holds_up_neither_cells_nor_the_pings_that_keep_the_agent() -> None:
    """The controller's I/O thread handles what it receives in bounded turns (iothread.RECV_BUDGET). An agent whose
    ranks print without pause kept its ROUTER socket readable: the cells sent to the agent waited for a lull, and so
    did the pings, until the agent, hearing nothing for heartbeat_timeout seconds, ended its ranks ("lost (its host
    agent ... exited (exit code 3))")."""
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null):  # the flood's lines: not this log's
        with Mesh(4, launcher="agent", start_timeout=WAIT, heartbeat_interval=0.5, heartbeat_timeout=3.0) as m:
            m.run(FLOOD)
            try:
                deadline, i = time.monotonic() + 15, 0
                while time.monotonic() < deadline:
                    assert m.run(f"'{i}' * 3000") == {r: str(i) * 3000 for r in range(4)}
                    i += 1
            finally:
                m.run("_flood_stop.set(); _flooder.join()")
            assert m.run("rank") == {0: 0, 1: 1, 2: 2, 3: 3}
