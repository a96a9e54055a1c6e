"""A rank that raises never hangs the others: they are released from whatever they wait in for it.

Each test runs real training code on a real 2-rank gloo mesh in which rank 1 raises at a known step while rank 0
goes on into the next collective, which rank 1 will never issue. Rank 0 then waits in DDP's C++ reducer, in
autograd's engine, in FSDP2's or DTensor's collectives, in a barrier or in ``Work.wait()``: places where no
``torch.distributed`` Python frame needs to be on its stack. The controller compares the collectives each rank
issued (torch's flight recorder, monarch_worker.recovery.last_collective) and tears the process group down to
release rank 0, as torchrun's fail-fast would end it, but keeps every namespace and makes a fresh group.

What each test asserts: the cell raises MeshError, never MeshTimeoutError (the limit is far below the 1,800 s
collective timeout the cell would otherwise hang for, and far above what the release takes: bench/bench_faults.py
measures that); the raising rank is the root cause, first; rank 0 is reported as released from the collective;
and the next cell runs a collective without ``--force``, every rank's namespace kept.
"""

from __future__ import annotations

import os
import signal
import textwrap
import threading
import time
from collections.abc import Iterator

import pytest

from monarch_jupyter import Mesh, MeshError, MeshTimeoutError
from monarch_jupyter.errors import RankAbortedError
from monarch_jupyter.kernel.releases import waiting_for

pytestmark = pytest.mark.slow

WORLD = 2
LIMIT = 60.0  # seconds: a MeshTimeoutError means rank 0 was never released (it would wait 1,800 s)


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = Mesh(WORLD, interrupt_grace=1.5, start_timeout=120)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture()
def healthy(mesh: Mesh) -> Iterator[Mesh]:
    dead = [r for r, s in mesh.status().items() if s["state"] == "dead"]
    if dead:
        mesh.restart(ranks=dead)
    mesh.run("marker = rank * 10")
    yield mesh


def assert_recovered(mesh: Mesh) -> None:
    """A collective works on every rank with no --force, and every rank kept its namespace."""
    assert mesh.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())") == dict.fromkeys(range(WORLD), WORLD)
    assert mesh.run("marker") == {r: r * 10 for r in range(WORLD)}


def assert_released(err: MeshError, message: str) -> None:
    assert not isinstance(err, MeshTimeoutError), "rank 0 was never released"
    assert list(err.errors)[0] == 1, f"root cause is not the raising rank: {list(err.errors)}"
    assert str(err.errors[1]) == f"[rank1] RuntimeError: {message}"
    assert f"first failure: [rank1] RuntimeError: {message}" in str(err)
    released = err.errors[0]
    assert isinstance(released, RankAbortedError) and released.raised == "RuntimeError", repr(released)
    assert released.collective.startswith("gloo:"), released.collective
    shown = "\n".join(err._render_traceback_())
    assert shown.index("--- root cause: rank 1") < shown.index("--- rank 0: released from gloo:"), shown
    assert "which rank 1 never joined (it raised RuntimeError)" in shown, shown
    assert "rank 1 raised RuntimeError while rank 0 waited for it in a collective" in err.hint, err.hint
    assert "a fresh one was made (every rank kept its namespace; groups made with dist.new_group" in err.hint, err.hint


CASES = {
    "ddp_forward": """
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Linear(4, 1))
        for step in range(5):
            if rank == 1 and step == 1:
                raise RuntimeError("raised before forward at step 1")
            ddp(torch.ones(2, 4)).sum().backward()
        """,
    "ddp_backward": """
        from torch.nn.parallel import DistributedDataParallel as DDP
        torch.manual_seed(0)
        ddp = DDP(torch.nn.Linear(4, 1))
        for step in range(5):
            loss = ddp(torch.ones(2, 4)).sum()
            if rank == 1 and step == 2:
                raise RuntimeError("raised before backward at step 2")
            loss.backward()
        """,
    "fsdp2": """
        from torch.distributed.fsdp import fully_shard
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
        for layer in model:
            fully_shard(layer)
        fully_shard(model)
        for step in range(4):
            if rank == 1 and step == 2:
                raise RuntimeError("raised in an FSDP2 loop")
            model(torch.ones(2, 8)).sum().backward()
        """,
    "dtensor": """
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Replicate, Shard, distribute_tensor
        device_mesh = init_device_mesh("cpu", (world_size,))
        for step in range(4):
            if rank == 1 and step == 2:
                raise RuntimeError("raised before a redistribution")
            full = distribute_tensor(torch.arange(8.0), device_mesh, [Shard(0)]).redistribute(
                device_mesh, [Replicate()]).to_local()
        """,
    "barrier": """
        dist.all_reduce(torch.ones(1))
        if rank == 1:
            raise RuntimeError("raised before the barrier")
        dist.barrier()
        """,
    "uneven_sampler": """
        from torch.nn.parallel import DistributedDataParallel as DDP
        from torch.utils.data import DataLoader, DistributedSampler, TensorDataset
        data = TensorDataset(torch.randn(24, 4))
        sampler = DistributedSampler(data, num_replicas=world_size, rank=rank, shuffle=False)
        ddp = DDP(torch.nn.Linear(4, 1))
        for step, (x,) in enumerate(DataLoader(data, batch_size=2 + rank, sampler=sampler)):  # uneven batches
            if rank == 1 and step == 3:
                raise RuntimeError("raised at step 3 of an uneven loader")
            ddp(x).sum().backward()
        """,
    "work_wait": """
        for step in range(4):
            if rank == 1 and step == 2:
                raise RuntimeError("raised between async collectives")
            work = dist.all_reduce(torch.ones(4), async_op=True)
            work.wait()
        """,
}


NEEDS = {"fsdp2": ("torch.distributed.fsdp", "fully_shard"), "dtensor": ("torch.distributed.tensor", "Replicate")}


@pytest.mark.parametrize("case", list(CASES))
def test_a_rank_that_raises_releases_the_others(healthy: Mesh, case: str) -> None:
    if case in NEEDS:  # public from torch 2.6 on (the oldest environment has 2.4)
        module, name = NEEDS[case]
        if not hasattr(__import__(module, fromlist=[name]), name):
            pytest.skip(f"{module}.{name} is not in torch {__import__('torch').__version__}")
    mesh = healthy
    before = {r: s["pid"] for r, s in mesh.status().items()}
    with pytest.raises(MeshError) as info:
        mesh.run(textwrap.dedent(CASES[case]), timeout=LIMIT)
    message = textwrap.dedent(CASES[case]).split('RuntimeError("', 1)[1].split('")', 1)[0]
    assert_released(info.value, message)
    assert {r: s["pid"] for r, s in mesh.status().items()} == before  # nobody was killed
    assert_recovered(mesh)


def test_without_the_flight_recorder_each_groups_count_decides(monkeypatch: pytest.MonkeyPatch) -> None:
    """Torch before 2.8 records no gloo collectives (and TORCH_FR_BUFFER_SIZE=0 turns the recorder off): the
    ranks then report each group's own count of the operations they issued, and the release works the same."""
    monkeypatch.setenv("TORCH_FR_BUFFER_SIZE", "0")
    mesh = Mesh(WORLD, interrupt_grace=1.5, start_timeout=120)
    try:
        mesh.run("marker = rank * 10")
        summary = mesh.run("from monarch_worker.recovery import last_collective\n"
                           "t = torch.ones(1); dist.all_reduce(t); c = last_collective(); (c['source'], c['name'])")
        assert summary == dict.fromkeys(range(WORLD), ("sequence", "gloo:collective")), summary
        with pytest.raises(MeshError) as info:
            mesh.run(textwrap.dedent(CASES["ddp_backward"]), timeout=LIMIT)
        message = textwrap.dedent(CASES["ddp_backward"]).split('RuntimeError("', 1)[1].split('")', 1)[0]
        assert_released(info.value, message)
        assert info.value.errors[0].collective.startswith("gloo:collective #"), info.value.errors[0].collective
        assert_recovered(mesh)
    finally:
        mesh.stop()


def test_a_torchrun_script_that_raises_in_ddp_releases_the_others(healthy: Mesh, tmp_path: object) -> None:
    """``%mesh run myddp.py --fail-rank 1``: the same script under torchrun ends with exit status 1."""
    script = os.path.join(str(tmp_path), "myddp.py")
    with open(script, "w") as f:
        f.write(textwrap.dedent("""
            import argparse
            import torch
            import torch.distributed as dist
            from torch.nn.parallel import DistributedDataParallel as DDP

            parser = argparse.ArgumentParser()
            parser.add_argument("--fail-rank", type=int, default=-1)
            args = parser.parse_args()
            dist.init_process_group("gloo")
            ddp = DDP(torch.nn.Linear(4, 1))
            for step in range(5):
                if dist.get_rank() == args.fail_rank and step == 1:
                    raise RuntimeError(f"rank {args.fail_rank} fails at step 1")
                ddp(torch.ones(2, 4)).sum().backward()
            dist.destroy_process_group()
            """))
    with pytest.raises(MeshError) as info:
        healthy.run_script(script, "--fail-rank", "1", timeout=LIMIT)
    assert_released(info.value, "rank 1 fails at step 1")
    assert_recovered(healthy)


def test_ranks_that_do_not_wait_for_the_raising_rank_are_not_released(healthy: Mesh) -> None:
    """Rank 0 works on without any collective the raising rank missed: it finishes, and its value is kept."""
    code = ("import time\nif rank == 1:\n    raise RuntimeError('rank 1 only')\n"
            "time.sleep(2.0)\nlocal = torch.ones(3).sum().item()\nlocal\n")
    with pytest.raises(MeshError) as info:
        healthy.run(code, timeout=LIMIT)
    err = info.value
    assert list(err.errors) == [1] and err.results == {0: 3.0}, (err.errors, err.results)
    assert "waited for it in a collective" not in err.hint
    assert_recovered(healthy)


def test_a_timeout_puts_the_rank_that_raised_first(healthy: Mesh) -> None:
    """Rank 0 waits in plain Python (nothing to release) past the timeout: the error names rank 1's exception as
    the root cause, first, and only then where the others were."""
    code = "import time\nif rank == 1:\n    raise ValueError('the real cause')\ntime.sleep(600)\n"
    with pytest.raises(MeshTimeoutError) as info:
        healthy.run(code, timeout=3)
    err = info.value
    assert err.late == [0] and list(err.errors)[0] == 1, (err.late, list(err.errors))
    assert str(err) == ("the cell did not finish within 3 s on rank 0; first failure: [rank1] ValueError: "
                        "the real cause"), str(err)
    shown = err._render_traceback_()
    text = "\n".join(shown)
    assert text.index("--- rank 1 (root cause: it failed before the timeout) ---") < text.index(
        "Where each rank was:"), text
    assert "[rank1] ValueError: the real cause" in text, text
    assert_recovered(healthy)


def test_an_interrupt_names_the_rank_that_raised_first(healthy: Mesh) -> None:
    code = "import time\nif rank == 1:\n    raise ValueError('the real cause')\nprint('waiting', flush=True)\n" \
           "time.sleep(600)\n"

    def poll() -> None:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and "rank 0: time.sleep at cell line 5" not in healthy.stacks().text:
            time.sleep(0.05)
        os.kill(os.getpid(), signal.SIGINT)

    poller = threading.Thread(target=poll, daemon=True)
    poller.start()
    with pytest.raises(KeyboardInterrupt) as info:
        healthy.run(code)
    poller.join()
    assert str(info.value).startswith("rank 1 had raised ValueError: the real cause; interrupted rank 0"), \
        str(info.value)
    assert_recovered(healthy)


def test_a_rank_that_dies_once_released_gets_no_group_without_it(healthy: Mesh) -> None:
    """Rank 0 is released from the all_reduce rank 1 never joins, and then exits: the controller must not make a
    fresh group that waits for the dead rank (it hung the start timeout, then left every rank 'starting' and the
    next  %mesh restart --rank  failing). The raising rank stays the root cause, ahead of the death."""
    code = textwrap.dedent("""
        import os
        t = torch.ones(1)
        if rank == 1:
            raise RuntimeError("boom before the all_reduce")
        try:
            dist.all_reduce(t)
        except Exception:
            os._exit(3)
        """)
    with pytest.raises(MeshError) as info:
        healthy.run(code, timeout=LIMIT)
    err = info.value
    assert not isinstance(err, MeshTimeoutError)
    assert list(err.errors) == [1, 0], list(err.errors)
    assert str(err.errors[1]) == "[rank1] RuntimeError: boom before the all_reduce"
    assert "no fresh one was made, since rank 0 is dead" in err.hint, err.hint
    assert "%mesh restart --rank 0" in err.hint, err.hint
    assert {r: s["state"] for r, s in healthy.status().items()} == {0: "dead", 1: "idle"}
    healthy.restart(ranks=[0])
    assert healthy.run("t = torch.ones(1); dist.all_reduce(t); int(t.item())") == {0: 2, 1: 2}


# ------------------------------------------------------------------------------- the decision, on recorder data

def summary(**groups: tuple[int, list[int]]) -> dict:
    """A rank's flight-recorder summary (Stacks.collective) with ``group=(seq, ranks)`` entries."""
    return {"name": "gloo:all_reduce", "seq": 0,
            "groups": {g: [seq, ranks, "gloo:all_reduce"] for g, (seq, ranks) in groups.items()}}


def test_waiting_for_compares_the_collectives_each_rank_issued() -> None:
    failed = {1: summary(**{"0": (4, [0, 1, 2])})}
    # Rank 0 issued #5, which rank 1 never will; rank 2 is at #4, still computing toward #5: not (yet) waiting.
    assert waiting_for(failed, {0: summary(**{"0": (5, [0, 1, 2])}), 2: summary(**{"0": (4, [0, 1, 2])})}) == {
        0: "gloo:all_reduce #5"}
    # A group without the raising rank does not count; one it never used does (it issued nothing there).
    assert waiting_for(failed, {0: summary(**{"0": (3, [0, 1, 2]), "7": (9, [0, 2])})}) == {}
    assert waiting_for(failed, {0: summary(**{"0": (4, [0, 1, 2]), "8": (1, [0, 1])})}) == {0: "gloo:all_reduce #1"}
    # A group whose ranks the rank could not tell is not counted (it may not hold the raising rank).
    assert waiting_for(failed, {0: summary(**{"0": (4, [0, 1, 2]), "9": (5, [])})}) == {}
    # A rank with no recorder summary is left to the caller's fallback (its stacks).
    assert waiting_for(failed, {0: {}}) == {}


def test_waiting_for_reads_a_sub_meshs_torch_ranks_as_its_mesh_ranks() -> None:
    """On a sub-mesh of mesh ranks [2, 3], torch ranks are 0 and 1: the stopped mesh rank 2 is torch rank 0 of
    the group (it was compared as torch rank 2, which the group does not hold, and nobody was released)."""
    failed = {2: summary(**{"0": (1, [0, 1])})}
    running = {3: summary(**{"0": (2, [0, 1])})}
    assert waiting_for(failed, running, peers=[2, 3]) == {3: "gloo:all_reduce #2"}
    assert waiting_for(failed, running) == {}  # read as mesh ranks: not a member
