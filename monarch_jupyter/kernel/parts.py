"""The parts of one mesh's controller and how they are wired: the one place that says who talks to whom.

Every part gets the shared ``MeshState`` and the other parts (or the narrow callables) it calls, in its
constructor; none of them sees the ``Mesh``, and none is given anything after it was made. ``build`` makes them in
dependency order: a part is made after everything it calls. What ranks send reaches the part that handles it by the
route its message type declares (``Message.ROUTE``), through one table (``routes``), over the socket on the I/O
thread or as records in a local rank's output, read by the launcher's reader.
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_worker import protocol as P
from monarch_worker.options import MeshOptions

from .cells import CellTable
from .completion import Completions
from .daprelay import DapRelay
from .deaths import Deaths, RankEvents
from .debugger import MeshDebugger
from .dispatch import Dispatcher
from .endpoint import ControllerSocket
from .events import EventBus
from .ftscale import FtScaler
from .healing import REPLAY_TIMEOUT, DeathQueue, Healer
from .history import History
from .interrupts import Interrupter
from .iothread import IOThread
from .launch.capacity import check_host_capacity
from .launch.hosts import HostLinks
from .launch.join import JoinLauncher
from .launch.listener import Listener
from .lifecycle import Lifecycle
from .lighthouse import Lighthouse
from .output import OutputWriter
from .postmortem import Inspector, PostMortem
from .prompts import PromptServer
from .recovery import Restarts
from .releases import Releases
from .resize import Resizer
from .rich import RichRouter
from .routing import OutputRouter
from .segments import Segments
from .stacks import StackRequests
from .state import Handler, MeshState
from .submesh import Splitter
from .transfer import Transfers
from .waiting import Waiter

__all__ = ["Parts", "build"]


@dataclass(frozen=True)
class Parts:
    """The parts of one mesh (each module's docstring says what it owns)."""

    events: EventBus
    state: MeshState
    writer: OutputWriter
    cells: CellTable
    dispatcher: Dispatcher
    stacks: StackRequests
    interrupter: Interrupter
    segments: Segments
    router: OutputRouter
    deaths: Deaths
    listener: Listener | None
    io: IOThread
    lifecycle: Lifecycle
    restarts: Restarts
    releases: Releases
    waiter: Waiter
    transfers: Transfers
    debugger: MeshDebugger
    rich: RichRouter
    completions: Completions
    dap: DapRelay
    history: History
    healer: Healer
    lighthouse: Lighthouse
    resizer: Resizer
    splitter: Splitter


def build(nproc: int, options: MeshOptions, join_launcher: JoinLauncher | None) -> Parts:
    """Make and wire the parts of a mesh of ``nproc`` ranks; ``join_launcher``: None for local ranks.

    Raises ValueError for more ranks than this host can carry (local ranks, or a launcher that starts every rank
    on this host), unless ``options.oversubscribe``."""
    if (join_launcher is None or join_launcher.on_this_host) and not options.oversubscribe:
        check_host_capacity(nproc)
    events = EventBus()
    state = MeshState(nproc, options, events)
    writer = OutputWriter()  # lines nobody waits for, written outside the lock
    cells = CellTable(state, writer)
    dispatcher = Dispatcher(state, cells)
    stacks = StackRequests(state, dispatcher)
    interrupter = Interrupter(state, dispatcher)
    segments = Segments(state, dispatcher, cells)  # shared memory of transfers
    prompts = PromptServer(state, dispatcher, cells, writer)  # pdb prompts of ranks at breakpoint()
    inspector = Inspector(state, dispatcher)  # inspect and clear, off a rank's busy main thread
    rich = RichRouter(state, cells, dispatcher, writer)  # ranks' display(), figures
    completions = Completions(state, dispatcher)  # Tab and Shift-Tab in %%mesh cells
    dap = DapRelay(state, dispatcher)  # the visual debugger's DAP streams to ranks of other hosts
    # What handles each route a rank's message names (Message.ROUTE); the router adds its own (progress).
    routes: dict[str, Handler] = {
        "results": cells.on_result, "stacks": stacks.on_reply, "pull_replies": segments.on_pull_reply,
        "segments": segments.on_release, "debugger": prompts.on_message, "inspections": inspector.on_reply,
        "displays": rich.on_display, "completions": completions.on_reply, "dap": dap.on_message,
    }
    router = OutputRouter(state, cells, writer, routes)
    routes.update({"streams": router.on_stream, "progress": router.on_progress})
    queue = DeathQueue(state)  # ranks that died by themselves, for the healer (on_rank_death="restart")
    deaths = Deaths(state, dispatcher, cells, interrupter, writer, queue.put, queue.admit)
    sink = RankEvents(state, router, deaths, [segments.on_rank_exit, dap.on_rank_exit])  # what launchers report
    socket = ControllerSocket()
    hosts = listener = None
    if join_launcher is not None:  # ranks that join: admitted by the listener, host agents among them
        hosts = HostLinks(state, cells, router, dispatcher, socket, sink, deaths.ranks_lost)
        listener = Listener(state, join_launcher, options.address, options.port, options.encrypt,
                            options.secret_file, hosts.send_to, dispatcher, sink, hosts)
    handlers = {cls: routes[cls.ROUTE] for cls in P.MESSAGE_TYPES.values() if cls.ROUTE}
    lighthouse = Lighthouse(lambda: state.options.torchft_min_replicas,  # torchft's, when options.torchft
                            lambda text: writer.put([(tuple(sorted(state.ranks)), "stderr", text)], None))
    ticks = [deaths.check_heartbeats, segments.idle_tick, lighthouse.check,
             *([listener.check] if listener is not None else [])]
    io = IOThread(state, dispatcher, socket, listener, hosts, handlers, ticks)
    lifecycle = Lifecycle(state, io, dispatcher, router, cells, segments, listener, sink, writer, lighthouse)
    restarts = Restarts(state, dispatcher, cells, interrupter, stacks, lifecycle)
    releases = Releases(state, dispatcher, cells, stacks, restarts.regroup)
    waiter = Waiter(state, dispatcher, cells, writer, stacks, interrupter, deaths, releases, restarts, prompts)
    history = History(state)  # what the notebook sent, for replacements
    transfers = Transfers(state, waiter, segments, hosts.holds if hosts is not None else _not_held, history.pushed)
    debugger = MeshDebugger(prompts, PostMortem(state, waiter, prompts, inspector), inspector)
    healer = Healer(state, queue, cells, dispatcher, restarts, lifecycle, history, writer, waiter.submit,
                    lambda values, rank, device: transfers.push(values, [rank], device, REPLAY_TIMEOUT, "auto"))
    resizer = Resizer(state, restarts, lifecycle, healer,  # %mesh scale: one regroup, as restarts and healing
                      lambda replay: FtScaler(state, cells, dispatcher, restarts, healer, replay))
    return Parts(events, state, writer, cells, dispatcher, stacks, interrupter, segments, router, deaths, listener, io,
                 lifecycle, restarts, releases, waiter, transfers, debugger, rich, completions, dap, history, healer,
                 lighthouse, resizer, Splitter(state, resizer, lifecycle))  # sub-meshes: the same regroup


def _not_held(rank: int) -> bool:
    """No host agent holds any rank of a mesh without agents."""
    return False
