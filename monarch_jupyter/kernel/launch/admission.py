"""The rules of admission to a listening mesh, and the report of who came: pure functions of what the Listener
(launch/listener.py) holds, so the rules read in one place. Every refusal names the host (or rank) and the fix."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from monarch_worker import protocol as P

from ...ranks import ranks_text

__all__ = ["Joiner", "slots", "rank_refusal", "agent_refusal", "waiting_report"]


@dataclass
class Joiner:
    """A rank, or a host agent for ``count`` ranks (``hello`` an AgentHello), that joined or waits to."""

    identity: bytes
    hello: Any  # P.Hello, or P.AgentHello for an agent
    arrival: int
    last_heard: float
    rank: int = -1  # an agent's: its first rank, once numbered
    local_rank: int = -1
    local_world_size: int = -1
    count: int = 1
    agent: bool = False
    srcfd: int = -1
    group_rank: int = 0  # torchrun's GROUP_RANK of its host (a rank that joined alone)


def slots(pending: dict[bytes, Joiner]) -> int:
    """Ranks the joiners waiting now bring (an agent brings its host's)."""
    return sum(j.count for j in pending.values())


def rank_refusal(identity: bytes, msg: P.Hello, world: int, pending: dict[bytes, Joiner], complete: bool,
                 failed: str) -> str:
    """Why rank ``msg`` cannot join ("" when it can): the message says what to do."""
    if msg.version != P.PROTOCOL_VERSION:
        return (f"this rank speaks protocol {msg.version}, the controller {P.PROTOCOL_VERSION}: install the "
                "same monarch_jupyter version on every host")
    if failed:
        return f"the mesh stopped waiting for ranks ({failed.splitlines()[0]}); %mesh restart listens again"
    if complete or slots(pending) >= world:
        return f"the mesh already has its {world} ranks"
    if any(j.agent for j in pending.values()):
        return ("this mesh's hosts are joining through host agents (python -m monarch_worker.agent): start "
                "agents on every host, or plain ranks on every host")
    if identity in pending:
        return "said hello twice"
    if msg.world_size not in (-1, world):
        return (f"launched with world size {msg.world_size}, but the mesh listens for {world} ranks: launch "
                f"{world} ranks, or listen with --world-size {msg.world_size}")
    if msg.rank >= world:
        return f"rank {msg.rank} is outside the mesh's world size {world}"
    if msg.rank >= 0:
        for j in pending.values():
            if j.rank == msg.rank:
                return (f"rank {msg.rank} already joined from {j.hello.host} (pid {j.hello.pid}); are two launches "
                        "running at once?")
    return ""


def agent_refusal(identity: bytes, msg: P.AgentHello, world: int, pending: dict[bytes, Joiner], complete: bool,
                  failed: str) -> str:
    """Why host agent ``msg`` cannot join ("" when it can): the message names the host and the fix."""
    host = msg.host
    if msg.version != P.PROTOCOL_VERSION:
        return (f"the host agent on {host} speaks protocol {msg.version}, the controller {P.PROTOCOL_VERSION}: "
                "install the same monarch_jupyter version on every host")
    if failed:
        return (f"the mesh stopped waiting for hosts ({failed.splitlines()[0]}); the host agent of {host} "
                "came too late: %mesh restart listens again")
    free = world - slots(pending)
    if complete or free <= 0:
        return (f"the mesh already has its {world} ranks: the host agent of {host} came too late, or one host "
                "too many was launched (%mesh restart listens again)")
    if identity in pending:
        return "said hello twice"
    if any(not j.agent for j in pending.values()):
        return ("ranks of this mesh are joining one process per rank (python -m monarch_worker): start host "
                "agents on every host or on none")
    if msg.nproc > free:
        return (f"the host agent of {host} brings {msg.nproc} ranks, but only {free} of the mesh's {world} are "
                "free: check --nproc-per-node on every host")
    g, hosts = msg.group_rank, msg.group_world_size
    if hosts > 0 and hosts * msg.nproc != world:
        return (f"the host agent of {host} was launched as one of {hosts} hosts with {msg.nproc} ranks each "
                f"({hosts * msg.nproc} ranks), but the mesh listens for {world}: launch {world // msg.nproc} "
                f"hosts, or listen with --world-size {hosts * msg.nproc}")
    for j in pending.values():
        if g >= 0 and j.hello.group_rank == g:
            return (f"host slot {g} is taken: the host agent of {j.hello.host} (pid {j.hello.pid}) claimed it "
                    f"first, and {host} claims it too. Two launches running at once, or a wrong --node-rank / "
                    f"SLURM_NODEID on one of them?")
    return ""


def waiting_report(world: int, waited: float, pending: dict[bytes, Joiner], rejected: list[str],
                   bad_peers: dict[str, int], address: str, launcher: Any) -> str:
    """Who joined and who is missing when the start timed out before all ranks (or host agents) came."""
    joined = list(pending.values())
    numbered = sorted(j.rank for j in joined if j.rank >= 0 and not j.agent)
    unnumbered = [j for j in joined if j.rank < 0 and not j.agent]
    lines = [f"{slots(pending)} of {world} ranks joined within {waited:g} s"]
    by_host: dict[str, list[str]] = {}
    for j in sorted(joined, key=lambda j: (j.hello.host, j.rank < 0, j.rank, j.arrival)):
        by_host.setdefault(j.hello.host, []).append(f"a host agent for {j.count} ranks" if j.agent else
                                                    str(j.rank) if j.rank >= 0 else "?")
    for host, ranks in by_host.items():
        lines.append(f"  {host}: {'rank(s) ' if not ranks[0].startswith('a host') else ''}{', '.join(ranks)}")
    missing = sorted(set(range(world)) - set(numbered))
    if unnumbered or any(j.agent for j in joined):
        lines.append(f"  missing: {world - slots(pending)} rank(s) (numbered once all joined)")
    elif missing:
        lines.append(f"  missing: {ranks_text(missing)}")
    lines += [f"  turned away: {why}" for why in rejected]
    lines += [f"  {n} message(s) from {peer} had a bad signature: that host has another mesh's secret (check "
              "MONARCH_SECRET_FILE / MONARCH_SECRET there)" for peer, n in bad_peers.items()]
    if launcher.on_this_host:  # torchrun or the agent, started here: slowness, or the launcher's own failure
        lines.append(f"Every rank starts on this host: raise the start timeout (now {waited:g} s:  %mesh start "
                     "--timeout S,  Mesh(start_timeout=S)).")
    else:
        lines.append(f"Check that the launch ran on every host and that those hosts reach {address} "
                     "(firewall? an address of the controller that they cannot route to?).")
    tail = launcher.log_tail()
    if tail:
        lines.append(f"{launcher.name} output ({getattr(launcher, 'log_path', '')}):")
        lines += [f"  {line}" for line in tail.splitlines()]
    return "\n".join(lines)
