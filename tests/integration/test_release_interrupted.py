"""An interrupt (a blocking cell's timeout here) that stops some ranks while the others wait for them in a
collective releases the waiters (waiting.py, releases.py), in the cases a review found left behind: on a sub-mesh
whose mesh ranks are not its torch ranks, with released ranks that take longer than the grace to stop, with a rank
that had ended the cell without the collective, with a grace shorter than the check interval, and with a rank that
stops only after the grace (a long finally clause): the cell is abandoned, then its waiters are released; and an
--async cell whose group such a release tore down is told why."""

from __future__ import annotations

import textwrap
import time
from collections.abc import Iterator

import pytest

from monarch_jupyter import Mesh, MeshError, MeshTimeoutError

WORLD = 4
ALL_REDUCE = "t = torch.ones(1); dist.all_reduce(t); int(t.item())"


@pytest.fixture(scope="module")
def mesh() -> Iterator[Mesh]:
    m = Mesh(WORLD, interrupt_grace=1.5, start_timeout=120)
    try:
        yield m
    finally:
        m.stop()


@pytest.fixture()
def healthy(mesh: Mesh) -> Iterator[Mesh]:
    """The whole mesh, every rank idle in one working process group, ``marker`` set on each rank."""
    if mesh.subs:
        mesh.merge()
    mesh.interrupt_grace = 1.5
    wait_idle(mesh)
    assert mesh.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    mesh.run("marker = rank * 10")
    yield mesh


def wait_idle(mesh: Mesh, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while (text := mesh.stacks().text) != f"ranks 0-{WORLD - 1}: idle":
        assert time.monotonic() < deadline, text
        time.sleep(0.1)


def rendered(e: MeshTimeoutError) -> str:
    return "\n".join(e._render_traceback_())


def test_a_sub_mesh_whose_mesh_ranks_are_not_its_torch_ranks_is_released(healthy: Mesh) -> None:
    a, b = healthy.split([[0, 1], [2, 3]])
    code = "import time\nt = torch.ones(1)\nif rank == 0:\n    time.sleep(600)\nelse:\n    dist.all_reduce(t)\n"
    with pytest.raises(MeshTimeoutError) as info:
        b.run(code, timeout=1.0)  # its torch rank 0 is mesh rank 2
    text = rendered(info.value)
    assert ("rank 2 was interrupted while rank 3 waited for it in a collective: the process group was torn down "
            "to release it and a fresh one was made") in text, text
    assert "--force" not in text, text
    assert b.run(ALL_REDUCE) == {0: 2, 1: 2}  # a sub-mesh's results are keyed by its own ranks
    assert a.run(ALL_REDUCE) == {0: 2, 1: 2}  # the other sub-mesh kept its group
    healthy.merge()
    assert healthy.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    assert healthy.run("marker") == {r: r * 10 for r in range(WORLD)}


SLOW_CLEAN_UP = textwrap.dedent("""\
        import signal, time
        t = torch.ones(1)
        if rank == 3:
            time.sleep(600)
        else:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            try:
                dist.all_reduce(t)
            except Exception:
                time.sleep(3)  # a clean-up longer than the grace, which an interrupt cannot cut short
            finally:
                signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        """)


@pytest.mark.parametrize("then", ["next cell", "interrupt --force"])
def test_released_ranks_slower_than_the_grace_get_a_fresh_group_before_the_next_cell(
        healthy: Mesh, capsys: pytest.CaptureFixture, then: str) -> None:
    healthy.interrupt_grace = 1.0
    with pytest.raises(MeshTimeoutError) as info:
        healthy.run(SLOW_CLEAN_UP, timeout=1.0)
    text = rendered(info.value)
    assert "rank 3 was interrupted while ranks 0-2 waited for it in a collective" in text, text
    assert "a fresh one is made before the next cell, once every rank stopped" in text, text
    wait_idle(healthy)
    capsys.readouterr()
    made_again = "was made again now that its ranks stopped; every rank kept its namespace"
    if then == "interrupt --force":  # on idle ranks: makes it at once, and says so
        text = healthy.interrupt(force=True).text
        assert text.startswith("nothing to interrupt: ranks 0-3 idle\n") and made_again in text, text
    assert healthy.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    err = capsys.readouterr().err
    assert (made_again in err) == (then == "next cell"), err
    assert healthy.run("marker") == {r: r * 10 for r in range(WORLD)}


def test_a_rank_that_ended_the_cell_without_the_collective_releases_the_others_with_a_short_grace(
        healthy: Mesh) -> None:
    healthy.interrupt_grace = 0.3  # shorter than the check interval (COLLECTIVE_CHECK): asked once all the same
    code = "t = torch.ones(1)\nif rank != 1:\n    dist.all_reduce(t)\n"
    with pytest.raises(MeshTimeoutError) as info:
        healthy.run(code, timeout=1.0)
    text = rendered(info.value)
    assert ("rank 1 had ended the cell while ranks 0,2,3 waited for it in a collective: the process group was torn "
            "down to release them and a fresh one was made") in text, text
    assert "--force" not in text, text
    assert healthy.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    assert healthy.run("marker") == {r: r * 10 for r in range(WORLD)}


LONG_FINALLY = textwrap.dedent("""\
        import signal, time
        t = torch.ones(1)
        try:
            if rank == 0:
                time.sleep(600)
            else:
                dist.all_reduce(t)
        finally:
            signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
            time.sleep(3)  # a clean-up longer than the grace, which an interrupt cannot cut short
            signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})
        """)


@pytest.mark.parametrize("where", ["mesh", "sub-mesh"])
def test_ranks_that_wait_for_a_rank_slower_than_the_grace_are_released_once_it_stops(
        healthy: Mesh, capsys: pytest.CaptureFixture, where: str) -> None:
    """Rank 0 (of the sub-mesh: mesh rank 2) leaves the cell only after the grace: nobody had stopped within it, so
    the cell is abandoned with every rank still running it; once rank 0 stops, the ranks waiting for it in the
    all_reduce are released, and the next cell runs in a fresh group, without --force."""
    healthy.interrupt_grace = 1.0  # one interrupt: none is sent again within the grace
    target = healthy if where == "mesh" else healthy.split([[0, 1], [2, 3]])[1]
    slow, waiting = ("rank 0", "ranks 1-3") if where == "mesh" else ("rank 2", "rank 3")
    with pytest.raises(MeshTimeoutError) as info:
        target.run(LONG_FINALLY, timeout=1.0)
    text = rendered(info.value)
    stuck = "0-3" if where == "mesh" else "2,3"
    assert f"%mesh interrupt --force --ranks {stuck}  stops the ranks still running" in text, text
    wait_idle(healthy)  # before: ranks 1-3 stayed in the all_reduce until --force
    deadline = time.monotonic() + 30  # every rank ended it: its record leaves the cell table (it stayed for good)
    while healthy.state.cells:
        assert time.monotonic() < deadline, sorted(healthy.state.cells)
        time.sleep(0.05)
    capsys.readouterr()
    expected = dict.fromkeys(range(WORLD), WORLD) if where == "mesh" else {0: 2, 1: 2}
    assert target.run(ALL_REDUCE) == expected
    err = capsys.readouterr().err
    assert (f"the process group torn down earlier ({slow} was interrupted while {waiting} waited for it in a "
            "collective) was made again now that its ranks stopped") in err, err
    if where == "sub-mesh":
        healthy.merge()
    assert healthy.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    assert healthy.run("marker") == {r: r * 10 for r in range(WORLD)}


PAIR_LOOP = textwrap.dedent("""\
        import pathlib, time
        for i in range(1200):  # about a minute of all_reduce on the group of ranks 2 and 3 alone
            t = torch.ones(1)
            dist.all_reduce(t, group=g23)
            if i == 0 and rank == 2:
                pathlib.Path({flag!r}).write_text("in the loop")
            time.sleep(0.05)
        """)


def test_an_async_cell_whose_group_another_cells_release_tore_down_is_told_why(healthy: Mesh, tmp_path) -> None:
    """Releasing ranks 0 and 1 tears down the process groups of every rank of the mesh: an --async cell that ranks
    2 and 3 run meanwhile on a group of their own sees its collective fail, and its error says why."""
    healthy.run("g23 = dist.new_group([2, 3])")
    flag = tmp_path / "flag"
    handle = healthy.run(PAIR_LOOP.format(flag=str(flag)), ranks=[2, 3], block=False)
    deadline = time.monotonic() + 60
    while not flag.exists():
        assert time.monotonic() < deadline and not handle.done(), "ranks 2 and 3 never ran their all_reduce"
        time.sleep(0.05)
    code = "import time\nt = torch.ones(1)\nif rank == 0:\n    time.sleep(600)\nelse:\n    dist.all_reduce(t)\n"
    with pytest.raises(MeshTimeoutError):
        healthy.run(code, ranks=[0, 1], timeout=1.0)
    with pytest.raises(MeshError) as info:
        handle.result(timeout=120)
    text = "\n".join(info.value._render_traceback_())
    assert ("the process group of ranks 2,3 was torn down while this cell ran, to release the ranks of another "
            "cell") in text, text
    assert "rank 0 was interrupted while rank 1 waited for it in a collective" in text, text
    wait_idle(healthy)
    assert healthy.run(ALL_REDUCE) == dict.fromkeys(range(WORLD), WORLD)
    assert healthy.run("marker") == {r: r * 10 for r in range(WORLD)}
