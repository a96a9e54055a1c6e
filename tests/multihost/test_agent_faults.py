"""Host agents on fake hosts (network namespaces) when things go wrong, each test with a mesh of its own: a link
that goes down, a kernel that is SIGKILLed, agents that must be turned away (with the host and the fix named), a
host whose torch does not import; and the one-process-per-rank form, still working beside them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import zmq

from monarch_jupyter import Mesh, MeshError, MeshStartError, RankDiedError
from monarch_worker import protocol as P
from tests.conftest import reap
from tests.multihost.conftest import NETNS, FakeHosts, comm_of, start_agents

pytestmark = [pytest.mark.multihost, pytest.mark.slow]


def test_one_process_per_rank_form_still_works(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=180, show=False)
    procs: list[subprocess.Popen] = []
    try:
        procs = start_agents(fake_hosts, m.join_commands().torchrun_per_rank, tmp_path)
        assert m.wait_ready(180)
        assert m.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(4), 10.0)
        assert sorted(map(sorted, m.hosts().values())) == [[0, 1], [2, 3]]
    finally:
        m.stop()
    assert reap(procs) == [0, 0]


def test_link_down_is_reported_within_the_heartbeat_window(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    m = Mesh.listen(2, address=fake_hosts.bridge, nproc_per_node=1, timeout=180, heartbeat_timeout=4,
                    heartbeat_interval=0.5, show=False)
    link = f"{fake_hosts.name(2)}-br"
    procs: list[subprocess.Popen] = []
    try:
        procs = start_agents(fake_hosts, m.join_commands().generic, tmp_path)
        assert m.wait_ready(180)
        handle = m.run("import time; time.sleep(120)", block=False)
        t0 = time.monotonic()
        subprocess.run(["ip", "link", "set", link, "down"], check=True)
        with pytest.raises(MeshError) as info:
            handle.result(timeout=60)
        took = time.monotonic() - t0
        err = info.value.errors[1]
        assert isinstance(err, RankDiedError) and "no heartbeat for 4 s" in str(err)
        assert took < 4 + 10  # the heartbeat window, and slack for a loaded machine; never a hang
        assert reap(procs[1:], 30) == [3]  # the agent cut off gave up on the controller, ending its ranks
        assert not fake_hosts.left(2)
        assert m.run("rank", ranks=0) == {0: 0}  # the rest of the mesh goes on
    finally:
        subprocess.run(["ip", "link", "set", link, "up"])
        m.stop()
        reap(procs)
    assert not fake_hosts.left(1)


KERNEL = """
import sys, time
from monarch_jupyter import Mesh
m = Mesh.listen(4, address=sys.argv[1], nproc_per_node=2, timeout=180, show=False)
print(m.join_commands().generic.replace(chr(10), " "), flush=True)
m.wait_ready(180)
m.run("import subprocess; child = subprocess.Popen(['sleep', '300'])")  # a rank's own child too
print("READY", flush=True)
time.sleep(600)
"""


def test_kernel_sigkill_leaves_nothing_on_any_host(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    kernel = subprocess.Popen([sys.executable, "-c", KERNEL, fake_hosts.bridge], stdout=subprocess.PIPE, text=True)
    procs: list[subprocess.Popen] = []
    try:
        assert kernel.stdout is not None
        command = kernel.stdout.readline().strip()
        procs = start_agents(fake_hosts, command, tmp_path)
        deadline = time.monotonic() + 180
        line = ""
        while "READY" not in line and time.monotonic() < deadline:
            line = kernel.stdout.readline()
        assert "READY" in line
        assert any("sleep 300" in comm_of(p) for p in fake_hosts.pids(1))
        kernel.kill()  # SIGKILL: no atexit, no Shutdown; the agents see their connection drop
        kernel.wait()
        assert reap(procs, 30) == [3, 3]
        # the ranks, their fork servers, the agents and what a rank started itself (`sleep`, ended by its fork
        # server's process-tree sweep) are gone from both hosts
        left = {k: fake_hosts.left(k) for k in (1, 2)}
        assert left == {1: [], 2: []}
    finally:
        kernel.kill()
        reap(procs, 5)
        for k in (1, 2):
            for p in fake_hosts.pids(k):
                os.kill(p, signal.SIGKILL)


def fake_agent(address: str, secret: bytes, hello: P.AgentHello) -> P.Message | None:
    """Say ``hello`` as an agent would; what the controller answers within 10 s."""
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        signer = P.Signer(secret)
        sock.send_multipart(signer.pack(hello))
        if not sock.poll(10000):
            return None
        return signer.unpack(sock.recv_multipart())[0]
    finally:
        ctx.destroy(0)


def test_agents_turned_away_name_the_host_and_the_fix(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=30, show=False)
    procs: list[subprocess.Popen] = []
    try:
        commands = m.join_commands()
        secret = bytes.fromhex(Path(commands.secret_file).read_text().strip())
        old = fake_agent(m.address, secret, P.AgentHello(host="old-host", pid=1, nproc=2, addr="10.0.0.9",
                                                         version=P.PROTOCOL_VERSION - 1))
        assert isinstance(old, P.Rejected) and "old-host speaks protocol" in old.reason
        assert "same monarch_jupyter version" in old.reason
        # Two agents that claim host slot 0, as two launches with the same --node-rank would.
        slot0 = {"RANK": "0", "WORLD_SIZE": "2", "GROUP_RANK": "0", "GROUP_WORLD_SIZE": "2", "LOCAL_RANK": "0",
                 "LOCAL_WORLD_SIZE": "1"}
        procs = start_agents(fake_hosts, commands.generic, tmp_path, slot0, which=(1,))
        deadline = time.monotonic() + 60
        while m.listener.joined_count() < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        second = subprocess.run([*fake_host_cmd(fake_hosts, 2), "sh", "-c", commands.generic + " 2>&1"],
                                env={**os.environ, **fake_hosts.env, **slot0}, capture_output=True, text=True,
                                timeout=60)
        assert second.returncode == 2
        assert f"host slot 0 is taken: the host agent of {fake_hosts.name(1)}" in second.stdout
        # An agent with another mesh's secret: it can prove nothing, so it gets no answer; the report names it.
        other_secret = (f"MONARCH_CONTROLLER={m.address} MONARCH_SECRET={os.urandom(32).hex()} "
                        f"MONARCH_JOIN_TIMEOUT=20 {sys.executable} -m monarch_worker.agent --nproc-per-node 2")
        stranger = start_agents(fake_hosts, other_secret, tmp_path, which=(2,))
        procs += stranger
        with pytest.raises(MeshStartError) as info:
            m.wait_ready()
        text = str(info.value)
        assert "2 of 4 ranks joined within 30 s" in text and f"{fake_hosts.name(1)}: a host agent for 2 ranks" in text
        assert f"turned away: {fake_hosts.name(2)}" in text and "host slot 0 is taken" in text
        assert f"from {fake_hosts.subnet}.12 had a bad signature" in text and "MONARCH_SECRET" in text
        codes = reap(procs, 60)
        assert codes[0] == 2  # the waiting agent was told to go when the start failed
        assert codes[1] == 2  # the stranger gave up at its join timeout, saying why
    finally:
        m.stop()
        reap(procs, 5)
    assert not fake_hosts.left(1) and not fake_hosts.left(2)


def fake_host_cmd(hosts: FakeHosts, k: int) -> list[str]:
    return [NETNS, "exec", str(k)]


def test_late_host_and_host_without_torch(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    m = Mesh.listen(2, address=fake_hosts.bridge, nproc_per_node=1, timeout=120, show=False)
    procs: list[subprocess.Popen] = []
    try:
        commands = m.join_commands()
        procs = start_agents(fake_hosts, commands.generic, tmp_path)
        assert m.wait_ready(120)
        # A host that comes to the running mesh waits for a %mesh scale to admit it (test_agent_scale.py); when the
        # mesh stops first, it is turned away and exits.
        late = subprocess.Popen([*fake_host_cmd(fake_hosts, 2), "sh", "-c", commands.generic + " 2>&1"],
                                env={**os.environ, **fake_hosts.env}, stdout=subprocess.PIPE, text=True)
        deadline = time.monotonic() + 60
        while not m.waiting_hosts and time.monotonic() < deadline:
            time.sleep(0.1)
        assert m.waiting_hosts == {fake_hosts.name(2): 1}
        assert m.run("rank") == {0: 0, 1: 1}  # the mesh is unaffected
    finally:
        m.stop()
    assert reap(procs) == [0, 0]
    out, _ = late.communicate(timeout=60)
    assert late.returncode == 2 and "the mesh stopped before a %mesh scale admitted this host" in out, out
    # A host whose torch does not import: the start fails at once, naming the host; nothing is left.
    fake = tmp_path / "badtorch" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('this torch is broken on purpose')\n")
    m = Mesh.listen(2, address=fake_hosts.bridge, nproc_per_node=1, timeout=120, show=False)
    try:
        procs = start_agents(fake_hosts, m.join_commands().generic, tmp_path, which=(1,))
        procs += start_agents(fake_hosts, m.join_commands().generic, tmp_path,
                              {"PYTHONPATH": str(fake.parent)}, which=(2,))
        t0 = time.monotonic()
        with pytest.raises(MeshStartError) as info:
            m.wait_ready()
        assert time.monotonic() - t0 < 60
        text = str(info.value) + str(getattr(info.value, "detail", ""))
        assert f"host agent on {fake_hosts.name(2)} cannot start its ranks" in text
        assert "this torch is broken on purpose" in text
    finally:
        m.stop()
    codes = reap(procs, 30)
    assert codes[1] == 1  # the broken host's agent said why and ended
    assert codes[0] in (0, 2)  # the good one was stopped (admitted: 0) or turned away (still waiting: 2)
    assert not fake_hosts.left(1) and not fake_hosts.left(2)


def test_a_host_agents_rank_that_dies_is_restarted_on_its_host(fake_hosts: FakeHosts, tmp_path: Path) -> None:
    """on_rank_death="restart" across hosts: rank 3 (on fake host 2) SIGKILLed; its host agent forks a fresh
    process, which gets back what the notebook pushed and joins a fresh process group of 4 (kernel/healing.py)."""
    m = Mesh.listen(4, address=fake_hosts.bridge, nproc_per_node=2, timeout=180, show=False,
                    on_rank_death="restart")
    procs: list[subprocess.Popen] = []
    try:
        procs = start_agents(fake_hosts, m.join_commands().generic, tmp_path)
        assert m.wait_ready(180)
        m.push(w=7)
        hosts = {r: h for h, ranks in m.hosts().items() for r in ranks}
        old = m.status()[3]["pid"]
        assert old in fake_hosts.pids(2)
        os.kill(old, signal.SIGKILL)
        deadline = time.monotonic() + 180  # the next cell waits for the healing, then runs on all four
        while m.status()[3]["pid"] == old and time.monotonic() < deadline:
            time.sleep(0.05)
        got = m.run("import os\nt = torch.ones(1); dist.all_reduce(t); (t.item(), w + rank, os.getpid())")
        assert {r: v[:2] for r, v in got.items()} == {r: (4.0, 7 + r) for r in range(4)}
        assert got[3][2] != old and got[3][2] in fake_hosts.pids(2)  # a fresh process, on the same host
        assert {r: h for h, ranks in m.hosts().items() for r in ranks} == hosts
    finally:
        m.stop()
    assert reap(procs) == [0, 0]
