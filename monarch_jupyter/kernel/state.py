"""The state the controller's parts share: ranks, cells, the generation's secret and launcher, one lock.

``MeshState`` is the small explicit object that every part of the controller (cells, dispatch, the I/O thread,
output routing, waiting, recovery, transfers, the debugger) is given instead of the ``Mesh`` itself. Everything
in it that changes is guarded by ``lock`` (``cond`` is its condition: notified when ranks join, die, or answer).

``owner_check`` asserts, at each use of a socket or pipe, that the thread using it is the one that owns it (the
habit of ipykernel's subshell manager).
"""

from __future__ import annotations

import enum
import itertools
import threading
import uuid
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from monarch_worker.options import MeshOptions, rank_settings

from ..errors import MeshNotRunningError
from ..ranks import format_ranks, ranks_text
from .events import EventBus
from .output import StreamSplitter, temp_file_sink
from .records import CellRecord

if TYPE_CHECKING:
    from .launch.base import Launcher

__all__ = ["RankState", "RankInfo", "MeshState", "MeshLock", "LAST_LINES", "owner_check", "Handler"]

Handler = Callable[[int, Any, bytes, list], None]
"""What handles a message a rank sent: (rank, message, payload, buffers); the route of each message type
(``Message.ROUTE``) names one (kernel/parts.py)."""

LAST_LINES = 20  # lines of output kept per rank for death reports


class RankState(enum.StrEnum):
    """Lifecycle of a rank as the controller sees it."""

    STARTING = "starting"
    IDLE = "idle"
    RUNNING = "running"
    DEAD = "dead"
    STOPPED = "stopped"


@dataclass
class RankInfo:
    """Live handle of one rank (mutable; guarded by the mesh lock)."""

    rank: int
    base_state: RankState = RankState.STARTING  # ``state`` as set (IDLE for a rank that runs cells: see ``state``)
    pid: int | None = None
    host: str = ""
    device: str = ""
    backend: str = ""
    identity: bytes | None = None
    returncode: int | None = None
    death_reason: str = ""  # why the controller declared it dead, when it knows better than returncode
    start_error: str = ""
    rss: int = 0  # bytes
    group: str = ""  # backend of the rank's default process group as it last reported it ("" for none)
    cuda_allocated: int = 0  # bytes
    cuda_reserved: int = 0  # bytes
    last_heard: float = 0.0  # time.monotonic() of its last message
    # The mesh's cells in flight (MeshState.pending, shared by every rank's handle): ``cells`` reads it
    pending: dict[int, CellRecord] = field(default_factory=dict, repr=False)
    # The mesh's dead ranks (MeshState.dead_ranks, shared): a superset (a rank's old handle may die after its restart)
    dead: set[int] = field(default_factory=set, repr=False)
    last_lines: deque[str] = field(default_factory=lambda: deque(maxlen=LAST_LINES))
    last_line_cells: deque[int] = field(default_factory=lambda: deque(maxlen=LAST_LINES))  # each line's cell (-1)
    splitters: dict[str, StreamSplitter] = field(default_factory=dict)  # "stdout", "stderr" (MeshState.rank_info)
    progress: tuple | None = None
    progress_seq: int = 0  # Progress.seq of the newest report taken from this rank process
    record_parts: list[bytes] = field(default_factory=list)  # bodies of a record message not complete yet

    @property
    def cells(self) -> list[CellRecord]:
        """The cells submitted to this rank that it has not finished, oldest first (read from the mesh's cells in
        flight, so that a cell's dispatch and end touch no rank's handle)."""
        r = self.rank
        return [c for c in self.pending.values() if c.runs_on(r)]

    @property
    def state(self) -> RankState:
        """Its lifecycle state: RUNNING while it has cells (``cells``), IDLE once they ended."""
        s = self.base_state
        if s is RankState.IDLE:
            r = self.rank
            for c in self.pending.values():
                if c.runs_on(r):
                    return RankState.RUNNING
        return s

    @state.setter
    def state(self, value: RankState) -> None:
        self.base_state = RankState.IDLE if value is RankState.RUNNING else value  # running: idle with cells
        if value is RankState.DEAD:
            self.dead.add(self.rank)
        else:
            self.dead.discard(self.rank)

    @property
    def alive(self) -> bool:
        return self.state not in (RankState.DEAD, RankState.STOPPED)

    def last_output(self, cell_id: int) -> tuple[str, bool]:
        """(its last lines, earlier): the lines cell ``cell_id`` wrote, or else (``earlier`` True) those of the
        cells before it, so that a death report never passes earlier output off as the dying cell's."""
        own = [line for line, c in zip(self.last_lines, self.last_line_cells, strict=True) if c == cell_id]
        return ("\n".join(own), False) if own else ("\n".join(self.last_lines), bool(self.last_lines))


class MeshLock:
    """The mesh's one lock: a plain ``threading.Lock`` that knows which thread holds it.

    Methods that need it assert so (``MeshState.assert_locked``) instead of saying it in prose, and a thread that
    takes it a second time gets ``RuntimeError`` at once instead of a deadlock (it is not reentrant, so that
    every taking of it is visible in the code that does it). ``threading.Condition`` works on it (``_is_owned``).
    """

    __slots__ = ("_lock", "_owner")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._owner: int | None = None  # threading.get_ident() of the holder

    def acquire(self, blocking: bool = True, timeout: float = -1) -> bool:
        """Take the lock (as ``threading.Lock.acquire``). Raises RuntimeError when this thread holds it already."""
        me = threading.get_ident()
        if self._owner == me:
            raise RuntimeError("the mesh lock is not reentrant, and this thread holds it already")
        if not self._lock.acquire(blocking, timeout):
            return False
        self._owner = me
        return True

    def release(self) -> None:
        self._owner = None
        self._lock.release()

    def held(self) -> bool:
        """The calling thread holds the lock."""
        return self._owner == threading.get_ident()

    _is_owned = held  # what threading.Condition asks of its lock

    def __enter__(self) -> bool:
        return self.acquire()

    def __exit__(self, *exc: object) -> None:
        self.release()


BY_HOST = -2
"""``MeshState.local_world`` for ranks on several hosts regrouped by a split or merge: a rank's LOCAL_RANK is its
index among its group's ranks on its host (as torchrun numbers them), LOCAL_WORLD_SIZE their number."""


class MeshState:
    """What the parts of one mesh share (see the module docstring). Attributes that change are guarded by
    ``lock``; ``options``, ``events`` and ``ids`` are set once, ``nproc`` changes only in a resize (resize.py,
    under the lock, with no cell running)."""

    def __init__(self, nproc: int, options: MeshOptions, events: EventBus) -> None:
        self.nproc = nproc
        self.options = options
        self.events = events
        self.lock = MeshLock()
        self.cond = threading.Condition(self.lock)  # type: ignore[arg-type]  # a lock with what Condition needs
        self.ids = itertools.count(1)  # cell, call and request ids: unique for the mesh's lifetime
        self.ranks: dict[int, RankInfo] = {}
        self.cells: dict[int, CellRecord] = {}  # cells some rank has not finished (and blocking ones not yet read)
        # Cells some rank still runs, in the order they were sent (RankInfo.cells reads it; the cell table writes it)
        self.pending: dict[int, CellRecord] = {}
        self.dead_ranks: set[int] = set()  # ranks whose state is DEAD, and maybe some restarted since (RankInfo.state)
        self.last_cell: CellRecord | None = None  # output that belongs to no cell goes there
        self.recent_cells: dict[int, CellRecord] = {}  # the last cells submitted, ended or not (late displays)
        self.running = False
        self.stopping = False  # exits now are expected (stop, restart): not reported as deaths
        self.launcher: Launcher | None = None
        self.secret = b""
        self.address = ""  # where ranks connect (tcp://...)
        self.store_port: int | None = None  # the c10d store rank 0 hosts for this generation
        # rank -> why its process group (the mesh's; split: its sub-mesh's) is broken; absent when it is fine
        self.down: dict[int, str] = {}
        self.regrouping: set[int] = set()  # surviving ranks that get Regroup once the new store is up
        # a regroup runs (recovery.py): fresh ranks get the new store, never the last one (also with no survivor)
        self.regroup_active = False
        self.killing: dict[int, str] = {}  # rank -> why the controller killed it on purpose
        # LOCAL_WORLD_SIZE a Regroup gives survivors (-1: their own; resize.py sets it; BY_HOST: numbered per host)
        self.local_world = -1
        self.group_world = -1  # GROUP_WORLD_SIZE a Regroup gives (-1: unchanged; resize.py sets it when a host came)
        self.resizing = False  # a %mesh scale runs (resize.py): other scales are refused
        self.growing: set[int] = set()  # new ranks of a scale, in no process group yet: their death breaks none
        # Sub-meshes (submesh.py): the groups of global ranks, each its own default process group; None: one group
        self.partition: list[list[int]] | None = None
        self.sub_names: list[str] = []  # the sub-meshes' names, one per group of ``partition`` (submesh.py)
        # Self-healing (kernel/healing.py): ranks being restarted after they died (cells for them wait), the thread
        # that restarts them (its own cells do not wait), and replacements welcomed without a process group (the
        # others run a cell they rejoin; a Regroup makes the group once it ended).
        self.healing: set[int] = set()
        self.healer: threading.Thread | None = None
        self.solo: set[int] = set()
        self.healed_note = ""  # what the last healing said (repeated to a cell that waited for it)
        self.extra_env: dict[str, str] = {}  # what every rank of this generation gets besides ``options.env``
        self.generation = 0  # counts starts and restarts
        self.run_id = str(uuid.uuid4())  # torchrun's TORCHELASTIC_RUN_ID of ranks it did not start (one per mesh)
        # rank -> (cell id, order) of its last failed cell, for post-mortem (CellTable.on_result keeps it)
        self.failures: dict[int, tuple[int, int]] = {}
        # Lines of ranks that belong to no cell, held while a start of many ranks runs, to be shown folded
        # (identical lines of several ranks once: Lifecycle.release_held); None: written as they come.
        self.held_output: list[tuple[int, str, Any]] | None = None
        # Ranks of cells that ended with an error or an interrupt since their process group's collective numbers
        # were last compared (Restarts.check_alignment): one may have left a collective issued and not waited for.
        self.unaligned: set[int] = set()
        # Ranks whose process group a release tore down (releases.py) while a rank of it still ran the cell, so that
        # no fresh one was made then: Restarts.check_alignment makes it before their next cell.
        self.unrenewed: set[int] = set()

    def new_generation(self, secret: bytes) -> None:
        """Fresh rank handles and secret for a start or restart (under no lock: nothing else runs yet)."""
        self.secret = secret
        self.generation += 1
        self.failures = {}
        self.pending.clear()
        self.dead_ranks.clear()
        self.ranks = {r: self.rank_info(r) for r in range(self.nproc)}
        self.store_port = None
        self.down = {}
        self.unaligned = set()
        self.unrenewed = set()
        self.regrouping = set()
        self.regroup_active = False
        self.killing = {}
        self.local_world = -1
        self.partition = None
        self.healing, self.solo, self.growing = set(), set(), set()
        self.stopping = False

    def group_of(self, rank: int) -> list[int]:
        """The global ranks of ``rank``'s default process group: its sub-mesh's (submesh.py), else the mesh's."""
        for group in self.partition or ():
            if rank in group:
                return group
        return list(range(self.nproc))

    def host_local(self, rank: int, group: list[int]) -> tuple[int, int]:
        """(local rank, local world size) of ``rank`` in ``group`` (global ranks), counting the group's ranks on the
        host ``rank`` is on (``RankInfo.host``), in rank order: torchrun's LOCAL_RANK and LOCAL_WORLD_SIZE."""
        host = self.ranks[rank].host
        same = [r for r in group if r in self.ranks and self.ranks[r].host == host]
        return same.index(rank), len(same)

    def peers(self, ranks: Sequence[int]) -> list[int]:
        """Every rank that shares a default process group with one of ``ranks`` (sorted)."""
        if not self.partition:
            return list(range(self.nproc)) if ranks else []
        return sorted({p for r in ranks for p in self.group_of(r)})

    def assert_locked(self) -> None:
        """Assert that the calling thread holds ``lock`` (at the top of every method that needs it held)."""
        assert self.lock.held(), "called without the mesh lock, which it needs held"

    def assert_unlocked(self) -> None:
        """Assert that the calling thread does not hold ``lock`` (at the top of every method that waits, sends or
        writes: what must never happen under it)."""
        assert not self.lock.held(), "called with the mesh lock held, which it must not be"

    def rank_info(self, rank: int) -> RankInfo:
        """A fresh handle of ``rank``, its output splitters cutting lines at ``options.output_line_limit`` bytes
        (the whole line goes to a file: monarch_worker.streams)."""
        limit = self.options.output_line_limit
        self.dead_ranks.discard(rank)
        return RankInfo(rank, pending=self.pending, dead=self.dead_ranks, splitters={
            stream: StreamSplitter(records=stream == "stdout", line_limit=limit,
                                   sink=temp_file_sink(f"monarch-rank{rank}-{stream}-"))
            for stream in ("stdout", "stderr")})

    def rank_settings(self) -> dict[str, Any]:
        """The RankConfig fields a rank that joins is sent (monarch_worker.options.rank_settings), ``extra_env``
        (the torchft Lighthouse's address) in its ``env``."""
        settings = rank_settings(self.options)
        settings["env"] = {**self.extra_env, **settings["env"]}
        return settings

    def status(self) -> dict[int, dict[str, Any]]:
        """rank -> {"state", "pid", "host", "device", "rss", "cuda_allocated", "cuda_reserved" (bytes),
        "returncode", "backend", "group"}; "group" is the backend of the rank's default process group as the rank
        last reported it (at most ``heartbeat_interval`` seconds ago), "" when it has none."""
        with self.lock:
            return {
                r: {"state": i.state.value, "pid": i.pid, "host": i.host, "device": i.device, "rss": i.rss,
                    "cuda_allocated": i.cuda_allocated, "cuda_reserved": i.cuda_reserved,
                    "returncode": i.returncode, "backend": i.backend, "group": i.group}
                for r, i in self.ranks.items()
            }

    def group_status(self) -> str:
        """The process group as it is: "up (gloo, 4 of 4 ranks)" (split: "...; split into sub-meshes left (ranks
        0,1: idle) | right (ranks 2,3: running cell 7)": each sub-mesh's name, its ranks and what they run), "down:
        rank 1 died; ..." (the controller tore it down, or ranks report having none), or "none: the mesh is not
        running"."""
        with self.lock:
            if not self.running:
                return "none: the mesh is not running"
            if self.down:
                whole = len(self.down) == self.nproc
                return f"down{'' if whole else f' for {ranks_text(sorted(self.down))}'}: {self.group_down}"
            joined = [i for i in self.ranks.values() if i.state in (RankState.IDLE, RankState.RUNNING)]
            missing = [i.rank for i in joined if not i.group]
            if missing:
                return (f"down on {ranks_text(missing)}: no default process group there (collectives fail); "
                        "%mesh restart  makes a fresh mesh")
            backends = sorted({i.group for i in joined})
            split = f"; split into sub-meshes {' | '.join(self._sub_status())}" if self.partition else ""
            return f"up ({', '.join(backends) or '?'}, {len(joined)} of {self.nproc} ranks{split})"

    def _sub_status(self) -> list[str]:
        """Under ``lock``, split: each sub-mesh as "left (ranks 0,1: idle)" or "right (ranks 2,3: running cell 7)"
        ("cell 8, call of train" for a call): its name, its mesh ranks, and the cells its ranks run now (not the
        package's own background work)."""
        out = []
        for i, group in enumerate(self.partition or ()):
            name = self.sub_names[i] if i < len(self.sub_names) else f"sub{i}"
            cells = [c for c in self.pending.values()
                     if not c.background and any(c.runs_on(r) for r in group)]
            doing = ", ".join(f"cell {c.cell_id}" + ("" if c.what == "the cell" else f" ({c.what})") for c in cells)
            out.append(f"{name} (ranks {format_ranks(group)}: {'running ' + doing if cells else 'idle'})")
        return out

    def elastic(self, group_rank: int, group_world_size: int) -> dict[str, Any]:
        """Welcome's ``elastic`` field: the torchrun values only the controller knows (monarch_worker.elastic_env)."""
        return {"group_rank": group_rank, "group_world_size": group_world_size, "run_id": self.run_id}

    def describe(self) -> str:
        """"world_size=4 backend=gloo (idle: 0-3)", or "4 ranks: not started" (a snapshot, for ``repr(mesh)``)."""
        ranks = self.ranks
        if not ranks:
            return f"{self.nproc} ranks: not started"
        states: dict[str, list[int]] = {}
        for r, i in list(ranks.items()):
            states.setdefault(i.state.value, []).append(r)
        backend = next((i.backend for i in ranks.values() if i.backend), self.options.backend)
        summary = ", ".join(f"{s}: {format_ranks(rs)}" for s, rs in states.items())
        return f"world_size={self.nproc} backend={backend} ({summary})"

    def check_running(self) -> None:
        """Raise MeshNotRunningError unless the ranks are up."""
        if not self.running:
            raise MeshNotRunningError("this mesh is not running: start it with  %mesh start -n N  "
                                      "(or mesh.start() / mesh.restart())")

    @property
    def group_down(self) -> str:
        """Why process groups are broken ("" when every one is fine): each reason once."""
        return "; ".join(dict.fromkeys(self.down.values()))

    @group_down.setter
    def group_down(self, why: str) -> None:
        """Every rank's group is broken (``why``), or, with "", fine."""
        self.down = dict.fromkeys(range(self.nproc), why) if why else {}

    def mark_down(self, ranks: Iterable[int], why: str) -> None:
        """Under the lock: the process groups of ``ranks`` (whole groups: ``peers``) are broken, ``why``."""
        self.assert_locked()
        for r in ranks:
            self.down[r] = why
            self.unaligned.discard(r)  # a fresh group comes: nothing of this one is paired any more

    def mark_up(self, ranks: Iterable[int]) -> None:
        """Under the lock: ``ranks`` are in a fresh process group."""
        self.assert_locked()
        for r in ranks:
            self.down.pop(r, None)
            self.unaligned.discard(r)
            self.unrenewed.discard(r)

    def down_for(self, ranks: Iterable[int]) -> str:
        """Under the lock: why the process group of some of ``ranks`` is broken ("" when theirs are fine)."""
        self.assert_locked()
        if not self.down:  # the usual case: no step per rank
            return ""
        return "; ".join(dict.fromkeys(self.down[r] for r in ranks if r in self.down))

    def stuck(self, ranks: Sequence[int]) -> list[int]:
        """Under the lock: those of ``ranks`` that still run a cell that was interrupted or timed out and did not
        stop (not those that had not started it: they skip it)."""
        self.assert_locked()
        return [r for r in ranks if r in self.ranks and any(
            c.abandoned and r not in c.finished and r not in c.queued_on for c in self.ranks[r].cells)]

    def dead(self) -> list[int]:
        """Ranks whose process is gone (under the lock or not: a snapshot)."""
        with self.lock:
            return [r for r, i in self.ranks.items() if i.state is RankState.DEAD]


def owner_check(owner: Callable[[], threading.Thread | None], what: str) -> None:
    """Assert that the calling thread is ``owner()`` (the thread that owns ``what``: a socket, a pipe)."""
    thread = owner()
    assert thread is None or thread is threading.current_thread(), (
        f"{what} is owned by thread {thread.name!r}, used from {threading.current_thread().name!r}")
