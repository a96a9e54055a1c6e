"""``%mesh interrupt`` (``Mesh.interrupt``) of an ``--async`` cell whose ranks are stuck in a collective: the ranks
that did not stop stay marked as running that interrupted cell, so new code is refused with RankBusyError (its
collective would pair with the stuck one and give wrong values, or hang), the handle does not say done, and
``--force`` frees them. A fresh user's case: the next cell was accepted and its all_reduce paired with the stuck
one (rank 0 got 301.0)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from jupyter_client.manager import KernelManager

from monarch_jupyter import Mesh, MonarchError
from monarch_jupyter.errors import RankBusyError
from tests.integration.test_kernel_faults import execute, kernel

__all__ = ["kernel"]  # the fixture, imported

pytestmark = pytest.mark.slow

WAIT = 120.0
SUM = "t = torch.ones(1)\ndist.all_reduce(t)\nt.item()"
STUCK = ("if rank != 0:\n    t = torch.ones(1) * 100\n    dist.all_reduce(t)\n"
         "else:\n    import time\n    time.sleep(3600)")


def in_collective(m: Mesh, ranks: list[int]) -> None:
    """Wait until ``ranks`` (of the mesh) are blocked in the all_reduce's ``work.wait()``, seen there twice 0.1 s
    apart: an interrupt that lands before, in the Python around it (torch's c10d_logger wrapper), stops them (a CI
    run under load saw rank 1 "interrupted" where it was to be stuck)."""
    def blocked() -> bool:
        replies = m.stacks(ranks).replies
        return all(r in replies and replies[r].frames and replies[r].frames[-1][3].strip() == "work.wait()"
                   for r in ranks)

    deadline = time.monotonic() + WAIT
    seen = 0
    while seen < 2:
        seen = seen + 1 if blocked() else 0
        assert time.monotonic() < deadline, m.stacks(ranks).summary()
        time.sleep(0.1)


def test_interrupt_of_an_async_cell_stuck_in_a_collective_refuses_new_code(kernel: tuple[KernelManager, Any]) -> None:
    _, kc = kernel
    r = execute(kc, "%load_ext monarch_jupyter\nm = %mesh start -n 4\n%config MeshMagics.live_view = 'off'")
    assert r.status == "ok", r.traceback
    r = execute(kc, "%%mesh --async\n" + STUCK)
    assert r.status == "ok", r.traceback
    r = execute(kc, "h = _\nfrom tests.integration.test_interrupt_stuck import in_collective\n"
                    "in_collective(m, [1, 2, 3])")
    assert r.status == "ok", r.traceback
    r = execute(kc, "%mesh interrupt --grace 2")
    assert r.status == "ok", r.traceback
    shown = r.stdout + r.stderr + "".join(r.results)
    assert "interrupted rank 0" in shown and "ranks 1-3 did not stop" in shown, shown
    r = execute(kc, "%%mesh --timeout 30\n" + SUM)
    assert (r.status, r.ename) == ("error", "RankBusyError"), (r.status, r.ename, r.results, r.traceback)
    assert "ranks 1-3 still run an earlier cell that was interrupted" in r.evalue, r.evalue
    assert "%mesh interrupt --force --ranks 1-3" in r.evalue, r.evalue
    r = execute(kc, "print(repr(h))")
    assert r.status == "ok" and ": running>" in r.stdout, (r.stdout, r.traceback)
    r = execute(kc, "%mesh split 2")
    shown = r.stdout + r.stderr + r.evalue
    assert "no split while a cell runs" in shown and "%mesh interrupt --force --ranks 1-3" in shown, shown
    r = execute(kc, "%mesh interrupt --force --ranks 1-3 --grace 5")
    assert r.status == "ok", r.traceback
    r = execute(kc, "%%mesh --timeout 60\n" + SUM)
    assert r.status == "ok" and r.results == ["{0: 4.0, 1: 4.0, 2: 4.0, 3: 4.0}"], (r.results, r.traceback)
    r = execute(kc, "print(repr(h))")
    assert r.status == "ok" and ": failed on ranks 0-3>" in r.stdout, (r.stdout, r.traceback)  # interrupted


def test_interrupt_of_a_stuck_sub_mesh_refuses_its_code_only() -> None:
    with Mesh(4, start_timeout=WAIT, interrupt_grace=2.0) as m:
        a, b = m.split(2)
        handle = a.run("if rank != 0:\n    t = torch.ones(1) * 100\n    dist.all_reduce(t)\n"
                       "else:\n    import time\n    time.sleep(3600)", block=False)
        in_collective(m, [1])
        report = a.interrupt()
        assert report.interrupted == [0] and report.stuck == [1], report.text
        with pytest.raises(RankBusyError, match="interrupt --force --ranks 1"):
            a.run(SUM, timeout=30)  # paired with the stuck all_reduce, it gave {0: 101.0}
        assert not handle.done()
        assert b.run(SUM, timeout=30) == {0: 2.0, 1: 2.0}  # the other sub-mesh runs on
        with pytest.raises(MonarchError, match="interrupt --force --ranks 1"):
            m.merge()
        a.interrupt(force=True)
        assert a.run(SUM, timeout=60) == {0: 2.0, 1: 2.0}
        m.merge()
        assert m.run(SUM, timeout=60) == dict.fromkeys(range(4), 4.0)


def test_a_death_in_one_sub_mesh_leaves_the_others_group_up(capsys: pytest.CaptureFixture) -> None:
    """After rank 3 (sub1) died: a cell on sub0 gets no "process group is down" note, and a rank of sub0 that
    raises while its peer waits in a collective releases it and sub0 gets a fresh group (it got none, "since rank
    3 is dead", and every collective of sub0 failed after)."""
    from monarch_jupyter import MeshError

    with Mesh(4, start_timeout=WAIT) as m:
        a, b = m.split(2)
        with pytest.raises(MeshError):
            b.run("import os\nif rank == 1:\n    os._exit(7)", timeout=60)
        capsys.readouterr()
        assert a.run(SUM, timeout=60) == {0: 2.0, 1: 2.0}
        assert "process group is down" not in capsys.readouterr().err
        with pytest.raises(MeshError) as info:
            a.run("if rank == 0:\n    raise RuntimeError('boom')\nt = torch.ones(1)\ndist.all_reduce(t)", timeout=60)
        assert "a fresh one was made" in info.value.hint, info.value.hint
        capsys.readouterr()
        assert a.run(SUM, timeout=60) == {0: 2.0, 1: 2.0}
        assert "process group is down" not in capsys.readouterr().err
        assert b.run("rank", ranks=0, timeout=60) == {0: 0}  # sub1's rank 1 is dead: its group is down
        assert "process group is down (rank 3 died)" in capsys.readouterr().err
