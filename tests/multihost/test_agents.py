"""Host agents on fake hosts (network namespaces): one agent per host started by the printed torchrun command (or
by hand), forking that host's ranks; work goes once per host, output and results come back per host.

What each test checks is what the issue asks of agents: torchrun's variables on every rank, one import of torch per
host, restart of one rank on a remote host, deaths with their signal, pushes and pulls across hosts, a link that
goes down, a kernel that is SIGKILLed, and agents that must be turned away (with the host and the fix named).
"""

from __future__ import annotations

import signal
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from monarch_jupyter import Mesh, MeshError, RankDiedError, RemoteError
from tests.conftest import reap
from tests.multihost.conftest import FakeHosts, comm_of, start_agents

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


@pytest.fixture(scope="module")
def agents(fake_hosts: FakeHosts, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    """4 ranks: a host agent on each of 2 fake hosts, started by the printed torchrun command."""
    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=180, show=False)
    procs = start_agents(fake_hosts, m.join_commands().torchrun, tmp_path_factory.mktemp("agents"))
    try:
        assert m.wait_ready(180)
        yield m
    finally:
        m.stop()
        assert reap(procs) == [0, 0]  # each torchrun ends cleanly: its agent exited 0
        assert not fake_hosts.left(1) and not fake_hosts.left(2)


def test_one_agent_per_host_forks_ranks_with_torchruns_variables(agents: Mesh, fake_hosts: FakeHosts) -> None:
    h1, h2 = fake_hosts.name(1), fake_hosts.name(2)
    assert agents.hosts() == {h1: [0, 1], h2: [2, 3]}
    out = agents.run(textwrap.dedent("""
        import os
        keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE", "ROLE_RANK",
                "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT", "MONARCH_SECRET")
        t = torch.ones(1) * (rank + 1)
        dist.all_reduce(t)
        ({k: os.environ.get(k) for k in keys}, os.getppid(), t.item())
    """))
    for r, (env, parent, total) in out.items():
        assert total == 10.0
        assert (env["RANK"], env["LOCAL_RANK"], env["WORLD_SIZE"], env["LOCAL_WORLD_SIZE"]) == (str(r), str(r % 2),
                                                                                               "4", "2")
        assert (env["GROUP_RANK"], env["GROUP_WORLD_SIZE"]) == (str(r // 2), "2")
        assert (env["ROLE_RANK"], env["ROLE_WORLD_SIZE"]) == (str(r), "4")
        assert env["TORCHELASTIC_RUN_ID"] and env["MASTER_ADDR"] and env["MONARCH_SECRET"] is None
        # forked by the host's fork server, which imported torch once for both ranks of the host
        assert "monarch_worker.forkserver" in comm_of(parent)
    for k in (1, 2):
        cmds = [comm_of(p) for p in fake_hosts.pids(k)]
        assert sum("-m monarch_worker.agent" in c for c in cmds if "torch.distributed.run" not in c
                   and "torchrun" not in c) == 1
        assert sum("monarch_worker.forkserver" in c for c in cmds) == 3  # the fork server and its 2 ranks
    assert {out[0][1], out[1][1]} != {out[2][1], out[3][1]}


def test_output_results_errors_and_large_results(agents: Mesh, capsys: pytest.CaptureFixture[str]) -> None:
    out = agents.run(textwrap.dedent("""
        import os, sys, ctypes
        os.write(1, b"fd-level\\n")
        ctypes.CDLL(None).write(2, b"from C on stderr\\n", 17)
        print("python stdout", rank)
        sys.stdout.write("no newline at the end")
        rank * 10
    """), order="rank")
    assert out == {0: 0, 1: 10, 2: 20, 3: 30}
    cap = capsys.readouterr()
    for r in range(4):
        assert f"[rank{r}]: fd-level" in cap.out and f"[rank{r}]: python stdout {r}" in cap.out
        assert f"[rank{r}]: no newline at the end" in cap.out and f"[rank{r}]: from C on stderr" in cap.err
    assert cap.out.index("[rank1]: python stdout") < cap.out.index("[rank2]: fd-level")  # --order rank
    assert "monarch-" not in cap.out + cap.err
    big = agents.run("bytes(range(256)) * 1024 * (rank + 1)")  # > 64 KiB: over the sockets, after markers
    assert {r: len(v) for r, v in big.items()} == {r: 262144 * (r + 1) for r in range(4)}
    with pytest.raises(MeshError) as info:
        agents.run("x = 1\nif rank == 3:\n    raise ValueError(f'bad value on {rank}')\nx")
    err = info.value.errors[3]
    assert isinstance(err, RemoteError) and err.evalue == "bad value on 3" and "line 3" in err.traceback
    assert info.value.results == {0: 1, 1: 1, 2: 1}


def test_push_pull_scatter_gather_across_hosts(agents: Mesh) -> None:
    import torch

    x = torch.arange(2 << 20, dtype=torch.float32)  # 8 MiB: sent once per host, into shared memory there
    agents.push(x=x)
    seen = agents.run(textwrap.dedent("""
        from monarch_worker import shm
        (float(x.sum()), len(shm.memfd_mappings()) > 0)
    """))
    assert seen == dict.fromkeys(range(4), (float(x.sum()), True))
    agents.run("x.mul_(rank)")  # copy-on-write: each rank's value stays its own
    pulled = agents.pull("x")
    for r in range(4):
        assert torch.equal(pulled[r], x * r)
    agents.scatter("part", x, dim=0)
    assert torch.equal(agents.gather("part"), x)
    agents.push(small=list(range(10)), ranks="2,3", via="socket")
    assert agents.run("small[rank]", ranks="2,3") == {2: 2, 3: 3}
    agents.run("del x, part")


def test_stacks_and_interrupt_through_agents(agents: Mesh) -> None:
    handle = agents.run("import time\nif rank == 3:\n    time.sleep(60)\n", block=False)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        report = agents.stacks()
        if "sleep" in report.text and "rank 3" in report.text:
            break
        time.sleep(0.2)
    assert "rank 3" in report.text and "line 3" in report.text, report.text
    with pytest.raises(KeyboardInterrupt):
        agents.waiter.interrupt_cell(handle.record)
        handle.result(timeout=20)
    assert agents.run("rank", ranks=3) == {3: 3}


def test_rank_death_reported_with_its_signal_then_restart_on_its_host(agents: Mesh, fake_hosts: FakeHosts) -> None:
    agents.run("kept = rank * 100")
    old = agents.status()[3]["pid"]
    t0 = time.monotonic()
    with pytest.raises(MeshError) as info:
        agents.run("import os, signal\nif rank == 3:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                   "import time; time.sleep(0.5 if rank != 3 else 0)")
    assert time.monotonic() - t0 < 30  # (a sanity bound: the death comes from the agent, not a heartbeat)
    err = info.value.errors[3]
    assert isinstance(err, RankDiedError) and err.returncode == -signal.SIGKILL and "SIGKILL" in str(err)
    agents.restart(ranks=[3])  # a fresh process on its own (remote) host, from its agent
    status = agents.status()
    assert status[3]["state"] == "idle" and status[3]["pid"] != old and status[3]["host"] == fake_hosts.name(2)
    assert agents.run("globals().get('kept')") == {0: 0, 1: 100, 2: 200, 3: None}  # the others kept theirs
    assert agents.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(4), 4.0)


# Each sub-mesh's rank 0 marks that its cell runs, then waits for the other sub-mesh's mark: the cells end only when
# both sub-meshes run at once. Then a collective in the sub-mesh's own group, and its numbering.
CROSS_HOST_CELL = """
import os, socket, time
from pathlib import Path
if rank == 0:
    Path(MARKS, NAME).touch()
    deadline = time.monotonic() + 60
    while not Path(MARKS, OTHER).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
t = torch.ones(1) * (split_kept + 1)
dist.all_reduce(t)
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")
(rank, world_size, t.item(), tuple(os.environ[k] for k in keys), socket.gethostname(), Path(MARKS, OTHER).exists())
"""


def test_split_across_hosts_runs_both_sub_meshes_at_once_then_merges(agents: Mesh, fake_hosts: FakeHosts,
                                                                     tmp_path: Path) -> None:
    h1, h2 = fake_hosts.name(1), fake_hosts.name(2)
    assert agents.hosts() == {h1: [0, 1], h2: [2, 3]}
    agents.run("split_kept = rank")
    agents.push(MARKS=str(tmp_path))
    a, b = agents.split([[0, 2], [1, 3]], names=["across0", "across1"])  # each sub-mesh spans both hosts
    try:
        a.run("NAME, OTHER = 'a', 'b'")
        b.run("NAME, OTHER = 'b', 'a'")
        ha, hb = a.run(CROSS_HOST_CELL, block=False), b.run(CROSS_HOST_CELL, block=False)
        got_a, got_b = ha.result(120), hb.result(120)
    finally:
        agents.merge()
    # Sub-mesh rank, world size 2, the sum over its own ranks only (mesh ranks 0+2: 1+3; 1+3: 2+4), torchrun's
    # variables renumbered inside it (one rank of it per host: LOCAL_RANK 0 of 1), on the host each rank is on.
    assert got_a == {0: (0, 2, 4.0, ("0", "2", "0", "1"), h1, True), 1: (1, 2, 4.0, ("1", "2", "0", "1"), h2, True)}
    assert got_b == {0: (0, 2, 6.0, ("0", "2", "0", "1"), h1, True), 1: (1, 2, 6.0, ("1", "2", "0", "1"), h2, True)}
    assert agents.subs == {}
    out = agents.run("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                     "keys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', 'LOCAL_WORLD_SIZE')\n"
                     "(rank, world_size, t.item(), tuple(__import__('os').environ[k] for k in keys), split_kept)")
    assert out == {r: (r, 4, 10.0, (str(r), "4", str(r % 2), "2"), r) for r in range(4)}  # numbered as before


# Collectives until the test marks that the other sub-mesh healed (the ranks agree through a MAX all_reduce);
# True when the mark ended it (False: 90 s passed, the other sub-mesh waited for this cell).
UNTIL_MARKED = """
import time
from pathlib import Path
deadline, seen = time.monotonic() + 90, torch.zeros(1)
while not seen.item() and time.monotonic() < deadline:
    t = torch.ones(1)
    dist.all_reduce(t)
    seen = torch.tensor([float(Path(MARK).exists())])
    dist.all_reduce(seen, op=dist.ReduceOp.MAX)
    time.sleep(0.05)
(world_size, t.item(), bool(seen.item()))
"""


def test_a_rank_that_dies_on_a_split_mesh_heals_inside_its_sub_mesh_on_its_host(agents: Mesh, fake_hosts: FakeHosts,
                                                                                tmp_path: Path) -> None:
    """on_rank_death="restart" on a split mesh behind agents: mesh rank 3 (sub-mesh b's rank 1, on host 2) dies; its
    agent starts a replacement that joins b's fresh group, numbered inside b, while sub-mesh a runs a cell."""
    env_cell = ("t = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\nkeys = ('RANK', 'WORLD_SIZE', 'LOCAL_RANK', "
                "'LOCAL_WORLD_SIZE')\n(rank, world_size, t.item(), tuple(__import__('os').environ[k] for k in keys))")
    agents.on_rank_death = "restart"
    try:
        a, b = agents.split([[0, 2], [1, 3]])
        try:
            old = agents.status()[3]["pid"]
            a.run(f"MARK = {str(tmp_path / 'healed')!r}")
            running = a.run(UNTIL_MARKED, block=False)
            with pytest.raises(MeshError) as info:
                b.run("import os\nif rank == 1:\n    os._exit(3)\nt = torch.ones(1)\ndist.all_reduce(t)")
            assert isinstance(info.value.errors[3], RankDiedError)
            # The next cell on b waits for the healing, then runs in b's fresh group with the replacement.
            got = b.run(env_cell)
            assert got == {0: (0, 2, 3.0, ("0", "2", "0", "1")), 1: (1, 2, 3.0, ("1", "2", "0", "1"))}
            status = agents.status()[3]
            assert status["pid"] != old and status["host"] == fake_hosts.name(2)
            (tmp_path / "healed").touch()  # a's cell ran all along (it ends now), undisturbed
            assert running.result(120) == {0: (2, 2.0, True), 1: (2, 2.0, True)}
            assert set(agents.subs) == {"sub0", "sub1"}  # the split stays
        finally:
            agents.merge()
    finally:
        agents.on_rank_death = "report"
    out = agents.run(env_cell)
    assert out == {r: (r, 4, 10.0, (str(r), "4", str(r % 2), "2")) for r in range(4)}
