"""``RankSide``: what the parts of a rank's runtime (its debugger, its transfers, its recovery from faults) use of
the rank they belong to (runtime.Rank), as a Protocol: those modules need no import of the runtime, which imports
them."""

from __future__ import annotations

from typing import Any, Protocol

from . import protocol as P
from .channel import Outbox
from .executor import Namespace

__all__ = ["RankSide"]


class RankSide(Protocol):
    """The rank as its parts see it (runtime.Rank implements it)."""

    rank: int  # the global rank
    device: Any  # the rank's torch device
    ns: Namespace | None  # the cells' namespace (None before the rank joined)
    current_cell: int  # the cell the main thread runs now (-1: idle)
    main_ident: int  # threading.get_ident() of the main thread
    outbox: Outbox  # what the I/O thread sends
    group_sockets: Any  # recovery.GroupSockets: the connections of the process group and its dist.new_group groups

    def send(self, msg: P.Message, value: Any = None, *, with_value: bool = False,
             buffers: list | None = None) -> None: ...

    def note_interrupt(self, cell_id: int) -> None: ...

    def init_group(self, rank: int, world_size: int, local_rank: int, local_world_size: int, master_addr: str,
                   master_port: int, backend: str) -> tuple[Any, str]: ...

    def run_work(self, cell_id: int, body: Any, reply: Any = None) -> None: ...
