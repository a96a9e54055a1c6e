"""The example a refused split gives fits the mesh it was refused for (helper-49: "%mesh split 3" on 2 ranks
suggested m.split([[0, 1], [2, 3]]), and rank 3 does not exist)."""

from __future__ import annotations

import pytest

from monarch_jupyter.kernel.submesh import partition
from monarch_jupyter.ranks import parse_ranks


@pytest.mark.parametrize("nproc,spec", [(2, 3), (4, 3), (6, 4), (7, 2), (64, 5)])
def test_the_example_of_a_refused_split_is_a_valid_split_of_this_mesh(nproc: int, spec: int) -> None:
    with pytest.raises(ValueError) as info:
        partition(spec, nproc)
    text = str(info.value)
    python = eval(text.split("m.split(", 1)[1].split(")  or", 1)[0])  # noqa: S307 - our own message
    assert partition(python, nproc) == python  # accepted as it is
    magic = text.rsplit("%mesh split ", 1)[1].split()
    assert [parse_ranks(g, nproc) for g in magic] == python  # the magic's form names the same groups


def test_a_single_rank_mesh_says_it_cannot_split() -> None:
    with pytest.raises(ValueError, match="a mesh of 1 rank does not split: start one of 2 or more ranks"):
        partition(2, 1)
