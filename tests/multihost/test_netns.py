"""Ranks on two fake hosts (network namespaces, each with its own address, hostname and loopback) join a
controller on a third address: through the torchrun command that ``Mesh.listen`` prints, run as printed on
each host, and as plain ``python -m monarch_worker`` without a launcher. gloo collectives cross the hosts."""

from __future__ import annotations

import subprocess
import textwrap
import time

import pytest

from monarch_jupyter import Mesh, MeshError, RemoteError
from tests.conftest import reap
from tests.multihost.conftest import FakeHosts

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_printed_torchrun_command_on_two_hosts(fake_hosts: FakeHosts, tmp_path: object) -> None:
    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=120, show=False)
    procs: list[subprocess.Popen] = []
    try:
        commands = m.join_commands()
        assert m.address.startswith(f"tcp://{fake_hosts.controller_addr}:")
        assert commands.rdzv_endpoint.startswith(fake_hosts.controller_addr)  # the same command on every host
        logs = [open(f"{tmp_path}/h{k}.log", "w") for k in (1, 2)]
        for k in (1, 2):  # exactly the text a user pastes into a shell on each host
            procs.append(fake_hosts.popen(k, ["sh", "-c", commands.torchrun], stdout=logs[k - 1],
                                          stderr=subprocess.STDOUT))
        assert m.wait_ready(120)
        hosts = m.hosts()
        assert sorted(hosts) == [fake_hosts.name(1), fake_hosts.name(2)]
        assert sorted(map(sorted, hosts.values())) == [[0, 1], [2, 3]]  # torchrun places 2 per host
        out = m.run(textwrap.dedent("""
            import os, socket
            t = torch.ones(2) * (rank + 1)
            dist.all_reduce(t)
            print("on", socket.gethostname())
            (socket.gethostname(), t.tolist(), os.environ["LOCAL_RANK"], os.environ["TORCHELASTIC_RUN_ID"])
        """))
        for r, (host, total, local, run_id) in out.items():
            assert r in hosts[host] and total == [10.0, 10.0] and local == str(r % 2) and run_id
        with pytest.raises(MeshError) as info:
            m.run("import socket\nif rank == 3:\n    raise RuntimeError(socket.gethostname())\n")
        err = info.value.errors[3]
        assert isinstance(err, RemoteError) and err.evalue in hosts and "line 3" in err.traceback
        t0 = time.monotonic()
        assert m.run("rank") == {r: r for r in range(4)}
        assert time.monotonic() - t0 < 30  # (a sanity bound, not a timing assertion)
    finally:
        m.stop()
    assert reap(procs) == [0, 0]  # torchrun agents end cleanly: every rank exited 0 on Shutdown
    left = {k: fake_hosts.left(k) for k in (1, 2)}
    assert left == {1: [], 2: []}  # nothing left on either host


def test_plain_python_ranks_rank0_hosts_the_store(fake_hosts: FakeHosts) -> None:
    """No launcher: the controller numbers ranks by host; rank 0 hosts the store on its own address."""
    m = Mesh.listen(2, address=fake_hosts.controller_addr, timeout=120, show=False)
    procs: list[subprocess.Popen] = []
    try:
        env = " ".join(f"{k}={v}" for k, v in m.join_commands().env.items())
        for k in (1, 2):
            procs.append(fake_hosts.popen(k, ["sh", "-c", f"{env} exec python -m monarch_worker"],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        assert m.wait_ready(120)
        out = m.run("import os, socket\nt = torch.ones(1) * (rank + 1)\ndist.all_reduce(t)\n"
                    "(socket.gethostname(), os.environ['MASTER_ADDR'], t.item())")
        addrs = {fake_hosts.name(k): f"{fake_hosts.subnet}.{10 + k}" for k in (1, 2)}
        host0 = out[0][0]
        assert {out[0][0], out[1][0]} == set(addrs)
        assert out[0][1] == out[1][1] == addrs[host0]  # rank 0's address toward the controller
        assert out[0][2] == out[1][2] == 3.0
    finally:
        m.stop()
    assert reap(procs) == [0, 0]
