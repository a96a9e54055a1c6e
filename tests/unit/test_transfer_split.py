"""Splitting for scatter, concatenating for gather, and the choice of route (pure functions)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from monarch_jupyter.kernel.transfer import choose_route, concat, split
from monarch_jupyter.ranks import RankMap
from monarch_worker import shm


@pytest.mark.parametrize("n,length", [(4, 10), (3, 3), (4, 17), (1, 5)])
def test_split_follows_tensor_split(n: int, length: int) -> None:
    t = torch.arange(length * 2).reshape(length, 2)
    parts = split("t", t, n, 0)
    expected = torch.tensor_split(t, n, 0)
    assert [p.shape for p in parts] == [e.shape for e in expected]
    assert all(torch.equal(p, e) for p, e in zip(parts, expected, strict=False))
    assert torch.equal(concat("t", RankMap(enumerate(parts)), 0), t)


def test_split_other_dims_numpy_and_lists() -> None:
    t = torch.arange(30.).reshape(3, 10)
    parts = split("t", t, 4, -1)
    assert [p.shape[1] for p in parts] == [3, 3, 2, 2]
    assert torch.equal(concat("t", RankMap(enumerate(parts)), 1), t)
    a = np.arange(21).reshape(7, 3)
    aparts = split("a", a, 3, 0)
    assert [len(p) for p in aparts] == [3, 2, 2]
    assert np.array_equal(concat("a", RankMap(enumerate(aparts)), 0), a)
    lparts = split("l", list(range(5)), 2, 0)
    assert lparts == [[0, 1, 2], [3, 4]]
    assert concat("l", RankMap(enumerate(lparts)), 0) == list(range(5))


def test_split_refuses_what_it_cannot_share_out() -> None:
    with pytest.raises(ValueError, match=r"3 element\(s\) along dim 0 .* for 4 ranks"):
        split("x", torch.ones(3, 5), 4, 0)
    with pytest.raises(ValueError, match="0-dim"):
        split("x", torch.tensor(1.0), 2, 0)
    with pytest.raises(ValueError, match="out of range"):
        split("x", torch.ones(4), 2, 1)
    with pytest.raises(TypeError, match="cannot split a builtins.dict"):
        split("x", {"a": 1}, 2, 0)


def test_split_of_a_grad_tensor_detaches() -> None:
    t = torch.ones(4, requires_grad=True)
    assert not any(p.requires_grad for p in split("t", t, 2, 0))


def test_concat_reports_each_rank() -> None:
    with pytest.raises(ValueError, match=r"rank 0: \(2, 3\), rank 1: \(2, 4\)"):
        concat("x", RankMap({0: torch.ones(2, 3), 1: torch.ones(2, 4)}), 0)
    with pytest.raises(TypeError, match="rank 1: builtins.str"):
        concat("x", RankMap({0: torch.ones(2), 1: "two"}), 0)
    with pytest.raises(ValueError, match="0-dim"):
        concat("x", RankMap({0: torch.tensor(1.0), 1: torch.tensor(2.0)}), 0)


def test_concat_large_output_is_a_regular_tensor() -> None:
    parts = RankMap({r: torch.full((1 << 18,), r, dtype=torch.bfloat16) for r in range(4)})
    out = concat("x", parts, 0)
    assert out.dtype == torch.bfloat16 and out.shape == (1 << 20,)
    assert out[0] == 0 and out[-1] == 3 and out.is_contiguous()
    mixed = RankMap({0: torch.ones(1 << 20), 1: torch.ones(1 << 20, dtype=torch.float64)})
    assert concat("x", mixed, 0).dtype == torch.float64  # type promotion as torch.cat does


def test_route_choice() -> None:
    big, small = shm.SHM_THRESHOLD, shm.SHM_THRESHOLD - 1
    assert choose_route(small, 4, True) == "socket"
    assert choose_route(big, 4, True) == "shm"
    assert choose_route(big, 1, True) == "shm"
    assert choose_route(big, 4, False) == "broadcast"
    assert choose_route(big, 2, False) == "socket"
    assert choose_route(small, 8, False) == "socket"
    assert choose_route(small, 4, True, via="broadcast") == "broadcast"
