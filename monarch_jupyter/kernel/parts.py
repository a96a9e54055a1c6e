"""The parts of one mesh's controller and how they are wired: the one place that says who talks to whom.

Every part gets the shared ``MeshState`` and the other parts it calls, explicitly, in its constructor; none of
them sees the ``Mesh``. ``build`` makes them in dependency order and registers who handles which message from the
ranks (over the socket on the I/O thread, or as records in a local rank's output, read by the launcher's reader).
"""

from __future__ import annotations

from dataclasses import dataclass

from monarch_worker import protocol as P
from monarch_worker.options import MeshOptions

from .cells import CellTable
from .completion import Completions
from .debugger import MeshDebugger
from .dispatch import Dispatcher
from .events import EventBus
from .iothread import IOThread
from .launch.capacity import check_host_capacity
from .launch.hosts import HostLinks
from .launch.join import JoinLauncher
from .launch.listener import Listener
from .lifecycle import Lifecycle
from .recovery import RankEvents, Recovery
from .rich import RichRouter
from .routing import OutputRouter
from .stacks import StackRequests
from .state import MeshState
from .transfer import Transfers
from .waiting import Waiter

__all__ = ["Parts", "build"]


@dataclass(frozen=True)
class Parts:
    """The parts of one mesh (each module's docstring says what it owns)."""

    events: EventBus
    state: MeshState
    dispatcher: Dispatcher
    cells: CellTable
    stacks: StackRequests
    transfers: Transfers
    listener: Listener | None
    io: IOThread
    router: OutputRouter
    lifecycle: Lifecycle
    recovery: Recovery
    waiter: Waiter
    debugger: MeshDebugger
    rich: RichRouter
    completions: Completions


def build(nproc: int, options: MeshOptions, join_launcher: JoinLauncher | None) -> Parts:
    """Make and wire the parts of a mesh of ``nproc`` ranks; ``join_launcher``: None for local ranks.

    Raises ValueError for more local ranks than this host can carry, unless ``options.oversubscribe``."""
    if join_launcher is None and not options.oversubscribe:
        check_host_capacity(nproc)
    events = EventBus()
    state = MeshState(nproc, options, events)
    dispatcher = Dispatcher(state)
    cells = CellTable(state)
    stacks = StackRequests(state, dispatcher)
    transfers = Transfers(state, dispatcher, cells)
    o = options
    listener = (None if join_launcher is None else
                Listener(state, join_launcher, o.address, o.port, o.encrypt, o.secret_file))
    io = IOThread(state, dispatcher, listener)
    router = OutputRouter(state, cells)
    hosts = None if listener is None else HostLinks(state, cells, router, dispatcher)  # host agents
    io.links = hosts
    lifecycle = Lifecycle(state, io, dispatcher, router, cells, transfers, listener)
    recovery = Recovery(state, dispatcher, stacks, lifecycle)
    lifecycle.sink = sink = RankEvents(state, router, recovery, [transfers.on_rank_exit])
    waiter = Waiter(state, dispatcher, stacks, recovery)
    transfers.waiter = waiter
    debugger = MeshDebugger(state, dispatcher, waiter)  # breakpoint(), post-mortem, inspect
    waiter.prompts = debugger
    rich = RichRouter(state, cells, dispatcher)  # ranks' display(), figures
    completions = Completions(state, dispatcher)  # Tab and Shift-Tab in %%mesh cells
    # What ranks send over the socket (I/O thread) ...
    for kind, handler in ((P.Result, cells.on_result), (P.Stacks, stacks.on_reply), (P.Stream, router.on_stream),
                          (P.PullReply, transfers.on_pull_reply), (P.ShmRelease, transfers.on_release),
                          (P.DebugOutput, debugger.on_message), (P.DebugPrompt, debugger.on_message),
                          (P.DebugResumed, debugger.on_message), (P.DebugReply, debugger.on_message),
                          (P.Display, rich.on_display), (P.CompleteReply, completions.on_reply)):
        io.handle(kind, handler)
    # ... and as records in a local rank's stdout pipe (protocol.record_types; the output reader thread).
    router.record_handlers.update({P.Result: cells.on_result, P.Progress: io.on_progress,
                                   P.DebugOutput: debugger.on_message, P.DebugPrompt: debugger.on_message,
                                   P.DebugResumed: debugger.on_message, P.Display: rich.on_display})
    io.every_interval(recovery.check_heartbeats)
    io.every_interval(transfers.idle_tick)
    if listener is not None and hosts is not None:
        io.every_interval(listener.check)
        listener.attach(io.send_to, dispatcher, sink)
        listener.hosts = hosts
        hosts.attach(io.send_to, sink, recovery.ranks_lost)
        transfers.agent_held = hosts.holds
    return Parts(events, state, dispatcher, cells, stacks, transfers, listener, io, router, lifecycle, recovery,
                 waiter, debugger, rich, completions)
