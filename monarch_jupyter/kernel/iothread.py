"""The controller's I/O thread (``monarch-io``): the ROUTER socket, the handshake with ranks, heartbeats.

The I/O thread owns the ZeroMQ ROUTER socket and its Signer: only it receives, verifies and sends frames there
(``send_to`` asserts it). It

- verifies every message (HMAC, replays) and dispatches it through an explicit {type: handler} table: the
  handshake's own messages here, the rest to the handlers the mesh registers (results, transfers, debugger);
- runs the rendezvous handshake of local ranks: ``Hello`` -> ``Welcome`` (rank 0 first: it hosts the c10d store
  and reports its port with ``StoreReady``; the others are welcomed to that port) -> ``Ready``. Ranks that join
  from elsewhere are admitted by the mesh's Listener (launch/listener.py), which this thread calls;
- sends what other threads queued in the dispatcher's outbox, and writes work-pipe bytes a busy rank could not
  take yet;
- pings every rank once per ``heartbeat_interval``, and as often runs the tick callbacks (the heartbeat check of
  recovery.py, the Listener's deadline) once every message received so far was handled.

A turn handles received messages for ``RECV_BUDGET`` seconds at most, then sends what is queued and pings: a host
agent that streams a flood of output would otherwise keep the ROUTER socket readable for as long as it lasts, and
hold up the cells sent to it and the pings that tell it the controller is there (it ends its ranks after
``heartbeat_timeout`` seconds without word). The ticks wait until the socket is empty: the heartbeats of the
agent's ranks travel behind its output, and a check made with them still queued would find the ranks silent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import zmq

from monarch_worker import protocol as P
from monarch_worker.channel import recv_frames

from . import lograte
from .dispatch import Dispatcher, ToRanks
from .endpoint import ControllerSocket
from .state import BY_HOST, Handler, MeshState, RankInfo, RankState

if TYPE_CHECKING:  # the host links are a launcher's part: their module imports launch/ (not the reverse)
    from .launch.hosts import HostLinks

log = logging.getLogger(__name__)
log.addFilter(lograte.REJECTED)  # a stranger's messages are all rejected, but logged at a bounded rate
RECV_BUDGET = 0.02  # seconds of received messages handled per turn of the loop (see the module docstring)
DROPPED = lograte.kind("messages dropped by the controller")
REFUSED = lograte.kind("hellos refused by the controller")

__all__ = ["IOThread", "Admission", "post_regroup"]



class Admission(Protocol):
    """Admission of ranks started elsewhere (launch/listener.py's Listener); called on the I/O thread."""

    def on_hello(self, identity: bytes, msg: P.Hello, by_identity: dict[bytes, int]) -> None: ...

    def on_agent_hello(self, identity: bytes, msg: P.AgentHello, srcfd: int) -> None: ...

    def on_store_ready(self, rank: int, msg: P.StoreReady) -> None: ...

    def on_goodbye(self, rank: int, msg: P.Goodbye) -> None: ...

    def on_unknown(self, identity: bytes, msg: P.Message) -> bool: ...


def post_regroup(state: MeshState, dispatcher: Dispatcher, info: RankInfo, port: int, addr: str) -> None:
    """Tell surviving rank ``info`` to join its new process group (store at ``addr:port``; port 0: host it): the
    mesh's ``state.nproc`` ranks, where its local world size is ``state.local_world`` (-1: its own local rank and
    size; BY_HOST: numbered among the ranks on its host; else one host: its local rank is its rank); or, split
    (``state.partition``), its sub-mesh's, numbered inside it (its local rank: among the sub-mesh's ranks on its
    host)."""
    group = state.group_of(info.rank)
    if state.partition:
        inner = group.index(info.rank)
        local, local_world = state.host_local(info.rank, group)
        msg = P.Regroup(rank=inner, world_size=len(group), local_rank=local, local_world_size=local_world,
                        master_addr=addr, master_port=port, backend=info.backend or state.options.backend)
    else:
        if state.local_world == BY_HOST:  # ranks on several hosts, back from a split
            local, local_world = state.host_local(info.rank, group)
        else:  # local ranks (one host): the rank (back from a split); -1: its own
            local, local_world = (info.rank if state.local_world >= 0 else -1), state.local_world
        msg = P.Regroup(rank=info.rank, world_size=state.nproc, local_rank=local, local_world_size=local_world,
                        master_addr=addr, master_port=port, backend=info.backend or state.options.backend,
                        group_world_size=state.group_world)
    dispatcher.post(info.rank, msg)


class IOThread:
    """The I/O thread of one mesh and the socket it owns (see the module docstring).

    ``handlers``: what handles each message type ranks send (the handshake's own are added here); ``ticks``: what
    runs once per heartbeat interval; ``links``: the host agents (None for a mesh without them).
    """

    def __init__(self, state: MeshState, dispatcher: Dispatcher, socket: ControllerSocket,
                 admission: Admission | None, links: HostLinks | None, handlers: dict[type, Handler],
                 ticks: Sequence[Callable[[float], None]]) -> None:
        self.state = state
        self.dispatcher = dispatcher
        self.socket = socket
        self.admission = admission
        self.links = links
        self._by_identity: dict[bytes, int] = {}
        self._ticks = list(ticks)
        self._handlers: dict[type, Handler] = {
            P.StoreReady: self._on_store_ready,
            P.Ready: self._on_ready,
            P.StartFailed: self._on_start_failed,
            P.Heartbeat: self._on_heartbeat,
            P.Goodbye: self._on_goodbye,
            **handlers,
        }
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    # ------------------------------------------------------------------ generation (caller's thread)

    def open(self, secret: bytes) -> zmq.Socket:
        """A fresh context and ROUTER socket for a new generation (not bound yet)."""
        return self.socket.open(secret)

    def start(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="monarch-io", daemon=True)
        self.socket.owner = self._thread
        self._thread.start()

    def stop(self, linger_ms: int) -> None:
        """Stop the thread (it sends what was queued first), then close the socket (``linger_ms``: how long
        Shutdown/Rejected may take to leave) and the context."""
        if self._thread is not None and self._thread.is_alive():
            self._stop.set()
            self.dispatcher.outbox.put(None)
            self._thread.join(5.0)
        self._thread = None
        self.socket.owner = None
        if self.links is not None:
            self.links.close(self.socket.router)
        self.socket.close(linger_ms)

    @property
    def thread(self) -> threading.Thread | None:
        return self._thread

    # ------------------------------------------------------------------ I/O thread

    def send_to(self, identity: bytes, msg: P.Message) -> None:
        """Send ``msg`` to one peer now, through its host agent if one holds it (I/O thread only)."""
        self._deliver([identity], self.socket.pack(msg), msg)

    def _deliver(self, identities: list[Any], frames: list, msg: P.Message) -> None:
        """Send signed ``frames`` to each peer; a host agent gets them once for all its ranks (``Forward``)."""
        if self.links is not None:
            self.links.deliver(identities, frames, msg)
            return
        for identity in identities:
            if identity is not None:
                self.socket.send_frames(identity, frames)

    def _loop(self) -> None:
        assert self.socket.router is not None
        router, dispatcher, state = self.socket.router, self.dispatcher, self.state
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(dispatcher.outbox.wake_fd, zmq.POLLIN)
        monitor: zmq.Socket | None = None  # the host links' connection monitor (made when the listener opens)
        by_identity: dict[bytes, int] = {}
        self._by_identity = by_identity
        recv = recv_frames if self.links is None else self.links.recv
        next_ping = next_tick = 0.0
        interval = state.options.heartbeat_interval
        while not self._stop.is_set():
            if self.links is not None and self.links.monitor is not monitor:
                if monitor is not None:
                    poller.unregister(monitor)
                monitor = self.links.monitor
                if monitor is not None:
                    poller.register(monitor, zmq.POLLIN)
            # Work pipes that are full are polled until they take more (registered for this poll only: a pipe that
            # closes meanwhile must not sit in the poller).
            waiting = dispatcher.waiting_fds()
            for fd in waiting:
                poller.register(fd, zmq.POLLOUT)
            events = dict(poller.poll(int(interval * 1000)))
            for fd in waiting:
                poller.unregister(fd)
            dispatcher.flush_pipes()
            drained = True
            if router in events:
                budget = time.monotonic() + RECV_BUDGET
                while (frames := recv(router)) is not None:
                    self._receive(bytes(frames[0]), frames[1:], by_identity)
                    if time.monotonic() > budget:
                        drained = False  # the rest after the sends and pings: the next poll returns at once
                        break
            if monitor is not None and monitor in events and self.links is not None:
                self.links.on_monitor()  # after the ROUTER: what an agent said before it went comes first
            if dispatcher.outbox.wake_fd in events:
                self._send_outbox()
            now = time.monotonic()
            if now >= next_ping:
                next_ping = now + interval
                self._ping()
            if drained and now >= next_tick:
                next_tick = now + interval
                for tick in self._ticks:
                    tick(now)
                lograte.REJECTED.flush(now)
        self._send_outbox()  # what was queued while stopping (Shutdown, Rejected)

    def _ping(self) -> None:
        """Ping every rank that is not dead: one message per host agent when agents hold every rank, else rank by
        rank (an agent gets one Forward for its ranks either way)."""
        state, links = self.state, self.links
        ping = self.socket.pack(P.Ping())
        if links is not None:
            with state.lock:
                dead = {r for r in state.dead_ranks if r in state.ranks and state.ranks[r].base_state is RankState.DEAD}
            if links.ping(ping, dead):
                return
        with state.lock:
            idents = [i.identity for i in state.ranks.values() if i.identity and i.base_state is not RankState.DEAD]
        if links is not None:
            idents += links.agent_identities()
        self._deliver(idents, ping, P.Ping())

    def _receive(self, identity: bytes, frames: list, by_identity: dict[bytes, int]) -> None:
        try:
            msg, payload, bufs = self.socket.signer.unpack(frames)
        except (P.ProtocolError, ValueError, TypeError, KeyError) as e:
            log.warning("dropped a message from %r: %s", identity[:32], e, extra=DROPPED)
            if self.links is not None:
                self.links.bad_message()
            return
        links = self.links
        if links is not None and (links.is_agent(identity) or isinstance(msg, P.AgentHello)):
            if links.on_agent_message(identity, msg, payload, bufs, self._relayed):
                return
            if self.admission is not None and isinstance(msg, P.AgentHello):
                self.admission.on_agent_hello(identity, msg, links.srcfd())
                return
        if isinstance(msg, P.Hello):
            self._on_hello(identity, msg, by_identity)
            return
        rank = by_identity.get(identity)
        if rank is None and self.admission is not None and self.admission.on_unknown(identity, msg):
            return  # a rank waiting for the others to join
        if rank is None:
            log.warning("dropped %s from a peer that did not say hello", msg.TYPE, extra=DROPPED)
            return
        handler = self._handlers.get(type(msg))
        if handler is None:
            log.warning("rank %d sent an unexpected %s", rank, msg.TYPE, extra=DROPPED)
            return
        try:
            handler(rank, msg, payload, bufs)
        except Exception:  # noqa: BLE001 - keep the I/O thread alive whatever a rank sent
            log.exception("handling %s from rank %d failed", msg.TYPE, rank)

    def _relayed(self, identity: bytes, frames: list) -> None:
        """A message a host agent relayed for one of its ranks (``identity``: the rank's, launch/hosts.py)."""
        self._receive(identity, frames, self._by_identity)

    def _send_outbox(self) -> None:
        for identities, msg, payload, buffers in self.dispatcher.drain():
            # One signature for every recipient: each rank checks replays per sender session.
            frames = self.socket.pack(msg, payload, buffers)
            if isinstance(identities, ToRanks):
                if self.links is not None:
                    self.links.deliver_ranks(identities.ranks, frames, msg)
                    continue
                with self.state.lock:
                    identities = [self.state.ranks[r].identity for r in identities.ranks if r in self.state.ranks]
            self._deliver(identities, frames, msg)

    # ------------------------------------------------------------------ handshake (I/O thread)

    def welcome(self, info: RankInfo, port: int) -> P.Welcome:
        """What admits local rank ``info`` to the store at ``port`` (0: host it); sent by the caller, after it
        released the lock."""
        n = self.state.nproc
        return P.Welcome(rank=info.rank, world_size=n, local_rank=info.rank, local_world_size=n,
                         master_addr="127.0.0.1", master_port=port, elastic=self.state.elastic(0, 1))

    def _send_all(self, sends: list[tuple[bytes, P.Message]]) -> None:
        for identity, msg in sends:
            self.send_to(identity, msg)

    def _on_hello(self, identity: bytes, msg: P.Hello, by_identity: dict[bytes, int]) -> None:
        if self.links is not None and self.links.on_rank_hello(identity, msg, by_identity):
            return
        if self.admission is not None:
            self.admission.on_hello(identity, msg, by_identity)
            return
        if msg.version != P.PROTOCOL_VERSION:
            log.warning("rank %d speaks protocol %d, controller %d; ignored", msg.rank, msg.version,
                        P.PROTOCOL_VERSION, extra=REFUSED)
            return
        state = self.state
        sends: list[tuple[bytes, P.Message]] = []
        with state.lock:
            info = state.ranks.get(msg.rank)
            if info is None or info.identity is not None:
                log.warning("rejected hello for rank %d (unknown or taken)", msg.rank, extra=REFUSED)
                return
            info.identity = identity
            info.host = msg.host
            info.pid = info.pid or msg.pid
            info.last_heard = time.monotonic()
            by_identity[identity] = msg.rank
            if msg.rank in state.solo:  # a replacement that joins the group later (kernel/healing.py)
                sends.append((identity, self.welcome(info, P.NO_GROUP)))
            elif msg.rank == 0:
                sends.append((identity, self.welcome(info, 0)))
            elif state.store_port is not None:
                sends.append((identity, self.welcome(info, state.store_port)))
        self._send_all(sends)

    def _on_store_ready(self, rank: int, msg: P.StoreReady, payload: bytes, bufs: list) -> None:
        state = self.state
        sends: list[tuple[bytes, P.Message]] = []
        if state.regroup_active:  # a new process group for survivors and restarted ranks (recovery.py)
            addr = msg.addr or "127.0.0.1"
            with state.lock:
                group = state.group_of(rank)  # the leader ``rank`` hosts its group's store (a sub-mesh's, or all's)
                if group[0] == 0 and len(group) == state.nproc:
                    state.store_port = msg.port
                for info in state.ranks.values():
                    if info.rank == rank or info.rank not in group or info.identity is None:
                        continue
                    if info.rank in state.regrouping:
                        post_regroup(state, self.dispatcher, info, msg.port, addr)
                    elif self.links is None or not self.links.holds(info.rank):
                        sends.append((info.identity, self.welcome(info, msg.port)))
            self._send_all(sends)
            if self.links is not None and not state.partition:  # fresh ranks on host agents
                self.links.on_store_ready(P.StoreReady(msg.port, addr))
            return
        if self.admission is not None:
            self.admission.on_store_ready(rank, msg)
            return
        with state.lock:
            state.store_port = msg.port
            for info in state.ranks.values():
                if info.rank != 0 and info.identity is not None:
                    sends.append((info.identity, self.welcome(info, msg.port)))
        self._send_all(sends)

    def _on_ready(self, rank: int, msg: P.Ready, payload: bytes, bufs: list) -> None:
        state = self.state
        with state.lock:
            info = state.ranks[rank]
            info.state = RankState.IDLE
            info.device, info.backend, info.host = msg.device, msg.backend, msg.host
            info.group = msg.backend
            state.cond.notify_all()
        state.events.emit("rank_state", rank=rank, state="idle", host=msg.host, device=msg.device, pid=msg.pid)

    def _on_start_failed(self, rank: int, msg: P.StartFailed, payload: bytes, bufs: list) -> None:
        with self.state.lock:
            self.state.ranks[rank].start_error = msg.error
            self.state.cond.notify_all()

    def _on_heartbeat(self, rank: int, msg: P.Heartbeat, payload: bytes, bufs: list) -> None:
        state = self.state
        with state.lock:
            info = state.ranks[rank]
            info.rss = msg.rss
            info.cuda_allocated, info.cuda_reserved = msg.cuda_allocated, msg.cuda_reserved
            info.group = msg.group
            info.last_heard = time.monotonic()
        state.events.emit("heartbeat", rank=rank, rss=msg.rss, cuda_allocated=msg.cuda_allocated,
                          cuda_reserved=msg.cuda_reserved)

    def _on_goodbye(self, rank: int, msg: P.Goodbye, payload: bytes, bufs: list) -> None:
        if self.admission is not None:  # local ranks' exits come from the fork server
            self.admission.on_goodbye(rank, msg)
