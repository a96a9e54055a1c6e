"""Fake hosts for the multi-host tests: network namespaces (netns.sh) and a throw-away SLURM cluster (slurm.sh)
whose nodes are those namespaces. Each session gets its own namespace names, bridge, subnet, SLURM directory
and ports, so it collides neither with another session nor with a real SLURM install; finalizers remove all
of it (daemons, namespaces, processes left in them). Where this machine cannot do it (not root, no iproute2,
namespaces not allowed, no SLURM packages) the tests skip and say why.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

HERE = Path(__file__).parent
NETNS = str(HERE / "netns.sh")
SLURM = str(HERE / "slurm.sh")
_ID = os.getpid() % 1000


@dataclass(frozen=True)
class FakeHosts:
    """Namespaces PREFIX1..PREFIXn on a bridge; the controller (this process) is ``controller_addr``."""

    prefix: str
    bridge: str
    subnet: str
    count: int

    @property
    def env(self) -> dict[str, str]:
        return {"MJ_NETNS_PREFIX": self.prefix, "MJ_NETNS_BRIDGE": self.bridge, "MJ_NETNS_SUBNET": self.subnet}

    @property
    def controller_addr(self) -> str:
        return f"{self.subnet}.1"

    def name(self, k: int) -> str:
        return f"{self.prefix}{k}"

    def popen(self, k: int, argv: list[str], env: dict[str, str] | None = None, **kw: object) -> subprocess.Popen:
        """Run ``argv`` on fake host ``k`` (own network, hostname, /etc/hosts), with this environment and ``env``."""
        return subprocess.Popen([NETNS, "exec", str(k), *argv], env={**os.environ, **self.env, **(env or {})}, **kw)

    def pids(self, k: int) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.name(k)], capture_output=True, text=True).stdout
        return [int(p) for p in out.split()]

    def left(self, k: int, timeout: float = 20) -> list[tuple[int, str]]:
        """What still runs on fake host ``k`` after waiting up to ``timeout`` seconds for it to be empty (processes
        that were told to end take a moment to be gone): (pid, command line) pairs, for assertion messages. The
        SLURM cluster's ``slurmd`` does not count: a session fixture of test_slurm.py and the Lightning tests keeps
        it there, and with the files spread over pytest-xdist workers it may have started before any test here."""
        deadline = time.monotonic() + timeout
        while True:
            left = [(pid, cmd) for pid in self.pids(k) if (cmd := comm_of(pid)) and cmd.split()[0] != "slurmd"]
            if not left or time.monotonic() >= deadline:
                return left
            time.sleep(0.1)


def comm_of(pid: int) -> str:
    """The command line of process ``pid`` ("" once it is gone)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def start_agents(hosts: FakeHosts, command: str, tmp: Path, env: dict[str, str] | None = None,
                 which: tuple[int, ...] = (1, 2)) -> list[subprocess.Popen]:
    """Run ``command`` (as printed) in a shell on each fake host of ``which``, its output in a log under ``tmp``."""
    procs = []
    for k in which:
        log = open(tmp / f"host{k}-{time.monotonic_ns()}.log", "w")
        procs.append(hosts.popen(k, ["sh", "-c", command], env=env, stdout=log, stderr=subprocess.STDOUT))
    return procs


def _sh(argv: list[str], env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout)


def _netns_possible() -> str:
    """'' when network namespaces work here, else why not."""
    if os.geteuid() != 0:
        return "needs root (network namespaces)"
    if shutil.which("ip") is None or shutil.which("nsenter") is None:
        return "needs iproute2 and util-linux (ip, nsenter); tests/multihost/INSTALL.sh installs them"
    probe = f"mjprobe{_ID}"
    res = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if res.returncode != 0:
        return f"`ip netns add` is not allowed here: {res.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return ""


@pytest.fixture(scope="session")
def fake_hosts() -> Iterator[FakeHosts]:
    why = _netns_possible()
    if why:
        pytest.skip(why)
    hosts = FakeHosts(f"mjt{_ID}h", f"mjt{_ID}br", f"10.214.{20 + _ID % 200}", 2)
    res = _sh([NETNS, "up", str(hosts.count)], hosts.env)
    try:
        if res.returncode != 0:
            pytest.skip(f"netns.sh up failed: {res.stderr.strip()[-500:]}")
        yield hosts
    finally:
        _sh([NETNS, "down"], hosts.env)


@dataclass(frozen=True)
class SlurmCluster:
    hosts: FakeHosts
    env: dict[str, str]

    def run(self, *argv: str, timeout: float = 60) -> subprocess.CompletedProcess:
        return _sh(list(argv), self.env, timeout)


@pytest.fixture(scope="session")
def slurm(fake_hosts: FakeHosts) -> Iterator[SlurmCluster]:
    """slurmctld here, one slurmd per fake host (nodes PREFIX1, PREFIX2, 2 CPUs each)."""
    missing = [b for b in ("slurmctld", "slurmd", "srun", "munged") if shutil.which(b) is None]
    if missing:
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing); tests/multihost/INSTALL.sh installs "
                    "Debian's slurm-wlm and munge")
    env = {**fake_hosts.env, "MJ_SLURM_DIR": f"/tmp/mjt-slurm-{_ID}", "MJ_SLURM_PORT": str(17000 + 3 * _ID),
           "SLURM_CONF": f"/tmp/mjt-slurm-{_ID}/etc/slurm.conf"}
    res = _sh([SLURM, "up", "netns", str(fake_hosts.count)], env, timeout=180)
    try:
        if res.returncode != 0:
            log = Path(env["MJ_SLURM_DIR"], "log")
            detail = "".join(p.read_text()[-400:] for p in log.glob("*.log")) if log.exists() else ""
            pytest.skip(f"SLURM daemons did not start here: {res.stderr.strip()[-600:]} {detail}")
        yield SlurmCluster(fake_hosts, env)
    finally:
        _sh([SLURM, "down"], env, timeout=180)
