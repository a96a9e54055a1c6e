"""Simulated hosts for bench/bench_multihost.py: meshes of 256, 1,024 and 4,096 ranks on one 2-core machine.

A simulated agent (``python bench/simhosts.py agent ...``) speaks the real agent protocol to a real controller
(``Mesh.listen``): AgentHello, the ranks' Hello / StoreReady / Ready relayed in HostEvents, Forward in, compact
``done`` events out. Its ranks are not processes: they finish every cell at once, so what is measured is the
controller's cost and the messages' path, not rank work. A simulated relay (``... relay ...``) is the inner node of
a tree: to the controller it is one agent for all the ranks below it; it hands each Forward to its children once
and merges their batches (the ``done`` events of one cell become one) before it answers. The children of a relay
speak the same protocol to it as agents speak to the controller, with the same secret. A relay's merged ``done``
event lists its ranks in order (its children's lists sorted by their first rank), so that the controller sees one
range per relay.

``agents`` runs several simulated agents in one process, each with its own connection (to the controller they
are that many hosts): on a 2-core machine, fewer processes compete with the controller for the CPUs. A relay starts
its agents that way, in one process. Agents answer a cell with one ``span`` event when ``SIMHOSTS_SPANS=1`` (what
this checkout's agents send for consecutive ranks), else with a ``done`` event that lists ranks and durations;
``SIMHOSTS_DELAY`` (seconds) makes each agent take that long to answer a cell (the controller's cost at a longer
latency).

This is a model of docs/scale.md's design, not the product: the product's agent (monarch_worker.agent) forks real
ranks; relays are the documented next step.
"""

from __future__ import annotations

import os
import sys
import time

import zmq

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from monarch_worker import protocol as P  # noqa: E402
from monarch_worker.channel import recv_frames, send_frames  # noqa: E402

BEAT = 1.0  # seconds between the batches that say "alive"
ALL = [-1]  # a Forward's ranks: every rank of the agent (or of the relay: every rank below it)
# Agents answer a cell with one ("span", cell, start, stop, durations) event (what monarch_worker.hostlink sends for
# consecutive ranks) when this is "1", else with ("done", cell, ranks, durations) (what controllers before the
# span event read: bench_scale.py sets it for this checkout's rows only)
SPANS = os.environ.get("SIMHOSTS_SPANS") == "1"
DELAY = float(os.environ.get("SIMHOSTS_DELAY", "0"))  # seconds each agent takes to answer a cell


class Upstream:
    """The connection toward the controller (or a relay): one DEALER, one signer."""

    def __init__(self, address: str, secret: bytes, ctx: zmq.Context | None = None) -> None:
        self.ctx = ctx or zmq.Context()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.IDENTITY, f"sim-{os.getpid()}-{os.urandom(4).hex()}".encode())
        self.sock.connect(address)
        self.signer = P.Signer(secret)
        self.rank_signer = P.Signer(secret)  # the session the simulated ranks sign with

    def send(self, msg: P.Message, payload: bytes = b"", buffers: list | tuple = ()) -> None:
        send_frames(self.sock, self.signer.pack(msg, payload, buffers))

    def events(self, events: list, relayed: list) -> None:
        self.send(P.HostEvents(events), b"", relayed)

    def relay(self, ranks: list[int], make: object) -> tuple[list, list]:
        """("msg", rank, n) events and frames for one message per rank, signed as the ranks would."""
        events, frames = [], []
        for r in ranks:
            f = self.rank_signer.pack(make(r))  # type: ignore[operator]
            events.append(("msg", r, len(f)))
            frames += f
        return events, frames


class SimAgent:
    """One simulated host agent of ``nproc`` ranks that finish every cell at once (its own connection)."""

    def __init__(self, address: str, secret_hex: str, nproc: int, ctx: zmq.Context, name: str) -> None:
        self.secret_hex = secret_hex
        self.up = Upstream(address, bytes.fromhex(secret_hex), ctx)
        self.up.send(P.AgentHello(host=name, pid=os.getpid(), nproc=nproc, addr="127.0.0.1"))
        self.ranks: list[int] = []

    def on_readable(self) -> bool:
        """Handle what came; False once told to stop."""
        up = self.up
        while (frames := recv_frames(up.sock)) is not None:
            msg, _, bufs = up.signer.unpack(frames)
            if isinstance(msg, P.AgentWelcome):
                self.ranks, world = list(msg.ranks), msg.world_size
                ev, fr = up.relay(self.ranks, lambda r, w=world: P.Hello(rank=r, pid=os.getpid(), host="sim",
                                                                         world_size=w))
                up.events(ev, fr)
            elif isinstance(msg, P.Forward):
                its = self.ranks if msg.ranks == ALL else list(msg.ranks)
                if msg.kind == "welcome":
                    welcome = P.Signer(bytes.fromhex(self.secret_hex)).unpack(bufs)[0]
                    assert isinstance(welcome, P.Welcome)
                    events, frames_out = [], []
                    if welcome.master_port == 0:
                        ev, fr = up.relay(its, lambda r: P.StoreReady(port=1, addr="127.0.0.1"))
                        events += ev
                        frames_out += fr
                    ev, fr = up.relay(its, lambda r: P.Ready(device="cpu", backend="sim", host="sim",
                                                             pid=os.getpid()))
                    up.events(events + ev, frames_out + fr)
                elif msg.kind in ("exec", "call") and msg.cell_id >= 0:
                    if DELAY:
                        time.sleep(DELAY)
                    if SPANS and its and its[-1] - its[0] + 1 == len(its):
                        up.events([("span", msg.cell_id, its[0], its[-1] + 1, bytes(8 * len(its)))], [])  # 0.0 s
                    else:
                        up.events([("done", msg.cell_id, its, [0.0] * len(its))], [])
                elif msg.kind == "shutdown":
                    up.events([("exit", r, 0) for r in its], [])
            elif isinstance(msg, (P.Shutdown, P.Rejected)):
                return False
        return True

    def beat(self) -> None:
        if self.ranks:
            self.up.events([("beat", [(r, 0, 0, 0, "sim") for r in self.ranks])], [])


def agents(address: str, secret_hex: str, nproc: int, count: int) -> None:
    """``count`` simulated host agents of ``nproc`` ranks each, in this one process (one connection each: to the
    controller they are ``count`` hosts; on a 2-core machine, fewer processes compete with the controller)."""
    ctx = zmq.Context()
    sims = [SimAgent(address, secret_hex, nproc, ctx, f"sim{os.getpid()}-{i}") for i in range(count)]
    poller = zmq.Poller()
    by_sock = {}
    for sim in sims:
        poller.register(sim.up.sock, zmq.POLLIN)
        by_sock[sim.up.sock] = sim
    next_beat = time.monotonic() + BEAT
    while by_sock:
        for sock, _ in poller.poll(int(BEAT * 1000)):
            if not by_sock[sock].on_readable():
                poller.unregister(sock)
                del by_sock[sock]
        now = time.monotonic()
        if now >= next_beat:
            next_beat = now + BEAT
            for sim in by_sock.values():
                sim.beat()


def agent(address: str, secret_hex: str, nproc: int) -> None:
    """A simulated host agent of ``nproc`` ranks that finish every cell at once."""
    agents(address, secret_hex, nproc, 1)


def relay(address: str, secret_hex: str, children: int, nproc: int) -> None:
    """A simulated relay for ``children`` simulated agents of ``nproc`` ranks each (it starts them itself)."""
    import subprocess

    secret = bytes.fromhex(secret_hex)
    up = Upstream(address, secret)
    down = up.ctx.socket(zmq.ROUTER)
    down.setsockopt(zmq.LINGER, 0)
    port = down.bind_to_random_port("tcp://127.0.0.1")
    kids = [subprocess.Popen([sys.executable, __file__, "agents", f"tcp://127.0.0.1:{port}", secret_hex, str(nproc),
                              str(children)])]  # its agents, in one process
    down_signer = P.Signer(secret)
    child_of: dict[int, bytes] = {}  # rank -> child identity
    below = 0  # ranks below this relay
    pending: dict[bytes, P.AgentHello] = {}
    poller = zmq.Poller()
    poller.register(up.sock, zmq.POLLIN)
    poller.register(down, zmq.POLLIN)
    cells: dict[int, list] = {}  # cell -> [ranks that still owe it, their children's (ranks, durations) so far]
    try:
        while True:
            for sock, _ in poller.poll(int(BEAT * 1000)):
                if sock is down:
                    while (frames := recv_frames(down)) is not None:
                        ident = bytes(frames[0])
                        msg, _, bufs = down_signer.unpack(frames[1:])
                        if isinstance(msg, P.AgentHello):
                            pending[ident] = msg
                            if len(pending) == children:
                                up.send(P.AgentHello(host=f"relay{os.getpid()}", pid=os.getpid(),
                                                     nproc=children * nproc, addr="127.0.0.1"))
                        elif isinstance(msg, P.HostEvents):
                            _merge(up, msg, bufs, cells)
                else:
                    while (frames := recv_frames(up.sock)) is not None:
                        msg, _, bufs = up.signer.unpack(frames)
                        if isinstance(msg, P.AgentWelcome):
                            below = len(msg.ranks)
                            for i, ident in enumerate(sorted(pending)):
                                its = msg.ranks[i * nproc:(i + 1) * nproc]
                                for r in its:
                                    child_of[r] = ident
                                send_frames(down, [ident, *down_signer.pack(P.AgentWelcome(
                                    its, msg.world_size, i, children, msg.settings))])
                        elif isinstance(msg, P.Forward):
                            per: dict[bytes, list[int]] = {}
                            if msg.ranks == ALL:  # every rank below: each child gets all of its own
                                per = dict.fromkeys(pending, ALL)
                            else:
                                for r in msg.ranks:
                                    per.setdefault(child_of[r], []).append(r)
                            if msg.kind in ("exec", "call") and msg.cell_id >= 0:
                                cells[msg.cell_id] = [below if msg.ranks == ALL else len(msg.ranks), []]
                            for ident, its in per.items():
                                fwd = P.Forward(its, msg.kind, msg.cell_id)
                                send_frames(down, [ident, *down_signer.pack(fwd, b"", bufs)])
                        elif isinstance(msg, (P.Shutdown, P.Rejected)):
                            for ident in pending:
                                send_frames(down, [ident, *down_signer.pack(P.Shutdown())])
                            return
    finally:
        time.sleep(0.2)
        for k in kids:
            k.kill()
            k.wait()


def _merge(up: Upstream, msg: P.HostEvents, bufs: list, cells: dict) -> None:
    """Pass a child's batch up; a cell's ``done`` events are held until every rank below owes nothing, then go up
    as one."""
    out, relayed, pos = [], [], 0
    for event in msg.events:
        if event[0] in ("done", "span") and event[1] in cells:
            entry = cells[event[1]]
            if event[0] == "span":  # (start, stop, durations bytes)
                entry[0] -= event[3] - event[2]
                entry[1].append((event[2], event[3], event[4]))
            else:
                entry[0] -= len(event[2])
                entry[1].append((event[2][0] if event[2] else -1, None, (event[2], event[3])))
            if entry[0] <= 0:
                del cells[event[1]]
                out.append(_merged(event[1], entry[1]))
            continue
        if event[0] == "msg":
            relayed += bufs[pos:pos + event[2]]
            pos += event[2]
        out.append(event)
    if out:
        up.events(out, relayed)


def _merged(cell_id: int, batches: list) -> tuple:
    """One event for the children's answers to a cell: a span when they are spans that join up, else a done."""
    batches.sort(key=lambda b: b[0])
    if all(b[1] is not None for b in batches) and all(a[1] == b[0] for a, b in zip(batches, batches[1:], strict=False)):
        return ("span", cell_id, batches[0][0], batches[-1][1], b"".join(b[2] for b in batches))
    ranks: list[int] = []
    durations: list[float] = []
    for start, stop, data in batches:
        if stop is None:
            ranks += data[0]
            durations += data[1]
        else:
            ranks += range(start, stop)
            durations += P.unpack_durations(data)
    return ("done", cell_id, ranks, durations)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "agent":
        agent(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    elif kind == "agents":
        agents(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
    else:
        relay(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
