"""The host agent's loop (``HostAgent``): one thread, one poller over the controller's connection, the ranks' socket,
the fork server and every rank's pipes. monarch_worker.agent documents what an agent does; hostlink.py holds the
rank side (fork server client, pipes, records, batches).

Sockets: ``up`` (DEALER) to the controller, plus a monitor of it (a dropped connection ends the agent and its
ranks); ``down`` (ROUTER) on an abstract Unix socket of this host's network namespace, where each rank's I/O thread
connects (config ``connect``). Everything either way is signed with the mesh secret: the agent verifies what it
acts on and relays the rest unchanged, so a rank and the controller check each other's signatures end to end. The
one exception is a push it writes into shared memory for its ranks: that message it signs itself.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import socket
import sys
import time
from typing import Any

import zmq

from . import protocol as P
from . import shm
from .addresses import address_toward
from .agentconfig import AgentConfig, rank_environment
from .channel import recv_frames, send_frames
from .hostlimits import host_limits, visible_gpus
from .hostlink import EventBatch, ForkServerClient, LocalRank, drain, read_output, read_segment, take_record
from .pipes import WorkPipe
from .reaper import END_WAIT

log = logging.getLogger(__name__)

__all__ = ["HostAgent", "HOLD", "EXIT_LOST", "EXIT_REJECTED", "EXIT_FAILED"]

HOLD = 0.02
"""Seconds the agent may hold the results of a cell that some of its ranks still run, so that the ranks of a
host answer in one message; output of a long cell flows at least this often."""
EXIT_REJECTED, EXIT_FAILED, EXIT_LOST = 2, 1, 3
_WORK_KINDS = frozenset(cls.TYPE for cls in P.work_types())


class HostAgent:
    """One host's agent (see the module docstring); ``run`` returns the process exit code."""

    def __init__(self, cfg: AgentConfig) -> None:
        self.cfg = cfg
        self.host = socket.gethostname()
        secret = bytes.fromhex(cfg.secret)
        self.signer = P.Signer(secret)  # signs what the agent sends; verifies the controller's and the ranks'
        self.inner = P.Signer(secret)  # verifies forwarded messages the agent rewrites (their own sequence)
        # Signs the ranks' displays it rewrites (bytes out of shared memory): they travel inside a later HostEvents,
        # so they need a session of their own, whose sequence follows the batch's order, not the agent's messages'.
        self.relay_signer = P.Signer(secret)
        env = dict(os.environ)
        self.fork = ForkServerClient(env)  # imports torch while the agent says hello
        self.base_env = env
        self.ctx = zmq.Context()
        self.up = self.ctx.socket(zmq.DEALER)
        self.up.setsockopt(zmq.LINGER, 2000)
        self.up.setsockopt(zmq.IDENTITY, f"agent-{os.getpid()}-{os.urandom(8).hex()}".encode())
        if cfg.curve_serverkey:
            public, secret_key = zmq.curve_keypair()
            self.up.curve_serverkey = cfg.curve_serverkey.encode()
            self.up.curve_publickey = public
            self.up.curve_secretkey = secret_key
        self.monitor = self.up.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self.up.connect(cfg.controller)
        self.endpoint = f"ipc://@monarch-agent-{os.getpid()}-{os.urandom(8).hex()}"  # abstract: no file to leak
        self.down = self.ctx.socket(zmq.ROUTER)
        self.down.setsockopt(zmq.LINGER, 0)
        self.down.bind(self.endpoint)
        self.ranks: dict[int, LocalRank] = {}  # global rank -> its handle
        self.by_sid: dict[int, LocalRank] = {}
        self.by_ident: dict[bytes, LocalRank] = {}
        self.by_fd: dict[int, tuple[LocalRank, str]] = {}
        self.batch = EventBatch(HOLD)
        self.welcome: P.AgentWelcome | None = None
        self.pool: shm.SegmentPool | None = None
        self.waiting: set[WorkPipe] = set()
        self.poller = zmq.Poller()
        for s in (self.up, self.down, self.monitor):
            self.poller.register(s, zmq.POLLIN)
        for fd in self.fork.poll_fds:
            self.poller.register(fd, zmq.POLLIN)
        self.last_heard = time.monotonic()
        self.connected = False
        self.exit_code: int | None = None
        self.exit_note = ""
        self.signalled: int | None = None  # the signal that stopped this agent (SIGTERM, SIGINT)
        self.start_failed = False  # its fork server died before it was ready: no rank of this host ever started
        self.interval = 1.0
        self.heartbeat_timeout = 30.0
        self.tee = cfg.tee

    # ------------------------------------------------------------------ the loop

    def run(self) -> int:
        addr = address_toward(self.cfg.controller)
        self.send(P.AgentHello(host=self.host, pid=os.getpid(), nproc=self.cfg.nproc, addr=addr,
                               group_rank=self.cfg.group_rank, group_world_size=self.cfg.group_world_size,
                               launcher_env=self.cfg.launcher_env, limits=[*host_limits(), visible_gpus()]))
        join_deadline = time.monotonic() + self.cfg.join_timeout
        next_beat = time.monotonic() + self.interval
        try:
            while self.exit_code is None:
                now = time.monotonic()
                due = self.batch.due(now)
                timeout = min(next_beat - now, self.interval if due is None else due)
                fds = [pipe.fd for pipe in self.waiting if not pipe.closed]
                for fd in fds:
                    self.poller.register(fd, zmq.POLLOUT)
                events = dict(self.poller.poll(max(0, int(timeout * 1000))))
                for fd in fds:
                    self.poller.unregister(fd)
                for pipe in list(self.waiting):
                    if pipe.flush():
                        self.waiting.discard(pipe)
                for item in events:
                    self._readable(item)
                now = time.monotonic()
                if now >= next_beat:
                    next_beat = now + self.interval
                    self._tick(now, join_deadline)
                due = self.batch.due(now)
                if due is not None and due <= 0:
                    self.flush()
        except Exception as e:  # noqa: BLE001 - say why, then end the ranks
            log.exception("host agent failed")
            if self.exit_code is None:  # a reason said before (its fork server died) stays the reason
                self.exit_code, self.exit_note = EXIT_FAILED, f"the host agent failed: {e!r}"
        return self.close()

    def _readable(self, item: Any) -> None:
        if item is self.up:
            while (frames := recv_frames(self.up)) is not None:
                self._from_controller(frames)
        elif item is self.down:
            while (frames := recv_frames(self.down)) is not None:
                self._from_rank(bytes(frames[0]), frames[1:])
        elif item is self.monitor:
            self._on_monitor()
        elif isinstance(item, int) and item in self.fork.poll_fds:
            for event in self.fork.on_readable(item):
                self._fork_event(event)
        elif item in self.by_fd:
            rank, stream = self.by_fd[item]
            if not read_output(rank, stream, self.batch, self._on_record, self._tee_fn()):
                self._forget_fd(item)

    def _tick(self, now: float, join_deadline: float) -> None:
        """Once per heartbeat interval: heartbeats, and the silence checks that end an abandoned agent."""
        if self.welcome is None:
            self.send(P.Heartbeat())
            if now > max(join_deadline, self.last_heard + self.cfg.join_timeout):  # a late host: pinged while held
                self.stop(EXIT_REJECTED, f"no word from the controller at {self.cfg.controller} in "
                                         f"{self.cfg.join_timeout:.0f} s: it is not listening there, cannot be "
                                         "reached from this host, or does not hold this secret (check "
                                         "MONARCH_SECRET_FILE / MONARCH_SECRET on this host)")
            return
        beats = [(r.rank, *r.beat) for r in self.ranks.values() if r.alive and r.beat is not None]
        for r in self.ranks.values():
            r.beat = None
        self.batch.other(("beat", beats))
        if now - self.last_heard > self.heartbeat_timeout > 0:
            self.stop(EXIT_LOST, f"no word from the controller for {self.heartbeat_timeout:.0f} s; ending this "
                                 "host's ranks")

    def on_sigterm(self, signum: int, frame: Any) -> None:
        if self.signalled is None:
            self.signalled = signum
        self.stop(128 + signum, f"stopped by signal {signal.Signals(signum).name}; ending this host's ranks")

    def stop(self, code: int, note: str) -> None:
        if self.exit_code is None:
            self.exit_code, self.exit_note = code, note

    # ------------------------------------------------------------------ controller

    def send(self, msg: P.Message, payload: bytes = b"", buffers: list | tuple = ()) -> None:
        send_frames(self.up, self.signer.pack(msg, payload, buffers))

    def flush(self) -> None:
        if self.batch.events:
            self.send(*self.batch.take())

    def _from_controller(self, frames: list) -> None:
        try:
            msg, payload, bufs = self.signer.unpack(frames)
        except P.ProtocolError as e:
            log.warning("host agent dropped a message from the controller: %s", e)
            return
        self.last_heard = time.monotonic()
        if isinstance(msg, P.Forward):
            self._forward(msg, bufs)
        elif isinstance(msg, P.AgentWelcome):
            self._on_welcome(msg)
        elif isinstance(msg, P.Spawn):
            for r in msg.ranks:
                self._spawn(r)
        elif isinstance(msg, P.HostRanks):
            self._on_host_ranks(msg)
        elif isinstance(msg, P.Signal):
            for r in self._chosen(msg.ranks):
                if r.alive:
                    self.fork.signal(r.sid, msg.signal)
        elif isinstance(msg, P.Rejected):
            self.stop(EXIT_REJECTED, f"not admitted to the mesh: {msg.reason}")
        elif isinstance(msg, P.Shutdown):
            self.stop(0, "")

    def _on_monitor(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while self.monitor.poll(0):
            event = recv_monitor_message(self.monitor)["event"]
            if event == zmq.EVENT_CONNECTED:
                self.connected = True
            elif event == zmq.EVENT_DISCONNECTED and self.connected and self.welcome is not None:
                self.stop(EXIT_LOST, "the connection to the controller dropped (the notebook kernel exited or "
                                     "was killed, or the network failed); ending this host's ranks")

    def _on_welcome(self, msg: P.AgentWelcome) -> None:
        self.welcome = msg
        settings = msg.settings
        self.interval = float(settings.get("heartbeat_interval", self.interval))
        self.heartbeat_timeout = float(settings.get("heartbeat_timeout", self.heartbeat_timeout))
        for local, rank in enumerate(msg.ranks):
            self.ranks[rank] = LocalRank(local, rank)
        if self.fork.ready:
            for rank in msg.ranks:
                self._spawn(rank)

    def _on_host_ranks(self, msg: P.HostRanks) -> None:
        """``%mesh scale`` changed this host's ranks: forget (and SIGKILL, if still running) those it no longer
        holds, renumber the rest locally, and start later ranks (``Spawn``) in the new world."""
        welcome = self.welcome
        if welcome is None:
            return
        keep = [int(r) for r in msg.ranks]
        for rank in [r for r in self.ranks if r not in keep]:
            r = self.ranks.pop(rank)
            if r.alive:
                self.fork.signal(r.sid, signal.SIGKILL)  # its exit is not reported: the rank is not this host's
        for local, rank in enumerate(keep):
            if rank in self.ranks:
                self.ranks[rank].local_rank = local
        self.welcome = P.AgentWelcome(ranks=keep, world_size=int(msg.world_size), group_rank=welcome.group_rank,
                                      group_world_size=welcome.group_world_size, settings=welcome.settings)

    def _chosen(self, ranks: list[int]) -> list[LocalRank]:
        if ranks == [-1]:
            return list(self.ranks.values())
        return [self.ranks[r] for r in ranks if r in self.ranks]

    def _forward(self, msg: P.Forward, frames: list) -> None:
        """Give the controller's message (``frames``, signed by it) to the chosen ranks of this host."""
        targets = [r for r in self._chosen(msg.ranks) if r.alive]
        if msg.kind in _WORK_KINDS:
            if msg.kind == P.Push.TYPE:
                frames = self._push_through_shm(frames, targets)
            parts = P.work_message(frames)
            for r in targets:
                if r.work is not None and not r.work.send(parts):
                    self.waiting.add(r.work)
            if msg.cell_id >= 0 and targets:
                self.batch.expect.setdefault(msg.cell_id, set()).update(r.rank for r in targets)
            return
        for r in targets:
            if r.ident:
                send_frames(self.down, [r.ident, *frames])

    def _push_through_shm(self, frames: list, targets: list[LocalRank]) -> list:
        """A push's large values go into one shared memory segment per value for all the ranks of this host (one
        copy here, none in the ranks); returns the frames to give them (the original ones when nothing moved)."""
        if not targets or not shm.supported():
            return frames
        try:
            msg, payload, bufs = self.inner.unpack(frames)
        except P.ProtocolError as e:
            log.warning("host agent could not read a push: %s", e)
            return frames
        assert isinstance(msg, P.Push)
        if self.pool is None:
            self.pool = shm.SegmentPool()
        holders = [r.rank for r in targets]
        items, kept, pos, moved = [], [], 0, False
        for item in msg.items:
            these = bufs[pos:pos + item["nbufs"]]
            pos += item["nbufs"]
            layout, size = shm.layout_of(memoryview(b).nbytes for b in these)
            if these and item.get("shm") is None and not item.get("bcast") and size >= shm.SHM_THRESHOLD:
                try:
                    seg = self.pool.acquire(size)
                    try:
                        seg.write(these, layout)
                    except BaseException:
                        seg.close()
                        raise
                except shm.ShmError as e:
                    log.warning("push of %r stays on the pipes: %s", item.get("name"), e)
                else:
                    self.pool.lend(seg, holders)
                    items.append({**item, "nbufs": 0, "shm": seg.describe(layout, size)})
                    moved = True
                    continue
            items.append(item)
            kept.extend(these)
        if not moved:
            return frames
        return self.signer.pack(P.Push(msg.cell_id, items, msg.device), payload, kept)

    # ------------------------------------------------------------------ ranks

    def _spawn(self, rank: int) -> None:
        welcome = self.welcome
        assert welcome is not None
        if self.exit_code is not None:
            return  # ending (its fork server died): no more ranks
        old = self.ranks.get(rank)
        local = welcome.ranks.index(rank)
        r = LocalRank(local, rank)
        self.ranks[rank] = r
        if old is not None and old.ident:
            self.by_ident.pop(old.ident, None)
        settings = dict(welcome.settings)
        env = rank_environment(self.base_env, self.cfg.launcher, welcome.ranks, local, welcome.world_size,
                               welcome.group_rank, welcome.group_world_size)
        env.update(settings.pop("env", {}))
        config = {**settings, "controller": self.cfg.controller, "connect": self.endpoint, "secret": self.cfg.secret,
                  "rank": rank, "world_size": welcome.world_size, "local_rank": local,
                  "local_world_size": len(welcome.ranks), "output_records": True,
                  "launcher_env": self.cfg.launcher_env, "env": {}}
        work_r, work_w = os.pipe()
        try:
            r.sid = self.fork.spawn(env, config, work_r)
        except (BrokenPipeError, ConnectionResetError):  # it died: the loop ends before its ("gone",) event
            os.close(work_w)
            self._fork_gone(f"its fork server died before it forked rank {rank}")
            return
        finally:
            os.close(work_r)
        r.work = WorkPipe(work_w)
        r.alive = True
        self.by_sid[r.sid] = r

    def _fork_event(self, event: tuple) -> None:
        kind = event[0]
        if kind == "ready":
            if self.welcome is not None:
                for rank in self.welcome.ranks:
                    r = self.ranks.get(rank)
                    if r is None or (not r.alive and r.sid < 0):
                        self._spawn(rank)
        elif kind == "spawned":
            _, sid, pid, out_fd, err_fd = event
            r = self.by_sid.get(sid)
            if r is None:
                os.close(out_fd)
                os.close(err_fd)
                return
            r.pid, r.out_fd, r.err_fd = pid, out_fd, err_fd
            for fd, stream in ((out_fd, "stdout"), (err_fd, "stderr")):
                os.set_blocking(fd, False)
                self.by_fd[fd] = (r, stream)
                self.poller.register(fd, zmq.POLLIN)
            if self.ranks.get(r.rank) is r:  # not a rank this host was told to forget (HostRanks)
                self.batch.other(("up", r.rank, pid))
        elif kind == "exited":
            _, sid, returncode = event
            r = self.by_sid.pop(sid, None)
            if r is not None:
                self._rank_exited(r, returncode)
        elif kind == "log_closed":
            with contextlib.suppress(KeyError):  # _fork_gone may have unregistered it already
                self.poller.unregister(event[1])
        elif kind == "gone":
            self._fork_gone("its fork server died")

    def _fork_gone(self, why: str) -> None:
        """The fork server died (its socket closed, or a request to it failed): the ranks died with it."""
        if self.exit_code is not None:
            return  # said already
        for fd in self.fork.poll_fds:
            with contextlib.suppress(KeyError):
                self.poller.unregister(fd)
        if not self.fork.ready:  # no rank of this host ever started: close() says it in a StartFailed
            self.start_failed = True
            self.stop(EXIT_FAILED, self.fork.failure())
            return
        # close() says why (a Goodbye with this note) before it reports the ranks' exits
        self.stop(EXIT_FAILED, f"{why}, and this host's ranks with it")

    def _rank_exited(self, r: LocalRank, returncode: int) -> None:
        drain(r, self.batch, self._on_record, self._tee_fn())  # what it printed before it exited comes first
        for fd in (r.out_fd, r.err_fd):
            if fd >= 0:
                self._forget_fd(fd)
                os.close(fd)
        r.out_fd = r.err_fd = -1
        if r.work is not None:
            self.waiting.discard(r.work)
            r.work.close()
        r.alive = False
        if r.ident:
            self.by_ident.pop(r.ident, None)
        if self.pool is not None:
            self.pool.drop_holder(r.rank)
        if self.ranks.get(r.rank) is not r:  # forgotten (HostRanks), or replaced since: not news for the controller
            return
        self.batch.rank_gone(r.rank)
        self.batch.other(("exit", r.rank, returncode))
        self.flush()  # a death is news at once

    def _forget_fd(self, fd: int) -> None:
        if self.by_fd.pop(fd, None) is not None:
            self.poller.unregister(fd)

    def _from_rank(self, ident: bytes, frames: list) -> None:
        try:
            msg, payload, bufs = self.signer.unpack(frames)
        except P.ProtocolError as e:
            log.warning("host agent dropped a message from a rank: %s", e)
            return
        r = self.by_ident.get(ident)
        if isinstance(msg, P.Hello):
            r = self.ranks.get(msg.rank)
            if r is None or not r.alive:
                return
            r.ident = ident
            self.by_ident[ident] = r
        if r is None:
            return
        if isinstance(msg, P.Heartbeat):
            r.beat = (msg.rss, msg.cuda_allocated, msg.cuda_reserved, msg.group)
            return
        if isinstance(msg, P.ShmRelease) and self.pool is not None:
            own = [i for i in msg.ids if int(i) >> 32 == os.getpid()]
            for seg_id in own:
                self.pool.give_back(int(seg_id), r.rank)
            if len(own) == len(msg.ids):
                return
        if isinstance(msg, P.Goodbye):
            return  # its exit status comes from the fork server
        if isinstance(msg, (P.Ready, P.StartFailed)):
            r.beat = None  # taken before it joined a group (or failed to): sent after this, it said "no group"
        drain(r, self.batch, self._on_record, self._tee_fn())  # its output before what it says
        if isinstance(msg, (P.Result, P.PullReply)):
            self.batch.answered(msg.cell_id, r.rank)
        if isinstance(msg, P.Display) and msg.shm:
            frames = self._display_without_shm(r, msg)
        self.batch.relay(r.rank, frames)

    def _display_without_shm(self, r: LocalRank, msg: P.Display) -> list:
        """A rank put a large display's bytes in shared memory, as for a kernel on its host: the controller may be
        on another host, so the bytes travel in the message (read once here); the rank gets its segment back."""
        desc = msg.shm or {}
        try:
            buffers = read_segment(desc)
        except OSError as e:
            log.warning("host agent could not read rank %d's display: %s", r.rank, e)
            buffers = []
        if r.ident:
            send_frames(self.down, [r.ident, *self.signer.pack(P.ShmRelease(ids=[desc.get("id")]))])
        return self.relay_signer.pack(P.Display(msg.cell_id, msg.kind, msg.data, msg.json, msg.binary, msg.metadata,
                                          msg.display_id, msg.wait, None), b"", buffers)

    def _on_record(self, r: LocalRank, flags: int, body: bytes) -> None:
        got = take_record(r, flags, body, self.signer)
        if got is None:
            return
        msg, payload, bufs, frames = got
        if isinstance(msg, P.Display) and msg.shm:
            frames = self._display_without_shm(r, msg)
        if isinstance(msg, P.Result):
            if flags & P.RECORD_SYNC:  # the cell ended: a partial last line on stderr belongs to it
                for _kind, value in r.splitters["stderr"].end_line():
                    self.batch.line(r.rank, "stderr", str(value))
            self.batch.result(r.rank, msg, payload, bufs)
        else:
            self.batch.relay(r.rank, frames)

    def _tee_fn(self) -> Any:
        return self._tee if self.tee else None

    def _tee(self, rank: int, stream: str, text: str) -> None:
        target = sys.stdout if stream == "stdout" else sys.stderr
        try:
            target.write(f"[rank{rank}]: {text}\n")
            target.flush()
        except (OSError, ValueError):
            self.tee = False

    # ------------------------------------------------------------------ the end

    def close(self) -> int:
        code = self.exit_code if self.exit_code is not None else 0
        if self.exit_note:
            sys.stderr.write(f"monarch agent on {self.host}: {self.exit_note}\n")
        if (self.welcome is None or self.start_failed) and code == EXIT_FAILED and self.exit_note:
            try:  # its start failed (a Goodbye, sent too once welcomed, is not read as this host's before that)
                self.send(P.StartFailed(error=f"the host agent on {self.host} cannot start its ranks: "
                                              f"{self.exit_note}"))
            except zmq.ZMQError:
                pass
        if self.welcome is not None and (self.signalled is not None or (code and self.exit_note)):
            why = P.Goodbye(returncode=-self.signalled) if self.signalled is not None else P.Goodbye(
                returncode=code, note=self.exit_note)  # e.g. no word from the controller for heartbeat_timeout
            try:  # before its ranks' exits: they are lost with this agent, and the controller says so (and why)
                self.send(why)
            except zmq.ZMQError:
                pass
        self.fork.close(END_WAIT + 2)  # the fork server kills every rank, ends their trees and reaps it all
        for r in list(self.by_sid.values()):
            self._rank_exited(r, -signal.SIGKILL)
        try:
            self.flush()
            if self.welcome is not None:
                self.send(P.Goodbye(returncode=code))
        except zmq.ZMQError:
            pass
        if self.pool is not None:
            self.pool.close()
        self.monitor.close(0)
        self.down.close(0)
        self.up.close(1000)
        self.ctx.term()
        return code
