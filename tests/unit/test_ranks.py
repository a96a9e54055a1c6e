"""Rank selections and per-rank results."""

from __future__ import annotations

import pytest

from monarch_jupyter.ranks import RankMap, chosen_ranks, format_ranks, parse_ranks, ranks_text


@pytest.mark.parametrize(
    "spec, expected",
    [(None, [0, 1, 2, 3]), ("all", [0, 1, 2, 3]), ("0", [0]), (2, [2]), ("0,2", [0, 2]), ("1-3", [1, 2, 3]),
     ("::2", [0, 2]), ("1::2", [1, 3]), ("0, 3", [0, 3]), ([3, 1], [1, 3]), ("0-1,3", [0, 1, 3])],
)
def test_parse(spec: object, expected: list[int]) -> None:
    assert parse_ranks(spec, 4) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["4", "0-9", "x", "3-1", "1:2:3:4", [7]])
def test_parse_errors_name_the_problem(spec: object) -> None:
    with pytest.raises(ValueError, match="rank"):
        parse_ranks(spec, 4)  # type: ignore[arg-type]


@pytest.mark.parametrize("spec", ["", "0,,1", "0,1,", " , "])
def test_an_empty_part_is_refused_not_read_as_every_rank(spec: str) -> None:
    with pytest.raises(ValueError, match="cannot parse rank selection .*'all'"):
        parse_ranks(spec, 4)


@pytest.mark.parametrize("spec", [1.5, True, [0, 1.0], [0, False], b"01", object()])
def test_a_selection_of_the_wrong_type_names_the_forms_it_takes(spec: object) -> None:
    with pytest.raises(TypeError, match=r"a rank is an int, got .*; ranks are None or 'all'"):
        parse_ranks(spec, 4)  # type: ignore[arg-type]


def test_integers_of_numpy_and_torch_are_ranks() -> None:
    np = pytest.importorskip("numpy")
    torch = pytest.importorskip("torch")
    assert parse_ranks(np.int64(2), 4) == [2] and parse_ranks(np.array([3, 1]), 4) == [1, 3]
    assert parse_ranks(torch.tensor([0, 2]), 4) == [0, 2] and parse_ranks(range(1, 3), 4) == [1, 2]
    assert parse_ranks(torch.tensor(3), 4) == [3]  # 0-dim: an Iterable whose iteration fails
    assert parse_ranks(" ALL ", 2) == [0, 1] and chosen_ranks("All", 3) == range(3)


def test_every_rank_is_chosen_as_a_range_without_a_list() -> None:
    assert chosen_ranks(None, 4096) == range(4096) and chosen_ranks("all", 3) == range(3)
    assert chosen_ranks("1-2", 4) == [1, 2]  # any other selection: parse_ranks's sorted list
    with pytest.raises(ValueError, match="rank 9"):
        chosen_ranks(9, 4)


def test_format_reads_aloud() -> None:
    assert format_ranks([0, 1, 2, 5, 7, 8]) == "0-2,5,7,8"  # runs of three or more become ranges
    assert format_ranks([3, 0, 1]) == "0,1,3"
    assert format_ranks([]) == ""
    assert ranks_text([2]) == "rank 2" and ranks_text([0, 1, 2, 3]) == "ranks 0-3"


def test_rankmap_orders_by_rank() -> None:
    m = RankMap({2: "c", 0: "a", 1: "b"})
    assert list(m) == [0, 1, 2]
    assert m.ranks == [0, 1, 2]
    assert m == {0: "a", 1: "b", 2: "c"}
