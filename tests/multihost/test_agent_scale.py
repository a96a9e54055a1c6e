"""``%mesh scale`` across hosts (issue 27: "multihost: a host added with %mesh scale"): host agents on 2 fake hosts
(network namespaces), started by the printed torchrun command with one rank each. Growing places the new ranks on
the hosts evenly (launch/placement.py) through their agents; shrinking stops the highest ranks through theirs; the
ranks that stay keep their namespaces; every rank has torchrun's numbers of the new world, counted per host
(LOCAL_RANK, LOCAL_WORLD_SIZE; the hosts keep GROUP_RANK); the fresh process group spans both hosts. A host agent
that vanishes while a scale waits for its new rank fails that scale with its host named, and leaves the mesh as it
was; the next scale places ranks on the hosts that are left."""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from pathlib import Path

import pytest

from monarch_jupyter import Mesh, MeshStartError, MonarchError
from tests.conftest import reap
from tests.multihost.conftest import FakeHosts, start_agents

pytestmark = [pytest.mark.multihost, pytest.mark.slow]

KEYS = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
        "ROLE_WORLD_SIZE")
ENV = textwrap.dedent(f"""
    import os, socket
    t = torch.ones(1) * (rank + 1)
    dist.all_reduce(t)
    (t.item(), tuple(int(os.environ[k]) for k in {KEYS!r}), socket.gethostname(), os.getpid(), os.getppid())
""")


def numbers(rank: int, world: int, local: int, local_world: int, group: int) -> tuple[int, ...]:
    """What torchrun gives a worker: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, GROUP_WORLD_SIZE (2
    hosts), ROLE_RANK, ROLE_WORLD_SIZE."""
    return (rank, world, local, local_world, group, 2, rank, world)


def test_scale_across_host_agents(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    h1, h2 = fake_hosts.name(1), fake_hosts.name(2)
    m = Mesh.listen(2, address=fake_hosts.bridge, nproc_per_node=1, on_rank_death="restart", timeout=180, show=False)
    procs = start_agents(fake_hosts, m.join_commands().torchrun, tmp_path)
    try:
        assert m.wait_ready(180)
        assert m.hosts() == {h1: [0], h2: [1]}
        m.push(lr=0.5)
        m.run("kept = rank * 10")
        before = m.run(ENV)

        report = m.scale(4)
        assert (report.started, report.stopped) == ([2, 3], [])
        # Evenly: rank 2 to the first host (GROUP_RANK 0), rank 3 to the second; numbered per host in rank order
        assert m.hosts() == {h1: [0, 2], h2: [1, 3]}
        got = m.run(ENV)
        assert {r: v[:3] for r, v in got.items()} == {
            0: (10.0, numbers(0, 4, 0, 2, 0), h1), 1: (10.0, numbers(1, 4, 0, 2, 1), h2),
            2: (10.0, numbers(2, 4, 1, 2, 0), h1), 3: (10.0, numbers(3, 4, 1, 2, 1), h2)}
        assert [got[r][3] for r in (0, 1)] == [before[r][3] for r in (0, 1)], "a surviving rank was replaced"
        assert got[2][4] == before[0][4] and got[3][4] == before[1][4], "not forked by its host's agent"
        assert m.run("(globals().get('kept'), lr)") == {0: (0, 0.5), 1: (10, 0.5), 2: (None, 0.5), 3: (None, 0.5)}
        assert m.state.group_status() == "up (gloo, 4 of 4 ranks)"

        with pytest.raises(MonarchError, match="a cell runs on ranks 0-3"):
            handle = m.run("import time\ntime.sleep(1)", block=False)
            m.scale(2)
        handle.result(60)
        assert m.nproc == 4

        report = m.scale(3)  # the highest rank goes: rank 3, on the second host
        assert report.stopped == [3] and m.hosts() == {h1: [0, 2], h2: [1]}
        got = m.run(ENV)
        assert {r: v[:2] for r, v in got.items()} == {
            0: (6.0, numbers(0, 3, 0, 2, 0)), 1: (6.0, numbers(1, 3, 0, 1, 1)), 2: (6.0, numbers(2, 3, 1, 2, 0))}

        # The second host left with no rank; its agent vanishes while a scale waits for the rank it places there.
        m.scale(1)
        assert m.hosts() == {h1: [0]}
        forkserver2 = before[1][4]
        (agent2,) = [a for a in m.state.launcher.hosts.live_agents() if a.host == h2]  # type: ignore[union-attr]
        os.kill(forkserver2, signal.SIGSTOP)  # the agent cannot fork: the scale waits
        failure: list[BaseException] = []
        scaling = threading.Thread(target=lambda: _catch(failure, m.scale, 2, timeout=120))
        scaling.start()
        try:
            deadline = time.monotonic() + 30
            while m.nproc != 2 and time.monotonic() < deadline:
                time.sleep(0.05)
            assert m.nproc == 2 and m.status()[1]["host"] == h2
            os.kill(agent2.pid, signal.SIGKILL)
            scaling.join(60)
            assert not scaling.is_alive(), "the scale hung after the host agent vanished"
        finally:
            os.kill(forkserver2, signal.SIGCONT)
        (err,) = failure
        assert isinstance(err, MeshStartError), repr(err)
        assert f"new rank 1 (host {h2}) failed to start" in str(err) and "disconnected" in str(err), str(err)
        assert "the mesh is as it was, 1 ranks" in str(err)
        assert m.nproc == 1 and m.hosts() == {h1: [0]} and m.run("(world_size, kept)") == {0: (1, 0)}
        # The next scale places ranks on the host that is left.
        assert m.scale(2).started == [1]
        assert m.hosts() == {h1: [0, 1]}
        got = m.run(ENV)
        assert {r: v[:3] for r, v in got.items()} == {0: (3.0, numbers(0, 2, 0, 2, 0), h1),
                                                      1: (3.0, numbers(1, 2, 1, 2, 0), h1)}
    finally:
        m.stop()
        reap(procs)
    assert not fake_hosts.left(1) and not fake_hosts.left(2)


def _catch(into: list[BaseException], fn: object, *args: object, **kw: object) -> None:
    try:
        fn(*args, **kw)  # type: ignore[operator]
    except BaseException as e:  # noqa: BLE001 - the test reads it
        into.append(e)


def test_a_host_that_comes_later_waits_and_the_next_scale_admits_it(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    """As torchrun's --nnodes MIN:MAX: a host agent started after the mesh is complete waits (not in the mesh yet);
    ``%mesh scale`` admits it first, with the ranks its --nproc-per-node asked for and the next GROUP_RANK, then
    places the rest evenly; every rank's GROUP_WORLD_SIZE counts the new host."""
    h1, h2 = fake_hosts.name(1), fake_hosts.name(2)
    m = Mesh.listen(1, address=fake_hosts.bridge, nproc_per_node=1, timeout=180, show=False)
    command = m.join_commands().generic
    procs = start_agents(fake_hosts, command, tmp_path, which=(1,))
    try:
        assert m.wait_ready(180)
        m.run("kept = 7")
        assert "--nproc-per-node 1" in command
        procs += start_agents(fake_hosts, command.replace("--nproc-per-node 1", "--nproc-per-node 2"), tmp_path,
                              which=(2,))
        hosts = m.state.launcher.hosts  # type: ignore[union-attr]
        assert hosts is not None
        deadline = time.monotonic() + 120
        while not hosts.waiting_hosts() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert [a.host for a, _ in hosts.waiting_hosts()] == [h2]
        time.sleep(2 * m.state.options.heartbeat_interval)  # it stays, pinged, outside the mesh
        assert m.hosts() == {h1: [0]} and m.nproc == 1 and m.waiting_hosts == {h2: 2}

        report = m.scale(4)
        assert (report.started, report.stopped) == ([1, 2, 3], [])
        assert m.hosts() == {h1: [0, 3], h2: [1, 2]}  # the host that came takes its 2 ranks; rank 3 evenly
        assert m.waiting_hosts == {}
        got = m.run(ENV)
        assert {r: v[:3] for r, v in got.items()} == {
            0: (10.0, numbers(0, 4, 0, 2, 0), h1), 1: (10.0, numbers(1, 4, 0, 2, 1), h2),
            2: (10.0, numbers(2, 4, 1, 2, 1), h2), 3: (10.0, numbers(3, 4, 1, 2, 0), h1)}
        assert m.run("globals().get('kept')") == {0: 7, 1: None, 2: None, 3: None}
        assert m.state.group_status() == "up (gloo, 4 of 4 ranks)"
        assert m.scale(2).stopped == [2, 3] and m.hosts() == {h1: [0], h2: [1]}
        assert m.run("t = torch.ones(1)\ndist.all_reduce(t)\n(world_size, t.item())") == {0: (2, 2.0), 1: (2, 2.0)}
    finally:
        m.stop()
        assert reap(procs) == [0, 0]
    assert not fake_hosts.left(1) and not fake_hosts.left(2)
