"""Elastic resize of a live mesh (issue 27, item 5): ``mesh.scale(N)`` / ``%mesh scale -n N`` on real local ranks
and through a real kernel. Grown ranks are new processes that get what the notebook sent every rank; shrinking
stops the highest ranks; the ranks that stay keep their processes and namespaces; every rank is in a fresh process
group of the new size, with torchrun's numbers of the new world; and what is refused leaves the mesh as it was."""

from __future__ import annotations

import ast
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from monarch_jupyter import Mesh, MeshError, MonarchError
from tests.conftest import reap
from tests.integration.test_join import start_ranks
from tests.integration.test_kernel_faults import execute, kernel, wait_gone

__all__ = ["kernel"]  # the fixture, imported

pytestmark = pytest.mark.slow

WAIT = 120.0
ENV = ("import os\nt = torch.ones(1)\ndist.all_reduce(t)\n"
       "(rank, world_size, os.environ['RANK'], os.environ['WORLD_SIZE'], os.environ['LOCAL_WORLD_SIZE'], "
       "os.environ['TORCHELASTIC_RUN_ID'], t.item(), os.getpid())")


def test_scale_4_to_6_to_3_keeps_namespaces_and_makes_a_group_of_the_new_size() -> None:
    with Mesh(4, on_rank_death="restart", start_timeout=WAIT) as m:
        m.push(lr=0.5)
        m.run("import torch\nbase = torch.ones(2)", replay=True)
        m.run("mine = rank * 10")  # not replayable: only the ranks that ran it have it
        before = m.run(ENV)
        run_id = before[0][5]

        report = m.scale(6)
        assert (report.before, report.after, report.started, report.stopped) == (4, 6, [4, 5], [])
        assert "got 1 pushed value and 1 replayed cell" in report.text, report.text
        after = m.run(ENV)
        assert sorted(after) == list(range(6))
        for r, (rank, world, env_rank, env_world, local_world, rid, total, _pid) in after.items():
            assert (rank, world, env_rank, env_world, local_world, rid, total) == (r, 6, str(r), "6", "6", run_id,
                                                                                   6.0)
        assert all(after[r][7] == before[r][7] for r in range(4)), "a surviving rank was replaced"
        assert m.run("(globals().get('mine'), lr, base.sum().item())") == {
            0: (0, 0.5, 2.0), 1: (10, 0.5, 2.0), 2: (20, 0.5, 2.0), 3: (30, 0.5, 2.0), 4: (None, 0.5, 2.0),
            5: (None, 0.5, 2.0)}

        report = m.scale(3)
        assert (report.started, report.stopped) == ([], [3, 4, 5])
        assert wait_gone([after[r][7] for r in (3, 4, 5)]) == [], "a stopped rank is still running"
        small = m.run(ENV)
        assert {r: v[:7] for r, v in small.items()} == {
            r: (r, 3, str(r), "3", "3", run_id, 3.0) for r in range(3)}
        assert all(small[r][7] == before[r][7] for r in range(3))
        assert m.run("mine") == {0: 0, 1: 10, 2: 20}
        assert sorted(m.status()) == [0, 1, 2] and m.nproc == 3
        assert m.state.group_status() == "up (gloo, 3 of 3 ranks)"
        assert "world_size=3" in repr(m)
        # A full restart keeps the new size.
        m.restart()
        assert m.run("world_size") == {0: 3, 1: 3, 2: 3}


def test_bad_scales_are_refused_and_leave_the_mesh_as_it_was() -> None:
    with Mesh(2, start_timeout=WAIT) as m:
        pids = [s["pid"] for s in m.status().values()]
        for bad in (0, -1):
            with pytest.raises(ValueError, match="at least 1 rank"):
                m.scale(bad)
        for wrong in (True, 2.5, "2"):
            with pytest.raises(TypeError, match="the number of ranks the mesh should have, an int"):
                m.scale(wrong)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="above 0 seconds"):
            m.scale(3, timeout=0)
        with pytest.raises(ValueError, match="ranks on this host are more than it can carry"):
            m.scale(100_000)
        handle = m.run("import time\ntime.sleep(2)\nrank", block=False)
        with pytest.raises(MonarchError, match="a cell runs on ranks 0,1"):
            m.scale(3)
        assert handle.result(timeout=WAIT) == {0: 0, 1: 1}
        assert m.scale(2).text == "the mesh has 2 ranks already: nothing to do"
        with pytest.raises(MeshError):
            m.run("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                  "t = torch.ones(1)\ndist.all_reduce(t)")
        with pytest.raises(MonarchError, match=r"rank 1 is dead: restart it first with  %mesh restart --rank 1"):
            m.scale(3)
        m.restart(ranks=1)
        assert m.status()[0]["pid"] == pids[0]
        assert m.run("t = torch.ones(1)\ndist.all_reduce(t)\n(world_size, t.item())") == {0: (2, 2.0), 1: (2, 2.0)}


@pytest.mark.kernel
def test_scale_in_the_notebook(kernel: tuple[KernelManager, Any]) -> None:
    """%mesh scale -n N through a real kernel: its report, the ranks' new world, %mesh status, bad input."""
    _, kc = kernel
    r = execute(kc, "%load_ext monarch_jupyter\nm = %mesh start -n 2\n%config MeshMagics.live_view = 'off'")
    assert r.status == "ok", r.traceback
    assert execute(kc, "%%mesh\nkept = rank + 100").status == "ok"
    r = execute(kc, "%mesh scale -n 3")
    assert r.status == "ok", r.traceback
    assert "scaled from 2 to 3 ranks" in r.results[0] and "started rank 2" in r.results[0], r.results
    r = execute(kc, "%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(world_size, t.item(), globals().get('kept'))")
    assert r.status == "ok", r.traceback
    assert ast.literal_eval(r.results[0]) == {0: (3, 3.0, 100), 1: (3, 3.0, 101), 2: (3, 3.0, None)}
    r = execute(kc, "%mesh status")
    assert r.status == "ok", r.traceback
    shown = "".join(r.results)
    assert "mesh: world size 3; ranks 0-2: idle on ranks 0-2" in shown and "up (gloo, 3 of 3 ranks)" in shown, shown
    r = execute(kc, "%mesh scale -n 0")
    assert r.status == "error" and "at least 1 rank" in r.stderr, r.stderr
    r = execute(kc, "%mesh scale -n 1")
    assert r.status == "ok" and "stopped ranks 1,2" in r.results[0], (r.results, r.traceback)
    r = execute(kc, "%%mesh\n(world_size, kept)")
    assert r.status == "ok" and ast.literal_eval(r.results[0]) == {0: (1, 100)}, (r.results, r.traceback)
    r = execute(kc, "%mesh status")
    assert "mesh: world size 1; ranks 0: idle on rank 0" in "".join(r.results), r.results
    assert execute(kc, "%mesh stop").status == "ok"


def test_ranks_started_one_by_one_elsewhere_are_not_scaled_and_say_so() -> None:
    """Ranks started one process per rank by someone else (no host agent) cannot be placed from here."""
    m = Mesh.listen(1, timeout=WAIT, show=False)
    procs = start_ranks(m, 1)
    try:
        assert m.run("world_size") == {0: 1}
        with pytest.raises(MonarchError, match="one process per rank elsewhere, whose launcher owns their processes"):
            m.scale(2)
        assert m.nproc == 1 and m.run("world_size") == {0: 1}
    finally:
        m.stop()
        reap(procs)


def test_scale_gives_torchft_replica_groups_of_the_new_world() -> None:
    pytest.importorskip("torchft")
    with Mesh(2, torchft=True, start_timeout=WAIT) as m:
        m.scale(3)
        env = m.run("import os\n(os.environ['REPLICA_GROUP_ID'], os.environ['NUM_REPLICA_GROUPS'], "
                    "os.environ['TORCHFT_LIGHTHOUSE'])")
        assert env == {r: (str(r), "3", m.parts.lighthouse.address) for r in range(3)}
        m.scale(2)
        assert m.run("os.environ['NUM_REPLICA_GROUPS']") == {0: "2", 1: "2"}


def test_a_grown_rank_that_dies_is_healed_with_its_history_in_order() -> None:
    """What a new rank got is its history: when it dies, its replacement gets the push before the cell using it."""
    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        m.push(lr=0.5)
        m.run("w = lr * 2", replay=True)
        m.scale(3)
        with pytest.raises(MeshError):
            m.run("import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", ranks=2)
        assert m.run("t = torch.ones(1)\ndist.all_reduce(t)\n(w, t.item())") == dict.fromkeys(range(3), (1.0, 3.0))
