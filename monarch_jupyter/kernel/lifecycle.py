"""Starting and stopping the ranks of a mesh: one generation at a time.

A generation is one start: a fresh per-mesh secret, ROUTER socket, I/O thread, launcher and process group.

Start (local ranks)
    1. A new secret (32 random bytes) and socket on loopback; the I/O thread starts.
    2. The local fork server forks one rank per rank number, each given its ``RankConfig`` (controller address,
       secret, rank, world size, the options' rank settings) over the fork server's socket, never on a command
       line, and the environment torchrun would give it (``rank_env``).
    3. Each rank says Hello, is welcomed (rank 0 first: it hosts the c10d store on a free port), joins the
       process group and reports Ready. ``wait_started`` waits for all of them, or raises MeshStartError with the
       first failing rank's error and last output; every process started is killed first.

Ranks started elsewhere (launchers "join", "torchrun", "slurm") are admitted by the Listener (launch/listener.py).

Stop: Shutdown to every rank, 3 s, then SIGKILL; cells still running end with RankDiedError ("the mesh was
stopped").
"""

from __future__ import annotations

import atexit
import os
import socket
import time
from typing import Any

from monarch_worker import protocol as P
from monarch_worker.options import rank_settings

from ..errors import MeshNotRunningError, MeshStartError, MonarchError, describe_returncode, mesh_interrupt
from ..ranks import ranks_text
from .cells import CellTable
from .dispatch import Dispatcher
from .iothread import IOThread
from .launch.base import LauncherEvents
from .launch.isolation import without_debugger_env
from .launch.listener import Listener
from .launch.local import LocalLauncher
from .lighthouse import Lighthouse
from .output import OutputWriter, fold_lines
from .routing import OutputRouter
from .segments import Segments
from .state import MeshState, RankState

__all__ = ["Lifecycle", "STOP_GRACE"]

STOP_GRACE = 3.0  # seconds ranks get to exit after Shutdown before they are killed
HOLD = 0.5  # seconds lines of starting ranks are held, so that the same line of many ranks shows once
REPLACEMENT_IMPORTS = ("torch._dynamo", "torchft")
"""What the fork server imports before the first ranks of a self-healing mesh (torchft, on_rank_death="restart"),
so that its ranks and every replacement start with it (one that is not installed is left out): a rank's first
optimizer step imports ``torch._dynamo`` (1.2-1.7 s here, through ``torch._disable_dynamo``), and a replacement
rejoins a torchft loop. Before the first ranks, not once they run: while it imports, the fork server reports no
rank's exit, and a death would be reported that much later. Only for these meshes: on this 2-core machine the two
imports add 1.2 s and 0.3 s to a ``%mesh start`` (bench/bench_core.py: cold start 1.4-1.5 s without them)."""


class Lifecycle:
    """Start, stop and wait for the ranks of one mesh (see the module docstring)."""

    def __init__(self, state: MeshState, io: IOThread, dispatcher: Dispatcher, router: OutputRouter,
                 cells: CellTable, segments: Segments, listener: Listener | None, sink: LauncherEvents,
                 writer: OutputWriter, lighthouse: Lighthouse) -> None:
        self.state = state
        self.io = io
        self.dispatcher = dispatcher
        self.router = router
        self.cells = cells
        self.segments = segments
        self.writer = writer
        self.listener = listener
        self.sink = sink  # what the launcher reports to (deaths.RankEvents)
        self.lighthouse = lighthouse  # torchft's, started with each generation when options.torchft
        self.started_at = 0.0  # time.time() when the mesh was last ready
        self.ready_seconds = 0.0  # seconds the last start took
        self.ended_cells = 0  # cells the last teardown ended with ranks still running them (e.g. --async cells)

    @property
    def joined(self) -> bool:
        """The ranks were started elsewhere and joined (a launcher other than "local")."""
        return self.listener is not None

    # ------------------------------------------------------------------ start

    def start(self, wait: bool | None) -> bool:
        """Start a generation; True when the mesh is running, False when it listens for ranks that others start
        (``wait`` False, the default for launcher "join").

        Raises
        ------
        MeshStartError
            A rank failed to start or to join in time; nothing is left running.
        """
        state = self.state
        if state.running:
            raise MonarchError("this mesh is already running; use restart() for fresh processes")
        t0 = time.monotonic()
        secret = os.urandom(32)
        state.new_generation(secret)
        self.dispatcher.new_generation(secret)
        self.router.new_generation(secret)
        router = self.io.open(secret)
        if self.listener is None:
            port = router.bind_to_random_port("tcp://127.0.0.1")
            state.address = f"tcp://127.0.0.1:{port}"
        self.segments.open()
        self.io.start()
        deadline = t0 + state.options.start_timeout
        if 0 < state.options.output_fold < state.nproc:  # what many ranks print alike while starting shows once
            with state.lock:
                state.held_output = []
        try:
            if state.options.torchft:  # before the ranks: they are started with its address (elastic_env.py)
                self.lighthouse.start()
            state.extra_env = self.lighthouse.env()
            if self.listener is not None:  # ranks that join (launch/listener.py)
                self.listener.use_sink(GenerationEvents(self.sink, state, state.generation))
                state.address = self.listener.open(router, secret)
                state.launcher = self.listener.launch(self.launch_env())
                if wait is None:
                    wait = self.listener.launcher.starts_ranks
                if not wait:
                    return False
                if not self.listener.wait_ready(deadline):
                    raise MeshStartError(f"the mesh did not start within {state.options.start_timeout:g} s; "
                                         f"{self.listener.missing_report()}")
                self.mark_started(t0)
                return True
            state.launcher = LocalLauncher(state.options.start_timeout)
            if state.options.torchft or state.options.on_rank_death == "restart":
                state.launcher.warm(list(REPLACEMENT_IMPORTS))  # before the first ranks: see REPLACEMENT_IMPORTS
            self.spawn(list(range(state.nproc)))
            self.wait_started(deadline)
        except BaseException:
            self.teardown(graceful=False)
            raise
        finally:
            self.release_held(final=True)
        self.mark_started(t0)
        return True

    def release_held(self, final: bool) -> None:
        """Write the lines held while ranks start (``MeshState.held_output``), identical lines of several ranks
        once (``[rank0-999]: frame #3: ...``: a failed start of many ranks prints the same C++ trace on each);
        ``final``: stop holding."""
        with self.state.lock:
            self._release_held(final)

    def _release_held(self, final: bool) -> None:
        """``release_held`` with the lock held (the lines are queued to the writer, not written here)."""
        state = self.state
        state.assert_locked()
        held = state.held_output
        if held is None:
            return
        state.held_output = None if final else []
        if held:
            self.writer.put(fold_lines(held), None)

    def check_running(self, refuse_while_joining: str = "") -> None:
        """Raise MeshNotRunningError unless the ranks are up. A mesh still listening for its ranks is waited for
        (until its start timeout: MeshStartError), or, given ``refuse_while_joining`` (what the caller would do),
        refused at once; an interrupt of that wait is one line (MeshInterrupt), and the mesh listens on."""
        li = self.listener
        if not self.state.running and li is not None and li.is_open:
            if refuse_while_joining and not li.failed:
                raise MeshNotRunningError(f"{refuse_while_joining}: nothing runs on the ranks yet, {li.joined_text()}")
            try:
                self.wait_ready(None)
            except KeyboardInterrupt:
                raise mesh_interrupt(f"interrupted while waiting for the ranks to join: {li.joined_text()}") from None
        self.state.check_running()

    def wait_ready(self, timeout: float | None) -> bool:
        """Wait up to ``timeout`` seconds (None: until the start timeout passed) for every rank of a listening
        mesh to join; True when the mesh is running. Raises MeshStartError (the mesh is stopped then)."""
        state, listener = self.state, self.listener
        if state.running:
            return True
        if listener is None or not listener.is_open:
            raise MeshNotRunningError("this mesh is not running: start it with  %mesh start -n N  (or restart())")
        if timeout is None:  # until the start timeout passed and the report is out
            deadline = listener.deadline + 3 * state.options.heartbeat_interval + 2
        else:
            deadline = time.monotonic() + timeout
        try:
            ready = listener.wait_ready(deadline)
        except MeshStartError:
            self.teardown(graceful=False)
            raise
        if ready:
            self.mark_started(listener.opened_at)
        return ready

    def mark_started(self, t0: float) -> None:
        self.state.running = True
        self.ready_seconds = time.monotonic() - t0
        self.started_at = time.time()
        atexit.register(self.exit_quietly)  # runs before the launcher's own atexit kills the ranks
        self.state.events.emit("started", ready_seconds=self.ready_seconds)

    def spawn(self, ranks: list[int]) -> None:
        """Start processes for ``ranks`` with the current launcher (a local one; joined ranks start elsewhere)."""
        launcher, sink = self.state.launcher, self.sink
        assert launcher is not None
        sink = GenerationEvents(sink, self.state, self.state.generation)
        env = self.rank_env()
        for r in ranks:
            launcher.start(r, env, self.rank_config(r), sink)

    def wait_started(self, deadline: float, only: list[int] | None = None) -> None:
        """Wait until every rank (``only``: these) is idle (joined the process group), or raise MeshStartError for
        the first that failed or, at ``deadline``, for those that did not join."""
        state = self.state
        release_at = time.monotonic() + HOLD
        with state.lock:
            while True:
                infos = [state.ranks[r] for r in only if r in state.ranks] if only is not None else None
                failed = [i for i in (infos or state.ranks.values()) if i.start_error or i.state is RankState.DEAD]
                if failed:
                    info = failed[0]
                    state.cond.release()
                    try:
                        time.sleep(0.2)  # let its last output arrive
                    finally:
                        state.cond.acquire()
                    detail = info.start_error or ""
                    if info.last_lines:
                        detail += "\nits last output:\n" + "\n".join(f"  {line}" for line in info.last_lines)
                    cause = f"; {info.death_reason}" if info.death_reason else ""  # e.g. its fork server died
                    if info.start_error:
                        why = "failed to join"
                    elif info.returncode is None and info.death_reason:  # no exit status: lost (as RankDiedError)
                        why = f"was lost ({info.death_reason})"
                    else:
                        why = f"died ({describe_returncode(info.returncode)}{cause})"
                    raise MeshStartError(f"rank {info.rank} {why} while the mesh was starting", info.rank,
                                         detail.strip("\n"))
                if all(i.state is RankState.IDLE for i in (infos or state.ranks.values())):
                    return
                if state.held_output and time.monotonic() >= release_at:
                    release_at = time.monotonic() + HOLD
                    self._release_held(final=False)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    waiting = [i.rank for i in state.ranks.values() if i.state is not RankState.IDLE]
                    raise MeshStartError(
                        f"{ranks_text(waiting)} did not join within {state.options.start_timeout:g} s; "
                        "raise the start timeout (--timeout) or look at their output above", waiting[0])
                state.cond.wait(min(remaining, 0.1))

    # ------------------------------------------------------------------ what ranks are given

    def launch_env(self) -> dict[str, str]:
        """Environment of an engine that starts joining ranks (torchrun, srun): this one plus ``env``."""
        env = without_debugger_env(os.environ)  # never the kernel's debugpy settings (launch/isolation.py)
        env.update(self.state.extra_env)
        env.update(self.state.options.env)
        for key in ("JPY_PARENT_PID", "MPLBACKEND"):
            env.pop(key, None)
        return env

    def rank_config(self, r: int) -> dict[str, Any]:
        """The RankConfig fields of local rank ``r`` (sent by the launcher)."""
        state = self.state
        return {**rank_settings(state.options), "controller": state.address, "secret": state.secret.hex(),
                "rank": r, "world_size": state.nproc, "local_rank": r, "local_world_size": state.nproc, "env": {}}

    def rank_env(self) -> dict[str, str]:
        """Environment of a local rank: this one, ``env``, and what torchrun would set."""
        env = without_debugger_env(os.environ)  # never the kernel's debugpy settings (launch/isolation.py)
        env.update(self.state.extra_env)  # TORCHFT_LIGHTHOUSE
        env.update(self.state.options.env)
        # As torchrun: one OpenMP thread per rank when several share this host, unless the user chose, so N ranks
        # do not oversubscribe its cores (the rank applies it: monarch_worker.startup.apply_thread_settings).
        if self.state.nproc > 1:
            env.setdefault("OMP_NUM_THREADS", "1")
        # Local ranks talk over loopback; this also silences gloo's hostname-resolution warning.
        env.setdefault("GLOO_SOCKET_IFNAME", _loopback_ifname())
        # torch.distributed's flight recorder: the last collectives of each rank, shown by stack reports
        # (docs/faults.md lists what else helps with hangs). 0 turns it off.
        env.setdefault("TORCH_FR_BUFFER_SIZE", "1024")
        env["MASTER_ADDR"] = "127.0.0.1"
        for key in ("JPY_PARENT_PID", "MPLBACKEND"):
            env.pop(key, None)
        return env

    # ------------------------------------------------------------------ stop

    def exit_quietly(self) -> None:
        """At interpreter exit the ranks die with the fork server: expected, so not reported as deaths."""
        self.state.stopping = True

    def teardown(self, graceful: bool) -> None:
        """End the generation: Shutdown (``graceful``), kill what is left, close the socket, end every cell."""
        state = self.state
        atexit.unregister(self.exit_quietly)
        state.stopping = True
        was_running = state.running
        state.running = False
        self.segments.close()
        launcher = state.launcher
        if graceful and was_running and launcher is not None:
            with state.lock:
                targets = [i.rank for i in state.ranks.values() if i.identity and i.state is not RankState.DEAD]
            for r in targets:
                self.dispatcher.post(r, P.Shutdown())
            launcher.wait(STOP_GRACE)
        if launcher is not None:
            launcher.kill()
            launcher.wait(5.0)
        if self.listener is not None:
            self.listener.reject_pending("the mesh was stopped")
        # Joined ranks may be on other hosts: give Shutdown/Rejected up to 1 s to leave.
        self.io.stop(0 if self.listener is None else 1000)
        with state.lock:
            for info in state.ranks.values():
                if info.state is not RankState.DEAD:
                    info.state = RankState.STOPPED
            self.ended_cells = self.cells.stop_all()
            state.cond.notify_all()
        if self.listener is not None:
            self.listener.close()
        self.lighthouse.stop()


def _loopback_ifname() -> str:
    try:
        for _idx, name in socket.if_nameindex():
            if name == "lo" or name.startswith("lo"):
                return name
    except OSError:
        pass
    return "lo"


class GenerationEvents:
    """A launcher sink for the processes of one generation: their events are dropped once a newer generation has
    started, so the late exit (or last output) of a rank that was stopped never lands on the rank that replaced it.
    (A launcher's ``wait`` can return before its reader thread has delivered the last exit.)"""

    def __init__(self, sink: LauncherEvents, state: MeshState, generation: int) -> None:
        self.sink = sink
        self.state = state
        self.generation = generation

    def on_spawned(self, rank: int, pid: int) -> None:
        if self.state.generation == self.generation:
            self.sink.on_spawned(rank, pid)

    def on_output(self, rank: int, stream: str, data: bytes) -> None:
        if self.state.generation == self.generation:
            self.sink.on_output(rank, stream, data)

    def on_exit(self, rank: int, returncode: int, cause: str = "") -> None:
        if self.state.generation == self.generation:
            self.sink.on_exit(rank, returncode, cause)

