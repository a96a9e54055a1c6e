"""Fork server for local ranks ("zygote").

The kernel starts this module as a fresh interpreter (``python -m monarch_worker.zygote``), never by forking
itself. It imports torch once, never runs any torch compute (no CUDA context, no OpenMP thread pool, no threads
at all), and then forks one child per rank on request. A child starts with torch already imported, so a mesh is
ready in about the time of one ``import torch``, and a restart takes a fraction of that.

The zygote also relays each rank's stdout and stderr (the read ends of the pipes on the rank's fds 1 and 2) to
the kernel, so what a rank printed just before it crashed is never lost, and reports every rank's exit status
within one select() wake-up of the SIGCHLD.

It exits, killing every rank, when the kernel closes its control pipe or when its parent process changes (the
kernel died), so no rank outlives the notebook kernel.

Control fds: the kernel passes the control pipe's read end as fd 0 and the event pipe's write end as fd 1;
they are moved away at once so that nothing printed by imports corrupts the framing.
"""

from __future__ import annotations

import ctypes
import json
import os
import select
import signal
import sys
import time

from . import protocol as P

PR_SET_PDEATHSIG = 1


def _set_pdeathsig(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent thread exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class Zygote:
    def __init__(self, ctl_in: int, ev_out: int) -> None:
        self.ctl_in = ctl_in
        self.ev_out = ev_out
        self.parent = os.getppid()
        self.children: dict[int, int] = {}  # pid -> spawn id
        self.pipes: dict[int, tuple[int, int]] = {}  # read fd -> (spawn id, kind)
        self.stderr_of: dict[int, int] = {}  # spawn id -> read fd of its stderr pipe
        self.buf = b""
        self.pending: list[bytes] = []
        self.sig_r, self.sig_w = os.pipe()
        os.set_blocking(self.sig_r, False)
        os.set_blocking(self.sig_w, False)
        signal.set_wakeup_fd(self.sig_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.shutdown(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def emit(self, frame: bytes) -> None:
        """Queue a frame for the kernel; ``flush`` writes everything queued in one system call."""
        self.pending.append(frame)

    def flush(self) -> None:
        if not self.pending:
            return
        data, self.pending = b"".join(self.pending), []
        view = memoryview(data)
        while view:
            try:
                n = os.write(self.ev_out, view)
            except BrokenPipeError:
                self.shutdown(0)
            view = view[n:]

    def spawn(self, sid: int, req: dict) -> None:
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            try:
                self._become_rank(req, out_w, err_w)
            finally:
                os._exit(1)
        os.close(out_w)
        os.close(err_w)
        os.set_blocking(out_r, False)
        os.set_blocking(err_r, False)
        self.children[pid] = sid
        self.pipes[out_r] = (sid, P.Z_STDOUT)
        self.pipes[err_r] = (sid, P.Z_STDERR)
        self.stderr_of[sid] = err_r
        self.emit(P.zygote_json(P.Z_SPAWNED, sid, {"pid": pid}))

    def _become_rank(self, req: dict, out_w: int, err_w: int) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != self.zygote_pid:
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        os.closerange(3, 65536)
        os.environ.clear()
        os.environ.update(req["env"])
        try:
            os.chdir(req["cwd"])
        except OSError:
            pass
        sys.path[:] = req["sys_path"]
        from .runtime import RankConfig, run_rank

        code = run_rank(RankConfig(**req["config"]))
        os._exit(code)

    def kill(self, sid: int, sig: int) -> None:
        for pid, s in list(self.children.items()):
            if sid in (-1, s):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    pass

    def reap(self) -> None:
        while self.children:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            sid = self.children.pop(pid, None)
            if sid is None:
                continue
            # Relay what the rank wrote before it died, then its exit status.
            for fd, (s, kind) in list(self.pipes.items()):
                if s == sid:
                    self.drain(fd, final=True)
            code = os.waitstatus_to_exitcode(status)
            self.emit(P.zygote_json(P.Z_EXITED, sid, {"returncode": code, "pid": pid}))

    def drain(self, fd: int, final: bool = False, empty: bool = False) -> None:
        """Relay what the pipe ``fd`` holds: one read; with ``empty``, reads until it is empty; with ``final``
        (the rank exited), reads until it is empty and closes it (a grandchild may still hold the write end).

        Before bytes read from a rank's stdout are relayed, whatever that rank's stderr pipe holds is relayed
        first: a rank writes its stderr before the stdout record that ends a cell (protocol.RECORD_SYNC), so the
        kernel sees all of the cell's output on both streams before that record.
        """
        sid, kind = self.pipes[fd]
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                data = None
            if data:
                if kind == P.Z_STDOUT:
                    err = self.stderr_of.get(sid)
                    if err is not None and err in self.pipes:
                        self.drain(err, empty=True)
                self.emit(P.zygote_frame(kind, sid, data))
                if final or empty:
                    continue
                return
            if data is None and not final:
                return
            del self.pipes[fd]
            if self.stderr_of.get(sid) == fd:
                del self.stderr_of[sid]
            os.close(fd)
            return

    def handle_control(self) -> None:
        data = os.read(self.ctl_in, 65536)
        if not data:
            self.shutdown(0)
        self.buf += data
        hs = P.ZYGOTE_HEADER.size
        while len(self.buf) >= hs:
            kind, sid, n = P.ZYGOTE_HEADER.unpack_from(self.buf)
            if len(self.buf) < hs + n:
                break
            body, self.buf = self.buf[hs:hs + n], self.buf[hs + n:]
            req = json.loads(body)
            if kind == P.Z_SPAWN:
                self.spawn(sid, req)
            elif kind == P.Z_KILL:
                self.kill(sid, int(req["signal"]))

    def shutdown(self, code: int) -> None:
        self.kill(-1, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while self.children and time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, 0)
                self.children.pop(pid, None)
            except ChildProcessError:
                break
        os._exit(code)

    def serve(self) -> None:
        self.zygote_pid = os.getpid()
        self.emit(P.zygote_json(P.Z_READY, -1, {"pid": self.zygote_pid}))
        self.flush()
        while True:
            fds = [self.ctl_in, self.sig_r, *self.pipes]
            try:
                ready, _, _ = select.select(fds, [], [], 1.0)
            except InterruptedError:
                continue
            if os.getppid() != self.parent:
                self.shutdown(0)  # the kernel died; its ranks go with it
            for fd in ready:
                if fd == self.sig_r:
                    try:
                        os.read(self.sig_r, 4096)
                    except BlockingIOError:
                        pass
                elif fd == self.ctl_in:
                    self.handle_control()
                elif fd in self.pipes:
                    self.drain(fd)
            self.reap()
            self.flush()


def main() -> None:
    ctl_in = os.dup(0)
    ev_out = os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # anything printed by imports goes to the kernel's stderr, not into the event pipe
    os.close(devnull)
    import torch  # noqa: F401  - the point of the zygote: pay for this once
    import torch.distributed  # noqa: F401
    import cloudpickle  # noqa: F401
    import zmq  # noqa: F401  - imports only; no Context (it would start threads) before forking

    from . import runtime  # noqa: F401

    Zygote(ctl_in, ev_out).serve()


if __name__ == "__main__":
    main()
