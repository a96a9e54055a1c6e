"""Every message of the wire protocol, as a frozen dataclass in one registry (``MESSAGE_TYPES``).

Framing and signing live in ``monarch_worker.protocol``, which re-exports these classes: everything
else sends and receives them as ``protocol.Exec``, ``protocol.Result``, ...
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "PROTOCOL_VERSION", "Message", "MESSAGE_TYPES", "Hello", "Welcome", "StoreReady", "Ready", "StartFailed",
    "Exec", "Call", "Interrupt", "StacksRequest", "Abort", "Regroup", "Replicas", "Ping", "Rejected", "Shutdown",
    "Result", "Stream", "Stacks", "Progress", "Heartbeat", "Push", "Pull", "PullReply", "ShmRelease", "DebugOutput",
    "DebugPrompt", "DebugResumed", "DebugInput", "DebugPostMortem", "Inspect", "DebugClear", "DebugReply",
    "Goodbye", "Display", "Complete", "CompleteReply", "register", "NO_GROUP",
]

#: Welcome's ``master_port`` for a rank that joins no process group now: a replacement started while the others run
#: a cell it rejoins (kernel/healing.py); a Regroup makes the group once that cell has ended.
NO_GROUP = -2

PROTOCOL_VERSION = 8  # checked at the handshake (Hello, AgentHello); raise it when a message changes

# ``payload`` fields carry user values and travel pickled outside the header.


@dataclass(frozen=True)
class Message:
    """Base of every message. ``TYPE`` is the wire name; ``payload`` (if any) is sent pickled."""

    TYPE: ClassVar[str] = ""
    #: A rank's message to the controller: the controller's route that handles it (the kernel's parts.py maps each
    #: route to one handler); "" for messages the controller sends or the handshake handles itself.
    ROUTE: ClassVar[str] = ""
    #: A rank's main thread may send it as a record behind its output in its stdout pipe (protocol.record_types).
    RECORD: ClassVar[bool] = False
    #: The controller sends it through a rank's work pipe, straight to the main thread (protocol.work_types).
    WORK: ClassVar[bool] = False


MESSAGE_TYPES: dict[str, type[Message]] = {}


def _register(cls: type[Message]) -> type[Message]:
    if not cls.TYPE or cls.TYPE in MESSAGE_TYPES:
        raise TypeError(f"message type {cls.TYPE!r} of {cls.__name__} is empty or registered twice")
    MESSAGE_TYPES[cls.TYPE] = cls
    return cls


# ---- handshake and rendezvous (rank -> controller unless noted)


@_register
@dataclass(frozen=True)
class Hello(Message):
    """First message of a rank. ``rank`` is -1 when the launcher lets the controller assign it."""

    TYPE: ClassVar[str] = "hello"
    rank: int
    pid: int
    host: str
    version: int = PROTOCOL_VERSION
    local_rank: int = -1
    local_world_size: int = -1
    world_size: int = -1
    launcher_env: dict = field(default_factory=dict)


@_register
@dataclass(frozen=True)
class Welcome(Message):
    """Controller -> rank: accepted.

    ``master_port`` 0 asks this rank (rank 0) to host the rendezvous store (a c10d TCPStore) on
    ``master_addr``, or, when ``master_addr`` is empty, on its own address toward the controller, and to answer
    ``StoreReady``; -1 means the launcher's own rendezvous (MASTER_ADDR/MASTER_PORT in the rank's environment,
    torch's ``env://``); ``NO_GROUP`` (-2): join no process group now (a ``Regroup`` follows). ``settings`` are
    RankConfig fields a joined rank takes from the controller (backend,
    timeouts, env). ``elastic``: what torchrun's agent would export that only the controller knows
    (``group_rank``, ``group_world_size``: this rank's host among the mesh's hosts; ``run_id``), see
    monarch_worker.elastic_env.
    """

    TYPE: ClassVar[str] = "welcome"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    settings: dict = field(default_factory=dict)
    elastic: dict = field(default_factory=dict)


@_register
@dataclass(frozen=True)
class StoreReady(Message):
    """Rank 0 -> controller: the c10d TCPStore listens on ``port`` of ``addr`` (the other ranks' MASTER_ADDR)."""

    TYPE: ClassVar[str] = "store_ready"
    port: int
    addr: str = ""


@_register
@dataclass(frozen=True)
class Ready(Message):
    """The rank's process group is up; it waits for work."""

    TYPE: ClassVar[str] = "ready"
    device: str
    backend: str
    host: str
    pid: int


@_register
@dataclass(frozen=True)
class StartFailed(Message):
    """The rank could not join (error text is the formatted exception)."""

    TYPE: ClassVar[str] = "start_failed"
    error: str


# ---- work (controller -> rank)


@_register
@dataclass(frozen=True)
class Exec(Message):
    """Run ``code`` (a cell) in the rank's persistent namespace.

    ``payload`` is a dict of notebook-defined functions and classes the cell refers to; ``sources`` maps their
    file names to source lines so tracebacks on the rank show them.
    """

    TYPE: ClassVar[str] = "exec"
    WORK: ClassVar[bool] = True
    cell_id: int
    code: str
    filename: str
    sources: dict = field(default_factory=dict)
    payload: Any = None


@_register
@dataclass(frozen=True)
class Call(Message):
    """Run ``payload = (fn, args, kwargs)`` on the rank; the result comes back as a ``Result``."""

    TYPE: ClassVar[str] = "call"
    WORK: ClassVar[bool] = True
    cell_id: int
    sources: dict = field(default_factory=dict)
    payload: Any = None


@_register
@dataclass(frozen=True)
class Interrupt(Message):
    """Raise KeyboardInterrupt in the rank's main thread if it still runs ``cell_id``."""

    TYPE: ClassVar[str] = "interrupt"
    cell_id: int


@_register
@dataclass(frozen=True)
class StacksRequest(Message):
    """Ask for the Python stack of the rank's main thread (answered by its I/O thread)."""

    TYPE: ClassVar[str] = "stacks_request"
    request_id: int


@_register
@dataclass(frozen=True)
class Abort(Message):
    """The process group is broken (``reason``, e.g. "rank 2 died (signal SIGKILL)"); leave it.

    The rank's I/O thread aborts the group's communicators where the backend can (NCCL), which releases a main
    thread blocked in a collective; the main thread destroys the process group as soon as it is free, which
    closes its connections and so releases peers blocked in gloo collectives with it. Namespaces are kept.
    """

    TYPE: ClassVar[str] = "abort"
    reason: str


@_register
@dataclass(frozen=True)
class Replicas(Message):
    """Controller -> rank, answered by its I/O thread even while a cell runs: the torchft replica groups of the mesh
    are now ``groups`` (``%mesh scale`` under a running torchft loop, kernel/ftscale.py); the rank sets
    ``NUM_REPLICA_GROUPS`` where set. Its default process group is made again later (a ``Regroup``)."""

    TYPE: ClassVar[str] = "replicas"
    groups: int


@_register
@dataclass(frozen=True)
class Regroup(Message):
    """Controller -> surviving rank: join a fresh process group (after ``Abort``, or to admit restarted ranks).

    Fields as in ``Welcome`` (``local_rank``/``local_world_size`` -1: keep this rank's own); ``master_port`` 0
    asks this rank (rank 0) to host a new TCPStore (on ``master_addr``, or its address toward the controller
    when empty) and answer ``StoreReady``. ``group_world_size``: the number of hosts, when a ``%mesh scale``
    admitted one (torchrun's GROUP_WORLD_SIZE; -1: unchanged). The rank answers ``Ready`` (or ``StartFailed``),
    keeping its namespace.
    """

    TYPE: ClassVar[str] = "regroup"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str
    group_world_size: int = -1


@_register
@dataclass(frozen=True)
class Ping(Message):
    """Controller heartbeat; a rank that hears nothing for its heartbeat window exits."""

    TYPE: ClassVar[str] = "ping"


@_register
@dataclass(frozen=True)
class Rejected(Message):
    """Controller -> joining rank: not admitted (``reason`` says why and what to do); the rank exits."""

    TYPE: ClassVar[str] = "rejected"
    reason: str


@_register
@dataclass(frozen=True)
class Shutdown(Message):
    """Leave the process group and exit."""

    TYPE: ClassVar[str] = "shutdown"
    WORK: ClassVar[bool] = True


# ---- results and events (rank -> controller)


@_register
@dataclass(frozen=True)
class Result(Message):
    """Outcome of an ``Exec`` or ``Call``.

    ``status`` is "ok" or "error". On "ok", ``payload`` is the value of the cell's last expression (or the
    call's return value) and ``has_value`` says whether there was one. On "error", ``error`` holds
    ``{"type", "module", "message", "traceback", "interrupted", "frames"}`` (frames: the traceback as
    (filename, lineno, function, source line), outermost first).
    """

    TYPE: ClassVar[str] = "result"
    ROUTE: ClassVar[str] = "results"
    RECORD: ClassVar[bool] = True
    cell_id: int
    status: str
    has_value: bool = False
    error: dict | None = None
    duration: float = 0.0
    payload: Any = None


@_register
@dataclass(frozen=True)
class Stream(Message):
    """Raw output bytes of a rank (``name`` is "stdout" or "stderr") relayed by the rank itself."""

    TYPE: ClassVar[str] = "stream"
    ROUTE: ClassVar[str] = "streams"
    name: str
    data: str


@_register
@dataclass(frozen=True)
class Stacks(Message):
    """Reply to ``StacksRequest``: ``frames`` is a list of (filename, lineno, function, source line).

    ``collective`` describes the last collective this rank issued, from torch.distributed's flight recorder
    (``{"name", "seq", "group", "state"}``; empty when the recorder is off): ranks of a hung mesh that show
    different sequence numbers are the ones that skipped or added a collective.
    """

    TYPE: ClassVar[str] = "stacks"
    ROUTE: ClassVar[str] = "stacks"
    request_id: int
    cell_id: int
    frames: list
    state: str
    collective: dict = field(default_factory=dict)  # last collective in torch's flight recorder, if enabled


@_register
@dataclass(frozen=True)
class Progress(Message):
    """Progress of a loop in the rank (``monarch_worker.progress`` or tqdm).

    ``n`` of ``total`` steps (``total`` None: unknown); ``postfix`` is shown after the count ("loss=0.25").
    ``seq`` numbers the reports of one rank process from 1 (0: not numbered); a report may travel as a record in
    the rank's output or on its socket, and the controller drops one older than the newest it has. ``metrics``:
    the numbers among ``progress()``'s keyword metrics, as (name, float) pairs, unrounded (sweeps report them to
    Optuna; the postfix shows them rounded).
    """

    TYPE: ClassVar[str] = "progress"
    ROUTE: ClassVar[str] = "progress"
    RECORD: ClassVar[bool] = True
    cell_id: int
    n: float
    total: float | None
    desc: str = ""
    postfix: str = ""
    seq: int = 0
    metrics: tuple = ()


@_register
@dataclass(frozen=True)
class Heartbeat(Message):
    """Rank -> controller: alive. Memory in bytes: ``rss`` (resident set size of the process) and, once the rank
    uses CUDA, ``cuda_allocated`` / ``cuda_reserved`` (torch's caching allocator on the rank's device). ``group``:
    the backend of the rank's default process group ("" when it has none)."""

    TYPE: ClassVar[str] = "heartbeat"
    rss: int = 0
    cuda_allocated: int = 0
    cuda_reserved: int = 0
    group: str = ""


# ---- transfers of values between the notebook and the ranks (see monarch_worker.transfer)


@_register
@dataclass(frozen=True)
class Push(Message):
    """Controller -> rank: bind values in the rank's namespace (``%mesh push`` and ``%mesh scatter``).

    ``items`` holds one dict per value: ``{"name", "pickle": its pickle's byte length in the payload, "nbufs":
    its number of out-of-band buffers on the socket, "shm": a segment descriptor (monarch_worker.shm) or None,
    "bcast": None or {"src", "group", "layout", "size"} when the bytes come from rank ``src`` by a
    torch.distributed broadcast}``. The payload frame is the items' pickles, concatenated; the buffers follow.
    ``device``: None (as received, on the CPU), "rank" (the rank's own device) or a torch device string.
    Answered by a ``Result`` without value once every name is bound.
    """

    TYPE: ClassVar[str] = "push"
    WORK: ClassVar[bool] = True
    cell_id: int
    items: list
    device: str | None = None
    payload: Any = None


@_register
@dataclass(frozen=True)
class Pull(Message):
    """Controller -> rank: send back the value bound to ``name``; ``shm``: the reply may use shared memory."""

    TYPE: ClassVar[str] = "pull"
    WORK: ClassVar[bool] = True
    cell_id: int
    name: str
    shm: bool = False


@_register
@dataclass(frozen=True)
class PullReply(Message):
    """Rank -> controller: the outcome of a ``Pull``, as a ``Result`` (same ``status``/``error``/``duration``).

    On "ok" the payload is the value's pickle; its out-of-band buffers follow on the socket, or lie in the shared
    memory segment described by ``shm`` (then the controller releases it with ``ShmRelease`` when it drops them).
    """

    TYPE: ClassVar[str] = "pull_reply"
    ROUTE: ClassVar[str] = "pull_replies"
    cell_id: int
    status: str
    error: dict | None = None
    duration: float = 0.0
    shm: dict | None = None
    payload: Any = None


@_register
@dataclass(frozen=True)
class ShmRelease(Message):
    """Either direction: the sender no longer maps the shared memory segments ``ids`` that the receiver wrote."""

    TYPE: ClassVar[str] = "shm_release"
    ROUTE: ClassVar[str] = "segments"
    ids: list


# ---- debugging (see monarch_worker.debugger and monarch_jupyter.kernel.debugger)


@_register
@dataclass(frozen=True)
class DebugOutput(Message):
    """Rank -> controller: text pdb wrote on the rank (complete lines, or what came before a prompt)."""

    TYPE: ClassVar[str] = "debug_output"
    ROUTE: ClassVar[str] = "debugger"
    RECORD: ClassVar[bool] = True
    text: str


@_register
@dataclass(frozen=True)
class DebugPrompt(Message):
    """Rank -> controller: the rank's pdb waits for one line of input, answered by ``DebugInput(prompt_id)``.

    ``kind`` is "pdb" (a pdb command) or "interact" (a line for pdb's ``interact`` console); the location is
    pdb's current frame; ``cell_id`` is the cell the rank runs (-1: none).
    """

    TYPE: ClassVar[str] = "debug_prompt"
    ROUTE: ClassVar[str] = "debugger"
    RECORD: ClassVar[bool] = True
    prompt_id: int
    prompt: str
    kind: str = "pdb"
    cell_id: int = -1
    filename: str = ""
    lineno: int = 0
    function: str = ""


@_register
@dataclass(frozen=True)
class DebugResumed(Message):
    """Rank -> controller: the rank left its pdb prompt and runs again (``how``: continue, step, quit, raise)."""

    TYPE: ClassVar[str] = "debug_resumed"
    ROUTE: ClassVar[str] = "debugger"
    RECORD: ClassVar[bool] = True
    how: str = "continue"


@_register
@dataclass(frozen=True)
class DebugInput(Message):
    """Controller -> rank (I/O thread): the answer to prompt ``prompt_id``.

    ``action`` "" sends ``line``; "continue" lets the rank go on (pdb ``continue``, or the end of ``interact``);
    "raise" lets it go on by raising KeyboardInterrupt at its current line.
    """

    TYPE: ClassVar[str] = "debug_input"
    prompt_id: int
    line: str = ""
    action: str = ""


@_register
@dataclass(frozen=True)
class DebugPostMortem(Message):
    """Controller -> rank (main thread, like a cell): open pdb on the traceback the rank kept from its last
    failed cell; the outcome comes back as a ``Result`` whose value is ``{"debugged": bool, "reason": str}``.

    ``mode`` "sidebar": stop in the attached visual debugger instead of pdb; "listen": only start the rank's
    debugpy adapter (the traceback stays kept, as it would not through a ``Call``) and add its ``"port"``."""

    TYPE: ClassVar[str] = "debug_post_mortem"
    WORK: ClassVar[bool] = True
    cell_id: int
    mode: str = "pdb"


@_register
@dataclass(frozen=True)
class Inspect(Message):
    """Controller -> rank (answered off the main thread, which may be busy): evaluate ``expr`` in the rank's
    namespace (``frame``: with the locals of the innermost frame of a notebook cell the main thread runs)."""

    TYPE: ClassVar[str] = "inspect"
    request_id: int
    expr: str
    frame: bool = False


@_register
@dataclass(frozen=True)
class DebugClear(Message):
    """Controller -> rank (I/O thread): drop the traceback kept for post-mortem debugging."""

    TYPE: ClassVar[str] = "debug_clear"
    request_id: int


@_register
@dataclass(frozen=True)
class DebugReply(Message):
    """Rank -> controller: answer to ``Inspect`` or ``DebugClear``.

    ``text`` is the value's repr (or the error, when ``ok`` is False); ``state`` is "running" or "idle" and
    ``where`` says where the main thread was ("<mesh In[3]> line 7, in train"), for the live-state note.
    """

    TYPE: ClassVar[str] = "debug_reply"
    ROUTE: ClassVar[str] = "inspections"
    request_id: int
    ok: bool
    text: str
    state: str = ""
    where: str = ""
    cell_id: int = -1


@_register
@dataclass(frozen=True)
class Goodbye(Message):
    """Rank or host agent -> controller: this process exits now with ``returncode`` (how the controller learns that
    a process on another host ended); an agent says why in ``note`` (its fork server died, no word from you)."""

    TYPE: ClassVar[str] = "goodbye"
    returncode: int = 0
    note: str = ""


# ---- rich output and completion (see monarch_worker.display, monarch_jupyter.kernel.display)


@_register
@dataclass(frozen=True)
class Display(Message):
    """Rank -> controller: rich output of cell ``cell_id`` (``display()``, ``update_display()``,
    ``clear_output()``, matplotlib figures), republished in the notebook as display_data, update_display_data or
    clear_output.

    ``kind`` is "display", "update" or "clear" (``wait``: clear when the next output comes). ``data`` maps text
    MIME types to their text (JSON-valued types, named in ``json``, as JSON text); each MIME type named in
    ``binary`` (image/png, ...) has its raw bytes, not base64, in one out-of-band buffer, in order, or, for
    large ones from a local rank, at ``layout`` offsets of the shared memory segment ``shm``
    (monarch_worker.shm). ``metadata`` is JSON text.
    """

    TYPE: ClassVar[str] = "display"
    ROUTE: ClassVar[str] = "displays"
    RECORD: ClassVar[bool] = True
    cell_id: int
    kind: str = "display"
    data: dict = field(default_factory=dict)
    json: list = field(default_factory=list)
    binary: list = field(default_factory=list)
    metadata: str = "{}"
    display_id: str = ""
    wait: bool = False
    shm: dict | None = None


@_register
@dataclass(frozen=True)
class Complete(Message):
    """Controller -> rank (I/O thread, answered while the main thread is busy): complete, or (``inspect``)
    describe, the name at ``cursor_pos`` of ``code`` in the rank's namespace."""

    TYPE: ClassVar[str] = "complete"
    request_id: int
    code: str
    cursor_pos: int
    inspect: bool = False


@_register
@dataclass(frozen=True)
class CompleteReply(Message):
    """Rank -> controller: ``matches`` replace ``code[cursor_start:cursor_end]``; for an inspection, ``text`` is
    the object's signature and docstring ("" when the name is not found)."""

    TYPE: ClassVar[str] = "complete_reply"
    ROUTE: ClassVar[str] = "completions"
    request_id: int
    matches: list = field(default_factory=list)
    cursor_start: int = 0
    cursor_end: int = 0
    text: str = ""


register = _register
"""Add a message class to ``MESSAGE_TYPES`` (a decorator): for the modules that define more messages
(monarch_worker.hostmessages: the host agents'; monarch_worker.dapmessages: the visual debugger's relay)."""
