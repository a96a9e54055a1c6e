"""Process trees: nothing a rank started outlives the rank, nor the kernel, unless it is kept on purpose.

A rank may start processes of its own: a ``subprocess``, DataLoader workers, compile workers, a TensorBoard server,
and those may start more, leave the rank's session (``setsid()``) or double-fork like a daemon. The fork server
ends all of them when their rank ends (stopped, restarted, killed or dead by itself) and when it ends itself (the
kernel closed the control socket: it stopped, or died by any signal, SIGKILL included). It uses only what every
Linux user has:

- **The fork server is a child subreaper** (``prctl(PR_SET_CHILD_SUBREAPER)``, Linux 3.4). A process whose parent
  exits is reparented to its nearest living subreaper ancestor instead of init, so whatever a rank started, however
  it detached itself, stays below the fork server, which can end it and reaps it (no zombies).
- **Each rank leads a session of its own** (``setsid()`` right after the fork). What it starts shares its session
  id, the rank's pid, unless it calls ``setsid()`` itself; Linux does not hand out a pid again while a session or
  process group of that number exists, so the session id names the rank even after the rank and the processes in
  between are gone.
- **Each rank's environment is tagged** (``MONARCH_PROCESS_TREE=<fork server pid>:<spawn id>``). A program
  executed below the rank inherits the tag (``/proc/PID/environ`` holds the environment it was started with), which
  names the rank of a process that left the session.
- **Ranks die with the fork server** (``PR_SET_PDEATHSIG=SIGKILL``), so a SIGKILLed fork server leaves no rank.

When a rank has exited, its orphans have been reparented to the fork server before the fork server is told
(SIGCHLD). ``ProcessTrees.sweep`` then ends every orphan tree whose rank is not alive: a child of the fork server
that is not a live rank, whose session is not a live rank's and whose tag (if any) is not a live rank's, with all
its descendants. A process that left the session *and* carries no tag of a live rank (one forked without
``exec``, that called ``setsid()`` and whose parent exited; or one started with an environment without the tag)
cannot be traced to its rank: it is ended by the next sweep, when any rank of the fork server ends.

**Keeping a process on purpose.** A process started with ``MONARCH_KEEP_ALIVE=1`` in its environment, and
everything below it, is never ended by a sweep: it outlives its rank, the mesh and the kernel (end it yourself).
``keep_alive()`` gives the ``subprocess.Popen`` arguments for that. The rank removes the variable from its own
environment, so only the processes started with it are kept.

Why not a cgroup: a cgroup (v2, ``cgroup.kill``) would catch every descendant without these rules, but creating one
needs a writable, delegated cgroup tree (root, or systemd's ``Delegate=``), which a notebook user on a shared node
or in a container usually does not have; this file's tools work for any user and behave the same everywhere, so the
same code runs and is tested on every machine.
"""

from __future__ import annotations

import ctypes
import os
import signal
import time
from collections.abc import Callable, Iterable

__all__ = ["ProcessTrees", "keep_alive", "become_rank", "TREE_ENV", "KEEP_ALIVE_ENV", "END_WAIT"]

TREE_ENV = "MONARCH_PROCESS_TREE"
"""The variable that tags a rank's environment with ``<fork server pid>:<spawn id>``."""

KEEP_ALIVE_ENV = "MONARCH_KEEP_ALIVE"
"""A process started with this variable set to ``1`` (and what it starts) outlives its rank and the kernel."""

PR_SET_PDEATHSIG = 1
PR_SET_CHILD_SUBREAPER = 36

SWEEP_WAIT = 2.0
"""Seconds a sweep waits for the processes it SIGKILLed to die (one stuck in the kernel, state D, may take longer)."""

END_WAIT = 5.0
"""Seconds the fork server's exit (``ProcessTrees.end_all``) waits at most for its ranks and their trees to be gone;
whoever closes a fork server's control socket should wait a little longer than this before killing it."""


def _prctl(option: int, value: int) -> bool:
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(option, value, 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False  # not Linux


def keep_alive(env: dict[str, str] | None = None) -> dict:
    """``subprocess.Popen`` keyword arguments for a process meant to outlive its rank (a TensorBoard server).

    ``subprocess.Popen(["tensorboard", "--logdir", "runs"], **keep_alive())`` starts it in a session of its own,
    with ``MONARCH_KEEP_ALIVE=1`` in its environment (``env``, default: the rank's), so ending the rank, the mesh or
    the kernel does not end it or what it starts; stop it yourself (``proc.terminate()``, ``kill PID``). Its stdin,
    stdout and stderr are ``/dev/null``: the rank's output pipes close with the rank, and writing to a closed pipe
    would kill it (SIGPIPE); pass ``stdout=open("tb.log", "w")`` after ``**keep_alive()`` to keep its output.

    Returns a dict with ``start_new_session``, ``env``, ``stdin``, ``stdout`` and ``stderr``.
    """
    import subprocess

    base = dict(os.environ if env is None else env)
    base[KEEP_ALIVE_ENV] = "1"
    return {"start_new_session": True, "env": base, "stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL,
            "stderr": subprocess.DEVNULL}


def become_rank(tag: str) -> None:
    """In a freshly forked rank, before any user code: lead a session of its own, die with the fork server, carry
    ``tag`` in the environment that its programs inherit, and drop MONARCH_KEEP_ALIVE from it."""
    try:
        os.setsid()
    except OSError:
        pass  # already a session leader
    _prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    os.environ.pop(KEEP_ALIVE_ENV, None)
    os.environ[TREE_ENV] = tag


class _Proc:
    """What /proc/PID/stat says of a process: its parent, session and state."""

    __slots__ = ("pid", "ppid", "sid", "state")

    def __init__(self, pid: int, ppid: int, sid: int, state: str) -> None:
        self.pid, self.ppid, self.sid, self.state = pid, ppid, sid, state


Doomed = Callable[[_Proc, dict[str, str]], bool]  # (orphan, its environment) -> end its tree?


def _stat(pid: int) -> _Proc | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        return _Proc(pid, int(fields[1]), int(fields[3]), fields[0].decode())
    except (OSError, IndexError, ValueError):
        return None


def _environ(pid: int) -> dict[str, str]:
    """The two variables this module reads from the environment ``pid`` was started with.

    A process whose main thread has exited while others run (a zombie leader: every multithreaded process passes
    through that state when it is killed) shows no environment under /proc/PID; its live threads still do."""
    data = _read(f"/proc/{pid}/environ")
    if not data:
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            tids = []
        for tid in tids:
            data = _read(f"/proc/{pid}/task/{tid}/environ")
            if data:
                break
    out = {}
    for item in data.split(b"\0"):
        for name in (TREE_ENV, KEEP_ALIVE_ENV):
            if item.startswith(name.encode() + b"="):
                out[name] = item[len(name) + 1:].decode(errors="replace")
    return out


def _read(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return b""


def _live(proc: _Proc) -> bool:
    """Whether some thread of ``proc`` still runs: not a zombie, or a zombie leader whose other threads do not
    exit yet (its children hang below one of them, and it is reaped only when the last one is gone)."""
    if proc.state not in ("Z", "X"):
        return True
    try:
        return len(os.listdir(f"/proc/{proc.pid}/task")) > 1
    except OSError:
        return False


def _children_of(pid: int) -> list[int] | None:
    """Direct children of ``pid`` from /proc/PID/task/*/children (None where the kernel does not provide it)."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(c) for c in f.read().split())
        except FileNotFoundError:
            if not os.path.exists(f"/proc/{pid}/task/{tid}"):
                continue  # the thread exited meanwhile
            return None
        except OSError:
            continue
    return out


def _process_table() -> dict[int, _Proc]:
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            proc = _stat(int(entry))
            if proc is not None:
                table[proc.pid] = proc
    return table


class ProcessTrees:
    """The fork server's side: it is a subreaper, and ends the trees of ranks that are gone (module docstring).

    Parameters
    ----------
    pid:
        The fork server's pid (the root of every tree).
    """

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.subreaper = _prctl(PR_SET_CHILD_SUBREAPER, 1)
        self.ended = 0  # processes this object SIGKILLed, over its life (for tests and benchmarks)

    def tag(self, spawn_id: int) -> str:
        """The MONARCH_PROCESS_TREE value of spawn ``spawn_id``."""
        return f"{self.pid}:{spawn_id}"

    def sweep(self, live: dict[int, int], deadline: float = SWEEP_WAIT) -> int:
        """End every orphan tree that belongs to no live rank; returns how many processes it SIGKILLed.

        ``live`` maps the pid of each live rank to its spawn id. Waits up to ``deadline`` seconds for them to die
        (they stay zombies until the caller reaps them with ``os.waitpid``).
        """
        return self._end(lambda proc, env: self._orphan_of_dead_rank(proc, env, live), live, deadline)

    def end_all(self, deadline: float = END_WAIT) -> int:
        """End every process below the fork server, ranks included, but kept ones; reap them. Returns how many
        it SIGKILLed. For the fork server's exit.

        Returns only when every child but the kept ones has been reaped and nothing of theirs is left (a rank's
        threads may outlive its main thread for a while, and what they started comes back here only when the last
        one is gone), or after ``deadline`` seconds (what is stuck in the kernel, state D, may outlast it)."""
        return self._end(lambda proc, env: True, {}, deadline, reap=True)

    def _orphan_of_dead_rank(self, proc: _Proc, env: dict[str, str], live: dict[int, int]) -> bool:
        if proc.sid in live:
            return False
        tag = env.get(TREE_ENV, "")
        return tag not in {self.tag(s) for s in live.values()}

    def _end(self, doomed: Doomed, live: dict[int, int], deadline: float, reap: bool = False) -> int:
        killed: set[int] = set()
        until = time.monotonic() + deadline
        while True:
            if reap:
                _reap_any()
            targets = self._targets(doomed, live)
            targets -= {p for p in killed if _gone(p)}
            # At the exit, a rank that is not reaped yet may still hold children below one of its threads (its
            # main thread is a zombie while the others die); they come back here when the last thread is gone.
            waiting = reap and self._unreaped()
            if not targets and not waiting:
                break
            for pid in targets:
                try:
                    os.kill(pid, signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass
            killed |= targets
            if time.monotonic() > until:
                break
            if targets:
                self._wait_dead(targets, until, reap)
            else:
                time.sleep(0.005)
        self.ended += len(killed)
        return len(killed)

    def _unreaped(self) -> bool:
        """Whether a child of the fork server that is not kept on purpose is still there (alive, or a zombie not
        reaped yet)."""
        children = _children_of(self.pid)
        if children is None:
            children = [p.pid for p in _process_table().values() if p.ppid == self.pid]
        return any(_environ(c).get(KEEP_ALIVE_ENV) != "1" for c in children if _stat(c) is not None)

    @staticmethod
    def _wait_dead(pids: Iterable[int], until: float, reap: bool) -> None:
        left = set(pids)
        while left and time.monotonic() < until:
            if reap:
                _reap_any()
            left = {p for p in left if not _gone(p)}
            if left:
                time.sleep(0.005)

    def _targets(self, doomed: Doomed, live: dict[int, int]) -> set[int]:
        """Pids to end: the trees below orphans (children of the fork server that are not live ranks) for which
        ``doomed(proc, env)`` holds, kept processes and their trees excluded."""
        children = _children_of(self.pid)
        if children is not None and all(c in live for c in children):
            return set()  # the common case: only live ranks below the fork server
        table = _process_table()
        below: dict[int, list[int]] = {}
        for proc in table.values():
            below.setdefault(proc.ppid, []).append(proc.pid)
        targets: set[int] = set()
        for root in below.get(self.pid, []):
            proc = table[root]
            if root in live:
                continue
            env = _environ(root)
            if env.get(KEEP_ALIVE_ENV) == "1" or not doomed(proc, env):
                continue
            stack = [root]
            while stack:
                pid = stack.pop()
                if pid != root and _environ(pid).get(KEEP_ALIVE_ENV) == "1":
                    continue
                if _live(table[pid]):
                    targets.add(pid)
                stack.extend(below.get(pid, []))  # a zombie leader's children hang below its live threads
        return targets


def _gone(pid: int) -> bool:
    proc = _stat(pid)
    return proc is None or not _live(proc)


def _reap_any() -> None:
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
