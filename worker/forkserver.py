"""The fork server: forks this host's ranks from one interpreter that imported torch once.

The kernel starts this module as a fresh interpreter (``python -m monarch_worker.forkserver``), never by forking
itself. It imports torch once, never runs any torch compute (no CUDA context, no OpenMP thread pool, no threads
at all), and then forks one child per rank on request. A child starts with torch already imported, so a mesh is
ready in about the time of one ``import torch``, and a restart takes a fraction of that.

Each rank's stdout and stderr are pipes whose read ends the fork server hands to the kernel (SCM_RIGHTS), so the
kernel reads a rank's output, and the records in it (protocol.RECORD_PREFIX), with no process in between. The
kernel holds those read ends, so what a rank printed just before it crashed stays in the pipe until the kernel has
read it; the fork server reports every rank's exit status within one select() wake-up of the SIGCHLD, and the kernel
drains the rank's pipes before it acts on that status. Each rank's work pipe (protocol.WORK_FD) arrives the other
way, from the kernel, with the spawn request.

It exits, killing every rank, when the kernel closes the control socket or when its parent process changes (the
kernel died), so no rank outlives the notebook kernel. Nor does anything a rank started: the fork server is a child
subreaper and ends the process tree of every rank that is gone (reaper.py).

Control channel: the kernel passes one end of a Unix socket pair as fd 0; it carries the frames of
protocol.FORK_SERVER_HEADER both ways, and file descriptors with them. It is moved away from fd 0 at once.

**Clones.** A host agent on the kernel's own host (``--launcher agent``) needs a fork server of its own, whose ranks
it reads and speaks for. Started fresh, that fork server would import torch again (seconds, the whole start of such a
mesh); instead the kernel sends this one a socket with ``FS_CLONE`` and hands the other end to the agent, and this
process forks a child that serves that socket as a fork server, torch and every preloaded module already imported.
The clone is a child of this process (it dies with it, ``PR_SET_PDEATHSIG``, and is killed with its ranks when this
one ends) and a subreaper of its own; it ends, killing its ranks, when the agent closes the socket.
"""

from __future__ import annotations

import ctypes
import gc
import importlib
import json
import os
import select
import shutil
import signal
import socket
import sys
import tempfile

from . import protocol as P
from .elastic_env import keep_error_files_under
from .reaper import ProcessTrees, become_rank

PR_SET_PDEATHSIG = 1
CLONE_CTL_FD = 3  # a clone's control socket (fds 0-2 are this process's /dev/null and stderr)


def _set_pdeathsig(sig: int) -> None:
    """Linux: deliver ``sig`` to this process when its parent thread exits."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, sig, 0, 0, 0)
    except (OSError, AttributeError):
        pass


class ForkServer:
    def __init__(self, ctl_fd: int, folder: str = "") -> None:
        self.ctl = socket.socket(fileno=ctl_fd)
        self.folder = folder  # the ranks' error-file folders (elastic_env.keep_error_files_under); removed at exit
        self.received_fds: list[int] = []  # work pipes handed over with SCM_RIGHTS, in the order of the spawns
        self.parent = os.getppid()
        self.children: dict[int, int] = {}  # pid -> spawn id
        self.trees = ProcessTrees(os.getpid())  # subreaper from now on: what ranks leave behind comes back here
        self.buf = b""
        self.pending: list[tuple[bytes, tuple[int, ...]]] = []  # frames for the kernel, with fds to hand over
        self.sig_r, self.sig_w = os.pipe()
        os.set_blocking(self.sig_r, False)
        os.set_blocking(self.sig_w, False)
        signal.set_wakeup_fd(self.sig_w)
        signal.signal(signal.SIGCHLD, lambda *_: None)
        signal.signal(signal.SIGTERM, lambda *_: self.shutdown(0))
        signal.signal(signal.SIGINT, signal.SIG_IGN)

    def emit(self, frame: bytes, fds: tuple[int, ...] = ()) -> None:
        """Queue a frame for the kernel (with file descriptors it takes over); ``flush`` sends the queue."""
        self.pending.append((frame, fds))

    def flush(self) -> None:
        pending, self.pending = self.pending, []
        try:
            for frame, fds in pending:
                sent = socket.send_fds(self.ctl, [frame], list(fds)) if fds else 0
                self.ctl.sendall(frame[sent:])
                for fd in fds:
                    os.close(fd)  # the kernel holds them now
        except OSError:  # the kernel is gone
            self.shutdown(0)

    def spawn(self, sid: int, req: dict) -> None:
        work_r = self.received_fds.pop(0) if req.get("work_pipe") and self.received_fds else -1
        out_r, out_w = os.pipe()
        err_r, err_w = os.pipe()
        pid = os.fork()
        if pid == 0:  # the rank
            try:
                self._become_rank(req, out_w, err_w, work_r, sid)
            finally:
                os._exit(1)
        os.close(out_w)
        os.close(err_w)
        if work_r >= 0:
            os.close(work_r)
        self.children[pid] = sid
        self.emit(P.fork_server_json(P.FS_SPAWNED, sid, {"pid": pid}), (out_r, err_r))

    def _become_rank(self, req: dict, out_w: int, err_w: int, work_r: int, sid: int) -> None:
        signal.set_wakeup_fd(-1)
        for sig in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(sig, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != self.pid:
            os._exit(1)
        devnull = os.open(os.devnull, os.O_RDONLY)
        os.dup2(devnull, 0)
        os.dup2(out_w, 1)
        os.dup2(err_w, 2)
        if work_r >= 0:
            os.dup2(work_r, P.WORK_FD)
            req["config"]["work_fd"] = P.WORK_FD
        os.closerange(P.WORK_FD + 1 if work_r >= 0 else 3, 65536)
        os.environ.clear()
        os.environ.update(req["env"])
        become_rank(self.trees.tag(sid))  # a session of its own, tagged: reaper.py finds what it leaves behind
        try:
            os.chdir(req["cwd"])
        except OSError:
            pass
        sys.path[:] = req["sys_path"]
        from .config import RankConfig
        from .startup import run_rank

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
        exited = False
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            sid = self.children.pop(pid, None)
            if sid is None:
                continue  # a process a rank left behind, reparented here (reaper.py)
            exited = True
            code = os.waitstatus_to_exitcode(status)
            self.emit(P.fork_server_json(P.FS_EXITED, sid, {"returncode": code, "pid": pid}))
        if exited:  # before the exit is reported: what the rank left behind is gone when the kernel hears of it
            self.trees.sweep(dict(self.children))

    def handle_control(self) -> None:
        try:
            data, fds, _, _ = socket.recv_fds(self.ctl, 65536, 16)
        except OSError:
            data, fds = b"", []
        self.received_fds.extend(fds)
        if not data:
            self.shutdown(0)
        self.buf += data
        hs = P.FORK_SERVER_HEADER.size
        while len(self.buf) >= hs:
            kind, sid, n = P.FORK_SERVER_HEADER.unpack_from(self.buf)
            if len(self.buf) < hs + n:
                break
            body, self.buf = self.buf[hs:hs + n], self.buf[hs + n:]
            req = json.loads(body)
            if kind == P.FS_SPAWN:
                self.spawn(sid, req)
            elif kind == P.FS_KILL:
                self.kill(sid, int(req["signal"]))
            elif kind == P.FS_IMPORT:
                self.preload(req.get("modules", []))
            elif kind == P.FS_CLONE and self.received_fds:
                self.clone(sid, self.received_fds.pop(0))

    def clone(self, sid: int, ctl_fd: int) -> None:
        """Fork a fork server of its own that serves ``ctl_fd`` (see "Clones" above). It is filed as spawn ``sid``:
        its exit is reported like a rank's (the kernel knows no rank by that id), and this process's shutdown kills
        it."""
        pid = os.fork()
        if pid == 0:
            try:
                self._become_clone(ctl_fd)
            finally:
                os._exit(1)
        os.close(ctl_fd)
        self.children[pid] = sid

    def _become_clone(self, ctl_fd: int) -> None:
        signal.set_wakeup_fd(-1)
        _set_pdeathsig(signal.SIGKILL)
        if os.getppid() != self.pid:
            os._exit(1)
        if ctl_fd != CLONE_CTL_FD:
            os.dup2(ctl_fd, CLONE_CTL_FD)
        os.closerange(CLONE_CTL_FD + 1, 65536)  # this process's control socket and pipes are not the clone's
        # Inside this process's folder: this process removes it as it ends, also after SIGKILLing the clone.
        folder = tempfile.mkdtemp(prefix="monarch-ranks-", dir=self.folder or None)
        keep_error_files_under(folder)
        ForkServer(CLONE_CTL_FD, folder).serve()

    def preload(self, modules: list[str]) -> None:
        """Import ``modules`` (what the notebook imported: Lightning; what a self-healing mesh's replacements need:
        torchft, torch._dynamo), so that ranks forked from now on start with them, as the ranks of a fork-based
        launcher do. A module that fails to import is left out (a rank imports it
        itself, and says why, when it needs it). Spawns and exit reports wait meanwhile (seconds, once)."""
        for name in modules:
            try:
                importlib.import_module(name)
            except Exception:  # noqa: BLE001 - only a head start
                pass
        gc.collect()
        gc.freeze()  # as after torch (main): what was imported is long-lived

    def shutdown(self, code: int) -> None:
        """Kill every rank, end everything they started (but processes kept on purpose), reap it all, and exit.

        Every way this process ends but its own SIGKILL comes here (the kernel closed the control socket, it died,
        SIGTERM). It waits for the ranks to be reaped and their trees gone, at most ``reaper.END_WAIT`` seconds:
        leaving earlier would let the ranks' children, which reach this subreaper only when a rank's last thread
        is gone, be reparented to init instead."""
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second request must not cut the sweep short
        self.kill(-1, signal.SIGKILL)
        self.trees.end_all()
        if self.folder:
            shutil.rmtree(self.folder, ignore_errors=True)
        os._exit(code)

    def serve(self) -> None:
        self.pid = os.getpid()
        self.emit(P.fork_server_json(P.FS_READY, -1, {"pid": self.pid}))
        self.flush()
        while True:
            try:
                ready, _, _ = select.select([self.ctl.fileno(), self.sig_r], [], [], 1.0)
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
                else:
                    self.handle_control()
            self.reap()
            self.flush()


def main() -> None:
    ctl_fd = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # anything printed by imports goes to the kernel's stderr
    os.close(devnull)
    import cloudpickle  # noqa: F401
    import torch  # noqa: F401  - the point of the fork server: pay for this once
    import torch.distributed  # noqa: F401
    import zmq  # noqa: F401  - imports only; no Context (it would start threads) before forking

    # torchft's Rust log reads RUST_LOG once, when a rank (or this process, asked to: ``preload``) imports it: INFO
    # lines, several per training step, would flood the cells, so warnings only (of any Rust library) unless the
    # user chose. torchft itself is not imported here: it would add 0.3 s to every start (see the kernel's
    # lifecycle.REPLACEMENT_IMPORTS: a self-healing mesh has this process import it before its first ranks).
    os.environ.setdefault("RUST_LOG", "warn")

    from . import startup  # noqa: F401  - the rank runtime, imported once here

    folder = tempfile.mkdtemp(prefix="monarch-ranks-")
    keep_error_files_under(folder)

    # The objects of torch and the rest are long-lived: move them out of the collector's view before forking, so
    # that a rank's garbage collections do not walk them over and over (and do not copy their pages on write).
    # This is the standard pre-fork recipe of CPython's gc.freeze documentation.
    gc.collect()
    gc.freeze()
    ForkServer(ctl_fd, folder).serve()


if __name__ == "__main__":
    main()
