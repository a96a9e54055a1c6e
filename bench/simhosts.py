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


class Upstream:
    """The connection toward the controller (or a relay): one DEALER, one signer."""

    def __init__(self, address: str, secret: bytes) -> None:
        self.ctx = zmq.Context()
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


def agent(address: str, secret_hex: str, nproc: int) -> None:
    """A simulated host agent of ``nproc`` ranks that finish every cell at once."""
    up = Upstream(address, bytes.fromhex(secret_hex))
    up.send(P.AgentHello(host=f"sim{os.getpid()}", pid=os.getpid(), nproc=nproc, addr="127.0.0.1"))
    ranks: list[int] = []
    next_beat = time.monotonic() + BEAT
    while True:
        if up.sock.poll(int(BEAT * 1000)):
            while (frames := recv_frames(up.sock)) is not None:
                msg, _, bufs = up.signer.unpack(frames)
                if isinstance(msg, P.AgentWelcome):
                    ranks, world = list(msg.ranks), msg.world_size
                    ev, fr = up.relay(ranks, lambda r, w=world: P.Hello(rank=r, pid=os.getpid(), host="sim",
                                                                        world_size=w))
                    up.events(ev, fr)
                elif isinstance(msg, P.Forward):
                    if msg.kind == "welcome":
                        inner = P.Signer(bytes.fromhex(secret_hex))
                        welcome = inner.unpack(bufs)[0]
                        assert isinstance(welcome, P.Welcome)
                        events, frames_out = [], []
                        if welcome.master_port == 0:
                            ev, fr = up.relay(msg.ranks, lambda r: P.StoreReady(port=1, addr="127.0.0.1"))
                            events += ev
                            frames_out += fr
                        ev, fr = up.relay(msg.ranks, lambda r: P.Ready(device="cpu", backend="sim", host="sim",
                                                                       pid=os.getpid()))
                        up.events(events + ev, frames_out + fr)
                    elif msg.kind in ("exec", "call") and msg.cell_id >= 0:
                        up.events([("done", msg.cell_id, list(msg.ranks), [0.0] * len(msg.ranks))], [])
                    elif msg.kind == "shutdown":
                        up.events([("exit", r, 0) for r in msg.ranks], [])
                elif isinstance(msg, (P.Shutdown, P.Rejected)):
                    return
        now = time.monotonic()
        if now >= next_beat and ranks:
            next_beat = now + BEAT
            up.events([("beat", [(r, 0, 0, 0, "sim") for r in ranks])], [])


def relay(address: str, secret_hex: str, children: int, nproc: int) -> None:
    """A simulated relay for ``children`` simulated agents of ``nproc`` ranks each (it starts them itself)."""
    import subprocess

    secret = bytes.fromhex(secret_hex)
    up = Upstream(address, secret)
    down = up.ctx.socket(zmq.ROUTER)
    down.setsockopt(zmq.LINGER, 0)
    port = down.bind_to_random_port("tcp://127.0.0.1")
    kids = [subprocess.Popen([sys.executable, __file__, "agent", f"tcp://127.0.0.1:{port}", secret_hex, str(nproc)])
            for _ in range(children)]
    down_signer = P.Signer(secret)
    child_of: dict[int, bytes] = {}  # rank -> child identity
    pending: dict[bytes, P.AgentHello] = {}
    poller = zmq.Poller()
    poller.register(up.sock, zmq.POLLIN)
    poller.register(down, zmq.POLLIN)
    cells: dict[int, tuple[set[int], list[tuple[list[int], list[float]]]]] = {}  # cell -> (owed ranks, batches)
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
                            for i, ident in enumerate(sorted(pending)):
                                its = msg.ranks[i * nproc:(i + 1) * nproc]
                                for r in its:
                                    child_of[r] = ident
                                send_frames(down, [ident, *down_signer.pack(P.AgentWelcome(
                                    its, msg.world_size, i, children, msg.settings))])
                        elif isinstance(msg, P.Forward):
                            per: dict[bytes, list[int]] = {}
                            for r in msg.ranks:
                                per.setdefault(child_of[r], []).append(r)
                            if msg.kind in ("exec", "call") and msg.cell_id >= 0:
                                cells[msg.cell_id] = (set(msg.ranks), [])
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
        if event[0] == "done" and event[1] in cells:
            owed, batches = cells[event[1]]
            owed.difference_update(event[2])
            batches.append((event[2], event[3]))
            if not owed:
                del cells[event[1]]
                batches.sort(key=lambda b: b[0][0] if b[0] else -1)
                out.append(("done", event[1], [r for b in batches for r in b[0]], [d for b in batches for d in b[1]]))
            continue
        if event[0] == "msg":
            relayed += bufs[pos:pos + event[2]]
            pos += event[2]
        out.append(event)
    if out:
        up.events(out, relayed)


if __name__ == "__main__":
    kind = sys.argv[1]
    if kind == "agent":
        agent(sys.argv[2], sys.argv[3], int(sys.argv[4]))
    else:
        relay(sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]))
