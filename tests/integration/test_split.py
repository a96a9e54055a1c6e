"""Sub-meshes (issue 29, item 1): ``mesh.split`` / ``%mesh split`` on real local ranks and through a real kernel.
Each sub-mesh is its own default process group numbered from 0 (torch.distributed, torchrun's variables and the
namespace agree), runs collectives while another sub-mesh runs its own, refuses code only while one of its own ranks
is stuck, and ``merge`` gives back one group of the whole mesh; namespaces are kept throughout, and bad input leaves
the mesh usable."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from monarch_jupyter import Mesh, MeshTimeoutError, MonarchError
from monarch_jupyter.errors import RankBusyError
from tests.integration.test_kernel_faults import execute, kernel

__all__ = ["kernel"]  # the fixture, imported

pytestmark = pytest.mark.slow

WAIT = 120.0
NUMBERS = ("import os\n(rank, world_size, dist.get_rank(), dist.get_world_size(), os.environ['RANK'], "
           "os.environ['WORLD_SIZE'], os.environ['LOCAL_RANK'], os.environ['LOCAL_WORLD_SIZE'], os.getpid())")
SUM = "t = torch.tensor([float(x)])\ndist.all_reduce(t)\nt.item()"


def test_split_runs_collectives_on_both_halves_at_once_then_merges(tmp_path: Path) -> None:
    gate = tmp_path / "go"
    with Mesh(4, start_timeout=WAIT) as m:
        m.run("x = rank * 10")
        pids = {r: v[-1] for r, v in m.run(NUMBERS).items()}
        a, b = m.split(2)
        assert (a.name, a.ranks, b.name, b.ranks) == ("sub0", [0, 1], "sub1", [2, 3])
        assert m.subs == {"sub0": a, "sub1": b}
        assert m.state.group_status() == ("up (gloo, 4 of 4 ranks; split into sub-meshes sub0 (ranks 0,1: idle) | "
                                          "sub1 (ranks 2,3: idle))")
        for sub in (a, b):
            got = sub.run(NUMBERS)
            assert {r: v[:8] for r, v in got.items()} == {
                r: (r, 2, r, 2, str(r), "2", str(r), "2") for r in (0, 1)}
            assert {r: v[8] for r, v in got.items()} == {r: pids[g] for r, g in enumerate(sub.ranks)}

        # sub1's rank 1 waits inside an all_reduce until sub1's rank 0 sees the gate; meanwhile sub0's collectives
        # complete with sub0's values, which they could not if the halves shared a process group.
        waiting = b.run(f"import os, time\nif rank == 0:\n    while not os.path.exists({str(gate)!r}):\n"
                        f"        time.sleep(0.05)\n{SUM}", block=False)
        assert a.run(SUM) == {0: 10.0, 1: 10.0}
        assert a.run("t = torch.tensor([float(rank)])\ndist.broadcast(t, src=1)\nt.item()") == {0: 1.0, 1: 1.0}
        assert not waiting.done()
        assert m.state.group_status() == ("up (gloo, 4 of 4 ranks; split into sub-meshes sub0 (ranks 0,1: idle) | "
                                          f"sub1 (ranks 2,3: running cell {waiting.cell_id}))")
        gate.touch()
        assert waiting.result(WAIT) == {0: 50.0, 1: 50.0}
        assert waiting.ranks == [0, 1]

        m.merge()
        assert m.subs == {} and not a.alive
        assert m.state.group_status() == "up (gloo, 4 of 4 ranks)"
        back = m.run(NUMBERS)
        assert {r: v[:8] for r, v in back.items()} == {
            r: (r, 4, r, 4, str(r), "4", str(r), "4") for r in range(4)}
        assert {r: v[8] for r, v in back.items()} == pids, "a rank was replaced"
        assert m.run(SUM) == dict.fromkeys(range(4), 60.0)  # namespaces kept through split and merge
        with pytest.raises(MonarchError, match="no longer exists"):
            a.run("1")

        # Named groups of unequal size, then merged again.
        big, one = m.split([[0, 2, 3], [1]], names=["big", "one"])
        assert big.run(SUM) == {0: 50.0, 1: 50.0, 2: 50.0}
        assert one.run("(rank, world_size, x)") == {0: (0, 1, 10)}
        assert (repr(big), repr(one)) == ("<SubMesh big: 3 ranks, mesh ranks 0,2,3>",
                                          "<SubMesh one: 1 rank, mesh ranks 1>")
        m.merge()
        assert m.run("world_size") == dict.fromkeys(range(4), 4)


def test_bad_splits_and_merges_leave_the_mesh_usable() -> None:
    with Mesh(4, start_timeout=WAIT) as m:
        m.run("x = rank")
        for groups, words in (([[0, 1], [1, 2, 3]], "rank 1 is in more than one group"),
                              ([[0, 1], [2]], "rank 3 is in no group"),
                              ([[0, 1, 2, 3, 4], [5]], "ranks 4,5 are not in the mesh"),
                              (3, "do not split into 3 equal sub-meshes"),
                              ([[0, 1, 2, 3]], "2 or more non-empty groups")):
            with pytest.raises(ValueError, match=words):
                m.split(groups)
        with pytest.raises(ValueError, match="distinct Python names"):
            m.split(2, names=["a", "a"])
        with pytest.raises(MonarchError, match="nothing to merge"):
            m.merge()
        assert m.run(SUM) == dict.fromkeys(range(4), 6.0)

        a, b = m.split(2)
        with pytest.raises(MonarchError, match="split already"):
            m.split(2)
        with pytest.raises(MonarchError, match="merge it first"):
            m.scale(2)
        with pytest.raises(ValueError):
            a.run("1", ranks=2)  # sub-mesh numbers: 0 and 1 only
        running = a.run("import time\ntime.sleep(2)\nrank", block=False)
        with pytest.raises(MonarchError, match="a cell runs on sub0"):
            m.merge()
        assert b.run(SUM) == {0: 5.0, 1: 5.0}  # the other sub-mesh is unaffected
        assert running.result(WAIT) == {0: 0, 1: 1}
        m.merge()
        assert m.run(SUM) == dict.fromkeys(range(4), 6.0)


def test_a_stuck_sub_mesh_never_blocks_another() -> None:
    with Mesh(4, start_timeout=WAIT, interrupt_grace=2.0) as m:
        m.run("x = rank")
        a, b = m.split(2)
        # sub1's rank 0 waits in a barrier for its peer, which an interrupt cannot reach (it blocks SIGINT for
        # 15 s, as a long call into C code would): nobody stops, so nothing is released.
        with pytest.raises(MeshTimeoutError):
            b.run("import signal, time\nif rank == 0:\n    dist.barrier()\nelse:\n"
                  "    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})\n    time.sleep(15)\n"
                  "    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})", timeout=3.0)
        with pytest.raises(RankBusyError):
            b.run(SUM)  # code on sub1 would pair with the stuck barrier
        assert a.run(SUM) == {0: 1.0, 1: 1.0}  # sub0 runs on
        with pytest.raises(MonarchError, match="a cell runs"):
            m.merge()
        b.interrupt(force=True, grace=120)  # releases the barrier, then rank 1 stops: sub1 alone gets a fresh group
        assert b.run(SUM) == {0: 5.0, 1: 5.0}
        assert a.run(SUM) == {0: 1.0, 1: 1.0}
        m.merge()
        assert m.run(SUM) == dict.fromkeys(range(4), 6.0)


def test_split_waits_for_the_packages_background_work_instead_of_refusing(tmp_path: Path) -> None:
    """Lightning's warm-up import (sent when the notebook imports lightning) is no cell of the user's: a split
    waits for it (a fresh user's ``import lightning`` then ``m.split(2)`` was refused with "a cell runs")."""
    import threading

    gate = tmp_path / "gate"
    with Mesh(2, start_timeout=WAIT) as m:
        handle = m.run(f"import os, time\nwhile not os.path.exists({str(gate)!r}):\n    time.sleep(0.02)", block=False)
        m.parts.cells.mark_background(handle)  # as lightning.launch.warm_up marks its import
        outcome: dict[str, Any] = {}

        def split() -> None:
            try:
                outcome["subs"] = m.split(2)
            except BaseException as e:  # noqa: BLE001 - asserted below
                outcome["error"] = e

        t = threading.Thread(target=split)
        t.start()
        t.join(1.0)
        gate.touch()
        t.join(WAIT)
        assert not t.is_alive() and "error" not in outcome, outcome
        a, b = outcome["subs"]
        assert a.run("dist.get_world_size()") == {0: 1} and b.run("dist.get_world_size()") == {0: 1}
        m.merge()


def test_two_stuck_sub_meshes_released_at_once_both_regroup() -> None:
    """Two sub-meshes stuck in collectives, force-interrupted from two threads at once (a sweep's interrupt stops
    every trial so): both regroup and run on, and the mesh merges (two regroups at once shared the mesh's regroup
    state, and a fresh user's kernel hung with its ranks "starting")."""
    import threading

    with Mesh(4, start_timeout=WAIT, interrupt_grace=2.0) as m:
        m.run("x = rank")
        subs = m.split(2)
        for sub in subs:  # each sub-mesh's rank 0 waits in a barrier its peer never joins
            with pytest.raises(MeshTimeoutError):
                sub.run("if rank == 0:\n    dist.barrier()", timeout=3.0)
        errors: list[BaseException] = []

        def release(sub: Any) -> None:
            try:
                sub.interrupt(force=True)
            except BaseException as e:  # noqa: BLE001 - asserted below
                errors.append(e)

        threads = [threading.Thread(target=release, args=(sub,)) for sub in subs]
        for t in threads:
            t.start()
        for t in threads:
            t.join(WAIT)
        assert not any(t.is_alive() for t in threads) and not errors, errors
        assert [sub.run(SUM, timeout=WAIT) for sub in subs] == [{0: 1.0, 1: 1.0}, {0: 5.0, 1: 5.0}]
        m.merge()
        assert m.run(SUM, timeout=WAIT) == dict.fromkeys(range(4), 6.0)


def test_split_in_the_notebook(kernel: tuple[KernelManager, Any], tmp_path: Path) -> None:
    _, kc = kernel
    r = execute(kc, "%load_ext monarch_jupyter\nm = %mesh start -n 4\n%config MeshMagics.live_view = 'off'")
    assert r.status == "ok", r.traceback
    assert execute(kc, "%%mesh\nkept = rank + 100").status == "ok"
    r = execute(kc, "%mesh split 0,1 2-3 --names left,right")
    assert r.status == "ok", r.traceback
    r = execute(kc, "%%mesh --mesh right\nt = torch.ones(1)\ndist.all_reduce(t)\n(rank, world_size, t.item(), kept)")
    assert r.status == "ok", r.traceback
    assert ast.literal_eval(r.results[0]) == {0: (0, 2, 2.0, 102), 1: (1, 2, 2.0, 103)}
    r = execute(kc, "%%mesh --mesh left --ranks 1\n(rank, kept)")
    assert ast.literal_eval(r.results[0]) == {1: (1, 101)}
    r = execute(kc, "repr(right)")  # bound in the notebook under its name
    assert "mesh ranks 2,3" in r.results[0], r.results
    # %mesh status names each sub-mesh, its ranks and what they run (an --async cell on right, waiting for a file)
    gate = tmp_path / "go"
    r = execute(kc, f"%%mesh --mesh right --async\nimport os, time\nwhile not os.path.exists({str(gate)!r}):\n"
                    "    time.sleep(0.05)\n")
    assert r.status == "ok", r.traceback
    r = execute(kc, "h = _\nprint(h.cell_id)\n%mesh status")
    assert r.status == "ok", r.traceback
    cell = r.stdout.strip().splitlines()[-1]
    assert (f"split into sub-meshes left (ranks 0,1: idle) | right (ranks 2,3: running cell {cell})"
            in r.results[0]), r.results
    gate.touch()
    assert execute(kc, "h.result(120)").status == "ok"
    r = execute(kc, "%%mesh --mesh nowhere\n1")
    assert r.status == "error" and "sub-meshes are left, right" in r.stderr, (r.stderr, r.traceback)
    r = execute(kc, "%mesh split 0,1 1,2,3")
    assert r.status == "error" and "more than one group" in r.stderr, (r.stderr, r.traceback)
    r = execute(kc, "%mesh merge")
    assert r.status == "ok" and "merged left, right" in r.stdout, r.traceback
    r = execute(kc, "%%mesh\nt = torch.ones(1)\ndist.all_reduce(t)\n(world_size, t.item(), kept)")
    assert ast.literal_eval(r.results[0]) == {r: (4, 4.0, 100 + r) for r in range(4)}
    # %mesh restart --rank on a split mesh regroups the whole mesh: its line says the split ended
    assert execute(kc, "%mesh split 2 --names a,b").status == "ok"
    r = execute(kc, "%mesh restart --rank 3")
    assert r.status == "ok", r.traceback
    assert "restarted rank 3, which ended the split: a, b merged into one process group of 4 ranks" in r.stdout, (
        r.stdout)
    r = execute(kc, "(m.subs, a.alive, m.run('(world_size, globals().get(\\'kept\\'))'))")
    assert ast.literal_eval(r.results[0]) == ({}, False, {0: (4, 100), 1: (4, 101), 2: (4, 102), 3: (4, None)}), (
        r.results)
    assert execute(kc, "%mesh stop").status == "ok"
