"""An interrupt that stops a rank between issuing a collective and waiting for it: torch has enqueued it and gloo
has sent that rank's part, so the collective stays in flight after the cell ended. Every rank stopped, so the
process group looked fine, and the peers' next collective paired with the abandoned one: wrong values, then one
rank hung at the cell's last collective (a sweep whose pruned trial left it this way hung the next trial on that
sub-mesh, CI's notebooks/10_sweeps.ipynb). The mesh compares the ranks' collective numbers after such an
interrupt and re-creates the group when they differ, whichever way the interrupt came: ``Mesh.interrupt``
(``%mesh interrupt``, a pruned trial), a cell's timeout, a sub-mesh's. Each rank keeps its namespace."""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import pytest

from monarch_jupyter import CellHandle, Mesh, MeshError, MeshTimeoutError

pytestmark = pytest.mark.slow

WAIT = 120.0
# Rank 1 (of the group) issues an all_reduce its peer never issues, does not wait for it, then sleeps: an
# interrupt stops both ranks in time.sleep, with rank 1 one collective ahead.
ORPHAN = ("w = torch.zeros(1)\n"
          "if rank == 1:\n    work = dist.all_reduce(torch.full((1,), 100.0), async_op=True)\n")
SUM = "t = torch.tensor([rank + 1.0])\ndist.all_reduce(t)\nt.item()"
SKEW = re.compile(r"rank 1 issued gloo:all_reduce #\d+, which rank 0 never issued")


def asleep(code: str, marks: Path) -> str:
    """``code``, then each rank marks that it got past it (a file in ``marks``) and sleeps."""
    return f"{code}\nimport pathlib, time\npathlib.Path({str(marks)!r}, f'r{{rank}}').touch()\ntime.sleep(600)"


def run_asleep(runner: Any, code: str, marks: Path, ranks: int = 2) -> Any:
    """Run ``asleep(code, marks)`` with ``block=False`` on ``runner`` (a mesh or a sub-mesh) and wait until its
    ``ranks`` ranks sleep (an interrupt before would stop a rank before its collective); returns the handle."""
    handle = runner.run(asleep(code, marks), block=False)
    both_sleep(marks, ranks)
    return handle


def both_sleep(marks: Path, ranks: int = 2) -> None:
    """Wait until every rank reached its sleep (an interrupt before would stop rank 1 before its all_reduce)."""
    deadline = time.monotonic() + WAIT
    while len(list(marks.iterdir())) < ranks:
        assert time.monotonic() < deadline, sorted(p.name for p in marks.iterdir())
        time.sleep(0.05)


def test_interrupt_of_an_unmatched_collective_re_creates_the_group(tmp_path: Path) -> None:
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        m.run(SUM)  # a collective before: the numbers agree and are not zero
        handle = run_asleep(m, ORPHAN, tmp_path)
        assert isinstance(handle, CellHandle)
        report = m.interrupt()
        assert report.interrupted == [0, 1] and not report.stuck, report.text
        assert SKEW.search(report.text) and "the process group was re-created" in report.text, report.text
        assert handle.wait(WAIT)
        # Without the fresh group rank 0's all_reduce paired with rank 1's abandoned one (101.0), and rank 1's hung.
        assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}
        assert m.run("w.tolist()") == {0: [0.0], 1: [0.0]}  # namespaces kept
        # An interrupt that stops every rank at the same collective number leaves the group as it is.
        marks = tmp_path / "again"
        marks.mkdir()
        run_asleep(m, "pass", marks)
        report = m.interrupt()
        assert report.interrupted == [0, 1] and not report.realigned, report.text
        assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}


def test_point_to_point_traffic_and_matched_groups_of_its_own_are_left_alone(tmp_path: Path) -> None:
    with Mesh(3, start_timeout=WAIT, interrupt_grace=5.0) as m:
        m.run("g = dist.new_group([0, 1])")
        # send/recv are counted by a group's own sequence number, not by the flight recorder: no regroup for them.
        run_asleep(m, "t = torch.ones(1)\nif rank == 0:\n    dist.send(t, 1)\n    dist.send(t, 2)\n"
                      "else:\n    dist.recv(t, 0)\nif rank < 2:\n    dist.all_reduce(t, group=g)", tmp_path, 3)
        report = m.interrupt()
        assert report.interrupted == [0, 1, 2] and not report.realigned, report.text
        assert m.run("u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u, group=g)\nu.item()", ranks=[0, 1],
                     timeout=60) == {0: 3.0, 1: 3.0}


def test_a_group_of_its_own_left_unmatched_fails_at_once_until_made_again(tmp_path: Path) -> None:
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        m.run("g = dist.new_group([0, 1])")
        left = "t = torch.full((1,), 100.0)\nif rank == 1:\n    work = dist.all_reduce(t, group=g, async_op=True)"
        run_asleep(m, left, tmp_path)
        report = m.interrupt()
        assert "the process group was re-created" in report.text and "dist.new_group" in report.text, report.text
        # The old group's connections were shut down: its next collective fails at once, never pairs with the
        # abandoned one (before: rank 0 got 101.0 and rank 1 hung, past even --force).
        with pytest.raises(MeshError) as caught:
            m.run("u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u, group=g)\nu.item()", timeout=60)
        assert not isinstance(caught.value, MeshTimeoutError), caught.value
        assert m.run("g = dist.new_group([0, 1])\nu = torch.ones(1) * (rank + 1)\ndist.all_reduce(u, group=g)\n"
                     "u.item()", timeout=60) == {0: 3.0, 1: 3.0}
        # The same with no interrupt: the cell raised, both ranks were idle when the group was re-created (their
        # main threads once destroyed it before the I/O thread cut its connections, and the old g stayed connected:
        # rank 1's next collective on it waited for the abandoned one, about one mesh in three).
        for _ in range(3):
            with pytest.raises(MeshError) as caught:
                m.run(left + "\nraise ValueError('bad batch')", timeout=60)
            assert "the process group was re-created" in caught.value.hint, caught.value.hint
            with pytest.raises(MeshError) as caught:
                m.run("u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u, group=g)\nu.item()", timeout=60)
            assert not isinstance(caught.value, MeshTimeoutError), caught.value
            m.run("g = dist.new_group([0, 1])")


def test_a_stale_group_used_after_a_regroup_leaves_the_fresh_groups_alone() -> None:
    # A fresh group reuses the old one's name (names count from "0" again after a regroup). The stale group's
    # collective, one ahead on rank 1 since the abandoned one, was counted as the fresh group's: a second regroup
    # destroyed the group just made (helper-39, 5 of 5).
    left = "t = torch.full((1,), 100.0)\nif rank == 1:\n    work = dist.all_reduce(t, group=g, async_op=True)\n"
    fresh = "u = torch.ones(1) * (rank + 1)\ndist.all_reduce(u, group=g2)\nu.item()"
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        m.run("g = dist.new_group([0, 1])")
        with pytest.raises(MeshError) as caught:
            m.run(left + "raise ValueError('bad batch')", timeout=60)
        assert "the process group was re-created" in caught.value.hint, caught.value.hint
        assert m.run("g2 = dist.new_group([0, 1])\n" + fresh, timeout=60) == {0: 3.0, 1: 3.0}
        with pytest.raises(MeshError) as caught:
            m.run("dist.all_reduce(torch.ones(1), group=g)", timeout=60)
        assert not isinstance(caught.value, MeshTimeoutError) and not caught.value.hint, caught.value.hint
        assert m.run(fresh, timeout=60) == {0: 3.0, 1: 3.0}


def test_a_timed_out_cell_with_an_unmatched_collective_says_so_and_re_creates_the_group(tmp_path: Path) -> None:
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        with pytest.raises(MeshTimeoutError) as caught:
            m.run(asleep(ORPHAN, tmp_path), timeout=10)  # ample: the ranks reach their sleep at once
        hint = caught.value.hint  # shown under the cell's error in a notebook (_render_traceback_)
        assert SKEW.search(hint) and "the process group was re-created" in hint, hint
        assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}


def test_a_cell_that_raised_after_a_collective_in_flight_re_creates_the_group() -> None:
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        m.run(SUM)
        # No interrupt: both ranks raise, rank 1 with an all_reduce issued and never waited for.
        with pytest.raises(MeshError) as caught:
            m.run(ORPHAN + "raise ValueError('bad batch')", timeout=60)
        shown = "\n".join(caught.value._render_traceback_())  # what a notebook prints under the cell
        assert "bad batch" in shown and SKEW.search(shown) and "the process group was re-created" in shown, shown
        assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}  # before: 101.0 on rank 0, and rank 1 hung
        assert m.run("w.tolist()") == {0: [0.0], 1: [0.0]}  # namespaces kept
        # A cell that raised with the numbers in step leaves the group as it is.
        with pytest.raises(MeshError) as caught:
            m.run(SUM + "\nraise ValueError('after')", timeout=60)
        assert not caught.value.hint, caught.value.hint
        assert m.run("t.item()") == {0: 3.0, 1: 3.0}


def test_two_of_four_ranks_with_a_collective_in_flight_regroup_every_time() -> None:
    # Ranks 1 and 2 of a ring wait in the abandoned all_reduce on gloo's work thread; destroying their group joined
    # that thread, which never returned, so the fresh group never formed (at the first or second try before).
    left = "t = torch.ones(1) * (rank + 1)\nif rank in (1, 2):\n    w = dist.all_reduce(t, async_op=True)\n"
    with Mesh(4, start_timeout=60, interrupt_grace=5.0) as m:
        for _ in range(3):
            with pytest.raises(MeshError) as caught:
                m.run(left + "raise RuntimeError('boom')", timeout=WAIT)
            hint = caught.value.hint
            assert "ranks 1,2 issued" in hint and "the process group was re-created" in hint, hint
            assert m.run(SUM, timeout=60) == {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}


def test_an_interrupt_of_one_rank_is_judged_when_its_peers_end_the_cell(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    go = tmp_path / "go"
    marks = tmp_path / "marks"
    marks.mkdir()
    # Rank 1 leaves an all_reduce in flight and sleeps; rank 0 runs on until told, then ends the cell normally.
    code = (ORPHAN + f"import pathlib, time\npathlib.Path({str(marks)!r}, f'r{{rank}}').touch()\n"
            f"while rank == 1 or not pathlib.Path({str(go)!r}).exists():\n    time.sleep(0.05)\n'ok'")
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        for waited in (True, False):
            m.run(SUM)
            for p in marks.iterdir():
                p.unlink()
            go.unlink(missing_ok=True)
            handle = m.run(code, block=False)
            both_sleep(marks)
            report = m.interrupt(ranks=1)  # rank 0 still runs the cell: nothing can be judged yet
            assert report.interrupted == [1] and not report.realigned, report.text
            go.touch()
            if waited:  # the cell's own outcome says it
                with pytest.raises(KeyboardInterrupt) as caught:
                    handle.result(WAIT)
                assert SKEW.search(str(caught.value)) and "re-created" in str(caught.value), caught.value
                assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}
            else:  # nobody asked for its outcome: the next cell's note says it
                deadline = time.monotonic() + WAIT
                while not handle.done():
                    assert time.monotonic() < deadline
                    time.sleep(0.05)
                capsys.readouterr()
                assert m.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}
                err = capsys.readouterr().err
                assert SKEW.search(err) and "re-created" in err, err


def test_a_sub_mesh_with_an_unmatched_collective_regroups_alone(tmp_path: Path) -> None:
    with Mesh(4, start_timeout=WAIT, interrupt_grace=5.0) as m:
        a, b = m.split(2)
        handle = run_asleep(b, ORPHAN, tmp_path)
        other = a.run("import time\ntime.sleep(1)\n" + SUM, block=False)  # the other sub-mesh runs on meanwhile
        report = b.interrupt()
        assert report.interrupted == [2, 3], report.text
        assert re.search(r"rank 3 issued gloo:all_reduce #\d+, which rank 2 never issued", report.text), report.text
        assert handle.wait(WAIT)
        assert other.result(WAIT) == {0: 3.0, 1: 3.0}
        assert b.run(SUM, timeout=60) == {0: 3.0, 1: 3.0}
        m.merge()
        assert m.run(SUM, timeout=60) == {0: 10.0, 1: 10.0, 2: 10.0, 3: 10.0}


def summary(**groups: tuple[int, list[int]]) -> dict:
    """A ``last_collective()`` summary with these groups: name -> (its newest collective's number, its ranks)."""
    return {"source": "recorder", "groups": {g: [seq, ranks, "gloo:all_reduce"] for g, (seq, ranks) in groups.items()}}


def test_unmatched_compares_the_numbers_of_every_member_of_a_group() -> None:
    from monarch_jupyter.kernel.releases import unmatched

    same = summary(**{"0": (4, [0, 1])})
    assert unmatched({0: same, 1: same}, [0, 1]) == ""
    assert unmatched({0: same, 1: summary(**{"0": (5, [0, 1])})}, [0, 1]) == (
        "rank 1 issued gloo:all_reduce #5, which rank 0 never issued")
    # A rank that issued nothing on the group since it was made reports no entry: number 0.
    assert unmatched({0: {}, 1: summary(**{"0": (1, [0, 1])})}, [0, 1]).startswith("rank 1 issued")
    # A sub-mesh numbers its ranks 0..k-1: torch rank i of the group is the sub-mesh's i-th mesh rank.
    assert unmatched({2: summary(**{"0": (3, [0, 1])}), 3: summary(**{"0": (2, [0, 1])})}, [2, 3]) == (
        "rank 2 issued gloo:all_reduce #3, which rank 3 never issued")
    # A member that did not answer: no evidence, no judgement. A group of two of three ranks: the third is no member.
    assert unmatched({0: summary(**{"0": (5, [0, 1])})}, [0, 1]) == ""
    sub = summary(**{"0": (4, [0, 1, 2]), "1": (2, [0, 1])})
    assert unmatched({0: sub, 1: sub, 2: summary(**{"0": (4, [0, 1, 2])})}, [0, 1, 2]) == ""
    # A group's own count (no recorder entry since the group was made) holds send/recv: no evidence alone.
    counted = {"source": "sequence", "groups": {"0": [2, [0, 1, 2], "gloo:collective"]}}
    assert unmatched({0: counted, 1: {}, 2: {}}, [0, 1, 2]) == ""
    # A recorder whose ring buffer dropped entries since the group was made says nothing of a group it lacks.
    full = {**summary(**{"5": (900, [0])}), "complete": False}
    assert unmatched({0: full, 1: summary(**{"0": (3, [0, 1])})}, [0, 1]) == ""
    assert unmatched({0: {**summary(**{"0": (2, [0, 1])}), "complete": False}, 1: summary(**{"0": (3, [0, 1])})},
                     [0, 1]).startswith("rank 1 issued")
    # Every group out of step is named, not only the first (helper-39: rank 3's on a second group went unsaid).
    two = {0: summary(**{"1": (1, [0, 1])}), 1: summary(**{"1": (2, [0, 1])}),
           2: summary(**{"2": (1, [2, 3])}), 3: summary(**{"2": (2, [2, 3])})}
    assert unmatched(two, [0, 1, 2, 3]) == ("rank 1 issued gloo:all_reduce #2, which rank 0 never issued; "
                                            "rank 3 issued gloo:all_reduce #2, which rank 2 never issued")


def test_a_pruned_trial_that_left_a_collective_in_flight_hands_on_a_fresh_group(tmp_path: Path) -> None:
    optuna = pytest.importorskip("optuna")
    from monarch_jupyter import sweep

    # Trial 0: once rank 1 has an all_reduce in flight, rank 0 reports a loss the pruner stops at once. Trial 1 then
    # runs an all_reduce on the same ranks, which would pair with it (101.0 on rank 0, then a hang on rank 1).
    issued = str(tmp_path / "issued")
    pruned = ("from monarch_worker import progress\nimport time, os\n"
              "if rank == 1:\n    work = dist.all_reduce(torch.full((1,), 100.0), async_op=True)\n"
              f"    open({issued!r}, 'w').close()\n"
              f"else:\n    while not os.path.exists({issued!r}):\n        time.sleep(0.05)\n"
              "    progress(1, 10, loss=1e6)\ntime.sleep(600)")
    complete = "from monarch_worker import progress\n" + SUM.replace("t.item()",
                                                                  "progress(1, 1, loss=t.item())\nt.item()")

    def objective(trial: object, sub: object) -> float:
        trial.suggest_float("x", 0.0, 1.0)  # type: ignore[attr-defined]
        out = sub.run(complete if trial.number else pruned, timeout=WAIT)  # type: ignore[attr-defined]
        return float(out[0])

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(pruner=optuna.pruners.ThresholdPruner(upper=100.0))
    with Mesh(2, start_timeout=WAIT, interrupt_grace=5.0) as m:
        sweep(m, objective, study, n_trials=2, ranks_per_trial=2, report="loss")
        first, second = study.trials
        assert first.state.name == "PRUNED" and SKEW.search(first.user_attrs.get("regrouped", "")), first.user_attrs
        assert (second.state.name, second.value) == ("COMPLETE", 3.0), (second.state, second.value)
