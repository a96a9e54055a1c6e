"""The ranks of one host as its agent sees them: forked by a local fork server, read through their pipes.

A host agent (monarch_worker.agent) does for the ranks of its host what the notebook kernel does for local ranks:
it asks a fork server (``python -m monarch_worker.forkserver``, a child of the agent that imported torch once) to
fork them, writes their work into their work pipes, and reads their stdout and stderr pipes itself, records
(protocol.RECORD_PREFIX) included. What it reads goes to the controller in ``HostEvents`` batches (``EventBatch``):
lines of output, results (one compact ``done`` event for all the ranks that finished a cell without a value),
relayed messages, exits. Nothing here runs on another thread: the agent's one loop calls it.

The fork server is this module's only way to make processes; it exits, killing every rank, when the agent closes
its control socket or dies (the socket's end of file), so no rank outlives its agent.
"""

from __future__ import annotations

import json
import mmap
import os
import socket
import subprocess
import sys
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import protocol as P
from .hostmessages import pack_durations
from .pipes import WorkPipe
from .streams import LINE_LIMIT, StreamSplitter, temp_file_sink

__all__ = ["ForkServerClient", "LocalRank", "EventBatch", "ENV_FORK_SERVER_FD", "FORK_SERVER_LOG_LINES",
           "read_segment"]

ENV_FORK_SERVER_FD = "MONARCH_FORK_SERVER_FD"  # set by the kernel for an agent on its host: a clone's socket
FORK_SERVER_LOG_LINES = 30  # lines of the fork server's own stderr kept for a failure report
READ_SIZE = 1 << 16


class ForkServerClient:
    """The agent's fork server: started at once (it imports torch while the agent says hello), one control socket
    that carries frames (protocol.FORK_SERVER_HEADER) and file descriptors both ways. When ``env`` names an
    inherited socket (``MONARCH_FORK_SERVER_FD``: the kernel started this agent on its own host), the fork server is
    a clone of the kernel's, forked with torch imported (forkserver.py, "Clones"), and nothing is started here.

    ``poll_fds`` are what the agent's loop watches; ``on_readable(fd)`` handles them and returns what happened:
    ("ready",), ("spawned", sid, pid, out_fd, err_fd), ("exited", sid, returncode), ("gone",).
    """

    def __init__(self, env: dict[str, str]) -> None:
        inherited = env.pop(ENV_FORK_SERVER_FD, None)
        os.environ.pop(ENV_FORK_SERVER_FD, None)  # not the ranks'
        self.proc: subprocess.Popen | None = None
        self.err_fd = -1
        if inherited is not None:  # a clone of the kernel's fork server (forkserver.py, "Clones"), torch imported
            self.ctl = socket.socket(fileno=int(inherited))
        else:
            self.ctl, child = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            self.proc = subprocess.Popen([sys.executable, "-m", "monarch_worker.forkserver"], stdin=child.fileno(),
                                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, close_fds=True)
            child.close()
            assert self.proc.stderr is not None
            self.err_fd = self.proc.stderr.fileno()
            os.set_blocking(self.err_fd, False)
        self.ctl.setblocking(False)
        self.log: deque[str] = deque(maxlen=FORK_SERVER_LOG_LINES)
        self._log_part = b""
        self.ready = False
        self._buf = b""
        self._fds: list[int] = []
        self._ids = 0

    @property
    def poll_fds(self) -> list[int]:
        return [self.ctl.fileno(), self.err_fd] if self.err_fd >= 0 else [self.ctl.fileno()]

    def spawn(self, env: dict[str, str], config: dict, work_r: int) -> int:
        """Ask for one rank; returns its spawn id (its pipes and pid come with ("spawned", sid, ...))."""
        self._ids += 1
        body = {"env": env, "cwd": os.getcwd(), "sys_path": sys.path, "config": config, "work_pipe": True}
        frame = P.fork_server_json(P.FS_SPAWN, self._ids, body)
        self.ctl.setblocking(True)
        try:
            sent = socket.send_fds(self.ctl, [frame], [work_r])
            self.ctl.sendall(frame[sent:])
        finally:
            self.ctl.setblocking(False)
        return self._ids

    def signal(self, sid: int, sig: int) -> None:
        """Send ``sig`` to spawn ``sid`` (-1: every rank)."""
        frame = P.fork_server_json(P.FS_KILL, sid, {"signal": int(sig)})
        self.ctl.setblocking(True)
        try:
            self.ctl.sendall(frame)
        except OSError:
            pass  # the fork server is gone, and every rank with it
        finally:
            self.ctl.setblocking(False)

    def on_readable(self, fd: int) -> list[tuple]:
        if fd != self.ctl.fileno():
            self._read_log()
            return [] if self.err_fd >= 0 else [("log_closed", fd)]
        try:
            data, fds, _, _ = socket.recv_fds(self.ctl, 1 << 16, 64)
        except BlockingIOError:
            return []
        except OSError:
            data, fds = b"", []
        self._fds.extend(fds)
        if not data:
            return [("gone",)]
        self._buf += data
        out: list[tuple] = []
        hs = P.FORK_SERVER_HEADER.size
        while len(self._buf) >= hs:
            kind, sid, n = P.FORK_SERVER_HEADER.unpack_from(self._buf)
            if len(self._buf) < hs + n:
                break
            body, self._buf = json.loads(self._buf[hs:hs + n]), self._buf[hs + n:]
            if kind == P.FS_READY:
                self.ready = True
                out.append(("ready",))
            elif kind == P.FS_SPAWNED:
                out_fd, err_fd = self._fds.pop(0), self._fds.pop(0)
                out.append(("spawned", sid, body["pid"], out_fd, err_fd))
            elif kind == P.FS_EXITED:
                out.append(("exited", sid, body["returncode"]))
        return out

    def _read_log(self) -> None:
        """The fork server's own stderr (import errors, warnings): kept for reports and copied to ours."""
        try:
            data = os.read(self.err_fd, READ_SIZE)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            self.err_fd = -1
            return
        try:
            sys.stderr.buffer.write(data)
            sys.stderr.flush()
        except (OSError, ValueError):
            pass
        *lines, self._log_part = (self._log_part + data).split(b"\n")
        self.log.extend(line.decode(errors="replace") for line in lines)

    def failure(self) -> str:
        """Why the fork server could not start: its exit status and last lines."""
        if self.proc is None:
            return ("its fork server died before it was ready (a clone of the kernel's fork server; if the kernel's "
                    "fork server ended, and the clone with it, the kernel's stderr says why)")
        try:
            rc: int | None = self.proc.wait(2.0)
        except subprocess.TimeoutExpired:
            rc = None
        self._read_log()
        tail = "\n".join([*self.log, self._log_part.decode(errors="replace")]).strip()
        return (f"the fork server exited ({'code ' + str(rc) if rc is not None else 'still running'}) before it "
                f"was ready:\n{tail}")

    def close(self, timeout: float) -> None:
        """End of file on the control socket: the fork server kills every rank and exits (waits ``timeout`` s)."""
        try:
            self.ctl.shutdown(socket.SHUT_WR)
        except OSError:
            pass
        if self.proc is None:
            self._wait_closed(timeout)  # a clone is not our child: its socket closes as it exits
        else:
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.ctl.close()
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def _wait_closed(self, timeout: float) -> None:
        """Read and drop what the clone still sends until it closes its end (it exits), ``timeout`` seconds at
        most; after that it is left to end by itself (it got end of file, and kills its ranks)."""
        deadline = time.monotonic() + timeout
        self.ctl.setblocking(True)
        while (left := deadline - time.monotonic()) > 0:
            self.ctl.settimeout(left)
            try:
                data, fds, _, _ = socket.recv_fds(self.ctl, 1 << 16, 64)
            except OSError:  # the timeout included
                return
            for fd in fds:
                os.close(fd)
            if not data:
                return


@dataclass
class LocalRank:
    """One rank of this host: its numbers, process and pipes (the agent's loop owns all of it)."""

    local_rank: int
    rank: int
    sid: int = -1
    pid: int = 0
    work: WorkPipe | None = None
    out_fd: int = -1
    err_fd: int = -1
    ident: bytes = b""  # its socket's identity on the agent's rank socket (from its Hello)
    alive: bool = False
    splitters: dict[str, StreamSplitter] = field(init=False)
    record_parts: list[bytes] = field(default_factory=list)
    beat: tuple | None = None  # the last heartbeat it sent: (rss, cuda_allocated, cuda_reserved)

    def __post_init__(self) -> None:
        # A line over LINE_LIMIT bytes is cut here, on the agent, and kept whole in a file on this host.
        host = socket.gethostname()
        self.splitters = {stream: StreamSplitter(records=stream == "stdout", line_limit=LINE_LIMIT,
                                                 sink=temp_file_sink(f"monarch-rank{self.rank}-{stream}-", host))
                          for stream in ("stdout", "stderr")}


class EventBatch:
    """The ``HostEvents`` under way to the controller: events in order, result pickles and buffers.

    Results of a cell are held until every rank of this host that got the cell has answered (one message per host
    and cell), or ``hold`` seconds passed since the oldest event held (output of long cells keeps flowing).
    """

    def __init__(self, hold: float) -> None:
        self.hold = hold
        self.events: list[tuple] = []
        self.payload: list[bytes] = []
        self.buffers: list[Any] = []
        self.since = 0.0
        self.expect: dict[int, set[int]] = {}  # cell id -> ranks of this host that still owe its result
        self._done: dict[int, tuple[list[int], list[float]]] = {}  # cell id -> the "done" event being built

    def _add(self, event: tuple) -> None:
        if not self.events:
            self.since = time.monotonic()
        self.events.append(event)

    def line(self, rank: int, stream: str, text: str) -> None:
        self._add(("out", rank, stream, text))
        self._done.clear()  # later results go after this line

    def result(self, rank: int, msg: P.Result, payload: bytes, bufs: list) -> None:
        self.answered(msg.cell_id, rank)
        if msg.status == "ok" and not msg.has_value:
            ranks_durations = self._done.get(msg.cell_id)
            if ranks_durations is None:
                ranks_durations = ([], [])
                self._done[msg.cell_id] = ranks_durations
                self._add(("done", msg.cell_id, ranks_durations[0], ranks_durations[1]))
            ranks_durations[0].append(rank)
            ranks_durations[1].append(msg.duration)
            return
        self._add(("res", rank, msg.cell_id, msg.status, msg.has_value, msg.error, msg.duration, len(payload),
                   len(bufs)))
        self._done.clear()
        self.payload.append(payload)
        self.buffers.extend(bufs)

    def relay(self, rank: int, frames: list) -> None:
        self._add(("msg", rank, len(frames)))
        self._done.clear()
        self.buffers.extend(frames)

    def other(self, event: tuple) -> None:
        self._add(event)
        self._done.clear()

    def answered(self, cell_id: int, rank: int) -> None:
        owed = self.expect.get(cell_id)
        if owed is not None:
            owed.discard(rank)
            if not owed:
                del self.expect[cell_id]

    def rank_gone(self, rank: int) -> None:
        for cell_id in list(self.expect):
            self.answered(cell_id, rank)

    def due(self, now: float) -> float | None:
        """Seconds until the batch must go (0: now), or None when there is nothing to send."""
        if not self.events:
            return None
        if not self.expect or len(self.events) > 512 or len(self.buffers) > 64:
            return 0.0
        return max(0.0, self.since + self.hold - now)

    def take(self) -> tuple[P.HostEvents, bytes, list]:
        # a cell's "done" ranks that are a run of consecutive ranks go as one "span" event
        self.events = [compact_done(e) if e[0] == "done" else e for e in self.events]
        msg = P.HostEvents(self.events)
        payload = b"".join(self.payload)
        buffers = self.buffers
        self.events, self.payload, self.buffers = [], [], []
        self._done.clear()
        return msg, payload, buffers


def compact_done(event: tuple) -> tuple:
    """A ``("done", cell_id, ranks, durations)`` event as ``("span", cell_id, start, stop, durations)`` when its ranks
    are consecutive (in any order: they are listed as they finished), else unchanged."""
    _, cell_id, ranks, durations = event
    n = len(ranks)
    if n < 2:
        return event
    lo, hi = min(ranks), max(ranks)
    if hi - lo + 1 != n or len(set(ranks)) != n:
        return event
    in_order = durations if ranks[0] == lo and ranks[-1] == hi and ranks == sorted(ranks) else [
        d for _, d in sorted(zip(ranks, durations, strict=True))]
    return ("span", cell_id, lo, hi + 1, pack_durations(in_order))


def read_output(rank: LocalRank, stream: str, batch: EventBatch, on_record: Callable[[LocalRank, int, bytes], None],
                tee: Callable[[int, str, str], None] | None, until_empty: bool = False) -> bool:
    """Read ``rank``'s ``stream`` pipe once (or until it is empty) and turn the bytes into events; False at end of
    file (the pipe is closed and its fd set to -1). Before stdout bytes are passed on, the stderr pipe is drained:
    a rank writes its stderr before the record that ends a cell (protocol.RECORD_SYNC)."""
    fd = rank.out_fd if stream == "stdout" else rank.err_fd
    for _ in range(256 if until_empty else 1):  # bounded: a process the rank started may write on and on
        if fd < 0:
            return False
        try:
            data = os.read(fd, READ_SIZE)
        except BlockingIOError:
            return True
        except OSError:
            data = b""
        if not data:
            os.close(fd)
            if stream == "stdout":
                rank.out_fd = -1
            else:
                rank.err_fd = -1
            for kind, value in rank.splitters[stream].flush():
                if kind in ("line", "errline"):
                    _line(rank, "stderr" if kind == "errline" else stream, str(value), batch, tee)
            return False
        if stream == "stdout" and rank.err_fd >= 0:
            read_output(rank, "stderr", batch, on_record, tee, until_empty=True)
        for kind, value in rank.splitters[stream].feed(data):
            if kind in ("line", "errline"):  # errline: the rank's stderr, embedded in its stdout (protocol.py)
                _line(rank, "stderr" if kind == "errline" else stream, str(value), batch, tee)
            elif kind == "msg":
                record: tuple[int, bytes] = value  # type: ignore[assignment]
                on_record(rank, record[0], record[1])
            # sync markers need nothing here: output and results reach the controller in order
    return True


def _line(rank: LocalRank, stream: str, text: str, batch: EventBatch, tee: Callable[[int, str, str], None] | None
          ) -> None:
    batch.line(rank.rank, stream, text)
    if tee is not None:
        tee(rank.rank, stream, text)


def drain(rank: LocalRank, batch: EventBatch, on_record: Callable[[LocalRank, int, bytes], None],
          tee: Callable[[int, str, str], None] | None) -> None:
    """Pass on everything the rank's pipes hold now (before a message it sent on its socket, or its exit)."""
    if rank.out_fd >= 0:
        read_output(rank, "stdout", batch, on_record, tee, until_empty=True)
    if rank.err_fd >= 0:
        read_output(rank, "stderr", batch, on_record, tee, until_empty=True)


def take_record(rank: LocalRank, flags: int, body: bytes, signer: P.Signer) -> tuple[Any, bytes, list, list] | None:
    """The verified message of a record once all its parts are in: (message, payload, buffers, its signed frames),
    else None. Leading parts that fail to verify came from output that only looked like a record."""
    if flags & P.RECORD_MORE:
        rank.record_parts.append(body)
        return None
    parts, rank.record_parts = [*rank.record_parts, body], []
    for start in range(len(parts)):
        try:
            frames = P.unpack_frames(b"".join(parts[start:]))
            msg, payload, bufs = signer.unpack(frames)
            return msg, payload, bufs, frames
        except (P.ProtocolError, ValueError, TypeError, KeyError):
            continue
    return None


def read_segment(desc: dict) -> list[bytes]:
    """The buffers of a shared memory segment of a rank of this host (monarch_worker.shm's descriptor), copied
    out: without torch, which the agent never imports.

    Raises OSError when the segment cannot be opened or is not the one described."""
    fd = os.open(desc["path"], os.O_RDONLY | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if st.st_ino != desc["ino"] or st.st_size < desc["length"] or st.st_uid != os.getuid():
            raise OSError(f"{desc['path']} is not the segment the message describes")
        if desc["length"] == 0:
            return [b"" for _ in desc["layout"]]
        with mmap.mmap(fd, desc["length"], prot=mmap.PROT_READ) as mm:
            return [mm[offset:offset + nbytes] for offset, nbytes in desc["layout"]]
    finally:
        os.close(fd)
