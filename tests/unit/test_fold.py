"""Folding identical output lines of many ranks (output.fold_lines): identical lines become one, labelled with
their ranks; lines that differ in any byte never fold; each rank's own lines keep their order."""

from __future__ import annotations

from monarch_jupyter.kernel.output import fold_lines, label


def test_identical_lines_fold_with_their_ranks() -> None:
    lines = [(r, "stdout", "epoch 1 done") for r in range(64)]
    assert fold_lines(lines) == [(tuple(range(64)), "stdout", "epoch 1 done")]
    assert label(tuple(range(64))) == "[rank0-63]:"
    assert label((0, 2, 3, 4)) == "[rank0,2-4]:" and label(5) == "[rank5]:"
    assert fold_lines([]) == []  # a quiet cell's end


def test_lines_that_differ_or_change_streams_never_fold() -> None:
    lines = [(0, "stdout", "loss 0.25"), (1, "stdout", "loss 0.26"), (2, "stderr", "loss 0.25"),
             (3, "stdout", "loss 0.25 ")]
    assert fold_lines(lines) == lines


def test_each_rank_keeps_the_order_of_its_own_lines() -> None:
    lines = [(0, "stdout", "a"), (0, "stdout", "b"), (1, "stdout", "b"), (1, "stdout", "a"),
             (2, "stdout", "a"), (2, "stdout", "b")]
    out = fold_lines(lines)
    # rank 1 printed b before a: its "a" cannot join rank 0's earlier "a" line
    assert len(out) == 3 and ((0, 1, 2), "stdout", "b") in out
    for rank in (0, 1, 2):
        mine = [text for who, _, text in out if who == rank or (isinstance(who, tuple) and rank in who)]
        assert mine == [text for r, _, text in lines if r == rank]


def test_a_rank_repeating_a_line_is_not_folded_into_itself() -> None:
    lines = [(0, "stdout", "tick"), (0, "stdout", "tick"), (1, "stdout", "tick")]
    assert fold_lines(lines) == [((0, 1), "stdout", "tick"), (0, "stdout", "tick")]


def test_many_ranks_in_lockstep_fold_line_by_line() -> None:
    lines = [(r, "stdout", f"step {i}") for i in range(3) for r in range(16)]
    assert fold_lines(lines) == [(tuple(range(16)), "stdout", f"step {i}") for i in range(3)]


def test_a_common_line_waits_for_the_ranks_own_lines_before_it() -> None:
    lines = [(0, "stdout", "epoch 1 done"), (1, "stdout", "epoch 1 done"), (1, "stdout", "loss 1"),
             (1, "stdout", "epoch 2 done"), (0, "stdout", "loss 0"), (0, "stdout", "epoch 2 done")]
    assert fold_lines(lines) == [((0, 1), "stdout", "epoch 1 done"), (1, "stdout", "loss 1"),
                                 (0, "stdout", "loss 0"), ((0, 1), "stdout", "epoch 2 done")]
