"""The wire protocol between the controller (notebook kernel) and the ranks.

This module is the only place that defines messages, frames them and signs them. Everything else sends and
receives the frozen dataclasses below.

Frames of one message on a ZeroMQ socket (a ROUTER on the controller prepends the peer identity)::

    [MAGIC, signature, header, payload, *buffers]

- ``header``: ``{"t": type, "s": sender session, "n": sequence number, "f": fields}`` in Python's marshal format
  (version 4, stable since Python 3.4: None, bool, int, float, str, bytes, tuple, list and dict only; about 4x
  faster than JSON both ways). It is read only after its signature was verified, like the pickled payload.
- ``payload``: a pickle (protocol 5) of the message's user value, or empty; ``buffers`` are its out-of-band
  buffers (tensor and array memory), never copied into the pickle stream.
- ``signature``: HMAC-SHA256 with the per-mesh secret over ``header``, ``payload`` and the byte length of every
  buffer. As in Jupyter's messaging protocol (jupyter_client.session), raw buffer contents are not hashed: they
  are never unpickled, only used as array memory, so a forged buffer cannot run code. Where the network itself
  is untrusted, use CurveZMQ encryption, which authenticates every byte.

Large values for ranks on the same host travel in shared memory segments instead of buffer frames
(monarch_worker.shm): the message that names a segment is signed, its bytes are not, for the same reason.

A receiver verifies the signature (``hmac.compare_digest``) and rejects replays (the sequence number of each
sender session must increase) before it parses the header or unpickles anything. ``PROTOCOL_VERSION`` is checked
at the handshake.

The local launcher's fork server talks to the kernel over plain pipes with the small binary framing
at the end of this module; those pipes never leave the host and carry no code from outside.
"""

from __future__ import annotations

import dataclasses
import functools
import hmac
import json
import marshal
import os
import struct
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "PROTOCOL_VERSION",
    "ProtocolError",
    "Signer",
    "Message",
    "MESSAGE_TYPES",
]

PROTOCOL_VERSION = 2
MAGIC = b"MJ\x01"


class ProtocolError(Exception):
    """A message failed verification (bad signature, replay, unknown type or version)."""


# --------------------------------------------------------------------------------------------------------------
# Messages. ``payload`` fields carry user values and travel pickled outside the JSON header.


@dataclass(frozen=True)
class Message:
    """Base of every message. ``TYPE`` is the wire name; ``payload`` (if any) is sent pickled."""

    TYPE: ClassVar[str] = ""


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
    torch's ``env://``). ``settings`` are RankConfig fields a joined rank takes from the controller (backend,
    timeouts, env).
    """

    TYPE: ClassVar[str] = "welcome"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    settings: dict = field(default_factory=dict)


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
class Regroup(Message):
    """Controller -> surviving rank: join a fresh process group (after ``Abort``, or to admit restarted ranks).

    Fields as in ``Welcome`` (``local_rank``/``local_world_size`` -1: keep this rank's own); ``master_port`` 0
    asks this rank (rank 0) to host a new TCPStore (on ``master_addr``, or its address toward the controller
    when empty) and answer ``StoreReady``. The rank answers ``Ready`` (or ``StartFailed``), keeping its
    namespace.
    """

    TYPE: ClassVar[str] = "regroup"
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int
    master_addr: str
    master_port: int
    backend: str


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
    """

    TYPE: ClassVar[str] = "progress"
    cell_id: int
    n: float
    total: float | None
    desc: str = ""
    postfix: str = ""


@_register
@dataclass(frozen=True)
class Heartbeat(Message):
    """Rank -> controller: alive. Memory in bytes: ``rss`` (resident set size of the process) and, once the rank
    uses CUDA, ``cuda_allocated`` / ``cuda_reserved`` (torch's caching allocator on the rank's device)."""

    TYPE: ClassVar[str] = "heartbeat"
    rss: int = 0
    cuda_allocated: int = 0
    cuda_reserved: int = 0


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
    cell_id: int
    items: list
    device: str | None = None
    payload: Any = None


@_register
@dataclass(frozen=True)
class Pull(Message):
    """Controller -> rank: send back the value bound to ``name``; ``shm``: the reply may use shared memory."""

    TYPE: ClassVar[str] = "pull"
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
    ids: list


# ---- debugging (see monarch_worker.debugger and monarch_jupyter.kernel.debugger)


@_register
@dataclass(frozen=True)
class DebugOutput(Message):
    """Rank -> controller: text pdb wrote on the rank (complete lines, or what came before a prompt)."""

    TYPE: ClassVar[str] = "debug_output"
    text: str


@_register
@dataclass(frozen=True)
class DebugPrompt(Message):
    """Rank -> controller: the rank's pdb waits for one line of input, answered by ``DebugInput(prompt_id)``.

    ``kind`` is "pdb" (a pdb command) or "interact" (a line for pdb's ``interact`` console); the location is
    pdb's current frame; ``cell_id`` is the cell the rank runs (-1: none).
    """

    TYPE: ClassVar[str] = "debug_prompt"
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
    failed cell; the outcome comes back as a ``Result`` whose value is ``{"debugged": bool, "reason": str}``."""

    TYPE: ClassVar[str] = "debug_post_mortem"
    cell_id: int


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
    request_id: int
    ok: bool
    text: str
    state: str = ""
    where: str = ""
    cell_id: int = -1
@_register
@dataclass(frozen=True)
class Goodbye(Message):
    """Rank -> controller: this process exits now with ``returncode`` (how the controller learns that a rank on
    another host ended, where no launcher reports exit statuses)."""

    TYPE: ClassVar[str] = "goodbye"
    returncode: int = 0


# --------------------------------------------------------------------------------------------------------------
# Framing and signing


@functools.cache
def _field_names(cls: type) -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(cls) if f.name != "payload")


class Signer:
    """Signs and verifies frames with HMAC-SHA256 and a per-mesh secret; rejects replays.

    One Signer belongs to one endpoint (a rank, or the controller). It is not thread-safe: only the thread
    that owns the socket uses it.

    Parameters
    ----------
    key:
        The per-mesh secret (at least 16 bytes).
    """

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("the mesh secret must be at least 16 bytes")
        self._key = key
        self._session = os.urandom(8).hex()
        self._seq = 0
        self._last_seen: dict[str, int] = {}

    def _digest(self, header: bytes, payload: bytes, sizes: list[int]) -> bytes:
        # Length-prefix header and payload so that no byte can move from one to the other.
        data = b"".join((struct.pack(f"!QQ{len(sizes)}Q", len(header), len(payload), *sizes), header, payload))
        return hmac.digest(self._key, data, "sha256")

    def pack(self, msg: Message, payload: bytes = b"", buffers: list | tuple = ()) -> list:
        """Frame ``msg``; ``payload``/``buffers`` are its pickled user value (see serialize.dumps)."""
        self._seq += 1
        fields = {name: getattr(msg, name) for name in _field_names(type(msg))}
        header = marshal.dumps({"t": msg.TYPE, "s": self._session, "n": self._seq, "f": fields}, 4)
        sizes = [memoryview(b).nbytes for b in buffers]
        return [MAGIC, self._digest(header, payload, sizes), header, payload, *buffers]

    def unpack(self, frames: list) -> tuple[Message, bytes, list]:
        """Verify and parse frames; returns (message without payload, payload bytes, buffers).

        Raises
        ------
        ProtocolError
            Wrong magic, bad signature, replayed sequence number or unknown message type.
        """
        if len(frames) < 4:
            raise ProtocolError(f"short message: {len(frames)} frames")
        magic, sig, header, payload, *buffers = frames
        if bytes(magic) != MAGIC:
            raise ProtocolError("not a monarch_jupyter message (bad magic)")
        header_b, payload_b = bytes(header), bytes(payload)
        sizes = [memoryview(b).nbytes for b in buffers]
        if not hmac.compare_digest(self._digest(header_b, payload_b, sizes), bytes(sig)):
            raise ProtocolError("bad signature: the sender does not hold this mesh's secret")
        try:
            head = marshal.loads(header_b)
        except (EOFError, ValueError, TypeError) as e:
            raise ProtocolError(f"malformed header: {e}") from None
        session, seq = head["s"], head["n"]
        if seq <= self._last_seen.get(session, 0):
            raise ProtocolError(f"replayed message (session {session}, seq {seq})")
        self._last_seen[session] = seq
        cls = MESSAGE_TYPES.get(head["t"])
        if cls is None:
            raise ProtocolError(f"unknown message type {head['t']!r}")
        return cls(**head["f"]), payload_b, buffers


# --------------------------------------------------------------------------------------------------------------
# Fork-server socket framing (kernel <-> local fork server): a 9-byte header then a body.
#   kind (1 byte) | rank (int32, -1 for none) | body length (uint32)

FORK_SERVER_HEADER = struct.Struct("!BiI")
FS_SPAWN = 1  # kernel -> fork server: body is JSON {"rank", "env", "cwd", "config"}
FS_KILL = 2  # kernel -> fork server: body is JSON {"signal"}; rank -1 means every rank
FS_SPAWNED = 10  # fork server -> kernel: body is JSON {"pid"}; the read ends of its stdout and stderr pipes come with it
FS_EXITED = 11  # fork server -> kernel: body is JSON {"returncode"} (negative: killed by that signal)
FS_READY = 14  # fork server -> kernel: the fork server imported torch and waits for work


def fork_server_frame(kind: int, rank: int, body: bytes) -> bytes:
    """One pipe frame: header plus body."""
    return FORK_SERVER_HEADER.pack(kind, rank, len(body)) + body


def fork_server_json(kind: int, rank: int, obj: dict) -> bytes:
    return fork_server_frame(kind, rank, json.dumps(obj).encode())


# A marker each rank writes to its stdout and stderr after every cell, so the controller knows it has all the
# output of that cell before it shows the result. The format is not printable text that users would write.
SYNC_PREFIX = b"\x1b]monarch-sync;"
SYNC_SUFFIX = b"\x07"


def sync_marker(cell_id: int) -> bytes:
    return SYNC_PREFIX + str(cell_id).encode() + SYNC_SUFFIX


# --------------------------------------------------------------------------------------------------------------
# Records: signed messages that a local rank writes into its own stdout pipe, in line with its output.
#
# A rank started by the fork server sends what its main thread reports (a cell's Result, progress, debugger
# prompts) as records on the pipe behind fd 1 rather than over ZeroMQ. The kernel reads the rank's stdout and
# stderr pipes itself, and passes on everything the stderr pipe holds before the stdout bytes it has just read, so
# a Result record arrives after every byte of output the cell wrote on either stream: no sync marker and no ZeroMQ
# round trip are needed for it. Each record is one write() of at most PIPE_BUF bytes, which
# POSIX makes atomic on a pipe, so output written by other threads never lands inside one; a longer message is
# cut into several records (flag RECORD_MORE on all but the last).
#
#   RECORD_PREFIX | body length (uint32) | flags (uint8) | body
#
# The bodies of a message's records, joined, are ``pack_frames`` of its signed frames (``Signer.pack``), which
# the kernel verifies like any other message before it unpickles anything.

RECORD_PREFIX = b"\x1b]monarch-msg;"
RECORD_HEADER = struct.Struct("!IB")
RECORD_MORE = 1  # more records of this message follow
RECORD_SYNC = 2  # the cell ended: every line it wrote before this record is complete
PIPE_BUF = 4096  # POSIX guarantees at least 512; Linux gives 4096
RECORD_BODY_MAX = PIPE_BUF - len(RECORD_PREFIX) - RECORD_HEADER.size
_FRAME_COUNT = struct.Struct("!H")
_FRAME_LEN = struct.Struct("!I")
# How the first (or only) record of every message begins: after the frame count (2 bytes), the length of the
# first frame and that frame, MAGIC. Output that merely looks like a record does not (see StreamSplitter).
RECORD_BODY_START = _FRAME_LEN.pack(len(MAGIC)) + MAGIC


def record_types() -> tuple[type[Message], ...]:
    """The messages a rank's main thread sends as records (their kernel handlers may run on any thread)."""
    return (Result, Progress, DebugOutput, DebugPrompt, DebugResumed)


def pack_frames(frames: list) -> bytes:
    """One byte string holding ``frames`` (bytes-like), each with its length."""
    parts = [_FRAME_COUNT.pack(len(frames))]
    for f in frames:
        parts.append(_FRAME_LEN.pack(memoryview(f).nbytes))
        parts.append(f)
    return b"".join(parts)


def unpack_frames(data: bytes) -> list[bytes]:
    """The frames ``pack_frames`` packed. Raises ProtocolError on a malformed string."""
    try:
        (count,) = _FRAME_COUNT.unpack_from(data, 0)
        pos, frames = _FRAME_COUNT.size, []
        for _ in range(count):
            (n,) = _FRAME_LEN.unpack_from(data, pos)
            pos += _FRAME_LEN.size
            if pos + n > len(data):
                raise ProtocolError("truncated record")
            frames.append(data[pos:pos + n])
            pos += n
    except struct.error as e:
        raise ProtocolError(f"malformed record: {e}") from None
    if pos != len(data):
        raise ProtocolError("malformed record: trailing bytes")
    return frames


def records(body: bytes, sync: bool = False) -> list[bytes]:
    """Cut ``body`` (``pack_frames`` output) into records of at most PIPE_BUF bytes each."""
    out = []
    chunks = [body[i:i + RECORD_BODY_MAX] for i in range(0, len(body), RECORD_BODY_MAX)] or [b""]
    for i, chunk in enumerate(chunks):
        last = i == len(chunks) - 1
        flags = (0 if last else RECORD_MORE) | (RECORD_SYNC if sync and last else 0)
        out.append(RECORD_PREFIX + RECORD_HEADER.pack(len(chunk), flags) + chunk)
    return out


# --------------------------------------------------------------------------------------------------------------
# The work pipe: kernel -> a local rank's main thread.
#
# A rank started by the fork server also gets the read end of a pipe (fd WORK_FD) whose write end the kernel
# holds. The kernel sends the messages that the rank's main thread runs (cells, calls, transfers, regroup,
# shutdown) there, signed, so a cell reaches the thread that runs it in one hop rather than through two ZeroMQ
# I/O threads and the rank's own I/O thread. Messages its I/O thread answers (interrupts, stack requests,
# debugger input, heartbeats) still go over the socket, so they are heard while a cell runs. So do Abort and
# Regroup: the I/O thread hands both to the main thread in the order they came, and a Regroup must never overtake
# the Abort before it (that would tear down the new process group).
#
#   body length (uint64) | pack_frames(signed frames)

WORK_FD = 3
WORK_HEADER = struct.Struct("!Q")


def work_types() -> tuple[type[Message], ...]:
    """The messages a kernel sends through a rank's work pipe when it has one."""
    return (Exec, Call, Push, Pull, DebugPostMortem, Shutdown)


def work_message(frames: list) -> bytes:
    """Frame signed ``frames`` for the work pipe."""
    body = pack_frames(frames)
    return WORK_HEADER.pack(len(body)) + body


class WorkReader:
    """Splits the bytes read from a work pipe into messages (``pack_frames`` bodies); one thread uses it."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out, pos = [], 0
        hs = WORK_HEADER.size
        while len(self._buf) - pos >= hs:
            (n,) = WORK_HEADER.unpack_from(self._buf, pos)
            if len(self._buf) - pos - hs < n:
                break
            out.append(bytes(self._buf[pos + hs:pos + hs + n]))
            pos += hs + n
        if pos:
            del self._buf[:pos]
        return out
