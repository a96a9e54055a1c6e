"""Ranks that join: started on any host by an engine (torchrun, srun, a Kubernetes Job, a shell), they connect to
the controller, prove the per-mesh secret and are admitted.

``Listener`` is the controller's side, one per Mesh that does not use the local fork server. Per generation
(start/restart) it binds the controller's socket to an explicitly chosen address (loopback unless told
otherwise; CurveZMQ encryption on request), writes the secret to a 0600 file, and runs the admission: every
``Hello`` is checked (protocol version, world size, rank taken), held until all ``world_size`` ranks are
there, then numbered where the launcher did not number it (grouped by host), and welcomed. Rank 0 hosts the
c10d store on its address toward the controller, or, when the launcher set MASTER_ADDR/MASTER_PORT
(torchrun), every rank uses ``env://``. When the start timeout passes first, the report names who joined and
who is missing.

The launchers (who starts the ranks) and the printed commands are in launch/join.py.

Threads: methods marked (I/O) run on the mesh's I/O thread (which owns the socket; ``attach`` gives its
``send_to``); ``wait_ready`` and ``wait_exited`` on the caller's thread; launcher exit events on the launcher's
waiter thread. State is guarded by the mesh's lock.
"""

from __future__ import annotations

import atexit
import contextvars
import logging
import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Any

import zmq

from monarch_worker import protocol as P

from ...errors import MeshStartError, describe_returncode
from ...ranks import format_ranks
from .. import lograte
from ..state import MeshState, RankState
from .admission import Joiner, agent_refusal, rank_refusal, slots, waiting_report
from .base import LauncherEvents
from .join import (
    JoinCommands,
    JoinLauncher,
    ProcessLauncher,
    open_rdzv_store,
    resolve_address,
    write_secret_file,
)

if TYPE_CHECKING:
    from collections.abc import Callable

    from ..dispatch import Dispatcher
    from .hosts import HostLinks

log = logging.getLogger(__name__)
log.addFilter(lograte.REJECTED)
REFUSED = lograte.kind("hellos refused by the controller")

__all__ = ["Listener"]

PENDING_SILENCE = 10.0  # seconds without a heartbeat after which a rank waiting for the others is dropped
RDZV_LINGER = 30.0  # seconds torchrun's rendezvous store stays up after the mesh stopped (agents leave it)


# ---------------------------------------------------------------------------------------------------- listener


class Listener:
    """The controller's side of joined ranks (see the module docstring).

    Parameters
    ----------
    state:
        The state of the mesh it admits ranks to.
    launcher:
        A JoinLauncher (or a subclass that starts the ranks: torchrun, srun).
    address:
        Where to listen: None (loopback), an interface, an address or host name of this host, or ``*``.
    port:
        TCP port (0: any free port).
    encrypt:
        Encrypt and authenticate the connections with CurveZMQ (needs libzmq with CURVE).
    secret_file:
        Where to write the secret (default: a new file in Jupyter's runtime directory); removed at stop.

    Raises
    ------
    ValueError
        Bad address or port, or encryption asked for without CURVE support.
    """

    def __init__(self, state: MeshState, launcher: JoinLauncher, address: str | None, port: int, encrypt: bool,
                 secret_file: str | None, send_to: Callable[[bytes, P.Message], None], dispatcher: Dispatcher,
                 sink: LauncherEvents, hosts: HostLinks | None) -> None:
        if not 0 <= port < 65536:
            raise ValueError(f"port must be 0 (any) or 1-65535, got {port}")
        if encrypt and not zmq.has("curve"):
            raise ValueError("encrypt=True needs libzmq built with CURVE (libsodium); this pyzmq has none")
        self.state = state
        self.launcher = launcher
        self.bind_ip, self.advertised = resolve_address(address)
        self.port = port
        self.encrypt = encrypt
        self.secret_file_option = secret_file
        self.commands: JoinCommands | None = None
        self.is_open = False
        self.opened_at = 0.0
        self.deadline = 0.0
        self.failed = ""
        self._pending: dict[bytes, Joiner] = {}
        self._hosts = 1  # hosts of the admitted ranks (torchrun's GROUP_WORLD_SIZE)
        self._placement: dict[int, Joiner] = {}
        self._arrivals = 0
        self._complete = False
        self._launcher_rc: int | None = None
        self._secret_path = ""
        self._curve_public = ""
        self._rdzv_store: Any = None
        self._ctx = contextvars.copy_context()
        self.waiting = False
        self._secret = b""
        self._send_to = send_to  # the I/O thread's send (through host agents: launch/hosts.py)
        self._dispatcher = dispatcher
        self._sink = sink
        self.hosts = hosts  # the host agents' side (launch/hosts.py)
        self.rejected: list[str] = []  # "host (pid): reason" of agents and ranks turned away, for the report

    def use_sink(self, sink: LauncherEvents) -> None:
        """Report the ranks of the generation about to open to ``sink``."""
        self._sink = sink

    @property
    def loopback(self) -> bool:
        return self.bind_ip.startswith("127.")

    # ---- generation (caller thread)

    def open(self, router: zmq.Socket, secret: bytes) -> str:
        """Bind ``router`` and write the secret file; returns the address ranks connect to."""
        self._pending, self._placement, self._arrivals = {}, {}, 0
        self._complete, self._launcher_rc, self.failed, self.rejected = False, None, "", []
        if self.hosts is not None:
            self.hosts.open(router)  # its connection monitor must see every connection
        router.setsockopt(zmq.ROUTER_HANDOVER, 0)  # a second connection can never take over a rank's identity
        if self.encrypt:
            public, secret_key = zmq.curve_keypair()
            router.curve_server = True
            router.curve_secretkey = secret_key
            self._curve_public = public.decode()
        try:
            if self.port:
                router.bind(f"tcp://{self.bind_ip}:{self.port}")
                port = self.port
            else:
                port = router.bind_to_random_port(f"tcp://{self.bind_ip}")
        except zmq.ZMQError as e:
            raise MeshStartError(f"cannot listen on {self.bind_ip}:{self.port or 'any port'}: {e}") from None
        url = f"tcp://{self.advertised}:{port}"
        self._secret = secret
        self._secret_path = write_secret_file(self.secret_file_option, secret)
        atexit.register(self._remove_secret)  # also when the kernel exits without stopping the mesh
        world = self.state.nproc
        per_node = self.launcher.ranks_per_host(world)
        if world % per_node:
            raise ValueError(f"nproc_per_node {per_node} does not divide the world size {world}")
        rdzv = ""
        gen = os.urandom(4).hex()
        if world // per_node > 1 and not self.launcher.starts_ranks:
            self._rdzv_store = open_rdzv_store(self.advertised, max(self.state.options.start_timeout, 60))
            rdzv = f"{self.advertised}:{self._rdzv_store.port}"
        self.commands = JoinCommands(url, self._secret_path, world, per_node, self._curve_public, rdzv,
                                     f"monarch-{gen}", sys.executable,
                                     join_timeout=self.state.options.start_timeout + 10)
        self.is_open = True
        self.opened_at = time.monotonic()
        self.deadline = self.opened_at + self.state.options.start_timeout
        self._ctx = contextvars.copy_context()
        if not self.loopback:
            log.info("the mesh listens on %s (bound to %s)", url, self.bind_ip)
        return url

    def launch(self, env: dict[str, str]) -> JoinLauncher:
        assert self.commands is not None
        self.launcher.bind(self.hosts, self.wait_exited, self.placement)
        self.launcher.launch(self.commands, env, self._secret.hex(), self)
        return self.launcher

    def close(self) -> None:
        """After the mesh's socket closed: remove the secret file and the rendezvous store."""
        self.is_open = False
        atexit.unregister(self._remove_secret)
        self._remove_secret()
        if self._rdzv_store is not None:  # torchrun agents still leave its rendezvous for a moment
            store, self._rdzv_store = self._rdzv_store, None
            timer = threading.Timer(RDZV_LINGER, lambda: store)  # holds the last reference until it fires
            timer.daemon = True
            timer.start()
        if isinstance(self.launcher, ProcessLauncher):
            self.launcher.cleanup()

    def _remove_secret(self) -> None:
        if self._secret_path:
            try:
                os.unlink(self._secret_path)
            except OSError:
                pass
            self._secret_path = ""

    # ---- admission (I/O thread)

    def on_hello(self, identity: bytes, msg: P.Hello, by_identity: dict[bytes, int]) -> None:
        reason = rank_refusal(identity, msg, self.state.nproc, self._pending, self._complete, self.failed)
        if reason:
            log.warning("rejected a rank from %s (pid %d): %s", msg.host, msg.pid, reason, extra=REFUSED)
            self._send(identity, P.Rejected(reason))
            return
        with self.state.lock:
            self._arrivals += 1
            self._pending[identity] = Joiner(identity, msg, self._arrivals, time.monotonic(), msg.rank)
            if msg.rank >= 0:  # numbered by its launcher: %mesh status shows where it is while others come
                info = self.state.ranks[msg.rank]
                info.host, info.pid = msg.host, msg.pid
            self.state.cond.notify_all()
        self._joined(msg.host, msg.pid, msg.rank, by_identity)

    def _joined(self, host: str, pid: int, rank: int, by_identity: dict[bytes, int]) -> None:
        joined = slots(self._pending)
        self.state.events.emit("rank_joined", host=host, pid=pid, rank=rank, joined=joined,
                               world_size=self.state.nproc)
        if joined == self.state.nproc:
            self._admit(by_identity)

    def on_agent_hello(self, identity: bytes, msg: P.AgentHello, srcfd: int) -> None:
        """(I/O) A host agent asks to join for ``msg.nproc`` ranks; one that comes to a running mesh of agents that
        listens waits for a ``%mesh scale`` to admit it (HostLinks.hold)."""
        if (self._complete and self.state.running and self.hosts is not None and self.hosts.agents
                and not self.launcher.starts_ranks and msg.version == P.PROTOCOL_VERSION
                and identity not in self.hosts.late):
            self.hosts.hold(identity, msg, srcfd)
            return
        reason = agent_refusal(identity, msg, self.state.nproc, self._pending, self._complete, self.failed)
        if reason:
            log.warning("rejected the host agent of %s (pid %d): %s", msg.host, msg.pid, reason, extra=REFUSED)
            self.rejected.append(f"{msg.host} (pid {msg.pid}): {reason}")
            self._send(identity, P.Rejected(reason))
            return
        with self.state.lock:
            self._arrivals += 1
            self._pending[identity] = Joiner(identity, msg, self._arrivals, time.monotonic(), count=msg.nproc,
                                              agent=True, srcfd=srcfd)
            self.state.cond.notify_all()
        self._joined(msg.host, msg.pid, -1, {})

    def _admit(self, by_identity: dict[bytes, int]) -> None:
        """Every rank is here: number the unnumbered ones (grouped by host), then welcome them."""
        joiners = list(self._pending.values())
        if any(j.agent for j in joiners):
            self._admit_agents(joiners)
            return
        free = iter(sorted(set(range(self.state.nproc)) - {j.rank for j in joiners if j.rank >= 0}))
        for j in sorted((j for j in joiners if j.rank < 0), key=lambda j: (j.hello.host, j.arrival)):
            j.rank = next(free)
        hosts: dict[str, list[Joiner]] = {}
        for j in sorted(joiners, key=lambda j: j.rank):
            hosts.setdefault(j.hello.host, []).append(j)
        for index, group in enumerate(hosts.values()):
            for i, j in enumerate(group):
                j.local_rank = j.hello.local_rank if j.hello.local_rank >= 0 else i
                j.local_world_size = j.hello.local_world_size if j.hello.local_world_size > 0 else len(group)
                j.group_rank = index  # torchrun's GROUP_RANK: the host's place, hosts ordered by their lowest rank
        self._hosts = len(hosts)
        masters = {(j.hello.launcher_env.get("MASTER_ADDR"), j.hello.launcher_env.get("MASTER_PORT"))
                   for j in joiners}
        use_env = len(masters) == 1 and None not in next(iter(masters)) and all(j.hello.rank >= 0 for j in joiners)
        now = time.monotonic()
        with self.state.lock:
            for j in joiners:
                info = self.state.ranks[j.rank]
                info.identity, info.host, info.pid, info.last_heard = j.identity, j.hello.host, j.hello.pid, now
                by_identity[j.identity] = j.rank
                self._placement[j.rank] = j
            self._pending = {}
            self._complete = True
        for j in joiners:
            self.launcher.note_rank(j.rank, j.hello.pid, j.hello.host)
        log.info("all %d ranks joined (%s); rendezvous %s", len(joiners), self.hosts_text(),
                 "env:// (the launcher's)" if use_env else "a store on rank 0")
        if use_env:
            for j in joiners:
                self._welcome(j, "", -1)
        else:
            self._welcome(self._placement[0], "", 0)

    def _admit_agents(self, agents: list[Joiner]) -> None:
        """Every host agent is here: number the hosts (the launcher's order, else by host name), give each its
        ranks, and welcome it; its ranks then say hello through it (launch/hosts.py)."""
        assert self.hosts is not None
        order = sorted(agents, key=lambda j: (j.hello.group_rank < 0, j.hello.group_rank, j.hello.host, j.arrival))
        masters = {(j.hello.launcher_env.get("MASTER_ADDR"), j.hello.launcher_env.get("MASTER_PORT"))
                   for j in agents}
        self.hosts.use_env = (len(masters) == 1 and None not in next(iter(masters))
                              and all(j.hello.group_rank >= 0 for j in agents))
        now = time.monotonic()
        first = 0
        with self.state.lock:
            for j in order:
                j.rank = first
                for local in range(j.count):
                    r = first + local
                    self._placement[r] = Joiner(b"", j.hello, j.arrival, now, r, local, j.count, agent=True)
                    info = self.state.ranks[r]
                    info.host, info.last_heard = j.hello.host, 0.0
                first += j.count
            self._pending = {}
            self._complete = True
        for g, j in enumerate(order):
            self.hosts.admit(j.identity, j.hello, list(range(j.rank, j.rank + j.count)), g, len(order), j.srcfd)
        log.info("all %d host agents joined (%s); rendezvous %s", len(order), self.hosts_text(),
                 "env:// (the launcher's)" if self.hosts.use_env else "a store on rank 0")

    def on_store_ready(self, rank: int, msg: P.StoreReady) -> None:
        """(I/O) Rank 0 hosts the store: the others can join it."""
        if self.hosts is not None and self.hosts.agents:
            self.hosts.on_store_ready(msg)
            return
        for r, j in self._placement.items():
            if r != 0:
                self._welcome(j, msg.addr, msg.port)

    def _welcome(self, j: Joiner, addr: str, port: int) -> None:
        settings = self.state.rank_settings()  # the torchft Lighthouse's address among its env
        self._send(j.identity, P.Welcome(rank=j.rank, world_size=self.state.nproc, local_rank=j.local_rank,
                                         local_world_size=j.local_world_size, master_addr=addr, master_port=port,
                                         settings=settings, elastic=self.state.elastic(j.group_rank, self._hosts)))

    def _send(self, identity: bytes, msg: P.Message) -> None:
        self._send_to(identity, msg)

    def on_unknown(self, identity: bytes, msg: P.Message) -> bool:
        """(I/O) A verified message from a rank not numbered yet; True when it belongs to a waiting joiner."""
        if self.hosts is not None and self.hosts.heard_waiting(identity, msg):
            return True
        j = self._pending.get(identity)
        if j is None:
            return False
        j.last_heard = time.monotonic()
        if j.agent and isinstance(msg, P.StartFailed):
            with self.state.lock:
                self.failed = msg.error
                self.state.cond.notify_all()
        if isinstance(msg, (P.Goodbye, P.StartFailed)):
            self._forget(identity)
            log.warning("%s from %s (pid %d) left before the mesh was complete", "a host agent" if j.agent
                        else "a rank", j.hello.host, j.hello.pid)
        return True

    def _forget(self, identity: bytes) -> None:
        """A rank that waited to be admitted is gone."""
        with self.state.lock:
            j = self._pending.pop(identity, None)
            if j is not None and j.rank >= 0:
                info = self.state.ranks[j.rank]
                info.host, info.pid = "", None

    def on_goodbye(self, rank: int, msg: P.Goodbye) -> None:
        """(I/O) A joined rank exits."""
        self._rank_exited(rank, msg.returncode)

    def _rank_exited(self, rank: int, returncode: int) -> None:
        with self.state.lock:
            info = self.state.ranks.get(rank)
            if info is None or info.state in (RankState.DEAD, RankState.STOPPED):
                return
        self.launcher.note_exit(rank)
        assert self._sink is not None
        self._sink.on_exit(rank, returncode)

    def on_launcher_exit(self, returncode: int) -> None:
        """(launcher's waiter thread) The engine exited: so did every rank it ran."""
        if self.hosts is not None:  # the ranks died of their agent's end: say so (else: "died (signal SIGKILL)")
            code = describe_returncode(returncode)  # first: an agent's own word on why comes before the exit status
            self.hosts.all_gone(f"exited ({code})" if self.launcher.name == "agent"
                                else f"ended with {self.launcher.name}, which exited ({code})")
        with self.state.lock:
            self._launcher_rc = returncode
            ranks = list(self.state.ranks)
            self.state.cond.notify_all()
        for r in ranks:
            self._rank_exited(r, returncode)

    # LauncherEvents, for launchers that report per rank
    def on_spawned(self, rank: int, pid: int) -> None:
        assert self._sink is not None
        self._sink.on_spawned(rank, pid)

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        assert self._sink is not None
        self._sink.on_output(rank, stream, data)

    def on_exit(self, rank: int, returncode: int, cause: str = "") -> None:
        self._rank_exited(rank, returncode)

    def check(self, now: float) -> None:
        """(I/O, once per heartbeat interval) Drop waiting joiners that went silent; give up at the deadline."""
        if self.hosts is not None and self.hosts.late.agents:
            self.hosts.tick_waiting(now, max(PENDING_SILENCE, 5 * self.state.options.heartbeat_interval))
        if not self.is_open or self.failed or self.state.running:
            return
        for identity, j in list(self._pending.items()):
            if now - j.last_heard > max(PENDING_SILENCE, 5 * self.state.options.heartbeat_interval):
                self._forget(identity)
                log.warning("a rank from %s (pid %d) went silent before the mesh was complete", j.hello.host,
                            j.hello.pid)
        if now > self.deadline:
            report = self.missing_report()
            for identity in list(self._pending):
                self._send(identity, P.Rejected(f"the mesh did not get all its ranks in time: {report}"))
            with self.state.lock:
                self.failed = report
                self.state.cond.notify_all()
                waiting = self.waiting
            # %mesh listen returned long ago: say it in that cell's output (a start that launches its ranks waits
            # for them, and its error says it)
            if not waiting and not self.launcher.starts_ranks:
                self._ctx.run(lambda: sys.stderr.write(f"mesh: {report}\n"))

    def reject_pending(self, reason: str) -> None:
        """(any thread) Tell the ranks still waiting to be admitted to exit."""
        with self.state.lock:
            identities = list(self._pending)
        if identities:
            self._dispatcher.outbox.put((identities, P.Rejected(reason), b"", []))

    # ---- reports

    def hosts_text(self) -> str:
        hosts: dict[str, list[int]] = {}
        for r, j in sorted(self._placement.items()):
            hosts.setdefault(j.hello.host, []).append(r)
        return ", ".join(f"{h}: ranks {format_ranks(rs)}" for h, rs in hosts.items())

    def missing_report(self) -> str:
        """Who joined and who is missing, for a start that timed out."""
        world = self.state.nproc
        if self._complete:  # everyone came; some did not get through the process group's rendezvous
            late = [r for r, i in self.state.ranks.items() if i.state is not RankState.IDLE]
            where = ", ".join(f"{r} on {self._placement[r].hello.host}" for r in late if r in self._placement)
            timeout = self.state.options.start_timeout
            hosts = {j.hello.host for j in self._placement.values()}
            why = (f"raise the start timeout (now {timeout:g} s:  %mesh start --timeout S,  Mesh(start_timeout=S))"
                   if len(hosts) <= 1 else
                   "can the hosts reach each other (rank 0's store, gloo: set GLOO_SOCKET_IFNAME to the right "
                   f"interface)? See docs/multihost.md; or raise the start timeout (now {timeout:g} s)")
            return (f"all {world} ranks came, but rank(s) {where} did not join the process group in time: {why}")
        bad = self.hosts.bad_peers if self.hosts is not None else {}
        return waiting_report(world, self.state.options.start_timeout, self._pending, self.rejected, bad,
                              self.state.address, self.launcher)

    # ---- waiting (caller thread)

    def wait_ready(self, deadline: float) -> bool:
        """Wait until every rank joined the process group (True), ``deadline`` (monotonic) passed (False), or
        the start failed.

        Raises
        ------
        MeshStartError
            The start timeout passed first (the report names who is missing), a rank failed to join, or the
            launcher exited.
        """
        m = self.state
        with m.cond:
            self.waiting = True
            try:
                while True:
                    if self.failed:
                        first = next((r for r in range(m.nproc) if m.ranks[r].state is not RankState.IDLE), -1)
                        raise MeshStartError(f"the mesh did not start: {self.failed}", first)
                    # a rank's own reason first: the launcher exits with the ranks whose start failed
                    bad = ([i for i in m.ranks.values() if i.start_error]
                           or [i for i in m.ranks.values() if i.state is RankState.DEAD])
                    if self._launcher_rc is not None and not (bad and bad[0].start_error) and not all(
                            i.state is RankState.IDLE for i in m.ranks.values()):
                        raise MeshStartError(
                            f"{self.launcher.name} exited ({describe_returncode(self._launcher_rc)}) before every rank "
                            f"joined; {self.missing_report()}")
                    if bad:
                        info = bad[0]
                        why = ("failed to join" if info.start_error
                               else f"exited ({describe_returncode(info.returncode)})")
                        detail = info.start_error or "\n".join(info.last_lines)
                        tail = self.launcher.log_tail()
                        if tail:
                            detail += f"\n{self.launcher.name} output:\n{tail}"
                        raise MeshStartError(f"rank {info.rank} (host {info.host or '?'}) {why} while the mesh was "
                                             "starting", info.rank, detail.strip("\n"))
                    if all(i.state is RankState.IDLE for i in m.ranks.values()):
                        return True
                    now = time.monotonic()
                    if now > self.deadline + 3 * m.options.heartbeat_interval + 1:  # the I/O thread should have said so
                        self.failed = self.missing_report()
                        continue
                    if now >= deadline:
                        return False
                    m.cond.wait(min(deadline - now, 0.1))
            finally:
                self.waiting = False

    def wait_exited(self, timeout: float) -> bool:
        """Wait until every admitted rank exited (said goodbye), up to ``timeout`` seconds."""
        m = self.state
        end = time.monotonic() + timeout
        with m.cond:
            while any(i.identity is not None and i.state not in (RankState.DEAD, RankState.STOPPED)
                      for i in m.ranks.values()):
                remaining = end - time.monotonic()
                if remaining <= 0:
                    return False
                m.cond.wait(min(remaining, 0.05))
        return True

    def placement(self) -> dict[int, dict[str, Any]]:
        """rank -> {"host", "local_rank", "local_world_size", "launcher_env"} of the admitted ranks."""
        return {r: {"host": j.hello.host, "local_rank": j.local_rank, "local_world_size": j.local_world_size,
                    "launcher_env": dict(j.hello.launcher_env)} for r, j in sorted(self._placement.items())}

    def joined_text(self) -> str:
        """How far the join got, and the way out, for what refuses or stops while the mesh listens."""
        return (f"{self.joined_count()} of {self.state.nproc} joined so far and the mesh still listens for the others "
                "(%mesh status  shows who joined,  %mesh stop  stops waiting)")

    def joined_count(self) -> int:
        return len(self._placement) if self._complete else slots(self._pending)
