"""The source of past cells in linecache (monarch_worker.executor.register_source / expire_source): a cell that
defines nothing able to run later keeps its lines only while it is among the newest ``KEPT_SOURCES`` such cells,
so a long session does not keep every cell's text; a cell that defines a function, class, lambda or generator keeps
them for the session."""

from __future__ import annotations

import linecache

import pytest

from monarch_jupyter.kernel.compiling import compile_cell
from monarch_worker import executor


@pytest.fixture
def kept(monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(executor, "KEPT_SOURCES", 3)
    return 3


def cell(tag: str, i: int, code: str) -> str:
    name = f"<test cell {tag} {i}>"
    compile_cell(code, name)
    return name


def test_only_the_newest_passing_cells_keep_their_lines(kept: int) -> None:
    names = [cell("passing", i, f"x = {i}\nprint(x)\n") for i in range(kept + 2)]
    assert [n in linecache.cache for n in names] == [False, False] + [True] * kept
    assert linecache.getline(names[-1], 2) == "print(x)\n"
    assert linecache.getline(names[0], 1) == ""


def test_cells_that_define_what_runs_later_keep_their_lines(kept: int) -> None:
    defining = [cell("defining", 0, "def f():\n    return 1\n"), cell("defining", 1, "class A:\n    pass\n"),
                cell("defining", 2, "g = lambda: 2\n"), cell("defining", 3, "it = (i for i in range(3))\n"),
                cell("defining", 4, "fs = [lambda: i for i in range(3)]\n")]
    comprehension = cell("defining", 5, "xs = [i * i for i in range(3)]\n")
    for i in range(kept + 1):
        cell("later", i, f"y = {i}\n")
    assert all(n in linecache.cache for n in defining)
    assert linecache.getline(defining[0], 2) == "    return 1\n"
    assert comprehension not in linecache.cache  # a list comprehension runs within its cell only


def test_a_name_registered_again_defining_a_function_is_kept(kept: int) -> None:
    name = cell("again", 0, "z = 1\n")
    cell("again", 0, "def z():\n    pass\n")  # the same name: a debugger's rerun of a cell
    for i in range(kept + 1):
        cell("again", i + 1, f"z = {i}\n")
    assert linecache.getline(name, 1) == "def z():\n"


def test_a_syntax_error_keeps_its_lines_for_its_message(kept: int) -> None:
    with pytest.raises(SyntaxError):
        compile_cell("x = (\n", "<test cell syntax 0>")
    for i in range(kept + 1):
        cell("syntax", i + 1, f"z = {i}\n")
    assert linecache.getline("<test cell syntax 0>", 1) == "x = (\n"
