"""Rank selections, the one way rank lists are written, and per-rank results.

Every message, report and view names ranks through ``format_ranks`` ("0,1,3", "0-7", "0,2-5") or its phrase form
``ranks_text`` ("rank 2", "ranks 0-3"), so a rank list reads the same wherever it appears.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from typing import Any

__all__ = ["parse_ranks", "chosen_ranks", "RankMap", "format_ranks", "plural", "ranks_text"]


def chosen_ranks(spec: str | int | Iterable[int] | None, world_size: int) -> Sequence[int]:
    """``parse_ranks``, but every rank (``spec`` None or "all") as ``range(world_size)``: a cell sent to the whole
    mesh makes no list of its ranks (at 4,096 ranks that list and its sort were a tenth of the controller's CPU per
    cell). Raises as ``parse_ranks`` does."""
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _EVERY):
        return range(world_size)
    return parse_ranks(spec, world_size)


_EVERY = ("all", "*")
_FORMS = "None or 'all' (every rank), an int, a string such as '0,2', '1-3' or '::2', or a list of ints"


def parse_ranks(spec: str | int | Iterable[int] | None, world_size: int) -> list[int]:
    """Turn a rank selection into a sorted list of ranks.

    ``spec`` is None or "all" (any case: every rank), an int, an iterable of ints, or a string of comma-separated parts,
    each ``R`` (one rank), ``A-B`` (inclusive range) or a Python slice ``start:stop:step`` (``::2`` = even ranks).

    Raises
    ------
    TypeError
        ``spec`` is none of these (a float, a bool, a list holding something other than ints).
    ValueError
        The string does not parse (an empty part: "", "0,,1"), names a rank outside ``0..world_size-1``, or
        selects no rank.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in _EVERY):
        return list(range(world_size))
    ranks: set[int] = set()
    if isinstance(spec, str):
        for part in spec.replace(" ", "").split(","):
            try:
                if not part:
                    raise ValueError
                if ":" in part:
                    bits = [int(b) if b else None for b in part.split(":")]
                    if len(bits) > 3:
                        raise ValueError
                    ranks.update(range(world_size)[slice(*bits)])
                elif "-" in part[1:]:
                    a, b = part.split("-", 1)
                    lo, hi = int(a), int(b)
                    if hi < lo:
                        raise ValueError
                    ranks.update(range(lo, hi + 1))
                else:
                    ranks.add(int(part))
            except ValueError:
                raise ValueError(
                    f"cannot parse rank selection {spec!r} (part {part!r}); use e.g. 0  or  0,2  or  1-3  or  ::2, "
                    "or 'all'") from None
    elif _is_int(spec) or not isinstance(spec, Iterable) or isinstance(spec, (bytes, bytearray)):
        ranks.add(_rank(spec, spec))  # a 0-dim tensor is an Iterable whose iteration fails
    else:
        for r in spec:
            ranks.add(_rank(r, spec))
    bad = sorted(r for r in ranks if not 0 <= r < world_size)
    if bad:
        raise ValueError(f"{ranks_text(bad)} not in this mesh of world size {world_size} (ranks 0..{world_size - 1})")
    if not ranks:
        raise ValueError(f"rank selection {spec!r} selects no rank of a mesh of world size {world_size}")
    return sorted(ranks)


def _is_int(value: Any) -> bool:
    """An int as ``operator.index`` takes it (numpy's, a 0-dim integer tensor), not a bool."""
    if isinstance(value, bool):
        return False
    try:
        operator.index(value)
    except TypeError:
        return False
    return True


def _rank(value: Any, spec: Any) -> int:
    """One rank of a selection: an int (numpy's and a 0-dim integer tensor's too: ``operator.index``), not a bool
    or a float. Raises TypeError naming the forms a selection takes."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    where = "" if value is spec else f" (in {spec!r})"
    raise TypeError(f"a rank is an int, got {value!r} ({type(value).__name__}){where}; ranks are {_FORMS}")


def format_ranks(ranks: Iterable[int]) -> str:
    """Ranks as read aloud: [0, 1, 3] -> "0,1,3"; runs of three or more as ranges: "0-7", "0,2-5"."""
    rs = sorted(set(ranks))
    parts: list[str] = []
    i = 0
    while i < len(rs):
        j = i
        while j + 1 < len(rs) and rs[j + 1] == rs[j] + 1:
            j += 1
        parts += [f"{rs[i]}-{rs[j]}"] if j - i >= 2 else [str(r) for r in rs[i:j + 1]]
        i = j + 1
    return ",".join(parts)


def ranks_text(ranks: Iterable[int]) -> str:
    """"rank 2" or "ranks 0,1,3": ``format_ranks`` with the word in front, singular or plural."""
    rs = sorted(set(ranks))
    return f"rank{'s' if len(rs) != 1 else ''} {format_ranks(rs)}"


def n_ranks(n: int) -> str:
    """``n`` with its noun: "1 rank", "4 ranks"."""
    return f"{n} rank{'' if n == 1 else 's'}"


def plural(ranks: Iterable[int], many: str, one: str) -> str:
    """``one`` when ``ranks`` holds one rank, else ``many``: the words that follow ``ranks_text(ranks)``."""
    return one if len(set(ranks)) == 1 else many


class RankMap(dict):
    """Per-rank values: a dict keyed by rank, in rank order (the ValueMesh idea of torchmonarch).

    Printed like a dict, ranks in increasing order (``text/plain``, stable for saved notebooks). In Jupyter, values
    with a rich repr (DataFrames, images, figures from ranks) also get an HTML view: each rank's rich repr, or one
    of them under "all N ranks equal" when every value is equal. Indexing gives the raw values.
    """

    def __init__(self, items: Iterable[tuple[int, Any]] | dict = ()) -> None:
        pairs = list(items.items() if isinstance(items, dict) else items)
        if any(pairs[i][0] > pairs[i + 1][0] for i in range(len(pairs) - 1)):
            pairs = sorted(dict(pairs).items())
        super().__init__(pairs)

    @property
    def ranks(self) -> list[int]:
        return list(self.keys())

    def _repr_pretty_(self, p: Any, cycle: bool) -> None:
        if cycle:
            p.text("RankMap(...)")
            return
        with p.group(1, "{", "}"):
            for i, (k, v) in enumerate(self.items()):
                if i:
                    p.text(",")
                    p.breakable()
                p.pretty(k)
                p.text(": ")
                p.pretty(v)

    def _repr_html_(self) -> str | None:
        from .richrepr import rankmap_html

        return rankmap_html(self, ranks_text(self.keys()))
