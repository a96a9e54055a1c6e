"""Host agents as the controller files them: ``Agent`` (one admitted agent), the pseudo identities of the ranks it
holds, and ``WaitingHosts``: agents that came to a listening mesh after it was complete and wait, pinged, until a
``%mesh scale`` admits them, as torchrun's ``--nnodes MIN:MAX`` holds a node that comes until the next membership
change. launch/hosts.py (``HostLinks``) uses both.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from monarch_worker import protocol as P

log = logging.getLogger(__name__)

__all__ = ["Agent", "WaitingHosts", "pseudo_identity"]


def pseudo_identity(rank: int) -> bytes:
    """The identity the controller files a rank held by an agent under (never a ZeroMQ peer's: those are either
    set by our peers, which never start with a zero byte, or 5 bytes long)."""
    return b"\x00host-rank-%d" % rank


@dataclass
class Agent:
    """One admitted host agent."""

    identity: bytes
    host: str
    pid: int
    addr: str  # its address toward the controller
    ranks: list[int]
    launcher_env: dict
    srcfd: int = -1  # the controller's end of its TCP connection (for the disconnect monitor)
    alive: bool = True
    last_heard: float = 0.0
    group_rank: int = 0  # its host's place among the mesh's hosts (torchrun's GROUP_RANK)
    lost: str = ""  # why it is gone, once it is
    failed: str = ""  # why it could not start its ranks
    exited: str = ""  # what became of the process that ran it, once its launcher saw (e.g. "exited (signal SIGKILL)")
    pending_welcome: set[int] = field(default_factory=set)  # ranks that said hello before the store was up
    limits: list = field(default_factory=list)  # [cores, available bytes, open-file limit] (AgentHello.limits)
    declared: threading.Event = field(default_factory=threading.Event)  # set once its loss was told (HostLinks)


class WaitingHosts:
    """The held agents of one generation, in the order they came. Their tables are new dicts swapped in whole, so
    other threads read them without the lock; the I/O thread holds, hears and pings them, a scale takes them."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.agents: dict[bytes, Agent] = {}
        self._hellos: dict[bytes, P.AgentHello] = {}

    def __contains__(self, identity: bytes) -> bool:
        return identity in self.agents

    def hold(self, identity: bytes, hello: P.AgentHello, srcfd: int) -> None:
        """Hold the agent that said ``hello`` on connection ``srcfd``."""
        agent = Agent(identity, hello.host, hello.pid, hello.addr, [], dict(hello.launcher_env), srcfd,
                      last_heard=time.monotonic(), group_rank=1 << 30, limits=list(hello.limits))
        with self._lock:
            self.agents = {**self.agents, identity: agent}
            self._hellos = {**self._hellos, identity: hello}
        log.info("the host agent of %s (pid %d, %d ranks) waits: %%mesh scale admits it", hello.host, hello.pid,
                 hello.nproc)

    def heard(self, identity: bytes, leaving: bool) -> bool:
        """A message from ``identity``: True when it is held (then ``leaving`` forgets it), else False."""
        agent = self.agents.get(identity)
        if agent is None:
            return False
        agent.last_heard = time.monotonic()
        if leaving:
            self._drop(identity, "left")
        return True

    def pinged(self, now: float, silence: float) -> list[bytes]:
        """Forget the agents silent for ``silence`` seconds; the identities of the others, to ping."""
        out = []
        for identity, agent in list(self.agents.items()):
            if now - agent.last_heard > silence:
                self._drop(identity, f"went silent for {silence:g} s")
            else:
                out.append(identity)
        return out

    def hosts(self) -> list[tuple[Agent, int]]:
        """The held agents with the ranks each brings (its --nproc-per-node), in the order they came."""
        with self._lock:
            return [(a, self._hellos[k].nproc) for k, a in self.agents.items()]

    def take(self, identity: bytes) -> tuple[Agent, P.AgentHello]:
        """Stop holding ``identity`` (a scale admits it): its entry and its hello. Raises KeyError if not held."""
        with self._lock:
            held, hello = self.agents[identity], self._hellos[identity]
            self.agents = {k: a for k, a in self.agents.items() if k != identity}
            self._hellos = {k: h for k, h in self._hellos.items() if k != identity}
        return held, hello

    def _drop(self, identity: bytes, why: str) -> None:
        with self._lock:
            agent = self.agents.get(identity)
            self.agents = {k: a for k, a in self.agents.items() if k != identity}
            self._hellos = {k: h for k, h in self._hellos.items() if k != identity}
        if agent is not None:
            log.warning("the waiting host agent of %s (pid %d) %s", agent.host, agent.pid, why)
