"""Where ``%mesh scale`` puts new ranks on a mesh whose ranks are behind host agents (launch/hosts.py).

Growing from N to M ranks numbers the new ranks N..M-1 (every rank keeps its number, so ranks stay numbered 0..M-1)
and gives them, one at a time in rank order, to the live host agent that holds the fewest ranks and still has room,
ties going to the host with the lower GROUP_RANK: the hosts fill evenly. A host's room is what its agent measured
when it started (``AgentHello.limits``: cores and memory, by the rules of a local mesh, launch/capacity.py);
``oversubscribe`` (``%mesh start --force``) lifts it. Under the nccl backend (one CUDA device per rank) a host also
carries no more ranks than the CUDA devices its agent saw, oversubscribed or not. Shrinking stops the highest ranks,
wherever they are. A host that came to a listening mesh after it started (its agent waits: HostLinks.hold) is
admitted by the next grow first, in the order they came, each with the ranks its ``--nproc-per-node`` asked for
(when they fit in the growth) and the next GROUP_RANK, as torchrun's ``--nnodes MIN:MAX`` admits a node at the next
membership change; the rest is then placed evenly. A host keeps its GROUP_RANK, and its ranks are numbered on it in
rank order (LOCAL_RANK, LOCAL_WORLD_SIZE: ``state.BY_HOST``), as torchrun numbers the workers of one node.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

from .capacity import IDLE_RANK_BYTES, RANKS_PER_CORE, host_room, world_fds_problem

if TYPE_CHECKING:
    from .agents import Agent

__all__ = ["Placement", "place"]


@dataclass
class Placement:
    """The hosts' ranks after a grow: ``ranks`` agent identity -> its global ranks (sorted), ``hosts`` new rank ->
    the host it goes to."""

    ranks: dict[bytes, list[int]] = field(default_factory=dict)
    hosts: dict[int, str] = field(default_factory=dict)
    admit: dict[bytes, list[int]] = field(default_factory=dict)  # waiting hosts admitted, with their ranks

    @property
    def admitted(self) -> set[int]:
        """The new ranks that go to admitted hosts (their agent forks them when welcomed)."""
        return {r for ranks in self.admit.values() for r in ranks}


def place(agents: list[Agent], before: int, n: int, oversubscribe: bool,
          waiting: Sequence[tuple[Agent, int]] = (), gpus: bool = False) -> Placement:
    """Place ranks ``before``..``n``-1 on ``agents`` (the live ones) and hosts ``waiting`` (held agents, each with
    the ranks it brings), see the module docstring; ``gpus``: one CUDA device per rank (backend nccl).

    Raises
    ------
    ValueError
        No live host agent, or the hosts have room for fewer ranks (the message gives each host's room and the
        ways out: more hosts, or ``oversubscribe``).
    """
    agents = list(agents)
    admit: dict[bytes, list[int]] = {}
    nxt = before
    for agent, count in waiting:  # hosts that came wait for this: admitted first, each with all its ranks
        if nxt + count <= n:
            admit[agent.identity] = list(range(nxt, nxt + count))
            agents.append(replace(agent, ranks=[], group_rank=len(agents)))  # the next GROUP_RANK
            nxt += count
    if not agents:
        raise ValueError("no host agent is connected any more: there is no host to place new ranks on. "
                         "Run  %mesh restart  (a fresh mesh; one that listens for its hosts prints their commands "
                         "again).")
    held = {a.identity: sorted(r for r in a.ranks if r < before) for a in agents}
    room = {a.identity: None if oversubscribe else host_room(a.limits) for a in agents}
    if gpus:
        room = {a.identity: gpu_room(room[a.identity], a.limits) for a in agents}
    files = min((int(a.limits[2]) for a in agents if len(a.limits) > 2), default=0)
    why = "" if oversubscribe or not files else world_fds_problem(n, files)
    out = Placement({k: list(v) for k, v in held.items()}, admit=admit)
    for k, ranks in admit.items():
        out.ranks[k] = list(ranks)
        out.hosts.update(dict.fromkeys(ranks, next(a.host for a in agents if a.identity == k)))
    order = {a.identity: (a.group_rank, a.host) for a in agents}
    names = {a.identity: a.host for a in agents}
    for r in range(nxt, n):
        if why:
            break
        free = [k for k in held if room[k] is None or len(out.ranks[k]) < room[k]]  # type: ignore[operator]
        if not free:
            break
        k = min(free, key=lambda k: (len(out.ranks[k]), order[k]))
        out.ranks[k].append(r)
        out.hosts[r] = names[k]
    if len(out.hosts) < n - before:
        rooms = ", ".join(f"{names[k]} {len(held[k])} of {room[k]}" for k in held)
        raise ValueError(
            f"{n} ranks are more than the hosts of this mesh can carry"
            + (f": {why}" if why else f" (ranks held of the room each has: {rooms}; {RULE})")
            + ". Scale to fewer ranks, add hosts (a mesh started with more hosts:  %mesh listen), or scale a mesh "
              "started with  --force  (Mesh(..., oversubscribe=True)), which is not held to the room.")
    return out


def gpu_room(room: int | None, limits: list) -> int | None:
    """``room`` bounded by the CUDA devices of a host with ``limits`` (its 4th entry; unknown for an older agent)."""
    if len(limits) < 4:
        return room
    return int(limits[3]) if room is None else min(room, int(limits[3]))


RULE = (f"room: {RANKS_PER_CORE} ranks per core and {IDLE_RANK_BYTES >> 20} MiB of memory per rank, as the host's "
        "agent measured them when it started; under backend nccl, one CUDA device per rank")
