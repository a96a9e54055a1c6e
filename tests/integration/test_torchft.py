"""torchft on a self-healing mesh: a DDP loop written for torchft in a --rejoin cell keeps training when a rank is
SIGKILLed at a known step; the replacement heals live from its peer and both end with bitwise-equal weights."""

from __future__ import annotations

import os
import signal
import time

import pytest

from monarch_jupyter import Mesh, MeshError

pytest.importorskip("torchft")
pytestmark = pytest.mark.slow

WAIT = 120.0

SETUP = """
import os, signal, time, torch
from monarch_worker import ft
from torchft import Optimizer
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4))
opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
"""

# A torchft loop as torchft's own train_ddp.py writes it; rank 1 kills itself once (a marker file), at its first step
# from DIE_AT on (a rank that fell behind heals to its peer's step and may skip DIE_AT itself; DIE_AT=-1: never):
# before the step (WHERE="step"), or after its forward, so that rank 0's gradient allreduce fails ("allreduce").
LOOP = """
manager = ft.manager(state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                     load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])))
ddp, optim = ft.DistributedDataParallel(manager, model), Optimizer(manager, opt)
steps = []
while manager.current_step() < STEPS:
    step = manager.current_step()
    if rank == 1 and 0 <= DIE_AT <= step and WHERE == "step" and not os.path.exists(FLAG):
        open(FLAG, "w").close()
        os.kill(os.getpid(), signal.SIGKILL)
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    optim.zero_grad()
    loss = ((ddp(x) - y) ** 2).mean()
    if rank == 1 and 0 <= DIE_AT <= step and WHERE == "allreduce" and not os.path.exists(FLAG):
        open(FLAG, "w").close()  # in the step's quorum already: rank 0's gradient allreduce fails while it waits
        time.sleep(2)  # (so that rank 0 is inside it: an allreduce that starts after the death fails at once)
        os.kill(os.getpid(), signal.SIGKILL)
    loss.backward()
    optim.step()
    if manager.current_step() > step:  # committed: the step the quorum was at (a replacement's first is the peer's)
        steps.append((manager.current_step() - 1, manager.num_participants(), time.time()))
manager.shutdown()
manager.current_step()
"""


# Rank 2 gives one step up (torchft's report_error, as after a failed collective) without joining the allreduce its
# peers are waiting in; the collective's timeout (TIMEOUT) is far longer than the test waits.
GIVE_UP = """
manager = ft.manager(timeout=TIMEOUT, state_dict=lambda: {"model": model.state_dict(), "opt": opt.state_dict()},
                     load_state_dict=lambda sd: (model.load_state_dict(sd["model"]), opt.load_state_dict(sd["opt"])))
ddp, optim = ft.DistributedDataParallel(manager, model), Optimizer(manager, opt)
while manager.current_step() < STEPS:
    step = manager.current_step()
    g = torch.Generator().manual_seed(step)
    x, y = torch.randn(32, 16, generator=g), torch.randn(32, 4, generator=g)
    optim.zero_grad()
    if rank == 2 and step == GIVE_UP_AT and not os.path.exists(FLAG):
        open(FLAG, "w").close()
        manager.wait_quorum()  # the step's process group is configured: the peers' allreduce waits on this rank
        time.sleep(1)
        manager.report_error(RuntimeError("rank 2 gives this step up"))
    else:
        ((ddp(x) - y) ** 2).mean().backward()
    optim.step()
manager.shutdown()
manager.current_step()
"""

@pytest.fixture()
def flag(tmp_path: object) -> str:
    return os.path.join(str(tmp_path), "died")


@pytest.mark.parametrize("where", ["step", "allreduce"])
def test_a_rank_sigkilled_at_a_known_step_heals_from_its_peer_and_trains_on(flag: str, where: str) -> None:
    """``allreduce``: the survivor's allreduce fails; torchft's managed future is never completed then, and DDP's
    reducer waited for it inside backward forever (bench_elastic's 4-rank runs stalled there).

    min_replicas 2: after the death rank 0 waits in the next quorum for the replacement, which then heals from its
    live state. With torchft's default of 1 rank 0 trained on alone, and under load (scripts/stress.sh) it finished
    all 60 steps before the replacement came, which then started from step 0 with no peer to heal from."""
    with Mesh(2, on_rank_death="restart", torchft=True, torchft_min_replicas=2, start_timeout=WAIT) as m:
        lighthouse = m.parts.lighthouse.proc
        assert lighthouse is not None and lighthouse.poll() is None
        env = m.run("import os\n{k: os.environ.get(k) for k in ('TORCHFT_LIGHTHOUSE', 'REPLICA_GROUP_ID', "
                    "'NUM_REPLICA_GROUPS')}")
        assert env[1] == {"TORCHFT_LIGHTHOUSE": m.parts.lighthouse.address, "REPLICA_GROUP_ID": "1",
                          "NUM_REPLICA_GROUPS": "2"}
        m.push(STEPS=60, DIE_AT=20, FLAG=flag, WHERE=where)
        m.run(SETUP, replay=True)
        handle = m.run(LOOP, rejoin=True, block=False)
        assert handle.result(timeout=WAIT) == {0: 60, 1: 60}
        assert os.path.exists(flag), "rank 1 did not die at its step"
        steps = m.pull("steps")
        # The replacement started from the quorum's step, not from 0: it healed from rank 0's live state.
        assert steps[1][0][0] >= 20 and steps[1][-1][0] == 59
        # Rank 0 trained through (from where it joined at the start: either replica may heal from the other then).
        first = steps[0][0][0]
        assert first < 20 and [s for s, _, _ in steps[0]] == list(range(first, 60))
        both = [s for s, n, _ in steps[0] if n == 2]
        assert both[-1] == 59 and any(s > 20 for s in both)
        weights = m.pull("model")
        a, b = weights[0].state_dict(), weights[1].state_dict()
        assert all(a[k].equal(b[k]) for k in a), "the replicas' weights differ"
        # Once the loop ended, the mesh's own process group is made again with the replacement.
        deadline = time.monotonic() + WAIT
        while not m.state.group_status().startswith("up") and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    assert lighthouse.poll() is not None, "the Lighthouse outlived its mesh"


def test_a_rank_that_gives_a_step_up_frees_its_peers_at_once(flag: str) -> None:
    """A rank whose step failed aborts its gloo group (ft.manager): the peers waiting on it in the allreduce fail at
    once instead of after the collective's timeout (600 s here; the test waits 120 s), and all train on."""
    with Mesh(3, torchft=True, start_timeout=WAIT) as m:
        m.push(STEPS=20, GIVE_UP_AT=8, FLAG=flag, TIMEOUT=600.0)
        m.run(SETUP)
        assert m.run(GIVE_UP, timeout=WAIT) == {0: 20, 1: 20, 2: 20}
        assert os.path.exists(flag), "rank 2 did not give its step up"
        weights = m.pull("model")
        first = weights[0].state_dict()
        assert all(all(first[k].equal(w.state_dict()[k]) for k in first) for w in weights.values())


def test_the_lighthouse_is_started_again_when_it_dies(capfd: pytest.CaptureFixture) -> None:
    with Mesh(2, torchft=True, start_timeout=WAIT) as m:
        first = m.parts.lighthouse.proc
        address = m.parts.lighthouse.address
        assert first is not None
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + WAIT
        while m.parts.lighthouse.restarts == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert m.parts.lighthouse.address == address
        m.push(STEPS=5, DIE_AT=-1, FLAG="/nonexistent", WHERE="step")
        m.run(SETUP)
        assert m.run(LOOP, timeout=WAIT) == {0: 5, 1: 5}
    assert f"exited with code -9; it was started again at {address}" in capfd.readouterr().err


def test_without_torchft_the_helper_says_how_to_start_it() -> None:
    with Mesh(1, start_timeout=WAIT) as m:
        err = m.run("from monarch_worker import ft\nmsg = ''\ntry:\n    ft.replica_group()\n"
                    "except ft.FtSetupError as e:\n    msg = str(e)\nmsg")
        assert "%mesh start --torchft" in err[0]


def test_fewer_ranks_than_min_replicas_wait_visibly_and_the_interrupt_works(flag: str) -> None:
    with Mesh(2, on_rank_death="restart", restart_limit=0, torchft=True, torchft_min_replicas=2,
              start_timeout=WAIT) as m:
        m.push(STEPS=1000, DIE_AT=5, FLAG=flag, WHERE="step")
        m.run(SETUP, replay=True)
        handle = m.run(LOOP, rejoin=True, block=False)
        deadline = time.monotonic() + WAIT
        while not (os.path.exists(flag) and m.status()[1]["state"] == "dead" and not m.state.healing):
            assert time.monotonic() < deadline, "rank 1 was not given up"
            time.sleep(0.05)
        # Rank 0 waits for a quorum of 2 in torchft's Manager: where it waits is visible.
        deadline = time.monotonic() + WAIT
        while "quorum" not in (where := m.stacks(0).text):
            assert time.monotonic() < deadline, where
            time.sleep(0.2)
        report = m.interrupt(0)
        assert report.interrupted == [0], report.text
        with pytest.raises(MeshError) as info:
            handle.result(timeout=WAIT)
        assert "[rank1] died (signal SIGKILL; not restarted)" in str(info.value)
        assert "%mesh restart --rank 1" in str(info.value.hint)
        m.restart(ranks=1)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}


def test_report_shows_the_step_and_the_quorum_in_the_live_view() -> None:
    # min_replicas 2: every quorum holds both ranks (with torchft's default of 1, a rank that comes late under load
    # finds a quorum of one already formed, and the last quorum shown is 1/2: right, but not what is asserted here)
    with Mesh(2, torchft=True, torchft_min_replicas=2, start_timeout=WAIT) as m:
        seen: list[dict] = []
        m.add_listener(lambda kind, data: seen.append(data) if kind == "progress" else None)
        m.push(STEPS=5, DIE_AT=-1, FLAG="/nonexistent", WHERE="step")
        m.run(SETUP)
        assert m.run(LOOP.replace("manager.shutdown()", "ft.report(manager, STEPS)\nmanager.shutdown()"),
                     timeout=WAIT) == {0: 5, 1: 5}
        m.events.flush()
        assert {(d["rank"], d["n"], d["total"], d["desc"], d["postfix"]) for d in seen} >= {
            (0, 5.0, 5.0, "torchft", "quorum=2/2"), (1, 5.0, 5.0, "torchft", "quorum=2/2")}, seen
