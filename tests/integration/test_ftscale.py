"""``mesh.scale(N)`` under a running torchft loop (issue 27, item 5; kernel/ftscale.py), on real ranks and a real
torchft Lighthouse: growing adds replica groups that heal live from a peer inside the running cell, shrinking stops
the highest ranks while the survivors' loop goes on through torchft's quorum; the default process group of the new
size is made once the loop ends. Before ftscale.py every scale here was refused ("a cell runs")."""

from __future__ import annotations

import os
import time

import pytest

from monarch_jupyter import Mesh, MonarchError

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

WAIT = 120.0

SETUP = """
import os, time, torch
from monarch_worker import ft
from torchft import Optimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

def load(sd):  # what torchft calls to heal this replica; rank DIE_RANK dies in its first heal (once: FLAG)
    if rank == DIE_RANK and not os.path.exists(FLAG):
        open(FLAG, "w").close()
        os.kill(os.getpid(), 9)
    model.load_state_dict(sd["model"])
    opt.load_state_dict(sd["opt"])
"""

# A torchft loop that runs until every replica agrees on its last step: once rank 0 commits a step with the quorum
# of the new size (``NUM_REPLICA_GROUPS``, which the scale sets beneath the running loop), it writes END = that step
# + 10; every replica stops there, the replica grown in the meantime included.
LOOP = """
manager = ft.manager(state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()}, load_state_dict=load)
ddp, optim = ft.DistributedDataParallel(manager, model), Optimizer(manager, opt)

def end():
    try:
        return int(open(END).read())
    except (FileNotFoundError, ValueError):
        return 10 ** 9

steps = []
while manager.current_step() < end():
    step = manager.current_step()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    optim.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    loss.backward()
    optim.step()
    if manager.current_step() > step:
        steps.append((manager.current_step() - 1, manager.num_participants()))
        open(STARTED, "w").close()
        if rank == 0 and not os.path.exists(END) and manager.num_participants() == WANT == int(
                os.environ["NUM_REPLICA_GROUPS"]):
            with open(END + ".tmp", "w") as f:
                f.write(str(manager.current_step() + 10))
            os.replace(END + ".tmp", END)
    time.sleep(0.05)
groups = os.environ["NUM_REPLICA_GROUPS"]
manager.shutdown()
manager.current_step()
"""


def _start_loop(m: Mesh, tmp: str, want: int, die_rank: int = -1) -> tuple[object, str]:
    end, started = os.path.join(tmp, "end"), os.path.join(tmp, "started")
    m.push(END=end, STARTED=started, WANT=want, DIE_RANK=die_rank, FLAG=os.path.join(tmp, "died"))
    m.run(SETUP, replay=True)
    handle = m.run(LOOP, rejoin=True, block=False)
    deadline = time.monotonic() + WAIT
    while not os.path.exists(started):
        assert time.monotonic() < deadline, "the loop committed no step"
        assert not handle.done(), handle.result()  # type: ignore[attr-defined]
        time.sleep(0.05)
    return handle, end


def _group_up(m: Mesh, n: int) -> None:
    deadline = time.monotonic() + WAIT
    while not m.state.group_status().startswith(f"up (gloo, {n} of {n}"):
        assert time.monotonic() < deadline, m.state.group_status()
        time.sleep(0.05)


def _equal_weights(m: Mesh) -> None:
    weights = m.pull("model")
    first = weights[0].state_dict()
    for r, w in weights.items():
        sd = w.state_dict()
        assert all(first[k].equal(sd[k]) for k in first), f"rank {r}'s weights differ from rank 0's"


def test_scale_2_to_3_under_a_torchft_loop_the_new_replica_heals_from_a_peer(tmp_path: object) -> None:
    with Mesh(2, on_rank_death="restart", torchft=True, start_timeout=WAIT) as m:
        # A running cell that is not a torchft loop is refused as before.
        other = m.run("import time\ntime.sleep(3)", block=False)
        with pytest.raises(MonarchError, match="a cell runs on ranks 0,1"):
            m.scale(3)
        other.result(timeout=WAIT)

        handle, end = _start_loop(m, str(tmp_path), 3)
        report = m.scale(3)
        assert (report.before, report.after, report.started, report.stopped) == (2, 3, [2], [])
        assert "joined the running torchft loop" in report.text and "when the running cell ends" in report.text, \
            report.text
        assert m.status()[2]["state"] in ("running", "idle")
        # Its ranks change once per loop: a second scale under it is refused with why (it cannot end before rank 2
        # committed 10 steps in the quorum of 3). A fresh user's shrink then grow under one loop hung the mesh.
        with pytest.raises(MonarchError, match="scaled already under the running torchft loop"):
            m.scale(2)
        result = handle.result(timeout=WAIT)  # type: ignore[attr-defined]
        last = int(open(end).read())
        assert result == {0: last, 1: last, 2: last}
        steps = m.pull("steps")
        # Rank 2 did not start from step 0: its first quorum found it behind and it healed from a live peer.
        assert steps[2][0][0] > 0 and steps[2][-1] == (last - 1, 3)
        assert m.pull("groups") == {0: "3", 1: "3", 2: "3"}
        _equal_weights(m)
        # Once the loop ended, the default process group of 3 ranks is made, with the new world's numbers.
        _group_up(m, 3)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); (t.item(), world_size, os.environ['WORLD_SIZE'])") \
            == dict.fromkeys(range(3), (3.0, 3, "3"))


def test_scale_3_to_2_under_a_torchft_loop_the_loop_finishes(tmp_path: object) -> None:
    with Mesh(3, torchft=True, torchft_min_replicas=2, start_timeout=WAIT) as m:
        handle, end = _start_loop(m, str(tmp_path), 2)
        with pytest.raises(ValueError, match="torchft_min_replicas=2"):
            m.scale(1)
        with pytest.raises(MonarchError, match="--on-rank-death restart"):  # the new rank would have no model
            m.scale(4)
        report = m.scale(2)
        assert (report.before, report.after, report.started, report.stopped) == (3, 2, [], [2]), report.text
        assert sorted(m.status()) == [0, 1]
        result = handle.result(timeout=WAIT)  # type: ignore[attr-defined]
        last = int(open(end).read())
        assert result == {0: last, 1: last}
        steps = m.pull("steps")
        assert steps[0][-1] == (last - 1, 2) and steps[1][-1] == (last - 1, 2)
        assert m.pull("groups") == {0: "2", 1: "2"}
        _equal_weights(m)
        _group_up(m, 2)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); (t.item(), world_size)") == {0: (2.0, 2), 1: (2.0, 2)}


def test_a_grown_rank_that_dies_in_its_heal_is_restarted_and_rejoins_the_loop(tmp_path: object) -> None:
    with Mesh(2, on_rank_death="restart", torchft=True, start_timeout=WAIT) as m:
        handle, end = _start_loop(m, str(tmp_path), 3, die_rank=2)
        report = m.scale(3)
        assert report.started == [2], report.text
        result = handle.result(timeout=WAIT)  # type: ignore[attr-defined]
        assert os.path.exists(os.path.join(str(tmp_path), "died")), "rank 2 did not die in its heal"
        last = int(open(end).read())
        assert result == {0: last, 1: last, 2: last}
        _equal_weights(m)
        _group_up(m, 3)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(3), 3.0)
