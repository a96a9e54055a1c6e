"""Where ``%mesh scale`` puts new ranks on host agents (launch/placement.py): evenly over the live hosts, ties to the
lower GROUP_RANK, each up to the room its agent measured; hosts that came and wait are admitted first with all their
ranks; past the room, a message naming each host's room and the ways out. The real ranks: tests/multihost."""

from __future__ import annotations

import pytest

from monarch_jupyter.kernel.launch.agents import Agent
from monarch_jupyter.kernel.launch.capacity import IDLE_RANK_BYTES, RANKS_PER_CORE
from monarch_jupyter.kernel.launch.placement import place

GIB = 1 << 30


def agent(name: str, group_rank: int, ranks: list[int], limits: list[int] | None = None) -> Agent:
    return Agent(name.encode(), name, 1, "127.0.0.1", ranks, {}, group_rank=group_rank,
                 limits=[2, 64 * GIB, 1 << 20] if limits is None else limits)


def test_new_ranks_fill_the_hosts_evenly_ties_to_the_lower_group_rank() -> None:
    a, b = agent("a", 0, [0]), agent("b", 1, [1])
    plan = place([a, b], 2, 5, oversubscribe=False)
    assert plan.ranks == {b"a": [0, 2, 4], b"b": [1, 3]}
    assert plan.hosts == {2: "a", 3: "b", 4: "a"} and plan.admit == {}
    # A host that holds fewer ranks gets the new ones first
    plan = place([agent("a", 0, [0, 1, 2]), agent("b", 1, [3])], 4, 7, oversubscribe=False)
    assert plan.ranks == {b"a": [0, 1, 2, 6], b"b": [3, 4, 5]}


def test_a_full_host_is_skipped_and_past_every_hosts_room_the_scale_is_refused() -> None:
    small = [1, 2 * IDLE_RANK_BYTES, 1 << 20]  # room for 2 ranks (memory)
    plan = place([agent("a", 0, [0, 1], small), agent("b", 1, [2])], 3, 5, oversubscribe=False)
    assert plan.ranks == {b"a": [0, 1], b"b": [2, 3, 4]}
    with pytest.raises(ValueError) as info:
        place([agent("a", 0, [0], small), agent("b", 1, [1], small)], 2, 5, oversubscribe=False)
    text = str(info.value)
    assert text.startswith("5 ranks are more than the hosts of this mesh can carry (ranks held of the room each "
                           "has: a 1 of 2, b 1 of 2;"), text
    assert "add hosts" in text and "oversubscribe=True" in text
    assert place([agent("a", 0, [0], small)], 1, 4, oversubscribe=True).ranks == {b"a": [0, 1, 2, 3]}
    # An agent that did not say what its host carries (an older one): not limited
    assert len(place([agent("a", 0, [0], [])], 1, RANKS_PER_CORE * 4, oversubscribe=False).hosts) == \
        RANKS_PER_CORE * 4 - 1
    with pytest.raises(ValueError, match="no host agent is connected any more"):
        place([], 1, 2, oversubscribe=False)


def test_waiting_hosts_are_admitted_first_with_all_their_ranks_and_the_next_group_rank() -> None:
    a = agent("a", 0, [0])
    late, later = agent("late", 99, []), agent("later", 99, [])
    plan = place([a], 1, 5, oversubscribe=False, waiting=[(late, 2), (later, 3)])
    assert plan.admit == {b"late": [1, 2]}  # "later" brings 3 ranks: they do not fit in the growth; it waits
    assert plan.ranks == {b"a": [0, 3, 4], b"late": [1, 2]}
    assert plan.hosts == {1: "late", 2: "late", 3: "a", 4: "a"} and plan.admitted == {1, 2}
    assert late.ranks == [] and late.group_rank == 99  # the held agent itself is left as it was


def test_under_nccl_a_host_carries_no_more_ranks_than_its_cuda_devices_even_oversubscribed() -> None:
    two_gpus = [8, 64 * GIB, 1 << 20, 2]
    plan = place([agent("a", 0, [0], two_gpus), agent("b", 1, [1], [8, 64 * GIB, 1 << 20, 1])], 2, 3,
                 oversubscribe=False, gpus=True)
    assert plan.ranks == {b"a": [0, 2], b"b": [1]}  # b's one device is taken
    for oversubscribe in (False, True):
        with pytest.raises(ValueError, match="one CUDA device per rank"):
            place([agent("a", 0, [0, 1], two_gpus)], 2, 3, oversubscribe=oversubscribe, gpus=True)
    # gloo: the devices do not count; an older agent (3 limits) is not limited by devices
    assert len(place([agent("a", 0, [0, 1], two_gpus)], 2, 4, oversubscribe=False).hosts) == 2
    assert len(place([agent("a", 0, [0], [8, 64 * GIB, 1 << 20])], 1, 4, oversubscribe=False, gpus=True).hosts) == 3


@pytest.mark.parametrize(("value", "count"), [("0,1", 2), ("", 0), ("-1", 0), ("3", 1), ("0,-1,2", 1),
                                              ("GPU-8d2f,GPU-11aa", 2)])
def test_the_cuda_devices_an_agent_reports_follow_cuda_visible_devices(monkeypatch: pytest.MonkeyPatch,
                                                                         value: str, count: int) -> None:
    from monarch_worker.hostlimits import visible_gpus

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", value)
    assert visible_gpus() == count


def test_local_nccl_ranks_past_the_cuda_devices_are_refused_with_the_way_out() -> None:
    import torch

    from monarch_jupyter.kernel.launch.capacity import check_local_gpus

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    with pytest.raises(ValueError) as info:
        check_local_gpus(n + 1)
    assert f"{n + 1} ranks but {n} CUDA device(s) visible" in str(info.value)
    assert "--backend gloo" in str(info.value)
