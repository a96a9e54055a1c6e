"""A host agent's loss is told once, and whoever learns of it second waits until it was told.

Found under load (CI, test_agent_launcher ``test_a_killed_agent_takes_its_ranks_and_fails_the_cell[9]``): the I/O
thread saw the killed agent's connection drop and marked it gone, then, while it had not yet declared its ranks
lost, the launcher's waiter thread saw ``--launcher agent`` exit. ``HostLinks.all_gone`` found no live agent and
returned at once, and the waiter reported the ranks' exits itself: the cell said "died (signal SIGKILL)" instead of
naming the host agent. The test holds the first teller inside the declaration and checks that the second
``all_gone`` returns only after it.
"""

from __future__ import annotations

import threading

from monarch_jupyter.kernel.config import MeshOptions
from monarch_jupyter.kernel.events import EventBus
from monarch_jupyter.kernel.launch.agents import Agent
from monarch_jupyter.kernel.launch.hosts import HostLinks
from monarch_jupyter.kernel.state import MeshState, RankState


def test_a_second_all_gone_returns_only_once_the_first_told_the_loss() -> None:
    state = MeshState(2, MeshOptions(), EventBus())
    state.new_generation(b"s")
    state.running = True
    for info in state.ranks.values():
        info.state = RankState.IDLE
    order: list[str] = []
    told: list[tuple[list[int], str]] = []
    telling, release = threading.Event(), threading.Event()

    def lost(ranks: list[int], reason: str) -> None:  # deaths.Deaths.ranks_lost, held open by the test
        telling.set()
        assert release.wait(30)
        told.append((ranks, reason))
        order.append("told")

    links = HostLinks(state, None, None, None, None, None, lost)  # type: ignore[arg-type]
    agent = Agent(b"agent", "host-a", 4242, "tcp://host-a:1", [0, 1], {})
    links.agents = {agent.identity: agent}

    first = threading.Thread(target=links.all_gone, args=("disconnected",))
    first.start()
    assert telling.wait(30)  # the first teller is inside the declaration

    def second_teller() -> None:
        links.all_gone("exited (signal SIGKILL)")
        order.append("second returned")

    second = threading.Thread(target=second_teller)
    second.start()
    second.join(0.5)  # it must still wait: were it to return now, its caller would report plain exits first
    release.set()
    first.join(30)
    second.join(30)
    assert not first.is_alive() and not second.is_alive()
    assert order == ["told", "second returned"], order
    assert told == [([0, 1], "its host agent (pid 4242 on host-a) disconnected")], told  # once, by the first
    assert agent.declared.is_set() and not agent.alive
