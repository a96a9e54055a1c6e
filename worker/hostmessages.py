"""The messages of host agents (monarch_worker.agent), registered with the others (``messages.MESSAGE_TYPES``).

monarch_worker.protocol re-exports them with every other message; docs/scale.md describes the exchange: an agent
says ``AgentHello`` and is answered ``AgentWelcome`` (or ``Rejected``); the controller sends ``Forward`` (one signed
message for several ranks of the host), ``Spawn``, ``Signal`` and ``HostRanks`` (the host's ranks after
``%mesh scale``); the agent answers with ``HostEvents`` batches.
"""

from __future__ import annotations

import array
import sys
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .messages import PROTOCOL_VERSION, Message, register

__all__ = ["AgentHello", "AgentWelcome", "Forward", "HostEvents", "HostRanks", "Spawn", "Signal", "pack_durations",
           "unpack_durations"]


@register
@dataclass(frozen=True)
class AgentHello(Message):
    """Agent -> controller: a host agent for ``nproc`` ranks. ``group_rank`` / ``group_world_size``: the host's
    number and the number of hosts as its launcher gave them (-1: unknown; the controller numbers hosts then);
    ``addr``: its address toward the controller (where its rank 0 may host the c10d store); ``limits``: what the
    host can carry, ``[cores, available memory in bytes, open-file limit, CUDA devices]`` as
    ``monarch_worker.hostlimits`` measured it when the agent started (``[]``: unknown; ``%mesh scale`` places
    ranks by it)."""

    TYPE: ClassVar[str] = "agent_hello"
    host: str
    pid: int
    nproc: int
    addr: str
    version: int = PROTOCOL_VERSION
    group_rank: int = -1
    group_world_size: int = -1
    launcher_env: dict = field(default_factory=dict)
    limits: list = field(default_factory=list)


@register
@dataclass(frozen=True)
class AgentWelcome(Message):
    """Controller -> agent: admitted; local rank i is global rank ``ranks[i]`` of ``world_size``. ``settings``:
    the RankConfig fields of the mesh's options. The agent forks its ranks now."""

    TYPE: ClassVar[str] = "agent_welcome"
    ranks: list
    world_size: int
    group_rank: int
    group_world_size: int
    settings: dict = field(default_factory=dict)


@register
@dataclass(frozen=True)
class Spawn(Message):
    """Controller -> agent: fork fresh processes for these global ``ranks`` (of this host)."""

    TYPE: ClassVar[str] = "spawn"
    ranks: list


@register
@dataclass(frozen=True)
class HostRanks(Message):
    """Controller -> agent, after ``%mesh scale``: this host now holds global ranks ``ranks`` (in order: local rank i
    is ``ranks[i]``) of a mesh of ``world_size``. Ranks it held that are not in ``ranks`` are forgotten (SIGKILLed if
    still running; their exits are not reported); new ones start with a ``Spawn`` that follows."""

    TYPE: ClassVar[str] = "host_ranks"
    ranks: list
    world_size: int


@register
@dataclass(frozen=True)
class Signal(Message):
    """Controller -> agent: send ``signal`` to these global ``ranks`` of this host (``[-1]``: all of them)."""

    TYPE: ClassVar[str] = "signal"
    ranks: list
    signal: int


@register
@dataclass(frozen=True)
class Forward(Message):
    """Controller -> agent: give one signed message (its frames are this message's buffers) to each of ``ranks``
    (``[-1]``: every rank of this host, so that a cell for a whole host names none of them one by one): into the
    work pipe when ``kind`` (the inner message's TYPE) is work, else over the rank's socket. ``cell_id`` (-1: none):
    the cell whose results the agent collects from those ranks before it answers."""

    TYPE: ClassVar[str] = "forward"
    ranks: list
    kind: str
    cell_id: int = -1


@register
@dataclass(frozen=True)
class HostEvents(Message):
    """Agent -> controller: what the ranks of a host did, in order, since the last batch.

    ``events`` is a list of tuples, by their first item: ``("out", rank, stream, text)`` a line of output;
    ``("done", cell_id, ranks, durations)`` ranks that finished a cell with no value and no error;
    ``("span", cell_id, start, stop, durations)`` the same for ranks ``start`` to ``stop - 1`` (a host whose ranks
    are consecutive sends this form: no list of ranks, and ``durations``, their seconds in rank order, as float64
    bytes in little-endian order: ``pack_durations``), so that the controller reads a host's ranks in one
    step whatever their number;
    ``("res", rank, cell_id, status, has_value, error, duration, pickle_bytes, nbufs)`` any other result (its pickle
    in the payload, its out-of-band buffers next in the buffers); ``("msg", rank, nframes)`` a signed message of the
    rank, relayed (its frames next in the buffers); ``("up", rank, pid)`` forked; ``("exit", rank, returncode)``
    exited (negative: killed by that signal); ``("beat", [(rank, rss, cuda_allocated, cuda_reserved, group), ...])``
    the ranks' heartbeats (bytes; ``group``: the backend of the rank's default process group, "" for none).
    ``payload`` holds the results' pickles, concatenated."""

    TYPE: ClassVar[str] = "host_events"
    events: list
    payload: Any = None


def pack_durations(durations: list[float]) -> bytes:
    """Seconds as float64 bytes, little-endian (a ``span`` event's durations, hostmessages.HostEvents)."""
    arr = array.array("d", durations)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tobytes()


def unpack_durations(data: bytes) -> list[float]:
    """The seconds ``pack_durations`` packed."""
    arr = array.array("d")
    arr.frombytes(data)
    if sys.byteorder != "little":
        arr.byteswap()
    return arr.tolist()
