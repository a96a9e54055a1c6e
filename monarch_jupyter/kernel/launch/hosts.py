"""Host agents, the controller's side: one connection per host, however many ranks it holds.

A host agent (monarch_worker.agent) is admitted by the Listener (launch/listener.py) like a rank that joins, but
for ``nproc`` ranks at once. From then on ``HostLinks``

- routes: a message for several ranks goes once to each agent that holds some of them (``Forward``, signed once
  per agent around the message, itself signed once: ``route``, called by the I/O thread for every send);
- takes each agent's ``HostEvents`` batch apart, in order: lines to the router, the results of a cell (one compact
  ``done`` event for the ranks that ended it alike) to the cell table, relayed messages to the I/O thread's own
  handlers as if the rank had sent them, exits and pids to the launcher's sink, heartbeats to the rank handles;
- runs the rendezvous of agent ranks (their Hello, relayed: rank 0 hosts the c10d store on its agent's address,
  or every rank uses the launcher's own store, ``env://``, when the launcher numbered the hosts and set it);
- starts, signals and stops ranks through their agent (``restart --rank R`` works for a rank on any host), and
  changes which ranks each host holds (``reassign``: ``%mesh scale``, placed by launch/placement.py);
- notices an agent whose connection drops (a ZeroMQ socket monitor: milliseconds after a kill -9 of the agent)
  and reports its ranks dead; a silent one (a link down) is caught by the heartbeat check of recovery.py.

Threads: ``on_agent_message``, ``route``, ``on_rank_hello``, ``recv`` and ``on_monitor`` (the socket monitor,
read after the ROUTER socket in each turn, so an agent's last messages come before its loss) on the I/O thread;
``spawn``/``signal``/``stop_agents`` on any thread (they queue on the dispatcher's outbox).
"""

from __future__ import annotations

import logging
import threading
import time
from bisect import bisect_left
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import zmq

from monarch_worker import protocol as P

from ...errors import describe_returncode
from ...ranks import ranks_text
from ..state import MeshState
from .agents import Agent, WaitingHosts, pseudo_identity

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..cells import CellTable
    from ..dispatch import Dispatcher
    from ..endpoint import ControllerSocket
    from ..routing import OutputRouter
    from .base import LauncherEvents

log = logging.getLogger(__name__)

__all__ = ["HostLinks", "Agent", "pseudo_identity"]  # Agent, pseudo_identity: from launch/agents.py

OWN_WORD_GRACE = 2.0  # seconds all_gone waits for an exited agent's connection to drop (its last words read)
LOSS_TOLD_TIMEOUT = 10.0  # seconds all_gone waits for another thread to tell an agent's loss
ALL = [-1]  # a Forward's or Signal's ranks: every rank of the agent (hostmessages.Forward)


class HostLinks:
    """The agents of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, cells: CellTable, router: OutputRouter, dispatcher: Dispatcher,
                 socket: ControllerSocket, sink: LauncherEvents, lost: Callable[[list[int], str], None]) -> None:
        """``socket``: the controller's (the I/O thread sends on it); ``sink``: where rank events go (pids, exits);
        ``lost``: what declares ranks lost (deaths.Deaths.ranks_lost)."""
        self.state = state
        self.cells = cells
        self.router = router
        self.dispatcher = dispatcher
        self.socket = socket
        self._sink = sink
        self._lost = lost
        self.agents: dict[bytes, Agent] = {}
        self._rank_agent: dict[int, Agent] = {}
        self._pseudo: dict[bytes, int] = {}
        self._by_fd: dict[int, Agent] = {}
        # Agents whose ranks are numbers start..stop-1, by start (deliver_ranks routes a cell with them)
        self._spans: list[tuple[int, int, Agent]] = []
        self._unjoined: set[int] = set()  # agent ranks whose process has not said hello since it was started
        self._lock = threading.Lock()  # the tables above (other threads read them)
        self.use_env = False  # ranks use the launcher's store (env://)
        self.store: tuple[str, int] | None = None  # the c10d store of this generation, once rank 0 hosts it
        self.last_srcfd = -1
        self._last_frame: Any = None
        self.bad_peers: dict[str, int] = {}  # address -> messages that failed verification
        self._monitor: zmq.Socket | None = None
        self.late = WaitingHosts()  # agents that came after the mesh was complete, until a %mesh scale admits them

    # ------------------------------------------------------------------ generation

    def open(self, router: zmq.Socket) -> None:
        """A new generation on ``router`` (before it binds): empty tables, a monitor of its connections."""
        with self._lock:
            self.agents, self._rank_agent, self._pseudo, self._by_fd = {}, {}, {}, {}
            self._spans, self._unjoined = [], set()
            self.late = WaitingHosts()
        self.use_env, self.store, self.bad_peers = False, None, {}
        self._monitor = router.get_monitor_socket(zmq.EVENT_DISCONNECTED)

    @property
    def monitor(self) -> zmq.Socket | None:
        """The generation's connection monitor: the I/O thread polls it beside the ROUTER socket and calls
        ``on_monitor`` after it has read the ROUTER, so what an agent sent before its connection dropped (its
        StartFailed, its Goodbye) is handled before the loss."""
        return self._monitor

    def close(self, router: zmq.Socket | None) -> None:
        """After the I/O thread ended, before the generation's socket closes: stop and close the monitor."""
        if router is not None and self._monitor is not None:
            try:
                router.disable_monitor()
            except zmq.ZMQError:
                pass
        if self._monitor is not None:
            self._monitor.close(0)
        self._monitor = None

    def on_monitor(self) -> None:
        """(I/O thread) Connections that dropped: an agent's is its loss (killed, host or network down)."""
        from zmq.utils.monitor import recv_monitor_message

        monitor = self._monitor
        try:
            while monitor is not None and monitor.poll(0):
                event = recv_monitor_message(monitor)
                with self._lock:
                    agent = self._by_fd.pop(int(event["value"]), None)
                if agent is not None and agent.alive:  # its exit status, where its launcher saw it first
                    self._agent_gone(agent, f"its host agent (pid {agent.pid} on {agent.host}) " + (
                        agent.exited or "disconnected: it was killed, or its host or network went down"))
        except zmq.ZMQError:
            pass

    # ------------------------------------------------------------------ admission (I/O thread, from the Listener)

    def admit(self, identity: bytes, hello: P.AgentHello, ranks: list[int], group_rank: int, group_world: int,
              srcfd: int) -> None:
        """Welcome an agent for global ``ranks`` (its local ranks, in order)."""
        agent = Agent(identity, hello.host, hello.pid, hello.addr, list(ranks), dict(hello.launcher_env), srcfd,
                      last_heard=time.monotonic(), group_rank=group_rank, limits=list(hello.limits))
        with self._lock:
            self.agents[identity] = agent
            for r in ranks:
                self._rank_agent[r] = agent
                self._pseudo[pseudo_identity(r)] = r
            self._unjoined.update(ranks)
            if ranks and ranks == list(range(ranks[0], ranks[0] + len(ranks))):
                self._spans = sorted([*self._spans, (ranks[0], ranks[0] + len(ranks), agent)], key=lambda t: t[0])
            if srcfd >= 0:
                self._by_fd[srcfd] = agent
        settings = self.state.rank_settings()  # the torchft Lighthouse's address among its env
        self._send(identity, P.AgentWelcome(ranks=list(ranks), world_size=self.state.nproc, group_rank=group_rank,
                                            group_world_size=group_world, settings=settings))

    def recv(self, sock: zmq.Socket) -> list | None:
        """One message from the ROUTER socket, like channel.recv_frames, noting the connection it came on."""
        try:
            frame = sock.recv(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        self._last_frame = frame
        frames = [frame.buffer]
        while frame.more:
            frame = sock.recv(0, copy=False)
            frames.append(frame.buffer)
        self.last_srcfd = -1
        return frames

    def srcfd(self) -> int:
        """The file descriptor of the connection the last message came on (-1: unknown)."""
        try:
            return int(self._last_frame.get(zmq.SRCFD))
        except (AttributeError, zmq.ZMQError, TypeError):
            return -1

    def bad_message(self) -> None:
        """The last message failed verification: remember where it came from, for the missing-rank report."""
        try:
            peer = str(self._last_frame.get("Peer-Address"))
        except (AttributeError, zmq.ZMQError, TypeError, UnicodeDecodeError):
            peer = "?"
        self.bad_peers[peer] = self.bad_peers.get(peer, 0) + 1

    # ------------------------------------------------------------------ routing (I/O thread)

    def is_agent(self, identity: bytes) -> bool:
        return identity in self.agents

    def holds(self, rank: int) -> bool:
        """``rank`` belongs to a host agent."""
        return rank in self._rank_agent

    def route(self, identities: list[Any]) -> tuple[list[bytes], dict[bytes, list[int]]]:
        """Split recipients into peers reached directly and, per agent, the ranks it gives the message to."""
        direct: list[bytes] = []
        via: dict[bytes, list[int]] = {}
        pseudo, rank_agent = self._pseudo, self._rank_agent
        for identity in identities:
            rank = pseudo.get(identity)
            if rank is None:
                if identity is not None:
                    direct.append(identity)
                continue
            agent = rank_agent[rank]
            if agent.alive:
                ranks = via.get(agent.identity)
                if ranks is None:
                    via[agent.identity] = [rank]
                else:
                    ranks.append(rank)
        return direct, via

    def agent_identities(self) -> list[bytes]:
        """The agents that are alive (pinged by the I/O thread)."""
        return [a.identity for a in self.agents.values() if a.alive]

    def ping(self, frames: list, dead: set[int]) -> bool:
        """Ping every rank through its agent, one ``Forward`` per agent (``frames``: a signed Ping; ``dead``: ranks
        the controller holds dead, not pinged), when agents hold every rank of the mesh and each has said hello:
        then True, with no step per rank; else False, and nothing is sent (the caller pings rank by rank) (I/O
        thread)."""
        if self._unjoined or len(self._rank_agent) != self.state.nproc:
            return False
        for agent in list(self.agents.values()):
            if not agent.alive:
                continue
            its = [r for r in agent.ranks if r not in dead] if dead and not dead.isdisjoint(agent.ranks) else ALL
            if its:
                self.socket.send_frames(agent.identity, self.socket.pack(P.Forward(its, P.Ping.TYPE), b"", frames))
        return True

    # ------------------------------------------------------------------ agent messages (I/O thread)

    def on_agent_message(self, identity: bytes, msg: P.Message, payload: bytes, bufs: list,
                         receive: Callable[[bytes, list], None]) -> bool:
        """A verified message from an admitted agent; False when ``identity`` is not one (the Listener's then)."""
        agent = self.agents.get(identity)
        if agent is None:
            return False
        agent.last_heard = time.monotonic()
        if isinstance(msg, P.HostEvents):
            self._on_events(agent, msg, payload, bufs, receive)
        elif isinstance(msg, P.StartFailed):
            agent.failed = msg.error
            with self.state.lock:
                for r in agent.ranks:
                    info = self.state.ranks[r]
                    info.host = agent.host
                    info.start_error = info.start_error or msg.error
                self.state.cond.notify_all()
        elif isinstance(msg, P.Goodbye):
            self._agent_gone(agent, f"its host agent (pid {agent.pid} on {agent.host}) exited "
                                    f"({describe_returncode(msg.returncode)}){': ' + msg.note if msg.note else ''}")
        return True

    def _on_events(self, agent: Agent, msg: P.HostEvents, payload: bytes, bufs: list,
                   receive: Callable[[bytes, list], None]) -> None:
        sink = self._sink
        assert sink is not None
        lines: list[tuple[int, str, str]] = []
        pos = nbuf = 0
        for event in msg.events:
            kind = event[0]
            if kind == "out":
                lines.append((event[1], event[2], event[3]))
                continue
            if lines:
                self._lines(lines)
                lines = []
            if kind == "span":  # a host's ranks start..stop-1, their durations as float64 bytes
                self.cells.on_done(event[1], range(event[2], event[3]), event[4])
            elif kind == "done":
                self.cells.on_done(event[1], event[2], event[3])
            elif kind == "res":
                _, rank, cell_id, status, has_value, error, duration, nbytes, n = event
                data, these = payload[pos:pos + nbytes], bufs[nbuf:nbuf + n]
                pos, nbuf = pos + nbytes, nbuf + n
                self.cells.on_result(rank, P.Result(cell_id, status, has_value, error, duration), data, these)
            elif kind == "msg":
                _, rank, n = event
                frames = bufs[nbuf:nbuf + n]
                nbuf += n
                receive(pseudo_identity(rank), frames)
            elif kind == "beat":
                self._beats(event[1])
            elif kind == "up":
                sink.on_spawned(event[1], event[2])
            elif kind == "exit":
                sink.on_exit(event[1], event[2])
        if lines:
            self._lines(lines)

    def _lines(self, lines: list[tuple[int, str, str]]) -> None:
        state = self.state
        with state.lock:
            for rank, stream, text in lines:
                info = state.ranks.get(rank)
                if info is not None:
                    self.router.route_line(info, stream, text)

    def _beats(self, beats: list) -> None:
        """A host's heartbeats, (rank, rss, cuda_allocated, cuda_reserved, group) each: once per heartbeat interval,
        not per cell; one lock and one queueing of the views' events for the batch."""
        state = self.state
        now = time.monotonic()
        infos = state.ranks
        with state.lock:
            for rank, rss, cuda_allocated, cuda_reserved, group in beats:
                info = infos.get(rank)
                if info is not None:
                    info.rss, info.cuda_allocated, info.cuda_reserved, info.group, info.last_heard = (
                        rss, cuda_allocated, cuda_reserved, group, now)
        if state.events.listening:
            state.events.emit_all([("heartbeat", {"rank": rank, "rss": rss, "cuda_allocated": cuda_allocated,
                                                  "cuda_reserved": cuda_reserved})
                                   for rank, rss, cuda_allocated, cuda_reserved, _group in beats])

    # ------------------------------------------------------------------ rendezvous of agent ranks (I/O thread)

    def on_rank_hello(self, identity: bytes, msg: P.Hello, by_identity: dict[bytes, int]) -> bool:
        """A rank of an agent said hello (relayed); False when ``identity`` is not an agent rank's."""
        rank = self._pseudo.get(identity)
        if rank is None:
            return False
        if msg.version != P.PROTOCOL_VERSION or msg.rank != rank:
            log.warning("agent rank %d: unexpected hello (rank %d, protocol %d)", rank, msg.rank, msg.version)
            return True
        agent = self._rank_agent[rank]
        state = self.state
        self._unjoined.discard(rank)
        with state.lock:
            info = state.ranks[rank]
            info.identity, info.host, info.pid = identity, agent.host, msg.pid
            info.last_heard = time.monotonic()
            by_identity[identity] = rank
            regrouping = state.regroup_active
            solo = rank in state.solo  # a replacement that joins the group later (kernel/healing.py)
            # During a regroup the old store is gone until rank 0 reports the new one (state.store_port).
            store = self.store if not regrouping or state.store_port is not None else None
        if solo:
            self.welcome(rank, P.NO_GROUP, "")
        elif self.use_env and not regrouping:
            self.welcome(rank, -1, "")  # the launcher's store (torchrun's), env://
        elif rank == 0:
            self.welcome(0, 0, agent.addr)  # it hosts the store, on its agent's address toward us
        elif store is not None:
            self.welcome(rank, store[1], store[0])
        else:
            agent.pending_welcome.add(rank)
        return True

    def on_store_ready(self, msg: P.StoreReady) -> None:
        """Rank 0 hosts the store: welcome the agent ranks that said hello before it was up."""
        self.store = (msg.addr, msg.port)
        for agent in self.agents.values():
            waiting, agent.pending_welcome = agent.pending_welcome, set()
            for rank in sorted(waiting):
                self.welcome(rank, msg.port, msg.addr)

    def welcome(self, rank: int, port: int, addr: str) -> None:
        """Admit agent rank ``rank`` to the store at ``addr:port`` (0: host it; -1: the launcher's, env://)."""
        agent = self._rank_agent[rank]
        info = self.state.ranks[rank]
        assert info.identity is not None
        self._send(info.identity, P.Welcome(rank=rank, world_size=self.state.nproc,
                                            local_rank=agent.ranks.index(rank), local_world_size=len(agent.ranks),
                                            master_addr=addr, master_port=port,
                                            elastic=self.state.elastic(agent.group_rank, len(self.agents))))

    def _send(self, identity: bytes, msg: P.Message) -> None:
        self.send_to(identity, msg)

    def send_to(self, identity: bytes, msg: P.Message) -> None:
        """Sign ``msg`` and send it to one peer: a rank an agent holds gets it through its agent (I/O thread)."""
        self.deliver([identity], self.socket.pack(msg), msg)

    def deliver_ranks(self, ranks: Sequence[int], frames: list, msg: P.Message) -> None:
        """``deliver`` to ``ranks`` (sorted), routed per agent by the ranges agents hold: a step per agent, none
        per rank, while every agent rank has said hello; else (a rank being started) as ``deliver`` (I/O thread)."""
        if self._unjoined or not ranks:
            with self.state.lock:
                infos = self.state.ranks
                identities = [infos[r].identity for r in ranks if r in infos]
            self.deliver(identities, frames, msg)
            return
        covered = 0
        sends: list[tuple[bytes, list[int]]] = []
        for start, stop, agent in self._spans:
            lo, hi = bisect_left(ranks, start), bisect_left(ranks, stop)
            if lo == hi:
                continue
            covered += hi - lo
            if agent.alive:
                sends.append((agent.identity, ALL if hi - lo == stop - start else list(ranks[lo:hi])))
        if covered != len(ranks):  # ranks that joined on their own (no agent), or agents with scattered ranks
            spans = self._spans
            with self.state.lock:
                infos = self.state.ranks
                rest = [infos[r].identity for r in ranks if r in infos
                        and not any(a <= r < b for a, b, _ in spans)]
            direct, via = self.route(rest)
            for identity in direct:
                self.socket.send_frames(identity, frames)
            sends += via.items()
        cell_id = getattr(msg, "cell_id", -1)
        for identity, its in sends:
            self.socket.send_frames(identity, self.socket.pack(P.Forward(its, msg.TYPE, cell_id), b"", frames))

    def deliver(self, identities: list[Any], frames: list, msg: P.Message) -> None:
        """Send signed ``frames`` to each peer; an agent gets them once for all its ranks among them (``Forward``,
        signed around them) (I/O thread)."""
        direct, via = self.route(identities)
        for identity in direct:
            self.socket.send_frames(identity, frames)
        for agent, ranks in via.items():
            forward = P.Forward(ranks, msg.TYPE, getattr(msg, "cell_id", -1))
            self.socket.send_frames(agent, self.socket.pack(forward, b"", frames))

    # ------------------------------------------------------------------ starting and stopping ranks (any thread)

    def restartable(self, ranks: list[int]) -> str:
        """"" when every rank of ``ranks`` can get a fresh process through its agent, else why not."""
        missing = [r for r in ranks if r not in self._rank_agent]
        if missing:
            return f"{ranks_text(missing)} {'were' if len(missing) > 1 else 'was'} not started by a host agent"
        gone = sorted({a.host for r in ranks if not (a := self._rank_agent[r]).alive})
        if gone:
            return f"the host agent of {', '.join(gone)} is gone ({self._rank_agent[ranks[0]].lost})"
        return ""

    def spawn(self, ranks: list[int]) -> None:
        """Fresh processes for ``ranks`` (each agent forks its own)."""
        self._unjoined.update(r for r in ranks if r in self._rank_agent)  # until the fresh process says hello
        for identity, its in self._by_agent(ranks).items():
            self._post(identity, P.Spawn(its))

    def signal(self, ranks: list[int], sig: int) -> None:
        """Send ``sig`` to ``ranks`` (-1 in the list: every rank of every agent)."""
        if -1 in ranks:
            for agent in self.agents.values():
                if agent.alive:
                    self._post(agent.identity, P.Signal([-1], int(sig)))
            return
        for identity, its in self._by_agent(ranks).items():
            self._post(identity, P.Signal(its, int(sig)))

    def stop_agents(self) -> None:
        """Tell every agent to end its ranks and exit (0: the launcher sees a clean end); agents still waiting to be
        admitted are turned away."""
        for agent in self.agents.values():
            if agent.alive:
                self._post(agent.identity, P.Shutdown())
        for identity in list(self.late.agents):
            self._post(identity, P.Rejected("the mesh stopped before a %mesh scale admitted this host"))

    def live_agents(self) -> list[Agent]:
        """The agents still connected, in their hosts' order (GROUP_RANK)."""
        return sorted((a for a in self.agents.values() if a.alive), key=lambda a: (a.group_rank, a.host))

    def reassign(self, ranks: dict[bytes, list[int]], world_size: int) -> None:
        """``%mesh scale``: the mesh has ``world_size`` ranks now, and agent ``identity`` holds ``ranks[identity]``
        (an agent left out keeps its ranks below ``world_size``). Every live agent is told (``HostRanks``, queued
        before the ``Spawn`` of its new ranks); ranks no agent holds any more are forgotten here and there."""
        with self._lock:
            for agent in self.agents.values():
                agent.ranks = sorted(ranks.get(agent.identity, [r for r in agent.ranks if r < world_size]))
            # New tables, each swapped in whole: the I/O thread reads them without the lock
            self._rank_agent = {r: a for a in self.agents.values() for r in a.ranks}
            self._pseudo = {pseudo_identity(r): r for r in self._rank_agent}
            self._unjoined.intersection_update(self._rank_agent)
            self._spans = sorted(((a.ranks[0], a.ranks[-1] + 1, a) for a in self.agents.values()
                                  if a.ranks and a.ranks == list(range(a.ranks[0], a.ranks[-1] + 1))),
                                 key=lambda t: t[0])
        for agent in self.agents.values():
            if agent.alive:
                self._post(agent.identity, P.HostRanks(list(agent.ranks), world_size))

    # ------------------------------------------------------------------ hosts that come later (%mesh scale)

    def hold(self, identity: bytes, hello: P.AgentHello, srcfd: int) -> None:
        """(I/O) An agent that came after the mesh was complete: held until a ``%mesh scale`` admits it
        (agents.WaitingHosts)."""
        self.late.hold(identity, hello, srcfd)
        self.state.events.emit("host_waiting", host=hello.host, pid=hello.pid, nproc=hello.nproc)

    def heard_waiting(self, identity: bytes, msg: P.Message) -> bool:
        """(I/O) A message from a held agent (True), else False; one that leaves is forgotten."""
        return self.late.heard(identity, isinstance(msg, (P.Goodbye, P.StartFailed)))

    def tick_waiting(self, now: float, silence: float) -> None:
        """(I/O, once per heartbeat interval) Ping the held agents (they wait while they hear from us); forget those
        silent for ``silence`` seconds."""
        for identity in self.late.pinged(now, silence):
            self._send(identity, P.Ping())

    def waiting_hosts(self) -> list[tuple[Agent, int]]:
        """The held agents with the ranks each brings (its --nproc-per-node), in the order they came."""
        return self.late.hosts()

    def admit_late(self, identity: bytes, ranks: list[int]) -> None:
        """(any thread) Admit held agent ``identity`` for global ``ranks``: its host is the next GROUP_RANK; it forks
        them when the welcome reaches it."""
        held, hello = self.late.take(identity)
        with self._lock:
            group_rank = len(self.agents)
            agent = Agent(identity, hello.host, hello.pid, hello.addr, list(ranks), dict(hello.launcher_env),
                          held.srcfd, last_heard=time.monotonic(), group_rank=group_rank, limits=list(hello.limits))
            self.agents = {**self.agents, identity: agent}  # swapped in whole: the I/O thread iterates it
            if held.srcfd >= 0:
                self._by_fd[held.srcfd] = agent
        self.reassign({}, self.state.nproc)  # its tables (and HostRanks to the others)
        self._post(identity, P.AgentWelcome(ranks=list(ranks), world_size=self.state.nproc, group_rank=group_rank,
                                            group_world_size=len(self.agents), settings=self.state.rank_settings()))

    def dismiss(self, identity: bytes, reason: str) -> None:
        """(any thread) Send admitted agent ``identity`` away (its ranks were stopped): a scale that admitted it
        gave up."""
        with self._lock:
            agent = self.agents.get(identity)
            self.agents = {k: a for k, a in self.agents.items() if k != identity}
            if agent is not None:
                agent.alive = False
                agent.declared.set()  # nothing to tell: its ranks were stopped
                self._by_fd = {fd: a for fd, a in self._by_fd.items() if a is not agent}
        if agent is not None:
            self._post(identity, P.Rejected(reason))

    def _by_agent(self, ranks: list[int]) -> dict[bytes, list[int]]:
        out: dict[bytes, list[int]] = {}
        for r in ranks:
            agent = self._rank_agent.get(r)
            if agent is not None and agent.alive:
                out.setdefault(agent.identity, []).append(r)
        return out

    def _post(self, identity: bytes, msg: P.Message) -> None:
        self.dispatcher.outbox.put(([identity], msg, b"", []))

    # ------------------------------------------------------------------ loss

    def all_gone(self, why: str) -> None:
        """(any thread) Every agent is gone with the process that started them (``--launcher agent`` or
        torchrun exited): their ranks are lost, and the reason names the agent (``why``: what became of it).
        Returns once each agent's loss was told, also one that another thread (the I/O thread, which saw its
        connection drop) is telling: the caller reports the ranks' exits next, and those must not come first."""
        with self._lock:
            agents = list(self.agents.values())
        # an agent's own word (a StartFailed, a Goodbye with a note) names the cause better than its exit status:
        # the I/O thread reads it before its connection's drop, which then tells the loss (sets ``declared``)
        end = time.monotonic() + OWN_WORD_GRACE
        for agent in agents:
            agent.exited = why  # the drop of its connection says this, not a guess, if it comes first
        for agent in agents:
            if agent.alive and not self.state.stopping:
                agent.declared.wait(max(0.0, end - time.monotonic()))
        for agent in agents:
            self._agent_gone(agent, f"its host agent (pid {agent.pid} on {agent.host}) {why}")
        for agent in agents:
            if not agent.declared.wait(LOSS_TOLD_TIMEOUT):
                log.warning("the loss of the host agent of %s (pid %d) was not told within %g s", agent.host,
                            agent.pid, LOSS_TOLD_TIMEOUT)

    def _agent_gone(self, agent: Agent, reason: str) -> None:
        """``agent`` disconnected or said goodbye: its ranks that were not reported gone are lost with it. Only
        the first caller tells it, and sets ``agent.declared`` when it has."""
        with self._lock:
            if not agent.alive:
                return
            agent.alive, agent.lost = False, reason
        try:
            self._tell_loss(agent, reason)
        finally:
            agent.declared.set()

    def _tell_loss(self, agent: Agent, reason: str) -> None:
        state = self.state
        with state.lock:
            if state.stopping:
                return
            alive = [r for r in agent.ranks if state.ranks[r].alive]
            starting = not state.running
            if starting:
                for r in alive:
                    info = state.ranks[r]
                    info.host = info.host or agent.host
                    info.start_error = info.start_error or f"rank {r}: {reason}"
                state.cond.notify_all()
                return
        if alive and self._lost is not None:
            log.warning("%s: %s", ranks_text(alive), reason)
            self._lost(alive, reason)
