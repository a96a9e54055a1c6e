"""A mesh that heals itself (on_rank_death="restart"): real ranks SIGKILLed, restarted through the fork server, given
back what the notebook sent, in a fresh process group with the survivors (kernel/healing.py, kernel/history.py)."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from monarch_jupyter import Mesh, MeshError
from monarch_jupyter.kernel.healing import SERVE_IDLE

pytestmark = pytest.mark.slow

WAIT = 120.0  # seconds a test waits for a state it asserts (the machine is shared and slow under load)


def wait_for(what: str, check: Callable[[], bool], timeout: float = WAIT) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g} s waiting for {what}")
        time.sleep(0.02)


def kill(m: Mesh, *ranks: int) -> dict[int, int]:
    """SIGKILL ``ranks`` and wait until the mesh has seen each death (so the next cell does not race it)."""
    pids = {r: m.status()[r]["pid"] for r in ranks}
    for pid in pids.values():
        os.kill(pid, signal.SIGKILL)
    wait_for("the deaths to be seen", lambda: all(
        m.status()[r]["pid"] != pid or m.status()[r]["state"] == "dead" or r in m.state.healing
        for r, pid in pids.items()))
    return pids


def notebook() -> dict:
    """A namespace like the notebook's: a function defined in ``__main__`` (sent to ranks by value)."""
    ns: dict = {"__name__": "__main__"}
    exec("def helper(v):\n    return v * 2\n\ndef hook():\n    import __main__\n    __main__.hooked = True\n", ns)
    return ns


def test_a_dead_rank_is_restarted_and_gets_back_what_the_notebook_sent(capfd: pytest.CaptureFixture) -> None:
    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        assert not m.parts.healer.queue.serving  # a mesh that lost no rank keeps no healer's thread
        m.push(x=41)
        m.scatter("part", list(range(4)))
        m.run("import os\ny = 5", replay=True)
        ns = notebook()
        m.run("z = helper(x)", namespace=ns)
        m.on_rejoin(ns["hook"])
        old = kill(m, 1)
        # The next cell waits for the replacement, then runs on both ranks in a fresh process group.
        got = m.run("(x, part, y, helper(1), 'z' in globals(), globals().get('hooked', False), os.getpid())")
        assert got[1][:6] == (41, [2, 3], 5, 2, False, True)  # z came from a cell not marked --replay
        assert got[0][:6] == (41, [0, 1], 5, 2, True, False)
        assert got[1][6] != old[1]
        assert m.run("t = torch.ones(1) * (rank + 1); dist.all_reduce(t); t.item()") == {0: 3.0, 1: 3.0}
        assert m.state.group_status().startswith("up")
    # The healer's thread ends once no death came for SERVE_IDLE seconds (a stopped mesh keeps no thread).
    wait_for("the healer's thread to end", lambda: not m.parts.healer.queue.serving, SERVE_IDLE + WAIT)
    err = capfd.readouterr().err
    assert "rank 1 died (signal SIGKILL) and was restarted (on_rank_death=restart)" in err
    assert "got back 2 pushed values, 1 notebook definition, 1 replayed cell and 1 on_rejoin hook" in err


def test_a_rank_restarted_by_hand_gets_back_what_the_notebook_sent_on_a_self_healing_mesh(
        capfd: pytest.CaptureFixture) -> None:
    """``%mesh restart --rank R`` gives a fresh rank what a healing gives it, on a mesh that keeps it; a mesh that
    keeps nothing says the rank starts with a fresh namespace (a fresh user's restarted rank failed with NameError,
    silently different from the others)."""
    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        m.push(x=41)
        m.run("import os\ny = 5", replay=True)
        old = m.status()[1]["pid"]
        m.restart(ranks=[1])
        assert m.run("(x, y, os.getpid())")[1][:2] == (41, 5) and m.status()[1]["pid"] != old
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    out = capfd.readouterr().out
    assert "restarted rank 1 (a fresh process); the other ranks kept their namespaces; a fresh process group of 2 " \
           "ranks; it got back 1 pushed value and 1 replayed cell" in out, out
    with Mesh(2, start_timeout=WAIT) as m:
        m.push(x=41)
        m.restart(ranks=[1])
        assert m.run("'x' in globals()") == {0: True, 1: False}
    out = capfd.readouterr().out
    assert "restarted rank 1 (a fresh process)" in out and "it starts with a fresh namespace" in out and \
        "--on-rank-death restart" in out, out


def test_a_cell_running_when_a_rank_dies_fails_as_before_then_the_rank_comes_back() -> None:
    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        with pytest.raises(MeshError) as info:
            m.run("import os, signal, time\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
                  "t = torch.ones(1)\ndist.all_reduce(t)\n")
        assert "restarted by the mesh (on_rank_death=restart)" in str(info.value.hint)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}


def test_two_deaths_at_once_are_healed_together() -> None:
    with Mesh(4, on_rank_death="restart", start_timeout=WAIT, oversubscribe=True) as m:
        m.push(w=7)
        kill(m, 1, 2)
        assert m.run("w + rank") == {0: 7, 1: 8, 2: 9, 3: 10}
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(4), 4.0)


def test_a_rank_that_keeps_dying_is_given_up_and_the_mesh_stays_usable(capfd: pytest.CaptureFixture) -> None:
    flag = f"/tmp/monarch-heal-{os.getpid()}"
    with Mesh(2, on_rank_death="restart", restart_limit=1, start_timeout=WAIT) as m:
        # The replayed cell kills every replacement of rank 1: a rank that dies during its own healing.
        m.run(f"import os, signal\nif rank == 1 and os.path.exists({flag!r}):\n"
              "    os.kill(os.getpid(), signal.SIGKILL)", replay=True)
        open(flag, "w").close()
        try:
            kill(m, 1)
            wait_for("rank 1 to be given up", lambda: m.status()[1]["state"] == "dead" and not m.state.healing)
        finally:
            os.unlink(flag)
        said = "rank 1 died 2 times within 60 s (restart_limit 1): it is not restarted again"
        err = ""

        def told() -> bool:  # the output thread writes the note, maybe after the state changed
            nonlocal err
            err += capfd.readouterr().err
            return said in err

        wait_for("the note that rank 1 is given up", told)
        assert "the replay of" not in err, err  # it died again: not reported as a replay that failed
        assert m.run("rank", ranks=0) == {0: 0}  # the survivor runs cells of its own
        with pytest.raises(MeshError, match="not run"):
            m.run("rank")
        m.restart(ranks=1)  # by hand, as the message says (no replay: the flag is gone anyway)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}


def test_the_cell_that_sees_the_death_past_the_limit_says_it_is_given_up_not_restarted(
        capfd: pytest.CaptureFixture) -> None:
    """The decision to give up is taken as the rank dies, so the cell that saw that death says so (a fresh user got
    "restarted by the mesh" in that cell's error, and the give-up line in an earlier cell)."""
    suicide = ("import os, signal\nif rank == 1:\n    os.kill(os.getpid(), signal.SIGKILL)\n"
               "t = torch.ones(1)\ndist.all_reduce(t)")
    with Mesh(2, on_rank_death="restart", restart_limit=1, start_timeout=WAIT) as m:
        with pytest.raises(MeshError) as first:
            m.run(suicide)
        assert "restarted by the mesh (on_rank_death=restart)" in first.value.hint
        with pytest.raises(MeshError) as second:  # waits for the replacement, which then dies the same way
            m.run(suicide)
        hint = second.value.hint
        assert "rank 1 died 2 times within 60 s (restart_limit 1): it is not restarted again" in hint, hint
        assert "restarted by the mesh" not in hint
        assert m.status()[1]["state"] == "dead" and 1 not in m.state.healing
        assert m.run("rank", ranks=0) == {0: 0}
        m.restart(ranks=1)
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == {0: 2.0, 1: 2.0}
    assert "restart_limit" not in capfd.readouterr().err  # said once, in the cell's error, not as a stray line


def test_interrupting_a_cell_that_waits_for_a_restart_says_so_in_one_line() -> None:
    """The notebook's interrupt of a cell waiting for a healing rank: one line (a MeshInterrupt), nothing ran, and
    the healing goes on (a fresh user got the controller's frames)."""
    import _thread
    import sys
    import threading

    from monarch_jupyter.errors import MeshInterrupt

    flag = f"/tmp/monarch-heal-slow-{os.getpid()}"
    main = threading.get_ident()

    def interrupt_when_waiting() -> None:  # SIGINT's effect, once the main thread waits for the healing
        wait_for("the cell to wait for the healing", lambda: any(
            f.f_code.co_name == "_wait_healed" for f in _frames(sys._current_frames().get(main))))
        _thread.interrupt_main()

    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        m.run(f"import os, time\nif rank == 1 and os.path.exists({flag!r}):\n    os.unlink({flag!r})\n"
              "    time.sleep(5)", replay=True)  # the replacement gets this back: its healing takes 5 s
        open(flag, "w").close()
        try:
            kill(m, 1)
            threading.Thread(target=interrupt_when_waiting, daemon=True).start()
            with pytest.raises(MeshInterrupt) as info:
                m.run("rank")
        finally:
            if os.path.exists(flag):
                os.unlink(flag)
        text = "".join(info.value._render_traceback_())
        assert "waited for rank 1 to be restarted (on_rank_death=restart): it did not run" in text, text
        assert "\n" not in text.strip()
        assert m.run("rank") == {0: 0, 1: 1}  # the healing went on; this cell waits for it, then runs


def test_a_death_while_a_given_up_rank_stays_dead_restarts_the_rank_without_a_group(
        capfd: pytest.CaptureFixture) -> None:
    """No process group can be made while a rank given up (past restart_limit) stays dead: the next death's
    replacement starts without one, gets back what the notebook sent, and cells do not wait (a fresh user's
    ``run("rank", timeout=20)`` waited for a regroup that could never happen, past its timeout)."""
    with Mesh(4, on_rank_death="restart", restart_limit=1, start_timeout=WAIT, oversubscribe=True) as m:
        m.push(w=7)
        first = kill(m, 1)
        wait_for("rank 1 to be restarted", lambda: m.status()[1]["state"] == "idle"
                 and m.status()[1]["pid"] != first[1] and not m.state.healing)
        kill(m, 1)  # its second death within restart_window: given up
        wait_for("rank 1 to be given up", lambda: m.status()[1]["state"] == "dead" and not m.state.healing)
        old = kill(m, 2)
        with pytest.raises(MeshError, match="not run") as info:  # rank 1 is dead: said at once, not after 60 s
            m.run("rank", timeout=60)
        assert 1 in info.value.errors
        wait_for("rank 2 to be restarted", lambda: m.status()[2]["state"] == "idle"
                 and m.status()[2]["pid"] != old[2] and not m.state.healing)
        assert m.run("w + rank", ranks=[0, 2, 3]) == {0: 7, 2: 9, 3: 10}  # it got back what the notebook sent
        m.restart(ranks=1)  # as the note says: a group of every rank
        assert m.run("t = torch.ones(1); dist.all_reduce(t); t.item()") == dict.fromkeys(range(4), 4.0)
    err = capfd.readouterr().err
    assert ("rank 2 died (signal SIGKILL) and was restarted (on_rank_death=restart) in" in err
            and "it is in no process group, as rank 1 stays dead" in err), err


def test_a_cell_waits_for_a_restart_no_longer_than_its_timeout() -> None:
    """A cell waits for a healing rank at most its own timeout: MeshTimeoutError, nothing ran; the healing goes
    on and a later cell runs on the replacement."""
    from monarch_jupyter.errors import MeshTimeoutError

    flag = f"/tmp/monarch-heal-hold-{os.getpid()}"
    with Mesh(2, on_rank_death="restart", start_timeout=WAIT) as m:
        # The replacement gets this cell back and holds its healing until the flag is gone.
        m.run(f"import os, time\nwhile rank == 1 and os.path.exists({flag!r}):\n    time.sleep(0.02)", replay=True)
        open(flag, "w").close()
        try:
            kill(m, 1)
            with pytest.raises(MeshTimeoutError) as info:
                m.run("rank", timeout=1.0)
            assert info.value.late == [1]
            assert "the cell did not run: rank 1 was still being restarted (on_rank_death=restart) after its " \
                   "timeout of 1 s" in info.value.hint, info.value.hint
            assert 1 in m.state.healing  # the healing goes on
        finally:
            if os.path.exists(flag):
                os.unlink(flag)
        assert m.run("rank") == {0: 0, 1: 1}


def test_a_cell_that_waited_for_a_healing_that_failed_repeats_no_earlier_note(capfd: pytest.CaptureFixture) -> None:
    """The cell that waited for a healing repeats its note; when that healing gave up, it repeated the note of an
    earlier one ("rank 1 ... was restarted", helper-61), although the rank stayed dead."""
    flag = f"/tmp/monarch-heal-stale-{os.getpid()}"
    with Mesh(2, on_rank_death="restart", restart_limit=2, start_timeout=WAIT) as m:
        m.run(f"import os, signal\nif rank == 1 and os.path.exists({flag!r}):\n"
              "    os.kill(os.getpid(), signal.SIGKILL)", replay=True)
        first = kill(m, 1)
        wait_for("rank 1 to be restarted", lambda: m.status()[1]["state"] == "idle"
                 and m.status()[1]["pid"] != first[1] and not m.state.healing)
        assert m.state.healed_note
        open(flag, "w").close()
        try:
            kill(m, 1)  # its replacement dies in its replay: a third death, given up
            with pytest.raises(MeshError, match="not run"):
                m.run("rank", timeout=WAIT)
        finally:
            os.unlink(flag)
    err = capfd.readouterr().err
    assert "rank 1 died 3 times within 60 s (restart_limit 2)" in err, err
    assert "note: rank 1 died (signal SIGKILL) and was restarted" not in err, err


def test_a_replacement_on_a_split_mesh_says_it_joined_its_sub_meshs_group(capfd: pytest.CaptureFixture) -> None:
    with Mesh(4, on_rank_death="restart", start_timeout=WAIT, oversubscribe=True) as m:
        a, b = m.split(2)
        old = kill(m, 3)
        assert b.run("t = torch.ones(1); dist.all_reduce(t); t.item()", timeout=WAIT) == {0: 2.0, 1: 2.0}
        assert m.status()[3]["pid"] != old[3]
        assert a.run("rank") == {0: 0, 1: 1}
    err = capfd.readouterr().err
    assert "joined a fresh process group with the others of its sub-mesh" in err, err


def _frames(frame: object) -> list:
    out = []
    while frame is not None:
        out.append(frame)
        frame = frame.f_back  # type: ignore[attr-defined]
    return out


def test_report_stays_the_default() -> None:
    with Mesh(2, start_timeout=WAIT) as m:
        assert m.on_rank_death == "report"
        kill(m, 1)
        wait_for("rank 1 dead", lambda: m.status()[1]["state"] == "dead")
        with pytest.raises(MeshError, match="not run"):
            m.run("rank")


def test_ranks_that_joined_one_process_per_rank_cannot_be_restarted_and_say_so(
        capfd: pytest.CaptureFixture) -> None:
    from tests.conftest import reap
    from tests.integration.test_join import start_ranks

    m = Mesh.listen(2, show=False, on_rank_death="restart", heartbeat_timeout=3.0, timeout=WAIT)
    procs = start_ranks(m, 2)
    try:
        assert m.wait_ready(WAIT)
        pids = m.status()
        victim = next(p for p in procs if p.pid == pids[1]["pid"])
        victim.kill()
        wait_for("rank 1 to be given up", lambda: m.status()[1]["state"] == "dead" and not m.state.healing)
        said = "rank 1 died and cannot be restarted from here (these ranks were started one process per rank elsewhere"
        err = ""

        def told() -> bool:  # the note is written by the output thread, maybe after the state changed
            nonlocal err
            err += capfd.readouterr().err
            return said in err

        wait_for("the note that rank 1 cannot be restarted", told)
        assert m.run("rank", ranks=0) == {0: 0}  # the survivor is usable
    finally:
        m.stop()
        reap(procs)
