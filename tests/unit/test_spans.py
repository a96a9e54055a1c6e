"""RankSpans (kernel/spans.py): the ranges a cell's records keep ranks in behave as the set of those ranks."""

from __future__ import annotations

import random

from monarch_jupyter.kernel.spans import RankSpans, contiguous


def test_rank_spans_behave_as_a_set_under_random_operations() -> None:
    rng = random.Random(7)
    for _ in range(200):
        spans, model = RankSpans(), set()
        for _ in range(30):
            op = rng.random()
            if op < 0.4:  # a host's ranks: a contiguous run
                a = rng.randrange(64)
                run = list(range(a, a + rng.randrange(1, 9)))
                spans.update(run)
                model.update(run)
            elif op < 0.6:  # scattered ranks, unsorted
                some = rng.sample(range(64), rng.randrange(1, 6))
                spans.update(some)
                model.update(some)
            elif op < 0.8:
                r = rng.randrange(64)
                spans.discard(r)
                model.discard(r)
            else:
                r = rng.randrange(64)
                spans.add(r)
                model.add(r)
            assert list(spans) == sorted(model) and len(spans) == len(model)
            assert all((r in spans) == (r in model) for r in range(-1, 66))
            starts = [a for a, _ in spans.ranges()]
            stops = [b for _, b in spans.ranges()]
            assert all(stops[i] < starts[i + 1] for i in range(len(starts) - 1)), "ranges merged where they touch"
        members = RankSpans.of_sorted(sorted(rng.sample(range(64), rng.randrange(0, 64))))
        missing = [r for r in members if r not in model]
        assert members.without(spans) == missing
        assert members.first_not_in(spans) == (missing[0] if missing else None)


def test_contiguous_needs_sorted_unique_runs() -> None:
    assert contiguous([3, 4, 5]) and contiguous(range(2, 9)) and contiguous([])
    assert not contiguous([3, 5, 4]) and not contiguous([3, 3, 5]) and not contiguous([0, 2])
    assert RankSpans([5, 3, 4, 9]) == {3, 4, 5, 9}
    assert RankSpans.of_sorted(list(range(4096))).ranges() == [(0, 4096)]


def test_span_of_finds_a_run_in_any_order_and_refuses_gaps_and_repeats() -> None:
    from monarch_jupyter.kernel.spans import span_of

    assert span_of([4, 5, 6]) == range(4, 7)
    assert span_of([6, 4, 5]) == range(4, 7)  # a host's ranks in the order they finished
    assert span_of(range(3, 9)) == range(3, 9) and span_of([7]) == range(7, 8)
    assert span_of([]) is None and span_of(range(0, 8, 2)) is None
    assert span_of([4, 6, 6]) is None  # right length and ends, a repeat
    assert span_of([4, 5, 5, 7]) is None and span_of([6, 4, 4]) is None and span_of([0, 2]) is None
