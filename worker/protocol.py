"""The wire protocol between the controller (notebook kernel) and the ranks.

This module and ``monarch_worker.messages`` (the message dataclasses, re-exported here) are the only places that
define messages, frame them and sign them. Everything else sends and receives those frozen dataclasses.

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

# The message classes are part of the protocol: protocol.Exec, protocol.Result, protocol.Forward, ... They are
# listed once, in their modules' __all__ (tests/unit/test_protocol.py checks those against the registry).
from . import dapmessages, hostmessages, messages
from .dapmessages import *  # noqa: F403
from .hostmessages import *  # noqa: F403
from .messages import *  # noqa: F403
from .messages import MESSAGE_TYPES, Message
from .pipes import receive_buffers

__all__ = ["ProtocolError", "Signer"]
__all__ += messages.__all__
__all__ += hostmessages.__all__
__all__ += dapmessages.__all__

MAGIC = b"MJ\x01"


class ProtocolError(Exception):
    """A message failed verification (bad signature, replay, unknown type or version)."""


# --------------------------------------------------------------------------------------------------------------
# Framing and signing


@functools.cache
def _field_names(cls: type[Message]) -> tuple[str, ...]:
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
        fields = {name: getattr(msg, name) for name in _field_names(type(msg))}  # type: ignore[arg-type]
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
FS_IMPORT = 3  # kernel -> fork server: body is JSON {"modules"}: import them, so that ranks forked later have them
FS_CLONE = 4  # kernel -> fork server: body is JSON {}; one socket comes too: fork a fork server of its own on it
FS_SPAWNED = 10  # fork server -> kernel: body is JSON {"pid"}; the read ends of its stdout and stderr pipes come too
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


# Python-level stderr of a rank, written into its stdout pipe, in order with its stdout (a progress bar's last update
# and the print after it, as the rank wrote them): each piece is
#
#   ERR_PREFIX | body length (4 hex digits) | body (UTF-8, cut at character boundaries)
#
# in one write() of at most PIPE_BUF bytes (atomic on a pipe). C-level writes to fd 2 (and a subprocess's stderr)
# still go to the stderr pipe. The header is ASCII, so the stream stays text for ranks that relay their own output.
ERR_PREFIX = b"\x1b]monarch-err;"
ERR_HEADER_LEN = len(ERR_PREFIX) + 4
ERR_BODY_MAX = 4096 - ERR_HEADER_LEN  # PIPE_BUF


def err_pieces(data: bytes) -> list[bytes]:
    """``data`` (UTF-8 text a rank wrote on its stderr) as embedded pieces for its stdout pipe (see above)."""
    out = []
    start, n = 0, len(data)
    while start < n:
        end = min(start + ERR_BODY_MAX, n)
        while end < n and end > start and data[end] & 0xC0 == 0x80:  # not inside a character
            end -= 1
        body = data[start:end]
        out.append(ERR_PREFIX + b"%04x" % len(body) + body)
        start = end
    return out


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
    return tuple(cls for cls in MESSAGE_TYPES.values() if cls.RECORD)


def pack_frames(frames: list) -> bytes:
    """One byte string holding ``frames`` (bytes-like), each with its length."""
    return b"".join(frame_parts(frames))


def frame_parts(frames: list) -> list:
    """The pieces whose concatenation is ``pack_frames(frames)``; large frames are not copied."""
    parts: list = [_FRAME_COUNT.pack(len(frames))]
    for f in frames:
        parts.append(_FRAME_LEN.pack(memoryview(f).nbytes))
        parts.append(f)
    return parts


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
    return tuple(cls for cls in MESSAGE_TYPES.values() if cls.WORK)


def work_message(frames: list) -> list:
    """Frame signed ``frames`` for the work pipe: the pieces to write in order (a message of ``WORK_COPY_MAX``
    bytes or less is one bytes object; a larger one keeps its large frames as they are, so tensor memory goes
    into the pipe without a copy)."""
    if all(type(f) is bytes for f in frames):  # no out-of-band buffers: one string (the common, small case)
        body = pack_frames(frames)
        return [WORK_HEADER.pack(len(body)) + body]
    parts = frame_parts(frames)
    size = sum(memoryview(p).nbytes for p in parts)
    if size <= WORK_COPY_MAX:
        return [WORK_HEADER.pack(size) + b"".join(parts)]
    return [WORK_HEADER.pack(size), *parts]


WORK_COPY_MAX = 256 * 1024
"""Largest work message (bytes) joined into one string before it is written (larger ones are written piecewise)."""
WORK_READ = 64 * 1024
"""Bytes read from a work pipe at a time while no large message is under way."""
WORK_DIRECT_MIN = 1 << 20
"""A message body of at least this many bytes is read straight into a buffer of its own (recycled anonymous
memory: pipes.receive_buffers), so its tensors are built on the bytes the pipe delivered, uncopied."""


class WorkReader:
    """Splits the bytes of a work pipe into messages (``pack_frames`` bodies); one thread uses it.

    ``read_from`` reads the pipe itself: a large body (``WORK_DIRECT_MIN`` bytes or more) is read into a buffer of
    its own and returned as a writable memoryview, which ``unpack_frames`` slices without copying.
    """

    def __init__(self) -> None:
        self._buf = bytearray()
        self._body: memoryview | None = None  # the large body being read, and how much of it has arrived
        self._filled = 0

    def read_from(self, fd: int) -> list | None:
        """Read what the pipe has (one read); the messages completed by it, or None at end of file."""
        if self._body is not None:
            n = os.readv(fd, [self._body[self._filled:]])
            if n == 0:
                return None
            self._filled += n
            if self._filled < len(self._body):
                return []
            body, self._body = self._body, None
            return [body]
        data = os.read(fd, WORK_READ)
        if not data:
            return None
        return self.feed(data)

    def feed(self, data: bytes) -> list:
        self._buf += data
        out: list = []
        pos = 0
        hs = WORK_HEADER.size
        while len(self._buf) - pos >= hs:
            (n,) = WORK_HEADER.unpack_from(self._buf, pos)
            have = len(self._buf) - pos - hs
            if have < n:
                if n >= WORK_DIRECT_MIN:
                    self._body = receive_buffers.take(n)
                    self._body[:have] = self._buf[pos + hs:]
                    self._filled = have
                    pos = len(self._buf)
                break
            out.append(bytes(self._buf[pos + hs:pos + hs + n]))
            pos += hs + n
        if pos:
            del self._buf[:pos]
        return out
