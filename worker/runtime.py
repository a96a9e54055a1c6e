"""A rank: connect to the controller, join the process group, run cells until told to stop.

Threads
-------
- The main thread runs user code (so KeyboardInterrupt, CUDA contexts and ``breakpoint()`` behave as in a
  script) and takes work from ``Rank.work`` one item at a time.
- The I/O thread owns the ZeroMQ socket and the Signer: it receives and verifies every message, answers
  heartbeats and stack requests itself (it stays responsive while the main thread blocks in a collective),
  interrupts the main thread, and sends what other threads put in the outbox.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import logging
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import zmq

from . import completion, elastic_env, heap, live, recovery
from . import protocol as P
from .channel import Mailbox, Outbox, recv_frames, send_frames
from .config import RankConfig
from .dapbridge import DapBridge
from .debugger import RankDebugger
from .executor import MESH_NAMES, Namespace, format_error, main_thread_stack, register_source
from .group import MeshGroup
from .options import RANK_SETTINGS
from .serialize import SerializationError, dumps, loads
from .transfer import RankTransfers

log = logging.getLogger(__name__)

__all__ = ["Rank", "JoinRejected", "RECORD_RESULT_MAX"]

class JoinRejected(RuntimeError):
    """The controller did not admit this rank (the message says why)."""


class Rank:
    """The runtime of one rank (see module docstring for the threads)."""

    def __init__(self, config: RankConfig) -> None:
        self.config = config
        self.rank = config.rank
        self.outbox = Outbox()
        # Work for the main thread that the I/O thread received (all of it, for a rank without a work pipe).
        self.work = Mailbox()
        self.current_cell = -1  # cell the main thread runs now (-1: idle)
        self._in_cell = False  # the main thread runs a cell's own code (user code), not the runtime's
        self._sigint_cell = -1  # the cell the I/O thread last sent SIGINT for (-1: none pending)
        self._cell_lock = threading.Lock()
        self._last_started = 0  # the id of the last cell the main thread started
        self._early_interrupts: set[int] = set()  # cells interrupted before they reached the main thread
        # Cells an interrupt was sent to (or a SIGINT landed in): their KeyboardInterrupt is an interrupt, not an
        # exception the cell's own code raised.
        self._interrupt_sent: set[int] = set()
        self._last_heard = time.monotonic()
        self.main_ident: int = threading.main_thread().ident or 0
        self._signer = P.Signer(bytes.fromhex(config.secret))
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 2000)
        self._sock.setsockopt(zmq.IDENTITY, f"rank-{os.getpid()}-{os.urandom(8).hex()}".encode())
        if config.curve_serverkey and not config.connect:  # encrypted, the controller authenticated by its key
            public, secret = zmq.curve_keypair()
            self._sock.curve_serverkey = config.curve_serverkey.encode()
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        self._sock.connect(config.connect or config.controller)  # a host agent's socket, or the controller's
        self.relay: Any = None  # an OutputRelay (relay.py) when this rank sends its own output
        self._joined = False  # the controller admitted this rank (heartbeat timeout applies from then on)
        self._said_hello = False
        self._io = threading.Thread(target=self._io_loop, name="monarch-io", daemon=True)
        self._stop = threading.Event()
        self.ns: Namespace | None = None
        self.device: Any = None  # this rank's torch.device (cuda:LOCAL_RANK or cpu), set by join()
        self.transfers = RankTransfers(self)
        self.idle = heap.IdleTrim()  # freed heap memory goes back to the OS once the rank idles after work
        self.group_sockets = recovery.GroupSockets()  # what Abort shuts down to release gloo collectives
        self.group = MeshGroup(lambda: self._in_cell, self.send)  # the mesh's process group (group.py)
        self.group.sockets = self.group_sockets
        self.debugger = RankDebugger(self)  # breakpoint(), post-mortem, inspect (debugger.py)
        self.dap = DapBridge(self.send)  # the visual debugger's DAP stream, relayed for a kernel elsewhere
        # Records (protocol.RECORD_PREFIX): once the rank serves cells, its main thread writes what it reports
        # into its stdout pipe, through a copy of fd 1 that user code redirecting fd 1 does not affect.
        self._record_fd = -1
        self._stderr_fd = -1  # a copy of fd 2, for sync markers (user code may redirect fd 2)
        self._pid = os.getpid()  # a process forked by user code (multiprocessing) must not write records
        self._record_types = P.record_types()
        # A SIGINT for the cell that lands while its main thread writes a record is held until the record is whole
        # (``_write_records``): raised mid-write it would cut the record, or write it twice.
        self._writing_record = False
        self._held_sigint = False
        self._main_signer = P.Signer(bytes.fromhex(config.secret))  # the main thread's own sender session
        self.rich: Any = None  # the display publisher (display.Publisher), set at start-up

    @property
    def writes_records(self) -> bool:
        """What this thread sends now goes as records into the stdout pipe (a local rank's main thread)."""
        return self._record_fd >= 0 and threading.get_ident() == self.main_ident and os.getpid() == self._pid

    def send(self, msg: P.Message, value: Any = None, *, with_value: bool = False, buffers: list | None = None) -> None:
        """Queue ``msg`` for the I/O thread (any thread); ``value`` is pickled here as its payload, or ``buffers``
        (raw bytes) go with it as they are.

        Raises SerializationError when ``value`` cannot be pickled (nothing is queued then).
        """
        payload, buffers = dumps(value) if with_value else (b"", buffers or [])
        if (self._record_fd >= 0 and isinstance(msg, self._record_types)
                and threading.get_ident() == self.main_ident and os.getpid() == self._pid):
            self._write_records(msg, payload, buffers)
            return
        self.outbox.put((msg, payload, buffers))

    def _write_records(self, msg: P.Message, payload: bytes, buffers: list | tuple, sync: bool = False,
                       limit: int | None = None) -> bool:
        """Main thread: write ``msg`` as records into the stdout pipe (see protocol.RECORD_PREFIX), in order with
        the output before it. Returns False, writing nothing, when it packs to more than ``limit`` bytes."""
        body = P.pack_frames(self._main_signer.pack(msg, payload, buffers))
        if limit is not None and len(body) > limit:
            return False
        # on_sigint holds an interrupt of the cell meanwhile: a KeyboardInterrupt raised as os.write returns would
        # lose how much it wrote (the record went out twice), and one swallowed here would never stop the cell.
        self._writing_record, self._held_sigint = True, False
        try:
            for record in P.records(body, sync):
                view = memoryview(record)
                while view:
                    view = view[os.write(self._record_fd, view):]
        finally:
            self._writing_record = False
        if self._held_sigint:
            self._held_sigint = False
            if self._in_cell:  # the cell goes on to its next line only to stop there
                raise KeyboardInterrupt
        return True

    # ---- I/O thread ------------------------------------------------------------------------------------------

    def _send_now(self, msg: P.Message, payload: bytes = b"", buffers: list | tuple = ()) -> None:
        """Send from the I/O thread (the only thread that touches the socket; asserted)."""
        assert threading.current_thread() is self._io, "the rank's DEALER socket is the I/O thread's"
        send_frames(self._sock, self._signer.pack(msg, payload, buffers))

    def _io_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self.outbox.wake_fd, zmq.POLLIN)
        interval_ms = int(self.config.heartbeat_interval * 1000)
        next_beat = 0.0
        handlers: dict[type, Callable[[Any, bytes, list], None]] = {
            P.Interrupt: self._on_interrupt,
            P.StacksRequest: self._on_stacks,
            P.Abort: self._on_abort,
            P.Ping: lambda msg, payload, bufs: None,
            P.Replicas: lambda msg, payload, bufs: elastic_env.replicas(msg.groups),
            P.ShmRelease: self.transfers.on_release,
            P.DebugInput: self.debugger.on_input,
            P.Inspect: self.debugger.on_inspect,
            P.DebugClear: self.debugger.on_clear,
            P.DapOpen: self.dap.on_open,
            P.DapData: self.dap.on_data,
            P.DapClose: self.dap.on_close,
            P.Complete: lambda msg, payload, bufs: self._send_now(
                completion.answer(self.ns.ns if self.ns is not None else None, msg)),
        }
        while not self._stop.is_set():
            events = dict(poller.poll(interval_ms))
            now = time.monotonic()
            if self._sock in events:
                while (frames := recv_frames(self._sock)) is not None:
                    try:
                        msg, payload, bufs = self._signer.unpack(frames)
                    except P.ProtocolError as e:
                        log.warning("rank %d dropped a message: %s", self.rank, e)
                        continue
                    self._last_heard = now
                    handler = handlers.get(type(msg))
                    if handler is not None:
                        handler(msg, payload, bufs)
                    else:
                        self.work.put((msg, payload, bufs))
            if self.outbox.wake_fd in events:
                for item in self.outbox.drain():
                    if item is not None:
                        self._send_now(*item)
            if now >= next_beat and self._said_hello:
                next_beat = now + self.config.heartbeat_interval
                self._send_now(P.Heartbeat(rss=_rss_bytes(), group=self.group.current_backend(),
                                           **_cuda_memory(self.device)))
                if self._joined and now - self._last_heard > self.config.heartbeat_timeout:
                    sys.stderr.write(
                        f"monarch_worker rank {self.rank}: no word from the controller for "
                        f"{self.config.heartbeat_timeout:.0f} s; exiting\n"
                    )
                    os._exit(3)
        for item in self.outbox.drain():  # close(): what is left (Goodbye), then the socket
            if item is not None:
                self._send_now(*item)
        self._sock.close(linger=1000)
        self._ctx.term()

    def close(self, timeout: float = 2.0) -> None:
        """Send what the outbox holds, then close the socket (waits up to ``timeout`` seconds; any thread but
        the I/O thread)."""
        self._stop.set()
        self.outbox.put(None)
        if self._io.is_alive():
            self._io.join(timeout)

    def _on_interrupt(self, msg: P.Interrupt, payload: bytes, bufs: list) -> None:
        self.note_interrupt(msg.cell_id)
        if self.debugger.on_interrupt(msg.cell_id):
            return  # it waited at a pdb prompt: it raises KeyboardInterrupt there
        with self._cell_lock:
            if self.current_cell == msg.cell_id:
                self._sigint_cell = msg.cell_id  # read by on_sigint, in the main thread
                signal.pthread_kill(self.main_ident, signal.SIGINT)
            elif msg.cell_id > self._last_started:
                # The cell has not reached the main thread yet (it travels by another pipe): it stops at once
                # when it does.
                self._early_interrupts.add(msg.cell_id)

    def on_sigint(self, signum: int, frame: Any) -> None:
        """SIGINT handler (main thread): KeyboardInterrupt in the cell it was meant for.

        The I/O thread sends SIGINT for one cell; it may arrive after that cell ended, while the main thread runs the
        runtime's own code (writing the result, reading the next cell) or the next cell: there it is dropped, so it
        never breaks a result or interrupts the wrong cell. A SIGINT from elsewhere (a terminal) interrupts the
        running cell, and is ignored between cells, as before.
        """
        ours, self._sigint_cell = self._sigint_cell, -1
        if not self._in_cell:
            return
        if ours >= 0 and ours != self.current_cell:
            return
        if self.debugger.leaving:  # held: pdb leaves its prompt, or the cell's exception is kept (debugger.py)
            self.debugger.sigint_pending = True
            return
        self.note_interrupt(self.current_cell)
        if self._writing_record:  # raised once the record is whole (_write_records)
            self._held_sigint = True
            return
        raise KeyboardInterrupt

    def note_interrupt(self, cell_id: int) -> None:
        """An interrupt reached ``cell_id`` (any thread, a signal handler too: no lock, ``set.add`` is atomic):
        a KeyboardInterrupt it ends with is reported as an interrupt, not as an exception of the cell's code."""
        self._interrupt_sent.add(cell_id)

    def _on_stacks(self, msg: P.StacksRequest, payload: bytes, bufs: list) -> None:
        frame = sys._current_frames().get(self.main_ident)
        cell = self.current_cell
        frames = main_thread_stack(frame) if cell >= 0 else []
        self._send_now(P.Stacks(msg.request_id, cell, frames, "running" if cell >= 0 else "idle",
                                recovery.last_collective()))

    def _on_abort(self, msg: P.Abort, payload: bytes, bufs: list) -> None:
        # Queued first: the main thread leaves the group before anything that comes after the collective this
        # releases (the cell's end, a Regroup), whichever way that comes.
        self.work.put((msg, payload, bufs))
        recovery.abort_communicators(msg.reason, self.group_sockets)

    # ---- main thread ------------------------------------------------------------------------------------------

    def _wait_for(self, kind: type[P.Message], timeout: float) -> tuple:
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"rank {self.rank}: no {kind.TYPE} from the controller at {self.config.controller} in "
                    f"{timeout:.0f} s: it is not listening there, cannot be reached from this host, or ignores "
                    "this rank because it does not hold the mesh's secret")
            item = self.work.get(timeout=remaining)
            if item is None:
                continue
            if isinstance(item[0], kind):
                return item
            if isinstance(item[0], P.Rejected):
                raise JoinRejected(item[0].reason)
            if isinstance(item[0], P.Shutdown):
                os._exit(0)

    def join(self) -> None:
        """Handshake with the controller and initialize torch.distributed."""
        cfg = self.config
        self.send(
            P.Hello(
                rank=cfg.rank,
                pid=os.getpid(),
                host=socket.gethostname(),
                local_rank=cfg.local_rank,
                local_world_size=cfg.local_world_size,
                world_size=cfg.world_size,
                launcher_env=cfg.launcher_env,
            )
        )
        self._said_hello = True  # heartbeats may follow (a controller ignores them from a stranger)
        import torch
        import torch.distributed as dist

        welcome, _, _ = self._wait_for(P.Welcome, cfg.join_timeout)
        self._joined = True
        self.rank = welcome.rank
        settings = {k: v for k, v in welcome.settings.items() if k in RANK_SETTINGS}
        if settings:
            os.environ.update(settings.pop("env", {}))
            self.config = cfg = dataclasses.replace(cfg, **settings)
        if self.relay is not None:
            self.relay.release()  # output held while waiting to be admitted goes out now
        elastic_env.apply(rank=welcome.rank, world_size=welcome.world_size, local_rank=welcome.local_rank,
                          local_world_size=welcome.local_world_size, elastic=welcome.elastic,
                          launched_by_torchrun="TORCHELASTIC_RUN_ID" in cfg.launcher_env)
        device, backend = self.init_group(welcome.rank, welcome.world_size, welcome.local_rank,
                                          welcome.local_world_size, welcome.master_addr, welcome.master_port,
                                          cfg.backend)
        self.device = device
        self.ns = Namespace(dict(zip(MESH_NAMES, (welcome.rank, welcome.world_size, welcome.local_rank, device, dist,
                                                  torch), strict=True)))
        self.group.install()  # user code's own init/destroy_process_group (group.py)
        self.send(P.Ready(device=str(device), backend=backend, host=socket.gethostname(), pid=os.getpid()))

    def init_group(self, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
                   master_port: int, backend: str) -> tuple[Any, str]:
        """Join the default process group (at start, and again on Regroup); returns (device, backend). See
        ``MeshGroup.join`` (group.py) for ``master_addr`` and ``master_port``."""
        cfg = self.config
        return self.group.join(rank, world_size, local_rank, local_world_size, master_addr, master_port, backend,
                               cfg.controller, cfg.join_timeout, cfg.pg_timeout)

    @property
    def in_cell(self) -> bool:
        """The main thread runs user code now (a cell, a call, a script)."""
        return self._in_cell

    def serve(self) -> None:
        """Main loop: take work and run it until Shutdown."""
        if self.config.output_records:
            # Copies (not inherited by subprocesses) that user code redirecting or closing fds 1 and 2 cannot touch.
            self._record_fd = fcntl.fcntl(1, fcntl.F_DUPFD_CLOEXEC, 100)
            self._stderr_fd = fcntl.fcntl(2, fcntl.F_DUPFD_CLOEXEC, 100)
        if self.config.work_fd >= 0:  # the same for the work pipe, away from the low fd numbers code may close
            fd = fcntl.fcntl(self.config.work_fd, fcntl.F_DUPFD_CLOEXEC, 100)
            os.close(self.config.work_fd)
            self.config = dataclasses.replace(self.config, work_fd=fd)
        dispatch: dict[type, Callable[[Any, bytes, list], None]] = {
            P.Exec: self._exec,
            P.Call: self._call,
            P.Push: self.transfers.push,
            P.Pull: self.transfers.pull,
            P.DebugPostMortem: self._post_mortem,
            P.Abort: lambda *m: recovery.destroy_group(self, *m),
            P.Regroup: lambda *m: recovery.regroup(self, *m),
        }
        next_work = self._work_source()
        while True:
            try:
                item = next_work()
                if item is None:
                    return  # the kernel closed the work pipe: it stopped the mesh or exited
                msg, payload, bufs = item
                if isinstance(msg, P.Shutdown):
                    return
                handler = dispatch.get(type(msg))
                if handler is None:
                    log.warning("rank %d: unexpected %s", self.rank, msg.TYPE)
                    continue
                handler(msg, payload, bufs)
                self.idle.worked()  # what the work freed goes back to the OS once the rank idles (heap)
            except KeyboardInterrupt:
                # An interrupt that landed just after its cell ended (or a stray SIGINT): the rank stays up.
                log.info("rank %d: interrupt outside a cell ignored", self.rank)
            except OSError as e:
                private = {self.config.work_fd, self._record_fd, self._stderr_fd} - {-1}
                if getattr(e, "errno", None) != errno.EBADF or not private:
                    raise
                # User code closed one of the rank's own pipes (fds >= 100): it can no longer talk to the kernel.
                os.write(2, (f"monarch_worker rank {self.rank}: code in a cell closed this rank's own pipe to the "
                             f"kernel (one of fds {sorted(private)}); the rank exits. Restart it with  %mesh "
                             f"restart --rank {self.rank}\n").encode())
                return

    def _work_source(self) -> Any:
        """A function returning the next work item (message, payload, buffers), or None once the kernel has
        closed the work pipe. Items the I/O thread queued come first (an Abort must precede a later Regroup)."""
        fd = self.config.work_fd
        if fd < 0:
            def next_queued() -> tuple | None:
                while (item := self.work.get(self.idle.timeout())) is None:
                    self.idle.maybe_trim()
                return item

            return next_queued
        reader = P.WorkReader()
        ready: list = []
        signer = self._main_signer  # the main thread's: it verifies what the kernel's work session signs

        def next_work() -> tuple | None:
            while True:
                item = self.work.get_nowait()
                if item is not None:
                    return item
                if ready:
                    return ready.pop(0)
                r, _, _ = select.select([fd, self.work.wake_fd], [], [], self.idle.timeout())
                if not r:
                    self.idle.maybe_trim()
                    continue
                if self.work.wake_fd in r:
                    self.work.clear_wake()
                if fd not in r:
                    continue
                bodies = reader.read_from(fd)
                if bodies is None:
                    return None
                for body in bodies:
                    try:
                        ready.append(signer.unpack(P.unpack_frames(body)))
                    except P.ProtocolError as e:
                        log.warning("rank %d dropped a work message: %s", self.rank, e)

        return next_work

    def run_work(self, cell_id: int, body: Any, reply: Any = None) -> None:
        """Run ``body()`` as cell ``cell_id`` and report its Result after its output is flushed.

        ``reply(result, value)``, when given, sends the outcome instead of a plain ``Result`` (pulls do).
        """
        with self._cell_lock:
            self.current_cell = cell_id
            self._last_started = max(self._last_started, cell_id)
            interrupted = cell_id in self._early_interrupts
            self._early_interrupts = {c for c in self._early_interrupts if c > cell_id}
        start = time.perf_counter()
        value: Any = None
        has_value, error = False, None
        try:
            try:
                self._in_cell = True
                if interrupted:
                    raise KeyboardInterrupt
                has_value, value = body()
            finally:
                self._in_cell = False
                with self._cell_lock:
                    self.current_cell = -1
                self.debugger.cell_finished()
        except BaseException as e:  # noqa: BLE001 - report everything, KeyboardInterrupt included
            error = format_error(e, self.ns.ns if self.ns is not None else None, cell_id in self._interrupt_sent)
            value, has_value = None, False
        # In place (list() and difference_update are atomic): the I/O thread may note a later cell meanwhile.
        self._interrupt_sent.difference_update([c for c in list(self._interrupt_sent) if c <= cell_id])
        if self.rich is not None:  # figures left open are shown; a figure value comes back as its image
            value = self.rich.cell_value(value) if has_value and reply is None else value
            self.rich.end_cell(cell_id)
        live.flush()  # the last progress report of the cell, held back by throttling
        result = P.Result(cell_id, "error" if error else "ok", has_value, error, time.perf_counter() - start)
        if reply is not None:
            self._sync_output(cell_id)
            reply(result, value)
            return
        try:
            payload, buffers = dumps(value) if result.has_value else (b"", [])
        except SerializationError as e:
            result, payload, buffers = _unpicklable(result, e), b"", []
        if self._record_fd >= 0:
            # A Result of up to RECORD_RESULT_MAX bytes ends the cell as records in the stdout pipe, behind the
            # cell's output: no sync markers, no socket (see protocol.RECORD_PREFIX).
            self._flush_std_streams()
            if self._write_records(result, payload, buffers, sync=True, limit=RECORD_RESULT_MAX):
                return
        self._send_marked(result, payload, buffers)

    def _send_marked(self, result: P.Result, payload: bytes, buffers: list) -> None:
        """Send a large Result over the socket, after sync markers in both output streams."""
        self._sync_output(result.cell_id)
        # The I/O thread sends later; the next cell may change this value in place meanwhile, so large buffers
        # are copied now (one memcpy) rather than sent from the live tensor's memory.
        self.outbox.put((result, payload, [bytes(b) for b in buffers]))

    @staticmethod
    def _flush_std_streams() -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # noqa: BLE001 - a user may have replaced or closed it
                pass
        recovery.flush_c_stdio()  # C stdio too: a printf without a newline belongs to this cell

    def _sync_output(self, cell_id: int) -> None:
        self._flush_std_streams()
        marker = P.sync_marker(cell_id)
        if self.relay is not None:
            self.relay.mark(marker, 1.0)  # the cell's output (and markers) is queued before its Result
            return
        for fd in (self._record_fd if self._record_fd >= 0 else 1, self._stderr_fd if self._stderr_fd >= 0 else 2):
            try:
                os.write(fd, marker)
            except OSError:
                pass

    def _exec(self, msg: P.Exec, payload: bytes, bufs: list) -> None:
        ns = self.ns
        assert ns is not None
        for filename, source in msg.sources.items():
            register_source(filename, source)

        def body() -> tuple[bool, Any]:
            with self.debugger.keeping():  # its exception stays for post-mortem until the next cell
                if payload:
                    ns.inject(loads(payload, bufs))
                return ns.run_cell(msg.code, msg.filename)

        self.run_work(msg.cell_id, body)

    def _call(self, msg: P.Call, payload: bytes, bufs: list) -> None:
        for filename, source in msg.sources.items():
            register_source(filename, source)

        def body() -> tuple[bool, Any]:
            with self.debugger.keeping():
                fn, args, kwargs = loads(payload, bufs)
                value = fn(*args, **kwargs)
                return value is not None, value

        self.run_work(msg.cell_id, body)

    def _post_mortem(self, msg: P.DebugPostMortem, payload: bytes, bufs: list) -> None:
        self.run_work(msg.cell_id, lambda: self.debugger.post_mortem(msg.mode))

    def start_io(self) -> None:
        self._io.start()


RECORD_RESULT_MAX = 64 * 1024
"""Largest Result (bytes, packed) a local rank sends as records in its stdout pipe; larger ones, and their tensor
memory, go over the socket without being cut up (measured with bench/bench_core.py)."""


def _unpicklable(result: P.Result, e: Exception) -> P.Result:
    """The error Result for a cell whose last value cannot be pickled."""
    err = {"type": "SerializationError", "module": "monarch_worker.serialize",
           "message": f"the cell's result cannot be sent to the notebook: {e}",
           "traceback": "", "interrupted": False}
    return P.Result(result.cell_id, "error", error=err, duration=result.duration)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _cuda_memory(device: Any) -> dict[str, int]:
    """Allocated and reserved bytes of torch's CUDA caching allocator on the rank's device (device 0 for a CPU
    rank whose code uses CUDA), once this process uses CUDA; empty otherwise (never initializes CUDA itself)."""
    torch = sys.modules.get("torch")
    try:
        if torch is None or not torch.cuda.is_initialized():
            return {}
        on_gpu = device is not None and device.type == "cuda"
        device = (device.index or 0) if on_gpu else 0
        return {"cuda_allocated": int(torch.cuda.memory_allocated(device)),
                "cuda_reserved": int(torch.cuda.memory_reserved(device))}
    except Exception:  # noqa: BLE001 - a heartbeat must always go out
        return {}
